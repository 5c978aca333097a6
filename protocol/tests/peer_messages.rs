//! A `Peer` fed arbitrary sequences of messages from arbitrary keys (the deterministic run of
//! the `peer_messages` fuzz target): no input panics it (overflow checks are on in tests), and
//! what it keeps stays bounded however long the input.

#![allow(clippy::unwrap_used, missing_docs)]

#[path = "support/alloc.rs"]
mod alloc;
#[path = "support/exercise.rs"]
mod exercise;

use exercise::Exercise;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }
}

#[test]
fn arbitrary_message_sequences_never_panic_a_peer() {
    let mut rng = Rng(0x5eed_feed);
    let mut violations = 0;
    for i in 0..2_000 {
        let len = (rng.next() % 3_000) as usize;
        let input = rng.bytes(len);
        let mut e = Exercise::new((i % 2) as u32, i % 3 == 0);
        e.run(&input);
        violations += e.violations;
    }
    // The inputs reach the role checks, not only the decoders.
    assert!(violations > 1_000, "{violations} violations");
}

#[test]
fn a_long_stream_of_hostile_messages_keeps_memory_bounded() {
    for (stage, diloco) in [(0, false), (1, false), (1, true)] {
        let mut e = Exercise::new(stage, diloco);
        let mut rng = Rng(0xbad_c0de ^ stage as u64);
        let before = alloc::live();
        let mut peak = 0;
        let mut after_first = 0;
        for chunk in 0..200 {
            let input = rng.bytes(20_000);
            let start = alloc::live().saturating_sub(before);
            let ((), p) = alloc::peak_of(|| e.run(&input));
            peak = peak.max(start + p);
            if chunk == 19 {
                after_first = alloc::live().saturating_sub(before);
            }
        }
        let end = alloc::live().saturating_sub(before);
        eprintln!("{}", e.summary());
        eprintln!(
            "stage {stage} diloco {diloco}: live {after_first} B after 400 KB of input, \
             {end} B after 4 MB, peak {peak} B"
        );
        // What a peer keeps for other peers is capped (members, held forwards, early round
        // messages, exports, catch-ups); with this toy stage the caps come to under a megabyte.
        assert!(peak < 8 << 20, "peak {peak} bytes");
        assert!(end < 4 << 20, "live {end} bytes");
    }
}
