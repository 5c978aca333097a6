//! Chunked top-k (`ctopk:K/C:B`): the update codec of the SparseLoCo/DeMo class, for DiLoCo
//! pseudo-gradients sent with error feedback.
//!
//! The tensor is cut into chunks of `C` values (the last may be shorter); each chunk keeps its
//! `K` largest magnitudes. Each kept value travels as a sign bit and `B - 1` bits naming one
//! of `L = 2^(B-1)` magnitude levels of its chunk: the kept magnitudes, ranked, fall into `L`
//! groups of equal count, and a group's level is its mean (bf16, `2L` bytes a chunk). Levels
//! by rank rather than on a grid between the smallest and largest kept magnitude: the tail a
//! top-k keeps is skewed, and one outlier would stretch a grid so that most values (those near
//! the threshold) decode several times too large. Positions are Rice-coded gaps. Chunking
//! makes the selection a local pass (no global sort), bounds every gap by `C`, and spreads
//! what is sent over the whole tensor instead of letting a few layers take it all.
//!
//! Layout: all chunks' levels, then all values packed `B` bits each, then all chunks' index
//! codes, each section padded to a byte. Positions within a chunk are ascending and their gaps
//! (`p[i] - p[i-1] - 1`, the first from -1) are Rice codes with the parameter
//! [`rice_parameter`] derives from `C` and `K` (positions of a top-k are close to uniform, so
//! gaps are close to geometric, which Rice codes within a few percent of their entropy).

use super::*;
use half::bf16;

/// Chunk sizes accepted: powers of two in this range.
pub(super) const MIN_CHUNK: u32 = 16;
pub(super) const MAX_CHUNK: u32 = 1 << 15;
/// Bits per value accepted (sign included): at most 8 levels a chunk.
pub(super) const MAX_BITS: u8 = 4;

/// Checks `ctopk` parameters.
pub(super) fn validate(k: u32, chunk: u32, bits: u8) -> Result<(), CodecError> {
    if !chunk.is_power_of_two() || !(MIN_CHUNK..=MAX_CHUNK).contains(&chunk) {
        return Err(CodecError::BadParameter(format!(
            "chunk of {chunk} values: a power of two in {MIN_CHUNK}..={MAX_CHUNK}"
        )));
    }
    if k == 0 || k > chunk {
        return Err(CodecError::BadParameter(format!(
            "{k} values kept per chunk of {chunk}"
        )));
    }
    if bits == 0 || bits > MAX_BITS {
        return Err(CodecError::BadParameter(format!(
            "{bits} bits per value outside 1..={MAX_BITS}"
        )));
    }
    Ok(())
}

/// Header packing: `k` in the low 16 bits of the parameter word, `log2(chunk)` above.
pub(super) fn pack_param(k: u32, chunk: u32) -> u32 {
    // k <= chunk <= 2^15 fits the low 16 bits.
    k | (chunk.trailing_zeros() << 16)
}

/// The inverse of [`pack_param`] (not validated).
pub(super) fn unpack_param(param: u32) -> (u32, u32) {
    let log2 = (param >> 16) & 0xff;
    let chunk = if log2 < 32 { 1u32 << log2 } else { 0 };
    (param & 0xffff, chunk)
}

/// Rice parameter for the gaps between `k` positions among `len`: about `log2` of the mean
/// gap, less one (the optimum for geometric gaps lies between the two).
fn rice_parameter(len: usize, k: usize) -> u32 {
    (len / k.max(1)).max(1).ilog2().saturating_sub(1)
}

/// The chunks of `n` values: (start, length, kept).
fn chunks(n: usize, chunk: usize, k: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..n.div_ceil(chunk)).map(move |c| {
        let start = c * chunk;
        let len = chunk.min(n - start);
        (start, len, k.min(len))
    })
}

/// The chunk lengths of `n` values, as (how many, length): the full chunks and the tail.
/// Closed forms, so that checking a header costs nothing whatever the size it claims.
fn chunk_lengths(n: usize, chunk: usize) -> [(usize, usize); 2] {
    [
        (n / chunk, chunk),
        (usize::from(!n.is_multiple_of(chunk)), n % chunk),
    ]
}

/// Values kept over a tensor of `n` values.
pub(super) fn kept_count(n: usize, k: u32, chunk: u32) -> usize {
    chunk_lengths(n, chunk as usize)
        .iter()
        .map(|&(count, len)| count * len.min(k as usize))
        .sum()
}

/// Magnitude levels per chunk for `bits` bits per value.
fn levels(bits: u8) -> usize {
    1 << (bits - 1)
}

/// Bytes of the levels of all chunks of `n` values.
fn levels_len(n: usize, chunk: u32, bits: u8) -> usize {
    2 * levels(bits) * n.div_ceil(chunk as usize)
}

/// The most payload bytes a tensor of `n` values may take: levels, values, and index codes
/// whose unary parts sum to at most `len >> r` per chunk.
pub(super) fn payload_bound(n: usize, k: u32, chunk: u32, bits: u8) -> usize {
    let index_bits: usize = chunk_lengths(n, chunk as usize)
        .iter()
        .map(|&(count, len)| {
            let kept = len.min(k as usize);
            let r = rice_parameter(len, kept) as usize;
            count * ((len >> r) + kept * (1 + r))
        })
        .sum();
    levels_len(n, chunk, bits)
        + (kept_count(n, k, chunk) * bits as usize).div_ceil(8)
        + index_bits.div_ceil(8)
}

/// Little-endian bit packing.
struct BitWriter<'a> {
    out: &'a mut Vec<u8>,
    acc: u64,
    filled: u32,
}

impl<'a> BitWriter<'a> {
    fn new(out: &'a mut Vec<u8>) -> Self {
        BitWriter {
            out,
            acc: 0,
            filled: 0,
        }
    }

    /// Appends the low `n` bits of `v` (`n` <= 32).
    fn put(&mut self, v: u32, n: u32) {
        self.acc |= u64::from(v) << self.filled;
        self.filled += n;
        while self.filled >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.filled -= 8;
        }
    }

    /// `q` ones and a zero.
    fn unary(&mut self, mut q: usize) {
        while q >= 32 {
            self.put(u32::MAX, 32);
            q -= 32;
        }
        self.put((1u32 << q) - 1, q as u32 + 1);
    }

    fn finish(mut self) {
        if self.filled > 0 {
            self.out.push(self.acc as u8);
        }
        self.filled = 0;
    }
}

struct BitReader<'a> {
    bytes: &'a [u8],
    pos: usize,
    acc: u64,
    filled: u32,
}

impl<'a> BitReader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        BitReader {
            bytes,
            pos: 0,
            acc: 0,
            filled: 0,
        }
    }

    fn refill(&mut self) {
        while self.filled <= 56 {
            let Some(&b) = self.bytes.get(self.pos) else {
                return;
            };
            self.acc |= u64::from(b) << self.filled;
            self.pos += 1;
            self.filled += 8;
        }
    }

    /// The next `n` bits (`n` <= 32).
    fn get(&mut self, n: u32) -> Result<u32, CodecError> {
        if self.filled < n {
            self.refill();
            if self.filled < n {
                return Err(CodecError::BadIndices("bit stream ends early"));
            }
        }
        let v = (self.acc & ((1u64 << n) - 1)) as u32;
        self.acc >>= n;
        self.filled -= n;
        Ok(v)
    }

    /// A unary count, at most `max` (more means the stream is not one of ours).
    fn unary(&mut self, max: usize) -> Result<usize, CodecError> {
        let mut q = 0;
        loop {
            if self.filled == 0 {
                self.refill();
                if self.filled == 0 {
                    return Err(CodecError::BadIndices("bit stream ends in a gap"));
                }
            }
            let ones = (!self.acc).trailing_zeros().min(self.filled);
            q += ones as usize;
            if q > max {
                return Err(CodecError::BadIndices("gap beyond its chunk"));
            }
            if ones < self.filled {
                // `ones + 1` may be 64: a shift that wide is not defined on u64.
                self.acc = self.acc.checked_shr(ones + 1).unwrap_or(0);
                self.filled -= ones + 1;
                return Ok(q);
            }
            self.acc = 0;
            self.filled = 0;
        }
    }

    /// Whether everything was read, but for the zero padding of the last byte.
    fn exhausted(&self) -> bool {
        self.pos == self.bytes.len() && self.filled < 8 && self.acc == 0
    }
}

/// A magnitude in bf16, the precision levels travel in (the largest f32s clamped, not made
/// infinite).
fn level_bf16(v: f32) -> bf16 {
    bf16::from_f32(v.min(bf16::MAX.to_f32()))
}

/// Reusable state of the encoder.
#[derive(Default)]
pub(super) struct ChunkScratch {
    magnitudes: Vec<f32>,
    ranked: Vec<u32>,
    /// Kept positions (absolute, ascending) and their decoded values, for error feedback.
    pub(super) indices: Vec<u32>,
    pub(super) decoded: Vec<f32>,
    codes: Vec<u32>,
    index_bytes: Vec<u8>,
}

/// Encodes `x` (finite) into `out`'s tail.
pub(super) fn encode(
    scratch: &mut ChunkScratch,
    x: &[f32],
    k: u32,
    chunk: u32,
    bits: u8,
    out: &mut Vec<u8>,
) {
    let ChunkScratch {
        magnitudes,
        ranked,
        indices,
        decoded,
        codes,
        index_bytes,
    } = scratch;
    indices.clear();
    decoded.clear();
    codes.clear();
    index_bytes.clear();
    let mut index_writer = BitWriter::new(index_bytes);
    for (start, len, kept) in chunks(x.len(), chunk as usize, k as usize) {
        let values = &x[start..start + len];
        let first = indices.len();
        select_top(values, kept, magnitudes, indices);
        for i in &mut indices[first..] {
            *i += start as u32;
        }
        let chosen = &indices[first..];
        // Rank the kept values by magnitude (ties by position); rank r is in group
        // r * L / kept, decoded as its group's mean.
        let l = levels(bits);
        ranked.clear();
        ranked.extend(0..kept as u32);
        ranked.sort_unstable_by(|&a, &b| {
            let (ma, mb) = (
                x[chosen[a as usize] as usize].abs(),
                x[chosen[b as usize] as usize].abs(),
            );
            ma.total_cmp(&mb).then(a.cmp(&b))
        });
        let mut sums = [0f64; 1 << (MAX_BITS - 1)];
        let mut counts = [0usize; 1 << (MAX_BITS - 1)];
        codes.resize(first + kept, 0);
        for (rank, &j) in ranked.iter().enumerate() {
            let group = rank * l / kept;
            sums[group] += f64::from(x[chosen[j as usize] as usize].abs());
            counts[group] += 1;
            codes[first + j as usize] = group as u32;
        }
        let mut level = [0f32; 1 << (MAX_BITS - 1)];
        for g in 0..l {
            let mean = if counts[g] > 0 {
                sums[g] / counts[g] as f64
            } else {
                0.0
            };
            let b = level_bf16(mean as f32);
            out.extend_from_slice(&b.to_bits().to_le_bytes());
            level[g] = b.to_f32();
        }
        let r = rice_parameter(len, kept);
        let mut prev: i64 = -1;
        for (j, &i) in chosen.iter().enumerate() {
            let v = x[i as usize];
            let group = codes[first + j];
            let negative = v.is_sign_negative() && v != 0.0;
            codes[first + j] = group << 1 | u32::from(negative);
            let magnitude = level[group as usize];
            decoded.push(if negative { -magnitude } else { magnitude });
            let p = i as i64 - start as i64;
            let gap = (p - prev - 1) as usize;
            prev = p;
            index_writer.unary(gap >> r);
            if r > 0 {
                index_writer.put((gap & ((1 << r) - 1)) as u32, r);
            }
        }
    }
    index_writer.finish();
    let mut value_writer = BitWriter::new(out);
    for &c in codes.iter() {
        value_writer.put(c, u32::from(bits));
    }
    value_writer.finish();
    out.extend_from_slice(index_bytes);
}

/// Pushes the positions (ascending, relative to `x`) of the `k` largest magnitudes of `x`,
/// ties broken by position.
fn select_top(x: &[f32], k: usize, magnitudes: &mut Vec<f32>, out: &mut Vec<u32>) {
    if k >= x.len() {
        out.extend(0..x.len() as u32);
        return;
    }
    magnitudes.clear();
    magnitudes.extend(x.iter().map(|v| v.abs()));
    let (_, kth, _) = magnitudes.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    let kth = *kth;
    let above = x.iter().filter(|v| v.abs() > kth).count();
    let mut ties = k - above;
    for (i, v) in x.iter().enumerate() {
        let a = v.abs();
        if a > kth || (a == kth && ties > 0) {
            if a == kth {
                ties -= 1;
            }
            out.push(i as u32);
        }
    }
}

/// Decodes a payload into `out` (zeroed, of the tensor's length), checking every position.
pub(super) fn decode(
    payload: &[u8],
    k: u32,
    chunk: u32,
    bits: u8,
    out: &mut [f32],
) -> Result<(), CodecError> {
    let n = out.len();
    let kept = kept_count(n, k, chunk);
    let scale_len = levels_len(n, chunk, bits);
    let value_len = (kept * bits as usize).div_ceil(8);
    if payload.len() < scale_len + value_len {
        return Err(CodecError::Truncated {
            what: "chunked top-k levels and values",
            needed: scale_len + value_len,
            available: payload.len(),
        });
    }
    let (scales, rest) = payload.split_at(scale_len);
    let (value_bytes, index_bytes) = rest.split_at(value_len);
    let mut values = BitReader::new(value_bytes);
    let mut positions = BitReader::new(index_bytes);
    for (c, (start, len, kept)) in chunks(n, chunk as usize, k as usize).enumerate() {
        let l = levels(bits);
        let s = &scales[2 * l * c..2 * l * (c + 1)];
        let mut level = [0f32; 1 << (MAX_BITS - 1)];
        for (g, b) in level.iter_mut().zip(s.chunks_exact(2)) {
            *g = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
        }
        let r = rice_parameter(len, kept);
        let mut prev: i64 = -1;
        for _ in 0..kept {
            let q = positions.unary(len)?;
            let low = if r > 0 { positions.get(r)? } else { 0 };
            let gap = (q << r) | low as usize;
            let p = prev + 1 + gap as i64;
            if p >= len as i64 {
                return Err(CodecError::BadIndices("position beyond its chunk"));
            }
            prev = p;
            let code = values.get(u32::from(bits))?;
            let magnitude = level[(code >> 1) as usize];
            out[start + p as usize] = if code & 1 == 1 { -magnitude } else { magnitude };
        }
    }
    if !values.exhausted() {
        return Err(CodecError::BadIndices(
            "value stream longer than its values",
        ));
    }
    if !positions.exhausted() {
        return Err(CodecError::BadIndices(
            "index stream longer than its positions",
        ));
    }
    Ok(())
}
