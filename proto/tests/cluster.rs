//! Two pipelines of different depths under one controller: each forms its own ring, and a failure
//! in the token pipeline is recovered in a new epoch of that pipeline only.
//!
//! A minimal driver: every message is delivered on the next tick, steps compute immediately with
//! a placeholder engine, and KV is tracked only as counts (the simulator checks bytes).

use std::collections::{BTreeMap, BTreeSet};

use dejavu_proto::model::{
    Action, Addr, Cluster, ControllerConfig, Msg, NodeId, Output, Worker, WorkerConfig,
};

const PROMPT: u32 = 0;
const TOKEN: u32 = 1;

fn config(pipeline: u32, depth: u32) -> ControllerConfig {
    ControllerConfig {
        pipeline,
        depth,
        microbatches: 2,
        tokens: 4,
        failure_timeout: 3,
        prompts: vec![vec![1], vec![2]],
    }
}

struct Driver {
    cluster: Cluster,
    workers: BTreeMap<NodeId, Worker>,
    down: BTreeSet<NodeId>,
    inbox: Vec<(Addr, Msg)>,
    delivered: u32,
    now: u64,
}

impl Driver {
    fn new(layout: &[(u32, u32)]) -> Self {
        let mut workers = BTreeMap::new();
        let mut id = 0;
        for &(pipeline, count) in layout {
            let depth = if pipeline == PROMPT { 2 } else { 3 };
            for _ in 0..count {
                let cfg = WorkerConfig {
                    node: NodeId(id),
                    depth,
                    microbatches: 2,
                    tokens: 4,
                    checkpoint_every: 0,
                    pipeline,
                };
                workers.insert(NodeId(id), Worker::new(cfg, 1));
                id += 1;
            }
        }
        let cluster = Cluster::new([(PROMPT, config(PROMPT, 2)), (TOKEN, config(TOKEN, 3))]);
        Self { cluster, workers, down: BTreeSet::new(), inbox: Vec::new(), delivered: 0, now: 0 }
    }

    fn step(&mut self) {
        self.now += 1;
        for (to, msg) in std::mem::take(&mut self.inbox) {
            match to {
                Addr::Controller => self.cluster.handle(msg, self.now),
                Addr::Worker(n) if !self.down.contains(&n) => {
                    if let Some(w) = self.workers.get_mut(&n) {
                        w.handle(msg, self.now);
                    }
                }
                Addr::Worker(_) => {}
            }
        }
        self.cluster.tick(self.now);
        for (_, out) in self.cluster.drain() {
            match out {
                Output::Send(to, msg) => self.inbox.push((to, msg)),
                Output::Delivered { .. } => self.delivered += 1,
                _ => {}
            }
        }
        let up: Vec<NodeId> = self.workers.keys().copied().filter(|n| !self.down.contains(n)).collect();
        for n in up {
            let w = self.workers.get_mut(&n).unwrap();
            w.tick(self.now);
            let mut actions = w.drain();
            while let Some(action) = actions.pop() {
                match action {
                    Action::Send(to, msg) => self.inbox.push((to, msg)),
                    Action::Compute { microbatch, step, input, .. } => {
                        let w = self.workers.get_mut(&n).unwrap();
                        w.computed(microbatch, step, input);
                        actions.extend(w.drain());
                    }
                    Action::SendBulk { to, kind, stage, microbatch, len, .. } => {
                        let epoch = self.workers[&n].epoch();
                        let deltas = vec![vec![0u8]; len as usize];
                        let msg = Msg::Bulk { epoch, from: n, kind, stage, microbatch, deltas };
                        self.inbox.push((Addr::Worker(to), msg));
                    }
                    Action::SendReplicas { to, microbatch, from, to_step } => {
                        let (epoch, stage) = (self.workers[&n].epoch(), self.workers[&n].stage().unwrap());
                        for step in from..to_step {
                            let msg =
                                Msg::Replica { epoch, from: n, stage, microbatch, step, delta: vec![0] };
                            self.inbox.push((Addr::Worker(to), msg));
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    fn run_until(&mut self, limit: u64, done: impl Fn(&Cluster) -> bool) {
        while !done(&self.cluster) {
            assert!(self.now < limit, "not reached by tick {limit}");
            self.step();
        }
    }
}

#[test]
fn pipelines_of_different_depths_form_and_recover_independently() {
    // Prompt pipeline: depth 2 plus a spare; token pipeline: depth 3 plus a spare.
    let mut d = Driver::new(&[(PROMPT, 3), (TOKEN, 4)]);
    d.run_until(50, |c| c.pipeline(PROMPT).unwrap().running() && c.pipeline(TOKEN).unwrap().running());
    let prompt = d.cluster.pipeline(PROMPT).unwrap();
    let token = d.cluster.pipeline(TOKEN).unwrap();
    assert_eq!(prompt.owners().len(), 2);
    assert_eq!(token.owners().len(), 3);
    let prompt_nodes: BTreeSet<NodeId> = prompt.owners().iter().flatten().copied().collect();
    assert!(prompt_nodes.iter().all(|n| d.cluster.home(*n) == Some(PROMPT)));
    assert!(token.owners().iter().flatten().all(|n| d.cluster.home(*n) == Some(TOKEN)));
    let (prompt_epoch, token_epoch) = (prompt.epoch(), token.epoch());

    // A token worker fails: only the token pipeline recovers, with its own spare.
    let victim = token.owners()[1].unwrap();
    d.down.insert(victim);
    d.run_until(100, |c| {
        let t = c.pipeline(TOKEN).unwrap();
        t.running() && t.epoch() > token_epoch && t.owners()[1] != Some(victim)
    });
    let replacement = d.cluster.pipeline(TOKEN).unwrap().owners()[1].unwrap();
    assert_eq!(d.cluster.home(replacement), Some(TOKEN), "a token spare replaced it");
    assert_eq!(d.cluster.pipeline(PROMPT).unwrap().epoch(), prompt_epoch, "the prompt pipeline is untouched");

    // Both pipelines still finish their microbatches.
    d.run_until(300, |c| c.pipeline(PROMPT).unwrap().finished() && c.pipeline(TOKEN).unwrap().finished());
    assert!(d.delivered >= 2 * 2 * 4);
}

/// The controller process restarts with no record: every worker it does not know is told to
/// rejoin, registers again, and both pipelines form anew and finish.
#[test]
fn a_restarted_cluster_gets_its_workers_back() {
    let mut d = Driver::new(&[(PROMPT, 3), (TOKEN, 4)]);
    d.run_until(50, |c| c.pipeline(PROMPT).unwrap().running() && c.pipeline(TOKEN).unwrap().running());
    // Push the token pipeline past epoch 1 with a failure first.
    let victim = d.cluster.pipeline(TOKEN).unwrap().owners()[1].unwrap();
    d.down.insert(victim);
    d.run_until(100, |c| c.pipeline(TOKEN).unwrap().running() && c.pipeline(TOKEN).unwrap().epoch().0 > 1);
    d.cluster = Cluster::new([(PROMPT, config(PROMPT, 2)), (TOKEN, config(TOKEN, 3))]);
    d.inbox.clear();
    let limit = d.now + 200;
    d.run_until(limit, |c| c.pipeline(PROMPT).unwrap().running() && c.pipeline(TOKEN).unwrap().running());
}
