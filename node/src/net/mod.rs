//! The node's network: a libp2p swarm on QUIC with discovery (bootstrap addresses, Kademlia,
//! identify, mDNS), membership gossip, NAT traversal (AutoNAT, circuit relay, DCUtR) and
//! tensor streams, every resource bounded.
//!
//! [`start`] builds the swarm and spawns its event loop; the application talks to it through a
//! [`NodeHandle`] (commands, and a stream control for tensors) and receives [`NodeEvent`]s and
//! [`InboundFrame`]s on bounded channels.

pub mod direct;
mod events;
pub mod identity;
pub mod ip_limits;
pub mod tensor;

use anyhow::Context;
use futures::StreamExt;
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::{NetworkBehaviour, SwarmEvent};
use libp2p::{
    Multiaddr, PeerId, StreamProtocol, Swarm, allow_block_list, autonat, connection_limits, dcutr,
    gossipsub, identify, identity::Keypair, kad, mdns, multiaddr::Protocol, noise, ping, relay,
    yamux,
};
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

pub use tensor::{InboundFrame, TransportLimits};

/// Kademlia protocol of shoal's own DHT (separate from IPFS's).
const KAD_PROTOCOL: StreamProtocol = StreamProtocol::new("/shoal/kad/1");
/// identify's protocol version string: peers of other networks are not added to the DHT.
const IDENTIFY_VERSION: &str = "/shoal/1";

/// QUIC receive windows sized to the bandwidth-delay product of the links shoal targets:
/// 1 Gbit/s at 100 ms RTT needs 12.5 MB in flight, so a stream may have 16 MiB unacknowledged
/// and a connection (several tensors at once) 48 MiB. libp2p-quic does not expose quinn's send
/// window, which stays at quinn's default (10 MB): with it one connection moves at most about
/// 10 MB per round trip, ~100 MB/s at 100 ms RTT.
const STREAM_RECEIVE_WINDOW: u32 = 16 << 20;
const CONNECTION_RECEIVE_WINDOW: u32 = 48 << 20;
/// A silent peer is declared gone after this long. Keep-alives go out every 2 s, so a live
/// peer is never idle that long even when no tensor flows; 10 s leaves room for a peer whose
/// CPU is saturated by training (5 s cut live peers off on a loaded 2-core machine).
const IDLE_TIMEOUT_MS: u32 = 10_000;
const KEEP_ALIVE: Duration = Duration::from_secs(2);
/// How long libp2p keeps a connection no protocol needs (see `build_swarm`).
const SWARM_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);
/// A connected peer that has not joined the run's topic by then is disconnected (unless it is
/// a bootstrap peer or a relay this node uses): connection slots are for the run.
const OUTSIDE_RUN_GRACE: Duration = Duration::from_secs(60);
/// How often connections of peers outside the run, and of run peers whose subscriptions never
/// reached this node, are looked for.
const PRUNE_EVERY: Duration = Duration::from_secs(5);
/// A peer that forwards the run's gossip to this node although its subscription to the topic
/// never reached it, for this long, is reconnected (see `SwarmState::prune_outsiders`): longer
/// than the idle timeout, so that a connection the peer still held to this node's previous
/// life has closed by then and the new one is its first again.
const STALE_SUBSCRIPTIONS_AFTER: Duration = Duration::from_millis(IDLE_TIMEOUT_MS as u64 + 2_000);
/// Attempts at sending a frame that receivers drop unread because they are momentarily full.
const REFUSED_ATTEMPTS: u32 = 10;
/// Relays a node that AutoNAT finds unreachable listens through: two, so that losing one
/// leaves it reachable while it reserves a slot at another.
const RELAYS_BEHIND_NAT: usize = 2;
/// AutoNAT's first probe, once connections to peers that can dial back have come up.
const NAT_PROBE_DELAY: Duration = Duration::from_secs(5);
/// AutoNAT probes again this soon while its verdict is not yet confident (libp2p: 90 s).
const NAT_PROBE_RETRY: Duration = Duration::from_secs(30);

/// A random pause before sending a refused frame again: full jitter over a window that doubles
/// with each attempt (10 ms, 20 ms, ... up to 1 s), so that a burst of senders refused together
/// does not come back together.
fn refused_backoff(attempt: u32) -> Duration {
    let window_ms = (10u64 << attempt.min(7)).min(1000);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let noise = xxhash_rust::xxh3::xxh3_64(&nanos.to_le_bytes());
    Duration::from_millis(1 + noise % window_ms)
}

/// The QUIC transport settings of shoal's direct tensor endpoint (also used by the plain
/// quinn endpoint `shoal bench net` measures against).
pub fn quic_transport_config() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    // The direct endpoint can also size its send window (libp2p-quic cannot): as large as the
    // peer's connection receive window, so one connection can fill 1 Gbit/s at 100 ms RTT.
    t.send_window(CONNECTION_RECEIVE_WINDOW as u64);
    t.stream_receive_window(STREAM_RECEIVE_WINDOW.into());
    t.receive_window(CONNECTION_RECEIVE_WINDOW.into());
    t.keep_alive_interval(Some(KEEP_ALIVE));
    t.max_concurrent_bidi_streams(256u32.into());
    t
}

/// Decides whether a gossip message (its author, its bytes) is valid. A valid one is delivered
/// and forwarded; an invalid one is dropped and counts against the peer that relayed it in
/// gossipsub's peer score (a peer scored low enough is no longer gossiped with).
#[derive(Clone)]
pub struct GossipCheck(pub Arc<GossipCheckFn>);

/// The function inside a [`GossipCheck`]: the author and the bytes of a message.
pub type GossipCheckFn = dyn Fn(&PeerId, &[u8]) -> bool + Send + Sync;

impl std::fmt::Debug for GossipCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GossipCheck")
    }
}

/// How a node joins the network.
#[derive(Clone, Debug)]
pub struct NetConfig {
    /// Addresses to listen on.
    pub listen: Vec<Multiaddr>,
    /// Peers to dial at start.
    pub bootstrap: Vec<Multiaddr>,
    /// Find peers on the LAN by multicast DNS.
    pub mdns: bool,
    /// Serve as a circuit relay for peers behind NATs.
    pub relay_server: bool,
    /// The run (or public swarm) whose gossip topics this node joins.
    pub run: String,
    /// Caps on established connections: the least; the application raises it to what its
    /// run needs ([`NodeHandle::need_peers`]).
    pub max_connections: u32,
    /// Caps on connections per peer.
    pub max_connections_per_peer: u32,
    /// Caps on connections being set up.
    pub max_pending: u32,
    /// Caps on inbound connections from one IP address (both endpoints together).
    pub max_connections_per_ip: usize,
    /// Accept loopback, private and link-local addresses from identify and the DHT. Off by
    /// default (such an address names a host on someone else's network); on when a listen or
    /// bootstrap address is itself one (the run lives on a private network).
    pub allow_private: bool,
    /// Gossip validation; None accepts every signed message.
    pub gossip_check: Option<GossipCheck>,
    /// Caps on tensor streams and frames.
    pub transport: TransportLimits,
    /// Offer and use a direct QUIC endpoint for tensors (AES-GCM first) where peers are
    /// directly reachable; the libp2p stream serves everyone else.
    pub direct: bool,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            listen: vec![
                "/ip4/0.0.0.0/udp/0/quic-v1"
                    .parse()
                    .unwrap_or_else(|_| Multiaddr::empty()),
            ],
            bootstrap: Vec::new(),
            mdns: true,
            relay_server: false,
            run: "public".into(),
            max_connections: 256,
            max_connections_per_peer: 4,
            max_pending: 64,
            // A household or a small lab behind one address, each peer with a libp2p and a
            // direct connection; far below `max_connections`.
            max_connections_per_ip: 16,
            allow_private: false,
            gossip_check: None,
            transport: TransportLimits::default(),
            direct: true,
        }
    }
}

/// What the network tells the application.
#[derive(Clone, Debug)]
pub enum NodeEvent {
    /// A listen address is ready (with `/p2p/<id>` appended).
    Listening(Multiaddr),
    /// A connection to a peer is up.
    Connected(PeerId),
    /// The last connection to a peer closed (it left, crashed or became unreachable).
    Disconnected(PeerId),
    /// A shoal peer was identified and added to the routing table.
    Discovered(PeerId),
    /// A gossip message on the run's topic that passed [`NetConfig::gossip_check`].
    Gossip {
        /// The author (messages are signed).
        from: PeerId,
        /// The peer that relayed it here (the author, or a peer of the gossip mesh).
        via: PeerId,
        /// The message.
        data: Vec<u8>,
    },
    /// A relay reservation was accepted: reachable through `relay` now.
    RelayReservation(Multiaddr),
    /// AutoNAT's verdict changed: others can dial this node at the address, or cannot (it is
    /// behind a NAT or a firewall, and listens through relays of its own choosing).
    Reachability(Option<Multiaddr>),
    /// A direct connection replaced a relayed one (hole punching worked).
    HolePunched(PeerId),
    /// Hole punching to a peer failed: what passes between the two goes through a relay.
    HolePunchFailed(PeerId, String),
    /// libp2p's ping measured the round trip to a peer.
    Rtt(PeerId, Duration),
}

enum Command {
    Publish(Vec<u8>, oneshot::Sender<anyhow::Result<()>>),
    Dial(Multiaddr),
    Listen(Multiaddr),
    Peers(oneshot::Sender<Vec<PeerId>>),
    Ban(PeerId),
    /// Established connections allowed at once from now on.
    MaxConnections(u32),
}

/// Direct endpoints that peers advertised, by PeerId.
type DirectAddrs = Arc<Mutex<HashMap<PeerId, SocketAddr>>>;

/// The application's side of a running node.
#[derive(Clone)]
pub struct NodeHandle {
    /// This node's PeerId.
    pub peer_id: PeerId,
    commands: mpsc::Sender<Command>,
    streams: libp2p_stream::Control,
    limits: TransportLimits,
    direct: Option<Arc<direct::DirectEndpoint>>,
    direct_addrs: DirectAddrs,
    admission: tensor::Admission,
    /// The configured caps: the least [`NodeHandle::need_peers`] leaves.
    floor: Caps,
}

/// A node's caps on established connections and on inbound tensor streams open at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// Established connections, libp2p's and the direct endpoint's inbound ones each.
    pub connections: u32,
    /// Inbound tensor streams open at once, in total.
    pub streams: usize,
}

/// Connections per peer needed: a libp2p one, and room for a second while a peer redials, is
/// reached directly after a relayed connection (hole punching), or uses the direct endpoint.
pub const CONNECTIONS_PER_PEER_NEEDED: usize = 2;

/// Inbound tensor streams open at once per peer needed: a stage's replicas send a round's
/// shares, parts and verdicts within moments of each other, and a neighbour stage's peer a
/// microbatch while another is on its way. What streams hold is bounded apart, by
/// [`TransportLimits::queued_bytes`].
pub const STREAMS_PER_PEER_NEEDED: usize = 2;

/// The most either cap is ever raised to: a run past this would need a node per stage
/// neighbourhood of more than 8,000 peers.
const MAX_CAP: usize = 16_384;

impl Caps {
    /// The caps for `peers` peers needed at once (what the protocol counts: a stage and the
    /// stages next to it, its gossip mesh and the network's own), never below `self`.
    pub fn for_peers(self, peers: usize) -> Caps {
        let connections = peers
            .saturating_mul(CONNECTIONS_PER_PEER_NEEDED)
            .min(MAX_CAP) as u32;
        let streams = peers.saturating_mul(STREAMS_PER_PEER_NEEDED).min(MAX_CAP);
        Caps {
            connections: connections.max(self.connections),
            streams: streams.max(self.streams),
        }
    }
}

impl NodeHandle {
    /// Sizes the caps on connections (libp2p and direct) and on inbound tensor streams for
    /// `peers` peers needed at once ([`Caps::for_peers`]): a large run's stages need more
    /// than the configured caps, which stay the least. Returns the caps now in force.
    pub async fn need_peers(&self, peers: usize) -> anyhow::Result<Caps> {
        let caps = self.floor.for_peers(peers);
        self.admission.set_streams_total(caps.streams);
        if let Some(endpoint) = &self.direct {
            endpoint.set_max_inbound(caps.connections as usize);
        }
        self.commands
            .send(Command::MaxConnections(caps.connections))
            .await
            .context("node stopped")?;
        Ok(caps)
    }

    /// Publishes `data` on the run's gossip topic.
    pub async fn publish(&self, data: Vec<u8>) -> anyhow::Result<()> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(Command::Publish(data, tx))
            .await
            .context("node stopped")?;
        rx.await.context("node stopped")?
    }

    /// Dials an address.
    pub async fn dial(&self, addr: Multiaddr) -> anyhow::Result<()> {
        self.commands
            .send(Command::Dial(addr))
            .await
            .context("node stopped")
    }

    /// Listens on another address (e.g. a relay circuit).
    pub async fn listen(&self, addr: Multiaddr) -> anyhow::Result<()> {
        self.commands
            .send(Command::Listen(addr))
            .await
            .context("node stopped")
    }

    /// Peers connected now.
    pub async fn peers(&self) -> anyhow::Result<Vec<PeerId>> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(Command::Peers(tx))
            .await
            .context("node stopped")?;
        rx.await.context("node stopped")
    }

    /// Cuts `peer` off for the rest of this node's life: its connections close, new ones are
    /// refused (libp2p and direct alike), its gossip is ignored and it leaves the routing
    /// table. For a peer the protocol banned: dropping its messages is not enough when it
    /// may still hold connection slots and stream budgets.
    pub async fn ban(&self, peer: PeerId) -> anyhow::Result<()> {
        if let Some(endpoint) = &self.direct {
            endpoint.ban(peer);
        }
        self.direct_addrs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&peer);
        self.commands
            .send(Command::Ban(peer))
            .await
            .context("node stopped")
    }

    /// Opens a raw tensor stream to `peer`, for tools that speak the framing themselves.
    pub async fn open_tensor_stream(
        &self,
        peer: PeerId,
    ) -> Result<libp2p::Stream, tensor::SendError> {
        let mut control = self.streams.clone();
        tensor::open_stream(&mut control, peer).await
    }

    /// The direct endpoint `peer` advertised, if it did.
    pub fn direct_addr(&self, peer: PeerId) -> Option<SocketAddr> {
        self.direct_addrs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&peer)
            .copied()
    }

    /// Opens a raw stream to `peer`'s direct endpoint (for tools that speak the framing
    /// themselves); fails if either side has none.
    pub async fn open_direct_stream(&self, peer: PeerId) -> std::io::Result<direct::DirectStream> {
        let none = || std::io::Error::new(std::io::ErrorKind::NotFound, "no direct endpoint");
        let endpoint = self.direct.as_ref().ok_or_else(none)?;
        let addr = self.direct_addr(peer).ok_or_else(none)?;
        endpoint.open_stream(peer, addr).await
    }

    /// Sends one frame to `peer` on its own stream; resolves once the peer has it. Uses the
    /// peer's direct endpoint when it has one that answers, the libp2p connection otherwise.
    ///
    /// A receiver that is momentarily full drops a new stream unread (its stream caps, or
    /// libp2p-stream's inbound queue, which holds a single stream between two polls of the
    /// accepting task): the frame was not delivered, so it is sent again after a pause.
    pub async fn send_frame(
        &self,
        peer: PeerId,
        kind: shoal_protocol::FrameKind,
        payload: &[u8],
    ) -> Result<(), tensor::SendError> {
        tensor::check_sendable(payload, &self.limits)?;
        let mut attempt = 1;
        loop {
            match self.send_frame_once(peer, kind, payload).await {
                Err(e) if e.refused_unread() && attempt < REFUSED_ATTEMPTS => {
                    tracing::debug!(%peer, attempt, "tensor stream refused, sending again: {e}");
                    tokio::time::sleep(refused_backoff(attempt)).await;
                    attempt += 1;
                }
                result => return result,
            }
        }
    }

    async fn send_frame_once(
        &self,
        peer: PeerId,
        kind: shoal_protocol::FrameKind,
        payload: &[u8],
    ) -> Result<(), tensor::SendError> {
        let addr = self
            .direct_addrs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&peer)
            .copied();
        if let (Some(endpoint), Some(addr)) = (&self.direct, addr) {
            match endpoint.open_stream(peer, addr).await {
                Ok(mut stream) => {
                    let result = tensor::write_frame(&mut stream, kind, payload, &self.limits)
                        .await
                        .map_err(|source| tensor::SendError::Io { peer, source });
                    if result.as_ref().is_err_and(|e| !e.refused_unread()) {
                        // A dead connection (the peer crashed or restarted): start over, over
                        // libp2p until the peer's identify names a direct address again.
                        endpoint.forget(peer);
                        self.direct_addrs
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .remove(&peer);
                    }
                    return result;
                }
                Err(e) => {
                    // Not reachable directly (NAT, firewall): libp2p from now on.
                    tracing::debug!(%peer, %addr, "direct endpoint unreachable, using libp2p: {e}");
                    self.direct_addrs
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&peer);
                }
            }
        }
        let mut control = self.streams.clone();
        tensor::send_frame(&mut control, peer, kind, payload, &self.limits).await
    }
}

#[derive(NetworkBehaviour)]
struct Behaviour {
    banned: allow_block_list::Behaviour<allow_block_list::BlockedPeers>,
    limits: connection_limits::Behaviour,
    ip_limits: ip_limits::Behaviour,
    identify: identify::Behaviour,
    kad: kad::Behaviour<kad::store::MemoryStore>,
    gossipsub: gossipsub::Behaviour,
    mdns: Toggle<mdns::tokio::Behaviour>,
    autonat: autonat::Behaviour,
    relay_client: relay::client::Behaviour,
    relay_server: Toggle<relay::Behaviour>,
    dcutr: dcutr::Behaviour,
    ping: ping::Behaviour,
    streams: libp2p_stream::Behaviour,
}

/// identify's agent version, which also advertises the direct endpoint's UDP port.
fn agent_version(direct_port: Option<u16>) -> String {
    let version = env!("CARGO_PKG_VERSION");
    match direct_port {
        Some(port) => format!("shoal/{version} {DIRECT_TAG}{port}"),
        None => format!("shoal/{version}"),
    }
}

const DIRECT_TAG: &str = "direct-udp=";

fn advertised_direct_port(agent: &str) -> Option<u16> {
    agent
        .split_whitespace()
        .find_map(|w| w.strip_prefix(DIRECT_TAG)?.parse().ok())
}

fn build_swarm(
    key: Keypair,
    config: &NetConfig,
    direct_port: Option<u16>,
    ip_slots: ip_limits::IpSlots,
) -> anyhow::Result<Swarm<Behaviour>> {
    let swarm = libp2p::SwarmBuilder::with_existing_identity(key)
        .with_tokio()
        .with_quic_config(|mut quic| {
            quic.max_stream_data = STREAM_RECEIVE_WINDOW;
            quic.max_connection_data = CONNECTION_RECEIVE_WINDOW;
            quic.max_idle_timeout = IDLE_TIMEOUT_MS;
            quic.keep_alive_interval = KEEP_ALIVE;
            // Streams per connection: tensor streams are capped per peer well below this.
            quic.max_concurrent_stream_limit = 256;
            quic
        })
        .with_relay_client(noise::Config::new, yamux::Config::default)?
        .with_behaviour(|key, relay_client| {
            let peer_id = key.public().to_peer_id();
            let limits = connection_limits::ConnectionLimits::default()
                .with_max_established(Some(config.max_connections))
                .with_max_established_per_peer(Some(config.max_connections_per_peer))
                .with_max_pending_incoming(Some(config.max_pending))
                .with_max_pending_outgoing(Some(config.max_pending));
            let mut kad_config = kad::Config::new(KAD_PROTOCOL);
            kad_config.set_periodic_bootstrap_interval(Some(Duration::from_secs(30)));
            // Addresses enter the routing table only through `SwarmState`, which filters them.
            kad_config.set_kbucket_inserts(kad::BucketInserts::Manual);
            let mut kad = kad::Behaviour::with_config(
                peer_id,
                kad::store::MemoryStore::new(peer_id),
                kad_config,
            );
            // Every shoal node answers DHT queries: peers of a run are few and reachable.
            kad.set_mode(Some(kad::Mode::Server));
            let gossip_config = gossipsub::ConfigBuilder::default()
                .heartbeat_interval(Duration::from_millis(500))
                .validation_mode(gossipsub::ValidationMode::Strict)
                .max_transmit_size(64 * 1024)
                // Ids travel in every IHAVE a peer sends a few neighbours each heartbeat: 8
                // bytes of the signed message's hash, not the default's ~70 bytes of peer id and
                // sequence number.
                .message_id_fn(|m| {
                    let mut h = xxhash_rust::xxh3::Xxh3Default::new();
                    h.update(&m.source.map(|p| p.to_bytes()).unwrap_or_default());
                    h.update(&m.sequence_number.unwrap_or_default().to_le_bytes());
                    h.update(&m.data);
                    gossipsub::MessageId::from(h.digest().to_le_bytes().to_vec())
                })
                // Messages are delivered and forwarded only once `GossipCheck` accepts them.
                .validate_messages()
                .build()
                .map_err(|e| anyhow::anyhow!("gossipsub config: {e}"))?;
            let mut gossipsub = gossipsub::Behaviour::new(
                gossipsub::MessageAuthenticity::Signed(key.clone()),
                gossip_config,
            )
            .map_err(|e| anyhow::anyhow!("gossipsub: {e}"))?;
            gossipsub
                .with_peer_score(
                    gossip_score_params(&topic(&config.run)),
                    gossipsub::PeerScoreThresholds::default(),
                )
                .map_err(|e| anyhow::anyhow!("gossipsub peer scoring: {e}"))?;
            let mdns = if config.mdns {
                Some(mdns::tokio::Behaviour::new(
                    mdns::Config::default(),
                    peer_id,
                )?)
            } else {
                None
            };
            let relay_server = config.relay_server.then(|| {
                // libp2p's defaults (128 KiB and 2 minutes per circuit) suit signalling, not
                // tensors: a relayed peer must be able to take part until hole punching or a
                // direct route replaces the circuit.
                let relay_config = relay::Config {
                    max_circuit_bytes: 1 << 30,
                    max_circuit_duration: Duration::from_secs(3600),
                    ..relay::Config::default()
                };
                relay::Behaviour::new(peer_id, relay_config)
            });
            Ok(Behaviour {
                banned: allow_block_list::Behaviour::default(),
                limits: connection_limits::Behaviour::new(limits),
                ip_limits: ip_limits::Behaviour::new(ip_slots),
                identify: identify::Behaviour::new(
                    identify::Config::new(IDENTIFY_VERSION.into(), key.public())
                        .with_agent_version(agent_version(direct_port))
                        // A relay circuit listened on later must reach the peers already
                        // connected, or they could not dial back a peer behind a NAT.
                        .with_push_listen_addr_updates(true),
                ),
                kad,
                gossipsub,
                mdns: mdns.into(),
                autonat: autonat::Behaviour::new(
                    peer_id,
                    autonat::Config {
                        boot_delay: NAT_PROBE_DELAY,
                        retry_interval: NAT_PROBE_RETRY,
                        // On a private network (a lab, a test), its peers' addresses are the
                        // ones to probe.
                        only_global_ips: !config.allow_private,
                        ..autonat::Config::default()
                    },
                ),
                relay_client,
                relay_server: relay_server.into(),
                dcutr: dcutr::Behaviour::new(peer_id),
                ping: ping::Behaviour::new(ping::Config::new()),
                streams: libp2p_stream::Behaviour::new(),
            })
        })?
        // Peers of a run stay connected while they live: tensors may flow on the direct endpoint
        // for minutes while the libp2p connection only carries gossip, and libp2p would
        // otherwise close it as idle. Dead peers are still noticed by QUIC's idle timeout.
        .with_swarm_config(|c| c.with_idle_connection_timeout(SWARM_IDLE_TIMEOUT))
        .build();
    Ok(swarm)
}

/// Peer scoring on the run's topic: invalid messages weigh heavily and are forgiven slowly
/// (three in a row take a peer below the graylist threshold, where its messages are ignored);
/// a quiet peer is not penalised (announcements are few in a small run); and up to as many
/// peers share an IP address as it may hold connections.
fn gossip_score_params(topic: &gossipsub::IdentTopic) -> gossipsub::PeerScoreParams {
    let topic_params = gossipsub::TopicScoreParams {
        topic_weight: 1.0,
        mesh_message_deliveries_weight: 0.0,
        mesh_failure_penalty_weight: 0.0,
        invalid_message_deliveries_weight: -10.0,
        invalid_message_deliveries_decay: 0.9,
        ..gossipsub::TopicScoreParams::default()
    };
    let mut params = gossipsub::PeerScoreParams {
        ip_colocation_factor_threshold: 16.0,
        ..gossipsub::PeerScoreParams::default()
    };
    params.topics.insert(topic.hash(), topic_params);
    params
}

/// Whether an address names a host anyone may reach: not loopback, private, link-local,
/// shared (CGNAT), unspecified or documentation space. Addresses without an IP (DNS names,
/// relay circuits) are judged by whoever resolves them.
pub fn is_global(addr: &Multiaddr) -> bool {
    match multiaddr_ip(addr) {
        Some(IpAddr::V4(ip)) => {
            let [a, b, ..] = ip.octets();
            !(ip.is_loopback()
                || ip.is_private()
                || ip.is_link_local()
                || ip.is_unspecified()
                || ip.is_broadcast()
                || ip.is_documentation()
                || (a == 100 && (64..128).contains(&b)))
        }
        Some(IpAddr::V6(ip)) => {
            let first = ip.segments()[0];
            !(ip.is_loopback()
                || ip.is_unspecified()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80)
        }
        None => true,
    }
}

/// The gossip topic of a run.
fn topic(run: &str) -> gossipsub::IdentTopic {
    gossipsub::IdentTopic::new(format!("shoal/{run}/announce/1"))
}

/// Starts a node: listens, dials the bootstrap peers and runs the swarm on a tokio task.
pub async fn start(
    key: Keypair,
    config: NetConfig,
) -> anyhow::Result<(
    NodeHandle,
    mpsc::Receiver<NodeEvent>,
    mpsc::Receiver<InboundFrame>,
)> {
    let peer_id = key.public().to_peer_id();
    let ip_slots = ip_limits::IpSlots::new(config.max_connections_per_ip);
    let unspecified = |a: &Multiaddr| multiaddr_ip(a).is_some_and(|ip| ip.is_unspecified());
    let allow_private = config.allow_private
        || config
            .listen
            .iter()
            .chain(&config.bootstrap)
            .any(|a| !unspecified(a) && !is_global(a));
    let config = NetConfig {
        allow_private,
        ..config
    };
    let direct = if config.direct {
        // Bind on the host of the first IP listen address (any interface otherwise).
        let ip = config
            .listen
            .iter()
            .find_map(multiaddr_ip)
            .unwrap_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
        Some(direct::DirectEndpoint::bind(
            &key,
            SocketAddr::new(ip, 0),
            config.max_connections as usize,
            ip_slots.clone(),
        )?)
    } else {
        None
    };
    let mut swarm = build_swarm(key, &config, direct.as_ref().map(|d| d.port()), ip_slots)?;
    let topic = topic(&config.run);
    swarm.behaviour_mut().gossipsub.subscribe(&topic)?;
    for addr in &config.listen {
        swarm
            .listen_on(addr.clone())
            .with_context(|| format!("cannot listen on {addr}"))?;
    }
    for addr in &config.bootstrap {
        if let Some(Protocol::P2p(peer)) = addr.iter().last() {
            swarm.behaviour_mut().kad.add_address(&peer, addr.clone());
        }
        swarm
            .dial(addr.clone())
            .with_context(|| format!("cannot dial {addr}"))?;
    }
    let mut streams = swarm.behaviour().streams.new_control();
    let incoming = streams
        .accept(tensor::TENSOR_PROTOCOL)
        .map_err(|e| anyhow::anyhow!("tensor protocol: {e}"))?;
    // Bounded queues: a slow application applies backpressure instead of growing memory.
    let (event_tx, event_rx) = mpsc::channel(1024);
    let (frame_tx, frame_rx) = mpsc::channel(16);
    let (command_tx, command_rx) = mpsc::channel(64);
    let admission = tensor::Admission::new(config.transport, frame_tx);
    if let Some(endpoint) = &direct {
        let admission = admission.clone();
        tokio::spawn(
            endpoint
                .clone()
                .accept(move |peer, stream| admission.admit(peer, stream)),
        );
    }
    tokio::spawn(tensor::accept_frames(incoming, admission.clone()));
    let direct_addrs = DirectAddrs::default();
    let state = events::SwarmState {
        local: peer_id,
        relay_server: config.relay_server,
        direct_addrs: direct_addrs.clone(),
        discovered: HashSet::new(),
        pending_circuits: Vec::new(),
        nat: events::NatTraversal::default(),
        remote_ips: HashMap::new(),
        allow_private,
        gossip_check: config.gossip_check.clone(),
        topic: topic.hash(),
        kept: config
            .bootstrap
            .iter()
            .filter_map(|a| match a.iter().last() {
                Some(Protocol::P2p(peer)) => Some(peer),
                _ => None,
            })
            .collect(),
        connected_since: HashMap::new(),
        subscribed: HashSet::new(),
        unsubscribed_gossip: HashMap::new(),
        redial: HashSet::new(),
    };
    tokio::spawn(events::event_loop(
        swarm, topic, state, command_rx, event_tx,
    ));
    let handle = NodeHandle {
        peer_id,
        commands: command_tx,
        streams,
        limits: config.transport,
        direct,
        direct_addrs,
        admission,
        floor: Caps {
            connections: config.max_connections,
            streams: config.transport.streams_total,
        },
    };
    Ok((handle, event_rx, frame_rx))
}

/// The IP address in a multiaddr, if it has one.
fn multiaddr_ip(addr: &Multiaddr) -> Option<IpAddr> {
    addr.iter().find_map(|p| match p {
        Protocol::Ip4(ip) => Some(IpAddr::V4(ip)),
        Protocol::Ip6(ip) => Some(IpAddr::V6(ip)),
        _ => None,
    })
}

fn listen(swarm: &mut Swarm<Behaviour>, addr: Multiaddr) {
    if let Err(e) = swarm.listen_on(addr.clone()) {
        tracing::warn!(%addr, "listen failed: {e}");
    }
}

/// The relay of a `.../p2p/<relay>/p2p-circuit` address.
fn circuit_relay(addr: &Multiaddr) -> Option<PeerId> {
    let mut relay = None;
    for p in addr.iter() {
        match p {
            Protocol::P2p(peer) => relay = Some(peer),
            Protocol::P2pCircuit => return relay,
            _ => {}
        }
    }
    None
}

/// The part of a circuit address that reaches the relay itself.
fn relay_address(addr: &Multiaddr) -> Multiaddr {
    addr.iter()
        .take_while(|p| !matches!(p, Protocol::P2pCircuit))
        .collect()
}

/// `addr` with `/p2p/<peer>` at the end, unless it already ends with it.
fn with_peer(addr: Multiaddr, peer: PeerId) -> Multiaddr {
    match addr.iter().last() {
        Some(Protocol::P2p(p)) if p == peer => addr,
        _ => addr.with(Protocol::P2p(peer)),
    }
}

#[cfg(test)]
mod tests;
