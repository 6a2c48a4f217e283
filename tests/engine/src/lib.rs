//! # dejavu-engine
//!
//! A reference LLM engine that exists to produce real KV caches and real tokens, so the runtime can
//! be proven end to end: a decoder-only transformer with seeded random weights (no downloads),
//! grouped-query attention, rotary positions, RMSNorm and a SiLU MLP, greedy decoding.
//!
//! - [`model`]: the configuration and the deterministic weights of each layer;
//! - [`stage`]: a pipeline stage runs a range of layers over one sequence slot, reading and writing
//!   its KV cache (a [`dejavulib::KvCache`] in any layout) with buffered gather / scatter;
//! - [`pipeline`]: stages chained in one process, prompts in microbatches, greedy generation;
//! - [`process`]: stages as separate processes passing activations over TCP, copying their KV to
//!   sidecars and restoring it after a replacement (the `dejavu-engine` binary runs one);
//! - [`swap`]: microbatch swapping, fewer device caches than microbatches, the rest in host memory;
//! - [`sidecar`]: a worker's sidecar process, which keeps its engine's KV (received through shared
//!   memory) and its predecessor's replica, and forwards its engine's KV to the successor;
//! - [`heartbeat`]: processes beat every interval to the controller;
//! - [`controller`]: a process that declares the silent dead and issues the epoch of each
//!   recovery, with a state file that survives its crashes;
//! - [`netns`]: network namespaces that give each worker an address of its own;
//! - [`metrics`]: each process's counters on a Prometheus text endpoint;
//! - [`logging`]: each process's `tracing` events on standard error, as text or JSON;
//! - [`cluster`]: a pipeline of such processes and the recovery procedure for a dead worker;
//! - [`driver`]: the loop that runs requests through a cluster, injects faults, and recovers or
//!   restarts after a failure, recording every token and every recovery.
//!
//! Everything is plain `f32` arithmetic in a fixed order: the same binary produces the same bits
//! from run to run, and the split into stages or the cache layout does not change them. (`exp`,
//! `powf` and `sin_cos` come from the platform's math library, so two different machines may
//! disagree in the last bits; the processes of one run share a machine and a binary.)

pub mod cli;
pub mod cluster;
pub mod controller;
pub mod driver;
pub mod handoff;
pub mod heartbeat;
pub mod logging;
pub mod metrics;
pub mod model;
pub mod netns;
pub mod pipeline;
pub mod proc;
pub mod process;
pub mod sidecar;
pub mod spare;
pub mod stage;
pub mod swap;
pub mod transport;

mod math;
mod slots;

pub use model::ModelConfig;
pub use pipeline::{CacheLayout, Pipeline, Seat};
pub use stage::{Stage, StageError};
