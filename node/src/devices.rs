//! `shoal devices`: the compute backends and adapters this machine has, optionally measured.

use crate::bench::measure;
use crate::cli::DevicesArgs;
use shoal_compute::AnyBackend;
use shoal_compute::memory::host_memory;
use std::sync::Arc;

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Prints the GFLOP/s of a training step of `args.preset` on `backend`, or why it failed.
fn bench(args: &DevicesArgs, backend: anyhow::Result<AnyBackend>) {
    let result = backend.and_then(|b| measure(Arc::new(b), args.preset, 4, None, 1, 3));
    match result {
        Ok(r) => println!(
            "    {:.1} GFLOP/s training {} (batch 4) on {}",
            r.gflops, args.preset, r.backend
        ),
        Err(e) => println!("    measurement failed: {e:#}"),
    }
}

pub fn run(args: DevicesArgs) -> anyhow::Result<()> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let memory = host_memory().map_or_else(|| "memory unknown".into(), gib);
    println!("cpu: {threads} threads, {memory} (backend `cpu`)");
    if args.bench {
        bench(&args, AnyBackend::cpu(0).map_err(Into::into));
    }
    match shoal_compute::backend::CudaBackend::devices() {
        Err(e) => println!("cuda: not available ({e})"),
        Ok(devices) if devices.is_empty() => println!("cuda: no device"),
        Ok(devices) => {
            let missing = shoal_compute::backend::cuda::missing_libraries();
            for (i, (name, memory)) in devices.into_iter().enumerate() {
                println!(
                    "cuda device {i}: {name}, {} (backend `cuda --device {i}`)",
                    gib(memory as u64)
                );
                if !missing.is_empty() {
                    println!("    unusable: not found: {}", missing.join(", "));
                } else if args.bench {
                    bench(&args, AnyBackend::cuda(i).map_err(Into::into));
                }
            }
        }
    }
    {
        let adapters = shoal_compute::backend::webgpu::adapters();
        if adapters.is_empty() {
            println!(
                "wgpu: no adapter (no Vulkan, Metal or DirectX 12 driver found; on Linux without a \
                 GPU, Mesa's lavapipe provides one: mesa-vulkan-drivers)"
            );
        }
        for a in adapters {
            println!(
                "wgpu adapter {}: {} ({}, {}, {}), driver {}, memory unknown to wgpu (state it with \
                 --device-memory), largest buffer {}, {} (backend `wgpu --device {}`)",
                a.index,
                a.name,
                a.vendor,
                a.kind,
                a.api,
                a.driver,
                gib(a.max_buffer),
                a.subgroups
                    .map_or("no subgroups".into(), |(lo, hi)| format!(
                        "subgroups of {lo}-{hi}"
                    )),
                a.index
            );
            if args.bench {
                bench(&args, AnyBackend::wgpu(Some(a.index)).map_err(Into::into));
            }
        }
    }
    Ok(())
}
