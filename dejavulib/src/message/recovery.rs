//! What a controller did and found in a recovery, as it answers [`super::Message::Recover`].

use std::collections::BTreeMap;
use std::ops::Range;

use dejavu_proto::plan::{Loss, Reseed, Source, StagePlan};

use super::codec::{Reader, Writer};
use super::MessageError;

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

impl RecoveryOrders {
    /// Where whoever feeds the pipeline feeds each sequence again from: one mark per sequence
    /// (microbatch, slots) that any failed stage holds KV of, in order, whose `tokens` is the
    /// first token some failed stage does not hold (0 where a failed stage holds none of it).
    /// The tokens from there on are fed again through the whole pipeline; a sequence without a
    /// mark starts again from its first token.
    pub fn resume_from(&self) -> Vec<Mark> {
        let mut sequences: BTreeMap<(u32, u32, u32), u32> = BTreeMap::new();
        for mark in self.stages.iter().flat_map(|s| &s.marks) {
            sequences.insert((mark.microbatch, mark.slots.start, mark.slots.end), u32::MAX);
        }
        sequences
            .into_iter()
            .map(|((microbatch, start, end), _)| {
                let held = |stage: &StageOrders| {
                    let mark =
                        stage.marks.iter().find(|m| m.microbatch == microbatch && m.slots == (start..end));
                    mark.map_or(0, |m| m.tokens)
                };
                let tokens = self.stages.iter().map(held).min().unwrap_or(0);
                Mark { microbatch, slots: start..end, tokens }
            })
            .collect()
    }
}

/// Bytes of an encoded stage with no marks, and of an encoded mark.
const STAGE_LEN: usize = 6 * 4 + 8 + 4;
const MARK_LEN: usize = 4 * 4;

impl RecoveryOrders {
    pub(super) fn encode(&self, w: &mut Writer) {
        w.u64(self.epoch);
        w.len(self.stages.len());
        for s in &self.stages {
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
            for v in [s.plan.stage, loss, source, holder, reseed, from] {
                w.u32(v);
            }
            w.u64(s.reseeded.unwrap_or(u64::MAX));
            w.len(s.marks.len());
            for m in &s.marks {
                for v in [m.microbatch, m.slots.start, m.slots.end, m.tokens] {
                    w.u32(v);
                }
            }
        }
    }

    pub(super) fn decode(r: &mut Reader<'_>) -> Result<Self, MessageError> {
        let epoch = r.u64("recovery orders")?;
        let stages = r.list(STAGE_LEN, "recovery orders", |r| {
            let mut next = || r.u32("a stage's orders");
            let [stage, loss, source, holder, reseed, from] =
                [next()?, next()?, next()?, next()?, next()?, next()?];
            let loss = match loss {
                0 => Loss::Engine,
                1 => Loss::Worker,
                _ => return Err(MessageError::Malformed("a stage's loss")),
            };
            // The holder and the re-seed's origin only where they say something: one encoding.
            let source = match (source, holder) {
                (0, h) if h == stage => Source::Own,
                (1, h) => Source::Successor(h),
                (2, 0) => Source::Lost,
                _ => return Err(MessageError::Malformed("a stage's source")),
            };
            let reseed = match (reseed, from) {
                (0, 0) => None,
                (1, from) => Some((from, Reseed::Now)),
                (2, from) => Some((from, Reseed::AfterRestore)),
                _ => return Err(MessageError::Malformed("a stage's re-seed")),
            };
            let reseeded = r.u64("a stage's orders")?;
            let marks = r.list(MARK_LEN, "a stage's marks", |r| {
                let mut next = || r.u32("a mark");
                let [microbatch, start, end, tokens] = [next()?, next()?, next()?, next()?];
                Ok(Mark { microbatch, slots: start..end, tokens })
            })?;
            let plan = StagePlan { stage, loss, source, reseed };
            Ok(StageOrders { plan, reseeded: (reseeded != u64::MAX).then_some(reseeded), marks })
        })?;
        Ok(Self { epoch, stages })
    }
}
