//! The compute thread of `shoal run`: it runs the protocol's jobs on the stage worker one
//! at a time, rests for the duty cycle, writes checkpoints, and keeps what the report says of
//! device memory.

use super::checkpoint::{Checkpoint, save_checkpoint};
use shoal_compute::AnyBackend;
use shoal_protocol::swarm::{ComputeDone, Job, RunConfig};
use shoal_worker::StageWorker;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;
use tokio::sync::mpsc;

/// The compute thread's state: the stage worker, and where checkpoints go.
pub(super) struct Worker {
    pub(super) stage: StageWorker<AnyBackend>,
    pub(super) config: RunConfig,
    pub(super) checkpoint_dir: Option<PathBuf>,
    /// Rest after each job for its duration times this (0: never rest; `--duty-cycle`).
    pub(super) rest_per_busy: f64,
    /// The most device memory a stage of this peer held, and the bytes its offloaded blocks
    /// moved between host and device, for the report.
    pub(super) memory: Arc<MemoryTally>,
}

/// What the report says of device memory.
#[derive(Default)]
pub(super) struct MemoryTally {
    pub(super) peak: AtomicU64,
    /// The limit a stage was held under (0: none).
    pub(super) limit: AtomicU64,
    pub(super) offloaded: AtomicU64,
}

impl Worker {
    fn run(&mut self, job: Job) -> ComputeDone {
        match job {
            Job::Checkpoint { step, round } => match self.checkpoint(step, round) {
                Ok(()) => ComputeDone::Done,
                Err(e) => ComputeDone::Failed {
                    error: format!("{e:#}"),
                },
            },
            job => {
                let done = self.stage.run(job);
                if let Some(r) = self.stage.replica() {
                    let peak = r.stage().memory().peak.total();
                    self.memory.peak.fetch_max(peak, Ordering::Relaxed);
                    let moved = r.stage().offload_traffic();
                    let moved = moved.uploaded + moved.downloaded;
                    self.memory.offloaded.fetch_max(moved, Ordering::Relaxed);
                    let limit = r.stage().memory_limit().unwrap_or(0);
                    self.memory.limit.fetch_max(limit, Ordering::Relaxed);
                }
                done
            }
        }
    }

    fn checkpoint(&mut self, step: u64, round: u64) -> anyhow::Result<()> {
        let (Some(dir), Some(r)) = (self.checkpoint_dir.clone(), self.stage.replica()) else {
            return Ok(());
        };
        let ckpt = Checkpoint {
            config: self.config.clone(),
            stage: r.spec().index as u32,
            step,
            round,
            state: r.export_state()?,
        };
        save_checkpoint(&dir, &ckpt)
    }
}

pub(super) enum WorkerMsg {
    Job(Job),
    /// Checkpoint now (shutdown) and report when written.
    Checkpoint(u64, u64, std::sync::mpsc::Sender<anyhow::Result<()>>),
}

pub(super) fn spawn_worker(
    mut worker: Worker,
    done: mpsc::UnboundedSender<ComputeDone>,
) -> std::sync::mpsc::Sender<WorkerMsg> {
    let (tx, rx) = std::sync::mpsc::channel::<WorkerMsg>();
    std::thread::Builder::new()
        .name("shoal-compute".into())
        .spawn(move || {
            while let Ok(msg) = rx.recv() {
                match msg {
                    WorkerMsg::Job(job) => {
                        let started = Instant::now();
                        let result = worker.run(job);
                        if worker.rest_per_busy > 0.0 {
                            // Resting before reporting done keeps the device idle and makes
                            // the scheduler measure the throughput this peer really gives.
                            std::thread::sleep(started.elapsed().mul_f64(worker.rest_per_busy));
                        }
                        if done.send(result).is_err() {
                            return;
                        }
                    }
                    WorkerMsg::Checkpoint(step, round, reply) => {
                        let _ = reply.send(worker.checkpoint(step, round));
                    }
                }
            }
        })
        .unwrap_or_else(|e| panic!("cannot start the compute thread: {e}"));
    tx
}
