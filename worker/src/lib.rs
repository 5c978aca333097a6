//! shoal-worker: the compute side of a peer. It runs the protocol's compute jobs
//! (`shoal_protocol::swarm::Job`) on a stage replica (`shoal_compute::replica::StageReplica`)
//! and tells the protocol what it needs to know of the model's stages ([`stage_costs`]).
//!
//! The node runs it on a thread with a real clock; the simulator runs it inline and takes the
//! job's duration from a device profile. Both execute the very same jobs on the very same
//! replica code, so a simulated loss curve is a real one. This crate makes no protocol
//! decision and does no IO: it answers each job with its result.

use shoal_compute::replica::StageReplica;
use shoal_compute::stage::{MicrobatchShape, StageInput, StageOutput};
use shoal_compute::{
    AdamW, Backend, Corpus, CpuBackend, LrSchedule, ModelConfig, Preset, Residency, StageSpec,
};
use shoal_protocol::swarm::{ComputeDone, Input, Job, Output, RunConfig, StageCosts, Timing};
use std::sync::Arc;

/// The model a run trains.
pub fn model_of(config: &RunConfig) -> Result<ModelConfig, String> {
    let preset: Preset = config
        .preset
        .parse()
        .map_err(|e| format!("the run uses an unknown preset: {e}"))?;
    let model = preset.config();
    match config.data.vocab() {
        // A model's vocabulary follows its data's tokenizer.
        Some(vocab) if (1..=65536).contains(&vocab) => Ok(ModelConfig { vocab, ..model }),
        Some(vocab) => Err(format!("the run's data has a vocabulary of {vocab}")),
        None => Ok(model),
    }
}

fn specs(config: &RunConfig) -> Vec<StageSpec> {
    (0..config.stages as usize)
        .map(|index| StageSpec {
            index,
            count: config.stages as usize,
        })
        .collect()
}

/// The tokens and next-token targets of `rows` samples from `index` on, drawn with `seed`,
/// as a driver reads them.
pub fn read_samples(
    corpus: &Corpus,
    seed: u64,
    config: &RunConfig,
    index: u64,
    rows: u32,
) -> (Vec<u32>, Vec<u32>) {
    let seq = config.seq as usize;
    let mut inputs = Vec::with_capacity(rows as usize * seq);
    let mut targets = Vec::with_capacity(rows as usize * seq);
    let mut sample = vec![0u32; seq + 1];
    for r in 0..u64::from(rows) {
        corpus.sample(seed, index.wrapping_add(r), &mut sample);
        inputs.extend_from_slice(&sample[..seq]);
        targets.extend_from_slice(&sample[1..]);
    }
    (inputs, targets)
}

/// What the protocol needs to know of the model's stages.
pub fn stage_costs(config: &RunConfig, model: &ModelConfig, timing: &Timing) -> StageCosts {
    let seq = config.seq as usize;
    // A replica holds at most one pipeline's worth of microbatches awaiting their backward
    // pass from each driver it serves; budget for the drivers' window over all stages.
    let in_flight = (timing.in_flight_per_stage * config.stages) as usize;
    StageCosts {
        flops_per_sample: specs(config)
            .iter()
            .map(|s| s.train_flops_per_sample(model, seq))
            .collect(),
        params: specs(config).iter().map(|s| s.param_count(model)).collect(),
        activation_values: seq * model.width,
        memory: specs(config)
            .iter()
            .map(|s| s.train_memory_bytes(model, config.microbatch as usize, seq, in_flight))
            .collect(),
        offload_memory: specs(config)
            .iter()
            .map(|s| {
                let held = Residency {
                    offload: true,
                    ..Residency::default()
                };
                s.device_memory_bytes(model, config.microbatch as usize, seq, in_flight, held)
            })
            .collect(),
        microbatch_memory: specs(config)
            .iter()
            .map(|s| {
                let rows = config.microbatch as usize;
                // The backward pass's workspace comes with the first microbatch only.
                let held = Residency::default();
                s.device_memory_bytes(model, rows, seq, 2, held)
                    - s.device_memory_bytes(model, rows, seq, 1, held)
            })
            .collect(),
        param_scale: 1,
    }
}

/// Host memory a replica of the run's largest stage keeps when its blocks are offloaded:
/// AdamW's moments, the DiLoCo anchor and outer momentum, and the blocks' parameters and
/// gradients, six fp32 copies (the embeddings' are fewer; counted all the same).
pub fn offloaded_host_bytes(config: &RunConfig, model: &ModelConfig) -> u64 {
    let largest = specs(config)
        .iter()
        .map(|s| s.param_count(model) as u64)
        .max()
        .unwrap_or(0);
    24 * largest
}

/// A stage's initial parameters in its storage order, e.g. read from a model file.
pub type InitialParams<B> = Box<dyn Fn(&StageReplica<B>) -> Result<Vec<f32>, String> + Send>;

/// The seed of held-out samples is the run's plus this, so that no run trains on them.
pub const HELD_OUT_SEED: u64 = 0x0004_e1d0;

/// Runs one peer's compute jobs. Checkpoint jobs are the owner's (they write files) and are
/// answered `Done` here.
pub struct StageWorker<B: Backend = CpuBackend> {
    config: RunConfig,
    model: ModelConfig,
    backend: Arc<B>,
    corpus: Option<Corpus>,
    /// Where held-out samples come from (None: the training data, drawn with another seed).
    held_out: Option<Corpus>,
    /// The parameters a stage built fresh starts from (None: the run's seed).
    initial: Option<InitialParams<B>>,
    replica: Option<StageReplica<B>>,
    /// Stages recompute activations in the backward pass (see [`Stage::set_recompute`]).
    recompute: bool,
    /// The device memory a stage may hold (see [`StageWorker::set_memory_limit`]).
    memory_limit: Option<u64>,
    /// The device's memory and the microbatches a stage holds at once, where stages that do
    /// not fit it are offloaded (see [`StageWorker::set_device_memory`]).
    device_memory: Option<(u64, usize)>,
}

impl<B: Backend> StageWorker<B> {
    /// A worker for `config` on `backend`; `corpus` is the run's data (None: this peer cannot
    /// drive microbatches).
    pub fn new(config: RunConfig, backend: Arc<B>, corpus: Option<Corpus>) -> Result<Self, String> {
        let model = model_of(&config)?;
        Ok(StageWorker {
            config,
            model,
            backend,
            corpus,
            held_out: None,
            initial: None,
            replica: None,
            recompute: false,
            memory_limit: None,
            device_memory: None,
        })
    }

    /// Held-out samples are read from `corpus` (the run's held-out data) rather than drawn
    /// from the training data.
    pub fn set_held_out(&mut self, corpus: Option<Corpus>) {
        self.held_out = corpus;
    }

    /// Every stage built fresh from now on starts from these parameters rather than the
    /// seed's (`shoal run --init`).
    pub fn set_initial(&mut self, initial: InitialParams<B>) {
        self.initial = Some(initial);
    }

    /// Every stage built from now on recomputes activations in the backward pass rather than
    /// keep them (`shoal run --recompute`).
    pub fn set_recompute(&mut self, recompute: bool) {
        self.recompute = recompute;
    }

    /// Every stage built from now on holds at most `bytes` of device memory, keeping its
    /// blocks in host memory where they do not fit (see `Stage::with_memory_limit`):
    /// `shoal run --memory-limit`, or a device that cannot hold the stage the swarm gave it.
    pub fn set_memory_limit(&mut self, bytes: Option<u64>) {
        self.memory_limit = bytes;
    }

    /// A stage built from now on that would not fit `bytes` of device memory with
    /// `in_flight` microbatches awaiting their backward pass is held under that limit, its
    /// blocks offloaded to host memory; one that fits keeps everything on the device.
    pub fn set_device_memory(&mut self, bytes: u64, in_flight: usize) {
        self.device_memory = Some((bytes, in_flight));
    }

    /// A fresh replica of `stage`, initialised from the run's seed.
    pub fn build(&self, stage: u32) -> Result<StageReplica<B>, String> {
        let spec = StageSpec {
            index: stage as usize,
            count: self.config.stages as usize,
        };
        let schedule = LrSchedule::for_steps(self.config.lr, self.config.max_steps);
        let limit = self.memory_limit.or_else(|| {
            let (memory, in_flight) = self.device_memory?;
            let held = Residency {
                recompute: self.recompute,
                moments_on_host: true,
                offload: false,
            };
            let (rows, seq) = (self.config.microbatch as usize, self.config.seq as usize);
            let need = spec.device_memory_bytes(&self.model, rows, seq, in_flight, held);
            (need > memory).then_some(memory)
        });
        let mut r = StageReplica::with_memory_limit(
            self.backend.clone(),
            self.model,
            spec,
            self.config.seed,
            AdamW::default(),
            schedule,
            limit,
        )
        .map_err(err)?;
        r.set_recompute(self.recompute).map_err(err)?;
        Ok(r)
    }

    /// Installs `stage` restored from an exported state; returns its parameter hash.
    pub fn restore(&mut self, stage: u32, state: &[u8]) -> Result<u64, String> {
        let mut r = self.build(stage)?;
        r.import_state(state)
            .map_err(|e| format!("the saved state does not fit this run's stage: {e}"))?;
        let hash = r.param_hash().map_err(err)?;
        self.replica = Some(r);
        Ok(hash)
    }

    /// The replica served now, if any.
    pub fn replica(&self) -> Option<&StageReplica<B>> {
        self.replica.as_ref()
    }

    fn serving(&mut self) -> Result<&mut StageReplica<B>, String> {
        self.replica.as_mut().ok_or_else(|| "no stage yet".into())
    }

    /// Runs `job`; a failure is reported to the protocol as `ComputeDone::Failed`.
    pub fn run(&mut self, job: Job) -> ComputeDone {
        self.try_run(job)
            .unwrap_or_else(|error| ComputeDone::Failed { error })
    }

    fn try_run(&mut self, job: Job) -> Result<ComputeDone, String> {
        Ok(match job {
            Job::Init { stage } => {
                let mut r = self.build(stage)?;
                if let Some(initial) = &self.initial {
                    r.start_from(&initial(&r)?).map_err(err)?;
                }
                let hash = r.param_hash().map_err(err)?;
                self.replica = Some(r);
                ComputeDone::Ready { hash }
            }
            Job::Restart { stage } => {
                let held = self
                    .replica
                    .as_ref()
                    .filter(|r| r.spec().index == stage as usize);
                match held.map(|r| r.export_state()).transpose().map_err(err)? {
                    Some(state) => ComputeDone::Ready {
                        hash: self.restore(stage, &state)?,
                    },
                    None => return self.try_run(Job::Init { stage }),
                }
            }
            Job::Import { stage, state } => ComputeDone::Ready {
                hash: self.restore(stage, &state)?,
            },
            Job::Forward {
                id,
                rows,
                sample,
                input,
                held_out,
            } => {
                let shape = MicrobatchShape {
                    batch: rows as usize,
                    seq: self.config.seq as usize,
                };
                let last = self.serving()?.spec().is_last();
                // The data is read only where it is needed: inputs at the first stage,
                // targets at the last.
                let (inputs, targets) = match (&input, last) {
                    (Input::Activations(_), false) => (Vec::new(), None),
                    _ => {
                        let (corpus, seed) = match (held_out, &self.held_out) {
                            (false, _) => (self.corpus.as_ref(), self.config.seed),
                            (true, Some(c)) => (Some(c), self.config.seed),
                            (true, None) => (
                                self.corpus.as_ref(),
                                self.config.seed.wrapping_add(HELD_OUT_SEED),
                            ),
                        };
                        let corpus = corpus.ok_or("no data on this peer")?;
                        let (inputs, targets) =
                            read_samples(corpus, seed, &self.config, sample, rows);
                        (inputs, last.then_some(targets))
                    }
                };
                let stage_input = match &input {
                    Input::Tokens => StageInput::Tokens(&inputs),
                    Input::Activations(acts) => StageInput::Activations(acts),
                };
                let replica = self.serving()?;
                let out = if held_out {
                    replica.evaluate(id, shape, stage_input, targets.as_deref())
                } else {
                    replica.forward(id, shape, stage_input, targets.as_deref())
                };
                ComputeDone::Forward {
                    id,
                    output: output(out.map_err(err)?),
                }
            }
            Job::Backward { id, grad, rows } => {
                let replica = self.serving()?;
                let grad = replica
                    .backward(id, grad.as_deref(), rows as f32)
                    .map_err(err)?;
                ComputeDone::Backward { id, grad }
            }
            Job::Commit { id } => {
                self.serving()?.commit(id);
                ComputeDone::Done
            }
            Job::Abort { id } => {
                if let Some(r) = self.replica.as_mut() {
                    r.abort(id);
                }
                ComputeDone::Done
            }
            Job::TakeGradient => {
                let r = self.serving()?;
                let (mut values, samples) = r.take_gradient();
                if values.is_empty() {
                    values = vec![0.0; r.param_count()];
                }
                ComputeDone::Gradient { values, samples }
            }
            Job::TakePseudoGradient => ComputeDone::Gradient {
                values: self.serving()?.pseudo_gradient().map_err(err)?,
                samples: 0.0,
            },
            Job::Step { grad } => {
                let r = self.serving()?;
                ComputeDone::Stepped {
                    hash: r.apply_step(&grad).map_err(err)?,
                    alignments: r.take_alignments(),
                }
            }
            Job::LocalStep => {
                let r = self.serving()?;
                let (mut g, samples) = r.take_gradient();
                if g.is_empty() {
                    g = vec![0.0; r.param_count()];
                }
                let scale = 1.0 / samples.max(1.0) as f32;
                g.iter_mut().for_each(|v| *v *= scale);
                // A local step is this replica's own: nothing of the stage to judge by.
                ComputeDone::Stepped {
                    hash: r.apply_step(&g).map_err(err)?,
                    alignments: Vec::new(),
                }
            }
            Job::OuterStep { avg, lr, momentum } => ComputeDone::Stepped {
                hash: self
                    .serving()?
                    .apply_outer_step(&avg, lr, momentum)
                    .map_err(err)?,
                alignments: Vec::new(),
            },
            Job::Export { to } => ComputeDone::State {
                to,
                bytes: self.serving()?.export_state().map_err(err)?,
            },
            Job::Checkpoint { .. } => ComputeDone::Done,
        })
    }
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

fn output(out: StageOutput) -> Output {
    match out {
        StageOutput::Activations(a) => Output::Activations(a),
        StageOutput::Loss(l) => Output::Loss(l),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_protocol::swarm::SyncMode;

    fn config() -> RunConfig {
        RunConfig {
            preset: "nano".into(),
            stages: 2,
            global_batch: 4,
            microbatch: 2,
            seq: 16,
            sync: SyncMode::AllReduce,
            lr: 1e-3,
            max_steps: 10,
            codecs: shoal_protocol::TrafficCodecs::default(),
            data: shoal_protocol::swarm::DataSource::Synthetic,
            seed: 5,
            init: None,
            evaluation: Default::default(),
        }
    }

    /// A replica that restarts its stage keeps what it trained (its parameters, step and
    /// hash); restarting a stage it does not hold builds that one from the seed.
    #[test]
    fn a_restart_keeps_the_state_held() {
        let backend = Arc::new(CpuBackend::new(1).unwrap());
        let mut w = StageWorker::new(config(), backend, None).unwrap();
        let ready = |done: ComputeDone| match done {
            ComputeDone::Ready { hash } => hash,
            other => panic!("{other:?}"),
        };
        let fresh = ready(w.run(Job::Init { stage: 1 }));
        let n = w.replica().unwrap().param_count();
        let stepped = match w.run(Job::Step { grad: vec![0.5; n] }) {
            ComputeDone::Stepped { hash, .. } => hash,
            other => panic!("{other:?}"),
        };
        assert_ne!(stepped, fresh);
        assert_eq!(ready(w.run(Job::Restart { stage: 1 })), stepped);
        assert_eq!(w.replica().unwrap().step(), 1);
        let other = ready(w.run(Job::Restart { stage: 0 }));
        assert_eq!(ready(w.run(Job::Init { stage: 0 })), other);
    }

    /// A stage built fresh takes the run's initial parameters; a held-out forward pass reads
    /// held-out samples (not the training ones) and keeps nothing for a backward pass.
    #[test]
    fn a_fresh_stage_starts_from_the_initial_parameters_and_held_out_passes_keep_nothing() {
        let backend = Arc::new(CpuBackend::new(1).unwrap());
        let mut w = StageWorker::new(config(), backend, Some(Corpus::synthetic(5))).unwrap();
        let seeded = w.build(0).unwrap().stage().download_params().unwrap();
        let doubled: Vec<f32> = seeded.iter().map(|x| 2.0 * x).collect();
        let given = doubled.clone();
        w.set_initial(Box::new(move |_| Ok(given.clone())));
        w.run(Job::Init { stage: 0 });
        let r = w.replica().unwrap();
        assert!(r.stage().download_params().unwrap() == doubled);
        let forward = |id, held_out| Job::Forward {
            id,
            rows: 2,
            sample: 0,
            input: Input::Tokens,
            held_out,
        };
        let acts = |done| match done {
            ComputeDone::Forward {
                output: Output::Activations(a),
                ..
            } => a,
            other => panic!("{other:?}"),
        };
        let w2 = &mut w;
        let training = acts(w2.run(forward(1, false)));
        let held_out = acts(w2.run(forward(2, true)));
        assert!(
            training != held_out,
            "sample 0 of the held-out data is another text"
        );
        assert_eq!(
            w.replica().unwrap().in_flight(),
            1,
            "only the training pass waits"
        );
    }
}
