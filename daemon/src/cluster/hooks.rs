//! Faults injected at fixed points of a recovery, for the chaos harness and the tests. The
//! recovery ([`Cluster::recover_all`]) calls a [`RecoveryHooks`] at each point and knows nothing
//! of what it does; [`ScheduledFaults`], the cluster's own, carries out the faults asked for with
//! [`Cluster::crash_controller_in_next_recovery`], [`Cluster::kill_in_next_recovery`] and
//! [`Cluster::spare_presumed_dead_in_next_recovery`].

use super::{Cluster, ClusterError, Kill};

/// The points of a recovery where a fault can be injected.
pub trait RecoveryHooks {
    /// Whether the processes presumed dead are left running once fenced, as on a machine cut off
    /// from the cluster, rather than killed.
    fn leave_presumed_dead_running(&mut self) -> bool {
        false
    }

    /// Once the victims are fenced (durably, in the recovery's epoch), before their replacements
    /// start.
    fn after_fence(&mut self, cluster: &mut Cluster) -> Result<(), ClusterError> {
        let _ = cluster;
        Ok(())
    }

    /// Once the replacements of `victims` are up and the chain repaired, before they restore.
    fn before_restore(
        &mut self,
        cluster: &mut Cluster,
        victims: &[(usize, Kill)],
    ) -> Result<(), ClusterError> {
        let _ = (cluster, victims);
        Ok(())
    }
}

/// The faults asked of the next recoveries, carried out at their points.
#[derive(Debug, Default)]
pub struct ScheduledFaults {
    /// Leave the next recovery's victims running.
    pub(super) spare_presumed_dead: bool,
    /// SIGKILL the controller right after the next recovery's fence.
    pub(super) crash_controller: bool,
    /// Stages to kill in the middle of a recovery of other stages, in the order asked for.
    pub(super) kill: Vec<(usize, Kill)>,
    /// The stages killed so, since last taken.
    pub(super) killed: Vec<(usize, Kill)>,
}

impl RecoveryHooks for ScheduledFaults {
    fn leave_presumed_dead_running(&mut self) -> bool {
        std::mem::take(&mut self.spare_presumed_dead)
    }

    fn after_fence(&mut self, cluster: &mut Cluster) -> Result<(), ClusterError> {
        if std::mem::take(&mut self.crash_controller) {
            cluster.kill_controller()?;
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
            cluster.kill(stage, what)?;
        }
        Ok(())
    }
}
