//! Unit tests of the driver.

use super::*;
use crate::swarm::fixtures;
use crate::swarm::interface::Action;

const MS: Duration = Duration::from_millis(1);
const ME: PeerKey = PeerKey(1);

fn timing() -> Timing {
    Timing {
        join_window: 100 * MS,
        microbatch_deadline: 300 * MS,
        max_attempts: 2,
        ..Timing::default()
    }
}

/// An allreduce step of 16 samples (microbatches of 2) of which this driver's share is 8.
fn demand() -> Demand {
    Demand {
        round: 3,
        quota: 16.0,
        share: 8.0,
        committed: 0.0,
        others: Some(0.0),
        blocked: false,
        ahead: None,
    }
}

/// The forward jobs a pump started: (sample, round) of each new microbatch.
fn pump(d: &mut Driver, demand: &Demand, window: usize, now: Duration) -> Vec<(u64, u64)> {
    let mut out = Outbox::new(ME);
    d.pump(&mut out, ME, demand, window, 2, &timing(), now);
    let mut started = Vec::new();
    while let Some(Job::Forward { id, .. }) = out.jobs.next(now) {
        let e = d.entry(id).expect("a started attempt is in the ledger");
        started.push((e.sample, e.round));
        out.jobs.finished(now);
    }
    started
}

/// Starts one microbatch of [`demand`]: its attempt id (its forward job taken and done).
fn start_one(d: &mut Driver, out: &mut Outbox) -> u64 {
    d.pump(out, ME, &demand(), 1, 2, &timing(), Duration::ZERO);
    let Some(Job::Forward { id, .. }) = out.jobs.next(Duration::ZERO) else {
        panic!("a forward job");
    };
    out.jobs.finished(Duration::ZERO);
    id
}

/// The peers sent a message of the kind `is` picks, in order.
fn sent_to(out: &mut Outbox, is: fn(&Message) -> bool) -> Vec<PeerKey> {
    out.drain()
        .into_iter()
        .filter_map(|a| match a {
            Action::Send { to, msg } if is(&msg) => Some(to),
            _ => None,
        })
        .collect()
}

#[test]
fn a_driver_starts_its_share_of_the_step_within_its_window() {
    let mut d = Driver::new(7, Duration::ZERO);
    assert_eq!(
        pump(&mut d, &demand(), 3, Duration::ZERO).len(),
        3,
        "window"
    );
    assert_eq!(
        pump(&mut d, &demand(), 16, Duration::ZERO).len(),
        1,
        "share"
    );
    assert_eq!(d.in_flight(), 4);
    // Every microbatch counts toward the round being collected, with a distinct sample.
    let mut d = Driver::new(7, Duration::ZERO);
    let started = pump(&mut d, &demand(), 16, Duration::ZERO);
    assert!(started.iter().all(|s| s.1 == 3));
    let mut samples: Vec<u64> = started.iter().map(|s| s.0).collect();
    samples.dedup();
    assert_eq!(samples.len(), 4);
}

/// Stall: a driver that started its share looks again after the join window; if the run
/// has not advanced by then, it fills the step up to the whole quota (another driver is
/// gone or slow), but never beyond it.
#[test]
fn a_stalled_step_is_filled_up_to_the_quota_by_any_driver() {
    let mut d = Driver::new(7, Duration::ZERO);
    assert_eq!(pump(&mut d, &demand(), 16, Duration::ZERO).len(), 4);
    assert_eq!(d.next_timeout(), Some(Duration::from_millis(100)));
    assert!(pump(&mut d, &demand(), 16, 50 * MS).is_empty());
    // The run advanced meanwhile: the step is not stalled, wait again.
    d.note_advance(60 * MS);
    assert!(pump(&mut d, &demand(), 16, 100 * MS).is_empty());
    assert_eq!(d.stall_check, Some(160 * MS));
    // Nothing advanced for a join window: the driver starts the rest of the step.
    assert_eq!(pump(&mut d, &demand(), 16, 160 * MS).len(), 4);
    assert!(pump(&mut d, &demand(), 16, 500 * MS).is_empty(), "quota");
    // What other drivers claimed counts toward the quota.
    let mut d = Driver::new(7, Duration::ZERO);
    let others = Demand {
        others: Some(12.0),
        ..demand()
    };
    assert_eq!(pump(&mut d, &others, 16, Duration::from_secs(1)).len(), 2);
}

/// Laggards: a stage ahead of the run starts nothing while the run advances, then, once
/// it stalls, one microbatch at a time, for the slowest stage's round.
#[test]
fn a_stage_ahead_of_the_run_waits_then_feeds_the_slowest_round_one_at_a_time() {
    let ahead = Demand {
        ahead: Some(1),
        ..demand()
    };
    let mut d = Driver::new(7, Duration::ZERO);
    assert!(pump(&mut d, &ahead, 16, 50 * MS).is_empty());
    assert_eq!(d.next_timeout(), Some(100 * MS));
    assert_eq!(pump(&mut d, &ahead, 16, 100 * MS), [(d_sample(0), 1)]);
    assert!(
        pump(&mut d, &ahead, 16, 200 * MS).is_empty(),
        "one at a time"
    );
}

fn d_sample(microbatch: u64) -> u64 {
    sample_of(ME, microbatch)
}

#[test]
fn nothing_starts_before_the_step_is_applied() {
    let blocked = Demand {
        blocked: true,
        ..demand()
    };
    let mut d = Driver::new(7, Duration::ZERO);
    assert!(pump(&mut d, &blocked, 16, Duration::from_secs(9)).is_empty());
    // In DiLoCo only this replica's own samples count.
    let diloco = Demand {
        others: None,
        quota: 4.0,
        share: 4.0,
        committed: 2.0,
        ..demand()
    };
    assert_eq!(pump(&mut d, &diloco, 16, Duration::ZERO).len(), 1);
}

#[test]
fn a_timed_out_microbatch_is_retried_on_the_same_sample_then_dropped() {
    let t = timing();
    let mut d = Driver::new(7, Duration::ZERO);
    let mut out = Outbox::new(ME);
    let first = start_one(&mut d, &mut out);
    d.sent(first, PeerKey(7));
    assert_eq!(d.next_timeout(), Some(t.microbatch_deadline));
    assert!(
        !d.expire(&mut out, &t, t.microbatch_deadline),
        "retried, not dropped"
    );
    let Some(Job::Forward {
        id: retry,
        sample,
        input,
        ..
    }) = out.jobs.next(Duration::ZERO)
    else {
        panic!("a retry");
    };
    out.jobs.finished(Duration::ZERO);
    assert_ne!(retry, first);
    assert_eq!((sample, input), (d_sample(0), Input::Tokens));
    assert_eq!(
        d.previous_hop(retry),
        Some(PeerKey(7)),
        "the retry avoids it"
    );
    // Out of attempts: both attempts are aborted, the first also at its first hop, and
    // the caller hears of it (the other drivers must learn what is no longer in flight).
    assert!(d.expire(&mut out, &t, 2 * t.microbatch_deadline));
    let mut aborted = Vec::new();
    while let Some(job) = out.jobs.next(Duration::ZERO) {
        aborted.push(job);
        out.jobs.finished(Duration::ZERO);
    }
    assert_eq!(
        aborted,
        [Job::Abort { id: first }, Job::Abort { id: retry }]
    );
    let actions = out.drain();
    assert!(actions.contains(&Action::Send {
        to: PeerKey(7),
        msg: Message::Abort { id: first }
    }));
    assert!(actions.contains(&Action::Event(Event::Dropped { microbatch: 0 })));
    assert_eq!(d.stats().dropped, 1);
    assert_eq!(d.in_flight(), 0);
}

#[test]
fn the_first_attempt_home_is_committed_along_its_route_once() {
    let t = timing();
    let mut d = Driver::new(7, Duration::ZERO);
    let mut out = Outbox::new(ME);
    let id = start_one(&mut d, &mut out);
    let route = vec![ME, PeerKey(2), PeerKey(3)];
    // Wrong shape, wrong route: ignored.
    assert_eq!(d.came_home(&mut out, ME, id, route.clone(), 5, 3, 6), None);
    assert_eq!(
        d.came_home(&mut out, ME, id, route[1..].to_vec(), 12, 3, 6),
        None
    );
    assert_eq!(
        d.came_home(&mut out, ME, id, route.clone(), 12, 3, 6),
        Some((d_sample(0), 2))
    );
    // A second answer of the same attempt is stale: aborted along its route.
    assert_eq!(d.came_home(&mut out, ME, id, route.clone(), 12, 3, 6), None);
    out.drain();
    let (entry, hops) = d.commit(&mut out, id, 40 * MS).expect("committed");
    assert_eq!(hops, route[1..]);
    assert_eq!(entry.sample, d_sample(0));
    let sent = sent_to(&mut out, |m| matches!(m, Message::Commit { .. }));
    assert_eq!(sent, [PeerKey(2), PeerKey(3)]);
    assert!(d.commit(&mut out, id, 50 * MS).is_none(), "at most once");
    // The round trip sets the deadline once it exceeds the configured floor.
    assert_eq!(d.microbatch_deadline(&t), t.microbatch_deadline);
}

/// An attempt home but not committed when a later hop of its route is gone (banned, or
/// left) or a hop tells of it: its work at that hop would never count at that stage,
/// so it is not committed; the rest of its route throws its part away, and the
/// microbatch is retried on the same sample at once.
#[test]
fn an_attempt_home_through_a_hop_that_is_gone_is_retried_not_committed() {
    let t = timing();
    let route = vec![ME, PeerKey(2), PeerKey(3)];
    for rejected in [false, true] {
        let mut d = Driver::new(7, Duration::ZERO);
        let mut out = Outbox::new(ME);
        let id = start_one(&mut d, &mut out);
        d.sent(id, PeerKey(2));
        assert!(
            d.came_home(&mut out, ME, id, route.clone(), 12, 3, 6)
                .is_some()
        );
        out.drain();
        // A peer on no route changes nothing.
        d.hop_gone(&mut out, PeerKey(9), 10 * MS);
        assert!(out.drain().is_empty());
        if rejected {
            // Only a hop of its route is believed.
            d.rejected(&mut out, PeerKey(9), id, 10 * MS);
            assert!(out.drain().is_empty());
            assert_eq!(d.next_timeout(), None);
            d.rejected(&mut out, PeerKey(2), id, 10 * MS);
        } else {
            d.hop_gone(&mut out, PeerKey(3), 10 * MS);
        }
        let aborts = sent_to(&mut out, |m| matches!(m, Message::Abort { .. }));
        let expected: &[PeerKey] = if rejected { &route[1..] } else { &route[1..2] };
        assert_eq!(aborts, expected);
        assert!(d.commit(&mut out, id, 20 * MS).is_none());
        assert_eq!(d.next_timeout(), Some(10 * MS));
        assert!(!d.expire(&mut out, &t, 10 * MS));
        let Some(Job::Forward {
            id: retry, sample, ..
        }) = out.jobs.next(Duration::ZERO)
        else {
            panic!("a retry");
        };
        assert_ne!(retry, id);
        assert_eq!(sample, d_sample(0));
    }
}

/// Attempt ids come from the peer's secret: the same key with another secret draws other
/// ids, so knowing a driver's key and how many microbatches it started predicts nothing.
#[test]
fn attempt_ids_cannot_be_predicted_from_the_key() {
    let first_id = |secret| {
        let mut d = Driver::new(secret, Duration::ZERO);
        let mut out = Outbox::new(ME);
        d.pump(&mut out, ME, &demand(), 1, 2, &timing(), Duration::ZERO);
        match out.jobs.next(Duration::ZERO) {
            Some(Job::Forward { id, input, .. }) => (id, input),
            other => panic!("{other:?}"),
        }
    };
    let (a, sample_a) = first_id(1);
    let (b, sample_b) = first_id(2);
    assert_ne!(a, b);
    assert_eq!(sample_a, sample_b, "the data does not depend on the secret");
}

#[test]
fn microbatches_are_dealt_in_proportion_and_all_of_them() {
    // Equal weights: the first drivers in key order take the remainder.
    assert_eq!(deal(8, &[1.0, 1.0, 1.0]), [3, 3, 2]);
    assert_eq!(deal(8, &[3.0, 1.0]), [6, 2]);
    // A driver 100 times slower gets what its speed is worth, possibly nothing.
    assert_eq!(deal(8, &[100.0, 100.0, 1.0]), [4, 4, 0]);
    assert_eq!(deal(64, &[100.0, 100.0, 1.0]), [32, 32, 0]);
    assert_eq!(deal(201, &[100.0, 100.0, 1.0]), [100, 100, 1]);
    for (items, weights) in [(7, vec![0.3, 0.3, 0.4]), (1000, vec![1e-9, 5.0, 7.5, 2.0])] {
        assert_eq!(deal(items, &weights).iter().sum::<u64>(), items);
    }
    assert_eq!(deal(5, &[]), Vec::<u64>::new());
    assert_eq!(deal(5, &[0.0, 0.0]), [0, 0]);
}

#[test]
fn a_drivers_share_follows_throughput_once_every_driver_is_measured() {
    let p = |peer, stage, throughput| fixtures::placement(peer, stage, throughput, 0);
    let swarm = [p(2, 0, 30.0), p(3, 1, 5.0)];
    // 8 microbatches of 2 over drivers 1 (10/s) and 2 (30/s).
    assert_eq!(share(&swarm, ME, 10.0, true, 16, 2), 4.0);
    let with_me = [p(1, 0, 10.0), p(2, 0, 30.0), p(3, 1, 5.0)];
    assert_eq!(share(&with_me, PeerKey(2), 30.0, true, 16, 2), 12.0);
    // Unweighted, or a driver not measured yet: equal parts, the first key takes more.
    assert_eq!(share(&swarm, ME, 10.0, false, 18, 2), 10.0);
    assert_eq!(share(&swarm, ME, 0.0, true, 18, 2), 10.0);
}

#[test]
fn a_driver_keeps_the_round_trip_in_flight_within_memory() {
    let p = fixtures::placement;
    // Two stages of two replicas, each replica 100 samples/s; microbatches of 4 samples.
    let costs = StageCosts {
        flops_per_sample: vec![1.0; 2],
        params: vec![10; 2],
        activation_values: 1,
        memory: vec![1000; 2],
        offload_memory: vec![0; 2],
        microbatch_memory: vec![100; 2],
        param_scale: 1,
    };
    // Two drivers at stage 0; stage 1's replicas with this throughput, the first with this
    // much memory.
    let swarm = |second: f64, memory: u64| {
        [
            p(1, 0, 100.0, 0),
            p(2, 0, 100.0, 0),
            p(3, 1, second, memory),
            p(4, 1, second, 0),
        ]
    };
    let window = |placements: &[Placement], rtt: f64| {
        driver_window(placements, &costs, (4, 16), rtt, 100.0, 4)
    };
    let unlimited = swarm(100.0, 0);
    // A driver's share is 100 samples/s: a 20 ms round trip needs half a microbatch in
    // flight (2 with the margin), a 100 ms one 2.5 (10), a second 25 (100).
    assert_eq!(window(&unlimited, 0.02), 4);
    assert_eq!(window(&unlimited, 0.1), 10);
    assert_eq!(window(&unlimited, 1.0), 16);
    // Nothing measured yet: the least window.
    assert_eq!(window(&unlimited, f64::INFINITY), 4);
    // A slow second stage takes less, so less is sent into the pipeline.
    let slow = swarm(25.0, 0);
    assert_eq!(window(&slow, 0.1), 4);
    assert_eq!(window(&slow, 0.3), 8);
    // A replica with room for 2 microbatches beyond the least window holds 6 in all; two
    // drivers over two replicas may keep 6 each in flight.
    assert_eq!(window(&swarm(100.0, 1200), 1.0), 6);
    // Memory too small even for the least window does not stop the run.
    assert_eq!(window(&swarm(100.0, 500), 1.0), 4);
}
