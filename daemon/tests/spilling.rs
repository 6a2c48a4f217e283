//! Sidecars that spill: with no memory budget, every KV copy goes to a file in its sidecar's
//! spill directory; an engine restores from its own sidecar's files and a whole worker from its
//! successor's, bit-identically; a spill directory filled by something else makes spills fail
//! for a while, and the chunks stay in memory (counted) instead of being lost.

mod common;

use std::time::Duration;

use dejavu_engine::ModelConfig;
use dejavud::cluster::{Cluster, ClusterConfig, Kill, Role, SpillLimits};
use dejavud::driver::{drive, Workload};
use dejavud::metrics::value_of;

const NEW_TOKENS: u32 = 24;

#[test]
fn copies_spilled_to_files_restore_bit_identically_and_a_full_directory_loses_nothing() {
    let workload = Workload::synthetic(8, 16, NEW_TOKENS, 4, ModelConfig::reference().vocab);
    let splits = vec![0..2, 2..4, 4..6, 6..8];
    let expected = common::expected(&workload, &splits);
    let config = ClusterConfig {
        // Every chunk in a file: restores read them back.
        spill: Some(SpillLimits { memory_bytes: 0, dir_bytes: 8 << 20 }),
        ..common::cluster_config(&workload, splits)
    };
    let driver = common::recovering();
    let mut pages = Vec::new();
    let mut inject = |step: u64, cluster: &mut Cluster| {
        match step {
            // Sidecar 1's directory fills up for a while: its chunks stay in memory meanwhile.
            40 => cluster.faults().fill_spill(1, Duration::from_millis(300))?,
            // Restored from the files of its own sidecar, and of its successor's.
            80 => cluster.faults().kill(1, Kill::Engine)?,
            120 => cluster.faults().kill(2, Kill::Worker)?,
            _ => {}
        }
        if step + 1 == workload.steps() {
            pages =
                (0..cluster.len()).map(|s| cluster.metrics(s, Role::Sidecar)).collect::<Result<_, _>>()?;
        }
        Ok(())
    };
    let run = drive(&workload, &driver, &mut || Cluster::start(config.clone()), &mut inject).unwrap();
    assert_eq!(run.tokens, expected);
    assert_eq!(run.recoveries.len(), 2);
    // Restores came from the spilled copies: no more than a step or two of replication lag per
    // sequence was recomputed (without them, every sequence's prompt and tokens would be).
    for r in &run.recoveries {
        assert!(r.recomputed <= 1 + 2 * 8, "{r:?}");
    }
    let value = |page: &str, name: &str| value_of(page, name, &[]);
    assert_eq!(pages.len(), 4);
    for page in &pages {
        assert!(value(page, "dejavu_sidecar_spilled_bytes").unwrap() > 0.0, "{page}");
    }
    assert!(value(&pages[1], "dejavu_sidecar_spill_failures_total").unwrap() > 0.0, "{}", pages[1]);
}
