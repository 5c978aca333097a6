//! The step coordinator: when a replica's stage takes its next step, and keeping its replicas
//! on the same parameters.
//!
//! It counts the samples committed toward the step being collected (here and, from their
//! progress reports, at the stage's other replicas), starts an averaging round when the
//! global batch is complete (allreduce) or after H local steps (DiLoCo), applies the round's
//! result, and schedules checkpoints. A replica that falls behind replays the rounds it missed
//! from another replica's record (a catch-up); one whose parameters are outvoted by the
//! stage's other replicas is told to download the state again.
//!
//! Its rules for the stage's liveness, each with a test below:
//! * settle: a replica that just started serving waits one announcement period before
//!   starting a round, so that replicas starting together have heard of each other;
//! * starving: a stage that lost samples of a step closes its round with what it has once
//!   the next step's microbatches wait at it and nothing arrived for the join window (two
//!   steps' time when a replica of the stage left or was banned lately; what it had
//!   reported collecting counts as lost, not as awaited);
//! * laggards: a stage more than a round ahead of another starts no new work (see
//!   [`Demand::ahead`]);
//! * catch-up and the hash vote (see [`agreement`](super::agreement)).

use super::PeerKey;
use super::agreement::{CatchUp, Resync};
use super::averaging::RoundOut;
use super::claims::ClaimCheck;
use super::config::{RunConfig, SyncMode, Timing};
use super::driver::Demand;
use super::interface::{Event, Job};
use super::membership::{Membership, Standing};
use super::message::{MemberState, Message, RoundKey, RoundMsg};
use super::outbox::Outbox;
use super::progress::StageProgress;
use super::rounds::Rounds;
use crate::Codec;
use std::collections::BTreeMap;
use std::time::Duration;

/// The run's settings the coordinator decides with.
#[derive(Clone, Debug)]
pub(super) struct Settings {
    /// This peer.
    pub me: PeerKey,
    /// How replicas keep together.
    pub sync: SyncMode,
    /// Samples per step over all replicas.
    pub global_batch: u32,
    /// Steps of the run.
    pub max_steps: u64,
    /// Parameters of each stage.
    pub params: Vec<usize>,
    /// The protocol's clocks.
    pub timing: Timing,
}

impl Settings {
    /// The settings of `config`.
    pub fn of(me: PeerKey, config: &RunConfig, params: Vec<usize>, timing: Timing) -> Self {
        Settings {
            me,
            sync: config.sync,
            global_batch: config.global_batch,
            max_steps: config.max_steps,
            params,
            timing,
        }
    }

    fn allreduce(&self) -> bool {
        self.sync == SyncMode::AllReduce
    }
}

/// Counters for reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct StepStats {
    /// Microbatches committed.
    pub microbatches: u64,
    /// Rounds completed.
    pub rounds: u64,
    /// Rounds that lost a member's share or a part.
    pub rounds_degraded: u64,
}

/// One replica's steps and rounds.
#[derive(Debug)]
pub(super) struct StepCoordinator {
    settings: Settings,
    checkpoint_every: Option<u64>,
    step: u64,
    round: u64,
    params_hash: Option<u64>,
    /// This stage took the run's last step.
    finished: bool,
    /// This replica downloaded its state from another replica and has not finished a round
    /// with others since: while its elders serve, it joins the rounds the settled replicas
    /// lead rather than leading (see [`StepCoordinator::newcomer`]).
    joined: bool,
    /// The replicas that served the stage when this replica set out to download it: while
    /// none of them serves any more, it is no newcomer (see [`StepCoordinator::newcomer`]).
    elders: Vec<PeerKey>,
    /// The state being downloaded is to join the stage, not to re-sync with it.
    joining: bool,
    /// A driver that joined its stage starts no microbatch before this, nor before its first
    /// round with others (see [`StepCoordinator::demand`]).
    drive_after: Option<Duration>,
    /// Samples committed toward the step being collected.
    accumulated: f64,
    /// Loss times samples, and samples, of the microbatches behind `accumulated` (last stage).
    losses: (f64, f64),
    last_loss: Option<f32>,
    /// When a sample was last committed here (or the last contribution was taken).
    last_collected: Duration,
    /// The other replicas' latest progress reports.
    progress: StageProgress,
    /// The samples the stage's replicas claim in their shares, checked against their
    /// witnesses' tallies.
    claims: ClaimCheck,
    /// Members whose credit is below [`super::claims::DISCOUNTED`], with the lowest credit
    /// told.
    discounted: BTreeMap<PeerKey, f64>,
    /// A DiLoCo local step is queued.
    local_step_queued: bool,
    /// A round's result (or a catch-up) is being applied.
    applying_round: bool,
    inner_steps: u32,
    samples_since_outer: f64,
    last_local_samples: f64,
    /// Members, samples and loss of the round being applied.
    round_group: usize,
    round_samples: f64,
    round_loss: Option<f64>,
    catch_up: CatchUp,
    /// The replica this one's state was downloaded from: it keeps the rounds since its
    /// snapshot, so catch-ups go to it first (another's record may have dropped them).
    state_source: Option<PeerKey>,
    /// When to look again at a stage that may be starving.
    starve_check: Option<Duration>,
    /// The round being collected when a replica of the stage that had reported progress
    /// left or was banned: it took work of that round and of the next with it (the starving
    /// rule then waits less).
    replica_lost_in: Option<u64>,
    /// When this replica last contributed to a round (allreduce), and the time between its
    /// contributions lately: how long a step of the stage takes.
    contributed_at: Option<Duration>,
    step_time: Option<Duration>,
    /// No round starts before this (see the module docs).
    settle_until: Option<Duration>,
    /// When to try again a round that failed for this replica (see
    /// [`StepCoordinator::drain_round`]).
    retry_at: Option<Duration>,
    rounds: Rounds,
    stats: StepStats,
}

impl StepCoordinator {
    /// A replica with no stage yet; rounds encode with `codec`.
    pub fn new(settings: Settings, codec: Codec, now: Duration) -> Self {
        StepCoordinator {
            rounds: Rounds::new(
                settings.me,
                codec,
                settings.sync.feedback_decay(),
                settings.timing,
            ),
            settings,
            checkpoint_every: None,
            step: 0,
            round: 0,
            params_hash: None,
            state_source: None,
            finished: false,
            joined: false,
            elders: Vec::new(),
            joining: false,
            drive_after: None,
            accumulated: 0.0,
            losses: (0.0, 0.0),
            last_loss: None,
            last_collected: now,
            progress: StageProgress::default(),
            claims: ClaimCheck::default(),
            discounted: BTreeMap::new(),
            local_step_queued: false,
            applying_round: false,
            inner_steps: 0,
            samples_since_outer: 0.0,
            last_local_samples: 0.0,
            round_group: 1,
            round_samples: 0.0,
            round_loss: None,
            catch_up: CatchUp::default(),
            starve_check: None,
            replica_lost_in: None,
            contributed_at: None,
            step_time: None,
            settle_until: None,
            retry_at: None,
            stats: StepStats::default(),
        }
    }

    /// Writes a checkpoint every `steps` steps.
    pub fn set_checkpoint_every(&mut self, steps: Option<u64>) {
        self.checkpoint_every = steps.filter(|s| *s > 0);
    }

    /// Steps taken.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Rounds completed.
    pub fn round(&self) -> u64 {
        self.round
    }

    /// Seconds per byte of encoded round values on this replica's uplink, as measured: how
    /// long its next contribution's round, and a catch-up it asks for, wait for values to
    /// move.
    pub fn set_upload_pace(&mut self, secs_per_byte: f64) {
        self.rounds.upload_pace = Some(secs_per_byte);
    }

    /// Scripted misbehaviour (see [`super::attack`]): whether this replica's rounds negate
    /// the part it owns, and leave the others out when it leads; `attacking`: it attacks now
    /// (it never doubts its own share).
    pub fn misbehave(&mut self, forge_parts: bool, exclude_others: bool, attacking: bool) {
        self.rounds.forge_parts = forge_parts;
        self.rounds.exclude_others = exclude_others;
        self.rounds.attacking = attacking;
    }

    /// Parameter hash right after the last round.
    pub fn params_hash(&self) -> Option<u64> {
        self.params_hash
    }

    /// Whether this stage took the run's last step.
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// Mean loss of the last step (last stage).
    pub fn last_loss(&self) -> Option<f32> {
        self.last_loss
    }

    /// Counters.
    pub fn stats(&self) -> StepStats {
        self.stats
    }

    /// Whether an averaging round is under way or being applied.
    pub fn in_round(&self) -> bool {
        self.rounds.active()
    }

    /// The earliest of the coordinator's deadlines.
    pub fn next_timeout(&self) -> Option<Duration> {
        [
            self.rounds.deadline(),
            self.catch_up.deadline(),
            self.starve_check,
            self.settle_until,
            self.retry_at,
            self.drive_after,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// The stage state to serve: `step` and `round` from a transfer or a checkpoint.
    /// `joined`: the state was downloaded from another replica.
    pub fn set_position(&mut self, step: u64, round: u64, joined: bool) {
        self.step = step;
        self.round = round;
        self.joined = joined;
    }

    /// Who may lead this replica's rounds of `stage` and who is waited for in them; tells the
    /// rounds whether this replica is new to its stage.
    ///
    /// Where no replica has worked with this one yet, the replicas that do not announce
    /// themselves newcomers may lead (every replica at the start of the run; a replica that
    /// served alone, whom the newcomers join): a newcomer follows the first of them in rank
    /// order, the leader they follow among themselves. (Following only the replicas that
    /// served when it set out to download left a newcomer out for good once joiners that
    /// came with it had become leaders.)
    fn round_members(&mut self, stage: u32, members: &Membership) -> (Vec<PeerKey>, Vec<PeerKey>) {
        let newcomer = self.newcomer(Some(stage), members);
        self.rounds.newcomer = newcomer;
        let mut leaders = members.leaders(stage);
        if leaders.is_empty() {
            leaders = members.settled(stage);
        }
        // A replica that announces a later round finished this one elsewhere (it ran it
        // without this replica): it will neither lead this round nor join it. Nor will one
        // two rounds behind or more (cut off by a partition, it went on with other replicas
        // or stalled): it has rounds to catch up with first, and waiting for it would hold
        // the stage for a round timeout. One round behind is normal (announcements lag the
        // round that just ended).
        let round = self.round;
        let in_reach = |ks: Vec<PeerKey>| -> Vec<PeerKey> {
            ks.into_iter()
                .filter(|k| {
                    members.get(*k).is_none_or(|m| {
                        m.announcement.round <= round && m.announcement.round + 1 >= round
                    })
                })
                .collect()
        };
        (in_reach(leaders), in_reach(members.workers(stage)))
    }

    /// Whether this replica of `stage` is new to it: it took its state from another replica
    /// and has not finished a round with others since (a replica that re-synced has worked
    /// with its stage before). One whose elders are all gone is one like the others, or
    /// newcomers alone would wait for each other to lead.
    pub fn newcomer(&self, stage: Option<u32>, members: &Membership) -> bool {
        let Some(stage) = stage else { return false };
        self.joined
            && !members.any_worked(stage)
            && members
                .replicas(stage)
                .iter()
                .any(|k| self.elders.contains(k))
    }

    /// Whether this driver joined its stage so lately that it should start nothing yet: until
    /// its first round with the replicas that were there it does not know how far their step
    /// is (their progress reaches it once they count it a replica), and samples it starts for
    /// a step they are closing are counted toward that step downstream and toward the next
    /// one here, which then waits a join window for samples that never come. The replicas
    /// there deal it no part of the step meanwhile (they have not checked its work). Not after
    /// a re-sync (its stage-mates count on its part) and for one join window at most (a
    /// rejoining driver they still count on would otherwise hold the step for good).
    fn settling_in(&self, members: &Membership, now: Duration) -> bool {
        self.drive_after.is_some_and(|t| now < t) && self.newcomer(Some(0), members)
    }

    /// This replica sets out to download its stage's state while `elders` serve it, to join
    /// the stage or (`resync`) to take the state of replicas it served with.
    pub fn set_elders(&mut self, elders: Vec<PeerKey>, resync: bool) {
        self.elders = elders;
        self.joining = !resync;
    }

    /// The replica starts serving with parameters hashing to `hash` (None: not comparable,
    /// e.g. DiLoCo parameters in the middle of a round). It waits to settle until `settle`.
    pub fn start_serving(&mut self, hash: Option<u64>, source: Option<PeerKey>, settle: Duration) {
        self.settle_until = Some(settle);
        self.drive_after =
            (self.joined && self.joining).then_some(settle + self.settings.timing.join_window);
        self.state_source = source;
        self.params_hash = hash;
        self.inner_steps = 0;
        self.samples_since_outer = 0.0;
        self.finished = self.stage_finished();
    }

    /// Whether this replica's stage took the run's last step. In DiLoCo that is the last
    /// outer round (replicas count their inner steps independently; rounds they share).
    fn stage_finished(&self) -> bool {
        match self.settings.sync {
            SyncMode::AllReduce => self.round >= self.settings.max_steps,
            SyncMode::DiLoCo { h, .. } => {
                self.round >= self.settings.max_steps.div_ceil(u64::from(h))
            }
        }
    }

    /// The averaging round a microbatch committed now counts in (what a driver or a hop
    /// tallies it toward, see [`super::claims`]): the round being collected (allreduce), the
    /// outer round under way (DiLoCo, where microbatches are started for local steps).
    pub fn claim_round(&self) -> u64 {
        match self.settings.sync {
            SyncMode::AllReduce => self.collecting_round(),
            SyncMode::DiLoCo { .. } => self.round,
        }
    }

    /// The round new commits count toward: the next one once this replica's contribution to
    /// the current round is taken (allreduce); the local step in DiLoCo.
    pub fn collecting_round(&self) -> u64 {
        match self.settings.sync {
            SyncMode::AllReduce if self.rounds.contributed() => self.round + 1,
            SyncMode::AllReduce => self.round,
            SyncMode::DiLoCo { .. } => self.step,
        }
    }

    /// The rounds completed by the least advanced stage, each stage counted at its most
    /// advanced serving replica (this replica's own round is a bound too). A whole stage
    /// behind holds the run; a single replica behind catches up on its own, and an identity
    /// that announces an old round (one banned by its stage, or lying) holds nobody back.
    fn slowest_stage_round(&self, members: &Membership) -> u64 {
        let mut furthest: BTreeMap<u32, u64> = BTreeMap::new();
        for (_, m) in members.iter() {
            if let (MemberState::Serving, Some(stage)) =
                (&m.announcement.state, m.announcement.stage)
            {
                let r = furthest.entry(stage).or_insert(0);
                *r = (*r).max(m.announcement.round);
            }
        }
        furthest.into_values().fold(self.round, u64::min)
    }

    /// The fewest rounds any serving peer (this one included) has completed.
    fn slowest_replica_round(&self, members: &Membership) -> u64 {
        members
            .iter()
            .filter(|(_, m)| m.announcement.state == MemberState::Serving)
            .map(|(_, m)| m.announcement.round)
            .fold(self.round, u64::min)
    }

    /// What the step being collected needs from this replica as a data driver of stage 0,
    /// whose part of the step is `share` samples and which has `commits_queued` samples in
    /// queued commit jobs.
    pub fn demand(
        &self,
        members: &Membership,
        share: f64,
        commits_queued: f64,
        now: Duration,
    ) -> Demand {
        let allreduce = self.settings.allreduce();
        let round = self.collecting_round();
        let batch = f64::from(self.settings.global_batch);
        // Laggards: in synchronous training a stage more than a round behind holds the
        // others; starting more work only queues it there.
        let lagging = allreduce
            .then(|| self.slowest_stage_round(members))
            .filter(|slowest| slowest.saturating_add(1) < self.round);
        let drivers = members.vouched_replicas(0);
        let (quota, others) = if allreduce {
            (batch, Some(self.progress.reported(&drivers, round, true)))
        } else {
            ((batch / (drivers.len() + 1) as f64).max(1.0), None)
        };
        Demand {
            round,
            quota,
            share,
            committed: self.accumulated + commits_queued,
            others,
            blocked: self.local_step_queued
                || (allreduce
                    && (self.rounds.contributed()
                        || self.applying_round
                        || self.settling_in(members, now))),
            // At the end of the run every replica still behind is fed, down to the slowest.
            ahead: if self.finished {
                Some(self.slowest_replica_round(members))
            } else {
                lagging
            },
        }
    }

    /// Tells the stage's other replicas how far this one is toward the next round
    /// (`in_flight`: samples this driver has started and not yet committed).
    pub fn send_progress(
        &self,
        out: &mut Outbox,
        stage: u32,
        members: &Membership,
        in_flight: f64,
    ) {
        let msg = Message::Progress {
            stage,
            round: self.collecting_round(),
            samples: self.accumulated,
            in_flight,
        };
        for k in members.replicas(stage) {
            out.send(k, msg.clone());
        }
    }

    /// A progress report of `from` about a round of its stage (see
    /// [`StageProgress::update`]). Returns whether it was taken.
    pub fn on_progress(&mut self, from: PeerKey, round: u64, samples: f64, in_flight: f64) -> bool {
        self.progress.update(from, round, samples, in_flight)
    }

    /// A replica is gone: its progress no longer counts.
    pub fn forget(&mut self, peer: PeerKey, now: Duration) {
        self.claims.forget(peer);
        if self.progress.forget(peer) {
            self.replica_lost_in = Some(self.round);
        }
        self.rounds.member_gone(peer, now);
    }

    /// `peer` is banned for the rest of the run: no round waits for it again.
    pub fn banned(&mut self, peer: PeerKey, now: Duration) {
        self.rounds.banned(peer, now);
    }

    /// A microbatch of `rows` samples (with its loss, last stage) was committed here.
    pub fn on_committed(&mut self, rows: u32, loss: Option<f32>, now: Duration) {
        self.stats.microbatches += 1;
        self.accumulated += f64::from(rows);
        self.last_collected = now;
        if let Some(l) = loss {
            self.losses.0 += f64::from(l) * f64::from(rows);
            self.losses.1 += f64::from(rows);
        }
    }

    /// Starts the next round if the step is complete, or the next local step (DiLoCo).
    /// `stage` is the stage served (None: not serving); `next_waiting` is when the first
    /// microbatch of a later step came to wait at this replica, if one waits.
    pub fn maybe_begin_round(
        &mut self,
        out: &mut Outbox,
        stage: Option<u32>,
        members: &Membership,
        next_waiting: Option<Duration>,
        now: Duration,
    ) {
        let Some(stage) = stage else { return };
        if self.rounds.active() || self.finished {
            return;
        }
        match self.settle_until {
            Some(t) if now < t => return,
            Some(_) => self.settle_until = None,
            None => {}
        }
        // Behind a replica of this stage: its round is over, so catch up instead of starting
        // a round nobody else will join.
        if let Some(ahead) = self.replica_ahead(stage, members, now) {
            self.catch_up_with(out, stage, members, ahead, now);
            return;
        }
        let key = RoundKey {
            stage,
            index: self.round,
        };
        let len = self.params(stage);
        let (leaders, replicas) = self.round_members(stage, members);
        if self.rounds.follow_early_invitation(key, &leaders, len, now) {
            return;
        }
        match self.settings.sync {
            SyncMode::AllReduce => {
                if self.step_collected(stage, members, &replicas, next_waiting, now) {
                    self.rounds.begin(key, &leaders, &replicas, len, now);
                }
            }
            SyncMode::DiLoCo { h, .. } => {
                let local_batch =
                    f64::from(self.settings.global_batch) / (replicas.len() + 1) as f64;
                if !self.local_step_queued && self.accumulated >= local_batch.max(1.0) {
                    self.local_step_queued = true;
                    self.last_local_samples = self.accumulated;
                    self.samples_since_outer += self.accumulated;
                    self.accumulated = 0.0;
                    out.compute(Job::LocalStep);
                }
                if self.inner_steps >= h {
                    self.rounds.begin(key, &leaders, &replicas, len, now);
                }
            }
        }
    }

    fn params(&self, stage: u32) -> usize {
        self.settings
            .params
            .get(stage as usize)
            .copied()
            .unwrap_or(0)
    }

    /// Time passed: the round's deadlines, the starving and settling checks, and an
    /// unanswered catch-up (the replica then downloads the state instead).
    pub fn handle_timeout(
        &mut self,
        out: &mut Outbox,
        stage: Option<u32>,
        members: &Membership,
        next_waiting: Option<Duration>,
        now: Duration,
    ) -> Option<Resync> {
        self.rounds.handle_timeout(now);
        if self.starve_check.is_some_and(|t| now >= t) {
            self.starve_check = None;
            self.maybe_begin_round(out, stage, members, next_waiting, now);
        }
        if self.settle_until.is_some_and(|t| now >= t) {
            self.maybe_begin_round(out, stage, members, next_waiting, now);
            self.settle_until = None;
        }
        if self.retry_at.is_some_and(|t| now >= t) {
            self.retry_at = None;
            self.maybe_begin_round(out, stage, members, next_waiting, now);
        }
        if self.drive_after.is_some_and(|t| now >= t) {
            self.drive_after = None;
        }
        self.catch_up.expire(now)
    }

    /// The job that applies a round's averaged vector.
    fn apply(&self, avg: Vec<f32>) -> Job {
        match self.settings.sync {
            SyncMode::AllReduce => Job::Step { grad: avg },
            SyncMode::DiLoCo {
                outer_lr,
                outer_momentum,
                ..
            } => Job::OuterStep {
                avg,
                lr: outer_lr,
                momentum: outer_momentum,
            },
        }
    }

    /// A round message of this replica's stage (see [`Rounds::on_message`]).
    #[allow(clippy::too_many_arguments)]
    pub fn on_round(
        &mut self,
        out: &mut Outbox,
        members: &Membership,
        from: PeerKey,
        key: RoundKey,
        msg: RoundMsg,
        now: Duration,
    ) {
        // Rounds are among a stage's replicas: a message from a peer that neither serves the
        // stage nor is a member of the round it is about changes nothing.
        let standing = members.standing(from, key.stage);
        if standing != Standing::Replica && !self.rounds.has_member(key, from) {
            if standing == Standing::NotAReplica {
                out.violation(from, "a round message from a peer that serves no stage");
            }
            return;
        }
        let len = self.params(key.stage);
        let (leaders, replicas) = self.round_members(key.stage, members);
        self.rounds.on_message(
            out,
            from,
            key,
            msg,
            self.round,
            self.finished,
            (leaders, replicas),
            len,
            now,
        );
    }

    /// Carries out what the current round wants: its messages, the request for this
    /// replica's contribution, and applying its result. A round of `stage` whose leader left
    /// the stage before starting it fails now.
    ///
    /// Failed-round retry: a replica whose round failed looks at it again one announcement
    /// period later, by which it has heard whether the others finished that round (then it
    /// catches up) or not (then it starts the round again among the replicas still there);
    /// at once when other replicas joined it as their leader while it followed another (they
    /// have not finished the round: they wait for its start).
    /// Without this, a replica whose batch is complete waits for a trigger that never comes:
    /// no more samples arrive for it.
    pub fn drain_round(
        &mut self,
        out: &mut Outbox,
        stage: Option<u32>,
        members: &Membership,
        now: Duration,
    ) {
        if let Some(key) = stage.and_then(|s| self.rounds.leader_gone(s, members)) {
            out.event(Event::RoundFailed {
                round: key.index,
                reason: "the round's leader left the stage",
            });
            self.retry_failed(key, now);
            return;
        }
        while let Some((key, o)) = self.rounds.poll() {
            match o {
                RoundOut::Send(to, msg) => out.send(to, Message::Round { key, msg }),
                RoundOut::NeedContribution => out.compute(match self.settings.sync {
                    SyncMode::AllReduce => Job::TakeGradient,
                    SyncMode::DiLoCo { .. } => Job::TakePseudoGradient,
                }),
                RoundOut::Finished(result) => {
                    if !result.left_out.is_empty()
                        || !result.zeroed.is_empty()
                        || !result.refused.is_empty()
                    {
                        self.stats.rounds_degraded += 1;
                        out.event(Event::RoundDegraded {
                            round: key.index,
                            left_out: result.left_out.len(),
                            zeroed: result.zeroed.len(),
                            refused: result.refused.len(),
                        });
                    }
                    self.stats.rounds += 1;
                    if result.group.len() > 1 {
                        self.joined = false;
                    }
                    out.evidence.extend_from_slice(&result.evidence);
                    self.check_claims(out, key, &result.claims);
                    out.finished_groups.push((key.stage, result.group.clone()));
                    self.round_group = result.group.len();
                    self.round_samples = result.samples;
                    self.round_loss = result.loss;
                    self.catch_up.remember(
                        key.index,
                        &result.averaged,
                        &result.parts,
                        result.samples,
                    );
                    out.compute(self.apply(result.averaged));
                    self.applying_round = true;
                }
                RoundOut::Violation(from, what) => out.violation(from, what),
                RoundOut::Evidence(e) => out.evidence.push(e),
                RoundOut::Failed(reason) => {
                    out.event(Event::RoundFailed {
                        round: key.index,
                        reason,
                    });
                    self.rounds.fail();
                    self.retry_failed(key, now);
                    return;
                }
            }
        }
    }

    /// Schedules the retry of failed round `key` (see [`StepCoordinator::drain_round`]).
    fn retry_failed(&mut self, key: RoundKey, now: Duration) {
        let later = now + self.settings.timing.announce_every;
        self.retry_at = Some(if self.rounds.awaited(key) { now } else { later });
    }

    /// This replica's contribution to the round is computed: the sum of its gradients over
    /// `samples` (allreduce), or its pseudo-gradient (DiLoCo), weighted here by the samples
    /// behind it. Returns whether the samples collected were handed over (allreduce): the
    /// other replicas should hear of it.
    /// `claim` multiplies the samples the contribution claims (1 but for a scripted attacker,
    /// see [`super::attack`]).
    pub fn on_gradient(
        &mut self,
        values: Vec<f32>,
        samples: f64,
        claim: f64,
        now: Duration,
    ) -> bool {
        if !self.rounds.active() {
            return false;
        }
        match self.settings.sync {
            SyncMode::AllReduce => {
                self.note_step_time(now);
                self.accumulated = 0.0;
                self.last_collected = now;
                let loss = (self.losses.1 > 0.0).then_some(self.losses.0);
                self.losses = (0.0, 0.0);
                self.rounds.contribute(values, samples * claim, loss, now);
                true
            }
            SyncMode::DiLoCo { .. } => {
                let w = self.samples_since_outer as f32;
                let scaled: Vec<f32> = values.iter().map(|v| v * w).collect();
                let samples = self.samples_since_outer * claim;
                self.rounds.contribute(scaled, samples, None, now);
                false
            }
        }
    }

    /// A step was taken; the parameters now hash to `hash`. Closes the round it applied,
    /// reports the step, and queues a checkpoint on the schedule. Returns whether a round
    /// closed.
    pub fn on_stepped(&mut self, out: &mut Outbox, hash: u64, last_stage: bool) -> bool {
        let from_round = std::mem::take(&mut self.applying_round);
        let mut group = 1;
        let closed = match self.settings.sync {
            SyncMode::AllReduce => {
                self.step += 1;
                self.round += 1;
                true
            }
            SyncMode::DiLoCo { .. } if from_round => {
                self.round += 1;
                self.inner_steps = 0;
                self.samples_since_outer = 0.0;
                true
            }
            SyncMode::DiLoCo { .. } => {
                self.step += 1;
                self.inner_steps += 1;
                self.local_step_queued = false;
                false
            }
        };
        if closed {
            group = self.round_group;
            self.params_hash = Some(hash);
            self.rounds.finish();
        }
        let loss = match self.settings.sync {
            SyncMode::AllReduce => self.round_loss.take().map(|l| l as f32),
            SyncMode::DiLoCo { .. } if !from_round => {
                let (sum, n) = std::mem::take(&mut self.losses);
                (n > 0.0).then(|| (sum / n) as f32)
            }
            SyncMode::DiLoCo { .. } => None,
        };
        if last_stage && loss.is_some() {
            self.last_loss = loss;
        }
        let samples = if group > 1 || from_round || self.settings.allreduce() {
            self.round_samples
        } else {
            self.last_local_samples
        };
        out.event(Event::Stepped {
            step: self.step,
            loss,
            group,
            samples,
            hash,
        });
        self.finished = self.stage_finished();
        if let Some(every) = self.checkpoint_every {
            // A DiLoCo replica's state is comparable with its replicas' only after a round.
            let boundary = self.settings.allreduce() || from_round;
            if boundary && (self.step.is_multiple_of(every) || self.finished) {
                out.compute(Job::Checkpoint {
                    step: self.step,
                    round: self.round,
                });
            }
        }
        closed
    }

    /// Forgets everything about the stage served (it is being replaced): records of its
    /// rounds must not answer for the next one.
    pub fn abandon(&mut self, out: &mut Outbox) {
        self.catch_up.abandon();
        self.state_source = None;
        self.retry_at = None;
        self.applying_round = false;
        self.last_loss = None;
        if let Some(key) = self.rounds.abandon() {
            out.event(Event::RoundFailed {
                round: key.index,
                reason: "left the stage",
            });
        }
        self.local_step_queued = false;
        self.progress.clear();
        self.accumulated = 0.0;
        self.losses = (0.0, 0.0);
    }
}

mod catching_up;
mod claims;
mod collecting;
#[cfg(test)]
mod tests;
