//! The running recovery procedure ([`dejavu_proto::recovery::Recovery`]) under faults: the machine
//! the cluster supervisor drives, carried out against a model of a ring whose processes die during
//! the recovery itself.
//!
//! The model keeps, for every stage, whether its engine and sidecar live, and whether each of the
//! two copies of its KV is whole: the local copy in its own sidecar, and the replica in its ring
//! successor's. A dead sidecar loses both the copies it held; a replacement sidecar starts empty.
//! The controller fences and plans from what it fenced in its epoch, as `dejavud controller`
//! does. Steps fail as they would on real processes: a start, a repair or a restore that needs a
//! dead process, a controller that cannot be reached. Faults are injected before random steps:
//! an engine or a whole worker dies (a victim's replacement included), the controller is
//! unreachable once, or the census the shell reports after a failure misses the newest death.
//! A recovery that ends with stages still dead (they died after the last step that needed them)
//! is followed by another, as the driver's next detection would start.
//!
//! Invariants, checked as the run goes:
//! - a step fails only when a fault was injected in its attempt or a process died that no census
//!   has named yet (the machine never orders what a healthy cluster cannot do), and never because
//!   a death a census named is not among the victims;
//! - every fence is in an epoch not older than the attempt asks for, and each attempt that fenced
//!   is in a newer epoch than the one before;
//! - every replacement starts in an epoch not older than its member's fence;
//! - no restore or re-seed reads a copy that does not hold the stage's KV (a replaced sidecar
//!   before it was re-seeded or restored into);
//! - once the recoveries are over, every process lives and every stage's KV has both its copies;
//! - a recovery gives up only after as many failed attempts as it is allowed.

use std::collections::BTreeMap;

use dejavu_proto::liveness::{Member, Role};
use dejavu_proto::plan::{self, Loss, Reseed, Source, StagePlan};
use dejavu_proto::recovery::{Answer, Recovery, RecoveryConfig, Step, DEFAULT_ATTEMPTS};
use dejavu_proto::rng::SplitMix64;

/// The shape and fault rate of a recovery run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RecoverySimConfig {
    /// Stages in the ring.
    pub depth: u32,
    /// Chance of a fault before each step.
    pub fault: f64,
    /// Faults at most in one run.
    pub max_faults: u32,
}

impl Default for RecoverySimConfig {
    fn default() -> Self {
        Self { depth: 4, fault: 0.1, max_faults: 4 }
    }
}

impl RecoverySimConfig {
    /// A shape and rate drawn from `seed`.
    pub fn varied(seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed ^ 0x2ec0_7e2c_0000_0000);
        Self {
            depth: 1 + rng.below(6) as u32,
            fault: [0.02, 0.1, 0.25][rng.below(3) as usize],
            max_faults: 1 + rng.below(6) as u32,
        }
    }
}

/// What a recovery run found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Invariants broken, in order.
    pub violations: Vec<String>,
    /// Recoveries run (first ones and follow-ups).
    pub recoveries: u32,
    /// Attempts that failed and were tried again.
    pub retries: u32,
    /// Recoveries that gave up.
    pub given_up: u32,
    /// Faults injected, by class.
    pub faults: BTreeMap<&'static str, u32>,
}

/// The ring as the processes hold it.
#[derive(Clone, Debug)]
struct World {
    depth: u32,
    engine: Vec<bool>,
    sidecar: Vec<bool>,
    /// Stage `s`'s local copy, in sidecar `s`, is whole.
    own: Vec<bool>,
    /// Stage `s`'s replica, in sidecar `s + 1`, is whole.
    replica: Vec<bool>,
    /// The controller's epoch, the members it fenced last, and each member's fence.
    epoch: u64,
    last_fenced: Vec<Member>,
    fenced_in: BTreeMap<Member, u64>,
    /// The controller cannot be reached by the next request.
    controller_down: bool,
}

impl World {
    fn new(depth: u32) -> Self {
        let n = depth as usize;
        Self {
            depth,
            engine: vec![true; n],
            sidecar: vec![true; n],
            own: vec![true; n],
            replica: vec![true; n],
            epoch: 0,
            last_fenced: Vec::new(),
            fenced_in: BTreeMap::new(),
            controller_down: false,
        }
    }

    fn predecessor(&self, stage: u32) -> usize {
        ((stage + self.depth - 1) % self.depth) as usize
    }

    fn kill(&mut self, stage: u32, loss: Loss) {
        self.engine[stage as usize] = false;
        if loss == Loss::Worker {
            self.sidecar_gone(stage);
        }
    }

    /// Sidecar `stage` is dead or replaced: the copies it held are gone.
    fn sidecar_gone(&mut self, stage: u32) {
        self.sidecar[stage as usize] = false;
        self.own[stage as usize] = false;
        let predecessor = self.predecessor(stage);
        self.replica[predecessor] = false;
    }

    /// Every stage with a dead process, as a census names it.
    fn dead(&self) -> Vec<(u32, Loss)> {
        (0..self.depth)
            .filter_map(|s| match (self.engine[s as usize], self.sidecar[s as usize]) {
                (_, false) => Some((s, Loss::Worker)),
                (false, true) => Some((s, Loss::Engine)),
                (true, true) => None,
            })
            .collect()
    }

    fn healthy(&self) -> bool {
        self.dead().is_empty()
    }

    /// The controller's plan for its current epoch, from what it fenced in it.
    fn planned(&self, epoch: u64) -> Vec<StagePlan> {
        let fenced = |member: Member| self.fenced_in.get(&member) == Some(&epoch);
        let losses: Vec<(u32, Loss)> = (0..self.depth)
            .filter_map(|s| {
                if fenced((Role::Sidecar, s)) {
                    Some((s, Loss::Worker))
                } else {
                    fenced((Role::Engine, s)).then_some((s, Loss::Engine))
                }
            })
            .collect();
        plan::ring(self.depth, &losses)
    }
}

/// Why a step could not be carried out.
struct StepFailed;

struct Run {
    rng: SplitMix64,
    cfg: RecoverySimConfig,
    world: World,
    report: RecoveryReport,
    faults_left: u32,
    /// A fault was injected in the current attempt.
    faulted_in_attempt: bool,
    /// The census after the next failure misses the newest death.
    census_lags: bool,
    newest_death: Option<(u32, Loss)>,
}

/// Runs one seed of the recovery machine.
pub fn run_recovery_seed(seed: u64, cfg: &RecoverySimConfig) -> RecoveryReport {
    let mut run = Run {
        rng: SplitMix64::new(seed),
        cfg: *cfg,
        world: World::new(cfg.depth),
        report: RecoveryReport::default(),
        faults_left: cfg.max_faults,
        faulted_in_attempt: false,
        census_lags: false,
        newest_death: None,
    };
    // The failure that starts it: one or two stages, an engine or a whole worker each.
    for _ in 0..1 + run.rng.below(2) {
        let (stage, loss) = run.any_stage();
        run.world.kill(stage, loss);
    }
    let mut last_epoch = 0;
    // Follow-up recoveries, for deaths no step of the previous one needed; bounded, since each
    // starts only after a fault.
    while !run.world.healthy() && run.report.recoveries <= cfg.max_faults + 1 {
        run.report.recoveries += 1;
        last_epoch = run.recover(last_epoch);
    }
    let world = run.world.clone();
    if !world.healthy() {
        let dead = world.dead();
        run.violation(format!("the recoveries ended with {dead:?} dead"));
    } else if run.report.given_up == 0 {
        for s in 0..cfg.depth as usize {
            if !(world.own[s] && world.replica[s]) {
                let (own, replica) = (world.own[s], world.replica[s]);
                run.violation(format!(
                    "stage {s}'s copies after the recoveries: own {own}, replica {replica}"
                ));
            }
        }
    }
    run.report
}

impl Run {
    fn violation(&mut self, what: String) {
        self.report.violations.push(what);
    }

    fn any_stage(&mut self) -> (u32, Loss) {
        let stage = self.rng.below(u64::from(self.cfg.depth)) as u32;
        (stage, if self.rng.chance(0.5) { Loss::Engine } else { Loss::Worker })
    }

    fn count(&mut self, class: &'static str) {
        *self.report.faults.entry(class).or_insert(0) += 1;
        self.faulted_in_attempt = true;
        self.faults_left -= 1;
    }

    fn maybe_fault(&mut self) {
        if self.faults_left == 0 || !self.rng.chance(self.cfg.fault) {
            return;
        }
        match self.rng.below(4) {
            0 | 1 => {
                let (stage, loss) = self.any_stage();
                self.world.kill(stage, loss);
                self.newest_death = Some((stage, loss));
                self.count(if loss == Loss::Worker { "worker killed" } else { "engine killed" });
            }
            2 => {
                self.world.controller_down = true;
                self.count("controller unreachable");
            }
            _ => {
                self.census_lags = true;
                let (stage, loss) = self.any_stage();
                self.world.kill(stage, loss);
                self.newest_death = Some((stage, loss));
                self.count("death the census misses");
            }
        }
    }

    /// Runs one recovery of the stages now dead; returns the epoch it ended in.
    fn recover(&mut self, last_epoch: u64) -> u64 {
        let config = RecoveryConfig { depth: self.cfg.depth, last_epoch, attempts: DEFAULT_ATTEMPTS };
        let mut recovery = match Recovery::new(config, &self.world.dead()) {
            Ok(recovery) => recovery,
            Err(e) => {
                self.violation(format!("the recovery of {:?} was refused: {e}", self.world.dead()));
                return last_epoch;
            }
        };
        self.faulted_in_attempt = false;
        let mut reported = self.world.dead();
        let mut attempt_epochs: Vec<u64> = Vec::new();
        let mut failures = 0;
        loop {
            let step = recovery.step().clone();
            let answer = match &step {
                Step::Done(outcome) => {
                    if outcome.attempts != failures + 1 {
                        self.violation(format!(
                            "{} attempts reported after {failures} failures",
                            outcome.attempts
                        ));
                    }
                    return outcome.epoch;
                }
                Step::GiveUp { attempts, .. } => {
                    if *attempts != DEFAULT_ATTEMPTS || failures != DEFAULT_ATTEMPTS {
                        self.violation(format!("gave up after {attempts} attempts, {failures} failed"));
                    }
                    // Whoever drives the pipeline starts everything again.
                    self.report.given_up += 1;
                    self.world = World { epoch: self.world.epoch, ..World::new(self.cfg.depth) };
                    return self.world.epoch;
                }
                step => {
                    self.maybe_fault();
                    self.carry_out(step, &mut attempt_epochs)
                }
            };
            match answer {
                Ok(answer) => {
                    if let Err(e) = recovery.complete(answer) {
                        self.violation(format!("the machine refused the answer to {step:?}: {e}"));
                        return self.world.epoch;
                    }
                }
                Err(StepFailed) => {
                    let victims = recovery.victims();
                    // A victim is replaced whole: a process of it dead again is accounted for.
                    let covered =
                        |&(stage, loss): &(u32, Loss)| victims.iter().any(|&(s, l)| s == stage && l >= loss);
                    let unaccounted: Vec<(u32, Loss)> =
                        self.world.dead().into_iter().filter(|dead| !covered(dead)).collect();
                    if let Some(ignored) = unaccounted.iter().find(|dead| reported.contains(dead)) {
                        self.violation(format!(
                            "{step:?} failed: {ignored:?}, reported dead, is not a victim"
                        ));
                    } else if !self.faulted_in_attempt && unaccounted.is_empty() {
                        self.violation(format!("{step:?} failed on a cluster with no new fault"));
                    }
                    let mut census = self.world.dead();
                    if std::mem::take(&mut self.census_lags) {
                        census.retain(|&dead| Some(dead) != self.newest_death);
                    }
                    reported.extend(census.iter().copied());
                    failures += 1;
                    self.report.retries += 1;
                    self.faulted_in_attempt = false;
                    // An outage lasts one request: one that failed the attempt before it was
                    // tried is over.
                    self.world.controller_down = false;
                    recovery.fail(&census);
                }
            }
        }
    }

    /// Carries `step` out on the model, checking what it reads.
    fn carry_out(&mut self, step: &Step, attempt_epochs: &mut Vec<u64>) -> Result<Answer, StepFailed> {
        let w = &mut self.world;
        let mut violations = Vec::new();
        let answer = match step {
            Step::Fence { members, lowest } => {
                if std::mem::take(&mut w.controller_down) {
                    return Err(StepFailed);
                }
                let epoch = if w.last_fenced == *members && w.epoch >= *lowest {
                    w.epoch
                } else {
                    w.epoch = (w.epoch + 1).max(*lowest);
                    w.last_fenced = members.clone();
                    for &member in members {
                        w.fenced_in.insert(member, w.epoch);
                    }
                    w.epoch
                };
                if epoch < *lowest {
                    violations.push(format!("fenced in {epoch}, below the attempt's {lowest}"));
                }
                if attempt_epochs.last().is_some_and(|&last| epoch <= last) {
                    violations.push(format!("an attempt fenced in {epoch} after one in {attempt_epochs:?}"));
                }
                attempt_epochs.push(epoch);
                Answer::Fenced(epoch)
            }
            Step::Retire { victims } => {
                for &(stage, loss) in victims {
                    w.kill(stage, loss);
                }
                Answer::Retired
            }
            &Step::Start { member, epoch } => {
                if w.fenced_in.get(&member).is_some_and(|&fence| epoch < fence) {
                    violations.push(format!("{member:?} started in {epoch}, before its fence"));
                }
                let stage = member.1;
                match member.0 {
                    Role::Sidecar => {
                        w.sidecar_gone(stage);
                        w.sidecar[stage as usize] = true;
                    }
                    // An engine restores and forwards through its sidecar.
                    Role::Engine if !w.sidecar[stage as usize] => return Err(StepFailed),
                    Role::Engine => w.engine[stage as usize] = true,
                }
                Answer::Started(member)
            }
            Step::Repair { .. } => {
                if w.engine.contains(&false) {
                    return Err(StepFailed);
                }
                Answer::Repaired
            }
            &Step::CarryOut { epoch } => {
                if std::mem::take(&mut w.controller_down) || epoch != w.epoch {
                    return Err(StepFailed);
                }
                let plans = w.planned(epoch);
                for p in &plans {
                    if let Some((from, Reseed::Now)) = p.reseed {
                        let (from, to) = (from as usize, p.stage as usize);
                        if !w.sidecar[from] || !w.sidecar[to] {
                            return Err(StepFailed);
                        }
                        if !w.own[from] {
                            violations.push(format!("stage {to} re-seeded from {from}'s empty sidecar"));
                        }
                        w.replica[from] = w.own[from];
                    }
                    let holder = match p.source {
                        Source::Own => Some(p.stage),
                        Source::Successor(holder) => Some(holder),
                        Source::Lost => None,
                    };
                    if holder.is_some_and(|h| !w.sidecar[h as usize]) {
                        return Err(StepFailed);
                    }
                }
                Answer::CarriedOut(plans)
            }
            Step::Restore { plans, .. } => {
                // The steps the copies lack are recomputed through the whole chain.
                if w.engine.contains(&false) || w.sidecar.contains(&false) {
                    return Err(StepFailed);
                }
                for p in plans {
                    let whole = match p.source {
                        Source::Own => w.own[p.stage as usize],
                        Source::Successor(_) => w.replica[p.stage as usize],
                        Source::Lost => true,
                    };
                    if !whole {
                        violations.push(format!(
                            "stage {} restored from {:?}, which lacks its KV",
                            p.stage, p.source
                        ));
                    }
                }
                for p in plans {
                    let stage = p.stage as usize;
                    w.own[stage] = true;
                    // Its copies reach its successor's sidecar, unless that one waits to be
                    // re-seeded after the restores.
                    let successor = (p.stage + 1) % w.depth;
                    let waits = plans
                        .iter()
                        .any(|q| q.stage == successor && q.reseed == Some((p.stage, Reseed::AfterRestore)));
                    if !waits {
                        w.replica[stage] = true;
                    }
                }
                Answer::Restored
            }
            &Step::ReseedRestored { epoch } => {
                if std::mem::take(&mut w.controller_down) || epoch != w.epoch {
                    return Err(StepFailed);
                }
                for p in w.planned(epoch) {
                    if let Some((from, Reseed::AfterRestore)) = p.reseed {
                        let (from, to) = (from as usize, p.stage as usize);
                        if !w.sidecar[from] || !w.sidecar[to] {
                            return Err(StepFailed);
                        }
                        if !w.own[from] {
                            violations.push(format!(
                                "stage {to} re-seeded after the restores from {from}'s empty sidecar"
                            ));
                        }
                        w.replica[from] = w.own[from];
                    }
                }
                Answer::Reseeded
            }
            Step::Done(_) | Step::GiveUp { .. } => unreachable!("the recovery is over"),
        };
        self.report.violations.extend(violations);
        Ok(answer)
    }
}
