//! The invariants of the reliability contract, checked on a run's history against the failure-free
//! reference run of the same workload.

use std::time::Duration;

use dejavu_engine::driver::{RecoveryRecord, Run};
use serde::Serialize;

use crate::scenario::Limits;

/// One broken invariant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Violation {
    /// Which invariant.
    pub invariant: &'static str,
    /// What happened.
    pub detail: String,
    /// The step it showed at, when known (faults injected at or before it are blamed).
    pub step: Option<u64>,
}

/// Every violation in `run` (or in its failure to finish), judged against `reference`.
pub fn check(reference: &Run, run: Result<&Run, String>, limits: &Limits) -> Vec<Violation> {
    let run = match run {
        Ok(run) => run,
        Err(why) => {
            return vec![Violation { invariant: "run completes", detail: why, step: None }];
        }
    };
    let mut violations = Vec::new();
    output_is_identical(reference, run, &mut violations);
    each_position_delivered_once(run, &mut violations);
    recompute_is_bounded(run, limits, &mut violations);
    recovery_is_bounded(run, limits, &mut violations);
    violations
}

/// Bit-identical output: every request's tokens equal the reference's.
fn output_is_identical(reference: &Run, run: &Run, out: &mut Vec<Violation>) {
    for (request, (got, want)) in run.tokens.iter().zip(&reference.tokens).enumerate() {
        let Some(index) = (0..got.len().max(want.len())).find(|&i| got.get(i) != want.get(i)) else {
            continue;
        };
        let step = run
            .deliveries
            .iter()
            .find(|d| d.request as usize == request && d.index as usize == index)
            .map(|d| d.step);
        out.push(Violation {
            invariant: "bit-identical output",
            detail: format!(
                "request {request}, token {index}: {:?} where the failure-free run has {:?}",
                got.get(index),
                want.get(index)
            ),
            step,
        });
    }
    if run.tokens.len() != reference.tokens.len() {
        out.push(Violation {
            invariant: "bit-identical output",
            detail: format!("{} requests answered of {}", run.tokens.len(), reference.tokens.len()),
            step: None,
        });
    }
}

/// Exactly-once delivery: each request's tokens were delivered once each, in order.
fn each_position_delivered_once(run: &Run, out: &mut Vec<Violation>) {
    let mut next = vec![0u32; run.tokens.len()];
    for d in &run.deliveries {
        let Some(expected) = next.get_mut(d.request as usize) else {
            out.push(Violation {
                invariant: "exactly-once delivery",
                detail: format!("a token for request {} that does not exist", d.request),
                step: Some(d.step),
            });
            continue;
        };
        if d.index != *expected {
            out.push(Violation {
                invariant: "exactly-once delivery",
                detail: format!(
                    "request {}: position {} delivered where {} was next",
                    d.request, d.index, expected
                ),
                step: Some(d.step),
            });
        }
        *expected = d.index + 1;
    }
}

/// Bounded recompute: no recovery recomputes more than the replication lag allows, except one
/// that lost a stage's copies with its ring successor (adjacent workers): the ring cannot restore
/// that, and the recovery says it recomputed from the prompts instead.
fn recompute_is_bounded(run: &Run, limits: &Limits, out: &mut Vec<Violation>) {
    let over = |r: &&RecoveryRecord| r.recomputed > limits.max_recompute && r.copies_lost.is_empty();
    for r in run.recoveries.iter().filter(over) {
        out.push(Violation {
            invariant: "bounded recompute",
            detail: format!(
                "recovering {:?} recomputed {} steps, more than the {} replication allows",
                r.victims, r.recomputed, limits.max_recompute
            ),
            step: Some(r.step),
        });
    }
}

/// Bounded recovery: detection and the rest of the recovery within their budgets.
fn recovery_is_bounded(run: &Run, limits: &Limits, out: &mut Vec<Violation>) {
    let detection = Duration::from_millis(limits.max_detection_ms);
    let recovery = Duration::from_millis(limits.max_recovery_ms);
    for r in &run.recoveries {
        if r.detection > detection {
            out.push(Violation {
                invariant: "bounded recovery",
                detail: format!("the failure of {:?} took {:?} to detect", r.victims, r.detection),
                step: Some(r.step),
            });
        }
        if r.restore + r.resume > recovery {
            out.push(Violation {
                invariant: "bounded recovery",
                detail: format!("{:?} took {:?} to recover", r.victims, r.restore + r.resume),
                step: Some(r.step),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use dejavu_engine::cluster::Kill;
    use dejavu_engine::driver::Delivery;

    use super::*;

    fn run(tokens: &[&[u32]]) -> Run {
        let mut run = Run { tokens: tokens.iter().map(|t| t.to_vec()).collect(), ..Run::default() };
        let mut step = 0;
        for index in 0..tokens.iter().map(|t| t.len()).max().unwrap_or(0) {
            for (request, t) in tokens.iter().enumerate() {
                if let Some(&token) = t.get(index) {
                    let (request, index) = (request as u32, index as u32);
                    run.deliveries.push(Delivery { request, index, token, step });
                    step += 1;
                }
            }
        }
        run
    }

    fn recovery(recomputed: u64, detection_ms: u64) -> RecoveryRecord {
        RecoveryRecord {
            victims: vec![(1, Kill::Worker)],
            copies_lost: Vec::new(),
            step: 3,
            detection: Duration::from_millis(detection_ms),
            restore: Duration::from_millis(50),
            resume: Duration::from_millis(1),
            recomputed,
        }
    }

    #[test]
    fn a_clean_run_passes() {
        let reference = run(&[&[1, 2, 3], &[4, 5, 6]]);
        let mut same = reference.clone();
        same.recoveries.push(recovery(2, 300));
        assert_eq!(check(&reference, Ok(&same), &Limits::default()), vec![]);
    }

    #[test]
    fn each_invariant_can_fail() {
        let reference = run(&[&[1, 2, 3], &[4, 5, 6]]);
        let limits = Limits::default();
        let invariants = |r: &Run| -> Vec<&str> {
            check(&reference, Ok(r), &limits).iter().map(|v| v.invariant).collect()
        };

        let wrong = run(&[&[1, 2, 3], &[4, 9, 6]]);
        let found = check(&reference, Ok(&wrong), &limits);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].invariant, "bit-identical output");
        assert_eq!(found[0].step, Some(3), "blamed on the step that delivered it");

        let mut twice = reference.clone();
        let again = twice.deliveries[0];
        twice.deliveries.push(again);
        assert_eq!(invariants(&twice), ["exactly-once delivery"]);

        let mut lagging = reference.clone();
        lagging.recoveries.push(recovery(limits.max_recompute + 1, 300));
        assert_eq!(invariants(&lagging), ["bounded recompute"]);
        // Unless the copies died too, which the recovery says.
        lagging.recoveries[0].victims.push((2, Kill::Worker));
        lagging.recoveries[0].copies_lost.push(1);
        assert!(invariants(&lagging).is_empty());

        let mut slow = reference.clone();
        slow.recoveries.push(recovery(1, limits.max_detection_ms + 1));
        assert_eq!(invariants(&slow), ["bounded recovery"]);

        let failed = check(&reference, Err("stuck".into()), &limits);
        assert_eq!(failed[0].invariant, "run completes");
    }
}
