//! Routing: which replica of the next stage gets a microbatch, dealt by the weights of what
//! each replica announces and what this sender timed of it.

use super::{Membership, PeerKey, SeededRng};
use crate::swarm::message::Announcement;
use crate::swarm::service::Observed;
use std::collections::BTreeMap;

impl Membership {
    /// Picks the replica of `stage` to send a microbatch to, dealt in proportion to measured
    /// throughput over (1 + queue), so fast idle peers get more work and a peer that stopped
    /// answering (and so stopped being announced) gets none. `avoid` is skipped unless it is
    /// the only choice (a retry goes elsewhere when it can). `observed` is what this peer
    /// timed of each candidate (see `service.rs` and [`route_weights`]).
    pub fn route(
        &self,
        stage: u32,
        avoid: Option<PeerKey>,
        routing: Routing,
        dealer: &mut Dealer,
        observed: impl Fn(PeerKey) -> Observed,
    ) -> Option<PeerKey> {
        let mut candidates = self.replicas(stage);
        if candidates.len() > 1 {
            candidates.retain(|k| Some(*k) != avoid);
        }
        let weights = match routing {
            Routing::Weighted => route_weights(
                candidates
                    .iter()
                    .filter_map(|k| Some((&self.members.get(k)?.announcement, observed(*k)))),
            ),
            Routing::Uniform => {
                let i = dealer.rng.weighted(&vec![1.0; candidates.len()])?;
                return Some(candidates[i]);
            }
        };
        dealer.deal(&candidates, &weights).map(|i| candidates[i])
    }
}

/// Deals a sender's microbatches out to the replicas of the next stage in proportion to their
/// weights, as evenly as the weights allow (smooth weighted round robin: each deal adds every
/// candidate's weight to its credit and goes to the candidate with the most, which gives the
/// sum of the weights back). Random weighted picks reach the same proportions only on
/// average: over a few rounds a sender could send most of its microbatches through one
/// replica, and its averaging share would then reflect that replica's work more than the
/// stage's (with an attacker there, an honest replica's share looks poisoned and gets it
/// accused).
#[derive(Debug)]
pub struct Dealer {
    /// Each candidate's credit (candidates of the last deal only).
    credit: BTreeMap<PeerKey, f64>,
    /// New candidates start at a random point of their cycle, so that senders do not all
    /// pick the same replica first.
    rng: SeededRng,
}

impl Dealer {
    /// A dealer whose randomness comes from `seed`.
    pub fn new(seed: u64) -> Self {
        Dealer {
            credit: BTreeMap::new(),
            rng: SeededRng::new(seed),
        }
    }

    /// The index of the candidate (in key order) that gets the next microbatch; None when no
    /// weight is positive.
    fn deal(&mut self, candidates: &[PeerKey], weights: &[f64]) -> Option<usize> {
        self.credit
            .retain(|k, _| candidates.binary_search(k).is_ok());
        let total: f64 = weights.iter().filter(|w| **w > 0.0).sum();
        if !(total > 0.0 && total.is_finite()) {
            return None;
        }
        let rng = &mut self.rng;
        let mut best: Option<(usize, f64)> = None;
        for (i, (&k, &w)) in candidates.iter().zip(weights).enumerate() {
            let w = w.max(0.0);
            // A random credit of up to one cycle: at most one microbatch ahead or behind.
            let credit = self
                .credit
                .entry(k)
                .or_insert_with(|| rng.next_f64() * total);
            *credit += w;
            if w > 0.0 && best.is_none_or(|(_, most)| *credit > most) {
                best = Some((i, *credit));
            }
        }
        let (i, _) = best?;
        if let Some(c) = self.credit.get_mut(&candidates[i]) {
            *c -= total;
        }
        Some(i)
    }
}

/// How a sender picks the next stage's replica.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Routing {
    /// At random, weighted by throughput / (1 + queue) and skipping stragglers, and parts of
    /// a step in proportion to the drivers' throughput: the protocol's policy.
    #[default]
    Weighted,
    /// Uniformly at random, and equal parts of a step for every driver: the baseline the
    /// weighted policy is measured against.
    Uniform,
}

impl std::str::FromStr for Routing {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "weighted" => Ok(Routing::Weighted),
            "uniform" => Ok(Routing::Uniform),
            other => Err(format!("unknown routing '{other}' (weighted or uniform)")),
        }
    }
}

/// A replica whose expected time to finish one more microbatch ((1 + queue) / throughput) is
/// more than this many times the best candidate's gets none: in synchronous training a step
/// waits for its last microbatch, and one sent to a device hundreds of times slower than the
/// rest would hold up the whole swarm.
pub const STRAGGLER_FACTOR: f64 = 4.0;

/// A factor from the sender's timing at or below which a candidate that announces no measured
/// throughput yet counts as a straggler (about eight late answers in a row).
pub const UNMEASURED_LATE: f64 = 1.0 / 16.0;

/// Routing weights of a list of candidate announcements, each with what the sender's own
/// timing of it says (see `service.rs`): throughput x factor / (1 + queue), the inverse of the
/// expected time to finish one more microbatch. A candidate is a straggler, and gets 0, when
/// its announcement alone (throughput / (1 + queue)) says it is more than
/// [`STRAGGLER_FACTOR`] times slower than the best weight: a low factor scales a candidate's
/// work down but never takes it all away, so its answers in time can restore it, and a
/// candidate's inflated claim counts only as far as its factor lets it. Peers not measured
/// yet count as the mean of the measured ones (or 1 if none is), so newcomers get work from
/// the start.
///
/// While the sender has timed exactly one candidate, the others it has not timed are not cut
/// as stragglers: the one timed may owe its place to an inflated claim, and only a second
/// time shows that (its factor stays 1 until there is a typical time to compare with). Before
/// any is timed, the claims are all there is. Once one is, a candidate that never answered
/// and has a microbatch in flight (on probation) gets no other until it answers, while another
/// candidate can take it: an identity that announces throughput and answers nothing costs a
/// sender one microbatch, not its share of them.
pub fn route_weights<'a>(
    candidates: impl Iterator<Item = (&'a Announcement, Observed)>,
) -> Vec<f64> {
    let list: Vec<(&Announcement, Observed)> = candidates.collect();
    let exploring = list.iter().filter(|(_, o)| o.timed).count() == 1;
    // A throughput claim, if the candidate has measured one.
    let claim = |a: &Announcement| Some(a.throughput as f64).filter(|t| t.is_finite() && *t > 0.0);
    let measured: Vec<f64> = list.iter().filter_map(|(a, _)| claim(a)).collect();
    let default = if measured.is_empty() {
        1.0
    } else {
        measured.iter().sum::<f64>() / measured.len() as f64
    };
    let announced: Vec<f64> = list
        .iter()
        .map(|(a, _)| claim(a).unwrap_or(default) / (1.0 + a.queue as f64))
        .collect();
    let mut weights: Vec<f64> = announced
        .iter()
        .zip(&list)
        .map(|(w, (_, o))| w * o.factor)
        .collect();
    let judged_weights = weights.clone();
    let best = weights.iter().copied().fold(0.0, f64::max);
    for ((w, announced), (a, o)) in weights.iter_mut().zip(&announced).zip(&list) {
        // A peer not measured yet has no claim to hold it up: the sender's timing is all
        // there is, and a persistently late one is a straggler (its probes would each hold a
        // step up, and they end in retries elsewhere, so it would never be measured either).
        let unmeasured_and_late = claim(a).is_none() && o.factor <= UNMEASURED_LATE;
        let judged = o.timed || !exploring;
        let straggler = judged && announced * STRAGGLER_FACTOR < best;
        if straggler || unmeasured_and_late {
            *w = 0.0;
        }
    }
    if list.iter().any(|(_, o)| o.probing) {
        let free = |(w, (_, o)): (&f64, &(&Announcement, Observed))| *w > 0.0 && o.timed;
        if weights.iter().zip(&list).any(free) {
            for (w, (_, o)) in weights.iter_mut().zip(&list) {
                if !o.timed {
                    *w = 0.0;
                }
            }
        }
    }
    if !weights.iter().any(|w| *w > 0.0) {
        // Every replica looks slow or late to this sender (after a partition, say, all of them
        // missed its deadlines and none has measured itself since): it still sends, by the
        // weights it had before judging them, or alike. Sending nowhere would stall the run
        // for good: no replica would get the work that makes it measured and timely again.
        weights = if judged_weights.iter().any(|w| *w > 0.0) {
            judged_weights
        } else {
            vec![1.0; list.len()]
        };
    }
    weights
}
