//! Controller failover on etcd: two `dejavud controller --etcd` processes on a local 3-member
//! etcd cluster, one leading and one standing by; the leader is SIGKILLed, and the time until the
//! standby serves (it prints `listening`) is one failover. A new standby is started each time.
//! The limit is the lease's TTL plus one heartbeat interval: a dead leader's lease expires within
//! its TTL, and the next must take over within a heartbeat of that. The standby does better when
//! the leader's process is gone: its address refuses connections, and the standby revokes its
//! lease at its next probe (`dejavud::controller::PROBE_EVERY`).

use std::path::Path;
use std::time::{Duration, Instant};

use dejavud::etcd_cluster::EtcdCluster;

use crate::controller_load::{wait_for, Load};
use crate::controller_process::{metric, ControllerProcess};
use crate::Row;

/// The lease TTL the controllers ask for, in seconds (etcd grants at least its own minimum).
const LEASE_SECS: u64 = 2;

/// The members' heartbeat interval, the default.
const HEARTBEAT: Duration = Duration::from_millis(100);

/// A controller of the benchmark's cluster on the etcd cluster at `etcd`.
fn controller(exe: &Path, etcd: &str) -> Result<ControllerProcess, String> {
    let args = ["--etcd", etcd, "--cluster", "bench", "--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0"];
    let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    args.push(format!("--lease-secs={LEASE_SECS}"));
    ControllerProcess::start(exe, &args)
}

/// The p50 and p99 rows of `failovers` failovers with controllers started from `exe`, and a note.
pub fn measure(exe: &Path, failovers: usize) -> Result<(Vec<Row>, String), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let etcd = EtcdCluster::start(dir.path(), 3).map_err(|e| e.to_string())?;
    let mut leader = controller(exe, etcd.endpoints())?;
    leader.says("listening ")?;
    let mut standby = controller(exe, etcd.endpoints())?;
    standby.says("standby ")?;
    let mut times = Vec::with_capacity(failovers);
    for _ in 0..failovers {
        let killed = Instant::now();
        drop(leader);
        standby.says("listening ")?;
        times.push(killed.elapsed().as_secs_f64() * 1e3);
        leader = standby;
        standby = controller(exe, etcd.endpoints())?;
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
    let mut leader = controller(exe, etcd.endpoints())?;
    leader.says("metrics ")?;
    let mut leading = leader.address("listening ")?;
    let mut standby = controller(exe, etcd.endpoints())?;
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
        let detected =
            || Ok(metric(metrics, "dejavu_controller_detections_total", &[]).unwrap_or(0.0) >= 1.0);
        wait_for(Duration::from_secs(30), detected)
            .map_err(|e| format!("member {member} never declared dead by the new leader: {e}"))?;
        times.push(killed.elapsed().as_secs_f64() * 1e3);
        (leader, leading) = (standby, standing);
        standby = controller(exe, etcd.endpoints())?;
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
