//! A `Peer` driven by arbitrary bytes: each op delivers a message from some key (decoded from
//! the bytes, or built from a template the bytes perturb so that deep paths are reached:
//! valid tensors, current rounds, the peer's own attempt ids), passes time, completes the
//! peer's compute job, or loses a peer. Shared by the fuzz target (`protocol/fuzz`) and the
//! deterministic run in the test suite.

use shoal_protocol::codec::{TENSOR_HEADER_LEN, encode_to_vec};
use shoal_protocol::swarm::message::{
    Accusation, Backward, Forward, Misconduct, RoundKey, RoundMsg, Routed, RoutedRows, StateChunk,
};
use shoal_protocol::swarm::{
    Action, Announcement, ComputeDone, DataSource, HeldOut, Job, MemberState, Message, Output,
    Peer, PeerKey, RunConfig, StageCosts, SyncMode, Timing,
};
use shoal_protocol::{Codec, HopCodec, TrafficCodecs};
use std::collections::VecDeque;
use std::time::Duration;

const ME: PeerKey = PeerKey(1);
const STAGES: u32 = 2;
const PARAMS: usize = 40;
const ACTS_PER_ROW: usize = 6;
/// Messages of the peer's own kept to replay (its attempt ids, rounds, routes).
const KEPT: usize = 64;

/// Reads the fuzz input; past its end, zeros.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        let (b, rest) = self.0.split_first().map_or((0, &[][..]), |(b, r)| (*b, r));
        self.0 = rest;
        b
    }
    fn u64(&mut self) -> u64 {
        (0..8).fold(0, |v, _| (v << 8) | self.u8() as u64)
    }
    fn take(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The peer under test and what it asked for.
pub struct Exercise {
    peer: Peer,
    now: Duration,
    job: Option<Job>,
    kept: VecDeque<Message>,
    stage: u32,
    /// Violations the peer reported.
    pub violations: u64,
}

fn config(sync: SyncMode) -> RunConfig {
    RunConfig {
        preset: "toy".into(),
        stages: STAGES,
        global_batch: 8,
        microbatch: 2,
        seq: 3,
        sync,
        lr: 0.1,
        max_steps: 1_000,
        codecs: TrafficCodecs {
            activations: HopCodec::fixed(Codec::Fp32),
            activation_grads: HopCodec::fixed(Codec::default()),
            averaging: Codec::Fp32,
        },
        data: DataSource::Synthetic,
        seed: 5,
        init: None,
        // Evaluations run too, so that held-out traffic meets the forgeries.
        evaluation: shoal_protocol::swarm::Evaluation {
            every: 2,
            samples: 4,
            data: None,
        },
    }
}

fn timing() -> Timing {
    let ms = Duration::from_millis(1);
    Timing {
        announce_every: 50 * ms,
        member_timeout: 400 * ms,
        microbatch_deadline: 300 * ms,
        join_window: 100 * ms,
        round_timeout: 300 * ms,
        choose_after: 120 * ms,
        rebalance_every: Duration::from_secs(1),
        transfer_timeout: Duration::from_secs(2),
        ..Timing::default()
    }
}

fn announcement(stage: Option<u32>, state: MemberState, round: u64, seq: u64) -> Announcement {
    Announcement {
        stage,
        state,
        throughput: 1.0,
        queue: 0,
        step: round,
        round,
        params_hash: None,
        finished: false,
        newcomer: false,
        loss: None,
        memory: 0,
        offloads: false,
        incarnation: 1,
        seq,
        accuses: Vec::new(),
        held_out: None,
        routed: Routed::default(),
    }
}

fn tensor(values: &[f32], poison: bool) -> Vec<u8> {
    let mut m = encode_to_vec(Codec::Fp32, values, &[values.len()]).unwrap_or_default();
    if poison && m.len() >= TENSOR_HEADER_LEN + 4 {
        let at = TENSOR_HEADER_LEN;
        m[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        let sum = xxhash_rust::xxh3::xxh3_64(&m[TENSOR_HEADER_LEN..]);
        m[28..36].copy_from_slice(&sum.to_le_bytes());
    }
    m
}

impl Exercise {
    /// A peer that created a run of two stages (it serves stage `stage`), with `sync`.
    pub fn new(stage: u32, diloco: bool) -> Self {
        let sync = if diloco {
            SyncMode::diloco(2)
        } else {
            SyncMode::AllReduce
        };
        let costs = StageCosts {
            flops_per_sample: vec![1.0; STAGES as usize],
            params: vec![PARAMS; STAGES as usize],
            activation_values: ACTS_PER_ROW,
            memory: vec![0; STAGES as usize],
            offload_memory: vec![0; STAGES as usize],
            microbatch_memory: vec![0; STAGES as usize],
            param_scale: 1,
        };
        let mut peer = Peer::new(ME, config(sync), costs, timing(), 11, None, Duration::ZERO);
        peer.set_first_stage(stage);
        let mut e = Exercise {
            peer,
            now: Duration::ZERO,
            job: None,
            kept: VecDeque::new(),
            stage,
            violations: 0,
        };
        // Alone, it creates the stage; then it is serving.
        for _ in 0..40 {
            e.advance(Duration::from_millis(25));
            e.complete();
        }
        e
    }

    fn drain(&mut self) {
        while let Some(action) = self.peer.poll_action() {
            match action {
                Action::Send { msg, .. } => {
                    if self.kept.len() == KEPT {
                        self.kept.pop_front();
                    }
                    self.kept.push_back(msg);
                }
                Action::Announce(_) => {}
                Action::Compute(job) => self.job = Some(job),
                Action::Event(shoal_protocol::swarm::Event::Violation { .. }) => {
                    self.violations += 1
                }
                Action::Event(_) => {}
            }
        }
    }

    fn advance(&mut self, by: Duration) {
        self.now += by;
        if self.peer.poll_timeout().is_some_and(|t| t <= self.now) {
            self.peer.handle_timeout(self.now);
        }
        self.drain();
    }

    /// Completes the peer's compute job, as a device would.
    fn complete(&mut self) {
        let Some(job) = self.job.take() else { return };
        let last = self.stage + 1 == STAGES;
        let done = match job {
            Job::Init { .. } | Job::Restart { .. } | Job::Import { .. } => {
                ComputeDone::Ready { hash: 7 }
            }
            Job::Export { to } => ComputeDone::State {
                to,
                bytes: vec![0; PARAMS * 8],
            },
            Job::Forward { id, rows, .. } => ComputeDone::Forward {
                id,
                output: if last {
                    Output::Loss(1.0)
                } else {
                    Output::Activations(vec![0.5; rows as usize * ACTS_PER_ROW])
                },
            },
            Job::Backward { id, rows, .. } => ComputeDone::Backward {
                id,
                grad: (self.stage > 0).then(|| vec![0.25; rows as usize * ACTS_PER_ROW]),
            },
            Job::TakeGradient | Job::TakePseudoGradient => ComputeDone::Gradient {
                values: vec![0.1; PARAMS],
                samples: 2.0,
            },
            Job::Step { .. } | Job::LocalStep | Job::OuterStep { .. } => ComputeDone::Stepped {
                hash: 9,
                alignments: Vec::new(),
            },
            Job::Commit { .. } | Job::Abort { .. } | Job::Checkpoint { .. } => ComputeDone::Done,
        };
        self.peer.handle_compute_done(done, self.now);
        self.drain();
    }

    fn deliver(&mut self, from: PeerKey, msg: Message) {
        self.peer.handle_message(from, msg, self.now);
        self.drain();
    }

    /// A message built from a template, perturbed by the input.
    fn template(&mut self, b: &mut Bytes, from: PeerKey) -> Message {
        let round = self.peer.round();
        let small = |b: &mut Bytes, base: u64| match b.u8() % 4 {
            0 => base,
            1 => base + 1,
            2 => base.saturating_sub(1),
            _ => u64::MAX - (b.u8() as u64),
        };
        let stage = (b.u8() % 3) as u32;
        let poison = b.u8().is_multiple_of(4);
        let n = (b.u8() % 32) as usize;
        match b.u8() % 12 {
            0 => Message::Announce(Announcement {
                throughput: f32::from_bits(b.u64() as u32),
                queue: b.u8() as u32,
                params_hash: Some(b.u64()),
                finished: b.u8().is_multiple_of(8),
                memory: b.u64(),
                // A held-out result it may not have run, of any step.
                held_out: b.u8().is_multiple_of(3).then(|| HeldOut {
                    step: [2, 4, 1_000, u64::MAX][b.u8() as usize % 4],
                    loss: [2.5, f32::NAN, -3.0][b.u8() as usize % 3],
                    by: [from, PeerKey(b.u8() as u64 % 8)][b.u8() as usize % 2],
                }),
                // Up to 20 accusations of small keys (the peer itself among them): more
                // than an announcement may carry, and enough to reach a stage's majority.
                accuses: (0..(b.u8() % 21))
                    .map(|_| Accusation {
                        peer: PeerKey(b.u8() as u64 % 8),
                        why: Misconduct::OpposedTheStage,
                    })
                    .collect(),
                // Tallies of routes it may never have driven: any round, any hop, any count,
                // up to more entries than an announcement may carry.
                routed: Routed {
                    first: small(b, round),
                    rows: (0..[0, 3, 40, 2_100][b.u8() as usize % 4])
                        .map(|_| RoutedRows {
                            round: small(b, round),
                            hop: PeerKey(b.u8() as u64 % 8),
                            rows: [1, 8, u32::MAX][b.u8() as usize % 3],
                        })
                        .collect(),
                },
                ..announcement(
                    Some(stage),
                    [
                        MemberState::Serving,
                        MemberState::Syncing,
                        MemberState::Choosing,
                        MemberState::Leaving,
                    ][b.u8() as usize % 4],
                    small(b, round),
                    b.u8() as u64,
                )
            }),
            1 => {
                let f = Forward {
                    id: b.u64(),
                    sample: b.u64(),
                    round: small(b, round),
                    rows: (b.u8() % 4) as u32,
                    route: (0..(b.u8() % 4))
                        .map(|_| PeerKey(b.u8() as u64 % 8))
                        .chain([from])
                        .collect(),
                    activations: tensor(&vec![0.5; n], poison),
                };
                // A third are held-out microbatches of an evaluation.
                if b.u8().is_multiple_of(3) {
                    Message::Evaluate(f)
                } else {
                    Message::Forward(f)
                }
            }
            2 if b.u8().is_multiple_of(4) => Message::Evaluated {
                id: b.u64(),
                loss: [1.0, f32::NAN, -1.0, 1e9][b.u8() as usize % 4],
            },
            2 if b.u8().is_multiple_of(4) => Message::Discarded {
                id: b.u64(),
                route: vec![ME, from],
            },
            2 => Message::Backward(Backward {
                id: b.u64(),
                route: vec![ME, from],
                grad: tensor(&vec![0.5; n], poison),
            }),
            3 => Message::Progress {
                stage,
                round: small(b, round),
                samples: f64::from_bits(b.u64()),
                in_flight: (b.u8() as f64) / 4.0,
            },
            4..=6 => Message::Round {
                key: RoundKey {
                    stage,
                    index: small(b, round),
                },
                msg: match b.u8() % 6 {
                    0 => RoundMsg::Join,
                    1 => RoundMsg::Start {
                        group: (0..(b.u8() % 5))
                            .map(|_| PeerKey(b.u8() as u64 % 8))
                            .collect(),
                    },
                    2 => RoundMsg::Part {
                        attempt: b.u8() as u64,
                        part: (b.u8() % 4) as u32,
                        samples: (b.u8() as f64) / 2.0,
                        loss: None,
                        data: tensor(&vec![0.5; n], poison),
                    },
                    3 => RoundMsg::Averaged {
                        attempt: b.u8() as u64,
                        part: (b.u8() % 4) as u32,
                        samples: (b.u8() as f64) / 2.0,
                        loss: Some(1.0),
                        data: tensor(&vec![0.5; n], poison).into(),
                    },
                    4 => RoundMsg::Request {
                        attempt: b.u8() as u64,
                        part: (b.u8() % 4) as u32,
                    },
                    _ => RoundMsg::Missing {
                        attempt: b.u8() as u64,
                        part: (b.u8() % 4) as u32,
                    },
                },
            },
            7 => Message::CatchUpRequest {
                stage,
                round: small(b, round),
            },
            8 => Message::CatchUp {
                stage,
                round: small(b, round),
                samples: (b.u8() as f64) / 2.0,
                data: tensor(&vec![0.5; PARAMS.min(n * 2)], poison),
            },
            9 if b.u8().is_multiple_of(2) => Message::StateRequest {
                stage,
                first: [0, 1, u32::MAX][b.u8() as usize % 3],
                resume: [None, Some(b.u64())][b.u8() as usize % 2],
            },
            9 if b.u8().is_multiple_of(3) => Message::StateRelease {
                stage,
                hash: b.u64(),
            },
            9 => Message::ChunkRequest {
                stage,
                hash: b.u64(),
                index: [0, 1, u32::MAX][b.u8() as usize % 3],
            },
            10 => {
                let total = [0, 4, (PARAMS * 8) as u64, u64::MAX][b.u8() as usize % 4];
                Message::StateChunk(StateChunk {
                    stage,
                    step: small(b, round),
                    round: small(b, round),
                    offset: [0, 4, total, u64::MAX][b.u8() as usize % 4],
                    total,
                    hash: b.u64(),
                    data: vec![0; n * 8],
                })
            }
            _ => match b.u8() % 3 {
                0 => Message::Commit { id: b.u64() },
                1 => Message::Abort { id: b.u64() },
                _ => Message::Reject { id: b.u64() },
            },
        }
    }

    /// Where the peer stands: stage served, round, and its statistics.
    pub fn summary(&self) -> String {
        format!(
            "serving {:?} round {} {:?}",
            self.peer.stage().filter(|_| self.peer.is_serving()),
            self.peer.round(),
            self.peer.stats()
        )
    }

    /// Runs the ops the bytes describe.
    pub fn run(&mut self, data: &[u8]) {
        let mut b = Bytes(data);
        while !b.is_empty() {
            // Mostly a handful of keys, so that state builds up; sometimes a fresh one.
            let k = b.u8();
            let from = if k < 240 {
                PeerKey(2 + (k % 6) as u64)
            } else {
                PeerKey(b.u64())
            };
            match b.u8() % 8 {
                0 => {
                    let len = b.u8() as usize;
                    let raw = b.take(len).to_vec();
                    if let Ok(msg) = postcard::from_bytes::<Message>(&raw) {
                        self.deliver(from, msg);
                    }
                }
                1 | 2 => {
                    let msg = self.template(&mut b, from);
                    self.deliver(from, msg);
                }
                3 => {
                    // One of its own messages back, from another key.
                    if !self.kept.is_empty() {
                        let i = b.u8() as usize % self.kept.len();
                        let msg = self.kept[i].clone();
                        self.deliver(from, msg);
                    }
                }
                4 => {
                    let a = announcement(
                        Some((b.u8() % 2) as u32),
                        MemberState::Serving,
                        self.peer.round() + (b.u8() % 2) as u64,
                        b.u64(),
                    );
                    self.deliver(from, Message::Announce(a));
                }
                5 => self.advance(Duration::from_millis(b.u8() as u64 * 4)),
                6 => self.complete(),
                _ => {
                    if b.u8().is_multiple_of(2) {
                        self.peer.handle_peer_lost(from, self.now);
                    } else {
                        self.peer.handle_send_failed(from, self.now);
                    }
                    self.drain();
                }
            }
        }
    }
}
