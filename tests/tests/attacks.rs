//! Well-formed lies with real processes: `shoal run` peers built with the test-only `attacks`
//! feature misbehave (`--behavior`) in a swarm of honest ones on loopback. The honest peers
//! must ban them with evidence, end with identical parameters and train on.

#![allow(clippy::unwrap_used, missing_docs)]

use serde_json::Value;
use shoal_tests::{RunProcess, temp_dir};
use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

const LONG: Duration = Duration::from_secs(600);

/// Four processes each: the tests take turns on a small machine.
static ONE_SWARM_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A `shoal run` peer on loopback, one compute thread, identity and report in `dir`.
fn start(dir: &Path, name: &str, extra: &[&str]) -> RunProcess {
    let common = [
        "--listen",
        "/ip4/127.0.0.1/udp/0/quic-v1",
        "--no-mdns",
        "--threads",
        "1",
    ];
    let args: Vec<&str> = common.iter().chain(extra).copied().collect();
    RunProcess::start(dir, name, &args)
}

/// Creates a run of `nano` in one stage; returns its creator and the flags others join with
/// (`--run ID --bootstrap ADDR`).
fn create(dir: &Path, global_batch: &str, max_steps: &str) -> (RunProcess, Vec<String>) {
    let mut creator = start(
        dir,
        "p0",
        &[
            "--preset",
            "nano",
            "--global-batch",
            global_batch,
            "--microbatch",
            "8",
            "--max-steps",
            max_steps,
        ],
    );
    let join = creator.wait_line(LONG, |l| l.contains("--bootstrap"));
    let words: Vec<&str> = join.split_whitespace().collect();
    let after = |flag: &str| words[words.iter().position(|w| *w == flag).unwrap() + 1].to_owned();
    let joining = vec![
        "--run".to_owned(),
        after("--run"),
        "--bootstrap".to_owned(),
        after("--bootstrap"),
    ];
    (creator, joining)
}

/// Five replicas of one stage, one of them attacking with `behavior` once the swarm has
/// formed; returns the honest peers' reports and the attacker's peer id.
fn swarm_with_an_attacker(behavior: &str) -> (Vec<Value>, String) {
    let _turn = ONE_SWARM_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir(&format!("attack-{}", behavior.replace(':', "")));
    let (creator, joining) = create(&dir, "40", "150");
    let joiner = |extra: &[&str]| -> Vec<String> {
        joining
            .iter()
            .map(String::as_str)
            .chain(extra.iter().copied())
            .map(str::to_owned)
            .collect()
    };
    // The attacker joins first and turns once the swarm has formed and trained a little.
    let args = joiner(&["--behavior", behavior, "--behavior-from", "6"]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut attacker = start(&dir, "attacker", &refs);
    let mut peers = vec![creator];
    for i in 1..4 {
        let args = joiner(&[]);
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        peers.push(start(&dir, &format!("p{i}"), &refs));
    }
    let id = attacker
        .wait_line(LONG, |l| l.starts_with("shoal run"))
        .rsplit(' ')
        .next()
        .unwrap()
        .to_owned();
    let reports: Vec<Value> = peers.iter_mut().map(|p| p.finish(LONG)).collect();
    attacker.kill();
    (reports, id)
}

/// Every honest peer banned the attacker, none banned an honest one, and the honest replicas
/// agree and learned.
fn defended(reports: &[Value], attacker: &str, why: &str) {
    let mut hashes = BTreeSet::new();
    for r in reports {
        let banned: Vec<(&str, &str)> = r["banned"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| (b[0].as_str().unwrap(), b[1].as_str().unwrap()))
            .collect();
        assert_eq!(banned.len(), 1, "only the attacker is banned: {banned:?}");
        assert_eq!(banned[0].0, attacker, "{banned:?}");
        assert!(banned[0].1.contains(why), "{banned:?}");
        hashes.insert(r["params_hash"].as_str().unwrap_or("none").to_owned());
        assert_eq!(r["violations"], 0, "a well-formed lie breaks no rule: {r}");
    }
    assert_eq!(hashes.len(), 1, "honest replicas differ: {hashes:?}");
    let r = &reports[0];
    let first = r["loss_curve"][0][1].as_f64().unwrap();
    let last = r["final_loss"].as_f64().unwrap();
    eprintln!("attacker {attacker} banned by all; loss {first:.3} -> {last:.3}");
    assert!(last < first - 1.0, "the loss fell: {first} -> {last}");
}

#[test]
fn a_peer_sending_flipped_gradients_is_banned_by_every_honest_peer() {
    let (reports, attacker) = swarm_with_an_attacker("sign-flip");
    defended(&reports, &attacker, "opposed the stage");
}

#[test]
fn a_peer_corrupting_the_part_it_averages_is_banned_by_every_honest_peer() {
    let (reports, attacker) = swarm_with_an_attacker("bad-part");
    defended(&reports, &attacker, "averaged parts");
}

/// A replica that serves joiners a well-formed state with its parameters negated (its hash
/// matching the bytes it sends): a joiner that downloads from it refuses the state, as its
/// parameters differ from those the rest of the stage announces, and downloads another
/// replica's. Joiners pick their source at random, so they are started one at a time until
/// one has picked the attacker (each does with probability 1/2).
#[test]
fn a_poisoned_state_is_refused_by_the_joiner_that_downloads_it() {
    let _turn = ONE_SWARM_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("attack-poison-state");
    let (mut creator, joining) = create(&dir, "16", "600");
    let joining: Vec<&str> = joining.iter().map(String::as_str).collect();
    let attacker_args: Vec<&str> = joining
        .iter()
        .copied()
        .chain(["--behavior", "poison-state"])
        .collect();
    let mut attacker = start(&dir, "attacker", &attacker_args);
    attacker.wait_line(LONG, |l| l.starts_with("serving stage"));
    let mut refused = None;
    for i in 1..=10 {
        let mut joiner = start(&dir, &format!("j{i}"), &joining);
        joiner.wait_line(LONG, |l| l.starts_with("serving stage"));
        if joiner
            .seen
            .iter()
            .any(|l| l.starts_with("refused the state"))
        {
            refused = Some(joiner);
            break;
        }
        joiner.kill();
    }
    let mut joiner = refused.expect("a joiner picked the attacker in 10 tries (1 in 1024 fails)");
    let reports = [creator.finish(LONG), joiner.finish(LONG)];
    attacker.kill();
    assert_eq!(
        reports[0]["params_hash"], reports[1]["params_hash"],
        "the joiner ends on the honest parameters"
    );
    let last = reports[1]["final_loss"].as_f64().unwrap();
    assert!(last < 3.0, "it trained on: final loss {last}");
}
