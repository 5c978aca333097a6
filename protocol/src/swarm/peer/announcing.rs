//! What this peer tells the others of itself: its announcements, and the route tallies
//! they carry to the peers that check its stage-mates' claims (see
//! [`crate::swarm::claims`]).

use super::Peer;
use crate::swarm::interface::Action;
use crate::swarm::message::{Announcement, MemberState, Message, Routed};

impl Peer {
    /// The announcement this peer gossips next (with no route tallies: those go to the peers
    /// that check them, in `announcement_since`).
    pub fn announcement(&mut self) -> Announcement {
        let round = self.steps.round();
        self.announcement_with(Routed {
            first: round,
            rows: Vec::new(),
        })
    }

    /// An announcement with this peer's route tallies of the rounds since `told`, the round
    /// up to which it last told the same listeners (the caller keeps the announcement's
    /// `round` as the next `told`): each round's tally goes out about once per channel, not
    /// with every announcement.
    pub(super) fn announcement_since(&mut self, told: u64) -> Announcement {
        let round = self.steps.round();
        let routed = if matches!(self.role.serving(), Some(0 | 1)) {
            self.witness.routed(told, round)
        } else {
            Routed {
                first: round,
                rows: Vec::new(),
            }
        };
        self.announcement_with(routed)
    }

    fn announcement_with(&mut self, routed: Routed) -> Announcement {
        self.announcements += 1;
        self.announced_throughput = self.out.jobs.throughput();
        let (stage, state) = self.role.announced();
        Announcement {
            stage,
            state,
            throughput: self.announced_throughput as f32,
            queue: self.out.jobs.queued(),
            step: self.steps.step(),
            round: self.steps.round(),
            params_hash: self.steps.params_hash(),
            finished: self.is_finished(),
            newcomer: self.steps.newcomer(stage, &self.members),
            loss: self.steps.last_loss(),
            memory: self.memory,
            offloads: self.offloads,
            incarnation: self.incarnation,
            seq: self.announcements,
            accuses: self.bans.accusations(),
            held_out: self.evaluator.latest(),
            routed,
        }
    }

    /// The peer is shutting down: tell the others.
    pub fn leave(&mut self) -> Announcement {
        let mut a = self.announcement();
        a.state = MemberState::Leaving;
        a
    }

    /// A step: the peers that need it at once (this stage's replicas for the hash vote, the
    /// stages next to it) are told directly; gossip would make every peer of a large swarm
    /// forward every replica's every step. The last step goes to everyone: every stage waits
    /// for the others to finish.
    pub(super) fn announce_near(&mut self) {
        let a = self.announcement_since(self.told_near);
        self.told_near = a.round;
        if a.finished {
            self.out.push(Action::Announce(a));
            return;
        }
        for k in crate::swarm::membership::near_peers(self.role.serving(), &self.members) {
            self.out.send(k, Message::Announce(a.clone()));
        }
    }

    pub(super) fn announce(&mut self) {
        let a = self.announcement();
        self.out.push(Action::Announce(a));
    }
}
