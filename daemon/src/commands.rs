//! The processes a cluster is made of, as subcommands, declared once: `dejavud` and every binary
//! that starts a cluster from its own executable (the chaos harness) flatten them into their
//! command lines.

use std::ffi::OsString;

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

/// The subcommands that take `--config FILE`.
const CONFIGURABLE: [&str; 5] = ["stage", "sidecar", "worker", "controller", "spare"];

/// A process subcommand's command line with the flags of its `--config FILE` (TOML) put before
/// its own, which win (the parser keeps the last of a flag given twice). Each key is a flag's
/// name (`timeout_ms` or `timeout-ms` for `--timeout-ms`): a string or number is its value, `true`
/// sets a switch (`false` leaves it off), a list gives the flag once per item. A key that is no
/// flag is refused by the parser, by name. Other command lines come back as they are.
pub fn with_config_file(args: Vec<OsString>) -> Result<Vec<OsString>, String> {
    let Some(command) = args.get(1).and_then(|a| a.to_str()) else { return Ok(args) };
    if !CONFIGURABLE.contains(&command) {
        return Ok(args);
    }
    let path = args.iter().enumerate().skip(2).find_map(|(i, arg)| match arg.to_str()? {
        "--config" => args.get(i + 1).cloned(),
        other => other.strip_prefix("--config=").map(OsString::from),
    });
    let Some(path) = path else { return Ok(args) };
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.to_string_lossy()))?;
    let table: toml::Table = text.parse().map_err(|e| format!("{}: {e}", path.to_string_lossy()))?;
    let mut flags = Vec::new();
    for (key, value) in table {
        let flag = format!("--{}", key.replace('_', "-"));
        let items = match value {
            toml::Value::Array(items) => items,
            one => vec![one],
        };
        for item in items {
            match item {
                toml::Value::Boolean(true) => flags.push(OsString::from(&flag)),
                toml::Value::Boolean(false) => {}
                toml::Value::String(v) => flags.push(OsString::from(format!("{flag}={v}"))),
                toml::Value::Integer(v) => flags.push(OsString::from(format!("{flag}={v}"))),
                toml::Value::Float(v) => flags.push(OsString::from(format!("{flag}={v}"))),
                other => {
                    return Err(format!("{}: {key} = {other} is not a flag's value", path.to_string_lossy()))
                }
            }
        }
    }
    let mut expanded = args[..2].to_vec();
    expanded.extend(flags);
    expanded.extend(args[2..].iter().cloned());
    Ok(expanded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_files_flags_come_first_and_others_are_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("sidecar.toml");
        std::fs::write(&file, "local = \"/run/s0.sock\"\nregion_bytes = 1024\ndie-with-parent = true\nlog = [\"info\"]\nquiet = false\n").unwrap();
        let args = |list: &[&str]| list.iter().map(OsString::from).collect::<Vec<_>>();
        let config = format!("--config={}", file.display());
        let expanded =
            with_config_file(args(&["dejavud", "sidecar", &config, "--region-bytes", "8"])).unwrap();
        assert_eq!(
            expanded,
            args(&[
                "dejavud",
                "sidecar",
                "--die-with-parent",
                "--local=/run/s0.sock",
                "--log=info",
                "--region-bytes=1024",
                &config,
                "--region-bytes",
                "8"
            ])
        );
        let plan = args(&["dejavud", "plan", "--config", "x"]);
        assert_eq!(with_config_file(plan.clone()).unwrap(), plan, "not a process subcommand");
        std::fs::write(&file, "nested = { a = 1 }").unwrap();
        assert!(with_config_file(args(&["dejavud", "sidecar", &config])).unwrap_err().contains("nested"));
    }
}
