//! Interleavings driven directly against the sans-IO state machines: reordered statuses, the order
//! of persistence and delivery, activations from another pipeline, and a late `Rejoin`.

use dejavu_proto::model::{Command, Controller, ControllerConfig, Epoch, Msg, NodeId, Output, Status};

fn cfg() -> ControllerConfig {
    ControllerConfig {
        depth: 3,
        microbatches: 1,
        tokens: 10,
        failure_timeout: 3,
        prompts: vec![vec![7]],
        pipeline: 0,
    }
}

#[allow(clippy::too_many_arguments)]
fn st(
    epoch: u64,
    stage: u32,
    fenced: bool,
    kv: u32,
    rep: u32,
    own: bool,
    repl: bool,
    running: bool,
) -> Status {
    Status {
        incarnation: 1,
        epoch: Epoch(epoch),
        stage: Some(stage),
        fenced,
        kv_len: vec![kv],
        replica_len: vec![rep],
        checkpoint_len: vec![0],
        own_restored: own,
        replica_restored: repl,
        running,
    }
}

fn status(c: &mut Controller, node: u32, s: Status, now: u64) {
    c.handle(Msg::Status { node: NodeId(node), status: s }, now);
}

/// A status from the previous epoch, delivered late, must not replace a survivor's current-epoch
/// status: the resume minimum would leave that survivor out and resume above the KV it holds.
#[test]
fn a_reordered_old_status_keeps_its_survivor_in_the_resume_minimum() {
    let mut c = Controller::new(cfg());
    let mut now = 1;
    for n in 0..5 {
        c.handle(Msg::Register { node: NodeId(n), incarnation: 1, pipeline: 0 }, now);
    }
    assert_eq!(c.owners(), &[Some(NodeId(0)), Some(NodeId(1)), Some(NodeId(2))]);
    assert_eq!(c.epoch(), Epoch(1));
    for (n, s) in [(0, 0), (1, 1), (2, 2)] {
        status(&mut c, n, st(1, s, true, 0, 0, false, false, false), now);
    }
    assert!(c.running());
    // Epoch 1 runs: six tokens delivered, every stage holds 6 steps, stage 2 holds 3 replica steps of stage 1.
    for step in 0..6 {
        c.handle(
            Msg::Deliver { node: NodeId(2), epoch: Epoch(1), microbatch: 0, step, token: vec![step as u8] },
            now,
        );
    }
    // Node 1 (stage 1) goes silent: epoch 2, spare 3 replaces it.
    while c.epoch() == Epoch(1) {
        now += 1;
        status(&mut c, 0, st(1, 0, false, 6, 6, false, false, true), now);
        status(&mut c, 2, st(1, 2, false, 6, 3, false, false, true), now);
        status(&mut c, 3, Status { stage: None, ..st(1, 0, true, 0, 0, false, false, false) }, now);
        status(&mut c, 4, Status { stage: None, ..st(1, 0, true, 0, 0, false, false, false) }, now);
        c.tick(now);
    }
    assert_eq!(c.owners()[1], Some(NodeId(3)));
    now += 1;
    status(&mut c, 0, st(2, 0, true, 6, 6, false, false, false), now);
    status(&mut c, 2, st(2, 2, true, 6, 3, false, false, false), now);
    status(&mut c, 3, st(2, 1, true, 3, 0, true, false, false), now); // own KV from stage 2's replica: 3 steps
    status(&mut c, 3, st(2, 1, true, 3, 6, true, true, false), now);
    assert!(c.running());
    assert_eq!(c.resume_points_in_force().unwrap()[0].step, 3);
    // Epoch 2 recomputes from step 3; stage 2, last in the pipeline, is one step behind.
    // Node 0 (stage 0) goes silent: epoch 3, spare 4 replaces it.
    let mut late = None;
    while c.epoch() == Epoch(2) {
        now += 1;
        status(&mut c, 3, st(2, 1, false, 5, 5, true, true, true), now);
        let s2 = st(2, 2, false, 4, 5, false, false, true);
        late = Some(s2.clone()); // this copy will be delivered late
        status(&mut c, 2, s2, now);
        status(&mut c, 4, Status { stage: None, ..st(2, 0, true, 0, 0, false, false, false) }, now);
        c.tick(now);
    }
    assert_eq!(c.epoch(), Epoch(3));
    assert_eq!(c.owners()[0], Some(NodeId(4)));
    now += 1;
    status(&mut c, 3, st(3, 1, true, 5, 5, true, true, false), now);
    status(&mut c, 2, st(3, 2, true, 4, 5, false, false, false), now); // stage 2 holds 4 steps, in epoch 3
    status(&mut c, 4, st(3, 0, true, 0, 0, false, false, false), now);
    assert!(matches!(c.command(1), Command::SendReplicaOf { stage: 0, .. }));
    status(&mut c, 4, st(3, 0, true, 5, 0, true, false, false), now); // own KV from stage 1's replica: 5
                                                                      // The epoch-2 status of node 2 that was delayed in the network arrives now.
    status(&mut c, 2, late.unwrap(), now);
    status(&mut c, 4, st(3, 0, true, 5, 4, true, true, false), now); // replica from stage 2: 4 steps
    assert!(c.running(), "recovery finished");
    let p = c.resume_points_in_force().unwrap()[0].step;
    let _ = c.drain().into_iter().filter(|o| matches!(o, Output::Plan(_))).count();
    assert!(p <= 4, "resumed at step {p}, but stage 2 reported holding only 4 steps in epoch 3");
}

/// A token is persisted before it is delivered: a driver that acts on outputs in order and dies
/// between the two must not have handed the client a token the record lacks (a restarted
/// controller would deliver that position again).
#[test]
fn a_token_is_persisted_before_it_is_delivered() {
    let mut c = Controller::new(cfg());
    let now = 1;
    for n in 0..3 {
        c.handle(Msg::Register { node: NodeId(n), incarnation: 1, pipeline: 0 }, now);
    }
    for (n, s) in [(0, 0), (1, 1), (2, 2)] {
        status(&mut c, n, st(1, s, true, 0, 0, false, false, false), now);
    }
    assert!(c.running());
    let mut record = None;
    for o in c.drain() {
        if let Output::Persist(r) = o {
            record = Some(r);
        }
    }
    c.handle(Msg::Deliver { node: NodeId(2), epoch: Epoch(1), microbatch: 0, step: 0, token: vec![9] }, now);
    // A driver acts on the outputs in order and dies right after handing the client a token.
    for o in c.drain() {
        match o {
            Output::Persist(r) => record = Some(r),
            Output::Delivered { .. } => break,
            _ => {}
        }
    }
    let mut c = Controller::restart(cfg(), record.unwrap(), 2);
    for (n, s) in [(0, 0), (1, 1), (2, 2)] {
        status(&mut c, n, st(2, s, true, 1, 1, false, false, false), 2);
    }
    assert!(c.running());
    c.drain();
    c.handle(Msg::Deliver { node: NodeId(2), epoch: Epoch(2), microbatch: 0, step: 0, token: vec![9] }, 3);
    let again = c.drain().into_iter().any(|o| matches!(o, Output::Delivered { step: 0, .. }));
    assert!(!again, "token 0 of microbatch 0 reached the client twice");
}

/// Epochs are numbered per pipeline: a worker must not compute on an activation from a node of
/// another pipeline that happens to be in an epoch with the same number (only its predecessor of
/// this epoch feeds it).
#[test]
fn an_activation_from_another_pipeline_is_ignored() {
    use dejavu_proto::model::{Action, Directive, ResumePoint, Worker, WorkerConfig};
    let cfg = WorkerConfig {
        node: NodeId(5),
        depth: 2,
        microbatches: 1,
        tokens: 4,
        checkpoint_every: 0,
        pipeline: 1,
    };
    let mut w = Worker::new(cfg, 1);
    w.tick(1);
    let run = Directive {
        pipeline: 1,
        epoch: Epoch(1),
        incarnation: 1,
        owners: vec![Some(NodeId(4)), Some(NodeId(5))],
        command: Command::Run { points: vec![ResumePoint { microbatch: 0, step: 0, input: vec![1] }] },
        delivered: vec![0],
    };
    w.handle(Msg::Directive(run), 2);
    assert!(w.is_running());
    w.drain();
    // NodeId(0) belongs to pipeline 0, whose epoch 1 listed NodeId(5) as its stage 1.
    let foreign =
        Msg::Activation { epoch: Epoch(1), from: NodeId(0), microbatch: 0, step: 0, value: vec![0xEE] };
    w.handle(foreign, 3);
    let computed =
        w.drain().into_iter().any(|a| matches!(a, Action::Compute { input, .. } if input == vec![0xEE]));
    assert!(!computed, "computed on another pipeline's activation");
}

/// A restarted node's first status can reach the controller before its registration. The
/// controller must not answer it with `Rejoin` (the fresh process registers anyway): delivered
/// after the node was made a replacement, it would wipe the replacement.
#[test]
fn a_fresh_incarnation_is_not_told_to_rejoin() {
    use dejavu_proto::model::{Action, Directive, Worker, WorkerConfig};
    let cfg2 = ControllerConfig {
        depth: 2,
        microbatches: 1,
        tokens: 10,
        failure_timeout: 3,
        prompts: vec![vec![7]],
        pipeline: 0,
    };
    let mut c = Controller::new(cfg2);
    let mut now = 1;
    for n in 0..2 {
        c.handle(Msg::Register { node: NodeId(n), incarnation: 1, pipeline: 0 }, now);
    }
    for n in 0..2 {
        status(&mut c, n, st(1, n, true, 0, 0, false, false, false), now);
    }
    assert!(c.running());
    // Node 1 dies; its stage waits for a replacement in epoch 2.
    while c.epoch() == Epoch(1) {
        now += 1;
        status(&mut c, 0, st(1, 0, false, 3, 3, false, false, true), now);
        c.tick(now);
    }
    assert_eq!(c.owners()[1], None);
    c.drain();
    // Node 1 restarts as incarnation 2; its status overtakes its registration.
    let wcfg = WorkerConfig {
        node: NodeId(1),
        depth: 2,
        microbatches: 1,
        tokens: 10,
        checkpoint_every: 0,
        pipeline: 0,
    };
    let mut w = Worker::new(wcfg, 2);
    w.tick(now);
    let mut register = None;
    let mut first_status = None;
    for a in w.drain() {
        match a {
            Action::Send(_, m @ Msg::Register { .. }) if register.is_none() => register = Some(m),
            Action::Send(_, m @ Msg::Status { .. }) if first_status.is_none() => first_status = Some(m),
            _ => {}
        }
    }
    c.handle(first_status.unwrap(), now);
    let rejoin: Vec<Directive> = c
        .drain()
        .into_iter()
        .filter_map(|o| match o {
            Output::Send(_, Msg::Directive(d)) if matches!(d.command, Command::Rejoin { .. }) => Some(d),
            _ => None,
        })
        .collect();

    c.handle(register.unwrap(), now);
    assert_eq!(c.owners()[1], Some(NodeId(1)), "the fresh process is the replacement");
    now += 1;
    c.tick(now);
    for o in c.drain() {
        if let Output::Send(_, Msg::Directive(d)) = o {
            if d.incarnation == 2 {
                w.handle(Msg::Directive(d), now);
            }
        }
    }
    assert_eq!(w.stage(), Some(1));
    let epoch = c.epoch();
    // The Rejoin (if any was sent) arrives late.
    for d in rejoin {
        w.handle(Msg::Directive(d), now);
    }
    assert_eq!(
        w.incarnation(),
        2,
        "the replacement was wiped (now incarnation {}), so epoch {epoch:?} is lost",
        w.incarnation()
    );
}
