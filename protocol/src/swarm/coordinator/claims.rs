//! The stage's check of its replicas' sample claims against what their witnesses saw (see
//! [`crate::swarm::claims`]): the witnesses' tallies heard, the claims of each round finished,
//! and the weights of the rounds to come.

use super::StepCoordinator;
use crate::swarm::PeerKey;
use crate::swarm::claims::DISCOUNTED;
use crate::swarm::interface::Event;
use crate::swarm::membership::Membership;
use crate::swarm::message::{RoundKey, Routed};
use crate::swarm::outbox::Outbox;
use std::collections::BTreeMap;

impl StepCoordinator {
    /// A witness of this stage's claims (a driver, or for the first stage a second-stage
    /// replica) that completed `completed` rounds announced the samples it committed with each
    /// replica lately (see [`super::claims`]).
    pub fn heard_routes(
        &mut self,
        witness: PeerKey,
        completed: u64,
        routed: &Routed,
        members: &Membership,
        stage: u32,
    ) {
        if routed.rows.is_empty() && !self.claims.waits_for(witness) {
            return;
        }
        // A hop not known yet may be a replica of this stage this peer has not heard of: its
        // rows count (the first tally of a round heard is the one kept).
        let mine = |k| {
            members
                .get(k)
                .is_none_or(|m| m.announcement.stage == Some(stage))
        };
        self.claims.heard(witness, completed, routed, mine);
    }

    /// The credit of each stage-mate whose claims exceeded what its witnesses saw (see
    /// [`super::claims`]).
    pub fn credits(&self) -> &BTreeMap<PeerKey, f64> {
        &self.rounds.credits
    }

    /// This replica serves another stage now: its check of the last one's claims goes.
    pub fn left_stage(&mut self) {
        self.claims.clear();
        self.discounted.clear();
        self.rounds.credits.clear();
    }

    /// The round `key` of this stage finished with these claims: checks what can be checked
    /// and sets the weights of the rounds to come.
    pub(super) fn check_claims(
        &mut self,
        out: &mut Outbox,
        key: RoundKey,
        claims: &[(PeerKey, f64)],
    ) {
        self.claims.claimed(key.index, claims);
        self.claims.settle();
        self.rounds.credits = self.claims.credits();
        for (&peer, &credit) in &self.rounds.credits {
            // Told on the first fall below the mark and on every halving after it.
            let told = self
                .discounted
                .get(&peer)
                .copied()
                .unwrap_or(2.0 * DISCOUNTED);
            if credit < told / 2.0 {
                self.discounted.insert(peer, credit);
                out.event(Event::Discounted { peer, credit });
            }
        }
        let credits = &self.rounds.credits;
        self.discounted
            .retain(|k, _| credits.get(k).is_some_and(|c| *c < DISCOUNTED));
    }
}
