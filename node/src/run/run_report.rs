//! What a swarm peer reports on exit (`shoal run --report`).

use serde::Serialize;
use std::collections::BTreeMap;

/// The JSON report written on exit.
#[derive(Debug, Serialize)]
pub(super) struct RunReport {
    pub(super) run_id: String,
    pub(super) peer_id: String,
    /// The compute backend this peer ran its stage on.
    pub(super) backend: String,
    pub(super) preset: String,
    pub(super) sync: String,
    pub(super) stage: Option<u32>,
    pub(super) stages: u32,
    pub(super) steps: u64,
    pub(super) rounds: u64,
    pub(super) params_hash: Option<String>,
    pub(super) resumed_from_step: Option<u64>,
    pub(super) microbatches_done: u64,
    pub(super) microbatches_retried: u64,
    pub(super) microbatches_dropped: u64,
    pub(super) rounds_degraded: u64,
    pub(super) state_transfers: u64,
    /// Bytes of state downloaded, duplicates and chunks of abandoned versions included.
    pub(super) state_bytes_received: u64,
    /// Downloads that started over because no source of their version was left.
    pub(super) state_restarts: u64,
    pub(super) moves: u64,
    /// Messages dropped as protocol violations (each sender and kind is logged once).
    pub(super) violations: u64,
    /// The violations by sender and kind: `[peer id, kind, count]`.
    pub(super) violations_by_kind: Vec<(String, String, u64)>,
    /// Peers this peer banned: `[peer id, reason]`, in the order banned.
    pub(super) banned: Vec<(String, String)>,
    /// Mean loss of the last steps this peer saw as the last stage.
    pub(super) final_loss: Option<f64>,
    pub(super) loss_curve: Vec<(u64, f64)>,
    /// `[stage, sample]` of every microbatch (by its first sample) whose gradient this peer
    /// applied: over all replicas of a stage, no sample may appear twice.
    pub(super) committed_samples: Vec<(u32, u64)>,
    /// Tokens of the microbatches this stage committed.
    pub(super) tokens: u64,
    pub(super) tokens_per_s: f64,
    pub(super) seconds: f64,
    pub(super) bytes_sent: BTreeMap<String, u64>,
    pub(super) bytes_received: BTreeMap<String, u64>,
    /// Activations and activation gradients sent, by the codec chosen for their hop.
    pub(super) boundary_codecs: BTreeMap<String, u64>,
    pub(super) stage_history: Vec<u32>,
    /// Samples averaged in each step this peer took.
    pub(super) step_samples: Vec<f64>,
    /// The most device memory a stage of this peer held, bytes (the stages it served
    /// counted one at a time).
    pub(super) device_memory_peak_bytes: u64,
    /// The device memory limit a stage was held under, its blocks offloaded to host memory
    /// where they did not fit (`--memory-limit`, or a device that could not hold the stage);
    /// absent if none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) memory_limit_bytes: Option<u64>,
    /// Bytes those blocks moved between host and device (the most one stage replica moved).
    pub(super) offloaded_bytes: u64,
}
