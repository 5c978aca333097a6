//! Which slice of the model a stage is, and what training it costs: FLOPs, and the memory
//! a [`super::Stage`] of it holds (the planning figure its accounting matches exactly).

use super::{StageError, layout};
use crate::config::ModelConfig;
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// Where a stage keeps what training needs, for [`StageSpec::device_memory_bytes`]; the
/// default is what [`Stage::new`](super::Stage::new) builds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Residency {
    /// Activations recomputed in the backward pass
    /// ([`Stage::set_recompute`](super::Stage::set_recompute)).
    pub recompute: bool,
    /// AdamW's moments on the host
    /// ([`Stage::new_stepped_on_host`](super::Stage::new_stepped_on_host)).
    pub moments_on_host: bool,
    /// The blocks' parameters and gradients on the host, two blocks on the device at a time
    /// (the one computing and the next, fetched ahead), the moments on the host: the least a
    /// stage under a memory limit ([`Stage::with_memory_limit`](super::Stage::with_memory_limit))
    /// needs to run at full speed.
    pub offload: bool,
}

/// Which slice of the model a stage is: stage `index` of `count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StageSpec {
    /// 0-based position in the pipeline.
    pub index: usize,
    /// Number of stages the model is cut into.
    pub count: usize,
}

impl StageSpec {
    /// The only stage of an uncut model.
    pub const WHOLE: StageSpec = StageSpec { index: 0, count: 1 };

    /// Stage 0 owns the embeddings.
    pub fn is_first(&self) -> bool {
        self.index == 0
    }

    /// The last stage owns the final norm, the head and the loss.
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.count
    }

    /// The transformer blocks of this stage: blocks are spread as evenly as possible.
    pub fn blocks(&self, config: &ModelConfig) -> Range<usize> {
        let l = config.layers;
        (self.index * l / self.count)..((self.index + 1) * l / self.count)
    }

    /// Parameters this stage holds (a tied embedding copy counted), without building it.
    pub fn param_count(&self, config: &ModelConfig) -> usize {
        layout(config, *self).iter().map(|i| i.len).sum()
    }

    /// Training FLOPs (forward + backward) per sample of `seq` tokens on this stage: 6 per
    /// matrix weight it holds (the head included on the last stage) plus its blocks'
    /// attention products, as in [`ModelConfig::train_flops_per_token`].
    pub fn train_flops_per_sample(&self, config: &ModelConfig, seq: usize) -> f64 {
        let c = config.width;
        let blocks = self.blocks(config).len();
        let mut weights = blocks * 12 * c * c;
        if self.is_last() {
            weights += config.vocab * c;
        }
        let attention = blocks * 4 * seq * c;
        3.0 * (2.0 * weights as f64 + attention as f64) * seq as f64
    }

    /// Memory (bytes) to train this stage as a swarm replica, wherever it is held:
    /// parameters, gradients and activations on the device ([`Self::device_memory_bytes`]),
    /// AdamW's moments and a DiLoCo anchor and outer momentum, four fp32 copies of the
    /// parameters, on the host. Stage choice counts them all, so that a stage it gives a
    /// device fits also where device and host share memory (integrated GPUs, the CPU).
    pub fn train_memory_bytes(
        &self,
        config: &ModelConfig,
        rows: usize,
        seq: usize,
        in_flight: usize,
    ) -> u64 {
        let held = Residency {
            recompute: false,
            moments_on_host: true,
            offload: false,
        };
        self.device_memory_bytes(config, rows, seq, in_flight, held)
            + 16 * self.param_count(config) as u64
    }

    /// Device memory (bytes) a [`Stage`](super::Stage) of this spec holds at most with
    /// `in_flight` microbatches of `rows` x `seq` tokens awaiting their backward pass:
    /// parameters and gradients (and AdamW's two moments unless `held.moments_on_host` or
    /// `held.offload`; with `held.offload`, of the embeddings and two blocks only), the
    /// activations each microbatch keeps and the backward pass's workspace. A block's
    /// activations are 15 width-sized values, 4 per-token statistics and the attention matrix
    /// per token, and its output; with `held.recompute` a microbatch keeps only the outputs,
    /// and one block's activations are workspace. The last stage adds the logits. What
    /// [`crate::memory::StageMemory::peak`] measures, exactly.
    pub fn device_memory_bytes(
        &self,
        config: &ModelConfig,
        rows: usize,
        seq: usize,
        in_flight: usize,
        held: Residency,
    ) -> u64 {
        let (c, heads, vocab) = (config.width, config.heads, config.vocab);
        let blocks = self.blocks(config).len();
        let state = if held.offload {
            let on_device = blocks.min(2) * config.block_params();
            2 * (self.param_count(config) - blocks * config.block_params() + on_device)
        } else if held.moments_on_host {
            2 * self.param_count(config)
        } else {
            4 * self.param_count(config)
        };
        let tokens = rows * seq;
        let block_acts = tokens * (15 * c + 4 + heads * seq);
        let mut per_microbatch = tokens * c + blocks * tokens * c;
        let mut workspace = tokens * (14 * c + heads * seq);
        if held.recompute {
            workspace += if blocks > 0 { block_acts } else { 0 };
        } else {
            per_microbatch += blocks * block_acts;
        }
        if self.is_first() {
            per_microbatch += tokens;
        }
        if self.is_last() {
            per_microbatch += tokens * (c + vocab + 4);
        }
        let microbatches = in_flight * per_microbatch + if in_flight > 0 { workspace } else { 0 };
        4 * (state + microbatches) as u64
    }

    /// Checks that `config` can be trained as `stages` pipeline stages on samples of `seq`
    /// tokens.
    pub fn check_pipeline(
        config: &ModelConfig,
        stages: usize,
        seq: usize,
    ) -> Result<(), StageError> {
        if seq > config.context {
            return Err(StageError::SeqTooLong {
                seq,
                context: config.context,
            });
        }
        StageSpec {
            index: 0,
            count: stages,
        }
        .validate(config)
    }

    /// Checks that the cut is possible: every stage between the first and the last must own
    /// at least one block (the first and last always own the embeddings or the head).
    pub fn validate(&self, config: &ModelConfig) -> Result<(), StageError> {
        let bad = self.count == 0
            || self.index >= self.count
            || (1..self.count.saturating_sub(1)).any(|i| {
                StageSpec {
                    index: i,
                    count: self.count,
                }
                .blocks(config)
                .is_empty()
            });
        if bad {
            return Err(StageError::BadCut {
                stages: self.count,
                layers: config.layers,
            });
        }
        Ok(())
    }
}
