//! The data driver: a replica of the first stage that starts microbatches.
//!
//! It decides how many microbatches to keep in flight (a window sized by the pipeline's round
//! trip), how many to start for a step (its share of the step, dealt out over the drivers by
//! throughput), when to hold back (the step is complete, another stage lags, the step is not
//! applied yet) and when to give up holding back (nothing advanced for a while). Its
//! [`Ledger`] makes every microbatch apply at most once however often it is retried.
//!
//! The driver owns no compute and no routing: it queues forward jobs for its own microbatches
//! and the peer passes their activations on like anyone else's.

use super::PeerKey;
use super::config::{StageCosts, Timing};
use super::interface::{Event, Input, Job};
use super::ledger::{Arrival, Entry, Expiry, Ledger};
use super::message::Message;
use super::outbox::Outbox;
use super::placement::{Placement, stage_totals};
use super::{SeededRng, ledger};
use std::collections::BTreeMap;
use std::time::Duration;

/// Microbatches over which the least round trip is taken (then it starts over, so that a
/// route that got slower is noticed).
const RTT_EPOCH: u32 = 64;

/// Weight of a new round trip in the moving average the deadlines follow.
const RTT_WEIGHT: f64 = 0.2;

/// What the step being collected needs from this driver, as the step coordinator and the
/// membership see it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Demand {
    /// The round new microbatches count toward.
    pub round: u64,
    /// Samples the step needs: the global batch from all drivers together (allreduce), this
    /// replica's local batch (DiLoCo).
    pub quota: f64,
    /// This driver's part of the step's samples (see [`share`]).
    pub share: f64,
    /// Samples committed here toward `round`, commits still queued included.
    pub committed: f64,
    /// Samples the stage's other replicas committed or have in flight toward `round`
    /// (allreduce: drivers count each other's claims); None in DiLoCo, where each replica
    /// fills its own local batch.
    pub others: Option<f64>,
    /// The step must be applied before more microbatches start (a local step is queued, or
    /// this replica's contribution is in a round whose result it has not applied).
    pub blocked: bool,
    /// This stage is ahead of the run (it took its last step, or another stage is more than
    /// a round behind): the round of the slowest stage, which is what a microbatch started
    /// to unstick the swarm counts toward.
    pub ahead: Option<u64>,
}

/// One data driver's flow control and ledger.
#[derive(Debug)]
pub(super) struct Driver {
    ledger: Ledger,
    next_microbatch: u64,
    /// Where attempt ids come from: drawn from the peer's secret seed, so that no one else
    /// can predict them (a forged forward pass carrying a driver's next id would get the real
    /// one refused as a repeat).
    ids: SeededRng,
    /// Routes of this driver's attempts whose backward pass was accepted, to commit along.
    routes: BTreeMap<u64, Vec<PeerKey>>,
    /// Round trip of a microbatch, a moving average (0: none yet); deadlines follow it.
    rtt: f64,
    /// The least round trip of a microbatch lately (no queueing on the way): this epoch's and
    /// the last one's, and how many microbatches this epoch has seen.
    rtt_floor: (f64, f64, u32),
    /// When to look again at a step this driver is holding back on.
    stall_check: Option<Duration>,
    /// When the run last advanced (a replica announced a new round, or this one stepped).
    last_advance: Duration,
}

impl Driver {
    /// A driver with nothing in flight, drawing attempt ids from `secret`; the run counts as
    /// advancing from `now`.
    pub fn new(secret: u64, now: Duration) -> Self {
        Driver {
            ledger: Ledger::default(),
            next_microbatch: 0,
            ids: SeededRng::new(secret),
            routes: BTreeMap::new(),
            rtt: 0.0,
            rtt_floor: (f64::INFINITY, f64::INFINITY, 0),
            stall_check: None,
            last_advance: now,
        }
    }

    /// The entry of one of this driver's attempts.
    pub fn entry(&self, attempt: u64) -> Option<&Entry> {
        self.ledger.entry_of(attempt)
    }

    /// Microbatches in flight.
    pub fn in_flight(&self) -> usize {
        self.ledger.in_flight()
    }

    /// Retries started and microbatches dropped so far.
    pub fn stats(&self) -> ledger::LedgerStats {
        self.ledger.stats
    }

    /// Not driving now: no step to look at again.
    pub fn rest(&mut self) {
        self.stall_check = None;
    }

    /// The run advanced a round.
    pub fn note_advance(&mut self, now: Duration) {
        self.last_advance = now;
    }

    /// The earliest of the driver's deadlines.
    pub fn next_timeout(&self) -> Option<Duration> {
        [self.ledger.next_deadline(), self.stall_check]
            .into_iter()
            .flatten()
            .min()
    }

    /// How long an attempt may take: three times the measured round trip of a microbatch,
    /// and never less than the configured floor (a slow pipeline is not a dead one).
    pub fn microbatch_deadline(&self, timing: &Timing) -> Duration {
        timing
            .microbatch_deadline
            .max(Duration::from_secs_f64(3.0 * self.rtt))
    }

    /// Microbatches to keep in flight (see [`driver_window`]): between the configured least
    /// and most per stage of the pipeline.
    pub fn window(
        &self,
        placements: &[Placement],
        costs: &StageCosts,
        timing: &Timing,
        own: f64,
        microbatch: u32,
    ) -> usize {
        let stages = costs.memory.len();
        let floor = (timing.in_flight_per_stage as usize * stages).max(1);
        let ceiling = (timing.max_in_flight_per_stage as usize * stages).max(floor);
        driver_window(
            placements,
            costs,
            (floor, ceiling),
            self.rtt_floor.0.min(self.rtt_floor.1),
            own,
            microbatch,
        )
    }

    /// Starts microbatches of `rows` samples while the window has room and the step needs
    /// them. Returns whether any started.
    ///
    /// Drivers learn of each other's claims a round trip late, so each starts only its share
    /// of the step; a driver holding back looks again after the join window, and if the run
    /// has not advanced by then (a driver is gone or slow) it fills the step up to the whole
    /// quota. A stage that is ahead of the run waits for the others (every stage sees every
    /// committed microbatch, so they have what they need), unless nothing advanced for the
    /// join window: then microbatches go out one at a time, counted toward the slowest
    /// stage's round, in case a stage lost samples (a replica that re-synced drops what it
    /// had collected).
    pub fn pump(
        &mut self,
        out: &mut Outbox,
        me: PeerKey,
        demand: &Demand,
        window: usize,
        rows: u32,
        timing: &Timing,
        now: Duration,
    ) -> bool {
        self.stall_check = None;
        let mut started = false;
        while self.ledger.in_flight() < window {
            let stalled = now.saturating_sub(self.last_advance) >= timing.join_window;
            let look_again = self.last_advance + timing.join_window;
            let round = match demand.ahead {
                Some(slowest) => {
                    if !stalled {
                        self.stall_check = Some(look_again);
                    }
                    if !stalled || self.ledger.in_flight() > 0 {
                        break;
                    }
                    slowest
                }
                None => {
                    let rows = f64::from(rows);
                    let mine =
                        demand.committed + self.ledger.in_flight_from(demand.round) as f64 * rows;
                    let claimed = match demand.others {
                        Some(others) => {
                            demand.committed + self.ledger.in_flight() as f64 * rows + others
                        }
                        None => mine,
                    };
                    if claimed >= demand.quota || (mine >= demand.share && !stalled) {
                        if !stalled {
                            self.stall_check = Some(look_again);
                        }
                        break;
                    }
                    if demand.blocked {
                        break;
                    }
                    demand.round
                }
            };
            started = true;
            self.start(out, me, rows, round, timing, now);
        }
        started
    }

    fn start(
        &mut self,
        out: &mut Outbox,
        me: PeerKey,
        rows: u32,
        round: u64,
        timing: &Timing,
        now: Duration,
    ) {
        let microbatch = self.next_microbatch;
        self.next_microbatch += 1;
        let id = self.ids.next_u64();
        // Samples need no secret: a driver's are its own and never repeat.
        let sample = sample_of(me, microbatch);
        let deadline = now + self.microbatch_deadline(timing);
        self.ledger
            .start(microbatch, sample, rows, round, id, now, deadline);
        out.compute(Job::Forward {
            id,
            rows,
            sample,
            input: Input::Tokens,
            held_out: false,
        });
    }

    /// Retries the microbatches whose attempt timed out (same sample, new attempt id), and
    /// drops those out of attempts: their attempts are aborted here and at their first hop.
    /// Returns whether a microbatch was dropped (what this driver has in flight fell).
    pub fn expire(&mut self, out: &mut Outbox, timing: &Timing, now: Duration) -> bool {
        let deadline = self.microbatch_deadline(timing);
        let mut dropped = false;
        let ids = &mut self.ids;
        let expired = self
            .ledger
            .expire(now, timing.max_attempts, deadline, || ids.next_u64());
        for e in expired {
            match e {
                Expiry::Retry {
                    attempt,
                    sample,
                    rows,
                    ..
                } => out.compute(Job::Forward {
                    id: attempt,
                    rows,
                    sample,
                    input: Input::Tokens,
                    held_out: false,
                }),
                Expiry::Dropped(entry) => {
                    dropped = true;
                    for (a, hop) in entry.live {
                        out.compute(Job::Abort { id: a });
                        if let Some(h) = hop {
                            out.send(h, Message::Abort { id: a });
                        }
                    }
                    out.event(Event::Dropped {
                        microbatch: entry.microbatch,
                    });
                }
            }
        }
        dropped
    }

    /// The replica of the second stage `attempt`'s activations went to, if still known.
    pub fn first_hop(&self, attempt: u64) -> Option<PeerKey> {
        let entry = self.ledger.entry_of(attempt)?;
        entry.live.iter().find(|l| l.0 == attempt).and_then(|l| l.1)
    }

    /// The first hop of the attempt before `attempt` of the same microbatch: a retry goes
    /// elsewhere if it can.
    pub fn previous_hop(&self, attempt: u64) -> Option<PeerKey> {
        self.ledger
            .entry_of(attempt)
            .and_then(|e| e.live.iter().rev().nth(1).and_then(|l| l.1))
    }

    /// The attempt's activations went to `first_hop`.
    pub fn sent(&mut self, attempt: u64, first_hop: PeerKey) {
        self.ledger.sent(attempt, first_hop);
    }

    /// The attempt's route failed (a hop rejected it, or it could not be sent): retry now.
    pub fn fail(&mut self, attempt: u64, now: Duration) {
        self.ledger.fail(attempt, now);
    }

    /// Attempts whose first hop was `peer` (gone, or unreachable) are retried now.
    pub fn fail_hop(&mut self, peer: PeerKey, now: Duration) {
        self.ledger.fail_hop(peer, now);
    }

    /// `from` rejected the attempt: retry now. If it had come home and is not committed
    /// yet, a hop after `from` is gone with its part of the work (see [`Driver::hop_gone`]):
    /// it is retried all the same, but only on the word of a hop of its route (the route is
    /// known now; anyone else learned the attempt id from a hop).
    pub fn rejected(&mut self, out: &mut Outbox, from: PeerKey, attempt: u64, now: Duration) {
        match self.routes.get(&attempt) {
            Some(route) if route.iter().skip(1).any(|h| *h == from) => {
                self.retry_accepted(out, attempt, None, now);
            }
            Some(_) => {}
            None => self.ledger.fail(attempt, now),
        }
    }

    /// `peer` is gone (it left, or was banned): attempts whose first hop it was are retried
    /// now, and so are attempts that came home through it and are not committed yet. Their
    /// work at `peer` would never be added to its stage's step, so committing them would
    /// leave that stage short of the step's samples while the others had them all.
    pub fn hop_gone(&mut self, out: &mut Outbox, peer: PeerKey, now: Duration) {
        self.ledger.fail_hop(peer, now);
        let through: Vec<u64> = self
            .routes
            .iter()
            .filter(|(_, route)| route.iter().skip(1).any(|h| *h == peer))
            .map(|(a, _)| *a)
            .collect();
        for attempt in through {
            self.retry_accepted(out, attempt, Some(peer), now);
        }
    }

    /// Gives up an attempt that came home before it is committed: the rest of its route
    /// (but `gone`) is told to throw its part away, and the microbatch is retried.
    fn retry_accepted(
        &mut self,
        out: &mut Outbox,
        attempt: u64,
        gone: Option<PeerKey>,
        now: Duration,
    ) {
        let route = self.routes.remove(&attempt).unwrap_or_default();
        for hop in route.iter().skip(1).filter(|h| Some(**h) != gone) {
            out.send(*hop, Message::Abort { id: attempt });
        }
        self.ledger.unaccept(attempt, now);
    }

    /// The accepted attempt's backward pass failed here: the microbatch is retried.
    pub fn failed_locally(&mut self, attempt: u64, now: Duration) {
        self.routes.remove(&attempt);
        self.ledger.unaccept(attempt, now);
        self.ledger.fail(attempt, now);
    }

    /// A pipeline of one stage: this driver computed the loss itself, so its attempt came
    /// home. Returns the sample and rows of the microbatch.
    pub fn came_home_locally(&mut self, me: PeerKey, attempt: u64) -> Option<(u64, u32)> {
        let (sample, rows) = self.ledger.entry_of(attempt).map(|e| (e.sample, e.rows))?;
        self.routes.insert(attempt, vec![me]);
        let _ = self.ledger.arrive(attempt);
        Some((sample, rows))
    }

    /// The gradient of an attempt came home along `route` with `values` values (the caller
    /// decoded them, bounded by the largest microbatch). The first attempt to come home wins:
    /// the others are aborted here; a later one is aborted along its route. Returns the
    /// sample and rows of an accepted attempt, whose backward pass the caller runs.
    #[allow(clippy::too_many_arguments)]
    pub fn came_home(
        &mut self,
        out: &mut Outbox,
        me: PeerKey,
        attempt: u64,
        route: Vec<PeerKey>,
        values: usize,
        stages: u32,
        activation_values: usize,
    ) -> Option<(u64, u32)> {
        let (sample, rows) = self.ledger.entry_of(attempt).map(|e| (e.sample, e.rows))?;
        if values != activation_values * rows as usize
            || route.len() != stages as usize
            || route.first() != Some(&me)
        {
            return None;
        }
        match self.ledger.arrive(attempt) {
            Arrival::Accept { abort } => {
                for a in abort {
                    out.compute(Job::Abort { id: a });
                }
                self.routes.insert(attempt, route);
                Some((sample, rows))
            }
            Arrival::Stale => {
                for hop in route.iter().skip(1) {
                    out.send(*hop, Message::Abort { id: attempt });
                }
                None
            }
        }
    }

    /// The accepted attempt's backward pass finished here: the microbatch is committed, and
    /// every stage on its route is told to add its gradient. None if the attempt is not the
    /// accepted one of a live microbatch (so nothing is ever committed twice). Returns it with
    /// the hops of its route past this driver.
    pub fn commit(
        &mut self,
        out: &mut Outbox,
        attempt: u64,
        now: Duration,
    ) -> Option<(Entry, Vec<PeerKey>)> {
        let entry = self.ledger.commit(attempt)?;
        let rtt = now.saturating_sub(entry.started).as_secs_f64();
        self.rtt = if self.rtt > 0.0 {
            (1.0 - RTT_WEIGHT) * self.rtt + RTT_WEIGHT * rtt
        } else {
            rtt
        };
        let (current, last, count) = &mut self.rtt_floor;
        *current = current.min(rtt);
        *count += 1;
        if *count >= RTT_EPOCH {
            *last = std::mem::replace(current, f64::INFINITY);
            *count = 0;
        }
        let mut hops = self.routes.remove(&attempt).unwrap_or_default();
        if !hops.is_empty() {
            hops.remove(0);
        }
        for hop in &hops {
            out.send(*hop, Message::Commit { id: attempt });
        }
        Some((entry, hops))
    }

    /// Forgets every microbatch in flight: the stage state they were started on is being
    /// replaced, so none can complete (they count as dropped).
    pub fn abandon(&mut self) {
        self.routes.clear();
        self.ledger.abandon();
    }
}

/// This driver's part of a step's samples: the step's microbatches dealt out over the drivers
/// (the first stage's replicas, `me` with `own` throughput among them) in key order, so that
/// together they start the global batch and no more. `weighted`: in proportion to the
/// drivers' throughput (a fast driver must not wait for a slow one to push its equal part
/// through), unless some driver's throughput is unknown; equal parts otherwise (the uniform
/// baseline, and DiLoCo, where every replica's local step is an equal part of the batch).
pub(super) fn share(
    placements: &[Placement],
    me: PeerKey,
    own: f64,
    weighted: bool,
    global_batch: u32,
    microbatch: u32,
) -> f64 {
    let mut drivers: Vec<(PeerKey, f64)> = placements
        .iter()
        .filter(|p| p.stage == 0)
        .map(|p| (p.peer, p.throughput))
        .collect();
    if !drivers.iter().any(|d| d.0 == me) {
        drivers.push((me, own));
    }
    drivers.sort_unstable_by_key(|d| d.0);
    let weighted = weighted && drivers.iter().all(|d| d.1.is_finite() && d.1 > 0.0);
    if !weighted {
        drivers.iter_mut().for_each(|d| d.1 = 1.0);
    }
    let rows = u64::from(microbatch.max(1));
    let microbatches = u64::from(global_batch).div_ceil(rows);
    let weights: Vec<f64> = drivers.iter().map(|d| d.1).collect();
    let position = drivers.iter().position(|d| d.0 == me).unwrap_or(0);
    let mine = deal(microbatches, &weights)
        .get(position)
        .copied()
        .unwrap_or(0);
    (mine * rows) as f64
}

/// `items` dealt out in proportion to `weights` (whole items, summing to `items`): the floor
/// of each exact share, then one more to the largest remainders, earlier entries first.
fn deal(items: u64, weights: &[f64]) -> Vec<u64> {
    let total: f64 = weights.iter().sum();
    if weights.is_empty() || total.is_nan() || total <= 0.0 {
        return vec![0; weights.len()];
    }
    let exact: Vec<f64> = weights.iter().map(|w| items as f64 * w / total).collect();
    let mut dealt: Vec<u64> = exact.iter().map(|e| e.floor() as u64).collect();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|a, b| {
        let (fa, fb) = (exact[*a] - exact[*a].floor(), exact[*b] - exact[*b].floor());
        fb.total_cmp(&fa).then(a.cmp(b))
    });
    let left = items.saturating_sub(dealt.iter().sum());
    for i in order.into_iter().cycle().take(left as usize) {
        dealt[i] += 1;
    }
    dealt
}

/// The first sample of a driver's `microbatch`-th microbatch: a mix of the driver and a
/// counter, unique over the swarm.
fn sample_of(me: PeerKey, microbatch: u64) -> u64 {
    SeededRng::new((me.0 ^ 0x5A5A_5A5A) ^ microbatch.wrapping_mul(0x9E37_79B9_7F4A_7C15)).next_u64()
}

/// Microbatches a driver keeps in flight: as many as the pipeline's round trip needs to keep
/// the slowest stage busy, by Little's law (in flight = throughput x round trip), within
/// `limits` (least, most) and what the replicas' memory holds. The round trip measured is the
/// least one (an idle pipeline); under load every device also queues the forward passes of new
/// microbatches beside the backward passes of returning ones, and several drivers' microbatches
/// meet at a stage's replicas, so the window is four times the product (in the simulator, on
/// two stages across US regions: twice gave 74% efficiency, four times 83%, eight times 83%).
///
/// `rtt` is the least round trip of this driver's microbatches lately (infinite: none yet),
/// `own` its throughput at the first stage (samples/s), `placements` every replica with its
/// throughput. Over links whose latency is small next to a microbatch's compute the least
/// window suffices; across regions it takes several times more.
pub fn driver_window(
    placements: &[Placement],
    costs: &StageCosts,
    limits: (usize, usize),
    rtt: f64,
    own: f64,
    microbatch: u32,
) -> usize {
    let (floor, ceiling) = limits;
    let stages = costs.memory.len() as u32;
    let totals = stage_totals(placements, stages);
    let slowest = totals.iter().map(|t| t.0).fold(f64::INFINITY, f64::min);
    let drivers = totals.first().map_or(0.0, |t| t.0);
    if !(rtt.is_finite() && own > 0.0 && slowest.is_finite() && slowest > 0.0 && drivers > 0.0) {
        return floor;
    }
    // This driver's part of what the slowest stage can take, in samples per second.
    let share = slowest * own / drivers;
    let target = (4.0 * share * rtt / f64::from(microbatch.max(1))).ceil();
    let target = if target.is_finite() {
        target as usize
    } else {
        floor
    };
    let memory = memory_window(placements, costs, floor).max(floor);
    target.clamp(floor, ceiling.min(memory).max(floor))
}

/// The largest window whose microbatches every stage's replicas can hold beside their state,
/// if the drivers' windows spread evenly over a stage's replicas. A stage's need (resident,
/// or offloaded on a replica that offloads it) already holds `floor` microbatches.
fn memory_window(placements: &[Placement], costs: &StageCosts, floor: usize) -> usize {
    let drivers = placements.iter().filter(|p| p.stage == 0).count().max(1) as u64;
    let mut window = u64::MAX;
    for (stage, (need, &per)) in costs
        .needs()
        .into_iter()
        .zip(&costs.microbatch_memory)
        .enumerate()
    {
        let replicas: Vec<&Placement> = placements
            .iter()
            .filter(|p| p.stage as usize == stage)
            .collect();
        // Memory 0: not limited. The room a replica has beside its state.
        let room = |p: &&Placement| {
            let held = need.on(p.memory, p.offloads).unwrap_or(need.resident);
            p.memory.saturating_sub(held)
        };
        let Some(least) = replicas.iter().filter(|p| p.memory > 0).map(room).min() else {
            continue;
        };
        if per == 0 {
            continue;
        }
        // Microbatches one replica can hold, then the window that puts that many on each.
        let held = floor as u64 + least / per;
        window = window.min(held * replicas.len() as u64 / drivers);
    }
    usize::try_from(window).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests;
