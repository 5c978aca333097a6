//! Training through compressed stage boundaries ends where uncompressed training ends.

#![allow(clippy::unwrap_used, missing_docs)]

use shoal_compute::{
    AdamW, Corpus, CpuBackend, DataLoader, LocalPipeline, LrSchedule, Preset, Shard, Transit,
};
use shoal_protocol::{Codec, Decoder, Encoder, ErrorFeedback, HopCodec, ValueFormat};
use std::sync::Arc;

/// Sends every tensor through an encode/decode round trip, as the network would.
struct CodecTransit {
    activations: Codec,
    activation_grads: Codec,
    /// Parameter-gradient codec, with one error-feedback state per stage.
    param_grads: Option<(Codec, Vec<ErrorFeedback>)>,

    encoder: Encoder,
    decoder: Decoder,
    bytes: Vec<u8>,
    sent_bytes: u64,
    raw_bytes: u64,
}

impl CodecTransit {
    fn new(activations: Codec, activation_grads: Codec, param_grads: Option<Codec>) -> Self {
        CodecTransit {
            activations,
            activation_grads,
            param_grads: param_grads.map(|c| (c, (0..3).map(|_| ErrorFeedback::new()).collect())),

            encoder: Encoder::new(),
            decoder: Decoder::new(),
            bytes: Vec::new(),
            sent_bytes: 0,
            raw_bytes: 0,
        }
    }

    fn roundtrip(&mut self, codec: Codec, values: &mut Vec<f32>) {
        let n = values.len();
        self.encoder
            .encode(codec, values, &[n], &mut self.bytes)
            .unwrap();
        self.sent_bytes += self.bytes.len() as u64;
        self.raw_bytes += 4 * n as u64;
        self.decoder.decode(&self.bytes, values).unwrap();
    }
}

impl Transit for CodecTransit {
    fn activations(&mut self, _from: usize, values: &mut Vec<f32>) {
        self.roundtrip(self.activations, values);
    }

    fn activation_grads(&mut self, _from: usize, values: &mut Vec<f32>) {
        self.roundtrip(self.activation_grads, values);
    }

    fn touches_param_grads(&self) -> bool {
        self.param_grads.is_some()
    }

    fn param_grads(&mut self, stage: usize, values: &mut Vec<f32>) {
        let Some((codec, feedback)) = self.param_grads.as_mut() else {
            return;
        };
        let n = values.len();
        feedback[stage]
            .encode(&mut self.encoder, *codec, values, &[n], &mut self.bytes)
            .unwrap();
        self.decoder.decode(&self.bytes, values).unwrap();
    }
}

/// Trains nano cut into 3 stages and returns the held-out loss.
fn train(transit: &mut CodecTransit, steps: u64) -> f32 {
    train_and_evaluate(transit, steps, &mut ())
}

/// The model's own part of a boundary code (a subspace code's projection), without rounding.
struct Projection(Codec);

impl Transit for Projection {
    fn activations(&mut self, _from: usize, values: &mut Vec<f32>) {
        self.0.apply_projection(values).unwrap();
    }
}

/// [`train`], evaluating with activations through `evaluation`.
fn train_and_evaluate(transit: &mut CodecTransit, steps: u64, evaluation: &mut dyn Transit) -> f32 {
    let preset = Preset::Nano;
    let config = preset.config();
    let mut pipeline = LocalPipeline::new(
        Arc::new(CpuBackend::new(0).unwrap()),
        config,
        3,
        5,
        AdamW::default(),
        LrSchedule::for_steps(preset.default_lr(), steps),
    )
    .unwrap();
    let corpus = Corpus::synthetic(5);
    let mut data = DataLoader::new(corpus.clone(), 5, Shard::ALL, config.context).unwrap();
    for _ in 0..steps {
        pipeline
            .train_step_via(&data.next_batch(16), 8, transit)
            .unwrap();
    }
    let mut held_out = DataLoader::new(corpus, 77, Shard::ALL, config.context).unwrap();
    pipeline
        .evaluate_via(&held_out.next_batch(128), evaluation)
        .unwrap()
}

const STEPS: u64 = 300;

/// Both codecs a boundary hop chooses between by default (`HopCodec::AUTO`: int8 on links
/// that keep pace, int4 on the others) train about as well as fp32: int8 to within noise,
/// int4 within 3% on this small model (+2.4% measured: 1.2648 against 1.2352; on `micro` in 3
/// stages, 300 steps, -0.1% and +0.2% on seeds 1 and 2, see the README).
#[test]
fn the_default_boundary_codecs_train_as_well_as_fp32() {
    let baseline = train(
        &mut CodecTransit::new(Codec::Fp32, Codec::Fp32, None),
        STEPS,
    );
    let auto = HopCodec::AUTO;
    for (codec, least_ratio, margin) in [(auto.light, 3.5, 0.02), (auto.strong, 6.5, 0.03)] {
        let mut transit = CodecTransit::new(codec, codec, None);
        let compressed = train(&mut transit, STEPS);
        let ratio = transit.raw_bytes as f64 / transit.sent_bytes as f64;
        eprintln!(
            "nano, 3 stages, {STEPS} steps: fp32 {baseline:.4}, {codec} {compressed:.4}, {ratio:.2}x fewer bytes"
        );
        assert!(
            ratio > least_ratio,
            "{codec} should shrink boundary traffic more than {least_ratio}x, got {ratio:.2}x"
        );
        assert!(
            (compressed - baseline).abs() <= margin * baseline,
            "{codec} loss {compressed} not within {margin} of fp32 loss {baseline}"
        );
    }
}

/// A subspace code makes its projection part of the model: trained through `sub:2:int4`
/// (14x fewer boundary bytes than fp32) the model learns to carry what the next stage needs
/// in half the width, and ends near fp32 when evaluated with the projection (it cost 1.9% on
/// `micro`, see the README); evaluated without it, the next stage sees directions it never
/// saw in training.
#[test]
fn a_subspace_code_trains_a_model_with_its_projection() {
    let baseline = train(
        &mut CodecTransit::new(Codec::Fp32, Codec::Fp32, None),
        STEPS,
    );
    let codec: Codec = "sub:2:int4".parse().unwrap();
    let mut transit = CodecTransit::new(codec, codec, None);
    let with = train_and_evaluate(&mut transit, STEPS, &mut Projection(codec));
    let ratio = transit.raw_bytes as f64 / transit.sent_bytes as f64;
    let mut transit = CodecTransit::new(codec, codec, None);
    let without = train(&mut transit, STEPS);
    eprintln!(
        "nano, 3 stages, {STEPS} steps: fp32 {baseline:.4}, {codec} {with:.4} evaluated with \
         its projection, {without:.4} without, {ratio:.2}x fewer bytes"
    );
    assert!(ratio > 14.0, "{codec}: {ratio:.2}x");
    assert!(
        with <= baseline * 1.05,
        "{codec} loss {with} not within 5% of fp32 loss {baseline}"
    );
    assert!(
        with < without,
        "{with} with the projection, {without} without"
    );
}

/// A subspace code projects blocks of channels: every preset's width is whole blocks, so
/// every activation row is.
#[test]
fn every_preset_width_is_whole_subspace_blocks() {
    for preset in Preset::ALL {
        assert_eq!(
            preset.config().width % shoal_protocol::codec::SUBSPACE_BLOCK,
            0,
            "{preset}"
        );
    }
}

/// Top-k with error feedback on the parameter gradients before AdamW (what gradient averaging
/// would send). It trains, but at equal steps it falls well short of fp32: AdamW normalises
/// every coordinate, so the small coordinates top-k withholds matter as much to it as the
/// large ones it sends. This prints the gap at several fractions (the README's table) and
/// checks that what is sent still trains; run with `--ignored --nocapture`.
#[test]
#[ignore = "measurement for the README; run with --ignored --nocapture"]
fn topk_gradients_with_error_feedback_measured_against_fp32() {
    let baseline = train(
        &mut CodecTransit::new(Codec::Fp32, Codec::Fp32, None),
        STEPS,
    );
    let unigram = match Corpus::synthetic(5) {
        Corpus::Synthetic(m) => m.unigram_entropy() as f32,
        Corpus::Text(_) => unreachable!(),
    };
    for ppm in [1_000_000, 100_000, 10_000] {
        let topk = Codec::TopK {
            ppm,
            values: ValueFormat::Fp16,
        };
        let mut t = CodecTransit::new(Codec::default(), Codec::default(), Some(topk));
        let loss = train(&mut t, STEPS);
        eprintln!(
            "nano, 3 stages, {STEPS} steps: fp32 {baseline:.4}, {topk} + EF on gradients {loss:.4} ({:+.1}%)",
            100.0 * (loss - baseline) / baseline
        );
        assert!(
            loss < unigram,
            "{topk}: loss {loss} did not get below the unigram entropy"
        );
        if ppm == 1_000_000 {
            // Keeping everything is fp16 gradients: indistinguishable from fp32.
            assert!((loss - baseline).abs() <= 0.01 * baseline);
        }
    }
}

/// DiLoCo in one process: `replicas` copies of nano take `inner` local AdamW steps on their
/// own data shards, then average their pseudo-gradients (start-of-round parameters minus
/// current ones) through `codec` (with error feedback per replica) and apply an outer Nesterov
/// step (learning rate 0.7, momentum 0.9, as in the DiLoCo paper). Returns the held-out loss
/// and the bytes each replica sent per round.
fn diloco(codec: Codec, replicas: usize, inner: usize, rounds: usize) -> (f32, usize) {
    let preset = Preset::Nano;
    let config = preset.config();
    let total = (inner * rounds) as u64;
    let mut workers: Vec<_> = (0..replicas)
        .map(|r| {
            let pipeline = LocalPipeline::new(
                Arc::new(CpuBackend::new(1).unwrap()),
                config,
                1,
                5,
                AdamW::default(),
                LrSchedule::for_steps(preset.default_lr(), total),
            )
            .unwrap();
            let shard = Shard::new(r as u64, replicas as u64).unwrap();
            let data = DataLoader::new(Corpus::synthetic(5), 5, shard, config.context).unwrap();
            (pipeline, data, ErrorFeedback::new())
        })
        .collect();
    let mut global = workers[0].0.stages()[0].download_params().unwrap();
    let mut momentum = vec![0f32; global.len()];
    let (mut encoder, mut decoder) = (Encoder::new(), Decoder::new());
    let (mut bytes, mut decoded) = (Vec::new(), Vec::new());
    let mut sent = 0;
    for _ in 0..rounds {
        let mut average = vec![0f32; global.len()];
        for (pipeline, data, feedback) in &mut workers {
            pipeline.stages_mut()[0].upload_params(&global).unwrap();
            for _ in 0..inner {
                pipeline.train_step(&data.next_batch(16), 16).unwrap();
            }
            let local = pipeline.stages()[0].download_params().unwrap();
            let delta: Vec<f32> = global.iter().zip(&local).map(|(g, l)| g - l).collect();
            feedback
                .encode(&mut encoder, codec, &delta, &[delta.len()], &mut bytes)
                .unwrap();
            sent = bytes.len();
            decoder.decode(&bytes, &mut decoded).unwrap();
            for (a, d) in average.iter_mut().zip(&decoded) {
                *a += d / replicas as f32;
            }
        }
        for ((p, m), d) in global.iter_mut().zip(&mut momentum).zip(&average) {
            *m = 0.9 * *m + d;
            *p -= 0.7 * (d + 0.9 * *m);
        }
    }
    let (pipeline, _, _) = &mut workers[0];
    pipeline.stages_mut()[0].upload_params(&global).unwrap();
    let mut held_out =
        DataLoader::new(Corpus::synthetic(5), 77, Shard::ALL, config.context).unwrap();
    (pipeline.evaluate(&held_out.next_batch(128)).unwrap(), sent)
}

/// Top-k with error feedback on DiLoCo pseudo-gradients: prints the gap to fp32 averaging at
/// several fractions (the README's table); run with `--ignored --nocapture`.
#[test]
#[ignore = "measurement for the README; run with --ignored --nocapture"]
fn topk_pseudo_gradients_with_error_feedback_measured_against_fp32() {
    let (replicas, inner, rounds) = (2, 10, 30);
    let (baseline, dense_bytes) = diloco(Codec::Fp32, replicas, inner, rounds);
    for ppm in [1_000_000, 100_000, 10_000] {
        let topk = Codec::TopK {
            ppm,
            values: ValueFormat::Fp16,
        };
        let (loss, sparse_bytes) = diloco(topk, replicas, inner, rounds);
        eprintln!(
            "DiLoCo nano, {replicas} replicas, H={inner}, {rounds} rounds: fp32 {baseline:.4}, \
             {topk} + EF {loss:.4} ({:+.1}%), {:.1}x fewer bytes",
            100.0 * (loss - baseline) / baseline,
            dense_bytes as f64 / sparse_bytes as f64
        );
        if ppm == 1_000_000 {
            assert!(
                (loss - baseline).abs() <= 0.01 * baseline,
                "fp16 pseudo-gradients: {loss}"
            );
        }
    }
}
