//! A hostile peer sends garbage, truncated frames, frames above the cap, idle headers that
//! claim huge payloads, and more streams than allowed. The node stays up, its memory stays
//! bounded, and an honest peer's tensors keep arriving intact.

#![allow(clippy::unwrap_used, missing_docs)]

use futures::{AsyncReadExt, AsyncWriteExt};
use libp2p::PeerId;
use libp2p::identity::Keypair;
use shoal_node::net::{self, NetConfig};
use shoal_protocol::wire::{FrameHeader, FrameKind};
use shoal_tests::{NodeProcess, temp_dir};
use std::time::Duration;

fn header(len: u32) -> [u8; 12] {
    FrameHeader {
        kind: FrameKind::Tensor,
        len,
    }
    .to_bytes()
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
    let target_addr = target.addr.parse().unwrap();
    let report = runtime.block_on(async {
        let config = NetConfig {
            listen: Vec::new(),
            bootstrap: vec![target_addr],
            mdns: false,
            run: run.clone(),
            ..NetConfig::default()
        };
        let (attacker, _events, _frames) = net::start(Keypair::generate_ed25519(), config)
            .await
            .unwrap();
        for _ in 0..100 {
            if attacker.peers().await.unwrap().contains(&target_peer) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut report = Vec::new();
        // 1. Garbage.
        for i in 0..20u8 {
            let mut s = attacker.open_tensor_stream(target_peer).await.unwrap();
            let junk: Vec<u8> = (0..4096u32)
                .map(|j| (j as u8).wrapping_mul(31).wrapping_add(i))
                .collect();
            let _ = s.write_all(&junk).await;
            let _ = s.close().await;
        }
        report.push("20 garbage streams");
        // 2. Truncated frames: a valid header for 8 MiB, then 1000 bytes and the end.
        for _ in 0..20 {
            let mut s = attacker.open_tensor_stream(target_peer).await.unwrap();
            let _ = s.write_all(&header(8 << 20)).await;
            let _ = s.write_all(&[7u8; 1000]).await;
            let _ = s.close().await;
        }
        report.push("20 truncated frames");
        // 3. Frames above the cap (256 MiB): rejected from the header alone.
        for _ in 0..20 {
            let mut s = attacker.open_tensor_stream(target_peer).await.unwrap();
            let _ = s.write_all(&header(u32::MAX)).await;
            let _ = s.write_all(&[0u8; 65536]).await;
            let _ = s.close().await;
        }
        report.push("20 frames above the cap");
        // 4. More streams than allowed, each claiming a 200 MiB payload and sending none of it.
        let mut held = Vec::new();
        for _ in 0..40 {
            if let Ok(mut s) = attacker.open_tensor_stream(target_peer).await {
                let _ = s.write_all(&header(200 << 20)).await;
                let _ = s.flush().await;
                held.push(s);
            }
        }
        let mut reset = 0;
        for s in &mut held {
            let mut b = [0u8; 1];
            // Admitted streams wait for a payload that never comes; refused ones end at once.
            if let Ok(r) = tokio::time::timeout(Duration::from_millis(300), s.read(&mut b)).await {
                if matches!(r, Ok(0) | Err(_)) {
                    reset += 1;
                }
            }
        }
        assert!(
            reset >= 40 - 8,
            "only {reset} of 40 streams beyond the per-peer limit were refused"
        );
        report.push("40 idle streams claiming 200 MiB each");
        tokio::time::sleep(Duration::from_secs(2)).await;
        drop(held);
        report
    });

    // The honest peer's tensors arrive intact, after and despite all that.
    for k in 0..4 {
        honest.send_tensor(&target.peer, 1 << 20, 100 + k);
    }
    let honest_id = honest.peer.clone();
    for _ in 0..4 {
        let sent = honest.wait_for(Duration::from_secs(60), |e| {
            (e["event"] == "sent" || e["event"] == "send_failed") && e.get("counted").is_none()
        });
        assert_eq!(sent["event"], "sent", "{sent}");
        let pos = honest.seen.iter().position(|s| *s == sent).unwrap();
        honest.seen[pos]["counted"] = serde_json::json!(true);
        let checksum = sent["checksum"].clone();
        target.wait_for(Duration::from_secs(60), |e| {
            e["event"] == "tensor" && e["from"] == honest_id.as_str() && e["checksum"] == checksum
        });
    }
    assert!(target.is_running(), "the node died");
    let peak = target.peak_rss_bytes().unwrap_or(0);
    eprintln!(
        "hostile peer: {}; target peak RSS {:.1} MiB (before the attack {:.1} MiB)",
        report.join(", "),
        peak as f64 / (1 << 20) as f64,
        baseline as f64 / (1 << 20) as f64
    );
    // Claimed sizes cost budget reservations, not memory: the attack above claimed 8 GB.
    assert!(
        peak < baseline + (256 << 20),
        "peak RSS {peak} grew far above {baseline}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
