//! A stage's state (parameters, optimizer moments, DiLoCo anchor) sent to a joining or
//! re-syncing peer in chunks, checked against a hash of the whole before it is used.

use super::message::StateChunk;
use xxhash_rust::xxh3::xxh3_64;

/// Bytes per chunk: large enough that per-message overhead vanishes, small enough that a
/// chunk never approaches the frame limit and memory follows arrival.
pub const CHUNK_BYTES: usize = 4 << 20;

/// Splits a stage's exported state into chunks.
pub fn chunks(stage: u32, step: u64, round: u64, state: &[u8]) -> Vec<StateChunk> {
    let hash = xxh3_64(state);
    let total = state.len() as u64;
    let mut out: Vec<StateChunk> = state
        .chunks(CHUNK_BYTES)
        .enumerate()
        .map(|(i, data)| StateChunk {
            stage,
            step,
            round,
            offset: (i * CHUNK_BYTES) as u64,
            total,
            hash,
            data: data.to_vec(),
        })
        .collect();
    if out.is_empty() {
        out.push(StateChunk {
            stage,
            step,
            round,
            offset: 0,
            total: 0,
            hash,
            data: Vec::new(),
        });
    }
    out
}

/// Why a download failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// The chunk belongs to another stage or another version of the state.
    #[error("chunk of another stage or state version")]
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

/// A download in progress.
#[derive(Clone, Debug)]
pub struct Download {
    stage: u32,
    max_bytes: usize,
    header: Option<(u64, u64, u64, u64)>,
    bytes: Vec<u8>,
    received: u64,
    filled: Vec<bool>,
    done: bool,
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
}

impl Download {
    /// Expects the state of `stage`, at most `max_bytes` long.
    pub fn new(stage: u32, max_bytes: usize) -> Self {
        Download {
            stage,
            max_bytes,
            header: None,
            bytes: Vec::new(),
            received: 0,
            filled: Vec::new(),
            done: false,
        }
    }

    /// Adds a chunk. Returns the state once every byte arrived and the hash matched.
    pub fn add(&mut self, chunk: StateChunk) -> Result<Option<Downloaded>, TransferError> {
        if self.done {
            return Ok(None);
        }
        if chunk.stage != self.stage {
            return Err(TransferError::Mismatch);
        }
        if chunk.total > self.max_bytes as u64 {
            return Err(TransferError::TooLarge(chunk.total));
        }
        let header = (chunk.step, chunk.round, chunk.total, chunk.hash);
        match self.header {
            None => {
                self.header = Some(header);
                // Memory is bounded by the stage's size, checked above.
                self.bytes = vec![0; chunk.total as usize];
                self.filled = vec![false; (chunk.total as usize).div_ceil(CHUNK_BYTES)];
            }
            Some(h) if h != header => return Err(TransferError::Mismatch),
            Some(_) => {}
        }
        let offset = chunk.offset as usize;
        let index = offset / CHUNK_BYTES;
        let end = offset
            .checked_add(chunk.data.len())
            .ok_or(TransferError::OutOfPlace)?;
        let expected_len = (self.bytes.len() - offset.min(self.bytes.len())).min(CHUNK_BYTES);
        // Every chunk but the one of an empty state starts inside the state: an empty chunk
        // at the very end (a state whose size is a multiple of the chunk size) is out of
        // place, not a chunk with no slot.
        let inside = offset < self.bytes.len() || (offset == 0 && self.bytes.is_empty());
        if !offset.is_multiple_of(CHUNK_BYTES)
            || !inside
            || end > self.bytes.len()
            || chunk.data.len() != expected_len
        {
            return Err(TransferError::OutOfPlace);
        }
        if let Some(slot) = self.filled.get_mut(index).filter(|f| !**f) {
            *slot = true;
            self.bytes[offset..end].copy_from_slice(&chunk.data);
            self.received += chunk.data.len() as u64;
        }
        if self.received < chunk.total {
            return Ok(None);
        }
        if xxh3_64(&self.bytes) != chunk.hash {
            return Err(TransferError::Hash);
        }
        self.done = true;
        Ok(Some(Downloaded {
            step: chunk.step,
            round: chunk.round,
            bytes: std::mem::take(&mut self.bytes),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[test]
    fn chunks_reassemble_in_any_order() {
        let s = state(3 * CHUNK_BYTES + 123);
        let mut c = chunks(2, 10, 10, &s);
        assert_eq!(c.len(), 4);
        c.reverse();
        c.push(c[1].clone()); // a duplicate is harmless
        let mut d = Download::new(2, s.len());
        let mut done = None;
        for chunk in c {
            if let Some(x) = d.add(chunk).unwrap() {
                done = Some(x);
            }
        }
        let done = done.unwrap();
        assert_eq!((done.step, done.round), (10, 10));
        assert_eq!(done.bytes, s);
    }

    /// Regression: an empty chunk at the end of a state whose size is a multiple of the chunk
    /// size indexed one past the chunk table and crashed the receiver.
    #[test]
    fn an_empty_chunk_past_the_end_is_refused_not_a_crash() {
        let s = state(2 * CHUNK_BYTES);
        let c = chunks(1, 3, 3, &s);
        let past = StateChunk {
            offset: s.len() as u64,
            data: Vec::new(),
            ..c[0].clone()
        };
        let mut d = Download::new(1, s.len());
        assert_eq!(d.add(past.clone()), Err(TransferError::OutOfPlace));
        d.add(c[0].clone()).unwrap();
        assert_eq!(d.add(past), Err(TransferError::OutOfPlace));
        // An empty state is still one empty chunk.
        let empty = chunks(1, 0, 0, &[]);
        let mut d = Download::new(1, 16);
        assert!(d.add(empty[0].clone()).unwrap().is_some());
    }

    #[test]
    fn corrupt_or_foreign_chunks_are_refused() {
        let s = state(CHUNK_BYTES + 10);
        let c = chunks(1, 3, 3, &s);
        assert_eq!(
            Download::new(2, s.len()).add(c[0].clone()),
            Err(TransferError::Mismatch)
        );
        assert!(matches!(
            Download::new(1, 100).add(c[0].clone()),
            Err(TransferError::TooLarge(_))
        ));
        let mut bad = c[1].clone();
        bad.data[0] ^= 1;
        let mut d = Download::new(1, s.len());
        d.add(c[0].clone()).unwrap();
        assert_eq!(d.add(bad), Err(TransferError::Hash));
        let mut shifted = c[1].clone();
        shifted.offset += 1;
        let mut d = Download::new(1, s.len());
        assert_eq!(d.add(shifted), Err(TransferError::OutOfPlace));
        let mut other = c[1].clone();
        other.step = 4;
        let mut d = Download::new(1, s.len());
        d.add(c[0].clone()).unwrap();
        assert_eq!(d.add(other), Err(TransferError::Mismatch));
    }
}
