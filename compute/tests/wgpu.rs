#![cfg(feature = "wgpu")]
#![allow(clippy::unwrap_used, missing_docs)]
//! The wgpu backend against the CPU reference (see `agreement/mod.rs` for what is checked and
//! the tolerances).
//!
//! These tests need a wgpu adapter. In CI it is Mesa's lavapipe (software Vulkan); where no
//! adapter exists they fail, unless `SHOAL_SKIP_WGPU=1` says to skip them, which they report.

#[macro_use]
mod agreement;

use shoal_compute::backend::webgpu::WgpuBackend;
use shoal_compute::{Backend, Preset, StageSpec};
use std::sync::{Arc, OnceLock};

/// The wgpu backend, built once for the whole file (compiling the kernels takes a while on a
/// software driver); `None` only when skipping was asked for.
fn gpu() -> Option<Arc<WgpuBackend>> {
    static GPU: OnceLock<Option<Arc<WgpuBackend>>> = OnceLock::new();
    GPU.get_or_init(|| match WgpuBackend::new(None) {
        Ok(b) => {
            eprintln!("wgpu tests run on {}", b.name());
            Some(Arc::new(b))
        }
        Err(e) if std::env::var_os("SHOAL_SKIP_WGPU").is_some() => {
            eprintln!("SKIPPED: wgpu tests did not run: {e} (SHOAL_SKIP_WGPU is set)");
            None
        }
        Err(e) => panic!(
            "no wgpu adapter: {e}. Install a Vulkan driver (Mesa's lavapipe: apt-get install \
             mesa-vulkan-drivers libvulkan1) or set SHOAL_SKIP_WGPU=1 to skip these tests"
        ),
    })
    .clone()
}

agreement_tests!(gpu);

/// The same backend with subgroup operations off: the reductions every adapter can run.
fn gpu_without_subgroups() -> Option<Arc<WgpuBackend>> {
    static GPU: OnceLock<Option<Arc<WgpuBackend>>> = OnceLock::new();
    GPU.get_or_init(|| {
        let index = gpu()?.adapter().index;
        Some(Arc::new(
            WgpuBackend::with_subgroups(Some(index), false).unwrap(),
        ))
    })
    .clone()
}

/// The workgroup-memory reductions, on an adapter that would otherwise use subgroups.
mod without_subgroups {
    use super::*;
    agreement_tests!(gpu_without_subgroups);
}

#[test]
fn subgroups_are_used_where_the_adapter_has_them() {
    let Some(b) = gpu() else { return };
    assert_eq!(b.uses_subgroups(), b.adapter().subgroups.is_some());
    if let Some(f) = gpu_without_subgroups() {
        assert!(!f.uses_subgroups());
    }
}
