//! Serial per-row kernels of the CPU backend, written so that LLVM vectorises them, and
//! compiled twice: for the baseline target and for AVX2+FMA, chosen at run time. The binary
//! stays portable while the hot loops use the machine's vector units.

/// Defines `pub fn $name(args)` that runs an AVX2+FMA build of `$body` where the CPU has it.
macro_rules! multiversion {
    ($(#[$meta:meta])* pub fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        pub fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn generic($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? { generic($($arg),*) }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU supports the features `avx2` was compiled for.
                    return unsafe { avx2($($arg),*) };
                }
            }
            generic($($arg),*)
        }
    };
}

const LANES: usize = 16;

/// Sum with independent accumulators, so the reduction vectorises without fast-math.
#[inline(always)]
fn sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for ch in chunks {
        for i in 0..LANES {
            acc[i] += ch[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Dot product with independent accumulators.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `exp(x)` for f32 in pure arithmetic (vectorisable): Cody-Waite reduction `x = n·ln2 + r`,
/// a degree-7 Taylor polynomial on |r| <= ln2/2 (truncation error < 2e-8 relative), and `2^n`
/// built from the exponent bits. Within 2 ulp of `f32::exp` on the clamped range; inputs below
/// -87 flush to ~0, which is all softmax and GELU need.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer.
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let bits = ((n as i32 + 127) as u32) << 23;
    p * f32::from_bits(bits)
}

const GELU_SCALE: f32 = 0.797_884_6; // sqrt(2/pi)
const GELU_CUBE: f32 = 0.044_715;

/// tanh via exp: `1 - 2 / (exp(2u) + 1)`; saturates correctly at both ends.
#[inline(always)]
fn tanh(u: f32) -> f32 {
    1.0 - 2.0 / (exp(2.0 * u) + 1.0)
}

multiversion! {
    /// GELU (tanh approximation) of each value.
    pub fn gelu_forward(out: &mut [f32], inp: &[f32]) {
        for (o, &x) in out.iter_mut().zip(inp) {
            let u = GELU_SCALE * (x + GELU_CUBE * x * x * x);
            *o = 0.5 * x * (1.0 + tanh(u));
        }
    }
}

multiversion! {
    /// `dinp = gelu'(inp) · dout`.
    pub fn gelu_backward(dinp: &mut [f32], inp: &[f32], dout: &[f32]) {
        for ((d, &x), &g) in dinp.iter_mut().zip(inp).zip(dout) {
            let u = GELU_SCALE * (x + GELU_CUBE * x * x * x);
            let th = tanh(u);
            let du = GELU_SCALE * (1.0 + 3.0 * GELU_CUBE * x * x);
            *d = g * (0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * du);
        }
    }
}

multiversion! {
    /// `out = a + b`.
    pub fn add(out: &mut [f32], a: &[f32], b: &[f32]) {
        for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
            *o = x + y;
        }
    }
}

multiversion! {
    /// `acc += x`.
    pub fn add_assign(acc: &mut [f32], x: &[f32]) {
        for (a, &v) in acc.iter_mut().zip(x) {
            *a += v;
        }
    }
}

multiversion! {
    /// Sum of squares in f32 lanes, returned as f64 (callers sum chunks in f64).
    pub fn sum_squares(x: &[f32]) -> f64 {
        dot(x, x) as f64
    }
}

/// Values in one partial sum of [`sum_squares_chunked`] (and one rayon task of the CPU
/// backend's elementwise kernels).
pub(crate) const VALUES_PER_TASK: usize = 1 << 14;

/// Sum of squares of `x` as the CPU backend computes it: partial sums of
/// [`VALUES_PER_TASK`] values added in order, so the host and the backend agree bit for bit.
pub(crate) fn sum_squares_chunked(x: &[f32]) -> f64 {
    x.chunks(VALUES_PER_TASK).map(sum_squares).sum()
}

pub(crate) const LAYERNORM_EPS: f32 = 1e-5;

multiversion! {
    /// LayerNorm of rows of `width`; writes the normalised rows and each row's mean and 1/std.
    pub fn layernorm_forward(
        out: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
        inp: &[f32],
        weight: &[f32],
        bias: &[f32],
        width: usize,
    ) {
        for (((o, x), m), r) in out
            .chunks_exact_mut(width)
            .zip(inp.chunks_exact(width))
            .zip(mean.iter_mut())
            .zip(rstd.iter_mut())
        {
            let mu = sum(x) / width as f32;
            let mut acc = [0f32; LANES];
            let chunks = x.chunks_exact(LANES);
            let tail: f32 = chunks.remainder().iter().map(|v| (v - mu) * (v - mu)).sum();
            for ch in chunks {
                for i in 0..LANES {
                    let d = ch[i] - mu;
                    acc[i] += d * d;
                }
            }
            let var = (acc.iter().sum::<f32>() + tail) / width as f32;
            let s = 1.0 / (var + LAYERNORM_EPS).sqrt();
            for (((o, &v), &w), &b) in o.iter_mut().zip(x).zip(weight).zip(bias) {
                *o = (v - mu) * s * w + b;
            }
            *m = mu;
            *r = s;
        }
    }
}

multiversion! {
    /// LayerNorm backward over rows: adds into `dinp`, accumulates `dweight` and `dbias`.
    /// `scratch` holds `width` values.
    pub fn layernorm_backward(
        dinp: &mut [f32],
        dweight: &mut [f32],
        dbias: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        weight: &[f32],
        mean: &[f32],
        rstd: &[f32],
        scratch: &mut [f32],
        width: usize,
    ) {
        let norm = scratch;
        for ((((di, g), x), &mu), &s) in dinp
            .chunks_exact_mut(width)
            .zip(dout.chunks_exact(width))
            .zip(inp.chunks_exact(width))
            .zip(mean)
            .zip(rstd)
        {
            for (n, &v) in norm.iter_mut().zip(x) {
                *n = (v - mu) * s;
            }
            // dnorm = weight * g; the two row means below are of dnorm and dnorm * norm.
            let mut a1 = [0f32; LANES];
            let mut a2 = [0f32; LANES];
            let (mut t1, mut t2) = (0f32, 0f32);
            let full = width / LANES * LANES;
            for c0 in (0..full).step_by(LANES) {
                for i in 0..LANES {
                    let dn = weight[c0 + i] * g[c0 + i];
                    a1[i] += dn;
                    a2[i] += dn * norm[c0 + i];
                }
            }
            for c in full..width {
                let dn = weight[c] * g[c];
                t1 += dn;
                t2 += dn * norm[c];
            }
            let mean_dn = (a1.iter().sum::<f32>() + t1) / width as f32;
            let mean_dn_n = (a2.iter().sum::<f32>() + t2) / width as f32;
            for c in 0..width {
                let dn = weight[c] * g[c];
                di[c] += (dn - mean_dn - norm[c] * mean_dn_n) * s;
                dweight[c] += g[c] * norm[c];
                dbias[c] += g[c];
            }
        }
    }
}

multiversion! {
    /// Softmax of the first `len` values of `row` in place (the rest is zeroed: causal mask).
    pub fn causal_softmax_row(row: &mut [f32], len: usize) {
        let (live, masked) = row.split_at_mut(len);
        let max = live.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        for v in live.iter_mut() {
            *v = exp(*v - max);
        }
        let inv = 1.0 / sum(live);
        for v in live.iter_mut() {
            *v *= inv;
        }
        masked.fill(0.0);
    }
}

multiversion! {
    /// Softmax backward of one row in place: `d = p · (d - Σ p·d) · scale`, zero past `len`.
    pub fn causal_softmax_backward_row(d: &mut [f32], p: &[f32], len: usize, scale: f32) {
        let s = dot(&p[..len], &d[..len]);
        for (dv, &pv) in d[..len].iter_mut().zip(&p[..len]) {
            *dv = pv * (*dv - s) * scale;
        }
        d[len..].fill(0.0);
    }
}

multiversion! {
    /// Softmax of a logit row in place; returns `-ln p[target]`.
    pub fn softmax_cross_entropy_row(row: &mut [f32], target: usize) -> f32 {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        for v in row.iter_mut() {
            *v = exp(*v - max);
        }
        let total = sum(row);
        let inv = 1.0 / total;
        let loss = -((row[target] * inv).max(f32::MIN_POSITIVE)).ln();
        for v in row.iter_mut() {
            *v *= inv;
        }
        loss
    }
}

multiversion! {
    /// `dst = a · scale` .
    pub fn scale_into(dst: &mut [f32], scale: f32) {
        for v in dst.iter_mut() {
            *v *= scale;
        }
    }
}

multiversion! {
    /// AdamW on a chunk; `bc1`/`bc2` are the bias corrections `1 - beta^t`.
    pub fn adamw(
        param: &mut [f32],
        grad: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        u: &super::AdamWUpdate,
        bc1: f32,
        bc2: f32,
    ) {
        for (((p, &g), m), v) in param.iter_mut().zip(grad).zip(m.iter_mut()).zip(v.iter_mut()) {
            let g = g * u.grad_scale;
            *m = u.beta1 * *m + (1.0 - u.beta1) * g;
            *v = u.beta2 * *v + (1.0 - u.beta2) * g * g;
            let mhat = *m / bc1;
            let vhat = *v / bc2;
            *p -= u.lr * (mhat / (vhat.sqrt() + u.eps) + u.weight_decay * *p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_matches_libm() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let rel = ((exp(x) - x.exp()) / x.exp()).abs();
            worst = worst.max(rel);
            x += 0.0137;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert!(exp(-1000.0) < 1e-37);
        assert!(exp(1000.0).is_finite());
    }

    #[test]
    fn tanh_matches_libm() {
        for i in -2000..2000 {
            let u = i as f32 * 0.005;
            assert!((tanh(u) - u.tanh()).abs() < 2e-7, "u={u}");
        }
    }
}
