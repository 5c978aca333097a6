//! Whole-swarm tests of the protocol machines in a small in-memory harness: virtual time, a
//! message queue with fixed latency, and a toy compute model whose gradients and parameters
//! are easy to check. No sockets, no threads, no clock.

use super::*;
use crate::swarm::transfer::{MAX_SOURCES, RACING_SOURCES};
use crate::{Codec, HopCodec, TrafficCodecs};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};
use std::time::Duration;
use xxhash_rust::xxh3::xxh3_64;

mod claims;
mod hostile;

const MS: Duration = Duration::from_millis(1);
const PARAMS: usize = 40;
const ACTS_PER_ROW: usize = 6;
/// The toy's held-out loss before its first step.
const HELD_OUT_LOSS: f32 = 3.0;

fn config(stages: u32, sync: SyncMode, max_steps: u64) -> RunConfig {
    RunConfig {
        preset: "toy".into(),
        stages,
        global_batch: 8,
        microbatch: 2,
        seq: 3,
        sync,
        lr: 0.1,
        max_steps,
        codecs: TrafficCodecs::default(),
        data: DataSource::Synthetic,
        seed: 5,
        init: None,
        evaluation: Default::default(),
    }
}

fn costs(stages: u32) -> StageCosts {
    StageCosts {
        flops_per_sample: vec![1.0; stages as usize],
        params: vec![PARAMS; stages as usize],
        activation_values: ACTS_PER_ROW,
        memory: vec![0; stages as usize],
        offload_memory: vec![0; stages as usize],
        microbatch_memory: vec![0; stages as usize],
        param_scale: 1,
    }
}

fn timing() -> Timing {
    Timing {
        announce_every: 50 * MS,
        member_timeout: 400 * MS,
        microbatch_deadline: 300 * MS,
        join_window: 100 * MS,
        round_timeout: 300 * MS,
        choose_after: 120 * MS,
        rebalance_every: Duration::from_secs(1),
        transfer_timeout: Duration::from_secs(2),
        ..Timing::default()
    }
}

/// A toy stage: parameters are a vector; every microbatch's gradient is a fixed function of
/// its sample, so the result of a step says exactly which samples were applied.
#[derive(Clone, Debug, Default)]
struct ToyStage {
    stage: u32,
    params: Vec<f32>,
    anchor: Vec<f32>,
    accum: Vec<f32>,
    samples: f64,
    sample_of: HashMap<u64, u64>,
    pending: HashMap<u64, (Vec<f32>, u32)>,
    committed: Vec<u64>,
    /// Optimizer steps taken; a microbatch's gradient is current if no step came between its
    /// forward pass and its commit.
    version: u64,
    version_of: HashMap<u64, u64>,
    /// Steps that took a gradient computed on parameters a step old or more.
    stale: Vec<u64>,
}

fn hash(v: &[f32]) -> u64 {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    xxh3_64(&bytes)
}

impl ToyStage {
    fn init(stage: u32) -> Self {
        let params: Vec<f32> = (0..PARAMS)
            .map(|i| (i as f32 * 0.01) + stage as f32)
            .collect();
        ToyStage {
            stage,
            anchor: params.clone(),
            params,
            accum: vec![0.0; PARAMS],
            ..Default::default()
        }
    }

    fn run(&mut self, job: Job, stages: u32) -> ComputeDone {
        match job {
            Job::Init { stage } => {
                *self = ToyStage::init(stage);
                ComputeDone::Ready {
                    hash: hash(&self.params),
                }
            }
            Job::Restart { stage } if stage == self.stage => {
                let (params, anchor) = (self.params.clone(), self.anchor.clone());
                *self = ToyStage::init(stage);
                (self.params, self.anchor) = (params, anchor);
                ComputeDone::Ready {
                    hash: hash(&self.params),
                }
            }
            Job::Restart { stage } => self.run(Job::Init { stage }, stages),
            Job::Import { stage, state } => {
                let v: Vec<f32> = state
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                *self = ToyStage::init(stage);
                self.params = v[..PARAMS].to_vec();
                self.anchor = v[PARAMS..].to_vec();
                ComputeDone::Ready {
                    hash: hash(&self.params),
                }
            }
            Job::Export { to } => ComputeDone::State {
                to,
                bytes: self
                    .params
                    .iter()
                    .chain(&self.anchor)
                    .flat_map(|x| x.to_le_bytes())
                    .collect(),
            },
            Job::Forward {
                id,
                rows,
                sample,
                input,
                held_out,
            } => {
                let sample = match input {
                    Input::Tokens => sample,
                    Input::Activations(a) => a[..6]
                        .iter()
                        .rev()
                        .fold(0, |id, x| (id << 8) | (*x as u64 - 256)),
                };
                if held_out && self.stage + 1 == stages {
                    // A held-out loss that tells the parameters' version.
                    let loss = HELD_OUT_LOSS + self.version as f32;
                    return ComputeDone::Forward {
                        id,
                        output: Output::Loss(loss),
                    };
                }
                if !held_out {
                    self.sample_of.insert(id, sample);
                    self.version_of.insert(id, self.version);
                }
                let n = rows as usize * ACTS_PER_ROW;
                // The sample id travels in the activations a byte per value, each value of the
                // same size (a receiver refuses activations far larger than usual).
                let mut acts = vec![256.0f32; n];
                for (k, a) in acts[..6].iter_mut().enumerate() {
                    *a += ((sample >> (8 * k)) & 0xFF) as f32;
                }
                let output = if self.stage + 1 == stages {
                    Output::Loss(1.0)
                } else {
                    Output::Activations(acts)
                };
                ComputeDone::Forward { id, output }
            }
            Job::Backward { id, rows, .. } => {
                let sample = self.sample_of.get(&id).copied().unwrap_or(0);
                // A part common to every sample (8) and a part of its own (0-6), as the
                // gradients of one batch share a direction: honest shares are then of about
                // one length, which the stage judges (with only a sample's own part, one that
                // is a multiple of 7 gave a share a fifth of the others' length, and another
                // replica's looked 4 times the median). Never all zero either (that made a
                // share with samples but no values, and got its replica accused).
                let g: Vec<f32> = (0..PARAMS)
                    .map(|i| ((8 + sample.wrapping_mul(i as u64 + 1) % 7) as f32) * rows as f32)
                    .collect();
                self.pending.insert(id, (g, rows));
                let grad = (self.stage > 0).then(|| vec![0.5; rows as usize * ACTS_PER_ROW]);
                ComputeDone::Backward { id, grad }
            }
            Job::Commit { id } => {
                if let Some((g, rows)) = self.pending.remove(&id) {
                    if self.version_of.get(&id) != Some(&self.version) {
                        self.stale.push(self.version);
                    }
                    self.accum.iter_mut().zip(&g).for_each(|(a, b)| *a += b);
                    self.samples += rows as f64;
                    self.committed
                        .push(self.sample_of.get(&id).copied().unwrap_or(0));
                }
                ComputeDone::Done
            }
            Job::Abort { id } => {
                self.pending.remove(&id);
                ComputeDone::Done
            }
            Job::TakeGradient => {
                let values = std::mem::replace(&mut self.accum, vec![0.0; PARAMS]);
                let samples = std::mem::take(&mut self.samples);
                ComputeDone::Gradient { values, samples }
            }
            Job::TakePseudoGradient => ComputeDone::Gradient {
                values: self
                    .anchor
                    .iter()
                    .zip(&self.params)
                    .map(|(a, p)| a - p)
                    .collect(),
                samples: 0.0,
            },
            Job::Step { grad } => {
                self.params
                    .iter_mut()
                    .zip(&grad)
                    .for_each(|(p, g)| *p -= 0.01 * g);
                self.version += 1;
                ComputeDone::Stepped {
                    hash: hash(&self.params),
                    alignments: Vec::new(),
                }
            }
            Job::LocalStep => {
                let s = std::mem::take(&mut self.samples).max(1.0) as f32;
                let accum = std::mem::replace(&mut self.accum, vec![0.0; PARAMS]);
                self.params
                    .iter_mut()
                    .zip(&accum)
                    .for_each(|(p, g)| *p -= 0.01 * g / s);
                ComputeDone::Stepped {
                    hash: hash(&self.params),
                    alignments: Vec::new(),
                }
            }
            Job::OuterStep { avg, lr, .. } => {
                self.params = self
                    .anchor
                    .iter()
                    .zip(&avg)
                    .map(|(a, g)| a - lr * g)
                    .collect();
                self.anchor = self.params.clone();
                ComputeDone::Stepped {
                    hash: hash(&self.params),
                    alignments: Vec::new(),
                }
            }
            Job::Checkpoint { .. } => ComputeDone::Done,
        }
    }
}

/// Message filter: None drops a message, Some(d) delivers it `d` later than usual.
type Filter = Box<dyn FnMut(PeerKey, PeerKey, &Message) -> Option<Duration>>;

struct Swarm {
    now: Duration,
    peers: BTreeMap<PeerKey, (Peer, ToyStage, u32)>,
    dead: BTreeSet<PeerKey>,
    queue: BinaryHeap<Reverse<(Duration, u64, DueKey)>>,
    inflight: HashMap<u64, (PeerKey, PeerKey, Message)>,
    jobs: HashMap<PeerKey, (u64, Job)>,
    seq: u64,
    filter: Filter,
    events: Vec<(PeerKey, Event)>,
    stages: u32,
    sync: SyncMode,
    max_steps: u64,
    evaluation: Evaluation,
    /// A hostile peer overhearing everything and sending one forgery every `attack_every`.
    attacker: Option<hostile::Attacker>,
    attack_every: Duration,
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord, Clone, Copy)]
enum DueKey {
    Message(u64),
    Job(PeerKey),
    Timer(PeerKey),
    Attack,
}

/// int8 cannot carry the toy's sample ids through activations; every other hop stays int8.
fn codecs() -> TrafficCodecs {
    TrafficCodecs {
        activations: HopCodec::fixed(Codec::Fp32),
        activation_grads: HopCodec::fixed(Codec::default()),
        averaging: Codec::Fp32,
    }
}

impl Swarm {
    fn new(stages: u32, sync: SyncMode, max_steps: u64) -> Self {
        Swarm {
            now: Duration::ZERO,
            peers: BTreeMap::new(),
            dead: BTreeSet::new(),
            queue: BinaryHeap::new(),
            inflight: HashMap::new(),
            jobs: HashMap::new(),
            seq: 0,
            filter: Box::new(|_, _, _| Some(Duration::ZERO)),
            events: Vec::new(),
            stages,
            sync,
            max_steps,
            evaluation: Evaluation::default(),
            attacker: None,
            attack_every: Duration::MAX,
        }
    }

    /// Lets `attacker` loose from now on.
    fn attack(&mut self, attacker: hostile::Attacker, every: Duration) {
        self.attacker = Some(attacker);
        self.attack_every = every;
        self.schedule(self.now, DueKey::Attack);
    }

    /// The attacker's turn: its own announcement now and then, a forgery otherwise.
    fn attack_once(&mut self) {
        let honest: Vec<PeerKey> = self.live().map(|(k, _)| *k).collect();
        let Some(attacker) = self.attacker.as_mut() else {
            return;
        };
        let sends = if self.seq.is_multiple_of(16) {
            let a = attacker.announcement();
            honest
                .iter()
                .map(|to| (*to, Message::Announce(a.clone())))
                .collect()
        } else {
            attacker
                .next(&honest)
                .map(|(to, msg, _)| vec![(to, msg)])
                .unwrap_or_default()
        };
        for (to, msg) in sends {
            self.seq += 1;
            self.inflight.insert(self.seq, (hostile::ATTACKER, to, msg));
            self.schedule(self.now + MS, DueKey::Message(self.seq));
        }
        self.schedule(self.now + self.attack_every, DueKey::Attack);
    }

    fn config(&self) -> RunConfig {
        let mut c = config(self.stages, self.sync, self.max_steps);
        c.codecs = codecs();
        c.evaluation = self.evaluation.clone();
        c
    }

    /// Adds a peer; `speed` multiplies its compute time.
    fn add(&mut self, key: u64, speed: u32) {
        self.add_at(key, speed, None);
    }

    /// Adds a peer that takes `stage` first, if given.
    fn add_at(&mut self, key: u64, speed: u32, stage: Option<u32>) {
        let k = PeerKey(key);
        let mut peer = Peer::new(
            k,
            self.config(),
            costs(self.stages),
            timing(),
            11,
            None,
            self.now,
        );
        if let Some(stage) = stage {
            peer.set_first_stage(stage);
        }
        self.peers.insert(k, (peer, ToyStage::default(), speed));
        self.schedule(self.now, DueKey::Timer(k));
    }

    fn schedule(&mut self, at: Duration, key: DueKey) {
        self.seq += 1;
        self.queue.push(Reverse((at, self.seq, key)));
    }

    fn kill(&mut self, key: u64) {
        self.dead.insert(PeerKey(key));
    }

    fn drain(&mut self, k: PeerKey) {
        loop {
            let Some((peer, _, speed)) = self.peers.get_mut(&k) else {
                return;
            };
            let speed = *speed;
            let Some(action) = peer.poll_action() else {
                break;
            };
            match action {
                Action::Send { to, msg } => self.post(k, to, msg),
                Action::Announce(a) => {
                    let others: Vec<PeerKey> =
                        self.peers.keys().copied().filter(|p| *p != k).collect();
                    for to in others {
                        self.post(k, to, Message::Announce(a.clone()));
                    }
                }
                Action::Compute(job) => {
                    let cost = match &job {
                        Job::Forward { .. } | Job::Backward { .. } => 10 * MS,
                        _ => MS,
                    } * speed;
                    self.seq += 1;
                    self.jobs.insert(k, (self.seq, job));
                    self.schedule(self.now + cost, DueKey::Job(k));
                }
                Action::Event(e) => self.events.push((k, e)),
            }
        }
        if let Some(t) = self.peers.get(&k).and_then(|p| p.0.poll_timeout()) {
            self.schedule(t.max(self.now), DueKey::Timer(k));
        }
    }

    fn post(&mut self, from: PeerKey, to: PeerKey, msg: Message) {
        if self.dead.contains(&from) {
            return;
        }
        let Some(delay) = (self.filter)(from, to, &msg) else {
            return;
        };
        if let Some(attacker) = self.attacker.as_mut() {
            attacker.overhear(from, to, &msg);
        }
        self.seq += 1;
        let id = self.seq;
        self.inflight.insert(id, (from, to, msg));
        self.schedule(self.now + MS + delay, DueKey::Message(id));
    }

    /// Runs until `until` or until every live peer finished.
    fn run_until(&mut self, until: Duration) {
        while let Some(Reverse((at, _, key))) = self.queue.pop() {
            if at > until {
                self.queue.push(Reverse((at, 0, key)));
                self.now = until;
                return;
            }
            self.now = at;
            let now = at;
            let target = match key {
                DueKey::Message(id) => {
                    let Some((from, to, msg)) = self.inflight.remove(&id) else {
                        continue;
                    };
                    if self.dead.contains(&to) {
                        continue;
                    }
                    if let Some((p, _, _)) = self.peers.get_mut(&to) {
                        p.handle_message(from, msg, now);
                    }
                    to
                }
                DueKey::Job(k) => {
                    let stages = self.stages;
                    let Some((_, job)) = self.jobs.remove(&k) else {
                        continue;
                    };
                    if self.dead.contains(&k) {
                        continue;
                    }
                    if let Some((p, toy, _)) = self.peers.get_mut(&k) {
                        let done = toy.run(job, stages);
                        p.handle_compute_done(done, now);
                    }
                    k
                }
                DueKey::Attack => {
                    self.attack_once();
                    continue;
                }
                DueKey::Timer(k) => {
                    if self.dead.contains(&k) {
                        continue;
                    }
                    match self.peers.get_mut(&k) {
                        Some((p, _, _)) if p.poll_timeout().is_some_and(|t| t <= now) => {
                            p.handle_timeout(now)
                        }
                        _ => continue,
                    }
                    k
                }
            };
            self.drain(target);
            if self.all_finished() {
                return;
            }
        }
    }

    fn live(&self) -> impl Iterator<Item = (&PeerKey, &(Peer, ToyStage, u32))> {
        self.peers.iter().filter(|(k, _)| !self.dead.contains(k))
    }

    fn all_finished(&self) -> bool {
        self.live().all(|(_, (p, _, _))| p.is_finished())
    }

    /// No sample is committed twice at any stage, over all of its replicas.
    fn assert_at_most_once(&self) {
        let mut per_stage: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
        for (_, (_, toy, _)) in self.peers.iter() {
            per_stage
                .entry(toy.stage)
                .or_default()
                .extend(&toy.committed);
        }
        for (stage, mut samples) in per_stage {
            let n = samples.len();
            samples.sort();
            samples.dedup();
            assert_eq!(
                samples.len(),
                n,
                "stage {stage}: a sample was committed twice"
            );
        }
    }

    fn hashes(&self, stage: u32) -> Vec<(u64, Option<u64>)> {
        self.live()
            .filter(|(_, (p, _, _))| p.stage() == Some(stage) && p.is_serving())
            .map(|(_, (p, _, _))| (p.round(), p.params_hash()))
            .collect()
    }
}

/// Runs the swarm to its end: it finishes, drivers retried at least `retries` times, no
/// sample was applied twice and every stage's replicas agree.
fn finishes_after_retries(s: &mut Swarm, retries: u64) {
    s.run_until(Duration::from_secs(60));
    assert!(s.all_finished());
    let retried: u64 = s
        .peers
        .values()
        .map(|p| p.0.stats().microbatches_retried)
        .sum();
    assert!(retried >= retries, "{retried} retries");
    s.assert_at_most_once();
    for stage in 0..3 {
        let h = s.hashes(stage);
        assert_eq!(h[0], h[1], "stage {stage}");
    }
}

fn three_by_two(sync: SyncMode, max_steps: u64) -> Swarm {
    let mut s = Swarm::new(3, sync, max_steps);
    for k in 1..=6 {
        s.add(k, 1);
        // Staggered arrivals, as people join a run.
        let t = s.now + 200 * MS;
        s.run_until(t);
    }
    assert!(!s.all_finished(), "the run must outlast the set-up");
    s
}

#[test]
fn a_swarm_trains_to_the_last_step_with_equal_replicas() {
    let mut s = three_by_two(SyncMode::AllReduce, 30);
    s.run_until(Duration::from_secs(60));
    assert!(
        s.all_finished(),
        "events: {:?}",
        &s.events[s.events.len().saturating_sub(20)..]
    );
    for stage in 0..3 {
        let h = s.hashes(stage);
        assert_eq!(h.len(), 2, "stage {stage} has two replicas: {h:?}");
        assert_eq!(h[0], h[1], "stage {stage}: replicas differ");
        assert_eq!(h[0].0, 30);
    }
    s.assert_at_most_once();
    assert!(
        !s.events.iter().any(|e| matches!(e.1, Event::Moving { .. })),
        "a balanced swarm does not move"
    );
    // Every claim checked out against what its witnesses saw.
    assert!(
        !s.events
            .iter()
            .any(|e| matches!(e.1, Event::Discounted { .. })),
        "an honest claim discounted"
    );
    // Two drivers feed the pipeline, and still no replica of any stage applied a gradient
    // computed on parameters older than the ones it updated, once the swarm had formed (while
    // peers arrive, a replica may take over microbatches already on their way).
    const SETTLED: u64 = 8;
    for (k, (_, toy, _)) in &s.peers {
        let late = toy.stale.iter().filter(|v| **v > SETTLED).count();
        assert_eq!(
            late, 0,
            "peer {k:?} (stage {}) stale at {:?}",
            toy.stage, toy.stale
        );
    }
    // Every step averaged the global batch (at least 8 samples, 4 microbatches).
    let committed: usize = s
        .peers
        .values()
        .filter(|p| p.1.stage == 0)
        .map(|p| p.1.committed.len())
        .sum();
    assert!(
        committed >= 6 * 4,
        "{committed} microbatches committed at stage 0"
    );
}

#[test]
fn held_out_evaluations_pass_through_the_pipeline_and_every_peer_hears_each_once() {
    let mut s = Swarm::new(3, SyncMode::AllReduce, 20);
    s.evaluation = Evaluation {
        every: 6,
        samples: 5,
        data: None,
    };
    for k in 1..=6 {
        s.add(k, 1);
        let t = s.now + 200 * MS;
        s.run_until(t);
    }
    // Past the last step, until every peer saw the run end (the first stage holds its end
    // back for the last evaluation).
    let ended = |s: &Swarm| s.events.iter().filter(|e| e.1 == Event::Finished).count();
    while ended(&s) < 6 && s.now < Duration::from_secs(60) {
        let next = s.now + MS;
        s.run_until(next);
    }
    assert_eq!(ended(&s), 6);
    // Steps 6, 12 and 18, and the last one: one first-stage replica evaluates a step for
    // everyone, each peer hears of it once, and the loss follows the parameters (the toy's
    // held-out loss counts the steps its replica took).
    let mut by_step: BTreeMap<u64, Vec<(PeerKey, HeldOut)>> = BTreeMap::new();
    for (k, e) in &s.events {
        if let Event::HeldOut(h) = e {
            by_step.entry(h.step).or_default().push((*k, *h));
        }
    }
    assert_eq!(by_step.keys().copied().collect::<Vec<_>>(), [6, 12, 18, 20]);
    let mut previous = HELD_OUT_LOSS;
    for (step, heard) in &by_step {
        let mut peers: Vec<PeerKey> = heard.iter().map(|h| h.0).collect();
        peers.sort();
        peers.dedup();
        assert_eq!(peers.len(), 6, "step {step}: heard by {heard:?}");
        assert_eq!(heard.len(), 6, "step {step}: heard twice: {heard:?}");
        let first = heard[0].1;
        assert!(heard.iter().all(|h| h.1 == first), "{heard:?}");
        assert!(
            first.loss > previous,
            "step {step}: {} after {previous}",
            first.loss
        );
        previous = first.loss;
        let evaluator = s.peers[&first.by].1.stage;
        assert_eq!(evaluator, 0, "evaluated by a replica of stage {evaluator}");
    }
    // Forward passes only: nothing of a held-out microbatch was committed.
    s.assert_at_most_once();
}

#[test]
fn a_lost_reply_is_retried_and_never_applied_twice() {
    let mut s = three_by_two(SyncMode::AllReduce, 30);
    // Lose the first three gradients going back to the first driver (the run's creator).
    let mut lost = 0;
    s.filter = Box::new(move |_, to, m| {
        if to == PeerKey(1) && matches!(m, Message::Backward(_)) && lost < 3 {
            lost += 1;
            return None;
        }
        Some(Duration::ZERO)
    });
    finishes_after_retries(&mut s, 3);
}

#[test]
fn a_late_reply_races_its_retry_and_only_one_is_applied() {
    let mut s = three_by_two(SyncMode::AllReduce, 30);
    // Hold back the first backward passes to a driver past the deadline instead of losing
    // them: the retry and the original both come home.
    let mut seen = 0;
    s.filter = Box::new(move |_, to, m| {
        if to == PeerKey(1) && matches!(m, Message::Backward(_)) {
            seen += 1;
            if seen <= 3 {
                return Some(Duration::from_millis(700));
            }
        }
        Some(Duration::ZERO)
    });
    finishes_after_retries(&mut s, 3);
}

#[test]
fn a_killed_replica_does_not_stop_the_run() {
    let mut s = three_by_two(SyncMode::AllReduce, 8);
    s.run_until(s.now + Duration::from_millis(300));
    // Kill a middle-stage replica mid-run.
    let victim = s
        .live()
        .find(|(_, (p, _, _))| p.stage() == Some(1))
        .map(|(k, _)| k.0)
        .unwrap();
    s.kill(victim);
    s.run_until(Duration::from_secs(120));
    assert!(
        s.all_finished(),
        "{:?}",
        &s.events[s.events.len().saturating_sub(30)..]
    );
    s.assert_at_most_once();
    for stage in 0..3 {
        let h = s.hashes(stage);
        assert!(h.windows(2).all(|w| w[0] == w[1]), "stage {stage}: {h:?}");
    }
}

#[test]
fn a_joiner_takes_a_stage_and_matches_its_replicas() {
    let mut s = Swarm::new(2, SyncMode::AllReduce, 12);
    for k in 1..=3 {
        s.add(k, 1);
        let t = s.now + 200 * MS;
        s.run_until(t);
    }
    s.run_until(s.now + Duration::from_millis(500));
    s.add(9, 1);
    s.run_until(Duration::from_secs(120));
    assert!(s.all_finished());
    let joiner = &s.peers[&PeerKey(9)].0;
    let stage = joiner.stage().unwrap();
    assert!(
        joiner.stats().state_transfers >= 1,
        "the joiner downloaded its stage"
    );
    let h = s.hashes(stage);
    assert!(
        h.len() >= 2 && h.windows(2).all(|w| w[0] == w[1]),
        "stage {stage}: {h:?}"
    );
    s.assert_at_most_once();
}

/// A joiner of a stage with ten replicas asks eight of them for the state in allreduce
/// (their exports are identical, so each serves part of it) and only three in DiLoCo (each
/// exports its own local state, so the first to answer serves it all).
#[test]
fn a_joiner_asks_more_replicas_where_their_states_are_identical() {
    for (sync, asked) in [
        (SyncMode::AllReduce, MAX_SOURCES),
        (SyncMode::diloco(4), RACING_SOURCES),
    ] {
        let mut s = Swarm::new(1, sync, 40);
        for k in 1..=10 {
            s.add_at(k, 1, Some(0));
        }
        s.run_until(s.now + Duration::from_millis(500));
        let sources = std::rc::Rc::new(std::cell::RefCell::new(BTreeSet::new()));
        let seen = sources.clone();
        s.filter = Box::new(move |from, to, msg| {
            if from == PeerKey(99) && matches!(msg, Message::StateRequest { .. }) {
                seen.borrow_mut().insert(to);
            }
            Some(Duration::ZERO)
        });
        s.add(99, 1);
        s.run_until(s.now + Duration::from_secs(5));
        let joiner = &s.peers[&PeerKey(99)].0;
        assert!(joiner.stats().state_transfers >= 1, "{sync:?}: downloaded");
        assert_eq!(sources.borrow().len(), asked, "{sync:?}");
    }
}

/// Rebalancing: three replicas on the first stage, one on the second; one of the first moves
/// (the smallest key: the moves are equally good), the others see the new balance and stay,
/// and the run goes on to its end with equal replicas.
#[test]
fn a_badly_balanced_swarm_moves_one_peer_and_trains_on() {
    let mut s = Swarm::new(2, SyncMode::AllReduce, 200);
    for (key, stage) in [(1, 0), (2, 0), (3, 0), (4, 1)] {
        s.add_at(key, 1, Some(stage));
    }
    s.run_until(Duration::from_secs(120));
    assert!(
        s.all_finished(),
        "{:?}",
        &s.events[s.events.len().saturating_sub(20)..]
    );
    let moves: Vec<(PeerKey, u32, u32)> = s
        .events
        .iter()
        .filter_map(|(k, e)| match e {
            Event::Moving { from, to } => Some((*k, *from, *to)),
            _ => None,
        })
        .collect();
    assert_eq!(moves, [(PeerKey(1), 0, 1)]);
    for stage in 0..2 {
        let h = s.hashes(stage);
        assert_eq!(h.len(), 2, "stage {stage}: {h:?}");
        assert_eq!(h[0], h[1], "stage {stage}");
    }
    s.assert_at_most_once();
}

#[test]
fn diloco_replicas_agree_after_every_outer_round() {
    let mut s = three_by_two(SyncMode::diloco(2), 6);
    s.run_until(Duration::from_secs(120));
    if !s.all_finished() {
        for (k, (p, _, _)) in &s.peers {
            eprintln!(
                "{k} stage {:?} step {} round {} finished {}",
                p.stage(),
                p.step(),
                p.round(),
                p.is_finished()
            );
        }
        for (k, e) in &s.events {
            if !matches!(e, Event::Committed { .. }) {
                eprintln!("{k} {e:?}");
            }
        }
    }
    assert!(s.all_finished());
    for stage in 0..3 {
        let h = s.hashes(stage);
        assert_eq!(h.len(), 2);
        assert_eq!(h[0], h[1], "stage {stage}");
        assert_eq!(h[0].0, 3, "6 inner steps at h = 2 are 3 outer rounds");
    }
    s.assert_at_most_once();
}
