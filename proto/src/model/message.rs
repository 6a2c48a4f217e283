//! Identifiers and the messages the controller and the workers exchange.
//!
//! Control messages are *state-based*: a worker's [`Status`] and the controller's [`Directive`]
//! each carry the sender's whole relevant state and are re-sent every tick, so a lost, duplicated
//! or reordered one is repaired by the next. Data messages (activations, replication deltas, bulk
//! restores) are re-sent until the receiver's progress shows they arrived; receivers ignore
//! duplicates. Every message carries the sender's epoch; a receiver drops anything from an older
//! epoch than its own (fencing).

/// A worker process (a sidecar and its engine).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

/// A configuration generation. Every failure or controller restart starts a new one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Epoch(pub u64);

/// Opaque bytes: an activation, a token, or one step's KV delta.
pub type Payload = Vec<u8>;

/// Where a message goes or comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Addr {
    /// The controller.
    Controller,
    /// A worker.
    Worker(NodeId),
}

/// Where a microbatch restarts after recovery, and the token that feeds that step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResumePoint {
    /// Microbatch.
    pub microbatch: u32,
    /// First step to compute.
    pub step: u32,
    /// Input of that step at stage 0: the prompt for step 0, else the previous token.
    pub input: Payload,
}

/// What the controller asks of one worker in the current epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Stop computing and wait (the epoch changed).
    Fence,
    /// Recovery step 1: send your replica of `stage`'s KV to its new owner `to`.
    SendReplicaOf {
        /// The failed stage whose replica you hold.
        stage: u32,
        /// Its replacement.
        to: NodeId,
    },
    /// Recovery step 2: send your own KV to `to`, the new holder of your replica.
    SendOwnTo {
        /// The replacement of your successor.
        to: NodeId,
    },
    /// You are not a member (declared dead, or unknown to a restarted controller): drop your state
    /// and register again with a new incarnation. Applies only to the incarnation named.
    Rejoin {
        /// The incarnation this is for.
        incarnation: u64,
    },
    /// Recovery step 1 for a stage whose replica was lost with its successor: load your own KV
    /// from the durable checkpoints of `stage`, `lens[microbatch]` steps each.
    LoadCheckpoint {
        /// The stage whose checkpoints to load (yours).
        stage: u32,
        /// Steps checkpointed per microbatch.
        lens: Vec<u32>,
    },
    /// Recovery steps 3 and 4 (and the initial start): truncate to these points and run.
    Run {
        /// One per microbatch.
        points: Vec<ResumePoint>,
    },
}

/// The controller's word to one worker, re-sent every tick.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Directive {
    /// The pipeline it concerns (epochs are numbered per pipeline).
    pub pipeline: u32,
    /// Current epoch.
    pub epoch: Epoch,
    /// The incarnation of the receiver the controller knows (0 when a restarted controller has not
    /// learned it yet): a process that is not that incarnation ignores the directive.
    pub incarnation: u64,
    /// Owner of each stage in this epoch (`None` while a stage waits for a replacement).
    pub owners: Vec<Option<NodeId>>,
    /// What this worker should do.
    pub command: Command,
    /// Tokens the controller has delivered per microbatch (so the last stage stops re-sending).
    pub delivered: Vec<u32>,
}

/// A worker's report, re-sent every tick: its heartbeat and its progress.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    /// The incarnation of the worker process (a restart makes a new one).
    pub incarnation: u64,
    /// The epoch it is in.
    pub epoch: Epoch,
    /// The stage it owns in that epoch.
    pub stage: Option<u32>,
    /// Whether it has stopped for the epoch change (true until it runs in this epoch).
    pub fenced: bool,
    /// Steps of its own stage's KV it holds, per microbatch.
    pub kv_len: Vec<u32>,
    /// Steps of its predecessor's KV it holds as a replica, per microbatch: the replication marks.
    pub replica_len: Vec<u32>,
    /// Steps of its own KV durably checkpointed, per microbatch.
    pub checkpoint_len: Vec<u32>,
    /// Recovery step 1 done: its own KV was restored from the successor's replica.
    pub own_restored: bool,
    /// Recovery step 2 done: its replica was restored from the predecessor.
    pub replica_restored: bool,
    /// It runs in this epoch.
    pub running: bool,
}

/// Which store a bulk transfer fills at the receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BulkKind {
    /// The receiver's own KV (step 1).
    Own,
    /// The receiver's replica of its predecessor (step 2).
    Replica,
}

/// Every message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Worker to controller: join a pipeline of the cluster.
    Register {
        /// Sender.
        node: NodeId,
        /// Its incarnation.
        incarnation: u64,
        /// The pipeline it joins (prompt and token pipelines are separate rings).
        pipeline: u32,
    },
    /// Worker to controller: heartbeat and progress.
    Status {
        /// Sender.
        node: NodeId,
        /// The report.
        status: Status,
    },
    /// Last stage to controller: token `step` of `microbatch`.
    Deliver {
        /// Sender.
        node: NodeId,
        /// Sender's epoch.
        epoch: Epoch,
        /// Microbatch.
        microbatch: u32,
        /// Token position.
        step: u32,
        /// The token.
        token: Payload,
    },
    /// Controller to worker.
    Directive(Directive),
    /// Stage `s` to stage `s + 1` (or the last stage to stage 0): the input of `step` there.
    Activation {
        /// Sender's epoch.
        epoch: Epoch,
        /// Sender.
        from: NodeId,
        /// Microbatch.
        microbatch: u32,
        /// Step the receiver computes with it.
        step: u32,
        /// The activation (or token).
        value: Payload,
    },
    /// Owner of `stage` to its successor: the KV delta of one step, to keep as a replica.
    Replica {
        /// Sender's epoch.
        epoch: Epoch,
        /// Sender.
        from: NodeId,
        /// The sender's stage.
        stage: u32,
        /// Microbatch.
        microbatch: u32,
        /// Step.
        step: u32,
        /// The KV delta.
        delta: Payload,
    },
    /// Successor to owner: how many steps of a microbatch it now holds.
    ReplicaAck {
        /// Sender's epoch.
        epoch: Epoch,
        /// Sender.
        from: NodeId,
        /// Microbatch.
        microbatch: u32,
        /// Steps held.
        len: u32,
    },
    /// Recovery: every step of one microbatch's KV, to install whole.
    Bulk {
        /// Sender's epoch.
        epoch: Epoch,
        /// Sender.
        from: NodeId,
        /// Which store it fills.
        kind: BulkKind,
        /// The stage the KV belongs to.
        stage: u32,
        /// Microbatch.
        microbatch: u32,
        /// One delta per step, from step 0.
        deltas: Vec<Payload>,
    },
}

impl Msg {
    /// The epoch a message was sent in, if it carries one.
    pub fn epoch(&self) -> Option<Epoch> {
        match self {
            Msg::Register { .. } => None,
            Msg::Status { status, .. } => Some(status.epoch),
            Msg::Directive(d) => Some(d.epoch),
            Msg::Deliver { epoch, .. }
            | Msg::Activation { epoch, .. }
            | Msg::Replica { epoch, .. }
            | Msg::ReplicaAck { epoch, .. }
            | Msg::Bulk { epoch, .. } => Some(*epoch),
        }
    }
}
