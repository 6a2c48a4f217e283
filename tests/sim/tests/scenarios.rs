//! Golden scenarios of the control plane, run through the simulator with a calm network: the
//! failure-free run, the paper's Figure 10, an adjacent double failure, a failure during recovery,
//! a stale worker rejoining, and a controller restart. Every run must also deliver the reference
//! tokens exactly once (checked by the simulator).

use dejavu_proto::model::{Command, NodeId};
use dejavu_sim::{run_seed, Faults, Sim, SimConfig};

fn calm() -> SimConfig {
    SimConfig { faults: Faults::none(), chaos_ticks: 0, ..SimConfig::default() }
}

fn owner(sim: &Sim, stage: usize) -> NodeId {
    sim.controller().expect("controller up").owners()[stage].expect("stage owned")
}

fn step_until(sim: &mut Sim, limit: u64, mut done: impl FnMut(&Sim) -> bool) {
    while !done(sim) {
        assert!(sim.now() < limit, "condition not reached by tick {limit}");
        sim.step();
    }
}

fn assert_clean(report: &dejavu_sim::Report) {
    assert!(report.violations.is_empty(), "{:#?}", report.violations);
    assert!(report.finished);
}

#[test]
fn failure_free_run_delivers_the_reference_tokens() {
    let report = run_seed(7, &calm());
    assert_clean(&report);
    assert_eq!(report.plans, 1, "only the initial start");
    assert_eq!(report.recomputed_tokens, 0);
}

/// DéjàVu's Figure 10: four token stages and microbatches A-D; stage 2 fails after step 1 of B was
/// replicated but before step 1 of C was. Stage 3 returns stage 2's replica, stage 1 re-sends its
/// KV, and every stage resumes at microbatch C, step 1 (D, behind C in the pipeline, resumes at
/// its own first unreplicated step).
#[test]
fn paper_figure_10() {
    let mut sim = Sim::new(1, calm());
    let (a, b, c) = (0, 1, 2);
    // Step 1 of A and B held by stage 3 as a replica, step 1 of C not (the crash loses what stage 2
    // had not yet sent).
    step_until(&mut sim, 200, |s| {
        let Some(owners) = s.controller().map(|c| c.owners().to_vec()) else { return false };
        let (Some(two), Some(three)) =
            (owners[2].and_then(|n| s.worker(n)), owners[3].and_then(|n| s.worker(n)))
        else {
            return false;
        };
        let replica = three.replica_len();
        replica[a] >= 2 && replica[b] >= 2 && two.kv_len()[c] >= 1 && replica[c] == 1
    });
    let failed = owner(&sim, 2);
    let spare = NodeId(4);
    sim.crash_worker(failed, 1_000);

    let mut saw_step1 = false;
    let mut saw_step2 = false;
    step_until(&mut sim, 400, |s| {
        let Some(ctl) = s.controller() else { return false };
        match ctl.command(3) {
            Command::SendReplicaOf { stage: 2, to } if to == spare => saw_step1 = true,
            _ => {}
        }
        if let Command::SendOwnTo { to } = ctl.command(1) {
            saw_step2 |= to == spare;
        }
        ctl.running() && ctl.owners()[2] == Some(spare)
    });
    assert!(saw_step1, "stage 3 was never asked to return stage 2's replica");
    assert!(saw_step2, "stage 1 was never asked to re-send its KV");
    let points = sim.controller().unwrap().resume_points_in_force().unwrap().to_vec();
    assert_eq!(points[c].step, 1, "resume at microbatch C, step 1: {points:?}");
    assert!(points[a].step >= 2 && points[b].step >= 2, "A and B keep their replicated step 1: {points:?}");
    assert!(points[3].step <= 1, "D was behind C: {points:?}");
    assert_clean(&sim.run());
}

#[test]
fn adjacent_double_failure_without_checkpoints_recomputes_from_the_prompt() {
    let mut sim = Sim::new(2, SimConfig { checkpoint_every: 0, ..calm() });
    step_until(&mut sim, 200, |s| s.controller().is_some_and(|c| c.delivered()[0].len() >= 3));
    let (one, two) = (owner(&sim, 1), owner(&sim, 2));
    sim.crash_worker(one, 1_000);
    sim.crash_worker(two, 10);
    step_until(&mut sim, 500, |s| s.controller().is_some_and(|c| c.running() && c.epoch().0 > 1));
    let points = sim.controller().unwrap().resume_points_in_force().unwrap().to_vec();
    assert!(points.iter().all(|p| p.step == 0), "stage 1's KV is lost with its replica: {points:?}");
    let report = sim.run();
    assert_clean(&report);
    assert!(report.faults.contains_key("unrecoverable from the ring"));
    assert!(report.recomputed_tokens > 0, "delivered tokens were recomputed and checked");
}

#[test]
fn adjacent_double_failure_restores_from_checkpoints() {
    let mut sim = Sim::new(2, SimConfig { checkpoint_every: 2, ..calm() });
    step_until(&mut sim, 300, |s| s.controller().is_some_and(|c| c.delivered().iter().all(|d| d.len() >= 5)));
    let (one, two) = (owner(&sim, 1), owner(&sim, 2));
    sim.crash_worker(one, 1_000);
    sim.crash_worker(two, 10);
    step_until(&mut sim, 600, |s| s.controller().is_some_and(|c| c.running() && c.epoch().0 > 1));
    let points = sim.controller().unwrap().resume_points_in_force().unwrap().to_vec();
    // Checkpoints every 2 steps: at least 4 of the 5 delivered steps come back from storage.
    assert!(points.iter().all(|p| p.step >= 4), "resumed from the checkpoints: {points:?}");
    let report = sim.run();
    assert_clean(&report);
    assert!(report.faults.contains_key("restored from checkpoints"));
}

#[test]
fn failure_during_recovery_replans_in_a_newer_epoch() {
    let mut sim = Sim::new(3, SimConfig { spares: 2, ..calm() });
    step_until(&mut sim, 200, |s| s.controller().is_some_and(|c| c.delivered()[0].len() >= 2));
    sim.crash_worker(owner(&sim, 2), 1_000);
    step_until(&mut sim, 300, |s| s.controller().is_some_and(|c| !c.running()));
    let epoch = sim.controller().unwrap().epoch();
    sim.crash_worker(owner(&sim, 0), 1_000);
    step_until(&mut sim, 600, |s| s.controller().is_some_and(|c| c.running()));
    assert!(sim.controller().unwrap().epoch() > epoch);
    assert_clean(&sim.run());
}

#[test]
fn stale_worker_is_fenced_and_rejoins_as_a_new_incarnation() {
    let mut sim = Sim::new(4, calm());
    step_until(&mut sim, 200, |s| s.controller().is_some_and(|c| c.delivered()[0].len() >= 2));
    let stale = owner(&sim, 1);
    let incarnation = sim.worker(stale).unwrap().incarnation();
    // Paused for longer than the failure timeout: declared dead and replaced meanwhile.
    sim.pause_worker(stale, 4 * calm().failure_timeout);
    step_until(&mut sim, 400, |s| {
        s.controller().is_some_and(|c| c.running() && c.owners()[1] != Some(stale))
    });
    // Awake again, it still believes it owns stage 1 in the old epoch: its messages are dropped
    // (the simulator checks that no two workers own a stage in the same epoch) until it rejoins.
    step_until(&mut sim, 600, |s| s.worker(stale).is_some_and(|w| w.incarnation() > incarnation));
    assert_eq!(sim.worker(stale).unwrap().stage(), None);
    assert_clean(&sim.run());
}

#[test]
fn controller_restart_resyncs_without_losing_tokens() {
    let mut sim = Sim::new(5, calm());
    step_until(&mut sim, 200, |s| s.controller().is_some_and(|c| c.delivered()[1].len() >= 3));
    let epoch = sim.controller().unwrap().epoch();
    let delivered = sim.controller().unwrap().delivered().to_vec();
    sim.crash_controller(5);
    step_until(&mut sim, 400, |s| s.controller().is_some_and(|c| c.running()));
    let ctl = sim.controller().unwrap();
    assert!(ctl.epoch() > epoch, "a restarted controller starts a newer epoch");
    for (now, before) in ctl.delivered().iter().zip(&delivered) {
        assert!(now.len() >= before.len() && now[..before.len()] == before[..], "persisted tokens survive");
    }
    assert_clean(&sim.run());
}

#[test]
fn same_seed_same_trace() {
    let cfg = SimConfig::default();
    let a = run_seed(42, &cfg);
    let b = run_seed(42, &cfg);
    assert_eq!(a, b);
    assert_ne!(a.trace_hash, run_seed(43, &cfg).trace_hash);
}

/// An owner that cannot hear the controller (a one-way cut) keeps heartbeating in its old epoch; it
/// must still be replaced once it fails to report in the new epoch, or recovery would wait for as
/// long as the cut lasts.
#[test]
fn an_owner_that_cannot_hear_the_controller_is_replaced() {
    let mut sim = Sim::new(4, SimConfig { spares: 2, ..calm() });
    step_until(&mut sim, 200, |s| s.controller().is_some_and(|c| c.delivered()[0].len() >= 2));
    let deaf = owner(&sim, 1);
    sim.cut(dejavu_proto::model::Addr::Controller, dejavu_proto::model::Addr::Worker(deaf), 100_000);
    sim.crash_worker(owner(&sim, 2), 5);
    step_until(&mut sim, 400, |s| s.controller().is_some_and(|c| c.running() && c.owners()[1] != Some(deaf)));
    assert_clean(&sim.run());
}
