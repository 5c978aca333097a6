//! The CPU backend: the reference implementation of every operation, multi-threaded with rayon,
//! matrix products through the `gemm` crate.

use super::kernels;
use super::{
    AdamWUpdate, AttentionShape, Backend, BackendError, MatmulShape, Result, RowShape,
    check_host_len, check_len,
};
use gemm::Parallelism;
use rayon::prelude::*;

/// Runs a stage on the host CPU with a private thread pool.
pub struct CpuBackend {
    pool: rayon::ThreadPool,
    threads: usize,
}

/// Rows handed to one rayon task in row-parallel kernels: enough work to amortise scheduling.
const ROWS_PER_TASK: usize = 16;
use kernels::VALUES_PER_TASK;

impl CpuBackend {
    /// A backend with `threads` worker threads (0: one per available core).
    pub fn new(threads: usize) -> Result<Self> {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("shoal-cpu-{i}"))
            .build()
            .map_err(|e| BackendError::Device {
                backend: "cpu".into(),
                message: e.to_string(),
            })?;
        Ok(CpuBackend { pool, threads })
    }

    /// Number of worker threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }
}

/// A raw pointer that may cross threads; used where parallel tasks write disjoint, interleaved
/// elements of one buffer (per-head column blocks), which slices cannot express.
#[derive(Clone, Copy)]
struct SharedMut(*mut f32);
// SAFETY: every use documents why concurrent tasks touch disjoint elements.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

impl SharedMut {
    /// The pointer (a method, so closures capture the whole `Send` wrapper, not the field).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// A strided matrix view: element `(i, j)` is at `offset + i*rs + j*cs`.
#[derive(Clone, Copy)]
struct Mat {
    offset: usize,
    rs: usize,
    cs: usize,
}

impl Mat {
    fn rows(offset: usize, rs: usize) -> Self {
        Mat { offset, rs, cs: 1 }
    }
    fn cols(offset: usize, cs: usize) -> Self {
        Mat { offset, rs: 1, cs }
    }
    /// One past the largest index touched by an `r x c` matrix.
    fn extent(&self, r: usize, c: usize) -> usize {
        if r == 0 || c == 0 {
            return self.offset;
        }
        self.offset + (r - 1) * self.rs + (c - 1) * self.cs + 1
    }
}

/// `dst(m x n) = [dst +] scale · lhs(m x k) · rhs(k x n)`, with bounds checked on the slices.
#[allow(clippy::too_many_arguments)]
fn sgemm(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    d: Mat,
    lhs: &[f32],
    l: Mat,
    rhs: &[f32],
    r: Mat,
    accumulate: bool,
    scale: f32,
    par: Parallelism,
) {
    assert!(d.extent(m, n) <= dst.len(), "gemm dst out of bounds");
    assert!(l.extent(m, k) <= lhs.len(), "gemm lhs out of bounds");
    assert!(r.extent(k, n) <= rhs.len(), "gemm rhs out of bounds");
    // SAFETY: the extents were checked against the slices above, and `dst` is borrowed mutably,
    // so it aliases neither input.
    unsafe {
        sgemm_raw(
            (m, n, k),
            dst.as_mut_ptr(),
            d,
            lhs,
            l,
            rhs,
            r,
            accumulate,
            scale,
            par,
        )
    }
}

/// # Safety
/// `dst + d.extent(m, n)` must be writable and not read or written by anyone else meanwhile;
/// `lhs` and `rhs` must cover their extents.
#[allow(clippy::too_many_arguments)]
unsafe fn sgemm_raw(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    d: Mat,
    lhs: &[f32],
    l: Mat,
    rhs: &[f32],
    r: Mat,
    accumulate: bool,
    scale: f32,
    par: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: per this function's contract; gemm reads exactly the given extents.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.add(d.offset),
            d.cs as isize,
            d.rs as isize,
            accumulate,
            lhs.as_ptr().add(l.offset),
            l.cs as isize,
            l.rs as isize,
            rhs.as_ptr().add(r.offset),
            r.cs as isize,
            r.rs as isize,
            1.0,
            scale,
            false,
            false,
            false,
            par,
        );
    }
}

fn check(buf: &[f32], len: usize, what: &str) {
    check_len(buf.len(), len, what);
}

impl Backend for CpuBackend {
    type Buffer = Vec<f32>;
    type Tokens = Vec<u32>;

    fn name(&self) -> String {
        format!("cpu ({} threads)", self.threads)
    }

    fn alloc(&self, len: usize) -> Result<Vec<f32>> {
        let mut v = Vec::new();
        v.try_reserve_exact(len)
            .map_err(|_| BackendError::OutOfMemory {
                backend: "cpu".into(),
                bytes: len.saturating_mul(4),
            })?;
        v.resize(len, 0.0);
        Ok(v)
    }

    fn upload(&self, host: &[f32]) -> Result<Vec<f32>> {
        let mut v = self.alloc(0)?;
        v.try_reserve_exact(host.len())
            .map_err(|_| BackendError::OutOfMemory {
                backend: "cpu".into(),
                bytes: host.len() * 4,
            })?;
        v.extend_from_slice(host);
        Ok(v)
    }

    fn write(&self, buf: &mut Vec<f32>, host: &[f32]) -> Result<()> {
        check_host_len(buf.len(), host.len())?;
        buf.copy_from_slice(host);
        Ok(())
    }

    fn download(&self, buf: &Vec<f32>, host: &mut [f32]) -> Result<()> {
        check_host_len(buf.len(), host.len())?;
        host.copy_from_slice(buf);
        Ok(())
    }

    fn upload_tokens(&self, tokens: &[u32]) -> Result<Vec<u32>> {
        Ok(tokens.to_vec())
    }

    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }

    fn fill(&self, buf: &mut Vec<f32>, value: f32) -> Result<()> {
        self.run(|| {
            buf.par_chunks_mut(VALUES_PER_TASK)
                .for_each(|c| c.fill(value))
        });
        Ok(())
    }

    fn copy(&self, dst: &mut Vec<f32>, src: &Vec<f32>) -> Result<()> {
        check(dst, src.len(), "copy");
        self.run(|| {
            dst.par_chunks_mut(VALUES_PER_TASK)
                .zip(src.par_chunks(VALUES_PER_TASK))
                .for_each(|(d, s)| d.copy_from_slice(s))
        });
        Ok(())
    }

    fn add_assign(&self, acc: &mut Vec<f32>, x: &Vec<f32>) -> Result<()> {
        check(acc, x.len(), "add_assign");
        self.run(|| {
            acc.par_chunks_mut(VALUES_PER_TASK)
                .zip(x.par_chunks(VALUES_PER_TASK))
                .for_each(|(a, x)| kernels::add_assign(a, x))
        });
        Ok(())
    }

    fn sum_squares(&self, buf: &Vec<f32>) -> Result<f64> {
        // Partial sums added in order (rayon's reduction tree varies from run to run), as
        // `kernels::sum_squares_chunked` adds them on the host.
        let partials: Vec<f64> = self.run(|| {
            buf.par_chunks(VALUES_PER_TASK)
                .map(kernels::sum_squares)
                .collect()
        });
        Ok(partials.into_iter().sum())
    }

    fn embedding_forward(
        &self,
        out: &mut Vec<f32>,
        tokens: &Vec<u32>,
        wte: &Vec<f32>,
        wpe: &Vec<f32>,
        batch: usize,
        seq: usize,
        width: usize,
    ) -> Result<()> {
        check(out, batch * seq * width, "embedding out");
        assert_eq!(tokens.len(), batch * seq);
        assert!(wpe.len() >= seq * width);
        let vocab = wte.len() / width;
        self.run(|| {
            out.par_chunks_mut(width).enumerate().for_each(|(i, o)| {
                let tok = tokens[i] as usize;
                assert!(tok < vocab, "token {tok} outside vocabulary {vocab}");
                let t = i % seq;
                kernels::add(o, &wte[tok * width..][..width], &wpe[t * width..][..width]);
            })
        });
        Ok(())
    }

    fn embedding_backward(
        &self,
        dwte: &mut Vec<f32>,
        dwpe: &mut Vec<f32>,
        dout: &Vec<f32>,
        tokens: &Vec<u32>,
        batch: usize,
        seq: usize,
        width: usize,
    ) -> Result<()> {
        check(dout, batch * seq * width, "embedding dout");
        assert_eq!(tokens.len(), batch * seq);
        // Rows of dwpe are independent; dwte rows collide on repeated tokens, so it is done
        // serially (it is a small fraction of the step).
        self.run(|| {
            dwpe.par_chunks_mut(width)
                .take(seq)
                .enumerate()
                .for_each(|(t, d)| {
                    for b in 0..batch {
                        kernels::add_assign(d, &dout[(b * seq + t) * width..][..width]);
                    }
                })
        });
        for (i, &tok) in tokens.iter().enumerate() {
            let row = &mut dwte[tok as usize * width..][..width];
            kernels::add_assign(row, &dout[i * width..][..width]);
        }
        Ok(())
    }

    fn layernorm_forward(
        &self,
        out: &mut Vec<f32>,
        mean: &mut Vec<f32>,
        rstd: &mut Vec<f32>,
        inp: &Vec<f32>,
        weight: &Vec<f32>,
        bias: &Vec<f32>,
        s: RowShape,
    ) -> Result<()> {
        s.check_layernorm(
            &[out.len(), inp.len()],
            [mean.len(), rstd.len()],
            [weight.len(), bias.len()],
        );
        let w = s.width;
        let chunk = ROWS_PER_TASK * w;
        self.run(|| {
            out.par_chunks_mut(chunk)
                .zip(mean.par_chunks_mut(ROWS_PER_TASK))
                .zip(rstd.par_chunks_mut(ROWS_PER_TASK))
                .zip(inp.par_chunks(chunk))
                .for_each(|(((o, m), r), x)| {
                    kernels::layernorm_forward(o, m, r, x, weight, bias, w)
                })
        });
        Ok(())
    }

    fn layernorm_backward(
        &self,
        dinp: &mut Vec<f32>,
        dweight: &mut Vec<f32>,
        dbias: &mut Vec<f32>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        weight: &Vec<f32>,
        mean: &Vec<f32>,
        rstd: &Vec<f32>,
        s: RowShape,
    ) -> Result<()> {
        let w = s.width;
        s.check_layernorm(
            &[dinp.len(), dout.len(), inp.len()],
            [mean.len(), rstd.len()],
            [dweight.len(), dbias.len()],
        );
        // Each task accumulates its own weight/bias gradient over a block of rows; the partial
        // sums are added at the end (one block per thread keeps that reduction small).
        let rows_per_task = s.rows.div_ceil(self.threads * 4).max(1);
        let chunk = rows_per_task * w;
        let partials: Vec<(Vec<f32>, Vec<f32>)> = self.run(|| {
            dinp.par_chunks_mut(chunk)
                .zip(dout.par_chunks(chunk))
                .zip(inp.par_chunks(chunk))
                .zip(mean.par_chunks(rows_per_task))
                .zip(rstd.par_chunks(rows_per_task))
                .map(|((((di, g), x), m), r)| {
                    let mut dw = vec![0f32; w];
                    let mut db = vec![0f32; w];
                    let mut scratch = vec![0f32; w];
                    kernels::layernorm_backward(
                        di,
                        &mut dw,
                        &mut db,
                        g,
                        x,
                        weight,
                        m,
                        r,
                        &mut scratch,
                        w,
                    );
                    (dw, db)
                })
                .collect()
        });
        for (dw, db) in partials {
            kernels::add_assign(dweight, &dw);
            kernels::add_assign(dbias, &db);
        }
        Ok(())
    }

    fn matmul_forward(
        &self,
        out: &mut Vec<f32>,
        inp: &Vec<f32>,
        weight: &Vec<f32>,
        bias: Option<&Vec<f32>>,
        s: MatmulShape,
    ) -> Result<()> {
        let (n, c, oc) = (s.rows, s.input, s.output);
        s.check_forward(out.len(), inp.len(), weight.len());
        self.run(|| {
            if let Some(bias) = bias {
                check(bias, oc, "matmul bias");
                out.par_chunks_mut(oc * ROWS_PER_TASK).for_each(|rows| {
                    rows.chunks_exact_mut(oc)
                        .for_each(|r| r.copy_from_slice(bias))
                });
            }
            // out(n x oc) = inp(n x c) · Wᵀ(c x oc); Wᵀ(k, j) = W[j*c + k].
            sgemm(
                (n, oc, c),
                out,
                Mat::rows(0, oc),
                inp,
                Mat::rows(0, c),
                weight,
                Mat::cols(0, c),
                bias.is_some(),
                1.0,
                Parallelism::Rayon(0),
            );
        });
        Ok(())
    }

    fn matmul_backward(
        &self,
        dinp: &mut Vec<f32>,
        dweight: &mut Vec<f32>,
        dbias: Option<&mut Vec<f32>>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        weight: &Vec<f32>,
        s: MatmulShape,
    ) -> Result<()> {
        let (n, c, oc) = (s.rows, s.input, s.output);
        s.check_backward(dinp.len(), dweight.len(), dout.len(), inp.len());
        self.run(|| {
            // dinp(n x c) = dout(n x oc) · W(oc x c)
            sgemm(
                (n, c, oc),
                dinp,
                Mat::rows(0, c),
                dout,
                Mat::rows(0, oc),
                weight,
                Mat::rows(0, c),
                false,
                1.0,
                Parallelism::Rayon(0),
            );
            // dW(oc x c) += doutᵀ(oc x n) · inp(n x c); doutᵀ(i, k) = dout[k*oc + i].
            sgemm(
                (oc, c, n),
                dweight,
                Mat::rows(0, c),
                dout,
                Mat::cols(0, oc),
                inp,
                Mat::rows(0, c),
                true,
                1.0,
                Parallelism::Rayon(0),
            );
            if let Some(dbias) = dbias {
                check(dbias, oc, "matmul dbias");
                // Column sums, parallel over column blocks so tasks never share an output.
                const COLS: usize = 64;
                dbias
                    .par_chunks_mut(COLS)
                    .enumerate()
                    .for_each(|(blk, db)| {
                        let c0 = blk * COLS;
                        for row in dout.chunks_exact(oc) {
                            kernels::add_assign(db, &row[c0..c0 + db.len()]);
                        }
                    });
            }
        });
        Ok(())
    }

    fn attention_forward(
        &self,
        out: &mut Vec<f32>,
        probs: &mut Vec<f32>,
        qkv: &Vec<f32>,
        s: AttentionShape,
    ) -> Result<()> {
        let (t, c, nh) = (s.seq, s.width, s.heads);
        let hs = c / nh;
        s.check_forward(out.len(), probs.len(), qkv.len());
        let scale = 1.0 / (hs as f32).sqrt();
        let out_ptr = SharedMut(out.as_mut_ptr());
        let out_len = out.len();
        self.run(|| {
            probs
                .par_chunks_mut(t * t)
                .enumerate()
                .for_each(|(bh, att)| {
                    let (bi, h) = (bh / nh, bh % nh);
                    let base = bi * t * 3 * c + h * hs;
                    // scores(t x t) = Q(t x hs) · Kᵀ(hs x t) · scale
                    sgemm(
                        (t, t, hs),
                        att,
                        Mat::rows(0, t),
                        qkv,
                        Mat::rows(base, 3 * c),
                        qkv,
                        Mat::cols(base + c, 3 * c),
                        false,
                        scale,
                        Parallelism::None,
                    );
                    for (i, row) in att.chunks_exact_mut(t).enumerate() {
                        kernels::causal_softmax_row(row, i + 1);
                    }
                    // out[bi, :, h] (t x hs) = P(t x t) · V(t x hs)
                    let o = Mat::rows(bi * t * c + h * hs, c);
                    assert!(o.extent(t, hs) <= out_len);
                    // SAFETY: task (bi, h) writes only the rows of sequence bi and the columns of
                    // head h of `out`, so no two tasks touch the same element; the extent is checked.
                    unsafe {
                        sgemm_raw(
                            (t, hs, t),
                            out_ptr.get(),
                            o,
                            att,
                            Mat::rows(0, t),
                            qkv,
                            Mat::rows(base + 2 * c, 3 * c),
                            false,
                            1.0,
                            Parallelism::None,
                        )
                    };
                })
        });
        Ok(())
    }

    fn attention_backward(
        &self,
        dqkv: &mut Vec<f32>,
        scratch: &mut Vec<f32>,
        dout: &Vec<f32>,
        qkv: &Vec<f32>,
        probs: &Vec<f32>,
        s: AttentionShape,
    ) -> Result<()> {
        let (t, c, nh) = (s.seq, s.width, s.heads);
        let hs = c / nh;
        s.check_backward(dqkv.len(), scratch.len(), dout.len(), probs.len());
        let scale = 1.0 / (hs as f32).sqrt();
        let dqkv_len = dqkv.len();
        let dq_ptr = SharedMut(dqkv.as_mut_ptr());
        self.run(|| {
            scratch
                .par_chunks_mut(t * t)
                .enumerate()
                .for_each(|(bh, datt)| {
                    let (bi, h) = (bh / nh, bh % nh);
                    let base = bi * t * 3 * c + h * hs;
                    let p = &probs[bh * t * t..][..t * t];
                    let g = Mat::rows(bi * t * c + h * hs, c);
                    // dP(t x t) = dO(t x hs) · Vᵀ
                    sgemm(
                        (t, t, hs),
                        datt,
                        Mat::rows(0, t),
                        dout,
                        g,
                        qkv,
                        Mat::cols(base + 2 * c, 3 * c),
                        false,
                        1.0,
                        Parallelism::None,
                    );
                    let dq = Mat::rows(base, 3 * c);
                    let dk = Mat::rows(base + c, 3 * c);
                    let dv = Mat::rows(base + 2 * c, 3 * c);
                    assert!(dv.extent(t, hs) <= dqkv_len);
                    // SAFETY: task (bi, h) writes only sequence bi's rows and head h's columns of
                    // the q, k and v blocks of `dqkv`: disjoint across tasks, extent checked.
                    unsafe {
                        // dV = Pᵀ(t x t) · dO(t x hs)
                        sgemm_raw(
                            (t, hs, t),
                            dq_ptr.get(),
                            dv,
                            p,
                            Mat::cols(0, t),
                            dout,
                            g,
                            false,
                            1.0,
                            Parallelism::None,
                        );
                    }
                    for (i, (drow, prow)) in
                        datt.chunks_exact_mut(t).zip(p.chunks_exact(t)).enumerate()
                    {
                        kernels::causal_softmax_backward_row(drow, prow, i + 1, scale);
                    }
                    // SAFETY: as above.
                    unsafe {
                        // dQ = dS(t x t) · K(t x hs); dK = dSᵀ · Q
                        sgemm_raw(
                            (t, hs, t),
                            dq_ptr.get(),
                            dq,
                            datt,
                            Mat::rows(0, t),
                            qkv,
                            Mat::rows(base + c, 3 * c),
                            false,
                            1.0,
                            Parallelism::None,
                        );
                        sgemm_raw(
                            (t, hs, t),
                            dq_ptr.get(),
                            dk,
                            datt,
                            Mat::cols(0, t),
                            qkv,
                            Mat::rows(base, 3 * c),
                            false,
                            1.0,
                            Parallelism::None,
                        );
                    }
                })
        });
        Ok(())
    }

    fn gelu_forward(&self, out: &mut Vec<f32>, inp: &Vec<f32>) -> Result<()> {
        check(out, inp.len(), "gelu out");
        self.run(|| {
            out.par_chunks_mut(VALUES_PER_TASK)
                .zip(inp.par_chunks(VALUES_PER_TASK))
                .for_each(|(o, x)| kernels::gelu_forward(o, x))
        });
        Ok(())
    }

    fn gelu_backward(&self, dinp: &mut Vec<f32>, inp: &Vec<f32>, dout: &Vec<f32>) -> Result<()> {
        check(dinp, inp.len(), "gelu dinp");
        check(dout, inp.len(), "gelu dout");
        self.run(|| {
            dinp.par_chunks_mut(VALUES_PER_TASK)
                .zip(inp.par_chunks(VALUES_PER_TASK))
                .zip(dout.par_chunks(VALUES_PER_TASK))
                .for_each(|((d, x), g)| kernels::gelu_backward(d, x, g))
        });
        Ok(())
    }

    fn residual_forward(&self, out: &mut Vec<f32>, a: &Vec<f32>, b: &Vec<f32>) -> Result<()> {
        check(out, a.len(), "residual out");
        check(b, a.len(), "residual b");
        self.run(|| {
            out.par_chunks_mut(VALUES_PER_TASK)
                .zip(a.par_chunks(VALUES_PER_TASK))
                .zip(b.par_chunks(VALUES_PER_TASK))
                .for_each(|((o, a), b)| kernels::add(o, a, b))
        });
        Ok(())
    }

    fn softmax_cross_entropy_forward(
        &self,
        logits: &mut Vec<f32>,
        losses: &mut Vec<f32>,
        targets: &Vec<u32>,
        s: RowShape,
    ) -> Result<()> {
        s.check_cross_entropy(logits.len(), targets.len());
        check(losses, s.rows, "cross-entropy losses");
        self.run(|| {
            logits
                .par_chunks_mut(s.width)
                .zip(losses.par_iter_mut())
                .zip(targets.par_iter())
                .for_each(|((row, loss), &tgt)| {
                    assert!((tgt as usize) < s.width, "target {tgt} outside vocabulary");
                    *loss = kernels::softmax_cross_entropy_row(row, tgt as usize);
                })
        });
        Ok(())
    }

    fn softmax_cross_entropy_backward(
        &self,
        probs: &mut Vec<f32>,
        targets: &Vec<u32>,
        s: RowShape,
        scale: f32,
    ) -> Result<()> {
        s.check_cross_entropy(probs.len(), targets.len());
        self.run(|| {
            probs
                .par_chunks_mut(s.width)
                .zip(targets.par_iter())
                .for_each(|(row, &tgt)| {
                    row[tgt as usize] -= 1.0;
                    kernels::scale_into(row, scale);
                })
        });
        Ok(())
    }

    fn adamw(
        &self,
        param: &mut Vec<f32>,
        grad: &Vec<f32>,
        m: &mut Vec<f32>,
        v: &mut Vec<f32>,
        u: &AdamWUpdate,
    ) -> Result<()> {
        let n = param.len();
        check(grad, n, "adamw grad");
        check(m, n, "adamw m");
        check(v, n, "adamw v");
        let (bc1, bc2) = u.bias_corrections();
        self.run(|| {
            param
                .par_chunks_mut(VALUES_PER_TASK)
                .zip(grad.par_chunks(VALUES_PER_TASK))
                .zip(m.par_chunks_mut(VALUES_PER_TASK))
                .zip(v.par_chunks_mut(VALUES_PER_TASK))
                .for_each(|(((p, g), m), v)| kernels::adamw(p, g, m, v, u, bc1, bc2))
        });
        Ok(())
    }
}
