//! `dejavud`: the DéjàVu daemon's command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use dejavu_engine::cli::{SidecarArgs, StageArgs};
use dejavud::certs;
use dejavud::demo::{self, DemoConfig, Kill};
use dejavud::plan::{self, Overrides};

/// The DéjàVu daemon: a fault-tolerance demo, the deployment planner and cluster certificates.
#[derive(Debug, Parser)]
#[command(name = "dejavud", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum KillArg {
    /// The engine and its sidecar: the KV comes back from the successor's sidecar.
    Worker,
    /// The engine alone: the KV comes back from its own sidecar.
    Engine,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the reference model as a pipeline of stage processes on loopback, SIGKILL one stage in
    /// the middle of decoding, recover it from replicated KV, and compare with a failure-free run
    /// and a restart from scratch.
    Demo {
        /// Pipeline stages (processes); the model's 8 layers are split evenly.
        #[arg(long, default_value_t = 4)]
        stages: u32,
        /// The stage to kill.
        #[arg(long, default_value_t = 2)]
        victim: u32,
        /// Requests (4 per microbatch).
        #[arg(long, default_value_t = 8)]
        requests: u32,
        /// Prompt tokens per request.
        #[arg(long, default_value_t = 32)]
        prompt_tokens: u32,
        /// Tokens generated per request.
        #[arg(long, default_value_t = 256)]
        new_tokens: u32,
        /// A step with no answer after this many milliseconds means a stage failed.
        #[arg(long, default_value_t = 300)]
        deadline_ms: u64,
        /// What to kill: the victim's whole worker (engine and sidecar) or its engine alone.
        #[arg(long, value_enum, default_value = "worker")]
        kill: KillArg,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Run one stage of the reference engine (started by `demo`).
    Stage(StageArgs),
    /// A stage's sidecar: its local KV copy and its predecessor's replica (started by `demo`).
    Sidecar(SidecarArgs),
    /// Size KV caches, split machines between prompt and token pipelines, check the swapping
    /// condition, estimate KV transfer costs and check stage memory, from a TOML or JSON file.
    Plan {
        /// The cluster description (`.toml` or `.json`); see docs/operations.md for the fields.
        input: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// A JSON file of measurements (`prompt_ms`, `token_ms`, `streaming_overhead`, any
        /// subset) that override the `[timing]` section.
        #[arg(long)]
        calibration: Option<PathBuf>,
        /// Prompt time of one microbatch through the whole model, in ms (overrides the file).
        #[arg(long)]
        prompt_ms: Option<f64>,
        /// Token step time of one microbatch through the whole model, in ms (overrides the file).
        #[arg(long)]
        token_ms: Option<f64>,
        /// Prompt slowdown while its KV streams, m >= 1 (overrides the file).
        #[arg(long)]
        streaming_overhead: Option<f64>,
    },
    /// Create a cluster's certificate authority (or reuse the one in OUT) and issue a certificate
    /// to each node. Nodes trust only that authority: QUIC and TLS peers without one of its
    /// certificates are refused.
    Certs {
        /// The cluster's name (written into the authority's certificate).
        #[arg(long)]
        cluster: String,
        /// Directory for `ca.pem`, `ca.key` and one `<node>.pem` / `<node>.key` per node (keys are
        /// written with mode 0600).
        #[arg(long)]
        out: PathBuf,
        /// Replace node certificates that already exist.
        #[arg(long)]
        force: bool,
        /// Node names (DNS labels: lowercase letters, digits and '-', at most 63 characters).
        #[arg(required = true)]
        nodes: Vec<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Plan { input, json, calibration, prompt_ms, token_ms, streaming_overhead } => {
            let flags = Overrides { prompt_ms, token_ms, streaming_overhead };
            match plan::run(&input, calibration.as_deref(), flags) {
                Ok(report) => {
                    if json {
                        println!(
                            "{}",
                            serde_json::to_string_pretty(&report.to_json()).expect("JSON of numbers")
                        );
                    } else {
                        print!("{}", report.to_table());
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("dejavud plan: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Command::Demo { stages, victim, requests, prompt_tokens, new_tokens, deadline_ms, kill, json } => {
            let exe = match std::env::current_exe() {
                Ok(exe) => exe,
                Err(e) => {
                    eprintln!("dejavud demo: cannot find its own executable: {e}");
                    return ExitCode::from(2);
                }
            };
            let config = DemoConfig {
                stages,
                victim,
                requests,
                prompt_tokens,
                new_tokens,
                deadline: std::time::Duration::from_millis(deadline_ms),
                kill: match kill {
                    KillArg::Worker => Kill::Worker,
                    KillArg::Engine => Kill::Engine,
                },
                exe,
            };
            if let Err(e) = config.validate() {
                eprintln!("dejavud demo: {e}");
                return ExitCode::from(2);
            }
            if !json {
                println!(
                    "DéjàVu demo: the reference model (8 layers, d_model 256, 8 query / 2 KV heads) as {stages} stage \
processes on loopback, {requests} requests of {prompt_tokens} prompt + {new_tokens} new tokens, \
each stage's KV copied every step to its own sidecar process and its ring successor's"
                );
            }
            match demo::run(&config, |line| {
                if !json {
                    println!("  {line}");
                }
            }) {
                Ok(report) => {
                    if json {
                        println!("{}", serde_json::to_string_pretty(&report).expect("JSON of numbers"));
                    } else {
                        print!("{}", report.to_text(&config));
                    }
                    if report.matched {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::from(1)
                    }
                }
                Err(e) => {
                    eprintln!("dejavud demo: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Command::Stage(args) => match args.run() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("dejavud stage: {e}");
                ExitCode::from(2)
            }
        },
        Command::Sidecar(args) => match args.run() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("dejavud sidecar: {e}");
                ExitCode::from(2)
            }
        },
        Command::Certs { cluster, out, force, nodes } => match certs::issue(&cluster, &out, &nodes, force) {
            Ok(report) => {
                print!("{report}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("dejavud certs: {e}");
                ExitCode::from(2)
            }
        },
    }
}
