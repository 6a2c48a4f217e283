//! A pipeline of stage and sidecar processes on loopback, started from an executable that has the
//! `stage` and `sidecar` subcommands of [`crate::cli`] (`dejavu-engine` or `dejavud`), a heartbeat
//! monitor that says which of them died, and the recovery procedure that replaces a dead worker.
//! The demo and the process tests share it.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpListener};
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use thiserror::Error;

use crate::heartbeat::Monitor;
pub use crate::heartbeat::Role;
use crate::pipeline::Seat;
use crate::process::{ProcessError, RemotePipeline};

/// What dies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kill {
    /// The engine process alone: its sidecar lives on with the local copy of its KV.
    Engine,
    /// The whole worker, engine and sidecar: its KV comes back from its ring successor's sidecar.
    Worker,
}

/// Errors of starting or repairing a cluster.
#[derive(Debug, Error)]
pub enum ClusterError {
    /// A process did not start.
    #[error("cannot start {what}: {why}")]
    Spawn {
        /// Which process.
        what: String,
        /// Why (its standard error, when it said something).
        why: String,
    },
    /// The chain failed in a way recovery does not cover.
    #[error(transparent)]
    Pipeline(#[from] ProcessError),
    /// A local operation failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The cluster cannot do what was asked.
    #[error("{0}")]
    Invalid(String),
}

/// Bytes of a child's standard error kept for error messages.
const STDERR_TAIL: usize = 8 << 10;

/// A child process, killed and reaped when dropped. Its standard error is drained continuously
/// (a full pipe would block it) and its last bytes kept for error messages.
pub struct Proc {
    child: Child,
    stderr: Arc<Mutex<VecDeque<u8>>>,
}

impl Proc {
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

/// Starts `exe args...` and waits (at most `patience`) for its `listening ADDR` line.
pub fn spawn(
    exe: &Path,
    args: &[String],
    what: &str,
    patience: Duration,
) -> Result<(Proc, SocketAddr), ClusterError> {
    let fail = |why: String| ClusterError::Spawn { what: what.to_owned(), why };
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fail(e.to_string()))?;
    let stderr = Arc::new(Mutex::new(VecDeque::new()));
    let (mut out, mut err) = (child.stdout.take().expect("piped"), child.stderr.take().expect("piped"));
    let tail = stderr.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = err.read(&mut buf) {
            let mut tail = tail.lock();
            tail.extend(&buf[..n]);
            let excess = tail.len().saturating_sub(STDERR_TAIL);
            tail.drain(..excess);
        }
    });
    let mut proc = Proc { child, stderr };
    let (tx, rx) = crossbeam_channel::bounded(1);
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(&mut out).read_line(&mut line);
        let _ = tx.send(line);
        // Keep reading so the child never blocks on a full stdout pipe.
        let _ = std::io::copy(&mut out, &mut std::io::sink());
    });
    let line = rx.recv_timeout(patience).unwrap_or_default();
    match line.trim().strip_prefix("listening ").and_then(|a| a.parse().ok()) {
        Some(addr) => Ok((proc, addr)),
        None => {
            let _ = proc.kill();
            Err(fail(format!("{} {}", line.trim(), proc.stderr_tail().trim())))
        }
    }
}

/// A connection between the processes of a cluster that something (a fault-injecting proxy) may be
/// put on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Link {
    /// Activations from stage `from` to stage `from + 1`.
    Activation {
        /// The sending stage.
        from: u32,
    },
    /// KV copies from stage `from` to its ring successor's sidecar (and, after a replacement, the
    /// restore from it).
    Replica {
        /// The sending stage.
        from: u32,
    },
}

/// Says which address a process is given for a link: the target's own, or one in front of it.
pub trait Interpose: Send + Sync + std::fmt::Debug {
    /// The address to connect to for `link` to reach `target`.
    fn route(&self, link: Link, target: SocketAddr) -> SocketAddr;
}

/// What a cluster runs.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// The executable with the `stage` and `sidecar` subcommands.
    pub exe: PathBuf,
    /// Layers of each stage.
    pub splits: Vec<Range<u32>>,
    /// Sequences per microbatch.
    pub slots: u32,
    /// Microbatches.
    pub microbatches: u32,
    /// Tokens per sequence at most.
    pub max_tokens: u32,
    /// Whether stages keep copies of their KV in sidecars.
    pub replicate: bool,
    /// Time a step may take before the driver looks for a dead stage.
    pub deadline: Duration,
    /// Time between heartbeats; a process silent for three is dead.
    pub heartbeat: Duration,
    /// What stands between processes, if anything (see [`Link`]).
    pub interpose: Option<Arc<dyn Interpose>>,
    /// For testing fault checkers only: stages skip the copy to their successor's sidecar while
    /// still claiming to replicate, so a worker failure loses KV the recovery expects.
    pub sabotage_replicas: bool,
}

impl ClusterConfig {
    /// One replicated stage of the whole reference model, 4 slots in one microbatch, started from
    /// `exe`; the fields are public for the rest.
    pub fn new(exe: PathBuf) -> Self {
        Self {
            exe,
            splits: std::iter::once(0..crate::ModelConfig::reference().layers).collect(),
            slots: 4,
            microbatches: 1,
            max_tokens: 256,
            replicate: true,
            deadline: Duration::from_millis(300),
            heartbeat: Duration::from_millis(100),
            interpose: None,
            sabotage_replicas: false,
        }
    }

    /// The address to give a process for `link` to reach `target`.
    fn route(&self, link: Link, target: SocketAddr) -> SocketAddr {
        self.interpose.as_ref().map_or(target, |i| i.route(link, target))
    }
}

/// One sequence as the driver knows it.
#[derive(Clone, Copy, Debug)]
pub struct Sequence<'a> {
    /// Where it lives.
    pub seat: Seat,
    /// Its prompt.
    pub prompt: &'a [u32],
    /// The tokens generated so far.
    pub generated: &'a [u32],
}

impl Sequence<'_> {
    /// Prompt length and tokens with KV (the prompt and every generated token but the last).
    fn kv(&self) -> (u32, u32) {
        let prompt_len = self.prompt.len() as u32;
        (prompt_len, prompt_len + self.generated.len().saturating_sub(1) as u32)
    }
}

/// A running pipeline: stage processes, their sidecars (when replicating) and the driver's end.
pub struct Cluster {
    config: ClusterConfig,
    /// One per stage; stage `k` keeps its local copy in sidecar `k` and its replica in `k + 1`.
    sidecars: Vec<(Proc, SocketAddr)>,
    stages: Vec<Proc>,
    addrs: Vec<SocketAddr>,
    driver: SocketAddr,
    monitor: Monitor,
    /// The driver's end of the chain.
    pub remote: RemotePipeline,
}

/// Time a process has to start listening.
const START: Duration = Duration::from_secs(30);

impl Cluster {
    /// Starts sidecars (when replicating), then the stages last first (so each knows where to
    /// send), and connects to them.
    pub fn start(config: ClusterConfig) -> Result<Self, ClusterError> {
        let n = config.splits.len();
        let monitor = Monitor::start(config.heartbeat * 3)?;
        let mut sidecars = Vec::new();
        if config.replicate {
            for i in 0..n {
                let args = Self::sidecar_args(&config, &monitor, i);
                sidecars.push(spawn(&config.exe, &args, &format!("sidecar {i}"), START)?);
            }
        }
        let results = TcpListener::bind("127.0.0.1:0")?;
        let driver = results.local_addr()?;
        let (mut stages, mut addrs, mut next) = (Vec::new(), Vec::new(), driver);
        for index in (0..n).rev() {
            let args = Self::stage_args(&config, &monitor, Self::copies(&sidecars, index), index, next);
            let (proc, addr) = spawn(&config.exe, &args, &format!("stage {index}"), START)?;
            stages.push(proc);
            addrs.push(addr);
            next = addr;
        }
        stages.reverse();
        addrs.reverse();
        // Every process beats before the cluster is up, so silence later means death.
        for index in 0..n as u32 {
            let roles: &[Role] =
                if config.replicate { &[Role::Engine, Role::Sidecar] } else { &[Role::Engine] };
            for &role in roles {
                if !monitor.wait_alive(role, index, START) {
                    return Err(ClusterError::Invalid(format!("{role:?} {index} never sent a heartbeat")));
                }
            }
        }
        let remote = RemotePipeline::connect(next, results, config.deadline)?;
        Ok(Self { config, sidecars, stages, addrs, driver, monitor, remote })
    }

    fn sidecar_args(config: &ClusterConfig, monitor: &Monitor, index: usize) -> Vec<String> {
        vec![
            "sidecar".to_owned(),
            format!("--index={index}"),
            format!("--heartbeat={}", monitor.addr()),
            format!("--heartbeat-ms={}", config.heartbeat.as_millis()),
        ]
    }

    fn stage_args(
        config: &ClusterConfig,
        monitor: &Monitor,
        sidecars: Option<(SocketAddr, SocketAddr)>,
        index: usize,
        next: SocketAddr,
    ) -> Vec<String> {
        let layers = &config.splits[index];
        let last = index + 1 == config.splits.len();
        // The link to the driver is its own: faults go between processes of the cluster.
        let next = if last { next } else { config.route(Link::Activation { from: index as u32 }, next) };
        let mut args = vec![
            "stage".to_owned(),
            format!("--index={index}"),
            format!("--layers={}..{}", layers.start, layers.end),
            format!("--next={next}"),
            format!("--slots={}", config.slots),
            format!("--microbatches={}", config.microbatches),
            format!("--max-tokens={}", config.max_tokens),
            format!("--heartbeat={}", monitor.addr()),
            format!("--heartbeat-ms={}", config.heartbeat.as_millis()),
        ];
        if let Some((local, successor)) = sidecars {
            let successor = config.route(Link::Replica { from: index as u32 }, successor);
            args.push(format!("--local={local}"));
            args.push(format!("--successor={successor}"));
        }
        if config.sabotage_replicas {
            args.push("--test-only-skip-replicas".to_owned());
        }
        args
    }

    /// Stage `index`'s sidecars: its own and its ring successor's.
    fn copies(sidecars: &[(Proc, SocketAddr)], index: usize) -> Option<(SocketAddr, SocketAddr)> {
        (!sidecars.is_empty()).then(|| (sidecars[index].1, sidecars[(index + 1) % sidecars.len()].1))
    }

    /// Stages.
    pub fn len(&self) -> usize {
        self.stages.len()
    }

    /// Whether it has no stage (never: a cluster has at least one).
    pub fn is_empty(&self) -> bool {
        self.stages.is_empty()
    }

    /// Kills stage `victim`'s engine, and with [`Kill::Worker`] its sidecar too.
    pub fn kill(&mut self, victim: usize, what: Kill) -> Result<(), ClusterError> {
        if what == Kill::Worker && (self.sidecars.is_empty() || self.len() < 2) {
            return Err(ClusterError::Invalid(
                "killing a worker needs replication and two stages or more".into(),
            ));
        }
        self.stages[victim].kill()?;
        if what == Kill::Worker {
            self.sidecars[victim].0.kill()?;
        }
        Ok(())
    }

    /// Stage `stage`'s engine or sidecar.
    fn process(&mut self, stage: usize, role: Role) -> Result<&mut Proc, ClusterError> {
        let proc = match role {
            Role::Engine => self.stages.get_mut(stage),
            Role::Sidecar => self.sidecars.get_mut(stage).map(|(proc, _)| proc),
        };
        proc.ok_or_else(|| ClusterError::Invalid(format!("no {role:?} {stage}")))
    }

    /// Sends `signal` to stage `stage`'s engine or sidecar; a process already dead is left alone.
    pub fn signal(&mut self, stage: usize, role: Role, signal: i32) -> Result<(), ClusterError> {
        Ok(self.process(stage, role)?.signal(signal)?)
    }

    /// Stops stage `stage`'s engine or sidecar for `pause` (see [`Proc::pause`]): shorter than the
    /// heartbeat timeout it is a slow process, longer it is declared dead and replaced (and killed,
    /// so it cannot come back).
    pub fn pause(&mut self, stage: usize, role: Role, pause: Duration) -> Result<(), ClusterError> {
        Ok(self.process(stage, role)?.pause(pause)?)
    }

    /// Every stage whose engine has fallen silent, and whether its sidecar has too.
    pub fn dead(&self) -> Vec<(usize, Kill)> {
        (0..self.len())
            .filter(|&i| self.monitor.is_dead(Role::Engine, i as u32))
            .map(|stage| {
                let sidecar_dead = self.config.replicate && self.monitor.is_dead(Role::Sidecar, stage as u32);
                (stage, if sidecar_dead { Kill::Worker } else { Kill::Engine })
            })
            .collect()
    }

    /// Waits at most `patience` for dead stages to show (a heartbeat timeout takes a few
    /// intervals), as [`Cluster::dead`] reports them; empty if none did. Once one has, processes
    /// that have been silent for half the timeout get the rest of it to beat again or be declared
    /// dead too, so that workers that died together are recovered together.
    pub fn detect(&self, patience: Duration) -> Vec<(usize, Kill)> {
        let start = Instant::now();
        let mut first: Option<Instant> = None;
        loop {
            let dead = self.dead();
            if !dead.is_empty() {
                let since = *first.get_or_insert_with(Instant::now);
                let dying = (0..self.len() as u32).any(|i| {
                    let suspect = |role| self.monitor.is_suspect(role, i) && !self.monitor.is_dead(role, i);
                    suspect(Role::Engine) || (self.config.replicate && suspect(Role::Sidecar))
                });
                if !dying || since.elapsed() >= self.config.heartbeat * 3 {
                    return dead;
                }
            } else if start.elapsed() >= patience {
                return dead;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// A sidecar that fell silent while its engine lives (not a failure this cluster recovers from).
    pub fn orphaned_engine(&self) -> Option<usize> {
        (0..self.sidecars.len()).find(|&i| {
            self.monitor.is_dead(Role::Sidecar, i as u32) && !self.monitor.is_dead(Role::Engine, i as u32)
        })
    }

    /// Replaces dead stage `victim` and recovers every sequence on it; see
    /// [`Cluster::recover_all`]. Returns the steps recomputed.
    pub fn recover(
        &mut self,
        victim: usize,
        what: Kill,
        sequences: &[Sequence<'_>],
    ) -> Result<u64, ClusterError> {
        Ok(self.recover_all(&[(victim, what)], sequences)?.recomputed)
    }

    /// Replaces the dead stages `victims` and recovers every sequence on them:
    ///
    /// 1. the presumed-dead processes are killed (fenced), and replacement sidecars start for the
    ///    ones that died;
    /// 2. replacement engines start (the last first, so each knows where to send) and the chain is
    ///    repaired around them;
    /// 3. a live predecessor of a replaced sidecar replicates to the new one from now on, starting
    ///    with each sequence's KV so far (before anything is recomputed, so the recomputed steps'
    ///    copies land there too);
    /// 4. each replacement restores each sequence's KV, from its own sidecar if that survived or
    ///    from its successor's, and the steps the copies lacked are recomputed. When the successor
    ///    died too (adjacent workers), that copy is gone: the ring cannot restore the stage, and
    ///    its sequences are recomputed from their prompts ([`Recovered::copies_lost`] says so);
    /// 5. a replaced predecessor of a replaced sidecar copies its restored KV there.
    pub fn recover_all(
        &mut self,
        victims: &[(usize, Kill)],
        sequences: &[Sequence<'_>],
    ) -> Result<Recovered, ClusterError> {
        let n = self.len();
        if self.sidecars.is_empty() {
            return Err(ClusterError::Invalid("recovery needs replication".into()));
        }
        let mut victims = victims.to_vec();
        victims.sort_by_key(|&(stage, _)| stage);
        victims.dedup_by_key(|&mut (stage, _)| stage);
        if victims.iter().any(|&(stage, _)| stage >= n) {
            return Err(ClusterError::Invalid(format!("no such stage in {victims:?}")));
        }
        let died = |stage: usize, what: Kill| victims.contains(&(stage, what));
        let replaced = |stage: usize| victims.iter().any(|&(s, _)| s == stage);
        let silent = |role: Role, index: usize| {
            ClusterError::Invalid(format!("the replacement {role:?} {index} sends no heartbeat"))
        };
        // Fencing: a process presumed dead may only be slow; make sure it is gone before its
        // replacement takes its place.
        for &(victim, what) in &victims {
            let _ = self.stages[victim].kill();
            self.monitor.forget(Role::Engine, victim as u32);
            if what == Kill::Worker {
                let _ = self.sidecars[victim].0.kill();
                self.monitor.forget(Role::Sidecar, victim as u32);
            }
        }
        for &(victim, _) in victims.iter().filter(|&&(_, what)| what == Kill::Worker) {
            let args = Self::sidecar_args(&self.config, &self.monitor, victim);
            self.sidecars[victim] = spawn(&self.config.exe, &args, "a replacement sidecar", START)?;
            if !self.monitor.wait_alive(Role::Sidecar, victim as u32, START) {
                return Err(silent(Role::Sidecar, victim));
            }
        }
        for &(victim, _) in victims.iter().rev() {
            let next = if victim + 1 == n { self.driver } else { self.addrs[victim + 1] };
            let copies = Self::copies(&self.sidecars, victim);
            let args = Self::stage_args(&self.config, &self.monitor, copies, victim, next);
            let (proc, addr) = spawn(&self.config.exe, &args, "a replacement stage", START)?;
            self.stages[victim] = proc;
            self.addrs[victim] = addr;
            if !self.monitor.wait_alive(Role::Engine, victim as u32, START) {
                return Err(silent(Role::Engine, victim));
            }
        }
        let reachable: Vec<(u32, SocketAddr)> = victims
            .iter()
            .map(|&(victim, _)| {
                let (index, addr) = (victim as u32, self.addrs[victim]);
                let reach = if victim == 0 {
                    addr
                } else {
                    self.config.route(Link::Activation { from: index - 1 }, addr)
                };
                (index, reach)
            })
            .collect();
        self.remote.replace_all(&reachable, replaced(n - 1))?;
        // Where each replaced sidecar's replica comes from: its predecessor, now or once restored.
        let mut copy_later = Vec::new();
        for &(victim, _) in victims.iter().filter(|&&(_, what)| what == Kill::Worker) {
            let predecessor = (victim + n - 1) % n;
            let to = self.config.route(Link::Replica { from: predecessor as u32 }, self.sidecars[victim].1);
            if replaced(predecessor) {
                copy_later.push((predecessor, to));
            } else {
                self.copy_kv_to(predecessor, to, sequences)?;
            }
        }
        let mut copies_lost = Vec::new();
        let sources: Vec<(u32, Option<SocketAddr>)> = victims
            .iter()
            .map(|&(victim, what)| {
                let from = (what == Kill::Worker).then(|| {
                    let successor = (victim + 1) % n;
                    if died(successor, Kill::Worker) {
                        copies_lost.push(victim);
                    }
                    self.config.route(Link::Replica { from: victim as u32 }, self.sidecars[successor].1)
                });
                (victim as u32, from)
            })
            .collect();
        let mut recovered = Recovered {
            recomputed: 0,
            lag: victims.iter().map(|&(victim, _)| (victim, 0)).collect(),
            copies_lost,
        };
        for s in sequences {
            let sequence = self.remote.recover(&sources, s.seat, s.prompt, s.generated)?;
            recovered.recomputed += sequence.recomputed;
            for (total, lacked) in recovered.lag.iter_mut().zip(sequence.lacked) {
                total.1 += lacked;
            }
        }
        for (predecessor, to) in copy_later {
            self.copy_kv_to(predecessor, to, sequences)?;
        }
        Ok(recovered)
    }

    /// Makes stage `stage` replicate to the sidecar at `to` from now on, starting with every
    /// sequence's KV so far.
    fn copy_kv_to(
        &mut self,
        stage: usize,
        to: SocketAddr,
        sequences: &[Sequence<'_>],
    ) -> Result<(), ClusterError> {
        for s in sequences.iter().filter(|s| !s.generated.is_empty()) {
            let (prompt_len, kv_tokens) = s.kv();
            self.remote.replicate_to(stage as u32, s.seat, prompt_len, kv_tokens, to)?;
        }
        // Retarget even when no sequence has started.
        self.remote.replicate_to(stage as u32, Seat { microbatch: 0, slot: 0 }, 0, 0, to)?;
        Ok(())
    }
}

/// What a recovery did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Steps recomputed (the largest replication lag among the victims, summed over the
    /// sequences).
    pub recomputed: u64,
    /// Each victim and the steps its copies lacked, summed over the sequences.
    pub lag: Vec<(usize, u64)>,
    /// Replaced stages whose copies died with them (their successor's worker died too): their
    /// sequences were recomputed from the prompt, as the ring cannot restore them.
    pub copies_lost: Vec<usize>,
}
