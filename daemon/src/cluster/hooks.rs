//! The points of a recovery where a fault can be injected. The recovery
//! ([`Cluster::recover_with`]) calls a [`RecoveryHooks`] at each point and knows nothing of what it
//! does; the chaos harness implements it to crash the controller, kill a worker or leave the
//! presumed dead running in the middle of a recovery. [`NoHooks`] injects nothing.

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

/// A recovery without injected faults.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoHooks;

impl RecoveryHooks for NoHooks {}
