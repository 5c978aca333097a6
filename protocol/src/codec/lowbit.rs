//! Blockwise absmax at 4, 3 and 2 bits (`int4[:BLOCK]`, `int3[:BLOCK]`, `int2[:BLOCK]`):
//! `int8`'s layout with fewer levels, for activations and their gradients on slow links.
//!
//! Each block of `BLOCK` values stores one f32 scale `absmax / L` and each value as the nearest
//! of the `2L + 1` levels `-L..=L` times the scale, `L = 2^(B-1) - 1` (7 at 4 bits, 3 at 3
//! bits; at 2 bits 1: ternary), in `B` bits (`level + L`), packed little-endian after all the
//! scales (value `i` in bits `B i .. B (i + 1)` of the packed stream). Every value is within
//! half a step (`scale / 2`) of its original. The one code above `2L` is never written; a
//! decoder reads it as level `L + 1` (finite, just beyond the block's absmax).

use super::*;

/// Bits per value accepted.
pub(super) fn validate(bits: u8, block: u32) -> Result<(), CodecError> {
    if !matches!(bits, 2..=4) {
        return Err(CodecError::BadParameter(format!(
            "{bits} bits per value (2, 3 or 4)"
        )));
    }
    if !(MIN_INT8_BLOCK..=MAX_INT8_BLOCK).contains(&block) {
        return Err(CodecError::BadParameter(format!(
            "int{bits} block {block} outside {MIN_INT8_BLOCK}..={MAX_INT8_BLOCK}"
        )));
    }
    Ok(())
}

/// Largest level.
fn top(bits: u8) -> i32 {
    (1 << (bits - 1)) - 1
}

/// Payload bytes of `n` values.
pub(super) fn payload_len(n: usize, bits: u8, block: u32) -> usize {
    4 * n.div_ceil(block as usize) + (n * bits as usize).div_ceil(8)
}

/// Appends the encoding of `input` (finite) to `out`.
pub(super) fn write(input: &[f32], bits: u8, block: u32, out: &mut Vec<u8>) {
    match bits {
        2 => write_packed::<2>(input, block as usize, out),
        3 => write_packed::<3>(input, block as usize, out),
        _ => write_packed::<4>(input, block as usize, out),
    }
}

/// [`write`] at `BITS` bits (a constant, so that packing is shifts and the loops vectorise:
/// these codecs run on every activation of a slow hop).
fn write_packed<const BITS: usize>(input: &[f32], block: usize, out: &mut Vec<u8>) {
    let l = top(BITS as u8);
    // The scales go first on the wire; the values are packed after them.
    let scales: Vec<f32> = input
        .chunks(block)
        .map(|x| x.iter().fold(0f32, |m, v| m.max(v.abs())) / l as f32)
        .collect();
    for s in &scales {
        out.extend_from_slice(&s.to_le_bytes());
    }
    let mut codes = Vec::with_capacity(input.len());
    for (x, &scale) in input.chunks(block).zip(&scales) {
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        // To nearest, halves away from zero, by truncating after adding half of the value's
        // sign (`f32::round` is a library call per value here); the clamp bounds what the
        // rounding of `v * inv` may carry past the top level.
        codes.extend(x.iter().map(|&v| {
            let r = v * inv;
            (((r + 0.5f32.copysign(r)) as i32).clamp(-l, l) + l) as u8
        }));
    }
    // Eight codes fill exactly BITS bytes: pack them in a word, then take its low bytes.
    for c in codes.chunks(8) {
        let word = c
            .iter()
            .enumerate()
            .fold(0u32, |w, (k, &q)| w | (u32::from(q) << (k * BITS)));
        let bytes = (c.len() * BITS).div_ceil(8);
        out.extend_from_slice(&word.to_le_bytes()[..bytes]);
    }
}

/// Decodes a payload whose length the header has checked ([`payload_len`]).
pub(super) fn read(payload: &[u8], bits: u8, block: u32, out: &mut [f32]) {
    match bits {
        2 => read_packed::<2>(payload, block as usize, out),
        3 => read_packed::<3>(payload, block as usize, out),
        _ => read_packed::<4>(payload, block as usize, out),
    }
}

/// [`read`] at `BITS` bits.
fn read_packed<const BITS: usize>(payload: &[u8], block: usize, out: &mut [f32]) {
    let l = top(BITS as u8);
    let blocks = out.len().div_ceil(block);
    let (scales, values) = payload.split_at(4 * blocks);
    let mask = (1u32 << BITS) - 1;
    for (b, (o, s)) in out
        .chunks_mut(block)
        .zip(scales.chunks_exact(4))
        .enumerate()
    {
        let scale = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        let first = b * block;
        for (i, o) in o.iter_mut().enumerate() {
            // The code's bits start at bit BITS * at and span at most two bytes.
            let bit = (first + i) * BITS;
            let low = u32::from(values[bit / 8]);
            let high = values.get(bit / 8 + 1).map_or(0, |&b| u32::from(b));
            let code = ((low | (high << 8)) >> (bit % 8)) & mask;
            *o = (code as i32 - l) as f32 * scale;
        }
    }
}
