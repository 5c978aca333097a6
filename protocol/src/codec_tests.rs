//! Property tests of the codecs: exact where lossless, within the documented error bound where
//! lossy, and error feedback that loses nothing over time.

use super::*;
use proptest::prelude::*;

fn roundtrip(codec: Codec, x: &[f32]) -> Vec<f32> {
    let bytes = encode_to_vec(codec, x, &[x.len()]).unwrap();
    let (header, y) = decode_to_vec(&bytes).unwrap();
    assert_eq!(header.shape.numel(), x.len());
    y
}

fn finite_vec(max_len: usize) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(
        prop_oneof![
            4 => -1e3f32..1e3,
            1 => -1e-3f32..1e-3,
            1 => Just(0.0f32),
            1 => -6e4f32..6e4,
        ],
        0..max_len,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn fp32_is_exact(x in prop::collection::vec(any::<f32>(), 0..300)) {
        let y = roundtrip(Codec::Fp32, &x);
        prop_assert_eq!(x.len(), y.len());
        for (a, b) in x.iter().zip(&y) {
            prop_assert_eq!(a.to_bits(), b.to_bits());
        }
    }

    #[test]
    fn fp16_and_bf16_round_to_nearest(x in finite_vec(300)) {
        let h = roundtrip(Codec::Fp16, &x);
        let b = roundtrip(Codec::Bf16, &x);
        for ((&v, &hv), &bv) in x.iter().zip(&h).zip(&b) {
            prop_assert_eq!(hv, half::f16::from_f32(v).to_f32());
            prop_assert_eq!(bv, half::bf16::from_f32(v).to_f32());
            // bf16 keeps 8 significant bits: relative error at most 2^-8.
            prop_assert!((bv - v).abs() <= v.abs() / 256.0);
        }
    }

    #[test]
    fn int8_is_within_half_a_step_of_its_block_scale(
        x in finite_vec(600),
        block in prop::sample::select(vec![8u32, 16, 64, 100, 256]),
    ) {
        let y = roundtrip(Codec::Int8 { block }, &x);
        for (chunk_x, chunk_y) in x.chunks(block as usize).zip(y.chunks(block as usize)) {
            let absmax = chunk_x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let step = absmax / 127.0;
            for (a, b) in chunk_x.iter().zip(chunk_y) {
                // Half a step, plus the f32 rounding of the scale and product (a few ulp).
                prop_assert!((a - b).abs() <= 0.5 * step * (1.0 + 1e-5) + absmax * 1e-6,
                    "{} vs {} (step {})", a, b, step);
            }
        }
    }

    #[test]
    fn int4_and_int2_are_within_half_a_step_of_their_block_scale(
        x in finite_vec(600),
        block in prop::sample::select(vec![8u32, 16, 64, 100, 256]),
        bits in prop::sample::select(vec![2u8, 3, 4]),
    ) {
        let y = roundtrip(Codec::LowBit { bits, block }, &x);
        let levels = ((1 << (bits - 1)) - 1) as f32;
        for (chunk_x, chunk_y) in x.chunks(block as usize).zip(y.chunks(block as usize)) {
            let absmax = chunk_x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let step = absmax / levels;
            for (a, b) in chunk_x.iter().zip(chunk_y) {
                prop_assert!((a - b).abs() <= 0.5 * step * (1.0 + 1e-5) + absmax * 1e-6,
                    "{} vs {} (step {}, {} bits)", a, b, step, bits);
            }
        }
        let payload = encode_to_vec(Codec::LowBit { bits, block }, &x, &[x.len()]).unwrap().len()
            - TENSOR_HEADER_LEN;
        prop_assert_eq!(payload, 4 * x.len().div_ceil(block as usize) + (x.len() * bits as usize).div_ceil(8));
    }

    #[test]
    fn subspace_codes_decode_to_the_projection_within_the_inner_codes_error(
        rows in 1usize..6,
        width in prop::sample::select(vec![64usize, 128, 256, 768]),
        fold in prop::sample::select(vec![1u32, 2, 4, 8, 64]),
        bits in prop::sample::select(vec![8u8, 4, 3, 2]),
        seed in any::<u64>(),
    ) {
        let mut rng = seed;
        let x: Vec<f32> = (0..rows * width).map(|_| gaussian(&mut rng) * 3.0).collect();
        let codec = Codec::Subspace { fold, bits, block: 16 };
        let dims = [rows, width];
        let bytes = encode_to_vec(codec, &x, &dims).unwrap();
        prop_assert_eq!(bytes.len() - TENSOR_HEADER_LEN,
            subspace_payload_len(rows * width / fold as usize, bits, 16));
        let (header, y) = decode_to_vec(&bytes).unwrap();
        prop_assert!(codec.encodes_as(&header.encoding));
        // The exact projection: the same code with a lossless inner step is `W W^T x`.
        let exact = project_exactly(&x, fold);
        let energy = |v: &[f32]| v.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>();
        // An inner block may span rows: its scale is bounded by the largest row's norm.
        let largest = x.chunks(width).map(energy).fold(0.0, f64::max).sqrt();
        for ((xr, pr), yr) in x.chunks(width).zip(exact.chunks(width)).zip(y.chunks(width)) {
            // An orthogonal projection keeps at most the row's energy (all of it, unfolded).
            prop_assert!(energy(pr) <= energy(xr) * (1.0 + 1e-4) + 1e-6);
            if fold == 1 {
                prop_assert!((energy(pr) - energy(xr)).abs() <= energy(xr) * 1e-4 + 1e-6);
            }
            // W is orthonormal: the decoded row is as far from the projection as the projected
            // values are from their quantization, at most half a step of the inner code each,
            // whose scale is at most the largest projected value (bounded by a row's norm).
            let levels = match bits { 8 => 127.0, 4 => 7.0, 3 => 3.0, _ => 1.0 };
            let half_step = largest / levels / 2.0;
            let bound = half_step * ((width / fold as usize) as f64).sqrt() * (1.0 + 1e-4) + 1e-4;
            let diff: Vec<f32> = pr.iter().zip(yr).map(|(a, b)| a - b).collect();
            prop_assert!(energy(&diff).sqrt() <= bound, "{} > {}", energy(&diff).sqrt(), bound);
        }
        // A projection: projecting its output again changes nothing.
        let again = project_exactly(&exact, fold);
        for (a, b) in exact.iter().zip(&again) {
            prop_assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()));
        }
    }

    #[test]
    fn subspace_projection_is_symmetric(
        width in prop::sample::select(vec![64usize, 256, 320]),
        fold in prop::sample::select(vec![1u32, 2, 4, 16]),
        seed in any::<u64>(),
    ) {
        // <P x, g> = <x, P g>: the gradient a next stage sends back through the code is the
        // exact gradient through the projection its activations went through.
        let mut rng = seed;
        let x: Vec<f32> = (0..width).map(|_| gaussian(&mut rng)).collect();
        let g: Vec<f32> = (0..width).map(|_| gaussian(&mut rng)).collect();
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(a, b)| f64::from(a * b)).sum::<f64>();
        let px = project_exactly(&x, fold);
        let pg = project_exactly(&g, fold);
        prop_assert!((dot(&px, &g) - dot(&x, &pg)).abs() <= 1e-4 * width as f64);
    }

    #[test]
    fn topk_keeps_exactly_the_largest(x in finite_vec(2000), pct in 1u32..50) {
        let codec = Codec::TopK { ppm: pct * 10_000, values: ValueFormat::Fp16 };
        let y = roundtrip(codec, &x);
        let k = Codec::topk_count(pct * 10_000, x.len());
        let mut mags: Vec<f32> = x.iter().map(|v| v.abs()).collect();
        mags.sort_by(|a, b| b.total_cmp(a));
        let kth = mags.get(k.saturating_sub(1)).copied().unwrap_or(0.0);
        let kept = y.iter().zip(&x).filter(|(yv, _)| **yv != 0.0).count();
        prop_assert!(kept <= k);
        for (&a, &b) in x.iter().zip(&y) {
            if b != 0.0 {
                prop_assert_eq!(b, half::f16::from_f32(a).to_f32());
                prop_assert!(a.abs() >= kth);
            } else if a.abs() > kth && half::f16::from_f32(a).to_f32() != 0.0 {
                prop_assert!(false, "dropped {} above the k-th magnitude {}", a, kth);
            }
        }
    }

    /// Every chunk keeps exactly its k largest magnitudes (ties at the k-th allowed), each
    /// decoded with its sign, at a level within the kept magnitudes' range (plus the bf16
    /// rounding of the levels) and in the same order as the magnitudes; everything else
    /// decodes to zero. One bit (sign only) decodes every kept value at their mean magnitude.
    #[test]
    fn chunked_topk_keeps_each_chunks_largest_at_ordered_levels(
        x in finite_vec(3000),
        chunk in prop::sample::select(vec![16u32, 64, 256, 1024]),
        k_frac in 1u32..=16,
        bits in 1u8..=4,
    ) {
        let k = (chunk * k_frac / 16).max(1);
        let codec = Codec::ChunkTopK { k, chunk, bits };
        let mut enc = Encoder::new();
        let mut bytes = Vec::new();
        enc.encode(codec, &x, &[x.len()], &mut bytes).unwrap();
        let (_, y) = decode_to_vec(&bytes).unwrap();
        let mut is_kept = vec![false; x.len()];
        for &i in &enc.chunked.indices {
            is_kept[i as usize] = true;
        }
        for (c, (xs, ys)) in x.chunks(chunk as usize).zip(y.chunks(chunk as usize)).enumerate() {
            let start = c * chunk as usize;
            let want = (k as usize).min(xs.len());
            let mine: Vec<usize> = (0..xs.len()).filter(|&i| is_kept[start + i]).collect();
            prop_assert_eq!(mine.len(), want);
            let mut mags: Vec<f32> = xs.iter().map(|v| v.abs()).collect();
            mags.sort_by(|a, b| b.total_cmp(a));
            let kth = mags[want - 1];
            let (lo, hi) = mine.iter().fold((f32::INFINITY, 0f32), |(l, h), &i| {
                (l.min(xs[i].abs()), h.max(xs[i].abs()))
            });
            let mean = mine.iter().map(|&i| f64::from(xs[i].abs())).sum::<f64>() / want as f64;
            for i in 0..xs.len() {
                let (a, b) = (xs[i], ys[i]);
                if !is_kept[start + i] {
                    prop_assert_eq!(b, 0.0);
                    prop_assert!(a.abs() <= kth, "dropped {} above the k-th {}", a, kth);
                    continue;
                }
                prop_assert!(a.abs() >= kth);
                if a != 0.0 && b != 0.0 {
                    prop_assert_eq!(a.is_sign_negative(), b.is_sign_negative());
                }
                let m = b.abs();
                prop_assert!(m >= lo * (1.0 - 1.0 / 128.0) && m <= hi * (1.0 + 1.0 / 128.0),
                    "{} decoded as {} outside [{}, {}]", a, b, lo, hi);
                if bits == 1 {
                    prop_assert!((f64::from(m) - mean).abs() <= mean / 128.0 + 1e-30);
                }
                for &j in &mine {
                    if xs[j].abs() < a.abs() {
                        prop_assert!(ys[j].abs() <= m, "levels out of order");
                    }
                }
            }
        }
    }

    #[test]
    fn error_feedback_tracks_the_running_sum(
        rounds in prop::collection::vec(prop::collection::vec(-1.0f32..1.0, 256), 1..40),
        which in 0usize..3,
    ) {
        let codec = match which {
            0 => Codec::TopK { ppm: 50_000, values: ValueFormat::Fp16 },
            1 => Codec::TopK { ppm: 50_000, values: ValueFormat::Int8 },
            _ => Codec::ChunkTopK { k: 4, chunk: 64, bits: 2 },
        };
        let mut fb = ErrorFeedback::new();
        let mut enc = Encoder::new();
        let mut dec = Decoder::new();
        let (mut sent, mut got) = (vec![0f64; 256], vec![0f64; 256]);
        let mut bytes = Vec::new();
        let mut y = Vec::new();
        for x in &rounds {
            fb.encode(&mut enc, codec, x, &[256], &mut bytes).unwrap();
            dec.decode(&bytes, &mut y).unwrap();
            for i in 0..256 {
                sent[i] += x[i] as f64;
                got[i] += y[i] as f64;
            }
        }
        // Invariant: what was sent plus what is withheld is what went in (up to rounding).
        for i in 0..256 {
            let withheld = fb.residual()[i] as f64;
            prop_assert!((sent[i] - got[i] - withheld).abs() < 1e-3, "element {}", i);
        }
    }
}

/// Positions travel as Rice codes: a chunk's positions decode to exactly the kept ones at
/// every density (gaps of zero, gaps as long as the chunk, the last chunk shorter), and the
/// payload is the size the layout says.
#[test]
fn chunked_topk_positions_round_trip_at_every_density() {
    for (n, chunk) in [(4096usize, 4096u32), (5000, 1024), (100, 16), (1, 16)] {
        for k in [1u32, 2, 7, chunk / 64, chunk / 8, chunk / 2, chunk] {
            let k = k.max(1);
            let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1013) as f32 - 506.5).collect();
            let codec = Codec::ChunkTopK { k, chunk, bits: 3 };
            let mut enc = Encoder::new();
            let mut bytes = Vec::new();
            enc.encode(codec, &x, &[n], &mut bytes).unwrap();
            let (_, y) = decode_to_vec(&bytes).unwrap();
            let sent: Vec<u32> = (0..n as u32).filter(|&i| y[i as usize] != 0.0).collect();
            assert_eq!(sent, enc.chunked.indices, "n {n} chunk {chunk} k {k}");
            let kept = chunked::kept_count(n, k, chunk);
            assert_eq!(kept, sent.len());
            let fixed = 8 * n.div_ceil(chunk as usize) + (kept * 3).div_ceil(8);
            let payload = bytes.len() - TENSOR_HEADER_LEN;
            assert!(payload > fixed && payload <= chunked::payload_bound(n, k, chunk, 3));
        }
    }
    // Long runs of ones in the unary codes: the largest half of a chunk is its second half.
    for k in [1u32, 100, 2048, 4095] {
        let x: Vec<f32> = (0..4096).map(|i| i as f32).collect();
        let (_, y) = decode_to_vec(
            &encode_to_vec(
                Codec::ChunkTopK {
                    k,
                    chunk: 4096,
                    bits: 2,
                },
                &x,
                &[4096],
            )
            .unwrap(),
        )
        .unwrap();
        let first = 4096 - k as usize;
        assert!(y[..first].iter().all(|&v| v == 0.0) && y[first..].iter().all(|&v| v > 0.0));
    }
    // Near the entropy of the positions: 64 of 4096 (log2 C(4096, 64) / 64 = 7.4 bits).
    let n = 1 << 16;
    let x: Vec<f32> = (0..n)
        .map(|i| ((i * 2_654_435_761usize) % 65_521) as f32)
        .collect();
    let bytes = encode_to_vec(
        Codec::ChunkTopK {
            k: 64,
            chunk: 4096,
            bits: 2,
        },
        &x,
        &[n],
    )
    .unwrap();
    let index_bits = 8.0 * (bytes.len() - TENSOR_HEADER_LEN - 4 * 16 - 16 * 64 * 2 / 8) as f64;
    // (levels: 2 of 2 bytes for each of the 16 chunks)
    let per_position = index_bits / (16.0 * 64.0);
    assert!(
        (7.4..8.4).contains(&per_position),
        "{per_position} bits a position"
    );
}

/// A chunked top-k message is accepted only exactly as the encoder writes it.
#[test]
fn chunked_topk_rejects_what_its_encoder_never_writes() {
    let x: Vec<f32> = (0..300).map(|i| (i as f32 * 0.37).sin()).collect();
    let good = encode_to_vec(
        Codec::ChunkTopK {
            k: 4,
            chunk: 64,
            bits: 2,
        },
        &x,
        &[300],
    )
    .unwrap();
    let payload = &good[TENSOR_HEADER_LEN..];
    let mut dec = Decoder::new();
    let mut y = Vec::new();
    assert!(dec.decode(&good, &mut y).is_ok());
    // One byte more or less, anywhere in the streams.
    let mut longer = payload.to_vec();
    longer.push(0);
    let mut header = good[..TENSOR_HEADER_LEN].to_vec();
    header[24..28].copy_from_slice(&(longer.len() as u32).to_le_bytes());
    assert!(dec.decode(&with_payload(&header, &longer), &mut y).is_err());
    header[24..28].copy_from_slice(&(payload.len() as u32 - 1).to_le_bytes());
    let shorter = &payload[..payload.len() - 1];
    assert!(dec.decode(&with_payload(&header, shorter), &mut y).is_err());
    // A gap that runs past its chunk: all ones in the index stream.
    let mut ones = payload.to_vec();
    let index_start = 4 * 5 + (4 * 5 * 2usize).div_ceil(8); // levels, then values
    ones[index_start..].iter_mut().for_each(|b| *b = 0xff);
    assert!(matches!(
        dec.decode(&with_payload(&good, &ones), &mut y),
        Err(CodecError::BadIndices(_))
    ));
    // Padding bits that are not zero.
    let mut padded = payload.to_vec();
    *padded.last_mut().unwrap() |= 0x80;
    assert!(dec.decode(&with_payload(&good, &padded), &mut y).is_err());
    // Parameters out of range or a parameter word with stray bits.
    for (param, aux) in [
        (4 | (3 << 16), 2),
        (4 | (6 << 16), 0),
        (4 | (6 << 16), 9),
        (65 | (6 << 16), 2),
        (4 | (6 << 16) | (1 << 30), 2),
    ] {
        let mut bad = good.clone();
        bad[4..8].copy_from_slice(&(param as u32).to_le_bytes());
        bad[2] = aux;
        assert!(
            matches!(dec.decode(&bad, &mut y), Err(CodecError::BadParameter(_))),
            "{param:#x} {aux}"
        );
    }
}

/// A decaying residual is `decay x residual + input - sent`, round after round.
#[test]
fn decaying_error_feedback_scales_what_it_withheld_before_adding_the_input() {
    let codec = Codec::ChunkTopK {
        k: 2,
        chunk: 16,
        bits: 3,
    };
    let (decay, n) = (0.9f32, 40);
    let mut fb = ErrorFeedback::with_decay(decay);
    let (mut enc, mut dec) = (Encoder::new(), Decoder::new());
    let (mut bytes, mut y) = (Vec::new(), Vec::new());
    let mut expected = vec![0f32; n];
    for round in 0..20 {
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 37 + round * 11) % 23) as f32 - 11.0)
            .collect();
        fb.encode(&mut enc, codec, &x, &[n], &mut bytes).unwrap();
        dec.decode(&bytes, &mut y).unwrap();
        for i in 0..n {
            expected[i] = decay * expected[i] + x[i] - y[i];
            assert!((fb.residual()[i] - expected[i]).abs() <= 1e-4 * (1.0 + expected[i].abs()));
        }
    }
}

#[test]
fn error_feedback_residual_stays_bounded_over_many_rounds() {
    // 1% top-k of a stream of random vectors: without feedback 99% of every round would be
    // lost; with it the residual stays bounded and the decoded sum follows the input sum.
    let n = 1000;
    let codec = Codec::TopK {
        ppm: 10_000,
        values: ValueFormat::Fp16,
    };
    let (mut fb, mut enc, mut dec) = (ErrorFeedback::new(), Encoder::new(), Decoder::new());
    let (mut bytes, mut y) = (Vec::new(), Vec::new());
    let mut state = 12345u64;
    let mut rand = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let (mut sent, mut got) = (vec![0f64; n], vec![0f64; n]);
    let mut max_residual = 0f32;
    for _ in 0..3000 {
        let x: Vec<f32> = (0..n).map(|_| rand()).collect();
        fb.encode(&mut enc, codec, &x, &[n], &mut bytes).unwrap();
        dec.decode(&bytes, &mut y).unwrap();
        for i in 0..n {
            sent[i] += x[i] as f64;
            got[i] += y[i] as f64;
        }
        max_residual = max_residual.max(fb.residual().iter().fold(0f32, |m, v| m.max(v.abs())));
    }
    let drift = sent
        .iter()
        .zip(&got)
        .map(|(a, b)| (a - b).abs())
        .fold(0f64, f64::max);
    // A random walk of 3000 steps of std 0.29 would wander ~16; the residual stays far lower.
    assert!(max_residual < 12.0, "residual grew to {max_residual}");
    assert!(drift <= max_residual as f64 + 1e-2, "drift {drift}");
}

#[test]
fn shapes_whose_product_overflows_before_a_zero_are_rejected() {
    // Found by cargo fuzz: huge dimensions followed by a zero used to pass validation (the
    // saturated product times zero is zero) and then overflow when counting elements.
    let mut msg = encode_to_vec(Codec::Fp16, &[], &[0]).unwrap();
    msg[3] = 4;
    for (i, d) in [65529u32, 2_424_987, 0x4100_0000, 0].iter().enumerate() {
        msg[8 + 4 * i..12 + 4 * i].copy_from_slice(&d.to_le_bytes());
    }
    assert!(matches!(decode_to_vec(&msg), Err(CodecError::BadShape(_))));
    assert!(Shape::new(&[1 << 20, 1 << 20, 0]).is_err());
    assert_eq!(Shape::new(&[0, 5]).unwrap().numel(), 0);
}

/// A standard normal draw (Box-Muller over splitmix64).
fn gaussian(state: &mut u64) -> f32 {
    let mut uniform = || {
        *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    let (u, v) = (uniform().max(1e-300), uniform());
    ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
}

/// `W W^T x`, with no quantization.
fn project_exactly(x: &[f32], fold: u32) -> Vec<f32> {
    let mut out = x.to_vec();
    Codec::Subspace {
        fold,
        bits: 8,
        block: 64,
    }
    .apply_projection(&mut out)
    .unwrap();
    out
}

fn subspace_payload_len(values: usize, bits: u8, block: usize) -> usize {
    4 * values.div_ceil(block) + (values * bits as usize).div_ceil(8)
}

#[test]
fn subspace_codes_check_shape_and_parameters() {
    let x = vec![1.0f32; 4 * 64];
    assert!(encode_to_vec("sub:64:int4".parse().unwrap(), &x, &[4, 64]).is_ok());
    // Whole blocks of 64 values only.
    assert!(matches!(
        encode_to_vec("sub:2:int4".parse().unwrap(), &x[..96], &[96]),
        Err(CodecError::BadShape(_))
    ));
    // A header whose length is not whole blocks, or whose parameter byte is not one the
    // encoder writes, is refused before its payload is read.
    let mut bytes = encode_to_vec("sub:8".parse().unwrap(), &x, &[4, 64]).unwrap();
    let good = bytes.clone();
    bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
    bytes[12..16].copy_from_slice(&100u32.to_le_bytes());
    assert!(matches!(
        decode_to_vec(&bytes),
        Err(CodecError::BadShape(_))
    ));
    for aux in [0x78u8, 0x34, 0x33, 0x48, 0xf8] {
        let mut bytes = good.clone();
        bytes[2] = aux;
        assert!(decode_to_vec(&bytes).is_err(), "aux {aux:#x}");
    }
    // Not an averaging codec: what it drops it drops every round.
    let mut feedback = ErrorFeedback::new();
    let codec: Codec = "sub:2".parse().unwrap();
    assert!(
        feedback
            .encode(&mut Encoder::new(), codec, &x, &[x.len()], &mut Vec::new())
            .is_err()
    );
    // Finite values near f32's limit that sum past it are refused, not sent as infinities.
    let big = vec![f32::MAX; 64];
    assert_eq!(
        encode_to_vec("sub:1".parse().unwrap(), &big, &[1, 64]),
        Err(CodecError::NonFinite)
    );
    assert!(
        (Codec::Subspace {
            fold: 4,
            bits: 4,
            block: 64
        }
        .nominal_bits_per_value()
            - 4.5 / 4.0)
            .abs()
            < 1e-9
    );
}

#[test]
fn codec_names_parse_and_print() {
    for s in [
        "fp32",
        "fp16",
        "bf16",
        "int8",
        "int8:128",
        "topk:1%",
        "topk:0.5%:int8",
        "ctopk:32/4096:2",
        "ctopk:1/16:4",
        "int4",
        "int2:256",
        "int3:32",
        "sub:4:int8",
        "sub:1:int4",
        "sub:16:int2:32",
    ] {
        let c: Codec = s.parse().unwrap();
        assert_eq!(c.to_string(), s);
    }
    assert_eq!("ctopk".parse::<Codec>(), Ok(DEFAULT_CHUNK_TOPK));
    for bad in [
        "",
        "int16",
        "int8:3",
        "topk",
        "topk:0%",
        "topk:1",
        "topk:1%:bf16",
        "fp16:2",
        "ctopk:0/4096:2",
        "ctopk:32/4000:2",
        "ctopk:32/4096:0",
        "ctopk:32/4096:5",
        "ctopk:32/4096",
        "ctopk:32:2",
        "int4:3",
        "int5",
        "int1",
        "sub",
        "sub:3",
        "sub:128",
        "sub:4:fp16",
        "sub:4:ctopk",
        "sub:4:int4:3",
        "sub:4:int4:64:1",
    ] {
        assert!(bad.parse::<Codec>().is_err(), "{bad:?} should not parse");
    }
}

#[test]
fn decoder_rejects_inconsistent_messages() {
    let x: Vec<f32> = (0..100).map(|i| i as f32).collect();
    let good = encode_to_vec(Codec::Int8 { block: 16 }, &x, &[10, 10]).unwrap();
    let mut y = Vec::new();
    let mut dec = Decoder::new();
    assert!(dec.decode(&good, &mut y).is_ok());
    // Flip a payload bit: checksum.
    let mut bad = good.clone();
    *bad.last_mut().unwrap() ^= 1;
    assert_eq!(dec.decode(&bad, &mut y), Err(CodecError::Checksum));
    // Truncate.
    assert!(matches!(
        dec.decode(&good[..good.len() - 1], &mut y),
        Err(CodecError::Truncated { .. })
    ));
    // Trailing bytes.
    let mut long = good.clone();
    long.push(0);
    assert_eq!(dec.decode(&long, &mut y), Err(CodecError::TrailingBytes(1)));
    // Shape that disagrees with the payload length.
    let mut reshaped = good.clone();
    reshaped[8] = 11;
    assert!(matches!(
        dec.decode(&reshaped, &mut y),
        Err(CodecError::PayloadLength { .. })
    ));
    // Unknown encoding id from a newer peer.
    let mut newer = good;
    newer[1] = 9;
    assert_eq!(
        dec.decode(&newer, &mut y),
        Err(CodecError::UnknownEncoding(9))
    );
}

/// Replaces a message's payload and its checksum, as a peer could.
fn with_payload(message: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut m = message[..TENSOR_HEADER_LEN].to_vec();
    m[28..36].copy_from_slice(&xxh3_64(payload).to_le_bytes());
    m.extend_from_slice(payload);
    m
}

/// Regression: int8 quietly encoded NaN as its block's largest value, and decoders passed NaN
/// and infinities on. No codec carries a value that is not finite, in either direction.
#[test]
fn values_that_are_not_finite_are_refused_both_ways() {
    let codecs = [
        Codec::Fp32,
        Codec::Fp16,
        Codec::Bf16,
        Codec::default(),
        "topk:10%".parse().unwrap(),
        "ctopk:8/64:2".parse().unwrap(),
        "int4".parse().unwrap(),
        "int2".parse().unwrap(),
    ];
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut x = vec![0.5f32; 64];
        x[17] = bad;
        for codec in codecs {
            let mut out = Vec::new();
            assert_eq!(
                Encoder::new().encode(codec, &x, &[64], &mut out),
                Err(CodecError::NonFinite),
                "{codec} encoding {bad}"
            );
        }
    }
    // A peer's fp32 message carrying NaN, with a valid checksum.
    let good = encode_to_vec(Codec::Fp32, &[1.0; 4], &[4]).unwrap();
    let mut payload = good[TENSOR_HEADER_LEN..].to_vec();
    payload[4..8].copy_from_slice(&f32::NAN.to_le_bytes());
    let mut y = Vec::new();
    assert_eq!(
        Decoder::new().decode(&with_payload(&good, &payload), &mut y),
        Err(CodecError::NonFinite)
    );
    assert!(y.is_empty(), "nothing decoded is left behind");
    // An int8 block whose scale is infinite.
    let good = encode_to_vec(Codec::default(), &[1.0; 64], &[64]).unwrap();
    let mut payload = good[TENSOR_HEADER_LEN..].to_vec();
    payload[..4].copy_from_slice(&f32::INFINITY.to_le_bytes());
    assert_eq!(
        Decoder::new().decode(&with_payload(&good, &payload), &mut y),
        Err(CodecError::NonFinite)
    );
}
