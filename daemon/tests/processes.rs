//! The reference engine as separate OS processes on loopback: a chain of stage processes produces
//! the same tokens as the in-process pipeline; stages killed mid-decode (engines alone, or with
//! their sidecars) are replaced, restore their KV from a sidecar and continue bit-identically.

use std::path::PathBuf;
use std::time::Duration;

use dejavu_engine::{CacheLayout, ModelConfig, Pipeline, Seat};
use dejavu_proto::plan::Loss;
use dejavu_proto::recovery::Input;
use dejavud::cluster::{
    Cluster, ClusterConfig, ClusterError, Kill, Recoveries, RecoveryHooks, Role, Sequence,
};
use dejavud::metrics::value_of;
use dejavud::process::RemotePipeline;

const SLOTS: u32 = 2;
const MICROBATCHES: u32 = 2;
const MAX_TOKENS: u32 = 64;
const NEW_TOKENS: usize = 10;

fn splits() -> Vec<std::ops::Range<u32>> {
    vec![0..2, 2..4, 4..6, 6..8]
}

/// Faults a test injects into a recovery, each at most once.
#[derive(Default)]
struct InRecovery {
    /// SIGKILL the controller right after the fence.
    crash_controller: bool,
    /// Kill this once the replacements are up, before they restore.
    kill: Option<(usize, Kill)>,
    /// What was killed so.
    killed: Vec<(usize, Kill)>,
    /// Leave the presumed dead running, fenced.
    leave_running: bool,
}

impl RecoveryHooks for InRecovery {
    fn leave_presumed_dead_running(&mut self) -> bool {
        std::mem::take(&mut self.leave_running)
    }

    fn after_fence(&mut self, cluster: &mut Cluster) -> Result<(), ClusterError> {
        if std::mem::take(&mut self.crash_controller) {
            cluster.faults().kill_controller()?;
            cluster.census()?;
        }
        Ok(())
    }

    fn before_restore(&mut self, cluster: &mut Cluster, _: &[(usize, Kill)]) -> Result<(), ClusterError> {
        if let Some((stage, what)) = self.kill.take() {
            self.killed.push((stage, what));
            cluster.faults().kill(stage, what)?;
        }
        Ok(())
    }
}

/// The tests' cluster: four stages of the reference model, replicated.
fn config() -> ClusterConfig {
    ClusterConfig {
        splits: splits(),
        slots: SLOTS,
        microbatches: MICROBATCHES,
        max_tokens: MAX_TOKENS,
        deadline: Duration::from_secs(1),
        ..ClusterConfig::new(PathBuf::from(env!("CARGO_BIN_EXE_dejavud")))
    }
}

fn cluster(replicate: bool) -> Cluster {
    Cluster::start(ClusterConfig { replicate, ..config() }).unwrap()
}

fn prompts() -> Vec<Vec<u32>> {
    vec![vec![3, 141, 59, 26, 5], vec![9, 9], (0..17).map(|i| (i * 53 + 7) % 512).collect()]
}

fn reference() -> Vec<Vec<u32>> {
    Pipeline::new(
        ModelConfig::reference(),
        &splits(),
        CacheLayout::FasterTransformer,
        SLOTS,
        MICROBATCHES,
        MAX_TOKENS,
    )
    .unwrap()
    .generate(&prompts(), NEW_TOKENS)
    .unwrap()
}

fn seat(i: usize) -> Seat {
    Seat { microbatch: i as u32 / SLOTS, slot: i as u32 % SLOTS }
}

/// Extends request `i`'s generated tokens `out` (at least one) to `until` tokens.
fn decode(remote: &mut RemotePipeline, i: usize, mut out: Vec<u32>, until: usize) -> Vec<u32> {
    let prompt_len = prompts()[i].len();
    while out.len() < until {
        // Token n (n >= 1) comes from running token n - 1, at position prompt_len + n - 1.
        let position = (prompt_len + out.len() - 1) as u32;
        let token = remote.run(seat(i), &[*out.last().unwrap()], position).unwrap();
        out.push(token);
    }
    out
}

/// Prefills every request and decodes each to `done` tokens.
/// Waits until stage `stage`'s engine has handed its sidecar a chunk for every step it computed
/// (its copies run behind its steps); returns its metrics page then.
fn copies_landed(chain: &mut Cluster, stage: usize) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let page = chain.metrics(stage, Role::Engine).unwrap();
        let of = |name| value_of(&page, name, &[]).unwrap();
        if of("dejavu_stage_copied_chunks_total") >= of("dejavu_stage_steps_total") {
            return page;
        }
        assert!(std::time::Instant::now() < deadline, "stage {stage}'s copies never landed: {page}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn start_requests(remote: &mut RemotePipeline, done: usize) -> Vec<Vec<u32>> {
    prompts()
        .iter()
        .enumerate()
        .map(|(i, prompt)| {
            let first = remote.run(seat(i), prompt, 0).unwrap();
            decode(remote, i, vec![first], done)
        })
        .collect()
}

/// Kills `victims` together, sees the next step fail, and waits for the controller to name them
/// dead.
fn kill_and_detect(chain: &mut Cluster, so_far: &[Vec<u32>], victims: &[(usize, Kill)]) {
    chain.faults().kill_together(victims).unwrap();
    let position = (prompts()[0].len() + so_far[0].len() - 1) as u32;
    assert!(chain.remote.run(seat(0), &[*so_far[0].last().unwrap()], position).is_err(), "{victims:?}");
    assert_eq!(chain.detect(Duration::from_secs(3)).unwrap(), victims);
}

/// Decodes every request on from `so_far` to the end, and checks that each gives the
/// failure-free tokens (`context` says which run, in the failure message).
fn finish_identically(chain: &mut Cluster, so_far: &mut [Vec<u32>], expected: &[Vec<u32>], context: &str) {
    for (i, tokens) in so_far.iter_mut().enumerate() {
        *tokens = decode(&mut chain.remote, i, tokens.clone(), NEW_TOKENS);
        assert_eq!(*tokens, expected[i], "{context} request {i}");
    }
}

fn sequences<'a>(prompts: &'a [Vec<u32>], generated: &'a [Vec<u32>]) -> Vec<Sequence<'a>> {
    prompts
        .iter()
        .zip(generated)
        .enumerate()
        .map(|(i, (p, g))| Sequence { seat: seat(i), prompt: p, generated: g })
        .collect()
}

#[test]
fn stage_processes_produce_the_in_process_tokens() {
    let mut chain = cluster(false);
    assert_eq!(start_requests(&mut chain.remote, NEW_TOKENS), reference());
}

/// Each thread of process `pid`: its name and the CPUs it may run on (as the kernel lists them).
fn thread_cpus(pid: u32) -> Vec<(String, String)> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
    tasks
        .map(|task| {
            let dir = task.unwrap().path();
            let name = std::fs::read_to_string(dir.join("comm")).unwrap().trim().to_owned();
            let status = std::fs::read_to_string(dir.join("status")).unwrap();
            let cpus = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap();
            (name, cpus.trim().to_owned())
        })
        .collect()
}

#[test]
fn stages_compute_and_streamers_and_sidecars_copy_on_the_cpus_set_apart_for_them() {
    use dejavud::cluster::CpuSplit;
    use dejavulib::affinity::CpuList;
    // The first and the last CPU this test may use (one and the same on a single CPU).
    let available = CpuList::of_current_thread().unwrap();
    let first = CpuList::new([available.cpus()[0]]).unwrap();
    let last = CpuList::new([*available.cpus().last().unwrap()]).unwrap();
    let split = CpuSplit { compute: first.clone(), replication: last.clone() };
    let mut chain = Cluster::start(ClusterConfig { cpus: Some(split), ..config() }).unwrap();
    assert_eq!(start_requests(&mut chain.remote, NEW_TOKENS), reference());
    for stage in 0..splits().len() {
        let threads = thread_cpus(chain.pid(stage, Role::Engine).unwrap());
        let streamers = threads.iter().filter(|(name, _)| name == "dejavu-streamer").count();
        assert_eq!(streamers, 1, "stage {stage}: {threads:?}");
        for (name, cpus) in &threads {
            let expected = if name == "dejavu-streamer" { &last } else { &first };
            assert_eq!(*cpus, expected.to_string(), "stage {stage}, thread {name}: {threads:?}");
        }
        let threads = thread_cpus(chain.pid(stage, Role::Sidecar).unwrap());
        assert!(threads.iter().all(|(_, cpus)| *cpus == last.to_string()), "sidecar {stage}: {threads:?}");
    }
}

#[test]
fn without_its_kv_a_replacement_goes_astray() {
    // The control for the recovery tests: decoding on from the same tokens with blank caches
    // gives other tokens, so matching tokens prove the KV was restored.
    let expected = reference();
    let mut chain = cluster(false);
    let so_far = start_requests(&mut chain.remote, 3);
    let mut blank = cluster(false);
    assert_ne!(decode(&mut blank.remote, 0, so_far[0].clone(), NEW_TOKENS), expected[0]);
}

#[test]
fn a_killed_engine_or_worker_is_replaced_and_sequences_resume_bit_identically() {
    let expected = reference();
    let prompts = prompts();
    for (victim, what) in
        [(2usize, Kill::Engine), (0, Kill::Engine), (3, Kill::Engine), (1, Kill::Worker), (3, Kill::Worker)]
    {
        let mut chain = cluster(true);
        let done = 3;
        let mut so_far = start_requests(&mut chain.remote, done);
        chain.faults().kill(victim, what).unwrap();
        let position = (prompts[0].len() + done - 1) as u32;
        assert!(chain.remote.run(seat(0), &[so_far[0][done - 1]], position).is_err(), "{victim} {what:?}");
        // The heartbeats say who died, and how much of the worker.
        assert_eq!(chain.detect(Duration::from_secs(3)).unwrap(), [(victim, what)]);

        let successor = (victim + 1) % splits().len();
        let served = |chain: &mut Cluster, stage| {
            let page = chain.metrics(stage, Role::Sidecar).unwrap();
            value_of(&page, "dejavu_sidecar_chunks_served_total", &[]).unwrap()
        };
        let successor_served = served(&mut chain, successor);
        chain.recover(victim, what, &sequences(&prompts, &so_far)).unwrap();
        // The metrics say where the KV came from: an engine that died alone restores from its
        // own sidecar, with nothing over the network; a whole worker from its successor's.
        let page = chain.metrics(victim, Role::Engine).unwrap();
        let restored =
            |target| value_of(&page, "dejavu_stage_restored_tokens_total", &[("target", target)]).unwrap();
        let successor_served_now = served(&mut chain, successor);
        match what {
            Kill::Engine => {
                assert!(restored("local") > 0.0, "{page}");
                assert_eq!(restored("peer"), 0.0, "{page}");
                assert_eq!(successor_served_now, successor_served, "no network restore");
            }
            Kill::Worker => {
                assert!(restored("peer") > 0.0, "{page}");
                assert!(successor_served_now > successor_served, "restored from the successor");
            }
        }
        let controller = chain.controller_metrics().unwrap();
        assert_eq!(value_of(&controller, "dejavu_controller_epoch", &[]), Some(1.0), "{controller}");
        assert_eq!(value_of(&controller, "dejavu_controller_fences_total", &[]), Some(1.0));
        // The controller carried its part out: a replaced sidecar got its replica from the
        // predecessor's sidecar, on the controller's orders.
        assert_eq!(value_of(&controller, "dejavu_controller_recovery_seconds_count", &[]), Some(1.0));
        let reseeded = value_of(&controller, "dejavu_controller_reseeded_chunks_total", &[]).unwrap();
        let predecessor = (victim + splits().len() - 1) % splits().len();
        let page = chain.metrics(predecessor, Role::Sidecar).unwrap();
        let sent =
            value_of(&page, "dejavu_sidecar_reseeded_chunks_total", &[("stage", &predecessor.to_string())]);
        match what {
            Kill::Engine => assert_eq!(reseeded, 0.0, "{controller}"),
            Kill::Worker => {
                assert!(reseeded > 0.0, "{controller}");
                assert_eq!(sent, Some(reseeded), "{page}");
            }
        }

        finish_identically(&mut chain, &mut so_far, &expected, &format!("{victim} {what:?}"));
    }
}

#[test]
fn a_controller_crash_loses_no_failure_and_never_reuses_an_epoch() {
    let expected = reference();
    let prompts = prompts();
    let mut chain = cluster(true);
    let done = 3;
    let mut so_far = start_requests(&mut chain.remote, done);

    // The controller dies, then an engine: the replacement controller, started when the failed
    // step sends the cluster to it, finds that engine silent and no one else.
    chain.faults().kill_controller().unwrap();
    chain.faults().kill(2, Kill::Engine).unwrap();
    let position = (prompts[0].len() + done - 1) as u32;
    assert!(chain.remote.run(seat(0), &[so_far[0][done - 1]], position).is_err());
    assert_eq!(chain.detect(Duration::from_secs(3)).unwrap(), [(2, Kill::Engine)]);
    assert_eq!(chain.controller_restarts(), 1);

    // It dies again in the middle of the recovery, right after fencing: its replacement keeps the
    // epoch and the fence, and the recovery goes on.
    let mut crash = InRecovery { crash_controller: true, ..InRecovery::default() };
    let first = chain.recover_with(&mut crash, &[(2, Kill::Engine)], &sequences(&prompts, &so_far)).unwrap();
    assert_eq!(first.epoch, 1);
    assert_eq!(chain.controller_restarts(), 2);

    // A later failure gets the next epoch, never one handed out before.
    chain.faults().kill(1, Kill::Worker).unwrap();
    assert!(chain.remote.run(seat(0), &[so_far[0][done - 1]], position).is_err());
    assert_eq!(chain.detect(Duration::from_secs(3)).unwrap(), [(1, Kill::Worker)]);
    let second = chain.recover_all(&[(1, Kill::Worker)], &sequences(&prompts, &so_far)).unwrap();
    assert_eq!(second.epoch, 2);
    let controller = chain.controller_metrics().unwrap();
    assert_eq!(value_of(&controller, "dejavu_controller_incarnation", &[]), Some(3.0), "{controller}");

    finish_identically(&mut chain, &mut so_far, &expected, "");
}

#[test]
fn after_a_worker_recovery_replication_goes_on_and_survives_a_second_failure() {
    let expected = reference();
    let prompts = prompts();
    let mut chain = cluster(true);
    let mut so_far = start_requests(&mut chain.remote, 3);

    // Worker 1 dies whole: its engine and its sidecar, which held worker 0's replica.
    chain.faults().kill(1, Kill::Worker).unwrap();
    chain.recover(1, Kill::Worker, &sequences(&prompts, &so_far)).unwrap();
    for (i, tokens) in so_far.iter_mut().enumerate() {
        *tokens = decode(&mut chain.remote, i, tokens.clone(), 6);
        assert_eq!(*tokens, expected[i][..6]);
    }
    // Worker 0 dies whole: its replica is in worker 1's new sidecar.
    chain.faults().kill(0, Kill::Worker).unwrap();
    chain.recover(0, Kill::Worker, &sequences(&prompts, &so_far)).unwrap();
    // Worker 1's engine dies alone: its KV was restored from worker 2's sidecar and copied into
    // its own new sidecar, so it comes back from there.
    chain.faults().kill(1, Kill::Engine).unwrap();
    let recomputed = chain.recover(1, Kill::Engine, &sequences(&prompts, &so_far)).unwrap();
    let steps: usize = so_far.iter().map(Vec::len).sum();
    assert!(
        (recomputed as usize) < steps,
        "the local copy was found: {recomputed} of {steps} steps recomputed"
    );
    finish_identically(&mut chain, &mut so_far, &expected, "");
}

#[test]
fn a_worker_killed_during_a_recovery_fails_the_attempt_at_its_fence_and_the_next_recovers_both() {
    let expected = reference();
    let prompts = prompts();
    let mut chain = cluster(true);
    let done = 3;
    let so_far = start_requests(&mut chain.remote, done);

    // Worker 1 dies; worker 2, whose sidecar holds worker 1's replica, dies while worker 1's
    // replacement is about to restore from it. The restore's reply cannot come round the broken
    // chain: the attempt ends at worker 2's fence, not at the control deadline.
    chain.faults().kill(1, Kill::Worker).unwrap();
    let position = (prompts[0].len() + done - 1) as u32;
    assert!(chain.remote.run(seat(0), &[so_far[0][done - 1]], position).is_err());
    assert_eq!(chain.detect(Duration::from_secs(3)).unwrap(), [(1, Kill::Worker)]);
    let mut kill = InRecovery { kill: Some((2, Kill::Worker)), ..InRecovery::default() };
    let both = chain.recover_with(&mut kill, &[(1, Kill::Worker)], &sequences(&prompts, &so_far)).unwrap();
    assert_eq!(both.attempts, 2, "{both:?}");
    assert!(both.failures[0].contains("fenced members"), "the attempt ends at the fence: {both:?}");
    assert_eq!(both.victims, [(1, Kill::Worker), (2, Kill::Worker)]);
    assert_eq!(kill.killed, [(2, Kill::Worker)]);
    // The failed attempt and the retry replay through a fresh recovery machine.
    let transcript = &both.transcript;
    assert!(transcript
        .inputs
        .iter()
        .any(|i| matches!(i, Input::Failed(dead) if dead.contains(&(2, Loss::Worker)))));
    assert_eq!(transcript.replay(), Ok(transcript.steps.len()), "{transcript:?}");
    assert!(chain.dead().unwrap().is_empty(), "every replacement lives");

    // Worker 1's replica died with worker 2's sidecar, so its sequences were recomputed; the
    // output is the failure-free one.
    assert_eq!(both.copies_lost, [1], "{both:?}");
    let mut so_far = so_far;
    finish_identically(&mut chain, &mut so_far, &expected, "");
}

#[test]
fn adjacent_workers_lost_together_recompute_and_the_controller_reseeds_the_second_from_the_first() {
    let expected = reference();
    let prompts = prompts();
    let mut chain = cluster(true);
    let done = 3;
    let so_far = start_requests(&mut chain.remote, done);

    // Workers 1 and 2 die together: worker 1's replica died with worker 2's sidecar.
    chain.faults().kill_together(&[(1, Kill::Worker), (2, Kill::Worker)]).unwrap();
    let position = (prompts[0].len() + done - 1) as u32;
    assert!(chain.remote.run(seat(0), &[so_far[0][done - 1]], position).is_err());
    let victims = chain.detect(Duration::from_secs(3)).unwrap();
    assert_eq!(victims, [(1, Kill::Worker), (2, Kill::Worker)]);
    let first = chain.recover_all(&victims, &sequences(&prompts, &so_far)).unwrap();
    assert_eq!(first.copies_lost, [1], "the ring cannot restore worker 1");
    // Worker 2's new sidecar got worker 1's KV from worker 1's new sidecar once worker 1 had
    // recomputed it, on the controller's orders (worker 0's re-seeded worker 1's at once).
    let sent = |chain: &mut Cluster, stage: usize| {
        let page = chain.metrics(stage, Role::Sidecar).unwrap();
        value_of(&page, "dejavu_sidecar_reseeded_chunks_total", &[("stage", &stage.to_string())]).unwrap()
    };
    assert!(sent(&mut chain, 0) > 0.0);
    assert!(sent(&mut chain, 1) > 0.0, "re-seeded after the restore");

    // So when worker 1 dies again, its KV comes back from worker 2's sidecar: nothing recomputed
    // but the step the failed run did not finish.
    chain.faults().kill(1, Kill::Worker).unwrap();
    assert!(chain.remote.run(seat(0), &[so_far[0][done - 1]], position).is_err());
    assert_eq!(chain.detect(Duration::from_secs(3)).unwrap(), [(1, Kill::Worker)]);
    let second = chain.recover_all(&[(1, Kill::Worker)], &sequences(&prompts, &so_far)).unwrap();
    assert!(second.copies_lost.is_empty());
    assert_eq!(second.lag, [(1, 0)], "worker 2's sidecar held all of worker 1's KV");
    let mut so_far = so_far;
    finish_identically(&mut chain, &mut so_far, &expected, "");
}

#[test]
fn workers_apart_in_the_chain_lost_together_are_recovered_in_one_repair() {
    let expected = reference();
    let prompts = prompts();
    let mut chain = cluster(true);
    let done = 3;
    let so_far = start_requests(&mut chain.remote, done);

    // Workers 1 and 3 die together: the chain is repaired at two links at once (stage 0 to the
    // new stage 1, stage 2 to the new stage 3), and the rewire of each must cross the other's
    // link after its repair. Both restore from their successors' sidecars.
    chain.faults().kill_together(&[(1, Kill::Worker), (3, Kill::Worker)]).unwrap();
    let position = (prompts[0].len() + done - 1) as u32;
    assert!(chain.remote.run(seat(0), &[so_far[0][done - 1]], position).is_err());
    let victims = chain.detect(Duration::from_secs(3)).unwrap();
    assert_eq!(victims, [(1, Kill::Worker), (3, Kill::Worker)]);
    let recovered = chain.recover_all(&victims, &sequences(&prompts, &so_far)).unwrap();
    assert!(recovered.copies_lost.is_empty(), "{recovered:?}");
    let mut so_far = so_far;
    finish_identically(&mut chain, &mut so_far, &expected, "");
}

/// The controller's decisions replay: a run of real processes in which a whole worker is killed,
/// detected, fenced and recovered writes the journal of the controller's liveness machine, and a
/// fresh machine in the simulator, given the same calls, answers every one the same.
#[test]
fn the_controllers_and_the_recoverys_decisions_in_a_real_run_replay_through_the_simulated_machines() {
    let expected = reference();
    let prompts = prompts();
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("controller.journal");
    let mut chain = Cluster::start(ClusterConfig { journal: Some(journal.clone()), ..config() }).unwrap();
    let done = 3;
    let mut so_far = start_requests(&mut chain.remote, done);
    chain.faults().kill(1, Kill::Worker).unwrap();
    assert_eq!(chain.detect(Duration::from_secs(3)).unwrap(), [(1, Kill::Worker)]);
    let recovered = chain.recover_all(&[(1, Kill::Worker)], &sequences(&prompts, &so_far)).unwrap();
    finish_identically(&mut chain, &mut so_far, &expected, "");
    drop(chain);

    let text = std::fs::read_to_string(&journal).unwrap();
    let replayed = dejavu_sim::replay_journal(&text).unwrap();
    // The journal holds the run's decisions, not only its beats: the worker's fence in the
    // recovery's epoch, and its replacements' first beats in that epoch.
    let fenced = text.lines().find(|l| l.starts_with("fence engine:1,sidecar:1 - "));
    let fenced = fenced.unwrap_or_else(|| panic!("no fence: {text}"));
    assert!(fenced.ends_with(&format!("1 -> {}", recovered.epoch)), "{fenced}");
    for member in ["engine:1", "sidecar:1"] {
        let first = format!("beat {member} {} ", recovered.epoch);
        assert!(
            text.lines().any(|l| l.starts_with(&first) && l.contains("-> taken 1")),
            "{member}'s replacement"
        );
    }
    assert!(replayed > 20, "{replayed} entries replayed");

    // The supervisor's recovery machine too: fence, retire, a sidecar and an engine started,
    // repair, the controller's part, restore, done.
    let steps = recovered.transcript.steps.len();
    assert_eq!(recovered.transcript.replay(), Ok(steps), "{:?}", recovered.transcript);
    assert_eq!(steps, 8, "{:?}", recovered.transcript.steps);
}

#[test]
fn a_stale_engine_back_from_a_pause_is_fenced_out() {
    let expected = reference();
    let prompts = prompts();
    let mut chain = cluster(true);
    let done = 3;
    let mut so_far = start_requests(&mut chain.remote, done);

    // Stage 2's engine stops for longer than the heartbeat timeout: presumed dead, it is fenced and
    // replaced, but left running, as a machine cut off from the cluster could not be killed.
    let engine = |page: &str, name: &str| value_of(page, name, &[]).unwrap();
    // Its copies trail its steps: a copy still in flight when it stops would find the sidecar
    // taken over as it resumes, and it would stop before computing anything.
    let before = copies_landed(&mut chain, 2);
    let pause = Duration::from_millis(2500);
    let paused = std::time::Instant::now();
    chain.faults().pause(2, Role::Engine, pause).unwrap();
    let position = (prompts[0].len() + done - 1) as u32;
    assert!(chain.remote.run(seat(0), &[so_far[0][done - 1]], position).is_err());
    assert_eq!(chain.detect(Duration::from_secs(3)).unwrap(), [(2, Kill::Engine)]);
    let mut leave = InRecovery { leave_running: true, ..InRecovery::default() };
    let recovered = chain.recover_with(&mut leave, &[(2, Kill::Engine)], &sequences(&prompts, &so_far));
    assert_eq!(recovered.unwrap().epoch, 1);
    for (i, tokens) in so_far.iter_mut().enumerate() {
        *tokens = decode(&mut chain.remote, i, tokens.clone(), 6);
    }
    let kept = |chain: &mut Cluster| {
        let page = chain.metrics(2, Role::Sidecar).unwrap();
        value_of(&page, "dejavu_sidecar_local_chunks_total", &[]).unwrap()
    };
    copies_landed(&mut chain, 2);
    let kept_before = kept(&mut chain);

    // It comes back: it beats, and it finishes the step it had been sent and hands that KV to its
    // sidecar, in its old epoch, while the driver sends nothing.
    std::thread::sleep((pause + Duration::from_millis(700)).saturating_sub(paused.elapsed()));
    let controller = chain.controller_metrics().unwrap();
    let stale_beats = value_of(&controller, "dejavu_controller_stale_heartbeats_total", &[]).unwrap();
    assert!(stale_beats > 0.0, "its heartbeats are ignored: {controller}");
    assert!(!chain.census().unwrap().is_dead((Role::Engine, 2)), "the replacement is what is alive");
    // It computed the step it had been sent and tried to hand that KV to its sidecar, but its
    // replacement had taken the sidecar over: nothing it handed over was kept.
    let stale = chain.spared_metrics(0).unwrap();
    let computed = engine(&stale, "dejavu_stage_steps_total") - engine(&before, "dejavu_stage_steps_total");
    assert_eq!(computed, 1.0, "the stale engine ran its last step: {stale}");
    // Each step hands one chunk over: fewer kept than computed means its last one was refused
    // (the count of chunks kept lags a step behind, so it cannot be compared with `before`).
    let copied = engine(&stale, "dejavu_stage_copied_chunks_total");
    assert!(copied < engine(&stale, "dejavu_stage_steps_total"), "its copy failed: {stale}");
    assert_eq!(kept(&mut chain), kept_before, "its KV copies are refused");

    finish_identically(&mut chain, &mut so_far, &expected, "");
}

/// The tests' cluster, its recoveries carried out by the controller.
fn cluster_by_controller(spares: u32) -> Cluster {
    Cluster::start(ClusterConfig { recoveries: Recoveries::ByController, spares, ..config() }).unwrap()
}

/// A counter of the controller's metrics page.
fn controller_counter(chain: &Cluster, name: &str) -> f64 {
    let page = chain.controller_metrics().unwrap();
    value_of(&page, name, &[]).unwrap_or_else(|| panic!("no {name}: {page}"))
}

#[test]
fn the_controller_recovers_a_killed_engine_or_worker_and_the_feeder_resumes_bit_identically() {
    let expected = reference();
    let prompts = prompts();
    for (victim, what) in [(2usize, Kill::Engine), (1, Kill::Worker), (3, Kill::Worker)] {
        let mut chain = cluster_by_controller(0);
        let done = 3;
        let mut so_far = start_requests(&mut chain.remote, done);
        kill_and_detect(&mut chain, &so_far, &[(victim, what)]);
        let recovered = chain.recover_all(&[(victim, what)], &sequences(&prompts, &so_far)).unwrap();
        assert_eq!((recovered.epoch, recovered.attempts), (1, 1), "{recovered:?}");
        assert_eq!(recovered.victims, [(victim, what)]);
        assert!(recovered.copies_lost.is_empty(), "{recovered:?}");
        // Every replaced engine restored from its own sidecar: the controller handed a replaced
        // sidecar the stage's KV from the successor's.
        let page = chain.metrics(victim, Role::Engine).unwrap();
        let restored =
            |target| value_of(&page, "dejavu_stage_restored_tokens_total", &[("target", target)]).unwrap();
        assert!(restored("local") > 0.0, "{page}");
        assert_eq!(restored("peer"), 0.0, "{page}");
        // The controller restored a replaced sidecar itself, and heard the feeder acknowledge.
        let restores = controller_counter(&chain, "dejavu_controller_recovery_seconds_count");
        assert_eq!(restores, if what == Kill::Worker { 1.0 } else { 0.0 });
        assert_eq!(controller_counter(&chain, "dejavu_controller_recoveries_acknowledged_total"), 1.0);
        assert_eq!(controller_counter(&chain, "dejavu_controller_recovery_acknowledged_epoch"), 1.0);

        finish_identically(&mut chain, &mut so_far, &expected, &format!("{victim} {what:?}"));
    }
}

#[test]
fn adjacent_workers_recovered_by_the_controller_recompute_and_replicate_again() {
    let expected = reference();
    let prompts = prompts();
    let mut chain = cluster_by_controller(0);
    let done = 3;
    let so_far = start_requests(&mut chain.remote, done);

    // Workers 1 and 2 die together: worker 1's replica died with worker 2's sidecar.
    let victims = [(1, Kill::Worker), (2, Kill::Worker)];
    kill_and_detect(&mut chain, &so_far, &victims);
    let first = chain.recover_all(&victims, &sequences(&prompts, &so_far)).unwrap();
    assert_eq!(first.copies_lost, [1], "the ring cannot restore worker 1: {first:?}");

    // Worker 1's recomputed steps went on to worker 2's new sidecar as it computed them, so when
    // worker 1 dies again its KV comes back from there, with nothing to recompute.
    copies_landed(&mut chain, 1);
    kill_and_detect(&mut chain, &so_far, &[(1, Kill::Worker)]);
    let second = chain.recover_all(&[(1, Kill::Worker)], &sequences(&prompts, &so_far)).unwrap();
    assert!(second.copies_lost.is_empty(), "{second:?}");
    assert_eq!(second.lag, [(1, 0)], "worker 2's sidecar held all of worker 1's KV: {second:?}");
    let mut so_far = so_far;
    finish_identically(&mut chain, &mut so_far, &expected, "");
}

#[test]
fn the_controller_hands_a_spare_sidecar_the_place_of_a_lost_worker() {
    let expected = reference();
    let prompts = prompts();
    let mut chain = cluster_by_controller(1);
    let done = 3;
    let mut so_far = start_requests(&mut chain.remote, done);
    kill_and_detect(&mut chain, &so_far, &[(2, Kill::Worker)]);
    chain.recover_all(&[(2, Kill::Worker)], &sequences(&prompts, &so_far)).unwrap();
    // The controller chose the spare sidecar; the cluster made its spare stage the engine.
    assert_eq!(controller_counter(&chain, "dejavu_controller_spares_assigned_total"), 1.0);
    assert_eq!(chain.spares_used(), 2);
    finish_identically(&mut chain, &mut so_far, &expected, "");
}

#[test]
fn a_recovery_by_the_controller_survives_the_controllers_crash_and_a_second_death_in_its_middle() {
    let expected = reference();
    let prompts = prompts();
    let mut chain = cluster_by_controller(0);
    let done = 3;
    let mut so_far = start_requests(&mut chain.remote, done);

    // The controller dies right after fencing an engine: its replacement, on the same state,
    // keeps the fence and publishes the recovery once the replacement engine joins.
    kill_and_detect(&mut chain, &so_far, &[(2, Kill::Engine)]);
    let mut crash = InRecovery { crash_controller: true, ..InRecovery::default() };
    let first = chain.recover_with(&mut crash, &[(2, Kill::Engine)], &sequences(&prompts, &so_far)).unwrap();
    assert_eq!((first.epoch, first.attempts), (1, 1), "{first:?}");
    assert_eq!(chain.controller_restarts(), 1);

    // Worker 1 dies; worker 2 dies while worker 1's replacement is about to resume. The attempt
    // fails on the broken chain, the controller fences worker 2, and the next attempt replaces it
    // and resumes both.
    kill_and_detect(&mut chain, &so_far, &[(1, Kill::Worker)]);
    let mut kill = InRecovery { kill: Some((2, Kill::Worker)), ..InRecovery::default() };
    let both = chain.recover_with(&mut kill, &[(1, Kill::Worker)], &sequences(&prompts, &so_far)).unwrap();
    assert_eq!(both.attempts, 2, "{both:?}");
    assert_eq!(both.victims, [(1, Kill::Worker), (2, Kill::Worker)]);
    assert_eq!(both.epoch, 3, "{both:?}");
    assert!(chain.dead().unwrap().is_empty(), "every replacement lives");
    assert_eq!(controller_counter(&chain, "dejavu_controller_recovery_acknowledged_epoch"), 3.0);

    finish_identically(&mut chain, &mut so_far, &expected, "");
}

#[test]
fn a_successor_lost_in_the_middle_of_a_restore_by_the_controller_leaves_the_stage_to_recompute() {
    let expected = reference();
    let prompts = prompts();
    let mut chain = cluster_by_controller(0);
    let done = 3;
    let so_far = start_requests(&mut chain.remote, done);

    // Worker 1 dies; the sidecar of its successor, which holds its copy, stops before the
    // controller can hand that copy back, and its worker dies while the hand-back waits on it.
    // The controller plans worker 1's restore again: its copy is lost, and the restore ends
    // rather than waiting for it for good.
    kill_and_detect(&mut chain, &so_far, &[(1, Kill::Worker)]);
    chain.faults().signal(2, Role::Sidecar, libc::SIGSTOP).unwrap();
    let mut kill = InRecovery { kill: Some((2, Kill::Worker)), ..InRecovery::default() };
    let recovered =
        chain.recover_with(&mut kill, &[(1, Kill::Worker)], &sequences(&prompts, &so_far)).unwrap();
    assert_eq!(recovered.victims, [(1, Kill::Worker), (2, Kill::Worker)], "{recovered:?}");
    assert_eq!(recovered.copies_lost, [1], "{recovered:?}");
    assert!(chain.dead().unwrap().is_empty(), "every replacement lives");

    let mut so_far = so_far;
    finish_identically(&mut chain, &mut so_far, &expected, "");
}
