//! A sidecar that dies while its engine computes on fails no step: the controller declares it
//! dead and fences its whole worker on its own, and the driver, asking between steps, recovers it
//! with no step interrupted. Replication goes on to the replacement sidecar: when the worker it
//! keeps copies for dies next, its KV comes back from there. The output is bit-identical.

mod common;

use std::time::Duration;

use dejavu_engine::cluster::{Cluster, Kill, Role};
use dejavu_engine::driver::{drive, Workload};
use dejavu_engine::ModelConfig;

const NEW_TOKENS: u32 = 24;

#[test]
fn the_controller_starts_the_recovery_of_a_worker_whose_sidecar_died() {
    let workload = Workload::synthetic(4, 10, NEW_TOKENS, 2, ModelConfig::reference().vocab);
    let splits = vec![0..3, 3..5, 5..8];
    let expected = common::expected(&workload, &splits);
    let config = common::cluster_config(&workload, splits);
    let driver = common::recovering();
    let mut inject = |step: u64, cluster: &mut Cluster| {
        match step {
            10 => cluster.signal(1, Role::Sidecar, libc::SIGKILL)?,
            // An idle spell: the controller has the time to declare the sidecar dead (300 ms
            // without a beat) while nothing fails.
            11 => std::thread::sleep(Duration::from_millis(800)),
            // Worker 0's copies are kept by its successor's sidecar: the replacement's.
            50 => cluster.kill(0, Kill::Worker)?,
            _ => {}
        }
        Ok(())
    };
    let run = drive(&workload, &driver, &mut || Cluster::start(config.clone()), &mut inject).unwrap();
    assert_eq!(run.tokens, expected);
    assert_eq!(run.recoveries.len(), 2, "{:?}", run.recoveries);
    let found = &run.recoveries[0];
    assert_eq!(found.victims, [(1, Kill::Worker)], "the engine goes with its sidecar");
    assert!(!found.interrupted, "no step failed: {found:?}");
    assert_eq!((found.detection, found.resume), (Duration::ZERO, Duration::ZERO));
    assert!(found.step > 11 && found.step < 50, "found between steps, after the idle spell: {found:?}");
    assert!(found.epoch >= 1);
    let killed = &run.recoveries[1];
    assert_eq!(killed.victims, [(0, Kill::Worker)]);
    assert!(killed.interrupted);
    assert!(killed.epoch > found.epoch);
    assert!(killed.copies_lost.is_empty(), "{killed:?}");
    // Restored from the replacement sidecar: only the interrupted step and the copies' lag, a
    // few steps per sequence at most, were computed again.
    assert!(killed.recomputed <= 1 + 2 * 4, "restored from the new sidecar: {killed:?}");
}
