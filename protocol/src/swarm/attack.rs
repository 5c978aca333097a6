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
//! ([`Attack::excludes_others`]); and the messages, announcements and compute jobs it hands
//! out ([`Attack::outgoing`]). A state it serves is poisoned by its owner, which knows the
//! state's layout ([`Attack::poisons_state`]).

use super::SeededRng;
use super::interface::{Action, Input, Job};
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
    /// Claims this many times the samples it computed its averaging contribution on (its
    /// values are honest): its per-sample mean shrinks toward zero while it takes a typical
    /// member's weight, diluting every update without pointing against it.
    Inflate(f32),
    /// Puts NaN in its averaging contribution.
    Nan,
    /// Inner-product manipulation: sends minus this fraction of its estimate of the honest
    /// mean (its own contribution: it sees no other).
    Ipm(f32),
    /// Sends its contribution of this many rounds ago (honest until it has one).
    Stale(u32),
    /// "A little is enough": moves each value of its contribution against its sign by this
    /// many estimated standard deviations of the replicas' spread, small enough to hide in
    /// it. It sees no other replica's values, so it estimates the spread of a value from how
    /// much its own moved since the previous round (two draws of the same spread).
    Alie(f32),
    /// Trains on wrong targets where it computes a loss (the last stage): the next tokens of
    /// another sample than its inputs', as a volunteer with mislabeled data would. Its
    /// gradients, and the activation gradients it sends back along each route, pull every
    /// stage toward them. (A driver cannot mislabel: targets do not travel, the last stage
    /// reads them from the sample.)
    LabelFlip,
    /// Negates the activation gradients it sends back to the stage before (it computes and
    /// averages honestly): a hop's backward pass is recomputed by nobody, so only the shares
    /// of the replicas upstream that used them show it.
    FlipBackward,
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
    /// Speaks for this many more identities that cost it nothing: they announce themselves
    /// as replicas of its stage and never work. It and they announce one forged parameter
    /// hash per round and accuse the honest replicas of its stage (who those are is the
    /// simulator's to say: it knows the colluders). It computes honestly.
    Sybil(u32),
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
                "alie" => Behavior::Alie(1.0),
                "label-flip" => Behavior::LabelFlip,
                "flip-backward" => Behavior::FlipBackward,
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
            Some(("inflate", f)) => Behavior::Inflate(number(f)?),
            Some(("alie", z)) => Behavior::Alie(number(z)?),
            Some(("sybil", n)) => Behavior::Sybil(
                n.parse::<u32>()
                    .ok()
                    .filter(|n| (1..=1000).contains(n))
                    .ok_or_else(|| format!("'{n}' is not a number of identities from 1 to 1000"))?,
            ),
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
            "'{s}' (honest, sign-flip, scale:F, noise:SIGMA, zero, inflate:F, nan, ipm:EPS, \
             alie[:Z], stale:K, label-flip, flip-backward, bad-part, bad-leader, lie-throughput, forge-hash, \
             poison-catch-up, poison-state or sybil:N)"
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
    /// Its past contributions (`stale:K`, `alie`).
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

    /// How many times the samples it computed its averaging contribution on it claims.
    pub fn claim(&self) -> f64 {
        match self.behavior {
            Behavior::Inflate(f) if self.on => f64::from(f),
            _ => 1.0,
        }
    }

    /// Its averaging contribution (the device's result) as it hands it to its peer.
    pub fn contribution(&mut self, values: &mut Vec<f32>) {
        let remembered = match self.behavior {
            Behavior::Stale(k) => k as usize + 1,
            Behavior::Alie(_) => 2,
            _ => 0,
        };
        if remembered > 0 {
            // Remembered from the start, so that it has old ones when it turns.
            self.past.push_back(values.clone());
            if self.past.len() > remembered {
                self.past.pop_front();
            }
        }
        if let Behavior::Stale(_) = self.behavior {
            if self.on && self.past.len() == remembered {
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
            Behavior::Alie(z) if self.past.len() == 2 && self.past[0].len() == values.len() => {
                for (v, p) in values.iter_mut().zip(&self.past[0]) {
                    let spread = (*v - p).abs() * std::f32::consts::FRAC_1_SQRT_2;
                    *v -= z * spread * v.signum();
                }
            }
            _ => {}
        }
    }

    /// The gradient of a hop's input (its backward pass's result) as it sends it back.
    pub fn activation_gradient(&self, values: &mut [f32]) {
        if self.on && self.behavior == Behavior::FlipBackward {
            values.iter_mut().for_each(|v| *v = -*v);
        }
    }

    /// Whether it attacks now.
    pub fn attacking(&self) -> bool {
        self.on
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

    /// The identities it speaks for now, beside its own (`sybil:N`).
    pub fn sybils(&self) -> u32 {
        match self.behavior {
            Behavior::Sybil(n) if self.on => n,
            _ => 0,
        }
    }

    /// An action as it carries it out.
    pub fn outgoing(&mut self, action: &mut Action) {
        if !self.on {
            return;
        }
        match (self.behavior, action) {
            (
                Behavior::LabelFlip,
                Action::Compute(Job::Forward {
                    sample,
                    input: Input::Activations(_),
                    ..
                }),
            ) => {
                // Only the last stage reads targets from an activations job's sample.
                *sample = sample.rotate_left(32) ^ 0x6c61_6265_6c73;
            }
            (Behavior::LieThroughput, Action::Announce(a)) => {
                a.throughput *= 100.0;
                a.queue = 0;
            }
            (Behavior::ForgeHash, Action::Announce(a)) if a.params_hash.is_some() => {
                a.params_hash = Some(self.rng.next_u64());
            }
            (Behavior::Sybil(_), Action::Announce(a)) if a.params_hash.is_some() => {
                // One hash per round that every colluder computes alike.
                a.params_hash =
                    Some(a.round.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x7379_6279_6c21);
            }
            (
                Behavior::PoisonCatchUp,
                Action::Send {
                    msg: Message::CatchUp { data, .. },
                    ..
                },
            ) if !data.is_empty() => {
                // Each part negated and re-encoded losslessly: a receiver decodes whatever
                // codec a tensor names.
                let forged: Option<Vec<Vec<u8>>> = super::agreement::parts_of(data).map(|parts| {
                    parts
                        .iter()
                        .filter_map(|p| {
                            let (_, values) = crate::codec::decode_to_vec(p).ok()?;
                            let negated: Vec<f32> = values.iter().map(|v| -v).collect();
                            let n = negated.len();
                            crate::codec::encode_to_vec(crate::Codec::Fp32, &negated, &[n]).ok()
                        })
                        .collect()
                });
                if let Some(parts) = forged {
                    *data = super::agreement::frame_parts(parts.iter().map(Vec::as_slice));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::swarm::interface::{Input, Job};

    fn on(behavior: Behavior) -> Attack {
        let mut a = Attack::new(behavior, Duration::ZERO, 1);
        a.tick(Duration::ZERO);
        a
    }

    #[test]
    fn behaviors_parse_and_bad_ones_say_what_is_expected() {
        for (text, behavior) in [
            ("alie", Behavior::Alie(1.0)),
            ("alie:2.5", Behavior::Alie(2.5)),
            ("label-flip", Behavior::LabelFlip),
            ("flip-backward", Behavior::FlipBackward),
            ("stale:4", Behavior::Stale(4)),
            ("scale:-4", Behavior::Scale(-4.0)),
            ("sybil:40", Behavior::Sybil(40)),
        ] {
            assert_eq!(text.parse::<Behavior>(), Ok(behavior));
        }
        for bad in ["alie:x", "stale:0", "flip", "scale:inf", "sybil:0"] {
            let e = bad.parse::<Behavior>().unwrap_err();
            assert!(e.contains(bad.split(':').next_back().unwrap()), "{e}");
        }
    }

    #[test]
    fn alie_moves_each_value_against_its_sign_by_its_estimated_spread() {
        let mut a = on(Behavior::Alie(2.0));
        let mut first = vec![1.0, -1.0, 0.5];
        a.contribution(&mut first);
        assert_eq!(first, [1.0, -1.0, 0.5], "no spread known yet");
        let mut second = vec![1.0, -3.0, 0.5 + 2f32.sqrt()];
        a.contribution(&mut second);
        // Spread estimates |difference| / sqrt(2): 0, sqrt(2), 1.
        let expected = [1.0, -3.0 + 2.0 * 2f32.sqrt(), 0.5 + 2f32.sqrt() - 2.0];
        for (v, e) in second.iter().zip(expected) {
            assert!((v - e).abs() < 1e-5, "{second:?} against {expected:?}");
        }
    }

    #[test]
    fn flip_backward_negates_the_activation_gradients_it_sends_from_its_time_on() {
        let mut later = Attack::new(Behavior::FlipBackward, Duration::from_secs(5), 1);
        let mut grad = vec![0.5, -2.0];
        later.tick(Duration::from_secs(1));
        later.activation_gradient(&mut grad);
        assert_eq!(grad, [0.5, -2.0]);
        later.tick(Duration::from_secs(5));
        later.activation_gradient(&mut grad);
        assert_eq!(grad, [-0.5, 2.0]);
        // Its averaging contributions stay honest.
        let mut values = vec![1.0, 3.0];
        later.contribution(&mut values);
        assert_eq!(values, [1.0, 3.0]);
    }

    #[test]
    fn label_flip_changes_the_targets_of_the_last_stage_only() {
        let mut a = on(Behavior::LabelFlip);
        let job = |input| {
            Action::Compute(Job::Forward {
                id: 1,
                rows: 2,
                sample: 77,
                input,
                held_out: false,
            })
        };
        // A first stage's tokens and targets come from one sample: nothing to mislabel.
        let mut first = job(Input::Tokens);
        a.outgoing(&mut first);
        assert_eq!(first, job(Input::Tokens));
        let mut last = job(Input::Activations(vec![0.5; 4]));
        a.outgoing(&mut last);
        let Action::Compute(Job::Forward { sample, .. }) = last else {
            panic!("a forward job")
        };
        assert_ne!(sample, 77);
        // Honest until its time.
        let mut later = Attack::new(Behavior::LabelFlip, Duration::from_secs(5), 1);
        later.tick(Duration::from_secs(1));
        let mut early = job(Input::Activations(vec![0.5; 4]));
        later.outgoing(&mut early);
        assert_eq!(early, job(Input::Activations(vec![0.5; 4])));
    }
}
