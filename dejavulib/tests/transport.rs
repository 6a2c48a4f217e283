//! One conformance suite for every transport: in-memory, TCP, TCP with TLS and QUIC. Each test body
//! is written once over a [`Net`] and instantiated per transport by `conformance!`. Everything runs
//! on real sockets on loopback except the in-memory instance.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use dejavulib::chunk::ChunkDescriptor;
use dejavulib::net::auth::{client_handshake, server_handshake, NONCE_LEN};
use dejavulib::net::codec::{read_frame, write_frame};
use dejavulib::net::memory::{MemoryNetwork, MemoryTransport};
use dejavulib::net::quic::QuicTransport;
use dejavulib::net::tcp::TcpTransport;
use dejavulib::net::tls::ClusterCa;
use dejavulib::net::{ClientConfig, PeerClient, PeerError, PeerServer, PeerStore, ServerConfig, Transport};
use dejavulib::store::StoreError;
use dejavulib::wire::{FrameHeader, Kind, FLAG_CHUNK};
use dejavulib::{ChunkStore, DType, HostStore, KvRegion, KvSpec, Packing, WorkerId};

const SECRET: &[u8] = b"cluster secret";

/// A server-side and a client-side transport of one kind.
struct Net {
    server: Arc<dyn Transport>,
    client: Arc<dyn Transport>,
}

impl Net {
    fn memory() -> Self {
        let network = MemoryNetwork::default();
        Self {
            server: Arc::new(MemoryTransport::new(&network)),
            client: Arc::new(MemoryTransport::new(&network)),
        }
    }

    fn tcp() -> Self {
        Self { server: Arc::new(TcpTransport::plain()), client: Arc::new(TcpTransport::plain()) }
    }

    fn tls() -> Self {
        let ca = ClusterCa::generate("conformance").unwrap();
        Self {
            server: Arc::new(TcpTransport::with_tls(&ca.issue("server").unwrap()).unwrap()),
            client: Arc::new(TcpTransport::with_tls(&ca.issue("client").unwrap()).unwrap()),
        }
    }

    fn quic() -> Self {
        let ca = ClusterCa::generate("conformance").unwrap();
        Self {
            server: Arc::new(QuicTransport::new(&ca.issue("server").unwrap()).unwrap()),
            client: Arc::new(QuicTransport::new(&ca.issue("client").unwrap()).unwrap()),
        }
    }

    fn any_port(&self) -> SocketAddr {
        "127.0.0.1:0".parse().unwrap()
    }

    async fn serve(&self, config: ServerConfig) -> PeerServer {
        PeerServer::bind(&*self.server, self.any_port(), config, HostStore::new()).await.unwrap()
    }

    fn client(&self, addr: SocketAddr, config: ClientConfig) -> PeerClient {
        PeerClient::new(self.client.clone(), addr, config)
    }
}

/// A chunk whose payload is `bytes` (even, at least 2) of seeded noise.
fn chunk(bytes: u32, seed: u64, microbatch: u32) -> (ChunkDescriptor, Vec<u8>) {
    assert!(bytes >= 2 && bytes % 2 == 0);
    // One int8 layer and head, head_dim 1: K and V of one token are 2 bytes.
    let spec = KvSpec::new(1, 1, 1, DType::Int8).unwrap();
    let descriptor = ChunkDescriptor {
        source: WorkerId { stage: 0, rank: 0 },
        destination: WorkerId { stage: 1, rank: 0 },
        microbatch,
        region: KvRegion::new(0..1, 0..1, 0..1, 0..bytes / 2),
        spec,
        packing: Packing::token_major(&spec),
    };
    let payload = dejavu_proto::rng::SplitMix64::new(seed).bytes(bytes as usize);
    assert_eq!(descriptor.payload_len(), bytes as u64);
    (descriptor, payload)
}

fn count(counter: &std::sync::atomic::AtomicU64) -> u64 {
    counter.load(Ordering::SeqCst)
}

/// `counter` once it reaches `at_least`, or its value after ten seconds: what a test asserts on
/// when the server counts an event after the client has seen it.
async fn reaches(counter: &std::sync::atomic::AtomicU64, at_least: u64) -> u64 {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while count(counter) < at_least && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    count(counter)
}

async fn round_trips_from_two_bytes_to_64_mib(net: Net) {
    let server = net.serve(ServerConfig::new(SECRET, 1)).await;
    let client = net.client(server.addr(), ClientConfig::new(SECRET, 2));
    let sizes = [2, 4098, 1 << 20, (1 << 20) + 6, 64 << 20];
    for (i, &size) in sizes.iter().enumerate() {
        let (descriptor, payload) = chunk(size, i as u64, i as u32);
        client.put(&descriptor, &payload).await.unwrap();
        let back = client.get(&descriptor.key()).await.unwrap();
        assert_eq!(back.descriptor, descriptor);
        assert!(back.payload() == payload, "{size} bytes came back different");
    }
    assert_eq!(count(&server.stats().puts), sizes.len() as u64);
    assert_eq!(server.store().len(), sizes.len());
    assert_eq!(client.connects(), 1, "one connection carried everything");
    let mut missing = chunk(2, 0, 99).0.key();
    missing.microbatch = 99;
    assert!(matches!(client.get(&missing).await, Err(PeerError::NotFound)));
    assert!(client.ping().await.is_ok());
}

async fn many_concurrent_requests_share_connections(net: Net) {
    let server = net.serve(ServerConfig::new(SECRET, 1)).await;
    let clients: Vec<PeerClient> =
        (0..4).map(|n| net.client(server.addr(), ClientConfig::new(SECRET, 10 + n))).collect();
    let mut tasks = Vec::new();
    for i in 0..48u32 {
        let client = clients[i as usize % clients.len()].clone();
        tasks.push(tokio::spawn(async move {
            let (descriptor, payload) = chunk(2 * (1000 + 4099 * i), i as u64, i);
            client.put(&descriptor, &payload).await.unwrap();
            let back = client.get(&descriptor.key()).await.unwrap();
            assert!(back.payload() == payload, "request {i} mixed up");
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(count(&server.stats().puts), 48);
    assert_eq!(count(&server.stats().authenticated), 4);
}

async fn a_wrong_secret_is_refused_before_any_kv_frame(net: Net) {
    let server = net.serve(ServerConfig::new(SECRET, 1)).await;
    let intruder = net.client(server.addr(), ClientConfig::new(b"another cluster".to_vec(), 2));
    let (descriptor, payload) = chunk(64, 1, 0);
    let err = intruder.put(&descriptor, &payload).await.unwrap_err();
    assert!(matches!(err, PeerError::Auth(_)), "{err}");

    // A raw client that skips the handshake and sends a KV frame straight away.
    let mut raw = net.client.connect(server.addr()).await.unwrap();
    let header = descriptor.encode_header(&payload);
    let mut put = FrameHeader::new(Kind::Put, 9, 0, 1);
    put.flags = FLAG_CHUNK;
    let _ = write_frame(&mut raw, &put, &[&header, &payload]).await;
    // The server answers with nothing but the end of the connection.
    assert!(!matches!(read_frame(&mut raw, 1 << 20).await, Ok(Some(_))));
    assert!(server.store().is_empty());
    assert_eq!(count(&server.stats().puts), 0);
    // The server counts a refusal after it has closed the connection: wait for the count.
    let refused = reaches(&server.stats().refused, 2).await;
    assert!(refused >= 2, "refusals counted: {refused}");
}

async fn a_replayed_handshake_is_refused(net: Net) {
    let server = net.serve(ServerConfig::new(SECRET, 1)).await;
    // An eavesdropper records a member's Hello and Proof...
    let mut member = net.client.connect(server.addr()).await.unwrap();
    let hello = [7u8; NONCE_LEN];
    write_frame(&mut member, &FrameHeader::new(Kind::Hello, 2, 0, 0), &[&hello]).await.unwrap();
    let challenge = read_frame(&mut member, 64).await.unwrap().unwrap();
    let proof = {
        use hmac::Mac;
        let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(SECRET).unwrap();
        mac.update(b"client");
        mac.update(&challenge.payload[..NONCE_LEN]);
        mac.update(&hello);
        mac.finalize().into_bytes()
    };
    write_frame(&mut member, &FrameHeader::new(Kind::Proof, 2, 0, 0), &[&proof]).await.unwrap();
    assert_eq!(read_frame(&mut member, 64).await.unwrap().unwrap().header.kind, Kind::Welcome);
    // ...and replays them on a connection of its own: the server's fresh nonce defeats it.
    let mut replay = net.client.connect(server.addr()).await.unwrap();
    write_frame(&mut replay, &FrameHeader::new(Kind::Hello, 2, 0, 0), &[&hello]).await.unwrap();
    let fresh = read_frame(&mut replay, 64).await.unwrap().unwrap();
    assert_ne!(fresh.payload[..NONCE_LEN], challenge.payload[..NONCE_LEN]);
    write_frame(&mut replay, &FrameHeader::new(Kind::Proof, 2, 0, 0), &[&proof]).await.unwrap();
    let answer = read_frame(&mut replay, 256).await.unwrap().unwrap();
    assert_eq!(answer.header.kind, Kind::Error);
    assert_eq!(count(&server.stats().authenticated), 1);
}

async fn the_sender_sees_a_typed_error_when_the_peer_restarts_then_reconnects(net: Net) {
    let first = net.serve(ServerConfig::new(SECRET, 1)).await;
    let addr = first.addr();
    // A QUIC dial to a closed port hears nothing back (UDP): only the timeout ends it.
    let mut config = ClientConfig::new(SECRET, 2);
    config.connect_timeout = Duration::from_millis(500);
    let client = net.client(addr, config);
    let sender = {
        let client = client.clone();
        tokio::spawn(async move {
            for i in 0.. {
                let (descriptor, payload) = chunk(1 << 20, i, i as u32);
                if let Err(e) = client.put(&descriptor, &payload).await {
                    return e;
                }
            }
            unreachable!()
        })
    };
    while count(&first.stats().puts) < 3 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    drop(first);
    let err = sender.await.unwrap();
    assert!(
        matches!(err, PeerError::ConnectionLost(_) | PeerError::Unreachable { .. } | PeerError::Timeout(_)),
        "{err}"
    );
    // The peer comes back on the same address; the next request reconnects.
    let second = loop {
        match PeerServer::bind(&*net.server, addr, ServerConfig::new(SECRET, 1), HostStore::new()).await {
            Ok(server) => break server,
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    let (descriptor, payload) = chunk(4096, 7, 7);
    client.put(&descriptor, &payload).await.unwrap();
    assert!(client.connects() >= 2);
    assert_eq!(count(&second.stats().puts), 1);
}

async fn backpressure_bounds_bytes_in_flight_and_timeouts_are_typed(net: Net) {
    // A peer that completes the handshake and then never reads.
    let mut listener = net.server.listen(net.any_port()).await.unwrap();
    let addr = listener.local_addr();
    let stalled = tokio::spawn(async move {
        let mut stream = listener.accept().await.unwrap().await.unwrap();
        server_handshake(&mut stream, SECRET, 1).await.unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
        drop(stream);
    });
    let mut config = ClientConfig::new(SECRET, 2);
    config.max_put_bytes_in_flight = 4 << 20;
    config.request_timeout = Duration::from_millis(1500);
    config.connect_timeout = Duration::from_millis(500);
    config.connect_attempts = 2;
    let client = net.client(addr, config);
    let mut puts = Vec::new();
    for i in 0..8 {
        let client = client.clone();
        puts.push(tokio::spawn(async move {
            let (descriptor, payload) = chunk(1 << 20, i, i as u32);
            client.put(&descriptor, &payload).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(client.put_budget_left(), 0, "four 1 MiB puts hold the whole 4 MiB budget");
    let mut timeouts = 0;
    for put in puts {
        match put.await.unwrap() {
            Err(PeerError::Timeout(_)) => timeouts += 1,
            // Once a timeout has closed the connection, waiting puts find the stalled peer gone.
            Err(PeerError::ConnectionLost(_) | PeerError::Unreachable { .. }) => {}
            other => panic!("a put to a peer that never reads: {other:?}"),
        }
    }
    assert!(timeouts >= 1);
    assert_eq!(client.put_budget_left(), 4 << 20, "every byte of budget came back");
    stalled.abort();
}

async fn stale_epochs_are_fenced(net: Net) {
    let server = net.serve(ServerConfig::new(SECRET, 1)).await;
    let mut config = ClientConfig::new(SECRET, 2);
    config.epoch = 3;
    let client = net.client(server.addr(), config);
    let (descriptor, payload) = chunk(256, 1, 0);
    client.put(&descriptor, &payload).await.unwrap();
    server.set_epoch(5);
    let err = client.put(&descriptor, &payload).await.unwrap_err();
    assert!(matches!(err, PeerError::StaleEpoch { sent: 3 }), "{err}");
    assert!(matches!(client.get(&descriptor.key()).await, Err(PeerError::StaleEpoch { .. })));
    client.set_epoch(5);
    client.put(&descriptor, &payload).await.unwrap();
    assert_eq!(count(&server.stats().stale), 2);
    assert_eq!(count(&server.stats().puts), 2);

    // Sender 2 now runs in epoch 7 (a replacement); an incarnation of it still in epoch 6 (a stale
    // worker back from a pause) is refused, while another sender in epoch 6 is not.
    let mut config = ClientConfig::new(SECRET, 2);
    config.epoch = 7;
    net.client(server.addr(), config).put(&descriptor, &payload).await.unwrap();
    client.set_epoch(6);
    let err = client.put(&descriptor, &payload).await.unwrap_err();
    assert!(matches!(err, PeerError::StaleEpoch { sent: 6 }), "{err}");
    let mut config = ClientConfig::new(SECRET, 3);
    config.epoch = 6;
    net.client(server.addr(), config).put(&descriptor, &payload).await.unwrap();
    assert_eq!(count(&server.stats().stale), 3);
    assert_eq!(count(&server.stats().puts), 4);
}

async fn bad_frames_close_the_connection_and_bad_chunks_are_not_stored(net: Net) {
    let mut config = ServerConfig::new(SECRET, 1);
    config.max_payload = 1 << 20;
    let server = net.serve(config).await;
    let member = |net: &Net| {
        let transport = net.client.clone();
        let addr = server.addr();
        async move {
            let mut stream = transport.connect(addr).await.unwrap();
            client_handshake(&mut stream, SECRET, 2).await.unwrap();
            stream
        }
    };
    let (descriptor, payload) = chunk(4096, 3, 0);
    let header = descriptor.encode_header(&payload);
    let mut put = FrameHeader::new(Kind::Put, 2, 0, 1);
    put.flags = FLAG_CHUNK;

    // A good chunk is stored; a chunk whose header lies about its region is refused (the connection
    // stays usable).
    let mut stream = member(&net).await;
    write_frame(&mut stream, &put, &[&header, &payload]).await.unwrap();
    assert_eq!(read_frame(&mut stream, 1 << 20).await.unwrap().unwrap().header.kind, Kind::PutAck);
    let mut lying = header;
    lying[0] ^= 1;
    write_frame(&mut stream, &put, &[&lying, &payload]).await.unwrap();
    assert_eq!(read_frame(&mut stream, 1 << 20).await.unwrap().unwrap().header.kind, Kind::Error);
    assert_eq!(count(&server.stats().bad_chunks), 1);

    // A flipped KV byte: the chunk's checksum catches it as the frame is read; connection closed.
    let mut flipped_stream = member(&net).await;
    let mut flipped = payload.clone();
    flipped[100] ^= 0x10;
    write_frame(&mut flipped_stream, &put, &[&header, &flipped]).await.unwrap();
    assert!(!matches!(read_frame(&mut flipped_stream, 1 << 20).await, Ok(Some(_))));

    // A header announcing more than the maximum: refused before allocation, connection closed.
    let mut oversized = member(&net).await;
    let (big, big_payload) = chunk(2 << 20, 4, 1);
    let big_header = big.encode_header(&big_payload);
    let _ = write_frame(&mut oversized, &put, &[&big_header, &big_payload]).await;
    assert!(!matches!(read_frame(&mut oversized, 1 << 20).await, Ok(Some(_))));

    // Garbage below the framing layer: connection closed.
    let mut garbage = member(&net).await;
    use tokio::io::AsyncWriteExt;
    garbage.write_all(&[0xAB; 200]).await.unwrap();
    garbage.flush().await.unwrap();
    assert!(!matches!(read_frame(&mut garbage, 1 << 20).await, Ok(Some(_))));

    assert_eq!(count(&server.stats().bad_frames), 3);
    assert_eq!(server.store().len(), 1, "only the good chunk was stored");
}

async fn the_blocking_store_flushes_and_fetches(net: Net) {
    let server = net.serve(ServerConfig::new(SECRET, 1)).await;
    let transport = net.client.clone();
    let addr = server.addr();
    let handle = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        let mut store = PeerStore::new(handle, transport, addr, ClientConfig::new(SECRET, 2));
        let (descriptor, payload) = chunk(10_000, 5, 0);
        store.put(&descriptor, &payload).unwrap();
        let mut back = Vec::new();
        assert_eq!(store.get(&descriptor.key(), &mut back).unwrap(), descriptor);
        assert_eq!(back, payload);
        let mut missing = descriptor.key();
        missing.microbatch = 9;
        assert!(matches!(store.get(&missing, &mut back), Err(StoreError::NotFound(_))));

        // A chunk put as encoded (its checksum from when it was made) is stored as any other; one
        // whose header and payload disagree is refused before it is sent.
        let (made, made_kv) = chunk(600, 41, 7);
        let encoded = [&made.encode_header(&made_kv)[..], &made_kv[..]].concat();
        store.put_encoded(&encoded).unwrap();
        assert_eq!(store.get(&made.key(), &mut back).unwrap(), made);
        assert_eq!(back, made_kv);
        assert!(store.put_encoded(&encoded[..encoded.len() - 1]).is_err());
        let mut flipped = encoded.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(store.put_encoded(&flipped).is_err(), "the peer verifies the payload");

        // Many at once, in flight together, each result in its place.
        let chunks: Vec<_> = (0..40u32).map(|i| chunk(1000 + 38 * i, 20 + i as u64, 10 + i)).collect();
        assert!(store.put_many(chunks.clone()).iter().all(Result::is_ok));
        let mut keys: Vec<_> = chunks.iter().map(|(d, _)| d.key()).collect();
        keys.insert(17, missing);
        let fetched = store.get_many(&keys);
        assert_eq!(fetched.len(), 41);
        assert!(matches!(fetched[17], Err(StoreError::NotFound(_))));
        let found: Vec<_> = fetched.into_iter().filter_map(Result::ok).collect();
        assert_eq!(found.len(), 40);
        for (f, (d, p)) in found.iter().zip(&chunks) {
            assert_eq!((&f.descriptor, f.payload()), (d, &p[..]));
            assert_eq!(&f.encoded()[dejavulib::chunk::HEADER_LEN..], &p[..]);
        }
    })
    .await
    .unwrap();
}

async fn a_request_abandoned_mid_write_does_not_wedge_the_connection(net: Net) {
    let server = net.serve(ServerConfig::new(SECRET, 1)).await;
    let client = net.client(server.addr(), ClientConfig::new(SECRET, 2));
    client.ping().await.unwrap();
    let (descriptor, payload) = chunk(64 << 20, 1, 0);
    // The caller gives up on a large put while its frame is still going out.
    let abandoned = tokio::time::timeout(Duration::from_micros(200), client.put(&descriptor, &payload)).await;
    let (small, small_payload) = chunk(4096, 2, 1);
    for _ in 0..3 {
        client.ping().await.unwrap();
    }
    client.put(&small, &small_payload).await.unwrap();
    if abandoned.is_err() {
        assert_eq!(client.connects(), 2, "the half-written connection was replaced");
    }
    assert_eq!(server.store().encoded_len(&small.key()), Some(4096 + dejavulib::chunk::HEADER_LEN));
}

async fn a_peer_that_stops_answering_is_replaced_after_a_timeout(net: Net) {
    // A peer that completes the handshake, reads everything and never answers.
    let mut listener = net.server.listen(net.any_port()).await.unwrap();
    let addr = listener.local_addr();
    let mute = tokio::spawn(async move {
        let mut stream = listener.accept().await.unwrap().await.unwrap();
        server_handshake(&mut stream, SECRET, 1).await.unwrap();
        let mut sink = tokio::io::sink();
        let _ = tokio::io::copy(&mut stream, &mut sink).await;
        drop(listener);
    });
    let mut config = ClientConfig::new(SECRET, 2);
    config.request_timeout = Duration::from_millis(300);
    config.connect_timeout = Duration::from_millis(300);
    config.connect_attempts = 1;
    let client = net.client(addr, config);
    assert!(matches!(client.ping().await, Err(PeerError::Timeout(_))));
    // The stuck connection was closed: the next request dials again instead of timing out on it.
    let next = client.ping().await;
    assert!(!matches!(next, Err(PeerError::Timeout(_)) if client.connects() == 1), "{next:?}");
    mute.abort();
}

async fn a_shut_client_fails_its_waiting_requests_at_once_and_every_later_one(net: Net) {
    // A peer that completes the handshake and never answers, as a dead QUIC peer stays silent.
    let mut listener = net.server.listen(net.any_port()).await.unwrap();
    let addr = listener.local_addr();
    let mute = tokio::spawn(async move {
        let mut stream = listener.accept().await.unwrap().await.unwrap();
        server_handshake(&mut stream, SECRET, 1).await.unwrap();
        let _ = tokio::io::copy(&mut stream, &mut tokio::io::sink()).await;
        drop(listener);
    });
    let mut config = ClientConfig::new(SECRET, 2);
    config.request_timeout = Duration::from_secs(30);
    let client = net.client(addr, config);
    let waiting = tokio::spawn({
        let client = client.clone();
        async move { client.ping().await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let start = std::time::Instant::now();
    client.shut();
    let waited = waiting.await.unwrap();
    assert!(matches!(waited, Err(PeerError::ConnectionLost(_))), "{waited:?}");
    assert!(start.elapsed() < Duration::from_secs(5), "failed at once, not at the 30 s timeout");
    assert!(matches!(client.ping().await, Err(PeerError::ConnectionLost(_))), "and every later request");
    mute.abort();
}

async fn requests_queued_behind_a_failed_connect_fail_together(net: Net) {
    // Nobody listens here any more.
    let addr = net.server.listen(net.any_port()).await.unwrap().local_addr();
    let mut config = ClientConfig::new(SECRET, 2);
    config.connect_timeout = Duration::from_millis(200);
    config.connect_attempts = 3;
    config.max_put_bytes_in_flight = 0;
    let client = net.client(addr, config);
    let start = std::time::Instant::now();
    let pings: Vec<_> = (0..4)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move { client.ping().await })
        })
        .collect();
    for ping in pings {
        assert!(matches!(ping.await.unwrap(), Err(PeerError::Unreachable { .. })));
    }
    // One round of attempts (3 x at most 200 ms, plus 30 ms of backoff), not four in turn.
    assert!(start.elapsed() < Duration::from_millis(1500), "{:?}", start.elapsed());
}

macro_rules! conformance {
    ($($test:ident),* $(,)?) => {
        mod memory {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                super::$test(super::Net::memory()).await
            })*
        }
        mod tcp {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                super::$test(super::Net::tcp()).await
            })*
        }
        mod tcp_tls {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                super::$test(super::Net::tls()).await
            })*
        }
        mod quic {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                super::$test(super::Net::quic()).await
            })*
        }
    };
}

conformance!(
    round_trips_from_two_bytes_to_64_mib,
    many_concurrent_requests_share_connections,
    a_wrong_secret_is_refused_before_any_kv_frame,
    a_replayed_handshake_is_refused,
    the_sender_sees_a_typed_error_when_the_peer_restarts_then_reconnects,
    backpressure_bounds_bytes_in_flight_and_timeouts_are_typed,
    stale_epochs_are_fenced,
    bad_frames_close_the_connection_and_bad_chunks_are_not_stored,
    the_blocking_store_flushes_and_fetches,
    a_request_abandoned_mid_write_does_not_wedge_the_connection,
    a_peer_that_stops_answering_is_replaced_after_a_timeout,
    a_shut_client_fails_its_waiting_requests_at_once_and_every_later_one,
    requests_queued_behind_a_failed_connect_fail_together,
);

/// Certificates: a node of another cluster, or one with no certificate at all, is refused by TLS
/// before the cluster handshake even starts.
mod certificates {
    use super::*;

    async fn refused(server: Arc<dyn Transport>, client: Arc<dyn Transport>) {
        let net = Net { server, client };
        let peer = net.serve(ServerConfig::new(SECRET, 1)).await;
        let mut config = ClientConfig::new(SECRET, 2);
        config.connect_timeout = Duration::from_secs(3);
        let (descriptor, payload) = chunk(64, 1, 0);
        let err = net.client(peer.addr(), config).put(&descriptor, &payload).await.unwrap_err();
        assert!(matches!(err, PeerError::Auth(_)), "{err}");
        assert_eq!(count(&peer.stats().authenticated), 0);
        // The client may give up before the server's side of the handshake has failed.
        for _ in 0..200 {
            if count(&peer.stats().refused) >= 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(count(&peer.stats().refused) >= 1);
        assert!(peer.store().is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn quic_refuses_another_clusters_certificate() {
        let ours = ClusterCa::generate("ours").unwrap().issue("server").unwrap();
        let theirs = ClusterCa::generate("theirs").unwrap().issue("client").unwrap();
        refused(Arc::new(QuicTransport::new(&ours).unwrap()), Arc::new(QuicTransport::new(&theirs).unwrap()))
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn quic_refuses_a_client_without_a_certificate() {
        let ca = ClusterCa::generate("ours").unwrap();
        let server = ca.issue("server").unwrap();
        let anonymous = ca.issue("client").unwrap();
        let client =
            QuicTransport::with_client(&anonymous, anonymous.anonymous_client_config().unwrap()).unwrap();
        refused(Arc::new(QuicTransport::new(&server).unwrap()), Arc::new(client)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tls_refuses_another_clusters_certificate() {
        let ours = ClusterCa::generate("ours").unwrap().issue("server").unwrap();
        let theirs = ClusterCa::generate("theirs").unwrap().issue("client").unwrap();
        refused(
            Arc::new(TcpTransport::with_tls(&ours).unwrap()),
            Arc::new(TcpTransport::with_tls(&theirs).unwrap()),
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tls_refuses_a_client_without_a_certificate() {
        let ca = ClusterCa::generate("ours").unwrap();
        let server = ca.issue("server").unwrap();
        let anonymous = ca.issue("client").unwrap();
        let client =
            TcpTransport::with_client_tls(&server, anonymous.anonymous_client_config().unwrap()).unwrap();
        refused(Arc::new(TcpTransport::with_tls(&server).unwrap()), Arc::new(client)).await;
    }
}
