//! Models out of shoal and back in: `shoal train --export` writes a GPT-2 safetensors file
//! that a NumPy forward pass written apart from shoal (`tests/python/gpt2_numpy.py`, reading
//! it with the `safetensors` package) computes the same next-token probabilities from (within
//! 1e-4) and continues the same way greedily; `--init` starts training from the file where
//! the first run ended, in `shoal train` and in a swarm (`shoal run --init`, whose held-out
//! evaluations every peer reports).
//!
//! Needs python3 with numpy and safetensors: the README's test command installs them into
//! `target/python`.

#![allow(clippy::unwrap_used, missing_docs)]

use serde_json::Value;
use shoal_tests::{RunProcess, shoal_binary, temp_dir};
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

const LONG: Duration = Duration::from_secs(600);

fn shoal(args: &[&str]) -> Output {
    let out = Command::new(shoal_binary()).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "shoal {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn report(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn an_exported_model_is_gpt2_to_numpy_and_training_resumes_from_it() {
    let dir = temp_dir("models");
    let model = dir.join("model.safetensors");
    let (first, second) = (dir.join("first.json"), dir.join("second.json"));
    let common = [
        "--preset",
        "nano",
        "--stages",
        "2",
        "--batch",
        "8",
        "--seq",
        "64",
        "--threads",
        "1",
    ];
    let mut args = common.to_vec();
    let model_s = model.to_str().unwrap();
    args.extend([
        "--steps",
        "60",
        "--export",
        model_s,
        "--report",
        first.to_str().unwrap(),
    ]);
    args.insert(0, "train");
    shoal(&args);
    assert!(dir.join("config.json").exists());

    let probs = dir.join("probs.json");
    let prompt = "The cat sat on the mat.";
    let generated = shoal(&[
        "generate",
        model_s,
        "--prompt",
        prompt,
        "--tokens",
        "12",
        "--temperature",
        "0",
        "--probabilities",
        probs.to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&generated.stdout)
        .trim_end()
        .to_owned();
    assert!(
        text.starts_with(prompt) && text.len() > prompt.len(),
        "{text}"
    );

    let python_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/python");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/gpt2_numpy.py");
    let out = Command::new("python3")
        .arg(&script)
        .args([model_s, prompt, probs.to_str().unwrap(), "12"])
        .env("PYTHONPATH", &python_path)
        .output()
        .expect("python3 (the README's test command installs numpy and safetensors)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{stdout}");
    let greedy: String = stdout
        .lines()
        .find_map(|l| serde_json::from_str(l.strip_prefix("greedy: ")?).ok())
        .unwrap();
    assert_eq!(greedy, text, "NumPy's greedy continuation is shoal's");

    // Training from the file starts where the first run ended, not from scratch.
    let mut args = common.to_vec();
    args.extend([
        "--steps",
        "5",
        "--init",
        model_s,
        "--report",
        second.to_str().unwrap(),
    ]);
    args.insert(0, "train");
    shoal(&args);
    let (a, b) = (report(&first), report(&second));
    let start = a["loss_curve"][0][1].as_f64().unwrap();
    let end = a["final_loss"].as_f64().unwrap();
    let resumed = b["loss_curve"][0][1].as_f64().unwrap();
    assert!(
        (resumed - end).abs() < 0.25 * (start - end),
        "first run {start:.3} to {end:.3}; from its file: {resumed:.3}"
    );
}

/// Real tokens: the shipped text as GPT-2 token shards (llm.c's format), a model whose
/// vocabulary follows them, evaluated on the validation shard and sampled as text.
#[test]
fn gpt2_token_shards_train_a_model_of_gpt2s_vocabulary() {
    let dir = temp_dir("shards");
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/shakespeare.txt");
    let prefix = dir.join("shk");
    let prepared = shoal(&[
        "data",
        "prepare",
        text.to_str().unwrap(),
        "--tokenizer",
        "gpt2",
        "-o",
        prefix.to_str().unwrap(),
    ]);
    let said = String::from_utf8_lossy(&prepared.stdout);
    let (train, val) = (dir.join("shk_train.bin"), dir.join("shk_val.bin"));
    let bytes = std::fs::read(&train).unwrap();
    let field = |i: usize| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
    assert_eq!(
        (field(0), field(1)),
        (20240520, 1),
        "llm.c's magic and version"
    );
    let tokens = field(2) as usize;
    assert_eq!(bytes.len(), 1024 + 2 * tokens);
    // GPT-2 BPE: about 3.7 bytes of English per token, far fewer tokens than bytes.
    let size = std::fs::metadata(&text).unwrap().len() as usize;
    assert!(tokens * 3 < size, "{tokens} tokens for {size} bytes");
    assert!(said.contains("(validation)"), "{said}");

    let model = dir.join("model.safetensors");
    let report = dir.join("train.json");
    shoal(&[
        "train",
        "--preset",
        "nano",
        "--steps",
        "20",
        "--batch",
        "8",
        "--seq",
        "32",
        "--threads",
        "1",
        "--eval-every",
        "10",
        "--data",
        train.to_str().unwrap(),
        "--val-data",
        val.to_str().unwrap(),
        "--export",
        model.to_str().unwrap(),
        "--report",
        report.to_str().unwrap(),
    ]);
    let r = self::report(&report);
    assert!(
        r["data"].as_str().unwrap().contains("vocabulary of 50257"),
        "{r}"
    );
    assert_eq!(r["val_curve"].as_array().unwrap().len(), 2, "{r}");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["vocab_size"], 50257);
    // A uniform guess over GPT-2's vocabulary scores ln 50257 = 10.8; training did better.
    let held_out = r["held_out_loss"].as_f64().unwrap();
    assert!(held_out < 10.0, "{held_out}");

    let evaluated = shoal(&[
        "eval",
        model.to_str().unwrap(),
        "--data",
        val.to_str().unwrap(),
        "--seq",
        "32",
    ]);
    let said = String::from_utf8_lossy(&evaluated.stdout);
    let loss: f64 = said
        .strip_prefix("loss ")
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{said}"));
    assert!(loss < 10.0, "{said}");

    let generated = shoal(&[
        "generate",
        model.to_str().unwrap(),
        "--prompt",
        "ROMEO:",
        "--tokens",
        "10",
    ]);
    assert!(String::from_utf8_lossy(&generated.stdout).starts_with("ROMEO:"));
}

/// A swarm started from a model file (`shoal run --init`): both peers of a 2-stage run build
/// their stages from the file, so the run's first loss is where the file's training ended;
/// its held-out evaluations (`--eval-every`) reach both peers' reports; a peer without the
/// file cannot join.
#[test]
fn a_swarm_starts_from_a_model_file_and_reports_its_held_out_loss() {
    let dir = temp_dir("run-init");
    let model = dir.join("model.safetensors");
    let trained = dir.join("train.json");
    let shape = ["--preset", "nano", "--seq", "32"];
    let mut args = vec!["train", "--stages", "2", "--batch", "8", "--threads", "1"];
    args.extend(shape);
    args.extend([
        "--steps",
        "60",
        "--export",
        model.to_str().unwrap(),
        "--report",
        trained.to_str().unwrap(),
    ]);
    shoal(&args);
    let trained = report(&trained);

    let peer = |name: &str, extra: &[&str]| {
        let mut a = vec![
            "--listen",
            "/ip4/127.0.0.1/udp/0/quic-v1",
            "--no-mdns",
            "--threads",
            "1",
        ];
        a.extend(extra);
        RunProcess::start(&dir, name, &a)
    };
    let mut creator_args = vec![
        "--stages",
        "2",
        "--global-batch",
        "8",
        "--microbatch",
        "4",
        "--max-steps",
        "8",
        "--eval-every",
        "4",
        "--eval-samples",
        "32",
        "--init",
        model.to_str().unwrap(),
    ];
    creator_args.extend(shape);
    let mut creator = peer("p0", &creator_args);
    let (run, addr) = creator.join_command(LONG, |_| true);
    let join = ["--run", run.as_str(), "--bootstrap", addr.as_str()];
    let without = Command::new(shoal_binary())
        .args([
            "run",
            "--no-mdns",
            "--listen",
            "/ip4/127.0.0.1/udp/0/quic-v1",
        ])
        .args(join)
        .arg("--identity")
        .arg(dir.join("p2.key"))
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&without.stderr);
    assert!(!without.status.success(), "{said}");
    assert!(said.contains("pass the same file with --init"), "{said}");
    let mut joiner = peer(
        "p1",
        &[&join[..], &["--init", model.to_str().unwrap()]].concat(),
    );
    let reports = [creator.finish(LONG), joiner.finish(LONG)];

    let end = trained["final_loss"].as_f64().unwrap();
    let held_out = trained["held_out_loss"].as_f64().unwrap();
    let uniform = 256f64.ln();
    for r in &reports {
        // Steps 4 and 8, the same evaluation in both peers' reports.
        let curve = r["val_curve"].as_array().unwrap();
        let steps: Vec<u64> = curve.iter().map(|p| p[0].as_u64().unwrap()).collect();
        assert_eq!(steps, [4, 8], "{r}");
        assert_eq!(r["val_curve"], reports[0]["val_curve"]);
        assert_eq!(r["held_out_loss"], curve[1][1], "{r}");
        // Near the file's held-out loss, far from a fresh model's.
        let first = curve[0][1].as_f64().unwrap();
        assert!(
            (first - held_out).abs() < 0.25 * (uniform - held_out),
            "held-out {first:.3} after 4 steps from a file at {held_out:.3} (fresh: {uniform:.3})"
        );
    }
    let last_stage = reports.iter().find(|r| r["stage"] == 1).unwrap();
    let first_loss = last_stage["loss_curve"][0][1].as_f64().unwrap();
    assert!(
        (first_loss - end).abs() < 0.25 * (uniform - end),
        "the run's first loss {first_loss:.3}; the file's training ended at {end:.3}"
    );
}
