//! Value formats: how f32 values become bytes and back (fp32, fp16, bf16, blockwise int8),
//! and the LEB128 varints of sparse indices.

use super::*;

pub(super) fn write_varint(mut v: u32, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

pub(super) fn read_varint(bytes: &[u8], pos: &mut usize) -> Result<u32, CodecError> {
    let mut v: u64 = 0;
    for shift in 0..MAX_VARINT_LEN {
        let Some(&b) = bytes.get(*pos) else {
            return Err(CodecError::BadIndices("index stream ends inside a varint"));
        };
        *pos += 1;
        v |= ((b & 0x7f) as u64) << (7 * shift);
        if b & 0x80 == 0 {
            return u32::try_from(v).map_err(|_| CodecError::BadIndices("varint above u32"));
        }
    }
    Err(CodecError::BadIndices("varint longer than 5 bytes"))
}

/// The little-endian bytes of `values` (on little-endian targets, their memory).
#[cfg(target_endian = "little")]
pub(super) fn f32_bytes(values: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and u8 no alignment requirement; the length is in bytes.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), size_of_val(values)) }
}

pub(super) fn write_fp32(input: &[f32], out: &mut Vec<u8>) {
    #[cfg(target_endian = "little")]
    out.extend_from_slice(f32_bytes(input));
    #[cfg(not(target_endian = "little"))]
    out.extend(input.iter().flat_map(|v| v.to_le_bytes()));
}

pub(super) fn le_to_f32(bytes: &[u8], out: &mut [f32]) {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: every bit pattern is a valid f32; `out` is borrowed mutably for the copy and
        // the byte length matches (checked by the caller through the header).
        let dst = unsafe {
            std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), size_of_val(out))
        };
        dst.copy_from_slice(bytes);
    }
    #[cfg(not(target_endian = "little"))]
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// Values converted per step through a stack buffer by the half-precision paths.
pub(super) const HALF_CHUNK: usize = 1024;

pub(super) fn write_fp16(input: &[f32], out: &mut Vec<u8>) {
    let start = out.len();
    out.resize(start + 2 * input.len(), 0);
    let mut buf = [half::f16::ZERO; HALF_CHUNK];
    for (src, dst) in input
        .chunks(HALF_CHUNK)
        .zip(out[start..].chunks_mut(2 * HALF_CHUNK))
    {
        let buf = &mut buf[..src.len()];
        buf.convert_from_f32_slice(src);
        u16_to_le(buf.reinterpret_cast(), dst);
    }
}

multiversion! {
    fn u16_to_le(input: &[u16], out: &mut [u8]) {
        for (o, v) in out.chunks_exact_mut(2).zip(input) {
            o.copy_from_slice(&v.to_le_bytes());
        }
    }
}

multiversion! {
    fn f32_to_bf16(input: &[f32], out: &mut [u8]) {
        for (o, &x) in out.chunks_exact_mut(2).zip(input) {
            let bits = x.to_bits();
            // Round to nearest even on the 16 dropped bits; NaNs stay (quiet) NaNs.
            let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
            let v = if x.is_nan() { ((bits >> 16) as u16) | 0x0040 } else { rounded };
            o.copy_from_slice(&v.to_le_bytes());
        }
    }
}

multiversion! {
    fn bf16_to_f32(bytes: &[u8], out: &mut [f32]) {
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
            *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
        }
    }
}

pub(super) fn write_bf16(input: &[f32], out: &mut Vec<u8>) {
    let start = out.len();
    out.resize(start + 2 * input.len(), 0);
    f32_to_bf16(input, &mut out[start..]);
}

pub(super) fn read_fp16(bytes: &[u8], out: &mut [f32]) {
    let mut buf = [0u16; HALF_CHUNK];
    for (src, dst) in bytes.chunks(2 * HALF_CHUNK).zip(out.chunks_mut(HALF_CHUNK)) {
        let buf = &mut buf[..dst.len()];
        for (b, s) in buf.iter_mut().zip(src.chunks_exact(2)) {
            *b = u16::from_le_bytes([s[0], s[1]]);
        }
        let halves: &[half::f16] = buf.reinterpret_cast();
        halves.convert_to_f32_slice(dst);
    }
}

/// Quantises one block: writes one signed byte per value and returns the block's scale.
#[inline(always)]
pub(super) fn quantize_block(x: &[f32], q: &mut [MaybeUninit<u8>]) -> f32 {
    // Adding 1.5 * 2^23 rounds to the nearest integer (ties to even) and leaves it in the low
    // mantissa bits, so the rounding and the conversion are plain integer arithmetic that
    // vectorises everywhere; |x * inv| <= 127 keeps it exact.
    const ROUND: f32 = 12_582_912.0;
    const ROUND_BITS: i32 = 0x4b40_0000;
    // Lane-wise maxima in independent accumulators, so the reduction vectorises.
    let max = |m: f32, v: &f32| {
        let a = v.abs();
        if a > m { a } else { m }
    };
    let mut lanes = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder().iter().fold(0f32, max);
    for c in chunks {
        for i in 0..8 {
            lanes[i] = max(lanes[i], &c[i]);
        }
    }
    let absmax = lanes.iter().fold(tail, max);
    let inv = if absmax > 0.0 { 127.0 / absmax } else { 0.0 };
    for (o, &v) in q.iter_mut().zip(x) {
        let r = (v * inv + ROUND).to_bits() as i32 - ROUND_BITS;
        o.write(r.clamp(-127, 127) as i8 as u8);
    }
    absmax / 127.0
}

/// Quantises `input` in blocks of `B` (a constant, so the block loops unroll completely), the
/// last partial block included.
#[inline(always)]
pub(super) fn quantize_fixed<const B: usize>(
    input: &[f32],
    scales: &mut [MaybeUninit<u8>],
    values: &mut [MaybeUninit<u8>],
) {
    let full = input.len() / B;
    let (xs, x_tail) = input.split_at(full * B);
    let (qs, q_tail) = values.split_at_mut(full * B);
    for ((x, q), s) in xs
        .chunks_exact(B)
        .zip(qs.chunks_exact_mut(B))
        .zip(scales.chunks_exact_mut(4))
    {
        let x: &[f32; B] = x.try_into().unwrap_or_else(|_| unreachable!());
        let scale = quantize_block(x, q);
        for (o, b) in s.iter_mut().zip(scale.to_le_bytes()) {
            o.write(b);
        }
    }
    if !x_tail.is_empty() {
        let scale = quantize_block(x_tail, q_tail);
        for (o, b) in scales[4 * full..4 * full + 4]
            .iter_mut()
            .zip(scale.to_le_bytes())
        {
            o.write(b);
        }
    }
}

multiversion! {
    /// Quantises `input` block by block: one f32 scale per block into `scales` (4 bytes each),
    /// one signed byte per value into `values`. Common block sizes get unrolled loops.
    fn quantize_blocks(
        input: &[f32],
        block: usize,
        scales: &mut [MaybeUninit<u8>],
        values: &mut [MaybeUninit<u8>],
    ) {
        match block {
            32 => quantize_fixed::<32>(input, scales, values),
            64 => quantize_fixed::<64>(input, scales, values),
            128 => quantize_fixed::<128>(input, scales, values),
            256 => quantize_fixed::<256>(input, scales, values),
            _ => {
                for ((x, q), s) in input.chunks(block).zip(values.chunks_mut(block)).zip(scales.chunks_exact_mut(4)) {
                    let scale = quantize_block(x, q);
                    for (o, b) in s.iter_mut().zip(scale.to_le_bytes()) {
                        o.write(b);
                    }
                }
            }
        }
    }
}

multiversion! {
    fn dequantize_blocks(scales: &[u8], values: &[u8], block: usize, out: &mut [f32]) {
        for ((o, q), s) in out.chunks_mut(block).zip(values.chunks(block)).zip(scales.chunks_exact(4)) {
            let scale = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            for (o, &b) in o.iter_mut().zip(q) {
                *o = (b as i8) as f32 * scale;
            }
        }
    }
}

pub(super) fn write_int8(input: &[f32], block: usize, out: &mut Vec<u8>) {
    let blocks = input.len().div_ceil(block);
    let len = 4 * blocks + input.len();
    out.reserve(len);
    // Written in place without zero-filling first: this codec runs at memory speed, where an
    // extra pass over the output shows.
    let (scales, values) = out.spare_capacity_mut()[..len].split_at_mut(4 * blocks);
    quantize_blocks(input, block, scales, values);
    // SAFETY: `quantize_blocks` wrote every scale (one per block) and every value byte.
    unsafe { out.set_len(out.len() + len) };
}

pub(super) fn read_int8(payload: &[u8], block: usize, out: &mut [f32]) {
    let blocks = out.len().div_ceil(block);
    let (scales, values) = payload.split_at(4 * blocks);
    dequantize_blocks(scales, values, block, out);
}

/// Decodes a dense payload whose length the header has already checked.
pub(super) fn decode_dense(encoding: Encoding, payload: &[u8], out: &mut [f32]) {
    match encoding {
        Encoding::Fp32 => le_to_f32(payload, out),
        Encoding::Fp16 => read_fp16(payload, out),
        Encoding::Bf16 => bf16_to_f32(payload, out),
        Encoding::Int8 { block } => read_int8(payload, block as usize, out),
        Encoding::LowBit { bits, block } => lowbit::read(payload, bits, block, out),
        Encoding::TopK { .. } | Encoding::ChunkTopK { .. } | Encoding::Subspace { .. } => {
            unreachable!("sparse and projected encodings are decoded by their modules")
        }
    }
}
