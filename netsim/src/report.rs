//! What a simulation reports: JSON, a summary table, and the curves as an SVG image.

use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write;

/// How long the swarm took to get over a disruption.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Recovery {
    /// What happened (`crash of 4`, `partition of 2`, ...).
    pub cause: String,
    /// When, simulated seconds.
    pub at_s: f64,
    /// Seconds until every live replica had completed a step that was not complete at the
    /// disruption (None: never, within the simulation).
    pub seconds: Option<f64>,
}

/// The result of a simulation. Everything in it follows from the scenario and the seed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// Peers that took part (joiners included).
    pub peers: usize,
    /// Simulated seconds until the last step (or until the simulation gave up).
    pub sim_seconds: f64,
    /// Tokens per second if every peer's device did nothing but forward and backward passes
    /// all the time it was present: the sum over peers of its compute-only throughput (a
    /// microbatch through every stage, per-job overheads included), weighted by presence.
    pub ideal_tokens_per_s: f64,
    /// Tokens trained (committed at the last stage) per simulated second.
    pub achieved_tokens_per_s: f64,
    /// Achieved over ideal.
    pub efficiency: f64,
    /// The fraction of their time present the peers' devices were busy (any job).
    pub device_busy: f64,
    /// Optimizer steps the run took.
    pub steps: u64,
    /// Whether it reached its last step.
    pub finished: bool,
    /// `real` (the model was trained: the loss is real) or `modelled` (timing and traffic only:
    /// no loss).
    pub compute: String,
    /// Mean loss of the last 5 steps.
    pub final_loss: Option<f64>,
    /// `[sim_s, step, loss]` per step.
    pub loss_curve: Vec<(f64, u64, f64)>,
    /// `[sim_s, step, held-out loss]` per evaluation (`eval_every` in `[run]`).
    pub val_curve: Vec<(f64, u64, f64)>,
    /// `[sim_s, tokens trained so far]` per step.
    pub tokens_curve: Vec<(f64, u64)>,
    /// Device-seconds of work given to the peers serving each stage, by stage (the stage a
    /// peer served when it was given the job).
    pub stage_busy_seconds: Vec<f64>,
    /// Bytes sent, by kind of traffic (`gossip`: announcements through the gossip mesh,
    /// every copy and id advertisement; `control` holds those sent directly).
    pub bytes: BTreeMap<String, u64>,
    /// Activation and activation-gradient messages sent, by the codec their sender chose for
    /// the hop (`int8`, `int4`, ...).
    pub boundary_codecs: BTreeMap<String, u64>,
    /// Tokens trained.
    pub tokens: u64,
    /// Microbatches given up.
    pub microbatches_dropped: u64,
    /// Microbatches retried on another replica.
    pub microbatches_retried: u64,
    /// Microbatch gradients thrown away by the replicas that computed them, because the
    /// replica of the next stage whose activation gradients they came from was out of line.
    pub gradients_discarded: u64,
    /// Samples applied twice at one stage (must be 0).
    pub double_commits: u64,
    /// Replicas that re-synced after a parameter hash disagreement.
    pub resyncs: u64,
    /// State transfers refused by their receivers: the state differed from the parameters
    /// more than half of its stage announce (a poisoned state).
    pub refused_states: u64,
    /// Averaged parts the members' votes refused, counted once per honest replica that applied
    /// zero there: most members that could tell found the part pointing against their own
    /// shares (a forged part; 0 where every peer is honest).
    pub refused_parts: u64,
    /// Protocol violations the peers reported (0 where every simulated peer is honest).
    pub violations: u64,
    /// Peers that attack at some point (numbered in the order they joined).
    pub attackers: Vec<usize>,
    /// `[sim_s, peer, reason]`: when an honest peer first banned each peer, and why.
    pub banned: Vec<(f64, usize, String)>,
    /// Honest peers that an honest peer banned (must be 0).
    pub false_bans: usize,
    /// `[sim_s, peer, credit]` of each peer whose averaging weight an honest peer lowered
    /// for claiming more samples than its witnesses saw it commit: when first, and the
    /// lowest credit (weight over claim) any honest peer gave it.
    pub discounted: Vec<(f64, usize, f64)>,
    /// Honest peers among them.
    pub false_discounts: usize,
    /// The lowest credit an honest peer gave an honest stage-mate, sampled at each of its
    /// steps (1: every honest claim matched its witnesses).
    pub honest_credit_min: f64,
    /// Honest replicas alive at the end that hold a parameter or optimizer value that is not
    /// finite (real compute).
    pub nonfinite_replicas: usize,
    /// Whether every stage's honest replicas at its last round hold one parameter hash.
    pub honest_agree: bool,
    /// Disruptions and recovery times.
    pub recoveries: Vec<Recovery>,
    /// Rebalancing: `[sim_s, peer, from_stage, to_stage]` of every stage move (peers are
    /// numbered in the order they joined).
    pub moves: Vec<(f64, usize, u32, u32)>,
    /// `[sim_s, peer, bytes, seconds, senders]` of every state download completed (joins,
    /// moves and re-syncs): when it completed, its size, the time from asking the first
    /// replica to the last chunk, and how many replicas sent chunks of it.
    pub downloads: Vec<(f64, usize, u64, f64, usize)>,
    /// `[sim_s, peer, seconds_to_serving]` of every peer that joined after the start (it
    /// chose a stage and downloaded its state): None if it never served.
    pub joins: Vec<(f64, usize, Option<f64>)>,
    /// What the peers warned of (a run that trains nothing says why here: no stage fits a
    /// device, a state source went quiet), each with how many peers did, most first; at most
    /// [`MAX_WARNINGS`] kinds.
    pub warnings: Vec<(String, usize)>,
    /// The slowest stage's capacity, samples per second (the sum over its serving replicas of
    /// what each device can compute there: forward and backward passes back to back, per
    /// the device model): `[at the first step, at the end]`.
    pub slowest_stage: (f64, f64),
    /// Events simulated.
    pub events: u64,
    /// Hash over the ordered event trace (time, kind, peers of every event).
    pub event_hash: String,
}

/// Kinds of warnings a report keeps, at most (peers' warnings may name peers, and there may be
/// a thousand of them).
pub const MAX_WARNINGS: usize = 16;

impl Report {
    /// Bytes of pipeline and averaging traffic per trained token, by kind.
    pub fn bytes_per_token(&self, kind: &str) -> f64 {
        let b = self.bytes.get(kind).copied().unwrap_or(0) as f64;
        b / (self.tokens.max(1) as f64)
    }

    /// The summary table printed after a simulation.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let row = |out: &mut String, k: &str, v: String| {
            let _ = writeln!(out, "  {k:<24} {v}");
        };
        row(&mut out, "seed", self.seed.to_string());
        row(&mut out, "peers", self.peers.to_string());
        row(
            &mut out,
            "steps",
            format!(
                "{}{}",
                self.steps,
                if self.finished { "" } else { " (unfinished)" }
            ),
        );
        row(
            &mut out,
            "simulated time",
            format!("{:.1} s", self.sim_seconds),
        );
        let first = self.loss_curve.first().map(|p| p.2);
        row(
            &mut out,
            "loss",
            match (first, self.final_loss) {
                (Some(a), Some(b)) => {
                    format!("{a:.4} at the first step, {b:.4} at the end (last 5 steps)")
                }
                _ if self.compute == "modelled" => "not computed (modelled compute)".into(),
                _ => "-".into(),
            },
        );
        if let Some((_, step, loss)) = self.val_curve.last() {
            row(
                &mut out,
                "held-out loss",
                format!(
                    "{loss:.4} at step {step} ({} evaluations)",
                    self.val_curve.len()
                ),
            );
        }
        row(
            &mut out,
            "throughput",
            format!(
                "{:.0} tokens/s of {:.0} ideal",
                self.achieved_tokens_per_s, self.ideal_tokens_per_s
            ),
        );
        row(
            &mut out,
            "efficiency",
            format!("{:.1}%", 100.0 * self.efficiency),
        );
        row(
            &mut out,
            "devices busy",
            format!("{:.1}% of the time", 100.0 * self.device_busy),
        );
        for kind in [
            "activations",
            "activation_grads",
            "averaging",
            "state",
            "control",
            "gossip",
        ] {
            let b = self.bytes.get(kind).copied().unwrap_or(0);
            row(
                &mut out,
                &format!("bytes {kind}"),
                format!("{} ({:.0} B/token)", human(b), self.bytes_per_token(kind)),
            );
        }
        let codecs: Vec<String> = self
            .boundary_codecs
            .iter()
            .map(|(c, n)| format!("{c} {n}"))
            .collect();
        row(
            &mut out,
            "boundary codecs",
            format!("{} (messages)", codecs.join(", ")),
        );
        row(
            &mut out,
            "microbatches",
            format!(
                "{} retried, {} dropped, {} gradients discarded, {} applied twice",
                self.microbatches_retried,
                self.microbatches_dropped,
                self.gradients_discarded,
                self.double_commits
            ),
        );
        row(&mut out, "re-syncs", self.resyncs.to_string());
        if self.refused_states > 0 {
            row(&mut out, "states refused", self.refused_states.to_string());
        }
        if self.refused_parts > 0 {
            row(&mut out, "parts refused", self.refused_parts.to_string());
        }
        row(&mut out, "violations", self.violations.to_string());
        if !self.banned.is_empty() || self.false_bans > 0 {
            let bans: Vec<String> = self
                .banned
                .iter()
                .map(|b| format!("{} at {:.1} s", b.1, b.0))
                .collect();
            row(
                &mut out,
                "banned",
                format!("{} ({} honest)", bans.join(", "), self.false_bans),
            );
        }
        if self.honest_credit_min < 1.0 {
            let c = format!("x{:.2} at the lowest", self.honest_credit_min);
            row(&mut out, "honest claims", c);
        }
        if !self.discounted.is_empty() {
            let who: Vec<String> = self
                .discounted
                .iter()
                .map(|d| format!("{} at {:.1} s (x{:.2})", d.1, d.0, d.2))
                .collect();
            row(
                &mut out,
                "claims discounted",
                format!("{} ({} honest)", who.join(", "), self.false_discounts),
            );
        }
        if !self.attackers.is_empty() {
            let ids: Vec<String> = self.attackers.iter().map(|i| i.to_string()).collect();
            row(&mut out, "attackers", ids.join(", "));
            row(
                &mut out,
                "honest replicas",
                format!(
                    "{} agree, {} hold a value that is not finite",
                    if self.honest_agree {
                        "all"
                    } else {
                        "do not all"
                    },
                    self.nonfinite_replicas
                ),
            );
        }
        let moves: Vec<String> = self
            .moves
            .iter()
            .map(|m| format!("peer {} {}->{} at {:.0} s", m.1, m.2, m.3, m.0))
            .collect();
        row(
            &mut out,
            "moves",
            if moves.is_empty() {
                "0".into()
            } else {
                format!("{} ({})", moves.len(), moves.join(", "))
            },
        );
        if let Some((first, peers)) = self.warnings.first() {
            let more = match self.warnings.len() {
                1 => String::new(),
                n => format!(" (and {} more kinds)", n - 1),
            };
            row(
                &mut out,
                "warnings",
                format!("{peers} peer(s): {first}{more}"),
            );
        }
        if !self.joins.is_empty() {
            let serving: Vec<String> = self
                .joins
                .iter()
                .map(|j| j.2.map_or("never".into(), |s| format!("{s:.1} s")))
                .collect();
            row(
                &mut out,
                "joiners serving after",
                format!("{} ({})", serving.len(), serving.join(", ")),
            );
        }
        if !self.downloads.is_empty() {
            let took: Vec<String> = self
                .downloads
                .iter()
                .map(|d| format!("{} in {:.1} s from {}", human(d.2), d.3, d.4))
                .collect();
            row(
                &mut out,
                "state downloads",
                format!("{} ({})", took.len(), took.join(", ")),
            );
        }
        row(
            &mut out,
            "slowest stage",
            format!(
                "{:.0} samples/s at the first step, {:.0} at the end",
                self.slowest_stage.0, self.slowest_stage.1
            ),
        );
        for r in &self.recoveries {
            row(
                &mut out,
                &format!("{} at {:.0} s", r.cause, r.at_s),
                r.seconds
                    .map_or("not recovered".into(), |s| format!("recovered in {s:.1} s")),
            );
        }
        row(&mut out, "event hash", self.event_hash.clone());
        out
    }
}

/// Bytes in human units.
pub fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.2} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} kB", b / 1e3)
    } else {
        format!("{bytes} B")
    }
}
