//! A pipeline stage of the GPT model: a contiguous range of transformer blocks, plus the
//! embeddings on the first stage and the final norm, tied head and loss on the last.
//!
//! A stage keeps, per in-flight microbatch, exactly the activations its backward pass needs,
//! keyed by a [`MicrobatchId`]; backward consumes them and accumulates parameter gradients, so
//! any number of microbatches can be accumulated before an optimizer step.
//!
//! The LM head is tied to the token embedding. When the model is cut into several stages the
//! first and the last stage each hold a copy of that matrix (as Megatron-LM does); their
//! gradients must be summed before each optimizer step ([`Stage::tied_embedding_grad`]) so that
//! both copies take the same update and stay identical.
//!
//! Under a device memory limit ([`Stage::with_memory_limit`]) the blocks' parameters and
//! gradients live on the host and visit the device a block at a time (`stage/chunks.rs`);
//! AdamW then steps on the host.
//!
//! The file is over 900 lines on purpose: its concerns already live in `stage/` (activations,
//! chunks, spec, state, tensors), and what stays is the forward and the backward pass over the
//! blocks (some 460 lines together), which mirror each other step by step and are read side by
//! side.
//!
//! What a stage is and costs ([`StageSpec`], `stage/spec.rs`), its tensors' layout and
//! initialisation (`stage/tensors.rs`), one block's activations and forward pass
//! (`stage/activations.rs`), where the blocks' tensors live (`stage/chunks.rs`) and the
//! tensors seen whole, as flat vectors and in AdamW's step (`stage/state.rs`) are apart.
//! What stays here, just over 1,000 lines, is one concern: the buffers a pass needs (saved
//! activations, workspace, their accounting against the limit) and the forward and backward
//! passes that fill and consume them, which share those buffers' layout.

use crate::backend::{AttentionShape, Backend, BackendError, MatmulShape, RowShape};
use crate::config::ModelConfig;
use crate::memory::{MemoryUse, StageMemory};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::Arc;
use thiserror::Error;

mod activations;
mod chunks;
mod spec;
mod state;
mod tensors;

use activations::BlockActs;
pub use chunks::OffloadTraffic;
use chunks::{Chunks, FetchError};
pub use spec::{Residency, StageSpec};
pub use tensors::TensorInfo;
use tensors::{Block, StageTensors, initial_values, layout};

/// Identifies one microbatch while it is in flight through the pipeline.
pub type MicrobatchId = u64;

/// What went wrong in a stage.
#[derive(Debug, Error)]
pub enum StageError {
    /// The device failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The model cannot be cut this way.
    #[error("cannot cut a {layers}-layer model into {stages} stages")]
    BadCut {
        /// Requested stages.
        stages: usize,
        /// Layers of the model.
        layers: usize,
    },
    /// Samples longer than the model's context.
    #[error("sequence length {seq} exceeds the model's context of {context}")]
    SeqTooLong {
        /// Requested sequence length.
        seq: usize,
        /// The model's context.
        context: usize,
    },
    /// Input that does not fit this stage (wrong kind, length, token or shape).
    #[error("bad input for stage {stage}: {reason}")]
    BadInput {
        /// The stage that rejected the input.
        stage: usize,
        /// What was wrong.
        reason: String,
    },
    /// A microbatch id that is already in flight.
    #[error("microbatch {0} is already in flight on this stage")]
    DuplicateMicrobatch(MicrobatchId),
    /// Backward for a microbatch this stage has no saved activations for.
    #[error("microbatch {0} is not in flight on this stage")]
    UnknownMicrobatch(MicrobatchId),
    /// What the stage needs does not fit its device memory limit.
    #[error(
        "stage {stage} needs {needed} bytes of device memory for {what}, over its limit of {limit} (a larger limit, --recompute or smaller microbatches fit)"
    )]
    MemoryLimit {
        /// The stage.
        stage: usize,
        /// Bytes it would hold.
        needed: u64,
        /// Its limit.
        limit: u64,
        /// What it was making room for.
        what: &'static str,
    },
}

impl StageError {
    fn from_fetch(e: FetchError, stage: usize, limit: Option<u64>) -> Self {
        match e {
            FetchError::Backend(e) => StageError::Backend(e),
            FetchError::NoRoom { needed } => StageError::MemoryLimit {
                stage,
                needed,
                limit: limit.unwrap_or(0),
                what: "a block's parameters and gradients",
            },
        }
    }
}

/// Batch size and sequence length of one microbatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MicrobatchShape {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
}

fn attention_shape(config: &ModelConfig, shape: MicrobatchShape) -> AttentionShape {
    AttentionShape {
        batch: shape.batch,
        seq: shape.seq,
        width: config.width,
        heads: config.heads,
    }
}

impl MicrobatchShape {
    /// Token positions in the microbatch.
    pub fn tokens(&self) -> usize {
        self.batch * self.seq
    }
}

/// The input of a stage's forward pass.
#[derive(Clone, Copy, Debug)]
pub enum StageInput<'a> {
    /// Token ids `(batch, seq)`: the first stage's input.
    Tokens(&'a [u32]),
    /// Activations `(batch, seq, width)` from the previous stage.
    Activations(&'a [f32]),
}

/// The result of a stage's forward pass.
#[derive(Clone, Debug, PartialEq)]
pub enum StageOutput {
    /// Activations `(batch, seq, width)` for the next stage.
    Activations(Vec<f32>),
    /// Mean cross-entropy of the microbatch (last stage).
    Loss(f32),
}

/// Records what a stage holds: `outside` its blocks, and the blocks' parameters and
/// gradients on the device.
fn record<B: Backend>(memory: &mut StageMemory, outside: MemoryUse, blocks: &Chunks<B>) {
    let (params, grads) = blocks.device_bytes();
    memory.set(MemoryUse {
        parameters: outside.parameters + params,
        gradients: outside.gradients + grads,
        ..outside
    });
}

/// What a stage keeps for one in-flight microbatch.
struct Saved<B: Backend> {
    shape: MicrobatchShape,
    /// Device bytes held (see [`MemoryUse::activations`]).
    bytes: u64,
    tokens: Option<B::Tokens>,
    targets: Option<B::Tokens>,
    input: B::Buffer,
    /// Each block's output (the next block's input).
    outs: Vec<B::Buffer>,
    /// Each block's activations for its backward pass; none where the stage recomputes them.
    blocks: Vec<BlockActs<B>>,
    lnf: Option<(B::Buffer, B::Buffer, B::Buffer)>,
    /// Logits, turned into probabilities by the loss, then into logit gradients by backward.
    probs: Option<B::Buffer>,
    losses: Option<B::Buffer>,
}

/// Gradient buffers reused by every backward pass of one microbatch shape.
struct Scratch<B: Backend> {
    shape: MicrobatchShape,
    /// Device bytes held.
    bytes: u64,
    dres: B::Buffer,
    dln: B::Buffer,
    datty: B::Buffer,
    dqkv: B::Buffer,
    datt: B::Buffer,
    dfch: B::Buffer,
    dfcg: B::Buffer,
}

/// Where AdamW's two moments are, and so where the optimizer steps.
enum Moments<B: Backend> {
    /// On the device, stepped there ([`Stage::new`]).
    Device(StageTensors<B::Buffer>, StageTensors<B::Buffer>),
    /// On the host in storage order, stepped there: a stage under a memory limit.
    Host(Vec<f32>, Vec<f32>),
    /// With the caller, which steps on the host ([`Stage::new_stepped_on_host`]).
    Caller,
}

/// One pipeline stage on a backend: parameters, gradients, AdamW state and the saved
/// activations of in-flight microbatches.
pub struct Stage<B: Backend> {
    backend: Arc<B>,
    config: ModelConfig,
    spec: StageSpec,
    info: StageTensors<TensorInfo>,
    /// The embeddings and the final norm (no blocks: those are in `blocks`), always on the
    /// device.
    params: StageTensors<B::Buffer>,
    grads: StageTensors<B::Buffer>,
    /// The transformer blocks' parameters and gradients, on the device or offloaded.
    blocks: Chunks<B>,
    moments: Moments<B>,
    /// Device memory this stage may hold (see [`Stage::with_memory_limit`]).
    memory_limit: Option<u64>,
    optimizer_steps: u64,
    in_flight: HashMap<MicrobatchId, Saved<B>>,
    spare: Vec<Saved<B>>,
    scratch: Option<Scratch<B>>,
    /// Recompute each block's activations in the backward pass from its input rather than
    /// keep them (see [`Stage::set_recompute`]).
    recompute: bool,
    /// Where recomputing: one block's activations for microbatches of a shape.
    replay: Option<(MicrobatchShape, BlockActs<B>)>,
    memory: StageMemory,
}

impl<B: Backend> Stage<B> {
    /// Builds stage `spec` of a model of shape `config`, initialised from `seed` (GPT-2
    /// initialisation; the same seed gives the same model however it is cut).
    pub fn new(
        backend: Arc<B>,
        config: ModelConfig,
        spec: StageSpec,
        seed: u64,
    ) -> Result<Self, StageError> {
        Self::with_memory_limit(backend, config, spec, seed, false, None)
    }

    /// [`Stage::new`] for a caller that runs the optimizer step on the host and keeps AdamW's
    /// moments there (a swarm replica: see `StageReplica::apply_step`): the device holds
    /// parameters and gradients only, half the state, and a step moves no moments.
    pub fn new_stepped_on_host(
        backend: Arc<B>,
        config: ModelConfig,
        spec: StageSpec,
        seed: u64,
    ) -> Result<Self, StageError> {
        Self::with_memory_limit(backend, config, spec, seed, true, None)
    }

    /// [`Stage::new`] (or, if `stepped_on_host`, [`Stage::new_stepped_on_host`]) holding at
    /// most `limit` bytes of device memory. Under a limit the blocks' parameters and gradients
    /// live on the host and come to the device a block at a time while a pass needs them, the
    /// next block fetched before the current one runs where two fit (see `stage/chunks.rs`);
    /// AdamW's moments and its step stay on the host. The numbers are those of an unlimited
    /// stage, bit for bit on the CPU backend. What does not fit is refused with
    /// [`StageError::MemoryLimit`] before anything is allocated past the limit.
    pub fn with_memory_limit(
        backend: Arc<B>,
        config: ModelConfig,
        spec: StageSpec,
        seed: u64,
        stepped_on_host: bool,
        limit: Option<u64>,
    ) -> Result<Self, StageError> {
        config.validate().map_err(|reason| StageError::BadInput {
            stage: spec.index,
            reason,
        })?;
        spec.validate(&config)?;
        let info = layout(&config, spec);
        let b = &*backend;
        let edges = 8 * info
            .front()
            .chain(info.back())
            .map(|i| i.len)
            .sum::<usize>() as u64;
        if let Some(limit) = limit {
            let block = |blk: &Block<TensorInfo>| blk.iter().iter().map(|i| i.len).sum::<usize>();
            let largest = 8 * info.blocks.iter().map(block).max().unwrap_or(0) as u64;
            if edges + largest > limit {
                return Err(StageError::MemoryLimit {
                    stage: spec.index,
                    needed: edges + largest,
                    limit,
                    what: "the embeddings' and one block's parameters and gradients",
                });
            }
        }
        let params = info.try_map_edges(|i| b.upload(&initial_values(i, seed)))?;
        let grads = info.try_map_edges(|i| b.alloc(i.len))?;
        let block_values = info.blocks.iter().map(|blk| {
            blk.iter()
                .into_iter()
                .flat_map(|i| initial_values(i, seed))
                .collect::<Vec<f32>>()
        });
        let blocks = match limit {
            None => Chunks::resident(b, &info.blocks, block_values)?,
            Some(_) => Chunks::offloaded(&info.blocks, block_values),
        };
        let n = info.iter().map(|i| i.len).sum::<usize>();
        let moments = match (stepped_on_host, limit) {
            (true, _) => Moments::Caller,
            (false, None) => Moments::Device(
                info.try_map(|i| b.alloc(i.len))?,
                info.try_map(|i| b.alloc(i.len))?,
            ),
            (false, Some(_)) => Moments::Host(vec![0.0; n], vec![0.0; n]),
        };
        let mut stage = Stage {
            backend,
            config,
            spec,
            info,
            params,
            grads,
            blocks,
            moments,
            memory_limit: limit,
            optimizer_steps: 0,
            in_flight: HashMap::new(),
            spare: Vec::new(),
            scratch: None,
            recompute: false,
            replay: None,
            memory: StageMemory::default(),
        };
        stage.account(0);
        Ok(stage)
    }

    /// Activation recomputation: a microbatch keeps only its blocks' inputs, and the backward
    /// pass computes each block's activations again, one block at a time, before running
    /// it backward. Saves about 15 of every 16 width-sized values a block keeps, at the cost
    /// of a block's forward pass again (less its last product); gradients are the same, bit
    /// for bit on a deterministic backend. Microbatches in flight must be run backward or
    /// discarded before this changes.
    pub fn set_recompute(&mut self, recompute: bool) -> Result<(), StageError> {
        if recompute == self.recompute {
            return Ok(());
        }
        if !self.in_flight.is_empty() {
            return Err(self.bad_input(format!(
                "{} microbatch(es) in flight while switching recomputation",
                self.in_flight.len()
            )));
        }
        self.recompute = recompute;
        // Kept buffers of the other layout are of no use now.
        self.spare.clear();
        self.replay = None;
        self.account(0);
        Ok(())
    }

    /// Device memory this stage holds now and the most it has held.
    pub fn memory(&self) -> StageMemory {
        self.memory
    }

    /// The device memory this stage may hold, if limited.
    pub fn memory_limit(&self) -> Option<u64> {
        self.memory_limit
    }

    /// Bytes of parameters and gradients moved between host and device so far by a stage
    /// under a memory limit (zero without one).
    pub fn offload_traffic(&self) -> OffloadTraffic {
        self.blocks.traffic()
    }

    /// What the stage holds besides its blocks' parameters and gradients (`pending`: the
    /// bytes of saved activations held outside the in-flight map and the spares).
    fn usage_outside_blocks(&self, pending: u64) -> MemoryUse {
        let edges = 4 * self
            .info
            .front()
            .chain(self.info.back())
            .map(|i| i.len)
            .sum::<usize>() as u64;
        let saved = self.in_flight.values().chain(&self.spare);
        MemoryUse {
            parameters: edges,
            gradients: edges,
            optimizer: match self.moments {
                Moments::Device(..) => 8 * self.param_count() as u64,
                Moments::Host(..) | Moments::Caller => 0,
            },
            activations: pending + saved.map(|s| s.bytes).sum::<u64>(),
            workspace: self.scratch.as_ref().map_or(0, |s| s.bytes)
                + self
                    .replay
                    .as_ref()
                    .map_or(0, |(_, a)| 4 * a.values(&*self.backend) as u64),
        }
    }

    /// Counts what the stage holds after an allocation (`pending` as above).
    fn account(&mut self, pending: u64) {
        let outside = self.usage_outside_blocks(pending);
        record(&mut self.memory, outside, &self.blocks);
    }

    /// What the blocks may hold on the device with `pending` bytes of activations held
    /// outside the map (unbounded without a limit).
    fn block_budget(&self, pending: u64) -> u64 {
        match self.memory_limit {
            None => u64::MAX,
            Some(limit) => limit.saturating_sub(self.usage_outside_blocks(pending).total()),
        }
    }

    /// Under a limit, makes room for `bytes` more of activations or workspace (with `pending`
    /// bytes held outside the map) by moving blocks to the host, and refuses what would not
    /// leave room for one block.
    fn make_room(
        &mut self,
        bytes: u64,
        pending: u64,
        what: &'static str,
    ) -> Result<(), StageError> {
        let Some(limit) = self.memory_limit else {
            return Ok(());
        };
        let outside = self.usage_outside_blocks(pending).total();
        let block = self.blocks.largest_block_bytes();
        if outside + bytes + block > limit {
            return Err(StageError::MemoryLimit {
                stage: self.spec.index,
                needed: outside + bytes + block,
                limit,
                what,
            });
        }
        let budget = limit - outside - bytes;
        self.blocks.evict_to(&*self.backend, budget, [None, None])?;
        Ok(())
    }

    /// Which stage this is.
    pub fn spec(&self) -> StageSpec {
        self.spec
    }

    /// The model shape.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The backend this stage runs on.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// Number of parameters held by this stage (a tied copy counted).
    pub fn param_count(&self) -> usize {
        self.info.iter().map(|i| i.len).sum()
    }

    /// Names and sizes of this stage's parameter tensors, in storage order.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorInfo> {
        self.info.iter()
    }

    /// Whether this stage holds a copy of the tied embedding that another stage also holds.
    pub fn holds_tied_copy(&self) -> bool {
        self.spec.count > 1 && (self.spec.is_first() || self.spec.is_last())
    }

    /// Optimizer steps taken so far.
    pub fn optimizer_steps(&self) -> u64 {
        self.optimizer_steps
    }

    /// Microbatches whose backward pass is pending.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    fn bad_input(&self, reason: impl Into<String>) -> StageError {
        StageError::BadInput {
            stage: self.spec.index,
            reason: reason.into(),
        }
    }

    fn alloc_saved(&mut self, shape: MicrobatchShape) -> Result<Saved<B>, StageError> {
        if let Some(pos) = self.spare.iter().position(|s| s.shape == shape) {
            return Ok(self.spare.swap_remove(pos));
        }
        let n = shape.tokens();
        let c = self.config.width;
        let count = self.spec.blocks(&self.config).len();
        let last = self.spec.is_last();
        let mut values = (1 + count) * n * c;
        if !self.recompute {
            values += count * BlockActs::<B>::values_for(&self.config, shape);
        }
        if last {
            // The final norm's output, mean and rstd; the logits; the losses; the targets.
            values += n * c + 2 * n + n * self.config.vocab + n + n;
        }
        if self.spec.is_first() {
            values += n; // the token ids
        }
        if self.memory_limit.is_some() {
            // Buffers kept for another shape give their room first.
            self.spare.clear();
        }
        self.make_room(4 * values as u64, 0, "a microbatch's activations")?;
        let b = &*self.backend;
        let blocks = if self.recompute {
            Vec::new()
        } else {
            (0..count)
                .map(|_| BlockActs::alloc(b, &self.config, shape))
                .collect::<Result<Vec<_>, BackendError>>()?
        };
        let outs = (0..count)
            .map(|_| b.alloc(n * c))
            .collect::<Result<Vec<_>, BackendError>>()?;
        Ok(Saved {
            shape,
            bytes: 4 * values as u64,
            tokens: None,
            targets: None,
            input: b.alloc(n * c)?,
            outs,
            blocks,
            lnf: if last {
                Some((b.alloc(n * c)?, b.alloc(n)?, b.alloc(n)?))
            } else {
                None
            },
            probs: if last {
                Some(b.alloc(n * self.config.vocab)?)
            } else {
                None
            },
            losses: if last { Some(b.alloc(n)?) } else { None },
        })
    }

    /// Forward pass of microbatch `id`. The first stage takes tokens, others the previous
    /// stage's activations; the last stage needs `targets` and returns the mean loss.
    pub fn forward(
        &mut self,
        id: MicrobatchId,
        shape: MicrobatchShape,
        input: StageInput<'_>,
        targets: Option<&[u32]>,
    ) -> Result<StageOutput, StageError> {
        if self.in_flight.contains_key(&id) {
            return Err(StageError::DuplicateMicrobatch(id));
        }
        if shape.batch == 0 || shape.seq == 0 || shape.seq > self.config.context {
            return Err(self.bad_input(format!(
                "microbatch of {} x {} tokens (context is {})",
                shape.batch, shape.seq, self.config.context
            )));
        }
        let n = shape.tokens();
        let c = self.config.width;
        let vocab = self.config.vocab;
        let check_tokens = |what: &str, t: &[u32]| -> Result<(), StageError> {
            if t.len() != n {
                return Err(self.bad_input(format!("{what}: {} ids, expected {n}", t.len())));
            }
            if let Some(&bad) = t.iter().find(|&&x| x as usize >= vocab) {
                return Err(
                    self.bad_input(format!("{what}: token {bad} outside vocabulary {vocab}"))
                );
            }
            Ok(())
        };
        match (self.spec.is_first(), &input) {
            (true, StageInput::Tokens(t)) => check_tokens("tokens", t)?,
            (false, StageInput::Activations(a)) if a.len() == n * c => {}
            (false, StageInput::Activations(a)) => {
                return Err(self.bad_input(format!("{} activations, expected {}", a.len(), n * c)));
            }
            (true, _) => return Err(self.bad_input("the first stage takes tokens")),
            (false, _) => return Err(self.bad_input("this stage takes activations")),
        }
        let targets = match (self.spec.is_last(), targets) {
            (true, Some(t)) => {
                check_tokens("targets", t)?;
                Some(t)
            }
            (true, None) => return Err(self.bad_input("the last stage needs targets")),
            (false, _) => None,
        };

        let mut saved = self.alloc_saved(shape)?;
        if let Err(e) = self.ensure_replay(shape, saved.bytes) {
            self.spare.push(saved);
            return Err(e);
        }
        self.account(saved.bytes);
        let result = self.forward_into(&mut saved, input, targets);
        match result {
            Ok(out) => {
                self.in_flight.insert(id, saved);
                Ok(out)
            }
            Err(e) => {
                self.spare.push(saved);
                Err(e)
            }
        }
    }

    /// Where the stage recomputes activations in the backward pass, every block computes into
    /// the one block's buffers of `self.replay` and `s` keeps block outputs only.
    fn forward_into(
        &mut self,
        s: &mut Saved<B>,
        input: StageInput<'_>,
        targets: Option<&[u32]>,
    ) -> Result<StageOutput, StageError> {
        let backend = self.backend.clone();
        let b = &*backend;
        let outside = self.usage_outside_blocks(s.bytes);
        let budget = self.block_budget(s.bytes);
        let (stage, limit) = (self.spec.index, self.memory_limit);
        let fetch_err = |e| StageError::from_fetch(e, stage, limit);
        let count = s.outs.len();
        if count > 0 {
            self.blocks.prefetch(b, 0, false, budget, None)?;
        }
        let cfg = &self.config;
        let (n, c) = (s.shape.tokens(), cfg.width);
        let rows = RowShape { rows: n, width: c };
        let att = attention_shape(cfg, s.shape);
        match input {
            StageInput::Tokens(t) => {
                let tokens = b.upload_tokens(t)?;
                let (wte, wpe) = (self.params.wte.as_ref(), self.params.wpe.as_ref());
                let (Some(wte), Some(wpe)) = (wte, wpe) else {
                    unreachable!("the first stage holds the embeddings");
                };
                b.embedding_forward(
                    &mut s.input,
                    &tokens,
                    wte,
                    wpe,
                    s.shape.batch,
                    s.shape.seq,
                    c,
                )?;
                s.tokens = Some(tokens);
            }
            StageInput::Activations(a) => b.write(&mut s.input, a)?,
        }
        s.targets = targets.map(|t| b.upload_tokens(t)).transpose()?;

        for i in 0..count {
            self.blocks
                .fetch(b, i, false, budget, None)
                .map_err(fetch_err)?;
            if i + 1 < count {
                self.blocks.prefetch(b, i + 1, false, budget, Some(i))?;
            }
            record(&mut self.memory, outside, &self.blocks);
            let p = self.blocks.params_on_device(i);
            let (before, rest) = s.outs.split_at_mut(i);
            let x = if i == 0 { &s.input } else { &before[i - 1] };
            let acts = match self.replay.as_mut() {
                Some((_, one)) => one,
                None => &mut s.blocks[i],
            };
            acts.forward(b, p, x, Some(&mut rest[0]), rows, att)?;
        }
        let x = s.outs.last().unwrap_or(&s.input);

        if !self.spec.is_last() {
            let mut host = vec![0.0; n * c];
            b.download(x, &mut host)?;
            return Ok(StageOutput::Activations(host));
        }
        let (Some((lnf, mean, rstd)), Some(probs), Some(losses), Some(targets)) = (
            s.lnf.as_mut(),
            s.probs.as_mut(),
            s.losses.as_mut(),
            s.targets.as_ref(),
        ) else {
            unreachable!("the last stage saves its head activations and has targets");
        };
        let (Some(lnf_w), Some(lnf_b), Some(wte)) = (
            self.params.lnf_w.as_ref(),
            self.params.lnf_b.as_ref(),
            self.params.wte.as_ref(),
        ) else {
            unreachable!("the last stage holds the final norm and the head");
        };
        b.layernorm_forward(lnf, mean, rstd, x, lnf_w, lnf_b, rows)?;
        b.matmul_forward(
            probs,
            lnf,
            wte,
            None,
            MatmulShape {
                rows: n,
                input: c,
                output: cfg.vocab,
            },
        )?;
        b.softmax_cross_entropy_forward(
            probs,
            losses,
            targets,
            RowShape {
                rows: n,
                width: cfg.vocab,
            },
        )?;
        let mut host = vec![0.0; n];
        b.download(losses, &mut host)?;
        let mean_loss = host.iter().map(|&l| l as f64).sum::<f64>() / n as f64;
        Ok(StageOutput::Loss(mean_loss as f32))
    }

    /// Backward pass of microbatch `id`. The last stage starts from its loss, weighted by
    /// `loss_scale` (e.g. 1 / microbatches per step, so accumulated gradients are of the mean);
    /// other stages take the gradient of their output. Returns the gradient of the stage input
    /// (`None` on the first stage). Parameter gradients accumulate.
    pub fn backward(
        &mut self,
        id: MicrobatchId,
        grad_output: Option<&[f32]>,
        loss_scale: f32,
    ) -> Result<Option<Vec<f32>>, StageError> {
        let Some(mut saved) = self.in_flight.remove(&id) else {
            return Err(StageError::UnknownMicrobatch(id));
        };
        let n = saved.shape.tokens() * self.config.width;
        match (self.spec.is_last(), grad_output) {
            (true, _) => {}
            (false, Some(g)) if g.len() == n => {}
            (false, g) => {
                let got = g.map_or(0, |g| g.len());
                self.in_flight.insert(id, saved);
                return Err(self.bad_input(format!("{got} output gradients, expected {n}")));
            }
        }
        let result = self.backward_from(&mut saved, grad_output, loss_scale);
        self.spare.push(saved);
        result
    }

    /// Where recomputing, one block's activation buffers for `shape` (`pending`: the bytes
    /// of the microbatch being run, out of the in-flight map meanwhile).
    fn ensure_replay(&mut self, shape: MicrobatchShape, pending: u64) -> Result<(), StageError> {
        let blocks = self.spec.blocks(&self.config).len();
        if !self.recompute || blocks == 0 || self.replay.as_ref().is_some_and(|r| r.0 == shape) {
            return Ok(());
        }
        self.replay = None;
        let bytes = 4 * BlockActs::<B>::values_for(&self.config, shape) as u64;
        self.make_room(bytes, pending, "one block's recomputed activations")?;
        self.replay = Some((
            shape,
            BlockActs::alloc(&*self.backend, &self.config, shape)?,
        ));
        Ok(())
    }

    /// The backward pass's workspace for `shape` (`pending`: the bytes of the microbatch being
    /// run backward, out of the in-flight map meanwhile).
    fn ensure_scratch(&mut self, shape: MicrobatchShape, pending: u64) -> Result<(), StageError> {
        if self.scratch.as_ref().is_some_and(|s| s.shape == shape) {
            return Ok(());
        }
        let (n, c) = (shape.tokens(), self.config.width);
        let probs = shape.batch * self.config.heads * shape.seq * shape.seq;
        // A scratch of another shape is dropped first: the two are never held together.
        self.scratch = None;
        let bytes = 4 * (n * c * 3 + n * 3 * c + probs + 2 * n * 4 * c) as u64;
        self.make_room(bytes, pending, "the backward pass's workspace")?;
        let b = &*self.backend;
        self.scratch = Some(Scratch {
            shape,
            bytes,
            dres: b.alloc(n * c)?,
            dln: b.alloc(n * c)?,
            datty: b.alloc(n * c)?,
            dqkv: b.alloc(n * 3 * c)?,
            datt: b.alloc(probs)?,
            dfch: b.alloc(n * 4 * c)?,
            dfcg: b.alloc(n * 4 * c)?,
        });
        self.account(pending);
        Ok(())
    }

    fn backward_from(
        &mut self,
        s: &mut Saved<B>,
        grad_output: Option<&[f32]>,
        loss_scale: f32,
    ) -> Result<Option<Vec<f32>>, StageError> {
        self.ensure_replay(s.shape, s.bytes)?;
        self.ensure_scratch(s.shape, s.bytes)?;
        let outside = self.usage_outside_blocks(s.bytes);
        let budget = self.block_budget(s.bytes);
        let (stage, limit) = (self.spec.index, self.memory_limit);
        let fetch_err = |e| StageError::from_fetch(e, stage, limit);
        let Stage {
            backend,
            config,
            spec,
            params,
            grads,
            blocks,
            scratch,
            replay,
            memory,
            ..
        } = self;
        let Some(sc) = scratch.as_mut() else {
            unreachable!("scratch was just ensured")
        };
        let b = &**backend;
        let count = s.outs.len();
        if count > 0 {
            blocks.prefetch(b, count - 1, true, budget, None)?;
        }
        let (n, c) = (s.shape.tokens(), config.width);
        let rows = RowShape { rows: n, width: c };
        let att = attention_shape(config, s.shape);
        let x_last = s.outs.last().unwrap_or(&s.input);

        if spec.is_last() {
            let (Some((lnf, mean, rstd)), Some(probs), Some(targets)) =
                (s.lnf.as_ref(), s.probs.as_mut(), s.targets.as_ref())
            else {
                unreachable!("the last stage saved its head activations");
            };
            let (Some(lnf_w), Some(wte)) = (params.lnf_w.as_ref(), params.wte.as_ref()) else {
                unreachable!("the last stage holds the final norm and the head");
            };
            let (Some(g_lnf_w), Some(g_lnf_b), Some(g_wte)) = (
                grads.lnf_w.as_mut(),
                grads.lnf_b.as_mut(),
                grads.wte.as_mut(),
            ) else {
                unreachable!("the last stage holds the final norm and the head");
            };
            b.softmax_cross_entropy_backward(
                probs,
                targets,
                RowShape {
                    rows: n,
                    width: config.vocab,
                },
                loss_scale / n as f32,
            )?;
            b.matmul_backward(
                &mut sc.dln,
                g_wte,
                None,
                probs,
                lnf,
                wte,
                MatmulShape {
                    rows: n,
                    input: c,
                    output: config.vocab,
                },
            )?;
            b.fill(&mut sc.dres, 0.0)?;
            b.layernorm_backward(
                &mut sc.dres,
                g_lnf_w,
                g_lnf_b,
                &sc.dln,
                x_last,
                lnf_w,
                mean,
                rstd,
                rows,
            )?;
        } else if let Some(g) = grad_output {
            b.write(&mut sc.dres, g)?;
        }

        for i in (0..count).rev() {
            blocks.fetch(b, i, true, budget, None).map_err(fetch_err)?;
            if i > 0 {
                blocks.prefetch(b, i - 1, true, budget, Some(i))?;
            }
            record(memory, outside, blocks);
            let (p, g) = blocks.on_device(i);
            let x = if i == 0 { &s.input } else { &s.outs[i - 1] };
            let a = match replay.as_mut() {
                Some((_, one)) => {
                    one.forward(b, p, x, None, rows, att)?;
                    &*one
                }
                None => &s.blocks[i],
            };
            b.matmul_backward(
                &mut sc.dfcg,
                &mut g.fc_proj_w,
                Some(&mut g.fc_proj_b),
                &sc.dres,
                &a.fcg,
                &p.fc_proj_w,
                MatmulShape {
                    rows: n,
                    input: 4 * c,
                    output: c,
                },
            )?;
            b.gelu_backward(&mut sc.dfch, &a.fch, &sc.dfcg)?;
            b.matmul_backward(
                &mut sc.dln,
                &mut g.fc_w,
                Some(&mut g.fc_b),
                &sc.dfch,
                &a.ln2,
                &p.fc_w,
                MatmulShape {
                    rows: n,
                    input: c,
                    output: 4 * c,
                },
            )?;
            b.layernorm_backward(
                &mut sc.dres,
                &mut g.ln2_w,
                &mut g.ln2_b,
                &sc.dln,
                &a.x2,
                &p.ln2_w,
                &a.ln2_mean,
                &a.ln2_rstd,
                rows,
            )?;
            b.matmul_backward(
                &mut sc.datty,
                &mut g.attn_proj_w,
                Some(&mut g.attn_proj_b),
                &sc.dres,
                &a.atty,
                &p.attn_proj_w,
                MatmulShape {
                    rows: n,
                    input: c,
                    output: c,
                },
            )?;
            b.attention_backward(&mut sc.dqkv, &mut sc.datt, &sc.datty, &a.qkv, &a.probs, att)?;
            b.matmul_backward(
                &mut sc.dln,
                &mut g.qkv_w,
                Some(&mut g.qkv_b),
                &sc.dqkv,
                &a.ln1,
                &p.qkv_w,
                MatmulShape {
                    rows: n,
                    input: c,
                    output: 3 * c,
                },
            )?;
            b.layernorm_backward(
                &mut sc.dres,
                &mut g.ln1_w,
                &mut g.ln1_b,
                &sc.dln,
                x,
                &p.ln1_w,
                &a.ln1_mean,
                &a.ln1_rstd,
                rows,
            )?;
        }

        if spec.is_first() {
            let (Some(g_wte), Some(g_wpe), Some(tokens)) =
                (grads.wte.as_mut(), grads.wpe.as_mut(), s.tokens.as_ref())
            else {
                unreachable!("the first stage holds the embeddings and saved its tokens");
            };
            b.embedding_backward(
                g_wte,
                g_wpe,
                &sc.dres,
                tokens,
                s.shape.batch,
                s.shape.seq,
                c,
            )?;
            Ok(None)
        } else {
            let mut host = vec![0.0; n * c];
            b.download(&sc.dres, &mut host)?;
            Ok(Some(host))
        }
    }

    /// The next-token probabilities `(batch, seq, vocab)` the last stage computed in the
    /// forward pass of microbatch `id` (while it is still in flight: before its backward pass
    /// or [`Stage::discard`]); `None` elsewhere. What sampling reads.
    pub fn probabilities(&self, id: MicrobatchId) -> Result<Option<Vec<f32>>, StageError> {
        let Some(probs) = self.in_flight.get(&id).and_then(|s| s.probs.as_ref()) else {
            return Ok(None);
        };
        let mut host = vec![0.0; self.backend.len(probs)];
        self.backend.download(probs, &mut host)?;
        Ok(Some(host))
    }

    /// Forgets microbatch `id` without a backward pass (it will never complete). Returns
    /// whether it was in flight.
    pub fn discard(&mut self, id: MicrobatchId) -> bool {
        match self.in_flight.remove(&id) {
            Some(saved) => {
                self.spare.push(saved);
                true
            }
            None => false,
        }
    }

    /// Forgets every in-flight microbatch (e.g. after the parameters were replaced, so their
    /// saved activations no longer match). Returns how many there were.
    pub fn discard_all(&mut self) -> usize {
        let n = self.in_flight.len();
        self.spare
            .extend(self.in_flight.drain().map(|(_, saved)| saved));
        n
    }
}
