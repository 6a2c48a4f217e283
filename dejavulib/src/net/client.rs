//! The calling side of remote flush / fetch: many requests in flight on one connection.
//!
//! Requests are written whole, one at a time, on the connection and carry ids; a reader task hands
//! each reply to the request waiting for it. Bytes of puts in flight are bounded by a budget (a
//! put waits for room, so a fast producer cannot queue without bound), and fetches in flight by a
//! count. A request that gets no reply in time fails with [`PeerError::Timeout`]. When the
//! connection breaks, every request in flight fails with [`PeerError::ConnectionLost`] and the next
//! request reconnects, retrying with exponential backoff.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::checksum::xxh3_64;
use parking_lot::Mutex;
use tokio::sync::{oneshot, Semaphore};

use super::auth::{client_handshake, expect};
use super::codec::{read_frame, write_frame};
use super::error::PeerError;
use super::transport::{ReadHalf, Transport, WriteHalf};
use crate::chunk::{ChunkDescriptor, ChunkKey, SequencePlace, HEADER_LEN};
use crate::message::Message;
use crate::wire::{Frame, FrameHeader, Kind, DEFAULT_MAX_PAYLOAD, FLAG_CHUNK};

/// Settings of a peer client.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// The shared cluster secret.
    pub secret: Vec<u8>,
    /// This node's id (sent in every frame).
    pub node: u32,
    /// The epoch requests carry at first (see [`PeerClient::set_epoch`]).
    pub epoch: u64,
    /// Largest reply payload accepted.
    pub max_payload: u64,
    /// Bytes of puts in flight at most (a single larger put still goes, alone).
    pub max_put_bytes_in_flight: u64,
    /// Fetches in flight at most.
    pub max_gets_in_flight: u32,
    /// Time allowed for a connection attempt, handshakes included.
    pub connect_timeout: Duration,
    /// Time allowed for a request's reply.
    pub request_timeout: Duration,
    /// Connection attempts per request before giving up.
    pub connect_attempts: u32,
    /// Wait after the first failed attempt; doubles after each.
    pub backoff: Duration,
}

impl ClientConfig {
    /// Defaults for `secret` and `node`: 256 MiB of puts in flight, 3 s to connect, 10 s for a
    /// reply, 6 connection attempts from 10 ms apart, doubling (about 0.3 s of backoff in all).
    pub fn new(secret: impl Into<Vec<u8>>, node: u32) -> Self {
        Self {
            secret: secret.into(),
            node,
            epoch: 0,
            max_payload: DEFAULT_MAX_PAYLOAD,
            max_put_bytes_in_flight: 256 << 20,
            max_gets_in_flight: 8,
            connect_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(10),
            connect_attempts: 6,
            backoff: Duration::from_millis(10),
        }
    }
}

/// Replies awaited on one connection.
#[derive(Default)]
struct Waiting {
    replies: HashMap<u64, oneshot::Sender<Result<Frame, PeerError>>>,
    /// Why the connection closed, once it has.
    closed: Option<String>,
}

struct Connection {
    writer: tokio::sync::Mutex<WriteHalf>,
    waiting: Mutex<Waiting>,
    reader: tokio::task::JoinHandle<()>,
}

impl Connection {
    fn close(&self, reason: &str) {
        let mut waiting = self.waiting.lock();
        waiting.closed.get_or_insert_with(|| reason.to_owned());
        for (_, reply) in waiting.replies.drain() {
            let _ = reply.send(Err(PeerError::ConnectionLost(reason.to_owned())));
        }
    }

    fn is_closed(&self) -> bool {
        self.waiting.lock().closed.is_some()
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// Hands each reply to the request waiting for it, until the connection fails.
async fn read_replies(mut reader: ReadHalf, connection: std::sync::Weak<Connection>, max: u64) {
    loop {
        let result = read_frame(&mut reader, max).await;
        let Some(connection) = connection.upgrade() else { return };
        match result {
            Ok(Some(frame)) => {
                // A reply nobody waits for any more (its request timed out) is dropped.
                if let Some(reply) = connection.waiting.lock().replies.remove(&frame.header.request) {
                    let _ = reply.send(Ok(frame));
                }
            }
            Ok(None) => return connection.close("the peer closed the connection"),
            Err(e) => return connection.close(&e.to_string()),
        }
    }
}

struct Inner {
    transport: Arc<dyn Transport>,
    addr: SocketAddr,
    config: ClientConfig,
    epoch: AtomicU64,
    next_request: AtomicU64,
    put_budget: Semaphore,
    get_slots: Semaphore,
    slot: tokio::sync::Mutex<Slot>,
    connects: AtomicU64,
    /// Set by [`PeerClient::shut`]: every request fails at once from then on.
    shut: std::sync::atomic::AtomicBool,
    /// The connection in use, for [`PeerClient::shut`] to close without waiting for the slot
    /// (held by a request that is connecting).
    current: parking_lot::Mutex<Option<Arc<Connection>>>,
}

/// A client of one [`super::PeerServer`]. Clones share the connection; calls may run concurrently.
#[derive(Clone)]
pub struct PeerClient {
    inner: Arc<Inner>,
}

/// A chunk fetched and verified: its descriptor and its bytes as they travelled (header first).
pub struct Fetched {
    /// What the chunk holds.
    pub descriptor: ChunkDescriptor,
    encoded: Vec<u8>,
}

impl Fetched {
    /// The chunk's payload.
    pub fn payload(&self) -> &[u8] {
        &self.encoded[HEADER_LEN..]
    }

    /// The chunk as it travelled: its header, then its payload.
    pub fn encoded(&self) -> &[u8] {
        &self.encoded
    }

    /// Its descriptor and its encoded bytes ([`Fetched::encoded`]), without a copy.
    pub fn into_parts(self) -> (ChunkDescriptor, Vec<u8>) {
        (self.descriptor, self.encoded)
    }
}

/// Semaphore permits for `bytes` of puts, clamped so that one put larger than the whole budget
/// still goes (alone).
fn put_permits(bytes: u64, budget: u64) -> u32 {
    bytes.clamp(1, budget.clamp(1, u32::MAX as u64)) as u32
}

/// Closes a connection and forgets a request's waiter unless disarmed: a request future dropped
/// mid-write (its caller gave up) would otherwise leave half a frame on the stream, and the peer
/// would read the next request's bytes as the rest of it.
struct InFlight<'a> {
    connection: &'a Connection,
    request: u64,
    writing: bool,
    waiting: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.writing {
            self.connection.close("a request was abandoned while it was being written");
        } else if self.waiting {
            self.connection.waiting.lock().replies.remove(&self.request);
        }
    }
}

/// The outcome of the last round of connection attempts, shared with the requests that queued
/// behind it so they fail at once instead of each retrying in turn.
struct Slot {
    connection: Option<Arc<Connection>>,
    failed: Option<(Instant, PeerError)>,
}

impl PeerError {
    /// A copy of a connection failure for a request that shared the attempt.
    fn shared(&self) -> PeerError {
        match self {
            PeerError::Auth(m) => PeerError::Auth(m.clone()),
            PeerError::Unreachable { attempts, last } => {
                PeerError::Unreachable { attempts: *attempts, last: last.clone() }
            }
            other => PeerError::Unreachable { attempts: 0, last: other.to_string() },
        }
    }
}

impl PeerClient {
    /// A client of the peer at `addr`; it connects on first use.
    pub fn new(transport: Arc<dyn Transport>, addr: SocketAddr, config: ClientConfig) -> Self {
        let budget = put_permits(config.max_put_bytes_in_flight, config.max_put_bytes_in_flight) as usize;
        Self {
            inner: Arc::new(Inner {
                transport,
                addr,
                epoch: AtomicU64::new(config.epoch),
                next_request: AtomicU64::new(1),
                put_budget: Semaphore::new(budget),
                get_slots: Semaphore::new(config.max_gets_in_flight.max(1) as usize),
                slot: tokio::sync::Mutex::new(Slot { connection: None, failed: None }),
                connects: AtomicU64::new(0),
                shut: std::sync::atomic::AtomicBool::new(false),
                current: parking_lot::Mutex::new(None),
                config,
            }),
        }
    }

    /// The peer's address.
    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// Sets the epoch later requests carry (the control plane moves it on after a recovery).
    pub fn set_epoch(&self, epoch: u64) {
        self.inner.epoch.store(epoch, Ordering::SeqCst);
    }

    /// Connections made so far (reconnections included).
    pub fn connects(&self) -> u64 {
        self.inner.connects.load(Ordering::Relaxed)
    }

    /// Gives the peer up for good: the requests in flight fail at once (`ConnectionLost`), and so
    /// does every later one. For a peer known dead or replaced, whose silence would otherwise
    /// hold requests until a timeout (a dead QUIC peer sends no reset).
    pub fn shut(&self) {
        self.inner.shut.store(true, Ordering::SeqCst);
        if let Some(connection) = self.inner.current.lock().take() {
            connection.close("the client was shut");
        }
    }

    /// Bytes of puts that may still be sent before a put must wait.
    pub fn put_budget_left(&self) -> u64 {
        self.inner.put_budget.available_permits() as u64
    }

    /// Pushes a chunk into the peer; returns once the peer has verified and stored it and
    /// acknowledged its checksum.
    pub async fn put(&self, descriptor: &ChunkDescriptor, payload: &[u8]) -> Result<(), PeerError> {
        if payload.len() as u64 != descriptor.payload_len() {
            return Err(PeerError::Protocol(format!(
                "payload of {} bytes, the descriptor needs {}",
                payload.len(),
                descriptor.payload_len()
            )));
        }
        let sum = xxh3_64(payload);
        let header = descriptor.encode_header_with_checksum(payload.len() as u64, sum);
        let permits = put_permits(payload.len() as u64, self.inner.config.max_put_bytes_in_flight);
        let _room = self.inner.put_budget.acquire_many(permits).await.expect("the budget is never closed");
        let ack = self.request(Kind::Put, FLAG_CHUNK, &[&header, payload], Kind::PutAck).await?;
        let acked = ack.header.ids[0] as u64 | (ack.header.ids[1] as u64) << 32;
        if acked != sum {
            return Err(PeerError::Protocol("the peer acknowledged another checksum".into()));
        }
        Ok(())
    }

    /// Pushes a chunk already encoded (its header, with the payload's checksum computed when the
    /// chunk was made, then its payload: as a store keeps it), without hashing it again; the peer
    /// verifies it as any other. Returns once the peer has stored it and acknowledged its checksum.
    pub async fn put_encoded(&self, encoded: &[u8]) -> Result<(), PeerError> {
        let bad = |why: String| PeerError::Protocol(format!("an encoded chunk to put: {why}"));
        if encoded.len() < HEADER_LEN {
            return Err(bad(format!("{} bytes, shorter than a chunk header", encoded.len())));
        }
        let (header, payload) = encoded.split_at(HEADER_LEN);
        let (_, len, sum) = ChunkDescriptor::decode_header(header).map_err(|e| bad(e.to_string()))?;
        if payload.len() as u64 != len {
            return Err(bad(format!("a payload of {} bytes, its header says {len}", payload.len())));
        }
        let permits = put_permits(len, self.inner.config.max_put_bytes_in_flight);
        let _room = self.inner.put_budget.acquire_many(permits).await.expect("the budget is never closed");
        let ack = self.request(Kind::Put, FLAG_CHUNK, &[header, payload], Kind::PutAck).await?;
        let acked = ack.header.ids[0] as u64 | (ack.header.ids[1] as u64) << 32;
        if acked != sum {
            return Err(PeerError::Protocol("the peer acknowledged another checksum".into()));
        }
        Ok(())
    }

    /// Pulls the chunk under `key` and verifies it end to end.
    pub async fn get(&self, key: &ChunkKey) -> Result<Fetched, PeerError> {
        let _slot = self.inner.get_slots.acquire().await.expect("the slots are never closed");
        let reply = self.request(Kind::Get, 0, &[&key.encode()], Kind::GetReply).await?;
        let corrupt = |why: String| PeerError::Protocol(format!("fetched chunk: {why}"));
        // Only a chunk frame has had its payload checked against the chunk's own checksum.
        if reply.header.flags & FLAG_CHUNK == 0 {
            return Err(corrupt("not sent as a chunk frame".into()));
        }
        let encoded = reply.payload;
        let (descriptor, len, _) =
            ChunkDescriptor::decode_header(&encoded[..HEADER_LEN]).map_err(|e| corrupt(e.to_string()))?;
        if (encoded.len() - HEADER_LEN) as u64 != len || descriptor.key() != *key {
            return Err(corrupt("the peer returned another chunk".into()));
        }
        Ok(Fetched { descriptor, encoded })
    }

    /// Releases the sequence at `place` on the peer ([`crate::ChunkStore::release`]); returns the
    /// chunks it dropped. Fenced by epoch as a put is.
    pub async fn release(&self, place: &SequencePlace) -> Result<u64, PeerError> {
        let request = Message::Release(place.clone()).encode();
        let reply = self.request(Kind::Control, 0, &[&request], Kind::Control).await?;
        match Message::decode(&reply.payload) {
            Ok(Message::Released { chunks }) => Ok(chunks),
            other => Err(PeerError::Protocol(format!("a release answered with {other:?}"))),
        }
    }

    /// Round-trip time of a heartbeat.
    pub async fn ping(&self) -> Result<Duration, PeerError> {
        let start = Instant::now();
        self.request(Kind::Heartbeat, 0, &[], Kind::Heartbeat).await?;
        Ok(start.elapsed())
    }

    /// Sends one request and waits for its reply.
    ///
    /// A reply that does not come in time closes the connection (a peer that misses a deadline is
    /// presumed stuck; the other requests on it fail with `ConnectionLost` and the next reconnects).
    async fn request(
        &self,
        kind: Kind,
        flags: u32,
        parts: &[&[u8]],
        reply: Kind,
    ) -> Result<Frame, PeerError> {
        let connection = self.connection().await?;
        let request = self.inner.next_request.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let mut header =
            FrameHeader::new(kind, self.inner.config.node, self.inner.epoch.load(Ordering::SeqCst), request);
        header.flags = flags;
        let timeout = self.inner.config.request_timeout;
        let mut guard = InFlight { connection: &connection, request, writing: true, waiting: true };
        {
            // Waiting for the writer is bounded by the current writer's own timeout.
            let mut writer = connection.writer.lock().await;
            {
                let mut waiting = connection.waiting.lock();
                if let Some(reason) = &waiting.closed {
                    guard.writing = false;
                    return Err(PeerError::ConnectionLost(reason.clone()));
                }
                waiting.replies.insert(request, tx);
            }
            match tokio::time::timeout(timeout, write_frame(&mut *writer, &header, parts)).await {
                Ok(Ok(())) => guard.writing = false,
                Ok(Err(e)) => {
                    guard.writing = false;
                    connection.close(&e.to_string());
                    return Err(PeerError::ConnectionLost(e.to_string()));
                }
                // The guard closes the connection: part of the frame may have gone out.
                Err(_) => return Err(PeerError::Timeout(timeout)),
            }
        }
        let result = match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(result)) => expect(Some(result?), reply),
            Ok(Err(_)) => Err(PeerError::ConnectionLost("the connection closed".into())),
            Err(_) => {
                connection.close("a reply did not come in time");
                Err(PeerError::Timeout(timeout))
            }
        };
        guard.waiting = false;
        result
    }

    /// The open connection, or a new one (retrying with exponential backoff). Requests that queued
    /// while a round of attempts ran share its failure instead of starting rounds of their own.
    async fn connection(&self) -> Result<Arc<Connection>, PeerError> {
        let shut = || PeerError::ConnectionLost("the client was shut".into());
        if self.inner.shut.load(Ordering::SeqCst) {
            return Err(shut());
        }
        let asked = Instant::now();
        let mut slot = self.inner.slot.lock().await;
        if let Some(connection) = slot.connection.as_ref().filter(|c| !c.is_closed()) {
            return Ok(connection.clone());
        }
        if let Some((when, error)) = &slot.failed {
            if *when >= asked {
                return Err(error.shared());
            }
        }
        slot.connection = None;
        let config = &self.inner.config;
        let mut delay = config.backoff;
        let attempts = config.connect_attempts.max(1);
        let mut last = String::new();
        for attempt in 1..=attempts {
            match tokio::time::timeout(config.connect_timeout, self.connect_once()).await {
                Ok(Ok(connection)) => {
                    self.inner.connects.fetch_add(1, Ordering::Relaxed);
                    *self.inner.current.lock() = Some(connection.clone());
                    if self.inner.shut.load(Ordering::SeqCst) {
                        connection.close("the client was shut");
                        return Err(shut());
                    }
                    slot.connection = Some(connection.clone());
                    slot.failed = None;
                    return Ok(connection);
                }
                // The secret or certificate is wrong: retrying cannot help.
                Ok(Err(e @ PeerError::Auth(_))) => {
                    slot.failed = Some((Instant::now(), e.shared()));
                    return Err(e);
                }
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => last = format!("no connection within {:?}", config.connect_timeout),
            }
            if attempt < attempts {
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
        }
        let error = PeerError::Unreachable { attempts, last };
        slot.failed = Some((Instant::now(), error.shared()));
        Err(error)
    }

    async fn connect_once(&self) -> Result<Arc<Connection>, PeerError> {
        let config = &self.inner.config;
        let mut stream =
            self.inner.transport.connect(self.inner.addr).await.map_err(|e| PeerError::Io(e).at_connect())?;
        client_handshake(&mut stream, &config.secret, config.node).await.map_err(PeerError::at_connect)?;
        let (reader, writer) = stream.into_split();
        Ok(Arc::new_cyclic(|weak| Connection {
            writer: tokio::sync::Mutex::new(writer),
            waiting: Mutex::new(Waiting::default()),
            reader: tokio::spawn(read_replies(reader, weak.clone(), config.max_payload)),
        }))
    }
}
