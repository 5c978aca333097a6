//! `topk`: the `k` largest magnitudes of a tensor, their indices delta-coded as LEB128 varints
//! (zstd-compressed when that saves at least [`ZSTD_MIN_SAVING`]), their values in fp16 or
//! int8.

use super::*;

/// Largest top-k payload for `k` values: flags, two lengths, worst-case varints (zstd output is
/// only used when smaller), int8 scale and fp16 values (the larger format).
pub(super) fn topk_payload_bound(k: usize) -> usize {
    1 + 4 + 4 + MAX_VARINT_LEN * k + 4 + 2 * k
}

impl Encoder {
    /// Picks the indices of the `k` largest magnitudes of `x` into `self.indices`, ascending.
    ///
    /// Exact, in about two passes: a threshold estimated from a strided sample selects a
    /// candidate superset (retried with a lower threshold in the rare case it is too small),
    /// and an exact selection among the few candidates keeps the top `k`, ties broken by
    /// position.
    pub(super) fn select_topk(&mut self, x: &[f32], k: usize) {
        self.indices.clear();
        let n = x.len();
        if k == 0 {
            return;
        }
        if k >= n {
            self.indices.extend(0..n as u32);
            return;
        }
        const SAMPLE: usize = 1 << 14;
        let stride = (n / SAMPLE).max(1);
        self.magnitudes.clear();
        self.magnitudes
            .extend(x.iter().step_by(stride).map(|v| v.abs()));
        let m = self.magnitudes.len();
        // Aim for 1.5x the needed candidates (plus slack for small samples).
        let want = ((k as f64 * 1.5 + 64.0) / n as f64 * m as f64).ceil() as usize;
        let mut threshold = if want >= m {
            0.0
        } else {
            let rank = want.max(1) - 1;
            let (_, t, _) = self
                .magnitudes
                .select_nth_unstable_by(rank, |a, b| b.total_cmp(a));
            *t
        };
        loop {
            self.candidates.clear();
            collect_at_least(x, threshold, &mut self.candidates);
            if self.candidates.len() >= k || threshold == 0.0 {
                break;
            }
            threshold *= 0.5;
            if threshold < f32::MIN_POSITIVE {
                threshold = 0.0;
            }
        }
        if self.candidates.len() < k {
            // Only possible with NaNs, which never compare >= a threshold: take them in order.
            self.indices.extend(0..k as u32);
            return;
        }
        self.magnitudes.clear();
        self.magnitudes
            .extend(self.candidates.iter().map(|&i| x[i as usize].abs()));
        let (_, kth, _) = self
            .magnitudes
            .select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
        let kth = *kth;
        let above = self
            .candidates
            .iter()
            .filter(|&&i| x[i as usize].abs() > kth)
            .count();
        let mut ties = k - above;
        for &i in &self.candidates {
            let a = x[i as usize].abs();
            if a > kth {
                self.indices.push(i);
            } else if a == kth && ties > 0 {
                self.indices.push(i);
                ties -= 1;
            }
        }
    }

    pub(super) fn write_topk(
        &mut self,
        format: ValueFormat,
        out: &mut Vec<u8>,
    ) -> Result<(), CodecError> {
        self.varints.clear();
        let mut prev: i64 = -1;
        for &i in &self.indices {
            let delta = (i as i64 - prev - 1) as u32;
            prev = i as i64;
            write_varint(delta, &mut self.varints);
        }
        let raw_len = self.varints.len();
        let mut use_zstd = false;
        if raw_len >= 64 {
            let zstd = match &mut self.zstd {
                Some(z) => z,
                None => self.zstd.insert(
                    zstd::bulk::Compressor::new(ZSTD_LEVEL)
                        .map_err(|e| CodecError::Compression(e.to_string()))?,
                ),
            };
            self.compressed.clear();
            self.compressed
                .reserve(zstd::zstd_safe::compress_bound(raw_len));
            if let Ok(len) = zstd.compress_to_buffer(&self.varints, &mut self.compressed) {
                use_zstd = (len as f64) < raw_len as f64 * (1.0 - ZSTD_MIN_SAVING);
            }
        }
        let stream: &[u8] = if use_zstd {
            &self.compressed
        } else {
            &self.varints
        };
        out.push(use_zstd as u8);
        out.extend_from_slice(&(raw_len as u32).to_le_bytes());
        out.extend_from_slice(&(stream.len() as u32).to_le_bytes());
        out.extend_from_slice(stream);
        match format {
            ValueFormat::Fp16 => write_fp16(&self.values, out),
            ValueFormat::Int8 => write_int8(&self.values, self.values.len().max(1), out),
        }
        Ok(())
    }

    /// The indices and (decoded) values the last top-k encoding kept.
    pub(super) fn kept(&self) -> (&[u32], &[f32]) {
        (&self.indices, &self.values)
    }
}

multiversion! {
    /// Pushes the indices of values with `|x| >= threshold`.
    fn collect_at_least(x: &[f32], threshold: f32, out: &mut Vec<u32>) {
        const CHUNK: usize = 64;
        for (c, chunk) in x.chunks(CHUNK).enumerate() {
            // Most chunks have no candidate: test the whole chunk with a vectorised max first.
            let max = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
            if max < threshold {
                continue;
            }
            for (j, v) in chunk.iter().enumerate() {
                if v.abs() >= threshold {
                    out.push((c * CHUNK + j) as u32);
                }
            }
        }
    }
}

impl Decoder {
    pub(super) fn read_topk(
        &mut self,
        payload: &[u8],
        k: usize,
        format: ValueFormat,
        out: &mut [f32],
    ) -> Result<(), CodecError> {
        let take = |pos: &mut usize, len: usize, what: &'static str| -> Result<&[u8], CodecError> {
            let s = payload.get(*pos..*pos + len).ok_or(CodecError::Truncated {
                what,
                needed: len,
                available: payload.len().saturating_sub(*pos),
            })?;
            *pos += len;
            Ok(s)
        };
        let mut pos = 0;
        let flags = take(&mut pos, 1, "top-k flags")?[0];
        let raw_len = u32::from_le_bytes(
            take(&mut pos, 4, "index length")?
                .try_into()
                .unwrap_or_default(),
        ) as usize;
        let stored_len = u32::from_le_bytes(
            take(&mut pos, 4, "index length")?
                .try_into()
                .unwrap_or_default(),
        ) as usize;
        if raw_len > MAX_VARINT_LEN * k || raw_len < k {
            return Err(CodecError::BadIndices("index stream length does not fit k"));
        }
        let value_len = match format {
            ValueFormat::Fp16 => 2 * k,
            // One scale for all values (none when there are no values).
            ValueFormat::Int8 => 4 * k.min(1) + k,
        };
        // The whole layout is checked before anything is allocated: k is then backed by bytes
        // present (its values), and so is the index stream's decompressed length (at most
        // MAX_VARINT_LEN per value), whatever the header claims.
        let expect = pos + stored_len + value_len;
        if payload.len() != expect {
            return Err(CodecError::Truncated {
                what: "top-k payload",
                needed: expect,
                available: payload.len(),
            });
        }
        let stream = take(&mut pos, stored_len, "index stream")?;
        let varints: &[u8] = match flags {
            0 if stored_len == raw_len => stream,
            0 => {
                return Err(CodecError::BadIndices(
                    "raw index stream of the wrong length",
                ));
            }
            1 => {
                let z = match &mut self.zstd {
                    Some(z) => z,
                    None => self.zstd.insert(
                        zstd::bulk::Decompressor::new()
                            .map_err(|e| CodecError::Compression(e.to_string()))?,
                    ),
                };
                self.varints.clear();
                self.varints.reserve(raw_len);
                let got = z
                    .decompress_to_buffer(stream, &mut self.varints)
                    .map_err(|e| CodecError::Compression(e.to_string()))?;
                if got != raw_len {
                    return Err(CodecError::BadIndices("decompressed index stream length"));
                }
                &self.varints
            }
            _ => return Err(CodecError::BadParameter(format!("top-k flags {flags}"))),
        };
        let value_bytes = take(&mut pos, value_len, "top-k values")?;
        if pos != payload.len() {
            return Err(CodecError::TrailingBytes(payload.len() - pos));
        }
        self.values.clear();
        self.values.resize(k, 0.0);
        match format {
            ValueFormat::Fp16 => read_fp16(value_bytes, &mut self.values),
            ValueFormat::Int8 => read_int8(value_bytes, k.max(1), &mut self.values),
        }
        let n = out.len() as u64;
        let mut prev: i64 = -1;
        let mut p = 0;
        for &v in &self.values {
            let delta = read_varint(varints, &mut p)?;
            let index = prev + 1 + delta as i64;
            if index as u64 >= n {
                return Err(CodecError::BadIndices("index beyond the tensor"));
            }
            out[index as usize] = v;
            prev = index;
        }
        if p != varints.len() {
            return Err(CodecError::BadIndices("more indices than values"));
        }
        Ok(())
    }
}
