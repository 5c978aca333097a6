//! The owner's side of a round: the members' shares of its part as they arrive, their robust
//! mean, the evidence on each share, and the averaged part sent back to every member (one
//! encoded buffer for all of them).

use super::{Phase, Round, RoundMsg, RoundOut};
use crate::swarm::PeerKey;
use crate::swarm::bans::Evidence;
use crate::swarm::norms;
use crate::swarm::robust::{self, Share};
use std::sync::Arc;
use std::time::Duration;

impl Round {
    /// `from`'s share of part `part`, which this member should own: once per member of the
    /// group, finite, of the part's size and within reach of this member's own scale.
    pub(super) fn on_share(
        &mut self,
        from: PeerKey,
        part: u32,
        samples: f64,
        loss: Option<f64>,
        data: Vec<u8>,
        now: Duration,
    ) {
        let Some(me) = self.my_index() else { return };
        if self.owned_done || self.gone.contains(&from) {
            // Late: the part was reduced (or is being reduced) without it.
            return;
        }
        // One share per member: a repeat (or a replay) does not replace the first.
        if part as usize != me || !self.group.contains(&from) || self.shares.contains_key(&from) {
            self.violation(
                from,
                "a part sent to a member that does not own it, twice, or from outside the group",
            );
            return;
        }
        if !(samples.is_finite() && samples >= 0.0) || loss.is_some_and(|l| !l.is_finite()) {
            self.violation(from, "a part with a sample count or loss out of range");
            return;
        }
        let expect = self.range(me).len();
        match self.decode(&data, expect) {
            Some(v) if !norms::within(norms::rms(&v) / samples.max(1.0), self.own_scale) => {
                self.violation(from, "a part far larger than this member's own");
                // Counted as a member that contributed nothing.
                self.shares.insert(from, (Vec::new(), 0.0, None));
            }
            Some(v) => {
                self.heard.insert(from);
                self.shares.insert(from, (v, samples, loss));
                self.share_arrived(now);
            }
            None => self.violation(
                from,
                "a part that does not decode to finite values of its size",
            ),
        }
        self.maybe_reduce(now, false);
        self.maybe_finish(now);
    }

    /// A share of this attempt reached this member `at` (see `sure_to_be_kept`).
    pub(super) fn share_arrived(&mut self, at: Duration) {
        self.first_share_at = Some(self.first_share_at.map_or(at, |t| t.min(at)));
    }

    /// Once every member's share of this member's part is in (or the exchange timed out):
    /// the part's robust mean, the evidence on each share, and the part encoded once for
    /// every other member.
    pub(super) fn maybe_reduce(&mut self, now: Duration, timed_out: bool) {
        if self.owned_done || self.phase != Phase::Exchanging {
            return;
        }
        let Some(me) = self.my_index() else { return };
        let all = self.group.iter().all(|k| self.shares.contains_key(k));
        if !all && !timed_out {
            return;
        }
        self.owned_done = true;
        let r = self.range(me);
        let members: Vec<PeerKey> = self.shares.keys().copied().collect();
        let shares: Vec<Share> = self
            .shares
            .iter()
            .map(|(k, (values, samples, _))| Share {
                values,
                samples: *samples,
                credit: self.credits.get(k).copied().unwrap_or(1.0),
            })
            .collect();
        self.claims = (self.shares.iter())
            .filter(|(k, _)| **k != self.me)
            .map(|(k, (_, s, _))| (*k, *s))
            .collect();
        let robust = robust::centered_clip(&shares, r.len());
        // The loss too is a mean over capped weights: a claimed batch buys no more say. It is
        // a sum over the member's samples, so a claim beyond its routes would also lower its
        // mean: per sample, it counts the samples its credit allows.
        let (mut loss_sum, mut loss_weight) = (0.0, 0.0);
        for ((share, (_, _, l)), w) in shares.iter().zip(self.shares.values()).zip(&robust.weights)
        {
            let samples = share.credited_samples();
            if let Some(l) = l.filter(|_| samples > 0.0) {
                loss_sum += w * l / samples;
                loss_weight += w;
            }
        }
        let loss = (loss_weight > 0.0).then(|| loss_sum / loss_weight);
        // This member's own part decides the loss it reports (parts agree unless a share
        // went missing).
        self.loss = loss.or(self.loss);
        self.evidence.extend(
            members
                .into_iter()
                .zip(robust.support)
                .filter(|(k, _)| *k != self.me)
                .filter_map(|(peer, s)| Some(Evidence::Share { peer, support: s? })),
        );
        let samples = robust.weight;
        let mut avg = robust.mean;
        if self.forge_part {
            // A scripted attacker (see [`super::attack`]): its part, negated, for everyone.
            avg.iter_mut().for_each(|v| *v = -*v);
        }
        let mut data = Vec::new();
        if self.group.len() == 1 {
            // Alone: nothing travels, so nothing needs compressing.
            self.averaged[me] = Some(avg);
        } else if r.is_empty()
            || self
                .feedback
                .encode_part(&mut self.encoder, &avg, r.clone(), self.len, &mut data)
                .is_err()
        {
            self.averaged[me] = Some(avg);
        } else {
            // The owner uses the decoded bytes too, so every replica holds the same values.
            let decoded = self.decode(&data, r.len()).unwrap_or(avg);
            self.own_part_sure = all && self.sure_to_be_kept(&decoded, now);
            self.averaged[me] = Some(decoded);
            let data = Arc::new(data);
            for &k in &self.group {
                if k != self.me {
                    self.out.push_back(RoundOut::Send(
                        k,
                        RoundMsg::Averaged {
                            attempt: self.attempt,
                            part: me as u32,
                            samples,
                            loss,
                            data: data.clone(),
                        },
                    ));
                }
            }
            self.encoded.insert(me as u32, (samples, loss, data));
        }
    }
}
