//! The command line: a short run writes a complete report; bad input gets one line of error
//! and a non-zero exit, never a panic.

#![allow(clippy::unwrap_used, missing_docs)]

use std::process::Command;

fn shoal(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(args)
        .output()
        .expect("run shoal")
}

/// The one JSON object a successful `shoal bench ...` prints.
fn bench_json(args: &[&str]) -> serde_json::Value {
    let out = shoal(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn assert_clean_failure(args: &[&str], expect: &str) {
    let out = shoal(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} should fail");
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(
        lines.len(),
        1,
        "{args:?}: expected one line, got {stderr:?}"
    );
    assert!(
        lines[0].contains(expect),
        "{args:?}: {:?} does not mention {expect:?}",
        lines[0]
    );
}

#[test]
fn bad_input_gives_one_line_and_nonzero_exit() {
    let dir = std::env::temp_dir().join(format!("shoal-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let binary = dir.join("binary.txt");
    std::fs::write(&binary, [0xff, 0xfe, 0x00, 0x80]).unwrap();
    let short = dir.join("short.txt");
    std::fs::write(&short, "tiny").unwrap();
    let missing = dir.join("does-not-exist.txt");

    assert_clean_failure(
        &["train", "--data", missing.to_str().unwrap(), "--steps", "1"],
        "cannot read",
    );
    assert_clean_failure(
        &["train", "--data", dir.to_str().unwrap(), "--steps", "1"],
        "cannot read",
    );
    assert_clean_failure(
        &["train", "--data", empty.to_str().unwrap(), "--steps", "1"],
        "empty",
    );
    assert_clean_failure(
        &["train", "--data", binary.to_str().unwrap(), "--steps", "1"],
        "not UTF-8",
    );
    assert_clean_failure(
        &["train", "--data", short.to_str().unwrap(), "--steps", "1"],
        "at least",
    );
    assert_clean_failure(&["train", "--preset", "huge"], "unknown preset");
    assert_clean_failure(&["train", "--batch", "0"], "at least 1");
    assert_clean_failure(&["train", "--steps=-3"], "not a positive whole number");
    assert_clean_failure(&["train", "--stages", "5"], "cannot cut");
    assert_clean_failure(&["bench", "compute", "--batch", "0"], "at least 1");
    assert_clean_failure(&["run", "--device-memory", "8XB"], "unknown unit");
    assert_clean_failure(&["run", "--device-memory=-1GB"], "not a positive size");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_short_run_writes_a_complete_report() {
    let dir = std::env::temp_dir().join(format!("shoal-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let report = dir.join("report.json");
    let out = shoal(&[
        "train",
        "--preset",
        "nano",
        "--steps",
        "4",
        "--batch",
        "2",
        "--stages",
        "2",
        "--threads",
        "1",
        "--report",
        report.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&report).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    for key in [
        "preset",
        "params",
        "steps",
        "tokens",
        "final_loss",
        "loss_floor",
        "tokens_per_s",
        "loss_curve",
    ] {
        assert!(json.get(key).is_some(), "report lacks {key}: {text}");
    }
    assert_eq!(json["preset"], "nano");
    assert_eq!(json["params"], 120_576);
    assert_eq!(json["tokens"], 4 * 2 * 64);
    assert_eq!(json["loss_curve"].as_array().unwrap().len(), 4);
    assert!(json["loss_floor"].as_f64().unwrap() > 0.5);
    // Each stage held what the plan says for one microbatch of 2 x 64 in flight.
    let peaks = json["device_memory_peak_bytes"].as_array().unwrap();
    assert_eq!(peaks.len(), 2);
    for (index, peak) in peaks.iter().enumerate() {
        let spec = shoal_compute::StageSpec { index, count: 2 };
        let plan = spec.device_memory_bytes(
            &shoal_compute::Preset::Nano.config(),
            2,
            64,
            1,
            shoal_compute::Residency::default(),
        );
        assert_eq!(peak.as_u64(), Some(plan), "stage {index}: {text}");
    }

    // A text file trains too, and has no known floor.
    let text_file = dir.join("text.txt");
    std::fs::write(
        &text_file,
        "the quick brown fox jumps over the lazy dog. ".repeat(20),
    )
    .unwrap();
    let out = shoal(&[
        "train",
        "--steps",
        "2",
        "--batch",
        "2",
        "--data",
        text_file.to_str().unwrap(),
        "--report",
        report.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert!(json["loss_floor"].is_null());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_compute_prints_one_json_object() {
    let json = bench_json(&[
        "bench",
        "compute",
        "--preset",
        "nano",
        "--batch",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--threads",
        "1",
        "--json",
    ]);
    for key in [
        "preset",
        "backend",
        "batch",
        "context",
        "params",
        "step_ms_median",
        "step_ms_min",
        "tokens_per_s",
        "gflops",
    ] {
        assert!(json.get(key).is_some(), "bench output lacks {key}");
    }
    assert!(json["step_ms_median"].as_f64().unwrap() > 0.0);
}

#[test]
fn bench_codec_prints_one_json_object() {
    let json = bench_json(&[
        "bench", "codec", "--values", "4096", "--rounds", "1", "--json",
    ]);
    assert!(json["memcpy_gbps"].as_f64().unwrap() > 0.0);
    for codec in ["fp32", "fp16", "bf16", "int8", "topk:1%"] {
        let c = &json["codecs"][codec];
        for key in ["encode_gbps", "decode_gbps", "ratio", "max_abs_error"] {
            assert!(c[key].is_number(), "{codec} lacks {key}");
        }
    }
    assert_eq!(json["codecs"]["fp32"]["max_abs_error"], 0.0);
    assert!(json["codecs"]["int8"]["ratio"].as_f64().unwrap() > 3.5);
}

#[test]
fn bench_net_prints_one_json_object() {
    let json = bench_json(&[
        "bench",
        "net",
        "--frame-mib",
        "1",
        "--frames",
        "2",
        "--rounds",
        "1",
        "--json",
    ]);
    for key in ["raw_quinn_mib_s", "shoal_mib_s", "ratio", "rtt_us_median"] {
        assert!(json[key].as_f64().unwrap() > 0.0, "bench net lacks {key}");
    }
}

/// `shoal bench average`: real processes average with the swarm's round, and every member
/// checks every result against the robust mean it recomputes: exact with fp32, within what
/// the codec explains with int8; no result may differ without saying it is partial.
#[test]
fn bench_average_checks_every_result_of_every_member() {
    for (codec, exact) in [("fp32", true), ("int8", false)] {
        let json = bench_json(&[
            "bench", "average", "--peers", "3", "--mib", "1", "--rounds", "6", "--codec", codec,
            "--json",
        ]);
        assert_eq!(json["rounds"], 6, "{json}");
        assert_eq!(json["silent_errors"], 0, "{json}");
        assert!(json["seconds_per_round_median"].as_f64().unwrap() > 0.0);
        let (error, explained) = (
            json["max_error"].as_f64().unwrap(),
            json["tolerance"].as_f64().unwrap(),
        );
        if exact {
            assert_eq!((error, explained), (0.0, 0.0), "{json}");
        } else {
            assert!(explained > 0.0 && error <= explained, "{json}");
        }
    }
    assert_clean_failure(&["bench", "average", "--peers", "1"], "at least 2");
}

/// Regression: every process on one machine used `~/.shoal/identity.key`, so several were one
/// peer to the network, never saw each other, and waited forever without a word. A second
/// process with an identity in use exits at once, naming the file and `--identity`.
#[test]
fn a_second_process_with_the_same_identity_exits_naming_the_file() {
    let dir = std::env::temp_dir().join(format!("shoal-cli-id-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let key = dir.join("shared.key");
    let key_arg = key.to_str().unwrap();
    let args = [
        "node",
        "--identity",
        key_arg,
        "--listen",
        "/ip4/127.0.0.1/udp/0/quic-v1",
        "--no-mdns",
    ];
    let mut first = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The first holds the identity once the file exists and is locked.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !key.exists() {
        assert!(std::time::Instant::now() < deadline, "no identity file");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    let started = std::time::Instant::now();
    let out = shoal(&args);
    let took = started.elapsed();
    let _ = first.kill();
    let _ = first.wait();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the second process ran: {stderr}");
    assert!(took < std::time::Duration::from_secs(5), "{took:?}");
    assert!(
        stderr.contains(key_arg) && stderr.contains("--identity"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
