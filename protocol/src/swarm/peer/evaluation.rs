//! The held-out evaluation through a peer's parts (see [`crate::swarm::evaluation`]): a
//! first-stage replica starting the evaluation it is due to run, a held-out microbatch
//! passed on to the next stage or answered with its loss, and the results heard of.

use super::Peer;
use crate::swarm::PeerKey;
use crate::swarm::SyncMode;
use crate::swarm::evaluation::{Evaluator, LossTaken, Plan, Sender, evaluator_key};
use crate::swarm::interface::Output;
use crate::swarm::membership::Standing;
use crate::swarm::message::{Announcement, Forward, HeldOut, MemberState, Message};
use std::time::Duration;

impl Peer {
    pub(super) fn evaluation_plan(&self) -> Plan {
        let e = &self.config.evaluation;
        Plan {
            every: e.every,
            max_steps: self.config.max_steps,
            samples: e.samples,
            rows: self.config.microbatch,
            deadline: self.driver.microbatch_deadline(&self.timing),
            max_attempts: self.timing.max_attempts,
        }
    }

    /// Whether this peer holds back its `finished` announcement for the run's last
    /// evaluation (see [`Evaluator::holds_finish`]).
    pub(super) fn holds_finish(&self) -> bool {
        self.is_driver() && self.evaluator.holds_finish(&self.evaluation_plan())
    }

    /// Starts the evaluation due at this step if this replica runs it, and times the wait
    /// for the last one.
    pub(super) fn evaluate(&mut self, now: Duration) {
        if self.config.evaluation.every == 0 {
            return;
        }
        if !self.is_driver() {
            // Moved off the first stage: its held-out microbatches can no longer start here.
            self.evaluator.abandon();
            return;
        }
        let plan = self.evaluation_plan();
        if self.steps.finished() {
            let held = self.evaluator.holds_finish(&plan);
            self.evaluator.watch_final(&mut self.out, &plan, now);
            if held && !self.evaluator.holds_finish(&plan) {
                // The wait is over: the other stages learn that this one finished.
                self.announce();
            }
        }
        if !self.pipeline_ready() {
            return;
        }
        let step = self.evaluation_step();
        let candidates = self.evaluators();
        self.evaluator
            .maybe_start(&mut self.out, self.me, step, candidates, &plan, now);
    }

    /// The step the model is at for an evaluation: the steps taken in allreduce mode; in
    /// DiLoCo, the steps of the outer rounds applied (a replica's local steps in between are
    /// its own), the run's last once it is finished.
    pub(super) fn evaluation_step(&self) -> u64 {
        match self.config.sync {
            SyncMode::AllReduce => self.steps.step(),
            SyncMode::DiLoCo { .. } if self.steps.finished() => self.config.max_steps,
            SyncMode::DiLoCo { h, .. } => self
                .steps
                .round()
                .saturating_mul(u64::from(h))
                .min(self.config.max_steps),
        }
    }

    /// The first-stage replicas one of which runs each evaluation ([`evaluator_key`]): those
    /// this peer vouches for (an identity that never worked ranks nowhere), itself included.
    fn evaluators(&self) -> Vec<PeerKey> {
        let mut replicas = self.members.vouched_replicas(0);
        if self.is_driver() {
            replicas.push(self.me);
        }
        replicas
    }

    /// A held-out microbatch arrived from the previous stage.
    pub(super) fn on_evaluate(&mut self, from: PeerKey, f: Forward, now: Duration) {
        let at = self.serving();
        let here = f.route.len() as u32;
        let evaluator = f.route.first().copied().unwrap_or(from);
        let who = Sender {
            evaluator_is_a_driver: self.members.standing(evaluator, 0) == Standing::Replica,
            sender_serves_previous: here > 0
                && self.members.standing(from, here - 1) == Standing::Replica,
        };
        let plan = self.evaluation_plan();
        let server = &self.server;
        self.relays.on_evaluate(
            &mut self.out,
            from,
            f,
            &at,
            &who,
            &plan,
            |id| server.holds(id),
            &self.server.activation_norms,
            now,
        );
    }

    /// The last stage's loss on one of this peer's held-out microbatches.
    pub(super) fn on_evaluated(&mut self, from: PeerKey, id: u64, loss: f32, now: Duration) {
        let last = self.config.stages - 1;
        match self.members.get(from).map(|m| m.announcement.stage) {
            Some(Some(stage)) if stage == last => {}
            Some(None) => {
                self.out
                    .violation(from, "a held-out loss from a peer that serves no stage");
                return;
            }
            // Moved, or not heard of yet: its attempt times out instead.
            _ => return,
        }
        if self.take_loss(id, loss, now) == LossTaken::Refused {
            self.out
                .violation(from, "a held-out loss no model gives (not finite or huge)");
        }
    }

    /// The last stage's loss on one of this peer's held-out microbatches (its own, in a
    /// pipeline of one stage). The evaluation's result, once complete, goes to everyone at
    /// once: the other first-stage replicas may be waiting for it to finish.
    fn take_loss(&mut self, id: u64, loss: f32, now: Duration) -> LossTaken {
        let plan = self.evaluation_plan();
        let me = self.me;
        let taken = self
            .evaluator
            .on_loss(&mut self.out, me, id, loss, &plan, now);
        if taken == LossTaken::Completed {
            self.announce();
        }
        taken
    }

    /// `peer` is gone or unreachable: this peer's held-out microbatches sent to it are
    /// tried again now.
    pub(super) fn held_out_hop_failed(&mut self, peer: PeerKey, now: Duration) {
        let plan = self.evaluation_plan();
        self.evaluator.fail_hop(&mut self.out, peer, &plan, now);
    }

    /// A held-out microbatch's route failed; it is retried if it is this peer's.
    pub(super) fn held_out_failed(&mut self, id: u64, now: Duration) {
        let plan = self.evaluation_plan();
        self.evaluator.fail(&mut self.out, id, &plan, now);
    }

    /// Whether `id` is a held-out microbatch, this peer's or relayed.
    pub(super) fn is_held_out(&self, id: u64) -> bool {
        self.evaluator.owns(id) || self.relays.holds(id)
    }

    /// The forward pass of a held-out microbatch is done: its activations go on to the next
    /// stage, or its loss to its evaluator.
    pub(super) fn on_held_out_done(&mut self, id: u64, output: Output, now: Duration) {
        let plan = self.evaluation_plan();
        let own = self.evaluator.header(id, &plan).map(|(sample, rows)| {
            let step = self.evaluator.step().unwrap_or(0);
            let f = Forward {
                id,
                sample,
                round: step,
                rows,
                route: vec![self.me],
                activations: Vec::new(),
            };
            (f, self.me)
        });
        let Some((mut f, evaluator)) = own.or_else(|| self.relays.done(self.me, id)) else {
            return;
        };
        let mine = evaluator == self.me;
        match output {
            Output::Loss(loss) if mine => {
                self.take_loss(id, loss, now);
            }
            Output::Loss(loss) => self.out.send(evaluator, Message::Evaluated { id, loss }),
            Output::Activations(activations) => {
                let next_stage = self.role.stage().unwrap_or(0) + 1;
                let avoid = self.evaluator.previous_hop(id);
                let service = &self.service;
                let next =
                    self.members
                        .route(next_stage, avoid, self.routing, &mut self.dealer, |k| {
                            service.observed(k)
                        });
                let encoded = next.and_then(|to| {
                    let codec =
                        self.hop_codec(to, self.config.codecs.activations, activations.len());
                    self.server.encode(&mut self.out, codec, &activations)
                });
                match (next, encoded) {
                    (Some(next), Some(activations)) => {
                        if mine {
                            self.evaluator.sent(id, next);
                        }
                        f.activations = activations;
                        self.out.send(next, Message::Evaluate(f));
                    }
                    _ if mine => self.held_out_failed(id, now),
                    _ => self.out.send(evaluator, Message::Reject { id }),
                }
            }
        }
    }

    /// A held-out forward job failed here.
    pub(super) fn held_out_job_failed(&mut self, id: u64, now: Duration) {
        if self.evaluator.owns(id) {
            self.held_out_failed(id, now);
        } else if let Some((_, evaluator)) = self.relays.done(self.me, id) {
            self.out.send(evaluator, Message::Reject { id });
        }
    }

    /// An evaluation a first-stage replica announced with `announced` (what a serving
    /// replica says of itself). Only one of a step the announcer reached counts: a result
    /// for a later step would hide the real ones until then.
    pub(super) fn heard_held_out(
        &mut self,
        from: PeerKey,
        announced: &Announcement,
        held_out: HeldOut,
    ) {
        let plan = self.evaluation_plan();
        // Its own result, of a step it ran: the one that ranks first for the step among the
        // first-stage replicas this peer vouches for (another would be a forgery, or a view
        // that differs, whose result is missed rather than risked).
        if held_out.by == from
            && announced.stage == Some(0)
            && announced.state == MemberState::Serving
            && held_out.step <= announced.step
            && Evaluator::plausible(&held_out, &plan)
            && evaluator_key(held_out.step).leader(self.evaluators()) == Some(from)
            && self.evaluator.learn(&mut self.out, held_out)
            && held_out.step >= plan.max_steps
            && self.is_driver()
        {
            // The last one: the wait for it is over.
            self.announce();
        }
    }
}
