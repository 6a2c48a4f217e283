//! `dejavu-engine`: one pipeline stage of the reference engine as its own process, or a replica
//! peer that keeps stages' KV. Each prints `listening ADDR` once it accepts connections.

use std::net::SocketAddr;
use std::ops::Range;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use dejavu_engine::process::{serve_stage, Replica, StageConfig};
use dejavu_engine::{CacheLayout, ModelConfig};

#[derive(Debug, Parser)]
#[command(name = "dejavu-engine", about = "Reference engine stage or replica peer")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Layout {
    /// FasterTransformer's K [L][B][H][D/x][S][x] and V [L][B][H][S][D].
    Ft,
    /// One [B][H][S][D] tensor per layer and K/V.
    PerLayer,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run one stage of the reference model.
    Stage {
        /// Position of this stage in the chain (0 is the first).
        #[arg(long)]
        index: u32,
        /// Global layers it runs, as START..END.
        #[arg(long, value_parser = parse_layers)]
        layers: Range<u32>,
        /// Where its output goes: the next stage, or the driver after the last stage.
        #[arg(long)]
        next: SocketAddr,
        /// Where it listens for its input (port 0 picks one).
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
        /// KV cache layout.
        #[arg(long, value_enum, default_value = "ft")]
        layout: Layout,
        /// Sequences per microbatch.
        #[arg(long, default_value_t = 4)]
        slots: u32,
        /// Microbatches.
        #[arg(long, default_value_t = 2)]
        microbatches: u32,
        /// Tokens per sequence at most.
        #[arg(long, default_value_t = 256)]
        max_tokens: u32,
        /// A replica peer to flush each step's KV to (and restore it from).
        #[arg(long)]
        replica: Option<SocketAddr>,
        /// The cluster secret shared with the replica peer.
        #[arg(long, default_value = "dejavu reference cluster")]
        secret: String,
    },
    /// Keep stages' KV replicas in memory for them.
    Replica {
        /// Where it listens (port 0 picks one).
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
        /// The cluster secret.
        #[arg(long, default_value = "dejavu reference cluster")]
        secret: String,
    },
}

fn parse_layers(s: &str) -> Result<Range<u32>, String> {
    let (a, b) = s.split_once("..").ok_or("layers are START..END")?;
    let (a, b) = (a.parse::<u32>().map_err(|e| e.to_string())?, b.parse::<u32>().map_err(|e| e.to_string())?);
    if a >= b {
        return Err(format!("empty layer range {a}..{b}"));
    }
    Ok(a..b)
}

fn announce(addr: SocketAddr) {
    use std::io::Write;
    println!("listening {addr}");
    let _ = std::io::stdout().flush();
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Stage {
            index,
            layers,
            next,
            listen,
            layout,
            slots,
            microbatches,
            max_tokens,
            replica,
            secret,
        } => {
            let config = StageConfig {
                model: ModelConfig::reference(),
                index,
                layers,
                layout: match layout {
                    Layout::Ft => CacheLayout::FasterTransformer,
                    Layout::PerLayer => CacheLayout::PerLayer,
                },
                slots,
                microbatches,
                max_tokens,
                next,
                replica: replica.map(|addr| Replica { addr, secret: secret.into_bytes() }),
            };
            serve_stage(config, listen, announce).map_err(|e| e.to_string())
        }
        Command::Replica { listen, secret } => run_replica(listen, secret),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dejavu-engine: {e}");
            ExitCode::from(2)
        }
    }
}

fn run_replica(listen: SocketAddr, secret: String) -> Result<(), String> {
    use dejavulib::net::tcp::TcpTransport;
    use dejavulib::net::{PeerServer, ServerConfig};
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let config = ServerConfig::new(secret.into_bytes(), u32::MAX);
        let server = PeerServer::bind(&TcpTransport::plain(), listen, config, dejavulib::HostStore::new())
            .await
            .map_err(|e| format!("cannot listen at {listen}: {e}"))?;
        announce(server.addr());
        // Serves until the process is stopped.
        std::future::pending::<()>().await;
        Ok(())
    })
}
