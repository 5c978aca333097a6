//! What `shoal run --dashboard` shows: the swarm by stage as this peer sees it, the loss and
//! throughput curves and recent events, as one JSON snapshot a second for the page
//! (`node/src/dashboard.html`) to draw.

use super::run_metrics::RunMetrics;
use super::{Tally, committed_tokens, peer_id};
use libp2p::PeerId;
use serde_json::{Value, json};
use shoal_protocol::swarm::message::MemberState;
use shoal_protocol::swarm::{Event, Peer, PeerKey};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Events kept for the page.
const EVENTS: usize = 100;
/// Points kept per curve; past it, every other one is dropped.
const CURVE_POINTS: usize = 2000;

/// The dashboard's state, refreshed from the run loop.
pub(super) struct Dashboard {
    snapshots: watch::Sender<Arc<String>>,
    start: Instant,
    last: Option<Instant>,
    header: Value,
    events: VecDeque<(f64, String)>,
    /// The run's loss by step: this peer's own at the last stage, else the last stage's
    /// announcements.
    loss: BTreeMap<u64, f64>,
    /// Committed tokens per second of this peer's stage over time.
    throughput: Vec<(f64, f64)>,
    last_tokens: u64,
    /// Members as last seen, to tell who joined, moved or left.
    known: HashMap<PeerKey, Option<u32>>,
    rtt: HashMap<PeerKey, Duration>,
}

impl Dashboard {
    /// A dashboard whose snapshots `header` opens (the run, this peer, its device); the
    /// receiver the page's endpoint reads.
    pub(super) fn new(header: Value) -> (Dashboard, watch::Receiver<Arc<String>>) {
        let (snapshots, rx) = watch::channel(Arc::new("{}".to_string()));
        let d = Dashboard {
            snapshots,
            start: Instant::now(),
            last: None,
            header,
            events: VecDeque::new(),
            loss: BTreeMap::new(),
            throughput: Vec::new(),
            last_tokens: 0,
            known: HashMap::new(),
            rtt: HashMap::new(),
        };
        (d, rx)
    }

    fn event(&mut self, text: String) {
        if self.events.len() == EVENTS {
            self.events.pop_front();
        }
        self.events
            .push_back((self.start.elapsed().as_secs_f64(), text));
    }

    /// The link round-trip time to `peer`, as the network measured it.
    pub(super) fn rtt(&mut self, peer: PeerKey, rtt: Duration) {
        self.rtt.insert(peer, rtt);
    }

    /// Notes what the protocol reported, where an operator would want to see it.
    pub(super) fn on_event(&mut self, e: &Event, ids: &HashMap<PeerKey, PeerId>) {
        let text = match e {
            Event::Serving { stage, step, from } => match from {
                Some(from) => format!(
                    "serving stage {stage} from step {step} (state from {})",
                    short(ids, *from)
                ),
                None => format!("serving stage {stage} from step {step}"),
            },
            Event::Moving { from, to } => format!("moving from stage {from} to stage {to}"),
            Event::Banned {
                peer,
                why,
                accusers,
                replicas,
            } => format!(
                "banned {}: {why} ({accusers} of {replicas} replicas accuse it)",
                short(ids, *peer)
            ),
            Event::Discounted { peer, credit } => format!(
                "{} claims more samples than it committed: weight x{credit:.2}",
                short(ids, *peer)
            ),
            Event::Resync { from, reason } => {
                format!("re-syncing from {}: {reason}", short(ids, *from))
            }
            Event::StateReceived {
                stage,
                bytes,
                took,
                senders,
            } => format!(
                "received stage {stage}'s state: {:.1} MB in {:.1} s from {senders} replica(s)",
                *bytes as f64 / 1e6,
                took.as_secs_f64()
            ),
            Event::StateRefused { from } => {
                format!(
                    "refused the state from {}: its parameters differ from its stage's",
                    short(ids, *from)
                )
            }
            Event::RoundDegraded {
                round,
                left_out,
                zeroed,
                refused,
            } => format!(
                "round {round}: {left_out} member(s) left out, {zeroed} part(s) lost, {refused} refused"
            ),
            Event::Finished => "the run reached its last step".to_string(),
            Event::HeldOut(h) => format!("step {}: held-out loss {:.4}", h.step, h.loss),
            _ => return,
        };
        self.event(text);
    }

    /// Publishes a snapshot, at most once a second.
    pub(super) fn refresh(&mut self, peer: &Peer, tally: &Tally, ids: &HashMap<PeerKey, PeerId>) {
        let now = Instant::now();
        let dt = match self.last {
            Some(t) if now.duration_since(t) < Duration::from_secs(1) => return,
            Some(t) => now.duration_since(t).as_secs_f64(),
            None => 0.0,
        };
        self.last = Some(now);
        let c = peer.config();
        let seq = f64::from(c.seq);
        let tokens = committed_tokens(peer);
        if dt > 0.0 {
            let t = self.start.elapsed().as_secs_f64();
            push(
                &mut self.throughput,
                (t, (tokens - self.last_tokens.min(tokens)) as f64 / dt),
            );
        }
        self.last_tokens = tokens;
        for (step, loss) in &tally.loss_curve {
            self.loss.insert(*step, *loss);
        }
        let last_stage = c.stages - 1;
        // Peers of other stages: the last stage's replicas announce the loss of their step.
        if let Some((step, loss)) = peer
            .members()
            .iter()
            .filter(|(_, m)| m.announcement.stage == Some(last_stage))
            .filter_map(|(_, m)| Some((m.announcement.step, f64::from(m.announcement.loss?))))
            .max_by_key(|(step, _)| *step)
        {
            self.loss.entry(step).or_insert(loss);
        }
        while self.loss.len() > CURVE_POINTS {
            let drop: Vec<u64> = self.loss.keys().copied().step_by(2).collect();
            for k in drop {
                self.loss.remove(&k);
            }
        }
        // Who joined, moved or left since the last snapshot.
        let mut seen = HashMap::new();
        for (k, m) in peer.members().iter() {
            let stage = m.announcement.stage;
            match self.known.get(k) {
                None => self.event(format!(
                    "{} joined{}",
                    short(ids, *k),
                    stage.map_or(String::new(), |s| format!(" (stage {s})"))
                )),
                Some(before) if *before != stage && stage.is_some() => self.event(format!(
                    "{} moved to stage {}",
                    short(ids, *k),
                    stage.unwrap_or_default()
                )),
                _ => {}
            }
            seen.insert(*k, stage);
        }
        let gone: Vec<PeerKey> = self
            .known
            .keys()
            .filter(|k| !seen.contains_key(k))
            .copied()
            .collect();
        for k in gone {
            self.event(format!("{} left or crashed", short(ids, k)));
            self.rtt.remove(&k);
        }
        self.known = seen;

        let mut stages: Vec<Vec<Value>> = vec![Vec::new(); c.stages as usize];
        if let Some(s) = peer.stage().filter(|s| *s < c.stages) {
            stages[s as usize].push(json!({
                "id": self.header["id"],
                "me": true,
                "state": if peer.is_serving() { "serving" } else { "syncing" },
                "tokens_per_s": peer.throughput() * seq,
                "step": peer.step(),
            }));
        }
        for (k, m) in peer.members().iter() {
            let a = &m.announcement;
            let Some(s) = a.stage.filter(|s| *s < c.stages) else {
                continue;
            };
            stages[s as usize].push(json!({
                "id": peer_id(ids, *k),
                "me": false,
                "state": match a.state {
                    MemberState::Choosing => "choosing",
                    MemberState::Syncing => "syncing",
                    MemberState::Serving => "serving",
                    MemberState::Leaving => "leaving",
                },
                "tokens_per_s": f64::from(a.throughput) * seq,
                "queue": a.queue,
                "step": a.step,
                "memory": a.memory,
                "offloads": a.offloads,
                "rtt_ms": self.rtt.get(k).map(|r| r.as_secs_f64() * 1e3),
            }));
        }
        let snapshot = json!({
            "peer": self.header,
            "stage": peer.stage(),
            "step": peer.step(),
            "max_steps": c.max_steps,
            "stages": stages,
            "loss": self.loss.iter().map(|(s, l)| json!([s, l])).collect::<Vec<_>>(),
            "held_out": tally.val_curve.last().map(|(s, l)| json!([s, l])),
            "throughput": self.throughput.iter().map(|(t, v)| json!([t, v])).collect::<Vec<_>>(),
            "events": self.events.iter().rev().map(|(t, e)| json!([t, e])).collect::<Vec<_>>(),
            "seconds": self.start.elapsed().as_secs_f64(),
        });
        self.snapshots.send_replace(Arc::new(snapshot.to_string()));
    }
}

/// Appends to a curve, halving it past [`CURVE_POINTS`].
fn push(curve: &mut Vec<(f64, f64)>, point: (f64, f64)) {
    curve.push(point);
    if curve.len() > CURVE_POINTS {
        let halved: Vec<(f64, f64)> = curve.iter().copied().step_by(2).collect();
        *curve = halved;
    }
}

/// A peer's id as the page shows it in events: its last 8 characters.
fn short(ids: &HashMap<PeerKey, PeerId>, key: PeerKey) -> String {
    let id = peer_id(ids, key);
    let tail = id.len().saturating_sub(8);
    format!("…{}", &id[tail..])
}

/// Starts the operator's endpoints the flags ask for: `--metrics` and `--dashboard`, on one
/// listener where they name the same address. Prints where they are.
pub(super) async fn serve_endpoints(
    metrics_at: Option<std::net::SocketAddr>,
    dashboard_at: Option<std::net::SocketAddr>,
    info: Vec<(&'static str, String)>,
    header: Value,
) -> anyhow::Result<(Option<RunMetrics>, Option<Dashboard>)> {
    use crate::http::{Routes, serve};
    use anyhow::Context;
    let (metrics, registry) = match metrics_at {
        Some(_) => {
            let (m, r) = RunMetrics::new(info);
            (Some(m), Some(Arc::new(r)))
        }
        None => (None, None),
    };
    let (dashboard, snapshots) = match dashboard_at {
        Some(_) => {
            let (d, rx) = Dashboard::new(header);
            (Some(d), Some(rx))
        }
        None => (None, None),
    };
    if let Some(addr) = metrics_at.filter(|a| Some(*a) == dashboard_at) {
        let routes = Routes {
            metrics: registry,
            dashboard: snapshots,
        };
        let at = serve(addr, routes)
            .await
            .context("--metrics and --dashboard")?;
        println!("metrics on http://{at}/metrics");
        println!("dashboard on http://{at}/");
        return Ok((metrics, dashboard));
    }
    if let Some(addr) = metrics_at {
        let routes = Routes {
            metrics: registry,
            dashboard: None,
        };
        let at = serve(addr, routes).await.context("--metrics")?;
        println!("metrics on http://{at}/metrics");
    }
    if let Some(addr) = dashboard_at {
        let routes = Routes {
            metrics: None,
            dashboard: snapshots,
        };
        let at = serve(addr, routes).await.context("--dashboard")?;
        println!("dashboard on http://{at}/");
    }
    Ok((metrics, dashboard))
}
