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

/// Polls the controller's metrics page until it contains `line`, for at most 10 s.
fn wait_for_metric(controller: &Controller, line: &str) -> String {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let page = scrape(controller.metrics);
        if page.contains(line) || std::time::Instant::now() > until {
            return page;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// `dejavud worker` for stage 0 (`who`: `--index 0` or `--replace 0`), beating to `controller`.
fn worker(controller: &Controller, dir: &std::path::Path, name: &str, who: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_dejavud"));
    command
        .arg("worker")
        .args(who)
        .args(["--local", dir.join(name).to_str().unwrap(), "--shm-dir", dir.to_str().unwrap()])
        .args(["--heartbeat", &controller.addr.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Starts `command` and waits for its `listening` line; the child is returned to be killed.
fn listening(mut command: Command) -> Child {
    let mut child = command.spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = lines.next().unwrap().unwrap();
    assert!(line.starts_with("listening "), "{line:?}");
    child
}

#[test]
fn the_controller_fences_a_dead_worker_itself_and_a_replacement_starts_in_that_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("controller.state");
    let controller = start(&state, &[]);
    let mut first = listening(worker(&controller, dir.path(), "first.sock", &["--index", "0"]));
    let page = wait_for_metric(&controller, "dejavu_controller_members{health=\"alive\"} 1\n");
    assert!(page.contains("dejavu_controller_members{health=\"alive\"} 1\n"), "{page}");

    // Nothing to replace while it lives: a clear error, exit 2, and nothing fenced.
    let out = worker(&controller, dir.path(), "early.sock", &["--replace", "0"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("sidecar 0 awaits no replacement: it is not fenced"), "{err}");
    assert!(!dir.path().join("early.sock").exists(), "it made nothing");
    // A replacement must know where the controller is.
    let out = Command::new(env!("CARGO_BIN_EXE_dejavud"))
        .args(["worker", "--replace", "0", "--local", dir.path().join("x.sock").to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--heartbeat"));

    // SIGKILL: the controller declares it dead and fences it in epoch 1 on its own.
    first.kill().unwrap();
    first.wait().unwrap();
    let page = wait_for_metric(&controller, "dejavu_controller_detections_total 1\n");
    assert!(page.contains("dejavu_controller_detections_total 1\n"), "{page}");
    assert!(page.contains("\ndejavu_controller_epoch 1\n"), "{page}");
    assert!(page.contains("dejavu_controller_members{health=\"fenced\"} 1\n"), "{page}");

    // The replacement asks the controller for that epoch; its beats count, so it is no longer
    // fenced (a process started in an older epoch would be ignored).
    let mut replacement = listening(worker(&controller, dir.path(), "second.sock", &["--replace", "0"]));
    let page = wait_for_metric(&controller, "dejavu_controller_members{health=\"alive\"} 1\n");
    assert!(page.contains("dejavu_controller_members{health=\"alive\"} 1\n"), "{page}");
    assert!(page.contains("dejavu_controller_members{health=\"fenced\"} 0\n"), "{page}");
    assert!(page.contains("dejavu_controller_replacement_seconds_count 1\n"), "{page}");
    assert!(std::fs::read_to_string(&state).unwrap().contains("member sidecar 0 live 1\n"));
    replacement.kill().unwrap();
    replacement.wait().unwrap();
}
