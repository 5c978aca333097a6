//! `shoal bench average`: K processes on this machine average a vector round after round with
//! the swarm's averaging round (the protocol's [`Round`], its codecs and error feedback, over
//! the node's QUIC transport, as `shoal run` sends it). Every member checks every result it
//! gets against the robust mean it recomputes from everyone's contribution: a round that
//! delivered less than the whole (a member left out, a part lost or refused) must say so.

use crate::cli::BenchAverageArgs;
use anyhow::{Context, bail};
use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};
use serde::{Deserialize, Serialize};
use shoal_compute::rng::Rng;
use shoal_node::net::{self, NetConfig, NodeEvent};
use shoal_protocol::swarm::averaging::{Feedback, Round, RoundOut, RoundResult, part_range};
use shoal_protocol::swarm::message::{RoundKey, RoundMsg};
use shoal_protocol::swarm::robust::{Share, centered_clip};
use shoal_protocol::swarm::{Envelope, Message, PeerKey, RunId, Timing};
use shoal_protocol::wire::FrameKind;
use shoal_protocol::{Codec, Decoder, Encoder};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

/// The run id the members' messages carry.
const RUN: RunId = RunId(0x5be7_a1e5);

/// What the command prints.
#[derive(Debug, Serialize)]
struct AverageBench {
    peers: usize,
    mib: usize,
    codec: String,
    rounds: usize,
    /// Per round, the time from its group being fixed to the slowest member holding the
    /// result; the median over rounds.
    seconds_per_round_median: f64,
    /// The vector's MiB over that time: what each member averages per second.
    mib_s_per_peer: f64,
    /// Rounds whose result some member reported as partial (a member left out, a part lost
    /// or refused by the vote) or that some member did not finish at all.
    partial_rounds: usize,
    /// Rounds that some member did not finish (no result at all).
    failed_rounds: usize,
    /// Results further from the recomputed robust mean than the codec explains, that did not
    /// say they were partial. Must be 0.
    silent_errors: usize,
    /// Largest difference of any value of any member's complete result from the recomputed
    /// mean.
    max_error: f64,
    /// The largest difference the codec explains: 0 for a lossless codec (the result must be
    /// exact); none for a sparse one (it explains any single round: not checked).
    tolerance: Option<f64>,
}

/// What a member reports to the command when it is done.
#[derive(Debug, Default, Serialize, Deserialize)]
struct MemberReport {
    /// Seconds from the group being fixed to the result, per round (None: no result).
    seconds: Vec<Option<f64>>,
    /// Rounds whose result said it was partial.
    partial: Vec<u64>,
    silent_errors: usize,
    max_error: f64,
    tolerance: Option<f64>,
}

pub fn average(args: BenchAverageArgs) -> anyhow::Result<()> {
    if args.peers < 2 {
        bail!("--peers {}: averaging needs at least 2", args.peers);
    }
    match args.member {
        Some(i) => member(&args, i),
        None => coordinate(&args),
    }
}

fn values_of(args: &BenchAverageArgs) -> usize {
    (args.mib << 20) / 4
}

// ----- the command: starts the members and sums up what they saw -----

struct Member {
    child: Child,
    /// Closed once every member reported: then they may go.
    stdin: Option<ChildStdin>,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn coordinate(args: &BenchAverageArgs) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("cannot find this program")?;
    let mut members = Vec::with_capacity(args.peers);
    for i in 0..args.peers {
        let mut child = Command::new(&exe)
            .args(["bench", "average"])
            .args(["--peers", &args.peers.to_string()])
            .args(["--mib", &args.mib.to_string()])
            .args(["--codec", &args.codec.to_string()])
            .args(["--rounds", &args.rounds.to_string()])
            .args(["--seed", &args.seed.to_string()])
            .args(["--member", &i.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("cannot start member {i}"))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            bail!("member {i}: no pipes");
        };
        members.push(Member {
            child,
            stdin: Some(stdin),
            lines: BufReader::new(stdout).lines(),
        });
    }
    let mut addrs = Vec::with_capacity(args.peers);
    for (i, m) in members.iter_mut().enumerate() {
        let line = next_line(m, i)?;
        let Some(addr) = line.strip_prefix("listening ") else {
            bail!("member {i} said {line:?} instead of its address");
        };
        addrs.push(addr.to_owned());
    }
    let all = addrs.join(" ");
    for (i, m) in members.iter_mut().enumerate() {
        let stdin = m.stdin.as_mut().context("no pipe")?;
        writeln!(stdin, "{all}").with_context(|| format!("member {i} is gone"))?;
    }
    // Each round starts when every member is ready for it (has checked the one before).
    for r in 0..args.rounds {
        for (i, m) in members.iter_mut().enumerate() {
            let line = next_line(m, i)?;
            if line != format!("ready {r}") {
                bail!("member {i} said {line:?} instead of being ready for round {r}");
            }
        }
        for (i, m) in members.iter_mut().enumerate() {
            let stdin = m.stdin.as_mut().context("no pipe")?;
            writeln!(stdin, "go").with_context(|| format!("member {i} is gone"))?;
        }
    }
    let mut reports = Vec::with_capacity(args.peers);
    for (i, m) in members.iter_mut().enumerate() {
        let line = next_line(m, i)?;
        let report: MemberReport =
            serde_json::from_str(&line).with_context(|| format!("member {i} reported {line:?}"))?;
        reports.push(report);
    }
    for (i, m) in members.iter_mut().enumerate() {
        m.stdin = None;
        let status = m.child.wait()?;
        if !status.success() {
            bail!("member {i} exited with {status}");
        }
    }
    let result = sum_up(args, &reports);
    if args.json {
        println!("{}", serde_json::to_string(&result)?);
    } else {
        println!(
            "{} peers average {} MiB ({}) in {:.3} s per round (median of {}), {:.1} MiB/s per peer; \
             {} partial round(s), {} failed, {} silent error(s); max error {:.3e} (codec explains {})",
            result.peers,
            result.mib,
            result.codec,
            result.seconds_per_round_median,
            result.rounds,
            result.mib_s_per_peer,
            result.partial_rounds,
            result.failed_rounds,
            result.silent_errors,
            result.max_error,
            result
                .tolerance
                .map_or("anything: not checked".to_owned(), |t| format!("{t:.3e}"))
        );
    }
    if result.silent_errors > 0 {
        bail!(
            "{} result(s) differ from the robust mean without saying they are partial",
            result.silent_errors
        );
    }
    Ok(())
}

fn next_line(m: &mut Member, i: usize) -> anyhow::Result<String> {
    match m.lines.next() {
        Some(line) => Ok(line.with_context(|| format!("member {i}"))?),
        None => bail!("member {i} stopped (see its error above)"),
    }
}

fn sum_up(args: &BenchAverageArgs, reports: &[MemberReport]) -> AverageBench {
    let mut per_round = Vec::with_capacity(args.rounds);
    let mut failed_rounds = 0;
    for r in 0..args.rounds {
        let times: Option<Vec<f64>> = reports
            .iter()
            .map(|m| m.seconds.get(r).copied().flatten())
            .collect();
        match times {
            Some(t) => per_round.push(t.into_iter().fold(0.0, f64::max)),
            None => failed_rounds += 1,
        }
    }
    let mut partial: Vec<u64> = reports.iter().flat_map(|m| m.partial.clone()).collect();
    partial.sort_unstable();
    partial.dedup();
    per_round.sort_by(f64::total_cmp);
    let median = per_round
        .get(per_round.len() / 2)
        .copied()
        .unwrap_or(f64::NAN);
    AverageBench {
        peers: args.peers,
        mib: args.mib,
        codec: args.codec.to_string(),
        rounds: args.rounds,
        seconds_per_round_median: median,
        mib_s_per_peer: args.mib as f64 / median,
        partial_rounds: partial.len() + failed_rounds,
        failed_rounds,
        silent_errors: reports.iter().map(|m| m.silent_errors).sum(),
        max_error: reports.iter().map(|m| m.max_error).fold(0.0, f64::max),
        tolerance: reports
            .iter()
            .map(|m| m.tolerance)
            .reduce(|a, b| a.zip(b).map(|(a, b)| a.max(b)))
            .flatten(),
    }
}

// ----- a member -----

/// Every member's contributions, which every member can recompute: member j's per-sample
/// mean in round r is `a_r * signal + b_jr * noise_j` over `samples_j` samples (a common
/// direction and a member's own, as gradients of one model on different data are).
struct Contributions {
    signal: Vec<f32>,
    noise: Vec<Vec<f32>>,
    seed: u64,
}

impl Contributions {
    fn new(peers: usize, len: usize, seed: u64) -> Self {
        let normal = |s: u64| {
            let mut rng = Rng::new(s);
            (0..len).map(|_| rng.normal() as f32).collect::<Vec<f32>>()
        };
        Contributions {
            signal: normal(seed),
            noise: (0..peers as u64)
                .map(|j| normal(seed ^ (j + 1) << 32))
                .collect(),
            seed,
        }
    }

    fn samples(j: usize) -> f64 {
        8.0 + j as f64
    }

    /// Member `j`'s sum over its samples in round `r`, over `range`.
    fn sum(&self, j: usize, r: u64, range: std::ops::Range<usize>) -> Vec<f32> {
        let mut rng = Rng::new(self.seed ^ r.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ j as u64);
        let a = 0.8 + 0.4 * rng.next_f64() as f32;
        let b = 0.2 + 0.3 * rng.next_f64() as f32;
        let n = Self::samples(j) as f32;
        self.signal[range.clone()]
            .iter()
            .zip(&self.noise[j][range])
            .map(|(s, e)| n * (a * s + b * e))
            .collect()
    }
}

fn member(args: &BenchAverageArgs, index: usize) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(run_member(args, index))
}

async fn run_member(args: &BenchAverageArgs, index: usize) -> anyhow::Result<()> {
    let config = NetConfig {
        listen: vec!["/ip4/127.0.0.1/udp/0/quic-v1".parse()?],
        mdns: false,
        run: RUN.to_string(),
        allow_private: true,
        ..NetConfig::default()
    };
    let (handle, mut events, mut frames) = net::start(Keypair::generate_ed25519(), config).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let listening = loop {
        match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Some(NodeEvent::Listening(a))) if crate::run::is_dialable(&a) => break a,
            Ok(Some(_)) => {}
            _ => bail!("member {index}: not listening after 30 s"),
        }
    };
    println!("listening {listening}/p2p/{}", handle.peer_id);
    std::io::stdout().flush()?;
    let mut commands = stdin_lines();
    let line = commands
        .recv()
        .await
        .context("the command closed its pipe")?;
    let mut ids: Vec<PeerId> = Vec::new();
    for word in line.split_whitespace() {
        let addr: Multiaddr = word.parse().with_context(|| format!("address {word}"))?;
        let Some(Protocol::P2p(id)) = addr.iter().last() else {
            bail!("{addr} names no peer");
        };
        if id != handle.peer_id {
            handle.dial(addr).await?;
        }
        ids.push(id);
    }
    if ids.len() != args.peers {
        bail!("{} addresses for {} peers", ids.len(), args.peers);
    }
    let mut connected = std::collections::HashSet::new();
    while connected.len() < args.peers - 1 {
        match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Some(NodeEvent::Connected(p))) if ids.contains(&p) => {
                connected.insert(p);
            }
            Ok(Some(_)) => {}
            _ => bail!(
                "member {index}: connected to {} of the others",
                connected.len()
            ),
        }
    }

    let keys: Vec<PeerKey> = ids.iter().map(crate::run::key_of).collect();
    let me = keys[index];
    let len = values_of(args);
    let contributions = Contributions::new(args.peers, len, args.seed);
    // Time for the slowest member to move its share of a large vector on a busy machine.
    let timing = Timing {
        round_timeout: Duration::from_secs(8).max(Duration::from_millis(250 * args.mib as u64)),
        ..Timing::default()
    };
    let start = Instant::now();
    let now = || start.elapsed();
    let mut net = Wire {
        handle: &handle,
        ids: &ids,
        keys: &keys,
        early: Vec::new(),
        limit: 64 * args.peers,
    };
    let mut feedback = Feedback::new(args.codec, 1.0);
    let mut report = MemberReport::default();
    let mut check = Check::new(args.codec);
    // The last round stays to answer what its slower members still ask (a part, a verdict).
    let mut last: Option<Round> = None;
    for r in 0..args.rounds as u64 {
        let key = RoundKey { stage: 0, index: r };
        let mut own = contributions.sum(index, r, 0..len);
        // Every member starts the round together, once all have checked the last one: the
        // time measured is the round's alone, not a check competing for the cores.
        println!("ready {r}");
        std::io::stdout().flush()?;
        loop {
            tokio::select! {
                line = commands.recv() => match line.as_deref() {
                    Some("go") => break,
                    _ => bail!("member {index}: the command said {line:?} instead of go"),
                },
                Some(frame) = frames.recv() => net.route(frame, r, &mut last, None, now())?,
            }
        }
        let leader = key.leader(keys.iter().copied()).unwrap_or(me);
        let mut round = if leader == me {
            Round::lead(key, me, &keys, len, args.codec, timing, now())
        } else {
            Round::follow(key, me, leader, len, args.codec, timing, now())
        };
        round.lend_feedback(&mut feedback);
        for (from, _, msg) in net.early.extract_if(.., |(_, k, _)| *k == key) {
            round.handle(from, msg, now());
        }
        let mut fixed = None;
        let outcome = loop {
            let mut ended = None;
            while let Some(o) = round.poll() {
                match o {
                    RoundOut::Send(to, msg) => net.send(key, to, msg),
                    RoundOut::NeedContribution => {
                        fixed = Some(Instant::now());
                        round.contribute(
                            std::mem::take(&mut own),
                            Contributions::samples(index),
                            None,
                            now(),
                        );
                    }
                    RoundOut::Finished(result) => ended = Some(Some(result)),
                    RoundOut::Failed(why) => {
                        tracing::warn!("round {r}: {why}");
                        ended = Some(None);
                    }
                    RoundOut::Violation(from, what) => {
                        bail!("round {r}: {from} broke a rule: {what}")
                    }
                    RoundOut::Evidence(_) => {}
                }
            }
            if let Some(e) = ended {
                break e;
            }
            let wake = round
                .deadline()
                .map(|d| start + d)
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(1));
            tokio::select! {
                Some(frame) = frames.recv() => {
                    net.route(frame, r, &mut last, Some(&mut round), now())?;
                }
                _ = tokio::time::sleep_until(wake.into()) => round.handle_timeout(now()),
            }
        };
        round.lend_feedback(&mut feedback);
        let took = fixed.map(|t| t.elapsed().as_secs_f64());
        match outcome {
            Some(result) => {
                report.seconds.push(took);
                let partial = !result.left_out.is_empty()
                    || !result.zeroed.is_empty()
                    || !result.refused.is_empty();
                if partial {
                    report.partial.push(r);
                }
                let (error, wrong) = check.result(&contributions, r, &keys, &result);
                if !partial {
                    report.max_error = report.max_error.max(error);
                    report.silent_errors += usize::from(wrong);
                }
            }
            None => report.seconds.push(None),
        }
        last = Some(round);
    }
    report.tolerance = check.tolerance;
    println!("{}", serde_json::to_string(&report)?);
    std::io::stdout().flush()?;
    // The others may still want this member's parts and verdicts of the last round: it
    // leaves when the command says every member is done (its input closes).
    let after = args.rounds as u64;
    loop {
        tokio::select! {
            line = commands.recv() => if line.is_none() { return Ok(()) },
            Some(frame) = frames.recv() => net.route(frame, after, &mut last, None, now())?,
        }
    }
}

/// The command's lines to this member, read on a thread of their own; closed when it closes
/// the pipe.
fn stdin_lines() -> tokio::sync::mpsc::UnboundedReceiver<String> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            let Ok(line) = line else { return };
            if tx.send(line.trim().to_owned()).is_err() {
                return;
            }
        }
    });
    rx
}

/// A member's side of the network: who the others are, and round messages that came early.
struct Wire<'a> {
    handle: &'a net::NodeHandle,
    ids: &'a [PeerId],
    keys: &'a [PeerKey],
    early: Vec<(PeerKey, RoundKey, RoundMsg)>,
    limit: usize,
}

impl Wire<'_> {
    fn send(&self, key: RoundKey, to: PeerKey, msg: RoundMsg) {
        let Some(j) = self.keys.iter().position(|k| *k == to) else {
            return;
        };
        let to = self.ids[j];
        let bytes = Envelope {
            run: RUN,
            msg: Message::Round { key, msg },
        }
        .to_bytes();
        let h = self.handle.clone();
        tokio::spawn(async move {
            if let Err(e) = h.send_frame(to, FrameKind::Tensor, &bytes).await {
                tracing::warn!("send to {to} failed: {e:#}");
            }
        });
    }

    /// Hands a frame to the round `r` it is for (`current`), to the round before it (`last`,
    /// which still answers requests), or keeps it for a later round.
    fn route(
        &mut self,
        frame: net::InboundFrame,
        r: u64,
        last: &mut Option<Round>,
        current: Option<&mut Round>,
        now: Duration,
    ) -> anyhow::Result<()> {
        let Some(j) = self.ids.iter().position(|p| *p == frame.peer) else {
            return Ok(());
        };
        let from = self.keys[j];
        let Ok(Envelope {
            run: RUN,
            msg: Message::Round { key, msg },
        }) = Envelope::from_bytes(&frame.payload)
        else {
            bail!("an unexpected message from {}", frame.peer);
        };
        match (current, last.as_mut()) {
            (Some(round), _) if key.index == r => round.handle(from, msg, now),
            (_, Some(round)) if key.index + 1 == r => {
                round.handle(from, msg, now);
                while let Some(o) = round.poll() {
                    if let RoundOut::Send(to, msg) = o {
                        self.send(key, to, msg);
                    }
                }
            }
            _ if key.index >= r && self.early.len() < self.limit => {
                self.early.push((from, key, msg));
            }
            _ => {}
        }
        Ok(())
    }
}

/// Checks a round's result against the robust mean recomputed from every contribution.
struct Check {
    codec: Codec,
    encoder: Encoder,
    decoder: Decoder,
    /// The largest difference the codec explained so far (None: not checked).
    tolerance: Option<f64>,
}

impl Check {
    fn new(codec: Codec) -> Self {
        Check {
            codec,
            encoder: Encoder::new(),
            decoder: Decoder::new(),
            tolerance: (!codec.is_sparse()).then_some(0.0),
        }
    }

    /// The largest difference of `result` from the robust mean of round `r`'s contributions,
    /// part by part as the group split the vector, and whether the codec explains it: exact
    /// for a lossless codec; otherwise within six times what encoding the mean once changes
    /// (the shares and the averaged part are each encoded once, and error feedback delays up
    /// to one encoding's error by a round). Sparse codecs explain anything: not checked.
    fn result(
        &mut self,
        contributions: &Contributions,
        r: u64,
        keys: &[PeerKey],
        result: &RoundResult,
    ) -> (f64, bool) {
        let len = result.averaged.len();
        let n = result.group.len();
        let (mut error, mut wrong) = (0f64, false);
        // In key order, as the owner holds them: the same sums in the same order.
        let mut members: Vec<(PeerKey, usize)> = result
            .group
            .iter()
            .filter_map(|k| Some((*k, keys.iter().position(|x| x == k)?)))
            .collect();
        members.sort_unstable();
        let members: Vec<usize> = members.into_iter().map(|(_, j)| j).collect();
        for part in 0..n {
            let range = part_range(len, n, part);
            let sums: Vec<Vec<f32>> = members
                .iter()
                .map(|&j| contributions.sum(j, r, range.clone()))
                .collect();
            let shares: Vec<Share> = sums
                .iter()
                .zip(&members)
                .map(|(values, &j)| Share::new(values, Contributions::samples(j)))
                .collect();
            let mean = centered_clip(&shares, range.len()).mean;
            let got = &result.averaged[range];
            let diff = got
                .iter()
                .zip(&mean)
                .map(|(a, b)| f64::from((a - b).abs()))
                .fold(0.0, f64::max);
            error = error.max(diff);
            if let Some(explained) = self.explained(&mean) {
                self.tolerance = self.tolerance.map(|t| t.max(explained));
                wrong |= diff > explained;
            }
        }
        (error, wrong)
    }

    fn explained(&mut self, mean: &[f32]) -> Option<f64> {
        if self.codec.is_lossless() {
            return Some(0.0);
        }
        if self.codec.is_sparse() {
            return None;
        }
        let mut bytes = Vec::new();
        let mut back = Vec::new();
        let once = self
            .encoder
            .encode(self.codec, mean, &[mean.len()], &mut bytes)
            .and_then(|_| self.decoder.decode(&bytes, &mut back).map(|_| ()));
        if once.is_err() || back.len() != mean.len() {
            return None;
        }
        let once = back
            .iter()
            .zip(mean)
            .map(|(a, b)| f64::from((a - b).abs()))
            .fold(0.0, f64::max);
        Some(6.0 * once)
    }
}
