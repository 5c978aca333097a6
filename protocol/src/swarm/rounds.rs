//! Which averaging round a replica is in: starting one, joining one that another replica
//! started, and keeping invitations that arrive before this replica is ready.
//!
//! One [`Round`] runs the exchange itself; this part decides who leads (the first of the
//! replicas that may lead, as a member knows them, in the round's rank order,
//! [`RoundKey::rank`]; a newcomer to the stage follows rather than leads, see
//! [`Rounds::newcomer`]), answers the messages of the round that just finished
//! (a slower member may still ask for parts), and joins the round another replica started
//! before this one noticed the step was complete.

use super::PeerKey;
use super::averaging::{Round, RoundOut};
use super::config::Timing;
use super::membership::Membership;
use super::message::{Message, RoundKey, RoundMsg};
use super::outbox::Outbox;
use crate::Codec;
use std::time::Duration;

/// Invitations to a next round kept while the current one finishes, at most.
pub(super) const MAX_EARLY_JOINS: usize = 256;

/// The averaging rounds of one replica.
#[derive(Debug)]
pub(super) struct Rounds {
    me: PeerKey,
    codec: Codec,
    timing: Timing,
    current: Option<Round>,
    /// The round finished last, to answer members still exchanging.
    last: Option<Round>,
    /// Joins of the next round that came before this replica was ready for it.
    early_joins: Vec<(RoundKey, PeerKey)>,
    /// The leader of the round this replica follows was seen serving the stage.
    leader_seen: bool,
    /// Leaders whose start this replica waited for in vain, by round: passed over when the
    /// round is tried again (they may still take part as members). Every follower of a
    /// leader that withholds its start times out alike, so they pass over the same one.
    passed_over: Vec<PassedOver>,
    /// Scripted misbehaviour (see [`super::attack`]): rounds started from now on negate the
    /// part this replica owns, and leave the others out when it leads.
    pub forge_parts: bool,
    pub exclude_others: bool,
    /// Banned peers: members no round waits for.
    banned: std::collections::BTreeSet<PeerKey>,
    /// This replica is new to its stage (it started from a state the others trained and has
    /// not finished a round with them yet): it does not lead, but joins the round of the leader
    /// the replicas already there follow. Were it to lead, it and the other joiners, whom
    /// those replicas do not follow, would average apart for good.
    pub newcomer: bool,
}

/// A leader a follower gave up on in one round ([`Rounds::fail`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PassedOver {
    key: RoundKey,
    leader: PeerKey,
    /// It started the round without this replica (rather than never starting it): what it
    /// averaged (its own share, or its accomplices') is not caught up from.
    excluded: bool,
}

impl Rounds {
    /// No round yet; rounds encode with `codec`.
    pub fn new(me: PeerKey, codec: Codec, timing: Timing) -> Self {
        Rounds {
            me,
            codec,
            timing,
            current: None,
            last: None,
            early_joins: Vec::new(),
            leader_seen: false,
            passed_over: Vec::new(),
            forge_parts: false,
            exclude_others: false,
            banned: std::collections::BTreeSet::new(),
            newcomer: false,
        }
    }

    /// Whether a round is under way (or its result not yet applied).
    pub fn active(&self) -> bool {
        self.current.is_some()
    }

    /// Whether this replica's contribution to the current round is taken: new samples count
    /// toward the next round.
    pub fn contributed(&self) -> bool {
        self.current.as_ref().is_some_and(Round::contributed)
    }

    /// When the current round needs [`Rounds::handle_timeout`].
    pub fn deadline(&self) -> Option<Duration> {
        self.current.as_ref().and_then(Round::deadline)
    }

    /// The first of `peers` in `key`'s rank order that was not passed over in that round.
    fn leader(&self, key: RoundKey, peers: impl IntoIterator<Item = PeerKey>) -> Option<PeerKey> {
        key.leader(peers.into_iter().filter(|p| !self.passed_over_in(key, *p)))
    }

    /// Whether `a` may lead `key` before `b` would.
    fn precedes(&self, key: RoundKey, a: PeerKey, b: PeerKey) -> bool {
        !self.passed_over_in(key, a) && key.rank(a) < key.rank(b)
    }

    /// Whether this replica follows `from`'s invitation to round `key`: one that ranks
    /// before it; a newcomer, any of the `leaders` it may follow (it cannot tell which of
    /// them the others follow).
    fn may_follow(&self, key: RoundKey, from: PeerKey, leaders: &[PeerKey]) -> bool {
        match self.newcomer {
            true => leaders.contains(&from) && !self.passed_over_in(key, from),
            false => self.precedes(key, from, self.me),
        }
    }

    /// This replica, where it may lead.
    fn me_as_leader(&self) -> Option<PeerKey> {
        (!self.newcomer).then_some(self.me)
    }

    /// Starts round `key`, led by the first in rank order of `leaders` and this replica (a
    /// newcomer only where none of them may), waiting for `others`. A leader takes in the
    /// joins that came early.
    pub fn begin(
        &mut self,
        key: RoundKey,
        leaders: &[PeerKey],
        others: &[PeerKey],
        len: usize,
        now: Duration,
    ) {
        let leader = self
            .leader(key, leaders.iter().copied().chain(self.me_as_leader()))
            .unwrap_or(self.me);
        let mut round = if leader == self.me {
            let mut r = Round::lead(key, self.me, others, len, self.codec, self.timing, now);
            for (k, from) in std::mem::take(&mut self.early_joins) {
                if k == key {
                    r.handle(from, RoundMsg::Join, now);
                }
            }
            r
        } else {
            Round::follow(key, self.me, leader, len, self.codec, self.timing, now)
        };
        round.forge_part = self.forge_parts;
        round.exclude_others = self.exclude_others;
        round.gone.clone_from(&self.banned);
        self.current = Some(round);
        self.leader_seen = false;
    }

    fn follow(&mut self, key: RoundKey, leader: PeerKey, len: usize, now: Duration) {
        self.leader_seen = false;
        let mut round = Round::follow(key, self.me, leader, len, self.codec, self.timing, now);
        round.forge_part = self.forge_parts;
        round.gone.clone_from(&self.banned);
        self.current = Some(round);
    }

    /// Early joins: a replica that finished round `round - 1` sooner may already have invited
    /// this one to round `round`. Follows the invitation of one it may follow (see
    /// [`Rounds::may_follow`]), if one came; returns whether it did. Invitations to rounds
    /// already past are forgotten.
    pub fn follow_early_invitation(
        &mut self,
        key: RoundKey,
        leaders: &[PeerKey],
        len: usize,
        now: Duration,
    ) -> bool {
        self.early_joins.retain(|(k, _)| k.index >= key.index);
        let invite = self
            .early_joins
            .iter()
            .find(|(k, from)| *k == key && self.may_follow(key, *from, leaders))
            .copied();
        let Some((key, from)) = invite else {
            return false;
        };
        self.early_joins
            .retain(|(k, f)| !(k.index == key.index && *f == from));
        self.follow(key, from, len, now);
        true
    }

    /// A round message from another replica of this stage, which has completed `round`
    /// rounds and knows `replicas`: those that may lead, and those its rounds wait for. Messages of the current or the last round go to it; a
    /// join of the next round is kept for later; a message of this replica's next round that
    /// another replica started first makes it join that round: following the sender if it
    /// is the leader (a join from one that ranks before it, a start), leading if this one
    /// ranks first, following the first in rank order it knows otherwise (a part that arrives
    /// before the start). A replica that is finished takes part in no new round.
    #[allow(clippy::too_many_arguments)]
    pub fn on_message(
        &mut self,
        out: &mut Outbox,
        from: PeerKey,
        key: RoundKey,
        msg: RoundMsg,
        round: u64,
        finished: bool,
        replicas: (Vec<PeerKey>, Vec<PeerKey>),
        len: usize,
        now: Duration,
    ) {
        let (leaders, replicas) = replicas;
        // A leader passed over that starts late is not blamed: it may only have been slow.
        if matches!(msg, RoundMsg::Start { .. }) && self.passed_over_in(key, from) {
            return;
        }
        for r in [self.current.as_mut(), self.last.as_mut()]
            .into_iter()
            .flatten()
        {
            if r.key() == key {
                r.handle(from, msg, now);
                return;
            }
        }
        let active = self.current.is_some();
        if msg == RoundMsg::Join
            && key.index > round.saturating_sub(1)
            && (active || key.index != round)
            && key.index <= round + 1
            && self.early_joins.len() < MAX_EARLY_JOINS
        {
            self.early_joins.push((key, from));
            return;
        }
        if active || key.index != round || finished {
            return;
        }
        match msg {
            RoundMsg::Join => {
                let mut others = replicas;
                if !others.contains(&from) {
                    others.push(from);
                }
                let leader = self.leader(key, leaders.iter().copied().chain(self.me_as_leader()));
                if leader == Some(self.me) {
                    self.begin(key, &leaders, &others, len, now);
                    if let Some(r) = self.current.as_mut() {
                        r.handle(from, RoundMsg::Join, now);
                    }
                } else if self.may_follow(key, from, &leaders) {
                    self.follow(key, from, len, now);
                }
            }
            RoundMsg::Start { .. } => {
                self.follow(key, from, len, now);
                if let Some(r) = self.current.as_mut() {
                    // The leader already counted this replica out if it did not join: drop
                    // the join.
                    while r.poll().is_some() {}
                    r.handle(from, msg, now);
                }
            }
            RoundMsg::Part { .. } | RoundMsg::Averaged { .. } => {
                let leader = self
                    .leader(key, leaders.iter().copied().chain(self.me_as_leader()))
                    .unwrap_or(from);
                self.follow(key, leader, len, now);
                if let Some(r) = self.current.as_mut() {
                    r.handle(from, msg, now);
                }
            }
            RoundMsg::Request { attempt, part } => out.send(
                from,
                Message::Round {
                    key,
                    msg: RoundMsg::Missing { attempt, part },
                },
            ),
            RoundMsg::Missing { .. } => {}
        }
    }

    /// `peer` announced it has completed `its_round` rounds: the current round, if already
    /// behind it, no longer waits for it (see [`Round::went_on`]).
    pub fn went_on(&mut self, peer: PeerKey, its_round: u64, now: Duration) {
        if let Some(r) = self.current.as_mut()
            && its_round > r.key().index
        {
            r.went_on(peer, now);
        }
    }

    /// Whether `peer` led round `index` of this replica's stage with a group that left this
    /// replica out.
    pub fn excluded_by(&self, index: u64, peer: PeerKey) -> bool {
        self.passed_over
            .iter()
            .any(|p| p.excluded && p.key.index == index && p.leader == peer)
    }

    /// Whether a leader started round `index` with a group that left this replica out.
    pub fn excluded_in(&self, index: u64) -> bool {
        self.passed_over
            .iter()
            .any(|p| p.excluded && p.key.index == index)
    }

    /// Whether this replica passed over `leader` in round `key`.
    fn passed_over_in(&self, key: RoundKey, leader: PeerKey) -> bool {
        self.passed_over
            .iter()
            .any(|p| p.key == key && p.leader == leader)
    }

    /// A round whose start this replica waits for cannot start once its leader no longer
    /// serves the stage (it moved, re-synced or left, or its connection closed): it fails now
    /// rather than at
    /// its deadline, so that the replicas still there can start the round among themselves.
    /// A leader not seen serving yet (its announcement may still be on the way) is waited
    /// for. Returns the failed round's key.
    pub fn leader_gone(&mut self, stage: u32, members: &Membership) -> Option<RoundKey> {
        let r = self.current.as_ref()?;
        let leader = r.awaited_leader()?;
        if members.get(leader).is_some_and(|m| m.serves(stage)) {
            self.leader_seen = true;
            return None;
        }
        if !self.leader_seen {
            return None;
        }
        let key = r.key();
        self.current = None;
        Some(key)
    }

    /// `peer` left, crashed or was banned: the current round stops waiting for its share.
    pub fn member_gone(&mut self, peer: PeerKey, now: Duration) {
        if let Some(r) = self.current.as_mut() {
            r.member_gone(peer, now);
        }
    }

    /// `peer` is banned: no round of this replica waits for it again.
    pub fn banned(&mut self, peer: PeerKey, now: Duration) {
        if self.banned.len() < super::membership::MAX_MEMBERS {
            self.banned.insert(peer);
        }
        self.member_gone(peer, now);
    }

    /// Whether `peer` is a member of round `key` (current or last) as this replica knows it.
    pub fn has_member(&self, key: RoundKey, peer: PeerKey) -> bool {
        [self.current.as_ref(), self.last.as_ref()]
            .into_iter()
            .flatten()
            .any(|r| r.key() == key && r.has_member(peer))
    }

    /// Time passed.
    pub fn handle_timeout(&mut self, now: Duration) {
        if let Some(r) = self.current.as_mut() {
            r.handle_timeout(now);
        }
    }

    /// What the current round wants done next.
    pub fn poll(&mut self) -> Option<(RoundKey, RoundOut)> {
        let r = self.current.as_mut()?;
        let key = r.key();
        r.poll().map(|out| (key, out))
    }

    /// This replica's contribution to the current round.
    pub fn contribute(&mut self, values: &[f32], samples: f64, loss: Option<f64>, now: Duration) {
        if let Some(r) = self.current.as_mut() {
            r.contribute(values, samples, loss, now);
        }
    }

    /// The current round failed for this replica. A leader that never started it is passed
    /// over when it is tried again.
    pub fn fail(&mut self) {
        let Some(r) = self.current.take() else {
            return;
        };
        let key = r.key();
        self.passed_over.retain(|p| p.key.index >= key.index);
        if let Some(leader) = r.withheld_by()
            && self.passed_over.len() < MAX_EARLY_JOINS
        {
            self.passed_over.push(PassedOver {
                key,
                leader,
                excluded: r.excluded_by().is_some(),
            });
        }
    }

    /// The current round's result is applied: it stays to answer slower members.
    pub fn finish(&mut self) {
        if let Some(r) = self.current.take() {
            self.last = Some(r);
        }
    }

    /// Forgets every round (the replica leaves its stage); returns the current one's key.
    pub fn abandon(&mut self) -> Option<RoundKey> {
        self.last = None;
        self.early_joins.clear();
        self.current.take().map(|r| r.key())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::swarm::bans::Evidence;
    use crate::swarm::peer::Action;

    const MS: Duration = Duration::from_millis(1);

    fn key(index: u64) -> RoundKey {
        RoundKey { stage: 1, index }
    }

    fn rounds(me: u64) -> Rounds {
        Rounds::new(
            PeerKey(me),
            Codec::Fp32,
            Timing {
                join_window: 100 * MS,
                ..Timing::default()
            },
        )
    }

    /// `r` hears `msg` about round `index` from peer `from`, having completed `round` rounds.
    #[allow(clippy::too_many_arguments)]
    fn hear(
        r: &mut Rounds,
        out: &mut Outbox,
        from: u64,
        index: u64,
        msg: RoundMsg,
        round: u64,
        finished: bool,
        replicas: Vec<PeerKey>,
    ) {
        r.on_message(
            out,
            PeerKey(from),
            key(index),
            msg,
            round,
            finished,
            (replicas.clone(), replicas),
            8,
            MS,
        );
    }

    /// Messages the current round sends, in order.
    fn sent(r: &mut Rounds) -> Vec<(PeerKey, RoundMsg)> {
        let mut out = Vec::new();
        while let Some((_, o)) = r.poll() {
            if let RoundOut::Send(to, msg) = o {
                out.push((to, msg));
            }
        }
        out
    }

    #[test]
    fn the_first_in_rank_order_leads_and_invites_the_others() {
        // Round 0 of stage 1 ranks peers 1 to 6 as 1, 6, 4, 2, 3, 5; round 1 as 3, 2, 6,
        // 4, 5, 1: who leads changes from round to round, whatever the keys.
        let order = |index: u64| {
            let mut v: Vec<u64> = (1..=6).collect();
            v.sort_by_key(|p| key(index).rank(PeerKey(*p)));
            v
        };
        assert_eq!(order(0), [1, 6, 4, 2, 3, 5]);
        assert_eq!(order(1), [3, 2, 6, 4, 5, 1]);
        let mut r = rounds(4);
        r.begin(
            key(0),
            &[PeerKey(2), PeerKey(3)],
            &[PeerKey(2), PeerKey(3)],
            8,
            Duration::ZERO,
        );
        assert_eq!(
            sent(&mut r),
            [(PeerKey(2), RoundMsg::Join), (PeerKey(3), RoundMsg::Join)]
        );
        let mut r = rounds(3);
        r.begin(
            key(0),
            &[PeerKey(2), PeerKey(4)],
            &[PeerKey(2), PeerKey(4)],
            8,
            Duration::ZERO,
        );
        assert_eq!(sent(&mut r), [(PeerKey(4), RoundMsg::Join)], "follows 4");
        let mut r = rounds(4);
        r.begin(
            key(1),
            &[PeerKey(2), PeerKey(3)],
            &[PeerKey(2), PeerKey(3)],
            8,
            Duration::ZERO,
        );
        assert_eq!(sent(&mut r), [(PeerKey(3), RoundMsg::Join)], "follows 3");
    }

    /// A replica new to its stage does not lead though it ranks first: it joins the leader
    /// the replicas already there follow, and takes part in that leader's round.
    #[test]
    fn a_newcomer_joins_the_round_of_the_leader_the_others_follow() {
        // Round 0 ranks 1 first, then 6, 4 and 2.
        let mut r = rounds(1);
        r.newcomer = true;
        r.begin(
            key(0),
            &[PeerKey(4), PeerKey(2)],
            &[PeerKey(4), PeerKey(2)],
            8,
            Duration::ZERO,
        );
        assert_eq!(sent(&mut r), [(PeerKey(4), RoundMsg::Join)], "follows 4");
        // Invited by the leader before it noticed the step was complete: follows it.
        let mut out = Outbox::new(PeerKey(1));
        let mut r = rounds(1);
        r.newcomer = true;
        hear(
            &mut r,
            &mut out,
            4,
            0,
            RoundMsg::Join,
            0,
            false,
            vec![PeerKey(4), PeerKey(2)],
        );
        assert_eq!(sent(&mut r), [(PeerKey(4), RoundMsg::Join)], "follows 4");
        // Invited early to its next round: it follows a replica it may follow though that
        // one ranks after it, never an identity it may not (it would hold it in a round
        // that never starts).
        let invited_by = |out: &mut Outbox, from: &[u64]| {
            let mut r = rounds(1);
            r.newcomer = true;
            for &k in from {
                let replicas = vec![PeerKey(4), PeerKey(2), PeerKey(9)];
                hear(&mut r, out, k, 1, RoundMsg::Join, 0, false, replicas);
            }
            r
        };
        let leaders = [PeerKey(4), PeerKey(2)];
        let mut r = invited_by(&mut out, &[9, 2]);
        assert!(r.follow_early_invitation(key(1), &leaders, 8, MS));
        assert_eq!(sent(&mut r), [(PeerKey(2), RoundMsg::Join)], "follows 2");
        let mut r = invited_by(&mut out, &[9]);
        assert!(!r.follow_early_invitation(key(1), &leaders, 8, MS));
        // Not new, it leads.
        let mut r = rounds(1);
        r.begin(
            key(0),
            &[PeerKey(4), PeerKey(2)],
            &[PeerKey(4), PeerKey(2)],
            8,
            Duration::ZERO,
        );
        assert_eq!(
            sent(&mut r),
            [(PeerKey(2), RoundMsg::Join), (PeerKey(4), RoundMsg::Join)],
            "leads"
        );
    }

    /// A leader that never starts its round (it withholds, or it is gone without its
    /// connection closing) is passed over when the round is tried again: the stage is not
    /// held by whoever ranks first.
    #[test]
    fn a_leader_that_never_starts_its_round_is_passed_over() {
        let mut out = Outbox::new(PeerKey(3));
        let mut r = rounds(3);
        // Among 1, 3 and 5, peer 1 leads round 0 of stage 1.
        r.begin(
            key(0),
            &[PeerKey(1), PeerKey(5)],
            &[PeerKey(1), PeerKey(5)],
            8,
            Duration::ZERO,
        );
        assert_eq!(sent(&mut r), [(PeerKey(1), RoundMsg::Join)]);
        r.handle_timeout(Duration::from_secs(600));
        // Evidence against the leader, then the failure.
        assert!(matches!(
            r.poll(),
            Some((
                _,
                RoundOut::Evidence(Evidence::Led {
                    peer: PeerKey(1),
                    included: false
                })
            ))
        ));
        assert!(matches!(r.poll(), Some((_, RoundOut::Failed(_)))));
        r.fail();
        // Tried again: 3 ranks first among those left, so it leads (and invites the one passed
        // over, which may have been slow rather than malicious).
        r.begin(
            key(0),
            &[PeerKey(1), PeerKey(5)],
            &[PeerKey(1), PeerKey(5)],
            8,
            Duration::from_secs(601),
        );
        assert_eq!(
            sent(&mut r),
            [(PeerKey(1), RoundMsg::Join), (PeerKey(5), RoundMsg::Join)]
        );
        // A late start from the passed-over leader is not followed by a replica between
        // rounds, and its join makes it a member, not the leader.
        let mut r2 = rounds(5);
        r2.begin(
            key(0),
            &[PeerKey(1), PeerKey(3)],
            &[PeerKey(1), PeerKey(3)],
            8,
            Duration::ZERO,
        );
        sent(&mut r2);
        r2.handle_timeout(Duration::from_secs(600));
        while r2.poll().is_some() {}
        r2.fail();
        let start = RoundMsg::Start {
            group: vec![PeerKey(1), PeerKey(5)],
        };
        hear(
            &mut r2,
            &mut out,
            1,
            0,
            start,
            0,
            false,
            vec![PeerKey(1), PeerKey(3)],
        );
        assert!(!r2.active());
        // The next round ranks anew: nobody is passed over there.
        r2.begin(
            key(1),
            &[PeerKey(1), PeerKey(3)],
            &[PeerKey(1), PeerKey(3)],
            8,
            Duration::from_secs(700),
        );
        assert_eq!(sent(&mut r2), [(PeerKey(3), RoundMsg::Join)]);
    }

    /// Early joins: a join of the next round that arrives while this replica still averages
    /// (or has not finished the step) is kept; the leader counts it in when it starts that
    /// round, and a follower follows the invitation of one that ranks before it.
    #[test]
    fn a_join_that_comes_early_is_kept_for_the_next_round() {
        let mut out = Outbox::new(PeerKey(3));
        let mut r = rounds(3);
        r.begin(key(0), &[PeerKey(5)], &[PeerKey(5)], 8, Duration::ZERO);
        sent(&mut r);
        hear(
            &mut r,
            &mut out,
            5,
            1,
            RoundMsg::Join,
            0,
            false,
            vec![PeerKey(5)],
        );
        r.finish();
        // As leader of round 1 it starts at once: everyone it expects already joined.
        r.begin(key(1), &[PeerKey(5)], &[PeerKey(5)], 8, 2 * MS);
        let start = sent(&mut r);
        assert!(
            start.contains(&(
                PeerKey(5),
                RoundMsg::Start {
                    group: vec![PeerKey(3), PeerKey(5)]
                }
            )),
            "{start:?}"
        );
        // A follower: the invitation to round 1 of one that ranks before it is followed.
        let mut r = rounds(5);
        hear(
            &mut r,
            &mut out,
            3,
            1,
            RoundMsg::Join,
            0,
            false,
            vec![PeerKey(3)],
        );
        assert!(
            !r.follow_early_invitation(key(0), &[PeerKey(3)], 8, MS),
            "not for round 0"
        );
        assert!(r.follow_early_invitation(key(1), &[PeerKey(3)], 8, MS));
        assert_eq!(sent(&mut r), [(PeerKey(3), RoundMsg::Join)]);
        // Invitations to rounds long past are not kept.
        let mut r = rounds(5);
        hear(
            &mut r,
            &mut out,
            3,
            1,
            RoundMsg::Join,
            4,
            false,
            vec![PeerKey(3)],
        );
        assert!(!r.active());
        assert!(!r.follow_early_invitation(key(1), &[PeerKey(3)], 8, MS));
    }

    #[test]
    fn a_round_whose_leader_left_the_stage_fails_at_once() {
        use crate::swarm::fixtures::serving as a;
        let mut m = Membership::default();
        let mut r = rounds(5);
        r.begin(key(0), &[PeerKey(3)], &[PeerKey(3)], 8, Duration::ZERO);
        // The leader is not known yet: wait for it.
        assert_eq!(r.leader_gone(1, &m), None);
        m.update(PeerKey(3), a(1), Duration::ZERO);
        assert_eq!(r.leader_gone(1, &m), None);
        assert!(r.active());
        // It moves to stage 2 before starting the round.
        let mut moved = a(2);
        moved.seq = 2;
        m.update(PeerKey(3), moved, MS);
        assert_eq!(r.leader_gone(1, &m), Some(key(0)));
        assert!(!r.active());
        // A leader that is gone altogether counts the same.
        let mut m = Membership::default();
        m.update(PeerKey(3), a(1), Duration::ZERO);
        r.begin(key(0), &[PeerKey(3)], &[PeerKey(3)], 8, MS);
        assert_eq!(r.leader_gone(1, &m), None);
        m.remove(PeerKey(3));
        assert_eq!(r.leader_gone(1, &m), Some(key(0)));
    }

    /// A leader that starts a round with a group leaving this replica out is remembered for
    /// that round (its result is not caught up from, and its samples are not waited for); a
    /// replica that announces it is past the round is not waited for, and a follower whose
    /// leader went on fails at once.
    #[test]
    fn a_round_run_without_this_replica_is_not_waited_for() {
        let mut out = Outbox::new(PeerKey(5));
        let mut r = rounds(5);
        r.begin(key(0), &[PeerKey(1)], &[PeerKey(1), PeerKey(3)], 8, MS);
        sent(&mut r);
        let alone = RoundMsg::Start {
            group: vec![PeerKey(1)],
        };
        hear(&mut r, &mut out, 1, 0, alone, 0, false, vec![PeerKey(1)]);
        let mut evidence = None;
        while let Some((_, o)) = r.poll() {
            match o {
                RoundOut::Evidence(e) => evidence = Some(e),
                RoundOut::Failed(_) => r.fail(),
                _ => {}
            }
        }
        assert_eq!(
            evidence,
            Some(Evidence::Led {
                peer: PeerKey(1),
                included: false
            })
        );
        assert!(r.excluded_by(0, PeerKey(1)) && r.excluded_in(0));
        assert!(!r.excluded_by(0, PeerKey(3)) && !r.excluded_in(1));
        // Tried again, 5 leads and waits for 1 and 3 until 1 says it is past round 0.
        r.begin(key(0), &[], &[PeerKey(1), PeerKey(3)], 8, 2 * MS);
        sent(&mut r);
        let mut join = |r: &mut Rounds, from| {
            r.on_message(
                &mut out,
                PeerKey(from),
                key(0),
                RoundMsg::Join,
                0,
                false,
                (Vec::new(), vec![PeerKey(1), PeerKey(3)]),
                8,
                3 * MS,
            )
        };
        join(&mut r, 3);
        assert!(r.poll().is_none(), "1 is waited for");
        r.went_on(PeerKey(1), 0, 4 * MS);
        assert!(
            r.poll().is_none(),
            "a replica still at round 0 is waited for"
        );
        r.went_on(PeerKey(1), 1, 4 * MS);
        let starts: Vec<_> = std::iter::from_fn(|| r.poll()).collect();
        let started_without_1 = |(_, o): &(RoundKey, RoundOut)| {
            matches!(o, RoundOut::Send(PeerKey(3), RoundMsg::Start { group })
                if group.len() == 2 && !group.contains(&PeerKey(1)))
        };
        assert!(starts.iter().any(started_without_1), "{starts:?}");
        // A follower whose leader announces it went past the round fails now.
        let mut f = rounds(5);
        f.begin(key(2), &[PeerKey(1)], &[PeerKey(1)], 8, MS);
        sent(&mut f);
        f.went_on(PeerKey(1), 3, 2 * MS);
        let out: Vec<_> = std::iter::from_fn(|| f.poll()).map(|(_, o)| o).collect();
        assert!(matches!(out.last(), Some(RoundOut::Failed(_))), "{out:?}");
    }

    #[test]
    fn a_round_another_replica_started_first_is_joined() {
        let mut out = Outbox::new(PeerKey(5));
        // A start from the leader: follow it.
        let mut r = rounds(5);
        let start = RoundMsg::Start {
            group: vec![PeerKey(3), PeerKey(5)],
        };
        hear(&mut r, &mut out, 3, 2, start, 2, false, vec![PeerKey(3)]);
        assert!(r.active());
        // The round then wants this replica's contribution.
        assert!(matches!(r.poll(), Some((_, RoundOut::NeedContribution))));
        // A join from one that ranks after this replica, which ranks first: it leads.
        let mut r = rounds(1);
        hear(
            &mut r,
            &mut out,
            5,
            2,
            RoundMsg::Join,
            2,
            false,
            vec![PeerKey(5)],
        );
        assert!(r.active());
        // A finished replica joins nothing; a request for a round it does not have is
        // answered "missing".
        let mut r = rounds(1);
        hear(
            &mut r,
            &mut out,
            3,
            2,
            RoundMsg::Join,
            2,
            true,
            vec![PeerKey(3)],
        );
        assert!(!r.active());
        hear(
            &mut r,
            &mut out,
            3,
            2,
            RoundMsg::Request {
                attempt: 7,
                part: 1,
            },
            2,
            true,
            vec![],
        );
        hear(
            &mut r,
            &mut out,
            3,
            2,
            RoundMsg::Request {
                attempt: 7,
                part: 1,
            },
            2,
            false,
            vec![],
        );
        assert_eq!(
            out.drain(),
            [Action::Send {
                to: PeerKey(3),
                msg: Message::Round {
                    key: key(2),
                    msg: RoundMsg::Missing {
                        attempt: 7,
                        part: 1
                    }
                }
            }]
        );
    }
}
