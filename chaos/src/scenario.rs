//! Scenarios: a cluster shape, a workload and faults, read from TOML.
//!
//! ```toml
//! name = "short mixed"
//! seed = 7
//!
//! [cluster]
//! stages = 4
//!
//! [workload]
//! requests = 4
//! new_tokens = 40
//!
//! [[fault]]             # scheduled: before step 30, stage 2's engine and sidecar are SIGKILLed
//! at_step = 30
//! kind = "kill-worker"
//! stage = 2
//!
//! [random]              # drawn from the seed: a fault before each step with this probability
//! rate = 0.02
//! kinds = ["kill-engine", "reset", "delay"]
//! ```

use std::path::Path;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A scenario that cannot run, with what is wrong in words.
#[derive(Debug, Error)]
#[error("{0}")]
pub struct ScenarioError(pub String);

/// Everything a chaos run needs.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Its name, for reports.
    pub name: String,
    /// The seed random faults are drawn from (`--seed` overrides it).
    #[serde(default = "defaults::seed")]
    pub seed: u64,
    /// The cluster.
    #[serde(default)]
    pub cluster: ClusterShape,
    /// The requests.
    #[serde(default)]
    pub workload: WorkloadShape,
    /// Faults at given steps.
    #[serde(default, rename = "fault")]
    pub faults: Vec<Fault>,
    /// Faults drawn from the seed.
    #[serde(default)]
    pub random: Option<RandomFaults>,
    /// The bounds the checkers hold the run to.
    #[serde(default)]
    pub limits: Limits,
}

/// The cluster: a pipeline of the reference model, each stage an engine process with a sidecar
/// process, on loopback, a fault-injecting proxy on every link between them.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterShape {
    /// Pipeline stages (2 to 8; the model's 8 layers are split evenly).
    pub stages: u32,
    /// Milliseconds between heartbeats; a process silent for three is dead.
    pub heartbeat_ms: u64,
    /// A step with no answer after this many milliseconds makes the driver look for a dead stage.
    pub deadline_ms: u64,
    /// KV caches each stage keeps in device memory, if fewer than the microbatches (swapping).
    pub device_caches: Option<u32>,
    /// Milliseconds each stage's step takes on top of the reference model's arithmetic, as a
    /// real model's kernels would on a GPU (where recovery and restart from scratch compare).
    pub step_ms: f64,
    /// For testing the checkers only: stages skip their replicas while claiming to keep them.
    pub test_only_sabotage_replicas: bool,
    /// Spare workers kept started, which recoveries make the dead stages' processes.
    pub spares: u32,
    /// Bytes of chunks each sidecar keeps in memory before it spills the rest to a directory of
    /// its own, if it spills at all.
    pub spill_memory_bytes: Option<u64>,
    /// Bytes each spill directory may hold (what `fill-spill` takes up).
    pub spill_dir_bytes: u64,
    /// Stages of a prompt pipeline of its own, if any (prompt-token disaggregation): it computes
    /// every prompt and hands the KV over to the stages above, the token pipeline, which decode.
    /// Faults hit the token pipeline.
    pub prompt_stages: Option<u32>,
    /// Sequences per prompt microbatch (the requests must fill whole ones; the token pipeline's
    /// microbatches hold 4).
    pub prompt_slots: u32,
    /// The transport between sidecars (and from stages to sidecars): `tcp` or `quic`. The proxies
    /// carry TCP only, so with QUIC the replica links take no network faults.
    pub transport: Transport,
    /// Each worker (and each spare and prompt stage) in a network namespace of its own, at an
    /// address of its own on a bridge, as on machines of their own; the controller, the driver
    /// and the proxies on the bridge's address. Needs root and iproute2 (`ip`).
    pub namespaces: bool,
    /// Controllers: 1 with a state file (the default), or with `etcd_members`, this many on a
    /// local etcd cluster of that many members (one leads, the others stand by), each controller's
    /// connection to each etcd member through a proxy of its own.
    pub controllers: u32,
    /// Members of the local etcd cluster the controllers keep their state in (0: no etcd). Needs
    /// `etcd` on the PATH (Debian's `etcd-server`).
    pub etcd_members: u32,
    /// Seconds a leader that stopped renewing its etcd lease stays leader (`--lease-secs`).
    pub lease_secs: u64,
    /// Who carries out recoveries: `controller` (the controller restores, hands spare sidecars
    /// over and publishes where each sequence resumes; the harness starts replacements and feeds
    /// the pipeline from the recovery feed, as beside any engine), or `driver` (the harness step by
    /// step, each recovery's steps replayed through the simulated recovery machine).
    pub recoveries: RecoveredBy,
}

/// Who carries out a scenario's recoveries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RecoveredBy {
    /// The controller; the harness feeds the pipeline from its recovery feed.
    #[default]
    Controller,
    /// The harness's driver, step by step.
    Driver,
}

impl ClusterShape {
    /// Whether its controllers run on etcd.
    pub fn on_etcd(&self) -> bool {
        self.etcd_members > 0
    }
}

/// The transport between a scenario's sidecars.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Transport {
    /// TCP, through the fault-injecting proxies.
    #[default]
    Tcp,
    /// QUIC with mutual TLS on certificates the cluster generates.
    Quic,
}

impl Default for ClusterShape {
    fn default() -> Self {
        Self {
            stages: 4,
            heartbeat_ms: 100,
            deadline_ms: 300,
            device_caches: None,
            step_ms: 0.0,
            test_only_sabotage_replicas: false,
            spares: 0,
            spill_memory_bytes: None,
            spill_dir_bytes: 4 << 20,
            prompt_stages: None,
            prompt_slots: 8,
            transport: Transport::Tcp,
            namespaces: false,
            controllers: 1,
            etcd_members: 0,
            lease_secs: 2,
            recoveries: RecoveredBy::Controller,
        }
    }
}

/// The requests.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkloadShape {
    /// Requests (4 per microbatch).
    pub requests: u32,
    /// Prompt tokens per request (the fewest, with `prompt_tokens_max`).
    pub prompt_tokens: u32,
    /// With it, each prompt's length is drawn from the seed, from `prompt_tokens` to this.
    pub prompt_tokens_max: Option<u32>,
    /// Tokens generated per request.
    pub new_tokens: u32,
    /// Seats (slots of microbatches, 4 per microbatch) the requests take turns in: a request
    /// starts once the one before it in its seat has finished, so later requests reuse the slots
    /// of earlier ones. Without it, each request has a seat of its own.
    pub seats: Option<u32>,
}

impl Default for WorkloadShape {
    fn default() -> Self {
        Self { requests: 4, prompt_tokens: 16, prompt_tokens_max: None, new_tokens: 32, seats: None }
    }
}

/// What a fault does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// SIGKILL a stage's engine; its sidecar keeps the local copy of its KV.
    KillEngine,
    /// SIGKILL a stage's engine and sidecar; its KV comes back from its successor's sidecar.
    KillWorker,
    /// SIGKILL a stage's sidecar alone: its engine computes no more steps once a copy finds the
    /// sidecar gone, and the controller fences the whole worker, which is replaced as a dead one.
    KillSidecar,
    /// SIGKILL the workers of a stage and of its ring successor together: the first's copies die
    /// with the second, so the ring cannot restore it and its sequences are recomputed.
    KillAdjacent,
    /// SIGSTOP a stage's engine for `duration_ms`, then SIGCONT (longer than the heartbeat timeout:
    /// declared dead, fenced and replaced).
    PauseEngine,
    /// SIGSTOP a stage's sidecar for `duration_ms`, then SIGCONT: shorter than the heartbeat
    /// timeout it is a slow sidecar (its engine and its predecessor wait for it), longer it is
    /// declared dead and its whole worker fenced and replaced.
    PauseSidecar,
    /// SIGSTOP a stage's engine for `duration_ms` (longer than the heartbeat timeout), and have the
    /// recovery fence and replace it without killing it: it comes back, stale, while its
    /// replacement runs, and must be kept out (heartbeats ignored, connections and KV copies
    /// refused by epoch).
    StaleRejoin,
    /// The same for a stage's sidecar: stopped past the heartbeat timeout, its whole worker is
    /// fenced and replaced but left running; when the sidecar comes back, its heartbeats are
    /// ignored and the copies it forwards are refused by the successor's sidecar (an older epoch
    /// of that stage than its replacement's).
    StaleSidecar,
    /// Add `delay_ms` plus up to `jitter_ms` to every write on a link, for `duration_ms`.
    Delay,
    /// Limit a link to `bytes_per_s`, for `duration_ms`.
    Bandwidth,
    /// Hold all bytes on a link in both directions for `duration_ms` (a two-way partition, or a
    /// stall).
    Partition,
    /// Hold the bytes going towards the link's target for `duration_ms` (one-way).
    OneWayPartition,
    /// Close every connection on a link at once.
    Reset,
    /// Flip one byte in the next write on a link (below the framing layer).
    Corrupt,
    /// Forward half of the next write on a link, then close the connection.
    Truncate,
    /// Fill a stage's sidecar's spill directory for `duration_ms` (another file takes all the room
    /// its cap allows): its spills fail meanwhile and its chunks stay in memory, so nothing is
    /// lost. Needs `cluster.spill_memory_bytes`.
    FillSpill,
    /// SIGKILL the controller; the cluster starts another on the same state file when it next
    /// needs it. With controllers on etcd: the leader, whom a controller standing by succeeds.
    KillController,
    /// SIGSTOP the controller for `duration_ms`, then SIGCONT (longer than the time it has to
    /// answer, and asked something meanwhile: killed and replaced). With controllers on etcd: the
    /// leader; past its lease, another takes the lead, and the old one must not act once resumed
    /// (its writes fail, and it stops).
    PauseController,
    /// SIGKILL the controller in the middle of the next recovery, right after it fenced the dead
    /// (with controllers on etcd, the leader: its successor finishes the recovery).
    KillControllerInRecovery,
    /// Cut the leading controller off from etcd for `duration_ms` (its connections to every etcd
    /// member stall both ways), while members and the cluster still reach it: it cannot renew
    /// its lease, so it must stop leading, and another takes the lead. Needs controllers on etcd.
    CutLeaderFromEtcd,
    /// SIGKILL one etcd member (the first still alive): the others keep a quorum, and the
    /// controllers go on through them. Needs controllers on etcd, and no more of these than a
    /// quorum allows.
    KillEtcdMember,
    /// SIGKILL a stage's worker in the middle of the next recovery of other stages, once their
    /// replacements are up and before they restore: a second failure during a recovery.
    KillWorkerInRecovery,
}

impl FaultKind {
    /// Every kind, in report order.
    pub const ALL: [FaultKind; 22] = [
        FaultKind::KillEngine,
        FaultKind::KillWorker,
        FaultKind::KillSidecar,
        FaultKind::KillAdjacent,
        FaultKind::PauseEngine,
        FaultKind::PauseSidecar,
        FaultKind::StaleRejoin,
        FaultKind::StaleSidecar,
        FaultKind::Delay,
        FaultKind::Bandwidth,
        FaultKind::Partition,
        FaultKind::OneWayPartition,
        FaultKind::Reset,
        FaultKind::Corrupt,
        FaultKind::Truncate,
        FaultKind::FillSpill,
        FaultKind::KillController,
        FaultKind::PauseController,
        FaultKind::KillControllerInRecovery,
        FaultKind::KillWorkerInRecovery,
        FaultKind::CutLeaderFromEtcd,
        FaultKind::KillEtcdMember,
    ];

    /// Whether it acts on a stage's processes.
    pub fn is_process_fault(self) -> bool {
        matches!(
            self,
            FaultKind::KillEngine
                | FaultKind::KillWorker
                | FaultKind::KillSidecar
                | FaultKind::KillAdjacent
                | FaultKind::PauseEngine
                | FaultKind::PauseSidecar
                | FaultKind::StaleRejoin
                | FaultKind::StaleSidecar
                | FaultKind::KillWorkerInRecovery
        )
    }

    /// Whether it acts on the control plane: the controllers, or the etcd they keep their state
    /// in.
    pub fn is_controller_fault(self) -> bool {
        matches!(
            self,
            FaultKind::KillController
                | FaultKind::PauseController
                | FaultKind::KillControllerInRecovery
                | FaultKind::CutLeaderFromEtcd
                | FaultKind::KillEtcdMember
        )
    }

    /// Whether it needs controllers on etcd.
    pub fn needs_etcd(self) -> bool {
        matches!(self, FaultKind::CutLeaderFromEtcd | FaultKind::KillEtcdMember)
    }

    /// Whether it acts on a sidecar's storage.
    pub fn is_storage_fault(self) -> bool {
        self == FaultKind::FillSpill
    }

    /// Whether it acts on a link (neither a stage's processes, nor its storage, nor the
    /// controller).
    pub fn is_network_fault(self) -> bool {
        !self.is_process_fault() && !self.is_storage_fault() && !self.is_controller_fault()
    }

    /// Its name in scenarios and reports.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::KillEngine => "kill-engine",
            FaultKind::KillWorker => "kill-worker",
            FaultKind::KillSidecar => "kill-sidecar",
            FaultKind::KillAdjacent => "kill-adjacent",
            FaultKind::PauseEngine => "pause-engine",
            FaultKind::PauseSidecar => "pause-sidecar",
            FaultKind::StaleRejoin => "stale-rejoin",
            FaultKind::StaleSidecar => "stale-sidecar",
            FaultKind::Delay => "delay",
            FaultKind::Bandwidth => "bandwidth",
            FaultKind::Partition => "partition",
            FaultKind::OneWayPartition => "one-way-partition",
            FaultKind::Reset => "reset",
            FaultKind::Corrupt => "corrupt",
            FaultKind::Truncate => "truncate",
            FaultKind::FillSpill => "fill-spill",
            FaultKind::KillController => "kill-controller",
            FaultKind::PauseController => "pause-controller",
            FaultKind::KillControllerInRecovery => "kill-controller-in-recovery",
            FaultKind::KillWorkerInRecovery => "kill-worker-in-recovery",
            FaultKind::CutLeaderFromEtcd => "cut-leader-from-etcd",
            FaultKind::KillEtcdMember => "kill-etcd-member",
        }
    }
}

/// Which link of a stage a network fault acts on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LinkKind {
    /// Activations from the stage to the next one (from the last stage: its replies to the
    /// driver).
    #[default]
    Activation,
    /// KV copies from the stage to its ring successor's sidecar.
    Replica,
    /// Requests from the driver into stage 0 (its `stage` is 0).
    Input,
}

/// One fault.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    /// The step it comes before (counted from 0 over every step the driver sends, repeated ones
    /// included).
    pub at_step: u64,
    /// What it does.
    pub kind: FaultKind,
    /// The stage it hits (for a network fault, the sending end of the link); required, except
    /// for a controller fault, which has none.
    #[serde(default)]
    pub stage: Option<u32>,
    /// For a network fault: which of the stage's links.
    #[serde(default)]
    pub link: LinkKind,
    /// How long a pause, delay, bandwidth limit or partition lasts.
    #[serde(default = "defaults::duration_ms")]
    pub duration_ms: u64,
    /// Added delay per write.
    #[serde(default = "defaults::delay_ms")]
    pub delay_ms: u64,
    /// Up to this much more delay, drawn per write.
    #[serde(default = "defaults::jitter_ms")]
    pub jitter_ms: u64,
    /// Bandwidth limit.
    #[serde(default = "defaults::bytes_per_s")]
    pub bytes_per_s: u64,
}

impl Fault {
    /// The stage it hits (0 for a controller fault, which hits none).
    pub fn stage(&self) -> u32 {
        self.stage.unwrap_or(0)
    }
}

/// Faults drawn from the seed: before each step, one with probability `rate`, of a kind drawn from
/// `kinds`, on a stage (and link) drawn uniformly.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandomFaults {
    /// Probability of a fault before each step.
    pub rate: f64,
    /// The kinds to draw from.
    pub kinds: Vec<FaultKind>,
    /// Steps at least between two process faults (each costs a recovery).
    #[serde(default = "defaults::min_gap_steps")]
    pub min_gap_steps: u64,
    /// Duration of timed faults.
    #[serde(default = "defaults::duration_ms")]
    pub duration_ms: u64,
}

/// What the checkers hold a run to.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Steps one recovery may recompute at most: the replication lag the stages allow (the
    /// streamer's queue of 64 plus the job in flight) plus the interrupted step.
    pub max_recompute: u64,
    /// Milliseconds from the failed step to the dead stage named.
    pub max_detection_ms: u64,
    /// Milliseconds from detection to the interrupted step done again.
    pub max_recovery_ms: u64,
    /// Failed attempts at one step with no stage dead before the run counts as stuck.
    pub retries: u32,
    /// Whether to also run the faults with restart-from-scratch instead of recovery, for the
    /// slowdown comparison.
    pub restart_baseline: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_recompute: 66,
            max_detection_ms: 2_000,
            max_recovery_ms: 10_000,
            retries: 8,
            restart_baseline: true,
        }
    }
}

/// The longest time any setting may name, in milliseconds (ten minutes).
const MAX_MS: u64 = 600_000;

mod defaults {
    pub fn seed() -> u64 {
        1
    }
    pub fn duration_ms() -> u64 {
        400
    }
    pub fn delay_ms() -> u64 {
        5
    }
    pub fn jitter_ms() -> u64 {
        5
    }
    pub fn bytes_per_s() -> u64 {
        1 << 20
    }
    pub fn min_gap_steps() -> u64 {
        10
    }
}

impl Scenario {
    /// Reads and checks a scenario file.
    pub fn load(path: &Path) -> Result<Self, ScenarioError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ScenarioError(format!("cannot read {}: {e}", path.display())))?;
        Self::parse(&text).map_err(|e| ScenarioError(format!("{}: {e}", path.display())))
    }

    /// Parses and checks a scenario.
    pub fn parse(text: &str) -> Result<Self, ScenarioError> {
        let scenario: Scenario = toml::from_str(text).map_err(|e| ScenarioError(e.message().to_owned()))?;
        scenario.validate()?;
        Ok(scenario)
    }

    /// Checks ranges and that every fault names a stage and link that exist.
    pub fn validate(&self) -> Result<(), ScenarioError> {
        let fail = |why: String| Err(ScenarioError(why));
        let c = &self.cluster;
        if !(2..=8).contains(&c.stages) {
            return fail(format!("cluster.stages must be 2..=8, not {}", c.stages));
        }
        if c.device_caches == Some(0) {
            return fail("cluster.device_caches must be at least 1".into());
        }
        if let Some(p) = c.prompt_stages {
            if !(1..=8).contains(&p) {
                return fail(format!("cluster.prompt_stages must be 1..=8, not {p}"));
            }
            let r = self.workload.requests;
            if self.workload.seats.is_some_and(|seats| seats < r) {
                return fail("a prompt pipeline needs a seat per request: no workload.seats".into());
            }
            if c.prompt_slots == 0 || r % c.prompt_slots != 0 || r % 4 != 0 {
                return fail(format!(
                    "a prompt pipeline needs workload.requests ({r}) to fill whole microbatches of \
                     cluster.prompt_slots ({}) and of 4",
                    c.prompt_slots
                ));
            }
        }
        if !(1..=MAX_MS).contains(&c.heartbeat_ms) || !(1..=MAX_MS).contains(&c.deadline_ms) {
            return fail(format!("cluster.heartbeat_ms and cluster.deadline_ms must be 1..={MAX_MS}"));
        }
        if !(0.0..=MAX_MS as f64).contains(&c.step_ms) {
            return fail(format!("cluster.step_ms must be 0..={MAX_MS}"));
        }
        let w = &self.workload;
        if w.requests == 0 || w.prompt_tokens == 0 || w.new_tokens < 2 {
            return fail(
                "workload: requests and prompt_tokens must be positive, new_tokens at least 2".into(),
            );
        }
        if w.prompt_tokens_max.is_some_and(|max| max < w.prompt_tokens) {
            return fail("workload.prompt_tokens_max must be at least workload.prompt_tokens".into());
        }
        if w.seats == Some(0) {
            return fail("workload.seats must be at least 1".into());
        }
        if c.controllers == 0 || c.controllers > 8 || c.etcd_members > 7 {
            return fail("cluster.controllers must be 1..=8, cluster.etcd_members 0..=7".into());
        }
        if c.controllers > 1 && !c.on_etcd() {
            return fail("several controllers keep their state in etcd: set cluster.etcd_members".into());
        }
        if c.on_etcd() && !(1..=60).contains(&c.lease_secs) {
            return fail("cluster.lease_secs must be 1..=60".into());
        }
        // A quorum of etcd members must outlive the kills.
        let etcd_kills = self.faults.iter().filter(|f| f.kind == FaultKind::KillEtcdMember).count() as u32;
        if c.on_etcd() && etcd_kills > (c.etcd_members - 1) / 2 {
            return fail(format!(
                "{etcd_kills} kill-etcd-member faults leave {} etcd members no quorum",
                c.etcd_members
            ));
        }
        for f in &self.faults {
            self.check_fault(f).or_else(|why| fail(format!("fault at step {}: {why}", f.at_step)))?;
        }
        if let Some(r) = &self.random {
            if !(0.0..=1.0).contains(&r.rate) {
                return fail(format!("random.rate must be in 0..=1, not {}", r.rate));
            }
            if r.kinds.is_empty() {
                return fail("random.kinds is empty".into());
            }
            if let Some(kind) = r.kinds.iter().find(|k| k.needs_etcd()) {
                return fail(format!("{} is scheduled ([[fault]]), not drawn", kind.name()));
            }
            if !(1..=MAX_MS).contains(&r.duration_ms) {
                return fail(format!("random.duration_ms must be 1..={MAX_MS}"));
            }
        }
        Ok(())
    }

    fn check_fault(&self, fault: &Fault) -> Result<(), String> {
        let stages = self.cluster.stages;
        match (fault.kind.is_controller_fault(), fault.stage) {
            (true, Some(_)) => return Err(format!("{} acts on no stage: drop `stage`", fault.kind.name())),
            (false, None) => return Err(format!("{} needs a `stage`", fault.kind.name())),
            (false, Some(stage)) if stage >= stages => {
                return Err(format!("stage {stage} is not one of {stages}"))
            }
            _ => {}
        }
        if fault.kind.needs_etcd() && !self.cluster.on_etcd() {
            return Err(format!("{} needs controllers on etcd: set cluster.etcd_members", fault.kind.name()));
        }
        if fault.kind == FaultKind::FillSpill && self.cluster.spill_memory_bytes.is_none() {
            return Err("fill-spill needs sidecars that spill: set cluster.spill_memory_bytes".into());
        }
        let timed = matches!(
            fault.kind,
            FaultKind::FillSpill
                | FaultKind::PauseEngine
                | FaultKind::PauseSidecar
                | FaultKind::StaleRejoin
                | FaultKind::StaleSidecar
                | FaultKind::PauseController
                | FaultKind::CutLeaderFromEtcd
                | FaultKind::Delay
                | FaultKind::Bandwidth
                | FaultKind::Partition
                | FaultKind::OneWayPartition
        );
        if timed && fault.duration_ms == 0 {
            return Err(format!("{} needs a positive duration_ms", fault.kind.name()));
        }
        for (name, ms) in
            [("duration_ms", fault.duration_ms), ("delay_ms", fault.delay_ms), ("jitter_ms", fault.jitter_ms)]
        {
            if ms > MAX_MS {
                return Err(format!("{name} must be at most {MAX_MS}"));
            }
        }
        if fault.kind == FaultKind::Bandwidth && fault.bytes_per_s == 0 {
            return Err("bandwidth needs a positive bytes_per_s".into());
        }
        if fault.kind.is_network_fault()
            && fault.link == LinkKind::Replica
            && self.cluster.transport == Transport::Quic
        {
            return Err(format!(
                "{} on a replica link needs transport = \"tcp\" (the proxies carry TCP)",
                fault.kind.name()
            ));
        }
        if fault.kind.is_network_fault() && fault.link == LinkKind::Input && fault.stage() != 0 {
            return Err(format!("the input link feeds stage 0, not stage {}", fault.stage()));
        }
        Ok(())
    }
}
