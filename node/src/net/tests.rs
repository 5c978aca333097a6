use super::*;

#[test]
fn only_global_addresses_are_global() {
    let global = |a: &str| is_global(&a.parse().expect("address"));
    for a in [
        "/ip4/8.8.8.8/udp/1/quic-v1",
        "/ip6/2001:4860::8888/udp/1/quic-v1",
        "/dns4/example.org/udp/1/quic-v1",
    ] {
        assert!(global(a), "{a}");
    }
    for a in [
        "/ip4/127.0.0.1/udp/1/quic-v1",
        "/ip4/10.1.2.3/udp/1/quic-v1",
        "/ip4/172.16.0.1/udp/1/quic-v1",
        "/ip4/192.168.1.1/udp/1/quic-v1",
        "/ip4/169.254.1.1/udp/1/quic-v1",
        "/ip4/100.64.0.1/udp/1/quic-v1",
        "/ip4/0.0.0.0/udp/1/quic-v1",
        "/ip6/::1/udp/1/quic-v1",
        "/ip6/fd00::1/udp/1/quic-v1",
        "/ip6/fe80::1/udp/1/quic-v1",
    ] {
        assert!(!global(a), "{a}");
    }
}

/// The caps grow with the peers a stage needs and never fall below the configured ones: a
/// middle stage of a 1,000-peer run in 8 stages (375 replicas around it, 32 others) gets
/// 814 connections and 814 streams, far past the defaults of 256 and 64.
#[test]
fn caps_follow_the_peers_needed() {
    let floor = Caps {
        connections: 256,
        streams: 64,
    };
    assert_eq!(floor.for_peers(0), floor);
    assert_eq!(
        floor.for_peers(20),
        Caps {
            connections: 256,
            streams: 64
        }
    );
    assert_eq!(
        floor.for_peers(407),
        Caps {
            connections: 814,
            streams: 814
        }
    );
    let huge = floor.for_peers(usize::MAX / 4);
    assert_eq!((huge.connections, huge.streams), (16_384, 16_384));
}

fn loopback(bootstrap: Vec<Multiaddr>, direct: bool) -> NetConfig {
    NetConfig {
        listen: vec!["/ip4/127.0.0.1/udp/0/quic-v1".parse().expect("address")],
        bootstrap,
        mdns: false,
        run: "test".into(),
        direct,
        ..NetConfig::default()
    }
}

async fn until<T>(
    events: &mut mpsc::Receiver<NodeEvent>,
    mut pick: impl FnMut(NodeEvent) -> Option<T>,
) -> T {
    let wait = async {
        while let Some(e) = events.recv().await {
            if let Some(t) = pick(e) {
                return t;
            }
        }
        panic!("node stopped");
    };
    tokio::time::timeout(Duration::from_secs(30), wait)
        .await
        .expect("event in time")
}

/// A node listening on loopback, and its address.
async fn listening(
    direct: bool,
) -> (
    NodeHandle,
    mpsc::Receiver<NodeEvent>,
    mpsc::Receiver<InboundFrame>,
    Multiaddr,
) {
    let (node, mut events, inbound) =
        start(Keypair::generate_ed25519(), loopback(Vec::new(), direct))
            .await
            .expect("receiver starts");
    let addr = until(&mut events, |e| match e {
        NodeEvent::Listening(a) => Some(a),
        _ => None,
    })
    .await;
    (node, events, inbound, addr)
}

/// A node bootstrapped from `addr` that has discovered `target` there (its inbound frames are
/// returned to keep them open).
async fn joined(
    addr: &Multiaddr,
    target: PeerId,
    direct: bool,
) -> (NodeHandle, mpsc::Receiver<InboundFrame>) {
    let (node, mut events, frames) = start(
        Keypair::generate_ed25519(),
        loopback(vec![addr.clone()], direct),
    )
    .await
    .expect("sender starts");
    until(&mut events, |e| {
        matches!(e, NodeEvent::Discovered(p) if p == target).then_some(())
    })
    .await;
    (node, frames)
}

/// The next frame `inbound` receives.
async fn next_frame(inbound: &mut mpsc::Receiver<InboundFrame>) -> InboundFrame {
    tokio::time::timeout(Duration::from_secs(30), inbound.recv())
        .await
        .expect("frame in time")
        .expect("receiver running")
}

/// Bursts of streams from several peers at once: libp2p-stream drops an inbound stream
/// when the previous one was not taken yet, and the node must send such a frame again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bursts_of_frames_from_many_peers_all_arrive() {
    const SENDERS: usize = 3;
    const FRAMES: usize = 24;
    for direct in [false, true] {
        let (receiver, _events, mut inbound, addr) = listening(direct).await;
        let mut sends = Vec::new();
        for s in 0..SENDERS {
            let target = receiver.peer_id;
            let (sender, _frames) = joined(&addr, target, direct).await;
            for f in 0..FRAMES {
                let sender = sender.clone();
                sends.push(tokio::spawn(async move {
                    let payload = vec![(s * FRAMES + f) as u8; 1000 + f];
                    sender
                        .send_frame(target, shoal_protocol::FrameKind::Tensor, &payload)
                        .await
                }));
            }
        }
        let collect = tokio::spawn(async move {
            let mut got = HashSet::new();
            for _ in 0..SENDERS * FRAMES {
                let frame = next_frame(&mut inbound).await;
                got.insert((frame.peer, frame.payload[0], frame.payload.len()));
            }
            got
        });
        for send in sends {
            send.await
                .expect("send task")
                .unwrap_or_else(|e| panic!("direct={direct}: {e}"));
        }
        let got = collect.await.expect("collector");
        assert_eq!(got.len(), SENDERS * FRAMES, "direct={direct}");
    }
}

/// A banned peer is cut off on both transports: its connections close, and what it sends
/// afterwards (over a new connection) never arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_banned_peer_is_cut_off_and_cannot_come_back() {
    for direct in [false, true] {
        let (receiver, mut events, mut inbound, addr) = listening(direct).await;
        let target = receiver.peer_id;
        let (sender, _frames) = joined(&addr, target, direct).await;
        let kind = shoal_protocol::FrameKind::Tensor;
        sender
            .send_frame(target, kind, b"before")
            .await
            .expect("delivered before the ban");
        assert_eq!(next_frame(&mut inbound).await.payload, b"before");

        let direct_from = |node: &NodeHandle| {
            node.direct
                .as_ref()
                .map_or(0, |d| d.inbound_from(sender.peer_id))
        };
        assert_eq!(direct_from(&receiver), usize::from(direct));
        receiver.ban(sender.peer_id).await.expect("ban");
        // Its direct connection closes with the ban, not at its next stream.
        assert_eq!(direct_from(&receiver), 0);
        let banned = sender.peer_id;
        until(&mut events, |e| {
            matches!(e, NodeEvent::Disconnected(p) if p == banned).then_some(())
        })
        .await;
        // The banned peer tries again, over a fresh connection if it must.
        let _ = sender.dial(addr.clone()).await;
        let sent = tokio::time::timeout(
            Duration::from_secs(30),
            sender.send_frame(target, kind, b"after"),
        )
        .await
        .expect("the send gives up in time");
        assert!(
            sent.is_err(),
            "direct={direct}: a banned peer's frame was taken"
        );
        assert!(inbound.try_recv().is_err(), "direct={direct}");
        let connected = receiver.peers().await.expect("peers");
        assert!(!connected.contains(&banned), "direct={direct}");
    }
}
