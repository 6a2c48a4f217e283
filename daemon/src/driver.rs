//! The driver's loop: runs a workload of requests through a [`Cluster`] (every prompt, then one
//! token per request per round), lets an [`Injector`] act on the cluster before each step, and
//! carries out the recoveries the controller starts: it waits for the controller to name the
//! stages it fenced when a step fails, and asks it between steps too (a fence can come while no
//! step waits on the fenced worker). A fenced stage is either
//! recovered (DéjàVu: replaced, its KV restored, the steps its copy lacked recomputed) or the
//! whole pipeline restarts from the first token. Every token delivered and every recovery is
//! recorded, so callers (the demo, the chaos harness) can check and report them.

use std::time::{Duration, Instant};

use thiserror::Error;

use crate::cluster::{
    Cluster, ClusterError, ControllerLife, Kill, NoHooks, Recovered, RecoveryHooks, Sequence,
};
use crate::process::{ProcessError, StepReply};
use dejavu_engine::Seat;
use dejavu_proto::recovery::Transcript;
use dejavu_proto::rng::SplitMix64;

/// Requests and how many tokens each generates.
#[derive(Clone, Debug)]
pub struct Workload {
    /// One prompt per request.
    pub prompts: Vec<Vec<u32>>,
    /// Tokens generated per request (at least 1).
    pub new_tokens: u32,
    /// Sequences per microbatch.
    pub slots: u32,
    /// Places the requests take turns in, each a slot of a microbatch: request `r` sits in seat
    /// `s = r % seats` (microbatch `s / slots`, slot `s % slots`), once the request before it in
    /// that seat (`r - seats`) has finished. As many as the requests: each has a seat of its own.
    pub seats: u32,
}

impl Workload {
    /// Deterministic prompts of `prompt_tokens` tokens from a vocabulary of `vocab`, `slots` per
    /// microbatch (fewer when there are fewer requests).
    pub fn synthetic(requests: u32, prompt_tokens: u32, new_tokens: u32, slots: u32, vocab: u32) -> Self {
        let prompts = (0..requests)
            .map(|r| (0..prompt_tokens).map(|t| (r * 7919 + t * 104_729 + 13) % vocab).collect())
            .collect();
        Self { prompts, new_tokens, slots: slots.min(requests).max(1), seats: requests.max(1) }
    }

    /// The same requests with prompts of lengths drawn from `seed` between their length now and
    /// `longest` tokens: a prompt is cut, or goes on with more tokens of the same kind.
    pub fn with_prompt_lengths_up_to(mut self, longest: u32, seed: u64, vocab: u32) -> Self {
        let mut rng = SplitMix64::new(seed);
        for (r, prompt) in self.prompts.iter_mut().enumerate() {
            let shortest = prompt.len() as u32;
            let len = shortest + rng.below(u64::from(longest.saturating_sub(shortest)) + 1) as u32;
            *prompt = (0..len).map(|t| (r as u32 * 7919 + t * 104_729 + 13) % vocab).collect();
        }
        self
    }

    /// The same requests taking turns in `seats` seats (at most one each), so that later requests
    /// reuse the slots of earlier ones, as a server's do.
    pub fn in_seats(mut self, seats: u32) -> Self {
        self.seats = seats.clamp(1, self.prompts.len().max(1) as u32);
        self.slots = self.slots.min(self.seats);
        self
    }

    /// Where request `request` lives.
    pub fn seat(&self, request: usize) -> Seat {
        let (slots, seat) = (self.slots as usize, request % self.seats as usize);
        Seat { microbatch: (seat / slots) as u32, slot: (seat % slots) as u32 }
    }

    /// Whether request `request` has its seat: the one before it there has finished (`generated`:
    /// the tokens of every request so far).
    pub fn seated(&self, request: usize, generated: &[Vec<u32>]) -> bool {
        let seats = self.seats as usize;
        request < seats || generated[request - seats].len() == self.new_tokens as usize
    }

    /// The requests whose KV the cluster holds now: in each seat, the last one seated.
    pub fn occupants(&self, generated: &[Vec<u32>]) -> impl Iterator<Item = usize> + '_ {
        let seats = self.seats as usize;
        let seated: Vec<bool> = (0..self.prompts.len()).map(|r| self.seated(r, generated)).collect();
        (0..self.prompts.len())
            .filter(move |&r| seated[r] && !seated.get(r + seats).copied().unwrap_or(false))
    }

    /// Microbatches the seats fill.
    pub fn microbatches(&self) -> u32 {
        self.seats.min(self.prompts.len() as u32).div_ceil(self.slots)
    }

    /// Steps of a failure-free run (one per generated token).
    pub fn steps(&self) -> u64 {
        self.prompts.len() as u64 * self.new_tokens as u64
    }

    /// Tokens a sequence of this workload holds at most.
    pub fn max_tokens(&self) -> u32 {
        self.prompts.iter().map(|p| p.len() as u32).max().unwrap_or(0) + self.new_tokens + 1
    }
}

/// What happens when a stage dies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnFailure {
    /// Replace the dead stage and restore its KV (DéjàVu).
    Recover,
    /// Start everything again from the first token.
    Restart,
}

/// How the driver reacts to failed steps.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// Recover or restart.
    pub on_failure: OnFailure,
    /// How long to wait for the controller to name a dead stage after a step failed.
    pub detect_patience: Duration,
    /// How often to ask the controller, between steps, whether it fenced a stage.
    pub watch_every: Duration,
    /// Failed attempts at one step with no stage dead before the driver gives up (a slow or
    /// partitioned link: the step is sent again each time; re-running a step rewrites the same KV).
    pub retries: u32,
}

/// Acts on the cluster before a step: kills, pauses, network faults. `step` counts the steps the
/// driver sends, from 0, repeated ones included (the steps a recovery recomputes are not counted).
pub trait Injector {
    /// Called before step `step`.
    fn before_step(&mut self, step: u64, cluster: &mut Cluster) -> Result<(), ClusterError>;

    /// What to call at the points of the next recovery (none by default).
    fn recovery_hooks(&mut self) -> Option<&mut dyn RecoveryHooks> {
        None
    }

    /// The stages it killed during recoveries since last asked, in order.
    fn killed_in_recovery(&mut self) -> Vec<(usize, Kill)> {
        Vec::new()
    }
}

impl<F: FnMut(u64, &mut Cluster) -> Result<(), ClusterError>> Injector for F {
    fn before_step(&mut self, step: u64, cluster: &mut Cluster) -> Result<(), ClusterError> {
        self(step, cluster)
    }
}

/// No faults.
pub fn no_faults(_: u64, _: &mut Cluster) -> Result<(), ClusterError> {
    Ok(())
}

/// One token handed to a client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Delivery {
    /// The request.
    pub request: u32,
    /// Its position among the request's generated tokens.
    pub index: u32,
    /// The token.
    pub token: u32,
    /// The step that produced it.
    pub step: u64,
    /// The sequence the last stage says the step ran for.
    pub seat: Seat,
    /// Tokens of the sequence with KV after the step, as the last stage reports it: one more
    /// with each token of a request, if each position is computed and delivered once.
    pub kv_end: u32,
}

/// One recovery (or, with [`OnFailure::Restart`], one restart).
#[derive(Clone, Debug)]
pub struct RecoveryRecord {
    /// The stages that died, and what of each.
    pub victims: Vec<(usize, Kill)>,
    /// The epoch the controller opened for the recovery (0 for a restart).
    pub epoch: u64,
    /// Stages whose copies died with them (adjacent workers): recomputed from the prompts.
    pub copies_lost: Vec<usize>,
    /// Each victim and the steps its copies lacked (its replication lag), summed over sequences.
    pub lag: Vec<(usize, u64)>,
    /// The step that failed (or, for a recovery found between steps, the next step).
    pub step: u64,
    /// From first sending the step that failed (it may have been sent again before a stage was
    /// found dead) to the controller naming the dead stages; zero when the driver found the
    /// controller's fence between steps (no step waited for it).
    pub detection: Duration,
    /// Replacing the processes, repairing the chain, restoring KV and recomputing what the copies
    /// lacked.
    pub restore: Duration,
    /// Running the interrupted step again (zero when none was interrupted).
    pub resume: Duration,
    /// Steps computed twice: the ones the copies lacked, plus the interrupted one.
    pub recomputed: u64,
    /// Whether a failed step started it (else the driver found the fence between steps).
    pub interrupted: bool,
    /// Attempts it took: more than one when a fault hit a recovery attempt (another stage died
    /// meanwhile, say), whose victims the next attempt recovered too.
    pub attempts: u32,
    /// The stages killed during it on request ([`Injector::killed_in_recovery`]): among its
    /// victims, recovered by a later attempt.
    pub killed_during: Vec<(usize, Kill)>,
    /// The recovery machine's transcript ([`dejavu_proto::recovery::Transcript`]; empty for a
    /// restart), which the chaos harness replays through a fresh machine.
    pub transcript: Transcript,
}

/// What a run did.
#[derive(Clone, Debug, Default)]
pub struct Run {
    /// The tokens of each request.
    pub tokens: Vec<Vec<u32>>,
    /// Every token delivered, in order (after a restart, the tokens are delivered again).
    pub deliveries: Vec<Delivery>,
    /// Every recovery or restart.
    pub recoveries: Vec<RecoveryRecord>,
    /// From sending to the reply, each decode step that succeeded at its first attempt (prompts,
    /// and steps sent again or resumed after a failure, are left out): the decode-step times,
    /// each with its step number (as [`Injector::before_step`] counts them).
    pub decode_steps: Vec<(u64, Duration)>,
    /// Attempts at a step that failed with no stage dead (slow or broken links).
    pub repeated_steps: u64,
    /// Controllers started to replace one that died or stopped answering (counted when a
    /// cluster finishes or is restarted, not in a run that stopped early).
    pub controller_restarts: u64,
    /// Heartbeats from fenced processes that the last controller of each cluster ignored
    /// (counted as `controller_restarts` is).
    pub stale_heartbeats: u64,
    /// Prompts a prompt pipeline failed to hand over, computed by the token pipeline instead
    /// (counted as `controller_restarts` is).
    pub prompt_fallbacks: u64,
    /// Spare processes recoveries made stages' processes of (counted as `controller_restarts`
    /// is).
    pub spares_used: u64,
    /// Every controller process of each cluster, and how it ended (gathered as
    /// `controller_restarts` is).
    pub controllers: Vec<ControllerLife>,
    /// Starting the first cluster (its processes, until every one has beaten).
    pub startup: Duration,
    /// Wall time serving, from the first cluster being up to the last token (a restart's start of
    /// a new cluster included).
    pub elapsed: Duration,
}

/// Why a run stopped.
#[derive(Debug, Error)]
pub enum DriveError {
    /// The cluster could not start or recover.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// The pipeline failed in a way recovery does not cover.
    #[error(transparent)]
    Pipeline(#[from] ProcessError),
    /// Steps kept failing but no stage had died.
    #[error("{0}")]
    Stuck(String),
}

/// A run that stopped early: why, and what it had done until then.
#[derive(Debug, Error)]
#[error("{error}")]
pub struct Failed {
    /// Why it stopped.
    pub error: DriveError,
    /// Its history until then.
    pub run: Box<Run>,
}

/// Runs `workload` on clusters made by `start` (a new one after each restart).
pub fn drive(
    workload: &Workload,
    config: &DriverConfig,
    start: &mut dyn FnMut() -> Result<Cluster, ClusterError>,
    injector: &mut dyn Injector,
) -> Result<Run, Failed> {
    let started = Instant::now();
    let mut run = Run { tokens: vec![Vec::new(); workload.prompts.len()], ..Run::default() };
    let result = drive_into(&mut run, workload, config, start, injector);
    // Served until the last token: the cluster's teardown after it (its spares still starting,
    // its processes stopped) is not serving time.
    run.elapsed = started.elapsed().saturating_sub(run.startup);
    match result {
        Ok(cluster) => {
            drop(cluster);
            Ok(run)
        }
        Err(error) => Err(Failed { error, run: Box::new(run) }),
    }
}

fn drive_into(
    run: &mut Run,
    workload: &Workload,
    config: &DriverConfig,
    start: &mut dyn FnMut() -> Result<Cluster, ClusterError>,
    injector: &mut dyn Injector,
) -> Result<Cluster, DriveError> {
    let starting = Instant::now();
    let mut cluster = start()?;
    run.startup = starting.elapsed();
    let (mut step, mut failures) = (0u64, 0u32);
    // When the step now failing was first sent: detection is timed from there, across attempts.
    let mut failing_since: Option<Instant> = None;
    let mut watched = Instant::now();
    'rounds: loop {
        for request in 0..workload.prompts.len() {
            if run.tokens[request].len() == workload.new_tokens as usize
                || !workload.seated(request, &run.tokens)
            {
                continue;
            }
            if watched.elapsed() >= config.watch_every {
                watched = Instant::now();
                let victims = cluster.fenced()?;
                if !victims.is_empty() {
                    let record = RecoveryRecord::new(victims, step, Duration::ZERO, false);
                    match config.on_failure {
                        OnFailure::Recover => {
                            recover_now(&mut cluster, workload, run, record, None, injector)?
                        }
                        OnFailure::Restart => {
                            cluster = restart(cluster, start, run, record)?;
                            continue 'rounds;
                        }
                    }
                }
            }
            injector.before_step(step, &mut cluster)?;
            let sent = Instant::now();
            let result = next_token(&mut cluster, workload, &run.tokens, request);
            step += 1;
            let error = match result {
                Ok(reply) => {
                    if !run.tokens[request].is_empty() && failing_since.is_none() {
                        run.decode_steps.push((step - 1, sent.elapsed()));
                    }
                    run.deliver(request, reply, step - 1);
                    (failures, failing_since) = (0, None);
                    continue;
                }
                Err(e) => e,
            };
            let first_sent = *failing_since.get_or_insert(sent);
            let victims = cluster.detect(config.detect_patience)?;
            if victims.is_empty() {
                run.repeated_steps += 1;
                failures += 1;
                if failures > config.retries {
                    return Err(DriveError::Stuck(format!(
                        "{failures} attempts at a step failed with no stage dead: {error}"
                    )));
                }
                // The next round sends this request's step again.
                continue;
            }
            let record = RecoveryRecord::new(victims, step - 1, first_sent.elapsed(), true);
            (failures, failing_since) = (0, None);
            match config.on_failure {
                OnFailure::Recover => {
                    recover_now(&mut cluster, workload, run, record, Some(request), injector)?;
                    // The interrupted step ran again: the next one is counted after it.
                    step += 1;
                }
                OnFailure::Restart => {
                    cluster = restart(cluster, start, run, record)?;
                    continue 'rounds;
                }
            }
        }
        if run.tokens.iter().all(|t| t.len() == workload.new_tokens as usize) {
            run.count_from(&mut cluster);
            return Ok(cluster);
        }
    }
}

impl RecoveryRecord {
    /// The record of a recovery of `victims` that starts now, the rest filled in as it goes.
    fn new(victims: Vec<(usize, Kill)>, step: u64, detection: Duration, interrupted: bool) -> Self {
        Self {
            victims,
            epoch: 0,
            copies_lost: Vec::new(),
            lag: Vec::new(),
            step,
            detection,
            restore: Duration::ZERO,
            resume: Duration::ZERO,
            recomputed: 0,
            interrupted,
            attempts: 0,
            killed_during: Vec::new(),
            transcript: Transcript::default(),
        }
    }
}

/// Carries out the recovery `record` starts and records it in `run`. With `interrupted`, the
/// request whose step failed runs that step again once recovered.
fn recover_now(
    cluster: &mut Cluster,
    workload: &Workload,
    run: &mut Run,
    mut record: RecoveryRecord,
    interrupted: Option<usize>,
    injector: &mut dyn Injector,
) -> Result<(), DriveError> {
    let detected = Instant::now();
    let recovered = recover(cluster, workload, run, &record.victims, injector)?;
    record.victims = recovered.victims;
    record.attempts = recovered.attempts;
    record.killed_during = injector.killed_in_recovery();
    record.transcript = recovered.transcript;
    record.recomputed = recovered.recomputed;
    record.epoch = recovered.epoch;
    record.copies_lost = recovered.copies_lost;
    record.lag = recovered.lag;
    let restored = Instant::now();
    record.restore = restored - detected;
    let Some(request) = interrupted else {
        run.recoveries.push(record);
        return Ok(());
    };
    // The interrupted step again; if it fails, the next round handles it as any failed step.
    let resumed = next_token(cluster, workload, &run.tokens, request);
    record.recomputed += 1;
    record.resume = restored.elapsed();
    let step = record.step + 1;
    run.recoveries.push(record);
    if let Ok(reply) = resumed {
        run.deliver(request, reply, step);
    }
    Ok(())
}

/// Handles the failure `record` describes by starting everything again: `cluster` goes (its
/// processes and hosts first), a new one is started and every request starts from its first token.
fn restart(
    mut cluster: Cluster,
    start: &mut dyn FnMut() -> Result<Cluster, ClusterError>,
    run: &mut Run,
    mut record: RecoveryRecord,
) -> Result<Cluster, DriveError> {
    let detected = Instant::now();
    record.recomputed = run.tokens.iter().map(|t| t.len() as u64).sum();
    run.count_from(&mut cluster);
    drop(cluster);
    let cluster = start()?;
    run.tokens.iter_mut().for_each(Vec::clear);
    record.restore = detected.elapsed();
    run.recoveries.push(record);
    Ok(cluster)
}

/// Recovers `victims` on `cluster` ([`Cluster::recover_all`] tries again when a fault hits the
/// recovery itself, with any stage found dead meanwhile added to the victims), with `injector`'s
/// hooks at its points.
fn recover(
    cluster: &mut Cluster,
    workload: &Workload,
    run: &Run,
    victims: &[(usize, Kill)],
    injector: &mut dyn Injector,
) -> Result<Recovered, DriveError> {
    let sequences: Vec<Sequence<'_>> = workload
        .occupants(&run.tokens)
        .map(|i| Sequence { seat: workload.seat(i), prompt: &workload.prompts[i], generated: &run.tokens[i] })
        .collect();
    let mut none = NoHooks;
    let hooks = injector.recovery_hooks().unwrap_or(&mut none);
    Ok(cluster.recover_with(hooks, victims, &sequences)?)
}

/// Runs request `request`'s next step: its prompt, or its last token.
fn next_token(
    cluster: &mut Cluster,
    workload: &Workload,
    tokens: &[Vec<u32>],
    request: usize,
) -> Result<StepReply, ProcessError> {
    let seat = workload.seat(request);
    let prompt = &workload.prompts[request];
    match tokens[request].last() {
        None => cluster.prefill(seat, prompt),
        Some(&token) => {
            cluster.remote.step(seat, &[token], (prompt.len() + tokens[request].len()) as u32 - 1)
        }
    }
}

impl Run {
    /// The median decode-step time ([`Run::decode_steps`]); `None` without decode steps. Bursts
    /// of a shared machine's load move it far less than a run's total time.
    pub fn median_decode_step(&self) -> Option<Duration> {
        self.median_decode_step_where(|_| true)
    }

    /// The median time of the decode steps whose step numbers `selected` picks; `None` if none.
    pub fn median_decode_step_where(&self, selected: impl Fn(u64) -> bool) -> Option<Duration> {
        let mut steps: Vec<Duration> =
            self.decode_steps.iter().filter(|&&(step, _)| selected(step)).map(|&(_, took)| took).collect();
        steps.sort_unstable();
        steps.get(steps.len() / 2).copied()
    }

    /// Adds what `cluster`, about to go, counted.
    fn count_from(&mut self, cluster: &mut Cluster) {
        self.controllers.extend(cluster.controller_lives());
        self.controller_restarts += cluster.controller_restarts();
        self.stale_heartbeats += cluster.stale_heartbeats();
        self.prompt_fallbacks += cluster.prompt_fallbacks();
        self.spares_used += cluster.spares_used();
    }

    fn deliver(&mut self, request: usize, reply: StepReply, step: u64) {
        let index = self.tokens[request].len() as u32;
        self.tokens[request].push(reply.token);
        self.deliveries.push(Delivery {
            request: request as u32,
            index,
            token: reply.token,
            step,
            seat: reply.seat,
            kv_end: reply.kv_end,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_decode_step_ignores_bursts() {
        let ms = Duration::from_millis;
        let mut run = Run::default();
        assert_eq!(run.median_decode_step(), None);
        run.decode_steps = [ms(2), ms(90), ms(1), ms(3), ms(2)]
            .into_iter()
            .enumerate()
            .map(|(i, t)| (i as u64, t))
            .collect();
        assert_eq!(run.median_decode_step(), Some(ms(2)));
        // Steps 0, 2 and 4 (2, 1 and 2 ms); steps 1 and 3 (90 and 3 ms: the upper median).
        assert_eq!(run.median_decode_step_where(|step| step % 2 == 0), Some(ms(2)));
        assert_eq!(run.median_decode_step_where(|step| step % 2 == 1), Some(ms(90)));
        assert_eq!(run.median_decode_step_where(|step| step > 10), None);
    }

    #[test]
    fn requests_taking_turns_wait_for_their_seat() {
        let workload = Workload::synthetic(6, 4, 2, 4, 512).in_seats(2);
        assert_eq!((workload.slots, workload.microbatches()), (2, 1));
        assert_eq!(workload.seat(4), Seat { microbatch: 0, slot: 0 });
        assert_eq!(workload.seat(3), Seat { microbatch: 0, slot: 1 });
        let mut generated = vec![Vec::new(); 6];
        assert_eq!((0..6).filter(|&r| workload.seated(r, &generated)).collect::<Vec<_>>(), [0, 1]);
        generated[0] = vec![7, 8];
        assert_eq!((0..6).filter(|&r| workload.seated(r, &generated)).collect::<Vec<_>>(), [0, 1, 2]);
        // The cluster holds request 2's KV in seat 0 now, and still request 1's in seat 1.
        assert_eq!(workload.occupants(&generated).collect::<Vec<_>>(), [1, 2]);
    }

    #[test]
    fn prompt_lengths_are_drawn_from_the_seed_within_their_bounds() {
        let drawn = |seed| Workload::synthetic(64, 8, 2, 4, 512).with_prompt_lengths_up_to(40, seed, 512);
        let lengths: Vec<usize> = drawn(1).prompts.iter().map(Vec::len).collect();
        assert!(lengths.iter().all(|l| (8..=40).contains(l)));
        assert!(lengths.iter().any(|&l| l != lengths[0]), "lengths vary: {lengths:?}");
        assert_eq!(drawn(1).prompts, drawn(1).prompts);
        assert_ne!(drawn(1).prompts, drawn(2).prompts);
        // A longer prompt starts as the shorter one did.
        let base = Workload::synthetic(64, 8, 2, 4, 512);
        assert!(drawn(1).prompts.iter().zip(&base.prompts).all(|(long, short)| long.starts_with(short)));
    }
}
