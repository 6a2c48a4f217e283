//! `dejavu-chaos`: runs chaos scenarios against real DéjàVu processes.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use dejavu_chaos::{Options, Scenario};
use dejavud::commands::ProcessCommand;

/// Chaos harness: real multi-process DéjàVu clusters under injected faults, invariants checked.
/// Exits with 1 when an invariant was violated, 2 when the scenario or the harness failed.
#[derive(Debug, Parser)]
#[command(name = "dejavu-chaos", version, about, args_override_self = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Run a scenario (a TOML file; see chaos/scenarios and docs/operations.md).
    Run {
        /// The scenario file.
        scenario: PathBuf,
        /// Seed for the random faults (overrides the scenario's).
        #[arg(long)]
        seed: Option<u64>,
        /// Print the report as JSON (with every fault injected) instead of a table.
        #[arg(long)]
        json: bool,
        /// The executable to start stage and sidecar processes with (`dejavud`); by default this
        /// harness's own binary, which has the same subcommands.
        #[arg(long)]
        exe: Option<PathBuf>,
        /// Run each worker in a network namespace of its own, with its own address (as the
        /// scenario's `namespaces = true`); needs root and iproute2.
        #[arg(long)]
        namespaces: bool,
    },
    /// The cluster's processes, which `run` starts from this executable: `dejavud`'s.
    #[command(flatten)]
    Process(ProcessCommand),
}

fn main() -> ExitCode {
    let failed = |e: String| {
        eprintln!("dejavu-chaos: {e}");
        ExitCode::from(2)
    };
    let args = match dejavud::commands::with_config_file(std::env::args_os().collect()) {
        Ok(args) => args,
        Err(e) => return failed(format!("--config {e}")),
    };
    match Cli::parse_from(args).command {
        Command::Run { scenario, seed, json, exe, namespaces } => {
            let scenario = match Scenario::load(&scenario) {
                Ok(s) => s,
                Err(e) => return failed(e.to_string()),
            };
            let exe = match exe.map_or_else(std::env::current_exe, Ok) {
                Ok(exe) => exe,
                Err(e) => return failed(format!("cannot find this executable: {e}")),
            };
            let options = match Options::new(&scenario, exe, namespaces) {
                Ok(options) => Options { seed, ..options },
                Err(e) => return failed(e.to_string()),
            };
            let report = match dejavu_chaos::run(&scenario, &options, |line| eprintln!("  {line}")) {
                Ok(report) => report,
                Err(e) => return failed(e.to_string()),
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&report).expect("a report serializes"));
            } else {
                print!("{}", report.to_text());
            }
            if report.passed {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Command::Process(process) => {
            process.run().map_or_else(|e| failed(e.to_string()), |()| ExitCode::SUCCESS)
        }
    }
}
