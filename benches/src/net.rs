//! Transport benchmarks: the peer protocol over TCP and QUIC against raw streams moving the same
//! bytes with the same request/acknowledgment pattern.
//!
//! Each case sends `count` messages with at most `window` unacknowledged: the [`messages`] of the
//! case, `2 * window` encoded chunks of `size` payload bytes taken in turn. The peer protocol puts
//! each as a chunk (framed, checksummed, verified and stored by the receiver, its checksum
//! acknowledged); the raw baselines write its bytes and the receiver answers each with one byte.
//!
//! Both move the same memory: the senders send from the same buffers, and the raw receiver reads
//! each message into its own buffer and keeps the last `2 * window` of them, as the peer's store
//! keeps the chunk of each of the `2 * window` keys and reads each new chunk into a buffer freed
//! by an earlier replacement. A raw baseline reusing one buffer at each end would keep its bytes in the L3 cache
//! while the protocol's come from and go to memory. Both keep their connection from run to run,
//! and both send from the runtime's worker threads.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dejavulib::chunk::ChunkDescriptor;
use dejavulib::net::quic::{endpoint_configs, QuicTransport};
use dejavulib::net::tcp::TcpTransport;
use dejavulib::net::tls::{ClusterCa, NodeIdentity, SERVER_NAME};
use dejavulib::net::transport::{ReadHalf, WriteHalf};
use dejavulib::net::{ClientConfig, Duplex, PeerClient, PeerServer, ServerConfig, Transport};
use dejavulib::{DType, HostStore, KvRegion, KvSpec, Packing, WorkerId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
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

/// The messages of `case`: `2 * window` chunks of `payload` (for keys that differ in their
/// microbatch), encoded before any clock starts with their checksums computed once, as a chunk is
/// when it is gathered. Run `i` sends message `i % len`: the keys cycle as a swap space or replica
/// store replaces the chunks of a microbatch each iteration.
pub fn messages(case: Case, payload: &[u8]) -> Arc<Vec<Vec<u8>>> {
    let encode = |m: usize| {
        let descriptor = descriptor(case.size, m as u32);
        [&descriptor.encode_header(payload)[..], payload].concat()
    };
    Arc::new((0..2 * case.window).map(encode).collect())
}

/// A raw stream both ends of which stay open from run to run, as the peer protocol's connection
/// does (a new connection per run would start each run with small windows and buffers), and the
/// receiver's buffers, kept as the peer's store keeps its own.
pub struct RawLink {
    client: Option<(ReadHalf, WriteHalf)>,
    server: Option<Box<dyn Duplex>>,
    kept: Vec<Vec<u8>>,
    /// Endpoints and connections that must live as long as the streams.
    _owners: Vec<Box<dyn std::any::Any + Send>>,
}

impl RawLink {
    /// Raw tokio TCP (TCP_NODELAY), the limit for the TCP transport, receiving messages of `len`
    /// bytes into `buffers` buffers in turn.
    pub async fn tcp(len: usize, buffers: usize) -> Self {
        let listener = tokio::net::TcpListener::bind(any_port()).await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (client, accepted) = tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        let client = client.expect("connect");
        let (server, _) = accepted.expect("accept");
        client.set_nodelay(true).expect("nodelay");
        server.set_nodelay(true).expect("nodelay");
        let (r, w) = client.into_split();
        Self::warmed_up((Box::new(r), Box::new(w)), Box::new(server), len, buffers, vec![]).await
    }

    /// One raw quinn stream with the transport's own TLS and flow-control settings, the limit for
    /// the QUIC transport; receives as [`RawLink::tcp`] does.
    pub async fn quic(len: usize, buffers: usize, ids: &(NodeIdentity, NodeIdentity)) -> Self {
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
            let connection = client
                .connect_with(client_config, addr, SERVER_NAME)
                .expect("dial")
                .await
                .expect("handshake");
            let (mut send, recv) = connection.open_bi().await.expect("stream");
            // The peer learns of a stream from its first byte.
            send.write_all(&[0]).await.expect("preamble");
            (connection, (recv, send))
        };
        let ((client_connection, client_stream), (server_connection, server_stream)) =
            tokio::join!(dialing, accepting);
        let owners: Vec<Box<dyn std::any::Any + Send>> = vec![
            Box::new(server),
            Box::new(client),
            Box::new(client_connection),
            Box::new(server_connection),
        ];
        let client_halves: (ReadHalf, WriteHalf) = (Box::new(client_stream.0), Box::new(client_stream.1));
        Self::warmed_up(client_halves, Box::new(server_stream), len, buffers, owners).await
    }

    /// The link after one untimed message: connected, its receive buffers touched.
    async fn warmed_up(
        client: (ReadHalf, WriteHalf),
        server: Box<dyn Duplex>,
        len: usize,
        buffers: usize,
        owners: Vec<Box<dyn std::any::Any + Send>>,
    ) -> Self {
        // Written once, so no page is first touched while a clock runs.
        let kept = vec![vec![1u8; len]; buffers];
        let mut link = Self { client: Some(client), server: Some(server), kept, _owners: owners };
        let warm_up = Case { name: "warm-up", size: len, count: 1, window: 1 };
        link.run(warm_up, Arc::new(vec![vec![0u8; len]])).await;
        link
    }

    /// Sends `case`'s `messages` in turn, at most `window` unacknowledged, the receiver reading each
    /// into the next of its buffers and answering it with one byte. Returns the time to the last
    /// acknowledgment.
    pub async fn run(&mut self, case: Case, messages: Arc<Vec<Vec<u8>>>) -> Duration {
        let Case { count, window, .. } = case;
        let (mut server, mut kept) =
            (self.server.take().expect("a server end"), std::mem::take(&mut self.kept));
        let sink = tokio::spawn(async move {
            for i in 0..count {
                let n = kept.len();
                server.read_exact(&mut kept[i % n]).await.expect("raw receive");
                server.write_all(&[1]).await.expect("raw ack");
                server.flush().await.expect("raw ack");
            }
            (server, kept)
        });
        // The sender runs on the runtime's workers, as the peer protocol's puts do (they are
        // spawned), not on the thread blocking on the runtime: waking that thread costs more.
        let client = self.client.take().expect("a client end");
        let sender = tokio::spawn(async move {
            let (mut r, mut w) = client;
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
            for i in 0..count {
                room.acquire().await.expect("open").forget();
                w.write_all(&messages[i % messages.len()]).await.expect("raw send");
            }
            w.flush().await.expect("raw flush");
            let r = acks.await.expect("acks");
            (start.elapsed(), (r, w))
        });
        let (elapsed, client) = sender.await.expect("raw sender");
        self.client = Some(client);
        (self.server, self.kept) = sink.await.map(|(s, k)| (Some(s), k)).expect("raw receiver");
        elapsed
    }
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

/// Puts `case`'s [`messages`] through `sender`. The transport sends them as a sidecar forwards
/// what it keeps, without hashing them again; the receiver verifies every byte.
pub async fn peer(case: Case, messages: Arc<Vec<Vec<u8>>>, sender: &PeerClient) -> Duration {
    // Timed on the runtime's workers, as the raw baselines are.
    let sender = sender.clone();
    let timed = tokio::spawn(async move {
        let start = Instant::now();
        let puts: Vec<_> = (0..case.count)
            .map(|i| {
                let (sender, messages) = (sender.clone(), messages.clone());
                tokio::spawn(async move { sender.put_encoded(&messages[i % messages.len()]).await })
            })
            .collect();
        for put in puts {
            put.await.expect("task").expect("put");
        }
        start.elapsed()
    });
    timed.await.expect("the timed puts")
}

/// The order of `n` measurements in run `run`: a shuffle, the same for every report, so that each
/// follows each of the others about as often (a run can slow the one after it).
fn shuffled(n: usize, run: usize) -> Vec<usize> {
    let mut rng = dejavu_proto::rng::SplitMix64::new(run as u64 + 1);
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    order
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
    /// Median time of raw TCP sending one message over and over into one receive buffer, whose
    /// bytes stay in cache where they fit (the memory pattern of earlier builds' baseline, which
    /// was otherwise slower: a new connection per run, a sender on the blocking thread, a locked
    /// split; measured for TCP only).
    pub raw_one_buffer: Option<Duration>,
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
        let messages = messages(case, &noise(case.size));
        let one_message = Arc::new(vec![messages[0].clone()]);
        let (mut tcp_peer, mut tcp_raw, mut quic_peer, mut quic_raw) = (vec![], vec![], vec![], vec![]);
        let mut tcp_raw_one = vec![];
        runtime.block_on(async {
            let (_tcp_server, tcp_sender) = peer_pair(case, &*tcp, tcp.clone()).await;
            let (_quic_server, quic_sender) = peer_pair(case, &quic_server, quic_client.clone()).await;
            // One untimed round each: connections warm, the peers' buffers in steady state.
            peer(case, messages.clone(), &tcp_sender).await;
            peer(case, messages.clone(), &quic_sender).await;
            // As many receive buffers as the peer's store cycles through: one per key, and the
            // one being read into.
            let (len, buffers) = (messages[0].len(), messages.len() + 1);
            let mut tcp_link = RawLink::tcp(len, buffers).await;
            let mut quic_link = RawLink::quic(len, buffers, &ids).await;
            let mut one_buffer_link = RawLink::tcp(len, 1).await;
            // One untimed round each, as the peers had.
            tcp_link.run(case, messages.clone()).await;
            quic_link.run(case, messages.clone()).await;
            one_buffer_link.run(case, one_message.clone()).await;
            for run in 0..runs {
                for measurement in shuffled(5, run) {
                    let m = messages.clone();
                    match measurement {
                        0 => tcp_raw.push(tcp_link.run(case, m).await),
                        1 => tcp_peer.push(peer(case, m, &tcp_sender).await),
                        2 => quic_raw.push(quic_link.run(case, m).await),
                        3 => quic_peer.push(peer(case, m, &quic_sender).await),
                        _ => tcp_raw_one.push(one_buffer_link.run(case, one_message.clone()).await),
                    }
                }
            }
        });
        let (peer, raw, raw_one_buffer) = (median(tcp_peer), median(tcp_raw), Some(median(tcp_raw_one)));
        out.push(Comparison { transport: "tcp", case, peer, raw, raw_one_buffer });
        let (peer, raw) = (median(quic_peer), median(quic_raw));
        out.push(Comparison { transport: "quic", case, peer, raw, raw_one_buffer: None });
    }
    out
}

/// A decode step of `w` flushed to a TCP peer: buffered (one gather, one put) against one put per
/// KV vector (one layer, sequence and head: its K and V), each waiting for its acknowledgment as
/// a copy per piece would. The buffered flush is timed gathering on each of `gather_threads`
/// (the variants take turns, run by run). Returns the buffered times (one per entry of
/// `gather_threads`), the per-vector time and the number of vectors.
pub fn remote_decode_step<const N: usize>(
    w: &crate::Workload,
    runs: usize,
    gather_threads: [usize; N],
) -> ([Duration; N], Duration, u64) {
    use dejavulib::net::PeerStore;
    use dejavulib::ChunkStore;

    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
    let transport: Arc<dyn Transport> = Arc::new(TcpTransport::plain());
    let peer = runtime
        .block_on(PeerServer::bind(&*transport, any_port(), ServerConfig::new(SECRET, 1), HostStore::new()))
        .expect("peer");
    let store =
        PeerStore::new(runtime.handle().clone(), transport, peer.addr(), ClientConfig::new(SECRET, 2));
    // A cell: each variant's closure puts through the one connection.
    let store = std::cell::RefCell::new(store);

    let descriptor = w.descriptor(&w.decode);
    let staging = std::cell::RefCell::new(vec![0u8; w.cache.packed_len(&w.decode) as usize]);
    let mut flushes = gather_threads.map(|threads| {
        let (store, staging, descriptor) = (&store, &staging, &descriptor);
        move || {
            w.cache.set_copy_threads(threads);
            let mut staging = staging.borrow_mut();
            w.cache.gather(&w.decode, w.packing(), &mut staging).expect("gather");
            store.borrow_mut().put(descriptor, &staging).expect("put");
        }
    });
    let buffered = crate::medians_interleaved(runs, flushes.each_mut().map(|f| f as &mut dyn FnMut()));
    w.cache.set_copy_threads(1);
    let mut store = store.into_inner();

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
