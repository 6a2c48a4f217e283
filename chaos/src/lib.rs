//! # dejavu-chaos
//!
//! A chaos harness for DéjàVu clusters: it starts real stage and sidecar processes on loopback
//! (from `dejavud`, or from its own binary), puts a fault-injecting proxy on every link between
//! them, runs a workload of the reference model while it kills, pauses, partitions, slows, resets
//! and corrupts, and checks the reliability contract against a failure-free run of the same
//! workload in the same invocation.
//!
//! - [`scenario`]: cluster shape, workload and faults, from TOML;
//! - [`inject`]: the fault plan (scheduled, and drawn from a seed) and the injector;
//! - [`proxy`]: the user-space proxy that delays, throttles, stalls, resets, corrupts, truncates;
//! - [`check`]: the invariants (bit-identical output, exactly-once delivery, bounded recompute,
//!   bounded recovery), and the leak check in [`harness`];
//! - [`control_plane`]: with controllers on etcd, the invariants of their leadership, checked
//!   from etcd's own history;
//! - [`report`]: per fault class injected / survived / violated, recovery percentiles, slowdowns;
//! - [`harness`]: the runs of one scenario.

pub mod check;
pub mod control_plane;
pub mod harness;
pub mod hooks;
pub mod inject;
pub mod proxy;
pub mod report;
pub mod scenario;

pub use harness::{run, Options};
pub use report::Report;
pub use scenario::Scenario;
