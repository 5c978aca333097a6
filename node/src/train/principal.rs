//! `shoal train --principal-subspace K`: every stage boundary sends the coordinates of its
//! tensors in the `K` principal directions of the activations that crossed it, as tracked by
//! the sending stage of each replica (see [`shoal_protocol::codec::principal`]).
//!
//! A basis is found from the first microbatch that crosses its boundary and refined every
//! [`REFRESH_STEPS`] steps from the covariance of what crossed since; a microbatch's forward
//! and backward pass use the same basis (refinements come between steps). Every basis the
//! sender finds is counted as sent in fp32, since the receiver needs it to expand the
//! coefficients and to project the gradients it sends back.

use shoal_protocol::codec::principal::{Covariance, PrincipalBasis};

/// Steps between refinements of a basis.
pub const REFRESH_STEPS: usize = 10;

/// Every `COVARIANCE_STRIDE`-th token of a microbatch goes into the covariance.
const COVARIANCE_STRIDE: usize = 4;

/// One boundary of one replica.
struct Tracked {
    basis: Option<PrincipalBasis>,
    covariance: Covariance,
}

/// The bases of every replica's boundaries.
pub struct Subspaces {
    k: usize,
    width: usize,
    /// `[replica][boundary]`.
    tracked: Vec<Vec<Tracked>>,
    steps: usize,
}

impl Subspaces {
    /// `k` directions of activations `width` wide, for `replicas` pipelines of `stages`.
    pub fn new(k: usize, width: usize, replicas: usize, stages: usize) -> anyhow::Result<Self> {
        if k == 0 || k > width {
            anyhow::bail!(
                "--principal-subspace {k}: between 1 and the model's width ({width}) directions"
            );
        }
        if stages < 2 {
            anyhow::bail!("--principal-subspace needs a stage boundary: --stages 2 or more");
        }
        let tracked = (0..replicas)
            .map(|_| {
                (0..stages - 1)
                    .map(|_| Tracked {
                        basis: None,
                        covariance: Covariance::new(width),
                    })
                    .collect()
            })
            .collect();
        Ok(Subspaces {
            k,
            width,
            tracked,
            steps: 0,
        })
    }

    /// The seed of the rotation each boundary's basis is spread with.
    fn seed(boundary: usize) -> u64 {
        boundary as u64 + 1
    }

    /// Activations `x` cross `boundary` of `replica`: the basis they go through, and the values
    /// of a basis the sender found for them (0 if it had one).
    pub fn forward(
        &mut self,
        replica: usize,
        boundary: usize,
        x: &[f32],
    ) -> (&PrincipalBasis, usize) {
        let (k, width) = (self.k, self.width);
        let t = &mut self.tracked[replica][boundary];
        let mut sent = 0;
        if t.basis.is_none() {
            let mut first = Covariance::new(width);
            first.add(x, 1);
            let basis = PrincipalBasis::of_covariance(&first, k, Self::seed(boundary));
            sent = basis.len();
            t.basis = Some(basis);
        }
        t.covariance.add(x, COVARIANCE_STRIDE);
        (t.basis.as_ref().expect("found above"), sent)
    }

    /// The basis activation gradients crossing `boundary` of `replica` back go through (the one
    /// their activations went through).
    pub fn backward(&self, replica: usize, boundary: usize) -> Option<&PrincipalBasis> {
        self.tracked[replica][boundary].basis.as_ref()
    }

    /// Replica 0's bases, by boundary (the model evaluated is replica 0's).
    pub fn first_replicas(&self) -> Vec<Option<PrincipalBasis>> {
        self.tracked[0].iter().map(|t| t.basis.clone()).collect()
    }

    /// A step ended: every [`REFRESH_STEPS`] steps each basis is refined. Returns the values
    /// of the bases sent.
    pub fn end_step(&mut self) -> usize {
        self.steps += 1;
        if !self.steps.is_multiple_of(REFRESH_STEPS) {
            return 0;
        }
        let mut sent = 0;
        for boundaries in &mut self.tracked {
            for (b, t) in boundaries.iter_mut().enumerate() {
                if let Some(basis) = t.basis.as_mut() {
                    basis.refine(&t.covariance, Self::seed(b));
                    sent += basis.len();
                }
                t.covariance.clear();
            }
        }
        sent
    }
}
