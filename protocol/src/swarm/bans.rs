//! Bans with evidence: a replica whose averaging shares keep opposing (or dwarfing) its stage's
//! robust mean is accused by the replicas that saw them, and banned by every peer once a
//! majority of the stage accuses it.
//!
//! Evidence is first-hand. Each part owner scores every share it reduced by how much it
//! supported the part's robust mean ([`super::robust::Support`]: a ratio, about 1 for honest
//! shares, and a robust z-score against the other members). A replica keeps the last
//! [`WINDOW`] scores it saw of each member; when their mean ratio falls below [`SUPPORT_LOW`]
//! with a mean deviation below -[`DEVIATION`] (flipped or zeroed shares), or rises above
//! [`SUPPORT_HIGH`] with a deviation above [`DEVIATION`] (scaled ones), it accuses the member in
//! its announcements, and withdraws the accusation if the window recovers (one unlucky stretch
//! of noise costs nothing). Every
//! member sends a share to every owner, so every replica of the stage holds its own evidence.
//!
//! A peer bans a member when more than half of the member's stage (the member counted)
//! accuses it, counting only accusers that its own view holds to be replicas of that stage. So
//! a minority of colluding replicas can neither frame an honest one nor shield one of theirs,
//! and peers of other stages, which see no shares, follow the stage's majority. A ban lasts
//! for the rest of the run: the banned peer's messages and announcements are dropped and it is
//! routed around like a peer that left.

use super::PeerKey;
use super::membership::Membership;
use super::message::{Accusation, Misconduct};
use super::robust::Support;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Rounds of scores a replica judges a member by.
pub const WINDOW: usize = 5;

/// Below this mean support a member's shares oppose the stage (an honest member's mean over
/// [`WINDOW`] rounds stays above ~0.2 even with attackers present; a flipped share's is ~-1).
pub const SUPPORT_LOW: f64 = 0.4;

/// Above this mean support a member's shares dwarf the stage's (honest: below ~2.1).
pub const SUPPORT_HIGH: f64 = 3.0;

/// ...and only when the window's mean deviation is at least this many robust standard
/// deviations from the median member (for honest members it averages 0 over the window).
pub const DEVIATION: f64 = 2.0;

/// Accusations one announcement may carry.
pub const MAX_ACCUSATIONS: usize = 16;

/// Banned peers remembered, at most (older bans are forgotten first beyond it).
const MAX_BANNED: usize = super::membership::MAX_MEMBERS;

/// A ban, as decided by this peer.
#[derive(Clone, Debug, PartialEq)]
pub struct Ban {
    /// The banned peer.
    pub peer: PeerKey,
    /// What most of its accusers said.
    pub why: Misconduct,
    /// Replicas of its stage that accused it, and the replicas counted (it included).
    pub accusers: usize,
    /// Replicas counted.
    pub replicas: usize,
}

/// One peer's evidence, accusations and bans.
#[derive(Debug, Default)]
pub struct Bans {
    /// The last [`WINDOW`] support scores this peer saw of each member of its stage.
    seen: BTreeMap<PeerKey, VecDeque<Support>>,
    /// Whom this peer accuses (announced with every announcement).
    accusing: BTreeMap<PeerKey, Misconduct>,
    /// Banned peers (looked up on every message).
    banned: BTreeSet<PeerKey>,
    /// The same, in the order banned (the oldest is forgotten first).
    banned_order: VecDeque<PeerKey>,
}

impl Bans {
    /// Whether `peer` is banned.
    pub fn is_banned(&self, peer: PeerKey) -> bool {
        self.banned.contains(&peer)
    }

    /// This peer's accusations, for its announcements.
    pub fn accusations(&self) -> Vec<Accusation> {
        self.accusing
            .iter()
            .map(|(&peer, &why)| Accusation { peer, why })
            .collect()
    }

    /// Scores a round this peer owned a part of gave members of its stage. Returns the members
    /// whose accusation changed (to check for a ban).
    pub fn observe(&mut self, support: &[(PeerKey, Support)]) -> Vec<PeerKey> {
        let mut changed = Vec::new();
        for &(peer, s) in support {
            if self.is_banned(peer) || !(s.ratio.is_finite() && s.deviation.is_finite()) {
                continue;
            }
            let seen = self.seen.entry(peer).or_default();
            seen.push_back(s);
            if seen.len() > WINDOW {
                seen.pop_front();
            }
            if seen.len() < WINDOW {
                continue;
            }
            let ratio = seen.iter().map(|s| s.ratio).sum::<f64>() / WINDOW as f64;
            let deviation = seen.iter().map(|s| s.deviation).sum::<f64>() / WINDOW as f64;
            let verdict = if ratio < SUPPORT_LOW && deviation < -DEVIATION {
                Some(Misconduct::OpposedTheStage)
            } else if ratio > SUPPORT_HIGH && deviation > DEVIATION {
                Some(Misconduct::DwarfedTheStage)
            } else {
                None
            };
            let before = self.accusing.get(&peer).copied();
            match verdict {
                Some(why) if before != Some(why) => {
                    if self.accusing.len() >= MAX_ACCUSATIONS && before.is_none() {
                        self.make_room();
                    }
                    if self.accusing.len() < MAX_ACCUSATIONS || before.is_some() {
                        self.accusing.insert(peer, why);
                        changed.push(peer);
                    }
                }
                None if before.is_some() => {
                    self.accusing.remove(&peer);
                    changed.push(peer);
                }
                _ => {}
            }
        }
        changed
    }

    /// Drops the accusation of the earliest banned peer still accused (its ban has had time to
    /// spread), if any.
    fn make_room(&mut self) {
        if let Some(k) = self
            .banned_order
            .iter()
            .find(|k| self.accusing.contains_key(k))
        {
            self.accusing.remove(&k.clone());
        }
    }

    /// Forgets the evidence about a member that left (a ban is not forgotten).
    pub fn forget(&mut self, peer: PeerKey) {
        self.seen.remove(&peer);
        if !self.is_banned(peer) {
            self.accusing.remove(&peer);
        }
    }

    /// Bans `accused` if more than half of its stage accuses it, as `members` and this peer
    /// (`me`, serving `my_stage`) see it; returns the ban when it is new.
    pub fn judge(
        &mut self,
        accused: PeerKey,
        members: &Membership,
        me: PeerKey,
        my_stage: Option<u32>,
    ) -> Option<Ban> {
        if self.is_banned(accused) || accused == me {
            return None;
        }
        let stage = members.get(accused)?.announcement.stage?;
        let mut replicas = members.replicas(stage);
        if my_stage == Some(stage) {
            replicas.push(me);
        }
        if !replicas.contains(&accused) {
            replicas.push(accused);
        }
        let mut votes: BTreeMap<Misconduct, usize> = BTreeMap::new();
        for &r in &replicas {
            let why = if r == me {
                self.accusing.get(&accused).copied()
            } else {
                members.get(r).and_then(|m| {
                    m.announcement
                        .accuses
                        .iter()
                        .find(|a| a.peer == accused)
                        .map(|a| a.why)
                })
            };
            if let Some(why) = why.filter(|_| r != accused) {
                *votes.entry(why).or_default() += 1;
            }
        }
        let accusers: usize = votes.values().sum();
        if 2 * accusers <= replicas.len() {
            return None;
        }
        let why = votes
            .iter()
            .max_by_key(|(_, n)| **n)
            .map(|(w, _)| *w)
            .unwrap_or(Misconduct::OpposedTheStage);
        self.seen.remove(&accused);
        if self.banned_order.len() >= MAX_BANNED
            && let Some(oldest) = self.banned_order.pop_front()
        {
            self.banned.remove(&oldest);
        }
        self.banned_order.push_back(accused);
        self.banned.insert(accused);
        // Keep accusing it, so that peers that have not yet banned it still can.
        self.accusing.entry(accused).or_insert(why);
        Some(Ban {
            peer: accused,
            why,
            accusers,
            replicas: replicas.len(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::swarm::fixtures::announcement;

    /// A score of `ratio`, as far from the others as a ratio that far from 1 would be when
    /// honest ratios spread by 0.2.
    fn s(ratio: f64) -> Support {
        Support {
            ratio,
            deviation: ((ratio - 1.0) / 0.2).clamp(-8.0, 8.0),
        }
    }

    fn stage_of(n: u64) -> Membership {
        let mut m = Membership::default();
        for k in 1..=n {
            m.update(PeerKey(k), announcement(Some(0)), std::time::Duration::ZERO);
        }
        m
    }

    fn accuse(m: &mut Membership, accuser: u64, accused: u64) {
        let mut a = m.get(PeerKey(accuser)).unwrap().announcement.clone();
        a.seq += 1;
        a.accuses.push(Accusation {
            peer: PeerKey(accused),
            why: Misconduct::OpposedTheStage,
        });
        m.update(PeerKey(accuser), a, std::time::Duration::ZERO);
    }

    #[test]
    fn a_member_is_accused_only_after_a_window_of_opposing_shares_and_cleared_when_it_recovers() {
        let mut b = Bans::default();
        let bad = PeerKey(9);
        for round in 0..WINDOW {
            let changed = b.observe(&[(bad, s(-1.0)), (PeerKey(2), s(1.0))]);
            assert_eq!(changed.is_empty(), round + 1 < WINDOW, "round {round}");
        }
        assert_eq!(
            b.accusations(),
            vec![Accusation {
                peer: bad,
                why: Misconduct::OpposedTheStage
            }]
        );
        // One bad round among good ones is noise.
        let mut c = Bans::default();
        for r in [1.0, -1.0, 1.2, 0.9, 1.0, 0.8] {
            c.observe(&[(bad, s(r))]);
        }
        assert!(c.accusations().is_empty());
        // Low ratios within the members' own spread (no common signal) are no evidence.
        let mut d = Bans::default();
        for _ in 0..2 * WINDOW {
            d.observe(&[(
                bad,
                Support {
                    ratio: -3.0,
                    deviation: -1.0,
                },
            )]);
        }
        assert!(d.accusations().is_empty());
        // Recovering withdraws the accusation.
        for _ in 0..WINDOW {
            b.observe(&[(bad, s(1.0))]);
        }
        assert!(b.accusations().is_empty());
        // Scaled shares are accused too.
        for _ in 0..WINDOW {
            b.observe(&[(bad, s(10.0))]);
        }
        assert_eq!(b.accusations()[0].why, Misconduct::DwarfedTheStage);
    }

    #[test]
    fn a_ban_needs_more_than_half_of_the_stage() {
        // Six replicas (1..=6), this peer is 1; 6 is accused.
        let mut m = stage_of(6);
        let me = PeerKey(1);
        m.remove(me);
        let mut b = Bans::default();
        for _ in 0..WINDOW {
            b.observe(&[(PeerKey(6), s(-1.0))]);
        }
        accuse(&mut m, 2, 6);
        assert_eq!(b.judge(PeerKey(6), &m, me, Some(0)), None, "2 of 6");
        accuse(&mut m, 3, 6);
        assert_eq!(
            b.judge(PeerKey(6), &m, me, Some(0)),
            None,
            "3 of 6 is not more than half"
        );
        accuse(&mut m, 4, 6);
        let ban = b.judge(PeerKey(6), &m, me, Some(0)).expect("4 of 6");
        assert_eq!((ban.accusers, ban.replicas), (4, 6));
        assert!(b.is_banned(PeerKey(6)));
        assert_eq!(b.judge(PeerKey(6), &m, me, Some(0)), None, "banned once");
    }

    #[test]
    fn colluding_minorities_and_other_stages_cannot_frame_a_replica() {
        let mut m = stage_of(6);
        // Three peers of another stage accuse replica 1 as well.
        for k in 10..13 {
            m.update(PeerKey(k), announcement(Some(1)), std::time::Duration::ZERO);
            accuse(&mut m, k, 1);
        }
        // Two colluding replicas of its stage.
        accuse(&mut m, 5, 1);
        accuse(&mut m, 6, 1);
        let mut b = Bans::default();
        assert_eq!(b.judge(PeerKey(1), &m, PeerKey(99), None), None);
        // A peer that serves no stage is judged by nobody's stage.
        m.update(PeerKey(20), announcement(None), std::time::Duration::ZERO);
        for k in 2..7 {
            accuse(&mut m, k, 20);
        }
        assert_eq!(b.judge(PeerKey(20), &m, PeerKey(99), None), None);
    }

    /// Shares with no common signal (pure noise, as late in training or in a modelled run):
    /// their ratios scatter widely, but no member stands out from the others for long.
    #[test]
    fn members_without_a_common_signal_are_never_accused() {
        use crate::swarm::SeededRng;
        use crate::swarm::robust::{Share, centered_clip, tests::gaussian};
        let mut rng = SeededRng::new(3);
        let mut b = Bans::default();
        for _ in 0..2_000 {
            let sums: Vec<Vec<f32>> = (0..6)
                .map(|_| (0..200).map(|_| gaussian(&mut rng) as f32).collect())
                .collect();
            let shares: Vec<Share> = sums
                .iter()
                .map(|v| Share {
                    values: v,
                    samples: 1.0,
                })
                .collect();
            let robust = centered_clip(&shares, 200);
            let scores: Vec<(PeerKey, Support)> = (0..6)
                .filter_map(|k| Some((PeerKey(k), robust.support[k as usize]?)))
                .collect();
            b.observe(&scores);
            assert!(b.accusations().is_empty(), "{scores:?}");
        }
    }

    #[test]
    fn accusations_are_bounded() {
        let mut b = Bans::default();
        for _ in 0..WINDOW {
            let all: Vec<(PeerKey, Support)> = (0..100).map(|k| (PeerKey(k), s(-1.0))).collect();
            b.observe(&all);
        }
        assert_eq!(b.accusations().len(), MAX_ACCUSATIONS);
    }
}
