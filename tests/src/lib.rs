//! shoal-tests: behaviour across crates, tested end to end.
//!
//! The tests live in `tests/tests/`: training outcomes on the built-in corpus, and (as the
//! network and simulator land) multi-process swarms on loopback and netsim scenarios. This
//! crate exports nothing; it must never be a dependency of another crate, and its tests assert
//! outcomes a user would care about (the loss fell, the peer recovered, the bytes match), never
//! wall-clock timings.
