//! A hostile host attacks a node on both of its tensor paths (libp2p streams and the direct
//! QUIC endpoint): garbage, truncated frames, frames above the cap, idle streams that claim
//! huge payloads and are held open, slow-loris streams that trickle a large frame, and many
//! identities that try to take every connection slot. While the attack goes on, an honest peer
//! sends 4 x 1 MiB (each must arrive within 15 s), a new peer from another address connects
//! and is served on both paths, the node stays up and its memory stays bounded.

#![allow(clippy::unwrap_used, missing_docs)]

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use libp2p::PeerId;
use libp2p::identity::Keypair;
use shoal_node::net::direct::DirectEndpoint;
use shoal_node::net::ip_limits::IpSlots;
use shoal_node::net::tensor::{TransportLimits, write_frame};
use shoal_node::net::{self, NetConfig, NodeHandle};
use shoal_protocol::Codec;
use shoal_protocol::codec::encode_to_vec;
use shoal_protocol::wire::{FrameHeader, FrameKind};
use shoal_tests::{NodeProcess, temp_dir};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Memory the node may grow by during the attack: the attack claims tens of gigabytes; what it
/// actually sends at once is a few megabytes.
const RSS_GROWTH_BOUND: u64 = 160 << 20;

/// Identities the attacker brings to take connection slots (the node allows 16 per address).
const SYBILS: usize = 24;

fn header(len: u32) -> [u8; 12] {
    FrameHeader {
        kind: FrameKind::Tensor,
        len,
    }
    .to_bytes()
}

trait Duplex: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Duplex for T {}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    Libp2p,
    Direct,
}

/// A tensor stream to `peer` on `path`.
async fn open(attacker: &NodeHandle, path: Path, peer: PeerId) -> Option<Box<dyn Duplex>> {
    match path {
        Path::Libp2p => attacker
            .open_tensor_stream(peer)
            .await
            .ok()
            .map(|s| Box::new(s) as Box<dyn Duplex>),
        Path::Direct => attacker
            .open_direct_stream(peer)
            .await
            .ok()
            .map(|s| Box::new(s) as Box<dyn Duplex>),
    }
}

/// What the attack did, counted while it runs.
#[derive(Default)]
struct Tally {
    streams: AtomicUsize,
    held: AtomicUsize,
    trickles_cut: AtomicUsize,
    /// Longest a slow-loris stream lived, in milliseconds.
    trickle_life_ms: AtomicUsize,
}

/// One-shot malformed frames: garbage, a header for 8 MiB and 1,000 bytes, above the cap.
async fn malformed(attacker: &NodeHandle, path: Path, peer: PeerId, round: u8, tally: &Tally) {
    for kind in 0..3 {
        let Some(mut s) = open(attacker, path, peer).await else {
            continue;
        };
        let bytes: Vec<u8> = match kind {
            0 => (0..4096u32)
                .map(|j| (j as u8).wrapping_mul(31).wrapping_add(round))
                .collect(),
            1 => [&header(8 << 20)[..], &[7u8; 1000]].concat(),
            _ => [&header(u32::MAX)[..], &[0u8; 65536]].concat(),
        };
        let _ = s.write_all(&bytes).await;
        let _ = s.close().await;
        tally.streams.fetch_add(1, Ordering::Relaxed);
    }
}

/// Slow loris: claims 64 MiB and sends 1 KiB every half second; reopens when cut.
async fn trickle(
    attacker: NodeHandle,
    path: Path,
    peer: PeerId,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
) {
    while !stop.load(Ordering::Relaxed) {
        let Some(mut s) = open(&attacker, path, peer).await else {
            tokio::time::sleep(Duration::from_millis(500)).await;
            continue;
        };
        tally.streams.fetch_add(1, Ordering::Relaxed);
        let opened = Instant::now();
        if s.write_all(&header(64 << 20)).await.is_err() {
            continue;
        }
        loop {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            let sent = async {
                s.write_all(&[1u8; 1024]).await?;
                s.flush().await
            };
            if tokio::time::timeout(Duration::from_secs(2), sent)
                .await
                .map_or(true, |r| r.is_err())
            {
                tally.trickles_cut.fetch_add(1, Ordering::Relaxed);
                let life = opened.elapsed().as_millis() as usize;
                tally.trickle_life_ms.fetch_max(life, Ordering::Relaxed);
                break;
            }
        }
    }
}

fn tensor_message(values: usize, seed: u64) -> Vec<u8> {
    let x: Vec<f32> = (0..values)
        .map(|i| ((i as u64 ^ seed) % 97) as f32)
        .collect();
    encode_to_vec(Codec::Fp32, &x, &[values]).unwrap()
}

#[test]
fn a_hostile_peer_cannot_take_a_node_down() {
    let dir = temp_dir("hostile");
    let run = format!("hostile-{}", std::process::id());
    let listen = [
        "--no-mdns",
        "--listen",
        "/ip4/127.0.0.1/udp/0/quic-v1",
        "--run",
        run.as_str(),
    ];
    let mut target = NodeProcess::start(&dir, "target", &listen);
    let mut honest_args = listen.to_vec();
    honest_args.extend(["--bootstrap", target.addr.as_str()]);
    let mut honest = NodeProcess::start(&dir, "honest", &honest_args);
    let target_id = target.peer.clone();
    honest.wait_for(Duration::from_secs(30), |e| {
        e["event"] == "connected" && e["peer"] == target_id.as_str()
    });
    let baseline = target.peak_rss_bytes().unwrap_or(0);

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let target_peer: PeerId = target.peer.parse().unwrap();
    let target_addr: libp2p::Multiaddr = target.addr.parse().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let config = |direct: bool| NetConfig {
        listen: vec!["/ip4/127.0.0.1/udp/0/quic-v1".parse().unwrap()],
        bootstrap: vec![target_addr.clone()],
        mdns: false,
        run: run.clone(),
        direct,
        ..NetConfig::default()
    };

    // The attacker, with three identities (each peer has its own stream caps): one holds idle
    // streams, one trickles slow-loris frames, one sends malformed ones; each on both paths.
    let (attacker, loris, noise, direct_port, held) = runtime.block_on(async {
        let start = || async {
            net::start(Keypair::generate_ed25519(), config(true))
                .await
                .unwrap()
                .0
        };
        let (attacker, loris, noise) = (start().await, start().await, start().await);
        let deadline = Instant::now() + Duration::from_secs(30);
        while [&attacker, &loris, &noise]
            .iter()
            .any(|a| a.direct_addr(target_peer).is_none())
        {
            assert!(
                Instant::now() < deadline,
                "the target's direct endpoint was never advertised"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let direct_port = attacker.direct_addr(target_peer).unwrap().port();
        for path in [Path::Libp2p, Path::Direct] {
            for round in 0..10 {
                malformed(&noise, path, target_peer, round, &tally).await;
            }
        }
        // More streams than allowed, each claiming 200 MiB and sending none of it; held open
        // for the rest of the test.
        let mut held = Vec::new();
        let mut refused = 0;
        for path in [Path::Libp2p, Path::Direct] {
            for _ in 0..40 {
                let Some(mut s) = open(&attacker, path, target_peer).await else {
                    refused += 1;
                    continue;
                };
                let _ = s.write_all(&header(200 << 20)).await;
                let _ = s.flush().await;
                held.push(s);
            }
        }
        let mut reset = 0;
        for s in &mut held {
            let mut b = [0u8; 1];
            if let Ok(r) = tokio::time::timeout(Duration::from_millis(200), s.read(&mut b)).await {
                if matches!(r, Ok(0) | Err(_)) {
                    reset += 1;
                }
            }
        }
        assert!(
            reset + refused >= 80 - 2 * 8,
            "only {} of 80 streams beyond the per-peer limit were refused",
            reset + refused
        );
        tally.held.store(held.len() - reset, Ordering::Relaxed);
        (attacker, loris, noise, direct_port, held)
    });
    let _guard = runtime.enter();
    for path in [Path::Libp2p, Path::Direct] {
        for _ in 0..4 {
            runtime.spawn(trickle(
                loris.clone(),
                path,
                target_peer,
                stop.clone(),
                tally.clone(),
            ));
        }
        let (a, t, st) = (noise.clone(), tally.clone(), stop.clone());
        runtime.spawn(async move {
            let mut round = 0u8;
            while !st.load(Ordering::Relaxed) {
                malformed(&a, path, target_peer, round, &t).await;
                round = round.wrapping_add(1);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
    }

    // Connection slots: many identities from this address, on both endpoints.
    let target_direct = SocketAddr::from(([127, 0, 0, 1], direct_port));
    let (sybils, direct_sybils, direct_in) = runtime.block_on(async {
        let mut sybils = Vec::new();
        for _ in 0..SYBILS {
            if let Ok((h, events, frames)) =
                net::start(Keypair::generate_ed25519(), config(false)).await
            {
                sybils.push((h, events, frames));
            }
        }
        let mut direct_sybils = Vec::new();
        let mut direct_in = 0;
        for _ in 0..SYBILS {
            let endpoint = DirectEndpoint::bind(
                &Keypair::generate_ed25519(),
                "127.0.0.1:0".parse().unwrap(),
                4,
                IpSlots::new(4),
            )
            .unwrap();
            if let Ok(Ok(mut s)) = tokio::time::timeout(
                Duration::from_secs(5),
                endpoint.open_stream(target_peer, target_direct),
            )
            .await
            {
                // A connection refused at accept fails its first stream.
                let _ = s.write_all(&header(1 << 20)).await;
                let mut b = [0u8; 1];
                if tokio::time::timeout(Duration::from_millis(500), s.read(&mut b))
                    .await
                    .is_err()
                {
                    direct_in += 1;
                }
                direct_sybils.push((endpoint, s));
            }
        }
        (sybils, direct_sybils, direct_in)
    });
    assert!(
        direct_in <= 16,
        "{direct_in} direct connections from one address were taken"
    );

    // The honest peer's tensors arrive, each within 15 s, while all of the above goes on.
    for k in 0..4 {
        honest.send_tensor(&target.peer, 1 << 20, 100 + k);
    }
    let honest_id = honest.peer.clone();
    for _ in 0..4 {
        let sent = honest.wait_for(Duration::from_secs(15), |e| {
            (e["event"] == "sent" || e["event"] == "send_failed") && e.get("counted").is_none()
        });
        assert_eq!(sent["event"], "sent", "{sent}");
        let pos = honest.seen.iter().position(|s| *s == sent).unwrap();
        honest.seen[pos]["counted"] = serde_json::json!(true);
        let checksum = sent["checksum"].clone();
        target.wait_for(Duration::from_secs(15), |e| {
            e["event"] == "tensor" && e["from"] == honest_id.as_str() && e["checksum"] == checksum
        });
    }

    // A new peer from another address gets a connection and is served on both paths.
    let fresh_args = [
        "--no-mdns",
        "--listen",
        "/ip4/127.0.0.2/udp/0/quic-v1",
        "--run",
        run.as_str(),
        "--bootstrap",
        target.addr.as_str(),
    ];
    let mut fresh = NodeProcess::start(&dir, "fresh", &fresh_args);
    fresh.wait_for(Duration::from_secs(30), |e| {
        e["event"] == "connected" && e["peer"] == target_id.as_str()
    });
    fresh.send_tensor(&target.peer, 1 << 20, 7);
    let sent = fresh.wait_for(Duration::from_secs(15), |e| {
        e["event"] == "sent" || e["event"] == "send_failed"
    });
    assert_eq!(sent["event"], "sent", "{sent}");
    let fresh_id = fresh.peer.clone();
    target.wait_for(Duration::from_secs(15), |e| {
        e["event"] == "tensor" && e["from"] == fresh_id.as_str()
    });
    let newcomer = Keypair::generate_ed25519();
    let newcomer_id = newcomer.public().to_peer_id().to_string();
    runtime.block_on(async {
        let endpoint = DirectEndpoint::bind(
            &newcomer,
            "127.0.0.2:0".parse().unwrap(),
            4,
            IpSlots::new(4),
        )
        .unwrap();
        let mut s = endpoint
            .open_stream(target_peer, target_direct)
            .await
            .unwrap();
        write_frame(
            &mut s,
            FrameKind::Tensor,
            &tensor_message(1 << 18, 9),
            &TransportLimits::default(),
        )
        .await
        .unwrap();
    });
    target.wait_for(Duration::from_secs(15), |e| {
        e["event"] == "tensor" && e["from"] == newcomer_id.as_str()
    });

    // Slow-loris streams are cut once their grace period is over.
    let deadline = Instant::now() + Duration::from_secs(30);
    while tally.trickles_cut.load(Ordering::Relaxed) < 4 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    let cut = tally.trickles_cut.load(Ordering::Relaxed);
    assert!(cut >= 4, "only {cut} slow-loris streams were cut");

    assert!(target.is_running(), "the node died");
    let peak = target.peak_rss_bytes().unwrap_or(0);
    let sybils_connected = runtime.block_on(async {
        let mut n = 0;
        for (h, _, _) in &sybils {
            if h.peers().await.unwrap_or_default().contains(&target_peer) {
                n += 1;
            }
        }
        n
    });
    eprintln!(
        "under attack ({} streams opened, {} held claiming 200 MiB, {} slow-loris streams cut \
         after at most {:.1} s; {sybils_connected} of {SYBILS} libp2p and {direct_in} of \
         {SYBILS} direct sybil connections from one address in): honest 4 x 1 MiB arrived; \
         target peak RSS {:.1} MiB (before the attack {:.1} MiB)",
        tally.streams.load(Ordering::Relaxed),
        tally.held.load(Ordering::Relaxed),
        cut,
        tally.trickle_life_ms.load(Ordering::Relaxed) as f64 / 1000.0,
        peak as f64 / (1 << 20) as f64,
        baseline as f64 / (1 << 20) as f64
    );
    assert!(
        peak < baseline + RSS_GROWTH_BOUND,
        "peak RSS {peak} grew more than {RSS_GROWTH_BOUND} above {baseline}"
    );
    stop.store(true, Ordering::Relaxed);
    drop((held, sybils, direct_sybils, attacker, loris, noise));
    runtime.shutdown_timeout(Duration::from_secs(1));
    let _ = std::fs::remove_dir_all(&dir);
}
