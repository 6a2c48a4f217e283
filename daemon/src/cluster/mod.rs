//! A pipeline of stage and sidecar processes on loopback (or each worker in a network namespace
//! of its own, see [`crate::netns`]), started from an executable that has the
//! `stage`, `sidecar` and `controller` subcommands of [`crate::cli`] (`dejavud`), the controller
//! process that says which of them died, and the recovery procedure that replaces a dead worker.
//! The demo, the chaos harness and the process tests share it.
//!
//! What a cluster runs is [`ClusterConfig`] (the `config` module); the processes' command lines
//! are built in `args` (their transport flags in `config`). A recovery ([`Cluster::recover_all`],
//! in `recovery`) is carried out as [`Recoveries`] says: by the controller, the cluster starting
//! the replacements and feeding the pipeline from the recovery feed (`by_controller`), or by the
//! cluster step by step (`recovery`). The points where the chaos harness injects faults into
//! either are in `hooks` ([`RecoveryHooks`]), and spare workers in `spares`.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use thiserror::Error;

mod args;
mod by_controller;
mod config;
mod controllers;
mod faults;
mod hooks;
mod recovery;
mod spares;
mod watch;

use args::{spill_dir_of, worker_host, SidecarOf, Start};
pub use config::{
    ClusterConfig, ControlPlane, CpuSplit, Disaggregation, EtcdControllers, Interpose, Link, Recoveries,
    SpillLimits,
};
pub use controllers::{ControllerEnd, ControllerLife};
pub use faults::Faults;
pub use hooks::{NoHooks, RecoveryHooks};
pub use recovery::{Recovered, RECOVERY_ATTEMPTS};

use crate::controller::{Census, ControllerClient, ControllerError, Member};
use crate::handoff::Shapes;
pub use crate::heartbeat::Role;
use crate::netns::NetnsError;
use crate::proc::Spawned;
pub use crate::proc::{Proc, SpawnError};
use crate::process::{ProcessError, RemotePipeline, StepReply};
pub use crate::transport::TransportKind;
use dejavu_engine::pipeline::Seat;
use dejavulib::net::controller::RecoveryFeed;

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
    /// The prompt and token pipelines' shapes do not fit together.
    #[error(transparent)]
    Handoff(#[from] crate::handoff::HandoffError),
    /// A local operation failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// A recovery was asked of stages outside the cluster, or answered out of turn.
    #[error("recovery: {0}")]
    Recovery(#[from] dejavu_proto::recovery::RecoveryError),
    /// The cluster cannot do what was asked.
    #[error("{0}")]
    Invalid(String),
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
    controllers: controllers::Controllers,
    /// Fenced processes left running; killed with the cluster.
    spared: Vec<Spawned>,
    /// The driver's end of the chain.
    pub remote: RemotePipeline,
    /// Tells `remote` of each fence the controller opens. Declared after `controller`, so dropped
    /// once the controller is stopped: its wait then ends at once.
    _fence_watch: watch::FenceWatch,
    /// The prompt pipeline, when disaggregated.
    prompt: Option<PromptPipeline>,
    /// Spare workers.
    spares: spares::SparePool,
    /// The controller's recovery feed, once a recovery by the controller has used it.
    recovery_feed: Option<RecoveryFeed>,
    /// The newest recovery by the controller whose sequences resumed.
    acknowledged: u64,
    /// Holds the controller's state, the local sockets and the shared regions; removed last, once
    /// every process is gone.
    dir: StateDir,
}

/// Time a process has to start listening.
const START: Duration = Duration::from_secs(30);

/// The cluster secret the driver proves. It starts every process without `--secret`, so they take
/// it from the environment [`crate::proc::spawn`] gives them ([`crate::cli::cluster_secret`]).
fn secret() -> Vec<u8> {
    crate::cli::cluster_secret().as_bytes().to_vec()
}

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
        let controllers = controllers::Controllers::start(&config, &dir)?;
        let heartbeat = controllers.heartbeat_arg();
        let (mut sidecars, mut sockets) = (Vec::new(), Vec::new());
        if config.replicate {
            for i in 0..n {
                let socket = dir.join(format!("sidecar-{i}-{i}.sock"));
                let place = config.place(&worker_host(i))?;
                let who = SidecarOf::Stage(i, Start::First);
                let args = Self::sidecar_args(&config, &heartbeat, who, &socket, &dir, place.ip);
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
                Self::stage_args(&config, &heartbeat, copies, (index, Start::First), next, &dir, place.ip);
            let stage = place.spawn(&config.exe, &args, &format!("stage {index}"))?;
            next = stage.addr;
            stages.push(stage);
        }
        stages.reverse();
        let first = config.route(Link::Input, next);
        let mut remote = RemotePipeline::connect(first, results, n as u32 - 1, config.deadline, &secret())?;
        // A step in flight when the controller declares a stage dead fails at once, not at its
        // deadline.
        let (fence_watch, fences) =
            watch::FenceWatch::start(controllers.leader_addr(), &secret(), remote.epoch())?;
        remote.watch_fences(fences);
        let prompt = Self::start_prompt_pipeline(&config, &sidecars, &dir)?;
        let mut cluster = Self {
            prompt,
            spares: spares::SparePool::default(),
            recovery_feed: None,
            acknowledged: 0,
            config,
            sidecar_starts: sidecars.len() as u64,
            sidecars,
            sockets,
            dir,
            stages,
            driver,
            controllers,
            spared: Vec::new(),
            remote,
            _fence_watch: fence_watch,
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
        shapes.setups(dejavu_engine::ModelConfig::reference().kv_spec())?;
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
            args.extend(config.step_args());
            args.extend(config.transport_args(dir));
            if let Some(engine) = &config.engine {
                args.push("--".to_owned());
                args.extend(engine.argv().iter().cloned());
            }
            let stage = place.spawn(&config.exe, &args, &format!("prompt stage {index}"))?;
            next = stage.addr;
            stages.push(stage);
        }
        stages.reverse();
        let last = disaggregation.splits.len() as u32 - 1;
        let remote = RemotePipeline::connect(next, results, last, config.deadline, &secret())?;
        Ok(Some(PromptPipeline { stages, remote, shapes, fallbacks: 0, broken: false }))
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

    /// The metrics page of prompt stage `stage`.
    pub fn prompt_metrics(&self, stage: usize) -> Result<String, ClusterError> {
        let at = self.prompt.as_ref().and_then(|p| p.stages.get(stage)).and_then(|s| s.metrics);
        let at = at.ok_or_else(|| ClusterError::Invalid(format!("no prompt stage {stage} with metrics")))?;
        Ok(crate::metrics::scrape(at)?)
    }

    /// Asks the controller in charge, replacing it (or following its successor) if it does not
    /// answer.
    fn ask<T>(
        &mut self,
        call: impl FnMut(&mut ControllerClient) -> Result<T, ControllerError>,
    ) -> Result<T, ClusterError> {
        self.controllers.ask(call)
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
        let heartbeat = self.controllers.heartbeat_arg();
        // Each job makes its process's host first, where it runs.
        let placed = |config: &ClusterConfig, n: u32| {
            config
                .place(&format!("spare-{n}"))
                .map_err(|e| SpawnError { what: "a spare".into(), why: e.to_string() })
        };
        for _ in 0..stages {
            let (n, config, heartbeat) = (self.spares.started, self.config.clone(), heartbeat.clone());
            self.spares.start_stage(
                Box::new(move || {
                    let place = placed(&config, n)?;
                    let mut args = vec![
                        "spare".to_owned(),
                        format!("--id={n}"),
                        format!("--heartbeat={heartbeat}"),
                        format!("--heartbeat-ms={}", config.heartbeat.as_millis()),
                        format!("--listen={}", SocketAddr::new(place.ip, 0)),
                    ];
                    // Its engine process starts now and stands by, warm, for the stage to come.
                    if let Some(engine) = &config.engine {
                        args.push("--".to_owned());
                        args.extend(engine.argv().iter().cloned());
                    }
                    place.spawn(&config.exe, &args, "a spare stage")
                }),
                wait,
            )?;
        }
        for _ in 0..sidecars {
            let (n, config, dir) = (self.spares.started, self.config.clone(), self.dir.to_path_buf());
            let heartbeat = heartbeat.clone();
            let socket = self.dir.join(format!("spare-sidecar-{n}.sock"));
            let local = socket.clone();
            let job = Box::new(move || {
                let place = placed(&config, n)?;
                let args =
                    Self::sidecar_args(&config, &heartbeat, SidecarOf::Spare(n), &local, &dir, place.ip);
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
        self.new_replacement_sidecar(victim)
    }

    /// A new process to replace stage `victim`'s sidecar, which asks the controller for the
    /// place (`--replace`), on the dead worker's host. Returns it with its local socket.
    pub(super) fn new_replacement_sidecar(
        &mut self,
        victim: usize,
    ) -> Result<(Spawned, PathBuf), ClusterError> {
        let heartbeat = self.controllers.heartbeat_arg();
        let socket = self.dir.join(format!("sidecar-{victim}-{}.sock", self.sidecar_starts));
        self.sidecar_starts += 1;
        let who = SidecarOf::Stage(victim, Start::Replacement);
        // A replacement takes the dead worker's host, as a restarted machine would.
        let place = self.config.place(&worker_host(victim))?;
        let args = Self::sidecar_args(&self.config, &heartbeat, who, &socket, &self.dir, place.ip);
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
        let heartbeat = self.controllers.heartbeat_arg();
        let copies = Self::copies(&self.sidecars, &self.sockets, victim);
        let args = |ip| {
            let who = (victim, Start::Replacement);
            Self::stage_args(&self.config, &heartbeat, copies.clone(), who, next, &self.dir, ip)
        };
        if let Some(spare) = self.spares.take_stage() {
            // Without the subcommand; it serves where it listens, on its own host.
            let flags = args(spare.addr.ip());
            match crate::spare::assign_stage(spare.addr, &flags[1..], epoch, &secret(), START) {
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

    /// The faults to inject into it ([`Faults`]): kills, signals, pauses, the controller's death.
    pub fn faults(&mut self) -> Faults<'_> {
        Faults { cluster: self }
    }

    /// Stage `stage`'s engine or sidecar.
    pub(super) fn process(&mut self, stage: usize, role: Role) -> Result<&mut Spawned, ClusterError> {
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

    /// The metrics page of stage `stage`'s engine or sidecar.
    pub fn metrics(&mut self, stage: usize, role: Role) -> Result<String, ClusterError> {
        let at = self.process(stage, role)?.metrics;
        let at = at.ok_or_else(|| ClusterError::Invalid(format!("{role:?} {stage} serves no metrics")))?;
        Ok(crate::metrics::scrape(at)?)
    }

    /// The metrics page of the `i`th process a recovery fenced but left running (see
    /// [`RecoveryHooks::leave_presumed_dead_running`]).
    pub fn spared_metrics(&self, i: usize) -> Result<String, ClusterError> {
        let spared = self.spared.get(i).filter(|s| s.metrics.is_some());
        let spared =
            spared.ok_or_else(|| ClusterError::Invalid(format!("no spared process {i} with metrics")))?;
        let at = spared.metrics.expect("filtered");
        crate::metrics::scrape(at).map_err(|e| {
            ClusterError::Invalid(format!(
                "spared process {i}'s metrics at {at}: {e} (pid {}; its last words: {})",
                spared.proc.pid(),
                spared.proc.stderr_tail()
            ))
        })
    }

    /// Heartbeats the current controller ignored as coming from fenced processes (0 if it cannot
    /// be asked).
    pub fn stale_heartbeats(&self) -> u64 {
        let page = self.controller_metrics().unwrap_or_default();
        crate::metrics::value_of(&page, "dejavu_controller_stale_heartbeats_total", &[]).unwrap_or(0.0) as u64
    }

    /// The metrics page of the controller in charge.
    pub fn controller_metrics(&self) -> Result<String, ClusterError> {
        self.controllers.metrics()
    }

    /// Controllers started to replace one that died, stopped answering or was deposed.
    pub fn controller_restarts(&self) -> u64 {
        self.controllers.restarts()
    }

    /// Every controller process's life so far (see [`ControllerLife`]).
    pub fn controller_lives(&mut self) -> Vec<ControllerLife> {
        self.controllers.lives()
    }

    /// Controllers it runs (1, or several on etcd).
    pub fn controllers(&self) -> u32 {
        self.controllers.count()
    }

    /// Which controller leads, in the order they were first started (0 with one): the one that
    /// announced the lead last, of those alive.
    pub fn leading_controller(&mut self) -> u32 {
        self.controllers.follow();
        self.controllers.leader()
    }
}
