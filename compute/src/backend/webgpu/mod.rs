//! The wgpu backend: every operation of a stage as a WGSL compute shader, on any GPU that
//! speaks Vulkan, Metal or DirectX 12 (AMD, Intel, Apple, NVIDIA), and on Mesa's lavapipe, a
//! software Vulkan driver, where there is none.
//!
//! (Over 900 lines, as one file still: its buffer handling is to be reworked for memory
//! accounting and offload, and is split by concern then rather than twice.)
//!
//! Tensors live in storage buffers; operations are recorded into one command encoder and
//! submitted together when the host needs a result (a download, a norm) or the batch grows,
//! so a stage's forward and backward pass never round-trip through the host between layers.
//! Every queue operation (upload, write) first submits what is recorded, which keeps the
//! order the caller wrote.
//!
//! Reductions (LayerNorm, softmax, norms) use subgroup operations where the adapter has them
//! (`reduce_subgroup.wgsl`) and a tree through workgroup memory where it does not
//! (`reduce_workgroup.wgsl`); the kernels are the same source either way.

use super::{
    AdamWUpdate, AttentionShape, Backend, BackendError, MatmulShape, Result, RowShape,
    check_host_len, check_len, dim,
};
use std::sync::{Arc, Mutex, MutexGuard};
use wgpu::util::DeviceExt;

/// What kind of device an adapter is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum AdapterKind {
    /// A GPU with its own memory.
    Discrete,
    /// A GPU sharing the host's memory.
    Integrated,
    /// A virtualised GPU.
    Virtual,
    /// A software implementation running on the CPU (e.g. lavapipe).
    Software,
    /// Not reported.
    Other,
}

impl std::fmt::Display for AdapterKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AdapterKind::Discrete => "discrete",
            AdapterKind::Integrated => "integrated",
            AdapterKind::Virtual => "virtual",
            AdapterKind::Software => "software",
            AdapterKind::Other => "other",
        })
    }
}

/// An adapter wgpu found.
#[derive(Clone, Debug)]
pub struct AdapterSummary {
    /// Position in wgpu's enumeration (what `--adapter` selects).
    pub index: usize,
    /// Device name as the driver reports it.
    pub name: String,
    /// Vendor, from the PCI vendor id.
    pub vendor: String,
    /// Graphics API wgpu drives it through (vulkan, metal, dx12, gl).
    pub api: String,
    /// Discrete, integrated, software, ...
    pub kind: AdapterKind,
    /// Driver name and version.
    pub driver: String,
    /// Largest buffer the adapter allows, in bytes (wgpu does not report memory size).
    pub max_buffer: u64,
    /// Whether the adapter offers subgroup operations, and their size range.
    pub subgroups: Option<(u32, u32)>,
}

fn vendor_name(id: u32) -> String {
    match id {
        0x10DE => "NVIDIA".into(),
        0x1002 | 0x1022 => "AMD".into(),
        0x8086 => "Intel".into(),
        0x106B => "Apple".into(),
        0x13B5 => "ARM".into(),
        0x5143 => "Qualcomm".into(),
        0x10005 => "Mesa".into(),
        0 => "unknown".into(),
        other => format!("{other:#06x}"),
    }
}

fn kind_of(t: wgpu::DeviceType) -> AdapterKind {
    match t {
        wgpu::DeviceType::DiscreteGpu => AdapterKind::Discrete,
        wgpu::DeviceType::IntegratedGpu => AdapterKind::Integrated,
        wgpu::DeviceType::VirtualGpu => AdapterKind::Virtual,
        wgpu::DeviceType::Cpu => AdapterKind::Software,
        wgpu::DeviceType::Other => AdapterKind::Other,
    }
}

fn summary(index: usize, adapter: &wgpu::Adapter) -> AdapterSummary {
    let info = adapter.get_info();
    AdapterSummary {
        index,
        name: info.name.clone(),
        vendor: vendor_name(info.vendor),
        api: info.backend.to_string(),
        kind: kind_of(info.device_type),
        driver: format!("{} {}", info.driver, info.driver_info)
            .trim()
            .to_string(),
        max_buffer: adapter.limits().max_buffer_size,
        subgroups: adapter
            .features()
            .contains(wgpu::Features::SUBGROUP)
            .then_some((info.subgroup_min_size, info.subgroup_max_size)),
    }
}

fn instance() -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12;
    wgpu::Instance::new(desc)
}

fn enumerate() -> Vec<wgpu::Adapter> {
    pollster::block_on(instance().enumerate_adapters(wgpu::Backends::all()))
}

/// Every adapter wgpu can use on this machine (none where no driver is installed).
pub fn adapters() -> Vec<AdapterSummary> {
    enumerate()
        .iter()
        .enumerate()
        .map(|(i, a)| summary(i, a))
        .collect()
}

fn device_error(message: impl std::fmt::Display) -> BackendError {
    BackendError::Device {
        backend: "wgpu".into(),
        message: message.to_string(),
    }
}

/// A device buffer of `f32` values.
pub struct WgpuBuffer {
    buf: wgpu::Buffer,
    len: usize,
}

/// Token ids on the device.
pub struct WgpuTokens {
    buf: wgpu::Buffer,
    len: usize,
}

/// The compute pipelines, one per kernel.
struct Kernels {
    fill: wgpu::ComputePipeline,
    add: wgpu::ComputePipeline,
    add_assign: wgpu::ComputePipeline,
    broadcast_rows: wgpu::ComputePipeline,
    sum_squares: wgpu::ComputePipeline,
    gelu_forward: wgpu::ComputePipeline,
    gelu_backward: wgpu::ComputePipeline,
    adamw: wgpu::ComputePipeline,
    embedding_forward: wgpu::ComputePipeline,
    embedding_backward_wpe: wgpu::ComputePipeline,
    embedding_backward_wte: wgpu::ComputePipeline,
    layernorm_forward: wgpu::ComputePipeline,
    layernorm_backward_input: wgpu::ComputePipeline,
    layernorm_backward_params: wgpu::ComputePipeline,
    column_sum: wgpu::ComputePipeline,
    gemm: wgpu::ComputePipeline,
    attention_softmax: wgpu::ComputePipeline,
    attention_softmax_backward: wgpu::ComputePipeline,
    cross_entropy_forward: wgpu::ComputePipeline,
    cross_entropy_backward: wgpu::ComputePipeline,
}

/// WGSL sources of every kernel, by name (each is compiled as [`kernel_source`] assembles it).
pub const KERNEL_SOURCES: &[(&str, &str)] = &[
    ("fill", include_str!("fill.wgsl")),
    ("add", include_str!("add.wgsl")),
    ("add_assign", include_str!("add_assign.wgsl")),
    ("broadcast_rows", include_str!("broadcast_rows.wgsl")),
    ("sum_squares", include_str!("sum_squares.wgsl")),
    ("gelu_forward", include_str!("gelu_forward.wgsl")),
    ("gelu_backward", include_str!("gelu_backward.wgsl")),
    ("adamw", include_str!("adamw.wgsl")),
    ("embedding_forward", include_str!("embedding_forward.wgsl")),
    (
        "embedding_backward_wpe",
        include_str!("embedding_backward_wpe.wgsl"),
    ),
    (
        "embedding_backward_wte",
        include_str!("embedding_backward_wte.wgsl"),
    ),
    ("layernorm_forward", include_str!("layernorm_forward.wgsl")),
    (
        "layernorm_backward_input",
        include_str!("layernorm_backward_input.wgsl"),
    ),
    (
        "layernorm_backward_params",
        include_str!("layernorm_backward_params.wgsl"),
    ),
    ("column_sum", include_str!("column_sum.wgsl")),
    ("gemm", include_str!("gemm.wgsl")),
    ("attention_softmax", include_str!("attention_softmax.wgsl")),
    (
        "attention_softmax_backward",
        include_str!("attention_softmax_backward.wgsl"),
    ),
    (
        "cross_entropy_forward",
        include_str!("cross_entropy_forward.wgsl"),
    ),
    (
        "cross_entropy_backward",
        include_str!("cross_entropy_backward.wgsl"),
    ),
];

const COMMON: &str = include_str!("common.wgsl");
const REDUCE_WORKGROUP: &str = include_str!("reduce_workgroup.wgsl");
const REDUCE_SUBGROUP: &str = include_str!("reduce_subgroup.wgsl");

/// The full WGSL of kernel `body`: the reductions (with subgroups or without), the shared
/// helpers, then the kernel, whose entry point gets the subgroup built-ins it needs.
pub fn kernel_source(body: &str, subgroups: bool) -> String {
    if subgroups {
        let body = body
            .replace(
                "/*SUBGROUP_ARGS*/",
                ", @builtin(subgroup_invocation_id) sg_lane_in: u32, \
                 @builtin(subgroup_id) sg_id_in: u32, @builtin(num_subgroups) sg_count_in: u32",
            )
            .replace(
                "/*SUBGROUP_INIT*/",
                "subgroup_init(sg_lane_in, sg_id_in, sg_count_in);",
            );
        format!("{REDUCE_SUBGROUP}\n{COMMON}\n{body}")
    } else {
        format!("{REDUCE_WORKGROUP}\n{COMMON}\n{body}")
    }
}

/// Element-wise kernels run this many threads per workgroup.
const WG: u32 = 256;
/// Values one `sum_squares` workgroup reduces.
const SUM_BLOCK: usize = 4096;
/// Largest workgroup count in one dimension.
const MAX_GROUPS: u32 = 65535;
/// Dispatches recorded before they are submitted anyway (bounds the encoder's memory).
const MAX_PENDING: usize = 512;
/// The gemm kernel's block of C per workgroup.
const GEMM_TILE: usize = 64;

#[derive(Default)]
struct Pending {
    encoder: Option<wgpu::CommandEncoder>,
    dispatches: usize,
}

/// Runs a stage on a GPU through wgpu.
pub struct WgpuBackend {
    device: wgpu::Device,
    queue: wgpu::Queue,
    adapter: AdapterSummary,
    kernels: Kernels,
    pending: Mutex<Pending>,
    /// The first error the device reported outside an error scope (validation, lost device).
    error: Arc<Mutex<Option<String>>>,
    max_buffer: u64,
    max_binding: u64,
    /// Whether reductions use subgroup operations.
    subgroups: bool,
}

/// Strides of one matrix operand of [`WgpuBackend::gemm`]: element `(i, j)` of batch
/// `(outer, head)` is at `off + outer*so + head*sh + i*rs + j*cs`.
#[derive(Clone, Copy)]
struct Operand {
    off: usize,
    rs: usize,
    cs: usize,
    so: usize,
    sh: usize,
}

impl Operand {
    fn rows(rs: usize) -> Self {
        Operand {
            off: 0,
            rs,
            cs: 1,
            so: 0,
            sh: 0,
        }
    }
    fn cols(cs: usize) -> Self {
        Operand {
            off: 0,
            rs: 1,
            cs,
            so: 0,
            sh: 0,
        }
    }
    fn at(self, off: usize) -> Self {
        Operand { off, ..self }
    }
    fn batched(self, so: usize, sh: usize) -> Self {
        Operand { so, sh, ..self }
    }
}

/// Shape of a (batched) gemm: `C(m x n) = alpha * A(m x k) * B(k x n)`, `outer * heads` times.
#[derive(Clone, Copy)]
struct GemmShape {
    m: usize,
    n: usize,
    k: usize,
    outer: usize,
    heads: usize,
    alpha: f32,
    accumulate: bool,
}

fn f(v: f32) -> u32 {
    v.to_bits()
}

/// A grid of `groups` workgroups, folded into two dimensions when it is too long for one.
fn grid(groups: usize) -> (u32, u32, u32) {
    let groups = dim(groups.max(1));
    if groups <= MAX_GROUPS {
        (groups, 1, 1)
    } else {
        (MAX_GROUPS, groups.div_ceil(MAX_GROUPS), 1)
    }
}

fn elementwise(n: usize) -> (u32, u32, u32) {
    grid(n.div_ceil(WG as usize))
}

impl WgpuBackend {
    /// The adapter `index` of [`adapters`], or the best one (discrete, then integrated, then
    /// anything else) when `None`; reductions use subgroups where the adapter has them.
    pub fn new(index: Option<usize>) -> Result<Self> {
        Self::with_subgroups(index, true)
    }

    /// As [`WgpuBackend::new`], using subgroup operations only if `subgroups` is true and the
    /// adapter has them (false forces the workgroup-memory reductions everywhere).
    pub fn with_subgroups(index: Option<usize>, subgroups: bool) -> Result<Self> {
        let adapters = enumerate();
        let chosen = match index {
            Some(i) => adapters.into_iter().nth(i).map(|a| (i, a)).ok_or_else(|| {
                device_error(format!("no wgpu adapter {i} (see `shoal devices`)"))
            })?,
            None => adapters
                .into_iter()
                .enumerate()
                .min_by_key(|(_, a)| kind_of(a.get_info().device_type))
                .ok_or_else(|| {
                    device_error(
                        "no wgpu adapter found (no Vulkan, Metal or DirectX 12 driver; on Linux \
                         without a GPU, Mesa's lavapipe provides one: mesa-vulkan-drivers)",
                    )
                })?,
        };
        let (index, adapter) = chosen;
        let summary = summary(index, &adapter);
        let subgroups = subgroups && summary.subgroups.is_some();
        // Ask for everything the adapter allows: big models need big storage bindings.
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("shoal"),
            required_features: if subgroups {
                wgpu::Features::SUBGROUP
            } else {
                wgpu::Features::empty()
            },
            required_limits: limits.clone(),
            memory_hints: wgpu::MemoryHints::Performance,
            ..Default::default()
        }))
        .map_err(|e| device_error(format!("{}: {e}", summary.name)))?;
        let error = Arc::new(Mutex::new(None::<String>));
        let sink = error.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut slot = sink.lock().unwrap_or_else(|p| p.into_inner());
            slot.get_or_insert_with(|| e.to_string());
        }));
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let build = |name: &str| -> wgpu::ComputePipeline {
            let body = KERNEL_SOURCES
                .iter()
                .find(|(n, _)| *n == name)
                .map_or("", |(_, s)| s);
            let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(name),
                source: wgpu::ShaderSource::Wgsl(kernel_source(body, subgroups).into()),
            });
            device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(name),
                layout: None,
                module: &module,
                entry_point: Some("main"),
                compilation_options: Default::default(),
                cache: None,
            })
        };
        let kernels = Kernels {
            fill: build("fill"),
            add: build("add"),
            add_assign: build("add_assign"),
            broadcast_rows: build("broadcast_rows"),
            sum_squares: build("sum_squares"),
            gelu_forward: build("gelu_forward"),
            gelu_backward: build("gelu_backward"),
            adamw: build("adamw"),
            embedding_forward: build("embedding_forward"),
            embedding_backward_wpe: build("embedding_backward_wpe"),
            embedding_backward_wte: build("embedding_backward_wte"),
            layernorm_forward: build("layernorm_forward"),
            layernorm_backward_input: build("layernorm_backward_input"),
            layernorm_backward_params: build("layernorm_backward_params"),
            column_sum: build("column_sum"),
            gemm: build("gemm"),
            attention_softmax: build("attention_softmax"),
            attention_softmax_backward: build("attention_softmax_backward"),
            cross_entropy_forward: build("cross_entropy_forward"),
            cross_entropy_backward: build("cross_entropy_backward"),
        };
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(device_error(format!("compiling kernels: {e}")));
        }
        Ok(WgpuBackend {
            device,
            queue,
            adapter: summary,
            kernels,
            pending: Mutex::new(Pending::default()),
            error,
            max_buffer: limits.max_buffer_size,
            max_binding: limits.max_storage_buffer_binding_size,
            subgroups,
        })
    }

    /// The adapter this backend runs on.
    pub fn adapter(&self) -> &AdapterSummary {
        &self.adapter
    }

    /// Whether its reductions use subgroup operations.
    pub fn uses_subgroups(&self) -> bool {
        self.subgroups
    }

    fn pending(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fails with the first error the device reported, if any.
    fn check_device(&self) -> Result<()> {
        let slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        match slot.as_ref() {
            Some(e) => Err(device_error(e)),
            None => Ok(()),
        }
    }

    /// Submits what `p` recorded. Callers hold the lock on it until their own queue operation
    /// is issued too: a write staged while another thread holds commands recorded before it
    /// would otherwise run ahead of them (wgpu applies staged writes before the next submit).
    fn submit(&self, p: &mut Pending) {
        p.dispatches = 0;
        if let Some(encoder) = p.encoder.take() {
            self.queue.submit([encoder.finish()]);
        }
    }

    /// Submits everything recorded so far.
    fn flush(&self) -> Result<()> {
        self.submit(&mut self.pending());
        self.check_device()
    }

    fn buffer(&self, bytes: u64, usage: wgpu::BufferUsages) -> Result<wgpu::Buffer> {
        // wgpu rejects empty bindings; a zero-length tensor gets one word nobody reads.
        let size = bytes.max(4);
        if size > self.max_buffer || size > self.max_binding {
            return Err(BackendError::OutOfMemory {
                backend: format!("wgpu ({})", self.adapter.name),
                bytes: size as usize,
            });
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size,
            usage,
            mapped_at_creation: false,
        });
        match pollster::block_on(scope.pop()) {
            None => Ok(buf),
            Some(_) => Err(BackendError::OutOfMemory {
                backend: format!("wgpu ({})", self.adapter.name),
                bytes: size as usize,
            }),
        }
    }

    fn storage(&self, bytes: u64) -> Result<wgpu::Buffer> {
        self.buffer(
            bytes,
            wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
        )
    }

    /// Records one dispatch of `kernel` with `params` (padded to a 16-byte uniform) bound at
    /// binding 0 and `buffers` at bindings 1, 2, ...
    fn dispatch(
        &self,
        kernel: &wgpu::ComputePipeline,
        params: &[u32],
        buffers: &[&wgpu::Buffer],
        groups: (u32, u32, u32),
    ) -> Result<()> {
        let mut words = params.to_vec();
        words.resize(params.len().div_ceil(4).max(1) * 4, 0);
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let uniform = self
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: None,
                contents: &bytes,
                usage: wgpu::BufferUsages::UNIFORM,
            });
        let layout = kernel.get_bind_group_layout(0);
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: uniform.as_entire_binding(),
        }];
        for (i, b) in buffers.iter().enumerate() {
            entries.push(wgpu::BindGroupEntry {
                binding: i as u32 + 1,
                resource: b.as_entire_binding(),
            });
        }
        let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &layout,
            entries: &entries,
        });
        let full = {
            let mut p = self.pending();
            let encoder = p.encoder.get_or_insert_with(|| {
                self.device
                    .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None })
            });
            {
                let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
                pass.set_pipeline(kernel);
                pass.set_bind_group(0, &group, &[]);
                pass.dispatch_workgroups(groups.0, groups.1, groups.2);
            }
            p.dispatches += 1;
            p.dispatches >= MAX_PENDING
        };
        if full { self.flush() } else { Ok(()) }
    }

    /// Copies `bytes` of `src` to the host.
    fn read(&self, src: &wgpu::Buffer, bytes: u64) -> Result<Vec<u8>> {
        if bytes == 0 {
            return Ok(Vec::new());
        }
        let staging = self.buffer(
            bytes,
            wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        )?;
        {
            let mut p = self.pending();
            let encoder = p.encoder.get_or_insert_with(|| {
                self.device
                    .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None })
            });
            encoder.copy_buffer_to_buffer(src, 0, &staging, 0, bytes);
            self.submit(&mut p);
        }
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(device_error)?;
        self.check_device()?;
        rx.recv()
            .map_err(device_error)?
            .map_err(|e| device_error(format!("reading a buffer back: {e}")))?;
        let data = staging.get_mapped_range(..).map_err(device_error)?.to_vec();
        staging.unmap();
        Ok(data)
    }

    fn gemm(
        &self,
        c: &wgpu::Buffer,
        a: (&wgpu::Buffer, Operand),
        b: (&wgpu::Buffer, Operand),
        co: Operand,
        s: GemmShape,
    ) -> Result<()> {
        if s.m == 0 || s.n == 0 {
            return Ok(());
        }
        let (ab, ao) = a;
        let (bb, bo) = b;
        let params = [
            s.m,
            s.n,
            s.k,
            s.heads.max(1),
            ao.off,
            ao.rs,
            ao.cs,
            ao.so,
            ao.sh,
            bo.off,
            bo.rs,
            bo.cs,
            bo.so,
            bo.sh,
            co.off,
            co.rs,
            co.cs,
            co.so,
            co.sh,
            usize::from(s.accumulate),
        ]
        .map(dim);
        let mut words = params.to_vec();
        words.push(f(s.alpha));
        let groups = (
            dim(s.n.div_ceil(GEMM_TILE)),
            dim(s.m.div_ceil(GEMM_TILE)),
            dim(s.outer * s.heads.max(1)),
        );
        self.dispatch(&self.kernels.gemm, &words, &[ab, bb, c], groups)
    }
}

fn check(buf: &WgpuBuffer, len: usize, what: &str) {
    check_len(buf.len, len, what);
}

fn bytes_of(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

impl Backend for WgpuBackend {
    type Buffer = WgpuBuffer;
    type Tokens = WgpuTokens;

    fn name(&self) -> String {
        format!(
            "wgpu ({}, {} {}{})",
            self.adapter.name,
            self.adapter.kind,
            self.adapter.api,
            if self.subgroups { ", subgroups" } else { "" }
        )
    }

    fn alloc(&self, len: usize) -> Result<WgpuBuffer> {
        let buf = self.storage(len as u64 * 4)?;
        // Fresh buffers are zeroed by wgpu.
        Ok(WgpuBuffer { buf, len })
    }

    fn upload(&self, host: &[f32]) -> Result<WgpuBuffer> {
        let mut b = self.alloc(host.len())?;
        self.write(&mut b, host)?;
        Ok(b)
    }

    fn write(&self, buf: &mut WgpuBuffer, host: &[f32]) -> Result<()> {
        check_host_len(buf.len, host.len())?;
        if host.is_empty() {
            return Ok(());
        }
        let mut p = self.pending();
        self.submit(&mut p);
        self.queue.write_buffer(&buf.buf, 0, &bytes_of(host));
        drop(p);
        self.check_device()
    }

    fn download(&self, buf: &WgpuBuffer, host: &mut [f32]) -> Result<()> {
        check_host_len(buf.len, host.len())?;
        let data = self.read(&buf.buf, buf.len as u64 * 4)?;
        for (h, c) in host.iter_mut().zip(data.chunks_exact(4)) {
            *h = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        Ok(())
    }

    fn upload_tokens(&self, tokens: &[u32]) -> Result<WgpuTokens> {
        let buf = self.storage(tokens.len() as u64 * 4)?;
        if !tokens.is_empty() {
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            let mut p = self.pending();
            self.submit(&mut p);
            self.queue.write_buffer(&buf, 0, &bytes);
        }
        Ok(WgpuTokens {
            buf,
            len: tokens.len(),
        })
    }

    fn len(&self, buf: &WgpuBuffer) -> usize {
        buf.len
    }

    fn fill(&self, buf: &mut WgpuBuffer, value: f32) -> Result<()> {
        let n = buf.len;
        self.dispatch(
            &self.kernels.fill,
            &[dim(n), f(value)],
            &[&buf.buf],
            elementwise(n),
        )
    }

    fn copy(&self, dst: &mut WgpuBuffer, src: &WgpuBuffer) -> Result<()> {
        check(dst, src.len, "copy");
        if src.len == 0 {
            return Ok(());
        }
        let mut p = self.pending();
        let encoder = p.encoder.get_or_insert_with(|| {
            self.device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None })
        });
        encoder.copy_buffer_to_buffer(&src.buf, 0, &dst.buf, 0, src.len as u64 * 4);
        Ok(())
    }

    fn add_assign(&self, acc: &mut WgpuBuffer, x: &WgpuBuffer) -> Result<()> {
        check(acc, x.len, "add_assign");
        let n = acc.len;
        self.dispatch(
            &self.kernels.add_assign,
            &[dim(n)],
            &[&acc.buf, &x.buf],
            elementwise(n),
        )
    }

    fn sum_squares(&self, buf: &WgpuBuffer) -> Result<f64> {
        let blocks = buf.len.div_ceil(SUM_BLOCK);
        if blocks == 0 {
            return Ok(0.0);
        }
        let partials = self.storage(blocks as u64 * 4)?;
        self.dispatch(
            &self.kernels.sum_squares,
            &[dim(buf.len)],
            &[&partials, &buf.buf],
            grid(blocks),
        )?;
        let data = self.read(&partials, blocks as u64 * 4)?;
        Ok(data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .sum())
    }

    fn embedding_forward(
        &self,
        out: &mut WgpuBuffer,
        tokens: &WgpuTokens,
        wte: &WgpuBuffer,
        wpe: &WgpuBuffer,
        batch: usize,
        seq: usize,
        width: usize,
    ) -> Result<()> {
        check(out, batch * seq * width, "embedding out");
        assert_eq!(tokens.len, batch * seq);
        assert!(wpe.len >= seq * width);
        let n = out.len;
        let vocab = wte.len / width.max(1);
        self.dispatch(
            &self.kernels.embedding_forward,
            &[dim(n), dim(seq), dim(width), dim(vocab)],
            &[&out.buf, &tokens.buf, &wte.buf, &wpe.buf],
            elementwise(n),
        )
    }

    fn embedding_backward(
        &self,
        dwte: &mut WgpuBuffer,
        dwpe: &mut WgpuBuffer,
        dout: &WgpuBuffer,
        tokens: &WgpuTokens,
        batch: usize,
        seq: usize,
        width: usize,
    ) -> Result<()> {
        check(dout, batch * seq * width, "embedding dout");
        assert_eq!(tokens.len, batch * seq);
        let n = seq * width;
        self.dispatch(
            &self.kernels.embedding_backward_wpe,
            &[dim(n), dim(seq), dim(width), dim(batch)],
            &[&dwpe.buf, &dout.buf],
            elementwise(n),
        )?;
        let vocab = dwte.len / width.max(1);
        self.dispatch(
            &self.kernels.embedding_backward_wte,
            &[dim(batch * seq), dim(width), dim(vocab)],
            &[&dwte.buf, &dout.buf, &tokens.buf],
            elementwise(width),
        )
    }

    fn layernorm_forward(
        &self,
        out: &mut WgpuBuffer,
        mean: &mut WgpuBuffer,
        rstd: &mut WgpuBuffer,
        inp: &WgpuBuffer,
        weight: &WgpuBuffer,
        bias: &WgpuBuffer,
        s: RowShape,
    ) -> Result<()> {
        s.check_layernorm(
            &[out.len, inp.len],
            [mean.len, rstd.len],
            [weight.len, bias.len],
        );
        self.dispatch(
            &self.kernels.layernorm_forward,
            &[dim(s.rows), dim(s.width)],
            &[
                &out.buf,
                &mean.buf,
                &rstd.buf,
                &inp.buf,
                &weight.buf,
                &bias.buf,
            ],
            grid(s.rows),
        )
    }

    fn layernorm_backward(
        &self,
        dinp: &mut WgpuBuffer,
        dweight: &mut WgpuBuffer,
        dbias: &mut WgpuBuffer,
        dout: &WgpuBuffer,
        inp: &WgpuBuffer,
        weight: &WgpuBuffer,
        mean: &WgpuBuffer,
        rstd: &WgpuBuffer,
        s: RowShape,
    ) -> Result<()> {
        s.check_layernorm(
            &[dinp.len, dout.len, inp.len],
            [mean.len, rstd.len],
            [dweight.len, dbias.len],
        );
        let shape = [dim(s.rows), dim(s.width)];
        self.dispatch(
            &self.kernels.layernorm_backward_input,
            &shape,
            &[
                &dinp.buf,
                &dout.buf,
                &inp.buf,
                &weight.buf,
                &mean.buf,
                &rstd.buf,
            ],
            grid(s.rows),
        )?;
        self.dispatch(
            &self.kernels.layernorm_backward_params,
            &shape,
            &[
                &dweight.buf,
                &dbias.buf,
                &dout.buf,
                &inp.buf,
                &mean.buf,
                &rstd.buf,
            ],
            elementwise(s.width),
        )
    }

    fn matmul_forward(
        &self,
        out: &mut WgpuBuffer,
        inp: &WgpuBuffer,
        weight: &WgpuBuffer,
        bias: Option<&WgpuBuffer>,
        s: MatmulShape,
    ) -> Result<()> {
        let (n, c, oc) = (s.rows, s.input, s.output);
        s.check_forward(out.len, inp.len, weight.len);
        if let Some(bias) = bias {
            check(bias, oc, "matmul bias");
            self.dispatch(
                &self.kernels.broadcast_rows,
                &[dim(out.len), dim(oc)],
                &[&out.buf, &bias.buf],
                elementwise(out.len),
            )?;
        }
        // out(n x oc) = inp(n x c) · Wᵀ(c x oc); Wᵀ(k, j) = W[j*c + k].
        self.gemm(
            &out.buf,
            (&inp.buf, Operand::rows(c)),
            (&weight.buf, Operand::cols(c)),
            Operand::rows(oc),
            GemmShape {
                m: n,
                n: oc,
                k: c,
                outer: 1,
                heads: 1,
                alpha: 1.0,
                accumulate: bias.is_some(),
            },
        )
    }

    fn matmul_backward(
        &self,
        dinp: &mut WgpuBuffer,
        dweight: &mut WgpuBuffer,
        dbias: Option<&mut WgpuBuffer>,
        dout: &WgpuBuffer,
        inp: &WgpuBuffer,
        weight: &WgpuBuffer,
        s: MatmulShape,
    ) -> Result<()> {
        let (n, c, oc) = (s.rows, s.input, s.output);
        s.check_backward(dinp.len, dweight.len, dout.len, inp.len);
        // dinp(n x c) = dout(n x oc) · W(oc x c)
        self.gemm(
            &dinp.buf,
            (&dout.buf, Operand::rows(oc)),
            (&weight.buf, Operand::rows(c)),
            Operand::rows(c),
            GemmShape {
                m: n,
                n: c,
                k: oc,
                outer: 1,
                heads: 1,
                alpha: 1.0,
                accumulate: false,
            },
        )?;
        // dW(oc x c) += doutᵀ(oc x n) · inp(n x c); doutᵀ(i, k) = dout[k*oc + i].
        self.gemm(
            &dweight.buf,
            (&dout.buf, Operand::cols(oc)),
            (&inp.buf, Operand::rows(c)),
            Operand::rows(c),
            GemmShape {
                m: oc,
                n: c,
                k: n,
                outer: 1,
                heads: 1,
                alpha: 1.0,
                accumulate: true,
            },
        )?;
        if let Some(dbias) = dbias {
            check(dbias, oc, "matmul dbias");
            self.dispatch(
                &self.kernels.column_sum,
                &[dim(n), dim(oc)],
                &[&dbias.buf, &dout.buf],
                elementwise(oc),
            )?;
        }
        Ok(())
    }

    fn attention_forward(
        &self,
        out: &mut WgpuBuffer,
        probs: &mut WgpuBuffer,
        qkv: &WgpuBuffer,
        s: AttentionShape,
    ) -> Result<()> {
        let (b, t, c, nh) = (s.batch, s.seq, s.width, s.heads);
        let hs = c / nh;
        s.check_forward(out.len, probs.len, qkv.len);
        let scale = 1.0 / (hs as f32).sqrt();
        let seq_stride = t * 3 * c;
        let batched = |shape: GemmShape| GemmShape {
            outer: b,
            heads: nh,
            ..shape
        };
        // scores(t x t) = Q(t x hs) · Kᵀ(hs x t) · scale, per (sequence, head).
        self.gemm(
            &probs.buf,
            (&qkv.buf, Operand::rows(3 * c).batched(seq_stride, hs)),
            (&qkv.buf, Operand::cols(3 * c).at(c).batched(seq_stride, hs)),
            Operand::rows(t).batched(nh * t * t, t * t),
            batched(GemmShape {
                m: t,
                n: t,
                k: hs,
                outer: 1,
                heads: 1,
                alpha: scale,
                accumulate: false,
            }),
        )?;
        self.dispatch(
            &self.kernels.attention_softmax,
            &[dim(b * nh * t), dim(t)],
            &[&probs.buf],
            grid(b * nh * t),
        )?;
        // out[bi, :, h] (t x hs) = P(t x t) · V(t x hs)
        self.gemm(
            &out.buf,
            (&probs.buf, Operand::rows(t).batched(nh * t * t, t * t)),
            (
                &qkv.buf,
                Operand::rows(3 * c).at(2 * c).batched(seq_stride, hs),
            ),
            Operand::rows(c).batched(t * c, hs),
            batched(GemmShape {
                m: t,
                n: hs,
                k: t,
                outer: 1,
                heads: 1,
                alpha: 1.0,
                accumulate: false,
            }),
        )
    }

    fn attention_backward(
        &self,
        dqkv: &mut WgpuBuffer,
        scratch: &mut WgpuBuffer,
        dout: &WgpuBuffer,
        qkv: &WgpuBuffer,
        probs: &WgpuBuffer,
        s: AttentionShape,
    ) -> Result<()> {
        let (b, t, c, nh) = (s.batch, s.seq, s.width, s.heads);
        let hs = c / nh;
        s.check_backward(dqkv.len, scratch.len, dout.len, probs.len);
        let scale = 1.0 / (hs as f32).sqrt();
        let seq_stride = t * 3 * c;
        let square = Operand::rows(t).batched(nh * t * t, t * t);
        let square_t = Operand::cols(t).batched(nh * t * t, t * t);
        let grad_out = Operand::rows(c).batched(t * c, hs);
        let q = Operand::rows(3 * c).batched(seq_stride, hs);
        let k = q.at(c);
        let v = q.at(2 * c);
        let shape = |m, n, inner| GemmShape {
            m,
            n,
            k: inner,
            outer: b,
            heads: nh,
            alpha: 1.0,
            accumulate: false,
        };
        // dP(t x t) = dO(t x hs) · Vᵀ
        self.gemm(
            &scratch.buf,
            (&dout.buf, grad_out),
            (
                &qkv.buf,
                Operand::cols(3 * c).at(2 * c).batched(seq_stride, hs),
            ),
            square,
            shape(t, t, hs),
        )?;
        // dV = Pᵀ(t x t) · dO(t x hs)
        self.gemm(
            &dqkv.buf,
            (&probs.buf, square_t),
            (&dout.buf, grad_out),
            v,
            shape(t, hs, t),
        )?;
        self.dispatch(
            &self.kernels.attention_softmax_backward,
            &[dim(b * nh * t), dim(t), f(scale)],
            &[&scratch.buf, &probs.buf],
            grid(b * nh * t),
        )?;
        // dQ = dS(t x t) · K(t x hs); dK = dSᵀ · Q
        self.gemm(
            &dqkv.buf,
            (&scratch.buf, square),
            (&qkv.buf, k),
            q,
            shape(t, hs, t),
        )?;
        self.gemm(
            &dqkv.buf,
            (&scratch.buf, square_t),
            (&qkv.buf, q),
            k,
            shape(t, hs, t),
        )
    }

    fn gelu_forward(&self, out: &mut WgpuBuffer, inp: &WgpuBuffer) -> Result<()> {
        check(out, inp.len, "gelu out");
        self.dispatch(
            &self.kernels.gelu_forward,
            &[dim(inp.len)],
            &[&out.buf, &inp.buf],
            elementwise(inp.len),
        )
    }

    fn gelu_backward(
        &self,
        dinp: &mut WgpuBuffer,
        inp: &WgpuBuffer,
        dout: &WgpuBuffer,
    ) -> Result<()> {
        check(dinp, inp.len, "gelu dinp");
        check(dout, inp.len, "gelu dout");
        self.dispatch(
            &self.kernels.gelu_backward,
            &[dim(inp.len)],
            &[&dinp.buf, &inp.buf, &dout.buf],
            elementwise(inp.len),
        )
    }

    fn residual_forward(&self, out: &mut WgpuBuffer, a: &WgpuBuffer, b: &WgpuBuffer) -> Result<()> {
        check(out, a.len, "residual out");
        check(b, a.len, "residual b");
        self.dispatch(
            &self.kernels.add,
            &[dim(a.len)],
            &[&out.buf, &a.buf, &b.buf],
            elementwise(a.len),
        )
    }

    fn softmax_cross_entropy_forward(
        &self,
        logits: &mut WgpuBuffer,
        losses: &mut WgpuBuffer,
        targets: &WgpuTokens,
        s: RowShape,
    ) -> Result<()> {
        s.check_cross_entropy(logits.len, targets.len);
        check(losses, s.rows, "cross-entropy losses");
        self.dispatch(
            &self.kernels.cross_entropy_forward,
            &[dim(s.rows), dim(s.width)],
            &[&logits.buf, &losses.buf, &targets.buf],
            grid(s.rows),
        )
    }

    fn softmax_cross_entropy_backward(
        &self,
        probs: &mut WgpuBuffer,
        targets: &WgpuTokens,
        s: RowShape,
        scale: f32,
    ) -> Result<()> {
        s.check_cross_entropy(probs.len, targets.len);
        let n = s.rows * s.width;
        self.dispatch(
            &self.kernels.cross_entropy_backward,
            &[dim(n), dim(s.width), f(scale)],
            &[&probs.buf, &targets.buf],
            elementwise(n),
        )
    }

    fn adamw(
        &self,
        param: &mut WgpuBuffer,
        grad: &WgpuBuffer,
        m: &mut WgpuBuffer,
        v: &mut WgpuBuffer,
        u: &AdamWUpdate,
    ) -> Result<()> {
        let n = param.len;
        check(grad, n, "adamw grad");
        check(m, n, "adamw m");
        check(v, n, "adamw v");
        let (bc1, bc2) = u.bias_corrections();
        self.dispatch(
            &self.kernels.adamw,
            &[
                dim(n),
                f(u.lr),
                f(u.beta1),
                f(u.beta2),
                f(u.eps),
                f(u.weight_decay),
                f(bc1),
                f(bc2),
                f(u.grad_scale),
            ],
            &[&param.buf, &grad.buf, &m.buf, &v.buf],
            elementwise(n),
        )
    }
}
