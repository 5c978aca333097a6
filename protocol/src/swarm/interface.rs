//! What a [`Peer`](super::Peer) and its owner exchange: the actions the peer asks for
//! (messages, gossip, compute jobs, events), the results of compute jobs, and what the owner
//! tells the peer at its start. The owner runs one compute job at a time, in the order handed
//! out.

use super::PeerKey;
use super::message::{Announcement, Message};
use std::time::Duration;

/// The input of a forward job.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// First stage: the tokens of the job's samples, read from the run's data.
    Tokens,
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
/// [`super::Peer::handle_compute_done`].
#[derive(Clone, Debug, PartialEq)]
pub enum Job {
    /// Build the stage fresh from the run's seed.
    Init {
        /// The stage.
        stage: u32,
    },
    /// Build the stage again from the state it holds, as a download of that state would
    /// (work in progress and accumulated gradients dropped): a replica that must re-sync and
    /// finds no other replica to sync from keeps what it trained. Fresh from the seed if it
    /// holds no state of this stage.
    Restart {
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
        /// The first of its `rows` consecutive samples of the run's data. The first stage
        /// reads its tokens from them and the last stage its next-token targets: targets do
        /// not travel, so no peer on the route can hand the last stage wrong ones.
        sample: u64,
        /// Input.
        input: Input,
        /// A held-out microbatch of an evaluation: `sample` indexes the held-out data, and
        /// nothing is kept for a backward pass.
        held_out: bool,
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
        /// For a Step, where the device can tell: how well each microbatch committed into the
        /// gradient it contributed pointed along the step (a cosine; see the compute crate's
        /// `StageReplica::take_alignments`). How the peer judges the activation gradients the
        /// next stage sent for them.
        alignments: Vec<(u64, f64)>,
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
        /// Parts the members' vote refused: most members that could tell found them pointing
        /// against their own shares.
        refused: usize,
    },
    /// A round this replica could not take part in.
    RoundFailed {
        /// The round.
        round: u64,
        /// Why.
        reason: &'static str,
    },
    /// A stage's state arrived whole and verified against its hash (it is built next).
    StateReceived {
        /// The stage.
        stage: u32,
        /// Its size.
        bytes: u64,
        /// From the first replica asked to the last chunk.
        took: Duration,
        /// Replicas that sent chunks of it.
        senders: usize,
    },
    /// A state downloaded from `from` was refused: its parameters differ from those more than
    /// half of the stage announce. Another replica is asked.
    StateRefused {
        /// The sender.
        from: PeerKey,
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
    /// A held-out evaluation of the run's model, this peer's or announced by the first-stage
    /// replica that ran it; each step once.
    HeldOut(super::message::HeldOut),
    /// Something went wrong that the protocol handled.
    Warning(String),
    /// A peer broke the protocol (a message out of its role, out of range, or not finite):
    /// the message was dropped and nothing changed. Attributed to the sender's key, so that
    /// the owner can log it and count it toward a ban.
    Violation {
        /// Who sent it.
        peer: PeerKey,
        /// What was wrong.
        what: &'static str,
    },
    /// A majority of `peer`'s stage accused it (see [`super::bans`]): it is dropped for the
    /// rest of the run.
    Banned {
        /// Who.
        peer: PeerKey,
        /// What most of its accusers said it did.
        why: super::message::Misconduct,
        /// Replicas of its stage that accused it.
        accusers: usize,
        /// Replicas of its stage counted, it included.
        replicas: usize,
    },
    /// A replica of this peer's stage claimed more samples in its averaging shares than its
    /// witnesses saw it commit: its weight in this peer's parts is `credit` times its claim's
    /// (see [`super::claims`]). Told when the credit falls below
    /// [`super::claims::DISCOUNTED`], and at every halving after.
    Discounted {
        /// Who.
        peer: PeerKey,
        /// What its witnesses saw over what it claimed, lately.
        credit: f64,
    },
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
    /// Microbatch gradients this peer threw away because the replica of the next stage whose
    /// activation gradients they came from was out of line (see [`super::service`]).
    pub gradients_discarded: u64,
    /// Averaging rounds completed.
    pub rounds: u64,
    /// Rounds that lost a member's share or a part.
    pub rounds_degraded: u64,
    /// State downloads completed (joins and re-syncs).
    pub state_transfers: u64,
    /// Bytes of state received (duplicates and abandoned versions included).
    pub state_bytes_received: u64,
    /// State downloads that started over because no source of their version was left.
    pub state_restarts: u64,
    /// Stage moves.
    pub moves: u64,
    /// Messages dropped as protocol violations (see [`Event::Violation`]).
    pub violations: u64,
}
