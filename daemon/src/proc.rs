//! Child processes of a cluster: started from an executable whose subcommands announce where
//! they listen, killed and reaped when dropped, their standard error kept for error messages.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use thiserror::Error;

use crate::netns::Host;

/// A process that did not start.
#[derive(Debug, Error)]
#[error("cannot start {what}: {why}")]
pub struct SpawnError {
    /// Which process.
    pub what: String,
    /// Why (its standard error, when it said something).
    pub why: String,
}

/// Bytes of a child's standard error kept for error messages.
const STDERR_TAIL: usize = 8 << 10;

/// A child process, killed and reaped when dropped. Its standard error is drained continuously
/// (a full pipe would block it) and its last bytes kept for error messages.
pub struct Proc {
    child: Child,
    stderr: Arc<Mutex<VecDeque<u8>>>,
    /// The lines it wrote to standard output after its first announcement, with when they were
    /// read (the last [`LATER_LINES`]).
    later: Arc<Mutex<VecDeque<(Instant, String)>>>,
}

/// Lines of a child's standard output kept after its first announcement: a controller standing
/// by says two more when it takes the lead (`metrics ADDR`, `listening ADDR`).
const LATER_LINES: usize = 64;

impl Proc {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills it (SIGKILL) and reaps it.
    pub fn kill(&mut self) -> std::io::Result<()> {
        self.child.kill()?;
        self.child.wait().map(|_| ())
    }

    /// Sends it `signal` (`libc::SIGSTOP`, `libc::SIGCONT`, ...), unless it was already reaped.
    pub fn signal(&mut self, signal: i32) -> std::io::Result<()> {
        if self.child.try_wait()?.is_some() {
            return Ok(());
        }
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: kill(2) takes plain integers; the child is not reaped yet (checked just above,
        // and only this handle reaps it), so `pid` is still this child's and cannot be reused.
        if unsafe { libc::kill(pid, signal) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Stops it (`SIGSTOP`) and resumes it (`SIGCONT`) after `pause`, from a thread of its own,
    /// unless it has been killed by then. The resume goes through a pidfd opened while the child
    /// is known to be alive, so it can never reach another process that reused the pid.
    pub fn pause(&mut self, pause: Duration) -> std::io::Result<()> {
        if self.child.try_wait()?.is_some() {
            return Ok(());
        }
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1; the child
        // is not reaped yet (checked above, and only this handle reaps it), so `pid` is this child.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the descriptor was just returned by pidfd_open and is owned by nobody else.
        let pidfd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) };
        // The resume is scheduled before the stop, so a process is never left stopped.
        std::thread::Builder::new().name("resume".into()).spawn(move || {
            std::thread::sleep(pause);
            // SAFETY: pidfd_send_signal with a valid pidfd, a signal number, no siginfo and no
            // flags; a process that died meanwhile makes it fail with ESRCH, which is fine.
            unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    pidfd.as_raw_fd(),
                    libc::SIGCONT,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                )
            };
        })?;
        self.signal(libc::SIGSTOP)
    }

    /// How it ended, if it has (reaping it); `None` while it runs.
    pub fn exited(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        self.child.try_wait()
    }

    /// The last line it wrote to standard output, after its first announcement, that starts with
    /// `prefix`: that line without the prefix, and when it was read.
    pub fn said_later(&self, prefix: &str) -> Option<(Instant, String)> {
        let later = self.later.lock();
        later.iter().rev().find_map(|(at, line)| Some((*at, line.strip_prefix(prefix)?.trim().to_owned())))
    }

    /// The end of what it wrote to standard error.
    pub fn stderr_tail(&self) -> String {
        let tail = self.stderr.lock();
        String::from_utf8_lossy(&tail.iter().copied().collect::<Vec<_>>()).into_owned()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A started process and where it listens.
pub struct Spawned {
    /// The process.
    pub proc: Proc,
    /// Where it listens.
    pub addr: SocketAddr,
    /// Where it serves its metrics, if it said.
    pub metrics: Option<SocketAddr>,
}

/// Starts `exe args...` and waits (at most `patience`) for its `listening ADDR` line, after an
/// optional `metrics ADDR` line. Its environment names the cluster's secret
/// ([`crate::cli::cluster_secret`]).
pub fn spawn(exe: &Path, args: &[String], what: &str, patience: Duration) -> Result<Spawned, SpawnError> {
    spawn_on(None, exe, args, what, patience)
}

/// [`spawn`] of a controller on etcd, which may also announce `standby ADDR`: another controller
/// leads, and it serves once it takes the lead (then it says `listening ADDR`, which
/// [`Proc::said_later`] finds). A controller standing by has no metrics page yet.
pub fn spawn_candidate(
    exe: &Path,
    args: &[String],
    what: &str,
    patience: Duration,
) -> Result<(Spawned, bool), SpawnError> {
    let spawned = start(None, exe, args, what, patience, &["listening ", "standby "])?;
    let standing_by = spawned.1 == "standby ";
    Ok((spawned.0, standing_by))
}

/// [`spawn`], in `host`'s network namespace if one is given.
pub fn spawn_on(
    host: Option<&Arc<Host>>,
    exe: &Path,
    args: &[String],
    what: &str,
    patience: Duration,
) -> Result<Spawned, SpawnError> {
    Ok(start(host, exe, args, what, patience, &["listening "])?.0)
}

/// Starts the process and waits for a line that starts with one of `announcements` and names an
/// address; returns it with the announcement it made.
fn start(
    host: Option<&Arc<Host>>,
    exe: &Path,
    args: &[String],
    what: &str,
    patience: Duration,
    announcements: &'static [&'static str],
) -> Result<(Spawned, &'static str), SpawnError> {
    let fail = |why: String| SpawnError { what: what.to_owned(), why };
    let mut command = Command::new(exe);
    // The cluster's secret, where flags would show it to every user of the machine.
    command.env(crate::cli::SECRET_ENV, crate::cli::cluster_secret());
    if let Some(host) = host {
        host.enter(&mut command).map_err(|e| fail(format!("cannot enter {}: {e}", host.name())))?;
    }
    // Whoever starts a process here owns it: it dies with its starter, leaving nothing behind
    // when a run is interrupted. (Its flags end at a `--`, after which come an engine's.)
    let flags = args.iter().position(|a| a == "--").unwrap_or(args.len());
    let mut child = command
        .args(&args[..flags])
        .arg("--die-with-parent")
        .args(&args[flags..])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fail(e.to_string()))?;
    let stderr = Arc::new(Mutex::new(VecDeque::new()));
    let (mut out, mut err) = (child.stdout.take().expect("piped"), child.stderr.take().expect("piped"));
    let tail = stderr.clone();
    let drain = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = err.read(&mut buf) {
            let mut tail = tail.lock();
            tail.extend(&buf[..n]);
            let excess = tail.len().saturating_sub(STDERR_TAIL);
            tail.drain(..excess);
        }
    });
    let later = Arc::new(Mutex::new(VecDeque::new()));
    let mut proc = Proc { child, stderr, later: later.clone() };
    let (tx, rx) = crossbeam_channel::bounded(1);
    std::thread::spawn(move || {
        let mut reader = BufReader::new(&mut out);
        let (mut metrics, mut line) = (None, String::new());
        loop {
            line.clear();
            if !matches!(reader.read_line(&mut line), Ok(1..)) {
                break;
            }
            match line.trim().strip_prefix("metrics ") {
                Some(addr) => metrics = addr.parse().ok(),
                None => break,
            }
        }
        let _ = tx.send((line, metrics));
        // Keep reading so the child never blocks on a full stdout pipe (bytes, not text: a line
        // that is not UTF-8 must not stop the draining).
        let mut line = Vec::new();
        while matches!(reader.read_until(b'\n', &mut line), Ok(1..)) {
            let mut later = later.lock();
            if later.len() == LATER_LINES {
                later.pop_front();
            }
            later.push_back((Instant::now(), String::from_utf8_lossy(&line).trim().to_owned()));
            line.clear();
        }
    });
    let (line, metrics) = rx.recv_timeout(patience).unwrap_or_default();
    let announced = announcements.iter().find_map(|&announcement| {
        let addr = line.trim().strip_prefix(announcement)?.parse().ok()?;
        Some((addr, announcement))
    });
    match announced {
        Some((addr, announcement)) => Ok((Spawned { proc, addr, metrics }, announcement)),
        None => {
            // Once it is dead, all it wrote to standard error has been drained: the reason it
            // gave is in the message.
            let _ = proc.kill();
            let _ = drain.join();
            let said = match line.trim() {
                "" => format!("it announced nothing within {patience:?}"),
                line => line.to_owned(),
            };
            Err(fail(format!("{said} {}", proc.stderr_tail().trim())))
        }
    }
}
