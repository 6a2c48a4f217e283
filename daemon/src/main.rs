//! `dejavud`: the DéjàVu daemon's command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use dejavud::certs;
use dejavud::commands::ProcessCommand;
use dejavud::demo::{self, DemoConfig, DemoEngine, DemoSettings};
use dejavud::plan::{self, Overrides};

/// The DéjàVu daemon: a fault-tolerance demo, the deployment planner and cluster certificates.
#[derive(Debug, Parser)]
#[command(name = "dejavud", version, about, args_override_self = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Run the reference model as a pipeline of stage processes on loopback, SIGKILL one stage in
    /// the middle of decoding, recover it from replicated KV, and compare with a failure-free run
    /// and a restart from scratch.
    Demo {
        #[command(flatten)]
        settings: DemoSettings,
        /// A TOML file of the same settings (`stages = 4`, `kill = "engine"`, ...); flags override it.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    #[command(flatten)]
    Process(ProcessCommand),
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

/// "CPU 3" or "CPUs 0-3,8".
fn cpus_named(cpus: &dejavulib::affinity::CpuList) -> String {
    match cpus.cpus() {
        [one] => format!("CPU {one}"),
        _ => format!("CPUs {cpus}"),
    }
}

fn main() -> ExitCode {
    let args = match dejavud::commands::with_config_file(std::env::args_os().collect()) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("dejavud: --config {e}");
            return ExitCode::from(2);
        }
    };
    let cli = Cli::parse_from(args);
    match cli.command {
        Command::Plan { input, json, calibration, prompt_ms, token_ms, streaming_overhead } => {
            let flags = Overrides { prompt_ms, token_ms, streaming_overhead };
            match plan::run(&input, calibration.as_deref(), flags) {
                Ok(report) => {
                    if json {
                        let text = serde_json::to_string_pretty(&report.to_json()).expect("JSON of numbers");
                        emit(&format!("{text}\n"));
                    } else {
                        emit(&report.to_table());
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("dejavud plan: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Command::Demo { settings, config, json } => {
            let exe = match std::env::current_exe() {
                Ok(exe) => exe,
                Err(e) => {
                    eprintln!("dejavud demo: cannot find its own executable: {e}");
                    return ExitCode::from(2);
                }
            };
            let file = match config.as_deref().map(DemoSettings::load).transpose() {
                Ok(file) => file.unwrap_or_default(),
                Err(e) => {
                    eprintln!("dejavud demo: {e}");
                    return ExitCode::from(2);
                }
            };
            let config = settings.or(file).resolve(exe);
            let DemoConfig { stages, requests, prompt_tokens, new_tokens, namespaces, .. } = config;
            let model = match config.engine {
                DemoEngine::Reference => "the reference model",
                DemoEngine::Torch { .. } => {
                    "the PyTorch engine (a transformers Llama with seeded random weights) as an engine process under each stage"
                }
            };
            let cpus = match &config.cpus {
                Some(split) => format!(
                    "; the stages compute on {}, their streamers and sidecars copy on {}",
                    cpus_named(&split.compute),
                    cpus_named(&split.replication)
                ),
                None => String::new(),
            };
            let on =
                if namespaces { "with each worker in a network namespace of its own" } else { "on loopback" };
            if let Err(e) = config.validate() {
                eprintln!("dejavud demo: {e}");
                return ExitCode::from(2);
            }
            // A ring of one stage has no other sidecar to keep a replica.
            let copies = if stages == 1 {
                "its own sidecar process (local copies only: a ring of one stage)"
            } else {
                "its own sidecar process and its ring successor's"
            };
            if !json {
                emit(&format!(
                    "DéjàVu demo: {model}, 8 layers, d_model 256, 8 query / 2 KV heads, as {stages} stage \
processes {on}, {requests} requests of {prompt_tokens} prompt + {new_tokens} new tokens, \
each stage's KV copied every step to {copies}, every process heartbeating to a controller process{cpus}\n"
                ));
            }
            match demo::run(&config, |line| {
                if !json {
                    emit(&format!("  {line}\n"));
                }
            }) {
                Ok(report) => {
                    if json {
                        emit(&format!(
                            "{}\n",
                            serde_json::to_string_pretty(&report).expect("JSON of numbers")
                        ));
                    } else {
                        emit(&report.to_text(&config));
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
        Command::Process(process) => served(process.name(), process.run()),
        Command::Certs { cluster, out, force, nodes } => match certs::issue(&cluster, &out, &nodes, force) {
            Ok(report) => {
                emit(&report.to_string());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("dejavud certs: {e}");
                ExitCode::from(2)
            }
        },
    }
}

/// Writes `text` to standard output. A reader that went away (`dejavud plan --json | head -c 10`)
/// ends the process quietly, as Unix tools do; another failure ends it with status 2.
fn emit(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("dejavud: cannot write to standard output: {e}");
        std::process::exit(2);
    }
}

/// The exit of a process the demo starts: 0 when it stops cleanly, 2 with the reason otherwise.
fn served(what: &str, result: Result<(), dejavud::cli::CliError>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dejavud {what}: {e}");
            ExitCode::from(2)
        }
    }
}
