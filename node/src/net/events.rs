//! The swarm's event loop: the application's commands, and what the swarm's events mean for
//! the node (addresses, discovery, gossip validation, relays, peers outside the run).

use super::*;

pub(super) async fn event_loop(
    mut swarm: Swarm<Behaviour>,
    topic: gossipsub::IdentTopic,
    mut state: SwarmState,
    mut commands: mpsc::Receiver<Command>,
    events: mpsc::Sender<NodeEvent>,
) {
    let mut prune = tokio::time::interval(PRUNE_EVERY);
    loop {
        tokio::select! {
            _ = prune.tick() => state.prune_outsiders(&mut swarm),
            command = commands.recv() => match command {
                None => break,
                Some(Command::Publish(data, reply)) => {
                    let result = swarm
                        .behaviour_mut()
                        .gossipsub
                        .publish(topic.clone(), data)
                        .map(|_| ())
                        .map_err(|e| anyhow::anyhow!("gossip publish: {e}"));
                    let _ = reply.send(result);
                }
                Some(Command::Dial(addr)) => {
                    if let Err(e) = swarm.dial(addr.clone()) {
                        tracing::warn!(%addr, "dial failed: {e}");
                    }
                }
                Some(Command::Listen(addr)) => {
                    // A relay circuit can only be reserved over a connection to the relay: wait
                    // for it (the reservation would otherwise race the dial and be dropped).
                    match circuit_relay(&addr) {
                        Some(relay) if !swarm.is_connected(&relay) => {
                            if let Err(e) = swarm.dial(relay_address(&addr)) {
                                tracing::warn!(%addr, "cannot dial the relay: {e}");
                            }
                            state.pending_circuits.push((relay, addr));
                        }
                        _ => listen(&mut swarm, addr),
                    }
                }
                Some(Command::Peers(reply)) => {
                    let _ = reply.send(swarm.connected_peers().copied().collect());
                }
                Some(Command::MaxConnections(n)) => {
                    let limits = swarm.behaviour_mut().limits.limits_mut();
                    *limits = limits.clone().with_max_established(Some(n));
                }
                Some(Command::Ban(peer)) => {
                    tracing::info!(%peer, "cutting off a banned peer");
                    // Blocking closes its connections and refuses new ones.
                    let behaviour = swarm.behaviour_mut();
                    behaviour.banned.block_peer(peer);
                    behaviour.gossipsub.blacklist_peer(&peer);
                    behaviour.kad.remove_peer(&peer);
                    state.discovered.remove(&peer);
                    state.kept.remove(&peer);
                }
            },
            event = swarm.select_next_some() => {
                for e in state.handle(&mut swarm, event) {
                    // The application is slow: drop this event rather than block the swarm
                    // (which would stall every connection).
                    if events.try_send(e).is_err() {
                        tracing::warn!("node event queue full; dropping an event");
                    }
                }
            }
        }
    }
}

/// What the event loop remembers between swarm events.
pub(super) struct SwarmState {
    pub(super) local: PeerId,
    pub(super) relay_server: bool,
    /// Shared with the handle: where each peer's direct endpoint is.
    pub(super) direct_addrs: DirectAddrs,
    /// Shoal peers identified so far.
    pub(super) discovered: HashSet<PeerId>,
    /// Relay circuits to listen on once the relay is connected.
    pub(super) pending_circuits: Vec<(PeerId, Multiaddr)>,
    /// What AutoNAT found, and the relays this node listens through because of it.
    pub(super) nat: NatTraversal,
    /// The IP each peer's (non-relayed) connection comes from: where its direct endpoint is.
    pub(super) remote_ips: HashMap<PeerId, IpAddr>,
    /// Whether non-global addresses are accepted (see [`NetConfig::allow_private`]).
    pub(super) allow_private: bool,
    /// Gossip validation.
    pub(super) gossip_check: Option<GossipCheck>,
    /// The run's topic.
    pub(super) topic: gossipsub::TopicHash,
    /// Peers never pruned: bootstrap peers and relays this node uses.
    pub(super) kept: HashSet<PeerId>,
    /// When each connected peer's first connection came up.
    pub(super) connected_since: HashMap<PeerId, std::time::Instant>,
    /// Peers known here to subscribe to the run's topic.
    pub(super) subscribed: HashSet<PeerId>,
    /// Peers that forwarded the run's gossip here while their subscription to the topic was
    /// unknown here, since when.
    pub(super) unsubscribed_gossip: HashMap<PeerId, std::time::Instant>,
    /// Peers disconnected to be dialled again once their last connection has closed.
    pub(super) redial: HashSet<PeerId>,
}

impl SwarmState {
    /// Disconnects peers connected for longer than [`OUTSIDE_RUN_GRACE`] that have not joined
    /// the run's topic, and reconnects run peers whose subscriptions never reached this node.
    ///
    /// gossipsub sends its subscriptions only on a peer's first connection. When this node
    /// restarts under the same identity, its neighbours still hold a connection to its previous
    /// life until that times out, so the new connection is not their first: they never tell
    /// this node what they subscribe to, and it can publish to nobody (and would prune them as
    /// outsiders). They do forward the run's gossip here; once that has gone on for
    /// [`STALE_SUBSCRIPTIONS_AFTER`], the old connection is gone at their end, and a fresh
    /// connection makes them send their subscriptions again.
    pub(super) fn prune_outsiders(&mut self, swarm: &mut Swarm<Behaviour>) {
        let in_run = &self.subscribed;
        self.unsubscribed_gossip
            .retain(|p, _| !in_run.contains(p) && swarm.is_connected(p));
        let stale: Vec<PeerId> = self
            .unsubscribed_gossip
            .iter()
            .filter(|(_, since)| since.elapsed() > STALE_SUBSCRIPTIONS_AFTER)
            .map(|(p, _)| *p)
            .collect();
        for peer in stale {
            tracing::info!(%peer, "reconnecting: its subscriptions never reached this node");
            self.unsubscribed_gossip.remove(&peer);
            self.redial.insert(peer);
            let _ = swarm.disconnect_peer_id(peer);
        }
        if self.relay_server {
            // A relay serves peers of any run: its circuits and reservations need their
            // connections, and its connection caps bound what they hold.
            return;
        }
        let outsiders: Vec<PeerId> = self
            .connected_since
            .iter()
            .filter(|(p, since)| {
                since.elapsed() > OUTSIDE_RUN_GRACE
                    && !in_run.contains(p)
                    && !self.kept.contains(p)
                    && !self.redial.contains(p)
            })
            .map(|(p, _)| *p)
            .collect();
        for peer in outsiders {
            tracing::debug!(%peer, "disconnecting a peer outside the run");
            self.connected_since.remove(&peer);
            let _ = swarm.disconnect_peer_id(peer);
        }
    }

    /// Whether `addr` may enter the routing table or be dialled for discovery.
    fn admissible(&self, addr: &Multiaddr) -> bool {
        self.allow_private || is_global(addr)
    }

    /// Acts on one swarm event; returns what the application should hear of it.
    fn handle(
        &mut self,
        swarm: &mut Swarm<Behaviour>,
        event: SwarmEvent<BehaviourEvent>,
    ) -> Vec<NodeEvent> {
        let mut out = Vec::new();
        match event {
            SwarmEvent::NewListenAddr { address, .. } => {
                // A relay serves only from confirmed external addresses. Whoever runs a node
                // with --relay-server declares it reachable where it listens (AutoNAT confirms
                // addresses of ordinary nodes).
                if self.relay_server {
                    swarm.add_external_address(address.clone());
                }
                out.push(NodeEvent::Listening(with_peer(address, self.local)));
            }
            SwarmEvent::ConnectionEstablished {
                peer_id,
                num_established,
                endpoint,
                ..
            } => {
                let addr = endpoint.get_remote_address();
                let relayed = addr.iter().any(|p| matches!(p, Protocol::P2pCircuit));
                if let (false, Some(ip)) = (relayed, multiaddr_ip(addr)) {
                    self.remote_ips.insert(peer_id, ip);
                }
                let (ready, waiting) = std::mem::take(&mut self.pending_circuits)
                    .into_iter()
                    .partition(|(relay, _)| *relay == peer_id);
                self.pending_circuits = waiting;
                for (relay, addr) in ready {
                    self.kept.insert(relay);
                    listen(swarm, addr);
                }
                if num_established.get() == 1 {
                    self.connected_since
                        .insert(peer_id, std::time::Instant::now());
                    out.push(NodeEvent::Connected(peer_id));
                }
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                num_established: 0,
                ..
            } => {
                self.nat.relays.remove(&peer_id);
                self.remote_ips.remove(&peer_id);
                self.connected_since.remove(&peer_id);
                self.subscribed.remove(&peer_id);
                if self.redial.remove(&peer_id) {
                    // Known to Kademlia, which holds its listen addresses.
                    if let Err(e) = swarm.dial(peer_id) {
                        tracing::debug!(peer = %peer_id, "redial failed: {e}");
                    }
                }
                self.direct_addrs
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&peer_id);
                out.push(NodeEvent::Disconnected(peer_id));
            }
            SwarmEvent::Behaviour(BehaviourEvent::Identify(identify::Event::Received {
                peer_id,
                info,
                ..
            })) if info.protocol_version == IDENTIFY_VERSION => {
                if let (Some(port), Some(ip)) = (
                    advertised_direct_port(&info.agent_version),
                    self.remote_ips.get(&peer_id),
                ) {
                    self.direct_addrs
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(peer_id, SocketAddr::new(*ip, port));
                }
                for addr in &info.listen_addrs {
                    if self.admissible(addr) {
                        swarm
                            .behaviour_mut()
                            .kad
                            .add_address(&peer_id, addr.clone());
                    }
                }
                if info.protocols.contains(&relay::HOP_PROTOCOL_NAME) {
                    // Where this node reaches the relay: the listen address it advertises on
                    // the IP our connection to it comes from.
                    let ip = self.remote_ips.get(&peer_id);
                    let at = info.listen_addrs.iter().find(|a| {
                        multiaddr_ip(a).as_ref() == ip
                            && !a.iter().any(|p| matches!(p, Protocol::P2pCircuit))
                    });
                    if let Some(at) = at {
                        self.nat.relays.insert(peer_id, at.clone());
                        self.nat.reserve(swarm, &mut self.kept);
                    }
                }
                if self.discovered.insert(peer_id) {
                    out.push(NodeEvent::Discovered(peer_id));
                    // Learn who else our new neighbour knows.
                    let _ = swarm.behaviour_mut().kad.bootstrap();
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Kad(
                kad::Event::RoutablePeer { peer, address }
                | kad::Event::PendingRoutablePeer { peer, address },
            )) if self.admissible(&address) => {
                swarm.behaviour_mut().kad.add_address(&peer, address);
            }
            SwarmEvent::Behaviour(BehaviourEvent::Kad(kad::Event::RoutingUpdated {
                peer, ..
            })) if !swarm.is_connected(&peer) => {
                // Peers found through the DHT: connect, so gossip and tensors can flow.
                let _ = swarm.dial(peer);
            }
            SwarmEvent::Behaviour(BehaviourEvent::Mdns(mdns::Event::Discovered(found))) => {
                for (peer, addr) in found {
                    swarm.behaviour_mut().kad.add_address(&peer, addr.clone());
                    if !swarm.is_connected(&peer) {
                        let _ = swarm.dial(addr);
                    }
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(gossipsub::Event::Message {
                propagation_source,
                message_id,
                message,
            })) => {
                let valid = message.source.filter(|from| {
                    self.gossip_check
                        .as_ref()
                        .is_none_or(|check| (check.0)(from, &message.data))
                });
                let verdict = match valid {
                    Some(_) => gossipsub::MessageAcceptance::Accept,
                    None => gossipsub::MessageAcceptance::Reject,
                };
                swarm
                    .behaviour_mut()
                    .gossipsub
                    .report_message_validation_result(&message_id, &propagation_source, verdict);
                if let Some(from) = valid {
                    if !self.subscribed.contains(&propagation_source) {
                        self.unsubscribed_gossip
                            .entry(propagation_source)
                            .or_insert_with(std::time::Instant::now);
                    }
                    out.push(NodeEvent::Gossip {
                        from,
                        via: propagation_source,
                        data: message.data,
                    });
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(gossipsub::Event::Subscribed {
                peer_id,
                topic,
            })) if topic == self.topic => {
                self.subscribed.insert(peer_id);
                self.unsubscribed_gossip.remove(&peer_id);
            }
            SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(gossipsub::Event::Unsubscribed {
                peer_id,
                topic,
            })) if topic == self.topic => {
                self.subscribed.remove(&peer_id);
            }
            SwarmEvent::Behaviour(BehaviourEvent::RelayClient(
                relay::client::Event::ReservationReqAccepted { relay_peer_id, .. },
            )) => {
                self.kept.insert(relay_peer_id);
                out.push(NodeEvent::RelayReservation(
                    Multiaddr::empty()
                        .with(Protocol::P2p(relay_peer_id))
                        .with(Protocol::P2pCircuit),
                ));
            }
            SwarmEvent::Behaviour(BehaviourEvent::Autonat(autonat::Event::StatusChanged {
                new,
                ..
            })) => {
                tracing::info!("AutoNAT: {new:?}");
                self.nat.behind_nat = new == autonat::NatStatus::Private;
                self.nat.reserve(swarm, &mut self.kept);
                match new {
                    autonat::NatStatus::Public(addr) => {
                        out.push(NodeEvent::Reachability(Some(addr)));
                    }
                    autonat::NatStatus::Private => out.push(NodeEvent::Reachability(None)),
                    autonat::NatStatus::Unknown => {}
                }
            }
            SwarmEvent::ListenerClosed {
                listener_id,
                reason,
                ..
            } => {
                if let Some(relay) = self.nat.circuits.remove(&listener_id) {
                    // The relay went away or refused the reservation: it is tried again once
                    // identify offers it anew; another relay takes its place now.
                    tracing::info!(%relay, "no longer listening through the relay: {reason:?}");
                    self.nat.relays.remove(&relay);
                    self.nat.reserve(swarm, &mut self.kept);
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Dcutr(dcutr::Event {
                remote_peer_id,
                result,
            })) => out.push(match result {
                Ok(_) => NodeEvent::HolePunched(remote_peer_id),
                Err(e) => NodeEvent::HolePunchFailed(remote_peer_id, e.to_string()),
            }),
            SwarmEvent::Behaviour(BehaviourEvent::Ping(ping::Event {
                peer,
                result: Ok(rtt),
                ..
            })) => out.push(NodeEvent::Rtt(peer, rtt)),
            SwarmEvent::IncomingConnectionError {
                error,
                send_back_addr,
                ..
            } => {
                tracing::debug!(%send_back_addr, "incoming connection failed: {error}");
            }
            _ => {}
        }
        out
    }
}

/// NAT traversal without flags: a node that AutoNAT finds unreachable listens through relays
/// it is connected to (peers that offer the relay protocol), so that others can dial it; DCUtR
/// then replaces relayed connections with direct ones where the NATs allow hole punching.
#[derive(Default)]
pub(super) struct NatTraversal {
    /// AutoNAT's verdict: others cannot dial this node.
    behind_nat: bool,
    /// Connected peers that offer the relay protocol, with the address they were reached at.
    relays: HashMap<PeerId, Multiaddr>,
    /// The relay circuits listened on, by listener.
    circuits: HashMap<libp2p::core::transport::ListenerId, PeerId>,
}

impl NatTraversal {
    /// Listens through relays until [`RELAYS_BEHIND_NAT`] circuits are open, while behind a
    /// NAT; relays used are kept connected.
    fn reserve(&mut self, swarm: &mut Swarm<Behaviour>, kept: &mut HashSet<PeerId>) {
        if !self.behind_nat {
            return;
        }
        let mut candidates: Vec<(PeerId, Multiaddr)> = self
            .relays
            .iter()
            .filter(|(relay, _)| !self.circuits.values().any(|r| r == *relay))
            .map(|(relay, addr)| (*relay, addr.clone()))
            .collect();
        // Deterministic order, so that peers behind NATs tend to share relays.
        candidates.sort_by_key(|(relay, _)| *relay);
        for (relay, addr) in candidates {
            if self.circuits.len() >= RELAYS_BEHIND_NAT {
                break;
            }
            let circuit = addr
                .iter()
                .filter(|p| !matches!(p, Protocol::P2p(_)))
                .collect::<Multiaddr>()
                .with(Protocol::P2p(relay))
                .with(Protocol::P2pCircuit);
            match swarm.listen_on(circuit.clone()) {
                Ok(listener) => {
                    tracing::info!(%circuit, "behind a NAT: listening through a relay");
                    self.circuits.insert(listener, relay);
                    kept.insert(relay);
                }
                Err(e) => {
                    tracing::warn!(%circuit, "cannot listen through the relay: {e}");
                    self.relays.remove(&relay);
                }
            }
        }
    }
}
