//! A peer's checkpoint: its run's configuration, its stage and position, and the stage's
//! state, written atomically and checked before anything is built from it.

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use shoal_compute::write_atomic;
use shoal_protocol::swarm::RunConfig;
use shoal_worker::model_of;
use std::path::Path;

/// What a checkpoint file holds.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Checkpoint {
    pub config: RunConfig,
    pub stage: u32,
    pub step: u64,
    pub round: u64,
    #[serde(with = "serde_bytes")]
    pub state: Vec<u8>,
}

const CHECKPOINT_FILE: &str = "stage.ckpt";

pub(crate) fn load_checkpoint(dir: &Path) -> anyhow::Result<Option<Checkpoint>> {
    let path = dir.join(CHECKPOINT_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let ckpt: Checkpoint = postcard::from_bytes(&bytes)
        .with_context(|| format!("{} is not a shoal checkpoint", path.display()))?;
    ckpt.check()
        .with_context(|| format!("{} holds an invalid checkpoint", path.display()))?;
    Ok(Some(ckpt))
}

impl Checkpoint {
    /// What a file can claim is checked before anything is built from it (the state itself is
    /// checked for its size and finiteness when the stage imports it).
    fn check(&self) -> anyhow::Result<()> {
        check_run_config(&self.config)?;
        if self.stage >= self.config.stages {
            bail!(
                "stage {} of a run with {} stages",
                self.stage,
                self.config.stages
            );
        }
        if self.step > self.config.max_steps || self.round > self.step {
            bail!(
                "step {} and round {} of a run of {} steps",
                self.step,
                self.round,
                self.config.max_steps
            );
        }
        Ok(())
    }
}

/// A run's configuration from a file or a peer: valid settings, a known model, and stages
/// that split it.
pub(super) fn check_run_config(config: &RunConfig) -> anyhow::Result<()> {
    config.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    let model = model_of(config).map_err(|e| anyhow::anyhow!("{e}"))?;
    shoal_compute::StageSpec::check_pipeline(&model, config.stages as usize, config.seq as usize)
        .with_context(|| format!("{} stages of sequence length {}", config.stages, config.seq))?;
    Ok(())
}

pub(super) fn save_checkpoint(dir: &Path, ckpt: &Checkpoint) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let bytes = postcard::to_allocvec(ckpt)?;
    let path = dir.join(CHECKPOINT_FILE);
    write_atomic(&path, &bytes).with_context(|| format!("cannot write {}", path.display()))
}
