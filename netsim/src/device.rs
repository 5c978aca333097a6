//! Modelled devices: how long a compute job takes, and how much memory a stage may use.
//!
//! A job's duration is a fixed per-job overhead (kernel launches and synchronisation on a GPU,
//! thread wake-ups on a CPU) plus its FLOPs at the device's effective training throughput.
//! Effective throughput is what shoal's fp32 training kernels can sustain, not the marketing
//! peak: the vendor's dense fp32 figure times a utilisation typical of fp32 training
//! (about 50% on NVIDIA and Apple GPUs, 35% on RDNA3 whose dual-issue peak is rarely reached;
//! the CPU figure is what the CPU backend measures with `shoal bench compute` on an 8-core
//! desktop). Memory is what a stage may use: the card's memory less room for the runtime, and
//! for Apple's unified memory about three quarters of the machine's.

use shoal_protocol::swarm::{Job, StageCosts};
use std::time::Duration;

/// A device model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceProfile {
    /// Preset name.
    pub name: &'static str,
    /// Effective training FLOP/s for shoal's fp32 kernels.
    pub flops: f64,
    /// Bytes a stage may use.
    pub memory: u64,
    /// Bytes per second between host memory and the device (PCIe 4.0 x16 moves about 25 GB/s
    /// in practice, 3.0 x16 about 12); 0 where the device computes in host memory (a CPU,
    /// unified memory), so that offloading to the host frees nothing.
    pub host_link: f64,
    /// Fixed cost of any job.
    pub job_overhead: Duration,
    /// Where the figures come from.
    pub note: &'static str,
}

const GIB: u64 = 1 << 30;

/// The device presets.
pub const DEVICES: [DeviceProfile; 10] = [
    DeviceProfile {
        name: "cpu",
        flops: 0.15e12,
        memory: 16 * GIB,
        host_link: 0.0,
        job_overhead: Duration::from_micros(50),
        note: "8-core AVX2 desktop, shoal's CPU backend (gemm), 16 GiB for the stage",
    },
    DeviceProfile {
        name: "t4",
        flops: 4.0e12,
        memory: 15 * GIB,
        host_link: 12e9,
        job_overhead: Duration::from_micros(300),
        note: "NVIDIA T4: 8.1 TFLOP/s fp32 peak x 0.5; 16 GB",
    },
    DeviceProfile {
        name: "rtx3090",
        flops: 17.8e12,
        memory: 23 * GIB,
        host_link: 25e9,
        job_overhead: Duration::from_micros(200),
        note: "NVIDIA RTX 3090: 35.6 TFLOP/s fp32 peak x 0.5; 24 GB",
    },
    DeviceProfile {
        name: "rtx4090",
        flops: 41.3e12,
        memory: 23 * GIB,
        host_link: 25e9,
        job_overhead: Duration::from_micros(150),
        note: "NVIDIA RTX 4090: 82.6 TFLOP/s fp32 peak x 0.5; 24 GB",
    },
    DeviceProfile {
        name: "a100",
        flops: 9.7e12,
        memory: 78 * GIB,
        host_link: 25e9,
        job_overhead: Duration::from_micros(150),
        note: "NVIDIA A100 80GB: 19.5 TFLOP/s fp32 (no TF32) peak x 0.5",
    },
    DeviceProfile {
        name: "h100",
        flops: 33.5e12,
        memory: 78 * GIB,
        host_link: 50e9,
        job_overhead: Duration::from_micros(100),
        note: "NVIDIA H100 SXM: 67 TFLOP/s fp32 (no TF32) peak x 0.5; 80 GB",
    },
    DeviceProfile {
        name: "m2-max",
        flops: 6.8e12,
        memory: 24 * GIB,
        host_link: 0.0,
        job_overhead: Duration::from_micros(300),
        note: "Apple M2 Max 38-core GPU: 13.6 TFLOP/s fp32 peak x 0.5; 3/4 of 32 GB unified",
    },
    DeviceProfile {
        name: "rx7900xtx",
        flops: 21.5e12,
        memory: 23 * GIB,
        host_link: 25e9,
        job_overhead: Duration::from_micros(200),
        note: "AMD RX 7900 XTX: 61.4 TFLOP/s fp32 dual-issue peak x 0.35; 24 GB",
    },
    DeviceProfile {
        name: "rtx3060",
        flops: 6.4e12,
        memory: 11 * GIB,
        host_link: 25e9,
        job_overhead: Duration::from_micros(200),
        note: "NVIDIA RTX 3060: 12.7 TFLOP/s fp32 peak x 0.5; 12 GB; PCIe 4.0 x16",
    },
    DeviceProfile {
        name: "gtx1650",
        flops: 1.5e12,
        memory: 3 * GIB + GIB / 2,
        host_link: 12e9,
        job_overhead: Duration::from_micros(300),
        note: "NVIDIA GTX 1650: 3.0 TFLOP/s fp32 peak x 0.5; 4 GB; PCIe 3.0 x16",
    },
];

/// What a stage costs a device that cannot hold all of it and keeps its blocks in host
/// memory, bringing each to the device when a pass needs it (as `Stage::with_memory_limit`
/// does; the copies are not overlapped with compute in this model, which is what the
/// backends do today).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StageOffload {
    /// Device bytes the stage needs with every block on the device.
    pub resident: u64,
    /// Parameters of one block.
    pub block_params: u64,
    /// Blocks in the stage.
    pub blocks: u64,
}

impl StageOffload {
    /// Bytes a forward and a backward pass move between host and device on a device with
    /// `memory` bytes: the blocks that do not fit (it keeps two at least) come in for each
    /// pass, their parameters forward, parameters and gradients backward, and the gradients
    /// go back.
    pub fn traffic(&self, memory: u64) -> (u64, u64) {
        if memory == 0 || memory >= self.resident || self.blocks <= 2 {
            return (0, 0);
        }
        let block = 8 * self.block_params;
        let streamed = (self.resident - memory)
            .div_ceil(block.max(1))
            .min(self.blocks - 2);
        let values = streamed * self.block_params;
        (4 * values, 12 * values)
    }
}

impl DeviceProfile {
    /// The preset called `name`.
    pub fn named(name: &str) -> Result<DeviceProfile, String> {
        crate::preset(&DEVICES, name, "device", |d| d.name)
    }

    /// How long `job` takes on this device for a peer serving `stage` (`offload`: what that
    /// stage costs where it does not fit, see [`StageOffload`]).
    pub fn job_time(
        &self,
        job: &Job,
        stage: Option<u32>,
        costs: &StageCosts,
        offload: Option<&StageOffload>,
    ) -> Duration {
        let s = stage.unwrap_or(0) as usize;
        let per_sample = costs.flops_per_sample.get(s).copied().unwrap_or(0.0);
        let params = costs.params.get(s).copied().unwrap_or(0) as f64;
        // Forward is a third of a training pass, backward two thirds. Optimizer and state
        // work is elementwise over the parameters: counted as a few FLOPs per parameter.
        let flops = match job {
            Job::Forward { rows, .. } => per_sample * *rows as f64 / 3.0,
            Job::Backward { rows, .. } => per_sample * *rows as f64 * 2.0 / 3.0,
            Job::Step { .. } | Job::LocalStep | Job::OuterStep { .. } => 12.0 * params,
            Job::Init { .. }
            | Job::Restart { .. }
            | Job::Import { .. }
            | Job::Export { .. }
            | Job::TakeGradient
            | Job::TakePseudoGradient
            | Job::Checkpoint { .. } => 2.0 * params,
            Job::Commit { .. } | Job::Abort { .. } => 0.0,
        };
        let (forward, backward) = match (offload, self.host_link > 0.0) {
            (Some(o), true) => o.traffic(self.memory),
            _ => (0, 0),
        };
        let moved = match job {
            Job::Forward { .. } => forward,
            Job::Backward { .. } => backward,
            _ => 0,
        };
        let copies = if moved > 0 {
            moved as f64 / self.host_link
        } else {
            0.0
        };
        self.job_overhead + Duration::from_secs_f64(flops / self.flops + copies)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_found_and_unknown_names_listed() {
        for d in DEVICES {
            assert_eq!(DeviceProfile::named(d.name), Ok(d));
            assert!(d.flops > 0.0 && d.memory > 0);
        }
        let e = DeviceProfile::named("tpu").unwrap_err();
        assert!(e.contains("rtx4090"), "{e}");
    }

    #[test]
    fn a_forward_pass_takes_a_third_of_a_training_pass() {
        let costs = StageCosts {
            flops_per_sample: vec![3e9],
            params: vec![1000],
            activation_values: 8,
            memory: vec![0],
            offload_memory: vec![0],
            microbatch_memory: vec![0],
            param_scale: 1,
        };
        let d = DeviceProfile::named("t4").unwrap();
        let fwd = Job::Forward {
            id: 1,
            rows: 4,
            sample: 0,
            input: shoal_protocol::swarm::Input::Tokens,
            held_out: false,
        };
        let t = d.job_time(&fwd, Some(0), &costs, None) - d.job_overhead;
        assert!((t.as_secs_f64() - 4.0 * 1e9 / 4.0e12).abs() < 1e-9);
        // Offloading: the blocks that do not fit cross the host link (12 GB/s on a T4).
        let offload = StageOffload {
            resident: d.memory + 8_000_000_000,
            block_params: 1_000_000_000,
            blocks: 4,
        };
        assert_eq!(offload.traffic(d.memory), (4_000_000_000, 12_000_000_000));
        assert_eq!(offload.traffic(offload.resident), (0, 0));
        let t = d.job_time(&fwd, Some(0), &costs, Some(&offload)) - d.job_overhead;
        assert!((t.as_secs_f64() - 4.0 * 1e9 / 4.0e12 - 4.0 / 12.0).abs() < 1e-9);
    }
}
