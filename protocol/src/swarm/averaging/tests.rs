//! Rounds among in-process members: results, refusals and members vanishing.

use super::vote::tally;
use super::*;

const MS: Duration = Duration::from_millis(1);

fn timing() -> Timing {
    Timing {
        join_window: 100 * MS,
        round_timeout: 300 * MS,
        ..Timing::default()
    }
}

/// Runs one round among `n` members with a hand-driven network. `kill` names a member and a
/// point at which it vanishes: it sends nothing from then on.
fn round_with_vanishing(n: usize, kill: Option<(usize, Vanish)>) -> Vec<Option<Vec<f32>>> {
    round_among(n, kill, None, |_, _| false)
        .into_iter()
        .map(|r| r.map(|(r, _)| r.averaged))
        .collect()
}

/// [`round_with_vanishing`], where `late` names a member that contributes only from a given
/// time on (a slow one: its share and its part come after the others gave up on them), and
/// `withheld(sender, msg)` the messages a member keeps to itself. Each member's result comes
/// with the time it finished.
fn round_among(
    n: usize,
    kill: Option<(usize, Vanish)>,
    late: Option<(usize, Duration)>,
    withheld: impl Fn(usize, &RoundMsg) -> bool,
) -> Vec<Option<(RoundResult, Duration)>> {
    round_paced(n, kill, late, withheld, None)
}

/// [`round_among`] with every member's uplink measured at `pace` seconds per byte.
fn round_paced(
    n: usize,
    kill: Option<(usize, Vanish)>,
    late: Option<(usize, Duration)>,
    withheld: impl Fn(usize, &RoundMsg) -> bool,
    pace: Option<f64>,
) -> Vec<Option<(RoundResult, Duration)>> {
    let key = RoundKey { stage: 0, index: 0 };
    let keys: Vec<PeerKey> = (0..n as u64).map(PeerKey).collect();
    let t = timing();
    let len = 37;
    let mut rounds: Vec<Round> = (0..n)
        .map(|i| {
            if i == 0 {
                Round::lead(
                    key,
                    keys[0],
                    &keys[1..],
                    len,
                    Codec::default(),
                    t,
                    Duration::ZERO,
                )
            } else {
                Round::follow(
                    key,
                    keys[i],
                    keys[0],
                    len,
                    Codec::default(),
                    t,
                    Duration::ZERO,
                )
            }
        })
        .collect();
    let contribution = |i: usize| -> Vec<f32> { (0..len).map(|j| ((i + 1) * j) as f32).collect() };
    let mut results: Vec<Option<(RoundResult, Duration)>> = vec![None; n];
    let mut now = Duration::ZERO;
    let mut averaged_sent = 0;
    let dead = |i: usize, point: Vanish, kill: Option<(usize, Vanish)>| {
        kill.is_some_and(|(k, p)| k == i && p <= point)
    };
    let mut asked = vec![false; n];
    for _tick in 0..200 {
        let mut mail: Vec<(usize, usize, RoundMsg)> = Vec::new();
        for i in 0..n {
            let slow = late.is_some_and(|(k, at)| k == i && now < at);
            if asked[i] && !slow {
                asked[i] = false;
                rounds[i].upload_pace = pace;
                rounds[i].contribute(contribution(i), (i + 1) as f64, None, now);
            }
            while let Some(out) = rounds[i].poll() {
                match out {
                    RoundOut::Send(to, msg) => {
                        let point = match msg {
                            RoundMsg::Join => Vanish::BeforeJoin,
                            RoundMsg::Start { .. } => Vanish::BeforeJoin,
                            RoundMsg::Part { .. } => Vanish::BeforeParts,
                            RoundMsg::Averaged { .. } => {
                                averaged_sent += 1;
                                if kill.is_some_and(|(k, _)| k == i) && averaged_sent > 1 {
                                    Vanish::MidAveraged
                                } else {
                                    Vanish::BeforeAveraged
                                }
                            }
                            _ => Vanish::MidAveraged,
                        };
                        if !dead(i, point, kill) && !withheld(i, &msg) {
                            mail.push((i, to.0 as usize, msg));
                        }
                    }
                    RoundOut::NeedContribution => {
                        if !dead(i, Vanish::BeforeParts, kill) {
                            asked[i] = true;
                        }
                    }
                    RoundOut::Finished(r) => results[i] = Some((r, now)),
                    RoundOut::Failed(_) | RoundOut::Evidence(_) => {}
                    RoundOut::Violation(from, what) => {
                        panic!("honest member {from:?} blamed: {what}")
                    }
                }
            }
        }
        now += 10 * MS;
        for (from, to, msg) in mail {
            if !dead(to, Vanish::BeforeJoin, kill) {
                rounds[to].handle(keys[from], msg, now);
            }
        }
        for r in &mut rounds {
            r.handle_timeout(now);
        }
    }
    results
}

/// A member so slow that the others gave up on its share and on the part it owns (a replica
/// that restarted and joined the round late did this): it still finishes the round, and the
/// others' verdicts make it drop its own part as they did, so every member applies the same
/// values (applying it alone left its replica apart until a re-sync).
#[test]
fn a_part_the_others_gave_up_on_is_dropped_by_its_owner_too() {
    let results = round_among(3, None, Some((2, 900 * MS)), |_, _| false);
    let results: Vec<Vec<f32>> = results
        .into_iter()
        .map(|r| r.expect("finished").0.averaged)
        .collect();
    assert!(results.iter().all(|r| *r == results[0]), "{results:?}");
    let dropped = (0..3).filter(|&j| {
        let part = &results[0][part_range(37, 3, j)];
        !part.is_empty() && part.iter().all(|v| *v == 0.0)
    });
    assert_eq!(dropped.count(), 1, "{:?}", results[0]);
}

/// The same slow member where every uplink was measured slow (its shares take about a second
/// to send, three round timeouts): the round waits for what the uplinks need, and nothing
/// is dropped. Left at the fixed timeout, a large stage on home uplinks lost its members'
/// shares round after round.
#[test]
fn a_round_on_slow_uplinks_waits_for_what_they_need() {
    let results = round_paced(3, None, Some((2, 900 * MS)), |_, _| false, Some(0.01));
    let on_time = round_among(3, None, None, |_, _| false);
    for (r, t) in results.iter().zip(&on_time) {
        let (r, t) = (r.as_ref().expect("finished"), t.as_ref().expect("finished"));
        assert!(r.0.left_out.is_empty() && r.0.zeroed.is_empty() && r.0.refused.is_empty());
        assert_eq!(r.0.averaged, t.0.averaged);
    }
}

/// `from`'s share (`values` over `samples`, in fp32) of the part `r` owns, arriving at 1 ms.
fn share_to_owner(r: &mut Round, from: PeerKey, values: &[f32], samples: f64) {
    let part = r.my_index().expect("a member") as u32;
    let data = crate::codec::encode_to_vec(Codec::Fp32, values, &[values.len()]).unwrap();
    let attempt = r.attempt;
    r.handle(
        from,
        RoundMsg::Part {
            attempt,
            part,
            samples,
            loss: None,
            data,
        },
        MS,
    );
}

/// Whether `r`'s evidence says `peer` delivered its work.
fn delivered(r: &RoundResult, peer: PeerKey) -> Option<bool> {
    r.evidence.iter().find_map(|e| match *e {
        Evidence::Delivered { peer: p, delivered } if p == peer => Some(delivered),
        _ => None,
    })
}

/// Members that send their shares and parts but keep their verdicts, where their verdicts
/// are needed (four members, two of them silent: one acceptance besides this member's own
/// cannot keep a part against two verdicts still out): the others apply the round after half
/// a round timeout, and count it as work not delivered (three such rounds in a row accuse
/// them of withholding).
#[test]
fn a_member_that_keeps_a_needed_verdict_has_not_delivered() {
    let results = round_among(4, None, None, |from, msg| {
        from >= 2 && matches!(msg, RoundMsg::Verdict { .. })
    });
    let (r, at) = results[0].as_ref().expect("finished");
    assert!(r.refused.is_empty() && r.zeroed.is_empty());
    assert!(*at >= timing().round_timeout / 2, "decided at {at:?}");
    for silent in [PeerKey(2), PeerKey(3)] {
        assert_eq!(delivered(r, silent), Some(false), "{:?}", r.evidence);
    }
}

/// With a dense codec the owner sees in each member's share how that member will vote on its
/// part: where every other member will clearly accept it and it went out in good time, the
/// vote cannot refuse it, and the owner does not wait for verdicts on it. Two members, one
/// keeping its verdicts: the other decides at once and holds nothing against it; a member
/// whose share points elsewhere could refuse, and is waited for.
#[test]
fn an_owner_sure_of_its_part_does_not_wait_for_the_verdicts_on_it() {
    let keeps_verdicts =
        |from: usize, msg: &RoundMsg| from == 1 && matches!(msg, RoundMsg::Verdict { .. });
    let results = round_among(2, None, None, keeps_verdicts);
    let (r, at) = results[0].as_ref().expect("finished");
    assert!(r.refused.is_empty() && r.zeroed.is_empty());
    assert!(*at < timing().round_timeout / 2, "decided at {at:?}");
    assert_eq!(delivered(r, PeerKey(1)), Some(true), "{:?}", r.evidence);

    let key = RoundKey { stage: 1, index: 0 };
    let (a, b) = (PeerKey(1), PeerKey(2));
    let own: Vec<f32> = (0..8).map(|i| 1.0 + i as f32).collect();
    for (theirs_sign, sure) in [(1.0f32, true), (-1.0, false)] {
        let mut r = Round::lead(key, a, &[b], 8, Codec::Fp32, timing(), Duration::ZERO);
        r.handle(b, RoundMsg::Join, Duration::ZERO);
        while r.poll().is_some() {}
        r.contribute(own.clone(), 2.0, None, Duration::ZERO);
        let mine = r.my_index().unwrap();
        let m = r.range(mine);
        while r.poll().is_some() {}
        // b's share of this member's part, along its own or against it.
        let share: Vec<f32> = own[m].iter().map(|v| theirs_sign * v).collect();
        share_to_owner(&mut r, b, &share, 2.0);
        assert_eq!(r.own_part_sure, sure);
    }
}

/// Where the verdicts that came settle every part whatever the missing one would say (three
/// members, two agreeing), a member keeping its verdicts is not waited for: the others
/// apply the round at once, and its silence cost nothing, so it is not held against it.
#[test]
fn a_vote_settled_without_a_member_does_not_wait_for_it() {
    let results = round_among(3, None, None, |from, msg| {
        from == 2 && matches!(msg, RoundMsg::Verdict { .. })
    });
    let waited = round_among(3, None, None, |_, _| false);
    for i in 0..2 {
        let (r, at) = results[i].as_ref().expect("finished");
        assert!(r.refused.is_empty() && r.zeroed.is_empty());
        assert_eq!(*at, waited[i].as_ref().expect("finished").1);
        assert!(*at < timing().round_timeout / 2, "decided at {at:?}");
        for peer in [PeerKey(1 - i as u64), PeerKey(2)] {
            assert_eq!(delivered(r, peer), Some(true), "{:?}", r.evidence);
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Vanish {
    BeforeJoin,
    BeforeParts,
    BeforeAveraged,
    MidAveraged,
}

/// A member's part or an owner's averaged part a million times larger than this member's
/// own contribution is a violation: the part counts as a member that gave nothing, the
/// averaged part is not applied.
#[test]
fn parts_far_larger_than_this_members_own_are_refused() {
    // Peer 1 ranks before peer 2 in this round: it owns part 0.
    let key = RoundKey { stage: 1, index: 0 };
    let (a, b) = (PeerKey(1), PeerKey(2));
    let mut r = Round::lead(key, a, &[b], 8, Codec::Fp32, timing(), Duration::ZERO);
    r.handle(b, RoundMsg::Join, Duration::ZERO);
    while r.poll().is_some() {}
    r.contribute(vec![2.0; 8], 2.0, None, Duration::ZERO);
    while r.poll().is_some() {}
    let huge = crate::codec::encode_to_vec(Codec::Fp32, &[1e6; 4], &[4]).unwrap();
    r.handle(
        b,
        RoundMsg::Part {
            attempt: r.attempt,
            part: 0,
            samples: 2.0,
            loss: None,
            data: huge.clone(),
        },
        MS,
    );
    r.handle(
        b,
        RoundMsg::Averaged {
            attempt: r.attempt,
            part: 1,
            samples: 4.0,
            loss: None,
            data: huge.into(),
        },
        MS,
    );
    let mut out = Vec::new();
    while let Some(o) = r.poll() {
        out.push(o);
    }
    let blamed: Vec<&str> = out
        .iter()
        .filter_map(|o| match o {
            RoundOut::Violation(who, what) if *who == b => Some(*what),
            _ => None,
        })
        .collect();
    assert_eq!(blamed.len(), 2, "{out:?}");
    // Its own part averaged without the refused share: this member's values alone.
    let sent = out.iter().find_map(|o| match o {
        RoundOut::Send(to, RoundMsg::Averaged { data, .. }) if *to == b => Some(data),
        _ => None,
    });
    let (_, avg) = crate::codec::decode_to_vec(sent.expect("part 0 averaged")).unwrap();
    assert_eq!(avg, vec![1.0; 4]);
    assert!(
        r.averaged[1].is_none(),
        "the huge averaged part was not taken"
    );
}

/// An averaged part that points against this member's own share of it (a negated part) gets
/// this member's refusal; with no acceptance from another member (the owner's own vote does
/// not count) nobody applies it, and the round says so. An honest part is applied as sent.
/// Either way the member waits for the other's verdict before applying anything.
///
/// With a lossy codec, what this member's share of a refused part carried goes back to its
/// error feedback (nobody applied it); of an applied part, only what the codec dropped stays
/// there; of its own part, nothing (it travelled uncompressed).
#[test]
fn a_part_the_members_refuse_is_applied_by_nobody() {
    let key = RoundKey { stage: 1, index: 0 };
    let (a, b) = (PeerKey(1), PeerKey(2));
    let own: Vec<f32> = (0..8).map(|i| 1.0 + i as f32).collect();
    // One value of each share sent (its largest, exactly: one kept value is its own scale).
    let codec = Codec::ChunkTopK {
        k: 1,
        chunk: 16,
        bits: 2,
    };
    for (sign, refused) in [(1.0f32, false), (-1.0, true)] {
        let mut r = Round::lead(key, a, &[b], 8, codec, timing(), Duration::ZERO);
        r.handle(b, RoundMsg::Join, Duration::ZERO);
        while r.poll().is_some() {}
        r.contribute(own.clone(), 2.0, None, Duration::ZERO);
        let mine = r.my_index().unwrap();
        let theirs = 1 - mine;
        let (m, t) = (r.range(mine), r.range(theirs));
        while r.poll().is_some() {}
        share_to_owner(&mut r, b, &own[m.clone()], 2.0);
        // b's averaged part: this member's per-sample share of it, times the sign.
        let part: Vec<f32> = own[t.clone()].iter().map(|v| sign * v / 2.0).collect();
        let data = crate::codec::encode_to_vec(Codec::Fp32, &part, &[t.len()]).unwrap();
        r.handle(
            b,
            RoundMsg::Averaged {
                attempt: r.attempt,
                part: theirs as u32,
                samples: 4.0,
                loss: None,
                data: data.into(),
            },
            MS,
        );
        let outs: Vec<RoundOut> = std::iter::from_fn(|| r.poll()).collect();
        let mut expected = vec![Vote::Abstain; 2];
        expected[theirs] = if refused { Vote::Refuse } else { Vote::Accept };
        assert!(
            outs.contains(&RoundOut::Send(
                b,
                RoundMsg::Verdict {
                    attempt: r.attempt,
                    votes: expected,
                }
            )),
            "{outs:?}"
        );
        assert!(!outs.iter().any(|o| matches!(o, RoundOut::Finished(_))));
        // b vouches for its own part: an owner's vote on its own part does not count.
        let mut votes = vec![Vote::Abstain; 2];
        votes[theirs] = Vote::Accept;
        r.handle(
            b,
            RoundMsg::Verdict {
                attempt: r.attempt,
                votes,
            },
            MS,
        );
        let result = std::iter::from_fn(|| r.poll())
            .find_map(|o| match o {
                RoundOut::Finished(result) => Some(result),
                _ => None,
            })
            .expect("the round finished");
        let applied = &result.averaged[t.clone()];
        if refused {
            assert_eq!(result.refused, vec![theirs as u32]);
            assert!(applied.iter().all(|v| *v == 0.0), "{applied:?}");
        } else {
            assert!(result.refused.is_empty());
            assert_eq!(applied, &part[..]);
        }
        let residual = r.feedback.share_residual();
        assert!(
            residual[m.clone()].iter().all(|v| *v == 0.0),
            "{residual:?}"
        );
        let mut withheld = own[t.clone()].to_vec();
        if !refused {
            *withheld.last_mut().unwrap() = 0.0;
        }
        assert_eq!(residual[t.clone()], withheld[..]);
        // Refused or not, the part is evidence against or for its owner.
        assert!(result.evidence.iter().any(|e| matches!(
            e,
            Evidence::Part { peer, agreement } if *peer == b && (*agreement < 0.0) == refused
        )));
    }
}

/// A member whose own share most of the round's parts disagree with (a hop after its stage sent
/// it wrong activation gradients) is the odd one out: it refuses none of them and takes the
/// round as no evidence against their owners. One part against its share among several is
/// still refused and accused.
#[test]
fn a_member_whose_share_most_parts_disagree_with_neither_refuses_nor_accuses() {
    let key = RoundKey { stage: 1, index: 0 };
    let me = PeerKey(1);
    let others = [PeerKey(2), PeerKey(3), PeerKey(4)];
    let len = 12;
    let own: Vec<f32> = (0..len).map(|i| 1.0 + i as f32).collect();
    for (negated, odd_one_out) in [(3, true), (1, false)] {
        let mut r = Round::lead(key, me, &others, len, Codec::Fp32, timing(), Duration::ZERO);
        for k in others {
            r.handle(k, RoundMsg::Join, Duration::ZERO);
        }
        r.handle_timeout(timing().join_window);
        while r.poll().is_some() {}
        r.contribute(own.clone(), 2.0, None, MS);
        let mine = r.my_index().unwrap();
        while r.poll().is_some() {}
        let share = own[r.range(mine)].to_vec();
        for k in others {
            share_to_owner(&mut r, k, &share, 2.0);
        }
        let mut bad = Vec::new();
        for (j, &owner) in r.group.clone().iter().enumerate() {
            if j == mine {
                continue;
            }
            let sign = if bad.len() < negated { -1.0 } else { 1.0 };
            if sign < 0.0 {
                bad.push(owner);
            }
            let part: Vec<f32> = own[r.range(j)].iter().map(|v| sign * v / 2.0).collect();
            let data = crate::codec::encode_to_vec(Codec::Fp32, &part, &[part.len()]).unwrap();
            let attempt = r.attempt;
            let averaged = RoundMsg::Averaged {
                attempt,
                part: j as u32,
                samples: 8.0,
                loss: None,
                data: data.into(),
            };
            r.handle(owner, averaged, 2 * MS);
        }
        let outs: Vec<RoundOut> = std::iter::from_fn(|| r.poll()).collect();
        let refusals = outs
            .iter()
            .find_map(|o| match o {
                RoundOut::Send(_, RoundMsg::Verdict { votes, .. }) => {
                    Some(votes.iter().filter(|v| **v == Vote::Refuse).count())
                }
                _ => None,
            })
            .expect("a verdict went out");
        assert_eq!(refusals, if odd_one_out { 0 } else { 1 });
        r.handle_timeout(Duration::from_secs(10));
        let result = std::iter::from_fn(|| r.poll())
            .chain(outs)
            .find_map(|o| match o {
                RoundOut::Finished(result) => Some(result),
                _ => None,
            })
            .expect("the round finished");
        let accused: Vec<PeerKey> = result
            .evidence
            .iter()
            .filter_map(|e| match *e {
                Evidence::Part { peer, agreement } if agreement < 0.0 => Some(peer),
                _ => None,
            })
            .collect();
        let judged = result
            .evidence
            .iter()
            .filter(|e| matches!(e, Evidence::Part { .. }))
            .count();
        if odd_one_out {
            assert_eq!(judged, 0, "{:?}", result.evidence);
        } else {
            assert_eq!(judged, 3);
            assert_eq!(accused, bad);
        }
    }
}

/// A part is refused only by more refusals than acceptances among the members other than its
/// owner: liars fewer than the honest members that could tell can neither refuse an honest
/// part nor keep a forged one, and a tie keeps the part.
#[test]
fn parts_are_refused_by_a_majority_of_the_members_that_could_tell() {
    use Vote::{Abstain as O, Accept as A, Refuse as R};
    let group: Vec<PeerKey> = (1..=5).map(PeerKey).collect();
    let refused = |votes: &[[Vote; 5]]| -> Vec<u32> {
        let ballots: Vec<(PeerKey, &[Vote])> =
            group.iter().zip(votes).map(|(k, v)| (*k, &v[..])).collect();
        tally(&group, &ballots)
    };
    // Part 0 forged by member 1, whose accomplice 2 vouches for it and refuses the honest
    // parts; members 3 to 5 could tell.
    let liars = [[O, R, R, R, R], [A, O, R, R, R]];
    let honest = [[R, A, O, A, A], [R, A, A, O, A], [R, A, A, A, O]];
    let all: Vec<[Vote; 5]> = liars.iter().chain(&honest).copied().collect();
    assert_eq!(refused(&all), vec![0]);
    // Only member 5 could tell: then the liars outnumber it, and decide (honest parts applied
    // by nobody, the forged one kept). The vote cannot do better than the members that can
    // tell; the owner is banned on the evidence either way.
    let mut blind = all.clone();
    blind[2] = [O; 5];
    blind[3] = [O; 5];
    assert_eq!(refused(&blind), vec![2, 3, 4]);
    // A tie keeps the part; nobody able to tell keeps every part.
    assert_eq!(refused(&[[O, R, O, O, O], [O; 5], [O, A, O, O, O]]), vec![]);
    assert_eq!(refused(&[[O; 5]; 5]), vec![]);
    // A ballot shorter than the group abstains on the parts it lacks.
    let short = [(PeerKey(2), &[R][..]), (PeerKey(3), &[][..])];
    assert_eq!(tally(&group, &short), vec![0]);
}

/// A round tried again with another group cuts its parts differently. A message of the earlier
/// attempt that arrives late (a part of the old size, an averaged part from the old owner) is
/// neither used nor blamed on its honest sender; the same message of this attempt is.
#[test]
fn messages_of_an_earlier_attempt_are_dropped_unblamed() {
    let key = RoundKey { stage: 1, index: 0 };
    let (a, b, c) = (PeerKey(1), PeerKey(2), PeerKey(3));
    let mut r = Round::lead(key, a, &[b], 8, Codec::Fp32, timing(), Duration::ZERO);
    r.handle(b, RoundMsg::Join, Duration::ZERO);
    while r.poll().is_some() {}
    r.contribute(vec![2.0; 8], 2.0, None, Duration::ZERO);
    while r.poll().is_some() {}
    // The earlier attempt had three members, led by c: parts of 8/3 values.
    let mut earlier = vec![a, b, c];
    earlier.sort_by_key(|k| key.rank(*k));
    let old = key.attempt(c, &earlier);
    assert_ne!(old, r.attempt);
    let three = crate::codec::encode_to_vec(Codec::Fp32, &[1.0; 3], &[3]).unwrap();
    let mine = r.my_index().unwrap() as u32;
    for attempt in [old, r.attempt] {
        r.handle(
            b,
            RoundMsg::Part {
                attempt,
                part: mine,
                samples: 2.0,
                loss: None,
                data: three.clone(),
            },
            MS,
        );
        r.handle(
            b,
            RoundMsg::Averaged {
                attempt,
                part: 1 - mine,
                samples: 4.0,
                loss: None,
                data: three.clone().into(),
            },
            MS,
        );
        let blamed = std::iter::from_fn(|| r.poll())
            .filter(|o| matches!(o, RoundOut::Violation(who, _) if *who == b))
            .count();
        assert_eq!(
            blamed,
            if attempt == old { 0 } else { 2 },
            "attempt {attempt}"
        );
    }
}

#[test]
fn an_averaging_round_survives_a_member_vanishing_at_each_phase() {
    // Member i sums i + 1 samples of value j at coordinate j: the mean per sample is j.
    let full = round_with_vanishing(4, None);
    let expect: Vec<f32> = (0..37).map(|j| j as f32).collect();
    for r in &full {
        let r = r.as_ref().unwrap();
        for (a, b) in r.iter().zip(&expect) {
            // Shares travel as int8: about 1% of the largest value.
            assert!((a - b).abs() < 0.01 * b.max(10.0), "{a} vs {b}");
        }
    }
    for point in [
        Vanish::BeforeJoin,
        Vanish::BeforeParts,
        Vanish::BeforeAveraged,
        Vanish::MidAveraged,
    ] {
        for victim in [0usize, 2] {
            if victim == 0 && point == Vanish::BeforeJoin {
                // The leader vanished before starting: followers fail the round and keep
                // their gradients (the swarm tests cover what happens next).
                continue;
            }
            let results = round_with_vanishing(4, Some((victim, point)));
            let survivors: Vec<&Vec<f32>> = results
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != victim)
                .map(|(i, r)| {
                    r.as_ref()
                        .unwrap_or_else(|| panic!("{point:?}/{victim}: member {i} did not finish"))
                })
                .collect();
            for s in &survivors[1..] {
                assert_eq!(*s, survivors[0], "{point:?}/{victim}: survivors disagree");
            }
            assert!(survivors[0].iter().all(|v| v.is_finite()));
        }
    }
}

#[test]
fn a_follower_whose_leader_left_fails_at_once_without_evidence() {
    let key = RoundKey { stage: 1, index: 4 };
    let (me, leader) = (PeerKey(1), PeerKey(2));
    let mut r = Round::follow(key, me, leader, 8, Codec::Fp32, timing(), Duration::ZERO);
    while r.poll().is_some() {}
    // Another member leaving changes nothing; the leader leaving (a crash or a restart, long
    // before the deadline) fails the round now, so that its retry can pass the leader over.
    r.member_gone(PeerKey(3), MS);
    assert!(!r.is_done());
    r.member_gone(leader, MS);
    assert!(r.is_done());
    let outs: Vec<RoundOut> = std::iter::from_fn(|| r.poll()).collect();
    assert!(outs.iter().any(|o| matches!(o, RoundOut::Failed(_))));
    assert!(
        !outs.iter().any(|o| matches!(o, RoundOut::Evidence(_))),
        "a leader that left is not accused: {outs:?}"
    );
    assert_eq!(r.withheld_by(), Some(leader));
}
