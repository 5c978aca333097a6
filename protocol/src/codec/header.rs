//! The fixed little-endian header of a tensor message: dtype, shape, encoding and checksum.

use super::*;

/// The shape of a tensor: up to [`MAX_DIMS`] dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    dims: [u32; MAX_DIMS],
    ndim: u8,
}

impl Shape {
    /// A shape from dimension sizes; at most [`MAX_DIMS`] dimensions and
    /// [`MAX_TENSOR_ELEMENTS`] values.
    pub fn new(dims: &[usize]) -> Result<Self, CodecError> {
        if dims.len() > MAX_DIMS {
            return Err(CodecError::BadShape(format!(
                "{} dimensions (max {MAX_DIMS})",
                dims.len()
            )));
        }
        let mut out = [0u32; MAX_DIMS];
        let mut numel: u64 = 1;
        for (o, &d) in out.iter_mut().zip(dims) {
            *o = u32::try_from(d).map_err(|_| CodecError::BadShape(format!("dimension {d}")))?;
            // Every prefix product must fit, even when a later dimension is zero: `numel`
            // multiplies in the same order.
            numel = numel
                .checked_mul(d as u64)
                .filter(|&n| n <= MAX_TENSOR_ELEMENTS as u64)
                .ok_or_else(|| CodecError::BadShape(format!("dimensions {dims:?} overflow")))?;
        }
        if numel > MAX_TENSOR_ELEMENTS as u64 {
            return Err(CodecError::TooLarge {
                what: "tensor elements",
                value: numel,
                max: MAX_TENSOR_ELEMENTS as u64,
            });
        }
        Ok(Shape {
            dims: out,
            ndim: dims.len() as u8,
        })
    }

    /// The dimension sizes.
    pub fn dims(&self) -> &[u32] {
        &self.dims[..self.ndim as usize]
    }

    /// Number of values (at most [`MAX_TENSOR_ELEMENTS`]).
    pub fn numel(&self) -> usize {
        self.dims().iter().map(|&d| d as usize).product()
    }
}

/// How the payload of one message is encoded (the wire form of a [`Codec`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    /// f32 values.
    Fp32,
    /// f16 values.
    Fp16,
    /// bf16 values.
    Bf16,
    /// Blockwise int8 with one f32 scale per `block` values.
    Int8 {
        /// Values per scale.
        block: u32,
    },
    /// `k` sparse values with delta-coded indices.
    TopK {
        /// Values present.
        k: u32,
        /// How they are stored.
        values: ValueFormat,
    },
    /// Blockwise int4 or int2 (see [`super::lowbit`]).
    LowBit {
        /// Bits per value.
        bits: u8,
        /// Values per scale.
        block: u32,
    },
    /// Chunked top-k (see [`super::chunked`]).
    ChunkTopK {
        /// Values kept per chunk.
        k: u32,
        /// Values per chunk.
        chunk: u32,
        /// Bits per value.
        bits: u8,
    },
    /// Rows projected onto a fixed subspace (see [`super::subspace`]).
    Subspace {
        /// Width divided by the subspace's dimension.
        fold: u32,
        /// Bits per projected value.
        bits: u8,
        /// Projected values per scale.
        block: u32,
    },
}

impl Encoding {
    fn id(&self) -> u8 {
        match self {
            Encoding::Fp32 => 0,
            Encoding::Fp16 => 1,
            Encoding::Bf16 => 2,
            Encoding::Int8 { .. } => 3,
            Encoding::TopK { .. } => 4,
            Encoding::ChunkTopK { .. } => 5,
            Encoding::LowBit { .. } => 6,
            Encoding::Subspace { .. } => 7,
        }
    }

    /// Exact payload length of a dense encoding of `n` values (`None` for the sparse ones,
    /// whose index streams vary).
    fn dense_payload_len(&self, n: usize) -> Option<usize> {
        match *self {
            Encoding::Subspace { fold, bits, block } => subspace::inner_encoding(bits, block)
                .dense_payload_len(subspace::projected_len(n, fold)),
            Encoding::Fp32 => Some(4 * n),
            Encoding::Fp16 | Encoding::Bf16 => Some(2 * n),
            Encoding::Int8 { block } => Some(4 * n.div_ceil(block as usize) + n),
            Encoding::LowBit { bits, block } => Some(lowbit::payload_len(n, bits, block)),
            Encoding::TopK { .. } | Encoding::ChunkTopK { .. } => None,
        }
    }
}

impl fmt::Display for Encoding {
    /// The codec family, parameters aside (`int8`, `int4`, `ctopk`, ...).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Encoding::Fp32 => f.write_str("fp32"),
            Encoding::Fp16 => f.write_str("fp16"),
            Encoding::Bf16 => f.write_str("bf16"),
            Encoding::Int8 { .. } => f.write_str("int8"),
            Encoding::LowBit { bits, .. } => write!(f, "int{bits}"),
            Encoding::TopK { .. } => f.write_str("topk"),
            Encoding::ChunkTopK { .. } => f.write_str("ctopk"),
            Encoding::Subspace { .. } => f.write_str("sub"),
        }
    }
}

/// The fixed header of a tensor message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorHeader {
    /// Payload encoding.
    pub encoding: Encoding,
    /// Tensor shape (the decoded tensor is f32).
    pub shape: Shape,
    /// Bytes of payload after the header.
    pub payload_len: u32,
    /// xxh3-64 of the payload.
    pub checksum: u64,
}

/// The only dtype so far: decoded tensors are f32.
pub(super) const DTYPE_F32: u8 = 0;

impl TensorHeader {
    pub(super) fn write(&self, out: &mut [u8]) {
        let (param, aux) = match self.encoding {
            Encoding::Int8 { block } => (block, 0),
            Encoding::TopK { k, values } => (k, values as u8),
            Encoding::ChunkTopK { k, chunk, bits } => (chunked::pack_param(k, chunk), bits),
            Encoding::LowBit { bits, block } => (block, bits),
            Encoding::Subspace { fold, bits, block } => (block, subspace::pack_aux(fold, bits)),
            _ => (0, 0),
        };
        out[0] = DTYPE_F32;
        out[1] = self.encoding.id();
        out[2] = aux;
        out[3] = self.shape.ndim;
        out[4..8].copy_from_slice(&param.to_le_bytes());
        for (i, d) in self.shape.dims.iter().enumerate() {
            out[8 + 4 * i..12 + 4 * i].copy_from_slice(&d.to_le_bytes());
        }
        out[24..28].copy_from_slice(&self.payload_len.to_le_bytes());
        out[28..36].copy_from_slice(&self.checksum.to_le_bytes());
    }

    /// Parses and validates a header (everything but the payload itself), accepting tensors
    /// of up to `max_elements` values.
    pub fn parse(bytes: &[u8], max_elements: usize) -> Result<Self, CodecError> {
        let Some(h) = bytes.get(..TENSOR_HEADER_LEN) else {
            return Err(CodecError::Truncated {
                what: "tensor header",
                needed: TENSOR_HEADER_LEN,
                available: bytes.len(),
            });
        };
        let u32_at = |o: usize| u32::from_le_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
        if h[0] != DTYPE_F32 {
            return Err(CodecError::UnknownDType(h[0]));
        }
        let ndim = h[3] as usize;
        if ndim > MAX_DIMS {
            return Err(CodecError::BadShape(format!(
                "{ndim} dimensions (max {MAX_DIMS})"
            )));
        }
        let dims: Vec<usize> = (0..ndim).map(|i| u32_at(8 + 4 * i) as usize).collect();
        if (ndim..MAX_DIMS).any(|i| u32_at(8 + 4 * i) != 0) {
            return Err(CodecError::BadShape(
                "unused dimensions must be zero".into(),
            ));
        }
        let shape = Shape::new(&dims)?;
        let n = shape.numel();
        if n > max_elements {
            return Err(CodecError::TooLarge {
                what: "tensor elements",
                value: n as u64,
                max: max_elements as u64,
            });
        }
        let param = u32_at(4);
        let encoding = match h[1] {
            0 => Encoding::Fp32,
            1 => Encoding::Fp16,
            2 => Encoding::Bf16,
            3 => {
                Codec::Int8 { block: param }.validate()?;
                Encoding::Int8 { block: param }
            }
            4 => {
                let values = match h[2] {
                    0 => ValueFormat::Fp16,
                    1 => ValueFormat::Int8,
                    other => return Err(CodecError::UnknownValueFormat(other)),
                };
                if param as usize > n {
                    return Err(CodecError::BadParameter(format!(
                        "top-k of {param} out of {n}"
                    )));
                }
                Encoding::TopK { k: param, values }
            }
            5 => {
                let (k, chunk) = chunked::unpack_param(param);
                if chunked::pack_param(k, chunk) != param {
                    return Err(CodecError::BadParameter(format!(
                        "chunked top-k parameter word {param:#x}"
                    )));
                }
                let bits = h[2];
                chunked::validate(k, chunk, bits)?;
                Encoding::ChunkTopK { k, chunk, bits }
            }
            6 => {
                let bits = h[2];
                lowbit::validate(bits, param)?;
                Encoding::LowBit { bits, block: param }
            }
            7 => {
                let (fold, bits) = subspace::unpack_aux(h[2]);
                if subspace::pack_aux(fold, bits) != h[2] {
                    return Err(CodecError::BadParameter(format!(
                        "subspace parameter byte {:#x}",
                        h[2]
                    )));
                }
                subspace::validate(fold, bits, param)?;
                subspace::check_len(n)?;
                Encoding::Subspace {
                    fold,
                    bits,
                    block: param,
                }
            }
            other => return Err(CodecError::UnknownEncoding(other)),
        };
        if h[2] != 0
            && !matches!(
                encoding,
                Encoding::TopK { .. }
                    | Encoding::ChunkTopK { .. }
                    | Encoding::LowBit { .. }
                    | Encoding::Subspace { .. }
            )
        {
            return Err(CodecError::BadParameter("non-zero aux byte".into()));
        }
        let payload_len = u32_at(24);
        let bound = match encoding {
            Encoding::ChunkTopK { k, chunk, bits } => chunked::payload_bound(n, k, chunk, bits),
            _ => match encoding.dense_payload_len(n) {
                Some(len) => len,
                None => topk_payload_bound(param as usize),
            },
        };
        if payload_len as u64 > bound as u64 {
            return Err(CodecError::PayloadLength {
                expected: bound as u64,
                got: payload_len as u64,
            });
        }
        if let Some(len) = encoding.dense_payload_len(n) {
            if payload_len as usize != len {
                return Err(CodecError::PayloadLength {
                    expected: len as u64,
                    got: payload_len as u64,
                });
            }
        }
        let checksum = u64::from_le_bytes(h[28..36].try_into().unwrap_or_default());
        Ok(TensorHeader {
            encoding,
            shape,
            payload_len,
            checksum,
        })
    }
}
