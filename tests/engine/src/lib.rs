//! # dejavu-engine
//!
//! A reference LLM engine that exists to produce real KV caches and real tokens, so the runtime can
//! be proven end to end: a decoder-only transformer with seeded random weights (no downloads),
//! grouped-query attention, rotary positions, RMSNorm and a SiLU MLP, greedy decoding. It knows
//! nothing of the daemon: `dejavud`'s stage host runs it as one engine among others.
//!
//! - [`model`]: the configuration and the deterministic weights of each layer;
//! - [`stage`]: a pipeline stage runs a range of layers over one sequence slot, reading and writing
//!   its KV cache (a [`dejavulib::KvCache`] in any layout) with buffered gather / scatter;
//! - [`pipeline`]: stages chained in one process, prompts in microbatches, greedy generation.
//!
//! Everything is plain `f32` arithmetic in a fixed order: the same binary produces the same bits
//! from run to run, and the split into stages or the cache layout does not change them. (`exp`,
//! `powf` and `sin_cos` come from the platform's math library, so two different machines may
//! disagree in the last bits; the processes of one run share a machine and a binary.)

pub mod model;
pub mod pipeline;
pub mod stage;

mod math;

pub use model::ModelConfig;
pub use pipeline::{CacheLayout, Pipeline, Seat};
pub use stage::{Stage, StageError};
