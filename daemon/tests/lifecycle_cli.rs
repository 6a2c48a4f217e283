//! The daemons beside a supervisor, through the real binary: they outlive the shell that started
//! them, end cleanly on SIGTERM (the sidecar's socket removed, the controller's state kept), replace
//! a socket a dead sidecar left and refuse one a live sidecar holds, and a second controller on the
//! same state file is refused. A member whose lifeline no controller takes says so, and says
//! again when one does.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use dejavud::cli::DEFAULT_SECRET;
use dejavud::controller::ControllerClient;

/// A daemon process, killed when dropped.
struct Daemon {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    /// Sends `signal` and waits for the process to end.
    fn signal_and_wait(&mut self, signal: libc::c_int) -> (ExitStatus, String) {
        // SAFETY: kill(2) on the pid of a child this test started and has not reaped.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, signal) }, 0);
        let status = self.child.wait().unwrap();
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut self.child.stderr.take().unwrap(), &mut stderr).unwrap();
        (status, stderr)
    }
}

fn dejavud(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_dejavud"));
    command.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    command
}

/// Starts `args` and waits for its `listening` line.
fn start(args: &[&str]) -> Daemon {
    let mut child = dejavud(args).spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().unwrap_or_else(|| panic!("{args:?} ended before listening")).unwrap();
        if let Some(addr) = line.strip_prefix("listening ") {
            break addr.parse().unwrap();
        }
    };
    Daemon { child, addr }
}

fn sidecar(local: &Path) -> Daemon {
    start(&["sidecar", "--listen", "127.0.0.1:0", "--local", local.to_str().unwrap()])
}

fn controller(state: &Path) -> Daemon {
    start(&["controller", "--listen", "127.0.0.1:0", "--state", state.to_str().unwrap()])
}

/// A controller whose heartbeat timeout is `timeout_ms`, on a state file in `dir`.
fn controller_timing_out(dir: &Path, timeout_ms: &str) -> Daemon {
    let state = dir.join("controller.state");
    start(&[
        "controller",
        "--listen",
        "127.0.0.1:0",
        "--state",
        state.to_str().unwrap(),
        "--timeout-ms",
        timeout_ms,
    ])
}

/// Asks `client` for the census until `done` holds of it (at most 20 s: then `what` never came).
fn wait_until(
    client: &mut ControllerClient,
    what: &str,
    done: &dyn Fn(&dejavud::controller::Census) -> bool,
) {
    let started = std::time::Instant::now();
    while !done(&client.census().unwrap()) {
        assert!(started.elapsed() < Duration::from_secs(20), "never {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_daemon_outlives_the_shell_that_started_it() {
    let dir = tempfile::tempdir().unwrap();
    let (state, out) = (dir.path().join("controller.state"), dir.path().join("controller.out"));
    // The shell starts it in the background and exits: the controller is re-parented (to init,
    // or a subreaper), as under a container's `sh -c` entrypoint or a `nohup ... &`.
    let script = format!(
        "{} controller --listen 127.0.0.1:0 --state {} > {} 2>&1 & echo $!",
        env!("CARGO_BIN_EXE_dejavud"),
        state.display(),
        out.display()
    );
    let shell = Command::new("sh").args(["-c", &script]).output().unwrap();
    assert!(shell.status.success());
    let pid: i32 = String::from_utf8_lossy(&shell.stdout).trim().parse().unwrap();
    let guard = KillOnDrop(pid);
    // The shell has exited; the controller must still come up and answer.
    let started = std::time::Instant::now();
    let addr = loop {
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        if let Some(line) = text.lines().find_map(|l| l.strip_prefix("listening ")) {
            break line.parse::<SocketAddr>().unwrap();
        }
        // SAFETY: kill(pid, 0) only checks that the process exists.
        assert_eq!(unsafe { libc::kill(pid, 0) }, 0, "the controller exited: {text}");
        // A zombie nobody reaps still exists: a controller that never listens fails too.
        assert!(started.elapsed() < Duration::from_secs(30), "the controller never listened: {text}");
        std::thread::sleep(Duration::from_millis(10));
    };
    let census = ControllerClient::new(addr, Duration::from_secs(5), DEFAULT_SECRET.as_bytes()).census();
    assert_eq!(census.expect("it answers with its parent gone").epoch, 0);
    drop(guard);
}

struct KillOnDrop(i32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // SAFETY: kill(2) on a pid this test started (re-parented; reaped by its new parent).
        unsafe { libc::kill(self.0, libc::SIGKILL) };
    }
}

#[test]
fn sigterm_ends_a_sidecar_cleanly_and_removes_its_socket() {
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("s0.sock");
    let mut first = sidecar(&local);
    assert!(local.exists());
    let (status, stderr) = first.signal_and_wait(libc::SIGTERM);
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("the sidecar stopping") && stderr.contains("SIGTERM"), "{stderr}");
    assert!(!local.exists(), "its socket is gone");
    // So a replacement starts at once on the same path.
    drop(sidecar(&local));
}

#[test]
fn sigint_ends_a_controller_cleanly_and_keeps_its_state() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("controller.state");
    let mut controller = controller(&state);
    let (status, stderr) = controller.signal_and_wait(libc::SIGINT);
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("the controller stopping") && stderr.contains("SIGINT"), "{stderr}");
    assert!(state.exists(), "its state stays for the next controller");
}

#[test]
fn a_socket_left_by_a_dead_sidecar_is_replaced_and_a_live_ones_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("s0.sock");
    let mut first = sidecar(&local);
    let taken = dejavud(&["sidecar", "--listen", "127.0.0.1:0", "--local", local.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&taken.stderr);
    assert_eq!(taken.status.code(), Some(2), "{err}");
    assert!(err.contains("s0.sock") && err.contains("another process listens there"), "{err}");

    // SIGKILL leaves the socket file behind; the next sidecar takes its place.
    let (status, _) = first.signal_and_wait(libc::SIGKILL);
    assert!(!status.success());
    assert!(local.exists(), "a killed sidecar leaves its socket");
    drop(sidecar(&local));
}

#[test]
fn a_replacement_whose_socket_is_taken_fails_before_asking_for_an_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("controller.state");
    let controller = controller(&state);
    let local = dir.path().join("s0.sock");
    let _live = sidecar(&local);
    let heartbeat = controller.addr.to_string();
    let args = ["sidecar", "--replace", "0", "--heartbeat", &heartbeat, "--local", local.to_str().unwrap()];
    let out = dejavud(&args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // Asking first would have been refused as "not fenced": the socket is checked before.
    assert!(err.contains("another process listens there") && !err.contains("not fenced"), "{err}");
}

#[test]
fn a_second_controller_on_the_same_state_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("controller.state");
    let _first = controller(&state);
    let out = dejavud(&["controller", "--listen", "127.0.0.1:0", "--state", state.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("controller.state.lock") && err.contains("another controller"), "{err}");
}

#[test]
fn rust_log_chooses_what_is_logged_unless_log_is_given() {
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("s0.sock");
    let logged = |env: Option<&str>, flag: &[&str]| {
        let mut command =
            dejavud(&["sidecar", "--listen", "127.0.0.1:0", "--local", local.to_str().unwrap()]);
        command.args(flag).env_remove("RUST_LOG");
        if let Some(env) = env {
            command.env("RUST_LOG", env);
        }
        let mut child = command.spawn().unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        while !lines.next().unwrap().unwrap().starts_with("listening ") {}
        let mut daemon = Daemon { child, addr: "127.0.0.1:0".parse().unwrap() };
        daemon.signal_and_wait(libc::SIGTERM).1
    };
    assert!(logged(None, &[]).contains("sidecar listening"), "info by default");
    assert!(!logged(Some("warn"), &[]).contains("sidecar listening"), "RUST_LOG=warn");
    assert!(logged(Some("warn"), &["--log", "info"]).contains("sidecar listening"), "the flag wins");
}

#[test]
fn a_second_sidecar_for_the_same_stage_is_refused_and_names_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let controller = controller(&dir.path().join("controller.state"));
    let heartbeat = controller.addr.to_string();
    let first_socket = dir.path().join("a.sock");
    let first = start(&["sidecar", "--heartbeat", &heartbeat, "--local", first_socket.to_str().unwrap()]);
    // Started without --index too: it claims stage 0 as well.
    let second_socket = dir.path().join("b.sock");
    let out = dejavud(&["sidecar", "--heartbeat", &heartbeat, "--local", second_socket.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let holder = format!("sidecar 0 is held by process {}", first.child.id());
    assert!(err.contains(&holder) && err.contains("--replace 0"), "{err}");
    // The first keeps its place.
    let census =
        ControllerClient::new(controller.addr, Duration::from_secs(5), DEFAULT_SECRET.as_bytes()).census();
    assert!(!census.unwrap().is_dead((dejavud::cluster::Role::Sidecar, 0)));
}

#[test]
fn a_fenced_sidecar_says_so_loudly_and_refuses_engines() {
    use dejavud::cluster::Role;
    let dir = tempfile::tempdir().unwrap();
    let controller = controller_timing_out(dir.path(), "300");
    let heartbeat = controller.addr.to_string();
    let local = dir.path().join("s0.sock");
    let mut sidecar = start(&["sidecar", "--heartbeat", &heartbeat, "--local", local.to_str().unwrap()]);
    // Its log, line by line, as it comes.
    let (lines_tx, lines) = std::sync::mpsc::channel();
    let stderr = sidecar.child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });
    let mut client =
        ControllerClient::new(controller.addr, Duration::from_secs(5), DEFAULT_SECRET.as_bytes());
    wait_until(&mut client, "alive", &|c| !c.is_dead((Role::Sidecar, 0)));

    // Stopped past the timeout: the controller fences it; back, it hears so on its lifeline.
    let pid = sidecar.child.id() as i32;
    // SAFETY: kill(2) on the pid of a child this test started and has not reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    wait_until(&mut client, "fenced", &|c| c.is_fenced((Role::Sidecar, 0)));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let said = loop {
        let line = lines.recv_timeout(Duration::from_secs(20)).expect("a line saying it was fenced");
        if line.contains("FENCED") {
            break line;
        }
    };
    assert!(said.contains("ERROR") && said.contains("epoch 1"), "{said}");
    let successor: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let refused = dejavulib::local::LocalSidecar::connect(&local, 0, successor).map(|_| ()).unwrap_err();
    assert!(refused.to_string().contains("fenced in epoch 1"), "{refused}");
}

#[test]
fn flags_come_from_a_config_file_and_the_command_line_wins() {
    let dir = tempfile::tempdir().unwrap();
    let (from_file, from_flag) = (dir.path().join("a.state"), dir.path().join("b.state"));
    let file = dir.path().join("controller.toml");
    let text = format!("listen = \"127.0.0.1:0\"\nstate = \"{}\"\ntimeout_ms = 500\n", from_file.display());
    std::fs::write(&file, text).unwrap();
    let config = file.to_str().unwrap();
    drop(start(&["controller", "--config", config]));
    assert!(from_file.exists(), "the file's --state");
    std::fs::remove_file(&from_file).unwrap();
    drop(start(&["controller", "--config", config, "--state", from_flag.to_str().unwrap()]));
    assert!(from_flag.exists() && !from_file.exists(), "the command line's --state wins");

    std::fs::write(&file, "no_such_flag = 3\n").unwrap();
    let out = dejavud(&["controller", "--config", config]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--no-such-flag"), "the key is named: {err}");
}

#[test]
fn an_engine_that_reports_nothing_itself_is_a_member_through_its_sidecar() {
    use dejavud::cluster::Role;
    use dejavulib::local::LocalSidecar;
    let dir = tempfile::tempdir().unwrap();
    // A timeout far beyond the test's waits: only a lifeline can show the engine dead in time.
    let controller = controller_timing_out(dir.path(), "60000");
    let heartbeat = controller.addr.to_string();
    let local = dir.path().join("s0.sock");
    let _sidecar = start(&["sidecar", "--heartbeat", &heartbeat, "--local", local.to_str().unwrap()]);
    let mut client =
        ControllerClient::new(controller.addr, Duration::from_secs(5), DEFAULT_SECRET.as_bytes());
    let engine = (Role::Engine, 0);
    let successor: SocketAddr = "127.0.0.1:9".parse().unwrap();

    // An engine connected the plain way is not a member; one that asks its sidecar to report
    // for it is, as long as its connection lasts.
    let plain = LocalSidecar::connect(&local, 0, successor).unwrap();
    assert!(client.census().unwrap().is_dead(engine), "nobody reports the plain engine");
    drop(plain);
    // It asks its sidecar for its epoch: the stage's first engine's.
    let member = LocalSidecar::join(&local, successor).unwrap();
    assert_eq!(member.epoch(), 0);
    wait_until(&mut client, "alive", &|c| !c.is_dead(engine));
    // Its death (the connection closes with its process) is seen at once: fenced, long before
    // a heartbeat timeout of a minute.
    drop(member);
    wait_until(&mut client, "fenced", &|c| c.is_fenced(engine));
    let fenced_in = client.fenced_in(engine).unwrap();
    // Its replacement learns the fence's epoch from the sidecar and is a member again.
    let replacement = LocalSidecar::join(&local, successor).unwrap();
    assert_eq!(replacement.epoch(), fenced_in);
    wait_until(&mut client, "alive again", &|c| !c.is_dead(engine) && !c.is_fenced(engine));
    // And so on: each replacement in the epoch of its predecessor's fence.
    drop(replacement);
    wait_until(&mut client, "fenced again", &|c| c.is_fenced(engine));
    let again = client.fenced_in(engine).unwrap();
    assert!(again > fenced_in);
    assert_eq!(LocalSidecar::join(&local, successor).unwrap().epoch(), again);
}

#[test]
fn without_a_controller_each_engine_that_joins_takes_over_in_a_newer_epoch() {
    use dejavulib::local::LocalSidecar;
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("s0.sock");
    let _sidecar = sidecar(&local);
    let successor: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let first = LocalSidecar::join(&local, successor).unwrap();
    assert_eq!(first.epoch(), 0);
    let second = LocalSidecar::join(&local, successor).unwrap();
    assert_eq!(second.epoch(), 1);
    assert!(
        first.is_closed() || LocalSidecar::connect(&local, 0, successor).is_err(),
        "the first is cut off"
    );
}

#[test]
fn an_engine_naming_its_own_sidecar_as_successor_is_refused_and_the_sidecar_logs_it() {
    use dejavulib::local::LocalSidecar;
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("s0.sock");
    let mut first = sidecar(&local);
    // Its own KV transport, the address of its `listening` line.
    let itself = first.addr;
    let refused = LocalSidecar::connect(&local, 0, itself).map(|_| ()).unwrap_err().to_string();
    assert!(refused.contains("as its own successor") && refused.contains("`none`"), "{refused}");
    let (_, stderr) = first.signal_and_wait(libc::SIGTERM);
    assert!(stderr.contains("as its own successor"), "{stderr}");
}

#[test]
fn a_member_says_when_no_controller_takes_its_lifeline_and_when_one_does_again() {
    use std::sync::mpsc::channel;
    use std::time::Instant;
    let dir = tempfile::tempdir().unwrap();
    // The controller's address, where nobody listens yet.
    let at = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let local = dir.path().join("s0.sock");
    let mut member = start(&[
        "sidecar",
        "--listen",
        "127.0.0.1:0",
        "--local",
        local.to_str().unwrap(),
        "--index",
        "0",
        "--heartbeat",
        &at,
    ]);
    let (tx, lines) = channel();
    let stderr = BufReader::new(member.child.stderr.take().unwrap());
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let wait_for = |text: &str| {
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            let left = until.saturating_duration_since(Instant::now());
            let line = lines.recv_timeout(left).unwrap_or_else(|_| panic!("the member never said {text:?}"));
            if line.contains(text) {
                return line;
            }
        }
    };
    let said = wait_for("no controller has taken this member's lifeline");
    assert!(said.contains("WARN") && said.contains("neither detected nor recovered"), "{said}");
    let _controller =
        start(&["controller", "--listen", &at, "--state", dir.path().join("state").to_str().unwrap()]);
    wait_for("a controller holds this member's lifeline again");
}
