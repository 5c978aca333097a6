//! The members' vote on the averaged parts of a round (see the module above): each member's
//! verdicts, the wait for the others', and the tally that refuses a part.

use super::{Phase, Round, RoundMsg, RoundOut};
use crate::swarm::PeerKey;
use crate::swarm::bans::{Evidence, PART_LOW};
use crate::swarm::message::Vote;
use crate::swarm::robust;
use std::time::Duration;

/// The cosine above which an owner counts on a member to accept its part: the member's vote
/// compares the part with its own contribution, the owner only has the share it received (an
/// encoding of it, with error feedback), so a margin over [`robust::VOTE_COSINE`].
pub(super) const SURE_COSINE: f64 = robust::VOTE_COSINE + 0.1;

impl Round {
    /// How this member finds part `j`, received from `from`: its vote on it, and (from its
    /// owner, not relayed while filling: a relayer did not compute it) the evidence against
    /// or for the owner. Judged where the part has values: a sparse part's are where its
    /// owner's error feedback put them (see [`robust::on_support`]).
    pub(super) fn judge_part(&mut self, from: PeerKey, j: usize, part: &[f32]) {
        let own = self.own.get(self.range(j)).unwrap_or_default();
        let (own_there, part_there) = robust::on_support(own, part);
        let cosine = robust::cosine(&own_there, &part_there);
        let agreement = match self.codec.is_sparse() {
            true => cosine,
            false => robust::agreement(own, self.own_samples, part),
        };
        if let Some(agreement) = agreement.filter(|_| self.phase == Phase::Exchanging) {
            self.evidence.push(Evidence::Part {
                peer: from,
                agreement,
            });
        }
        if Some(j) != self.my_index() && self.own_samples > 0.0 {
            self.votes[j] = judge(cosine, self.forge_part);
        }
    }

    /// Whether the vote will keep this member's own part (`part`, as every member decodes
    /// it) whatever the verdicts on it say, so that it need not wait for them (with few
    /// members, that wait is most of what the vote costs a round: a verdict from across the
    /// swarm). It is sure when every other member still there sent a share with samples whose
    /// cosine with the part is clearly above [`robust::VOTE_COSINE`] ([`SURE_COSINE`]: the
    /// member judges with its own contribution, of which the share is an encoding), so every
    /// honest one accepts, and liars, fewer than half of the group, cannot outnumber the
    /// acceptances; and when the part goes out within half a round timeout of the first share
    /// coming in, long before any member that sent one gives the part up (1.5 timeouts after
    /// it sent its shares). A sparse codec's shares keep only some of a member's values, so
    /// they tell nothing of its vote.
    pub(super) fn sure_to_be_kept(&self, part: &[f32], now: Duration) -> bool {
        let prompt = (self.first_share_at)
            .is_some_and(|t| now.saturating_sub(t) < self.timing.round_timeout / 2);
        prompt
            && !self.codec.is_sparse()
            && self
                .group
                .iter()
                .filter(|k| **k != self.me && !self.gone.contains(k))
                .all(|k| match self.shares.get(k) {
                    Some((share, samples, _)) if *samples > 0.0 => {
                        let (share, part) = robust::on_support(share, part);
                        robust::cosine(&share, &part).is_some_and(|c| c > SURE_COSINE)
                    }
                    _ => false,
                })
    }

    /// Every part is in, or given up on (`zeroed`): tell the others how this member found
    /// each part, and wait for theirs.
    pub(super) fn vote(&mut self, zeroed: Vec<u32>, now: Duration) {
        self.doubt_own_share();
        // A part this member could not get counts as refused: when most members lost a part
        // (its owner was slow, or its messages were lost), its owner drops it too instead of
        // applying it alone.
        for &j in &zeroed {
            if let Some(v) = self.votes.get_mut(j as usize) {
                *v = Vote::Refuse;
            }
        }
        self.zeroed = zeroed;
        if self.group.len() == 1 {
            return self.decide(false);
        }
        for &k in &self.group {
            if k != self.me && !self.gone.contains(&k) {
                self.out.push_back(RoundOut::Send(
                    k,
                    RoundMsg::Verdict {
                        attempt: self.attempt,
                        votes: self.votes.clone(),
                    },
                ));
            }
        }
        self.phase = Phase::Voting;
        self.deadline = Some(now + self.timing.round_timeout / 2);
        self.maybe_decide();
    }

    /// Most of the parts this member judged disagree with its own share: then the odd one
    /// out is its share, not the parts, and it neither refuses them nor takes the round as
    /// evidence against their owners (fewer than half of the owners are assumed malicious,
    /// so most parts are honest). An honest member's share goes wrong that way when a hop
    /// after its stage sent it wrong activation gradients (`flip-backward`, `label-flip`):
    /// judging by it, such members accused honest owners together, and banned up to eight
    /// honest replicas in an `attack.toml` run.
    fn doubt_own_share(&mut self) {
        let judged = self
            .evidence
            .iter()
            .filter(|e| matches!(e, Evidence::Part { .. }))
            .count();
        let disagreeing = self
            .evidence
            .iter()
            .filter(|e| matches!(e, Evidence::Part { agreement, .. } if *agreement < PART_LOW))
            .count();
        // One part judged (a group of two) leaves nothing to tell the two apart by.
        if !self.self_doubt || judged < 2 || 2 * disagreeing <= judged {
            return;
        }
        self.evidence
            .retain(|e| !matches!(e, Evidence::Part { .. }));
        for v in &mut self.votes {
            if *v == Vote::Refuse {
                *v = Vote::Abstain;
            }
        }
    }

    /// Whether this member waits (or waited in vain) for `peer`'s verdict: it heard from
    /// `peer` this attempt, `peer` is still there, and no verdict came.
    pub(super) fn verdict_missing(&self, peer: PeerKey) -> bool {
        self.heard.contains(&peer)
            && !self.gone.contains(&peer)
            && !self.verdicts.contains_key(&peer)
    }

    /// Decide once every member heard from has voted, or as soon as the verdicts still
    /// missing could not change the outcome: the wait is then the time to the verdicts that
    /// settle it, not to the slowest member's.
    pub(super) fn maybe_decide(&mut self) {
        let heard_all = !self.heard.iter().any(|k| self.verdict_missing(*k));
        if self.phase == Phase::Voting && (heard_all || self.settled()) {
            self.decide(false);
        }
    }

    fn ballots(&self) -> Vec<(PeerKey, &[Vote])> {
        std::iter::once((self.me, &self.votes[..]))
            .chain(self.verdicts.iter().map(|(k, v)| (*k, &v[..])))
            .collect()
    }

    /// Whether every part's fate is fixed whatever the members not yet heard vote (each
    /// counted as able to vote either way): the decision is then the one every verdict
    /// would give.
    fn settled(&self) -> bool {
        let ballots = self.ballots();
        let pending: Vec<PeerKey> = self
            .group
            .iter()
            .copied()
            .filter(|k| *k != self.me && !self.gone.contains(k) && !self.verdicts.contains_key(k))
            .collect();
        (0..self.group.len()).all(|j| {
            let open = pending.iter().filter(|k| **k != self.group[j]).count();
            let (accept, refuse) = count(&self.group, &ballots, j);
            self.zeroed.contains(&(j as u32))
                || (Some(j) == self.my_index() && self.own_part_sure)
                || accept >= refuse + open
                || refuse > accept + open
        })
    }

    /// Apply the votes that came: a part with more refusals than acceptances among the
    /// members other than its owner is zero. `waited_out`: decided at the vote's deadline.
    pub(super) fn decide(&mut self, waited_out: bool) {
        let refused: Vec<u32> = tally(&self.group, &self.ballots())
            .into_iter()
            .filter(|j| !self.zeroed.contains(j))
            .collect();
        for &j in &refused {
            if let Some(Some(part)) = self.averaged.get_mut(j as usize) {
                part.iter_mut().for_each(|v| *v = 0.0);
            }
        }
        let zeroed = std::mem::take(&mut self.zeroed);
        self.finish(zeroed, refused, waited_out);
    }

    /// `from`'s verdict: only from a member of the group, once per attempt, with exactly one
    /// vote per part.
    pub(super) fn on_verdict(&mut self, from: PeerKey, votes: Vec<Vote>) {
        if !self.group.contains(&from)
            || from == self.me
            || votes.len() != self.group.len()
            || self.verdicts.contains_key(&from)
        {
            self.violation(
                from,
                "a verdict from outside the group, twice, or not one vote per part",
            );
            return;
        }
        self.verdicts.insert(from, votes);
        self.maybe_decide();
    }
}

/// The parts of `group` the `ballots` (each member's votes, in part order) refuse: more
/// refusals than acceptances among the members other than the part's owner (a tie keeps the
/// part).
pub(super) fn tally(group: &[PeerKey], ballots: &[(PeerKey, &[Vote])]) -> Vec<u32> {
    (0..group.len())
        .filter(|&j| {
            let (accept, refuse) = count(group, ballots, j);
            refuse > accept
        })
        .map(|j| j as u32)
        .collect()
}

/// The acceptances and refusals of part `j` among the `ballots` of the members other than
/// its owner.
fn count(group: &[PeerKey], ballots: &[(PeerKey, &[Vote])], j: usize) -> (usize, usize) {
    let count = |want: Vote| {
        ballots
            .iter()
            .filter(|(k, votes)| *k != group[j] && votes.get(j) == Some(&want))
            .count()
    };
    (count(Vote::Accept), count(Vote::Refuse))
}

/// How a member finds a part from the [`robust::cosine`] between its own share and it (None:
/// either is zero). A scripted forger votes the other way: for the forged parts, against the
/// honest ones.
fn judge(cosine: Option<f64>, inverted: bool) -> Vote {
    let found = match cosine {
        Some(c) if c > robust::VOTE_COSINE => Vote::Accept,
        Some(c) if c < -robust::VOTE_COSINE => Vote::Refuse,
        _ => Vote::Abstain,
    };
    match (found, inverted) {
        (Vote::Accept, true) | (Vote::Abstain, true) => Vote::Refuse,
        (Vote::Refuse, true) => Vote::Accept,
        (found, false) => found,
    }
}
