//! `shoal run`: one peer of a training run. The protocol decisions are made by
//! [`shoal_protocol::swarm::Peer`]; this file only feeds it what happens (messages from the
//! network, finished compute, the clock, Ctrl-C) and carries out what it asks (send, gossip,
//! compute), keeping counts for the progress line and the report.
//!
//! About 1,000 lines, kept whole: most of it is the one `select!` loop that owns the peer's
//! state and the exit path that must see all of it (goodbye, checkpoint, report); the compute
//! thread, checkpoints, the report, the progress bars, the metrics and the dashboard live in
//! `run/`.

use crate::cli::RunArgs;
use crate::report;
use anyhow::{Context, bail};
use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};
use shoal_compute::StageSpec;
use shoal_node::net::{self, GossipCheck, NetConfig, NodeEvent, NodeHandle, identity};
use shoal_protocol::swarm::message::Traffic;
use shoal_protocol::swarm::{
    Action, DataSource, Envelope, Evaluation, Event, Job, MAX_EVALUATION_SAMPLES, Message, Peer,
    PeerKey, Resume, RunConfig, RunId, Timing,
};
use shoal_protocol::{FrameKind, TrafficCodecs};
use shoal_worker::{StageWorker, model_of, stage_costs};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

pub(crate) mod checkpoint;
mod compute;
mod dashboard;
pub(crate) mod progress;
mod run_files;
mod run_metrics;
mod run_report;

/// Peers remembered as answered directly (see the run loop); forgotten all at once beyond it.
const MAX_ANSWERED_DIRECTLY: usize = 4096;

use checkpoint::{check_run_config, load_checkpoint};
use compute::{MemoryTally, Worker, WorkerMsg, spawn_worker};
use progress::{Progress, Stall, say};
use run_report::{ReportContext, RunReport};

/// The run's configuration from the command line of the peer that creates it.
fn config_from_args(args: &RunArgs) -> anyhow::Result<RunConfig> {
    let model = args.preset.config();
    let seq = args.seq.unwrap_or(model.context);
    StageSpec::check_pipeline(&model, args.stages, seq)
        .with_context(|| format!("--stages {} --seq {seq}", args.stages))?;
    let data = match &args.data {
        None => DataSource::Synthetic,
        Some(path) => run_files::data_source(path)?,
    };
    if args.val_data.is_some() && args.eval_every == 0 {
        bail!("--val-data is read only with --eval-every N (how often the run evaluates)");
    }
    let evaluation = Evaluation {
        every: args.eval_every,
        samples: u32::try_from(args.eval_samples)
            .ok()
            .filter(|n| *n <= MAX_EVALUATION_SAMPLES)
            .with_context(|| {
                format!(
                    "--eval-samples {}: at most {MAX_EVALUATION_SAMPLES}",
                    args.eval_samples
                )
            })?,
        data: args
            .val_data
            .as_deref()
            .map(run_files::data_source)
            .transpose()?,
    };
    let sync = args.diloco.sync_mode(args.sync)?;
    let mut config = RunConfig {
        preset: args.preset.name().to_string(),
        stages: args.stages as u32,
        global_batch: args.global_batch as u32,
        microbatch: args.microbatch as u32,
        seq: seq as u32,
        sync,
        lr: args.lr.unwrap_or(args.preset.default_lr()),
        max_steps: args.max_steps as u64,
        codecs: TrafficCodecs {
            activations: args.activation_codec,
            activation_grads: args.gradient_codec,
            averaging: args.averaging_codec,
        },
        data,
        seed: args.seed,
        init: None,
        evaluation,
    };
    config.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    // The model's shape follows the preset and the data's vocabulary.
    if let Some(path) = &args.init {
        let model = model_of(&config).map_err(anyhow::Error::msg)?;
        config.init = Some(run_files::model_ref(path, &model)?);
    }
    Ok(config)
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(args))
}

pub(crate) fn key_of(peer: &PeerId) -> PeerKey {
    PeerKey::from_bytes(&peer.to_bytes())
}

fn bootstrap_peers(addrs: &[Multiaddr]) -> Vec<PeerId> {
    addrs
        .iter()
        .filter_map(|a| match a.iter().last() {
            Some(Protocol::P2p(p)) => Some(p),
            _ => None,
        })
        .collect()
}

/// Asks the bootstrap peers for the run's configuration.
async fn learn_config(
    handle: &NodeHandle,
    run: RunId,
    bootstrap: &[PeerId],
    frames: &mut mpsc::Receiver<net::InboundFrame>,
    timeout: Duration,
) -> anyhow::Result<RunConfig> {
    if bootstrap.is_empty() {
        bail!("--bootstrap addresses must end in /p2p/<peer id> to learn the run from");
    }
    let hello = Envelope {
        run,
        msg: Message::Hello,
    }
    .to_bytes();
    let start = Instant::now();
    let mut ask = tokio::time::interval(Duration::from_secs(2));
    // What became of the last question to each bootstrap peer: None if it was delivered.
    let (sent_tx, mut sent) = mpsc::unbounded_channel::<(PeerId, Option<String>)>();
    let mut last_errors: BTreeMap<PeerId, String> = BTreeMap::new();
    let tried = |errors: &BTreeMap<PeerId, String>| {
        bootstrap
            .iter()
            .map(|p| match errors.get(p) {
                Some(e) => format!("{p}: {e}"),
                None => format!("{p}: no answer"),
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    loop {
        tokio::select! {
            _ = ask.tick() => {
                let waited = start.elapsed();
                if waited >= timeout {
                    bail!(
                        "no peer of run {run} answered within {:.0} s (--join-timeout); asked {} \
                         bootstrap peer(s) every 2 s: {}",
                        timeout.as_secs_f64(),
                        bootstrap.len(),
                        tried(&last_errors)
                    );
                }
                if waited >= Duration::from_secs(2) {
                    say!(
                        "joining run {run}: no answer after {:.0} s of {:.0} ({}); asking again",
                        waited.as_secs_f64(),
                        timeout.as_secs_f64(),
                        tried(&last_errors)
                    );
                }
                for p in bootstrap {
                    let (h, p, hello) = (handle.clone(), *p, hello.clone());
                    let sent = sent_tx.clone();
                    tokio::spawn(async move {
                        let result = h.send_frame(p, FrameKind::Control, &hello).await;
                        if let Err(e) = &result {
                            tracing::debug!("hello to {p}: {e}");
                        }
                        let _ = sent.send((p, result.err().map(|e| format!("{e:#}"))));
                    });
                }
            }
            Some((p, outcome)) = sent.recv() => {
                match outcome {
                    Some(e) => last_errors.insert(p, e),
                    None => last_errors.remove(&p),
                };
            }
            Some(frame) = frames.recv() => {
                if let Ok(Envelope { run: r, msg: Message::Config(config) }) =
                    Envelope::from_bytes(&frame.payload)
                {
                    if r == run && config.run_id() == run {
                        check_run_config(&config).context("the run's configuration")?;
                        return Ok(config);
                    }
                    tracing::warn!(peer = %frame.peer, "configuration of another run");
                }
            }
        }
    }
}

/// Live state of the driver loop, for progress and the report.
#[derive(Default)]
struct Tally {
    bytes_sent: BTreeMap<Traffic, u64>,
    bytes_received: BTreeMap<Traffic, u64>,
    /// Boundary messages handed to the transport, by the codec chosen for their hop.
    boundary_codecs: BTreeMap<String, u64>,
    loss_curve: Vec<(u64, f64)>,
    /// `[step, held-out loss]` of each evaluation heard of.
    val_curve: Vec<(u64, f64)>,
    /// `[seconds, tokens committed]` after each step.
    tokens_curve: Vec<(f64, u64)>,
    committed: Vec<(u32, u64)>,
    stage_history: Vec<u32>,
    step_samples: Vec<f64>,
    finished_at: Option<Instant>,
    /// Protocol violations by sender and kind: logged the first time, counted after.
    violations: BTreeMap<(PeerKey, &'static str), u64>,
    banned: Vec<(String, String)>,
    /// Stage-mates whose averaging weight this peer lowered, with the lowest credit told.
    discounted: BTreeMap<String, f64>,
}

impl Tally {
    /// Mean loss of the last steps this peer saw as the last stage (a tenth of them, 1 to 10).
    fn final_loss(&self) -> Option<f64> {
        let window = (self.loss_curve.len() / 10).clamp(1, 10);
        let tail = &self.loss_curve[self.loss_curve.len().saturating_sub(window)..];
        (!tail.is_empty()).then(|| tail.iter().map(|(_, l)| l).sum::<f64>() / tail.len() as f64)
    }
}

async fn serve(args: RunArgs) -> anyhow::Result<()> {
    let key_path = args.identity.clone().unwrap_or_else(identity::default_path);
    // Held to the end of the process: the identity's lock.
    let identity = identity::load_or_create(&key_path)?;
    let key = identity.key.clone();
    let checkpoint = match &args.checkpoint_dir {
        Some(dir) => load_checkpoint(dir)?,
        None => None,
    };
    // The run: from the checkpoint, from --run (learned from a peer), or created here.
    // A restarted peer knows its run from its checkpoint.
    let created = match (&checkpoint, args.run) {
        (Some(c), _) => Some(c.config.clone()),
        (None, None) => Some(config_from_args(&args)?),
        (None, Some(_)) => None,
    };
    let run_id = match (&created, args.run) {
        (Some(c), _) => c.run_id(),
        (None, Some(id)) => id,
        (None, None) => bail!("--run is required to join"),
    };
    if let (Some(c), Some(id)) = (&checkpoint, args.run) {
        if c.config.run_id() != id {
            bail!(
                "the checkpoint in {} belongs to run {}, not {id}",
                args.checkpoint_dir
                    .as_deref()
                    .unwrap_or(Path::new("."))
                    .display(),
                c.config.run_id()
            );
        }
    }
    let gossip_run = run_id;
    let mut net_config = NetConfig {
        bootstrap: args.bootstrap.clone(),
        mdns: !args.no_mdns,
        direct: !args.no_direct,
        run: run_id.to_string(),
        allow_private: args.allow_private,
        // Only announcements of this run are valid gossip; anything else counts against the
        // peer that relayed it.
        gossip_check: Some(GossipCheck(Arc::new(move |_, data| {
            matches!(
                Envelope::from_bytes(data),
                Ok(Envelope { run, msg: Message::Announce(_) }) if run == gossip_run
            )
        }))),
        ..NetConfig::default()
    };
    if !args.listen.is_empty() {
        net_config.listen = args.listen.clone();
    }
    let (handle, mut events, mut frames) = net::start(key, net_config).await?;
    let me = key_of(&handle.peer_id);
    let config = match created {
        Some(c) => c,
        None => {
            let boot = bootstrap_peers(&args.bootstrap);
            say!("joining run {run_id} through {} peer(s)", boot.len());
            let timeout = Duration::from_secs_f32(args.join_timeout);
            learn_config(&handle, run_id, &boot, &mut frames, timeout).await?
        }
    };
    let model = model_of(&config).map_err(anyhow::Error::msg)?;
    if let Some(stage) = args.stage.filter(|s| *s >= config.stages) {
        bail!(
            "--stage {stage}: the run has {} stages (0 to {})",
            config.stages,
            config.stages - 1
        );
    }
    let timing = Timing {
        rebalance_every: Duration::try_from_secs_f32(args.rebalance_every)
            .with_context(|| format!("--rebalance-every {}", args.rebalance_every))?,
        ..Timing::default()
    };
    let costs = stage_costs(&config, &model, &timing);
    let announce_every = timing.announce_every;
    let corpus =
        run_files::local_corpus(&config.data, args.data.as_deref(), "--data", config.seed)?;
    corpus.check_seq(config.seq as usize)?;
    let held_out = match &config.evaluation.data {
        Some(source) if config.evaluation.every > 0 => {
            let corpus = run_files::local_corpus(
                source,
                args.val_data.as_deref(),
                "--val-data",
                config.seed,
            )?;
            corpus.check_seq(config.seq as usize)?;
            Some(corpus)
        }
        _ => None,
    };
    let initial = run_files::initial_params(&config, &model, args.init.as_deref())?;
    let backend = Arc::new(args.device.open()?);
    let backend_name = shoal_compute::Backend::name(&*backend);
    let device_memory = args
        .memory_limit
        .or(args.device_memory)
        .or_else(|| backend.memory_capacity());
    // Offloading to the host frees device memory only where the device is not the host; a
    // stated limit is honoured on any backend (it is how CPU and lavapipe test it).
    let hosts_any_stage = shoal_compute::memory::host_memory()
        .is_some_and(|host| host >= shoal_worker::offloaded_host_bytes(&config, &model));
    let offloads = args.memory_limit.is_some()
        || (!backend.is_cpu() && device_memory.is_some() && hosts_any_stage);
    match device_memory {
        Some(bytes) => say!(
            "compute: {backend_name}, {}{}",
            report::size(bytes),
            if offloads {
                ", blocks offloaded to host memory where a stage does not fit"
            } else {
                ""
            }
        ),
        None => say!(
            "compute: {backend_name}, memory unknown (--device-memory states it; until then \
             this peer may be given a stage its device cannot hold)"
        ),
    }
    let in_flight = (timing.in_flight_per_stage * config.stages) as usize;
    let memory = Arc::new(MemoryTally::default());
    let mut worker = Worker {
        stage: {
            let mut w = StageWorker::new(config.clone(), backend, Some(corpus))
                .map_err(anyhow::Error::msg)?;
            w.set_held_out(held_out);
            if let Some(initial) = initial {
                w.set_initial(initial);
            }
            w.set_recompute(args.recompute);
            match (args.memory_limit, device_memory) {
                (Some(limit), _) => w.set_memory_limit(Some(limit)),
                (None, Some(memory)) if offloads => w.set_device_memory(memory, in_flight),
                _ => {}
            }
            w
        },
        config: config.clone(),
        checkpoint_dir: args.checkpoint_dir.clone(),
        rest_per_busy: 1.0 / f64::from(args.duty_cycle) - 1.0,
        memory: memory.clone(),
    };
    let mut resume = None;
    if let Some(c) = checkpoint {
        let hash = worker
            .stage
            .restore(c.stage, &c.state)
            .map_err(anyhow::Error::msg)?;
        resume = Some(Resume {
            stage: c.stage,
            step: c.step,
            round: c.round,
            hash,
        });
        say!(
            "resuming stage {} at step {} from {}",
            c.stage,
            c.step,
            args.checkpoint_dir
                .as_deref()
                .unwrap_or(Path::new("."))
                .display()
        );
    }
    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    let jobs = spawn_worker(worker, done_tx);

    let start = Instant::now();
    let now = || start.elapsed();
    // The protocol's random choices (routing, back-offs, attempt ids) must be unpredictable to
    // other peers: a secret seed, drawn from the system's randomness (the standard library
    // seeds its hasher keys from it).
    let seed = {
        use std::hash::BuildHasher;
        std::collections::hash_map::RandomState::new().hash_one(me.0)
    };
    let mut peer = Peer::new(me, config.clone(), costs, timing, seed, resume, now());
    #[cfg(feature = "attacks")]
    if let shoal_protocol::swarm::attack::Behavior::Sybil(_) = args.behavior {
        // Its identities are played by the simulator, which knows who colludes.
        anyhow::bail!("--behavior sybil:N exists in the simulator only (netsim's `behavior`)");
    }
    #[cfg(feature = "attacks")]
    peer.set_attack(shoal_protocol::swarm::attack::Attack::new(
        args.behavior,
        Duration::from_secs_f64(args.behavior_from.max(0.0)),
        seed,
    ));
    peer.set_routing(args.routing);
    if let Some(bytes) = device_memory {
        peer.set_memory(bytes);
    }
    peer.set_offloads(offloads);
    peer.set_state_upload_limit(args.state_upload_limit.map(|mb| f64::from(mb) * 1e6));
    if let Some(stage) = args.stage {
        peer.set_first_stage(stage);
    }
    peer.set_checkpoint_every(
        args.checkpoint_dir
            .as_ref()
            .map(|_| args.checkpoint_every as u64),
    );
    say!(
        "shoal run {run_id}: {} in {} stages, {} sync, global batch {}, microbatch {}, {} steps; peer {}",
        config.preset,
        config.stages,
        config.sync,
        config.global_batch,
        config.microbatch,
        config.max_steps,
        handle.peer_id
    );

    let mut ids: HashMap<PeerKey, PeerId> = HashMap::new();
    let (failed_tx, mut failed_rx) = mpsc::unbounded_channel::<PeerKey>();
    let (sent_tx, mut sent_rx) = mpsc::unbounded_channel::<(PeerKey, Traffic, u64, Duration)>();
    let mut tally = Tally::default();
    let mut printed_join = false;
    // The relay client reports a circuit each time its reservation is renewed.
    let mut listening: HashSet<Multiaddr> = HashSet::new();
    let mut progress = Progress::new();
    // This peer's latest announcement, for peers that announce directly (see below).
    let mut announcement: Option<Vec<u8>> = None;
    let mut answered_directly: HashMap<PeerKey, Instant> = HashMap::new();
    let mut timer = tokio::time::interval(Duration::from_millis(100));
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let stop = stop_requested();
    tokio::pin!(stop);
    let report_every = Duration::try_from_secs_f32(args.report_every)
        .with_context(|| format!("--report-every {}", args.report_every))?;
    let mut reported = Instant::now();
    let report_context = ReportContext {
        run_id: run_id.to_string(),
        peer_id: handle.peer_id.to_string(),
        backend: backend_name.clone(),
        config: config.clone(),
        resume,
        start,
        memory: memory.clone(),
    };
    let (mut metrics, mut dashboard) = dashboard::serve_endpoints(
        args.metrics,
        args.dashboard,
        vec![
            ("run", run_id.to_string()),
            ("peer", handle.peer_id.to_string()),
            ("backend", backend_name.clone()),
            ("preset", config.preset.clone()),
            ("version", env!("CARGO_PKG_VERSION").to_string()),
        ],
        serde_json::json!({
            "run": run_id.to_string(),
            "id": handle.peer_id.to_string(),
            "backend": backend_name,
            "preset": config.preset,
            "stages": config.stages,
            "sync": config.sync.to_string(),
        }),
    )
    .await?;
    // When this replica handed over its contribution to the round under way.
    let mut contributed_at: Option<Instant> = None;
    let mut stall = Stall::new(args.stall_timeout)?;
    // The caps on connections and streams follow what this peer's stage needs.
    let mut peers_needed = 0;
    let ending = loop {
        tokio::select! {
            signal = &mut stop => break Ending::Stopped(signal?),
            _ = timer.tick() => {
                if peer.poll_timeout().is_some_and(|t| t <= now()) {
                    peer.handle_timeout(now());
                }
                let needed = peer.peers_needed();
                if needed != peers_needed {
                    peers_needed = needed;
                    let caps = handle.need_peers(needed).await?;
                    tracing::debug!(needed, ?caps, "connection and stream caps");
                }
                progress.maybe_print(&peer, &tally, start);
                if let Some(m) = &mut metrics {
                    m.refresh(&peer, &tally, &memory);
                }
                if let Some(d) = &mut dashboard {
                    d.refresh(&peer, &tally, &ids);
                }
                if let Some(path) = &args.report
                    && reported.elapsed() >= report_every
                {
                    reported = Instant::now();
                    let report = RunReport::new("running", &report_context, &peer, &tally, &ids);
                    if let Err(e) = report::write_json(path, &report) {
                        tracing::warn!("{e:#}");
                    }
                }
                progress.download(&peer);
                if tally.finished_at.is_none() {
                    if let Some(why) = stall.check(&peer) {
                        break Ending::Stalled(why);
                    }
                }
            }
            Some(event) = events.recv() => match event {
                NodeEvent::Listening(addr) if is_dialable(&addr) && listening.insert(addr.clone()) => {
                    let relayed = addr.iter().any(|p| matches!(p, Protocol::P2pCircuit));
                    if relayed {
                        say!("listening through a relay on {addr}");
                    } else {
                        say!("listening on {addr}");
                    }
                    // Behind a NAT, the relayed address is the one others can dial.
                    if args.run.is_none() && (!printed_join || relayed) {
                        printed_join = true;
                        say!("others join with:\n  shoal run --run {run_id} --bootstrap {addr}");
                    }
                }
                NodeEvent::Reachability(Some(addr)) => say!("reachable from outside at {addr}"),
                NodeEvent::Reachability(None) => {
                    say!("behind a NAT or firewall: listening through relays");
                }
                NodeEvent::HolePunched(p) => say!("hole punched: direct connection to {p}"),
                NodeEvent::HolePunchFailed(p, why) => {
                    say!("hole punching to {p} failed ({why}): relayed connection");
                }
                NodeEvent::Gossip { from, via, data } => {
                    // The network checked that it is an announcement of this run.
                    let k = key_of(&from);
                    ids.insert(k, from);
                    if let Ok(Envelope { msg, .. }) = Envelope::from_bytes(&data) {
                        peer.handle_gossip(k, key_of(&via), msg, now());
                    }
                }
                NodeEvent::Connected(p) | NodeEvent::Discovered(p) => {
                    ids.insert(key_of(&p), p);
                }
                NodeEvent::Disconnected(p) => peer.handle_peer_lost(key_of(&p), now()),
                NodeEvent::Rtt(p, rtt) => {
                    if let Some(d) = &mut dashboard {
                        d.rtt(key_of(&p), rtt);
                    }
                    peer.handle_rtt(key_of(&p), rtt)
                }
                _ => {}
            },
            Some(frame) = frames.recv() => {
                let k = key_of(&frame.peer);
                ids.insert(k, frame.peer);
                match Envelope::from_bytes(&frame.payload) {
                    Ok(env) if env.run == run_id => {
                        *tally.bytes_received.entry(env.msg.traffic()).or_default() += frame.payload.len() as u64;
                        // A peer announces directly when it has no gossip mesh to publish into
                        // (after a restart under the same identity, until its neighbours
                        // reconnect): it would not hear this peer's gossip either, so it gets
                        // this peer's announcement back, at most once per announcement period.
                        if matches!(env.msg, Message::Announce(_)) {
                            if answered_directly.len() > MAX_ANSWERED_DIRECTLY {
                                answered_directly.clear();
                            }
                            let due = answered_directly
                                .get(&k)
                                .is_none_or(|t| t.elapsed() >= announce_every);
                            if let (true, Some(bytes)) = (due, announcement.clone()) {
                                answered_directly.insert(k, Instant::now());
                                let (h, to) = (handle.clone(), frame.peer);
                                tokio::spawn(async move {
                                    let _ = h.send_frame(to, FrameKind::Tensor, &bytes).await;
                                });
                            }
                        }
                        peer.handle_message(k, env.msg, now());
                    }
                    Ok(env) => tracing::debug!(peer = %frame.peer, "message of run {}", env.run),
                    Err(e) => tracing::warn!(peer = %frame.peer, "bad message: {e}"),
                }
            }
            Some(done) = done_rx.recv() => {
                #[cfg(feature = "attacks")]
                let done = match done {
                    shoal_protocol::swarm::ComputeDone::State { to, bytes } if peer.poisons_state() => {
                        let bytes = shoal_compute::poisoned_state(&bytes).unwrap_or(bytes);
                        shoal_protocol::swarm::ComputeDone::State { to, bytes }
                    }
                    other => other,
                };
                if matches!(done, shoal_protocol::swarm::ComputeDone::Gradient { .. }) {
                    contributed_at = Some(Instant::now());
                }
                peer.handle_compute_done(done, now())
            }
            Some(k) = failed_rx.recv() => peer.handle_send_failed(k, now()),
            Some((to, traffic, bytes, elapsed)) = sent_rx.recv() => {
                *tally.bytes_sent.entry(traffic).or_default() += bytes;
                peer.handle_delivered(to, bytes, elapsed);
            }
        }
        while let Some(action) = peer.poll_action() {
            match action {
                Action::Send { to, msg } => {
                    let Some(&pid) = ids.get(&to) else {
                        tracing::debug!("no address for {to}");
                        continue;
                    };
                    let traffic = msg.traffic();
                    if matches!(msg, Message::Announce(_)) {
                        // Told directly already: no answer owed this period.
                        answered_directly.insert(to, Instant::now());
                    }
                    if let Some(codec) = msg.boundary_codec() {
                        *tally.boundary_codecs.entry(codec).or_default() += 1;
                    }
                    let bytes = Envelope { run: run_id, msg }.to_bytes();
                    let (h, failed, sent) = (handle.clone(), failed_tx.clone(), sent_tx.clone());
                    // Each message on its own task and stream: many in flight, none blocking
                    // another; the protocol does not rely on ordering between messages.
                    tokio::spawn(async move {
                        let began = Instant::now();
                        match h.send_frame(pid, FrameKind::Tensor, &bytes).await {
                            Ok(()) => {
                                let took = began.elapsed();
                                let _ = sent.send((to, traffic, bytes.len() as u64, took));
                            }
                            Err(e) => {
                                tracing::info!("send to {pid} failed: {e}");
                                let _ = failed.send(to);
                            }
                        }
                    });
                }
                Action::Announce(a) => {
                    let bytes = Envelope {
                        run: run_id,
                        msg: Message::Announce(a),
                    }
                    .to_bytes();
                    announcement = Some(bytes.clone());
                    let h = handle.clone();
                    let known: Vec<PeerId> = ids.values().copied().collect();
                    tokio::spawn(async move {
                        if let Err(e) = h.publish(bytes.clone()).await {
                            // No gossip mesh to publish into: before the mesh forms, or when
                            // a peer restarted under the same identity and its neighbours,
                            // still holding the old connection, never re-sent their
                            // subscriptions. Tell the known peers directly instead.
                            tracing::debug!("gossip: {e:#}; announcing directly");
                            for pid in known {
                                let (h, bytes) = (h.clone(), bytes.clone());
                                tokio::spawn(async move {
                                    let _ = h.send_frame(pid, FrameKind::Tensor, &bytes).await;
                                });
                            }
                        }
                    });
                }
                Action::Compute(job) => {
                    if matches!(job, Job::Step { .. } | Job::OuterStep { .. })
                        && let (Some(m), Some(t)) = (&metrics, contributed_at.take())
                    {
                        m.averaged(t.elapsed().as_secs_f64());
                    }
                    if jobs.send(WorkerMsg::Job(job)).is_err() {
                        bail!("the compute thread stopped");
                    }
                }
                Action::Event(e) => {
                    if let Event::Banned { peer: banned, .. } = &e
                        && let Some(&pid) = ids.get(banned)
                    {
                        let h = handle.clone();
                        tokio::spawn(async move { h.ban(pid).await });
                    }
                    if let Some(d) = &mut dashboard {
                        d.on_event(&e, &ids);
                    }
                    if matches!(e, Event::Stepped { .. }) {
                        let at = start.elapsed().as_secs_f64();
                        tally.tokens_curve.push((at, committed_tokens(&peer)));
                    }
                    on_event(e, &peer, &ids, &mut tally);
                }
            }
        }
        if let Some(t) = tally.finished_at {
            // Linger so replicas still finishing can fetch what they need.
            if t.elapsed() > Duration::from_secs(3) {
                break Ending::Done;
            }
        }
    };
    progress.finish();
    // Leaving: tell the others, save the stage, write the report.
    let bye = Envelope {
        run: run_id,
        msg: Message::Announce(peer.leave()),
    }
    .to_bytes();
    let _ = tokio::time::timeout(Duration::from_secs(1), handle.publish(bye)).await;
    if args.checkpoint_dir.is_some() && peer.is_serving() {
        let (tx, rx) = std::sync::mpsc::channel();
        if jobs
            .send(WorkerMsg::Checkpoint(peer.step(), peer.round(), tx))
            .is_ok()
        {
            match tokio::task::spawn_blocking(move || rx.recv()).await {
                Ok(Ok(Ok(()))) => say!("checkpoint written at step {}", peer.step()),
                Ok(Ok(Err(e))) => eprintln!("error: checkpoint: {e:#}"),
                _ => eprintln!("error: checkpoint: the compute thread stopped"),
            }
        }
    }
    let stats = peer.stats();
    let tokens = committed_tokens(&peer);
    say!(
        "{}: stage {} at step {}, {} microbatches ({} retried, {} dropped, {} gradients discarded), {:.0} tokens/s{}",
        match &ending {
            Ending::Done => "done".to_string(),
            Ending::Stopped(signal) => format!("stopped by {signal}"),
            Ending::Stalled(_) => "gave up".to_string(),
        },
        peer.stage().map_or("-".into(), |s| s.to_string()),
        peer.step(),
        stats.microbatches_done,
        stats.microbatches_retried,
        stats.microbatches_dropped,
        stats.gradients_discarded,
        tokens as f64 / start.elapsed().as_secs_f64().max(1e-9),
        tally
            .final_loss()
            .map_or(String::new(), |l| format!(", loss {l:.4}")),
    );
    if let Some(path) = &args.report {
        let status = match ending {
            Ending::Done => "done",
            Ending::Stopped(_) => "stopped",
            Ending::Stalled(_) => "gave up",
        };
        report::write_json(
            path,
            &RunReport::new(status, &report_context, &peer, &tally, &ids),
        )?;
    }
    match ending {
        Ending::Stalled(why) => bail!("{why}"),
        Ending::Done | Ending::Stopped(_) => Ok(()),
    }
}

/// Resolves with the signal's name when the process is asked to stop: SIGINT (Ctrl-C) or,
/// on Unix, SIGTERM, as `kill`, docker and systemd stop a process. Both leave the swarm the
/// same way: checkpoint, report, goodbye.
async fn stop_requested() -> anyhow::Result<&'static str> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r.map(|()| "SIGINT").context("cannot listen for SIGINT"),
            _ = term.recv() => Ok("SIGTERM"),
        }
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c()
            .await
            .map(|()| "Ctrl-C")
            .context("cannot listen for Ctrl-C")
    }
}

/// Tokens of the microbatches this peer's stage has committed (the progress line, the report,
/// the metrics and the dashboard all count throughput from it).
fn committed_tokens(peer: &Peer) -> u64 {
    let c = peer.config();
    peer.stats().microbatches_done * u64::from(c.microbatch) * u64::from(c.seq)
}

/// How the run loop ended.
enum Ending {
    /// The run reached its last step.
    Done,
    /// SIGINT (Ctrl-C) or SIGTERM (`kill`, `docker stop`, `systemctl stop`): which.
    Stopped(&'static str),
    /// No step for `--stall-timeout` with a stage unserved: why.
    Stalled(String),
}

pub(crate) fn is_dialable(addr: &Multiaddr) -> bool {
    !addr.iter().any(|p| match p {
        Protocol::Ip4(ip) => ip.is_unspecified(),
        Protocol::Ip6(ip) => ip.is_unspecified(),
        _ => false,
    })
}

/// A protocol key's libp2p PeerId where it is known.
fn peer_id(ids: &HashMap<PeerKey, PeerId>, key: PeerKey) -> String {
    ids.get(&key).map_or(key.to_string(), |p| p.to_string())
}

fn on_event(e: Event, peer: &Peer, ids: &HashMap<PeerKey, PeerId>, tally: &mut Tally) {
    match e {
        Event::Violation { peer: from, what } => {
            let count = tally.violations.entry((from, what)).or_default();
            *count += 1;
            if *count == 1 {
                let who = peer_id(ids, from);
                tracing::warn!("protocol violation by {who}: {what} (dropped; logged once)");
            }
        }
        Event::Banned {
            peer: banned,
            why,
            accusers,
            replicas,
        } => {
            let who = peer_id(ids, banned);
            tracing::warn!(
                "banned {who} for the rest of the run: {why} ({accusers} of its stage's {replicas} replicas accuse it)"
            );
            tally.banned.push((who, why.to_string()));
        }
        Event::Discounted {
            peer: member,
            credit,
        } => {
            let who = peer_id(ids, member);
            tracing::warn!(
                "{who} claims more samples than the replicas it worked with saw it commit: its weight in averaging is {credit:.2} of its claim's"
            );
            tally.discounted.insert(who, credit);
        }
        Event::Serving { stage, step, from } => {
            tally.stage_history.push(stage);
            match from {
                Some(from) => {
                    say!("serving stage {stage} from step {step} (state from {from})")
                }
                None => say!("serving stage {stage} from step {step}"),
            }
        }
        Event::Stepped {
            step,
            loss,
            group,
            samples,
            hash,
        } => {
            tracing::debug!(
                "step {step}: {group} replica(s) averaged {samples} sample(s), parameters {hash:016x}"
            );
            tally.step_samples.push(samples);
            if let Some(l) = loss {
                tally.loss_curve.push((step, l as f64));
            }
        }
        Event::Committed { sample } => {
            if let Some(stage) = peer.stage() {
                tally.committed.push((stage, sample));
            }
        }
        Event::RoundDegraded {
            round,
            left_out,
            zeroed,
            refused,
        } => tracing::warn!(
            "round {round}: {left_out} member(s) left out, {zeroed} part(s) lost, \
             {refused} part(s) refused by the members' vote (forged)"
        ),
        Event::RoundFailed { round, reason } => tracing::info!("round {round}: {reason}"),
        Event::StateReceived {
            stage,
            bytes,
            took,
            senders,
        } => say!(
            "received stage {stage}'s state: {:.1} MB in {:.1} s from {senders} replica(s) ({:.1} MB/s)",
            bytes as f64 / 1e6,
            took.as_secs_f64(),
            bytes as f64 / 1e6 / took.as_secs_f64().max(1e-3)
        ),
        Event::Resync { from, reason } => say!("re-syncing from {from}: {reason}"),
        Event::StateRefused { from } => say!(
            "refused the state from {from}: its parameters differ from its stage's; asking another replica"
        ),
        Event::Moving { from, to } => say!("moving from stage {from} to stage {to}"),
        Event::Dropped { microbatch } => tracing::info!("microbatch {microbatch} dropped"),
        Event::Finished => {
            if tally.finished_at.is_none() {
                tally.finished_at = Some(Instant::now());
                say!("the run reached step {}", peer.step());
            }
        }
        Event::Warning(w) => tracing::warn!("{w}"),
        Event::HeldOut(h) => {
            let by = peer_id(ids, h.by);
            say!(
                "step {}: held-out loss {:.4} (evaluated by {by})",
                h.step,
                h.loss
            );
            tally.val_curve.push((h.step, f64::from(h.loss)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use checkpoint::{Checkpoint, save_checkpoint};
    use shoal_protocol::swarm::SyncMode;

    fn checkpoint() -> Checkpoint {
        Checkpoint {
            config: RunConfig {
                preset: "nano".into(),
                stages: 2,
                global_batch: 8,
                microbatch: 2,
                seq: 32,
                sync: SyncMode::AllReduce,
                lr: 1e-3,
                max_steps: 10,
                codecs: TrafficCodecs::default(),
                data: DataSource::Synthetic,
                seed: 1,
                init: None,
                evaluation: Default::default(),
            },
            stage: 1,
            step: 4,
            round: 4,
            state: Vec::new(),
        }
    }

    /// Regression: a checkpoint's configuration was trusted as read.
    #[test]
    fn a_checkpoint_that_cannot_be_is_refused_with_its_reason() {
        let dir = std::env::temp_dir().join(format!("shoal-ckpt-{}", std::process::id()));
        let good = checkpoint();
        save_checkpoint(&dir, &good).unwrap();
        assert!(load_checkpoint(&dir).unwrap().is_some());
        let bad: [(Checkpoint, &str); 5] = [
            (
                Checkpoint {
                    stage: 2,
                    ..checkpoint()
                },
                "stage 2",
            ),
            (
                Checkpoint {
                    step: 11,
                    round: 11,
                    ..checkpoint()
                },
                "step 11",
            ),
            (
                Checkpoint {
                    round: 5,
                    ..checkpoint()
                },
                "round 5",
            ),
            (
                Checkpoint {
                    config: RunConfig {
                        preset: "gpt9".into(),
                        ..checkpoint().config
                    },
                    ..checkpoint()
                },
                "preset",
            ),
            (
                Checkpoint {
                    config: RunConfig {
                        stages: 4096,
                        ..checkpoint().config
                    },
                    ..checkpoint()
                },
                "4096 stages",
            ),
        ];
        for (ckpt, why) in bad {
            save_checkpoint(&dir, &ckpt).unwrap();
            let e = format!("{:#}", load_checkpoint(&dir).unwrap_err());
            assert!(e.contains("invalid checkpoint") && e.contains(why), "{e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
