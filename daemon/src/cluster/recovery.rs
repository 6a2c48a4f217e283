//! Failure detection as the driver sees it (the controller's census) and the recovery procedure
//! that replaces dead workers and resumes their sequences ([`Cluster::recover_all`]): a shell that
//! carries out the steps [`dejavu_proto::recovery::Recovery`] decides.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use dejavu_proto::plan::{Loss, Source};
use dejavu_proto::recovery::{Answer, Input, Outcome, Recovery, RecoveryConfig, Step, Transcript};
use dejavulib::message::StageOrders;

use super::{
    Cluster, ClusterError, Kill, Link, NoHooks, Recoveries, RecoveryHooks, Role, Sequence, RECOVERY_PATIENCE,
};
use crate::controller::{Census, ControllerClient, ControllerError, Member};
use crate::proc::Spawned;
use crate::process::RestoreSource;

impl Cluster {
    /// Every stage whose engine or sidecar has fallen silent: the engine alone, or the whole
    /// worker when its sidecar is silent (an engine without its sidecar can neither keep nor
    /// forward its KV, so it is fenced and replaced with it).
    pub fn dead(&mut self) -> Result<Vec<(usize, Kill)>, ClusterError> {
        let census = self.census()?;
        Ok(self.dead_in(&census))
    }

    /// The stages whose engine or sidecar the controller fenced and which await their
    /// replacements: the victims of the recovery it started, if any.
    pub fn fenced(&mut self) -> Result<Vec<(usize, Kill)>, ClusterError> {
        let census = self.census()?;
        Ok(self.victims_in(&census, Census::is_fenced))
    }

    fn dead_in(&self, census: &Census) -> Vec<(usize, Kill)> {
        self.victims_in(census, Census::is_dead)
    }

    /// The stages whose engine or sidecar is `down` in `census`, and what of each to replace.
    pub(super) fn victims_in(
        &self,
        census: &Census,
        down: fn(&Census, Member) -> bool,
    ) -> Vec<(usize, Kill)> {
        (0..self.len() as u32)
            .filter_map(|stage| {
                let sidecar_down = self.config.replicate && down(census, (Role::Sidecar, stage));
                match (down(census, (Role::Engine, stage)), sidecar_down) {
                    (_, true) => Some((stage as usize, Kill::Worker)),
                    (true, false) => Some((stage as usize, Kill::Engine)),
                    (false, false) => None,
                }
            })
            .collect()
    }

    /// Waits at most `patience` for the controller to start a recovery, and returns its victims:
    /// the stages whose engine or sidecar it declared dead and fenced (empty if it fenced none).
    /// The controller fences a member whose lifeline broke after a short settling wait, and one
    /// silent for the heartbeat timeout after waiting for members silent for half of it to beat
    /// again or die too, so that workers that died together are recovered together. A
    /// controller replaced meanwhile has heard from no one yet: the patience starts again with it.
    pub fn detect(&mut self, patience: Duration) -> Result<Vec<(usize, Kill)>, ClusterError> {
        let mut start = Instant::now();
        loop {
            let changes = self.controllers.changes();
            let census = self.census()?;
            if self.controllers.changes() != changes {
                start = Instant::now();
            }
            let fenced = self.victims_in(&census, Census::is_fenced);
            if !fenced.is_empty() || start.elapsed() >= patience {
                return Ok(fenced);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Replaces dead stage `victim` and recovers every sequence on it; see
    /// [`Cluster::recover_all`]. Returns the steps recomputed.
    pub fn recover(
        &mut self,
        victim: usize,
        what: Kill,
        sequences: &[Sequence<'_>],
    ) -> Result<u64, ClusterError> {
        Ok(self.recover_all(&[(victim, what)], sequences)?.recomputed)
    }

    /// Replaces the dead stages `victims` and recovers every sequence on them, following the
    /// steps of [`dejavu_proto::recovery::Recovery`]:
    ///
    /// 1. the controller fences the presumed-dead processes in a new epoch (durably, so a
    ///    controller crash cannot undo it; when it declared exactly them dead itself, since the
    ///    last recovery started, they are fenced already and its epoch is the recovery's), they
    ///    are killed (unless spared, see
    ///    [`RecoveryHooks::leave_presumed_dead_running`]: the epoch keeps them out), and
    ///    replacement sidecars start for the ones that died;
    /// 2. replacement engines start (the last first, so each knows where to send) and the chain is
    ///    repaired around them;
    /// 3. the controller carries out its part ([`ControllerClient::recover`]): it plans the ring,
    ///    has the live predecessor sidecar of each replaced sidecar re-seed it and forward there
    ///    from now on (before anything is recomputed, so the recomputed steps' copies land there
    ///    too), and finds each sequence's first unreplicated token in each restore source;
    /// 4. each replacement restores each sequence's KV up to that mark, from its own sidecar if
    ///    that survived or from its successor's, and the steps the copies lacked are recomputed.
    ///    When the successor died too (adjacent workers), that copy is gone: the ring cannot
    ///    restore the stage, and its sequences are recomputed from their prompts
    ///    ([`Recovered::copies_lost`] says so);
    /// 5. the controller has the new sidecar of a replaced predecessor of a replaced sidecar
    ///    re-seed it, now that it holds the restored KV ([`ControllerClient::reseed_restored`]).
    ///
    /// A step that fails starts a new attempt, in a newer epoch, with every stage the controller
    /// names dead meanwhile added to the victims; after [`RECOVERY_ATTEMPTS`] the last failure is
    /// returned.
    pub fn recover_all(
        &mut self,
        victims: &[(usize, Kill)],
        sequences: &[Sequence<'_>],
    ) -> Result<Recovered, ClusterError> {
        self.recover_with(&mut NoHooks, victims, sequences)
    }

    /// As [`Cluster::recover_all`], calling `hooks` at each of its points (the chaos harness
    /// injects its faults there).
    pub fn recover_with(
        &mut self,
        hooks: &mut dyn RecoveryHooks,
        victims: &[(usize, Kill)],
        sequences: &[Sequence<'_>],
    ) -> Result<Recovered, ClusterError> {
        if self.sidecars.is_empty() {
            return Err(ClusterError::Invalid("recovery needs replication".into()));
        }
        if self.config.recoveries == Recoveries::ByController {
            return self.recover_by_controller(hooks, victims, sequences);
        }
        let losses: Vec<(u32, Loss)> =
            victims.iter().map(|&(stage, what)| (stage as u32, what.into())).collect();
        let config = RecoveryConfig {
            depth: self.len() as u32,
            last_epoch: self.remote.epoch(),
            attempts: RECOVERY_ATTEMPTS,
        };
        let mut recovery = Recovery::new(config.clone(), &losses)?;
        let mut transcript = Transcript { config: Some(config), victims: losses, ..Transcript::default() };
        let used = self.spares.used;
        let mut attempt = Attempt::default();
        let mut failures: Vec<ClusterError> = Vec::new();
        loop {
            let step = recovery.step().clone();
            transcript.steps.push(step.clone());
            let answer = match step {
                Step::Done(outcome) => {
                    // The spares used are replaced in the background, off the recovery.
                    let (stages, sidecars) = (self.spares.used.0 - used.0, self.spares.used.1 - used.1);
                    self.start_spares((stages, sidecars), false)?;
                    let failures = failures.iter().map(ToString::to_string).collect();
                    return Ok(attempt.recovered(&outcome, failures, transcript));
                }
                Step::GiveUp { .. } => {
                    return Err(failures.pop().expect("a recovery gives up after a failed attempt"))
                }
                step => self.carry_out(hooks, &recovery, step, &mut attempt, sequences),
            };
            let input = match answer {
                Ok(answer) => Input::Completed(answer),
                Err(e) => {
                    tracing::warn!(attempt = recovery.attempt(), error = %e, "a recovery attempt failed");
                    let dead = self.dead_after_failed_attempt(&recovery.victims())?;
                    failures.push(e);
                    attempt = Attempt::default();
                    Input::Failed(dead.iter().map(|&(stage, what)| (stage as u32, what.into())).collect())
                }
            };
            recovery.apply(&input)?;
            transcript.inputs.push(input);
        }
    }

    /// Carries out one `step` of `recovery`.
    fn carry_out(
        &mut self,
        hooks: &mut dyn RecoveryHooks,
        recovery: &Recovery,
        step: Step,
        attempt: &mut Attempt,
        sequences: &[Sequence<'_>],
    ) -> Result<Answer, ClusterError> {
        let n = self.len();
        let victims: Vec<(usize, Kill)> =
            recovery.victims().into_iter().map(|(stage, loss)| (stage as usize, loss.into())).collect();
        match step {
            Step::Fence { members, lowest } => {
                // Fencing: the controller opens a new epoch in which the presumed-dead processes
                // are ignored, durably, before anything else happens. Replacements start in that
                // epoch, so their successors and the sidecars refuse the old processes'
                // connections and copies once they have seen them.
                let epoch = self.ask(|client| client.fence_unless_fenced(&members, lowest))?;
                self.remote.set_epoch(epoch);
                Ok(Answer::Fenced(epoch))
            }
            Step::Retire { .. } => {
                // A process presumed dead may only be slow: it is killed before its replacement
                // takes its place (when it can be).
                attempt.spare = hooks.leave_presumed_dead_running();
                for &(victim, what) in victims.iter().filter(|_| !attempt.spare) {
                    let _ = self.stages[victim].proc.kill();
                    if what == Kill::Worker {
                        let _ = self.sidecars[victim].proc.kill();
                    }
                }
                hooks.after_fence(self)?;
                Ok(Answer::Retired)
            }
            Step::Start { member: (Role::Sidecar, stage), epoch } => {
                let victim = stage as usize;
                let (new, socket) = self.replacement_sidecar(victim, epoch)?;
                self.sockets[victim] = socket;
                let old = std::mem::replace(&mut self.sidecars[victim], new);
                self.retire(old, attempt.spare);
                self.wait_alive((Role::Sidecar, stage))?;
                self.hand_prompts_to(victim);
                Ok(Answer::Started((Role::Sidecar, stage)))
            }
            Step::Start { member: (Role::Engine, stage), epoch } => {
                let victim = stage as usize;
                let next = if victim + 1 == n { self.driver } else { self.stages[victim + 1].addr };
                let new = self.replacement_stage(victim, epoch, next)?;
                let old = std::mem::replace(&mut self.stages[victim], new);
                self.retire(old, attempt.spare);
                self.wait_alive((Role::Engine, stage))?;
                Ok(Answer::Started((Role::Engine, stage)))
            }
            Step::Repair { stages } => {
                self.repair_chain(&stages)?;
                Ok(Answer::Repaired)
            }
            Step::CarryOut { epoch } => {
                // The controller's part: it re-seeds each replaced sidecar from its surviving
                // predecessor's, and finds each sequence's first unreplicated token in the copy
                // each replacement restores from. The addresses a re-seed may use (a replaced
                // sidecar's, from its predecessor) go through the routes that link takes; the
                // others are not used.
                attempt.book = (0..n)
                    .map(|k| {
                        let successor = (k + 1) % n;
                        let sidecar = self.sidecars[successor].addr;
                        if victims.contains(&(successor, Kill::Worker)) {
                            self.config.route(Link::Replica { from: k as u32 }, sidecar)
                        } else {
                            sidecar
                        }
                    })
                    .collect();
                let book = attempt.book.clone();
                let orders = self.patiently(|client| client.recover(epoch, &book, RECOVERY_PATIENCE))?;
                let plans = orders.stages.iter().map(|o| o.plan).collect();
                attempt.orders = orders.stages;
                Ok(Answer::CarriedOut(plans))
            }
            Step::Restore { .. } => {
                let sources: Vec<RestoreSource> = attempt
                    .orders
                    .iter()
                    .map(|o| {
                        let stage = o.plan.stage;
                        let replica_at = |holder: u32| {
                            self.config
                                .route(Link::Replica { from: stage }, self.sidecars[holder as usize].addr)
                        };
                        let from = match o.plan.source {
                            Source::Own => None,
                            Source::Successor(holder) => Some(replica_at(holder)),
                            // Its successor's new sidecar holds nothing: the stage recomputes.
                            Source::Lost => Some(replica_at((stage + 1) % n as u32)),
                        };
                        RestoreSource { stage, from, orders: o.clone() }
                    })
                    .collect();
                hooks.before_restore(self, &victims)?;
                attempt.lag = victims.iter().map(|&(victim, _)| (victim, 0)).collect();
                for s in sequences {
                    let sequence = self.remote.recover(&sources, s.seat, s.prompt, s.generated)?;
                    attempt.recomputed += sequence.recomputed;
                    for (total, lacked) in attempt.lag.iter_mut().zip(sequence.lacked) {
                        total.1 += lacked;
                    }
                }
                Ok(Answer::Restored)
            }
            Step::ReseedRestored { epoch } => {
                let book = attempt.book.clone();
                self.patiently(|client| client.reseed_restored(epoch, &book, RECOVERY_PATIENCE))?;
                Ok(Answer::Reseeded)
            }
            Step::Done(_) | Step::GiveUp { .. } => unreachable!("the recovery is over"),
        }
    }

    /// The stages dead after a recovery attempt of `victims` failed. A stage that died during the
    /// attempt can fail it (its chain broken) before the controller has named it: waits up to
    /// [`NAMING_PATIENCE`] heartbeats for the controller to name one the attempt did not recover,
    /// then takes whatever it names (nothing new: the attempt failed for another reason, and the
    /// next one tries the same).
    fn dead_after_failed_attempt(
        &mut self,
        victims: &[(u32, Loss)],
    ) -> Result<Vec<(usize, Kill)>, ClusterError> {
        let until = Instant::now() + self.config.heartbeat * NAMING_PATIENCE;
        loop {
            let dead = self.dead()?;
            let new = |&(stage, what): &(usize, Kill)| !victims.contains(&(stage as u32, what.into()));
            if dead.iter().any(new) || Instant::now() >= until {
                return Ok(dead);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Has the controller carry out a part of a recovery (`call`), replacing it (or following
    /// its successor) if it cannot be reached; unlike [`Cluster::ask`], a refusal is not taken
    /// for a dead controller.
    fn patiently<T>(
        &mut self,
        call: impl Fn(&mut ControllerClient) -> Result<T, ControllerError>,
    ) -> Result<T, ClusterError> {
        self.controllers.ask_unless(call, |e| !matches!(e, ControllerError::Io(_)))
    }

    /// Repairs the chain around the replaced `stages` (in stage order): each replacement is sent
    /// to through the route its link takes.
    pub(super) fn repair_chain(&mut self, stages: &[u32]) -> Result<(), ClusterError> {
        let reachable: Vec<(u32, SocketAddr)> = stages
            .iter()
            .map(|&index| {
                let addr = self.stages[index as usize].addr;
                let reach = if index == 0 {
                    self.config.route(Link::Input, addr)
                } else {
                    self.config.route(Link::Activation { from: index - 1 }, addr)
                };
                (index, reach)
            })
            .collect();
        let last_replaced = stages.last() == Some(&(self.len() as u32 - 1));
        self.remote.replace_all(&reachable, last_replaced)?;
        Ok(())
    }

    /// Tells every prompt stage, if there are any, that token stage `stage`'s sidecar was
    /// replaced. A prompt pipeline that cannot be told is no longer used.
    pub(super) fn hand_prompts_to(&mut self, stage: usize) {
        let to = self.sidecars[stage].addr;
        let Some(p) = self.prompt.as_mut().filter(|p| !p.broken) else { return };
        for prompt_stage in 0..p.stages.len() as u32 {
            if let Err(e) = p.remote.handoff_to(prompt_stage, stage as u32, to) {
                tracing::warn!(error = %e, "the prompt pipeline failed: prompts are computed here");
                p.broken = true;
                return;
            }
        }
    }

    /// Lets a replaced process go: killed (when dropped), or kept running when `spare`.
    pub(super) fn retire(&mut self, old: Spawned, spare: bool) {
        if spare {
            self.spared.push(old);
        }
    }
}

/// What a recovery did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    /// The epoch of the attempt that succeeded.
    pub epoch: u64,
    /// The stages recovered, with what of each (more than asked for when others died during the
    /// recovery).
    pub victims: Vec<(usize, Kill)>,
    /// Attempts it took.
    pub attempts: u32,
    /// Why each failed attempt failed, in order.
    pub failures: Vec<String>,
    /// Steps recomputed (the largest replication lag among the victims, summed over the
    /// sequences).
    pub recomputed: u64,
    /// Each victim and the steps its copies lacked, summed over the sequences.
    pub lag: Vec<(usize, u64)>,
    /// Replaced stages whose copies died with them (their successor's worker died too): their
    /// sequences were recomputed from the prompt, as the ring cannot restore them.
    pub copies_lost: Vec<usize>,
    /// The recovery machine's steps and inputs, which replay through a fresh machine
    /// ([`Transcript::replay`]); empty when the controller carried the recovery out
    /// ([`super::Recoveries::ByController`]).
    pub transcript: Transcript,
}

/// Attempts at a recovery before it fails.
pub const RECOVERY_ATTEMPTS: u32 = 3;

/// Heartbeats a failed attempt waits for the controller to name a stage that died during it.
const NAMING_PATIENCE: u32 = 6;

/// What the shell keeps of the current attempt between its steps.
#[derive(Default)]
struct Attempt {
    /// Whether its presumed dead were left running.
    spare: bool,
    /// The address book the controller's part used.
    book: Vec<SocketAddr>,
    /// The controller's orders for each replaced stage.
    orders: Vec<StageOrders>,
    recomputed: u64,
    lag: Vec<(usize, u64)>,
}

impl Attempt {
    fn recovered(self, outcome: &Outcome, failures: Vec<String>, transcript: Transcript) -> Recovered {
        Recovered {
            epoch: outcome.epoch,
            victims: outcome.plans.iter().map(|p| (p.stage as usize, p.loss.into())).collect(),
            attempts: outcome.attempts,
            failures,
            recomputed: self.recomputed,
            lag: self.lag,
            copies_lost: outcome.copies_lost().into_iter().map(|stage| stage as usize).collect(),
            transcript,
        }
    }
}

impl From<Kill> for Loss {
    fn from(kill: Kill) -> Self {
        match kill {
            Kill::Engine => Loss::Engine,
            Kill::Worker => Loss::Worker,
        }
    }
}

impl From<Loss> for Kill {
    fn from(loss: Loss) -> Self {
        match loss {
            Loss::Engine => Kill::Engine,
            Loss::Worker => Kill::Worker,
        }
    }
}
