//! The composition: one peer of a run. See the module docs of [`crate::swarm`] for the shape
//! (events in, actions out), the parts and DESIGN.md for the flow.
//!
//! A [`Peer`] owns the five parts (`Role`, `Driver`, `StageServer`, `StepCoordinator`, and
//! the `Scheduler` inside its `Outbox`) and routes every input to the part it concerns.
//! What one part needs of another passes through here as plain values (the stage served, the
//! round being collected, what the step demands of a driver), so that each part can be
//! tested alone. Every deadline lives in the part it belongs to; [`Peer::poll_timeout`] is the
//! earliest of them. The peer itself keeps the membership, the run's settings and this
//! peer's own (memory, routing), its announcements, and the random generator every part draws
//! from (one generator, so that a seed fixes every choice). The microbatch path is in `peer/microbatch.rs`.

use super::attack::Attack;
use super::bans::{self, Ban, Bans};
use super::claims::{self, Tallies};
use super::config::{RunConfig, RunId, StageCosts, SyncMode, Timing};
use super::coordinator::{Settings, StepCoordinator};
use super::driver::Driver;
use super::evaluation::{Evaluator, Relays};
use super::exports::StateExports;
pub use super::interface::{Action, ComputeDone, Event, Input, Job, Output, PeerStats, Resume};
use super::links::Links;
use super::membership::{Dealer, Gossip, Membership, Routing, Standing};
use super::message::{Announcement, MemberState, Message};
use super::outbox::Outbox;
use super::placement::Placement;
use super::role::{self, Phase, Role};
use super::scheduler::Running;
use super::server::StageServer;
use super::service::Service;
use super::{PeerKey, SeededRng};
use std::time::Duration;

mod announcing;
mod evaluation;
mod microbatch;
mod syncing;

/// Announcements an accusation outlasts at least (see [`Bans::new`]).
const ACCUSATION_ANNOUNCEMENTS: u32 = 4;

/// One peer of a run.
#[derive(Debug)]
pub struct Peer {
    me: PeerKey,
    config: RunConfig,
    run: RunId,
    costs: StageCosts,
    timing: Timing,
    /// Device memory this peer can give a stage (0: not limited).
    memory: u64,
    /// Whether it keeps blocks in host memory where its device cannot hold a stage.
    offloads: bool,
    /// The stage whose state the compute side holds (the last one built and served): a sync
    /// of that stage that finds nobody to sync from keeps it ([`Job::Restart`]).
    holds: Option<u32>,
    routing: Routing,
    incarnation: u64,
    announcements: u64,
    /// The throughput in this peer's last announcement: what the others plan with.
    announced_throughput: f64,
    next_announce: Duration,
    /// Where each period's announcement goes (everyone, in a small swarm).
    gossip: Gossip,
    rng: SeededRng,
    /// Deals this peer's microbatches out to the next stage's replicas.
    dealer: Dealer,
    /// The next stage's replicas as this peer times them: routing weights follow it.
    service: Service,
    /// Rates measured to the peers this one sends to: the codec of each boundary hop.
    links: Links,
    members: Membership,
    role: Role,
    driver: Driver,
    server: StageServer,
    /// The held-out evaluations this peer runs (first stage) and hears of.
    evaluator: Evaluator,
    /// Held-out microbatches this peer computes for evaluators.
    relays: Relays,
    /// The samples this peer committed with each replica of the stage next to it lately: a
    /// driver's through each later hop, a second-stage replica's for each driver (see
    /// [`claims`]).
    witness: Tallies,
    /// The rounds whose tallies this peer's step announcements (to the peers near it) and its
    /// periodic ones (to all) have covered.
    told_near: u64,
    told_all: u64,
    steps: StepCoordinator,
    exports: StateExports,
    bans: Bans,
    /// Scripted misbehaviour (tests and the simulator only; honest by default).
    attack: Option<Attack>,
    finish_reported: bool,
    out: Outbox,
}

impl Peer {
    /// A peer joining (or creating) the run described by `config`. It listens to gossip for
    /// a moment, then takes a stage. `resume` skips that: the owner already restored a stage
    /// from a checkpoint.
    pub fn new(
        me: PeerKey,
        config: RunConfig,
        costs: StageCosts,
        timing: Timing,
        seed: u64,
        resume: Option<Resume>,
        now: Duration,
    ) -> Self {
        let mut rng = SeededRng::new(seed ^ me.0.rotate_left(17));
        let incarnation = rng.next_u64();
        let dealer = Dealer::new(rng.next_u64());
        let settings = Settings::of(me, &config, costs.params.clone(), timing);
        let mut peer = Peer {
            me,
            run: config.run_id(),
            memory: 0,
            offloads: false,
            holds: None,
            routing: Routing::default(),
            incarnation,
            announcements: 0,
            announced_throughput: 0.0,
            next_announce: now,
            gossip: Gossip::default(),
            rng,
            dealer,
            service: Service::default(),
            links: Links::default(),
            members: Membership::default(),
            role: Role::joining(&timing, now),
            driver: Driver::new(seed.rotate_left(29) ^ me.0 ^ 0xD121_7E55_A77E_4D15, now),
            server: StageServer::default(),
            evaluator: Evaluator::new(
                seed.rotate_left(41) ^ me.0 ^ 0x4E1D_0E7A_1CA7_E5ED,
                resume.map_or(0, |r| r.step),
            ),
            relays: Relays::default(),
            witness: Tallies::default(),
            told_near: 0,
            told_all: 0,
            steps: StepCoordinator::new(settings, config.codecs.averaging, now),
            exports: StateExports::new(timing.transfer_timeout, costs.state_chunk_bytes()),
            bans: Bans::new(timing.announce_every * ACCUSATION_ANNOUNCEMENTS),
            attack: None,
            finish_reported: false,
            out: Outbox::new(me),
            config,
            costs,
            timing,
        };
        if let Some(r) = resume {
            peer.role.resume(r.stage);
            peer.steps.set_position(r.step, r.round, false);
            // A restarted replica knows nobody yet: it listens as long as a joiner does before
            // it takes a step or starts a round, so that it hears its stage (and catches up)
            // rather than training alone at its checkpoint's round.
            let listen = timing.choose_after.max(timing.announce_every);
            peer.steps.start_serving(Some(r.hash), None, now + listen);
            peer.out.event(Event::Serving {
                stage: r.stage,
                step: r.step,
                from: None,
            });
        }
        peer
    }

    /// Write a checkpoint every `steps` steps.
    pub fn set_checkpoint_every(&mut self, steps: Option<u64>) {
        self.steps.set_checkpoint_every(steps);
    }

    /// The device memory this peer can give a stage (0: not limited): it only takes, and is
    /// only asked to move to, stages that fit.
    pub fn set_memory(&mut self, bytes: u64) {
        self.memory = bytes;
    }

    /// Whether this peer can serve a stage its device memory does not hold by keeping the
    /// stage's blocks in host memory (see [`super::placement::Need`]): it is then given such
    /// stages too, and is routed by the throughput it measures there.
    pub fn set_offloads(&mut self, offloads: bool) {
        self.offloads = offloads;
    }

    /// Caps the upload this peer's state exports take, bytes per second (None: no cap).
    pub fn set_state_upload_limit(&mut self, bytes_per_s: Option<f64>) {
        self.exports.set_upload_limit(bytes_per_s);
    }

    /// Takes `stage` first instead of the stage the run needs most (if its memory holds it):
    /// an operator's choice; rebalancing may move the peer later like any other.
    pub fn set_first_stage(&mut self, stage: u32) {
        self.role.choose_first(stage);
    }

    /// How this peer routes microbatches to the next stage (weighted unless measuring the
    /// uniform baseline).
    pub fn set_routing(&mut self, routing: Routing) {
        self.routing = routing;
    }

    /// Makes this peer misbehave as `attack` says, to test the others' defences (the
    /// simulator's `behavior`, the node's test-only `--behavior`).
    pub fn set_attack(&mut self, attack: Attack) {
        self.attack = attack.is_attacker().then_some(attack);
    }

    /// The weight factor of each replica of this peer's stage whose averaging shares claimed
    /// more samples than its witnesses saw it commit (see [`claims`]); the others have 1.
    pub fn claim_credits(&self) -> &std::collections::BTreeMap<PeerKey, f64> {
        self.steps.credits()
    }

    /// This peer's key.
    pub fn key(&self) -> PeerKey {
        self.me
    }

    /// The run's configuration.
    pub fn config(&self) -> &RunConfig {
        &self.config
    }

    /// The run id.
    pub fn run_id(&self) -> RunId {
        self.run
    }

    /// The stage served (or being synced).
    pub fn stage(&self) -> Option<u32> {
        self.role.stage()
    }

    /// While a state is downloaded: bytes of it held, and its size (0 until a chunk said).
    pub fn download_progress(&self) -> Option<(u64, u64)> {
        self.role.download_progress()
    }

    /// Whether the stage is being served now.
    pub fn is_serving(&self) -> bool {
        self.role.serving().is_some()
    }

    /// Steps taken.
    pub fn step(&self) -> u64 {
        self.steps.step()
    }

    /// Rounds completed.
    pub fn round(&self) -> u64 {
        self.steps.round()
    }

    /// Parameter hash after the last round.
    pub fn params_hash(&self) -> Option<u64> {
        self.steps.params_hash()
    }

    /// Mean loss of the last step (last stage).
    pub fn last_loss(&self) -> Option<f32> {
        self.steps.last_loss()
    }

    /// Measured samples per second.
    pub fn throughput(&self) -> f64 {
        self.out.jobs.throughput()
    }

    /// Whether this peer's stage took the run's last step (and, on the first stage, the run's
    /// last held-out evaluation is known or was waited for): what it announces.
    pub fn is_finished(&self) -> bool {
        self.steps.finished() && !self.holds_finish()
    }

    /// Counters.
    pub fn stats(&self) -> PeerStats {
        let steps = self.steps.stats();
        let ledger = self.driver.stats();
        PeerStats {
            microbatches_done: steps.microbatches,
            microbatches_retried: ledger.retried,
            microbatches_dropped: ledger.dropped,
            gradients_discarded: self.service.discarded(),
            rounds: steps.rounds,
            rounds_degraded: steps.rounds_degraded,
            state_transfers: self.role.state_transfers,
            state_bytes_received: self.role.state_bytes_received,
            state_restarts: self.role.state_restarts,
            moves: self.role.moves,
            violations: self.out.violations,
        }
    }

    /// The other peers as known now.
    pub fn members(&self) -> &Membership {
        &self.members
    }

    /// Replicas known per stage, this peer included.
    pub fn stage_replicas(&self) -> Vec<usize> {
        (0..self.config.stages)
            .map(|s| self.members.serving_count(s) + usize::from(self.role.serving() == Some(s)))
            .collect()
    }

    /// The next action, if any.
    pub fn poll_action(&mut self) -> Option<Action> {
        let mut action = self.out.pop()?;
        if let Some(a) = self.attack.as_mut() {
            a.outgoing(&mut action);
        }
        Some(action)
    }

    /// Whether the state this peer is about to serve should be poisoned by its owner (a
    /// scripted attacker; see [`Attack::poisons_state`]).
    pub fn poisons_state(&self) -> bool {
        self.attack.as_ref().is_some_and(Attack::poisons_state)
    }

    /// The identities this peer speaks for beside its own, now (a scripted attacker's
    /// sybils; see [`Attack::sybils`]).
    pub fn sybils(&self) -> u32 {
        self.attack.as_ref().map_or(0, Attack::sybils)
    }

    /// When [`Peer::handle_timeout`] must be called next: the earliest deadline of any part.
    pub fn poll_timeout(&self) -> Option<Duration> {
        [
            Some(self.next_announce),
            self.role.next_timeout(),
            self.driver.next_timeout(),
            self.server.next_timeout(),
            self.evaluator.next_timeout(),
            self.relays.next_timeout(),
            self.steps.next_timeout(),
            self.exports.next_timeout(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// How many peers this one may need to be connected to at once (see
    /// [`super::membership::peers_needed`]): what the node sizes its connection and stream
    /// caps by.
    pub fn peers_needed(&self) -> usize {
        super::membership::peers_needed(self.role.serving(), &self.members)
    }

    fn allreduce(&self) -> bool {
        self.config.sync == SyncMode::AllReduce
    }

    fn is_last_stage(&self) -> bool {
        self.role.stage() == Some(self.config.stages - 1)
    }

    fn is_driver(&self) -> bool {
        self.role.serving() == Some(0)
    }

    /// Every serving peer with its measured throughput, this one included (at `own`).
    fn measured_placements(&self, own: f64) -> Vec<Placement> {
        let me = self.role.serving().map(|stage| Placement {
            peer: self.me,
            stage,
            throughput: own,
            memory: self.memory,
            offloads: self.offloads,
        });
        role::placements(&self.members, me, self.config.stages, false)
    }

    fn after(&mut self, now: Duration) {
        if let Some(a) = self.attack.as_mut() {
            a.tick(now);
            self.steps
                .misbehave(a.forges_parts(), a.excludes_others(), a.attacking());
        }
        let stage = self.role.serving();
        self.steps
            .drain_round(&mut self.out, stage, &self.members, now);
        if !self.out.evidence.is_empty() {
            let evidence = std::mem::take(&mut self.out.evidence);
            for peer in self.bans.observe(&evidence, now) {
                self.judge(peer, now);
            }
            for e in &evidence {
                let peer = e.peer();
                let served = self.service.observed(peer).timed;
                let checked = self.bans.verified(peer) || served;
                self.members
                    .set_checked(peer, checked, self.bans.worked(peer) || served);
            }
        }
        for (stage, group) in std::mem::take(&mut self.out.finished_groups) {
            self.members.round_finished(stage, &group);
        }
        self.pump(now);
        if let Some(job) = self.out.jobs.next(now) {
            self.out.push(Action::Compute(job));
        }
    }

    // ----- events from the owner -----

    /// A message from another peer of the run (the owner checked the run id).
    pub fn handle_message(&mut self, from: PeerKey, msg: Message, now: Duration) {
        if from == self.me || self.bans.is_banned(from) {
            return;
        }
        self.members.touch(from, now);
        let out = &mut self.out;
        match msg {
            Message::Hello => out.send(from, Message::Config(self.config.clone())),
            Message::Config(_) => {}
            Message::Announce(a) => self.on_announce(from, None, a, now),
            Message::Forward(f) => self.on_forward(from, f, now),
            Message::Backward(b) => self.on_backward(from, b, now),
            Message::Discarded { id, route } => self.on_discarded(from, id, route, now),
            Message::Evaluate(f) => self.on_evaluate(from, f, now),
            Message::Evaluated { id, loss } => self.on_evaluated(from, id, loss, now),
            Message::Commit { id } => self.server.on_commit(out, from, id),
            Message::Abort { id } => self.server.on_abort(out, from, id),
            Message::Reject { id } => {
                // Any hop of the route may reject, and the driver knows only the first; a
                // rejection from a peer that serves no stage is not a hop's.
                match self.members.get(from).map(|m| m.announcement.stage) {
                    Some(Some(_)) if self.evaluator.owns(id) => self.held_out_failed(id, now),
                    Some(Some(_)) => self.driver.rejected(out, from, id, now),
                    Some(None) => {
                        out.violation(from, "a rejection from a peer that serves no stage")
                    }
                    // Not heard of yet: its attempt times out instead.
                    None => {}
                }
            }
            Message::Progress {
                stage,
                round,
                samples,
                in_flight,
            } => {
                let standing = self.members.standing(from, stage);
                if standing == Standing::NotAReplica {
                    // Counting it would let anyone close a stage's round early.
                    out.violation(from, "a progress report from a peer that serves no stage");
                } else if standing == Standing::Replica
                    && self.role.stage() == Some(stage)
                    && self.steps.on_progress(from, round, samples, in_flight)
                {
                    self.maybe_begin_round(now);
                }
            }
            Message::Round { key, msg } => {
                if self.role.serving() == Some(key.stage) {
                    self.steps.on_round(out, &self.members, from, key, msg, now);
                }
            }
            Message::StateRequest {
                stage,
                first,
                resume,
            } => {
                // A joiner's request may overtake its announcement: anyone may ask, and
                // exports are few at a time and one per requester (see `StateExports`).
                if self.role.serving() == Some(stage) {
                    let in_round = self.steps.in_round();
                    let at = self.state_at(stage);
                    let out = &mut self.out;
                    self.exports
                        .request(out, from, first, resume, at, in_round, now);
                }
            }
            Message::StateRelease { stage, hash } => {
                self.exports.release(from, stage, hash, now);
                self.steps.keep_history_since(self.exports.history_needed());
            }
            Message::ChunkRequest { stage, hash, index } => {
                if let Err(what) = self
                    .exports
                    .chunk_request(out, from, stage, hash, index, now)
                {
                    out.violation(from, what);
                }
            }
            Message::StateChunk(c) => self.on_chunk(from, c, now),
            Message::CatchUpRequest { stage, round } => {
                let standing = self.members.standing(from, stage);
                if standing == Standing::NotAReplica {
                    out.violation(from, "a catch-up request from a peer that serves no stage");
                } else if standing == Standing::Replica && self.role.serving() == Some(stage) {
                    self.steps.answer_catch_up(out, from, stage, round);
                }
            }
            Message::CatchUp {
                stage,
                round,
                samples,
                data,
            } => {
                let mine = self.role.stage();
                if let Some(r) = self
                    .steps
                    .on_catch_up(out, from, mine, stage, round, samples, &data)
                {
                    self.resync(r, now);
                }
            }
        }
        self.after(now);
    }

    /// A gossip announcement by `origin` that `via` relayed (gossip's propagation source; the
    /// origin itself when they are equal). Unlike [`Peer::handle_message`], it is no evidence
    /// that `origin` exists: a relay can introduce at most
    /// [`super::membership::MAX_RELAYED_PER_PEER`] peers that never contact this one directly.
    pub fn handle_gossip(&mut self, origin: PeerKey, via: PeerKey, msg: Message, now: Duration) {
        if origin == self.me || self.bans.is_banned(origin) || self.bans.is_banned(via) {
            return;
        }
        match msg {
            Message::Announce(a) => self.on_announce(origin, Some(via), a, now),
            _ => self
                .out
                .violation(via, "gossip that is not an announcement"),
        }
        self.after(now);
    }

    /// A peer went away (its last connection closed).
    pub fn handle_peer_lost(&mut self, peer: PeerKey, now: Duration) {
        self.peer_gone(peer, now);
        self.after(now);
    }

    /// A message to `peer` could not be delivered. Work routed through it is retried at
    /// once; whether it is gone is left to its announcements (a send can fail for a live
    /// peer, e.g. one that just restarted at a new address).
    pub fn handle_send_failed(&mut self, peer: PeerKey, now: Duration) {
        self.driver.fail_hop(peer, now);
        self.held_out_hop_failed(peer, now);
        self.server
            .reject_routed_through(&mut self.out, peer, false);
        self.after(now);
    }

    /// A message of `bytes` to `peer` was acknowledged `elapsed` after it was handed to the
    /// transport (what the boundary codecs are chosen by).
    pub fn handle_delivered(&mut self, peer: PeerKey, bytes: u64, elapsed: Duration) {
        self.links.delivered(peer, bytes, elapsed);
    }

    /// The round trip to `peer` was measured (libp2p's ping; the simulator's link model).
    pub fn handle_rtt(&mut self, peer: PeerKey, rtt: Duration) {
        self.links.rtt(peer, rtt);
    }

    fn peer_gone(&mut self, peer: PeerKey, now: Duration) {
        self.members.remove(peer);
        self.service.forget(peer);
        self.links.forget(peer);
        self.bans.forget(peer);
        self.steps.forget(peer, now);
        self.driver.hop_gone(&mut self.out, peer, now);
        self.held_out_hop_failed(peer, now);
        self.server.reject_routed_through(&mut self.out, peer, true);
        self.role
            .source_lost(peer, now, self.timing.transfer_timeout);
    }

    /// Time passed.
    pub fn handle_timeout(&mut self, now: Duration) {
        let timeouts =
            Gossip::timeout(self.role.stage(), &self.members, self.timing.member_timeout);
        for gone in self.members.expire(now, |m| timeouts.of(m)) {
            self.peer_gone(gone, now);
        }
        self.exports.expire(now);
        let in_round = self.steps.in_round();
        self.exports.resume(&mut self.out, in_round, now);
        self.exports.pump(&mut self.out, now);
        self.steps.keep_history_since(self.exports.history_needed());
        if now >= self.next_announce {
            // The rounds' values travel scaled down in netsim's modelled compute (see
            // `StageCosts::param_scale`): their pace is per byte carried.
            let scale = self.costs.param_scale.max(1) as f64;
            self.steps.set_upload_pace(self.links.upload_pace() * scale);
            let plan = self.gossip.plan(self.role.serving(), &self.members);
            let a = self.announcement_since(self.told_all);
            self.told_all = a.round;
            for k in plan.direct {
                self.out.send(k, Message::Announce(a.clone()));
            }
            if plan.broadcast {
                self.out.push(Action::Announce(a));
            }
            self.out.jobs.measure();
            self.next_announce = now + self.timing.announce_every;
        }
        match self.role.phase() {
            Phase::Choosing { until } if now >= until => self.choose(now),
            Phase::Syncing { deadline, .. } if now >= deadline => self.sync_overdue(now),
            _ => {}
        }
        if self.is_driver() && self.driver.expire(&mut self.out, &self.timing, now) {
            // The other drivers count what this one has in flight toward the step: samples
            // dropped and never reported would hold their part of it back for good.
            if self.allreduce() {
                self.send_progress();
            }
        }
        self.server.expire(&mut self.out, now);
        let plan = self.evaluation_plan();
        self.evaluator.expire(&mut self.out, &plan, now);
        self.relays.expire(now);
        let next_waiting = self.server.next_step_waiting_since(self.steps.round());
        let serving = self.role.serving();
        let resync =
            self.steps
                .handle_timeout(&mut self.out, serving, &self.members, next_waiting, now);
        if let Some(r) = resync {
            self.resync(r, now);
        }
        if self.role.next_timeout().is_some_and(|t| now >= t) {
            // As every peer sees this one: the others' view decides who moves.
            let placements = self.measured_placements(self.announced_throughput);
            let busy = self.steps.in_round() || self.steps.finished();
            let planned = self.role.consider_move(
                self.me,
                &placements,
                &self.costs,
                &self.timing,
                busy,
                &mut self.rng,
                now,
            );
            if let Some(m) = planned {
                self.out.event(Event::Moving {
                    from: m.from,
                    to: m.to,
                });
                self.sync_from_someone(m.to, None, now);
            }
        }
        self.after(now);
    }

    /// A compute job finished.
    pub fn handle_compute_done(&mut self, done: ComputeDone, now: Duration) {
        let running = self.out.jobs.finished(now);
        match done {
            ComputeDone::Ready { hash } => self.on_ready(hash, now),
            ComputeDone::Forward { id, output } if self.is_held_out(id) => {
                self.on_held_out_done(id, output, now)
            }
            ComputeDone::Forward { id, output } => self.on_forward_done(id, output, now),
            ComputeDone::Backward { id, mut grad } => {
                if let Some((a, g)) = self.attack.as_ref().zip(grad.as_mut()) {
                    a.activation_gradient(g);
                }
                let discarded = self.gradient_judged(id);
                self.on_backward_done(id, grad, discarded, now)
            }
            ComputeDone::Gradient {
                mut values,
                samples,
            } => {
                let mut claim = 1.0;
                if let Some(a) = self.attack.as_mut() {
                    a.contribution(&mut values);
                    claim = a.claim();
                }
                if self.steps.on_gradient(values, samples, claim, now) {
                    self.send_progress();
                }
            }
            ComputeDone::Stepped { hash, alignments } => {
                if self.allreduce() {
                    self.service.judge(&alignments);
                }
                self.on_stepped(hash, now)
            }
            ComputeDone::State { to, bytes } => {
                if let Some(stage) = self.role.stage() {
                    let at = self.state_at(stage);
                    self.exports.exported(&mut self.out, to, at, bytes, now);
                    self.steps.keep_history_since(self.exports.history_needed());
                }
                let in_round = self.steps.in_round();
                self.exports.done(&mut self.out, in_round, now);
            }
            ComputeDone::Done => {
                if let Running::Commit(id) = running {
                    if let Some(c) = self.server.committed(id) {
                        self.on_committed(c, now);
                    }
                }
            }
            ComputeDone::Failed { error } => {
                self.out
                    .event(Event::Warning(format!("compute job failed: {error}")));
                let out = &mut self.out;
                match running {
                    Running::HeldOut(id) => self.held_out_job_failed(id, now),
                    Running::Microbatch(id) if self.driver.entry(id).is_some() => {
                        self.driver.failed_locally(id, now);
                    }
                    Running::Microbatch(id) => {
                        self.server.reject(out, id);
                        out.compute(Job::Abort { id });
                    }
                    Running::Commit(id) => {
                        self.server.committed(id);
                    }
                    Running::Export => {
                        let in_round = self.steps.in_round();
                        self.exports.done(out, in_round, now);
                    }
                    Running::Other => {}
                }
            }
        }
        self.after(now);
    }

    // ----- role: choosing, syncing, moving -----

    /// Bans `peer` if its stage's majority now accuses it (see [`bans`]).
    fn judge(&mut self, peer: PeerKey, now: Duration) {
        let mine = self.role.serving();
        let service = &self.service;
        let served = |r| service.observed(r).timed;
        if let Some(Ban {
            peer,
            why,
            accusers,
            replicas,
        }) = self.bans.judge(peer, &self.members, self.me, mine, served)
        {
            self.out.event(Event::Banned {
                peer,
                why,
                accusers,
                replicas,
            });
            self.steps.banned(peer, now);
            self.peer_gone(peer, now);
        }
    }

    fn on_announce(&mut self, from: PeerKey, via: Option<PeerKey>, a: Announcement, now: Duration) {
        // No honest peer counts rounds past the run's last step (nor steps, in allreduce
        // mode: a DiLoCo replica goes on with local steps while its round is retried), or
        // measures a throughput that is not a number; such values would only feed arithmetic
        // and placement decisions.
        let in_range = a.stage.is_none_or(|s| s < self.config.stages)
            && (a.step <= self.config.max_steps || !self.allreduce())
            && a.round <= self.config.max_steps
            && a.throughput.is_finite()
            && a.throughput >= 0.0
            && a.loss.is_none_or(f32::is_finite)
            && a.accuses.len() <= bans::MAX_ACCUSATIONS
            && a.routed.rows.len() <= claims::MAX_ROUTED
            && a.routed.first <= a.round
            && a.routed.first + claims::ROUTED_ROUNDS >= a.round
            && (a.routed.rows.iter()).all(|r| (a.routed.first..a.round).contains(&r.round));
        if !in_range {
            self.out
                .violation(from, "an announcement with values out of the run's range");
            return;
        }
        let known = self.members.get(from).map(|m| m.announcement.round);
        let known_stage = self.members.get(from).map(|m| m.announcement.stage);
        if known.is_none_or(|r| a.round > r) {
            self.driver.note_advance(now);
        }
        let admitted = match via {
            Some(via) => self.members.update_relayed(from, a.clone(), now, via),
            None => self.members.update(from, a.clone(), now),
        };
        if !admitted && self.members.get(from).is_none() {
            // No room for it (see `Membership`): nothing of it is known.
            return;
        }
        if known.is_none()
            && !self.bans.is_banned(from)
            && self.gossip.tell_newcomer(&self.members, &a)
        {
            let mine = self.announcement();
            self.out.send(from, Message::Announce(mine));
        }
        // Its stage may have accused it before this peer knew its stage (judged on every
        // accuser's announcement after that); what it accuses may now have its majority.
        if known_stage != Some(a.stage) {
            self.judge(from, now);
        }
        for accused in a.accuses.iter().map(|x| x.peer) {
            self.judge(accused, now);
        }
        if self.bans.is_banned(from) {
            return;
        }
        if let Some(held_out) = a.held_out {
            self.heard_held_out(from, &a, held_out);
        }
        let Some(stage) = self.role.serving() else {
            return;
        };
        if a.state == MemberState::Serving && a.stage == Some(claims::witnesses_of(stage)) {
            self.steps
                .heard_routes(from, a.round, &a.routed, &self.members, stage);
        }
        if a.state != MemberState::Serving || a.stage != Some(stage) {
            return;
        }
        let out = &mut self.out;
        if let Some(r) = self
            .steps
            .on_replica_announced(out, stage, &self.members, from, &a, now)
        {
            self.resync(r, now);
        }
    }

    /// Takes a stage (see [`role::choose`]), or looks again later if none fits.
    fn choose(&mut self, now: Duration) {
        let placements = role::placements(&self.members, None, self.config.stages, true);
        let choosers = self
            .members
            .iter()
            .filter(|(_, m)| m.announcement.state == MemberState::Choosing)
            .map(|(k, m)| {
                let a = &m.announcement;
                (*k, (a.memory, a.offloads), a.stage)
            })
            .chain([(
                self.me,
                (self.memory, self.offloads),
                self.role.first_choice(),
            )])
            .collect();
        match role::choose(placements, choosers, &self.costs.needs(), self.me) {
            Some(stage) => self.sync_from_someone(stage, None, now),
            None => {
                self.out.event(Event::Warning(format!(
                    "no stage fits this device's {} bytes of memory",
                    self.memory
                )));
                self.role.choose_again(now, self.timing.rebalance_every);
            }
        }
    }

    // ----- steps and rounds -----

    fn maybe_begin_round(&mut self, now: Duration) {
        let next_waiting = self.server.next_step_waiting_since(self.steps.round());
        let serving = self.role.serving();
        self.steps
            .maybe_begin_round(&mut self.out, serving, &self.members, next_waiting, now);
    }

    fn on_stepped(&mut self, hash: u64, now: Duration) {
        self.driver.note_advance(now);
        let last = self.is_last_stage();
        let closed = self.steps.on_stepped(&mut self.out, hash, last);
        if closed {
            // State requests that came during the round are served now.
            self.exports.resume(&mut self.out, false, now);
        }
        if closed && self.allreduce() {
            self.release_held_forwards(now);
        }
        self.announce_near();
        if closed
            && let Some(stage) = self.role.serving()
            && let Some(r) = self.steps.vote_after_step(stage, &self.members)
        {
            self.resync(r, now);
            return;
        }
        let stage = self.role.stage();
        self.steps
            .catch_up_if_behind(&mut self.out, stage, &self.members, now);
        self.maybe_begin_round(now);
    }
}
