//! How large a received tensor may be. Finite values can still be absurd (1e30 activations, a
//! part a million times larger than the gradients around it); a receiver refuses values whose
//! root-mean-square is more than [`NORM_FACTOR`] times what it expects: its own contribution
//! for averaging, what it has recently accepted for activations and their gradients. The
//! factor is wide on purpose: it stops values that would wreck a step, not subtle ones (a
//! robust mean over contributions is what bounds those).

use std::collections::VecDeque;

/// How many times larger than expected (root-mean-square) a received tensor may be.
pub const NORM_FACTOR: f64 = 1000.0;

/// Accepted tensors a [`NormReference`] remembers; it judges from the median of them.
const WINDOW: usize = 64;

/// Accepted tensors before a [`NormReference`] judges at all.
const WARM_UP: usize = 8;

/// Root-mean-square of `v` (0 for an empty slice).
pub fn rms(v: &[f32]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    (v.iter().map(|x| f64::from(*x) * f64::from(*x)).sum::<f64>() / v.len() as f64).sqrt()
}

/// Whether `value` is within [`NORM_FACTOR`] of `expected` (always, when nothing is expected).
pub fn within(value: f64, expected: f64) -> bool {
    expected <= 0.0 || !expected.is_finite() || value <= NORM_FACTOR * expected
}

/// The sizes of recently accepted tensors of one kind.
#[derive(Clone, Debug, Default)]
pub struct NormReference {
    recent: VecDeque<f64>,
}

impl NormReference {
    /// Whether a tensor of root-mean-square `rms` is admitted; an admitted one joins the
    /// reference.
    pub fn admits(&mut self, rms: f64) -> bool {
        let fits = self.fits(rms);
        if fits {
            self.record(rms);
        }
        fits
    }

    /// Whether a tensor of root-mean-square `rms` is within bounds (without recording it).
    pub fn fits(&self, rms: f64) -> bool {
        self.recent.len() < WARM_UP || within(rms, self.median())
    }

    /// Records an accepted tensor's root-mean-square.
    pub fn record(&mut self, rms: f64) {
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(rms);
    }

    fn median(&self) -> f64 {
        let mut v: Vec<f64> = self.recent.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absurd_tensors_are_refused_after_a_warm_up_and_usual_ones_never() {
        let mut r = NormReference::default();
        for i in 0..WARM_UP {
            assert!(r.admits(1.0 + i as f64 * 0.1));
        }
        assert!(!r.admits(1e30));
        assert!(!r.admits(2e3));
        assert!(r.admits(900.0), "wide on purpose");
        // Honest sizes drift over training; the reference follows them.
        for _ in 0..WINDOW {
            assert!(r.admits(50.0));
        }
        assert!(r.admits(40_000.0));
        assert!(within(5.0, 0.0), "nothing expected yet");
        assert_eq!(rms(&[3.0, 4.0]), (12.5f64).sqrt());
    }
}
