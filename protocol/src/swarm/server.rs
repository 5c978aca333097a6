//! The stage server: the microbatch work a replica does for the drivers of the run.
//!
//! A forward pass arrives from the previous stage; the server checks it against the run's
//! shape, holds it if it belongs to a step this replica has not reached, runs it, passes the
//! activations on (the peer picks the next replica) and keeps a [`Hop`] record until the
//! gradient comes back, runs the backward pass and sends the gradient of its input back along
//! the route. The parameter gradient stays pending until the driver commits the attempt.
//! Records that outlive every attempt of their microbatch are dropped.
//!
//! The driver's own microbatches run on the same replica; the server keeps their pending
//! commits too, so that every commit of the stage goes through one place.

use super::PeerKey;
use super::interface::{Event, Input, Job};
use super::message::{Backward, Forward, Message};
use super::norms::{self, NormReference};
use super::outbox::Outbox;
use crate::{Codec, Decoder, Encoder, HopCodec};
use std::collections::BTreeMap;
use std::time::Duration;

/// Forwards of later steps a replica holds at most (each is a microbatch's activations).
pub(super) const MAX_HELD_FORWARDS: usize = 256;

/// A microbatch attempt this replica computes for a driver.
#[derive(Clone, Debug)]
pub(super) struct Hop {
    sample: u64,
    round: u64,
    route: Vec<PeerKey>,
    rows: u32,
    /// Where its activations went.
    next: Option<PeerKey>,
    backward_done: bool,
    loss: Option<f32>,
    /// When the record is dropped if the driver neither commits nor aborts it.
    expires: Duration,
}

/// An attempt whose gradient waits for (or is in) its commit job.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct PendingCommit {
    /// The microbatch's driver.
    pub driver: PeerKey,
    /// The microbatch's first sample.
    pub sample: u64,
    /// Samples in it.
    pub rows: u32,
    /// Its loss (last stage).
    pub loss: Option<f32>,
}

/// A forward pass held until this replica reaches its step.
#[derive(Clone, Debug)]
pub(super) struct HeldForward {
    /// Who sent it.
    pub from: PeerKey,
    /// The message.
    pub forward: Forward,
    /// When it arrived.
    pub at: Duration,
}

/// What a microbatch's activations carry to the next stage besides the values.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct ForwardHeader {
    /// The peers it passed, driver first, this one last.
    pub route: Vec<PeerKey>,
    /// Samples in it.
    pub rows: u32,
    /// Its first sample.
    pub sample: u64,
    /// The round it counts toward.
    pub round: u64,
}

/// What became of an incoming forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Arrival {
    /// Its forward pass is queued.
    Running,
    /// It belongs to a later step; it waits here.
    Held,
    /// Refused; its driver was told.
    Rejected,
}

/// Where this replica stands, as the checks of an incoming microbatch need it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Serving {
    /// The stage served, if serving.
    pub stage: Option<u32>,
    /// The last stage of the pipeline.
    pub last: bool,
    /// Steps taken (microbatches of later steps are held), in allreduce mode; None in
    /// DiLoCo, where every replica steps on its own.
    pub round: Option<u64>,
    /// Samples in the largest microbatch.
    pub microbatch: u32,
    /// Activation values per sample at a stage boundary.
    pub activation_values: usize,
    /// The codecs the run allows activations in.
    pub activation_codecs: HopCodec,
    /// How long a record lives without news from its driver.
    pub hop_lifetime: Duration,
    /// Microbatch records kept at most; past it, new forwards are refused (their drivers
    /// retry elsewhere) until records are committed, aborted or expire.
    pub max_hops: usize,
}

impl Serving {
    /// The hop of `route` (driver first, one peer per stage) that sent this stage its
    /// activations: where gradients, or the word that none comes, go back.
    fn previous_hop(&self, route: &[PeerKey]) -> Option<PeerKey> {
        let stage = self.stage?.checked_sub(1)?;
        route.get(stage as usize).copied()
    }
}

/// The replica's microbatch work for others, and its pending commits.
#[derive(Debug, Default)]
pub(super) struct StageServer {
    hops: BTreeMap<u64, Hop>,
    committing: BTreeMap<u64, PendingCommit>,
    /// Samples in commit jobs queued and not yet done.
    commits_queued: f64,
    held_forwards: Vec<HeldForward>,
    encoder: Encoder,
    /// Sizes of the activations accepted lately (see [`super::norms`]).
    pub activation_norms: NormReference,
    /// Sizes of the activation gradients accepted lately.
    pub gradient_norms: NormReference,
}

/// What no honest peer sends in a forward pass, for training or held out: the sender not
/// the route's last peer, a size outside the run's, an attempt id `repeated` here, a codec the
/// run does not allow.
pub(super) fn forged_forward(
    f: &Forward,
    from: PeerKey,
    at: &Serving,
    repeated: bool,
) -> Option<&'static str> {
    if f.route.last() != Some(&from) {
        Some("a forward pass whose route does not end with its sender")
    } else if f.rows == 0 || f.rows > at.microbatch {
        Some("a forward pass of a size outside the run's")
    } else if repeated {
        Some("a forward pass repeating an attempt id")
    } else if !at.activation_codecs.allows(&f.activations) {
        Some("activations in a codec the run does not allow")
    } else {
        None
    }
}

/// A forward pass's activations, decoded to the size its rows make and of a scale `admit`
/// takes (against what the stage accepted lately); otherwise None: the sender's violation is
/// reported and `driver` told, so it retries elsewhere.
pub(super) fn accepted_activations(
    out: &mut Outbox,
    from: PeerKey,
    driver: PeerKey,
    f: &Forward,
    at: &Serving,
    admit: impl FnOnce(f64) -> bool,
) -> Option<Vec<f32>> {
    let expect = at.activation_values * f.rows as usize;
    let refused = match decode(&f.activations, expect).filter(|a| a.len() == expect) {
        None => "activations malformed, of the wrong size or not finite",
        Some(acts) if admit(norms::rms(&acts)) => return Some(acts),
        Some(_) => "activations far larger than this stage has seen",
    };
    out.violation(from, refused);
    out.send(driver, Message::Reject { id: f.id });
    None
}

/// Decodes a tensor of at most `max` values; None if it is malformed.
pub(super) fn decode(bytes: &[u8], max: usize) -> Option<Vec<f32>> {
    let mut values = Vec::new();
    Decoder::with_max_elements(max)
        .decode(bytes, &mut values)
        .ok()
        .map(|_| values)
}

impl StageServer {
    /// Samples in commit jobs queued and not yet done.
    pub fn commits_queued(&self) -> f64 {
        self.commits_queued
    }

    /// Where `attempt`'s activations went, if it is a microbatch this replica computes.
    pub fn next_of(&self, attempt: u64) -> Option<PeerKey> {
        self.hops.get(&attempt).and_then(|h| h.next)
    }

    /// Whether `attempt` is a microbatch this replica computes for a driver.
    pub fn holds(&self, attempt: u64) -> bool {
        self.hops.contains_key(&attempt)
    }

    /// When the next record expires.
    pub fn next_timeout(&self) -> Option<Duration> {
        self.hops.values().map(|h| h.expires).min()
    }

    /// The earliest arrival of a held forward pass of a step after `round`: evidence that
    /// the drivers have moved on.
    pub fn next_step_waiting_since(&self, round: u64) -> Option<Duration> {
        self.held_forwards
            .iter()
            .filter(|h| h.forward.round > round)
            .map(|h| h.at)
            .min()
    }

    /// A forward pass arrived. It must come from the last peer of its route, for this stage
    /// (its route's length), with a sane size and a fresh attempt id; otherwise its driver is
    /// told at once so it retries elsewhere. One of a later step waits (at most
    /// [`MAX_HELD_FORWARDS`]) until this replica took the steps before it, so that its gradient
    /// is computed on the parameters it will update (a gradient a step stale costs accuracy).
    pub fn on_forward(
        &mut self,
        out: &mut Outbox,
        from: PeerKey,
        f: Forward,
        at: &Serving,
        now: Duration,
    ) -> Arrival {
        let here = f.route.len() as u32;
        let driver = f.route.first().copied().unwrap_or(from);
        let forged = forged_forward(&f, from, at, self.hops.contains_key(&f.id));
        if let Some(what) = forged {
            out.violation(from, what);
        }
        // Not for this stage (the sender's view of the membership is a little old, or this
        // replica is syncing), or more than one step ahead of this replica (no driver starts a
        // microbatch before its stage applied the step before, but this replica may lag, e.g.
        // restarted from a checkpoint): an honest miss, the driver retries elsewhere.
        let ahead = at
            .round
            .is_some_and(|round| f.round > round.saturating_add(1));
        if forged.is_some() || ahead || at.stage != Some(here) {
            out.send(driver, Message::Reject { id: f.id });
            return Arrival::Rejected;
        }
        if self.hops.len() >= at.max_hops {
            // Busy (or flooded): an honest refusal; the driver retries elsewhere.
            out.send(driver, Message::Reject { id: f.id });
            return Arrival::Rejected;
        }
        if at.round.is_some_and(|round| f.round > round) {
            if self.held_forwards.len() < MAX_HELD_FORWARDS {
                self.held_forwards.push(HeldForward {
                    from,
                    forward: f,
                    at: now,
                });
                return Arrival::Held;
            }
            out.send(driver, Message::Reject { id: f.id });
            return Arrival::Rejected;
        }
        let seen = &mut self.activation_norms;
        let Some(acts) = accepted_activations(out, from, driver, &f, at, |rms| seen.admits(rms))
        else {
            return Arrival::Rejected;
        };
        self.hops.insert(
            f.id,
            Hop {
                sample: f.sample,
                round: f.round,
                route: f.route,
                rows: f.rows,
                next: None,
                backward_done: false,
                loss: None,
                expires: now + at.hop_lifetime,
            },
        );
        out.compute(Job::Forward {
            id: f.id,
            rows: f.rows,
            sample: f.sample,
            input: Input::Activations(acts),
            held_out: false,
        });
        Arrival::Running
    }

    /// The held forward passes of steps up to `round`, to run now.
    pub fn release_held_forwards(&mut self, round: u64) -> Vec<HeldForward> {
        let (due, keep) = std::mem::take(&mut self.held_forwards)
            .into_iter()
            .partition(|h| h.forward.round <= round);
        self.held_forwards = keep;
        due
    }

    /// A hop's loss at the last stage; returns the samples behind it (None: not a hop).
    pub fn record_loss(&mut self, attempt: u64, loss: f32) -> Option<u32> {
        let h = self.hops.get_mut(&attempt)?;
        h.loss = Some(loss);
        Some(h.rows)
    }

    /// What a hop's activations carry on: its route with this peer appended, its samples,
    /// sample and round.
    pub fn forwarding(&self, me: PeerKey, attempt: u64) -> Option<ForwardHeader> {
        let h = self.hops.get(&attempt)?;
        let mut route = h.route.clone();
        route.push(me);
        Some(ForwardHeader {
            route,
            rows: h.rows,
            sample: h.sample,
            round: h.round,
        })
    }

    /// A hop's activations went to `next`.
    pub fn sent(&mut self, attempt: u64, next: PeerKey) {
        if let Some(h) = self.hops.get_mut(&attempt) {
            h.next = Some(next);
        }
    }

    /// A hop cannot go on (no replica of the next stage, or its job failed): its driver is
    /// told, so it retries elsewhere.
    pub fn reject(&mut self, out: &mut Outbox, attempt: u64) {
        if let Some(h) = self.hops.remove(&attempt) {
            if let Some(d) = h.route.first() {
                out.send(*d, Message::Reject { id: attempt });
            }
        }
    }

    /// The gradient of a hop's output came back from the peer it was sent to: run the
    /// backward pass; returns whether it did. Anything else (another sender, a second
    /// gradient, a wrong size) is ignored.
    pub fn on_backward(
        &mut self,
        out: &mut Outbox,
        from: PeerKey,
        b: Backward,
        grad: Vec<f32>,
        at: &Serving,
        now: Duration,
    ) -> bool {
        let Some(h) = self.hops.get_mut(&b.id) else {
            return false;
        };
        if h.next != Some(from)
            || h.backward_done
            || grad.len() != at.activation_values * h.rows as usize
        {
            return false;
        }
        if !self.gradient_norms.admits(norms::rms(&grad)) {
            // Its driver retries the microbatch when its deadline passes.
            out.violation(
                from,
                "an activation gradient far larger than this stage has seen",
            );
            return false;
        }
        h.route = b.route;
        h.expires = now + at.hop_lifetime;
        out.compute(Job::Backward {
            id: b.id,
            grad: Some(grad),
            rows: h.rows,
        });
        true
    }

    /// A hop's backward pass finished: send the gradient of its input to the previous stage
    /// (the last stage appends itself to the route the driver commits along). A `discarded`
    /// one (its gradient came from a replica out of line) drops its parameter gradient, and
    /// the stage before is told to drop its own instead of being sent a gradient.
    #[allow(clippy::too_many_arguments)]
    pub fn on_backward_done(
        &mut self,
        out: &mut Outbox,
        me: PeerKey,
        attempt: u64,
        grad: Option<Vec<f32>>,
        discarded: bool,
        at: &Serving,
        codec: impl FnOnce(PeerKey, usize) -> Codec,
        now: Duration,
    ) {
        let Some(h) = self.hops.get_mut(&attempt) else {
            out.compute(Job::Abort { id: attempt });
            return;
        };
        h.backward_done = true;
        h.expires = now + at.hop_lifetime;
        let mut route = h.route.clone();
        if at.last {
            route.push(me);
        }
        if discarded {
            // The commit that follows adds nothing: its job finds no gradient pending.
            out.compute(Job::Abort { id: attempt });
        }
        let Some(prev) = at.previous_hop(&route) else {
            return;
        };
        if discarded {
            out.send(prev, Message::Discarded { id: attempt, route });
            return;
        }
        // Nothing sent if it cannot be encoded: the driver's deadline retries the microbatch.
        let grad = grad.unwrap_or_default();
        let codec = codec(prev, grad.len());
        let Some(grad) = self.encode(out, codec, &grad) else {
            return;
        };
        out.send(
            prev,
            Message::Backward(Backward {
                id: attempt,
                route,
                grad,
            }),
        );
    }

    /// The peer a hop's activations went to discarded the gradient it got for them: this hop
    /// runs no backward pass and drops the attempt's activations, and the stage before is told
    /// the same. The commit that follows counts the attempt's samples toward the step but adds
    /// no gradient here. Returns whether the message was the hop's answer (from the peer the
    /// activations went to, before any gradient).
    pub fn on_discarded(
        &mut self,
        out: &mut Outbox,
        from: PeerKey,
        attempt: u64,
        route: Vec<PeerKey>,
        at: &Serving,
        now: Duration,
    ) -> bool {
        let Some(h) = self.hops.get_mut(&attempt) else {
            return false;
        };
        if h.next != Some(from) {
            // The attempt id is secret to its route: no honest peer sends this.
            out.violation(
                from,
                "a discarded answer from a peer the microbatch did not go to",
            );
            return false;
        }
        if h.backward_done {
            return false;
        }
        h.route = route;
        out.compute(Job::Abort { id: attempt });
        h.backward_done = true;
        h.expires = now + at.hop_lifetime;
        if let Some(prev) = at.previous_hop(&h.route) {
            let route = h.route.clone();
            out.send(prev, Message::Discarded { id: attempt, route });
        }
        true
    }

    /// Encodes a tensor with `codec`; None (reported) if it cannot be, e.g. values that are
    /// not finite: nothing is sent then.
    pub fn encode(&mut self, out: &mut Outbox, codec: Codec, values: &[f32]) -> Option<Vec<u8>> {
        let mut bytes = Vec::new();
        match self
            .encoder
            .encode(codec, values, &[values.len()], &mut bytes)
        {
            Ok(_) => Some(bytes),
            Err(e) => {
                out.event(Event::Warning(format!("encoding failed: {e}")));
                None
            }
        }
    }

    /// The driver commits a hop: its gradient is added to the step being collected. A hop is
    /// never ahead of that step (a forward pass of a later step waits until this replica
    /// reaches it), so nothing needs holding here. A hop whose backward pass never ran here
    /// is aborted.
    pub fn on_commit(&mut self, out: &mut Outbox, from: PeerKey, attempt: u64) {
        if !self.driven_by(out, from, attempt) {
            return;
        }
        let Some(h) = self.hops.remove(&attempt) else {
            return;
        };
        if !h.backward_done {
            out.compute(Job::Abort { id: attempt });
            return;
        }
        let driver = h.route.first().copied().unwrap_or(from);
        self.expect_commit(attempt, driver, h.sample, h.rows, h.loss);
        self.commit(out, attempt);
    }

    /// Whether `from` drives `attempt` (or it is not a hop here): only a microbatch's driver
    /// commits or aborts it.
    fn driven_by(&self, out: &mut Outbox, from: PeerKey, attempt: u64) -> bool {
        match self.hops.get(&attempt) {
            Some(h) if h.route.first() != Some(&from) => {
                out.violation(from, "a commit or abort of a microbatch it does not drive");
                false
            }
            _ => true,
        }
    }

    /// The driver gave a hop up.
    pub fn on_abort(&mut self, out: &mut Outbox, from: PeerKey, attempt: u64) {
        if self.driven_by(out, from, attempt) && self.hops.remove(&attempt).is_some() {
            out.compute(Job::Abort { id: attempt });
        }
    }

    /// Records an attempt whose gradient will be committed.
    pub fn expect_commit(
        &mut self,
        attempt: u64,
        driver: PeerKey,
        sample: u64,
        rows: u32,
        loss: Option<f32>,
    ) {
        let commit = PendingCommit {
            driver,
            sample,
            rows,
            loss,
        };
        self.committing.insert(attempt, commit);
    }

    /// The loss recorded with a pending commit.
    pub fn pending_loss(&self, attempt: u64) -> Option<f32> {
        self.committing.get(&attempt).and_then(|c| c.loss)
    }

    /// Queues the commit job of a recorded attempt.
    pub fn commit(&mut self, out: &mut Outbox, attempt: u64) {
        self.commits_queued += self
            .committing
            .get(&attempt)
            .map_or(0.0, |c| f64::from(c.rows));
        out.compute(Job::Commit { id: attempt });
    }

    /// A commit job finished (`done`) or failed: the attempt is no longer pending. Returns
    /// it, with what the step needs to count it.
    pub fn committed(&mut self, attempt: u64) -> Option<PendingCommit> {
        let c = self.committing.remove(&attempt)?;
        self.commits_queued = (self.commits_queued - f64::from(c.rows)).max(0.0);
        Some(c)
    }

    /// Drops records whose driver went quiet for longer than every attempt can take.
    pub fn expire(&mut self, out: &mut Outbox, now: Duration) {
        let stale: Vec<u64> = self
            .hops
            .iter()
            .filter(|(_, h)| h.expires <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            self.hops.remove(&id);
            out.compute(Job::Abort { id });
        }
    }

    /// `peer` is unreachable, or `gone`: the drivers of hops waiting on it are told at once.
    /// Gone, it also took its part of the hops whose gradient it already sent back: their
    /// drivers are told too (the record stays: a commit sent before the driver heard still
    /// counts here, as it did at the stages before).
    pub fn reject_routed_through(&mut self, out: &mut Outbox, peer: PeerKey, gone: bool) {
        for (id, h) in &self.hops {
            if h.next == Some(peer) && (gone || !h.backward_done) {
                if let Some(driver) = h.route.first() {
                    out.send(*driver, Message::Reject { id: *id });
                }
            }
        }
    }

    /// Drops all work: the stage is about to be replaced. Other drivers are told at once so
    /// they retry elsewhere.
    pub fn abandon(&mut self, out: &mut Outbox) {
        for (id, h) in std::mem::take(&mut self.hops) {
            if let Some(d) = h.route.first() {
                out.send(*d, Message::Reject { id });
            }
        }
        self.committing.clear();
        self.commits_queued = 0.0;
        self.held_forwards.clear();
    }
}

#[cfg(test)]
mod tests;
