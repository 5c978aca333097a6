//! Finite-difference checks of every backward pass, per operation and for whole stages.
//!
//! The kernels compute in f32, so the checks are in f32 with central differences and a step
//! of `EPS = 3e-3`. Rounding error of a difference quotient is about a few ulp(f) / EPS
//! ~ 4 · 2.4e-7 · |f| / 3e-3 ~ 3e-4 for the O(1) objectives used, and truncation error is
//! O(EPS² · f''') ~ 1e-5 · f''' (at EPS = 1e-2 the curvature of attention already shows: 5%
//! errors on some weights, which is why the step is not larger). A tolerance of
//! `1e-3 + 1e-2 · |grad|` is therefore a few times above the expected error, while a wrong
//! formula (a missing term, a transposed index, a factor of 2) gives errors of the order of
//! the gradient itself. Inputs are drawn at O(1) scale so that gradients are well above the
//! absolute tolerance.

#![allow(clippy::unwrap_used, missing_docs)]

use shoal_compute::backend::{AttentionShape, MatmulShape, RowShape};
use shoal_compute::rng::Rng;
use shoal_compute::stage::{MicrobatchShape, StageInput, StageOutput};
use shoal_compute::{Backend, CpuBackend, ModelConfig, Stage, StageSpec};
use std::sync::Arc;

const EPS: f32 = 3e-3;
const ATOL: f64 = 1e-3;
const RTOL: f64 = 1e-2;

fn backend() -> CpuBackend {
    CpuBackend::new(2).unwrap()
}

fn randn(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.normal() as f32 * scale).collect()
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

/// Checks `analytic` against central differences of `f` around `x` at up to `max_checks`
/// evenly spread indices.
fn check(
    name: &str,
    x: &[f32],
    analytic: &[f32],
    max_checks: usize,
    mut f: impl FnMut(&[f32]) -> f64,
) {
    assert_eq!(x.len(), analytic.len(), "{name}: gradient length");
    let stride = (x.len() / max_checks).max(1);
    let mut xp = x.to_vec();
    let mut worst = 0.0f64;
    for i in (0..x.len()).step_by(stride) {
        xp[i] = x[i] + EPS;
        let up = f(&xp);
        xp[i] = x[i] - EPS;
        let down = f(&xp);
        xp[i] = x[i];
        let numeric = (up - down) / (2.0 * EPS as f64);
        let a = analytic[i] as f64;
        let err = (numeric - a).abs();
        worst = worst.max(err / (ATOL + RTOL * a.abs()));
        assert!(
            err <= ATOL + RTOL * a.abs(),
            "{name}[{i}]: analytic {a:.6}, numeric {numeric:.6}"
        );
    }
    assert!(worst.is_finite());
}

#[test]
fn matmul_backward_matches_finite_differences() {
    let b = backend();
    let mut rng = Rng::new(1);
    let s = MatmulShape {
        rows: 5,
        input: 6,
        output: 7,
    };
    let inp = randn(&mut rng, 30, 1.0);
    let w = randn(&mut rng, 42, 0.5);
    let bias = randn(&mut rng, 7, 0.5);
    let r = randn(&mut rng, 35, 1.0);
    let f = |inp: &[f32], w: &[f32], bias: &[f32]| {
        let mut out = b.alloc(35).unwrap();
        b.matmul_forward(
            &mut out,
            &inp.to_vec(),
            &w.to_vec(),
            Some(&bias.to_vec()),
            s,
        )
        .unwrap();
        dot(&out, &r)
    };
    let mut dinp = b.alloc(30).unwrap();
    let mut dw = b.alloc(42).unwrap();
    let mut db = b.alloc(7).unwrap();
    b.matmul_backward(&mut dinp, &mut dw, Some(&mut db), &r, &inp, &w, s)
        .unwrap();
    check("matmul dinp", &inp, &dinp, 100, |x| f(x, &w, &bias));
    check("matmul dweight", &w, &dw, 100, |x| f(&inp, x, &bias));
    check("matmul dbias", &bias, &db, 100, |x| f(&inp, &w, x));
    // Parameter gradients accumulate across calls.
    b.matmul_backward(&mut dinp, &mut dw, Some(&mut db), &r, &inp, &w, s)
        .unwrap();
    check("matmul dweight x2", &w, &dw, 100, |x| {
        2.0 * f(&inp, x, &bias)
    });
}

#[test]
fn layernorm_backward_matches_finite_differences() {
    let b = backend();
    let mut rng = Rng::new(2);
    let s = RowShape { rows: 4, width: 9 };
    let inp = randn(&mut rng, 36, 1.0);
    let w: Vec<f32> = randn(&mut rng, 9, 0.3).iter().map(|x| 1.0 + x).collect();
    let bias = randn(&mut rng, 9, 0.3);
    let r = randn(&mut rng, 36, 1.0);
    let f = |inp: &[f32], w: &[f32], bias: &[f32]| {
        let (mut out, mut m, mut rs) = (
            b.alloc(36).unwrap(),
            b.alloc(4).unwrap(),
            b.alloc(4).unwrap(),
        );
        b.layernorm_forward(
            &mut out,
            &mut m,
            &mut rs,
            &inp.to_vec(),
            &w.to_vec(),
            &bias.to_vec(),
            s,
        )
        .unwrap();
        dot(&out, &r)
    };
    let (mut out, mut m, mut rs) = (
        b.alloc(36).unwrap(),
        b.alloc(4).unwrap(),
        b.alloc(4).unwrap(),
    );
    b.layernorm_forward(&mut out, &mut m, &mut rs, &inp, &w, &bias, s)
        .unwrap();
    // dinp is added to: start from a known non-zero value and subtract it afterwards.
    let mut dinp = vec![0.25f32; 36];
    let (mut dw, mut db) = (b.alloc(9).unwrap(), b.alloc(9).unwrap());
    b.layernorm_backward(&mut dinp, &mut dw, &mut db, &r, &inp, &w, &m, &rs, s)
        .unwrap();
    let dinp: Vec<f32> = dinp.iter().map(|x| x - 0.25).collect();
    check("layernorm dinp", &inp, &dinp, 100, |x| f(x, &w, &bias));
    check("layernorm dweight", &w, &dw, 100, |x| f(&inp, x, &bias));
    check("layernorm dbias", &bias, &db, 100, |x| f(&inp, &w, x));
}

#[test]
fn attention_backward_matches_finite_differences() {
    let b = backend();
    let mut rng = Rng::new(3);
    let s = AttentionShape {
        batch: 2,
        seq: 5,
        width: 8,
        heads: 2,
    };
    let n = 2 * 5 * 8;
    let qkv = randn(&mut rng, 3 * n, 1.0);
    let r = randn(&mut rng, n, 1.0);
    let f = |qkv: &[f32]| {
        let (mut out, mut p) = (b.alloc(n).unwrap(), b.alloc(s.probs_len()).unwrap());
        b.attention_forward(&mut out, &mut p, &qkv.to_vec(), s)
            .unwrap();
        dot(&out, &r)
    };
    let (mut out, mut p) = (b.alloc(n).unwrap(), b.alloc(s.probs_len()).unwrap());
    b.attention_forward(&mut out, &mut p, &qkv, s).unwrap();
    let (mut dqkv, mut scratch) = (b.alloc(3 * n).unwrap(), b.alloc(s.probs_len()).unwrap());
    b.attention_backward(&mut dqkv, &mut scratch, &r, &qkv, &p, s)
        .unwrap();
    check("attention dqkv", &qkv, &dqkv, 1000, f);
    // Causality: the output at position 0 depends on nothing later.
    let mut later = qkv.clone();
    for t in 1..5 {
        for c in 0..24 {
            later[t * 24 + c] += 1.0;
        }
    }
    let (mut out2, mut p2) = (b.alloc(n).unwrap(), b.alloc(s.probs_len()).unwrap());
    b.attention_forward(&mut out2, &mut p2, &later, s).unwrap();
    assert_eq!(out[..8], out2[..8]);
}

#[test]
fn gelu_and_softmax_cross_entropy_backward_match_finite_differences() {
    let b = backend();
    let mut rng = Rng::new(4);
    let x = randn(&mut rng, 50, 2.0);
    let r = randn(&mut rng, 50, 1.0);
    let f = |x: &[f32]| {
        let mut out = b.alloc(50).unwrap();
        b.gelu_forward(&mut out, &x.to_vec()).unwrap();
        dot(&out, &r)
    };
    let mut dx = b.alloc(50).unwrap();
    b.gelu_backward(&mut dx, &x, &r).unwrap();
    check("gelu", &x, &dx, 100, f);

    let s = RowShape { rows: 3, width: 11 };
    let logits = randn(&mut rng, 33, 2.0);
    let targets = vec![0u32, 5, 10];
    let f = |l: &[f32]| {
        let (mut p, mut losses) = (l.to_vec(), b.alloc(3).unwrap());
        b.softmax_cross_entropy_forward(&mut p, &mut losses, &targets, s)
            .unwrap();
        losses.iter().map(|&x| x as f64).sum::<f64>()
    };
    let (mut p, mut losses) = (logits.clone(), b.alloc(3).unwrap());
    b.softmax_cross_entropy_forward(&mut p, &mut losses, &targets, s)
        .unwrap();
    b.softmax_cross_entropy_backward(&mut p, &targets, s, 1.0)
        .unwrap();
    check("cross-entropy", &logits, &p, 100, f);
}

#[test]
fn embedding_backward_matches_finite_differences() {
    let b = backend();
    let mut rng = Rng::new(5);
    let (batch, seq, width, vocab) = (2, 4, 3, 5);
    let tokens = vec![1u32, 3, 1, 0, 4, 4, 2, 1];
    let wte = randn(&mut rng, vocab * width, 1.0);
    let wpe = randn(&mut rng, seq * width, 1.0);
    let r = randn(&mut rng, batch * seq * width, 1.0);
    let f = |wte: &[f32], wpe: &[f32]| {
        let mut out = b.alloc(batch * seq * width).unwrap();
        b.embedding_forward(
            &mut out,
            &tokens,
            &wte.to_vec(),
            &wpe.to_vec(),
            batch,
            seq,
            width,
        )
        .unwrap();
        dot(&out, &r)
    };
    let (mut dwte, mut dwpe) = (b.alloc(wte.len()).unwrap(), b.alloc(wpe.len()).unwrap());
    b.embedding_backward(&mut dwte, &mut dwpe, &r, &tokens, batch, seq, width)
        .unwrap();
    check("embedding dwte", &wte, &dwte, 100, |x| f(x, &wpe));
    check("embedding dwpe", &wpe, &dwpe, 100, |x| f(&wte, x));
}

const TINY: ModelConfig = ModelConfig {
    vocab: 16,
    context: 8,
    width: 8,
    layers: 3,
    heads: 2,
};

/// A stage with O(1) random parameters (LayerNorm gains around 1), so that gradients are large
/// compared with the finite-difference error.
fn tiny_stage(spec: StageSpec, seed: u64) -> Stage<CpuBackend> {
    let mut stage = Stage::new(Arc::new(backend()), TINY, spec, 1).unwrap();
    let mut rng = Rng::new(seed);
    let values: Vec<f32> = stage
        .tensors()
        .flat_map(|t| {
            let gain = t.name.ends_with("ln1_w") || t.name.ends_with("ln2_w") || t.name == "lnf_w";
            randn(&mut rng, t.len, 0.3)
                .into_iter()
                .map(move |x| if gain { 1.0 + x } else { x })
        })
        .collect();
    stage.upload_params(&values).unwrap();
    stage
}

#[test]
fn whole_stage_backward_matches_finite_differences() {
    let shape = MicrobatchShape { batch: 2, seq: 6 };
    let tokens: Vec<u32> = (0..12).map(|i| (i * 7 % 16) as u32).collect();
    let targets: Vec<u32> = (0..12).map(|i| (i * 5 % 16) as u32).collect();

    // Uncut model: parameters against the loss.
    let mut stage = tiny_stage(StageSpec::WHOLE, 11);
    let theta = stage.download_params().unwrap();
    let loss_at = |stage: &mut Stage<CpuBackend>, p: &[f32]| {
        stage.upload_params(p).unwrap();
        let out = stage
            .forward(9, shape, StageInput::Tokens(&tokens), Some(&targets))
            .unwrap();
        stage.discard(9);
        match out {
            StageOutput::Loss(l) => l as f64,
            StageOutput::Activations(_) => unreachable!(),
        }
    };
    stage
        .forward(1, shape, StageInput::Tokens(&tokens), Some(&targets))
        .unwrap();
    assert_eq!(stage.backward(1, None, 1.0).unwrap(), None);
    let grads = stage.download_grads().unwrap();
    check("stage parameters", &theta, &grads, 400, |p| {
        loss_at(&mut stage, p)
    });
    // A directional derivative over all parameters at once.
    let mut rng = Rng::new(12);
    let dir = randn(&mut rng, theta.len(), 1.0);
    let along = |t: f32| -> Vec<f32> { theta.iter().zip(&dir).map(|(p, d)| p + t * d).collect() };
    let numeric = (loss_at(&mut stage, &along(1e-3)) - loss_at(&mut stage, &along(-1e-3))) / 2e-3;
    let analytic = dot(&grads, &dir);
    assert!(
        (numeric - analytic).abs() < 2e-2 * analytic.abs().max(1.0),
        "{numeric} vs {analytic}"
    );

    // A middle stage: input activations and parameters against <output, R>.
    let spec = StageSpec { index: 1, count: 3 };
    let mut mid = tiny_stage(spec, 13);
    let input = randn(&mut rng, 12 * 8, 1.0);
    let r = randn(&mut rng, 12 * 8, 1.0);
    let f = |mid: &mut Stage<CpuBackend>, input: &[f32]| {
        let out = mid
            .forward(9, shape, StageInput::Activations(input), None)
            .unwrap();
        mid.discard(9);
        match out {
            StageOutput::Activations(a) => dot(&a, &r),
            StageOutput::Loss(_) => unreachable!(),
        }
    };
    mid.forward(1, shape, StageInput::Activations(&input), None)
        .unwrap();
    let dinput = mid.backward(1, Some(&r), 1.0).unwrap().unwrap();
    check("middle stage input", &input, &dinput, 200, |x| {
        f(&mut mid, x)
    });
    let theta = mid.download_params().unwrap();
    let grads = mid.download_grads().unwrap();
    check("middle stage parameters", &theta, &grads, 300, |p| {
        mid.upload_params(p).unwrap();
        f(&mut mid, &input)
    });
}
