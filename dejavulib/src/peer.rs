//! Remote flush / fetch over TCP: a peer that stores chunks in host memory, and a [`ChunkStore`]
//! that flushes to and fetches from it.
//!
//! Every connection starts with a mutual challenge-response keyed by the cluster secret
//! (HMAC-SHA256 over both nonces): a peer that does not know the secret is refused before it can
//! send a single KV frame. After that, each request is one [`crate::wire`] frame and one reply
//! (one request in flight per connection: bounded memory, natural backpressure). A chunk travels
//! with its own header, so the receiver verifies it end to end before storing it, and a fetched
//! chunk is verified again before it is returned. A client whose connection fails reconnects with
//! exponential backoff.
//!
//! This transport uses blocking sockets and one thread per connection.

use std::io::{self, BufReader, BufWriter, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use hmac::{Hmac, Mac};
use parking_lot::Mutex;
use sha2::Sha256;
use thiserror::Error;

use crate::chunk::{verify_payload, ChunkDescriptor, ChunkKey, HEADER_LEN};
use crate::store::{ChunkStore, HostStore, StoreError};
use crate::wire::{
    read_frame, write_frame, write_frame_parts, Frame, FrameError, FrameHeader, Kind, DEFAULT_MAX_PAYLOAD,
};

type HmacSha256 = Hmac<Sha256>;

/// Bytes of a handshake nonce.
const NONCE_LEN: usize = 32;

/// Errors of the TCP peer transport.
#[derive(Debug, Error)]
pub enum PeerError {
    /// The peer did not prove it knows the cluster secret (or we were refused).
    #[error("authentication failed: {0}")]
    Auth(String),
    /// A frame was malformed.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The peer refused the request.
    #[error("peer refused: {0}")]
    Refused(String),
    /// The peer answered with an unexpected frame.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// The connection failed (after retries).
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
}

impl From<PeerError> for StoreError {
    fn from(e: PeerError) -> Self {
        StoreError::Io {
            op: "remote",
            path: std::path::PathBuf::from("peer"),
            source: io::Error::other(e.to_string()),
        }
    }
}

fn nonce() -> io::Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    std::fs::File::open("/dev/urandom").and_then(|mut f| io::Read::read_exact(&mut f, &mut n))?;
    Ok(n)
}

fn mac(secret: &[u8], role: &[u8], a: &[u8], b: &[u8]) -> Vec<u8> {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes keys of any length");
    m.update(role);
    m.update(a);
    m.update(b);
    m.finalize().into_bytes().to_vec()
}

fn verify_mac(secret: &[u8], role: &[u8], a: &[u8], b: &[u8], tag: &[u8]) -> bool {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes keys of any length");
    m.update(role);
    m.update(a);
    m.update(b);
    m.verify_slice(tag).is_ok()
}

/// Settings of a peer server.
#[derive(Clone, Debug)]
pub struct PeerConfig {
    /// The shared cluster secret.
    pub secret: Vec<u8>,
    /// This node's id (sent in every frame).
    pub node: u32,
    /// Largest payload accepted.
    pub max_payload: u64,
    /// Time allowed for the handshake and for each frame.
    pub io_timeout: Duration,
}

impl PeerConfig {
    /// Defaults for `secret` and `node`: 1 GiB frames, 10 s timeouts.
    pub fn new(secret: impl Into<Vec<u8>>, node: u32) -> Self {
        Self {
            secret: secret.into(),
            node,
            max_payload: DEFAULT_MAX_PAYLOAD,
            io_timeout: Duration::from_secs(10),
        }
    }
}

/// Counters of a peer server.
#[derive(Debug, Default)]
pub struct PeerStats {
    /// Connections that passed the handshake.
    pub authenticated: AtomicU64,
    /// Connections refused at the handshake.
    pub refused: AtomicU64,
    /// Chunks stored.
    pub puts: AtomicU64,
    /// Connections closed on a malformed frame.
    pub bad_frames: AtomicU64,
}

/// A peer that keeps chunks flushed to it in host memory (a replica holder, a swap space).
pub struct PeerServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    /// Open connections, shut down when the server is dropped (as a process exit would).
    connections: Arc<Mutex<Vec<TcpStream>>>,
    accept: Option<JoinHandle<()>>,
    stats: Arc<PeerStats>,
    store: HostStore,
}

impl PeerServer {
    /// Listens on `addr` (port 0 picks one) and serves `store`.
    pub fn bind(addr: impl ToSocketAddrs, config: PeerConfig, store: HostStore) -> io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let local = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(PeerStats::default());
        let connections = Arc::new(Mutex::new(Vec::new()));
        let (stop2, stats2, store2, open) = (stop.clone(), stats.clone(), store.clone(), connections.clone());
        let accept = std::thread::Builder::new().name("dejavu-peer".into()).spawn(move || {
            for conn in listener.incoming() {
                if stop2.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                if let Ok(handle) = conn.try_clone() {
                    let mut open = open.lock();
                    // Forget connections that have closed since.
                    open.retain(|c: &TcpStream| c.peer_addr().is_ok());
                    open.push(handle);
                }
                let (config, stats, store) = (config.clone(), stats2.clone(), store2.clone());
                let _ = std::thread::Builder::new()
                    .name("dejavu-peer-conn".into())
                    .spawn(move || serve(conn, &config, &stats, store));
            }
        })?;
        Ok(Self { addr: local, stop, connections, accept: Some(accept), stats, store })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its counters.
    pub fn stats(&self) -> &PeerStats {
        &self.stats
    }

    /// The chunks it holds.
    pub fn store(&self) -> &HostStore {
        &self.store
    }
}

impl Drop for PeerServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        for conn in self.connections.lock().drain(..) {
            let _ = conn.shutdown(Shutdown::Both);
        }
    }
}

/// Serves one connection until it closes or misbehaves.
fn serve(conn: TcpStream, config: &PeerConfig, stats: &PeerStats, mut store: HostStore) {
    let _ = conn.set_nodelay(true);
    let _ = conn.set_read_timeout(Some(config.io_timeout));
    let _ = conn.set_write_timeout(Some(config.io_timeout));
    let Ok(read_half) = conn.try_clone() else { return };
    let mut r = BufReader::with_capacity(1 << 20, read_half);
    let mut w = BufWriter::with_capacity(1 << 20, conn);
    match server_handshake(&mut r, &mut w, config) {
        Ok(()) => stats.authenticated.fetch_add(1, Ordering::Relaxed),
        Err(e) => {
            // Counted before the client can hear of it.
            stats.refused.fetch_add(1, Ordering::Relaxed);
            if let PeerError::Auth(_) = e {
                let reason = b"authentication failed: wrong cluster secret";
                let _ = write_frame(&mut w, &FrameHeader::new(Kind::Error, config.node, 0, 0), reason)
                    .and_then(|()| w.flush());
            }
            let _ = w.get_ref().shutdown(Shutdown::Both);
            return;
        }
    };
    loop {
        let frame = match read_frame(&mut r, config.max_payload) {
            Ok(Some(f)) => f,
            Ok(None) => return,
            Err(_) => {
                stats.bad_frames.fetch_add(1, Ordering::Relaxed);
                let _ = w.get_ref().shutdown(Shutdown::Both);
                return;
            }
        };
        let request = frame.header.request;
        let reply = match frame.header.kind {
            Kind::Put => match store_chunk(&frame.payload, &mut store) {
                Ok(sum) => {
                    stats.puts.fetch_add(1, Ordering::Relaxed);
                    let mut h = FrameHeader::new(Kind::PutAck, config.node, 0, request);
                    h.ids = [sum as u32, (sum >> 32) as u32, 0, 0];
                    (h, Vec::new())
                }
                Err(e) => (FrameHeader::new(Kind::Error, config.node, 0, request), e.into_bytes()),
            },
            Kind::Get => match ChunkKey::decode(&frame.payload) {
                Some(key) => {
                    let mut payload = Vec::new();
                    match store.get(&key, &mut payload) {
                        Ok(descriptor) => {
                            // The chunk header and payload go out as two parts, not joined.
                            let chunk_header = descriptor.encode_header(&payload);
                            let header = FrameHeader::new(Kind::GetReply, config.node, 0, request);
                            let sent = write_frame_parts(&mut w, &header, &[&chunk_header, &payload])
                                .and_then(|()| w.flush());
                            if sent.is_err() {
                                return;
                            }
                            continue;
                        }
                        Err(e) => (
                            FrameHeader::new(Kind::Error, config.node, 0, request),
                            e.to_string().into_bytes(),
                        ),
                    }
                }
                None => (FrameHeader::new(Kind::Error, config.node, 0, request), b"malformed key".to_vec()),
            },
            Kind::Heartbeat => (FrameHeader::new(Kind::Heartbeat, config.node, 0, request), Vec::new()),
            other => (
                FrameHeader::new(Kind::Error, config.node, 0, request),
                format!("unexpected {other:?}").into_bytes(),
            ),
        };
        if write_frame(&mut w, &reply.0, &reply.1).and_then(|()| w.flush()).is_err() {
            return;
        }
    }
}

/// Verifies a chunk (header and payload) and stores it; returns the payload checksum.
fn store_chunk(bytes: &[u8], store: &mut HostStore) -> Result<u64, String> {
    if bytes.len() < HEADER_LEN {
        return Err("chunk shorter than its header".into());
    }
    let (descriptor, len, sum) =
        ChunkDescriptor::decode_header(&bytes[..HEADER_LEN]).map_err(|e| e.to_string())?;
    let payload = &bytes[HEADER_LEN..];
    if payload.len() as u64 != len {
        return Err(format!("chunk payload of {} bytes, header says {len}", payload.len()));
    }
    verify_payload(payload, sum).map_err(|e| e.to_string())?;
    store.put(&descriptor, payload).map_err(|e| e.to_string())?;
    Ok(sum)
}

fn expect(frame: Option<Frame>, kind: Kind) -> Result<Frame, PeerError> {
    match frame {
        Some(f) if f.header.kind == kind => Ok(f),
        Some(f) if f.header.kind == Kind::Error => {
            Err(PeerError::Refused(String::from_utf8_lossy(&f.payload).into()))
        }
        Some(f) => Err(PeerError::Protocol(format!("expected {kind:?}, got {:?}", f.header.kind))),
        None => Err(PeerError::Io(io::ErrorKind::UnexpectedEof.into())),
    }
}

fn server_handshake(r: &mut impl io::Read, w: &mut impl Write, config: &PeerConfig) -> Result<(), PeerError> {
    // Hello carries only a nonce: nothing else is read before the client proves the secret.
    let hello = expect(read_frame(r, NONCE_LEN as u64)?, Kind::Hello)?;
    let ours = nonce()?;
    let mut payload = ours.to_vec();
    payload.extend(mac(&config.secret, b"server", &hello.payload, &ours));
    write_frame(w, &FrameHeader::new(Kind::Challenge, config.node, 0, 0), &payload)?;
    w.flush()?;
    let proof = expect(read_frame(r, 64)?, Kind::Proof)?;
    if !verify_mac(&config.secret, b"client", &ours, &hello.payload, &proof.payload) {
        return Err(PeerError::Auth("client does not know the cluster secret".into()));
    }
    write_frame(w, &FrameHeader::new(Kind::Welcome, config.node, 0, 0), &[])?;
    w.flush()?;
    Ok(())
}

/// A [`ChunkStore`] whose chunks live on a [`PeerServer`]: remote flush and fetch.
pub struct PeerStore {
    addr: SocketAddr,
    config: PeerConfig,
    conn: Option<(BufReader<TcpStream>, BufWriter<TcpStream>)>,
    next_request: u64,
    /// Connection attempts before giving up, with exponential backoff from 10 ms.
    pub retries: u32,
}

impl PeerStore {
    /// A store on the peer at `addr`; connects on first use.
    pub fn new(addr: SocketAddr, config: PeerConfig) -> Self {
        Self { addr, config, conn: None, next_request: 1, retries: 5 }
    }

    fn connect(&self) -> Result<(BufReader<TcpStream>, BufWriter<TcpStream>), PeerError> {
        let stream = TcpStream::connect_timeout(&self.addr, self.config.io_timeout)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(self.config.io_timeout))?;
        stream.set_write_timeout(Some(self.config.io_timeout))?;
        let mut r = BufReader::with_capacity(1 << 20, stream.try_clone()?);
        let mut w = BufWriter::with_capacity(1 << 20, stream);
        let ours = nonce()?;
        write_frame(&mut w, &FrameHeader::new(Kind::Hello, self.config.node, 0, 0), &ours)?;
        w.flush()?;
        let challenge = expect(read_frame(&mut r, (NONCE_LEN + 32) as u64)?, Kind::Challenge)?;
        if challenge.payload.len() != NONCE_LEN + 32 {
            return Err(PeerError::Auth("malformed challenge".into()));
        }
        let (theirs, tag) = challenge.payload.split_at(NONCE_LEN);
        if !verify_mac(&self.config.secret, b"server", &ours, theirs, tag) {
            return Err(PeerError::Auth("server does not know the cluster secret".into()));
        }
        let proof = mac(&self.config.secret, b"client", theirs, &ours);
        write_frame(&mut w, &FrameHeader::new(Kind::Proof, self.config.node, 0, 0), &proof)?;
        w.flush()?;
        match expect(read_frame(&mut r, 256)?, Kind::Welcome) {
            Ok(_) => Ok((r, w)),
            Err(PeerError::Refused(reason)) => Err(PeerError::Auth(reason)),
            Err(e) => Err(e),
        }
    }

    /// Sends one request and reads its reply, reconnecting with backoff on connection failures.
    fn call(&mut self, kind: Kind, payload: &[&[u8]], reply: Kind) -> Result<Frame, PeerError> {
        let mut delay = Duration::from_millis(10);
        let mut attempt = 0;
        loop {
            let result = self.try_call(kind, payload, reply);
            match result {
                Err(
                    PeerError::Io(_)
                    | PeerError::Frame(FrameError::Io(_))
                    | PeerError::Frame(FrameError::Truncated { .. }),
                ) if attempt < self.retries => {
                    self.conn = None;
                    attempt += 1;
                    std::thread::sleep(delay);
                    delay *= 2;
                }
                Err(PeerError::Auth(m)) => {
                    self.conn = None;
                    return Err(PeerError::Auth(m));
                }
                other => return other,
            }
        }
    }

    fn try_call(&mut self, kind: Kind, payload: &[&[u8]], reply: Kind) -> Result<Frame, PeerError> {
        if self.conn.is_none() {
            self.conn = Some(self.connect()?);
        }
        let request = self.next_request;
        self.next_request += 1;
        let header = FrameHeader::new(kind, self.config.node, 0, request);
        let max = self.config.max_payload;
        let (r, w) = self.conn.as_mut().expect("connected above");
        write_frame_parts(w, &header, payload)?;
        w.flush()?;
        let frame = expect(read_frame(r, max)?, reply)?;
        if frame.header.request != request {
            self.conn = None;
            return Err(PeerError::Protocol("reply to another request".into()));
        }
        Ok(frame)
    }
}

impl ChunkStore for PeerStore {
    fn put(&mut self, descriptor: &ChunkDescriptor, payload: &[u8]) -> Result<(), StoreError> {
        let header = descriptor.encode_header(payload);
        let ack = self.call(Kind::Put, &[&header, payload], Kind::PutAck)?;
        let sum = ack.header.ids[0] as u64 | (ack.header.ids[1] as u64) << 32;
        if sum != xxhash_rust::xxh3::xxh3_64(payload) {
            return Err(PeerError::Protocol("the peer acknowledged another checksum".into()).into());
        }
        Ok(())
    }

    fn get(&mut self, key: &ChunkKey, out: &mut Vec<u8>) -> Result<ChunkDescriptor, StoreError> {
        let reply = self.call(Kind::Get, &[&key.encode()], Kind::GetReply);
        let frame = match reply {
            Err(PeerError::Refused(m)) if m.starts_with("no chunk") => {
                return Err(StoreError::NotFound(Box::new(key.clone())))
            }
            other => other?,
        };
        let bytes = &frame.payload;
        let corrupt = |source| StoreError::Chunk { key: key.file_name(), source };
        if bytes.len() < HEADER_LEN {
            return Err(corrupt(crate::chunk::ChunkError::Truncated {
                expected: HEADER_LEN as u64,
                got: bytes.len() as u64,
            }));
        }
        let (descriptor, len, sum) = ChunkDescriptor::decode_header(&bytes[..HEADER_LEN]).map_err(corrupt)?;
        let payload = &bytes[HEADER_LEN..];
        if payload.len() as u64 != len || descriptor.key() != *key {
            return Err(corrupt(crate::chunk::ChunkError::Invalid("the peer returned another chunk".into())));
        }
        verify_payload(payload, sum).map_err(corrupt)?;
        out.clear();
        out.extend_from_slice(payload);
        Ok(descriptor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Packing;
    use crate::placement::WorkerId;
    use crate::region::KvRegion;
    use crate::spec::{DType, KvSpec};

    fn chunk_bytes() -> Vec<u8> {
        let spec = KvSpec::new(1, 1, 8, DType::F16).unwrap();
        let descriptor = ChunkDescriptor {
            source: WorkerId { stage: 0, rank: 0 },
            destination: WorkerId { stage: 1, rank: 0 },
            microbatch: 0,
            region: KvRegion::new(0..1, 0..1, 0..1, 0..2),
            spec,
            packing: Packing::token_major(&spec),
        };
        let payload = vec![5u8; descriptor.payload_len() as usize];
        let mut bytes = descriptor.encode_header(&payload).to_vec();
        bytes.extend_from_slice(&payload);
        bytes
    }

    #[test]
    fn a_received_chunk_is_verified_before_it_is_stored() {
        let mut store = HostStore::new();
        let good = chunk_bytes();
        assert!(store_chunk(&good, &mut store).is_ok());
        let mut corrupt = good.clone();
        *corrupt.last_mut().unwrap() ^= 1;
        let mut truncated = good.clone();
        truncated.pop();
        let mut fresh = HostStore::new();
        assert!(store_chunk(&corrupt, &mut fresh).is_err());
        assert!(store_chunk(&truncated, &mut fresh).is_err());
        assert!(store_chunk(&good[..50], &mut fresh).is_err());
        assert!(fresh.is_empty());
    }

    #[test]
    fn keys_round_trip() {
        let key = ChunkKey {
            destination: WorkerId { stage: 3, rank: 1 },
            microbatch: 7,
            region: KvRegion::new(1..4, 0..8, 2..6, 100..101),
        };
        assert_eq!(ChunkKey::decode(&key.encode()), Some(key));
        assert_eq!(ChunkKey::decode(&[0u8; 43]), None);
    }
}
