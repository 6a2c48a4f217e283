//! # dejavu-sim
//!
//! A deterministic fault simulator for the DéjàVu control plane: one thread, one seeded RNG,
//! virtual time. It drives the real state machines of `dejavu-proto` with a fake engine whose KV
//! and tokens are pure functions of their inputs ([`engine`]), over a faulty network, through
//! crashes, pauses, partitions and controller restarts ([`sim`]), and checks the reliability
//! contract after every tick: no acknowledged KV lost, bit-identical tokens delivered exactly once,
//! at most one owner per (stage, epoch), bounded recompute, every request finishes after healing.
//! [`liveness`] drives the machine the running controller is built on
//! ([`dejavu_proto::liveness::Liveness`]) through process kills, pauses, replayed beats, an
//! unwritable state file and controller restarts. [`recovery`] carries out the recovery machine the
//! cluster supervisor drives ([`dejavu_proto::recovery::Recovery`]) on a model ring whose processes
//! die during the recovery itself. [`forwarding`] drives the machine every sidecar forwards its
//! engine's KV with ([`dejavu_proto::forwarding::Forwarding`]) against a successor that fails,
//! refuses stale chunks and is replaced in the middle of a forward.
//!
//! Replay a seed with `cargo run --release -p dejavu-sim -- --seed N`; with `DEJAVU_SIM_TRACE=1` it
//! prints crashes, recovery plans and the computations of microbatch 0 as they happen.

pub mod engine;
pub mod forwarding;
pub mod liveness;
pub mod recovery;
pub mod sim;

pub use forwarding::{run_forwarding_seed, ForwardingReport, ForwardingSimConfig};
pub use liveness::{replay_journal, run_liveness_seed, LivenessReport, LivenessSimConfig};
pub use recovery::{run_recovery_seed, RecoveryReport, RecoverySimConfig};
pub use sim::{Faults, Report, Sim, SimConfig};

/// Runs one seed with `cfg`.
pub fn run_seed(seed: u64, cfg: &SimConfig) -> Report {
    Sim::new(seed, cfg.clone()).run()
}
