//! `dejavud controller` through the real binary: it announces where it listens and serves its
//! metrics, logs JSON lines when asked, keeps its epoch in the state file, and refuses a malformed
//! state file without touching it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};

/// A controller process, killed when dropped.
struct Controller {
    child: Child,
    addr: SocketAddr,
    metrics: SocketAddr,
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(state: &std::path::Path, extra: &[&str]) -> Controller {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dejavud"))
        .args(["controller", "--state", state.to_str().unwrap(), "--metrics", "127.0.0.1:0"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut next = |prefix: &str| -> SocketAddr {
        let line = lines.next().unwrap().unwrap();
        line.strip_prefix(prefix).unwrap_or_else(|| panic!("{line:?}")).parse().unwrap()
    };
    let metrics = next("metrics ");
    let addr = next("listening ");
    Controller { child, addr, metrics }
}

fn scrape(addr: SocketAddr) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.write_all(b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response
}

#[test]
fn it_serves_metrics_logs_json_and_keeps_its_state() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("controller.state");
    let mut first = start(&state, &["--log-format", "json"]);
    assert!(scrape(first.metrics).contains("\ndejavu_controller_epoch 0\n"));
    assert!(scrape(first.metrics).contains("\ndejavu_controller_incarnation 1\n"));
    let _ = first.child.kill();
    let mut stderr = String::new();
    first.child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    let line = stderr.lines().next().unwrap_or_default();
    let event: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
    assert_eq!(event["level"], "INFO");
    assert_eq!(event["fields"]["message"], "controller listening");
    assert_eq!(event["fields"]["addr"], first.addr.to_string());
    drop(first);

    // A second controller on the same state file is the next incarnation.
    let second = start(&state, &[]);
    assert!(scrape(second.metrics).contains("\ndejavu_controller_incarnation 2\n"));
    drop(second);
    assert!(std::fs::read_to_string(&state).unwrap().contains("incarnation 2\n"));
}

#[test]
fn a_malformed_state_file_is_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("controller.state");
    std::fs::write(&state, "epoch 3\nmember engine zero live\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_dejavud"))
        .args(["controller", "--state", state.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 2"), "{err}");
    assert_eq!(std::fs::read_to_string(&state).unwrap(), "epoch 3\nmember engine zero live\n");
    let out = Command::new(env!("CARGO_BIN_EXE_dejavud"))
        .args(["controller", "--state", state.to_str().unwrap(), "--log", "nonsense[["])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bad --log filter"));
}
