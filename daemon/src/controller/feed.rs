//! The recovery feed: what whoever feeds a pipeline (it alone holds the requests' tokens) learns
//! of the recoveries the controller carries out itself (`--stages`), and its acknowledgements.
//! Its client is [`dejavulib::net::controller::RecoveryFeed`].
//!
//! A recovery is named by the epoch its fence opened. Its losses are the stages fenced in that
//! epoch (and not again since), read from the controller's record, so a controller restarted on
//! its state, or a new leader, serves the same feed. It is published once every stage it fenced
//! has its replacement in place: a new engine has joined the stage's sidecar, and a replaced
//! sidecar has been restored. Its marks are read then from the sidecars the plan restores from.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use dejavu_proto::plan::{self, Loss, Source};
use dejavulib::message::{RecoveryOrders, StageOrders};
use parking_lot::Mutex;
use tracing::info;

use super::recovery::{losses_fenced_in, marks_of};
use super::{ControllerError, Counters, Events, Tables};
use crate::heartbeat::Role;

/// How often a watch looks again at a recovery whose replacements are not in place yet (a fence
/// wakes it at once).
const RECHECK: Duration = Duration::from_millis(5);

/// The recovery of the first epoch after `after` in which a stage of the ring of `depth` was
/// fenced, once its replacements are in place, waiting until `until` for one; `None` if there is
/// none by then.
pub(super) fn watch(
    tables: &Mutex<Tables>,
    events: &Events,
    depth: u32,
    after: u64,
    until: Instant,
) -> Result<Option<RecoveryOrders>, ControllerError> {
    let (epoch, losses) = {
        let mut tables = tables.lock();
        loop {
            if let Some(ready) = next_in_place(&tables, depth, after) {
                break ready;
            }
            if Instant::now() >= until {
                return Ok(None);
            }
            let _ = events.fenced.wait_until(&mut tables, (Instant::now() + RECHECK).min(until));
        }
    };
    // Each replaced engine restores from its own sidecar, a replaced one included (the restore
    // handed it its stage's KV, or had nothing to give): the marks are read there, without the
    // tables' lock, and each plan says where that KV came from.
    let handed_back = tables.lock().handed_back.clone();
    let stages = plan::ring(depth, &losses)
        .into_iter()
        .map(|mut plan| {
            // Lost when the plan says so (its successor fenced with it), or when its restore
            // found nothing to hand back.
            if plan.loss == Loss::Worker && plan.source != Source::Lost {
                let restored = handed_back.get(&plan.stage).filter(|&&(fence, _)| fence == epoch);
                plan.source = restored.map_or(plan.source, |&(_, source)| source);
            }
            let own = plan::StagePlan { source: own_unless_lost(plan.source), ..plan };
            Ok(StageOrders { marks: marks_of(tables, &own)?, reseeded: None, plan })
        })
        .collect::<Result<Vec<_>, ControllerError>>()?;
    Ok(Some(RecoveryOrders { epoch, stages }))
}

/// Where a replaced engine restores from, given where its stage's KV came from: its own sidecar,
/// unless the KV was lost.
fn own_unless_lost(source: Source) -> Source {
    match source {
        Source::Lost => Source::Lost,
        Source::Own | Source::Successor(_) => Source::Own,
    }
}

/// The first epoch after `after` in which a stage was fenced, with its losses, if every stage it
/// fenced has its replacement in place.
fn next_in_place(tables: &Tables, depth: u32, after: u64) -> Option<(u64, Vec<(u32, Loss)>)> {
    let epoch = (0..depth)
        .flat_map(|stage| [(Role::Sidecar, stage), (Role::Engine, stage)])
        .filter_map(|member| tables.machine.membership(member))
        .map(|membership| membership.fenced_in)
        .filter(|&epoch| epoch > after)
        .min()?;
    let losses = losses_fenced_in(tables, epoch, depth);
    let back = |member| tables.machine.membership(member).is_some_and(|m| !m.awaiting);
    let restoring: Vec<u32> = tables.machine.restores_pending().collect();
    let in_place = losses.iter().all(|&(stage, loss)| {
        back((Role::Engine, stage))
            && (loss == Loss::Engine || (back((Role::Sidecar, stage)) && !restoring.contains(&stage)))
    });
    in_place.then_some((epoch, losses))
}

/// Records that the feeder fed every sequence of the recovery of `epoch` again (the newest
/// recovery acknowledged so far counts; an older one, or the same again, does not).
pub(super) fn acknowledge(
    tables: &Mutex<Tables>,
    counters: &Counters,
    epoch: u64,
) -> Result<(), ControllerError> {
    let current = tables.lock().machine.epoch();
    if epoch == 0 || epoch > current {
        return Err(ControllerError::Protocol(format!(
            "an acknowledgement of the recovery of epoch {epoch}, which is not one yet (the current epoch is {current})"
        )));
    }
    // Only the newest counts: a feeder saying it again (its first answer lost) is not counted.
    if counters.last_acknowledged.fetch_max(epoch, Ordering::Relaxed) < epoch {
        counters.acknowledged_recoveries.fetch_add(1, Ordering::Relaxed);
        info!(epoch, "the feeder resumed every sequence of the recovery");
    }
    Ok(())
}
