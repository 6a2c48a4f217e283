//! Recovery planning on the ring, as a pure function: given the stages that failed and what of
//! each was lost, where each replacement restores its KV from and who gives its new sidecar the
//! replica it must hold.
//!
//! Every stage's KV has two copies: the stage's own sidecar keeps it (the local copy), and the
//! ring successor's sidecar keeps it as a replica. So a failed stage restores from its own
//! sidecar when only its engine died, from its successor's when the whole worker died, and from
//! nowhere when its successor's worker died too (adjacent failures: the ring has lost both
//! copies). A replaced sidecar starts empty: its predecessor's sidecar sends it the replica it
//! must hold, at once if that sidecar survived, or once the predecessor's replacement has
//! restored and rewritten its own KV.
//!
//! The [`crate::Controller`] state machine and the `dejavud` controller process both plan with
//! [`ring`].

/// What of a stage was lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Loss {
    /// The engine only: its sidecar, with the stage's local copy and the predecessor's replica,
    /// survived.
    Engine,
    /// The whole worker: engine and sidecar.
    Worker,
}

/// Where a replaced stage restores its KV from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Its own sidecar's local copy (no network transfer).
    Own,
    /// The replica its ring successor's sidecar (this stage) holds.
    Successor(u32),
    /// Nowhere: its successor's worker failed too. Its KV is recomputed (or read from a
    /// checkpoint).
    Lost,
}

/// When a replaced sidecar gets the replica it must hold from its predecessor's sidecar.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reseed {
    /// Now: the predecessor's sidecar survived and holds its stage's KV.
    Now,
    /// Once the predecessor's replacement has restored its KV: the predecessor's sidecar was
    /// replaced too and starts empty.
    AfterRestore,
}

/// The recovery of one failed stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagePlan {
    /// The stage.
    pub stage: u32,
    /// What of it was lost.
    pub loss: Loss,
    /// Where its replacement restores from.
    pub source: Source,
    /// For a replaced sidecar: its predecessor stage, which sends it the replica, and when.
    pub reseed: Option<(u32, Reseed)>,
}

/// Plans the recovery of the `failed` stages of a ring of `depth` stages. Each stage is planned
/// once, in stage order (a stage named twice counts as its larger loss); stages at or beyond
/// `depth` are left out.
pub fn ring(depth: u32, failed: &[(u32, Loss)]) -> Vec<StagePlan> {
    let mut failed: Vec<(u32, Loss)> = failed.iter().copied().filter(|&(s, _)| s < depth).collect();
    // Sorted by stage, then loss: the last of each stage is its larger loss.
    failed.sort_unstable();
    failed.reverse();
    failed.dedup_by_key(|&mut (stage, _)| stage);
    failed.reverse();
    let loss_of = |stage: u32| failed.iter().find(|&&(s, _)| s == stage).map(|&(_, loss)| loss);
    failed
        .iter()
        .map(|&(stage, loss)| {
            let successor = (stage + 1) % depth;
            let predecessor = (stage + depth - 1) % depth;
            let source = match loss {
                Loss::Engine => Source::Own,
                // A one-stage ring holds no replica of itself anywhere else.
                Loss::Worker if loss_of(successor) == Some(Loss::Worker) => Source::Lost,
                Loss::Worker => Source::Successor(successor),
            };
            // A one-stage ring is its own predecessor: it re-seeds itself once restored.
            let reseed = match loss {
                Loss::Worker => Some(match loss_of(predecessor) {
                    Some(Loss::Worker) => (predecessor, Reseed::AfterRestore),
                    None | Some(Loss::Engine) => (predecessor, Reseed::Now),
                }),
                Loss::Engine => None,
            };
            StagePlan { stage, loss, source, reseed }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_restores_from_its_own_sidecar_and_nobody_reseeds() {
        assert_eq!(
            ring(4, &[(2, Loss::Engine)]),
            [StagePlan { stage: 2, loss: Loss::Engine, source: Source::Own, reseed: None }]
        );
    }

    #[test]
    fn a_worker_restores_from_its_successor_and_its_predecessor_reseeds_now() {
        assert_eq!(
            ring(4, &[(3, Loss::Worker)]),
            [StagePlan {
                stage: 3,
                loss: Loss::Worker,
                source: Source::Successor(0),
                reseed: Some((2, Reseed::Now))
            }]
        );
    }

    #[test]
    fn adjacent_workers_lose_the_first_ones_kv_and_the_second_waits_for_its_restore() {
        let plan = ring(4, &[(2, Loss::Worker), (1, Loss::Worker)]);
        assert_eq!(
            plan,
            [
                StagePlan {
                    stage: 1,
                    loss: Loss::Worker,
                    source: Source::Lost,
                    reseed: Some((0, Reseed::Now))
                },
                StagePlan {
                    stage: 2,
                    loss: Loss::Worker,
                    source: Source::Successor(3),
                    reseed: Some((1, Reseed::AfterRestore))
                },
            ]
        );
    }

    #[test]
    fn a_successor_that_lost_only_its_engine_still_holds_the_replica() {
        let plan = ring(3, &[(0, Loss::Worker), (1, Loss::Engine)]);
        assert_eq!(plan[0].source, Source::Successor(1));
        assert_eq!(plan[0].reseed, Some((2, Reseed::Now)));
        assert_eq!(plan[1], StagePlan { stage: 1, loss: Loss::Engine, source: Source::Own, reseed: None });
    }

    #[test]
    fn a_predecessor_that_lost_only_its_engine_reseeds_at_once_from_its_sidecar() {
        let plan = ring(3, &[(1, Loss::Engine), (2, Loss::Worker)]);
        assert_eq!(plan[1].reseed, Some((1, Reseed::Now)));
    }

    #[test]
    fn every_worker_lost_loses_every_copy() {
        let all: Vec<_> = (0..3).map(|s| (s, Loss::Worker)).collect();
        for p in ring(3, &all) {
            assert_eq!(p.source, Source::Lost);
            assert_eq!(p.reseed.map(|r| r.1), Some(Reseed::AfterRestore));
        }
    }

    #[test]
    fn duplicates_count_as_the_larger_loss_and_strangers_are_left_out() {
        let plan = ring(2, &[(1, Loss::Engine), (1, Loss::Worker), (7, Loss::Worker)]);
        assert_eq!(plan.len(), 1);
        assert_eq!(plan[0].loss, Loss::Worker);
        assert_eq!(plan[0].source, Source::Successor(0));
        assert_eq!(ring(1, &[(0, Loss::Worker)])[0].source, Source::Lost);
        assert_eq!(ring(1, &[(0, Loss::Worker)])[0].reseed, Some((0, Reseed::AfterRestore)));
    }
}
