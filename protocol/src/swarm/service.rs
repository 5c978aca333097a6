//! The service each replica of the next stage actually gives this peer, as this peer times it.
//!
//! Announced throughput and queue are claims, and routing follows them: a replica announcing a
//! hundred times its speed would draw most of its stage's microbatches and hold up every step
//! while they queue there. So a sender also times its own microbatches, from the activations
//! sent to a replica to the gradient coming back from it. While a replica's average answer
//! takes more than [`SLACK`] times the stage's typical one (the lower median of the replicas
//! this peer timed), it is overloaded, whatever it claims: each of its answers then multiplies
//! the factor its routing weight is scaled by by [`STEP_DOWN`], and each answer in time divides
//! it back, up to 1. A liar's weight so falls until its queue is what its real speed allows,
//! while an honest replica, loaded in proportion to its speed, answers in time and keeps its
//! weight. A microbatch that never comes back counts as a late answer; from a replica that
//! never answered one, it leaves the replica the least factor until its first answer (then
//! 1): identities cost nothing, and a swarm of them announcing throughput and answering
//! nothing would otherwise draw most microbatches, each lost to a timeout.
//!
//! The factor never takes a replica's work away entirely: routing skips a straggler by its
//! announcement, not by this factor, so a replica whose factor fell in a burst of late answers
//! still gets some work and its answers in time restore it.
//!
//! The answers are judged too. A replica of the next stage could answer in time with wrong
//! activation gradients (negated, or computed against wrong targets): nobody recomputes them,
//! its own shares stay honest, and the shares of the replicas that ran their backward passes on
//! them go wrong in proportion, so much that their stage-mates took them for attackers. Once
//! the step a microbatch's parameter gradient went into is taken, the device tells how well
//! the gradient pointed along it (its alignment: a cosine with the stage's robust mean of the
//! same step's gradients, so an honest microbatch points along it whichever way the step
//! before went). Judged against the step before instead, honest microbatches of `attack.toml`
//! averaged -0.02 to +0.32 with a spread of 0.41-0.56 per microbatch in a clean run (its
//! stages' steps often reverse); against their own step, +0.86 to +0.95 (spread 0.03-0.05)
//! early and +0.4 to +0.56 (spread 0.13-0.26) later on, when the steps are noisier, and under
//! `flip-backward` the negated ones -0.05 to -0.59 on average. A replica whose moving
//! average of them is more than [`MISALIGNED_BY`] below the typical replica's (the lower
//! median) is out of line: each of its microbatches halves its quality, down to
//! [`MIN_QUALITY`], and each one back in line doubles it, up to 1; the routing weight is
//! scaled by the quality as by the factor. And while it is out of line, the gradients it sends
//! are thrown away ([`Service::gradient_from`]): the sender drops the parameter gradient they
//! give and the stages before it drop theirs, instead of passing the poison on. Thrown-away
//! gradients are judged all the same, so a replica whose average strayed comes back. It is
//! no ban: the evidence is one peer's, and the culprit is not in its stage.

use crate::swarm::PeerKey;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// A replica whose average answer is later than this many times the stage's typical one is
/// overloaded.
pub const SLACK: f64 = 2.0;

/// What a late answer multiplies a replica's factor by (an answer in time divides by it).
const STEP_DOWN: f64 = 0.7;

/// The least factor.
const MIN_FACTOR: f64 = 1.0 / 1024.0;

/// Weight of a new answer in a replica's moving average.
const AVERAGE_WEIGHT: f64 = 0.2;

/// Microbatches in flight this peer times at most (more than any window; past it new ones
/// are not timed).
const MAX_TIMED: usize = 4096;

/// Weight of a new alignment in a replica's moving average (an honest replica's average then
/// spreads by about 0.1).
const ALIGNMENT_WEIGHT: f64 = 0.3;

/// A replica whose average alignment is further than this below the typical replica's sends
/// gradients that point elsewhere.
pub const MISALIGNED_BY: f64 = 0.25;

/// What each microbatch from such a replica multiplies its quality by (one in line divides).
const QUALITY_STEP: f64 = 0.5;

/// The least quality: a replica so judged still gets a trickle of work, by which it is judged
/// again (an honest one whose average strayed comes back).
pub const MIN_QUALITY: f64 = 1.0 / 16.0;

/// What a sender's own timing says of one replica of the next stage, for routing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Observed {
    /// What its routing weight is multiplied by, for its timing and its gradients together (1:
    /// in time and in line, or never judged).
    pub factor: f64,
    /// Whether one of its answers has been timed.
    pub timed: bool,
    /// Never answered, with a microbatch from this sender in flight: on probation.
    pub probing: bool,
}

impl Observed {
    /// A replica this sender has no time for.
    pub const UNTIMED: Observed = Observed {
        factor: 1.0,
        timed: false,
        probing: false,
    };
}

/// One replica as timed here.
#[derive(Clone, Copy, Debug)]
struct Timed {
    /// Moving average of its answers' seconds (0: none yet).
    seconds: f64,
    /// What its routing weight is multiplied by.
    factor: f64,
    /// Microbatches in flight to it.
    in_flight: u32,
    /// Moving average of the alignments of the microbatches it answered.
    alignment: f64,
    /// Alignments taken into it.
    aligned: u32,
    /// Whether its average is out of line now: gradients it sends are not used.
    misaligned: bool,
    /// What its routing weight is multiplied by for the gradients it sends.
    quality: f64,
}

impl Timed {
    fn scale(&mut self, by: f64) {
        self.factor = (self.factor * by).clamp(MIN_FACTOR, 1.0);
    }
}

/// Timings of the microbatches this peer sent to the next stage.
#[derive(Debug, Default)]
pub struct Service {
    /// Attempt id -> the replica it went to and when.
    in_flight: HashMap<u64, (PeerKey, Duration)>,
    replicas: BTreeMap<PeerKey, Timed>,
    /// Attempt id -> the replica whose activation gradients its parameter gradient came from,
    /// for the microbatches whose step is still to be taken (recorded since the last step,
    /// and in the step before: a microbatch committed while a round runs goes into the next).
    unjudged: [HashMap<u64, PeerKey>; 2],
    /// Gradients thrown away as out of line.
    discarded: u64,
}

impl Service {
    /// The attempt's activations went to `to` at `now`. Attempts sent longer than `lifetime`
    /// ago and never answered count as late answers of their replicas.
    pub fn sent(&mut self, attempt: u64, to: PeerKey, now: Duration, lifetime: Duration) {
        let expired: Vec<u64> = self
            .in_flight
            .iter()
            .filter(|(_, (_, at))| now.saturating_sub(*at) > lifetime)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            if let Some((peer, _)) = self.in_flight.remove(&id) {
                let timed = self.timed(peer);
                timed.in_flight = timed.in_flight.saturating_sub(1);
                if timed.seconds > 0.0 {
                    timed.scale(STEP_DOWN);
                } else {
                    timed.factor = MIN_FACTOR;
                }
            }
        }
        if self.in_flight.len() < MAX_TIMED {
            self.in_flight.insert(attempt, (to, now));
            self.timed(to).in_flight += 1;
        }
    }

    /// The gradient of `attempt` came back from `from`. Only the replica it was sent to
    /// answers for it.
    pub fn answered(&mut self, attempt: u64, from: PeerKey, now: Duration) {
        match self.in_flight.get(&attempt) {
            Some((to, _)) if *to == from => {}
            _ => return,
        }
        let Some((_, at)) = self.in_flight.remove(&attempt) else {
            return;
        };
        let seconds = now.saturating_sub(at).as_secs_f64();
        let typical = self.typical();
        let timed = self.timed(from);
        timed.in_flight = timed.in_flight.saturating_sub(1);
        timed.seconds = if timed.seconds > 0.0 {
            (1.0 - AVERAGE_WEIGHT) * timed.seconds + AVERAGE_WEIGHT * seconds
        } else {
            // Its first answer: whatever it lost before, it works.
            timed.factor = 1.0;
            seconds
        };
        // Its average, not this one answer, against the typical one: single answers vary with
        // the queues on the way, and an honest replica must not pay for one slow answer.
        let late = typical.is_some_and(|t| timed.seconds > SLACK * t);
        timed.scale(if late { STEP_DOWN } else { 1.0 / STEP_DOWN });
    }

    /// The parameter gradient of `attempt` was computed on activation gradients `from` sent:
    /// it is judged when the step it goes into is taken. Returns whether `from` is out of
    /// line now, so that the gradient is not to be used at all.
    pub fn gradient_from(&mut self, attempt: u64, from: PeerKey) -> bool {
        if self.unjudged[0].len() < MAX_TIMED {
            self.unjudged[0].insert(attempt, from);
        }
        let discard = self.replicas.get(&from).is_some_and(|t| t.misaligned);
        self.discarded += u64::from(discard);
        discard
    }

    /// Gradients thrown away as out of line so far.
    pub fn discarded(&self) -> u64 {
        self.discarded
    }

    /// The step was taken: how well each of its microbatches pointed along it (`alignments`,
    /// attempt id and cosine). Each is evidence about the replica whose activation gradients
    /// it was computed on.
    pub fn judge(&mut self, alignments: &[(u64, f64)]) {
        for (attempt, alignment) in alignments {
            let from = self.unjudged.iter_mut().find_map(|m| m.remove(attempt));
            if let Some(from) = from {
                self.aligned(from, *alignment);
            }
        }
        let [newer, older] = &mut self.unjudged;
        *older = std::mem::take(newer);
    }

    /// A microbatch whose activation gradients `from` sent gave a parameter gradient that
    /// points `alignment` along the step it went into.
    fn aligned(&mut self, from: PeerKey, alignment: f64) {
        if !alignment.is_finite() {
            return;
        }
        let typical = self.typical_alignment();
        let t = self.timed(from);
        t.alignment = match t.aligned {
            0 => alignment,
            _ => (1.0 - ALIGNMENT_WEIGHT) * t.alignment + ALIGNMENT_WEIGHT * alignment,
        };
        t.aligned = t.aligned.saturating_add(1);
        t.misaligned =
            t.aligned >= 2 && typical.is_some_and(|typical| t.alignment < typical - MISALIGNED_BY);
        t.quality = if t.misaligned {
            (t.quality * QUALITY_STEP).max(MIN_QUALITY)
        } else {
            (t.quality / QUALITY_STEP).min(1.0)
        };
    }

    /// What this peer's timing says of `peer`.
    pub fn observed(&self, peer: PeerKey) -> Observed {
        self.replicas
            .get(&peer)
            .map_or(Observed::UNTIMED, |t| Observed {
                factor: t.factor * t.quality,
                timed: t.seconds > 0.0,
                probing: t.seconds == 0.0 && t.in_flight > 0,
            })
    }

    /// Forgets a peer that left.
    pub fn forget(&mut self, peer: PeerKey) {
        self.replicas.remove(&peer);
        self.in_flight.retain(|_, (to, _)| *to != peer);
    }

    fn timed(&mut self, peer: PeerKey) -> &mut Timed {
        self.replicas.entry(peer).or_insert(Timed {
            seconds: 0.0,
            factor: 1.0,
            in_flight: 0,
            alignment: 0.0,
            aligned: 0,
            misaligned: false,
            quality: 1.0,
        })
    }

    /// The lower median of the replicas' average alignments (None before three have two
    /// each): with fewer than half of them sending wrong gradients, an honest replica's.
    fn typical_alignment(&self) -> Option<f64> {
        let a: Vec<f64> = self
            .replicas
            .values()
            .filter(|t| t.aligned >= 2)
            .map(|t| t.alignment)
            .collect();
        (a.len() >= 3).then(|| crate::swarm::robust::lower_median(a))
    }

    /// The lower median of the replicas' average answer times (None before two are timed):
    /// with fewer than half of them overloaded, an honest replica's time.
    fn typical(&self) -> Option<f64> {
        let s: Vec<f64> = self
            .replicas
            .values()
            .map(|t| t.seconds)
            .filter(|s| *s > 0.0)
            .collect();
        (s.len() >= 2).then(|| crate::swarm::robust::lower_median(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    /// Three replicas answer in 100 ms; a fourth, flooded because it claims more than it
    /// does, in 1 s: its factor falls while it is late and comes back once it answers in time.
    #[test]
    fn a_replica_that_answers_late_loses_weight_and_regains_it_in_time() {
        let mut s = Service::default();
        let life = Duration::from_secs(60);
        let mut id = 0;
        let mut round = |s: &mut Service, t: u64, liar_ms: u64| {
            for (peer, took) in [(1, 100), (2, 100), (3, 100), (4, liar_ms)] {
                id += 1;
                s.sent(id, PeerKey(peer), ms(t), life);
                s.answered(id, PeerKey(peer), ms(t + took));
            }
        };
        for i in 0..12 {
            round(&mut s, i, 1000);
        }
        for p in 1..=3 {
            assert_eq!(s.observed(PeerKey(p)).factor, 1.0);
        }
        let low = s.observed(PeerKey(4)).factor;
        assert!(low < 0.05, "{low}");
        // Answers in time bring it back (its average falls below twice the typical first).
        for i in 12..60 {
            round(&mut s, i, 100);
        }
        assert_eq!(s.observed(PeerKey(4)).factor, 1.0);
    }

    #[test]
    fn only_the_replica_sent_to_answers_and_unanswered_work_counts_late() {
        let mut s = Service::default();
        let life = Duration::from_secs(10);
        s.sent(1, PeerKey(1), ms(0), life);
        // Another peer cannot answer for it (nor earn its replica a fast time).
        s.answered(1, PeerKey(2), ms(10));
        assert_eq!(s.observed(PeerKey(2)).factor, 1.0);
        assert!(s.in_flight.contains_key(&1));
        // Never answered: late once its lifetime has passed; having never answered anything,
        // it keeps the least weight until it does.
        s.sent(2, PeerKey(3), ms(20_000), life);
        assert_eq!(s.observed(PeerKey(1)).factor, MIN_FACTOR);
        assert!(!s.in_flight.contains_key(&1));
        s.sent(3, PeerKey(1), ms(20_000), life);
        s.answered(3, PeerKey(1), ms(20_100));
        assert_eq!(s.observed(PeerKey(1)).factor, 1.0);
        // One that answered before only loses a step.
        s.sent(4, PeerKey(1), ms(20_200), life);
        s.sent(5, PeerKey(3), ms(40_000), life);
        assert_eq!(s.observed(PeerKey(1)).factor, STEP_DOWN);
        s.forget(PeerKey(3));
        assert!(s.in_flight.is_empty());
        assert_eq!(s.observed(PeerKey(3)).factor, 1.0);
    }

    /// Five replicas send gradients whose microbatches align with the steps they go into by
    /// +0.5 give or take 0.25; a sixth negates its gradients (-0.5): from its second
    /// microbatch on its gradients are thrown away, and its quality falls to the least within
    /// six, while the others keep theirs and none of their gradients is thrown away. Once in
    /// line again (its thrown-away gradients are judged too) it comes back.
    #[test]
    fn a_replica_whose_gradients_point_elsewhere_loses_its_work_and_regains_it_in_line() {
        let mut s = Service::default();
        let noise = [0.25, -0.25, 0.1, -0.1, 0.0, 0.2, -0.2];
        let mut id = 0;
        // One step: a microbatch from each replica; returns those thrown away.
        let mut step = |s: &mut Service, liar: f64| {
            let mut alignments = Vec::new();
            let mut discarded = Vec::new();
            for peer in 1..=6 {
                id += 1;
                if s.gradient_from(id, PeerKey(peer)) {
                    discarded.push(peer);
                }
                let mean = if peer == 6 { liar } else { 0.5 };
                alignments.push((id, mean + noise[id as usize % noise.len()]));
            }
            s.judge(&alignments);
            discarded
        };
        assert!(step(&mut s, 0.5).is_empty());
        assert!(step(&mut s, 0.5).is_empty());
        assert!(step(&mut s, -0.5).is_empty(), "judged after its step");
        assert_eq!(step(&mut s, -0.5), [6]);
        for _ in 0..4 {
            assert_eq!(step(&mut s, -0.5), [6]);
        }
        assert_eq!(s.observed(PeerKey(6)).factor, MIN_QUALITY);
        for p in 1..=5 {
            assert_eq!(s.observed(PeerKey(p)).factor, 1.0, "{p}");
        }
        assert_eq!(s.discarded(), 5);
        for _ in 0..12 {
            step(&mut s, 0.5);
        }
        assert_eq!(s.observed(PeerKey(6)).factor, 1.0);
        assert!(step(&mut s, 0.5).is_empty());
        // Not a number is no evidence; an attempt judged twice, or never recorded, neither.
        s.gradient_from(1000, PeerKey(1));
        s.judge(&[(1000, f64::NAN), (1001, -1.0)]);
        s.judge(&[(1000, -1.0)]);
        assert_eq!(s.observed(PeerKey(1)).factor, 1.0);
        // What is never judged is forgotten after two steps.
        s.gradient_from(1002, PeerKey(1));
        s.judge(&[]);
        s.judge(&[]);
        assert!(s.unjudged.iter().all(HashMap::is_empty));
    }

    #[test]
    fn the_factor_has_a_floor_and_timings_a_bound() {
        let mut s = Service::default();
        for _ in 0..100 {
            s.timed(PeerKey(1)).scale(STEP_DOWN);
        }
        assert_eq!(s.observed(PeerKey(1)).factor, MIN_FACTOR);
        for id in 0..(MAX_TIMED as u64 + 10) {
            s.sent(id, PeerKey(2), ms(0), Duration::from_secs(1));
        }
        assert_eq!(s.in_flight.len(), MAX_TIMED);
    }
}
