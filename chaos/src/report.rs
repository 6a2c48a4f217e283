//! What a chaos run reports: per fault class what was injected, survived and violated; recovery
//! times as percentiles; recompute, slowdowns, false detections; as a table or JSON.

use std::fmt::Write as _;
use std::time::Duration;

use dejavud::driver::{RecoveryRecord, Run};
use serde::Serialize;

use crate::check::Violation;
use crate::inject::Injected;
use crate::scenario::{FaultKind, RecoveredBy};

/// Percentiles of a set of durations, in milliseconds (nearest rank).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

impl Percentiles {
    /// Of `values` (all zeros when empty).
    pub fn of(values: impl IntoIterator<Item = Duration>) -> Self {
        let mut ms: Vec<f64> = values.into_iter().map(|d| d.as_secs_f64() * 1e3).collect();
        if ms.is_empty() {
            return Self::default();
        }
        ms.sort_by(f64::total_cmp);
        let rank = |p: f64| ms[((p * ms.len() as f64).ceil() as usize).clamp(1, ms.len()) - 1];
        Self { p50: rank(0.50), p90: rank(0.90), p99: rank(0.99), max: ms[ms.len() - 1] }
    }
}

/// One fault class.
#[derive(Clone, Debug, Serialize)]
pub struct ClassRow {
    /// The class.
    pub class: FaultKind,
    /// Faults of this class injected.
    pub injected: u64,
    /// Of those, how many no violation was blamed on.
    pub survived: u64,
    /// Of those, how many a violation was blamed on.
    pub violated: u64,
}

/// A violation and the fault it is blamed on (the last one injected at or before its step; none
/// for findings about a whole run, such as leaks).
#[derive(Clone, Debug, Serialize)]
pub struct Blamed {
    /// The violation.
    #[serde(flatten)]
    pub violation: Violation,
    /// The fault class blamed, if any fault came before it.
    pub blamed: Option<FaultKind>,
}

/// Everything a chaos run found.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The scenario's name.
    pub scenario: String,
    /// The seed of its random faults (rerun with `--seed` to reproduce a violation).
    pub seed: u64,
    /// Pipeline stages (the token pipeline's, with a prompt pipeline).
    pub stages: u32,
    /// Stages of the prompt pipeline, if the cluster has one.
    pub prompt_stages: Option<u32>,
    /// Whether each worker ran in a network namespace of its own (otherwise all on loopback).
    pub namespaces: bool,
    /// Who carried out the recoveries.
    pub recovered_by: RecoveredBy,
    /// Tokens generated per run.
    pub tokens: u64,
    /// Per fault class.
    pub classes: Vec<ClassRow>,
    /// Recoveries carried out.
    pub recoveries: usize,
    /// Recoveries the driver found between steps, started by the controller while no step failed
    /// (a sidecar that died or stopped while its engine computed on).
    pub between_steps: usize,
    /// From first sending the step that failed to the dead stage named, over the recoveries a
    /// failed step started.
    pub detection_ms: Percentiles,
    /// From detection to the KV restored and the lagging steps recomputed.
    pub restore_ms: Percentiles,
    /// Running the interrupted step again.
    pub resume_ms: Percentiles,
    /// The three together.
    pub recovery_ms: Percentiles,
    /// Steps recomputed per failure, mean.
    pub recomputed_mean: f64,
    /// Steps recomputed per failure, most.
    pub recomputed_max: u64,
    /// Steps a stage's copies lacked at a failure (its replication lag, summed over its
    /// sequences), most, over the stages whose copies survived.
    pub replication_lag_max: u64,
    /// Recoveries of a stage no fault had hit since its last recovery.
    pub false_detections: u64,
    /// Recoveries that found a stage's copies dead with it (adjacent workers) and recomputed its
    /// sequences from their prompts: the ring cannot cover that failure.
    pub copies_lost: usize,
    /// Recoveries that took more than one attempt: a fault hit an attempt (another stage died
    /// during it, say) and the next one recovered its victims too.
    pub retried_recoveries: usize,
    /// Steps sent again because a link lost them (no stage died).
    pub repeated_steps: u64,
    /// Controllers started to replace one that died or stopped answering.
    pub controller_restarts: u64,
    /// Heartbeats from fenced processes that the controller ignored (stale workers back).
    pub stale_heartbeats: u64,
    /// Prompts the prompt pipeline failed to hand over, computed by the token pipeline instead
    /// (disaggregated clusters).
    pub prompt_fallbacks: u64,
    /// Spare processes recoveries made the dead stages' instead of starting processes.
    pub spares_used: u64,
    /// Failure-free run, seconds.
    pub failure_free_s: f64,
    /// The run with faults, recovered, seconds.
    pub with_faults_s: f64,
    /// The same faults with restart from scratch, seconds (when that baseline ran).
    pub restart_s: Option<f64>,
    /// Every violation.
    pub violations: Vec<Blamed>,
    /// Every fault carried out in the run with recovery.
    pub injected: Vec<Injected>,
    /// Whether no invariant was violated.
    pub passed: bool,
}

/// The fault blamed for something seen at `step`: the last one injected at or before it, by its
/// position among the faults injected (nothing is blamed for what has no step).
fn blame(injected: &[Injected], step: Option<u64>) -> Option<usize> {
    let step = step?;
    injected.iter().rposition(|i| i.step <= step)
}

/// Stages recovered that no kill or pause (not yet answered by a recovery) had hit.
fn false_detections(recoveries: &[RecoveryRecord], injected: &[Injected], stages: u32) -> u64 {
    // Each process fault, as the stages it hit, until a recovery answers it. A kill armed for a
    // recovery hits when that recovery carries it out (if ever), not when it is armed.
    let mut open: Vec<(u64, Vec<usize>)> = injected
        .iter()
        .filter(|i| i.fault.kind.is_process_fault() && i.fault.kind != FaultKind::KillWorkerInRecovery)
        .map(|i| (i.step, crate::inject::stages_hit(&i.fault, stages)))
        .collect();
    let mut false_ones = 0;
    for r in recoveries {
        open.extend(r.killed_during.iter().map(|&(stage, _)| (r.step, vec![stage])));
        for &(stage, _) in &r.victims {
            let cause = open.iter_mut().find(|(step, hit)| *step <= r.step && hit.contains(&stage));
            match cause {
                Some((_, hit)) => hit.retain(|&s| s != stage),
                None => false_ones += 1,
            }
        }
    }
    false_ones
}

/// The runs of one scenario.
pub struct Runs<'a> {
    /// The failure-free reference.
    pub reference: &'a Run,
    /// The run with faults and recovery (as far as it went).
    pub faulty: &'a Run,
    /// What was injected into it.
    pub injected: Vec<Injected>,
    /// The restart-from-scratch baseline, if it ran and finished.
    pub restart: Option<&'a Run>,
}

/// What a kill armed for a later recovery that never came says of itself.
const NEVER_FIRED: &str = "never carried out: no later recovery of other stages";

/// Notes on each armed kill-in-recovery that no recovery carried out (recoveries carry them out
/// in the order they were armed), so that the report does not count them as survived.
fn mark_unfired_kills(injected: &mut [Injected], recoveries: &[RecoveryRecord]) {
    let fired: usize = recoveries.iter().map(|r| r.killed_during.len()).sum();
    injected
        .iter_mut()
        .filter(|i| i.fault.kind == FaultKind::KillWorkerInRecovery && i.note.is_none())
        .skip(fired)
        .for_each(|i| i.note = Some(NEVER_FIRED.to_owned()));
}

impl Report {
    /// Assembles the report of `runs` and their `violations`.
    pub fn new(
        scenario: &str,
        seed: u64,
        (stages, prompt_stages): (u32, Option<u32>),
        runs: Runs<'_>,
        violations: Vec<Violation>,
    ) -> Self {
        let faulty = runs.faulty;
        let recoveries = &faulty.recoveries;
        let mut runs = runs;
        mark_unfired_kills(&mut runs.injected, recoveries);
        let blamed_faults: Vec<Option<usize>> =
            violations.iter().map(|v| blame(&runs.injected, v.step)).collect();
        let blamed: Vec<Blamed> = violations
            .into_iter()
            .zip(&blamed_faults)
            .map(|(violation, &fault)| Blamed {
                violation,
                blamed: fault.map(|i| runs.injected[i].fault.kind),
            })
            .collect();
        let classes = FaultKind::ALL
            .iter()
            .filter_map(|&class| {
                let of_class = |i: &usize| runs.injected[*i].fault.kind == class;
                // A fault that never took effect was not survived.
                let took_effect = |i: &&Injected| i.note.as_deref() != Some(NEVER_FIRED);
                let injected =
                    runs.injected.iter().filter(|i| i.fault.kind == class).filter(took_effect).count() as u64;
                // Faults, not violations: one fault blamed twice counts once.
                let mut violated: Vec<usize> =
                    blamed_faults.iter().flatten().copied().filter(of_class).collect();
                violated.sort_unstable();
                violated.dedup();
                let violated = violated.len() as u64;
                (injected > 0 || violated > 0).then_some(ClassRow {
                    class,
                    injected,
                    survived: injected.saturating_sub(violated),
                    violated,
                })
            })
            .collect();
        let recomputed: Vec<u64> = recoveries.iter().map(|r| r.recomputed).collect();
        Self {
            scenario: scenario.to_owned(),
            namespaces: false,
            recovered_by: RecoveredBy::default(),
            seed,
            stages,
            prompt_stages,
            tokens: runs.reference.deliveries.len() as u64,
            classes,
            recoveries: recoveries.len(),
            between_steps: recoveries.iter().filter(|r| !r.interrupted).count(),
            detection_ms: Percentiles::of(recoveries.iter().filter(|r| r.interrupted).map(|r| r.detection)),
            restore_ms: Percentiles::of(recoveries.iter().map(|r| r.restore)),
            resume_ms: Percentiles::of(recoveries.iter().map(|r| r.resume)),
            recovery_ms: Percentiles::of(recoveries.iter().map(|r| r.detection + r.restore + r.resume)),
            recomputed_mean: if recomputed.is_empty() {
                0.0
            } else {
                recomputed.iter().sum::<u64>() as f64 / recomputed.len() as f64
            },
            recomputed_max: recomputed.iter().copied().max().unwrap_or(0),
            // Every recovery runs the interrupted step again; the rest is what the copies lacked.
            replication_lag_max: recoveries
                .iter()
                .flat_map(|r| r.lag.iter().filter(|(stage, _)| !r.copies_lost.contains(stage)))
                .map(|&(_, lag)| lag)
                .max()
                .unwrap_or(0),
            false_detections: false_detections(recoveries, &runs.injected, stages),
            copies_lost: recoveries.iter().filter(|r| !r.copies_lost.is_empty()).count(),
            retried_recoveries: recoveries.iter().filter(|r| r.attempts > 1).count(),
            repeated_steps: faulty.repeated_steps,
            controller_restarts: faulty.controller_restarts,
            stale_heartbeats: faulty.stale_heartbeats,
            prompt_fallbacks: faulty.prompt_fallbacks,
            spares_used: faulty.spares_used,
            failure_free_s: runs.reference.elapsed.as_secs_f64(),
            with_faults_s: faulty.elapsed.as_secs_f64(),
            restart_s: runs.restart.map(|r| r.elapsed.as_secs_f64()),
            passed: blamed.is_empty(),
            violations: blamed,
            injected: runs.injected,
        }
    }

    /// The report as a table.
    pub fn to_text(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "scenario {:?}, seed {}, {} stages{}{}, {} tokens, recoveries by the {}",
            self.scenario,
            self.seed,
            self.stages,
            self.prompt_stages.map_or(String::new(), |p| format!(" (tokens; prompts: {p} more)")),
            if self.namespaces { ", each worker in a network namespace" } else { "" },
            self.tokens,
            match self.recovered_by {
                RecoveredBy::Controller => "controller (the harness feeds from its recovery feed)",
                RecoveredBy::Driver => "harness's driver, step by step",
            }
        );
        let _ = writeln!(t, "\n{:<28} {:>9} {:>9} {:>9}", "fault class", "injected", "survived", "violated");
        for row in &self.classes {
            let _ = writeln!(
                t,
                "{:<28} {:>9} {:>9} {:>9}",
                row.class.name(),
                row.injected,
                row.survived,
                row.violated
            );
        }
        let p = |p: &Percentiles| format!("{:8.1} {:8.1} {:8.1} {:8.1}", p.p50, p.p90, p.p99, p.max);
        let _ = writeln!(
            t,
            "\nrecoveries: {} ({} started by the controller between steps, with no step failed)",
            self.recoveries, self.between_steps
        );
        let _ = writeln!(t, "{:<20} {:>8} {:>8} {:>8} {:>8}", "ms", "p50", "p90", "p99", "max");
        let _ = writeln!(t, "{:<20} {}", "detection", p(&self.detection_ms));
        let _ = writeln!(t, "{:<20} {}", "restore", p(&self.restore_ms));
        let _ = writeln!(t, "{:<20} {}", "resume", p(&self.resume_ms));
        let _ = writeln!(t, "{:<20} {}", "total", p(&self.recovery_ms));
        let _ = writeln!(
            t,
            "\nsteps recomputed per failure: mean {:.1}, max {} (replication lag where the copies survived: max {} steps)",
            self.recomputed_mean, self.recomputed_max, self.replication_lag_max
        );
        let _ = writeln!(
            t,
            "false failure detections: {}; steps sent again after a lost frame: {}; controllers replaced: {}; \
             heartbeats of fenced processes ignored: {}",
            self.false_detections, self.repeated_steps, self.controller_restarts, self.stale_heartbeats
        );
        if self.spares_used > 0 {
            let _ = writeln!(t, "spare processes made the dead stages' by recoveries: {}", self.spares_used);
        }
        if self.prompt_fallbacks > 0 {
            let _ = writeln!(
                t,
                "prompts computed by the token pipeline after a failed handoff: {}",
                self.prompt_fallbacks
            );
        }
        if self.copies_lost > 0 {
            let _ = writeln!(
                t,
                "recoveries that lost a stage's copies with its successor (adjacent failures) and \
                 recomputed from the prompts: {}",
                self.copies_lost
            );
        }
        if self.retried_recoveries > 0 {
            let _ = writeln!(
                t,
                "recoveries that a fault hit and another attempt finished (with the new victims): {}",
                self.retried_recoveries
            );
        }
        let slowdown = self.with_faults_s / self.failure_free_s;
        let _ = write!(
            t,
            "time: failure-free {:.2} s, with faults and recovery {:.2} s ({slowdown:.2}x)",
            self.failure_free_s, self.with_faults_s
        );
        match self.restart_s {
            Some(r) => {
                let _ = writeln!(
                    t,
                    ", with faults and restart from scratch {r:.2} s ({:.2}x)",
                    r / self.failure_free_s
                );
            }
            None => t.push('\n'),
        }
        if self.violations.is_empty() {
            let _ = writeln!(t, "\nno invariant violated");
        } else {
            let _ = writeln!(t, "\n{} VIOLATIONS (seed {}):", self.violations.len(), self.seed);
            for b in &self.violations {
                let _ = writeln!(
                    t,
                    "  {}: {} (step {}, blamed on {})",
                    b.violation.invariant,
                    b.violation.detail,
                    b.violation.step.map_or("?".into(), |s| s.to_string()),
                    b.blamed.map_or("no fault", FaultKind::name)
                );
            }
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Fault;
    use dejavud::cluster::Kill;

    fn injected(step: u64, kind: &str, stage: u32) -> Injected {
        let fault: Fault =
            toml::from_str(&format!("at_step = {step}\nkind = \"{kind}\"\nstage = {stage}")).unwrap();
        Injected { step, at_ms: 0.0, fault, note: None }
    }

    fn recovery(step: u64, victims: &[usize], killed_during: &[usize]) -> RecoveryRecord {
        RecoveryRecord {
            victims: victims.iter().map(|&s| (s, Kill::Worker)).collect(),
            epoch: 1,
            copies_lost: Vec::new(),
            lag: Vec::new(),
            step,
            detection: Duration::ZERO,
            restore: Duration::ZERO,
            resume: Duration::ZERO,
            recomputed: 1,
            interrupted: true,
            attempts: 1 + killed_during.len() as u32,
            killed_during: killed_during.iter().map(|&s| (s, Kill::Worker)).collect(),
            transcript: Default::default(),
        }
    }

    #[test]
    fn a_kill_armed_for_a_recovery_hits_when_carried_out_and_is_not_survived_when_never() {
        // Armed at step 5 for stage 3; stage 1 dies at step 8, and stage 3 during its recovery.
        let mut faults = vec![injected(5, "kill-worker-in-recovery", 3), injected(8, "kill-worker", 1)];
        let recoveries = vec![recovery(8, &[1, 3], &[3])];
        assert_eq!(false_detections(&recoveries, &faults, 4), 0);
        // A later recovery of stage 3 alone is a false detection: the armed kill was answered.
        let later = vec![recoveries[0].clone(), recovery(20, &[3], &[])];
        assert_eq!(false_detections(&later, &faults, 4), 1);
        // Armed, never carried out: it answers no recovery, and is marked so.
        faults.push(injected(30, "kill-worker-in-recovery", 2));
        let unfired = vec![recoveries[0].clone(), recovery(40, &[2], &[])];
        assert_eq!(false_detections(&unfired, &faults, 4), 1);
        mark_unfired_kills(&mut faults, &unfired);
        assert_eq!(faults[0].note, None);
        assert_eq!(faults[2].note.as_deref(), Some(NEVER_FIRED));
    }

    #[test]
    fn percentiles_by_nearest_rank() {
        let p = Percentiles::of((1..=100).map(Duration::from_millis));
        assert_eq!((p.p50, p.p90, p.p99, p.max), (50.0, 90.0, 99.0, 100.0));
        let one = Percentiles::of([Duration::from_millis(7)]);
        assert_eq!((one.p50, one.max), (7.0, 7.0));
        assert_eq!(Percentiles::of([]).max, 0.0);
    }
}
