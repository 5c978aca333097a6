//! Unit tests of the step coordinator, each rule fed alone.

use super::*;
use crate::swarm::fixtures::{self, at_round, sends};
use crate::swarm::message::{Announcement, MemberState};

const MS: Duration = Duration::from_millis(1);
const ME: PeerKey = PeerKey(5);

fn timing() -> Timing {
    Timing {
        announce_every: 50 * MS,
        join_window: 100 * MS,
        round_timeout: 300 * MS,
        ..Timing::default()
    }
}

fn settings(sync: SyncMode) -> Settings {
    Settings {
        me: ME,
        sync,
        global_batch: 8,
        max_steps: 10,
        params: vec![4; 3],
        timing: timing(),
    }
}

fn serving(sync: SyncMode) -> StepCoordinator {
    let mut c = StepCoordinator::new(settings(sync), Codec::Fp32, Duration::ZERO);
    c.start_serving(Some(7), None, Duration::ZERO);
    c.settle_until = None;
    c
}

fn announcement(stage: u32, round: u64, hash: Option<u64>) -> Announcement {
    at_round(stage, round, hash)
}

fn members(list: &[(u64, u32, u64, Option<u64>)]) -> Membership {
    fixtures::members(list.iter().map(|&(k, s, r, h)| (k, at_round(s, r, h))))
}

fn commit(c: &mut StepCoordinator, rows: u32) {
    c.on_committed(rows, None, Duration::ZERO);
}

#[test]
fn a_round_starts_when_the_stage_holds_the_global_batch() {
    let m = members(&[(9, 1, 0, None)]);
    let mut out = Outbox::new(ME);
    let mut c = serving(SyncMode::AllReduce);
    commit(&mut c, 4);
    c.maybe_begin_round(&mut out, Some(1), &m, None, MS);
    assert!(!c.in_round(), "4 of 8 samples");
    // The other replica reports 4: the stage has the batch; the smaller key leads.
    assert!(c.on_progress(PeerKey(9), 0, 4.0, 0.0));
    c.maybe_begin_round(&mut out, Some(1), &m, None, MS);
    assert!(c.in_round());
    c.drain_round(&mut out, Some(1), &m, MS);
    assert_eq!(
        sends(&mut out),
        [(
            PeerKey(9),
            Message::Round {
                key: RoundKey { stage: 1, index: 0 },
                msg: RoundMsg::Join
            }
        )],
        "5 leads, inviting 9"
    );
    // Not serving: nothing.
    let mut c = serving(SyncMode::AllReduce);
    commit(&mut c, 8);
    c.maybe_begin_round(&mut out, None, &m, None, MS);
    assert!(!c.in_round());
}

/// Failed-round retry: a round whose leader left the stage before starting it fails at once,
/// and one announcement period later the replica starts the round again among the replicas
/// still there (its samples are still here).
#[test]
fn a_round_whose_leader_left_is_started_again_without_it() {
    let with_leader = members(&[(3, 1, 0, None)]);
    let mut out = Outbox::new(ME);
    let mut c = serving(SyncMode::AllReduce);
    commit(&mut c, 8);
    c.maybe_begin_round(&mut out, Some(1), &with_leader, None, MS);
    c.drain_round(&mut out, Some(1), &with_leader, MS);
    assert!(c.in_round(), "following 3");
    let moved = members(&[(3, 2, 0, None)]);
    c.drain_round(&mut out, Some(1), &moved, 2 * MS);
    assert!(!c.in_round(), "the round failed");
    let retry = 2 * MS + timing().announce_every;
    assert_eq!(c.next_timeout(), Some(retry));
    assert_eq!(
        c.handle_timeout(&mut out, Some(1), &moved, None, retry),
        None
    );
    assert!(c.in_round(), "alone now, it leads");
    c.drain_round(&mut out, Some(1), &moved, retry);
    assert_eq!(out.jobs.next(MS), Some(Job::TakeGradient));
}

#[test]
fn a_replica_that_just_started_serving_settles_before_starting_a_round() {
    let m = members(&[]);
    let mut out = Outbox::new(ME);
    let mut c = StepCoordinator::new(settings(SyncMode::AllReduce), Codec::Fp32, Duration::ZERO);
    c.start_serving(Some(7), None, 50 * MS);
    commit(&mut c, 8);
    c.maybe_begin_round(&mut out, Some(1), &m, None, 10 * MS);
    assert!(!c.in_round());
    assert_eq!(c.next_timeout(), Some(50 * MS));
    assert_eq!(c.handle_timeout(&mut out, Some(1), &m, None, 50 * MS), None);
    assert!(c.in_round(), "the settle timer starts the round");
}

#[test]
fn a_starving_stage_closes_its_round_with_what_it_has() {
    let m = members(&[]);
    let mut out = Outbox::new(ME);
    let mut c = serving(SyncMode::AllReduce);
    commit(&mut c, 4);
    // No evidence that samples were lost: wait for the rest of the batch.
    c.maybe_begin_round(&mut out, Some(1), &m, None, Duration::from_secs(5));
    assert!(!c.in_round());
    assert_eq!(c.next_timeout(), None);
    // A microbatch of the next step waits here since 1 s: the round closes once a join
    // window has passed with nothing new.
    let waiting = Some(Duration::from_secs(1));
    c.maybe_begin_round(&mut out, Some(1), &m, waiting, Duration::from_secs(1));
    assert!(!c.in_round());
    let check = Duration::from_secs(1) + timing().join_window;
    assert_eq!(c.next_timeout(), Some(check));
    c.handle_timeout(&mut out, Some(1), &m, waiting, check);
    assert!(c.in_round());
    // Another stage two rounds ahead is evidence too, once this stage has samples.
    let ahead = members(&[(9, 2, 2, None)]);
    let mut c = serving(SyncMode::AllReduce);
    c.maybe_begin_round(&mut out, Some(1), &ahead, None, Duration::from_secs(5));
    assert!(!c.in_round(), "nothing to close the round with");
    commit(&mut c, 2);
    c.maybe_begin_round(&mut out, Some(1), &ahead, None, Duration::from_secs(5));
    assert!(c.in_round());
}

/// A replica of a later stage that is gone (banned, left) took what it had collected of the
/// step: the drivers committed those samples, so the stage counts them as lost rather than
/// waiting for them; and what it had of the step's work in flight, while the next step's
/// microbatches wait here, closes the round after two steps' time, not a join window.
#[test]
fn a_stage_that_lost_a_replica_does_not_wait_for_its_samples() {
    let m = members(&[(8, 1, 0, None), (9, 1, 0, None)]);
    let mut out = Outbox::new(ME);
    let mut c = serving(SyncMode::AllReduce);
    commit(&mut c, 4);
    assert!(c.on_progress(PeerKey(8), 0, 2.0, 0.0));
    assert!(c.on_progress(PeerKey(9), 0, 1.0, 0.0));
    c.maybe_begin_round(&mut out, Some(1), &m, None, MS);
    assert!(!c.in_round(), "7 of 8 samples");
    c.forget(PeerKey(9), MS);
    let m = members(&[(8, 1, 0, None)]);
    c.maybe_begin_round(&mut out, Some(1), &m, None, MS);
    assert!(!c.in_round(), "still 7 of 8: 1 here, 1 lost");
    assert!(c.on_progress(PeerKey(8), 0, 3.0, 0.0));
    c.maybe_begin_round(&mut out, Some(1), &m, None, MS);
    assert!(c.in_round(), "8 of 8, 1 of them lost");

    let mut c = serving(SyncMode::AllReduce);
    c.step_time = Some(10 * MS);
    commit(&mut c, 4);
    let waiting = Some(Duration::from_secs(1));
    c.maybe_begin_round(&mut out, Some(1), &m, waiting, Duration::from_secs(1));
    assert_eq!(
        c.next_timeout(),
        Some(Duration::from_secs(1) + timing().join_window)
    );
    assert!(c.on_progress(PeerKey(8), 0, 1.0, 0.0));
    c.forget(PeerKey(8), Duration::from_secs(1));
    c.maybe_begin_round(&mut out, Some(1), &m, waiting, Duration::from_secs(1));
    assert!(!c.in_round());
    let check = Duration::from_secs(1) + 20 * MS;
    assert_eq!(c.next_timeout(), Some(check));
    c.handle_timeout(&mut out, Some(1), &m, waiting, check);
    assert!(c.in_round());
}

#[test]
fn a_replica_behind_catches_up_from_the_replica_ahead_and_downloads_if_it_cannot() {
    let m = members(&[(9, 1, 1, Some(3))]);
    let mut out = Outbox::new(ME);
    let mut c = serving(SyncMode::AllReduce);
    let a = announcement(1, 1, Some(3));
    assert_eq!(
        c.on_replica_announced(&mut out, 1, &m, PeerKey(9), &a, MS),
        None
    );
    let request = Message::CatchUpRequest { stage: 1, round: 0 };
    assert_eq!(sends(&mut out), [(PeerKey(9), request)]);
    // The replica ahead answers from its record.
    let mut ahead = serving(SyncMode::AllReduce);
    ahead.catch_up.remember(0, &[0.5; 4], &[None], 8.0);
    let mut theirs = Outbox::new(PeerKey(9));
    ahead.answer_catch_up(&mut theirs, ME, 1, 0);
    let Some((_, Message::CatchUp { data, samples, .. })) = sends(&mut theirs).pop() else {
        panic!("an answer");
    };
    // An answer nobody asked for is ignored; the one asked for is applied as a step.
    assert_eq!(
        c.on_catch_up(&mut out, PeerKey(8), Some(1), 1, 0, samples, &data),
        None
    );
    assert_eq!(
        c.on_catch_up(&mut out, PeerKey(9), Some(1), 1, 0, samples, &data),
        None
    );
    assert_eq!(out.jobs.next(MS), Some(Job::Step { grad: vec![0.5; 4] }));
    // A replica that no longer has the round answers empty: download the state.
    let mut c = serving(SyncMode::AllReduce);
    c.on_replica_announced(&mut out, 1, &m, PeerKey(9), &a, MS);
    let resync = c.on_catch_up(&mut out, PeerKey(9), Some(1), 1, 0, 0.0, &[]);
    assert_eq!(resync.map(|r| r.from), Some(PeerKey(9)));
    // So does a replica that gets no answer.
    let mut c = serving(SyncMode::AllReduce);
    c.on_replica_announced(&mut out, 1, &m, PeerKey(9), &a, MS);
    let deadline = MS + timing().round_timeout;
    assert_eq!(c.next_timeout(), Some(deadline));
    let resync = c.handle_timeout(&mut out, Some(1), &m, None, deadline);
    assert_eq!(resync.map(|r| r.from), Some(PeerKey(9)));
}

/// After a download, the rounds missed meanwhile are asked of the replica the state came
/// from (it keeps them while its snapshot is held), not of whichever replica ahead announces
/// first; once that replica is gone, of any.
#[test]
fn a_replica_that_downloaded_catches_up_from_its_source() {
    let m = members(&[(9, 1, 3, Some(3)), (8, 1, 3, Some(3))]);
    let mut out = Outbox::new(ME);
    let mut c = serving(SyncMode::AllReduce);
    c.start_serving(Some(7), Some(PeerKey(8)), Duration::ZERO);
    c.settle_until = None;
    let a = announcement(1, 3, Some(3));
    c.on_replica_announced(&mut out, 1, &m, PeerKey(9), &a, MS);
    assert!(
        sends(&mut out).is_empty(),
        "9 is not where the state came from"
    );
    c.on_replica_announced(&mut out, 1, &m, PeerKey(8), &a, MS);
    let request = Message::CatchUpRequest { stage: 1, round: 0 };
    assert_eq!(sends(&mut out), [(PeerKey(8), request.clone())]);
    let gone = members(&[(9, 1, 3, Some(3))]);
    let mut c = serving(SyncMode::AllReduce);
    c.start_serving(Some(7), Some(PeerKey(8)), Duration::ZERO);
    c.settle_until = None;
    c.on_replica_announced(&mut out, 1, &gone, PeerKey(9), &a, MS);
    assert_eq!(sends(&mut out), [(PeerKey(9), request)]);
}

/// A replica left behind with the replicas it checked (a partition cut them off, and the run's
/// work went on with the others) catches up from a replica ahead it never checked, once no
/// work has come for longer than a round may take; not before, and not while a replica it
/// checked is ahead (it asks that one).
#[test]
fn a_stranded_replica_catches_up_from_a_replica_it_never_checked() {
    let mut m = members(&[(9, 1, 20, Some(3)), (4, 1, 0, Some(7))]);
    m.set_checked(PeerKey(4), true, true);
    let mut out = Outbox::new(ME);
    let mut c = serving(SyncMode::AllReduce);
    let a = announcement(1, 20, Some(3));
    let soon = timing().round_timeout;
    c.on_replica_announced(&mut out, 1, &m, PeerKey(9), &a, soon);
    assert_eq!(
        sends(&mut out),
        [],
        "idle for no longer than a round may take"
    );
    let later = soon + MS;
    c.on_replica_announced(&mut out, 1, &m, PeerKey(9), &a, later);
    let request = Message::CatchUpRequest { stage: 1, round: 0 };
    assert_eq!(sends(&mut out), [(PeerKey(9), request.clone())]);
    // A checked replica ahead is asked instead, and an unchecked one is not followed.
    let mut m = members(&[(9, 1, 20, Some(3)), (4, 1, 2, Some(7))]);
    m.set_checked(PeerKey(4), true, true);
    let mut c = serving(SyncMode::AllReduce);
    c.on_replica_announced(&mut out, 1, &m, PeerKey(9), &a, later);
    assert_eq!(sends(&mut out), []);
    c.on_replica_announced(
        &mut out,
        1,
        &m,
        PeerKey(4),
        &announcement(1, 2, Some(7)),
        later,
    );
    assert_eq!(sends(&mut out), [(PeerKey(4), request)]);
}

/// A driver that joined its stage starts no microbatch before its first round with the
/// replicas that were there (it cannot tell how far their step is), nor for a join window
/// after it serves; one that re-synced goes on at once (its stage-mates count on its part), as
/// does one whose elders are all gone (nobody else would drive).
#[test]
fn a_joined_driver_starts_nothing_before_its_first_round_with_the_stage() {
    let joined = |resync: bool| {
        let mut c = serving(SyncMode::AllReduce);
        c.set_elders(vec![PeerKey(9)], resync);
        c.set_position(3, 3, true);
        c.start_serving(Some(7), Some(PeerKey(9)), MS);
        c
    };
    let elder = members(&[(9, 0, 3, None)]);
    let c = joined(false);
    assert!(c.demand(&elder, 4.0, 0.0, MS).blocked);
    let window = c.settings.timing.join_window;
    assert!(
        !c.demand(&elder, 4.0, 0.0, MS + window).blocked,
        "a join window after it serves"
    );
    assert!(
        !c.demand(&members(&[(10, 0, 3, None)]), 4.0, 0.0, MS)
            .blocked,
        "its elders are gone"
    );
    let mut m = members(&[(9, 0, 3, None)]);
    m.set_checked(PeerKey(9), false, true);
    assert!(!c.demand(&m, 4.0, 0.0, MS).blocked, "it worked with them");
    assert!(
        !joined(true).demand(&elder, 4.0, 0.0, MS).blocked,
        "a re-sync"
    );
}

/// Laggards and the end of the run: a driver of a stage ahead of another by more than a
/// round, or of a finished stage, is told to feed the slowest round only.
#[test]
fn a_driver_ahead_of_a_lagging_stage_is_told_so() {
    let mut c = serving(SyncMode::AllReduce);
    c.set_position(3, 3, false);
    let d = c.demand(&members(&[(9, 1, 2, None)]), 4.0, 0.0, MS);
    assert_eq!(d.ahead, None, "a round behind is normal");
    let d = c.demand(&members(&[(9, 1, 1, None)]), 4.0, 0.0, MS);
    assert_eq!(d.ahead, Some(1));
    assert_eq!(d.quota, 8.0);
    // A stage is as far as its most advanced replica: one replica behind (or an identity
    // announcing an old round) holds nobody back, it catches up on its own.
    let d = c.demand(&members(&[(9, 1, 3, None), (10, 1, 0, None)]), 4.0, 0.0, MS);
    assert_eq!(d.ahead, None);
    let d = c.demand(&members(&[(9, 1, 1, None), (10, 2, 3, None)]), 4.0, 0.0, MS);
    assert_eq!(d.ahead, Some(1), "the whole of stage 1 is behind");
    // DiLoCo replicas step on their own: no laggards, the quota is the local batch.
    let mut c = serving(SyncMode::diloco(2));
    c.set_position(3, 3, false);
    let d = c.demand(&members(&[(9, 0, 1, None)]), 4.0, 0.0, MS);
    assert_eq!((d.ahead, d.quota, d.others), (None, 4.0, None));
}

#[test]
fn diloco_takes_local_steps_and_averages_every_h() {
    let m = members(&[(9, 1, 0, None)]);
    let mut out = Outbox::new(ME);
    let mut c = serving(SyncMode::diloco(2));
    for step in 0..2 {
        commit(&mut c, 4);
        c.maybe_begin_round(&mut out, Some(1), &m, None, MS);
        assert_eq!(out.jobs.next(MS), Some(Job::LocalStep), "step {step}");
        out.jobs.finished(MS);
        assert!(
            c.demand(&m, 4.0, 0.0, MS).blocked,
            "until the step is applied"
        );
        assert!(!c.on_stepped(&mut out, 1, true));
    }
    assert_eq!(c.step(), 2);
    c.maybe_begin_round(&mut out, Some(1), &m, None, MS);
    assert!(c.in_round(), "H = 2 local steps: average");
}

#[test]
fn checkpoints_follow_the_schedule() {
    let m = members(&[]);
    let mut out = Outbox::new(ME);
    let mut c = serving(SyncMode::AllReduce);
    c.set_checkpoint_every(Some(2));
    commit(&mut c, 8);
    c.maybe_begin_round(&mut out, Some(1), &m, None, MS);
    c.drain_round(&mut out, Some(1), &m, MS);
    // Alone, the round finishes at once once the gradient comes.
    assert_eq!(out.jobs.next(MS), Some(Job::TakeGradient));
    out.jobs.finished(MS);
    assert!(c.on_gradient(vec![1.0; 4], 8.0, 1.0, MS));
    c.drain_round(&mut out, Some(1), &m, MS);
    assert!(matches!(out.jobs.next(MS), Some(Job::Step { .. })));
    out.jobs.finished(MS);
    assert!(c.on_stepped(&mut out, 11, false));
    assert_eq!(out.jobs.next(MS), None, "step 1: no checkpoint");
    commit(&mut c, 8);
    c.maybe_begin_round(&mut out, Some(1), &m, None, MS);
    c.drain_round(&mut out, Some(1), &m, MS);
    out.jobs.next(MS);
    out.jobs.finished(MS);
    c.on_gradient(vec![1.0; 4], 8.0, 1.0, MS);
    c.drain_round(&mut out, Some(1), &m, MS);
    out.jobs.next(MS);
    out.jobs.finished(MS);
    c.on_stepped(&mut out, 12, false);
    assert_eq!(
        out.jobs.next(MS),
        Some(Job::Checkpoint { step: 2, round: 2 })
    );
    assert_eq!(c.params_hash(), Some(12));
}

/// The hash vote does not wait for a pause between rounds: on a busy stage the next round has
/// often begun when a replica's announcement of the last one arrives, and the replica that
/// stepped last has seen the others' hashes before it had its own.
#[test]
fn replicas_that_ended_a_round_apart_vote_even_while_the_next_round_runs() {
    // Two replicas at round 0 with other parameters: the tie goes to the smaller key.
    let smaller = members(&[(3, 1, 0, Some(3))]);
    let mut out = Outbox::new(ME);
    let mut c = serving(SyncMode::AllReduce);
    commit(&mut c, 8);
    c.maybe_begin_round(&mut out, Some(1), &smaller, None, MS);
    assert!(c.in_round());
    let theirs = announcement(1, 0, Some(3));
    let resync = c.on_replica_announced(&mut out, 1, &smaller, PeerKey(3), &theirs, MS);
    assert_eq!(resync.map(|r| r.from), Some(PeerKey(3)));
    let larger = members(&[(9, 1, 0, Some(3))]);
    let resync = c.on_replica_announced(&mut out, 1, &larger, PeerKey(9), &theirs, MS);
    assert_eq!(resync, None, "the larger key keeps its parameters");

    // Announced before this replica got to the round: voted on once it steps.
    let c = serving(SyncMode::AllReduce);
    assert_eq!(
        c.vote_after_step(1, &smaller).map(|r| r.from),
        Some(PeerKey(3))
    );
    assert_eq!(c.vote_after_step(1, &larger), None);
    let agree = members(&[(3, 1, 0, Some(7)), (9, 1, 0, Some(7))]);
    assert_eq!(c.vote_after_step(1, &agree), None);
}

/// The run ends at a replica only where its stage's replicas hold its parameters and none is
/// still downloading them: no vote comes after the last round.
#[test]
fn a_stage_ends_the_run_only_in_agreement() {
    let c = serving(SyncMode::AllReduce);
    assert!(c.stage_agrees(1, &members(&[(9, 1, 0, Some(7)), (4, 2, 0, Some(3))])));
    assert!(!c.stage_agrees(1, &members(&[(9, 1, 0, Some(3))])));
    let syncing = Announcement {
        state: MemberState::Syncing,
        ..announcement(1, 0, None)
    };
    let m = fixtures::members([(9, syncing)]);
    assert!(!c.stage_agrees(1, &m));
    // An identity whose work this replica never checked holds up nothing once it checked
    // some replica's.
    let mut m = members(&[(9, 1, 0, Some(7)), (11, 1, 0, Some(3))]);
    m.set_checked(PeerKey(9), true, true);
    assert!(c.stage_agrees(1, &m));
}

/// Regression (seed sweep, a partition that healed): two replicas that each downloaded from
/// the other sat at one round, each waiting for its source to bring the next, while a third
/// replica was a round ahead of both. A source no further than this replica is not waited for.
#[test]
fn replicas_that_are_each_others_source_catch_up_with_the_replica_ahead() {
    let m = members(&[(8, 1, 0, Some(7)), (9, 1, 1, Some(3))]);
    let mut out = Outbox::new(ME);
    let mut c = serving(SyncMode::AllReduce);
    c.start_serving(Some(7), Some(PeerKey(8)), Duration::ZERO);
    c.settle_until = None;
    c.maybe_begin_round(&mut out, Some(1), &m, None, MS);
    assert_eq!(
        sends(&mut out),
        [(PeerKey(9), Message::CatchUpRequest { stage: 1, round: 0 })]
    );
    assert!(!c.in_round());
}

/// Regression (seed sweep): after a partition healed, replicas the other side had left far
/// behind were counted into the stage's rounds, which then waited a round timeout for shares
/// that could not come. A replica two rounds behind is left out; one round behind is not (its
/// announcement of the round that just ended may still be on its way).
#[test]
fn a_replica_two_rounds_behind_is_left_out_of_the_round() {
    let m = members(&[
        (8, 1, 0, None),
        (9, 1, 2, None),
        (7, 1, 1, None),
        (6, 1, 3, None),
    ]);
    let mut c = serving(SyncMode::AllReduce);
    c.round = 2;
    let (leaders, workers) = c.round_members(1, &m);
    let mut workers = workers;
    workers.sort();
    assert_eq!(
        workers,
        [PeerKey(7), PeerKey(9)],
        "not 8 (behind) nor 6 (past)"
    );
    assert!(leaders.iter().all(|k| workers.contains(k)), "{leaders:?}");
}
