//! Framing: every message on a shoal stream is a frame.
//!
//! ```text
//! offset  size  field
//!      0     4  magic "SHOL"
//!      4     2  protocol version (little-endian u16)
//!      6     1  kind: 1 control (postcard), 2 tensor (see `codec`)
//!      7     1  flags, must be 0
//!      8     4  payload length (little-endian u32), at most the cap for its kind
//!     12     …  payload
//! ```
//!
//! A reader parses the 12-byte header first ([`FrameHeader::parse`]), checks the length against
//! [`FrameLimits`] before it allocates anything, then reads exactly that many bytes. A peer
//! speaking a newer version or an unknown kind gets a typed error it can log and answer.

use crate::PROTOCOL_VERSION;
use serde::Serialize;
use serde::de::DeserializeOwned;
use thiserror::Error;

/// First bytes of every frame.
pub const MAGIC: [u8; 4] = *b"SHOL";
/// Bytes of a frame header.
pub const FRAME_HEADER_LEN: usize = 12;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FrameKind {
    /// A control message, encoded with postcard.
    Control = 1,
    /// A tensor message (header and payload of `codec`).
    Tensor = 2,
}

/// Size caps, checked before anything is allocated for a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest control payload.
    pub max_control_len: u32,
    /// Largest tensor payload.
    pub max_tensor_len: u32,
}

impl Default for FrameLimits {
    /// Control messages are small (membership, announcements): 1 MiB is generous. Tensor
    /// frames carry at most one stage boundary's activations or one averaging part; 256 MiB
    /// covers a GPT-2 small activation tensor at batch 64 in fp32 with room to spare.
    fn default() -> Self {
        FrameLimits {
            max_control_len: 1 << 20,
            max_tensor_len: 256 << 20,
        }
    }
}

/// Why a frame was rejected.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum WireError {
    /// Fewer bytes than the header or the declared payload.
    #[error("truncated frame: {needed} bytes needed, {available} available")]
    Truncated {
        /// Bytes needed.
        needed: usize,
        /// Bytes present.
        available: usize,
    },
    /// Not a shoal frame.
    #[error("bad magic {0:02x?}: not a shoal frame")]
    BadMagic([u8; 4]),
    /// A protocol version this node does not speak.
    #[error("unsupported protocol version {got} (this node speaks {supported})")]
    UnsupportedVersion {
        /// The peer's version.
        got: u16,
        /// Ours.
        supported: u16,
    },
    /// A frame kind this node does not know.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Reserved flags set.
    #[error("reserved frame flags {0:#04x} set")]
    BadFlags(u8),
    /// A payload above the cap for its kind.
    #[error("{kind:?} frame of {len} bytes exceeds the {max}-byte limit")]
    TooLarge {
        /// The frame's kind.
        kind: FrameKind,
        /// Declared length.
        len: u32,
        /// The cap.
        max: u32,
    },
    /// Bytes after the frame where none belong.
    #[error("{0} unexpected bytes after the frame")]
    TrailingBytes(usize),
    /// A control payload that does not decode.
    #[error("malformed control message: {0}")]
    Control(String),
    /// A message too large to frame.
    #[error("message of {0} bytes is too large to send")]
    Unsendable(usize),
}

/// A parsed and validated frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the payload is.
    pub kind: FrameKind,
    /// Payload bytes following the header.
    pub len: u32,
}

impl FrameHeader {
    /// Parses the first [`FRAME_HEADER_LEN`] bytes of `bytes` and checks them against `limits`.
    pub fn parse(bytes: &[u8], limits: &FrameLimits) -> Result<Self, WireError> {
        let Some(h) = bytes.get(..FRAME_HEADER_LEN) else {
            return Err(WireError::Truncated {
                needed: FRAME_HEADER_LEN,
                available: bytes.len(),
            });
        };
        let magic = [h[0], h[1], h[2], h[3]];
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([h[4], h[5]]);
        if version != PROTOCOL_VERSION {
            return Err(WireError::UnsupportedVersion {
                got: version,
                supported: PROTOCOL_VERSION,
            });
        }
        let kind = match h[6] {
            1 => FrameKind::Control,
            2 => FrameKind::Tensor,
            other => return Err(WireError::UnknownKind(other)),
        };
        if h[7] != 0 {
            return Err(WireError::BadFlags(h[7]));
        }
        let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
        let max = match kind {
            FrameKind::Control => limits.max_control_len,
            FrameKind::Tensor => limits.max_tensor_len,
        };
        if len > max {
            return Err(WireError::TooLarge { kind, len, max });
        }
        Ok(FrameHeader { kind, len })
    }

    /// The 12 header bytes.
    pub fn to_bytes(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut h = [0u8; FRAME_HEADER_LEN];
        h[..4].copy_from_slice(&MAGIC);
        h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        h[6] = self.kind as u8;
        h[8..12].copy_from_slice(&self.len.to_le_bytes());
        h
    }
}

/// Appends a frame of `kind` carrying `payload` to `out`.
pub fn write_frame(kind: FrameKind, payload: &[u8], out: &mut Vec<u8>) -> Result<(), WireError> {
    let len = u32::try_from(payload.len()).map_err(|_| WireError::Unsendable(payload.len()))?;
    out.extend_from_slice(&FrameHeader { kind, len }.to_bytes());
    out.extend_from_slice(payload);
    Ok(())
}

/// Splits one complete frame (and nothing after it) into its header and payload.
pub fn read_frame<'a>(
    bytes: &'a [u8],
    limits: &FrameLimits,
) -> Result<(FrameHeader, &'a [u8]), WireError> {
    let header = FrameHeader::parse(bytes, limits)?;
    let body = &bytes[FRAME_HEADER_LEN..];
    let len = header.len as usize;
    if body.len() < len {
        return Err(WireError::Truncated {
            needed: FRAME_HEADER_LEN + len,
            available: bytes.len(),
        });
    }
    if body.len() > len {
        return Err(WireError::TrailingBytes(body.len() - len));
    }
    Ok((header, body))
}

/// Appends a control frame holding `msg` (postcard) to `out`.
pub fn write_control<T: Serialize>(
    msg: &T,
    limits: &FrameLimits,
    out: &mut Vec<u8>,
) -> Result<(), WireError> {
    let payload = postcard::to_stdvec(msg).map_err(|e| WireError::Control(e.to_string()))?;
    if payload.len() > limits.max_control_len as usize {
        return Err(WireError::Unsendable(payload.len()));
    }
    write_frame(FrameKind::Control, &payload, out)
}

/// Decodes a control payload. postcard reads from the slice, so no collection in the message
/// can claim more elements than there are bytes: allocation is bounded by the payload, which
/// the frame cap bounds.
pub fn decode_control<T: DeserializeOwned>(payload: &[u8]) -> Result<T, WireError> {
    let (msg, rest) =
        postcard::take_from_bytes::<T>(payload).map_err(|e| WireError::Control(e.to_string()))?;
    if !rest.is_empty() {
        return Err(WireError::TrailingBytes(rest.len()));
    }
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Hello {
        run: [u8; 8],
        peers: Vec<String>,
    }

    #[test]
    fn control_messages_round_trip() {
        let limits = FrameLimits::default();
        let msg = Hello {
            run: *b"run-0001",
            peers: vec!["a".into(), "bb".into()],
        };
        let mut out = Vec::new();
        write_control(&msg, &limits, &mut out).unwrap();
        let (header, payload) = read_frame(&out, &limits).unwrap();
        assert_eq!(header.kind, FrameKind::Control);
        assert_eq!(decode_control::<Hello>(payload).unwrap(), msg);
    }

    #[test]
    fn newer_peers_and_oversized_frames_get_typed_errors() {
        let limits = FrameLimits {
            max_control_len: 16,
            max_tensor_len: 64,
        };
        let mut frame = Vec::new();
        write_frame(FrameKind::Tensor, &[0; 8], &mut frame).unwrap();
        let mut newer = frame.clone();
        newer[4..6].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
        assert_eq!(
            read_frame(&newer, &limits),
            Err(WireError::UnsupportedVersion {
                got: PROTOCOL_VERSION + 1,
                supported: PROTOCOL_VERSION
            })
        );
        let mut unknown = frame.clone();
        unknown[6] = 7;
        assert_eq!(
            read_frame(&unknown, &limits),
            Err(WireError::UnknownKind(7))
        );
        let mut big = Vec::new();
        write_frame(FrameKind::Control, &[0; 17], &mut big).unwrap();
        assert_eq!(
            FrameHeader::parse(&big, &limits),
            Err(WireError::TooLarge {
                kind: FrameKind::Control,
                len: 17,
                max: 16
            })
        );
        assert!(matches!(
            read_frame(&frame[..15], &limits),
            Err(WireError::Truncated { .. })
        ));
        assert!(matches!(
            read_frame(b"HTTP/1.1 200 OK", &limits),
            Err(WireError::BadMagic(_))
        ));
        let too_big = Hello {
            run: [0; 8],
            peers: vec!["x".repeat(20)],
        };
        assert!(matches!(
            write_control(&too_big, &limits, &mut Vec::new()),
            Err(WireError::Unsendable(_))
        ));
    }
}
