//! The controller: membership, heartbeats, epochs, replication marks, delivery, and the paper's
//! 4-step recovery.
//!
//! Recovery of a set of failed stages, in a new epoch:
//!
//! 0. *Fence*: every owner stops and reports it is in the new epoch.
//! 1. *Restore own KV*: the successor of each failed stage sends the replica it holds to the
//!    replacement. If the successor failed too, that KV is gone (adjacent double failure).
//! 2. *Restore the replica*: the predecessor of each failed stage re-sends its own KV, so the
//!    replacement again holds the replica the failed worker held.
//! 3. *Resume points*: for each microbatch, the first step not both held by every stage and
//!    delivered. After an adjacent double failure the lost stage restores from its checkpoints if
//!    it has any, else the points fall to step 0: recompute from the prompt.
//! 4. *Run*: every stage truncates to those points and stage 0 restarts each microbatch there.
//!
//! Each step waits for every worker's acknowledgment (in its [`Status`]); a failure during recovery
//! starts a newer epoch and re-plans with every stage still to restore.

use std::collections::BTreeMap;

use super::message::{Addr, Command, Directive, Epoch, Msg, NodeId, Payload, ResumePoint, Status};
use crate::plan::{self, Loss, Source, StagePlan};

/// Length of a tick in a deployment: the driver calls `tick` this often.
pub const TICK_MS: u64 = 100;

/// Missed ticks before a worker is declared failed, by default: 3 x 100 ms, as DéjàVu's 3
/// heartbeats but ten times faster.
pub const DEFAULT_FAILURE_TIMEOUT: u64 = 3;

/// Controller settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControllerConfig {
    /// Pipeline stages, `D`: also the replication ring.
    pub depth: u32,
    /// Microbatches in flight.
    pub microbatches: u32,
    /// Tokens each microbatch generates.
    pub tokens: u32,
    /// Ticks without a status before a worker is declared failed ([`DEFAULT_FAILURE_TIMEOUT`]).
    pub failure_timeout: u64,
    /// Input of step 0 of each microbatch.
    pub prompts: Vec<Payload>,
    /// The pipeline this controller runs (named in its directives).
    pub pipeline: u32,
}

/// What the controller must keep across its own restarts (its "disk").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Persisted {
    /// The last epoch it started.
    pub epoch: Epoch,
    /// Owners in that epoch.
    pub owners: Vec<Option<NodeId>>,
    /// Stages still to restore.
    pub failed: Vec<u32>,
    /// Tokens delivered so far.
    pub delivered: Vec<Vec<Payload>>,
    /// Steps durably checkpointed per stage and microbatch.
    pub checkpointed: Vec<Vec<u32>>,
}

/// What the controller asks its driver to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    /// Send a message.
    Send(Addr, Msg),
    /// Write this record durably before sending anything else.
    Persist(Persisted),
    /// Token `step` of `microbatch` reached the client (exactly once per position).
    Delivered {
        /// Microbatch.
        microbatch: u32,
        /// Position.
        step: u32,
        /// The token.
        token: Payload,
    },
    /// A token delivered before was recomputed after a recovery and matched (counted once per
    /// position and epoch).
    Redelivered {
        /// Microbatch.
        microbatch: u32,
        /// Position.
        step: u32,
    },
    /// A re-delivered token differs from the one delivered before: output is not bit-identical.
    Mismatch {
        /// Microbatch.
        microbatch: u32,
        /// Position.
        step: u32,
    },
    /// A recovery plan was made.
    Plan(RecoveryPlan),
}

/// How the controller will recover, for logs and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecoveryPlan {
    /// The new epoch.
    pub epoch: Epoch,
    /// Failed stages and their replacements.
    pub replacements: Vec<(u32, NodeId)>,
    /// Stages whose KV cannot be restored from the ring (their successor failed too) and that have
    /// no checkpoint: everything is recomputed from the prompts.
    pub recompute: Vec<u32>,
    /// Stages whose KV cannot be restored from the ring but is restored from their checkpoints.
    pub from_checkpoint: Vec<u32>,
}

#[derive(Clone, Debug)]
struct Member {
    incarnation: u64,
    last_heard: u64,
    status: Option<Status>,
    alive: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    /// Waiting for enough workers.
    Forming,
    /// Step 0: waiting for every owner to fence.
    Fencing,
    /// Step 1.
    RestoreOwn,
    /// Step 2.
    RestoreReplica,
    /// Steps 3 and 4 done: running from these points.
    Running(Vec<ResumePoint>),
}

/// The controller state machine.
#[derive(Debug)]
pub struct Controller {
    cfg: ControllerConfig,
    epoch: Epoch,
    members: BTreeMap<NodeId, Member>,
    owners: Vec<Option<NodeId>>,
    /// Stages being restored in the current plan.
    failed: Vec<u32>,
    phase: Phase,
    delivered: Vec<Vec<Payload>>,
    /// The epoch each delivered token was last produced in.
    produced_in: Vec<Vec<Epoch>>,
    /// Steps durably checkpointed per stage and microbatch (checkpoints never go stale: a
    /// recomputed step has the same KV).
    checkpointed: Vec<Vec<u32>>,
    /// When the current epoch started: owners must report in it within a few timeouts.
    epoch_started: u64,
    now: u64,
    out: Vec<Output>,
}

impl Controller {
    /// A fresh controller.
    pub fn new(cfg: ControllerConfig) -> Self {
        let depth = cfg.depth as usize;
        let mbs = cfg.microbatches as usize;
        assert_eq!(cfg.prompts.len(), mbs, "one prompt per microbatch");
        Self {
            cfg,
            epoch: Epoch(0),
            members: BTreeMap::new(),
            owners: vec![None; depth],
            failed: Vec::new(),
            phase: Phase::Forming,
            delivered: vec![Vec::new(); mbs],
            produced_in: vec![Vec::new(); mbs],
            checkpointed: vec![vec![0; mbs]; depth],
            epoch_started: 0,
            now: 0,
            out: Vec::new(),
        }
    }

    /// A controller restarted from its persisted record. It starts a newer epoch so that nothing
    /// its previous life sent can be mistaken for its new orders, and re-syncs every stage.
    pub fn restart(cfg: ControllerConfig, record: Persisted, now: u64) -> Self {
        let mut c = Self::new(cfg);
        c.now = now;
        c.epoch = record.epoch;
        c.produced_in = record.delivered.iter().map(|d| vec![Epoch(0); d.len()]).collect();
        c.delivered = record.delivered;
        c.checkpointed = record.checkpointed;
        c.failed = record.failed;
        for node in record.owners.iter().flatten() {
            // Owners get a full timeout to show they are alive.
            c.members.insert(*node, Member { incarnation: 0, last_heard: now, status: None, alive: true });
        }
        c.owners = record.owners;
        c.start_epoch();
        c
    }

    /// The current epoch.
    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// Owner of each stage.
    pub fn owners(&self) -> &[Option<NodeId>] {
        &self.owners
    }

    /// Tokens delivered per microbatch.
    pub fn delivered(&self) -> &[Vec<Payload>] {
        &self.delivered
    }

    /// Whether every microbatch has delivered all its tokens.
    pub fn finished(&self) -> bool {
        self.delivered.iter().all(|d| d.len() as u32 >= self.cfg.tokens)
    }

    /// Whether the pipeline is running (not forming or recovering).
    pub fn running(&self) -> bool {
        matches!(self.phase, Phase::Running(_))
    }

    /// The resume points of the current epoch, once recovery reached step 4.
    pub fn resume_points_in_force(&self) -> Option<&[ResumePoint]> {
        match &self.phase {
            Phase::Running(points) => Some(points),
            _ => None,
        }
    }

    /// Steps of `stage`'s KV its successor has acknowledged holding, per microbatch, as last
    /// reported in this epoch: the replication marks.
    pub fn replication_marks(&self, stage: u32) -> Option<Vec<u32>> {
        let successor = self.owners[((stage + 1) % self.cfg.depth) as usize]?;
        let status = self.members.get(&successor)?.status.as_ref()?;
        (status.epoch == self.epoch && status.running).then(|| status.replica_len.clone())
    }

    /// Takes the outputs produced so far.
    pub fn drain(&mut self) -> Vec<Output> {
        std::mem::take(&mut self.out)
    }

    /// Handles a message that arrived at tick `now`.
    pub fn handle(&mut self, msg: Msg, now: u64) {
        self.now = self.now.max(now);
        match msg {
            Msg::Register { node, incarnation, .. } => self.register(node, incarnation),
            Msg::Status { node, status } => self.status(node, status),
            Msg::Deliver { node, epoch, microbatch, step, token } => {
                self.deliver(node, epoch, microbatch, step, token)
            }
            // Messages for workers are not ours; ignore them.
            _ => {}
        }
        self.advance();
    }

    /// Advances time to `now`: detects failures and re-sends every directive.
    pub fn tick(&mut self, now: u64) {
        self.now = self.now.max(now);
        let timeout = self.cfg.failure_timeout;
        let mut newly_failed = Vec::new();
        for (node, m) in self.members.iter_mut() {
            if m.alive && self.now.saturating_sub(m.last_heard) > timeout {
                m.alive = false;
                newly_failed.push(*node);
            }
        }
        // An owner that does not report in the current epoch within a few timeouts (it cannot hear
        // the controller: a one-way cut) is as good as failed.
        if self.phase != Phase::Forming && self.now.saturating_sub(self.epoch_started) > 3 * timeout + 2 {
            for node in self.owners.iter().flatten() {
                let behind = self
                    .members
                    .get(node)
                    .and_then(|m| m.status.as_ref())
                    .is_none_or(|s| s.epoch < self.epoch);
                if behind && !newly_failed.contains(node) {
                    newly_failed.push(*node);
                }
            }
        }
        for node in newly_failed {
            if let Some(m) = self.members.get_mut(&node) {
                m.alive = false;
            }
            self.fail_node(node);
        }
        self.advance();
        self.broadcast();
    }

    fn register(&mut self, node: NodeId, incarnation: u64) {
        let now = self.now;
        let previous = self.members.get(&node).map(|m| m.incarnation);
        match previous {
            Some(old) if old > incarnation => return, // a stale registration
            Some(old) if old == incarnation && self.members[&node].alive => {
                self.members.get_mut(&node).expect("present").last_heard = now;
                return;
            }
            _ => {}
        }
        // A new incarnation (or a worker coming back after being declared dead) loses whatever it
        // owned: it joins as a spare with empty state.
        let owned = self.owners.iter().position(|o| *o == Some(node));
        self.members.insert(node, Member { incarnation, last_heard: now, status: None, alive: true });
        if let Some(stage) = owned {
            self.fail_stage(stage as u32);
        } else if self.phase == Phase::Forming {
            self.try_form();
        } else if self.owners.iter().any(Option::is_none) {
            // A stage was waiting for a replacement: here is one.
            self.start_epoch();
        }
    }

    fn status(&mut self, node: NodeId, status: Status) {
        let now = self.now;
        let known = self.members.get(&node).map(|m| (m.alive, m.incarnation));
        match known {
            Some((_, inc)) if inc != 0 && status.incarnation < inc => return, // an old incarnation
            // A newer incarnation must register first: only `Register` changes incarnations.
            Some((true, inc)) if inc != 0 && status.incarnation > inc => return,
            // A restarted controller does not know incarnations: it learns them from workers that
            // have been in an epoch, never from a fresh process (which must register, and so be
            // recognised as having lost its state).
            Some((true, 0)) if status.epoch == Epoch(0) => return,
            Some((true, _)) => {}
            // A fresh process (never in an epoch) holds nothing and registers by itself.
            _ if status.epoch == Epoch(0) => return,
            // Declared dead, or unknown to a restarted controller: it must rejoin.
            _ => {
                let directive = Directive {
                    pipeline: self.cfg.pipeline,
                    epoch: self.epoch,
                    incarnation: status.incarnation,
                    owners: self.owners.clone(),
                    command: Command::Rejoin { incarnation: status.incarnation },
                    delivered: Vec::new(),
                };
                self.out.push(Output::Send(Addr::Worker(node), Msg::Directive(directive)));
                return;
            }
        }
        if let Some(stage) = self.owners.iter().position(|o| *o == Some(node)) {
            if status.epoch == self.epoch && status.stage == Some(stage as u32) {
                for (mark, &len) in self.checkpointed[stage].iter_mut().zip(&status.checkpoint_len) {
                    *mark = (*mark).max(len);
                }
            }
        }
        let m = self.members.get_mut(&node).expect("known member");
        if m.incarnation == status.incarnation
            && m.status.as_ref().is_some_and(|old| old.epoch > status.epoch)
        {
            // A status from an earlier epoch, reordered behind a newer one: it still shows the
            // process is alive, but must not replace what it reported in this epoch.
            m.last_heard = now;
            return;
        }
        m.incarnation = status.incarnation;
        m.last_heard = now;
        m.status = Some(status);
    }

    fn deliver(&mut self, node: NodeId, epoch: Epoch, microbatch: u32, step: u32, token: Payload) {
        let last = self.owners[(self.cfg.depth - 1) as usize];
        if epoch != self.epoch || last != Some(node) || !self.running() {
            return; // fencing: only the current last stage of the current epoch delivers
        }
        let Some(log) = self.delivered.get_mut(microbatch as usize) else { return };
        let produced = &mut self.produced_in[microbatch as usize];
        let step_us = step as usize;
        if step_us < log.len() {
            if log[step_us] != token {
                self.out.push(Output::Mismatch { microbatch, step });
            } else if produced[step_us] < epoch {
                produced[step_us] = epoch;
                self.out.push(Output::Redelivered { microbatch, step });
            }
        } else if step_us == log.len() && step < self.cfg.tokens {
            log.push(token.clone());
            produced.push(epoch);
            // Durable first: a token the client saw must be in the record a restart starts from.
            self.persist();
            self.out.push(Output::Delivered { microbatch, step, token });
        }
    }

    fn fail_node(&mut self, node: NodeId) {
        if let Some(stage) = self.owners.iter().position(|o| *o == Some(node)) {
            self.fail_stage(stage as u32);
        }
    }

    /// Marks `stage` failed and (re)starts recovery in a new epoch.
    fn fail_stage(&mut self, stage: u32) {
        self.owners[stage as usize] = None;
        if !self.failed.contains(&stage) {
            self.failed.push(stage);
            self.failed.sort_unstable();
        }
        if self.phase != Phase::Forming {
            self.start_epoch();
        }
    }

    fn try_form(&mut self) {
        let alive: Vec<NodeId> = self.members.iter().filter(|(_, m)| m.alive).map(|(n, _)| *n).collect();
        if alive.len() < self.cfg.depth as usize {
            return;
        }
        for (stage, node) in alive.iter().take(self.cfg.depth as usize).enumerate() {
            self.owners[stage] = Some(*node);
        }
        self.start_epoch();
    }

    /// Starts a new epoch: replacements for failed stages, then fencing.
    fn start_epoch(&mut self) {
        self.epoch = Epoch(self.epoch.0 + 1);
        self.epoch_started = self.now;
        let spares: Vec<NodeId> = self
            .members
            .iter()
            .filter(|(n, m)| m.alive && !self.owners.contains(&Some(**n)))
            .map(|(n, _)| *n)
            .collect();
        let mut spares = spares.into_iter();
        let mut replacements = Vec::new();
        for &stage in &self.failed {
            if self.owners[stage as usize].is_none() {
                if let Some(node) = spares.next() {
                    self.owners[stage as usize] = Some(node);
                }
            }
            if let Some(node) = self.owners[stage as usize] {
                replacements.push((stage, node));
            }
        }
        let (from_checkpoint, recompute) =
            self.unrecoverable().into_iter().partition(|&s| self.has_checkpoint(s));
        self.phase = Phase::Fencing;
        self.persist();
        self.out.push(Output::Plan(RecoveryPlan {
            epoch: self.epoch,
            replacements,
            recompute,
            from_checkpoint,
        }));
    }

    fn has_checkpoint(&self, stage: u32) -> bool {
        self.checkpointed[stage as usize].iter().any(|&c| c > 0)
    }

    /// Failed stages whose successor failed too: their KV is lost.
    /// A replacement that already installed its own KV in an earlier attempt keeps it (the worker
    /// keeps restored state across epochs while its stage stays the same), so that stage is not lost.
    fn unrecoverable(&self) -> Vec<u32> {
        let lost: Vec<u32> =
            self.plan().into_iter().filter(|p| p.source == Source::Lost).map(|p| p.stage).collect();
        self.failed
            .iter()
            .copied()
            .filter(|s| lost.contains(s))
            .filter(|&s| !self.already_restored(s))
            .collect()
    }

    /// The ring's recovery plan for the failed stages: a failed node is a whole worker.
    fn plan(&self) -> Vec<StagePlan> {
        let failed: Vec<(u32, Loss)> = self.failed.iter().map(|&s| (s, Loss::Worker)).collect();
        plan::ring(self.cfg.depth, &failed)
    }

    /// Whether the owner of `stage` last reported its own KV restored while owning that stage.
    fn already_restored(&self, stage: u32) -> bool {
        let Some(node) = self.owners[stage as usize] else { return false };
        let Some(m) = self.members.get(&node) else { return false };
        m.alive
            && m.status
                .as_ref()
                .is_some_and(|s| s.stage == Some(stage) && s.own_restored && s.epoch > Epoch(0))
    }

    fn persist(&mut self) {
        self.out.push(Output::Persist(Persisted {
            epoch: self.epoch,
            owners: self.owners.clone(),
            failed: self.failed.clone(),
            delivered: self.delivered.clone(),
            checkpointed: self.checkpointed.clone(),
        }));
    }

    /// The current status of `node` if it reports in this epoch.
    fn current(&self, node: NodeId) -> Option<&Status> {
        let m = self.members.get(&node)?;
        m.status.as_ref().filter(|s| m.alive && s.epoch == self.epoch)
    }

    fn all_owners(&self, pred: impl Fn(&Status) -> bool) -> bool {
        self.owners.iter().all(|o| o.and_then(|n| self.current(n)).is_some_and(&pred))
    }

    fn replacements_all(&self, pred: impl Fn(&Status) -> bool) -> bool {
        self.failed.iter().all(|&s| self.owners[s as usize].and_then(|n| self.current(n)).is_some_and(&pred))
    }

    /// Moves recovery forward as far as the acknowledgments allow.
    fn advance(&mut self) {
        loop {
            let next = match &self.phase {
                Phase::Forming | Phase::Running(_) => return,
                Phase::Fencing => {
                    // Every stage needs an owner that reports fenced in this epoch.
                    if self.owners.iter().any(Option::is_none) {
                        return;
                    }
                    if !self.all_owners(|s| s.fenced) {
                        return;
                    }
                    Phase::RestoreOwn
                }
                Phase::RestoreOwn => {
                    // Stages whose successor failed too restore from checkpoints if they have any;
                    // without, there is nothing to wait for (they recompute).
                    let lost: Vec<u32> =
                        self.unrecoverable().into_iter().filter(|&s| !self.has_checkpoint(s)).collect();
                    let restored = self.failed.iter().filter(|s| !lost.contains(s)).all(|&s| {
                        self.owners[s as usize]
                            .and_then(|n| self.current(n))
                            .is_some_and(|st| st.own_restored)
                    });
                    if !restored {
                        return;
                    }
                    Phase::RestoreReplica
                }
                Phase::RestoreReplica => {
                    // Step 3 takes the minimum over *every* owner: each must have reported in this
                    // epoch (resume_points would otherwise leave it out).
                    if !self.replacements_all(|s| s.replica_restored) || !self.all_owners(|s| s.fenced) {
                        return;
                    }
                    Phase::Running(self.resume_points())
                }
            };
            if let Phase::Running(_) = next {
                self.failed.clear();
                self.persist();
            }
            self.phase = next;
        }
    }

    /// Step 3: per microbatch, the first step that is not both held by every stage and delivered.
    fn resume_points(&self) -> Vec<ResumePoint> {
        (0..self.cfg.microbatches)
            .map(|mb| {
                let held = self
                    .owners
                    .iter()
                    .filter_map(|o| o.and_then(|n| self.current(n)))
                    .map(|s| s.kv_len[mb as usize])
                    .min()
                    .unwrap_or(0);
                let delivered = self.delivered[mb as usize].len() as u32;
                let step = held.min(delivered).min(self.cfg.tokens);
                let input = match step {
                    0 => self.cfg.prompts[mb as usize].clone(),
                    s => self.delivered[mb as usize][s as usize - 1].clone(),
                };
                ResumePoint { microbatch: mb, step, input }
            })
            .collect()
    }

    /// What the controller currently asks of the owner of `stage` (for tests and operators).
    pub fn command(&self, stage: u32) -> Command {
        self.command_for(Some(stage))
    }

    fn command_for(&self, stage: Option<u32>) -> Command {
        match (&self.phase, stage) {
            (Phase::Running(points), Some(_)) => Command::Run { points: points.clone() },
            (Phase::RestoreOwn, Some(s)) if self.unrecoverable().contains(&s) && self.has_checkpoint(s) => {
                Command::LoadCheckpoint { stage: s, lens: self.checkpointed[s as usize].clone() }
            }
            (Phase::RestoreOwn, Some(s)) => {
                // The successor of a failed stage sends its replica, unless it failed too.
                let restores_from_s = self.plan().into_iter().find(|p| p.source == Source::Successor(s));
                match restores_from_s.and_then(|p| Some((p.stage, self.owners[p.stage as usize]?))) {
                    Some((stage, to)) => Command::SendReplicaOf { stage, to },
                    None => Command::Fence,
                }
            }
            (Phase::RestoreReplica, Some(s)) => {
                // The predecessor of a replaced sidecar sends it the replica it holds.
                let reseeds_from_s =
                    self.plan().into_iter().find(|p| p.reseed.is_some_and(|(from, _)| from == s));
                match reseeds_from_s.and_then(|p| self.owners[p.stage as usize]) {
                    Some(to) => Command::SendOwnTo { to },
                    None => Command::Fence,
                }
            }
            _ => Command::Fence,
        }
    }

    fn broadcast(&mut self) {
        if self.phase == Phase::Forming {
            return;
        }
        let delivered: Vec<u32> = self.delivered.iter().map(|d| d.len() as u32).collect();
        let targets: Vec<(NodeId, u64, Option<u32>)> = self
            .members
            .iter()
            .filter(|(_, m)| m.alive)
            .map(|(n, m)| {
                (*n, m.incarnation, self.owners.iter().position(|o| *o == Some(*n)).map(|s| s as u32))
            })
            .collect();
        for (node, incarnation, stage) in targets {
            let directive = Directive {
                pipeline: self.cfg.pipeline,
                epoch: self.epoch,
                incarnation,
                owners: self.owners.clone(),
                command: self.command_for(stage),
                delivered: delivered.clone(),
            };
            self.out.push(Output::Send(Addr::Worker(node), Msg::Directive(directive)));
        }
    }
}
