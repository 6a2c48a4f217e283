//! The worker (sidecar) state machine: registration, heartbeats, the step pipeline, replication to
//! the ring successor, and the worker's part of recovery.
//!
//! The worker tracks *how much* KV it holds; the bytes live with its driver (the engine's cache, the
//! sidecar's replica store). It asks the driver to compute, store and send through [`Action`]s,
//! and learns results through [`Worker::computed`].

use std::collections::BTreeMap;

use super::message::{Addr, BulkKind, Command, Directive, Epoch, Msg, NodeId, Payload, ResumePoint, Status};
use crate::fencing;

/// Worker settings (must match the controller's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerConfig {
    /// This worker.
    pub node: NodeId,
    /// Pipeline depth.
    pub depth: u32,
    /// Microbatches.
    pub microbatches: u32,
    /// Tokens per microbatch.
    pub tokens: u32,
    /// Checkpoint own KV durably every this many steps per microbatch (0: never).
    pub checkpoint_every: u32,
    /// The pipeline this worker joins.
    pub pipeline: u32,
}

/// What the worker asks its driver to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send a message.
    Send(Addr, Msg),
    /// Run `stage` for step `step` of `microbatch` on `input`, then call [`Worker::computed`].
    Compute {
        /// The stage.
        stage: u32,
        /// Microbatch.
        microbatch: u32,
        /// Step.
        step: u32,
        /// The input activation or token.
        input: Payload,
    },
    /// Store a replicated delta of the predecessor's KV.
    StoreReplica {
        /// Microbatch.
        microbatch: u32,
        /// Step.
        step: u32,
        /// The delta.
        delta: Payload,
    },
    /// Replace a whole store for one microbatch (recovery).
    Install {
        /// Which store.
        kind: BulkKind,
        /// Microbatch.
        microbatch: u32,
        /// One delta per step from step 0.
        deltas: Vec<Payload>,
    },
    /// Send every delta of one microbatch of a store, in a [`Msg::Bulk`] to `to`.
    SendBulk {
        /// Receiver.
        to: NodeId,
        /// Which of *our* stores to read: `Own` or `Replica`.
        from_store: BulkKind,
        /// Which store it fills at the receiver.
        kind: BulkKind,
        /// The stage the KV belongs to.
        stage: u32,
        /// Microbatch.
        microbatch: u32,
        /// Steps to send.
        len: u32,
    },
    /// Send own deltas `from..to` of a microbatch to the successor as [`Msg::Replica`]s.
    SendReplicas {
        /// Successor.
        to: NodeId,
        /// Microbatch.
        microbatch: u32,
        /// First step.
        from: u32,
        /// One past the last step.
        to_step: u32,
    },
    /// Drop steps from `len` on, in both stores, for a microbatch (resume truncation).
    Truncate {
        /// Microbatch.
        microbatch: u32,
        /// Own steps kept.
        own_len: u32,
        /// Replica steps kept.
        replica_len: u32,
    },
    /// Write own steps `..upto` of a microbatch to the durable checkpoint store of `stage`, then
    /// call [`Worker::checkpointed`]. The store keeps the longest checkpoint it was given: it
    /// never shrinks below a length the controller may have recorded.
    Checkpoint {
        /// The stage.
        stage: u32,
        /// Microbatch.
        microbatch: u32,
        /// Steps to have on durable storage.
        upto: u32,
    },
    /// Read steps `..len` of a microbatch from the checkpoints of `stage`, then call
    /// [`Worker::checkpoint_loaded`].
    LoadCheckpoint {
        /// The stage.
        stage: u32,
        /// Microbatch.
        microbatch: u32,
        /// Steps to load.
        len: u32,
    },
    /// Drop all state: this worker may be a new incarnation. The driver must record
    /// [`Worker::incarnation`] durably: a process restart must use a larger one.
    Reset,
}

/// The worker state machine.
#[derive(Debug)]
pub struct Worker {
    cfg: WorkerConfig,
    incarnation: u64,
    epoch: Epoch,
    owners: Vec<Option<NodeId>>,
    stage: Option<u32>,
    fenced: bool,
    running_epoch: Option<Epoch>,
    kv_len: Vec<u32>,
    replica_len: Vec<u32>,
    /// Steps the successor acknowledged holding.
    replica_acked: Vec<u32>,
    /// Steps of own KV on durable storage.
    checkpoint_len: Vec<u32>,
    /// A checkpoint write handed to the driver, per microbatch.
    checkpointing: Vec<bool>,
    /// A step handed to the driver to compute, per microbatch.
    computing: Vec<Option<u32>>,
    /// The last output per microbatch (re-sent until superseded).
    last_output: Vec<Option<(u32, Payload)>>,
    /// Tokens this (last) stage produced and the controller has not yet confirmed, by position.
    tokens_out: Vec<BTreeMap<u32, Payload>>,
    delivered: Vec<u32>,
    own_received: Vec<bool>,
    replica_received: Vec<bool>,
    registered_at: Option<u64>,
    now: u64,
    out: Vec<Action>,
}

impl Worker {
    /// A new worker process (`incarnation` must grow across restarts of the same node).
    pub fn new(cfg: WorkerConfig, incarnation: u64) -> Self {
        let mbs = cfg.microbatches as usize;
        Self {
            incarnation,
            epoch: Epoch(0),
            owners: Vec::new(),
            stage: None,
            fenced: true,
            running_epoch: None,
            kv_len: vec![0; mbs],
            replica_len: vec![0; mbs],
            replica_acked: vec![0; mbs],
            checkpoint_len: vec![0; mbs],
            checkpointing: vec![false; mbs],
            computing: vec![None; mbs],
            last_output: vec![None; mbs],
            tokens_out: vec![BTreeMap::new(); mbs],
            delivered: vec![0; mbs],
            own_received: vec![false; mbs],
            replica_received: vec![false; mbs],
            registered_at: None,
            now: 0,
            out: Vec::new(),
            cfg,
        }
    }

    /// This worker's node.
    pub fn node(&self) -> NodeId {
        self.cfg.node
    }

    /// Its incarnation.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The epoch it is in.
    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// The stage it owns in its epoch.
    pub fn stage(&self) -> Option<u32> {
        self.stage
    }

    /// Whether it is computing in its epoch.
    pub fn is_running(&self) -> bool {
        self.running_epoch == Some(self.epoch) && !self.fenced
    }

    /// Own KV steps held per microbatch.
    pub fn kv_len(&self) -> &[u32] {
        &self.kv_len
    }

    /// Steps of the predecessor's KV held as a replica, per microbatch.
    pub fn replica_len(&self) -> &[u32] {
        &self.replica_len
    }

    /// Takes the actions produced so far.
    pub fn drain(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.out)
    }

    fn send(&mut self, to: Addr, msg: Msg) {
        self.out.push(Action::Send(to, msg));
    }

    fn successor(&self) -> Option<NodeId> {
        let s = self.stage?;
        self.owners.get(((s + 1) % self.cfg.depth) as usize).copied().flatten()
    }

    fn next_stage_owner(&self) -> Option<NodeId> {
        // The last stage feeds its token back to stage 0: the same ring.
        self.successor()
    }

    fn status(&self) -> Status {
        let all = |v: &[bool]| v.iter().all(|&b| b);
        Status {
            incarnation: self.incarnation,
            epoch: self.epoch,
            stage: self.stage,
            fenced: self.fenced,
            kv_len: self.kv_len.clone(),
            replica_len: self.replica_len.clone(),
            checkpoint_len: self.checkpoint_len.clone(),
            own_restored: all(&self.own_received),
            replica_restored: all(&self.replica_received),
            running: self.is_running(),
        }
    }

    /// Advances time: registers (again) if needed, heartbeats, and re-sends whatever the receivers
    /// have not shown they got.
    pub fn tick(&mut self, now: u64) {
        self.now = now;
        if self.registered_at.is_none() {
            self.registered_at = Some(now);
            self.register();
        }
        let status = Msg::Status { node: self.cfg.node, status: self.status() };
        self.send(Addr::Controller, status);
        if !self.is_running() {
            // Until a directive arrives, keep registering: the first one may have been lost.
            if self.epoch == Epoch(0) {
                self.register();
            }
            return;
        }
        self.resend();
    }

    fn register(&mut self) {
        let msg =
            Msg::Register { node: self.cfg.node, incarnation: self.incarnation, pipeline: self.cfg.pipeline };
        self.send(Addr::Controller, msg);
    }

    fn resend(&mut self) {
        for mb in 0..self.cfg.microbatches {
            self.emit(mb);
        }
    }

    /// Sends what the receivers of `mb`'s outputs have not shown they got: the last activation
    /// (or token), unacknowledged replication deltas, undelivered tokens.
    fn emit(&mut self, mb: u32) {
        let Some(stage) = self.stage else { return };
        let last = stage + 1 == self.cfg.depth;
        let m = mb as usize;
        if let (Some((step, value)), Some(next)) = (self.last_output[m].clone(), self.next_stage_owner()) {
            // The last stage's token for the final step feeds nothing.
            if !(last && step + 1 >= self.cfg.tokens) {
                let next_step = if last { step + 1 } else { step };
                self.send_activation(next, mb, next_step, value);
            }
        }
        if let Some(succ) = self.successor() {
            if self.replica_acked[m] < self.kv_len[m] {
                self.out.push(Action::SendReplicas {
                    to: succ,
                    microbatch: mb,
                    from: self.replica_acked[m],
                    to_step: self.kv_len[m],
                });
            }
        }
        if last {
            let undelivered = self.delivered.get(m).copied().unwrap_or(0);
            // Confirmed tokens need no more re-sending.
            self.tokens_out[m] = self.tokens_out[m].split_off(&undelivered);
            let pending: Vec<(u32, Payload)> =
                self.tokens_out[m].iter().map(|(s, t)| (*s, t.clone())).collect();
            for (step, token) in pending {
                self.send_deliver(mb, step, token);
            }
        }
    }

    fn send_activation(&mut self, to: NodeId, microbatch: u32, step: u32, value: Payload) {
        let msg = Msg::Activation { epoch: self.epoch, from: self.cfg.node, microbatch, step, value };
        self.send(Addr::Worker(to), msg);
    }

    fn send_deliver(&mut self, microbatch: u32, step: u32, token: Payload) {
        let msg = Msg::Deliver { node: self.cfg.node, epoch: self.epoch, microbatch, step, token };
        self.send(Addr::Controller, msg);
    }

    /// Handles a message that arrived at tick `now`.
    pub fn handle(&mut self, msg: Msg, now: u64) {
        self.now = now;
        if let Msg::Directive(d) = msg {
            self.directive(d);
            return;
        }
        // Bulk restores happen while fenced, in the current epoch only.
        if let Msg::Bulk { epoch, kind, stage, microbatch, deltas, from } = msg {
            // Step 1 comes from our successor (its replica of us), step 2 from our predecessor.
            let sender = match kind {
                BulkKind::Own => self.successor(),
                BulkKind::Replica => self.predecessor(),
            };
            if epoch == self.epoch && Some(from) == sender {
                self.bulk(kind, stage, microbatch, deltas);
            }
            return;
        }
        // Fencing: data from another epoch, or while not running, is dropped (senders re-send).
        if msg.epoch() != Some(self.epoch) || !self.is_running() {
            return;
        }
        match msg {
            // Only the predecessor of this epoch feeds us (a node of another pipeline may share the
            // epoch number).
            Msg::Activation { microbatch, step, value, from, .. } if Some(from) == self.predecessor() => {
                self.activation(microbatch, step, value)
            }
            Msg::Replica { stage, microbatch, step, delta, from, .. } => {
                self.replica(from, stage, microbatch, step, delta)
            }
            Msg::ReplicaAck { microbatch, len, from, .. } if Some(from) == self.successor() => {
                if let Some(acked) = self.replica_acked.get_mut(microbatch as usize) {
                    *acked = (*acked).max(len).min(self.kv_len[microbatch as usize]);
                }
            }
            _ => {}
        }
    }

    /// The owner of the stage before ours in this epoch (for stage 0: the last stage, which feeds
    /// back tokens).
    fn predecessor(&self) -> Option<NodeId> {
        let s = self.stage?;
        let d = self.cfg.depth;
        self.owners.get(((s + d - 1) % d) as usize).copied().flatten()
    }

    fn activation(&mut self, microbatch: u32, step: u32, value: Payload) {
        let (Some(stage), m) = (self.stage, microbatch as usize) else { return };
        if m >= self.kv_len.len() || step != self.kv_len[m] || self.computing[m] == Some(step) {
            return; // a duplicate or out-of-order input
        }
        if step >= self.cfg.tokens {
            return;
        }
        self.computing[m] = Some(step);
        self.out.push(Action::Compute { stage, microbatch, step, input: value });
    }

    /// The driver computed `step` of `microbatch`: `output` is the activation for the next stage
    /// (the token, at the last stage). The driver has stored the step's KV delta.
    pub fn computed(&mut self, microbatch: u32, step: u32, output: Payload) {
        let m = microbatch as usize;
        if self.computing.get(m) != Some(&Some(step)) || !self.is_running() {
            return; // fenced meanwhile: the result belongs to an old epoch
        }
        self.computing[m] = None;
        self.kv_len[m] = step + 1;
        self.last_output[m] = Some((step, output.clone()));
        if self.stage == Some(self.cfg.depth - 1) {
            self.tokens_out[m].insert(step, output.clone());
            // Sent once even if already delivered: the controller checks a recomputed token
            // against the one it delivered (bit-identical output).
            self.send_deliver(microbatch, step, output);
        }
        let every = self.cfg.checkpoint_every;
        if every > 0 && !self.checkpointing[m] && self.kv_len[m] >= self.checkpoint_len[m] + every {
            if let Some(stage) = self.stage {
                self.checkpointing[m] = true;
                self.out.push(Action::Checkpoint { stage, microbatch, upto: self.kv_len[m] });
            }
        }
        self.emit(microbatch);
    }

    /// The driver wrote steps `..upto` of `microbatch` to durable storage.
    pub fn checkpointed(&mut self, microbatch: u32, upto: u32) {
        let m = microbatch as usize;
        if m < self.checkpoint_len.len() {
            self.checkpointing[m] = false;
            self.checkpoint_len[m] = self.checkpoint_len[m].max(upto);
        }
    }

    /// The driver loaded `deltas` (steps from 0) of `microbatch` from `stage`'s checkpoints.
    pub fn checkpoint_loaded(&mut self, stage: u32, microbatch: u32, deltas: Vec<Payload>) {
        if self.stage == Some(stage) {
            let m = microbatch as usize;
            if m < self.checkpoint_len.len() {
                self.checkpoint_len[m] = deltas.len() as u32;
            }
            self.bulk(BulkKind::Own, stage, microbatch, deltas);
        }
    }

    fn replica(&mut self, from: NodeId, stage: u32, microbatch: u32, step: u32, delta: Payload) {
        let Some(own) = self.stage else { return };
        let d = self.cfg.depth;
        if stage != (own + d - 1) % d || self.owners.get(stage as usize) != Some(&Some(from)) {
            return;
        }
        let m = microbatch as usize;
        if m >= self.replica_len.len() {
            return;
        }
        if step == self.replica_len[m] {
            self.replica_len[m] += 1;
            self.out.push(Action::StoreReplica { microbatch, step, delta });
        }
        let ack =
            Msg::ReplicaAck { epoch: self.epoch, from: self.cfg.node, microbatch, len: self.replica_len[m] };
        self.send(Addr::Worker(from), ack);
    }

    /// A bulk restore arrived (recovery steps 1 and 2).
    fn bulk(&mut self, kind: BulkKind, stage: u32, microbatch: u32, deltas: Vec<Payload>) {
        let m = microbatch as usize;
        let Some(own) = self.stage else { return };
        let d = self.cfg.depth;
        let expected = match kind {
            BulkKind::Own => own,
            BulkKind::Replica => (own + d - 1) % d,
        };
        if stage != expected || m >= self.kv_len.len() {
            return;
        }
        let len = deltas.len() as u32;
        match kind {
            BulkKind::Own if !self.own_received[m] => {
                self.own_received[m] = true;
                self.kv_len[m] = len;
            }
            BulkKind::Replica if !self.replica_received[m] => {
                self.replica_received[m] = true;
                self.replica_len[m] = len;
            }
            _ => return,
        }
        self.out.push(Action::Install { kind, microbatch, deltas });
    }

    fn directive(&mut self, d: Directive) {
        if let Command::Rejoin { incarnation } = d.command {
            if incarnation == self.incarnation {
                self.rejoin();
            }
            return;
        }
        if d.pipeline != self.cfg.pipeline {
            return; // another pipeline's controller: its epochs are not ours
        }
        // Directives are for one incarnation. A restarted controller that does not know ours yet
        // (0) may only steer a process that has been in an epoch; a fresh one keeps registering,
        // so the controller learns it lost whatever its node held.
        let for_us = d.incarnation == self.incarnation || (d.incarnation == 0 && self.epoch > Epoch(0));
        // The rule every running process applies to its peers' epochs.
        if !for_us || fencing::fenced_since(d.epoch.0, self.epoch.0) {
            return; // for another incarnation, or from a stale controller
        }
        if fencing::fenced_since(self.epoch.0, d.epoch.0) {
            self.enter_epoch(&d);
        }
        self.delivered = d.delivered.clone();
        match d.command {
            Command::Fence | Command::Rejoin { .. } => {}
            Command::LoadCheckpoint { stage, lens } => {
                if self.stage == Some(stage) {
                    for (mb, len) in lens.into_iter().enumerate() {
                        if !self.own_received[mb] {
                            let microbatch = mb as u32;
                            self.out.push(Action::LoadCheckpoint { stage, microbatch, len });
                        }
                    }
                }
            }
            Command::SendReplicaOf { stage, to } => {
                self.send_bulk(to, BulkKind::Replica, BulkKind::Own, stage)
            }
            Command::SendOwnTo { to } => {
                if let Some(stage) = self.stage {
                    self.send_bulk(to, BulkKind::Own, BulkKind::Replica, stage);
                }
            }
            Command::Run { points } => {
                if self.running_epoch != Some(self.epoch) {
                    self.run(points);
                }
            }
        }
    }

    /// Asks the driver to send every microbatch of one of our stores (`from_store`) to `to`, to
    /// fill its `kind` store for `stage`.
    fn send_bulk(&mut self, to: NodeId, from_store: BulkKind, kind: BulkKind, stage: u32) {
        let lens = match from_store {
            BulkKind::Own => self.kv_len.clone(),
            BulkKind::Replica => self.replica_len.clone(),
        };
        for (mb, len) in lens.into_iter().enumerate() {
            let microbatch = mb as u32;
            self.out.push(Action::SendBulk { to, from_store, kind, stage, microbatch, len });
        }
    }

    /// A newer epoch: stop, and take the stage the controller gives (empty state if it changed).
    fn enter_epoch(&mut self, d: &Directive) {
        self.epoch = d.epoch;
        self.owners = d.owners.clone();
        self.fenced = true;
        self.running_epoch = None;
        let mbs = self.cfg.microbatches as usize;
        self.computing = vec![None; mbs];
        self.checkpointing = vec![false; mbs];
        self.last_output = vec![None; mbs];
        self.replica_acked = vec![0; mbs];
        let stage = d.owners.iter().position(|o| *o == Some(self.cfg.node)).map(|s| s as u32);
        if stage != self.stage {
            // A new stage (a replacement) or none (a spare): nothing held is valid any more.
            self.stage = stage;
            self.kv_len = vec![0; mbs];
            self.replica_len = vec![0; mbs];
            self.checkpoint_len = vec![0; mbs];
            self.tokens_out = vec![BTreeMap::new(); mbs];
            self.own_received = vec![false; mbs];
            self.replica_received = vec![false; mbs];
            self.out.push(Action::Reset);
        }
        // The same stage: our own KV and replica stay, and so does what was restored of them.
    }

    fn run(&mut self, points: Vec<ResumePoint>) {
        let Some(stage) = self.stage else { return };
        if points.iter().any(|p| self.kv_len.get(p.microbatch as usize).is_some_and(|&held| held < p.step)) {
            // The plan assumes KV this worker does not hold (it lost state without the controller
            // noticing): start over as a new incarnation so the controller recovers the stage.
            self.rejoin();
            return;
        }
        self.fenced = false;
        self.running_epoch = Some(self.epoch);
        for p in points {
            let m = p.microbatch as usize;
            if m >= self.kv_len.len() {
                continue;
            }
            self.kv_len[m] = self.kv_len[m].min(p.step);
            self.replica_len[m] = self.replica_len[m].min(p.step);
            self.replica_acked[m] = 0;
            self.tokens_out[m].split_off(&p.step);
            self.out.push(Action::Truncate {
                microbatch: p.microbatch,
                own_len: self.kv_len[m],
                replica_len: self.replica_len[m],
            });
            if stage == 0 && p.step < self.cfg.tokens {
                self.activation(p.microbatch, p.step, p.input);
            }
        }
    }

    fn rejoin(&mut self) {
        let cfg = self.cfg.clone();
        *self = Worker::new(cfg, self.incarnation + 1);
        self.out.push(Action::Reset);
    }
}
