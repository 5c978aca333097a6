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
//! (Over 900 lines, as one file still: activation recomputation and chunked offload rework
//! how a stage holds its buffers, and it is split by concern then rather than twice.)

use crate::backend::{AttentionShape, Backend, BackendError, MatmulShape, RowShape};
use crate::config::ModelConfig;
use crate::optim::AdamW;
use crate::rng::{Rng, derive_seed};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use thiserror::Error;

/// Identifies one microbatch while it is in flight through the pipeline.
pub type MicrobatchId = u64;

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

    /// Device memory (bytes) to train this stage: parameters, gradients, two AdamW moments and
    /// a DiLoCo anchor and momentum (6 fp32 copies), plus the activations kept for the backward
    /// pass of `in_flight` microbatches of `rows` x `seq` tokens (about 16 width-sized values
    /// and the attention matrix per token and block; the logits on the last stage).
    pub fn train_memory_bytes(
        &self,
        config: &ModelConfig,
        rows: usize,
        seq: usize,
        in_flight: usize,
    ) -> u64 {
        let state = 6 * self.param_count(config);
        let blocks = self.blocks(config).len();
        let tokens = rows * seq;
        let mut per_microbatch = blocks * tokens * (16 * config.width + config.heads * seq);
        if self.is_last() {
            per_microbatch += 2 * tokens * config.vocab;
        }
        4 * (state + in_flight * per_microbatch) as u64
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

/// Activations one block saves for its backward pass.
struct BlockActs<B: Backend> {
    ln1: B::Buffer,
    ln1_mean: B::Buffer,
    ln1_rstd: B::Buffer,
    qkv: B::Buffer,
    probs: B::Buffer,
    atty: B::Buffer,
    x2: B::Buffer,
    ln2: B::Buffer,
    ln2_mean: B::Buffer,
    ln2_rstd: B::Buffer,
    fch: B::Buffer,
    fcg: B::Buffer,
    /// Block output (input of the next block).
    out: B::Buffer,
}

/// What a stage keeps for one in-flight microbatch.
struct Saved<B: Backend> {
    shape: MicrobatchShape,
    tokens: Option<B::Tokens>,
    targets: Option<B::Tokens>,
    input: B::Buffer,
    blocks: Vec<BlockActs<B>>,
    lnf: Option<(B::Buffer, B::Buffer, B::Buffer)>,
    /// Logits, turned into probabilities by the loss, then into logit gradients by backward.
    probs: Option<B::Buffer>,
    losses: Option<B::Buffer>,
}

/// Gradient buffers reused by every backward pass of one microbatch shape.
struct Scratch<B: Backend> {
    shape: MicrobatchShape,
    dres: B::Buffer,
    dln: B::Buffer,
    datty: B::Buffer,
    dqkv: B::Buffer,
    datt: B::Buffer,
    dfch: B::Buffer,
    dfcg: B::Buffer,
}

/// One pipeline stage on a backend: parameters, gradients, AdamW state and the saved
/// activations of in-flight microbatches.
pub struct Stage<B: Backend> {
    backend: Arc<B>,
    config: ModelConfig,
    spec: StageSpec,
    info: StageTensors<TensorInfo>,
    params: StageTensors<B::Buffer>,
    grads: StageTensors<B::Buffer>,
    adam_m: StageTensors<B::Buffer>,
    adam_v: StageTensors<B::Buffer>,
    optimizer_steps: u64,
    in_flight: HashMap<MicrobatchId, Saved<B>>,
    spare: Vec<Saved<B>>,
    scratch: Option<Scratch<B>>,
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
        config.validate().map_err(|reason| StageError::BadInput {
            stage: spec.index,
            reason,
        })?;
        spec.validate(&config)?;
        let info = layout(&config, spec);
        let b = &*backend;
        let params = info.try_map(|i| b.upload(&initial_values(i, seed)))?;
        let grads = info.try_map(|i| b.alloc(i.len))?;
        let adam_m = info.try_map(|i| b.alloc(i.len))?;
        let adam_v = info.try_map(|i| b.alloc(i.len))?;
        Ok(Stage {
            backend,
            config,
            spec,
            info,
            params,
            grads,
            adam_m,
            adam_v,
            optimizer_steps: 0,
            in_flight: HashMap::new(),
            spare: Vec::new(),
            scratch: None,
        })
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
        let att = attention_shape(&self.config, shape);
        let blocks = self
            .spec
            .blocks(&self.config)
            .map(|_| {
                Ok(BlockActs {
                    ln1: b.alloc(n * c)?,
                    ln1_mean: b.alloc(n)?,
                    ln1_rstd: b.alloc(n)?,
                    qkv: b.alloc(n * 3 * c)?,
                    probs: b.alloc(att.probs_len())?,
                    atty: b.alloc(n * c)?,
                    x2: b.alloc(n * c)?,
                    ln2: b.alloc(n * c)?,
                    ln2_mean: b.alloc(n)?,
                    ln2_rstd: b.alloc(n)?,
                    fch: b.alloc(n * 4 * c)?,
                    fcg: b.alloc(n * 4 * c)?,
                    out: b.alloc(n * c)?,
                })
            })
            .collect::<Result<Vec<_>, BackendError>>()?;
        let last = self.spec.is_last();
        Ok(Saved {
            shape,
            tokens: None,
            targets: None,
            input: b.alloc(n * c)?,
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

    fn forward_into(
        &self,
        s: &mut Saved<B>,
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
            let (before, rest) = s.blocks.split_at_mut(i);
            let a = &mut rest[0];
            let x = if i == 0 { &s.input } else { &before[i - 1].out };
            b.layernorm_forward(
                &mut a.ln1,
                &mut a.ln1_mean,
                &mut a.ln1_rstd,
                x,
                &p.ln1_w,
                &p.ln1_b,
                rows,
            )?;
            b.matmul_forward(
                &mut a.qkv,
                &a.ln1,
                &p.qkv_w,
                Some(&p.qkv_b),
                MatmulShape {
                    rows: n,
                    input: c,
                    output: 3 * c,
                },
            )?;
            b.attention_forward(&mut a.atty, &mut a.probs, &a.qkv, att)?;
            b.matmul_forward(
                &mut a.x2,
                &a.atty,
                &p.attn_proj_w,
                Some(&p.attn_proj_b),
                MatmulShape {
                    rows: n,
                    input: c,
                    output: c,
                },
            )?;
            b.add_assign(&mut a.x2, x)?;
            b.layernorm_forward(
                &mut a.ln2,
                &mut a.ln2_mean,
                &mut a.ln2_rstd,
                &a.x2,
                &p.ln2_w,
                &p.ln2_b,
                rows,
            )?;
            b.matmul_forward(
                &mut a.fch,
                &a.ln2,
                &p.fc_w,
                Some(&p.fc_b),
                MatmulShape {
                    rows: n,
                    input: c,
                    output: 4 * c,
                },
            )?;
            b.gelu_forward(&mut a.fcg, &a.fch)?;
            b.matmul_forward(
                &mut a.out,
                &a.fcg,
                &p.fc_proj_w,
                Some(&p.fc_proj_b),
                MatmulShape {
                    rows: n,
                    input: 4 * c,
                    output: c,
                },
            )?;
            b.add_assign(&mut a.out, &a.x2)?;
        }
        let x = s.blocks.last().map_or(&s.input, |a| &a.out);

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

    fn ensure_scratch(&mut self, shape: MicrobatchShape) -> Result<(), BackendError> {
        if self.scratch.as_ref().is_some_and(|s| s.shape == shape) {
            return Ok(());
        }
        let b = &*self.backend;
        let (n, c) = (shape.tokens(), self.config.width);
        let probs = shape.batch * self.config.heads * shape.seq * shape.seq;
        self.scratch = Some(Scratch {
            shape,
            dres: b.alloc(n * c)?,
            dln: b.alloc(n * c)?,
            datty: b.alloc(n * c)?,
            dqkv: b.alloc(n * 3 * c)?,
            datt: b.alloc(probs)?,
            dfch: b.alloc(n * 4 * c)?,
            dfcg: b.alloc(n * 4 * c)?,
        });
        Ok(())
    }

    fn backward_from(
        &mut self,
        s: &mut Saved<B>,
        grad_output: Option<&[f32]>,
        loss_scale: f32,
    ) -> Result<Option<Vec<f32>>, StageError> {
        self.ensure_scratch(s.shape)?;
        let Stage {
            backend,
            config,
            spec,
            params,
            grads,
            scratch,
            ..
        } = self;
        let Some(sc) = scratch.as_mut() else {
            unreachable!("scratch was just ensured")
        };
        let b = &**backend;
        let (n, c) = (s.shape.tokens(), config.width);
        let rows = RowShape { rows: n, width: c };
        let att = attention_shape(config, s.shape);
        let x_last = s.blocks.last().map_or(&s.input, |a| &a.out);

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
            let a = &s.blocks[i];
            let x = if i == 0 {
                &s.input
            } else {
                &s.blocks[i - 1].out
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
        self.optimizer_steps += 1;
        let b = &*self.backend;
        let tensors = self
            .info
            .iter()
            .zip(self.params.iter_mut())
            .zip(self.grads.iter())
            .zip(self.adam_m.iter_mut().zip(self.adam_v.iter_mut()));
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

    /// AdamW's first and second moments, each in storage order and concatenated like
    /// [`Stage::download_params`].
    pub fn download_optimizer_state(&self) -> Result<(Vec<f32>, Vec<f32>), StageError> {
        Ok((
            self.download_all(&self.adam_m)?,
            self.download_all(&self.adam_v)?,
        ))
    }

    /// Overwrites AdamW's moments and its step count (which drives bias correction), e.g. to
    /// resume from a checkpoint or take over another replica's state.
    pub fn upload_optimizer_state(
        &mut self,
        m: &[f32],
        v: &[f32],
        steps: u64,
    ) -> Result<(), StageError> {
        self.check_flat_len(m.len())?;
        self.check_flat_len(v.len())?;
        upload_all(&*self.backend, &self.info, &mut self.adam_m, m)?;
        upload_all(&*self.backend, &self.info, &mut self.adam_v, v)?;
        self.optimizer_steps = steps;
        Ok(())
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
