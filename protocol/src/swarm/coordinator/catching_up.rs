//! How a replica of the stage gets back to its stage's parameters: replaying a round it missed
//! from a replica ahead of it (a catch-up), and the hash vote on the replicas' announcements
//! (see [`agreement`](super::super::agreement) for the rules).

use super::StepCoordinator;
use crate::swarm::PeerKey;
use crate::swarm::agreement::{Resync, outvoted};
use crate::swarm::membership::Membership;
use crate::swarm::message::{Announcement, MemberState};
use crate::swarm::outbox::Outbox;
use std::time::Duration;

impl StepCoordinator {
    /// A replica of `stage` that completed more rounds than this one.
    pub(super) fn replica_ahead(
        &self,
        stage: u32,
        members: &Membership,
        now: Duration,
    ) -> Option<PeerKey> {
        if self.finished {
            return None;
        }
        let vouched = self.counted(stage, members, now);
        members
            .iter()
            .filter(|(k, m)| m.serves(stage) && self.catchable(**k, m.announcement.round, &vouched))
            .max_by_key(|(_, m)| m.announcement.round)
            .map(|(k, _)| *k)
    }

    /// The replicas of `stage` whose announcements of a later round this replica follows:
    /// those it vouches for ([`Membership::vouched`]), or every one while it is stranded.
    fn counted<'a>(
        &self,
        stage: u32,
        members: &'a Membership,
        now: Duration,
    ) -> impl Fn(PeerKey) -> bool + 'a {
        let vouched = members.vouched(stage);
        let stranded = self.stranded(stage, members, &vouched, now);
        move |k| stranded || vouched(k)
    }

    /// Stranded: no work has come for longer than a round may take, no round runs, and no
    /// replica this one vouches for is ahead of it, while some replica of the stage is. The
    /// stage went on without it (a partition cut it off with the replicas it had checked, and
    /// the run's work went to the others): the replicas it checked say nothing of where the
    /// stage is now, so it goes by announcements, as a replica that checked nobody does (a
    /// state it downloads is still checked against the hash the stage's replicas announce).
    fn stranded(
        &self,
        stage: u32,
        members: &Membership,
        vouched: &impl Fn(PeerKey) -> bool,
        now: Duration,
    ) -> bool {
        if self.rounds.active()
            || self.applying_round
            || now.saturating_sub(self.last_collected) <= self.settings.timing.round_timeout
        {
            return false;
        }
        let mut ahead = members
            .iter()
            .filter(|(_, m)| m.serves(stage) && m.announcement.round > self.round)
            .peekable();
        ahead.peek().is_some() && ahead.all(|(k, _)| !vouched(*k))
    }

    /// The replica this one's state came from, with the rounds it completed, while it
    /// serves `stage`.
    fn source_serving(&self, stage: u32, members: &Membership) -> Option<(PeerKey, u64)> {
        let source = self.state_source?;
        let m = members.get(source).filter(|m| m.serves(stage))?;
        Some((source, m.announcement.round))
    }

    /// Whether this replica could replay its current round from `peer`, which completed
    /// `its_round` rounds: it is ahead, vouched for, and did not leave this replica out of
    /// the round.
    fn catchable(&self, peer: PeerKey, its_round: u64, vouched: &impl Fn(PeerKey) -> bool) -> bool {
        its_round > self.round && vouched(peer) && !self.rounds.excluded_by(self.round, peer)
    }

    /// A replica of this replica's stage announced itself (serving). One a round ahead is
    /// caught up with (no round under way here); one at the same round with other parameters
    /// calls the hash vote (see [`outvoted`]), whether or not the next round is under way
    /// here: on a busy stage the next round has often started by the time a replica's
    /// announcement of the last one arrives. Both go by the replicas this replica vouches
    /// for ([`Membership::vouched`]): a catch-up is asked of one of them where there is one
    /// (an identity that only announces a later round never answers).
    pub fn on_replica_announced(
        &mut self,
        out: &mut Outbox,
        stage: u32,
        members: &Membership,
        from: PeerKey,
        a: &Announcement,
        now: Duration,
    ) -> Option<Resync> {
        // Only a replica ahead matters (the active round's index is this replica's round), and
        // `vouched` scans the membership: not worth doing for every announcement.
        let catchable = a.round > self.round
            && self.catchable(from, a.round, &self.counted(stage, members, now));
        if self.rounds.active() {
            self.rounds
                .went_on(from, a.round, catchable && !self.finished, now);
        } else if a.round > self.round && !self.finished {
            // The replica this one downloaded from keeps the rounds since: while it serves,
            // its own announcement brings the catch-up (it may announce a round later than
            // the others: its uplink carries the catch-ups).
            let source_serves = self
                .source_serving(stage, members)
                .is_some_and(|s| s.0 != from);
            if catchable && !source_serves {
                self.catch_up(out, stage, from, now);
            }
            return None;
        }
        if a.round != self.round {
            return None;
        }
        self.vote(stage, members, from, a.params_hash?)
    }

    /// The hash vote against `from`, which announced `theirs` for this replica's round.
    fn vote(&self, stage: u32, members: &Membership, from: PeerKey, theirs: u64) -> Option<Resync> {
        let mine = self.params_hash?;
        if theirs == mine {
            return None;
        }
        let (me, round) = (self.settings.me, self.round);
        let vouched = members.vouched(stage);
        outvoted(members, me, stage, round, from, theirs, mine, vouched).then_some(Resync {
            from,
            reason: "parameters differ from the stage's other replicas",
            elsewhere: false,
        })
    }

    /// This replica just took its round's step: the hash vote against the replicas that
    /// announced other parameters for the round before this replica got there (they had
    /// moved on, or were in their next round, when this replica's announcement reached them).
    pub fn vote_after_step(&self, stage: u32, members: &Membership) -> Option<Resync> {
        let vouched = members.vouched(stage);
        members
            .iter()
            .filter(|(k, m)| m.serves(stage) && vouched(**k))
            .filter_map(|(k, m)| Some((*k, m.hash_at(self.round)?)))
            .find_map(|(k, theirs)| self.vote(stage, members, k, theirs))
    }

    /// Whether the replicas of `stage` this replica vouches for hold its parameters at its
    /// round, and none is downloading the stage's state: the run may end here. (Replicas
    /// that end apart would be settled by no later vote.)
    pub fn stage_agrees(&self, stage: u32, members: &Membership) -> bool {
        let vouched = members.vouched(stage);
        members
            .iter()
            .filter(|(k, m)| m.announcement.stage == Some(stage) && vouched(**k))
            .all(|(_, m)| match m.announcement.state {
                MemberState::Serving => {
                    self.params_hash.is_none()
                        || m.hash_at(self.round)
                            .is_none_or(|h| Some(h) == self.params_hash)
                }
                MemberState::Syncing => false,
                MemberState::Choosing | MemberState::Leaving => true,
            })
    }

    /// Behind a replica of this stage: replay the round it missed from that replica's
    /// record (cheap, and lands on the same parameters); a full state transfer if the
    /// replica no longer has it.
    pub(super) fn catch_up(&mut self, out: &mut Outbox, stage: u32, from: PeerKey, now: Duration) {
        if self.catch_up.asking() || self.rounds.active() || self.applying_round {
            return;
        }
        // The answer is the round's result, as large as the round's encoded values: on a
        // slow uplink busy with rounds it takes longer than a round timeout to come (the
        // responder's uplink is taken to be like this replica's).
        let transfer = self.rounds.transfer_time(self.params(stage));
        let deadline = now + self.settings.timing.round_timeout + 2 * transfer;
        self.catch_up.ask(out, from, stage, self.round, deadline);
    }

    /// Keeps the round results from a round on, up to some bytes (see
    /// [`super::super::agreement::CatchUp::keep_since`]).
    pub fn keep_history_since(&mut self, keep: Option<(u64, usize)>) {
        self.catch_up.keep_since(keep);
    }

    /// Another replica asks for the result of `round` (see [`CatchUp::answer`]).
    pub fn answer_catch_up(&mut self, out: &mut Outbox, to: PeerKey, stage: u32, round: u64) {
        self.catch_up.answer(out, to, stage, round);
    }

    /// The answer to this replica's catch-up request: apply it as the round's result. An
    /// answer that was not asked for is ignored; an empty or malformed one (or one that comes
    /// while a round runs) means downloading the state from that replica.
    #[allow(clippy::too_many_arguments)]
    pub fn on_catch_up(
        &mut self,
        out: &mut Outbox,
        from: PeerKey,
        my_stage: Option<u32>,
        stage: u32,
        round: u64,
        samples: f64,
        data: &[u8],
    ) -> Option<Resync> {
        if my_stage != Some(stage) || round != self.round {
            return None;
        }
        let len = self.params(stage);
        let values = match self
            .catch_up
            .on_answer(out, from, round, samples, data, len)?
        {
            Ok(values) if !self.rounds.active() => values,
            Ok(_) => {
                return Some(Resync {
                    from,
                    reason: "a replica of this stage is ahead",
                    elsewhere: false,
                });
            }
            Err(resync) => return Some(resync),
        };
        self.applying_round = true;
        self.round_group = 0;
        self.round_samples = samples;
        out.compute(self.apply(values));
        None
    }

    /// After a step: a replica of `stage` that is ahead is caught up with.
    pub fn catch_up_if_behind(
        &mut self,
        out: &mut Outbox,
        stage: Option<u32>,
        members: &Membership,
        now: Duration,
    ) {
        let Some(stage) = stage else {
            return;
        };
        if let Some(ahead) = self.replica_ahead(stage, members, now) {
            self.catch_up_with(out, stage, members, ahead, now);
        }
    }

    /// Catches up with the replica this one downloaded from where it serves and is ahead
    /// (see `on_replica_announced`), else with `ahead`. A source no further than this replica
    /// is not waited for: after a partition two replicas can each hold the other as source,
    /// at one round, while a third is ahead of both.
    pub(super) fn catch_up_with(
        &mut self,
        out: &mut Outbox,
        stage: u32,
        members: &Membership,
        ahead: PeerKey,
        now: Duration,
    ) {
        match self.source_serving(stage, members) {
            Some(source) if source.1 > self.round => self.catch_up(out, stage, source.0, now),
            _ => self.catch_up(out, stage, ahead, now),
        }
    }
}
