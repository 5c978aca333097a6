//! Scripted misbehaviour: what a malicious volunteer can do without breaking a rule of the
//! protocol, so that the defences can be measured attack by attack. The simulator gives it to
//! the peer groups a scenario marks with a `behavior`; the node takes it only in builds with
//! the test-only `attacks` feature; either hands it to [`super::Peer::set_attack`]. An attacker
//! runs the honest protocol and changes only values it sends: well-formed and (but for `nan`)
//! finite.
//!
//! The attacks act in three places: the contribution the device computed for an averaging
//! round ([`Attack::contribution`]); its role in a round, as the owner of a part it negates
//! for everyone, itself included, so that it stays in step with the replicas it poisons
//! ([`Attack::forges_parts`]) or as a leader that leaves the others out
//! ([`Attack::excludes_others`]); and the messages and announcements it sends
//! ([`Attack::outgoing`]). A state it serves is poisoned by its owner, which knows the state's
//! layout ([`Attack::poisons_state`]).

use super::SeededRng;
use super::interface::Action;
use super::message::Message;
use std::collections::VecDeque;
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
    /// Inner-product manipulation: sends minus this fraction of its estimate of the honest
    /// mean (its own contribution: it sees no other).
    Ipm(f32),
    /// Sends its contribution of this many rounds ago (honest until it has one).
    Stale(u32),
    /// Negates the averaged part it owns (the part every replica applies, itself included).
    BadPart,
    /// As a round's leader, starts the round with itself alone: the others are left out.
    BadLeader,
    /// Announces a hundred times its measured throughput and an empty queue, to draw work.
    LieThroughput,
    /// Announces parameter hashes it does not hold.
    ForgeHash,
    /// Answers catch-up requests with the negated update.
    PoisonCatchUp,
    /// Serves joiners a state with its parameters negated (well-formed, with a valid hash).
    PoisonState,
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
            None => match s {
                "honest" => Behavior::Honest,
                "sign-flip" => Behavior::SignFlip,
                "zero" => Behavior::Zero,
                "nan" => Behavior::Nan,
                "bad-part" => Behavior::BadPart,
                "bad-leader" => Behavior::BadLeader,
                "lie-throughput" => Behavior::LieThroughput,
                "forge-hash" => Behavior::ForgeHash,
                "poison-catch-up" => Behavior::PoisonCatchUp,
                "poison-state" => Behavior::PoisonState,
                _ => return Err(Self::expected(s)),
            },
            Some(("scale", f)) => Behavior::Scale(number(f)?),
            Some(("noise", sigma)) => Behavior::Noise(number(sigma)?),
            Some(("ipm", eps)) => Behavior::Ipm(number(eps)?),
            Some(("stale", k)) => Behavior::Stale(
                k.parse::<u32>()
                    .ok()
                    .filter(|k| (1..=64).contains(k))
                    .ok_or_else(|| format!("'{k}' is not a number of rounds from 1 to 64"))?,
            ),
            _ => return Err(Self::expected(s)),
        })
    }
}

impl Behavior {
    fn expected(s: &str) -> String {
        format!(
            "'{s}' (honest, sign-flip, scale:F, noise:SIGMA, zero, nan, ipm:EPS, stale:K, \
             bad-part, bad-leader, lie-throughput, forge-hash, poison-catch-up or poison-state)"
        )
    }
}

/// One peer's behavior from a point in time on.
#[derive(Clone, Debug)]
pub struct Attack {
    behavior: Behavior,
    /// Honest before this.
    from: Duration,
    /// Whether it attacks now (as of the last [`Attack::tick`]).
    on: bool,
    /// Its past contributions (`stale:K`).
    past: VecDeque<Vec<f32>>,
    /// Its own noise, so that an attacker draws nothing from its owner's randomness.
    rng: SeededRng,
}

impl Attack {
    /// `behavior` from `from` on; `seed` feeds its noise.
    pub fn new(behavior: Behavior, from: Duration, seed: u64) -> Self {
        Attack {
            behavior,
            from,
            on: false,
            past: VecDeque::new(),
            rng: SeededRng::new(seed ^ 0x6e6f_6973_6521),
        }
    }

    /// Whether it attacks at some point.
    pub fn is_attacker(&self) -> bool {
        self.behavior != Behavior::Honest
    }

    /// The time is `now`.
    pub fn tick(&mut self, now: Duration) {
        self.on = self.is_attacker() && now >= self.from;
    }

    /// Its averaging contribution (the device's result) as it hands it to its peer.
    pub fn contribution(&mut self, values: &mut Vec<f32>) {
        if let Behavior::Stale(k) = self.behavior {
            // Remembered from the start, so that it has old ones when it turns.
            self.past.push_back(values.clone());
            if self.past.len() > k as usize + 1 {
                self.past.pop_front();
            }
            if self.on && self.past.len() == k as usize + 1 {
                values.clone_from(&self.past[0]);
            }
            return;
        }
        if !self.on {
            return;
        }
        match self.behavior {
            Behavior::SignFlip => values.iter_mut().for_each(|v| *v = -*v),
            Behavior::Scale(f) => values.iter_mut().for_each(|v| *v *= f),
            Behavior::Ipm(eps) => values.iter_mut().for_each(|v| *v *= -eps),
            Behavior::Zero => values.iter_mut().for_each(|v| *v = 0.0),
            Behavior::Nan => {
                if let Some(v) = values.first_mut() {
                    *v = f32::NAN;
                }
            }
            Behavior::Noise(sigma) => {
                for v in values.iter_mut() {
                    *v += sigma * self.gaussian();
                }
            }
            _ => {}
        }
    }

    /// Whether it negates the averaged parts it owns.
    pub fn forges_parts(&self) -> bool {
        self.on && self.behavior == Behavior::BadPart
    }

    /// Whether, leading a round, it leaves every other replica out.
    pub fn excludes_others(&self) -> bool {
        self.on && self.behavior == Behavior::BadLeader
    }

    /// Whether the state it serves should be poisoned (by its owner, who knows the layout).
    pub fn poisons_state(&self) -> bool {
        self.on && self.behavior == Behavior::PoisonState
    }

    /// An action as it carries it out.
    pub fn outgoing(&mut self, action: &mut Action) {
        if !self.on {
            return;
        }
        match (self.behavior, action) {
            (Behavior::LieThroughput, Action::Announce(a)) => {
                a.throughput *= 100.0;
                a.queue = 0;
            }
            (Behavior::ForgeHash, Action::Announce(a)) if a.params_hash.is_some() => {
                a.params_hash = Some(self.rng.next_u64());
            }
            (
                Behavior::PoisonCatchUp,
                Action::Send {
                    msg: Message::CatchUp { data, .. },
                    ..
                },
            ) if !data.is_empty() => {
                // Re-encoded losslessly: a receiver decodes whatever codec a tensor names.
                if let Ok((_, values)) = crate::codec::decode_to_vec(data) {
                    let negated: Vec<f32> = values.iter().map(|v| -v).collect();
                    if let Ok(forged) =
                        crate::codec::encode_to_vec(crate::Codec::Fp32, &negated, &[negated.len()])
                    {
                        *data = forged;
                    }
                }
            }
            _ => {}
        }
    }

    /// A standard normal draw (Box-Muller).
    fn gaussian(&mut self) -> f32 {
        let u1 = ((self.rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let u2 = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }
}
