//! Command-line arguments of a stage process and a sidecar, shared by the `dejavu-engine`
//! binary and `dejavud` (which runs the same processes for its demo).

use std::net::SocketAddr;
use std::ops::Range;
use std::time::Duration;

use clap::{Args, ValueEnum};

use crate::heartbeat::{beat, Role};
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
    /// Where to send heartbeats (a monitor's UDP address), if anywhere.
    #[arg(long)]
    pub heartbeat: Option<SocketAddr>,
    /// Milliseconds between heartbeats.
    #[arg(long, default_value_t = 100)]
    pub heartbeat_ms: u64,
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
    /// Where to send heartbeats (a monitor's UDP address), if anywhere.
    #[arg(long)]
    pub heartbeat: Option<SocketAddr>,
    /// Milliseconds between heartbeats.
    #[arg(long, default_value_t = 100)]
    pub heartbeat_ms: u64,
}

fn parse_layers(s: &str) -> Result<Range<u32>, String> {
    let (a, b) = s.split_once("..").ok_or("layers are START..END")?;
    let (a, b) = (a.parse::<u32>().map_err(|e| e.to_string())?, b.parse::<u32>().map_err(|e| e.to_string())?);
    if a >= b {
        return Err(format!("empty layer range {a}..{b}"));
    }
    Ok(a..b)
}

/// Prints `listening ADDR`, the line a parent waits for.
fn announce(addr: SocketAddr) {
    use std::io::Write;
    println!("listening {addr}");
    let _ = std::io::stdout().flush();
}

/// Asks the kernel to kill this process when the thread that started it exits (for the demo, its
/// main thread: the demo's end), so a driver that is killed or interrupted leaves no stage behind.
/// A parent already gone by then (the process was re-parented) means exiting at once.
fn die_with_parent() {
    // SAFETY: prctl(PR_SET_PDEATHSIG) and getppid only read or set flags of the calling process.
    let (set, parent) = unsafe { (libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL), libc::getppid()) };
    if set != 0 {
        eprintln!("warning: cannot ask to die with the parent process");
    }
    if parent == 1 {
        std::process::exit(1);
    }
}

impl StageArgs {
    /// Runs the stage until it is killed.
    pub fn run(self) -> Result<(), String> {
        die_with_parent();
        if let Some(monitor) = self.heartbeat {
            beat(monitor, Role::Engine, self.index, Duration::from_millis(self.heartbeat_ms))
                .map_err(|e| e.to_string())?;
        }
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
        };
        serve_stage(config, self.listen, announce).map_err(|e| e.to_string())
    }
}

impl SidecarArgs {
    /// Serves until killed.
    pub fn run(self) -> Result<(), String> {
        use dejavulib::net::tcp::TcpTransport;
        use dejavulib::net::{PeerServer, ServerConfig};
        die_with_parent();
        if let Some(monitor) = self.heartbeat {
            beat(monitor, Role::Sidecar, self.index, Duration::from_millis(self.heartbeat_ms))
                .map_err(|e| e.to_string())?;
        }
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
            announce(server.addr());
            std::future::pending::<()>().await;
            Ok(())
        })
    }
}
