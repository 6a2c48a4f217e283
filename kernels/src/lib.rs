//! # dejavu-kernels
//!
//! The CUDA C sources the project runs on GPUs, kept apart from the Rust that launches them (as
//! `candle-kernels` keeps candle's). Nothing is compiled when the crate builds: the sources are
//! strings, compiled by NVRTC for the device's architecture when an engine opens, so the crates
//! that use them build on machines without CUDA.

/// The copy kernels of `dejavulib`'s CUDA engine: copy plans (gathers into a staging buffer,
/// scatters out of one) executed by items or by runs, their table passed inline, through shared
/// memory or from device memory.
pub const COPY_BLOCKS: &str = include_str!("../copy_blocks.cu");

/// The benchmarks' synthetic decoder layer: a memory-bound kernel that stands in for a layer's
/// compute while the overlap of copies and compute is measured.
pub const SYNTHETIC_LAYER: &str = include_str!("../synthetic_layer.cu");
