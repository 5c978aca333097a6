//! NAT traversal with no flags, behind real NATs: Linux network namespaces on one machine
//! make an "internet" (a bridge) with a public relay/bootstrap node on it, and two home
//! networks, each behind its own router that masquerades (nftables) and forwards nothing
//! inbound that its hosts did not start. A peer on each home network trains with the other:
//! each must find by AutoNAT that it cannot be dialled, listen through the relay on its own,
//! and reach the other through it; DCUtR then tries to punch a hole. Needs root (CI has it),
//! `ip` and `nft`.

#![allow(clippy::unwrap_used, missing_docs)]

use shoal_tests::{NodeProcess, RunProcess, temp_dir};
use std::process::Command;
use std::time::Duration;

const LONG: Duration = Duration::from_secs(300);

/// Builds the networks: namespaces `<p>-inet` (the bridge, 10.200.0.0/24, with the relay at
/// .1), routers `<p>-nata` and `<p>-natb` (.2 and .3 on the bridge) and hosts `<p>-a`
/// (192.168.10.2) and `<p>-b` (192.168.20.2) behind them. The routers drop what comes in
/// unasked, before it can take a port the host behind them would map to.
const NETWORKS: &str = r#"
set -e
P=$1
# "masquerade", or "masquerade random": a new random port per destination, as NATs that
# defeat hole punching do.
MASQUERADE=$2
ip netns add $P-inet
ip -n $P-inet link set lo up
ip -n $P-inet link add br0 type bridge
ip -n $P-inet addr add 10.200.0.1/24 dev br0
ip -n $P-inet link set br0 up
home() {
  nat=$P-nat$1; host=$P-$1
  ip netns add $nat; ip netns add $host
  ip -n $nat link set lo up; ip -n $host link set lo up
  ip -n $nat link add wan type veth peer name up-$1 netns $P-inet
  ip -n $P-inet link set up-$1 master br0 up
  ip -n $nat addr add 10.200.0.$2/24 dev wan
  ip -n $nat link set wan up
  ip -n $nat link add lan type veth peer name eth0 netns $host
  ip -n $nat addr add $3.1/24 dev lan
  ip -n $nat link set lan up
  ip -n $host addr add $3.2/24 dev eth0
  ip -n $host link set eth0 up
  ip -n $host route add default via $3.1
  ip netns exec $nat sysctl -qw net.ipv4.ip_forward=1
  ip netns exec $nat nft -f - <<NFT
table ip nat {
  chain postrouting { type nat hook postrouting priority srcnat; oifname "wan" $MASQUERADE; }
}
table ip filter {
  chain input {
    type filter hook input priority filter; policy accept;
    iifname "wan" ct state new drop
  }
  chain forward {
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname "lan" oifname "wan" accept
  }
}
NFT
}
home a 2 192.168.10
home b 3 192.168.20
"#;

/// The namespaces of one test, removed when dropped (after the processes in them).
struct Networks {
    prefix: String,
}

impl Networks {
    fn build(name: &str, masquerade: &str) -> Networks {
        // Interface names in the script are fixed, namespace names carry the prefix.
        let prefix = format!("sh{}{name}", std::process::id());
        let networks = Networks { prefix };
        let status = Command::new("bash")
            .args(["-c", NETWORKS, "networks", &networks.prefix, masquerade])
            .status()
            .expect("run bash");
        assert!(status.success(), "building the namespaces failed");
        networks
    }

    fn ns(&self, name: &str) -> String {
        format!("{}-{name}", self.prefix)
    }
}

impl Drop for Networks {
    fn drop(&mut self) {
        for name in ["a", "nata", "b", "natb", "inet"] {
            let _ = Command::new("ip")
                .args(["netns", "del", &self.ns(name)])
                .status();
        }
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn have(tool: &str) -> bool {
    Command::new(tool).arg("--version").output().is_ok()
}

/// Two peers behind separate NATs train `nano` in two stages, one stage each; the second
/// joins through the address the first printed. Returns what hole punching did (a line of
/// output, None where it had no outcome before the run ended).
fn train_across_nats(name: &str, masquerade: &str) -> Option<String> {
    let net = Networks::build(name, masquerade);
    let dir = temp_dir(&format!("nat-{name}"));
    let relay = NodeProcess::start_in(
        Some(&net.ns("inet")),
        &dir,
        "relay",
        &[
            "--listen",
            "/ip4/10.200.0.1/udp/4001/quic-v1",
            "--relay-server",
            "--no-mdns",
        ],
        "/ip4/10.200.0.1/",
    );
    let common = ["--no-mdns", "--threads", "1", "--stall-timeout", "120"];
    let mut a = RunProcess::start_in(
        Some(&net.ns("a")),
        &dir,
        "a",
        &[
            &common[..],
            &[
                "--preset",
                "nano",
                "--stages",
                "2",
                "--global-batch",
                "32",
                "--microbatch",
                "8",
                "--max-steps",
                "20",
                "--bootstrap",
                &relay.addr,
            ],
        ]
        .concat(),
    );
    // Nobody told `a` it is behind a NAT, nor which relay to use.
    a.wait_line(LONG, |l| l.starts_with("behind a NAT"));
    let (run, circuit) = a.join_command(LONG, |l| l.contains("p2p-circuit"));
    let mut b = RunProcess::start_in(
        Some(&net.ns("b")),
        &dir,
        "b",
        &[&common[..], &["--run", &run, "--bootstrap", &circuit]].concat(),
    );
    let (report_a, report_b) = (a.finish(LONG), b.finish(LONG));
    for (name, report) in [("a", &report_a), ("b", &report_b)] {
        assert_eq!(report["steps"].as_u64(), Some(20), "{name}: {report}");
    }
    let said = |p: &RunProcess, start: &str| p.seen.iter().find(|l| l.starts_with(start)).cloned();
    let punched = said(&a, "hole punch").or_else(|| said(&b, "hole punch"));
    println!(
        "{name}: trained 20 steps across two NATs; a: behind a NAT, listening through the \
         relay; b: {}; hole punching: {}",
        said(&b, "behind a NAT").unwrap_or_else(|| "no AutoNAT verdict before the end".into()),
        punched
            .as_deref()
            .unwrap_or("no outcome before the run ended")
    );
    drop(relay);
    punched
}

/// Routers that keep a host's port (Linux's masquerade does where it can): the peers find
/// they are behind NATs, listen through the relay, and hole punching replaces the relayed
/// connection with a direct one (it is reported; the test asserts the training).
#[test]
fn peers_behind_separate_nats_train_together_through_a_relay_they_chose() {
    if !can_build_networks() {
        return;
    }
    train_across_nats("keep", "masquerade");
}

/// Routers that map every destination to a new random port, which hole punching cannot
/// guess: the run trains over the relayed connection.
#[test]
fn peers_behind_nats_that_defeat_hole_punching_train_through_the_relay() {
    if !can_build_networks() {
        return;
    }
    let punched = train_across_nats("random", "masquerade random");
    assert!(
        punched.as_ref().is_none_or(|l| l.contains("failed")),
        "{punched:?}"
    );
}

/// Whether this machine can build the networks: as root with iproute2 and nftables. Not root
/// is a skip (CI runs as root, so the tests run there); root without the tools is a failure.
fn can_build_networks() -> bool {
    if !is_root() {
        eprintln!("skipped: network namespaces need root");
        return false;
    }
    assert!(
        have("ip") && have("nft"),
        "the NAT tests need iproute2 and nftables (apt-get install -y iproute2 nftables)"
    );
    true
}
