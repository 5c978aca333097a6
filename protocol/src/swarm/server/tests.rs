//! Unit tests of the stage server.

use super::*;
use crate::swarm::fixtures::{jobs, sends};

const MS: Duration = Duration::from_millis(1);
const ME: PeerKey = PeerKey(5);
const DRIVER: PeerKey = PeerKey(1);
const PREV: PeerKey = PeerKey(2);

/// Stage 2 of 4 in allreduce mode at round 3; microbatches of up to 2 samples of 3 tokens,
/// 4 values per sample at a boundary.
fn serving() -> Serving {
    Serving {
        stage: Some(2),
        last: false,
        round: Some(3),
        microbatch: 2,
        activation_values: 4,
        activation_codecs: HopCodec::fixed(Codec::Fp32),
        hop_lifetime: Duration::from_secs(1),
        max_hops: 64,
    }
}

fn forward(id: u64, round: u64) -> Forward {
    let acts = crate::codec::encode_to_vec(Codec::Fp32, &[0.5; 8], &[8]).unwrap();
    Forward {
        id,
        sample: 100 + id,
        round,
        rows: 2,
        route: vec![DRIVER, PREV],
        activations: acts,
    }
}

/// The backward pass of attempt 1 is done here: its gradient (fp32) goes back.
fn backward_done(s: &mut StageServer, out: &mut Outbox, at: &Serving) {
    let fp32 = |_, _| Codec::Fp32;
    s.on_backward_done(out, ME, 1, Some(vec![0.0; 8]), false, at, fp32, MS);
}

#[test]
fn a_forward_pass_that_does_not_fit_the_run_is_rejected_to_its_driver() {
    let mut s = StageServer::default();
    let mut out = Outbox::new(ME);
    let bad = [
        Forward {
            route: vec![DRIVER],
            ..forward(1, 3)
        },
        Forward {
            rows: 3,
            ..forward(2, 3)
        },
        Forward {
            activations: vec![1, 2, 3],
            ..forward(4, 3)
        },
    ];
    for f in bad {
        assert_eq!(
            s.on_forward(&mut out, PREV, f, &serving(), Duration::ZERO),
            Arrival::Rejected
        );
    }
    // Not from the route's last peer.
    assert_eq!(
        s.on_forward(
            &mut out,
            PeerKey(9),
            forward(5, 3),
            &serving(),
            Duration::ZERO
        ),
        Arrival::Rejected
    );
    let rejected: Vec<Message> = sends(&mut out).into_iter().map(|s| s.1).collect();
    assert_eq!(rejected.len(), 4);
    assert!(jobs(&mut out).is_empty());
    // A good one runs; its id cannot be used twice.
    let at = serving();
    assert_eq!(
        s.on_forward(&mut out, PREV, forward(6, 3), &at, Duration::ZERO),
        Arrival::Running
    );
    assert_eq!(
        s.on_forward(&mut out, PREV, forward(6, 3), &at, Duration::ZERO),
        Arrival::Rejected
    );
    assert_eq!(s.next_timeout(), Some(at.hop_lifetime));
}

/// A flood of well-formed forwards: records stop at the cap, the rest go back to their
/// drivers (an honest refusal, not a violation), and room comes back as records expire.
#[test]
fn forwards_past_the_record_cap_are_refused() {
    let mut s = StageServer::default();
    let mut out = Outbox::new(ME);
    let at = serving();
    let running = (0..200)
        .filter(|id| {
            s.on_forward(&mut out, PREV, forward(*id, 3), &at, Duration::ZERO) == Arrival::Running
        })
        .count();
    assert_eq!(running, at.max_hops);
    assert_eq!(out.violations, 0);
    let refused = sends(&mut out)
        .iter()
        .filter(|(to, m)| *to == DRIVER && matches!(m, Message::Reject { .. }))
        .count();
    assert_eq!(refused, 200 - at.max_hops);
    s.expire(&mut out, at.hop_lifetime);
    assert_eq!(
        s.on_forward(&mut out, PREV, forward(500, 3), &at, at.hop_lifetime),
        Arrival::Running
    );
}

/// Held forwards: a microbatch of a later step waits until this replica took the steps
/// before it, then runs; the time the first one arrived is the evidence a starving stage
/// needs.
#[test]
fn a_forward_pass_of_a_later_step_waits_for_it() {
    let mut s = StageServer::default();
    let mut out = Outbox::new(ME);
    assert_eq!(
        s.on_forward(&mut out, PREV, forward(1, 4), &serving(), 10 * MS),
        Arrival::Held
    );
    assert!(jobs(&mut out).is_empty());
    assert_eq!(s.next_step_waiting_since(3), Some(10 * MS));
    assert_eq!(s.next_step_waiting_since(4), None);
    assert!(s.release_held_forwards(3).is_empty());
    let due = s.release_held_forwards(4);
    assert_eq!(due.len(), 1);
    let mut at = serving();
    at.round = Some(4);
    let h = due.into_iter().next().unwrap();
    assert_eq!(
        s.on_forward(&mut out, h.from, h.forward, &at, 20 * MS),
        Arrival::Running
    );
    // DiLoCo replicas step on their own: nothing is held.
    at.round = None;
    assert_eq!(
        s.on_forward(&mut out, PREV, forward(2, 9), &at, 20 * MS),
        Arrival::Running
    );
    // The hold is bounded.
    for id in 0..MAX_HELD_FORWARDS as u64 {
        s.on_forward(&mut out, PREV, forward(10 + id, 5), &serving(), 20 * MS);
    }
    assert_eq!(
        s.on_forward(&mut out, PREV, forward(9999, 5), &serving(), 20 * MS),
        Arrival::Rejected
    );
}

/// A commit adds a hop's gradient; the samples of queued commits count toward the step
/// until the commit job is done.
#[test]
fn a_commit_counts_until_its_job_is_done_and_aborts_a_hop_without_backward() {
    let mut s = StageServer::default();
    let mut out = Outbox::new(ME);
    let at = serving();
    s.on_forward(&mut out, PREV, forward(1, 3), &at, Duration::ZERO);
    s.sent(1, PeerKey(7));
    backward_done(&mut s, &mut out, &at);
    jobs(&mut out);
    s.on_commit(&mut out, DRIVER, 1);
    assert_eq!(jobs(&mut out), [Job::Commit { id: 1 }]);
    assert_eq!(s.commits_queued(), 2.0);
    assert_eq!(s.committed(1).map(|c| c.sample), Some(101));
    assert_eq!(s.commits_queued(), 0.0);
    assert_eq!(s.committed(1), None, "once");
    s.on_forward(&mut out, PREV, forward(3, 3), &at, Duration::ZERO);
    jobs(&mut out);
    s.on_commit(&mut out, DRIVER, 3);
    assert_eq!(jobs(&mut out), [Job::Abort { id: 3 }]);
}

#[test]
fn a_gradient_goes_back_along_the_route_from_the_right_peer_once() {
    let mut s = StageServer::default();
    let mut out = Outbox::new(ME);
    let at = serving();
    s.on_forward(&mut out, PREV, forward(1, 3), &at, Duration::ZERO);
    s.sent(1, PeerKey(7));
    jobs(&mut out);
    let back = |from| Backward {
        id: 1,
        route: vec![DRIVER, PREV, ME, from],
        grad: Vec::new(),
    };
    // Not from where the activations went, or the wrong size: ignored.
    s.on_backward(
        &mut out,
        PeerKey(8),
        back(PeerKey(8)),
        vec![0.0; 8],
        &at,
        MS,
    );
    s.on_backward(
        &mut out,
        PeerKey(7),
        back(PeerKey(7)),
        vec![0.0; 7],
        &at,
        MS,
    );
    assert!(jobs(&mut out).is_empty());
    s.on_backward(
        &mut out,
        PeerKey(7),
        back(PeerKey(7)),
        vec![0.0; 8],
        &at,
        MS,
    );
    assert!(matches!(jobs(&mut out)[..], [Job::Backward { id: 1, .. }]));
    backward_done(&mut s, &mut out, &at);
    let sent = sends(&mut out);
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].0, PREV, "to the previous stage on the route");
    // The driver's abort drops the record; a stale record expires.
    s.on_abort(&mut out, DRIVER, 1);
    assert_eq!(jobs(&mut out), [Job::Abort { id: 1 }]);
    s.on_forward(&mut out, PREV, forward(2, 3), &at, Duration::ZERO);
    jobs(&mut out);
    s.expire(&mut out, at.hop_lifetime);
    assert_eq!(jobs(&mut out), [Job::Abort { id: 2 }]);
    assert_eq!(s.next_timeout(), None);
}

/// Only a microbatch's driver commits or aborts it (attempt ids travel on the route, so
/// any hop knows them); anything else is a violation and changes nothing.
#[test]
fn a_commit_or_abort_from_another_peer_is_a_violation() {
    let mut s = StageServer::default();
    let mut out = Outbox::new(ME);
    let at = serving();
    s.on_forward(&mut out, PREV, forward(1, 3), &at, Duration::ZERO);
    s.sent(1, PeerKey(7));
    backward_done(&mut s, &mut out, &at);
    jobs(&mut out);
    out.drain();
    s.on_commit(&mut out, PeerKey(7), 1);
    s.on_abort(&mut out, PREV, 1);
    assert!(jobs(&mut out).is_empty());
    assert_eq!(out.violations, 2);
    s.on_commit(&mut out, DRIVER, 1);
    assert_eq!(jobs(&mut out), [Job::Commit { id: 1 }]);
}

/// Forged forward passes (not from the route's last peer, of no size, not finite, in a
/// codec the run does not allow) are violations of their sender; a forward pass for another stage
/// (an old view of the membership) or two steps ahead (a lagging receiver) is only
/// rejected.
#[test]
fn forged_forward_passes_are_attributed_to_their_sender() {
    let mut s = StageServer::default();
    let mut out = Outbox::new(ME);
    let at = serving();
    let forged = [
        (PeerKey(9), forward(1, 3)),
        (
            PREV,
            Forward {
                rows: 0,
                ..forward(2, 3)
            },
        ),
        (
            PREV,
            Forward {
                activations: crate::swarm::fixtures::poisoned(8),
                ..forward(6, 3)
            },
        ),
        (
            PREV,
            Forward {
                activations: crate::codec::encode_to_vec(Codec::Bf16, &[0.5; 8], &[8]).unwrap(),
                ..forward(9, 3)
            },
        ),
    ];
    for (from, f) in forged {
        assert_eq!(s.on_forward(&mut out, from, f, &at, MS), Arrival::Rejected);
    }
    assert_eq!(out.violations, 4);
    // Two steps ahead: this replica may be the one lagging (restarted from a checkpoint),
    // so the driver is only told to retry elsewhere.
    assert_eq!(
        s.on_forward(&mut out, PREV, forward(5, 3 + 2), &at, MS),
        Arrival::Rejected
    );
    assert_eq!(out.violations, 4);
    let other_stage = Forward {
        route: vec![DRIVER],
        ..forward(7, 3)
    };
    assert_eq!(
        s.on_forward(&mut out, DRIVER, other_stage, &at, MS),
        Arrival::Rejected
    );
    assert_eq!(out.violations, 4, "an honest miss");
    assert_eq!(
        s.on_forward(&mut out, PREV, forward(8, 4), &at, MS),
        Arrival::Held
    );
}

#[test]
fn drivers_hear_at_once_of_work_stuck_at_a_gone_peer_or_a_replaced_stage() {
    let mut s = StageServer::default();
    let mut out = Outbox::new(ME);
    let at = serving();
    s.on_forward(&mut out, PREV, forward(1, 3), &at, Duration::ZERO);
    s.on_forward(&mut out, PREV, forward(2, 3), &at, Duration::ZERO);
    s.sent(1, PeerKey(7));
    s.sent(2, PeerKey(8));
    s.reject_routed_through(&mut out, PeerKey(7), false);
    assert_eq!(sends(&mut out), [(DRIVER, Message::Reject { id: 1 })]);
    // Its gradient back, hop 2 is done but for the commit: unreachable, its next hop
    // holds it up no longer; gone, it took its part of the work, and the driver is told.
    let back = Backward {
        id: 2,
        route: vec![DRIVER, PREV, ME, PeerKey(8)],
        grad: Vec::new(),
    };
    assert!(s.on_backward(&mut out, PeerKey(8), back, vec![0.0; 8], &at, MS));
    s.on_backward_done(
        &mut out,
        ME,
        2,
        Some(vec![0.0; 8]),
        false,
        &at,
        |_, _| Codec::Fp32,
        MS,
    );
    out.drain();
    s.reject_routed_through(&mut out, PeerKey(8), false);
    assert!(sends(&mut out).is_empty());
    s.reject_routed_through(&mut out, PeerKey(8), true);
    assert_eq!(sends(&mut out), [(DRIVER, Message::Reject { id: 2 })]);
    assert!(s.holds(2), "a commit sent meanwhile still counts here");
    s.abandon(&mut out);
    assert_eq!(sends(&mut out).len(), 2);
    assert_eq!(s.next_timeout(), None);
}

/// A hop whose gradient came from a replica out of line drops its parameter gradient and tells
/// the stage before to drop its own; a hop told so by the peer it sent to runs no backward
/// pass and passes the word on. Either way the driver's commit still counts the samples
/// (its job finds nothing pending), and only the peer the activations went to can say it.
#[test]
fn a_discarded_gradient_is_dropped_along_the_route_and_its_commit_adds_nothing() {
    const NEXT: PeerKey = PeerKey(7);
    let at = serving();
    let route = vec![DRIVER, PREV, ME, NEXT];
    let back = |id| Backward {
        id,
        route: route.clone(),
        grad: Vec::new(),
    };
    let discarded = |id| Message::Discarded {
        id,
        route: route.clone(),
    };
    let mut s = StageServer::default();
    let mut out = Outbox::new(ME);
    for id in [1, 2] {
        s.on_forward(&mut out, PREV, forward(id, 3), &at, Duration::ZERO);
        s.sent(id, NEXT);
    }
    jobs(&mut out);
    out.drain();

    // Judged here: no gradient goes back, the word does.
    assert!(s.on_backward(&mut out, NEXT, back(1), vec![0.0; 8], &at, MS));
    assert_eq!(jobs(&mut out).len(), 1, "its backward pass");
    s.on_backward_done(
        &mut out,
        ME,
        1,
        Some(vec![0.0; 8]),
        true,
        &at,
        |_, _| Codec::Fp32,
        MS,
    );
    assert_eq!(jobs(&mut out), [Job::Abort { id: 1 }]);
    assert_eq!(sends(&mut out), [(PREV, discarded(1))]);

    // Judged after: only the peer the activations went to is heard, once.
    assert!(!s.on_discarded(&mut out, PeerKey(9), 2, route.clone(), &at, MS));
    assert!(s.on_discarded(&mut out, NEXT, 2, route.clone(), &at, MS));
    assert_eq!(jobs(&mut out), [Job::Abort { id: 2 }]);
    assert_eq!(sends(&mut out), [(PREV, discarded(2))]);
    assert!(!s.on_discarded(&mut out, NEXT, 2, route.clone(), &at, MS));
    assert!(!s.on_backward(&mut out, NEXT, back(2), vec![0.0; 8], &at, MS));
    assert!(jobs(&mut out).is_empty() && out.drain().is_empty());

    // The driver commits both: the samples count toward the step.
    for id in [1, 2] {
        s.on_commit(&mut out, DRIVER, id);
        assert_eq!(jobs(&mut out), [Job::Commit { id }]);
        assert_eq!(s.committed(id).map(|c| c.rows), Some(2));
    }
}
