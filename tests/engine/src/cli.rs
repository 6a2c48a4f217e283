//! Command-line arguments of a stage process and a sidecar, shared by the `dejavu-engine`
//! binary and `dejavud` (which runs the same processes for its demo).

use std::net::SocketAddr;
use std::ops::Range;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

use crate::controller::{serve_controller, ControllerConfig};
use crate::heartbeat::{beat, Heartbeat, Role};
use crate::logging::LogArgs;
use crate::metrics::{Exposition, MetricType};
use crate::process::{serve_stage, Replication, StageConfig};
use crate::{CacheLayout, ModelConfig};

/// The KV cache layout of a stage.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Layout {
    /// FasterTransformer's K `[L][B][H][D/x][S][x]` and V `[L][B][H][S][D]`.
    Ft,
    /// One `[B][H][S][D]` tensor per layer and K/V.
    PerLayer,
}

/// Run one stage of the reference model.
#[derive(Clone, Debug, Args)]
pub struct StageArgs {
    /// Position of this stage in the chain (0 is the first).
    #[arg(long)]
    pub index: u32,
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
    /// Tokens per sequence at most.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: u32,
    /// Its own sidecar, which keeps a local copy of each step's KV.
    #[arg(long, requires = "successor")]
    pub local: Option<SocketAddr>,
    /// Its ring successor's sidecar, which keeps a replica of each step's KV.
    #[arg(long, requires = "local")]
    pub successor: Option<SocketAddr>,
    /// The cluster secret shared with the sidecars.
    #[arg(long, default_value = "dejavu reference cluster")]
    pub secret: String,
    /// Where to send heartbeats (the controller's address), if anywhere.
    #[arg(long)]
    pub heartbeat: Option<SocketAddr>,
    /// Milliseconds between heartbeats.
    #[arg(long, default_value_t = 100)]
    pub heartbeat_ms: u64,
    /// Serve Prometheus metrics at this address (`GET /metrics`; port 0 picks one).
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// Logging.
    #[command(flatten)]
    pub log: LogArgs,
    /// The epoch it is started in (a replacement: the recovery's). Its connections and KV copies
    /// carry it; its successor and the sidecars refuse an older one once they have seen it.
    #[arg(long, default_value_t = 0)]
    pub epoch: u64,
    /// Breaks replication on purpose (copies to the successor are skipped but reported done), so
    /// that tests can prove the chaos harness catches lost KV. Never use it otherwise.
    #[arg(long, hide = true)]
    pub test_only_skip_replicas: bool,
}

/// A stage's sidecar: keeps its local KV copy and its predecessor's replica in memory.
#[derive(Clone, Debug, Args)]
pub struct SidecarArgs {
    /// The stage it belongs to.
    #[arg(long, default_value_t = 0)]
    pub index: u32,
    /// Where it listens (port 0 picks one).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// The cluster secret.
    #[arg(long, default_value = "dejavu reference cluster")]
    pub secret: String,
    /// Where to send heartbeats (the controller's address), if anywhere.
    #[arg(long)]
    pub heartbeat: Option<SocketAddr>,
    /// Milliseconds between heartbeats.
    #[arg(long, default_value_t = 100)]
    pub heartbeat_ms: u64,
    /// Serve Prometheus metrics at this address (`GET /metrics`; port 0 picks one).
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// Logging.
    #[command(flatten)]
    pub log: LogArgs,
}

/// The controller: receives heartbeats, says who fell silent, and issues the epoch of each
/// recovery, kept in a state file that survives its crashes.
#[derive(Clone, Debug, Args)]
pub struct ControllerArgs {
    /// Where it listens: UDP for heartbeats and TCP for queries, on one port (0 picks one).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Its state file (epoch, members, fenced processes), created if missing; a restarted
    /// controller given the same file goes on where the last one stopped.
    #[arg(long)]
    pub state: PathBuf,
    /// Milliseconds of silence after which a process is declared dead.
    #[arg(long, default_value_t = 300)]
    pub timeout_ms: u64,
    /// Milliseconds between the members' heartbeats (to count missed ones).
    #[arg(long, default_value_t = 100)]
    pub heartbeat_ms: u64,
    /// Serve Prometheus metrics at this address (`GET /metrics`; port 0 picks one).
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// Logging.
    #[command(flatten)]
    pub log: LogArgs,
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
fn announce(addr: SocketAddr, metrics: Option<SocketAddr>) {
    use std::io::Write;
    if let Some(metrics) = metrics {
        println!("metrics {metrics}");
    }
    println!("listening {addr}");
    let _ = std::io::stdout().flush();
}

/// Starts beating to `controller`, if given.
fn start_heartbeat(
    controller: Option<SocketAddr>,
    role: Role,
    index: u32,
    interval_ms: u64,
) -> Result<Option<Heartbeat>, String> {
    controller
        .map(|to| beat(to, role, index, Duration::from_millis(interval_ms)))
        .transpose()
        .map_err(|e| format!("cannot send heartbeats: {e}"))
}

/// Asks the kernel to kill this process when the thread that started it exits (for the demo, its
/// main thread: the demo's end), so a driver that is killed or interrupted leaves no stage behind.
/// A parent already gone by then (the process was re-parented) means exiting at once.
fn die_with_parent() {
    // SAFETY: prctl(PR_SET_PDEATHSIG) and getppid only read or set flags of the calling process.
    let (set, parent) = unsafe { (libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL), libc::getppid()) };
    if set != 0 {
        tracing::warn!("cannot ask to die with the parent process");
    }
    if parent == 1 {
        std::process::exit(1);
    }
}

impl StageArgs {
    /// Runs the stage until it is killed.
    pub fn run(self) -> Result<(), String> {
        self.log.init()?;
        die_with_parent();
        let _heartbeat = start_heartbeat(self.heartbeat, Role::Engine, self.index, self.heartbeat_ms)?;
        let config = StageConfig {
            model: ModelConfig::reference(),
            index: self.index,
            layers: self.layers,
            layout: match self.layout {
                Layout::Ft => CacheLayout::FasterTransformer,
                Layout::PerLayer => CacheLayout::PerLayer,
            },
            slots: self.slots,
            microbatches: self.microbatches,
            max_tokens: self.max_tokens,
            next: self.next,
            replication: self.local.zip(self.successor).map(|(local, successor)| Replication {
                local,
                successor,
                secret: self.secret.into_bytes(),
                skip_replicas: self.test_only_skip_replicas,
            }),
            epoch: self.epoch,
        };
        serve_stage(config, self.listen, self.metrics, announce).map_err(|e| e.to_string())
    }
}

impl SidecarArgs {
    /// Serves until killed.
    pub fn run(self) -> Result<(), String> {
        use dejavulib::net::tcp::TcpTransport;
        use dejavulib::net::{PeerServer, ServerConfig};
        self.log.init()?;
        die_with_parent();
        let _heartbeat = start_heartbeat(self.heartbeat, Role::Sidecar, self.index, self.heartbeat_ms)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        runtime.block_on(async {
            let config = ServerConfig::new(self.secret.into_bytes(), u32::MAX);
            let server =
                PeerServer::bind(&TcpTransport::plain(), self.listen, config, dejavulib::HostStore::new())
                    .await
                    .map_err(|e| format!("cannot listen at {}: {e}", self.listen))?;
            let server = std::sync::Arc::new(server);
            let metrics = match self.metrics {
                Some(at) => {
                    let (server, index) = (server.clone(), self.index);
                    let page = move || render_sidecar(&server, index);
                    Some(crate::metrics::serve(at, page).map_err(|e| format!("cannot serve metrics: {e}"))?)
                }
                None => None,
            };
            tracing::info!(stage = self.index, addr = %server.addr(), "sidecar listening");
            announce(server.addr(), metrics);
            std::future::pending::<()>().await;
            Ok(())
        })
    }
}

/// A sidecar's metrics page.
fn render_sidecar(server: &dejavulib::net::PeerServer, index: u32) -> String {
    use std::sync::atomic::Ordering::Relaxed;
    let stats = server.stats();
    let index = index.to_string();
    let label = [("stage", index.as_str())];
    let mut page = Exposition::new();
    let counters = [
        ("dejavu_sidecar_chunks_stored_total", "KV chunks stored (local copies and replicas).", &stats.puts),
        ("dejavu_sidecar_bytes_stored_total", "Bytes of the KV chunks stored.", &stats.bytes_stored),
        ("dejavu_sidecar_chunks_served_total", "KV chunks served to restores.", &stats.gets),
        ("dejavu_sidecar_bytes_served_total", "Bytes of the KV chunks served.", &stats.bytes_served),
        (
            "dejavu_sidecar_connections_total",
            "Connections that passed the cluster handshake.",
            &stats.authenticated,
        ),
        ("dejavu_sidecar_refused_total", "Connections refused at the handshake.", &stats.refused),
        (
            "dejavu_sidecar_bad_chunks_total",
            "Chunks refused as inconsistent with their header.",
            &stats.bad_chunks,
        ),
        ("dejavu_sidecar_stale_total", "Requests refused for a stale epoch.", &stats.stale),
        (
            "dejavu_sidecar_bad_frames_total",
            "Connections closed on a malformed or corrupted frame.",
            &stats.bad_frames,
        ),
    ];
    for (name, help, counter) in counters {
        page.family(name, MetricType::Counter, help).sample(name, &label, counter.load(Relaxed) as f64);
    }
    page.family("dejavu_sidecar_chunks_held", MetricType::Gauge, "KV chunks held in memory.").sample(
        "dejavu_sidecar_chunks_held",
        &label,
        server.store().len() as f64,
    );
    page.finish()
}

impl ControllerArgs {
    /// Serves until killed.
    pub fn run(self) -> Result<(), String> {
        self.log.init()?;
        die_with_parent();
        let config = ControllerConfig {
            listen: self.listen,
            state: self.state,
            timeout: Duration::from_millis(self.timeout_ms),
            interval: Duration::from_millis(self.heartbeat_ms),
            metrics: self.metrics,
        };
        serve_controller(config, announce).map_err(|e| e.to_string())
    }
}
