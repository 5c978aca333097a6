//! The data driver's ledger: every microbatch it started, which attempts of it are out, their
//! deadlines, and the rule that makes application at-most-once: the first attempt whose
//! backward pass comes home wins, every other attempt of the same microbatch is aborted, and
//! an attempt is committed exactly once.

use super::PeerKey;
use std::collections::BTreeMap;
use std::time::Duration;

/// One microbatch as the driver tracks it.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// The driver's own number for it (stable across attempts).
    pub microbatch: u64,
    /// Which sample of the data it is (stable across attempts, so a retry trains on the same
    /// data).
    pub sample: u64,
    /// Samples in it.
    pub rows: u32,
    /// The round it was started for.
    pub round: u64,
    /// Attempts so far.
    pub attempts: u32,
    /// Attempts that are out (may still answer), with the first hop each took.
    pub live: Vec<(u64, Option<PeerKey>)>,
    /// When the first attempt started.
    pub started: Duration,
    /// When the newest attempt times out.
    pub deadline: Duration,
    /// The attempt whose backward pass was accepted, if any.
    pub accepted: Option<u64>,
}

/// What to do with a backward pass that arrived.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// Run the backward pass of this attempt; abort these other attempts.
    Accept {
        /// Other attempts of the same microbatch, to abort along their routes.
        abort: Vec<u64>,
    },
    /// Another attempt already won (or the microbatch was dropped): abort this one.
    Stale,
}

/// Counters for reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LedgerStats {
    /// Microbatches committed.
    pub committed: u64,
    /// Attempts beyond the first.
    pub retried: u64,
    /// Microbatches given up after the last attempt.
    pub dropped: u64,
}

/// The ledger.
#[derive(Clone, Debug, Default)]
pub struct Ledger {
    entries: BTreeMap<u64, Entry>,
    attempt_of: BTreeMap<u64, u64>,
    /// Counters.
    pub stats: LedgerStats,
}

impl Ledger {
    /// Microbatches not yet committed or dropped.
    pub fn in_flight(&self) -> usize {
        self.entries.len()
    }

    /// Microbatches in flight that were started for round `round` or a later one.
    pub fn in_flight_from(&self, round: u64) -> usize {
        self.entries.values().filter(|e| e.round >= round).count()
    }

    /// Forgets every microbatch in flight (the driver's stage state is being replaced, so
    /// none can complete); they count as dropped.
    pub fn abandon(&mut self) {
        self.stats.dropped += self.entries.len() as u64;
        self.entries.clear();
        self.attempt_of.clear();
    }

    /// Records the first attempt of a new microbatch.
    pub fn start(
        &mut self,
        microbatch: u64,
        sample: u64,
        rows: u32,
        round: u64,
        attempt: u64,
        started: Duration,
        deadline: Duration,
    ) {
        self.attempt_of.insert(attempt, microbatch);
        self.entries.insert(
            microbatch,
            Entry {
                microbatch,
                sample,
                rows,
                round,
                attempts: 1,
                live: vec![(attempt, None)],
                started,
                deadline,
                accepted: None,
            },
        );
    }

    /// The entry an attempt belongs to.
    pub fn entry_of(&self, attempt: u64) -> Option<&Entry> {
        self.attempt_of
            .get(&attempt)
            .and_then(|m| self.entries.get(m))
    }

    /// Records where an attempt was sent.
    pub fn sent(&mut self, attempt: u64, first_hop: PeerKey) {
        if let Some(e) = self
            .attempt_of
            .get(&attempt)
            .and_then(|m| self.entries.get_mut(m))
        {
            for live in &mut e.live {
                if live.0 == attempt {
                    live.1 = Some(first_hop);
                }
            }
        }
    }

    /// A backward pass of `attempt` came home.
    pub fn arrive(&mut self, attempt: u64) -> Arrival {
        let Some(e) = self
            .attempt_of
            .get(&attempt)
            .and_then(|m| self.entries.get_mut(m))
        else {
            return Arrival::Stale;
        };
        if e.accepted.is_some() {
            return Arrival::Stale;
        }
        e.accepted = Some(attempt);
        let abort: Vec<u64> = e
            .live
            .iter()
            .map(|l| l.0)
            .filter(|a| *a != attempt)
            .collect();
        e.live.retain(|l| l.0 == attempt);
        for a in &abort {
            self.attempt_of.remove(a);
        }
        Arrival::Accept { abort }
    }

    /// The accepted attempt's backward pass finished here: the microbatch is committed.
    /// Returns its entry, or None if `attempt` is not the accepted attempt of a live entry
    /// (so a second completion can never commit twice).
    pub fn commit(&mut self, attempt: u64) -> Option<Entry> {
        let m = *self.attempt_of.get(&attempt)?;
        if self.entries.get(&m)?.accepted != Some(attempt) {
            return None;
        }
        self.attempt_of.remove(&attempt);
        let e = self.entries.remove(&m)?;
        self.stats.committed += 1;
        Some(e)
    }

    /// The accepted attempt failed locally (its backward could not run): forget acceptance
    /// so the microbatch can be retried.
    pub fn unaccept(&mut self, attempt: u64, now: Duration) {
        if let Some(e) = self
            .attempt_of
            .get(&attempt)
            .and_then(|m| self.entries.get_mut(m))
        {
            if e.accepted == Some(attempt) {
                e.accepted = None;
                e.deadline = now;
            }
        }
    }

    /// Makes an attempt time out now (its route failed, e.g. a hop rejected it or died).
    pub fn fail(&mut self, attempt: u64, now: Duration) {
        if let Some(e) = self
            .attempt_of
            .get(&attempt)
            .and_then(|m| self.entries.get_mut(m))
        {
            if e.accepted.is_none() && e.live.last().map(|l| l.0) == Some(attempt) {
                e.deadline = e.deadline.min(now);
            }
        }
    }

    /// Makes every attempt whose first hop was `peer` time out now.
    pub fn fail_hop(&mut self, peer: PeerKey, now: Duration) {
        for e in self.entries.values_mut() {
            if e.accepted.is_none() && e.live.last().and_then(|l| l.1) == Some(peer) {
                e.deadline = e.deadline.min(now);
            }
        }
    }

    /// The earliest deadline of an attempt not yet accepted.
    pub fn next_deadline(&self) -> Option<Duration> {
        self.entries
            .values()
            .filter(|e| e.accepted.is_none())
            .map(|e| e.deadline)
            .min()
    }

    /// Microbatches whose newest attempt timed out at `now`. Each gets a new attempt id from
    /// `next_attempt` (the old ones stay live: a late answer still wins) and a new deadline,
    /// or, after `max_attempts`, is dropped: all its attempts are returned for aborting.
    pub fn expire(
        &mut self,
        now: Duration,
        max_attempts: u32,
        deadline: Duration,
        mut next_attempt: impl FnMut() -> u64,
    ) -> Vec<Expiry> {
        let due: Vec<u64> = self
            .entries
            .values()
            .filter(|e| e.accepted.is_none() && e.deadline <= now)
            .map(|e| e.microbatch)
            .collect();
        let mut out = Vec::new();
        for m in due {
            let Some(attempts) = self.entries.get(&m).map(|e| e.attempts) else {
                continue;
            };
            if attempts >= max_attempts {
                if let Some(e) = self.entries.remove(&m) {
                    for (a, _) in &e.live {
                        self.attempt_of.remove(a);
                    }
                    self.stats.dropped += 1;
                    out.push(Expiry::Dropped(e));
                }
            } else if let Some(e) = self.entries.get_mut(&m) {
                let attempt = next_attempt();
                let avoid = e.live.last().and_then(|l| l.1);
                e.attempts += 1;
                e.live.push((attempt, None));
                e.deadline = now + deadline;
                self.attempt_of.insert(attempt, m);
                self.stats.retried += 1;
                out.push(Expiry::Retry {
                    attempt,
                    sample: e.sample,
                    rows: e.rows,
                    avoid,
                });
            }
        }
        out
    }
}

/// What became of a timed-out microbatch.
#[derive(Clone, Debug, PartialEq)]
pub enum Expiry {
    /// Try again with this attempt, avoiding the last first hop.
    Retry {
        /// The new attempt id.
        attempt: u64,
        /// The sample to recompute.
        sample: u64,
        /// Samples in it.
        rows: u32,
        /// The first hop of the attempt that timed out.
        avoid: Option<PeerKey>,
    },
    /// Given up; abort all its attempts.
    Dropped(Entry),
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_lost_reply_is_retried_and_applied_once() {
        let mut l = Ledger::default();
        let mut ids = 100..;
        l.start(0, 7, 4, 0, 1, Duration::ZERO, S);
        l.sent(1, PeerKey(9));
        // The reply of attempt 1 is lost: the deadline passes, a retry avoids peer 9.
        let ex = l.expire(S, 3, S, || ids.next().unwrap_or(0));
        assert_eq!(
            ex,
            vec![Expiry::Retry {
                attempt: 100,
                sample: 7,
                rows: 4,
                avoid: Some(PeerKey(9))
            }]
        );
        assert_eq!(l.stats.retried, 1);
        // The retry answers: accepted, the first attempt is aborted.
        assert_eq!(l.arrive(100), Arrival::Accept { abort: vec![1] });
        // Now the lost reply turns up after all: stale.
        assert_eq!(l.arrive(1), Arrival::Stale);
        assert!(l.commit(1).is_none());
        // Committed exactly once.
        assert_eq!(l.commit(100).map(|e| e.sample), Some(7));
        assert!(l.commit(100).is_none());
        assert_eq!(l.arrive(100), Arrival::Stale);
        assert_eq!(l.stats.committed, 1);
        assert_eq!(l.in_flight(), 0);
    }

    #[test]
    fn a_late_first_answer_still_wins() {
        let mut l = Ledger::default();
        l.start(0, 7, 4, 0, 1, Duration::ZERO, S);
        let mut next = 2;
        l.expire(S, 3, S, || {
            next += 1;
            next
        });
        assert_eq!(l.arrive(1), Arrival::Accept { abort: vec![3] });
        assert_eq!(l.arrive(3), Arrival::Stale);
        assert!(l.commit(1).is_some());
    }

    #[test]
    fn gives_up_after_max_attempts() {
        let mut l = Ledger::default();
        l.start(0, 7, 4, 0, 1, Duration::ZERO, S);
        let mut next = 1;
        let mut fresh = || {
            next += 1;
            next
        };
        assert_eq!(l.expire(S, 2, S, &mut fresh).len(), 1);
        assert!(l.expire(S, 2, S, &mut fresh).is_empty(), "not due yet");
        match l.expire(2 * S, 2, S, &mut fresh).as_slice() {
            [Expiry::Dropped(e)] => assert_eq!(e.live.len(), 2),
            other => panic!("{other:?}"),
        }
        assert_eq!(l.stats.dropped, 1);
        assert_eq!(l.arrive(1), Arrival::Stale);
        assert_eq!(l.in_flight(), 0);
    }

    #[test]
    fn a_failed_hop_times_out_at_once() {
        let mut l = Ledger::default();
        l.start(0, 7, 4, 0, 1, Duration::ZERO, 10 * S);
        l.sent(1, PeerKey(5));
        l.fail_hop(PeerKey(5), S);
        assert_eq!(l.next_deadline(), Some(S));
        assert_eq!(l.expire(S, 3, S, || 2).len(), 1);
    }
}
