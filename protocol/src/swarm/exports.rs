//! Serving this stage's state to joiners and re-syncing replicas.
//!
//! An export copies the whole state (parameters, optimizer moments, DiLoCo anchor) and runs
//! before any training job, so requests are what a peer could flood a replica with: exports
//! run at most [`MAX_RUNNING`] at a time, none while an averaging round is under way (the
//! state would be mid-round, unlike the other replicas'), each requester is served at most
//! once per transfer timeout (a joiner whose download failed asks again after its deadline),
//! and at most [`MAX_WAITING`] requests wait.
//!
//! A finished export is kept as a snapshot while its requesters pull chunks of it (see
//! [`super::transfer`]): chunks are cut as they are asked for, so memory is one copy of the
//! state however many chunks are in flight. A request that comes while a snapshot of the
//! current step is held is served from it without another export. A snapshot is dropped once
//! every peer it served released it (see [`StateExports::release`]) or nobody asked anything
//! of it for a transfer timeout, and at most [`MAX_SNAPSHOTS`] are kept;
//! each requester may pull at most twice its chunks (the endgame asks some twice), so a
//! request costs a bounded upload. An operator may cap the upload chunks take
//! ([`StateExports::set_upload_limit`]): chunks then leave one after another at that rate.

use super::PeerKey;
use super::interface::Job;
use super::message::{Message, StateChunk};
use super::outbox::Outbox;
use super::transfer::{WINDOW, chunk, chunk_count, state_hash};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

/// Exports queued or running at once, at most: each holds a copy of the state in memory.
pub(super) const MAX_RUNNING: usize = 2;

/// Requests waiting for a round to end or an export to finish, at most.
pub(super) const MAX_WAITING: usize = 64;

/// Snapshots kept at once, at most (the least recently used goes first).
pub(super) const MAX_SNAPSHOTS: usize = 2;

/// Round history kept for downloads under way, in snapshot sizes: int8 rounds of a stage
/// are a sixteenth of its state (parameters and two AdamW moments, fp32), so this holds the
/// rounds of a download that takes 32 steps.
const HISTORY_PER_SNAPSHOT: usize = 2;

/// Chunks waiting for the upload limit, at most: a full window for every request that may
/// wait.
const MAX_PACED: usize = MAX_WAITING * WINDOW;

/// Where a state stands: its stage, steps and rounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct At {
    pub stage: u32,
    pub step: u64,
    pub round: u64,
}

/// Exports made for one requester within a transfer timeout.
#[derive(Clone, Copy, Debug)]
struct Served {
    since: Duration,
    exports: u32,
    done: bool,
}

/// Exports one requester may cause within a transfer timeout, at most, each after it was
/// done with the last: a re-sync right after a download is not a flood, a loop of them is.
const EXPORTS_PER_REQUESTER: u32 = 3;

/// An export kept while it is downloaded.
#[derive(Debug)]
struct Snapshot {
    at: At,
    hash: u64,
    bytes: Vec<u8>,
    /// Chunks sent to each peer it serves.
    sent: BTreeMap<PeerKey, u32>,
    /// Those of them done with it (see [`StateExports::release`]).
    released: BTreeSet<PeerKey>,
    /// When a chunk of it was last asked for.
    used: Duration,
    chunk_bytes: usize,
}

impl Snapshot {
    /// How many chunks it is cut into.
    fn chunks(&self) -> u32 {
        chunk_count(self.bytes.len() as u64, self.chunk_bytes)
    }

    /// Chunk `index` of it, None past its end.
    fn cut(&self, index: u32) -> Option<StateChunk> {
        let at = self.at;
        let cut = (index, self.chunk_bytes);
        chunk(at.stage, at.step, at.round, self.hash, &self.bytes, cut)
    }

    /// Whether chunk `index` may go to `to` (within `to`'s allowance); counts it if so.
    fn grant(&mut self, to: PeerKey, index: u32, now: Duration) -> bool {
        let chunks = self.chunks();
        let allowance = 2 * chunks + WINDOW as u32;
        let Some(sent) = self.sent.get_mut(&to).filter(|n| **n < allowance) else {
            return false;
        };
        if index >= chunks {
            return false;
        }
        *sent += 1;
        self.used = now;
        true
    }
}

/// The state exports of one replica.
#[derive(Debug)]
pub(super) struct StateExports {
    /// How long a requester waits before it is served again, and a snapshot is kept unused.
    every: Duration,
    running: usize,
    /// Requests waiting, with the chunk each wants first.
    waiting: VecDeque<(PeerKey, u32)>,
    /// The chunk each requester of a running export wants first.
    first: BTreeMap<PeerKey, u32>,
    /// Each recent requester: since when, exports made for it, and whether it is done with
    /// the last (pulled it whole or released it).
    served: BTreeMap<PeerKey, Served>,
    snapshots: Vec<Snapshot>,
    /// Snapshots dropped once their downloads were done, as (round, bytes, until when): their
    /// downloaders still catch up the rounds since from this replica for a while.
    catching_up: Vec<(u64, usize, Duration)>,
    /// Upload for state chunks, bytes per second (None: as fast as the link goes).
    limit: Option<f64>,
    /// Chunks granted and waiting for the upload limit: (to, snapshot hash, index).
    paced: VecDeque<(PeerKey, u64, u32)>,
    /// When the upload limit lets the next chunk go.
    next_send: Duration,
    /// Bytes per chunk (see [`crate::swarm::StageCosts::state_chunk_bytes`]).
    chunk_bytes: usize,
}

impl StateExports {
    /// Exports serving each requester at most once per `every`, cut in chunks of
    /// `chunk_bytes`.
    pub fn new(every: Duration, chunk_bytes: usize) -> Self {
        StateExports {
            every,
            running: 0,
            waiting: VecDeque::new(),
            first: BTreeMap::new(),
            served: BTreeMap::new(),
            snapshots: Vec::new(),
            catching_up: Vec::new(),
            limit: None,
            paced: VecDeque::new(),
            next_send: Duration::ZERO,
            chunk_bytes: chunk_bytes.max(1),
        }
    }

    /// Caps the upload state chunks take at `bytes_per_s` (a volunteer keeps its uplink for
    /// training, or shares it with the rest of its home).
    pub fn set_upload_limit(&mut self, bytes_per_s: Option<f64>) {
        self.limit = bytes_per_s.filter(|b| *b > 0.0);
    }

    /// Sends the chunk a requester wants first (`first`: any number, taken round the
    /// snapshot's chunks).
    fn send_first(
        &mut self,
        out: &mut Outbox,
        which: usize,
        to: PeerKey,
        first: u32,
        now: Duration,
    ) {
        let index = first % self.snapshots[which].chunks();
        self.send(out, which, to, index, now);
    }

    /// Sends chunk `index` of the snapshot `which` to `to` if its allowance lets it: now, or
    /// when the upload limit does.
    fn send(&mut self, out: &mut Outbox, which: usize, to: PeerKey, index: u32, now: Duration) {
        let s = &mut self.snapshots[which];
        if !s.grant(to, index, now) {
            return;
        }
        if s.sent.get(&to).is_some_and(|n| *n >= s.chunks()) {
            self.note_done(to);
        }
        let s = &self.snapshots[which];
        if self.limit.is_some() {
            if self.paced.len() < MAX_PACED {
                self.paced.push_back((to, s.hash, index));
            }
            self.pump(out, now);
            return;
        }
        if let Some(c) = s.cut(index) {
            out.send(to, Message::StateChunk(c));
        }
    }

    /// The snapshot of `stage` hashing to `hash`, if held.
    fn find(&self, stage: u32, hash: u64) -> Option<usize> {
        self.snapshots
            .iter()
            .position(|s| s.hash == hash && s.at.stage == stage)
    }

    /// Sends the paced chunks the upload limit lets go by `now`.
    pub fn pump(&mut self, out: &mut Outbox, now: Duration) {
        let Some(limit) = self.limit else {
            return;
        };
        while now >= self.next_send {
            let Some((to, hash, index)) = self.paced.pop_front() else {
                return;
            };
            // A snapshot dropped since takes its chunks with it.
            let Some(s) = self.snapshots.iter().find(|s| s.hash == hash) else {
                continue;
            };
            if let Some(c) = s.cut(index) {
                let spent = Duration::from_secs_f64(c.data.len() as f64 / limit);
                self.next_send = self.next_send.max(now) + spent;
                out.send(to, Message::StateChunk(c));
            }
        }
    }

    /// When paced chunks are due next, if any wait.
    pub fn next_timeout(&self) -> Option<Duration> {
        (!self.paced.is_empty()).then_some(self.next_send)
    }

    /// `to` asks for the state (`first`: the chunk it wants first; `resume`: the version
    /// it holds chunks of), which stands at `at`. A snapshot of version `resume` goes on if
    /// held; else one of `at` serves if held; else an export: now if it may be, later if a
    /// round runs (`in_round`) or enough exports run already, not at all if too many wait,
    /// or `to` is still served one (it neither pulled it whole nor released it), or it was
    /// served [`EXPORTS_PER_REQUESTER`] within the transfer timeout.
    #[allow(clippy::too_many_arguments)]
    pub fn request(
        &mut self,
        out: &mut Outbox,
        to: PeerKey,
        first: u32,
        resume: Option<u64>,
        at: At,
        in_round: bool,
        now: Duration,
    ) {
        let every = self.every;
        self.served
            .retain(|_, s| now.saturating_sub(s.since) < every);
        if let Some(which) = self.snapshots.iter().position(|s| Some(s.hash) == resume) {
            // A downloader that lost its other sources, or gave this one up and found no
            // better: its version goes on.
            self.snapshots[which].sent.entry(to).or_insert(0);
            self.send_first(out, which, to, first, now);
            return;
        }
        let refused = self
            .served
            .get(&to)
            .is_some_and(|s| !s.done || s.exports >= EXPORTS_PER_REQUESTER);
        if refused || self.waiting.iter().any(|w| w.0 == to) {
            return;
        }
        if let Some(which) = self.snapshots.iter().position(|s| s.at == at) {
            self.note_served(to, now);
            self.snapshots[which].sent.entry(to).or_insert(0);
            self.send_first(out, which, to, first, now);
        } else if !in_round && self.running < MAX_RUNNING {
            self.start(out, to, first, now);
        } else if self.waiting.len() < MAX_WAITING {
            self.waiting.push_back((to, first));
        }
    }

    /// `to` is served a snapshot (an export, or one held).
    fn note_served(&mut self, to: PeerKey, now: Duration) {
        let s = self.served.entry(to).or_insert(Served {
            since: now,
            exports: 0,
            done: false,
        });
        s.exports += 1;
        s.done = false;
    }

    /// `to` is done with the snapshot it was served: it may ask for another.
    fn note_done(&mut self, to: PeerKey) {
        if let Some(s) = self.served.get_mut(&to) {
            s.done = true;
        }
    }

    fn start(&mut self, out: &mut Outbox, to: PeerKey, first: u32, now: Duration) {
        self.running += 1;
        self.note_served(to, now);
        self.first.insert(to, first);
        out.compute(Job::Export { to });
    }

    /// An export for `to` finished with `bytes` (the state at `at`): kept as a snapshot, and
    /// the chunk `to` wants first is sent. Two requests that came while neither's export had
    /// finished export the same version twice: the second serves its requester from the
    /// first's snapshot, since chunk requests name the version and find the first.
    pub fn exported(
        &mut self,
        out: &mut Outbox,
        to: PeerKey,
        at: At,
        bytes: Vec<u8>,
        now: Duration,
    ) {
        let first = self.first.remove(&to).unwrap_or(0);
        let hash = state_hash(&bytes);
        if let Some(which) = self.find(at.stage, hash) {
            self.snapshots[which].sent.entry(to).or_insert(0);
            self.send_first(out, which, to, first, now);
            return;
        }
        if self.snapshots.len() >= MAX_SNAPSHOTS
            && let Some(lru) = (0..self.snapshots.len()).min_by_key(|i| self.snapshots[*i].used)
        {
            self.snapshots.swap_remove(lru);
        }
        self.snapshots.push(Snapshot {
            at,
            hash,
            bytes,
            sent: BTreeMap::from([(to, 0)]),
            released: BTreeSet::new(),
            used: now,
            chunk_bytes: self.chunk_bytes,
        });
        self.send_first(out, self.snapshots.len() - 1, to, first, now);
    }

    /// `from` asks for chunk `index` of the snapshot of `stage` hashing to `hash`: sent if
    /// that snapshot is held for it. An error is the violation to report.
    pub fn chunk_request(
        &mut self,
        out: &mut Outbox,
        from: PeerKey,
        stage: u32,
        hash: u64,
        index: u32,
        now: Duration,
    ) -> Result<(), &'static str> {
        let Some(which) = self.find(stage, hash) else {
            // Dropped since (its requester was too slow, or the peer moved on).
            return Ok(());
        };
        if index >= self.snapshots[which].chunks() {
            return Err("a state chunk past the state's end");
        }
        self.send(out, which, from, index, now);
        Ok(())
    }

    /// `from` is done with the snapshot of `stage` hashing to `hash`. Once every peer it
    /// served is, it is dropped; the rounds since it are kept a transfer timeout longer for
    /// the downloaders' catch-ups.
    pub fn release(&mut self, from: PeerKey, stage: u32, hash: u64, now: Duration) {
        let Some(which) = self.find(stage, hash) else {
            return;
        };
        let s = &mut self.snapshots[which];
        if !s.sent.contains_key(&from) {
            return;
        }
        s.released.insert(from);
        self.note_done(from);
        let s = &mut self.snapshots[which];
        if s.sent.keys().all(|k| s.released.contains(k)) {
            let s = self.snapshots.swap_remove(which);
            self.catching_up
                .push((s.at.round, s.bytes.len(), now + self.every));
        }
    }

    /// Drops the snapshots nobody asked anything of for the transfer timeout.
    pub fn expire(&mut self, now: Duration) {
        let every = self.every;
        self.snapshots
            .retain(|s| now.saturating_sub(s.used) < every);
        self.catching_up.retain(|c| now < c.2);
    }

    /// What the round history must keep for the downloads under way: the rounds since the
    /// oldest snapshot, up to [`HISTORY_PER_SNAPSHOT`] times the largest snapshot's size (a
    /// downloader a few rounds behind catches up rather than downloading again).
    pub fn history_needed(&self) -> Option<(u64, usize)> {
        let held = self.snapshots.iter().map(|s| (s.at.round, s.bytes.len()));
        let done = self.catching_up.iter().map(|c| (c.0, c.1));
        let all: Vec<(u64, usize)> = held.chain(done).collect();
        let since = all.iter().map(|a| a.0).min()?;
        let largest = all.iter().map(|a| a.1).max().unwrap_or(0);
        Some((since, HISTORY_PER_SNAPSHOT * largest))
    }

    /// The stage's state is about to be replaced: its snapshots serve nobody.
    pub fn forget_snapshots(&mut self) {
        self.snapshots.clear();
        self.catching_up.clear();
        self.paced.clear();
    }

    /// An export finished (or failed); waiting requests go on if they may.
    pub fn done(&mut self, out: &mut Outbox, in_round: bool, now: Duration) {
        self.running = self.running.saturating_sub(1);
        self.resume(out, in_round, now);
    }

    /// Starts waiting exports while fewer than [`MAX_RUNNING`] run and no round is under way.
    pub fn resume(&mut self, out: &mut Outbox, in_round: bool, now: Duration) {
        while !in_round && self.running < MAX_RUNNING {
            let Some((to, first)) = self.waiting.pop_front() else {
                return;
            };
            self.start(out, to, first, now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::swarm::fixtures::jobs;
    use crate::swarm::transfer::CHUNK_BYTES;

    const S: Duration = Duration::from_secs(1);
    const AT: At = At {
        stage: 1,
        step: 4,
        round: 4,
    };

    /// The chunks sent, as (to, offset in chunks, step).
    fn chunks(out: &mut Outbox) -> Vec<(u64, u64, u64)> {
        out.drain()
            .into_iter()
            .filter_map(|a| match a {
                crate::swarm::Action::Send {
                    to,
                    msg: Message::StateChunk(c),
                } => Some((to.0, c.offset / CHUNK_BYTES as u64, c.step)),
                _ => None,
            })
            .collect()
    }

    fn exports(out: &mut Outbox) -> Vec<u64> {
        jobs(out)
            .into_iter()
            .filter_map(|j| match j {
                Job::Export { to } => Some(to.0),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn exports_are_few_at_a_time_never_mid_round_and_once_per_requester() {
        let mut e = StateExports::new(30 * S, CHUNK_BYTES);
        let mut out = Outbox::new(PeerKey(1));
        // Mid-round: wait.
        e.request(&mut out, PeerKey(7), 0, None, AT, true, S);
        assert!(exports(&mut out).is_empty());
        e.resume(&mut out, false, 2 * S);
        assert_eq!(exports(&mut out), [7]);
        // A repeat while served lately is dropped; others run up to the cap, then wait.
        for k in [7, 8, 9, 10] {
            e.request(&mut out, PeerKey(k), 0, None, AT, false, 3 * S);
        }
        assert_eq!(exports(&mut out), [8], "two run at once");
        e.done(&mut out, false, 4 * S);
        assert_eq!(exports(&mut out), [9]);
        e.done(&mut out, false, 5 * S);
        e.done(&mut out, false, 5 * S);
        assert_eq!(exports(&mut out), [10]);
        // Served again once the transfer timeout has passed.
        e.done(&mut out, false, 6 * S);
        e.request(&mut out, PeerKey(7), 0, None, AT, false, 20 * S);
        assert!(exports(&mut out).is_empty());
        e.request(&mut out, PeerKey(7), 0, None, AT, false, 32 * S);
        assert_eq!(exports(&mut out), [7]);
        // The wait is bounded: a flood of fresh keys does not grow it.
        let mut e = StateExports::new(30 * S, CHUNK_BYTES);
        for k in 0..10_000 {
            e.request(&mut out, PeerKey(100 + k), 0, None, AT, true, S);
        }
        assert_eq!(e.waiting.len(), MAX_WAITING);
    }

    /// Two joiners asking at once both start an export of the same version; each is then
    /// served every chunk it asks for (the second's chunk requests find the first snapshot).
    #[test]
    fn requesters_whose_exports_ran_together_are_both_served() {
        let mut e = StateExports::new(30 * S, CHUNK_BYTES);
        let mut out = Outbox::new(PeerKey(1));
        e.request(&mut out, PeerKey(7), 0, None, AT, false, S);
        e.request(&mut out, PeerKey(8), 1, None, AT, false, S);
        assert_eq!(exports(&mut out), [7, 8]);
        let state = vec![5u8; 3 * CHUNK_BYTES];
        let hash = state_hash(&state);
        e.exported(&mut out, PeerKey(7), AT, state.clone(), 2 * S);
        e.exported(&mut out, PeerKey(8), AT, state, 2 * S);
        assert_eq!(e.snapshots.len(), 1, "one copy of one version");
        assert_eq!(chunks(&mut out), [(7, 0, 4), (8, 1, 4)]);
        for (k, i) in [(7, 1), (7, 2), (8, 0), (8, 2)] {
            e.chunk_request(&mut out, PeerKey(k), 1, hash, i, 3 * S)
                .unwrap();
        }
        assert_eq!(
            chunks(&mut out),
            [(7, 1, 4), (7, 2, 4), (8, 0, 4), (8, 2, 4)]
        );
    }

    #[test]
    fn a_snapshot_serves_chunks_as_asked_within_an_allowance_until_unused() {
        let mut e = StateExports::new(30 * S, CHUNK_BYTES);
        let mut out = Outbox::new(PeerKey(1));
        e.request(&mut out, PeerKey(7), 2, None, AT, false, S);
        assert_eq!(exports(&mut out), [7]);
        let state = vec![5u8; 3 * CHUNK_BYTES];
        let hash = state_hash(&state);
        e.exported(&mut out, PeerKey(7), AT, state, 2 * S);
        e.done(&mut out, false, 2 * S);
        assert_eq!(chunks(&mut out), [(7, 2, 4)], "the chunk asked for first");
        e.chunk_request(&mut out, PeerKey(7), 1, hash, 0, 3 * S)
            .unwrap();
        assert_eq!(chunks(&mut out), [(7, 0, 4)]);
        // Past the end: a violation; another stage or version, or a peer it was not made
        // for: nothing.
        assert!(
            e.chunk_request(&mut out, PeerKey(7), 1, hash, 3, 3 * S)
                .is_err()
        );
        e.chunk_request(&mut out, PeerKey(7), 2, hash, 0, 3 * S)
            .unwrap();
        e.chunk_request(&mut out, PeerKey(7), 1, hash ^ 1, 0, 3 * S)
            .unwrap();
        e.chunk_request(&mut out, PeerKey(8), 1, hash, 0, 3 * S)
            .unwrap();
        assert!(chunks(&mut out).is_empty());
        // A second joiner at the same step is served from the snapshot, no export.
        e.request(&mut out, PeerKey(8), 1, None, AT, false, 3 * S);
        assert!(exports(&mut out).is_empty());
        assert_eq!(chunks(&mut out), [(8, 1, 4)]);
        // Each requester gets at most twice the state, plus a window.
        for _ in 0..100 {
            e.chunk_request(&mut out, PeerKey(7), 1, hash, 1, 4 * S)
                .unwrap();
        }
        assert_eq!(chunks(&mut out).len(), 2 * 3 + WINDOW - 2);
        // Unused for the transfer timeout: dropped; a request then exports again.
        e.expire(33 * S);
        assert_eq!(e.snapshots.len(), 1);
        e.expire(34 * S);
        assert!(e.snapshots.is_empty());
        e.request(&mut out, PeerKey(9), 0, None, AT, false, 35 * S);
        assert_eq!(exports(&mut out), [9]);
    }

    #[test]
    fn the_least_recently_used_snapshot_makes_room() {
        let mut e = StateExports::new(30 * S, CHUNK_BYTES);
        let mut out = Outbox::new(PeerKey(1));
        for (k, step) in [(7, 4), (8, 5), (9, 6)] {
            let at = At {
                step,
                round: step,
                ..AT
            };
            e.exported(&mut out, PeerKey(k), at, vec![k as u8; 10], S * k as u32);
        }
        let steps: Vec<u64> = e.snapshots.iter().map(|s| s.at.step).collect();
        assert_eq!(steps.len(), MAX_SNAPSHOTS);
        assert!(!steps.contains(&4));
    }

    #[test]
    fn a_requester_that_asks_again_goes_on_with_its_snapshot() {
        let mut e = StateExports::new(30 * S, CHUNK_BYTES);
        let mut out = Outbox::new(PeerKey(1));
        e.request(&mut out, PeerKey(7), 0, None, AT, false, S);
        e.exported(&mut out, PeerKey(7), AT, vec![1; 10], S);
        e.done(&mut out, false, S);
        exports(&mut out);
        assert_eq!(chunks(&mut out), [(7, 0, 4)]);
        // Served lately, but the version it holds goes on: no new export. The chunk asked
        // first is taken round the state's chunks (one here).
        let later = At { step: 9, ..AT };
        e.request(
            &mut out,
            PeerKey(7),
            5,
            Some(state_hash(&[1; 10])),
            later,
            false,
            2 * S,
        );
        assert!(exports(&mut out).is_empty());
        assert_eq!(chunks(&mut out), [(7, 0, 4)]);
        // It pulled the whole state: asking again without a version is a new download.
        e.request(&mut out, PeerKey(7), 0, None, later, false, 3 * S);
        assert_eq!(exports(&mut out), [7]);
        assert_eq!(e.history_needed(), Some((4, 2 * 10)));
    }

    #[test]
    fn an_upload_limit_spaces_chunks_out() {
        let mut e = StateExports::new(30 * S, CHUNK_BYTES);
        e.set_upload_limit(Some(CHUNK_BYTES as f64)); // a chunk a second
        let mut out = Outbox::new(PeerKey(1));
        let state = vec![5u8; 3 * CHUNK_BYTES];
        let hash = state_hash(&state);
        e.request(&mut out, PeerKey(7), 0, None, AT, false, S);
        e.exported(&mut out, PeerKey(7), AT, state, S);
        for i in 1..3 {
            e.chunk_request(&mut out, PeerKey(7), 1, hash, i, S)
                .unwrap();
        }
        assert_eq!(chunks(&mut out).len(), 1, "one now");
        assert_eq!(e.next_timeout(), Some(2 * S));
        e.pump(&mut out, 2 * S - Duration::from_millis(1));
        assert!(chunks(&mut out).is_empty());
        e.pump(&mut out, 2 * S);
        assert_eq!(chunks(&mut out), [(7, 1, 4)]);
        e.pump(&mut out, 3 * S);
        assert_eq!(chunks(&mut out), [(7, 2, 4)]);
        assert_eq!(e.next_timeout(), None);
    }

    #[test]
    fn a_snapshot_released_by_its_downloaders_is_dropped_but_its_rounds_are_kept_a_while() {
        let mut e = StateExports::new(30 * S, CHUNK_BYTES);
        let mut out = Outbox::new(PeerKey(1));
        e.exported(&mut out, PeerKey(7), AT, vec![1; 10], S);
        e.request(&mut out, PeerKey(8), 0, None, AT, false, S);
        let hash = state_hash(&[1; 10]);
        // A stranger's release, or another version's, changes nothing.
        e.release(PeerKey(9), 1, hash, S);
        e.release(PeerKey(7), 1, hash ^ 1, S);
        e.release(PeerKey(7), 1, hash, S);
        assert_eq!(e.snapshots.len(), 1, "8 still downloads");
        e.release(PeerKey(8), 1, hash, 2 * S);
        assert!(e.snapshots.is_empty());
        assert_eq!(e.history_needed(), Some((4, 2 * 10)));
        // Done with its snapshot, 8 may ask for another (a re-sync), a few times.
        exports(&mut out);
        for _ in 0..5 {
            e.request(&mut out, PeerKey(8), 0, None, AT, false, 3 * S);
            e.done(&mut out, false, 3 * S);
            e.note_done(PeerKey(8));
        }
        assert_eq!(
            exports(&mut out),
            [8, 8],
            "{} exports per requester",
            EXPORTS_PER_REQUESTER
        );
        e.expire(32 * S);
        assert_eq!(e.history_needed(), None);
    }
}
