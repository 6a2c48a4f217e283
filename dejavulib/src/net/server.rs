//! The serving side of remote flush / fetch: a peer that keeps chunks pushed to it.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dejavu_proto::fencing::{fenced_since, Claim, Newest};
use parking_lot::{Mutex, MutexGuard, RwLock};
use std::collections::HashMap;
use tokio::task::JoinSet;

use super::auth::server_handshake;
use super::codec::{read_frame_into, write_frame};
use super::transport::{Accepted, Listener, Stream, Transport};
use crate::chunk::{ChunkDescriptor, ChunkKey, HEADER_LEN};
use crate::message::Message;
use crate::store::HostStore;
use crate::wire::{ErrorCode, Frame, FrameHeader, Kind, DEFAULT_MAX_PAYLOAD, FLAG_CHUNK};

/// Settings of a peer server.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The shared cluster secret.
    pub secret: Vec<u8>,
    /// This node's id (sent in every frame).
    pub node: u32,
    /// Largest frame payload accepted; a longer one is refused before allocation and closes the
    /// connection.
    pub max_payload: u64,
    /// Time a new connection has to finish its transport and cluster handshakes.
    pub handshake_timeout: Duration,
    /// Connections served at once; more are closed as they arrive (and counted as refused).
    pub max_connections: usize,
}

impl ServerConfig {
    /// Defaults for `secret` and `node`: 1 GiB frames, 10 s handshakes, 1024 connections.
    pub fn new(secret: impl Into<Vec<u8>>, node: u32) -> Self {
        Self {
            secret: secret.into(),
            node,
            max_payload: DEFAULT_MAX_PAYLOAD,
            handshake_timeout: Duration::from_secs(10),
            max_connections: 1024,
        }
    }
}

/// Counters of a peer server.
#[derive(Debug, Default)]
pub struct PeerStats {
    /// Connections that passed the handshake.
    pub authenticated: AtomicU64,
    /// Connections refused at the transport or cluster handshake.
    pub refused: AtomicU64,
    /// Chunks stored.
    pub puts: AtomicU64,
    /// Chunks served.
    pub gets: AtomicU64,
    /// Bytes of the chunks stored (chunk headers included).
    pub bytes_stored: AtomicU64,
    /// Bytes of the chunks served (chunk headers included).
    pub bytes_served: AtomicU64,
    /// Chunks refused because their header does not describe a valid chunk of the bytes sent.
    pub bad_chunks: AtomicU64,
    /// Requests refused because their epoch was stale.
    pub stale: AtomicU64,
    /// Connections closed on a malformed, corrupted or oversized frame.
    pub bad_frames: AtomicU64,
}

struct Shared {
    config: ServerConfig,
    stats: PeerStats,
    store: HostStore,
    /// The fence: requests from older epochs are refused (see [`decide`]).
    epoch: RwLock<u64>,
    /// The newest epoch each sender has stored a chunk in (see [`decide`]).
    senders: Mutex<HashMap<u32, Newest>>,
}

/// A peer that keeps chunks flushed to it in host memory (a replica holder, a swap space).
///
/// Dropping it stops accepting and closes every connection, as a process exit would.
pub struct PeerServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
}

impl PeerServer {
    /// Listens at `addr` on `transport` (port 0 picks one) and serves `store`. Must be called from
    /// within a tokio runtime, which runs the server's tasks.
    pub async fn bind(
        transport: &dyn Transport,
        addr: SocketAddr,
        config: ServerConfig,
        store: HostStore,
    ) -> io::Result<Self> {
        let listener = transport.listen(addr).await?;
        let addr = listener.local_addr();
        let shared = Arc::new(Shared {
            config,
            stats: PeerStats::default(),
            store,
            epoch: RwLock::new(0),
            senders: Mutex::default(),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(Self { addr, shared, accept })
    }

    /// The address it listens at.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its counters.
    pub fn stats(&self) -> &PeerStats {
        &self.shared.stats
    }

    /// The chunks it holds.
    pub fn store(&self) -> &HostStore {
        &self.shared.store
    }

    /// Fences senders: from now on requests from an epoch below `epoch` are refused.
    pub fn set_epoch(&self, epoch: u64) {
        let mut fence = self.shared.epoch.write();
        *fence = (*fence).max(epoch);
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        *self.shared.epoch.read()
    }
}

impl Drop for PeerServer {
    fn drop(&mut self) {
        // Aborting the accept task drops its listener and its set of connection tasks.
        self.accept.abort();
    }
}

async fn accept_loop(mut listener: Box<dyn Listener>, shared: Arc<Shared>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(setup) if connections.len() < shared.config.max_connections => {
                    connections.spawn(serve(setup, shared.clone()));
                }
                Ok(setup) => {
                    drop(setup);
                    shared.stats.refused.fetch_add(1, Ordering::Relaxed);
                }
                // A listener error (out of descriptors) is not a reason to stop serving.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn serve(setup: Accepted, shared: Arc<Shared>) {
    let config = &shared.config;
    let refused = || shared.stats.refused.fetch_add(1, Ordering::Relaxed);
    let mut stream = match tokio::time::timeout(config.handshake_timeout, setup).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(_)) | Err(_) => {
            refused();
            return;
        }
    };
    let proven = server_handshake(&mut stream, &config.secret, config.node);
    if !matches!(tokio::time::timeout(config.handshake_timeout, proven).await, Ok(Ok(()))) {
        // Counted before the stream closes, so a refused client never sees the count behind.
        refused();
        return;
    }
    shared.stats.authenticated.fetch_add(1, Ordering::Relaxed);
    loop {
        let frame = match read_frame_into(&mut stream, config.max_payload, |len| shared.store.buffer_for(len))
            .await
        {
            Ok(Some(frame)) => frame,
            Ok(None) => return,
            Err(_) => {
                shared.stats.bad_frames.fetch_add(1, Ordering::Relaxed);
                return;
            }
        };
        if answer(&mut stream, frame, &shared).await.is_err() {
            return;
        }
    }
}

/// A reply: a frame with a byte payload, or a stored chunk sent as it is kept.
enum Reply {
    Bytes(FrameHeader, Vec<u8>),
    Chunk(FrameHeader, Arc<Vec<u8>>),
}

/// Serves one request.
async fn answer(stream: &mut Stream, frame: Frame, shared: &Shared) -> io::Result<()> {
    match decide(frame, shared) {
        Reply::Bytes(header, payload) => write_frame(stream, &header, &[&payload]).await,
        // The stored chunk is shared, not copied, while it is written out.
        Reply::Chunk(header, chunk) => write_frame(stream, &header, &[&chunk[..]]).await,
    }
}

/// What to answer to `frame`. Runs without awaiting: the epoch fence is held from the check to the
/// store, so once [`PeerServer::set_epoch`] has returned no stale put can still be stored.
///
/// Besides the fence, each sender's epochs only grow: a put from an epoch older than one the same
/// sender has already stored a chunk in comes from a fenced incarnation of that sender (a stale
/// worker back from a pause or a partition, whose replacement runs in a newer epoch), and is
/// refused as stale.
fn decide(frame: Frame, shared: &Shared) -> Reply {
    let node = shared.config.node;
    let fence = shared.epoch.read();
    let epoch = *fence;
    let request = frame.header.request;
    let refuse = |code: ErrorCode, reason: String| {
        let mut header = FrameHeader::new(Kind::Error, node, frame.header.epoch, request);
        header.ids[0] = code as u32;
        Reply::Bytes(header, reason.into_bytes())
    };
    match frame.header.kind {
        Kind::Put | Kind::Get | Kind::Control if fenced_since(frame.header.epoch, epoch) => {
            shared.stats.stale.fetch_add(1, Ordering::Relaxed);
            refuse(ErrorCode::StaleEpoch, format!("epoch {} is older than {epoch}", frame.header.epoch))
        }
        Kind::Put => {
            let _sender = match admit_sender(shared, &frame.header) {
                Ok(held) => held,
                Err(reason) => return refuse(ErrorCode::StaleEpoch, reason),
            };
            let bytes = frame.payload.len() as u64;
            let stored = if frame.header.flags & FLAG_CHUNK == 0 {
                Err("a put must carry a chunk".to_owned())
            } else {
                store_chunk(frame.payload, &shared.store)
            };
            match stored {
                Ok(sum) => {
                    shared.stats.puts.fetch_add(1, Ordering::Relaxed);
                    shared.stats.bytes_stored.fetch_add(bytes, Ordering::Relaxed);
                    let mut ack = FrameHeader::new(Kind::PutAck, node, epoch, request);
                    ack.ids = [sum as u32, (sum >> 32) as u32, 0, 0];
                    Reply::Bytes(ack, Vec::new())
                }
                Err(reason) => {
                    shared.stats.bad_chunks.fetch_add(1, Ordering::Relaxed);
                    refuse(ErrorCode::BadChunk, reason)
                }
            }
        }
        Kind::Get => match ChunkKey::decode(&frame.payload).and_then(|key| shared.store.encoded(&key)) {
            Some(chunk) => {
                shared.stats.gets.fetch_add(1, Ordering::Relaxed);
                shared.stats.bytes_served.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                let mut reply = FrameHeader::new(Kind::GetReply, node, epoch, request);
                reply.flags = FLAG_CHUNK;
                Reply::Chunk(reply, chunk)
            }
            None => refuse(ErrorCode::NotFound, "no such chunk".into()),
        },
        Kind::Control => match Message::of_frame(&frame) {
            // A release drops KV as a put replaces it: from the sender's newest epoch only.
            Ok(Message::Release(place)) => {
                let _sender = match admit_sender(shared, &frame.header) {
                    Ok(held) => held,
                    Err(reason) => return refuse(ErrorCode::StaleEpoch, reason),
                };
                let chunks = shared.store.release_place(&place);
                let (header, payload) = Message::Released { chunks }.frame(node, epoch, request);
                Reply::Bytes(header, payload)
            }
            Ok(other) => refuse(ErrorCode::Unexpected, format!("unexpected {other:?}")),
            Err(e) => refuse(ErrorCode::Unexpected, e.to_string()),
        },
        Kind::Heartbeat => Reply::Bytes(FrameHeader::new(Kind::Heartbeat, node, epoch, request), Vec::new()),
        other => refuse(ErrorCode::Unexpected, format!("unexpected {other:?}")),
    }
}

/// Admits a put or a release from `header`'s sender unless that sender has stored something in a
/// newer epoch already (a fenced incarnation of it); the sender's epoch is recorded. The guard is
/// held while the frame is carried out, so that nothing of a newer epoch overtakes it.
fn admit_sender<'a>(
    shared: &'a Shared,
    header: &FrameHeader,
) -> Result<MutexGuard<'a, HashMap<u32, Newest>>, String> {
    let mut senders = shared.senders.lock();
    if let Claim::Stale { newest } = senders.entry(header.sender).or_default().claim(header.epoch) {
        shared.stats.stale.fetch_add(1, Ordering::Relaxed);
        return Err(format!(
            "epoch {} is older than sender {}'s epoch {newest}",
            header.epoch, header.sender
        ));
    }
    Ok(senders)
}

/// Keeps an encoded chunk (header and payload) from a chunk frame; returns the payload checksum.
/// The codec has already checked the payload against the checksum the chunk header records; this
/// checks that the header describes a valid chunk of exactly the bytes that came.
fn store_chunk(encoded: Vec<u8>, store: &HostStore) -> Result<u64, String> {
    if encoded.len() < HEADER_LEN {
        return Err("chunk shorter than its header".into());
    }
    let (descriptor, len, sum) =
        ChunkDescriptor::decode_header(&encoded[..HEADER_LEN]).map_err(|e| e.to_string())?;
    let payload_len = (encoded.len() - HEADER_LEN) as u64;
    if payload_len != len {
        return Err(format!("chunk payload of {payload_len} bytes, its header says {len}"));
    }
    store.insert_encoded(descriptor.key(), encoded);
    Ok(sum)
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
    fn a_chunk_is_stored_only_if_its_header_describes_the_bytes_that_came() {
        let good = chunk_bytes();
        assert!(store_chunk(good.clone(), &HostStore::new()).is_ok());
        let mut bad_header = good.clone();
        bad_header[20] ^= 1;
        let mut truncated = good.clone();
        truncated.pop();
        let fresh = HostStore::new();
        assert!(store_chunk(bad_header, &fresh).is_err());
        assert!(store_chunk(truncated, &fresh).is_err());
        assert!(store_chunk(good[..50].to_vec(), &fresh).is_err());
        assert!(fresh.is_empty());
    }
}
