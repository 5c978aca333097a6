//! Hostile input: the frame and tensor decoders each get 100,000 random and mutated inputs
//! (truncated, bit-flipped, length fields at and beyond their caps). Every input must give
//! `Ok` or a typed error, never a panic, and no call may allocate more than the caps allow.

#![allow(clippy::unwrap_used, missing_docs)]

use serde::{Deserialize, Serialize};
use shoal_protocol::codec::{Decoder, Encoder, TENSOR_HEADER_LEN};
use shoal_protocol::wire::{
    FRAME_HEADER_LEN, FrameLimits, decode_control, read_frame, write_control,
};
use shoal_protocol::{Codec, ValueFormat};
use xxhash_rust::xxh3::xxh3_64;

#[allow(dead_code)] // `live` is for other tests
#[path = "support/alloc.rs"]
mod alloc;
use alloc::peak_of;

struct Fuzz(u64);

impl Fuzz {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }

    /// Mutates a valid message the ways an attacker or a broken link would.
    fn mutate(&mut self, valid: &[u8], len_fields: &[usize], caps: &[u32]) -> Vec<u8> {
        let mut m = valid.to_vec();
        match self.below(5) {
            0 => m.truncate(self.below(valid.len() + 1)),
            1 => {
                for _ in 0..1 + self.below(8) {
                    if !m.is_empty() {
                        let i = self.below(m.len());
                        m[i] ^= 1 << self.below(8);
                    }
                }
            }
            2 => {
                // A length or count field at a boundary value.
                let at = len_fields[self.below(len_fields.len())];
                let cap = caps[self.below(caps.len())];
                let v = [
                    0,
                    1,
                    cap.saturating_sub(1),
                    cap,
                    cap.saturating_add(1),
                    u32::MAX,
                ][self.below(6)];
                if at + 4 <= m.len() {
                    m[at..at + 4].copy_from_slice(&v.to_le_bytes());
                }
            }
            3 => {
                let len = 1 + self.below(64);
                let extra = self.bytes(len);
                m.extend_from_slice(&extra);
            }
            _ => {
                let i = self.below(m.len() + 1);
                let len = self.below(16);
                let junk = self.bytes(len);
                m.splice(i..i, junk);
            }
        }
        m
    }
}

const INPUTS: usize = 100_000;

#[test]
fn tensor_decoder_survives_hostile_input() {
    let max_elements = 1 << 16;
    let mut fuzz = Fuzz(0x5eed);
    let mut encoder = Encoder::new();
    let codecs = [
        Codec::Fp32,
        Codec::Fp16,
        Codec::Bf16,
        Codec::Int8 { block: 16 },
        Codec::TopK {
            ppm: 100_000,
            values: ValueFormat::Fp16,
        },
        Codec::TopK {
            ppm: 300_000,
            values: ValueFormat::Int8,
        },
        Codec::LowBit { bits: 4, block: 16 },
        Codec::LowBit { bits: 2, block: 8 },
        Codec::ChunkTopK {
            k: 5,
            chunk: 64,
            bits: 2,
        },
        Codec::ChunkTopK {
            k: 16,
            chunk: 16,
            bits: 4,
        },
    ];
    let mut valid = Vec::new();
    for (i, &codec) in codecs.iter().enumerate() {
        for len in [0usize, 1, 7, 100, 2000] {
            let x: Vec<f32> = (0..len)
                .map(|j| ((i * 31 + j * 7) % 19) as f32 - 9.0)
                .collect();
            let mut out = Vec::new();
            encoder.encode(codec, &x, &[len], &mut out).unwrap();
            valid.push(out);
        }
    }
    for (i, codec) in ["sub:1:int8", "sub:4:int4:8", "sub:8:int2:16"]
        .iter()
        .enumerate()
    {
        let codec: Codec = codec.parse().unwrap();
        for rows in [1usize, 3, 40] {
            let x: Vec<f32> = (0..rows * 64)
                .map(|j| ((i * 31 + j * 7) % 19) as f32 - 9.0)
                .collect();
            let mut out = Vec::new();
            encoder.encode(codec, &x, &[rows, 64], &mut out).unwrap();
            valid.push(out);
        }
    }
    // Header offsets of the u32 fields: codec parameter, four dims, payload length.
    let len_fields = [
        4,
        8,
        12,
        16,
        20,
        24,
        TENSOR_HEADER_LEN + 1,
        TENSOR_HEADER_LEN + 5,
    ];
    let caps = [max_elements as u32, 1 << 28, 1 << 16];
    let mut decoder = Decoder::with_max_elements(max_elements);
    let mut out = Vec::new();
    // Warm up: the zstd context and the output buffer exist before measuring.
    for v in &valid {
        decoder.decode(v, &mut out).unwrap();
    }
    let (mut ok, mut errors, mut worst) = (0, 0, 0usize);
    let mut kinds = std::collections::BTreeMap::new();
    for i in 0..INPUTS {
        let input = if i % 4 == 0 {
            let len = fuzz.below(300);
            fuzz.bytes(len)
        } else {
            let v = &valid[fuzz.below(valid.len())];
            let mut m = fuzz.mutate(v, &len_fields, &caps);
            // An attacker recomputes the checksum: half the mutants get a valid one, so the
            // payload parsers behind the checksum are exercised too.
            if i % 2 == 1 && m.len() >= TENSOR_HEADER_LEN {
                let sum = xxh3_64(&m[TENSOR_HEADER_LEN..]);
                m[28..36].copy_from_slice(&sum.to_le_bytes());
            }
            m
        };
        let (result, peak) = peak_of(|| decoder.decode(&input, &mut out));
        match result {
            Ok(h) => {
                ok += 1;
                assert_eq!(out.len(), h.shape.numel());
            }
            Err(e) => {
                errors += 1;
                let kind = format!("{e:?}");
                *kinds
                    .entry(kind.split([' ', '(']).next().unwrap_or("").to_owned())
                    .or_insert(0) += 1;
            }
        }
        worst = worst.max(peak);
    }
    eprintln!("tensor decoder errors by kind: {kinds:?}");
    // Errors from behind the checksum were reached too.
    assert!(kinds.contains_key("BadIndices") && kinds.contains_key("Truncated"));
    // The output (4 bytes a value) and the index stream (at most 5 bytes a value) are all a
    // message can make the decoder allocate.
    let cap = 9 * max_elements;
    eprintln!(
        "tensor decoder: {ok} ok, {errors} rejected, peak allocation {worst} bytes (cap {cap})"
    );
    assert!(errors > INPUTS / 2 && ok > 100);
    assert!(
        worst <= cap,
        "a decode allocated {worst} bytes, above {cap}"
    );
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
enum TestMessage {
    Announce {
        peer: String,
        stages: Vec<u32>,
        throughput: f64,
    },
    Ledger(Vec<(u64, Option<String>)>),
    Nested(Vec<Vec<u8>>),
}

#[test]
fn frame_decoder_survives_hostile_input() {
    let limits = FrameLimits {
        max_control_len: 4096,
        max_tensor_len: 1 << 16,
    };
    let mut fuzz = Fuzz(0xf4a3e);
    let messages = [
        TestMessage::Announce {
            peer: "12D3KooW".into(),
            stages: vec![0, 2, 5],
            throughput: 1e3,
        },
        TestMessage::Ledger(vec![
            (1, None),
            (2, Some("dropped".into())),
            (u64::MAX, None),
        ]),
        TestMessage::Nested(vec![vec![1, 2, 3], vec![], vec![9; 200]]),
    ];
    let valid: Vec<Vec<u8>> = messages
        .iter()
        .map(|m| {
            let mut out = Vec::new();
            write_control(m, &limits, &mut out).unwrap();
            let (_, payload) = read_frame(&out, &limits).unwrap();
            assert_eq!(&decode_control::<TestMessage>(payload).unwrap(), m);
            out
        })
        .collect();
    let len_fields = [4, 8, FRAME_HEADER_LEN + 1, FRAME_HEADER_LEN + 2];
    let caps = [limits.max_control_len, limits.max_tensor_len];
    let (mut ok, mut errors, mut worst) = (0, 0, 0usize);
    for i in 0..INPUTS {
        let input = if i % 4 == 0 {
            let len = fuzz.below(200);
            let mut b = fuzz.bytes(len);
            if b.len() >= 4 && fuzz.below(2) == 0 {
                b[..4].copy_from_slice(b"SHOL");
            }
            b
        } else {
            let v = &valid[fuzz.below(valid.len())];
            fuzz.mutate(v, &len_fields, &caps)
        };
        let (result, peak) = peak_of(|| {
            let (_, payload) = read_frame(&input, &limits)?;
            decode_control::<TestMessage>(payload)
        });
        match result {
            Ok(_) => ok += 1,
            Err(e) => {
                errors += 1;
                assert!(!e.to_string().is_empty());
            }
        }
        worst = worst.max(peak);
    }
    // postcard reads from the payload: no message can make it hold more than a small multiple
    // of the payload (strings and vectors of at most that many bytes, plus error text).
    let cap = 8 * limits.max_control_len as usize;
    eprintln!(
        "frame decoder: {ok} ok, {errors} rejected, peak allocation {worst} bytes (cap {cap})"
    );
    assert!(errors > INPUTS / 2 && ok > 100);
    assert!(
        worst <= cap,
        "a decode allocated {worst} bytes, above {cap}"
    );
}

/// Regression: a top-k message of a few dozen bytes claiming k values and a zstd index stream
/// of 5 bytes per value made the decoder reserve that stream (5 x its element cap) before it
/// saw that the values were not there. Now nothing beyond the output tensor is allocated
/// before the layout is checked against the bytes present.
#[test]
fn a_tiny_top_k_message_cannot_make_the_decoder_reserve_much() {
    const N: u32 = 1 << 20;
    let mut payload = vec![1u8];
    payload.extend_from_slice(&(5 * N).to_le_bytes()); // decompressed index stream
    payload.extend_from_slice(&4u32.to_le_bytes()); // stored index stream
    payload.extend_from_slice(&[0x28, 0xb5, 0x2f, 0xfd]); // a zstd magic, then nothing
    let mut m = vec![0u8; TENSOR_HEADER_LEN];
    m[1] = 4; // top-k
    m[2] = 1; // int8 values
    m[3] = 1; // one dimension
    m[4..8].copy_from_slice(&N.to_le_bytes()); // k
    m[8..12].copy_from_slice(&N.to_le_bytes());
    m[24..28].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    m[28..36].copy_from_slice(&xxh3_64(&payload).to_le_bytes());
    m.extend_from_slice(&payload);
    assert!(m.len() < 64);
    let mut decoder = Decoder::with_max_elements(N as usize);
    let mut out = Vec::new();
    let (result, peak) = peak_of(|| decoder.decode(&m, &mut out));
    assert!(result.is_err());
    let output = 4 * N as usize;
    assert!(
        peak <= output + (64 << 10),
        "{peak} bytes allocated for a {}-byte message (the output alone is {output})",
        m.len()
    );
}
