//! A `dejavud controller` process the benchmarks start: the lines it prints, its metrics and its
//! CPU time; killed when dropped.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::Duration;

use dejavud::metrics::{scrape, value_of};

/// The secret the benchmarks' controllers and their simulated members share.
pub const SECRET: &str = "controller bench";

/// A controller process and the lines it prints.
pub struct ControllerProcess {
    child: Child,
    lines: Receiver<String>,
}

impl ControllerProcess {
    /// Starts `exe controller ARGS` with the benchmarks' secret.
    pub fn start(exe: &Path, args: &[String]) -> Result<Self, String> {
        let mut child = Command::new(exe)
            .arg("controller")
            .args(args)
            .env("DEJAVU_SECRET", SECRET)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start a controller: {e}"))?;
        let out = BufReader::new(child.stdout.take().ok_or("no standard output")?);
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Ok(Self { child, lines })
    }

    /// Waits for a line starting with `prefix`; returns the rest of it.
    pub fn says(&self, prefix: &str) -> Result<String, String> {
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(30))
                .map_err(|_| format!("a controller never said {prefix:?}"))?;
            if let Some(rest) = line.strip_prefix(prefix) {
                return Ok(rest.trim().to_owned());
            }
        }
    }

    /// Waits for a line `prefix ADDR`; returns the address.
    pub fn address(&self, prefix: &str) -> Result<SocketAddr, String> {
        let rest = self.says(prefix)?;
        rest.parse().map_err(|e| format!("{prefix}{rest}: {e}"))
    }

    /// User and system CPU seconds the process has used (counted in the kernel's ticks).
    pub fn cpu_seconds(&self) -> Result<f64, String> {
        crate::cpu_time::of_process(self.child.id()).map(|d| d.as_secs_f64())
    }
}

impl Drop for ControllerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of `name` (with `labels`) on the metrics page at `metrics`.
pub fn metric(metrics: SocketAddr, name: &str, labels: &[(&str, &str)]) -> Result<f64, String> {
    let page = scrape(metrics).map_err(|e| e.to_string())?;
    value_of(&page, name, labels).ok_or_else(|| format!("no {name} in the controller's metrics"))
}
