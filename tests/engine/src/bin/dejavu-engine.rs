//! `dejavu-engine`: one pipeline stage of the reference engine as its own process, or a replica
//! peer that keeps stages' KV. Each prints `listening ADDR` once it accepts connections.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use dejavu_engine::cli::{ReplicaArgs, StageArgs};

#[derive(Debug, Parser)]
#[command(name = "dejavu-engine", about = "Reference engine stage or replica peer")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run one stage of the reference model.
    Stage(StageArgs),
    /// Keep stages' KV replicas in memory for them.
    Replica(ReplicaArgs),
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Stage(args) => args.run(),
        Command::Replica(args) => args.run(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dejavu-engine: {e}");
            ExitCode::from(2)
        }
    }
}
