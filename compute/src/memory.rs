//! Device memory a stage holds, by kind.
//!
//! Every device buffer of a model is allocated by its [`crate::Stage`], so the stage accounts
//! for them as it allocates and frees them, the same way on every backend: what is counted is
//! the buffers the model holds, not what a driver reserves around them (a CUDA context, the
//! allocator's pools, wgpu's staging buffers).

use serde::{Deserialize, Serialize};

/// Bytes of device memory by what they hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryUse {
    /// The stage's parameters.
    pub parameters: u64,
    /// Their gradients, accumulated over microbatches.
    pub gradients: u64,
    /// AdamW's two moments.
    pub optimizer: u64,
    /// What forward passes keep for their backward passes (in flight, and the buffers kept for
    /// the next microbatch of the same shape), token ids and targets included.
    pub activations: u64,
    /// Buffers reused by every backward pass (gradients of activations within the stage).
    pub workspace: u64,
}

impl MemoryUse {
    /// All kinds together.
    pub fn total(&self) -> u64 {
        self.parameters + self.gradients + self.optimizer + self.activations + self.workspace
    }
}

/// What a stage holds now and the most it has held.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageMemory {
    /// Held now.
    pub now: MemoryUse,
    /// Held when the total was highest (the high-water mark, by kind at that moment).
    pub peak: MemoryUse,
}

impl StageMemory {
    /// Accounts for a change in what is held now.
    pub(crate) fn set(&mut self, now: MemoryUse) {
        self.now = now;
        if now.total() > self.peak.total() {
            self.peak = now;
        }
    }
}

/// Total memory of this machine (Linux: `MemTotal` of /proc/meminfo), where it can be read:
/// the CPU backend's device memory.
pub fn host_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
