//! Controller failover on etcd: two `dejavud controller --etcd` processes on a local 3-member
//! etcd cluster, one leading and one standing by; the leader is SIGKILLed, and the time until the
//! standby serves (it prints `listening`) is one failover. A new standby is started each time.
//! The limit is the lease's TTL plus one heartbeat interval: a dead leader's lease expires within
//! its TTL, and the next must take over within a heartbeat of that.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use dejavud::etcd_cluster::EtcdCluster;
use dejavud::metrics::{scrape, value_of};

use crate::controller_load::{wait_for, Load, SECRET};
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
            .args(["--lease-secs", &LEASE_SECS.to_string(), "--metrics", "127.0.0.1:0"])
            .env("DEJAVU_SECRET", SECRET)
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

    /// Waits for a line starting with `prefix`; returns the rest of it.
    fn says(&self, prefix: &str) -> Result<String, String> {
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(30))
                .map_err(|_| format!("a controller never said {prefix:?}"))?;
            if let Some(rest) = line.strip_prefix(prefix) {
                return Ok(rest.trim().to_owned());
            }
        }
    }

    /// Waits for a line `prefix ADDR`; returns the address.
    fn address(&self, prefix: &str) -> Result<SocketAddr, String> {
        let rest = self.says(prefix)?;
        rest.parse().map_err(|e| format!("{prefix}{rest}: {e}"))
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

/// Members beating to the controllers while the leader is killed: one of them is silenced at the
/// same instant, and its detection by the next leader is timed from the kill.
const DETECTION_MEMBERS: u32 = 100;

/// The silence after which a controller declares a member dead (its default).
const TIMEOUT: Duration = Duration::from_millis(300);

/// The median and slowest of `runs` detections of a member that died as the leading controller was
/// SIGKILLed, by the controller that took over, against the lease TTL plus one heartbeat plus the
/// silence timeout; and a note.
pub fn measure_detection(exe: &Path, runs: usize) -> Result<(Vec<Row>, String), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let etcd = EtcdCluster::start(dir.path(), 3).map_err(|e| e.to_string())?;
    let mut leader = Controller::start(exe, etcd.endpoints())?;
    leader.says("metrics ")?;
    let mut leading = leader.address("listening ")?;
    let mut standby = Controller::start(exe, etcd.endpoints())?;
    let mut standing = standby.address("standby ")?;
    let load = Load::start(vec![leading, standing], DETECTION_MEMBERS)?;
    // Every member heard (and so in the record) before the first kill.
    std::thread::sleep(Duration::from_secs(1));
    let mut times = Vec::with_capacity(runs);
    for member in 0..runs as u32 {
        load.silence(member);
        let killed = Instant::now();
        drop(leader);
        let metrics = standby.address("metrics ")?;
        standby.says("listening ")?;
        let detected = || {
            let page = scrape(metrics).map_err(|e| e.to_string())?;
            Ok(value_of(&page, "dejavu_controller_detections_total", &[]).unwrap_or(0.0) >= 1.0)
        };
        wait_for(Duration::from_secs(30), detected)
            .map_err(|e| format!("member {member} never declared dead by the new leader: {e}"))?;
        times.push(killed.elapsed().as_secs_f64() * 1e3);
        (leader, leading) = (standby, standing);
        standby = Controller::start(exe, etcd.endpoints())?;
        standing = standby.address("standby ")?;
        load.beat_to(vec![leading, standing]);
        // The new standby hears every member before the next kill.
        std::thread::sleep(Duration::from_millis(500));
    }
    times.sort_by(f64::total_cmp);
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    let limit = (Duration::from_secs(LEASE_SECS) + HEARTBEAT + TIMEOUT).as_secs_f64() * 1e3;
    let row = |name: &str, value: f64| {
        Row {
        name: format!(
            "a member dead as the leading controller is SIGKILLed, declared dead by the next leader, {name} of {runs}"
        ),
        value,
        unit: "ms",
        limit_name: format!("the lease TTL ({LEASE_SECS} s) plus one heartbeat plus the silence timeout"),
        limit,
        target: 1.0,
        higher_is_better: false,
    }
    };
    let note = format!(
        "detection during a failover: {DETECTION_MEMBERS} members beating to both controllers, one silenced as \
         the leader was SIGKILLed, {runs} times; from the kill to the next leader's detection {:.0} to {:.0} ms",
        times[0],
        times[times.len() - 1]
    );
    Ok((vec![row("p50", at(0.5)), row("p99", at(0.99))], note))
}
