//! The simulator: one thread, one seeded RNG, virtual time in ticks.
//!
//! It runs a controller, `depth + spares` workers and the fake engine, over a network that can
//! drop, delay (and so reorder) and duplicate messages, cut links one way or both, and isolate
//! nodes. Workers crash (losing their KV) and restart as new incarnations, pause for longer than
//! the failure timeout, and the controller crashes and restarts from its persisted record. A run
//! has a chaos phase, then a heal phase in which every fault is repaired and every request must
//! finish. Invariants are checked as the run goes; each broken one is recorded as a violation.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

use dejavu_proto::model::{
    Action, Addr, BulkKind, Controller, ControllerConfig, Msg, NodeId, Output, Payload, Persisted, Worker,
    WorkerConfig,
};

use crate::engine::{self, hash, mix, Reference};
use dejavu_proto::rng::SplitMix64;

/// Fault rates of the chaos phase (probabilities per message or per node and tick).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Faults {
    /// A message is lost.
    pub drop: f64,
    /// A message is delivered twice.
    pub duplicate: f64,
    /// Extra delivery delay, up to this many ticks (reorders messages).
    pub max_delay: u64,
    /// A worker crashes (loses its state) in a tick.
    pub crash: f64,
    /// A worker pauses in a tick (for up to three failure timeouts).
    pub pause: f64,
    /// A link is cut (one way or both) in a tick.
    pub partition: f64,
    /// The controller crashes in a tick.
    pub controller_crash: f64,
}

impl Faults {
    /// No faults: the failure-free run.
    pub fn none() -> Self {
        Self {
            drop: 0.0,
            duplicate: 0.0,
            max_delay: 0,
            crash: 0.0,
            pause: 0.0,
            partition: 0.0,
            controller_crash: 0.0,
        }
    }

    /// Every fault class at once, at rates that leave room for progress.
    pub fn mixed() -> Self {
        Self {
            drop: 0.05,
            duplicate: 0.05,
            max_delay: 3,
            crash: 0.004,
            pause: 0.003,
            partition: 0.01,
            controller_crash: 0.003,
        }
    }
}

/// The shape of a simulated cluster and run.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// Pipeline stages.
    pub depth: u32,
    /// Microbatches.
    pub microbatches: u32,
    /// Tokens per microbatch.
    pub tokens: u32,
    /// Spare workers beyond one per stage.
    pub spares: u32,
    /// Ticks without a status before the controller declares a worker failed.
    pub failure_timeout: u64,
    /// Ticks of chaos before healing.
    pub chaos_ticks: u64,
    /// Ticks after which an unfinished run is a violation.
    pub max_ticks: u64,
    /// Fault rates during chaos.
    pub faults: Faults,
    /// Workers checkpoint their KV to durable shared storage every this many steps (0: never).
    pub checkpoint_every: u32,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            depth: 4,
            microbatches: 4,
            tokens: 10,
            spares: 1,
            failure_timeout: dejavu_proto::model::DEFAULT_FAILURE_TIMEOUT,
            chaos_ticks: 120,
            max_ticks: 2_000,
            faults: Faults::mixed(),
            checkpoint_every: 4,
        }
    }
}

impl SimConfig {
    /// A cluster shape and fault mix drawn from `seed`: depth 2-6, 1-8 microbatches, 0-3 spares,
    /// delays up to 10 ticks (deeply reordered streams), timeouts of 1-6 ticks, checkpoints or none.
    pub fn varied(seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed ^ 0x5eed_c0f1_6000_0000);
        let pick = |rng: &mut SplitMix64, options: &[u64]| options[rng.below(options.len() as u64) as usize];
        let depth = pick(&mut rng, &[2, 3, 4, 6]) as u32;
        let microbatches = pick(&mut rng, &[1, 2, 4, 8]) as u32;
        let spares = pick(&mut rng, &[0, 1, 2, 3]) as u32;
        let failure_timeout = pick(&mut rng, &[1, 3, 6]);
        let checkpoint_every = pick(&mut rng, &[0, 2, 4]) as u32;
        let faults = Faults { max_delay: pick(&mut rng, &[1, 3, 6, 10]), ..Faults::mixed() };
        Self { depth, microbatches, spares, failure_timeout, checkpoint_every, faults, ..Self::default() }
    }
}

/// What a run found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// Ticks run.
    pub ticks: u64,
    /// Whether every request finished.
    pub finished: bool,
    /// Invariants broken, in order.
    pub violations: Vec<String>,
    /// Hash of every delivered message: equal seeds give equal hashes.
    pub trace_hash: u64,
    /// Recovery plans the controller made (the initial start included).
    pub plans: u32,
    /// Faults injected, by class.
    pub faults: BTreeMap<&'static str, u32>,
    /// Tokens delivered again after a recovery (recomputed and checked bit-identical).
    pub recomputed_tokens: u64,
}

struct Node {
    id: NodeId,
    worker: Option<Worker>,
    incarnation: u64,
    own: Vec<Vec<Payload>>,
    replica: Vec<Vec<Payload>>,
    paused_until: u64,
    restart_at: Option<u64>,
    /// The engine runs one step at a time: the tick its last queued step completes.
    busy_until: u64,
}

struct Pending {
    from: Addr,
    to: Addr,
    msg: Msg,
}

struct Compute {
    at: u64,
    node: usize,
    incarnation: u64,
    stage: u32,
    microbatch: u32,
    step: u32,
    input: Payload,
}

/// A simulated cluster.
pub struct Sim {
    cfg: SimConfig,
    rng: SplitMix64,
    now: u64,
    controller: Option<Controller>,
    persisted: Option<Persisted>,
    controller_restart_at: Option<u64>,
    nodes: Vec<Node>,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    in_flight: HashMap<u64, Pending>,
    /// Durable shared checkpoint storage, by (stage, microbatch): survives every crash.
    checkpoints: HashMap<(u32, u32), Vec<Payload>>,
    seq: u64,
    cuts: Vec<(Addr, Addr, u64)>,
    computes: Vec<Compute>,
    reference: Reference,
    /// Latest replication marks per stage, as the controller saw them, with the epoch they were
    /// reported in (marks are only valid in their epoch: a resume truncates them).
    marks: Vec<Option<(u64, Vec<u32>)>>,
    /// The bound the next resume must respect, per microbatch: what every failed stage had
    /// acknowledged as replicated and every surviving stage held. `None` while no bound is known
    /// (no failure, or one whose marks the simulator did not see).
    resume_bound: Option<Vec<u32>>,
    /// Stages counted in `resume_bound`.
    bounded: Vec<u32>,
    report: Report,
    healed: bool,
    /// Workers whose driver callbacks produced actions still to run.
    pending_drain: Vec<usize>,
    /// Print crashes, plans and the computations of microbatch 0 to stderr (`DEJAVU_SIM_TRACE`).
    trace: bool,
    /// The message being handled is stale data (another epoch, or a Deliver not from the current
    /// last stage): acting on it is a fencing violation.
    handling_stale: Option<String>,
    /// A Run directive asked a worker to resume above the KV it holds.
    handling_run_violation: Option<String>,
}

impl Sim {
    /// A cluster for `seed`, not yet started.
    pub fn new(seed: u64, cfg: SimConfig) -> Self {
        let workers = cfg.depth + cfg.spares;
        let mbs = cfg.microbatches as usize;
        let nodes = (0..workers)
            .map(|i| {
                let id = NodeId(i);
                Node {
                    id,
                    worker: Some(Worker::new(worker_config(&cfg, id), 1)),
                    incarnation: 1,
                    own: vec![Vec::new(); mbs],
                    replica: vec![Vec::new(); mbs],
                    paused_until: 0,
                    restart_at: None,
                    busy_until: 0,
                }
            })
            .collect();
        let reference = Reference::new(cfg.depth, cfg.microbatches, cfg.tokens);
        Self {
            controller: Some(Controller::new(controller_config(&cfg))),
            persisted: None,
            controller_restart_at: None,
            rng: SplitMix64::new(seed),
            now: 0,
            nodes,
            queue: BinaryHeap::new(),
            in_flight: HashMap::new(),
            checkpoints: HashMap::new(),
            seq: 0,
            cuts: Vec::new(),
            computes: Vec::new(),
            marks: vec![None; cfg.depth as usize],
            resume_bound: None,
            bounded: Vec::new(),
            report: Report { seed, ..Report::default() },
            healed: false,
            pending_drain: Vec::new(),
            trace: std::env::var_os("DEJAVU_SIM_TRACE").is_some(),
            handling_stale: None,
            handling_run_violation: None,
            reference,
            cfg,
        }
    }

    /// The controller, unless it is crashed.
    pub fn controller(&self) -> Option<&Controller> {
        self.controller.as_ref()
    }

    /// The worker on `node`, unless it is crashed.
    pub fn worker(&self, node: NodeId) -> Option<&Worker> {
        self.nodes.get(node.0 as usize)?.worker.as_ref()
    }

    /// The current tick.
    pub fn now(&self) -> u64 {
        self.now
    }

    /// Whether `node`'s own KV store matches the failure-free run for `stage`, per microbatch
    /// (for debugging scenarios).
    pub fn own_store_matches(&self, node: NodeId, stage: u32) -> Vec<bool> {
        let n = &self.nodes[node.0 as usize];
        n.own
            .iter()
            .enumerate()
            .map(|(j, store)| {
                let reference = &self.reference.deltas[stage as usize][j];
                store.len() <= reference.len() && store[..] == reference[..store.len()]
            })
            .collect()
    }

    /// The report so far.
    pub fn report(&self) -> &Report {
        &self.report
    }

    /// Crashes a worker now: it loses its state and whatever it had sent that is still in flight
    /// (a killed process's unsent socket buffers), and restarts after `down_for` ticks.
    pub fn crash_worker(&mut self, node: NodeId, down_for: u64) {
        self.in_flight.retain(|_, p| p.from != Addr::Worker(node));
        let n = &mut self.nodes[node.0 as usize];
        n.worker = None;
        n.own.iter_mut().for_each(Vec::clear);
        n.replica.iter_mut().for_each(Vec::clear);
        n.restart_at = Some(self.now + down_for.max(1));
        *self.report.faults.entry("worker crash").or_default() += 1;
    }

    /// Pauses a worker for `ticks` (it neither ticks nor receives meanwhile).
    pub fn pause_worker(&mut self, node: NodeId, ticks: u64) {
        self.nodes[node.0 as usize].paused_until = self.now + ticks;
        *self.report.faults.entry("worker pause").or_default() += 1;
    }

    /// Crashes the controller; it restarts from its persisted record after `down_for` ticks.
    pub fn crash_controller(&mut self, down_for: u64) {
        self.controller = None;
        self.controller_restart_at = Some(self.now + down_for.max(1));
        *self.report.faults.entry("controller crash").or_default() += 1;
    }

    /// Cuts messages from `from` to `to` for `ticks`.
    pub fn cut(&mut self, from: Addr, to: Addr, ticks: u64) {
        self.cuts.push((from, to, self.now + ticks));
        *self.report.faults.entry("partition").or_default() += 1;
    }

    /// Cuts every link to and from `node` for `ticks`.
    pub fn isolate(&mut self, node: Addr, ticks: u64) {
        let until = self.now + ticks;
        let others: Vec<Addr> = std::iter::once(Addr::Controller)
            .chain(self.nodes.iter().map(|n| Addr::Worker(n.id)))
            .filter(|&a| a != node)
            .collect();
        for other in others {
            self.cuts.push((node, other, until));
            self.cuts.push((other, node, until));
        }
        *self.report.faults.entry("isolation").or_default() += 1;
    }

    fn violation(&mut self, what: String) {
        if self.report.violations.len() < 20 {
            self.report.violations.push(format!("tick {}: {what}", self.now));
        }
    }

    /// Runs until every request finished (after the chaos phase) or `max_ticks`.
    pub fn run(mut self) -> Report {
        while self.now < self.cfg.max_ticks {
            self.step();
            let done = self.controller.as_ref().is_some_and(Controller::finished);
            if done && self.now > self.cfg.chaos_ticks {
                self.check_replication_settles();
                break;
            }
        }
        self.finish()
    }

    /// Once the faults have healed and every token is delivered, every stage must come to hold all
    /// of its KV, and its successor all of it as a replica, within a bounded time: replication keeps
    /// up, it is not merely reported (a recovery that starts after the last token recomputes first).
    fn check_replication_settles(&mut self) {
        let deadline = self.now + 300;
        let full = vec![self.cfg.tokens; self.cfg.microbatches as usize];
        let settled = |sim: &Sim| -> Result<(), String> {
            let c = sim.controller.as_ref().ok_or("controller down")?;
            if !c.running() {
                return Err("controller still recovering".into());
            }
            let owners = c.owners();
            let d = owners.len();
            for s in 0..d {
                let (Some(own), Some(succ)) = (owners[s], owners[(s + 1) % d]) else {
                    return Err(format!("stage {s} has no owner"));
                };
                let (Some(w), Some(r)) = (sim.worker(own), sim.worker(succ)) else {
                    return Err(format!("stage {s} or its successor is down"));
                };
                if w.kv_len() != &full[..] || r.replica_len() != &full[..] {
                    return Err(format!(
                        "stage {s} holds {:?} steps, its successor replicates {:?}",
                        w.kv_len(),
                        r.replica_len()
                    ));
                }
            }
            Ok(())
        };
        loop {
            match settled(self) {
                Ok(()) => return,
                Err(why) if self.now >= deadline => {
                    self.violation(format!("replication did not catch up after healing: {why}"));
                    return;
                }
                Err(_) => self.step(),
            }
        }
    }

    /// Ends the run: checks that every request finished with the reference tokens.
    pub fn finish(mut self) -> Report {
        self.report.ticks = self.now;
        let delivered = self.controller.as_ref().map(|c| c.delivered().to_vec());
        match delivered {
            Some(d) if d.iter().all(|t| t.len() as u32 == self.cfg.tokens) => {
                if d != self.reference.tokens {
                    self.violation("delivered tokens differ from the failure-free run".into());
                }
                self.report.finished = true;
            }
            _ => self.violation("requests did not finish after healing".into()),
        }
        self.report
    }

    /// Advances one tick.
    pub fn step(&mut self) {
        self.now += 1;
        let chaos = self.now <= self.cfg.chaos_ticks;
        if chaos {
            self.inject_faults();
        } else if !self.healed {
            self.heal();
        }
        self.restarts();
        self.complete_computes();
        self.deliver_due();
        self.tick_everyone();
        self.check_ownership();
        self.check_resume();
    }

    fn inject_faults(&mut self) {
        let f = self.cfg.faults;
        let timeout = self.cfg.failure_timeout;
        for i in 0..self.nodes.len() {
            let id = self.nodes[i].id;
            if self.nodes[i].worker.is_some() && self.rng.chance(f.crash) {
                let down = 1 + self.rng.below(3 * timeout);
                self.crash_worker(id, down);
                if self.trace {
                    eprintln!("t{} crash {id:?} for {down}", self.now);
                }
            } else if self.rng.chance(f.pause) {
                let ticks = 1 + self.rng.below(3 * timeout);
                self.pause_worker(id, ticks);
            }
        }
        if self.rng.chance(f.partition) {
            let count = self.nodes.len() as u64 + 1;
            let addr = |k: u64| if k == 0 { Addr::Controller } else { Addr::Worker(NodeId(k as u32 - 1)) };
            let (a, b) = (addr(self.rng.below(count)), addr(self.rng.below(count)));
            let ticks = 1 + self.rng.below(3 * timeout);
            if self.rng.chance(0.25) {
                self.isolate(a, ticks);
            } else if a != b {
                // One way, or both.
                self.cut(a, b, ticks);
                if self.rng.chance(0.5) {
                    self.cuts.push((b, a, self.now + ticks));
                }
            }
        }
        if self.controller.is_some() && self.rng.chance(f.controller_crash) {
            let down = 1 + self.rng.below(2 * timeout);
            self.crash_controller(down);
        }
    }

    fn heal(&mut self) {
        self.healed = true;
        self.cuts.clear();
        let now = self.now;
        for n in &mut self.nodes {
            n.paused_until = 0;
            if n.restart_at.is_some() {
                n.restart_at = Some(now);
            }
        }
        if self.controller_restart_at.is_some() {
            self.controller_restart_at = Some(now);
        }
    }

    fn restarts(&mut self) {
        let now = self.now;
        for i in 0..self.nodes.len() {
            if self.nodes[i].restart_at.is_some_and(|t| t <= now) {
                let n = &mut self.nodes[i];
                n.restart_at = None;
                n.incarnation += 1;
                n.worker = Some(Worker::new(worker_config(&self.cfg, n.id), n.incarnation));
            }
        }
        if self.controller_restart_at.is_some_and(|t| t <= now) {
            self.controller_restart_at = None;
            let cfg = controller_config(&self.cfg);
            self.controller = Some(match self.persisted.clone() {
                Some(record) => Controller::restart(cfg, record, now),
                None => Controller::new(cfg),
            });
            self.drain_controller();
        }
    }

    fn complete_computes(&mut self) {
        let now = self.now;
        let (due, later): (Vec<Compute>, Vec<Compute>) =
            std::mem::take(&mut self.computes).into_iter().partition(|c| c.at <= now);
        self.computes = later;
        for mut c in due {
            let node = &mut self.nodes[c.node];
            if node.incarnation != c.incarnation {
                continue; // the process that asked crashed
            }
            if node.paused_until > now {
                // A paused process finishes its computation when it wakes.
                c.at = node.paused_until;
                self.computes.push(c);
                continue;
            }
            let Some(worker) = node.worker.as_mut() else { continue };
            let m = c.microbatch as usize;
            if node.own[m].len() != c.step as usize || worker.stage() != Some(c.stage) {
                continue; // stale: the worker moved on
            }
            let (delta, output) = engine::step(c.stage, c.microbatch, c.step, &c.input, &node.own[m]);
            if self.trace && c.microbatch == 0 {
                eprintln!(
                    "t{} compute node {} stage {} step {} input {:x} held {} out {:x}",
                    now,
                    c.node,
                    c.stage,
                    c.step,
                    engine::unword(&c.input),
                    node.own[m].len(),
                    engine::unword(&output)
                );
            }
            worker.computed(c.microbatch, c.step, output);
            if worker.kv_len()[m] == c.step + 1 {
                node.own[m].push(delta);
            }
            self.drain_worker(c.node);
        }
    }

    fn deliver_due(&mut self) {
        while let Some(&Reverse((at, seq))) = self.queue.peek() {
            if at > self.now {
                break;
            }
            self.queue.pop();
            let Some(p) = self.in_flight.remove(&seq) else { continue };
            self.deliver(p);
        }
    }

    fn deliver(&mut self, p: Pending) {
        self.report.trace_hash = mix(
            self.report.trace_hash ^ hash(&[self.now, addr_key(p.from), addr_key(p.to), msg_key(&p.msg)])
        );
        match p.to {
            Addr::Controller => {
                if let Some(c) = self.controller.as_mut() {
                    if let Msg::Deliver { node, epoch, .. } = &p.msg {
                        let last = c.owners()[(self.cfg.depth - 1) as usize];
                        if *epoch != c.epoch() || last != Some(*node) {
                            self.handling_stale = Some(format!("Deliver from {node:?} in {epoch:?}"));
                        }
                    }
                    c.handle(p.msg, self.now);
                    self.drain_controller();
                    self.handling_stale = None;
                }
            }
            Addr::Worker(id) => {
                let i = id.0 as usize;
                let now = self.now;
                let paused_until = self.nodes[i].paused_until;
                if paused_until > now {
                    // A paused process reads its socket when it wakes.
                    self.enqueue(p, paused_until);
                    return;
                }
                if let Some(w) = self.nodes[i].worker.as_mut() {
                    if let Msg::Directive(d) = &p.msg {
                        if let dejavu_proto::model::Command::Run { points } = &d.command {
                            let for_us =
                                d.incarnation == w.incarnation() || (d.incarnation == 0 && w.epoch().0 > 0);
                            let stage = d.owners.iter().position(|o| *o == Some(id)).map(|s| s as u32);
                            let fresh = d.epoch > w.epoch() || !w.is_running();
                            if for_us && d.epoch >= w.epoch() && fresh && stage.is_some() {
                                let held: Vec<u32> = if stage == w.stage() {
                                    w.kv_len().to_vec()
                                } else {
                                    vec![0; points.len()]
                                };
                                if let Some(p) = points.iter().find(|p| held[p.microbatch as usize] < p.step)
                                {
                                    let msg = format!(
                                        "{id:?} told to resume microbatch {} at step {} in {:?} holding {} steps",
                                        p.microbatch, p.step, d.epoch, held[p.microbatch as usize]
                                    );
                                    self.handling_run_violation = Some(msg);
                                }
                            }
                        }
                    }
                    let data =
                        matches!(p.msg, Msg::Activation { .. } | Msg::Replica { .. } | Msg::Bulk { .. });
                    if data && p.msg.epoch() != Some(w.epoch()) {
                        self.handling_stale =
                            Some(format!("{:?}-epoch data at a worker in {:?}", p.msg.epoch(), w.epoch()));
                    }
                    w.handle(p.msg, now);
                    if let Some(msg) = self.handling_run_violation.take() {
                        self.violation(msg);
                    }
                    self.drain_worker(i);
                    self.handling_stale = None;
                }
            }
        }
    }

    fn tick_everyone(&mut self) {
        let now = self.now;
        if let Some(c) = self.controller.as_mut() {
            c.tick(now);
            self.drain_controller();
        }
        if let Some(c) = &self.controller {
            for s in 0..self.cfg.depth {
                if let Some(m) = c.replication_marks(s) {
                    self.marks[s as usize] = Some((c.epoch().0, m));
                }
            }
        }
        for i in 0..self.nodes.len() {
            if self.nodes[i].paused_until > now {
                continue;
            }
            if let Some(w) = self.nodes[i].worker.as_mut() {
                w.tick(now);
                self.drain_worker(i);
            }
        }
    }

    fn enqueue(&mut self, p: Pending, at: u64) {
        self.seq += 1;
        self.queue.push(Reverse((at, self.seq)));
        self.in_flight.insert(self.seq, p);
    }

    fn send(&mut self, from: Addr, to: Addr, msg: Msg) {
        let now = self.now;
        if self.cuts.iter().any(|&(a, b, until)| a == from && b == to && until > now) {
            return;
        }
        let chaos = !self.healed;
        let f = self.cfg.faults;
        if chaos && self.rng.chance(f.drop) {
            *self.report.faults.entry("message drop").or_default() += 1;
            return;
        }
        let copies = if chaos && self.rng.chance(f.duplicate) {
            *self.report.faults.entry("message duplicate").or_default() += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let delay = 1 + if chaos { self.rng.below(f.max_delay + 1) } else { 0 };
            self.enqueue(Pending { from, to, msg: msg.clone() }, now + delay);
        }
    }

    fn drain_controller(&mut self) {
        let Some(c) = self.controller.as_mut() else { return };
        for out in c.drain() {
            match out {
                Output::Send(to, msg) => self.send(Addr::Controller, to, msg),
                Output::Persist(record) => self.persisted = Some(record),
                Output::Delivered { microbatch, step, token } => {
                    if let Some(why) = self.handling_stale.clone() {
                        self.violation(format!("controller delivered a token from stale data: {why}"));
                    }
                    if self.reference.tokens[microbatch as usize][step as usize] != token {
                        self.violation(format!(
                            "token {step} of microbatch {microbatch} differs from the reference"
                        ));
                    }
                }
                Output::Mismatch { microbatch, step } => {
                    self.violation(format!("re-delivered token {step} of microbatch {microbatch} differs"));
                }
                Output::Redelivered { .. } => {
                    if let Some(why) = self.handling_stale.clone() {
                        self.violation(format!("controller checked a token from stale data: {why}"));
                    }
                    self.report.recomputed_tokens += 1
                }
                Output::Plan(plan) => {
                    if self.trace {
                        eprintln!("t{} plan {plan:?} marks {:?}", self.now, self.marks);
                    }
                    self.report.plans += 1;
                    if !plan.from_checkpoint.is_empty() {
                        *self.report.faults.entry("restored from checkpoints").or_default() += 1;
                    }
                    if !plan.recompute.is_empty() || !plan.from_checkpoint.is_empty() {
                        // KV was lost (adjacent failures): the plan recomputes from the prompt, so
                        // no resume bound applies; tokens must still match.
                        self.resume_bound = None;
                        self.bounded.clear();
                        *self.report.faults.entry("unrecoverable from the ring").or_default() += 1;
                        continue;
                    }
                    self.bound_resume(&plan);
                }
            }
        }
    }

    /// Tightens the resume bound with every stage this plan restores: its marks acknowledged in the
    /// epoch that just ended, and what the surviving stages hold now. A stage whose marks the
    /// simulator did not see in that epoch makes the bound unknown.
    fn bound_resume(&mut self, plan: &dejavu_proto::model::RecoveryPlan) {
        let failed: Vec<u32> = plan.replacements.iter().map(|(s, _)| *s).collect();
        let mbs = self.cfg.microbatches as usize;
        let floor: Vec<u32> = (0..mbs)
            .map(|m| {
                self.nodes
                    .iter()
                    .filter_map(|n| n.worker.as_ref())
                    .filter(|w| w.stage().is_some_and(|s| !failed.contains(&s)))
                    .map(|w| w.kv_len()[m])
                    .min()
                    .unwrap_or(u32::MAX)
            })
            .collect();
        for &stage in &failed {
            if self.bounded.contains(&stage) {
                continue;
            }
            self.bounded.push(stage);
            match self.marks[stage as usize].clone() {
                Some((epoch, marks)) if epoch + 1 == plan.epoch.0 => {
                    let bound = self.resume_bound.get_or_insert_with(|| vec![u32::MAX; mbs]);
                    for m in 0..mbs {
                        bound[m] = bound[m].min(marks[m]).min(floor[m]);
                    }
                }
                // Marks unknown for this failure: no bound can be checked for this recovery.
                _ => self.resume_bound = Some(vec![0; mbs]),
            }
        }
    }

    fn drain_worker(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        let Some(w) = node.worker.as_mut() else { return };
        // A worker that rejoined is a new incarnation: a later restart must count on from it.
        node.incarnation = node.incarnation.max(w.incarnation());
        let actions = w.drain();
        let (epoch, stage) = (w.epoch(), w.stage());
        let id = self.nodes[i].id;
        for action in actions {
            match action {
                Action::Send(to, msg) => self.send(Addr::Worker(id), to, msg),
                Action::Compute { stage, microbatch, step, input } => {
                    if let Some(why) = self.handling_stale.clone() {
                        self.violation(format!("{id:?} acted on stale data: {why}"));
                    }
                    // A stage computes one microbatch at a time, one tick each, in arrival order.
                    let at = (self.now + 1).max(self.nodes[i].busy_until + 1);
                    self.nodes[i].busy_until = at;
                    self.computes.push(Compute {
                        at,
                        node: i,
                        incarnation: self.nodes[i].incarnation,
                        stage,
                        microbatch,
                        step,
                        input,
                    });
                }
                Action::StoreReplica { microbatch, step, delta } => {
                    if let Some(why) = self.handling_stale.clone() {
                        self.violation(format!("{id:?} acted on stale data: {why}"));
                    }
                    let store = &mut self.nodes[i].replica[microbatch as usize];
                    if store.len() == step as usize {
                        store.push(delta);
                    } else {
                        self.violation(format!("{id:?}: replica store out of step with its worker"));
                    }
                }
                Action::Install { kind, microbatch, deltas } => {
                    if let Some(why) = self.handling_stale.clone() {
                        self.violation(format!("{id:?} acted on stale data: {why}"));
                    }
                    let Some(own) = stage else { continue };
                    let d = self.cfg.depth;
                    let of = if kind == BulkKind::Own { own } else { (own + d - 1) % d };
                    let reference = &self.reference.deltas[of as usize][microbatch as usize];
                    if deltas.len() > reference.len() || deltas[..] != reference[..deltas.len()] {
                        self.violation(format!(
                            "{id:?} installed KV of stage {of} that differs from the reference"
                        ));
                    }
                    let node = &mut self.nodes[i];
                    let store = if kind == BulkKind::Own { &mut node.own } else { &mut node.replica };
                    store[microbatch as usize] = deltas;
                }
                Action::SendBulk { to, from_store, kind, stage, microbatch, len } => {
                    let node = &self.nodes[i];
                    let source = if from_store == BulkKind::Own { &node.own } else { &node.replica };
                    let Some(deltas) =
                        source[microbatch as usize].get(..len as usize).map(<[Payload]>::to_vec)
                    else {
                        self.violation(format!("{id:?} reports more KV than it holds"));
                        continue;
                    };
                    let msg = Msg::Bulk { epoch, from: id, kind, stage, microbatch, deltas };
                    self.send(Addr::Worker(id), Addr::Worker(to), msg);
                }
                Action::SendReplicas { to, microbatch, from, to_step } => {
                    let Some(stage) = stage else { continue };
                    for step in from..to_step {
                        let Some(delta) = self.nodes[i].own[microbatch as usize].get(step as usize).cloned()
                        else {
                            self.violation(format!("{id:?} replicates KV it does not hold"));
                            break;
                        };
                        let msg = Msg::Replica { epoch, from: id, stage, microbatch, step, delta };
                        self.send(Addr::Worker(id), Addr::Worker(to), msg);
                    }
                }
                Action::Truncate { microbatch, own_len, replica_len } => {
                    let node = &mut self.nodes[i];
                    node.own[microbatch as usize].truncate(own_len as usize);
                    node.replica[microbatch as usize].truncate(replica_len as usize);
                }
                Action::Checkpoint { stage, microbatch, upto } => {
                    let Some(deltas) =
                        self.nodes[i].own[microbatch as usize].get(..upto as usize).map(<[Payload]>::to_vec)
                    else {
                        self.violation(format!("{id:?} checkpoints KV it does not hold"));
                        continue;
                    };
                    let slot = self.checkpoints.entry((stage, microbatch)).or_default();
                    if deltas.len() > slot.len() {
                        *slot = deltas;
                    }
                    if let Some(w) = self.nodes[i].worker.as_mut() {
                        w.checkpointed(microbatch, upto);
                    }
                    self.pending_drain.push(i);
                }
                Action::LoadCheckpoint { stage, microbatch, len } => {
                    let stored = self.checkpoints.get(&(stage, microbatch)).cloned().unwrap_or_default();
                    let Some(deltas) = stored.get(..len as usize).map(<[Payload]>::to_vec) else {
                        self.violation(format!("checkpoint of stage {stage} holds fewer than {len} steps"));
                        continue;
                    };
                    if let Some(w) = self.nodes[i].worker.as_mut() {
                        w.checkpoint_loaded(stage, microbatch, deltas);
                    }
                    self.pending_drain.push(i);
                }
                Action::Reset => {
                    let node = &mut self.nodes[i];
                    node.own.iter_mut().for_each(Vec::clear);
                    node.replica.iter_mut().for_each(Vec::clear);
                }
            }
        }
        // Driver callbacks (checkpoint written or loaded) may have produced more actions.
        for j in std::mem::take(&mut self.pending_drain) {
            self.drain_worker(j);
        }
    }

    /// At most one owner per (stage, epoch).
    fn check_ownership(&mut self) {
        let mut seen: HashMap<(u32, u64), NodeId> = HashMap::new();
        let mut clash = None;
        for n in &self.nodes {
            let Some(w) = &n.worker else { continue };
            let Some(stage) = w.stage() else { continue };
            if let Some(other) = seen.insert((stage, w.epoch().0), n.id) {
                clash = Some((stage, w.epoch().0, other, n.id));
            }
        }
        if let Some((stage, epoch, a, b)) = clash {
            self.violation(format!("{a:?} and {b:?} both own stage {stage} in epoch {epoch}"));
        }
    }

    /// When a recovery resumes: every stage restored from the ring resumes no earlier than what
    /// was both acknowledged as replicated and delivered (bounded recompute, no acknowledged KV
    /// lost).
    fn check_resume(&mut self) {
        if self.bounded.is_empty() {
            return;
        }
        let Some(c) = &self.controller else { return };
        let Some(points) = c.resume_points_in_force() else { return };
        let delivered: Vec<u32> = c.delivered().iter().map(|d| d.len() as u32).collect();
        let mut problems = Vec::new();
        if let Some(bound) = &self.resume_bound {
            for p in points {
                let m = p.microbatch as usize;
                let bound = bound[m].min(delivered[m]);
                if p.step < bound {
                    problems.push(format!(
                        "microbatch {m} resumed at step {} though steps below {bound} were replicated, held and delivered",
                        p.step
                    ));
                }
            }
        }
        self.resume_bound = None;
        self.bounded.clear();
        for p in problems {
            self.violation(p);
        }
    }
}

fn worker_config(cfg: &SimConfig, node: NodeId) -> WorkerConfig {
    WorkerConfig {
        node,
        depth: cfg.depth,
        microbatches: cfg.microbatches,
        tokens: cfg.tokens,
        checkpoint_every: cfg.checkpoint_every,
        pipeline: 0,
    }
}

fn controller_config(cfg: &SimConfig) -> ControllerConfig {
    ControllerConfig {
        depth: cfg.depth,
        microbatches: cfg.microbatches,
        tokens: cfg.tokens,
        failure_timeout: cfg.failure_timeout,
        prompts: (0..cfg.microbatches).map(engine::prompt).collect(),
        pipeline: 0,
    }
}

fn addr_key(a: Addr) -> u64 {
    match a {
        Addr::Controller => u64::MAX,
        Addr::Worker(n) => n.0 as u64,
    }
}

fn msg_key(m: &Msg) -> u64 {
    match m {
        Msg::Register { node, incarnation, .. } => hash(&[1, node.0 as u64, *incarnation]),
        Msg::Status { node, status } => {
            hash(&[2, node.0 as u64, status.epoch.0, status.kv_len.iter().map(|&x| x as u64).sum()])
        }
        Msg::Deliver { microbatch, step, .. } => hash(&[3, *microbatch as u64, *step as u64]),
        Msg::Directive(d) => hash(&[4, d.epoch.0]),
        Msg::Activation { microbatch, step, .. } => hash(&[5, *microbatch as u64, *step as u64]),
        Msg::Replica { microbatch, step, .. } => hash(&[6, *microbatch as u64, *step as u64]),
        Msg::ReplicaAck { microbatch, len, .. } => hash(&[7, *microbatch as u64, *len as u64]),
        Msg::Bulk { microbatch, deltas, .. } => hash(&[8, *microbatch as u64, deltas.len() as u64]),
    }
}
