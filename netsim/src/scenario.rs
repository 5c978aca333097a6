//! Scenario files (TOML): the run, groups of peers, and scripted events.

use crate::device::DeviceProfile;
use crate::link::LinkProfile;
use serde::Deserialize;
use shoal_compute::StageSpec;
use shoal_protocol::TrafficCodecs;
use shoal_protocol::swarm::attack::Behavior;
use shoal_protocol::swarm::membership::Routing;
use shoal_protocol::swarm::{
    DataSource, Evaluation, PAPER_OUTER_LR, PAPER_OUTER_MOMENTUM, RunConfig, SyncMode,
};
use std::str::FromStr;

/// A scenario as written.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// The training run.
    pub run: RunSection,
    /// Groups of identical peers.
    #[serde(default)]
    pub peers: Vec<PeerGroup>,
    /// Scripted events.
    #[serde(default)]
    pub events: Vec<ScriptEvent>,
    /// Simulator settings.
    #[serde(default)]
    pub sim: SimSection,
}

/// `[run]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSection {
    /// Model preset.
    pub preset: String,
    /// Pipeline stages.
    pub stages: u32,
    /// `allreduce` or `diloco`.
    #[serde(default = "allreduce")]
    pub sync: String,
    /// Inner steps per DiLoCo round.
    #[serde(default = "eight")]
    pub diloco_h: u32,
    /// DiLoCo's outer learning rate (default: the paper's 0.7).
    pub outer_lr: Option<f32>,
    /// DiLoCo's outer momentum (default: the paper's 0.9).
    pub outer_momentum: Option<f32>,
    /// DiLoCo's error feedback decay per round (default: 1, plain feedback).
    pub feedback_decay: Option<f32>,
    /// Samples per optimizer step.
    pub global_batch: u32,
    /// Samples per microbatch.
    pub microbatch: u32,
    /// Optimizer steps to simulate.
    pub steps: u64,
    /// Codec of activations: one codec, `LIGHT,STRONG` chosen per hop, or `auto`.
    #[serde(default = "auto")]
    pub activation_codec: String,
    /// Codec of activation gradients, likewise.
    #[serde(default = "auto")]
    pub gradient_codec: String,
    /// Codec of averaging.
    #[serde(default = "int8")]
    pub averaging_codec: String,
    /// Tokens per sample (default: the preset's context).
    pub seq: Option<u32>,
    /// Peak learning rate (default: the preset's).
    pub lr: Option<f32>,
    /// Seed of the model's initialisation and data (the scenario's `--seed` drives the rest).
    #[serde(default = "one")]
    pub data_seed: u64,
    /// `weighted` (the protocol's routing) or `uniform` (the baseline).
    #[serde(default = "weighted")]
    pub routing: String,
    /// `real` (train the model on the CPU: real loss curve) or `modelled` (tensors of the right
    /// sizes and random contents: timing and traffic only, for models too large to train here).
    #[serde(default = "real")]
    pub compute: String,
    /// Steps between held-out evaluations of the swarm's model (0: none).
    #[serde(default)]
    pub eval_every: u64,
    /// Held-out samples each evaluation.
    #[serde(default = "held_out_samples")]
    pub eval_samples: u32,
}

impl RunSection {
    fn evaluation(&self) -> Evaluation {
        Evaluation {
            every: self.eval_every,
            samples: self.eval_samples,
            data: None,
        }
    }
}

fn held_out_samples() -> u32 {
    Evaluation::default().samples
}

fn allreduce() -> String {
    "allreduce".into()
}
fn auto() -> String {
    "auto".into()
}

fn int8() -> String {
    "int8".into()
}
fn real() -> String {
    "real".into()
}
fn weighted() -> String {
    "weighted".into()
}
fn eight() -> u32 {
    8
}
fn one() -> u64 {
    1
}

/// `[[peers]]`: identical peers.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerGroup {
    /// How many.
    pub count: u32,
    /// Device preset.
    pub device: String,
    /// Link preset.
    pub link: String,
    /// When they join, simulated seconds.
    #[serde(default)]
    pub join_at_s: f64,
    /// The stage they take first (default: the one the run needs most when they choose),
    /// e.g. to start a swarm badly balanced; rebalancing may move them later.
    pub stage: Option<u32>,
    /// How they behave: `honest` (default) or an attack (see [`Behavior`]).
    #[serde(default)]
    pub behavior: Option<String>,
    /// Honest until then, simulated seconds.
    #[serde(default)]
    pub behavior_from_s: f64,
    /// Whether they keep a stage's blocks in host memory when their device cannot hold it
    /// (default: where the device has a host link to offload over, see `DeviceProfile`).
    #[serde(default = "yes")]
    pub offload: bool,
}

fn yes() -> bool {
    true
}

/// What a scripted event does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EventKind {
    /// Peers stop dead: no goodbye, connections time out.
    Crash,
    /// Peers leave politely: they announce it and close their connections.
    Leave,
    /// New peers join (`device` and `link` say what kind).
    Join,
    /// The chosen peers are cut off from the rest until a `heal`.
    Partition,
    /// Every partition heals.
    Heal,
}

impl EventKind {
    /// The name used in scenario files and reports.
    pub fn name(self) -> &'static str {
        match self {
            EventKind::Crash => "crash",
            EventKind::Leave => "leave",
            EventKind::Join => "join",
            EventKind::Partition => "partition",
            EventKind::Heal => "heal",
        }
    }
}

/// `[[events]]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptEvent {
    /// When, simulated seconds.
    pub at_s: f64,
    /// What.
    pub kind: EventKind,
    /// How many peers (chosen by the seed among those alive), or joiners.
    pub count: Option<u32>,
    /// Which peers, by index in order of creation (instead of `count`).
    pub peers: Option<Vec<usize>>,
    /// Joiners' device.
    pub device: Option<String>,
    /// Joiners' link.
    pub link: Option<String>,
}

/// `[sim]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimSection {
    /// Give up after this many simulated seconds.
    #[serde(default = "max_sim_s")]
    pub max_sim_s: f64,
    /// A silent connection is declared dead after this long (the node's QUIC idle timeout).
    #[serde(default = "idle_timeout_s")]
    pub idle_timeout_s: f64,
    /// Modelled compute: the most values a stage's parameter-sized tensors (gradients,
    /// averaged parts, catch-ups, states) hold in the simulator. A larger stage carries them
    /// scaled down by the same factor for every stage, and the links are charged their full
    /// size, so the simulator's memory follows the number of peers, not the model.
    #[serde(default = "modelled_tensor_values")]
    pub modelled_tensor_values: usize,
}

fn max_sim_s() -> f64 {
    3600.0
}
fn idle_timeout_s() -> f64 {
    10.0
}
fn modelled_tensor_values() -> usize {
    1 << 16
}

impl Default for SimSection {
    fn default() -> Self {
        SimSection {
            max_sim_s: max_sim_s(),
            idle_timeout_s: idle_timeout_s(),
            modelled_tensor_values: modelled_tensor_values(),
        }
    }
}

/// A group of peers resolved to profiles.
#[derive(Clone, Debug)]
pub struct Group {
    /// How many.
    pub count: u32,
    /// Their device.
    pub device: DeviceProfile,
    /// Their access link.
    pub link: LinkProfile,
    /// When they join.
    pub join_at_s: f64,
    /// The stage they take first, if set.
    pub stage: Option<u32>,
    /// How they behave, and from when (simulated seconds).
    pub behavior: Behavior,
    /// When the behavior starts (honest before).
    pub behavior_from_s: f64,
    /// They offload blocks to host memory where their device cannot hold a stage.
    pub offload: bool,
}

/// A scripted event resolved to profiles.
#[derive(Clone, Debug)]
pub struct Scripted {
    /// When.
    pub at_s: f64,
    /// What.
    pub kind: EventKind,
    /// How many peers, if chosen by the seed.
    pub count: u32,
    /// Which peers, if named.
    pub peers: Option<Vec<usize>>,
    /// Joiners.
    pub joiners: Option<Group>,
}

/// How the peers' compute jobs are carried out (their duration always comes from the device
/// model).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compute {
    /// For real, on the CPU: the loss curve is real.
    Real,
    /// By [`crate::modelled::ModelledStage`]: right-sized tensors, no arithmetic, no loss.
    Modelled,
}

impl Compute {
    /// The name used in scenario files and reports.
    pub fn name(self) -> &'static str {
        match self {
            Compute::Real => "real",
            Compute::Modelled => "modelled",
        }
    }
}

/// A checked scenario, ready to simulate.
#[derive(Clone, Debug)]
pub struct Setup {
    /// The run every peer trains.
    pub config: RunConfig,
    /// How microbatches are routed.
    pub routing: Routing,
    /// Real or modelled compute.
    pub compute: Compute,
    /// Peers present or joining.
    pub groups: Vec<Group>,
    /// Scripted events, in time order.
    pub events: Vec<Scripted>,
    /// Simulator settings.
    pub sim: SimSection,
}

fn codec<C: FromStr<Err = String>>(name: &str, what: &str) -> Result<C, String> {
    name.parse().map_err(|e| format!("{what}: {e}"))
}

fn time(t: f64, what: &str) -> Result<f64, String> {
    if t.is_finite() && t >= 0.0 {
        Ok(t)
    } else {
        Err(format!("{what}: {t} is not a time in seconds"))
    }
}

impl Scenario {
    /// Parses and checks a scenario file's text.
    pub fn parse(text: &str) -> Result<Setup, String> {
        let s: Scenario = toml::from_str(text).map_err(|e| e.to_string())?;
        s.check()
    }

    /// Checks the scenario and resolves its presets.
    pub fn check(&self) -> Result<Setup, String> {
        let r = &self.run;
        let preset: shoal_compute::Preset =
            r.preset.parse().map_err(|e| format!("[run] preset: {e}"))?;
        let model = preset.config();
        let seq = r.seq.unwrap_or(model.context as u32);
        StageSpec::check_pipeline(&model, r.stages as usize, seq as usize)
            .map_err(|e| format!("[run]: {e}"))?;
        let sync = match r.sync.as_str() {
            "allreduce" => SyncMode::AllReduce,
            "diloco" if r.diloco_h >= 1 => SyncMode::DiLoCo {
                h: r.diloco_h,
                outer_lr: r.outer_lr.unwrap_or(PAPER_OUTER_LR),
                outer_momentum: r.outer_momentum.unwrap_or(PAPER_OUTER_MOMENTUM),
                feedback_decay: r.feedback_decay.unwrap_or(1.0),
            },
            "diloco" => return Err("[run] diloco_h must be at least 1".into()),
            other => return Err(format!("[run] sync: '{other}' (allreduce or diloco)")),
        };
        let routing: Routing = r
            .routing
            .parse()
            .map_err(|e| format!("[run] routing: {e}"))?;
        let compute = [Compute::Real, Compute::Modelled]
            .into_iter()
            .find(|c| c.name() == r.compute)
            .ok_or_else(|| format!("[run] compute: '{}' (real or modelled)", r.compute))?;
        let codecs = TrafficCodecs {
            activations: codec(&r.activation_codec, "[run] activation_codec")?,
            activation_grads: codec(&r.gradient_codec, "[run] gradient_codec")?,
            averaging: codec(&r.averaging_codec, "[run] averaging_codec")?,
        };
        if r.steps == 0 {
            return Err("[run] steps must be at least 1".into());
        }
        let config = RunConfig {
            preset: r.preset.clone(),
            stages: r.stages,
            global_batch: r.global_batch,
            microbatch: r.microbatch,
            seq,
            sync,
            lr: r.lr.unwrap_or(preset.default_lr()),
            max_steps: r.steps,
            codecs,
            data: DataSource::Synthetic,
            seed: r.data_seed,
            init: None,
            evaluation: r.evaluation(),
        };
        config.validate().map_err(|e| format!("[run]: {e}"))?;
        if self.peers.is_empty() {
            return Err("no [[peers]]".into());
        }
        let group = |count: u32, device: &str, link: &str, at: f64, what: &str| {
            Ok::<Group, String>(Group {
                count,
                device: DeviceProfile::named(device).map_err(|e| format!("{what}: {e}"))?,
                link: LinkProfile::named(link).map_err(|e| format!("{what}: {e}"))?,
                join_at_s: time(at, what)?,
                stage: None,
                behavior: Behavior::Honest,
                behavior_from_s: 0.0,
                offload: true,
            })
        };
        let mut groups = Vec::new();
        for (i, p) in self.peers.iter().enumerate() {
            let what = format!("[[peers]] #{}", i + 1);
            if p.count == 0 || p.count > 4096 {
                return Err(format!("{what}: count {} (1 to 4096)", p.count));
            }
            let mut g = group(p.count, &p.device, &p.link, p.join_at_s, &what)?;
            if let Some(stage) = p.stage {
                if stage >= r.stages {
                    return Err(format!("{what}: stage {stage} of {} stages", r.stages));
                }
                g.stage = Some(stage);
            }
            if let Some(b) = &p.behavior {
                g.behavior = b.parse().map_err(|e| format!("{what}: behavior {e}"))?;
            }
            g.behavior_from_s = time(p.behavior_from_s, &what)?;
            g.offload = p.offload;
            groups.push(g);
        }
        let mut events = Vec::new();
        for (i, e) in self.events.iter().enumerate() {
            let what = format!("[[events]] #{} ({})", i + 1, e.kind.name());
            let at_s = time(e.at_s, &what)?;
            let count = e.count.unwrap_or(0);
            let joiners = match e.kind {
                EventKind::Join => {
                    let first = &self.peers[0];
                    if count == 0 || count > 4096 {
                        return Err(format!("{what}: count {count} (1 to 4096)"));
                    }
                    Some(group(
                        count,
                        e.device.as_deref().unwrap_or(&first.device),
                        e.link.as_deref().unwrap_or(&first.link),
                        at_s,
                        &what,
                    )?)
                }
                _ => None,
            };
            let peers = e.peers.clone();
            let needs_peers = matches!(
                e.kind,
                EventKind::Crash | EventKind::Leave | EventKind::Partition
            );
            match (&peers, count) {
                (Some(_), c) if c > 0 => return Err(format!("{what}: give count or peers")),
                (None, 0) if needs_peers => {
                    return Err(format!("{what}: which peers? (count or peers)"));
                }
                _ => {}
            }
            if !needs_peers && e.kind != EventKind::Join && (peers.is_some() || count > 0) {
                return Err(format!("{what}: takes no peers"));
            }
            events.push(Scripted {
                at_s,
                kind: e.kind,
                count,
                peers,
                joiners,
            });
        }
        events.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
        if !(self.sim.max_sim_s > 0.0 && self.sim.idle_timeout_s > 0.0) {
            return Err("[sim] times must be positive".into());
        }
        if self.sim.modelled_tensor_values == 0 {
            return Err("[sim] modelled_tensor_values must be at least 1".into());
        }
        Ok(Setup {
            config,
            routing,
            compute,
            groups,
            events,
            sim: self.sim.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_protocol::{Codec, HopCodec};

    const EXAMPLE: &str = r#"
[run]
preset = "nano"          # model preset
stages = 3
sync = "allreduce"       # or "diloco"; diloco_h = 8
global_batch = 64        # samples per optimizer step
microbatch = 8
steps = 40               # optimizer steps to simulate
activation_codec = "auto"
gradient_codec = "int8,int4"
averaging_codec = "int8"

[[peers]]                # a group of identical peers
count = 4
device = "rtx4090"
link = "home"
join_at_s = 0.0          # optional
stage = 0                # optional: the stage they take first

[[events]]
at_s = 60.0
kind = "crash"           # crash | leave | join | partition | heal
count = 2                # peers chosen by the seed (or `peers = [ids]`)
"#;

    #[test]
    fn the_documented_example_parses() {
        let s = Scenario::parse(EXAMPLE).unwrap();
        assert_eq!(s.config.stages, 3);
        assert_eq!(s.config.max_steps, 40);
        assert_eq!(s.groups[0].device.name, "rtx4090");
        assert_eq!(s.groups[0].link.name, "home");
        assert_eq!(s.groups[0].stage, Some(0));
        assert_eq!(s.events[0].kind, EventKind::Crash);
        assert_eq!(s.events[0].count, 2);
        assert_eq!(s.config.codecs.activations, HopCodec::AUTO);
        assert_eq!(s.config.codecs.activation_grads, HopCodec::AUTO);
        assert_eq!(s.config.codecs.averaging, Codec::default());
    }

    #[test]
    fn mistakes_are_named() {
        let cases = [
            (
                EXAMPLE.replace("\"rtx4090\"", "\"rtx9090\""),
                "unknown device",
            ),
            (EXAMPLE.replace("\"home\"", "\"moon\""), "unknown link"),
            (EXAMPLE.replace("stages = 3", "stages = 9"), "cannot cut"),
            (
                EXAMPLE.replace("count = 2 ", "peers = [0]\ncount = 2 "),
                "count or peers",
            ),
            (
                EXAMPLE.replace("\"crash\"", "\"explode\""),
                "unknown variant",
            ),
            (
                EXAMPLE.replace("steps = 40", "steps = 40\nspeed = 2"),
                "unknown field",
            ),
            (EXAMPLE.replace("\"int8\"", "\"int5\""), "unknown codec"),
            (EXAMPLE.replace("int8,int4", "int8,int5"), "gradient_codec"),
            (EXAMPLE.replace("int8,int4", "int8,int4:7"), "block"),
            (
                EXAMPLE.replace("steps = 40", "steps = 40\ncompute = \"guessed\""),
                "real or modelled",
            ),
            (EXAMPLE.replace("at_s = 60.0", "at_s = -1.0"), "not a time"),
            (
                EXAMPLE.replace("stage = 0 ", "stage = 3 "),
                "stage 3 of 3 stages",
            ),
        ];
        for (text, want) in cases {
            let e = Scenario::parse(&text).unwrap_err();
            assert!(e.contains(want), "{want}: {e}");
        }
    }
}
