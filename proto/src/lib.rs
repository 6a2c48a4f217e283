//! # dejavu-proto
//!
//! The DéjàVu control plane as deterministic state machines, in the style of quinn-proto and
//! raft-rs: a [`Controller`] and a [`Worker`] take messages and ticks as inputs and return what to
//! do as outputs. They contain no sockets, threads, clocks or randomness (this crate has no
//! dependencies, and a test checks its sources), so a seeded simulator can run them through
//! millions of fault schedules (`dejavu-sim`). The `dejavud` controller is a shell around
//! [`liveness::Liveness`]: every liveness, fencing and epoch decision it takes is the machine's;
//! it plans recoveries with [`plan::ring`], as the [`Controller`] state machine does, and every
//! recovery the cluster supervisor carries out follows [`recovery::Recovery`].
//!
//! - [`message`]: identifiers, epochs and every message; control messages are state-based and
//!   re-sent every tick, data messages are re-sent until acknowledged.
//! - [`controller`]: membership, heartbeats counted in ticks, replication marks, exactly-once token
//!   delivery, and the paper's 4-step recovery in a new epoch per failure.
//! - [`cluster`]: several pipelines (prompt and token, of different depths) under one controller,
//!   each its own ring with its own epochs.
//! - [`plan`]: where each failed stage restores from, and who re-seeds each replaced sidecar.
//! - [`fencing`]: the epoch rule every process applies to its peers (the newest holds a place, the
//!   stale are refused, a newer fence ends what an older epoch started).
//! - [`forwarding`]: a sidecar's forwarding of its engine's KV to the ring successor (order,
//!   backlog, what the engine hears for each chunk), which `dejavud sidecar` drives.
//! - [`liveness`]: the running controller's heartbeats, lifelines, failure detection, fences and
//!   epochs, which `dejavud controller` drives.
//! - [`recovery`]: the running recovery procedure (fence, replace, carry out, restore, re-seed) and
//!   its retries after a death in the middle of it, which the demo's driver and the chaos harness
//!   drive.
//! - [`spares`]: which live spare takes the place of which fenced member, in which epoch, which
//!   `dejavud controller --stages` hands over itself.
//! - [`rng`]: SplitMix64, the one seeded generator the simulator, the chaos harness, the reference
//!   model and the tests draw from.
//! - [`worker`]: the sidecar's side: registration, heartbeats, the step pipeline, replication to the
//!   ring successor, fencing, and executing recovery.

pub mod cluster;
pub mod controller;
pub mod fencing;
pub mod forwarding;
pub mod liveness;
pub mod message;
pub mod plan;
pub mod recovery;
pub mod rng;
pub mod spares;
pub mod worker;

pub use cluster::Cluster;
pub use controller::{
    Controller, ControllerConfig, Output, Persisted, RecoveryPlan, DEFAULT_FAILURE_TIMEOUT, TICK_MS,
};
pub use message::{Addr, BulkKind, Command, Directive, Epoch, Msg, NodeId, Payload, ResumePoint, Status};
pub use worker::{Action, Worker, WorkerConfig};
