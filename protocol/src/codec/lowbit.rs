//! Blockwise absmax at 4 and 2 bits (`int4[:BLOCK]`, `int2[:BLOCK]`): `int8`'s layout with
//! fewer levels, for activations and their gradients on slow links.
//!
//! Each block of `BLOCK` values stores one f32 scale `absmax / L` and each value as the nearest
//! of the `2L + 1` levels `-L..=L` times the scale, `L = 2^(B-1) - 1` (7 at 4 bits; at 2 bits
//! 1: ternary), in `B` bits (`level + L`), packed little-endian after all the scales. Every
//! value is within half a step (`scale / 2`) of its original. The one code above `2L` is never
//! written; a decoder reads it as level `L + 1` (finite, just beyond the block's absmax).

use super::*;

/// Bits per value accepted.
pub(super) fn validate(bits: u8, block: u32) -> Result<(), CodecError> {
    if bits != 2 && bits != 4 {
        return Err(CodecError::BadParameter(format!(
            "{bits} bits per value (2 or 4)"
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
    let l = top(bits);
    // The scales go first on the wire; the values are packed from them as written.
    let scales_at = out.len();
    for x in input.chunks(block as usize) {
        let absmax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        out.extend_from_slice(&(absmax / l as f32).to_le_bytes());
    }
    let per_byte = 8 / bits as usize;
    let mut byte = 0u8;
    let mut filled = 0;
    for (b, x) in input.chunks(block as usize).enumerate() {
        let at = scales_at + 4 * b;
        let scale = f32::from_le_bytes([out[at], out[at + 1], out[at + 2], out[at + 3]]);
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        for &v in x {
            let q = ((v * inv).round() as i32).clamp(-l, l) + l;
            byte |= (q as u8) << (filled * bits as usize);
            filled += 1;
            if filled == per_byte {
                out.push(byte);
                byte = 0;
                filled = 0;
            }
        }
    }
    if filled > 0 {
        out.push(byte);
    }
}

/// Decodes a payload whose length the header has checked ([`payload_len`]).
pub(super) fn read(payload: &[u8], bits: u8, block: u32, out: &mut [f32]) {
    let l = top(bits);
    let blocks = out.len().div_ceil(block as usize);
    let (scales, values) = payload.split_at(4 * blocks);
    let per_byte = 8 / bits as usize;
    let mask = (1u8 << bits) - 1;
    for (b, (o, s)) in out
        .chunks_mut(block as usize)
        .zip(scales.chunks_exact(4))
        .enumerate()
    {
        let scale = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        let first = b * block as usize;
        for (i, o) in o.iter_mut().enumerate() {
            let at = first + i;
            let code = (values[at / per_byte] >> ((at % per_byte) * bits as usize)) & mask;
            *o = (i32::from(code) - l) as f32 * scale;
        }
    }
}
