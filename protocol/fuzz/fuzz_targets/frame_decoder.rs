//! Frames and control messages from arbitrary bytes: `Ok` or a typed error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde::Deserialize;
use shoal_protocol::wire::{FrameLimits, decode_control, read_frame};

/// A control message shape with the constructs real messages use.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
enum Message {
    Announce { peer: String, stages: Vec<u32>, throughput: f64 },
    Ledger(Vec<(u64, Option<String>)>),
    Nested(Vec<Vec<u8>>),
}

fuzz_target!(|data: &[u8]| {
    let limits = FrameLimits { max_control_len: 1 << 16, max_tensor_len: 1 << 20 };
    if let Ok((_, payload)) = read_frame(data, &limits) {
        let _ = decode_control::<Message>(payload);
    }
});
