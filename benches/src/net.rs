//! Transport benchmarks: the peer protocol over TCP and QUIC against raw streams moving the same
//! bytes with the same request/acknowledgment pattern.
//!
//! Each case sends `count` messages of `size` bytes with at most `window` unacknowledged. The raw
//! baselines write the bytes and the receiver answers each message with one byte; the peer protocol
//! puts each message as a chunk (framed, checksummed, verified and stored by the receiver, its
//! checksum acknowledged).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dejavulib::chunk::ChunkDescriptor;
use dejavulib::net::quic::{endpoint_configs, QuicTransport};
use dejavulib::net::tcp::TcpTransport;
use dejavulib::net::tls::{ClusterCa, NodeIdentity, SERVER_NAME};
use dejavulib::net::{ClientConfig, PeerClient, PeerServer, ServerConfig, Transport};
use dejavulib::{DType, HostStore, KvRegion, KvSpec, Packing, WorkerId};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::Semaphore;

const SECRET: &[u8] = b"bench cluster secret";

/// One transfer pattern.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    /// What it stands for.
    pub name: &'static str,
    /// Bytes per message.
    pub size: usize,
    /// Messages per run.
    pub count: usize,
    /// Messages in flight at most.
    pub window: usize,
}

/// 1 MiB and 64 MiB chunks, and a replication-like stream of 6.5 MB per-step deltas (a 13B-class
/// model at batch 8: 40 layers x 8 sequences x 40 heads x 128 x K and V x 2 bytes).
pub const CASES: [Case; 3] = [
    Case { name: "1 MiB chunks", size: 1 << 20, count: 128, window: 4 },
    Case { name: "64 MiB chunks", size: 64 << 20, count: 4, window: 2 },
    Case { name: "6.5 MB step deltas", size: 6_553_600, count: 32, window: 4 },
];

/// A chunk descriptor whose payload is `size` bytes (int8, one layer and head of dimension 1: a
/// token is 2 bytes of K and V).
pub fn descriptor(size: usize, microbatch: u32) -> ChunkDescriptor {
    let spec = KvSpec::new(1, 1, 1, DType::Int8).expect("a valid spec");
    ChunkDescriptor {
        source: WorkerId { stage: 0, rank: 0 },
        destination: WorkerId { stage: 1, rank: 0 },
        microbatch,
        region: KvRegion::new(0..1, 0..1, 0..1, 0..(size / 2) as u32),
        spec,
        packing: Packing::token_major(&spec),
    }
}

/// Noise, so no layer can cheat on zeros.
pub fn noise(len: usize) -> Vec<u8> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// Certificates for a server and a client of one bench cluster.
pub fn identities() -> (NodeIdentity, NodeIdentity) {
    let ca = ClusterCa::generate("bench").expect("a CA");
    (ca.issue("server").expect("a certificate"), ca.issue("client").expect("a certificate"))
}

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().expect("an address")
}

/// Sends `case` over a connected raw stream pair and returns the time to the last acknowledgment.
async fn raw_run<C, S>(client: C, server: S, case: Case, payload: Arc<Vec<u8>>) -> Duration
where
    C: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let Case { size, count, window, .. } = case;
    let sink = tokio::spawn(async move {
        let (mut r, mut w) = tokio::io::split(server);
        let mut buf = vec![0u8; size];
        // One more message than timed: the first warms the connection up, as the peer's ping does.
        for _ in 0..=count {
            r.read_exact(&mut buf).await.expect("raw receive");
            w.write_all(&[1]).await.expect("raw ack");
            w.flush().await.expect("raw ack");
        }
        // Keep the stream open until the sender has read the last acknowledgment.
        let _ = r.read(&mut [0u8; 1]).await;
    });
    let (mut r, mut w) = tokio::io::split(client);
    w.write_all(&payload).await.expect("raw warm-up");
    r.read_exact(&mut [0u8; 1]).await.expect("raw warm-up ack");
    let room = Arc::new(Semaphore::new(window));
    let start = Instant::now();
    let acks = {
        let room = room.clone();
        tokio::spawn(async move {
            for _ in 0..count {
                r.read_exact(&mut [0u8; 1]).await.expect("raw ack");
                room.add_permits(1);
            }
            r
        })
    };
    for _ in 0..count {
        room.acquire().await.expect("open").forget();
        w.write_all(&payload).await.expect("raw send");
    }
    w.flush().await.expect("raw flush");
    let r = acks.await.expect("acks");
    let elapsed = start.elapsed();
    let mut stream = r.unsplit(w);
    let _ = stream.shutdown().await;
    drop(stream);
    let _ = sink.await;
    elapsed
}

/// Raw tokio TCP (TCP_NODELAY), the limit for the TCP transport.
pub async fn raw_tcp(case: Case, payload: Arc<Vec<u8>>) -> Duration {
    let listener = tokio::net::TcpListener::bind(any_port()).await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (client, accepted) = tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
    let client = client.expect("connect");
    let (server, _) = accepted.expect("accept");
    client.set_nodelay(true).expect("nodelay");
    server.set_nodelay(true).expect("nodelay");
    raw_run(client, server, case, payload).await
}

/// One raw quinn stream with the transport's own TLS and flow-control settings, the limit for the
/// QUIC transport.
pub async fn raw_quic(case: Case, payload: Arc<Vec<u8>>, ids: &(NodeIdentity, NodeIdentity)) -> Duration {
    let (server_config, _) = endpoint_configs(&ids.0, ids.0.client_config().expect("tls")).expect("quic");
    let (_, client_config) = endpoint_configs(&ids.1, ids.1.client_config().expect("tls")).expect("quic");
    let server = quinn::Endpoint::server(server_config, any_port()).expect("endpoint");
    let addr = server.local_addr().expect("addr");
    let client = quinn::Endpoint::client(any_port()).expect("endpoint");
    let accepting = async {
        let connection = server.accept().await.expect("incoming").await.expect("handshake");
        let (send, mut recv) = connection.accept_bi().await.expect("stream");
        recv.read_exact(&mut [0u8; 1]).await.expect("preamble");
        (connection, tokio::io::join(recv, send))
    };
    let dialing = async {
        let connection =
            client.connect_with(client_config, addr, SERVER_NAME).expect("dial").await.expect("handshake");
        let (mut send, recv) = connection.open_bi().await.expect("stream");
        // The peer learns of a stream from its first byte.
        send.write_all(&[0]).await.expect("preamble");
        (connection, send, recv)
    };
    let ((_client_connection, send, recv), (_server_connection, server_stream)) =
        tokio::join!(dialing, accepting);
    let elapsed = raw_run(tokio::io::join(recv, send), server_stream, case, payload).await;
    server.close(0u32.into(), b"done");
    client.close(0u32.into(), b"done");
    elapsed
}

/// A peer and a client of it over `server`/`client` transports, with room for `case`'s window.
pub async fn peer_pair(
    case: Case,
    server: &dyn Transport,
    client: Arc<dyn Transport>,
) -> (PeerServer, PeerClient) {
    let peer = PeerServer::bind(server, any_port(), ServerConfig::new(SECRET, 1), HostStore::new())
        .await
        .expect("peer");
    let mut config = ClientConfig::new(SECRET, 2);
    config.max_put_bytes_in_flight = (case.window * case.size) as u64;
    config.request_timeout = Duration::from_secs(60);
    let sender = PeerClient::new(client, peer.addr(), config);
    sender.ping().await.expect("connect");
    (peer, sender)
}

/// Puts `case` through `sender`. Keys cycle through twice the window, as a swap space or replica
/// store replaces the chunks of a microbatch each iteration, so the peer reuses replaced buffers.
///
/// The chunks are encoded before the clock starts, their checksums computed once, as a chunk is
/// when it is made (gathered); the transport sends them as a sidecar forwards what it keeps,
/// without hashing them again, and the receiver verifies every byte.
pub async fn peer(case: Case, payload: Arc<Vec<u8>>, sender: &PeerClient) -> Duration {
    let encoded: Vec<Arc<Vec<u8>>> = (0..2 * case.window)
        .map(|m| {
            let descriptor = descriptor(case.size, m as u32);
            Arc::new([&descriptor.encode_header(&payload)[..], &payload[..]].concat())
        })
        .collect();
    let start = Instant::now();
    let puts: Vec<_> = (0..case.count)
        .map(|i| {
            let (sender, chunk) = (sender.clone(), encoded[i % encoded.len()].clone());
            tokio::spawn(async move { sender.put_encoded(&chunk).await })
        })
        .collect();
    for put in puts {
        put.await.expect("task").expect("put");
    }
    start.elapsed()
}

/// One measurement: the peer protocol and its raw baseline, medians of `runs` interleaved runs.
pub struct Comparison {
    /// The transport measured.
    pub transport: &'static str,
    /// The case.
    pub case: Case,
    /// Median time of the peer protocol.
    pub peer: Duration,
    /// Median time of the raw baseline.
    pub raw: Duration,
}

impl Comparison {
    /// Bytes moved per run.
    pub fn bytes(&self) -> u64 {
        (self.case.size * self.case.count) as u64
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Runs every case over TCP and QUIC against raw tokio TCP and a raw quinn stream.
pub fn compare_transports(runs: usize) -> Vec<Comparison> {
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
    let ids = identities();
    let tcp: Arc<dyn Transport> = Arc::new(TcpTransport::plain());
    let quic_server = QuicTransport::new(&ids.0).expect("quic");
    let quic_client: Arc<dyn Transport> = Arc::new(QuicTransport::new(&ids.1).expect("quic"));
    let mut out = Vec::new();
    for case in CASES {
        let payload = Arc::new(noise(case.size));
        let (mut tcp_peer, mut tcp_raw, mut quic_peer, mut quic_raw) = (vec![], vec![], vec![], vec![]);
        runtime.block_on(async {
            let (_tcp_server, tcp_sender) = peer_pair(case, &*tcp, tcp.clone()).await;
            let (_quic_server, quic_sender) = peer_pair(case, &quic_server, quic_client.clone()).await;
            // One untimed round each: connections warm, the peers' buffers in steady state.
            peer(case, payload.clone(), &tcp_sender).await;
            peer(case, payload.clone(), &quic_sender).await;
            for _ in 0..runs {
                tcp_raw.push(raw_tcp(case, payload.clone()).await);
                tcp_peer.push(peer(case, payload.clone(), &tcp_sender).await);
                quic_raw.push(raw_quic(case, payload.clone(), &ids).await);
                quic_peer.push(peer(case, payload.clone(), &quic_sender).await);
            }
        });
        out.push(Comparison { transport: "tcp", case, peer: median(tcp_peer), raw: median(tcp_raw) });
        out.push(Comparison { transport: "quic", case, peer: median(quic_peer), raw: median(quic_raw) });
    }
    out
}

/// A decode step of `w` flushed to a TCP peer: buffered (one gather, one put) against one put per
/// KV vector (one layer, sequence and head: its K and V), each waiting for its acknowledgment as
/// a copy per piece would. Returns the buffered time, the per-vector time and the number of vectors.
pub fn remote_decode_step(w: &crate::Workload, runs: usize) -> (Duration, Duration, u64) {
    use dejavulib::net::PeerStore;
    use dejavulib::ChunkStore;

    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
    let transport: Arc<dyn Transport> = Arc::new(TcpTransport::plain());
    let peer = runtime
        .block_on(PeerServer::bind(&*transport, any_port(), ServerConfig::new(SECRET, 1), HostStore::new()))
        .expect("peer");
    let mut store =
        PeerStore::new(runtime.handle().clone(), transport, peer.addr(), ClientConfig::new(SECRET, 2));

    let descriptor = w.descriptor(&w.decode);
    let mut staging = vec![0u8; w.cache.packed_len(&w.decode) as usize];
    let buffered = crate::median_of(runs, || {
        w.cache.gather(&w.decode, w.packing(), &mut staging).expect("gather");
        store.put(&descriptor, &staging).expect("put");
    });

    let mut vectors = Vec::new();
    let d = &w.decode;
    for layer in d.layers.clone() {
        for slot in d.slots.clone() {
            for head in d.heads.clone() {
                vectors.push(KvRegion::new(
                    layer..layer + 1,
                    slot..slot + 1,
                    head..head + 1,
                    d.tokens.clone(),
                ));
            }
        }
    }
    let mut piece = vec![0u8; w.cache.packed_len(&vectors[0]) as usize];
    let per_vector = crate::median_of(runs, || {
        for region in &vectors {
            w.cache.gather(region, w.packing(), &mut piece).expect("gather");
            store.put(&w.descriptor(region), &piece).expect("put");
        }
    });
    (buffered, per_vector, vectors.len() as u64)
}
