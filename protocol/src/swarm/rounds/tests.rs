//! Rounds of a stage driven by hand: leaders passed over, newcomers, early joins and exclusions.

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
        1.0,
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

/// Replicas that banned a leader this one still follows take this one for their leader and
/// join it. When its round fails (the leader is banned here too), the retry it leads counts
/// those joins and starts at once: they wait for its start and will not join again, so
/// without them it waited its join window and started alone, and they failed (a stage of
/// `attack.toml` stood still for 2.7 s that way).
#[test]
fn joins_that_came_while_following_another_leader_count_in_the_retry_this_replica_leads() {
    let mut out = Outbox::new(PeerKey(3));
    let mut r = rounds(3);
    let replicas = vec![PeerKey(1), PeerKey(5)];
    // Among 1, 3 and 5, peer 1 leads round 0 of stage 1.
    r.begin(key(0), &replicas, &replicas, 8, Duration::ZERO);
    assert_eq!(sent(&mut r), [(PeerKey(1), RoundMsg::Join)]);
    // A join from 6, which ranks before 3, is 6 leading and inviting it: nobody waits for 3.
    hear(
        &mut r,
        &mut out,
        6,
        0,
        RoundMsg::Join,
        0,
        false,
        replicas.clone(),
    );
    assert!(!r.awaited(key(0)));
    // 5 has banned 1: to it, 3 leads.
    hear(&mut r, &mut out, 5, 0, RoundMsg::Join, 0, false, replicas);
    assert!(r.awaited(key(0)));
    assert!(!r.awaited(key(1)));
    r.banned(PeerKey(1), MS);
    assert!(matches!(r.poll(), Some((_, RoundOut::Failed(_)))));
    r.fail();
    // The retry: 3 leads, invites 5 as it invites every replica, and starts with it at once.
    r.begin(key(0), &[PeerKey(5)], &[PeerKey(5)], 8, 2 * MS);
    assert_eq!(
        sent(&mut r),
        [
            (PeerKey(5), RoundMsg::Join),
            (
                PeerKey(5),
                RoundMsg::Start {
                    group: vec![PeerKey(3), PeerKey(5)]
                }
            )
        ]
    );
    assert!(!r.awaited(key(0)), "the joins were taken in");
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
/// that round (its result is not caught up from, and its samples are not waited for, nor is
/// it in the retry); a replica that announces it is past the round is not waited for, and a
/// follower whose leader went on fails at once.
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
    assert_eq!(evidence, Some(Evidence::LeftOut { peer: PeerKey(1) }));
    assert!(r.excluded_by(0, PeerKey(1)) && r.excluded_in(0));
    assert!(!r.excluded_by(0, PeerKey(3)) && !r.excluded_in(1));
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
    let started_without_1 = |(_, o): &(RoundKey, RoundOut)| {
        matches!(o, RoundOut::Send(PeerKey(3), RoundMsg::Start { group })
            if group.len() == 2 && !group.contains(&PeerKey(1)))
    };
    // Tried again, 5 leads, and starts as soon as 3 joins: 1 finished the round without it.
    r.begin(key(0), &[], &[PeerKey(1), PeerKey(3)], 8, 2 * MS);
    sent(&mut r);
    join(&mut r, 3);
    let starts: Vec<_> = std::iter::from_fn(|| r.poll()).collect();
    assert!(starts.iter().any(started_without_1), "{starts:?}");
    // A replica that did not leave it out is waited for until it says it is past the round.
    let mut r = rounds(5);
    r.begin(key(0), &[], &[PeerKey(1), PeerKey(3)], 8, 2 * MS);
    sent(&mut r);
    join(&mut r, 3);
    assert!(r.poll().is_none(), "1 is waited for");
    r.went_on(PeerKey(1), 0, true, 4 * MS);
    assert!(
        r.poll().is_none(),
        "a replica still at round 0 is waited for"
    );
    r.went_on(PeerKey(1), 1, true, 4 * MS);
    let starts: Vec<_> = std::iter::from_fn(|| r.poll()).collect();
    assert!(starts.iter().any(started_without_1), "{starts:?}");
    // A follower whose leader announces it went past the round fails now.
    let mut f = rounds(5);
    f.begin(key(2), &[PeerKey(1)], &[PeerKey(1)], 8, MS);
    sent(&mut f);
    f.went_on(PeerKey(1), 3, true, 2 * MS);
    let out: Vec<_> = std::iter::from_fn(|| f.poll()).map(|(_, o)| o).collect();
    assert!(matches!(out.last(), Some(RoundOut::Failed(_))), "{out:?}");
}

/// A leader left alone because the replica it waited for went on past the round does not run
/// the round by itself (its parameters would step away from the stage's): it fails, and the
/// retry catches up. A replica it could not catch up from (not vouched for, or one that left
/// it out) does not stop it.
#[test]
fn a_leader_left_behind_fails_rather_than_averaging_alone() {
    for (catchable, fails) in [(true, true), (false, false)] {
        let mut r = rounds(5);
        r.begin(key(4), &[], &[PeerKey(1)], 8, MS);
        sent(&mut r);
        r.went_on(PeerKey(1), 5, catchable, 2 * MS);
        let out: Vec<_> = std::iter::from_fn(|| r.poll()).map(|(_, o)| o).collect();
        assert_eq!(
            matches!(out.last(), Some(RoundOut::Failed(_))),
            fails,
            "{out:?}"
        );
        assert_eq!(
            out.iter().any(|o| matches!(o, RoundOut::NeedContribution)),
            !fails,
            "{out:?}"
        );
    }
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
