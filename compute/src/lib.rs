//! shoal-compute: the numerical core of shoal.
//!
//! A GPT-2 style decoder with hand-written forward and backward passes per layer (in the spirit
//! of llm.c), cut into contiguous pipeline [`Stage`]s, the mean cross-entropy loss, AdamW with a
//! warmup + cosine schedule, and the data the model trains on (byte tokenizer, a synthetic corpus
//! with a known entropy rate, text files, deterministic sharding).
//!
//! All tensor math goes through the [`Backend`] trait, whose buffers live on a device; the model
//! code never touches their contents directly, so GPU backends fit behind the same trait. The CPU
//! backend ([`CpuBackend`]) is the reference every other backend is checked against.
//!
//! This crate must never perform network IO, read a clock for any decision, or hold global
//! state: given the same seeds and inputs it produces the same numbers. It knows nothing about
//! peers, routes or the wire format.

pub mod backend;
pub mod config;
pub mod data;
pub mod file;
pub mod memory;
pub mod optim;
pub mod pipeline;
pub mod replica;
pub mod rng;
pub mod stage;

pub use backend::{AnyBackend, Backend, BackendChoice, BackendError, CpuBackend};
pub use config::{ModelConfig, Preset};
pub use data::{Batch, Corpus, DataError, DataLoader, Shard};
pub use file::write_atomic;
pub use memory::{MemoryUse, StageMemory};
pub use optim::{AdamW, LrSchedule};
pub use pipeline::{Coupling, LocalPipeline, StepStats, Transit};
pub use replica::{ReplicaError, StageReplica, exported_state_len, poisoned_state};
pub use stage::{MicrobatchId, OffloadTraffic, Residency, Stage, StageError, StageSpec};
