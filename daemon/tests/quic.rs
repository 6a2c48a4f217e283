//! A cluster whose sidecars replicate, and whose stages restore, over QUIC with mutual TLS on
//! certificates the cluster generates: a worker and an engine killed mid-decode are recovered
//! bit-identically, and the replicas crossed QUIC.

mod common;

use dejavu_engine::ModelConfig;
use dejavud::cluster::{Cluster, ClusterConfig, Kill, Role, TransportKind};
use dejavud::driver::{drive, Workload};
use dejavud::metrics::value_of;

const NEW_TOKENS: u32 = 24;

#[test]
fn replicas_over_quic_restore_a_killed_worker_bit_identically() {
    let workload = Workload::synthetic(4, 12, NEW_TOKENS, 2, ModelConfig::reference().vocab);
    let splits = vec![0..2, 2..5, 5..8];
    let expected = common::expected(&workload, &splits);
    let config =
        ClusterConfig { transport: TransportKind::Quic, ..common::cluster_config(&workload, splits) };
    let driver = common::recovering();
    let (mut pages, mut restorer) = (Vec::new(), String::new());
    let mut inject = |step: u64, cluster: &mut Cluster| {
        match step {
            60 => cluster.faults().kill(1, Kill::Worker)?,
            80 => cluster.faults().kill(2, Kill::Engine)?,
            _ => {}
        }
        if step + 1 == workload.steps() {
            pages =
                (0..cluster.len()).map(|s| cluster.metrics(s, Role::Sidecar)).collect::<Result<_, _>>()?;
            restorer = cluster.metrics(1, Role::Engine)?;
        }
        Ok(())
    };
    let run = drive(&workload, &driver, &mut || Cluster::start(config.clone()), &mut inject).unwrap();
    assert_eq!(run.tokens, expected);
    assert_eq!(run.recoveries.len(), 2);
    // Stage 1's replacement restored every prompt, and more, from its successor's sidecar over
    // QUIC (how much more depends on the replication lag: QUIC forwards lag behind TCP's here).
    let from_peer = value_of(&restorer, "dejavu_stage_restored_tokens_total", &[("target", "peer")]).unwrap();
    let prompts: usize = workload.prompts.iter().map(Vec::len).sum();
    assert!(from_peer >= prompts as f64, "{from_peer} tokens restored\n{restorer}");
    for page in &pages {
        assert_eq!(
            value_of(page, "dejavu_sidecar_transport_info", &[("transport", "quic")]),
            Some(1.0),
            "{page}"
        );
        // Its predecessor's replicas came in over QUIC.
        assert!(value_of(page, "dejavu_sidecar_chunks_stored_total", &[]).unwrap() > 0.0, "{page}");
    }
}
