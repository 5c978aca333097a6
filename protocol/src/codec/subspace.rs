//! Subspace codes (`sub:F[:INNER]`): a tensor projected onto a fixed subspace of `1/F` of
//! its dimension, then quantized with `int8`, `int4` or `int2` blocks (the inner code, `int8` by
//! default).
//!
//! The projection is an orthonormal map `W^T` applied to every [`ROTATION`] consecutive values
//! alike (a block of channels of an activation: model widths are multiples of it, so the map
//! is the same for every token and every peer whatever the tensor's shape): the block's values
//! get fixed pseudo-random signs, its `F` slices of `r = ROTATION / F` values are added, and
//! the sum goes through a Walsh-Hadamard transform of size `r`, scaled by `1 / sqrt(ROTATION)`.
//! Those `r` outputs are the first `r` rows of the block's randomized Hadamard transform, so
//! `W^T W = I`, and decoding (`W y`: the same transform back, then each slice with its signs)
//! returns the orthogonal projection `W W^T x` of the block.
//!
//! Used on a pipeline boundary for both activations and their gradients, the projection is a
//! fixed linear layer of the model: the next stage computes on `P x` (`P = W W^T`), the
//! gradient it sends back is `P g` (the exact gradient through `P`, since `P` is symmetric),
//! and training learns to carry what the next stage needs in the subspace. With `F = 1` nothing
//! is dropped and the code is a rotation, which spreads outlier channels over the block before
//! quantization. The signs and transform use only additions, subtractions and one exact scale,
//! so every peer computes the same projection.

use super::*;

/// Values projected together: a divisor of every preset's width (64 to 1,600), enough mixing
/// to spread an outlier channel, and a transform of a few additions per value.
pub const ROTATION: usize = 64;
/// Largest reduction: one value of every block.
pub(super) const MAX_FOLD: u32 = ROTATION as u32;

/// The inner code of the projected values.
pub(super) fn inner(bits: u8, block: u32) -> Codec {
    match bits {
        8 => Codec::Int8 { block },
        _ => Codec::LowBit { bits, block },
    }
}

/// The wire encoding of the inner code.
pub(super) fn inner_encoding(bits: u8, block: u32) -> Encoding {
    match bits {
        8 => Encoding::Int8 { block },
        _ => Encoding::LowBit { bits, block },
    }
}

/// Checks the code's parameters.
pub(super) fn validate(fold: u32, bits: u8, block: u32) -> Result<(), CodecError> {
    if !fold.is_power_of_two() || fold > MAX_FOLD {
        return Err(CodecError::BadParameter(format!(
            "subspace reduction {fold} (a power of two up to {MAX_FOLD})"
        )));
    }
    if !matches!(bits, 8 | 4 | 3 | 2) {
        return Err(CodecError::BadParameter(format!(
            "subspace inner code of {bits} bits (int8, int4, int3 or int2)"
        )));
    }
    inner(bits, block).validate()
}

/// Checks that a tensor of `n` values is whole blocks.
pub(super) fn check_len(n: usize) -> Result<(), CodecError> {
    if !n.is_multiple_of(ROTATION) {
        return Err(CodecError::BadShape(format!(
            "a subspace code projects blocks of {ROTATION} values: {n} values are not whole blocks"
        )));
    }
    Ok(())
}

/// Values on the wire for a tensor of `n` values: `n / fold` (the shape was checked).
pub(super) fn projected_len(n: usize, fold: u32) -> usize {
    n / fold as usize
}

/// The header's aux byte: the inner code's bits and the fold's logarithm.
pub(super) fn pack_aux(fold: u32, bits: u8) -> u8 {
    bits | ((fold.trailing_zeros() as u8) << 4)
}

/// The fold and bits of an aux byte (checked by [`validate`] after).
pub(super) fn unpack_aux(aux: u8) -> (u32, u8) {
    (1 << (aux >> 4), aux & 0x0f)
}

/// The fixed sign (+1 or -1) of each value of a block: bits of a constant drawn once at
/// random (part of the code's definition: changing it changes the model a run trains).
const SIGNS: u64 = 0x9b3c_e5a1_46d2_7f08;

fn sign(j: usize) -> f32 {
    if (SIGNS >> j) & 1 == 0 { 1.0 } else { -1.0 }
}

/// In-place unnormalised Walsh-Hadamard transform of a power-of-two length.
fn hadamard(x: &mut [f32]) {
    let mut h = 1;
    while h < x.len() {
        for pair in x.chunks_exact_mut(2 * h) {
            let (a, b) = pair.split_at_mut(h);
            for (a, b) in a.iter_mut().zip(b) {
                let (u, v) = (*a, *b);
                *a = u + v;
                *b = u - v;
            }
        }
        h *= 2;
    }
}

/// Projects every block of `input` (whole blocks) into `out` (cleared), `ROTATION / fold`
/// values a block.
pub(super) fn project(input: &[f32], fold: u32, out: &mut Vec<f32>) {
    let r = ROTATION / fold as usize;
    let scale = 1.0 / (ROTATION as f32).sqrt();
    let signs: [f32; ROTATION] = std::array::from_fn(sign);
    out.clear();
    out.resize(projected_len(input.len(), fold), 0.0);
    for (x, z) in input.chunks_exact(ROTATION).zip(out.chunks_exact_mut(r)) {
        for (xs, ss) in x.chunks_exact(r).zip(signs.chunks_exact(r)) {
            for ((z, &x), &s) in z.iter_mut().zip(xs).zip(ss) {
                *z += s * x;
            }
        }
        hadamard(z);
        for z in z.iter_mut() {
            *z *= scale;
        }
    }
}

/// The inverse of [`project`] on its image: writes `W y` for every projected block of
/// `projected` (transformed in place) into `out` (its length fixed by the caller).
pub(super) fn lift(projected: &mut [f32], fold: u32, out: &mut [f32]) {
    let r = ROTATION / fold as usize;
    let scale = 1.0 / (ROTATION as f32).sqrt();
    let signs: [f32; ROTATION] = std::array::from_fn(sign);
    for (z, x) in projected
        .chunks_exact_mut(r)
        .zip(out.chunks_exact_mut(ROTATION))
    {
        hadamard(z);
        for z in z.iter_mut() {
            *z *= scale;
        }
        for (xs, ss) in x.chunks_exact_mut(r).zip(signs.chunks_exact(r)) {
            for ((x, &z), &s) in xs.iter_mut().zip(z.iter()).zip(ss) {
                *x = s * z;
            }
        }
    }
}

/// Appends the encoding of `input` (finite, whole blocks checked here) to `out`: projected
/// into `projected`, then the inner code.
pub(super) fn encode(
    input: &[f32],
    fold: u32,
    bits: u8,
    block: u32,
    projected: &mut Vec<f32>,
    out: &mut Vec<u8>,
) -> Result<(), CodecError> {
    check_len(input.len())?;
    project(input, fold, projected);
    // Finite inputs near f32's limit can sum past it.
    if !all_finite(projected) {
        return Err(CodecError::NonFinite);
    }
    match bits {
        8 => write_int8(projected, block as usize, out),
        _ => lowbit::write(projected, bits, block, out),
    }
    Ok(())
}

/// Decodes a payload the header has checked into `out` (its length the tensor's), through
/// `projected`.
pub(super) fn decode(
    payload: &[u8],
    fold: u32,
    bits: u8,
    block: u32,
    projected: &mut Vec<f32>,
    out: &mut [f32],
) {
    projected.clear();
    projected.resize(projected_len(out.len(), fold), 0.0);
    decode_dense(inner_encoding(bits, block), payload, projected);
    lift(projected, fold, out);
}
