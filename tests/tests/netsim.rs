//! The simulator end to end: reproducible from a seed, training for real, reporting what the
//! issue of a run needs; and the shipped scenarios are valid.

#![allow(clippy::unwrap_used, missing_docs)]

use serde_json::Value;
use shoal_netsim::{Report, Scenario, simulate};
use shoal_tests::{shoal_binary, temp_dir};
use std::path::Path;
use std::process::Command;

/// Six peers on mixed links, one crashing mid-run and one joining: every kind of event.
const SMALL: &str = r#"
[run]
preset = "nano"
stages = 3
global_batch = 32
microbatch = 8
steps = 12

[[peers]]
count = 4
device = "rtx3090"
link = "home"

[[peers]]
count = 2
device = "t4"
link = "us-regions"

[[events]]
at_s = 3.0
kind = "crash"
count = 1

[[events]]
at_s = 4.0
kind = "join"
count = 1
device = "rtx4090"
link = "metro"
"#;

fn run(text: &str, seed: u64) -> Report {
    simulate(Scenario::parse(text).unwrap(), seed, &mut |_| {}).unwrap()
}

#[test]
fn a_seed_fixes_the_whole_trace() {
    let a = run(SMALL, 7);
    let b = run(SMALL, 7);
    let c = run(SMALL, 8);
    assert_eq!(
        serde_json::to_string(&a).unwrap(),
        serde_json::to_string(&b).unwrap(),
        "same scenario and seed, same report"
    );
    assert_ne!(a.event_hash, c.event_hash, "another seed, another trace");
    for r in [&a, &c] {
        assert!(r.finished, "{}", r.table());
        assert_eq!(r.double_commits, 0, "{}", r.table());
        assert_eq!(r.violations, 0, "honest peers break no rule: {}", r.table());
        assert_eq!(r.peers, 7);
        let first = r.loss_curve.first().unwrap().2;
        assert!(r.final_loss.unwrap() < first - 0.3, "{}", r.table());
        assert_eq!(r.recoveries.len(), 1);
        assert!(r.recoveries[0].seconds.is_some(), "{:?}", r.recoveries);
        assert!(r.efficiency > 0.0 && r.efficiency <= 1.0);
    }
}

/// Modelled compute changes nothing the protocol sees but the numbers inside the tensors: the
/// same scenario and seed send the same bytes of every tensor traffic and take the same time;
/// only the loss is missing. (Not the very same trace: announcements carry parameter hashes,
/// whose varint encoding is a byte longer or shorter with the value.)
#[test]
fn modelled_compute_times_and_sends_what_real_compute_does() {
    let real = run(SMALL, 3);
    let modelled = run(
        &SMALL.replace("steps = 12", "steps = 12\ncompute = \"modelled\""),
        3,
    );
    assert_eq!(real.compute, "real");
    assert_eq!(modelled.compute, "modelled");
    assert!(real.final_loss.is_some() && !real.loss_curve.is_empty());
    assert!(modelled.final_loss.is_none() && modelled.loss_curve.is_empty());
    assert!(
        modelled.table().contains("not computed"),
        "{}",
        modelled.table()
    );
    let tables = format!("modelled:\n{}\nreal:\n{}", modelled.table(), real.table());
    assert!(modelled.finished, "{tables}");
    assert_eq!(modelled.resyncs, 0, "{tables}");
    same_traffic_and_time(&modelled, &real, 0.01, &tables);
}

/// `a` sends as many bytes per token of every tensor traffic as `b` (within `bytes_tolerance`),
/// in the same simulated time (within 5%), with as many recoveries.
fn same_traffic_and_time(a: &Report, b: &Report, bytes_tolerance: f64, tables: &str) {
    let close = |x: f64, y: f64, tolerance: f64| (x - y).abs() <= tolerance * y.abs();
    for kind in ["activations", "activation_grads", "averaging", "state"] {
        let (x, y) = (a.bytes_per_token(kind), b.bytes_per_token(kind));
        assert!(
            close(x, y, bytes_tolerance),
            "{kind}: {x} vs {y} bytes per token\n{tables}"
        );
    }
    assert!(close(a.sim_seconds, b.sim_seconds, 0.05), "{tables}");
    assert_eq!(a.recoveries.len(), b.recoveries.len(), "{tables}");
}

/// Modelled compute carries a large stage's gradients, parts and states scaled down (so that a
/// simulated swarm's memory does not follow the model) and charges the links their full size:
/// scaled down ten times, the same scenario sends as many bytes of every traffic (to within
/// the tensors' headers, which are charged scaled too) and takes as long as with full-size
/// tensors.
#[test]
fn scaled_down_tensors_are_charged_their_full_size() {
    let modelled = SMALL.replace("steps = 12", "steps = 12\ncompute = \"modelled\"");
    let full = run(&modelled, 5);
    let scaled = run(
        &format!("{modelled}\n[sim]\nmodelled_tensor_values = 4096\n"),
        5,
    );
    let tables = format!("scaled:\n{}\nfull:\n{}", scaled.table(), full.table());
    assert!(full.finished && scaled.finished, "{tables}");
    same_traffic_and_time(&scaled, &full, 0.03, &tables);
}

/// Past 64 peers, announcements go directly to near peers and by gossip to everyone only
/// every few periods, and members are given up after as many periods longer (see
/// `membership/gossip.rs`): a swarm of 80 still trains, and notices a crash and recovers from
/// it as one that gossips everything to everyone did (4.2 s, seed 1).
#[test]
fn a_swarm_past_64_peers_trains_and_recovers_on_tiered_gossip() {
    let text = r#"
[run]
preset = "nano"
stages = 3
global_batch = 160
microbatch = 8
steps = 10

[[peers]]
count = 60
device = "rtx3090"
link = "metro"

[[peers]]
count = 20
device = "t4"
link = "us-regions"

[[events]]
at_s = 3.0
kind = "crash"
count = 2
"#;
    let r = run(text, 1);
    let table = r.table();
    assert!(r.finished, "{table}");
    assert_eq!(r.violations, 0, "{table}");
    assert_eq!(r.resyncs, 0, "{table}");
    assert!(r.honest_agree, "{table}");
    assert_eq!(r.recoveries.len(), 1, "{table}");
    assert!(r.recoveries[0].seconds.is_some_and(|s| s < 10.0), "{table}");
}

/// A run that trains nothing says why: GPT-2 XL at 1,024 tokens a sample fits no stage of a
/// 24 GB card, and the report names that and how many peers found it.
#[test]
fn a_run_that_trains_nothing_says_why() {
    let text = r#"
[run]
preset = "gpt2-xl"
stages = 12
global_batch = 8
microbatch = 2
steps = 2
compute = "modelled"

[[peers]]
count = 4
device = "rtx3090"
link = "home"

[sim]
max_sim_s = 60.0
"#;
    let r = run(text, 1);
    let table = r.table();
    assert!(!r.finished && r.steps == 0, "{table}");
    let (warning, peers) = r.warnings.first().expect("a warning");
    assert!(warning.contains("no stage fits"), "{table}");
    assert_eq!(*peers, 4, "{table}");
    assert!(table.contains("no stage fits"), "{table}");
}

/// `micro` in 2 stages with modelled compute, its 6 peers on `fast` or `slow` links.
fn two_stages_on(fast: &str, slow: &str) -> String {
    format!(
        r#"
[run]
preset = "micro"
stages = 2
global_batch = 64
microbatch = 8
steps = 20
compute = "modelled"

[[peers]]
count = 2
device = "rtx3090"
link = "{fast}"
stage = 0

[[peers]]
count = 2
device = "rtx3090"
link = "{fast}"
stage = 1

[[peers]]
count = 1
device = "rtx3090"
link = "{slow}"
stage = 0

[[peers]]
count = 1
device = "rtx3090"
link = "{slow}"
stage = 1
"#
    )
}

/// With no codec named, each boundary hop goes out in int8 while its link keeps pace with
/// the sender's device and in int4 where it does not: int8 among peers on 10 Gbit/s links
/// (but for the odd message that queued behind a round's shares: there a `micro` stage's
/// int8 activations take about half its compute time, the budget; seeds 1-4 gave 0-24 of
/// about 320 in int4), mostly int4 among peers on home links (the first messages of each link
/// go out before it is measured), both in a swarm that mixes them; a codec named is used
/// everywhere.
#[test]
fn each_boundary_hop_picks_its_codec_from_its_link() {
    let count = |r: &Report, codec: &str| r.boundary_codecs.get(codec).copied().unwrap_or(0);
    let fast = run(&two_stages_on("metro", "metro"), 1);
    let slow = run(&two_stages_on("home", "home"), 1);
    let mixed = run(&two_stages_on("metro", "home"), 1);
    let named = run(
        &two_stages_on("home", "home").replace(
            "steps = 20",
            "steps = 20\nactivation_codec = \"int8\"\ngradient_codec = \"int8\"",
        ),
        1,
    );
    let tables = format!(
        "fast:\n{}\nslow:\n{}\nmixed:\n{}\nnamed:\n{}",
        fast.table(),
        slow.table(),
        mixed.table(),
        named.table()
    );
    for r in [&fast, &slow, &mixed, &named] {
        assert!(r.finished, "{tables}");
    }
    assert!(count(&fast, "int8") > 9 * count(&fast, "int4"), "{tables}");
    assert!(count(&slow, "int4") > 9 * count(&slow, "int8"), "{tables}");
    assert!(
        count(&mixed, "int8") > 0 && count(&mixed, "int4") > 0,
        "{tables}"
    );
    assert!(
        count(&named, "int8") > 0 && count(&named, "int4") == 0,
        "{tables}"
    );
    assert!(
        slow.bytes_per_token("activations") < 0.6 * named.bytes_per_token("activations"),
        "{tables}"
    );
}

/// Rebalancing, end to end: the shipped `uneven` swarm starts with its fast peers crowding the
/// first stage; peers move until the slowest stage is much faster, no peer moves twice, and
/// the run finishes with every sample applied at most once.
#[test]
fn a_badly_balanced_swarm_rebalances_once_per_peer() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../netsim/scenarios/uneven.toml");
    let r = run(&std::fs::read_to_string(path).unwrap(), 1);
    let table = r.table();
    assert!(r.finished, "{table}");
    assert_eq!(r.double_commits, 0, "{table}");
    assert_eq!(r.violations, 0, "{table}");
    assert!(!r.moves.is_empty(), "{table}");
    let (start, end) = r.slowest_stage;
    assert!(end >= 1.25 * start, "{table}");
    let mut movers: Vec<usize> = r.moves.iter().map(|m| m.1).collect();
    movers.sort_unstable();
    movers.dedup();
    assert_eq!(movers.len(), r.moves.len(), "a peer moved twice: {table}");
    assert!(table.contains("moves"), "{table}");
}

/// Devices too small for any stage serve one by keeping its blocks in host memory; told not
/// to, none finds a stage it can hold and nothing trains.
#[test]
fn memory_poor_devices_serve_by_offloading() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../netsim/scenarios/offload.toml");
    let text = std::fs::read_to_string(path).unwrap();
    for seed in [1, 2] {
        let r = run(&text, seed);
        let table = r.table();
        assert!(r.finished && r.honest_agree, "seed {seed}: {table}");
        assert!(r.device_busy > 0.2, "seed {seed}: {table}");
    }
    let r = run(&text.replace("offload = true", "offload = false"), 1);
    let table = r.table();
    assert!(!r.finished && r.tokens == 0, "{table}");
    assert!(table.contains("no stage fits"), "{table}");
}

/// A partition that heals: the seeds that once stalled for good (4: two replicas of a stage
/// were left behind with each other and never followed the one that went on; 14: every
/// replica of a stage looked late to the senders, which then sent nowhere) reach the last
/// step, with the replicas agreeing.
#[test]
fn a_swarm_cut_in_two_finishes_after_the_heal() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../netsim/scenarios/partition.toml");
    let text = std::fs::read_to_string(path).unwrap();
    for seed in [4, 14] {
        let r = run(&text, seed);
        let table = r.table();
        assert!(r.finished && r.honest_agree, "seed {seed}: {table}");
        assert!(
            r.recoveries.iter().all(|c| c.seconds.is_some()),
            "seed {seed}: {table}"
        );
    }
}

/// A partition that heals before the connections' idle timeout loses no message: QUIC sends
/// again what the cut lost, so the run only waits. The seeds are ones that once stalled for
/// good (at step 93 of 1,000, nothing retried or re-synced) when the simulator dropped those
/// messages, and told their senders only at the timeout, though the connection had healed.
#[test]
fn a_partition_shorter_than_the_idle_timeout_only_delays_messages() {
    let events = r#"
[[events]]
at_s = 2.4
kind = "partition"
count = 3

[[events]]
at_s = 4.0
kind = "heal"
"#;
    let text = sweep_scenario("datacenter", 1000, events);
    for seed in [26, 39] {
        let r = run(&text, seed);
        let table = r.table();
        assert!(r.finished && r.honest_agree, "seed {seed}: {table}");
        assert_eq!(
            (r.resyncs, r.microbatches_dropped),
            (0, 0),
            "seed {seed}: {table}"
        );
    }
}

#[test]
fn the_shipped_scenarios_are_valid() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../netsim/scenarios");
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        Scenario::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        names.push(path.file_stem().unwrap().to_string_lossy().into_owned());
    }
    names.sort();
    assert_eq!(
        names,
        [
            "attack",
            "attack-16",
            "churn",
            "churn-nano",
            "demo",
            "gpt2-home",
            "hetero",
            "hetero-nano",
            "home",
            "loopback",
            "offload",
            "partition",
            "regions",
            "regions-nano",
            "scale",
            "thousand",
            "uneven",
            "wan",
            "xl-home"
        ]
    );
}

#[test]
fn the_command_writes_a_report_and_a_plot() {
    let dir = temp_dir("netsim-cli");
    let scenario = dir.join("small.toml");
    // With held-out evaluations every 4 steps.
    let evaluated = SMALL.replace(
        "steps = 12",
        "steps = 12\neval_every = 4\neval_samples = 16",
    );
    std::fs::write(&scenario, &evaluated).unwrap();
    let (report, plot) = (dir.join("report.json"), dir.join("curves.svg"));
    let out = Command::new(shoal_binary())
        .arg("netsim")
        .arg(&scenario)
        .args(["--seed", "3", "--report"])
        .arg(&report)
        .arg("--plot")
        .arg(&plot)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("efficiency"), "{stdout}");
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    for field in [
        "seed",
        "peers",
        "sim_seconds",
        "ideal_tokens_per_s",
        "achieved_tokens_per_s",
        "efficiency",
        "steps",
        "final_loss",
        "loss_curve",
        "bytes",
        "microbatches_dropped",
        "recoveries",
        "moves",
        "slowest_stage",
        "event_hash",
    ] {
        assert!(!r[field].is_null(), "{field} in {r}");
    }
    assert_eq!(r["seed"], 3);
    assert_eq!(r["loss_curve"][0].as_array().unwrap().len(), 3);
    let steps: Vec<u64> = r["val_curve"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[1].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [4, 8, 12], "{r}");
    assert!(stdout.contains("held-out loss"), "{stdout}");
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("polyline"), "{svg}");

    // A broken scenario is one clear line, not a panic.
    std::fs::write(&scenario, SMALL.replace("rtx3090", "rtx9999")).unwrap();
    let out = Command::new(shoal_binary())
        .arg("netsim")
        .arg(&scenario)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("unknown device 'rtx9999'"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}

/// Two stages of four replicas, one of each stage attacking from 2.1 s (the swarm's first
/// steps are at 2.0 s), 30 steps.
fn attacked(behavior: &str) -> String {
    let mut text = String::from(
        "[run]\npreset = \"nano\"\nstages = 2\nglobal_batch = 64\nmicrobatch = 8\nsteps = 30\n",
    );
    for stage in 0..2 {
        text += &format!(
            "\n[[peers]]\ncount = 3\ndevice = \"rtx3090\"\nlink = \"metro\"\nstage = {stage}\n\
             \n[[peers]]\ncount = 1\ndevice = \"rtx3090\"\nlink = \"metro\"\nstage = {stage}\n\
             behavior = \"{behavior}\"\nbehavior_from_s = 2.1\n"
        );
    }
    text
}

/// A scenario event: `count` RTX 3090s on metro links join at `at_s`.
fn joiners(count: u32, at_s: f64) -> String {
    format!(
        "\n[[events]]\nat_s = {at_s}\nkind = \"join\"\ncount = {count}\ndevice = \"rtx3090\"\nlink = \"metro\"\n"
    )
}

/// The attacks that hide in the honest spread, work on data, withhold, or target roles and
/// claims rather than shares: each leaves the honest replicas finite and in agreement, bans
/// no honest peer, finishes, and costs the loss little. Two peers join at 2.3 s.
#[test]
fn attacks_on_roles_claims_and_data_leave_the_honest_replicas_agreeing() {
    let with_joiners = |behavior: &str| attacked(behavior) + &joiners(2, 2.3);
    let honest = run(&with_joiners("honest"), 1);
    let honest_loss = honest.final_loss.expect("a loss");
    for behavior in [
        "ipm:0.5",
        "alie",
        "stale:4",
        "label-flip",
        "flip-backward",
        "nan",
        "bad-leader",
        "lie-throughput",
        "forge-hash",
        "poison-catch-up",
        "inflate:8",
    ] {
        let r = run(&with_joiners(behavior), 1);
        let table = r.table();
        assert!(r.finished, "{behavior}: {table}");
        assert_eq!(r.attackers.len(), 2, "{behavior}");
        assert_eq!(r.nonfinite_replicas, 0, "{behavior}: {table}");
        assert!(r.honest_agree, "{behavior}: {table}");
        // No honest replica's claims fall short of its routes.
        assert_eq!(r.false_discounts, 0, "{behavior}: {table}");
        let discounted: Vec<usize> = r.discounted.iter().map(|d| d.1).collect();
        if behavior == "inflate:8" {
            // Each attacker weighs about what its witnesses committed with it (an eighth, and
            // one round's worth forgiven over the window).
            assert_eq!(discounted, r.attackers, "{table}");
            assert!(r.discounted.iter().all(|d| d.2 < 0.3), "{table}");
        } else {
            assert!(discounted.is_empty(), "{behavior}: {table}");
        }
        if matches!(behavior, "label-flip" | "flip-backward") {
            // The attacks that still cost honest peers: wrong activation gradients (from a
            // last stage training on wrong targets, or negated on purpose by any hop) poison
            // the shares of the replicas upstream that used them, and one of those can look
            // like an attacker to its stage before its senders find the culprit out of line
            // and throw its gradients away (in this small swarm, seeds 1-12: one honest
            // first-stage replica in 3 runs of `label-flip`, none of `flip-backward`; see the
            // README's threat model).
            assert!(r.false_bans <= 1, "{behavior}: {table}");
        } else {
            assert_eq!(r.false_bans, 0, "{behavior}: {table}");
        }
        let banned: Vec<usize> = r.banned.iter().map(|b| b.1).collect();
        match behavior {
            // Its followers are told they are left out, pass it over and accuse it at once.
            "bad-leader" => {
                assert_eq!(banned.len(), 2, "{behavior}: {table}");
                let why = shoal_protocol::swarm::message::Misconduct::LeftReplicasOut.to_string();
                assert!(r.banned.iter().all(|b| b.2 == why), "{table}");
                // The work a banned leader took with it is retried or counted as lost, so no
                // stage waits a join window for it (that once made runs up to 3x longer).
                let (t, honest_t) = (r.sim_seconds, honest.sim_seconds);
                assert!(
                    t < 1.3 * honest_t,
                    "{t} s against {honest_t} s honest: {table}"
                );
            }
            // Its shares never come. It used to be accused of withholding them and banned
            // (seed 1: at 87 and 130 s, the run's end); now it falls two rounds behind within
            // a few rounds, which leave it out from then on, unbanned (the run ends at 89 s).
            // Either way its NaN never reaches a replica (asserted above).
            // Only the last stage reads targets: the attacker there trains on wrong ones, and
            // its shares give it away.
            "label-flip" => assert!(banned.contains(&r.attackers[1]), "{table}"),
            // The first stage finds the last stage's attacker out of line and throws its
            // gradients away (seeds 1-12: 10-14 per run; all honest, 0-3).
            "flip-backward" => assert!(r.gradients_discarded >= 5, "{table}"),
            _ => {}
        }
        // Measured (seed 1): within +0.6% (`stale:4`, `bad-leader`), the others within 0.2%,
        // but `label-flip`, which poisons the shares upstream through its activation
        // gradients until its ban (seeds 1-12, each against the same seed all honest: +0.6% to
        // +2.3%, and +4.0% in seed 4, where its gradients were thrown away and it got so
        // little work that it was never banned: the reported loss counts its own, on wrong
        // targets, in the last steps; +1.4% to +11.4% before shares at a small angle from the
        // stage's were accused), `flip-backward`, whose negated activation gradients do the
        // same until the senders throw them away (seeds 1-12: -0.3% to +1.1%), and `nan`, whose withheld
        // shares fail rounds and
        // drop microbatches until its ban (seeds 1-4: +0.2% to +2.4%; which microbatches are
        // dropped moves with any change of timing).
        let loss = r.final_loss.expect("a loss");
        let bound = if matches!(behavior, "label-flip" | "flip-backward" | "nan") {
            1.03
        } else {
            1.02
        };
        assert!(
            loss < honest_loss * bound,
            "{behavior}: loss {loss} against {honest_loss} honest"
        );
    }
}

/// Joiners average with the replicas already there: six honest peers join `attack.toml` (3
/// stages of 6, every peer honest here) at 2.2 s of a 150-step run, and each stage's
/// replicas end on one parameter hash without a re-sync. When only the replicas that had sent
/// a peer work led and were waited for, the joiners of a stage led rounds of their own and
/// averaged apart for good (seed 1: 2 of the first stage's 8 replicas).
#[test]
fn joiners_average_with_the_replicas_already_there() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../netsim/scenarios/attack.toml");
    let text = std::fs::read_to_string(path)
        .unwrap()
        .replace("behavior = \"sign-flip\"", "behavior = \"honest\"")
        .replace("steps = 60", "steps = 150")
        + "\n[[peers]]\ncount = 6\ndevice = \"rtx3090\"\nlink = \"metro\"\njoin_at_s = 2.2\n";
    let r = run(&text, 1);
    let table = r.table();
    assert_eq!(r.peers, 24, "{table}");
    assert!(r.attackers.is_empty(), "{table}");
    assert!(r.finished && r.honest_agree, "{table}");
    assert_eq!(r.resyncs, 0, "{table}");
    assert!(r.banned.is_empty(), "{table}");
}

/// A replica that serves joiners a well-formed state with its parameters negated (and a hash
/// that matches the bytes it sent): each joiner that downloads from it finds the parameters
/// differ from those more than half of the stage announce, refuses the state and downloads
/// another replica's. Four peers join at 2.2 s of a 150-step run. The attackers have the
/// fastest links, so their chunks arrive first and joiners take their version (a joiner
/// asks every replica of these small stages, and keeps the version that comes first).
/// Whether a joiner can check a state when it arrives depends on whether the stage has
/// announced its round yet: on seed 2 all four joiners refuse one; on seeds 1 and 3 (since
/// senders judge the gradients they get, which moves the timing) some took a state of a
/// round not announced yet and were re-synced by the hash vote after their first round.
#[test]
fn a_poisoned_state_is_refused_and_downloaded_again() {
    let scenario = |behavior: &str| {
        let mut text = attacked(behavior).replace("steps = 30", "steps = 150");
        for stage in 0..2 {
            let attacker = format!("link = \"metro\"\nstage = {stage}\nbehavior");
            let fast = format!("link = \"datacenter\"\nstage = {stage}\nbehavior");
            text = text.replace(&attacker, &fast);
        }
        text + &joiners(4, 2.2)
    };
    let honest = run(&scenario("honest"), 2);
    assert_eq!(honest.refused_states, 0);
    let r = run(&scenario("poison-state"), 2);
    let table = r.table();
    assert!(r.refused_states >= 1, "{table}");
    assert!(r.finished && r.honest_agree, "{table}");
    assert_eq!(r.nonfinite_replicas, 0, "{table}");
    // Within the attacks' goal (3%): the joiners that took a poisoned state download
    // another and start serving later (-0.2% on this seed).
    let (loss, honest_loss) = (r.final_loss.unwrap(), honest.final_loss.unwrap());
    assert!(
        loss < honest_loss * 1.03,
        "loss {loss} against {honest_loss} honest"
    );
}

/// Identities cost nothing: one attacker per stage speaks for 20 more (`sybil:20`), which
/// announce themselves as replicas of its stage, announce with it one forged parameter hash
/// per round and accuse every honest replica. Counted by announcements they would outvote
/// the honest replicas' hash (sending them to download a state nobody serves) and ban them.
/// Only replicas whose work a peer checked vote, so neither happens: the identities never
/// deliver a share and are banned for withholding, and the run trains as if they were not
/// there.
#[test]
fn sybils_neither_outvote_nor_frame_the_replicas_that_work() {
    let honest = run(&attacked("honest"), 1);
    let r = run(&attacked("sybil:20"), 1);
    let table = r.table();
    assert!(r.finished, "{table}");
    assert_eq!(r.attackers.len(), 42, "{table}");
    assert_eq!(r.false_bans, 0, "{table}");
    assert_eq!(r.resyncs, honest.resyncs, "{table}");
    assert_eq!(r.nonfinite_replicas, 0, "{table}");
    assert!(r.honest_agree, "{table}");
    let (loss, honest_loss) = (r.final_loss.unwrap(), honest.final_loss.unwrap());
    assert!(
        loss < honest_loss * 1.02,
        "loss {loss} against {honest_loss} honest"
    );
}

/// Attackers that change the values they send (well-formed, finite) break no protocol rule,
/// so they are judged by what their values do: the part owners' centered clipping bounds
/// their pull, and the replicas they fail to support (or whose averaged parts disagree with
/// their own shares) accuse them until a majority of their stage has, and everyone bans them. The run finishes, honest replicas stay finite and agree,
/// no honest peer is banned, and the loss stays near the honest run's.
#[test]
fn poisoned_contributions_are_bounded_and_their_senders_banned() {
    let honest = run(&attacked("honest"), 1);
    assert!(honest.attackers.is_empty());
    assert!(honest.banned.is_empty(), "{}", honest.table());
    let honest_loss = honest.final_loss.expect("a loss");
    for behavior in [
        "sign-flip",
        "scale:-4",
        "scale:10",
        "zero",
        "noise:0.1",
        "bad-part",
    ] {
        let r = run(&attacked(behavior), 1);
        let table = r.table();
        assert!(r.finished, "{behavior}: {table}");
        assert_eq!(r.attackers.len(), 2, "{behavior}");
        assert_eq!(r.nonfinite_replicas, 0, "{behavior}");
        assert!(r.honest_agree, "{behavior}: {table}");
        assert_eq!(r.violations, 0, "{behavior}");
        assert_eq!(r.false_bans, 0, "{behavior}: {table}");
        let banned: Vec<usize> = r.banned.iter().map(|b| b.1).collect();
        // Each stands out within a few steps (noise by its length: its component along the
        // stage's mean looks honest).
        assert_eq!(banned.len(), 2, "{behavior}: {table}");
        assert!(banned.iter().all(|p| r.attackers.contains(p)), "{behavior}");
        assert!(table.contains("banned"), "{table}");
        // Measured: within 0.5% (seed 1) but for a forged part, which every replica applies
        // until its owner is banned (+4.2%); the README's tables have longer runs.
        let loss = r.final_loss.expect("a loss");
        let bound = if behavior == "bad-part" { 1.06 } else { 1.02 };
        assert!(
            loss < honest_loss * bound,
            "{behavior}: loss {loss} against {honest_loss} honest"
        );
        // The run ends when the honest replicas finish, banned attackers or not.
        assert!(
            r.sim_seconds < honest.sim_seconds * 1.5,
            "{behavior}: {} s against {} s honest",
            r.sim_seconds,
            honest.sim_seconds
        );
    }
    let bad = Scenario::parse(&attacked("flip")).unwrap_err();
    assert!(
        bad.contains("behavior") && bad.contains("sign-flip"),
        "{bad}"
    );
}

/// DiLoCo with sparse pseudo-gradients (`ctopk`, error feedback on both sides of the round):
/// an honest swarm bans nobody (a sparse part is judged by its direction where it has values,
/// see `robust::on_support`, not by a scale its owner's feedback decides) and its replicas
/// agree; a forged part is still refused and its owner banned. Measured (seed 1, 30 steps):
/// no ban honest; both owners of forged parts banned by 2.2 s, loss +0.9%.
#[test]
fn sparse_pseudo_gradients_keep_the_replicas_together_and_forgers_out() {
    let sparse = |behavior: &str| {
        attacked(behavior).replacen(
            "steps = 30\n",
            "steps = 30\nsync = \"diloco\"\ndiloco_h = 2\nouter_lr = 1.0\nouter_momentum = 0.5\n\
             feedback_decay = 0.95\naveraging_codec = \"ctopk:64/4096:2\"\n",
            1,
        )
    };
    let honest = run(&sparse("honest"), 1);
    let table = honest.table();
    assert!(honest.finished && honest.honest_agree, "{table}");
    assert!(honest.banned.is_empty(), "{table}");
    assert_eq!(honest.violations, 0, "{table}");
    let honest_loss = honest.final_loss.expect("a loss");
    let forged = run(&sparse("bad-part"), 1);
    let table = forged.table();
    assert!(forged.finished && forged.honest_agree, "{table}");
    assert_eq!(forged.false_bans, 0, "{table}");
    let banned: Vec<usize> = forged.banned.iter().map(|b| b.1).collect();
    assert_eq!(banned.len(), 2, "{table}");
    assert!(
        banned.iter().all(|p| forged.attackers.contains(p)),
        "{table}"
    );
    let loss = forged.final_loss.expect("a loss");
    assert!(loss < honest_loss * 1.03, "{loss} against {honest_loss}");
}

/// A slow peer announcing 100x its throughput (`lie-throughput`: a CPU among RTX 3090s in the
/// middle stage, modelled compute) would draw a share of its stage's microbatches that it
/// serves a hundred times slower than the others, and every step would wait for it. The
/// senders time its answers and scale its weight down (`service.rs`): the run takes about
/// as long as with the same peer honest. Measured (seeds 1-6): 4.0-5.0 s against 3.4-9.3 s
/// honest (ratios 0.44-1.43: the honest runs vary with the work the slow peer gets before it
/// is measured); 14.8-15.7 s without the timing.
#[test]
fn a_slow_peer_lying_about_its_throughput_draws_no_more_work_than_it_serves() {
    let scenario = |behavior: &str| {
        let mut text = String::from(
            "[run]\npreset = \"micro\"\nstages = 3\nglobal_batch = 512\nmicrobatch = 8\n\
             steps = 10\ncompute = \"modelled\"\n",
        );
        for stage in 0..3 {
            text += &format!(
                "\n[[peers]]\ncount = 3\ndevice = \"rtx3090\"\nlink = \"metro\"\nstage = {stage}\n"
            );
        }
        text + &format!(
            "\n[[peers]]\ncount = 1\ndevice = \"cpu\"\nlink = \"metro\"\nstage = 1\n\
             behavior = \"{behavior}\"\nbehavior_from_s = 2.1\n"
        )
    };
    let honest = run(&scenario("honest"), 2);
    let lied = run(&scenario("lie-throughput"), 2);
    for r in [&honest, &lied] {
        assert!(r.finished, "{}", r.table());
        assert_eq!(r.false_bans, 0, "{}", r.table());
    }
    let ratio = lied.sim_seconds / honest.sim_seconds;
    assert!(
        ratio < 1.5,
        "the liar's run took {ratio:.2}x the honest one: {}",
        lied.table()
    );
}

/// One swarm of the seed sweep on `link`: nine peers of two kinds in three stages, `steps`
/// long, with modelled compute (so that a run lasts a minute of simulated time on every link
/// without a minute of real training). Without `events`, the calibration run that times it.
fn sweep_scenario(link: &str, steps: u64, events: &str) -> String {
    format!(
        r#"
[run]
preset = "nano"
stages = 3
sync = "allreduce"
compute = "modelled"
global_batch = 32
microbatch = 8
steps = {steps}

[[peers]]
count = 6
device = "rtx3090"
link = "{link}"

[[peers]]
count = 3
device = "t4"
link = "{link}"
{events}"#
    )
}

/// Runs `seeds` on every link preset: a partition that cuts three peers off (which ones, the
/// seed draws), its heal, then a crash. The run is made to last about a minute of simulated
/// training (20 to 1,000 steps), the events fall at the same fractions of it on every link,
/// and the partition lasts 15 s (past a connection's idle timeout) where the run is long
/// enough, two fifths of it otherwise (datacenter and metro links, where 1,000 steps take
/// 4-25 s). Returns every run that did not reach its last step with the replicas agreeing,
/// with what replays it; prints how many steps after the heal the step time came back.
fn sweep(seeds: std::ops::RangeInclusive<u64>) -> Vec<String> {
    let links = shoal_netsim::link::LINKS.map(|l| l.name);
    std::thread::scope(|scope| {
        let runs: Vec<_> = links
            .iter()
            .map(|link| {
                let seeds = seeds.clone();
                scope.spawn(move || sweep_link(link, seeds))
            })
            .collect();
        runs.into_iter().flat_map(|r| r.join().unwrap()).collect()
    })
}

fn sweep_link(link: &str, seeds: std::ops::RangeInclusive<u64>) -> Vec<String> {
    // The calm run's training time: from its first step to its end.
    let calm = |steps| {
        let r = run(&sweep_scenario(link, steps, ""), 1);
        assert!(r.finished, "{link}: {}", r.table());
        (r.tokens_curve[1].0, r.sim_seconds)
    };
    let (_, short) = calm(20);
    let (_, long) = calm(40);
    let steps = ((60.0 * 20.0 / (long - short)).ceil() as u64).clamp(20, 1000);
    let (start, end) = calm(steps);
    let at = |fraction: f64| start + fraction * (end - start);
    let cut = at(0.1);
    let heal = cut + 15.0_f64.min(at(0.5) - cut);
    let crash = at(0.75);
    let events = format!(
        r#"
[[events]]
at_s = {cut}
kind = "partition"
count = 3

[[events]]
at_s = {heal}
kind = "heal"

[[events]]
at_s = {crash}
kind = "crash"
count = 1
"#
    );
    let text = sweep_scenario(link, steps, &events);
    let mut failed = Vec::new();
    let mut recoveries = Vec::new();
    for seed in seeds {
        let r = run(&text, seed);
        if let Some(back) = steps_until_pace_returns(&r, (start, cut), (heal, crash)) {
            recoveries.push(back);
        }
        if !(r.finished && r.honest_agree && r.double_commits == 0 && r.violations == 0) {
            failed.push(format!(
                "link {link} seed {seed}: finished {}, replicas agree {} (replay: shoal \
                 netsim SCENARIO --seed {seed} with SCENARIO:\n{text}):\n{}",
                r.finished,
                r.honest_agree,
                r.table()
            ));
        }
    }
    recoveries.sort_unstable();
    println!(
        "{link}: {steps} steps, {:.1} s of training when calm; the step time came back \
         after the heal in {} runs, after (median, max) {:?} and {:?} steps",
        end - start,
        recoveries.len(),
        recoveries.get(recoveries.len() / 2),
        recoveries.last()
    );
    failed
}

/// How many steps after `heal` (and before `then`, the next event) the run's step time comes
/// back to its level in `before` (the median step time there): the first step from which
/// three in a row take at most 1.5 times as long. None if it does not, or if `before` holds
/// no step to compare with.
fn steps_until_pace_returns(
    r: &Report,
    before: (f64, f64),
    (heal, then): (f64, f64),
) -> Option<u64> {
    let steps: Vec<(f64, f64)> = r
        .tokens_curve
        .windows(2)
        .map(|w| (w[1].0, w[1].0 - w[0].0))
        .collect();
    let mut calm: Vec<f64> = steps
        .iter()
        .filter(|(at, _)| (before.0..before.1).contains(at))
        .map(|(_, took)| *took)
        .collect();
    calm.sort_by(f64::total_cmp);
    let pace = *calm.get(calm.len() / 2)?;
    let after: Vec<f64> = steps
        .iter()
        .filter(|(at, _)| (heal..then).contains(at))
        .map(|(_, took)| *took)
        .collect();
    after
        .windows(3)
        .position(|w| w.iter().all(|took| *took <= 1.5 * pace))
        .map(|i| i as u64)
}

/// The seed sweep, in the manner of simulation-tested databases: on every link preset, nine
/// seeds of a run with a crash, a partition and a heal (54 runs) reach the last step with the
/// replicas agreeing. A seed that does not is printed with its scenario, for replay.
#[test]
fn every_link_preset_survives_a_crash_a_partition_and_a_heal() {
    let failed = sweep(1..=9);
    assert!(failed.is_empty(), "{}", failed.join("\n\n"));
}

/// The long sweep (`SHOAL_SWEEP_SEEDS` seeds per link preset, 170 by default: 1,020 runs),
/// too long for every test run: `cargo test --release -p shoal-tests --test netsim --
/// --ignored long_seed_sweep`.
#[test]
#[ignore]
fn long_seed_sweep() {
    let seeds: u64 = std::env::var("SHOAL_SWEEP_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(170);
    let failed = sweep(1..=seeds);
    println!(
        "{} of {} runs failed",
        failed.len(),
        shoal_netsim::link::LINKS.len() as u64 * seeds
    );
    assert!(failed.is_empty(), "{}", failed.join("\n\n"));
}
