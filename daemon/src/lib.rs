//! # dejavud
//!
//! The DéjàVu daemon: the runtime that runs beside each engine worker and the controller that
//! watches them, as I/O shells around the `dejavu-proto` state machines, with the demo, the
//! planner and the certificate tool.
//!
//! - [`sidecar`]: a worker's sidecar process, which keeps its engine's KV (received through shared
//!   memory) and its predecessor's replica, and forwards its engine's KV to the successor;
//! - [`controller`]: a process that declares the silent dead and issues the epoch of each
//!   recovery, with a state file that survives its crashes;
//! - [`heartbeat`]: processes beat every interval to the controller;
//! - [`membership`]: a process's heartbeats and lifeline, held and let go together;
//! - [`process`]: the stage host: an engine's stages as separate processes passing activations
//!   over TCP, copying their KV to sidecars and restoring it after a replacement; each runs the
//!   reference model, or an engine process of any language ([`process::external`]);
//! - [`swap`]: microbatch swapping, fewer device caches than microbatches, the rest in host memory;
//! - [`handoff`]: prompt-token disaggregation, prompt stages handing KV to token stages;
//! - [`spare`]: processes registered ahead, made stages or sidecars by a recovery;
//! - [`cluster`]: the supervisor of a pipeline of such processes and the recovery procedure for a
//!   dead worker;
//! - [`driver`]: the loop that runs requests through a cluster, injects faults, and recovers or
//!   restarts after a failure, recording every token and every recovery;
//! - [`proc`]: starting and watching child processes;
//! - [`etcd_cluster`]: a local etcd cluster on loopback, for the controllers' high availability
//!   (`controller --etcd`) in tests, benchmarks and trials;
//! - [`lifecycle`]: how a daemon process lives beside a supervisor: the parent it may die with,
//!   SIGTERM and SIGINT, stale sockets, locked files;
//! - [`netns`]: network namespaces that give each worker an address of its own;
//! - [`metrics`]: each process's counters on a Prometheus text endpoint;
//! - [`logging`]: each process's `tracing` events on standard error, as text or JSON;
//! - [`transport`]: the TCP or QUIC links between processes;
//! - [`cli`]: the subcommands' arguments, and [`commands`]: the subcommands of a cluster's
//!   processes, declared once;
//! - [`demo`], [`plan`], [`certs`]: `dejavud demo`, `dejavud plan`, `dejavud certs`.

pub mod certs;
pub mod cli;
pub mod cluster;
pub mod commands;
pub mod controller;
pub mod demo;
pub mod driver;
pub mod etcd_cluster;
pub mod handoff;
pub mod heartbeat;
pub mod lifecycle;
pub mod logging;
pub mod membership;
pub mod metrics;
pub mod netns;
pub mod plan;
pub mod proc;
pub mod process;
pub mod sidecar;
pub mod spare;
pub mod swap;
pub mod transport;

mod slots;
