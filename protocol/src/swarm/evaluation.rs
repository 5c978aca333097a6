//! Held-out evaluation of the swarm's model while it trains.
//!
//! Every [`Evaluation::every`](super::Evaluation) steps, and at the run's last step, one
//! replica of the first stage sends the run's held-out samples through the pipeline, forward
//! only ([`Message::Evaluate`]); the last stage answers each microbatch with its loss
//! ([`Message::Evaluated`]) and the evaluator announces the mean ([`HeldOut`]), which every
//! peer reports. The evaluator is the replica that ranks first for the step under a key no
//! averaging round has ([`evaluator_key`]), so nobody chooses it and the replicas agree on it
//! without a message. The held-out samples are the same each time, so that the curve
//! compares like with like.
//!
//! Each replica on the way evaluates with the parameters it holds when the microbatch passes
//! (in allreduce mode the step evaluated or the next: an evaluation is never held for a step,
//! it must not slow training down). Nothing of an evaluation is kept for a backward pass; a
//! replica relays only a first-stage replica's held-out microbatches of a step the run
//! evaluates, at most a window of each evaluator and [`MAX_RELAYED`] at once, each attempt
//! once. The loss is the last stage's word and the mean the evaluator's: a result counts only
//! from the replica that ranks first for its step in the hearer's view, and it is reported,
//! never acted on.

use super::interface::{Event, Input, Job};
use super::message::{Forward, HeldOut, Message, RoundKey};
use super::norms::NormReference;
use super::outbox::Outbox;
use super::server::{Serving, accepted_activations, forged_forward};
use super::{PeerKey, SeededRng};
use std::collections::BTreeMap;
use std::time::Duration;

/// Held-out microbatches an evaluator keeps in flight at once.
const WINDOW: usize = 8;

/// Held-out microbatches a replica relays at once, for every evaluator together.
pub(super) const MAX_RELAYED: usize = 64;

/// Attempt ids of relayed held-out microbatches remembered at most (a replay is refused).
const MAX_REMEMBERED: usize = 4096;

/// A loss no honest last stage reports (the uniform guess over 2^32 tokens is 22).
const MAX_LOSS: f32 = 100.0;

/// The key whose ranking picks the evaluator of `step`: no averaging round has stage
/// `u32::MAX`, so the evaluator is not the leader of that step's round by construction.
pub(super) fn evaluator_key(step: u64) -> RoundKey {
    RoundKey {
        stage: u32::MAX,
        index: step,
    }
}

/// One held-out microbatch of the evaluation under way.
#[derive(Clone, Copy, Debug)]
struct Attempt {
    microbatch: u32,
    deadline: Duration,
    /// The replica of the next stage it went to.
    first_hop: Option<PeerKey>,
}

/// The evaluation this replica runs.
#[derive(Debug)]
struct UnderWay {
    step: u64,
    /// Microbatches of `rows` samples (the last may have fewer), in held-out sample order.
    microbatches: u32,
    /// The next microbatch to start.
    next: u32,
    live: BTreeMap<u64, Attempt>,
    /// Attempts started per microbatch.
    tries: BTreeMap<u32, u32>,
    /// Where each microbatch's last attempt went: a retry goes elsewhere if it can.
    last_hop: BTreeMap<u32, PeerKey>,
    /// Samples and loss of each microbatch done.
    losses: BTreeMap<u32, (u32, f32)>,
}

/// The evaluator's side: the evaluation this replica runs, if any, and the latest result
/// anyone announced.
#[derive(Debug)]
pub(super) struct Evaluator {
    under_way: Option<UnderWay>,
    /// The last step this replica evaluated, gave up on or left to another replica.
    settled: u64,
    /// The latest evaluation known, this replica's or announced.
    latest: Option<HeldOut>,
    ids: SeededRng,
    /// Until when a first-stage replica that took the last step holds back its `finished`
    /// announcement for the last evaluation (see [`Evaluator::holds_finish`]).
    final_wait: Option<Duration>,
    /// That wait is over.
    final_wait_over: bool,
}

/// What a loss from the last stage did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LossTaken {
    /// No honest last stage sends it (not finite, or huge): its attempt is tried again.
    Refused,
    /// Counted (or late, and ignored).
    Taken,
    /// It was the evaluation's last: the result is known.
    Completed,
}

/// What the peer needs of the run to evaluate.
#[derive(Clone, Copy, Debug)]
pub(super) struct Plan {
    /// Steps between evaluations (0: none).
    pub every: u64,
    /// The run's last step.
    pub max_steps: u64,
    /// Held-out samples per evaluation.
    pub samples: u32,
    /// Samples per microbatch.
    pub rows: u32,
    /// How long an attempt may take.
    pub deadline: Duration,
    /// Attempts per microbatch.
    pub max_attempts: u32,
}

impl Plan {
    /// How long the first stage waits for the last evaluation before it ends the run
    /// anyway: every microbatch's attempts, a window at a time.
    fn final_wait(&self) -> Duration {
        let windows = self
            .samples
            .div_ceil(self.rows.max(1))
            .div_ceil(WINDOW as u32);
        self.deadline * (self.max_attempts + windows + 1)
    }

    /// Whether `step` is evaluated.
    pub fn evaluates(&self, step: u64) -> bool {
        self.every > 0 && step > 0 && (step.is_multiple_of(self.every) || step == self.max_steps)
    }
}

impl Evaluator {
    /// An evaluator drawing attempt ids from `secret`, with every step up to `step` settled
    /// (a replica resumed from a checkpoint does not evaluate its step again).
    pub fn new(secret: u64, step: u64) -> Self {
        Evaluator {
            under_way: None,
            settled: step,
            latest: None,
            ids: SeededRng::new(secret),
            final_wait: None,
            final_wait_over: false,
        }
    }

    /// The latest evaluation known.
    pub fn latest(&self) -> Option<HeldOut> {
        self.latest
    }

    /// Whether `attempt` is one of this evaluator's.
    pub fn owns(&self, attempt: u64) -> bool {
        self.under_way
            .as_ref()
            .is_some_and(|u| u.live.contains_key(&attempt))
    }

    /// Drops the evaluation under way (this replica left the first stage).
    pub fn abandon(&mut self) {
        self.under_way = None;
    }

    /// The step of the evaluation under way.
    pub fn step(&self) -> Option<u64> {
        self.under_way.as_ref().map(|u| u.step)
    }

    /// The held-out sample and rows of an attempt of this evaluator.
    pub fn header(&self, attempt: u64, plan: &Plan) -> Option<(u64, u32)> {
        let a = self.under_way.as_ref()?.live.get(&attempt)?;
        Some(microbatch_samples(a.microbatch, plan))
    }

    /// Starts the evaluation of `step` if it is due and this replica is its evaluator among
    /// `replicas` (the first stage's, this one included); a step another replica evaluates
    /// is settled here.
    pub fn maybe_start(
        &mut self,
        out: &mut Outbox,
        me: PeerKey,
        step: u64,
        replicas: impl IntoIterator<Item = PeerKey>,
        plan: &Plan,
        now: Duration,
    ) {
        if step <= self.settled || !plan.evaluates(step) {
            return;
        }
        // The last evaluation goes before one still under way: the run ends after it.
        match &self.under_way {
            Some(u) if step >= plan.max_steps => {
                out.event(Event::Warning(format!(
                    "held-out evaluation of step {} given up for the run's last",
                    u.step
                )));
                self.under_way = None;
            }
            Some(_) => return,
            None => {}
        }
        self.settled = step;
        if evaluator_key(step).leader(replicas) != Some(me) {
            return;
        }
        self.under_way = Some(UnderWay {
            step,
            microbatches: plan.samples.div_ceil(plan.rows.max(1)),
            next: 0,
            live: BTreeMap::new(),
            tries: BTreeMap::new(),
            last_hop: BTreeMap::new(),
            losses: BTreeMap::new(),
        });
        self.pump(out, plan, now);
    }

    /// Starts microbatches while the window has room.
    fn pump(&mut self, out: &mut Outbox, plan: &Plan, now: Duration) {
        let Some(u) = self.under_way.as_mut() else {
            return;
        };
        while u.live.len() < WINDOW && u.next < u.microbatches {
            let m = u.next;
            u.next += 1;
            start(out, &mut self.ids, u, m, plan, now);
        }
    }

    /// The last stage's loss on `attempt`. An answer to an attempt that is not live is
    /// late, not a lie: taken and ignored.
    pub fn on_loss(
        &mut self,
        out: &mut Outbox,
        me: PeerKey,
        attempt: u64,
        loss: f32,
        plan: &Plan,
        now: Duration,
    ) -> LossTaken {
        if !(loss.is_finite() && (0.0..=MAX_LOSS).contains(&loss)) {
            // Tried again elsewhere at once rather than at its deadline.
            self.fail(out, attempt, plan, now);
            return LossTaken::Refused;
        }
        let Some(u) = self.under_way.as_mut() else {
            return LossTaken::Taken;
        };
        let Some(a) = u.live.remove(&attempt) else {
            return LossTaken::Taken;
        };
        let (_, rows) = microbatch_samples(a.microbatch, plan);
        u.losses.entry(a.microbatch).or_insert((rows, loss));
        // A retried microbatch may still have an attempt out: it is done now.
        u.live.retain(|_, other| other.microbatch != a.microbatch);
        if u.losses.len() as u32 == u.microbatches {
            let (samples, sum) = u
                .losses
                .values()
                .fold((0u64, 0.0f64), |(n, s), (rows, loss)| {
                    (
                        n + u64::from(*rows),
                        s + f64::from(*rows) * f64::from(*loss),
                    )
                });
            let held_out = HeldOut {
                step: u.step,
                loss: (sum / samples.max(1) as f64) as f32,
                by: me,
            };
            self.under_way = None;
            self.learn(out, held_out);
            LossTaken::Completed
        } else {
            self.pump(out, plan, now);
            LossTaken::Taken
        }
    }

    /// The attempt's activations went to `first_hop`.
    pub fn sent(&mut self, attempt: u64, first_hop: PeerKey) {
        if let Some(u) = self.under_way.as_mut()
            && let Some(a) = u.live.get_mut(&attempt)
        {
            a.first_hop = Some(first_hop);
            u.last_hop.insert(a.microbatch, first_hop);
        }
    }

    /// The replica the attempt's microbatch went to last time, to avoid.
    pub fn previous_hop(&self, attempt: u64) -> Option<PeerKey> {
        let u = self.under_way.as_ref()?;
        u.last_hop.get(&u.live.get(&attempt)?.microbatch).copied()
    }

    /// `peer` is gone or unreachable: the attempts that went to it are tried again now.
    pub fn fail_hop(&mut self, out: &mut Outbox, peer: PeerKey, plan: &Plan, now: Duration) {
        let through: Vec<u64> = self
            .under_way
            .as_ref()
            .map(|u| {
                u.live
                    .iter()
                    .filter(|(_, a)| a.first_hop == Some(peer))
                    .map(|(id, _)| *id)
                    .collect()
            })
            .unwrap_or_default();
        for id in through {
            self.fail(out, id, plan, now);
        }
    }

    /// The route of `attempt` failed (a hop rejected it, or it could not be sent): it is
    /// tried again now.
    pub fn fail(&mut self, out: &mut Outbox, attempt: u64, plan: &Plan, now: Duration) {
        let Some(a) = self
            .under_way
            .as_mut()
            .and_then(|u| u.live.remove(&attempt))
        else {
            return;
        };
        self.retry(out, a.microbatch, plan, now);
    }

    fn retry(&mut self, out: &mut Outbox, microbatch: u32, plan: &Plan, now: Duration) {
        let Some(u) = self.under_way.as_mut() else {
            return;
        };
        if u.tries.get(&microbatch).copied().unwrap_or(0) >= plan.max_attempts {
            out.event(Event::Warning(format!(
                "held-out evaluation of step {} given up: a microbatch failed {} times",
                u.step, plan.max_attempts
            )));
            self.under_way = None;
            return;
        }
        start(out, &mut self.ids, u, microbatch, plan, now);
    }

    /// Retries the attempts past their deadline; past the last step, lets a first-stage
    /// replica's `finished` go out once the wait for the last evaluation is over.
    pub fn expire(&mut self, out: &mut Outbox, plan: &Plan, now: Duration) {
        let overdue: Vec<(u64, u32)> = self
            .under_way
            .as_ref()
            .map(|u| {
                u.live
                    .iter()
                    .filter(|(_, a)| now >= a.deadline)
                    .map(|(id, a)| (*id, a.microbatch))
                    .collect()
            })
            .unwrap_or_default();
        for (id, microbatch) in overdue {
            if let Some(u) = self.under_way.as_mut() {
                u.live.remove(&id);
            }
            self.retry(out, microbatch, plan, now);
        }
    }

    /// The earliest deadline of the evaluation under way, and the end of the wait for the
    /// last one.
    pub fn next_timeout(&self) -> Option<Duration> {
        let attempts = self
            .under_way
            .as_ref()
            .and_then(|u| u.live.values().map(|a| a.deadline).min());
        [attempts, self.final_wait].into_iter().flatten().min()
    }

    /// An evaluation this peer heard of (its own, or a first-stage replica's announcement).
    /// Returns whether it is news (a later step than any known): every peer reports each
    /// step once.
    pub fn learn(&mut self, out: &mut Outbox, held_out: HeldOut) -> bool {
        if self.latest.is_some_and(|l| l.step >= held_out.step) {
            return false;
        }
        self.latest = Some(held_out);
        out.event(Event::HeldOut(held_out));
        true
    }

    /// Whether an announced evaluation has values an honest evaluator sends.
    pub fn plausible(held_out: &HeldOut, plan: &Plan) -> bool {
        held_out.loss.is_finite()
            && (0.0..=MAX_LOSS).contains(&held_out.loss)
            && held_out.step <= plan.max_steps
            && plan.evaluates(held_out.step)
    }

    /// Whether a first-stage replica that took the run's last step should not announce it
    /// yet: the other stages end once a first-stage replica has, and the last evaluation
    /// needs them. It holds until the evaluation of the last step is known, or for
    /// [`Plan::final_wait`] (see [`Evaluator::watch_final`]): an evaluator that never
    /// reports delays the end by that much at most.
    pub fn holds_finish(&self, plan: &Plan) -> bool {
        plan.evaluates(plan.max_steps)
            && self.latest.is_none_or(|l| l.step < plan.max_steps)
            && !self.final_wait_over
    }

    /// Times the wait of [`Evaluator::holds_finish`]; called while a first-stage replica
    /// has taken the last step.
    pub fn watch_final(&mut self, out: &mut Outbox, plan: &Plan, now: Duration) {
        if !self.holds_finish(plan) {
            self.final_wait = None;
            return;
        }
        let until = *self.final_wait.get_or_insert(now + plan.final_wait());
        if now < until {
            return;
        }
        self.final_wait_over = true;
        self.final_wait = None;
        if let Some(u) = self.under_way.take() {
            out.event(Event::Warning(format!(
                "held-out evaluation of step {} given up: out of time at the run's end",
                u.step
            )));
        }
    }
}

/// Starts an attempt of `microbatch`.
fn start(
    out: &mut Outbox,
    ids: &mut SeededRng,
    u: &mut UnderWay,
    microbatch: u32,
    plan: &Plan,
    now: Duration,
) {
    let id = ids.next_u64();
    *u.tries.entry(microbatch).or_default() += 1;
    u.live.insert(
        id,
        Attempt {
            microbatch,
            deadline: now + plan.deadline,
            first_hop: None,
        },
    );
    let (sample, rows) = microbatch_samples(microbatch, plan);
    out.compute(Job::Forward {
        id,
        rows,
        sample,
        input: Input::Tokens,
        held_out: true,
    });
}

/// The first held-out sample and the samples of microbatch `m`.
fn microbatch_samples(m: u32, plan: &Plan) -> (u64, u32) {
    let rows = plan.rows.max(1);
    let first = m * rows;
    (
        u64::from(first),
        rows.min(plan.samples.saturating_sub(first)),
    )
}

/// A held-out microbatch this replica computes for an evaluator.
#[derive(Clone, Debug)]
struct Relayed {
    route: Vec<PeerKey>,
    rows: u32,
    sample: u64,
    step: u64,
    expires: Duration,
}

/// The relay's side: held-out microbatches this replica computes for evaluators.
#[derive(Debug, Default)]
pub(super) struct Relays {
    relayed: BTreeMap<u64, Relayed>,
    /// Attempts relayed lately, until their record would have expired: a replayed one is
    /// refused.
    done: BTreeMap<u64, Duration>,
}

/// Whom a held-out microbatch passed, as the relay checks them.
pub(super) struct Sender {
    /// Whether the route's first peer (its evaluator) is a replica of the first stage.
    pub evaluator_is_a_driver: bool,
    /// Whether the sender is a replica of the stage before this one.
    pub sender_serves_previous: bool,
}

impl Relays {
    /// Whether `attempt` is a held-out microbatch relayed here.
    pub fn holds(&self, attempt: u64) -> bool {
        self.relayed.contains_key(&attempt)
    }

    /// A held-out microbatch arrived. The checks are a training forward pass's (see
    /// `StageServer::on_forward`), less the step: an evaluation is never held.
    /// `training` says whether an attempt id is one of the replica's training microbatches.
    #[allow(clippy::too_many_arguments)]
    pub fn on_evaluate(
        &mut self,
        out: &mut Outbox,
        from: PeerKey,
        f: Forward,
        at: &Serving,
        who: &Sender,
        plan: &Plan,
        training: impl Fn(u64) -> bool,
        activation_norms: &NormReference,
        now: Duration,
    ) {
        let here = f.route.len() as u32;
        let evaluator = f.route.first().copied().unwrap_or(from);
        let samples = u64::from(f.rows).saturating_add(f.sample);
        let repeated =
            self.relayed.contains_key(&f.id) || self.done.contains_key(&f.id) || training(f.id);
        let forged = forged_forward(&f, from, at, repeated)
            .or_else(|| {
                (samples > u64::from(plan.samples))
                    .then_some("a held-out forward pass of samples outside the held-out set")
            })
            .or_else(|| {
                (!plan.evaluates(f.round))
                    .then_some("a held-out forward pass of a step the run does not evaluate")
            });
        if let Some(what) = forged {
            out.violation(from, what);
        }
        // Not ours to judge as lies (a view a little old), but not worked for either: only
        // a first-stage replica's evaluations, passed on by the stage before, each evaluator
        // its window at a time.
        let busy = self.relayed.len() >= MAX_RELAYED
            || self.done.len() >= MAX_REMEMBERED
            || self
                .relayed
                .values()
                .filter(|r| r.route.first() == Some(&evaluator))
                .count()
                >= WINDOW;
        if forged.is_some()
            || at.stage != Some(here)
            || !who.evaluator_is_a_driver
            || !who.sender_serves_previous
            || busy
        {
            out.send(evaluator, Message::Reject { id: f.id });
            return;
        }
        // Held-out activations are checked against the stage's sizes but do not join them.
        let Some(acts) = accepted_activations(out, from, evaluator, &f, at, |rms| {
            activation_norms.fits(rms)
        }) else {
            return;
        };
        self.relayed.insert(
            f.id,
            Relayed {
                route: f.route,
                rows: f.rows,
                sample: f.sample,
                step: f.round,
                expires: now + at.hop_lifetime,
            },
        );
        out.compute(Job::Forward {
            id: f.id,
            rows: f.rows,
            sample: f.sample,
            input: Input::Activations(acts),
            held_out: true,
        });
    }

    /// A relayed microbatch's forward pass is done: what its activations carry on (the
    /// route with `me` appended, rows, sample, step) and its evaluator. The record is gone
    /// either way: nothing comes back through here.
    pub fn done(&mut self, me: PeerKey, attempt: u64) -> Option<(Forward, PeerKey)> {
        let r = self.relayed.remove(&attempt)?;
        self.done.insert(attempt, r.expires);
        let evaluator = *r.route.first()?;
        let mut route = r.route;
        route.push(me);
        Some((
            Forward {
                id: attempt,
                sample: r.sample,
                round: r.step,
                rows: r.rows,
                route,
                activations: Vec::new(),
            },
            evaluator,
        ))
    }

    /// Forgets records whose forward pass never ran (the stage was replaced meanwhile).
    pub fn expire(&mut self, now: Duration) {
        self.relayed.retain(|_, r| r.expires > now);
        self.done.retain(|_, expires| *expires > now);
    }

    /// When the next record expires.
    pub fn next_timeout(&self) -> Option<Duration> {
        self.relayed
            .values()
            .map(|r| r.expires)
            .chain(self.done.values().copied())
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: PeerKey = PeerKey(1);
    const S: Duration = Duration::from_secs(1);

    fn plan() -> Plan {
        Plan {
            every: 10,
            max_steps: 25,
            samples: 50,
            rows: 4,
            deadline: S,
            max_attempts: 2,
        }
    }

    /// The attempt ids of the held-out forward jobs queued.
    fn started(out: &mut Outbox) -> Vec<(u64, u64, u32)> {
        std::iter::from_fn(|| {
            let job = out.jobs.next(Duration::ZERO);
            if job.is_some() {
                out.jobs.finished(Duration::ZERO);
            }
            job
        })
        .filter_map(|j| match j {
            Job::Forward {
                id,
                sample,
                rows,
                held_out: true,
                ..
            } => Some((id, sample, rows)),
            _ => None,
        })
        .collect()
    }

    fn results(out: &mut Outbox) -> Vec<HeldOut> {
        out.drain()
            .into_iter()
            .filter_map(|a| match a {
                Action::Event(Event::HeldOut(h)) => Some(h),
                _ => None,
            })
            .collect()
    }

    use super::super::interface::Action;

    #[test]
    fn an_evaluation_covers_every_held_out_sample_once_and_weighs_microbatches_by_samples() {
        let (mut e, mut out, p) = (Evaluator::new(7, 0), Outbox::new(ME), plan());
        // Not a step that is evaluated; then one that is, and this replica leads it.
        e.maybe_start(&mut out, ME, 9, [ME], &p, Duration::ZERO);
        assert!(started(&mut out).is_empty());
        e.maybe_start(&mut out, ME, 10, [ME], &p, Duration::ZERO);
        let mut samples = Vec::new();
        let mut first = started(&mut out);
        assert_eq!(first.len(), WINDOW, "a window at a time");
        // A refused loss changes nothing; an attempt's route fails and is tried again.
        assert_eq!(
            e.on_loss(&mut out, ME, first[0].0, f32::NAN, &p, S),
            LossTaken::Refused
        );
        e.fail(&mut out, first[0].0, &p, S);
        first.remove(0);
        first.extend(started(&mut out));
        let mut pending = first;
        while let Some((id, sample, rows)) = pending.pop() {
            samples.extend(sample..sample + u64::from(rows));
            // The last microbatch (2 samples) scores 1, the others 2.
            let loss = if rows == 4 { 2.0 } else { 1.0 };
            let taken = e.on_loss(&mut out, ME, id, loss, &p, S);
            // The last of them completes the evaluation.
            let expected = if e.step().is_none() {
                LossTaken::Completed
            } else {
                LossTaken::Taken
            };
            assert_eq!(taken, expected);
            pending.extend(started(&mut out));
        }
        samples.sort_unstable();
        assert_eq!(samples, (0..50).collect::<Vec<u64>>());
        let r = results(&mut out);
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].step, r[0].by), (10, ME));
        assert!((r[0].loss - (48.0 * 2.0 + 2.0) / 50.0).abs() < 1e-6);
        // The same step is not evaluated twice.
        e.maybe_start(&mut out, ME, 10, [ME], &p, S);
        assert!(started(&mut out).is_empty());
    }

    #[test]
    fn attempts_through_a_lost_peer_are_retried_at_once_and_elsewhere() {
        let (mut e, mut out, p) = (Evaluator::new(7, 0), Outbox::new(ME), plan());
        e.maybe_start(&mut out, ME, 10, [ME], &p, Duration::ZERO);
        let first = started(&mut out);
        let (lost, kept) = (PeerKey(5), PeerKey(6));
        e.sent(first[0].0, lost);
        e.sent(first[1].0, kept);
        e.fail_hop(&mut out, lost, &p, S);
        let retried = started(&mut out);
        assert_eq!(retried.len(), 1, "only the attempt through the lost peer");
        assert_eq!(retried[0].1, first[0].1, "the same samples");
        assert_eq!(e.previous_hop(retried[0].0), Some(lost), "to be avoided");
        assert!(!e.owns(first[0].0) && e.owns(first[1].0));
    }

    #[test]
    fn an_evaluation_that_keeps_failing_is_given_up_and_the_end_waits_a_bounded_time() {
        let (mut e, mut out, p) = (Evaluator::new(7, 0), Outbox::new(ME), plan());
        // Another replica leads step 20: settled here without a job.
        let other = PeerKey(2);
        let leader = evaluator_key(20).leader([ME, other]).unwrap();
        let follower = if leader == ME { other } else { ME };
        e.maybe_start(&mut out, follower, 20, [ME, other], &p, Duration::ZERO);
        assert!(started(&mut out).is_empty());
        // The last step (25) is evaluated whatever `every` says; each attempt times out.
        e.maybe_start(&mut out, ME, 25, [ME], &p, Duration::ZERO);
        let mut now = Duration::ZERO;
        for _ in 0..p.max_attempts {
            assert!(!started(&mut out).is_empty());
            now += 2 * S;
            e.expire(&mut out, &p, now);
        }
        assert!(e.step().is_none(), "given up after its attempts");
        // Until the last evaluation is known, the first stage holds back its end, for a
        // bounded time only.
        assert!(e.holds_finish(&p));
        e.watch_final(&mut out, &p, now);
        assert!(e.holds_finish(&p));
        e.watch_final(&mut out, &p, now + 60 * S);
        assert!(!e.holds_finish(&p));
        // A result heard from another replica ends the wait at once.
        let mut e = Evaluator::new(7, 0);
        assert!(e.holds_finish(&p));
        let heard = HeldOut {
            step: 25,
            loss: 3.0,
            by: other,
        };
        assert!(Evaluator::plausible(&heard, &p));
        assert!(!Evaluator::plausible(&HeldOut { step: 24, ..heard }, &p));
        assert!(!Evaluator::plausible(
            &HeldOut {
                loss: -1.0,
                ..heard
            },
            &p
        ));
        assert!(e.learn(&mut out, heard));
        assert!(!e.learn(&mut out, heard), "each step once");
        assert!(!e.holds_finish(&p));
    }
}
