//! `shoal node`: join the network and serve it (bootstrap, relay, discovery), optionally
//! driven line by line as JSON on stdin/stdout (`--control`), which is how the integration
//! tests and scripts operate a real process.

use crate::cli::NodeArgs;
use anyhow::Context;
use libp2p::{Multiaddr, PeerId};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use serde::Deserialize;
use serde_json::json;
use shoal_node::net::{self, NetConfig, NodeEvent, NodeHandle, identity};
use shoal_protocol::{Codec, Decoder, Encoder, FrameKind};
use std::collections::HashSet;
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;
use tokio::io::AsyncBufReadExt;

/// Commands accepted on stdin with `--control`, one JSON object per line.
#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum ControlCommand {
    /// Publish a text on the run's gossip topic.
    Gossip { text: String },
    /// Send a tensor of `values` pseudo-random f32 (from `seed`) to `peer`.
    Send {
        peer: String,
        values: usize,
        seed: u64,
    },
    /// Dial an address.
    Dial { addr: String },
    /// Listen on an address (e.g. `/p2p/<relay>/p2p-circuit`).
    Listen { addr: String },
    /// List connected peers.
    Peers,
}

/// What `shoal node --metrics` exports.
struct NodeMetrics {
    connected: HashSet<PeerId>,
    peers: Gauge,
    events: Family<Vec<(&'static str, String)>, Counter>,
    frames: Counter,
    frame_bytes: Counter,
}

impl NodeMetrics {
    fn new(peer: &PeerId) -> (NodeMetrics, Registry) {
        let mut r = Registry::with_prefix("shoal");
        let info: Family<Vec<(&'static str, String)>, Gauge> = Family::default();
        info.get_or_create(&vec![
            ("peer", peer.to_string()),
            ("version", env!("CARGO_PKG_VERSION").to_string()),
        ])
        .set(1);
        r.register("node_info", "The node: peer id, version", info);
        let m = NodeMetrics {
            connected: HashSet::new(),
            peers: Gauge::default(),
            events: Family::default(),
            frames: Counter::default(),
            frame_bytes: Counter::default(),
        };
        r.register(
            "connected_peers",
            "Peers with a connection to this node",
            m.peers.clone(),
        );
        r.register(
            "network_events",
            "Network events by kind (connected, discovered, gossip, hole_punched, ...)",
            m.events.clone(),
        );
        r.register(
            "frames_received",
            "Frames received on tensor streams",
            m.frames.clone(),
        );
        r.register_with_unit(
            "frames_received",
            "Bytes of the frames received on tensor streams",
            Unit::Bytes,
            m.frame_bytes.clone(),
        );
        (m, r)
    }

    fn event(&mut self, event: &NodeEvent) {
        let kind = match event {
            NodeEvent::Connected(p) => {
                self.connected.insert(*p);
                "connected"
            }
            NodeEvent::Disconnected(p) => {
                self.connected.remove(p);
                "disconnected"
            }
            NodeEvent::Discovered(_) => "discovered",
            NodeEvent::Gossip { .. } => "gossip",
            NodeEvent::RelayReservation(_) => "relay_reservation",
            NodeEvent::HolePunched(_) => "hole_punched",
            NodeEvent::HolePunchFailed(..) => "hole_punch_failed",
            NodeEvent::Reachability(_) => "reachability",
            _ => return,
        };
        self.peers
            .set(i64::try_from(self.connected.len()).unwrap_or(i64::MAX));
        self.events
            .get_or_create(&vec![("kind", kind.to_string())])
            .inc();
    }
}

fn emit(value: serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{value}");
    let _ = out.flush();
}

pub fn run(args: NodeArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(args))
}

async fn serve(args: NodeArgs) -> anyhow::Result<()> {
    let key_path = args.identity.clone().unwrap_or_else(identity::default_path);
    // Held to the end of the process: the identity's lock.
    let identity = identity::load_or_create(&key_path)?;
    let key = identity.key.clone();
    let mut config = NetConfig {
        bootstrap: args.bootstrap.clone(),
        mdns: !args.no_mdns,
        relay_server: args.relay_server,
        allow_private: args.allow_private,
        direct: !args.no_direct,
        run: args.run.clone(),
        ..NetConfig::default()
    };
    if !args.listen.is_empty() || args.no_listen {
        config.listen = args.listen.clone();
    }
    let limits = config.transport;
    let (handle, mut events, mut frames) = net::start(key, config).await?;
    let control = args.control;
    if control {
        emit(json!({"event": "started", "peer": handle.peer_id.to_string()}));
    } else {
        println!(
            "shoal node {} (identity {})",
            handle.peer_id,
            key_path.display()
        );
    }

    let mut metrics = match args.metrics {
        Some(addr) => {
            let (metrics, registry) = NodeMetrics::new(&handle.peer_id);
            let routes = crate::http::Routes {
                metrics: Some(Arc::new(registry)),
                dashboard: None,
            };
            let bound = crate::http::serve(addr, routes)
                .await
                .context("--metrics")?;
            if control {
                emit(json!({"event": "metrics", "url": format!("http://{bound}/metrics")}));
            } else {
                println!("metrics on http://{bound}/metrics");
            }
            Some(metrics)
        }
        None => None,
    };
    let (line_tx, mut lines) = tokio::sync::mpsc::channel::<String>(64);
    if control {
        tokio::spawn(async move {
            let mut stdin = tokio::io::BufReader::new(tokio::io::stdin()).lines();
            while let Ok(Some(line)) = stdin.next_line().await {
                if line_tx.send(line).await.is_err() {
                    break;
                }
            }
        });
    }
    // This node expects no tensor larger than a frame holds at one byte per value; a top-k
    // message claiming more is refused before its output is allocated.
    let mut decoder = Decoder::with_max_elements(limits.frames.max_tensor_len as usize);
    let mut values = Vec::new();
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            Some(line) = lines.recv() => {
                match serde_json::from_str::<ControlCommand>(&line) {
                    Ok(cmd) => command(&handle, cmd).await,
                    Err(e) => emit(json!({"event": "bad_command", "error": e.to_string()})),
                }
            }
            Some(event) = events.recv() => {
                if let Some(m) = &mut metrics {
                    m.event(&event);
                }
                report_event(event, control)
            }
            Some(frame) = frames.recv() => {
                let peer = frame.peer;
                if let Some(m) = &metrics {
                    m.frames.inc();
                    m.frame_bytes.inc_by(frame.payload.len() as u64);
                }
                match frame.kind {
                    FrameKind::Tensor => match decoder.decode(&frame.payload, &mut values) {
                        Ok(header) => {
                            if control {
                                emit(json!({"event": "tensor", "from": peer.to_string(),
                                    "values": values.len(), "bytes": frame.payload.len(),
                                    "checksum": format!("{:016x}", header.checksum)}));
                            } else {
                                println!("tensor of {} values from {peer}", values.len());
                            }
                        }
                        Err(e) => tracing::warn!(%peer, "bad tensor message: {e}"),
                    },
                    FrameKind::Control => tracing::debug!(%peer, "control frame on a tensor stream"),
                }
            }
        }
    }
    Ok(())
}

async fn command(handle: &NodeHandle, cmd: ControlCommand) {
    match cmd {
        ControlCommand::Gossip { text } => {
            if let Err(e) = handle.publish(text.into_bytes()).await {
                emit(json!({"event": "gossip_failed", "error": format!("{e:#}")}));
            }
        }
        ControlCommand::Send { peer, values, seed } => {
            let Ok(peer) = peer.parse::<PeerId>() else {
                emit(json!({"event": "bad_command", "error": format!("bad peer id {peer}")}));
                return;
            };
            let handle = handle.clone();
            // Each transfer on its own task: many in flight at once.
            tokio::spawn(async move {
                let mut rng = shoal_compute::rng::Rng::new(seed);
                let data: Vec<f32> = (0..values).map(|_| rng.normal() as f32).collect();
                let mut message = Vec::new();
                let header = match Encoder::new().encode(
                    Codec::Fp32,
                    &data,
                    &[values],
                    &mut message,
                ) {
                    Ok(h) => h,
                    Err(e) => {
                        emit(
                            json!({"event": "send_failed", "to": peer.to_string(), "error": e.to_string()}),
                        );
                        return;
                    }
                };
                let start = Instant::now();
                match handle.send_frame(peer, FrameKind::Tensor, &message).await {
                    Ok(()) => emit(json!({"event": "sent", "to": peer.to_string(),
                        "bytes": message.len(), "checksum": format!("{:016x}", header.checksum),
                        "ms": start.elapsed().as_secs_f64() * 1e3})),
                    Err(e) => emit(
                        json!({"event": "send_failed", "to": peer.to_string(), "error": e.to_string()}),
                    ),
                }
            });
        }
        ControlCommand::Dial { addr } => match addr.parse::<Multiaddr>() {
            Ok(addr) => {
                let _ = handle.dial(addr).await;
            }
            Err(e) => emit(json!({"event": "bad_command", "error": format!("bad address: {e}")})),
        },
        ControlCommand::Listen { addr } => match addr.parse::<Multiaddr>() {
            Ok(addr) => {
                let _ = handle.listen(addr).await;
            }
            Err(e) => emit(json!({"event": "bad_command", "error": format!("bad address: {e}")})),
        },
        ControlCommand::Peers => {
            let peers = handle.peers().await.unwrap_or_default();
            emit(
                json!({"event": "peers", "peers": peers.iter().map(|p| p.to_string()).collect::<Vec<_>>()}),
            );
        }
    }
}

fn report_event(event: NodeEvent, control: bool) {
    let value = match &event {
        NodeEvent::Listening(addr) => json!({"event": "listening", "addr": addr.to_string()}),
        NodeEvent::Connected(p) => json!({"event": "connected", "peer": p.to_string()}),
        NodeEvent::Disconnected(p) => json!({"event": "disconnected", "peer": p.to_string()}),
        NodeEvent::Discovered(p) => json!({"event": "discovered", "peer": p.to_string()}),
        NodeEvent::Gossip { from, via, data } => {
            json!({"event": "gossip", "from": from.to_string(),
            "via": via.to_string(), "text": String::from_utf8_lossy(data)})
        }
        NodeEvent::RelayReservation(addr) => {
            json!({"event": "relay_reservation", "addr": addr.to_string()})
        }
        NodeEvent::Reachability(addr) => json!({"event": "reachability",
            "public": addr.is_some(), "addr": addr.as_ref().map(|a| a.to_string())}),
        NodeEvent::HolePunched(p) => json!({"event": "hole_punched", "peer": p.to_string()}),
        NodeEvent::HolePunchFailed(p, why) => {
            json!({"event": "hole_punch_failed", "peer": p.to_string(), "error": why})
        }
        // Every 15 s per connection: the training loop's business, not an event to print.
        NodeEvent::Rtt(..) => return,
    };
    if control {
        emit(value);
    } else if let NodeEvent::Listening(addr) = event {
        println!("listening on {addr}");
    } else {
        tracing::info!("{value}");
    }
}
