//! shoal-node: the network layer of the `shoal` binary, as a library so that tests and tools
//! can run real nodes in-process.
//!
//! This crate drives the protocol and compute crates with real IO: libp2p, QUIC streams,
//! threads, the clock, the terminal. It must never hold protocol decisions of its own (those
//! live in `shoal-protocol`), never panic on network input, and never let a peer make it hold
//! unbounded memory: every queue and buffer fed from the network has a cap.

pub mod net;
