//! Pipeline setups: which worker holds which layers, heads and requests.
//!
//! A [`Setup`] is a pipeline of stages. Each stage holds a contiguous layer range (splits may be
//! unequal, as in HexGen's 48/20/12) and shards KV heads over its tensor-parallel ranks (TP degrees
//! may differ per stage). Requests are grouped into `microbatches` of `microbatch_slots` slots; every
//! stage of a pipeline processes the same microbatches, so slots are a property of the setup.
//! Request `g` lives in microbatch `g / microbatch_slots`, slot `g % microbatch_slots`.
//!
//! With TP degree `T <= kv_heads`, rank `r` holds heads `[r * kv_heads / T, (r + 1) * kv_heads / T)`.
//! With `T > kv_heads` (GQA/MQA), each KV head is replicated on `T / kv_heads` consecutive ranks; the
//! first of them is the head's *primary* holder, the one that sends it when streaming out.

use std::ops::Range;

use thiserror::Error;

use crate::spec::{KvSpec, SpecError};

/// Errors describing a setup.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SetupError {
    /// The stages leave a gap, overlap or do not cover every layer.
    #[error("stage {stage} starts at layer {start}, expected {expected}")]
    LayerGap {
        /// Stage index.
        stage: usize,
        /// Its first layer.
        start: u32,
        /// Where it should start.
        expected: u32,
    },
    /// The last stage does not end at the model's last layer.
    #[error("stages cover {covered} of {layers} layers")]
    Coverage {
        /// Layers covered.
        covered: u32,
        /// Layers in the model.
        layers: u32,
    },
    /// A TP degree neither divides nor is a multiple of the KV head count.
    #[error("stage {stage}: TP degree {tp} does not fit {kv_heads} KV heads (one must divide the other)")]
    BadTp {
        /// Stage index.
        stage: usize,
        /// Its TP degree.
        tp: u32,
        /// KV heads of the model.
        kv_heads: u32,
    },
    /// A count was zero.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// A worker id outside the setup.
    #[error("no worker {0:?} in this setup")]
    NoSuchWorker(WorkerId),
    /// Two setups describe different models or request counts.
    #[error("setups are incompatible: {0}")]
    Incompatible(String),
    /// A derived spec is invalid.
    #[error(transparent)]
    Spec(#[from] SpecError),
}

/// A worker: one tensor-parallel rank of one pipeline stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId {
    /// Pipeline stage.
    pub stage: u32,
    /// Tensor-parallel rank within the stage.
    pub rank: u32,
}

/// One pipeline stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageSpec {
    /// Global layers it holds.
    pub layers: Range<u32>,
    /// Tensor-parallel degree.
    pub tp: u32,
}

/// What one worker holds, in global coordinates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holding {
    /// Global layers.
    pub layers: Range<u32>,
    /// Global KV heads.
    pub heads: Range<u32>,
    /// Whether this worker is the primary holder of its heads (false for extra GQA replicas).
    pub primary: bool,
}

/// A pipeline: the model's KV spec, its stages, and how requests are batched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setup {
    spec: KvSpec,
    stages: Vec<StageSpec>,
    microbatch_slots: u32,
    microbatches: u32,
}

impl Setup {
    /// Validates and builds a setup; `spec` describes the whole model.
    pub fn new(
        spec: KvSpec,
        stages: Vec<StageSpec>,
        microbatch_slots: u32,
        microbatches: u32,
    ) -> Result<Self, SetupError> {
        if stages.is_empty() {
            return Err(SetupError::Zero("stages"));
        }
        if microbatch_slots == 0 {
            return Err(SetupError::Zero("microbatch_slots"));
        }
        if microbatches == 0 {
            return Err(SetupError::Zero("microbatches"));
        }
        if microbatches.checked_mul(microbatch_slots).is_none() {
            return Err(SetupError::Incompatible(format!(
                "{microbatches} microbatches of {microbatch_slots} slots overflow a 32-bit request count"
            )));
        }
        let mut expected = 0;
        for (i, stage) in stages.iter().enumerate() {
            if stage.layers.start != expected || stage.layers.end <= stage.layers.start {
                return Err(SetupError::LayerGap { stage: i, start: stage.layers.start, expected });
            }
            expected = stage.layers.end;
            let kv = spec.kv_heads();
            if stage.tp == 0 || (kv % stage.tp != 0 && stage.tp % kv != 0) {
                return Err(SetupError::BadTp { stage: i, tp: stage.tp, kv_heads: kv });
            }
        }
        if expected != spec.layers() {
            return Err(SetupError::Coverage { covered: expected, layers: spec.layers() });
        }
        Ok(Self { spec, stages, microbatch_slots, microbatches })
    }

    /// A setup of `depth` stages with layers split as evenly as possible (earlier stages take the
    /// remainder) and the same TP degree everywhere.
    pub fn uniform(
        spec: KvSpec,
        depth: u32,
        tp: u32,
        microbatch_slots: u32,
        microbatches: u32,
    ) -> Result<Self, SetupError> {
        if depth == 0 {
            return Err(SetupError::Zero("depth"));
        }
        if depth > spec.layers() {
            return Err(SetupError::Coverage { covered: depth, layers: spec.layers() });
        }
        let (base, extra) = (spec.layers() / depth, spec.layers() % depth);
        let mut start = 0;
        let stages = (0..depth)
            .map(|i| {
                let len = base + u32::from(i < extra);
                let stage = StageSpec { layers: start..start + len, tp };
                start += len;
                stage
            })
            .collect();
        Self::new(spec, stages, microbatch_slots, microbatches)
    }

    /// The model's spec.
    pub fn spec(&self) -> &KvSpec {
        &self.spec
    }

    /// The stages.
    pub fn stages(&self) -> &[StageSpec] {
        &self.stages
    }

    /// Slots per microbatch.
    pub fn microbatch_slots(&self) -> u32 {
        self.microbatch_slots
    }

    /// Microbatches in flight.
    pub fn microbatches(&self) -> u32 {
        self.microbatches
    }

    /// Requests the setup holds: microbatches x slots.
    pub fn requests(&self) -> u32 {
        self.microbatches * self.microbatch_slots
    }

    /// Every worker, stage by stage, rank by rank.
    pub fn workers(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.stages
            .iter()
            .enumerate()
            .flat_map(|(s, st)| (0..st.tp).map(move |rank| WorkerId { stage: s as u32, rank }))
    }

    /// The layers and heads `worker` holds.
    pub fn holding(&self, worker: WorkerId) -> Result<Holding, SetupError> {
        let stage = self
            .stages
            .get(worker.stage as usize)
            .filter(|s| worker.rank < s.tp)
            .ok_or(SetupError::NoSuchWorker(worker))?;
        let kv = self.spec.kv_heads();
        let (heads, primary) = if stage.tp <= kv {
            let per = kv / stage.tp;
            (worker.rank * per..(worker.rank + 1) * per, true)
        } else {
            let replicas = stage.tp / kv;
            let head = worker.rank / replicas;
            (head..head + 1, worker.rank % replicas == 0)
        };
        Ok(Holding { layers: stage.layers.clone(), heads, primary })
    }

    /// The spec of `worker`'s local cache: its layers and heads only.
    pub fn local_spec(&self, worker: WorkerId) -> Result<KvSpec, SetupError> {
        let h = self.holding(worker)?;
        Ok(self.spec.share(h.layers.len() as u32, h.heads.len() as u32)?)
    }

    /// Global request range of microbatch `m` (empty for a microbatch the setup does not have).
    pub fn microbatch_requests(&self, m: u32) -> Range<u32> {
        if m >= self.microbatches {
            return 0..0;
        }
        // In range: `new` checked that microbatches x slots fits in u32.
        m * self.microbatch_slots..(m + 1) * self.microbatch_slots
    }

    /// Checks that `other` holds the same model and the same number of requests.
    pub fn check_compatible(&self, other: &Setup) -> Result<(), SetupError> {
        if self.spec != other.spec {
            return Err(SetupError::Incompatible(format!("{:?} vs {:?}", self.spec, other.spec)));
        }
        if self.requests() != other.requests() {
            return Err(SetupError::Incompatible(format!(
                "{} requests vs {}",
                self.requests(),
                other.requests()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::DType;

    #[test]
    fn hexgen_asymmetric_split_is_expressible() {
        let spec = KvSpec::new(80, 8, 128, DType::F16).unwrap();
        let stages = vec![
            StageSpec { layers: 0..48, tp: 4 },
            StageSpec { layers: 48..68, tp: 2 },
            StageSpec { layers: 68..80, tp: 2 },
        ];
        let setup = Setup::new(spec, stages, 8, 3).unwrap();
        assert_eq!(setup.workers().count(), 8);
        let h = setup.holding(WorkerId { stage: 0, rank: 3 }).unwrap();
        assert_eq!((h.layers, h.heads), (0..48, 6..8));
        let h = setup.holding(WorkerId { stage: 1, rank: 1 }).unwrap();
        assert_eq!((h.layers, h.heads), (48..68, 4..8));
    }

    #[test]
    fn gqa_with_more_ranks_than_heads_replicates() {
        let spec = KvSpec::new(4, 2, 64, DType::F16).unwrap();
        let setup = Setup::uniform(spec, 1, 8, 4, 1).unwrap();
        let holdings: Vec<_> = setup.workers().map(|w| setup.holding(w).unwrap()).collect();
        assert_eq!(holdings[3].heads, 0..1);
        assert!(!holdings[3].primary);
        assert_eq!(holdings[4].heads, 1..2);
        assert!(holdings[4].primary);
        assert_eq!(holdings.iter().filter(|h| h.primary).count(), 2);
    }

    #[test]
    fn bad_setups_are_typed_errors() {
        let spec = KvSpec::new(10, 6, 64, DType::F16).unwrap();
        let gap = vec![StageSpec { layers: 0..4, tp: 1 }, StageSpec { layers: 5..10, tp: 1 }];
        assert!(matches!(Setup::new(spec, gap, 1, 1), Err(SetupError::LayerGap { stage: 1, .. })));
        let short = vec![StageSpec { layers: 0..9, tp: 1 }];
        assert!(matches!(Setup::new(spec, short, 1, 1), Err(SetupError::Coverage { .. })));
        let tp = vec![StageSpec { layers: 0..10, tp: 4 }];
        assert!(matches!(Setup::new(spec, tp, 1, 1), Err(SetupError::BadTp { tp: 4, .. })));
        let setup = Setup::uniform(spec, 2, 3, 2, 2).unwrap();
        assert!(setup.holding(WorkerId { stage: 0, rank: 3 }).is_err());
        assert_eq!(setup.microbatch_requests(2), 0..0);
        assert!(matches!(Setup::uniform(spec, 1, 1, 1 << 16, 1 << 16), Err(SetupError::Incompatible(_))));
        assert!(matches!(Setup::uniform(spec, 11, 1, 1, 1), Err(SetupError::Coverage { .. })));
    }
}
