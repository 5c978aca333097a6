//! A stage's state (parameters, optimizer moments, DiLoCo anchor) sent to a joining or
//! re-syncing peer in chunks, pulled from several replicas at once and checked against a hash
//! of the whole before it is used.
//!
//! A joiner asks up to [`MAX_SOURCES`] replicas for an export at once ([`RACING_SOURCES`]
//! where replicas' states differ, as in DiLoCo). A replica keeps its
//! export as a snapshot while it is downloaded and cuts chunks from it as they are asked for
//! ([`chunk`]), so a sender holds one copy of the state, not one per chunk in flight. Each
//! source first sends one chunk, which names its version (the snapshot's hash); the joiner
//! keeps the version that arrives first and pulls the chunks it lacks, [`WINDOW`] at a time
//! from every source of that version (replicas at the same step export the same bytes), so a
//! faster source serves more. Deadlines follow progress, not the whole state: a source that
//! sends nothing for the transfer timeout is given up and its chunks are asked of the others.
//! A source that leaves costs nothing already received; only when no source of the version
//! is left does the download take another version and start over.

use super::PeerKey;
use super::message::StateChunk;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use xxhash_rust::xxh3::xxh3_64;

/// Bytes per chunk: large enough that per-message overhead vanishes, small enough that a
/// chunk never approaches the frame limit and memory follows arrival.
pub const CHUNK_BYTES: usize = 4 << 20;

/// Chunks asked of one source and not received yet, at most: 16 MiB, more than a home
/// uplink sends in a round trip, so a source's link never idles waiting for the next ask.
pub const WINDOW: usize = 4;

/// Replicas asked for the state at once, at most, where they export identical bytes
/// (allreduce). Each holds a snapshot while it serves, and each shares its uplink between
/// the chunks and its own rounds, which on home links keep it busy most of a step: eight
/// sources' spare uplinks fill most of a home downlink (netsim `gpt2-home`: joiners serving
/// in 40-73 s with eight, 52-120 s with three).
pub const MAX_SOURCES: usize = 8;

/// Replicas asked at once where each exports its own bytes (DiLoCo: local parameters and
/// moments differ): the first to answer serves and the others only cost an export, so a few
/// race, no more.
pub const RACING_SOURCES: usize = 3;

/// How many chunks of `chunk_bytes` a state of `total` bytes has (an empty state is one
/// empty chunk).
pub fn chunk_count(total: u64, chunk_bytes: usize) -> u32 {
    (total as usize).div_ceil(chunk_bytes.max(1)).max(1) as u32
}

/// Chunk `index` (of `chunk_bytes`) of `state` (of stage `stage`, `step` steps and `round`
/// rounds old, hashing to `hash`), or None past its end.
pub fn chunk(
    stage: u32,
    step: u64,
    round: u64,
    hash: u64,
    state: &[u8],
    (index, chunk_bytes): (u32, usize),
) -> Option<StateChunk> {
    if index >= chunk_count(state.len() as u64, chunk_bytes) {
        return None;
    }
    let offset = index as usize * chunk_bytes;
    let end = (offset + chunk_bytes).min(state.len());
    Some(StateChunk {
        stage,
        step,
        round,
        offset: offset as u64,
        total: state.len() as u64,
        hash,
        data: state[offset..end].to_vec(),
    })
}

/// The hash a state is announced and checked with.
pub fn state_hash(state: &[u8]) -> u64 {
    xxh3_64(state)
}

/// Why a download failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// The chunk belongs to another stage.
    #[error("chunk of another stage")]
    Mismatch,
    /// The announced size exceeds what this stage's state can be.
    #[error("state of {0} bytes exceeds the stage's bound")]
    TooLarge(u64),
    /// A chunk that does not fit where it claims to go.
    #[error("chunk out of place")]
    OutOfPlace,
    /// All bytes arrived but do not hash to the announced value.
    #[error("state hash mismatch")]
    Hash,
}

/// What a chunk did to a download.
#[derive(Debug, PartialEq, Eq)]
pub enum Added {
    /// Kept (or a duplicate, or from a peer that is not a source): more to come.
    Pending,
    /// The last missing chunk: the whole state, verified.
    Complete(Downloaded),
    /// The chunk was wrong; `from` is no longer a source.
    Refused(TransferError),
    /// Every byte arrived but the whole does not hash to its version: every source that sent
    /// a chunk of it is suspect, and the download starts over.
    Corrupt(Vec<PeerKey>),
}

/// A completed, verified download.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Downloaded {
    /// Steps the state has taken.
    pub step: u64,
    /// Rounds it has completed.
    pub round: u64,
    /// The state.
    pub bytes: Vec<u8>,
    /// A source of it that served to the end (the first to send a chunk of it, if it did).
    pub source: PeerKey,
    /// From the first source asked to the last chunk, restarts included.
    pub took: Duration,
    /// Replicas that sent chunks of it.
    pub senders: usize,
}

/// A state's version, as every chunk of it says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Version {
    step: u64,
    round: u64,
    total: u64,
    hash: u64,
}

impl Version {
    fn of(c: &StateChunk) -> Self {
        Version {
            step: c.step,
            round: c.round,
            total: c.total,
            hash: c.hash,
        }
    }
}

/// A replica the state is being pulled from.
#[derive(Clone, Debug)]
struct Source {
    /// The version it serves, once a chunk said.
    version: Option<Version>,
    /// Chunks asked of it and not received yet.
    asked: BTreeSet<u32>,
    /// When it was asked first or last sent a chunk: progress is judged from then.
    heard: Duration,
}

/// A download in progress.
#[derive(Clone, Debug)]
pub struct Download {
    stage: u32,
    max_bytes: usize,
    chunk_bytes: usize,
    version: Option<Version>,
    /// Whose version it is.
    origin: Option<PeerKey>,
    bytes: Vec<u8>,
    filled: Vec<bool>,
    received: u64,
    /// Who sent each chunk held (the suspects if the whole turns out corrupt).
    senders: BTreeSet<PeerKey>,
    sources: BTreeMap<PeerKey, Source>,
    /// Sources let go while holding a snapshot for this peer (another version served it,
    /// it stalled, or the download completed), with their snapshot's hash: each is told, so
    /// it can drop its copy of the state.
    released: Vec<(PeerKey, u64)>,
    /// When the first source was asked.
    started: Option<Duration>,
    /// Bytes received in all (including chunks dropped by starting over).
    pub bytes_received: u64,
    /// Times the download started over with another version.
    pub restarts: u64,
}

impl Download {
    /// Expects the state of `stage`, at most `max_bytes` long, in chunks of [`CHUNK_BYTES`].
    pub fn new(stage: u32, max_bytes: usize) -> Self {
        Self::with_chunks(stage, max_bytes, CHUNK_BYTES)
    }

    /// Expects the state of `stage`, at most `max_bytes` long, in chunks of `chunk_bytes`
    /// (see [`super::StageCosts::state_chunk_bytes`]).
    pub fn with_chunks(stage: u32, max_bytes: usize, chunk_bytes: usize) -> Self {
        Download {
            stage,
            max_bytes,
            chunk_bytes: chunk_bytes.max(1),
            version: None,
            origin: None,
            bytes: Vec::new(),
            filled: Vec::new(),
            received: 0,
            senders: BTreeSet::new(),
            sources: BTreeMap::new(),
            released: Vec::new(),
            started: None,
            bytes_received: 0,
            restarts: 0,
        }
    }

    /// `peer` was asked for an export now: a source until it fails to make progress.
    pub fn ask(&mut self, peer: PeerKey, now: Duration) {
        self.started.get_or_insert(now);
        self.sources.entry(peer).or_insert(Source {
            version: None,
            asked: BTreeSet::new(),
            heard: now,
        });
    }

    /// Whether `peer` is a source of this download.
    pub fn is_source(&self, peer: PeerKey) -> bool {
        self.sources.contains_key(&peer)
    }

    /// Sources that may still send the version being downloaded: those of that version and
    /// those that have not said theirs yet.
    pub fn live_sources(&self) -> usize {
        self.sources
            .values()
            .filter(|s| s.version.is_none() || s.version == self.version)
            .count()
    }

    /// Bytes of the version held, and its size (0 before the first chunk).
    pub fn progress(&self) -> (u64, u64) {
        (self.received, self.version.map_or(0, |v| v.total))
    }

    /// The hash of the version being downloaded, once a chunk said.
    pub fn hash(&self) -> Option<u64> {
        self.version.map(|v| v.hash)
    }

    /// The chunk to ask the `nth` of several new sources to send first: before any chunk
    /// arrived, chunk `nth`; after, the `nth` missing one nobody was asked for (or the first
    /// missing one), so that new sources do not all send the same.
    pub fn first_wanted(&self, nth: usize) -> u32 {
        if self.version.is_none() {
            return nth as u32;
        }
        let asked: BTreeSet<u32> = self
            .sources
            .values()
            .flat_map(|s| s.asked.iter().copied())
            .collect();
        let missing = || (0..self.filled.len() as u32).filter(|i| !self.filled[*i as usize]);
        missing()
            .filter(|i| !asked.contains(i))
            .nth(nth)
            .or_else(|| missing().next())
            .unwrap_or(0)
    }

    /// `peer` is gone (or refused): its chunks in flight are asked of the others.
    pub fn lose(&mut self, peer: PeerKey) {
        self.sources.remove(&peer);
    }

    /// When the first source that has made no progress for `timeout` will be given up.
    pub fn next_deadline(&self, timeout: Duration) -> Option<Duration> {
        self.sources.values().map(|s| s.heard + timeout).min()
    }

    /// Gives up the sources that sent nothing for `timeout`; returns them.
    pub fn expire(&mut self, now: Duration, timeout: Duration) -> Vec<PeerKey> {
        let stalled: Vec<PeerKey> = self
            .sources
            .iter()
            .filter(|(_, s)| now >= s.heard + timeout)
            .map(|(k, _)| *k)
            .collect();
        for k in &stalled {
            self.release(*k);
        }
        stalled
    }

    /// Lets `peer` go as a source, telling it if it holds a snapshot for this peer.
    fn release(&mut self, peer: PeerKey) {
        if let Some(v) = self.sources.remove(&peer).and_then(|s| s.version) {
            self.released.push((peer, v.hash));
        }
    }

    /// The sources let go since last asked, with their snapshots' hashes.
    pub fn take_released(&mut self) -> Vec<(PeerKey, u64)> {
        std::mem::take(&mut self.released)
    }

    /// Takes `version` (from `origin`), dropping the chunks of any other.
    fn adopt(&mut self, version: Version, origin: PeerKey) {
        if self.version.is_some() {
            self.restarts += 1;
        }
        self.version = Some(version);
        self.origin = Some(origin);
        // Memory is bounded by the stage's size, checked before.
        self.bytes = vec![0; version.total as usize];
        self.filled = vec![false; chunk_count(version.total, self.chunk_bytes) as usize];
        self.received = 0;
        self.senders.clear();
        for s in self.sources.values_mut() {
            if s.version != Some(version) {
                s.asked.clear();
            }
        }
    }

    /// A chunk from `from` at `now`.
    pub fn add(&mut self, from: PeerKey, chunk: StateChunk, now: Duration) -> Added {
        let Some(source) = self.sources.get(&from) else {
            return Added::Pending;
        };
        let refuse = |d: &mut Self, e| {
            d.sources.remove(&from);
            Added::Refused(e)
        };
        if chunk.stage != self.stage {
            return refuse(self, TransferError::Mismatch);
        }
        if chunk.total > self.max_bytes as u64 {
            return refuse(self, TransferError::TooLarge(chunk.total));
        }
        let version = Version::of(&chunk);
        if source.version.is_some_and(|v| v != version) {
            // One source, one snapshot: a second version from it is a lie.
            return refuse(self, TransferError::OutOfPlace);
        }
        if self.version != Some(version) {
            let held_elsewhere = self.version.is_some_and(|mine| {
                self.sources
                    .iter()
                    .any(|(k, s)| *k != from && s.version == Some(mine))
            });
            if held_elsewhere {
                // Another snapshot (another step, or DiLoCo's local parameters): not
                // mixable with this one, and another source serves this one.
                self.sources.remove(&from);
                self.released.push((from, version.hash));
                return Added::Pending;
            }
            self.adopt(version, from);
        }
        let offset = chunk.offset as usize;
        let index = offset / self.chunk_bytes;
        let expected_len = (self.bytes.len() - offset.min(self.bytes.len())).min(self.chunk_bytes);
        // Every chunk but the one of an empty state starts inside the state: an empty chunk
        // at the very end (a state whose size is a multiple of the chunk size) is out of
        // place, not a chunk with no slot.
        let inside = offset < self.bytes.len() || (offset == 0 && self.bytes.is_empty());
        if !offset.is_multiple_of(self.chunk_bytes) || !inside || chunk.data.len() != expected_len {
            return refuse(self, TransferError::OutOfPlace);
        }
        let source = self.sources.get_mut(&from).expect("checked above");
        source.version = Some(version);
        source.heard = now;
        source.asked.remove(&(index as u32));
        self.bytes_received += chunk.data.len() as u64;
        if let Some(slot) = self.filled.get_mut(index).filter(|f| !**f) {
            *slot = true;
            self.bytes[offset..offset + chunk.data.len()].copy_from_slice(&chunk.data);
            self.received += chunk.data.len() as u64;
            self.senders.insert(from);
        }
        if self.filled.iter().any(|f| !f) {
            return Added::Pending;
        }
        if state_hash(&self.bytes) != version.hash {
            let suspects: Vec<PeerKey> = std::mem::take(&mut self.senders).into_iter().collect();
            for k in &suspects {
                self.sources.remove(k);
            }
            self.version = None;
            self.origin = None;
            self.bytes = Vec::new();
            self.filled.clear();
            self.received = 0;
            return Added::Corrupt(suspects);
        }
        let senders = self.senders.len();
        let done: Vec<PeerKey> = self.sources.keys().copied().collect();
        // The version's first source if it served to the end, else the one that sent the
        // last chunk: a source still holding the snapshot keeps the rounds since it, which
        // the new replica's catch-ups ask for (one given up midway may not).
        let source = self.origin.filter(|o| done.contains(o)).unwrap_or(from);
        for k in done {
            self.release(k);
        }
        Added::Complete(Downloaded {
            step: version.step,
            round: version.round,
            bytes: std::mem::take(&mut self.bytes),
            source,
            took: now.saturating_sub(self.started.unwrap_or(now)),
            senders,
        })
    }

    /// The chunks to ask for now, by source: every source of the version gets the lowest
    /// chunks nobody was asked for, up to [`WINDOW`] in flight; when none is left, a chunk
    /// that only one other source was asked for (the last chunks must not wait on the
    /// slowest source).
    pub fn requests(&mut self) -> Vec<(PeerKey, u32)> {
        let Some(version) = self.version else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut asked: BTreeMap<u32, usize> = BTreeMap::new();
        for s in self.sources.values() {
            for i in &s.asked {
                *asked.entry(*i).or_default() += 1;
            }
        }
        let missing: Vec<u32> = (0..self.filled.len() as u32)
            .filter(|i| !self.filled[*i as usize])
            .collect();
        for (k, s) in self.sources.iter_mut() {
            if s.version != Some(version) {
                continue;
            }
            while s.asked.len() < WINDOW {
                let fresh = missing.iter().find(|i| !asked.contains_key(i));
                let pick = fresh.or_else(|| {
                    missing
                        .iter()
                        .find(|i| asked.get(i) == Some(&1) && !s.asked.contains(i))
                });
                let Some(&i) = pick else {
                    break;
                };
                *asked.entry(i).or_default() += 1;
                s.asked.insert(i);
                out.push((*k, i));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);
    const T: Duration = Duration::from_secs(30);

    fn state(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    /// A replica's snapshot of `s` at `step`.
    fn cut(s: &[u8], step: u64, index: u32) -> StateChunk {
        chunk(2, step, step, state_hash(s), s, (index, CHUNK_BYTES)).unwrap()
    }

    /// Serves every request from the sources in `snapshots` (those not in it are silent)
    /// until nothing is asked; returns what the download ended with and the chunks each
    /// source sent.
    fn pull(
        d: &mut Download,
        snapshots: &BTreeMap<PeerKey, (Vec<u8>, u64)>,
        now: Duration,
    ) -> (Option<Added>, BTreeMap<PeerKey, usize>) {
        let mut sent = BTreeMap::new();
        loop {
            let asks = d.requests();
            let mut any = false;
            for (k, i) in asks {
                let Some((s, step)) = snapshots.get(&k) else {
                    continue;
                };
                any = true;
                *sent.entry(k).or_default() += 1;
                match d.add(k, cut(s, *step, i), now) {
                    Added::Pending => {}
                    other => return (Some(other), sent),
                }
            }
            if !any {
                return (None, sent);
            }
        }
    }

    #[test]
    fn chunks_reassemble_in_any_order() {
        let s = state(3 * CHUNK_BYTES + 123);
        assert_eq!(chunk_count(s.len() as u64, CHUNK_BYTES), 4);
        let mut d = Download::new(2, s.len());
        d.ask(PeerKey(1), S);
        let mut done = None;
        for i in [3, 1, 1, 0, 2] {
            // A duplicate is harmless.
            if let Added::Complete(x) = d.add(PeerKey(1), cut(&s, 10, i), S) {
                done = Some(x);
            }
        }
        let done = done.unwrap();
        assert_eq!((done.step, done.round, done.source), (10, 10, PeerKey(1)));
        assert_eq!(done.bytes, s);
        assert!(chunk(2, 0, 0, 0, &s, (4, CHUNK_BYTES)).is_none());
    }

    #[test]
    fn sources_of_one_version_share_the_work_and_a_lost_one_costs_nothing_held() {
        let s = state(40 * CHUNK_BYTES + 5);
        let n = chunk_count(s.len() as u64, CHUNK_BYTES) as u64;
        let mut d = Download::new(2, s.len());
        for k in 1..=3 {
            d.ask(PeerKey(k), S);
        }
        // Each source sends the chunk it was asked to start with; 3 serves another step.
        assert_eq!(d.add(PeerKey(1), cut(&s, 5, 0), S), Added::Pending);
        assert_eq!(d.add(PeerKey(2), cut(&s, 5, 1), S), Added::Pending);
        let newer = state(40 * CHUNK_BYTES + 5)
            .iter()
            .map(|b| b ^ 1)
            .collect::<Vec<_>>();
        assert_eq!(d.add(PeerKey(3), cut(&newer, 6, 2), S), Added::Pending);
        assert!(
            !d.is_source(PeerKey(3)),
            "another version is dropped while one is served"
        );
        assert_eq!(d.take_released(), [(PeerKey(3), state_hash(&newer))]);
        // Both remaining sources get a full window of distinct chunks.
        let asks = d.requests();
        assert_eq!(asks.len(), 2 * WINDOW);
        let distinct: BTreeSet<u32> = asks.iter().map(|a| a.1).collect();
        assert_eq!(distinct.len(), 2 * WINDOW);
        for (k, i) in asks {
            d.add(k, cut(&s, 5, i), S);
        }
        // Source 1 leaves midway: the download goes on from 2 alone, nothing re-sent.
        d.lose(PeerKey(1));
        let snapshots = BTreeMap::from([(PeerKey(2), (s.clone(), 5))]);
        let (end, sent) = pull(&mut d, &snapshots, 2 * S);
        let Some(Added::Complete(done)) = end else {
            panic!("{end:?}")
        };
        assert_eq!(done.bytes, s);
        assert_eq!(
            done.source,
            PeerKey(2),
            "1 started the version, 2 served to the end"
        );
        assert_eq!(sent[&PeerKey(2)] as u64, n - 2 - 2 * WINDOW as u64);
        assert_eq!(d.restarts, 0);
        assert_eq!(d.bytes_received, s.len() as u64);
        // Done: the source left holding a snapshot for it is told.
        assert_eq!(d.take_released(), [(PeerKey(2), state_hash(&s))]);
    }

    #[test]
    fn a_silent_source_is_given_up_and_its_chunks_asked_of_the_others() {
        let s = state(12 * CHUNK_BYTES);
        let mut d = Download::new(2, s.len());
        d.ask(PeerKey(1), S);
        d.ask(PeerKey(2), S);
        d.add(PeerKey(1), cut(&s, 1, 0), S);
        d.add(PeerKey(2), cut(&s, 1, 1), S);
        let asks = d.requests();
        // 1 answers, 2 goes silent with its window.
        for (k, i) in &asks {
            if *k == PeerKey(1) {
                d.add(*k, cut(&s, 1, *i), 5 * S);
            }
        }
        assert_eq!(d.next_deadline(T), Some(S + T));
        assert!(d.expire(S + T - S, T).is_empty());
        assert_eq!(d.expire(S + T, T), [PeerKey(2)]);
        assert_eq!(d.next_deadline(T), Some(5 * S + T));
        let snapshots = BTreeMap::from([(PeerKey(1), (s.clone(), 1))]);
        let (end, _) = pull(&mut d, &snapshots, 40 * S);
        assert!(matches!(end, Some(Added::Complete(x)) if x.bytes == s));
    }

    #[test]
    fn the_last_chunks_are_asked_twice_so_the_slowest_source_does_not_hold_them() {
        let s = state(3 * CHUNK_BYTES);
        let mut d = Download::new(2, s.len());
        d.ask(PeerKey(1), S);
        d.ask(PeerKey(2), S);
        d.add(PeerKey(1), cut(&s, 1, 0), S);
        let first = d.requests();
        assert_eq!(first, [(PeerKey(1), 1), (PeerKey(1), 2)]);
        d.add(PeerKey(2), cut(&s, 1, 0), S);
        // Nothing new is left: 2 takes the chunks only 1 was asked for.
        assert_eq!(d.requests(), [(PeerKey(2), 1), (PeerKey(2), 2)]);
        assert!(d.requests().is_empty());
        d.add(PeerKey(2), cut(&s, 1, 1), S);
        assert!(matches!(
            d.add(PeerKey(2), cut(&s, 1, 2), S),
            Added::Complete(_)
        ));
    }

    #[test]
    fn with_no_source_of_its_version_left_a_download_starts_over_with_another() {
        let s = state(6 * CHUNK_BYTES);
        let newer: Vec<u8> = s.iter().map(|b| b.wrapping_add(3)).collect();
        let mut d = Download::new(2, s.len());
        d.ask(PeerKey(1), S);
        d.add(PeerKey(1), cut(&s, 1, 0), S);
        d.lose(PeerKey(1));
        assert_eq!(d.live_sources(), 0);
        d.ask(PeerKey(4), 2 * S);
        d.add(PeerKey(4), cut(&newer, 2, 0), 2 * S);
        assert_eq!(
            (d.restarts, d.progress()),
            (1, (CHUNK_BYTES as u64, s.len() as u64))
        );
        let snapshots = BTreeMap::from([(PeerKey(4), (newer.clone(), 2))]);
        let (end, _) = pull(&mut d, &snapshots, 3 * S);
        assert!(matches!(end, Some(Added::Complete(x)) if x.bytes == newer && x.step == 2));
    }

    #[test]
    fn corrupt_or_foreign_chunks_are_refused_and_blamed() {
        let s = state(CHUNK_BYTES + 10);
        let fresh = |sources: &[u64]| {
            let mut d = Download::new(2, s.len());
            for k in sources {
                d.ask(PeerKey(*k), S);
            }
            d
        };
        let mut other_stage = cut(&s, 3, 0);
        other_stage.stage = 1;
        let mut d = fresh(&[1]);
        assert_eq!(
            d.add(PeerKey(1), other_stage, S),
            Added::Refused(TransferError::Mismatch)
        );
        assert!(!d.is_source(PeerKey(1)));
        let mut d = Download::new(2, 100);
        d.ask(PeerKey(1), S);
        assert!(matches!(
            d.add(PeerKey(1), cut(&s, 3, 0), S),
            Added::Refused(TransferError::TooLarge(_))
        ));
        // Not a source: ignored.
        assert_eq!(
            fresh(&[1]).add(PeerKey(9), cut(&s, 3, 0), S),
            Added::Pending
        );
        let mut shifted = cut(&s, 3, 1);
        shifted.offset += 1;
        assert_eq!(
            fresh(&[1]).add(PeerKey(1), shifted, S),
            Added::Refused(TransferError::OutOfPlace)
        );
        // A source that changes its version mid-download lies.
        let mut d = fresh(&[1]);
        d.add(PeerKey(1), cut(&s, 3, 0), S);
        assert_eq!(
            d.add(PeerKey(1), cut(&s, 4, 1), S),
            Added::Refused(TransferError::OutOfPlace)
        );
        // Bytes that do not hash to their version: both senders are suspects, and the
        // download waits for new sources.
        let mut d = fresh(&[1, 2]);
        d.add(PeerKey(1), cut(&s, 3, 0), S);
        let mut bad = cut(&s, 3, 1);
        bad.data[0] ^= 1;
        assert_eq!(
            d.add(PeerKey(2), bad, S),
            Added::Corrupt(vec![PeerKey(1), PeerKey(2)])
        );
        assert_eq!((d.live_sources(), d.progress()), (0, (0, 0)));
    }

    /// Regression: an empty chunk at the end of a state whose size is a multiple of the chunk
    /// size indexed one past the chunk table and crashed the receiver.
    #[test]
    fn an_empty_chunk_past_the_end_is_refused_not_a_crash() {
        let s = state(2 * CHUNK_BYTES);
        let past = StateChunk {
            offset: s.len() as u64,
            data: Vec::new(),
            ..cut(&s, 3, 0)
        };
        let mut d = Download::new(2, s.len());
        d.ask(PeerKey(1), S);
        assert_eq!(
            d.add(PeerKey(1), past, S),
            Added::Refused(TransferError::OutOfPlace)
        );
        // An empty state is still one empty chunk.
        let mut d = Download::new(2, 16);
        d.ask(PeerKey(1), S);
        assert!(matches!(
            d.add(PeerKey(1), cut(&[], 0, 0), S),
            Added::Complete(_)
        ));
    }
}
