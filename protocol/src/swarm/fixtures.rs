//! Small builders shared by the unit tests of the peer's parts.

use super::PeerKey;
use super::interface::{Action, Job};
use super::membership::Membership;
use super::message::{Announcement, MemberState, Message};
use super::outbox::Outbox;
use std::time::Duration;

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
        loss: None,
        memory: 0,
        incarnation: 1,
        seq: 1,
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
