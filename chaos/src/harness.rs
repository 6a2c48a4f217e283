//! One chaos run: the failure-free reference, the run with the scenario's faults and DéjàVu
//! recovery, and (optionally) the same faults with restart from scratch, each on a fresh cluster of
//! real processes behind fault-injecting proxies; then the invariants and the report.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dejavu_engine::ModelConfig;
use dejavud::cluster::{
    Cluster, ClusterConfig, ControlPlane, Disaggregation, EtcdControllers, Recoveries, SpillLimits,
    TransportKind,
};
use dejavud::driver::{drive, DriverConfig, Failed, OnFailure, Run, Workload};
use dejavud::etcd_cluster::EtcdCluster;
use dejavud::netns::{Fabric, NetnsError};

use crate::check::{check, Violation};
use crate::control_plane;
use crate::inject::{plan, ChaosInjector, Injected};
use crate::proxy::Proxies;
use crate::report::{Report, Runs};
use crate::scenario::{Fault, RecoveredBy, Scenario, Transport, WorkloadShape};

/// How to run a scenario.
#[derive(Clone, Debug)]
pub struct Options {
    /// Overrides the scenario's seed.
    pub seed: Option<u64>,
    /// The executable with the `stage` and `sidecar` subcommands (`dejavud`, or this harness).
    pub exe: PathBuf,
    /// Network namespaces for the workers, if the scenario runs them on hosts of their own (see
    /// [`ClusterShape::namespaces`](crate::scenario::ClusterShape::namespaces)).
    pub fabric: Option<Arc<Fabric>>,
}

impl Options {
    /// Options for `scenario` started from `exe`: a fabric of network namespaces is made when it
    /// asks for one (or `namespaces` does), which needs root.
    pub fn new(scenario: &Scenario, exe: PathBuf, namespaces: bool) -> Result<Self, NetnsError> {
        let fabric =
            if namespaces || scenario.cluster.namespaces { Some(Arc::new(Fabric::create()?)) } else { None };
        Ok(Self { seed: None, exe, fabric })
    }
}

/// The requests `shape` describes, with the prompt lengths drawn from `seed` where it asks.
fn workload(shape: &WorkloadShape, seed: u64, vocab: u32) -> Workload {
    let mut workload = Workload::synthetic(shape.requests, shape.prompt_tokens, shape.new_tokens, 4, vocab);
    if let Some(longest) = shape.prompt_tokens_max {
        // Apart from the faults' draws: the same seed with other lengths gives the same faults.
        workload = workload.with_prompt_lengths_up_to(longest, seed ^ PROMPT_LENGTHS, vocab);
    }
    if let Some(seats) = shape.seats {
        workload = workload.in_seats(seats);
    }
    workload
}

/// Mixed into the seed for the prompt lengths.
const PROMPT_LENGTHS: u64 = 0x7072_6f6d_7074;

/// Runs `scenario`, reporting progress through `say`. An error means the harness itself could not
/// run (the failure-free reference did not finish); faults that break the cluster are violations
/// in the report.
pub fn run(scenario: &Scenario, options: &Options, mut say: impl FnMut(&str)) -> Result<Report, Failed> {
    let seed = options.seed.unwrap_or(scenario.seed);
    let model = ModelConfig::reference();
    let w = &scenario.workload;
    let workload = workload(w, seed, model.vocab);
    let faults = plan(scenario, seed, workload.steps());
    // Findings about whole runs (leaks, a baseline that did not finish): no fault is blamed.
    let mut whole_runs = Vec::new();
    let baseline = Resources::now();

    say("failure-free reference run...");
    let (reference, _, control) = one_run(scenario, options, seed, &workload, &[], OnFailure::Recover);
    let reference = reference?;
    whole_runs.extend(control);
    whole_runs.extend(baseline.leaked_by("the failure-free run"));

    say(&format!("run with {} faults, recovered...", faults.len()));
    let (faulty, injected, control) =
        one_run(scenario, options, seed, &workload, &faults, OnFailure::Recover);
    whole_runs.extend(control);
    whole_runs.extend(baseline.leaked_by("the run with faults"));

    let restart = if scenario.limits.restart_baseline && faults.iter().any(|f| f.kind.is_process_fault()) {
        say("the same faults, restarted from scratch...");
        let (restart, _, control) = one_run(scenario, options, seed, &workload, &faults, OnFailure::Restart);
        whole_runs.extend(control);
        whole_runs.extend(baseline.leaked_by("the restart baseline"));
        match restart {
            Ok(run) => Some(run),
            Err(e) => {
                whole_runs.push(Violation {
                    invariant: "run completes",
                    detail: format!("the restart-from-scratch baseline did not finish: {e}"),
                    step: None,
                });
                None
            }
        }
    } else {
        None
    };

    let (faulty, failure) = match faulty {
        Ok(run) => (run, None),
        Err(Failed { error, run }) => (*run, Some(error.to_string())),
    };
    let mut violations = check(&reference, &faulty, failure.as_deref(), &scenario.limits);
    violations.extend(whole_runs);
    let runs = Runs { reference: &reference, faulty: &faulty, injected, restart: restart.as_ref() };
    let mut report = Report::new(
        &scenario.name,
        seed,
        (scenario.cluster.stages, scenario.cluster.prompt_stages),
        runs,
        violations,
    );
    report.namespaces = options.fabric.is_some();
    report.recovered_by = scenario.cluster.recoveries;
    Ok(report)
}

/// One run on fresh proxies and clusters (and a fresh etcd cluster for controllers on etcd), with
/// `faults` (none for the reference); everything it started is gone when it returns. Also returns
/// the control plane's violations (see [`control_plane`]), with controllers on etcd.
fn one_run(
    scenario: &Scenario,
    options: &Options,
    seed: u64,
    workload: &Workload,
    faults: &[Fault],
    on_failure: OnFailure,
) -> (Result<Run, Failed>, Vec<Injected>, Vec<Violation>) {
    let gateway = options.fabric.as_ref().map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |f| f.gateway());
    let proxies = Arc::new(Proxies::on(gateway, seed));
    let replicate = on_failure == OnFailure::Recover;
    let mut config = cluster_config(scenario, options, workload, &proxies, replicate);
    config.sabotage_replicas =
        !faults.is_empty() && replicate && scenario.cluster.test_only_sabotage_replicas;
    let driver = DriverConfig {
        on_failure,
        detect_patience: Duration::from_millis(scenario.cluster.heartbeat_ms * 6),
        watch_every: Duration::from_millis(scenario.cluster.heartbeat_ms),
        retries: scenario.limits.retries,
    };
    let shape = &scenario.cluster;
    let mut etcd = match shape.on_etcd().then(|| LocalEtcd::start(shape.etcd_members)).transpose() {
        Ok(etcd) => etcd,
        Err(e) => {
            let error = dejavud::cluster::ClusterError::Io(e);
            return (Err(Failed { error: error.into(), run: Box::default() }), Vec::new(), Vec::new());
        }
    };
    let mut injector = ChaosInjector::new(faults, &proxies, on_failure);
    if let Some(etcd) = &mut etcd {
        config.control_plane = ControlPlane::Etcd(EtcdControllers {
            endpoints: etcd.cluster.client_addrs(),
            controllers: shape.controllers,
            lease_secs: shape.lease_secs,
        });
        injector = injector.on_etcd(&mut etcd.cluster, shape.etcd_members);
    }
    let result = drive(workload, &driver, &mut || Cluster::start(config.clone()), &mut injector);
    let injected = injector.injected;
    let control = etcd.map_or_else(Vec::new, |etcd| {
        let lives = match &result {
            Ok(run) => &run.controllers,
            Err(failed) => &failed.run.controllers,
        };
        match control_plane::history(&etcd.cluster.live_client_addrs()) {
            Ok(events) => control_plane::check(&events, lives),
            Err(detail) => vec![Violation { invariant: "etcd history read", detail, step: None }],
        }
    });
    (result, injected, control)
}

/// A local etcd cluster in a temporary directory of its own, both gone when dropped.
struct LocalEtcd {
    cluster: EtcdCluster,
    dir: std::path::PathBuf,
}

impl LocalEtcd {
    fn start(members: u32) -> std::io::Result<Self> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name =
            format!("dejavu-chaos-etcd-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let dir = etcd_data_dir(&name)?;
        let cluster = EtcdCluster::start(&dir, members as usize)?;
        Ok(Self { cluster, dir })
    }
}

/// A new directory `name` for a local etcd's data: in memory where the machine has a tmpfs at
/// `/dev/shm`, so that the members' fsyncs (each write, on the leader and on the followers) do not
/// wait behind a disk the rest of a loaded machine shares, which can hold an election past the
/// controllers' lease; under the temporary directory elsewhere.
fn etcd_data_dir(name: &str) -> std::io::Result<std::path::PathBuf> {
    let in_memory = std::path::Path::new("/dev/shm").join(name);
    match std::fs::create_dir_all(&in_memory) {
        Ok(()) => Ok(in_memory),
        Err(_) => {
            let dir = std::env::temp_dir().join(name);
            std::fs::create_dir_all(&dir)?;
            Ok(dir)
        }
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        // Its members first: they write there until they die.
        self.cluster.kill_all();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn cluster_config(
    scenario: &Scenario,
    options: &Options,
    workload: &Workload,
    proxies: &Arc<Proxies>,
    replicate: bool,
) -> ClusterConfig {
    let layers = ModelConfig::reference().layers;
    let even = |stages: u32| (0..stages).map(|s| s * layers / stages..(s + 1) * layers / stages).collect();
    // The prompt pipeline hands prompts to the sidecars: without replication (the restart
    // baseline) the token pipeline computes them.
    let disaggregation = scenario
        .cluster
        .prompt_stages
        .filter(|_| replicate)
        .map(|p| Disaggregation { splits: even(p), slots: scenario.cluster.prompt_slots });
    ClusterConfig {
        splits: even(scenario.cluster.stages),
        disaggregation,
        slots: workload.slots,
        microbatches: workload.microbatches(),
        max_tokens: workload.max_tokens(),
        step_time: Duration::from_secs_f64(scenario.cluster.step_ms / 1e3),
        replicate,
        deadline: Duration::from_millis(scenario.cluster.deadline_ms),
        heartbeat: Duration::from_millis(scenario.cluster.heartbeat_ms),
        device_caches: scenario.cluster.device_caches,
        spares: scenario.cluster.spares,
        transport: match scenario.cluster.transport {
            Transport::Tcp => TransportKind::Tcp,
            Transport::Quic => TransportKind::Quic,
        },
        spill: scenario
            .cluster
            .spill_memory_bytes
            .map(|memory_bytes| SpillLimits { memory_bytes, dir_bytes: scenario.cluster.spill_dir_bytes }),
        interpose: Some(proxies.clone()),
        fabric: options.fabric.clone(),
        recoveries: match scenario.cluster.recoveries {
            RecoveredBy::Controller => Recoveries::ByController,
            RecoveredBy::Driver => Recoveries::Driven,
        },
        ..ClusterConfig::new(options.exe.clone())
    }
}

/// What a run must give back: child processes and open file descriptors (threads, sockets,
/// pidfds, proxies).
struct Resources {
    descriptors: usize,
}

impl Resources {
    fn now() -> Self {
        Self { descriptors: open_descriptors() }
    }

    /// A violation if, after a run, child processes are still alive or this process holds more
    /// descriptors than before it (given a second for the threads that close them to notice).
    fn leaked_by(&self, run: &str) -> Option<Violation> {
        let deadline = Instant::now() + Duration::from_secs(1);
        loop {
            let (children, descriptors) = (children_of(std::process::id()), open_descriptors());
            if children.is_empty() && descriptors <= self.descriptors {
                return None;
            }
            if Instant::now() >= deadline {
                return Some(Violation {
                    invariant: "no leaks",
                    detail: format!(
                        "after {run}: {} child processes alive {children:?}, {descriptors} descriptors open \
                         (before: {})",
                        children.len(),
                        self.descriptors
                    ),
                    step: None,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Descriptors this process has open.
fn open_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// The live (not zombie) children of process `parent`, from /proc.
pub fn children_of(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
            // After the command name (which may hold spaces, so find its closing parenthesis):
            // state, then the parent's pid.
            let mut fields =
                stat.rsplit_once(')').map(|(_, rest)| rest.split_whitespace()).into_iter().flatten();
            let state = fields.next();
            let ppid = fields.next().and_then(|p| p.parse::<u32>().ok());
            ppid == Some(parent) && state != Some("Z")
        })
        .collect()
}
