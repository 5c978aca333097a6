//! `shoal bench`: performance measurements printed as JSON for tools and as a sentence for
//! people.

use crate::cli::BenchComputeArgs;
use serde::Serialize;
use shoal_compute::{
    AdamW, Backend, Corpus, CpuBackend, DataLoader, LocalPipeline, LrSchedule, Shard,
};
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, Serialize)]
struct ComputeBench {
    preset: String,
    backend: String,
    threads: usize,
    batch: usize,
    context: usize,
    seq: usize,
    params: usize,
    steps: usize,
    step_ms_median: f64,
    step_ms_min: f64,
    tokens_per_s: f64,
    /// Model FLOPs per second: 6 per weight per token plus attention (see
    /// `ModelConfig::train_flops_per_token`).
    gflops: f64,
}

pub fn compute(args: BenchComputeArgs) -> anyhow::Result<()> {
    let config = args.preset.config();
    let seq = args.seq.unwrap_or(config.context).min(config.context);
    let backend = Arc::new(CpuBackend::new(args.threads)?);
    let mut pipeline = LocalPipeline::new(
        backend.clone(),
        config,
        1,
        1,
        AdamW::default(),
        LrSchedule::for_steps(3e-4, (args.warmup + args.steps) as u64),
    )?;
    let mut loader = DataLoader::new(Corpus::synthetic(1), 1, Shard::ALL, seq)?;
    let mut times = Vec::with_capacity(args.steps);
    for i in 0..args.warmup + args.steps {
        let batch = loader.next_batch(args.batch);
        let start = Instant::now();
        pipeline.train_step(&batch, args.batch)?;
        if i >= args.warmup {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    let median = if times.len() % 2 == 1 {
        times[times.len() / 2]
    } else {
        (times[times.len() / 2 - 1] + times[times.len() / 2]) / 2.0
    };
    let tokens = (args.batch * seq) as f64;
    let result = ComputeBench {
        preset: args.preset.to_string(),
        backend: "cpu".into(),
        threads: backend.threads(),
        batch: args.batch,
        context: config.context,
        seq,
        params: config.params(),
        steps: args.steps,
        step_ms_median: median,
        step_ms_min: times[0],
        tokens_per_s: tokens / (median / 1e3),
        gflops: config.train_flops_per_token(seq) * tokens / (median / 1e3) / 1e9,
    };
    if args.json {
        println!("{}", serde_json::to_string(&result)?);
    } else {
        println!(
            "{} batch {} x {} on {}: {:.1} ms/step median ({:.1} min), {:.0} tokens/s, {:.1} GFLOP/s",
            result.preset,
            result.batch,
            seq,
            backend.name(),
            result.step_ms_median,
            result.step_ms_min,
            result.tokens_per_s,
            result.gflops
        );
    }
    Ok(())
}
