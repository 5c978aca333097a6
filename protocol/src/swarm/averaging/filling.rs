//! Filling in the averaged parts whose owner went quiet (or is gone): asking the other members
//! for them, and giving a part up once every member asked said it does not have it.

use super::{Phase, Round, RoundMsg, RoundOut};
use crate::swarm::PeerKey;
use std::time::Duration;

impl Round {
    /// The members asked for part `j`: every one still there but its owner and this member.
    fn asked_for(&self, j: usize) -> impl Iterator<Item = PeerKey> + '_ {
        let me = self.my_index();
        self.group
            .iter()
            .enumerate()
            .filter(move |(i, k)| *i != j && Some(*i) != me && !self.gone.contains(k))
            .map(|(_, k)| *k)
    }

    /// Owners that went quiet (or are gone): ask every other member still there for their
    /// parts.
    pub(super) fn start_filling(&mut self, now: Duration) {
        for j in 0..self.group.len() {
            if self.averaged[j].is_some() {
                continue;
            }
            let asked: Vec<PeerKey> = self.asked_for(j).collect();
            for k in asked {
                self.out.push_back(RoundOut::Send(
                    k,
                    RoundMsg::Request {
                        attempt: self.attempt,
                        part: j as u32,
                    },
                ));
            }
        }
        self.phase = Phase::Filling;
        self.deadline = Some(now + self.patience() / 2);
        self.maybe_give_up_fill(now);
    }

    /// Gives up the parts still missing once every member asked answered that it lacks them
    /// (they are then zero, and voted as refused).
    pub(super) fn maybe_give_up_fill(&mut self, now: Duration) {
        if self.phase != Phase::Filling {
            return;
        }
        let all_said_missing = |j: usize| {
            let answers = self.missing_answers.get(&(j as u32));
            self.asked_for(j)
                .all(|k| answers.is_some_and(|a| a.contains(&k)))
        };
        let missing: Vec<usize> = (0..self.group.len())
            .filter(|j| self.averaged[*j].is_none())
            .collect();
        if missing.iter().all(|j| all_said_missing(*j)) {
            self.vote(missing.iter().map(|j| *j as u32).collect(), now);
        }
    }
}
