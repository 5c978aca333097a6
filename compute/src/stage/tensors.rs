//! The tensors of a stage: each parameter tensor's name, size and initialisation, grouped by
//! transformer block and by what lies outside the blocks (the embeddings before them, the
//! final norm after), in the one storage order every flat vector of a stage follows.

use super::StageSpec;
use crate::config::ModelConfig;
use crate::rng::{Rng, derive_seed};

/// How a parameter tensor is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Init {
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
pub(super) struct Block<T> {
    pub(super) ln1_w: T,
    pub(super) ln1_b: T,
    pub(super) qkv_w: T,
    pub(super) qkv_b: T,
    pub(super) attn_proj_w: T,
    pub(super) attn_proj_b: T,
    pub(super) ln2_w: T,
    pub(super) ln2_b: T,
    pub(super) fc_w: T,
    pub(super) fc_b: T,
    pub(super) fc_proj_w: T,
    pub(super) fc_proj_b: T,
}

impl<T> Block<T> {
    pub(super) fn iter(&self) -> [&T; 12] {
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

    pub(super) fn iter_mut(&mut self) -> [&mut T; 12] {
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

    /// A block of the tensors `f` gives for each place in [`Block::iter`] order.
    pub(super) fn try_build<E>(mut f: impl FnMut(usize) -> Result<T, E>) -> Result<Block<T>, E> {
        Ok(Block {
            ln1_w: f(0)?,
            ln1_b: f(1)?,
            qkv_w: f(2)?,
            qkv_b: f(3)?,
            attn_proj_w: f(4)?,
            attn_proj_b: f(5)?,
            ln2_w: f(6)?,
            ln2_b: f(7)?,
            fc_w: f(8)?,
            fc_b: f(9)?,
            fc_proj_w: f(10)?,
            fc_proj_b: f(11)?,
        })
    }

    pub(super) fn try_map<U, E>(
        &self,
        mut f: impl FnMut(&T) -> Result<U, E>,
    ) -> Result<Block<U>, E> {
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
pub(super) struct StageTensors<T> {
    /// Token embedding (first stage) or its tied copy used as the LM head (last stage).
    pub(super) wte: Option<T>,
    pub(super) wpe: Option<T>,
    pub(super) blocks: Vec<Block<T>>,
    pub(super) lnf_w: Option<T>,
    pub(super) lnf_b: Option<T>,
}

impl<T> StageTensors<T> {
    pub(super) fn iter(&self) -> impl Iterator<Item = &T> {
        self.wte
            .iter()
            .chain(self.wpe.iter())
            .chain(self.blocks.iter().flat_map(|b| b.iter()))
            .chain(self.lnf_w.iter())
            .chain(self.lnf_b.iter())
    }

    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.wte
            .iter_mut()
            .chain(self.wpe.iter_mut())
            .chain(self.blocks.iter_mut().flat_map(|b| b.iter_mut()))
            .chain(self.lnf_w.iter_mut())
            .chain(self.lnf_b.iter_mut())
    }

    /// The embeddings, which come before the blocks in storage order.
    pub(super) fn front(&self) -> impl Iterator<Item = &T> {
        self.wte.iter().chain(self.wpe.iter())
    }

    /// The final norm, after the blocks.
    pub(super) fn back(&self) -> impl Iterator<Item = &T> {
        self.lnf_w.iter().chain(self.lnf_b.iter())
    }

    pub(super) fn front_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.wte.iter_mut().chain(self.wpe.iter_mut())
    }

    pub(super) fn back_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.lnf_w.iter_mut().chain(self.lnf_b.iter_mut())
    }

    /// The tensors outside the blocks (`f` of each), with no blocks.
    pub(super) fn try_map_edges<U, E>(
        &self,
        mut f: impl FnMut(&T) -> Result<U, E>,
    ) -> Result<StageTensors<U>, E> {
        Ok(StageTensors {
            wte: self.wte.as_ref().map(&mut f).transpose()?,
            wpe: self.wpe.as_ref().map(&mut f).transpose()?,
            blocks: Vec::new(),
            lnf_w: self.lnf_w.as_ref().map(&mut f).transpose()?,
            lnf_b: self.lnf_b.as_ref().map(&mut f).transpose()?,
        })
    }

    pub(super) fn try_map<U, E>(
        &self,
        mut f: impl FnMut(&T) -> Result<U, E>,
    ) -> Result<StageTensors<U>, E> {
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

pub(super) fn layout(config: &ModelConfig, spec: StageSpec) -> StageTensors<TensorInfo> {
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

/// FNV-1a, to give each tensor name a stable seed.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

pub(super) fn initial_values(info: &TensorInfo, seed: u64) -> Vec<f32> {
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
