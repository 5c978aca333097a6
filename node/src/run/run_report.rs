//! What a swarm peer reports (`shoal run --report`): every `--report-every` seconds while it
//! runs, so a peer that crashes leaves one, and on exit.

use super::compute::MemoryTally;
use super::{Tally, committed_tokens, peer_id};
use libp2p::PeerId;
use serde::Serialize;
use shoal_protocol::swarm::message::Traffic;
use shoal_protocol::swarm::{Peer, PeerKey, Resume, RunConfig};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::time::Instant;

/// The JSON report.
#[derive(Debug, Serialize)]
pub(super) struct RunReport {
    /// `running` (a report written on the way), `done` (the run reached its last step),
    /// `stopped` (SIGINT or SIGTERM) or `gave up` (`--stall-timeout`).
    pub(super) status: &'static str,
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
    /// Stage-mates whose averaging weight this peer lowered because their shares claimed more
    /// samples than their witnesses saw them commit: `[peer id, credit]` (the lowest told).
    pub(super) discounted: Vec<(String, f64)>,
    /// Mean loss of the last steps this peer saw as the last stage.
    pub(super) final_loss: Option<f64>,
    pub(super) loss_curve: Vec<(u64, f64)>,
    /// `[step, held-out loss]` of the run's model: every `--eval-every` steps and at the last,
    /// one first-stage replica evaluates it through the pipeline and announces the result.
    pub(super) val_curve: Vec<(u64, f64)>,
    /// The held-out loss of the run's last step, if it was evaluated.
    pub(super) held_out_loss: Option<f64>,
    /// `[seconds, tokens]` after each step: the tokens this stage had committed by then.
    pub(super) tokens_curve: Vec<(f64, u64)>,
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

/// What a report says that does not change while the peer runs.
pub(super) struct ReportContext {
    pub(super) run_id: String,
    pub(super) peer_id: String,
    pub(super) backend: String,
    pub(super) config: RunConfig,
    pub(super) resume: Option<Resume>,
    pub(super) start: Instant,
    pub(super) memory: std::sync::Arc<MemoryTally>,
}

impl RunReport {
    /// The report as things stand.
    pub(super) fn new(
        status: &'static str,
        ctx: &ReportContext,
        peer: &Peer,
        tally: &Tally,
        ids: &HashMap<PeerKey, PeerId>,
    ) -> RunReport {
        let config = &ctx.config;
        let seconds = ctx.start.elapsed().as_secs_f64();
        let stats = peer.stats();
        let tokens = committed_tokens(peer);
        let names = |m: &BTreeMap<Traffic, u64>| {
            Traffic::ALL
                .iter()
                .map(|t| (t.name().to_string(), m.get(t).copied().unwrap_or(0)))
                .collect::<BTreeMap<_, _>>()
        };
        let memory = &ctx.memory;
        RunReport {
            status,
            run_id: ctx.run_id.clone(),
            peer_id: ctx.peer_id.clone(),
            backend: ctx.backend.clone(),
            preset: config.preset.clone(),
            sync: config.sync.to_string(),
            stage: peer.stage(),
            stages: config.stages,
            steps: peer.step(),
            rounds: peer.round(),
            params_hash: peer.params_hash().map(|h| format!("{h:016x}")),
            resumed_from_step: ctx.resume.map(|r| r.step),
            microbatches_done: stats.microbatches_done,
            microbatches_retried: stats.microbatches_retried,
            microbatches_dropped: stats.microbatches_dropped,
            rounds_degraded: stats.rounds_degraded,
            state_transfers: stats.state_transfers,
            state_bytes_received: stats.state_bytes_received,
            state_restarts: stats.state_restarts,
            moves: stats.moves,
            violations: stats.violations,
            violations_by_kind: tally
                .violations
                .iter()
                .map(|((from, what), n)| (peer_id(ids, *from), what.to_string(), *n))
                .collect(),
            banned: tally.banned.clone(),
            discounted: (tally.discounted.iter())
                .map(|(k, c)| (k.clone(), *c))
                .collect(),
            final_loss: tally.final_loss(),
            loss_curve: tally.loss_curve.clone(),
            val_curve: tally.val_curve.clone(),
            held_out_loss: tally
                .val_curve
                .last()
                .filter(|(step, _)| *step == config.max_steps)
                .map(|(_, loss)| *loss),
            tokens_curve: tally.tokens_curve.clone(),
            committed_samples: tally.committed.clone(),
            tokens,
            tokens_per_s: tokens as f64 / seconds.max(1e-9),
            seconds,
            bytes_sent: names(&tally.bytes_sent),
            bytes_received: names(&tally.bytes_received),
            boundary_codecs: tally.boundary_codecs.clone(),
            stage_history: tally.stage_history.clone(),
            step_samples: tally.step_samples.clone(),
            device_memory_peak_bytes: memory.peak.load(Ordering::Relaxed),
            memory_limit_bytes: Some(memory.limit.load(Ordering::Relaxed)).filter(|l| *l > 0),
            offloaded_bytes: memory.offloaded.load(Ordering::Relaxed),
        }
    }
}
