//! Finding peers without a bootstrap address (mDNS) and reaching a peer only through a relay.

#![allow(clippy::unwrap_used, missing_docs)]

use serde_json::json;
use shoal_tests::{NodeProcess, temp_dir};
use std::time::Duration;

#[test]
fn two_nodes_find_each_other_by_mdns() {
    let dir = temp_dir("mdns");
    let run = format!("mdns-{}", std::process::id());
    // No bootstrap address: multicast DNS on the machine's interfaces is the only way.
    let args = [
        "--listen",
        "/ip4/0.0.0.0/udp/0/quic-v1",
        "--run",
        run.as_str(),
    ];
    let mut a = NodeProcess::start(&dir, "a", &args);
    let mut b = NodeProcess::start(&dir, "b", &args);
    let (ida, idb) = (a.peer.clone(), b.peer.clone());
    a.wait_for(Duration::from_secs(60), |e| {
        e["event"] == "discovered" && e["peer"] == idb.as_str()
    });
    b.wait_for(Duration::from_secs(60), |e| {
        e["event"] == "discovered" && e["peer"] == ida.as_str()
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn nodes_reachable_only_through_a_relay_exchange_a_tensor() {
    let dir = temp_dir("relay");
    let run = format!("relay-{}", std::process::id());
    let mut relay = NodeProcess::start(
        &dir,
        "relay",
        &[
            "--no-mdns",
            "--relay-server",
            "--listen",
            "/ip4/127.0.0.1/udp/0/quic-v1",
            "--run",
            &run,
        ],
    );
    let circuit = format!("{}/p2p-circuit", relay.addr);
    // `hidden` listens on no address of its own: it is reachable only through the relay.
    let mut hidden = NodeProcess::start_without_listen(
        &dir,
        "hidden",
        &[
            "--no-mdns",
            "--bootstrap",
            &relay.addr,
            "--run",
            &run,
            "--metrics",
            "127.0.0.1:0",
        ],
    );
    hidden.send(json!({"op": "listen", "addr": circuit}));
    hidden.wait_for(Duration::from_secs(60), |e| {
        e["event"] == "relay_reservation"
    });
    let mut outside = NodeProcess::start(
        &dir,
        "outside",
        &[
            "--no-mdns",
            "--listen",
            "/ip4/127.0.0.1/udp/0/quic-v1",
            "--run",
            &run,
        ],
    );
    let via_relay = format!("{circuit}/p2p/{}", hidden.peer);
    outside.send(json!({"op": "dial", "addr": via_relay}));
    let hidden_id = hidden.peer.clone();
    outside.wait_for(Duration::from_secs(60), |e| {
        e["event"] == "connected" && e["peer"] == hidden_id.as_str()
    });
    outside.send_tensor(&hidden_id, 100_000, 42);
    let sent = outside.wait_for(Duration::from_secs(60), |e| {
        e["event"] == "sent" || e["event"] == "send_failed"
    });
    assert_eq!(sent["event"], "sent", "{sent}");
    let outside_id = outside.peer.clone();
    let got = hidden.wait_for(Duration::from_secs(60), |e| {
        e["event"] == "tensor" && e["from"] == outside_id.as_str()
    });
    assert_eq!(got["checksum"], sent["checksum"]);
    // Its metrics say what happened: connected to two peers, a frame received.
    let url = hidden.wait_for(Duration::from_secs(10), |e| e["event"] == "metrics")["url"]
        .as_str()
        .unwrap()
        .to_owned();
    let text = shoal_tests::scrape(&url);
    let metric = |name: &str| shoal_tests::metric(&text, name).unwrap_or(0.0);
    assert!(metric("shoal_connected_peers") >= 2.0, "{text}");
    assert!(metric("shoal_frames_received_total") >= 1.0, "{text}");
    assert!(
        metric("shoal_frames_received_bytes_total") >= 100_000.0,
        "{text}"
    );
    assert!(
        text.contains("# TYPE shoal_network_events counter"),
        "{text}"
    );
    // Hole punching may or may not succeed here (loopback has no NAT to punch); say which.
    outside.drain(Duration::from_secs(3));
    let punched = outside
        .seen
        .iter()
        .chain(hidden.seen.iter())
        .any(|e| e["event"] == "hole_punched");
    eprintln!(
        "relay test: tensor arrived through a relayed connection; hole punching {}",
        if punched {
            "then opened a direct one"
        } else {
            "did not happen"
        }
    );
    relay.kill();
    let _ = std::fs::remove_dir_all(&dir);
}
