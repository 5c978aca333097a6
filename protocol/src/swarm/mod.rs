//! The training protocol: how peers that nobody coordinates train one model together.
//!
//! Every peer runs one [`Peer`] machine for the stage it serves. The owner (the node with real
//! sockets and a compute thread, or the simulator with modelled links and devices) feeds it
//! what happened — a message from a peer, a finished compute job, the passing of time — and
//! drains the [`Action`]s it wants performed: send this message, run this compute job,
//! announce this. The machine never blocks, reads no clock and draws randomness only from the
//! seed it was given, so the same inputs always give the same decisions.
//!
//! The shared pieces, each testable on its own:
//! * [`config`]: the run's configuration, chosen by its creator; its hash is the run id.
//! * [`message`]: what peers say to each other.
//! * [`membership`]: who serves which stage how fast, learned from gossip, and each
//!   replica's recent parameter hashes; routing weights.
//! * [`placement`]: the stage a joiner takes, and rebalancing moves.
//! * `service.rs` (`Service`): the next stage's replicas as this peer times them; a replica
//!   that answers far later than its stage's typical time loses routing weight, whatever it
//!   announces.
//! * [`links`]: the rate and round trip this peer measured to each peer it sends to, and the
//!   codec each stage-boundary hop goes out in (light where the link keeps pace with the
//!   device, strong where it does not).
//! * [`ledger`]: the data driver's record of every microbatch in flight: deadlines, retries,
//!   at-most-once commit.
//! * [`averaging`]: one fault-tolerant, compressed reduce-scatter/all-gather round among the
//!   replicas of a stage.
//! * [`bans`]: accusations from a stage's own replicas, and bans once a majority accuses.
//! * [`claims`]: the samples a replica's averaging shares claim, checked against what the
//!   replicas it worked with (its witnesses) say it committed; a claim beyond the routes
//!   weighs what they carried.
//! * [`robust`]: the centered-clipping mean an averaging round's part owner computes, so
//!   that no replica steers a part by more than the honest replicas' spread.
//! * [`transfer`]: a joiner's download of a stage's state: hash-checked chunks pulled from
//!   several replicas at once, with deadlines by progress (the replicas' side, snapshots
//!   and the chunks cut from them, is `exports.rs`).
//!
//! The [`peer`] is a thin composition of five parts, each a small state machine that owns its
//! state and deadlines and has unit tests of its own rules (the whole-swarm tests in `tests.rs`
//! drive them together):
//! * `role.rs` (`Role`): choosing a stage, syncing its state, serving it, moving to another
//!   stage (rebalancing);
//! * `driver.rs` (`Driver`): a first-stage replica starting microbatches: the window in
//!   flight, its share of each step, when to hold back and when holding back has stalled;
//! * `server.rs` (`StageServer`): the microbatch work done for the run's drivers: checks,
//!   forward and backward passes, commits, and forwards of later steps held back;
//! * `coordinator.rs` (`StepCoordinator`): when the stage steps (the batch is complete, or
//!   it is starving), averaging rounds (`rounds.rs`), DiLoCo, checkpoints; with
//!   `progress.rs` for the other replicas' progress reports and `agreement.rs` for
//!   catch-ups and the parameter-hash vote;
//! * `scheduler.rs` (`Scheduler`): the device's job queue by priority, and the throughput
//!   measured from it.
//!
//! Parts do not call each other: what one needs of another passes through the peer as plain
//! values, and what they ask of the world goes into one `Outbox` (messages, events, compute
//! jobs), in order. The compute interface with the owner is in `interface.rs`.

mod agreement;
pub mod attack;
pub mod averaging;
pub mod bans;
pub mod claims;
pub mod config;
mod coordinator;
mod driver;
mod evaluation;
mod exports;
mod interface;
pub mod ledger;
pub mod links;
pub mod membership;
pub mod message;
pub mod norms;
mod outbox;
pub mod peer;
pub mod placement;
mod progress;
pub mod robust;
mod role;
mod rounds;
mod scheduler;
mod server;
mod service;
pub mod transfer;

#[cfg(test)]
mod fixtures;
#[cfg(test)]
mod tests;

pub use config::{
    DataSource, Evaluation, MAX_EVALUATION_SAMPLES, ModelRef, PAPER_OUTER_LR, PAPER_OUTER_MOMENTUM,
    RunConfig, RunId, StageCosts, SyncMode, Timing,
};
pub use message::{Announcement, Envelope, HeldOut, MemberState, Message};
pub use peer::{Action, ComputeDone, Event, Input, Job, Output, Peer, PeerStats, Resume};

use serde::{Deserialize, Serialize};
use std::fmt;

/// A peer's identity inside the protocol: a 64-bit digest of its network identity (the node
/// maps it back to a libp2p `PeerId`, the simulator uses small integers). 64 bits keep routes
/// and ledgers compact; finding a collision with a given peer takes ~2^64 work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PeerKey(pub u64);

impl PeerKey {
    /// The key of a network identity given as bytes (e.g. a libp2p `PeerId`).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        PeerKey(xxhash_rust::xxh3::xxh3_64(bytes))
    }
}

impl fmt::Display for PeerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// The small seeded generator the machines draw from (SplitMix64: every decision that looks
/// random is a function of the seed and the events so far).
#[derive(Clone, Debug)]
pub struct SeededRng(u64);

impl SeededRng {
    /// A generator whose stream is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        SeededRng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// An index drawn with probability proportional to `weights` (None if all are zero).
    pub fn weighted(&mut self, weights: &[f64]) -> Option<usize> {
        let total: f64 = weights.iter().filter(|w| w.is_finite() && **w > 0.0).sum();
        if total <= 0.0 {
            return None;
        }
        let mut x = self.next_f64() * total;
        let mut last = None;
        for (i, &w) in weights.iter().enumerate() {
            if !(w.is_finite() && w > 0.0) {
                continue;
            }
            last = Some(i);
            if x < w {
                return Some(i);
            }
            x -= w;
        }
        last
    }
}
