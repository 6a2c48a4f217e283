//! Logs of the cluster's processes: `tracing` events on standard error, as text for people or as
//! JSON lines for a log pipeline, filtered by a `tracing` directive (`info`, `warn`,
//! `dejavud=debug`, ...).

use clap::{Args, ValueEnum};
use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One line of text per event.
    #[default]
    Human,
    /// One JSON object per line.
    Json,
}

/// Logging options shared by the stage, sidecar and controller subcommands.
#[derive(Clone, Debug, Args)]
pub struct LogArgs {
    /// Log format on standard error.
    #[arg(long, value_enum, default_value = "human")]
    pub log_format: LogFormat,
    /// Which events to log: a `tracing` filter directive (`info`, `warn`, `dejavud=debug`); taken
    /// from `RUST_LOG` when the flag is not given.
    #[arg(long, env = "RUST_LOG", default_value = "info")]
    pub log: String,
}

impl Default for LogArgs {
    fn default() -> Self {
        Self { log_format: LogFormat::Human, log: "info".to_owned() }
    }
}

/// Why a process's logs could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LoggingError {
    /// `--log` is not a `tracing` filter.
    #[error("bad --log filter {filter:?}: {reason}")]
    Filter {
        /// The filter given.
        filter: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A subscriber was installed already.
    #[error("cannot install the logger: {0}")]
    Install(String),
}

impl LogArgs {
    /// Installs the process's log subscriber; a bad filter is an error naming it.
    pub fn init(&self) -> Result<(), LoggingError> {
        let filter = EnvFilter::try_new(&self.log)
            .map_err(|e| LoggingError::Filter { filter: self.log.clone(), reason: e.to_string() })?;
        let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
        let installed = match self.log_format {
            LogFormat::Human => builder.with_ansi(false).try_init(),
            LogFormat::Json => builder.json().with_current_span(false).try_init(),
        };
        installed.map_err(|e| LoggingError::Install(e.to_string()))
    }
}
