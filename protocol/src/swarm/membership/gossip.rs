//! How often a peer tells each other peer what it is doing, so that what a peer receives per
//! second does not grow with the swarm.
//!
//! A swarm of up to [`SMALL_SWARM`] known peers gossips every announcement to everyone every
//! announce period. Past that, announcements go two ways:
//! * to the peers *near* it (replicas of its stage and of the stages next to it: those it
//!   averages with, routes microbatches to and takes them from), directly, at most
//!   [`NEAR_PER_PERIOD`] of them each period, taken in turn;
//! * to everyone by gossip, once every `ceil(known / FAR_PER_PERIOD)` periods: what the far
//!   stages need of it (placement, rebalancing, the run's progress) changes slowly.
//!
//! Only serving peers are near each other, so a peer told directly is one that expects to
//! be. A peer hears from about `NEAR_PER_PERIOD + FAR_PER_PERIOD` peers a period however
//! large the swarm, and gives a member up after the member timeout times the periods between
//! that member's announcements to it (counted from its own view of the swarm, which differs
//! little from the member's). Announcements that something changed (serving, a move,
//! finishing) still go to everyone at once: they are rare.

use super::{Member, Membership};
use crate::swarm::PeerKey;
use std::time::Duration;

/// Known peers up to which every announcement goes to everyone every period.
pub const SMALL_SWARM: usize = 64;

/// Near peers sent this peer's announcement each period, at most.
pub const NEAR_PER_PERIOD: usize = 64;

/// Announcements a peer receives by gossip each period, about, in a large swarm.
pub const FAR_PER_PERIOD: usize = 32;

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
}

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

/// Periods between two announcements to each of `count` peers, `per_period` a period.
fn spread(count: usize, per_period: usize) -> u32 {
    count.div_ceil(per_period).max(1) as u32
}

impl Gossip {
    /// Where this period's announcement of a peer serving `stage` goes.
    pub fn plan(&mut self, stage: Option<u32>, members: &Membership) -> Plan {
        if members.len() <= SMALL_SWARM {
            self.until_broadcast = 0;
            return Plan {
                broadcast: true,
                direct: Vec::new(),
            };
        }
        let broadcast = self.until_broadcast == 0;
        self.until_broadcast = match broadcast {
            true => spread(members.len(), FAR_PER_PERIOD) - 1,
            false => self.until_broadcast - 1,
        };
        let near: Vec<PeerKey> = near_stages(stage)
            .flat_map(|s| members.serving_in(s))
            .collect();
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

    /// How long a member may stay silent before it counts as gone, to a peer serving `stage`
    /// (None: not serving) that gives a small swarm's members `timeout`: the member's
    /// announcements to it may be that many periods apart.
    pub fn timeout(stage: Option<u32>, members: &Membership, timeout: Duration) -> Timeouts {
        if members.len() <= SMALL_SWARM {
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

    /// A small swarm is as it always was: everyone, every period.
    #[test]
    fn a_small_swarm_gossips_everything_every_period() {
        let members = swarm(8, 4);
        let mut g = Gossip::default();
        for _ in 0..3 {
            let p = g.plan(Some(1), &members);
            assert!(p.broadcast && p.direct.is_empty());
        }
        let m = members.iter().next().unwrap().1;
        let t = Duration::from_secs(4);
        assert_eq!(Gossip::timeout(Some(1), &members, t).of(m), t);
    }

    /// 1,000 peers in 8 stages: near peers (375) are each told every 6 periods, in turn,
    /// everyone by gossip every 32; a peer receives about 96 announcements a period, not
    /// 999, and waits as many periods longer before giving a member up.
    #[test]
    fn a_large_swarm_gossips_far_seldom_and_near_in_turn() {
        let members = swarm(125, 8);
        let mut g = Gossip::default();
        let mut told = std::collections::BTreeMap::new();
        let mut broadcasts = 0;
        for _ in 0..64 {
            let p = g.plan(Some(3), &members);
            assert!(p.direct.len() <= NEAR_PER_PERIOD);
            broadcasts += u32::from(p.broadcast);
            for k in p.direct {
                *told.entry(k).or_insert(0) += 1;
            }
        }
        assert_eq!(broadcasts, 2, "once every 32 periods");
        assert_eq!(told.len(), 375, "stages 2, 3 and 4");
        assert!(told.keys().all(|k| (20_000..50_000).contains(&k.0)));
        assert!(told.values().all(|n| (10..=11).contains(n)), "{told:?}");
        let t = Gossip::timeout(Some(3), &members, Duration::from_secs(4));
        let of = |key| t.of(members.get(PeerKey(key)).unwrap());
        assert_eq!(of(20_001), Duration::from_secs(24));
        assert_eq!(of(70_001), Duration::from_secs(128));
    }
}
