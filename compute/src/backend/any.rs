//! [`AnyBackend`]: the backend chosen at run time (`--backend`), behind the same [`Backend`]
//! trait, so that the model, the swarm worker and the commands are written once.

#[cfg(any(not(feature = "wgpu"), not(feature = "cuda")))]
use super::BackendError;
#[cfg(feature = "cuda")]
use super::cuda::{CudaBackend, CudaBuffer, CudaTokens};
#[cfg(feature = "wgpu")]
use super::webgpu::{WgpuBackend, WgpuBuffer, WgpuTokens};
use super::{AdamWUpdate, AttentionShape, Backend, CpuBackend, MatmulShape, Result, RowShape};

/// The backend a user asks for (`--backend`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendChoice {
    /// An NVIDIA GPU through CUDA if there is one, else a GPU through wgpu (discrete before
    /// integrated), else the CPU. Software adapters such as lavapipe are left out: the CPU
    /// backend is faster than them.
    #[default]
    Auto,
    /// The host CPU.
    Cpu,
    /// A GPU through wgpu (Vulkan, Metal, DirectX 12), or a software adapter if that is all.
    Wgpu,
    /// An NVIDIA GPU through CUDA.
    Cuda,
}

impl std::str::FromStr for BackendChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(BackendChoice::Auto),
            "cpu" => Ok(BackendChoice::Cpu),
            "wgpu" => Ok(BackendChoice::Wgpu),
            "cuda" => Ok(BackendChoice::Cuda),
            other => Err(format!(
                "unknown backend {other:?} (auto, cpu, wgpu or cuda)"
            )),
        }
    }
}

impl std::fmt::Display for BackendChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendChoice::Auto => "auto",
            BackendChoice::Cpu => "cpu",
            BackendChoice::Wgpu => "wgpu",
            BackendChoice::Cuda => "cuda",
        })
    }
}

/// One of the backends this build has.
pub enum AnyBackend {
    /// The CPU reference.
    Cpu(CpuBackend),
    /// wgpu.
    #[cfg(feature = "wgpu")]
    Wgpu(Box<WgpuBackend>),
    /// CUDA.
    #[cfg(feature = "cuda")]
    Cuda(Box<CudaBackend>),
}

/// A buffer of an [`AnyBackend`]; it belongs to the backend that made it.
pub enum AnyBuffer {
    /// Host memory.
    Cpu(Vec<f32>),
    /// A wgpu storage buffer.
    #[cfg(feature = "wgpu")]
    Wgpu(WgpuBuffer),
    /// CUDA device memory.
    #[cfg(feature = "cuda")]
    Cuda(CudaBuffer),
}

/// Token ids of an [`AnyBackend`].
pub enum AnyTokens {
    /// Host memory.
    Cpu(Vec<u32>),
    /// A wgpu storage buffer.
    #[cfg(feature = "wgpu")]
    Wgpu(WgpuTokens),
    /// CUDA device memory.
    #[cfg(feature = "cuda")]
    Cuda(CudaTokens),
}

const MIXED: &str = "a buffer was passed to a backend other than the one that made it";

/// Access to the variant's inner value; a buffer of another backend is a programming error.
trait Inner<T> {
    fn inner(&self) -> &T;
    fn inner_mut(&mut self) -> &mut T;
}

macro_rules! inner {
    ($outer:ident, $variant:ident, $t:ty) => {
        impl Inner<$t> for $outer {
            fn inner(&self) -> &$t {
                match self {
                    $outer::$variant(x) => x,
                    #[allow(unreachable_patterns)]
                    _ => panic!("{MIXED}"),
                }
            }
            fn inner_mut(&mut self) -> &mut $t {
                match self {
                    $outer::$variant(x) => x,
                    #[allow(unreachable_patterns)]
                    _ => panic!("{MIXED}"),
                }
            }
        }
    };
}

inner!(AnyBuffer, Cpu, Vec<f32>);
inner!(AnyTokens, Cpu, Vec<u32>);
#[cfg(feature = "wgpu")]
inner!(AnyBuffer, Wgpu, WgpuBuffer);
#[cfg(feature = "wgpu")]
inner!(AnyTokens, Wgpu, WgpuTokens);
#[cfg(feature = "cuda")]
inner!(AnyBuffer, Cuda, CudaBuffer);
#[cfg(feature = "cuda")]
inner!(AnyTokens, Cuda, CudaTokens);

/// Calls `$method` on the active backend with each argument unwrapped to its buffer type:
/// `r` a buffer or tokens by reference, `m` by mutable reference, `o` an optional buffer,
/// `om` an optional mutable buffer, `v` a plain value.
macro_rules! forward {
    ($self:ident . $method:ident ( $( $kind:ident $arg:expr ),* )) => {
        match $self {
            AnyBackend::Cpu(b) => b.$method($( forward!(@ $kind $arg) ),*),
            #[cfg(feature = "wgpu")]
            AnyBackend::Wgpu(b) => b.$method($( forward!(@ $kind $arg) ),*),
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda(b) => b.$method($( forward!(@ $kind $arg) ),*),
        }
    };
    (@ r $a:expr) => { Inner::inner($a) };
    (@ m $a:expr) => { Inner::inner_mut($a) };
    (@ o $a:expr) => { $a.map(|x| Inner::inner(x)) };
    (@ om $a:expr) => { $a.map(|x| Inner::inner_mut(x)) };
    (@ v $a:expr) => { $a };
}

impl AnyBackend {
    /// The CPU backend with `threads` threads (0: one per core).
    pub fn cpu(threads: usize) -> Result<Self> {
        CpuBackend::new(threads).map(AnyBackend::Cpu)
    }

    /// The wgpu backend on adapter `index` (see `shoal devices`), or the best adapter.
    pub fn wgpu(index: Option<usize>) -> Result<Self> {
        #[cfg(feature = "wgpu")]
        {
            WgpuBackend::new(index).map(|b| AnyBackend::Wgpu(Box::new(b)))
        }
        #[cfg(not(feature = "wgpu"))]
        {
            let _ = index;
            Err(BackendError::Device {
                backend: "wgpu".into(),
                message: "this build of shoal has no wgpu backend (feature `wgpu`)".into(),
            })
        }
    }

    /// The CUDA backend on device `ordinal`.
    pub fn cuda(ordinal: usize) -> Result<Self> {
        #[cfg(feature = "cuda")]
        {
            CudaBackend::new(ordinal).map(|b| AnyBackend::Cuda(Box::new(b)))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = ordinal;
            Err(BackendError::Device {
                backend: "cuda".into(),
                message: "this build of shoal has no CUDA backend (feature `cuda`)".into(),
            })
        }
    }

    /// The backend `choice` names: `device` picks the wgpu adapter (see `shoal devices`) or
    /// the CUDA device (default: the best adapter, CUDA device 0); `threads` sizes the CPU
    /// backend (0: one per core).
    pub fn open(choice: BackendChoice, device: Option<usize>, threads: usize) -> Result<Self> {
        match choice {
            BackendChoice::Cpu => Self::cpu(threads),
            BackendChoice::Wgpu => Self::wgpu(device),
            BackendChoice::Cuda => Self::cuda(device.unwrap_or(0)),
            BackendChoice::Auto => {
                #[cfg(feature = "cuda")]
                if CudaBackend::device_count() > 0 {
                    if let Ok(b) = Self::cuda(0) {
                        return Ok(b);
                    }
                }
                #[cfg(feature = "wgpu")]
                {
                    use super::webgpu::{AdapterKind, adapters};
                    let gpu = adapters()
                        .into_iter()
                        .filter(|a| {
                            matches!(a.kind, AdapterKind::Discrete | AdapterKind::Integrated)
                        })
                        .min_by_key(|a| a.kind);
                    if let Some(a) = gpu {
                        if let Ok(b) = Self::wgpu(Some(a.index)) {
                            return Ok(b);
                        }
                    }
                }
                Self::cpu(threads)
            }
        }
    }

    /// Whether this is the CPU backend.
    pub fn is_cpu(&self) -> bool {
        matches!(self, AnyBackend::Cpu(_))
    }

    /// The device's memory, bytes, where its API tells: a CUDA device's, the host's for the
    /// CPU; wgpu has no such query (its adapters report their largest buffer only).
    pub fn memory_capacity(&self) -> Option<u64> {
        match self {
            AnyBackend::Cpu(_) => crate::memory::host_memory(),
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda(b) => Some(b.memory()),
            #[cfg(feature = "wgpu")]
            AnyBackend::Wgpu(_) => None,
        }
    }
}

impl Backend for AnyBackend {
    type Buffer = AnyBuffer;
    type Tokens = AnyTokens;

    fn name(&self) -> String {
        forward!(self.name())
    }

    fn alloc(&self, len: usize) -> Result<AnyBuffer> {
        match self {
            AnyBackend::Cpu(b) => b.alloc(len).map(AnyBuffer::Cpu),
            #[cfg(feature = "wgpu")]
            AnyBackend::Wgpu(b) => b.alloc(len).map(AnyBuffer::Wgpu),
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda(b) => b.alloc(len).map(AnyBuffer::Cuda),
        }
    }

    fn upload(&self, host: &[f32]) -> Result<AnyBuffer> {
        match self {
            AnyBackend::Cpu(b) => b.upload(host).map(AnyBuffer::Cpu),
            #[cfg(feature = "wgpu")]
            AnyBackend::Wgpu(b) => b.upload(host).map(AnyBuffer::Wgpu),
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda(b) => b.upload(host).map(AnyBuffer::Cuda),
        }
    }

    fn write(&self, buf: &mut AnyBuffer, host: &[f32]) -> Result<()> {
        forward!(self.write(m buf, v host))
    }

    fn download(&self, buf: &AnyBuffer, host: &mut [f32]) -> Result<()> {
        forward!(self.download(r buf, v host))
    }

    fn upload_tokens(&self, tokens: &[u32]) -> Result<AnyTokens> {
        match self {
            AnyBackend::Cpu(b) => b.upload_tokens(tokens).map(AnyTokens::Cpu),
            #[cfg(feature = "wgpu")]
            AnyBackend::Wgpu(b) => b.upload_tokens(tokens).map(AnyTokens::Wgpu),
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda(b) => b.upload_tokens(tokens).map(AnyTokens::Cuda),
        }
    }

    fn len(&self, buf: &AnyBuffer) -> usize {
        forward!(self.len(r buf))
    }

    fn fill(&self, buf: &mut AnyBuffer, value: f32) -> Result<()> {
        forward!(self.fill(m buf, v value))
    }

    fn copy(&self, dst: &mut AnyBuffer, src: &AnyBuffer) -> Result<()> {
        forward!(self.copy(m dst, r src))
    }

    fn add_assign(&self, acc: &mut AnyBuffer, x: &AnyBuffer) -> Result<()> {
        forward!(self.add_assign(m acc, r x))
    }

    fn sum_squares(&self, buf: &AnyBuffer) -> Result<f64> {
        forward!(self.sum_squares(r buf))
    }

    fn embedding_forward(
        &self,
        out: &mut AnyBuffer,
        tokens: &AnyTokens,
        wte: &AnyBuffer,
        wpe: &AnyBuffer,
        batch: usize,
        seq: usize,
        width: usize,
    ) -> Result<()> {
        forward!(self.embedding_forward(m out, r tokens, r wte, r wpe, v batch, v seq, v width))
    }

    fn embedding_backward(
        &self,
        dwte: &mut AnyBuffer,
        dwpe: &mut AnyBuffer,
        dout: &AnyBuffer,
        tokens: &AnyTokens,
        batch: usize,
        seq: usize,
        width: usize,
    ) -> Result<()> {
        forward!(self.embedding_backward(m dwte, m dwpe, r dout, r tokens, v batch, v seq, v width))
    }

    fn layernorm_forward(
        &self,
        out: &mut AnyBuffer,
        mean: &mut AnyBuffer,
        rstd: &mut AnyBuffer,
        inp: &AnyBuffer,
        weight: &AnyBuffer,
        bias: &AnyBuffer,
        shape: RowShape,
    ) -> Result<()> {
        forward!(self.layernorm_forward(m out, m mean, m rstd, r inp, r weight, r bias, v shape))
    }

    fn layernorm_backward(
        &self,
        dinp: &mut AnyBuffer,
        dweight: &mut AnyBuffer,
        dbias: &mut AnyBuffer,
        dout: &AnyBuffer,
        inp: &AnyBuffer,
        weight: &AnyBuffer,
        mean: &AnyBuffer,
        rstd: &AnyBuffer,
        shape: RowShape,
    ) -> Result<()> {
        forward!(self.layernorm_backward(
            m dinp, m dweight, m dbias, r dout, r inp, r weight, r mean, r rstd, v shape
        ))
    }

    fn matmul_forward(
        &self,
        out: &mut AnyBuffer,
        inp: &AnyBuffer,
        weight: &AnyBuffer,
        bias: Option<&AnyBuffer>,
        shape: MatmulShape,
    ) -> Result<()> {
        forward!(self.matmul_forward(m out, r inp, r weight, o bias, v shape))
    }

    fn matmul_backward(
        &self,
        dinp: &mut AnyBuffer,
        dweight: &mut AnyBuffer,
        dbias: Option<&mut AnyBuffer>,
        dout: &AnyBuffer,
        inp: &AnyBuffer,
        weight: &AnyBuffer,
        shape: MatmulShape,
    ) -> Result<()> {
        forward!(self.matmul_backward(m dinp, m dweight, om dbias, r dout, r inp, r weight, v shape))
    }

    fn attention_forward(
        &self,
        out: &mut AnyBuffer,
        probs: &mut AnyBuffer,
        qkv: &AnyBuffer,
        shape: AttentionShape,
    ) -> Result<()> {
        forward!(self.attention_forward(m out, m probs, r qkv, v shape))
    }

    fn attention_backward(
        &self,
        dqkv: &mut AnyBuffer,
        scratch: &mut AnyBuffer,
        dout: &AnyBuffer,
        qkv: &AnyBuffer,
        probs: &AnyBuffer,
        shape: AttentionShape,
    ) -> Result<()> {
        forward!(self.attention_backward(m dqkv, m scratch, r dout, r qkv, r probs, v shape))
    }

    fn gelu_forward(&self, out: &mut AnyBuffer, inp: &AnyBuffer) -> Result<()> {
        forward!(self.gelu_forward(m out, r inp))
    }

    fn gelu_backward(&self, dinp: &mut AnyBuffer, inp: &AnyBuffer, dout: &AnyBuffer) -> Result<()> {
        forward!(self.gelu_backward(m dinp, r inp, r dout))
    }

    fn residual_forward(&self, out: &mut AnyBuffer, a: &AnyBuffer, b: &AnyBuffer) -> Result<()> {
        forward!(self.residual_forward(m out, r a, r b))
    }

    fn softmax_cross_entropy_forward(
        &self,
        logits: &mut AnyBuffer,
        losses: &mut AnyBuffer,
        targets: &AnyTokens,
        shape: RowShape,
    ) -> Result<()> {
        forward!(self.softmax_cross_entropy_forward(m logits, m losses, r targets, v shape))
    }

    fn softmax_cross_entropy_backward(
        &self,
        probs: &mut AnyBuffer,
        targets: &AnyTokens,
        shape: RowShape,
        scale: f32,
    ) -> Result<()> {
        forward!(self.softmax_cross_entropy_backward(m probs, r targets, v shape, v scale))
    }

    fn adamw(
        &self,
        param: &mut AnyBuffer,
        grad: &AnyBuffer,
        m: &mut AnyBuffer,
        v: &mut AnyBuffer,
        update: &AdamWUpdate,
    ) -> Result<()> {
        forward!(self.adamw(m param, r grad, m m, m v, v update))
    }
}

impl std::fmt::Debug for AnyBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}
