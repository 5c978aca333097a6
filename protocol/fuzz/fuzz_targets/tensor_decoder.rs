//! Tensor messages from arbitrary bytes: `Ok` or a typed error, never a panic, and never an
//! allocation beyond the decoder's element cap. The checksum is recomputed for every input (as
//! an attacker would), so the fuzzer explores the payload parsers behind it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shoal_protocol::Decoder;
use shoal_protocol::codec::TENSOR_HEADER_LEN;
use xxhash_rust::xxh3::xxh3_64;

fuzz_target!(|data: &[u8]| {
    let mut message = data.to_vec();
    if message.len() >= TENSOR_HEADER_LEN {
        let sum = xxh3_64(&message[TENSOR_HEADER_LEN..]);
        message[28..36].copy_from_slice(&sum.to_le_bytes());
    }
    let mut decoder = Decoder::with_max_elements(1 << 20);
    let mut out = Vec::new();
    if let Ok(header) = decoder.decode(&message, &mut out) {
        assert_eq!(out.len(), header.shape.numel());
    }
});
