//! Serving this stage's state to joiners and re-syncing replicas.
//!
//! An export copies the whole state (parameters, optimizer moments, DiLoCo anchor) and runs
//! before any training job, so requests are what a peer could flood a replica with: exports
//! run at most [`MAX_RUNNING`] at a time, none while an averaging round is under way (the
//! state would be mid-round, unlike the other replicas'), each requester is served at most
//! once per transfer timeout (a joiner whose download failed asks again after its deadline),
//! and at most [`MAX_WAITING`] requests wait.

use super::PeerKey;
use super::interface::Job;
use super::outbox::Outbox;
use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

/// Exports queued or running at once, at most: each holds a copy of the state in memory.
pub(super) const MAX_RUNNING: usize = 2;

/// Requests waiting for a round to end or an export to finish, at most.
pub(super) const MAX_WAITING: usize = 64;

/// The state exports of one replica.
#[derive(Debug)]
pub(super) struct StateExports {
    /// How long a requester waits before it is served again.
    every: Duration,
    running: usize,
    waiting: VecDeque<PeerKey>,
    /// When each recent requester was last served.
    served: BTreeMap<PeerKey, Duration>,
}

impl StateExports {
    /// Exports serving each requester at most once per `every`.
    pub fn new(every: Duration) -> Self {
        StateExports {
            every,
            running: 0,
            waiting: VecDeque::new(),
            served: BTreeMap::new(),
        }
    }

    /// `to` asks for the state. Served now if it may be, later if a round runs (`in_round`)
    /// or enough exports run already, not at all if it was served lately or too many wait.
    pub fn request(&mut self, out: &mut Outbox, to: PeerKey, in_round: bool, now: Duration) {
        self.served
            .retain(|_, at| now.saturating_sub(*at) < self.every);
        if self.served.contains_key(&to) || self.waiting.contains(&to) {
            return;
        }
        if !in_round && self.running < MAX_RUNNING {
            self.start(out, to, now);
        } else if self.waiting.len() < MAX_WAITING {
            self.waiting.push_back(to);
        }
    }

    fn start(&mut self, out: &mut Outbox, to: PeerKey, now: Duration) {
        self.running += 1;
        self.served.insert(to, now);
        out.compute(Job::Export { to });
    }

    /// An export finished (or failed); waiting requests go on if they may.
    pub fn done(&mut self, out: &mut Outbox, in_round: bool, now: Duration) {
        self.running = self.running.saturating_sub(1);
        self.resume(out, in_round, now);
    }

    /// Starts waiting exports while fewer than [`MAX_RUNNING`] run and no round is under way.
    pub fn resume(&mut self, out: &mut Outbox, in_round: bool, now: Duration) {
        while !in_round && self.running < MAX_RUNNING {
            let Some(to) = self.waiting.pop_front() else {
                return;
            };
            self.start(out, to, now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::swarm::fixtures::jobs;

    const S: Duration = Duration::from_secs(1);

    fn exports(out: &mut Outbox) -> Vec<u64> {
        jobs(out)
            .into_iter()
            .filter_map(|j| match j {
                Job::Export { to } => Some(to.0),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn exports_are_few_at_a_time_never_mid_round_and_once_per_requester() {
        let mut e = StateExports::new(30 * S);
        let mut out = Outbox::new(PeerKey(1));
        // Mid-round: wait.
        e.request(&mut out, PeerKey(7), true, S);
        assert!(exports(&mut out).is_empty());
        e.resume(&mut out, false, 2 * S);
        assert_eq!(exports(&mut out), [7]);
        // A repeat while served lately is dropped; others run up to the cap, then wait.
        for k in [7, 8, 9, 10] {
            e.request(&mut out, PeerKey(k), false, 3 * S);
        }
        assert_eq!(exports(&mut out), [8], "two run at once");
        e.done(&mut out, false, 4 * S);
        assert_eq!(exports(&mut out), [9]);
        e.done(&mut out, false, 5 * S);
        e.done(&mut out, false, 5 * S);
        assert_eq!(exports(&mut out), [10]);
        // Served again once the transfer timeout has passed.
        e.done(&mut out, false, 6 * S);
        e.request(&mut out, PeerKey(7), false, 20 * S);
        assert!(exports(&mut out).is_empty());
        e.request(&mut out, PeerKey(7), false, 32 * S);
        assert_eq!(exports(&mut out), [7]);
        // The wait is bounded: a flood of fresh keys does not grow it.
        let mut e = StateExports::new(30 * S);
        for k in 0..10_000 {
            e.request(&mut out, PeerKey(100 + k), true, S);
        }
        assert_eq!(e.waiting.len(), MAX_WAITING);
    }
}
