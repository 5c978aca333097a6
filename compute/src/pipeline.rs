//! All stages of a model in one process: the reference for what the swarm computes, and the
//! engine of `shoal train`.

use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::data::Batch;
use crate::optim::{AdamW, LrSchedule};
use crate::stage::{MicrobatchShape, Stage, StageError, StageInput, StageOutput, StageSpec};
use std::sync::Arc;

/// What happens to tensors in transit between stages (activations forward, their gradients
/// backward) and between replicas (parameter gradients). In one process nothing happens; a
/// test or benchmark can apply a codec round trip to see what compression does to training.
pub trait Transit {
    /// Activations leaving stage `from` for stage `from + 1`.
    fn activations(&mut self, _from: usize, _values: &mut Vec<f32>) {}
    /// Activation gradients leaving stage `from` for stage `from - 1`.
    fn activation_grads(&mut self, _from: usize, _values: &mut Vec<f32>) {}
    /// Whether [`Transit::param_grads`] changes anything (it costs a download and upload).
    fn touches_param_grads(&self) -> bool {
        false
    }
    /// The accumulated parameter gradients of `stage` before the optimizer step, as they would
    /// be after averaging with replicas.
    fn param_grads(&mut self, _stage: usize, _values: &mut Vec<f32>) {}
}

/// Tensors arrive exactly as sent.
impl Transit for () {}

/// What one optimizer step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// Mean loss over the step's samples (before the update).
    pub loss: f32,
    /// Gradient norm over all stages before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f32,
}

/// How the stages of a cut model share an optimizer step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Coupling {
    /// One model, exactly: the tied embedding's gradient is summed over its two copies and
    /// the gradient norm is clipped over all stages.
    #[default]
    Joint,
    /// As a swarm trains it, where stages do not talk to each other at every step: each stage
    /// clips its own gradient norm and trains its own copy of the tied embedding.
    PerStage,
}

/// A model cut into stages that all run in this process, chained in order (GPipe-style: all
/// forwards, then all backwards, then one synchronous optimizer step).
pub struct LocalPipeline<B: Backend> {
    stages: Vec<Stage<B>>,
    optimizer: AdamW,
    schedule: LrSchedule,
    coupling: Coupling,
    step: u64,
}

impl<B: Backend> LocalPipeline<B> {
    /// A model of shape `config` cut into `stages` stages, all on `backend`.
    pub fn new(
        backend: Arc<B>,
        config: ModelConfig,
        stages: usize,
        seed: u64,
        optimizer: AdamW,
        schedule: LrSchedule,
    ) -> Result<Self, StageError> {
        Self::with_memory_limit(backend, config, stages, seed, optimizer, schedule, None)
    }

    /// [`LocalPipeline::new`] with each stage holding at most `limit` bytes of device memory
    /// (see [`Stage::with_memory_limit`]): what one peer's device would hold of it.
    pub fn with_memory_limit(
        backend: Arc<B>,
        config: ModelConfig,
        stages: usize,
        seed: u64,
        optimizer: AdamW,
        schedule: LrSchedule,
        limit: Option<u64>,
    ) -> Result<Self, StageError> {
        let stages = (0..stages.max(1))
            .map(|index| {
                let spec = StageSpec {
                    index,
                    count: stages,
                };
                Stage::with_memory_limit(backend.clone(), config, spec, seed, false, limit)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(LocalPipeline {
            stages,
            optimizer,
            schedule,
            coupling: Coupling::Joint,
            step: 0,
        })
    }

    /// Sets how the stages share a step (the default is [`Coupling::Joint`]).
    pub fn set_coupling(&mut self, coupling: Coupling) {
        self.coupling = coupling;
    }

    /// Activation recomputation on every stage (see [`Stage::set_recompute`]).
    pub fn set_recompute(&mut self, recompute: bool) -> Result<(), StageError> {
        for s in &mut self.stages {
            s.set_recompute(recompute)?;
        }
        Ok(())
    }

    /// The stages, first to last.
    pub fn stages(&self) -> &[Stage<B>] {
        &self.stages
    }

    /// Mutable access to the stages.
    pub fn stages_mut(&mut self) -> &mut [Stage<B>] {
        &mut self.stages
    }

    /// Optimizer steps taken.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Parameters trained (the tied embedding counted once unless each stage trains its own
    /// copy).
    pub fn param_count(&self) -> usize {
        let tied_copy = match self.stages.as_slice() {
            _ if self.coupling == Coupling::PerStage => 0,
            [_] | [] => 0,
            [.., last] => last
                .tensors()
                .find(|t| t.name == "wte")
                .map_or(0, |t| t.len),
        };
        self.stages.iter().map(|s| s.param_count()).sum::<usize>() - tied_copy
    }

    /// Forward and backward over `batch` in microbatches of `microbatch` samples, accumulating
    /// the gradient of the batch's mean loss. Returns the mean loss; does not step.
    pub fn accumulate(&mut self, batch: &Batch, microbatch: usize) -> Result<f32, StageError> {
        self.accumulate_via(batch, microbatch, &mut ())
    }

    /// [`LocalPipeline::accumulate`] with tensors passing through `transit` between stages.
    pub fn accumulate_via(
        &mut self,
        batch: &Batch,
        microbatch: usize,
        transit: &mut dyn Transit,
    ) -> Result<f32, StageError> {
        let microbatch = microbatch.clamp(1, batch.batch.max(1));
        let count = batch.batch.div_ceil(microbatch);
        let mut loss_sum = 0.0f64;
        for m in 0..count {
            let rows = (m * microbatch)..((m + 1) * microbatch).min(batch.batch);
            let shape = MicrobatchShape {
                batch: rows.len(),
                seq: batch.seq,
            };
            let tokens = &batch.inputs[rows.start * batch.seq..rows.end * batch.seq];
            let targets = &batch.targets[rows.start * batch.seq..rows.end * batch.seq];
            let weight = rows.len() as f32 / batch.batch as f32;
            let id = m as u64;
            let mut acts = Vec::new();
            for (i, stage) in self.stages.iter_mut().enumerate() {
                let input = if i == 0 {
                    StageInput::Tokens(tokens)
                } else {
                    StageInput::Activations(&acts)
                };
                match stage.forward(id, shape, input, Some(targets))? {
                    StageOutput::Activations(a) => {
                        acts = a;
                        transit.activations(i, &mut acts);
                    }
                    StageOutput::Loss(l) => loss_sum += l as f64 * weight as f64,
                }
            }
            let mut grad: Option<Vec<f32>> = None;
            for (i, stage) in self.stages.iter_mut().enumerate().rev() {
                grad = stage.backward(id, grad.as_deref(), weight)?;
                if let Some(g) = grad.as_mut() {
                    transit.activation_grads(i, g);
                }
            }
        }
        Ok(loss_sum as f32)
    }

    /// Sums the tied embedding's gradient across the first and last stage (both copies then
    /// hold the full gradient) and returns the global gradient norm.
    pub fn reduce_grads(&mut self) -> Result<f64, StageError> {
        if self.stages.len() > 1 {
            let n = self.stages.len();
            let first = self.stages[0].tied_embedding_grad()?;
            let last = self.stages[n - 1].tied_embedding_grad()?;
            if let (Some(mut a), Some(b)) = (first, last) {
                a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
                self.stages[0].set_tied_embedding_grad(&a)?;
                self.stages[n - 1].set_tied_embedding_grad(&a)?;
            }
        }
        let mut total = 0.0;
        for s in &self.stages {
            total += s.grad_sum_squares(false)?;
        }
        Ok(total.sqrt())
    }

    /// One optimizer step on `batch`: accumulate, reduce, clip, AdamW, zero the gradients.
    pub fn train_step(
        &mut self,
        batch: &Batch,
        microbatch: usize,
    ) -> Result<StepStats, StageError> {
        self.train_step_via(batch, microbatch, &mut ())
    }

    /// [`LocalPipeline::train_step`] with tensors passing through `transit`.
    pub fn train_step_via(
        &mut self,
        batch: &Batch,
        microbatch: usize,
        transit: &mut dyn Transit,
    ) -> Result<StepStats, StageError> {
        let loss = self.accumulate_via(batch, microbatch, transit)?;
        if transit.touches_param_grads() {
            for (i, s) in self.stages.iter_mut().enumerate() {
                let mut g = s.download_grads()?;
                transit.param_grads(i, &mut g);
                s.upload_grads(&g)?;
            }
        }
        self.apply_step(loss)
    }

    /// The optimizer step on the gradients the stages hold (accumulated here, or uploaded, as
    /// replicas do with their averaged gradients): reduce, clip, AdamW, zero the gradients.
    /// `loss` is reported as the step's.
    pub fn apply_step(&mut self, loss: f32) -> Result<StepStats, StageError> {
        let lr = self.schedule.lr(self.step);
        let grad_norm = match self.coupling {
            Coupling::Joint => {
                let grad_norm = self.reduce_grads()?;
                let scale = self.optimizer.clip_scale(grad_norm);
                for s in &mut self.stages {
                    s.apply_optimizer(&self.optimizer, lr, scale)?;
                }
                grad_norm
            }
            Coupling::PerStage => {
                let mut total = 0.0;
                for s in &mut self.stages {
                    let squares = s.grad_sum_squares(true)?;
                    total += squares;
                    let scale = self.optimizer.clip_scale(squares.sqrt());
                    s.apply_optimizer(&self.optimizer, lr, scale)?;
                }
                total.sqrt()
            }
        };
        for s in &mut self.stages {
            s.zero_grads()?;
        }
        self.step += 1;
        Ok(StepStats {
            loss,
            grad_norm,
            lr,
        })
    }

    /// Mean loss on `batch` without touching gradients (forward only).
    pub fn evaluate(&mut self, batch: &Batch) -> Result<f32, StageError> {
        self.evaluate_via(batch, &mut ())
    }

    /// [`LocalPipeline::evaluate`] with activations passing through `transit` (the parts of a
    /// boundary code that belong to the model, such as a subspace code's projection).
    pub fn evaluate_via(
        &mut self,
        batch: &Batch,
        transit: &mut dyn Transit,
    ) -> Result<f32, StageError> {
        let shape = MicrobatchShape {
            batch: batch.batch,
            seq: batch.seq,
        };
        let id = u64::MAX;
        let mut acts = Vec::new();
        let mut loss = f32::NAN;
        for (i, stage) in self.stages.iter_mut().enumerate() {
            let input = if i == 0 {
                StageInput::Tokens(&batch.inputs)
            } else {
                StageInput::Activations(&acts)
            };
            match stage.forward(id, shape, input, Some(&batch.targets))? {
                StageOutput::Activations(a) => {
                    acts = a;
                    transit.activations(i, &mut acts);
                }
                StageOutput::Loss(l) => loss = l,
            }
        }
        for stage in &mut self.stages {
            stage.discard(id);
        }
        Ok(loss)
    }
}
