//! What the parts of a peer ask of the world, in the order they ask it: messages to send and
//! events to report (drained by the owner as [`Action`]s), and compute jobs, which wait in the
//! device's [`Scheduler`] until the device is free.

use super::PeerKey;
use super::interface::{Action, Event, Job};
use super::message::Message;
use super::scheduler::Scheduler;
use std::collections::VecDeque;

/// The peer's outgoing actions and its job queue.
#[derive(Debug)]
pub(super) struct Outbox {
    me: PeerKey,
    actions: VecDeque<Action>,
    /// Compute jobs waiting for the device.
    pub jobs: Scheduler,
    /// Protocol violations reported so far.
    pub violations: u64,
    /// What this peer's rounds showed of the other members, not yet judged (see
    /// [`super::bans`]).
    pub evidence: Vec<super::bans::Evidence>,
    /// The stages and groups of the rounds finished here, not yet noted in the membership
    /// (who was left out, see [`super::membership::Membership::round_finished`]).
    pub finished_groups: Vec<(u32, Vec<PeerKey>)>,
}

impl Outbox {
    /// An empty outbox of peer `me`.
    pub fn new(me: PeerKey) -> Self {
        Outbox {
            me,
            actions: VecDeque::new(),
            jobs: Scheduler::default(),
            violations: 0,
            evidence: Vec::new(),
            finished_groups: Vec::new(),
        }
    }

    /// Sends `msg` to `to` (never to this peer itself).
    pub fn send(&mut self, to: PeerKey, msg: Message) {
        if to != self.me {
            self.actions.push_back(Action::Send { to, msg });
        }
    }

    /// Tells the owner something.
    pub fn event(&mut self, e: Event) {
        self.actions.push_back(Action::Event(e));
    }

    /// `peer` broke the protocol: its message is dropped (by the caller) and this is
    /// reported to the owner, attributed to it.
    pub fn violation(&mut self, peer: PeerKey, what: &'static str) {
        self.violations += 1;
        self.event(Event::Violation { peer, what });
    }

    /// Queues a compute job.
    pub fn compute(&mut self, job: Job) {
        self.jobs.enqueue(job);
    }

    /// Hands an action to the owner as it is (gossip, a compute job the device starts now).
    pub fn push(&mut self, action: Action) {
        self.actions.push_back(action);
    }

    /// The next action for the owner.
    pub fn pop(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Takes every action out (tests look at what a part asked for).
    #[cfg(test)]
    pub fn drain(&mut self) -> Vec<Action> {
        self.actions.drain(..).collect()
    }
}
