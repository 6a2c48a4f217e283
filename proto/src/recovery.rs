//! The recovery of a ring's failed stages as a state machine: which step comes next, in which
//! epoch, and what a failure in the middle of it does.
//!
//! Whoever carries a recovery out step by step (a cluster supervisor driving its pipeline:
//! `dejavud`'s `Recoveries::Driven`, which the demo and the chaos harness can choose) asks
//! [`Recovery::step`] what to do, does it, and reports the result with [`Recovery::complete`], or
//! with [`Recovery::fail`] when it could not (naming the stages found dead meanwhile). The
//! machine decides everything else:
//!
//! 1. [`Step::Fence`]: the victims' processes are fenced in a new epoch, durably, at least the
//!    one after the last attempt's (a failed attempt's replacements may have started in that one);
//! 2. [`Step::Retire`]: the processes presumed dead are stopped, when they can be;
//! 3. [`Step::Start`]: replacement sidecars start (for the workers lost), then replacement engines,
//!    the last stage first, so that each knows where to send;
//! 4. [`Step::Repair`]: the chain is repaired around the replacements;
//! 5. [`Step::CarryOut`]: the controller plans the ring from what it fenced in the epoch, re-seeds
//!    each replaced sidecar from a surviving predecessor, and finds each sequence's resume marks.
//!    Its plan must be the machine's own ([`plan::ring`] over the victims);
//! 6. [`Step::Restore`]: each replacement restores its sequences up to their marks and recomputes
//!    the rest;
//! 7. [`Step::ReseedRestored`]: a replaced sidecar whose predecessor was replaced too is re-seeded,
//!    now that the predecessor holds its KV again (only when the plan needs it);
//! 8. [`Step::Done`].
//!
//! A failure at any step starts a new attempt from step 1 with every stage found dead added to the
//! victims (an engine whose sidecar died since counts as its whole worker), until
//! [`RecoveryConfig::attempts`] have failed: then [`Step::GiveUp`].

use std::collections::BTreeMap;

use crate::liveness::{Member, Role};
use crate::plan::{self, Loss, Reseed, Source, StagePlan};

/// Attempts before a recovery gives up, by default.
pub const DEFAULT_ATTEMPTS: u32 = 3;

/// What a recovery is asked to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecoveryConfig {
    /// Stages in the ring.
    pub depth: u32,
    /// The epoch of the last recovery (0 if none): the first fence must be newer.
    pub last_epoch: u64,
    /// Attempts before giving up ([`DEFAULT_ATTEMPTS`]).
    pub attempts: u32,
}

/// The next thing to carry out. Each step is reported done with the [`Answer`] of the same name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Fence `members` (durably) in an epoch not older than `lowest`; answer [`Answer::Fenced`].
    Fence {
        /// The victims' processes: every victim's engine, and the sidecar of each whole worker.
        members: Vec<Member>,
        /// The oldest epoch the fence may have.
        lowest: u64,
    },
    /// Stop the processes presumed dead (the epoch keeps them out if they cannot be stopped);
    /// answer [`Answer::Retired`].
    Retire {
        /// The victims and what of each to stop.
        victims: Vec<(u32, Loss)>,
    },
    /// Start the replacement of `member` in `epoch` and wait until it is alive; answer
    /// [`Answer::Started`].
    Start {
        /// The member replaced.
        member: Member,
        /// The epoch it starts in.
        epoch: u64,
    },
    /// Connect the chain to the replaced engines (each predecessor sends to its replacement);
    /// answer [`Answer::Repaired`].
    Repair {
        /// The replaced stages.
        stages: Vec<u32>,
    },
    /// Have the controller carry out its part of the recovery of `epoch`; answer
    /// [`Answer::CarriedOut`] with the plan it followed.
    CarryOut {
        /// The recovery's epoch.
        epoch: u64,
    },
    /// Restore every sequence on the replaced stages as `plans` say; answer [`Answer::Restored`].
    Restore {
        /// The recovery's epoch.
        epoch: u64,
        /// Where each replaced stage restores from.
        plans: Vec<StagePlan>,
    },
    /// Re-seed the replaced sidecars whose predecessors were replaced too; answer
    /// [`Answer::Reseeded`].
    ReseedRestored {
        /// The recovery's epoch.
        epoch: u64,
    },
    /// The recovery is over.
    Done(Outcome),
    /// Every attempt failed: the pipeline cannot be recovered in place.
    GiveUp {
        /// Attempts made.
        attempts: u32,
        /// The victims of the last one.
        victims: Vec<(u32, Loss)>,
    },
}

/// The result of the step asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// The victims are fenced in this epoch.
    Fenced(u64),
    /// The presumed dead were stopped (or left running, fenced).
    Retired,
    /// The replacement of this member is alive.
    Started(Member),
    /// The chain reaches the replacements.
    Repaired,
    /// The controller carried out its part following these plans.
    CarriedOut(Vec<StagePlan>),
    /// Every sequence was restored.
    Restored,
    /// The replaced sidecars were re-seeded.
    Reseeded,
}

/// What the shell reports of a step: its answer, or that it failed with these stages found dead.
/// A recovery's inputs in order are its transcript: fed to a fresh machine with the same config
/// and victims, they give the same steps ([`Recovery::apply`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// [`Recovery::complete`] with this answer.
    Completed(Answer),
    /// [`Recovery::fail`] with these stages found dead.
    Failed(Vec<(u32, Loss)>),
}

/// A recovery as it was carried out: what it was asked, each step it took, and each input it got
/// (one input fewer than steps: the last step is how it ended).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Transcript {
    /// Its config.
    pub config: Option<RecoveryConfig>,
    /// The victims it was asked to recover.
    pub victims: Vec<(u32, Loss)>,
    /// The steps, in order.
    pub steps: Vec<Step>,
    /// The inputs, in order: the `i`th answered the `i`th step.
    pub inputs: Vec<Input>,
}

impl Transcript {
    /// Feeds the inputs to a fresh machine and checks that it takes the same steps; returns the
    /// steps compared, or the first that differs (its index, the recorded step and the new one).
    pub fn replay(&self) -> Result<usize, (usize, Option<Step>, Option<Step>)> {
        let Some(config) = self.config.clone() else { return Ok(0) };
        let mut machine =
            Recovery::new(config, &self.victims).map_err(|_| (0, self.steps.first().cloned(), None))?;
        for (i, recorded) in self.steps.iter().enumerate() {
            if machine.step() != recorded {
                return Err((i, Some(recorded.clone()), Some(machine.step().clone())));
            }
            if let Some(input) = self.inputs.get(i) {
                machine.apply(input).map_err(|_| (i, Some(recorded.clone()), None))?;
            }
        }
        if self.inputs.len() + 1 != self.steps.len() {
            return Err((self.steps.len(), None, Some(machine.step().clone())));
        }
        Ok(self.steps.len())
    }
}

/// How a recovery ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The epoch of the attempt that succeeded.
    pub epoch: u64,
    /// Its plan, one entry per victim in stage order.
    pub plans: Vec<StagePlan>,
    /// Attempts it took.
    pub attempts: u32,
}

impl Outcome {
    /// The stages whose copies were all lost (their successors' workers died too): their sequences
    /// were recomputed from their prompts.
    pub fn copies_lost(&self) -> Vec<u32> {
        self.plans.iter().filter(|p| p.source == Source::Lost).map(|p| p.stage).collect()
    }
}

/// Why an answer or a victim was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecoveryError {
    /// A stage outside the ring.
    NoSuchStage(u32),
    /// A recovery of nothing.
    NoVictims,
    /// The answer is not the one the current step asks for.
    Unexpected {
        /// The step in progress.
        step: Box<Step>,
        /// The answer given.
        answer: Answer,
    },
    /// The fence came back older than the attempt needs.
    StaleFence {
        /// The epoch given.
        epoch: u64,
        /// The oldest acceptable.
        lowest: u64,
    },
}

impl std::fmt::Display for RecoveryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoSuchStage(stage) => write!(f, "stage {stage} is not in the ring"),
            Self::NoVictims => write!(f, "a recovery needs at least one failed stage"),
            Self::Unexpected { step, answer } => write!(f, "answer {answer:?} to step {step:?}"),
            Self::StaleFence { epoch, lowest } => {
                write!(f, "fenced in epoch {epoch}, older than the attempt's lowest {lowest}")
            }
        }
    }
}

impl std::error::Error for RecoveryError {}

/// One recovery in progress.
#[derive(Clone, Debug)]
pub struct Recovery {
    config: RecoveryConfig,
    victims: BTreeMap<u32, Loss>,
    attempt: u32,
    /// The oldest epoch the current attempt's fence may have.
    lowest: u64,
    step: Step,
    /// The members still to start in the current attempt, in order.
    to_start: Vec<Member>,
}

impl Recovery {
    /// A recovery of `victims` (stage and what of it was lost; a stage named twice counts as its
    /// larger loss).
    pub fn new(config: RecoveryConfig, victims: &[(u32, Loss)]) -> Result<Self, RecoveryError> {
        if victims.is_empty() {
            return Err(RecoveryError::NoVictims);
        }
        if let Some(&(stage, _)) = victims.iter().find(|&&(stage, _)| stage >= config.depth) {
            return Err(RecoveryError::NoSuchStage(stage));
        }
        let lowest = config.last_epoch + 1;
        let mut recovery = Self {
            config,
            victims: BTreeMap::new(),
            attempt: 0,
            lowest,
            step: Step::Retire { victims: Vec::new() },
            to_start: Vec::new(),
        };
        recovery.add_victims(victims);
        recovery.begin_attempt();
        Ok(recovery)
    }

    /// What to carry out now.
    pub fn step(&self) -> &Step {
        &self.step
    }

    /// The current attempt (1 for the first).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The stages being recovered and what of each was lost, in stage order.
    pub fn victims(&self) -> Vec<(u32, Loss)> {
        self.victims.iter().map(|(&stage, &loss)| (stage, loss)).collect()
    }

    /// The current attempt's epoch, once fenced.
    pub fn epoch(&self) -> Option<u64> {
        match &self.step {
            Step::Fence { .. } | Step::GiveUp { .. } => None,
            Step::Done(outcome) => Some(outcome.epoch),
            _ => Some(self.lowest),
        }
    }

    /// Reports the current step done. A controller whose plan is not the machine's (it fenced
    /// other stages in the epoch: one died meanwhile) fails the attempt, with its victims added.
    pub fn complete(&mut self, answer: Answer) -> Result<(), RecoveryError> {
        let unexpected =
            |step: &Step, answer: Answer| RecoveryError::Unexpected { step: Box::new(step.clone()), answer };
        match (&self.step, answer) {
            (Step::Fence { lowest, .. }, Answer::Fenced(epoch)) => {
                if epoch < *lowest {
                    return Err(RecoveryError::StaleFence { epoch, lowest: *lowest });
                }
                // From now on `lowest` is the attempt's epoch: a retry must fence past it.
                self.lowest = epoch;
                self.step = Step::Retire { victims: self.victims() };
            }
            (Step::Retire { .. }, Answer::Retired) => self.start_next(),
            (Step::Start { member, .. }, Answer::Started(started)) if *member == started => {
                self.to_start.remove(0);
                self.start_next();
            }
            (Step::Repair { .. }, Answer::Repaired) => self.step = Step::CarryOut { epoch: self.lowest },
            (Step::CarryOut { .. }, Answer::CarriedOut(planned)) => {
                let plans = self.plans();
                if planned != plans {
                    let losses: Vec<(u32, Loss)> = planned.iter().map(|p| (p.stage, p.loss)).collect();
                    self.fail(&losses);
                } else {
                    self.step = Step::Restore { epoch: self.lowest, plans };
                }
            }
            (Step::Restore { plans, .. }, Answer::Restored) => {
                let after_restore = plans.iter().any(|p| matches!(p.reseed, Some((_, Reseed::AfterRestore))));
                self.step =
                    if after_restore { Step::ReseedRestored { epoch: self.lowest } } else { self.done() };
            }
            (Step::ReseedRestored { .. }, Answer::Reseeded) => self.step = self.done(),
            (step, answer) => return Err(unexpected(step, answer)),
        }
        Ok(())
    }

    /// Reports that the current step could not be carried out, and the stages found dead since the
    /// recovery started (a stage already a victim counts as its larger loss). Starts the next
    /// attempt, or gives up after the last. Does nothing once the recovery is over.
    pub fn fail(&mut self, dead: &[(u32, Loss)]) {
        if matches!(self.step, Step::Done(_) | Step::GiveUp { .. }) {
            return;
        }
        let in_ring: Vec<(u32, Loss)> =
            dead.iter().copied().filter(|&(stage, _)| stage < self.config.depth).collect();
        self.add_victims(&in_ring);
        if self.attempt >= self.config.attempts {
            self.step = Step::GiveUp { attempts: self.attempt, victims: self.victims() };
            return;
        }
        // A fenced attempt's epoch is taken: the next fence must be newer.
        if !matches!(self.step, Step::Fence { .. }) {
            self.lowest += 1;
        }
        self.begin_attempt();
    }

    /// Takes one input, as [`Recovery::complete`] or [`Recovery::fail`].
    pub fn apply(&mut self, input: &Input) -> Result<(), RecoveryError> {
        match input {
            Input::Completed(answer) => self.complete(answer.clone()),
            Input::Failed(dead) => {
                self.fail(dead);
                Ok(())
            }
        }
    }

    fn add_victims(&mut self, victims: &[(u32, Loss)]) {
        for &(stage, loss) in victims {
            let held = self.victims.entry(stage).or_insert(loss);
            *held = (*held).max(loss);
        }
    }

    fn begin_attempt(&mut self) {
        self.attempt += 1;
        let mut members = Vec::new();
        for (&stage, &loss) in &self.victims {
            members.push((Role::Engine, stage));
            if loss == Loss::Worker {
                members.push((Role::Sidecar, stage));
            }
        }
        self.step = Step::Fence { members, lowest: self.lowest };
        // Sidecars first, so that each replacement engine finds its sidecar; then the engines from
        // the last stage, so that each knows where to send.
        let sidecars =
            self.victims.iter().filter(|&(_, &loss)| loss == Loss::Worker).map(|(&s, _)| (Role::Sidecar, s));
        let engines = self.victims.keys().rev().map(|&s| (Role::Engine, s));
        self.to_start = sidecars.chain(engines).collect();
    }

    fn start_next(&mut self) {
        self.step = match self.to_start.first() {
            Some(&member) => Step::Start { member, epoch: self.lowest },
            None => Step::Repair { stages: self.victims.keys().copied().collect() },
        };
    }

    fn plans(&self) -> Vec<StagePlan> {
        plan::ring(self.config.depth, &self.victims())
    }

    fn done(&self) -> Step {
        Step::Done(Outcome { epoch: self.lowest, plans: self.plans(), attempts: self.attempt })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(depth: u32) -> RecoveryConfig {
        RecoveryConfig { depth, last_epoch: 4, attempts: DEFAULT_ATTEMPTS }
    }

    /// Answers every step as a healthy cluster would, until the recovery ends; returns the steps.
    fn run_clean(recovery: &mut Recovery, epoch: u64) -> Vec<Step> {
        let mut steps = Vec::new();
        loop {
            let step = recovery.step().clone();
            steps.push(step.clone());
            let answer = match step {
                Step::Fence { .. } => Answer::Fenced(epoch),
                Step::Retire { .. } => Answer::Retired,
                Step::Start { member, .. } => Answer::Started(member),
                Step::Repair { .. } => Answer::Repaired,
                Step::CarryOut { .. } => Answer::CarriedOut(recovery.plans()),
                Step::Restore { .. } => Answer::Restored,
                Step::ReseedRestored { .. } => Answer::Reseeded,
                Step::Done(_) | Step::GiveUp { .. } => return steps,
            };
            recovery.complete(answer).unwrap();
        }
    }

    #[test]
    fn a_lost_engine_is_fenced_replaced_and_restored_from_its_own_sidecar() {
        let mut recovery = Recovery::new(config(4), &[(2, Loss::Engine)]).unwrap();
        let steps = run_clean(&mut recovery, 5);
        assert_eq!(steps[0], Step::Fence { members: vec![(Role::Engine, 2)], lowest: 5 });
        assert_eq!(steps[2], Step::Start { member: (Role::Engine, 2), epoch: 5 });
        assert_eq!(steps[3], Step::Repair { stages: vec![2] });
        let Step::Done(outcome) = steps.last().unwrap() else { panic!("{steps:?}") };
        assert_eq!(outcome.epoch, 5);
        assert_eq!(outcome.plans[0].source, Source::Own);
        assert!(!steps.iter().any(|s| matches!(s, Step::ReseedRestored { .. })));
    }

    #[test]
    fn sidecars_start_first_then_engines_from_the_last_stage() {
        let mut recovery = Recovery::new(config(4), &[(1, Loss::Worker), (3, Loss::Engine)]).unwrap();
        let starts: Vec<Member> = run_clean(&mut recovery, 9)
            .into_iter()
            .filter_map(|s| match s {
                Step::Start { member, epoch } => {
                    assert_eq!(epoch, 9);
                    Some(member)
                }
                _ => None,
            })
            .collect();
        assert_eq!(starts, [(Role::Sidecar, 1), (Role::Engine, 3), (Role::Engine, 1)]);
    }

    #[test]
    fn adjacent_workers_reseed_after_the_restore_and_report_the_lost_copy() {
        let mut recovery = Recovery::new(config(4), &[(1, Loss::Worker), (2, Loss::Worker)]).unwrap();
        let steps = run_clean(&mut recovery, 5);
        assert!(steps.contains(&Step::ReseedRestored { epoch: 5 }));
        let Step::Done(outcome) = steps.last().unwrap() else { panic!() };
        assert_eq!(outcome.copies_lost(), [1]);
    }

    #[test]
    fn a_death_during_the_restore_starts_a_newer_attempt_with_the_larger_loss() {
        let mut recovery = Recovery::new(config(4), &[(1, Loss::Engine)]).unwrap();
        for answer in
            [Answer::Fenced(5), Answer::Retired, Answer::Started((Role::Engine, 1)), Answer::Repaired]
        {
            recovery.complete(answer).unwrap();
        }
        recovery.complete(Answer::CarriedOut(recovery.plans())).unwrap();
        assert!(matches!(recovery.step(), Step::Restore { epoch: 5, .. }));
        recovery.fail(&[(1, Loss::Worker), (3, Loss::Engine)]);
        assert_eq!(recovery.attempt(), 2);
        assert_eq!(recovery.victims(), [(1, Loss::Worker), (3, Loss::Engine)]);
        assert_eq!(
            recovery.step(),
            &Step::Fence {
                members: vec![(Role::Engine, 1), (Role::Sidecar, 1), (Role::Engine, 3)],
                lowest: 6
            }
        );
        assert_eq!(
            recovery.complete(Answer::Fenced(5)),
            Err(RecoveryError::StaleFence { epoch: 5, lowest: 6 })
        );
        let Step::Done(outcome) = run_clean(&mut recovery, 6).pop().unwrap() else { panic!() };
        assert_eq!((outcome.epoch, outcome.attempts), (6, 2));
    }

    #[test]
    fn a_failed_fence_is_tried_again_at_the_same_lowest_epoch() {
        let mut recovery = Recovery::new(config(3), &[(0, Loss::Worker)]).unwrap();
        recovery.fail(&[]);
        assert_eq!(
            recovery.step(),
            &Step::Fence { members: vec![(Role::Engine, 0), (Role::Sidecar, 0)], lowest: 5 }
        );
    }

    #[test]
    fn a_controller_that_fenced_more_fails_the_attempt_and_its_stages_join() {
        let mut recovery = Recovery::new(config(4), &[(0, Loss::Engine)]).unwrap();
        for answer in
            [Answer::Fenced(5), Answer::Retired, Answer::Started((Role::Engine, 0)), Answer::Repaired]
        {
            recovery.complete(answer).unwrap();
        }
        let theirs = plan::ring(4, &[(0, Loss::Engine), (2, Loss::Worker)]);
        recovery.complete(Answer::CarriedOut(theirs)).unwrap();
        assert_eq!(recovery.victims(), [(0, Loss::Engine), (2, Loss::Worker)]);
        assert!(matches!(recovery.step(), Step::Fence { lowest: 6, .. }));
    }

    #[test]
    fn the_last_failed_attempt_gives_up() {
        let mut recovery = Recovery::new(config(2), &[(1, Loss::Engine)]).unwrap();
        for _ in 0..DEFAULT_ATTEMPTS {
            recovery.fail(&[]);
        }
        assert_eq!(recovery.step(), &Step::GiveUp { attempts: 3, victims: vec![(1, Loss::Engine)] });
        recovery.fail(&[(0, Loss::Worker)]);
        assert!(matches!(recovery.step(), Step::GiveUp { .. }));
    }

    #[test]
    fn a_transcript_replays_to_the_same_steps() {
        let config = config(4);
        let mut live = Recovery::new(config.clone(), &[(1, Loss::Engine)]).unwrap();
        let inputs = [
            Input::Completed(Answer::Fenced(5)),
            Input::Failed(vec![(1, Loss::Worker)]),
            Input::Completed(Answer::Fenced(6)),
            Input::Completed(Answer::Retired),
        ];
        let mut steps = vec![live.step().clone()];
        for input in &inputs {
            live.apply(input).unwrap();
            steps.push(live.step().clone());
        }
        assert_eq!(steps.last(), Some(&Step::Start { member: (Role::Sidecar, 1), epoch: 6 }));
        let mut transcript = Transcript {
            config: Some(config),
            victims: vec![(1, Loss::Engine)],
            steps,
            inputs: inputs.to_vec(),
        };
        assert_eq!(transcript.replay(), Ok(5));
        transcript.inputs[1] = Input::Failed(vec![]);
        assert!(matches!(transcript.replay(), Err((2, _, _))), "the engine alone is fenced again");
    }

    #[test]
    fn wrong_answers_and_victims_are_refused() {
        assert_eq!(Recovery::new(config(2), &[]).unwrap_err(), RecoveryError::NoVictims);
        assert_eq!(
            Recovery::new(config(2), &[(2, Loss::Engine)]).unwrap_err(),
            RecoveryError::NoSuchStage(2)
        );
        let mut recovery = Recovery::new(config(2), &[(1, Loss::Engine)]).unwrap();
        assert!(matches!(recovery.complete(Answer::Restored), Err(RecoveryError::Unexpected { .. })));
        recovery.complete(Answer::Fenced(5)).unwrap();
        recovery.complete(Answer::Retired).unwrap();
        let wrong = Answer::Started((Role::Sidecar, 1));
        assert!(matches!(recovery.complete(wrong), Err(RecoveryError::Unexpected { .. })));
    }
}
