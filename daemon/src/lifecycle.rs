//! How a daemon process lives and ends beside a supervisor (systemd, a container's init, a shell):
//!
//! - it outlives the process that started it unless asked not to ([`LifeArgs::die_with_parent`],
//!   which the demo and the chaos harness ask for, so that an interrupted run leaves nothing);
//! - SIGTERM and SIGINT end it cleanly: it logs why, removes the files only it uses (its local
//!   socket, its shared-memory regions), and exits with 0 ([`end_on_signals`]);
//! - a socket file left by a process that died is replaced, and one a live process listens on is
//!   an error that names the path ([`bind_unix`]);
//! - a file only one process may use at a time is locked ([`lock_exclusive`]).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Args;

/// How a daemon process is started: its flags file and its relation to the process that
/// started it.
#[derive(Clone, Debug, Default, Args)]
pub struct LifeArgs {
    /// Read flags from this TOML file first (`timeout_ms = 300`, `die_with_parent = true`, ...):
    /// flags on the command line win.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Exit when the process that started it exits. For a driver that starts and owns its
    /// processes (the demo, the chaos harness); off by default, as a supervisor (systemd, a
    /// container's init) is the parent of a daemon it keeps running.
    #[arg(long)]
    pub die_with_parent: bool,
}

impl LifeArgs {
    /// Carries the flag out; call it before starting any thread.
    pub fn apply(&self) {
        if self.die_with_parent {
            die_with_parent();
        }
    }
}

/// Why a file could not be claimed.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// A live process listens on the socket.
    #[error("{path}: another process listens there (stop it, or choose another path)")]
    InUse {
        /// The socket's path.
        path: PathBuf,
    },
    /// The path holds something other than a socket.
    #[error("{path}: exists and is not a socket (remove it, or choose another path)")]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// Another process holds the lock.
    #[error("{path}: locked by another process (is another controller using this state file?)")]
    Locked {
        /// The lock file's path.
        path: PathBuf,
    },
    /// The file system refused.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
}

/// Asks the kernel to kill this process when the thread that started it exits, so that a driver
/// that is killed or interrupted leaves no process behind. A parent already gone by then (the
/// process was re-parented) means exiting at once.
fn die_with_parent() {
    // SAFETY: prctl(PR_SET_PDEATHSIG) and getppid only read or set flags of the calling process.
    let (set, parent) = unsafe { (libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL), libc::getppid()) };
    if set != 0 {
        tracing::warn!("cannot ask to die with the parent process");
    }
    if parent == 1 {
        tracing::error!("the process that started this one (--die-with-parent) is gone: exiting");
        std::process::exit(1);
    }
}

/// Ends the process cleanly on SIGTERM or SIGINT: logs which, runs `cleanup`, and exits with 0.
///
/// Blocks both signals in the calling thread, which every thread it starts from now on inherits,
/// and waits for them on a thread of its own: call it before starting any other thread, or a
/// thread started before keeps the default action (death without cleanup).
pub fn end_on_signals(what: &'static str, cleanup: impl FnOnce() + Send + 'static) -> io::Result<()> {
    let set = termination_signals();
    // SAFETY: the set was initialised by `termination_signals`; pthread_sigmask only changes the
    // calling thread's mask.
    let blocked = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if blocked != 0 {
        return Err(io::Error::from_raw_os_error(blocked));
    }
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        let mut signal = 0;
        // SAFETY: `set` is a valid, initialised signal set and `signal` a valid place to write to;
        // both signals are blocked in every thread, so sigwait is the only one to take them.
        while unsafe { libc::sigwait(&set, &mut signal) } != 0 {}
        let name = if signal == libc::SIGINT { "SIGINT" } else { "SIGTERM" };
        tracing::info!(signal = name, "{what} stopping");
        cleanup();
        tracing::info!("{what} stopped");
        std::process::exit(0);
    })?;
    Ok(())
}

fn termination_signals() -> libc::sigset_t {
    // SAFETY: sigemptyset initialises the zeroed set before sigaddset adds valid signal numbers.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        set
    }
}

/// Whether a socket file at `path` may be bound: nothing is there, or a socket nobody listens on
/// (a process that died left it), which is removed. A live listener is [`ClaimError::InUse`].
pub fn free_unix_path(path: &Path) -> Result<(), ClaimError> {
    let io = |source| ClaimError::Io { path: path.to_owned(), source };
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io(e)),
        Ok(meta) if !meta.file_type().is_socket() => Err(ClaimError::NotASocket { path: path.to_owned() }),
        Ok(_) => match UnixStream::connect(path) {
            Ok(_) => Err(ClaimError::InUse { path: path.to_owned() }),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                tracing::info!(path = %path.display(), "replacing a socket no process listens on");
                std::fs::remove_file(path).map_err(io)
            }
            Err(e) => Err(io(e)),
        },
    }
}

/// Listens at `path`, replacing a stale socket there ([`free_unix_path`]).
pub fn bind_unix(path: &Path) -> Result<UnixListener, ClaimError> {
    free_unix_path(path)?;
    UnixListener::bind(path).map_err(|e| match e.kind() {
        io::ErrorKind::AddrInUse => ClaimError::InUse { path: path.to_owned() },
        _ => ClaimError::Io { path: path.to_owned(), source: e },
    })
}

/// Takes the exclusive lock of `path` (created if missing), waiting up to `patience` for a
/// process that holds it to let go (a predecessor just killed may not have exited yet). The lock
/// lasts as long as the returned file is open; the kernel drops it when the process dies.
pub fn lock_exclusive(path: &Path, patience: Duration) -> Result<File, ClaimError> {
    let io = |source| ClaimError::Io { path: path.to_owned(), source };
    let file = File::options().read(true).write(true).create(true).truncate(false).open(path).map_err(io)?;
    let start = Instant::now();
    loop {
        // SAFETY: flock on a file descriptor this function owns, open for the call.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(file);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::WouldBlock {
            return Err(io(e));
        }
        if start.elapsed() >= patience {
            return Err(ClaimError::Locked { path: path.to_owned() });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stale_socket_is_replaced_and_a_live_one_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        drop(UnixListener::bind(&path).unwrap());
        assert!(path.exists(), "a dropped listener leaves its file");
        let live = bind_unix(&path).unwrap();
        let refused = bind_unix(&path).unwrap_err();
        assert!(matches!(refused, ClaimError::InUse { .. }), "{refused}");
        assert!(refused.to_string().contains("s.sock"), "{refused}");
        drop(live);
        std::fs::write(dir.path().join("file"), b"x").unwrap();
        let not = bind_unix(&dir.path().join("file")).unwrap_err();
        assert!(matches!(not, ClaimError::NotASocket { .. }), "{not}");
    }

    #[test]
    fn a_lock_is_exclusive_until_its_file_is_closed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.lock");
        let held = lock_exclusive(&path, Duration::ZERO).unwrap();
        let refused = lock_exclusive(&path, Duration::from_millis(30)).unwrap_err();
        assert!(matches!(refused, ClaimError::Locked { .. }), "{refused}");
        drop(held);
        lock_exclusive(&path, Duration::ZERO).unwrap();
    }
}
