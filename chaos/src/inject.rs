//! The fault plan of a run (the scheduled faults and those drawn from the seed, by step) and the
//! injector that carries it out on a cluster before each step, recording what it did and when.

use std::time::{Duration, Instant};

use dejavud::cluster::{Cluster, ClusterError, Kill, Link, RecoveryHooks, Role};
use dejavud::driver::{Injector, OnFailure};
use dejavud::etcd_cluster::EtcdCluster;
use serde::Serialize;

use crate::hooks::ScheduledFaults;
use crate::proxy::{NetFault, Proxies};
use crate::scenario::{Fault, FaultKind, LinkKind, Scenario, Transport};
use dejavu_proto::rng::SplitMix64;

/// The faults of a scenario with `seed`, by step: the scheduled ones, and for each of `steps`
/// steps one drawn with the random rate (process faults at least `min_gap_steps` apart).
pub fn plan(scenario: &Scenario, seed: u64, steps: u64) -> Vec<Fault> {
    let mut faults = scenario.faults.clone();
    if let Some(random) = &scenario.random {
        let mut rng = SplitMix64::new(seed);
        let stages = scenario.cluster.stages as u64;
        let mut last_process_fault: Option<u64> = None;
        for step in 0..steps {
            if !rng.chance(random.rate) {
                continue;
            }
            let kind = random.kinds[rng.below(random.kinds.len() as u64) as usize];
            if !kind.is_network_fault() && last_process_fault.is_some_and(|s| step - s < random.min_gap_steps)
            {
                continue;
            }
            // The proxies carry TCP: QUIC replica links take no network faults.
            let replica = rng.chance(0.5) && scenario.cluster.transport == Transport::Tcp;
            let link = if replica { LinkKind::Replica } else { LinkKind::Activation };
            // Drawn faults stay between the cluster's processes; the driver's own links (into
            // stage 0, back from the last stage) take scheduled faults.
            let senders =
                if kind.is_network_fault() && link == LinkKind::Activation { stages - 1 } else { stages };
            let stage = rng.below(senders) as u32;
            if !kind.is_network_fault() {
                last_process_fault = Some(step);
            }
            faults.push(Fault {
                at_step: step,
                kind,
                stage: (!kind.is_controller_fault()).then_some(stage),
                link,
                duration_ms: random.duration_ms,
                delay_ms: 5,
                jitter_ms: 5,
                bytes_per_s: 1 << 20,
            });
        }
    }
    faults.sort_by_key(|f| f.at_step);
    faults
}

/// A fault as it was carried out.
#[derive(Clone, Debug, Serialize)]
pub struct Injected {
    /// The step it came before (its planned step, or the first step sent after it).
    pub step: u64,
    /// Milliseconds from the run's start.
    pub at_ms: f64,
    /// The fault.
    pub fault: Fault,
    /// How it was carried out, when not as planned (in a restart-from-scratch run there are no
    /// sidecars and no replica links).
    pub note: Option<String>,
}

/// Carries out a plan before each step.
pub struct ChaosInjector<'a> {
    plan: &'a [Fault],
    next: usize,
    proxies: &'a Proxies,
    on_failure: OnFailure,
    started: Instant,
    /// The faults scheduled inside the next recoveries.
    in_recovery: ScheduledFaults,
    /// The etcd cluster the controllers keep their state in, if they do, with its members' count.
    etcd: Option<(&'a mut EtcdCluster, u32)>,
    /// etcd members killed so far (the first ones).
    etcd_killed: u32,
    /// What was done, in order.
    pub injected: Vec<Injected>,
}

impl<'a> ChaosInjector<'a> {
    /// An injector of `plan` through `proxies`, for a run that recovers or restarts.
    pub fn new(plan: &'a [Fault], proxies: &'a Proxies, on_failure: OnFailure) -> Self {
        Self {
            plan,
            next: 0,
            proxies,
            on_failure,
            started: Instant::now(),
            in_recovery: ScheduledFaults::default(),
            etcd: None,
            etcd_killed: 0,
            injected: Vec::new(),
        }
    }

    /// The same, for controllers on `etcd`, a cluster of `members` members.
    pub fn on_etcd(self, etcd: &'a mut EtcdCluster, members: u32) -> Self {
        Self { etcd: Some((etcd, members)), ..self }
    }

    fn apply(&mut self, step: u64, fault: Fault, cluster: &mut Cluster) -> Result<(), ClusterError> {
        let stage = fault.stage() as usize;
        let lasting = Duration::from_millis(fault.duration_ms);
        let mut note = None;
        let link = match fault.link {
            LinkKind::Activation => Link::Activation { from: fault.stage() },
            LinkKind::Replica => Link::Replica { from: fault.stage() },
            LinkKind::Input => Link::Input,
        };
        let restarting = self.on_failure == OnFailure::Restart;
        match fault.kind {
            FaultKind::KillEngine => cluster.faults().kill(stage, Kill::Engine)?,
            FaultKind::KillWorker if restarting => {
                note = Some("no sidecars without replication: the engine alone".to_owned());
                cluster.faults().kill(stage, Kill::Engine)?;
            }
            FaultKind::KillWorker => cluster.faults().kill(stage, Kill::Worker)?,
            FaultKind::KillSidecar if restarting => {
                note = Some("no sidecars without replication: skipped".to_owned());
            }
            FaultKind::KillSidecar => cluster.faults().signal(stage, Role::Sidecar, libc::SIGKILL)?,
            FaultKind::KillAdjacent => {
                let what = if restarting { Kill::Engine } else { Kill::Worker };
                let hits: Vec<(usize, Kill)> =
                    stages_hit(&fault, cluster.len() as u32).into_iter().map(|hit| (hit, what)).collect();
                cluster.faults().kill_together(&hits)?;
            }
            FaultKind::PauseEngine => cluster.faults().pause(stage, Role::Engine, lasting)?,
            FaultKind::PauseSidecar if restarting => {
                note = Some("no sidecars without replication: skipped".to_owned());
            }
            FaultKind::PauseSidecar => cluster.faults().pause(stage, Role::Sidecar, lasting)?,
            FaultKind::StaleSidecar if restarting => {
                note = Some("no sidecars without replication: skipped".to_owned());
            }
            FaultKind::StaleSidecar => {
                cluster.faults().pause(stage, Role::Sidecar, lasting)?;
                self.in_recovery.spare_presumed_dead_in_next_recovery();
            }
            FaultKind::StaleRejoin => {
                cluster.faults().pause(stage, Role::Engine, lasting)?;
                self.in_recovery.spare_presumed_dead_in_next_recovery();
            }
            FaultKind::FillSpill if restarting => {
                note = Some("no sidecars without replication: skipped".to_owned());
            }
            FaultKind::FillSpill => cluster.faults().fill_spill(stage, lasting)?,
            FaultKind::KillController => cluster.faults().kill_controller()?,
            FaultKind::PauseController => cluster.faults().pause_controller(lasting)?,
            FaultKind::KillControllerInRecovery => self.in_recovery.crash_controller_in_next_recovery(),
            FaultKind::KillWorkerInRecovery if restarting => {
                note = Some("no recovery without replication: skipped".to_owned());
            }
            FaultKind::KillWorkerInRecovery => self.in_recovery.kill_in_next_recovery(stage, Kill::Worker),
            FaultKind::CutLeaderFromEtcd => {
                let members = self.etcd.as_ref().map_or(0, |e| e.1);
                let controller = cluster.leading_controller();
                note = Some(format!("controller {controller} cut off"));
                for member in 0..members {
                    let cut = NetFault::Stall { both: true, lasting };
                    self.proxies.inject(Link::Etcd { controller, member }, cut);
                }
            }
            FaultKind::KillEtcdMember => {
                let Some((etcd, _)) = self.etcd.as_mut() else {
                    return Err(ClusterError::Invalid("kill-etcd-member needs controllers on etcd".into()));
                };
                let member = self.etcd_killed;
                etcd.kill_member(member as usize);
                // Its machine is gone: what stood in front of it refuses, as it would.
                let controllers = cluster.controllers();
                for controller in 0..controllers {
                    self.proxies.inject(Link::Etcd { controller, member }, NetFault::Down);
                }
                note = Some(format!("etcd member {} killed", self.etcd_killed));
                self.etcd_killed += 1;
            }
            _ if restarting && fault.link == LinkKind::Replica => {
                note = Some("no replica links without replication: skipped".to_owned());
            }
            kind => self.proxies.inject(link, net_fault(kind, &fault, lasting)),
        }
        self.injected.push(Injected { step, at_ms: self.started.elapsed().as_secs_f64() * 1e3, fault, note });
        Ok(())
    }
}

/// The stages a process fault hits.
pub fn stages_hit(fault: &Fault, stages: u32) -> Vec<usize> {
    match fault.kind {
        FaultKind::KillAdjacent => vec![fault.stage() as usize, ((fault.stage() + 1) % stages) as usize],
        _ if fault.kind.is_controller_fault() => Vec::new(),
        _ => vec![fault.stage() as usize],
    }
}

fn net_fault(kind: FaultKind, fault: &Fault, lasting: Duration) -> NetFault {
    match kind {
        FaultKind::Delay => NetFault::Delay {
            delay: Duration::from_millis(fault.delay_ms),
            jitter: Duration::from_millis(fault.jitter_ms),
            lasting,
        },
        FaultKind::Bandwidth => NetFault::Bandwidth { bytes_per_s: fault.bytes_per_s, lasting },
        FaultKind::Partition => NetFault::Stall { both: true, lasting },
        FaultKind::OneWayPartition => NetFault::Stall { both: false, lasting },
        FaultKind::Reset => NetFault::Reset,
        FaultKind::Corrupt => NetFault::Corrupt,
        FaultKind::Truncate => NetFault::Truncate,
        kind => unreachable!("{} is not a network fault", kind.name()),
    }
}

impl Injector for ChaosInjector<'_> {
    fn before_step(&mut self, step: u64, cluster: &mut Cluster) -> Result<(), ClusterError> {
        while let Some(&fault) = self.plan.get(self.next).filter(|f| f.at_step <= step) {
            self.next += 1;
            self.apply(step, fault, cluster)?;
        }
        Ok(())
    }

    fn recovery_hooks(&mut self) -> Option<&mut dyn RecoveryHooks> {
        Some(&mut self.in_recovery)
    }

    fn killed_in_recovery(&mut self) -> Vec<(usize, Kill)> {
        self.in_recovery.take_killed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCENARIO: &str = r#"
        name = "t"
        [cluster]
        stages = 3
        [[fault]]
        at_step = 5
        kind = "kill-worker"
        stage = 1
        [random]
        rate = 0.3
        kinds = ["kill-engine", "reset", "corrupt"]
        min_gap_steps = 4
    "#;

    #[test]
    fn a_plan_is_reproducible_from_its_seed_and_keeps_its_rules() {
        let scenario = Scenario::parse(SCENARIO).unwrap();
        let plan = super::plan(&scenario, 9, 200);
        assert_eq!(plan, super::plan(&scenario, 9, 200));
        assert_ne!(plan, super::plan(&scenario, 10, 200));
        assert!(plan.windows(2).all(|w| w[0].at_step <= w[1].at_step));
        assert!(plan.iter().any(|f| f.at_step == 5 && f.kind == FaultKind::KillWorker));
        for f in &plan {
            assert!(f.stage() < 3);
            if f.link == LinkKind::Activation && f.kind.is_network_fault() {
                assert!(f.stage() < 2, "no drawn fault on the last stage's link to the driver");
            }
        }
        let kills: Vec<u64> =
            plan.iter().filter(|f| f.kind == FaultKind::KillEngine).map(|f| f.at_step).collect();
        assert!(kills.len() > 3);
        assert!(kills.windows(2).all(|w| w[1] - w[0] >= 4));
    }
}
