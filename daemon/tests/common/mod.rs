//! What the process tests of a cluster share: the tokens a workload must produce (from the
//! in-process pipeline), a cluster of the test binary's processes for it, and a driver that
//! recovers.

use std::ops::Range;
use std::path::PathBuf;
use std::time::Duration;

use dejavu_engine::{CacheLayout, ModelConfig, Pipeline};
use dejavud::cluster::ClusterConfig;
use dejavud::driver::{DriverConfig, OnFailure, Workload};

/// The tokens of `workload` from the in-process pipeline split as `splits`: what every
/// distributed run must produce.
pub fn expected(workload: &Workload, splits: &[Range<u32>]) -> Vec<Vec<u32>> {
    Pipeline::new(
        ModelConfig::reference(),
        splits,
        CacheLayout::FasterTransformer,
        workload.slots,
        workload.microbatches(),
        workload.max_tokens(),
    )
    .unwrap()
    .generate(&workload.prompts, workload.new_tokens as usize)
    .unwrap()
}

/// A replicated cluster of `splits` sized for `workload`, of this crate's `dejavu-engine`
/// processes, a step deadline of 1 s; the other fields are the defaults, to override.
pub fn cluster_config(workload: &Workload, splits: Vec<Range<u32>>) -> ClusterConfig {
    ClusterConfig {
        splits,
        slots: workload.slots,
        microbatches: workload.microbatches(),
        max_tokens: workload.max_tokens(),
        deadline: Duration::from_secs(1),
        ..ClusterConfig::new(PathBuf::from(env!("CARGO_BIN_EXE_dejavud")))
    }
}

/// A driver that recovers dead stages.
pub fn recovering() -> DriverConfig {
    DriverConfig {
        on_failure: OnFailure::Recover,
        detect_patience: Duration::from_secs(3),
        watch_every: Duration::from_millis(100),
        retries: 3,
    }
}
