//! One chaos run: the failure-free reference, the run with the scenario's faults and DéjàVu
//! recovery, and (optionally) the same faults with restart from scratch, each on a fresh cluster of
//! real processes behind fault-injecting proxies; then the invariants and the report.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dejavu_engine::cluster::{Cluster, ClusterConfig, ClusterError};
use dejavu_engine::driver::{drive, no_faults, DriveError, DriverConfig, OnFailure, Workload};
use dejavu_engine::ModelConfig;

use crate::check::{check, Violation};
use crate::inject::{plan, ChaosInjector};
use crate::proxy::Proxies;
use crate::report::{Report, Runs};
use crate::scenario::Scenario;

/// How to run a scenario.
#[derive(Clone, Debug)]
pub struct Options {
    /// Overrides the scenario's seed.
    pub seed: Option<u64>,
    /// The executable with the `stage` and `sidecar` subcommands (`dejavud`, or this harness).
    pub exe: PathBuf,
}

/// Runs `scenario`, reporting progress through `say`. An error means the harness itself could not
/// run (a cluster that never started); faults that break the cluster are violations in the report.
pub fn run(scenario: &Scenario, options: &Options, mut say: impl FnMut(&str)) -> Result<Report, DriveError> {
    let seed = options.seed.unwrap_or(scenario.seed);
    let model = ModelConfig::reference();
    let w = &scenario.workload;
    let workload = Workload::synthetic(w.requests, w.prompt_tokens, w.new_tokens, 4, model.vocab);
    let faults = plan(scenario, seed, workload.steps());
    let driver = |on_failure| DriverConfig {
        on_failure,
        detect_patience: Duration::from_millis(scenario.cluster.heartbeat_ms * 6),
        retries: scenario.limits.retries,
    };
    let mut leaks = Vec::new();

    say("failure-free reference run...");
    let proxies = Arc::new(Proxies::new(seed));
    let config = cluster_config(scenario, options, &workload, &proxies, true);
    let reference = drive(&workload, &driver(OnFailure::Recover), &mut starter(&config), &mut no_faults)?;
    drop(proxies);
    leaks.extend(leaked("the failure-free run"));

    say(&format!("run with {} faults, recovered...", faults.len()));
    let proxies = Arc::new(Proxies::new(seed));
    let mut config = cluster_config(scenario, options, &workload, &proxies, true);
    config.sabotage_replicas = scenario.cluster.test_only_sabotage_replicas;
    let mut injector = ChaosInjector::new(&faults, &proxies, OnFailure::Recover);
    let faulty = drive(&workload, &driver(OnFailure::Recover), &mut starter(&config), &mut injector);
    let injected = injector.injected;
    drop(proxies);
    leaks.extend(leaked("the run with faults"));

    let restart =
        if scenario.limits.restart_baseline && faults.iter().any(|f| f.fault.kind.is_process_fault()) {
            say("the same faults, restarted from scratch...");
            let proxies = Arc::new(Proxies::new(seed));
            let config = cluster_config(scenario, options, &workload, &proxies, false);
            let mut injector = ChaosInjector::new(&faults, &proxies, OnFailure::Restart);
            let restart = drive(&workload, &driver(OnFailure::Restart), &mut starter(&config), &mut injector);
            drop(proxies);
            leaks.extend(leaked("the restart baseline"));
            match restart {
                Ok(run) => Some(run),
                Err(e) => {
                    say(&format!("the restart baseline did not finish: {e}"));
                    None
                }
            }
        } else {
            None
        };

    let faulty_result = faulty.as_ref().map_err(|e| e.to_string());
    let mut violations = check(&reference, faulty_result.clone(), &scenario.limits);
    violations.extend(leaks);
    let runs = Runs { reference: &reference, faulty: faulty_result, injected, restart: restart.as_ref() };
    Ok(Report::new(&scenario.name, seed, scenario.cluster.stages, runs, violations))
}

fn cluster_config(
    scenario: &Scenario,
    options: &Options,
    workload: &Workload,
    proxies: &Arc<Proxies>,
    replicate: bool,
) -> ClusterConfig {
    let (layers, stages) = (ModelConfig::reference().layers, scenario.cluster.stages);
    ClusterConfig {
        splits: (0..stages).map(|s| s * layers / stages..(s + 1) * layers / stages).collect(),
        slots: workload.slots,
        microbatches: workload.microbatches(),
        max_tokens: workload.max_tokens(),
        replicate,
        deadline: Duration::from_millis(scenario.cluster.deadline_ms),
        heartbeat: Duration::from_millis(scenario.cluster.heartbeat_ms),
        interpose: Some(proxies.clone()),
        ..ClusterConfig::new(options.exe.clone())
    }
}

fn starter(config: &ClusterConfig) -> impl FnMut() -> Result<Cluster, ClusterError> + '_ {
    move || Cluster::start(config.clone())
}

/// A violation for each child process still alive after a run's cluster was dropped.
fn leaked(run: &str) -> Vec<Violation> {
    let children = children_of(std::process::id());
    if children.is_empty() {
        return Vec::new();
    }
    vec![Violation {
        invariant: "no leaks",
        detail: format!("{} processes left behind by {run}: {children:?}", children.len()),
        step: None,
    }]
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
