//! The controller's part of a recovery, once the replacements are up (the paper's 4 steps):
//!
//! 1. it plans the ring ([`dejavu_proto::plan::ring`]) from what it fenced in the recovery's
//!    epoch: each failed stage restores from its own sidecar (the engine died alone), from its
//!    successor's (the whole worker died), or from nowhere (its successor's worker died too);
//! 2. it makes each replaced sidecar's surviving predecessor sidecar send it the replica it must
//!    hold, and forward there from now on ([`SidecarControl::reseed`]), before anything is
//!    recomputed, so that the recomputed steps' copies land there too;
//! 3. it finds, from the chunks the restore sources actually hold, each sequence's first
//!    unreplicated token: the [`Mark`] up to which the replacement restores, and from which the
//!    steps are recomputed;
//! 4. whoever feeds the pipeline resumes every sequence at its mark (it alone has the tokens).
//!
//! The sidecars are reached at the control addresses their heartbeats name. A predecessor that
//! was replaced too has nothing to send yet: the plan says so ([`Reseed::AfterRestore`]), and its
//! new sidecar re-seeds once its stage has restored or recomputed its KV ([`reseed_restored`]).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use dejavu_proto::liveness::SPARE_MEMBERS;
use dejavu_proto::plan::{self, Loss, Reseed, Source};
use dejavu_proto::spares::Assignment;
use dejavulib::message::{Mark, RecoveryOrders, StageOrders};
use dejavulib::resume::resume_points;
use parking_lot::Mutex;
use tracing::{debug, error, info, warn};

use super::{ControllerError, Counters, Member, Tables};
use crate::heartbeat::Role;
use crate::sidecar::control::SidecarControl;

/// How long one control request to a sidecar may take (a re-seed moves a stage's whole KV).
const SIDECAR_DEADLINE: Duration = Duration::from_secs(20);

/// The depth of the ring whose address book is `book`.
fn ring_depth(book: &[SocketAddr]) -> Result<u32, ControllerError> {
    match u32::try_from(book.len()) {
        Ok(0) | Err(_) => Err(ControllerError::Protocol(format!("a ring of {} stages", book.len()))),
        Ok(depth) => Ok(depth),
    }
}

/// Carries out steps 1 to 3 of the recovery of epoch `epoch`, for a ring whose stage `k`
/// reaches its successor's sidecar at `book[k]`.
pub(super) fn carry_out(
    tables: &Mutex<Tables>,
    counters: &Counters,
    epoch: u64,
    book: &[SocketAddr],
) -> Result<RecoveryOrders, ControllerError> {
    let started = Instant::now();
    let depth = ring_depth(book)?;
    let losses = losses_in(tables, epoch, depth)?;
    let mut stages = Vec::new();
    for plan in plan::ring(depth, &losses) {
        let reseeded = match plan.reseed {
            Some((from, Reseed::Now)) => {
                Some(control_of(tables, (Role::Sidecar, from))?.reseed(book[from as usize])?)
            }
            Some((_, Reseed::AfterRestore)) | None => None,
        };
        let marks = marks_of(tables, &plan)?;
        stages.push(StageOrders { plan, reseeded, marks });
    }
    counters.recoveries.fetch_add(1, Ordering::Relaxed);
    counters.recovery_micros.fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
    let reseeded: u64 = stages.iter().filter_map(|s| s.reseeded).sum();
    counters.reseeded_chunks.fetch_add(reseeded, Ordering::Relaxed);
    info!(epoch, ?losses, reseeded, took = ?started.elapsed(), "carried a recovery out");
    Ok(RecoveryOrders { epoch, stages })
}

/// Step 3 for one stage of a recovery's plan: each of its sequences' first token whose KV the
/// sidecar it restores from does not hold (none where that KV is lost).
pub(super) fn marks_of(tables: &Mutex<Tables>, plan: &plan::StagePlan) -> Result<Vec<Mark>, ControllerError> {
    let holder = match plan.source {
        Source::Own => plan.stage,
        Source::Successor(successor) => successor,
        Source::Lost => return Ok(Vec::new()),
    };
    let held = control_of(tables, (Role::Sidecar, holder))?.held_of(plan.stage)?;
    Ok(resume_points(&held)
        .into_iter()
        .filter(|point| point.destination.stage == plan.stage)
        .map(|point| Mark { microbatch: point.microbatch, slots: point.slots, tokens: point.tokens })
        .collect())
}

/// The rest of step 2, once the replaced stages have restored (or recomputed) their KV: each
/// replaced sidecar whose predecessor was replaced too ([`Reseed::AfterRestore`]) is re-seeded by
/// the predecessor's new sidecar, which now holds that KV. Returns the chunks sent.
pub(super) fn reseed_restored(
    tables: &Mutex<Tables>,
    counters: &Counters,
    epoch: u64,
    book: &[SocketAddr],
) -> Result<u64, ControllerError> {
    let depth = ring_depth(book)?;
    let losses = losses_in(tables, epoch, depth)?;
    let mut sent = 0;
    for plan in plan::ring(depth, &losses) {
        if let Some((from, Reseed::AfterRestore)) = plan.reseed {
            sent += control_of(tables, (Role::Sidecar, from))?.reseed(book[from as usize])?;
        }
    }
    counters.reseeded_chunks.fetch_add(sent, Ordering::Relaxed);
    info!(epoch, reseeded = sent, "re-seeded after the restores");
    Ok(sent)
}

/// What of each stage was fenced in `epoch`, the current one: the whole worker when its sidecar
/// was. A late request for an older epoch is refused: it must not retarget sidecars from an old
/// book. Neither may a controller paused past its lease, on what it knew before its pause: it
/// confirms that it still leads first.
fn losses_in(tables: &Mutex<Tables>, epoch: u64, depth: u32) -> Result<Vec<(u32, Loss)>, ControllerError> {
    let mut tables = tables.lock();
    tables.store.confirm_leading()?;
    let current = tables.machine.epoch();
    if epoch != current {
        return Err(ControllerError::Protocol(format!(
            "a recovery of epoch {epoch}, not the current {current}"
        )));
    }
    let losses = losses_fenced_in(&tables, epoch, depth);
    if losses.is_empty() {
        return Err(ControllerError::Protocol(format!("no stage of {depth} was fenced in epoch {epoch}")));
    }
    Ok(losses)
}

/// What of each stage of a ring of `depth` was fenced in `epoch` (and not again since): the whole
/// worker when its sidecar was, else its engine.
pub(super) fn losses_fenced_in(tables: &Tables, epoch: u64, depth: u32) -> Vec<(u32, Loss)> {
    let fenced = |member: Member| tables.machine.membership(member).is_some_and(|m| m.fenced_in == epoch);
    (0..depth)
        .filter_map(|stage| {
            if fenced((Role::Sidecar, stage)) {
                Some((stage, Loss::Worker))
            } else {
                fenced((Role::Engine, stage)).then_some((stage, Loss::Engine))
            }
        })
        .collect()
}

/// The control listener of `member`'s current process, waiting up to a heartbeat timeout for it
/// to beat (a controller just restarted has heard from no one).
fn control_of(tables: &Mutex<Tables>, member: Member) -> Result<SidecarControl, ControllerError> {
    let start = Instant::now();
    loop {
        let (known, timeout) = {
            let tables = tables.lock();
            let control = |&addr| SidecarControl::new(addr, SIDECAR_DEADLINE, &tables.secret);
            (tables.controls.get(&member).map(control), tables.timeout)
        };
        match known {
            Some(control) => return Ok(control),
            None if start.elapsed() >= timeout => {
                return Err(ControllerError::Protocol(format!("{member:?} names no control listener")))
            }
            None => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// How long the restore of a replaced sidecar tries again (its transport may not listen yet when
/// its first heartbeat comes).
const RESTORE_PATIENCE: Duration = Duration::from_secs(10);

/// The restore of stage `stage`'s replaced sidecar in a ring of `depth` stages, which the
/// controller carries out itself (`--stages`) once the replacement beats: the surviving
/// predecessor's sidecar re-seeds it with the replica it must hold and forwards there from now
/// on, and the surviving successor's hands it back the stage's own KV, which the stage's
/// replacement engine restores from it (through shared memory, as after an engine restart). A
/// neighbour replaced too has nothing to give: the stage's KV is recomputed, and the replica
/// comes once that neighbour's engine writes again. Each try plans again, so a neighbour that
/// dies during the restore is planned as lost; one that cannot be reached for
/// [`RESTORE_PATIENCE`] counts as lost too, so that the recovery is not held up for good.
pub(super) fn restore_replaced(tables: &Mutex<Tables>, counters: &Counters, stage: u32, depth: u32) {
    // The fence this restore serves: a replacement fenced again meanwhile has a restore of its
    // own queued, which this one must not settle for it.
    let serves = fenced_in(tables, stage);
    if stage >= depth {
        warn!(stage, depth, "a replaced sidecar outside the ring: nothing restored");
        return settled(tables, stage, serves, Source::Lost);
    }
    let started = Instant::now();
    // Where the replacement serves KV, as its heartbeats say: a controller that restarted in the
    // middle of a restore has not heard it yet.
    let to = loop {
        let known = tables.lock().data.get(&(Role::Sidecar, stage)).copied();
        match known {
            Some(to) => break to,
            None if started.elapsed() < RESTORE_PATIENCE => std::thread::sleep(Duration::from_millis(2)),
            None => {
                warn!(stage, "a replaced sidecar named no KV port in time: nothing restored");
                return settled(tables, stage, serves, Source::Lost);
            }
        }
    };
    let (mut reseeded, mut handed_back, mut sent) = (false, None, 0);
    let source = loop {
        if fenced_in(tables, stage) != serves {
            // The replacement was fenced in turn: the restore of its own replacement follows.
            info!(stage, "a replaced sidecar was replaced again before its restore: giving it up");
            return;
        }
        let plan = plan_of_replaced(tables, stage, depth);
        let successor = match plan.source {
            Source::Successor(holder) => Some(holder),
            Source::Own | Source::Lost => None,
        };
        // The replica from the predecessor and the stage's own KV from the successor, at once:
        // they come from two sidecars.
        let reseed = match (reseeded, plan.reseed) {
            (false, Some((from, Reseed::Now))) => Some(from),
            _ => None,
        };
        let hand_back_from = successor.filter(|_| handed_back.is_none());
        // A neighbour that does not answer within what is left of the patience counts as failed
        // (a stopped process accepts connections but never proves the secret).
        let patience_ends = started + RESTORE_PATIENCE;
        let (reseed, hand_back) =
            reseed_and_hand_back(tables, (stage, to), patience_ends, reseed, hand_back_from);
        // What went through counts, whatever else failed: only the rest is tried again.
        let mut failed = None;
        match reseed {
            Some(Ok(chunks)) => {
                sent += chunks;
                reseeded = true;
            }
            Some(Err(e)) => failed = Some(e),
            None => {}
        }
        match hand_back {
            Some(Ok(chunks)) => {
                sent += chunks;
                handed_back = hand_back_from;
            }
            Some(Err(e)) => failed = failed.or(Some(e)),
            None => {}
        }
        match failed {
            None => break handed_back.map_or(Source::Lost, Source::Successor),
            Some(e) if started.elapsed() < RESTORE_PATIENCE => {
                debug!(stage, error = %e, "restoring a replaced sidecar: trying again");
                std::thread::sleep(Duration::from_millis(50));
            }
            Some(e) => {
                error!(stage, error = %e, "could not restore a replaced sidecar: its stage's KV is recomputed");
                break handed_back.map_or(Source::Lost, Source::Successor);
            }
        }
    };
    if source == Source::Lost {
        warn!(stage, "the replaced sidecar's successor has nothing to give: the stage's KV is recomputed");
    }
    settled(tables, stage, serves, source);
    counters.recoveries.fetch_add(1, Ordering::Relaxed);
    counters.recovery_micros.fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
    counters.reseeded_chunks.fetch_add(sent, Ordering::Relaxed);
    info!(stage, %to, chunks = sent, took = ?started.elapsed(), "restored a replaced sidecar");
}

/// What one part of a restore sent, in chunks, or why it failed.
type Sent = Result<u64, ControllerError>;

/// The least time a restore's try gives a neighbour to connect and prove the secret.
const MIN_REACH: Duration = Duration::from_millis(100);

/// Has the sidecar of stage `from` re-seed stage `stage`'s replaced sidecar at `to`, and the one of
/// stage `holder` hand it back its stage's KV, each if given, at once (they are two sidecars),
/// each giving up on a sidecar that has not answered by `patience_ends` (given [`MIN_REACH`] at
/// least). Returns the chunks each sent, or why it failed.
fn reseed_and_hand_back(
    tables: &Mutex<Tables>,
    (stage, to): (u32, SocketAddr),
    patience_ends: Instant,
    from: Option<u32>,
    holder: Option<u32>,
) -> (Option<Sent>, Option<Sent>) {
    let control = |k: u32| {
        let control = control_of(tables, (Role::Sidecar, k))?;
        // What is left once its control listener is known, which may have taken a while.
        let reach = patience_ends.saturating_duration_since(Instant::now()).max(MIN_REACH);
        Ok::<_, ControllerError>(control.reaching_within(reach))
    };
    std::thread::scope(|scope| {
        let reseeding = from.map(|from| scope.spawn(move || Ok(control(from)?.reseed(to)?)));
        let handed_back = holder.map(|holder| Ok(control(holder)?.hand_back(stage, to)?));
        let reseeded = reseeding.map(|thread| thread.join().expect("a re-seed does not panic"));
        (reseeded, handed_back)
    })
}

/// The ring's plan for stage `stage`'s replaced sidecar, with every stage whose sidecar awaits its
/// own replacement, or was replaced since this one's fence, lost too: such a neighbour's sidecar
/// started after this stage's died, and holds nothing of it to give.
fn plan_of_replaced(tables: &Mutex<Tables>, stage: u32, depth: u32) -> plan::StagePlan {
    let tables = tables.lock();
    let fenced_in = sidecar_fenced_in(&tables, stage);
    let sidecar = |k: u32| tables.machine.membership((Role::Sidecar, k));
    let lost = |k: u32| sidecar(k).is_some_and(|m| m.awaiting || (fenced_in > 0 && m.fenced_in >= fenced_in));
    let mut losses: Vec<(u32, Loss)> = (0..depth).filter(|&k| lost(k)).map(|k| (k, Loss::Worker)).collect();
    losses.push((stage, Loss::Worker));
    plan::ring(depth, &losses).into_iter().find(|p| p.stage == stage).expect("a stage of the ring is planned")
}

/// The epoch stage `stage`'s sidecar was last fenced in (0: never).
fn fenced_in(tables: &Mutex<Tables>, stage: u32) -> u64 {
    sidecar_fenced_in(&tables.lock(), stage)
}

/// [`fenced_in`], under the lock already held.
fn sidecar_fenced_in(tables: &Tables, stage: u32) -> u64 {
    tables.machine.membership((Role::Sidecar, stage)).map_or(0, |m| m.fenced_in)
}

/// Records that stage `stage`'s replaced sidecar, replaced after its fence of epoch `serves`,
/// needs no restore any more (restored from `source`, or never restorable), so that a restarted
/// controller does not take it up again; unless the stage was fenced again since, whose restore
/// is still to come.
fn settled(tables: &Mutex<Tables>, stage: u32, serves: u64, source: Source) {
    let mut tables = tables.lock();
    if sidecar_fenced_in(&tables, stage) != serves {
        return;
    }
    tables.handed_back.insert(stage, (serves, source));
    tables.machine.restore_done(stage);
    if let Err(e) = tables.save() {
        error!(stage, error = %e, "cannot record a finished restore: a restarted controller does it again");
    }
}

/// Hands spare sidecars over to the fenced sidecars' places, every `every`, as the
/// controller's machine decides ([`dejavu_proto::spares::Spares`]): each is told its stage and epoch over its
/// control listener, if the stage still awaits that replacement; one that cannot be told is
/// reported, and the stage gets another.
pub(super) fn hand_over_spares(tables: &Mutex<Tables>, counters: &Counters, every: Duration) {
    loop {
        std::thread::sleep(every);
        let assignments = {
            let mut tables = tables.lock();
            let now = tables.now();
            tables.machine.assign_spares(Role::Sidecar, now)
        };
        for assignment in assignments {
            let Assignment { spare, member, epoch } = assignment;
            let awaited = |tables: &Tables| {
                tables.machine.membership(member).is_some_and(|m| m.awaiting && m.fenced_in == epoch)
            };
            // Checked in a statement of its own: the lock is let go before the spare is told. A
            // controller paused past its lease learns here that it no longer leads, before it
            // tells anyone anything.
            let still_awaited = {
                let mut tables = tables.lock();
                tables.store.confirm_leading().map(|()| awaited(&tables))
            };
            let handed = match still_awaited {
                Ok(true) => control_of(tables, spare).and_then(|c| Ok(c.assign(member.1, epoch)?)),
                Ok(false) => {
                    Err(ControllerError::Protocol(format!("{member:?} no longer awaits a replacement")))
                }
                Err(e) => Err(e),
            };
            let (stage, number) = (member.1, spare.1 - SPARE_MEMBERS);
            let mut tables = tables.lock();
            match handed {
                Ok(()) => {
                    let now = tables.now();
                    tables.machine.spare_handed_over(assignment, now);
                    counters.spares_assigned.fetch_add(1, Ordering::Relaxed);
                    info!(stage, epoch, spare = number, "handed a spare sidecar the stage");
                }
                Err(e) => {
                    tables.machine.spare_failed(assignment);
                    counters.spare_failures.fetch_add(1, Ordering::Relaxed);
                    warn!(stage, spare = number, error = %e, "could not hand a spare sidecar over");
                }
            }
        }
    }
}
