//! A stage accounts for the device memory it holds, by kind, and the figure the protocol plans
//! with ([`StageSpec::device_memory_bytes`]) is what it measures; recomputing activations
//! holds less and changes no result.

#![allow(clippy::unwrap_used, missing_docs)]

use shoal_compute::stage::{MicrobatchShape, StageInput, StageOutput};
use shoal_compute::{
    AdamW, Corpus, CpuBackend, DataLoader, LocalPipeline, LrSchedule, MemoryUse, Preset, Residency,
    Shard, Stage, StageSpec,
};
use std::sync::Arc;

/// Runs `in_flight` microbatches of `rows` x `seq` through every stage of `stages`, all
/// forward passes first (the most a stage holds), then the backward passes.
fn check(
    preset: Preset,
    stages: usize,
    rows: usize,
    seq: usize,
    in_flight: usize,
    held: Residency,
) {
    let config = preset.config();
    let backend = Arc::new(CpuBackend::new(2).unwrap());
    let shape = MicrobatchShape { batch: rows, seq };
    for index in 0..stages {
        let spec = StageSpec {
            index,
            count: stages,
        };
        let mut stage = if held.moments_on_host {
            Stage::new_stepped_on_host(backend.clone(), config, spec, 3).unwrap()
        } else {
            Stage::new(backend.clone(), config, spec, 3).unwrap()
        };
        stage.set_recompute(held.recompute).unwrap();
        let tensors = 4 * spec.param_count(&config) as u64;
        let built = MemoryUse {
            parameters: tensors,
            gradients: tensors,
            optimizer: if held.moments_on_host { 0 } else { 2 * tensors },
            activations: 0,
            workspace: 0,
        };
        assert_eq!(stage.memory().now, built);
        assert_eq!(stage.memory().peak, built);
        assert_eq!(
            spec.device_memory_bytes(&config, rows, seq, 0, held),
            built.total()
        );

        let n = rows * seq;
        let tokens: Vec<u32> = (0..n as u32).map(|t| t % config.vocab as u32).collect();
        let acts = vec![0.01f32; n * config.width];
        let targets = spec.is_last().then_some(&tokens[..]);
        let forward = |stage: &mut Stage<CpuBackend>, id| {
            let input = if spec.is_first() {
                StageInput::Tokens(&tokens)
            } else {
                StageInput::Activations(&acts)
            };
            stage.forward(id, shape, input, targets).unwrap()
        };
        let mut per_microbatch = 0;
        for id in 0..in_flight as u64 {
            forward(&mut stage, id);
            let held = stage.memory().now.activations;
            if id == 0 {
                per_microbatch = held;
            }
            assert_eq!(held, (id + 1) * per_microbatch, "stage {index}");
        }
        for id in 0..in_flight as u64 {
            let grad = (!spec.is_last()).then_some(&acts[..]);
            stage.backward(id, grad, 1.0).unwrap();
        }
        let memory = stage.memory();
        // Backward passes keep the buffers for the next microbatches and add their workspace.
        assert_eq!(memory.now.activations, in_flight as u64 * per_microbatch);
        assert!(memory.now.workspace > 0);
        assert_eq!(memory.peak, memory.now, "nothing was freed");
        assert_eq!(
            spec.device_memory_bytes(&config, rows, seq, in_flight, held),
            memory.peak.total(),
            "stage {index} of {stages}: {memory:?}"
        );
        // A second round of the same microbatches allocates nothing.
        for id in 0..in_flight as u64 {
            assert!(matches!(
                (spec.is_last(), forward(&mut stage, id)),
                (true, StageOutput::Loss(_)) | (false, StageOutput::Activations(_))
            ));
        }
        assert_eq!(stage.memory().peak, memory.peak);
    }
}

#[test]
fn a_stage_holds_what_the_plan_says() {
    for recompute in [false, true] {
        for moments_on_host in [false, true] {
            let held = Residency {
                recompute,
                moments_on_host,
            };
            check(Preset::Nano, 3, 2, 32, 3, held);
            check(Preset::Nano, 1, 4, 16, 1, held);
            check(Preset::Micro, 2, 1, 64, 2, held);
        }
    }
    // What recomputation saves where activations dominate: a stage of micro with 8 in flight.
    let (config, spec) = (Preset::Micro.config(), StageSpec { index: 1, count: 3 });
    let kept = spec.device_memory_bytes(&config, 8, 128, 8, Residency::default());
    let recompute = Residency {
        recompute: true,
        ..Residency::default()
    };
    let recomputed = spec.device_memory_bytes(&config, 8, 128, 8, recompute);
    assert!(recomputed * 3 < kept, "{recomputed} of {kept}");
}

/// Parameters after `steps` steps of `preset` in `stages` stages, with or without
/// recomputation (microbatches of 2 in a batch of 6: several in flight, a smaller last one).
fn trained(preset: Preset, stages: usize, steps: usize, recompute: bool) -> Vec<Vec<f32>> {
    let config = preset.config();
    let backend = Arc::new(CpuBackend::new(2).unwrap());
    let mut p = LocalPipeline::new(
        backend,
        config,
        stages,
        5,
        AdamW::default(),
        LrSchedule::for_steps(1e-3, steps as u64),
    )
    .unwrap();
    p.set_recompute(recompute).unwrap();
    let mut data = DataLoader::new(Corpus::synthetic(5), 5, Shard::ALL, 32).unwrap();
    for _ in 0..steps {
        p.train_step(&data.next_batch(5), 2).unwrap();
    }
    p.stages()
        .iter()
        .map(|s| s.download_params().unwrap())
        .collect()
}

#[test]
fn recomputed_activations_train_the_same_model_bit_for_bit() {
    for (preset, stages) in [(Preset::Nano, 1), (Preset::Nano, 3), (Preset::Micro, 2)] {
        let kept = trained(preset, stages, 3, false);
        let recomputed = trained(preset, stages, 3, true);
        for (i, (a, b)) in kept.iter().zip(&recomputed).enumerate() {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{preset:?} in {stages} stages: stage {i} differs");
        }
    }
}

/// The most transformer blocks a middle stage of `preset` holds within `limit` bytes of
/// device memory as a swarm replica holds it (AdamW's moments on the host), training
/// `in_flight` microbatches of `rows` full-context samples (a model of three times as many
/// layers cut in three has exactly that many in its middle stage).
fn largest_stage(
    preset: Preset,
    limit: u64,
    rows: usize,
    in_flight: usize,
    recompute: bool,
) -> usize {
    let config = preset.config();
    let spec = StageSpec { index: 1, count: 3 };
    let memory = |blocks: usize| {
        let cut = shoal_compute::ModelConfig {
            layers: 3 * blocks,
            ..config
        };
        let held = Residency {
            recompute,
            moments_on_host: true,
        };
        spec.device_memory_bytes(&cut, rows, config.context, in_flight, held)
    };
    (1..=config.layers)
        .take_while(|b| memory(*b) <= limit)
        .last()
        .unwrap_or(0)
}

/// The table of the README (`cargo test -p shoal-compute --test memory -- --nocapture`): the
/// largest stage each preset trains within 4 GB, keeping activations and recomputing them.
#[test]
fn largest_stages_within_four_gigabytes() {
    const LIMIT: u64 = 4_000_000_000;
    println!("| preset | layers | rows x context | in flight | blocks kept | blocks recomputed |");
    println!("|---|---|---|---|---|---|");
    for preset in Preset::ALL {
        let config = preset.config();
        for (rows, in_flight) in [(1, 1), (4, 2), (8, 4)] {
            let kept = largest_stage(preset, LIMIT, rows, in_flight, false);
            let recomputed = largest_stage(preset, LIMIT, rows, in_flight, true);
            println!(
                "| {preset} | {} | {rows} x {} | {in_flight} | {kept} | {recomputed} |",
                config.layers, config.context
            );
            assert!(recomputed >= kept, "{preset}: recomputing never fits less");
        }
    }
    // GPT-2 XL at 4 x 1024 tokens, 2 in flight: its activations, not its parameters, are
    // what stops a 4 GB device; recomputing them fits several times the blocks.
    let kept = largest_stage(Preset::Gpt2Xl, LIMIT, 4, 2, false);
    let recomputed = largest_stage(Preset::Gpt2Xl, LIMIT, 4, 2, true);
    assert!(recomputed >= 3 * kept.max(1), "{kept} vs {recomputed}");
}
