//! Command-line arguments.

use clap::{Args, Parser, Subcommand};
use shoal_compute::Preset;
use std::path::PathBuf;

/// shoal: train one transformer across many machines, peer to peer.
#[derive(Debug, Parser)]
#[command(name = "shoal", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Read flags from a TOML file, one key per flag (`global_batch = 64`, `recompute =
    /// true`, `bootstrap = ["/ip4/..."]`); flags on the command line override its keys.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// How log records (stderr; filtered by RUST_LOG, `warn` by default) are written: text
    /// for people, or json, one object per line for log collectors.
    #[arg(long, global = true, default_value = "text")]
    pub log_format: LogFormat,
}

/// The format of log records.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a model in this process, all stages local.
    Train(Box<TrainArgs>),
    /// Start a training run, or join one, as one peer serving one pipeline stage.
    Run(Box<RunArgs>),
    /// Join the network and serve it (bootstrap, relay, discovery) without training.
    Node(NodeArgs),
    /// Measure performance.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Simulate a swarm on this machine from a scenario file, reproducibly from a seed.
    Netsim(NetsimArgs),
    /// List the compute backends and adapters of this machine.
    Devices(DevicesArgs),
    /// Draw the curves of train, run or netsim reports (several of one kind: overlaid).
    Plot(PlotArgs),
    /// Prepare training data.
    #[command(subcommand)]
    Data(DataCommand),
    /// The mean loss of a model file on a data file (text or token shard).
    Eval(EvalArgs),
    /// Assemble a run's stage checkpoints into one GPT-2 model (safetensors, Hugging Face
    /// names and layout, config.json beside it).
    Export(ExportArgs),
    /// Sample text from a model file (safetensors, as `shoal export` or `train --export`
    /// write, or Hugging Face's GPT-2 layout).
    Generate(GenerateArgs),
}

#[derive(Debug, Subcommand)]
pub enum DataCommand {
    /// Tokenize text files into llm.c token shards: PREFIX_train.bin and PREFIX_val.bin
    /// (--data takes either; a model's vocabulary follows its data's tokenizer).
    Prepare(DataPrepareArgs),
}

#[derive(Debug, Args)]
pub struct DataPrepareArgs {
    /// UTF-8 text files, one document each.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// gpt2 (GPT-2's BPE, 50,257 tokens) or bytes (256).
    #[arg(long, default_value = "gpt2")]
    pub tokenizer: crate::tokenizer::Tokenizer,
    /// Where the shards go: PREFIX_train.bin and PREFIX_val.bin (a trailing .bin is dropped).
    #[arg(short, long)]
    pub output: PathBuf,
    /// The fraction of the tokens (the last ones) kept for validation.
    #[arg(long, default_value = "0.1")]
    pub val_fraction: f64,
}

#[derive(Debug, Args)]
pub struct EvalArgs {
    /// The model file (safetensors).
    pub model: PathBuf,
    /// The data: a UTF-8 text file or a token shard of the model's vocabulary.
    #[arg(long)]
    pub data: PathBuf,
    /// Tokens per window (default: the model's context).
    #[arg(long, value_parser = positive)]
    pub seq: Option<usize>,
    /// Windows evaluated at most (from the start of the data, one after another).
    #[arg(long, default_value = "256", value_parser = positive)]
    pub windows: usize,
    #[command(flatten)]
    pub device: DeviceArgs,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// Checkpoint directories of the run's peers (`--checkpoint-dir`), together covering
    /// every stage; of several for one stage, the one at the latest step is taken.
    #[arg(required = true)]
    pub checkpoints: Vec<PathBuf>,
    /// The model file to write (safetensors); config.json is written beside it.
    #[arg(short, long)]
    pub output: PathBuf,
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// The model file (safetensors).
    pub model: PathBuf,
    /// Text to continue (a model of the byte or GPT-2 vocabulary), or token ids separated by
    /// spaces.
    #[arg(long)]
    pub prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value = "200")]
    pub tokens: usize,
    /// Sampling temperature; 0 always takes the most likely token.
    #[arg(long, default_value = "0.8")]
    pub temperature: f32,
    /// Seed of the sampling.
    #[arg(long, default_value = "1")]
    pub seed: u64,
    /// Also write the next-token probabilities at every position of the prompt here (JSON:
    /// one row of the vocabulary's size per position).
    #[arg(long)]
    pub probabilities: Option<PathBuf>,
    #[command(flatten)]
    pub device: DeviceArgs,
}

#[derive(Debug, Args)]
pub struct PlotArgs {
    /// JSON reports of `shoal train`, `shoal run` or `shoal netsim` (all of one kind).
    #[arg(required = true)]
    pub reports: Vec<PathBuf>,
    /// The image to write: FILE.svg or FILE.png.
    #[arg(short, long)]
    pub output: PathBuf,
    /// The figure's title (default: the reports' names).
    #[arg(long)]
    pub title: Option<String>,
}

/// Where a stage's compute runs.
#[derive(Debug, Args)]
pub struct DeviceArgs {
    /// Compute backend: auto (CUDA, else a GPU through wgpu, else the CPU), cpu, wgpu or cuda.
    #[arg(long, default_value = "auto")]
    pub backend: shoal_compute::BackendChoice,
    /// The wgpu adapter or CUDA device to use, by its number in `shoal devices` (default: the
    /// best adapter, CUDA device 0).
    #[arg(long)]
    pub device: Option<usize>,
    /// CPU backend worker threads (0: one per core).
    #[arg(long, default_value = "0")]
    pub threads: usize,
}

impl DeviceArgs {
    /// Opens the backend these arguments name.
    pub fn open(&self) -> anyhow::Result<shoal_compute::AnyBackend> {
        Ok(shoal_compute::AnyBackend::open(
            self.backend,
            self.device,
            self.threads,
        )?)
    }
}

#[derive(Debug, Args)]
pub struct DevicesArgs {
    /// Also measure each backend: GFLOP/s of a training step of one stage of --preset.
    #[arg(long)]
    pub bench: bool,
    /// Model size the measurement trains.
    #[arg(long, default_value = "micro")]
    pub preset: Preset,
}

#[derive(Debug, Args)]
pub struct NetsimArgs {
    /// The scenario (TOML), e.g. netsim/scenarios/demo.toml.
    pub scenario: PathBuf,
    /// Seed of every random choice of the simulation.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write the report as JSON to this file.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Write the loss and throughput curves as an SVG image to this file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct NodeArgs {
    /// The key file of this node's identity (created on first run, owner-only).
    #[arg(long)]
    pub identity: Option<PathBuf>,
    /// Address to listen on (repeatable; default: QUIC on all interfaces, any port).
    #[arg(long)]
    pub listen: Vec<libp2p::Multiaddr>,
    /// Listen on nothing at start (reachable only through relays or outgoing connections).
    #[arg(long, conflicts_with = "listen")]
    pub no_listen: bool,
    /// A peer to join through, e.g. /ip4/1.2.3.4/udp/4001/quic-v1/p2p/12D3... (repeatable).
    #[arg(long)]
    pub bootstrap: Vec<libp2p::Multiaddr>,
    /// Do not look for peers on the LAN with multicast DNS.
    #[arg(long)]
    pub no_mdns: bool,
    /// Accept private, loopback and link-local addresses from other peers (automatic when a
    /// listen or bootstrap address is one: the run is on a private network).
    #[arg(long)]
    pub allow_private: bool,
    /// Relay traffic for peers that cannot be reached directly.
    #[arg(long)]
    pub relay_server: bool,
    /// Send tensors only over libp2p streams (no direct QUIC endpoint).
    #[arg(long)]
    pub no_direct: bool,
    /// The run (or public swarm) to join.
    #[arg(long, default_value = "public")]
    pub run: String,
    /// Serve Prometheus metrics at http://ADDR/metrics, e.g. `127.0.0.1:9100` (port 0: any
    /// free port, printed at start). For the operator: bind it to localhost or a private
    /// network.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<std::net::SocketAddr>,
    /// Read commands from stdin and print events to stdout, one JSON object per line.
    #[arg(long)]
    pub control: bool,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Model size: nano, micro, mini or gpt2 (creator only; joiners learn the run's).
    #[arg(long, default_value = "nano")]
    pub preset: Preset,
    /// Pipeline stages the model is cut into.
    #[arg(long, default_value = "1", value_parser = positive)]
    pub stages: usize,
    /// How replicas of a stage stay together: allreduce (every step) or diloco.
    #[arg(long, default_value = "allreduce")]
    pub sync: shoal_protocol::swarm::SyncMode,
    #[command(flatten)]
    pub diloco: DiLoCoArgs,
    /// Samples per optimizer step, over all replicas of a stage.
    #[arg(long, default_value = "16", value_parser = positive)]
    pub global_batch: usize,
    /// Samples per microbatch.
    #[arg(long, default_value = "4", value_parser = positive)]
    pub microbatch: usize,
    /// Tokens per sample (default: the model's context).
    #[arg(long, value_parser = positive)]
    pub seq: Option<usize>,
    /// Optimizer steps of the run.
    #[arg(long, default_value = "300", value_parser = positive)]
    pub max_steps: usize,
    /// Peak learning rate; default per preset.
    #[arg(long, value_parser = positive_f32)]
    pub lr: Option<f32>,
    /// Seed of initialisation and data.
    #[arg(long, default_value = "1")]
    pub seed: u64,
    /// A UTF-8 text file to train on; every data driver needs the same file (default: the
    /// built-in synthetic corpus).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Held-out data the swarm's model is evaluated on (e.g. the `_val.bin` shard of `shoal
    /// data prepare`): needed when --data is a file, whose windows are the same whatever the
    /// seed (the synthetic corpus draws fresh samples); every peer needs the same file.
    #[arg(long)]
    pub val_data: Option<PathBuf>,
    /// Evaluate the swarm's model on held-out data every N steps and at the last (0: never):
    /// one first-stage replica runs it through the pipeline, every peer's report has the
    /// `val_curve`.
    #[arg(long, default_value = "0")]
    pub eval_every: u64,
    /// Held-out samples per evaluation.
    #[arg(long, default_value = "256", value_parser = positive)]
    pub eval_samples: usize,
    /// Start the run from this model file (safetensors, as `shoal export` writes, or Hugging
    /// Face's GPT-2 layout) instead of the seed's initialisation; its shape must be the
    /// preset's and every peer needs the same file.
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Codec of activations (fp32, fp16, bf16, int8[:BLOCK], int4[:BLOCK], int2[:BLOCK],
    /// topk:P%[:int8], ctopk:K/CHUNK:BITS), or two as LIGHT,STRONG: each hop sends the light
    /// one while its link keeps pace with the stage's device and the strong one otherwise;
    /// auto is int8,int4.
    #[arg(long, default_value = "auto")]
    pub activation_codec: shoal_protocol::HopCodec,
    /// Codec of activation gradients (as --activation-codec).
    #[arg(long, default_value = "auto")]
    pub gradient_codec: shoal_protocol::HopCodec,
    /// Codec of gradient / pseudo-gradient averaging between replicas.
    #[arg(long, default_value = "int8")]
    pub averaging_codec: shoal_protocol::Codec,
    /// The run to join (printed by the peer that created it); requires --bootstrap.
    #[arg(long, requires = "bootstrap")]
    pub run: Option<shoal_protocol::swarm::RunId>,
    /// Write this peer's stage state here every --checkpoint-every steps and on exit; a peer
    /// restarted with the same identity and directory resumes from it.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints.
    #[arg(long, default_value = "50", value_parser = positive)]
    pub checkpoint_every: usize,
    /// Write a JSON report here every --report-every seconds and on exit (its `status` says
    /// which: running, done, stopped or gave up).
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR/metrics, e.g. `127.0.0.1:9100` (port 0: any
    /// free port, printed at start). For the operator: bind it to localhost or a private
    /// network.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<std::net::SocketAddr>,
    /// Serve a live dashboard of the run at http://ADDR/ (the swarm by stage, loss and
    /// throughput curves, recent events), e.g. `127.0.0.1:8080`; it may share --metrics'
    /// address. For the operator: bind it to localhost or a private network.
    #[arg(long, value_name = "ADDR")]
    pub dashboard: Option<std::net::SocketAddr>,
    /// Seconds between the reports written while the peer runs, so one that crashes or is
    /// killed leaves one.
    #[arg(long, default_value = "15", value_parser = positive_f32)]
    pub report_every: f32,
    /// Serve this stage first instead of the one the run needs most (if this device's memory
    /// holds it); rebalancing may still move the peer later.
    #[arg(long)]
    pub stage: Option<u32>,
    /// Seconds between this peer's checks whether moving to another stage would raise the
    /// slowest stage's throughput by more than 25% (then it moves, after a random back-off).
    #[arg(long, default_value = "15", value_parser = positive_f32)]
    pub rebalance_every: f32,
    /// Give up (exit with an error, after writing the checkpoint and the report) when the run
    /// has made no step for this many seconds while some stage has no peer: the others left,
    /// or the run ended without this peer. 0 waits for new peers forever.
    #[arg(long, default_value = "300")]
    pub stall_timeout: f32,
    /// A joiner that learns nothing of the run from its bootstrap peers within this many
    /// seconds exits with an error saying what it tried (it asks again every 2 seconds
    /// meanwhile, and says so).
    #[arg(long, default_value = "60", value_parser = positive_f32)]
    pub join_timeout: f32,
    /// The fraction of the time this peer's device computes: after each job it rests for as
    /// long as the job took times (1 / F - 1), so a volunteer can lend part of a laptop or GPU.
    /// The peer measures, announces and is routed by the throughput it really gives.
    #[arg(long, default_value = "1", value_parser = fraction)]
    pub duty_cycle: f32,
    /// Keep only each block's input for the backward pass and compute the rest again there:
    /// less device memory for a block's forward pass more compute, same gradients.
    #[arg(long)]
    pub recompute: bool,
    /// Caps the upload that serving this stage's state to joining peers takes, in megabytes
    /// per second (chunks leave one after another at that rate); by default as fast as the
    /// link goes. Joiners pull from several replicas at once, so a capped one serves less.
    #[arg(long, value_parser = positive_f32)]
    pub state_upload_limit: Option<f32>,
    /// How this peer shares out work: weighted (replicas by throughput and queue, skipping
    /// stragglers; a driver's part of a step by its throughput) or uniform (every replica and
    /// driver alike, however slow).
    #[arg(long, default_value = "weighted")]
    pub routing: shoal_protocol::swarm::membership::Routing,
    /// Misbehave on purpose, to test the swarm's defences with real processes: sign-flip,
    /// scale:F, noise:SIGMA, zero, inflate:F, nan, ipm:EPS, alie[:Z], stale:K, label-flip,
    /// flip-backward, bad-part, bad-leader, lie-throughput, forge-hash, poison-catch-up or
    /// poison-state (test builds only: the `attacks` feature; `sybil:N` is the simulator's
    /// alone).
    #[cfg(feature = "attacks")]
    #[arg(long, default_value = "honest")]
    pub behavior: shoal_protocol::swarm::attack::Behavior,
    /// Honest until this many seconds after start.
    #[cfg(feature = "attacks")]
    #[arg(long, default_value = "0")]
    pub behavior_from: f64,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// The device memory a stage may use, e.g. `8GB` or `7.5GiB` (default: what the device
    /// reports: a CUDA device's memory, the host's for the CPU; wgpu cannot tell, so state it
    /// there). The swarm gives this peer only stages that fit, resident or, on a GPU with
    /// enough host memory, with the blocks that do not fit kept in host memory.
    #[arg(long, value_parser = bytes)]
    pub device_memory: Option<u64>,
    /// Caps the device memory this peer's stage holds, e.g. `2GB`, on any backend: the
    /// blocks that do not fit live in host memory and come to the device a block at a time
    /// (the same numbers, more time). The swarm counts this as the device's memory.
    #[arg(long, value_parser = bytes)]
    pub memory_limit: Option<u64>,
    /// The key file of this peer's identity (created on first run, owner-only).
    #[arg(long)]
    pub identity: Option<PathBuf>,
    /// Address to listen on (repeatable; default: QUIC on all interfaces, any port).
    #[arg(long)]
    pub listen: Vec<libp2p::Multiaddr>,
    /// A peer of the run to join through (repeatable).
    #[arg(long)]
    pub bootstrap: Vec<libp2p::Multiaddr>,
    /// Do not look for peers on the LAN with multicast DNS.
    #[arg(long)]
    pub no_mdns: bool,
    /// Accept private, loopback and link-local addresses from other peers (automatic when a
    /// listen or bootstrap address is one: the run is on a private network).
    #[arg(long)]
    pub allow_private: bool,
    /// Send tensors only over libp2p streams (no direct QUIC endpoint).
    #[arg(long)]
    pub no_direct: bool,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Time full training steps (forward, backward, AdamW).
    Compute(BenchComputeArgs),
    /// Measure the tensor codecs (speed on one core, size, error).
    Codec(BenchCodecArgs),
    /// Measure tensor transfer between two local nodes against plain quinn.
    Net(BenchNetArgs),
    /// Measure a part owner's robust mean (centered clipping) against a plain mean.
    RobustMean(BenchRobustMeanArgs),
    /// Average a vector among processes on this machine with the swarm's averaging round,
    /// checking every result.
    Average(BenchAverageArgs),
}

#[derive(Debug, Args)]
pub struct BenchAverageArgs {
    /// Processes averaging together, one member each.
    #[arg(long, default_value = "4", value_parser = positive)]
    pub peers: usize,
    /// Size of the averaged vector, in MiB of fp32 values.
    #[arg(long, default_value = "64", value_parser = positive)]
    pub mib: usize,
    /// Codec of the round's shares and averaged parts (as --averaging-codec of a run).
    #[arg(long, default_value = "fp32")]
    pub codec: shoal_protocol::Codec,
    /// Rounds, one after the other (the median time is reported).
    #[arg(long, default_value = "20", value_parser = positive)]
    pub rounds: usize,
    /// Seed of the members' contributions.
    #[arg(long, default_value = "1")]
    pub seed: u64,
    /// Print one JSON object instead of a sentence.
    #[arg(long)]
    pub json: bool,
    /// Run as member I of a bench this command started (internal).
    #[arg(long, hide = true)]
    pub member: Option<usize>,
}

#[derive(Debug, Args)]
pub struct BenchRobustMeanArgs {
    /// Members whose shares the owner reduces.
    #[arg(long, default_value = "6", value_parser = positive)]
    pub members: usize,
    /// Values in the part.
    #[arg(long, default_value = "1048576", value_parser = positive)]
    pub values: usize,
    /// Timed repetitions of each operation (the fastest is reported).
    #[arg(long, default_value = "5", value_parser = positive)]
    pub rounds: usize,
    /// Print one JSON object instead of a sentence.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BenchNetArgs {
    /// Size of each tensor frame, in MiB.
    #[arg(long, default_value = "64", value_parser = positive)]
    pub frame_mib: usize,
    /// Frames per measurement (16 x 64 MiB = 1 GiB).
    #[arg(long, default_value = "16", value_parser = positive)]
    pub frames: usize,
    /// Frames in flight at once.
    #[arg(long, default_value = "4", value_parser = positive)]
    pub in_flight: usize,
    /// Alternating rounds of both measurements (the best of each is reported).
    #[arg(long, default_value = "2", value_parser = positive)]
    pub rounds: usize,
    /// Print one JSON object instead of a sentence.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct BenchCodecArgs {
    /// Values in the test tensor (the memcpy baseline copies the same number of bytes).
    #[arg(long, default_value = "16777216", value_parser = positive)]
    pub values: usize,
    /// Timed repetitions of each operation (the fastest is reported).
    #[arg(long, default_value = "5", value_parser = positive)]
    pub rounds: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("'{s}' is not a positive whole number")),
    }
}

/// A size in bytes: a number with an optional unit, decimal (`kB`, `MB`, `GB`, `TB`) or
/// binary (`KiB`, `MiB`, `GiB`, `TiB`); the `B` may be left out (`8G`, `512Mi`).
pub(crate) fn bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let not_a_size = || format!("'{s}' is not a positive size such as 8GB or 512MiB");
    if number.is_empty() {
        return Err(not_a_size());
    }
    let scale: f64 = match unit.trim().to_ascii_lowercase().trim_end_matches('b') {
        "" => 1.0,
        "k" => 1e3,
        "m" => 1e6,
        "g" => 1e9,
        "t" => 1e12,
        "ki" => 1024.0,
        "mi" => 1024.0 * 1024.0,
        "gi" => 1024.0 * 1024.0 * 1024.0,
        "ti" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => {
            return Err(format!(
                "'{s}': unknown unit (use B, kB, MB, GB, TB, KiB, MiB, GiB)"
            ));
        }
    };
    match number.parse::<f64>() {
        Ok(x) if x > 0.0 && (x * scale).is_finite() && x * scale < u64::MAX as f64 => {
            Ok((x * scale).round() as u64)
        }
        _ => Err(not_a_size()),
    }
}

fn fraction(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(x) if x > 0.0 && x <= 1.0 => Ok(x),
        _ => Err(format!("'{s}' is not a fraction in (0, 1]")),
    }
}

fn positive_f32(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("'{s}' is not a positive number")),
    }
}

#[derive(Debug, Args)]
pub struct TrainArgs {
    /// Model size: nano, micro, mini or gpt2.
    #[arg(long, default_value = "nano")]
    pub preset: Preset,
    /// Number of pipeline stages the model is cut into.
    #[arg(long, default_value = "1", value_parser = positive)]
    pub stages: usize,
    /// Optimizer steps.
    #[arg(long, default_value = "600", value_parser = positive)]
    pub steps: usize,
    /// Samples (sequences) per optimizer step.
    #[arg(long, default_value = "16", value_parser = positive)]
    pub batch: usize,
    /// Samples per microbatch (default: the whole batch).
    #[arg(long, value_parser = positive)]
    pub microbatch: Option<usize>,
    /// Tokens per sample (default: the model's context).
    #[arg(long, value_parser = positive)]
    pub seq: Option<usize>,
    /// A UTF-8 text file to train on (default: the built-in synthetic corpus).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Held-out data to evaluate on (e.g. the `_val.bin` shard of `shoal data prepare`;
    /// default: samples of the synthetic corpus drawn apart from training's, or --data's own
    /// windows, which are not held out).
    #[arg(long)]
    pub val_data: Option<PathBuf>,
    /// Evaluate on the held-out data every N steps too (0: only at the end); the report's
    /// `val_curve`.
    #[arg(long, default_value = "0")]
    pub eval_every: usize,
    /// Seed of the model initialisation and of the data order.
    #[arg(long, default_value = "1")]
    pub seed: u64,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Peak learning rate (warmup then cosine decay to a tenth of it); default per preset.
    #[arg(long, value_parser = positive_f32)]
    pub lr: Option<f32>,
    /// How the stages share a step: `joint` (one model: tied embedding, one gradient-norm
    /// clip) or `per-stage` (as a swarm trains it: each stage clips its own gradient and
    /// trains its own copy of the tied embedding).
    #[arg(long, value_enum, default_value = "joint")]
    pub coupling: CouplingArg,
    /// Keep only each block's input for the backward pass and compute the rest again there:
    /// less device memory for a block's forward pass more compute, same gradients.
    #[arg(long)]
    pub recompute: bool,
    /// The most device memory each stage may hold, e.g. `60MB`: the transformer blocks'
    /// parameters and gradients then live in host memory and come to the device a block at
    /// a time, the optimizer steps on the host; same results, bit for bit on the CPU.
    #[arg(long, value_parser = bytes)]
    pub memory_limit: Option<u64>,
    /// Replicas training together, each on its share of every step's batch and its own data
    /// shard, agreeing as a swarm's replicas do (see --sync). With more than one replica, a
    /// DiLoCo sync or any codec other than fp32, training follows the swarm's arithmetic
    /// (per-stage coupling, the swarm's averaging round) and the report counts the bytes sent.
    #[arg(long, default_value = "1", value_parser = positive)]
    pub replicas: usize,
    /// How replicas stay together: allreduce (every step) or diloco.
    #[arg(long, default_value = "allreduce")]
    pub sync: shoal_protocol::swarm::SyncMode,
    #[command(flatten)]
    pub diloco: DiLoCoArgs,
    /// Codec of activations between stages (fp32, fp16, bf16, int8, int8:BLOCK, topk:P%[:int8],
    /// ctopk:K/CHUNK:BITS).
    #[arg(long, default_value = "fp32")]
    pub activation_codec: shoal_protocol::Codec,
    /// Codec of activation gradients between stages.
    #[arg(long, default_value = "fp32")]
    pub gradient_codec: shoal_protocol::Codec,
    /// Codec of the averaging between replicas (gradients in allreduce, pseudo-gradients in
    /// DiLoCo).
    #[arg(long, default_value = "fp32")]
    pub averaging_codec: shoal_protocol::Codec,
    /// Send activations and their gradients as their coordinates in the K principal
    /// directions of the activations that crossed each stage boundary (tracked by the sending
    /// stage, refined every 10 steps, each basis counted as sent), coded with the boundary
    /// codecs. Measured here only: swarm peers do not send bases.
    #[arg(long, value_name = "K")]
    pub principal_subspace: Option<usize>,
    /// Write a JSON report here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Start from this model file (safetensors, as `--export` and `shoal export` write, or
    /// Hugging Face's GPT-2 layout) instead of the seed's initialisation; its shape must be
    /// the preset's.
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Write the trained model here (safetensors with Hugging Face GPT-2 names and layout,
    /// config.json beside it).
    #[arg(long)]
    pub export: Option<PathBuf>,
}

/// `--coupling` values.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum CouplingArg {
    /// One model, exactly.
    Joint,
    /// As a swarm trains it.
    PerStage,
}

impl From<CouplingArg> for shoal_compute::Coupling {
    fn from(c: CouplingArg) -> Self {
        match c {
            CouplingArg::Joint => shoal_compute::Coupling::Joint,
            CouplingArg::PerStage => shoal_compute::Coupling::PerStage,
        }
    }
}

#[derive(Debug, Args)]
pub struct BenchComputeArgs {
    /// Model size: nano, micro, mini or gpt2.
    #[arg(long, default_value = "micro")]
    pub preset: Preset,
    /// Samples per step.
    #[arg(long, default_value = "8", value_parser = positive)]
    pub batch: usize,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Timed steps (the median is reported).
    #[arg(long, default_value = "10", value_parser = positive)]
    pub steps: usize,
    /// Untimed warm-up steps.
    #[arg(long, default_value = "3")]
    pub warmup: usize,
    /// Tokens per sample (default: the model's context).
    #[arg(long, value_parser = positive)]
    pub seq: Option<usize>,
    /// Print one JSON object instead of a sentence.
    #[arg(long)]
    pub json: bool,
}

/// DiLoCo's settings, for `--sync diloco`.
#[derive(Debug, Args)]
pub struct DiLoCoArgs {
    /// DiLoCo: local steps per outer round.
    #[arg(long = "diloco-h", default_value = "8", value_parser = positive)]
    pub h: usize,
    /// DiLoCo: the outer step's learning rate (the paper's 0.7).
    #[arg(long, default_value = "0.7")]
    pub outer_lr: f32,
    /// DiLoCo: the outer step's Nesterov momentum, in [0, 1) (the paper's 0.9).
    #[arg(long, default_value = "0.9")]
    pub outer_momentum: f32,
    /// DiLoCo: decay per round of the error feedback of compressed pseudo-gradients, in
    /// (0, 1] (1: plain error feedback; SparseLoCo's 0.95 with a sparse --averaging-codec).
    #[arg(long, default_value = "1.0")]
    pub feedback_decay: f32,
}

impl DiLoCoArgs {
    /// `sync` with these settings (and them checked) where it is DiLoCo.
    pub fn sync_mode(
        &self,
        sync: shoal_protocol::swarm::SyncMode,
    ) -> anyhow::Result<shoal_protocol::swarm::SyncMode> {
        use shoal_protocol::swarm::SyncMode;
        let sync = match sync {
            SyncMode::AllReduce => SyncMode::AllReduce,
            SyncMode::DiLoCo { .. } => SyncMode::DiLoCo {
                h: self.h as u32,
                outer_lr: self.outer_lr,
                outer_momentum: self.outer_momentum,
                feedback_decay: self.feedback_decay,
            },
        };
        sync.validate().map_err(|e| {
            anyhow::anyhow!("{e} (--diloco-h, --outer-lr, --outer-momentum, --feedback-decay)")
        })?;
        Ok(sync)
    }
}

#[cfg(test)]
mod tests {
    use super::bytes;

    #[test]
    fn sizes_parse_in_decimal_and_binary_units() {
        assert_eq!(bytes("8GB"), Ok(8_000_000_000));
        assert_eq!(bytes("8g"), Ok(8_000_000_000));
        assert_eq!(
            bytes("7.5GiB"),
            Ok(7.5 * (1u64 << 30) as f64).map(|x| x as u64)
        );
        assert_eq!(bytes("512Mi"), Ok(512 << 20));
        assert_eq!(bytes("1000"), Ok(1000));
        assert_eq!(bytes(" 2 kB "), Ok(2000));
        for bad in ["", "GB", "0", "-1GB", "8XB", "1e400", "NaN"] {
            assert!(bytes(bad).is_err(), "{bad}");
        }
    }
}
