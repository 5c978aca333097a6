//! shoal-protocol: what peers say to each other and how they decide what to do.
//!
//! This crate holds the wire format (framing, control messages, tensor codecs) and the training
//! protocol (membership, stage assignment, microbatch routing, averaging, joining) as sans-IO
//! state machines in the shape of quinn-proto: the owner feeds them events with the current
//! time and drains the actions they want performed. Two owners drive the same machines: the
//! node (real sockets and clocks) and the simulator (modelled links, virtual time).
//!
//! This crate must never perform IO, read a clock, spawn threads, or use randomness other than
//! from a seed it is given; it depends on no other shoal crate. Every length and count decoded
//! from the network is bounded before anything is allocated for it.

/// The protocol's major version; it appears in every frame and protocol id (`/shoal/.../1`).
pub const PROTOCOL_VERSION: u16 = 1;

pub mod codec;
mod simd;
pub mod swarm;
pub mod wire;

pub use codec::{
    Codec, CodecError, Decoder, Encoder, Encoding, ErrorFeedback, TensorHeader, ValueFormat,
};
pub use wire::{FrameHeader, FrameKind, FrameLimits, WireError};

use serde::{Deserialize, Serialize};

/// The codec of each kind of tensor traffic; part of a run's configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TrafficCodecs {
    /// Activations sent forward between stages.
    pub activations: HopCodec,
    /// Gradients of activations sent backward between stages.
    pub activation_grads: HopCodec,
    /// Gradient (or DiLoCo pseudo-gradient) averaging between replicas of a stage.
    pub averaging: Codec,
}

impl Default for TrafficCodecs {
    /// Stage boundaries choose per hop between int8 and int4 ([`HopCodec::AUTO`]); averaging in
    /// int8, 3.8x smaller than fp32 at a loss cost within noise (see the README).
    fn default() -> Self {
        TrafficCodecs {
            activations: HopCodec::AUTO,
            activation_grads: HopCodec::AUTO,
            averaging: Codec::default(),
        }
    }
}

/// The codec of one kind of stage-boundary traffic: one codec, or a choice a sender makes for
/// each hop between a light codec and a strong one, from the hop's measured bandwidth and its
/// stage's compute time (`swarm::links`). Written `int8` (one codec), `int8,int4` (light,
/// strong) or `auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HopCodec {
    /// Sent where the link keeps up with the stage.
    pub light: Codec,
    /// Sent where it does not.
    pub strong: Codec,
}

impl HopCodec {
    /// int8 on links that keep up, int4 on the others: both within 1% of fp32's loss at equal
    /// tokens, where int2 was not (the boundary table in the README).
    pub const AUTO: HopCodec = HopCodec {
        light: Codec::Int8 {
            block: codec::DEFAULT_INT8_BLOCK,
        },
        strong: Codec::LowBit {
            bits: 4,
            block: codec::DEFAULT_INT8_BLOCK,
        },
    };

    /// Always `codec`.
    pub const fn fixed(codec: Codec) -> HopCodec {
        HopCodec {
            light: codec,
            strong: codec,
        }
    }

    /// Whether there is a choice to make.
    pub fn chooses(&self) -> bool {
        self.light != self.strong
    }

    /// Whether `tensor` (as sent) is encoded with one of the two codecs: a hop may pick
    /// either, nothing else.
    pub fn allows(&self, tensor: &[u8]) -> bool {
        TensorHeader::parse(tensor, usize::MAX).is_ok_and(|h| {
            self.light.encodes_as(&h.encoding) || self.strong.encodes_as(&h.encoding)
        })
    }

    /// Checks both codecs.
    pub fn validate(&self) -> Result<(), CodecError> {
        self.light.validate()?;
        self.strong.validate()
    }

    /// Checks that the light and strong codecs of activations and of their gradients all
    /// project onto the same subspace (see [`Codec::projection_fold`]): a projection is part
    /// of the model, so a hop may not drop it for some messages or one direction.
    pub fn check_projections(activations: &HopCodec, grads: &HopCodec) -> Result<(), String> {
        let codecs = [
            activations.light,
            activations.strong,
            grads.light,
            grads.strong,
        ];
        if codecs
            .iter()
            .any(|c| c.projection_fold() != codecs[0].projection_fold())
        {
            return Err(format!(
                "activation codecs {activations} and gradient codecs {grads} project onto \
                 different subspaces: a subspace code (sub:F) is part of the model, so every \
                 boundary codec must use the same F"
            ));
        }
        Ok(())
    }
}

impl std::fmt::Display for HopCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self == HopCodec::AUTO {
            f.write_str("auto")
        } else if self.chooses() {
            write!(f, "{},{}", self.light, self.strong)
        } else {
            write!(f, "{}", self.light)
        }
    }
}

impl std::str::FromStr for HopCodec {
    type Err = String;

    /// `auto`, one codec, or `LIGHT,STRONG`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "auto" {
            return Ok(HopCodec::AUTO);
        }
        let hop = match s.split_once(',') {
            None => HopCodec::fixed(s.parse()?),
            Some((light, strong)) => HopCodec {
                light: light.parse()?,
                strong: strong.parse()?,
            },
        };
        hop.validate().map_err(|e| e.to_string())?;
        Ok(hop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hop_codec_is_one_codec_two_or_auto_and_prints_as_it_parses() {
        let int8 = Codec::default();
        let cases = [
            ("auto", HopCodec::AUTO),
            ("int8", HopCodec::fixed(int8)),
            ("int8,int4", HopCodec::AUTO),
            (
                "fp32,ctopk:32/4096:2",
                HopCodec {
                    light: Codec::Fp32,
                    strong: codec::DEFAULT_CHUNK_TOPK,
                },
            ),
        ];
        for (text, want) in cases {
            let hop: HopCodec = text.parse().unwrap();
            assert_eq!(hop, want, "{text}");
            assert_eq!(hop.to_string().parse::<HopCodec>().unwrap(), hop);
        }
        assert!(!HopCodec::fixed(int8).chooses() && HopCodec::AUTO.chooses());
        for bad in ["", "int5", "int8,", ",int4", "int8,int4,int2", "int8:7"] {
            assert!(bad.parse::<HopCodec>().is_err(), "{bad}");
        }
    }

    /// A subspace code's projection is part of the model: every boundary codec of a run
    /// shares it, or the run is refused (a rotation alone, `sub:1`, drops nothing).
    #[test]
    fn every_boundary_codec_shares_a_projection() {
        let hop = |s: &str| s.parse::<HopCodec>().unwrap();
        let check = |a: &str, g: &str| HopCodec::check_projections(&hop(a), &hop(g));
        assert!(check("sub:2:int8,sub:2:int4", "sub:2:int4").is_ok());
        assert!(check("int8,sub:1:int4", "auto").is_ok());
        assert!(check("sub:2:int4", "auto").is_err());
        assert!(check("int8,sub:2:int4", "sub:2:int4").is_err());
        assert!(check("sub:4", "sub:2").is_err());
    }

    /// A hop's receiver takes a tensor in either of the run's two codecs for the hop, block
    /// sizes and all, and nothing else (nor bytes that are no tensor).
    #[test]
    fn a_hop_allows_exactly_its_two_codecs() {
        let values = [0.25f32; 512];
        let sent = |codec: &str| {
            let codec: Codec = codec.parse().unwrap();
            codec::encode_to_vec(codec, &values, &[values.len()]).unwrap()
        };
        for codec in ["int8", "int4"] {
            assert!(HopCodec::AUTO.allows(&sent(codec)), "{codec}");
        }
        for codec in [
            "fp32", "bf16", "int8:32", "int4:32", "int2", "topk:1%", "ctopk",
        ] {
            assert!(!HopCodec::AUTO.allows(&sent(codec)), "{codec}");
        }
        let sparse: HopCodec = "fp32,ctopk:32/4096:2".parse().unwrap();
        assert!(sparse.allows(&sent("ctopk")) && !sparse.allows(&sent("ctopk:64/4096:2")));
        let topk = HopCodec::fixed("topk:1%:int8".parse().unwrap());
        assert!(topk.allows(&sent("topk:5%:int8")) && !topk.allows(&sent("topk:1%")));
        assert!(!HopCodec::AUTO.allows(b"not a tensor"));
    }
}
