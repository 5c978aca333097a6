//! The CUDA backend, for NVIDIA GPUs: matrix products on cuBLAS, every other operation a
//! kernel of [`KERNELS`] compiled by NVRTC when the backend starts.
//!
//! The driver, NVRTC and cuBLAS are loaded at run time (cudarc's dynamic loading), so the
//! binary builds and runs on machines without them; [`CudaBackend::new`] checks that each
//! library is present before the first call into it and otherwise returns an error naming the
//! missing one (cudarc would panic on the call).
//!
//! Everything runs on one stream in order; the host waits only where it reads a result.
//! The products are in [`gemm`].

use super::{
    AdamWUpdate, AttentionShape, Backend, BackendError, MatmulShape, Result, RowShape,
    check_host_len, check_len, dim,
};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, LaunchConfig, PushKernelArg,
};
use gemm::Operand;
use std::sync::Arc;

mod gemm;

/// The CUDA C source of every kernel.
pub const KERNELS: &str = include_str!("kernels.cu");

/// Names of the kernels in [`KERNELS`].
const KERNEL_NAMES: [&str; 20] = [
    "fill",
    "add",
    "add_assign",
    "broadcast_rows",
    "sum_squares",
    "gelu_forward",
    "gelu_backward",
    "adamw",
    "embedding_forward",
    "embedding_backward_wpe",
    "embedding_backward_wte",
    "layernorm_forward",
    "layernorm_backward_input",
    "column_sum_partials",
    "layernorm_params_partials",
    "add_column_partials",
    "attention_softmax",
    "attention_softmax_backward",
    "cross_entropy_forward",
    "cross_entropy_backward",
];

const BLOCK: u32 = 256;
const SUM_BLOCK: usize = 4096;

fn cuda_error(message: impl std::fmt::Display) -> BackendError {
    BackendError::Device {
        backend: "cuda".into(),
        message: message.to_string(),
    }
}

/// Which of the libraries the CUDA backend loads at run time are missing.
pub fn missing_libraries() -> Vec<&'static str> {
    let mut missing = Vec::new();
    // SAFETY: these only try to open the shared libraries; nothing is called in them.
    unsafe {
        if !cudarc::driver::sys::is_culib_present() {
            missing.push("the NVIDIA driver (libcuda)");
        }
        if !cudarc::nvrtc::sys::is_culib_present() {
            missing.push("NVRTC (libnvrtc)");
        }
        if !cudarc::cublas::sys::is_culib_present() {
            missing.push("cuBLAS (libcublas)");
        }
    }
    missing
}

/// Compiles [`KERNELS`] with NVRTC; needs only the NVRTC library, no GPU.
pub fn compile_kernels() -> Result<cudarc::nvrtc::Ptx> {
    // SAFETY: only opens the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(cuda_error("NVRTC (libnvrtc) not found"));
    }
    cudarc::nvrtc::compile_ptx_with_opts(KERNELS, Default::default())
        .map_err(|e| cuda_error(format!("compiling kernels: {e}")))
}

/// A device buffer of `f32` values.
pub struct CudaBuffer {
    data: CudaSlice<f32>,
    len: usize,
}

/// Token ids on the device.
pub struct CudaTokens {
    data: CudaSlice<u32>,
    len: usize,
}

/// Runs a stage on an NVIDIA GPU.
pub struct CudaBackend {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: Vec<(&'static str, CudaFunction)>,
    name: String,
    /// The device's memory, bytes.
    memory: u64,
}

fn grid(groups: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (u32::try_from(groups.max(1)).expect("grid over 2^32"), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn elementwise(n: usize) -> LaunchConfig {
    grid(n.div_ceil(BLOCK as usize))
}

/// How a column reduction over `rows x width` is cut (see `column_sum_partials` in
/// [`KERNELS`]): tiles of 32 columns by chunks of rows, enough blocks to fill a large GPU, at
/// most 64 partials per column. Returns the launch, the rows per chunk and the chunk count.
fn column_chunks(rows: usize, width: usize) -> (LaunchConfig, u32, u32) {
    let chunk = rows.div_ceil(64).max(32);
    let chunks = rows.div_ceil(chunk).max(1);
    let tiles = width.div_ceil(32).max(1);
    let cfg = LaunchConfig {
        grid_dim: (dim(tiles), dim(chunks), 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    (cfg, dim(chunk), dim(chunks))
}

/// Launches kernel `$name` with `$cfg` and the given arguments.
macro_rules! launch {
    ($self:ident, $name:literal, $cfg:expr, $($arg:expr),* $(,)?) => {{
        let f = $self.kernel($name);
        let mut b = $self.stream.launch_builder(f);
        $( b.arg($arg); )*
        // SAFETY: each kernel's arguments are passed in its declared order and types, and
        // every buffer was checked against the shape the kernel indexes with.
        unsafe { b.launch($cfg) }.map(|_| ()).map_err(cuda_error)
    }};
}

impl CudaBackend {
    /// The CUDA device `ordinal`, after checking that the driver, NVRTC and cuBLAS libraries
    /// are present.
    pub fn new(ordinal: usize) -> Result<Self> {
        let missing = missing_libraries();
        if !missing.is_empty() {
            return Err(cuda_error(format!("not found: {}", missing.join(", "))));
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda_error)?;
        let name = ctx.name().map_err(cuda_error)?;
        let memory = ctx.total_mem().map_err(cuda_error)? as u64;
        let stream = ctx.default_stream();
        let ptx = compile_kernels()?;
        let module = ctx.load_module(ptx).map_err(cuda_error)?;
        let kernels = KERNEL_NAMES
            .iter()
            .map(|n| module.load_function(n).map(|f| (*n, f)))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(cuda_error)?;
        let blas = CudaBlas::new(stream.clone()).map_err(cuda_error)?;
        Ok(CudaBackend {
            stream,
            blas,
            kernels,
            name,
            memory,
        })
    }

    /// The device's memory, bytes.
    pub fn memory(&self) -> u64 {
        self.memory
    }

    /// Number of CUDA devices (0 where the driver is missing).
    pub fn device_count() -> usize {
        // SAFETY: only opens the library.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return 0;
        }
        CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
    }

    /// Name and memory of every CUDA device, by ordinal.
    pub fn devices() -> Result<Vec<(String, usize)>> {
        let missing = missing_libraries();
        if missing.iter().any(|m| m.contains("driver")) {
            return Err(cuda_error("the NVIDIA driver (libcuda) was not found"));
        }
        (0..Self::device_count())
            .map(|i| {
                let ctx = CudaContext::new(i).map_err(cuda_error)?;
                Ok((
                    ctx.name().map_err(cuda_error)?,
                    ctx.total_mem().map_err(cuda_error)?,
                ))
            })
            .collect()
    }

    /// Device memory for a kernel's intermediate values, taken from the stream's pool (no
    /// device-wide synchronisation) and returned when dropped.
    fn scratch(&self, len: usize) -> Result<CudaSlice<f32>> {
        // SAFETY: every kernel given scratch writes each value before it reads it.
        unsafe { self.stream.alloc::<f32>(len.max(1)) }.map_err(|_| BackendError::OutOfMemory {
            backend: self.name(),
            bytes: len * 4,
        })
    }

    /// `acc[c] += the sum of partials[k][c]` over `chunks` rows of partials (the second pass of
    /// a column reduction, see [`column_chunks`]).
    fn add_partials(
        &self,
        acc: &mut CudaBuffer,
        partials: &CudaView<'_, f32>,
        chunks: u32,
        width: usize,
    ) -> Result<()> {
        let w = dim(width);
        launch!(
            self,
            "add_column_partials",
            elementwise(width),
            &mut acc.data,
            partials,
            &chunks,
            &w
        )
    }

    fn kernel(&self, name: &str) -> &CudaFunction {
        &self
            .kernels
            .iter()
            .find(|(n, _)| *n == name)
            .expect("kernel compiled at start")
            .1
    }
}

fn check(buf: &CudaBuffer, len: usize, what: &str) {
    check_len(buf.len, len, what);
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;
    type Tokens = CudaTokens;

    fn name(&self) -> String {
        format!("cuda ({})", self.name)
    }

    fn alloc(&self, len: usize) -> Result<CudaBuffer> {
        let data =
            self.stream
                .alloc_zeros::<f32>(len.max(1))
                .map_err(|_| BackendError::OutOfMemory {
                    backend: self.name(),
                    bytes: len * 4,
                })?;
        Ok(CudaBuffer { data, len })
    }

    fn upload(&self, host: &[f32]) -> Result<CudaBuffer> {
        let mut b = self.alloc(host.len())?;
        self.write(&mut b, host)?;
        Ok(b)
    }

    fn write(&self, buf: &mut CudaBuffer, host: &[f32]) -> Result<()> {
        check_host_len(buf.len, host.len())?;
        if host.is_empty() {
            return Ok(());
        }
        let mut dst = buf.data.slice_mut(..host.len());
        self.stream.memcpy_htod(host, &mut dst).map_err(cuda_error)
    }

    fn download(&self, buf: &CudaBuffer, host: &mut [f32]) -> Result<()> {
        check_host_len(buf.len, host.len())?;
        if host.is_empty() {
            return Ok(());
        }
        let src = buf.data.slice(..host.len());
        self.stream.memcpy_dtoh(&src, host).map_err(cuda_error)?;
        self.stream.synchronize().map_err(cuda_error)
    }

    fn upload_tokens(&self, tokens: &[u32]) -> Result<CudaTokens> {
        let mut data = self
            .stream
            .alloc_zeros::<u32>(tokens.len().max(1))
            .map_err(cuda_error)?;
        if !tokens.is_empty() {
            let mut dst = data.slice_mut(..tokens.len());
            self.stream
                .memcpy_htod(tokens, &mut dst)
                .map_err(cuda_error)?;
        }
        Ok(CudaTokens {
            data,
            len: tokens.len(),
        })
    }

    fn len(&self, buf: &CudaBuffer) -> usize {
        buf.len
    }

    fn fill(&self, buf: &mut CudaBuffer, value: f32) -> Result<()> {
        let n = dim(buf.len);
        launch!(
            self,
            "fill",
            elementwise(buf.len),
            &mut buf.data,
            &value,
            &n
        )
    }

    fn copy(&self, dst: &mut CudaBuffer, src: &CudaBuffer) -> Result<()> {
        check(dst, src.len, "copy");
        self.stream
            .memcpy_dtod(&src.data, &mut dst.data)
            .map_err(cuda_error)
    }

    fn add_assign(&self, acc: &mut CudaBuffer, x: &CudaBuffer) -> Result<()> {
        check(acc, x.len, "add_assign");
        let n = dim(acc.len);
        launch!(
            self,
            "add_assign",
            elementwise(acc.len),
            &mut acc.data,
            &x.data,
            &n
        )
    }

    fn sum_squares(&self, buf: &CudaBuffer) -> Result<f64> {
        let blocks = buf.len.div_ceil(SUM_BLOCK);
        if blocks == 0 {
            return Ok(0.0);
        }
        let mut partials = self.alloc(blocks)?;
        let n = dim(buf.len);
        launch!(
            self,
            "sum_squares",
            grid(blocks),
            &mut partials.data,
            &buf.data,
            &n
        )?;
        let mut host = vec![0.0f32; blocks];
        self.download(&partials, &mut host)?;
        Ok(host.iter().map(|v| *v as f64).sum())
    }

    fn embedding_forward(
        &self,
        out: &mut CudaBuffer,
        tokens: &CudaTokens,
        wte: &CudaBuffer,
        wpe: &CudaBuffer,
        batch: usize,
        seq: usize,
        width: usize,
    ) -> Result<()> {
        check(out, batch * seq * width, "embedding out");
        assert_eq!(tokens.len, batch * seq);
        assert!(wpe.len >= seq * width);
        let (n, s, w, v) = (
            dim(out.len),
            dim(seq),
            dim(width),
            dim(wte.len / width.max(1)),
        );
        launch!(
            self,
            "embedding_forward",
            elementwise(out.len),
            &mut out.data,
            &tokens.data,
            &wte.data,
            &wpe.data,
            &n,
            &s,
            &w,
            &v
        )
    }

    fn embedding_backward(
        &self,
        dwte: &mut CudaBuffer,
        dwpe: &mut CudaBuffer,
        dout: &CudaBuffer,
        tokens: &CudaTokens,
        batch: usize,
        seq: usize,
        width: usize,
    ) -> Result<()> {
        check(dout, batch * seq * width, "embedding dout");
        assert_eq!(tokens.len, batch * seq);
        assert!(dwpe.len >= seq * width);
        let (n, s, w, b) = (dim(seq * width), dim(seq), dim(width), dim(batch));
        launch!(
            self,
            "embedding_backward_wpe",
            elementwise(seq * width),
            &mut dwpe.data,
            &dout.data,
            &n,
            &s,
            &w,
            &b
        )?;
        let (rows, vocab) = (dim(batch * seq), dim(dwte.len / width.max(1)));
        launch!(
            self,
            "embedding_backward_wte",
            elementwise(width),
            &mut dwte.data,
            &dout.data,
            &tokens.data,
            &rows,
            &w,
            &vocab
        )
    }

    fn layernorm_forward(
        &self,
        out: &mut CudaBuffer,
        mean: &mut CudaBuffer,
        rstd: &mut CudaBuffer,
        inp: &CudaBuffer,
        weight: &CudaBuffer,
        bias: &CudaBuffer,
        s: RowShape,
    ) -> Result<()> {
        s.check_layernorm(
            &[out.len, inp.len],
            [mean.len, rstd.len],
            [weight.len, bias.len],
        );
        let (rows, width) = (dim(s.rows), dim(s.width));
        launch!(
            self,
            "layernorm_forward",
            grid(s.rows),
            &mut out.data,
            &mut mean.data,
            &mut rstd.data,
            &inp.data,
            &weight.data,
            &bias.data,
            &rows,
            &width
        )
    }

    fn layernorm_backward(
        &self,
        dinp: &mut CudaBuffer,
        dweight: &mut CudaBuffer,
        dbias: &mut CudaBuffer,
        dout: &CudaBuffer,
        inp: &CudaBuffer,
        weight: &CudaBuffer,
        mean: &CudaBuffer,
        rstd: &CudaBuffer,
        s: RowShape,
    ) -> Result<()> {
        s.check_layernorm(
            &[dinp.len, dout.len, inp.len],
            [mean.len, rstd.len],
            [dweight.len, dbias.len],
        );
        let (rows, width) = (dim(s.rows), dim(s.width));
        launch!(
            self,
            "layernorm_backward_input",
            grid(s.rows),
            &mut dinp.data,
            &dout.data,
            &inp.data,
            &weight.data,
            &mean.data,
            &rstd.data,
            &rows,
            &width
        )?;
        let (cfg, chunk, chunks) = column_chunks(s.rows, s.width);
        let mut partials = self.scratch(2 * chunks as usize * s.width)?;
        launch!(
            self,
            "layernorm_params_partials",
            cfg,
            &mut partials,
            &dout.data,
            &inp.data,
            &mean.data,
            &rstd.data,
            &rows,
            &width,
            &chunk
        )?;
        let (weight_partials, bias_partials) = partials.split_at(chunks as usize * s.width);
        self.add_partials(dbias, &bias_partials, chunks, s.width)?;
        self.add_partials(dweight, &weight_partials, chunks, s.width)
    }

    fn matmul_forward(
        &self,
        out: &mut CudaBuffer,
        inp: &CudaBuffer,
        weight: &CudaBuffer,
        bias: Option<&CudaBuffer>,
        s: MatmulShape,
    ) -> Result<()> {
        let (n, c, oc) = (s.rows, s.input, s.output);
        s.check_forward(out.len, inp.len, weight.len);
        if let Some(bias) = bias {
            check(bias, oc, "matmul bias");
            let (len, width) = (dim(out.len), dim(oc));
            launch!(
                self,
                "broadcast_rows",
                elementwise(out.len),
                &mut out.data,
                &bias.data,
                &len,
                &width
            )?;
        }
        // out(n x oc) = inp(n x c) · Wᵀ
        self.gemm(
            (n, oc, c, 1),
            (inp, Operand::plain(c)),
            (weight, Operand::plain(c).t()),
            (out, Operand::plain(oc)),
            1.0,
            if bias.is_some() { 1.0 } else { 0.0 },
        )
    }

    fn matmul_backward(
        &self,
        dinp: &mut CudaBuffer,
        dweight: &mut CudaBuffer,
        dbias: Option<&mut CudaBuffer>,
        dout: &CudaBuffer,
        inp: &CudaBuffer,
        weight: &CudaBuffer,
        s: MatmulShape,
    ) -> Result<()> {
        let (n, c, oc) = (s.rows, s.input, s.output);
        s.check_backward(dinp.len, dweight.len, dout.len, inp.len);
        // dinp(n x c) = dout(n x oc) · W(oc x c)
        self.gemm(
            (n, c, oc, 1),
            (dout, Operand::plain(oc)),
            (weight, Operand::plain(c)),
            (dinp, Operand::plain(c)),
            1.0,
            0.0,
        )?;
        // dW(oc x c) += doutᵀ · inp
        self.gemm(
            (oc, c, n, 1),
            (dout, Operand::plain(oc).t()),
            (inp, Operand::plain(c)),
            (dweight, Operand::plain(c)),
            1.0,
            1.0,
        )?;
        if let Some(dbias) = dbias {
            check(dbias, oc, "matmul dbias");
            let (rows, width) = (dim(n), dim(oc));
            let (cfg, chunk, chunks) = column_chunks(n, oc);
            let mut partials = self.scratch(chunks as usize * oc)?;
            launch!(
                self,
                "column_sum_partials",
                cfg,
                &mut partials,
                &dout.data,
                &rows,
                &width,
                &chunk
            )?;
            self.add_partials(dbias, &partials.as_view(), chunks, oc)?;
        }
        Ok(())
    }

    fn attention_forward(
        &self,
        out: &mut CudaBuffer,
        probs: &mut CudaBuffer,
        qkv: &CudaBuffer,
        s: AttentionShape,
    ) -> Result<()> {
        let (b, t, c, nh) = (s.batch, s.seq, s.width, s.heads);
        let hs = c / nh;
        s.check_forward(out.len, probs.len, qkv.len);
        let scale = 1.0 / (hs as f32).sqrt();
        // One batched product over every sequence and head.
        let q = Operand::plain(3 * c).batched(hs);
        let p = Operand::plain(t).batched(t * t);
        let o = Operand::plain(c).batched(hs);
        let (qkv_seq, p_seq, o_seq) = (t * 3 * c, nh * t * t, t * c);
        // scores = Q Kᵀ · scale
        self.gemm_grouped(
            (t, t, hs, nh, b),
            (qkv, q, qkv_seq),
            (qkv, q.at(c).t(), qkv_seq),
            (probs, p, p_seq),
            scale,
            0.0,
        )?;
        let (rows, seq) = (dim(b * nh * t), dim(t));
        launch!(
            self,
            "attention_softmax",
            grid(b * nh * t),
            &mut probs.data,
            &rows,
            &seq
        )?;
        // out = P V
        self.gemm_grouped(
            (t, hs, t, nh, b),
            (probs, p, p_seq),
            (qkv, q.at(2 * c), qkv_seq),
            (out, o, o_seq),
            1.0,
            0.0,
        )
    }

    fn attention_backward(
        &self,
        dqkv: &mut CudaBuffer,
        scratch: &mut CudaBuffer,
        dout: &CudaBuffer,
        qkv: &CudaBuffer,
        probs: &CudaBuffer,
        s: AttentionShape,
    ) -> Result<()> {
        let (b, t, c, nh) = (s.batch, s.seq, s.width, s.heads);
        let hs = c / nh;
        s.check_backward(dqkv.len, scratch.len, dout.len, probs.len);
        let scale = 1.0 / (hs as f32).sqrt();
        let q = Operand::plain(3 * c).batched(hs);
        let (k, v) = (q.at(c), q.at(2 * c));
        let p = Operand::plain(t).batched(t * t);
        let g = Operand::plain(c).batched(hs);
        let (qkv_seq, p_seq, g_seq) = (t * 3 * c, nh * t * t, t * c);
        // dP = dO Vᵀ; dV = Pᵀ dO
        self.gemm_grouped(
            (t, t, hs, nh, b),
            (dout, g, g_seq),
            (qkv, v.t(), qkv_seq),
            (scratch, p, p_seq),
            1.0,
            0.0,
        )?;
        self.gemm_grouped(
            (t, hs, t, nh, b),
            (probs, p.t(), p_seq),
            (dout, g, g_seq),
            (dqkv, v, qkv_seq),
            1.0,
            0.0,
        )?;
        let (rows, seq) = (dim(b * nh * t), dim(t));
        launch!(
            self,
            "attention_softmax_backward",
            grid(b * nh * t),
            &mut scratch.data,
            &probs.data,
            &rows,
            &seq,
            &scale
        )?;
        // dQ = dS K; dK = dSᵀ Q
        self.gemm_grouped(
            (t, hs, t, nh, b),
            (scratch, p, p_seq),
            (qkv, k, qkv_seq),
            (dqkv, q, qkv_seq),
            1.0,
            0.0,
        )?;
        self.gemm_grouped(
            (t, hs, t, nh, b),
            (scratch, p.t(), p_seq),
            (qkv, q, qkv_seq),
            (dqkv, k, qkv_seq),
            1.0,
            0.0,
        )
    }

    fn gelu_forward(&self, out: &mut CudaBuffer, inp: &CudaBuffer) -> Result<()> {
        check(out, inp.len, "gelu out");
        let n = dim(inp.len);
        launch!(
            self,
            "gelu_forward",
            elementwise(inp.len),
            &mut out.data,
            &inp.data,
            &n
        )
    }

    fn gelu_backward(
        &self,
        dinp: &mut CudaBuffer,
        inp: &CudaBuffer,
        dout: &CudaBuffer,
    ) -> Result<()> {
        check(dinp, inp.len, "gelu dinp");
        check(dout, inp.len, "gelu dout");
        let n = dim(inp.len);
        launch!(
            self,
            "gelu_backward",
            elementwise(inp.len),
            &mut dinp.data,
            &inp.data,
            &dout.data,
            &n
        )
    }

    fn residual_forward(&self, out: &mut CudaBuffer, a: &CudaBuffer, b: &CudaBuffer) -> Result<()> {
        check(out, a.len, "residual out");
        check(b, a.len, "residual b");
        let n = dim(a.len);
        launch!(
            self,
            "add",
            elementwise(a.len),
            &mut out.data,
            &a.data,
            &b.data,
            &n
        )
    }

    fn softmax_cross_entropy_forward(
        &self,
        logits: &mut CudaBuffer,
        losses: &mut CudaBuffer,
        targets: &CudaTokens,
        s: RowShape,
    ) -> Result<()> {
        s.check_cross_entropy(logits.len, targets.len);
        check(losses, s.rows, "cross-entropy losses");
        let (rows, width) = (dim(s.rows), dim(s.width));
        launch!(
            self,
            "cross_entropy_forward",
            grid(s.rows),
            &mut logits.data,
            &mut losses.data,
            &targets.data,
            &rows,
            &width
        )
    }

    fn softmax_cross_entropy_backward(
        &self,
        probs: &mut CudaBuffer,
        targets: &CudaTokens,
        s: RowShape,
        scale: f32,
    ) -> Result<()> {
        s.check_cross_entropy(probs.len, targets.len);
        let (n, width) = (dim(s.rows * s.width), dim(s.width));
        launch!(
            self,
            "cross_entropy_backward",
            elementwise(s.rows * s.width),
            &mut probs.data,
            &targets.data,
            &n,
            &width,
            &scale
        )
    }

    fn adamw(
        &self,
        param: &mut CudaBuffer,
        grad: &CudaBuffer,
        m: &mut CudaBuffer,
        v: &mut CudaBuffer,
        up: &AdamWUpdate,
    ) -> Result<()> {
        let n = param.len;
        check(grad, n, "adamw grad");
        check(m, n, "adamw m");
        check(v, n, "adamw v");
        let (bc1, bc2) = up.bias_corrections();
        let count = dim(n);
        launch!(
            self,
            "adamw",
            elementwise(n),
            &mut param.data,
            &grad.data,
            &mut m.data,
            &mut v.data,
            &count,
            &up.lr,
            &up.beta1,
            &up.beta2,
            &up.eps,
            &up.weight_decay,
            &bc1,
            &bc2,
            &up.grad_scale
        )
    }
}
