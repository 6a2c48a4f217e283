//! The controller: a process of its own that every stage and sidecar heartbeats to, which declares
//! the silent dead, fences them and issues the epoch of each recovery.
//!
//! - Heartbeats are datagrams to the controller's UDP port ([`crate::heartbeat::beat`]); each
//!   carries the epoch its sender was started in. Queries come over TCP on the same port number,
//!   in framed, checksummed messages ([`dejavulib::wire`]): a [`Census`] of who is alive, suspect,
//!   dead or fenced; a fence; and the epoch a fenced member's replacement starts in.
//! - Every member also holds a lifeline ([`Lifeline`]): a query connection its kernel closes
//!   when its process dies, which the controller takes as the member's death at once.
//! - The controller starts each recovery itself: a stage's engine or sidecar silent for the
//!   timeout, or whose lifeline broke, is fenced in a new epoch, together with every member that
//!   failed with it (the private `detect` module decides). Whoever waits on the query port for a
//!   fence hears of it then. Its census then names the fenced members, the recovery's
//!   victims, until their replacements beat. With `--stages` it carries the recovery out itself
//!   (below) and publishes where each sequence resumes on its recovery feed; without, whoever
//!   drives the pipeline carries it out step by step, with the controller's help.
//! - A fence opens a new epoch in which the fenced members' old processes are ignored: a member
//!   fenced in epoch `e` counts as fenced until a process started in epoch `e` or later (its
//!   replacement) beats for it, and beats from older processes are stale.
//! - A fence is written to the state file (write, fsync, rename, directory fsync) before it is
//!   answered, so a controller that crashes and restarts never hands out an epoch twice, still
//!   waits for the fenced members' replacements, and still ignores their old processes.
//! - With `--stages`, the controller also restores each replaced sidecar itself once it beats,
//!   and hands a live spare sidecar to each fenced sidecar ([`dejavu_proto::spares::Spares`]
//!   decides which): the spare beats as that stage from then on, and is restored as any
//!   replacement.
//! - A restarted controller has heard from no one yet: each member it knew gets a full timeout
//!   from the restart to beat, so a controller crash is never a false failure detection.
//!
//! [`ControllerClient`] is the other end, used by [`crate::cluster`].
//!
//! The controller is an I/O shell around [`dejavu_proto::Controller`] (its liveness machine and
//! its spares): every decision above (whose beat counts, who is alive, suspect or dead, whom to
//! fence and in which epoch, which spare takes whose place, what a restart keeps) is the machine's; the shell turns datagrams, connections, its clock and the
//! state file into its calls. This module holds the tables and the threads that serve them; the
//! state file is [`State`], and the private modules `heartbeats` (the UDP socket), `lifeline`
//! (members' lifelines), `query` (the query protocol's refusal codes), `recovery` (the
//! controller's part of a recovery) and `metrics` (its page) each do one job.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use dejavulib::message::Message;
use dejavulib::net::auth::server_handshake_blocking;
use dejavulib::wire::{read_frame, write_frame, FrameHeader, Kind};
use parking_lot::{Condvar, Mutex};
use thiserror::Error;
use tracing::{debug, error, info, warn};

use dejavu_proto::liveness::{self, Heard, LivenessConfig};
use dejavu_proto::plan::Source;
use dejavu_proto::Controller;

use crate::heartbeat::{Beat, Role};
use crate::slots::Slot;

mod client;
mod etcd_access;
mod feed;
mod heartbeats;
mod leadership;
mod lifeline;
mod metrics;
mod query;
mod recovery;
mod standby;
mod state;

pub use client::{Census, ControllerClient};
pub use etcd_access::{ClientIdentity, EtcdAccess, EtcdAccessError, EtcdAccessFiles};
use heartbeats::{authentic_beat, listen_heartbeats, recv_waiting, DATAGRAM_BUFFER};
pub use leadership::{EtcdConfig, Leadership, PROBE_EVERY};
pub use lifeline::Lifeline;
use query::{refusal_code, QUERY_SERVER_NODE};
pub use state::{Membership, Record, State};

pub use dejavulib::message::{Mark, RecoveryOrders, StageOrders};

pub use dejavulib::message::{Health, Member};

/// Errors of the controller and of talking to it.
#[derive(Debug, Error)]
pub enum ControllerError {
    /// Its state file cannot be read or written.
    #[error("controller state {path}: {why}")]
    State {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// etcd cannot be reached, or answered something unexpected.
    #[error("etcd: {0}")]
    Etcd(String),
    /// This controller no longer leads its cluster (its etcd lease expired, or another took
    /// over): it must stop acting.
    #[error("this controller no longer leads its cluster")]
    NotLeader,
    /// A socket failed.
    #[error("controller i/o: {0}")]
    Io(#[from] std::io::Error),
    /// Its state file's lock is another controller's.
    #[error(transparent)]
    StateLocked(#[from] crate::lifecycle::ClaimError),
    /// It answered something that makes no sense, or refused the request.
    #[error("controller protocol: {0}")]
    Protocol(String),
    /// The member has no fence to be replaced from: it is alive, or was never fenced.
    #[error("{} {} awaits no replacement: it is not fenced", role_name(.0.0), .0.1)]
    NotFenced(Member),
    /// Another live process of the same epoch holds the member's place.
    #[error("{}", claimed_text(*.member, *.by))]
    Claimed {
        /// The member claimed twice.
        member: Member,
        /// The holder's process id.
        by: u32,
    },
    /// The controller refused the request (an `Error` reply), for `reason`.
    #[error("the controller refused: {reason}")]
    Refused {
        /// What kind of refusal (see the query protocol).
        code: u32,
        /// What the refusal names, by its kind (the holder's process id, for a member claimed
        /// twice).
        detail: u32,
        /// Why, in words.
        reason: String,
    },
    /// One end did not prove the cluster secret to the other (a controller or client of
    /// another cluster, or an impostor).
    #[error("controller handshake: {0}")]
    Auth(String),
    /// A sidecar did not do what a recovery needed of it.
    #[error(transparent)]
    Sidecar(#[from] crate::sidecar::control::ControlError),
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Engine => "engine",
        Role::Sidecar => "sidecar",
    }
}

/// The controller's tables, shared by its heartbeat, detector, query and metrics threads: the
/// controller's machine, which takes every decision, and what the shell keeps beside it.
struct Tables {
    /// The controller's machine: liveness, fences, epochs and spares.
    machine: Controller,
    /// Where the machine's record is written.
    store: Store,
    /// The machine's clock: its time is the milliseconds since this instant.
    clock: Instant,
    /// Where each member that has one (a sidecar) serves control requests, as its latest
    /// heartbeat from a process not fenced says.
    controls: HashMap<Member, SocketAddr>,
    /// The cluster secret, which the sidecars' control listeners ask it to prove.
    secret: Vec<u8>,
    timeout: Duration,
    interval: Duration,
    /// Where the machine's journal goes, if it keeps one.
    journal: Option<BufWriter<std::fs::File>>,
    /// The sending end of each member's current lifeline, with its number: a fence tells the
    /// fenced process on it.
    lifelines: HashMap<Member, (u64, TcpStream)>,
    /// Where each sidecar that names a fixed one serves KV, as its latest heartbeat says.
    data: HashMap<Member, SocketAddr>,
    /// Where a fenced sidecar's replacement is announced, once it beats, when the controller
    /// restores replaced sidecars itself.
    replaced: Option<crossbeam_channel::Sender<u32>>,
    /// Where each replaced sidecar this controller restored got its stage's own KV from (its
    /// successor's sidecar, or nowhere: lost), with the epoch of the fence it replaced. The
    /// recovery feed of that epoch says so.
    handed_back: HashMap<u32, (u64, Source)>,
}

/// Counters for the metrics page.
#[derive(Default)]
struct Counters {
    heartbeats: AtomicU64,
    stale_heartbeats: AtomicU64,
    /// Beats no older than the last taken for their member: replays.
    replayed_heartbeats: AtomicU64,
    /// Datagrams on the heartbeat port that are not heartbeats signed with the cluster secret.
    refused_heartbeats: AtomicU64,
    missed_heartbeats: AtomicU64,
    fences: AtomicU64,
    /// Fences the controller opened on its own, declaring silent members dead.
    detections: AtomicU64,
    queries: AtomicU64,
    /// Query connections closed because they did not prove the cluster secret.
    refused_queries: AtomicU64,
    /// Replacements heard from after a fence, and the microseconds from fence to first beat.
    replacements: AtomicU64,
    replacement_micros: AtomicU64,
    /// Recoveries carried out ([`recovery`]), the microseconds they took, and the chunks their
    /// re-seeds sent.
    recoveries: AtomicU64,
    recovery_micros: AtomicU64,
    reseeded_chunks: AtomicU64,
    /// Spare sidecars handed over to take a fenced sidecar's place, and hand-overs that failed.
    spares_assigned: AtomicU64,
    spare_failures: AtomicU64,
    /// Lifelines held now, and those that broke while they were their member's current one.
    lifelines: AtomicU64,
    severed_lifelines: AtomicU64,
    /// Recoveries the feeder acknowledged ([`feed`]), and the newest one's epoch.
    acknowledged_recoveries: AtomicU64,
    last_acknowledged: AtomicU64,
}

/// What the controller's threads tell one another.
struct Events {
    /// Notified at every fence, with the tables' lock, for the queries awaiting one.
    fenced: Condvar,
    /// Wakes the detector when a lifeline breaks.
    severed: Sender<()>,
}

impl Tables {
    /// The machine's time now.
    fn now(&self) -> u64 {
        self.clock.elapsed().as_millis() as u64
    }

    /// Appends what the machine journaled since the last call to the journal file, if any.
    fn write_journal(&mut self) {
        // Drained whatever becomes of them: entries left in the machine would pile up.
        let entries = self.machine.drain_journal();
        let Some(file) = self.journal.as_mut() else { return };
        let written = entries
            .iter()
            .try_for_each(|entry| writeln!(file, "{}", entry.encode()))
            .and_then(|()| file.flush());
        if let Err(e) = written {
            error!(error = %e, "cannot write the journal: it stops here");
            self.journal = None;
        }
    }

    /// Records a heartbeat `beat` that came from `from`; returns whether the state file must be
    /// written (a new member, or a fenced one's replacement).
    fn heard(&mut self, beat: Beat, from: SocketAddr, counters: &Counters) -> bool {
        let Beat { member, epoch, sequence, control_port, data_port, .. } = beat;
        let now = self.now();
        let was_awaiting = self.machine.membership(member).is_some_and(|m| m.awaiting);
        let (first_of_process, fenced_for_ms, gap_ms) =
            match self.machine.heartbeat(liveness::Beat { member, epoch, sequence }, now) {
                Heard::Stale => {
                    counters.stale_heartbeats.fetch_add(1, Ordering::Relaxed);
                    return false;
                }
                Heard::Replay => {
                    counters.replayed_heartbeats.fetch_add(1, Ordering::Relaxed);
                    return false;
                }
                Heard::Taken { first_of_process, fenced_for_ms, gap_ms } => {
                    (first_of_process, fenced_for_ms, gap_ms)
                }
            };
        self.write_journal();
        if let Some(port) = control_port {
            self.controls.insert(member, SocketAddr::new(from.ip(), port));
        }
        match data_port {
            Some(port) => {
                self.data.insert(member, SocketAddr::new(from.ip(), port));
            }
            // A new process whose transport does not listen yet: not where its predecessor's did.
            None if first_of_process => {
                self.data.remove(&member);
            }
            None => {}
        }
        counters.heartbeats.fetch_add(1, Ordering::Relaxed);
        if let Some(gap) = gap_ms {
            // A beat is missed when the gap holds more than one interval (with some slack).
            let intervals = gap as f64 / self.interval.as_secs_f64() / 1e3;
            let missed = (intervals - 0.5).floor().max(1.0) - 1.0;
            counters.missed_heartbeats.fetch_add(missed as u64, Ordering::Relaxed);
        }
        if let Some(waited) = fenced_for_ms {
            counters.replacements.fetch_add(1, Ordering::Relaxed);
            counters.replacement_micros.fetch_add(waited * 1000, Ordering::Relaxed);
        }
        // A fenced sidecar's replacement, heard for the first time (by this controller or the
        // one it restarted from): its restore is recorded before it starts (the caller writes
        // the record under the same lock), so that a controller restarted meanwhile finishes it.
        if let (true, true, Some(replaced), (Role::Sidecar, stage)) =
            (first_of_process, was_awaiting, &self.replaced, member)
        {
            self.machine.restore_begun(stage);
            let _ = replaced.send(stage);
        }
        first_of_process
    }

    /// Writes the machine's record to the state file if it changed since it was last written.
    fn save(&mut self) -> Result<(), ControllerError> {
        if let Some(record) = self.machine.unwritten_record() {
            self.store.save(record)?;
            self.machine.record_written();
            self.write_journal();
        }
        Ok(())
    }

    /// Has the machine fence `members` (see [`dejavu_proto::liveness::Liveness::fence`]), its record written first;
    /// returns the epoch.
    fn fence(
        &mut self,
        members: &[Member],
        reuse: Option<u64>,
        counters: &Counters,
    ) -> Result<u64, ControllerError> {
        let (before, now) = (self.machine.epoch(), self.now());
        let Tables { machine, store, .. } = self;
        let fenced = machine.fence(members, reuse, now, |record| store.save(record));
        self.write_journal();
        let epoch = fenced?;
        if epoch == before {
            return Ok(epoch);
        }
        for member in members {
            // The fenced process's listener is no longer the member's.
            self.controls.remove(member);
            // A process presumed dead may only be stopped or cut off: it learns, if it can hear.
            if let Some((_, lifeline)) = self.lifelines.remove(member) {
                tell_fenced(lifeline, epoch);
            }
        }
        info!(epoch, fenced = ?members, "fenced in a new epoch");
        counters.fences.fetch_add(1, Ordering::Relaxed);
        Ok(epoch)
    }

    /// Takes in the heartbeats waiting on `socket` without blocking, so that a census answered
    /// right after the controller was stopped (SIGSTOP) counts the beats that came meanwhile
    /// rather than declaring everyone dead.
    fn absorb_pending(&mut self, socket: &UdpSocket, counters: &Counters) {
        let mut buf = [0u8; DATAGRAM_BUFFER];
        loop {
            let Some((n, from)) = recv_waiting(socket, &mut buf) else { return };
            let Some(beat) = authentic_beat(&buf[..n], &self.secret, counters) else { continue };
            if self.heard(beat, from, counters) {
                if let Err(e) = self.save() {
                    error!(error = %e, "cannot record a member");
                }
            }
        }
    }
}

/// How a controller runs.
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    /// Where it listens: UDP for heartbeats and TCP for queries, on the same port (0 picks one).
    pub listen: SocketAddr,
    /// Where its record is kept: a state file, or etcd for several controllers.
    pub store: StoreConfig,
    /// Silence after which a member is dead.
    pub timeout: Duration,
    /// The interval members beat at (to count missed beats).
    pub interval: Duration,
    /// Where to serve metrics, if anywhere.
    pub metrics: Option<SocketAddr>,
    /// The cluster secret: recoveries reach the sidecars with it.
    pub secret: Vec<u8>,
    /// Where to append the journal of its liveness machine, if anywhere.
    pub journal: Option<PathBuf>,
    /// What the controller does as it stops, once it leads on etcd: give the leadership up
    /// ([`Leaving::leave`], from the process's SIGTERM handler).
    pub leaving: Leaving,
    /// The ring's stages, when the controller restores replaced sidecars itself: once a fenced
    /// stage's replacement sidecar beats, it has the surviving predecessor's sidecar re-seed it
    /// and the surviving successor's hand back the stage's own KV (`recovery::restore_replaced`).
    /// `None` when whoever drives the pipeline carries recoveries out step by step.
    pub stages: Option<u32>,
}

/// What a controller leaving its cluster must do first: a leader on etcd gives its leadership
/// up, so that one standing by takes over at once. Shared between the controller, which sets it
/// once it leads, and the process's stop handler, which calls [`Leaving::leave`].
#[derive(Clone, Default)]
pub struct Leaving(Arc<Mutex<Option<Resignation>>>);

/// How a leader gives its leadership up ([`Leadership::resignation`]).
type Resignation = Box<dyn FnOnce() + Send>;

impl Leaving {
    /// Does what leaving takes (nothing if the controller does not lead on etcd).
    pub fn leave(&self) {
        if let Some(resign) = self.0.lock().take() {
            resign();
        }
    }

    fn set(&self, resign: impl FnOnce() + Send + 'static) {
        *self.0.lock() = Some(Box::new(resign));
    }
}

impl std::fmt::Debug for Leaving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Leaving")
    }
}

/// Where a controller keeps its machine's record.
#[derive(Clone, Debug)]
pub enum StoreConfig {
    /// A state file, locked by the one controller that uses it.
    File(PathBuf),
    /// etcd, shared by several controllers of which one leads ([`Leadership`]).
    Etcd(EtcdConfig),
}

/// Where the running controller writes its record.
enum Store {
    /// The state file (its lock held as long as the controller runs).
    File { path: PathBuf, _lock: std::fs::File },
    /// etcd, while this controller leads.
    Etcd(Box<Leadership>),
}

impl Store {
    /// Writes `record` durably; for a leader that lost its leadership, nothing is written.
    fn save(&mut self, record: &Record) -> Result<(), ControllerError> {
        match self {
            Store::File { path, .. } => State::save(record, path),
            Store::Etcd(leadership) => leadership.save(record),
        }
    }

    /// Checks that this controller still leads, through etcd (a guarded write of nothing),
    /// before it acts on a member; a controller with a state file always does.
    fn confirm_leading(&mut self) -> Result<(), ControllerError> {
        match self {
            Store::File { .. } => Ok(()),
            Store::Etcd(leadership) => leadership.confirm(),
        }
    }

    /// Whether this controller may no longer act: it lost its leadership.
    fn deposed(&self) -> bool {
        matches!(self, Store::Etcd(leadership) if leadership.lost())
    }
}

/// The exit status of a controller that lost its leadership of the cluster.
pub const DEPOSED_EXIT: i32 = 3;

/// Query connections served at once; more are closed as they come (each has a thread).
const MAX_QUERY_CONNECTIONS: usize = 64;

/// How long a query connection has to prove the cluster secret.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);

/// After a fence the detector could not make durable, how long it waits before trying again.
const FENCE_RETRY: Duration = Duration::from_secs(1);

/// How long the detector waits, once a lifeline broke, for the lifelines of processes that died
/// with it (a worker's engine and sidecar, killed together) to break too, so that they are fenced
/// in one epoch: it waits until none has broken for this long (for half the timeout at most).
const SETTLE: Duration = Duration::from_millis(20);

/// The longest a [`Message::AwaitFence`] query may wait.
const MAX_FENCE_WAIT: Duration = Duration::from_secs(10);

/// The longest a [`Message::WatchRecovery`] query may wait.
const MAX_WATCH: Duration = dejavulib::net::controller::MAX_WATCH;

/// Attempts at binding a UDP and a TCP socket to one free port before giving up.
const BIND_ATTEMPTS: usize = 16;

/// The error of a journal that cannot be opened or started.
fn journal_error(path: &std::path::Path, e: std::io::Error) -> ControllerError {
    ControllerError::State { path: path.to_owned(), why: format!("the journal: {e}") }
}

/// Bytes of heartbeat datagrams the controller's socket may hold unread. The kernel's default
/// (about 208 KiB, charged about 800 bytes a datagram) holds some 256 beats: a thousand members
/// beating in step, or a controller busy for a few tens of milliseconds, lost most of a round.
const HEARTBEAT_BUFFER: libc::c_int = 8 << 20;

/// Asks for `HEARTBEAT_BUFFER` bytes of receive buffer on `socket`: beyond `net.core.rmem_max`
/// where the process may (`SO_RCVBUFFORCE`, as root), else up to it. Returns the size granted.
pub fn enlarge_receive_buffer(socket: &UdpSocket) -> usize {
    use std::os::fd::AsRawFd;
    let fd = socket.as_raw_fd();
    let size = HEARTBEAT_BUFFER;
    let int_len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    for option in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
        // SAFETY: the descriptor is the socket's own, and `size` is a live `c_int` whose length
        // is passed with it.
        let set = unsafe {
            libc::setsockopt(fd, libc::SOL_SOCKET, option, (&size as *const libc::c_int).cast(), int_len)
        };
        if set == 0 {
            break;
        }
    }
    let (mut granted, mut len): (libc::c_int, libc::socklen_t) = (0, int_len);
    // SAFETY: as above; `granted` and `len` are live and `len` holds `granted`'s size.
    let got = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&mut granted as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    let granted = if got == 0 { granted.max(0) as usize } else { 0 };
    if granted < HEARTBEAT_BUFFER as usize {
        warn!(
            granted,
            wanted = HEARTBEAT_BUFFER,
            "the heartbeat socket's receive buffer is smaller than asked (raise net.core.rmem_max): \
             beats of many members arriving together may be lost"
        );
    }
    granted
}

/// Binds a UDP and a TCP socket on the same port of `addr` (a free one if its port is 0).
fn bind_pair(addr: SocketAddr) -> std::io::Result<(UdpSocket, TcpListener)> {
    let mut last = None;
    for _ in 0..BIND_ATTEMPTS {
        let udp = UdpSocket::bind(addr)?;
        enlarge_receive_buffer(&udp);
        match TcpListener::bind(udp.local_addr()?) {
            Ok(tcp) => return Ok((udp, tcp)),
            // Someone holds the TCP side of the port picked: try another.
            Err(e) if addr.port() == 0 => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no port")))
}

fn claimed_text(member: Member, by: u32) -> String {
    let (role, index) = (role_name(member.0), member.1);
    format!(
        "{role} {index} is held by process {by}, alive in the same epoch: start this one for another \
         stage (--index), or, once that one has died and been fenced, as its replacement (--replace {index})"
    )
}

/// Sends [`Message::Fenced`] on a fenced member's lifeline. A process stopped with a full
/// receive buffer does not hold the controller up: the write gives up after a moment.
fn tell_fenced(lifeline: TcpStream, epoch: u64) {
    let (header, payload) = Message::Fenced(epoch).frame(QUERY_SERVER_NODE, epoch, 0);
    let told = lifeline
        .set_write_timeout(Some(Duration::from_millis(100)))
        .and_then(|()| write_frame(&mut &lifeline, &header, &payload).map_err(std::io::Error::other));
    if let Err(e) = told {
        debug!(error = %e, "could not tell a fenced process");
    }
}

/// How long a controller waits for the lock of its state file.
const STATE_LOCK_PATIENCE: Duration = Duration::from_secs(3);

/// Runs a controller until the process is killed. `ready` gets the address it listens at (and of
/// its metrics page) once it answers queries.
pub fn serve_controller(
    config: ControllerConfig,
    ready: impl FnOnce(SocketAddr, Option<SocketAddr>),
) -> Result<(), ControllerError> {
    let (udp, tcp) = bind_pair(config.listen)?;
    let addr = tcp.local_addr()?;
    let (store, record) = match config.store.clone() {
        StoreConfig::File(path) => {
            // One controller per state file: two would hand out the same epochs. The lock goes
            // with the process, however it ends; a predecessor just killed gets a moment to let go.
            let mut lock_path = path.clone().into_os_string();
            lock_path.push(".lock");
            let lock = crate::lifecycle::lock_exclusive(Path::new(&lock_path), STATE_LOCK_PATIENCE)?;
            let record = State::load(&path)?;
            (Store::File { path, _lock: lock }, record)
        }
        StoreConfig::Etcd(etcd) => {
            // Bound first, so that the address it campaigns with is its own; members' beats wait
            // in the socket's buffer meanwhile.
            let waiting = |leader: Option<String>| {
                info!(%addr, leader = leader.as_deref().unwrap_or("?"), "standing by: another controller leads");
                // The line a parent waits for, as `listening ADDR` once it leads.
                println!("standby {addr}");
                let _ = std::io::stdout().flush();
            };
            let door = standby::Door::open(&tcp)?;
            let mut leadership = Leadership::campaign(etcd, addr, waiting)?;
            door.shut();
            config.leaving.set(leadership.resignation());
            let record = leadership.load()?;
            (Store::Etcd(Box::new(leadership)), record)
        }
    };
    // Workers that died together get the timeout to show it, so they are fenced together.
    let timeout_ms = config.timeout.as_millis().max(1) as u64;
    let settings = LivenessConfig { timeout_ms, grace_ms: timeout_ms };
    // A restarted controller gives every live member it knew a full timeout from now.
    // Journaled only with a file to write to.
    let (machine, journal) = match &config.journal {
        Some(path) => {
            let (machine, start) = Controller::start_journaled(settings, record, 0);
            let open = std::fs::OpenOptions::new().create(true).append(true).open(path);
            let mut file = BufWriter::new(open.map_err(|e| journal_error(path, e))?);
            writeln!(file, "{}", start.encode())
                .and_then(|()| file.flush())
                .map_err(|e| journal_error(path, e))?;
            (machine, Some(file))
        }
        None => (Controller::start(settings, record, 0), None),
    };
    let tables = Tables {
        machine,
        store,
        clock: Instant::now(),
        controls: HashMap::new(),
        secret: config.secret.clone(),
        timeout: config.timeout,
        interval: config.interval,
        journal,
        lifelines: HashMap::new(),
        data: HashMap::new(),
        replaced: None,
        handed_back: HashMap::new(),
    };
    let mut tables = tables;
    let replaced = config.stages.map(|depth| {
        let (tx, rx) = crossbeam_channel::unbounded();
        tables.replaced = Some(tx);
        (depth, rx)
    });
    tables.save()?;
    let tables = Arc::new(Mutex::new(tables));
    let counters = Arc::new(Counters::default());
    let (severed, severances) = crossbeam_channel::bounded(1);
    let events = Arc::new(Events { fenced: Condvar::new(), severed });
    let udp = Arc::new(udp);
    {
        let (tables, counters, udp, secret) =
            (tables.clone(), counters.clone(), udp.clone(), config.secret.clone());
        std::thread::Builder::new()
            .name("heartbeats".into())
            .spawn(move || listen_heartbeats(&udp, &tables, &counters, &secret))?;
    }
    {
        let (tables, counters, udp, events) = (tables.clone(), counters.clone(), udp.clone(), events.clone());
        let wake = Wake { longest: config.timeout / 2, settle_at_most: config.timeout / 2, severances };
        std::thread::Builder::new()
            .name("detector".into())
            .spawn(move || detect_failures(&udp, &tables, &counters, &events, wake))?;
    }
    if let Some((depth, replacements)) = replaced {
        let (tables_, counters_) = (tables.clone(), counters.clone());
        // Restores the controller it restarted from (or the last leader) left unfinished first.
        let pending: Vec<u32> = tables.lock().machine.restores_pending().collect();
        for &stage in &pending {
            info!(stage, "finishing the restore of a replaced sidecar begun before this controller started");
        }
        std::thread::Builder::new().name("replacements".into()).spawn(move || {
            for stage in pending.into_iter().chain(replacements) {
                recovery::restore_replaced(&tables_, &counters_, stage, depth);
            }
        })?;
        let (tables, counters) = (tables.clone(), counters.clone());
        // As often as members beat: a spare is handed over within an interval of the fence.
        let every = config.interval.min(config.timeout / 4).max(Duration::from_millis(1));
        std::thread::Builder::new()
            .name("spares".into())
            .spawn(move || recovery::hand_over_spares(&tables, &counters, every))?;
    }
    let metrics = match config.metrics {
        Some(at) => {
            let (tables, counters) = (tables.clone(), counters.clone());
            Some(crate::metrics::serve(at, move || metrics::render(&tables.lock(), &counters))?)
        }
        None => None,
    };
    info!(%addr, epoch = tables.lock().machine.epoch(), "controller listening");
    ready(addr, metrics);
    let live = Arc::new(AtomicUsize::new(0));
    let lifeline_slots = Arc::new(AtomicUsize::new(0));
    for stream in tcp.incoming() {
        let Ok(stream) = stream else {
            // Out of descriptors, say: wait rather than spin.
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let Some(slot) = Slot::take(&live, MAX_QUERY_CONNECTIONS) else {
            counters.refused_queries.fetch_add(1, Ordering::Relaxed);
            warn!("too many query connections: one closed");
            continue;
        };
        let (tables, counters, udp, events) = (tables.clone(), counters.clone(), udp.clone(), events.clone());
        let (secret, lifeline_slots) = (config.secret.clone(), lifeline_slots.clone());
        // The slot is given back when the closure is dropped: after the connection, or at once
        // if no thread could be started for it.
        let spawned = std::thread::Builder::new().name("query".into()).spawn(move || {
            let query = Query {
                depth: config.stages,
                secret: &secret,
                heartbeats: &udp,
                tables: &tables,
                counters: &counters,
                events: &events,
            };
            if let Err(e) = answer_queries(stream, slot, &lifeline_slots, &query) {
                warn!(error = %e, "a query connection closed");
            }
        });
        if let Err(e) = spawned {
            warn!(error = %e, "cannot serve a query connection");
        }
    }
    Ok(())
}

/// When the detector runs: at the machine's next deadline ([`dejavu_proto::liveness::Liveness::poll_timeout`]; at most
/// `longest` from now, the least time before a member that joins meanwhile can turn suspect), and
/// when a lifeline breaks, once lifelines have stopped breaking for [`SETTLE`] (or
/// `settle_at_most` has passed).
struct Wake {
    longest: Duration,
    settle_at_most: Duration,
    severances: Receiver<()>,
}

impl Wake {
    /// Blocks for `sleep` at most, or until a lifeline breaks and the breaks settle.
    fn wait(&self, sleep: Duration) {
        if self.severances.recv_timeout(sleep.min(self.longest)).is_err() {
            return;
        }
        let until = Instant::now() + self.settle_at_most;
        while Instant::now() < until && self.severances.recv_timeout(SETTLE).is_ok() {}
    }
}

/// Fences the members `detector` finds dead, whenever `wake` says: the start of each recovery.
fn detect_failures(
    heartbeats: &UdpSocket,
    tables: &Mutex<Tables>,
    counters: &Counters,
    events: &Events,
    wake: Wake,
) {
    let mut sleep = Duration::ZERO;
    loop {
        wake.wait(sleep);
        let mut tables = tables.lock();
        if tables.store.deposed() {
            // Another controller leads now: nothing this one could still decide or answer would
            // be right. A supervisor starts it again, and it stands by.
            error!("no longer leading the cluster: stopping");
            std::process::exit(DEPOSED_EXIT);
        }
        // Beats that came while the controller was stopped count before anyone is declared dead.
        tables.absorb_pending(heartbeats, counters);
        // A record that could not be written before is written now: a member it lacks would be
        // unknown to a restarted controller.
        if let Err(e) = tables.save() {
            error!(error = %e, "cannot write the state file");
        }
        let now = tables.now();
        let dead = tables.machine.tick(now);
        tables.write_journal();
        sleep = match tables.machine.poll_timeout(now) {
            Some(at) => Duration::from_millis(at - now),
            None => wake.longest,
        };
        if dead.is_empty() {
            continue;
        }
        match tables.fence(&dead, None, counters) {
            Ok(epoch) => {
                events.fenced.notify_all();
                counters.detections.fetch_add(1, Ordering::Relaxed);
                warn!(epoch, fenced = ?dead, "declared dead and fenced");
            }
            Err(e) => {
                // They are still dead later: try again then, not at every tick.
                error!(error = %e, "cannot fence the dead");
                drop(tables);
                std::thread::sleep(FENCE_RETRY);
            }
        }
    }
}

/// What a query connection's thread works with.
struct Query<'a> {
    /// The ring's size, where the controller carries out recoveries itself (`--stages`).
    depth: Option<u32>,
    secret: &'a [u8],
    heartbeats: &'a UdpSocket,
    tables: &'a Mutex<Tables>,
    counters: &'a Counters,
    events: &'a Events,
}

/// Answers queries on one connection, which holds `slot`, until it closes; a connection that
/// becomes a lifeline trades the slot for one of `lifeline_slots`, and is held until it ends.
fn answer_queries(
    stream: TcpStream,
    slot: Slot,
    lifeline_slots: &Arc<AtomicUsize>,
    query: &Query<'_>,
) -> Result<(), ControllerError> {
    let Query { depth, secret, heartbeats, tables, counters, events } = *query;
    stream.set_nodelay(true)?;
    // A connection closed before it said anything (its client speaks first) is a probe: a
    // controller standing by checking that this one's process lives. Nothing to answer, and
    // nothing refused.
    stream.set_read_timeout(Some(HANDSHAKE_DEADLINE))?;
    let probe = matches!(stream.peek(&mut [0u8; 1]), Ok(0));
    stream.set_read_timeout(None)?;
    if probe {
        return Ok(());
    }
    if let Err(e) = server_handshake_blocking(&stream, secret, QUERY_SERVER_NODE, HANDSHAKE_DEADLINE) {
        counters.refused_queries.fetch_add(1, Ordering::Relaxed);
        return Err(ControllerError::Auth(e.to_string()));
    }
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = BufWriter::new(stream);
    while let Some(frame) =
        read_frame(&mut reader, 1 << 20).map_err(|e| ControllerError::Protocol(e.to_string()))?
    {
        counters.queries.fetch_add(1, Ordering::Relaxed);
        let request = frame.header.request;
        let mut lifeline = None;
        let request_message = match frame.header.kind {
            // KV sent here: a sidecar's successor pointed at the controller by mistake.
            Kind::Control => Message::of_frame(&frame).map_err(|e| ControllerError::Protocol(e.to_string())),
            kind => Err(ControllerError::Protocol(format!(
                "this is the DéjàVu controller's query port, which takes no {kind:?}: a sidecar's \
                 successor is the next stage's sidecar, at the address of its --listen"
            ))),
        };
        let reply = request_message.and_then(|message| match message {
            Message::Census => {
                let mut tables = tables.lock();
                tables.absorb_pending(heartbeats, counters);
                Ok((tables.machine.epoch(), census_of(&tables)))
            }
            Message::Fence { members, reuse } => {
                let epoch = tables.lock().fence(&members, reuse, counters)?;
                events.fenced.notify_all();
                Ok((epoch, Message::Epoch(epoch)))
            }
            Message::FencedIn(member) => {
                // A replacement starts in the epoch answered: only a leader may answer.
                let mut tables = tables.lock();
                tables.store.confirm_leading()?;
                match tables.machine.membership(member) {
                    Some(m) if m.awaiting => Ok((m.fenced_in, Message::Epoch(m.fenced_in))),
                    _ => Err(ControllerError::NotFenced(member)),
                }
            }
            Message::Recover { epoch, book } => recovery::carry_out(tables, counters, epoch, &book)
                .map(|orders| (epoch, Message::Orders(orders))),
            Message::ReseedRestored { epoch, book } => {
                recovery::reseed_restored(tables, counters, epoch, &book)
                    .map(|chunks| (epoch, Message::Reseeded { chunks }))
            }
            Message::AwaitFence { after, wait_ms } => {
                let until = Instant::now() + Duration::from_millis(wait_ms.into()).min(MAX_FENCE_WAIT);
                let mut tables = tables.lock();
                while tables.machine.epoch() <= after {
                    if events.fenced.wait_until(&mut tables, until).timed_out() {
                        break;
                    }
                }
                let epoch = tables.machine.epoch();
                Ok((epoch, Message::Epoch(epoch)))
            }
            Message::WatchRecovery { after, wait_ms } => {
                let depth = depth.ok_or_else(|| {
                    ControllerError::Protocol(
                        "this controller carries out no recoveries (start it with --stages, the ring's size)"
                            .into(),
                    )
                })?;
                let until = Instant::now() + Duration::from_millis(wait_ms.into()).min(MAX_WATCH);
                match feed::watch(tables, events, depth, after, until)? {
                    Some(orders) => Ok((orders.epoch, Message::Orders(orders))),
                    None => {
                        let epoch = tables.lock().machine.epoch();
                        Ok((epoch, Message::Epoch(epoch)))
                    }
                }
            }
            Message::AcknowledgeRecovery(epoch) => {
                feed::acknowledge(tables, counters, epoch)?;
                Ok((epoch, Message::Epoch(epoch)))
            }
            Message::Lifeline { member, epoch, process } => {
                let held = Slot::take(lifeline_slots, lifeline::MAX_LIFELINES)
                    .ok_or_else(|| ControllerError::Protocol("too many lifelines".into()))?;
                let number = lifeline::register(&mut tables.lock(), member, epoch, process)?;
                lifeline = Some((member, number, held));
                Ok((epoch, Message::Epoch(epoch)))
            }
            other => Err(ControllerError::Protocol(format!("unexpected {other:?}"))),
        });
        match reply {
            Ok((epoch, answer)) => {
                let (header, payload) = answer.frame(QUERY_SERVER_NODE, epoch, request);
                write_frame(&mut writer, &header, &payload)?
            }
            Err(e) => {
                let mut header = FrameHeader::new(Kind::Error, 0, 0, request);
                header.ids[0] = refusal_code(&e);
                if let ControllerError::Claimed { by, .. } = e {
                    header.ids[1] = by;
                }
                write_frame(&mut writer, &header, e.to_string().as_bytes())?
            }
        }
        writer.flush()?;
        if let Some((member, number, _held)) = lifeline {
            // No longer a query connection: its query slot goes back, its lifeline slot is held.
            drop(slot);
            if let Ok(sender) = writer.get_ref().try_clone() {
                tables.lock().lifelines.insert(member, (number, sender));
            }
            lifeline::wait_out(reader, (member, number), tables, counters, events);
            return Ok(());
        }
    }
    Ok(())
}

/// Every member the controller knows, and its health.
fn census_of(tables: &Tables) -> Message {
    Message::CensusReply { epoch: tables.machine.epoch(), members: tables.machine.census(tables.now()) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heartbeat::beat;
    use std::path::Path;

    const EVERY: Duration = Duration::from_millis(20);
    const SECRET: &[u8] = b"test cluster";

    fn start(state: &Path, listen: SocketAddr, timeout_ms: u64) -> SocketAddr {
        start_serving_metrics(state, listen, timeout_ms).0
    }

    /// A controller as [`start`] starts it, with its metrics page: both addresses.
    fn start_serving_metrics(state: &Path, listen: SocketAddr, timeout_ms: u64) -> (SocketAddr, SocketAddr) {
        let config = ControllerConfig {
            listen,
            store: StoreConfig::File(state.to_owned()),
            leaving: Leaving::default(),
            timeout: Duration::from_millis(timeout_ms),
            interval: Duration::from_millis(20),
            metrics: Some("127.0.0.1:0".parse().unwrap()),
            secret: SECRET.to_vec(),
            journal: None,
            stages: None,
        };
        let (tx, rx) = crossbeam_channel::bounded(1);
        std::thread::spawn(move || {
            serve_controller(config, |addr, metrics| tx.send((addr, metrics.unwrap())).unwrap())
        });
        rx.recv_timeout(Duration::from_secs(5)).unwrap()
    }

    fn wait_for(client: &mut ControllerClient, member: Member, health: Health) -> Census {
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            let census = client.census().unwrap();
            if census.health(member) == health || Instant::now() > until {
                return census;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn only_members_of_the_cluster_are_answered_or_kept_alive() {
        let dir = tempfile::tempdir().unwrap();
        let addr = start(&dir.path().join("state"), "127.0.0.1:0".parse().unwrap(), 200);
        // A client of another cluster is refused before any query is answered.
        let mut stranger = ControllerClient::new(addr, Duration::from_secs(2), b"another cluster".as_slice());
        let refused = stranger.census();
        assert!(matches!(refused, Err(ControllerError::Auth(_))), "{refused:?}");
        let mut client = ControllerClient::new(addr, Duration::from_secs(2), SECRET);
        // Beats signed with another secret register no one.
        let foreign = beat(addr, (Role::Engine, 5), 0, EVERY, None, b"another cluster").unwrap();
        // A member beating with growing sequence numbers stays alive past the timeout (200 ms)...
        let sender = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut recorded = Beat {
            member: (Role::Engine, 0),
            pid: 1,
            epoch: 0,
            sequence: 0,
            control_port: None,
            data_port: None,
        };
        let until = Instant::now() + Duration::from_millis(500);
        while Instant::now() < until {
            recorded.sequence += 1;
            sender.send_to(&recorded.encode(SECRET), addr).unwrap();
            std::thread::sleep(EVERY);
        }
        assert_eq!(client.census().unwrap().health((Role::Engine, 0)), Health::Alive);
        // ...but its last beat, recorded and replayed over and over, does not keep it alive: the
        // controller declares it dead and fences it once the timeout has passed.
        let datagram = recorded.encode(SECRET);
        let replayer = UdpSocket::bind("127.0.0.1:0").unwrap();
        let until = Instant::now() + Duration::from_millis(600);
        while Instant::now() < until {
            replayer.send_to(&datagram, addr).unwrap();
            std::thread::sleep(EVERY);
        }
        let census = client.census().unwrap();
        assert_eq!(census.health((Role::Engine, 0)), Health::Fenced, "replays are not beats");
        assert!(!census.members.contains_key(&(Role::Engine, 5)), "a stranger's beats: {census:?}");
        // A replacement's beat, signed, is taken whatever it numbers: the member is replaced.
        let fresh = Beat { epoch: census.epoch, sequence: 1, ..recorded };
        replayer.send_to(&fresh.encode(SECRET), addr).unwrap();
        let census = wait_for(&mut client, (Role::Engine, 0), Health::Alive);
        assert_eq!(census.health((Role::Engine, 0)), Health::Alive);
        foreign.stop();
    }

    #[test]
    fn the_controller_fences_the_silent_itself_and_they_stay_fenced_until_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let addr = start(&dir.path().join("state"), "127.0.0.1:0".parse().unwrap(), 200);
        let mut client = ControllerClient::new(addr, Duration::from_secs(2), SECRET);
        assert_eq!(client.census().unwrap().health((Role::Engine, 0)), Health::Dead, "never heard from");
        // A member that beats is alive; garbage on the port changes nothing.
        let stop = beat(addr, (Role::Engine, 0), 0, EVERY, None, SECRET).unwrap();
        assert_eq!(
            wait_for(&mut client, (Role::Engine, 0), Health::Alive).health((Role::Engine, 0)),
            Health::Alive
        );
        UdpSocket::bind("127.0.0.1:0").unwrap().send_to(b"not a heartbeat", addr).unwrap();
        let error = client.fenced_in((Role::Engine, 0)).unwrap_err();
        assert!(matches!(error, ControllerError::NotFenced((Role::Engine, 0))), "{error}");
        assert_eq!(error.to_string(), "engine 0 awaits no replacement: it is not fenced");
        // Silence: suspect, then declared dead and fenced in a new epoch, by the controller alone.
        stop.stop();
        let census = wait_for(&mut client, (Role::Engine, 0), Health::Suspect);
        assert_eq!(census.health((Role::Engine, 0)), Health::Suspect);
        let census = wait_for(&mut client, (Role::Engine, 0), Health::Fenced);
        assert_eq!(census.health((Role::Engine, 0)), Health::Fenced);
        assert_eq!(census.epoch, 1);
        assert_eq!(client.fenced_in((Role::Engine, 0)).unwrap(), 1, "its replacement's epoch");
        // A recovery of what the controller fenced uses its fence; one tried again (not below
        // epoch 2) fences anew.
        assert_eq!(client.fence_unless_fenced(&[(Role::Engine, 0)], 1).unwrap(), 1);
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(client.census().unwrap().epoch, 1, "a fenced member is not fenced again");
        assert_eq!(client.fence_unless_fenced(&[(Role::Engine, 0)], 2).unwrap(), 2);
        assert_eq!(client.fenced_in((Role::Engine, 0)).unwrap(), 2);
        // It stays fenced until a replacement, started in that epoch, beats.
        let _early = beat(addr, (Role::Engine, 0), 1, EVERY, None, SECRET).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert!(client.census().unwrap().is_fenced((Role::Engine, 0)), "started before the fence");
        let _replacement = beat(addr, (Role::Engine, 0), 2, EVERY, None, SECRET).unwrap();
        assert_eq!(
            wait_for(&mut client, (Role::Engine, 0), Health::Alive).health((Role::Engine, 0)),
            Health::Alive
        );
        assert!(client.fenced_in((Role::Engine, 0)).is_err(), "replaced");
        assert_eq!(client.fence(&[]).unwrap(), 3, "epochs only grow");
    }

    #[test]
    fn workers_that_die_together_are_fenced_together_and_a_dead_sidecar_takes_its_engine() {
        let dir = tempfile::tempdir().unwrap();
        let addr = start(&dir.path().join("state"), "127.0.0.1:0".parse().unwrap(), 200);
        let mut client = ControllerClient::new(addr, Duration::from_secs(2), SECRET);
        let members: Vec<Member> = (0..3).flat_map(|i| [(Role::Engine, i), (Role::Sidecar, i)]).collect();
        let mut beats: Vec<_> =
            members.iter().map(|&m| Some(beat(addr, m, 0, EVERY, None, SECRET).unwrap())).collect();
        for &m in &members {
            wait_for(&mut client, m, Health::Alive);
        }
        // Worker 1 (engine and sidecar) and engine 2 stop one beat apart.
        for i in [2, 3] {
            beats[i].take().unwrap().stop();
        }
        std::thread::sleep(EVERY);
        beats[4].take().unwrap().stop();
        let census = wait_for(&mut client, (Role::Engine, 2), Health::Fenced);
        assert_eq!(census.epoch, 1, "one epoch for all: {census:?}");
        for (m, health) in [
            ((Role::Engine, 1), Health::Fenced),
            ((Role::Sidecar, 1), Health::Fenced),
            ((Role::Engine, 2), Health::Fenced),
            ((Role::Sidecar, 2), Health::Alive),
            ((Role::Engine, 0), Health::Alive),
        ] {
            assert_eq!(census.health(m), health, "{m:?} in {census:?}");
        }
        // Sidecar 0 dies while its engine beats on: the whole worker is fenced.
        beats[1].take().unwrap().stop();
        let census = wait_for(&mut client, (Role::Sidecar, 0), Health::Fenced);
        assert_eq!(census.epoch, 2);
        assert_eq!(census.health((Role::Engine, 0)), Health::Fenced, "{census:?}");
        assert_eq!(client.fenced_in((Role::Engine, 0)).unwrap(), 2);
        assert_eq!(client.fenced_in((Role::Engine, 1)).unwrap(), 1);
    }

    #[test]
    fn a_member_whose_lifeline_breaks_is_fenced_long_before_its_heartbeats_would_tell() {
        let dir = tempfile::tempdir().unwrap();
        // A timeout of 5 s: only a lifeline can get a member fenced within a second.
        let (addr, metrics) =
            start_serving_metrics(&dir.path().join("state"), "127.0.0.1:0".parse().unwrap(), 5_000);
        let mut client = ControllerClient::new(addr, Duration::from_secs(2), SECRET);
        let held = || {
            let page = crate::metrics::scrape(metrics).unwrap();
            crate::metrics::value_of(&page, "dejavu_controller_lifelines", &[]).unwrap()
        };
        let hold = |member, epoch| {
            let lifeline = Lifeline::hold(addr, member, epoch, EVERY, SECRET).unwrap();
            let heartbeat = beat(addr, member, epoch, EVERY, None, SECRET).unwrap();
            crate::membership::Membership::new(heartbeat, lifeline)
        };
        let engine = hold((Role::Engine, 0), 0);
        let sidecar = hold((Role::Sidecar, 0), 0);
        let _other = hold((Role::Engine, 1), 0);
        let lifelines = |client: &mut ControllerClient| {
            let until = Instant::now() + Duration::from_secs(5);
            while client.census().unwrap().members.len() < 3 || held() < 3.0 {
                assert!(Instant::now() < until, "the lifelines are never held");
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        lifelines(&mut client);
        // A watcher waiting for a fence hears of it as soon as it is opened.
        let watcher = std::thread::spawn(move || {
            let mut watcher = ControllerClient::new(addr, Duration::from_secs(8), SECRET);
            let asked = Instant::now();
            (watcher.await_fence(0, Duration::from_secs(5)).unwrap(), asked.elapsed())
        });
        std::thread::sleep(Duration::from_millis(50));
        // The worker's processes end (as if killed) together: both are fenced, in one epoch.
        let ended = Instant::now();
        drop(engine);
        drop(sidecar);
        let census = wait_for(&mut client, (Role::Sidecar, 0), Health::Fenced);
        assert!(ended.elapsed() < Duration::from_secs(1), "fenced after {:?}", ended.elapsed());
        assert_eq!(census.epoch, 1, "{census:?}");
        assert!(census.is_fenced((Role::Engine, 0)), "{census:?}");
        assert_eq!(census.health((Role::Engine, 1)), Health::Alive);
        let (epoch, waited) = watcher.join().unwrap();
        assert_eq!(epoch, 1);
        assert!(waited < Duration::from_secs(2), "the watcher heard after {waited:?}");
        // With no fence, the wait ends with the epoch as it was.
        let asked = Instant::now();
        assert_eq!(client.await_fence(1, Duration::from_millis(100)).unwrap(), 1);
        assert!(asked.elapsed() >= Duration::from_millis(100));
        // The fenced process's lifeline is refused; its replacement's counts, and outlives an
        // older lifeline of the same member that ends after it.
        let stale = Lifeline::hold(addr, (Role::Engine, 0), 0, EVERY, SECRET).unwrap();
        let first = hold((Role::Engine, 0), 1);
        wait_for(&mut client, (Role::Engine, 0), Health::Alive);
        let second = Lifeline::hold(addr, (Role::Engine, 0), 1, EVERY, SECRET).unwrap();
        let until = Instant::now() + Duration::from_secs(5);
        while held() < 3.0 {
            assert!(Instant::now() < until, "the second lifeline is never held");
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(stale);
        drop(first);
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            client.census().unwrap().health((Role::Engine, 0)),
            Health::Alive,
            "an older lifeline ended"
        );
        drop(second);
        assert!(wait_for(&mut client, (Role::Engine, 0), Health::Fenced).is_fenced((Role::Engine, 0)));
    }

    #[test]
    fn a_fenced_process_is_ignored_when_it_beats_again() {
        let dir = tempfile::tempdir().unwrap();
        let addr = start(&dir.path().join("state"), "127.0.0.1:0".parse().unwrap(), 200);
        let mut client = ControllerClient::new(addr, Duration::from_secs(2), SECRET);
        // Sidecar 1, started in epoch 0, is fenced and beats on (a stale worker rejoining).
        let first = beat(addr, (Role::Sidecar, 1), 0, EVERY, None, SECRET).unwrap();
        wait_for(&mut client, (Role::Sidecar, 1), Health::Alive);
        let epoch = client.fence(&[(Role::Sidecar, 1)]).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert!(client.census().unwrap().is_fenced((Role::Sidecar, 1)), "its beats are refused");
        // Its replacement, started in the fence's epoch, counts; the stale one still does not.
        let replacement = beat(addr, (Role::Sidecar, 1), epoch, EVERY, None, SECRET).unwrap();
        wait_for(&mut client, (Role::Sidecar, 1), Health::Alive);
        drop(replacement);
        assert!(wait_for(&mut client, (Role::Sidecar, 1), Health::Fenced).is_fenced((Role::Sidecar, 1)));
        drop(first);
    }

    #[test]
    fn a_restarted_controller_keeps_its_epochs_and_fences_and_waits_before_declaring_deaths() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        // The first controller hears from engines 0 and 1, then fences engine 1.
        let first = start(&path, "127.0.0.1:0".parse().unwrap(), 300);
        let mut client = ControllerClient::new(first, Duration::from_secs(2), SECRET);
        let _beats = beat(first, (Role::Engine, 0), 0, EVERY, None, SECRET).unwrap();
        let one = beat(first, (Role::Engine, 1), 0, EVERY, None, SECRET).unwrap();
        wait_for(&mut client, (Role::Engine, 1), Health::Alive);
        wait_for(&mut client, (Role::Engine, 0), Health::Alive);
        assert_eq!(client.fence(&[(Role::Engine, 1)]).unwrap(), 1);
        one.stop();
        // A second controller on the same state (a copy, on another port: the first one's thread
        // lives on in this test process, holding the file's lock) hears from no one at first.
        let restarted = dir.path().join("restarted");
        std::fs::copy(&path, &restarted).unwrap();
        let second = start(&restarted, "127.0.0.1:0".parse().unwrap(), 300);
        let mut client = ControllerClient::new(second, Duration::from_secs(2), SECRET);
        let census = client.census().unwrap();
        assert_eq!(census.epoch, 1, "the epoch survived");
        assert_eq!(census.health((Role::Engine, 0)), Health::Alive, "a live member gets a timeout of grace");
        assert!(census.is_fenced((Role::Engine, 1)), "a fenced member still awaits its replacement");
        // The fenced engine, back from a pause, beats to the second controller, which never heard
        // from it: still ignored, as started before the fence; its replacement counts.
        let stale = beat(second, (Role::Engine, 1), 0, EVERY, None, SECRET).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert!(client.census().unwrap().is_fenced((Role::Engine, 1)), "a stale process after a restart");
        let _replacement = beat(second, (Role::Engine, 1), 1, EVERY, None, SECRET).unwrap();
        assert!(!wait_for(&mut client, (Role::Engine, 1), Health::Alive).is_dead((Role::Engine, 1)));
        drop(stale);
        // Engine 0 beats to the first controller only: to the second it falls silent, and the
        // second fences it in an epoch of its own.
        let census = wait_for(&mut client, (Role::Engine, 0), Health::Fenced);
        assert_eq!(census.health((Role::Engine, 0)), Health::Fenced);
        assert_eq!(census.epoch, 2, "no epoch is handed out twice");
        assert_eq!(client.fence(&[]).unwrap(), 3);
        assert_eq!(State::load(&restarted).unwrap().incarnation, 2);
    }

    #[test]
    fn malformed_requests_are_refused_and_the_connection_survives() {
        let dir = tempfile::tempdir().unwrap();
        let addr = start(&dir.path().join("state"), "127.0.0.1:0".parse().unwrap(), 200);
        let mut client = ControllerClient::new(addr, Duration::from_secs(2), SECRET);
        // A fence of one member whose role is 9.
        let mut fence = Message::Fence { members: vec![(Role::Engine, 0)], reuse: None }.encode();
        fence[8] = 9;
        let error = client.call_with_payload(fence).unwrap_err().to_string();
        assert!(error.contains("malformed a member's role"), "{error}");
        let mut unknown = Message::Census.encode();
        unknown[2] = 77;
        let error = client.call_with_payload(unknown).unwrap_err().to_string();
        assert!(error.contains("unknown message code 77"), "{error}");
        let error = client.call(&Message::Probe).unwrap_err().to_string();
        assert!(error.contains("unexpected Probe"), "{error}");
        assert_eq!(client.census().unwrap().epoch, 0, "nothing was fenced");
    }

    #[test]
    fn a_busy_port_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let config = ControllerConfig {
            listen: taken.local_addr().unwrap(),
            store: StoreConfig::File(dir.path().join("state")),
            leaving: Leaving::default(),
            timeout: Duration::from_millis(200),
            interval: Duration::from_millis(20),
            metrics: None,
            secret: SECRET.to_vec(),
            journal: None,
            stages: None,
        };
        let error = serve_controller(config, |_, _| panic!("it cannot be ready")).unwrap_err();
        assert!(matches!(error, ControllerError::Io(_)), "{error}");
    }
}
