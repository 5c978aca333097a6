//! Error feedback: what a lossy codec dropped is sent later instead of never.

use super::*;

/// Error feedback for a lossy codec: what compression dropped in round `t` is added to the
/// input of round `t + 1`, so the decoded stream's running sum tracks the input's running sum
/// with a bounded residual instead of losing the small components forever.
#[derive(Clone, Debug)]
pub struct ErrorFeedback {
    residual: Vec<f32>,
    decay: f32,
    decoded: Vec<f32>,
    bytes: Vec<u8>,
}

impl Default for ErrorFeedback {
    fn default() -> Self {
        Self::with_decay(1.0)
    }
}

impl ErrorFeedback {
    /// Empty feedback state (the residual starts at zero).
    pub fn new() -> Self {
        Self::default()
    }

    /// Feedback whose residual is multiplied by `decay` before each round's input is added
    /// (SparseLoCo's accumulator: with DiLoCo, where every round restarts from the parameters
    /// the replicas agreed on and so partly recomputes what was withheld, a decay below 1
    /// keeps the withheld part from being counted twice over). 1 is plain error feedback.
    pub fn with_decay(decay: f32) -> Self {
        ErrorFeedback {
            residual: Vec::new(),
            decay,
            decoded: Vec::new(),
            bytes: Vec::new(),
        }
    }

    /// The residual's decay per round.
    pub fn decay(&self) -> f32 {
        self.decay
    }

    /// What has been withheld so far.
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// The residual of a vector of `len` values, to restore what a round that never
    /// delivered its encoding withheld (zero where new; a different length starts afresh).
    pub fn residual_mut(&mut self, len: usize) -> &mut [f32] {
        sized(&mut self.residual, len)
    }

    /// `input` plus what is withheld at its place in a vector of `len` values, for a part
    /// that travels uncompressed (a round's owner keeps its own share): everything there is
    /// sent, so the residual there becomes zero.
    pub fn flush_part(&mut self, input: &[f32], offset: usize, len: usize) -> Vec<f32> {
        let residual = self.residual_mut(len);
        let Some(r) = residual.get_mut(offset..offset + input.len()) else {
            return input.to_vec();
        };
        let out = input.iter().zip(r.iter()).map(|(v, e)| v + e).collect();
        r.fill(0.0);
        out
    }

    /// Encodes `input + residual` and keeps the new residual. Works with any codec; for
    /// the sparse ones only the kept values are subtracted, so the cost stays a few passes.
    pub fn encode(
        &mut self,
        encoder: &mut Encoder,
        codec: Codec,
        input: &[f32],
        dims: &[usize],
        out: &mut Vec<u8>,
    ) -> Result<TensorHeader, CodecError> {
        self.encode_part(encoder, codec, input, 0, input.len(), dims, out)
    }

    /// [`ErrorFeedback::encode`] for the part of a vector of `len` values that starts at
    /// `offset`: the residual covers the whole vector, so a vector sent in parts that change
    /// from round to round (a swarm round's group decides them) withholds each value in one
    /// place, and what a part withheld is sent with whichever part holds it next time.
    #[allow(clippy::too_many_arguments)]
    pub fn encode_part(
        &mut self,
        encoder: &mut Encoder,
        codec: Codec,
        input: &[f32],
        offset: usize,
        len: usize,
        dims: &[usize],
        out: &mut Vec<u8>,
    ) -> Result<TensorHeader, CodecError> {
        // What a fixed subspace drops is dropped in every round: feedback would only grow.
        codec.validate_for_averaging()?;
        let end = offset
            .checked_add(input.len())
            .filter(|&end| end <= len)
            .ok_or_else(|| {
                CodecError::BadShape(format!(
                    "part of {} values at {offset} of a vector of {len}",
                    input.len()
                ))
            })?;
        let residual = &mut sized(&mut self.residual, len)[offset..end];
        if self.decay != 1.0 {
            scale(residual, self.decay);
        }
        add_assign(residual, input);
        let header = match encoder.encode(codec, residual, dims, out) {
            Ok(h) => h,
            Err(e) => {
                // Nothing was sent: the part stays withheld as it was.
                sub_assign(residual, input);
                return Err(e);
            }
        };
        match codec {
            Codec::TopK { values, .. } => {
                // Subtract exactly what the receiver will decode for the kept values.
                let (idx, vals) = encoder.kept();
                self.decoded.clear();
                self.decoded.resize(vals.len(), 0.0);
                let bytes = &mut self.bytes;
                bytes.clear();
                match values {
                    ValueFormat::Fp16 => {
                        write_fp16(vals, bytes);
                        read_fp16(bytes, &mut self.decoded);
                    }
                    ValueFormat::Int8 => {
                        write_int8(vals, vals.len().max(1), bytes);
                        read_int8(bytes, vals.len().max(1), &mut self.decoded);
                    }
                }
                for (&i, &d) in idx.iter().zip(&self.decoded) {
                    residual[i as usize] -= d;
                }
            }
            Codec::ChunkTopK { .. } => {
                let c = &encoder.chunked;
                for (&i, &d) in c.indices.iter().zip(&c.decoded) {
                    residual[i as usize] -= d;
                }
            }
            _ => {
                self.decoded.clear();
                self.decoded.resize(input.len(), 0.0);
                decode_dense(
                    header.encoding,
                    &out[TENSOR_HEADER_LEN..],
                    &mut self.decoded,
                );
                sub_assign(residual, &self.decoded);
            }
        }
        Ok(header)
    }
}

multiversion! {
    fn add_assign(acc: &mut [f32], x: &[f32]) {
        for (a, &v) in acc.iter_mut().zip(x) {
            *a += v;
        }
    }
}

multiversion! {
    fn scale(x: &mut [f32], by: f32) {
        for v in x {
            *v *= by;
        }
    }
}

multiversion! {
    fn sub_assign(acc: &mut [f32], x: &[f32]) {
        for (a, &v) in acc.iter_mut().zip(x) {
            *a -= v;
        }
    }
}

/// `residual` as the residual of a vector of `len` values: kept at that length, zeroed when
/// the length changes (a vector of another size is another vector).
fn sized(residual: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if residual.len() != len {
        residual.clear();
        residual.resize(len, 0.0);
    }
    residual
}
