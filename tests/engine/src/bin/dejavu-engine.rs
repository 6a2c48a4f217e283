//! `dejavu-engine`: one pipeline stage of the reference engine as its own process, or a stage's
//! sidecar that keeps copies of KV. Each prints `listening ADDR` once it accepts connections.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use dejavu_engine::cli::{SidecarArgs, StageArgs};

#[derive(Debug, Parser)]
#[command(name = "dejavu-engine", about = "Reference engine stage or sidecar")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run one stage of the reference model.
    Stage(StageArgs),
    /// Keep a stage's local KV copy and its predecessor's replica.
    Sidecar(SidecarArgs),
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Stage(args) => args.run(),
        Command::Sidecar(args) => args.run(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dejavu-engine: {e}");
            ExitCode::from(2)
        }
    }
}
