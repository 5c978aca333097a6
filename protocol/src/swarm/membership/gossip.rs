//! How often a peer tells each other peer what it is doing, so that what a peer sends and
//! receives per second does not grow with the swarm.
//!
//! Gossip (gossipsub) is not cheap per message: every peer forwards every message it first
//! receives to each of its mesh neighbours but one, and advertises its id to a few more, so a
//! peer's uplink carries several copies of every announcement of the swarm. Announcements
//! therefore go two ways:
//! * directly to the peers that need them often, each period, at most [`NEAR_PER_PERIOD`] of
//!   them, taken in turn: in a swarm of up to [`SMALL_SWARM`] known peers, everyone; past
//!   that, the peers *near* it (replicas of its stage and of the stages next to it: those it
//!   averages with, routes microbatches to and takes them from);
//! * to everyone by gossip, once every `ceil(max(known, SMALL_SWARM) / FAR_PER_PERIOD)`
//!   periods: how peers that do not know it yet learn of it, and what the far stages need of it (placement,
//!   rebalancing, the run's progress), which changes slowly.
//!
//! A peer sends and hears about `NEAR_PER_PERIOD` direct announcements a period and the swarm
//! gossips about `FAR_PER_PERIOD` a period, however large it is. Only serving peers are near
//! each other in a large swarm, so a peer told directly is one that expects to be. A member is
//! given up after the member timeout times the periods between its announcements to this peer
//! (counted from this peer's view of the swarm, which differs little from the member's).
//! Announcements that something changed (serving, a move, finishing) still go to everyone at
//! once by gossip: they are rare.

use super::{Member, Membership};
use crate::swarm::PeerKey;
use crate::swarm::message::{Announcement, MemberState};
use std::time::Duration;

/// Known peers up to which every announcement goes to everyone directly every period.
pub const SMALL_SWARM: usize = 64;

/// Near peers sent this peer's announcement each period, at most.
pub const NEAR_PER_PERIOD: usize = 64;

/// Announcements the whole swarm gossips each period, about.
pub const FAR_PER_PERIOD: usize = 8;

/// Connections a peer needs besides those of its stage's neighbourhood: its gossip mesh
/// (gossipsub's `mesh_n_high`: 12), and the network's own (bootstrap peers, relays, DHT
/// queries, a joiner downloading from it).
pub const PEERS_BESIDES_STAGES: usize = 32;

/// How many peers one serving `stage` (None: not serving yet) may need to be connected to at
/// once: every replica of its stage and of the stages next to it (those it averages with,
/// routes microbatches to and takes them from, and announces to directly), and
/// [`PEERS_BESIDES_STAGES`]. A peer not serving yet may take any stage: it counts the
/// largest such neighbourhood. The node sizes its connection and stream caps by it, so that
/// they grow with the run rather than drop a stage's work at a fixed number.
pub fn peers_needed(stage: Option<u32>, members: &Membership) -> usize {
    let around = |s: u32| -> usize { near_stages(Some(s)).map(|n| members.serving_count(n)).sum() };
    let near = match stage {
        Some(s) => around(s),
        None => members.serving_stages().map(around).max().unwrap_or(0),
    };
    near + PEERS_BESIDES_STAGES
}

/// Where this peer's next announcement goes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Gossip it to everyone.
    pub broadcast: bool,
    /// Send it directly to these.
    pub direct: Vec<PeerKey>,
}

/// A peer's announcement schedule.
#[derive(Clone, Debug, Default)]
pub struct Gossip {
    /// Where the next turn of near peers starts.
    cursor: usize,
    /// Periods until the next gossip to everyone.
    until_broadcast: u32,
    /// Choosing peers told directly this period (see [`Gossip::tell_newcomer`]).
    newcomers_told: usize,
}

/// Peers still choosing their stage that a peer of a large swarm tells directly of itself
/// each period, at most.
pub const NEWCOMERS_TOLD_PER_PERIOD: usize = 8;

/// Whether a peer serving `theirs` is near one serving `mine`. Only serving peers are near
/// each other, both ways alike: a peer that is told directly expects to be.
fn near(mine: Option<u32>, theirs: Option<u32>) -> bool {
    matches!((mine, theirs), (Some(a), Some(b)) if a.abs_diff(b) <= 1)
}

/// The stages near one serving `stage`.
fn near_stages(stage: Option<u32>) -> impl Iterator<Item = u32> {
    stage
        .into_iter()
        .flat_map(|s| s.saturating_sub(1)..=s.saturating_add(1))
}

/// The peers told directly what a peer serving `stage` does: in a small swarm everyone, in a
/// large one the serving peers near it.
pub fn near_peers(stage: Option<u32>, members: &Membership) -> Vec<PeerKey> {
    match members.len() <= SMALL_SWARM {
        true => members.iter().map(|(k, _)| *k).collect(),
        false => near_stages(stage)
            .flat_map(|s| members.serving_in(s))
            .collect(),
    }
}

/// Periods between two announcements to each of `count` peers, `per_period` a period.
fn spread(count: usize, per_period: usize) -> u32 {
    count.div_ceil(per_period).max(1) as u32
}

impl Gossip {
    /// Where this period's announcement of a peer serving `stage` goes.
    pub fn plan(&mut self, stage: Option<u32>, members: &Membership) -> Plan {
        self.newcomers_told = 0;
        // A peer of a small swarm that does not serve yet gossips every period: it chooses
        // its stage by what it hears within a few periods, and is told directly only by
        // those that heard of it.
        let small_and_new = members.len() <= SMALL_SWARM && stage.is_none();
        let broadcast = self.until_broadcast == 0 || small_and_new;
        self.until_broadcast = match broadcast {
            // A small swarm, told directly, gossips as often as one of SMALL_SWARM peers: to
            // be found by newcomers, which others then tell directly.
            true => spread(members.len().max(SMALL_SWARM), FAR_PER_PERIOD) - 1,
            false => self.until_broadcast - 1,
        };
        let near = near_peers(stage, members);
        let take = near.len().min(NEAR_PER_PERIOD);
        let start = self.cursor % near.len().max(1);
        let direct = near
            .iter()
            .cycle()
            .skip(start)
            .take(take)
            .copied()
            .collect();
        self.cursor = start + take;
        Plan { broadcast, direct }
    }

    /// Whether to tell a peer this one just heard of for the first time, whose announcement
    /// is `theirs`, of itself directly now rather than at its next turn: in a small swarm,
    /// always (everyone is told every period anyway, and a newcomer chooses its stage by what
    /// it hears in its first periods); in a large one, a peer still choosing its stage, up to
    /// [`NEWCOMERS_TOLD_PER_PERIOD`] a period (it would otherwise hear of far stages only at
    /// the swarm's gossip rate).
    pub fn tell_newcomer(&mut self, members: &Membership, theirs: &Announcement) -> bool {
        if members.len() <= SMALL_SWARM {
            return true;
        }
        let choosing = theirs.state == MemberState::Choosing;
        if choosing && self.newcomers_told < NEWCOMERS_TOLD_PER_PERIOD {
            self.newcomers_told += 1;
            return true;
        }
        false
    }

    /// How long a member may stay silent before it counts as gone, to a peer serving `stage`
    /// (None: not serving) that gives a small swarm's members `timeout`: the member's
    /// announcements to it may be that many periods apart.
    pub fn timeout(stage: Option<u32>, members: &Membership, timeout: Duration) -> Timeouts {
        if members.len() <= SMALL_SWARM {
            // Everyone is told directly every period (one that did not know this peer yet
            // does from the first announcement it gets from it).
            return Timeouts {
                stage,
                near: timeout,
                far: timeout,
            };
        }
        let near: usize = near_stages(stage).map(|s| members.serving_count(s)).sum();
        Timeouts {
            stage,
            // A near member may hear of this one only by gossip, if its view of who is near
            // differs: the far timeout would do for both, but would leave a gone replica
            // waited for by the rounds for minutes.
            near: timeout * spread(near, NEAR_PER_PERIOD),
            far: timeout * spread(members.len(), FAR_PER_PERIOD),
        }
    }
}

/// How long members may stay silent (see [`Gossip::timeout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    stage: Option<u32>,
    near: Duration,
    far: Duration,
}

impl Timeouts {
    /// For `member`.
    pub fn of(&self, member: &Member) -> Duration {
        match near(self.stage, super::serving_stage(&member.announcement)) {
            true => self.near,
            false => self.far,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::swarm::fixtures::announcement;

    fn swarm(per_stage: usize, stages: u32) -> Membership {
        let mut m = Membership::default();
        for s in 0..stages {
            for i in 0..per_stage {
                let key = PeerKey(u64::from(s) * 10_000 + i as u64 + 1);
                m.update(key, announcement(Some(s)), Duration::ZERO);
            }
        }
        m
    }

    /// The connections a peer needs follow its stage's neighbourhood, not the swarm: 1,000
    /// peers in 8 stages of 125 need 375 (a middle stage) or 250 (an end), plus the mesh's
    /// and the network's; a peer not serving yet counts the largest neighbourhood.
    #[test]
    fn the_peers_needed_are_the_stage_and_its_neighbours() {
        let members = swarm(125, 8);
        assert_eq!(peers_needed(Some(3), &members), 375 + PEERS_BESIDES_STAGES);
        assert_eq!(peers_needed(Some(0), &members), 250 + PEERS_BESIDES_STAGES);
        assert_eq!(peers_needed(Some(7), &members), 250 + PEERS_BESIDES_STAGES);
        assert_eq!(peers_needed(None, &members), 375 + PEERS_BESIDES_STAGES);
        let empty = Membership::default();
        assert_eq!(peers_needed(None, &empty), PEERS_BESIDES_STAGES);
    }

    /// A small swarm tells everyone directly every period, and gossips once every
    /// `ceil(SMALL_SWARM / FAR_PER_PERIOD)` periods (8).
    #[test]
    fn a_small_swarm_tells_everyone_directly_every_period() {
        let members = swarm(8, 4);
        let mut g = Gossip::default();
        let mut broadcasts = 0;
        for _ in 0..16 {
            let p = g.plan(Some(1), &members);
            assert_eq!(p.direct.len(), 32);
            broadcasts += u32::from(p.broadcast);
        }
        assert_eq!(broadcasts, 2);
        let m = members.iter().next().unwrap().1;
        let t = Duration::from_secs(4);
        assert_eq!(Gossip::timeout(Some(1), &members, t).of(m), t);
    }

    /// A peer that does not serve yet gossips every period in a small swarm; peers that hear
    /// of a newcomer tell it directly of themselves: always in a small swarm, in a large one
    /// only while it chooses its stage, and at most `NEWCOMERS_TOLD_PER_PERIOD` a period.
    #[test]
    fn newcomers_hear_of_the_swarm_at_once() {
        let small = swarm(8, 4);
        let mut g = Gossip::default();
        assert!((0..4).all(|_| g.plan(None, &small).broadcast));
        let serving = announcement(Some(1));
        assert!(g.tell_newcomer(&small, &serving));
        let large = swarm(125, 8);
        let mut choosing = announcement(None);
        choosing.state = MemberState::Choosing;
        g.plan(Some(3), &large);
        assert!(!g.tell_newcomer(&large, &serving));
        let told = (0..20)
            .filter(|_| g.tell_newcomer(&large, &choosing))
            .count();
        assert_eq!(told, NEWCOMERS_TOLD_PER_PERIOD);
        g.plan(Some(3), &large);
        assert!(g.tell_newcomer(&large, &choosing), "a new period");
    }

    /// 1,000 peers in 8 stages: near peers (375) are each told every 6 periods, in turn,
    /// everyone by gossip every 125; a peer receives about 72 announcements a period, not
    /// 999, and waits as many periods longer before giving a member up.
    #[test]
    fn a_large_swarm_gossips_far_seldom_and_near_in_turn() {
        let members = swarm(125, 8);
        let mut g = Gossip::default();
        let mut told = std::collections::BTreeMap::new();
        let mut broadcasts = 0;
        for _ in 0..250 {
            let p = g.plan(Some(3), &members);
            assert!(p.direct.len() <= NEAR_PER_PERIOD);
            broadcasts += u32::from(p.broadcast);
            for k in p.direct {
                *told.entry(k).or_insert(0) += 1;
            }
        }
        assert_eq!(broadcasts, 2, "once every 125 periods");
        assert_eq!(told.len(), 375, "stages 2, 3 and 4");
        assert!(told.keys().all(|k| (20_000..50_000).contains(&k.0)));
        assert!(told.values().all(|n| (42..=43).contains(n)), "{told:?}");
        let t = Gossip::timeout(Some(3), &members, Duration::from_secs(4));
        let of = |key| t.of(members.get(PeerKey(key)).unwrap());
        assert_eq!(of(20_001), Duration::from_secs(24));
        assert_eq!(of(70_001), Duration::from_secs(500));
    }
}
