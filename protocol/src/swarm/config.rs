//! A run's configuration: chosen by the peer that creates the run, learned by every joiner.
//! Its hash is the run id, so peers of different runs (or of a run whose settings differ in
//! any way) never mix.

use crate::{HopCodec, TrafficCodecs};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// How the replicas of a stage keep their parameters together.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum SyncMode {
    /// Average gradients after every global batch, then all take the same optimizer step.
    AllReduce,
    /// Local AdamW steps; every `h` of them average pseudo-gradients and take an outer
    /// Nesterov step.
    DiLoCo {
        /// Inner steps per outer round.
        h: u32,
        /// Outer learning rate (0.7 in the DiLoCo paper).
        outer_lr: f32,
        /// Outer Nesterov momentum (0.9 in the DiLoCo paper).
        outer_momentum: f32,
        /// Decay per round of the averaging's error feedback (shares and parts), in (0, 1] (1:
        /// plain error feedback; see [`crate::ErrorFeedback::with_decay`]).
        feedback_decay: f32,
    },
}

/// The DiLoCo paper's outer learning rate.
pub const PAPER_OUTER_LR: f32 = 0.7;
/// The DiLoCo paper's outer Nesterov momentum.
pub const PAPER_OUTER_MOMENTUM: f32 = 0.9;

impl SyncMode {
    /// DiLoCo with the paper's outer optimizer and `h` inner steps.
    pub fn diloco(h: u32) -> Self {
        SyncMode::DiLoCo {
            h,
            outer_lr: PAPER_OUTER_LR,
            outer_momentum: PAPER_OUTER_MOMENTUM,
            feedback_decay: 1.0,
        }
    }

    /// Checks DiLoCo's parameters.
    pub fn validate(&self) -> Result<(), String> {
        if let SyncMode::DiLoCo {
            h,
            outer_lr,
            outer_momentum,
            feedback_decay,
        } = *self
        {
            if h == 0 {
                return Err("DiLoCo needs at least one inner step per round".into());
            }
            if !(outer_lr.is_finite() && outer_lr > 0.0 && (0.0..1.0).contains(&outer_momentum)) {
                return Err("DiLoCo outer lr must be positive, momentum in [0, 1)".into());
            }
            if !(feedback_decay > 0.0 && feedback_decay <= 1.0) {
                return Err("DiLoCo feedback decay must be in (0, 1]".into());
            }
        }
        Ok(())
    }

    /// The decay of the averaging's error feedback (1 unless DiLoCo says otherwise).
    pub fn feedback_decay(&self) -> f32 {
        match *self {
            SyncMode::AllReduce => 1.0,
            SyncMode::DiLoCo { feedback_decay, .. } => feedback_decay,
        }
    }
}

impl fmt::Display for SyncMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SyncMode::AllReduce => write!(f, "allreduce"),
            SyncMode::DiLoCo { h, .. } => write!(f, "diloco(h={h})"),
        }
    }
}

impl FromStr for SyncMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "allreduce" => Ok(SyncMode::AllReduce),
            "diloco" => Ok(SyncMode::diloco(8)),
            other => Err(format!("unknown sync mode {other:?} (allreduce or diloco)")),
        }
    }
}

/// Where the training data comes from. Every data driver draws samples from the same source;
/// sample indices are unique per driver, so no sample is drawn twice.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DataSource {
    /// The built-in synthetic corpus generated from the run seed.
    Synthetic,
    /// A text file every data driver holds locally, identified by name and content hash.
    TextFile {
        /// File name, for messages.
        name: String,
        /// xxh3-64 of the file's bytes.
        hash: u64,
    },
    /// A token shard (llm.c's format, `shoal data prepare`) every data driver holds locally:
    /// its tokens are ids of a vocabulary of `vocab`, which the model's follows.
    TokenShard {
        /// File name, for messages.
        name: String,
        /// xxh3-64 of the file's bytes.
        hash: u64,
        /// The size of its tokens' vocabulary.
        vocab: u32,
    },
}

impl DataSource {
    /// The vocabulary the run's model has, where the data sets it (else the preset's).
    pub fn vocab(&self) -> Option<usize> {
        match self {
            DataSource::TokenShard { vocab, .. } => Some(*vocab as usize),
            DataSource::Synthetic | DataSource::TextFile { .. } => None,
        }
    }
}

/// Everything peers of one run must agree on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    /// Model preset name (`nano`, `micro`, ...).
    pub preset: String,
    /// Pipeline stages.
    pub stages: u32,
    /// Samples per optimizer step, over all replicas of a stage.
    pub global_batch: u32,
    /// Samples per microbatch.
    pub microbatch: u32,
    /// Tokens per sample.
    pub seq: u32,
    /// How replicas of a stage stay together.
    pub sync: SyncMode,
    /// Peak learning rate.
    pub lr: f32,
    /// Optimizer steps of the run (the schedule's length); peers stop after it.
    pub max_steps: u64,
    /// Codec per kind of traffic.
    pub codecs: TrafficCodecs,
    /// Training data.
    pub data: DataSource,
    /// Seed of initialisation and data.
    pub seed: u64,
    /// A model file the stages start from instead of the seed's initialisation.
    pub init: Option<ModelRef>,
    /// Held-out evaluation during the run.
    pub evaluation: Evaluation,
}

/// A model file (safetensors) every peer that builds a stage fresh holds locally, identified
/// by name and content hash as the data is: a peer with another file cannot join.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelRef {
    /// File name, for messages.
    pub name: String,
    /// xxh3-64 of the file's bytes.
    pub hash: u64,
}

/// Held-out evaluation of the swarm's model while it trains: every `every` steps one replica
/// of the first stage sends `samples` held-out samples through the pipeline, forward only,
/// and announces their mean loss (see `super::evaluation`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Evaluation {
    /// Steps between evaluations (0: none).
    pub every: u64,
    /// Samples each evaluation.
    pub samples: u32,
    /// The held-out data, which the first and last stages read (None: samples of the
    /// training data drawn with another seed).
    pub data: Option<DataSource>,
}

/// Samples an evaluation may ask for at most.
pub const MAX_EVALUATION_SAMPLES: u32 = 4096;

impl Default for Evaluation {
    fn default() -> Self {
        Evaluation {
            every: 0,
            samples: 256,
            data: None,
        }
    }
}

/// A run's id: the hash of its configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RunId(pub u64);

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl FromStr for RunId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        u64::from_str_radix(s, 16)
            .map(RunId)
            .map_err(|_| format!("bad run id {s:?} (16 hex digits)"))
    }
}

impl RunConfig {
    /// The run id: xxh3 of the configuration's canonical (postcard) encoding.
    pub fn run_id(&self) -> RunId {
        let bytes = postcard::to_allocvec(self).unwrap_or_default();
        RunId(xxhash_rust::xxh3::xxh3_64(&bytes))
    }

    /// Microbatches per global batch.
    pub fn microbatches_per_step(&self) -> u32 {
        self.global_batch.div_ceil(self.microbatch.max(1))
    }

    /// Checks the numbers make sense together; says what is wrong otherwise.
    pub fn validate(&self) -> Result<(), String> {
        if self.stages == 0 || self.stages > 256 {
            return Err(format!("{} stages (1 to 256)", self.stages));
        }
        if self.microbatch == 0 || self.global_batch == 0 {
            return Err("global batch and microbatch must be at least 1".into());
        }
        if self.microbatch > self.global_batch {
            return Err(format!(
                "microbatch {} exceeds the global batch {}",
                self.microbatch, self.global_batch
            ));
        }
        if self.seq == 0 {
            return Err("sequence length must be at least 1".into());
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(format!("learning rate {} must be positive", self.lr));
        }
        if self.max_steps == 0 {
            return Err("max steps must be at least 1".into());
        }
        self.sync.validate()?;
        let e = &self.evaluation;
        if e.samples == 0 || e.samples > MAX_EVALUATION_SAMPLES {
            return Err(format!(
                "{} held-out samples (1 to {MAX_EVALUATION_SAMPLES})",
                e.samples
            ));
        }
        match &e.data {
            // Held-out samples of the synthetic corpus are drawn with another seed; named as
            // the held-out data, it would be the training samples themselves.
            Some(DataSource::Synthetic) => {
                return Err("the held-out data is a file (the synthetic corpus is not one)".into());
            }
            Some(data) if data.vocab() != self.data.vocab() => {
                return Err("the held-out data's vocabulary is not the training data's".into());
            }
            _ => {}
        }
        // A file's windows are the same whatever the seed: held-out text must be a file of
        // its own.
        if e.every > 0 && e.data.is_none() && self.data != DataSource::Synthetic {
            return Err(
                "held-out evaluation of a run on a data file needs held-out data of its own \
                 (e.g. the _val.bin shard of `shoal data prepare`)"
                    .into(),
            );
        }
        for c in [self.codecs.activations, self.codecs.activation_grads] {
            c.validate().map_err(|e| e.to_string())?;
        }
        HopCodec::check_projections(&self.codecs.activations, &self.codecs.activation_grads)?;
        self.codecs
            .averaging
            .validate_for_averaging()
            .map_err(|e| e.to_string())?;
        Ok(())
    }
}

/// What the protocol needs to know about the model's stages (supplied by the owner from the
/// compute crate, which the protocol does not depend on).
#[derive(Clone, Debug, PartialEq)]
pub struct StageCosts {
    /// Training FLOPs per sample of each stage (forward + backward).
    pub flops_per_sample: Vec<f64>,
    /// Parameters of each stage (bounds state transfers and averaging parts).
    pub params: Vec<usize>,
    /// Values in one microbatch's activations at a stage boundary (bounds tensor decoding).
    pub activation_values: usize,
    /// Device memory each stage needs to train (state, optimizer and the activations of the
    /// least window of microbatches in flight).
    pub memory: Vec<u64>,
    /// Device memory each stage needs on a peer that keeps its blocks in host memory and
    /// brings them to the device a block at a time (see `Stage::with_memory_limit`), with
    /// the same window of microbatches; 0 where a stage cannot be offloaded.
    pub offload_memory: Vec<u64>,
    /// Device memory one more microbatch in flight takes on each stage (its activations kept
    /// for the backward pass).
    pub microbatch_memory: Vec<u64>,
    /// Bytes on the wire per byte of a parameter-sized tensor as this peer holds it: 1,
    /// except in netsim's modelled compute, which carries gradients, averaged parts,
    /// catch-ups and states at 1/`param_scale` of their size (`params` counts the values
    /// carried) and charges its links for the full size, so that a simulated swarm's memory
    /// does not grow with the model.
    pub param_scale: usize,
}

impl StageCosts {
    /// What each stage needs of a peer's device memory, resident or offloaded.
    pub fn needs(&self) -> Vec<super::placement::Need> {
        let offloaded = self.offload_memory.iter().chain(std::iter::repeat(&0));
        self.memory
            .iter()
            .zip(offloaded)
            .map(|(&resident, &offloaded)| super::placement::Need {
                resident,
                offloaded: if offloaded == 0 { resident } else { offloaded },
            })
            .collect()
    }

    /// Bytes per state chunk: [`super::transfer::CHUNK_BYTES`] of the real state, so a
    /// scaled-down state (see `param_scale`) is cut into as many chunks as the real one.
    pub fn state_chunk_bytes(&self) -> usize {
        (super::transfer::CHUNK_BYTES / self.param_scale.max(1)).max(1)
    }

    /// Upper bound of a stage's exported state in bytes (params, two AdamW moments, DiLoCo
    /// anchor and momentum, plus framing).
    pub fn max_state_bytes(&self, stage: usize) -> usize {
        self.params.get(stage).copied().unwrap_or(0) * 4 * 5 + 4096
    }
}

/// The protocol's clocks. The node uses the defaults; the simulator may scale them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    /// How often a peer gossips its announcement.
    pub announce_every: Duration,
    /// A peer not heard from for this long is considered gone.
    pub member_timeout: Duration,
    /// Least time a microbatch may take before the driver retries it.
    pub microbatch_deadline: Duration,
    /// Attempts per microbatch before it is dropped.
    pub max_attempts: u32,
    /// Microbatches a data driver keeps in flight per stage of the pipeline, at least (the
    /// driver widens its window up to `max_in_flight_per_stage` when the round trip of a
    /// microbatch needs more to keep the stages busy).
    pub in_flight_per_stage: u32,
    /// The most microbatches a driver keeps in flight per stage, if the replicas' memory
    /// holds them.
    pub max_in_flight_per_stage: u32,
    /// How long a round's leader waits for the stage's replicas to join.
    pub join_window: Duration,
    /// How long any later phase of a round may take before missing peers are left out.
    pub round_timeout: Duration,
    /// How long a joiner listens to gossip before choosing a stage.
    pub choose_after: Duration,
    /// How often rebalancing is considered.
    pub rebalance_every: Duration,
    /// A move must raise the slowest stage's throughput by this fraction.
    pub rebalance_gain: f64,
    /// How long to wait for a state transfer before trying another source.
    pub transfer_timeout: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            announce_every: Duration::from_millis(500),
            member_timeout: Duration::from_secs(4),
            microbatch_deadline: Duration::from_secs(4),
            max_attempts: 3,
            in_flight_per_stage: 2,
            max_in_flight_per_stage: 16,
            join_window: Duration::from_secs(2),
            round_timeout: Duration::from_secs(8),
            choose_after: Duration::from_millis(1500),
            rebalance_every: Duration::from_secs(15),
            rebalance_gain: 0.25,
            transfer_timeout: Duration::from_secs(30),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> RunConfig {
        RunConfig {
            preset: "nano".into(),
            stages: 3,
            global_batch: 16,
            microbatch: 4,
            seq: 64,
            sync: SyncMode::AllReduce,
            lr: 3e-3,
            max_steps: 100,
            codecs: TrafficCodecs::default(),
            data: DataSource::Synthetic,
            seed: 1,
            init: None,
            evaluation: Default::default(),
        }
    }

    #[test]
    fn run_id_changes_with_any_setting() {
        let a = config();
        let mut b = config();
        assert_eq!(a.run_id(), b.run_id());
        b.lr = 1e-3;
        assert_ne!(a.run_id(), b.run_id());
        let id = a.run_id();
        assert_eq!(id.to_string().parse::<RunId>(), Ok(id));
    }

    #[test]
    fn validation_names_the_problem() {
        let mut c = config();
        c.microbatch = 32;
        assert!(c.validate().unwrap_err().contains("microbatch"));
        let mut c = config();
        c.sync = SyncMode::DiLoCo {
            h: 0,
            outer_lr: 0.7,
            outer_momentum: 0.9,
            feedback_decay: 1.0,
        };
        assert!(c.validate().is_err());
        assert!(config().validate().is_ok());
    }
}
