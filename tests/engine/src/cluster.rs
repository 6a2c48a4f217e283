//! A pipeline of stage and sidecar processes on loopback (or each worker in a network namespace
//! of its own, see [`crate::netns`]), started from an executable that has the
//! `stage`, `sidecar` and `controller` subcommands of [`crate::cli`] (`dejavu-engine` or
//! `dejavud`), the controller process that says which of them died, and the recovery procedure
//! that replaces a dead worker. The demo, the chaos harness and the process tests share it.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dejavulib::affinity::CpuList;
use thiserror::Error;

mod spares;

use crate::controller::{Census, ControllerClient, ControllerError, Member};
use crate::handoff::Shapes;
pub use crate::heartbeat::Role;
use crate::netns::{Fabric, Host, NetnsError};
use crate::pipeline::{CacheLayout, Seat};
use crate::proc::{spawn, spawn_on, Spawned};
pub use crate::proc::{Proc, SpawnError};
use crate::process::{ProcessError, RemotePipeline, RestoreSource, StepReply};
pub use crate::transport::TransportKind;
use dejavu_proto::plan::{Loss, Reseed, Source};

/// What dies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kill {
    /// The engine process alone: its sidecar lives on with the local copy of its KV.
    Engine,
    /// The whole worker, engine and sidecar: its KV comes back from its ring successor's sidecar.
    Worker,
}

/// Errors of starting or repairing a cluster.
#[derive(Debug, Error)]
pub enum ClusterError {
    /// A process did not start.
    #[error(transparent)]
    Spawn(#[from] SpawnError),
    /// The controller failed, and so did its replacement.
    #[error(transparent)]
    Controller(#[from] ControllerError),
    /// The chain failed in a way recovery does not cover.
    #[error(transparent)]
    Pipeline(#[from] ProcessError),
    /// A worker's network namespace could not be made.
    #[error(transparent)]
    Netns(#[from] NetnsError),
    /// A local operation failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The cluster cannot do what was asked.
    #[error("{0}")]
    Invalid(String),
}

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
struct Place {
    ip: IpAddr,
    host: Option<Arc<Host>>,
}

impl Place {
    /// Starts `exe args` here (see [`spawn_on`]).
    fn spawn(&self, exe: &Path, args: &[String], what: &str) -> Result<Spawned, SpawnError> {
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

/// The prompt pipeline's processes and the driver's end of it.
struct PromptPipeline {
    stages: Vec<Spawned>,
    remote: RemotePipeline,
    shapes: Shapes,
    /// Prompts the token pipeline computed because the handoff failed.
    fallbacks: u64,
    /// Whether a step failed there: nothing repairs it, so it is not asked again (each try would
    /// cost a deadline).
    broken: bool,
}

impl ClusterConfig {
    /// One replicated stage of the whole reference model, 4 slots in one microbatch, started from
    /// `exe`; the fields are public for the rest.
    pub fn new(exe: PathBuf) -> Self {
        Self {
            exe,
            splits: std::iter::once(0..crate::ModelConfig::reference().layers).collect(),
            slots: 4,
            microbatches: 1,
            device_caches: None,
            max_tokens: 256,
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
        }
    }

    /// The address of the cluster's own side (the controller's, the driver's, an interposer's):
    /// loopback, or the fabric's gateway.
    pub fn gateway(&self) -> IpAddr {
        self.fabric.as_ref().map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |f| f.gateway())
    }

    /// Where the process(es) called `host` run: on loopback, or on that host of the fabric.
    fn place(&self, host: &str) -> Result<Place, ClusterError> {
        Ok(match &self.fabric {
            None => Place { ip: IpAddr::V4(Ipv4Addr::LOCALHOST), host: None },
            Some(fabric) => {
                let host = fabric.host(host)?;
                Place { ip: host.ip(), host: Some(host) }
            }
        })
    }

    /// The shapes of the prompt and token pipelines, when disaggregated.
    fn shapes(&self) -> Option<Shapes> {
        self.disaggregation.as_ref().map(|d| Shapes {
            prompt: d.splits.clone(),
            prompt_slots: d.slots,
            token: self.splits.clone(),
            token_slots: self.slots,
            requests: self.slots * self.microbatches,
        })
    }

    /// The address to give a process for `link` to reach `target`.
    fn route(&self, link: Link, target: SocketAddr) -> SocketAddr {
        if self.transport == TransportKind::Quic && matches!(link, Link::Replica { .. }) {
            return target;
        }
        self.interpose.as_ref().map_or(target, |i| i.route(link, target))
    }

    /// The flags that give a stage or sidecar the cluster's transport (certificates in `dir`).
    fn transport_args(&self, dir: &Path) -> Vec<String> {
        match self.transport {
            TransportKind::Tcp => Vec::new(),
            TransportKind::Quic => {
                vec!["--transport=quic".to_owned(), format!("--certs={}", certs_in(dir).display())]
            }
        }
    }
}

/// One sequence as the driver knows it.
#[derive(Clone, Copy, Debug)]
pub struct Sequence<'a> {
    /// Where it lives.
    pub seat: Seat,
    /// Its prompt.
    pub prompt: &'a [u32],
    /// The tokens generated so far.
    pub generated: &'a [u32],
}

/// The controller process and the cluster's connection to it. A controller that dies or stops
/// answering is replaced on the same port with the same state file, and goes on where it stopped.
struct Supervised {
    proc: Proc,
    metrics: Option<SocketAddr>,
    client: ControllerClient,
    args: Vec<String>,
    restarts: u64,
    /// Whether to kill the controller in the middle of the next recovery.
    crash_in_recovery: bool,
}

/// A directory of the cluster's own, in shared memory (`/dev/shm`) where there is one, else under
/// the system's temporary directory, removed when dropped: the controller's state file, the
/// sidecars' local sockets and the memory regions they share with their engines.
struct StateDir(PathBuf);

impl StateDir {
    fn create() -> std::io::Result<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!("dejavu-cluster-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let shm = std::path::Path::new("/dev/shm");
        let base = if shm.is_dir() { shm.to_owned() } else { std::env::temp_dir() };
        let dir = base.join(name);
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }
}

/// The cluster's certificates, for QUIC, in its state directory `dir`.
fn certs_in(dir: &Path) -> PathBuf {
    dir.join("certs")
}

impl std::ops::Deref for StateDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl StateDir {
    /// Generates the cluster's authority and the one certificate every process presents (each
    /// process checks only that a peer's is the cluster's).
    fn issue_certs(&self) -> Result<(), ClusterError> {
        let failed =
            |e: dejavulib::net::PeerError| ClusterError::Invalid(format!("cluster certificates: {e}"));
        let ca = dejavulib::net::tls::ClusterCa::generate("dejavu-reference").map_err(failed)?;
        ca.issue("member").map_err(failed)?.save(&certs_in(self), "member").map_err(failed)
    }
}

impl Drop for StateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running pipeline: stage processes, their sidecars (when replicating), the controller and the
/// driver's end.
pub struct Cluster {
    config: ClusterConfig,
    /// One per stage; stage `k` keeps its local copy in sidecar `k`, which forwards it to `k + 1`.
    sidecars: Vec<Spawned>,
    /// Each sidecar's local socket.
    sockets: Vec<PathBuf>,
    /// Sidecars started so far (each gets a local socket of its own).
    sidecar_starts: u64,
    stages: Vec<Spawned>,
    driver: SocketAddr,
    controller: Supervised,
    /// Whether the next recovery leaves the processes it fences running (see
    /// [`Cluster::spare_presumed_dead_in_next_recovery`]).
    spare_presumed_dead: bool,
    /// Fenced processes left running; killed with the cluster.
    spared: Vec<Spawned>,
    /// The driver's end of the chain.
    pub remote: RemotePipeline,
    /// The prompt pipeline, when disaggregated.
    prompt: Option<PromptPipeline>,
    /// Spare workers.
    spares: spares::SparePool,
    /// Holds the controller's state, the local sockets and the shared regions; removed last, once
    /// every process is gone.
    dir: StateDir,
}

/// Time a process has to start listening.
const START: Duration = Duration::from_secs(30);

/// The cluster secret the driver proves: it starts every process without `--secret`, so they all
/// share the default one.
const SECRET: &[u8] = crate::cli::DEFAULT_SECRET.as_bytes();

/// How long the controller may take to carry out its part of a recovery (re-seeds move KV).
const RECOVERY_PATIENCE: Duration = Duration::from_secs(30);

impl Cluster {
    /// Starts the controller, sidecars (when replicating), then the stages last first (so each
    /// knows where to send), and connects to them.
    pub fn start(config: ClusterConfig) -> Result<Self, ClusterError> {
        let n = config.splits.len();
        let dir = StateDir::create()?;
        if config.transport == TransportKind::Quic {
            dir.issue_certs()?;
        }
        let controller = Self::start_controller(&config, &dir)?;
        let heartbeat = controller.client.addr();
        let (mut sidecars, mut sockets) = (Vec::new(), Vec::new());
        if config.replicate {
            for i in 0..n {
                let socket = dir.join(format!("sidecar-{i}-{i}.sock"));
                let place = config.place(&worker_host(i))?;
                let who = SidecarOf::Stage(i, Start::First);
                let args = Self::sidecar_args(&config, heartbeat, who, &socket, &dir, place.ip);
                sidecars.push(place.spawn(&config.exe, &args, &format!("sidecar {i}"))?);
                sockets.push(socket);
            }
        }
        let results = TcpListener::bind((config.gateway(), 0))?;
        let driver = results.local_addr()?;
        let (mut stages, mut next) = (Vec::new(), driver);
        for index in (0..n).rev() {
            let copies = Self::copies(&sidecars, &sockets, index);
            let place = config.place(&worker_host(index))?;
            let args =
                Self::stage_args(&config, heartbeat, copies, (index, Start::First), next, &dir, place.ip);
            let stage = place.spawn(&config.exe, &args, &format!("stage {index}"))?;
            next = stage.addr;
            stages.push(stage);
        }
        stages.reverse();
        let first = config.route(Link::Input, next);
        let remote = RemotePipeline::connect(first, results, n as u32 - 1, config.deadline, SECRET)?;
        let prompt = Self::start_prompt_pipeline(&config, &sidecars, &dir)?;
        let mut cluster = Self {
            prompt,
            spares: spares::SparePool::default(),
            config,
            sidecar_starts: sidecars.len() as u64,
            sidecars,
            sockets,
            dir,
            stages,
            driver,
            controller,
            spare_presumed_dead: false,
            spared: Vec::new(),
            remote,
        };
        let spares = cluster.config.spares as u64;
        let sidecars = if cluster.config.replicate { spares } else { 0 };
        cluster.start_spares((spares, sidecars), true)?;
        // Every process beats before the cluster is up, so silence later means death.
        for index in 0..n {
            cluster.wait_alive((Role::Engine, index as u32))?;
            if cluster.config.replicate {
                cluster.wait_alive((Role::Sidecar, index as u32))?;
            }
        }
        Ok(cluster)
    }

    /// Starts the prompt pipeline, when disaggregated: its stages hand each prompt's KV over to
    /// `sidecars`, the token stages'.
    fn start_prompt_pipeline(
        config: &ClusterConfig,
        sidecars: &[Spawned],
        dir: &Path,
    ) -> Result<Option<PromptPipeline>, ClusterError> {
        let (Some(disaggregation), Some(shapes)) = (&config.disaggregation, config.shapes()) else {
            return Ok(None);
        };
        shapes.setups(crate::ModelConfig::reference().kv_spec()).map_err(ClusterError::Invalid)?;
        if sidecars.is_empty() {
            return Err(ClusterError::Invalid(
                "a token pipeline loads prompts from its sidecars: replicate".into(),
            ));
        }
        let results = TcpListener::bind((config.gateway(), 0))?;
        let (mut stages, mut next) = (Vec::new(), results.local_addr()?);
        let to: Vec<String> = sidecars.iter().map(|s| s.addr.to_string()).collect();
        for (index, layers) in disaggregation.splits.iter().enumerate().rev() {
            let place = config.place(&format!("prompt-{index}"))?;
            let mut args = vec![
                "stage".to_owned(),
                format!("--index={index}"),
                format!("--layers={}..{}", layers.start, layers.end),
                format!("--next={next}"),
                format!("--slots={}", disaggregation.slots),
                format!("--microbatches={}", shapes.requests / disaggregation.slots),
                format!("--max-tokens={}", config.max_tokens),
                format!("--listen={}", SocketAddr::new(place.ip, 0)),
                format!("--metrics={}", SocketAddr::new(place.ip, 0)),
                "--pipeline=prompt".to_owned(),
                format!("--handoff-to={}", to.join(",")),
            ];
            args.extend(Self::shape_args(&shapes));
            args.extend(config.transport_args(dir));
            let stage = place.spawn(&config.exe, &args, &format!("prompt stage {index}"))?;
            next = stage.addr;
            stages.push(stage);
        }
        stages.reverse();
        let last = disaggregation.splits.len() as u32 - 1;
        let remote = RemotePipeline::connect(next, results, last, config.deadline, SECRET)?;
        Ok(Some(PromptPipeline { stages, remote, shapes, fallbacks: 0, broken: false }))
    }

    /// The flags that give a stage both pipelines' shapes.
    fn shape_args(shapes: &Shapes) -> Vec<String> {
        let list = |splits: &[Range<u32>]| {
            splits.iter().map(|l| format!("{}..{}", l.start, l.end)).collect::<Vec<_>>().join(",")
        };
        vec![
            format!("--prompt-stages={}", list(&shapes.prompt)),
            format!("--prompt-slots={}", shapes.prompt_slots),
            format!("--token-stages={}", list(&shapes.token)),
            format!("--token-slots={}", shapes.token_slots),
            format!("--requests={}", shapes.requests),
        ]
    }

    /// Runs `seat`'s prompt and returns its first token. With a prompt pipeline, the prompt runs
    /// there and every stage here loads the KV handed over; if that fails anywhere, the prompt
    /// runs here instead (the same model gives the same token and KV).
    pub fn prefill(&mut self, seat: Seat, prompt: &[u32]) -> Result<StepReply, ProcessError> {
        let stages = self.len() as u32;
        let request = seat.microbatch * self.config.slots + seat.slot;
        let prompt_len = prompt.len() as u32;
        if let Some(p) = &mut self.prompt {
            if !p.broken {
                match p.remote.step(p.shapes.prompt_seat(request), prompt, 0) {
                    Ok(reply) => {
                        // A token pipeline that fails to answer fails the step, as any step here.
                        if self.remote.load(stages, seat, prompt_len)? == prompt_len {
                            return Ok(StepReply { token: reply.token, seat, kv_end: prompt_len });
                        }
                        tracing::warn!(request, "a prompt's KV did not arrive: computing it here");
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the prompt pipeline failed: prompts are computed here");
                        p.broken = true;
                    }
                }
            }
            p.fallbacks += 1;
        }
        self.remote.step(seat, prompt, 0)
    }

    /// Prompts the token pipeline computed itself because their handoff failed.
    pub fn prompt_fallbacks(&self) -> u64 {
        self.prompt.as_ref().map_or(0, |p| p.fallbacks)
    }

    /// Fills stage `stage`'s sidecar's spill directory with a file as large as the directory may
    /// hold, removed after `duration`: meanwhile its spills fail as on a full disk.
    pub fn fill_spill(&mut self, stage: usize, duration: Duration) -> Result<(), ClusterError> {
        let limits =
            self.config.spill.ok_or_else(|| ClusterError::Invalid("the sidecars do not spill".into()))?;
        let socket =
            self.sockets.get(stage).ok_or_else(|| ClusterError::Invalid(format!("no sidecar {stage}")))?;
        let dir = spill_dir_of(socket);
        std::fs::create_dir_all(&dir)?;
        let ballast = dir.join("ballast");
        std::fs::write(&ballast, vec![0u8; limits.dir_bytes as usize])?;
        std::thread::spawn(move || {
            std::thread::sleep(duration);
            let _ = std::fs::remove_file(ballast);
        });
        Ok(())
    }

    /// SIGKILLs prompt stage `stage`: the prompts not yet handed over are computed by the token
    /// pipeline.
    pub fn kill_prompt_stage(&mut self, stage: usize) -> Result<(), ClusterError> {
        let p = self.prompt.as_mut().and_then(|p| p.stages.get_mut(stage));
        let p = p.ok_or_else(|| ClusterError::Invalid(format!("no prompt stage {stage}")))?;
        Ok(p.proc.kill()?)
    }

    /// The metrics page of prompt stage `stage`.
    pub fn prompt_metrics(&self, stage: usize) -> Result<String, ClusterError> {
        let at = self.prompt.as_ref().and_then(|p| p.stages.get(stage)).and_then(|s| s.metrics);
        let at = at.ok_or_else(|| ClusterError::Invalid(format!("no prompt stage {stage} with metrics")))?;
        Ok(crate::metrics::scrape(at)?)
    }

    fn start_controller(config: &ClusterConfig, dir: &Path) -> Result<Supervised, ClusterError> {
        let timeout = config.heartbeat * 3;
        let mut args = vec![
            "controller".to_owned(),
            format!("--state={}", dir.join("controller.state").display()),
            format!("--timeout-ms={}", timeout.as_millis()),
            format!("--heartbeat-ms={}", config.heartbeat.as_millis()),
            format!("--metrics={}", SocketAddr::new(config.gateway(), 0)),
        ];
        let first =
            [args.clone(), vec![format!("--listen={}", SocketAddr::new(config.gateway(), 0))]].concat();
        let started = spawn(&config.exe, &first, "the controller", START)?;
        // Its replacements take the same port, which every process beats to.
        args.push(format!("--listen={}", started.addr));
        // A controller that takes this long to answer is presumed dead and replaced.
        let patience = (config.heartbeat * 5).max(Duration::from_millis(200));
        Ok(Supervised {
            proc: started.proc,
            metrics: started.metrics,
            client: ControllerClient::new(started.addr, patience, SECRET),
            args,
            restarts: 0,
            crash_in_recovery: false,
        })
    }

    /// Replaces the controller (killing it first: it may only be stopped).
    fn restart_controller(&mut self) -> Result<(), ClusterError> {
        let _ = self.controller.proc.kill();
        let started = spawn(&self.config.exe, &self.controller.args, "a replacement controller", START)?;
        self.controller.proc = started.proc;
        self.controller.metrics = started.metrics;
        self.controller.restarts += 1;
        // Its connection went with the old process.
        self.controller.client.disconnect();
        Ok(())
    }

    /// Asks the controller, replacing it once if it does not answer.
    fn ask<T>(
        &mut self,
        mut call: impl FnMut(&mut ControllerClient) -> Result<T, ControllerError>,
    ) -> Result<T, ClusterError> {
        match call(&mut self.controller.client) {
            Ok(answer) => Ok(answer),
            Err(_) => {
                self.restart_controller()?;
                Ok(call(&mut self.controller.client)?)
            }
        }
    }

    /// Who is alive, as the controller says.
    pub fn census(&mut self) -> Result<Census, ClusterError> {
        self.ask(ControllerClient::census)
    }

    /// Waits until `member` has beaten, at most [`START`].
    fn wait_alive(&mut self, member: Member) -> Result<(), ClusterError> {
        let start = Instant::now();
        while self.census()?.is_dead(member) {
            if start.elapsed() > START {
                return Err(ClusterError::Invalid(format!("{member:?} sends no heartbeat")));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    /// Starts `stages` spare stages and `sidecars` spare sidecars (registered with the controller
    /// as spares), now (`wait`) or in the background (their hosts too, with network namespaces).
    fn start_spares(&mut self, (stages, sidecars): (u64, u64), wait: bool) -> Result<(), ClusterError> {
        let heartbeat = self.controller.client.addr();
        // Each job makes its process's host first, where it runs.
        let placed = |config: &ClusterConfig, n: u32| {
            config
                .place(&format!("spare-{n}"))
                .map_err(|e| SpawnError { what: "a spare".into(), why: e.to_string() })
        };
        for _ in 0..stages {
            let (n, config) = (self.spares.started, self.config.clone());
            self.spares.start_stage(
                Box::new(move || {
                    let place = placed(&config, n)?;
                    let args = [
                        "spare".to_owned(),
                        format!("--id={n}"),
                        format!("--heartbeat={heartbeat}"),
                        format!("--heartbeat-ms={}", config.heartbeat.as_millis()),
                        format!("--listen={}", SocketAddr::new(place.ip, 0)),
                    ];
                    place.spawn(&config.exe, &args, "a spare stage")
                }),
                wait,
            )?;
        }
        for _ in 0..sidecars {
            let (n, config, dir) = (self.spares.started, self.config.clone(), self.dir.to_path_buf());
            let socket = self.dir.join(format!("spare-sidecar-{n}.sock"));
            let local = socket.clone();
            let job = Box::new(move || {
                let place = placed(&config, n)?;
                let args =
                    Self::sidecar_args(&config, heartbeat, SidecarOf::Spare(n), &local, &dir, place.ip);
                place.spawn(&config.exe, &args, "a spare sidecar")
            });
            self.spares.start_sidecar(job, socket, wait)?;
        }
        Ok(())
    }

    /// Spare processes (stages and sidecars) recoveries made stages' processes of, so far.
    pub fn spares_used(&self) -> u64 {
        self.spares.used.0 + self.spares.used.1
    }

    /// Stage `victim`'s replacement sidecar, started in `epoch`: a spare made its, or a new
    /// process. Returns it with its local socket.
    fn replacement_sidecar(&mut self, victim: usize, epoch: u64) -> Result<(Spawned, PathBuf), ClusterError> {
        if let Some(spare) = self.spares.take_sidecar() {
            match crate::spare::assign_sidecar(&spare.socket, victim as u32, epoch, START) {
                Ok(()) => {
                    self.spares.used.1 += 1;
                    return Ok((spare.process, spare.socket));
                }
                Err(e) => tracing::warn!(error = %e, "a spare sidecar could not be assigned: starting one"),
            }
        }
        let heartbeat = self.controller.client.addr();
        let socket = self.dir.join(format!("sidecar-{victim}-{}.sock", self.sidecar_starts));
        self.sidecar_starts += 1;
        let who = SidecarOf::Stage(victim, Start::Replacement);
        // A replacement takes the dead worker's host, as a restarted machine would.
        let place = self.config.place(&worker_host(victim))?;
        let args = Self::sidecar_args(&self.config, heartbeat, who, &socket, &self.dir, place.ip);
        Ok((place.spawn(&self.config.exe, &args, "a replacement sidecar")?, socket))
    }

    /// Stage `victim`'s replacement process, started in `epoch` and sending to `next`: a spare
    /// made that stage, or a new process on the dead worker's host.
    fn replacement_stage(
        &mut self,
        victim: usize,
        epoch: u64,
        next: SocketAddr,
    ) -> Result<Spawned, ClusterError> {
        let heartbeat = self.controller.client.addr();
        let copies = Self::copies(&self.sidecars, &self.sockets, victim);
        let args = |ip| {
            let who = (victim, Start::Replacement);
            Self::stage_args(&self.config, heartbeat, copies.clone(), who, next, &self.dir, ip)
        };
        if let Some(spare) = self.spares.take_stage() {
            // Without the subcommand; it serves where it listens, on its own host.
            let flags = args(spare.addr.ip());
            match crate::spare::assign_stage(spare.addr, &flags[1..], epoch, SECRET, START) {
                Ok(metrics) => {
                    self.spares.used.0 += 1;
                    return Ok(Spawned { metrics, ..spare });
                }
                Err(e) => tracing::warn!(error = %e, "a spare stage could not be assigned: starting one"),
            }
        }
        let place = self.config.place(&worker_host(victim))?;
        Ok(place.spawn(&self.config.exe, &args(place.ip), "a replacement stage")?)
    }

    fn sidecar_args(
        config: &ClusterConfig,
        heartbeat: SocketAddr,
        who: SidecarOf,
        socket: &std::path::Path,
        dir: &Path,
        ip: IpAddr,
    ) -> Vec<String> {
        let mut args = vec!["sidecar".to_owned()];
        args.extend(match who {
            SidecarOf::Stage(stage, start) => start.flags(stage),
            SidecarOf::Spare(n) => vec![format!("--spare={n}"), "--epoch=0".to_owned()],
        });
        args.extend([
            format!("--local={}", socket.display()),
            format!("--shm-dir={}", dir.display()),
            format!("--heartbeat={heartbeat}"),
            format!("--heartbeat-ms={}", config.heartbeat.as_millis()),
            format!("--listen={}", SocketAddr::new(ip, 0)),
            format!("--metrics={}", SocketAddr::new(ip, 0)),
        ]);
        if config.sabotage_replicas {
            args.push("--test-only-skip-replicas".to_owned());
        }
        if let Some(split) = &config.cpus {
            args.push(format!("--cpus={}", split.replication));
        }
        args.extend(config.transport_args(dir));
        if let Some(limits) = config.spill {
            args.push(format!("--spill-dir={}", spill_dir_of(socket).display()));
            args.push(format!("--memory-bytes={}", limits.memory_bytes));
            args.push(format!("--spill-dir-bytes={}", limits.dir_bytes));
        }
        args
    }

    fn stage_args(
        config: &ClusterConfig,
        heartbeat: SocketAddr,
        sidecars: Option<(PathBuf, SocketAddr)>,
        (index, start): (usize, Start),
        next: SocketAddr,
        dir: &Path,
        ip: IpAddr,
    ) -> Vec<String> {
        let layers = &config.splits[index];
        let next = config.route(Link::Activation { from: index as u32 }, next);
        let mut args = vec!["stage".to_owned()];
        args.extend(start.flags(index));
        args.extend([
            format!("--layers={}..{}", layers.start, layers.end),
            format!("--next={next}"),
            format!("--slots={}", config.slots),
            format!("--microbatches={}", config.microbatches),
            format!("--max-tokens={}", config.max_tokens),
            format!("--heartbeat={heartbeat}"),
            format!("--heartbeat-ms={}", config.heartbeat.as_millis()),
            format!("--listen={}", SocketAddr::new(ip, 0)),
            format!("--metrics={}", SocketAddr::new(ip, 0)),
        ]);
        if let Some(device) = config.device_caches {
            args.push(format!("--device-caches={device}"));
        }
        if config.layout == CacheLayout::PerLayer {
            args.push("--layout=per-layer".to_owned());
        }
        if let Some(shapes) = config.shapes() {
            args.push("--pipeline=token".to_owned());
            args.extend(Self::shape_args(&shapes));
        }
        if let Some((local, successor)) = sidecars {
            let successor = config.route(Link::Replica { from: index as u32 }, successor);
            args.push(format!("--local={}", local.display()));
            args.push(format!("--successor={successor}"));
            if let Some(split) = &config.cpus {
                args.push(format!("--streamer-cpus={}", split.replication));
            }
        }
        if let Some(split) = &config.cpus {
            args.push(format!("--cpus={}", split.compute));
        }
        args.extend(config.transport_args(dir));
        args
    }

    /// Stage `index`'s sidecars: its own (its local socket) and its ring successor's.
    fn copies(sidecars: &[Spawned], sockets: &[PathBuf], index: usize) -> Option<(PathBuf, SocketAddr)> {
        (!sidecars.is_empty()).then(|| (sockets[index].clone(), sidecars[(index + 1) % sidecars.len()].addr))
    }

    /// Stages.
    pub fn len(&self) -> usize {
        self.stages.len()
    }

    /// Whether it has no stage (never: a cluster has at least one).
    pub fn is_empty(&self) -> bool {
        self.stages.is_empty()
    }

    /// Pauses (`on` false) or resumes every stage's replication, from the next step on (see
    /// [`RemotePipeline::set_replication`]); an error without replication.
    pub fn set_replication(&mut self, on: bool) -> Result<(), ClusterError> {
        if self.sidecars.is_empty() {
            return Err(ClusterError::Invalid("this cluster does not replicate".into()));
        }
        for stage in 0..self.len() as u32 {
            self.remote.set_replication(stage, on)?;
        }
        Ok(())
    }

    /// Kills stage `victim`'s engine, and with [`Kill::Worker`] its sidecar too.
    pub fn kill(&mut self, victim: usize, what: Kill) -> Result<(), ClusterError> {
        if what == Kill::Worker && (self.sidecars.is_empty() || self.len() < 2) {
            return Err(ClusterError::Invalid(
                "killing a worker needs replication and two stages or more".into(),
            ));
        }
        self.stages[victim].proc.kill()?;
        if what == Kill::Worker {
            self.sidecars[victim].proc.kill()?;
        }
        Ok(())
    }

    /// Stage `stage`'s engine or sidecar.
    fn process(&mut self, stage: usize, role: Role) -> Result<&mut Spawned, ClusterError> {
        let spawned = match role {
            Role::Engine => self.stages.get_mut(stage),
            Role::Sidecar => self.sidecars.get_mut(stage),
        };
        spawned.ok_or_else(|| ClusterError::Invalid(format!("no {role:?} {stage}")))
    }

    /// Stage `stage`'s engine's or sidecar's process id.
    pub fn pid(&mut self, stage: usize, role: Role) -> Result<u32, ClusterError> {
        Ok(self.process(stage, role)?.proc.pid())
    }

    /// Where stage `stage`'s engine or sidecar listens.
    pub fn addr(&mut self, stage: usize, role: Role) -> Result<SocketAddr, ClusterError> {
        Ok(self.process(stage, role)?.addr)
    }

    /// Sends `signal` to stage `stage`'s engine or sidecar; a process already dead is left alone.
    pub fn signal(&mut self, stage: usize, role: Role, signal: i32) -> Result<(), ClusterError> {
        Ok(self.process(stage, role)?.proc.signal(signal)?)
    }

    /// Stops stage `stage`'s engine or sidecar for `pause` (see [`Proc::pause`]): shorter than the
    /// heartbeat timeout it is a slow process, longer it is declared dead and replaced (and killed,
    /// so it cannot come back).
    pub fn pause(&mut self, stage: usize, role: Role, pause: Duration) -> Result<(), ClusterError> {
        Ok(self.process(stage, role)?.proc.pause(pause)?)
    }

    /// The metrics page of stage `stage`'s engine or sidecar.
    pub fn metrics(&mut self, stage: usize, role: Role) -> Result<String, ClusterError> {
        let at = self.process(stage, role)?.metrics;
        let at = at.ok_or_else(|| ClusterError::Invalid(format!("{role:?} {stage} serves no metrics")))?;
        Ok(crate::metrics::scrape(at)?)
    }

    /// The metrics page of the `i`th process a recovery fenced but left running (see
    /// [`Cluster::spare_presumed_dead_in_next_recovery`]).
    pub fn spared_metrics(&self, i: usize) -> Result<String, ClusterError> {
        let at = self.spared.get(i).and_then(|s| s.metrics);
        let at = at.ok_or_else(|| ClusterError::Invalid(format!("no spared process {i} with metrics")))?;
        Ok(crate::metrics::scrape(at)?)
    }

    /// Heartbeats the current controller ignored as coming from fenced processes (0 if it cannot
    /// be asked).
    pub fn stale_heartbeats(&self) -> u64 {
        let page = self.controller_metrics().unwrap_or_default();
        crate::metrics::value_of(&page, "dejavu_controller_stale_heartbeats_total", &[]).unwrap_or(0.0) as u64
    }

    /// The controller's metrics page.
    pub fn controller_metrics(&self) -> Result<String, ClusterError> {
        let at =
            self.controller.metrics.ok_or_else(|| ClusterError::Invalid("no controller metrics".into()))?;
        Ok(crate::metrics::scrape(at)?)
    }

    /// SIGKILLs the controller. The cluster notices when it next asks it something (after a
    /// failed step, or in a recovery) and starts another on the same state.
    pub fn kill_controller(&mut self) -> Result<(), ClusterError> {
        Ok(self.controller.proc.kill()?)
    }

    /// Stops the controller for `pause`: a pause longer than the time it has to answer gets it
    /// replaced, if the cluster asks it something meanwhile.
    pub fn pause_controller(&mut self, pause: Duration) -> Result<(), ClusterError> {
        Ok(self.controller.proc.pause(pause)?)
    }

    /// Makes the next recovery SIGKILL the controller right after it has fenced the dead
    /// processes, before their replacements have beaten.
    pub fn crash_controller_in_next_recovery(&mut self) {
        self.controller.crash_in_recovery = true;
    }

    /// Makes the next recovery fence the processes presumed dead without killing them, as with a
    /// machine cut off from the cluster: if they were only stopped, they come back, stale, while
    /// their replacements run (a stale worker rejoining). They are killed with the cluster.
    pub fn spare_presumed_dead_in_next_recovery(&mut self) {
        self.spare_presumed_dead = true;
    }

    /// Controllers started to replace one that died or stopped answering.
    pub fn controller_restarts(&self) -> u64 {
        self.controller.restarts
    }

    /// Every stage whose engine or sidecar has fallen silent: the engine alone, or the whole
    /// worker when its sidecar is silent (an engine without its sidecar can neither keep nor
    /// forward its KV, so it is fenced and replaced with it).
    pub fn dead(&mut self) -> Result<Vec<(usize, Kill)>, ClusterError> {
        let census = self.census()?;
        Ok(self.dead_in(&census))
    }

    /// The stages whose engine or sidecar the controller fenced and which await their
    /// replacements: the victims of the recovery it started, if any.
    pub fn fenced(&mut self) -> Result<Vec<(usize, Kill)>, ClusterError> {
        let census = self.census()?;
        Ok(self.victims_in(&census, Census::is_fenced))
    }

    fn dead_in(&self, census: &Census) -> Vec<(usize, Kill)> {
        self.victims_in(census, Census::is_dead)
    }

    /// The stages whose engine or sidecar is `down` in `census`, and what of each to replace.
    fn victims_in(&self, census: &Census, down: fn(&Census, Member) -> bool) -> Vec<(usize, Kill)> {
        (0..self.len() as u32)
            .filter_map(|stage| {
                let sidecar_down = self.config.replicate && down(census, (Role::Sidecar, stage));
                match (down(census, (Role::Engine, stage)), sidecar_down) {
                    (_, true) => Some((stage as usize, Kill::Worker)),
                    (true, false) => Some((stage as usize, Kill::Engine)),
                    (false, false) => None,
                }
            })
            .collect()
    }

    /// Waits at most `patience` for the controller to start a recovery, and returns its victims:
    /// the stages whose engine or sidecar it declared dead and fenced (empty if it fenced none).
    /// The controller waits for the heartbeat timeout, and for members silent for half of it to
    /// beat again or die too, so that workers that died together are recovered together. A
    /// controller replaced meanwhile has heard from no one yet: the patience starts again with it.
    pub fn detect(&mut self, patience: Duration) -> Result<Vec<(usize, Kill)>, ClusterError> {
        let mut start = Instant::now();
        loop {
            let restarts = self.controller.restarts;
            let census = self.census()?;
            if self.controller.restarts != restarts {
                start = Instant::now();
            }
            let fenced = self.victims_in(&census, Census::is_fenced);
            if !fenced.is_empty() || start.elapsed() >= patience {
                return Ok(fenced);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Replaces dead stage `victim` and recovers every sequence on it; see
    /// [`Cluster::recover_all`]. Returns the steps recomputed.
    pub fn recover(
        &mut self,
        victim: usize,
        what: Kill,
        sequences: &[Sequence<'_>],
    ) -> Result<u64, ClusterError> {
        Ok(self.recover_all(&[(victim, what)], sequences)?.recomputed)
    }

    /// Replaces the dead stages `victims` and recovers every sequence on them:
    ///
    /// 1. the controller fences the presumed-dead processes in a new epoch (durably, so a
    ///    controller crash cannot undo it; when it declared exactly them dead itself, since the
    ///    last recovery started, they are fenced already and its epoch is the recovery's), they
    ///    are killed (unless spared, see
    ///    [`Cluster::spare_presumed_dead_in_next_recovery`]: the epoch keeps them out), and
    ///    replacement sidecars start for the ones that died;
    /// 2. replacement engines start (the last first, so each knows where to send) and the chain is
    ///    repaired around them;
    /// 3. the controller carries out its part ([`ControllerClient::recover`]): it plans the ring,
    ///    has the live predecessor sidecar of each replaced sidecar re-seed it and forward there
    ///    from now on (before anything is recomputed, so the recomputed steps' copies land there
    ///    too), and finds each sequence's first unreplicated token in each restore source;
    /// 4. each replacement restores each sequence's KV up to that mark, from its own sidecar if
    ///    that survived or from its successor's, and the steps the copies lacked are recomputed.
    ///    When the successor died too (adjacent workers), that copy is gone: the ring cannot
    ///    restore the stage, and its sequences are recomputed from their prompts
    ///    ([`Recovered::copies_lost`] says so);
    /// 5. the controller has the new sidecar of a replaced predecessor of a replaced sidecar
    ///    re-seed it, now that it holds the restored KV ([`ControllerClient::reseed_restored`]).
    pub fn recover_all(
        &mut self,
        victims: &[(usize, Kill)],
        sequences: &[Sequence<'_>],
    ) -> Result<Recovered, ClusterError> {
        let n = self.len();
        if self.sidecars.is_empty() {
            return Err(ClusterError::Invalid("recovery needs replication".into()));
        }
        let mut victims = victims.to_vec();
        victims.sort_by_key(|&(stage, _)| stage);
        victims.dedup_by_key(|&mut (stage, _)| stage);
        if victims.iter().any(|&(stage, _)| stage >= n) {
            return Err(ClusterError::Invalid(format!("no such stage in {victims:?}")));
        }
        // Fencing: the controller opens a new epoch in which the presumed-dead processes are
        // ignored, durably, before anything else happens. Replacements start in that epoch, so
        // their successors and the sidecars refuse the old processes' connections and copies
        // once they have seen them; a process presumed dead may only be slow, so it is also
        // killed before its replacement takes its place (when it can be).
        let mut fenced: Vec<Member> = Vec::new();
        for &(victim, what) in &victims {
            fenced.push((Role::Engine, victim as u32));
            if what == Kill::Worker {
                fenced.push((Role::Sidecar, victim as u32));
            }
        }
        // Only a fence newer than the last recovery's: a recovery tried again opens a newer epoch,
        // since the failed attempt's replacements may have started in that one.
        let lowest = self.remote.epoch() + 1;
        let epoch = self.ask(|client| client.fence_unless_fenced(&fenced, lowest))?;
        self.remote.set_epoch(epoch);
        let spare = std::mem::take(&mut self.spare_presumed_dead);
        for &(victim, what) in victims.iter().filter(|_| !spare) {
            let _ = self.stages[victim].proc.kill();
            if what == Kill::Worker {
                let _ = self.sidecars[victim].proc.kill();
            }
        }
        if std::mem::take(&mut self.controller.crash_in_recovery) {
            let _ = self.controller.proc.kill();
            // Its replacement, started now, is the one the replacements ask for their epoch.
            self.census()?;
        }
        let used = self.spares.used;
        for &(victim, _) in victims.iter().filter(|&&(_, what)| what == Kill::Worker) {
            let (new, socket) = self.replacement_sidecar(victim, epoch)?;
            self.sockets[victim] = socket;
            let old = std::mem::replace(&mut self.sidecars[victim], new);
            self.retire(old, spare);
            self.wait_alive((Role::Sidecar, victim as u32))?;
            self.hand_prompts_to(victim);
        }
        for &(victim, _) in victims.iter().rev() {
            let next = if victim + 1 == n { self.driver } else { self.stages[victim + 1].addr };
            let new = self.replacement_stage(victim, epoch, next)?;
            let old = std::mem::replace(&mut self.stages[victim], new);
            self.retire(old, spare);
            self.wait_alive((Role::Engine, victim as u32))?;
        }
        let reachable: Vec<(u32, SocketAddr)> = victims
            .iter()
            .map(|&(victim, _)| {
                let (index, addr) = (victim as u32, self.stages[victim].addr);
                let reach = if victim == 0 {
                    self.config.route(Link::Input, addr)
                } else {
                    self.config.route(Link::Activation { from: index - 1 }, addr)
                };
                (index, reach)
            })
            .collect();
        let last_replaced = victims.iter().any(|&(stage, _)| stage == n - 1);
        self.remote.replace_all(&reachable, last_replaced)?;
        // The controller's part: it re-seeds each replaced sidecar from its surviving
        // predecessor's, and finds each sequence's first unreplicated token in the copy each
        // replacement restores from. The addresses a re-seed may use (a replaced sidecar's, from
        // its predecessor) go through the routes that link takes; the others are not used.
        let book: Vec<SocketAddr> = (0..n)
            .map(|k| {
                let successor = (k + 1) % n;
                let sidecar = self.sidecars[successor].addr;
                if victims.contains(&(successor, Kill::Worker)) {
                    self.config.route(Link::Replica { from: k as u32 }, sidecar)
                } else {
                    sidecar
                }
            })
            .collect();
        let orders = self.patiently(|client| client.recover(epoch, &book, RECOVERY_PATIENCE))?;
        let planned: Vec<(usize, Kill)> = orders
            .stages
            .iter()
            .map(|o| {
                (o.plan.stage as usize, if o.plan.loss == Loss::Worker { Kill::Worker } else { Kill::Engine })
            })
            .collect();
        if planned != victims {
            return Err(ClusterError::Invalid(format!(
                "the controller recovered {planned:?} in epoch {epoch}, not the victims {victims:?}"
            )));
        }
        // A predecessor replaced too re-seeds the new sidecar once it has restored its KV.
        let reseed_after_restore =
            orders.stages.iter().any(|o| matches!(o.plan.reseed, Some((_, Reseed::AfterRestore))));
        let mut copies_lost = Vec::new();
        let mut sources = Vec::new();
        for o in &orders.stages {
            let stage = o.plan.stage;
            let replica_at = |holder: u32| {
                self.config.route(Link::Replica { from: stage }, self.sidecars[holder as usize].addr)
            };
            let from = match o.plan.source {
                Source::Own => None,
                Source::Successor(holder) => Some(replica_at(holder)),
                Source::Lost => {
                    // Its successor's new sidecar holds nothing: the stage recomputes.
                    copies_lost.push(stage as usize);
                    Some(replica_at((stage + 1) % n as u32))
                }
            };
            sources.push(RestoreSource { stage, from, orders: o.clone() });
        }
        let mut recovered = Recovered {
            epoch,
            recomputed: 0,
            lag: victims.iter().map(|&(victim, _)| (victim, 0)).collect(),
            copies_lost,
        };
        for s in sequences {
            let sequence = self.remote.recover(&sources, s.seat, s.prompt, s.generated)?;
            recovered.recomputed += sequence.recomputed;
            for (total, lacked) in recovered.lag.iter_mut().zip(sequence.lacked) {
                total.1 += lacked;
            }
        }
        if reseed_after_restore {
            self.patiently(|client| client.reseed_restored(epoch, &book, RECOVERY_PATIENCE))?;
        }
        // The spares used are replaced in the background, off the recovery.
        let (stages, sidecars) = (self.spares.used.0 - used.0, self.spares.used.1 - used.1);
        self.start_spares((stages, sidecars), false)?;
        Ok(recovered)
    }

    /// Has the controller carry out a part of a recovery (`call`), replacing it once if it
    /// cannot be reached; unlike [`Cluster::ask`], a refusal is not taken for a dead controller.
    fn patiently<T>(
        &mut self,
        call: impl Fn(&mut ControllerClient) -> Result<T, ControllerError>,
    ) -> Result<T, ClusterError> {
        match call(&mut self.controller.client) {
            Err(ControllerError::Io(e)) => {
                tracing::warn!(error = %e, "the controller did not answer a recovery: replacing it");
                self.restart_controller()?;
                Ok(call(&mut self.controller.client)?)
            }
            carried_out => Ok(carried_out?),
        }
    }

    /// Tells every prompt stage, if there are any, that token stage `stage`'s sidecar was
    /// replaced. A prompt pipeline that cannot be told is no longer used.
    fn hand_prompts_to(&mut self, stage: usize) {
        let to = self.sidecars[stage].addr;
        let Some(p) = self.prompt.as_mut().filter(|p| !p.broken) else { return };
        for prompt_stage in 0..p.stages.len() as u32 {
            if let Err(e) = p.remote.handoff_to(prompt_stage, stage as u32, to) {
                tracing::warn!(error = %e, "the prompt pipeline failed: prompts are computed here");
                p.broken = true;
                return;
            }
        }
    }

    /// Lets a replaced process go: killed (when dropped), or kept running when `spare`.
    fn retire(&mut self, old: Spawned, spare: bool) {
        if spare {
            self.spared.push(old);
        }
    }
}

/// Which of a stage's processes (engine or sidecar) is started.
#[derive(Clone, Copy, Debug)]
enum Start {
    /// The first, in epoch 0.
    First,
    /// The replacement of a fenced one, in the epoch of the fence, which it asks the controller
    /// for (`--replace`).
    Replacement,
}

impl Start {
    /// The flags that start stage `stage`'s process so.
    fn flags(self, stage: usize) -> Vec<String> {
        match self {
            Start::First => vec![format!("--index={stage}"), "--epoch=0".to_owned()],
            Start::Replacement => vec![format!("--replace={stage}")],
        }
    }
}

/// Whose a sidecar is started as.
#[derive(Clone, Copy, Debug)]
enum SidecarOf {
    /// Stage `.0`'s.
    Stage(usize, Start),
    /// Spare number `.0`, no stage's yet.
    Spare(u32),
}

/// The fabric host of worker `stage` (its stage and sidecar processes, and their replacements).
fn worker_host(stage: usize) -> String {
    format!("worker-{stage}")
}

/// The spill directory of the sidecar with local socket `socket`: beside it, in the cluster's
/// directory.
fn spill_dir_of(socket: &std::path::Path) -> PathBuf {
    socket.with_extension("spill")
}

/// What a recovery did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    /// The epoch the controller opened for it.
    pub epoch: u64,
    /// Steps recomputed (the largest replication lag among the victims, summed over the
    /// sequences).
    pub recomputed: u64,
    /// Each victim and the steps its copies lacked, summed over the sequences.
    pub lag: Vec<(usize, u64)>,
    /// Replaced stages whose copies died with them (their successor's worker died too): their
    /// sequences were recomputed from the prompt, as the ring cannot restore them.
    pub copies_lost: Vec<usize>,
}
