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

#[test]
fn a_spare_runs_no_engine_process_an_assignment_names() {
    let dir = tempfile::tempdir().unwrap();
    let ran = dir.path().join("ran");
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_dejavud"));
    let args = ["spare", "--id=0", "--listen=127.0.0.1:0"].map(String::from);
    let spare = dejavud::proc::spawn(exe, &args, "a spare", std::time::Duration::from_secs(30)).unwrap();
    // Whoever holds the cluster secret may assign the spare a stage, but not a command to run.
    let flags = ["--index=0", "--epoch=0", "--layers=0..8", "--next=127.0.0.1:9", "--", "touch"]
        .map(String::from)
        .into_iter()
        .chain([ran.display().to_string()])
        .collect::<Vec<_>>();
    let secret = dejavud::cli::cluster_secret().as_bytes();
    let refused =
        dejavud::spare::assign_stage(spare.addr, &flags, 0, secret, std::time::Duration::from_secs(10));
    match refused {
        Err(dejavud::spare::SpareError::Refused(why)) => {
            assert!(why.contains("must be the one the spare was started with"), "{why}")
        }
        other => panic!("an assignment naming an engine process was not refused: {other:?}"),
    }
    assert!(!ran.exists(), "the assignment's command ran");
}
