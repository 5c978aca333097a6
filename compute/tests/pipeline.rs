//! Cutting the model into stages changes where the computation happens, never its result.

#![allow(clippy::unwrap_used, missing_docs)]

use shoal_compute::{
    AdamW, Corpus, CpuBackend, DataLoader, LocalPipeline, LrSchedule, Preset, Shard,
};
use std::collections::HashMap;
use std::sync::Arc;

/// Loss and every parameter gradient (by global tensor name) of one accumulated batch.
fn loss_and_grads(stages: usize) -> (f32, HashMap<String, Vec<f32>>) {
    let config = Preset::Nano.config();
    let backend = Arc::new(CpuBackend::new(2).unwrap());
    let mut p = LocalPipeline::new(
        backend,
        config,
        stages,
        7,
        AdamW::default(),
        LrSchedule::for_steps(1e-3, 10),
    )
    .unwrap();
    let mut data = DataLoader::new(Corpus::synthetic(7), 7, Shard::ALL, config.context).unwrap();
    let batch = data.next_batch(6);
    // Two microbatches of unequal size exercise the loss weighting as well.
    let loss = p.accumulate(&batch, 4).unwrap();
    p.reduce_grads().unwrap();
    let mut grads = HashMap::new();
    for s in p.stages() {
        for (name, g) in s.named_grads().unwrap() {
            if let Some(prev) = grads.get(&name) {
                // Both holders of the tied embedding must hold the same, full gradient.
                assert_eq!(prev, &g, "copies of {name} disagree");
            }
            grads.insert(name, g);
        }
    }
    (loss, grads)
}

#[test]
fn cut_and_uncut_models_give_the_same_loss_and_gradients() {
    let (loss1, g1) = loss_and_grads(1);
    assert!(
        loss1 > 4.0 && loss1 < 7.0,
        "initial loss {loss1} should be near ln(256)"
    );
    for stages in [2, 3] {
        let (loss, g) = loss_and_grads(stages);
        assert!(
            (loss - loss1).abs() <= 1e-5 * loss1.abs(),
            "S={stages}: loss {loss} vs {loss1}"
        );
        assert_eq!(g.len(), g1.len(), "S={stages}: same tensors");
        for (name, a) in &g1 {
            let b = &g[name];
            let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12);
            let worst = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            // Same operations on the same values; only the order of summing the two halves of
            // the tied embedding's gradient differs.
            assert!(
                worst <= 1e-5 * scale,
                "S={stages} {name}: max diff {worst} of {scale}"
            );
        }
    }
}

#[test]
fn training_steps_agree_between_cuts() {
    let config = Preset::Nano.config();
    let run = |stages| {
        let backend = Arc::new(CpuBackend::new(2).unwrap());
        let mut p = LocalPipeline::new(
            backend,
            config,
            stages,
            3,
            AdamW::default(),
            LrSchedule::for_steps(1e-3, 5),
        )
        .unwrap();
        let mut data = DataLoader::new(Corpus::synthetic(3), 3, Shard::ALL, 32).unwrap();
        (0..5)
            .map(|_| p.train_step(&data.next_batch(4), 2).unwrap().loss)
            .collect::<Vec<_>>()
    };
    let (a, b) = (run(1), run(3));
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() < 1e-4, "{a:?} vs {b:?}");
    }
    assert!(a[4] < a[0], "loss fell: {a:?}");
}
