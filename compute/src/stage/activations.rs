//! The activations one block keeps for its backward pass, and the block's forward pass that
//! fills them (run again in the backward pass where the stage recomputes activations).

use super::{Block, MicrobatchShape, attention_shape};
use crate::backend::{AttentionShape, Backend, BackendError, MatmulShape, RowShape};
use crate::config::ModelConfig;

/// Activations one block saves for its backward pass.
pub(super) struct BlockActs<B: Backend> {
    pub(super) ln1: B::Buffer,
    pub(super) ln1_mean: B::Buffer,
    pub(super) ln1_rstd: B::Buffer,
    pub(super) qkv: B::Buffer,
    pub(super) probs: B::Buffer,
    pub(super) atty: B::Buffer,
    pub(super) x2: B::Buffer,
    pub(super) ln2: B::Buffer,
    pub(super) ln2_mean: B::Buffer,
    pub(super) ln2_rstd: B::Buffer,
    pub(super) fch: B::Buffer,
    pub(super) fcg: B::Buffer,
}

impl<B: Backend> BlockActs<B> {
    /// Values one block's activations of `shape` hold: 15 width-sized values, 4 per-token
    /// statistics and the attention matrix per token.
    pub(super) fn values_for(config: &ModelConfig, shape: MicrobatchShape) -> usize {
        let (n, c) = (shape.tokens(), config.width);
        15 * n * c + 4 * n + attention_shape(config, shape).probs_len()
    }

    /// Buffers for one block's activations of `shape`.
    pub(super) fn alloc(
        b: &B,
        config: &ModelConfig,
        shape: MicrobatchShape,
    ) -> Result<Self, BackendError> {
        let (n, c) = (shape.tokens(), config.width);
        Ok(BlockActs {
            ln1: b.alloc(n * c)?,
            ln1_mean: b.alloc(n)?,
            ln1_rstd: b.alloc(n)?,
            qkv: b.alloc(n * 3 * c)?,
            probs: b.alloc(attention_shape(config, shape).probs_len())?,
            atty: b.alloc(n * c)?,
            x2: b.alloc(n * c)?,
            ln2: b.alloc(n * c)?,
            ln2_mean: b.alloc(n)?,
            ln2_rstd: b.alloc(n)?,
            fch: b.alloc(n * 4 * c)?,
            fcg: b.alloc(n * 4 * c)?,
        })
    }

    /// Block `p`'s forward pass on `x` into these buffers and, unless None, its output into
    /// `out` (a backward pass that recomputes the activations needs everything but that).
    pub(super) fn forward(
        &mut self,
        b: &B,
        p: &Block<B::Buffer>,
        x: &B::Buffer,
        out: Option<&mut B::Buffer>,
        rows: RowShape,
        att: AttentionShape,
    ) -> Result<(), BackendError> {
        let (n, c) = (rows.rows, rows.width);
        b.layernorm_forward(
            &mut self.ln1,
            &mut self.ln1_mean,
            &mut self.ln1_rstd,
            x,
            &p.ln1_w,
            &p.ln1_b,
            rows,
        )?;
        b.matmul_forward(
            &mut self.qkv,
            &self.ln1,
            &p.qkv_w,
            Some(&p.qkv_b),
            MatmulShape {
                rows: n,
                input: c,
                output: 3 * c,
            },
        )?;
        b.attention_forward(&mut self.atty, &mut self.probs, &self.qkv, att)?;
        b.matmul_forward(
            &mut self.x2,
            &self.atty,
            &p.attn_proj_w,
            Some(&p.attn_proj_b),
            MatmulShape {
                rows: n,
                input: c,
                output: c,
            },
        )?;
        b.add_assign(&mut self.x2, x)?;
        b.layernorm_forward(
            &mut self.ln2,
            &mut self.ln2_mean,
            &mut self.ln2_rstd,
            &self.x2,
            &p.ln2_w,
            &p.ln2_b,
            rows,
        )?;
        b.matmul_forward(
            &mut self.fch,
            &self.ln2,
            &p.fc_w,
            Some(&p.fc_b),
            MatmulShape {
                rows: n,
                input: c,
                output: 4 * c,
            },
        )?;
        b.gelu_forward(&mut self.fcg, &self.fch)?;
        if let Some(out) = out {
            b.matmul_forward(
                out,
                &self.fcg,
                &p.fc_proj_w,
                Some(&p.fc_proj_b),
                MatmulShape {
                    rows: n,
                    input: 4 * c,
                    output: c,
                },
            )?;
            b.add_assign(out, &self.x2)?;
        }
        Ok(())
    }

    /// Values held.
    pub(super) fn values(&self, b: &B) -> usize {
        [
            &self.ln1,
            &self.ln1_mean,
            &self.ln1_rstd,
            &self.qkv,
            &self.probs,
            &self.atty,
            &self.x2,
            &self.ln2,
            &self.ln2_mean,
            &self.ln2_rstd,
            &self.fch,
            &self.fcg,
        ]
        .into_iter()
        .map(|buf| b.len(buf))
        .sum()
    }
}
