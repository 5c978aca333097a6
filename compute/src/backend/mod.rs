//! The [`Backend`] trait: device buffers and the operations of a GPT stage.
//!
//! A backend owns device memory ([`Backend::Buffer`] for `f32` tensors, [`Backend::Tokens`] for
//! token ids) and executes every operation of a stage's forward and backward pass and of the
//! optimizer on it. Data crosses to the host only through [`Backend::upload`] and
//! [`Backend::download`]; the model code chains operations on device buffers, so a GPU backend
//! never has to round-trip through the host between layers.
//!
//! Conventions shared by every implementation (the CPU backend is the reference):
//! * Matrices are row-major. A linear layer's weight is `(out, in)` and computes
//!   `out = inp · Wᵀ + bias`, as in GPT-2 / llm.c.
//! * Backward operations **overwrite** the gradient of their activation input, except
//!   [`Backend::layernorm_backward`], which **adds** into it (the residual stream's gradient
//!   flows through it), and always **accumulate** into parameter gradients, so microbatches
//!   accumulate without extra passes.

mod any;
mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub(crate) mod kernels;
#[cfg(feature = "wgpu")]
pub mod webgpu;

pub use any::{AnyBackend, AnyBuffer, AnyTokens, BackendChoice};
pub use cpu::CpuBackend;
#[cfg(feature = "cuda")]
pub use cuda::CudaBackend;
#[cfg(feature = "wgpu")]
pub use webgpu::WgpuBackend;

use thiserror::Error;

/// What can go wrong on a device.
#[derive(Debug, Error)]
pub enum BackendError {
    /// An allocation did not fit in the device's memory.
    #[error("out of device memory allocating {bytes} bytes on {backend}")]
    OutOfMemory {
        /// The backend that failed.
        backend: String,
        /// Size of the allocation that failed.
        bytes: usize,
    },
    /// A host buffer's length does not match the device buffer.
    #[error("length mismatch: device buffer holds {device} values, host slice {host}")]
    LengthMismatch {
        /// Values in the device buffer.
        device: usize,
        /// Values in the host slice.
        host: usize,
    },
    /// The device reported an error (lost device, failed launch, ...).
    #[error("device error on {backend}: {message}")]
    Device {
        /// The backend that failed.
        backend: String,
        /// What the device said.
        message: String,
    },
}

/// Result of a backend operation.
pub type Result<T> = std::result::Result<T, BackendError>;

/// Rows of `width` values each (LayerNorm, elementwise over a row).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowShape {
    /// Number of rows (batch × sequence positions).
    pub rows: usize,
    /// Values per row.
    pub width: usize,
}

/// A linear layer applied to `rows` vectors: `(rows, input) · (output, input)ᵀ`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulShape {
    /// Number of input vectors (batch × sequence positions).
    pub rows: usize,
    /// Input features.
    pub input: usize,
    /// Output features.
    pub output: usize,
}

/// Causal multi-head self-attention over a batch of sequences.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    /// Sequences in the batch.
    pub batch: usize,
    /// Positions per sequence.
    pub seq: usize,
    /// Model width (all heads together).
    pub width: usize,
    /// Number of heads; divides `width`.
    pub heads: usize,
}

impl AttentionShape {
    /// Values in the saved attention probabilities `(batch, heads, seq, seq)`.
    pub fn probs_len(&self) -> usize {
        self.batch * self.heads * self.seq * self.seq
    }
}

// Each operation's buffer lengths, checked alike by every backend (see `check_len`).

impl RowShape {
    /// LayerNorm's buffers: `rows` values (`mean`, `rstd`), `rows x width` (`x`), `width`
    /// (`w`: weights, biases and their gradients).
    pub(crate) fn check_layernorm(&self, x: &[usize], per_row: [usize; 2], w: [usize; 2]) {
        for len in x {
            check_len(*len, self.rows * self.width, "layernorm activations");
        }
        for len in per_row {
            check_len(len, self.rows, "layernorm mean/rstd");
        }
        for len in w {
            check_len(len, self.width, "layernorm weight/bias");
        }
    }

    pub(crate) fn check_cross_entropy(&self, logits: usize, targets: usize) {
        check_len(logits, self.rows * self.width, "cross-entropy logits");
        check_len(targets, self.rows, "cross-entropy targets");
    }
}

impl MatmulShape {
    pub(crate) fn check_forward(&self, out: usize, inp: usize, weight: usize) {
        check_len(out, self.rows * self.output, "matmul out");
        check_len(inp, self.rows * self.input, "matmul inp");
        check_len(weight, self.output * self.input, "matmul weight");
    }

    pub(crate) fn check_backward(&self, dinp: usize, dweight: usize, dout: usize, inp: usize) {
        check_len(dinp, self.rows * self.input, "matmul dinp");
        check_len(dweight, self.output * self.input, "matmul dweight");
        check_len(dout, self.rows * self.output, "matmul dout");
        check_len(inp, self.rows * self.input, "matmul inp");
    }
}

impl AttentionShape {
    pub(crate) fn check_forward(&self, out: usize, probs: usize, qkv: usize) {
        let values = self.batch * self.seq * self.width;
        check_len(out, values, "attention out");
        check_len(probs, self.probs_len(), "attention probs");
        check_len(qkv, 3 * values, "attention qkv");
    }

    pub(crate) fn check_backward(&self, dqkv: usize, scratch: usize, dout: usize, probs: usize) {
        let values = self.batch * self.seq * self.width;
        check_len(dqkv, 3 * values, "attention dqkv");
        check_len(scratch, self.probs_len(), "attention scratch");
        check_len(dout, values, "attention dout");
        check_len(probs, self.probs_len(), "attention probs");
    }
}

/// Hyper-parameters of one AdamW update of one tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWUpdate {
    /// Learning rate of this step.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled weight decay (0 for biases and norms).
    pub weight_decay: f32,
    /// 1-based step count, for bias correction.
    pub step: u64,
    /// Factor applied to the gradient first (gradient clipping, averaging).
    pub grad_scale: f32,
}

/// Panics unless a buffer of `actual` values has the `expected` length: shapes come from the
/// model code, so a mismatch is a programming error, never data-dependent (see [`Backend`]).
pub(crate) fn check_len(actual: usize, expected: usize, what: &str) {
    assert_eq!(
        actual, expected,
        "{what}: buffer length {actual} != expected {expected}"
    );
}

/// A host slice must have its device buffer's length to be copied in or out of it.
pub(crate) fn check_host_len(device: usize, host: usize) -> Result<()> {
    if device == host {
        Ok(())
    } else {
        Err(BackendError::LengthMismatch { device, host })
    }
}

/// A length or dimension as the `u32` that GPU kernels index with.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub(crate) fn dim(v: usize) -> u32 {
    u32::try_from(v).expect("tensor dimension over 2^32 values")
}

impl AdamWUpdate {
    /// The bias corrections `1 - beta1^t` and `1 - beta2^t` of this step.
    pub fn bias_corrections(&self) -> (f32, f32) {
        let t = self.step.min(i32::MAX as u64) as i32;
        (1.0 - self.beta1.powi(t), 1.0 - self.beta2.powi(t))
    }
}

/// A compute device that can run every operation of a GPT stage.
///
/// Shapes are passed explicitly; implementations check buffer lengths against them and treat a
/// mismatch as a programming error (panic), never as data-dependent behaviour.
pub trait Backend: Send + Sync + 'static {
    /// A device buffer of `f32` values.
    type Buffer: Send + Sync + 'static;
    /// A device buffer of token ids.
    type Tokens: Send + Sync + 'static;

    /// Human-readable name, e.g. `cpu (2 threads)`.
    fn name(&self) -> String;

    /// A zero-filled buffer of `len` values.
    fn alloc(&self, len: usize) -> Result<Self::Buffer>;
    /// A buffer holding a copy of `host`.
    fn upload(&self, host: &[f32]) -> Result<Self::Buffer>;
    /// Overwrites `buf` with `host` (same length).
    fn write(&self, buf: &mut Self::Buffer, host: &[f32]) -> Result<()>;
    /// Copies `buf` into `host` (same length).
    fn download(&self, buf: &Self::Buffer, host: &mut [f32]) -> Result<()>;
    /// Token ids on the device.
    fn upload_tokens(&self, tokens: &[u32]) -> Result<Self::Tokens>;
    /// Number of values in `buf`.
    fn len(&self, buf: &Self::Buffer) -> usize;

    /// Sets every value of `buf` to `value`.
    fn fill(&self, buf: &mut Self::Buffer, value: f32) -> Result<()>;
    /// `dst = src` (same length).
    fn copy(&self, dst: &mut Self::Buffer, src: &Self::Buffer) -> Result<()>;
    /// `acc += x` (same length).
    fn add_assign(&self, acc: &mut Self::Buffer, x: &Self::Buffer) -> Result<()>;
    /// Sum of squares of all values, accumulated in f64.
    fn sum_squares(&self, buf: &Self::Buffer) -> Result<f64>;

    /// `out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]` for `tokens` of shape `(batch, seq)`.
    fn embedding_forward(
        &self,
        out: &mut Self::Buffer,
        tokens: &Self::Tokens,
        wte: &Self::Buffer,
        wpe: &Self::Buffer,
        batch: usize,
        seq: usize,
        width: usize,
    ) -> Result<()>;
    /// Accumulates the embedding gradients: `dwte[tok] += dout`, `dwpe[t] += dout`.
    fn embedding_backward(
        &self,
        dwte: &mut Self::Buffer,
        dwpe: &mut Self::Buffer,
        dout: &Self::Buffer,
        tokens: &Self::Tokens,
        batch: usize,
        seq: usize,
        width: usize,
    ) -> Result<()>;

    /// LayerNorm over each row (eps 1e-5); saves each row's mean and 1/std for backward.
    fn layernorm_forward(
        &self,
        out: &mut Self::Buffer,
        mean: &mut Self::Buffer,
        rstd: &mut Self::Buffer,
        inp: &Self::Buffer,
        weight: &Self::Buffer,
        bias: &Self::Buffer,
        shape: RowShape,
    ) -> Result<()>;
    /// LayerNorm backward: **adds** to `dinp`, accumulates `dweight` and `dbias`.
    fn layernorm_backward(
        &self,
        dinp: &mut Self::Buffer,
        dweight: &mut Self::Buffer,
        dbias: &mut Self::Buffer,
        dout: &Self::Buffer,
        inp: &Self::Buffer,
        weight: &Self::Buffer,
        mean: &Self::Buffer,
        rstd: &Self::Buffer,
        shape: RowShape,
    ) -> Result<()>;

    /// `out = inp · weightᵀ (+ bias)`.
    fn matmul_forward(
        &self,
        out: &mut Self::Buffer,
        inp: &Self::Buffer,
        weight: &Self::Buffer,
        bias: Option<&Self::Buffer>,
        shape: MatmulShape,
    ) -> Result<()>;
    /// `dinp = dout · weight` (overwritten), `dweight += doutᵀ · inp`, `dbias += Σ_rows dout`.
    fn matmul_backward(
        &self,
        dinp: &mut Self::Buffer,
        dweight: &mut Self::Buffer,
        dbias: Option<&mut Self::Buffer>,
        dout: &Self::Buffer,
        inp: &Self::Buffer,
        weight: &Self::Buffer,
        shape: MatmulShape,
    ) -> Result<()>;

    /// Causal self-attention. `qkv` is `(batch, seq, 3·width)` (queries, keys, values), `out`
    /// is `(batch, seq, width)`; the softmax probabilities are saved in `probs`.
    fn attention_forward(
        &self,
        out: &mut Self::Buffer,
        probs: &mut Self::Buffer,
        qkv: &Self::Buffer,
        shape: AttentionShape,
    ) -> Result<()>;
    /// Attention backward: writes `dqkv`; `scratch` has the size of `probs`.
    fn attention_backward(
        &self,
        dqkv: &mut Self::Buffer,
        scratch: &mut Self::Buffer,
        dout: &Self::Buffer,
        qkv: &Self::Buffer,
        probs: &Self::Buffer,
        shape: AttentionShape,
    ) -> Result<()>;

    /// GELU, tanh approximation.
    fn gelu_forward(&self, out: &mut Self::Buffer, inp: &Self::Buffer) -> Result<()>;
    /// `dinp = gelu'(inp) · dout`.
    fn gelu_backward(
        &self,
        dinp: &mut Self::Buffer,
        inp: &Self::Buffer,
        dout: &Self::Buffer,
    ) -> Result<()>;
    /// `out = a + b`.
    fn residual_forward(
        &self,
        out: &mut Self::Buffer,
        a: &Self::Buffer,
        b: &Self::Buffer,
    ) -> Result<()>;

    /// Softmax of each row of `logits` in place (they become probabilities) and
    /// `losses[i] = -ln p[i, targets[i]]`.
    fn softmax_cross_entropy_forward(
        &self,
        logits: &mut Self::Buffer,
        losses: &mut Self::Buffer,
        targets: &Self::Tokens,
        shape: RowShape,
    ) -> Result<()>;
    /// Turns probabilities into logit gradients in place: `d = (p - onehot) · scale`.
    fn softmax_cross_entropy_backward(
        &self,
        probs: &mut Self::Buffer,
        targets: &Self::Tokens,
        shape: RowShape,
        scale: f32,
    ) -> Result<()>;

    /// One AdamW update of `param` from `grad` and its moments.
    fn adamw(
        &self,
        param: &mut Self::Buffer,
        grad: &Self::Buffer,
        m: &mut Self::Buffer,
        v: &mut Self::Buffer,
        update: &AdamWUpdate,
    ) -> Result<()>;
}
