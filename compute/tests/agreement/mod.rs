//! Agreement of a backend with the CPU reference, shared by the tests of every backend:
//! every operation on random inputs, then whole `nano` and `micro` stages (forward, backward,
//! one AdamW step), then replicas on the CPU and on the backend stepping together.
//!
//! Tolerances: a GPU sums in another order (tiled products, tree reductions) and its `exp`
//! and `sqrt` may differ by an ulp or two, so results agree to float rounding, not bit for
//! bit. Element-wise operations must match to 1e-5 relative to the largest value; products
//! and reductions over up to a few thousand terms to 1e-4; a whole stage, whose errors pass
//! through a dozen layers, to 2e-3 on activations and gradients and 1e-4 on parameters after a
//! step, except weights whose gradient is within rounding noise of zero: AdamW's first step
//! moves a weight by the learning rate times the sign of its gradient, and noise may flip it.

#![allow(dead_code)]

use shoal_compute::backend::{AdamWUpdate, AttentionShape, MatmulShape, RowShape};
use shoal_compute::rng::Rng;
use shoal_compute::stage::{MicrobatchShape, StageInput, StageOutput};
use shoal_compute::{AdamW, Backend, CpuBackend, Preset, Residency, Stage, StageSpec};
use std::sync::Arc;

/// Runs operation `$op` (a generic function of this module) on the CPU and on the backend
/// `$get()` returns, and checks every output it returns against tolerance `$tol`.
macro_rules! agree {
    ($get:path, $op:ident, $tol:expr) => {{
        let Some(other_backend) = $get() else { return };
        let reference = agreement::$op(&agreement::cpu());
        let other = agreement::$op(&*other_backend);
        assert_eq!(reference.len(), other.len());
        for (i, (r, o)) in reference.iter().zip(&other).enumerate() {
            let d = agreement::rel_diff(r, o);
            assert!(
                d <= $tol,
                "{}: output {i} differs by {d} (tolerance {})",
                stringify!($op),
                $tol
            );
            assert!(
                o.iter().all(|v| v.is_finite()),
                "{}: non-finite",
                stringify!($op)
            );
        }
    }};
}

/// The agreement tests, for the backend `$get()` returns (`None`: skipped, said by `$get`),
/// each with the attributes given after it (e.g. `#[ignore = "why"]`).
macro_rules! agreement_tests {
    ($get:path $(, #[$attr:meta])*) => {
        #[test]
        $(#[$attr])*
        fn elementwise_operations_agree() {
            agree!($get, elementwise, 1e-5);
        }

        #[test]
        $(#[$attr])*
        fn adamw_agrees() {
            agree!($get, adamw, 1e-5);
        }

        #[test]
        $(#[$attr])*
        fn embedding_agrees() {
            agree!($get, embedding, 1e-5);
        }

        #[test]
        $(#[$attr])*
        fn layernorm_agrees() {
            agree!($get, layernorm, 1e-4);
        }

        #[test]
        $(#[$attr])*
        fn matmul_agrees() {
            agree!($get, matmul, 1e-4);
        }

        #[test]
        $(#[$attr])*
        fn attention_agrees() {
            agree!($get, attention, 1e-4);
        }

        #[test]
        $(#[$attr])*
        fn cross_entropy_agrees() {
            agree!($get, cross_entropy, 1e-5);
        }

        #[test]
        $(#[$attr])*
        fn nano_stages_agree() {
            let Some(b) = $get() else { return };
            for index in 0..3 {
                agreement::check_stage(b.clone(), Preset::Nano, StageSpec { index, count: 3 });
            }
            agreement::check_stage(b, Preset::Nano, StageSpec::WHOLE);
        }

        /// Recomputing activations in the backward pass changes nothing beyond rounding.
        #[test]
        $(#[$attr])*
        fn stages_recomputing_activations_agree() {
            let Some(b) = $get() else { return };
            for index in 0..3 {
                let spec = StageSpec { index, count: 3 };
                agreement::check_stage_with(b.clone(), Preset::Nano, spec, agreement::Held::RECOMPUTE);
            }
        }

        /// A stage under a device memory limit, its blocks moving between host and device
        /// and its optimizer stepping on the host, computes what an unlimited one does.
        #[test]
        $(#[$attr])*
        fn stages_under_a_memory_limit_agree() {
            let Some(b) = $get() else { return };
            for index in 0..2 {
                let spec = StageSpec { index, count: 2 };
                agreement::check_stage_with(b.clone(), Preset::Micro, spec, agreement::Held::OFFLOAD);
            }
        }

        #[test]
        $(#[$attr])*
        fn micro_stages_agree() {
            let Some(b) = $get() else { return };
            for index in 0..3 {
                agreement::check_stage(b.clone(), Preset::Micro, StageSpec { index, count: 3 });
            }
        }

        /// The policy that lets replicas on different backends train one stage: their forward
        /// and backward passes differ in rounding, but they step with the same averaged
        /// gradient, and the step itself runs in one canonical way, so their parameters stay
        /// bit-identical (and their hashes, which the swarm compares, agree).
        #[test]
        $(#[$attr])*
        fn replicas_on_the_cpu_and_this_backend_take_bit_identical_steps() {
            let Some(b) = $get() else { return };
            agreement::check_identical_steps(b);
        }
    };
}

pub fn cpu() -> CpuBackend {
    CpuBackend::new(2).unwrap()
}

pub fn randn(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.normal() as f32 * scale).collect()
}

pub fn tokens(seed: u64, n: usize, vocab: u32) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
}

pub fn down<B: Backend>(b: &B, buf: &B::Buffer) -> Vec<f32> {
    let mut host = vec![0.0; b.len(buf)];
    b.download(buf, &mut host).unwrap();
    host
}

/// Largest absolute difference relative to the largest magnitude of the reference.
pub fn rel_diff(reference: &[f32], other: &[f32]) -> f32 {
    assert_eq!(reference.len(), other.len());
    let scale = reference
        .iter()
        .fold(0f32, |m, x| m.max(x.abs()))
        .max(1e-12);
    reference
        .iter()
        .zip(other)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

pub fn elementwise<B: Backend>(b: &B) -> Vec<Vec<f32>> {
    let n = 70_001; // not a multiple of the workgroup size
    let x = b.upload(&randn(1, n, 2.0)).unwrap();
    let y = b.upload(&randn(2, n, 1.0)).unwrap();
    let mut out = b.alloc(n).unwrap();
    let mut acc = b.upload(&randn(3, n, 1.0)).unwrap();
    let mut gelu = b.alloc(n).unwrap();
    let mut dgelu = b.alloc(n).unwrap();
    let mut copied = b.alloc(n).unwrap();
    let mut filled = b.alloc(n).unwrap();
    b.residual_forward(&mut out, &x, &y).unwrap();
    b.add_assign(&mut acc, &x).unwrap();
    b.gelu_forward(&mut gelu, &x).unwrap();
    b.gelu_backward(&mut dgelu, &x, &y).unwrap();
    b.copy(&mut copied, &acc).unwrap();
    b.fill(&mut filled, 0.375).unwrap();
    let mut written = b.alloc(n).unwrap();
    b.write(&mut written, &randn(4, n, 1.0)).unwrap();
    let squares = b.sum_squares(&x).unwrap() as f32;
    vec![
        down(b, &out),
        down(b, &acc),
        down(b, &gelu),
        down(b, &dgelu),
        down(b, &copied),
        down(b, &filled),
        down(b, &written),
        vec![squares],
    ]
}

pub fn adamw<B: Backend>(b: &B) -> Vec<Vec<f32>> {
    let n = 5000;
    let mut p = b.upload(&randn(5, n, 0.1)).unwrap();
    let g = b.upload(&randn(6, n, 0.01)).unwrap();
    let mut m = b.upload(&randn(7, n, 0.001)).unwrap();
    let mut v = b
        .upload(&randn(8, n, 0.001).iter().map(|x| x * x).collect::<Vec<_>>())
        .unwrap();
    let u = AdamWUpdate {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 3,
        grad_scale: 0.5,
    };
    b.adamw(&mut p, &g, &mut m, &mut v, &u).unwrap();
    vec![down(b, &p), down(b, &m), down(b, &v)]
}

pub fn embedding<B: Backend>(b: &B) -> Vec<Vec<f32>> {
    let (batch, seq, width, vocab) = (3, 17, 40, 50);
    let toks = tokens(9, batch * seq, 12); // few distinct tokens: many collide in dwte
    let t = b.upload_tokens(&toks).unwrap();
    let wte = b.upload(&randn(10, vocab * width, 1.0)).unwrap();
    let wpe = b.upload(&randn(11, 20 * width, 1.0)).unwrap();
    let mut out = b.alloc(batch * seq * width).unwrap();
    b.embedding_forward(&mut out, &t, &wte, &wpe, batch, seq, width)
        .unwrap();
    let dout = b.upload(&randn(12, batch * seq * width, 1.0)).unwrap();
    let mut dwte = b.upload(&randn(13, vocab * width, 1.0)).unwrap();
    let mut dwpe = b.upload(&randn(14, 20 * width, 1.0)).unwrap();
    b.embedding_backward(&mut dwte, &mut dwpe, &dout, &t, batch, seq, width)
        .unwrap();
    vec![down(b, &out), down(b, &dwte), down(b, &dwpe)]
}

pub fn layernorm<B: Backend>(b: &B) -> Vec<Vec<f32>> {
    let s = RowShape {
        rows: 37,
        width: 300,
    };
    let n = s.rows * s.width;
    let inp = b
        .upload(
            &randn(15, n, 3.0)
                .iter()
                .map(|x| x + 1.5)
                .collect::<Vec<_>>(),
        )
        .unwrap();
    let w = b.upload(&randn(16, s.width, 1.0)).unwrap();
    let bias = b.upload(&randn(17, s.width, 1.0)).unwrap();
    let mut out = b.alloc(n).unwrap();
    let mut mean = b.alloc(s.rows).unwrap();
    let mut rstd = b.alloc(s.rows).unwrap();
    b.layernorm_forward(&mut out, &mut mean, &mut rstd, &inp, &w, &bias, s)
        .unwrap();
    let dout = b.upload(&randn(18, n, 1.0)).unwrap();
    let mut dinp = b.upload(&randn(19, n, 1.0)).unwrap();
    let mut dw = b.upload(&randn(20, s.width, 1.0)).unwrap();
    let mut db = b.upload(&randn(21, s.width, 1.0)).unwrap();
    b.layernorm_backward(
        &mut dinp, &mut dw, &mut db, &dout, &inp, &w, &mean, &rstd, s,
    )
    .unwrap();
    vec![
        down(b, &out),
        down(b, &mean),
        down(b, &rstd),
        down(b, &dinp),
        down(b, &dw),
        down(b, &db),
    ]
}

pub fn matmul<B: Backend>(b: &B) -> Vec<Vec<f32>> {
    // Sizes that are not multiples of the 64x64 tiles or the 16-wide k slices.
    let s = MatmulShape {
        rows: 97,
        input: 83,
        output: 130,
    };
    let inp = b.upload(&randn(22, s.rows * s.input, 1.0)).unwrap();
    let w = b.upload(&randn(23, s.output * s.input, 0.1)).unwrap();
    let bias = b.upload(&randn(24, s.output, 1.0)).unwrap();
    let mut out = b.alloc(s.rows * s.output).unwrap();
    let mut plain = b.alloc(s.rows * s.output).unwrap();
    b.matmul_forward(&mut out, &inp, &w, Some(&bias), s)
        .unwrap();
    b.matmul_forward(&mut plain, &inp, &w, None, s).unwrap();
    let dout = b.upload(&randn(25, s.rows * s.output, 1.0)).unwrap();
    let mut dinp = b.alloc(s.rows * s.input).unwrap();
    let mut dw = b.upload(&randn(26, s.output * s.input, 1.0)).unwrap();
    let mut db = b.upload(&randn(27, s.output, 1.0)).unwrap();
    b.matmul_backward(&mut dinp, &mut dw, Some(&mut db), &dout, &inp, &w, s)
        .unwrap();
    vec![
        down(b, &out),
        down(b, &plain),
        down(b, &dinp),
        down(b, &dw),
        down(b, &db),
    ]
}

pub fn attention<B: Backend>(b: &B) -> Vec<Vec<f32>> {
    let s = AttentionShape {
        batch: 2,
        seq: 19,
        width: 48,
        heads: 3,
    };
    let n = s.batch * s.seq * s.width;
    let qkv = b.upload(&randn(28, 3 * n, 1.0)).unwrap();
    let mut out = b.alloc(n).unwrap();
    let mut probs = b.alloc(s.probs_len()).unwrap();
    b.attention_forward(&mut out, &mut probs, &qkv, s).unwrap();
    let dout = b.upload(&randn(29, n, 1.0)).unwrap();
    let mut dqkv = b.alloc(3 * n).unwrap();
    let mut scratch = b.alloc(s.probs_len()).unwrap();
    b.attention_backward(&mut dqkv, &mut scratch, &dout, &qkv, &probs, s)
        .unwrap();
    vec![down(b, &out), down(b, &probs), down(b, &dqkv)]
}

pub fn cross_entropy<B: Backend>(b: &B) -> Vec<Vec<f32>> {
    let s = RowShape {
        rows: 23,
        width: 1000,
    };
    let t = b
        .upload_tokens(&tokens(30, s.rows, s.width as u32))
        .unwrap();
    let mut logits = b.upload(&randn(31, s.rows * s.width, 4.0)).unwrap();
    let mut losses = b.alloc(s.rows).unwrap();
    b.softmax_cross_entropy_forward(&mut logits, &mut losses, &t, s)
        .unwrap();
    let probs = down(b, &logits);
    b.softmax_cross_entropy_backward(&mut logits, &t, s, 0.25)
        .unwrap();
    vec![probs, down(b, &losses), down(b, &logits)]
}

pub const LR: f32 = 1e-3;

/// How a stage holds what it trains with, in [`stage_step`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Held {
    /// Activations recomputed in the backward pass.
    pub recompute: bool,
    /// Under a memory limit one block short of all its blocks: blocks move between host and
    /// device, the optimizer steps on the host.
    pub offload: bool,
}

impl Held {
    pub const RECOMPUTE: Held = Held {
        recompute: true,
        offload: false,
    };
    pub const OFFLOAD: Held = Held {
        recompute: true,
        offload: true,
    };
}

/// Forward, backward and one AdamW step of stage `spec` of `preset`, held as `held` says: the
/// output (activations or loss), the input gradient, the parameter gradients and the
/// parameters after the step.
pub fn stage_step<B: Backend>(
    backend: Arc<B>,
    preset: Preset,
    spec: StageSpec,
    held: Held,
) -> Vec<Vec<f32>> {
    let config = preset.config();
    let shape = MicrobatchShape { batch: 2, seq: 32 };
    let residency = Residency {
        recompute: held.recompute,
        moments_on_host: true,
        offload: false,
    };
    let all = spec.device_memory_bytes(&config, shape.batch, shape.seq, 1, residency);
    let limit = held.offload.then(|| all - 8 * config.block_params() as u64);
    let mut stage = Stage::with_memory_limit(backend, config, spec, 42, false, limit).unwrap();
    stage.set_recompute(held.recompute).unwrap();
    let rows = shape.batch * shape.seq;
    let toks = tokens(32, rows, config.vocab as u32);
    let targets = tokens(33, rows, config.vocab as u32);
    let acts = randn(34, rows * config.width, 1.0);
    let input = if spec.is_first() {
        StageInput::Tokens(&toks)
    } else {
        StageInput::Activations(&acts)
    };
    let out = match stage.forward(7, shape, input, Some(&targets)).unwrap() {
        StageOutput::Activations(a) => a,
        StageOutput::Loss(l) => vec![l],
    };
    let last = spec.index + 1 == spec.count;
    let dout = (!last).then(|| randn(35, rows * config.width, 0.01));
    let dinp = stage
        .backward(7, dout.as_deref(), 1.0)
        .unwrap()
        .unwrap_or_default();
    let grads = stage.download_grads().unwrap();
    stage.apply_optimizer(&AdamW::default(), LR, 1.0).unwrap();
    if let Some(limit) = limit {
        let peak = stage.memory().peak.total();
        assert!(peak <= limit, "held {peak} bytes under a limit of {limit}");
        assert!(
            stage.offload_traffic().downloaded > 0,
            "no block left the device"
        );
    }
    vec![out, dinp, grads, stage.download_params().unwrap()]
}

pub fn check_stage<B: Backend>(backend: Arc<B>, preset: Preset, spec: StageSpec) {
    check_stage_with(backend, preset, spec, Held::default());
}

/// [`check_stage`], the backend holding the stage as `held` says (the reference keeps
/// everything on the device).
pub fn check_stage_with<B: Backend>(backend: Arc<B>, preset: Preset, spec: StageSpec, held: Held) {
    let reference = stage_step(Arc::new(cpu()), preset, spec, Held::default());
    let other = stage_step(backend, preset, spec, held);
    let names = ["output", "input gradient", "parameter gradients"];
    for (i, name) in names.iter().enumerate() {
        let d = rel_diff(&reference[i], &other[i]);
        assert!(
            d <= 2e-3,
            "{preset} stage {}/{}: {name} differ by {d} (tolerance 2e-3)",
            spec.index,
            spec.count,
        );
    }
    // AdamW's first step moves every weight by the learning rate times the sign of its
    // gradient, so a gradient within rounding noise of zero may flip the move: such weights
    // may differ by up to twice the learning rate; every other one must agree closely.
    let (grads, before, after) = (&reference[2], &reference[3], &other[3]);
    let gscale = grads.iter().fold(0f32, |m, x| m.max(x.abs()));
    let pscale = before.iter().fold(0f32, |m, x| m.max(x.abs()));
    let mut flipped = 0;
    for ((g, p), q) in grads.iter().zip(before).zip(after) {
        let d = (p - q).abs();
        if d <= 1e-4 * pscale {
            continue;
        }
        assert!(
            g.abs() <= 1e-4 * gscale && d <= 2.0 * LR * 1.001,
            "{preset} stage {}/{}: a weight with gradient {g} moved to {q} instead of {p}",
            spec.index,
            spec.count,
        );
        flipped += 1;
    }
    assert!(
        flipped * 1000 <= before.len(),
        "{flipped} of {} weights flipped",
        before.len()
    );
}

/// Forward, backward and commit of microbatch `id` (tokens and output gradient drawn from
/// it); returns the replica's mean gradient.
pub fn mean_gradient<B: Backend>(
    r: &mut shoal_compute::StageReplica<B>,
    id: u64,
    shape: MicrobatchShape,
) -> Vec<f32> {
    let config = Preset::Nano.config();
    let rows = shape.batch * shape.seq;
    let toks = tokens(40 + id, rows, config.vocab as u32);
    r.forward(id, shape, StageInput::Tokens(&toks), None)
        .unwrap();
    let dout = randn(50 + id, rows * config.width, 0.01);
    r.backward(id, Some(&dout), shape.batch as f32).unwrap();
    assert!(r.commit(id));
    let (g, samples) = r.take_gradient();
    g.iter().map(|x| x / samples as f32).collect()
}

/// The policy that lets replicas on different backends train one stage: their forward and
/// backward passes differ in rounding, but they step with the same averaged gradient, and the
/// step itself runs in one canonical way, so their parameters stay bit-identical (and their
/// hashes, which the swarm compares, agree).
pub fn check_identical_steps<B: Backend>(backend: Arc<B>) {
    use shoal_compute::{LrSchedule, StageReplica};
    let config = Preset::Nano.config();
    let spec = StageSpec { index: 0, count: 2 };
    let schedule = LrSchedule::for_steps(3e-3, 10);
    let mut on_cpu =
        StageReplica::new(Arc::new(cpu()), config, spec, 5, AdamW::default(), schedule).unwrap();
    let mut on_gpu =
        StageReplica::new(backend, config, spec, 5, AdamW::default(), schedule).unwrap();
    assert_eq!(on_cpu.param_hash().unwrap(), on_gpu.param_hash().unwrap());
    let shape = MicrobatchShape { batch: 2, seq: 32 };
    for step in 0..3u64 {
        let grads = [
            mean_gradient(&mut on_cpu, step * 2, shape),
            mean_gradient(&mut on_gpu, step * 2 + 1, shape),
        ];
        // Different backends, different microbatches: the gradients differ.
        assert_ne!(grads[0], grads[1]);
        let avg: Vec<f32> = grads[0]
            .iter()
            .zip(&grads[1])
            .map(|(a, b)| (a + b) / 2.0)
            .collect();
        let a = on_cpu.apply_step(&avg).unwrap();
        let b = on_gpu.apply_step(&avg).unwrap();
        assert_eq!(
            a, b,
            "step {step}: replicas on the cpu and the other backend diverged"
        );
        assert_eq!(b, on_gpu.param_hash().unwrap());
    }
}
