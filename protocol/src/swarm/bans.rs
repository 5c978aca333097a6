//! Bans with evidence: a replica whose averaging shares keep opposing (or dwarfing) its stage's
//! robust mean, or whose averaged parts keep disagreeing with the shares they were reduced
//! from, is accused by the replicas that saw them, and banned by every peer once a majority of
//! the stage accuses it.
//!
//! Evidence is first-hand. Each part owner scores every share it reduced by how much it
//! supported the part's robust mean ([`super::robust::Support`]: a ratio, about 1 for honest
//! shares, a robust z-score against the other members, and its length against theirs). A
//! replica keeps the last [`WINDOW`] scores it saw of each member; when their median ratio
//! falls below [`SUPPORT_LOW`] with a median deviation below -[`DEVIATION`] (flipped or zeroed
//! shares), or their median length or ratio rises above [`SUPPORT_HIGH`] (scaled or noisy
//! ones), it accuses the member in its announcements, and withdraws the accusation if the
//! window recovers (one unlucky stretch of noise costs nothing). The averaged parts are
//! judged the same way by the members that receive them: each compares a part with its own
//! share of it ([`super::robust::agreement`], about 1 for an honest part) and accuses an owner
//! whose last [`PART_WINDOW`] parts had a median outside [[`PART_LOW`], [`PART_HIGH`]]. Every
//! member sends a share to every owner and receives every part, so every replica of the stage
//! holds its own evidence of both.
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
use std::time::Duration;

/// Rounds of scores a replica judges a member by.
pub const WINDOW: usize = 5;

/// Below this median support a member's shares oppose the stage (an honest member's over
/// [`WINDOW`] rounds stays above ~0.2 even with attackers present; a flipped share's is ~-1).
pub const SUPPORT_LOW: f64 = 0.4;

/// ...and only while their median cosine with the stage's result is below this: a share that
/// points the stage's way but is short (a DiLoCo replica that took fewer inner steps than the
/// others, a slow one, sends a shorter pseudo-gradient) opposes nothing. Flipped shares are
/// near -1, zeroed ones 0. A last stage that trains on wrong targets sends shares at 0 to 0.3,
/// round after round: they share the stage's pull toward common tokens, and little else. At
/// 0.1 its window passed only now and then, and the last of the honest replicas a ban needed
/// accused it up to 7 rounds after the first (`attack.toml`, `label-flip`, seed 5), while it
/// poisoned the stages upstream. The ratio and the deviation are what keep honest members
/// out, and now and then late in a run, where the stage's common signal is weak, an honest
/// window has both and is accused: in 3 of 16 clean runs (`attack.toml` seeds 1-8,
/// `attack-16` seeds 1-2, whose 16 replicas send small shares: cosines 0.14 and 0.16;
/// `demo`, `regions-nano`, `churn-nano`, seeds 1-2), each time by one replica, far from the
/// majority a ban needs.
pub const OPPOSED_COSINE: f64 = 0.3;

/// Above this median [`Support::norm`] a member's shares dwarf its stage-mates': scaled up, or
/// mostly noise. Honest windows' means (before windows were judged by their medians) stayed
/// below 2.2 in 36 runs (`attack.toml` clean and under every attack, seeds 1-2 and 1-4,
/// `attack-16`, `demo`, `regions-nano`, `churn-nano`, `hetero-nano`, `partition`), the
/// highest a replica whose own shares an attacker downstream poisoned; `noise:0.1` windows
/// reached 5-38 and `noise:0.01` 5-10 (except at the first stage, whose embedding gradients
/// dwarf such noise: 1.1-1.2, and where it does no harm). The component along the result
/// (`ratio`) cannot tell noise: a noise share's is as honest's. So is a median `ratio` above
/// it, [`DEVIATION`] deviations above the median member's: the length is corrected by the
/// samples a member claims, and a liar that claims F times its samples while sending shares F
/// times as long would pass for short until its claims are checked; its component along the
/// result shows it whatever it claims.
pub const SUPPORT_HIGH: f64 = 3.0;

/// The window's median deviation is at least this many robust standard deviations beyond the
/// median member's, below it for opposing shares, above it for dwarfing ones (for honest
/// members it averages 0 over the window).
pub const DEVIATION: f64 = 2.0;

/// Averaged parts a replica judges a member by: fewer than shares, as a forged part is applied
/// by every replica (a share is only clipped), and an honest part's agreement scatters less.
pub const PART_WINDOW: usize = 3;

// Windows are judged by their medians, taken as `robust::lower_median`: odd windows have one.
const _: () = assert!(WINDOW % 2 == 1 && PART_WINDOW % 2 == 1);

/// Below this median agreement the averaged parts a member sent disagree with the shares they
/// were reduced from: a negated part gives about -1, a zeroed one 0, an honest one about 1 on
/// average. A member whose weight was capped, or whose small batch carried little of the
/// stage's signal, sees less and scatters more; at 0.25 such members saw two low parts in
/// three now and then, and as an accusation stands for a few announcements (tens of rounds
/// on a fast stage), five of a stage of eight once accused an honest owner at the same time.
pub const PART_LOW: f64 = 0.1;

/// Above this median agreement its parts were shrunk.
pub const PART_HIGH: f64 = 4.0;

/// Rounds of delivery a replica judges a member by: one that withheld its share or its part
/// in each of the last [`DELIVERY_WINDOW`] rounds it was counted in (while it kept announcing
/// itself as a replica) is accused. Each such round waited a full timeout for it, so the
/// window is short; a replica that reaches its owners too late round after round is judged
/// the same way (its work was lost to the stage anyway).
pub const DELIVERY_WINDOW: usize = 3;

/// Rounds a member led that a replica judges it by as a leader: one that never started, or
/// left this replica out of, each of the last [`LED_WINDOW`] rounds it led is accused.
pub const LED_WINDOW: usize = 2;

/// Accusations one announcement may carry.
pub const MAX_ACCUSATIONS: usize = 16;

/// Banned peers remembered, at most (older bans are forgotten first beyond it).
const MAX_BANNED: usize = super::membership::MAX_MEMBERS;

/// What one round showed this peer of another member.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Evidence {
    /// The member's share of the part this peer reduced supported its robust mean this much.
    Share {
        /// The member.
        peer: PeerKey,
        /// How much (see [`Support`]).
        support: Support,
    },
    /// The averaged part the member sent agreed this well with this peer's own share of it
    /// (see [`super::robust::agreement`]).
    Part {
        /// The member.
        peer: PeerKey,
        /// How well (about 1 when honest).
        agreement: f64,
    },
    /// Whether the member's share reached the part this peer owns, and its averaged part
    /// reached this peer, in time.
    Delivered {
        /// The member.
        peer: PeerKey,
        /// Delivered (false: withheld, or lost).
        delivered: bool,
    },
    /// Whether a round the member led started with this peer in it.
    Led {
        /// The leader.
        peer: PeerKey,
        /// Started with this peer (false: it never started, or left this peer out).
        included: bool,
    },
    /// The member led a round and sent this peer a group without it. No honest leader does:
    /// its group is every replica that joined, and it sends the group to them alone. A leader
    /// that crashed or was slow never sends one, so this, unlike a start that never came, is
    /// accused at once and for good.
    LeftOut {
        /// The leader.
        peer: PeerKey,
    },
}

impl Evidence {
    /// The member it is about.
    pub fn peer(&self) -> PeerKey {
        match *self {
            Evidence::Share { peer, .. }
            | Evidence::Part { peer, .. }
            | Evidence::Delivered { peer, .. }
            | Evidence::Led { peer, .. }
            | Evidence::LeftOut { peer } => peer,
        }
    }
}

/// What this peer saw of one member lately.
#[derive(Debug, Default)]
struct Record {
    /// Support scores of its shares (last [`WINDOW`]).
    shares: VecDeque<Support>,
    /// Agreements of its averaged parts (last [`PART_WINDOW`]).
    parts: VecDeque<f64>,
    /// Whether it delivered (last [`DELIVERY_WINDOW`]).
    delivered: VecDeque<bool>,
    /// Whether the rounds it led included this peer (last [`LED_WINDOW`]).
    led: VecDeque<bool>,
    /// It led a round and told this peer it was left out ([`Evidence::LeftOut`]).
    left_out: bool,
}

impl Record {
    /// What full windows of it say.
    fn verdict(&self) -> Option<Misconduct> {
        // Medians: most of the window's rounds must say it. One or two bad rounds are no
        // evidence of a replica's own: an honest replica whose microbatches went mostly
        // through poisoning replicas of the next stage opposes its stage for a round or two
        // (`attack.toml` under `flip-backward`: two rounds at -0.3 and -0.8, in a window of
        // ones, had a majority of the stage accuse and ban one in 2 of 12 runs while the
        // window's mean decided). Flipped, zeroed or scaled shares oppose every round.
        let median = super::robust::lower_median;
        let shares = (self.shares.len() == WINDOW).then(|| {
            let of = |f: fn(&Support) -> f64| median(self.shares.iter().map(f).collect());
            let ratio = of(|s| s.ratio);
            let deviation = of(|s| s.deviation);
            if ratio < SUPPORT_LOW && deviation < -DEVIATION && of(|s| s.cosine) < OPPOSED_COSINE {
                Some(Misconduct::OpposedTheStage)
            } else if of(|s| s.norm) > SUPPORT_HIGH
                || (ratio > SUPPORT_HIGH && deviation > DEVIATION)
            {
                Some(Misconduct::DwarfedTheStage)
            } else {
                None
            }
        });
        let parts = (self.parts.len() == PART_WINDOW)
            .then(|| {
                !(PART_LOW..=PART_HIGH).contains(&median(self.parts.iter().copied().collect()))
            })
            .filter(|bad| *bad)
            .map(|_| Misconduct::CorruptedParts);
        let withheld = self.delivered.len() == DELIVERY_WINDOW && self.delivered.iter().all(|d| !d);
        let misled = self.led.len() == LED_WINDOW && self.led.iter().all(|i| !i);
        self.left_out
            .then_some(Misconduct::LeftReplicasOut)
            .or(shares.flatten())
            .or(parts)
            .or((withheld || misled).then_some(Misconduct::WithheldWork))
    }

    /// Whether it sent work this peer judged: a share it reduced or a part it received.
    fn judged(&self) -> bool {
        !self.shares.is_empty() || !self.parts.is_empty()
    }

    /// Whether it sent work at all: judged, or delivered in a round too small to judge (a
    /// share is scored against at least two others).
    fn worked(&self) -> bool {
        self.judged() || self.delivered.iter().any(|d| *d)
    }

    /// Whether it did work this peer checked: judged, with nothing to accuse it of. An
    /// identity that only announces itself never is.
    fn verified(&self) -> bool {
        self.judged() && self.verdict().is_none()
    }
}

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
    /// What this peer saw of each member of its stage lately.
    seen: BTreeMap<PeerKey, Record>,
    /// Whom this peer accuses (announced with every announcement), why, and since when.
    accusing: BTreeMap<PeerKey, (Misconduct, Duration)>,
    /// How long an accusation stands at least, whatever the evidence does meanwhile.
    hold: Duration,
    /// Banned peers (looked up on every message).
    banned: BTreeSet<PeerKey>,
    /// The same, in the order banned (the oldest is forgotten first).
    banned_order: VecDeque<PeerKey>,
}

impl Bans {
    /// Bans whose accusations stand at least `hold` once made. Evidence moves round by round,
    /// far faster than announcements spread: an accusation made and withdrawn between two of
    /// them reaches some peers and not others, and a peer that counted it for a majority bans
    /// alone, for the rest of the run, out of step with the stage it then splits from. Held
    /// for a few announcements, an accusation reaches every peer before it can go.
    pub fn new(hold: Duration) -> Self {
        Bans {
            hold,
            ..Bans::default()
        }
    }

    /// Whether `peer` is banned.
    pub fn is_banned(&self, peer: PeerKey) -> bool {
        self.banned.contains(&peer)
    }

    /// Whether `peer`, a replica of this peer's stage, did work in its rounds that this peer
    /// judged, with nothing to accuse it of: only such replicas count in the votes of a peer
    /// that serves, so that identities that cost nothing (sybils) cannot outvote it.
    pub fn verified(&self, peer: PeerKey) -> bool {
        !self.is_banned(peer) && self.seen.get(&peer).is_some_and(Record::verified)
    }

    /// Whether `peer`, a replica of this peer's stage, sent shares or parts to its rounds,
    /// good or bad, or delivered them in a round too small to judge: unlike
    /// [`Bans::verified`] every member of a round sees the same, so replicas agree on it (who
    /// leads a round must not depend on when each judged whom).
    pub fn worked(&self, peer: PeerKey) -> bool {
        !self.is_banned(peer) && self.seen.get(&peer).is_some_and(Record::worked)
    }

    /// This peer's accusations, for its announcements.
    pub fn accusations(&self) -> Vec<Accusation> {
        self.accusing
            .iter()
            .map(|(&peer, &(why, _))| Accusation { peer, why })
            .collect()
    }

    /// This peer leaves its stage: what it saw of that stage's members says nothing of the
    /// stage it goes to (a peer that moved with it would otherwise count there as a replica
    /// it worked with, the only one, and be the only leader it follows). Bans and standing
    /// accusations stay.
    pub fn left_stage(&mut self) {
        self.seen.clear();
    }

    /// Takes in what a round showed of the members of this peer's stage. Returns the members
    /// whose accusation changed (to check for a ban).
    pub fn observe(&mut self, evidence: &[Evidence], now: Duration) -> Vec<PeerKey> {
        let mut changed = Vec::new();
        for e in evidence {
            let peer = e.peer();
            let r = self.seen.entry(peer).or_default();
            match *e {
                Evidence::Share { support, .. } => {
                    if !(support.ratio.is_finite() && support.deviation.is_finite()) {
                        continue;
                    }
                    remember(&mut r.shares, support, WINDOW);
                }
                Evidence::Part { agreement, .. } => {
                    if !agreement.is_finite() {
                        continue;
                    }
                    remember(&mut r.parts, agreement, PART_WINDOW);
                }
                Evidence::Delivered { delivered, .. } => {
                    remember(&mut r.delivered, delivered, DELIVERY_WINDOW);
                }
                Evidence::Led { included, .. } => remember(&mut r.led, included, LED_WINDOW),
                Evidence::LeftOut { .. } => r.left_out = true,
            }
            if self.is_banned(peer) {
                continue;
            }
            let verdict = self.seen.get(&peer).and_then(Record::verdict);
            let before = self.accusing.get(&peer).copied();
            match verdict {
                Some(why) if before.map(|(w, _)| w) != Some(why) => {
                    if self.accusing.len() >= MAX_ACCUSATIONS && before.is_none() {
                        self.make_room();
                    }
                    if self.accusing.len() < MAX_ACCUSATIONS || before.is_some() {
                        let since = before.map_or(now, |(_, since)| since);
                        self.accusing.insert(peer, (why, since));
                        changed.push(peer);
                    }
                }
                None if before.is_some_and(|(_, since)| now >= since + self.hold) => {
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
    /// (`me`, serving `my_stage`) see it; returns the ban when it is new. A peer that serves
    /// counts only the replicas that sent it work (its stage-mates by their shares and parts,
    /// good or bad, the replicas of another stage by the microbatches they answered it:
    /// `served`). Where no replica sent it work it does not judge: an announced replica costs nothing, and a
    /// swarm of identities that only announce themselves would otherwise decide. A peer that
    /// serves nothing yet (choosing or downloading a stage) has checked nobody and counts the
    /// announced replicas, so that it takes up the bans of the stage it joins.
    pub fn judge(
        &mut self,
        accused: PeerKey,
        members: &Membership,
        me: PeerKey,
        my_stage: Option<u32>,
        served: impl Fn(PeerKey) -> bool,
    ) -> Option<Ban> {
        if self.is_banned(accused) || accused == me {
            return None;
        }
        let stage = members.get(accused)?.announcement.stage?;
        let mut replicas = members.replicas(stage);
        // Serving, it counts the replicas that sent it work, good or bad: every replica of the
        // stage sees the same, so replicas ban together (a ban in the middle of a round drops
        // the banned owner's part, and replicas that ban at different rounds diverge).
        if my_stage.is_some() {
            replicas.retain(|&r| r != accused && (self.worked(r) || served(r)));
            if replicas.is_empty() {
                return None;
            }
        }
        if my_stage == Some(stage) {
            replicas.push(me);
        }
        if !replicas.contains(&accused) {
            replicas.push(accused);
        }
        let mut votes: BTreeMap<Misconduct, usize> = BTreeMap::new();
        for &r in &replicas {
            let why = if r == me {
                self.accusing.get(&accused).map(|&(why, _)| why)
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
        // Keep accusing it, so that peers that have not yet banned it still can (the
        // accusation of a banned peer is never withdrawn, so when it was made does not matter).
        self.accusing
            .entry(accused)
            .or_insert((why, Duration::ZERO));
        Some(Ban {
            peer: accused,
            why,
            accusers,
            replicas: replicas.len(),
        })
    }
}

/// Appends `x` to a window of the last `n` values.
fn remember<T>(window: &mut VecDeque<T>, x: T, n: usize) {
    window.push_back(x);
    if window.len() > n {
        window.pop_front();
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
            cosine: ratio.clamp(-1.0, 1.0),
            norm: ratio.abs(),
        }
    }

    fn share(peer: PeerKey, support: Support) -> Evidence {
        Evidence::Share { peer, support }
    }

    fn part(peer: PeerKey, agreement: f64) -> Evidence {
        Evidence::Part { peer, agreement }
    }

    fn stage_of(n: u64) -> Membership {
        let mut m = Membership::default();
        for k in 1..=n {
            m.update(PeerKey(k), announcement(Some(0)), Duration::ZERO);
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
        m.update(PeerKey(accuser), a, Duration::ZERO);
    }

    /// What a peer saw of its stage's members does not follow it to another stage: a peer
    /// that worked with it there is no replica it worked with in the new one.
    #[test]
    fn a_peer_that_leaves_its_stage_forgets_the_work_it_saw_there() {
        let mut b = Bans::new(Duration::ZERO);
        b.observe(&[share(PeerKey(2), s(1.0))], Duration::ZERO);
        assert!(b.worked(PeerKey(2)) && b.verified(PeerKey(2)));
        b.left_stage();
        assert!(!b.worked(PeerKey(2)) && !b.verified(PeerKey(2)));
    }

    #[test]
    fn a_member_is_accused_only_after_a_window_of_opposing_shares_and_cleared_when_it_recovers() {
        let mut b = Bans::default();
        let bad = PeerKey(9);
        for round in 0..WINDOW {
            let changed = b.observe(
                &[share(bad, s(-1.0)), share(PeerKey(2), s(1.0))],
                Duration::ZERO,
            );
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
            c.observe(&[share(bad, s(r))], Duration::ZERO);
        }
        assert!(c.accusations().is_empty());
        // Nor are two opposed rounds (see `Record::verdict`); three of the window's five are.
        let mut two = Bans::default();
        for r in [1.0, 1.0, 0.8, -0.8, -0.8] {
            two.observe(&[share(bad, s(r))], Duration::ZERO);
        }
        assert!(two.accusations().is_empty());
        two.observe(&[share(bad, s(-0.8))], Duration::ZERO);
        assert_eq!(two.accusations()[0].why, Misconduct::OpposedTheStage);
        // Low ratios within the members' own spread (no common signal) are no evidence.
        let mut d = Bans::default();
        for _ in 0..2 * WINDOW {
            d.observe(
                &[share(
                    bad,
                    Support {
                        ratio: -3.0,
                        deviation: -1.0,
                        cosine: -0.5,
                        norm: 1.0,
                    },
                )],
                Duration::ZERO,
            );
        }
        assert!(d.accusations().is_empty());
        // Short shares in the stage's direction (a DiLoCo replica slower than the others, a
        // fifth of their inner steps) are no evidence either.
        let mut slow = Bans::default();
        for _ in 0..2 * WINDOW {
            let short = Support {
                cosine: 0.6,
                ..s(0.2)
            };
            slow.observe(&[share(bad, short)], Duration::ZERO);
        }
        assert!(slow.accusations().is_empty());
        // Shares unrelated to the stage's (a last stage training on wrong targets: little
        // along the result, far below the others, at a small angle from it) are accused.
        let mut unrelated = Bans::default();
        for round in 0..WINDOW {
            let wrong_targets = Support {
                ratio: 0.1,
                deviation: -6.0,
                cosine: 0.2,
                norm: 1.0,
            };
            let changed = unrelated.observe(&[share(bad, wrong_targets)], Duration::ZERO);
            assert_eq!(changed.is_empty(), round + 1 < WINDOW, "round {round}");
        }
        assert_eq!(unrelated.accusations()[0].why, Misconduct::OpposedTheStage);
        // Recovering withdraws the accusation.
        for _ in 0..WINDOW {
            b.observe(&[share(bad, s(1.0))], Duration::ZERO);
        }
        assert!(b.accusations().is_empty());
        // ...but not before the accusation has stood its time (so that it reached every peer).
        let second = Duration::from_secs(1);
        let mut h = Bans::new(2 * second);
        for _ in 0..WINDOW {
            h.observe(&[share(bad, s(-1.0))], second);
        }
        for _ in 0..WINDOW {
            h.observe(&[share(bad, s(1.0))], 2 * second);
        }
        assert_eq!(h.accusations().len(), 1, "held");
        assert_eq!(h.observe(&[share(bad, s(1.0))], 3 * second), vec![bad]);
        assert!(
            h.accusations().is_empty(),
            "withdrawn once held long enough"
        );
        // Scaled shares are accused too.
        for _ in 0..WINDOW {
            b.observe(&[share(bad, s(10.0))], Duration::ZERO);
        }
        assert_eq!(b.accusations()[0].why, Misconduct::DwarfedTheStage);
        // So are shares that are mostly noise: an honest-looking component along the result,
        // but several times the others' length.
        let mut noisy = Bans::default();
        for _ in 0..WINDOW {
            let noise = Support {
                norm: 20.0,
                cosine: 0.05,
                ..s(1.0)
            };
            noisy.observe(&[share(bad, noise)], Duration::ZERO);
        }
        assert_eq!(noisy.accusations()[0].why, Misconduct::DwarfedTheStage);
        // And shares scaled up under a claim scaled up alike, which the length corrected by
        // the claim takes for short: their component along the result shows them.
        let mut claimed = Bans::default();
        for _ in 0..WINDOW {
            let scaled = Support {
                norm: 0.1,
                ..s(10.0)
            };
            claimed.observe(&[share(bad, scaled)], Duration::ZERO);
        }
        assert_eq!(claimed.accusations()[0].why, Misconduct::DwarfedTheStage);
    }

    #[test]
    fn a_member_whose_averaged_parts_disagree_with_the_shares_is_accused() {
        let bad = PeerKey(9);
        for (agreement, accused) in [(-1.0, true), (0.0, true), (0.05, true), (10.0, true)]
            .into_iter()
            .chain([(1.0, false), (0.2, false), (2.5, false)])
        {
            let mut b = Bans::default();
            for round in 0..PART_WINDOW {
                let changed = b.observe(&[part(bad, agreement)], Duration::ZERO);
                assert_eq!(
                    !changed.is_empty(),
                    accused && round + 1 == PART_WINDOW,
                    "agreement {agreement}, round {round}"
                );
            }
            assert_eq!(
                b.accusations().first().map(|a| a.why),
                accused.then_some(Misconduct::CorruptedParts),
                "agreement {agreement}"
            );
        }
        // Scattered agreements, as at a low signal-to-noise ratio, are no evidence.
        let mut b = Bans::default();
        for a in [1.6, 0.2, 0.9, -0.2, 1.4, 0.15, 1.1, 0.05, 1.0] {
            b.observe(&[part(bad, a)], Duration::ZERO);
        }
        assert!(b.accusations().is_empty());
    }

    #[test]
    fn a_member_that_withholds_its_work_is_accused() {
        let bad = PeerKey(9);
        let delivered = |delivered| Evidence::Delivered {
            peer: bad,
            delivered,
        };
        let led = |included| Evidence::Led {
            peer: bad,
            included,
        };
        let mut b = Bans::default();
        for d in [false, true, false, false] {
            b.observe(&[delivered(d)], Duration::ZERO);
        }
        assert!(
            b.accusations().is_empty(),
            "a delivery in the window clears it"
        );
        b.observe(&[delivered(false)], Duration::ZERO);
        assert_eq!(b.accusations()[0].why, Misconduct::WithheldWork);
        b.observe(&[delivered(true)], Duration::ZERO);
        assert!(b.accusations().is_empty(), "withdrawn once it delivers");
        // A leader that left this replica out of the last rounds it led.
        let mut b = Bans::default();
        for i in [false, true, false] {
            b.observe(&[led(i)], Duration::ZERO);
        }
        assert!(b.accusations().is_empty());
        b.observe(&[led(false)], Duration::ZERO);
        assert_eq!(b.accusations()[0].why, Misconduct::WithheldWork);
        // One that told it so, at once and whatever it does after.
        let mut b = Bans::default();
        b.observe(&[Evidence::LeftOut { peer: bad }], Duration::ZERO);
        for i in [true, true, true] {
            b.observe(&[led(i), delivered(true)], Duration::ZERO);
        }
        assert_eq!(b.accusations()[0].why, Misconduct::LeftReplicasOut);
    }

    /// Rounds in which replicas 2..=5 gave honest shares and 6 opposing ones, as replica 1
    /// saw them.
    fn judged_stage_of_six() -> Bans {
        let mut b = Bans::default();
        for _ in 0..WINDOW {
            let mut round: Vec<Evidence> = (2..=5).map(|k| share(PeerKey(k), s(1.0))).collect();
            round.push(share(PeerKey(6), s(-1.0)));
            b.observe(&round, Duration::ZERO);
        }
        b
    }

    const NOT_SERVED: fn(PeerKey) -> bool = |_| false;

    #[test]
    fn a_ban_needs_more_than_half_of_the_stage() {
        // Six replicas (1..=6), this peer is 1; 6 is accused.
        let mut m = stage_of(6);
        let me = PeerKey(1);
        m.remove(me);
        let mut b = judged_stage_of_six();
        let judge = |b: &mut Bans, m: &Membership| b.judge(PeerKey(6), m, me, Some(0), NOT_SERVED);
        accuse(&mut m, 2, 6);
        assert_eq!(judge(&mut b, &m), None, "2 of 6");
        accuse(&mut m, 3, 6);
        assert_eq!(judge(&mut b, &m), None, "3 of 6 is not more than half");
        accuse(&mut m, 4, 6);
        let ban = judge(&mut b, &m).expect("4 of 6");
        assert_eq!((ban.accusers, ban.replicas), (4, 6));
        assert!(b.is_banned(PeerKey(6)));
        assert_eq!(judge(&mut b, &m), None, "banned once");
    }

    #[test]
    fn identities_whose_work_nobody_checked_neither_frame_nor_shield() {
        let me = PeerKey(1);
        let mut m = stage_of(6);
        m.remove(me);
        // Twenty identities announce themselves as replicas of the stage; they never sent a
        // share. They accuse honest replica 2, and none of them accuses 6.
        for k in 100..120 {
            m.update(PeerKey(k), announcement(Some(0)), Duration::ZERO);
            accuse(&mut m, k, 2);
        }
        let mut b = judged_stage_of_six();
        assert!(b.verified(PeerKey(2)) && !b.verified(PeerKey(6)) && !b.verified(PeerKey(100)));
        assert_eq!(b.judge(PeerKey(2), &m, me, Some(0), NOT_SERVED), None);
        // They do not count against a ban either: 4 of the 6 replicas whose work was seen.
        for k in 2..=4 {
            accuse(&mut m, k, 6);
        }
        let ban = b
            .judge(PeerKey(6), &m, me, Some(0), NOT_SERVED)
            .expect("4 of 6");
        assert_eq!((ban.accusers, ban.replicas), (4, 6));
        // A peer of another stage counts the replicas that answered its microbatches; one
        // that checked none of the stage does not judge it.
        let mut other = Bans::default();
        let served = |k: PeerKey| (2..=5).contains(&k.0);
        assert_eq!(
            other.judge(PeerKey(2), &m, PeerKey(50), Some(1), served),
            None
        );
        assert_eq!(
            other.judge(PeerKey(3), &m, PeerKey(50), Some(1), NOT_SERVED),
            None
        );
        accuse(&mut m, 5, 3);
        accuse(&mut m, 4, 3);
        accuse(&mut m, 2, 3);
        assert!(
            other
                .judge(PeerKey(3), &m, PeerKey(50), Some(1), NOT_SERVED)
                .is_none()
        );
        assert!(
            other
                .judge(PeerKey(3), &m, PeerKey(50), Some(1), served)
                .is_some()
        );
    }

    #[test]
    fn colluding_minorities_and_other_stages_cannot_frame_a_replica() {
        let mut m = stage_of(6);
        // Three peers of another stage accuse replica 1 as well.
        for k in 10..13 {
            m.update(PeerKey(k), announcement(Some(1)), Duration::ZERO);
            accuse(&mut m, k, 1);
        }
        // Two colluding replicas of its stage.
        accuse(&mut m, 5, 1);
        accuse(&mut m, 6, 1);
        let mut b = Bans::default();
        assert_eq!(b.judge(PeerKey(1), &m, PeerKey(99), None, NOT_SERVED), None);
        // A peer that serves no stage is judged by nobody's stage.
        m.update(PeerKey(20), announcement(None), Duration::ZERO);
        for k in 2..7 {
            accuse(&mut m, k, 20);
        }
        assert_eq!(
            b.judge(PeerKey(20), &m, PeerKey(99), None, NOT_SERVED),
            None
        );
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
            let shares: Vec<Share> = sums.iter().map(|v| Share::new(v, 1.0)).collect();
            let robust = centered_clip(&shares, 200);
            let scores: Vec<Evidence> = (0..6)
                .filter_map(|k| Some(share(PeerKey(k), robust.support[k as usize]?)))
                .collect();
            b.observe(&scores, Duration::ZERO);
            assert!(b.accusations().is_empty(), "{scores:?}");
        }
    }

    #[test]
    fn accusations_are_bounded() {
        let mut b = Bans::default();
        for _ in 0..WINDOW {
            let all: Vec<Evidence> = (0..100).map(|k| share(PeerKey(k), s(-1.0))).collect();
            b.observe(&all, Duration::ZERO);
        }
        assert_eq!(b.accusations().len(), MAX_ACCUSATIONS);
    }
}
