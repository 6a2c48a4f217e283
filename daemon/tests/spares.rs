//! Spare workers: a spare stage and a spare sidecar, started ahead and registered with the
//! controller, become a dead worker's replacements in a recovery (no process is started then);
//! new spares start in the background and serve the next recovery; the output is bit-identical.

mod common;

use dejavu_engine::ModelConfig;
use dejavud::cluster::{Cluster, ClusterConfig, Kill};
use dejavud::driver::{drive, Workload};

const NEW_TOKENS: u32 = 16;

#[test]
fn spares_replace_dead_workers_and_are_replaced_in_turn() {
    let workload = Workload::synthetic(4, 10, NEW_TOKENS, 2, ModelConfig::reference().vocab);
    let splits = vec![0..3, 3..5, 5..8];
    let expected = common::expected(&workload, &splits);
    let config = ClusterConfig { spares: 1, ..common::cluster_config(&workload, splits) };
    let driver = common::recovering();
    let mut used = Vec::new();
    let mut inject = |step: u64, cluster: &mut Cluster| {
        match step {
            // The spare stage and the spare sidecar become worker 1.
            20 => cluster.faults().kill(1, Kill::Worker)?,
            // The spare stage started since becomes engine 2 (its sidecar lives on).
            40 => cluster.faults().kill(2, Kill::Engine)?,
            _ => {}
        }
        used.push(cluster.spares_used());
        Ok(())
    };
    let run = drive(&workload, &driver, &mut || Cluster::start(config.clone()), &mut inject).unwrap();
    assert_eq!(run.tokens, expected);
    assert_eq!(run.recoveries.len(), 2);
    assert_eq!(used.last(), Some(&3), "two spares for the worker, one for the engine: {used:?}");
    for r in &run.recoveries {
        assert!(r.recomputed <= 1 + 2 * 4, "restored from the copies: {r:?}");
    }
}
