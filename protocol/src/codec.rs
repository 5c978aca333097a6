//! Tensor codecs: how activations, their gradients and averaged gradients are packed for the
//! wire.
//!
//! A tensor message is a fixed little-endian [`TensorHeader`] followed by the payload. The
//! header names the dtype, shape, encoding (with its parameters) and an xxh3 checksum of the
//! payload; [`Decoder::decode`] checks the checksum and that shape, encoding and payload length
//! agree before it writes a single value, and bounds every size by [`MAX_TENSOR_ELEMENTS`]
//! before allocating.
//!
//! Encodings:
//! * `fp32`: lossless.
//! * `fp16`, `bf16`: round to nearest even.
//! * `int8`: blockwise absmax. Each block of `block` values stores one f32 scale
//!   `absmax / 127` and one signed byte per value, so every value is within half a
//!   quantisation step (`scale / 2`) of its original.
//! * `int4`, `int3`, `int2`: the same at 4 bits (levels -7..=7), 3 bits (-3..=3) and 2 bits
//!   (ternary), see [`lowbit`].
//! * `topk`: the `k` largest-magnitude values (`k` a fraction of the tensor), indices
//!   delta-coded as LEB128 varints (and zstd-compressed when that saves at least 10%), values in
//!   fp16 or int8. Used with [`ErrorFeedback`], which carries what was not sent into the next
//!   round so that nothing is lost over time, only delayed.
//! * `ctopk`: chunked top-k, `K` values of every chunk of `C` in `B` bits each, positions
//!   Rice-coded (see [`chunked`]): the update codec, with error feedback.
//! * `sub:F[:INNER]`: every block of 64 values projected onto a fixed subspace of `1/F` of
//!   its dimension, then quantized with the inner code (see [`subspace`]): a boundary codec
//!   that narrows the model at the boundary.
//!
//! zstd is used only on the index stream: on float data it gains 1.1-1.5x at a large cost in
//! speed, while the delta-coded indices of a sparse tensor compress well.

use crate::simd::multiversion;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::mem::{MaybeUninit, size_of_val};
use std::str::FromStr;
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

mod chunked;
mod feedback;
mod header;
mod lowbit;
pub mod principal;
mod subspace;
mod topk;
mod values;

pub use feedback::ErrorFeedback;
pub use header::{Encoding, Shape, TensorHeader};
pub use subspace::ROTATION as SUBSPACE_BLOCK;
use topk::topk_payload_bound;
use values::*;

/// The most values one tensor message may hold (1 GiB of f32).
pub const MAX_TENSOR_ELEMENTS: usize = 1 << 28;
/// The most dimensions a tensor may have.
pub const MAX_DIMS: usize = 4;
/// Bytes of the fixed tensor header.
pub const TENSOR_HEADER_LEN: usize = 36;
/// Default int8 block, chosen with `shoal bench codec` (normal data with outliers): blocks of
/// 32/64/128/256 give rms errors of 0.0096/0.0128/0.0174/0.0238 at ratios of
/// 3.56/3.76/3.88/3.94, and every size encodes and decodes above half of memcpy speed. 64
/// keeps the error 26% below 128's for 3% more bytes.
pub const DEFAULT_INT8_BLOCK: u32 = 64;
/// Smallest int8 block accepted.
pub const MIN_INT8_BLOCK: u32 = 8;
/// Largest int8 block accepted.
pub const MAX_INT8_BLOCK: u32 = 1 << 16;
/// Bytes of the largest LEB128 varint of a u32.
const MAX_VARINT_LEN: usize = 5;
/// Compress the index stream only if zstd saves at least this fraction.
const ZSTD_MIN_SAVING: f64 = 0.10;
/// zstd level for index streams: fast levels already capture the redundancy of varints.
const ZSTD_LEVEL: i32 = 1;

/// What can be wrong with a tensor message or a codec request.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum CodecError {
    /// Fewer bytes than a field needs.
    #[error("truncated tensor message: {what} needs {needed} bytes, {available} available")]
    Truncated {
        /// The field.
        what: &'static str,
        /// Bytes needed.
        needed: usize,
        /// Bytes present.
        available: usize,
    },
    /// A size above its cap.
    #[error("{what} is {value}, above the limit of {max}")]
    TooLarge {
        /// The size.
        what: &'static str,
        /// Its value.
        value: u64,
        /// The cap.
        max: u64,
    },
    /// An unknown dtype id (a newer peer?).
    #[error("unknown dtype id {0}")]
    UnknownDType(u8),
    /// An unknown encoding id (a newer peer?).
    #[error("unknown tensor encoding id {0}")]
    UnknownEncoding(u8),
    /// An unknown top-k value format.
    #[error("unknown top-k value format {0}")]
    UnknownValueFormat(u8),
    /// A malformed shape.
    #[error("bad shape: {0}")]
    BadShape(String),
    /// A codec parameter out of range.
    #[error("bad codec parameter: {0}")]
    BadParameter(String),
    /// The payload length does not match shape and encoding.
    #[error("payload is {got} bytes, shape and encoding need {expected}")]
    PayloadLength {
        /// Bytes the header implies.
        expected: u64,
        /// Bytes present.
        got: u64,
    },
    /// The payload does not match its checksum.
    #[error("payload checksum mismatch")]
    Checksum,
    /// Sparse indices that are out of range, unordered or miscounted.
    #[error("bad sparse indices: {0}")]
    BadIndices(&'static str),
    /// The compressed index stream is corrupt.
    #[error("corrupt compressed indices: {0}")]
    Compression(String),
    /// Bytes left over after the message.
    #[error("{0} unexpected bytes after the tensor")]
    TrailingBytes(usize),
    /// NaN or an infinity among the values: no codec carries them, in either direction (an
    /// int8 block would quietly turn a NaN into its largest value).
    #[error("the tensor holds values that are not finite")]
    NonFinite,
}

/// How top-k values are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ValueFormat {
    /// IEEE half precision.
    Fp16,
    /// One absmax scale for all k values, one signed byte each.
    Int8,
}

/// A codec as chosen in a run's configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Codec {
    /// 32-bit floats, lossless.
    Fp32,
    /// 16-bit IEEE floats.
    Fp16,
    /// bfloat16.
    Bf16,
    /// Blockwise absmax int8.
    Int8 {
        /// Values per scale.
        block: u32,
    },
    /// Blockwise absmax at 4, 3 or 2 bits.
    LowBit {
        /// Bits per value (4, 3 or 2).
        bits: u8,
        /// Values per scale.
        block: u32,
    },
    /// Top-k sparsification.
    TopK {
        /// Fraction of values sent, in parts per million (10_000 = 1%).
        ppm: u32,
        /// How the kept values are stored.
        values: ValueFormat,
    },
    /// Chunked top-k: the `k` largest magnitudes of every `chunk` values, each in `bits`
    /// bits (sign included), positions Rice-coded.
    ChunkTopK {
        /// Values kept per chunk.
        k: u32,
        /// Values per chunk (a power of two).
        chunk: u32,
        /// Bits per kept value.
        bits: u8,
    },
    /// Each block of [`SUBSPACE_BLOCK`] values projected onto a fixed subspace of `1/fold` of
    /// its dimension, the projected values in blockwise int8 (`bits` 8), int4, int3 or int2.
    Subspace {
        /// The block's dimension divided by the subspace's (a power of two).
        fold: u32,
        /// Bits per projected value: 8, 4, 3 or 2.
        bits: u8,
        /// Projected values per scale.
        block: u32,
    },
}

/// `ctopk` without parameters.
pub const DEFAULT_CHUNK_TOPK: Codec = Codec::ChunkTopK {
    k: 32,
    chunk: 4096,
    bits: 2,
};

impl Default for Codec {
    fn default() -> Self {
        Codec::Int8 {
            block: DEFAULT_INT8_BLOCK,
        }
    }
}

impl Codec {
    /// Whether decoding returns exactly the input.
    pub fn is_lossless(&self) -> bool {
        matches!(self, Codec::Fp32)
    }

    /// Whether it sends only some of the values (the others decode to zero).
    pub fn is_sparse(&self) -> bool {
        matches!(self, Codec::TopK { .. } | Codec::ChunkTopK { .. })
    }

    /// Whether a tensor encoded with this codec carries `encoding` (a top-k encoding's count
    /// depends on the tensor's size; everything else is the codec's).
    pub fn encodes_as(&self, encoding: &Encoding) -> bool {
        match (*self, *encoding) {
            (Codec::Fp32, Encoding::Fp32)
            | (Codec::Fp16, Encoding::Fp16)
            | (Codec::Bf16, Encoding::Bf16) => true,
            (Codec::Int8 { block }, Encoding::Int8 { block: b }) => block == b,
            (Codec::LowBit { bits, block }, Encoding::LowBit { bits: x, block: b }) => {
                (bits, block) == (x, b)
            }
            (Codec::TopK { values, .. }, Encoding::TopK { values: v, .. }) => values == v,
            (
                Codec::ChunkTopK { k, chunk, bits },
                Encoding::ChunkTopK {
                    k: x,
                    chunk: c,
                    bits: b,
                },
            ) => (k, chunk, bits) == (x, c, b),
            (
                Codec::Subspace { fold, bits, block },
                Encoding::Subspace {
                    fold: f,
                    bits: b,
                    block: k,
                },
            ) => (fold, bits, block) == (f, b, k),
            _ => false,
        }
    }

    /// Checks that replicas can average with it: not a subspace code, which would drop the
    /// same directions of every round's average for good.
    pub fn validate_for_averaging(&self) -> Result<(), CodecError> {
        if let Codec::Subspace { .. } = self {
            return Err(CodecError::BadParameter(format!(
                "{self} projects onto a fixed subspace: a boundary codec, not an averaging codec"
            )));
        }
        self.validate()
    }

    /// The reduction of the subspace a code projects onto: 1 (the whole space) for every code
    /// but `sub:F` with `F > 1`. The activations and activation gradients of a boundary must
    /// share it, or the gradient sent back is not the gradient of what was sent forward.
    pub fn projection_fold(&self) -> u32 {
        match *self {
            Codec::Subspace { fold, .. } => fold,
            _ => 1,
        }
    }

    /// What the code does to a tensor by design, its rounding aside: a subspace code's
    /// projection (part of the model a run trains through it, so evaluating or using that
    /// model applies it too); nothing for every other code.
    pub fn apply_projection(&self, values: &mut [f32]) -> Result<(), CodecError> {
        if let Codec::Subspace { fold, .. } = *self {
            if fold > 1 {
                subspace::check_len(values.len())?;
                let mut projected = Vec::new();
                subspace::project(values, fold, &mut projected);
                subspace::lift(&mut projected, fold, values);
            }
        }
        Ok(())
    }

    /// Checks the parameters.
    pub fn validate(&self) -> Result<(), CodecError> {
        match *self {
            Codec::Int8 { block } if !(MIN_INT8_BLOCK..=MAX_INT8_BLOCK).contains(&block) => {
                Err(CodecError::BadParameter(format!(
                    "int8 block {block} outside {MIN_INT8_BLOCK}..={MAX_INT8_BLOCK}"
                )))
            }
            Codec::TopK { ppm, .. } if ppm == 0 || ppm > 1_000_000 => Err(
                CodecError::BadParameter(format!("top-k fraction {ppm} ppm outside (0, 100%]")),
            ),
            Codec::ChunkTopK { k, chunk, bits } => chunked::validate(k, chunk, bits),
            Codec::LowBit { bits, block } => lowbit::validate(bits, block),
            Codec::Subspace { fold, bits, block } => subspace::validate(fold, bits, block),
            _ => Ok(()),
        }
    }

    /// Payload bits per value of a large tensor, headers aside: what a sender plans a
    /// transfer with before encoding (sparse codecs: their kept values and typical position
    /// cost, about 8 bits each for Rice-coded chunk positions, 14 for top-k's compressed
    /// deltas).
    pub fn nominal_bits_per_value(&self) -> f64 {
        match *self {
            Codec::Fp32 => 32.0,
            Codec::Fp16 | Codec::Bf16 => 16.0,
            Codec::Int8 { block } => 8.0 + 32.0 / f64::from(block.max(1)),
            Codec::LowBit { bits, block } => f64::from(bits) + 32.0 / f64::from(block.max(1)),
            Codec::TopK { ppm, values } => {
                let value = match values {
                    ValueFormat::Fp16 => 16.0,
                    ValueFormat::Int8 => 8.0,
                };
                f64::from(ppm) / 1e6 * (value + 14.0)
            }
            Codec::ChunkTopK { k, chunk, bits } => {
                f64::from(k) / f64::from(chunk.max(1)) * (f64::from(bits) + 8.0)
            }
            Codec::Subspace { fold, bits, block } => {
                subspace::inner(bits, block).nominal_bits_per_value() / f64::from(fold.max(1))
            }
        }
    }

    /// Values kept by top-k out of `n` (at least one of a non-empty tensor).
    pub fn topk_count(ppm: u32, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        ((n as u128 * ppm as u128).div_ceil(1_000_000) as usize).clamp(1, n)
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Codec::Fp32 => f.write_str("fp32"),
            Codec::Fp16 => f.write_str("fp16"),
            Codec::Bf16 => f.write_str("bf16"),
            Codec::Int8 { block } if block == DEFAULT_INT8_BLOCK => f.write_str("int8"),
            Codec::Int8 { block } => write!(f, "int8:{block}"),
            Codec::LowBit { bits, block } if block == DEFAULT_INT8_BLOCK => write!(f, "int{bits}"),
            Codec::LowBit { bits, block } => write!(f, "int{bits}:{block}"),
            Codec::TopK { ppm, values } => {
                write!(f, "topk:{}%", ppm as f64 / 10_000.0)?;
                if values == ValueFormat::Int8 {
                    f.write_str(":int8")?;
                }
                Ok(())
            }
            Codec::ChunkTopK { k, chunk, bits } => write!(f, "ctopk:{k}/{chunk}:{bits}"),
            Codec::Subspace { fold, bits, block } => {
                write!(f, "sub:{fold}:{}", subspace::inner(bits, block))
            }
        }
    }
}

impl FromStr for Codec {
    type Err = String;

    /// Parses `fp32`, `fp16`, `bf16`, `int8`, `int8:BLOCK`, `topk:PERCENT%`,
    /// `topk:PERCENT%:int8` (values in fp16 unless `:int8`), `ctopk` and `ctopk:K/CHUNK:BITS`,
    /// `int4[:BLOCK]`, `int3[:BLOCK]`, `int2[:BLOCK]` and `sub:FOLD[:INNER]` (INNER one of
    /// the int codes).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut parts = s.split(':');
        let name = parts.next().unwrap_or_default();
        let codec = match name {
            "fp32" => Codec::Fp32,
            "fp16" => Codec::Fp16,
            "bf16" => Codec::Bf16,
            "int8" => Codec::Int8 {
                block: match parts.next() {
                    None => DEFAULT_INT8_BLOCK,
                    Some(b) => b.parse().map_err(|_| format!("bad int8 block '{b}'"))?,
                },
            },
            "int4" | "int3" | "int2" => Codec::LowBit {
                bits: name.as_bytes()[3] - b'0',
                block: match parts.next() {
                    None => DEFAULT_INT8_BLOCK,
                    Some(b) => b.parse().map_err(|_| format!("bad {name} block '{b}'"))?,
                },
            },
            "topk" => {
                let frac = parts.next().ok_or("topk needs a fraction, e.g. topk:1%")?;
                let pct: f64 = frac
                    .strip_suffix('%')
                    .and_then(|p| p.parse().ok())
                    .ok_or_else(|| format!("bad top-k fraction '{frac}' (expected e.g. 1%)"))?;
                let values = match parts.next() {
                    None | Some("fp16") => ValueFormat::Fp16,
                    Some("int8") => ValueFormat::Int8,
                    Some(v) => return Err(format!("bad top-k value format '{v}'")),
                };
                Codec::TopK {
                    ppm: (pct * 10_000.0).round() as u32,
                    values,
                }
            }
            "ctopk" => match parts.next() {
                None => DEFAULT_CHUNK_TOPK,
                Some(kc) => {
                    let bad = || format!("bad chunked top-k '{s}' (expected e.g. ctopk:32/4096:2)");
                    let (k, chunk) = kc.split_once('/').ok_or_else(bad)?;
                    let bits = parts.next().ok_or_else(bad)?;
                    Codec::ChunkTopK {
                        k: k.parse().map_err(|_| bad())?,
                        chunk: chunk.parse().map_err(|_| bad())?,
                        bits: bits.parse().map_err(|_| bad())?,
                    }
                }
            },
            "sub" => {
                let bad = || format!("bad subspace code '{s}' (expected e.g. sub:4:int4)");
                let fold = parts.next().ok_or_else(bad)?.parse().map_err(|_| bad())?;
                // The rest is the inner code, with its own parameters.
                let inner: Vec<&str> = parts.by_ref().collect();
                let (bits, block) = if inner.is_empty() {
                    (8, DEFAULT_INT8_BLOCK)
                } else {
                    match inner.join(":").parse()? {
                        Codec::Int8 { block } => (8, block),
                        Codec::LowBit { bits, block } => (bits, block),
                        other => return Err(format!("{other} inside a subspace code {}", bad())),
                    }
                };
                Codec::Subspace { fold, bits, block }
            }
            _ => {
                return Err(format!(
                    "unknown codec '{s}' (fp32, fp16, bf16, int8, int4, int3, int2, topk:1%, ctopk:32/4096:2, sub:4:int4)"
                ));
            }
        };
        if let Some(extra) = parts.next() {
            return Err(format!("unexpected '{extra}' in codec '{s}'"));
        }
        codec.validate().map_err(|e| e.to_string())?;
        Ok(codec)
    }
}

/// Reusable state for encoding; holding one avoids allocations in steady state.
pub struct Encoder {
    candidates: Vec<u32>,
    magnitudes: Vec<f32>,
    indices: Vec<u32>,
    values: Vec<f32>,
    varints: Vec<u8>,
    zstd: Option<zstd::bulk::Compressor<'static>>,
    compressed: Vec<u8>,
    chunked: chunked::ChunkScratch,
}

impl Default for Encoder {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Encoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Encoder").finish_non_exhaustive()
    }
}

impl Encoder {
    /// A fresh encoder.
    pub fn new() -> Self {
        Encoder {
            candidates: Vec::new(),
            magnitudes: Vec::new(),
            indices: Vec::new(),
            values: Vec::new(),
            varints: Vec::new(),
            zstd: None,
            compressed: Vec::new(),
            chunked: chunked::ChunkScratch::default(),
        }
    }

    /// Encodes `input` of shape `dims` with `codec` into `out` (cleared first; its capacity is
    /// reused). Returns the header written.
    pub fn encode(
        &mut self,
        codec: Codec,
        input: &[f32],
        dims: &[usize],
        out: &mut Vec<u8>,
    ) -> Result<TensorHeader, CodecError> {
        codec.validate()?;
        let shape = Shape::new(dims)?;
        if shape.numel() != input.len() {
            return Err(CodecError::BadShape(format!(
                "{} values for shape {:?}",
                input.len(),
                shape.dims()
            )));
        }
        if !all_finite(input) {
            return Err(CodecError::NonFinite);
        }
        out.clear();
        out.resize(TENSOR_HEADER_LEN, 0);
        let encoding = match codec {
            Codec::Fp32 => {
                write_fp32(input, out);
                Encoding::Fp32
            }
            Codec::Fp16 => {
                write_fp16(input, out);
                Encoding::Fp16
            }
            Codec::Bf16 => {
                write_bf16(input, out);
                Encoding::Bf16
            }
            Codec::Int8 { block } => {
                write_int8(input, block as usize, out);
                Encoding::Int8 { block }
            }
            Codec::LowBit { bits, block } => {
                lowbit::write(input, bits, block, out);
                Encoding::LowBit { bits, block }
            }
            Codec::TopK { ppm, values } => {
                let k = Codec::topk_count(ppm, input.len());
                self.select_topk(input, k);
                self.values.clear();
                self.values
                    .extend(self.indices.iter().map(|&i| input[i as usize]));
                self.write_topk(values, out)?;
                Encoding::TopK {
                    k: k as u32,
                    values,
                }
            }
            Codec::ChunkTopK { k, chunk, bits } => {
                chunked::encode(&mut self.chunked, input, k, chunk, bits, out);
                Encoding::ChunkTopK { k, chunk, bits }
            }
            Codec::Subspace { fold, bits, block } => {
                subspace::encode(input, fold, bits, block, &mut self.values, out)?;
                Encoding::Subspace { fold, bits, block }
            }
        };
        let payload = &out[TENSOR_HEADER_LEN..];
        let header = TensorHeader {
            encoding,
            shape,
            payload_len: payload.len() as u32,
            checksum: xxh3_64(payload),
        };
        header.write(&mut out[..TENSOR_HEADER_LEN]);
        Ok(header)
    }
}

/// Reusable state for decoding.
pub struct Decoder {
    max_elements: usize,
    varints: Vec<u8>,
    zstd: Option<zstd::bulk::Decompressor<'static>>,
    values: Vec<f32>,
}

impl Default for Decoder {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Decoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Decoder").finish_non_exhaustive()
    }
}

impl Decoder {
    /// A fresh decoder accepting tensors of up to [`MAX_TENSOR_ELEMENTS`] values.
    pub fn new() -> Self {
        Self::with_max_elements(MAX_TENSOR_ELEMENTS)
    }

    /// A decoder accepting tensors of up to `max_elements` values. A receiver that knows the
    /// size it expects should say so: a sparse message of a few bytes may describe a large
    /// dense tensor, and this cap is what bounds the memory a sender can make it allocate.
    pub fn with_max_elements(max_elements: usize) -> Self {
        Decoder {
            max_elements: max_elements.min(MAX_TENSOR_ELEMENTS),
            varints: Vec::new(),
            zstd: None,
            values: Vec::new(),
        }
    }

    /// Decodes one tensor message (header and payload, nothing after) into `out`, resized to
    /// the tensor's length. Any malformed input gives an error; nothing is allocated beyond
    /// what the validated header implies.
    pub fn decode(&mut self, bytes: &[u8], out: &mut Vec<f32>) -> Result<TensorHeader, CodecError> {
        let header = TensorHeader::parse(bytes, self.max_elements)?;
        let payload = &bytes[TENSOR_HEADER_LEN..];
        let len = header.payload_len as usize;
        if payload.len() < len {
            return Err(CodecError::Truncated {
                what: "tensor payload",
                needed: len,
                available: payload.len(),
            });
        }
        if payload.len() > len {
            return Err(CodecError::TrailingBytes(payload.len() - len));
        }
        if xxh3_64(payload) != header.checksum {
            return Err(CodecError::Checksum);
        }
        let n = header.shape.numel();
        out.clear();
        out.resize(n, 0.0);
        let sparse = match header.encoding {
            Encoding::TopK { k, values } => self.read_topk(payload, k as usize, values, out),
            Encoding::ChunkTopK { k, chunk, bits } => chunked::decode(payload, k, chunk, bits, out),
            Encoding::Subspace { fold, bits, block } => {
                subspace::decode(payload, fold, bits, block, &mut self.values, out);
                Ok(())
            }
            dense => {
                decode_dense(dense, payload, out);
                Ok(())
            }
        };
        if let Err(e) = sparse {
            out.clear();
            return Err(e);
        }
        if !all_finite(out) {
            out.clear();
            return Err(CodecError::NonFinite);
        }
        Ok(header)
    }
}

multiversion! {
    /// Whether no value is NaN or infinite (exponent bits all set), without branches so that
    /// it vectorises: a pass over the tensor at memory speed.
    fn all_finite(x: &[f32]) -> bool {
        const EXPONENT: u32 = 0x7f80_0000;
        let mut special = 0u32;
        for v in x {
            special |= u32::from(v.to_bits() & EXPONENT == EXPONENT);
        }
        special == 0
    }
}

/// Encodes into a new buffer (convenience over [`Encoder::encode`]).
pub fn encode_to_vec(codec: Codec, input: &[f32], dims: &[usize]) -> Result<Vec<u8>, CodecError> {
    let mut out = Vec::new();
    Encoder::new().encode(codec, input, dims, &mut out)?;
    Ok(out)
}

/// Decodes into a new buffer (convenience over [`Decoder::decode`]).
pub fn decode_to_vec(bytes: &[u8]) -> Result<(TensorHeader, Vec<f32>), CodecError> {
    let mut out = Vec::new();
    let header = Decoder::new().decode(bytes, &mut out)?;
    Ok((header, out))
}

#[cfg(test)]
#[path = "codec_tests.rs"]
mod tests;
