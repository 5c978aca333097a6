#![allow(clippy::unwrap_used, missing_docs)]
//! A stage replica applies each committed microbatch exactly once, computes what a plain
//! stage computes, round-trips its state through bytes and does DiLoCo's outer step.

use shoal_compute::stage::{MicrobatchShape, StageInput, StageOutput};
use shoal_compute::{
    AdamW, Batch, Corpus, Coupling, CpuBackend, DataLoader, LocalPipeline, LrSchedule, Preset,
    ReplicaError, Shard, Stage, StageError, StageReplica, StageSpec, write_atomic,
};
use std::sync::Arc;

const SEQ: usize = 16;
const ROWS: usize = 2;
const SHAPE: MicrobatchShape = MicrobatchShape {
    batch: ROWS,
    seq: SEQ,
};

fn replica(spec: StageSpec, seed: u64) -> StageReplica<CpuBackend> {
    StageReplica::new(
        Arc::new(CpuBackend::new(1).unwrap()),
        Preset::Nano.config(),
        spec,
        seed,
        AdamW::default(),
        LrSchedule::for_steps(3e-3, 20),
    )
    .unwrap()
}

/// All stages of a model cut into `count`, each served by one replica.
fn pipeline(count: usize, seed: u64) -> Vec<StageReplica<CpuBackend>> {
    (0..count)
        .map(|index| replica(StageSpec { index, count }, seed))
        .collect()
}

/// Microbatch `i` of the synthetic corpus.
fn microbatch(i: u64) -> Batch {
    let mut data = DataLoader::new(Corpus::synthetic(7), 7, Shard::ALL, SEQ).unwrap();
    data.seek(i * ROWS as u64);
    data.next_batch(ROWS)
}

/// Forward and backward of microbatch `data` under `id` through all stages, leaving its
/// gradient pending on each. Returns the loss.
fn run(stages: &mut [StageReplica<CpuBackend>], id: u64, data: &Batch) -> f32 {
    let mut acts = Vec::new();
    let mut loss = f32::NAN;
    for (i, s) in stages.iter_mut().enumerate() {
        let input = if i == 0 {
            StageInput::Tokens(&data.inputs)
        } else {
            StageInput::Activations(&acts)
        };
        match s.forward(id, SHAPE, input, Some(&data.targets)).unwrap() {
            StageOutput::Activations(a) => acts = a,
            StageOutput::Loss(l) => loss = l,
        }
    }
    let mut grad: Option<Vec<f32>> = None;
    for s in stages.iter_mut().rev() {
        grad = s.backward(id, grad.as_deref(), ROWS as f32).unwrap();
    }
    loss
}

fn commit_all(stages: &mut [StageReplica<CpuBackend>], id: u64) {
    for s in stages {
        assert!(s.commit(id));
    }
}

/// Takes each stage's accumulated gradient, turns it into the mean and steps. Returns the
/// parameter hashes after the step.
fn step(stages: &mut [StageReplica<CpuBackend>]) -> Vec<u64> {
    stages
        .iter_mut()
        .map(|s| {
            let (mut g, samples) = s.take_gradient();
            g.iter_mut().for_each(|x| *x /= samples as f32);
            s.apply_step(&g).unwrap()
        })
        .collect()
}

fn hashes(stages: &[StageReplica<CpuBackend>]) -> Vec<u64> {
    stages.iter().map(|s| s.param_hash().unwrap()).collect()
}

/// Largest absolute difference relative to the largest magnitude of `a`.
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn replicas_agree_and_aborted_or_repeated_microbatches_count_nothing() {
    let mut a = pipeline(2, 7);
    let mut b = pipeline(2, 7);
    assert_eq!(hashes(&a), hashes(&b), "same seed, same parameters");

    // b also computes a retried copy of a microbatch and a third one, then drops both.
    for (id, i) in [(0, 0), (1, 1)] {
        run(&mut a, id, &microbatch(i));
        run(&mut b, id, &microbatch(i));
    }
    run(&mut b, 2, &microbatch(0));
    run(&mut b, 3, &microbatch(2));
    assert_eq!(b[0].pending(), 4);
    for s in &mut b {
        assert!(s.abort(2));
        assert!(s.abort(3));
        assert!(!s.abort(3), "nothing left to abort");
    }
    // A forward whose backward never comes: abort frees its activations.
    let data = microbatch(3);
    b[0].forward(4, SHAPE, StageInput::Tokens(&data.inputs), None)
        .unwrap();
    assert_eq!(b[0].in_flight(), 1);
    assert!(b[0].abort(4));
    assert_eq!(b[0].in_flight(), 0);

    for id in [0, 1] {
        commit_all(&mut a, id);
        commit_all(&mut b, id);
    }
    for s in a.iter_mut().chain(b.iter_mut()) {
        assert!(!s.commit(0), "a second commit is refused");
        assert!(!s.commit(99), "unknown id");
        assert!(!s.commit(2), "aborted id");
        assert_eq!(s.pending(), 0);
        assert_eq!(s.accumulated_samples(), 2.0 * ROWS as f64);
        // Reusing a committed id would apply that microbatch twice.
        let err = s
            .forward(0, SHAPE, StageInput::Tokens(&data.inputs), None)
            .unwrap_err();
        assert!(matches!(err, StageError::DuplicateMicrobatch(0)), "{err}");
    }

    // Aborted work left no trace: the accumulators are bit-identical.
    let take = |stages: &mut [StageReplica<CpuBackend>]| -> Vec<(Vec<f32>, f64)> {
        stages.iter_mut().map(|s| s.take_gradient()).collect()
    };
    let (ga, gb) = (take(&mut a), take(&mut b));
    assert_eq!(ga, gb);
    let apply = |stages: &mut [StageReplica<CpuBackend>], grads: &[(Vec<f32>, f64)]| {
        stages
            .iter_mut()
            .zip(grads)
            .map(|(s, (g, n))| {
                let mean: Vec<f32> = g.iter().map(|x| x / *n as f32).collect();
                s.apply_step(&mean).unwrap()
            })
            .collect::<Vec<_>>()
    };
    let (ha, hb) = (apply(&mut a, &ga), apply(&mut b, &gb));
    assert_eq!(ha, hb, "same committed microbatches, same step");
    assert_eq!(ha, hashes(&a));
    assert_ne!(
        ha,
        hashes(&pipeline(2, 7)),
        "the step changed the parameters"
    );
    assert!(a.iter().all(|s| s.step() == 1));

    // The accumulator is empty after a take.
    let (g, samples) = a[1].take_gradient();
    assert_eq!(samples, 0.0);
    assert_eq!(g.len(), a[1].param_count());
    assert!(g.iter().all(|&x| x == 0.0));
}

#[test]
fn committed_gradients_equal_plain_accumulation() {
    let config = Preset::Nano.config();
    let mut r = replica(StageSpec::WHOLE, 3);
    let mut stage = Stage::new(
        Arc::new(CpuBackend::new(1).unwrap()),
        config,
        StageSpec::WHOLE,
        3,
    )
    .unwrap();
    for id in [0, 1] {
        let data = microbatch(id);
        let loss = run(std::slice::from_mut(&mut r), id, &data);
        let out = stage
            .forward(
                id,
                SHAPE,
                StageInput::Tokens(&data.inputs),
                Some(&data.targets),
            )
            .unwrap();
        assert_eq!(out, StageOutput::Loss(loss));
        stage.backward(id, None, ROWS as f32).unwrap();
        assert!(r.commit(id));
    }
    let (g, samples) = r.take_gradient();
    assert_eq!(samples, 2.0 * ROWS as f64);
    let expected = stage.download_grads().unwrap();
    let diff = rel_diff(&expected, &g);
    assert!(diff <= 1e-6, "relative difference {diff}");
}

/// `shoal train --coupling per-stage` is the single-process reference of a swarm: its steps
/// must be the replicas' steps (each stage clipped alone, its own tied-embedding copy).
#[test]
fn a_per_stage_pipeline_steps_as_the_swarm_replicas_do() {
    const STEPS: u64 = 3;
    let mut replicas = pipeline(3, 9);
    for s in 0..STEPS {
        for id in [2 * s, 2 * s + 1] {
            run(&mut replicas, id, &microbatch(id));
            commit_all(&mut replicas, id);
        }
        step(&mut replicas);
    }
    let local = |coupling| {
        let mut p = LocalPipeline::new(
            Arc::new(CpuBackend::new(1).unwrap()),
            Preset::Nano.config(),
            3,
            9,
            AdamW::default(),
            LrSchedule::for_steps(3e-3, 20),
        )
        .unwrap();
        p.set_coupling(coupling);
        let mut data = DataLoader::new(Corpus::synthetic(7), 7, Shard::ALL, SEQ).unwrap();
        for _ in 0..STEPS {
            p.train_step(&data.next_batch(2 * ROWS), ROWS).unwrap();
        }
        p.stages()
            .iter()
            .map(|s| s.download_params().unwrap())
            .collect::<Vec<_>>()
    };
    let per_stage = local(Coupling::PerStage);
    for (i, r) in replicas.iter().enumerate() {
        let diff = rel_diff(&per_stage[i], &r.stage().download_params().unwrap());
        // Same operations; only the microbatch weighting (mean versus sum then divide) rounds
        // differently.
        assert!(diff <= 1e-5, "stage {i}: relative difference {diff}");
    }
    // The exact model (tied embedding, one clip) is another computation.
    let joint = local(Coupling::Joint);
    let diff = rel_diff(&joint[2], &replicas[2].stage().download_params().unwrap());
    assert!(
        diff > 1e-3,
        "joint and per-stage steps should differ: {diff}"
    );
}

#[test]
fn state_round_trips_and_bad_bytes_are_rejected() {
    let mut a = replica(StageSpec::WHOLE, 5);
    for round in 0..2u64 {
        run(std::slice::from_mut(&mut a), round, &microbatch(round));
        assert!(a.commit(round));
        step(std::slice::from_mut(&mut a));
    }
    // An outer step so the optional momentum section is exercised too.
    let pg = a.pseudo_gradient().unwrap();
    a.apply_outer_step(&pg, 0.7, 0.9).unwrap();
    let bytes = a.export_state().unwrap();

    let mut b = replica(StageSpec::WHOLE, 99);
    assert_ne!(a.param_hash().unwrap(), b.param_hash().unwrap());
    b.import_state(&bytes).unwrap();
    assert_eq!(a.param_hash().unwrap(), b.param_hash().unwrap());
    assert_eq!(b.step(), 2);
    assert_eq!(
        b.export_state().unwrap(),
        bytes,
        "nothing lost in the round trip"
    );

    // Training continues identically, inner and outer.
    for r in [&mut a, &mut b] {
        run(std::slice::from_mut(r), 10, &microbatch(5));
        assert!(r.commit(10));
        step(std::slice::from_mut(r));
        let pg = r.pseudo_gradient().unwrap();
        r.apply_outer_step(&pg, 0.7, 0.9).unwrap();
    }
    assert_eq!(a.param_hash().unwrap(), b.param_hash().unwrap());
    assert_eq!(a.export_state().unwrap(), b.export_state().unwrap());

    let before = b.param_hash().unwrap();
    let bytes = a.export_state().unwrap();
    let malformed = |r: Result<(), ReplicaError>| match r {
        Err(ReplicaError::Malformed(_)) => {}
        other => panic!("expected a malformed-state error, got {other:?}"),
    };
    malformed(b.import_state(&[]));
    malformed(b.import_state(&bytes[..bytes.len() / 2]));
    malformed(b.import_state(&bytes[..bytes.len() - 1]));
    malformed(b.import_state(&bytes[..40]));
    let mut flipped = bytes.clone();
    flipped[bytes.len() / 2] ^= 0x10;
    malformed(b.import_state(&flipped));
    let mut extended = bytes.clone();
    extended.push(0);
    malformed(b.import_state(&extended));
    // Deterministic garbage of the right length.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let garbage: Vec<u8> = (0..bytes.len())
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    malformed(b.import_state(&garbage));

    // Well-formed headers with wrong contents: the checksum is recomputed so that the
    // check of each field is what rejects them.
    let reseal = |mut body: Vec<u8>| {
        let h = xxhash_rust::xxh3::xxh3_64(&body);
        body.extend_from_slice(&h.to_le_bytes());
        body
    };
    let body = bytes[..bytes.len() - 8].to_vec();
    let mut v2 = body.clone();
    v2[8..12].copy_from_slice(&2u32.to_le_bytes());
    assert!(matches!(
        b.import_state(&reseal(v2)),
        Err(ReplicaError::UnsupportedVersion(2))
    ));
    // A claimed parameter count of 2^61 must be refused before any allocation.
    let mut huge = body.clone();
    huge[80..88].copy_from_slice(&(1u64 << 61).to_le_bytes());
    assert!(matches!(
        b.import_state(&reseal(huge)),
        Err(ReplicaError::Mismatch(_))
    ));
    let mut flags = body.clone();
    flags[12..16].copy_from_slice(&0u32.to_le_bytes());
    malformed(b.import_state(&reseal(flags)));

    // Another stage's state does not fit.
    let other = replica(StageSpec { index: 1, count: 2 }, 5);
    let err = b.import_state(&other.export_state().unwrap()).unwrap_err();
    assert!(matches!(err, ReplicaError::Mismatch(_)), "{err}");

    assert_eq!(
        b.param_hash().unwrap(),
        before,
        "failed imports change nothing"
    );
}

#[test]
fn diloco_pseudo_gradient_and_outer_step() {
    let mut r = replica(StageSpec::WHOLE, 11);
    let start = r.stage().download_params().unwrap();
    assert!(r.pseudo_gradient().unwrap().iter().all(|&x| x == 0.0));
    for k in 0..3u64 {
        run(std::slice::from_mut(&mut r), k, &microbatch(k));
        assert!(r.commit(k));
        step(std::slice::from_mut(&mut r));
    }
    let params = r.stage().download_params().unwrap();
    let pg = r.pseudo_gradient().unwrap();
    let expected: Vec<f32> = start.iter().zip(&params).map(|(a, p)| a - p).collect();
    assert_eq!(pg, expected);
    assert!(pg.iter().any(|&x| x != 0.0));

    // With no momentum and unit rate, a lone replica's outer step keeps its own parameters.
    let hash = r.apply_outer_step(&pg, 1.0, 0.0).unwrap();
    assert_eq!(hash, r.param_hash().unwrap());
    let after = r.stage().download_params().unwrap();
    let worst = params
        .iter()
        .zip(&after)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(worst <= 1e-6, "params moved by {worst}");
    // The new round starts at the new anchor.
    assert!(r.pseudo_gradient().unwrap().iter().all(|&x| x == 0.0));

    // Nesterov: the momentum left by the first outer step (= pg) carries into the second.
    let (lr, mu) = (0.7f32, 0.9f32);
    let avg: Vec<f32> = (0..after.len()).map(|i| (i % 7) as f32 * 1e-4).collect();
    r.apply_outer_step(&avg, lr, mu).unwrap();
    let got = r.stage().download_params().unwrap();
    let want: Vec<f32> = after
        .iter()
        .zip(&avg)
        .zip(&pg)
        .map(|((a, g), m)| a - lr * (g + mu * (mu * m + g)))
        .collect();
    assert!(rel_diff(&want, &got) <= 1e-6);

    let err = r.apply_outer_step(&avg[1..], lr, mu).unwrap_err();
    assert!(matches!(err, StageError::BadInput { .. }), "{err}");
}

/// Regression: a NaN in an averaged gradient made `clip_scale` return 1 (NaN > clip is
/// false) and AdamW wrote NaN into every parameter. Steps and states with values that are
/// not finite are refused whole, and the parameters stay as they were.
#[test]
fn steps_and_states_that_are_not_finite_are_refused() {
    let mut r = replica(StageSpec { index: 0, count: 2 }, 3);
    let before = r.param_hash().unwrap();
    let n = r.param_count();
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut grad = vec![0.0; n];
        grad[n / 2] = bad;
        assert!(r.apply_step(&grad).is_err(), "step with {bad}");
        assert!(
            r.apply_outer_step(&grad, 0.7, 0.9).is_err(),
            "outer step with {bad}"
        );
    }
    assert_eq!(r.param_hash().unwrap(), before);
    // A state whose parameters hold a NaN, however well-formed otherwise.
    let mut state = r.export_state().unwrap();
    let mut other = replica(StageSpec { index: 0, count: 2 }, 3);
    let good = state.clone();
    other.import_state(&good).unwrap();
    let at = state.len() / 3;
    let at = at - at % 4;
    state[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    // Re-seal the checksum so that only the values are wrong.
    let body = state.len() - 8;
    let checksum = xxhash_rust::xxh3::xxh3_64(&state[..body]);
    state[body..].copy_from_slice(&checksum.to_le_bytes());
    assert!(matches!(
        other.import_state(&state),
        Err(ReplicaError::Malformed(m)) if m.contains("not finite")
    ));
}

#[test]
fn write_atomic_writes_overwrites_and_leaves_no_temp_file() {
    let dir = std::env::temp_dir().join(format!("shoal-write-atomic-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("state.bin");
    write_atomic(&path, b"first version, longer").unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"first version, longer");
    write_atomic(&path, b"second").unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"second");
    let entries: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(entries, vec![std::ffi::OsString::from("state.bin")]);
    assert!(write_atomic(std::path::Path::new("/"), b"x").is_err());
    assert!(write_atomic(&dir.join("missing").join("f"), b"x").is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The microbatches of a step are judged by the step they went into: one computed on
/// activation gradients that came back negated points against it, honest ones along it, a
/// gradient thrown away is judged too, and each step's judgments are given once.
#[test]
fn a_microbatch_on_negated_activation_gradients_points_against_its_step() {
    // The pipeline judged, and another at the same parameters, as the first stage's mates.
    let mut stages = pipeline(2, 7);
    let mut mates = pipeline(2, 7);
    let first_stage_backward =
        |stages: &mut [StageReplica<CpuBackend>], id: u64, data: &Batch, sign: f32| {
            let (first, last) = stages.split_at_mut(1);
            let StageOutput::Activations(acts) = first[0]
                .forward(id, SHAPE, StageInput::Tokens(&data.inputs), None)
                .unwrap()
            else {
                panic!("activations")
            };
            last[0]
                .forward(
                    id,
                    SHAPE,
                    StageInput::Activations(&acts),
                    Some(&data.targets),
                )
                .unwrap();
            let mut grad = last[0].backward(id, None, ROWS as f32).unwrap().unwrap();
            grad.iter_mut().for_each(|g| *g *= sign);
            first[0].backward(id, Some(&grad), ROWS as f32).unwrap();
            assert!(last[0].abort(id));
        };
    first_stage_backward(&mut stages, 1, &microbatch(1), 1.0);
    first_stage_backward(&mut stages, 2, &microbatch(2), -1.0);
    first_stage_backward(&mut stages, 3, &microbatch(3), 1.0);
    assert!(stages[0].commit(1) && stages[0].commit(2));
    assert!(stages[0].abort(3), "thrown away, judged all the same");
    // The step the stage takes: the mean of honest gradients of the same samples, as the
    // robust mean of a stage with an honest majority would be.
    for id in 1..=3 {
        run(&mut mates, id, &microbatch(id));
        assert!(mates[0].commit(id));
    }
    assert!(stages[0].take_alignments().is_empty(), "no step yet");
    let _ = stages[0].take_gradient();
    let (mut honest, samples) = mates[0].take_gradient();
    honest.iter_mut().for_each(|g| *g /= samples as f32);
    stages[0].apply_step(&honest).unwrap();
    let alignments: std::collections::BTreeMap<u64, f64> =
        stages[0].take_alignments().into_iter().collect();
    assert_eq!(alignments.keys().copied().collect::<Vec<_>>(), [1, 2, 3]);
    assert!(alignments[&1] > 0.2, "{alignments:?}");
    assert!(alignments[&3] > 0.2, "{alignments:?}");
    assert!(alignments[&2] < -0.2, "{alignments:?}");
    assert!(stages[0].take_alignments().is_empty(), "given once");
}
