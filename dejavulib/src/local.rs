//! The engine's end of its sidecar: a [`ChunkStore`] whose chunks cross a memory region shared
//! with the sidecar process ([`crate::shm`]), with requests on a local Unix socket in
//! [`crate::wire`] frames, one at a time, but for puts in flight ([`PUT_IN_FLIGHT`]):
//!
//! | request (engine) | reply (sidecar) |
//! |---|---|
//! | `Hello`, epoch = the engine's, id 0 = flags ([`HELLO_MEMBER`], [`HELLO_EPOCH_FROM_SIDECAR`], [`HELLO_READER`]), payload = the successor sidecar's address (empty for a reader) | `Welcome`, epoch = the engine's (the sidecar's choice with [`HELLO_EPOCH_FROM_SIDECAR`]), ids 0-1 = the region's capacity, payload = its file; `Error` (`StaleEpoch`) if a newer engine is connected |
//! | [`Message::Mapped`] | [`Message::Done`]; the sidecar removes the region's file |
//! | `Put`, id 0 = length of the chunk (header and payload) written into the region | `PutAck` once the sidecar keeps it and has forwarded it to the successor; `Error` otherwise |
//! | `Put` with id 1 = [`PUT_IN_FLIGHT`] | `Taken` once the sidecar keeps it (the region is free), then `PutAck` once forwarded, or `Error`; `Error` alone if it cannot be kept |
//! | `Get`, payload = a chunk key | `GetReply`, id 0 = length of the chunk written into the region; `Error` (`NotFound`) |
//! | [`Message::Successor`] (also as the first and only frame of a connection of its own, epoch = the engine's) | `Done`; forwards go there from now on (a forward under way to the replaced successor fails at once); `Error` (`StaleEpoch`) on its own connection from an engine older than the one in use |
//! | [`Message::Assign`] (first and only frame of a connection of the cluster's) | `Done` once a spare sidecar has become that stage's; `Error` if it is not a spare waiting for one |
//! | [`Message::Keep`], the chunks (each header and payload) written one after the other into the region | `Done` once the sidecar keeps them all (it forwards none: they came from a copy that exists); `Error` otherwise |
//! | [`Message::Release`] | [`Message::Released`] once the sidecar has dropped the sequence's chunks and its successor's sidecar the replica's; `Error` if the successor could not be told |
//! | [`Message::Held`] | [`Message::HeldPage`]: what the sidecar serves as, and each of the stage's own chunks it keeps after the one named, in the order of their keys' encoding, as a [`HeldChunk`] (its key, [`ChunkKey::encode`], and when it was put), written one after the other into the region; `Error` from a spare not assigned yet |
//!
//! The control messages are [`crate::message`]'s.
//!
//! The sidecar itself is a process of the daemon (`dejavud sidecar`).

use std::collections::VecDeque;
use std::io::{BufReader, BufWriter, ErrorKind, Write};
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;

use crate::cache::{GatherPlan, KvCache};
use crate::chunk::{verify_payload, ChunkDescriptor, ChunkKey, SequencePlace, HEADER_LEN};
use crate::message::Message;
use crate::resume::{resume_points, HeldChunk, ResumePoint};
use crate::shm::{SharedRegion, ShmError};
use crate::store::{check_gathered, gather_encoded, ChunkStore, Started, StoreError};
use crate::wire::{read_frame, write_frame, ErrorCode, Frame, FrameError, FrameHeader, Kind};

/// A `Hello` flag (id 0): the sidecar is to report the engine's liveness to the controller on
/// its behalf, for as long as the connection lasts ([`LocalSidecar::connect_as_member`]).
pub const HELLO_MEMBER: u32 = 1;

/// A `Hello` flag (id 0): the engine does not know its epoch, the sidecar gives it one, in the
/// `Welcome`'s epoch ([`LocalSidecar::join`]).
pub const HELLO_EPOCH_FROM_SIDECAR: u32 = 2;

/// A `Hello` flag (id 0): a reader, beside the engine, that lists and fetches the chunks the
/// sidecar keeps for its stage ([`Message::Held`], `Get`) and does nothing else: it takes no
/// engine's place, has no epoch of its own (the `Welcome` carries the engine's in use) and names
/// no successor (an empty payload). A serving engine's scheduler in another process than its
/// workers (vLLM's) asks through one what its workers' sidecar keeps ([`LocalSidecar::reader`]).
pub const HELLO_READER: u32 = 4;

/// A `Put` flag (id 1): the put is *in flight*. The sidecar answers `Taken` as soon as it keeps
/// the chunk, after which the engine may write the region again (its next chunk), and answers the
/// put itself later, with `PutAck` once it has forwarded the chunk (or `Error`). Meanwhile it reads
/// the next requests: a `Put` with this flag is kept while the puts before it are forwarded; any
/// other request is answered after every forward before it ([`ChunkStore::start_put_gathered`]).
pub const PUT_IN_FLIGHT: u32 = 1;

/// Largest payload of a frame on the local socket (addresses, keys, paths, reasons).
pub const MAX_LOCAL_PAYLOAD: u64 = 64 << 10;

/// Errors of talking to the local sidecar.
#[derive(Debug, Error)]
pub enum LocalError {
    /// The socket failed.
    #[error("local sidecar i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The shared region is not what was announced.
    #[error(transparent)]
    Shm(#[from] ShmError),
    /// A malformed or unexpected frame, or a refusal.
    #[error("local sidecar protocol: {0}")]
    Protocol(String),
    /// The sidecar holds no such chunk.
    #[error("the sidecar holds no such chunk")]
    NotFound,
    /// The sidecar closed the connection: it died, an engine of a newer epoch took its place, or
    /// it dropped the connection after an error. Nothing more can be sent on it
    /// ([`LocalSidecar::is_closed`]).
    #[error("the sidecar closed the connection")]
    Closed,
}

impl From<FrameError> for LocalError {
    fn from(e: FrameError) -> Self {
        Self::Protocol(e.to_string())
    }
}

/// What a sidecar serves as: a spare's engine learns here the stage it was assigned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Serving {
    /// The stage the sidecar serves.
    pub stage: u32,
    /// The newest epoch it knows: its engine's, or that of the recovery that assigned it.
    pub epoch: u64,
    /// The successor sidecar it forwards to, if it has one.
    pub successor: Option<SocketAddr>,
}

/// What a sidecar tells its (re)started engine: what it serves as, and which of the stage's
/// chunks it keeps. An engine restarted beside a sidecar that survived restores from
/// [`Recovery::resume_points`] without any network transfer and computes from there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recovery {
    /// The stage, epoch and successor.
    pub serving: Serving,
    /// The stage's own chunks it keeps (not its predecessor's replica), in the order of their
    /// keys' encoding.
    pub held: Vec<HeldChunk>,
}

impl Recovery {
    /// Each sequence's KV held and where its engine resumes (see [`crate::resume`]).
    pub fn resume_points(&self) -> Vec<ResumePoint> {
        resume_points(&self.held)
    }
}

/// The engine's end of its sidecar: a [`ChunkStore`] whose puts and gets cross the shared region.
pub struct LocalSidecar {
    path: PathBuf,
    channel: Channel,
    region: SharedRegion,
    /// The engine's epoch, as it said it or as the sidecar gave it ([`LocalSidecar::join`]).
    epoch: u64,
}

/// Request and reply frames on the local socket.
struct Channel {
    reader: BufReader<UnixStream>,
    writer: BufWriter<UnixStream>,
    next_request: u64,
    /// Whether the sidecar closed the connection.
    closed: bool,
    /// Puts sent with [`PUT_IN_FLIGHT`] whose outcome has not been handed out, oldest first.
    in_flight: VecDeque<InFlightPut>,
}

/// A put sent with [`PUT_IN_FLIGHT`], and what the sidecar has said of it so far.
struct InFlightPut {
    request: u64,
    /// Whether the sidecar said `Taken`: it kept the chunk, and is done with the region (as it is
    /// once it has answered).
    taken: bool,
    /// Its `PutAck` (`Ok`) or `Error`, once read.
    outcome: Option<Result<(), LocalError>>,
}

impl Channel {
    fn new(stream: UnixStream) -> std::io::Result<Self> {
        Ok(Self {
            reader: BufReader::new(stream.try_clone()?),
            writer: BufWriter::new(stream),
            next_request: 1,
            closed: false,
            in_flight: VecDeque::new(),
        })
    }

    /// Sends a request and returns its reply, which must be of kind `expect` (an `Error` reply is
    /// an error: `NotFound` as [`LocalError::NotFound`]; a connection the sidecar closed as
    /// [`LocalError::Closed`], then and for every later call).
    fn call(
        &mut self,
        kind: Kind,
        epoch: u64,
        ids: [u32; 4],
        payload: &[u8],
        expect: Kind,
    ) -> Result<Frame, LocalError> {
        if self.closed {
            return Err(LocalError::Closed);
        }
        // The sidecar answers a request once every forward before it is answered.
        self.settle()?;
        let result = self.send(kind, epoch, ids, payload).and_then(|request| self.receive(request, expect));
        self.closed = matches!(result, Err(LocalError::Closed));
        result
    }

    /// Sends a `Put` of the `len` bytes written into the region with [`PUT_IN_FLIGHT`]; returns
    /// its request number. Its outcome is read later ([`Channel::await_region`],
    /// [`Channel::finish`]).
    fn put_in_flight(&mut self, len: u32) -> Result<u64, LocalError> {
        if self.closed {
            return Err(LocalError::Closed);
        }
        let sent = self.send(Kind::Put, 0, [len, PUT_IN_FLIGHT, 0, 0], &[]);
        let request = self.note_closed(sent)?;
        self.in_flight.push_back(InFlightPut { request, taken: false, outcome: None });
        Ok(request)
    }

    /// Reads answers to puts in flight until the sidecar is done with the region.
    fn await_region(&mut self) -> Result<(), LocalError> {
        while self.in_flight.iter().any(|put| !put.taken && put.outcome.is_none()) {
            self.read_in_flight()?;
        }
        Ok(())
    }

    /// Reads answers to puts in flight until every one is answered (their outcomes are kept for
    /// [`Channel::finish`]).
    fn settle(&mut self) -> Result<(), LocalError> {
        while self.in_flight.iter().any(|put| put.outcome.is_none()) {
            self.read_in_flight()?;
        }
        Ok(())
    }

    /// The outcome of the put in flight sent as request `request`, once answered (it is then no
    /// longer in flight); `None` if no put in flight has that number.
    fn finish(&mut self, request: u64) -> Option<Result<(), LocalError>> {
        let at = self.in_flight.iter().position(|put| put.request == request)?;
        while self.in_flight[at].outcome.is_none() {
            // A failed read answers every put still unanswered, this one included.
            let _ = self.read_in_flight();
        }
        self.in_flight.remove(at).and_then(|put| put.outcome)
    }

    /// Reads one answer to a put in flight. A failed read, or a frame that answers no put in
    /// flight as it may, leaves the connection out of step: every put still unanswered fails,
    /// and the connection is closed for good.
    fn read_in_flight(&mut self) -> Result<(), LocalError> {
        let read = self.read_reply();
        let frame = match self.note_closed(read) {
            Ok(frame) => frame,
            Err(e) => return Err(self.fail_in_flight(e)),
        };
        let request = frame.header.request;
        let put = self.in_flight.iter_mut().find(|put| put.request == request && put.outcome.is_none());
        match (put, frame.header.kind) {
            (Some(put), Kind::Taken) => put.taken = true,
            (Some(put), Kind::PutAck | Kind::Error) => {
                put.outcome = Some(refusal(&frame).map_or(Ok(()), Err))
            }
            (_, kind) => {
                let e = LocalError::Protocol(format!("an unexpected {kind:?} for request {request}"));
                self.closed = true;
                return Err(self.fail_in_flight(e));
            }
        }
        Ok(())
    }

    /// Fails every put in flight not answered yet, after `e`; returns `e`.
    fn fail_in_flight(&mut self, e: LocalError) -> LocalError {
        for put in self.in_flight.iter_mut().filter(|put| put.outcome.is_none()) {
            put.outcome = Some(Err(LocalError::Protocol(format!("no answer from the sidecar: {e}"))));
        }
        e
    }

    /// `result`, after noting whether it says the sidecar closed the connection.
    fn note_closed<T>(&mut self, result: Result<T, LocalError>) -> Result<T, LocalError> {
        self.closed |= matches!(result, Err(LocalError::Closed));
        result
    }

    /// Sends a control message and returns the message that answers it.
    fn control(&mut self, epoch: u64, message: &Message) -> Result<Message, LocalError> {
        let reply = self.call(Kind::Control, epoch, [0; 4], &message.encode(), Kind::Control)?;
        Message::of_frame(&reply).map_err(|e| LocalError::Protocol(e.to_string()))
    }

    /// Sends a control message whose answer says only that it was carried out.
    fn command(&mut self, epoch: u64, message: &Message) -> Result<(), LocalError> {
        match self.control(epoch, message)? {
            Message::Done => Ok(()),
            other => Err(LocalError::Protocol(format!("{message:?} answered with {other:?}"))),
        }
    }

    /// Writes a request; returns its number.
    fn send(&mut self, kind: Kind, epoch: u64, ids: [u32; 4], payload: &[u8]) -> Result<u64, LocalError> {
        let request = self.next_request;
        self.next_request += 1;
        let mut header = FrameHeader::new(kind, 0, epoch, request);
        header.ids = ids;
        write_frame(&mut self.writer, &header, payload).map_err(closed_or_io)?;
        self.writer.flush().map_err(closed_or_io)?;
        Ok(request)
    }

    /// Reads the reply to request `request`, which must be of kind `expect`.
    fn receive(&mut self, request: u64, expect: Kind) -> Result<Frame, LocalError> {
        let frame = self.read_reply()?;
        if frame.header.request != request {
            return Err(LocalError::Protocol(format!("a reply to {} for {request}", frame.header.request)));
        }
        match frame.header.kind {
            k if k == expect => Ok(frame),
            Kind::Error => Err(refusal(&frame).expect("an error frame")),
            other => Err(LocalError::Protocol(format!("an unexpected {other:?}"))),
        }
    }

    /// The next frame from the sidecar.
    fn read_reply(&mut self) -> Result<Frame, LocalError> {
        match read_frame(&mut self.reader, MAX_LOCAL_PAYLOAD) {
            Ok(Some(frame)) => Ok(frame),
            Ok(None) | Err(FrameError::Truncated { .. }) => Err(LocalError::Closed),
            Err(FrameError::Io(e)) => Err(closed_or_io(e)),
            Err(e) => Err(e.into()),
        }
    }
}

/// The error an `Error` frame carries (`NotFound` as [`LocalError::NotFound`]); `None` for any
/// other frame.
fn refusal(frame: &Frame) -> Option<LocalError> {
    (frame.header.kind == Kind::Error).then(|| match ErrorCode::from_code(frame.header.ids[0]) {
        ErrorCode::NotFound => LocalError::NotFound,
        _ => LocalError::Protocol(String::from_utf8_lossy(&frame.payload).into_owned()),
    })
}

/// Where a sidecar forwards its engine's KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Successor {
    /// The ring successor's sidecar, which keeps a replica: the KV survives the whole worker.
    Sidecar(SocketAddr),
    /// Nowhere: the sidecar keeps the local copy only, which survives the engine but not the
    /// worker. A ring of one stage has no other sidecar (written `none`).
    LocalOnly,
}

impl Successor {
    /// What the engine's hello carries: the address, or nothing for [`Successor::LocalOnly`].
    pub fn to_payload(self) -> String {
        match self {
            Successor::Sidecar(addr) => addr.to_string(),
            Successor::LocalOnly => String::new(),
        }
    }

    /// The successor a hello's payload names (see [`Successor::to_payload`]); `None` if it is
    /// neither empty nor an address.
    pub fn from_payload(payload: &[u8]) -> Option<Self> {
        if payload.is_empty() {
            return Some(Successor::LocalOnly);
        }
        std::str::from_utf8(payload).ok()?.parse().ok().map(Successor::Sidecar)
    }

    /// Its address, if it has one.
    pub fn addr(self) -> Option<SocketAddr> {
        match self {
            Successor::Sidecar(addr) => Some(addr),
            Successor::LocalOnly => None,
        }
    }
}

impl From<SocketAddr> for Successor {
    fn from(addr: SocketAddr) -> Self {
        Successor::Sidecar(addr)
    }
}

impl std::str::FromStr for Successor {
    type Err = String;

    /// `none`, or an `ip:port` address.
    fn from_str(text: &str) -> Result<Self, String> {
        match text.trim() {
            "none" => Ok(Successor::LocalOnly),
            addr => addr.parse().map(Successor::Sidecar).map_err(|_| {
                format!("{addr:?} is neither an ip:port address nor `none` (local copies only)")
            }),
        }
    }
}

impl std::fmt::Display for Successor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Successor::Sidecar(addr) => addr.fmt(f),
            Successor::LocalOnly => f.write_str("none"),
        }
    }
}

/// A socket error: [`LocalError::Closed`] when the sidecar's end is gone.
fn closed_or_io(e: std::io::Error) -> LocalError {
    match e.kind() {
        ErrorKind::BrokenPipe | ErrorKind::ConnectionReset => LocalError::Closed,
        _ => LocalError::Io(e),
    }
}

impl LocalSidecar {
    /// Connects to the sidecar at `path` as an engine of `epoch` whose successor's sidecar is
    /// `successor` (or [`Successor::LocalOnly`]), and maps the region it offers. A sidecar named
    /// as its own successor refuses: its copies would die with it.
    pub fn connect(path: &Path, epoch: u64, successor: impl Into<Successor>) -> Result<Self, LocalError> {
        Self::connect_with(path, epoch, successor.into(), 0)
    }

    /// As [`LocalSidecar::connect`], for an engine that does not report its own liveness to the
    /// controller (a Python or C engine): the sidecar beats and holds a lifeline as the stage's
    /// engine, in `epoch`, for as long as this connection lasts, so that the engine's death is
    /// seen as soon as its connection closes ([`HELLO_MEMBER`]). Without a controller, the same
    /// as [`LocalSidecar::connect`].
    pub fn connect_as_member(
        path: &Path,
        epoch: u64,
        successor: impl Into<Successor>,
    ) -> Result<Self, LocalError> {
        Self::connect_with(path, epoch, successor.into(), HELLO_MEMBER)
    }

    /// As [`LocalSidecar::connect_as_member`], in the epoch the sidecar gives the engine
    /// ([`HELLO_EPOCH_FROM_SIDECAR`]): the one the controller fenced the stage's engine in, when
    /// it awaits a replacement (the sidecar waits a moment for the fence of an engine that has
    /// just died); 0 for the stage's first engine; without a controller, one newer than the last
    /// engine's. [`LocalSidecar::epoch`] says which.
    pub fn join(path: &Path, successor: impl Into<Successor>) -> Result<Self, LocalError> {
        Self::connect_with(path, 0, successor.into(), HELLO_MEMBER | HELLO_EPOCH_FROM_SIDECAR)
    }

    /// Connects to the sidecar at `path` as a reader ([`HELLO_READER`]): it lists
    /// ([`LocalSidecar::recovery`]) and fetches ([`ChunkStore::get`]) the chunks the sidecar keeps,
    /// beside the engine's own connection, and is refused anything else.
    pub fn reader(path: &Path) -> Result<Self, LocalError> {
        Self::open(path, 0, "", HELLO_READER)
    }

    /// The engine's epoch on this connection.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    fn connect_with(path: &Path, epoch: u64, successor: Successor, flags: u32) -> Result<Self, LocalError> {
        Self::open(path, epoch, &successor.to_payload(), flags)
    }

    fn open(path: &Path, epoch: u64, successor: &str, flags: u32) -> Result<Self, LocalError> {
        let mut channel = Channel::new(UnixStream::connect(path)?)?;
        let welcome =
            channel.call(Kind::Hello, epoch, [flags, 0, 0, 0], successor.as_bytes(), Kind::Welcome)?;
        // The sidecar's choice, if it was asked to choose; the engine's own otherwise.
        let epoch = welcome.header.epoch;
        let capacity = welcome.header.ids[0] as u64 | (welcome.header.ids[1] as u64) << 32;
        let file = String::from_utf8(welcome.payload)
            .map_err(|_| LocalError::Protocol("a region path that is not UTF-8".into()))?;
        let region = SharedRegion::open(Path::new(&file), capacity as usize, epoch)?;
        channel.command(epoch, &Message::Mapped)?;
        Ok(Self { path: path.to_owned(), channel, region, epoch })
    }

    /// Has the sidecar at `path` forward to `successor` from now on, over a connection of its own
    /// (the first and only frame: [`Message::Successor`] in the engine's `epoch`): it takes effect
    /// even while the engine's own connection waits for a forward to the successor it replaces,
    /// which the sidecar then cuts short (a dead QUIC peer would hold it until a timeout).
    pub fn retarget_now(path: &Path, successor: SocketAddr, epoch: u64) -> Result<(), LocalError> {
        let mut channel = Channel::new(UnixStream::connect(path)?)?;
        channel.command(epoch, &Message::Successor(successor))
    }

    /// Whether the sidecar closed the connection (see [`LocalError::Closed`]): every request fails
    /// from then on, so the engine's KV is no longer kept or copied.
    pub fn is_closed(&self) -> bool {
        self.channel.closed
    }

    /// Has the sidecar forward to `successor` from now on.
    pub fn retarget(&mut self, successor: SocketAddr) -> Result<(), LocalError> {
        self.channel.command(0, &Message::Successor(successor))
    }

    /// Has the sidecar keep `chunks` (each encoded: header, then payload), many per request, and
    /// forward none of them: KV restored from a replica, which exists already, becomes the local
    /// copy again.
    pub fn keep(&mut self, chunks: &[&[u8]]) -> Result<(), StoreError> {
        self.channel.settle().map_err(|e| self.store_error(e))?;
        let capacity = self.region.capacity();
        let mut rest = chunks;
        while !rest.is_empty() {
            // As many as fit in the region at once (at least one: a larger one fails in write).
            let mut len = 0;
            let fit = rest.iter().take_while(|c| {
                len += c.len();
                len <= capacity
            });
            let n = fit.count().max(1);
            let (batch, after) = rest.split_at(n);
            let written = self.region.write(batch).map_err(|e| self.store_error(e.into()))? as u64;
            let keep = Message::Keep { chunks: n as u32, bytes: written };
            self.channel.command(0, &keep).map_err(|e| self.store_error(e))?;
            rest = after;
        }
        Ok(())
    }

    /// Releases the sequence at `place`: the sidecar drops every chunk of it, and has its
    /// successor's sidecar drop the replica; returns the chunks it dropped itself. Idempotent.
    pub fn release_place(&mut self, place: &SequencePlace) -> Result<u64, LocalError> {
        match self.channel.control(0, &Message::Release(place.clone()))? {
            Message::Released { chunks } => Ok(chunks),
            other => Err(LocalError::Protocol(format!("a release answered with {other:?}"))),
        }
    }

    /// Asks the sidecar what it serves as (no keys).
    pub fn serving(&mut self) -> Result<Serving, LocalError> {
        Ok(self.held_page(0, None)?.0)
    }

    /// Asks the sidecar what it serves as and which of the stage's own chunks it keeps: the
    /// instructions a restarted engine follows (restore each [`ResumePoint`]'s chunks with
    /// [`ChunkStore::get`], then compute from its `tokens`). Keys come in pages that fit the
    /// shared region, each after the last key of the one before.
    pub fn recovery(&mut self) -> Result<Recovery, LocalError> {
        let fit = (self.region.capacity() / HeldChunk::ENCODED_LEN).min(u32::MAX as usize) as u32;
        let mut held: Vec<HeldChunk> = Vec::new();
        loop {
            let (serving, (count, left)) = self.held_page(fit, held.last().map(|h| &h.key))?;
            let bytes = self.region.read(count as usize * HeldChunk::ENCODED_LEN)?;
            for encoded in bytes.chunks_exact(HeldChunk::ENCODED_LEN) {
                let chunk = HeldChunk::decode(encoded)
                    .ok_or_else(|| LocalError::Protocol("a malformed held chunk".into()))?;
                held.push(chunk);
            }
            match (left, count) {
                (0, _) => return Ok(Recovery { serving, held }),
                (_, 0) => {
                    return Err(LocalError::Protocol("keys left, but none fit the shared region".into()))
                }
                _ => {}
            }
        }
    }

    /// One [`Message::Held`] request for at most `want` keys after `last`: what the sidecar
    /// serves as, and (keys in the region now, keys after them).
    fn held_page(&mut self, want: u32, last: Option<&ChunkKey>) -> Result<(Serving, (u32, u32)), LocalError> {
        let request = Message::Held { want, after: last.cloned() };
        let Message::HeldPage { stage, epoch, successor, count, left } = self.channel.control(0, &request)?
        else {
            return Err(LocalError::Protocol("a held request answered with another message".into()));
        };
        if count > want {
            return Err(LocalError::Protocol(format!("{count} keys for {want} asked")));
        }
        Ok((Serving { stage, epoch, successor }, (count, left)))
    }

    /// Gathers the chunk `descriptor` says (header, then payload) into the region, which the
    /// sidecar must not be reading; returns its length.
    fn gather_into_region(
        &mut self,
        descriptor: &ChunkDescriptor,
        cache: &KvCache,
        plan: &GatherPlan,
        staging: &[u8],
    ) -> Result<u32, StoreError> {
        check_gathered(descriptor, plan, staging)?;
        let len = HEADER_LEN + staging.len();
        let encoded = match self.region.data_mut(len) {
            Ok(data) => data,
            Err(e) => return Err(self.store_error(e.into())),
        };
        gather_encoded(descriptor, cache, plan, encoded)?;
        Ok(len as u32)
    }

    fn store_error(&self, e: LocalError) -> StoreError {
        StoreError::Io { op: "local sidecar", path: self.path.clone(), source: std::io::Error::other(e) }
    }
}

impl ChunkStore for LocalSidecar {
    fn release(&mut self, place: &SequencePlace) -> Result<u64, StoreError> {
        self.release_place(place).map_err(|e| self.store_error(e))
    }

    fn put(&mut self, descriptor: &ChunkDescriptor, payload: &[u8]) -> Result<(), StoreError> {
        self.channel.settle().map_err(|e| self.store_error(e))?;
        let header = descriptor.encode_header(payload);
        let len = self.region.write(&[&header, payload]).map_err(|e| self.store_error(e.into()))?;
        let acked = self.channel.call(Kind::Put, 0, [len as u32, 0, 0, 0], &[], Kind::PutAck);
        acked.map_err(|e| self.store_error(e))?;
        Ok(())
    }

    /// Gathers straight into the shared region, checksumming each piece while it is in cache: no
    /// staging copy, no second pass to hash.
    fn put_gathered(
        &mut self,
        descriptor: &ChunkDescriptor,
        cache: &KvCache,
        plan: &GatherPlan,
        staging: &mut [u8],
    ) -> Result<Duration, StoreError> {
        self.channel.settle().map_err(|e| self.store_error(e))?;
        let written = self.gather_into_region(descriptor, cache, plan, staging)?;
        let acked = self.channel.call(Kind::Put, 0, [written, 0, 0, 0], &[], Kind::PutAck);
        acked.map_err(|e| self.store_error(e))?;
        Ok(Duration::ZERO)
    }

    /// Gathers into the region once the sidecar has kept the puts before (not waiting for their
    /// forwards), and leaves the put in flight ([`PUT_IN_FLIGHT`]): the sidecar keeps this chunk
    /// while it forwards those before it.
    fn start_put_gathered(
        &mut self,
        descriptor: &ChunkDescriptor,
        cache: &KvCache,
        plan: &GatherPlan,
        staging: &mut [u8],
    ) -> Result<Started, StoreError> {
        self.channel.await_region().map_err(|e| self.store_error(e))?;
        let written = self.gather_into_region(descriptor, cache, plan, staging)?;
        let ticket = self.channel.put_in_flight(written).map_err(|e| self.store_error(e))?;
        Ok(Started::InFlight { gathered: Duration::ZERO, ticket })
    }

    fn finish_put(&mut self, ticket: u64) -> Option<Result<(), StoreError>> {
        let outcome = self.channel.finish(ticket)?;
        Some(outcome.map_err(|e| self.store_error(e)))
    }

    fn get(&mut self, key: &ChunkKey, out: &mut Vec<u8>) -> Result<ChunkDescriptor, StoreError> {
        let reply = match self.channel.call(Kind::Get, 0, [0; 4], &key.encode(), Kind::GetReply) {
            Ok(reply) => reply,
            Err(LocalError::NotFound) => return Err(StoreError::NotFound(Box::new(key.clone()))),
            Err(e) => return Err(self.store_error(e)),
        };
        let corrupt = |source| StoreError::Chunk { key: key.file_name(), source };
        let encoded =
            self.region.read(reply.header.ids[0] as usize).map_err(|e| self.store_error(e.into()))?;
        if encoded.len() < HEADER_LEN {
            return Err(self.store_error(LocalError::Protocol("a chunk shorter than its header".into())));
        }
        let (descriptor, _, sum) = ChunkDescriptor::decode_header(&encoded[..HEADER_LEN]).map_err(corrupt)?;
        verify_payload(&encoded[HEADER_LEN..], sum).map_err(corrupt)?;
        out.clear();
        out.extend_from_slice(&encoded[HEADER_LEN..]);
        Ok(descriptor)
    }
}
