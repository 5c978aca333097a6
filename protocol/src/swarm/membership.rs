//! Who serves which stage, how fast and with which parameters, as learned from announcements;
//! and where to send a microbatch. Which stage a joiner takes and whether some peer should
//! move to another are in [`super::placement`].

use super::message::{Announcement, MemberState};
use super::{PeerKey, SeededRng};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

mod gossip;
mod routing;
pub use gossip::{
    FAR_PER_PERIOD, Gossip, NEAR_PER_PERIOD, PEERS_BESIDES_STAGES, Plan, SMALL_SWARM, Timeouts,
    near_peers, peers_needed,
};
pub use routing::{Dealer, Routing, STRAGGLER_FACTOR, UNMEASURED_LATE, route_weights};

/// What is known of one other peer.
#[derive(Clone, Debug, PartialEq)]
pub struct Member {
    /// Its latest announcement.
    pub announcement: Announcement,
    /// When it was last heard from.
    pub last_seen: Duration,
    /// The peer whose gossip introduced it, while it has given no evidence of its own (a
    /// message on a connection of its own); None once it has.
    pub relayed_by: Option<PeerKey>,
    /// Whether this peer checked work it did lately (see [`Membership::set_checked`]).
    pub checked: bool,
    /// Whether it sent this peer work at all, good or bad (see [`Membership::set_checked`]).
    pub worked: bool,
    /// Rounds of this peer's stage that finished without it while it served the stage and
    /// had sent no work (see [`Membership::workers`]).
    left_out: u8,
    /// The parameter hashes it announced for its latest rounds (this incarnation's), oldest
    /// first: a replica announces every round, and a state that took a while to arrive is
    /// checked against what the stage announced for the state's round, which its replicas
    /// have left behind by then.
    hashes: VecDeque<(u64, u64)>,
}

/// Rounds a replica that has sent no work may be left out of before it is no longer waited
/// for (see [`Membership::workers`]). The first may be one it started serving in the middle
/// of.
pub const NEWCOMER_ROUNDS: u8 = 3;

/// Rounds of announced parameter hashes kept per member (a few seconds of rounds on a fast
/// stage; 16 bytes each).
const HASHES_KEPT: usize = 32;

impl Member {
    fn new(announcement: Announcement, now: Duration, relayed_by: Option<PeerKey>) -> Self {
        let hashes = announcement
            .params_hash
            .map(|h| (announcement.round, h))
            .into_iter()
            .collect();
        Member {
            announcement,
            last_seen: now,
            relayed_by,
            checked: false,
            worked: false,
            left_out: 0,
            hashes,
        }
    }

    /// Takes the hash of its announcement `a` (newer than the one held) into its record.
    fn remember_hash(&mut self, a: &Announcement) {
        // A restart (a new incarnation, or an older round after a newer one) starts the
        // record afresh: what it said before is about parameters it no longer holds.
        if a.incarnation != self.announcement.incarnation
            || self.hashes.back().is_some_and(|(r, _)| *r > a.round)
        {
            self.hashes.clear();
        }
        let Some(hash) = a.params_hash else { return };
        match self.hashes.back_mut() {
            // Its parameters at one round are one claim: a later announcement of the same
            // round (after a re-sync) replaces it.
            Some(last) if last.0 == a.round => last.1 = hash,
            _ => {
                if self.hashes.len() == HASHES_KEPT {
                    self.hashes.pop_front();
                }
                self.hashes.push_back((a.round, hash));
            }
        }
    }

    /// The parameter hash it announced for `round`, if it is among those kept.
    pub fn hash_at(&self, round: u64) -> Option<u64> {
        self.hashes
            .iter()
            .rev()
            .find(|(r, _)| *r == round)
            .map(|(_, h)| *h)
    }

    /// Whether it serves `stage` now.
    pub fn serves(&self, stage: u32) -> bool {
        self.announcement.state == MemberState::Serving && self.announcement.stage == Some(stage)
    }
}

/// What this peer's view says of a sender's claim to be a replica of a stage. The view lags
/// (announcements travel by gossip, other messages directly, and either may come first), so
/// only a sender known to serve no stage at all is taken to break a rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// It serves the stage.
    Replica,
    /// Unknown yet, or announced a stage (this one while syncing, or another it may have just
    /// left): its message is dropped, no rule is known to be broken.
    Unsure,
    /// It announced that it serves no stage.
    NotAReplica,
}

/// The other peers of the run (never this peer itself).
#[derive(Clone, Debug, Default)]
pub struct Membership {
    members: BTreeMap<PeerKey, Member>,
    /// The members serving each stage: what most questions are about (a round's replicas,
    /// whether every stage has one), answered without a pass over a thousand members.
    serving: BTreeMap<u32, BTreeSet<PeerKey>>,
}

/// The stage `a` says its peer serves, if it serves one.
fn serving_stage(a: &Announcement) -> Option<u32> {
    a.stage.filter(|_| a.state == MemberState::Serving)
}

/// At most this many peers are tracked; announcements from more are ignored (bounds memory
/// whatever the network sends).
pub const MAX_MEMBERS: usize = 4096;

/// Peers one relay may introduce that have not yet shown up on a connection of their own.
/// Keys cost nothing to make; with this cap one relay fills at most an eighth of the table, and
/// a peer that contacts this one directly finds room while introduced ones remain (it takes
/// the place of the one heard from least recently).
pub const MAX_RELAYED_PER_PEER: usize = MAX_MEMBERS / 8;

impl Membership {
    /// Records an announcement the peer sent itself (on its own connection). Returns whether
    /// the peer is new.
    pub fn update(&mut self, peer: PeerKey, announcement: Announcement, now: Duration) -> bool {
        self.record(peer, announcement, now, None)
    }

    /// Records an announcement that `via` relayed (gossip). Returns whether the peer is new.
    pub fn update_relayed(
        &mut self,
        peer: PeerKey,
        announcement: Announcement,
        now: Duration,
        via: PeerKey,
    ) -> bool {
        self.record(peer, announcement, now, (via != peer).then_some(via))
    }

    fn record(
        &mut self,
        peer: PeerKey,
        announcement: Announcement,
        now: Duration,
        relay: Option<PeerKey>,
    ) -> bool {
        if announcement.state == MemberState::Leaving {
            self.drop_member(peer);
            return false;
        }
        if let Some(m) = self.members.get_mut(&peer) {
            let known = &m.announcement;
            if known.incarnation == announcement.incarnation && announcement.seq <= known.seq {
                // Overtaken by a newer announcement on the way.
                m.last_seen = m.last_seen.max(now);
                return false;
            }
        }
        if let Some(m) = self.members.get_mut(&peer) {
            m.remember_hash(&announcement);
            // A replica new to its stage is new again: it had no chance to work there.
            if announcement.stage != m.announcement.stage
                || announcement.incarnation != m.announcement.incarnation
            {
                m.left_out = 0;
            }
            let (was, is) = (serving_stage(&m.announcement), serving_stage(&announcement));
            m.announcement = announcement;
            m.last_seen = now;
            if relay.is_none() {
                m.relayed_by = None;
            }
            if was != is {
                self.unindex(peer, was);
                self.index(peer, is);
            }
            return false;
        }
        if !self.room_for(relay) {
            return false;
        }
        self.index(peer, serving_stage(&announcement));
        self.members
            .insert(peer, Member::new(announcement, now, relay));
        true
    }

    fn index(&mut self, peer: PeerKey, stage: Option<u32>) {
        if let Some(s) = stage {
            self.serving.entry(s).or_default().insert(peer);
        }
    }

    fn unindex(&mut self, peer: PeerKey, stage: Option<u32>) {
        if let Some(set) = stage.and_then(|s| self.serving.get_mut(&s)) {
            set.remove(&peer);
        }
    }

    /// Removes `peer` and its place in the index; returns whether it was a member.
    fn drop_member(&mut self, peer: PeerKey) -> bool {
        let Some(m) = self.members.remove(&peer) else {
            return false;
        };
        self.unindex(peer, serving_stage(&m.announcement));
        true
    }

    /// Whether a new peer introduced by `relay` (None: by itself) can be added, making room if
    /// it must and may.
    fn room_for(&mut self, relay: Option<PeerKey>) -> bool {
        if let Some(r) = relay {
            let introduced = self
                .members
                .values()
                .filter(|m| m.relayed_by == Some(r))
                .count();
            return introduced < MAX_RELAYED_PER_PEER && self.members.len() < MAX_MEMBERS;
        }
        if self.members.len() < MAX_MEMBERS {
            return true;
        }
        // Full: the introduced peer heard from least recently gives way.
        let victim = self
            .members
            .iter()
            .filter(|(_, m)| m.relayed_by.is_some())
            .min_by_key(|(k, m)| (m.last_seen, **k))
            .map(|(k, _)| *k);
        victim.is_some_and(|k| self.drop_member(k))
    }

    /// Notes that `peer` sent a message on its own connection (evidence that it exists, not
    /// only that some peer says so).
    pub fn touch(&mut self, peer: PeerKey, now: Duration) {
        if let Some(m) = self.members.get_mut(&peer) {
            m.last_seen = now;
            m.relayed_by = None;
        }
    }

    /// Forgets a peer (it left, its connection died or a send to it failed).
    pub fn remove(&mut self, peer: PeerKey) -> bool {
        self.drop_member(peer)
    }

    /// Records whether this peer checked work `peer` did lately: a share or part of its stage
    /// that gave nothing to accuse it of, or a microbatch it answered. An identity costs
    /// nothing to make, so counts that decide something (votes, leaders, who drives how much)
    /// go by the checked members where there are any (see [`Membership::vouched`]). Whether
    /// it `worked` at all, good or bad, is what every replica of a stage sees alike: who leads
    /// and who is waited for go by that (see [`Membership::workers`]).
    pub fn set_checked(&mut self, peer: PeerKey, checked: bool, worked: bool) {
        if let Some(m) = self.members.get_mut(&peer) {
            m.checked = checked;
            m.worked = worked || checked;
        }
    }

    /// Whether this peer checked work `peer` did lately.
    pub fn is_checked(&self, peer: PeerKey) -> bool {
        self.members.get(&peer).is_some_and(|m| m.checked)
    }

    /// Forgets every check that `still` does not confirm (checked, worked).
    pub fn recheck(&mut self, still: impl Fn(PeerKey) -> (bool, bool)) {
        for (k, m) in self.members.iter_mut() {
            let (checked, worked) = still(*k);
            m.checked = m.checked && checked;
            m.worked = m.worked && worked;
        }
    }

    /// The replicas of `stage` that sent this peer work, good or bad: those that may lead its
    /// rounds (where none did, see `StepCoordinator::round_members`). An identity that only
    /// announces itself never leads.
    pub fn leaders(&self, stage: u32) -> Vec<PeerKey> {
        self.replicas(stage)
            .into_iter()
            .filter(|k| self.members.get(k).is_some_and(|m| m.worked))
            .collect()
    }

    /// The replicas of `stage` that do not announce themselves new to it: those that may lead
    /// where none has worked with this peer yet.
    pub fn settled(&self, stage: u32) -> Vec<PeerKey> {
        self.replicas(stage)
            .into_iter()
            .filter(|k| {
                self.members
                    .get(k)
                    .is_some_and(|m| !m.announcement.newcomer)
            })
            .collect()
    }

    /// Whether some replica of `stage` sent this peer work.
    pub fn any_worked(&self, stage: u32) -> bool {
        self.members.values().any(|m| m.worked && m.serves(stage))
    }

    /// The replicas of `stage` this peer's rounds invite and wait for: those that may lead
    /// ([`Membership::leaders`]) and those new to it, left out of fewer than
    /// [`NEWCOMER_ROUNDS`] of its rounds. A joiner must be waited for from the start: the
    /// replicas already there start their round as soon as every replica they wait for has
    /// joined, before a joiner's join could arrive, and the joiners, left out, would make a
    /// group of their own that averages apart for good. An identity that only announces
    /// itself costs a few rounds a join window each, once.
    pub fn workers(&self, stage: u32) -> Vec<PeerKey> {
        self.replicas_where(stage, |m| m.worked || m.left_out < NEWCOMER_ROUNDS)
    }

    /// The replicas of `stage` that `keep` keeps, or all of them where it keeps none.
    fn replicas_where(&self, stage: u32, keep: impl Fn(&Member) -> bool) -> Vec<PeerKey> {
        let replicas = self.replicas(stage);
        let kept: Vec<PeerKey> = replicas
            .iter()
            .copied()
            .filter(|k| self.members.get(k).is_some_and(&keep))
            .collect();
        if kept.is_empty() { replicas } else { kept }
    }

    /// A round of `stage` finished here with `group`: the replicas of the stage left out of
    /// it that never sent work come closer to no longer counting as [`Membership::workers`].
    pub fn round_finished(&mut self, stage: u32, group: &[PeerKey]) {
        for (k, m) in self.members.iter_mut() {
            if m.serves(stage) && !m.worked && !group.contains(k) {
                m.left_out = m.left_out.saturating_add(1);
            }
        }
    }

    /// The replicas of `stage` that count for what this peer decides (see
    /// [`Membership::vouched`]).
    pub fn vouched_replicas(&self, stage: u32) -> Vec<PeerKey> {
        let vouched = self.vouched(stage);
        self.replicas(stage)
            .into_iter()
            .filter(|k| vouched(*k))
            .collect()
    }

    /// Whether `peer` counts among the replicas of `stage` for what this peer decides: it
    /// was checked, or no replica of the stage was (a peer new to the stage has seen no work
    /// yet and can only go by announcements).
    pub fn vouched(&self, stage: u32) -> impl Fn(PeerKey) -> bool + '_ {
        let any = self.members.values().any(|m| m.checked && m.serves(stage));
        move |k| !any || self.is_checked(k)
    }

    /// Forgets peers silent for longer than `timeout` says for each; returns them.
    pub fn expire(&mut self, now: Duration, timeout: impl Fn(&Member) -> Duration) -> Vec<PeerKey> {
        let gone: Vec<PeerKey> = self
            .members
            .iter()
            .filter(|(_, m)| now.saturating_sub(m.last_seen) > timeout(m))
            .map(|(k, _)| *k)
            .collect();
        for k in &gone {
            self.drop_member(*k);
        }
        gone
    }

    /// What `peer`'s last announcement says of its claim to serve `stage`.
    pub fn standing(&self, peer: PeerKey, stage: u32) -> Standing {
        match self.members.get(&peer) {
            Some(m) if m.serves(stage) => Standing::Replica,
            Some(m) if m.announcement.stage.is_none() => Standing::NotAReplica,
            _ => Standing::Unsure,
        }
    }

    /// One peer.
    pub fn get(&self, peer: PeerKey) -> Option<&Member> {
        self.members.get(&peer)
    }

    /// All known peers.
    pub fn iter(&self) -> impl Iterator<Item = (&PeerKey, &Member)> {
        self.members.iter()
    }

    /// Number of known peers.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether no other peer is known.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The peers serving `stage`, in key order.
    pub fn replicas(&self, stage: u32) -> Vec<PeerKey> {
        self.serving_in(stage).collect()
    }

    /// The members serving `stage`, in key order.
    pub fn serving_in(&self, stage: u32) -> impl Iterator<Item = PeerKey> + '_ {
        self.serving.get(&stage).into_iter().flatten().copied()
    }

    /// How many members serve `stage`.
    pub fn serving_count(&self, stage: u32) -> usize {
        self.serving.get(&stage).map_or(0, BTreeSet::len)
    }

    /// The stages some known member serves.
    pub fn serving_stages(&self) -> impl Iterator<Item = u32> + '_ {
        self.serving.keys().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::swarm::service::Observed;

    fn announcement(stage: u32, throughput: f32, queue: u32) -> Announcement {
        Announcement {
            throughput,
            queue,
            ..crate::swarm::fixtures::serving(stage)
        }
    }

    /// Regression: 4,096 announcements signed by fresh keys filled the table and locked real
    /// joiners out. A relay introduces at most its share of unconfirmed keys, and a peer heard
    /// on its own connection takes the place of one of them.
    #[test]
    fn fresh_keys_relayed_by_a_few_peers_cannot_lock_a_joiner_out() {
        let mut m = Membership::default();
        let now = Duration::ZERO;
        let mut fresh = 1_000_000;
        for relay in 1..=20 {
            for _ in 0..MAX_MEMBERS {
                fresh += 1;
                m.update_relayed(PeerKey(fresh), announcement(0, 1.0, 0), now, PeerKey(relay));
            }
        }
        let by_relay = |r: u64| {
            m.iter()
                .filter(|(_, x)| x.relayed_by == Some(PeerKey(r)))
                .count()
        };
        assert_eq!(by_relay(1), MAX_RELAYED_PER_PEER);
        assert_eq!(m.len(), MAX_MEMBERS, "eight relays fill the table");
        // The table is full, but a joiner that announces itself directly gets in.
        assert!(m.update(
            PeerKey(7),
            announcement(1, 1.0, 0),
            now + Duration::from_secs(1)
        ));
        assert_eq!(m.len(), MAX_MEMBERS);
        assert!(m.get(PeerKey(7)).is_some_and(|x| x.relayed_by.is_none()));
        // A relayed key that then sends a message of its own is confirmed.
        let introduced = m
            .iter()
            .find(|(_, x)| x.relayed_by.is_some())
            .map(|(k, _)| *k)
            .unwrap();
        m.touch(introduced, now);
        assert!(m.get(introduced).unwrap().relayed_by.is_none());
        // A peer's own announcement relayed by itself is direct evidence.
        let mut own = Membership::default();
        own.update_relayed(PeerKey(3), announcement(0, 1.0, 0), now, PeerKey(3));
        assert!(own.get(PeerKey(3)).unwrap().relayed_by.is_none());
    }

    #[test]
    fn routing_weights_follow_throughput() {
        let mut m = Membership::default();
        let now = Duration::ZERO;
        m.update(PeerKey(1), announcement(1, 30.0, 0), now);
        m.update(PeerKey(2), announcement(1, 10.0, 0), now);
        m.update(PeerKey(3), announcement(2, 99.0, 0), now);
        let mut dealer = Dealer::new(7);
        let mut counts = [0u32; 3];
        for _ in 0..20_000 {
            let k = m
                .route(1, None, Routing::Weighted, &mut dealer, |_| {
                    Observed::UNTIMED
                })
                .unwrap();
            counts[k.0 as usize - 1] += 1;
        }
        assert_eq!(counts[2], 0, "never routes to another stage");
        let share = counts[0] as f64 / 20_000.0;
        assert!(
            (share - 0.75).abs() < 0.02,
            "fast peer gets 3/4, got {share}"
        );
        // A queue of 2 on the fast peer makes them equal.
        m.update(PeerKey(1), announcement(1, 30.0, 2), now);
        let w = route_weights(
            [
                (&announcement(1, 30.0, 2), Observed::UNTIMED),
                (&announcement(1, 10.0, 0), Observed::UNTIMED),
            ]
            .into_iter(),
        );
        assert!((w[0] - w[1]).abs() < 1e-9);
        // A straggler (here 5x slower than an idle peer) gets nothing until the others queue.
        let w = route_weights(
            [
                (&announcement(1, 50.0, 0), Observed::UNTIMED),
                (&announcement(1, 10.0, 0), Observed::UNTIMED),
            ]
            .into_iter(),
        );
        assert_eq!(w, [50.0, 0.0]);
        let w = route_weights(
            [
                (&announcement(1, 50.0, 1), Observed::UNTIMED),
                (&announcement(1, 10.0, 0), Observed::UNTIMED),
            ]
            .into_iter(),
        );
        assert_eq!(w, [25.0, 10.0]);
        // Announcing 100x its speed buys a replica nothing once its answers come late: the
        // factor from the sender's timing scales the claim down.
        let liar = announcement(1, 1000.0, 0);
        let honest = announcement(1, 10.0, 0);
        let timed = |factor| Observed {
            factor,
            timed: true,
            probing: false,
        };
        let w = route_weights([(&liar, timed(1.0 / 128.0)), (&honest, timed(1.0))].into_iter());
        assert!(w[0] < w[1], "{w:?}");
        let w = route_weights([(&liar, timed(1.0)), (&honest, timed(1.0))].into_iter());
        assert_eq!(
            w[1], 0.0,
            "the claim alone makes the honest one a straggler"
        );
        // With only the liar timed there is nothing to judge it by yet: the honest one, not
        // timed, gets its share of the work so that it can be.
        let w = route_weights([(&liar, timed(1.0)), (&honest, Observed::UNTIMED)].into_iter());
        assert!(w[1] > 0.0 && w[1] < w[0], "{w:?}");
        // A low factor never makes a straggler: the replica keeps some work to be timed by.
        let w = route_weights([(&honest, timed(1.0 / 64.0)), (&honest, timed(1.0))].into_iter());
        assert!(w[0] > 0.0 && w[0] < w[1], "{w:?}");
        // One not measured yet and persistently late is a straggler.
        let new = announcement(1, 0.0, 0);
        let late = Observed {
            factor: 1.0 / 64.0,
            timed: false,
            probing: false,
        };
        let w = route_weights([(&new, late), (&honest, timed(1.0))].into_iter());
        assert_eq!(w[0], 0.0, "{w:?}");
        // But when every replica is unmeasured and late (after a partition), the work still
        // goes somewhere, the less late getting more: sending nowhere would stall the run.
        let later = Observed {
            factor: 1.0 / 128.0,
            ..late
        };
        let w = route_weights([(&new, late), (&new, later)].into_iter());
        assert!(w[0] > w[1] && w[1] > 0.0, "{w:?}");
        // One that never answered gets one microbatch at a time until it does, while another
        // can take the work; before anyone is timed, all there is are claims.
        let probing = Observed {
            probing: true,
            ..Observed::UNTIMED
        };
        let w = route_weights([(&honest, probing), (&honest, timed(1.0))].into_iter());
        assert_eq!(w, [0.0, 10.0]);
        let w = route_weights([(&honest, probing), (&honest, Observed::UNTIMED)].into_iter());
        assert_eq!(w, [10.0, 10.0]);
        let w = route_weights(
            [(&honest, probing), (&honest, timed(1.0))]
                .into_iter()
                .take(1),
        );
        assert_eq!(w, [10.0]);
        let w = route_weights([(&new, timed(0.5)), (&honest, timed(1.0))].into_iter());
        assert!(w[0] > 0.0, "{w:?}");
        // Retries avoid the previous replica when another exists.
        for _ in 0..100 {
            assert_eq!(
                m.route(1, Some(PeerKey(1)), Routing::Weighted, &mut dealer, |_| {
                    Observed::UNTIMED
                }),
                Some(PeerKey(2))
            );
        }
        // A gone peer gets nothing.
        m.remove(PeerKey(2));
        assert_eq!(
            m.route(1, Some(PeerKey(1)), Routing::Weighted, &mut dealer, |_| {
                Observed::UNTIMED
            }),
            Some(PeerKey(1))
        );
        m.remove(PeerKey(1));
        assert_eq!(
            m.route(1, None, Routing::Weighted, &mut dealer, |_| {
                Observed::UNTIMED
            }),
            None
        );
    }

    #[test]
    fn microbatches_are_dealt_as_evenly_as_the_weights_allow() {
        let mut m = Membership::default();
        for (k, throughput) in [(1, 30.0), (2, 10.0), (3, 20.0)] {
            m.update(PeerKey(k), announcement(1, throughput, 0), Duration::ZERO);
        }
        for seed in 0..20 {
            let mut dealer = Dealer::new(seed);
            let mut counts = [0i64; 3];
            for n in 1..=600i64 {
                let k = m
                    .route(1, None, Routing::Weighted, &mut dealer, |_| {
                        Observed::UNTIMED
                    })
                    .unwrap();
                counts[k.0 as usize - 1] += 1;
                // Never more than one microbatch (plus the random start) from its proportion,
                // at any point: random picks drift by the square root of the count.
                for (i, share) in [3, 1, 2].into_iter().enumerate() {
                    let expected = n * share / 6;
                    assert!(
                        (counts[i] - expected).abs() <= 2,
                        "seed {seed}, after {n}: {counts:?}"
                    );
                }
            }
        }
        // Senders start at different points of the cycle.
        let firsts: BTreeSet<PeerKey> = (0..20)
            .map(|seed| {
                m.route(1, None, Routing::Weighted, &mut Dealer::new(seed), |_| {
                    Observed::UNTIMED
                })
                .unwrap()
            })
            .collect();
        assert!(firsts.len() > 1, "{firsts:?}");
    }

    #[test]
    fn uniform_routing_ignores_throughput() {
        let mut m = Membership::default();
        m.update(PeerKey(1), announcement(1, 30.0, 0), Duration::ZERO);
        m.update(PeerKey(2), announcement(1, 10.0, 0), Duration::ZERO);
        let mut dealer = Dealer::new(7);
        let fast = (0..20_000)
            .filter(|_| {
                m.route(1, None, Routing::Uniform, &mut dealer, |_| {
                    Observed::UNTIMED
                }) == Some(PeerKey(1))
            })
            .count();
        let share = fast as f64 / 20_000.0;
        assert!((share - 0.5).abs() < 0.02, "uniform: {share}");
    }

    #[test]
    fn an_overtaken_announcement_does_not_undo_a_newer_one() {
        let mut m = Membership::default();
        let now = Duration::ZERO;
        let mut serving = announcement(1, 5.0, 0);
        serving.seq = 2;
        let mut syncing = announcement(1, 0.0, 0);
        syncing.state = MemberState::Syncing;
        syncing.seq = 1;
        m.update(PeerKey(1), serving.clone(), now);
        m.update(PeerKey(1), syncing.clone(), now);
        assert_eq!(m.replicas(1), vec![PeerKey(1)]);
        // The same peer restarted: a new incarnation starts its count again.
        syncing.incarnation = 2;
        m.update(PeerKey(1), syncing, now);
        assert_eq!(m.replicas(1), Vec::<PeerKey>::new());
    }

    /// Replicas that worked lead and are waited for; an identity that only announces itself
    /// does too until it has been left out of [`NEWCOMER_ROUNDS`] rounds, so that a joiner
    /// counts alike for the replicas already there and for the other joiners.
    #[test]
    fn a_new_replica_counts_among_the_workers_until_it_has_had_its_chance() {
        let mut m = Membership::default();
        let now = Duration::ZERO;
        for k in 1..=3 {
            m.update(PeerKey(k), announcement(0, 1.0, 0), now);
        }
        // None worked yet: all count.
        assert_eq!(m.workers(0), vec![PeerKey(1), PeerKey(2), PeerKey(3)]);
        m.set_checked(PeerKey(1), true, true);
        m.set_checked(PeerKey(2), false, true);
        // A joiner: new, it counts though it never worked.
        m.update(PeerKey(4), announcement(0, 1.0, 0), now);
        let all = vec![PeerKey(1), PeerKey(2), PeerKey(3), PeerKey(4)];
        assert_eq!(m.workers(0), all);
        // 4 is in the next round; 3 is left out of its third and no longer counts.
        m.round_finished(0, &[PeerKey(1), PeerKey(2)]);
        m.round_finished(0, &[PeerKey(1), PeerKey(2), PeerKey(4)]);
        m.set_checked(PeerKey(4), false, true);
        assert_eq!(m.workers(0), all);
        m.round_finished(0, &[PeerKey(1), PeerKey(2), PeerKey(4)]);
        assert_eq!(m.workers(0), vec![PeerKey(1), PeerKey(2), PeerKey(4)]);
        // A move to another stage makes it new again; rounds of another stage say nothing
        // of it.
        m.update(PeerKey(5), announcement(1, 1.0, 0), now);
        m.set_checked(PeerKey(5), false, true);
        let mut moved = announcement(1, 1.0, 0);
        moved.seq = 2;
        m.update(PeerKey(3), moved, now);
        assert_eq!(m.workers(1), vec![PeerKey(3), PeerKey(5)]);
        m.round_finished(0, &[PeerKey(1)]);
        m.round_finished(1, &[PeerKey(5)]);
        m.round_finished(1, &[PeerKey(5)]);
        assert_eq!(m.workers(1), vec![PeerKey(3), PeerKey(5)]);
        m.round_finished(1, &[PeerKey(5)]);
        assert_eq!(m.workers(1), vec![PeerKey(5)]);
    }

    /// A replica that announces itself new to its stage is no candidate leader for a peer
    /// that has worked with nobody yet (it would not lead: see `Rounds::newcomer`).
    #[test]
    fn a_replica_that_announces_itself_new_is_not_settled() {
        let mut m = Membership::default();
        let now = Duration::ZERO;
        m.update(PeerKey(1), announcement(0, 1.0, 0), now);
        let mut new = announcement(0, 1.0, 0);
        new.newcomer = true;
        m.update(PeerKey(2), new, now);
        assert_eq!(m.replicas(0), vec![PeerKey(1), PeerKey(2)]);
        assert_eq!(m.settled(0), vec![PeerKey(1)]);
    }

    #[test]
    fn silent_peers_expire() {
        let mut m = Membership::default();
        m.update(PeerKey(1), announcement(0, 1.0, 0), Duration::from_secs(1));
        m.update(PeerKey(2), announcement(0, 1.0, 0), Duration::from_secs(5));
        let gone = m.expire(Duration::from_secs(7), |_| Duration::from_secs(3));
        assert_eq!(gone, vec![PeerKey(1)]);
        assert_eq!(m.replicas(0), vec![PeerKey(2)]);
    }
}
