//! Sample claims checked against what their witnesses saw, in a whole swarm: inflated claims
//! are discounted by every stage-mate, honest ones are not.

use super::*;
use crate::swarm::attack::{Attack, Behavior};
use crate::swarm::claims;

/// A driver and a middle-stage replica that claim four times the samples they computed on are
/// weighed by every stage-mate at about what their witnesses committed with them (the second
/// stage for the driver, the drivers for the middle stage); nobody else is discounted.
#[test]
fn a_replica_claiming_more_samples_than_its_routes_weighs_what_they_carried() {
    inflated_claims_are_discounted(SyncMode::diloco(2), 40);
    inflated_claims_are_discounted(SyncMode::AllReduce, 30);
}

fn inflated_claims_are_discounted(sync: SyncMode, steps: u64) {
    let mut s = Swarm::new(3, sync, steps);
    for (k, stage) in [(1, 0), (2, 0), (3, 1), (4, 1), (5, 1), (6, 2), (7, 2)] {
        s.add_at(k, 1, Some(stage));
        if k == 2 || k == 4 {
            let peer = &mut s.peers.get_mut(&PeerKey(k)).expect("added").0;
            peer.set_attack(Attack::new(Behavior::Inflate(4.0), Duration::ZERO, 3));
        }
        let t = s.now + 200 * MS;
        s.run_until(t);
    }
    s.run_until(Duration::from_secs(120));
    assert!(s.all_finished(), "{sync:?}");
    let mut lowest: BTreeMap<(PeerKey, PeerKey), f64> = BTreeMap::new();
    for (by, e) in &s.events {
        if let Event::Discounted { peer, credit } = e {
            let l = lowest.entry((*by, *peer)).or_insert(1.0);
            *l = l.min(*credit);
        }
    }
    let judged: Vec<(u64, u64)> = lowest.keys().map(|k| (k.0.0, k.1.0)).collect();
    assert_eq!(judged, [(1, 2), (3, 4), (5, 4)], "{sync:?}: {lowest:?}");
    assert!(
        lowest.values().all(|c| *c < claims::DISCOUNTED),
        "{lowest:?}"
    );
    // At the end: about a quarter (a round's worth is forgiven over the window), and every
    // honest replica's claim within a little of what its witnesses saw.
    for (k, (peer, _, _)) in &s.peers {
        for (member, credit) in peer.claim_credits() {
            let bounds = if [2, 4].contains(&member.0) {
                0.15..0.4
            } else {
                0.8..1.0
            };
            assert!(
                bounds.contains(credit),
                "{sync:?}: {k:?} gives {member:?} {credit}"
            );
        }
    }
    for stage in 0..3 {
        let h = s.hashes(stage);
        assert!(h.windows(2).all(|w| w[0] == w[1]), "stage {stage}: {h:?}");
    }
}
