//! Robust aggregation of one averaged part: a centered clipping over the members' per-sample
//! means, so that no contributor moves the result by more than its weight times the honest
//! members' own spread, whatever it sends.
//!
//! Each member's share is a sum over its samples with a claimed sample count. The owner turns
//! it into a per-sample mean g_i and a weight w_i = min(claimed samples, the (lower) median claim)
//! x its credit (what the replicas it worked with saw it commit over what it claimed, see
//! [`super::claims`]): a peer that claims a huge batch weighs no more than a typical member,
//! nor more than its routes carried. Starting from the
//! coordinate-wise median, the centre moves by the weighted mean of the members' offsets, each
//! offset clipped to the radius tau (Karimireddy et al., "Learning from History for Byzantine
//! Robust Optimization"; BTARD runs the same rule per part). tau is the (lower) median distance
//! of the members from the coordinate-wise median: with at most half the shares malicious, it
//! is at most the honest members' spread, so an honest member is at most slightly clipped while a flipped,
//! scaled or noisy share counts at most tau.
//!
//! The same pass measures how much each share supports the result: its component along the
//! result's direction, relative to the median member's (the `ratio`: honest shares scatter
//! around 1 whatever their sample counts, as the noise of a per-sample mean mostly cancels in
//! one direction; a flipped share sits near -1, a zeroed one at 0, a scaled one at its factor),
//! and how far that component is from the median member's in units of the members' own spread
//! (the `deviation`, a robust z-score). A share is suspect only when both say so: the ratio
//! alone misleads when the gradients carry little common signal (late in training, tiny
//! batches) and the deviation alone when the members agree very closely. Noise leaves the
//! component along the result about as it is; it shows in the share's length against the
//! others' (the `norm`). Clipping bounds what one round of lies can do; this is the evidence
//! that ends them ([`super::bans`]).

/// A member's share of one part, as received: a sum over `samples`.
#[derive(Clone, Copy, Debug)]
pub struct Share<'a> {
    /// The sum of its samples' values.
    pub values: &'a [f32],
    /// The samples it claims are behind the sum.
    pub samples: f64,
    /// The factor on its weight from its claims checked against the routes, in (0, 1] (see
    /// [`super::claims`]); its per-sample mean is still the sum over its claim.
    pub credit: f64,
}

impl<'a> Share<'a> {
    /// A share whose claim was not checked (or checked out): full credit.
    pub fn new(values: &'a [f32], samples: f64) -> Self {
        Share {
            values,
            samples,
            credit: 1.0,
        }
    }

    /// Its claimed samples as its checked claim is worth them: times its credit.
    pub fn credited_samples(&self) -> f64 {
        self.samples * self.credit()
    }

    /// Its credit, never below [`super::claims::MIN_CREDIT`] nor above 1.
    fn credit(&self) -> f64 {
        self.credit.clamp(super::claims::MIN_CREDIT, 1.0)
    }
}

/// The robust mean of some shares.
#[derive(Clone, Debug, PartialEq)]
pub struct Aggregate {
    /// The per-sample mean.
    pub mean: Vec<f32>,
    /// The weight behind it (the sum of the capped sample counts).
    pub weight: f64,
    /// Per share, in the order given: its weight.
    pub weights: Vec<f64>,
    /// Per share: how much it supported the result (None for an absent share, or when fewer
    /// than three members are present or the median member's component along the result is
    /// not positive: then there is no majority to be relative to).
    pub support: Vec<Option<Support>>,
}

/// How much one share supported a part's robust mean.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Support {
    /// Its component along the result over the median member's (honest: about 1).
    pub ratio: f64,
    /// Its component's distance from the median member's in robust standard deviations
    /// (1.4826 x the median absolute deviation), within +-[`MAX_DEVIATION`].
    pub deviation: f64,
    /// The cosine between it and the result (0 for a share of zeros): its direction alone. A
    /// DiLoCo replica that took fewer inner steps than the others sends a shorter
    /// pseudo-gradient, a low `ratio` in the right direction.
    pub cosine: f64,
    /// Its length over the median member's, both per-sample means taken as if of the typical
    /// member's samples (a smaller batch's mean is longer by its noise, a DiLoCo replica with
    /// more inner steps moved further). About 1 for honest shares; several for scaled ones,
    /// and for noise, whose component along the result can look honest.
    pub norm: f64,
}

/// A deviation counts at most this much, so that one round cannot outweigh a window.
pub const MAX_DEVIATION: f64 = 8.0;

/// Clipping iterations at most. Among honest shares two or three take the centre from the
/// coordinate-wise median to its fixed point; when half the shares are far-off noise, the
/// median starts far off too and each iteration closes only part of the way.
const MAX_ITERATIONS: usize = 32;

/// The clipping has converged when an iteration moves the centre by less than this fraction
/// of the radius.
const CONVERGED: f64 = 0.02;

/// A weight is at most this many times the median claimed sample count.
pub const WEIGHT_CAP: f64 = 1.0;

/// A member votes on an averaged part only when the [`cosine`] between its own share and the
/// part is beyond this either way: above it, the part points along what the member computed;
/// below minus it, against. An honest part gives a member whose share carries the stage's
/// signal a cosine near 1 and a forged (negated) part near -1, while a share that is mostly
/// its member's own noise (a small batch against the stage's) is near 0 with any part: the
/// lowest honest cosine in clean runs was -0.53 in 13,530 checks. The [`agreement`] ratio
/// cannot vote: for a member whose batch is small against the stage's, the ratio of an honest
/// part scatters down to -3.6.
pub const VOTE_COSINE: f64 = 0.5;

/// The cosine of the angle between a member's own share of a part and the averaged part; None
/// when either is all zero.
pub fn cosine(own: &[f32], part: &[f32]) -> Option<f64> {
    if own.len() != part.len() {
        return None;
    }
    let (mut along, mut own_sq, mut part_sq) = (0.0f64, 0.0f64, 0.0f64);
    for (o, p) in own.iter().zip(part) {
        let (o, p) = (f64::from(*o), f64::from(*p));
        along += o * p;
        own_sq += o * o;
        part_sq += p * p;
    }
    let norms = own_sq.sqrt() * part_sq.sqrt();
    (norms > 0.0 && norms.is_finite()).then(|| along / norms)
}

/// A member's own share of a part and the part, where the part has values. A dense part is
/// judged whole (it is zero almost nowhere). A sparse one carries, where it has values, what
/// its owner's error feedback held back over several rounds, and nothing elsewhere: only its
/// direction there can be judged (an honest part's cosine with a member's share there had a
/// median of 0.91 and a 5th percentile of 0.29 in `nano` DiLoCo rounds with `ctopk:32/4096:2`;
/// a negated one gives the opposite), not its scale, which depends on how long each value was
/// held back.
pub fn on_support(own: &[f32], part: &[f32]) -> (Vec<f32>, Vec<f32>) {
    own.iter()
        .zip(part)
        .filter(|(_, p)| **p != 0.0)
        .map(|(o, p)| (*o, *p))
        .unzip()
}

/// How well an averaged part agrees with one member's own share of it (`own`, a sum over
/// `samples`): the share's per-sample component along the part, over the part's own length.
/// About 1 for an honestly reduced part, whatever the signal-to-noise ratio: the part contains
/// the share itself, so the share's noise adds as much to the numerator as the members' noise
/// adds to the denominator, and the common signal adds alike to both. A negated part gives
/// about -1, a part scaled by F about 1/F, a zeroed or unrelated one about 0. None when the
/// share carries nothing to compare (no samples, all zero).
pub fn agreement(own: &[f32], samples: f64, part: &[f32]) -> Option<f64> {
    if samples <= 0.0 || own.len() != part.len() {
        return None;
    }
    let (mut along, mut own_sq, mut part_sq) = (0.0f64, 0.0f64, 0.0f64);
    for (o, p) in own.iter().zip(part) {
        let (o, p) = (f64::from(*o), f64::from(*p));
        along += o * p;
        own_sq += o * o;
        part_sq += p * p;
    }
    if own_sq == 0.0 || !own_sq.is_finite() {
        return None;
    }
    if part_sq == 0.0 {
        return Some(0.0);
    }
    Some(along / samples / part_sq)
}

/// The centered-clipping mean of `shares`; shares with no samples or no values count as absent.
pub fn centered_clip(shares: &[Share<'_>], len: usize) -> Aggregate {
    let present: Vec<usize> = (0..shares.len())
        .filter(|&i| shares[i].samples > 0.0 && shares[i].values.len() == len)
        .collect();
    let mut weights = vec![0.0; shares.len()];
    let mut support = vec![None; shares.len()];
    if present.is_empty() {
        return Aggregate {
            mean: vec![0.0; len],
            weight: 0.0,
            weights,
            support,
        };
    }
    let typical_samples = lower_median(present.iter().map(|&i| shares[i].samples).collect());
    let cap = WEIGHT_CAP * typical_samples;
    for &i in &present {
        weights[i] = shares[i].samples.min(cap) * shares[i].credit();
    }
    // Shares are read in place: member j's per-sample mean at c is values[c] x inv[j].
    let vals: Vec<&[f32]> = present.iter().map(|&i| shares[i].values).collect();
    let inv: Vec<f32> = present
        .iter()
        .map(|&i| (1.0 / shares[i].samples) as f32)
        .collect();
    let w: Vec<f64> = present.iter().map(|&i| weights[i]).collect();
    let total: f64 = w.iter().sum();
    let n = vals.len();

    let mut centre = vec![0f32; len];
    coordinate_medians(&vals, &inv, &mut centre);
    let mut dist: Vec<f64> = (0..n).map(|j| distance(vals[j], inv[j], &centre)).collect();
    let mut next = vec![0f32; len];
    for _ in 0..MAX_ITERATIONS {
        // The radius follows the centre: from a median that half the shares pulled off,
        // the first radius is wide.
        let tau = lower_median(dist.clone());
        if tau <= 0.0 {
            break;
        }
        // centre + sum_j k_j (share_j - centre), as one scaled copy and n axpys.
        let k: Vec<f64> = (0..n)
            .map(|j| w[j] * (tau / dist[j]).min(1.0) / total)
            .collect();
        let keep = (1.0 - k.iter().sum::<f64>()) as f32;
        for (y, x) in next.iter_mut().zip(&centre) {
            *y = keep * x;
        }
        for j in 0..n {
            let a = k[j] as f32 * inv[j];
            for (y, v) in next.iter_mut().zip(vals[j]) {
                *y += a * v;
            }
        }
        let moved = distance(&next, 1.0, &centre);
        std::mem::swap(&mut centre, &mut next);
        dist = (0..n).map(|j| distance(vals[j], inv[j], &centre)).collect();
        if moved <= CONVERGED * tau {
            break;
        }
    }
    let along: Vec<f64> = (0..n).map(|j| dot(vals[j], inv[j], &centre)).collect();
    let typical = median(along.clone());
    if present.len() >= 3 && typical > 0.0 {
        // |share|^2 from what is at hand: |share - centre|^2 + 2 share.centre - |centre|^2.
        let centre_sq = dot(&centre, 1.0, &centre);
        let share_sq = |j: usize| (dist[j] * dist[j] + 2.0 * along[j] - centre_sq).max(0.0);
        let cosine = |j: usize| {
            let norms = (share_sq(j) * centre_sq).sqrt();
            if norms > 0.0 {
                (along[j] / norms).clamp(-1.0, 1.0)
            } else {
                0.0
            }
        };
        // Lengths compared as if every member had the typical member's samples (as its credit
        // allows): a smaller batch's mean is longer by its noise, by the square root of the
        // ratio, and a DiLoCo replica that took more inner steps than the typical one moved
        // further, in proportion.
        let norms: Vec<f64> = (0..n)
            .map(|j| {
                let r = shares[present[j]].credited_samples() / typical_samples;
                share_sq(j).sqrt() * r.min(1.0).sqrt() / r.max(1.0)
            })
            .collect();
        let typical_norm = median(norms.clone());
        let spread = 1.4826 * median(along.iter().map(|a| (a - typical).abs()).collect());
        for (j, &i) in present.iter().enumerate() {
            let off = along[j] - typical;
            let deviation = if spread > 0.0 {
                off / spread
            } else if off == 0.0 {
                0.0
            } else {
                off.signum() * MAX_DEVIATION
            };
            support[i] = Some(Support {
                ratio: along[j] / typical,
                deviation: deviation.clamp(-MAX_DEVIATION, MAX_DEVIATION),
                cosine: cosine(j),
                norm: if typical_norm > 0.0 {
                    norms[j] / typical_norm
                } else {
                    1.0
                },
            });
        }
    }
    Aggregate {
        mean: centre,
        weight: total,
        weights,
        support,
    }
}

/// The distance of `values` x `scale` from `centre` (f32 lanes, summed in f64 per block).
fn distance(values: &[f32], scale: f32, centre: &[f32]) -> f64 {
    blocks(values, centre, |v, x| {
        let d = v * scale - x;
        d * d
    })
    .sqrt()
}

/// The dot product of `values` x `scale` with `centre`.
fn dot(values: &[f32], scale: f32, centre: &[f32]) -> f64 {
    blocks(values, centre, |v, x| v * scale * x)
}

/// Sums `f` over pairs: eight f32 lanes per block of 1,024 values, blocks summed in f64 (the
/// lanes let the compiler vectorise; the blocks keep the rounding error of f32 sums small).
fn blocks(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f64 {
    let mut total = 0f64;
    for (a, b) in a.chunks(1024).zip(b.chunks(1024)) {
        let mut lanes = [0f32; 8];
        let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
        let (ra, rb) = (a8.remainder(), b8.remainder());
        for (x, y) in a8.zip(b8) {
            for l in 0..8 {
                lanes[l] += f(x[l], y[l]);
            }
        }
        let tail: f32 = ra.iter().zip(rb).map(|(x, y)| f(*x, *y)).sum();
        total += lanes.iter().map(|l| *l as f64).sum::<f64>() + tail as f64;
    }
    total
}

/// The coordinate-wise median of the members' per-sample means (`vals[j]` x `inv[j]`), into
/// `out`. Up to 32 members, eight coordinates at a time go through a branch-free sorting
/// network (odd-even transposition: n rounds of min/max on eight lanes); beyond, a selection
/// per coordinate.
fn coordinate_medians(vals: &[&[f32]], inv: &[f32], out: &mut [f32]) {
    let n = vals.len();
    if n > 32 {
        let mut column = vec![0f32; n];
        for (c, x) in out.iter_mut().enumerate() {
            for j in 0..n {
                column[j] = vals[j][c] * inv[j];
            }
            let (lower, mid, _) = column.select_nth_unstable_by(n / 2, f32::total_cmp);
            let mid = *mid;
            *x = if n % 2 == 1 {
                mid
            } else {
                (lower.iter().copied().fold(f32::NEG_INFINITY, f32::max) + mid) / 2.0
            };
        }
        return;
    }
    let mut cols = vec![[0f32; 8]; n];
    for (block, out8) in out.chunks_mut(8).enumerate() {
        let c0 = block * 8;
        for j in 0..n {
            let v = &vals[j][c0..c0 + out8.len()];
            for (l, x) in v.iter().enumerate() {
                cols[j][l] = x * inv[j];
            }
        }
        for round in 0..n {
            let mut i = round % 2;
            while i + 1 < n {
                let (a, b) = (cols[i], cols[i + 1]);
                for l in 0..8 {
                    cols[i][l] = a[l].min(b[l]);
                    cols[i + 1][l] = a[l].max(b[l]);
                }
                i += 2;
            }
        }
        for (l, x) in out8.iter_mut().enumerate() {
            *x = if n % 2 == 1 {
                cols[n / 2][l]
            } else {
                (cols[n / 2 - 1][l] + cols[n / 2][l]) / 2.0
            };
        }
    }
}

/// The median (the mean of the middle two for an even count); 0 for none.
/// The lower of the two middle values when there is an even number of them: at most the
/// largest of any half of `v`, so when exactly half the shares of a round are malicious (a
/// minority of the stage, with honest replicas that had no samples sending none) they cannot
/// set it, where the mean of the two middle values would be half theirs.
pub(super) fn lower_median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[(v.len() - 1) / 2]
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::swarm::SeededRng;

    pub(crate) fn gaussian(rng: &mut SeededRng) -> f64 {
        let u1 = ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let u2 = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// `honest` members' sums over `samples` each of a true mean of 1.0 per coordinate plus
    /// unit noise per sample.
    fn honest_sums(
        rng: &mut SeededRng,
        honest: usize,
        samples: usize,
        len: usize,
    ) -> Vec<Vec<f32>> {
        (0..honest)
            .map(|_| {
                (0..len)
                    .map(|_| (0..samples).map(|_| 1.0 + gaussian(rng)).sum::<f64>() as f32)
                    .collect()
            })
            .collect()
    }

    fn shares(sums: &[Vec<f32>], samples: &[f64]) -> Aggregate {
        let len = sums[0].len();
        let s: Vec<Share> = sums
            .iter()
            .zip(samples)
            .map(|(v, &samples)| Share::new(v, samples))
            .collect();
        centered_clip(&s, len)
    }

    fn error(mean: &[f32]) -> f64 {
        let len = mean.len() as f64;
        (mean.iter().map(|v| (*v as f64 - 1.0).powi(2)).sum::<f64>() / len).sqrt()
    }

    /// An honestly reduced part agrees with each member's share about 1 at any signal-to-noise
    /// ratio (members of equal weight); negated, scaled and zeroed parts do not.
    #[test]
    fn averaged_parts_are_judged_by_the_members_own_shares() {
        let len = 4_000;
        for (signal, lo, hi) in [(0.0, 0.7, 1.3), (0.1, 0.8, 1.2), (1.0, 0.97, 1.03)] {
            let mut rng = SeededRng::new(5);
            let g: Vec<f64> = (0..len).map(|_| signal * gaussian(&mut rng)).collect();
            let sums: Vec<Vec<f32>> = (0..6)
                .map(|_| {
                    (0..len)
                        .map(|c| (16.0 * g[c] + 4.0 * gaussian(&mut rng)) as f32)
                        .collect()
                })
                .collect();
            let part = shares(&sums, &[16.0; 6]).mean;
            for own in &sums {
                let honest = agreement(own, 16.0, &part).unwrap();
                assert!((lo..hi).contains(&honest), "signal {signal}: {honest}");
                let negated: Vec<f32> = part.iter().map(|v| -v).collect();
                let flipped = agreement(own, 16.0, &negated).unwrap();
                assert!((flipped + honest).abs() < 1e-9);
                let scaled: Vec<f32> = part.iter().map(|v| 10.0 * v).collect();
                let shrunk = agreement(own, 16.0, &scaled).unwrap();
                assert!((shrunk - honest / 10.0).abs() < 1e-6);
                assert_eq!(agreement(own, 16.0, &vec![0.0; len]), Some(0.0));
            }
        }
        assert_eq!(
            agreement(&[0.0; 4], 1.0, &[1.0; 4]),
            None,
            "nothing to compare"
        );
        assert_eq!(agreement(&[1.0; 4], 0.0, &[1.0; 4]), None, "no samples");
    }

    #[test]
    fn identical_shares_average_to_themselves() {
        let a = shares(&[vec![2.0, 4.0], vec![2.0, 4.0], vec![2.0, 4.0]], &[2.0; 3]);
        assert_eq!(a.mean, vec![1.0, 2.0]);
        assert_eq!(a.weight, 6.0);
        let same = Support {
            ratio: 1.0,
            deviation: 0.0,
            cosine: 1.0,
            norm: 1.0,
        };
        assert_eq!(a.support, vec![Some(same); 3]);
    }

    /// A short share in the result's direction has a low ratio and a cosine near 1; a
    /// flipped one a cosine near -1; a share of zeros a cosine of 0.
    #[test]
    fn support_tells_a_short_share_from_an_opposing_one() {
        let a = shares(
            &[
                vec![2.0, 0.0],
                vec![2.2, 0.2],
                vec![1.8, -0.2],
                vec![0.4, 0.05],
                vec![-2.0, 0.0],
                vec![0.0, 0.0],
            ],
            &[1.0; 6],
        );
        let support: Vec<Support> = a.support.iter().map(|s| s.unwrap()).collect();
        let short = support[3];
        assert!(short.ratio < 0.4 && short.cosine > 0.95, "{short:?}");
        let flipped = support[4];
        assert!(flipped.ratio < 0.0 && flipped.cosine < -0.95, "{flipped:?}");
        assert_eq!(support[5].cosine, 0.0);
        assert!(support[..3].iter().all(|s| s.cosine > 0.95), "{support:?}");
    }

    /// A share that is mostly noise has an honest-looking component along the result but is
    /// several times as long as its stage-mates'; a small batch's noisier mean, and a DiLoCo
    /// replica's longer move after more inner steps, are not judged longer for it
    /// (uncorrected, a mean of one sample is 2.7 times as long as the others' of 16).
    /// Members' samples: a mean of 0.3 per coordinate under unit noise.
    #[test]
    fn support_tells_noise_from_a_small_batch() {
        let mut rng = SeededRng::new(3);
        let len = 2_000;
        let mut sum = |samples: usize, noise: f64| -> Vec<f32> {
            (0..len)
                .map(|_| {
                    let s: f64 = (0..samples).map(|_| 0.3 + gaussian(&mut rng)).sum();
                    (s + noise * gaussian(&mut rng)) as f32
                })
                .collect()
        };
        let mut sums: Vec<Vec<f32>> = (0..5).map(|_| sum(16, 0.0)).collect();
        sums.push(sum(1, 0.0));
        sums.push(sum(16, 30.0));
        // A DiLoCo replica that took four times the typical inner steps: four times the
        // samples, and a mean four times as long.
        sums.push(sum(16, 0.0).iter().map(|v| 16.0 * v).collect());
        let a = shares(&sums, &[16.0, 16.0, 16.0, 16.0, 16.0, 1.0, 16.0, 64.0]);
        let support: Vec<Support> = a.support.iter().map(|s| s.unwrap()).collect();
        let (small, noisy, further) = (support[5], support[6], support[7]);
        assert!(further.norm < 1.5, "{further:?}");
        assert!(support[..5].iter().all(|s| s.norm < 1.5), "{support:?}");
        assert!(small.norm < 1.0, "{small:?}");
        assert!(noisy.norm > 3.0, "{noisy:?}");
        assert!(noisy.ratio < 2.0, "{noisy:?}");
    }

    #[test]
    fn honest_shares_average_close_to_the_plain_mean() {
        let mut rng = SeededRng::new(1);
        let sums = honest_sums(&mut rng, 6, 16, 400);
        let robust = shares(&sums, &[16.0; 6]);
        let plain: Vec<f32> = (0..400)
            .map(|c| sums.iter().map(|s| s[c]).sum::<f32>() / 96.0)
            .collect();
        // Both estimate the true mean about equally well.
        assert!(
            error(&robust.mean) < 1.1 * error(&plain),
            "{} vs {}",
            error(&robust.mean),
            error(&plain)
        );
        // Every honest share supports the result about as much as the median one.
        for s in &robust.support {
            assert!(
                s.is_some_and(|s| (0.8..1.2).contains(&s.ratio)),
                "{:?}",
                robust.support
            );
        }
    }

    #[test]
    fn a_minority_of_attackers_moves_the_mean_at_most_by_the_honest_spread() {
        for attack in ["flip", "scale", "huge-claim", "noise"] {
            let mut rng = SeededRng::new(7);
            let mut sums = honest_sums(&mut rng, 7, 16, 400);
            let mut samples = vec![16.0; 7];
            let honest_error = error(&shares(&sums, &samples).mean);
            for _ in 0..5 {
                let mut v = honest_sums(&mut rng, 1, 16, 400).remove(0);
                let mut claim = 16.0;
                match attack {
                    "flip" => v.iter_mut().for_each(|x| *x = -*x),
                    "scale" => v.iter_mut().for_each(|x| *x *= -1000.0),
                    "huge-claim" => {
                        v.iter_mut().for_each(|x| *x *= -1e6);
                        claim = 1e6 * 16.0;
                    }
                    _ => v
                        .iter_mut()
                        .for_each(|x| *x += 100.0 * gaussian(&mut rng) as f32),
                }
                sums.push(v);
                samples.push(claim);
            }
            let robust = shares(&sums, &samples);
            let e = error(&robust.mean);
            // 5 of 12 malicious: the error stays of the order of the per-sample noise of one
            // honest member (1/sqrt(16) = 0.25 per coordinate), nowhere near the attack's.
            assert!(e < 0.5, "{attack}: error {e} (honest alone {honest_error})");
            // The weight of a huge claim is capped.
            assert!(robust.weights.iter().all(|w| *w <= 16.0), "{attack}");
            // The evidence: honest shares support the result, flipped and scaled ones oppose
            // it far outside the honest spread, noise does not follow it.
            let support: Vec<Support> = robust.support.iter().map(|s| s.unwrap()).collect();
            assert!(
                support[..7].iter().all(|s| (0.8..1.2).contains(&s.ratio)),
                "{attack}: {support:?}"
            );
            if attack != "noise" {
                assert!(
                    support[7..]
                        .iter()
                        .all(|s| s.ratio < 0.0 && s.deviation <= -MAX_DEVIATION),
                    "{attack}: {support:?}"
                );
            }
        }
    }

    /// Half the shares of a round can be malicious when a minority of the stage is (honest
    /// replicas without samples in the round send none): noise far outside the honest spread
    /// still counts at most that spread.
    #[test]
    fn attackers_that_are_half_of_the_shares_cannot_set_the_radius() {
        for (honest, attackers) in [(2, 2), (3, 3), (5, 5)] {
            let mut rng = SeededRng::new(11);
            let mut sums = honest_sums(&mut rng, honest, 16, 400);
            for _ in 0..attackers {
                let noise: Vec<f32> = (0..400)
                    .map(|_| (16.0 + 1000.0 * gaussian(&mut rng)) as f32)
                    .collect();
                sums.push(noise);
            }
            let samples = vec![16.0; honest + attackers];
            let e = error(&shares(&sums, &samples).mean);
            // The honest members' own error is about 0.25 / sqrt(honest) per coordinate; the
            // noise alone, averaged in, would be about 1000 / 16 / 2 = 31.
            assert!(e < 0.5, "{honest} honest, {attackers} attackers: error {e}");
        }
    }

    #[test]
    fn coordinate_medians_match_sorting_for_any_group_size() {
        let mut rng = SeededRng::new(5);
        for n in 1..40 {
            let len = 21; // not a multiple of the eight lanes
            let vals: Vec<Vec<f32>> = (0..n)
                .map(|_| (0..len).map(|_| gaussian(&mut rng) as f32).collect())
                .collect();
            let inv: Vec<f32> = (0..n).map(|j| 1.0 / (1 + j % 3) as f32).collect();
            let refs: Vec<&[f32]> = vals.iter().map(|v| v.as_slice()).collect();
            let mut out = vec![0f32; len];
            coordinate_medians(&refs, &inv, &mut out);
            for c in 0..len {
                let mut col: Vec<f64> = (0..n).map(|j| (vals[j][c] * inv[j]) as f64).collect();
                col.sort_by(f64::total_cmp);
                let want = if n % 2 == 1 {
                    col[n / 2]
                } else {
                    (col[n / 2 - 1] + col[n / 2]) / 2.0
                };
                assert!((out[c] as f64 - want).abs() < 1e-6, "n {n} c {c}");
            }
        }
    }

    #[test]
    fn absent_shares_count_for_nothing() {
        let a = shares(&[vec![2.0], vec![], vec![6.0]], &[2.0, 0.0, 2.0]);
        assert_eq!(a.weights, vec![2.0, 0.0, 2.0]);
        assert_eq!(a.mean, vec![2.0]);
        // Two present members: no majority to judge either by.
        assert_eq!(a.support, vec![None; 3]);
        let none = centered_clip(&[], 3);
        assert_eq!(none.mean, vec![0.0; 3]);
    }
}
