//! `shoal train`: every stage in this process.

use crate::cli::TrainArgs;
use crate::report;
use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use shoal_compute::data::TextCorpus;
use shoal_compute::{AdamW, Corpus, DataLoader, LocalPipeline, LrSchedule, Shard, StageSpec};
use std::sync::Arc;
use std::time::Instant;

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
    /// Best achievable loss at this sequence length (known for the synthetic corpus only).
    pub loss_floor: Option<f64>,
    /// Loss of the best model that ignores context (synthetic corpus only).
    pub unigram_entropy: Option<f64>,
    pub tokens_per_s: f64,
    pub seconds: f64,
    pub loss_curve: Vec<(usize, f64)>,
}

pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let config = args.preset.config();
    let seq = args.seq.unwrap_or(config.context);
    StageSpec::check_pipeline(&config, args.stages, seq)
        .with_context(|| format!("--stages {} --seq {seq}", args.stages))?;
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
    let unigram = match &corpus {
        Corpus::Synthetic(m) => Some(m.unigram_entropy()),
        Corpus::Text(_) => None,
    };
    let loss_floor = corpus.loss_floor(seq);
    let data_name = corpus.describe();
    let mut loader = DataLoader::new(corpus, args.seed, Shard::ALL, seq)?;
    let backend = Arc::new(args.device.open()?);
    let schedule = LrSchedule::for_steps(
        args.lr.unwrap_or(args.preset.default_lr()),
        args.steps as u64,
    );
    let mut pipeline = LocalPipeline::new(
        backend.clone(),
        config,
        args.stages,
        args.seed,
        AdamW::default(),
        schedule,
    )?;
    pipeline.set_coupling(args.coupling.into());
    let params = pipeline.param_count();
    let microbatch = args.microbatch.unwrap_or(args.batch).min(args.batch);
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

    let bar = ProgressBar::new(args.steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  [{elapsed} < {eta}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let start = Instant::now();
    let mut loss_curve = Vec::with_capacity(args.steps);
    let mut tokens = 0u64;
    for step in 0..args.steps {
        let batch = loader.next_batch(args.batch);
        let stats = pipeline.train_step(&batch, microbatch)?;
        if !stats.loss.is_finite() {
            bar.abandon();
            bail!(
                "loss diverged to {} at step {step}; try a smaller --lr",
                stats.loss
            );
        }
        tokens += (args.batch * seq) as u64;
        loss_curve.push((step + 1, stats.loss as f64));
        let rate = tokens as f64 / start.elapsed().as_secs_f64().max(1e-9);
        bar.set_message(format!("loss {:.4}  {:.0} tok/s", stats.loss, rate));
        bar.inc(1);
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

    println!(
        "done: {} steps, {} tokens in {:.1} s ({:.0} tokens/s)",
        args.steps, tokens, seconds, tokens_per_s
    );
    println!(
        "loss: {:.4} at the start, {:.4} at the end (mean of the last {window} steps)",
        loss_curve[0].1, final_loss
    );
    if let (Some(floor), Some(unigram)) = (loss_floor, unigram) {
        println!(
            "      the corpus's floor is {floor:.4} (best possible) and its unigram entropy {unigram:.4} \
             (best without context): {:.4} nats above the floor",
            final_loss - floor
        );
    }
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
            loss_floor,
            unigram_entropy: unigram,
            tokens_per_s,
            seconds,
            loss_curve,
        };
        report::write_json(path, &report)?;
        println!("report: {}", path.display());
    }
    Ok(())
}
