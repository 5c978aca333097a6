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
use super::averaging::{Feedback, Round, RoundOut};
use super::config::Timing;
use super::membership::Membership;
use super::message::{Message, RoundKey, RoundMsg};
use super::outbox::Outbox;
use crate::Codec;
use std::time::Duration;

/// Invitations to a next round kept while the current one finishes, at most: one per known
/// member for each of the two rounds they may be for (the same one from the same member is
/// kept once), so that no stage the membership can hold loses its joins to the cap.
pub(super) const MAX_EARLY_JOINS: usize = 2 * super::membership::MAX_MEMBERS;

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
    /// Joins of the current round that came while this replica followed another leader (one
    /// the senders had banned and it had not yet, say). Their senders wait for its start and
    /// do not join again, so a retry it leads takes them in; otherwise it would wait out its
    /// join window and start alone.
    joins_to_me: Vec<(RoundKey, PeerKey)>,
    /// The leader of the round this replica follows was seen serving the stage.
    leader_seen: bool,
    /// Error feedback of this replica's rounds at its stage, lent to the current round.
    feedback: Feedback,
    /// Leaders whose start this replica waited for in vain, by round: passed over when the
    /// round is tried again (they may still take part as members). Every follower of a
    /// leader that withholds its start times out alike, so they pass over the same one.
    passed_over: Vec<PassedOver>,
    /// Scripted misbehaviour (see [`super::attack`]): rounds started from now on negate the
    /// part this replica owns, and leave the others out when it leads.
    pub forge_parts: bool,
    pub exclude_others: bool,
    /// A scripted attacker never doubts its own share (see `Round::doubt_own_share`).
    pub attacking: bool,
    /// The factor on each member's weight in the parts this replica owns in rounds started
    /// from now on (see [`super::claims`]).
    pub credits: std::collections::BTreeMap<PeerKey, f64>,
    /// Banned peers: members no round waits for.
    banned: std::collections::BTreeSet<PeerKey>,
    /// Seconds per byte of this replica's encoded shares on its uplink, as measured: given
    /// to the round it contributes to, and what a catch-up is waited for by.
    pub upload_pace: Option<f64>,
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
    /// No round yet; rounds encode with `codec`, shares with error feedback decaying by
    /// `feedback_decay` a round.
    pub fn new(me: PeerKey, codec: Codec, feedback_decay: f32, timing: Timing) -> Self {
        Rounds {
            me,
            codec,
            timing,
            current: None,
            last: None,
            early_joins: Vec::new(),
            joins_to_me: Vec::new(),
            leader_seen: false,
            feedback: Feedback::new(codec, feedback_decay),
            passed_over: Vec::new(),
            forge_parts: false,
            exclude_others: false,
            attacking: false,
            credits: std::collections::BTreeMap::new(),
            banned: std::collections::BTreeSet::new(),
            upload_pace: None,
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
        self.joins_to_me.retain(|(k, _)| *k == key);
        let mut round = if leader == self.me {
            // A leader that started this round with a group leaving this replica out finished
            // it with that group: it will not join the retry, and is not waited for.
            let others: Vec<PeerKey> = others
                .iter()
                .copied()
                .filter(|p| !self.excluded_by(key.index, *p))
                .collect();
            let mut r = Round::lead(key, self.me, &others, len, self.codec, self.timing, now);
            let joins = std::mem::take(&mut self.early_joins)
                .into_iter()
                .chain(std::mem::take(&mut self.joins_to_me));
            for (k, from) in joins {
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
        self.lend_doubt(&mut round);
        round.credits.clone_from(&self.credits);
        round.gone.clone_from(&self.banned);
        self.install(round);
        self.leader_seen = false;
    }

    /// Makes `round` the current one, lending it the error feedback.
    fn install(&mut self, mut round: Round) {
        self.reclaim();
        let empty = self.feedback.cleared();
        round.feedback = std::mem::replace(&mut self.feedback, empty);
        self.current = Some(round);
    }

    /// Takes the error feedback back from the current round, which is ending.
    fn reclaim(&mut self) {
        if let Some(r) = self.current.as_mut() {
            let empty = r.feedback.cleared();
            self.feedback = std::mem::replace(&mut r.feedback, empty);
        }
    }

    fn follow(&mut self, key: RoundKey, leader: PeerKey, len: usize, now: Duration) {
        self.leader_seen = false;
        let mut round = Round::follow(key, self.me, leader, len, self.codec, self.timing, now);
        round.forge_part = self.forge_parts;
        self.lend_doubt(&mut round);
        round.credits.clone_from(&self.credits);
        round.gone.clone_from(&self.banned);
        self.install(round);
    }

    /// Whether `round` may doubt this replica's share.
    fn lend_doubt(&self, round: &mut Round) {
        round.self_doubt = !self.attacking;
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
        // A join from one that ranks after this replica: it takes this one for its leader. (One
        // that ranks before it and sends a join is a leader inviting it.)
        let following = self
            .current
            .as_ref()
            .is_some_and(|r| r.key() == key && r.follows());
        if following
            && msg == RoundMsg::Join
            && key.rank(self.me) < key.rank(from)
            && self.joins_to_me.len() < MAX_EARLY_JOINS
            && !self.joins_to_me.contains(&(key, from))
        {
            self.joins_to_me.push((key, from));
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
            if !self.early_joins.contains(&(key, from)) {
                self.early_joins.push((key, from));
            }
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
            RoundMsg::Missing { .. } | RoundMsg::Verdict { .. } => {}
        }
    }

    /// `peer` announced it has completed `its_round` rounds: the current round, if already
    /// behind it, no longer waits for it (see [`Round::went_on`]; `catchable`: this replica
    /// could catch up from `peer`).
    pub fn went_on(&mut self, peer: PeerKey, its_round: u64, catchable: bool, now: Duration) {
        if let Some(r) = self.current.as_mut()
            && its_round > r.key().index
        {
            r.went_on(peer, catchable, now);
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
        self.reclaim();
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

    /// How long sending `values` of a stage's round results (encoded with the rounds' codec)
    /// takes at this replica's measured upload pace (see [`super::averaging::transfer_time`]).
    pub fn transfer_time(&self, values: usize) -> Duration {
        let bytes = values as f64 * self.codec.nominal_bits_per_value() / 8.0;
        super::averaging::transfer_time(self.upload_pace, bytes)
    }

    /// This replica's contribution to the current round.
    pub fn contribute(&mut self, values: Vec<f32>, samples: f64, loss: Option<f64>, now: Duration) {
        if let Some(r) = self.current.as_mut() {
            r.upload_pace = self.upload_pace;
            r.contribute(values, samples, loss, now);
        }
    }

    /// The current round failed for this replica. A leader that never started it is passed
    /// over when it is tried again.
    pub fn fail(&mut self) {
        self.reclaim();
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
        self.reclaim();
        if let Some(r) = self.current.take() {
            self.last = Some(r);
        }
    }

    /// Whether replicas joined round `key` with this one as their leader while it followed
    /// another: they wait for its start.
    pub fn awaited(&self, key: RoundKey) -> bool {
        self.joins_to_me.iter().any(|(k, _)| *k == key)
    }

    /// Forgets every round and what they withheld (the replica leaves its stage, or its
    /// state is replaced); returns the current one's key.
    pub fn abandon(&mut self) -> Option<RoundKey> {
        self.feedback = self.feedback.cleared();
        self.last = None;
        self.early_joins.clear();
        self.joins_to_me.clear();
        self.current.take().map(|r| r.key())
    }
}

#[cfg(test)]
mod tests;
