//! # dejavu-proto
//!
//! The DéjàVu control plane as deterministic state machines, in the style of quinn-proto and
//! raft-rs: each takes messages and times as inputs and returns what to do as outputs. They
//! contain no sockets, threads, clocks or randomness (this crate has no dependencies, and a test
//! checks its sources), so a seeded simulator can run them through millions of fault schedules
//! (`dejavu-sim`).
//!
//! The daemon runs two of them, and the simulator drives the same types:
//!
//! - [`Controller`] ([`controller`]): `dejavud controller` is its shell. It is the [`liveness`]
//!   machine (heartbeats, lifelines, failure detection, fences, epochs, the record a restart goes
//!   on from) with the hand-over of [`spares`] on top.
//! - [`Worker`] ([`worker`]): `dejavud sidecar` is its shell. Which engine it serves, which stage
//!   it is, and its [`forwarding`] of the engine's KV to the ring successor.
//!
//! Beside them, the procedures both follow:
//!
//! - [`recovery`]: the recovery procedure (fence, replace, carry out, restore, re-seed) and its
//!   retries after a death in the middle of it, which the demo's cluster supervisor and the chaos
//!   harness drive.
//! - [`plan`]: where each failed stage restores from, and who re-seeds each replaced sidecar.
//! - [`fencing`]: the epoch rule every process applies to its peers (the newest holds a place, the
//!   stale are refused, a newer fence ends what an older epoch started).
//! - [`rng`]: SplitMix64, the one seeded generator the simulator, the chaos harness, the reference
//!   model and the tests draw from.
//!
//! And [`model`]: the paper's pipeline as a closed model (a pipeline controller and workers that
//! compute, deliver tokens exactly once and recover in 4 steps), with which the simulator checks
//! the protocol's design. The daemon does not run it.

pub mod controller;
pub mod fencing;
pub mod forwarding;
pub mod liveness;
pub mod model;
pub mod plan;
pub mod recovery;
pub mod rng;
pub mod spares;
pub mod worker;

pub use controller::Controller;
pub use worker::Worker;
