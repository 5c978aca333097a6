//! The discrete-event core: a virtual clock, one queue of timed events, and the peers.
//!
//! Each simulated peer is the node's protocol machine ([`Peer`]) plus its compute
//! ([`StageWorker`]), a device model and an access link. The loop pops the earliest event,
//! feeds it to the machine it concerns at that virtual time, and carries out what the machine
//! asks: a message goes through the link model and arrives later as another event; a compute
//! job runs now, for real, and its completion is scheduled after the time the device model
//! gives it; a timer is scheduled for the machine's next deadline. Ties are broken by the
//! order events were scheduled in, and every random choice comes from one seeded generator,
//! so a scenario and a seed give one trace.
//!
//! Over 900 lines, kept whole: it is the event loop and the one `Ev` match the others feed.
//! What measures a run is in `measure.rs`, the gossip mesh in `mesh.rs`.

use crate::device::{DeviceProfile, StageOffload};
use crate::link::{AccessLink, deliver};
use crate::modelled::ModelledStage;
use crate::report::{Recovery, Report};
use crate::scenario::{Compute, EventKind, Group, Setup};
use shoal_compute::{Corpus, CpuBackend, ModelConfig, Residency, StageSpec};
use shoal_protocol::swarm::attack::{Attack, Behavior};
use shoal_protocol::swarm::message::Traffic;
use shoal_protocol::swarm::{
    Action, ComputeDone, Envelope, Event, Input, Job, Message, Peer, PeerKey, PeerStats, RunConfig,
    RunId, SeededRng, StageCosts, SyncMode, Timing,
};
use shoal_protocol::wire::FRAME_HEADER_LEN;
use shoal_worker::{StageWorker, model_of, stage_costs};
use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::sync::Arc;
use std::time::Duration;
use xxhash_rust::xxh3::Xxh3Default;

mod measure;
mod mesh;

/// Progress, for a progress bar.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    /// Simulated seconds so far.
    pub sim_s: f64,
    /// Optimizer steps the run has taken.
    pub step: u64,
    /// Steps it will take.
    pub steps: u64,
    /// Peers alive now.
    pub peers: usize,
}

/// What carries out a simulated peer's compute jobs.
enum Worker {
    Real(Box<StageWorker>),
    Modelled(Box<ModelledStage>),
}

impl Worker {
    /// A state this worker exported, made well-formed and wrong (a scripted attacker's).
    fn poison(&self, bytes: &mut Vec<u8>) {
        match self {
            Worker::Real(_) => {
                if let Some(p) = shoal_compute::poisoned_state(bytes) {
                    *bytes = p;
                }
            }
            // A modelled state is its parameters' hash: another hash is other parameters.
            Worker::Modelled(_) => {
                if let Some(h) = bytes.get_mut(8..16) {
                    h.iter_mut().for_each(|b| *b ^= 0x5a);
                }
            }
        }
    }

    fn run(&mut self, job: Job) -> ComputeDone {
        match self {
            Worker::Real(w) => w.run(job),
            Worker::Modelled(w) => w.run(job),
        }
    }
}

/// One simulated peer.
struct SimPeer {
    key: PeerKey,
    machine: Peer,
    worker: Worker,
    device: DeviceProfile,
    link: AccessLink,
    joined_at: f64,
    /// When it crashed or left.
    gone_at: Option<f64>,
    /// When it first served a stage.
    served_at: Option<f64>,
    /// Partition side (peers talk only within a side) and since when.
    side: u32,
    side_since: f64,
    /// When its device is free again.
    busy_until: f64,
    /// Seconds its device has been given work for.
    busy_total: f64,
    /// The deadline its pending timer event is for.
    timer: Option<u64>,
    /// Whether it misbehaves at some point of the run (see [`Attack`]).
    attacker: bool,
    /// The identities it speaks for (`sybil:N`: indices of peers whose machine never runs).
    sybils: Vec<usize>,
    /// Whether it is such an identity: it announces what its attacker says and nothing else,
    /// and whatever is sent to it is lost.
    sybil: bool,
}

impl SimPeer {
    /// Whether it attacks at some point of the run.
    fn attacker(&self) -> bool {
        self.attacker
    }

    /// Whether its replica holds a parameter or optimizer value that is not finite (real
    /// compute only).
    fn holds_nonfinite(&self) -> bool {
        let Worker::Real(w) = &self.worker else {
            return false;
        };
        // A replica that cannot be read counts as holding nothing wrong.
        w.replica()
            .is_some_and(|r| r.all_finite().is_ok_and(|finite| !finite))
    }

    fn alive(&self) -> bool {
        self.gone_at.is_none()
    }

    /// Seconds it was present in a simulation that ended at `end`.
    fn present(&self, end: f64) -> f64 {
        (self.left(end) - self.joined_at).max(0.0)
    }

    /// When it left a simulation that ended at `end` (crashed, left, or was there to the end).
    fn left(&self, end: f64) -> f64 {
        self.gone_at.unwrap_or(end).min(end)
    }
}

#[derive(Debug)]
enum Ev {
    /// A group of peers joins.
    Join(usize),
    /// A scripted event.
    Script(usize),
    /// A message of `bytes` on the wire arrives.
    Deliver {
        to: usize,
        from: usize,
        msg: Message,
        bytes: u64,
    },
    /// A message's acknowledgement reached its sender `peer`: the transfer took `elapsed` on a
    /// path whose round trip is `rtt`.
    Delivered {
        peer: usize,
        to: usize,
        bytes: u64,
        elapsed: u64,
        rtt: u64,
    },
    /// A gossiped announcement of `origin` reaches `to` from `via`, its mesh neighbour.
    Gossip {
        to: usize,
        via: usize,
        origin: usize,
        msg: Message,
    },
    /// A message sent across a partition is sent again (QUIC's probe timeout): delivered if
    /// the partition healed meanwhile, failed once the connection has timed out.
    Retransmit {
        from: usize,
        to: usize,
        msg: Message,
        bytes: u64,
        backoff: u64,
    },
    /// A send failed (the receiver is unreachable and the connection timed out).
    SendFailed { peer: usize, to: PeerKey },
    /// A peer's connection to another closed or timed out.
    PeerLost { peer: usize, lost: usize },
    /// A compute job finished.
    Computed { peer: usize, done: ComputeDone },
    /// A machine's deadline.
    Timer { peer: usize },
}

impl Ev {
    fn tag(&self) -> (u8, u64, u64) {
        match self {
            Ev::Join(g) => (0, *g as u64, 0),
            Ev::Script(i) => (1, *i as u64, 0),
            Ev::Deliver { to, from, .. } => (2, *to as u64, *from as u64),
            Ev::SendFailed { peer, to } => (3, *peer as u64, to.0),
            Ev::Retransmit { from, to, .. } => (8, *from as u64, *to as u64),
            Ev::Gossip { to, origin, .. } => (9, *to as u64, *origin as u64),
            Ev::Delivered { peer, to, .. } => (7, *peer as u64, *to as u64),
            Ev::PeerLost { peer, lost } => (4, *peer as u64, *lost as u64),
            Ev::Computed { peer, .. } => (5, *peer as u64, 0),
            Ev::Timer { peer } => (6, *peer as u64, 0),
        }
    }
}

struct Scheduled {
    at: u64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    /// Earliest first (BinaryHeap is a max-heap).
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

fn ns(s: f64) -> u64 {
    (s.max(0.0) * 1e9).round() as u64
}

fn secs(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// A disruption whose recovery is being timed.
struct Pending {
    cause: String,
    at: f64,
    /// Every live replica must pass this step.
    step: u64,
}

/// The simulation of one scenario.
pub struct Sim {
    setup: Setup,
    config: RunConfig,
    run: RunId,
    /// What each stage costs a device that cannot hold it and offloads its blocks.
    offload: Vec<StageOffload>,
    /// The model's costs: what the device model times jobs by.
    costs: StageCosts,
    /// What peers are told and carry: the model's, but for modelled compute's scaled-down
    /// parameter-sized tensors (see [`scaled_down`]).
    peer_costs: StageCosts,
    timing: Timing,
    backend: Arc<CpuBackend>,
    rng: SeededRng,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Scheduled>,
    peers: Vec<SimPeer>,
    by_key: BTreeMap<PeerKey, usize>,
    next_side: u32,
    /// The gossip mesh announcements travel through.
    mesh: mesh::Mesh,
    trace: Xxh3Default,
    events: u64,
    // What the report needs.
    step: u64,
    tokens: u64,
    loss_curve: Vec<(f64, u64, f64)>,
    val_curve: Vec<(f64, u64, f64)>,
    tokens_curve: Vec<(f64, u64)>,
    /// Device-seconds of work given to the peers serving each stage.
    stage_busy: Vec<f64>,
    bytes: BTreeMap<Traffic, u64>,
    /// Bytes of gossip through the mesh (see [`mesh`]).
    gossip_bytes: u64,
    boundary_codecs: BTreeMap<String, u64>,
    committed: BTreeSet<(u32, u64)>,
    double_commits: u64,
    resyncs: u64,
    /// States refused by their receivers (they differed from the stage's parameters).
    refused_states: u64,
    /// Averaged parts the members' votes refused, once per honest replica.
    refused_parts: u64,
    violations: u64,
    /// `[sim_s, peer, reason]`: the first ban of each peer by an honest peer.
    banned: Vec<(f64, usize, String)>,
    /// Per peer whose claims an honest peer discounted: when first, and the lowest credit.
    discounted: BTreeMap<usize, (f64, f64)>,
    /// The lowest credit an honest peer gave an honest one, sampled at its steps.
    honest_credit_min: f64,
    /// Each kind of warning, and the peers that gave it.
    warnings: BTreeMap<String, BTreeSet<usize>>,
    pending: Vec<Pending>,
    recoveries: Vec<Recovery>,
    gone_stats: Vec<PeerStats>,
    moves: Vec<(f64, usize, u32, u32)>,
    /// `[sim_s, peer, bytes, seconds, senders]` of every state download completed.
    downloads: Vec<(f64, usize, u64, f64, usize)>,
    /// The slowest stage's capacity at the first step.
    slowest_at_first_step: Option<f64>,
    /// Print every peer's protocol events to stderr (`SHOAL_NETSIM_EVENTS` set): what a
    /// seed's run did, to replay one that went wrong.
    log_events: bool,
}

/// What each stage of `config` costs a device that offloads it (see [`StageOffload`]): its
/// device memory with the window of microbatches the protocol budgets for, all blocks held.
fn stage_offload(config: &RunConfig, model: &ModelConfig, timing: &Timing) -> Vec<StageOffload> {
    let in_flight = (timing.in_flight_per_stage * config.stages) as usize;
    let held = Residency {
        moments_on_host: true,
        ..Residency::default()
    };
    (0..config.stages as usize)
        .map(|index| {
            let spec = StageSpec {
                index,
                count: config.stages as usize,
            };
            let rows = config.microbatch as usize;
            StageOffload {
                resident: spec.device_memory_bytes(
                    model,
                    rows,
                    config.seq as usize,
                    in_flight,
                    held,
                ),
                block_params: model.block_params() as u64,
                blocks: spec.blocks(model).len() as u64,
            }
        })
        .collect()
}

impl Sim {
    /// A simulation of `setup` from `seed`.
    pub fn new(setup: Setup, seed: u64) -> Result<Sim, String> {
        let config = setup.config.clone();
        let model = model_of(&config)?;
        let timing = Timing::default();
        let costs = stage_costs(&config, &model, &timing);
        let offload = stage_offload(&config, &model, &timing);
        let peer_costs = match setup.compute {
            Compute::Real => costs.clone(),
            Compute::Modelled => scaled_down(&costs, setup.sim.modelled_tensor_values),
        };
        let backend = Arc::new(CpuBackend::new(1).map_err(|e| e.to_string())?);
        let mut sim = Sim {
            run: config.run_id(),
            config,
            costs,
            offload,
            peer_costs,
            timing,
            backend,
            rng: SeededRng::new(seed),
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            peers: Vec::new(),
            by_key: BTreeMap::new(),
            next_side: 1,
            mesh: mesh::Mesh::new(seed),
            trace: Xxh3Default::new(),
            events: 0,
            step: 0,
            tokens: 0,
            loss_curve: Vec::new(),
            val_curve: Vec::new(),
            tokens_curve: vec![(0.0, 0)],
            stage_busy: vec![0.0; setup.config.stages as usize],
            bytes: BTreeMap::new(),
            gossip_bytes: 0,
            boundary_codecs: BTreeMap::new(),
            committed: BTreeSet::new(),
            double_commits: 0,
            resyncs: 0,
            refused_parts: 0,
            refused_states: 0,
            violations: 0,
            banned: Vec::new(),
            discounted: BTreeMap::new(),
            honest_credit_min: 1.0,
            pending: Vec::new(),
            recoveries: Vec::new(),
            gone_stats: Vec::new(),
            moves: Vec::new(),
            downloads: Vec::new(),
            slowest_at_first_step: None,
            log_events: std::env::var_os("SHOAL_NETSIM_EVENTS").is_some(),
            warnings: BTreeMap::new(),
            setup,
        };
        for (i, g) in sim.setup.groups.clone().iter().enumerate() {
            sim.schedule(ns(g.join_at_s), Ev::Join(i));
        }
        for (i, e) in sim.setup.events.clone().iter().enumerate() {
            sim.schedule(ns(e.at_s), Ev::Script(i));
        }
        Ok(sim)
    }

    fn schedule(&mut self, at: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Scheduled {
            at: at.max(self.now),
            seq: self.seq,
            ev,
        });
    }

    fn now_s(&self) -> f64 {
        secs(self.now)
    }

    fn now_d(&self) -> Duration {
        Duration::from_nanos(self.now)
    }

    /// Runs to the end (the last step, or `max_sim_s`), calling `progress` now and then.
    pub fn run(mut self, progress: &mut dyn FnMut(&Progress)) -> Result<Report, String> {
        let limit = ns(self.setup.sim.max_sim_s);
        let mut next_report = 0u64;
        while let Some(Scheduled { at, ev, .. }) = self.queue.pop() {
            if at > limit {
                self.now = limit;
                break;
            }
            self.now = at;
            self.events += 1;
            let (kind, a, b) = ev.tag();
            self.trace.update(&at.to_le_bytes());
            self.trace.update(&[kind]);
            self.trace.update(&a.to_le_bytes());
            self.trace.update(&b.to_le_bytes());
            self.handle(ev)?;
            if self.done() {
                break;
            }
            if at >= next_report {
                next_report = at + 500_000_000;
                progress(&Progress {
                    sim_s: self.now_s(),
                    step: self.step,
                    steps: self.config.max_steps,
                    peers: self.peers.iter().filter(|p| p.alive()).count(),
                });
            }
        }
        progress(&Progress {
            sim_s: self.now_s(),
            step: self.step,
            steps: self.config.max_steps,
            peers: self.peers.iter().filter(|p| p.alive()).count(),
        });
        if self.log_events {
            // Where each peer stands at the end: what to look at when a run did not finish.
            for (i, p) in self.peers.iter_mut().enumerate() {
                if p.alive() {
                    eprintln!("at the end, peer {i}: {:?}", p.machine.announcement());
                }
            }
        }
        Ok(self.report())
    }

    /// Live peers serving a stage.
    fn serving(&self) -> impl Iterator<Item = &SimPeer> {
        self.peers
            .iter()
            .filter(|p| p.alive() && p.machine.is_serving())
    }

    /// Every live honest replica has taken the run's last step, and each stage's replicas
    /// agree on where it ended (a banned attacker, cut off by everyone, never does; an
    /// attacker's progress is not the run's). A replica that finished apart from the others
    /// (a partition that gave each side a whole pipeline) still has the hash vote to lose.
    fn done(&self) -> bool {
        let mut serving = self.serving().filter(|p| !p.attacker()).peekable();
        serving.peek().is_some()
            && serving.all(|p| p.machine.is_finished())
            && self.honest_replicas_agree()
    }

    fn handle(&mut self, ev: Ev) -> Result<(), String> {
        let now = self.now_d();
        match ev {
            Ev::Join(g) => {
                let group = self.setup.groups[g].clone();
                self.join(&group)?;
            }
            Ev::Script(i) => self.script(i)?,
            Ev::Deliver {
                to,
                from,
                msg,
                bytes,
            } => {
                if !self.peers[to].alive() || self.peers[to].sybil {
                    return Ok(());
                }
                if self.peers[to].side != self.peers[from].side {
                    // Cut off in flight: lost, and sent again until the partition heals or
                    // the connection times out.
                    self.retransmit_later(from, to, msg, bytes, None);
                    return Ok(());
                }
                let key = self.peers[from].key;
                self.peers[to].machine.handle_message(key, msg, now);
                self.after(to);
            }
            Ev::Delivered {
                peer,
                to,
                bytes,
                elapsed,
                rtt,
            } => {
                // A receiver that crashed or was cut off meanwhile acknowledges nothing.
                let acked = self.peers[to].alive() && self.peers[to].side == self.peers[peer].side;
                if self.peers[peer].alive() && acked {
                    let key = self.peers[to].key;
                    let m = &mut self.peers[peer].machine;
                    m.handle_rtt(key, Duration::from_nanos(rtt));
                    m.handle_delivered(key, bytes, Duration::from_nanos(elapsed));
                }
            }
            Ev::Gossip {
                to,
                via,
                origin,
                msg,
            } => {
                let reachable = self.peers[via].side == self.peers[to].side;
                if self.peers[to].alive() && !self.peers[to].sybil && reachable {
                    let (origin, via) = (self.peers[origin].key, self.peers[via].key);
                    self.peers[to].machine.handle_gossip(origin, via, msg, now);
                    self.after(to);
                }
            }
            Ev::Retransmit {
                from,
                to,
                msg,
                bytes,
                backoff,
            } => {
                if self.peers[from].alive() {
                    self.transmit(from, to, msg, bytes, Some(backoff));
                }
            }
            Ev::SendFailed { peer, to } => {
                if self.peers[peer].alive() {
                    self.peers[peer].machine.handle_send_failed(to, now);
                    self.after(peer);
                }
            }
            Ev::PeerLost { peer, lost } => {
                let still_cut =
                    !self.peers[lost].alive() || self.peers[lost].side != self.peers[peer].side;
                if self.peers[peer].alive() && still_cut {
                    let key = self.peers[lost].key;
                    self.peers[peer].machine.handle_peer_lost(key, now);
                    self.after(peer);
                }
            }
            Ev::Computed { peer, mut done } => {
                if self.peers[peer].alive() {
                    if let ComputeDone::State { bytes, .. } = &mut done
                        && self.peers[peer].machine.poisons_state()
                    {
                        self.peers[peer].worker.poison(bytes);
                    }
                    self.peers[peer].machine.handle_compute_done(done, now);
                    self.after(peer);
                }
            }
            Ev::Timer { peer } => {
                let p = &mut self.peers[peer];
                if p.alive() && p.timer == Some(self.now) {
                    p.timer = None;
                    p.machine.handle_timeout(now);
                    self.after(peer);
                }
            }
        }
        Ok(())
    }

    fn join(&mut self, group: &Group) -> Result<(), String> {
        for _ in 0..group.count {
            let key = PeerKey(self.rng.next_u64());
            let link = AccessLink::new(group.link, &mut self.rng);
            let seed = self.rng.next_u64();
            let mut machine = Peer::new(
                key,
                self.config.clone(),
                self.peer_costs.clone(),
                self.timing,
                seed,
                None,
                self.now_d(),
            );
            machine.set_memory(group.device.memory);
            machine.set_offloads(group.offload && group.device.host_link > 0.0);
            machine.set_routing(self.setup.routing);
            if let Some(stage) = group.stage {
                machine.set_first_stage(stage);
            }
            // Its noise is seeded by its key: an attacker draws nothing from the simulation's.
            machine.set_attack(Attack::new(
                group.behavior,
                Duration::from_secs_f64(group.behavior_from_s),
                key.0,
            ));
            let worker = match self.setup.compute {
                Compute::Real => {
                    let corpus = Corpus::synthetic(self.config.seed);
                    Worker::Real(Box::new(StageWorker::new(
                        self.config.clone(),
                        self.backend.clone(),
                        Some(corpus),
                    )?))
                }
                // Seeded by the key, not by a draw, so that real and modelled runs of one
                // scenario draw the same random numbers.
                Compute::Modelled => Worker::Modelled(Box::new(ModelledStage::new(
                    self.config.clone(),
                    &self.peer_costs,
                    key.0,
                )?)),
            };
            let index = self.peers.len();
            if self.log_events {
                eprintln!("{:10.3} s  peer {index} joins as {key:?}", self.now_s());
            }
            self.by_key.insert(key, index);
            self.peers.push(SimPeer {
                key,
                machine,
                worker,
                device: group.device,
                link,
                joined_at: self.now_s(),
                gone_at: None,
                served_at: None,
                side: 0,
                side_since: 0.0,
                busy_until: self.now_s(),
                busy_total: 0.0,
                timer: None,
                attacker: group.behavior != Behavior::Honest,
                sybils: Vec::new(),
                sybil: false,
            });
            if let Behavior::Sybil(n) = group.behavior {
                for _ in 0..n {
                    self.add_sybil(index, group)?;
                }
            }
            self.after(index);
        }
        Ok(())
    }

    /// Adds an identity that `attacker` speaks for: a key and a link, no work.
    fn add_sybil(&mut self, attacker: usize, group: &Group) -> Result<(), String> {
        let key = PeerKey(self.rng.next_u64());
        let link = AccessLink::new(group.link, &mut self.rng);
        let machine = Peer::new(
            key,
            self.config.clone(),
            self.peer_costs.clone(),
            self.timing,
            key.0,
            None,
            self.now_d(),
        );
        let worker = Worker::Modelled(Box::new(ModelledStage::new(
            self.config.clone(),
            &self.peer_costs,
            key.0,
        )?));
        let index = self.peers.len();
        self.by_key.insert(key, index);
        self.peers.push(SimPeer {
            key,
            machine,
            worker,
            device: group.device,
            link,
            joined_at: self.now_s(),
            gone_at: None,
            served_at: None,
            side: 0,
            side_since: 0.0,
            busy_until: self.now_s(),
            busy_total: 0.0,
            timer: None,
            attacker: true,
            sybils: Vec::new(),
            sybil: true,
        });
        self.peers[attacker].sybils.push(index);
        Ok(())
    }

    /// What a `sybil:N` attacker announces, for itself and for each of its identities: its
    /// own announcement (its hash already forged), accusing the honest replicas of its stage.
    fn speak_for_sybils(&mut self, i: usize, a: &mut shoal_protocol::swarm::Announcement) {
        let stage = a.stage;
        a.accuses = self
            .peers
            .iter()
            .filter(|p| p.alive() && !p.attacker() && stage.is_some() && p.machine.stage() == stage)
            .take(shoal_protocol::swarm::bans::MAX_ACCUSATIONS)
            .map(|p| shoal_protocol::swarm::message::Accusation {
                peer: p.key,
                why: shoal_protocol::swarm::message::Misconduct::OpposedTheStage,
            })
            .collect();
        for j in self.peers[i].sybils.clone() {
            let mut theirs = a.clone();
            theirs.incarnation = self.peers[j].key.0;
            // The identity has no connections of its own: its attacker publishes for it.
            self.publish(i, j, theirs);
        }
    }

    /// Peers chosen for a crash, leave or partition: named, or drawn by the seed among the
    /// live ones, never taking a stage's last live replica while another choice exists.
    fn choose(&mut self, count: u32, named: Option<&[usize]>) -> Vec<usize> {
        if let Some(named) = named {
            return named
                .iter()
                .copied()
                .filter(|i| self.peers.get(*i).is_some_and(SimPeer::alive))
                .collect();
        }
        let mut chosen: Vec<usize> = Vec::new();
        for _ in 0..count {
            let live: Vec<usize> = (0..self.peers.len())
                .filter(|i| self.peers[*i].alive() && !chosen.contains(i))
                .collect();
            let replicas_left = |i: usize, chosen: &[usize]| {
                let stage = self.peers[i].machine.stage();
                live.iter()
                    .filter(|j| **j != i && !chosen.contains(j))
                    .any(|j| self.peers[*j].machine.stage() == stage)
            };
            let safe: Vec<usize> = live
                .iter()
                .copied()
                .filter(|i| replicas_left(*i, &chosen))
                .collect();
            let pool = if safe.is_empty() { &live } else { &safe };
            if pool.is_empty() {
                break;
            }
            let pick = pool[(self.rng.next_u64() % pool.len() as u64) as usize];
            chosen.push(pick);
        }
        chosen.sort_unstable();
        chosen
    }

    fn script(&mut self, i: usize) -> Result<(), String> {
        let e = self.setup.events[i].clone();
        let now = self.now_s();
        let idle = self.setup.sim.idle_timeout_s;
        let mut disrupted = Vec::new();
        match e.kind {
            EventKind::Join => {
                if let Some(g) = &e.joiners {
                    self.join(g)?;
                }
            }
            EventKind::Crash | EventKind::Leave => {
                disrupted = self.choose(e.count, e.peers.as_deref());
                for &p in &disrupted {
                    if e.kind == EventKind::Leave {
                        // A polite goodbye, then the connections close.
                        let bye = self.peers[p].machine.leave();
                        self.gossip(p, bye);
                    }
                    let stats = self.peers[p].machine.stats();
                    self.gone_stats.push(stats);
                    self.peers[p].gone_at = Some(now);
                    let notice = if e.kind == EventKind::Leave {
                        0.0
                    } else {
                        idle
                    };
                    for q in 0..self.peers.len() {
                        if q != p && self.peers[q].alive() {
                            let at = now + notice + self.latency(p, q);
                            self.schedule(ns(at), Ev::PeerLost { peer: q, lost: p });
                        }
                    }
                }
            }
            EventKind::Partition => {
                disrupted = self.choose(e.count, e.peers.as_deref());
                let side = self.next_side;
                self.next_side += 1;
                for &p in &disrupted {
                    self.peers[p].side = side;
                    self.peers[p].side_since = now;
                }
                for &p in &disrupted {
                    for q in 0..self.peers.len() {
                        if self.peers[q].alive() && self.peers[q].side != side {
                            self.schedule(ns(now + idle), Ev::PeerLost { peer: q, lost: p });
                            self.schedule(ns(now + idle), Ev::PeerLost { peer: p, lost: q });
                        }
                    }
                }
            }
            EventKind::Heal => {
                for p in &mut self.peers {
                    p.side = 0;
                    p.side_since = now;
                }
            }
        }
        if self.log_events {
            eprintln!("{now:10.3} s  {} of peers {disrupted:?}", e.kind.name());
        }
        if !disrupted.is_empty() {
            let step = self.serving().map(|p| p.machine.step()).max().unwrap_or(0);
            self.pending.push(Pending {
                cause: format!("{} of {}", e.kind.name(), disrupted.len()),
                at: now,
                step: step + 1,
            });
        }
        Ok(())
    }

    fn latency(&self, a: usize, b: usize) -> f64 {
        (self.peers[a].link.latency + self.peers[b].link.latency) / 2.0
    }

    /// Tells `from` that a send to `to` failed, once its connection has timed out.
    fn fail_send(&mut self, from: usize, to: usize, cut_at: f64) {
        let at = (self.now_s() + 2.0 * self.latency(from, to))
            .max(cut_at + self.setup.sim.idle_timeout_s);
        let to = self.peers[to].key;
        self.schedule(ns(at), Ev::SendFailed { peer: from, to });
    }

    /// Schedules the next try of a message cut off by a partition, or its failure once the
    /// connection has been cut for the idle timeout. The first probe timeout is three round
    /// trips (at least 10 ms), as QUIC's is with no RTT variance.
    fn retransmit_later(
        &mut self,
        from: usize,
        to: usize,
        msg: Message,
        bytes: u64,
        backoff: Option<u64>,
    ) {
        let cut = self.peers[to].side_since.max(self.peers[from].side_since);
        let timed_out = ns(cut + self.setup.sim.idle_timeout_s);
        if self.now >= timed_out {
            self.fail_send(from, to, cut);
            return;
        }
        let backoff = match backoff {
            Some(b) => 2 * b,
            None => ns((6.0 * self.latency(from, to)).max(0.010)),
        };
        let ev = Ev::Retransmit {
            from,
            to,
            msg,
            bytes,
            backoff,
        };
        self.schedule((self.now + backoff).min(timed_out), ev);
    }

    /// Sends `msg` from `from` to `to` through the link model.
    fn send(&mut self, from: usize, to: usize, msg: Message) {
        let env = Envelope { run: self.run, msg };
        // Scaled-down tensors are charged their full size.
        let unscaled = env.msg.parameter_bytes() * (self.peer_costs.param_scale - 1);
        let bytes = (env.to_bytes().len() + FRAME_HEADER_LEN + unscaled) as u64;
        *self.bytes.entry(env.msg.traffic()).or_default() += bytes;
        if let Some(codec) = env.msg.boundary_codec() {
            *self.boundary_codecs.entry(codec).or_default() += 1;
        }
        self.transmit(from, to, env.msg, bytes, None);
    }

    /// Puts `bytes` of `msg` on the path from `from` to `to`: delivered if `to` is reachable,
    /// failed once the connection times out if it crashed, and sent again after a probe
    /// timeout (`backoff`, doubling from the last) if a partition cuts them apart, as QUIC
    /// does: a partition that heals before the idle timeout delays messages, it does not lose
    /// them.
    fn transmit(&mut self, from: usize, to: usize, msg: Message, bytes: u64, backoff: Option<u64>) {
        if let Some(gone) = self.peers[to].gone_at {
            self.fail_send(from, to, gone);
            return;
        }
        if self.peers[to].side != self.peers[from].side {
            self.retransmit_later(from, to, msg, bytes, backoff);
            return;
        }
        let now = self.now_s();
        let at = {
            let (a, b) = pair(&mut self.peers, from, to);
            deliver(now, bytes, &mut a.link, &mut b.link)
        };
        if !matches!(msg, Message::Announce(_)) {
            // The node times every message but gossip from its hand-over to the receiver's
            // acknowledgement, one path latency after the arrival.
            let latency = self.latency(from, to);
            let acked = at + latency;
            let ev = Ev::Delivered {
                peer: from,
                to,
                bytes,
                elapsed: ns(acked) - ns(now),
                rtt: ns(2.0 * latency),
            };
            self.schedule(ns(acked), ev);
        }
        self.schedule(
            ns(at),
            Ev::Deliver {
                to,
                from,
                msg,
                bytes,
            },
        );
    }

    /// Gossips `origin`'s own announcement through the mesh.
    fn gossip(&mut self, origin: usize, a: shoal_protocol::swarm::Announcement) {
        self.publish(origin, origin, a);
    }

    /// Carries out what peer `i`'s machine asks, then sets its timer.
    fn after(&mut self, i: usize) {
        while let Some(action) = self.peers[i].machine.poll_action() {
            match action {
                Action::Send { to, msg } => match self.by_key.get(&to) {
                    Some(&j) if j != i => self.send(i, j, msg),
                    _ => {
                        // Nobody by that key: the node would fail to open a stream.
                        self.schedule(self.now + 1_000_000, Ev::SendFailed { peer: i, to });
                    }
                },
                Action::Announce(mut a) => {
                    if self.peers[i].machine.sybils() > 0 {
                        self.speak_for_sybils(i, &mut a);
                    }
                    self.gossip(i, a)
                }
                Action::Compute(job) => {
                    let p = &mut self.peers[i];
                    let stage = p.machine.stage();
                    let offload = stage.and_then(|s| self.offload.get(s as usize));
                    let took = p.device.job_time(&job, stage, &self.costs, offload);
                    let done = p.worker.run(job);
                    let start = p.busy_until.max(secs(self.now));
                    p.busy_until = start + took.as_secs_f64();
                    p.busy_total += took.as_secs_f64();
                    let at = ns(p.busy_until);
                    if let Some(busy) = stage.and_then(|s| self.stage_busy.get_mut(s as usize)) {
                        *busy += took.as_secs_f64();
                    }
                    self.schedule(at, Ev::Computed { peer: i, done });
                }
                Action::Event(e) => self.on_event(i, e),
            }
        }
        let p = &mut self.peers[i];
        if let Some(t) = p.machine.poll_timeout() {
            // A deadline already past is served right away, but never in a loop at one
            // instant: a machine that keeps one is looked at again a millisecond later.
            let t = (t.as_nanos() as u64).max(self.now + 1_000);
            if p.timer.is_none_or(|cur| t < cur) {
                p.timer = Some(t);
                self.schedule(t, Ev::Timer { peer: i });
            }
        }
    }
}

/// `costs` with every stage's parameter-sized tensors scaled down by one factor, so that the
/// largest holds at most `max_values` values.
fn scaled_down(costs: &StageCosts, max_values: usize) -> StageCosts {
    let largest = costs.params.iter().copied().max().unwrap_or(0);
    let scale = largest.div_ceil(max_values.max(1)).max(1);
    StageCosts {
        params: costs.params.iter().map(|p| p.div_ceil(scale)).collect(),
        param_scale: scale,
        ..costs.clone()
    }
}

/// Two distinct peers, mutably.
fn pair(peers: &mut [SimPeer], a: usize, b: usize) -> (&mut SimPeer, &mut SimPeer) {
    if a < b {
        let (lo, hi) = peers.split_at_mut(b);
        (&mut lo[a], &mut hi[0])
    } else {
        let (lo, hi) = peers.split_at_mut(a);
        (&mut hi[0], &mut lo[b])
    }
}

/// Simulates `setup` from `seed`.
pub fn simulate(
    setup: Setup,
    seed: u64,
    progress: &mut dyn FnMut(&Progress),
) -> Result<Report, String> {
    let mut report = Sim::new(setup, seed)?.run(progress)?;
    report.seed = seed;
    Ok(report)
}
