//! One averaging round among the replicas of a stage: a compressed reduce-scatter followed by
//! an all-gather, tolerant of members vanishing at any point.
//!
//! The leader (the smallest key among the replicas a member knows) collects `Join`s for a
//! short window and announces the group; member i then owns part i of the flattened vector.
//! Every member sends part j of its contribution (a sum over its samples, with the sample
//! count) to owner j; each owner reduces what reached it to a robust mean per sample (centered
//! clipping with capped weights, see [`super::robust`]: no member moves a part by more than
//! the honest members' spread), scores how much each share supported it (the evidence for
//! [`super::bans`]), and sends the averaged part, encoded once, to everyone. All members, the owner included,
//! use the decoded bytes, so every replica applies bit-identical values.
//!
//! The averaged part an owner sends is what every replica applies, and a forged one is not
//! clipped by anything: so before applying, every member votes on every part (a
//! [`RoundMsg::Verdict`] to all): accept when the part points along its own share of it,
//! refuse when against, abstain when it cannot tell ([`robust::VOTE_COSINE`]). A part with
//! more refusals than acceptances among the members other than its owner is applied by nobody
//! (zero there, as for a lost part). Members decide on the votes that reached them, as soon
//! as those settle every part whatever the missing ones would say; liars
//! fewer than the honest members that could tell cannot change the outcome, and where members
//! still decide differently the hash vote after the round re-syncs the minority. An owner
//! whose part every other member will clearly accept (it sees that in the shares it reduced)
//! does not wait for the verdicts on it at all: with few members, that wait was most of the
//! vote's cost.
//!
//! With a lossy codec, shares and parts carry error feedback across rounds ([`Feedback`]).
//!
//! Faults: a member that never sends its part is left out of that part's average (the others
//! still average over the samples they have). An owner that vanishes before sending its
//! averaged part to everyone: the members missing it ask the others, and take it from anyone
//! who got it; if nobody did, everyone uses zero for that part (so that part takes no gradient
//! step, identically everywhere). A member votes to refuse every part it could not get, so an
//! owner too slow for the others (they gave its part up) drops its own part as they did rather
//! than applying it alone. A member left out of the group stays behind and re-syncs.

use super::PeerKey;
use super::bans::Evidence;
use super::config::Timing;
use super::message::{RoundKey, RoundMsg, Vote};
use super::norms;
#[cfg(doc)]
use super::robust;
use crate::{Codec, Decoder, Encoder};
pub use feedback::Feedback;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

/// An averaged part as its owner sent it: samples, mean loss, the encoded values (shared by
/// every message that carries them).
type EncodedPart = (f64, Option<f64>, Arc<Vec<u8>>);

/// A round's group is at most every member a peer can know of.
const MAX_GROUP: usize = super::membership::MAX_MEMBERS;

/// Early messages (before the group is known) buffered from one sender, at most: a member
/// sends each other one a share, an averaged part and a verdict, and answers an ask.
const EARLY_PER_SENDER: usize = 4;

/// Early messages buffered in all, at most: what every member of the largest group sends.
const MAX_EARLY: usize = EARLY_PER_SENDER * MAX_GROUP;

/// The most a round waits for one member's shares to go out, however slow its uplink was
/// measured.
const MAX_TRANSFER: Duration = Duration::from_secs(600);

/// How long sending `bytes` takes at `pace` seconds per byte (None, or not a positive
/// number: no time to add), at most [`MAX_TRANSFER`]: a pace measured absurdly slow must not
/// hold a round for days.
pub(super) fn transfer_time(pace: Option<f64>, bytes: f64) -> Duration {
    let pace = pace.filter(|p| p.is_finite() && *p > 0.0);
    pace.map_or(Duration::ZERO, |p| {
        Duration::from_secs_f64((p * bytes).min(MAX_TRANSFER.as_secs_f64()))
    })
}

/// What a round wants its owner to do.
#[derive(Clone, Debug, PartialEq)]
pub enum RoundOut {
    /// Send this to that member.
    Send(PeerKey, RoundMsg),
    /// The group is fixed: provide this replica's contribution ([`Round::contribute`]).
    NeedContribution,
    /// The round is over: apply this.
    Finished(RoundResult),
    /// This replica is not part of the round (no start came, or the group left it out); its
    /// accumulated contribution is kept for the next attempt.
    Failed(&'static str),
    /// A member sent what no honest member sends (see [`super::Event::Violation`]); it
    /// changed nothing.
    Violation(PeerKey, &'static str),
    /// What the round showed of a member when it failed (see [`super::bans`]).
    Evidence(Evidence),
}

/// The outcome of a round.
#[derive(Clone, Debug, PartialEq)]
pub struct RoundResult {
    /// The averaged vector, identical on every member.
    pub averaged: Vec<f32>,
    /// Each part's encoding as its owner sent it (the averaged vector is their decoding),
    /// where there is one: a catch-up replays the round from these, at the codec's size.
    pub parts: Vec<Option<Arc<Vec<u8>>>>,
    /// The members.
    pub group: Vec<PeerKey>,
    /// Samples behind this member's own part's average.
    pub samples: f64,
    /// Mean loss per sample over the members that reported one (the last stage's replicas
    /// do): the step's loss over the whole global batch, known to every replica.
    pub loss: Option<f64>,
    /// Members whose share did not reach this member's part in time.
    pub left_out: Vec<PeerKey>,
    /// Parts nobody could deliver (zero everywhere).
    pub zeroed: Vec<u32>,
    /// Parts the members' votes refused (zero here, identically on every member that saw the
    /// same votes).
    pub refused: Vec<u32>,
    /// What this member saw of the others, the evidence bans are built on: per member whose
    /// share reached this member's part, how much it supported the part's robust mean
    /// ([`robust::Aggregate::support`]); per averaged part received, how well it agreed with
    /// this member's own share of it ([`robust::agreement`]).
    pub evidence: Vec<Evidence>,
    /// The samples each member's share of this member's part claimed (see
    /// [`crate::swarm::claims`]).
    pub claims: Vec<(PeerKey, f64)>,
}

#[derive(Clone, Debug, PartialEq)]
enum Phase {
    /// Leader: collecting joins until the window closes or every replica joined.
    Gathering,
    /// Follower: waiting for the leader's start.
    AwaitStart,
    /// Group known, contribution requested.
    AwaitContribution,
    /// Parts sent; owning one part and collecting the others.
    Exchanging,
    /// Asking other members for averaged parts whose owner went quiet.
    Filling,
    /// Every part is in (or given up on): collecting the members' verdicts on them.
    Voting,
    /// Over.
    Done,
}

/// One round, from this member's point of view.
#[derive(Debug)]
pub struct Round {
    key: RoundKey,
    me: PeerKey,
    len: usize,
    codec: Codec,
    timing: Timing,
    phase: Phase,
    /// The leader this member follows (None: it leads).
    leader: Option<PeerKey>,
    /// The leader whose start never came, or left this member out (the round failed for
    /// that).
    withheld_by: Option<PeerKey>,
    /// ...and it did so by starting the round with a group that left this member out.
    excluded: bool,
    expected: BTreeSet<PeerKey>,
    joined: BTreeSet<PeerKey>,
    /// A replica this leader could catch up from went on past the round (see
    /// [`Round::went_on`]).
    passed: bool,
    group: Vec<PeerKey>,
    /// The attempt once the group is fixed ([`RoundKey::attempt`]).
    attempt: u64,
    /// Messages that came before this member could use them, with when they came.
    early: Vec<(PeerKey, RoundMsg, Duration)>,
    /// When the first share of this attempt reached this member (see `sure_to_be_kept`).
    first_share_at: Option<Duration>,
    /// This member's own part will be kept by the vote whatever the verdicts say, as far
    /// as it can tell (`sure_to_be_kept`): it does not wait for them.
    own_part_sure: bool,
    /// Members that left or were banned (before or during the round): not waited for.
    pub(super) gone: BTreeSet<PeerKey>,
    /// Shares of the part this member owns: values (sums) and samples per sender.
    shares: BTreeMap<PeerKey, (Vec<f32>, f64, Option<f64>)>,
    owned_done: bool,
    averaged: Vec<Option<Vec<f32>>>,
    /// This member's vote on each part, and the verdicts of the others.
    votes: Vec<Vote>,
    verdicts: BTreeMap<PeerKey, Vec<Vote>>,
    /// Members that sent this member their share or their averaged part this attempt: those
    /// whose verdicts are waited for (one silent so far is not waited for again).
    heard: BTreeSet<PeerKey>,
    /// Parts nobody could deliver, known before the vote.
    zeroed: Vec<u32>,
    /// Averaged parts as encoded, to answer requests.
    encoded: BTreeMap<u32, EncodedPart>,
    own_samples: f64,
    /// Root-mean-square per sample of this member's own contribution: what it expects the
    /// others' parts and the averaged parts to be near (see [`super::norms`]).
    own_scale: f64,
    loss: Option<f64>,
    evidence: Vec<Evidence>,
    /// This member's contribution (a sum over `own_samples`), to check averaged parts by.
    own: Vec<f32>,
    /// Scripted misbehaviour: negate the part this member owns (and vote for the parts that
    /// point against its share, against the others); leading, leave the others out.
    pub(super) forge_part: bool,
    pub(super) exclude_others: bool,
    /// Whether this member judges its own share when most parts disagree with it
    /// ([`Round::doubt_own_share`]); a scripted attacker does not.
    pub(super) self_doubt: bool,
    /// The factor on each member's weight from its claims checked against the routes (see
    /// [`crate::swarm::claims`]; 1 where absent).
    pub(super) credits: BTreeMap<PeerKey, f64>,
    /// What the shares of this member's part claimed, once reduced.
    claims: Vec<(PeerKey, f64)>,
    /// Seconds per byte of encoded shares on this member's uplink (see
    /// [`crate::swarm::links::Links::upload_pace`]). The phases after the contribution wait `round_timeout` plus what
    /// sending this member's shares takes at that pace, twice (its shares out, then the part
    /// it owns to every member): a large stage on a home uplink needs far longer than the
    /// fixed timeout, and a fixed timeout there leaves out every member, round after round.
    pub(super) upload_pace: Option<f64>,
    /// What sending this member's shares takes at `upload_pace` (set on contributing).
    transfer: Duration,
    missing_answers: BTreeMap<u32, BTreeSet<PeerKey>>,
    started: Duration,
    deadline: Option<Duration>,
    out: VecDeque<RoundOut>,
    encoder: Encoder,
    decoder: Decoder,
    /// The replica's error feedback, lent for the round (see [`super::rounds::Rounds`]).
    pub(super) feedback: Feedback,
}

/// Part `j` of `n` over a vector of `len` values.
pub fn part_range(len: usize, n: usize, j: usize) -> Range<usize> {
    let n = n.max(1);
    (j * len / n)..((j + 1) * len / n)
}

impl Round {
    fn new(
        key: RoundKey,
        me: PeerKey,
        len: usize,
        codec: Codec,
        timing: Timing,
        now: Duration,
    ) -> Self {
        Round {
            key,
            me,
            len,
            codec,
            timing,
            phase: Phase::Done,
            leader: None,
            withheld_by: None,
            excluded: false,
            expected: BTreeSet::new(),
            passed: false,
            joined: BTreeSet::new(),
            group: Vec::new(),
            attempt: 0,
            early: Vec::new(),
            first_share_at: None,
            own_part_sure: false,
            gone: BTreeSet::new(),
            shares: BTreeMap::new(),
            owned_done: false,
            averaged: Vec::new(),
            votes: Vec::new(),
            verdicts: BTreeMap::new(),
            heard: BTreeSet::new(),
            zeroed: Vec::new(),
            encoded: BTreeMap::new(),
            own_samples: 0.0,
            own_scale: 0.0,
            loss: None,
            evidence: Vec::new(),
            own: Vec::new(),
            forge_part: false,
            exclude_others: false,
            self_doubt: true,
            credits: BTreeMap::new(),
            claims: Vec::new(),
            upload_pace: None,
            transfer: Duration::ZERO,
            missing_answers: BTreeMap::new(),
            started: now,
            deadline: None,
            out: VecDeque::new(),
            encoder: Encoder::new(),
            decoder: Decoder::with_max_elements(len),
            feedback: Feedback::new(codec, 1.0),
        }
    }

    /// This member leads the round; `others` are the stage's other replicas it knows of.
    pub fn lead(
        key: RoundKey,
        me: PeerKey,
        others: &[PeerKey],
        len: usize,
        codec: Codec,
        timing: Timing,
        now: Duration,
    ) -> Self {
        let mut r = Round::new(key, me, len, codec, timing, now);
        r.expected = others.iter().copied().filter(|k| *k != me).collect();
        r.joined.insert(me);
        // Invite the replicas it knows: one that has not noticed the stage is ready (its
        // view of the others' progress lags) joins now instead of missing the round.
        for &k in &r.expected {
            r.out.push_back(RoundOut::Send(k, RoundMsg::Join));
        }
        r.phase = Phase::Gathering;
        r.deadline = Some(now + timing.join_window);
        r.maybe_start(now, false);
        r
    }

    /// This member follows `leader`.
    pub fn follow(
        key: RoundKey,
        me: PeerKey,
        leader: PeerKey,
        len: usize,
        codec: Codec,
        timing: Timing,
        now: Duration,
    ) -> Self {
        let mut r = Round::new(key, me, len, codec, timing, now);
        r.phase = Phase::AwaitStart;
        r.leader = Some(leader);
        r.deadline = Some(now + timing.join_window + timing.round_timeout);
        r.out.push_back(RoundOut::Send(leader, RoundMsg::Join));
        r
    }

    /// Which round.
    pub fn key(&self) -> RoundKey {
        self.key
    }

    /// Whether this member follows another's lead in it.
    pub fn follows(&self) -> bool {
        self.leader.is_some()
    }

    /// Whether the round is over (finished or failed).
    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// Whether this member's contribution has been taken (from then on, new work counts
    /// toward the next round).
    pub fn contributed(&self) -> bool {
        matches!(
            self.phase,
            Phase::Exchanging | Phase::Filling | Phase::Voting
        ) || (self.phase == Phase::Done && !self.group.is_empty())
    }

    /// Whether `peer` is in the round's group (or, before the group is fixed, its leader or
    /// one that joined).
    pub fn has_member(&self, peer: PeerKey) -> bool {
        self.group.contains(&peer) || self.joined.contains(&peer) || self.leader == Some(peer)
    }

    /// The leader whose start this follower still waits for, if it waits.
    pub fn awaited_leader(&self) -> Option<PeerKey> {
        self.leader.filter(|_| self.phase == Phase::AwaitStart)
    }

    /// The leader this member waited for in vain, if the round failed for that.
    pub fn withheld_by(&self) -> Option<PeerKey> {
        self.withheld_by
    }

    /// The leader that started the round without this member, if it failed for that.
    pub fn excluded_by(&self) -> Option<PeerKey> {
        self.withheld_by.filter(|_| self.excluded)
    }

    /// `peer` announced that it is past this round (it finished it, or caught up, elsewhere):
    /// it will not join it. A leader stops waiting for it; a follower waiting for it to start
    /// the round fails now rather than at its deadline (it went on without this member).
    /// `catchable`: this member could replay the round from `peer`'s record instead (see
    /// [`Round::maybe_start`]).
    pub fn went_on(&mut self, peer: PeerKey, catchable: bool, now: Duration) {
        match self.phase {
            Phase::Gathering if !self.joined.contains(&peer) => {
                self.expected.remove(&peer);
                self.passed |= catchable;
                self.maybe_start(now, false);
            }
            Phase::AwaitStart if self.leader == Some(peer) => {
                self.withheld_by = self.leader;
                self.misled();
                self.fail("the round's leader went on without this replica");
            }
            _ => {}
        }
    }

    /// When [`Round::handle_timeout`] should be called.
    pub fn deadline(&self) -> Option<Duration> {
        self.deadline
    }

    /// The next thing to do.
    pub fn poll(&mut self) -> Option<RoundOut> {
        self.out.pop_front()
    }

    fn maybe_start(&mut self, now: Duration, window_closed: bool) {
        if self.phase != Phase::Gathering {
            return;
        }
        if !window_closed && !self.expected.iter().all(|k| self.joined.contains(k)) {
            return;
        }
        if self.passed && self.joined.len() == 1 {
            // Alone while a replica it could catch up from finished the round elsewhere: a
            // round of its own would step its parameters away from the stage's (a restarted
            // replica behind the others did, and a re-sync had to repair it). It fails, and
            // the retry catches up instead.
            return self.fail("the stage's other replicas went on past this round");
        }
        self.group = self.joined.iter().copied().collect();
        let key = self.key;
        self.group.sort_by_key(|k| key.rank(*k));
        let joined = self.group.clone();
        if self.exclude_others {
            self.group = vec![self.me];
        }
        for &k in &joined {
            if k != self.me {
                self.out.push_back(RoundOut::Send(
                    k,
                    RoundMsg::Start {
                        group: self.group.clone(),
                    },
                ));
            }
        }
        self.begin(now);
    }

    fn begin(&mut self, now: Duration) {
        // Members already known to be gone (banned before the group was fixed) are not
        // waited for.
        for k in &self.group {
            if self.gone.contains(k) {
                self.shares.insert(*k, (Vec::new(), 0.0, None));
            }
        }
        self.attempt = self
            .key
            .attempt(self.leader.unwrap_or(self.me), &self.group);
        self.phase = Phase::AwaitContribution;
        self.deadline = None;
        self.started = now;
        self.averaged = vec![None; self.group.len()];
        self.votes = vec![Vote::Abstain; self.group.len()];
        self.verdicts.clear();
        self.heard.clear();
        self.first_share_at = None;
        self.own_part_sure = false;
        self.zeroed.clear();
        self.out.push_back(RoundOut::NeedContribution);
    }

    fn my_index(&self) -> Option<usize> {
        self.group.iter().position(|k| *k == self.me)
    }

    fn range(&self, j: usize) -> Range<usize> {
        part_range(self.len, self.group.len(), j)
    }

    /// This member's contribution: the sum over its samples, how many samples, and (last
    /// stage) the sum of the samples' losses. The round keeps the values (its vote compares
    /// each averaged part with them): taken, not copied, as a stage's whole vector may be large.
    pub fn contribute(&mut self, values: Vec<f32>, samples: f64, loss: Option<f64>, now: Duration) {
        if self.phase != Phase::AwaitContribution || values.len() != self.len {
            return;
        }
        let Some(me) = self.my_index() else {
            return;
        };
        self.own_samples = samples;
        self.own_scale = norms::rms(&values) / samples.max(1.0);
        self.own = values;
        let values = &self.own;
        self.started = now;
        self.feedback.begin(self.len);
        let mut buf = Vec::new();
        let mut sent = 0;
        for j in 0..self.group.len() {
            let r = self.range(j);
            if j == me {
                let share = self.feedback.own_share(&values[r.clone()], r, self.len);
                self.shares.insert(self.me, (share, samples, loss));
                continue;
            }
            if r.is_empty() {
                continue;
            }
            let share = &values[r.clone()];
            if self
                .feedback
                .encode_share(&mut self.encoder, share, r, self.len, &mut buf)
                .is_ok()
            {
                sent += buf.len();
                self.out.push_back(RoundOut::Send(
                    self.group[j],
                    RoundMsg::Part {
                        attempt: self.attempt,
                        part: j as u32,
                        samples,
                        loss,
                        data: std::mem::take(&mut buf),
                    },
                ));
            }
        }
        for j in 0..self.group.len() {
            if self.range(j).is_empty() {
                self.averaged[j] = Some(Vec::new());
            }
        }
        self.phase = Phase::Exchanging;
        self.transfer = transfer_time(self.upload_pace, sent as f64);
        self.deadline = Some(now + self.patience());
        for (from, msg, at) in std::mem::take(&mut self.early) {
            if matches!(msg, RoundMsg::Part { .. }) && msg.attempt() == Some(self.attempt) {
                self.share_arrived(at);
            }
            self.handle(from, msg, now);
        }
        self.maybe_reduce(now, false);
        self.maybe_finish(now);
    }

    /// How long the phases that move values wait: the round timeout, and this member's
    /// shares out and its part back at the pace its uplink was measured at.
    fn patience(&self) -> Duration {
        self.timing.round_timeout + 2 * self.transfer
    }

    fn violation(&mut self, from: PeerKey, what: &'static str) {
        self.out.push_back(RoundOut::Violation(from, what));
    }

    fn decode(&mut self, data: &[u8], expect: usize) -> Option<Vec<f32>> {
        let mut out = Vec::new();
        match self.decoder.decode(data, &mut out) {
            Ok(_) if out.len() == expect && out.iter().all(|v| v.is_finite()) => Some(out),
            _ => None,
        }
    }

    /// `peer` is gone (it left, crashed or was banned): its share of this member's part is
    /// not waited for (it counts as contributing nothing), nor its join.
    pub fn member_gone(&mut self, peer: PeerKey, now: Duration) {
        self.expected.remove(&peer);
        self.gone.insert(peer);
        match self.phase {
            Phase::Gathering => {
                self.joined.remove(&peer);
                self.maybe_start(now, false);
            }
            // Its leader crashed or restarted: the start will not come. Tried again with
            // another leader now, rather than at the deadline; no evidence against it.
            Phase::AwaitStart if self.leader == Some(peer) => {
                self.withheld_by = self.leader;
                self.fail("the round's leader left");
            }
            Phase::AwaitStart | Phase::Done => {}
            Phase::AwaitContribution | Phase::Exchanging | Phase::Filling | Phase::Voting => {
                if self.group.contains(&peer) && !self.owned_done {
                    self.shares.entry(peer).or_insert((Vec::new(), 0.0, None));
                }
                self.maybe_reduce(now, false);
                self.maybe_finish(now);
                self.maybe_give_up_fill(now);
                self.maybe_decide();
            }
        }
    }

    /// A round message from `from`.
    pub fn handle(&mut self, from: PeerKey, msg: RoundMsg, now: Duration) {
        if !self.group.is_empty() && msg.attempt().is_some_and(|a| a != self.attempt) {
            // Another attempt at this round (a late message from before it was tried again,
            // or from a member that saw another start): its parts are cut differently, so it
            // is neither used nor blamed. Withholding this way gains nothing: a share or part
            // that does not arrive counts as not delivered.
            return;
        }
        match (&self.phase, msg) {
            (Phase::Gathering, RoundMsg::Join) => {
                self.joined.insert(from);
                self.maybe_start(now, false);
            }
            // Only the leader this member follows starts its round.
            (Phase::AwaitStart, RoundMsg::Start { group }) if Some(from) == self.leader => {
                // Strictly in rank order: no repeats, and the leader does not choose who owns
                // which part.
                let key = self.key;
                let ranked = group.windows(2).all(|w| key.rank(w[0]) < key.rank(w[1]));
                if !ranked || group.len() > MAX_GROUP {
                    self.violation(
                        from,
                        "a round's group out of rank order, with repeated members or too large",
                    );
                    return;
                }
                if !group.contains(&self.me) {
                    // Passed over when the round is tried again, like a leader that never
                    // starts: a leader that leaves its followers out would otherwise lead
                    // every retry of the round. Its result is not caught up from either.
                    self.withheld_by = self.leader;
                    self.excluded = true;
                    self.out
                        .push_back(RoundOut::Evidence(Evidence::LeftOut { peer: from }));
                    self.fail("the round's group left this replica out");
                    return;
                }
                self.evidence.push(Evidence::Led {
                    peer: from,
                    included: true,
                });
                self.group = group;
                self.begin(now);
            }
            // Not this member's leader: replicas whose views of the stage differ (one that just
            // restarted or joined counts other members) may each take itself to lead. Not a
            // lie, and not followed.
            (_, RoundMsg::Start { .. }) if Some(from) != self.leader => {}
            (
                Phase::AwaitStart | Phase::AwaitContribution,
                msg
                @ (RoundMsg::Part { .. } | RoundMsg::Averaged { .. } | RoundMsg::Verdict { .. }),
            ) if self.early.len() < MAX_EARLY
                && self.early.iter().filter(|(f, ..)| *f == from).count() < EARLY_PER_SENDER =>
            {
                self.early.push((from, msg, now))
            }
            (
                Phase::Exchanging | Phase::Filling,
                RoundMsg::Part {
                    part,
                    samples,
                    loss,
                    data,
                    ..
                },
            ) => self.on_share(from, part, samples, loss, data, now),
            (
                Phase::Exchanging | Phase::Filling,
                RoundMsg::Averaged {
                    part,
                    samples,
                    loss,
                    data,
                    ..
                },
            ) => {
                let j = part as usize;
                // While exchanging, a part comes from its owner; once filling, from any
                // member asked for it (the owner went quiet).
                let sender_may = match self.phase {
                    Phase::Exchanging => self.group.get(j) == Some(&from),
                    _ => self.group.contains(&from),
                };
                if j >= self.group.len() || !sender_may {
                    self.violation(from, "an averaged part from a member that does not own it");
                    return;
                }
                if self.averaged[j].is_some() {
                    // Several members may answer one request.
                    return;
                }
                if !(samples.is_finite() && samples >= 0.0) || loss.is_some_and(|l| !l.is_finite())
                {
                    self.violation(
                        from,
                        "an averaged part with a sample count or loss out of range",
                    );
                    return;
                }
                let expect = self.range(j).len();
                match self.decode(&data, expect) {
                    Some(v) if !norms::within(norms::rms(&v), self.own_scale) => {
                        self.violation(from, "an averaged part far larger than this member's own");
                    }
                    Some(v) => {
                        self.judge_part(from, j, &v);
                        if self.phase == Phase::Exchanging {
                            self.heard.insert(from);
                        }
                        self.averaged[j] = Some(v);
                        if self.loss.is_none() {
                            self.loss = loss;
                        }
                        self.encoded.insert(part, (samples, loss, data));
                    }
                    None => self.violation(
                        from,
                        "an averaged part that does not decode to finite values of its size",
                    ),
                }
                self.maybe_finish(now);
            }
            (
                Phase::Exchanging | Phase::Filling | Phase::Voting,
                RoundMsg::Verdict { votes, .. },
            ) => self.on_verdict(from, votes),
            (Phase::Filling, RoundMsg::Missing { part, .. }) if self.group.contains(&from) => {
                self.missing_answers.entry(part).or_default().insert(from);
                self.maybe_give_up_fill(now);
            }
            (_, RoundMsg::Request { part, attempt }) => {
                let reply = match self.encoded.get(&part) {
                    Some((samples, loss, data)) => RoundMsg::Averaged {
                        attempt,
                        part,
                        samples: *samples,
                        loss: *loss,
                        data: data.clone(),
                    },
                    None => RoundMsg::Missing { attempt, part },
                };
                if self.group.contains(&from) {
                    self.out.push_back(RoundOut::Send(from, reply));
                }
            }
            _ => {}
        }
    }

    fn maybe_finish(&mut self, now: Duration) {
        if !matches!(self.phase, Phase::Exchanging | Phase::Filling) || !self.owned_done {
            return;
        }
        let missing: Vec<PeerKey> = (0..self.group.len())
            .filter(|j| self.averaged[*j].is_none())
            .map(|j| self.group[j])
            .collect();
        if missing.is_empty() {
            self.vote(Vec::new(), now);
        } else if self.phase == Phase::Exchanging && missing.iter().all(|k| self.gone.contains(k)) {
            // Only parts of members that are gone are missing: ask the others now rather than
            // at the round's timeout.
            self.start_filling(now);
        }
    }

    /// `waited_out`: the vote was decided at its deadline, without the verdicts still missing.
    fn finish(&mut self, zeroed: Vec<u32>, refused: Vec<u32>, waited_out: bool) {
        let mut averaged = Vec::with_capacity(self.len);
        for (j, p) in self.averaged.iter().enumerate() {
            match p {
                Some(v) => averaged.extend_from_slice(v),
                None => averaged.extend(std::iter::repeat_n(0.0, self.range(j).len())),
            }
        }
        let left_out: Vec<PeerKey> = self
            .group
            .iter()
            .copied()
            .filter(|k| !self.shares.contains_key(k))
            .collect();
        // Who delivered: each member's share to this member's part, each owner's part (one
        // nobody could deliver was withheld by its owner), and the verdicts of the members
        // whose were waited for in vain (keeping them would cost every round a wait for
        // free; one not needed to settle the vote cost nothing). A member that left or
        // restarted during the round is not judged by it: what it had under way died with it.
        for (j, &peer) in self.group.iter().enumerate() {
            if peer != self.me && !self.gone.contains(&peer) {
                let share = !left_out.contains(&peer);
                let part = !zeroed.contains(&(j as u32));
                self.evidence.push(Evidence::Delivered {
                    peer,
                    delivered: share && part && !(waited_out && self.verdict_missing(peer)),
                });
            }
        }
        let samples = self
            .my_index()
            .and_then(|m| self.encoded.get(&(m as u32)).map(|e| e.0))
            .unwrap_or(self.own_samples);
        let (len, n) = (self.len, self.group.len());
        let undelivered = zeroed.iter().chain(&refused);
        let undelivered = undelivered.map(|&j| part_range(len, n, j as usize));
        self.feedback.finished(undelivered, &self.own);
        self.phase = Phase::Done;
        self.deadline = None;
        let parts = (0..n as u32)
            .map(|j| {
                let applied = !zeroed.contains(&j) && !refused.contains(&j);
                self.encoded
                    .get(&j)
                    .filter(|_| applied)
                    .map(|e| e.2.clone())
            })
            .collect();
        self.out.push_back(RoundOut::Finished(RoundResult {
            averaged,
            parts,
            group: self.group.clone(),
            samples,
            loss: self.loss,
            left_out,
            zeroed,
            refused,
            evidence: std::mem::take(&mut self.evidence),
            claims: std::mem::take(&mut self.claims),
        }));
    }

    /// The leader this member followed did not start the round with it.
    fn misled(&mut self) {
        if let Some(peer) = self.leader {
            self.out.push_back(RoundOut::Evidence(Evidence::Led {
                peer,
                included: false,
            }));
        }
    }

    fn fail(&mut self, why: &'static str) {
        self.feedback.failed();
        self.phase = Phase::Done;
        self.deadline = None;
        self.group.clear();
        self.out.push_back(RoundOut::Failed(why));
    }

    /// Time passed.
    pub fn handle_timeout(&mut self, now: Duration) {
        if self.deadline.is_none_or(|d| now < d) {
            return;
        }
        match self.phase {
            Phase::Gathering => self.maybe_start(now, true),
            Phase::AwaitStart => {
                self.withheld_by = self.leader;
                self.misled();
                self.fail("no start from the round's leader");
            }
            Phase::Exchanging if !self.owned_done => {
                self.maybe_reduce(now, true);
                self.maybe_finish(now);
                if self.phase == Phase::Exchanging {
                    self.deadline = Some(now + self.patience() / 2);
                }
            }
            Phase::Exchanging => self.start_filling(now),
            Phase::Filling => {
                let zeroed = (0..self.group.len())
                    .filter(|j| self.averaged[*j].is_none())
                    .map(|j| j as u32)
                    .collect();
                self.vote(zeroed, now);
            }
            Phase::Voting => self.decide(true),
            Phase::AwaitContribution | Phase::Done => self.deadline = None,
        }
    }
}

mod feedback;
mod filling;
mod reduce;
#[cfg(test)]
mod tests;
mod vote;
