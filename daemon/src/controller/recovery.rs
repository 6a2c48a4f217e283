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
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use dejavu_proto::plan::{self, Loss, Reseed, Source, StagePlan};
use dejavulib::resume::resume_points;
use parking_lot::Mutex;
use tracing::info;

use super::{ControllerError, Counters, Member, Tables};
use crate::heartbeat::Role;
use crate::sidecar::control::SidecarControl;

/// How long one control request to a sidecar may take (a re-seed moves a stage's whole KV).
const SIDECAR_DEADLINE: Duration = Duration::from_secs(20);

/// A sequence's first unreplicated token, as the KV a restore source holds says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mark {
    /// The sequence's microbatch.
    pub microbatch: u32,
    /// Its slots.
    pub slots: Range<u32>,
    /// KV of tokens `0..tokens` is held for every layer and head of the stage.
    pub tokens: u32,
}

/// What the controller did and found for one failed stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageOrders {
    /// Its plan.
    pub plan: StagePlan,
    /// Chunks its predecessor's sidecar sent its new sidecar (a re-seed done now), if any.
    pub reseeded: Option<u64>,
    /// Each sequence's first unreplicated token in its restore source (none when lost).
    pub marks: Vec<Mark>,
}

impl StageOrders {
    /// The first unreplicated token of the sequence in `microbatch` at `slot`, if the source
    /// holds KV for exactly that slot.
    pub fn mark_of(&self, microbatch: u32, slot: u32) -> Option<u32> {
        self.marks
            .iter()
            .find(|m| m.microbatch == microbatch && m.slots == (slot..slot + 1))
            .map(|m| m.tokens)
    }
}

/// A recovery as the controller carried it out, stage by stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecoveryOrders {
    /// Its epoch.
    pub epoch: u64,
    /// Every failed stage, in stage order.
    pub stages: Vec<StageOrders>,
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
    let depth = book.len() as u32;
    let losses = losses_in(&tables.lock(), epoch, depth)?;
    let mut stages = Vec::new();
    for plan in plan::ring(depth, &losses) {
        let reseeded = match plan.reseed {
            Some((from, Reseed::Now)) => {
                Some(control_of(tables, (Role::Sidecar, from))?.reseed(book[from as usize])?)
            }
            Some((_, Reseed::AfterRestore)) | None => None,
        };
        let holder = match plan.source {
            Source::Own => Some(plan.stage),
            Source::Successor(successor) => Some(successor),
            Source::Lost => None,
        };
        let held = match holder {
            Some(holder) => control_of(tables, (Role::Sidecar, holder))?.held_of(plan.stage)?,
            None => Vec::new(),
        };
        let marks = resume_points(&held)
            .into_iter()
            .filter(|point| point.destination.stage == plan.stage)
            .map(|point| Mark { microbatch: point.microbatch, slots: point.slots, tokens: point.tokens })
            .collect();
        stages.push(StageOrders { plan, reseeded, marks });
    }
    counters.recoveries.fetch_add(1, Ordering::Relaxed);
    counters.recovery_micros.fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
    let reseeded: u64 = stages.iter().filter_map(|s| s.reseeded).sum();
    counters.reseeded_chunks.fetch_add(reseeded, Ordering::Relaxed);
    info!(epoch, ?losses, reseeded, took = ?started.elapsed(), "carried a recovery out");
    Ok(RecoveryOrders { epoch, stages })
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
    let depth = book.len() as u32;
    let losses = losses_in(&tables.lock(), epoch, depth)?;
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
/// book.
fn losses_in(tables: &Tables, epoch: u64, depth: u32) -> Result<Vec<(u32, Loss)>, ControllerError> {
    let current = tables.state.epoch;
    if epoch != current {
        return Err(ControllerError::Protocol(format!(
            "a recovery of epoch {epoch}, not the current {current}"
        )));
    }
    let fenced = |member: Member| tables.state.members.get(&member).is_some_and(|m| m.fenced_in == epoch);
    let losses: Vec<(u32, Loss)> = (0..depth)
        .filter_map(|stage| {
            if fenced((Role::Sidecar, stage)) {
                Some((stage, Loss::Worker))
            } else {
                fenced((Role::Engine, stage)).then_some((stage, Loss::Engine))
            }
        })
        .collect();
    if losses.is_empty() {
        return Err(ControllerError::Protocol(format!("no stage of {depth} was fenced in epoch {epoch}")));
    }
    Ok(losses)
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

/// Encodes `book` for a request: one address per line.
pub(super) fn encode_book(book: &[SocketAddr]) -> Vec<u8> {
    book.iter().map(SocketAddr::to_string).collect::<Vec<_>>().join("\n").into_bytes()
}

/// Inverse of [`encode_book`].
pub(super) fn decode_book(payload: &[u8]) -> Result<Vec<SocketAddr>, ControllerError> {
    let bad = || ControllerError::Protocol("a malformed address book".into());
    let text = std::str::from_utf8(payload).map_err(|_| bad())?;
    let book: Vec<SocketAddr> =
        text.split('\n').map(|a| a.parse().map_err(|_| bad())).collect::<Result<_, _>>()?;
    if book.is_empty() {
        return Err(ControllerError::Protocol("a ring of no stage".into()));
    }
    Ok(book)
}

/// Encodes `orders`' stages for a reply (the epoch travels in the frame header).
pub(super) fn encode_orders(orders: &RecoveryOrders) -> Vec<u8> {
    let mut out = Vec::new();
    let u32s = |out: &mut Vec<u8>, values: &[u32]| {
        values.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()))
    };
    u32s(&mut out, &[orders.stages.len() as u32]);
    for s in &orders.stages {
        let loss = match s.plan.loss {
            Loss::Engine => 0,
            Loss::Worker => 1,
        };
        let (source, holder) = match s.plan.source {
            Source::Own => (0, s.plan.stage),
            Source::Successor(successor) => (1, successor),
            Source::Lost => (2, 0),
        };
        let (reseed, from) = match s.plan.reseed {
            None => (0, 0),
            Some((from, Reseed::Now)) => (1, from),
            Some((from, Reseed::AfterRestore)) => (2, from),
        };
        let reseeded = s.reseeded.unwrap_or(u64::MAX);
        u32s(&mut out, &[s.plan.stage, loss, source, holder, reseed, from]);
        out.extend_from_slice(&reseeded.to_le_bytes());
        u32s(&mut out, &[s.marks.len() as u32]);
        for m in &s.marks {
            u32s(&mut out, &[m.microbatch, m.slots.start, m.slots.end, m.tokens]);
        }
    }
    out
}

/// Inverse of [`encode_orders`].
pub(super) fn decode_orders(epoch: u64, payload: &[u8]) -> Result<RecoveryOrders, ControllerError> {
    let mut r = Reader(payload);
    let bad = |what: &str| ControllerError::Protocol(format!("malformed recovery orders: {what}"));
    let count = r.u32().ok_or_else(|| bad("no count"))?;
    let mut stages = Vec::new();
    for _ in 0..count {
        let mut next = || r.u32().ok_or_else(|| bad("a short stage"));
        let [stage, loss, source, holder, reseed, from] =
            [next()?, next()?, next()?, next()?, next()?, next()?];
        let loss = match loss {
            0 => Loss::Engine,
            1 => Loss::Worker,
            _ => return Err(bad("an unknown loss")),
        };
        let source = match source {
            0 => Source::Own,
            1 => Source::Successor(holder),
            2 => Source::Lost,
            _ => return Err(bad("an unknown source")),
        };
        let reseed = match reseed {
            0 => None,
            1 => Some((from, Reseed::Now)),
            2 => Some((from, Reseed::AfterRestore)),
            _ => return Err(bad("an unknown re-seed")),
        };
        let reseeded = r.u64().ok_or_else(|| bad("a short stage"))?;
        let marks_len = r.u32().ok_or_else(|| bad("a short stage"))?;
        let mut marks = Vec::new();
        for _ in 0..marks_len {
            let mut next = || r.u32().ok_or_else(|| bad("a short mark"));
            let [microbatch, start, end, tokens] = [next()?, next()?, next()?, next()?];
            marks.push(Mark { microbatch, slots: start..end, tokens });
        }
        let plan = StagePlan { stage, loss, source, reseed };
        stages.push(StageOrders { plan, reseeded: (reseeded != u64::MAX).then_some(reseeded), marks });
    }
    if !r.0.is_empty() {
        return Err(bad("trailing bytes"));
    }
    Ok(RecoveryOrders { epoch, stages })
}

/// Reads little-endian integers off the front of a slice.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_first_chunk::<N>()?;
        self.0 = rest;
        Some(*head)
    }

    fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_and_books_survive_their_encoding_and_garbage_is_refused() {
        let orders = RecoveryOrders {
            epoch: 7,
            stages: vec![
                StageOrders {
                    plan: StagePlan {
                        stage: 1,
                        loss: Loss::Worker,
                        source: Source::Lost,
                        reseed: Some((0, Reseed::Now)),
                    },
                    reseeded: Some(12),
                    marks: vec![],
                },
                StageOrders {
                    plan: StagePlan {
                        stage: 2,
                        loss: Loss::Worker,
                        source: Source::Successor(3),
                        reseed: Some((1, Reseed::AfterRestore)),
                    },
                    reseeded: None,
                    marks: vec![
                        Mark { microbatch: 1, slots: 0..1, tokens: 40 },
                        Mark { microbatch: 0, slots: 2..3, tokens: 9 },
                    ],
                },
                StageOrders {
                    plan: StagePlan { stage: 3, loss: Loss::Engine, source: Source::Own, reseed: None },
                    reseeded: None,
                    marks: vec![Mark { microbatch: 0, slots: 0..1, tokens: 3 }],
                },
            ],
        };
        let encoded = encode_orders(&orders);
        assert_eq!(decode_orders(7, &encoded).unwrap(), orders);
        assert_eq!(orders.stages[1].mark_of(0, 2), Some(9));
        assert_eq!(orders.stages[1].mark_of(0, 0), None);
        for cut in 0..encoded.len() {
            assert!(decode_orders(7, &encoded[..cut]).is_err(), "cut at {cut}");
        }
        let mut extra = encoded.clone();
        extra.push(0);
        assert!(decode_orders(7, &extra).is_err());
        let book: Vec<SocketAddr> = vec!["127.0.0.1:5".parse().unwrap(), "[::1]:6".parse().unwrap()];
        assert_eq!(decode_book(&encode_book(&book)).unwrap(), book);
        assert!(decode_book(b"").is_err(), "no stage");
        assert!(decode_book(b"127.0.0.1:5\nnot an address").is_err());
    }
}
