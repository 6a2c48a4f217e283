//! Lifelines: a connection each member holds open to the controller's query port for as long as
//! its process lives, so that a process that dies is seen dead at once rather than after the
//! heartbeat timeout.
//!
//! When a process exits or is killed, its kernel closes its sockets: the controller reads the end
//! of the member's lifeline within a round trip, declares the member dead and wakes its detector.
//! Heartbeats stay what detects the rest (a process stopped or hung, a host gone, a network cut):
//! none of those closes a connection. A member that never holds a lifeline is watched by its
//! heartbeats alone.
//!
//! - A lifeline is a query connection (it proves the cluster secret the same way) whose first
//!   request, [`dejavulib::message::Message::Lifeline`], names the member and the epoch its process was started in. A
//!   process fenced in a newer epoch is refused, as its heartbeats are.
//! - Only the member's latest lifeline counts: the end of an older one (a process presumed dead
//!   and replaced, a connection the member opened again) says nothing of the member.
//! - A fence forgets the fenced members' lifelines; the replacement holds its own.
//! - The member's side ([`Lifeline`]) opens the connection again whenever it breaks (a controller
//!   restarted), every retry interval, until it is dropped.

use std::io::{BufReader, ErrorKind, Read};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dejavu_proto::liveness::LifelineRefused;
use dejavulib::message::Message;
use dejavulib::wire::read_frame;
use parking_lot::Mutex;
use tracing::{debug, error, info, warn};

use super::{ControllerClient, ControllerError, Counters, Events, Member, Tables};

/// Lifelines held at once; more are refused (each holds a thread of the controller).
pub(super) const MAX_LIFELINES: usize = 1024;

/// The controller's side, when `member`, started in `epoch`, asks to hold a lifeline: its number,
/// now the member's current one, or a refusal for a process fenced since it started.
pub(super) fn register(
    tables: &mut Tables,
    member: Member,
    epoch: u64,
    process: u32,
) -> Result<u64, ControllerError> {
    let opened = tables.machine.lifeline_opened(member, epoch, process);
    tables.write_journal();
    opened.map_err(|refused| match refused {
        LifelineRefused::Stale { epoch, fenced_in } => ControllerError::Protocol(format!(
            "a lifeline of a process started in epoch {epoch}, fenced in epoch {fenced_in}"
        )),
        LifelineRefused::Claimed { by, .. } => {
            warn!(?member, process, holder = by, "refused a second process claiming a member's place");
            ControllerError::Claimed { member, by }
        }
    })
}

/// The controller's side of lifeline `number` of `member`, once answered: waits for the
/// connection's end, then, if it was still the member's lifeline, declares the member dead and
/// wakes the detector.
pub(super) fn wait_out(
    mut reader: BufReader<TcpStream>,
    (member, number): (Member, u64),
    tables: &Mutex<Tables>,
    counters: &Counters,
    events: &Events,
) {
    // A member's host that vanishes sends no end: probes find the connection dead within a
    // minute, and give its thread and slot back (the heartbeats have declared it dead by then).
    if let Err(e) = keep_alive(reader.get_ref()) {
        debug!(error = %e, "a lifeline without keepalive probes");
    }
    counters.lifelines.fetch_add(1, Ordering::Relaxed);
    // A member sends nothing more: whatever comes is dropped.
    read_until_end(&mut reader);
    counters.lifelines.fetch_sub(1, Ordering::Relaxed);
    let mut tables = tables.lock();
    if tables.lifelines.get(&member).is_some_and(|(held, _)| *held == number) {
        tables.lifelines.remove(&member);
    }
    let now = tables.now();
    let current = tables.machine.lifeline_closed(member, number, now);
    tables.write_journal();
    if current {
        counters.severed_lifelines.fetch_add(1, Ordering::Relaxed);
        info!(?member, "a lifeline broke: the member's process is gone");
        // A full channel means the detector runs anyway.
        let _ = events.severed.try_send(());
    }
}

/// A member's lifeline to the controller, held by a thread of its own until this is dropped.
#[derive(Debug)]
pub struct Lifeline {
    stop: Arc<AtomicBool>,
    /// The connection now held, to be shut down when this is dropped.
    held: Arc<Mutex<Option<TcpStream>>>,
    /// The epoch of the fence the controller announced on it ([`NOT_FENCED`] until then).
    fenced: Arc<AtomicU64>,
}

/// No fence heard (epochs of fences start at 1).
const NOT_FENCED: u64 = 0;

/// How long a member's lifeline may find no controller to take it before the member says so:
/// longer than a failover on etcd takes, even one that waits out a lease.
pub const NO_CONTROLLER_PATIENCE: Duration = Duration::from_secs(5);

impl Lifeline {
    /// Holds a lifeline for `member`, whose process was started in `epoch`, to the controller at
    /// `controller`, proving the cluster secret `secret`; a connection that cannot be opened or
    /// breaks is tried again every `retry`.
    ///
    /// The first one is asked for before this returns: a controller that says another live
    /// process of the same epoch holds the member's place ([`ControllerError::Claimed`]) is asked
    /// again for 2 s (a predecessor that just died may not have been seen dead
    /// yet), then refused. An unreachable controller is tried again in the background.
    pub fn hold(
        controller: SocketAddr,
        member: Member,
        epoch: u64,
        retry: Duration,
        secret: &[u8],
    ) -> Result<Self, ControllerError> {
        Self::hold_for(&[controller], member, epoch, std::process::id(), retry, secret)
    }

    /// As [`Lifeline::hold`], for process `process`, whose member this one is held on behalf of
    /// (a sidecar holds its engine's, for as long as the engine's connection lasts), to whichever
    /// of `controllers` takes it (several on etcd: the leader does; a lifeline that cannot be
    /// opened or breaks is tried at the next one).
    pub fn hold_for(
        controllers: &[SocketAddr],
        member: Member,
        epoch: u64,
        process: u32,
        retry: Duration,
        secret: &[u8],
    ) -> Result<Self, ControllerError> {
        let controllers = controllers.to_vec();
        let Some(&first_controller) = controllers.first() else {
            return Err(ControllerError::Protocol("no controller to hold a lifeline to".into()));
        };
        let patience = retry.max(Duration::from_secs(1));
        let started = Instant::now();
        // The controller tried next, by its place in `controllers`.
        let mut next = 0;
        let first = loop {
            match open(first_controller, (member, epoch, process), patience, secret) {
                Err(claimed @ ControllerError::Claimed { .. }) if started.elapsed() >= CLAIM_PATIENCE => {
                    return Err(claimed)
                }
                Err(ControllerError::Claimed { .. }) => std::thread::sleep(retry.min(CLAIM_PATIENCE / 10)),
                Ok(opened) => break Some(opened),
                Err(e) => {
                    debug!(error = %e, "cannot hold a lifeline to the controller yet");
                    next = 1;
                    break None;
                }
            }
        };
        let stop = Arc::new(AtomicBool::new(false));
        let held = Arc::new(Mutex::new(None));
        let fenced = Arc::new(AtomicU64::new(NOT_FENCED));
        let (stopped, holding, fenced_in, secret) =
            (stop.clone(), held.clone(), fenced.clone(), secret.to_vec());
        std::thread::Builder::new().name("lifeline".into()).spawn(move || {
            let mut opened = first;
            // Since when no controller holds the lifeline, and whether the member said so.
            let mut unheld_since = opened.is_none().then(Instant::now);
            let mut said = false;
            while !stopped.load(Ordering::SeqCst) {
                let at = controllers[next % controllers.len()];
                match opened.take().map_or_else(|| open(at, (member, epoch, process), patience, &secret), Ok)
                {
                    Ok((stream, shutter)) => {
                        if said {
                            info!(?member, controller = %at, "a controller holds this member's lifeline again: its failures are detected again");
                        }
                        said = false;
                        *holding.lock() = shutter;
                        // Dropped meanwhile: the drop found no connection to shut down.
                        if stopped.load(Ordering::SeqCst) {
                            break;
                        }
                        if let Some(epoch) = hear_fence(&stream) {
                            error!(
                                ?member,
                                epoch,
                                "FENCED: the controller declared this process dead in epoch {epoch} and a \
                                 replacement takes its place; it serves nothing more and should be stopped"
                            );
                            fenced_in.store(epoch, Ordering::SeqCst);
                            // A fenced process holds no lifeline again: it would be refused.
                            break;
                        }
                        unheld_since = Some(Instant::now());
                    }
                    Err(e) => {
                        debug!(error = %e, %at, "cannot hold a lifeline to this controller");
                        next += 1;
                        if !said && unheld_since.is_some_and(|since| since.elapsed() >= NO_CONTROLLER_PATIENCE) {
                            warn!(
                                ?member,
                                ?controllers,
                                "no controller has taken this member's lifeline for {} s: none leads (on etcd, \
                                 etcd may be down). Serving and copies go on, but failures here are neither \
                                 detected nor recovered until a controller leads again",
                                NO_CONTROLLER_PATIENCE.as_secs()
                            );
                            said = true;
                        }
                    }
                }
                std::thread::sleep(retry);
            }
        })?;
        Ok(Self { stop, held, fenced })
    }

    /// The epoch the controller fenced this process in, if it did (and this process heard it).
    pub fn fenced_in(&self) -> Option<u64> {
        Some(self.fenced.load(Ordering::SeqCst)).filter(|&epoch| epoch != NOT_FENCED)
    }
}

/// How long a process asks again for a lifeline another process of its epoch holds, before it
/// takes the refusal.
pub const CLAIM_PATIENCE: Duration = Duration::from_secs(2);

impl Drop for Lifeline {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(stream) = self.held.lock().take() {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

/// A connection to the controller at `controller`, accepted as `member`'s lifeline (for its
/// process started in `epoch`, `process`), and a second
/// handle on it to shut it down from elsewhere (if one could be had); `patience` bounds each step
/// of opening it.
fn open(
    controller: SocketAddr,
    (member, epoch, process): (Member, u64, u32),
    patience: Duration,
    secret: &[u8],
) -> Result<(TcpStream, Option<TcpStream>), ControllerError> {
    let stream = ControllerClient::new(controller, patience, secret).into_lifeline(member, epoch, process)?;
    // Without a second handle the lifeline still holds; it only ends with the process.
    let shutter = stream.try_clone().ok();
    Ok((stream, shutter))
}

/// Reads what the controller sends on a held lifeline until it ends, breaks or is shut down;
/// returns the epoch of a fence it announced ([`Message::Fenced`]), if it did.
fn hear_fence(stream: &TcpStream) -> Option<u64> {
    let mut reader = BufReader::new(stream);
    loop {
        match read_frame(&mut reader, 1 << 16) {
            Ok(Some(frame)) => {
                if let Ok(Message::Fenced(epoch)) = Message::of_frame(&frame) {
                    return Some(epoch);
                }
            }
            Ok(None) | Err(_) => return None,
        }
    }
}

/// Reads and drops what comes on `stream` until it ends, breaks, or is shut down.
fn read_until_end(stream: &mut impl Read) {
    let mut sink = [0u8; 64];
    loop {
        match stream.read(&mut sink) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => return,
        }
    }
}

/// Probes an idle `stream` after 30 s, then every 10 s, and closes it after 3 probes unanswered.
fn keep_alive(stream: &TcpStream) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    for (level, option, value) in [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 30),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 10),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3),
    ] {
        let value: libc::c_int = value;
        // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from `&value`, a live c_int; the
        // descriptor belongs to `stream`, open for the whole call.
        let rc = unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                level,
                option,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}
