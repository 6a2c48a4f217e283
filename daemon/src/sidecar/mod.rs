//! A worker's sidecar process (the engine's end is [`dejavulib::local::LocalSidecar`]).
//!
//! The sidecar is a process beside an engine. It keeps two kinds of copies in host memory (a
//! [`HostStore`]): the engine's own KV (the local copy, which an engine that dies alone restores
//! from without any network transfer) and its ring predecessor's (the replica, which the
//! predecessor's replacement restores from over the transport, a [`PeerServer`]). It forwards
//! each chunk of its engine's KV to the ring successor's sidecar.
//!
//! Engine and sidecar talk over a local Unix socket and share a memory region ([`SharedRegion`])
//! that the chunks themselves cross; [`dejavulib::local`] describes the requests. The sidecar
//! removes the region's file once the engine has mapped it (a killed process leaves nothing
//! behind). A connection from an older epoch than the one in use is refused: a fenced engine back
//! from a pause cannot take its sidecar back.
//!
//! The sidecar is an I/O shell around [`dejavu_proto::Worker`]: which engine it serves, which
//! stage it is (a spare's, once assigned), and what it forwards to the successor, in which order,
//! and what the engine hears for each chunk are the machine's decisions.

use std::io::{BufReader, BufWriter, Write};
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dejavu_proto::fencing::{newest_of, Claim};
use dejavu_proto::forwarding::{Answer, Counts, Kept, Next, Sent, DEFAULT_BACKLOG};
use dejavu_proto::worker::{NotASpare, Place, Worker};
use dejavulib::chunk::{ChunkDescriptor, ChunkKey, SequencePlace, HEADER_LEN};
use dejavulib::local::{
    Successor as Named, HELLO_EPOCH_FROM_SIDECAR, HELLO_MEMBER, HELLO_READER, MAX_LOCAL_PAYLOAD,
    PUT_IN_FLIGHT,
};
use dejavulib::message::Message;
use dejavulib::net::{ClientConfig, PeerClient, PeerError, PeerServer, PeerStore};
use dejavulib::resume::HeldChunk;
use dejavulib::store::StoreError;
use dejavulib::wire::{read_frame, write_frame, ErrorCode, Frame, FrameHeader, Kind};
use dejavulib::{ChunkStore, HostStore};
use parking_lot::Mutex;
use thiserror::Error;
use tracing::{info, warn};

use dejavulib::shm::{SharedRegion, ShmError};
use dejavulib::spill::Spill;

use crate::membership::Membership;
use crate::metrics::{Exposition, MetricType};
use crate::transport::Transports;

pub mod control;
mod forwards;

use forwards::{ForwardJob, Forwards, SharedWriter};

/// Errors of a sidecar.
#[derive(Debug, Error)]
pub enum SidecarError {
    /// A socket failed.
    #[error("local sidecar i/o: {0}")]
    Io(#[from] std::io::Error),
    /// Its local socket is another process's, or cannot be claimed.
    #[error("local socket: {0}")]
    LocalSocket(#[from] crate::lifecycle::ClaimError),
    /// It cannot listen where it was told to.
    #[error("cannot listen at {at}: {source}")]
    Listen {
        /// The address or socket path.
        at: String,
        /// Why.
        source: std::io::Error,
    },
    /// The shared region is not what was announced.
    #[error(transparent)]
    Shm(#[from] ShmError),
    /// A malformed or unexpected frame.
    #[error("local sidecar protocol: {0}")]
    Protocol(String),
    /// Chunks an engine wrote into the shared region are not whole chunks.
    #[error("malformed chunks in the shared region: {0}")]
    Malformed(&'static str),
    /// A chunk could not be kept (bad checksum, bad header, store full).
    #[error("a chunk could not be kept: {0}")]
    Keep(#[from] StoreError),
    /// A chunk was kept but could not be forwarded to the successor (it is forwarded later).
    #[error("forwarding to {to} failed: {source}")]
    Forward {
        /// The successor's sidecar.
        to: SocketAddr,
        /// Why.
        source: StoreError,
    },
    /// A chunk was kept, but waits to be forwarded behind older chunks whose forward failed.
    #[error("the forward to {0} waits behind chunks whose forward failed")]
    ForwardWaits(SocketAddr),
    /// No successor has been named to forward to.
    #[error("no successor to forward to")]
    NoSuccessor,
    /// An assignment reached a sidecar that is not a spare waiting for a stage.
    #[error("not a spare waiting for a stage")]
    NotASpare,
    /// A spare sidecar that no recovery has assigned a stage yet.
    #[error("a spare sidecar, not assigned a stage yet")]
    Unassigned,
    /// A re-seed named a sidecar that another request replaced as the successor meanwhile.
    #[error("{0} is not the successor (any more)")]
    NotTheSuccessor(SocketAddr),
    /// Re-seeding a new successor failed.
    #[error("re-seeding {to} failed: {source}")]
    Reseed {
        /// The new successor's sidecar.
        to: SocketAddr,
        /// Why.
        source: StoreError,
    },
}

impl From<dejavulib::wire::FrameError> for SidecarError {
    fn from(e: dejavulib::wire::FrameError) -> Self {
        Self::Protocol(e.to_string())
    }
}

/// How a sidecar runs.
#[derive(Clone, Debug)]
pub struct SidecarConfig {
    /// The stage it belongs to (its node id when it forwards).
    pub index: u32,
    /// Where its transport listens for replicas and restores (port 0 picks one).
    pub listen: SocketAddr,
    /// Its local socket, for its engine.
    pub local: PathBuf,
    /// Where it creates the shared regions.
    pub shm_dir: PathBuf,
    /// Data bytes of a shared region: the largest chunk (a whole prompt's KV) must fit.
    pub region_bytes: usize,
    /// The cluster secret.
    pub secret: Vec<u8>,
    /// For testing fault checkers only: keep chunks but never forward them, while saying they
    /// were.
    pub skip_forwarding: bool,
    /// Where chunks beyond a memory budget go, if anywhere ([`dejavulib::spill`]).
    pub spill: Option<Spill>,
    /// As a spare (no stage yet), what to do once assigned one: called with the stage and the
    /// epoch of the recovery that assigned it. `None` for a sidecar started for its stage.
    pub spare: Option<OnAssign>,
    /// Whether the controller fenced it ([`FencedProbe`]); none without a controller.
    pub fenced: Option<FencedProbe>,
    /// How it reports an engine's liveness on the engine's behalf ([`EngineMembership`]); none
    /// without a controller.
    pub engine_membership: Option<EngineMembership>,
    /// How it finds the epoch of an engine that asks ([`EngineEpoch`]); without a controller, one
    /// newer than the last engine's.
    pub engine_epoch: Option<EngineEpoch>,
    /// The transport to other sidecars and stages.
    pub transport: Transports,
}

/// Whether the controller has fenced this sidecar, and in which epoch (it heard so on its
/// lifeline): a fenced sidecar refuses engines.
#[derive(Clone)]
pub struct FencedProbe(pub Arc<dyn Fn() -> Option<u64> + Send + Sync>);

impl std::fmt::Debug for FencedProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FencedProbe")
    }
}

/// Makes the membership a sidecar holds for its engine ([`HELLO_MEMBER`]): heartbeats and a
/// lifeline as (engine, `stage`), started in `epoch`, for the engine's process `pid`; `None`
/// without a controller. Dropped when the engine's connection ends.
#[derive(Clone)]
pub struct EngineMembership(pub Arc<dyn Fn(u32, u64, u32) -> Option<Membership> + Send + Sync>);

impl std::fmt::Debug for EngineMembership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineMembership")
    }
}

/// The epoch a sidecar gives an engine that asks for one ([`HELLO_EPOCH_FROM_SIDECAR`]), for
/// `stage`, given the epoch of the last engine it admitted (if any); or why it cannot say.
#[derive(Clone)]
pub struct EngineEpoch(pub Arc<dyn Fn(u32, Option<u64>) -> Result<u64, String> + Send + Sync>);

impl std::fmt::Debug for EngineEpoch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineEpoch")
    }
}

/// What a spare sidecar does once a recovery assigns it a stage (its heartbeats become that
/// stage's sidecar's), with the stage and the recovery's epoch.
#[derive(Clone)]
pub struct OnAssign(pub Arc<dyn Fn(u32, u64) + Send + Sync>);

impl std::fmt::Debug for OnAssign {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnAssign")
    }
}

/// Counters of a sidecar, besides its transport's.
#[derive(Debug, Default)]
pub struct SidecarStats {
    /// Chunks of its engine's KV kept (the local copy), and their payload bytes.
    pub local_chunks: AtomicU64,
    /// See [`SidecarStats::local_chunks`].
    pub local_bytes: AtomicU64,
    /// Chunks forwarded to the successor, and their payload bytes.
    pub forwarded_chunks: AtomicU64,
    /// See [`SidecarStats::forwarded_chunks`].
    pub forwarded_bytes: AtomicU64,
    /// Forwards that failed (the successor's copy lacks those chunks until they are forwarded
    /// again).
    pub forward_failures: AtomicU64,
    /// Chunks forwarded again after a failed forward (the successor's copy caught up).
    pub forwards_caught_up: AtomicU64,
    /// Chunks whose forward was given up on (refused by the successor, or too many waiting).
    pub forwards_dropped: AtomicU64,
    /// Chunks handed to its engine through shared memory (local restores).
    pub local_restores: AtomicU64,
    /// Engine connections refused for an older epoch than the one in use.
    pub stale_engines_refused: AtomicU64,
    /// Chunks of its own stage sent to a new successor when a recovery re-seeded it.
    pub reseeded_chunks: AtomicU64,
}

fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

/// What the connections of a sidecar share.
/// The connection of the engine a sidecar serves (the newest to connect, as its [`Worker`]
/// machine decides), with its number and a handle to shut it. Locked before the machine when
/// both are, so that admitting an engine and replacing the connection are one step.
#[derive(Default)]
struct EngineInUse {
    connection: Option<(u64, UnixStream)>,
}

struct Sidecar {
    config: SidecarConfig,
    /// Where its KV transport listens.
    addr: SocketAddr,
    store: HostStore,
    stats: SidecarStats,
    /// The engine in use's connection.
    engine: Mutex<EngineInUse>,
    /// The sidecar's machine: which engine it serves, which stage it is, and what it forwards to
    /// the successor, in which order, and what waits ([`Worker`]).
    machine: Mutex<Worker<ChunkKey>>,
    /// Where and as what it forwards: the successor's address and a store on it (locked apart,
    /// so that a retarget never waits for a forward to a dead or partitioned successor).
    successor: Mutex<Forward>,
    runtime: tokio::runtime::Handle,
    /// Engine connections so far (numbers them, and their regions).
    connections: AtomicU64,
}

/// Where a sidecar forwards its engine's chunks.
#[derive(Clone, Default)]
enum Forward {
    /// No engine has named a successor yet.
    #[default]
    Unnamed,
    /// Its engine named none ([`Named::LocalOnly`]): it keeps the local copy only.
    LocalOnly,
    /// The ring successor's sidecar.
    To(Successor),
}

impl Forward {
    /// The successor's address, if there is one.
    fn addr(&self) -> Option<SocketAddr> {
        match self {
            Forward::To(successor) => Some(successor.addr),
            Forward::Unnamed | Forward::LocalOnly => None,
        }
    }
}

/// The ring successor a sidecar forwards to: its address, a store on it (locked apart from the
/// rest, so that a retarget never waits for a forward), and its client, to shut when it is
/// replaced.
#[derive(Clone)]
struct Successor {
    addr: SocketAddr,
    store: Arc<Mutex<PeerStore>>,
    client: PeerClient,
}

/// Runs a sidecar until the process is killed: its transport, its local socket, its control
/// listener (`control`, if given: [`control`]) and its metrics (at `metrics`, if given). `ready`
/// gets the transport's address and the metrics page's.
pub fn serve_sidecar(
    config: SidecarConfig,
    control: Option<std::net::TcpListener>,
    metrics: Option<SocketAddr>,
    ready: impl FnOnce(SocketAddr, Option<SocketAddr>),
) -> Result<(), SidecarError> {
    use dejavulib::net::ServerConfig;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    // Only the current sequence of each place: a sidecar serving traffic holds a cache's worth.
    let store =
        config.spill.clone().map_or_else(HostStore::new, HostStore::with_spill).keeping_current_sequences();
    let transport = config.transport.make().map_err(|e| SidecarError::Protocol(e.to_string()))?;
    let server = runtime
        .block_on(PeerServer::bind(
            &*transport,
            config.listen,
            ServerConfig::new(config.secret.clone(), config.index),
            store.clone(),
        ))
        .map_err(|source| SidecarError::Listen { at: config.listen.to_string(), source })?;
    // A socket left by a sidecar that died is replaced; a live one is refused by name.
    let local = crate::lifecycle::bind_unix(&config.local)?;
    let (index, spare) = (config.index, config.spare.is_some());
    let sidecar = Arc::new(Sidecar {
        config,
        addr: server.addr(),
        store,
        stats: SidecarStats::default(),
        engine: Mutex::new(EngineInUse::default()),
        successor: Mutex::new(Forward::Unnamed),
        runtime: runtime.handle().clone(),
        connections: AtomicU64::new(0),
        machine: Mutex::new(Worker::new(
            if spare { Place::Spare } else { Place::Stage { stage: index, epoch: 0 } },
            DEFAULT_BACKLOG,
        )),
    });
    let server = Arc::new(server);
    if let Some(listener) = control {
        control::serve(sidecar.clone(), listener)?;
    }
    let metrics = match metrics {
        Some(at) => {
            let (sidecar, server) = (sidecar.clone(), server.clone());
            Some(crate::metrics::serve(at, move || sidecar.render(&server))?)
        }
        None => None,
    };
    info!(stage = sidecar.index(), addr = %server.addr(), local = %sidecar.config.local.display(), "sidecar listening");
    ready(server.addr(), metrics);
    for stream in local.incoming() {
        let Ok(stream) = stream else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let sidecar = sidecar.clone();
        std::thread::Builder::new().name("engine".into()).spawn(move || {
            if let Err(e) = sidecar.serve_engine(stream) {
                warn!(stage = sidecar.index(), error = %e, "an engine connection ended");
            }
        })?;
    }
    Ok(())
}

impl Sidecar {
    /// The stage it belongs to.
    fn index(&self) -> u32 {
        match self.machine.lock().place() {
            Place::Stage { stage, .. } => stage,
            Place::Spare => self.config.index,
        }
    }

    /// The epoch of the recovery that assigned it its stage, a spare's (0 otherwise).
    fn assigned_epoch(&self) -> u64 {
        match self.machine.lock().place() {
            Place::Stage { epoch, .. } => epoch,
            Place::Spare => 0,
        }
    }

    /// The epoch it acts in toward its peers: its engine's, or the one it took its place in.
    fn epoch(&self) -> u64 {
        self.machine.lock().epoch()
    }

    /// A spare's assignment ([`Message::Assign`]) on an engine's connection: it becomes that
    /// stage's sidecar, once.
    fn assign(
        &self,
        frame: &Frame,
        stage: u32,
        epoch: u64,
        writer: &mut impl Write,
    ) -> Result<(), SidecarError> {
        match self.take_up(stage, epoch) {
            Ok(()) => reply(writer, frame, stage, epoch, &Message::Done),
            Err(e) => reply_error(writer, frame, ErrorCode::Unexpected, &e.to_string()),
        }
    }

    /// As a spare, becomes stage `stage`'s sidecar in `epoch` (its heartbeats become that
    /// stage's), once: by whoever assigns it, the cluster over its local socket or the controller
    /// over its control listener.
    fn take_up(&self, stage: u32, epoch: u64) -> Result<(), SidecarError> {
        let Some(OnAssign(hook)) = self.config.spare.as_ref() else { return Err(SidecarError::NotASpare) };
        self.machine.lock().take_up(stage, epoch).map_err(|NotASpare| SidecarError::NotASpare)?;
        hook(stage, epoch);
        info!(stage, epoch, "a spare sidecar was assigned its stage");
        Ok(())
    }

    /// A new successor named on a connection of its own ([`Message::Successor`] in the engine's
    /// epoch), so that it takes effect even while the engine's connection waits for a forward
    /// to the successor it replaces: that forward is cut short. An engine older than the one in
    /// use is refused.
    fn retarget(
        &self,
        frame: &Frame,
        successor: SocketAddr,
        writer: &mut impl Write,
    ) -> Result<(), SidecarError> {
        let epoch = frame.header.epoch;
        if self.machine.lock().admits_engine(epoch).is_err() {
            reply_error(writer, frame, ErrorCode::StaleEpoch, "an older engine than the one in use")?;
            return Ok(());
        }
        self.set_successor(successor, epoch);
        reply(writer, frame, self.index(), epoch, &Message::Done)
    }

    /// Serves one engine connection until it closes or a newer engine takes over (or a spare's
    /// assignment, or a new successor, on a connection of its own).
    fn serve_engine(&self, stream: UnixStream) -> Result<(), SidecarError> {
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut writer = BufWriter::new(stream.try_clone()?);
        let hello = read_frame(&mut reader, MAX_LOCAL_PAYLOAD)?
            .ok_or_else(|| SidecarError::Protocol("the engine left before its hello".into()))?;
        if hello.header.kind == Kind::Control {
            return match Message::of_frame(&hello) {
                Ok(Message::Assign { stage, epoch }) => self.assign(&hello, stage, epoch, &mut writer),
                Ok(Message::Successor(successor)) => self.retarget(&hello, successor, &mut writer),
                other => {
                    let reason = format!("a connection opened with {other:?}");
                    reply_error(&mut writer, &hello, ErrorCode::Unexpected, &reason)?;
                    Err(SidecarError::Protocol(reason))
                }
            };
        }
        if hello.header.kind != Kind::Hello {
            return Err(SidecarError::Protocol(format!("an engine opened with {:?}", hello.header.kind)));
        }
        if let Some(fenced_in) = self.config.fenced.as_ref().and_then(|probe| (probe.0)()) {
            let reason = format!(
                "this sidecar was fenced in epoch {fenced_in}: its replacement serves stage {}",
                self.index()
            );
            reply_error(&mut writer, &hello, ErrorCode::StaleEpoch, &reason)?;
            return Err(SidecarError::Protocol(reason));
        }
        let is_reader = hello.header.ids[0] & HELLO_READER != 0;
        let n = self.connections.fetch_add(1, Ordering::Relaxed);
        let epoch = if is_reader {
            // A reader takes no one's place: it sees what the engine in use sees.
            self.machine.lock().engine_epoch().unwrap_or(0)
        } else {
            let successor = Named::from_payload(&hello.payload)
                .ok_or_else(|| SidecarError::Protocol("a malformed successor address".into()))?;
            if let Some(addr) = successor.addr().filter(|&addr| self.is_itself(addr)) {
                let reason = format!(
                    "the engine names this sidecar ({addr}) as its own successor: its copies would die \
                     with it. Name the next stage's sidecar (the ring wraps around), or `none` for local \
                     copies only (a ring of one stage)"
                );
                warn!(stage = self.index(), "{reason}");
                reply_error(&mut writer, &hello, ErrorCode::Other, &reason)?;
                return Err(SidecarError::Protocol(reason));
            }
            let epoch = self.engine_epoch(&hello, &mut writer)?;
            self.claim_engine(&hello, epoch, n, stream, &mut writer)?;
            match successor {
                Named::Sidecar(addr) => self.set_successor(addr, epoch),
                Named::LocalOnly => self.keep_locally_only(),
            }
            epoch
        };
        let path = self.config.shm_dir.join(format!(
            "dejavu-{}-stage{}-region{n}",
            std::process::id(),
            self.index()
        ));
        let mut region = SharedRegion::create(&path, self.config.region_bytes, epoch)?;
        let capacity = region.capacity() as u64;
        let mut welcome = FrameHeader::new(Kind::Welcome, self.index(), epoch, hello.header.request);
        welcome.ids = [capacity as u32, (capacity >> 32) as u32, 0, 0];
        write_frame(&mut writer, &welcome, path.display().to_string().as_bytes())?;
        writer.flush()?;
        if is_reader {
            info!(stage = self.index(), epoch, "a reader connected");
        } else {
            info!(stage = self.index(), epoch, "an engine connected");
        }
        // Its liveness, reported for it as long as this connection lasts: the lifeline ends
        // with the connection, which ends with the engine's process.
        let membership = match (&self.config.engine_membership, hello.header.ids[0] & HELLO_MEMBER) {
            (Some(member), HELLO_MEMBER) if !is_reader => {
                (member.0)(self.index(), epoch, peer_pid(writer.get_ref()).unwrap_or(0))
            }
            _ => None,
        };
        let writer = Mutex::new(writer);
        std::thread::scope(|scope| {
            let mut forwards = Forwards::new(scope, self, &writer);
            let mut serve = || -> Result<(), SidecarError> {
                while let Some(frame) = read_frame(&mut reader, MAX_LOCAL_PAYLOAD)? {
                    // A frame read before a newer engine took over is not acted on.
                    if !is_reader && self.engine.lock().connection.as_ref().map(|c| c.0) != Some(n) {
                        return Ok(());
                    }
                    if is_reader && !reader_may(&frame) {
                        let reason = "a reader connection only lists and fetches chunks";
                        reply_error(&mut *writer.lock(), &frame, ErrorCode::Unexpected, reason)?;
                        continue;
                    }
                    if frame.header.kind == Kind::Put && frame.header.ids[1] & PUT_IN_FLIGHT != 0 {
                        self.keep_in_flight(frame, epoch, &region, &writer, &mut forwards)?;
                        continue;
                    }
                    // Any other request is answered after every forward before it: it may depend
                    // on them (a release of what they carry, a listing of what is kept).
                    forwards.drain();
                    let mut writer = writer.lock();
                    self.answer_request(&frame, epoch, &mut region, &mut *writer)?;
                    writer.flush()?;
                }
                Ok(())
            };
            let served = serve();
            // The lifeline ends with the connection, not with the forwards it left, which go on.
            drop(membership);
            served
        })
    }

    /// Keeps the chunk of a put in flight (`put`) and hands it to the connection's forwarding
    /// thread, then answers `Taken`: the engine may write the region again. The put itself is
    /// answered once its forward is over; at once, with an `Error`, if its chunk cannot be kept.
    fn keep_in_flight(
        &self,
        put: Frame,
        epoch: u64,
        region: &SharedRegion,
        writer: &SharedWriter,
        forwards: &mut Forwards<'_, '_>,
    ) -> Result<(), SidecarError> {
        let (descriptor, kept) = match self.keep_one(region.read(put.header.ids[0] as usize)?) {
            Ok(kept) => kept,
            Err(e) => return reply_error(&mut *writer.lock(), &put, ErrorCode::Other, &e.to_string()),
        };
        let request = put.header.request;
        // Handed over under the writer's lock, which the forwarding thread needs to answer the
        // put: `Taken` reaches the engine first. Handed over before `Taken` is written: a kept
        // chunk is forwarded even if the engine is gone.
        let mut writer = writer.lock();
        match forwards.push(ForwardJob { request: put, descriptor, kept, epoch }) {
            Ok(()) => {
                let taken = FrameHeader::new(Kind::Taken, self.index(), epoch, request);
                write_frame(&mut *writer, &taken, &[])?;
                writer.flush()?;
                Ok(())
            }
            Err(job) => {
                let reason = "the sidecar's forwarding thread is gone";
                reply_error(&mut *writer, &job.request, ErrorCode::Other, reason)
            }
        }
    }

    /// Answers one request of the engine of `epoch` (or of a reader), other than a put in flight.
    fn answer_request(
        &self,
        frame: &Frame,
        epoch: u64,
        region: &mut SharedRegion,
        writer: &mut impl Write,
    ) -> Result<(), SidecarError> {
        let request = frame.header.request;
        let answer = |kind: Kind, ids: [u32; 4]| {
            let mut header = FrameHeader::new(kind, self.index(), epoch, request);
            header.ids = ids;
            header
        };
        if frame.header.kind == Kind::Control {
            return match Message::of_frame(frame) {
                Ok(message) => self.answer_engine(frame, message, epoch, region, writer),
                Err(e) => reply_error(writer, frame, ErrorCode::Unexpected, &e.to_string()),
            };
        }
        match (frame.header.kind, frame.header.ids[0]) {
            (Kind::Put, len) => match self.keep_and_forward(region.read(len as usize)?, epoch) {
                Ok(()) => write_frame(writer, &answer(Kind::PutAck, [0; 4]), &[])?,
                Err(e) => reply_error(writer, frame, ErrorCode::Other, &e.to_string())?,
            },
            (Kind::Get, _) => {
                let Some(key) = ChunkKey::decode(&frame.payload) else {
                    return reply_error(writer, frame, ErrorCode::Unexpected, "a malformed chunk key");
                };
                let mut payload = Vec::new();
                match self.store.clone().get(&key, &mut payload) {
                    Ok(descriptor) => {
                        let header = descriptor.encode_header(&payload);
                        let len = region.write(&[&header, &payload])?;
                        add(&self.stats.local_restores, 1);
                        write_frame(writer, &answer(Kind::GetReply, [len as u32, 0, 0, 0]), &[])?;
                    }
                    Err(StoreError::NotFound(_)) => {
                        reply_error(writer, frame, ErrorCode::NotFound, "no such chunk")?
                    }
                    Err(e) => reply_error(writer, frame, ErrorCode::Other, &e.to_string())?,
                }
            }
            (kind, op) => {
                reply_error(writer, frame, ErrorCode::Unexpected, &format!("unexpected {kind:?} {op}"))?
            }
        }
        Ok(())
    }

    /// The epoch of the engine saying `hello`: its own, or the one the sidecar gives it
    /// ([`HELLO_EPOCH_FROM_SIDECAR`]).
    fn engine_epoch(&self, hello: &Frame, writer: &mut impl Write) -> Result<u64, SidecarError> {
        if hello.header.ids[0] & HELLO_EPOCH_FROM_SIDECAR == 0 {
            return Ok(hello.header.epoch);
        }
        let previous = self.machine.lock().engine_epoch();
        let chosen = match &self.config.engine_epoch {
            Some(ask) => (ask.0)(self.index(), previous),
            // Without a controller, a restarted engine takes over from the last one.
            None => Ok(previous.map_or(0, |last| last + 1)),
        };
        chosen.or_else(|reason| {
            reply_error(writer, hello, ErrorCode::Other, &reason)?;
            Err(SidecarError::Protocol(reason))
        })
    }

    /// Makes connection `n` (`stream`) the engine's, of `epoch`: an older epoch than the engine's
    /// in use is refused; the connection of the engine it replaces is shut.
    fn claim_engine(
        &self,
        hello: &Frame,
        epoch: u64,
        n: u64,
        stream: UnixStream,
        writer: &mut impl Write,
    ) -> Result<(), SidecarError> {
        let mut engine = self.engine.lock();
        // Bound apart: the machine's lock is let go before the refusal is written.
        let claim = self.machine.lock().engine_connects(epoch);
        if let Claim::Stale { newest } = claim {
            add(&self.stats.stale_engines_refused, 1);
            let reason = format!("epoch {epoch} is older than the engine's in use, {newest}");
            reply_error(writer, hello, ErrorCode::StaleEpoch, &reason)?;
            return Err(SidecarError::Protocol(reason));
        }
        if let Some((_, old)) = engine.connection.replace((n, stream)) {
            let _ = old.shutdown(std::net::Shutdown::Both);
        }
        Ok(())
    }

    /// The chunks it keeps for stage `stage` (its own, or its predecessor's replica), in no
    /// particular order.
    fn kept_for(&self, stage: u32) -> impl Iterator<Item = HeldChunk> {
        let keys = self.store.keys().into_iter();
        keys.filter(move |(key, _)| key.destination.stage == stage).map(|(key, put)| HeldChunk { key, put })
    }

    /// Answers a control message on the connection of the engine of `epoch`.
    fn answer_engine(
        &self,
        frame: &Frame,
        message: Message,
        epoch: u64,
        region: &mut SharedRegion,
        writer: &mut impl Write,
    ) -> Result<(), SidecarError> {
        match message {
            Message::Mapped => {
                region.unlink();
                reply(writer, frame, self.index(), epoch, &Message::Done)
            }
            Message::Successor(successor) => {
                self.set_successor(successor, epoch);
                reply(writer, frame, self.index(), epoch, &Message::Done)
            }
            Message::Keep { chunks, bytes } => {
                let kept = usize::try_from(bytes)
                    .map_err(|_| SidecarError::Malformed("more bytes to keep than memory holds"))
                    .and_then(|len| Ok(region.read(len)?))
                    .and_then(|c| self.keep(c, chunks));
                match kept {
                    Ok(()) => reply(writer, frame, self.index(), epoch, &Message::Done),
                    Err(e) => reply_error(writer, frame, ErrorCode::Other, &e.to_string()),
                }
            }
            Message::Release(place) => match self.release(&place, epoch) {
                Ok(chunks) => reply(writer, frame, self.index(), epoch, &Message::Released { chunks }),
                Err(e) => reply_error(writer, frame, ErrorCode::Other, &e.to_string()),
            },
            Message::Held { .. } if self.machine.lock().place() == Place::Spare => {
                reply_error(writer, frame, ErrorCode::Unexpected, "a spare sidecar, not assigned a stage yet")
            }
            Message::Held { want, after } => {
                // The keys after the one named, as many as asked for and fit the region.
                let want = (want as usize).min(region.capacity() / HeldChunk::ENCODED_LEN);
                let (page, left) = self.page_of(self.index(), after.as_ref(), want);
                let entries: Vec<u8> = page.iter().flat_map(HeldChunk::encode).collect();
                region.write(&[&entries])?;
                let page = Message::HeldPage {
                    stage: self.index(),
                    epoch: newest_of(epoch, self.assigned_epoch()),
                    successor: self.successor.lock().addr(),
                    count: page.len() as u32,
                    left: left.min(u32::MAX as usize) as u32,
                };
                reply(writer, frame, self.index(), epoch, &page)
            }
            other => reply_error(writer, frame, ErrorCode::Unexpected, &format!("unexpected {other:?}")),
        }
    }

    /// A page of the chunks it keeps for `stage`, in the order of their encoded keys: at most
    /// `wanted` of those whose key sorts after `after` (every one, for an empty `after`), and how
    /// many come after the page. Listings are asked for page by page, each after the last key of
    /// the page before (an engine's through shared memory, the controller's over the control
    /// listener); only the page is sorted, not all that is kept.
    fn page_of(&self, stage: u32, after: Option<&ChunkKey>, wanted: usize) -> (Vec<HeldChunk>, usize) {
        let after = after.map(ChunkKey::encode).unwrap_or_default();
        let mut later: Vec<(Vec<u8>, HeldChunk)> = self
            .kept_for(stage)
            .map(|chunk| (chunk.key.encode(), chunk))
            .filter(|(key, _)| *key > after)
            .collect();
        let rest = later.len().saturating_sub(wanted);
        if rest > 0 {
            later.select_nth_unstable_by(wanted, |a, b| a.0.cmp(&b.0));
            later.truncate(wanted);
        }
        later.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        (later.into_iter().map(|(_, chunk)| chunk).collect(), rest)
    }

    /// Whether `addr` is this sidecar's own KV transport (on any of its addresses, when it
    /// listens on all of them).
    fn is_itself(&self, addr: SocketAddr) -> bool {
        addr == self.addr
            || (self.addr.ip().is_unspecified() && addr.port() == self.addr.port() && addr.ip().is_loopback())
    }

    /// Keeps its engine's chunks here only from now on, forwarding nothing.
    fn keep_locally_only(&self) {
        if let Forward::To(old) = std::mem::replace(&mut *self.successor.lock(), Forward::LocalOnly) {
            old.client.shut();
        }
        info!(
            stage = self.index(),
            "no successor named: local copies only (they do not survive this worker)"
        );
    }

    /// Forwards to `successor` from now on, in `epoch`; named itself (a ring of one stage, whose
    /// recovery names the stage its own predecessor), it keeps the local copy only.
    fn set_successor(&self, successor: SocketAddr, epoch: u64) {
        if self.is_itself(successor) {
            self.keep_locally_only();
            return;
        }
        let mut current = self.successor.lock();
        if current.addr() == Some(successor) {
            return;
        }
        // What the old successor lacks, the re-seed that names the new one copies to it whole.
        self.machine.lock().successor_named();
        let mut client = ClientConfig::new(self.config.secret.clone(), self.index());
        client.epoch = epoch;
        // A dead or cut-off successor is given up on quickly (one connection attempt of at most
        // 500 ms, 2 s for a reply): the engine waits for the forward. What failed is forwarded
        // again before the next chunk, so the successor's copy catches up once it is back.
        client.connect_attempts = 1;
        client.connect_timeout = Duration::from_millis(500);
        client.request_timeout = Duration::from_secs(2);
        let transport = match self.config.transport.make() {
            Ok(transport) => transport,
            Err(e) => {
                warn!(stage = self.index(), error = %e, "no transport to the new successor");
                return;
            }
        };
        let store = PeerStore::new(self.runtime.clone(), transport, successor, client);
        let client = store.client().clone();
        // The successor given up: a forward still waiting on it fails now, not at a timeout.
        let new = Successor { addr: successor, store: Arc::new(Mutex::new(store)), client };
        if let Forward::To(old) = std::mem::replace(&mut *current, Forward::To(new)) {
            old.client.shut();
        }
    }

    /// Verifies and keeps one chunk the engine wrote into the region (`chunk`: header and
    /// payload), copied out before it is verified: the engine's process can write the region at
    /// any time.
    fn keep_one(&self, chunk: &[u8]) -> Result<(ChunkDescriptor, Arc<Vec<u8>>), SidecarError> {
        let (descriptor, kept) = self.store.put_copied(chunk)?;
        add(&self.stats.local_chunks, 1);
        add(&self.stats.local_bytes, (kept.len() - HEADER_LEN) as u64);
        Ok((descriptor, kept))
    }

    /// Verifies and keeps `count` chunks the engine wrote one after the other (`chunks`), without
    /// forwarding them.
    fn keep(&self, mut chunks: &[u8], count: u32) -> Result<(), SidecarError> {
        for _ in 0..count {
            let header =
                chunks.get(..HEADER_LEN).ok_or(SidecarError::Malformed("a chunk shorter than its header"))?;
            let (_, len, _) = ChunkDescriptor::decode_header(header)
                .map_err(|_| SidecarError::Malformed("a chunk header that does not decode"))?;
            let end = usize::try_from(len)
                .ok()
                .and_then(|len| len.checked_add(HEADER_LEN))
                .ok_or(SidecarError::Malformed("a chunk longer than memory"))?;
            let chunk =
                chunks.get(..end).ok_or(SidecarError::Malformed("chunks longer than what was written"))?;
            self.keep_one(chunk)?;
            chunks = &chunks[end..];
        }
        Ok(())
    }

    /// The successor to forward to; `None` where nothing is forwarded (local copies only, or
    /// replication broken on purpose for a test), an error where no successor was named yet.
    fn forwarding_to(&self) -> Result<Option<Successor>, SidecarError> {
        if self.config.skip_forwarding {
            return Ok(None);
        }
        match self.successor.lock().clone() {
            Forward::To(successor) => Ok(Some(successor)),
            Forward::LocalOnly => Ok(None),
            Forward::Unnamed => Err(SidecarError::NoSuccessor),
        }
    }

    /// Drops the sequence at `place` here, then at the successor's sidecar (its replica), as the
    /// engine of `epoch`; returns the chunks dropped here. Chunks of it still waiting to be
    /// forwarded are dropped with it (the backlog skips what the store no longer holds).
    fn release(&self, place: &SequencePlace, epoch: u64) -> Result<u64, SidecarError> {
        let chunks = self.store.release_place(place);
        let Some(Successor { addr, store, .. }) = self.forwarding_to()? else {
            return Ok(chunks);
        };
        let mut store = store.lock();
        store.client().set_epoch(epoch);
        store.release(place).map_err(|source| SidecarError::Forward { to: addr, source })?;
        Ok(chunks)
    }

    /// Verifies and keeps a chunk the engine wrote into the region (`chunk`), then forwards it,
    /// behind any chunks whose forward failed before: the [`Forwarding`] machine decides what is
    /// sent, in which order, and what the engine hears. `Ok` only once the successor stored it and
    /// every chunk kept before it that was not given up on.
    fn keep_and_forward(&self, chunk: &[u8], epoch: u64) -> Result<(), SidecarError> {
        let (descriptor, kept) = self.keep_one(chunk)?;
        self.forward(&descriptor, &kept, epoch)
    }

    /// Forwards a chunk just kept (`kept`: header and payload), as [`Sidecar::keep_and_forward`]
    /// does once it has kept it.
    fn forward(
        &self,
        descriptor: &ChunkDescriptor,
        kept: &Arc<Vec<u8>>,
        epoch: u64,
    ) -> Result<(), SidecarError> {
        let Some(Successor { addr, store, .. }) = self.forwarding_to()? else {
            return Ok(());
        };
        // One forward at a time: the successor's store is held throughout.
        let mut store = store.lock();
        let key = descriptor.key();
        // A chunk given up on to make room is counted with the machine's counts below.
        let Kept { ticket, mut next, .. } = self.machine.lock().kept(key.clone(), epoch);
        let mut failure = None;
        let mut payload = Vec::new();
        let answer = loop {
            let (sent_key, sent_epoch, successor) = match next {
                Next::Answer(answer) => break answer,
                Next::Send { key, epoch, successor } => (key, epoch, successor),
            };
            // The chunk just kept goes as kept, with the checksum the engine computed (not
            // hashed again); an older one is read back from the store, if it is still held.
            store.client().set_epoch(sent_epoch);
            let result = if sent_key == key {
                Some((store.put_encoded(kept), kept.len() - HEADER_LEN))
            } else {
                self.store.clone().get(&sent_key, &mut payload).ok().map(|held| {
                    let result = store.put(&held, &payload);
                    (result, payload.len())
                })
            };
            let outcome = match result {
                None => Sent::Gone,
                Some((Ok(()), bytes)) => {
                    add(&self.stats.forwarded_chunks, 1);
                    add(&self.stats.forwarded_bytes, bytes as u64);
                    Sent::Stored
                }
                Some((Err(e), _)) => {
                    let outcome = if stale(&e) { Sent::Refused } else { Sent::Failed };
                    failure = Some(e);
                    outcome
                }
            };
            next = self.machine.lock().sent(ticket, successor, outcome);
        };
        self.count(self.machine.lock().counts());
        match answer {
            Answer::Forwarded | Answer::Released => Ok(()),
            Answer::Waiting | Answer::Refused => Err(match failure {
                Some(source) => SidecarError::Forward { to: addr, source },
                None => SidecarError::ForwardWaits(addr),
            }),
            Answer::NoSuccessor => Err(SidecarError::NoSuccessor),
            Answer::SuccessorChanged => Err(SidecarError::NotTheSuccessor(addr)),
        }
    }

    /// Brings the forward counters up to the machine's.
    fn count(&self, counts: Counts) {
        let set = |counter: &AtomicU64, value: u64| counter.fetch_max(value, Ordering::Relaxed);
        set(&self.stats.forward_failures, counts.failed);
        set(&self.stats.forwards_caught_up, counts.caught_up);
        set(&self.stats.forwards_dropped, counts.dropped);
    }

    /// The sidecar's metrics page.
    fn render(&self, server: &PeerServer) -> String {
        let stats = server.stats();
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64;
        let index = self.index().to_string();
        let label = [("stage", index.as_str())];
        let mut page = Exposition::new();
        let counters = [
            (
                "dejavu_sidecar_local_chunks_total",
                "Chunks of its engine's KV kept (the local copy).",
                &self.stats.local_chunks,
            ),
            (
                "dejavu_sidecar_local_bytes_total",
                "Payload bytes of its engine's KV kept.",
                &self.stats.local_bytes,
            ),
            (
                "dejavu_sidecar_forwarded_chunks_total",
                "Chunks forwarded to the ring successor.",
                &self.stats.forwarded_chunks,
            ),
            (
                "dejavu_sidecar_forwarded_bytes_total",
                "Payload bytes forwarded to the ring successor.",
                &self.stats.forwarded_bytes,
            ),
            (
                "dejavu_sidecar_forward_failures_total",
                "Forwards to the successor that failed.",
                &self.stats.forward_failures,
            ),
            (
                "dejavu_sidecar_forwards_caught_up_total",
                "Chunks forwarded again after a failed forward.",
                &self.stats.forwards_caught_up,
            ),
            (
                "dejavu_sidecar_forwards_dropped_total",
                "Chunks whose forward was given up on (refused, or too many waiting).",
                &self.stats.forwards_dropped,
            ),
            (
                "dejavu_sidecar_local_restores_total",
                "Chunks handed to its engine through shared memory.",
                &self.stats.local_restores,
            ),
            (
                "dejavu_sidecar_stale_engines_total",
                "Engine connections refused for an older epoch.",
                &self.stats.stale_engines_refused,
            ),
            (
                "dejavu_sidecar_reseeded_chunks_total",
                "Chunks of its own stage sent to a new successor by a recovery's re-seed.",
                &self.stats.reseeded_chunks,
            ),
            (
                "dejavu_sidecar_chunks_stored_total",
                "Chunks stored over the transport (replicas, copies).",
                &stats.puts,
            ),
            (
                "dejavu_sidecar_bytes_stored_total",
                "Bytes of the chunks stored over the transport.",
                &stats.bytes_stored,
            ),
            (
                "dejavu_sidecar_chunks_served_total",
                "Chunks served over the transport (restores).",
                &stats.gets,
            ),
            (
                "dejavu_sidecar_bytes_served_total",
                "Bytes of the chunks served over the transport.",
                &stats.bytes_served,
            ),
            (
                "dejavu_sidecar_connections_total",
                "Connections that passed the cluster handshake.",
                &stats.authenticated,
            ),
            ("dejavu_sidecar_refused_total", "Connections refused at the handshake.", &stats.refused),
            (
                "dejavu_sidecar_bad_chunks_total",
                "Chunks refused as inconsistent with their header.",
                &stats.bad_chunks,
            ),
            ("dejavu_sidecar_stale_total", "Requests refused for a stale epoch.", &stats.stale),
            (
                "dejavu_sidecar_bad_frames_total",
                "Connections closed on a malformed or corrupted frame.",
                &stats.bad_frames,
            ),
        ];
        for (name, help, counter) in counters {
            page.family(name, MetricType::Counter, help).sample(name, &label, get(counter));
        }
        page.family(
            "dejavu_sidecar_chunks_held",
            MetricType::Gauge,
            "KV chunks held (in memory or spilled).",
        )
        .sample("dejavu_sidecar_chunks_held", &label, self.store.len() as f64);
        // Whose the chunks held are: this stage's engine's, or its predecessor's replicas.
        let stage = self.index();
        let [own, replicas] = self.store.held_split(|key| key.destination.stage == stage);
        for (name, help, (own, replicas)) in [
            (
                "dejavu_sidecar_held_chunks",
                "KV chunks held, by role: the engine's own, or the predecessor's replicas.",
                (own.0, replicas.0),
            ),
            (
                "dejavu_sidecar_held_bytes",
                "Bytes of KV chunks held (in memory or spilled), by role.",
                (own.1, replicas.1),
            ),
        ] {
            page.family(name, MetricType::Gauge, help)
                .sample(name, &[("stage", index.as_str()), ("role", "own")], own as f64)
                .sample(name, &[("stage", index.as_str()), ("role", "replica")], replicas as f64);
        }
        page.family(
            "dejavu_sidecar_pooled_bytes",
            MetricType::Gauge,
            "Bytes of dropped chunks' buffers kept for the next chunks of their size.",
        )
        .sample("dejavu_sidecar_pooled_bytes", &label, self.store.pooled_bytes() as f64);
        let usage = self.store.usage();
        let tiers = [
            (
                "dejavu_sidecar_memory_bytes",
                MetricType::Gauge,
                "Bytes of chunks in memory.",
                usage.memory_bytes,
            ),
            (
                "dejavu_sidecar_spilled_bytes",
                MetricType::Gauge,
                "Bytes of chunks in spill files.",
                usage.spilled_bytes,
            ),
            (
                "dejavu_sidecar_spill_failures_total",
                MetricType::Counter,
                "Chunks that could not be spilled (the directory was full) and stayed in memory.",
                usage.spill_failures,
            ),
            (
                "dejavu_sidecar_replaced_chunks_total",
                MetricType::Counter,
                "Chunks dropped because a new sequence started in their slots (own and replicas).",
                usage.replaced_chunks,
            ),
            (
                "dejavu_sidecar_replaced_bytes_total",
                MetricType::Counter,
                "Bytes of the chunks dropped because a new sequence started in their slots.",
                usage.replaced_bytes,
            ),
            (
                "dejavu_sidecar_released_chunks_total",
                MetricType::Counter,
                "Chunks dropped because their engine released the sequence (own and replicas).",
                usage.released_chunks,
            ),
            (
                "dejavu_sidecar_released_bytes_total",
                MetricType::Counter,
                "Bytes of the chunks dropped because their engine released the sequence.",
                usage.released_bytes,
            ),
        ];
        for (name, kind, help, value) in tiers {
            page.family(name, kind, help).sample(name, &label, value as f64);
        }
        let name = "dejavu_sidecar_transport_info";
        page.family(name, MetricType::Gauge, "The transport to other sidecars and stages (always 1).")
            .sample(name, &[("stage", index.as_str()), ("transport", self.config.transport.name())], 1.0);
        page.finish()
    }
}

/// Whether a reader connection ([`HELLO_READER`]) may send `frame`: it fetches chunks, lists
/// them and acknowledges its region, and changes nothing.
fn reader_may(frame: &Frame) -> bool {
    match frame.header.kind {
        Kind::Get => true,
        Kind::Control => matches!(Message::of_frame(frame), Ok(Message::Mapped | Message::Held { .. })),
        _ => false,
    }
}

/// The process id of the engine at the other end of a local connection (`SO_PEERCRED`).
fn peer_pid(stream: &impl std::os::fd::AsRawFd) -> Option<u32> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, a live ucred of that size; the
    // descriptor belongs to `stream`, open for the call.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(cred.pid as u32)
}

/// Whether the peer refused `e` for a stale epoch (a newer engine of this stage has written
/// there), which trying again cannot change.
fn stale(e: &StoreError) -> bool {
    let StoreError::Io { source, .. } = e else { return false };
    let peer = source.get_ref().and_then(|inner| inner.downcast_ref::<PeerError>());
    matches!(peer, Some(PeerError::Refused { code: ErrorCode::StaleEpoch, .. }))
}

/// Answers `to` with `message`, from `sender` in `epoch`.
fn reply(
    w: &mut impl Write,
    to: &Frame,
    sender: u32,
    epoch: u64,
    message: &Message,
) -> Result<(), SidecarError> {
    let (header, payload) = message.frame(sender, epoch, to.header.request);
    write_frame(w, &header, &payload)?;
    w.flush()?;
    Ok(())
}

fn reply_error(w: &mut impl Write, to: &Frame, code: ErrorCode, reason: &str) -> Result<(), SidecarError> {
    let mut header = FrameHeader::new(Kind::Error, 0, to.header.epoch, to.header.request);
    header.ids[0] = code as u32;
    write_frame(w, &header, reason.as_bytes())?;
    w.flush()?;
    Ok(())
}
