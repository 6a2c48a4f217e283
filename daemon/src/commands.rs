//! The processes a cluster is made of, as subcommands, declared once: `dejavud` and every binary
//! that starts a cluster from its own executable (the chaos harness) flatten them into their
//! command lines.

use crate::cli::{CliError, ControllerArgs, SidecarArgs, StageArgs};
use crate::spare::SpareArgs;

/// The processes a cluster is made of, as subcommands: `dejavud` declares them, and so does
/// every binary that starts a cluster from its own executable (the chaos harness).
#[derive(Debug, clap::Subcommand)]
pub enum ProcessCommand {
    /// Run one stage of the reference engine (started by `demo`).
    Stage(StageArgs),
    /// A worker's sidecar (also `dejavud worker`), beside its engine: keeps the engine's KV,
    /// received through shared memory, forwards it to the ring successor's sidecar, and keeps its
    /// predecessor's replica (started by `demo`).
    #[command(alias = "worker")]
    Sidecar(SidecarArgs),
    /// The cluster's controller: receives every process's heartbeats, declares the silent dead
    /// and issues the epoch of each recovery, kept in a state file that survives its crashes
    /// (started by `demo`).
    Controller(ControllerArgs),
    /// A spare stage: starts ahead of any failure, heartbeats to the controller as a spare, and
    /// becomes the stage a recovery assigns it (a spare sidecar is `dejavud sidecar --spare N`).
    Spare(SpareArgs),
}

impl ProcessCommand {
    /// The subcommand's name, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            ProcessCommand::Stage(_) => "stage",
            ProcessCommand::Sidecar(_) => "sidecar",
            ProcessCommand::Controller(_) => "controller",
            ProcessCommand::Spare(_) => "spare",
        }
    }

    /// Runs the process until it is told to stop or fails.
    pub fn run(self) -> Result<(), CliError> {
        match self {
            ProcessCommand::Stage(args) => args.run(),
            ProcessCommand::Sidecar(args) => args.run(),
            ProcessCommand::Controller(args) => args.run(),
            ProcessCommand::Spare(args) => args.run(),
        }
    }
}
