//! A `Peer` fed arbitrary sequences of messages from arbitrary keys, with time passing, compute
//! jobs completing and peers vanishing in between (see `tests/support/exercise.rs`, whose
//! bounded deterministic run is `tests/peer_messages.rs`): never a panic. Run with
//! `-malloc_limit_mb=64` to hold it to bounded memory.
#![no_main]

#[allow(dead_code)]
#[path = "../../tests/support/exercise.rs"]
mod exercise;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (&first, rest) = data.split_first().unwrap_or((&0, &[]));
    let mut e = exercise::Exercise::new(u32::from(first & 1), first & 2 != 0);
    e.run(rest);
});
