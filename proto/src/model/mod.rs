//! The paper's pipeline as a closed model: a pipeline controller and its workers, which compute
//! the tokens themselves (through their driver), replicate per step, deliver each token exactly
//! once and recover in the paper's 4 steps. The simulator (`dejavu-sim`'s `sim` module) checks the
//! protocol's design with it: no acknowledged KV lost, bit-identical tokens delivered exactly
//! once, bounded recompute.
//!
//! The daemon does not run this model: its pipeline is the reference engine's, and its control
//! decisions come from the running machines, [`crate::Controller`] and [`crate::Worker`], which
//! the simulator drives too. The two share the recovery plan ([`crate::plan::ring`]) and the epoch
//! rule ([`crate::fencing`]).
//!
//! - [`message`]: identifiers, epochs and every message; control messages are state-based and
//!   re-sent every tick, data messages are re-sent until acknowledged.
//! - [`controller`]: membership, heartbeats counted in ticks, replication marks, exactly-once token
//!   delivery, and the paper's 4-step recovery in a new epoch per failure.
//! - [`cluster`]: several pipelines (prompt and token, of different depths) under one controller,
//!   each its own ring with its own epochs.
//! - [`worker`]: a worker's side: registration, heartbeats, the step pipeline, replication to the
//!   ring successor, fencing, and executing recovery.

pub mod cluster;
pub mod controller;
pub mod message;
pub mod worker;

pub use cluster::Cluster;
pub use controller::{
    Controller, ControllerConfig, Output, Persisted, RecoveryPlan, DEFAULT_FAILURE_TIMEOUT, TICK_MS,
};
pub use message::{Addr, BulkKind, Command, Directive, Epoch, Msg, NodeId, Payload, ResumePoint, Status};
pub use worker::{Action, Worker, WorkerConfig};
