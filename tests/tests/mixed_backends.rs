//! A swarm whose replicas run on different backends: two `shoal run` peers on the CPU and one
//! on wgpu (Mesa's lavapipe in CI) train `nano` in 2 stages, the wgpu peer sharing a stage
//! with a CPU peer. Their forward and backward passes round differently, but they step with
//! the same averaged gradient in the same canonical way, so the stage's replicas must end on
//! one parameter hash, and the loss must fall. The wgpu peer joins second and is the first
//! to serve stage 1, so training cannot start without it and it computes microbatches.

#![allow(clippy::unwrap_used, missing_docs)]

use serde_json::Value;
use shoal_tests::{RunProcess, temp_dir};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

const LONG: Duration = Duration::from_secs(600);

fn start(dir: &std::path::Path, name: &str, args: &[&str]) -> RunProcess {
    let mut all = vec![
        "--listen",
        "/ip4/127.0.0.1/udp/0/quic-v1",
        "--no-mdns",
        "--threads",
        "1",
        // Weighted routing would leave the software wgpu replica (tens of times slower than
        // the CPU one) out of the work; the test is about both computing.
        "--routing",
        "uniform",
    ];
    all.extend_from_slice(args);
    RunProcess::start(dir, name, &all)
}

fn stage_of(p: &mut RunProcess) -> u64 {
    let line = p.wait_line(LONG, |l| l.starts_with("serving stage"));
    line.split_whitespace().nth(2).unwrap().parse().unwrap()
}

#[test]
fn cpu_and_wgpu_replicas_train_one_stage_with_equal_parameters() {
    if std::env::var_os("SHOAL_SKIP_WGPU").is_some() {
        eprintln!("SKIPPED: SHOAL_SKIP_WGPU is set, so the wgpu replica cannot run");
        return;
    }
    let dir = temp_dir("mixed-backends");
    let mut creator = start(
        &dir,
        "p0",
        &[
            "--backend",
            "cpu",
            "--preset",
            "nano",
            "--stages",
            "2",
            "--global-batch",
            "16",
            "--microbatch",
            "4",
            "--max-steps",
            "40",
            "--stage",
            "0",
        ],
    );
    let join = creator.wait_line(LONG, |l| l.contains("--bootstrap"));
    let words: Vec<&str> = join.split_whitespace().collect();
    let run_id = words[words.iter().position(|w| *w == "--run").unwrap() + 1].to_owned();
    let boot = words[words.iter().position(|w| *w == "--bootstrap").unwrap() + 1].to_owned();
    let mut stages = vec![stage_of(&mut creator)];
    let mut peers = vec![creator];
    for (name, backend) in [("p1", "wgpu"), ("p2", "cpu")] {
        let joiner = ["--run", &run_id, "--bootstrap", &boot, "--stage", "1"];
        let mut p = start(&dir, name, &[&["--backend", backend][..], &joiner].concat());
        stages.push(stage_of(&mut p));
        peers.push(p);
    }
    eprintln!("stages of the cpu, wgpu and cpu peers: {stages:?}");
    assert_eq!(stages, [0, 1, 1]);

    let reports: Vec<Value> = peers.iter_mut().map(|p| p.finish(LONG)).collect();
    let mut per_stage: BTreeMap<u64, Vec<(String, String)>> = BTreeMap::new();
    for r in &reports {
        assert_eq!(r["run_id"], run_id.as_str());
        assert!(r["steps"].as_u64().unwrap() > 0, "{r}");
        per_stage
            .entry(r["stage"].as_u64().unwrap())
            .or_default()
            .push((
                r["backend"].as_str().unwrap().to_owned(),
                r["params_hash"].as_str().unwrap_or("none").to_owned(),
            ));
    }
    assert!(
        reports[1]["backend"].as_str().unwrap().starts_with("wgpu"),
        "the second peer ran on wgpu: {}",
        reports[1]["backend"]
    );
    // Both stages served, so the wgpu peer shares its stage with a CPU peer.
    assert_eq!(per_stage.len(), 2, "{per_stage:?}");
    let mixed = per_stage
        .values()
        .find(|replicas| replicas.len() == 2)
        .unwrap();
    let backends: BTreeSet<&str> = mixed
        .iter()
        .map(|(b, _)| b.split_whitespace().next().unwrap())
        .collect();
    assert_eq!(backends.len(), 2, "one stage on cpu and wgpu: {mixed:?}");
    let done: Vec<u64> = reports
        .iter()
        .map(|r| r["microbatches_done"].as_u64().unwrap())
        .collect();
    eprintln!("microbatches computed by the cpu, wgpu and cpu peers: {done:?}");
    assert!(done[1] > 0, "the wgpu peer computed microbatches: {done:?}");
    assert_eq!(
        mixed[0].1, mixed[1].1,
        "cpu and wgpu replicas ended on different parameters: {mixed:?}"
    );
    // The loss fell on the last stage.
    let last = reports
        .iter()
        .filter(|r| r["stage"] == 1)
        .max_by_key(|r| r["loss_curve"].as_array().map_or(0, |c| c.len()))
        .unwrap();
    let curve: Vec<f64> = last["loss_curve"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[1].as_f64().unwrap())
        .collect();
    let first = curve[..3].iter().sum::<f64>() / 3.0;
    let final_loss = last["final_loss"].as_f64().unwrap();
    eprintln!("loss {first:.3} -> {final_loss:.3}");
    assert!(
        final_loss < first - 0.5,
        "the loss fell: {first} -> {final_loss}"
    );
}
