#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, missing_docs)]
//! The CUDA backend: its kernels compile with NVRTC, and on a machine with an NVIDIA GPU it
//! agrees with the CPU reference (see `agreement/mod.rs` for what is checked and the
//! tolerances).
//!
//! The agreement tests need an NVIDIA GPU, so they are ignored by default (the test summary
//! lists them as ignored, with the reason, not as passed); on a machine with one, run
//! `cargo test -p shoal-compute --test cuda -- --include-ignored`, where they fail if no CUDA
//! device works. The compile test needs only the NVRTC library: `./.ci/test` fetches it from
//! the `nvidia-cuda-nvrtc-cu12` wheel; without it the test fails, unless `SHOAL_SKIP_NVRTC=1`
//! says to skip it, which it reports.

#[macro_use]
mod agreement;

use shoal_compute::backend::cuda::{CudaBackend, compile_kernels, missing_libraries};
use shoal_compute::{Backend, Preset, StageSpec};
use std::sync::{Arc, OnceLock};

/// The CUDA backend on device 0, built once for the whole file.
fn gpu() -> Option<Arc<CudaBackend>> {
    static GPU: OnceLock<Arc<CudaBackend>> = OnceLock::new();
    let b = GPU.get_or_init(|| match CudaBackend::new(0) {
        Ok(b) => {
            eprintln!("CUDA tests run on {}", b.name());
            Arc::new(b)
        }
        Err(e) => panic!("the CUDA agreement tests need a CUDA device: {e}"),
    });
    Some(b.clone())
}

agreement_tests!(gpu, #[ignore = "needs an NVIDIA GPU: run with --include-ignored where there is one"]);

#[test]
fn every_kernel_compiles_with_nvrtc() {
    let missing = missing_libraries();
    if missing.iter().any(|m| m.contains("NVRTC")) {
        assert!(
            std::env::var_os("SHOAL_SKIP_NVRTC").is_some(),
            "NVRTC (libnvrtc.so) is not on the library path: run ./.ci/test, which fetches it, \
             or set SHOAL_SKIP_NVRTC=1 to skip this test"
        );
        eprintln!("SKIPPED: NVRTC (libnvrtc.so) not found; the CUDA kernels were not compiled");
        return;
    }
    let ptx = compile_kernels().unwrap();
    let text = ptx.to_src();
    for kernel in [
        "layernorm_forward",
        "attention_softmax",
        "cross_entropy_forward",
        "adamw",
    ] {
        assert!(text.contains(kernel), "{kernel} missing from the PTX");
    }
}
