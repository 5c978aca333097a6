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
        // Offloading, the plan is the limit: the stage must run within it.
        let plan = spec.device_memory_bytes(&config, rows, seq, in_flight, held);
        let limit = held.offload.then_some(plan);
        let on_host = held.moments_on_host;
        let mut stage =
            Stage::with_memory_limit(backend.clone(), config, spec, 3, on_host, limit).unwrap();
        stage.set_recompute(held.recompute).unwrap();
        let tensors = 4 * spec.param_count(&config) as u64;
        let block = 4 * config.block_params() as u64;
        let blocks = spec.blocks(&config).len() as u64;
        let built = MemoryUse {
            // Offloaded blocks come to the device when a pass needs them.
            parameters: tensors - if held.offload { blocks * block } else { 0 },
            gradients: tensors - if held.offload { blocks * block } else { 0 },
            optimizer: if on_host || held.offload {
                0
            } else {
                2 * tensors
            },
            activations: 0,
            workspace: 0,
        };
        assert_eq!(stage.memory().now, built);
        assert_eq!(stage.memory().peak, built);
        if !held.offload {
            let empty = spec.device_memory_bytes(&config, rows, seq, 0, held);
            assert_eq!(empty, built.total());
        }

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
        if !held.offload {
            assert_eq!(memory.peak, memory.now, "nothing was freed");
        }
        assert_eq!(
            plan,
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
        for (moments_on_host, offload) in [(false, false), (true, false), (false, true)] {
            let held = Residency {
                recompute,
                moments_on_host,
                offload,
            };
            check(Preset::Nano, 3, 2, 32, 3, held);
            check(Preset::Nano, 1, 4, 16, 1, held);
            check(Preset::Micro, 2, 1, 64, 2, held);
            check(Preset::Micro, 1, 1, 32, 2, held);
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

/// A pipeline trained for a few steps: each stage's parameters, memory high-water mark and
/// bytes offloaded, and the losses.
struct Trained {
    params: Vec<Vec<f32>>,
    peaks: Vec<u64>,
    offloaded: Vec<u64>,
    losses: Vec<f32>,
}

/// `steps` steps of `preset` in `stages` stages, with or without recomputation, under a
/// device memory limit per stage or none (microbatches of 2 in a batch of 5: several in
/// flight, a smaller last one).
fn train(
    preset: Preset,
    stages: usize,
    steps: usize,
    recompute: bool,
    limit: Option<u64>,
) -> Result<Trained, shoal_compute::StageError> {
    let config = preset.config();
    let backend = Arc::new(CpuBackend::new(2).unwrap());
    let mut p = LocalPipeline::with_memory_limit(
        backend,
        config,
        stages,
        5,
        AdamW::default(),
        LrSchedule::for_steps(1e-3, steps as u64),
        limit,
    )?;
    p.set_recompute(recompute)?;
    let mut data = DataLoader::new(Corpus::synthetic(5), 5, Shard::ALL, 32).unwrap();
    let mut losses = Vec::new();
    for _ in 0..steps {
        losses.push(p.train_step(&data.next_batch(5), 2)?.loss);
    }
    Ok(Trained {
        params: p
            .stages()
            .iter()
            .map(|s| s.download_params().unwrap())
            .collect(),
        peaks: p.stages().iter().map(|s| s.memory().peak.total()).collect(),
        offloaded: p
            .stages()
            .iter()
            .map(|s| s.offload_traffic().uploaded)
            .collect(),
        losses,
    })
}

fn trained(preset: Preset, stages: usize, steps: usize, recompute: bool) -> Vec<Vec<f32>> {
    train(preset, stages, steps, recompute, None)
        .unwrap()
        .params
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn a_stage_under_a_quarter_of_its_memory_trains_the_same_model_bit_for_bit() {
    // A stage needs room for one block at least: a quarter of micro in 2 stages (3 blocks
    // each), a third in 3 (2 each); nano's blocks are small beside its activations.
    for (preset, stages, least) in [
        (Preset::Micro, 2, 4),
        (Preset::Micro, 3, 3),
        (Preset::Nano, 1, 2),
    ] {
        let free = train(preset, stages, 3, false, None).unwrap();
        let need = *free.peaks.iter().max().unwrap();
        for (limit, recompute) in [(need / least, true), (need / 2, false), (need, false)] {
            let limited = train(preset, stages, 3, recompute, Some(limit)).unwrap_or_else(|e| {
                panic!("{preset:?} in {stages} stages, {limit} of {need}: {e}")
            });
            let what = format!("{preset:?} in {stages} stages under {limit} of {need} bytes");
            assert_eq!(
                free.losses.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
                limited
                    .losses
                    .iter()
                    .map(|l| l.to_bits())
                    .collect::<Vec<_>>(),
                "{what}"
            );
            for (i, (a, b)) in free.params.iter().zip(&limited.params).enumerate() {
                assert!(same_bits(a, b), "{what}: stage {i} differs");
            }
            for (i, peak) in limited.peaks.iter().enumerate() {
                assert!(*peak <= limit, "{what}: stage {i} held {peak}");
            }
            // A stage that had to move blocks moved some; free.offloaded is all zero.
            if limit < need / 2 {
                assert!(limited.offloaded.iter().any(|b| *b > 0), "{what}");
            }
            assert!(free.offloaded.iter().all(|b| *b == 0));
        }
    }
}

#[test]
fn a_limit_that_leaves_no_room_for_a_block_is_refused_with_what_it_needs() {
    let config = Preset::Micro.config();
    let spec = StageSpec { index: 0, count: 2 };
    // The embeddings and one of the stage's three blocks, parameters and gradients.
    let one_block = 8 * (spec.param_count(&config) - 2 * config.block_params()) as u64;
    // Less: refused when the stage is built.
    let err = train(Preset::Micro, 2, 1, true, Some(one_block - 1))
        .err()
        .unwrap();
    let message = err.to_string();
    assert!(
        message.contains(&format!("needs {one_block} bytes")),
        "{message}"
    );
    assert!(message.contains("one block's parameters"), "{message}");
    // One block fits but not a microbatch's activations beside it: refused at the forward.
    let err = train(Preset::Micro, 2, 1, false, Some(one_block + 600_000))
        .err()
        .unwrap();
    let message = err.to_string();
    assert!(message.contains("a microbatch's activations"), "{message}");
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
    held: Residency,
) -> usize {
    let config = preset.config();
    let spec = StageSpec { index: 1, count: 3 };
    let memory = |blocks: usize| {
        let cut = shoal_compute::ModelConfig {
            layers: 3 * blocks,
            ..config
        };
        spec.device_memory_bytes(&cut, rows, config.context, in_flight, held)
    };
    (1..=MOST_BLOCKS)
        .take_while(|b| memory(*b) <= limit)
        .last()
        .unwrap_or(0)
}

/// Where [`largest_stage`] stops looking: offloading, the device's memory stops mattering
/// long before, and the host's (24 bytes a parameter) is what bounds a stage.
const MOST_BLOCKS: usize = 512;

/// The table of the README (`cargo test -p shoal-compute --test memory -- --nocapture`): the
/// largest stage each preset trains within 4 GB, keeping activations and recomputing them.
#[test]
fn largest_stages_within_four_gigabytes() {
    const LIMIT: u64 = 4_000_000_000;
    let held = |recompute, offload| Residency {
        recompute,
        moments_on_host: true,
        offload,
    };
    let shown = |blocks: usize| match blocks {
        MOST_BLOCKS => format!("{MOST_BLOCKS}+"),
        b => b.to_string(),
    };
    println!(
        "| preset | layers | rows x context | in flight | kept | recomputed | offloaded | offloaded + recomputed |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for preset in Preset::ALL {
        let config = preset.config();
        for (rows, in_flight) in [(1, 1), (4, 2), (8, 4)] {
            let largest = |r, o| largest_stage(preset, LIMIT, rows, in_flight, held(r, o));
            let [kept, recomputed, offloaded, both] =
                [(false, false), (true, false), (false, true), (true, true)]
                    .map(|(r, o)| largest(r, o));
            println!(
                "| {preset} | {} | {rows} x {} | {in_flight} | {} | {} | {} | {} |",
                config.layers,
                config.context,
                shown(kept),
                shown(recomputed),
                shown(offloaded),
                shown(both)
            );
            assert!(recomputed >= kept, "{preset}: recomputing never fits less");
            assert!(
                offloaded >= kept && both >= recomputed.max(offloaded),
                "{preset}"
            );
        }
    }
    // GPT-2 XL at 4 x 1024 tokens, 2 in flight: its activations, not its parameters, are
    // what stops a 4 GB device; recomputing them fits several times the blocks, and
    // offloading the blocks too several times that again (their outputs are what is left).
    let largest = |r, o| largest_stage(Preset::Gpt2Xl, LIMIT, 4, 2, held(r, o));
    let (kept, recomputed, both) = (
        largest(false, false),
        largest(true, false),
        largest(true, true),
    );
    assert!(recomputed >= 3 * kept.max(1), "{kept} vs {recomputed}");
    assert!(both >= 4 * recomputed, "{recomputed} vs {both}");
}
