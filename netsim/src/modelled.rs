//! Modelled compute: a stage replica that does no arithmetic, for scenarios whose model is too
//! large to train for real on the simulating machine.
//!
//! It answers every compute job the protocol asks for with tensors of the sizes the real
//! replica would produce (activations, input gradients, gradients, exported states), filled
//! with seeded random values so the codecs see data like real data, except that
//! parameter-sized ones hold the values the simulator's stage costs say (scaled down for a
//! large model, see `StageCosts::param_scale`; the links are charged their real size). Parameter hashes follow the same rule as real replicas: equal
//! when two replicas applied the same updates from the same start, so agreement checks, state
//! transfers and re-syncs work unchanged. What it cannot give is a loss curve: the loss it
//! reports is a constant, and the simulator leaves it out of the report.
//!
//! Durations come from the device model either way, so a run's timing, traffic and protocol
//! decisions are those of the real model; only the numbers inside the tensors are not.

use shoal_compute::{ModelConfig, exported_state_len};
use shoal_protocol::swarm::{ComputeDone, Input, Job, Output, RunConfig, SeededRng, StageCosts};
use std::collections::BTreeMap;
use xxhash_rust::xxh3::{Xxh3Default, xxh3_64};

/// One peer's modelled stage replica.
pub struct ModelledStage {
    config: RunConfig,
    model: ModelConfig,
    /// Values of each stage's parameter-sized tensors.
    params: Vec<usize>,
    rng: SeededRng,
    /// Random values that tensors are cut from (filling every tensor value by value would
    /// cost more than the codecs it is made for).
    noise: Vec<f32>,
    /// The run's gradient signal, the same table on every peer (see [`ModelledStage::gradient`]).
    signal: Vec<f32>,
    /// The replica served, if any.
    replica: Option<Replica>,
}

struct Replica {
    stage: u32,
    params: usize,
    hash: u64,
    /// DiLoCo: the hash of the parameters the current outer round started from.
    anchor: u64,
    outer_steps: u64,
    /// Rows of microbatches past their forward pass, by attempt id.
    forwarded: BTreeMap<u64, u32>,
    /// Rows of microbatches past their backward pass, not yet committed.
    pending: BTreeMap<u64, u32>,
    /// Samples committed to the step being accumulated.
    samples: f64,
}

/// Length of the noise tensors are cut from: prime, so that its period does not line up with
/// rows of a tensor.
const NOISE_LEN: usize = 65_521;

/// Mixed into the run's seed for its signal table.
const SIGNAL_SALT: u64 = 0x5349_474e_414c_5f5f;

/// The common signal's size against one sample's noise: a gradient of a few samples is mostly
/// noise, as a real one is.
const SIGNAL: f32 = 0.5;

/// Magic of a modelled state (its bytes after this and the two hashes are filler).
const STATE_MAGIC: &[u8; 8] = b"SHOALSIM";

impl ModelledStage {
    /// A modelled replica for `config` whose stages hold `costs.params` values (scaled
    /// down from the model's where `costs.param_scale` says so); `seed` fills its tensors.
    pub fn new(config: RunConfig, costs: &StageCosts, seed: u64) -> Result<Self, String> {
        let model = shoal_worker::model_of(&config)?;
        let mut rng = SeededRng::new(seed);
        let mut noise = vec![0.0; NOISE_LEN];
        fill_random(&mut noise, &mut rng);
        let mut signal = vec![0.0; NOISE_LEN];
        fill_random(&mut signal, &mut SeededRng::new(config.seed ^ SIGNAL_SALT));
        Ok(ModelledStage {
            config,
            model,
            params: costs.params.clone(),
            rng,
            noise,
            signal,
            replica: None,
        })
    }

    /// Runs `job`; a failure is reported to the protocol as `ComputeDone::Failed`.
    pub fn run(&mut self, job: Job) -> ComputeDone {
        self.try_run(job)
            .unwrap_or_else(|error| ComputeDone::Failed { error })
    }

    fn build(&self, stage: u32, hash: u64, anchor: u64, outer_steps: u64) -> Replica {
        Replica {
            stage,
            params: self.params.get(stage as usize).copied().unwrap_or(0),
            hash,
            anchor,
            outer_steps,
            forwarded: BTreeMap::new(),
            pending: BTreeMap::new(),
            samples: 0.0,
        }
    }

    fn serving(&mut self) -> Result<&mut Replica, String> {
        self.replica.as_mut().ok_or_else(|| "no stage yet".into())
    }

    /// Values of one microbatch's activations (or their gradient) at a stage boundary.
    fn boundary_values(&self, rows: u32) -> usize {
        rows as usize * self.config.seq as usize * self.model.width
    }

    /// A gradient summed over `samples` samples at parameters hashing to `hash`, shaped as a
    /// real one is for what the protocol does with it (robust averaging, the evidence for
    /// bans): every sample shares the signal of the parameters (a window of the run's signal
    /// table that the hash picks, so replicas at the same parameters share it) and adds noise
    /// of its own, so the sum grows as `samples` x signal + sqrt(`samples`) x noise.
    fn gradient(&mut self, n: usize, hash: u64, samples: f64) -> Vec<f32> {
        let noise = self.random(n);
        let at = (hash % NOISE_LEN as u64) as usize;
        let (signal, spread) = (samples as f32 * SIGNAL, samples.sqrt() as f32);
        noise
            .iter()
            .enumerate()
            .map(|(i, e)| signal * self.signal[(at + i) % NOISE_LEN] + spread * e)
            .collect()
    }

    /// `n` random values: the noise, from a random place on, round and round.
    fn random(&mut self, n: usize) -> Vec<f32> {
        let mut v = Vec::with_capacity(n);
        let mut at = (self.rng.next_u64() % NOISE_LEN as u64) as usize;
        while v.len() < n {
            let take = (n - v.len()).min(NOISE_LEN - at);
            v.extend_from_slice(&self.noise[at..at + take]);
            at = 0;
        }
        v
    }

    fn try_run(&mut self, job: Job) -> Result<ComputeDone, String> {
        Ok(match job {
            Job::Init { stage } => {
                // Every replica of a stage starts from the same parameters.
                let hash = xxh3_64(
                    &[
                        self.config.seed.to_le_bytes(),
                        u64::from(stage).to_le_bytes(),
                    ]
                    .concat(),
                );
                self.replica = Some(self.build(stage, hash, hash, 0));
                ComputeDone::Ready { hash }
            }
            Job::Restart { stage } => {
                let held = self.replica.as_ref().filter(|r| r.stage == stage);
                match held.map(|r| (r.hash, r.anchor, r.outer_steps)) {
                    Some((hash, anchor, outer_steps)) => {
                        self.replica = Some(self.build(stage, hash, anchor, outer_steps));
                        ComputeDone::Ready { hash }
                    }
                    None => return self.try_run(Job::Init { stage }),
                }
            }
            Job::Import { stage, state } => {
                let field = |i: usize| {
                    state
                        .get(8 + 8 * i..16 + 8 * i)
                        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
                };
                let (Some(hash), Some(anchor), Some(outer_steps)) = (field(0), field(1), field(2))
                else {
                    return Err("the saved state is too short".into());
                };
                if &state[..8] != STATE_MAGIC {
                    return Err("the saved state is not a modelled stage's".into());
                }
                self.replica = Some(self.build(stage, hash, anchor, outer_steps));
                ComputeDone::Ready { hash }
            }
            Job::Forward {
                id,
                rows,
                input,
                held_out,
                ..
            } => {
                let last = self.serving()?.stage + 1 == self.config.stages;
                if let Input::Activations(acts) = &input {
                    let want = self.boundary_values(rows);
                    if acts.len() != want {
                        return Err(format!(
                            "activations of {} values, expected {want}",
                            acts.len()
                        ));
                    }
                }
                let output = if last {
                    // A uniform guess: the loss is not computed.
                    Output::Loss((self.model.vocab as f32).ln())
                } else {
                    Output::Activations(self.random(self.boundary_values(rows)))
                };
                // A held-out pass has no backward pass to wait for.
                if !held_out {
                    self.serving()?.forwarded.insert(id, rows);
                }
                ComputeDone::Forward { id, output }
            }
            Job::Backward { id, grad, rows } => {
                let first = {
                    let r = self.serving()?;
                    if r.forwarded.remove(&id).is_none() {
                        return Err(format!(
                            "no forward pass of microbatch {id} to go back through"
                        ));
                    }
                    r.pending.insert(id, rows);
                    r.stage == 0
                };
                if let Some(g) = &grad {
                    let want = self.boundary_values(rows);
                    if g.len() != want {
                        return Err(format!(
                            "an output gradient of {} values, expected {want}",
                            g.len()
                        ));
                    }
                }
                ComputeDone::Backward {
                    id,
                    grad: (!first).then(|| self.random(self.boundary_values(rows))),
                }
            }
            Job::Commit { id } => {
                let r = self.serving()?;
                if let Some(rows) = r.pending.remove(&id) {
                    r.samples += f64::from(rows);
                }
                ComputeDone::Done
            }
            Job::Abort { id } => {
                if let Some(r) = self.replica.as_mut() {
                    r.forwarded.remove(&id);
                    r.pending.remove(&id);
                }
                ComputeDone::Done
            }
            Job::TakeGradient => {
                let (params, samples, hash) = {
                    let r = self.serving()?;
                    (r.params, std::mem::take(&mut r.samples), r.hash)
                };
                let values = if samples > 0.0 {
                    self.gradient(params, hash, samples)
                } else {
                    vec![0.0; params]
                };
                ComputeDone::Gradient { values, samples }
            }
            Job::TakePseudoGradient => {
                // The replica's move since the outer round's anchor: mostly the signal of the
                // parameters it started from.
                let (params, anchor) = {
                    let r = self.serving()?;
                    (r.params, r.anchor)
                };
                ComputeDone::Gradient {
                    values: self.gradient(params, anchor, 4.0),
                    samples: 0.0,
                }
            }
            Job::Step { grad } => {
                let r = self.serving()?;
                check_params(r, grad.len())?;
                r.hash = hash_update(r.hash, &grad);
                ComputeDone::Stepped {
                    hash: r.hash,
                    alignments: Vec::new(),
                }
            }
            Job::LocalStep => {
                let r = self.serving()?;
                r.samples = 0.0;
                r.hash = xxh3_64(&[r.hash.to_le_bytes(), *b"localstp"].concat());
                ComputeDone::Stepped {
                    hash: r.hash,
                    alignments: Vec::new(),
                }
            }
            Job::OuterStep { avg, .. } => {
                let r = self.serving()?;
                check_params(r, avg.len())?;
                r.anchor = hash_update(r.anchor, &avg);
                r.hash = r.anchor;
                r.outer_steps += 1;
                ComputeDone::Stepped {
                    hash: r.hash,
                    alignments: Vec::new(),
                }
            }
            Job::Export { to } => {
                let (params, fields) = {
                    let r = self.serving()?;
                    (r.params, [r.hash, r.anchor, r.outer_steps])
                };
                let outer_momentum = fields[2] > 0;
                let len = exported_state_len(params, outer_momentum);
                let mut bytes = Vec::with_capacity(len);
                bytes.extend_from_slice(STATE_MAGIC);
                for f in fields {
                    bytes.extend_from_slice(&f.to_le_bytes());
                }
                // Filled from the run's signal table at a place the state picks: replicas at
                // the same parameters export the same bytes, as real ones do (a joiner pulls
                // from several of them at once only then).
                let mut at = (fields[0] ^ fields[1].rotate_left(17) ^ fields[2]) % NOISE_LEN as u64;
                while bytes.len() < len {
                    bytes.extend_from_slice(&self.signal[at as usize].to_le_bytes());
                    at = (at + 1) % NOISE_LEN as u64;
                }
                bytes.truncate(len);
                ComputeDone::State { to, bytes }
            }
            Job::Checkpoint { .. } => ComputeDone::Done,
        })
    }
}

fn check_params(r: &Replica, len: usize) -> Result<(), String> {
    if len == r.params {
        Ok(())
    } else {
        Err(format!(
            "an update of {len} values for {} parameters",
            r.params
        ))
    }
}

/// The hash of parameters `hash` after an update by `values`: equal inputs, equal hashes.
fn hash_update(hash: u64, values: &[f32]) -> u64 {
    let mut h = Xxh3Default::new();
    h.update(&hash.to_le_bytes());
    for chunk in values.chunks(4096) {
        let bytes: Vec<u8> = chunk.iter().flat_map(|x| x.to_le_bytes()).collect();
        h.update(&bytes);
    }
    h.digest()
}

/// Uniform values in [-1, 1), two per draw of the generator.
fn fill_random(values: &mut [f32], rng: &mut SeededRng) {
    const SCALE: f32 = 1.0 / (1u32 << 23) as f32;
    for pair in values.chunks_mut(2) {
        let bits = rng.next_u64();
        for (i, v) in pair.iter_mut().enumerate() {
            let x = ((bits >> (32 * i)) as u32) >> 8;
            *v = x as f32 * SCALE - 1.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_protocol::swarm::PeerKey;

    fn costs(config: &RunConfig) -> StageCosts {
        let model = shoal_worker::model_of(config).unwrap();
        shoal_worker::stage_costs(config, &model, &shoal_protocol::swarm::Timing::default())
    }

    fn config() -> RunConfig {
        crate::Scenario::parse(
            "[run]\npreset = \"mini\"\nstages = 2\nglobal_batch = 8\nmicrobatch = 2\nsteps = 1\n\
             compute = \"modelled\"\n[[peers]]\ncount = 1\ndevice = \"t4\"\nlink = \"metro\"\n",
        )
        .unwrap()
        .config
    }

    #[test]
    fn tensors_have_the_real_replicas_sizes() {
        let config = config();
        let model = shoal_worker::model_of(&config).unwrap();
        let boundary = 2 * config.seq as usize * model.width;
        let mut first = ModelledStage::new(config.clone(), &costs(&config), 1).unwrap();
        let mut last = ModelledStage::new(config.clone(), &costs(&config), 2).unwrap();
        first.run(Job::Init { stage: 0 });
        last.run(Job::Init { stage: 1 });
        let ComputeDone::Forward {
            output: Output::Activations(acts),
            ..
        } = first.run(Job::Forward {
            id: 7,
            rows: 2,
            sample: 0,
            input: Input::Tokens,
            held_out: false,
        })
        else {
            panic!("the first stage forwards activations")
        };
        assert_eq!(acts.len(), boundary);
        let ComputeDone::Forward {
            output: Output::Loss(_),
            ..
        } = last.run(Job::Forward {
            id: 7,
            rows: 2,
            sample: 0,
            input: Input::Activations(acts),
            held_out: false,
        })
        else {
            panic!("the last stage reports a loss")
        };
        let ComputeDone::Backward { grad: Some(g), .. } = last.run(Job::Backward {
            id: 7,
            grad: None,
            rows: 2,
        }) else {
            panic!("the last stage sends an input gradient back")
        };
        assert_eq!(g.len(), boundary);
        let ComputeDone::Backward { grad: None, .. } = first.run(Job::Backward {
            id: 7,
            grad: Some(g),
            rows: 2,
        }) else {
            panic!("the first stage has no input gradient")
        };
        first.run(Job::Commit { id: 7 });
        let ComputeDone::Gradient { values, samples } = first.run(Job::TakeGradient) else {
            panic!("a gradient")
        };
        let spec = shoal_compute::StageSpec { index: 0, count: 2 };
        assert_eq!(values.len(), spec.param_count(&model));
        assert_eq!(samples, 2.0);
        let ComputeDone::State { bytes, .. } = first.run(Job::Export { to: PeerKey(1) }) else {
            panic!("a state")
        };
        assert_eq!(bytes.len(), exported_state_len(values.len(), false));
    }

    /// A replica that restarts its stage keeps the parameters it stepped to; restarting
    /// another stage builds that one fresh.
    #[test]
    fn a_restart_keeps_the_state_held() {
        let config = config();
        let mut a = ModelledStage::new(config.clone(), &costs(&config), 1).unwrap();
        let ComputeDone::Ready { hash: fresh } = a.run(Job::Init { stage: 1 }) else {
            panic!()
        };
        let n = a.replica.as_ref().unwrap().params;
        let grad = a.random(n);
        let ComputeDone::Stepped { hash: stepped, .. } = a.run(Job::Step { grad }) else {
            panic!()
        };
        assert_ne!(stepped, fresh);
        assert!(matches!(
            a.run(Job::Restart { stage: 1 }),
            ComputeDone::Ready { hash } if hash == stepped
        ));
        let ComputeDone::Ready { hash: other } = a.run(Job::Restart { stage: 0 }) else {
            panic!()
        };
        let mut b = ModelledStage::new(config.clone(), &costs(&config), 2).unwrap();
        assert!(matches!(
            b.run(Job::Init { stage: 0 }),
            ComputeDone::Ready { hash } if hash == other
        ));
    }

    #[test]
    fn replicas_agree_exactly_when_they_took_the_same_steps() {
        let config = config();
        let mut a = ModelledStage::new(config.clone(), &costs(&config), 1).unwrap();
        let mut b = ModelledStage::new(config.clone(), &costs(&config), 2).unwrap();
        let ComputeDone::Ready { hash: ha } = a.run(Job::Init { stage: 1 }) else {
            panic!()
        };
        let ComputeDone::Ready { hash: hb } = b.run(Job::Init { stage: 1 }) else {
            panic!()
        };
        assert_eq!(ha, hb);
        let n = a.replica.as_ref().unwrap().params;
        let grad = a.random(n);
        let step = |s: &mut ModelledStage, grad: &[f32]| match s.run(Job::Step {
            grad: grad.to_vec(),
        }) {
            ComputeDone::Stepped { hash, .. } => hash,
            other => panic!("{other:?}"),
        };
        let (sa, sb) = (step(&mut a, &grad), step(&mut b, &grad));
        assert_eq!(sa, sb);
        assert_ne!(sa, ha);
        // A state transfer carries the hash; a different update gives a different one.
        let ComputeDone::State { bytes, .. } = a.run(Job::Export { to: PeerKey(2) }) else {
            panic!()
        };
        let ComputeDone::State { bytes: theirs, .. } = b.run(Job::Export { to: PeerKey(2) }) else {
            panic!()
        };
        assert!(
            bytes == theirs,
            "replicas at the same parameters export the same bytes"
        );
        let mut c = ModelledStage::new(config.clone(), &costs(&config), 3).unwrap();
        assert!(matches!(
            c.run(Job::Import { stage: 1, state: bytes }),
            ComputeDone::Ready { hash } if hash == sa
        ));
        let other = c.random(n);
        assert_ne!(step(&mut c, &other), step(&mut a, &grad));
        assert!(matches!(
            a.run(Job::Step { grad: vec![0.0; 3] }),
            ComputeDone::Failed { .. }
        ));
    }
}
