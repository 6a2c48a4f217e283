//! Memory check per stage: each rank holds its layers' weights (split over TP) and its share of
//! the KV of every request in flight; `layers x (weights + KV) <= memory` must hold on every rank.

use crate::placement::{Setup, WorkerId};

use super::{non_negative, positive, PlanError};

/// Memory use of the fullest rank of one stage.
#[derive(Clone, Debug, PartialEq)]
pub struct StageMemory {
    /// Stage index.
    pub stage: u32,
    /// Bytes its fullest rank needs.
    pub needed: f64,
    /// Bytes each of its ranks has.
    pub available: f64,
}

impl StageMemory {
    /// Whether the stage fits.
    pub fn fits(&self) -> bool {
        self.needed <= self.available
    }

    /// Bytes missing (0 when it fits).
    pub fn shortfall(&self) -> f64 {
        (self.needed - self.available).max(0.0)
    }
}

/// Checks every stage of `setup` holding `tokens_per_request` tokens for all its requests, with
/// `weights_per_layer` bytes of weights per layer and `memory[stage]` bytes per rank (one value
/// for every stage, or one per stage for heterogeneous machines).
pub fn check_stage_memory(
    setup: &Setup,
    weights_per_layer: f64,
    tokens_per_request: u64,
    memory: &[f64],
) -> Result<Vec<StageMemory>, PlanError> {
    let w0 = non_negative("weights_per_layer", weights_per_layer)?;
    if memory.len() != 1 && memory.len() != setup.stages().len() {
        return Err(PlanError::Setup(format!(
            "memory has {} entries: give one, or one per stage ({})",
            memory.len(),
            setup.stages().len()
        )));
    }
    let requests = setup.requests() as f64;
    setup
        .stages()
        .iter()
        .enumerate()
        .map(|(s, stage)| {
            let available = positive("memory", memory[if memory.len() == 1 { 0 } else { s }])?;
            let layers = stage.layers.len() as f64;
            let needed = (0..stage.tp)
                .map(|rank| {
                    let worker = WorkerId { stage: s as u32, rank };
                    let kv = setup.local_spec(worker).map_err(|e| PlanError::Setup(e.to_string()))?;
                    let kv_bytes = kv.bytes_per_token() as f64 * tokens_per_request as f64 * requests;
                    Ok(layers * w0 / stage.tp as f64 + kv_bytes)
                })
                .try_fold(0.0f64, |acc, x: Result<f64, PlanError>| Ok::<_, PlanError>(acc.max(x?)))?;
            Ok(StageMemory { stage: s as u32, needed, available })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::StageSpec;
    use crate::spec::{DType, KvSpec};

    #[test]
    fn reports_the_stage_that_does_not_fit_and_by_how_much() {
        let spec = KvSpec::new(80, 8, 128, DType::F16).unwrap();
        let stages = vec![
            StageSpec { layers: 0..48, tp: 4 },
            StageSpec { layers: 48..68, tp: 2 },
            StageSpec { layers: 68..80, tp: 2 },
        ];
        let setup = Setup::new(spec, stages, 8, 3).unwrap();
        let gb = 1e9;
        let report = check_stage_memory(&setup, 1.6 * gb, 2048, &[24.0 * gb]).unwrap();
        // Stage 0 rank: 48 x 1.6 GB / 4 = 19.2 GB of weights; KV: 48 layers x 2 heads x 512 B x
        // 2048 tokens x 24 requests = 2.42 GB.
        let kv0 = 48.0 * 2.0 * 512.0 * 2048.0 * 24.0;
        assert!((report[0].needed - (19.2 * gb + kv0)).abs() < 1.0);
        assert!(report[0].fits());
        // Stage 1 rank: 20 x 1.6 / 2 = 16 GB + 20 x 4 x 512 x 2048 x 24 = 2.01 GB.
        assert!(report[1].fits());
        let tight = check_stage_memory(&setup, 1.6 * gb, 2048, &[21.0 * gb, 17.0 * gb, 12.0 * gb]).unwrap();
        assert!(!tight[0].fits());
        assert!((tight[0].shortfall() - (19.2 * gb + kv0 - 21.0 * gb)).abs() < 1.0);
        assert!(!tight[1].fits());
        assert!(tight[2].fits());
    }

    #[test]
    fn memory_list_must_match_the_stages() {
        let spec = KvSpec::new(2, 2, 8, DType::F16).unwrap();
        let setup = Setup::uniform(spec, 2, 1, 1, 1).unwrap();
        assert!(matches!(check_stage_memory(&setup, 1.0, 1, &[1.0, 1.0, 1.0]), Err(PlanError::Setup(_))));
        assert!(matches!(
            check_stage_memory(&setup, 1.0, 1, &[0.0]),
            Err(PlanError::NotPositive { field: "memory", .. })
        ));
    }
}
