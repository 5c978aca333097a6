//! Optimizer settings: AdamW with decoupled weight decay, a warmup + cosine learning-rate
//! schedule and global gradient-norm clipping. The update itself runs on the backend
//! ([`crate::Backend::adamw`]), or on the host for a swarm replica
//! ([`crate::StageReplica::apply_step`]).

use crate::backend::AdamWUpdate;
use serde::{Deserialize, Serialize};

/// AdamW hyper-parameters (GPT-2/nanoGPT defaults).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamW {
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled weight decay, applied to matrices and embeddings only.
    pub weight_decay: f32,
    /// Clip the global gradient norm to this value (0 disables clipping).
    pub grad_clip: f32,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_clip: 1.0,
        }
    }
}

impl AdamW {
    /// The update of one tensor at 1-based optimizer step `step`: learning rate `lr`, weight
    /// decay if the tensor `decays`, gradients multiplied by `grad_scale` first.
    pub fn update(&self, lr: f32, decays: bool, step: u64, grad_scale: f32) -> AdamWUpdate {
        AdamWUpdate {
            lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: if decays { self.weight_decay } else { 0.0 },
            step,
            grad_scale,
        }
    }

    /// The factor to multiply gradients by so their global norm is at most `grad_clip`.
    pub fn clip_scale(&self, grad_norm: f64) -> f32 {
        if self.grad_clip > 0.0 && grad_norm > self.grad_clip as f64 {
            (self.grad_clip as f64 / grad_norm) as f32
        } else {
            1.0
        }
    }
}

/// Linear warmup to `max_lr`, then cosine decay to `min_lr` at `total_steps`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    /// Peak learning rate.
    pub max_lr: f32,
    /// Final learning rate.
    pub min_lr: f32,
    /// Steps of linear warmup.
    pub warmup_steps: u64,
    /// Step at which the cosine reaches `min_lr` (and stays there).
    pub total_steps: u64,
}

impl LrSchedule {
    /// The schedule used when nothing else is specified: peak `max_lr`, floor a tenth of it,
    /// warmup over the first 5% of steps (at least one).
    pub fn for_steps(max_lr: f32, total_steps: u64) -> Self {
        LrSchedule {
            max_lr,
            min_lr: max_lr / 10.0,
            warmup_steps: (total_steps / 20).max(1),
            total_steps,
        }
    }

    /// Learning rate of 0-based step `step`.
    pub fn lr(&self, step: u64) -> f32 {
        if step < self.warmup_steps {
            return self.max_lr * (step + 1) as f32 / self.warmup_steps as f32;
        }
        if step >= self.total_steps {
            return self.min_lr;
        }
        let span = (self.total_steps - self.warmup_steps).max(1) as f64;
        let progress = (step - self.warmup_steps) as f64 / span;
        let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.min_lr + (self.max_lr - self.min_lr) * cosine as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_the_floor() {
        let s = LrSchedule {
            max_lr: 1.0,
            min_lr: 0.1,
            warmup_steps: 10,
            total_steps: 110,
        };
        assert!((s.lr(0) - 0.1).abs() < 1e-6);
        assert!((s.lr(9) - 1.0).abs() < 1e-6);
        assert!((s.lr(10) - 1.0).abs() < 1e-6);
        assert!((s.lr(60) - 0.55).abs() < 1e-6);
        assert!((s.lr(110) - 0.1).abs() < 1e-6);
        assert!((s.lr(1000) - 0.1).abs() < 1e-6);
        for step in 10..110 {
            assert!(s.lr(step + 1) <= s.lr(step));
        }
    }

    #[test]
    fn clipping_only_shrinks() {
        let o = AdamW::default();
        assert_eq!(o.clip_scale(0.5), 1.0);
        assert!((o.clip_scale(4.0) - 0.25).abs() < 1e-7);
    }
}
