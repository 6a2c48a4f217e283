//! The faults a test, the demo or the chaos harness injects into a running cluster: kills of
//! engines and whole workers (together, as a machine's processes die), signals and pauses of
//! single processes, the controller killed or paused, a prompt stage killed, a spill directory
//! filled. The supervisor notices them as it would real ones, through its controller and its
//! processes; nothing here repairs anything.

use std::time::Duration;

use super::{spill_dir_of, Cluster, ClusterError, Kill, Role};
use crate::proc::Spawned;

/// The faults of one cluster ([`Cluster::faults`]).
pub struct Faults<'a> {
    pub(super) cluster: &'a mut Cluster,
}

impl Faults<'_> {
    /// Kills stage `victim`'s engine, and with [`Kill::Worker`] its sidecar too.
    pub fn kill(&mut self, victim: usize, what: Kill) -> Result<(), ClusterError> {
        self.kill_together(&[(victim, what)])
    }

    /// Kills each of `victims` as [`Faults::kill`] does, signalling every process before waiting
    /// for any to exit, so that they die together, as the processes of a machine that fails do.
    pub fn kill_together(&mut self, victims: &[(usize, Kill)]) -> Result<(), ClusterError> {
        for &(victim, what) in victims {
            if victim >= self.cluster.len() {
                return Err(ClusterError::Invalid(format!("no stage {victim}")));
            }
            if what == Kill::Worker && (self.cluster.sidecars.is_empty() || self.cluster.len() < 2) {
                return Err(ClusterError::Invalid(
                    "killing a worker needs replication and two stages or more".into(),
                ));
            }
        }
        let mut processes: Vec<&mut Spawned> = Vec::new();
        for (stage, spawned) in self.cluster.stages.iter_mut().enumerate() {
            if victims.iter().any(|&(victim, _)| victim == stage) {
                processes.push(spawned);
            }
        }
        for (stage, spawned) in self.cluster.sidecars.iter_mut().enumerate() {
            if victims.iter().any(|&(victim, what)| victim == stage && what == Kill::Worker) {
                processes.push(spawned);
            }
        }
        for spawned in &mut processes {
            spawned.proc.signal(libc::SIGKILL)?;
        }
        for spawned in processes {
            spawned.proc.kill()?;
        }
        Ok(())
    }

    /// Sends `signal` to stage `stage`'s engine or sidecar; a process already dead is left alone.
    pub fn signal(&mut self, stage: usize, role: Role, signal: i32) -> Result<(), ClusterError> {
        Ok(self.cluster.process(stage, role)?.proc.signal(signal)?)
    }

    /// Stops stage `stage`'s engine or sidecar for `pause` (see [`crate::proc::Proc::pause`]): shorter than the
    /// heartbeat timeout it is a slow process, longer it is declared dead and replaced (and killed,
    /// so it cannot come back).
    pub fn pause(&mut self, stage: usize, role: Role, pause: Duration) -> Result<(), ClusterError> {
        Ok(self.cluster.process(stage, role)?.proc.pause(pause)?)
    }

    /// SIGKILLs the controller in charge (the leader, with controllers on etcd). The cluster
    /// notices when it next asks it something (after a failed step, or in a recovery) and starts
    /// another on the same state, or follows the controller that takes the lead.
    pub fn kill_controller(&mut self) -> Result<(), ClusterError> {
        self.cluster.controllers.kill_leader()
    }

    /// Stops the controller in charge for `pause`. One controller: a pause longer than the time
    /// it has to answer gets it replaced, if the cluster asks it something meanwhile. On etcd: a
    /// pause past the leader's lease gets it deposed, and it must stop once resumed.
    pub fn pause_controller(&mut self, pause: Duration) -> Result<(), ClusterError> {
        self.cluster.controllers.pause_leader(pause)
    }

    /// Fills stage `stage`'s sidecar's spill directory with a file as large as the directory may
    /// hold, removed after `duration`: meanwhile its spills fail as on a full disk.
    pub fn fill_spill(&mut self, stage: usize, duration: Duration) -> Result<(), ClusterError> {
        let limits = self
            .cluster
            .config
            .spill
            .ok_or_else(|| ClusterError::Invalid("the sidecars do not spill".into()))?;
        let socket = self
            .cluster
            .sockets
            .get(stage)
            .ok_or_else(|| ClusterError::Invalid(format!("no sidecar {stage}")))?;
        let dir = spill_dir_of(socket);
        std::fs::create_dir_all(&dir)?;
        let ballast = dir.join("ballast");
        std::fs::write(&ballast, vec![0u8; limits.dir_bytes as usize])?;
        std::thread::spawn(move || {
            std::thread::sleep(duration);
            let _ = std::fs::remove_file(ballast);
        });
        Ok(())
    }

    /// SIGKILLs prompt stage `stage`: the prompts not yet handed over are computed by the token
    /// pipeline.
    pub fn kill_prompt_stage(&mut self, stage: usize) -> Result<(), ClusterError> {
        let p = self.cluster.prompt.as_mut().and_then(|p| p.stages.get_mut(stage));
        let p = p.ok_or_else(|| ClusterError::Invalid(format!("no prompt stage {stage}")))?;
        Ok(p.proc.kill()?)
    }
}
