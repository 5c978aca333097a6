//! A peer's role in the run: choosing a stage, syncing its state, serving it, and moving to
//! another stage when that helps the run more.
//!
//! A joiner listens to gossip for a moment, then takes the stage the run needs most that its
//! memory holds; it downloads the stage's state from one of its replicas (or builds it fresh
//! if there is none) and serves it. Every so often a serving peer asks whether some peer's
//! move would raise the slowest stage's throughput enough to pay for a state transfer; if the
//! best move is its own, it moves after a random back-off.

use super::config::{StageCosts, Timing};
use super::membership::Membership;
use super::message::{MemberState, Message, StateChunk};
use super::placement::{Move, Need, Placement, choose_stage, fits, plan_move};
use super::transfer::{Added, Download, Downloaded, TransferError};
use super::{PeerKey, SeededRng};
use std::collections::BTreeMap;
use std::time::Duration;

/// What the peer is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Listening to gossip until then, before choosing a stage.
    Choosing {
        /// When to choose.
        until: Duration,
    },
    /// Getting its stage's state.
    Syncing {
        /// From whom (None: building it fresh, or the source was lost).
        source: Option<PeerKey>,
        /// When to give up on the source and try another.
        deadline: Duration,
    },
    /// Serving its stage.
    Serving,
}

/// What a state chunk did.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum ChunkOutcome {
    /// Nothing yet (or not a chunk this peer waits for).
    Pending,
    /// The whole state arrived and checked out.
    Complete(Downloaded),
    /// A source failed the transfer; the peers named are not to be trusted with it.
    Failed(TransferError, Vec<PeerKey>),
}

/// A peer's role.
#[derive(Debug)]
pub(super) struct Role {
    phase: Phase,
    stage: Option<u32>,
    /// The stage to take first, if the operator chose one.
    first_choice: Option<u32>,
    download: Option<Download>,
    /// Releases of a download that completed, not sent yet.
    released: Vec<(PeerKey, Message)>,
    /// Replicas asked for a state lately, until when they will not serve this peer again (a
    /// replica exports to each requester once per transfer timeout; a second request sooner
    /// is ignored, and the download would wait for its deadline).
    asked: BTreeMap<PeerKey, Duration>,
    /// When to consider rebalancing next.
    next_rebalance: Duration,
    /// When to make the move planned after a back-off.
    move_at: Option<Duration>,
    /// State downloads completed (joins and re-syncs).
    pub state_transfers: u64,
    /// Bytes of state received, duplicates and chunks of abandoned versions included.
    pub state_bytes_received: u64,
    /// Downloads that started over with another version (no source of theirs was left).
    pub state_restarts: u64,
    /// Stage moves made.
    pub moves: u64,
}

impl Role {
    /// A joiner that chooses after listening for `timing.choose_after`.
    pub fn joining(timing: &Timing, now: Duration) -> Self {
        Role {
            phase: Phase::Choosing {
                until: now + timing.choose_after,
            },
            stage: None,
            first_choice: None,
            download: None,
            released: Vec::new(),
            asked: BTreeMap::new(),
            next_rebalance: now + timing.rebalance_every,
            move_at: None,
            state_transfers: 0,
            state_bytes_received: 0,
            state_restarts: 0,
            moves: 0,
        }
    }

    /// Takes `stage` when choosing (an operator's choice, e.g. where a device's memory is
    /// best used); rebalancing may move the peer later like any other.
    pub fn choose_first(&mut self, stage: u32) {
        self.first_choice = Some(stage);
    }

    /// The stage to take, if the operator chose one.
    pub fn first_choice(&self) -> Option<u32> {
        self.first_choice
    }

    /// Serving `stage` from the start (restored from a checkpoint).
    pub fn resume(&mut self, stage: u32) {
        self.phase = Phase::Serving;
        self.stage = Some(stage);
    }

    /// What the peer is doing.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The stage served or being synced.
    pub fn stage(&self) -> Option<u32> {
        self.stage
    }

    /// The stage, if it is being served now.
    pub fn serving(&self) -> Option<u32> {
        self.stage.filter(|_| self.phase == Phase::Serving)
    }

    /// How the peer announces itself: its stage and state.
    pub fn announced(&self) -> (Option<u32>, MemberState) {
        match self.phase {
            // Announced while choosing, so that others choosing at the same time play out
            // the same assignment.
            Phase::Choosing { .. } => (self.first_choice, MemberState::Choosing),
            Phase::Syncing { .. } => (self.stage, MemberState::Syncing),
            Phase::Serving => (self.stage, MemberState::Serving),
        }
    }

    /// The earliest of the role's deadlines.
    pub fn next_timeout(&self) -> Option<Duration> {
        let phase = match self.phase {
            Phase::Choosing { until } => Some(until),
            Phase::Syncing { deadline, .. } => Some(deadline),
            Phase::Serving => None,
        };
        [Some(self.next_rebalance), phase, self.move_at]
            .into_iter()
            .flatten()
            .min()
    }

    /// No stage fits this peer: look again after `wait`.
    pub fn choose_again(&mut self, now: Duration, wait: Duration) {
        self.phase = Phase::Choosing { until: now + wait };
    }

    /// Starts getting `stage`'s state: pulled from `sources` (a download of at most
    /// `max_bytes`, see [`Download`]), or fresh from the run's seed if there are none.
    /// Returns the requests to send.
    /// Deadlines follow progress: a source that sends nothing for `timeout` is given up
    /// (and will serve this peer again only after that long); building the state must take
    /// no longer either.
    pub fn sync(
        &mut self,
        stage: u32,
        sources: &[PeerKey],
        (max_bytes, chunk_bytes): (usize, usize),
        now: Duration,
        timeout: Duration,
    ) -> Vec<(PeerKey, Message)> {
        self.asked.retain(|_, until| now < *until);
        self.stage = Some(stage);
        self.phase = Phase::Syncing {
            source: None,
            deadline: now + timeout,
        };
        self.download =
            (!sources.is_empty()).then(|| Download::with_chunks(stage, max_bytes, chunk_bytes));
        self.add_sources(sources, now, timeout)
    }

    /// Asks `sources` too, each for the chunk this peer wants next. Returns the requests.
    pub fn add_sources(
        &mut self,
        sources: &[PeerKey],
        now: Duration,
        timeout: Duration,
    ) -> Vec<(PeerKey, Message)> {
        let (Some(stage), Some(d)) = (self.stage, self.download.as_mut()) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let resume = d.hash();
        for (nth, k) in sources.iter().enumerate() {
            self.asked.insert(*k, now + timeout);
            let first = d.first_wanted(nth);
            d.ask(*k, now);
            out.push((
                *k,
                Message::StateRequest {
                    stage,
                    first,
                    resume,
                },
            ));
        }
        self.set_deadline(now, timeout);
        out
    }

    /// Whether a download is under way (as opposed to building a state got or made).
    pub fn downloading(&self) -> bool {
        self.download.is_some()
    }

    /// Sources that may still send the version being downloaded.
    pub fn live_sources(&self) -> usize {
        self.download.as_ref().map_or(0, Download::live_sources)
    }

    /// Whether `peer` is a source of the download in progress.
    pub fn is_source(&self, peer: PeerKey) -> bool {
        self.download.as_ref().is_some_and(|d| d.is_source(peer))
    }

    /// Bytes of the state held and its size, while downloading.
    pub fn download_progress(&self) -> Option<(u64, u64)> {
        self.download.as_ref().map(Download::progress)
    }

    /// The next deadline: the first source's to make progress by, or now if none is left
    /// (another is to be asked at once).
    fn set_deadline(&mut self, now: Duration, timeout: Duration) {
        let next = match &self.download {
            Some(d) if d.live_sources() > 0 => d.next_deadline(timeout).unwrap_or(now),
            Some(_) => now,
            None => return,
        };
        if let Phase::Syncing { deadline, .. } = &mut self.phase {
            *deadline = next;
        }
    }

    /// Gives up the sources that made no progress for `timeout`; returns them.
    pub fn expire_sources(&mut self, now: Duration, timeout: Duration) -> Vec<PeerKey> {
        let stalled = self
            .download
            .as_mut()
            .map(|d| d.expire(now, timeout))
            .unwrap_or_default();
        self.set_deadline(now, timeout);
        stalled
    }

    /// What the download has to send now: chunk requests (see [`Download::requests`]), and
    /// releases to the sources it let go.
    pub fn download_messages(&mut self) -> Vec<(PeerKey, Message)> {
        let mut out = std::mem::take(&mut self.released);
        let (Some(stage), Some(d)) = (self.stage, self.download.as_mut()) else {
            return out;
        };
        out.extend(release(stage, d));
        if let Some(hash) = d.hash() {
            out.extend(
                d.requests()
                    .into_iter()
                    .map(|(k, index)| (k, Message::ChunkRequest { stage, hash, index })),
            );
        }
        out
    }

    /// Whether `peer` was asked for a state so lately that it would not answer again now.
    pub fn asked_lately(&self, peer: PeerKey, now: Duration) -> bool {
        self.asked.get(&peer).is_some_and(|until| now < *until)
    }

    /// A peer is gone: the download goes on from the other sources, or another is asked at
    /// once if none is left.
    pub fn source_lost(&mut self, peer: PeerKey, now: Duration, timeout: Duration) {
        if let Some(d) = self.download.as_mut()
            && d.is_source(peer)
        {
            d.lose(peer);
            self.set_deadline(now, timeout);
        }
    }

    /// A chunk of state from `from`: only sources of the download in progress are heard.
    /// Once complete, the state is built (the deadline starts again for that).
    pub fn on_chunk(
        &mut self,
        from: PeerKey,
        chunk: StateChunk,
        timing: &Timing,
        now: Duration,
    ) -> ChunkOutcome {
        let Some(d) = self.download.as_mut() else {
            return ChunkOutcome::Pending;
        };
        let (bytes, restarts) = (d.bytes_received, d.restarts);
        let added = d.add(from, chunk, now);
        self.state_bytes_received += d.bytes_received - bytes;
        self.state_restarts += d.restarts - restarts;
        let outcome = match added {
            Added::Pending => ChunkOutcome::Pending,
            Added::Complete(done) => {
                if let (Some(stage), Some(d)) = (self.stage, self.download.as_mut()) {
                    self.released = release(stage, d);
                }
                self.download = None;
                self.state_transfers += 1;
                self.phase = Phase::Syncing {
                    source: Some(done.source),
                    deadline: now + timing.transfer_timeout,
                };
                return ChunkOutcome::Complete(done);
            }
            Added::Refused(e) => ChunkOutcome::Failed(e, vec![from]),
            Added::Corrupt(suspects) => ChunkOutcome::Failed(TransferError::Hash, suspects),
        };
        self.set_deadline(now, timing.transfer_timeout);
        outcome
    }

    /// The stage's state is built: serving it. Returns the stage and where its state came
    /// from (None if not syncing).
    pub fn serve(&mut self) -> Option<(u32, Option<PeerKey>)> {
        let Phase::Syncing { source, .. } = self.phase else {
            return None;
        };
        let stage = self.stage?;
        self.phase = Phase::Serving;
        Some((stage, source))
    }

    /// Rebalancing: at every `timing.rebalance_every`, the move that most raises the slowest
    /// stage's throughput (see [`plan_move`]) is looked for among the measured `placements`;
    /// if it is this peer's, it is made after a random back-off of up to half the period
    /// (peers that all see the same imbalance must not all move), if it is still the move
    /// chosen then. Returns the move to make now.
    #[allow(clippy::too_many_arguments)]
    pub fn consider_move(
        &mut self,
        me: PeerKey,
        placements: &[Placement],
        costs: &StageCosts,
        timing: &Timing,
        busy: bool,
        rng: &mut SeededRng,
        now: Duration,
    ) -> Option<Move> {
        let planned = |at: Option<Duration>| at.is_some_and(|t| now >= t);
        let due = now >= self.next_rebalance;
        if !due && !planned(self.move_at) {
            return None;
        }
        if busy && self.phase == Phase::Serving {
            // In a round: look again shortly. (Skipping the whole period instead left a
            // stage starved for good where rounds take most of the time: in allreduce, every
            // step has one.)
            let soon = now + timing.announce_every;
            if due {
                self.next_rebalance = soon;
            }
            if planned(self.move_at) {
                self.move_at = Some(soon);
            }
            return None;
        }
        let gain = timing.rebalance_gain;
        let mine = (self.phase == Phase::Serving)
            .then(|| plan_move(placements, &costs.flops_per_sample, &costs.needs(), gain))
            .flatten()
            .filter(|m| m.peer == me);
        if due {
            self.next_rebalance = now + timing.rebalance_every;
            if mine.is_some() {
                let wait = timing.rebalance_every.as_secs_f64() * 0.5 * rng.next_f64();
                self.move_at = Some(now + Duration::from_secs_f64(wait));
            }
        }
        if !planned(self.move_at) {
            return None;
        }
        self.move_at = None;
        self.moves += u64::from(mine.is_some());
        mine
    }
}

/// Every peer's stage and throughput, as known from `members` (serving or syncing), and this
/// peer's own (`me`: serving, with its measured throughput), if given. With `estimate`, a
/// peer not measured yet (it just joined) counts as the mean of its stage's measured
/// replicas, or of all measured peers, so that joiners arriving together spread out instead
/// of all picking the same stage; without, only measurements count (rebalancing).
pub(super) fn placements(
    members: &Membership,
    me: Option<Placement>,
    stages: u32,
    estimate: bool,
) -> Vec<Placement> {
    let mut out: Vec<Placement> = members
        .iter()
        .filter(|(_, m)| {
            matches!(
                m.announcement.state,
                MemberState::Serving | MemberState::Syncing
            )
        })
        .filter_map(|(k, m)| {
            m.announcement.stage.map(|stage| Placement {
                peer: *k,
                stage,
                throughput: f64::from(m.announcement.throughput),
                memory: m.announcement.memory,
                offloads: m.announcement.offloads,
            })
        })
        .collect();
    out.extend(me);
    if !estimate {
        return out;
    }
    let overall = mean(out.iter().map(|p| p.throughput).filter(|t| *t > 0.0));
    let per_stage: Vec<Option<f64>> = (0..stages)
        .map(|s| {
            mean(
                out.iter()
                    .filter(|p| p.stage == s && p.throughput > 0.0)
                    .map(|p| p.throughput),
            )
        })
        .collect();
    for p in &mut out {
        if p.throughput <= 0.0 {
            p.throughput = per_stage
                .get(p.stage as usize)
                .copied()
                .flatten()
                .or(overall)
                .unwrap_or(0.0);
        }
    }
    out
}

fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values.fold((0.0, 0), |(s, n), t| (s + t, n + 1));
    (n > 0).then(|| sum / f64::from(n))
}

/// The stage `me` takes. Peers that start together would all see the same bottleneck and
/// pick it together, so every peer choosing now plays out the same assignment of all
/// `choosers` (key, memory, and the stage an operator told it to take first) in key order:
/// each takes its first choice if its memory holds it, else the stage the run needs most,
/// counted at the throughput that stage's replicas measure; this peer takes its own slot.
/// None if no stage fits its memory.
pub(super) fn choose(
    mut placements: Vec<Placement>,
    mut choosers: Vec<(PeerKey, (u64, bool), Option<u32>)>,
    need: &[Need],
    me: PeerKey,
) -> Option<u32> {
    choosers.sort_unstable();
    for (peer, (memory, offloads), first) in choosers {
        let holds = |n: &Need| fits(memory, offloads, *n);
        let first = first.filter(|s| need.get(*s as usize).is_some_and(holds));
        let stage = first.or_else(|| choose_stage(&placements, need, memory, offloads));
        if peer == me {
            return stage;
        }
        if let Some(stage) = stage {
            let measured = |only: Option<u32>| {
                mean(
                    placements
                        .iter()
                        .filter(|p| p.throughput > 0.0 && only.is_none_or(|s| p.stage == s))
                        .map(|p| p.throughput),
                )
            };
            let throughput = measured(Some(stage)).or(measured(None)).unwrap_or(0.0);
            placements.push(Placement {
                peer,
                stage,
                throughput,
                memory,
                offloads,
            });
        }
    }
    None
}

/// The releases `d` owes the sources it let go.
fn release(stage: u32, d: &mut Download) -> Vec<(PeerKey, Message)> {
    d.take_released()
        .into_iter()
        .map(|(k, hash)| (k, Message::StateRelease { stage, hash }))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::swarm::fixtures::{self, serving};
    use crate::swarm::message::Announcement;
    use crate::swarm::transfer::{CHUNK_BYTES, chunk, state_hash};

    const MS: Duration = Duration::from_millis(1);
    const ME: PeerKey = PeerKey(5);

    fn timing() -> Timing {
        Timing {
            choose_after: 100 * MS,
            rebalance_every: Duration::from_secs(10),
            rebalance_gain: 0.25,
            transfer_timeout: Duration::from_secs(2),
            ..Timing::default()
        }
    }

    fn costs(stages: usize) -> StageCosts {
        StageCosts {
            flops_per_sample: vec![1.0; stages],
            params: vec![4; stages],
            activation_values: 1,
            memory: vec![0; stages],
            offload_memory: vec![0; stages],
            microbatch_memory: vec![0; stages],
            param_scale: 1,
        }
    }

    fn place(peer: u64, stage: u32, throughput: f64) -> Placement {
        fixtures::placement(peer, stage, throughput, 0)
    }

    #[test]
    fn joiners_that_choose_together_spread_over_the_stages() {
        // Three peers join an empty run of three stages at once: each plays out the same
        // assignment and takes its own slot.
        let choosers = vec![
            (PeerKey(3), (0, false), None),
            (PeerKey(1), (0, false), None),
            (PeerKey(2), (0, false), None),
        ];
        // Offloaded, a stage needs a quarter of its device memory.
        fn needs<const N: usize>(n: [u64; N]) -> [Need; N] {
            n.map(|resident| Need {
                resident,
                offloaded: resident / 4,
            })
        }
        let picks: Vec<Option<u32>> = [1, 2, 3]
            .iter()
            .map(|k| choose(Vec::new(), choosers.clone(), &needs([0; 3]), PeerKey(*k)))
            .collect();
        assert_eq!(picks, [Some(0), Some(1), Some(2)]);
        // With every stage served, the slowest stage is taken.
        let served = vec![place(7, 0, 10.0), place(8, 1, 2.0), place(9, 2, 10.0)];
        assert_eq!(
            choose(
                served.clone(),
                vec![(ME, (0, false), None)],
                &needs([0; 3]),
                ME
            ),
            Some(1)
        );
        // A second joiner counts the first at stage 1's measured speed: then stage 1 holds
        // 4/s, still the slowest, so both go there.
        let both = vec![(PeerKey(4), (0, false), None), (ME, (0, false), None)];
        assert_eq!(choose(served, both, &needs([0; 3]), ME), Some(1));
        // No stage fits: none.
        assert_eq!(
            choose(
                Vec::new(),
                vec![(ME, (10, false), None)],
                &needs([20; 3]),
                ME
            ),
            None
        );
        // A peer told to take a stage first takes it, and the others choosing with it count
        // it there: three peers on three stages, the first pinned to the last stage.
        let pinned = vec![
            (PeerKey(1), (0, false), Some(2)),
            (PeerKey(2), (0, false), None),
            (PeerKey(3), (0, false), None),
        ];
        let picks: Vec<Option<u32>> = [1, 2, 3]
            .iter()
            .map(|k| choose(Vec::new(), pinned.clone(), &needs([0; 3]), PeerKey(*k)))
            .collect();
        assert_eq!(picks, [Some(2), Some(0), Some(1)]);
        // A first choice the memory cannot hold is not taken.
        let small = vec![(ME, (10, false), Some(1))];
        assert_eq!(choose(Vec::new(), small, &needs([5, 20]), ME), Some(0));
        // ... unless it offloads, and the stage's blocks wait in its host memory.
        let offloading = vec![(ME, (10, true), Some(1))];
        assert_eq!(choose(Vec::new(), offloading, &needs([5, 20]), ME), Some(1));
        let offloading = vec![(ME, (10, true), None)];
        assert_eq!(choose(Vec::new(), offloading, &needs([20; 3]), ME), Some(0));
    }

    #[test]
    fn a_peer_not_measured_yet_counts_as_its_stage_mean_when_choosing() {
        let mut m = Membership::default();
        let a = |stage, throughput| Announcement {
            throughput,
            ..serving(stage)
        };
        m.update(PeerKey(1), a(0, 10.0), Duration::ZERO);
        m.update(PeerKey(2), a(0, 0.0), Duration::ZERO);
        m.update(PeerKey(3), a(1, 4.0), Duration::ZERO);
        let estimated = placements(&m, None, 2, true);
        assert_eq!(estimated[1].throughput, 10.0);
        let measured = placements(&m, Some(place(5, 1, 1.0)), 2, false);
        assert_eq!(measured.len(), 4);
        assert_eq!(measured[1].throughput, 0.0);
    }

    /// A replica serves each requester once per transfer timeout: the peer knows whom it
    /// asked lately (a re-sync soon after a download goes to another replica, not to one
    /// that would ignore it until the download's deadline).
    #[test]
    fn a_replica_asked_for_a_state_is_known_not_to_answer_again_until_the_timeout() {
        let t = timing();
        let mut r = Role::joining(&t, Duration::ZERO);
        let asks = r.sync(
            1,
            &[PeerKey(9)],
            (1 << 20, CHUNK_BYTES),
            Duration::ZERO,
            t.transfer_timeout,
        );
        assert_eq!(
            asks,
            [(
                PeerKey(9),
                Message::StateRequest {
                    stage: 1,
                    first: 0,
                    resume: None
                }
            )]
        );
        assert!(r.asked_lately(PeerKey(9), t.transfer_timeout - MS));
        assert!(!r.asked_lately(PeerKey(8), MS));
        assert!(!r.asked_lately(PeerKey(9), t.transfer_timeout));
        r.sync(
            1,
            &[PeerKey(8)],
            (1 << 20, CHUNK_BYTES),
            t.transfer_timeout,
            t.transfer_timeout,
        );
        assert_eq!(r.asked.len(), 1, "requests past their window are forgotten");
    }

    #[test]
    fn a_download_is_heard_from_its_sources_only_and_then_served() {
        let t = timing();
        let mut r = Role::joining(&t, Duration::ZERO);
        assert_eq!(r.next_timeout(), Some(100 * MS));
        let asks = r.sync(
            1,
            &[PeerKey(9), PeerKey(7)],
            (1 << 24, CHUNK_BYTES),
            Duration::ZERO,
            t.transfer_timeout,
        );
        let firsts: Vec<Message> = asks.into_iter().map(|a| a.1).collect();
        assert_eq!(
            firsts,
            [
                Message::StateRequest {
                    stage: 1,
                    first: 0,
                    resume: None
                },
                Message::StateRequest {
                    stage: 1,
                    first: 1,
                    resume: None
                }
            ],
            "each source starts with another chunk"
        );
        assert_eq!(r.announced(), (Some(1), MemberState::Syncing));
        let state = vec![7u8; CHUNK_BYTES + 100];
        let hash = state_hash(&state);
        let cut = |i| chunk(1, 4, 4, hash, &state, (i, CHUNK_BYTES)).unwrap();
        assert_eq!(
            r.on_chunk(PeerKey(8), cut(0), &t, MS),
            ChunkOutcome::Pending
        );
        assert_eq!(
            r.on_chunk(PeerKey(9), cut(0), &t, MS),
            ChunkOutcome::Pending
        );
        assert_eq!(
            r.download_progress(),
            Some((CHUNK_BYTES as u64, state.len() as u64))
        );
        assert_eq!(
            r.download_messages(),
            [(
                PeerKey(9),
                Message::ChunkRequest {
                    stage: 1,
                    hash,
                    index: 1
                }
            )]
        );
        // 7 never answers: given up at its deadline, 9 goes on.
        assert_eq!(r.next_timeout(), Some(t.transfer_timeout));
        assert_eq!(
            r.expire_sources(t.transfer_timeout, t.transfer_timeout),
            [PeerKey(7)]
        );
        assert_eq!(r.live_sources(), 1);
        let ChunkOutcome::Complete(done) = r.on_chunk(PeerKey(9), cut(1), &t, 3 * MS) else {
            panic!("complete");
        };
        assert_eq!((done.step, done.bytes.len()), (4, state.len()));
        assert_eq!(r.next_timeout(), Some(3 * MS + t.transfer_timeout));
        assert_eq!(r.serve(), Some((1, Some(PeerKey(9)))));
        assert_eq!(r.serving(), Some(1));
        assert_eq!(r.state_transfers, 1);
        assert_eq!(
            r.state_bytes_received,
            state.len() as u64,
            "a stranger's chunk is not counted"
        );
        // A chunk of the wrong stage fails the transfer, and blames its sender.
        r.sync(
            0,
            &[PeerKey(9)],
            (1 << 24, CHUNK_BYTES),
            Duration::ZERO,
            t.transfer_timeout,
        );
        assert_eq!(
            r.on_chunk(PeerKey(9), cut(0), &t, MS),
            ChunkOutcome::Failed(TransferError::Mismatch, vec![PeerKey(9)])
        );
        // No source left: another is to be asked at once.
        assert_eq!(r.next_timeout(), Some(MS));
        r.add_sources(&[PeerKey(6)], 2 * MS, t.transfer_timeout);
        assert_eq!(r.next_timeout(), Some(2 * MS + t.transfer_timeout));
        r.source_lost(PeerKey(6), 3 * MS, t.transfer_timeout);
        assert_eq!(r.next_timeout(), Some(3 * MS));
    }

    /// Rebalancing: the peer whose move helps most plans it, waits a random part of half a
    /// period, and moves if it is still the best move; a move that helps too little, or a
    /// peer in a round, does not move.
    #[test]
    fn the_best_mover_moves_after_a_back_off() {
        let t = timing();
        let c = costs(2);
        let mut rng = SeededRng::new(1);
        // Stage 0 has three fast replicas, stage 1 one slow one: the fastest of stage 0
        // with the smallest key (this peer) should move.
        let swarm = [
            place(5, 0, 10.0),
            place(6, 0, 10.0),
            place(7, 0, 10.0),
            place(8, 1, 2.0),
        ];
        let mut r = Role::joining(&t, Duration::ZERO);
        r.resume(0);
        let first = t.rebalance_every;
        assert_eq!(
            r.consider_move(ME, &swarm, &c, &t, false, &mut rng, first),
            None
        );
        let at = r.move_at.expect("a move is planned");
        assert!(at >= first && at <= first + t.rebalance_every / 2);
        assert_eq!(r.next_timeout(), Some(at));
        let m = r
            .consider_move(ME, &swarm, &c, &t, false, &mut rng, at)
            .expect("moves");
        assert_eq!((m.from, m.to), (0, 1));
        assert_eq!(r.moves, 1);
        // Another peer's move, a small gain, or a round under way: nothing.
        let mut r = Role::joining(&t, Duration::ZERO);
        r.resume(0);
        assert_eq!(
            r.consider_move(PeerKey(6), &swarm, &c, &t, false, &mut rng, first),
            None
        );
        assert_eq!(r.move_at, None);
        let balanced = [place(5, 0, 10.0), place(6, 0, 10.0), place(8, 1, 16.0)];
        r.consider_move(ME, &balanced, &c, &t, false, &mut rng, 2 * first);
        assert_eq!(r.move_at, None);
        r.consider_move(ME, &swarm, &c, &t, true, &mut rng, 3 * first);
        assert_eq!(r.move_at, None);
        // ...but a round does not cost the period: the peer looks again an announcement
        // period later, and a move planned for the middle of a round waits for its end.
        let soon = 3 * first + t.announce_every;
        assert_eq!(r.next_timeout(), Some(soon));
        r.consider_move(ME, &swarm, &c, &t, false, &mut rng, soon);
        let at = r.move_at.expect("a move is planned after the round");
        assert_eq!(
            r.consider_move(ME, &swarm, &c, &t, true, &mut rng, at),
            None
        );
        let later = at + t.announce_every;
        assert_eq!(r.move_at, Some(later));
        assert!(
            r.consider_move(ME, &swarm, &c, &t, false, &mut rng, later)
                .is_some()
        );
    }
}
