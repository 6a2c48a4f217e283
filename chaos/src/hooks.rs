//! The faults a scenario schedules inside recoveries, carried out at the recovery's points
//! ([`RecoveryHooks`]): the controller crashed right after the fence, a worker killed once the
//! replacements are up and before they restore, the presumed dead left running.

use dejavud::cluster::{Cluster, ClusterError, Kill, RecoveryHooks};

/// The faults asked of the next recoveries.
#[derive(Debug, Default)]
pub struct ScheduledFaults {
    /// Leave the next recovery's victims running.
    spare_presumed_dead: bool,
    /// SIGKILL the controller right after the next recovery's fence.
    crash_controller: bool,
    /// Stages to kill in the middle of a recovery of other stages, in the order asked for.
    kill: Vec<(usize, Kill)>,
    /// The stages killed so, since last taken.
    killed: Vec<(usize, Kill)>,
}

impl ScheduledFaults {
    /// Makes the next recovery SIGKILL the controller right after it has fenced the dead
    /// processes, before their replacements have beaten.
    pub fn crash_controller_in_next_recovery(&mut self) {
        self.crash_controller = true;
    }

    /// Makes the next recovery that does not recover stage `stage` kill it (`what` of it, as
    /// [`dejavud::cluster::Faults::kill`] does) in its middle, once the replacements are up and the chain repaired,
    /// before they restore: a second failure during a recovery. That attempt then fails (a
    /// restore or recomputed step finds the chain broken, or the controller's fence), and the
    /// next attempt recovers both.
    ///
    /// Kills asked for before wait their turn: a recovery carries out the first one that does not
    /// hit its own victims.
    pub fn kill_in_next_recovery(&mut self, stage: usize, what: Kill) {
        self.kill.push((stage, what));
    }

    /// Makes the next recovery fence the processes presumed dead without killing them, as with a
    /// machine cut off from the cluster: if they were only stopped, they come back, stale, while
    /// their replacements run (a stale worker rejoining). They are killed with the cluster.
    pub fn spare_presumed_dead_in_next_recovery(&mut self) {
        self.spare_presumed_dead = true;
    }

    /// The stages killed during recoveries since last asked, in order.
    pub fn take_killed(&mut self) -> Vec<(usize, Kill)> {
        std::mem::take(&mut self.killed)
    }
}

impl RecoveryHooks for ScheduledFaults {
    fn leave_presumed_dead_running(&mut self) -> bool {
        std::mem::take(&mut self.spare_presumed_dead)
    }

    fn after_fence(&mut self, cluster: &mut Cluster) -> Result<(), ClusterError> {
        if std::mem::take(&mut self.crash_controller) {
            cluster.faults().kill_controller()?;
            // Its replacement, started now, is the one the replacements ask for their epoch.
            cluster.census()?;
        }
        Ok(())
    }

    fn before_restore(
        &mut self,
        cluster: &mut Cluster,
        victims: &[(usize, Kill)],
    ) -> Result<(), ClusterError> {
        // The first kill asked for that does not hit this recovery's own victims.
        let spared = |&(stage, _): &(usize, Kill)| !victims.iter().any(|v| v.0 == stage);
        if let Some(i) = self.kill.iter().position(spared) {
            let (stage, what) = self.kill.remove(i);
            self.killed.push((stage, what));
            cluster.faults().kill(stage, what)?;
        }
        Ok(())
    }
}
