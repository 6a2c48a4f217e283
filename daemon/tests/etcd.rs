//! Controllers in high availability on a real 3-member etcd cluster, started on loopback in a
//! temporary directory: one leads and the others stand by; a killed leader's successor goes on
//! from the record the first kept in etcd; a paused leader, back after its successor took over,
//! cannot write an epoch and stops.
//!
//! Needs Debian's `etcd-server` (`etcd` on the PATH, as `.ci/run` installs it).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use dejavud::cli::DEFAULT_SECRET;
use dejavud::cluster::Role;
use dejavud::controller::{Census, ControllerClient, Health, DEPOSED_EXIT};

/// A process, killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Three etcd members on loopback; their client URLs.
fn etcd_cluster(dir: &Path) -> (Vec<Killed>, String) {
    let names = ["e0", "e1", "e2"];
    let peers: Vec<String> = names.iter().map(|_| format!("http://127.0.0.1:{}", free_port())).collect();
    let clients: Vec<String> = names.iter().map(|_| format!("http://127.0.0.1:{}", free_port())).collect();
    let initial: Vec<String> = names.iter().zip(&peers).map(|(n, p)| format!("{n}={p}")).collect();
    let members = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let child = Command::new("etcd")
                .args(["--name", name, "--data-dir"])
                .arg(dir.join(name))
                .args(["--listen-peer-urls", &peers[i], "--initial-advertise-peer-urls", &peers[i]])
                .args(["--listen-client-urls", &clients[i], "--advertise-client-urls", &clients[i]])
                .args(["--initial-cluster", &initial.join(","), "--initial-cluster-state", "new"])
                .args(["--initial-cluster-token", "dejavu-test"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("etcd (Debian's etcd-server) on the PATH");
            Killed(child)
        })
        .collect();
    (members, clients.join(","))
}

/// A controller and the lines it prints, read on a thread of their own.
struct Controller {
    process: Killed,
    lines: Receiver<String>,
}

impl Controller {
    fn start(etcd: &str) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dejavud"))
            .args(["controller", "--etcd", etcd, "--cluster", "ha-test", "--listen", "127.0.0.1:0"])
            .args(["--timeout-ms", "300", "--lease-secs", "1"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Self { process: Killed(child), lines }
    }

    /// The address it serves at once it leads, waiting up to `patience`.
    fn leading(&self, patience: Duration) -> Option<SocketAddr> {
        let until = Instant::now() + patience;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            let line = self.lines.recv_timeout(left).ok()?;
            if let Some(addr) = line.strip_prefix("listening ") {
                return Some(addr.trim().parse().unwrap());
            }
        }
    }

    fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on the pid of a child this test started and has not reaped.
        let rc = unsafe { libc::kill(self.process.0.id() as i32, signal) };
        assert_eq!(rc, 0);
    }
}

fn sidecar(index: u32, controller: SocketAddr, dir: &Path) -> Killed {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dejavud"))
        .args(["sidecar", "--index", &index.to_string(), "--heartbeat", &controller.to_string()])
        .arg("--local")
        .arg(dir.join(format!("s{index}.sock")))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert!(line.starts_with("listening"), "{line}");
    Killed(child)
}

fn wait_until(addr: SocketAddr, what: &str, done: impl Fn(&Census) -> bool) -> Census {
    let mut client = ControllerClient::new(addr, Duration::from_secs(5), DEFAULT_SECRET.as_bytes());
    let started = Instant::now();
    loop {
        if let Ok(census) = client.census() {
            if done(&census) {
                return census;
            }
        }
        assert!(started.elapsed() < Duration::from_secs(30), "never {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The record the leader keeps in etcd, as text.
fn record_in_etcd(etcd: &str) -> String {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let endpoints: Vec<&str> = etcd.split(',').collect();
        let mut client = etcd_client::Client::connect(endpoints, None).await.unwrap();
        let found = client.get("/dejavu/ha-test/record", None).await.unwrap();
        found.kvs().first().map(|kv| kv.value_str().unwrap().to_owned()).unwrap_or_default()
    })
}

#[test]
fn one_controller_leads_a_successor_goes_on_from_etcd_and_a_paused_leader_is_fenced() {
    let dir = tempfile::tempdir().unwrap();
    let (_etcd, endpoints) = etcd_cluster(dir.path());

    // The first to campaign leads; the second stands by.
    let first = Controller::start(&endpoints);
    let a = first.leading(Duration::from_secs(30)).expect("the first controller leads");
    let second = Controller::start(&endpoints);
    assert_eq!(second.leading(Duration::from_secs(2)), None, "a second leader while the first lives");

    // A member beats to the leader, dies, and is fenced in epoch 1.
    let member = sidecar(0, a, dir.path());
    wait_until(a, "sidecar 0 alive", |c| c.health((Role::Sidecar, 0)) == Health::Alive);
    drop(member);
    wait_until(a, "sidecar 0 fenced", |c| c.is_fenced((Role::Sidecar, 0)) && c.epoch == 1);

    // The leader is killed: the second takes over, from the record the first kept in etcd.
    drop(first);
    let b = second.leading(Duration::from_secs(30)).expect("the second controller takes over");
    let census = wait_until(b, "the record carried over", |c| c.epoch == 1);
    assert!(census.is_fenced((Role::Sidecar, 0)), "{census:?}");
    assert!(record_in_etcd(&endpoints).contains("incarnation 2"));

    // A member of the second leader's; then the leader is paused past its lease, and a third
    // controller takes over.
    let member = sidecar(1, b, dir.path());
    wait_until(b, "sidecar 1 alive", |c| c.health((Role::Sidecar, 1)) == Health::Alive);
    second.signal(libc::SIGSTOP);
    let third = Controller::start(&endpoints);
    let c = third.leading(Duration::from_secs(30)).expect("a third controller takes over");
    // The member dies meanwhile: the new leader fences it in a new epoch.
    drop(member);
    let census = wait_until(c, "sidecar 1 fenced by the new leader", |c| c.is_fenced((Role::Sidecar, 1)));
    let epoch = census.epoch;
    assert!(epoch >= 2, "{census:?}");

    // The paused leader comes back: it cannot write, and stops without issuing an epoch.
    second.signal(libc::SIGCONT);
    let mut old = second.process;
    let started = Instant::now();
    let status = loop {
        if let Some(status) = old.0.try_wait().unwrap() {
            break status;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "the old leader never stopped");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(DEPOSED_EXIT));
    let record = record_in_etcd(&endpoints);
    assert!(record.starts_with(&format!("epoch {epoch}\n")), "{record}");
    assert!(record.contains("incarnation 3"), "{record}");
    let census = wait_until(c, "the new leader still serving", |c| c.epoch == epoch);
    assert!(census.is_fenced((Role::Sidecar, 1)));
}
