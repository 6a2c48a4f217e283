//! Failure detection as the driver sees it (the controller's census) and the recovery procedure
//! that replaces dead workers and resumes their sequences ([`Cluster::recover_all`]).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use dejavu_proto::plan::{Loss, Reseed, Source};

use super::{Cluster, ClusterError, Kill, Link, RecoveryHooks, Role, Sequence, RECOVERY_PATIENCE};
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
    fn victims_in(&self, census: &Census, down: fn(&Census, Member) -> bool) -> Vec<(usize, Kill)> {
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
            let restarts = self.controller.restarts;
            let census = self.census()?;
            if self.controller.restarts != restarts {
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

    /// Replaces the dead stages `victims` and recovers every sequence on them:
    ///
    /// 1. the controller fences the presumed-dead processes in a new epoch (durably, so a
    ///    controller crash cannot undo it; when it declared exactly them dead itself, since the
    ///    last recovery started, they are fenced already and its epoch is the recovery's), they
    ///    are killed (unless spared, see
    ///    [`Cluster::spare_presumed_dead_in_next_recovery`]: the epoch keeps them out), and
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
    /// The faults asked of it ([`super::ScheduledFaults`]) are injected at their points.
    pub fn recover_all(
        &mut self,
        victims: &[(usize, Kill)],
        sequences: &[Sequence<'_>],
    ) -> Result<Recovered, ClusterError> {
        let mut faults = std::mem::take(&mut self.faults);
        let recovered = self.recover_with(&mut faults, victims, sequences);
        self.faults = faults;
        recovered
    }

    /// As [`Cluster::recover_all`], calling `hooks` at each of its points.
    pub fn recover_with(
        &mut self,
        hooks: &mut dyn RecoveryHooks,
        victims: &[(usize, Kill)],
        sequences: &[Sequence<'_>],
    ) -> Result<Recovered, ClusterError> {
        let n = self.len();
        if self.sidecars.is_empty() {
            return Err(ClusterError::Invalid("recovery needs replication".into()));
        }
        let mut victims = victims.to_vec();
        victims.sort_by_key(|&(stage, _)| stage);
        victims.dedup_by_key(|&mut (stage, _)| stage);
        if victims.iter().any(|&(stage, _)| stage >= n) {
            return Err(ClusterError::Invalid(format!("no such stage in {victims:?}")));
        }
        // Fencing: the controller opens a new epoch in which the presumed-dead processes are
        // ignored, durably, before anything else happens. Replacements start in that epoch, so
        // their successors and the sidecars refuse the old processes' connections and copies
        // once they have seen them; a process presumed dead may only be slow, so it is also
        // killed before its replacement takes its place (when it can be).
        let mut fenced: Vec<Member> = Vec::new();
        for &(victim, what) in &victims {
            fenced.push((Role::Engine, victim as u32));
            if what == Kill::Worker {
                fenced.push((Role::Sidecar, victim as u32));
            }
        }
        // Only a fence newer than the last recovery's: a recovery tried again opens a newer epoch,
        // since the failed attempt's replacements may have started in that one.
        let lowest = self.remote.epoch() + 1;
        let epoch = self.ask(|client| client.fence_unless_fenced(&fenced, lowest))?;
        self.remote.set_epoch(epoch);
        let spare = hooks.leave_presumed_dead_running();
        for &(victim, what) in victims.iter().filter(|_| !spare) {
            let _ = self.stages[victim].proc.kill();
            if what == Kill::Worker {
                let _ = self.sidecars[victim].proc.kill();
            }
        }
        hooks.after_fence(self)?;
        let used = self.spares.used;
        for &(victim, _) in victims.iter().filter(|&&(_, what)| what == Kill::Worker) {
            let (new, socket) = self.replacement_sidecar(victim, epoch)?;
            self.sockets[victim] = socket;
            let old = std::mem::replace(&mut self.sidecars[victim], new);
            self.retire(old, spare);
            self.wait_alive((Role::Sidecar, victim as u32))?;
            self.hand_prompts_to(victim);
        }
        for &(victim, _) in victims.iter().rev() {
            let next = if victim + 1 == n { self.driver } else { self.stages[victim + 1].addr };
            let new = self.replacement_stage(victim, epoch, next)?;
            let old = std::mem::replace(&mut self.stages[victim], new);
            self.retire(old, spare);
            self.wait_alive((Role::Engine, victim as u32))?;
        }
        let reachable: Vec<(u32, SocketAddr)> = victims
            .iter()
            .map(|&(victim, _)| {
                let (index, addr) = (victim as u32, self.stages[victim].addr);
                let reach = if victim == 0 {
                    self.config.route(Link::Input, addr)
                } else {
                    self.config.route(Link::Activation { from: index - 1 }, addr)
                };
                (index, reach)
            })
            .collect();
        let last_replaced = victims.iter().any(|&(stage, _)| stage == n - 1);
        self.remote.replace_all(&reachable, last_replaced)?;
        // The controller's part: it re-seeds each replaced sidecar from its surviving
        // predecessor's, and finds each sequence's first unreplicated token in the copy each
        // replacement restores from. The addresses a re-seed may use (a replaced sidecar's, from
        // its predecessor) go through the routes that link takes; the others are not used.
        let book: Vec<SocketAddr> = (0..n)
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
        let orders = self.patiently(|client| client.recover(epoch, &book, RECOVERY_PATIENCE))?;
        let planned: Vec<(usize, Kill)> = orders
            .stages
            .iter()
            .map(|o| {
                (o.plan.stage as usize, if o.plan.loss == Loss::Worker { Kill::Worker } else { Kill::Engine })
            })
            .collect();
        if planned != victims {
            return Err(ClusterError::Invalid(format!(
                "the controller recovered {planned:?} in epoch {epoch}, not the victims {victims:?}"
            )));
        }
        // A predecessor replaced too re-seeds the new sidecar once it has restored its KV.
        let reseed_after_restore =
            orders.stages.iter().any(|o| matches!(o.plan.reseed, Some((_, Reseed::AfterRestore))));
        let mut copies_lost = Vec::new();
        let mut sources = Vec::new();
        for o in &orders.stages {
            let stage = o.plan.stage;
            let replica_at = |holder: u32| {
                self.config.route(Link::Replica { from: stage }, self.sidecars[holder as usize].addr)
            };
            let from = match o.plan.source {
                Source::Own => None,
                Source::Successor(holder) => Some(replica_at(holder)),
                Source::Lost => {
                    // Its successor's new sidecar holds nothing: the stage recomputes.
                    copies_lost.push(stage as usize);
                    Some(replica_at((stage + 1) % n as u32))
                }
            };
            sources.push(RestoreSource { stage, from, orders: o.clone() });
        }
        let mut recovered = Recovered {
            epoch,
            recomputed: 0,
            lag: victims.iter().map(|&(victim, _)| (victim, 0)).collect(),
            copies_lost,
        };
        hooks.before_restore(self, &victims)?;
        for s in sequences {
            let sequence = self.remote.recover(&sources, s.seat, s.prompt, s.generated)?;
            recovered.recomputed += sequence.recomputed;
            for (total, lacked) in recovered.lag.iter_mut().zip(sequence.lacked) {
                total.1 += lacked;
            }
        }
        if reseed_after_restore {
            self.patiently(|client| client.reseed_restored(epoch, &book, RECOVERY_PATIENCE))?;
        }
        // The spares used are replaced in the background, off the recovery.
        let (stages, sidecars) = (self.spares.used.0 - used.0, self.spares.used.1 - used.1);
        self.start_spares((stages, sidecars), false)?;
        Ok(recovered)
    }

    /// Has the controller carry out a part of a recovery (`call`), replacing it once if it
    /// cannot be reached; unlike [`Cluster::ask`], a refusal is not taken for a dead controller.
    fn patiently<T>(
        &mut self,
        call: impl Fn(&mut ControllerClient) -> Result<T, ControllerError>,
    ) -> Result<T, ClusterError> {
        match call(&mut self.controller.client) {
            Err(ControllerError::Io(e)) => {
                tracing::warn!(error = %e, "the controller did not answer a recovery: replacing it");
                self.restart_controller()?;
                Ok(call(&mut self.controller.client)?)
            }
            carried_out => Ok(carried_out?),
        }
    }

    /// Tells every prompt stage, if there are any, that token stage `stage`'s sidecar was
    /// replaced. A prompt pipeline that cannot be told is no longer used.
    fn hand_prompts_to(&mut self, stage: usize) {
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
    fn retire(&mut self, old: Spawned, spare: bool) {
        if spare {
            self.spared.push(old);
        }
    }
}

/// What a recovery did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    /// The epoch the controller opened for it.
    pub epoch: u64,
    /// Steps recomputed (the largest replication lag among the victims, summed over the
    /// sequences).
    pub recomputed: u64,
    /// Each victim and the steps its copies lacked, summed over the sequences.
    pub lag: Vec<(usize, u64)>,
    /// Replaced stages whose copies died with them (their successor's worker died too): their
    /// sequences were recomputed from the prompt, as the ring cannot restore them.
    pub copies_lost: Vec<usize>,
}
