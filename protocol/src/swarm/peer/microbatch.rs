//! The microbatch path through a peer's parts: a driver starting microbatches, a forward
//! pass arriving, its activations passed on to a replica of the next stage, the gradient
//! coming back, and the commit. Each step is a call into the part that owns it (driver,
//! stage server, step coordinator); what this file adds is the order of the calls and which
//! part an attempt belongs to (the driver's own, or a hop for another driver).

use super::Peer;
use crate::swarm::PeerKey;
use crate::swarm::config::SyncMode;
use crate::swarm::driver;
use crate::swarm::interface::{Event, Job, Output};
use crate::swarm::membership::Routing;
use crate::swarm::message::{Backward, Forward, MemberState, Message};
use crate::swarm::norms;
use crate::swarm::server::{self, Arrival, ForwardHeader, PendingCommit, Serving};
use crate::{Codec, HopCodec};
use std::time::Duration;

impl Peer {
    pub(super) fn activation_len(&self, rows: u32) -> usize {
        self.costs.activation_values * rows as usize
    }

    /// How long a hop record lives: every attempt of its microbatch may have timed out.
    pub(super) fn hop_lifetime(&self) -> Duration {
        self.driver.microbatch_deadline(&self.timing) * (self.timing.max_attempts + 1)
    }

    /// What the stage server checks microbatches against.
    pub(super) fn serving(&self) -> Serving {
        Serving {
            stage: self.role.serving(),
            last: self.is_last_stage(),
            round: self.allreduce().then(|| self.steps.round()),
            microbatch: self.config.microbatch,
            activation_values: self.costs.activation_values,
            activation_codecs: self.config.codecs.activations,
            hop_lifetime: self.hop_lifetime(),
            max_hops: self.max_hops(),
        }
    }

    /// Microbatch records a replica keeps for drivers at most: every attempt of two steps'
    /// microbatches (a step being collected and the next one, all of whose attempts may still
    /// be alive), and never fewer than 64.
    fn max_hops(&self) -> usize {
        let per_step = self
            .config
            .global_batch
            .div_ceil(self.config.microbatch.max(1)) as usize;
        (2 * per_step * (self.timing.max_attempts as usize + 1)).max(64)
    }

    pub(super) fn pipeline_ready(&self) -> bool {
        self.stage_replicas().iter().all(|c| *c > 0)
    }

    /// The run is over as far as this peer is concerned: its stage took the run's last step
    /// and its replicas agree on where it ended; every replica of its stage it vouches for
    /// took the last step (a banned one's word is not waited for); and every other stage has
    /// a replica that took it. A laggard of another stage is its own stage's to wait for and
    /// catch up: waiting for it here would let an identity banned by its own stage, which
    /// the others cannot judge, keep the whole swarm from ending by announcing it is behind.
    pub(super) fn everyone_finished(&self) -> bool {
        let Some(stage) = self.role.serving() else {
            return false;
        };
        if !(self.steps.finished() && self.steps.stage_agrees(stage, &self.members))
            || self.holds_finish()
        {
            return false;
        }
        let vouched = self.members.vouched(stage);
        let mut stage_ended = vec![false; self.config.stages as usize];
        let mut stage_served = vec![false; self.config.stages as usize];
        for (k, m) in self.members.iter() {
            let a = &m.announcement;
            let Some(s) = a.stage.filter(|_| a.state == MemberState::Serving) else {
                continue;
            };
            if self.bans.is_banned(*k) {
                continue;
            }
            if s == stage && vouched(*k) && !a.finished {
                return false;
            }
            if let Some(i) = usize::try_from(s).ok().filter(|i| *i < stage_ended.len()) {
                stage_served[i] = true;
                stage_ended[i] |= a.finished;
            }
        }
        stage_served
            .iter()
            .zip(&stage_ended)
            .enumerate()
            .all(|(i, (served, ended))| i == stage as usize || !served || *ended)
    }

    /// Starts what the step needs, if this peer drives.
    pub(super) fn pump(&mut self, now: Duration) {
        self.driver.rest();
        self.evaluate(now);
        if self.everyone_finished() {
            if !self.finish_reported {
                self.finish_reported = true;
                self.out.event(Event::Finished);
            }
            return;
        }
        if !self.is_driver() || !self.pipeline_ready() {
            return;
        }
        let own = self.out.jobs.throughput();
        let mut placements = self.measured_placements(own);
        let c = &self.config;
        let window = self
            .driver
            .window(&placements, &self.costs, &self.timing, own, c.microbatch);
        let weighted = self.allreduce() && self.routing == Routing::Weighted;
        // The step is dealt out over the drivers whose work this one checked: an identity
        // that announces a driver's throughput and never drives would keep its part unfilled.
        {
            let vouched = self.members.vouched(0);
            placements.retain(|p| p.stage != 0 || p.peer == self.me || vouched(p.peer));
        }
        let share = driver::share(
            &placements,
            self.me,
            own,
            weighted,
            c.global_batch,
            c.microbatch,
        );
        let demand = self
            .steps
            .demand(&self.members, share, self.server.commits_queued(), now);
        let rows = c.microbatch;
        let started = self.driver.pump(
            &mut self.out,
            self.me,
            &demand,
            window,
            rows,
            &self.timing,
            now,
        );
        if started && self.allreduce() {
            self.send_progress();
        }
    }

    pub(super) fn on_forward(&mut self, from: PeerKey, f: Forward, now: Duration) {
        if self.relays.holds(f.id) {
            // The id of a held-out microbatch relayed here: its result would be taken for
            // the other's.
            self.out
                .violation(from, "a forward pass repeating an attempt id");
            let driver = f.route.first().copied().unwrap_or(from);
            self.out.send(driver, Message::Reject { id: f.id });
            return;
        }
        let at = self.serving();
        if self.server.on_forward(&mut self.out, from, f, &at, now) == Arrival::Held {
            self.maybe_begin_round(now);
        }
    }

    /// Runs the held microbatches whose step this replica has reached.
    pub(super) fn release_held_forwards(&mut self, now: Duration) {
        for h in self.server.release_held_forwards(self.steps.round()) {
            self.on_forward(h.from, h.forward, now);
        }
    }

    pub(super) fn on_forward_done(&mut self, id: u64, output: Output, now: Duration) {
        let activations = match output {
            Output::Activations(a) => a,
            Output::Loss(loss) => {
                // The last stage: the backward pass starts here.
                let rows = if let Some(rows) = self.server.record_loss(id, loss) {
                    rows
                } else if let Some((sample, rows)) = self.driver.came_home_locally(self.me, id) {
                    self.server
                        .expect_commit(id, self.me, sample, rows, Some(loss));
                    rows
                } else {
                    0
                };
                self.out.compute(Job::Backward {
                    id,
                    grad: None,
                    rows,
                });
                return;
            }
        };
        let own = self.driver.entry(id).map(|e| ForwardHeader {
            route: vec![self.me],
            rows: e.rows,
            sample: e.sample,
            round: e.round,
        });
        let owned = own.is_some();
        let header = own.or_else(|| self.server.forwarding(self.me, id));
        let Some(h) = header else {
            // Aborted meanwhile.
            self.out.compute(Job::Abort { id });
            return;
        };
        let next_stage = self.role.stage().unwrap_or(0) + 1;
        let avoid = self.driver.previous_hop(id);
        let service = &self.service;
        let next = self
            .members
            .route(next_stage, avoid, self.routing, &mut self.dealer, |k| {
                service.observed(k)
            });
        let encoded = next.and_then(|to| {
            let codec = self.hop_codec(to, self.config.codecs.activations, activations.len());
            self.server.encode(&mut self.out, codec, &activations)
        });
        let (Some(next), Some(activations)) = (next, encoded) else {
            // No replica of the next stage, or activations that cannot be sent: this attempt
            // ends here and its driver retries it.
            self.out.compute(Job::Abort { id });
            if owned {
                self.driver.fail(id, now);
            } else {
                self.server.reject(&mut self.out, id);
            }
            return;
        };
        if owned {
            self.driver.sent(id, next);
        } else {
            self.server.sent(id, next);
        }
        let lifetime = self.hop_lifetime();
        self.service.sent(id, next, now, lifetime);
        self.out.send(
            next,
            Message::Forward(Forward {
                id,
                sample: h.sample,
                round: h.round,
                rows: h.rows,
                route: h.route,
                activations,
            }),
        );
    }

    pub(super) fn on_backward(&mut self, from: PeerKey, b: Backward, now: Duration) {
        let Some(stage) = self.role.serving() else {
            return;
        };
        if !self.config.codecs.activation_grads.allows(&b.grad) {
            self.out.violation(
                from,
                "an activation gradient in a codec the run does not allow",
            );
            return;
        }
        let Some(grad) = server::decode(&b.grad, self.activation_len(self.config.microbatch))
        else {
            self.out.violation(
                from,
                "an activation gradient malformed, too large or not finite",
            );
            return;
        };
        if stage == 0 && self.driver.entry(b.id).is_some() {
            let size = norms::rms(&grad);
            if !self.server.gradient_norms.fits(size) {
                // The attempt times out and is retried.
                self.out.violation(
                    from,
                    "an activation gradient far larger than this stage has seen",
                );
                return;
            }
            let (id, values) = (b.id, grad.len());
            let (stages, per_sample) = (self.config.stages, self.costs.activation_values);
            let accepted = self.driver.came_home(
                &mut self.out,
                self.me,
                id,
                b.route,
                values,
                stages,
                per_sample,
            );
            if let Some((sample, rows)) = accepted {
                self.service.answered(id, from, now);
                self.members.set_checked(from, true, true);
                self.server.gradient_norms.record(size);
                self.server.expect_commit(id, self.me, sample, rows, None);
                self.out.compute(Job::Backward {
                    id,
                    grad: Some(grad),
                    rows,
                });
            }
            return;
        }
        let at = self.serving();
        let id = b.id;
        // Only a gradient taken counts as the replica's answer: one refused leaves the
        // microbatch to time out, late.
        if self
            .server
            .on_backward(&mut self.out, from, b, grad, &at, now)
        {
            self.service.answered(id, from, now);
            self.members.set_checked(from, true, true);
        }
    }

    /// The peer a microbatch's activations went to discarded the gradient it got for them
    /// (see [`Peer::gradient_judged`]): this hop drops its part of the microbatch too, and
    /// the driver commits it for the hops after.
    pub(super) fn on_discarded(
        &mut self,
        from: PeerKey,
        id: u64,
        route: Vec<PeerKey>,
        now: Duration,
    ) {
        let Some(stage) = self.role.serving() else {
            return;
        };
        if let Some(rows) = self.driver.entry(id).map(|e| e.rows).filter(|_| stage == 0) {
            // Only the first hop answers the driver: a later one skipping it would leave it
            // a hop that never ran its backward pass, whose samples the commit cannot count.
            if self.driver.first_hop(id) != Some(from) {
                self.out.violation(
                    from,
                    "a discarded answer from a peer the microbatch did not go to",
                );
                return;
            }
            let (stages, per_sample) = (self.config.stages, self.costs.activation_values);
            let values = per_sample * rows as usize;
            let accepted = self.driver.came_home(
                &mut self.out,
                self.me,
                id,
                route,
                values,
                stages,
                per_sample,
            );
            if let Some((sample, rows)) = accepted {
                self.service.answered(id, from, now);
                self.server.expect_commit(id, self.me, sample, rows, None);
                self.out.compute(Job::Abort { id });
                self.commit_driven(id, now);
            }
            return;
        }
        let at = self.serving();
        if self
            .server
            .on_discarded(&mut self.out, from, id, route, &at, now)
        {
            self.service.answered(id, from, now);
        }
    }

    /// The backward pass of `id` ran on activation gradients from a replica of the next
    /// stage: its parameter gradient is evidence about that replica once the step it goes
    /// into is taken (see [`crate::swarm::service`]). Returns whether that replica is out of
    /// line already: the microbatch's parameter gradient is then discarded here, and the
    /// stages before discard theirs, rather than pass its poison on to the shares of the
    /// whole route. The microbatch still counts toward the step (the driver commits it for
    /// the stages after), so a discard costs the stages before some samples, never a retry.
    /// Allreduce only: in DiLoCo each replica of the next stage steps on its own between
    /// outer rounds, so honest ones send gradients of different parameters, and judged by
    /// them honest replicas lost work (`wan`, seeds 1-3: loss +0.5% to +1.2%).
    pub(super) fn gradient_judged(&mut self, id: u64) -> bool {
        if self.config.sync != SyncMode::AllReduce {
            return false;
        }
        let next = self
            .server
            .next_of(id)
            .or_else(|| self.driver.first_hop(id));
        next.is_some_and(|next| self.service.gradient_from(id, next))
    }

    pub(super) fn on_backward_done(
        &mut self,
        id: u64,
        grad: Option<Vec<f32>>,
        discarded: bool,
        now: Duration,
    ) {
        if self.role.stage().unwrap_or(0) == 0 && self.driver.entry(id).is_some() {
            if discarded {
                self.out.compute(Job::Abort { id });
            }
            self.commit_driven(id, now);
            return;
        }
        let at = self.serving();
        let hop = self.config.codecs.activation_grads;
        let per_microbatch = self.per_microbatch();
        let links = &mut self.links;
        let codec = |to, values| links.choose(to, hop, values, per_microbatch);
        self.server
            .on_backward_done(&mut self.out, self.me, id, grad, discarded, &at, codec, now);
    }

    /// A microbatch this peer drives came home: it is committed along its route, and here.
    fn commit_driven(&mut self, id: u64, now: Duration) {
        match self.driver.commit(&mut self.out, id, now) {
            Some((entry, hops)) => {
                let round = self.steps.claim_round();
                self.witness.record(round, &hops, entry.rows);
                let loss = self.server.pending_loss(id);
                self.server
                    .expect_commit(id, self.me, entry.sample, entry.rows, loss);
                self.server.commit(&mut self.out, id);
            }
            None => self.out.compute(Job::Abort { id }),
        }
    }

    /// The codec to send `values` of a boundary tensor to `to` in: `hop`'s light codec while
    /// the link to `to` keeps pace with this peer's device, its strong one when it does not.
    pub(super) fn hop_codec(&mut self, to: PeerKey, hop: HopCodec, values: usize) -> Codec {
        let per_microbatch = self.per_microbatch();
        self.links.choose(to, hop, values, per_microbatch)
    }

    /// What this peer's device takes for a microbatch of its stage, forward and backward
    /// (None until measured).
    fn per_microbatch(&self) -> Option<Duration> {
        let per_sample = self.out.jobs.seconds_per_sample()?;
        Duration::try_from_secs_f64(f64::from(self.config.microbatch) * per_sample).ok()
    }

    pub(super) fn on_committed(&mut self, c: PendingCommit, now: Duration) {
        // A second-stage replica witnesses the drivers' counts, as they witness the later
        // stages' (see [`super::super::claims`]).
        if self.role.serving() == Some(1) && c.driver != self.me {
            let round = self.steps.claim_round();
            self.witness.record(round, &[c.driver], c.rows);
        }
        self.steps.on_committed(c.rows, c.loss, now);
        self.out.event(Event::Committed { sample: c.sample });
        self.out.jobs.count_rows(c.rows);
        self.send_progress();
        self.maybe_begin_round(now);
    }

    /// Tells the stage's other replicas how far this one is toward the next round.
    pub(super) fn send_progress(&mut self) {
        let Some(stage) = self.role.stage() else {
            return;
        };
        let in_flight = self.driver.in_flight() as f64 * f64::from(self.config.microbatch)
            + self.server.commits_queued();
        self.steps
            .send_progress(&mut self.out, stage, &self.members, in_flight);
    }
}
