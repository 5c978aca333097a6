//! Tensor messages from arbitrary bytes: `Ok` or a typed error, never a panic, and never an
//! allocation beyond the decoder's element cap.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shoal_protocol::Decoder;

fuzz_target!(|data: &[u8]| {
    let mut decoder = Decoder::with_max_elements(1 << 20);
    let mut out = Vec::new();
    if let Ok(header) = decoder.decode(data, &mut out) {
        assert_eq!(out.len(), header.shape.numel());
    }
});
