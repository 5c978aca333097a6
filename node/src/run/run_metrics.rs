//! What `shoal run --metrics` exports: the peer's progress, traffic, work, averaging, state
//! transfers, misconduct and device memory, refreshed from the run loop's own counts (the
//! same numbers as the progress line and the report).

use super::compute::MemoryTally;
use super::{Tally, committed_tokens};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};
use shoal_protocol::swarm::Peer;
use shoal_protocol::swarm::message::Traffic;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

type Labels = Vec<(&'static str, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// The metrics of one peer.
pub(super) struct RunMetrics {
    step: Gauge,
    round: Gauge,
    stage: Gauge,
    loss: FloatGauge,
    held_out_loss: FloatGauge,
    held_out_step: Gauge,
    tokens: Counter,
    tokens_per_second: FloatGauge,
    traffic: Family<Labels, Counter>,
    microbatches: Family<Labels, Counter>,
    peers: Family<Labels, Gauge>,
    rounds: Counter,
    rounds_degraded: Counter,
    round_duration: Histogram,
    state_transfers: Counter,
    state_received: Counter,
    state_download_held: Gauge,
    state_download_size: Gauge,
    moves: Counter,
    violations: Family<Labels, Counter>,
    bans: Family<Labels, Counter>,
    memory_peak: Gauge,
    memory_limit: Gauge,
    offloaded: Gauge,
    /// Committed tokens over the last seconds, for the throughput gauge.
    recent: VecDeque<(Instant, u64)>,
}

/// The window of the throughput gauge.
const THROUGHPUT_WINDOW: Duration = Duration::from_secs(10);

impl RunMetrics {
    /// The metrics, registered in a new registry along with the peer's identity
    /// (`shoal_peer_info`).
    pub(super) fn new(info: Labels) -> (RunMetrics, Registry) {
        let mut r = Registry::with_prefix("shoal");
        let info_gauge: Family<Labels, Gauge> = Family::default();
        info_gauge.get_or_create(&info).set(1);
        r.register(
            "peer_info",
            "The peer: run, peer id, backend, model, version",
            info_gauge,
        );
        let m = RunMetrics {
            step: Gauge::default(),
            round: Gauge::default(),
            stage: Gauge::default(),
            loss: FloatGauge::default(),
            held_out_loss: FloatGauge::default(),
            held_out_step: Gauge::default(),
            tokens: Counter::default(),
            tokens_per_second: FloatGauge::default(),
            traffic: Family::default(),
            microbatches: Family::default(),
            peers: Family::default(),
            rounds: Counter::default(),
            rounds_degraded: Counter::default(),
            round_duration: Histogram::new(exponential_buckets(0.05, 2.0, 12)),
            state_transfers: Counter::default(),
            state_received: Counter::default(),
            state_download_held: Gauge::default(),
            state_download_size: Gauge::default(),
            moves: Counter::default(),
            violations: Family::default(),
            bans: Family::default(),
            memory_peak: Gauge::default(),
            memory_limit: Gauge::default(),
            offloaded: Gauge::default(),
            recent: VecDeque::new(),
        };
        m.stage.set(-1);
        m.loss.set(f64::NAN);
        m.held_out_loss.set(f64::NAN);
        r.register(
            "step",
            "Optimizer steps this peer's stage has taken",
            m.step.clone(),
        );
        r.register(
            "round",
            "Averaging rounds this peer's stage has closed",
            m.round.clone(),
        );
        r.register(
            "stage",
            "The stage this peer serves (-1: none yet)",
            m.stage.clone(),
        );
        r.register(
            "loss",
            "Mean loss of the last step this peer saw as the last stage (NaN before)",
            m.loss.clone(),
        );
        r.register(
            "held_out_loss",
            "Mean loss of the run's model on held-out samples at its last evaluation (NaN before)",
            m.held_out_loss.clone(),
        );
        r.register(
            "held_out_step",
            "The step of the last held-out evaluation (0 before)",
            m.held_out_step.clone(),
        );
        r.register(
            "tokens",
            "Tokens of the microbatches this peer's stage committed",
            m.tokens.clone(),
        );
        r.register(
            "throughput_tokens_per_second",
            "Tokens this peer's stage committed per second over the last 10 s",
            m.tokens_per_second.clone(),
        );
        r.register_with_unit(
            "traffic",
            "Bytes sent and received, by direction and kind (activations, activation_grads, averaging, state, control)",
            Unit::Bytes,
            m.traffic.clone(),
        );
        r.register(
            "microbatches",
            "Microbatches by outcome: committed at this stage; retried and dropped by this peer as a data driver",
            m.microbatches.clone(),
        );
        r.register(
            "stage_peers",
            "Peers serving each stage, as this peer sees the run",
            m.peers.clone(),
        );
        r.register(
            "averaging_rounds",
            "Averaging rounds completed",
            m.rounds.clone(),
        );
        r.register(
            "averaging_rounds_degraded",
            "Averaging rounds that lost a member's share or a part",
            m.rounds_degraded.clone(),
        );
        r.register_with_unit(
            "averaging_round_duration",
            "From handing over this replica's contribution to the averaged result",
            Unit::Seconds,
            m.round_duration.clone(),
        );
        r.register(
            "state_transfers",
            "State downloads completed (joins and re-syncs)",
            m.state_transfers.clone(),
        );
        r.register_with_unit(
            "state_received",
            "Bytes of state received, duplicates and abandoned versions included",
            Unit::Bytes,
            m.state_received.clone(),
        );
        r.register_with_unit(
            "state_download_held",
            "Bytes held of the state download under way (0: none)",
            Unit::Bytes,
            m.state_download_held.clone(),
        );
        r.register_with_unit(
            "state_download_size",
            "Size of the state download under way (0: none)",
            Unit::Bytes,
            m.state_download_size.clone(),
        );
        r.register(
            "stage_moves",
            "Moves of this peer to another stage",
            m.moves.clone(),
        );
        r.register(
            "protocol_violations",
            "Messages dropped as protocol violations, by kind",
            m.violations.clone(),
        );
        r.register("bans", "Peers this peer banned, by reason", m.bans.clone());
        r.register_with_unit(
            "device_memory_peak",
            "The most device memory a stage of this peer held",
            Unit::Bytes,
            m.memory_peak.clone(),
        );
        r.register_with_unit(
            "device_memory_limit",
            "The device memory limit a stage is held under (0: none)",
            Unit::Bytes,
            m.memory_limit.clone(),
        );
        r.register_with_unit(
            "offload_moved",
            "Bytes offloaded blocks moved between host and device (the most one stage moved)",
            Unit::Bytes,
            m.offloaded.clone(),
        );
        (m, r)
    }

    /// Brings every metric up to date.
    pub(super) fn refresh(&mut self, peer: &Peer, tally: &Tally, memory: &MemoryTally) {
        let stats = peer.stats();
        let gauge = |g: &Gauge, v: u64| g.set(i64::try_from(v).unwrap_or(i64::MAX));
        gauge(&self.step, peer.step());
        gauge(&self.round, peer.round());
        self.stage.set(peer.stage().map_or(-1, i64::from));
        if let Some((_, l)) = tally.loss_curve.last() {
            self.loss.set(*l);
        }
        if let Some((step, l)) = tally.val_curve.last() {
            self.held_out_loss.set(*l);
            gauge(&self.held_out_step, *step);
        }
        let tokens = committed_tokens(peer);
        raise(&self.tokens, tokens);
        let now = Instant::now();
        self.recent.push_back((now, tokens));
        while self
            .recent
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > THROUGHPUT_WINDOW)
        {
            self.recent.pop_front();
        }
        if let Some((t0, n0)) = self.recent.front() {
            let dt = now.duration_since(*t0).as_secs_f64();
            if dt > 0.0 {
                self.tokens_per_second.set((tokens - n0) as f64 / dt);
            }
        }
        for (direction, counts) in [
            ("sent", &tally.bytes_sent),
            ("received", &tally.bytes_received),
        ] {
            for t in Traffic::ALL {
                let labels = vec![
                    ("direction", direction.to_string()),
                    ("kind", t.name().to_string()),
                ];
                raise(
                    &self.traffic.get_or_create(&labels),
                    counts.get(&t).copied().unwrap_or(0),
                );
            }
        }
        for (outcome, n) in [
            ("committed", stats.microbatches_done),
            ("retried", stats.microbatches_retried),
            ("dropped", stats.microbatches_dropped),
        ] {
            raise(
                &self
                    .microbatches
                    .get_or_create(&vec![("outcome", outcome.to_string())]),
                n,
            );
        }
        for (stage, n) in peer.stage_replicas().into_iter().enumerate() {
            gauge(
                &self
                    .peers
                    .get_or_create(&vec![("stage", stage.to_string())]),
                n as u64,
            );
        }
        raise(&self.rounds, stats.rounds);
        raise(&self.rounds_degraded, stats.rounds_degraded);
        raise(&self.state_transfers, stats.state_transfers);
        raise(&self.state_received, stats.state_bytes_received);
        let (held, size) = peer.download_progress().unwrap_or((0, 0));
        gauge(&self.state_download_held, held);
        gauge(&self.state_download_size, size);
        raise(&self.moves, stats.moves);
        let mut by_kind: BTreeMap<&str, u64> = BTreeMap::new();
        for ((_, kind), n) in &tally.violations {
            *by_kind.entry(kind).or_default() += n;
        }
        for (kind, n) in by_kind {
            raise(
                &self
                    .violations
                    .get_or_create(&vec![("kind", kind.to_string())]),
                n,
            );
        }
        let mut by_reason: BTreeMap<&str, u64> = BTreeMap::new();
        for (_, why) in &tally.banned {
            *by_reason.entry(why).or_default() += 1;
        }
        for (reason, n) in by_reason {
            raise(
                &self
                    .bans
                    .get_or_create(&vec![("reason", reason.to_string())]),
                n,
            );
        }
        gauge(&self.memory_peak, memory.peak.load(Ordering::Relaxed));
        gauge(&self.memory_limit, memory.limit.load(Ordering::Relaxed));
        gauge(&self.offloaded, memory.offloaded.load(Ordering::Relaxed));
    }

    /// An averaging round took `seconds`, from this replica's contribution to the result.
    pub(super) fn averaged(&self, seconds: f64) {
        self.round_duration.observe(seconds);
    }
}

/// Raises a counter to `total` (counters only rise: a smaller total is ignored).
fn raise(counter: &Counter, total: u64) {
    let now = counter.get();
    if total > now {
        counter.inc_by(total - now);
    }
}
