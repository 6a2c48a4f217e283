//! Each worker in a network namespace of its own, at an address of its own, reaching the others
//! only over a bridge: the cluster serves, loses a worker, recovers it from the ring's copies and
//! produces the same tokens. Needs root and iproute2; elsewhere the test says it was skipped.

mod common;

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Arc;

use dejavu_engine::ModelConfig;
use dejavud::cluster::{Cluster, ClusterConfig, Kill, Role};
use dejavud::driver::{drive, Workload};
use dejavud::netns::{Fabric, NetnsError};

#[test]
fn workers_on_hosts_of_their_own_survive_a_dead_worker_with_identical_output() {
    // The machine must let the test make namespaces (root, iproute2, a kernel and container that
    // allow them); any other failure is one.
    let fabric = match Fabric::create() {
        Ok(fabric) => Arc::new(fabric),
        Err(e @ (NetnsError::NotRoot(_) | NetnsError::Unavailable(_))) => {
            eprintln!("skipped: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let gateway = fabric.gateway();
    let workload = Workload::synthetic(4, 10, 16, 2, ModelConfig::reference().vocab);
    let splits = vec![0..3, 3..5, 5..8];
    let expected = common::expected(&workload, &splits);
    let config =
        ClusterConfig { spares: 1, fabric: Some(fabric), ..common::cluster_config(&workload, splits) };
    let mut seen: Vec<(IpAddr, IpAddr)> = Vec::new();
    let mut inject = |step: u64, cluster: &mut Cluster| {
        match step {
            5 => {
                for stage in 0..cluster.len() {
                    seen.push((
                        cluster.addr(stage, Role::Engine)?.ip(),
                        cluster.addr(stage, Role::Sidecar)?.ip(),
                    ));
                }
            }
            // A spare (on hosts of its own) becomes worker 1.
            20 => cluster.faults().kill(1, Kill::Worker)?,
            // Worker 2 is replaced on its own host (the spares used are still starting, or not).
            40 => cluster.faults().kill(2, Kill::Worker)?,
            _ => {}
        }
        Ok(())
    };
    let run =
        drive(&workload, &common::recovering(), &mut || Cluster::start(config.clone()), &mut inject).unwrap();
    assert_eq!(run.tokens, expected);
    assert_eq!(run.recoveries.len(), 2);
    // Each worker had an address of its own on the fabric, its engine and sidecar the same one.
    assert_eq!(seen.len(), 3);
    let hosts: HashSet<IpAddr> = seen.iter().map(|&(engine, _)| engine).collect();
    assert_eq!(hosts.len(), 3, "{seen:?}");
    for &(engine, sidecar) in &seen {
        assert_eq!(engine, sidecar);
        assert!(!engine.is_loopback() && engine != gateway, "{engine}");
        let (IpAddr::V4(host), IpAddr::V4(gateway)) = (engine, gateway) else { panic!("IPv4 expected") };
        assert_eq!(host.octets()[..3], gateway.octets()[..3], "on the fabric's subnet");
    }
}
