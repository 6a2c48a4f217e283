//! `dejavud certs` through the real binary: the certificates it writes carry a QUIC transfer
//! between two nodes, a later node joins the same authority, and bad input writes nothing.

use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;

use dejavulib::net::quic::QuicTransport;
use dejavulib::net::tls::NodeIdentity;
use dejavulib::net::{ClientConfig, PeerClient, PeerError, PeerServer, ServerConfig};
use dejavulib::HostStore;

fn dejavud(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dejavud")).args(args).output().expect("run dejavud")
}

fn certs(dir: &Path, cluster: &str, nodes: &[&str]) -> Output {
    let mut args = vec!["certs", "--cluster", cluster, "--out", dir.to_str().unwrap()];
    args.extend_from_slice(nodes);
    dejavud(&args)
}

/// Whether `client` (from `client_dir`) can ping a QUIC peer run by `server` (from `server_dir`).
fn quic_ping(server_dir: &Path, server: &str, client_dir: &Path, client: &str) -> Result<(), PeerError> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let server_id = NodeIdentity::load(server_dir, server).unwrap();
    let client_id = NodeIdentity::load(client_dir, client).unwrap();
    runtime.block_on(async {
        let transport = QuicTransport::new(&server_id).unwrap();
        let addr = "127.0.0.1:0".parse().unwrap();
        let peer = PeerServer::bind(&transport, addr, ServerConfig::new(b"s".to_vec(), 1), HostStore::new())
            .await
            .unwrap();
        let mut config = ClientConfig::new(b"s".to_vec(), 2);
        config.connect_attempts = 1;
        let client = PeerClient::new(Arc::new(QuicTransport::new(&client_id).unwrap()), peer.addr(), config);
        client.ping().await.map(|_| ())
    })
}

#[test]
fn issued_certificates_carry_quic_and_later_nodes_join_the_same_authority() {
    let dir = tempfile::tempdir().unwrap();
    let out = certs(dir.path(), "prod", &["worker-0", "worker-1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ca = std::fs::read(dir.path().join("ca.pem")).unwrap();
    quic_ping(dir.path(), "worker-0", dir.path(), "worker-1").unwrap();

    let later = certs(dir.path(), "prod", &["worker-2"]);
    assert!(later.status.success(), "{}", String::from_utf8_lossy(&later.stderr));
    assert!(String::from_utf8_lossy(&later.stdout).contains("using the authority"));
    assert_eq!(std::fs::read(dir.path().join("ca.pem")).unwrap(), ca, "the authority is kept");
    quic_ping(dir.path(), "worker-0", dir.path(), "worker-2").unwrap();

    // A node of another cluster is refused.
    let other = tempfile::tempdir().unwrap();
    assert!(certs(other.path(), "staging", &["worker-9"]).status.success());
    assert!(matches!(quic_ping(dir.path(), "worker-0", other.path(), "worker-9"), Err(PeerError::Auth(_))));
}

#[test]
fn bad_input_is_refused_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    for nodes in [&["Bad_Name"][..], &["a", "a"][..], &["ok", "-no"][..]] {
        let out = certs(dir.path(), "c", nodes);
        assert_eq!(out.status.code(), Some(2), "{nodes:?}");
        assert!(!String::from_utf8_lossy(&out.stderr).is_empty());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "{nodes:?} wrote files");
    }
    assert!(certs(dir.path(), "c", &["n1"]).status.success());
    let again = certs(dir.path(), "c", &["n1"]);
    assert_eq!(again.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
    assert!(certs(dir.path(), "c", &["n1", "--force"]).status.success());
    assert!(certs(dir.path(), "c", &[]).status.code() != Some(0), "at least one node is required");
}
