//! The cluster's controllers and its connection to the one in charge.
//!
//! - **Embedded** (the default): one controller with a state file. One that dies or stops
//!   answering is replaced on the same port and file, and goes on where it stopped.
//! - **On etcd**: several controllers of one cluster, each with a port of its own; members beat to
//!   all of them. The one that leads announces `listening ADDR`, the others `standby ADDR` first.
//!   The cluster asks the newest leader that answers. When the one it asked does not answer, it
//!   follows the leader that took over, and then starts again, on their ports, the controllers
//!   that exited (killed, or deposed: status [`DEPOSED_EXIT`]), as a supervisor would; they stand
//!   by.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::config::{ControlPlane, EtcdControllers, Recoveries};
use super::{secret, ClusterConfig, ClusterError, Link, START};
use crate::controller::{ControllerClient, ControllerError, DEPOSED_EXIT};
use crate::proc::{spawn, spawn_candidate, Proc, Spawned};

/// How long a controller started again on etcd has to say it stands by (or leads).
const CANDIDATE_START: Duration = Duration::from_secs(3);

/// Where the controller in charge listens, shared with whoever follows it (the fence watch).
pub(super) type LeaderAddr = Arc<Mutex<SocketAddr>>;

/// How one controller process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ControllerEnd {
    /// Still running when the cluster was asked.
    Running,
    /// Killed, by a fault or by the cluster replacing it.
    Killed,
    /// It found it had lost the leadership and stopped ([`DEPOSED_EXIT`]).
    Deposed,
    /// It exited by itself with this status (`None`: a signal it did not get from the cluster).
    Exited(Option<i32>),
}

/// One controller process's life, as the cluster saw it.
#[derive(Clone, Debug)]
pub struct ControllerLife {
    /// Its process id.
    pub pid: u32,
    /// Whether it led (announced `listening`) at some point.
    pub led: bool,
    /// Whether a fault stopped it (SIGSTOP) while it led, and another controller announced the
    /// lead before it was resumed: it was deposed while it thought it led.
    pub deposed_while_paused: bool,
    /// How it ended.
    pub end: ControllerEnd,
}

/// One controller's place: its port stays, its process may be replaced.
struct Seat {
    proc: Proc,
    addr: SocketAddr,
    /// Its metrics page, once it leads.
    metrics: Option<SocketAddr>,
    /// Its command line, with its own port.
    args: Vec<String>,
    /// When it started leading, if it has.
    leading_since: Option<Instant>,
    /// When a fault paused it, and for how long, if one did while it led.
    paused: Option<(Instant, Duration)>,
    /// Whether the cluster killed it (rather than it exiting by itself).
    killed: bool,
}

impl Seat {
    fn started(spawned: Spawned, args: Vec<String>, standing_by: bool) -> Self {
        let leading_since = (!standing_by).then(Instant::now);
        let metrics = spawned.metrics;
        Self {
            proc: spawned.proc,
            addr: spawned.addr,
            metrics,
            args,
            leading_since,
            paused: None,
            killed: false,
        }
    }

    /// Whether its process still runs.
    fn running(&mut self) -> bool {
        matches!(self.proc.exited(), Ok(None))
    }

    /// Notes whether it announced the lead since it stood by.
    fn refresh(&mut self) {
        if self.leading_since.is_none() {
            if let Some((at, _)) = self.proc.said_later("listening ") {
                self.leading_since = Some(at);
                self.metrics = self.proc.said_later("metrics ").and_then(|(_, addr)| addr.parse().ok());
            }
        }
    }

    /// Its life so far; `leaders` are when each seat started leading.
    fn life(&mut self, leaders: &[Instant]) -> ControllerLife {
        let end = match self.proc.exited() {
            Ok(None) => ControllerEnd::Running,
            _ if self.killed => ControllerEnd::Killed,
            Ok(Some(status)) if status.code() == Some(DEPOSED_EXIT) => ControllerEnd::Deposed,
            Ok(Some(status)) => ControllerEnd::Exited(status.code()),
            Err(_) => ControllerEnd::Exited(None),
        };
        let deposed_while_paused = self
            .paused
            .is_some_and(|(at, pause)| leaders.iter().any(|&since| since > at && since < at + pause));
        ControllerLife { pid: self.proc.pid(), led: self.leading_since.is_some(), deposed_while_paused, end }
    }
}

/// The controllers of a cluster and the client of the one in charge.
pub(super) struct Controllers {
    /// The executable with the `controller` subcommand.
    exe: PathBuf,
    seats: Vec<Seat>,
    /// Which seat the client asks.
    leader: usize,
    client: ControllerClient,
    shared: LeaderAddr,
    /// Deadline of one call.
    patience: Duration,
    /// With controllers on etcd, how long a new leader may take after the old one is lost.
    failover: Option<Duration>,
    /// Controllers started to replace one that died, stopped answering or was deposed.
    restarts: u64,
    /// Times the client turned to another controller that took the lead.
    switches: u64,
    /// Controller processes already replaced.
    ended: Vec<Seat>,
}

impl Controllers {
    /// Starts the controllers `config` asks for, with their state in `dir`.
    pub(super) fn start(config: &ClusterConfig, dir: &Path) -> Result<Self, ClusterError> {
        let timeout = config.heartbeat * 3;
        let mut common = vec![
            "controller".to_owned(),
            format!("--timeout-ms={}", timeout.as_millis()),
            format!("--heartbeat-ms={}", config.heartbeat.as_millis()),
            format!("--metrics={}", SocketAddr::new(config.gateway(), 0)),
        ];
        if config.recoveries == Recoveries::ByController {
            common.push(format!("--stages={}", config.splits.len()));
        }
        // A controller that takes this long to answer is presumed dead (and replaced, or another
        // asked).
        let patience = (config.heartbeat * 5).max(Duration::from_millis(200));
        let any_port = format!("--listen={}", SocketAddr::new(config.gateway(), 0));
        let (seats, failover) = match &config.control_plane {
            ControlPlane::Embedded => {
                common.push(format!("--state={}", dir.join("controller.state").display()));
                // One journal per controller machine: several controllers would interleave theirs.
                common.extend(config.journal.iter().map(|path| format!("--journal={}", path.display())));
                let started =
                    spawn(&config.exe, &[common.clone(), vec![any_port]].concat(), "the controller", START)?;
                // Its replacements take the same port, which every process beats to.
                let args = [common, vec![format!("--listen={}", started.addr)]].concat();
                (vec![Seat::started(started, args, false)], None)
            }
            ControlPlane::Etcd(_) if config.journal.is_some() => {
                return Err(ClusterError::Invalid(
                    "a journal is kept by one controller: not with controllers on etcd".into(),
                ));
            }
            ControlPlane::Etcd(etcd) => {
                // A lease lapses within its TTL, and etcd looks for lapsed leases twice a second.
                let failover = Duration::from_secs(etcd.lease_secs) * 2 + Duration::from_secs(2);
                let name = dir.file_name().map_or("dejavu".into(), |n| n.to_string_lossy().into_owned());
                let mut seats: Vec<Seat> = Vec::new();
                for index in 0..etcd.controllers.max(1) {
                    let mut args = [common.clone(), Self::etcd_args(config, etcd, index, &name)].concat();
                    let what = format!("controller {index}");
                    let (started, standing_by) = spawn_candidate(
                        &config.exe,
                        &[args.clone(), vec![any_port.clone()]].concat(),
                        &what,
                        START,
                    )?;
                    args.push(format!("--listen={}", started.addr));
                    let mut seat = Seat::started(started, args, standing_by);
                    // The first leads, and the others are started once it does, so they stand by.
                    // It may stand by a moment first: a lease that its own campaign, tried again
                    // while etcd elected its leader, could not give up holds the election until it
                    // lapses.
                    if index == 0 {
                        let until = Instant::now() + failover;
                        while seat.leading_since.is_none() && Instant::now() < until {
                            std::thread::sleep(Duration::from_millis(20));
                            seat.refresh();
                        }
                        if seat.leading_since.is_none() {
                            return Err(ClusterError::Invalid(format!(
                                "no controller took the lead of cluster {name} in etcd within {failover:?}"
                            )));
                        }
                    }
                    seats.push(seat);
                }
                (seats, Some(failover))
            }
        };
        let addr = seats[0].addr;
        Ok(Self {
            exe: config.exe.clone(),
            seats,
            leader: 0,
            client: ControllerClient::new(addr, patience, secret()),
            shared: Arc::new(Mutex::new(addr)),
            patience,
            failover,
            restarts: 0,
            switches: 0,
            ended: Vec::new(),
        })
    }

    /// The flags of controller `index` on `etcd`, each etcd member reached through its link.
    fn etcd_args(config: &ClusterConfig, etcd: &EtcdControllers, index: u32, name: &str) -> Vec<String> {
        let urls: Vec<String> = (0..)
            .zip(&etcd.endpoints)
            .map(|(member, &addr)| {
                format!("http://{}", config.route(Link::Etcd { controller: index, member }, addr))
            })
            .collect();
        vec![
            format!("--etcd={}", urls.join(",")),
            format!("--cluster={name}"),
            format!("--lease-secs={}", etcd.lease_secs),
        ]
    }

    /// Every controller's address, comma-separated: where members beat (`--heartbeat`).
    pub(super) fn heartbeat_arg(&self) -> String {
        self.seats.iter().map(|s| s.addr.to_string()).collect::<Vec<_>>().join(",")
    }

    /// Every controller's address, in the order they were first started.
    pub(super) fn addrs(&self) -> Vec<SocketAddr> {
        self.seats.iter().map(|s| s.addr).collect()
    }

    /// Where the controller in charge listens, kept current for whoever follows it.
    pub(super) fn leader_addr(&self) -> LeaderAddr {
        self.shared.clone()
    }

    /// Asks the controller in charge. Embedded: one that does not answer is replaced once. On
    /// etcd: the newest leader is asked until one answers or a failover's time has passed.
    pub(super) fn ask<T>(
        &mut self,
        call: impl FnMut(&mut ControllerClient) -> Result<T, ControllerError>,
    ) -> Result<T, ClusterError> {
        self.ask_unless(call, |_| false)
    }

    /// [`Controllers::ask`], where an error that `answered` accepts is the controller's answer,
    /// not a sign that it is gone.
    pub(super) fn ask_unless<T>(
        &mut self,
        mut call: impl FnMut(&mut ControllerClient) -> Result<T, ControllerError>,
        answered: impl Fn(&ControllerError) -> bool,
    ) -> Result<T, ClusterError> {
        let mut error = match call(&mut self.client) {
            Err(e) if !answered(&e) => e,
            carried_out => return Ok(carried_out?),
        };
        tracing::warn!(error = %error, "the controller in charge did not answer");
        let Some(failover) = self.failover else {
            self.restart(0)?;
            return Ok(call(&mut self.client)?);
        };
        let start = Instant::now();
        while start.elapsed() < failover {
            self.follow();
            match call(&mut self.client) {
                Err(e) if !answered(&e) => error = e,
                carried_out => {
                    self.restart_exited();
                    return Ok(carried_out?);
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(ClusterError::Invalid(format!(
            "no controller answered within {failover:?} ({error}); their last words:\n{}",
            self.last_words()
        )))
    }

    /// What each controller process wrote last to its standard error, one per line.
    pub(super) fn last_words(&self) -> String {
        let words: Vec<String> = self
            .seats
            .iter()
            .map(|seat| format!("controller pid {}: {}", seat.proc.pid(), seat.proc.stderr_tail().trim()))
            .collect();
        words.join("\n")
    }

    /// Points the client at the controller that announced the lead last, of those alive.
    pub(super) fn follow(&mut self) {
        let mut newest: Option<(Instant, usize)> = None;
        for (index, seat) in self.seats.iter_mut().enumerate() {
            seat.refresh();
            let alive = seat.running();
            if let (true, Some(since)) = (alive, seat.leading_since) {
                if newest.is_none_or(|(at, _)| since > at) {
                    newest = Some((since, index));
                }
            }
        }
        if let Some((_, index)) = newest.filter(|&(_, index)| index != self.leader) {
            self.point_at(index);
        }
    }

    fn point_at(&mut self, index: usize) {
        self.leader = index;
        self.switches += 1;
        let addr = self.seats[index].addr;
        self.client = ControllerClient::new(addr, self.patience, secret());
        *self.shared.lock() = addr;
    }

    /// Starts again, on its port, each controller but the one in charge that has exited. One
    /// that does not start is tried again next time: the cluster goes on with those it has.
    fn restart_exited(&mut self) {
        for index in 0..self.seats.len() {
            if index != self.leader && !self.seats[index].running() {
                if let Err(e) = self.restart(index) {
                    tracing::warn!(error = %e, controller = index, "a controller did not start again");
                }
            }
        }
    }

    /// Replaces controller `index` (killing it first: it may only be stopped).
    fn restart(&mut self, index: usize) -> Result<(), ClusterError> {
        let seat = &mut self.seats[index];
        if seat.running() {
            seat.killed = true;
            let _ = seat.proc.kill();
        }
        seat.refresh();
        let args = seat.args.clone();
        let (started, standing_by) = match self.failover {
            None => (spawn(&self.exe, &args, "a replacement controller", START)?, false),
            // One that cannot reach etcd yet (cut off from it, say) does not hold the cluster up
            // for long: it is tried again at the next failover.
            Some(_) => spawn_candidate(&self.exe, &args, "a replacement controller", CANDIDATE_START)?,
        };
        let replaced = std::mem::replace(&mut self.seats[index], Seat::started(started, args, standing_by));
        self.ended.push(replaced);
        self.restarts += 1;
        if index == self.leader {
            // Its connection went with the old process.
            self.client.disconnect();
        }
        Ok(())
    }

    /// SIGKILLs the controller in charge (the newest leader). The cluster notices when it next asks it something.
    pub(super) fn kill_leader(&mut self) -> Result<(), ClusterError> {
        self.follow();
        let seat = &mut self.seats[self.leader];
        // One that had exited already keeps the end it chose.
        if seat.running() {
            seat.killed = true;
        }
        Ok(seat.proc.kill()?)
    }

    /// Stops the controller in charge for `pause` (SIGSTOP, then SIGCONT).
    pub(super) fn pause_leader(&mut self, pause: Duration) -> Result<(), ClusterError> {
        self.follow();
        let seat = &mut self.seats[self.leader];
        seat.refresh();
        if seat.leading_since.is_some() {
            seat.paused = Some((Instant::now(), pause));
        }
        Ok(seat.proc.pause(pause)?)
    }

    /// Controllers it runs.
    pub(super) fn count(&self) -> u32 {
        self.seats.len() as u32
    }

    /// Which controller is in charge, in the order they were first started.
    pub(super) fn leader(&self) -> u32 {
        self.leader as u32
    }

    /// The metrics page of the controller in charge.
    pub(super) fn metrics(&self) -> Result<String, ClusterError> {
        let seat = &self.seats[self.leader];
        let at = seat.metrics.ok_or_else(|| ClusterError::Invalid("no controller metrics".into()))?;
        crate::metrics::scrape(at).map_err(|e| {
            // Say what became of it: a scrape that fails has no other trace.
            ClusterError::Invalid(format!(
                "the controller's metrics at {at}: {e} (controller pid {}, {} restarts; its last words: {})",
                seat.proc.pid(),
                self.restarts,
                seat.proc.stderr_tail()
            ))
        })
    }

    /// Controllers started to replace one that died, stopped answering or was deposed.
    pub(super) fn restarts(&self) -> u64 {
        self.restarts
    }

    /// Times the controller in charge changed: replaced, or another took the lead. One that
    /// changed has heard from no member yet.
    pub(super) fn changes(&self) -> u64 {
        self.restarts + self.switches
    }

    /// Every controller process's life so far, the replaced ones first. A leader paused and
    /// superseded is given the time a failover takes, after its resume, to find it was deposed
    /// and stop.
    pub(super) fn lives(&mut self) -> Vec<ControllerLife> {
        let failover = self.failover.unwrap_or_default();
        loop {
            for seat in &mut self.seats {
                seat.refresh();
            }
            let leaders: Vec<Instant> =
                self.ended.iter().chain(&self.seats).filter_map(|s| s.leading_since).collect();
            let lives: Vec<(ControllerLife, Option<Instant>)> = self
                .ended
                .iter_mut()
                .chain(&mut self.seats)
                .map(|seat| (seat.life(&leaders), seat.paused.map(|(at, pause)| at + pause + failover)))
                .collect();
            let settling = lives.iter().any(|(life, settled_by)| {
                life.deposed_while_paused
                    && life.end == ControllerEnd::Running
                    && settled_by.is_some_and(|by| Instant::now() < by)
            });
            if !settling {
                return lives.into_iter().map(|(life, _)| life).collect();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
