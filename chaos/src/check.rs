//! The invariants of the reliability contract, checked on a run's history against the failure-free
//! reference run of the same workload.

use std::time::Duration;

use dejavud::driver::{Delivery, Run};
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

/// Every violation in `run`, judged against `reference`; `failure` says why the run stopped early,
/// if it did (what it delivered until then is still checked).
pub fn check(reference: &Run, run: &Run, failure: Option<&str>, limits: &Limits) -> Vec<Violation> {
    let mut violations = Vec::new();
    if let Some(why) = failure {
        // The run broke after the last step it recorded: blame what came before that.
        let last = run.deliveries.iter().map(|d| d.step).chain(run.recoveries.iter().map(|r| r.step)).max();
        violations.push(Violation {
            invariant: "run completes",
            detail: why.to_owned(),
            step: Some(last.map_or(0, |s| s + 1)),
        });
    }
    output_is_identical(reference, run, failure.is_some(), &mut violations);
    each_position_delivered_once(run, &mut violations);
    recompute_is_bounded(run, limits, &mut violations);
    recovery_is_bounded(run, limits, &mut violations);
    epochs_only_grow(run, &mut violations);
    recoveries_replay(run, &mut violations);
    violations
}

/// Bit-identical output: every request's tokens equal the reference's (of a run that stopped
/// early, the tokens it delivered).
fn output_is_identical(reference: &Run, run: &Run, stopped_early: bool, out: &mut Vec<Violation>) {
    for (request, (got, want)) in run.tokens.iter().zip(&reference.tokens).enumerate() {
        let compared = if stopped_early { got.len() } else { got.len().max(want.len()) };
        let Some(index) = (0..compared).find(|&i| got.get(i) != want.get(i)) else { continue };
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

/// Exactly-once delivery, from what the last stage reported with each token: all of a request's
/// tokens come from one sequence slot, which no other request uses until it has all its tokens
/// (requests that take turns in seats reuse the slots of finished ones), and each step extended
/// that sequence's KV by exactly one position past the previous delivery's (a position computed
/// twice and delivered twice, or skipped, breaks the chain).
fn each_position_delivered_once(run: &Run, out: &mut Vec<Violation>) {
    let mut last: Vec<Option<&Delivery>> = vec![None; run.tokens.len()];
    let mut delivered = vec![0; run.tokens.len()];
    let mut owner = std::collections::HashMap::new();
    for d in &run.deliveries {
        let mut fail = |detail: String| {
            out.push(Violation { invariant: "exactly-once delivery", detail, step: Some(d.step) });
        };
        let Some(previous) = last.get_mut(d.request as usize) else {
            fail(format!("a token for request {}, which does not exist", d.request));
            continue;
        };
        let seat = (d.seat.microbatch, d.seat.slot);
        let unfinished = |r: u32| delivered[r as usize] < run.tokens[r as usize].len();
        if let Some(other) = owner.insert(seat, d.request).filter(|&o| o != d.request && unfinished(o)) {
            fail(format!("requests {other} and {} both got tokens from slot {seat:?}", d.request));
        }
        if let Some(p) = previous.filter(|p| (p.seat.microbatch, p.seat.slot) != seat) {
            fail(format!(
                "request {}: tokens from slots {:?} and {seat:?}",
                d.request,
                (p.seat.microbatch, p.seat.slot)
            ));
        }
        delivered[d.request as usize] += 1;
        if let Some(p) = previous.filter(|p| d.kv_end != p.kv_end + 1) {
            fail(format!(
                "request {}: a token computed through position {} after one through {}",
                d.request, d.kv_end, p.kv_end
            ));
        }
        *previous = Some(d);
    }
}

/// Bounded recompute: for every victim of a recovery, the steps its copies lacked, plus the
/// interrupted step, within what replication allows; except a victim whose copies died with its
/// ring successor (adjacent workers), which the ring cannot restore and the recovery reports.
fn recompute_is_bounded(run: &Run, limits: &Limits, out: &mut Vec<Violation>) {
    for r in &run.recoveries {
        for &(stage, lag) in r.lag.iter().filter(|(stage, _)| !r.copies_lost.contains(stage)) {
            if lag + 1 > limits.max_recompute {
                out.push(Violation {
                    invariant: "bounded recompute",
                    detail: format!(
                        "stage {stage}'s copies lacked {lag} steps at a failure of {:?}; replication allows {}",
                        r.victims,
                        limits.max_recompute - 1
                    ),
                    step: Some(r.step),
                });
            }
        }
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

/// Fencing: each recovery runs in an epoch of its own, above every earlier one, even when the
/// controller crashed and was replaced in between (an epoch handed out twice would let a fenced
/// process pass for a live one).
fn epochs_only_grow(run: &Run, out: &mut Vec<Violation>) {
    let mut last = 0;
    for r in &run.recoveries {
        if r.epoch <= last {
            out.push(Violation {
                invariant: "fenced epochs",
                detail: format!(
                    "the recovery of {:?} ran in epoch {} after epoch {last}",
                    r.victims, r.epoch
                ),
                step: Some(r.step),
            });
        }
        last = last.max(r.epoch);
    }
}

/// One control plane: every recovery the run carried out took the steps a fresh recovery machine
/// takes from the same inputs.
fn recoveries_replay(run: &Run, out: &mut Vec<Violation>) {
    for r in &run.recoveries {
        if let Err((at, recorded, replayed)) = r.transcript.replay() {
            out.push(Violation {
                invariant: "recoveries replay",
                detail: format!(
                    "the recovery of {:?} took {recorded:?} at its step {at}, a fresh machine {replayed:?}",
                    r.victims
                ),
                step: Some(r.step),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use dejavu_engine::Seat;
    use dejavu_proto::plan::Loss;
    use dejavu_proto::recovery::{Answer, Input, Recovery, RecoveryConfig, Transcript};
    use dejavud::cluster::Kill;
    use dejavud::driver::RecoveryRecord;

    use super::*;

    /// A run that delivered `tokens`, request `r` in slot `r`, prompts of 4 tokens.
    fn run(tokens: &[&[u32]]) -> Run {
        let mut run = Run { tokens: tokens.iter().map(|t| t.to_vec()).collect(), ..Run::default() };
        let mut step = 0;
        for index in 0..tokens.iter().map(|t| t.len()).max().unwrap_or(0) {
            for (request, t) in tokens.iter().enumerate() {
                if let Some(&token) = t.get(index) {
                    let (request, index) = (request as u32, index as u32);
                    let seat = Seat { microbatch: 0, slot: request };
                    run.deliveries.push(Delivery { request, index, token, step, seat, kv_end: 4 + index });
                    step += 1;
                }
            }
        }
        run
    }

    fn recovery(lag: u64, detection_ms: u64) -> RecoveryRecord {
        RecoveryRecord {
            victims: vec![(1, Kill::Worker)],
            epoch: 1,
            copies_lost: Vec::new(),
            lag: vec![(1, lag)],
            step: 3,
            detection: Duration::from_millis(detection_ms),
            restore: Duration::from_millis(50),
            resume: Duration::from_millis(1),
            recomputed: lag + 1,
            interrupted: true,
            attempts: 1,
            killed_during: Vec::new(),
            transcript: Default::default(),
        }
    }

    #[test]
    fn a_clean_run_passes() {
        let reference = run(&[&[1, 2, 3], &[4, 5, 6]]);
        let mut same = reference.clone();
        same.recoveries.push(recovery(2, 300));
        assert_eq!(check(&reference, &same, None, &Limits::default()), vec![]);
    }

    #[test]
    fn each_invariant_can_fail() {
        let reference = run(&[&[1, 2, 3], &[4, 5, 6]]);
        let limits = Limits::default();
        // The invariants broken, each named once.
        let invariants = |r: &Run| -> Vec<&str> {
            let mut names: Vec<&str> =
                check(&reference, r, None, &limits).iter().map(|v| v.invariant).collect();
            names.dedup();
            names
        };
        let wrong = run(&[&[1, 2, 3], &[4, 9, 6]]);
        let found = check(&reference, &wrong, None, &limits);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].invariant, "bit-identical output");
        assert_eq!(found[0].step, Some(3), "blamed on the step that delivered it");

        // A position computed and delivered twice, and one skipped.
        let mut twice = reference.clone();
        twice.deliveries[2].kv_end -= 1;
        assert_eq!(invariants(&twice), ["exactly-once delivery"]);
        let mut skipped = reference.clone();
        skipped.deliveries[4].kv_end += 1;
        assert_eq!(invariants(&skipped), ["exactly-once delivery"]);
        // Two requests answered from one slot.
        let mut shared = reference.clone();
        shared.deliveries[1].seat.slot = 0;
        assert_eq!(invariants(&shared), ["exactly-once delivery"]);

        // A request that takes a finished one's seat is answered from it; one that takes it early
        // is not.
        let mut turns = reference.clone();
        for d in turns.deliveries.iter_mut().filter(|d| d.request == 1) {
            (d.seat.slot, d.step) = (0, d.step + 10);
        }
        turns.deliveries.sort_by_key(|d| d.step);
        assert!(invariants(&turns).is_empty());
        let mut early = reference.clone();
        for d in early.deliveries.iter_mut().filter(|d| d.request == 1) {
            d.seat.slot = 0;
        }
        assert_eq!(invariants(&early), ["exactly-once delivery"]);

        let mut lagging = reference.clone();
        lagging.recoveries.push(recovery(limits.max_recompute, 300));
        assert_eq!(invariants(&lagging), ["bounded recompute"]);
        // Unless that stage's copies died with its successor, which the recovery says; the
        // successor itself is still held to the bound.
        let r = &mut lagging.recoveries[0];
        r.victims.push((2, Kill::Worker));
        r.copies_lost.push(1);
        r.lag.push((2, 3));
        assert!(invariants(&lagging).is_empty());
        lagging.recoveries[0].lag[1].1 = limits.max_recompute;
        assert_eq!(invariants(&lagging), ["bounded recompute"]);

        let mut reused = reference.clone();
        reused.recoveries.extend([recovery(1, 300), recovery(1, 300)]);
        assert_eq!(invariants(&reused), ["fenced epochs"], "two recoveries in epoch 1");
        reused.recoveries[1].epoch = 2;
        assert!(invariants(&reused).is_empty());

        let mut slow = reference.clone();
        slow.recoveries.push(recovery(1, limits.max_detection_ms + 1));
        assert_eq!(invariants(&slow), ["bounded recovery"]);

        // A recovery whose recorded steps a fresh machine does not take from its inputs.
        let mut diverged = reference.clone();
        let mut r = recovery(1, 300);
        let config = RecoveryConfig { depth: 4, last_epoch: 0, attempts: 3 };
        let mut machine = Recovery::new(config.clone(), &[(1, Loss::Worker)]).unwrap();
        let fenced = Input::Completed(Answer::Fenced(1));
        let first = machine.step().clone();
        machine.apply(&fenced).unwrap();
        r.transcript = Transcript {
            config: Some(config),
            victims: vec![(1, Loss::Worker)],
            steps: vec![first, machine.step().clone()],
            inputs: vec![fenced],
        };
        diverged.recoveries.push(r);
        assert!(invariants(&diverged).is_empty(), "the true transcript replays");
        diverged.recoveries[0].transcript.victims = vec![(1, Loss::Engine)];
        assert_eq!(invariants(&diverged), ["recoveries replay"]);

        let mut cut = run(&[&[1, 2], &[4, 5]]);
        let failed = check(&reference, &cut, Some("stuck"), &limits);
        assert_eq!(failed.iter().map(|v| v.invariant).collect::<Vec<_>>(), ["run completes"]);
        assert_eq!(failed[0].step, Some(4), "after the last step it recorded");
        cut.tokens[1][1] = 7;
        let failed = check(&reference, &cut, Some("stuck"), &limits);
        assert_eq!(failed[1].invariant, "bit-identical output", "what it delivered is still checked");
    }
}
