//! What a cluster runs ([`ClusterConfig`]) and where each of its processes runs.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use dejavulib::affinity::CpuList;

use super::{certs_in, ClusterError, TransportKind, START};
use crate::handoff::Shapes;
use crate::netns::{Fabric, Host};
use crate::proc::{spawn_on, SpawnError, Spawned};
use crate::process::EngineCommand;
use dejavu_engine::pipeline::CacheLayout;

/// A connection between the processes of a cluster that something (a fault-injecting proxy) may be
/// put on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Link {
    /// Requests from the driver to stage 0.
    Input,
    /// Activations from stage `from` to stage `from + 1`, or from the last stage back to the
    /// driver.
    Activation {
        /// The sending stage.
        from: u32,
    },
    /// KV copies of stage `from` to its ring successor's sidecar: forwarded by its own sidecar,
    /// copied by the stage itself in a recovery, and the restore from there after a replacement.
    Replica {
        /// The sending stage.
        from: u32,
    },
    /// Controller `controller`'s connection to etcd member `member`, with controllers on etcd
    /// ([`ControlPlane::Etcd`]).
    Etcd {
        /// The controller, in the order they were first started.
        controller: u32,
        /// The etcd member, in the order of [`EtcdControllers::endpoints`].
        member: u32,
    },
}

/// Which controllers a cluster runs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ControlPlane {
    /// One controller with a state file (`dejavud controller --state`), replaced on the same port
    /// and file when it dies or stops answering.
    #[default]
    Embedded,
    /// Several controllers on an etcd cluster (`dejavud controller --etcd`): one leads, the others
    /// stand by, and one that exits is started again as a supervisor would.
    Etcd(EtcdControllers),
}

/// Controllers on an etcd cluster that someone else runs (a test's or the chaos harness's
/// [`crate::etcd_cluster::EtcdCluster`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdControllers {
    /// The etcd members' client addresses (plain `http`).
    pub endpoints: Vec<SocketAddr>,
    /// Controllers to run.
    pub controllers: u32,
    /// Their lease's time to live, in whole seconds (`--lease-secs`).
    pub lease_secs: u64,
}

/// Says which address a process is given for a link: the target's own, or one in front of it.
pub trait Interpose: Send + Sync + std::fmt::Debug {
    /// The address to connect to for `link` to reach `target`.
    fn route(&self, link: Link, target: SocketAddr) -> SocketAddr;
}

/// What a cluster runs.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// The executable with the `stage` and `sidecar` subcommands.
    pub exe: PathBuf,
    /// Layers of each stage.
    pub splits: Vec<Range<u32>>,
    /// Sequences per microbatch.
    pub slots: u32,
    /// Microbatches.
    pub microbatches: u32,
    /// KV caches each stage keeps in "device" memory, if fewer than microbatches (swapping).
    pub device_caches: Option<u32>,
    /// Tokens per sequence at most.
    pub max_tokens: u32,
    /// Time each stage's step takes on top of the reference model's arithmetic (`dejavud stage
    /// --step-ms`): a real model's per-step compute, where recovery and restart compare.
    pub step_time: Duration,
    /// Whether stages keep copies of their KV in sidecars.
    pub replicate: bool,
    /// Time a step may take before the driver looks for a dead stage.
    pub deadline: Duration,
    /// Time between heartbeats; a process silent for three is dead.
    pub heartbeat: Duration,
    /// What stands between processes, if anything (see [`Link`]).
    pub interpose: Option<Arc<dyn Interpose>>,
    /// For testing fault checkers only: sidecars skip the forward to their successor's sidecar
    /// while still claiming to replicate, so a worker failure loses KV the recovery expects.
    pub sabotage_replicas: bool,
    /// The stages' KV cache layout.
    pub layout: CacheLayout,
    /// The transport between sidecars, and from stages to sidecars. With QUIC, the cluster
    /// generates its certificates, and the [`Link::Replica`] links are not interposed (the
    /// interposer sees TCP).
    pub transport: TransportKind,
    /// Spare workers kept started (a stage process and a sidecar each, heartbeating to the
    /// controller as spares): a recovery makes them the dead stages' instead of starting new
    /// processes, and new spares start in the background.
    pub spares: u32,
    /// Sidecars keep at most this many bytes of chunks in memory and spill the rest to a
    /// directory of their own, capped in size (see [`SpillLimits`]); by default all in memory.
    pub spill: Option<SpillLimits>,
    /// A prompt pipeline of its own that computes the prompts, if any (prompt-token
    /// disaggregation); the stages above are then the token pipeline.
    pub disaggregation: Option<Disaggregation>,
    /// Network namespaces, if given: each worker (stage `i` and its sidecar, also their
    /// replacements), each prompt stage and each spare process runs in a host of its own on this
    /// fabric, at its own address; the controller, the driver and the interposer stay on the
    /// fabric's gateway. By default everything is on loopback.
    pub fabric: Option<Arc<Fabric>>,
    /// CPUs for the stages' compute and for replication, if set apart; by default every process
    /// runs on any CPU.
    pub cpus: Option<CpuSplit>,
    /// Where the controller (and each controller that replaces it) appends the journal of its
    /// liveness machine, if anywhere (`dejavud controller --journal`); one controller only, not
    /// with [`ControlPlane::Etcd`].
    pub journal: Option<PathBuf>,
    /// One controller with a state file (the default), or several on etcd.
    pub control_plane: ControlPlane,
    /// Who carries out recoveries.
    pub recoveries: Recoveries,
    /// An engine process each stage runs instead of the reference model (`dejavud stage --
    /// ENGINE...`), such as the PyTorch engine (spare stages start theirs ahead), the prompt
    /// pipeline's stages too.
    pub engine: Option<EngineCommand>,
}

/// Who carries out a cluster's recoveries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recoveries {
    /// The cluster, step by step as [`dejavu_proto::recovery::Recovery`] decides: it has the
    /// controller fence and re-seed, and restores the replaced stages from wherever their copies
    /// live. Its steps replay through the simulated machine, and faults can be injected between
    /// them ([`super::RecoveryHooks`]).
    #[default]
    Driven,
    /// The controller, as beside any engine (`dejavud controller --stages`): it fences, hands
    /// spare sidecars over and restores replaced sidecars; the cluster starts the replacements a
    /// supervisor would and, as whoever feeds the pipeline, resumes each sequence where the
    /// recovery feed says ([`dejavulib::net::controller::RecoveryFeed`]).
    ByController,
}

/// CPUs set apart for computing and for copying KV: the stages run on `compute` but for their
/// streamer threads, which run on `replication` with the sidecars. A spare stage moves to them
/// when assigned (its threads from before, heartbeats and the like, stay where they were).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuSplit {
    /// The stage processes' CPUs.
    pub compute: CpuList,
    /// The streamer threads' and the sidecar processes' CPUs.
    pub replication: CpuList,
}

/// Where a process of the cluster runs: its address, and its host when there is a fabric.
pub(super) struct Place {
    pub(super) ip: IpAddr,
    pub(super) host: Option<Arc<Host>>,
}

impl Place {
    /// Starts `exe args` here (see [`spawn_on`]).
    pub(super) fn spawn(&self, exe: &Path, args: &[String], what: &str) -> Result<Spawned, SpawnError> {
        spawn_on(self.host.as_ref(), exe, args, what, START)
    }
}

/// How much a sidecar keeps in memory before it spills to its directory, and how much that
/// directory holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpillLimits {
    /// Bytes of chunks in memory.
    pub memory_bytes: u64,
    /// Bytes the spill directory may hold (a spill beyond it fails as on a full disk, and the
    /// chunk stays in memory).
    pub dir_bytes: u64,
}

/// A prompt pipeline beside the cluster's (token) pipeline: its stages compute each prompt and
/// hand its KV over to the token stages' sidecars, from which the token stages load it
/// ([`crate::handoff`]). It keeps no copies and the controller does not watch it: a prompt it
/// fails to hand over is computed by the token pipeline instead.
#[derive(Clone, Debug)]
pub struct Disaggregation {
    /// Layers of each prompt stage.
    pub splits: Vec<Range<u32>>,
    /// Sequences per prompt microbatch (the requests must fill whole microbatches).
    pub slots: u32,
}

impl ClusterConfig {
    /// One replicated stage of the whole reference model, 4 slots in one microbatch, started from
    /// `exe`; the fields are public for the rest.
    pub fn new(exe: PathBuf) -> Self {
        Self {
            exe,
            splits: std::iter::once(0..dejavu_engine::ModelConfig::reference().layers).collect(),
            slots: 4,
            microbatches: 1,
            device_caches: None,
            max_tokens: 256,
            step_time: Duration::ZERO,
            replicate: true,
            deadline: Duration::from_millis(300),
            heartbeat: Duration::from_millis(100),
            interpose: None,
            sabotage_replicas: false,
            layout: CacheLayout::FasterTransformer,
            transport: TransportKind::Tcp,
            spares: 0,
            spill: None,
            disaggregation: None,
            fabric: None,
            cpus: None,
            journal: None,
            control_plane: ControlPlane::Embedded,
            recoveries: Recoveries::Driven,
            engine: None,
        }
    }

    /// The address of the cluster's own side (the controller's, the driver's, an interposer's):
    /// loopback, or the fabric's gateway.
    pub fn gateway(&self) -> IpAddr {
        self.fabric.as_ref().map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |f| f.gateway())
    }

    /// Where the process(es) called `host` run: on loopback, or on that host of the fabric.
    pub(super) fn place(&self, host: &str) -> Result<Place, ClusterError> {
        Ok(match &self.fabric {
            None => Place { ip: IpAddr::V4(Ipv4Addr::LOCALHOST), host: None },
            Some(fabric) => {
                let host = fabric.host(host)?;
                Place { ip: host.ip(), host: Some(host) }
            }
        })
    }

    /// The shapes of the prompt and token pipelines, when disaggregated.
    pub(super) fn shapes(&self) -> Option<Shapes> {
        self.disaggregation.as_ref().map(|d| Shapes {
            prompt: d.splits.clone(),
            prompt_slots: d.slots,
            token: self.splits.clone(),
            token_slots: self.slots,
            requests: self.slots * self.microbatches,
        })
    }

    /// The address to give a process for `link` to reach `target`.
    pub(super) fn route(&self, link: Link, target: SocketAddr) -> SocketAddr {
        if self.transport == TransportKind::Quic && matches!(link, Link::Replica { .. }) {
            return target;
        }
        self.interpose.as_ref().map_or(target, |i| i.route(link, target))
    }

    /// The flag that gives a stage its extra time per step, if any.
    pub(super) fn step_args(&self) -> Option<String> {
        (!self.step_time.is_zero()).then(|| format!("--step-ms={}", self.step_time.as_secs_f64() * 1e3))
    }

    /// The flags that give a stage or sidecar the cluster's transport (certificates in `dir`).
    pub(super) fn transport_args(&self, dir: &Path) -> Vec<String> {
        match self.transport {
            TransportKind::Tcp => Vec::new(),
            TransportKind::Quic => {
                vec!["--transport=quic".to_owned(), format!("--certs={}", certs_in(dir).display())]
            }
        }
    }
}
