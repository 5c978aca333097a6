//! Scripted misbehaviour: what a malicious volunteer can do without breaking a rule of the
//! protocol, so that the defences can be measured attack by attack. The simulator gives it to
//! the peer groups a scenario marks with a `behavior`; the node takes it only in builds with
//! the test-only `attacks` feature; either hands it to [`super::Peer::set_attack`]. An attacker
//! runs the honest protocol and changes only values it sends: well-formed and (but for `nan`)
//! finite.
//!
//! Two places are enough for the attacks here: the contribution the device computed for an
//! averaging round ([`Attack::contribution`]), and the averaged part it owns, which it negates
//! for everyone, itself included ([`Attack::forges_parts`]), so that it stays in step with the
//! replicas it poisons rather than being re-synced by their hash vote.

use super::SeededRng;
use std::time::Duration;

/// What a peer does with what it computes for others.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Behavior {
    /// Sends what it computed.
    Honest,
    /// Sends its averaging contribution negated.
    SignFlip,
    /// Sends its averaging contribution multiplied by a factor.
    Scale(f32),
    /// Sends its averaging contribution plus Gaussian noise of this standard deviation.
    Noise(f32),
    /// Sends zeros as its averaging contribution (while claiming its samples).
    Zero,
    /// Puts NaN in its averaging contribution.
    Nan,
    /// Negates the averaged part it owns (the part every replica applies, itself included).
    BadPart,
}

impl std::str::FromStr for Behavior {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let number = |v: &str| -> Result<f32, String> {
            v.parse::<f32>()
                .ok()
                .filter(|x| x.is_finite())
                .ok_or_else(|| format!("'{v}' is not a number"))
        };
        Ok(match s.split_once(':') {
            None if s == "honest" => Behavior::Honest,
            None if s == "sign-flip" => Behavior::SignFlip,
            None if s == "zero" => Behavior::Zero,
            None if s == "nan" => Behavior::Nan,
            None if s == "bad-part" => Behavior::BadPart,
            Some(("scale", f)) => Behavior::Scale(number(f)?),
            Some(("noise", sigma)) => Behavior::Noise(number(sigma)?),
            _ => {
                return Err(format!(
                    "'{s}' (honest, sign-flip, scale:F, noise:SIGMA, zero, nan or bad-part)"
                ));
            }
        })
    }
}

/// One peer's behavior from a point in time on.
#[derive(Clone, Debug)]
pub struct Attack {
    behavior: Behavior,
    /// Honest before this.
    from: Duration,
    /// Its own noise, so that an attacker draws nothing from its owner's randomness.
    rng: SeededRng,
}

impl Attack {
    /// `behavior` from `from` on; `seed` feeds its noise.
    pub fn new(behavior: Behavior, from: Duration, seed: u64) -> Self {
        Attack {
            behavior,
            from,
            rng: SeededRng::new(seed ^ 0x6e6f_6973_6521),
        }
    }

    /// Whether it attacks at some point.
    pub fn is_attacker(&self) -> bool {
        self.behavior != Behavior::Honest
    }

    fn active(&self, now: Duration) -> bool {
        self.is_attacker() && now >= self.from
    }

    /// Its averaging contribution (the device's result) as it hands it to its peer.
    pub fn contribution(&mut self, values: &mut [f32], now: Duration) {
        if !self.active(now) {
            return;
        }
        match self.behavior {
            Behavior::Honest | Behavior::BadPart => {}
            Behavior::SignFlip => values.iter_mut().for_each(|v| *v = -*v),
            Behavior::Scale(f) => values.iter_mut().for_each(|v| *v *= f),
            Behavior::Zero => values.iter_mut().for_each(|v| *v = 0.0),
            Behavior::Nan => {
                if let Some(v) = values.first_mut() {
                    *v = f32::NAN;
                }
            }
            Behavior::Noise(sigma) => {
                for v in values {
                    *v += sigma * self.gaussian();
                }
            }
        }
    }

    /// Whether it negates the averaged parts it owns (now).
    pub fn forges_parts(&self, now: Duration) -> bool {
        self.active(now) && self.behavior == Behavior::BadPart
    }

    /// A standard normal draw (Box-Muller).
    fn gaussian(&mut self) -> f32 {
        let u1 = ((self.rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let u2 = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }
}
