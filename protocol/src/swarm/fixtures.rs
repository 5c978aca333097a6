//! Small builders shared by the unit tests of the peer's parts.

use super::PeerKey;
use super::interface::{Action, Job};
use super::membership::Membership;
use super::message::{Announcement, MemberState, Message};
use super::outbox::Outbox;
use super::placement::Placement;
use crate::Codec;
use crate::codec::{TENSOR_HEADER_LEN, encode_to_vec};
use std::time::Duration;

/// Where `peer` serves: `stage`, at `throughput` samples/s, with `memory` bytes of device
/// memory (0: not announced), not offloading.
pub fn placement(peer: u64, stage: u32, throughput: f64, memory: u64) -> Placement {
    Placement {
        peer: PeerKey(peer),
        stage,
        throughput,
        memory,
        offloads: false,
    }
}

/// A peer serving `stage` at round 0, measured at 1 sample/s, nothing queued.
pub fn serving(stage: u32) -> Announcement {
    Announcement {
        stage: Some(stage),
        state: MemberState::Serving,
        throughput: 1.0,
        queue: 0,
        step: 0,
        round: 0,
        params_hash: None,
        finished: false,
        newcomer: false,
        loss: None,
        memory: 0,
        offloads: false,
        incarnation: 1,
        seq: 1,
        accuses: Vec::new(),
        held_out: None,
        routed: Default::default(),
    }
}

/// A peer announcing `stage` (serving it; choosing when None).
pub fn announcement(stage: Option<u32>) -> Announcement {
    match stage {
        Some(s) => serving(s),
        None => Announcement {
            stage: None,
            state: MemberState::Choosing,
            ..serving(0)
        },
    }
}

/// A peer serving `stage` at `round` with parameters hashing to `hash`.
pub fn at_round(stage: u32, round: u64, hash: Option<u64>) -> Announcement {
    Announcement {
        step: round,
        round,
        params_hash: hash,
        ..serving(stage)
    }
}

/// The membership of these peers, by key.
pub fn members(list: impl IntoIterator<Item = (u64, Announcement)>) -> Membership {
    let mut m = Membership::default();
    for (key, a) in list {
        m.update(PeerKey(key), a, Duration::ZERO);
    }
    m
}

/// The messages an outbox holds, in order, taken out with every other action.
pub fn sends(out: &mut Outbox) -> Vec<(PeerKey, Message)> {
    out.drain()
        .into_iter()
        .filter_map(|a| match a {
            Action::Send { to, msg } => Some((to, msg)),
            _ => None,
        })
        .collect()
}

/// The jobs an outbox's scheduler holds, in the order the device would run them.
pub fn jobs(out: &mut Outbox) -> Vec<Job> {
    let mut jobs = Vec::new();
    while let Some(j) = out.jobs.next(Duration::ZERO) {
        jobs.push(j);
        out.jobs.finished(Duration::ZERO);
    }
    jobs
}

/// A well-formed fp32 tensor message of `n` values (a valid checksum) of which one is NaN:
/// what a hostile peer can send, since no honest encoder makes it.
pub fn poisoned(n: usize) -> Vec<u8> {
    let mut message = encode_to_vec(Codec::Fp32, &vec![0.5; n], &[n]).expect("encodes");
    let nan = TENSOR_HEADER_LEN + 4 * (n / 2);
    message[nan..nan + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    let checksum = xxhash_rust::xxh3::xxh3_64(&message[TENSOR_HEADER_LEN..]);
    message[28..36].copy_from_slice(&checksum.to_le_bytes());
    message
}
