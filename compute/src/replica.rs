//! One pipeline stage as served by one peer of a swarm: a [`Stage`] with its optimizer,
//! learning-rate schedule and the bookkeeping a swarm needs on top of plain accumulation.
//!
//! In a swarm several replicas of a stage train side by side and a microbatch may be computed
//! twice (a retry after a peer looked dead). So a microbatch's parameter gradient is held
//! *pending* after its backward pass and reaches the step's accumulator only once the swarm
//! commits it; a replica whose copy lost the race aborts it. Each replica keeps its own copy of
//! the tied embedding untrained by the other end of the pipeline: the first and last stage
//! start from equal matrices and then train them independently.
//!
//! The replica also keeps what DiLoCo needs (the parameters at the start of the outer round and
//! the outer Nesterov momentum), and can write its whole state as bytes for a joining peer or a
//! checkpoint.

use crate::backend::{Backend, kernels};
use crate::config::ModelConfig;
use crate::optim::{AdamW, LrSchedule};
use crate::stage::{
    MicrobatchId, MicrobatchShape, Stage, StageError, StageInput, StageOutput, StageSpec,
};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use thiserror::Error;
use xxhash_rust::xxh3::{Xxh3Default, xxh3_64};

/// First bytes of an exported replica state.
const STATE_MAGIC: [u8; 8] = *b"SHOALSTG";
/// Layout version of the exported state; bump on any change to the layout.
const STATE_VERSION: u32 = 1;
/// Magic, version, flags, then nine u64 fields (see [`StageReplica::export_state`]).
const STATE_HEADER_LEN: usize = 8 + 4 + 4 + 9 * 8;
/// The xxh3-64 of everything before it.
const STATE_TRAILER_LEN: usize = 8;
/// Flag bit: the state carries an outer momentum section.
const FLAG_OUTER_MOMENTUM: u32 = 1;

/// Why a replica state could not be imported.
#[derive(Debug, Error)]
pub enum ReplicaError {
    /// The device or the stage failed.
    #[error(transparent)]
    Stage(#[from] StageError),
    /// The bytes are not a well-formed replica state (truncated, corrupted or not one at all).
    #[error("malformed replica state: {0}")]
    Malformed(String),
    /// A replica state written by a layout this build does not know.
    #[error("replica state has layout version {0}, this build reads version {STATE_VERSION}")]
    UnsupportedVersion(u32),
    /// A well-formed state of another stage or another model.
    #[error("replica state does not fit this replica: {0}")]
    Mismatch(String),
}

/// A microbatch gradient that awaits the swarm's decision.
struct Pending {
    grad: Vec<f32>,
    samples: f32,
}

/// One pipeline stage as served by one peer of a swarm (see the module docs).
pub struct StageReplica<B: Backend> {
    stage: Stage<B>,
    optimizer: AdamW,
    schedule: LrSchedule,
    pending: HashMap<MicrobatchId, Pending>,
    /// Ids committed into the current accumulator: a second forward under one of them would be
    /// the one way left to apply a microbatch twice.
    committed: HashSet<MicrobatchId>,
    /// Sum of committed gradients; empty while nothing is committed, so an idle replica does
    /// not hold a parameter-sized buffer of zeros and the first commit costs no addition.
    accumulator: Vec<f32>,
    accumulated_samples: f64,
    /// AdamW's moments: the step runs on the host (see [`StageReplica::apply_step`]), so they
    /// live there and the device holds parameters and gradients only.
    adam_m: Vec<f32>,
    adam_v: Vec<f32>,
    /// Parameters at the start of the current DiLoCo outer round.
    anchor: Vec<f32>,
    /// DiLoCo outer momentum; empty until the first outer step (it is zero until then).
    outer_momentum: Vec<f32>,
    /// A sketch (every [`sketch_stride`]-th value) of each microbatch gradient committed or
    /// dropped since the accumulator was last taken (at most [`MAX_JUDGED`]): what the step the
    /// accumulator goes into is compared with (see [`StageReplica::take_alignments`]). A sample
    /// of the values, so that it costs little memory on large stages.
    sketches: Vec<(MicrobatchId, Vec<f32>)>,
    /// The sketches of the gradient taken last, waiting for the step it goes into.
    taken_sketches: Vec<(MicrobatchId, Vec<f32>)>,
    /// How well each microbatch of the last step pointed along it.
    alignments: Vec<(MicrobatchId, f64)>,
}

/// Values of a microbatch's gradient that [`StageReplica::take_alignments`] compares, at
/// most: enough that the cosine over them is the cosine over all to a few hundredths.
const SKETCH_VALUES: usize = 1 << 16;

/// Microbatches of one step judged at most (a sketch of 256 KiB each); later ones are not.
const MAX_JUDGED: usize = 256;

/// The stride of the sample of a stage's `params` values that
/// [`StageReplica::take_alignments`] compares.
fn sketch_stride(params: usize) -> usize {
    params.div_ceil(SKETCH_VALUES).max(1)
}

/// The cosine of two vectors (None if either is zero or the result not finite).
fn cosine(a: &[f32], b: &[f32]) -> Option<f64> {
    let (mut ab, mut aa, mut bb) = (0.0f64, 0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x), f64::from(y));
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    let norms = (aa * bb).sqrt();
    (norms > 0.0 && norms.is_finite()).then(|| ab / norms)
}

impl<B: Backend> StageReplica<B> {
    /// Fresh stage from the seed (identical on every replica given the same seed); the anchor
    /// of the first outer round is the initial parameters.
    pub fn new(
        backend: Arc<B>,
        config: ModelConfig,
        spec: StageSpec,
        seed: u64,
        optimizer: AdamW,
        schedule: LrSchedule,
    ) -> Result<Self, StageError> {
        Self::with_memory_limit(backend, config, spec, seed, optimizer, schedule, None)
    }

    /// [`StageReplica::new`] holding at most `limit` bytes of device memory, its blocks in
    /// host memory where they do not fit (see [`Stage::with_memory_limit`]).
    pub fn with_memory_limit(
        backend: Arc<B>,
        config: ModelConfig,
        spec: StageSpec,
        seed: u64,
        optimizer: AdamW,
        schedule: LrSchedule,
        limit: Option<u64>,
    ) -> Result<Self, StageError> {
        let stage = Stage::with_memory_limit(backend, config, spec, seed, true, limit)?;
        let anchor = stage.download_params()?;
        Ok(StageReplica {
            adam_m: vec![0.0; anchor.len()],
            adam_v: vec![0.0; anchor.len()],
            stage,
            optimizer,
            schedule,
            pending: HashMap::new(),
            committed: HashSet::new(),
            accumulator: Vec::new(),
            accumulated_samples: 0.0,
            anchor,
            outer_momentum: Vec::new(),
            sketches: Vec::new(),
            taken_sketches: Vec::new(),
            alignments: Vec::new(),
        })
    }

    /// Replaces a fresh replica's initial parameters (e.g. by a pretrained model's): the
    /// first outer round's anchor follows. Refused once the replica has trained, where the
    /// optimizer's moments would no longer match the parameters.
    pub fn start_from(&mut self, params: &[f32]) -> Result<(), StageError> {
        if self.step() > 0 || !self.accumulator.is_empty() || !self.pending.is_empty() {
            return Err(StageError::BadInput {
                stage: self.spec().index,
                reason: "only a fresh replica takes initial parameters".into(),
            });
        }
        self.check_len(params.len())?;
        self.stage.upload_params(params)?;
        self.anchor = self.stage.download_params()?;
        Ok(())
    }

    /// Activation recomputation (see [`Stage::set_recompute`]).
    pub fn set_recompute(&mut self, recompute: bool) -> Result<(), StageError> {
        self.stage.set_recompute(recompute)
    }

    /// Which stage this replica serves.
    pub fn spec(&self) -> StageSpec {
        self.stage.spec()
    }

    /// The underlying stage, read-only: mutating it behind the replica's back would break the
    /// pending/commit accounting.
    pub fn stage(&self) -> &Stage<B> {
        &self.stage
    }

    /// Number of parameters of this stage (the length of every flat vector it takes or gives).
    pub fn param_count(&self) -> usize {
        self.stage.param_count()
    }

    /// Optimizer steps taken.
    pub fn step(&self) -> u64 {
        self.stage.optimizer_steps()
    }

    /// Forward of microbatch `id` (unique per attempt). The first stage takes tokens, the last
    /// needs `targets` and returns the loss, as [`Stage::forward`]. An id that is pending or
    /// already committed into the current accumulator is refused, so it cannot count twice.
    pub fn forward(
        &mut self,
        id: MicrobatchId,
        shape: MicrobatchShape,
        input: StageInput<'_>,
        targets: Option<&[u32]>,
    ) -> Result<StageOutput, StageError> {
        if self.pending.contains_key(&id) || self.committed.contains(&id) {
            return Err(StageError::DuplicateMicrobatch(id));
        }
        self.stage.forward(id, shape, input, targets)
    }

    /// Forward of held-out microbatch `id`, keeping nothing for a backward pass: what an
    /// evaluation of the model runs.
    pub fn evaluate(
        &mut self,
        id: MicrobatchId,
        shape: MicrobatchShape,
        input: StageInput<'_>,
        targets: Option<&[u32]>,
    ) -> Result<StageOutput, StageError> {
        let out = self.forward(id, shape, input, targets)?;
        self.stage.discard(id);
        Ok(out)
    }

    /// Backward of `id`. Its parameter gradient is held pending until [`StageReplica::commit`]
    /// adds it to the accumulator or [`StageReplica::abort`] drops it. `loss_scale` as in
    /// [`Stage::backward`]; the swarm passes the microbatch's sample count, so the accumulator
    /// holds a sum over samples of per-sample-mean gradients. Returns the gradient of the stage
    /// input (`None` on the first stage).
    pub fn backward(
        &mut self,
        id: MicrobatchId,
        grad_output: Option<&[f32]>,
        loss_scale: f32,
    ) -> Result<Option<Vec<f32>>, StageError> {
        // The stage's gradient buffers serve as scratch for one microbatch at a time; what
        // accumulates is on the host, where it can still be dropped.
        self.stage.zero_grads()?;
        let input_grad = self.stage.backward(id, grad_output, loss_scale)?;
        let grad = self.stage.download_grads()?;
        self.pending.insert(
            id,
            Pending {
                grad,
                samples: loss_scale,
            },
        );
        Ok(input_grad)
    }

    /// Adds the pending gradient of `id` to the accumulator. Returns whether it was pending
    /// (false for an unknown, aborted or already committed id, which changes nothing).
    pub fn commit(&mut self, id: MicrobatchId) -> bool {
        let Some(p) = self.pending.remove(&id) else {
            return false;
        };
        self.keep_sketch(id, &p.grad);
        if self.accumulator.is_empty() {
            self.accumulator = p.grad;
        } else {
            self.accumulator
                .iter_mut()
                .zip(&p.grad)
                .for_each(|(a, g)| *a += g);
        }
        self.accumulated_samples += p.samples as f64;
        self.committed.insert(id);
        true
    }

    /// Drops microbatch `id`: its pending gradient, or its saved activations if its forward
    /// ran but not its backward. Returns whether there was anything to drop.
    pub fn abort(&mut self, id: MicrobatchId) -> bool {
        let dropped = self.pending.remove(&id);
        if let Some(p) = &dropped {
            self.keep_sketch(id, &p.grad);
        }
        let dropped_grad = dropped.is_some();
        let dropped_acts = self.stage.discard(id);
        dropped_grad || dropped_acts
    }

    /// Keeps a sketch of a microbatch's gradient, to be judged by the next step.
    fn keep_sketch(&mut self, id: MicrobatchId, grad: &[f32]) {
        if self.sketches.len() < MAX_JUDGED {
            let stride = sketch_stride(grad.len());
            let sketch = grad.iter().step_by(stride).copied().collect();
            self.sketches.push((id, sketch));
        }
    }

    /// How well each microbatch of the step taken last pointed along that step: the cosine
    /// of its gradient with the step's (on a sample of the values), for the microbatches whose
    /// gradients were committed into the gradient taken before it, or dropped while it was
    /// collected (a gradient thrown away is judged too: the replica it came from must be able
    /// to show it is in line again). Empty until a step is taken, and after this call.
    ///
    /// In allreduce mode the step is the stage's robust mean of the same step's gradients,
    /// so an honest microbatch points along it, whichever way the last step went; one whose
    /// activation gradients a later hop sent negated points the other way. The device cannot
    /// tell who sent them; the swarm, which routed the microbatch, can.
    pub fn take_alignments(&mut self) -> Vec<(MicrobatchId, f64)> {
        std::mem::take(&mut self.alignments)
    }

    /// Microbatches whose gradient awaits commit or abort.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Microbatches whose forward ran but not yet their backward.
    pub fn in_flight(&self) -> usize {
        self.stage.in_flight()
    }

    /// Samples covered by the accumulator (sum of the `loss_scale` of committed microbatches).
    pub fn accumulated_samples(&self) -> f64 {
        self.accumulated_samples
    }

    /// Takes the sum of committed gradients, flat in storage order (as
    /// [`Stage::download_params`]), and the number of samples it covers, leaving the
    /// accumulator empty. Pending gradients stay pending.
    pub fn take_gradient(&mut self) -> (Vec<f32>, f64) {
        let mut grad = std::mem::take(&mut self.accumulator);
        if grad.is_empty() {
            grad = vec![0.0; self.param_count()];
        }
        self.committed.clear();
        self.taken_sketches = std::mem::take(&mut self.sketches);
        (grad, std::mem::take(&mut self.accumulated_samples))
    }

    /// One optimizer step with `grad`, already the mean over the step's samples: clipped by
    /// this stage's own gradient norm (replicas of one stage see the same averaged gradient,
    /// so they clip alike without talking to other stages), learning rate from the schedule at
    /// the current step, AdamW. Returns the parameter hash after the step.
    ///
    /// The step runs on the host, in one fixed order of f32 operations, whatever the backend:
    /// replicas on different backends (a GPU's fused multiply-adds and reduction order differ
    /// from the CPU's) then take bit-identical steps from identical inputs, so their parameter
    /// hashes keep agreeing. AdamW's moments live on the host for it; a step costs a download
    /// and an upload of the parameters, less than the averaging traffic a step carries.
    ///
    /// Gradients still pending were computed on the old parameters; the caller decides
    /// whether they may still be committed.
    pub fn apply_step(&mut self, grad: &[f32]) -> Result<u64, StageError> {
        self.check_len(grad.len())?;
        let stride = sketch_stride(grad.len());
        let direction: Vec<f32> = grad.iter().step_by(stride).copied().collect();
        self.alignments = std::mem::take(&mut self.taken_sketches)
            .into_iter()
            .filter_map(|(id, sketch)| Some((id, cosine(&sketch, &direction)?)))
            .collect();
        let grad_norm = grad
            .iter()
            .map(|g| *g as f64 * *g as f64)
            .sum::<f64>()
            .sqrt();
        // A NaN norm would not clip (NaN > clip is false) and AdamW would write NaN into
        // every parameter: a step with a value that is not finite is refused whole.
        self.check_finite(grad_norm, "gradient")?;
        let step = self.stage.optimizer_steps();
        let lr = self.schedule.lr(step);
        let scale = self.optimizer.clip_scale(grad_norm);
        let mut params = self.stage.download_params()?;
        let (m, v) = (&mut self.adam_m, &mut self.adam_v);
        let mut at = 0;
        for info in self.stage.tensors() {
            let range = at..at + info.len;
            at += info.len;
            let update = self.optimizer.update(lr, info.decay, step + 1, scale);
            let (bc1, bc2) = update.bias_corrections();
            kernels::adamw(
                &mut params[range.clone()],
                &grad[range.clone()],
                &mut m[range.clone()],
                &mut v[range],
                &update,
                bc1,
                bc2,
            );
        }
        self.stage.upload_params(&params)?;
        self.stage.set_optimizer_steps(step + 1);
        Ok(hash_f32s(&params))
    }

    /// DiLoCo pseudo-gradient of the current outer round: anchor minus current parameters.
    pub fn pseudo_gradient(&self) -> Result<Vec<f32>, StageError> {
        let mut pg = self.stage.download_params()?;
        pg.iter_mut()
            .zip(&self.anchor)
            .for_each(|(p, a)| *p = a - *p);
        Ok(pg)
    }

    /// DiLoCo outer step with Nesterov momentum, from the pseudo-gradient averaged over the
    /// replicas: `momentum = mu * momentum + avg`, `anchor -= outer_lr * (avg + mu *
    /// momentum)`, and the parameters restart the next round from the new anchor. AdamW's
    /// moments carry over, as in DiLoCo. Returns the parameter hash.
    pub fn apply_outer_step(
        &mut self,
        avg_pseudo_grad: &[f32],
        outer_lr: f32,
        mu: f32,
    ) -> Result<u64, StageError> {
        self.check_len(avg_pseudo_grad.len())?;
        let norm = avg_pseudo_grad
            .iter()
            .map(|g| *g as f64 * *g as f64)
            .sum::<f64>();
        self.check_finite(norm, "pseudo-gradient")?;
        if self.outer_momentum.is_empty() {
            self.outer_momentum = vec![0.0; self.anchor.len()];
        }
        for ((a, m), g) in self
            .anchor
            .iter_mut()
            .zip(self.outer_momentum.iter_mut())
            .zip(avg_pseudo_grad)
        {
            *m = mu * *m + g;
            *a -= outer_lr * (g + mu * *m);
        }
        self.stage.upload_params(&self.anchor)?;
        Ok(hash_f32s(&self.anchor))
    }

    /// xxh3-64 of the parameters' little-endian bytes, in storage order: replicas that agree
    /// on it hold bit-identical parameters.
    pub fn param_hash(&self) -> Result<u64, StageError> {
        Ok(hash_f32s(&self.stage.download_params()?))
    }

    /// Whether every parameter and optimizer value this replica holds is finite.
    pub fn all_finite(&self) -> Result<bool, StageError> {
        let params = self.stage.download_params()?;
        Ok([
            &params,
            &self.adam_m,
            &self.adam_v,
            &self.anchor,
            &self.outer_momentum,
        ]
        .iter()
        .all(|s| s.iter().all(|x| x.is_finite())))
    }

    /// The whole replica state as bytes, for a joining peer or a checkpoint. Pending and
    /// accumulated gradients are not part of it: they belong to a step in progress.
    ///
    /// Layout, all little-endian: magic `SHOALSTG`; u32 version; u32 flags (bit 0: outer
    /// momentum present); u64 stage index, stage count; u64 vocab, context, width, layers,
    /// heads; u64 optimizer steps; u64 `n`, the stage's parameter count; then `n` f32 each of
    /// parameters, AdamW first moment, second moment, DiLoCo anchor and, if flagged, outer
    /// momentum; finally the xxh3-64 of all preceding bytes.
    pub fn export_state(&self) -> Result<Vec<u8>, StageError> {
        let params = self.stage.download_params()?;
        let spec = self.spec();
        let cfg = self.stage.config();
        let has_momentum = !self.outer_momentum.is_empty();
        let mut sections = vec![&params, &self.adam_m, &self.adam_v, &self.anchor];
        if has_momentum {
            sections.push(&self.outer_momentum);
        }
        let n = params.len();
        let mut out = Vec::with_capacity(state_len(n, sections.len()));
        out.extend_from_slice(&STATE_MAGIC);
        out.extend_from_slice(&STATE_VERSION.to_le_bytes());
        let flags = if has_momentum { FLAG_OUTER_MOMENTUM } else { 0 };
        out.extend_from_slice(&flags.to_le_bytes());
        for field in [
            spec.index,
            spec.count,
            cfg.vocab,
            cfg.context,
            cfg.width,
            cfg.layers,
            cfg.heads,
        ] {
            out.extend_from_slice(&(field as u64).to_le_bytes());
        }
        out.extend_from_slice(&self.stage.optimizer_steps().to_le_bytes());
        out.extend_from_slice(&(n as u64).to_le_bytes());
        for section in sections {
            for x in section {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        let checksum = xxh3_64(&out);
        out.extend_from_slice(&checksum.to_le_bytes());
        Ok(out)
    }

    /// Replaces the whole replica state with one written by [`StageReplica::export_state`] for
    /// the same stage of the same model. Everything is checked before anything is replaced;
    /// pending, in-flight and accumulated work is dropped, as it was computed on the old
    /// parameters.
    pub fn import_state(&mut self, bytes: &[u8]) -> Result<(), ReplicaError> {
        let malformed = |reason: &str| ReplicaError::Malformed(reason.to_string());
        if bytes.len() < STATE_HEADER_LEN + STATE_TRAILER_LEN {
            return Err(malformed(&format!(
                "{} bytes, shorter than the {}-byte header",
                bytes.len(),
                STATE_HEADER_LEN + STATE_TRAILER_LEN
            )));
        }
        let mut r = Reader { bytes, pos: 0 };
        if r.take(8)? != STATE_MAGIC {
            return Err(malformed("not a shoal replica state (bad magic)"));
        }
        let version = r.u32()?;
        if version != STATE_VERSION {
            return Err(ReplicaError::UnsupportedVersion(version));
        }
        let (body, trailer) = bytes.split_at(bytes.len() - STATE_TRAILER_LEN);
        let mut stored = [0u8; 8];
        stored.copy_from_slice(trailer);
        if xxh3_64(body) != u64::from_le_bytes(stored) {
            return Err(malformed("checksum mismatch (truncated or corrupted)"));
        }
        let flags = r.u32()?;
        if flags & !FLAG_OUTER_MOMENTUM != 0 {
            return Err(malformed(&format!("unknown flags {flags:#x}")));
        }
        let spec = self.spec();
        let cfg = *self.stage.config();
        let expected = [
            ("stage index", spec.index),
            ("stage count", spec.count),
            ("vocab", cfg.vocab),
            ("context", cfg.context),
            ("width", cfg.width),
            ("layers", cfg.layers),
            ("heads", cfg.heads),
        ];
        for (what, want) in expected {
            let got = r.u64()?;
            if got != want as u64 {
                return Err(ReplicaError::Mismatch(format!(
                    "{what} is {got}, this replica has {want}"
                )));
            }
        }
        let steps = r.u64()?;
        let n = self.param_count();
        let got_n = r.u64()?;
        if got_n != n as u64 {
            return Err(ReplicaError::Mismatch(format!(
                "{got_n} parameters, this stage has {n}"
            )));
        }
        // Lengths are now fixed by this replica's own model, so the size check below bounds
        // every allocation by the model's size, whatever the bytes claim.
        let sections = if flags & FLAG_OUTER_MOMENTUM != 0 {
            5
        } else {
            4
        };
        if bytes.len() != state_len(n, sections) {
            return Err(malformed(&format!(
                "{} bytes, expected {} for {n} parameters",
                bytes.len(),
                state_len(n, sections)
            )));
        }
        let params = r.f32s(n)?;
        let m = r.f32s(n)?;
        let v = r.f32s(n)?;
        let anchor = r.f32s(n)?;
        let outer_momentum = if sections == 5 {
            r.f32s(n)?
        } else {
            Vec::new()
        };
        for (what, values) in [
            ("parameters", &params),
            ("first moments", &m),
            ("second moments", &v),
            ("anchor", &anchor),
            ("outer momentum", &outer_momentum),
        ] {
            if !values.iter().all(|x| x.is_finite()) {
                return Err(malformed(&format!(
                    "its {what} hold values that are not finite"
                )));
            }
        }

        self.stage.discard_all();
        self.stage.upload_params(&params)?;
        self.stage.set_optimizer_steps(steps);
        self.adam_m = m;
        self.adam_v = v;
        self.stage.zero_grads()?;
        self.pending.clear();
        self.committed.clear();
        self.accumulator = Vec::new();
        self.accumulated_samples = 0.0;
        self.anchor = anchor;
        self.outer_momentum = outer_momentum;
        self.sketches.clear();
        self.taken_sketches.clear();
        self.alignments.clear();
        Ok(())
    }

    /// A sum of squares (or its root) over values is finite exactly when every value is
    /// finite and none is so large that its square overflows.
    fn check_finite(&self, sum_of_squares: f64, what: &str) -> Result<(), StageError> {
        if sum_of_squares.is_finite() {
            return Ok(());
        }
        Err(StageError::BadInput {
            stage: self.spec().index,
            reason: format!("the {what} holds values that are not finite"),
        })
    }

    fn check_len(&self, len: usize) -> Result<(), StageError> {
        let n = self.param_count();
        if len != n {
            return Err(StageError::BadInput {
                stage: self.spec().index,
                reason: format!("{len} values, expected {n}"),
            });
        }
        Ok(())
    }
}

/// Bytes of the state [`StageReplica::export_state`] writes for a stage of `params` parameters
/// (with the DiLoCo outer momentum once an outer step was taken).
pub fn exported_state_len(params: usize, outer_momentum: bool) -> usize {
    state_len(params, if outer_momentum { 5 } else { 4 })
}

/// Size of an exported state with `sections` parameter-sized sections of `n` values.
/// A state written by [`StageReplica::export_state`] with its parameters negated and its
/// checksum made valid again: well-formed and wrong, what a malicious peer could serve a
/// joiner (for the attack tests; see `shoal_protocol::swarm::attack`). `None` if `bytes` is
/// not such a state.
pub fn poisoned_state(bytes: &[u8]) -> Option<Vec<u8>> {
    let n_at = STATE_HEADER_LEN - 8;
    let n = u64::from_le_bytes(bytes.get(n_at..STATE_HEADER_LEN)?.try_into().ok()?) as usize;
    let params_end = STATE_HEADER_LEN.checked_add(n.checked_mul(4)?)?;
    if bytes.len() < params_end + STATE_TRAILER_LEN {
        return None;
    }
    let mut out = bytes.to_vec();
    for x in out[STATE_HEADER_LEN..params_end].chunks_exact_mut(4) {
        let v = -f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
        x.copy_from_slice(&v.to_le_bytes());
    }
    let body = out.len() - STATE_TRAILER_LEN;
    let checksum = xxh3_64(&out[..body]);
    out[body..].copy_from_slice(&checksum.to_le_bytes());
    Some(out)
}

fn state_len(n: usize, sections: usize) -> usize {
    STATE_HEADER_LEN + sections * 4 * n + STATE_TRAILER_LEN
}

/// xxh3-64 of `values` as little-endian bytes, without materialising the byte copy.
fn hash_f32s(values: &[f32]) -> u64 {
    const CHUNK: usize = 1024;
    let mut hasher = Xxh3Default::new();
    let mut buf = [0u8; 4 * CHUNK];
    for chunk in values.chunks(CHUNK) {
        for (b, x) in buf.chunks_exact_mut(4).zip(chunk) {
            b.copy_from_slice(&x.to_le_bytes());
        }
        hasher.update(&buf[..4 * chunk.len()]);
    }
    hasher.digest()
}

/// Bounds-checked little-endian reads from an exported state.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize) -> Result<&'a [u8], ReplicaError> {
        let end = self
            .pos
            .checked_add(len)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| ReplicaError::Malformed(format!("truncated at byte {}", self.pos)))?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, ReplicaError> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }

    fn u64(&mut self) -> Result<u64, ReplicaError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }

    fn f32s(&mut self, n: usize) -> Result<Vec<f32>, ReplicaError> {
        let len = n
            .checked_mul(4)
            .ok_or_else(|| ReplicaError::Malformed("section too large".into()))?;
        Ok(self
            .take(len)?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}
