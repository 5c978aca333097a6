//! `shoal train`: every stage in this process.

use crate::cli::TrainArgs;
use crate::report;
use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use shoal_compute::data::TextCorpus;
use shoal_compute::{
    AdamW, AnyBackend, Corpus, DataLoader, LocalPipeline, LrSchedule, MemoryUse, OffloadTraffic,
    Shard, StageSpec,
};
use shoal_protocol::Codec;
use shoal_protocol::swarm::SyncMode;
use std::sync::Arc;
use std::time::Instant;

mod principal;
mod replicas;

use replicas::{Projection, Replicas, Settings, Traffic};

/// The JSON report of a training run.
#[derive(Debug, Serialize)]
pub struct TrainReport {
    pub preset: String,
    pub backend: String,
    pub stages: usize,
    pub params: usize,
    pub steps: usize,
    pub batch: usize,
    pub seq: usize,
    pub tokens: u64,
    pub data: String,
    /// Mean training loss over the last `final_loss_window` steps (every sample is fresh, so
    /// this is an unbiased estimate of the loss on unseen data for the synthetic corpus).
    pub final_loss: f64,
    pub final_loss_window: usize,
    /// Mean loss of the trained model on held-out samples ([`HELD_OUT_SAMPLES`] drawn with
    /// their own seed), after the last step: the figure to compare runs by, less noisy than
    /// the training loss. With replicas, replica 0's model (in DiLoCo the one every replica
    /// agreed on when the steps are a multiple of H).
    pub held_out_loss: f64,
    /// Best achievable loss at this sequence length (known for the synthetic corpus only).
    pub loss_floor: Option<f64>,
    /// Loss of the best model that ignores context (synthetic corpus only).
    pub unigram_entropy: Option<f64>,
    pub tokens_per_s: f64,
    pub seconds: f64,
    pub loss_curve: Vec<(usize, f64)>,
    /// `[step, held-out loss]` every `--eval-every` steps and at the end.
    pub val_curve: Vec<(usize, f64)>,
    /// `[seconds, tokens]` after each step.
    pub tokens_curve: Vec<(f64, u64)>,
    /// The most device memory each stage held (bytes; with replicas, replica 0's stages),
    /// and by kind at that moment.
    pub device_memory_peak_bytes: Vec<u64>,
    pub device_memory_peak: Vec<MemoryUse>,
    /// `--memory-limit`, and the bytes each stage moved between host and device under it
    /// (parameters and gradients of offloaded blocks, both ways).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_limit_bytes: Option<u64>,
    pub offloaded_bytes: Vec<u64>,
    /// Replicas, and how they were kept together and what they sent (`--replicas`, `--sync`
    /// and the codecs; absent for one model trained alone).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub swarm: Option<SwarmReport>,
}

/// What `shoal train` trained as a swarm would.
#[derive(Debug, Serialize)]
pub struct SwarmReport {
    pub replicas: usize,
    pub sync: String,
    pub activation_codec: String,
    pub gradient_codec: String,
    pub averaging_codec: String,
    /// `--principal-subspace`: directions kept at each boundary.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub principal_subspace: Option<usize>,
    /// Bytes sent by traffic kind (encoded, as the swarm sends them) and the same in fp32.
    pub bytes: std::collections::BTreeMap<&'static str, u64>,
    pub fp32_bytes: std::collections::BTreeMap<&'static str, u64>,
}

/// Samples of the held-out evaluation.
pub const HELD_OUT_SAMPLES: usize = 256;
/// Its data seed's offset from the run's, so that no run trains on its own held-out samples.
const HELD_OUT_SEED: u64 = 0x0004_e1d0;

/// One model alone, or replicas of it trained as a swarm would.
enum Trainer {
    Alone {
        pipeline: LocalPipeline<AnyBackend>,
        loader: DataLoader,
        microbatch: usize,
    },
    Swarm(Box<Replicas>),
}

impl Trainer {
    fn step(&mut self, batch: usize) -> anyhow::Result<f32> {
        match self {
            Trainer::Alone {
                pipeline,
                loader,
                microbatch,
            } => Ok(pipeline
                .train_step(&loader.next_batch(batch), *microbatch)?
                .loss),
            Trainer::Swarm(replicas) => replicas.step(),
        }
    }

    fn pipeline(&mut self) -> &mut LocalPipeline<AnyBackend> {
        match self {
            Trainer::Alone { pipeline, .. } => pipeline,
            Trainer::Swarm(r) => r.first_pipeline(),
        }
    }

    /// What the evaluated model goes through at its boundaries.
    fn projection(&self, codec: Codec) -> Projection {
        match self {
            Trainer::Alone { .. } => Projection {
                codec,
                subspaces: Vec::new(),
            },
            Trainer::Swarm(r) => r.projection(),
        }
    }

    fn param_count(&self) -> usize {
        match self {
            Trainer::Alone { pipeline, .. } => pipeline.param_count(),
            Trainer::Swarm(r) => r.param_count(),
        }
    }
}

pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let corpus = match &args.data {
        Some(path) => {
            let text = TextCorpus::open(path)?;
            if text.is_empty() {
                bail!("data file {} is empty", path.display());
            }
            Corpus::Text(text)
        }
        None => Corpus::synthetic(args.seed),
    };
    // A model's vocabulary follows its data's tokenizer.
    let config = shoal_compute::ModelConfig {
        vocab: corpus.vocab(),
        ..args.preset.config()
    };
    let seq = args.seq.unwrap_or(config.context);
    StageSpec::check_pipeline(&config, args.stages, seq)
        .with_context(|| format!("--stages {} --seq {seq}", args.stages))?;
    corpus.check_seq(seq)?;
    let held_out_corpus = match &args.val_data {
        Some(path) => {
            let val = TextCorpus::open(path)?;
            if val.vocab() != corpus.vocab() {
                bail!(
                    "--val-data {} holds tokens of a vocabulary of {}, --data's is {}",
                    path.display(),
                    val.vocab(),
                    corpus.vocab()
                );
            }
            let val = Corpus::Text(val);
            val.check_seq(seq)?;
            val
        }
        None => corpus.clone(),
    };
    // The same held-out samples each time it is asked.
    let held_out = || {
        DataLoader::new(
            held_out_corpus.clone(),
            args.seed.wrapping_add(HELD_OUT_SEED),
            Shard::ALL,
            seq,
        )
    };
    held_out()?;
    let unigram = match &corpus {
        Corpus::Synthetic(m) => Some(m.unigram_entropy()),
        Corpus::Text(_) => None,
    };
    let loss_floor = corpus.loss_floor(seq);
    let data_name = corpus.describe();
    let backend = Arc::new(args.device.open()?);
    let schedule = LrSchedule::for_steps(
        args.lr.unwrap_or(args.preset.default_lr()),
        args.steps as u64,
    );
    let sync = args.diloco.sync_mode(args.sync)?;
    args.averaging_codec
        .validate_for_averaging()
        .map_err(|e| anyhow::anyhow!("--averaging-codec: {e}"))?;
    shoal_protocol::HopCodec::check_projections(
        &shoal_protocol::HopCodec::fixed(args.activation_codec),
        &shoal_protocol::HopCodec::fixed(args.gradient_codec),
    )
    .map_err(anyhow::Error::msg)?;
    if args.principal_subspace.is_some()
        && [args.activation_codec, args.gradient_codec]
            .iter()
            .any(|c| matches!(c, Codec::Subspace { .. }))
    {
        bail!(
            "--principal-subspace projects the boundaries itself: give plain codecs (int4, not sub:F:int4)"
        );
    }
    let microbatch = args.microbatch.unwrap_or(args.batch).min(args.batch);
    let as_swarm = args.replicas > 1
        || sync != SyncMode::AllReduce
        || [
            args.activation_codec,
            args.gradient_codec,
            args.averaging_codec,
        ]
        .iter()
        .any(|c| *c != Codec::Fp32)
        || args.principal_subspace.is_some();
    let init = args
        .init
        .as_deref()
        .map(crate::model_file::ModelFile::open)
        .transpose()?;
    let pipeline = || -> anyhow::Result<LocalPipeline<AnyBackend>> {
        let mut p = LocalPipeline::with_memory_limit(
            backend.clone(),
            config,
            args.stages,
            args.seed,
            AdamW::default(),
            schedule,
            args.memory_limit,
        )?;
        p.set_recompute(args.recompute)?;
        if let (Some(file), Some(path)) = (&init, &args.init) {
            for stage in p.stages_mut() {
                file.load_into(stage)
                    .with_context(|| format!("--init {}", path.display()))?;
            }
        }
        Ok(p)
    };
    if args.replicas > args.batch {
        bail!(
            "--replicas {} is more than --batch {}: every replica needs a sample of each step",
            args.replicas,
            args.batch
        );
    }
    let mut trainer = if as_swarm {
        let mut pipelines = Vec::with_capacity(args.replicas);
        let mut shards = Vec::with_capacity(args.replicas);
        for r in 0..args.replicas {
            pipelines.push(pipeline()?);
            let shard = Shard::new(r as u64, args.replicas as u64)?;
            shards.push(DataLoader::new(corpus.clone(), args.seed, shard, seq)?);
        }
        let settings = Settings {
            replicas: args.replicas,
            sync,
            batch: args.batch,
            microbatch,
            activation_codec: args.activation_codec,
            gradient_codec: args.gradient_codec,
            averaging_codec: args.averaging_codec,
            principal_subspace: args.principal_subspace.map(|k| (k, config.width)),
        };
        Trainer::Swarm(Box::new(Replicas::new(pipelines, shards, settings)?))
    } else {
        let mut pipeline = pipeline()?;
        pipeline.set_coupling(args.coupling.into());
        Trainer::Alone {
            pipeline,
            loader: DataLoader::new(corpus, args.seed, Shard::ALL, seq)?,
            microbatch,
        }
    };
    let params = trainer.param_count();
    println!(
        "shoal train: {} ({} parameters) in {} stage(s) on {}, {} steps of {} x {} tokens, data: {}",
        args.preset,
        params,
        args.stages,
        shoal_compute::Backend::name(&*backend),
        args.steps,
        args.batch,
        seq,
        data_name
    );
    if as_swarm {
        println!(
            "as a swarm: {} replica(s), {sync} sync; codecs: activations {}, activation gradients {}, averaging {} (each stage clips its own gradient)",
            args.replicas, args.activation_codec, args.gradient_codec, args.averaging_codec
        );
    }

    let bar = ProgressBar::new(args.steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  [{elapsed} < {eta}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let start = Instant::now();
    let mut loss_curve = Vec::with_capacity(args.steps);
    let mut tokens_curve = vec![(0.0, 0)];
    let mut tokens = 0u64;
    let mut val_curve = Vec::new();
    // Batches no larger than the training's microbatches (what a memory limit was set for),
    // a power of two so they divide the held-out samples.
    let eval_batch = 1 << microbatch.clamp(1, 32).ilog2();
    let evaluate = |trainer: &mut Trainer| -> anyhow::Result<f64> {
        let mut loader = held_out()?;
        let mut sum = 0.0;
        let mut projection = trainer.projection(args.activation_codec);
        for _ in 0..HELD_OUT_SAMPLES / eval_batch {
            sum += f64::from(
                trainer
                    .pipeline()
                    .evaluate_via(&loader.next_batch(eval_batch), &mut projection)?,
            );
        }
        Ok(sum / (HELD_OUT_SAMPLES / eval_batch) as f64)
    };
    for step in 0..args.steps {
        let loss = trainer.step(args.batch)?;
        if !loss.is_finite() {
            bar.abandon();
            bail!("loss diverged to {loss} at step {step}; try a smaller --lr");
        }
        tokens += (args.batch * seq) as u64;
        loss_curve.push((step + 1, loss as f64));
        tokens_curve.push((start.elapsed().as_secs_f64(), tokens));
        let rate = tokens as f64 / start.elapsed().as_secs_f64().max(1e-9);
        bar.set_message(format!("loss {loss:.4}  {rate:.0} tok/s"));
        bar.inc(1);
        if args.eval_every > 0 && (step + 1) % args.eval_every == 0 && step + 1 < args.steps {
            let v = evaluate(&mut trainer)?;
            // Printed whether or not the bar is drawn (it is not, off a terminal).
            bar.suspend(|| println!("step {}: held-out loss {v:.4}", step + 1));
            val_curve.push((step + 1, v));
        }
    }
    bar.finish_and_clear();
    let seconds = start.elapsed().as_secs_f64();
    let window = (args.steps / 10).clamp(1, 10);
    let final_loss = loss_curve[loss_curve.len() - window..]
        .iter()
        .map(|(_, l)| l)
        .sum::<f64>()
        / window as f64;
    let tokens_per_s = tokens as f64 / seconds.max(1e-9);
    // Training's peak, before the held-out evaluation allocates for its larger batches.
    let memory: Vec<MemoryUse> = trainer
        .pipeline()
        .stages()
        .iter()
        .map(|s| s.memory().peak)
        .collect();
    let offloaded: Vec<OffloadTraffic> = trainer
        .pipeline()
        .stages()
        .iter()
        .map(|s| s.offload_traffic())
        .collect();
    if let Some(path) = &args.export {
        let mut tensors = Vec::new();
        for stage in trainer.pipeline().stages() {
            tensors.extend(crate::model_file::stage_tensors(stage)?);
        }
        crate::model_file::write(path, &config, &tensors)?;
        println!("model: {} (config.json beside it)", path.display());
    }
    let held_out_loss = evaluate(&mut trainer)?;
    val_curve.push((args.steps, held_out_loss));

    println!(
        "done: {} steps, {} tokens in {:.1} s ({:.0} tokens/s)",
        args.steps, tokens, seconds, tokens_per_s
    );
    println!(
        "loss: {:.4} at the start, {:.4} at the end (mean of the last {window} steps)",
        loss_curve[0].1, final_loss
    );
    println!(
        "      held-out loss {held_out_loss:.4} ({HELD_OUT_SAMPLES} {} samples)",
        match (&args.val_data, unigram) {
            (Some(_), _) => "--val-data",
            (None, Some(_)) => "unseen",
            // A text's windows are the same whatever the seed.
            (None, None) => "training (not held out: --val-data names held-out text)",
        }
    );
    if let (Some(floor), Some(unigram)) = (loss_floor, unigram) {
        println!(
            "      the corpus's floor is {floor:.4} (best possible) and its unigram entropy {unigram:.4} \
             (best without context): {:.4} nats above the floor",
            final_loss - floor
        );
    }
    println!(
        "device memory at its peak, by stage: {}{}",
        memory
            .iter()
            .map(|m| report::size(m.total()))
            .collect::<Vec<_>>()
            .join(", "),
        args.memory_limit
            .map(|l| format!(" (limit {})", report::size(l)))
            .unwrap_or_default()
    );
    if args.memory_limit.is_some() {
        println!(
            "offloaded blocks moved, by stage: {}",
            offloaded
                .iter()
                .map(|t| format!(
                    "{} to the device, {} back",
                    report::size(t.uploaded),
                    report::size(t.downloaded)
                ))
                .collect::<Vec<_>>()
                .join("; ")
        );
    }
    let swarm = match &trainer {
        Trainer::Swarm(r) => {
            let Traffic { bytes, fp32_bytes } = r.traffic();
            for (kind, sent) in &bytes {
                let raw = fp32_bytes.get(kind).copied().unwrap_or(0);
                if raw == 0 {
                    println!("sent: {kind} {:.1} MB", *sent as f64 / 1e6);
                    continue;
                }
                println!(
                    "sent: {kind} {:.1} MB ({:.1}x fewer bytes than fp32)",
                    *sent as f64 / 1e6,
                    raw as f64 / (*sent).max(1) as f64
                );
            }
            if let Some(basis) = bytes.get("basis") {
                let kinds = ["activations", "activation_grads"];
                let sent: u64 = kinds.iter().filter_map(|k| bytes.get(k)).sum::<u64>() + basis;
                let raw: u64 = kinds.iter().filter_map(|k| fp32_bytes.get(k)).sum();
                println!(
                    "between stages, bases included: {:.1} MB ({:.1}x fewer bytes than fp32)",
                    sent as f64 / 1e6,
                    raw as f64 / sent.max(1) as f64
                );
            }
            Some(SwarmReport {
                replicas: args.replicas,
                sync: sync.to_string(),
                activation_codec: args.activation_codec.to_string(),
                gradient_codec: args.gradient_codec.to_string(),
                averaging_codec: args.averaging_codec.to_string(),
                principal_subspace: args.principal_subspace,
                bytes,
                fp32_bytes,
            })
        }
        Trainer::Alone { .. } => None,
    };
    if let Some(path) = &args.report {
        let report = TrainReport {
            preset: args.preset.to_string(),
            backend: shoal_compute::Backend::name(&*backend),
            stages: args.stages,
            params,
            steps: args.steps,
            batch: args.batch,
            seq,
            tokens,
            data: data_name,
            final_loss,
            final_loss_window: window,
            held_out_loss,
            loss_floor,
            unigram_entropy: unigram,
            tokens_per_s,
            seconds,
            loss_curve,
            tokens_curve,
            val_curve,
            device_memory_peak_bytes: memory.iter().map(MemoryUse::total).collect(),
            device_memory_peak: memory,
            memory_limit_bytes: args.memory_limit,
            offloaded_bytes: offloaded
                .iter()
                .map(|t| t.uploaded + t.downloaded)
                .collect(),
            swarm,
        };
        report::write_json(path, &report)?;
        println!("report: {}", path.display());
    }
    Ok(())
}
