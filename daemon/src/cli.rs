//! Command-line arguments of a stage process and a sidecar, shared by the `dejavu-engine`
//! binary and `dejavud` (which runs the same processes for its demo).

use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use parking_lot::Mutex;
use std::sync::Arc;

use crate::controller::{
    serve_controller, ControllerClient, ControllerConfig, ControllerError, EtcdAccess, EtcdAccessError,
    EtcdAccessFiles, EtcdConfig, Leaving, Lifeline, Member, StoreConfig,
};
use crate::handoff::Shapes;
use crate::heartbeat::{beat_serving, spare_member, DataPort, Role};
use crate::lifecycle::{end_on_signals, free_unix_path, ClaimError, LifeArgs};
use crate::logging::LogArgs;
use crate::membership::Membership;
use crate::process::{
    serve_stage, serve_stage_on, EngineCommand, EngineProcess, Handoff, Replication, StageConfig,
};
use crate::sidecar::{serve_sidecar, EngineEpoch, EngineMembership, FencedProbe, OnAssign, SidecarConfig};
use crate::transport::TransportArgs;
use dejavu_engine::{CacheLayout, ModelConfig};
use dejavulib::affinity::CpuList;
use dejavulib::spill::Spill;

/// The cluster secret of every process given none (`--secret` or [`SECRET_ENV`]).
pub use dejavulib::net::auth::DEFAULT_SECRET;

/// The environment variable a process takes its cluster secret from when `--secret` is not
/// given: unlike a flag, it does not show in the process list.
pub use dejavulib::net::auth::SECRET_ENV;

/// Why the cluster secret a process was given cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// `--secret-file` names a file that cannot be read.
    #[error("cannot read the secret file {}: {source}", file.display())]
    Unreadable {
        /// The file.
        file: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// `--secret-file` names an empty file.
    #[error("the secret file {} is empty", file.display())]
    Empty {
        /// The file.
        file: PathBuf,
    },
    /// The built-in default, where the process listens beyond loopback.
    #[error(
        "refusing to listen at {at} with the built-in default cluster secret, which anyone can read in \
         this program: give the cluster a secret of its own, the same for each of its processes, with \
         --secret-file FILE (or the {SECRET_ENV} environment variable)"
    )]
    DefaultExposed {
        /// The address beyond loopback.
        at: SocketAddr,
    },
}

/// Why a cluster process (`stage`, `sidecar`, `controller`, `spare`) did not start, or stopped.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Flags that do not fit together, or name nothing usable.
    #[error("{0}")]
    Flags(String),
    /// Its cluster secret.
    #[error(transparent)]
    Secret(#[from] SecretError),
    /// Its settings to reach a secured etcd.
    #[error(transparent)]
    EtcdAccess(#[from] EtcdAccessError),
    /// Its logs could not be set up.
    #[error(transparent)]
    Logging(#[from] crate::logging::LoggingError),
    /// Its transport (`--transport`, `--certs`).
    #[error(transparent)]
    Transport(#[from] crate::transport::TransportError),
    /// It could not move to the CPUs it was given.
    #[error(transparent)]
    Cpus(#[from] dejavulib::affinity::AffinityError),
    /// It could not start beating to the controller, or holding its lifeline.
    #[error("cannot send heartbeats: {0}")]
    Heartbeat(#[source] std::io::Error),
    /// The controller refused it as a member (another live process holds its place).
    #[error(transparent)]
    Member(ControllerError),
    /// A file it must own (its local socket, the controller's state lock) is another process's.
    #[error(transparent)]
    Claim(#[from] ClaimError),
    /// Its signal handling could not be set up.
    #[error("cannot handle SIGTERM: {0}")]
    Signals(#[source] std::io::Error),
    /// The controller did not say in which epoch it replaces a fenced member.
    #[error("cannot replace {member:?}: {source}")]
    Replace {
        /// The member replaced.
        member: Member,
        /// What the controller said, or why it did not.
        source: ControllerError,
    },
    /// A socket could not be bound.
    #[error("cannot listen {what} at {at}: {source}")]
    Listen {
        /// What for.
        what: &'static str,
        /// Where.
        at: String,
        /// Why.
        source: std::io::Error,
    },
    /// The stage failed.
    #[error(transparent)]
    Stage(#[from] crate::process::ProcessError),
    /// The sidecar failed.
    #[error(transparent)]
    Sidecar(#[from] crate::sidecar::SidecarError),
    /// The controller failed.
    #[error(transparent)]
    Controller(#[from] ControllerError),
    /// A spare stopped before it was assigned a stage.
    #[error("the spare stopped listening")]
    SpareStopped,
}

/// The cluster secret of the clusters this process starts (the demo's, the chaos harness's):
/// its environment's ([`SECRET_ENV`]) if it has one, else one drawn from the kernel's random
/// source once per process. The processes it starts take it from their environment
/// ([`crate::proc::spawn`] puts it there), so no cluster it starts runs on [`DEFAULT_SECRET`].
pub fn cluster_secret() -> &'static str {
    static SECRET: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SECRET.get_or_init(|| {
        std::env::var(SECRET_ENV).unwrap_or_else(|_| {
            let random = dejavulib::net::auth::nonce().expect("the kernel's random source (/dev/urandom)");
            random.iter().map(|b| format!("{b:02x}")).collect()
        })
    })
}

/// The cluster secret a process runs with: the contents of `file` if given (without a trailing
/// newline; an empty or unreadable file is an error), else `given` (`--secret`, [`SECRET_ENV`] or
/// the default). A process listening anywhere but on loopback (any of `listening`) refuses the
/// built-in default: anyone can read it in this program.
pub fn secret_for(given: &str, file: Option<&Path>, listening: &[SocketAddr]) -> Result<String, SecretError> {
    let secret = match file {
        Some(file) => {
            let read = std::fs::read_to_string(file)
                .map_err(|source| SecretError::Unreadable { file: file.to_owned(), source })?;
            let secret = read.trim_end_matches(['\n', '\r']).to_owned();
            if secret.is_empty() {
                return Err(SecretError::Empty { file: file.to_owned() });
            }
            secret
        }
        None => given.to_owned(),
    };
    let exposed = listening.iter().find(|addr| !addr.ip().is_loopback());
    if let (Some(&at), true) = (exposed, secret == DEFAULT_SECRET) {
        return Err(SecretError::DefaultExposed { at });
    }
    Ok(secret)
}

/// The KV cache layout of a stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Layout {
    /// FasterTransformer's K `[L][B][H][D/x][S][x]` and V `[L][B][H][S][D]`.
    Ft,
    /// One `[B][H][S][D]` tensor per layer and K/V.
    PerLayer,
}

/// Run one stage: the reference model, or an engine process given after `--`.
#[derive(Clone, Debug, Args)]
pub struct StageArgs {
    /// Position of this stage in the chain (0 is the first).
    #[arg(long, required_unless_present = "replace")]
    pub index: Option<u32>,
    /// Start as the replacement of stage STAGE's engine, which the controller (`--heartbeat`)
    /// declared dead and fenced, in the epoch of that fence (instead of `--index` and `--epoch`).
    #[arg(long, value_name = "STAGE", conflicts_with_all = ["index", "epoch"], requires = "heartbeat")]
    pub replace: Option<u32>,
    /// Global layers it runs, as START..END.
    #[arg(long, value_parser = parse_layers)]
    pub layers: Range<u32>,
    /// Where its output goes: the next stage, or the driver after the last stage.
    #[arg(long)]
    pub next: SocketAddr,
    /// Where it listens for its input (port 0 picks one).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// KV cache layout.
    #[arg(long, value_enum, default_value = "ft")]
    pub layout: Layout,
    /// Sequences per microbatch.
    #[arg(long, default_value_t = 4)]
    pub slots: u32,
    /// Microbatches.
    #[arg(long, default_value_t = 2)]
    pub microbatches: u32,
    /// KV caches in "device" memory, if fewer than microbatches: the others' KV is swapped to host
    /// memory, the next microbatch's prefetched while the rest of the pipeline computes.
    #[arg(long)]
    pub device_caches: Option<u32>,
    /// Tokens per sequence at most.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: u32,
    /// Milliseconds each step takes on top of the reference model's arithmetic, as a real
    /// model's kernels would on a GPU: the stage waits that long without using a CPU (0: none).
    #[arg(long, default_value_t = 0.0, value_parser = parse_step_ms)]
    pub step_ms: f64,
    /// Its own sidecar's local socket: each step's KV goes there through shared memory, and the
    /// sidecar keeps it (the local copy) and forwards it to the successor's sidecar.
    #[arg(long, requires = "successor")]
    pub local: Option<PathBuf>,
    /// Its ring successor's sidecar, which keeps a replica of each step's KV: the next stage's
    /// (the last stage's is the first's). `none` keeps the local copy only, which survives the
    /// engine but not the worker: a ring of one stage has no other sidecar. Its own sidecar is
    /// refused.
    #[arg(long, value_name = "ADDR|none", requires = "local")]
    pub successor: Option<dejavulib::local::Successor>,
    /// Run the streamer, the thread that copies each step's KV to the sidecar, on these CPUs (a
    /// list such as 4-7), so that copies do not preempt the compute [default: as `--cpus`].
    #[arg(long, value_name = "LIST", requires = "local")]
    pub streamer_cpus: Option<CpuList>,
    /// Its part in prompt-token disaggregation.
    #[command(flatten)]
    pub handoff: HandoffArgs,
    /// Its transport to other sidecars.
    #[command(flatten)]
    pub transport: TransportArgs,
    /// What it is as a member of the cluster.
    #[command(flatten)]
    pub member: MemberArgs,
    /// An engine process to run instead of the reference model: the command and its arguments,
    /// after `--` (such as `-- python3 -m dejavu.torch_engine member --shape ...`). The stage
    /// keeps the chain and its membership, and the engine computes each step and keeps its KV
    /// with the sidecar, speaking the engine protocol on its standard input and output
    /// (docs/protocol.md). `--layout` and `--step-ms` are the reference model's only; a prompt
    /// handoff, the stage carries out for its engine (it reads and writes the engine's KV).
    #[arg(last = true, value_name = "ENGINE")]
    pub engine: Vec<String>,
}

/// Which prompts a stage computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PipelineRole {
    /// Prompts and tokens (colocated).
    Both,
    /// Prompts only: hands each prompt's KV over to the token stages' sidecars (`--handoff-to`).
    Prompt,
    /// Tokens: loads each prompt's KV from its own sidecar, where the prompt stages handed it
    /// over (a prompt sent to it, as in a recovery, is still computed).
    Token,
}

/// Prompt-token disaggregation: a prompt pipeline and a token pipeline of other shapes, which
/// both sides need to know to plan the handoff of each prompt's KV.
#[derive(Clone, Debug, Args)]
pub struct HandoffArgs {
    /// The pipeline it is part of.
    #[arg(long, value_enum, default_value = "both")]
    pub pipeline: PipelineRole,
    /// Layers of each prompt stage, as START..END,START..END,...
    #[arg(long, value_delimiter = ',', value_parser = parse_layers)]
    pub prompt_stages: Vec<Range<u32>>,
    /// Sequences per prompt microbatch.
    #[arg(long)]
    pub prompt_slots: Option<u32>,
    /// Layers of each token stage, as START..END,START..END,...
    #[arg(long, value_delimiter = ',', value_parser = parse_layers)]
    pub token_stages: Vec<Range<u32>>,
    /// Sequences per token microbatch.
    #[arg(long)]
    pub token_slots: Option<u32>,
    /// Requests in all (a multiple of both microbatch sizes).
    #[arg(long)]
    pub requests: Option<u32>,
    /// A prompt stage's token sidecars, in token stage order.
    #[arg(long, value_delimiter = ',')]
    pub handoff_to: Vec<SocketAddr>,
}

impl HandoffArgs {
    /// The stage's part, or why the flags do not describe one.
    fn handoff(&self, secret: &str) -> Result<Option<Handoff>, CliError> {
        if self.pipeline == PipelineRole::Both {
            return Ok(None);
        }
        let missing = |flag: &str| {
            CliError::Flags(format!("--pipeline {:?} needs {flag}", self.pipeline).to_lowercase())
        };
        let shapes = Shapes {
            prompt: Some(self.prompt_stages.clone())
                .filter(|s| !s.is_empty())
                .ok_or_else(|| missing("--prompt-stages"))?,
            prompt_slots: self.prompt_slots.ok_or_else(|| missing("--prompt-slots"))?,
            token: Some(self.token_stages.clone())
                .filter(|s| !s.is_empty())
                .ok_or_else(|| missing("--token-stages"))?,
            token_slots: self.token_slots.ok_or_else(|| missing("--token-slots"))?,
            requests: self.requests.ok_or_else(|| missing("--requests"))?,
        };
        Ok(Some(match self.pipeline {
            PipelineRole::Prompt if self.handoff_to.is_empty() => return Err(missing("--handoff-to")),
            PipelineRole::Prompt => Handoff::Prompt {
                shapes,
                sidecars: self.handoff_to.clone(),
                secret: secret.as_bytes().to_vec(),
            },
            _ => Handoff::Token { shapes },
        }))
    }
}

/// What a stage and a sidecar share as members of a cluster: heartbeats, the epoch they were
/// started in, metrics and logs.
#[derive(Clone, Debug, Args)]
pub struct MemberArgs {
    /// The controller's address, if there is one: where heartbeats go. With several controllers
    /// on etcd (`controller --etcd`), all their addresses, comma-separated: heartbeats go to
    /// each, and the lifeline and the queries to whichever leads.
    #[arg(long, value_name = "ADDR,...", value_delimiter = ',')]
    pub heartbeat: Vec<SocketAddr>,
    /// The address its heartbeats are sent from, when its listeners are bound to one (set by the
    /// process, not a flag): the controller reaches the ports its beats name at the address they
    /// come from, which the route would otherwise pick (another of the host's addresses).
    #[arg(skip)]
    pub source: Option<std::net::IpAddr>,
    /// Milliseconds between heartbeats.
    #[arg(long, default_value_t = 100)]
    pub heartbeat_ms: u64,
    /// The cluster secret: every network connection between the cluster's processes proves it
    /// (the local socket to its own sidecar is the file system's to guard), and heartbeats are
    /// signed with it. The built-in default is refused where the process listens beyond
    /// loopback.
    #[arg(long, env = SECRET_ENV, hide_env_values = true, default_value = DEFAULT_SECRET)]
    pub secret: String,
    /// Read the cluster secret from this file instead (without its trailing newline): it then
    /// shows neither in the process list nor in the environment.
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    /// The epoch it is started in (a replacement: the recovery's). Its heartbeats, connections and
    /// KV copies carry it; whoever has seen a newer one for its place refuses it.
    #[arg(long, default_value_t = 0)]
    pub epoch: u64,
    /// Serve Prometheus metrics at this address (`GET /metrics`; port 0 picks one).
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// Run on these CPUs only (a list such as 0-3,8; every thread of the process) [default: any].
    #[arg(long, value_name = "LIST")]
    pub cpus: Option<CpuList>,
    /// How it is started: its flags file, its parent.
    #[command(flatten)]
    pub life: LifeArgs,
    /// Logging.
    #[command(flatten)]
    pub log: LogArgs,
}

/// A stage's sidecar: keeps its engine's KV (received through shared memory) and its
/// predecessor's replica in memory, and forwards its engine's KV to the successor's sidecar.
#[derive(Clone, Debug, Args)]
pub struct SidecarArgs {
    /// The stage it belongs to.
    #[arg(long, default_value_t = 0, conflicts_with = "spare")]
    pub index: u32,
    /// Start as the replacement of stage STAGE's sidecar, which the controller (`--heartbeat`)
    /// declared dead and fenced, in the epoch of that fence (instead of `--index` and `--epoch`).
    #[arg(long, value_name = "STAGE", conflicts_with_all = ["index", "epoch", "spare"], requires = "heartbeat")]
    pub replace: Option<u32>,
    /// Start as stage STAGE's sidecar in whatever role the controller's record gives it: the
    /// replacement of a fenced one, in the fence's epoch, or the stage's first, in epoch 0 (for a
    /// supervisor that starts it the same way every time; a predecessor that has just died is
    /// waited for, a live one is an error).
    #[arg(long, value_name = "STAGE", conflicts_with_all = ["index", "epoch", "spare", "replace"], requires = "heartbeat")]
    pub join: Option<u32>,
    /// Start as spare number N, registered with the controller and waiting for a recovery to
    /// assign it a stage (over its local socket) instead of `--index`.
    #[arg(long, value_name = "N")]
    pub spare: Option<u32>,
    /// Where it listens for replicas and restores over TCP (port 0 picks one).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Its local socket, for its engine (created; must not exist).
    #[arg(long)]
    pub local: PathBuf,
    /// Where it creates the memory regions it shares with its engine (each is removed once both
    /// have mapped it).
    #[arg(long, default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
    /// Bytes of a shared region; the largest chunk (a whole prompt's KV on the stage) must fit.
    #[arg(long, default_value_t = 64 << 20)]
    pub region_bytes: usize,
    /// What it is as a member of the cluster.
    #[command(flatten)]
    pub member: MemberArgs,
    /// Where chunks go once `--memory-bytes` are held in memory (one file each); without it,
    /// everything stays in memory.
    #[arg(long, requires = "memory_bytes")]
    pub spill_dir: Option<PathBuf>,
    /// Bytes of chunks held in memory before they spill to `--spill-dir`.
    #[arg(long, requires = "spill_dir")]
    pub memory_bytes: Option<u64>,
    /// Bytes the spill directory may hold in all (its other files too); a spill beyond it fails
    /// as on a full disk, and the chunk stays in memory.
    #[arg(long, requires = "spill_dir")]
    pub spill_dir_bytes: Option<u64>,
    /// Breaks replication on purpose (its engine's KV is kept but never forwarded to the
    /// successor, while reported done), so that tests can prove the chaos harness catches lost
    /// KV. Never use it otherwise.
    #[arg(long, hide = true)]
    pub test_only_skip_replicas: bool,
    /// Its transport to other sidecars and stages.
    #[command(flatten)]
    pub transport: TransportArgs,
}

/// The controller: receives heartbeats, declares the silent dead and fences them, which starts
/// each recovery in an epoch kept in a state file that survives its crashes.
#[derive(Clone, Debug, Args)]
pub struct ControllerArgs {
    /// Where it listens: UDP for heartbeats and TCP for queries, on one port (0 picks one).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Its state file (epoch, members, fenced processes), created if missing; a restarted
    /// controller given the same file goes on where the last one stopped. Not with `--etcd`.
    #[arg(long, required_unless_present = "etcd", conflicts_with = "etcd")]
    pub state: Option<PathBuf>,
    /// Run as one of several controllers, the control state kept in this etcd cluster (client
    /// URLs, comma-separated): one leads, elected through an etcd lease; the others stand by.
    #[arg(long, value_name = "URL,...", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// The cluster's name in etcd (its keys are under `/dejavu/NAME/`).
    #[arg(long, value_name = "NAME", default_value = "dejavu", requires = "etcd")]
    pub cluster: String,
    /// Seconds a leader that stopped renewing its etcd lease (dead, paused, cut off) stays
    /// leader: how long a failover takes at most.
    #[arg(long, value_name = "SECONDS", default_value_t = 2, requires = "etcd")]
    pub lease_secs: u64,
    /// TLS to etcd (`https://` URLs): the PEM file of the authority that signed etcd's server
    /// certificates.
    #[arg(long, value_name = "FILE", requires = "etcd")]
    pub etcd_ca: Option<PathBuf>,
    /// The controller's certificate (PEM) for an etcd that checks its clients' certificates
    /// (etcd's `--client-cert-auth`), with `--etcd-key`.
    #[arg(long, value_name = "FILE", requires_all = ["etcd_key", "etcd_ca"])]
    pub etcd_cert: Option<PathBuf>,
    /// The private key (PEM) of `--etcd-cert`.
    #[arg(long, value_name = "FILE", requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,
    /// The etcd user it logs in as, where etcd has authentication on, with
    /// `--etcd-password-file`.
    #[arg(long, value_name = "NAME", requires_all = ["etcd", "etcd_password_file"])]
    pub etcd_user: Option<String>,
    /// A file holding the password of `--etcd-user` (without its trailing newline).
    #[arg(long, value_name = "FILE", requires = "etcd_user")]
    pub etcd_password_file: Option<PathBuf>,
    /// Milliseconds of silence after which a process is declared dead.
    #[arg(long, default_value_t = 300)]
    pub timeout_ms: u64,
    /// Milliseconds between the members' heartbeats (to count missed ones).
    #[arg(long, default_value_t = 100)]
    pub heartbeat_ms: u64,
    /// Serve Prometheus metrics at this address (`GET /metrics`; port 0 picks one).
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// The cluster secret: heartbeats must be signed with it, query connections must prove it,
    /// and the controller proves it to the sidecars when it carries out a recovery. The built-in
    /// default is refused where the controller listens beyond loopback.
    #[arg(long, env = SECRET_ENV, hide_env_values = true, default_value = DEFAULT_SECRET)]
    pub secret: String,
    /// Read the cluster secret from this file instead (without its trailing newline).
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    /// Append a journal of its liveness machine's life to this file: how it started, then every
    /// heartbeat, lifeline, detection and fence and what it decided, one line each (`dejavu-sim`
    /// replays it).
    #[arg(long, value_name = "FILE")]
    pub journal: Option<PathBuf>,
    /// The ring's stages, to have the controller restore replaced sidecars itself: when a fenced
    /// stage's replacement sidecar (`sidecar --replace STAGE`) beats naming its KV port, the
    /// surviving predecessor's sidecar re-seeds it and the surviving successor's hands it the
    /// stage's own KV, which the replacement engine then restores; the recovery feed says where
    /// each sequence resumes. Without it, whoever drives the pipeline carries recoveries out step
    /// by step (`dejavud demo --recoveries driver`).
    #[arg(long, value_name = "N")]
    pub stages: Option<u32>,
    /// How it is started: its flags file, its parent.
    #[command(flatten)]
    pub life: LifeArgs,
    /// Logging.
    #[command(flatten)]
    pub log: LogArgs,
}

/// A step's extra time in milliseconds: finite, at least 0, at most ten minutes.
fn parse_step_ms(text: &str) -> Result<f64, String> {
    let ms: f64 = text.parse().map_err(|e| format!("{text:?} is not a number of milliseconds: {e}"))?;
    if !(0.0..=600_000.0).contains(&ms) {
        return Err(format!("{ms} ms: give 0 to 600000"));
    }
    Ok(ms)
}

fn parse_layers(s: &str) -> Result<Range<u32>, String> {
    let (a, b) = s.split_once("..").ok_or("layers are START..END")?;
    let (a, b) = (a.parse::<u32>().map_err(|e| e.to_string())?, b.parse::<u32>().map_err(|e| e.to_string())?);
    if a >= b {
        return Err(format!("empty layer range {a}..{b}"));
    }
    Ok(a..b)
}

/// Prints `metrics ADDR` (when metrics are served) and then `listening ADDR`, the line a parent
/// waits for.
pub(crate) fn announce(addr: SocketAddr, metrics: Option<SocketAddr>) {
    use std::io::Write;
    if let Some(metrics) = metrics {
        println!("metrics {metrics}");
    }
    println!("listening {addr}");
    let _ = std::io::stdout().flush();
}

/// Prints `assigned STAGE EPOCH`: a spare sidecar was handed stage `stage`'s place in `epoch`
/// (a supervisor that started it learns which spare took which place).
pub(crate) fn say_assigned(stage: u32, epoch: u64) {
    use std::io::Write;
    // Said to whoever listens: a supervisor that no longer reads is no reason to fail.
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{ASSIGNED} {stage} {epoch}").and_then(|()| out.flush());
}

/// The prefix of the line a spare sidecar prints when it is handed a stage: `assigned STAGE EPOCH`.
pub const ASSIGNED: &str = "assigned";

/// How long a process joining as a member waits for the fence of its predecessor that has just
/// died (an engine its sidecar gives an epoch, a sidecar started with `--join`).
const JOIN_PATIENCE: Duration = Duration::from_secs(3);

/// How long a replacement keeps asking an unreachable controller for its epoch (it may be
/// restarting).
const REPLACEMENT_PATIENCE: Duration = Duration::from_secs(10);

/// How long a member waits for one of several controllers to answer, finding the leader.
const LEADER_PROBE: Duration = Duration::from_millis(300);

impl MemberArgs {
    /// Makes this the replacement of fenced `member`: it starts in the epoch the controller
    /// fenced the member in. An unreachable controller is asked again for a while; one that
    /// says the member is not fenced is an error.
    fn replace(&mut self, member: Member) -> Result<(), CliError> {
        if self.heartbeat.is_empty() {
            return Err(CliError::Flags("a replacement needs the controller's address (--heartbeat)".into()));
        }
        let start = Instant::now();
        let mut client = self.leader();
        loop {
            match client.fenced_in(member) {
                Ok(epoch) => {
                    self.epoch = epoch;
                    return Ok(());
                }
                Err(ControllerError::Io(e)) if start.elapsed() < REPLACEMENT_PATIENCE => {
                    tracing::debug!(error = %e, "the controller does not answer yet");
                    std::thread::sleep(Duration::from_millis(50));
                    // Another controller may lead by now.
                    client = self.leader();
                }
                Err(source) => return Err(CliError::Replace { member, source }),
            }
        }
    }

    /// A client of the controller that leads: the first of `--heartbeat` that answers a census
    /// (a controller standing by does not answer), or the first named if none does yet.
    fn leader(&self) -> ControllerClient {
        let secret = self.secret.as_bytes();
        let client = |addr, deadline| ControllerClient::new(addr, deadline, secret);
        if let [only] = self.heartbeat.as_slice() {
            return client(*only, Duration::from_secs(1));
        }
        let answering = self.heartbeat.iter().find(|&&addr| client(addr, LEADER_PROBE).census().is_ok());
        client(*answering.unwrap_or(&self.heartbeat[0]), Duration::from_secs(1))
    }

    /// Sets the process up as a member: its logs, its death with the parent that started it, and
    /// its heartbeats as (`role`, `index`) to the controller, if given (they stop when the handle
    /// is dropped).
    pub(crate) fn start(&self, role: Role, index: u32) -> Result<Option<Membership>, CliError> {
        self.init("a spare", || {})?;
        self.beat(role, index, self.epoch, (None, DataPort::none()))
    }

    /// Takes the secret from `--secret-file` if given, and refuses the default one where the
    /// process listens beyond loopback (`listening`).
    pub(crate) fn secure(&mut self, listening: &[SocketAddr]) -> Result<(), CliError> {
        self.secret = secret_for(&self.secret, self.secret_file.as_deref(), listening)?;
        self.secret_file = None;
        Ok(())
    }

    /// Its logs, its death with the parent that started it if asked, its end on SIGTERM or SIGINT
    /// (`what` stops, after `cleanup`), and its CPUs: before it starts any thread, so that every
    /// thread inherits them.
    fn init(&self, what: &'static str, cleanup: impl FnOnce() + Send + 'static) -> Result<(), CliError> {
        self.log.init()?;
        self.life.apply();
        self.pin()?;
        end_on_signals(what, cleanup).map_err(CliError::Signals)
    }

    /// Moves the calling thread, and the threads it starts from now on, to its CPUs (if given).
    fn pin(&self) -> Result<(), CliError> {
        Ok(self.cpus.as_ref().map_or(Ok(()), |cpus| cpus.pin_current_thread())?)
    }

    /// The epoch for a new engine of `stage` that asks its sidecar for one, the last engine the
    /// sidecar admitted having been of epoch `previous` ([`MemberArgs::epoch_to_join`]; without a
    /// controller, one newer than the last engine's).
    pub(crate) fn engine_epoch(&self, stage: u32, previous: Option<u64>) -> Result<u64, String> {
        if self.heartbeat.is_empty() {
            return Ok(previous.map_or(0, |last| last + 1));
        }
        self.epoch_to_join((Role::Engine, stage), previous)
            .map_err(|e| format!("no epoch for engine {stage}: the last one is not fenced yet ({e})"))
    }

    /// The epoch a process joining as `member` starts in, the last process of the member this
    /// one knows of having been of epoch `last`: the epoch of the member's fence when it awaits a
    /// replacement; `last` (0 if none) when the controller never heard of the member (it was no
    /// member before); otherwise the member is still known alive, and its fence is waited for a
    /// few seconds (its process has just died: its lifeline is closing), then an error (another
    /// live process holds the place).
    fn epoch_to_join(&self, member: Member, last: Option<u64>) -> Result<u64, ControllerError> {
        if self.heartbeat.is_empty() {
            return Err(ControllerError::Protocol("no controller (--heartbeat)".into()));
        }
        let start = Instant::now();
        let mut client = self.leader();
        loop {
            let known = client.census().map(|census| census.members.contains_key(&member));
            match client.fenced_in(member) {
                Ok(epoch) => return Ok(epoch),
                Err(ControllerError::NotFenced(_)) if matches!(known, Ok(false)) => {
                    return Ok(last.unwrap_or(0))
                }
                Err(e) if start.elapsed() >= JOIN_PATIENCE => return Err(e),
                Err(ControllerError::Io(_)) => {
                    std::thread::sleep(Duration::from_millis(10));
                    // Another controller may lead by now.
                    client = self.leader();
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }

    /// Heartbeats and a lifeline as engine `stage`'s, started in `epoch`, held by a sidecar for
    /// the engine's process `pid` (which reports nothing itself), if there is a controller.
    pub(crate) fn engine_membership(
        &self,
        stage: u32,
        epoch: u64,
        pid: u32,
    ) -> Result<Option<Membership>, CliError> {
        let to = self.heartbeat.as_slice();
        if to.is_empty() {
            return Ok(None);
        }
        let (interval, secret, member) =
            (Duration::from_millis(self.heartbeat_ms), self.secret.as_bytes(), (Role::Engine, stage));
        let lifeline =
            Lifeline::hold_for(to, member, epoch, pid, interval, secret).map_err(CliError::Member)?;
        let heartbeat =
            beat_serving(to, member, epoch, interval, (None, DataPort::none()), secret, self.source)
                .map_err(CliError::Heartbeat)?;
        Ok(Some(Membership::new(heartbeat, lifeline)))
    }

    /// Its heartbeats as (`role`, `index`), started in `epoch`, naming its control listener's
    /// port and its KV transport's (if it has them), if it has a controller.
    pub(crate) fn beat(
        &self,
        role: Role,
        index: u32,
        epoch: u64,
        ports: (Option<u16>, DataPort),
    ) -> Result<Option<Membership>, CliError> {
        let to = self.heartbeat.as_slice();
        if to.is_empty() {
            return Ok(None);
        }
        let interval = Duration::from_millis(self.heartbeat_ms);
        let secret = self.secret.as_bytes();
        let pid = std::process::id();
        let lifeline =
            Lifeline::hold_for(to, (role, index), epoch, pid, interval, secret).map_err(|e| match e {
                ControllerError::Io(e) => CliError::Heartbeat(e),
                refused => CliError::Member(refused),
            })?;
        let heartbeat = beat_serving(to, (role, index), epoch, interval, ports, secret, self.source)
            .map_err(CliError::Heartbeat)?;
        Ok(Some(Membership::new(heartbeat, lifeline)))
    }
}

impl StageArgs {
    /// Its position in the chain, from `--index` or `--replace`.
    fn position(&self) -> Result<u32, CliError> {
        self.index
            .or(self.replace)
            .ok_or_else(|| CliError::Flags("a stage needs --index or --replace".into()))
    }

    /// The same flags with `--replace` resolved: the stage's index, and the epoch the controller
    /// fenced its engine in.
    pub fn resolved(mut self) -> Result<Self, CliError> {
        if let Some(stage) = self.replace.take() {
            self.member.replace((Role::Engine, stage))?;
            self.index = Some(stage);
        }
        Ok(self)
    }

    /// Runs the stage until it is killed.
    pub fn run(mut self) -> Result<(), CliError> {
        self.member.init("the stage", || {})?;
        self.member.secure(&[self.listen])?;
        let this = self.resolved()?;
        let _heartbeat =
            this.member.beat(Role::Engine, this.position()?, this.member.epoch, (None, DataPort::none()))?;
        let (listen, metrics) = (this.listen, this.member.metrics);
        Ok(serve_stage(this.config()?, listen, metrics, announce)?)
    }

    /// Runs the stage on `listener`, a spare's (logs already set up), answering `assigned` once
    /// it serves, with the engine process the spare started ahead, if any; until it is killed.
    pub(crate) fn run_on(
        self,
        listener: std::net::TcpListener,
        assigned: impl FnOnce(std::net::SocketAddr, Option<std::net::SocketAddr>),
        standby: Option<EngineProcess>,
    ) -> Result<(), CliError> {
        self.member.pin()?;
        let this = self.resolved()?;
        let _heartbeat =
            this.member.beat(Role::Engine, this.position()?, this.member.epoch, (None, DataPort::none()))?;
        let metrics = this.member.metrics;
        Ok(serve_stage_on(this.config()?, listener, metrics, assigned, standby)?)
    }

    /// What the flags describe.
    fn config(self) -> Result<StageConfig, CliError> {
        if !self.engine.is_empty() && (self.layout != Layout::Ft || self.step_ms != 0.0) {
            return Err(CliError::Flags(
                "--layout and --step-ms are the reference model's, not an engine process's".into(),
            ));
        }
        let handoff = self.handoff.handoff(&self.member.secret)?;
        Ok(StageConfig {
            model: ModelConfig::reference(),
            index: self.position()?,
            layers: self.layers,
            layout: match self.layout {
                Layout::Ft => CacheLayout::FasterTransformer,
                Layout::PerLayer => CacheLayout::PerLayer,
            },
            slots: self.slots,
            microbatches: self.microbatches,
            max_tokens: self.max_tokens,
            step_time: Duration::from_secs_f64(self.step_ms / 1e3),
            next: self.next,
            replication: self.local.zip(self.successor).map(|(local, successor)| Replication {
                local,
                successor,
                streamer_cpus: self.streamer_cpus,
            }),
            epoch: self.member.epoch,
            secret: self.member.secret.clone().into_bytes(),
            device_caches: self.device_caches,
            handoff,
            transport: self.transport.transports()?,
            engine: (!self.engine.is_empty())
                .then(|| EngineCommand::new(self.engine))
                .transpose()
                .map_err(|e| CliError::Flags(e.to_string()))?,
        })
    }
}

impl SidecarArgs {
    /// Serves until killed.
    pub fn run(mut self) -> Result<(), CliError> {
        // On SIGTERM, the files only it uses go: its local socket and its engines' regions.
        let (local, shm_dir) = (self.local.clone(), self.shm_dir.clone());
        self.member.init("the sidecar", move || remove_sidecar_files(&local, &shm_dir))?;
        self.member.secure(&[self.listen])?;
        self.member.source = Some(self.listen.ip()).filter(|ip| !ip.is_unspecified());
        // Before asking for an epoch: a start that cannot listen must not use one up.
        free_unix_path(&self.local)?;
        let transports = self.transport.transports()?;
        if self.listen.port() != 0 {
            transports.check_free(self.listen).map_err(|source| CliError::Listen {
                what: "for KV",
                at: self.listen.to_string(),
                source,
            })?;
        }
        if let Some(stage) = self.replace.take() {
            self.member.replace((Role::Sidecar, stage))?;
            self.index = stage;
        }
        if let Some(stage) = self.join.take() {
            let member = (Role::Sidecar, stage);
            self.member.epoch = self
                .member
                .epoch_to_join(member, None)
                .map_err(|source| CliError::Replace { member, source })?;
            self.index = stage;
        }
        let member = match self.spare {
            Some(n) => spare_member(n),
            None => self.index,
        };
        // Bound before it beats: the beats name it, and the controller may use it at once.
        let listen =
            |source| CliError::Listen { what: "for control", at: self.listen.ip().to_string(), source };
        let control = std::net::TcpListener::bind((self.listen.ip(), 0)).map_err(listen)?;
        let port = control.local_addr().map_err(listen)?.port();
        // A port the system picks is named once the transport listens.
        let data_port = DataPort::new(self.listen.port());
        let heartbeat = Arc::new(Mutex::new(self.member.beat(
            Role::Sidecar,
            member,
            self.member.epoch,
            (Some(port), data_port.clone()),
        )?));
        let spare = self.spare.map(|_| {
            let (args, heartbeat, data_port) = (self.member.clone(), heartbeat.clone(), data_port.clone());
            // Assigned: it beats as that stage's sidecar, in the recovery's epoch, and says so on
            // standard output for whoever started it.
            OnAssign(Arc::new(move |stage, epoch| {
                match args.beat(Role::Sidecar, stage, epoch, (Some(port), data_port.clone())) {
                    Ok(beats) => {
                        *heartbeat.lock() = beats;
                        say_assigned(stage, epoch);
                    }
                    Err(e) => tracing::warn!(error = %e, "an assigned spare cannot send heartbeats"),
                }
            }))
        });
        let probe = heartbeat.clone();
        let fenced = FencedProbe(Arc::new(move || probe.lock().as_ref().and_then(Membership::fenced_in)));
        let member = self.member.clone();
        let engine_membership = EngineMembership(Arc::new(move |stage, epoch, pid| {
            member.engine_membership(stage, epoch, pid).unwrap_or_else(|e| {
                tracing::warn!(stage, epoch, pid, error = %e, "cannot report an engine's liveness for it");
                None
            })
        }));
        let config = SidecarConfig {
            spare,
            fenced: Some(fenced),
            engine_membership: (!self.member.heartbeat.is_empty()).then_some(engine_membership),
            engine_epoch: (!self.member.heartbeat.is_empty()).then(|| {
                let member = self.member.clone();
                EngineEpoch(Arc::new(move |stage, previous| member.engine_epoch(stage, previous)))
            }),
            index: self.index,
            listen: self.listen,
            local: self.local,
            shm_dir: self.shm_dir,
            region_bytes: self.region_bytes,
            secret: self.member.secret.clone().into_bytes(),
            skip_forwarding: self.test_only_skip_replicas,
            spill: self.spill_dir.zip(self.memory_bytes).map(|(dir, memory_bytes)| Spill {
                dir,
                memory_bytes,
                dir_bytes: self.spill_dir_bytes,
            }),
            transport: transports,
        };
        let ready = move |addr: SocketAddr, metrics| {
            data_port.name(addr.port());
            announce(addr, metrics);
        };
        Ok(serve_sidecar(config, Some(control), self.member.metrics, ready)?)
    }
}

impl ControllerArgs {
    /// Serves until killed.
    pub fn run(self) -> Result<(), CliError> {
        self.log.init()?;
        self.life.apply();
        // Its state file is durable at every step; a leader on etcd gives its leadership up.
        let leaving = Leaving::default();
        let stopping = leaving.clone();
        end_on_signals("the controller", move || stopping.leave()).map_err(CliError::Signals)?;
        let secret = secret_for(&self.secret, self.secret_file.as_deref(), &[self.listen])?;
        let store = match self.state {
            Some(path) => StoreConfig::File(path),
            None => {
                let files = EtcdAccessFiles {
                    ca: self.etcd_ca.as_deref(),
                    identity: self.etcd_cert.as_deref().zip(self.etcd_key.as_deref()),
                    user: self.etcd_user.as_deref().zip(self.etcd_password_file.as_deref()),
                };
                let access = EtcdAccess::load(&self.etcd, &files)?;
                StoreConfig::Etcd(EtcdConfig {
                    endpoints: self.etcd,
                    cluster: self.cluster,
                    lease_ttl: Duration::from_secs(self.lease_secs.max(1)),
                    access,
                })
            }
        };
        let config = ControllerConfig {
            listen: self.listen,
            store,
            leaving,
            timeout: Duration::from_millis(self.timeout_ms),
            interval: Duration::from_millis(self.heartbeat_ms),
            metrics: self.metrics,
            secret: secret.into_bytes(),
            journal: self.journal,
            stages: self.stages,
        };
        Ok(serve_controller(config, announce)?)
    }
}

/// Removes a sidecar's local socket and the shared-memory regions it made for its engines (named
/// after its process id), as it stops.
fn remove_sidecar_files(local: &Path, shm_dir: &Path) {
    let _ = std::fs::remove_file(local);
    let prefix = format!("dejavu-{}-", std::process::id());
    let Ok(entries) = std::fs::read_dir(shm_dir) else { return };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_started_here_never_runs_on_the_default_secret() {
        let secret = cluster_secret();
        match std::env::var(SECRET_ENV) {
            Ok(given) => assert_eq!(secret, given),
            Err(_) => {
                assert_ne!(secret, DEFAULT_SECRET);
                assert_eq!(secret.len(), 64, "32 random bytes in hex: {secret}");
                assert!(secret.bytes().all(|b| b.is_ascii_hexdigit()));
            }
        }
        // Drawn once: every process of every cluster of this process shares it.
        assert_eq!(cluster_secret(), secret);
    }

    #[test]
    fn a_step_time_is_a_finite_number_of_milliseconds_within_ten_minutes() {
        assert_eq!(parse_step_ms("2.5"), Ok(2.5));
        assert_eq!(parse_step_ms("0"), Ok(0.0));
        for bad in ["-1", "NaN", "inf", "600001", "fast"] {
            assert!(parse_step_ms(bad).is_err(), "{bad} accepted");
        }
        assert!(parse_step_ms("-1").unwrap_err().contains("give 0 to 600000"));
    }

    #[test]
    fn the_default_secret_is_refused_beyond_loopback_only() {
        let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let everywhere: SocketAddr = "0.0.0.0:7400".parse().unwrap();
        let v6_loopback: SocketAddr = "[::1]:0".parse().unwrap();
        assert_eq!(secret_for(DEFAULT_SECRET, None, &[loopback, v6_loopback]).unwrap(), DEFAULT_SECRET);
        let refused = secret_for(DEFAULT_SECRET, None, &[loopback, everywhere]).unwrap_err();
        assert!(matches!(refused, SecretError::DefaultExposed { at } if at == everywhere), "{refused}");
        assert_eq!(secret_for("ours", None, &[everywhere]).unwrap(), "ours");
    }
}
