//! `dejavu-engine`: one pipeline stage of the reference engine as its own process, or a stage's
//! sidecar that keeps copies of KV, or the cluster's controller. Each prints `listening ADDR` once it accepts connections.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use dejavu_engine::cli::{ControllerArgs, SidecarArgs, StageArgs};
use dejavu_engine::spare::SpareArgs;

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
    /// Watch heartbeats, declare the silent dead and issue recovery epochs.
    Controller(ControllerArgs),
    /// Wait, registered as a spare, until a recovery makes this process a stage.
    Spare(SpareArgs),
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Stage(args) => args.run(),
        Command::Sidecar(args) => args.run(),
        Command::Controller(args) => args.run(),
        Command::Spare(args) => args.run(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dejavu-engine: {e}");
            ExitCode::from(2)
        }
    }
}
