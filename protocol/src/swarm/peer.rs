//! The composition: one peer of a run, serving one stage. See the module docs of
//! [`crate::swarm`] for the shape (events in, actions out) and DESIGN.md for the flow.

use super::averaging::{Round, RoundOut};
use super::config::{RunConfig, RunId, StageCosts, SyncMode, Timing};
use super::ledger::{Arrival, Expiry, Ledger};
use super::membership::{Membership, Placement, Routing, choose_stage, driver_window, plan_move};
use super::message::{
    Announcement, Backward, Forward, MemberState, Message, RoundKey, RoundMsg, StateChunk,
};
use super::transfer::{Download, chunks};
use super::{PeerKey, SeededRng};
use crate::{Decoder, Encoder};
use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

/// The input of a forward job.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// First stage: read sample `index` of the run's data (`rows` consecutive samples from it).
    Sample {
        /// First sample index.
        index: u64,
    },
    /// Activations from the previous stage.
    Activations(Vec<f32>),
}

/// The output of a forward job.
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    /// Activations for the next stage.
    Activations(Vec<f32>),
    /// The microbatch's mean loss (last stage).
    Loss(f32),
}

/// Compute work for the owner. Jobs are handed out one at a time; the next comes after
/// [`Peer::handle_compute_done`].
#[derive(Clone, Debug, PartialEq)]
pub enum Job {
    /// Build the stage fresh from the run's seed.
    Init {
        /// The stage.
        stage: u32,
    },
    /// Build the stage from transferred state.
    Import {
        /// The stage.
        stage: u32,
        /// The state's bytes.
        state: Vec<u8>,
    },
    /// Forward pass of one microbatch attempt.
    Forward {
        /// Attempt id.
        id: u64,
        /// Samples.
        rows: u32,
        /// Input.
        input: Input,
        /// Targets (last stage; the first stage reads them with the sample).
        targets: Option<Vec<u32>>,
    },
    /// Backward pass; the parameter gradient stays pending until commit.
    Backward {
        /// Attempt id.
        id: u64,
        /// Gradient of the output (none on the last stage).
        grad: Option<Vec<f32>>,
        /// Samples (the loss scale on the last stage).
        rows: u32,
    },
    /// Add the attempt's pending gradient to the step.
    Commit {
        /// Attempt id.
        id: u64,
    },
    /// Throw the attempt's pending state away.
    Abort {
        /// Attempt id.
        id: u64,
    },
    /// Hand over the accumulated gradient sum (allreduce contribution).
    TakeGradient,
    /// Hand over the pseudo-gradient (DiLoCo contribution), not scaled.
    TakePseudoGradient,
    /// Optimizer step with this mean gradient.
    Step {
        /// The averaged gradient.
        grad: Vec<f32>,
    },
    /// DiLoCo inner step with this replica's own gradient, divided by its samples.
    LocalStep,
    /// DiLoCo outer step with this averaged pseudo-gradient.
    OuterStep {
        /// The averaged pseudo-gradient.
        avg: Vec<f32>,
        /// Outer learning rate.
        lr: f32,
        /// Outer momentum.
        momentum: f32,
    },
    /// Export the stage's state for a peer.
    Export {
        /// Who asked.
        to: PeerKey,
    },
    /// Write a checkpoint.
    Checkpoint {
        /// Steps taken.
        step: u64,
        /// Rounds completed.
        round: u64,
    },
}

impl Job {
    fn priority(&self) -> usize {
        match self {
            Job::Commit { .. } | Job::Abort { .. } => 1,
            Job::Backward { .. } => 2,
            Job::Forward { .. } => 3,
            _ => 0,
        }
    }
}

/// The result of a job.
#[derive(Clone, Debug, PartialEq)]
pub enum ComputeDone {
    /// The stage is built (Init or Import); its parameter hash.
    Ready {
        /// Parameter hash.
        hash: u64,
    },
    /// Forward done.
    Forward {
        /// Attempt id.
        id: u64,
        /// What it produced.
        output: Output,
        /// The targets read with the sample (first stage).
        targets: Option<Vec<u32>>,
    },
    /// Backward done.
    Backward {
        /// Attempt id.
        id: u64,
        /// Gradient of the input (none on the first stage).
        grad: Option<Vec<f32>>,
    },
    /// A contribution (TakeGradient / TakePseudoGradient).
    Gradient {
        /// The values.
        values: Vec<f32>,
        /// Samples behind them (TakeGradient).
        samples: f64,
    },
    /// A step (Step, LocalStep, OuterStep) was taken; the parameter hash after it.
    Stepped {
        /// Parameter hash.
        hash: u64,
    },
    /// Exported state.
    State {
        /// For whom.
        to: PeerKey,
        /// The bytes.
        bytes: Vec<u8>,
    },
    /// A job with nothing to report (Commit, Abort, Checkpoint).
    Done,
    /// The job failed (e.g. a peer sent activations of the wrong size).
    Failed {
        /// Why.
        error: String,
    },
}

/// Something the owner should know about (progress display, reports, logs).
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Serving a stage.
    Serving {
        /// The stage.
        stage: u32,
        /// Steps its state has taken.
        step: u64,
        /// Where the state came from (None: fresh from the seed or a checkpoint).
        from: Option<PeerKey>,
    },
    /// A step was taken.
    Stepped {
        /// Steps taken now.
        step: u64,
        /// Mean loss of the microbatches committed toward it (last stage).
        loss: Option<f32>,
        /// Replicas that averaged (1 for local steps).
        group: usize,
        /// Samples behind the step (this replica's part of the average in a round).
        samples: f64,
        /// The parameter hash after it.
        hash: u64,
    },
    /// An averaging round lost members or parts.
    RoundDegraded {
        /// The round.
        round: u64,
        /// Members whose share was missing from this replica's part.
        left_out: usize,
        /// Parts nobody delivered.
        zeroed: usize,
    },
    /// A round this replica could not take part in.
    RoundFailed {
        /// The round.
        round: u64,
        /// Why.
        reason: &'static str,
    },
    /// Re-syncing from a replica.
    Resync {
        /// From whom.
        from: PeerKey,
        /// Why.
        reason: &'static str,
    },
    /// Moving to another stage (rebalancing).
    Moving {
        /// From.
        from: u32,
        /// To.
        to: u32,
    },
    /// A microbatch's gradient was added to this stage's step (at most once per sample
    /// over all replicas of the stage).
    Committed {
        /// Its first sample.
        sample: u64,
    },
    /// A microbatch was given up.
    Dropped {
        /// Its number.
        microbatch: u64,
    },
    /// Every peer has taken the last step.
    Finished,
    /// Something went wrong that the protocol handled.
    Warning(String),
}

/// What the peer wants done.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Send a message on a stream.
    Send {
        /// To whom.
        to: PeerKey,
        /// What.
        msg: Message,
    },
    /// Gossip this announcement.
    Announce(Announcement),
    /// Run a compute job.
    Compute(Job),
    /// For the owner's information.
    Event(Event),
}

/// A stage restored from a checkpoint by the owner before the peer starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Resume {
    /// The stage.
    pub stage: u32,
    /// Steps taken.
    pub step: u64,
    /// Rounds completed.
    pub round: u64,
    /// Parameter hash.
    pub hash: u64,
}

/// Counters for reports.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PeerStats {
    /// Microbatches committed at this peer's stage.
    pub microbatches_done: u64,
    /// Retries started by this peer as a data driver.
    pub microbatches_retried: u64,
    /// Microbatches this peer dropped as a data driver.
    pub microbatches_dropped: u64,
    /// Averaging rounds completed.
    pub rounds: u64,
    /// Rounds that lost a member's share or a part.
    pub rounds_degraded: u64,
    /// State downloads completed (joins and re-syncs).
    pub state_transfers: u64,
    /// Stage moves.
    pub moves: u64,
}

#[derive(Clone, Debug, PartialEq)]
enum Role {
    Choosing {
        until: Duration,
    },
    Syncing {
        stage: u32,
        source: Option<PeerKey>,
        deadline: Duration,
    },
    Serving,
}

/// A microbatch attempt this peer computes for someone else.
#[derive(Clone, Debug)]
struct Hop {
    sample: u64,
    round: u64,
    route: Vec<PeerKey>,
    rows: u32,
    targets: Vec<u32>,
    next: Option<PeerKey>,
    backward_done: bool,
    loss: Option<f32>,
    expires: Duration,
}

/// Which job is running, for attributing its result.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Tag {
    Micro(u64),
    Commit(u64),
    Other,
}

/// One peer of a run.
#[derive(Debug)]
pub struct Peer {
    me: PeerKey,
    config: RunConfig,
    run: RunId,
    costs: StageCosts,
    timing: Timing,
    checkpoint_every: Option<u64>,
    memory: u64,
    routing: Routing,
    incarnation: u64,
    announcements: u64,
    rng: SeededRng,
    role: Role,
    stage: Option<u32>,
    members: Membership,
    queue: [VecDeque<Job>; 4],
    busy: Option<(Duration, Tag)>,
    ledger: Ledger,
    next_microbatch: u64,
    next_attempt: u64,
    routes: BTreeMap<u64, Vec<PeerKey>>,
    hops: BTreeMap<u64, Hop>,
    committing: BTreeMap<u64, (u64, u32, Option<f32>)>,
    step: u64,
    round: u64,
    params_hash: Option<u64>,
    accum_samples: f64,
    losses: (f64, f64),
    last_loss: Option<f32>,
    progress: BTreeMap<PeerKey, (u64, f64, f64)>,
    local_step_queued: bool,
    step_pending_round: bool,
    round_group: usize,
    round_samples: f64,
    round_loss: Option<f64>,
    last_local_samples: f64,
    history: VecDeque<(u64, Vec<f32>, f64)>,
    catching_up: Option<(PeerKey, u64, Duration)>,
    last_advance: Duration,
    stall_check: Option<Duration>,
    /// Microbatches of a step this replica has not reached yet.
    held_forwards: Vec<(PeerKey, Forward, Duration)>,
    /// A replica that just started serving waits this long before starting a round of its
    /// own, so that replicas starting together have heard of each other first.
    settle_until: Option<Duration>,
    /// When this replica last collected a sample for its round (or began collecting).
    last_collected: Duration,
    starve_check: Option<Duration>,
    early_joins: Vec<(RoundKey, PeerKey)>,
    rtt: f64,
    /// The least round trip of a microbatch lately (no queueing on the way): this and the
    /// last epoch of `RTT_EPOCH` microbatches.
    rtt_floor: (f64, f64, u32),
    commit_queued: f64,
    held_commits: Vec<(u64, u64)>,
    inner_steps: u32,
    samples_since_outer: f64,
    averaging: Option<Round>,
    last_round: Option<Round>,
    deferred_exports: Vec<PeerKey>,
    download: Option<Download>,
    next_announce: Duration,
    next_rebalance: Duration,
    move_at: Option<Duration>,
    busy_time: f64,
    rows_done: f64,
    throughput: f64,
    finished: bool,
    finish_reported: bool,
    stats: PeerStats,
    actions: VecDeque<Action>,
    encoder: Encoder,
    decoder: Decoder,
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
        let run = config.run_id();
        let mut peer = Peer {
            me,
            run,
            costs,
            timing,
            checkpoint_every: None,
            memory: 0,
            routing: Routing::default(),
            incarnation: 0,
            announcements: 0,
            rng: SeededRng::new(seed ^ me.0.rotate_left(17)),
            role: Role::Choosing {
                until: now + timing.choose_after,
            },
            stage: None,
            members: Membership::default(),
            queue: Default::default(),
            busy: None,
            ledger: Ledger::default(),
            next_microbatch: 0,
            next_attempt: 0,
            routes: BTreeMap::new(),
            hops: BTreeMap::new(),
            committing: BTreeMap::new(),
            step: 0,
            round: 0,
            params_hash: None,
            accum_samples: 0.0,
            losses: (0.0, 0.0),
            last_loss: None,
            progress: BTreeMap::new(),
            local_step_queued: false,
            step_pending_round: false,
            round_group: 1,
            round_samples: 0.0,
            round_loss: None,
            last_local_samples: 0.0,
            history: VecDeque::new(),
            catching_up: None,
            last_advance: now,
            stall_check: None,
            held_forwards: Vec::new(),
            settle_until: None,
            last_collected: now,
            starve_check: None,
            early_joins: Vec::new(),
            rtt: 0.0,
            rtt_floor: (f64::INFINITY, f64::INFINITY, 0),
            commit_queued: 0.0,
            held_commits: Vec::new(),
            inner_steps: 0,
            samples_since_outer: 0.0,
            averaging: None,
            last_round: None,
            deferred_exports: Vec::new(),
            download: None,
            next_announce: now,
            next_rebalance: now + timing.rebalance_every,
            move_at: None,
            busy_time: 0.0,
            rows_done: 0.0,
            throughput: 0.0,
            finished: false,
            finish_reported: false,
            stats: PeerStats::default(),
            actions: VecDeque::new(),
            encoder: Encoder::new(),
            decoder: Decoder::new(),
            config,
        };
        peer.incarnation = peer.rng.next_u64();
        if let Some(r) = resume {
            peer.settle_until = Some(now + timing.announce_every);
            peer.stage = Some(r.stage);
            peer.role = Role::Serving;
            peer.step = r.step;
            peer.round = r.round;
            peer.params_hash = Some(r.hash);
            peer.finished = peer.stage_finished();
            peer.event(Event::Serving {
                stage: r.stage,
                step: r.step,
                from: None,
            });
        }
        peer
    }

    /// Write a checkpoint every `steps` steps.
    pub fn set_checkpoint_every(&mut self, steps: Option<u64>) {
        self.checkpoint_every = steps.filter(|s| *s > 0);
    }

    /// The device memory this peer can give a stage (0: not limited): it only takes, and is
    /// only asked to move to, stages that fit.
    pub fn set_memory(&mut self, bytes: u64) {
        self.memory = bytes;
    }

    /// How this peer routes microbatches to the next stage (weighted unless measuring the
    /// uniform baseline).
    pub fn set_routing(&mut self, routing: Routing) {
        self.routing = routing;
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
        match self.role {
            Role::Syncing { stage, .. } => Some(stage),
            _ => self.stage,
        }
    }

    /// Whether the stage is being served now.
    pub fn is_serving(&self) -> bool {
        self.role == Role::Serving
    }

    /// Steps taken.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Rounds completed.
    pub fn round(&self) -> u64 {
        self.round
    }

    /// Parameter hash after the last round.
    pub fn params_hash(&self) -> Option<u64> {
        self.params_hash
    }

    /// Mean loss of the last step (last stage).
    pub fn last_loss(&self) -> Option<f32> {
        self.last_loss
    }

    /// Measured samples per second.
    pub fn throughput(&self) -> f64 {
        self.throughput
    }

    /// Whether this peer's stage took the run's last step.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Counters.
    pub fn stats(&self) -> PeerStats {
        let mut s = self.stats.clone();
        s.microbatches_retried = self.ledger.stats.retried;
        s.microbatches_dropped = self.ledger.stats.dropped;
        s
    }

    /// The other peers as known now.
    pub fn members(&self) -> &Membership {
        &self.members
    }

    /// Replicas known per stage, this peer included.
    pub fn stage_replicas(&self) -> Vec<usize> {
        let mut counts = vec![0; self.config.stages as usize];
        for (_, m) in self.members.iter() {
            if m.announcement.state == MemberState::Serving {
                if let Some(c) = m
                    .announcement
                    .stage
                    .and_then(|s| counts.get_mut(s as usize))
                {
                    *c += 1;
                }
            }
        }
        if let (Role::Serving, Some(s)) = (&self.role, self.stage) {
            if let Some(c) = counts.get_mut(s as usize) {
                *c += 1;
            }
        }
        counts
    }

    /// The next action, if any.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// When [`Peer::handle_timeout`] must be called next.
    pub fn poll_timeout(&self) -> Option<Duration> {
        let mut t = vec![self.next_announce, self.next_rebalance];
        if let Role::Choosing { until } = self.role {
            t.push(until);
        }
        if let Role::Syncing { deadline, .. } = self.role {
            t.push(deadline);
        }
        t.extend(self.ledger.next_deadline());
        t.extend(self.averaging.as_ref().and_then(|r| r.deadline()));
        t.extend(self.move_at);
        t.extend(self.catching_up.map(|c| c.2));
        t.extend(self.stall_check);
        t.extend(self.starve_check);
        t.extend(self.settle_until);
        t.extend(self.hops.values().map(|h| h.expires).min());
        t.into_iter().min()
    }

    fn event(&mut self, e: Event) {
        self.actions.push_back(Action::Event(e));
    }

    fn send(&mut self, to: PeerKey, msg: Message) {
        if to != self.me {
            self.actions.push_back(Action::Send { to, msg });
        }
    }

    fn enqueue(&mut self, job: Job) {
        if let Job::Commit { id } = &job {
            self.commit_queued += self.committing.get(id).map_or(0.0, |c| c.1 as f64);
        }
        let p = job.priority();
        self.queue[p].push_back(job);
    }

    fn dispatch(&mut self, now: Duration) {
        if self.busy.is_some() {
            return;
        }
        for p in 0..self.queue.len() {
            if let Some(job) = self.queue[p].pop_front() {
                let tag = match &job {
                    Job::Forward { id, .. } | Job::Backward { id, .. } => Tag::Micro(*id),
                    Job::Commit { id } => Tag::Commit(*id),
                    _ => Tag::Other,
                };
                self.busy = Some((now, tag));
                self.actions.push_back(Action::Compute(job));
                return;
            }
        }
    }

    fn queued(&self) -> u32 {
        self.queue.iter().map(|q| q.len()).sum::<usize>() as u32 + u32::from(self.busy.is_some())
    }

    fn announce(&mut self) {
        let a = self.announcement();
        self.actions.push_back(Action::Announce(a));
    }

    /// The announcement this peer gossips next.
    pub fn announcement(&mut self) -> Announcement {
        self.announcements += 1;
        let (stage, state) = match self.role {
            Role::Choosing { .. } => (None, MemberState::Choosing),
            Role::Syncing { stage, .. } => (Some(stage), MemberState::Syncing),
            Role::Serving => (self.stage, MemberState::Serving),
        };
        Announcement {
            stage,
            state,
            throughput: self.throughput as f32,
            queue: self.queued(),
            step: self.step,
            round: self.round,
            params_hash: self.params_hash,
            finished: self.finished,
            loss: self.last_loss,
            memory: self.memory,
            incarnation: self.incarnation,
            seq: self.announcements,
        }
    }

    /// The peer is shutting down: tell the others.
    pub fn leave(&mut self) -> Announcement {
        let mut a = self.announcement();
        a.state = MemberState::Leaving;
        a
    }

    fn is_last_stage(&self) -> bool {
        self.stage == Some(self.config.stages - 1)
    }

    fn is_driver(&self) -> bool {
        self.stage == Some(0) && self.role == Role::Serving
    }

    /// Whether this replica's stage took the run's last step. In DiLoCo that is the last
    /// outer round (replicas count their inner steps independently; rounds they share).
    fn stage_finished(&self) -> bool {
        match self.config.sync {
            SyncMode::AllReduce => self.round >= self.config.max_steps,
            SyncMode::DiLoCo { h, .. } => self.round >= self.config.max_steps.div_ceil(h as u64),
        }
    }

    fn activation_len(&self, rows: u32) -> usize {
        self.costs.activation_values * rows as usize
    }

    fn after(&mut self, now: Duration) {
        self.drain_round(now);
        self.pump(now);
        self.dispatch(now);
    }

    // ----- events from the owner -----

    /// A message from another peer of the run (the owner checked the run id).
    pub fn handle_message(&mut self, from: PeerKey, msg: Message, now: Duration) {
        if from == self.me {
            return;
        }
        self.members.touch(from, now);
        match msg {
            Message::Hello => self.send(from, Message::Config(self.config.clone())),
            Message::Config(_) => {}
            Message::Announce(a) => self.on_announce(from, a, now),
            Message::Forward(f) => self.on_forward(from, f, now),
            Message::Backward(b) => self.on_backward(from, b, now),
            Message::Commit { id } => {
                if let Some(h) = self.hops.remove(&id) {
                    if h.backward_done {
                        self.committing.insert(id, (h.sample, h.rows, h.loss));
                        if self.config.sync == SyncMode::AllReduce
                            && h.round > self.collecting_round()
                        {
                            // Started for a later step than this stage collects now.
                            self.held_commits.push((h.round, id));
                        } else {
                            self.enqueue(Job::Commit { id });
                        }
                    } else {
                        self.enqueue(Job::Abort { id });
                    }
                }
            }
            Message::Abort { id } => {
                if self.hops.remove(&id).is_some() {
                    self.enqueue(Job::Abort { id });
                }
            }
            Message::Reject { id } => self.ledger.fail(id, now),
            Message::Progress {
                stage,
                round,
                samples,
                in_flight,
            } => {
                let valid = |x: f64| x.is_finite() && x >= 0.0;
                // Within a round a replica's count only grows, and rounds only advance: a
                // report that arrives after a newer one (each message has its own stream) is
                // stale.
                let newer = self
                    .progress
                    .get(&from)
                    .is_none_or(|p| round > p.0 || (round == p.0 && samples >= p.1));
                if Some(stage) == self.stage && valid(samples) && valid(in_flight) && newer {
                    self.progress.insert(from, (round, samples, in_flight));
                    self.maybe_begin_round(now);
                }
            }
            Message::Round { key, msg } => self.on_round(from, key, msg, now),
            Message::StateRequest { stage } => {
                if self.role == Role::Serving && Some(stage) == self.stage {
                    if self.averaging.is_some() {
                        if !self.deferred_exports.contains(&from)
                            && self.deferred_exports.len() < 64
                        {
                            self.deferred_exports.push(from);
                        }
                    } else {
                        self.enqueue(Job::Export { to: from });
                    }
                }
            }
            Message::StateChunk(c) => self.on_chunk(from, c, now),
            Message::CatchUpRequest { stage, round } => {
                if Some(stage) == self.stage && self.role == Role::Serving {
                    let (samples, data) = match self.history.iter().find(|h| h.0 == round) {
                        Some((_, values, samples)) => {
                            let values = values.clone();
                            (*samples, self.encode(crate::Codec::Fp32, &values))
                        }
                        None => (0.0, Vec::new()),
                    };
                    self.send(
                        from,
                        Message::CatchUp {
                            stage,
                            round,
                            samples,
                            data,
                        },
                    );
                }
            }
            Message::CatchUp {
                stage,
                round,
                samples,
                data,
            } => self.on_catch_up(from, stage, round, samples, data, now),
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
        self.ledger.fail_hop(peer, now);
        self.reject_routed_through(peer);
        self.after(now);
    }

    fn reject_routed_through(&mut self, peer: PeerKey) {
        let rejected: Vec<(u64, PeerKey)> = self
            .hops
            .iter()
            .filter(|(_, h)| h.next == Some(peer) && !h.backward_done)
            .filter_map(|(id, h)| h.route.first().map(|d| (*id, *d)))
            .collect();
        for (id, driver) in rejected {
            self.send(driver, Message::Reject { id });
        }
    }

    fn peer_gone(&mut self, peer: PeerKey, now: Duration) {
        self.members.remove(peer);
        self.progress.remove(&peer);
        self.ledger.fail_hop(peer, now);
        self.reject_routed_through(peer);
        if let Role::Syncing { source, .. } = &mut self.role {
            if *source == Some(peer) {
                *source = None;
                if let Role::Syncing { deadline, .. } = &mut self.role {
                    *deadline = now;
                }
            }
        }
    }

    /// Time passed.
    pub fn handle_timeout(&mut self, now: Duration) {
        for gone in self.members.expire(now, self.timing.member_timeout) {
            self.peer_gone(gone, now);
        }
        if now >= self.next_announce {
            self.announce();
            self.update_throughput();
            self.next_announce = now + self.timing.announce_every;
        }
        match self.role.clone() {
            Role::Choosing { until } if now >= until => self.choose(now),
            Role::Syncing {
                stage, deadline, ..
            } if now >= deadline => self.sync_from_someone(stage, now),
            _ => {}
        }
        if self.is_driver() {
            let deadline = self.microbatch_deadline();
            let max = self.timing.max_attempts;
            let (me, mut n) = (self.me, self.next_attempt);
            let expired = self.ledger.expire(now, max, deadline, || {
                n += 1;
                attempt_id(me, n)
            });
            self.next_attempt = n;
            for e in expired {
                match e {
                    Expiry::Retry {
                        attempt,
                        sample,
                        rows,
                        ..
                    } => {
                        self.enqueue(Job::Forward {
                            id: attempt,
                            rows,
                            input: Input::Sample { index: sample },
                            targets: None,
                        });
                    }
                    Expiry::Dropped(entry) => {
                        for (a, hop) in entry.live {
                            self.enqueue(Job::Abort { id: a });
                            if let Some(h) = hop {
                                self.send(h, Message::Abort { id: a });
                            }
                        }
                        self.event(Event::Dropped {
                            microbatch: entry.microbatch,
                        });
                    }
                }
            }
        }
        let stale: Vec<u64> = self
            .hops
            .iter()
            .filter(|(_, h)| h.expires <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            self.hops.remove(&id);
            self.enqueue(Job::Abort { id });
        }
        if let Some(r) = self.averaging.as_mut() {
            r.handle_timeout(now);
        }
        if self.starve_check.is_some_and(|t| now >= t) {
            self.starve_check = None;
            self.maybe_begin_round(now);
        }
        if self.settle_until.is_some_and(|t| now >= t) {
            self.maybe_begin_round(now);
            self.settle_until = None;
        }
        if let Some((from, _, deadline)) = self.catching_up {
            if now >= deadline {
                self.catching_up = None;
                self.resync(from, "no answer to a catch-up request", now);
            }
        }
        if now >= self.next_rebalance {
            self.next_rebalance = now + self.timing.rebalance_every;
            self.consider_move(now, false);
        }
        if self.move_at.is_some_and(|t| now >= t) {
            self.move_at = None;
            self.consider_move(now, true);
        }
        self.after(now);
    }

    /// A compute job finished.
    pub fn handle_compute_done(&mut self, done: ComputeDone, now: Duration) {
        let tag = match self.busy.take() {
            Some((started, tag)) => {
                if matches!(tag, Tag::Micro(_)) {
                    self.busy_time += now.saturating_sub(started).as_secs_f64();
                }
                tag
            }
            None => Tag::Other,
        };
        match done {
            ComputeDone::Ready { hash } => self.on_ready(hash, now),
            ComputeDone::Forward {
                id,
                output,
                targets,
            } => self.on_forward_done(id, output, targets, now),
            ComputeDone::Backward { id, grad } => self.on_backward_done(id, grad, now),
            ComputeDone::Gradient { values, samples } => self.on_gradient(values, samples, now),
            ComputeDone::Stepped { hash } => self.on_stepped(hash, now),
            ComputeDone::State { to, bytes } => {
                if let Some(stage) = self.stage {
                    for c in chunks(stage, self.step, self.round, &bytes) {
                        self.send(to, Message::StateChunk(c));
                    }
                }
            }
            ComputeDone::Done => {
                if let Tag::Commit(id) = tag {
                    if let Some((sample, rows, loss)) = self.committing.remove(&id) {
                        self.commit_queued = (self.commit_queued - rows as f64).max(0.0);
                        self.on_committed(sample, rows, loss, now);
                    }
                }
            }
            ComputeDone::Failed { error } => {
                self.event(Event::Warning(format!("compute job failed: {error}")));
                match tag {
                    Tag::Micro(id) if self.ledger.entry_of(id).is_some() => {
                        self.ledger.unaccept(id, now);
                        self.ledger.fail(id, now);
                    }
                    Tag::Micro(id) => {
                        if let Some(h) = self.hops.remove(&id) {
                            if let Some(d) = h.route.first() {
                                self.send(*d, Message::Reject { id });
                            }
                        }
                        self.enqueue(Job::Abort { id });
                    }
                    Tag::Commit(id) => {
                        if let Some((_, rows, _)) = self.committing.remove(&id) {
                            self.commit_queued = (self.commit_queued - rows as f64).max(0.0);
                        }
                    }
                    Tag::Other => {}
                }
            }
        }
        self.after(now);
    }

    // ----- membership, joining, moving -----

    fn on_announce(&mut self, from: PeerKey, a: Announcement, now: Duration) {
        if a.stage.is_some_and(|s| s >= self.config.stages) {
            return;
        }
        let known = self.members.get(from).map(|m| m.announcement.round);
        if known.is_none_or(|r| a.round > r) {
            self.last_advance = now;
        }
        self.members.update(from, a.clone(), now);
        if a.state != MemberState::Serving {
            return;
        }
        if self.role != Role::Serving || a.stage != self.stage || self.averaging.is_some() {
            return;
        }
        if a.round > self.round && !self.finished {
            self.catch_up(from, now);
            return;
        }
        if a.round == self.round {
            if let (Some(theirs), Some(mine)) = (a.params_hash, self.params_hash) {
                if theirs != mine && self.outvoted(from, theirs, mine) {
                    self.resync(
                        from,
                        "parameters differ from the stage's other replicas",
                        now,
                    );
                }
            }
        }
    }

    /// Behind a replica of this stage: replay the round it missed from that replica's
    /// record (cheap, and lands on the same parameters); a full state transfer if the
    /// replica no longer has it.
    fn catch_up(&mut self, from: PeerKey, now: Duration) {
        if self.catching_up.is_some() || self.averaging.is_some() || self.step_pending_round {
            return;
        }
        let Some(stage) = self.stage else { return };
        self.catching_up = Some((from, self.round, now + self.timing.round_timeout));
        self.send(
            from,
            Message::CatchUpRequest {
                stage,
                round: self.round,
            },
        );
    }

    fn on_catch_up(
        &mut self,
        from: PeerKey,
        stage: u32,
        round: u64,
        samples: f64,
        data: Vec<u8>,
        now: Duration,
    ) {
        if self.catching_up.map(|c| (c.0, c.1)) != Some((from, round))
            || Some(stage) != self.stage
            || round != self.round
        {
            return;
        }
        self.catching_up = None;
        let len = self.costs.params.get(stage as usize).copied().unwrap_or(0);
        let mut values = Vec::new();
        let ok = !data.is_empty()
            && Decoder::with_max_elements(len)
                .decode(&data, &mut values)
                .is_ok()
            && values.len() == len
            && samples.is_finite();
        if !ok || self.averaging.is_some() {
            self.resync(from, "a replica of this stage is ahead", now);
            return;
        }
        self.step_pending_round = true;
        self.round_group = 0;
        self.round_samples = samples;
        self.remember(round, &values, samples);
        let job = match self.config.sync {
            SyncMode::AllReduce => Job::Step { grad: values },
            SyncMode::DiLoCo {
                outer_lr,
                outer_momentum,
                ..
            } => Job::OuterStep {
                avg: values,
                lr: outer_lr,
                momentum: outer_momentum,
            },
        };
        self.enqueue(job);
    }

    /// Keeps the results of recent rounds for replicas that fall behind (as many as fit in
    /// 64 MiB, at least the last).
    fn remember(&mut self, round: u64, values: &[f32], samples: f64) {
        const BUDGET: usize = 64 << 20;
        self.history.push_back((round, values.to_vec(), samples));
        let mut bytes: usize = self.history.iter().map(|h| h.1.len() * 4).sum();
        while self.history.len() > 1 && bytes > BUDGET {
            if let Some(old) = self.history.pop_front() {
                bytes -= old.1.len() * 4;
            }
        }
    }

    /// Whether this replica's hash loses to `theirs`: fewer replicas at this round hold it,
    /// or as many, and the other side has the smaller key.
    fn outvoted(&self, from: PeerKey, theirs: u64, mine: u64) -> bool {
        let (mut for_theirs, mut for_mine) = (0, 1);
        for (_, m) in self.members.iter() {
            let a = &m.announcement;
            if a.state == MemberState::Serving && a.stage == self.stage && a.round == self.round {
                if a.params_hash == Some(theirs) {
                    for_theirs += 1;
                } else if a.params_hash == Some(mine) {
                    for_mine += 1;
                }
            }
        }
        for_theirs > for_mine || (for_theirs == for_mine && from < self.me)
    }

    /// Every peer's stage and throughput. A peer not measured yet (it just joined) counts
    /// as the mean of its stage's measured replicas, or of all measured peers, so that
    /// joiners arriving together spread out instead of all picking the same stage.
    fn placements(&self, include_me: bool) -> Vec<Placement> {
        let mut out: Vec<Placement> = self
            .members
            .iter()
            .filter(|(_, m)| {
                matches!(
                    m.announcement.state,
                    MemberState::Serving | MemberState::Syncing
                )
            })
            .filter_map(|(k, m)| {
                m.announcement.stage.map(|stage| Placement {
                    peer: *k,
                    stage,
                    throughput: m.announcement.throughput as f64,
                    memory: m.announcement.memory,
                })
            })
            .collect();
        if include_me {
            if let (Role::Serving, Some(stage)) = (&self.role, self.stage) {
                out.push(Placement {
                    peer: self.me,
                    stage,
                    throughput: self.throughput,
                    memory: self.memory,
                });
            }
        }
        let mean = |it: &mut dyn Iterator<Item = f64>| {
            let (sum, n) = it.fold((0.0, 0), |(s, n), t| (s + t, n + 1));
            (n > 0).then(|| sum / n as f64)
        };
        let overall = mean(&mut out.iter().map(|p| p.throughput).filter(|t| *t > 0.0));
        let per_stage: Vec<Option<f64>> = (0..self.config.stages)
            .map(|s| {
                mean(
                    &mut out
                        .iter()
                        .filter(|p| p.stage == s && p.throughput > 0.0)
                        .map(|p| p.throughput),
                )
            })
            .collect();
        if include_me {
            // Rebalancing only trusts measurements.
            return out;
        }
        for p in &mut out {
            if p.throughput <= 0.0 {
                p.throughput = per_stage
                    .get(p.stage as usize)
                    .copied()
                    .flatten()
                    .or(overall)
                    .unwrap_or(0.0);
            }
        }
        out
    }

    /// Takes a stage. Peers that start together would all see the same bottleneck and pick
    /// it together, so every peer choosing now plays out the same assignment of all choosers
    /// in key order (each counted at the throughput its stage's replicas measure) and takes
    /// its own slot.
    fn choose(&mut self, now: Duration) {
        let mut placements = self.placements(false);
        let mut choosers: Vec<(PeerKey, u64)> = self
            .members
            .iter()
            .filter(|(_, m)| m.announcement.state == MemberState::Choosing)
            .map(|(k, m)| (*k, m.announcement.memory))
            .collect();
        choosers.push((self.me, self.memory));
        choosers.sort_unstable();
        let mut mine = None;
        for (peer, memory) in choosers {
            let stage = choose_stage(&placements, &self.costs.memory, memory);
            if peer == self.me {
                mine = stage;
                break;
            }
            if let Some(stage) = stage {
                let measured = |only: Option<u32>| {
                    let t: Vec<f64> = placements
                        .iter()
                        .filter(|p| p.throughput > 0.0 && only.is_none_or(|s| p.stage == s))
                        .map(|p| p.throughput)
                        .collect();
                    (!t.is_empty()).then(|| t.iter().sum::<f64>() / t.len() as f64)
                };
                let throughput = measured(Some(stage)).or(measured(None)).unwrap_or(0.0);
                placements.push(Placement {
                    peer,
                    stage,
                    throughput,
                    memory,
                });
            }
        }
        match mine {
            Some(stage) => self.sync_from_someone(stage, now),
            None => {
                // No stage fits this device: tell the owner, and look again now and then.
                self.event(Event::Warning(format!(
                    "no stage fits this device's {} bytes of memory",
                    self.memory
                )));
                self.role = Role::Choosing {
                    until: now + self.timing.rebalance_every,
                };
            }
        }
    }

    /// Starts downloading `stage`'s state from one of its replicas, or builds it fresh if it
    /// has none.
    fn sync_from_someone(&mut self, stage: u32, now: Duration) {
        let replicas = self.members.replicas(stage);
        let source = if replicas.is_empty() {
            None
        } else {
            Some(replicas[(self.rng.next_u64() % replicas.len() as u64) as usize])
        };
        self.abandon_stage_work(now);
        self.stage = Some(stage);
        match source {
            Some(source) => {
                self.role = Role::Syncing {
                    stage,
                    source: Some(source),
                    deadline: now + self.timing.transfer_timeout,
                };
                self.download = Some(Download::new(
                    stage,
                    self.costs.max_state_bytes(stage as usize),
                ));
                self.send(source, Message::StateRequest { stage });
            }
            None => {
                self.role = Role::Syncing {
                    stage,
                    source: None,
                    deadline: now + self.timing.transfer_timeout,
                };
                self.download = None;
                self.step = 0;
                self.round = 0;
                self.enqueue(Job::Init { stage });
            }
        }
        self.announce();
    }

    fn resync(&mut self, from: PeerKey, reason: &'static str, now: Duration) {
        let Some(stage) = self.stage else { return };
        self.event(Event::Resync { from, reason });
        self.abandon_stage_work(now);
        self.role = Role::Syncing {
            stage,
            source: Some(from),
            deadline: now + self.timing.transfer_timeout,
        };
        self.download = Some(Download::new(
            stage,
            self.costs.max_state_bytes(stage as usize),
        ));
        self.send(from, Message::StateRequest { stage });
    }

    /// Drops everything in flight at this stage (it is about to be replaced): other drivers
    /// are told at once so they retry elsewhere; this peer's own microbatches time out.
    fn abandon_stage_work(&mut self, now: Duration) {
        for (id, h) in std::mem::take(&mut self.hops) {
            if let Some(d) = h.route.first() {
                self.send(*d, Message::Reject { id });
            }
        }
        for q in &mut self.queue {
            q.retain(|j| {
                !matches!(
                    j,
                    Job::Forward { .. } | Job::Backward { .. } | Job::Commit { .. }
                )
            });
        }
        self.committing.clear();
        self.commit_queued = 0.0;
        self.held_commits.clear();
        self.catching_up = None;
        self.step_pending_round = false;
        // Records of the old stage's rounds must not answer for the new one.
        self.history.clear();
        self.last_round = None;
        self.early_joins.clear();
        self.last_loss = None;
        self.throughput = 0.0;
        if let Some(r) = self.averaging.take() {
            self.event(Event::RoundFailed {
                round: r.key().index,
                reason: "left the stage",
            });
        }
        self.local_step_queued = false;
        self.progress.clear();
        self.held_forwards.clear();
        self.accum_samples = 0.0;
        self.losses = (0.0, 0.0);
        let live: Vec<u64> = self.routes.keys().copied().collect();
        for id in live {
            self.ledger.fail(id, now);
        }
        self.routes.clear();
        self.ledger.abandon();
    }

    fn on_chunk(&mut self, from: PeerKey, chunk: StateChunk, now: Duration) {
        let Role::Syncing {
            stage,
            source: Some(source),
            ..
        } = self.role
        else {
            return;
        };
        if from != source {
            return;
        }
        let Some(d) = self.download.as_mut() else {
            return;
        };
        match d.add(chunk) {
            Ok(None) => {}
            Ok(Some(done)) => {
                self.download = None;
                self.step = done.step;
                self.round = done.round;
                self.stats.state_transfers += 1;
                self.enqueue(Job::Import {
                    stage,
                    state: done.bytes,
                });
                self.role = Role::Syncing {
                    stage,
                    source: Some(source),
                    deadline: now + self.timing.transfer_timeout,
                };
            }
            Err(e) => {
                self.event(Event::Warning(format!(
                    "state transfer from {from} failed: {e}"
                )));
                self.members.remove(from);
                self.sync_from_someone(stage, now);
            }
        }
    }

    fn on_ready(&mut self, hash: u64, now: Duration) {
        let Role::Syncing { stage, source, .. } = self.role else {
            return;
        };
        self.role = Role::Serving;
        self.stage = Some(stage);
        self.settle_until = Some(now + self.timing.announce_every);
        self.release_held_forwards(now);
        // In DiLoCo transferred parameters are mid-round (the source's local ones); only
        // hashes taken right after a round are comparable between replicas.
        self.params_hash = (self.config.sync == SyncMode::AllReduce).then_some(hash);
        self.inner_steps = 0;
        self.samples_since_outer = 0.0;
        self.finished = self.stage_finished();
        self.event(Event::Serving {
            stage,
            step: self.step,
            from: source,
        });
        self.announce();
        self.next_announce = now + self.timing.announce_every;
    }

    fn consider_move(&mut self, now: Duration, act: bool) {
        if self.role != Role::Serving || self.averaging.is_some() || self.finished {
            return;
        }
        let Some(m) = plan_move(
            &self.placements(true),
            &self.costs.flops_per_sample,
            &self.costs.memory,
            self.timing.rebalance_gain,
        ) else {
            return;
        };
        if m.peer != self.me {
            return;
        }
        if !act {
            // Random back-off: peers that all see the same imbalance do not all move.
            let wait = self.timing.rebalance_every.as_secs_f64() * 0.5 * self.rng.next_f64();
            self.move_at = Some(now + Duration::from_secs_f64(wait));
            return;
        }
        self.stats.moves += 1;
        self.event(Event::Moving {
            from: m.from,
            to: m.to,
        });
        self.sync_from_someone(m.to, now);
    }

    // ----- microbatches -----

    fn pipeline_ready(&self) -> bool {
        let counts = self.stage_replicas();
        counts.iter().all(|c| *c > 0)
    }

    fn everyone_finished(&self) -> bool {
        self.finished
            && self
                .members
                .iter()
                .filter(|(_, m)| m.announcement.state == MemberState::Serving)
                .all(|(_, m)| m.announcement.finished)
    }

    fn pump(&mut self, now: Duration) {
        self.stall_check = None;
        if self.everyone_finished() {
            if !self.finish_reported {
                self.finish_reported = true;
                self.event(Event::Finished);
            }
            return;
        }
        if !self.is_driver() || !self.pipeline_ready() {
            return;
        }
        let limit = self.window();
        // Flow control: start no more than the step being collected needs (all drivers
        // together in allreduce mode, this driver's share of it in DiLoCo), so that a step
        // averages the global batch, not whatever arrived while the last round ran. Once
        // this stage took its last step, only the in-flight cap applies: later stages may
        // still need samples.
        let quota = match self.config.sync {
            SyncMode::AllReduce => self.config.global_batch as f64,
            SyncMode::DiLoCo { .. } => {
                let replicas = self.members.replicas(0).len() + 1;
                (self.config.global_batch as f64 / replicas as f64).max(1.0)
            }
        };
        let share = self.driver_share();
        let mut started = false;
        let laggards = self.config.sync == SyncMode::AllReduce
            && self.members.iter().any(|(_, m)| {
                m.announcement.state == MemberState::Serving
                    && m.announcement.round + 1 < self.round
            });
        while self.ledger.in_flight() < limit {
            if self.finished || laggards {
                // Ahead of a stage (or done): the others have the microbatches they need
                // (every stage sees every committed microbatch), so wait for them. Only if
                // nobody advanced for a while do microbatches go out, one at a time and
                // counted toward the slowest stage's round, in case a stage lost samples
                // (a replica that re-synced drops what it had collected).
                let stalled = now.saturating_sub(self.last_advance) >= self.timing.join_window;
                if !stalled {
                    self.stall_check = Some(self.last_advance + self.timing.join_window);
                }
                if !stalled || self.ledger.in_flight() > 0 {
                    break;
                }
            } else {
                let mine = self.accum_samples
                    + (self.ledger.in_flight_from(self.collecting_round())
                        * self.config.microbatch as usize) as f64
                    + self.commit_queued;
                let claimed = match self.config.sync {
                    SyncMode::AllReduce => self.claimed_samples(),
                    SyncMode::DiLoCo { .. } => mine,
                };
                // Drivers learn of each other's claims a round trip late: each starts only
                // its share of the step's microbatches, unless the step has not advanced
                // for a while (a driver is gone or slow) and the batch is still short.
                let stalled = now.saturating_sub(self.last_advance) >= self.timing.join_window;
                if claimed >= quota || (mine >= share && !stalled) {
                    if !stalled {
                        self.stall_check = Some(self.last_advance + self.timing.join_window);
                    }
                    break;
                }
                if self.local_step_queued {
                    break;
                }
                // The same for a driver's own microbatches: none for the next step until this
                // one's averaged gradient is applied.
                if self.config.sync == SyncMode::AllReduce
                    && (self.averaging.as_ref().is_some_and(|r| r.contributed())
                        || self.step_pending_round)
                {
                    break;
                }
            }
            started = true;
            let microbatch = self.next_microbatch;
            self.next_microbatch += 1;
            self.next_attempt += 1;
            let id = attempt_id(self.me, self.next_attempt);
            let sample = attempt_id(PeerKey(self.me.0 ^ 0x5A5A_5A5A), microbatch);
            let rows = self.config.microbatch;
            let deadline = now + self.microbatch_deadline();
            let round = if self.finished || laggards {
                self.slowest_round()
            } else {
                self.collecting_round()
            };
            self.ledger
                .start(microbatch, sample, rows, round, id, now, deadline);
            self.enqueue(Job::Forward {
                id,
                rows,
                input: Input::Sample { index: sample },
                targets: None,
            });
        }
        if started && self.config.sync == SyncMode::AllReduce {
            self.send_progress();
        }
    }

    fn on_forward(&mut self, from: PeerKey, f: Forward, now: Duration) {
        let here = f.route.len() as u32;
        let driver = f.route.first().copied().unwrap_or(from);
        let seq = self.config.seq as usize;
        let ok = self.role == Role::Serving
            && self.stage == Some(here)
            && f.route.last() == Some(&from)
            && f.rows >= 1
            && f.rows <= self.config.microbatch
            && f.targets.len() == f.rows as usize * seq
            && !self.hops.contains_key(&f.id);
        if !ok {
            self.send(driver, Message::Reject { id: f.id });
            return;
        }
        // Synchronous steps: a microbatch of a later step waits until this replica has taken
        // the steps before it, so its gradient is computed on the parameters it will update
        // (running it on older ones makes every gradient a step stale, which costs accuracy).
        if self.config.sync == SyncMode::AllReduce && f.round > self.round {
            if self.held_forwards.len() < MAX_HELD_FORWARDS {
                self.held_forwards.push((from, f, now));
                self.maybe_begin_round(now);
            } else {
                self.send(driver, Message::Reject { id: f.id });
            }
            return;
        }
        let expect = self.activation_len(f.rows);
        self.decoder = Decoder::with_max_elements(expect);
        let mut acts = Vec::new();
        match self.decoder.decode(&f.activations, &mut acts) {
            Ok(_) if acts.len() == expect => {}
            _ => {
                self.event(Event::Warning(format!("bad activations from {from}")));
                self.send(driver, Message::Reject { id: f.id });
                return;
            }
        }
        let last = self.is_last_stage();
        let (job_targets, hop_targets) = if last {
            (Some(f.targets), Vec::new())
        } else {
            (None, f.targets)
        };
        self.hops.insert(
            f.id,
            Hop {
                sample: f.sample,
                round: f.round,
                route: f.route,
                rows: f.rows,
                targets: hop_targets,
                next: None,
                backward_done: false,
                loss: None,
                expires: now + self.hop_lifetime(),
            },
        );
        self.enqueue(Job::Forward {
            id: f.id,
            rows: f.rows,
            input: Input::Activations(acts),
            targets: job_targets,
        });
    }

    fn hop_lifetime(&self) -> Duration {
        self.microbatch_deadline() * (self.timing.max_attempts + 1)
    }

    /// How long an attempt may take: three times the measured round trip of a microbatch,
    /// and never less than the configured floor (a slow pipeline is not a dead one).
    /// Microbatches this driver keeps in flight (see [`driver_window`]).
    fn window(&self) -> usize {
        let stages = self.config.stages as usize;
        let floor = (self.timing.in_flight_per_stage as usize * stages).max(1);
        let ceiling = (self.timing.max_in_flight_per_stage as usize * stages).max(floor);
        driver_window(
            &self.placements(true),
            &self.costs,
            (floor, ceiling),
            self.rtt_floor.0.min(self.rtt_floor.1),
            self.throughput,
            self.config.microbatch,
        )
    }

    fn microbatch_deadline(&self) -> Duration {
        self.timing
            .microbatch_deadline
            .max(Duration::from_secs_f64(3.0 * self.rtt))
    }

    fn encode(&mut self, codec: crate::Codec, values: &[f32]) -> Vec<u8> {
        let mut out = Vec::new();
        if let Err(e) = self
            .encoder
            .encode(codec, values, &[values.len()], &mut out)
        {
            self.event(Event::Warning(format!("encoding failed: {e}")));
        }
        out
    }

    fn on_forward_done(
        &mut self,
        id: u64,
        output: Output,
        targets: Option<Vec<u32>>,
        now: Duration,
    ) {
        let stage = self.stage.unwrap_or(0);
        let own = self.ledger.entry_of(id).map(|e| e.rows);
        let own_sample = self.ledger.entry_of(id).map(|e| e.sample);
        match output {
            Output::Loss(loss) => {
                let rows = own
                    .or_else(|| self.hops.get(&id).map(|h| h.rows))
                    .unwrap_or(0);
                if let Some(h) = self.hops.get_mut(&id) {
                    h.loss = Some(loss);
                } else if let Some(sample) = own_sample {
                    self.committing.insert(id, (sample, rows, Some(loss)));
                    self.routes.insert(id, vec![self.me]);
                    let _ = self.ledger.arrive(id);
                }
                self.enqueue(Job::Backward {
                    id,
                    grad: None,
                    rows,
                });
            }
            Output::Activations(acts) => {
                let next_stage = stage + 1;
                let (route, rows, targets, sample, round) =
                    if let (Some(rows), Some(sample)) = (own, own_sample) {
                        let round = self.ledger.entry_of(id).map_or(0, |e| e.round);
                        (
                            vec![self.me],
                            rows,
                            targets.unwrap_or_default(),
                            sample,
                            round,
                        )
                    } else if let Some(h) = self.hops.get(&id) {
                        let mut r = h.route.clone();
                        r.push(self.me);
                        (
                            r,
                            h.rows,
                            targets.unwrap_or_else(|| h.targets.clone()),
                            h.sample,
                            h.round,
                        )
                    } else {
                        // Aborted meanwhile.
                        self.enqueue(Job::Abort { id });
                        return;
                    };
                let avoid = self
                    .ledger
                    .entry_of(id)
                    .and_then(|e| e.live.iter().rev().nth(1).and_then(|l| l.1));
                let Some(next) = self
                    .members
                    .route(next_stage, avoid, self.routing, &mut self.rng)
                else {
                    self.enqueue(Job::Abort { id });
                    if own.is_some() {
                        self.ledger.fail(id, now);
                    } else if let Some(h) = self.hops.remove(&id) {
                        if let Some(d) = h.route.first() {
                            self.send(*d, Message::Reject { id });
                        }
                    }
                    return;
                };
                let codec = self.config.codecs.activations;
                let activations = self.encode(codec, &acts);
                if own.is_some() {
                    self.ledger.sent(id, next);
                } else if let Some(h) = self.hops.get_mut(&id) {
                    h.next = Some(next);
                }
                self.send(
                    next,
                    Message::Forward(Forward {
                        id,
                        sample,
                        round,
                        rows,
                        route,
                        targets,
                        activations,
                    }),
                );
            }
        }
    }

    fn on_backward(&mut self, from: PeerKey, b: Backward, now: Duration) {
        let Some(stage) = self.stage else { return };
        if self.role != Role::Serving {
            return;
        }
        let expect = self.activation_len(self.config.microbatch);
        self.decoder = Decoder::with_max_elements(expect);
        let mut grad = Vec::new();
        if self.decoder.decode(&b.grad, &mut grad).is_err() {
            self.event(Event::Warning(format!("bad gradient from {from}")));
            return;
        }
        if stage == 0 && self.ledger.entry_of(b.id).is_some() {
            let Some(rows) = self.ledger.entry_of(b.id).map(|e| e.rows) else {
                return;
            };
            if grad.len() != self.activation_len(rows)
                || b.route.len() != self.config.stages as usize
                || b.route.first() != Some(&self.me)
            {
                return;
            }
            match self.ledger.arrive(b.id) {
                Arrival::Accept { abort } => {
                    for a in abort {
                        self.enqueue(Job::Abort { id: a });
                    }
                    self.routes.insert(b.id, b.route);
                    let sample = self.ledger.entry_of(b.id).map_or(0, |e| e.sample);
                    self.committing.insert(b.id, (sample, rows, None));
                    self.enqueue(Job::Backward {
                        id: b.id,
                        grad: Some(grad),
                        rows,
                    });
                }
                Arrival::Stale => {
                    for hop in b.route.iter().skip(1) {
                        self.send(*hop, Message::Abort { id: b.id });
                    }
                }
            }
            return;
        }
        let Some(h) = self.hops.get(&b.id) else {
            return;
        };
        if h.next != Some(from) || h.backward_done || grad.len() != self.activation_len(h.rows) {
            return;
        }
        let rows = h.rows;
        let expires = now + self.hop_lifetime();
        if let Some(h) = self.hops.get_mut(&b.id) {
            h.route = b.route;
            h.expires = expires;
        }
        self.enqueue(Job::Backward {
            id: b.id,
            grad: Some(grad),
            rows,
        });
    }

    fn on_backward_done(&mut self, id: u64, grad: Option<Vec<f32>>, now: Duration) {
        let stage = self.stage.unwrap_or(0);
        if stage == 0 && self.ledger.entry_of(id).is_some() {
            let Some(entry) = self.ledger.commit(id) else {
                self.enqueue(Job::Abort { id });
                return;
            };
            let rtt = now.saturating_sub(entry.started).as_secs_f64();
            self.rtt = if self.rtt > 0.0 {
                0.8 * self.rtt + 0.2 * rtt
            } else {
                rtt
            };
            let (current, last, count) = &mut self.rtt_floor;
            *current = current.min(rtt);
            *count += 1;
            if *count >= RTT_EPOCH {
                *last = std::mem::replace(current, f64::INFINITY);
                *count = 0;
            }
            let route = self.routes.remove(&id).unwrap_or_default();
            for hop in route.iter().skip(1) {
                self.send(*hop, Message::Commit { id });
            }
            let loss = self.committing.get(&id).and_then(|c| c.2);
            self.committing.insert(id, (entry.sample, entry.rows, loss));
            self.enqueue(Job::Commit { id });
            return;
        }
        let expires = now + self.hop_lifetime();
        let Some(h) = self.hops.get_mut(&id) else {
            self.enqueue(Job::Abort { id });
            return;
        };
        h.backward_done = true;
        h.expires = expires;
        let mut route = h.route.clone();
        if self.is_last_stage() {
            route.push(self.me);
        }
        let Some(prev) = route.get(stage as usize - 1).copied() else {
            return;
        };
        let codec = self.config.codecs.activation_grads;
        let grad = self.encode(codec, &grad.unwrap_or_default());
        self.send(prev, Message::Backward(Backward { id, route, grad }));
    }

    fn on_committed(&mut self, sample: u64, rows: u32, loss: Option<f32>, now: Duration) {
        self.stats.microbatches_done += 1;
        self.event(Event::Committed { sample });
        self.accum_samples += rows as f64;
        self.last_collected = now;
        self.rows_done += rows as f64;
        if let Some(l) = loss {
            self.losses.0 += l as f64 * rows as f64;
            self.losses.1 += rows as f64;
        }
        self.send_progress();
        self.maybe_begin_round(now);
    }

    /// Commits held for a later round that this stage now collects.
    fn release_held_commits(&mut self) {
        let round = self.collecting_round();
        let (due, keep): (Vec<_>, Vec<_>) =
            self.held_commits.drain(..).partition(|(r, _)| *r <= round);
        self.held_commits = keep;
        for (_, id) in due {
            self.enqueue(Job::Commit { id });
        }
    }

    /// Samples started by this driver and not yet in its accumulator (in flight, or
    /// committed with the commit job still queued).
    fn in_flight_samples(&self) -> f64 {
        self.ledger.in_flight() as f64 * self.config.microbatch as f64 + self.commit_queued
    }

    /// Tells the stage's other replicas how far this one is toward the next round.
    fn send_progress(&mut self) {
        let Some(stage) = self.stage else { return };
        let msg = Message::Progress {
            stage,
            round: self.collecting_round(),
            samples: self.accum_samples,
            in_flight: self.in_flight_samples(),
        };
        for k in self.members.replicas(stage) {
            self.send(k, msg.clone());
        }
    }

    /// This driver's share of a step's samples: the step's microbatches dealt out over the
    /// drivers (the first stage's replicas) in key order, so that together they start the
    /// global batch and no more.
    /// Samples this driver starts for a step. In allreduce mode with weighted routing the
    /// step's microbatches are dealt out in proportion to the drivers' throughput (a fast driver must not wait for a
    /// slow one to push its equal part through), by largest remainder in key order; equally
    /// while any driver's throughput is unknown, and in DiLoCo, where every replica's local
    /// step is an equal part of the global batch.
    fn driver_share(&self) -> f64 {
        let mut drivers: Vec<(PeerKey, f64)> = self
            .placements(true)
            .iter()
            .filter(|p| p.stage == 0)
            .map(|p| (p.peer, p.throughput))
            .collect();
        if !drivers.iter().any(|d| d.0 == self.me) {
            drivers.push((self.me, self.throughput));
        }
        drivers.sort_unstable_by_key(|d| d.0);
        let weighted = self.config.sync == SyncMode::AllReduce
            && self.routing == Routing::Weighted
            && drivers.iter().all(|d| d.1.is_finite() && d.1 > 0.0);
        if !weighted {
            drivers.iter_mut().for_each(|d| d.1 = 1.0);
        }
        let rows = self.config.microbatch.max(1) as u64;
        let microbatches = (self.config.global_batch as u64).div_ceil(rows);
        let weights: Vec<f64> = drivers.iter().map(|d| d.1).collect();
        let position = drivers.iter().position(|d| d.0 == self.me).unwrap_or(0);
        let mine = deal(microbatches, &weights)
            .get(position)
            .copied()
            .unwrap_or(0);
        (mine * rows) as f64
    }

    /// Samples committed or in flight toward the round being collected, over the stage's
    /// replicas as known from their progress messages.
    fn claimed_samples(&self) -> f64 {
        let round = self.collecting_round();
        let others: f64 = self
            .members
            .replicas(self.stage.unwrap_or(0))
            .iter()
            .filter_map(|k| self.progress.get(k))
            .filter(|p| p.0 == round)
            .map(|p| p.1 + p.2)
            .sum();
        self.accum_samples + self.in_flight_samples() + others
    }

    // ----- steps and rounds -----

    /// The round new commits count toward.
    fn collecting_round(&self) -> u64 {
        match (&self.averaging, self.config.sync) {
            (Some(r), SyncMode::AllReduce) if r.contributed() => self.round + 1,
            (_, SyncMode::AllReduce) => self.round,
            (_, SyncMode::DiLoCo { .. }) => self.step,
        }
    }

    fn follow_round(&mut self, key: RoundKey, leader: PeerKey, now: Duration) {
        let len = self
            .costs
            .params
            .get(key.stage as usize)
            .copied()
            .unwrap_or(0);
        self.averaging = Some(Round::follow(
            key,
            self.me,
            leader,
            len,
            self.config.codecs.averaging,
            self.timing,
            now,
        ));
    }

    fn maybe_begin_round(&mut self, now: Duration) {
        if self.role != Role::Serving || self.averaging.is_some() || self.finished {
            return;
        }
        let Some(stage) = self.stage else { return };
        match self.settle_until {
            Some(t) if now < t => return,
            Some(_) => self.settle_until = None,
            None => {}
        }
        // Behind a replica of this stage: its round is over, so catch up instead of starting
        // a round nobody else will join.
        if let Some(ahead) = self.replica_ahead() {
            self.catch_up(ahead, now);
            return;
        }
        // An invitation that came while this replica was still finishing the last round.
        let round = self.round;
        self.early_joins.retain(|(k, _)| k.index >= round);
        let invite = self
            .early_joins
            .iter()
            .find(|(k, from)| k.index == round && k.stage == stage && *from < self.me)
            .copied();
        if let Some((key, from)) = invite {
            self.early_joins
                .retain(|(k, f)| !(k.index == round && *f == from));
            self.follow_round(key, from, now);
            return;
        }
        let replicas = self.members.replicas(stage);
        match self.config.sync {
            SyncMode::AllReduce => {
                let others: f64 = replicas
                    .iter()
                    .filter_map(|k| self.progress.get(k))
                    .filter(|p| p.0 == self.round)
                    .map(|p| p.1)
                    .sum();
                let total = self.accum_samples + others;
                // A stage that lost samples (a replica died with what it had collected, or
                // re-synced) would wait forever for them: the drivers have moved on, and
                // every sample they send counts at every stage alike. The evidence is a
                // microbatch of the next step waiting here, or another stage two rounds
                // ahead; once no sample has come for a while, the stage closes its round
                // with what it has and goes on with the microbatches it holds.
                let behind = self.members.iter().any(|(_, m)| {
                    m.announcement.state == MemberState::Serving
                        && m.announcement.stage != Some(stage)
                        && m.announcement.round > self.round + 1
                });
                let next_waiting = self
                    .held_forwards
                    .iter()
                    .filter(|(_, f, _)| f.round > self.round)
                    .map(|(_, _, at)| *at)
                    .min();
                let evidence = next_waiting.is_some() || (behind && total > 0.0);
                let since =
                    next_waiting.map_or(self.last_collected, |t| t.max(self.last_collected));
                let quiet = now.saturating_sub(since) >= self.timing.join_window;
                let starving = evidence && quiet;
                if total >= self.config.global_batch as f64 || starving {
                    self.starve_check = None;
                    self.begin_round(replicas, now);
                } else if evidence {
                    self.starve_check = Some(since + self.timing.join_window);
                }
            }
            SyncMode::DiLoCo { h, .. } => {
                let local_batch = self.config.global_batch as f64 / (replicas.len() + 1) as f64;
                if !self.local_step_queued && self.accum_samples >= local_batch.max(1.0) {
                    self.local_step_queued = true;
                    self.last_local_samples = self.accum_samples;
                    self.samples_since_outer += self.accum_samples;
                    self.accum_samples = 0.0;
                    self.enqueue(Job::LocalStep);
                }
                if self.inner_steps >= h {
                    self.begin_round(replicas, now);
                }
            }
        }
    }

    fn begin_round(&mut self, others: Vec<PeerKey>, now: Duration) {
        let Some(stage) = self.stage else { return };
        let key = RoundKey {
            stage,
            index: self.round,
        };
        let len = self.costs.params.get(stage as usize).copied().unwrap_or(0);
        let leader = others
            .iter()
            .copied()
            .chain([self.me])
            .min()
            .unwrap_or(self.me);
        let codec = self.config.codecs.averaging;
        let round = if leader == self.me {
            let mut r = Round::lead(key, self.me, &others, len, codec, self.timing, now);
            for (k, from) in std::mem::take(&mut self.early_joins) {
                if k == key {
                    r.handle(from, RoundMsg::Join, now);
                }
            }
            r
        } else {
            Round::follow(key, self.me, leader, len, codec, self.timing, now)
        };
        self.averaging = Some(round);
    }

    fn on_round(&mut self, from: PeerKey, key: RoundKey, msg: RoundMsg, now: Duration) {
        if Some(key.stage) != self.stage || self.role != Role::Serving {
            return;
        }
        if let Some(r) = self.averaging.as_mut() {
            if r.key() == key {
                r.handle(from, msg, now);
                return;
            }
        }
        if let Some(r) = self.last_round.as_mut() {
            if r.key() == key {
                r.handle(from, msg, now);
                return;
            }
        }
        if msg == RoundMsg::Join
            && key.index > self.round.saturating_sub(1)
            && (self.averaging.is_some() || key.index != self.round)
            && key.index <= self.round + 1
            && self.early_joins.len() < 256
        {
            // A replica that finished the current round sooner is already joining the next.
            self.early_joins.push((key, from));
            return;
        }
        if self.averaging.is_some() || key.index != self.round || self.finished {
            return;
        }
        // Another replica started this round before this one noticed: join it now.
        let replicas = self.members.replicas(key.stage);
        match msg {
            RoundMsg::Join => {
                let mut others = replicas;
                if !others.contains(&from) {
                    others.push(from);
                }
                let leader = others.iter().copied().chain([self.me]).min();
                if leader == Some(self.me) {
                    self.begin_round(others, now);
                    if let Some(r) = self.averaging.as_mut() {
                        r.handle(from, RoundMsg::Join, now);
                    }
                } else if from < self.me {
                    // The round's leader invites this replica.
                    self.follow_round(key, from, now);
                }
            }
            RoundMsg::Start { .. } => {
                self.follow_round(key, from, now);
                if let Some(r) = self.averaging.as_mut() {
                    // The leader already counted us out if we did not join; drop the join.
                    while r.poll().is_some() {}
                    r.handle(from, msg, now);
                }
            }
            RoundMsg::Part { .. } | RoundMsg::Averaged { .. } => {
                let leader = replicas
                    .iter()
                    .copied()
                    .chain([self.me])
                    .min()
                    .unwrap_or(from);
                self.follow_round(key, leader, now);
                if let Some(r) = self.averaging.as_mut() {
                    r.handle(from, msg, now);
                }
            }
            RoundMsg::Request { part } => self.send(
                from,
                Message::Round {
                    key,
                    msg: RoundMsg::Missing { part },
                },
            ),
            RoundMsg::Missing { .. } => {}
        }
    }

    fn drain_round(&mut self, now: Duration) {
        loop {
            let Some(r) = self.averaging.as_mut() else {
                return;
            };
            let key = r.key();
            let Some(out) = r.poll() else { return };
            match out {
                RoundOut::Send(to, msg) => self.send(to, Message::Round { key, msg }),
                RoundOut::NeedContribution => {
                    let job = match self.config.sync {
                        SyncMode::AllReduce => Job::TakeGradient,
                        SyncMode::DiLoCo { .. } => Job::TakePseudoGradient,
                    };
                    self.enqueue(job);
                }
                RoundOut::Finished(result) => {
                    if !result.left_out.is_empty() || !result.zeroed.is_empty() {
                        self.stats.rounds_degraded += 1;
                        self.event(Event::RoundDegraded {
                            round: key.index,
                            left_out: result.left_out.len(),
                            zeroed: result.zeroed.len(),
                        });
                    }
                    self.stats.rounds += 1;
                    let group = result.group.len();
                    self.round_group = group;
                    self.round_samples = result.samples;
                    self.round_loss = result.loss;
                    self.remember(key.index, &result.averaged, result.samples);
                    let job = match self.config.sync {
                        SyncMode::AllReduce => Job::Step {
                            grad: result.averaged,
                        },
                        SyncMode::DiLoCo {
                            outer_lr,
                            outer_momentum,
                            ..
                        } => Job::OuterStep {
                            avg: result.averaged,
                            lr: outer_lr,
                            momentum: outer_momentum,
                        },
                    };
                    self.enqueue(job);
                    self.step_pending_round = true;
                }
                RoundOut::Failed(reason) => {
                    self.event(Event::RoundFailed {
                        round: key.index,
                        reason,
                    });
                    self.averaging = None;
                    let _ = now;
                    return;
                }
            }
        }
    }

    fn on_gradient(&mut self, values: Vec<f32>, samples: f64, now: Duration) {
        let Some(r) = self.averaging.as_mut() else {
            return;
        };
        match self.config.sync {
            SyncMode::AllReduce => {
                self.accum_samples = 0.0;
                self.last_collected = now;
                let loss = (self.losses.1 > 0.0).then_some(self.losses.0);
                self.losses = (0.0, 0.0);
                r.contribute(&values, samples, loss, now);
                self.release_held_commits();
                self.send_progress();
            }
            SyncMode::DiLoCo { .. } => {
                // Weighted by the samples behind it: contribute the sum.
                let w = self.samples_since_outer as f32;
                let scaled: Vec<f32> = values.iter().map(|v| v * w).collect();
                r.contribute(&scaled, self.samples_since_outer, None, now);
            }
        }
    }

    /// Runs the held microbatches whose step this replica has reached.
    fn release_held_forwards(&mut self, now: Duration) {
        let round = self.round;
        let (due, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.held_forwards)
            .into_iter()
            .partition(|(_, f, _)| f.round <= round);
        self.held_forwards = keep;
        for (from, f, _) in due {
            self.on_forward(from, f, now);
        }
    }

    fn on_stepped(&mut self, hash: u64, now: Duration) {
        let from_round = self.step_pending_round;
        self.step_pending_round = false;
        self.last_advance = now;
        let mut group = 1;
        match self.config.sync {
            SyncMode::AllReduce => {
                self.step += 1;
                self.round += 1;
                group = self.round_group;
                self.params_hash = Some(hash);
                self.finish_round();
                self.release_held_forwards(now);
            }
            SyncMode::DiLoCo { .. } if from_round => {
                self.round += 1;
                self.inner_steps = 0;
                self.samples_since_outer = 0.0;
                group = self.round_group;
                self.params_hash = Some(hash);
                self.finish_round();
            }
            SyncMode::DiLoCo { .. } => {
                self.step += 1;
                self.inner_steps += 1;
                self.local_step_queued = false;
            }
        }
        let loss = match self.config.sync {
            SyncMode::AllReduce => self.round_loss.take().map(|l| l as f32),
            SyncMode::DiLoCo { .. } if !from_round => {
                let (sum, n) = std::mem::take(&mut self.losses);
                (n > 0.0).then(|| (sum / n) as f32)
            }
            SyncMode::DiLoCo { .. } => None,
        };
        if self.is_last_stage() && loss.is_some() {
            self.last_loss = loss;
        }
        let samples = if group > 1 || from_round || self.config.sync == SyncMode::AllReduce {
            self.round_samples
        } else {
            self.last_local_samples
        };
        self.event(Event::Stepped {
            step: self.step,
            loss,
            group,
            samples,
            hash,
        });
        self.finished = self.stage_finished();
        if let Some(every) = self.checkpoint_every {
            let boundary = match self.config.sync {
                SyncMode::AllReduce => true,
                SyncMode::DiLoCo { .. } => from_round,
            };
            if boundary && (self.step.is_multiple_of(every) || self.finished) {
                self.enqueue(Job::Checkpoint {
                    step: self.step,
                    round: self.round,
                });
            }
        }
        self.announce();
        self.release_held_commits();
        if let Some(ahead) = self.replica_ahead() {
            self.catch_up(ahead, now);
        }
        self.maybe_begin_round(now);
    }

    /// The fewest rounds any serving peer (this one included) has completed.
    fn slowest_round(&self) -> u64 {
        self.members
            .iter()
            .filter(|(_, m)| m.announcement.state == MemberState::Serving)
            .map(|(_, m)| m.announcement.round)
            .fold(self.round, u64::min)
    }

    /// A replica of this stage that completed more rounds than this one.
    fn replica_ahead(&self) -> Option<PeerKey> {
        let stage = self.stage?;
        if self.finished {
            return None;
        }
        self.members
            .iter()
            .filter(|(_, m)| m.serves(stage) && m.announcement.round > self.round)
            .max_by_key(|(_, m)| m.announcement.round)
            .map(|(k, _)| *k)
    }

    fn finish_round(&mut self) {
        if let Some(r) = self.averaging.take() {
            self.last_round = Some(r);
        }
        for to in std::mem::take(&mut self.deferred_exports) {
            self.enqueue(Job::Export { to });
        }
    }

    fn update_throughput(&mut self) {
        if self.busy_time > 0.05 && self.rows_done > 0.0 {
            let sample = self.rows_done / self.busy_time;
            self.throughput = if self.throughput > 0.0 {
                0.7 * self.throughput + 0.3 * sample
            } else {
                sample
            };
            self.busy_time = 0.0;
            self.rows_done = 0.0;
        }
    }
}

/// Forwards of later steps a replica holds at most (each is a microbatch's activations).
const MAX_HELD_FORWARDS: usize = 256;

/// `items` dealt out in proportion to `weights` (whole items, summing to `items`): the floor
/// of each exact share, then one more to the largest remainders, earlier entries first.
fn deal(items: u64, weights: &[f64]) -> Vec<u64> {
    let total: f64 = weights.iter().sum();
    if weights.is_empty() || total.is_nan() || total <= 0.0 {
        return vec![0; weights.len()];
    }
    let exact: Vec<f64> = weights.iter().map(|w| items as f64 * w / total).collect();
    let mut dealt: Vec<u64> = exact.iter().map(|e| e.floor() as u64).collect();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|a, b| {
        let (fa, fb) = (exact[*a] - exact[*a].floor(), exact[*b] - exact[*b].floor());
        fb.total_cmp(&fa).then(a.cmp(b))
    });
    let left = items.saturating_sub(dealt.iter().sum());
    for i in order.into_iter().cycle().take(left as usize) {
        dealt[i] += 1;
    }
    dealt
}
/// Microbatches over which the least round trip is taken (then it starts over, so that a
/// route that got slower is noticed).
const RTT_EPOCH: u32 = 64;

/// A swarm-unique id for an attempt (or a sample): a mix of the peer and a counter.
fn attempt_id(me: PeerKey, n: u64) -> u64 {
    SeededRng::new(me.0 ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)).next_u64()
}

#[cfg(test)]
mod tests {
    use super::deal;

    #[test]
    fn microbatches_are_dealt_in_proportion_and_all_of_them() {
        // Equal weights: the first drivers in key order take the remainder.
        assert_eq!(deal(8, &[1.0, 1.0, 1.0]), [3, 3, 2]);
        assert_eq!(deal(8, &[3.0, 1.0]), [6, 2]);
        // A driver 100 times slower gets what its speed is worth, possibly nothing.
        assert_eq!(deal(8, &[100.0, 100.0, 1.0]), [4, 4, 0]);
        assert_eq!(deal(64, &[100.0, 100.0, 1.0]), [32, 32, 0]);
        assert_eq!(deal(201, &[100.0, 100.0, 1.0]), [100, 100, 1]);
        for (items, weights) in [(7, vec![0.3, 0.3, 0.4]), (1000, vec![1e-9, 5.0, 7.5, 2.0])] {
            assert_eq!(deal(items, &weights).iter().sum::<u64>(), items);
        }
        assert_eq!(deal(5, &[]), Vec::<u64>::new());
        assert_eq!(deal(5, &[0.0, 0.0]), [0, 0]);
    }
}
