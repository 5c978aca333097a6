//! shoal-netsim: a swarm on one machine, reproducible from a seed.
//!
//! A discrete-event simulator with a virtual clock that drives the very same protocol state
//! machines (`shoal-protocol`) and compute (`shoal-compute`) as the node, over modelled links
//! (latency, jitter, bandwidth with queueing, loss, partitions) and modelled devices. Compute
//! runs for real on the CPU so loss curves are real; its duration comes from the device model.
//! For models too large to train here, compute can be modelled instead ([`modelled`]): the
//! same jobs answered with random tensors, for timing and traffic without a loss; activations
//! at their real size, parameter-sized tensors scaled down to a bounded length and charged
//! their real size on the links, so memory follows the number of peers, not the model.
//!
//! This crate must never re-implement a protocol decision (if the simulator needs one, the
//! state machine makes it), never read the wall clock, and never use randomness that does not
//! derive from the scenario's seed: the same scenario and seed give the same event trace.

pub mod device;
pub mod link;
pub mod modelled;
pub mod report;
pub mod scenario;
pub mod sim;

pub use device::DeviceProfile;
pub use link::LinkProfile;
pub use modelled::ModelledStage;
pub use report::Report;
pub use scenario::{Compute, Scenario, Setup};
pub use sim::{Progress, simulate};

/// The entry of a preset table called `name`, or an error that lists the known names.
fn preset<T: Copy>(
    table: &[T],
    name: &str,
    kind: &str,
    name_of: impl Fn(&T) -> &'static str,
) -> Result<T, String> {
    table
        .iter()
        .find(|t| name_of(t) == name)
        .copied()
        .ok_or_else(|| {
            let known: Vec<&str> = table.iter().map(&name_of).collect();
            format!("unknown {kind} '{name}' (known: {})", known.join(", "))
        })
}
