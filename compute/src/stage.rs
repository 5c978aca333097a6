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
//! What a stage is and costs ([`StageSpec`], `stage/spec.rs`) and one block's activations and
//! forward pass (`stage/activations.rs`) are apart. What stays here, over 900 lines, is one
//! concern: the buffers a stage holds (parameters, gradients, moments, saved activations,
//! workspace, their accounting) and the forward and backward passes that fill and consume
//! them, which share those buffers' layout. Chunked offload will move where the parameter
//! and gradient buffers live; it is the next split, along that line.

use crate::backend::{AttentionShape, Backend, BackendError, MatmulShape, RowShape};
use crate::config::ModelConfig;
use crate::memory::{MemoryUse, StageMemory};
use crate::optim::AdamW;
use crate::rng::{Rng, derive_seed};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::Arc;
use thiserror::Error;

mod activations;
mod spec;

use activations::BlockActs;
pub use spec::{Residency, StageSpec};

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

/// How a parameter tensor is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Init {
    Normal(f32),
    Ones,
    Zeros,
}

/// Static description of one parameter tensor.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Global name, identical on every stage that holds the tensor (e.g. `h3.qkv_w`, `wte`).
    pub name: String,
    /// Number of values.
    pub len: usize,
    /// Whether AdamW's weight decay applies (matrices and embeddings, not biases or norms).
    pub decay: bool,
    init: Init,
}

/// The tensors of one transformer block (parameters, gradients or optimizer moments).
#[derive(Clone, Debug)]
struct Block<T> {
    ln1_w: T,
    ln1_b: T,
    qkv_w: T,
    qkv_b: T,
    attn_proj_w: T,
    attn_proj_b: T,
    ln2_w: T,
    ln2_b: T,
    fc_w: T,
    fc_b: T,
    fc_proj_w: T,
    fc_proj_b: T,
}

impl<T> Block<T> {
    fn iter(&self) -> [&T; 12] {
        [
            &self.ln1_w,
            &self.ln1_b,
            &self.qkv_w,
            &self.qkv_b,
            &self.attn_proj_w,
            &self.attn_proj_b,
            &self.ln2_w,
            &self.ln2_b,
            &self.fc_w,
            &self.fc_b,
            &self.fc_proj_w,
            &self.fc_proj_b,
        ]
    }

    fn iter_mut(&mut self) -> [&mut T; 12] {
        [
            &mut self.ln1_w,
            &mut self.ln1_b,
            &mut self.qkv_w,
            &mut self.qkv_b,
            &mut self.attn_proj_w,
            &mut self.attn_proj_b,
            &mut self.ln2_w,
            &mut self.ln2_b,
            &mut self.fc_w,
            &mut self.fc_b,
            &mut self.fc_proj_w,
            &mut self.fc_proj_b,
        ]
    }

    fn try_map<U, E>(&self, mut f: impl FnMut(&T) -> Result<U, E>) -> Result<Block<U>, E> {
        Ok(Block {
            ln1_w: f(&self.ln1_w)?,
            ln1_b: f(&self.ln1_b)?,
            qkv_w: f(&self.qkv_w)?,
            qkv_b: f(&self.qkv_b)?,
            attn_proj_w: f(&self.attn_proj_w)?,
            attn_proj_b: f(&self.attn_proj_b)?,
            ln2_w: f(&self.ln2_w)?,
            ln2_b: f(&self.ln2_b)?,
            fc_w: f(&self.fc_w)?,
            fc_b: f(&self.fc_b)?,
            fc_proj_w: f(&self.fc_proj_w)?,
            fc_proj_b: f(&self.fc_proj_b)?,
        })
    }
}

/// All tensors of a stage, in a fixed order (the order of [`StageTensors::iter`]).
#[derive(Clone, Debug)]
struct StageTensors<T> {
    /// Token embedding (first stage) or its tied copy used as the LM head (last stage).
    wte: Option<T>,
    wpe: Option<T>,
    blocks: Vec<Block<T>>,
    lnf_w: Option<T>,
    lnf_b: Option<T>,
}

impl<T> StageTensors<T> {
    fn iter(&self) -> impl Iterator<Item = &T> {
        self.wte
            .iter()
            .chain(self.wpe.iter())
            .chain(self.blocks.iter().flat_map(|b| b.iter()))
            .chain(self.lnf_w.iter())
            .chain(self.lnf_b.iter())
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.wte
            .iter_mut()
            .chain(self.wpe.iter_mut())
            .chain(self.blocks.iter_mut().flat_map(|b| b.iter_mut()))
            .chain(self.lnf_w.iter_mut())
            .chain(self.lnf_b.iter_mut())
    }

    fn try_map<U, E>(&self, mut f: impl FnMut(&T) -> Result<U, E>) -> Result<StageTensors<U>, E> {
        Ok(StageTensors {
            wte: self.wte.as_ref().map(&mut f).transpose()?,
            wpe: self.wpe.as_ref().map(&mut f).transpose()?,
            blocks: self
                .blocks
                .iter()
                .map(|b| b.try_map(&mut f))
                .collect::<Result<_, E>>()?,
            lnf_w: self.lnf_w.as_ref().map(&mut f).transpose()?,
            lnf_b: self.lnf_b.as_ref().map(&mut f).transpose()?,
        })
    }
}

fn layout(config: &ModelConfig, spec: StageSpec) -> StageTensors<TensorInfo> {
    let c = config.width;
    let std = 0.02;
    // GPT-2 scales the init of projections into the residual stream by 1/sqrt(2L) so the
    // stream's variance does not grow with depth.
    let resid_std = std / (2.0 * config.layers as f32).sqrt();
    let t = |name: String, len: usize, decay: bool, init: Init| TensorInfo {
        name,
        len,
        decay,
        init,
    };
    let first = spec.is_first();
    let last = spec.is_last();
    StageTensors {
        wte: (first || last).then(|| t("wte".into(), config.vocab * c, true, Init::Normal(std))),
        wpe: first.then(|| t("wpe".into(), config.context * c, true, Init::Normal(std))),
        blocks: spec
            .blocks(config)
            .map(|l| {
                let n = |s: &str| format!("h{l}.{s}");
                Block {
                    ln1_w: t(n("ln1_w"), c, false, Init::Ones),
                    ln1_b: t(n("ln1_b"), c, false, Init::Zeros),
                    qkv_w: t(n("qkv_w"), 3 * c * c, true, Init::Normal(std)),
                    qkv_b: t(n("qkv_b"), 3 * c, false, Init::Zeros),
                    attn_proj_w: t(n("attn_proj_w"), c * c, true, Init::Normal(resid_std)),
                    attn_proj_b: t(n("attn_proj_b"), c, false, Init::Zeros),
                    ln2_w: t(n("ln2_w"), c, false, Init::Ones),
                    ln2_b: t(n("ln2_b"), c, false, Init::Zeros),
                    fc_w: t(n("fc_w"), 4 * c * c, true, Init::Normal(std)),
                    fc_b: t(n("fc_b"), 4 * c, false, Init::Zeros),
                    fc_proj_w: t(n("fc_proj_w"), 4 * c * c, true, Init::Normal(resid_std)),
                    fc_proj_b: t(n("fc_proj_b"), c, false, Init::Zeros),
                }
            })
            .collect(),
        lnf_w: last.then(|| t("lnf_w".into(), c, false, Init::Ones)),
        lnf_b: last.then(|| t("lnf_b".into(), c, false, Init::Zeros)),
    }
}

fn upload_all<B: Backend>(
    backend: &B,
    info: &StageTensors<TensorInfo>,
    tensors: &mut StageTensors<B::Buffer>,
    values: &[f32],
) -> Result<(), StageError> {
    let mut offset = 0;
    for (info, t) in info.iter().zip(tensors.iter_mut()) {
        backend.write(t, &values[offset..offset + info.len])?;
        offset += info.len;
    }
    Ok(())
}

/// FNV-1a, to give each tensor name a stable seed.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

fn initial_values(info: &TensorInfo, seed: u64) -> Vec<f32> {
    match info.init {
        Init::Ones => vec![1.0; info.len],
        Init::Zeros => vec![0.0; info.len],
        Init::Normal(std) => {
            // Seeded by the tensor's global name: every cut of the model, and both copies of
            // the tied embedding, start from the same values.
            let mut rng = Rng::new(derive_seed(seed, &[name_hash(&info.name)]));
            (0..info.len).map(|_| rng.normal() as f32 * std).collect()
        }
    }
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

/// AdamW's first and second moments on the device.
type Moments<B> = (
    StageTensors<<B as Backend>::Buffer>,
    StageTensors<<B as Backend>::Buffer>,
);

/// One pipeline stage on a backend: parameters, gradients, AdamW state and the saved
/// activations of in-flight microbatches.
pub struct Stage<B: Backend> {
    backend: Arc<B>,
    config: ModelConfig,
    spec: StageSpec,
    info: StageTensors<TensorInfo>,
    params: StageTensors<B::Buffer>,
    grads: StageTensors<B::Buffer>,
    /// AdamW's two moments on the device; None where the optimizer steps on the host and its
    /// moments live there (see [`Stage::new_stepped_on_host`]).
    moments: Option<Moments<B>>,
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
        Self::build(backend, config, spec, seed, true)
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
        Self::build(backend, config, spec, seed, false)
    }

    fn build(
        backend: Arc<B>,
        config: ModelConfig,
        spec: StageSpec,
        seed: u64,
        device_moments: bool,
    ) -> Result<Self, StageError> {
        config.validate().map_err(|reason| StageError::BadInput {
            stage: spec.index,
            reason,
        })?;
        spec.validate(&config)?;
        let info = layout(&config, spec);
        let b = &*backend;
        let params = info.try_map(|i| b.upload(&initial_values(i, seed)))?;
        let grads = info.try_map(|i| b.alloc(i.len))?;
        let moments = if device_moments {
            Some((
                info.try_map(|i| b.alloc(i.len))?,
                info.try_map(|i| b.alloc(i.len))?,
            ))
        } else {
            None
        };
        let mut stage = Stage {
            backend,
            config,
            spec,
            info,
            params,
            grads,
            moments,
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

    /// Counts what the stage holds after an allocation (`pending`: the bytes of saved
    /// activations held outside the in-flight map and the spares, being filled).
    fn account(&mut self, pending: u64) {
        let tensors = 4 * self.param_count() as u64;
        let saved = self.in_flight.values().chain(&self.spare);
        self.memory.set(MemoryUse {
            parameters: tensors,
            gradients: tensors,
            optimizer: if self.moments.is_some() {
                2 * tensors
            } else {
                0
            },
            activations: pending + saved.map(|s| s.bytes).sum::<u64>(),
            workspace: self.scratch.as_ref().map_or(0, |s| s.bytes)
                + self
                    .replay
                    .as_ref()
                    .map_or(0, |(_, a)| 4 * a.values(&*self.backend) as u64),
        });
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
        let b = &*self.backend;
        let n = shape.tokens();
        let c = self.config.width;
        let count = self.spec.blocks(&self.config).len();
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
        let last = self.spec.is_last();
        let mut values = (1 + count) * n * c + blocks.iter().map(|a| a.values(b)).sum::<usize>();
        if last {
            // The final norm's output, mean and rstd; the logits; the losses; the targets.
            values += n * c + 2 * n + n * self.config.vocab + n + n;
        }
        if self.spec.is_first() {
            values += n; // the token ids
        }
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
        self.ensure_replay(shape)?;
        self.account(saved.bytes);
        let mut replay = self.replay.take();
        let result = self.forward_into(
            &mut saved,
            replay.as_mut().map(|r| &mut r.1),
            input,
            targets,
        );
        self.replay = replay;
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

    /// `replay`: the one block's buffers that every block computes into where the stage
    /// recomputes activations in the backward pass (`s` then keeps block outputs only).
    fn forward_into(
        &self,
        s: &mut Saved<B>,
        mut replay: Option<&mut BlockActs<B>>,
        input: StageInput<'_>,
        targets: Option<&[u32]>,
    ) -> Result<StageOutput, StageError> {
        let b = &*self.backend;
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

        for (i, p) in self.params.blocks.iter().enumerate() {
            let (before, rest) = s.outs.split_at_mut(i);
            let x = if i == 0 { &s.input } else { &before[i - 1] };
            let acts = match replay.as_deref_mut() {
                Some(one) => one,
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

    /// Where recomputing, one block's activation buffers for `shape`.
    fn ensure_replay(&mut self, shape: MicrobatchShape) -> Result<(), BackendError> {
        let blocks = self.spec.blocks(&self.config).len();
        if !self.recompute || blocks == 0 || self.replay.as_ref().is_some_and(|r| r.0 == shape) {
            return Ok(());
        }
        self.replay = None;
        self.replay = Some((
            shape,
            BlockActs::alloc(&*self.backend, &self.config, shape)?,
        ));
        Ok(())
    }

    /// The backward pass's workspace for `shape` (`pending`: the bytes of the microbatch being
    /// run backward, out of the in-flight map meanwhile).
    fn ensure_scratch(&mut self, shape: MicrobatchShape, pending: u64) -> Result<(), BackendError> {
        if self.scratch.as_ref().is_some_and(|s| s.shape == shape) {
            return Ok(());
        }
        let b = &*self.backend;
        let (n, c) = (shape.tokens(), self.config.width);
        let probs = shape.batch * self.config.heads * shape.seq * shape.seq;
        // A scratch of another shape is dropped first: the two are never held together.
        self.scratch = None;
        self.scratch = Some(Scratch {
            shape,
            bytes: 4 * (n * c * 3 + n * 3 * c + probs + 2 * n * 4 * c) as u64,
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
        self.ensure_replay(s.shape)?;
        self.ensure_scratch(s.shape, s.bytes)?;
        let Stage {
            backend,
            config,
            spec,
            params,
            grads,
            scratch,
            replay,
            ..
        } = self;
        let Some(sc) = scratch.as_mut() else {
            unreachable!("scratch was just ensured")
        };
        let b = &**backend;
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

        for (i, (p, g)) in params
            .blocks
            .iter()
            .zip(grads.blocks.iter_mut())
            .enumerate()
            .rev()
        {
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

    /// Sets all parameter gradients to zero.
    pub fn zero_grads(&mut self) -> Result<(), StageError> {
        for g in self.grads.iter_mut() {
            self.backend.fill(g, 0.0)?;
        }
        Ok(())
    }

    /// Sum of squared gradients of this stage. With `count_tied_copy == false` a tied
    /// embedding copy held by the last stage of a cut model is left out, so that summing over
    /// all stages counts the tied matrix once.
    pub fn grad_sum_squares(&self, count_tied_copy: bool) -> Result<f64, StageError> {
        let skip_wte = !count_tied_copy && self.holds_tied_copy() && !self.spec.is_first();
        let mut total = 0.0;
        for (info, g) in self.info.iter().zip(self.grads.iter()) {
            if skip_wte && info.name == "wte" {
                continue;
            }
            total += self.backend.sum_squares(g)?;
        }
        Ok(total)
    }

    /// The gradient of the tied embedding held by this stage, if it holds one.
    pub fn tied_embedding_grad(&self) -> Result<Option<Vec<f32>>, StageError> {
        let Some(g) = self.grads.wte.as_ref() else {
            return Ok(None);
        };
        let mut host = vec![0.0; self.backend.len(g)];
        self.backend.download(g, &mut host)?;
        Ok(Some(host))
    }

    /// Replaces the gradient of the tied embedding (after summing it across its holders).
    pub fn set_tied_embedding_grad(&mut self, grad: &[f32]) -> Result<(), StageError> {
        match self.grads.wte.as_mut() {
            Some(g) => Ok(self.backend.write(g, grad)?),
            None => Err(self.bad_input("this stage holds no embedding")),
        }
    }

    /// One AdamW step on every parameter at learning rate `lr`, gradients multiplied by
    /// `grad_scale` first (clipping).
    pub fn apply_optimizer(
        &mut self,
        opt: &AdamW,
        lr: f32,
        grad_scale: f32,
    ) -> Result<(), StageError> {
        let Some((adam_m, adam_v)) = self.moments.as_mut() else {
            return Err(StageError::BadInput {
                stage: self.spec.index,
                reason: "this stage's optimizer steps on the host".into(),
            });
        };
        self.optimizer_steps += 1;
        let b = &*self.backend;
        let tensors = self
            .info
            .iter()
            .zip(self.params.iter_mut())
            .zip(self.grads.iter())
            .zip(adam_m.iter_mut().zip(adam_v.iter_mut()));
        for (((info, p), g), (m, v)) in tensors {
            let update = opt.update(lr, info.decay, self.optimizer_steps, grad_scale);
            b.adamw(p, g, m, v, &update)?;
        }
        Ok(())
    }

    /// All parameters in storage order, concatenated.
    pub fn download_params(&self) -> Result<Vec<f32>, StageError> {
        self.download_all(&self.params)
    }

    /// All parameter gradients in storage order, concatenated.
    pub fn download_grads(&self) -> Result<Vec<f32>, StageError> {
        self.download_all(&self.grads)
    }

    /// Each parameter gradient with its tensor's global name.
    pub fn named_grads(&self) -> Result<Vec<(String, Vec<f32>)>, StageError> {
        let mut out = Vec::new();
        for (info, g) in self.info.iter().zip(self.grads.iter()) {
            let mut host = vec![0.0; info.len];
            self.backend.download(g, &mut host)?;
            out.push((info.name.clone(), host));
        }
        Ok(out)
    }

    /// Overwrites all parameters from a concatenation in storage order.
    pub fn upload_params(&mut self, values: &[f32]) -> Result<(), StageError> {
        self.check_flat_len(values.len())?;
        upload_all(&*self.backend, &self.info, &mut self.params, values)
    }

    /// Overwrites all parameter gradients from a concatenation in storage order (e.g. after
    /// averaging them with other replicas).
    pub fn upload_grads(&mut self, values: &[f32]) -> Result<(), StageError> {
        self.check_flat_len(values.len())?;
        upload_all(&*self.backend, &self.info, &mut self.grads, values)
    }

    /// Sets the optimizer's step count where the step runs on the host (see
    /// [`Stage::new_stepped_on_host`]).
    pub fn set_optimizer_steps(&mut self, steps: u64) {
        self.optimizer_steps = steps;
    }

    fn check_flat_len(&self, len: usize) -> Result<(), StageError> {
        let total = self.param_count();
        if len != total {
            return Err(self.bad_input(format!("{len} values, expected {total}")));
        }
        Ok(())
    }

    fn download_all(&self, t: &StageTensors<B::Buffer>) -> Result<Vec<f32>, StageError> {
        let mut out = vec![0.0; self.param_count()];
        let mut offset = 0;
        for (info, buf) in self.info.iter().zip(t.iter()) {
            self.backend
                .download(buf, &mut out[offset..offset + info.len])?;
            offset += info.len;
        }
        Ok(out)
    }
}
