//! What peers of a run say to each other. Announcements travel by gossip; everything else on
//! the tensor streams, one [`Envelope`] per frame. Tensor payloads inside are encoded with the
//! run's codecs and decoded against bounds the receiver derives from the run's configuration.

use super::{PeerKey, RunConfig, RunId};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// A message with the run it belongs to; the receiver drops envelopes of other runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// The run.
    pub run: RunId,
    /// The message.
    pub msg: Message,
}

impl Envelope {
    /// The wire encoding (postcard).
    pub fn to_bytes(&self) -> Vec<u8> {
        postcard::to_allocvec(self).unwrap_or_default()
    }

    /// Decodes an envelope; every length inside is bounded by `bytes.len()`.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, postcard::Error> {
        postcard::from_bytes(bytes)
    }
}

/// What a peer is doing, as announced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemberState {
    /// Listening to gossip before choosing a stage.
    Choosing,
    /// Downloading its stage's state.
    Syncing,
    /// Serving its stage.
    Serving,
    /// Leaving the run.
    Leaving,
}

/// A peer's periodic announcement (gossip).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Announcement {
    /// The stage it serves or is syncing; while choosing, the stage its operator told it to
    /// take first, if any (so that peers choosing together count it there).
    pub stage: Option<u32>,
    /// What it is doing.
    pub state: MemberState,
    /// Measured samples per second on its stage (0 until measured).
    pub throughput: f32,
    /// Compute jobs waiting.
    pub queue: u32,
    /// Optimizer steps its stage replica has taken.
    pub step: u64,
    /// Averaging rounds completed (= steps in allreduce mode, outer rounds in DiLoCo).
    pub round: u64,
    /// Hash of its parameters right after round `round` completed.
    pub params_hash: Option<u64>,
    /// Whether it has taken the run's last step.
    pub finished: bool,
    /// Whether it is new to its stage: it took its state from another replica and has not
    /// finished a round with others since. A newcomer never leads a round, so a replica
    /// that has worked with nobody yet does not wait for one to (see
    /// `Membership::settled`).
    pub newcomer: bool,
    /// Mean loss of its last step (last stage only).
    pub loss: Option<f32>,
    /// Bytes of device memory it can give a stage (0: not limited), so that no peer is asked
    /// to move to a stage it cannot hold.
    pub memory: u64,
    /// Whether it serves stages its device memory does not hold by keeping their blocks in
    /// host memory (see [`super::placement::Need`]).
    pub offloads: bool,
    /// Random per start of the peer, so that announcements of a restarted peer are told from
    /// its earlier life's.
    pub incarnation: u64,
    /// Counts this incarnation's announcements: each message travels on its own stream, so an
    /// older one can arrive after a newer one and must not undo it.
    pub seq: u64,
    /// Replicas of its stage it accuses, on its own evidence (see [`super::bans`]); at most
    /// [`super::bans::MAX_ACCUSATIONS`].
    pub accuses: Vec<Accusation>,
    /// The latest held-out evaluation of the run's model it knows of (see
    /// [`super::evaluation`]).
    pub held_out: Option<HeldOut>,
    /// A witness's samples committed with each replica it witnesses for, in the rounds it
    /// completed since it last told the peers this announcement goes to (see
    /// [`super::claims`]); empty for other peers.
    pub routed: Routed,
}

/// What a witness committed with the replicas it witnesses for, by round (see
/// [`super::claims`]): rounds `first .. round` of its announcement (at most
/// [`super::claims::ROUTED_ROUNDS`]), a round without an entry having none.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Routed {
    /// The first round covered.
    pub first: u64,
    /// The tallies.
    pub rows: Vec<RoutedRows>,
}

/// Samples committed through one hop toward one round.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutedRows {
    /// The round.
    pub round: u64,
    /// The hop.
    pub hop: PeerKey,
    /// Samples.
    pub rows: u32,
}

/// One held-out evaluation of the swarm's model.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct HeldOut {
    /// The step whose parameters were evaluated.
    pub step: u64,
    /// The mean loss per held-out sample.
    pub loss: f32,
    /// The first-stage replica that ran it.
    pub by: PeerKey,
}

/// "This replica of my stage misbehaved in our averaging rounds."
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accusation {
    /// The accused.
    pub peer: PeerKey,
    /// What it did.
    pub why: Misconduct,
}

/// What a replica can be accused of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Misconduct {
    /// Its averaging shares opposed its stage's robust mean, round after round (flipped,
    /// zeroed or unrelated gradients).
    OpposedTheStage,
    /// Its averaging shares were several times as long as its stage-mates', round after round
    /// (scaled, or mostly noise).
    DwarfedTheStage,
    /// The averaged parts it sent disagreed with the members' own shares, round after round
    /// (negated, scaled, zeroed or replaced).
    CorruptedParts,
    /// It kept its shares or parts from the stage, or led rounds that never started or left
    /// the others out, round after round, while announcing itself as a replica.
    WithheldWork,
    /// It led a round and sent the replicas that joined it a group without them.
    LeftReplicasOut,
}

impl std::fmt::Display for Misconduct {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Misconduct::OpposedTheStage => {
                "its averaging shares opposed the stage's robust mean, round after round"
            }
            Misconduct::DwarfedTheStage => {
                "its averaging shares were several times as long as its stage-mates', round after round"
            }
            Misconduct::CorruptedParts => {
                "the averaged parts it sent disagreed with the members' own shares, round after round"
            }
            Misconduct::WithheldWork => {
                "it withheld its shares or parts, or led rounds without the others, round after round"
            }
            Misconduct::LeftReplicasOut => {
                "it led a round and told the replicas that joined it they were left out"
            }
        })
    }
}

/// One microbatch's activations going forward.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Forward {
    /// Unique id of this attempt of the microbatch.
    pub id: u64,
    /// The microbatch's first sample (the same for every attempt): what at-most-once
    /// application is about, and what reports list.
    pub sample: u64,
    /// The round (optimizer step) the driver started it for: a stage adds it to that round
    /// or, if it is still collecting an earlier one, holds it until then, so that every
    /// stage averages the same microbatches in the same step.
    pub round: u64,
    /// Samples in it.
    pub rows: u32,
    /// The peers it passed, from the data driver on.
    pub route: Vec<PeerKey>,
    /// Encoded activations.
    #[serde(with = "serde_bytes")]
    pub activations: Vec<u8>,
}

/// The gradient of a stage's input going back along the recorded route.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Backward {
    /// The attempt.
    pub id: u64,
    /// The whole route, driver first (the driver commits along it).
    pub route: Vec<PeerKey>,
    /// Encoded gradient.
    #[serde(with = "serde_bytes")]
    pub grad: Vec<u8>,
}

/// Identifies one averaging round of one stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RoundKey {
    /// The stage.
    pub stage: u32,
    /// The round (the step in allreduce mode, the outer round in DiLoCo).
    pub index: u64,
}

impl RoundKey {
    /// Where `peer` ranks in this round: the leader ranks first and member `i` of the group
    /// (in rank order) owns part `i`. A hash of the round and the peer's key, so that no peer
    /// chooses its place: a key ground to lead one chosen round ranks at random in every
    /// other, and a member owns a different part each round. Ties (never seen in practice)
    /// are broken by the key.
    pub fn rank(&self, peer: PeerKey) -> (u64, PeerKey) {
        let mut bytes = [0u8; 20];
        bytes[..4].copy_from_slice(&self.stage.to_le_bytes());
        bytes[4..12].copy_from_slice(&self.index.to_le_bytes());
        bytes[12..].copy_from_slice(&peer.0.to_le_bytes());
        (xxhash_rust::xxh3::xxh3_64(&bytes), peer)
    }

    /// The first of `peers` in rank order: the leader among them.
    pub fn leader(&self, peers: impl IntoIterator<Item = PeerKey>) -> Option<PeerKey> {
        peers.into_iter().min_by_key(|p| self.rank(*p))
    }

    /// Names one attempt at this round: the leader that started it and the group it
    /// started. A round tried again (its leader withheld the start, or a member failed and
    /// re-led) may have another group, so other part ranges and owners; the exchange messages
    /// carry this, so that a late message of an earlier attempt is told apart from a lie.
    pub fn attempt(&self, leader: PeerKey, group: &[PeerKey]) -> u64 {
        let mut bytes = Vec::with_capacity(20 + 8 * group.len());
        bytes.extend_from_slice(&self.stage.to_le_bytes());
        bytes.extend_from_slice(&self.index.to_le_bytes());
        bytes.extend_from_slice(&leader.0.to_le_bytes());
        for k in group {
            bytes.extend_from_slice(&k.0.to_le_bytes());
        }
        xxhash_rust::xxh3::xxh3_64(&bytes)
    }
}

/// Messages of an averaging round.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum RoundMsg {
    /// "I am ready for this round" to the leader.
    Join,
    /// From the leader: the group, in part order.
    Start {
        /// Members in rank order ([`RoundKey::rank`]); member i owns part i.
        group: Vec<PeerKey>,
    },
    /// A member's share of one part, to that part's owner.
    Part {
        /// The attempt ([`RoundKey::attempt`]).
        attempt: u64,
        /// Which part.
        part: u32,
        /// Samples behind the member's contribution.
        samples: f64,
        /// Sum of those samples' losses (last stage only).
        loss: Option<f64>,
        /// Encoded values (sum over the member's samples).
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// From a part's owner: the averaged part.
    Averaged {
        /// The attempt ([`RoundKey::attempt`]).
        attempt: u64,
        /// Which part.
        part: u32,
        /// Samples averaged over.
        samples: f64,
        /// Mean loss per sample over them (last stage only).
        loss: Option<f64>,
        /// Encoded averaged values (one buffer however many members it goes to).
        #[serde(with = "shared_bytes")]
        data: Arc<Vec<u8>>,
    },
    /// "Send me averaged part `part` if you have it" (its owner vanished mid-send).
    Request {
        /// The attempt ([`RoundKey::attempt`]).
        attempt: u64,
        /// Which part.
        part: u32,
    },
    /// Reply to a request: I do not have it.
    Missing {
        /// The attempt ([`RoundKey::attempt`]).
        attempt: u64,
        /// Which part.
        part: u32,
    },
    /// A member's check of every averaged part against its own share, to every member: a
    /// part most members that could tell found pointing against their shares is applied by
    /// nobody.
    Verdict {
        /// The attempt ([`RoundKey::attempt`]).
        attempt: u64,
        /// One vote per part, in part order.
        votes: Vec<Vote>,
    },
}

/// One member's check of one averaged part ([`RoundMsg::Verdict`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Vote {
    /// The part points along this member's own share.
    Accept,
    /// This member cannot tell (no samples this round, its share is mostly noise, or it owns
    /// the part).
    Abstain,
    /// The part points against this member's own share, or never reached this member.
    Refuse,
}

impl RoundMsg {
    /// The attempt an exchange message belongs to (joins and starts come before there is one).
    pub fn attempt(&self) -> Option<u64> {
        match self {
            RoundMsg::Join | RoundMsg::Start { .. } => None,
            RoundMsg::Part { attempt, .. }
            | RoundMsg::Averaged { attempt, .. }
            | RoundMsg::Request { attempt, .. }
            | RoundMsg::Missing { attempt, .. }
            | RoundMsg::Verdict { attempt, .. } => Some(*attempt),
        }
    }
}

/// Everything except announcements.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Message {
    /// A joiner asks for the run's configuration.
    Hello,
    /// The run's configuration.
    Config(RunConfig),
    /// Gossip: what a peer is doing.
    Announce(Announcement),
    /// Activations forward.
    Forward(Forward),
    /// Gradients backward.
    Backward(Backward),
    /// In place of a [`Backward`]: the hop that sends it did not use the gradient it got for
    /// the attempt (the replica after it sends gradients out of line), so the hops before it
    /// skip theirs too; the driver still commits the attempt, for the hops after.
    Discarded {
        /// The attempt.
        id: u64,
        /// The whole route, driver first, as in [`Backward`].
        route: Vec<PeerKey>,
    },
    /// Activations of a held-out microbatch forward (an evaluation: no backward pass follows,
    /// `sample` indexes the held-out data and `round` is the step evaluated).
    Evaluate(Forward),
    /// The last stage's loss on a held-out microbatch, to its evaluator.
    Evaluated {
        /// The attempt.
        id: u64,
        /// Its mean loss per sample.
        loss: f32,
    },
    /// The driver saw the whole backward pass: add this attempt's gradient to the step.
    Commit {
        /// The attempt.
        id: u64,
    },
    /// The attempt will not be committed: forget it.
    Abort {
        /// The attempt.
        id: u64,
    },
    /// A stage could not pass the attempt on (no replica of the next stage).
    Reject {
        /// The attempt.
        id: u64,
    },
    /// Samples a replica has committed toward round `round`, to its stage's other replicas.
    Progress {
        /// The stage.
        stage: u32,
        /// The round the samples count toward.
        round: u64,
        /// Samples committed.
        samples: f64,
        /// Samples in flight from this replica (data drivers), counted toward the same round.
        in_flight: f64,
    },
    /// Averaging.
    Round {
        /// Which round.
        key: RoundKey,
        /// What.
        msg: RoundMsg,
    },
    /// A replica one or a few rounds behind asks for the result of round `round`.
    CatchUpRequest {
        /// The stage.
        stage: u32,
        /// The round it missed.
        round: u64,
    },
    /// The averaged vector a stage applied in round `round` (fp32, so the replica that
    /// applies it lands on bit-identical parameters), or nothing if it is no longer kept.
    CatchUp {
        /// The stage.
        stage: u32,
        /// The round.
        round: u64,
        /// Samples behind it.
        samples: f64,
        /// The encoded vector; empty when not available.
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// A joiner asks for a stage's state: an export to pull chunks of.
    StateRequest {
        /// The stage.
        stage: u32,
        /// The chunk to send first (a joiner asking several replicas at once asks each
        /// for a different one).
        first: u32,
        /// The hash of the state version the joiner holds chunks of, if any: a replica
        /// that still has it goes on with it rather than export another.
        resume: Option<u64>,
    },
    /// A joiner asks for one chunk of a state it was sent a chunk of.
    ChunkRequest {
        /// The stage.
        stage: u32,
        /// The state's hash, as its chunks gave it.
        hash: u64,
        /// Which chunk.
        index: u32,
    },
    /// One chunk of a stage's state.
    StateChunk(StateChunk),
    /// A joiner is done with a replica's snapshot of its stage's state (its download
    /// completed, or another replica's version served it): the replica may drop it.
    StateRelease {
        /// The stage.
        stage: u32,
        /// The snapshot's hash.
        hash: u64,
    },
}

/// One piece of a stage's state in transfer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StateChunk {
    /// The stage.
    pub stage: u32,
    /// Steps the state has taken.
    pub step: u64,
    /// Rounds it has completed.
    pub round: u64,
    /// Byte offset of this chunk.
    pub offset: u64,
    /// Total bytes of the state.
    pub total: u64,
    /// xxh3-64 of the whole state.
    pub hash: u64,
    /// The bytes.
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
}

impl Message {
    /// The codec of a stage-boundary tensor (activations or their gradients), by name
    /// (`int8`, `int4`, ...; see [`crate::codec::Encoding`]): what its sender chose for the
    /// hop. None for other messages and for tensors whose header does not parse.
    pub fn boundary_codec(&self) -> Option<String> {
        let tensor = match self {
            Message::Forward(f) | Message::Evaluate(f) => &f.activations,
            Message::Backward(b) => &b.grad,
            _ => return None,
        };
        let header = crate::TensorHeader::parse(tensor, usize::MAX).ok()?;
        Some(header.encoding.to_string())
    }

    /// Bytes of parameter-sized tensors in the message (averaging parts, averaged parts,
    /// catch-ups, state chunks): what netsim's modelled compute scales (see
    /// [`super::StageCosts::param_scale`]).
    pub fn parameter_bytes(&self) -> usize {
        match self {
            Message::Round {
                msg: RoundMsg::Part { data, .. },
                ..
            }
            | Message::CatchUp { data, .. } => data.len(),
            Message::Round {
                msg: RoundMsg::Averaged { data, .. },
                ..
            } => data.len(),
            Message::StateChunk(c) => c.data.len(),
            _ => 0,
        }
    }

    /// Which kind of traffic a message is, for byte accounting.
    pub fn traffic(&self) -> Traffic {
        match self {
            Message::Forward(_) | Message::Evaluate(_) => Traffic::Activations,
            Message::Backward(_) | Message::Discarded { .. } => Traffic::ActivationGrads,
            Message::Round { .. } | Message::CatchUp { .. } => Traffic::Averaging,
            Message::StateChunk(_)
            | Message::StateRequest { .. }
            | Message::ChunkRequest { .. }
            | Message::StateRelease { .. } => Traffic::State,
            _ => Traffic::Control,
        }
    }
}

/// Kinds of traffic counted separately in reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Traffic {
    /// Activations forward.
    Activations,
    /// Activation gradients backward.
    ActivationGrads,
    /// Gradient / pseudo-gradient averaging.
    Averaging,
    /// State transfers to joiners.
    State,
    /// Everything else (commits, progress, configuration).
    Control,
}

impl Traffic {
    /// All kinds, in report order.
    pub const ALL: [Traffic; 5] = [
        Traffic::Activations,
        Traffic::ActivationGrads,
        Traffic::Averaging,
        Traffic::State,
        Traffic::Control,
    ];

    /// The name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            Traffic::Activations => "activations",
            Traffic::ActivationGrads => "activation_grads",
            Traffic::Averaging => "averaging",
            Traffic::State => "state",
            Traffic::Control => "control",
        }
    }
}

/// Serde for a byte string that several messages share (an owner sends its averaged part to
/// every member): written as bytes, read into a buffer of its own.
mod shared_bytes {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::sync::Arc;

    pub fn serialize<S: Serializer>(data: &Arc<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(data)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Arc<Vec<u8>>, D::Error> {
        serde_bytes::ByteBuf::deserialize(d).map(|b| Arc::new(b.into_vec()))
    }
}
