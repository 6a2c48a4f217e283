//! Controllers in high availability on a real 3-member etcd cluster, started on loopback in a
//! temporary directory: one leads and the others stand by; a killed leader's successor goes on
//! from the record the first kept in etcd; members that name every controller follow the leader
//! (their beats and lifelines reach whichever leads); a paused leader, back after its successor
//! took over, cannot write an epoch and stops; a leader stopped by SIGTERM gives the leadership up
//! at once.
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
use dejavud::etcd_cluster::EtcdCluster;

/// A process, killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
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
        self.line("listening ", patience)
    }

    /// Its address, once it says it stands by while another leads.
    fn standing_by(&self) -> SocketAddr {
        self.line("standby ", Duration::from_secs(30)).expect("a controller standing by")
    }

    fn line(&self, prefix: &str, patience: Duration) -> Option<SocketAddr> {
        let until = Instant::now() + patience;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            let line = self.lines.recv_timeout(left).ok()?;
            if let Some(addr) = line.strip_prefix(prefix) {
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

/// A sidecar of stage `index` beating to `controllers`.
fn sidecar(index: u32, controllers: &[SocketAddr], dir: &Path) -> Killed {
    let controllers: Vec<String> = controllers.iter().map(SocketAddr::to_string).collect();
    let mut child = Command::new(env!("CARGO_BIN_EXE_dejavud"))
        .args(["sidecar", "--index", &index.to_string(), "--heartbeat", &controllers.join(",")])
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
fn one_controller_leads_members_follow_the_leader_and_a_paused_leader_is_fenced() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdCluster::start(dir.path(), 3).expect("etcd (Debian's etcd-server) on the PATH");
    let endpoints = etcd.endpoints().to_owned();

    // The first to campaign leads; the second stands by (members can name it already).
    let first = Controller::start(&endpoints);
    let a = first.leading(Duration::from_secs(30)).expect("the first controller leads");
    let second = Controller::start(&endpoints);
    let b = second.standing_by();
    assert_eq!(second.leading(Duration::from_secs(2)), None, "a second leader while the first lives");

    // A member that names both controllers, and one that names the first only, which dies and is
    // fenced in epoch 1.
    let follower = sidecar(0, &[a, b], dir.path());
    let member = sidecar(2, &[a], dir.path());
    wait_until(a, "both members alive", |census| {
        census.health((Role::Sidecar, 0)) == Health::Alive
            && census.health((Role::Sidecar, 2)) == Health::Alive
    });
    drop(member);
    wait_until(a, "sidecar 2 fenced", |census| census.is_fenced((Role::Sidecar, 2)) && census.epoch == 1);

    // The leader is killed: the second takes over, from the record the first kept in etcd.
    drop(first);
    assert_eq!(second.leading(Duration::from_secs(30)), Some(b), "the second controller takes over");
    let census = wait_until(b, "the record carried over", |census| census.epoch == 1);
    assert!(census.is_fenced((Role::Sidecar, 2)), "{census:?}");
    assert!(record_in_etcd(&endpoints).contains("incarnation 2"));
    // The follower's beats reach the new leader: alive past a full timeout (300 ms) after the
    // takeover, and its lifeline moved there, so its death is seen at once.
    std::thread::sleep(Duration::from_millis(900));
    assert_eq!(wait_until(b, "a census", |_| true).health((Role::Sidecar, 0)), Health::Alive);
    drop(follower);
    wait_until(b, "the follower fenced by the new leader", |census| {
        census.is_fenced((Role::Sidecar, 0)) && census.epoch == 2
    });

    // A third controller stands by; a member names the second and the third. The leader is
    // paused past its lease, and the third takes over.
    let third = Controller::start(&endpoints);
    let c = third.standing_by();
    let member = sidecar(1, &[b, c], dir.path());
    wait_until(b, "sidecar 1 alive", |census| census.health((Role::Sidecar, 1)) == Health::Alive);
    second.signal(libc::SIGSTOP);
    assert_eq!(third.leading(Duration::from_secs(30)), Some(c), "the third controller takes over");
    // The member dies: the new leader fences it in a new epoch.
    std::thread::sleep(Duration::from_millis(900));
    drop(member);
    let census = wait_until(c, "sidecar 1 fenced by the new leader", |census| {
        census.is_fenced((Role::Sidecar, 1)) && census.epoch == 3
    });
    let epoch = census.epoch;

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
    let census = wait_until(c, "the new leader still serving", |census| census.epoch == epoch);
    assert!(census.is_fenced((Role::Sidecar, 1)));

    // A leader stopped by SIGTERM gives its leadership up as it exits, without waiting for its
    // lease to lapse: when it is gone, etcd names it leader no more.
    let fourth = Controller::start(&endpoints);
    let d = fourth.standing_by();
    third.signal(libc::SIGTERM);
    let mut stopped = third.process;
    assert_eq!(stopped.0.wait().unwrap().code(), Some(0));
    assert_ne!(leader_in_etcd(&endpoints), Some(c.to_string()), "the stopped leader still leads");
    assert_eq!(fourth.leading(Duration::from_secs(30)), Some(d), "the fourth controller takes over");
}

/// The address the cluster's election names as its leader, if any.
fn leader_in_etcd(etcd: &str) -> Option<String> {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let endpoints: Vec<&str> = etcd.split(',').collect();
        let mut client = etcd_client::Client::connect(endpoints, None).await.unwrap();
        let leader = client.leader("/dejavu/ha-test/leader").await.ok()?;
        leader.kv().map(|kv| kv.value_str().unwrap().to_owned())
    })
}
