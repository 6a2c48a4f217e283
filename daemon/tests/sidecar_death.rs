//! A sidecar that dies while its engine lives: the engine computes no more steps once a copy
//! finds the sidecar gone, the controller declares the sidecar dead and fences its whole worker on
//! its own, and the driver replaces the worker: when a step fails, or, if none was sent
//! meanwhile, when it asks the controller between steps. Replication goes on to the replacement
//! sidecar: when the worker it keeps copies for dies next, its KV comes back from there. The
//! output is bit-identical, and only the steps in flight are computed again.

mod common;

use std::time::Duration;

use dejavu_engine::ModelConfig;
use dejavud::cluster::ClusterError;
use dejavud::cluster::{Cluster, Kill, Role};
use dejavud::driver::{drive, Injector, Run, Workload};

const NEW_TOKENS: u32 = 24;

/// Runs the workload with `inject`; checks the output and returns the run.
fn run(mut inject: impl Injector) -> Run {
    let workload = Workload::synthetic(4, 10, NEW_TOKENS, 2, ModelConfig::reference().vocab);
    let splits = vec![0..3, 3..5, 5..8];
    let expected = common::expected(&workload, &splits);
    let config = common::cluster_config(&workload, splits);
    let run =
        drive(&workload, &common::recovering(), &mut || Cluster::start(config.clone()), &mut inject).unwrap();
    assert_eq!(run.tokens, expected);
    run
}

#[test]
fn a_worker_whose_sidecar_died_stops_and_is_replaced_when_its_next_step_fails() {
    let run = run(|step: u64, cluster: &mut Cluster| -> Result<(), ClusterError> {
        if step == 10 {
            cluster.faults().signal(1, Role::Sidecar, libc::SIGKILL)?;
        }
        Ok(())
    });
    assert_eq!(run.recoveries.len(), 1, "{:?}", run.recoveries);
    let r = &run.recoveries[0];
    assert_eq!(r.victims, [(1, Kill::Worker)], "the engine goes with its sidecar");
    assert!(r.interrupted, "{r:?}");
    assert!(r.copies_lost.is_empty(), "{r:?}");
    // The engine stopped at the first copy that failed: a step or two per sequence to compute
    // again, not every step since the sidecar died.
    assert!(r.recomputed <= 1 + 2 * 4, "{r:?}");
}

#[test]
fn the_controller_starts_the_recovery_of_a_worker_whose_sidecar_died_while_no_step_was_sent() {
    let run = run(|step: u64, cluster: &mut Cluster| -> Result<(), ClusterError> {
        match step {
            10 => {
                // The copies of the last step done first (the engine stops at a copy that fails).
                std::thread::sleep(Duration::from_millis(200));
                cluster.faults().signal(1, Role::Sidecar, libc::SIGKILL)?;
                // An idle spell: the controller declares the sidecar dead (its lifeline broke, or
                // 300 ms without a beat) while no step is sent.
                std::thread::sleep(Duration::from_millis(800));
            }
            // Worker 0's copies are kept by its successor's sidecar: the replacement's.
            50 => cluster.faults().kill(0, Kill::Worker)?,
            _ => {}
        }
        Ok(())
    });
    assert_eq!(run.recoveries.len(), 2, "{:?}", run.recoveries);
    let found = &run.recoveries[0];
    assert_eq!(found.victims, [(1, Kill::Worker)], "the engine goes with its sidecar");
    // The driver heard of the fence during the idle spell: the next step failed as it was sent,
    // not at its deadline (300 ms).
    assert!(found.interrupted, "{found:?}");
    assert_eq!(found.step, 10, "{found:?}");
    assert!(found.detection < Duration::from_millis(300), "{found:?}");
    assert!(found.recomputed <= 2 * 4, "{found:?}");
    let killed = &run.recoveries[1];
    assert_eq!(killed.victims, [(0, Kill::Worker)]);
    assert!(killed.interrupted);
    assert!(killed.epoch > found.epoch);
    assert!(killed.copies_lost.is_empty(), "{killed:?}");
    // Restored from the replacement sidecar: only the interrupted step and what its copies
    // lacked were computed again, and they lacked a few steps per sequence at most (forwards trail
    // the steps by a step or two, a few more on a loaded machine), not the dozen each sequence
    // had computed since the first recovery.
    let lag: u64 = killed.lag.iter().map(|&(_, steps)| steps).sum();
    assert!(killed.recomputed <= 1 + lag, "no more than the copies lacked: {killed:?}");
    assert!(lag <= 4 * 4, "restored from the new sidecar: {killed:?}");
}
