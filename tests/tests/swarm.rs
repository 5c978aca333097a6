//! Real `shoal` processes on loopback find each other, gossip, move large tensors bit-exact,
//! and notice a peer that dies.

#![allow(clippy::unwrap_used, missing_docs)]

use serde_json::json;
use shoal_tests::{NodeProcess, temp_dir};
use std::collections::{HashMap, HashSet};
use std::time::Duration;

const NODES: usize = 5;
/// 64 MiB of f32 per tensor.
const TENSOR_VALUES: usize = 16 << 20;

#[test]
fn five_processes_discover_gossip_exchange_and_survive_a_kill() {
    let dir = temp_dir("swarm");
    let run = format!("test-{}", std::process::id());
    let common = [
        "--no-mdns",
        "--listen",
        "/ip4/127.0.0.1/udp/0/quic-v1",
        "--run",
        run.as_str(),
    ];
    let bootstrap = NodeProcess::start(&dir, "node0", &common);
    let boot_addr = bootstrap.addr.clone();
    let mut nodes = vec![bootstrap];
    for i in 1..NODES {
        let mut args = common.to_vec();
        args.extend(["--bootstrap", boot_addr.as_str()]);
        if i == 2 {
            // One node without a direct endpoint: tensors to and from it take the libp2p
            // path while the others use their direct endpoints, in the same swarm.
            args.push("--no-direct");
        }
        nodes.push(NodeProcess::start(&dir, &format!("node{i}"), &args));
    }
    let ids: Vec<String> = nodes.iter().map(|n| n.peer.clone()).collect();

    // Everyone discovers everyone, though only the bootstrap address was given.
    for (i, node) in nodes.iter_mut().enumerate() {
        for (j, id) in ids.iter().enumerate() {
            if i != j {
                node.wait_for(Duration::from_secs(60), |e| {
                    e["event"] == "discovered" && e["peer"] == id.as_str()
                });
            }
        }
    }

    // A gossip message from each reaches all others (retried while the mesh forms).
    for round in 0..20 {
        for (i, node) in nodes.iter_mut().enumerate() {
            node.send(json!({"op": "gossip", "text": format!("hello from {i} round {round}")}));
        }
        for node in nodes.iter_mut() {
            node.drain(Duration::from_millis(500));
        }
        let complete = nodes.iter().enumerate().all(|(i, node)| {
            let from: HashSet<&str> = node
                .seen
                .iter()
                .filter(|e| e["event"] == "gossip")
                .filter_map(|e| e["from"].as_str())
                .collect();
            ids.iter()
                .enumerate()
                .all(|(j, id)| i == j || from.contains(id.as_str()))
        });
        if complete {
            break;
        }
        assert!(round < 19, "gossip did not reach every node");
    }

    // A 64 MiB tensor between every ordered pair, all in flight at once.
    for (i, node) in nodes.iter_mut().enumerate() {
        for (j, id) in ids.iter().enumerate() {
            if i != j {
                node.send_tensor(id, TENSOR_VALUES, (i * NODES + j) as u64);
            }
        }
    }
    let mut sent: HashMap<(String, String), String> = HashMap::new();
    for (i, node) in nodes.iter_mut().enumerate() {
        for _ in 0..NODES - 1 {
            let e = node.wait_for(Duration::from_secs(240), |e| {
                (e["event"] == "sent" || e["event"] == "send_failed")
                    && !e.get("counted").is_some_and(|c| c == true)
            });
            assert_eq!(e["event"], "sent", "node {i}: {e}");
            // Mark as counted so the next wait finds the next one.
            let pos = node.seen.iter().position(|s| *s == e).unwrap();
            node.seen[pos]["counted"] = json!(true);
            sent.insert(
                (ids[i].clone(), e["to"].as_str().unwrap().to_owned()),
                e["checksum"].as_str().unwrap().to_owned(),
            );
        }
    }
    assert_eq!(sent.len(), NODES * (NODES - 1));
    for (j, node) in nodes.iter_mut().enumerate() {
        for (i, from) in ids.iter().enumerate() {
            if i == j {
                continue;
            }
            let want = sent[&(from.clone(), ids[j].clone())].clone();
            let got = node.wait_for(Duration::from_secs(60), |e| {
                e["event"] == "tensor" && e["from"] == from.as_str()
            });
            assert_eq!(got["values"], TENSOR_VALUES, "{got}");
            // The receiver verified the payload against this checksum: bit-exact.
            assert_eq!(got["checksum"], want.as_str(), "tensor {i} -> {j}");
        }
    }

    // SIGKILL one node: the others notice within a bounded time and keep exchanging.
    let mut victim = nodes.pop().unwrap();
    let victim_id = victim.peer.clone();
    victim.kill();
    for node in nodes.iter_mut() {
        node.wait_for(Duration::from_secs(20), |e| {
            e["event"] == "disconnected" && e["peer"] == victim_id.as_str()
        });
        assert!(node.is_running());
    }
    let survivors: Vec<String> = nodes.iter().map(|n| n.peer.clone()).collect();
    for (i, node) in nodes.iter_mut().enumerate() {
        for (j, id) in survivors.iter().enumerate() {
            if i != j {
                node.send_tensor(id, 1000, 7_000 + (i * NODES + j) as u64);
            }
        }
    }
    for (i, node) in nodes.iter_mut().enumerate() {
        for (j, to) in survivors.iter().enumerate() {
            if i != j {
                let outcome = node.wait_for(Duration::from_secs(30), |e| {
                    e["to"] == to.as_str()
                        && (e["event"] == "send_failed"
                            || (e["event"] == "sent"
                                && e["bytes"].as_u64().is_some_and(|b| b < 10_000)))
                });
                assert_eq!(
                    outcome["event"], "sent",
                    "after the kill, node {i} -> {j}: {outcome}"
                );
            }
        }
    }
    for (j, node) in nodes.iter_mut().enumerate() {
        for (i, from) in survivors.iter().enumerate() {
            if i != j {
                node.wait_for(Duration::from_secs(30), |e| {
                    e["event"] == "tensor" && e["from"] == from.as_str() && e["values"] == 1000
                });
            }
        }
    }
    drop(nodes);
    let _ = std::fs::remove_dir_all(&dir);
}
