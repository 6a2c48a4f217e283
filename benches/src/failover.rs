//! Controller failover on etcd: two `dejavud controller --etcd` processes on a local 3-member
//! etcd cluster, one leading and one standing by; the leader is SIGKILLed, and the time until the
//! standby serves (it prints `listening`) is one failover. A new standby is started each time.
//! The limit is the lease's TTL plus one heartbeat interval: a dead leader's lease expires within
//! its TTL, and the next must take over within a heartbeat of that.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use dejavud::etcd_cluster::EtcdCluster;

use crate::Row;

/// The lease TTL the controllers ask for, in seconds (etcd grants at least its own minimum).
const LEASE_SECS: u64 = 2;

/// The members' heartbeat interval, the default.
const HEARTBEAT: Duration = Duration::from_millis(100);

/// A controller process and the lines it prints.
struct Controller {
    child: Child,
    lines: Receiver<String>,
}

impl Controller {
    fn start(exe: &Path, etcd: &str) -> Result<Self, String> {
        let mut child = Command::new(exe)
            .args(["controller", "--etcd", etcd, "--cluster", "bench", "--listen", "127.0.0.1:0"])
            .args(["--lease-secs", &LEASE_SECS.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start a controller: {e}"))?;
        let out = BufReader::new(child.stdout.take().ok_or("no standard output")?);
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Ok(Self { child, lines })
    }

    /// Waits for a line starting with `prefix`.
    fn says(&self, prefix: &str) -> Result<(), String> {
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(30))
                .map_err(|_| format!("a controller never said {prefix:?}"))?;
            if line.starts_with(prefix) {
                return Ok(());
            }
        }
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The p50 and p99 rows of `failovers` failovers with controllers started from `exe`, and a note.
pub fn measure(exe: &Path, failovers: usize) -> Result<(Vec<Row>, String), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let etcd = EtcdCluster::start(dir.path(), 3).map_err(|e| e.to_string())?;
    let mut leader = Controller::start(exe, etcd.endpoints())?;
    leader.says("listening ")?;
    let mut standby = Controller::start(exe, etcd.endpoints())?;
    standby.says("standby ")?;
    let mut times = Vec::with_capacity(failovers);
    for _ in 0..failovers {
        let killed = Instant::now();
        drop(leader);
        standby.says("listening ")?;
        times.push(killed.elapsed().as_secs_f64() * 1e3);
        leader = standby;
        standby = Controller::start(exe, etcd.endpoints())?;
        standby.says("standby ")?;
    }
    times.sort_by(f64::total_cmp);
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    let limit = (Duration::from_secs(LEASE_SECS) + HEARTBEAT).as_secs_f64() * 1e3;
    let row = |name: &str, value: f64| Row {
        name: format!(
            "controller failover on etcd, {name} of {failovers} (leader SIGKILLed until the next serves)"
        ),
        value,
        unit: "ms",
        limit_name: format!("the lease TTL ({LEASE_SECS} s) plus one heartbeat"),
        limit,
        target: 1.0,
        higher_is_better: false,
    };
    let rows = vec![row("p50", at(0.5)), row("p99", at(0.99))];
    let note = format!(
        "controller failover: a local 3-member etcd cluster, two controllers (one leading, one standing by), \
         the leader SIGKILLed {failovers} times; fastest {:.0} ms, slowest {:.0} ms",
        times[0],
        times[times.len() - 1]
    );
    Ok((rows, note))
}
