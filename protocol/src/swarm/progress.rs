//! How far the replicas of a stage are toward a round, as they report it to each other.

use super::PeerKey;
use std::collections::BTreeMap;

/// What a replica reported of its progress toward a round.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Report {
    round: u64,
    samples: f64,
    in_flight: f64,
}

/// The latest progress report of each other replica of the stage.
#[derive(Debug, Default)]
pub(super) struct StageProgress {
    reports: BTreeMap<PeerKey, Report>,
    /// Samples of the latest round reported by replicas that are gone since (banned, left,
    /// moved): their drivers committed them, and no replica of the stage will count them
    /// again.
    lost: (u64, f64),
}

impl StageProgress {
    /// A report of `from`: `samples` committed toward `round` and `in_flight` on their way.
    /// Within a round a replica's count only grows, and rounds only advance: a report that
    /// arrives after a newer one (each message has its own stream) is stale, and so is
    /// anything not a finite count. Returns whether it was taken.
    pub fn update(&mut self, from: PeerKey, round: u64, samples: f64, in_flight: f64) -> bool {
        let valid = |x: f64| x.is_finite() && x >= 0.0;
        let newer = self
            .reports
            .get(&from)
            .is_none_or(|p| round > p.round || (round == p.round && samples >= p.samples));
        if !(valid(samples) && valid(in_flight) && newer) {
            return false;
        }
        let report = Report {
            round,
            samples,
            in_flight,
        };
        self.reports.insert(from, report);
        true
    }

    /// Samples `replicas` reported committed toward `round`, and with `in_flight` those they
    /// have on their way too.
    pub fn reported(&self, replicas: &[PeerKey], round: u64, in_flight: bool) -> f64 {
        replicas
            .iter()
            .filter_map(|k| self.reports.get(k))
            .filter(|p| p.round == round)
            .map(|p| {
                if in_flight {
                    p.samples + p.in_flight
                } else {
                    p.samples
                }
            })
            .sum()
    }

    /// `peer` is gone: its reports no longer count, and what it had collected of its
    /// round is lost to the stage. Returns whether it had reported (it was a replica of
    /// the stage).
    pub fn forget(&mut self, peer: PeerKey) -> bool {
        let Some(r) = self.reports.remove(&peer) else {
            return false;
        };
        if r.round > self.lost.0 {
            self.lost = (r.round, 0.0);
        }
        if r.round == self.lost.0 {
            self.lost.1 += r.samples;
        }
        true
    }

    /// Samples committed toward `round` at replicas gone since.
    pub fn lost(&self, round: u64) -> f64 {
        if self.lost.0 == round {
            self.lost.1
        } else {
            0.0
        }
    }

    /// Forgets every report (they were about a stage no longer served).
    pub fn clear(&mut self) {
        self.reports.clear();
        self.lost = (0, 0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Progress reports from a replica only move forward: one overtaken on the way does not
    /// lower its count, and nonsense is refused.
    #[test]
    fn a_stale_or_invalid_progress_report_is_ignored() {
        let mut p = StageProgress::default();
        assert!(p.update(PeerKey(9), 0, 4.0, 2.0));
        assert!(!p.update(PeerKey(9), 0, 2.0, 0.0));
        assert_eq!(p.reported(&[PeerKey(9)], 0, true), 6.0);
        assert!(p.update(PeerKey(9), 1, 0.0, 0.0));
        assert!(!p.update(PeerKey(9), 0, 8.0, 0.0));
        assert!(!p.update(PeerKey(8), 0, f64::NAN, 0.0));
        assert!(!p.update(PeerKey(8), 0, 1.0, -1.0));
        // Only the replicas asked about, and only the round asked about, count.
        assert!(p.update(PeerKey(7), 1, 3.0, 1.0));
        assert_eq!(p.reported(&[PeerKey(9), PeerKey(7)], 1, false), 3.0);
        assert_eq!(p.reported(&[PeerKey(7)], 0, false), 0.0);
        p.forget(PeerKey(7));
        assert_eq!(p.reported(&[PeerKey(7)], 1, true), 0.0);
    }

    /// What a replica that is gone had collected of the round counts as lost for that round
    /// only; an older round's report adds nothing to a newer round's loss.
    #[test]
    fn the_samples_of_a_gone_replica_are_lost_to_its_round() {
        let mut p = StageProgress::default();
        assert!(p.update(PeerKey(1), 3, 16.0, 8.0));
        assert!(p.update(PeerKey(2), 3, 8.0, 0.0));
        assert!(p.update(PeerKey(3), 2, 24.0, 0.0));
        p.forget(PeerKey(1));
        p.forget(PeerKey(2));
        p.forget(PeerKey(3));
        p.forget(PeerKey(4));
        assert_eq!(p.lost(3), 24.0);
        assert_eq!(p.lost(2), 0.0);
        assert_eq!(p.lost(4), 0.0);
        p.clear();
        assert_eq!(p.lost(3), 0.0);
    }
}
