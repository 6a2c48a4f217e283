//! A sidecar's control listener, through which the controller carries out recoveries, and
//! [`SidecarControl`], the controller's end.
//!
//! The listener is a TCP port on the sidecar's transport address; the sidecar's heartbeats name it
//! ([`crate::heartbeat::Beat::control_port`]), so the controller reaches whichever process holds
//! a stage's sidecar now. Requests and replies are control messages ([`dejavulib::message`]):
//!
//! - [`Message::HeldOf`]: the chunks it keeps for a stage (its own stage's local copy, or its
//!   predecessor's replica), a page of them in the order of their keys
//!   ([`Message::HeldOfPage`]). The controller asks page after page and finds each sequence's
//!   first unreplicated token from them.
//! - [`Message::Reseed`]: forward to that sidecar from now on, and first send it every chunk of
//!   its own stage it keeps (each sequence start alone and in put order, the chunks between two
//!   starts all at once); the reply ([`Message::Reseeded`]) says how many. A replaced
//!   successor's sidecar gets the replica it must hold this way.
//!
//! - [`Message::HandBack`]: send every chunk of a stage it holds (its predecessor's replica) to
//!   the sidecar that replaced that stage's, which keeps them as its local copy.
//!
//! - [`Message::Assign`]: a spare sidecar becomes a stage's, in the epoch of that stage's fence
//!   (the controller hands spares over itself when it runs with `--stages`).
//!
//! A connection first proves the cluster secret (the transports' HMAC challenge-response,
//! [`dejavulib::net::auth`]); one that cannot is closed before any request is read. A refusal is
//! an `Error` frame whose payload says why. At most [`MAX_CONTROL_CONNECTIONS`] are served at once.

use std::io::{BufReader, BufWriter, ErrorKind, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use dejavulib::chunk::{ChunkDescriptor, ChunkKey};
use dejavulib::message::Message;
use dejavulib::net::auth::{client_handshake_blocking, server_handshake_blocking};
use dejavulib::net::{ClientConfig, PeerStore};
use dejavulib::resume::HeldChunk;
use dejavulib::wire::{read_frame, write_frame, ErrorCode, FrameError, Kind};
use dejavulib::ChunkStore;
use tracing::{info, warn};

use dejavu_proto::worker::Place;

use super::{reply, reply_error, Forward, Sidecar, SidecarError};
use crate::slots::Slot;

/// The largest request or reply: a page of a listing, or a re-seed's address.
const MAX_CONTROL_FRAME: u64 = 16 << 20;

/// Entries of a listing in one reply at most: 3.4 MB of them.
pub const MAX_PAGE: usize = 1 << 16;

/// Control connections served at once; more are closed at once.
pub const MAX_CONTROL_CONNECTIONS: usize = 16;

/// How long a connection has to prove the cluster secret.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);

/// The node id the controller proves the secret as.
const CONTROLLER_NODE: u32 = u32::MAX;

/// Serves control connections on `listener` until the process ends, each on a thread of its own.
pub(super) fn serve(sidecar: Arc<Sidecar>, listener: TcpListener) -> std::io::Result<()> {
    let live = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new().name("control".into()).spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            };
            let Some(slot) = Slot::take(&live, MAX_CONTROL_CONNECTIONS) else {
                warn!(stage = sidecar.index(), "too many control connections: one closed");
                continue;
            };
            let sidecar = sidecar.clone();
            let spawned = std::thread::Builder::new().name("control-connection".into()).spawn(move || {
                let _slot = slot;
                if let Err(e) = answer(&sidecar, stream) {
                    warn!(stage = sidecar.index(), error = %e, "a control connection ended");
                }
            });
            if let Err(e) = spawned {
                warn!(error = %e, "cannot serve a control connection");
            }
        }
    })?;
    Ok(())
}

/// Answers one connection's requests until it closes.
fn answer(sidecar: &Sidecar, stream: TcpStream) -> Result<(), SidecarError> {
    stream.set_nodelay(true)?;
    server_handshake_blocking(&stream, &sidecar.config.secret, sidecar.index(), HANDSHAKE_DEADLINE)
        .map_err(|e| SidecarError::Protocol(format!("control handshake: {e}")))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = BufWriter::new(stream);
    while let Some(frame) = read_frame(&mut reader, MAX_CONTROL_FRAME)? {
        let message = match Message::of_frame(&frame) {
            Ok(message) => message,
            Err(e) => {
                reply_error(&mut writer, &frame, ErrorCode::Unexpected, &e.to_string())?;
                continue;
            }
        };
        let answer = match message {
            Message::HeldOf { stage, want, after } => {
                let (chunks, left) = sidecar.page_of(stage, after.as_ref(), (want as usize).min(MAX_PAGE));
                Ok(Message::HeldOfPage { chunks, left: left.min(u32::MAX as usize) as u32 })
            }
            Message::Reseed { to } => sidecar.reseed(to).map(|chunks| {
                info!(stage = sidecar.index(), %to, chunks, "re-seeded a new successor");
                Message::Reseeded { chunks }
            }),
            Message::HandBack { stage, to } => sidecar.hand_back(stage, to).map(|chunks| {
                info!(stage = sidecar.index(), of = stage, %to, chunks, "handed a replica back to a replaced sidecar");
                Message::Reseeded { chunks }
            }),
            Message::Assign { stage, epoch } => sidecar.take_up(stage, epoch).map(|()| Message::Done),
            other => Err(SidecarError::Protocol(format!("unexpected {other:?}"))),
        };
        match answer {
            Ok(answer) => reply(&mut writer, &frame, sidecar.index(), 0, &answer)?,
            Err(e) => reply_error(&mut writer, &frame, ErrorCode::Other, &e.to_string())?,
        }
        writer.flush()?;
    }
    Ok(())
}

impl Sidecar {
    /// Forwards to `to` from now on and sends it every chunk of its own stage it keeps; returns
    /// how many it sent. Chunks the engine writes meanwhile wait for the re-seed, then go to `to`
    /// as usual.
    ///
    /// The new successor must tell later requests' KV from earlier ones' as this sidecar does:
    /// a sequence's token-0 chunk counts as its start, so what came before it must arrive before
    /// it, and what came after it after ([`dejavulib::resume`]). Each token-0 chunk is therefore
    /// sent alone, in put order, and the chunks between two of them all at once.
    fn reseed(&self, to: SocketAddr) -> Result<u64, SidecarError> {
        if self.machine.lock().place() == Place::Spare {
            return Err(SidecarError::Unassigned);
        }
        // As the engine in use, so that the new successor takes its later forwards too.
        let epoch = self.epoch();
        self.set_successor(to, epoch);
        // Another request may have named another successor since: then this re-seed is void.
        let successor = match self.successor.lock().clone() {
            Forward::To(successor) if successor.addr == to => successor,
            _ => return Err(SidecarError::NotTheSuccessor(to)),
        };
        let store = successor.store.lock();
        store.client().set_epoch(epoch);
        let sent = self.send_held(self.index(), &store, to)?;
        super::add(&self.stats.reseeded_chunks, sent);
        Ok(sent)
    }

    /// Sends every chunk of `stage` it holds (the replica of its predecessor's KV) to the sidecar
    /// at `to`, which replaced that stage's sidecar after its worker died: they become the
    /// replacement's local copy, which the stage's replacement engine restores from. Returns how
    /// many it sent.
    fn hand_back(&self, stage: u32, to: SocketAddr) -> Result<u64, SidecarError> {
        let mut client = ClientConfig::new(self.config.secret.clone(), self.index());
        // As the engine in use, as its forwards: the replacement refuses a sender's older epochs.
        client.epoch = self.epoch();
        let transport = self.config.transport.make().map_err(|e| SidecarError::Protocol(e.to_string()))?;
        let store = PeerStore::new(self.runtime.clone(), transport, to, client);
        let sent = self.send_held(stage, &store, to)?;
        super::add(&self.stats.reseeded_chunks, sent);
        Ok(sent)
    }

    /// Sends every chunk of `stage` it holds to `store` (at `to`), in put order: each sequence's
    /// start alone, the chunks between two starts together (see [`Sidecar::reseed`]).
    fn send_held(&self, stage: u32, store: &PeerStore, to: SocketAddr) -> Result<u64, SidecarError> {
        let mut held: Vec<HeldChunk> = self.kept_for(stage).collect();
        held.sort_unstable_by_key(|chunk| chunk.put);
        let mut sent = 0;
        let mut batch = Batch::default();
        for chunk in held {
            let mut payload = Vec::new();
            // A chunk dropped meanwhile is not sent.
            let Ok(descriptor) = self.store.clone().get(&chunk.key, &mut payload) else { continue };
            let starts_a_sequence = descriptor.region.tokens.start == 0;
            if starts_a_sequence {
                sent += batch.send(store, to)?;
            }
            batch.push(descriptor, payload);
            if starts_a_sequence || batch.bytes >= RESEED_BATCH_BYTES {
                sent += batch.send(store, to)?;
            }
        }
        sent += batch.send(store, to)?;
        Ok(sent)
    }
}

/// Bytes of chunks a re-seed has in flight at most.
const RESEED_BATCH_BYTES: usize = 64 << 20;

/// Chunks a re-seed sends together.
#[derive(Default)]
struct Batch {
    chunks: Vec<(ChunkDescriptor, Vec<u8>)>,
    bytes: usize,
}

impl Batch {
    fn push(&mut self, descriptor: ChunkDescriptor, payload: Vec<u8>) {
        self.bytes += payload.len();
        self.chunks.push((descriptor, payload));
    }

    /// Sends the chunks to `store` (at `to`) all at once, and empties the batch; returns how
    /// many it sent.
    fn send(&mut self, store: &PeerStore, to: SocketAddr) -> Result<u64, SidecarError> {
        let chunks = std::mem::take(&mut self.chunks);
        self.bytes = 0;
        let count = chunks.len() as u64;
        for put in store.put_many(chunks) {
            put.map_err(|source| SidecarError::Reseed { to, source })?;
        }
        Ok(count)
    }
}

/// Errors of [`SidecarControl`].
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The sidecar could not be reached, did not answer in time, or closed the connection.
    #[error("sidecar control at {addr}: {source}")]
    Io {
        /// Its control address.
        addr: SocketAddr,
        /// What failed.
        source: std::io::Error,
    },
    /// It refused the request.
    #[error("sidecar control at {addr} refused: {reason}")]
    Refused {
        /// Its control address.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
    /// It could not prove the cluster secret, or did not take ours.
    #[error("sidecar control at {addr}: {reason}")]
    Auth {
        /// Its control address.
        addr: SocketAddr,
        /// What failed.
        reason: String,
    },
    /// It answered with something malformed.
    #[error("sidecar control at {addr}: {reason}")]
    Protocol {
        /// Its control address.
        addr: SocketAddr,
        /// What was wrong.
        reason: String,
    },
}

/// The controller's end of a sidecar's control listener: one request per connection.
#[derive(Clone)]
pub struct SidecarControl {
    addr: SocketAddr,
    deadline: Duration,
    /// How long connecting and proving the secret may take (at most `deadline`).
    reach: Duration,
    secret: Vec<u8>,
    /// Entries asked for per page of a listing.
    page: u32,
}

impl std::fmt::Debug for SidecarControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The secret stays out of logs.
        f.debug_struct("SidecarControl")
            .field("addr", &self.addr)
            .field("deadline", &self.deadline)
            .field("reach", &self.reach)
            .finish()
    }
}

impl SidecarControl {
    /// A client of the control listener at `addr`, proving the cluster `secret`; a request
    /// slower than `deadline` fails.
    pub fn new(addr: SocketAddr, deadline: Duration, secret: &[u8]) -> Self {
        Self { addr, deadline, reach: deadline, secret: secret.to_vec(), page: MAX_PAGE as u32 }
    }

    /// The same client, giving up on a listener that has not connected and proved the secret
    /// within `patience` (at most the deadline), while the request itself may still take the
    /// whole deadline: for a caller with only so long to wait for a peer that may be gone or
    /// stopped, whose request (a re-seed moving a stage's KV) can be long.
    pub fn reaching_within(mut self, patience: Duration) -> Self {
        self.reach = patience.min(self.deadline);
        self
    }

    /// The same client, asking for listings `entries` at a time (at least 1; the sidecar gives
    /// at most [`MAX_PAGE`]).
    pub fn with_page(mut self, entries: u32) -> Self {
        self.page = entries.max(1);
        self
    }

    /// The control listener's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The chunks the sidecar keeps for `stage`, in the order of their keys, asked for page after
    /// page.
    pub fn held_of(&self, stage: u32) -> Result<Vec<HeldChunk>, ControlError> {
        let mut held: Vec<HeldChunk> = Vec::new();
        loop {
            let after = held.last().map(|h| h.key.clone());
            let last_key = after.as_ref().map(ChunkKey::encode);
            let Message::HeldOfPage { chunks, left } =
                self.call(&Message::HeldOf { stage, want: self.page, after })?
            else {
                return Err(self.protocol("a listing answered with another message".into()));
            };
            if chunks.len() > self.page as usize {
                return Err(self.protocol(format!(
                    "a page of {} chunks for {} asked",
                    chunks.len(),
                    self.page
                )));
            }
            let count = chunks.len();
            let mut previous = last_key;
            for chunk in chunks {
                // Each page starts after the last key of the one before: keys only grow.
                let key = chunk.key.encode();
                if previous.as_ref().is_some_and(|p| key <= *p) {
                    return Err(self.protocol("a listing out of key order".into()));
                }
                previous = Some(key);
                held.push(chunk);
            }
            if left == 0 {
                return Ok(held);
            }
            if count == 0 {
                return Err(self.protocol(format!("an empty page with {left} chunks after it")));
            }
        }
    }

    /// Makes the sidecar forward to `to` from now on, after sending it its own stage's chunks;
    /// returns how many it sent.
    pub fn reseed(&self, to: SocketAddr) -> Result<u64, ControlError> {
        match self.call(&Message::Reseed { to })? {
            Message::Reseeded { chunks } => Ok(chunks),
            other => Err(self.protocol(format!("a re-seed answered with {other:?}"))),
        }
    }

    /// Has the sidecar send every chunk of `stage` it holds to the sidecar at `to`, which replaced
    /// that stage's ([`Message::HandBack`]); returns how many it sent.
    pub fn hand_back(&self, stage: u32, to: SocketAddr) -> Result<u64, ControlError> {
        match self.call(&Message::HandBack { stage, to })? {
            Message::Reseeded { chunks } => Ok(chunks),
            other => Err(self.protocol(format!("a hand-back answered with {other:?}"))),
        }
    }

    /// Makes a spare sidecar stage `stage`'s, started in `epoch` ([`Message::Assign`]).
    pub fn assign(&self, stage: u32, epoch: u64) -> Result<(), ControlError> {
        match self.call(&Message::Assign { stage, epoch })? {
            Message::Done => Ok(()),
            other => Err(self.protocol(format!("an assignment answered with {other:?}"))),
        }
    }

    fn protocol(&self, reason: String) -> ControlError {
        ControlError::Protocol { addr: self.addr, reason }
    }

    fn call(&self, request: &Message) -> Result<Message, ControlError> {
        let io = |source| ControlError::Io { addr: self.addr, source };
        let stream = TcpStream::connect_timeout(&self.addr, self.reach).map_err(io)?;
        stream.set_nodelay(true).map_err(io)?;
        stream.set_read_timeout(Some(self.deadline)).map_err(io)?;
        stream.set_write_timeout(Some(self.deadline)).map_err(io)?;
        client_handshake_blocking(&stream, &self.secret, CONTROLLER_NODE, self.reach)
            .map_err(|e| ControlError::Auth { addr: self.addr, reason: e.to_string() })?;
        let mut writer = BufWriter::new(stream.try_clone().map_err(io)?);
        let (header, payload) = request.frame(CONTROLLER_NODE, 0, 1);
        write_frame(&mut writer, &header, &payload).map_err(|e| self.protocol(e.to_string()))?;
        writer.flush().map_err(io)?;
        let frame = match read_frame(&mut BufReader::new(stream), MAX_CONTROL_FRAME) {
            Ok(Some(frame)) => frame,
            Ok(None) => return Err(io(std::io::Error::new(ErrorKind::UnexpectedEof, "no reply"))),
            Err(FrameError::Io(e)) => return Err(io(e)),
            Err(e) => return Err(self.protocol(e.to_string())),
        };
        match frame.header.kind {
            Kind::Control => Message::of_frame(&frame).map_err(|e| self.protocol(e.to_string())),
            Kind::Error => Err(ControlError::Refused {
                addr: self.addr,
                reason: String::from_utf8_lossy(&frame.payload).into_owned(),
            }),
            other => Err(self.protocol(format!("an unexpected {other:?} reply"))),
        }
    }
}
