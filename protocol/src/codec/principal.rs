//! Principal subspaces of a stage boundary: the `k` directions of a width-`d` activation that
//! carry most of its energy, tracked by subspace iteration on the covariance of what crossed
//! the boundary.
//!
//! Projected onto them, a boundary's activations (and, through the same projection, their
//! gradients: `P = U^T U` is symmetric, so `P g` is the exact gradient through it) keep far more
//! of what the next stage needs than the fixed random subspace of a `sub:F` code of the same
//! size, because a transformer's residual stream is far from isotropic. The basis is then
//! turned by a fixed pseudo-random rotation within the subspace ([`PrincipalBasis::spread`]),
//! so that every coefficient carries about the same energy: sorted by energy, the first block of
//! coefficients holds the stream's dominant directions, and a blockwise quantizer scaled to them
//! rounds the rest of the block to zero.
//!
//! The basis is data: the sending side computes it from its own activations, and a receiver
//! must hold the same one to expand the coefficients and to project the gradients it sends
//! back. `shoal train --principal-subspace K` measures what it does to training in one
//! process; swarm peers do not send bases (yet).

/// An orthonormal basis of `k` directions of `R^d`.
#[derive(Clone, Debug, PartialEq)]
pub struct PrincipalBasis {
    d: usize,
    k: usize,
    /// `k` rows of `d` values.
    rows: Vec<f32>,
}

/// Iterations that find a basis from a pseudo-random start; later refinements start from the
/// last basis, which a few steps of training moved little.
const FIRST_ITERATIONS: usize = 30;
const REFINE_ITERATIONS: usize = 2;

impl PrincipalBasis {
    /// `k` pseudo-random orthonormal directions of `R^d` (a function of `seed` alone).
    pub fn pseudo_random(d: usize, k: usize, seed: u64) -> PrincipalBasis {
        assert!(0 < k && k <= d, "a basis of {k} directions of R^{d}");
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let rows = (0..k * d)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect();
        let mut b = PrincipalBasis { d, k, rows };
        b.orthonormalize();
        b
    }

    /// The top `k` principal directions of covariance `c` (`d x d`, row-major), spread.
    pub fn of_covariance(c: &Covariance, k: usize, seed: u64) -> PrincipalBasis {
        let mut b = PrincipalBasis::pseudo_random(c.d, k, seed);
        b.iterate(&c.sums, FIRST_ITERATIONS);
        b.spread(seed);
        b
    }

    /// Moves the basis toward the principal subspace of `c` (a few iterations from where it
    /// is), spread again.
    pub fn refine(&mut self, c: &Covariance, seed: u64) {
        assert_eq!(c.d, self.d, "covariance of another width");
        self.iterate(&c.sums, REFINE_ITERATIONS);
        self.spread(seed);
    }

    /// Values a receiver needs to hold it.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether it holds no value (never: `k` and `d` are positive).
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Modified Gram-Schmidt, row by row.
    fn orthonormalize(&mut self) {
        let d = self.d;
        for i in 0..self.k {
            let (done, rest) = self.rows.split_at_mut(i * d);
            let row = &mut rest[..d];
            for prev in done.chunks_exact(d) {
                let dot: f64 = row.iter().zip(prev).map(|(a, b)| f64::from(a * b)).sum();
                for (a, b) in row.iter_mut().zip(prev) {
                    *a -= dot as f32 * b;
                }
            }
            let norm = row.iter().map(|a| f64::from(a * a)).sum::<f64>().sqrt();
            if norm > 1e-30 {
                row.iter_mut()
                    .for_each(|a| *a = (f64::from(*a) / norm) as f32);
            }
        }
    }

    /// Subspace iteration: `U <- orth(U (C + s I))`. The small shift `s` has the same
    /// eigenvectors and keeps rows from vanishing where `C` has rank under `k` (few vectors
    /// summed, or none).
    fn iterate(&mut self, c: &[f64], iterations: usize) {
        let d = self.d;
        let trace: f64 = (0..d).map(|i| c[i * d + i]).sum();
        let shift = 1e-3 * trace / d as f64 + 1e-20;
        for _ in 0..iterations {
            let mut next = vec![0.0f32; self.rows.len()];
            for (u, out) in self.rows.chunks_exact(d).zip(next.chunks_exact_mut(d)) {
                for ((o, c_row), own) in out.iter_mut().zip(c.chunks_exact(d)).zip(u) {
                    let cu: f64 = c_row.iter().zip(u).map(|(a, b)| a * f64::from(*b)).sum();
                    *o = (cu + shift * f64::from(*own)) as f32;
                }
            }
            self.rows = next;
            self.orthonormalize();
        }
    }

    /// The same subspace in other directions: the basis times a fixed pseudo-random rotation
    /// of `R^k`, so that each coefficient is a mix of all the principal ones.
    pub fn spread(&mut self, seed: u64) {
        let (d, k) = (self.d, self.k);
        let rotation = PrincipalBasis::pseudo_random(k, k, seed ^ 0x5eed);
        let mut rows = vec![0.0f32; k * d];
        for (r_row, out) in rotation.rows.chunks_exact(k).zip(rows.chunks_exact_mut(d)) {
            for (w, u) in r_row.iter().zip(self.rows.chunks_exact(d)) {
                for (o, a) in out.iter_mut().zip(u) {
                    *o += w * a;
                }
            }
        }
        self.rows = rows;
    }

    /// The coefficients of each vector of `x` (consecutive vectors of `d` values): `k` each.
    pub fn project(&self, x: &[f32], out: &mut Vec<f32>) {
        let d = self.d;
        out.clear();
        for xt in x.chunks_exact(d) {
            out.extend(
                self.rows
                    .chunks_exact(d)
                    .map(|u| u.iter().zip(xt).map(|(a, b)| a * b).sum::<f32>()),
            );
        }
    }

    /// Vectors of `d` values from their coefficients (`k` each), into `x`.
    pub fn expand(&self, y: &[f32], x: &mut [f32]) {
        let (d, k) = (self.d, self.k);
        for (xt, yt) in x.chunks_exact_mut(d).zip(y.chunks_exact(k)) {
            xt.iter_mut().for_each(|v| *v = 0.0);
            for (c, u) in yt.iter().zip(self.rows.chunks_exact(d)) {
                for (o, a) in xt.iter_mut().zip(u) {
                    *o += c * a;
                }
            }
        }
    }

    /// `x` projected onto the subspace in place (what the next stage computes on).
    pub fn apply(&self, x: &mut [f32]) {
        let mut y = Vec::new();
        self.project(x, &mut y);
        self.expand(&y, x);
    }
}

/// Sums of `x x^T` over the vectors that crossed a boundary.
#[derive(Clone, Debug)]
pub struct Covariance {
    d: usize,
    sums: Vec<f64>,
}

impl Covariance {
    /// Nothing summed yet, for vectors of `d` values.
    pub fn new(d: usize) -> Covariance {
        Covariance {
            d,
            sums: vec![0.0; d * d],
        }
    }

    /// Adds every `stride`-th vector of `x` (a sample of a microbatch's tokens is enough to
    /// find the directions of a few hundred dimensions).
    pub fn add(&mut self, x: &[f32], stride: usize) {
        let d = self.d;
        for xt in x.chunks_exact(d).step_by(stride.max(1)) {
            for (a, row) in xt.iter().zip(self.sums.chunks_exact_mut(d)) {
                let a = f64::from(*a);
                for (o, b) in row.iter_mut().zip(xt) {
                    *o += a * f64::from(*b);
                }
            }
        }
    }

    /// Starts over.
    pub fn clear(&mut self) {
        self.sums.iter_mut().for_each(|s| *s = 0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dot(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    fn assert_orthonormal(b: &PrincipalBasis) {
        let rows: Vec<&[f32]> = b.rows.chunks_exact(b.d).collect();
        for (i, u) in rows.iter().enumerate() {
            for (j, v) in rows.iter().enumerate() {
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((dot(u, v) - want).abs() < 1e-4, "rows {i}, {j}");
            }
        }
    }

    /// Vectors with energy in a few known directions: the basis keeps them whole and drops
    /// what lies in the others, and it is orthonormal once spread.
    #[test]
    fn the_principal_subspace_keeps_the_directions_that_carry_the_energy() {
        let d = 16;
        // Energy 100, 50, 25 along axes 3, 7, 11 and 0.01 along every other.
        let mut x = Vec::new();
        let mut state = 1u64;
        let mut noise = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        for _ in 0..400 {
            let mut t: Vec<f32> = (0..d).map(|_| 0.3 * noise()).collect();
            t[3] += 20.0 * noise();
            t[7] += 14.0 * noise();
            t[11] += 10.0 * noise();
            x.extend(t);
        }
        let mut c = Covariance::new(d);
        c.add(&x, 1);
        let b = PrincipalBasis::of_covariance(&c, 3, 7);
        assert_orthonormal(&b);
        let mut kept = vec![0.0; d];
        kept[3] = 1.0;
        kept[7] = -2.0;
        kept[11] = 0.5;
        let want = kept.clone();
        b.apply(&mut kept);
        for (k, w) in kept.iter().zip(&want) {
            assert!((k - w).abs() < 0.02, "{kept:?}");
        }
        let mut dropped = vec![0.0; d];
        dropped[5] = 1.0;
        b.apply(&mut dropped);
        assert!(dropped.iter().all(|v| v.abs() < 0.02), "{dropped:?}");
        // Spread: no coefficient of a principal direction is left alone in one row.
        for u in b.rows.chunks_exact(d) {
            assert!(u[3].abs() < 0.95 && u[7].abs() < 0.95 && u[11].abs() < 0.95);
        }
    }

    /// Projection is idempotent and orthogonal: projecting twice changes nothing, and what it
    /// removes is orthogonal to what it keeps; a refined basis is still orthonormal.
    #[test]
    fn projection_is_orthogonal_and_refinement_keeps_the_basis_orthonormal() {
        let (d, k) = (32, 8);
        let mut b = PrincipalBasis::pseudo_random(d, k, 3);
        assert_orthonormal(&b);
        let x: Vec<f32> = (0..3 * d).map(|i| ((i * 37 % 11) as f32) - 5.0).collect();
        let mut p = x.clone();
        b.apply(&mut p);
        let mut pp = p.clone();
        b.apply(&mut pp);
        for (a, c) in p.iter().zip(&pp) {
            assert!((a - c).abs() < 1e-4);
        }
        for (xt, pt) in x.chunks_exact(d).zip(p.chunks_exact(d)) {
            let residual: Vec<f32> = xt.iter().zip(pt).map(|(a, c)| a - c).collect();
            assert!(dot(&residual, pt).abs() < 1e-2);
        }
        let mut c = Covariance::new(d);
        c.add(&x, 1);
        b.refine(&c, 3);
        assert_orthonormal(&b);
        let mut y = Vec::new();
        b.project(&x, &mut y);
        assert_eq!(y.len(), 3 * k);
    }
}
