//! A stage's tensors seen whole: as flat vectors in storage order (what the swarm averages,
//! transfers and checkpoints), their gradients' norm and the tied embedding's gradient, and
//! AdamW's step, on the device or, under a memory limit, on the host.

use super::chunks::Kind;
use super::tensors::TensorInfo;
use super::{Moments, Stage, StageError};
use crate::backend::{Backend, BackendError, kernels};
use crate::optim::AdamW;

/// Runs `step` on a tensor held on the device with its gradient, on the host.
fn step_edge_on_host<B: Backend>(
    b: &B,
    p: &mut B::Buffer,
    g: &B::Buffer,
    step: impl FnOnce(&mut [f32], &[f32]),
) -> Result<(), BackendError> {
    let len = b.len(p);
    let (mut hp, mut hg) = (vec![0.0; len], vec![0.0; len]);
    b.download(p, &mut hp)?;
    b.download(g, &mut hg)?;
    step(&mut hp, &hg);
    b.write(p, &hp)
}

impl<B: Backend> Stage<B> {
    /// Sets all parameter gradients to zero.
    pub fn zero_grads(&mut self) -> Result<(), StageError> {
        for g in self.grads.iter_mut() {
            self.backend.fill(g, 0.0)?;
        }
        self.blocks.zero_grads(&*self.backend)?;
        Ok(())
    }

    /// Sum of squared gradients of this stage. With `count_tied_copy == false` a tied
    /// embedding copy held by the last stage of a cut model is left out, so that summing over
    /// all stages counts the tied matrix once.
    pub fn grad_sum_squares(&self, count_tied_copy: bool) -> Result<f64, StageError> {
        let skip_wte = !count_tied_copy && self.holds_tied_copy() && !self.spec.is_first();
        let b = &*self.backend;
        let mut total = 0.0;
        for (info, g) in self.info.front().zip(self.grads.front()) {
            if skip_wte && info.name == "wte" {
                continue;
            }
            total += b.sum_squares(g)?;
        }
        for i in 0..self.info.blocks.len() {
            for s in self.blocks.grad_sum_squares(b, i)? {
                total += s;
            }
        }
        for g in self.grads.back() {
            total += b.sum_squares(g)?;
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
    /// `grad_scale` first (clipping): on the device, or on the host under a memory limit.
    pub fn apply_optimizer(
        &mut self,
        opt: &AdamW,
        lr: f32,
        grad_scale: f32,
    ) -> Result<(), StageError> {
        let step = self.optimizer_steps + 1;
        let b = &*self.backend;
        match &mut self.moments {
            Moments::Caller => {
                return Err(StageError::BadInput {
                    stage: self.spec.index,
                    reason: "this stage's optimizer steps on the host".into(),
                });
            }
            Moments::Device(adam_m, adam_v) => {
                let update = |info: &TensorInfo| opt.update(lr, info.decay, step, grad_scale);
                let front = self.info.front().zip(self.params.front_mut());
                let front = front.zip(self.grads.front());
                let front = front.zip(adam_m.front_mut().zip(adam_v.front_mut()));
                for (((info, p), g), (m, v)) in front {
                    b.adamw(p, g, m, v, &update(info))?;
                }
                for (i, (m, v)) in adam_m.blocks.iter_mut().zip(&mut adam_v.blocks).enumerate() {
                    let (p, g) = self.blocks.on_device(i);
                    let tensors = self.info.blocks[i].iter().into_iter().zip(p.iter_mut());
                    let tensors = tensors
                        .zip(g.iter())
                        .zip(m.iter_mut().into_iter().zip(v.iter_mut()));
                    for (((info, p), g), (m, v)) in tensors {
                        b.adamw(p, g, m, v, &update(info))?;
                    }
                }
                let back = self.info.back().zip(self.params.back_mut());
                let back = back.zip(self.grads.back());
                let back = back.zip(adam_m.back_mut().zip(adam_v.back_mut()));
                for (((info, p), g), (m, v)) in back {
                    b.adamw(p, g, m, v, &update(info))?;
                }
            }
            Moments::Host(adam_m, adam_v) => {
                // The host kernel is the CPU backend's, so the step is the device's, bit for
                // bit, there.
                let host_step = |info: &TensorInfo, p: &mut [f32], g: &[f32], at: usize| {
                    let update = opt.update(lr, info.decay, step, grad_scale);
                    let (bc1, bc2) = update.bias_corrections();
                    let r = at..at + info.len;
                    kernels::adamw(
                        p,
                        g,
                        &mut adam_m[r.clone()],
                        &mut adam_v[r],
                        &update,
                        bc1,
                        bc2,
                    );
                };
                let mut host_step = host_step;
                let mut at = 0;
                let front = self
                    .info
                    .front()
                    .zip(self.params.front_mut())
                    .zip(self.grads.front());
                for ((info, p), g) in front {
                    step_edge_on_host(b, p, g, |p, g| host_step(info, p, g, at))?;
                    at += info.len;
                }
                for i in 0..self.info.blocks.len() {
                    let infos = self.info.blocks[i].iter();
                    self.blocks
                        .step_on_host(b, i, |j, r, p, g| host_step(infos[j], p, g, at + r.start))?;
                    at += infos.iter().map(|i| i.len).sum::<usize>();
                }
                let back = self
                    .info
                    .back()
                    .zip(self.params.back_mut())
                    .zip(self.grads.back());
                for ((info, p), g) in back {
                    step_edge_on_host(b, p, g, |p, g| host_step(info, p, g, at))?;
                    at += info.len;
                }
            }
        }
        self.optimizer_steps = step;
        Ok(())
    }
    /// All parameters in storage order, concatenated.
    pub fn download_params(&self) -> Result<Vec<f32>, StageError> {
        self.download_all(Kind::Params)
    }

    /// All parameter gradients in storage order, concatenated.
    pub fn download_grads(&self) -> Result<Vec<f32>, StageError> {
        self.download_all(Kind::Grads)
    }

    /// Each parameter gradient with its tensor's global name.
    pub fn named_grads(&self) -> Result<Vec<(String, Vec<f32>)>, StageError> {
        let all = self.download_grads()?;
        let mut at = 0;
        Ok(self
            .info
            .iter()
            .map(|info| {
                at += info.len;
                (info.name.clone(), all[at - info.len..at].to_vec())
            })
            .collect())
    }

    /// Overwrites all parameters from a concatenation in storage order.
    pub fn upload_params(&mut self, values: &[f32]) -> Result<(), StageError> {
        self.upload_all(Kind::Params, values)
    }

    /// Overwrites all parameter gradients from a concatenation in storage order (e.g. after
    /// averaging them with other replicas).
    pub fn upload_grads(&mut self, values: &[f32]) -> Result<(), StageError> {
        self.upload_all(Kind::Grads, values)
    }

    /// Sets the optimizer's step count where the step runs on the host (see
    /// [`Stage::new_stepped_on_host`]).
    pub fn set_optimizer_steps(&mut self, steps: u64) {
        self.optimizer_steps = steps;
    }

    /// Where each part of a flat vector in storage order lies: the embeddings, each block,
    /// the final norm.
    fn flat_parts(&self) -> (usize, Vec<usize>) {
        let front = self.info.front().map(|i| i.len).sum();
        let blocks = self.info.blocks.iter();
        let blocks = blocks
            .map(|b| b.iter().iter().map(|i| i.len).sum())
            .collect();
        (front, blocks)
    }

    fn download_all(&self, kind: Kind) -> Result<Vec<f32>, StageError> {
        let b = &*self.backend;
        let edges = match kind {
            Kind::Params => &self.params,
            Kind::Grads => &self.grads,
        };
        let mut out = vec![0.0; self.param_count()];
        let (front, blocks) = self.flat_parts();
        let mut at = 0;
        for (buf, info) in edges.front().zip(self.info.front()) {
            b.download(buf, &mut out[at..at + info.len])?;
            at += info.len;
        }
        debug_assert_eq!(at, front);
        for (i, len) in blocks.into_iter().enumerate() {
            self.blocks.read(b, i, kind, &mut out[at..at + len])?;
            at += len;
        }
        for (buf, info) in edges.back().zip(self.info.back()) {
            b.download(buf, &mut out[at..at + info.len])?;
            at += info.len;
        }
        Ok(out)
    }

    fn upload_all(&mut self, kind: Kind, values: &[f32]) -> Result<(), StageError> {
        let total = self.param_count();
        if values.len() != total {
            return Err(self.bad_input(format!("{} values, expected {total}", values.len())));
        }
        let b = &*self.backend;
        let (_, blocks) = self.flat_parts();
        let edges = match kind {
            Kind::Params => &mut self.params,
            Kind::Grads => &mut self.grads,
        };
        let mut at = 0;
        for (buf, info) in edges.front_mut().zip(self.info.front()) {
            b.write(buf, &values[at..at + info.len])?;
            at += info.len;
        }
        for (i, len) in blocks.into_iter().enumerate() {
            self.blocks.write(b, i, kind, &values[at..at + len])?;
            at += len;
        }
        for (buf, info) in edges.back_mut().zip(self.info.back()) {
            b.write(buf, &values[at..at + info.len])?;
            at += info.len;
        }
        Ok(())
    }
}
