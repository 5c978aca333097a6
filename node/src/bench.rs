//! `shoal bench`: performance measurements printed as JSON for tools and as a sentence for
//! people.

use crate::cli::{BenchCodecArgs, BenchComputeArgs, BenchRobustMeanArgs};
use serde::Serialize;
use shoal_compute::{
    AdamW, AnyBackend, Backend, Corpus, DataLoader, LocalPipeline, LrSchedule, Preset, Shard,
};
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, Serialize)]
pub struct ComputeBench {
    preset: String,
    pub backend: String,
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
    pub gflops: f64,
}

/// Times `steps` training steps (after `warmup` untimed ones) of the whole `preset` model on
/// `backend`, `batch` samples of `seq` tokens each.
pub fn measure(
    backend: Arc<AnyBackend>,
    preset: Preset,
    batch: usize,
    seq: Option<usize>,
    warmup: usize,
    steps: usize,
) -> anyhow::Result<ComputeBench> {
    let config = preset.config();
    let seq = seq.unwrap_or(config.context).min(config.context);
    let mut pipeline = LocalPipeline::new(
        backend.clone(),
        config,
        1,
        1,
        AdamW::default(),
        LrSchedule::for_steps(3e-4, (warmup + steps) as u64),
    )?;
    let mut loader = DataLoader::new(Corpus::synthetic(1), 1, Shard::ALL, seq)?;
    let mut times = Vec::with_capacity(steps);
    for i in 0..warmup + steps {
        let data = loader.next_batch(batch);
        let start = Instant::now();
        // What a step leaves queued on a GPU (the optimizer update) runs before the next
        // step's first read-back, so in steady state each timed step pays for one step.
        pipeline.train_step(&data, batch)?;
        if i >= warmup {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    let median = if times.len() % 2 == 1 {
        times[times.len() / 2]
    } else {
        (times[times.len() / 2 - 1] + times[times.len() / 2]) / 2.0
    };
    let tokens = (batch * seq) as f64;
    Ok(ComputeBench {
        preset: preset.to_string(),
        backend: backend.name(),
        batch,
        context: config.context,
        seq,
        params: config.params(),
        steps,
        step_ms_median: median,
        step_ms_min: times[0],
        tokens_per_s: tokens / (median / 1e3),
        gflops: config.train_flops_per_token(seq) * tokens / (median / 1e3) / 1e9,
    })
}

pub fn compute(args: BenchComputeArgs) -> anyhow::Result<()> {
    let backend = Arc::new(args.device.open()?);
    let result = measure(
        backend,
        args.preset,
        args.batch,
        args.seq,
        args.warmup,
        args.steps,
    )?;
    if args.json {
        println!("{}", serde_json::to_string(&result)?);
    } else {
        println!(
            "{} batch {} x {} on {}: {:.1} ms/step median ({:.1} min), {:.0} tokens/s, {:.1} GFLOP/s",
            result.preset,
            result.batch,
            result.seq,
            result.backend,
            result.step_ms_median,
            result.step_ms_min,
            result.tokens_per_s,
            result.gflops
        );
    }
    Ok(())
}

#[derive(Debug, Serialize)]
struct CodecFigures {
    /// Input bytes (fp32) encoded per second, one thread.
    encode_gbps: f64,
    /// Input-equivalent bytes (fp32) decoded per second, one thread.
    decode_gbps: f64,
    /// Values encoded per second, in millions.
    encode_mvalues_s: f64,
    /// fp32 bytes / encoded bytes (header included).
    ratio: f64,
    max_abs_error: f64,
    rms_error: f64,
    /// Top-k only: bytes of the delta-coded index stream before and after zstd.
    #[serde(skip_serializing_if = "Option::is_none")]
    index_bytes: Option<(u32, u32)>,
}

#[derive(Debug, Serialize)]
struct CodecBench {
    values: usize,
    /// Input distribution of the test tensor.
    data: &'static str,
    /// One-thread copy of the same number of bytes, for scale.
    memcpy_gbps: f64,
    codecs: std::collections::BTreeMap<String, CodecFigures>,
}

/// The fastest of `rounds` runs of `f`, in seconds.
fn fastest(rounds: usize, mut f: impl FnMut()) -> f64 {
    (0..rounds)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

pub fn codec(args: BenchCodecArgs) -> anyhow::Result<()> {
    use shoal_protocol::{Codec, Decoder, Encoder, ValueFormat};
    let n = args.values;
    // Gaussian values with a few large outliers, like activations and gradients.
    let mut rng = shoal_compute::rng::Rng::new(1);
    let input: Vec<f32> = (0..n)
        .map(|i| {
            let v = rng.normal() as f32;
            if i % 997 == 0 { v * 20.0 } else { v }
        })
        .collect();
    let bytes = 4.0 * n as f64;
    let mut copy = vec![0f32; n];
    let memcpy = fastest(args.rounds, || {
        copy.copy_from_slice(std::hint::black_box(&input))
    });
    let memcpy_gbps = bytes / memcpy / 1e9;

    let codecs = [
        Codec::Fp32,
        Codec::Fp16,
        Codec::Bf16,
        Codec::Int8 { block: 32 },
        Codec::Int8 { block: 64 },
        Codec::Int8 { block: 128 },
        Codec::Int8 { block: 256 },
        Codec::LowBit { bits: 4, block: 64 },
        Codec::LowBit { bits: 3, block: 64 },
        Codec::LowBit { bits: 2, block: 64 },
        Codec::Subspace {
            fold: 1,
            bits: 4,
            block: 64,
        },
        Codec::Subspace {
            fold: 2,
            bits: 4,
            block: 64,
        },
        Codec::Subspace {
            fold: 4,
            bits: 4,
            block: 64,
        },
        Codec::TopK {
            ppm: 10_000,
            values: ValueFormat::Fp16,
        },
        Codec::TopK {
            ppm: 10_000,
            values: ValueFormat::Int8,
        },
        Codec::TopK {
            ppm: 1_000,
            values: ValueFormat::Fp16,
        },
        Codec::ChunkTopK {
            k: 256,
            chunk: 4096,
            bits: 2,
        },
        Codec::ChunkTopK {
            k: 64,
            chunk: 4096,
            bits: 2,
        },
        Codec::ChunkTopK {
            k: 32,
            chunk: 4096,
            bits: 2,
        },
    ];
    let mut encoder = Encoder::new();
    let mut decoder = Decoder::new();
    let mut encoded = Vec::new();
    let mut decoded = Vec::new();
    let mut results = std::collections::BTreeMap::new();
    for codec in codecs {
        let enc = fastest(args.rounds, || {
            encoder
                .encode(codec, std::hint::black_box(&input), &[n], &mut encoded)
                .map(|_| ())
                .unwrap_or(())
        });
        encoder.encode(codec, &input, &[n], &mut encoded)?;
        let dec = fastest(args.rounds, || {
            decoder
                .decode(std::hint::black_box(&encoded), &mut decoded)
                .map(|_| ())
                .unwrap_or(())
        });
        decoder.decode(&encoded, &mut decoded)?;
        let (mut max_err, mut sq) = (0f64, 0f64);
        for (a, b) in input.iter().zip(&decoded) {
            let e = (*a as f64 - *b as f64).abs();
            max_err = max_err.max(e);
            sq += e * e;
        }
        results.insert(
            codec.to_string(),
            CodecFigures {
                encode_gbps: bytes / enc / 1e9,
                decode_gbps: bytes / dec / 1e9,
                encode_mvalues_s: n as f64 / enc / 1e6,
                ratio: bytes / encoded.len() as f64,
                max_abs_error: max_err,
                rms_error: (sq / n as f64).sqrt(),
                index_bytes: matches!(codec, Codec::TopK { .. }).then(|| {
                    // Top-k payload: flags, raw index length, stored index length, ...
                    let p = &encoded[shoal_protocol::codec::TENSOR_HEADER_LEN..];
                    let field = |o: usize| u32::from_le_bytes([p[o], p[o + 1], p[o + 2], p[o + 3]]);
                    (field(1), field(5))
                }),
            },
        );
    }
    let report = CodecBench {
        values: n,
        data: "normal(0,1), every 997th value x20",
        memcpy_gbps,
        codecs: results,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{n} values; memcpy {memcpy_gbps:.2} GB/s on one core");
        println!(
            "{:<16} {:>10} {:>10} {:>8} {:>12} {:>12}",
            "codec", "enc GB/s", "dec GB/s", "ratio", "max err", "rms err"
        );
        for (name, f) in &report.codecs {
            println!(
                "{:<16} {:>10.2} {:>10.2} {:>8.2} {:>12.3e} {:>12.3e}",
                name, f.encode_gbps, f.decode_gbps, f.ratio, f.max_abs_error, f.rms_error
            );
        }
    }
    Ok(())
}

#[derive(Debug, Serialize)]
struct AveragingBench {
    members: usize,
    values: usize,
    /// Seconds to reduce the part to a plain weighted mean (one thread).
    plain_mean_s: f64,
    /// Seconds to reduce it to the centered-clipping mean with its support scores.
    centered_clip_s: f64,
    /// Seconds to decode the members' int8 shares (what the owner does anyway).
    int8_decode_s: f64,
    /// centered_clip_s / plain_mean_s.
    ratio_to_plain: f64,
}

/// What robust averaging costs a part owner: the same shares (gradients with a common signal
/// and per-member noise) reduced both ways.
pub fn robust_mean(args: BenchRobustMeanArgs) -> anyhow::Result<()> {
    use shoal_protocol::swarm::robust::{Share, centered_clip};
    use shoal_protocol::{Codec, Decoder, Encoder};
    let (n, len) = (args.members, args.values);
    let mut rng = shoal_compute::rng::Rng::new(1);
    let signal: Vec<f32> = (0..len).map(|_| rng.normal() as f32).collect();
    let sums: Vec<Vec<f32>> = (0..n)
        .map(|_| {
            signal
                .iter()
                .map(|s| 16.0 * (0.3 * s + rng.normal() as f32 / 4.0))
                .collect()
        })
        .collect();
    let shares: Vec<Share> = sums.iter().map(|v| Share::new(v, 16.0)).collect();
    let plain = fastest(args.rounds, || {
        let mut sum = vec![0f64; len];
        for s in &shares {
            for (a, b) in sum.iter_mut().zip(s.values) {
                *a += *b as f64;
            }
        }
        let total: f64 = shares.iter().map(|s| s.samples).sum();
        let mean: Vec<f32> = sum.iter().map(|v| (v / total) as f32).collect();
        std::hint::black_box(mean);
    });
    let robust = fastest(args.rounds, || {
        std::hint::black_box(centered_clip(std::hint::black_box(&shares), len));
    });
    let mut encoder = Encoder::new();
    let mut decoder = Decoder::new();
    let encoded: Vec<Vec<u8>> = sums
        .iter()
        .map(|v| {
            let mut out = Vec::new();
            encoder
                .encode(Codec::default(), v, &[len], &mut out)
                .map(|_| out)
        })
        .collect::<Result<_, _>>()?;
    let mut decoded = Vec::new();
    let decode = fastest(args.rounds, || {
        for e in &encoded {
            decoder.decode(e, &mut decoded).map(|_| ()).unwrap_or(());
        }
    });
    let report = AveragingBench {
        members: n,
        values: len,
        plain_mean_s: plain,
        centered_clip_s: robust,
        int8_decode_s: decode,
        ratio_to_plain: robust / plain,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{n} shares of {len} values: plain mean {:.2} ms, centered clipping {:.2} ms ({:.1}x), \
             decoding the int8 shares {:.2} ms (one thread)",
            plain * 1e3,
            robust * 1e3,
            robust / plain,
            decode * 1e3
        );
    }
    Ok(())
}
