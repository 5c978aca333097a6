//! `shoal run` end to end: seven real processes on loopback train `nano` as 3 stages x 2
//! replicas while one replica is killed, a new peer joins and another restarts from its
//! checkpoint. Run for both synchronisation modes.

#![allow(clippy::unwrap_used, missing_docs)]

use serde_json::Value;
use shoal_tests::{RunProcess, metric, scrape, temp_dir};
use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::Duration;

const STAGES: u64 = 3;
const LONG: Duration = Duration::from_secs(600);

fn common(dir: &Path, name: &str) -> Vec<String> {
    [
        "--listen",
        "/ip4/127.0.0.1/udp/0/quic-v1",
        "--no-mdns",
        "--threads",
        "1",
        "--checkpoint-every",
        "10",
        "--checkpoint-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([dir.join(format!("{name}-ckpt")).display().to_string()])
    .collect()
}

fn start(dir: &Path, name: &str, args: &[String]) -> RunProcess {
    let mut all = common(dir, name);
    all.extend(args.iter().cloned());
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    RunProcess::start(dir, name, &refs)
}

/// The run id and bootstrap address the creator prints for others to join with.
fn run_to_join(creator: &mut RunProcess) -> (String, String) {
    creator.join_command(LONG, |_| true)
}

fn stage_of(p: &mut RunProcess) -> u64 {
    let line = p.wait_line(LONG, |l| l.starts_with("serving stage"));
    line.split_whitespace().nth(2).unwrap().parse().unwrap()
}

/// Seven processes each: the two tests take turns on a small machine.
static ONE_SWARM_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn swarm_trains(sync: &[&str], steps: u64, churn: bool) {
    let _turn = ONE_SWARM_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir(&format!("run-{}", sync.join("")));
    let creator_args: Vec<String> = [
        "--preset",
        "nano",
        "--stages",
        "3",
        "--global-batch",
        "64",
        "--microbatch",
        "8",
        "--max-steps",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([steps.to_string()])
    .chain(sync.iter().map(|s| s.to_string()))
    .collect();
    let mut creator = start(&dir, "p0", &creator_args);
    let (run_id, boot) = run_to_join(&mut creator);
    let join_args = vec![
        "--run".to_string(),
        run_id.clone(),
        "--bootstrap".into(),
        boot.clone(),
    ];
    let mut peers = vec![creator];
    let mut stages = vec![stage_of(&mut peers[0])];
    for i in 1..6 {
        let mut p = start(&dir, &format!("p{i}"), &join_args);
        stages.push(stage_of(&mut p));
        peers.push(p);
    }
    let mut per_stage = [0; STAGES as usize];
    for s in &stages {
        per_stage[*s as usize] += 1;
    }
    // Stages are chosen by measured throughput, so the split need not be even, but every
    // stage is served.
    assert!(
        per_stage.iter().all(|n| *n > 0),
        "stages served: {per_stage:?}"
    );

    let mut victim = usize::MAX;
    let mut restarted = usize::MAX;
    let mut newcomer = None;
    if churn {
        // Mid-run, SIGKILL a replica of a stage that has another.
        peers[0].wait_step(steps / 5, LONG);
        let replicated = |i: usize| i != 0 && per_stage[stages[i] as usize] >= 2;
        let victim_ = (0..6).find(|i| replicated(*i)).unwrap();
        victim = victim_;
        peers[victim].kill();

        // A new peer joins and takes a stage.
        let mut newcomer_ = start(&dir, "p6", &join_args);
        let newcomer_stage = stage_of(&mut newcomer_);
        eprintln!("the newcomer serves stage {newcomer_stage}");

        // Another peer, of another replicated stage if there is one, is killed and restarted
        // from its checkpoint.
        let restarted_ = (0..6)
            .filter(|i| *i != victim && replicated(*i))
            .max_by_key(|i| stages[*i] != stages[victim])
            .unwrap();
        restarted = restarted_;
        let restarted_stage = stages[restarted];
        let ckpt = dir.join(format!("p{restarted}-ckpt")).join("stage.ckpt");
        peers[restarted].wait_step(steps * 2 / 5, LONG);
        let deadline = std::time::Instant::now() + LONG;
        while !ckpt.exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "no checkpoint written"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        // Restarted as a server would be: same identity, same address.
        let listening = peers[restarted].wait_line(LONG, |l| l.starts_with("listening on"));
        let addr = listening["listening on ".len()..]
            .split("/p2p/")
            .next()
            .unwrap()
            .to_owned();
        peers[restarted].kill();
        std::thread::sleep(Duration::from_secs(2));
        let mut same_place = join_args.clone();
        same_place.extend(["--listen".to_string(), addr]);
        let mut back = start(&dir, &format!("p{restarted}"), &same_place);
        let resumed = back.wait_line(LONG, |l| l.starts_with("resuming stage"));
        assert!(
            resumed.starts_with(&format!("resuming stage {restarted_stage}")),
            "{resumed}"
        );
        peers[restarted] = back;

        newcomer = Some(newcomer_);
    }

    // Everyone finishes and reports.
    let mut reports: Vec<(usize, Value)> = Vec::new();
    for (i, p) in peers.iter_mut().enumerate() {
        if i != victim {
            reports.push((i, p.finish(LONG)));
        }
    }
    if let Some(mut n) = newcomer {
        reports.push((6, n.finish(LONG)));
    }

    verify(&reports, &run_id);
    if churn {
        let restarted_report = &reports.iter().find(|(i, _)| *i == restarted).unwrap().1;
        assert!(
            restarted_report["resumed_from_step"].as_u64().unwrap() >= 10,
            "{restarted_report}"
        );
    }
    loss_fell(&reports, STAGES - 1, &format!("{sync:?}"));
}

/// What every swarm must show at its end: each stage's replicas (newcomers, restarted and
/// moved peers included) hold identical parameters, and no microbatch was applied twice at
/// any stage, whatever was retried.
fn verify(reports: &[(usize, Value)], run_id: &str) {
    let mut hashes: BTreeMap<u64, HashSet<String>> = BTreeMap::new();
    let mut committed: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for (i, r) in reports {
        assert_eq!(r["run_id"], run_id);
        let stage = r["stage"].as_u64().unwrap();
        hashes
            .entry(stage)
            .or_default()
            .insert(r["params_hash"].as_str().unwrap_or("none").to_owned());
        for pair in r["committed_samples"].as_array().unwrap() {
            committed
                .entry(pair[0].as_u64().unwrap())
                .or_default()
                .push(pair[1].as_u64().unwrap());
        }
        assert!(r["steps"].as_u64().unwrap() > 0, "p{i} took steps: {r}");
        assert!(
            r["device_memory_peak_bytes"].as_u64().unwrap() > 0,
            "p{i} held a stage: {r}"
        );
        assert_eq!(
            r["violations"], 0,
            "p{i}: honest peers break no rule: {}",
            r["violations_by_kind"]
        );
    }
    // No codec named: each hop went out in int8 or int4, as its link allowed (which one is a
    // matter of timing; here, on loopback, mostly int8).
    let mut boundary: BTreeMap<String, u64> = BTreeMap::new();
    for (_, r) in reports {
        for (codec, n) in r["boundary_codecs"].as_object().unwrap() {
            *boundary.entry(codec.clone()).or_default() += n.as_u64().unwrap();
        }
    }
    eprintln!("boundary messages by codec: {boundary:?}");
    assert!(boundary.values().sum::<u64>() > 0, "{boundary:?}");
    assert!(
        boundary.keys().all(|c| c == "int8" || c == "int4"),
        "{boundary:?}"
    );
    for (stage, set) in &hashes {
        assert_eq!(set.len(), 1, "stage {stage}: replicas differ: {set:?}");
    }
    for (stage, samples) in &committed {
        let unique: HashSet<&u64> = samples.iter().collect();
        assert_eq!(
            unique.len(),
            samples.len(),
            "stage {stage}: a sample applied twice"
        );
    }
}

/// The loss fell: the first steps of the last stage's earliest curve against its last. (A
/// replica that joined the last stage later starts its curve where the others were then.)
fn loss_fell(reports: &[(usize, Value)], last_stage: u64, what: &str) {
    let first_step = |r: &Value| r["loss_curve"][0][0].as_u64().unwrap_or(u64::MAX);
    let last = reports
        .iter()
        .map(|(_, r)| r)
        .filter(|r| {
            r["stage"] == last_stage && r["loss_curve"].as_array().is_some_and(|c| c.len() > 20)
        })
        .min_by_key(|r| first_step(r))
        .unwrap();
    let curve: Vec<f64> = last["loss_curve"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[1].as_f64().unwrap())
        .collect();
    let first = curve[..5].iter().sum::<f64>() / 5.0;
    let final_loss = last["final_loss"].as_f64().unwrap();
    eprintln!(
        "{what}: loss {first:.3} -> {final_loss:.3}; dropped {}, retried {}",
        reports
            .iter()
            .map(|(_, r)| r["microbatches_dropped"].as_u64().unwrap())
            .sum::<u64>(),
        reports
            .iter()
            .map(|(_, r)| r["microbatches_retried"].as_u64().unwrap())
            .sum::<u64>()
    );
    assert!(
        final_loss < first - 1.0,
        "the loss fell: {first} -> {final_loss}"
    );
}

#[test]
fn allreduce_swarm_of_six_processes_trains_with_identical_replicas() {
    swarm_trains(&[], 300, false);
}

#[test]
fn diloco_swarm_of_six_processes_trains_with_identical_replicas() {
    swarm_trains(&["--sync", "diloco", "--diloco-h", "5"], 300, false);
}

/// Churn: a replica is killed, a peer joins, another restarts from its checkpoint.
#[test]
fn allreduce_swarm_survives_a_kill_a_join_and_a_restart() {
    swarm_trains(&[], 400, true);
}

#[test]
fn diloco_swarm_survives_a_kill_a_join_and_a_restart() {
    swarm_trains(&["--sync", "diloco", "--diloco-h", "5"], 400, true);
}

/// Rebalancing with real processes: four peers of two stages start three to one (`--stage`);
/// stage 1's peer lends a quarter of its device (`--duty-cycle 0.25`). One of the three moves
/// to the starved stage, the others stay, and the run goes on to its last step with identical
/// replicas. The run is long enough for several rebalancing checks
/// (a move waits for measured throughputs; at 200 steps, 1 run in 6 here ended before one).
#[test]
fn a_peer_moves_to_the_starved_stage_and_training_goes_on() {
    let _turn = ONE_SWARM_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("run-rebalance");
    let quick = ["--rebalance-every", "5"].map(String::from);
    let mut creator_args: Vec<String> = [
        "--preset",
        "nano",
        "--stages",
        "2",
        "--global-batch",
        "32",
        "--microbatch",
        "8",
        "--max-steps",
        "400",
        "--stage",
        "0",
    ]
    .map(String::from)
    .to_vec();
    creator_args.extend(quick.clone());
    let mut creator = start(&dir, "p0", &creator_args);
    let (run_id, boot) = run_to_join(&mut creator);
    let mut peers = vec![creator];
    for (i, stage) in [(1, 0), (2, 0), (3, 1)] {
        let mut args = vec!["--run".into(), run_id.clone(), "--bootstrap".into()];
        args.extend([boot.clone(), "--stage".into(), stage.to_string()]);
        args.extend(quick.clone());
        if stage == 1 {
            // Four processes share this machine's cores, and the samples per second each
            // measures follow the CPU share it gets: equal peers alone would not make stage 1
            // starved reliably. A peer lending a quarter of its device does.
            args.extend(["--duty-cycle", "0.25"].map(String::from));
        }
        peers.push(start(&dir, &format!("p{i}"), &args));
    }
    for (p, stage) in peers.iter_mut().zip([0, 0, 0, 1]) {
        assert_eq!(stage_of(p), stage, "{}", p.name);
    }
    let reports: Vec<(usize, Value)> = peers
        .iter_mut()
        .enumerate()
        .map(|(i, p)| (i, p.finish(LONG)))
        .collect();
    let moved: Vec<&Value> = reports
        .iter()
        .map(|(_, r)| r)
        .filter(|r| r["moves"].as_u64() != Some(0))
        .collect();
    assert_eq!(moved.len(), 1, "one peer moves: {reports:?}");
    assert_eq!(moved[0]["moves"], 1);
    assert_eq!(moved[0]["stage_history"], serde_json::json!([0, 1]));
    assert_eq!(moved[0]["stage"], 1);
    for (i, r) in &reports {
        assert_eq!(r["steps"], 400, "p{i} took the last step: {r}");
    }
    verify(&reports, &run_id);
    loss_fell(&reports, 1, "rebalanced");
}

/// A peer left alone (the only peer of the other stage is killed) gives up after
/// `--stall-timeout` with an error, leaving its report and checkpoint, instead of waiting for
/// peers forever.
#[test]
fn a_peer_left_alone_gives_up_with_an_error() {
    let _turn = ONE_SWARM_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("run-alone");
    let creator_args: Vec<String> = [
        "--preset",
        "nano",
        "--stages",
        "2",
        "--global-batch",
        "16",
        "--microbatch",
        "8",
        "--max-steps",
        "100000",
        "--stage",
        "0",
        "--stall-timeout",
        "5",
    ]
    .map(String::from)
    .to_vec();
    let mut creator = start(&dir, "p0", &creator_args);
    let (run_id, boot) = run_to_join(&mut creator);
    let joiner_args: Vec<String> = vec![
        "--run".into(),
        run_id,
        "--bootstrap".into(),
        boot,
        "--stage".into(),
        "1".into(),
    ];
    let mut other = start(&dir, "p1", &joiner_args);
    creator.wait_step(5, LONG);
    other.kill();
    let status = creator.wait_exit(Duration::from_secs(120));
    assert!(!status.success(), "a peer left alone exits with an error");
    let report = creator.report();
    assert!(report["steps"].as_u64().unwrap() >= 5, "{report}");
    assert!(dir.join("p0-ckpt").join("stage.ckpt").exists());
}

/// Three peers of a real run serve Prometheus metrics: every family with its type, and the
/// counters rise while the run trains.
#[test]
fn peers_serve_prometheus_metrics_that_rise_as_the_run_trains() {
    let _turn = ONE_SWARM_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("run-metrics");
    let metrics = ["--metrics", "127.0.0.1:0"].map(String::from).to_vec();
    let mut creator_args: Vec<String> = [
        "--preset",
        "nano",
        "--stages",
        "2",
        "--global-batch",
        "8",
        "--microbatch",
        "4",
        "--seq",
        "32",
        "--max-steps",
        "100000",
        "--stage",
        "0",
    ]
    .map(String::from)
    .to_vec();
    creator_args.extend(metrics.clone());
    let mut peers = vec![start(&dir, "p0", &creator_args)];
    let (run_id, boot) = run_to_join(&mut peers[0]);
    for (name, stage) in [("p1", "1"), ("p2", "1")] {
        let mut args = vec![
            "--run".into(),
            run_id.clone(),
            "--bootstrap".into(),
            boot.clone(),
        ];
        args.extend(["--stage".into(), stage.into()]);
        args.extend(metrics.clone());
        peers.push(start(&dir, name, &args));
    }
    let urls: Vec<String> = peers
        .iter_mut()
        .map(|p| {
            let line = p.wait_line(LONG, |l| l.starts_with("metrics on http://"));
            line.trim_start_matches("metrics on ").to_owned()
        })
        .collect();
    for p in &mut peers {
        p.wait_step(3, LONG);
    }
    let before: Vec<String> = urls.iter().map(|u| scrape(u)).collect();
    for p in &mut peers {
        let at = p.step();
        p.wait_step(at + 3, LONG);
    }
    let after: Vec<String> = urls.iter().map(|u| scrape(u)).collect();
    for (i, (before, after)) in before.iter().zip(&after).enumerate() {
        for (family, kind) in [
            ("shoal_peer_info", "gauge"),
            ("shoal_step", "gauge"),
            ("shoal_loss", "gauge"),
            ("shoal_tokens", "counter"),
            ("shoal_throughput_tokens_per_second", "gauge"),
            ("shoal_traffic_bytes", "counter"),
            ("shoal_microbatches", "counter"),
            ("shoal_stage_peers", "gauge"),
            ("shoal_averaging_round_duration_seconds", "histogram"),
            ("shoal_state_download_held_bytes", "gauge"),
            ("shoal_device_memory_peak_bytes", "gauge"),
        ] {
            assert!(
                after.contains(&format!("# TYPE {family} {kind}\n")),
                "p{i}: no {kind} {family}:\n{after}"
            );
        }
        assert!(after.ends_with("# EOF\n"), "p{i}: {after}");
        let rose = |name: &str| {
            let (b, a) = (metric(before, name), metric(after, name));
            assert!(
                a.unwrap_or(0.0) > b.unwrap_or(0.0),
                "p{i}: {name} did not rise ({b:?} to {a:?})"
            );
        };
        rose("shoal_step");
        rose("shoal_averaging_rounds_total");
        rose("shoal_averaging_round_duration_seconds_count");
        let seen: f64 = (0..2)
            .filter_map(|s| metric(after, &format!("shoal_stage_peers{{stage=\"{s}\"}}")))
            .sum();
        assert_eq!(seen, 3.0, "p{i} sees every peer");
        assert!(metric(after, "shoal_device_memory_peak_bytes").unwrap() > 0.0);
    }
    // Work: stage 0 (p0 alone) commits every microbatch, sends activations and receives
    // their gradients; routing may give one replica of stage 1 the whole of a few steps, so
    // the two are counted together there.
    let rose_over = |peers: std::ops::Range<usize>, name: &str| {
        let sum = |texts: &[String]| -> f64 {
            peers.clone().filter_map(|i| metric(&texts[i], name)).sum()
        };
        let (b, a) = (sum(&before), sum(&after));
        assert!(a > b, "peers {peers:?}: {name} did not rise ({b} to {a})");
    };
    let traffic = |direction: &str, kind: &str| {
        format!("shoal_traffic_bytes_total{{direction=\"{direction}\",kind=\"{kind}\"}}")
    };
    for (peers, sent, received) in [
        (0..1, "activations", "activation_grads"),
        (1..3, "activation_grads", "activations"),
    ] {
        rose_over(peers.clone(), "shoal_tokens_total");
        rose_over(peers.clone(), &traffic("sent", sent));
        rose_over(peers, &traffic("received", received));
    }
    // The stage-1 replicas average with each other: their traffic has averaging in it.
    for (i, after) in after.iter().enumerate().skip(1) {
        assert_eq!(metric(after, "shoal_stage"), Some(1.0), "p{i}");
        assert!(
            metric(after, &traffic("sent", "averaging")).unwrap() > 0.0,
            "p{i}: {after}"
        );
    }
}

/// SIGTERM (how `kill`, docker and systemd stop a process) leaves what Ctrl-C leaves: the
/// checkpoint and the report, written on the way out; a report is also on disk while the peer
/// runs. Restarted on its checkpoint, the peer resumes where it stopped.
#[test]
fn sigterm_writes_the_checkpoint_and_the_report_and_a_restart_resumes() {
    let _turn = ONE_SWARM_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("run-sigterm");
    let args: Vec<String> = [
        "--preset",
        "nano",
        "--global-batch",
        "8",
        "--microbatch",
        "4",
        "--seq",
        "32",
        "--max-steps",
        "100000",
        "--report-every",
        "1",
    ]
    .map(String::from)
    .to_vec();
    let mut peer = start(&dir, "p0", &args);
    peer.wait_step(3, LONG);
    let running = {
        let deadline = std::time::Instant::now() + LONG;
        loop {
            if let Ok(text) = std::fs::read_to_string(&peer.report)
                && let Ok(report) = serde_json::from_str::<Value>(&text)
            {
                break report;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no report while running"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    assert_eq!(running["status"], "running", "{running}");
    peer.wait_step(6, LONG);
    peer.terminate();
    let status = peer.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "SIGTERM is a clean stop: {status}");
    peer.wait_line(LONG, |l| l.starts_with("stopped by SIGTERM"));
    let report = peer.report();
    assert_eq!(report["status"], "stopped", "{report}");
    let steps = report["steps"].as_u64().unwrap();
    assert!(steps >= 6, "{report}");
    let written = peer.wait_line(LONG, |l| l.starts_with("checkpoint written at step"));
    assert!(written.ends_with(&format!("step {steps}")), "{written}");
    assert!(dir.join("p0-ckpt").join("stage.ckpt").exists());

    let mut again = start(&dir, "p0", &args);
    let resumed = again.wait_line(LONG, |l| l.starts_with("resuming stage"));
    assert!(resumed.contains(&format!("at step {steps} ")), "{resumed}");
    again.wait_step(steps + 2, LONG);
    again.terminate();
    assert!(again.wait_exit(Duration::from_secs(60)).success());
    assert_eq!(again.report()["resumed_from_step"].as_u64(), Some(steps));

    // The peer's checkpoint is a model others can read: `shoal export` writes it as GPT-2
    // safetensors (tests/tests/models.rs checks the format itself), and it generates.
    let model = dir.join("model.safetensors");
    let ckpt = dir.join("p0-ckpt");
    let export = std::process::Command::new(shoal_tests::shoal_binary())
        .arg("export")
        .arg(&ckpt)
        .arg("-o")
        .arg(&model)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&export.stdout);
    assert!(
        export.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&export.stderr)
    );
    assert!(said.contains("stage 0 at step"), "{said}");
    let generate = std::process::Command::new(shoal_tests::shoal_binary())
        .arg("generate")
        .arg(&model)
        .args(["--prompt", "ab", "--tokens", "8"])
        .output()
        .unwrap();
    assert!(generate.status.success(), "{generate:?}");
    assert!(String::from_utf8_lossy(&generate.stdout).starts_with("ab"));
}

/// A joiner pulls a stage's state (`mini` in one stage: about 400 MB with its AdamW moments)
/// from both replicas at once, each capped at 80 MB/s so the download takes seconds even on
/// loopback; one source is killed a third of the way and the download finishes from the
/// other, keeping every chunk it had (no restart, few bytes received twice).
#[test]
fn a_joiner_keeps_its_download_when_a_source_is_killed() {
    let _turn = ONE_SWARM_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("run-download");
    let run_args: Vec<String> = [
        "--preset",
        "mini",
        "--stages",
        "1",
        "--seq",
        "16",
        "--global-batch",
        "32",
        "--microbatch",
        "2",
        "--max-steps",
        "40",
    ]
    .map(String::from)
    .to_vec();
    let joiner = |run_id: &str, boot: &str| -> Vec<String> {
        [
            "--run",
            run_id,
            "--bootstrap",
            boot,
            "--state-upload-limit",
            "80",
        ]
        .map(String::from)
        .to_vec()
    };
    let mut creator_args = run_args.clone();
    creator_args.extend(["--state-upload-limit", "80"].map(String::from));
    // No checkpoints: 400 MB each.
    let start = |name: &str, args: &[String]| {
        let mut all: Vec<&str> = ["--listen", "/ip4/127.0.0.1/udp/0/quic-v1", "--no-mdns"].to_vec();
        all.extend(["--threads", "1"]);
        all.extend(args.iter().map(String::as_str));
        RunProcess::start(&dir, name, &all)
    };
    let mut p0 = start("p0", &creator_args);
    let (run_id, boot) = run_to_join(&mut p0);
    assert_eq!(stage_of(&mut p0), 0);
    let mut p1 = start("p1", &joiner(&run_id, &boot));
    assert_eq!(stage_of(&mut p1), 0);
    let at = p1.step();
    p1.wait_step(at + 3, LONG);
    let mut p2 = start("p2", &joiner(&run_id, &boot));
    let line = p2.wait_line(LONG, |l| {
        l.starts_with("state download: ")
            && l["state download: ".len()..]
                .split('%')
                .next()
                .and_then(|p| p.parse::<u32>().ok())
                .is_some_and(|p| p >= 30)
    });
    p1.kill();
    let total_mb: f64 = line
        .split(" of ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|t| t.parse().ok())
        .unwrap();
    assert!(total_mb > 300.0, "a multi-hundred-MB state: {line}");
    assert_eq!(stage_of(&mut p2), 0);
    let r0 = p0.finish(LONG);
    let r2 = p2.finish(LONG);
    let received = r2["state_bytes_received"].as_u64().unwrap() as f64 / 1e6;
    eprintln!(
        "joiner: {received:.1} MB received for a {total_mb:.1} MB state, source killed at {line:?}, \
         {} restart(s)",
        r2["state_restarts"]
    );
    assert_eq!(r2["state_restarts"], 0, "{r2}");
    assert_eq!(r2["state_transfers"], 1, "{r2}");
    // Lost with the killed source: the chunks it had been asked for, a few at most.
    assert!(
        received < total_mb + 40.0,
        "{received} MB for {total_mb} MB"
    );
    assert_eq!(r0["steps"], 40);
    assert_eq!(r2["steps"], 40);
    assert_eq!(
        r0["params_hash"], r2["params_hash"],
        "the joiner agrees with its stage"
    );
}

/// A peer whose `--memory-limit` cannot hold its stage (micro's last three blocks, with the
/// window of microbatches the swarm budgets for) serves it all the same, its blocks in host
/// memory and on the device a block at a time, within the limit, and the run trains.
#[test]
fn a_peer_under_a_memory_limit_serves_a_stage_it_cannot_hold() {
    use shoal_compute::{Preset, Residency, StageSpec};
    let _turn = ONE_SWARM_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let (config, spec) = (Preset::Micro.config(), StageSpec { index: 1, count: 2 });
    // Two microbatches of 2 x 32 tokens in flight per stage, as the protocol budgets.
    let device = |held| spec.device_memory_bytes(&config, 2, 32, 4, held);
    let resident = device(Residency {
        moments_on_host: true,
        ..Residency::default()
    });
    let offloaded = device(Residency {
        offload: true,
        ..Residency::default()
    });
    let limit = (resident + offloaded) / 2;
    assert!(offloaded < limit && limit < resident);

    let dir = temp_dir("run-memory-limit");
    let mut creator_args: Vec<String> = [
        "--preset",
        "micro",
        "--stages",
        "2",
        "--seq",
        "32",
        "--global-batch",
        "8",
        "--microbatch",
        "2",
        "--max-steps",
        "60",
        "--stage",
        "0",
    ]
    .map(String::from)
    .to_vec();
    creator_args.extend(["--lr".into(), "0.003".into()]);
    let mut creator = start(&dir, "p0", &creator_args);
    let (run_id, boot) = run_to_join(&mut creator);
    let args: Vec<String> = ["--run", &run_id, "--bootstrap", &boot, "--stage", "1"]
        .iter()
        .map(|s| s.to_string())
        .chain(["--memory-limit".into(), limit.to_string()])
        .collect();
    let mut limited = start(&dir, "p1", &args);
    assert_eq!(stage_of(&mut creator), 0);
    assert_eq!(stage_of(&mut limited), 1);
    let reports: Vec<(usize, Value)> = [creator, limited]
        .iter_mut()
        .enumerate()
        .map(|(i, p)| (i, p.finish(LONG)))
        .collect();
    let r = &reports[1].1;
    assert_eq!(r["steps"], 60, "{r}");
    assert_eq!(r["memory_limit_bytes"], limit, "{r}");
    let peak = r["device_memory_peak_bytes"].as_u64().unwrap();
    assert!(peak <= limit, "held {peak} of {limit}: {r}");
    assert!(r["offloaded_bytes"].as_u64().unwrap() > 0, "{r}");
    verify(&reports, &run_id);
    loss_fell(&reports, 1, "under a memory limit");
}

/// A joiner whose bootstrap peer never answers says so while it asks again, then exits with
/// an error naming the run, the peer it asked and the timeout, instead of waiting forever.
#[test]
fn a_joiner_that_hears_nothing_gives_up_saying_what_it_tried() {
    let dir = temp_dir("run-join-timeout");
    let nobody = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN";
    let mut child = std::process::Command::new(shoal_tests::shoal_binary())
        .args(["run", "--run", "0123456789abcdef", "--bootstrap"])
        .arg(format!("/ip4/127.0.0.1/udp/9/quic-v1/p2p/{nobody}"))
        .args(["--join-timeout", "3", "--no-mdns", "--identity"])
        .arg(dir.join("id"))
        .args(["--listen", "/ip4/127.0.0.1/udp/0/quic-v1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // It must end by itself; a minute is twenty times what it was given.
    let started = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("still waiting after a minute");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("asking again"), "{stdout}");
    assert!(
        stderr.contains("no peer of run 0123456789abcdef answered within 3 s (--join-timeout)")
            && stderr.contains(nobody),
        "{stderr}"
    );
}
