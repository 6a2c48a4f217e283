//! Stages as separate processes that pass activations over TCP, and the driver that feeds them.
//!
//! The stages form a chain: the driver sends a step's tokens to stage 0, each stage runs its layers
//! and sends the hidden states on, and the last stage sends the next token back to the driver.
//! Every message is one [`dejavulib::wire`] frame. An `Activation` frame's ids are (microbatch,
//! slot, position, token count); its payload is tokens (`u32`) into stage 0 and out of the last
//! stage, hidden states (`f32`) in between, all little-endian. The driver numbers every frame it
//! sends (the request id) and stages pass headers on unchanged, so each reply is matched to its
//! request exactly.
//!
//! With replication configured, a stage hands the KV it wrote in each step (the prompt's, then each
//! token's) to a background streamer and passes the step on at once (replication is off the
//! critical path and may lag a few steps). The streamer hands every chunk to the stage's own
//! sidecar through shared memory ([`crate::sidecar`]), which keeps it (a local copy: an engine
//! that dies alone restores from it, through shared memory again, without any network transfer)
//! and forwards it to the ring successor's sidecar (a replica: a worker that dies with its sidecar
//! restores from there, over the transport).
//!
//! `Control` frames travel the same chain. Their payload is an operation byte, the index of the
//! stage it is for (`u32`), and an argument; ids name a sequence as (microbatch, slot, prompt
//! length, tokens with KV):
//!
//! - restore (argument: a sidecar address, or none for the stage's own): fetch that sequence's KV
//!   into the cache, in order, as far as the sidecar has it, and copy it into the stage's own
//!   sidecar if it came from elsewhere; the number of tokens restored travels on, and the driver
//!   recomputes the steps after it ([`RemotePipeline::recover`]);
//! - rewire (argument: the new next address): send to another next stage from now on;
//! - replicate to (argument: the successor's new sidecar): have the stage's sidecar forward there
//!   from the stage's next copy on and, unless the sequence is empty, copy its KV so far there (the
//!   old replica died with its sidecar);
//! - load (no argument; ids: microbatch, slot, prompt length): in a token pipeline fed by a prompt
//!   pipeline ([`crate::handoff`]), load the sequence's prompt KV from the stage's own sidecar,
//!   where the prompt stages handed it over, and replicate it as a computed prompt's; the number
//!   of tokens loaded (0 if it could not) travels on;
//! - hand over to (argument: a token stage's index, `u32`, then its sidecar's new address): a prompt
//!   stage hands that token stage's prompt KV to the new sidecar from now on;
//! - replication (argument: one byte, 0 to pause, 1 to resume): the stage stops or starts again
//!   handing the KV of the steps it computes to the streamer (to measure replication's cost within
//!   one run; a prompt loaded from a prompt pipeline is still replicated, and a replacement stage
//!   starts with replication on).
//!
//! Every connection on the chain (driver to stage 0, stage to stage, last stage to driver) opens
//! with a `Hello` frame whose epoch is the one its sender was started in (a replacement's is the
//! epoch of the recovery that started it) and whose sender is the stage's predecessor. A receiver
//! takes a connection with an epoch at least that of the one in use, which it then shuts (a
//! replacement takes over; it connects as soon as it starts), and refuses an older one: a stage
//! presumed dead and replaced, but back from a pause or a partition, cannot take its link back.
//! Its sidecar, taken over by the replacement (a newer epoch on the local socket), has closed its
//! connection too, so none of its KV is kept.
//!
//! Every stage passes a control frame on, so its arrival back at the driver says the operation is
//! done and the chain whole. A stage whose predecessor goes away accepts the next connection (the
//! replacement); a frame it cannot pass on (its successor died) is dropped, and the driver sends it
//! again once the chain is repaired. A frame a stage cannot carry out is reported on its standard
//! error and dropped: the driver's deadline notices.

use std::collections::VecDeque;
use std::io::{BufReader, BufWriter, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::slots::Slot;
use crossbeam_channel::{Receiver, RecvTimeoutError};
use dejavulib::affinity::CpuList;
use dejavulib::chunk::{ChunkDescriptor, ChunkKey};
use dejavulib::local::LocalSidecar;
use dejavulib::net::auth::{client_handshake_blocking, server_handshake_blocking};
use dejavulib::net::{ClientConfig, PeerStore};
use dejavulib::reshard::{install, receive, transfer_key, StreamError};
use dejavulib::store::StoreError;
use dejavulib::streamer::{Completion, StreamJob};
use dejavulib::wire::{read_frame, write_frame, Frame, FrameHeader, Kind, DEFAULT_MAX_PAYLOAD};
use dejavulib::{ChunkStore, KvCache, KvRegion, Streamer, StreamerConfig, Transfer, WorkerId};
use parking_lot::Mutex;
use thiserror::Error;
use tracing::{error, info, warn};

use crate::handoff::{HandoffReceiver, HandoffSender, Shapes};
use crate::metrics::{Exposition, MetricType};
use crate::model::ModelConfig;
use crate::pipeline::{cache_layout, CacheLayout, Seat};
use crate::stage::{Stage, StageError};
use crate::swap::{SwapCaches, SwapStats};
use crate::transport::Transports;

/// Errors of a stage process or the driver.
#[derive(Debug, Error)]
pub enum ProcessError {
    /// The stage's computation failed.
    #[error(transparent)]
    Stage(#[from] StageError),
    /// A socket failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// A malformed frame.
    #[error(transparent)]
    Frame(#[from] dejavulib::wire::FrameError),
    /// A sidecar refused or failed.
    #[error("sidecar: {0}")]
    Sidecar(String),
    /// A message that does not belong in the chain.
    #[error("protocol: {0}")]
    Protocol(String),
    /// No reply within the deadline: a stage is presumed dead.
    #[error("no reply within {0:?}")]
    Timeout(Duration),
}

/// Control operation: restore a sequence's KV from a sidecar.
const OP_RESTORE: u8 = 1;
/// Control operation: send output to another address from now on.
const OP_REWIRE: u8 = 2;
/// Control operation: load a sequence's prompt KV handed over by a prompt pipeline.
const OP_LOAD: u8 = 4;
/// Control operation: a prompt stage hands a token stage's prompts to another sidecar from now on.
const OP_HANDOFF_TO: u8 = 5;
/// Control operation: pause (argument 0) or resume (1) the stage's replication.
const OP_REPLICATION: u8 = 6;
/// Stage index of control frames addressed to no stage (the driver's probes).
const NO_STAGE: u32 = u32::MAX;
/// The driver's node id on the chain: the first stage's predecessor, the last stage's successor.
const DRIVER: u32 = u32::MAX;

/// Where a stage keeps copies of its KV.
#[derive(Clone, Debug)]
pub struct Replication {
    /// Its own sidecar's local socket: the local copy, through shared memory, which the sidecar
    /// forwards to the successor.
    pub local: PathBuf,
    /// Its ring successor's sidecar: the replica.
    pub successor: SocketAddr,
    /// CPUs of the streamer thread (`None`: the process's).
    pub streamer_cpus: Option<CpuList>,
}

/// What one stage process runs.
#[derive(Clone, Debug)]
pub struct StageConfig {
    /// The model.
    pub model: ModelConfig,
    /// Its position in the chain.
    pub index: u32,
    /// Global layers it runs.
    pub layers: Range<u32>,
    /// Its cache layout.
    pub layout: CacheLayout,
    /// Sequences per microbatch.
    pub slots: u32,
    /// Microbatches (one cache each).
    pub microbatches: u32,
    /// Tokens per sequence at most.
    pub max_tokens: u32,
    /// Where to send its output (the next stage, or the driver after the last stage).
    pub next: SocketAddr,
    /// Where to keep copies of its KV, if anywhere.
    pub replication: Option<Replication>,
    /// The epoch it was started in: its hellos and KV copies carry it.
    pub epoch: u64,
    /// The cluster secret: its connections on the chain and to sidecars prove it.
    pub secret: Vec<u8>,
    /// KV caches in "device" memory, if fewer than microbatches: the others are swapped to host
    /// memory ([`crate::swap`]).
    pub device_caches: Option<u32>,
    /// Its part in prompt-token disaggregation, if any.
    pub handoff: Option<Handoff>,
    /// The transport to other sidecars (restores, copies, handoffs).
    pub transport: Transports,
}

/// A stage's part in prompt-token disaggregation ([`crate::handoff`]).
#[derive(Clone, Debug)]
pub enum Handoff {
    /// A prompt stage: hands each prompt's KV it computes over to the token stages' sidecars
    /// (`sidecars`, in token stage order, reached with the cluster secret `secret`).
    Prompt {
        /// Both pipelines' shapes.
        shapes: Shapes,
        /// The token stages' sidecars.
        sidecars: Vec<SocketAddr>,
        /// The cluster secret.
        secret: Vec<u8>,
    },
    /// A token stage: loads prompt KV from its own sidecar when told to (it still computes a
    /// prompt it is sent, as a recovery does).
    Token {
        /// Both pipelines' shapes.
        shapes: Shapes,
    },
}

/// What a stage does with handed-over prompts, running.
enum HandoffEnd {
    Sender(HandoffSender),
    Receiver(HandoffReceiver),
}

/// Time a load waits for prompt KV still on its way from the prompt stages (it was sent while the
/// rest of the prompt pipeline computed: normally it is there).
const LOAD_PATIENCE: Duration = Duration::from_millis(500);

fn tokens_payload(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

fn tokens_of(payload: &[u8]) -> Vec<u32> {
    payload.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

fn floats_of(payload: &[u8]) -> Vec<f32> {
    payload.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

fn floats_payload(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A control frame's payload: operation, target stage, argument.
fn control_payload(op: u8, stage: u32, argument: &[u8]) -> Vec<u8> {
    let mut payload = vec![op];
    payload.extend_from_slice(&stage.to_le_bytes());
    payload.extend_from_slice(argument);
    payload
}

/// Splits a control payload into operation, target stage and argument.
fn parse_control(payload: &[u8]) -> Option<(u8, u32, &[u8])> {
    let (&op, rest) = payload.split_first()?;
    let stage = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?);
    Some((op, stage, &rest[4..]))
}

fn parse_address(bytes: &[u8]) -> Result<Option<SocketAddr>, ProcessError> {
    if bytes.is_empty() {
        return Ok(None);
    }
    let addr = std::str::from_utf8(bytes).ok().and_then(|a| a.parse().ok());
    addr.map(Some).ok_or_else(|| ProcessError::Protocol("a control frame with a bad address".into()))
}

/// Connects to `addr`, retrying for up to `patience` while the peer starts.
fn connect(addr: SocketAddr, patience: Duration) -> std::io::Result<TcpStream> {
    let start = Instant::now();
    loop {
        match TcpStream::connect(addr) {
            Ok(stream) => {
                stream.set_nodelay(true)?;
                return Ok(stream);
            }
            Err(e) if start.elapsed() > patience => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Time a new connection on the chain has to say hello.
const HELLO_PATIENCE: Duration = Duration::from_secs(2);

/// Opens a connection on the chain: proves the cluster secret `secret` (the transports' HMAC
/// handshake), then says who sends and the epoch it was started in.
fn say_hello(stream: &TcpStream, secret: &[u8], sender: u32, epoch: u64) -> Result<(), ProcessError> {
    client_handshake_blocking(stream, secret, sender, HELLO_PATIENCE)
        .map_err(|e| ProcessError::Protocol(format!("handshake on the chain: {e}")))?;
    let mut writer = stream;
    write_frame(&mut writer, &FrameHeader::new(Kind::Hello, sender, epoch, 0), &[])?;
    Ok(writer.flush()?)
}

/// Reads a new connection's proof of the cluster secret `secret` (answering as node `node`) and
/// its hello (and nothing after it); returns its sender and epoch.
fn hear_hello(stream: &TcpStream, secret: &[u8], node: u32) -> Result<(u32, u64), ProcessError> {
    server_handshake_blocking(stream, secret, node, HELLO_PATIENCE)
        .map_err(|e| ProcessError::Protocol(format!("handshake on the chain: {e}")))?;
    stream.set_read_timeout(Some(HELLO_PATIENCE))?;
    let frame = read_frame(&mut &*stream, 0)?
        .ok_or_else(|| ProcessError::Protocol("a connection closed before its hello".into()))?;
    stream.set_read_timeout(None)?;
    match frame.header.kind {
        Kind::Hello => Ok((frame.header.sender, frame.header.epoch)),
        other => Err(ProcessError::Protocol(format!("a connection opened with {other:?}, not a hello"))),
    }
}

/// Accepts a connection on `listener` whose hello comes from `sender` and says epoch `epoch` or
/// newer, waiting at most `patience`; others (fenced processes, strangers) are closed.
fn accept_within(
    listener: &TcpListener,
    sender: u32,
    epoch: u64,
    secret: &[u8],
    patience: Duration,
) -> Result<TcpStream, ProcessError> {
    listener.set_nonblocking(true)?;
    let start = Instant::now();
    let accepted = loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false)?;
                match hear_hello(&stream, secret, DRIVER) {
                    Ok((from, said)) if from == sender && said >= epoch => break Ok(stream),
                    Ok((from, _)) if from != sender => {
                        warn!(from, sender, "refused a connection from another sender")
                    }
                    Ok((_, said)) => warn!(said, epoch, "refused a last stage from an older epoch"),
                    Err(e) => warn!(error = %e, "refused a connection to the driver"),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && start.elapsed() < patience => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                break Err(ProcessError::Timeout(patience))
            }
            Err(e) => break Err(e.into()),
        }
    };
    listener.set_nonblocking(false)?;
    let stream = accepted?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// Whether the peer of `stream`, a connection on which it never sends, has closed or reset it:
/// anything readable there is its end. Checked before a write, so that a frame is not written
/// into a connection that is already gone (the write would succeed and the frame be lost).
fn closed_by_peer(stream: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut byte = 0u8;
    // SAFETY: recv writes at most one byte into `byte`, a live local; the descriptor belongs to
    // `stream`, open for the call; MSG_PEEK leaves the data in place, MSG_DONTWAIT returns at once.
    let n = unsafe {
        libc::recv(stream.as_raw_fd(), (&mut byte as *mut u8).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT)
    };
    // Readable (data, or 0 for its end) means gone; an error other than "nothing yet" too.
    n >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock
}

/// Accepts a stage's input connections from a thread of its own and hands on each one that takes
/// over: one that proves the cluster secret and whose hello comes from its predecessor (the stage
/// before it, or the driver before stage 0) and says an epoch at least that of the connection in
/// use, which is then shut so that the stage's read on it ends. A connection from an older epoch
/// is refused and counted. Each connection's handshake runs on a thread of its own (at most
/// [`MAX_HELLOS`] at once), so one that stalls holds up no other.
fn accept_upstreams(
    listener: TcpListener,
    index: u32,
    secret: Vec<u8>,
    stats: Arc<StageStats>,
) -> Receiver<TcpStream> {
    let predecessor = index.checked_sub(1).unwrap_or(DRIVER);
    let (heard, hellos) = crossbeam_channel::unbounded::<(u64, TcpStream)>();
    std::thread::spawn(move || {
        let pending = Arc::new(AtomicUsize::new(0));
        for stream in listener.incoming() {
            let stream = match stream {
                Ok(stream) => stream,
                Err(_) => {
                    // Out of descriptors, say: wait rather than spin.
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            let Some(slot) = Slot::take(&pending, MAX_HELLOS) else {
                warn!(stage = index, "too many connections saying hello: one closed");
                continue;
            };
            let (secret, heard) = (secret.clone(), heard.clone());
            let spawned = std::thread::Builder::new().name("hello".into()).spawn(move || {
                let _slot = slot;
                match hear_hello(&stream, &secret, index) {
                    Ok((sender, epoch)) if sender == predecessor => {
                        let _ = heard.send((epoch, stream));
                    }
                    Ok((sender, _)) => warn!(
                        stage = index,
                        sender, "refused a connection from a process that is not its predecessor"
                    ),
                    Err(e) => warn!(stage = index, error = %e, "refused a connection"),
                }
            });
            if let Err(e) = spawned {
                warn!(stage = index, error = %e, "cannot hear a connection's hello");
            }
        }
    });
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::spawn(move || {
        let mut in_use: Option<(u64, TcpStream)> = None;
        for (epoch, stream) in hellos {
            if let Some((newest, old)) = &in_use {
                if epoch < *newest {
                    StageStats::add(&stats.stale_connections_refused, 1);
                    warn!(stage = index, epoch, newest, "refused a predecessor from an older epoch");
                    continue;
                }
                let _ = old.shutdown(Shutdown::Both);
                info!(stage = index, epoch, "a predecessor took over the input");
            }
            let Ok(handle) = stream.try_clone() else { continue };
            in_use = Some((epoch, handle));
            if tx.send(stream).is_err() {
                return;
            }
        }
    });
    rx
}

/// Input connections that may be proving the secret and saying hello at once.
const MAX_HELLOS: usize = 16;

/// Counters of a stage process, read by its metrics page.
#[derive(Debug, Default)]
pub struct StageStats {
    /// Steps computed (prompts and tokens).
    pub steps: AtomicU64,
    /// Tokens computed (a prompt counts its length).
    pub tokens: AtomicU64,
    /// Chunks handed to the stage's own sidecar through shared memory, and their payload bytes.
    pub copied_chunks: AtomicU64,
    /// See [`StageStats::copied_chunks`].
    pub copied_bytes: AtomicU64,
    /// Steps whose replication failed (the copies lack them until a replacement recomputes them).
    pub replication_failures: AtomicU64,
    /// Steps handed to the streamer whose replication is not known to be done.
    pub replication_pending: AtomicU64,
    /// Restores carried out, from the stage's own sidecar and from a peer's.
    pub local_restores: AtomicU64,
    /// See [`StageStats::local_restores`].
    pub peer_restores: AtomicU64,
    /// Tokens of KV restored from the stage's own sidecar and from a peer's.
    pub local_restored_tokens: AtomicU64,
    /// See [`StageStats::local_restored_tokens`].
    pub peer_restored_tokens: AtomicU64,
    /// Input connections refused because their hello came from an older epoch than the one in
    /// use (a fenced predecessor trying to come back).
    pub stale_connections_refused: AtomicU64,
    /// A prompt stage's handoffs: chunks of prompt KV stored at token sidecars, their payload
    /// bytes, and chunks that could not be stored.
    pub handed_chunks: AtomicU64,
    /// See [`StageStats::handed_chunks`].
    pub handed_bytes: AtomicU64,
    /// See [`StageStats::handed_chunks`].
    pub handoff_failures: AtomicU64,
    /// A token stage's loads: sequences whose prompt KV it loaded, their payload bytes, and loads
    /// that failed (the driver then has the prompt computed here).
    pub loaded_sequences: AtomicU64,
    /// See [`StageStats::loaded_sequences`].
    pub loaded_bytes: AtomicU64,
    /// See [`StageStats::loaded_sequences`].
    pub load_failures: AtomicU64,
    /// Bytes of the KV caches in "device" memory (fixed at start).
    pub device_bytes: AtomicU64,
    /// Swapping between device caches and host memory.
    pub swap: Arc<SwapStats>,
}

impl StageStats {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// The stage's metrics page.
    pub fn render(&self, stage: u32) -> String {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64;
        let stage = stage.to_string();
        let label = [("stage", stage.as_str())];
        let mut page = Exposition::new();
        let swap = &self.swap;
        let singles = [
            ("dejavu_stage_steps_total", MetricType::Counter, "Steps computed.", &self.steps),
            ("dejavu_stage_tokens_total", MetricType::Counter, "Tokens computed.", &self.tokens),
            (
                "dejavu_stage_replication_failures_total",
                MetricType::Counter,
                "Steps whose KV its sidecar could not keep or forward.",
                &self.replication_failures,
            ),
            (
                "dejavu_stage_copied_chunks_total",
                MetricType::Counter,
                "KV chunks handed to its sidecar through shared memory.",
                &self.copied_chunks,
            ),
            (
                "dejavu_stage_copied_bytes_total",
                MetricType::Counter,
                "KV payload bytes handed to its sidecar through shared memory.",
                &self.copied_bytes,
            ),
            (
                "dejavu_stage_device_kv_bytes",
                MetricType::Gauge,
                "Bytes of the KV caches in device memory.",
                &self.device_bytes,
            ),
            (
                "dejavu_stage_host_kv_bytes",
                MetricType::Gauge,
                "Bytes of KV swapped out to host memory.",
                &swap.host_bytes,
            ),
            ("dejavu_stage_swap_ins_total", MetricType::Counter, "Microbatches swapped in.", &swap.swap_ins),
            ("dejavu_stage_swap_in_bytes_total", MetricType::Counter, "Bytes swapped in.", &swap.bytes_in),
            ("dejavu_stage_swap_outs_total", MetricType::Counter, "Deltas swapped out.", &swap.swap_outs),
            ("dejavu_stage_swap_out_bytes_total", MetricType::Counter, "Bytes swapped out.", &swap.bytes_out),
            (
                "dejavu_stage_stale_connections_refused_total",
                MetricType::Counter,
                "Input connections refused as coming from a fenced predecessor (an older epoch).",
                &self.stale_connections_refused,
            ),
            (
                "dejavu_stage_handoff_chunks_total",
                MetricType::Counter,
                "Chunks of prompt KV handed over to token stages' sidecars.",
                &self.handed_chunks,
            ),
            (
                "dejavu_stage_handoff_bytes_total",
                MetricType::Counter,
                "Bytes of prompt KV handed over to token stages' sidecars.",
                &self.handed_bytes,
            ),
            (
                "dejavu_stage_handoff_failures_total",
                MetricType::Counter,
                "Chunks of prompt KV that could not be handed over.",
                &self.handoff_failures,
            ),
            (
                "dejavu_stage_loaded_sequences_total",
                MetricType::Counter,
                "Sequences whose prompt KV was loaded from a prompt pipeline's handoff.",
                &self.loaded_sequences,
            ),
            (
                "dejavu_stage_loaded_bytes_total",
                MetricType::Counter,
                "Bytes of prompt KV loaded from a prompt pipeline's handoff.",
                &self.loaded_bytes,
            ),
            (
                "dejavu_stage_load_failures_total",
                MetricType::Counter,
                "Loads of handed-over prompt KV that failed.",
                &self.load_failures,
            ),
            (
                "dejavu_stage_replication_lag_steps",
                MetricType::Gauge,
                "Steps whose KV copies are not known to be done.",
                &self.replication_pending,
            ),
        ];
        for (name, kind, help, counter) in singles {
            page.family(name, kind, help).sample(name, &label, get(counter));
        }
        // Counted apart for the stage's own sidecar (local) and another's (peer).
        let split = [
            (
                "dejavu_stage_restores_total",
                "Sequence restores from a sidecar.",
                &self.local_restores,
                &self.peer_restores,
            ),
            (
                "dejavu_stage_restored_tokens_total",
                "Tokens of KV restored from a sidecar.",
                &self.local_restored_tokens,
                &self.peer_restored_tokens,
            ),
        ];
        for (name, help, local, peer) in split {
            page.family(name, MetricType::Counter, help)
                .sample(name, &[("stage", stage.as_str()), ("target", "local")], get(local))
                .sample(name, &[("stage", stage.as_str()), ("target", "peer")], get(peer));
        }
        page.finish()
    }
}

/// A store on a sidecar, used by one writer at a time.
type SharedStore = Arc<Mutex<dyn ChunkStore>>;

/// The stage's own sidecar as the streamer sees it: every chunk crosses shared memory, counted.
struct ToSidecar {
    local: Arc<Mutex<LocalSidecar>>,
    stats: Arc<StageStats>,
    /// Set once the sidecar has closed the connection ([`Sidecars::lost`]).
    lost: Arc<AtomicBool>,
}

impl ToSidecar {
    /// Puts the chunk in the sidecar.
    fn put_now(&mut self, descriptor: &ChunkDescriptor, payload: &[u8]) -> Result<(), StoreError> {
        self.local.lock().put(descriptor, payload)?;
        StageStats::add(&self.stats.copied_chunks, 1);
        StageStats::add(&self.stats.copied_bytes, payload.len() as u64);
        Ok(())
    }
}

impl ChunkStore for ToSidecar {
    fn put(&mut self, descriptor: &ChunkDescriptor, payload: &[u8]) -> Result<(), StoreError> {
        let result = self.put_now(descriptor, payload);
        if result.is_err() && self.local.lock().is_closed() {
            self.lost.store(true, Ordering::Relaxed);
        }
        result
    }

    fn get(&mut self, key: &ChunkKey, out: &mut Vec<u8>) -> Result<ChunkDescriptor, StoreError> {
        self.local.lock().get(key, out)
    }
}

/// The sidecars of a replicating stage: its own, through shared memory, and others over the
/// transport (its successor's, to restore from after a replacement or to copy KV to).
struct Sidecars {
    local: Arc<Mutex<LocalSidecar>>,
    /// Whether the stage's own sidecar closed the connection (it died, a newer engine took its
    /// place, or it dropped the connection after an error). The stage then computes no more
    /// steps, none of which could be kept or copied: the next one it is sent stops the process,
    /// so the controller hears it fall silent and fences it (with its sidecar, if that died), and
    /// the steps to recompute stay as few as the copies in flight.
    lost: Arc<AtomicBool>,
    /// How the stage talks to another sidecar: as its node, in its epoch, over its transport.
    client: ClientConfig,
    transports: Transports,
    /// Stores on other sidecars, kept: a recovery restores or copies one sequence after another
    /// from the same sidecar, over one connection (a QUIC handshake each would add up).
    peers: Mutex<std::collections::HashMap<SocketAddr, Arc<PeerStore>>>,
    runtime: tokio::runtime::Runtime,
}

impl Sidecars {
    fn new(
        replication: &Replication,
        (node, epoch): (u32, u64),
        secret: &[u8],
        transports: Transports,
    ) -> Result<Self, ProcessError> {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let mut client = ClientConfig::new(secret.to_vec(), node);
        client.epoch = epoch;
        // A dead sidecar is given up on quickly: two connection attempts of at most 500 ms.
        client.connect_attempts = 2;
        client.connect_timeout = Duration::from_millis(500);
        let local = LocalSidecar::connect(&replication.local, epoch, replication.successor)
            .map_err(|e| ProcessError::Sidecar(format!("{}: {e}", replication.local.display())))?;
        let peers = Mutex::new(std::collections::HashMap::new());
        let (local, lost) = (Arc::new(Mutex::new(local)), Arc::new(AtomicBool::new(false)));
        Ok(Self { local, lost, client, transports, peers, runtime })
    }

    /// A store on the sidecar at `addr`, over the transport (the same one each time).
    fn peer_store(&self, addr: SocketAddr) -> Result<Arc<PeerStore>, ProcessError> {
        if let Some(store) = self.peers.lock().get(&addr) {
            return Ok(store.clone());
        }
        let transport = self.transports.make().map_err(ProcessError::Sidecar)?;
        let store =
            Arc::new(PeerStore::new(self.runtime.handle().clone(), transport, addr, self.client.clone()));
        self.peers.lock().insert(addr, store.clone());
        Ok(store)
    }
}

/// A running stage: its layers, caches and replication.
struct StageProcess {
    config: StageConfig,
    stage: Stage,
    caches: SwapCaches,
    sidecars: Option<Sidecars>,
    /// Flushes each step's KV to both sidecars in the background.
    streamer: Option<Streamer>,
    /// Replications not known to be done yet, and the cache each reads.
    pending: VecDeque<(Completion, Arc<KvCache>)>,
    /// Steps are not replicated while set ([`RemotePipeline::set_replication`]).
    replication_paused: bool,
    stats: Arc<StageStats>,
    handoff: Option<HandoffEnd>,
}

impl StageProcess {
    fn new(config: StageConfig) -> Result<Self, ProcessError> {
        let stage = Stage::new(config.model, config.layers.clone())?;
        let layout = cache_layout(&stage, config.layout, config.slots, config.max_tokens)?;
        let device_caches =
            config.device_caches.unwrap_or(config.microbatches).clamp(1, config.microbatches.max(1));
        let stats = Arc::new(StageStats::default());
        let bytes: u64 = layout.buffer_sizes().iter().sum();
        stats.device_bytes.store(bytes * device_caches as u64, Ordering::Relaxed);
        let layers = config.layers.len() as u32;
        let region = KvRegion::new(0..layers, 0..config.slots, 0..config.model.kv_heads, 0..0);
        let make = || KvCache::new(layout.clone()).map_err(|e| e.to_string());
        let caches = SwapCaches::new(device_caches, config.index, region, make, stats.swap.clone())
            .map_err(ProcessError::Protocol)?;
        let mut process = Self {
            stage,
            caches,
            sidecars: None,
            streamer: None,
            pending: VecDeque::new(),
            replication_paused: false,
            stats,
            handoff: None,
            config,
        };
        if let Some(replication) = &process.config.replication {
            let transports = process.config.transport.clone();
            let sidecars = Sidecars::new(
                replication,
                (process.config.index, process.config.epoch),
                &process.config.secret,
                transports,
            )?;
            let to_sidecar = ToSidecar {
                local: sidecars.local.clone(),
                stats: process.stats.clone(),
                lost: sidecars.lost.clone(),
            };
            let streamer =
                StreamerConfig { cpus: replication.streamer_cpus.clone(), ..StreamerConfig::default() };
            process.streamer = Some(Streamer::spawn(streamer, Box::new(to_sidecar))?);
            process.sidecars = Some(sidecars);
        }
        let (spec, index, epoch) =
            (process.config.model.kv_spec(), process.config.index, process.config.epoch);
        process.handoff = match &process.config.handoff {
            None => None,
            Some(Handoff::Prompt { shapes, sidecars, secret }) => {
                let c = &process.config;
                shapes
                    .check_stage(true, index, &c.layers, c.slots, c.microbatches)
                    .map_err(ProcessError::Protocol)?;
                if c.device_caches.is_some_and(|d| d < c.microbatches) {
                    // The handoff reads each prompt's cache in the background; swapping would
                    // refill it meanwhile.
                    return Err(ProcessError::Protocol(
                        "a prompt stage keeps every microbatch: no --device-caches".into(),
                    ));
                }
                let transports = &process.config.transport;
                let sender = HandoffSender::new(shapes, spec, (index, epoch), sidecars, secret, transports)
                    .map_err(ProcessError::Protocol)?;
                Some(HandoffEnd::Sender(sender))
            }
            Some(Handoff::Token { shapes }) => {
                let c = &process.config;
                shapes
                    .check_stage(false, index, &c.layers, c.slots, c.microbatches)
                    .map_err(ProcessError::Protocol)?;
                if process.sidecars.is_none() {
                    return Err(ProcessError::Protocol(
                        "a token stage loads prompts from its sidecar: it needs one".into(),
                    ));
                }
                Some(HandoffEnd::Receiver(
                    HandoffReceiver::new(shapes, spec, index).map_err(ProcessError::Protocol)?,
                ))
            }
        };
        Ok(process)
    }

    /// The transfer that names this stage's KV of one sequence (kept under its own worker id).
    fn transfer(&self, seat: Seat) -> Transfer {
        let worker = WorkerId { stage: self.config.index, rank: 0 };
        let layers = self.config.layers.len() as u32;
        let region = KvRegion::new(0..layers, seat.slot..seat.slot + 1, 0..self.config.model.kv_heads, 0..0);
        Transfer::in_place(worker, worker, seat.microbatch, &region)
    }

    /// The cache holding `seat`'s microbatch, swapped in if it was not resident.
    fn cache(&mut self, seat: Seat) -> Result<Arc<KvCache>, ProcessError> {
        if seat.microbatch >= self.config.microbatches || seat.slot >= self.config.slots {
            return Err(ProcessError::Protocol(format!("no sequence {seat:?}")));
        }
        let (pending, stats) = (&mut self.pending, &self.stats);
        let cache = self
            .caches
            .resident(seat.microbatch, &mut |cache, wait| Self::quiesce(pending, stats, cache, wait));
        cache.map_err(|e| ProcessError::Sidecar(format!("swapping in microbatch {}: {e}", seat.microbatch)))
    }

    /// Makes sure the streamer no longer copies out of `cache`, which is about to hold another
    /// microbatch: waits for those copies if `wait`, else only says whether they are done. (The
    /// streamer runs its jobs in order: once the last one that reads the cache is done, so are the
    /// ones before it.)
    fn quiesce(
        pending: &mut VecDeque<(Completion, Arc<KvCache>)>,
        stats: &StageStats,
        cache: &Arc<KvCache>,
        wait: bool,
    ) -> bool {
        let Some(last) = pending.iter().rposition(|(_, reads)| Arc::ptr_eq(reads, cache)) else {
            return true;
        };
        if !wait && !pending[last].0.is_finished() {
            return false;
        }
        for (done, _) in pending.drain(..=last) {
            if done.wait().is_err() {
                StageStats::add(&stats.replication_failures, 1);
            }
        }
        stats.replication_pending.store(pending.len() as u64, Ordering::Relaxed);
        true
    }

    /// After a step of `microbatch` has been passed on: brings the next microbatch in while the
    /// rest of the pipeline computes.
    fn prefetch_after(&mut self, microbatch: u32) {
        let next = (microbatch + 1) % self.config.microbatches.max(1);
        let (pending, stats) = (&mut self.pending, &self.stats);
        if let Err(e) = self
            .caches
            .prefetch(next, microbatch, &mut |cache, wait| Self::quiesce(pending, stats, cache, wait))
        {
            warn!(stage = self.config.index, error = %e, "a prefetch failed");
        }
    }

    /// Whether its own sidecar closed the connection ([`Sidecars::lost`]).
    fn sidecar_lost(&self) -> bool {
        self.sidecars.as_ref().is_some_and(|s| s.lost.load(Ordering::Relaxed))
    }

    /// Runs one step and returns the payload to pass on.
    fn step(&mut self, header: &FrameHeader, payload: &[u8]) -> Result<Vec<u8>, ProcessError> {
        if self.sidecar_lost() {
            return Err(ProcessError::Sidecar(
                "its sidecar closed the connection: the stage stops, to be replaced".into(),
            ));
        }
        let [microbatch, slot, position, count] = header.ids;
        let seat = Seat { microbatch, slot };
        let mut hidden = if self.stage.layers().start == 0 {
            self.stage.embed(&tokens_of(payload))?
        } else {
            floats_of(payload)
        };
        if count == 0 || hidden.len() % count as usize != 0 {
            return Err(ProcessError::Protocol(format!("{} values for {count} tokens", hidden.len())));
        }
        let cache = self.cache(seat)?;
        self.stage.forward(&cache, slot, position, &mut hidden)?;
        self.caches.grew(microbatch, slot, position + count);
        StageStats::add(&self.stats.steps, 1);
        StageStats::add(&self.stats.tokens, count as u64);
        if let Some(HandoffEnd::Sender(sender)) = &mut self.handoff {
            if position == 0 {
                sender.prompt_done(&cache, seat, 0..count).map_err(ProcessError::Sidecar)?;
            }
            let handed = sender.finished();
            StageStats::add(&self.stats.handed_chunks, handed.chunks);
            StageStats::add(&self.stats.handed_bytes, handed.bytes);
            StageStats::add(&self.stats.handoff_failures, handed.failures);
        }
        if !self.replication_paused {
            self.replicate(cache, seat, position..position + count)?;
        }
        Ok(if self.stage.layers().end == self.config.model.layers {
            let d = self.config.model.d_model as usize;
            tokens_payload(&[self.stage.next_token(&hidden[hidden.len() - d..])?])
        } else {
            floats_payload(&hidden)
        })
    }

    /// Hands `tokens` of `seat`'s KV, just written in `cache`, to the streamer (if replicating),
    /// which copies them to the sidecars in the background.
    fn replicate(&mut self, cache: Arc<KvCache>, seat: Seat, tokens: Range<u32>) -> Result<(), ProcessError> {
        let Some(streamer) = &self.streamer else { return Ok(()) };
        let job = StreamJob { cache: cache.clone(), transfer: self.transfer(seat), tokens };
        let done = streamer.submit(job).map_err(|e| ProcessError::Sidecar(e.to_string()))?;
        self.pending.push_back((done, cache));
        // Report failed replications; a replacement recomputes what the copies lack.
        while let Some(done) = self.pending.front().and_then(|(done, _)| done.poll()) {
            self.pending.pop_front();
            if let Err(e) = done {
                StageStats::add(&self.stats.replication_failures, 1);
                warn!(stage = self.config.index, error = %e, "a replication failed");
            }
        }
        self.stats.replication_pending.store(self.pending.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Loads `seat`'s prompt KV, handed over by the prompt pipeline, from the stage's own sidecar,
    /// and replicates it as a computed prompt's; returns the tokens loaded (0 if it could not:
    /// the driver then has the prompt computed here).
    fn load(&mut self, header: &FrameHeader) -> u32 {
        let [microbatch, slot, prompt_len, _] = header.ids;
        let seat = Seat { microbatch, slot };
        let loaded = self.cache(seat).and_then(|cache| {
            let (Some(HandoffEnd::Receiver(receiver)), Some(sidecars)) = (&self.handoff, &self.sidecars)
            else {
                return Err(ProcessError::Protocol("a load for a stage that is not a token stage".into()));
            };
            let source: SharedStore = sidecars.local.clone();
            let bytes = receiver
                .load(&cache, seat, prompt_len, &source, LOAD_PATIENCE)
                .map_err(|e| ProcessError::Sidecar(e.to_string()))?;
            Ok((cache, bytes))
        });
        let (cache, bytes) = match loaded {
            Ok(loaded) => loaded,
            Err(e) => {
                StageStats::add(&self.stats.load_failures, 1);
                warn!(stage = self.config.index, microbatch, slot, error = %e, "could not load a prompt's KV");
                return 0;
            }
        };
        self.caches.grew(microbatch, slot, prompt_len);
        StageStats::add(&self.stats.loaded_sequences, 1);
        StageStats::add(&self.stats.loaded_bytes, bytes);
        if let Err(e) = self.replicate(cache, seat, 0..prompt_len) {
            warn!(stage = self.config.index, error = %e, "could not replicate a loaded prompt");
        }
        prompt_len
    }

    /// Carries out a control frame if it is addressed to this stage; returns the payload to pass on.
    fn control(&mut self, header: &FrameHeader, payload: Vec<u8>) -> Result<Vec<u8>, ProcessError> {
        let (op, stage, argument) = parse_control(&payload)
            .ok_or_else(|| ProcessError::Protocol("a malformed control frame".into()))?;
        if stage != self.config.index {
            return Ok(payload);
        }
        match op {
            OP_RESTORE => {
                let from = parse_address(argument)?;
                let restored = self.restore(header, from);
                Ok(control_payload(OP_RESTORE, stage, &restored.to_le_bytes()))
            }
            OP_LOAD => {
                let loaded = self.load(header);
                Ok(control_payload(OP_LOAD, stage, &loaded.to_le_bytes()))
            }
            OP_HANDOFF_TO => {
                let Some(HandoffEnd::Sender(sender)) = &self.handoff else {
                    return Err(ProcessError::Protocol(
                        "a handoff target for a stage that is not a prompt stage".into(),
                    ));
                };
                let token_stage = argument.get(..4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes);
                let token_stage = token_stage
                    .ok_or_else(|| ProcessError::Protocol("a handoff target without a stage".into()))?;
                let to = parse_address(&argument[4..])?
                    .ok_or_else(|| ProcessError::Protocol("a handoff target without an address".into()))?;
                sender.retarget(token_stage, to).map_err(ProcessError::Protocol)?;
                Ok(payload)
            }
            OP_REWIRE => {
                self.config.next = parse_address(argument)?
                    .ok_or_else(|| ProcessError::Protocol("a rewire without an address".into()))?;
                Ok(payload)
            }
            OP_REPLICATION => {
                self.replication_paused = match argument {
                    [0] => true,
                    [1] => false,
                    _ => return Err(ProcessError::Protocol("replication neither paused nor resumed".into())),
                };
                Ok(payload)
            }
            other => Err(ProcessError::Protocol(format!("unknown control operation {other}"))),
        }
    }

    /// The chunks a sequence's KV is kept in: the prompt's, then one per token.
    fn chunks(prompt_len: u32, kv_tokens: u32) -> impl Iterator<Item = Range<u32>> {
        std::iter::once(0..prompt_len).chain((prompt_len..kv_tokens).map(|t| t..t + 1))
    }

    /// Restores a sequence's KV from the sidecar at `from` (or the stage's own), in order, as far as
    /// it has it; returns the number of tokens restored (0 if not even the prompt, or if the sidecar
    /// cannot be read: the driver then recomputes everything). KV restored from a peer's sidecar
    /// is handed to the stage's own sidecar to keep (not to forward: it came from the replica), so
    /// a later failure of the engine alone finds it there.
    fn restore(&mut self, header: &FrameHeader, from: Option<SocketAddr>) -> u32 {
        let [microbatch, slot, prompt_len, kv_tokens] = header.ids;
        let seat = Seat { microbatch, slot };
        let Ok(cache) = self.cache(seat) else { return 0 };
        let Some(sidecars) = &self.sidecars else { return 0 };
        let transfer = self.transfer(seat);
        let chunks: Vec<Range<u32>> = Self::chunks(prompt_len, kv_tokens).collect();
        let restored = match from {
            Some(addr) => match sidecars.peer_store(addr) {
                Ok(peer) => Self::restore_from_peer(&cache, &transfer, &chunks, &peer, &sidecars.local),
                Err(e) => Err((0, StreamError::Unexpected(e.to_string()))),
            },
            None => Self::restore_from(&cache, &transfer, &chunks, &mut *sidecars.local.lock()),
        };
        let restored = match restored {
            Ok(restored) => restored,
            Err((restored, e)) => {
                warn!(stage = self.config.index, error = %e, "restore stopped");
                restored
            }
        };
        let (restores, tokens) = match from {
            None => (&self.stats.local_restores, &self.stats.local_restored_tokens),
            Some(_) => (&self.stats.peer_restores, &self.stats.peer_restored_tokens),
        };
        StageStats::add(restores, 1);
        StageStats::add(tokens, restored as u64);
        self.caches.grew(microbatch, slot, restored);
        let source = if from.is_some() { "peer" } else { "local" };
        info!(stage = self.config.index, microbatch, slot, restored, source, "restored a sequence's KV");
        restored
    }

    /// Fetches `chunks` of `transfer` from `store` one by one into `cache`, in order, until one is
    /// missing; returns the tokens restored, with the error that stopped it early, if any.
    fn restore_from(
        cache: &KvCache,
        transfer: &Transfer,
        chunks: &[Range<u32>],
        store: &mut dyn ChunkStore,
    ) -> Result<u32, (u32, StreamError)> {
        let mut payload = Vec::new();
        let mut restored = 0;
        for tokens in chunks {
            match receive(cache, transfer, tokens.clone(), store, &mut payload) {
                Ok(_) => restored = tokens.end,
                Err(StreamError::Store(StoreError::NotFound(_))) => break,
                Err(e) => return Err((restored, e)),
            }
        }
        Ok(restored)
    }

    /// As [`StageProcess::restore_from`], from a peer's sidecar with every fetch in flight at once;
    /// what it restores, `local` (the stage's own sidecar) keeps.
    fn restore_from_peer(
        cache: &KvCache,
        transfer: &Transfer,
        chunks: &[Range<u32>],
        store: &PeerStore,
        local: &Mutex<LocalSidecar>,
    ) -> Result<u32, (u32, StreamError)> {
        let keys: Vec<ChunkKey> =
            chunks.iter().map(|tokens| transfer_key(transfer, tokens.clone())).collect();
        let (mut restored, mut kept) = (0, Vec::new());
        let mut stopped = None;
        for (tokens, fetched) in chunks.iter().zip(store.get_many(&keys)) {
            let installed = fetched.map_err(StreamError::from).and_then(|f| {
                install(cache, transfer, tokens.clone(), &f.descriptor, f.payload())?;
                Ok(f)
            });
            match installed {
                Ok(f) => {
                    restored = tokens.end;
                    kept.push(f);
                }
                Err(StreamError::Store(StoreError::NotFound(_))) => break,
                Err(e) => {
                    stopped = Some(e);
                    break;
                }
            }
        }
        let encoded: Vec<&[u8]> = kept.iter().map(|f| f.encoded()).collect();
        if let Err(e) = local.lock().keep(&encoded) {
            warn!(error = %e, "could not hand restored KV to its sidecar");
        }
        stopped.map_or(Ok(restored), |e| Err((restored, e)))
    }
}

/// Runs a stage: listens at `listen` (and serves its metrics at `metrics`, if given), reports the
/// bound addresses through `ready`, then serves one upstream connection at a time (a
/// predecessor's replacement connects after it) until killed.
pub fn serve_stage(
    config: StageConfig,
    listen: SocketAddr,
    metrics: Option<SocketAddr>,
    ready: impl FnOnce(SocketAddr, Option<SocketAddr>),
) -> Result<(), ProcessError> {
    serve_stage_on(config, TcpListener::bind(listen)?, metrics, ready)
}

/// [`serve_stage`] on a listener already bound (a spare's, which it was started with).
pub fn serve_stage_on(
    config: StageConfig,
    listener: TcpListener,
    metrics: Option<SocketAddr>,
    ready: impl FnOnce(SocketAddr, Option<SocketAddr>),
) -> Result<(), ProcessError> {
    let mut process = StageProcess::new(config)?;
    let (index, epoch) = (process.config.index, process.config.epoch);
    let metrics = match metrics {
        Some(at) => {
            let stats = process.stats.clone();
            Some(crate::metrics::serve(at, move || stats.render(index))?)
        }
        None => None,
    };
    let addr = listener.local_addr()?;
    info!(stage = index, epoch, %addr, "stage listening");
    ready(addr, metrics);
    let upstreams = accept_upstreams(listener, index, process.config.secret.clone(), process.stats.clone());
    // Connect to the next stage at once: a replacement takes its successor's input over from the
    // process it replaces before that one could send anything more.
    let secret = process.config.secret.clone();
    let connect_next = |next: SocketAddr, patience: Duration| {
        let stream = connect(next, patience).ok()?;
        say_hello(&stream, &secret, index, epoch).ok()?;
        Some((next, BufWriter::with_capacity(1 << 20, stream)))
    };
    let mut downstream: Option<(SocketAddr, BufWriter<TcpStream>)> =
        connect_next(process.config.next, Duration::from_secs(2));
    while let Ok(upstream) = upstreams.recv() {
        // Connections that took over meanwhile shut the ones before them: the newest counts.
        let upstream = upstreams.try_iter().last().unwrap_or(upstream);
        upstream.set_nodelay(true)?;
        let mut r = BufReader::with_capacity(1 << 20, upstream);
        // A predecessor that goes away (closed, broken or taken over) is replaced by the next
        // connection.
        while let Ok(Some(frame)) = read_frame(&mut r, DEFAULT_MAX_PAYLOAD) {
            let Frame { header, payload } = frame;
            let out = match header.kind {
                Kind::Activation => process.step(&header, &payload),
                Kind::Control => process.control(&header, payload),
                other => Err(ProcessError::Protocol(format!("unexpected {other:?} frame"))),
            };
            let out = match out {
                Ok(out) => out,
                // Without its sidecar it can neither keep nor copy KV: it stops.
                Err(e) if process.sidecar_lost() => {
                    error!(stage = index, error = %e, "the stage stops");
                    return Err(e);
                }
                Err(e) => {
                    warn!(stage = index, error = %e, "dropped a frame");
                    continue;
                }
            };
            let next = process.config.next;
            if downstream.as_ref().is_some_and(|(addr, w)| *addr != next || closed_by_peer(w.get_ref())) {
                downstream = None;
            }
            // A connection that breaks (a reset) is made again and the frame sent once more; if
            // that fails too, the successor is gone and the frame is lost until the driver repairs
            // the chain and sends it again. Connecting is tried once: a successor that refuses is
            // dead, and waiting for it would only hold up the repair.
            for _ in 0..2 {
                if downstream.is_none() {
                    downstream = connect_next(next, Duration::ZERO);
                }
                let Some((_, w)) = downstream.as_mut() else { break };
                if write_frame(w, &header, &out).and_then(|()| w.flush()).is_ok() {
                    break;
                }
                downstream = None;
            }
            if header.kind == Kind::Activation {
                process.prefetch_after(header.ids[0]);
            }
        }
        // Shut the connection, not only this handle on it: the acceptor holds another, and the
        // predecessor must see it end (to connect again after a corrupted frame, say).
        let _ = r.get_ref().shutdown(Shutdown::Both);
    }
    Err(ProcessError::Protocol("the stage stopped accepting connections".into()))
}

/// Frames coming out of the last stage, read whole by a thread of their own (a deadline never
/// leaves half a frame read).
fn read_replies(stream: TcpStream) -> Receiver<Result<Frame, String>> {
    let (tx, rx) = crossbeam_channel::bounded(64);
    std::thread::spawn(move || {
        let mut r = BufReader::new(stream);
        loop {
            let result = match read_frame(&mut r, DEFAULT_MAX_PAYLOAD) {
                Ok(Some(frame)) => Ok(frame),
                Ok(None) => Err("the last stage closed its connection".to_owned()),
                Err(e) => Err(e.to_string()),
            };
            let end = result.is_err();
            if tx.send(result).is_err() || end {
                return;
            }
        }
    });
    rx
}

/// A step's result as the last stage reported it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepReply {
    /// The next token.
    pub token: u32,
    /// The sequence the step ran for.
    pub seat: Seat,
    /// Tokens of the sequence with KV after the step (its position plus its token count).
    pub kv_end: u32,
}

/// Where a replaced stage restores its KV from, as a recovery's controller ordered.
#[derive(Clone, Debug)]
pub struct RestoreSource {
    /// The stage.
    pub stage: u32,
    /// The sidecar holding its KV (`None`: its own).
    pub from: Option<SocketAddr>,
    /// What the controller did and found for it: each sequence's first unreplicated token there.
    pub orders: crate::controller::StageOrders,
}

/// What recovering one sequence took.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SequenceRecovery {
    /// Steps recomputed: what the copy that lacked most did not have.
    pub recomputed: u64,
    /// For each source, in order, the steps its copy lacked (its replication lag).
    pub lacked: Vec<u64>,
}

/// The driver's end of a chain of stage processes.
pub struct RemotePipeline {
    /// Where the first stage is reached.
    first: SocketAddr,
    to_first: BufWriter<TcpStream>,
    results: TcpListener,
    replies: Receiver<Result<Frame, String>>,
    /// Time a step may take.
    deadline: Duration,
    /// Time a control operation may take (restores and copies move whole sequences).
    control_deadline: Duration,
    next_request: u64,
    /// The cluster's epoch: the driver's hellos carry it, and a replacement of the last stage must
    /// say it or a newer one.
    epoch: u64,
    /// The index of the last stage: only it may connect to `results`.
    last_stage: u32,
    /// The epoch the last stage in use was started in: a connection from an older one is refused
    /// (when the same last stage connects again, after a reset, it says the same).
    last_stage_epoch: u64,
    /// The cluster secret, which its connections prove.
    secret: Vec<u8>,
}

impl RemotePipeline {
    /// Connects to the first stage at `first` and takes the last stage's connection on `results`
    /// (stage `last_stage`'s), both proving the cluster secret `secret`; a step slower than
    /// `deadline` is a [`ProcessError::Timeout`].
    pub fn connect(
        first: SocketAddr,
        results: TcpListener,
        last_stage: u32,
        deadline: Duration,
        secret: &[u8],
    ) -> Result<Self, ProcessError> {
        let to_first = Self::connect_first(first, 0, secret, Duration::from_secs(30))?;
        let (_, placeholder) = crossbeam_channel::bounded(0);
        let control_deadline = (deadline * 20).max(Duration::from_secs(10));
        let mut pipeline = Self {
            first,
            to_first,
            results,
            replies: placeholder,
            deadline,
            control_deadline,
            next_request: 1,
            epoch: 0,
            last_stage,
            last_stage_epoch: 0,
            secret: secret.to_vec(),
        };
        // The last stage connects when it first passes something on: send a probe through.
        let request = pipeline.write(Kind::Control, [NO_STAGE; 4], &control_payload(0, NO_STAGE, &[]))?;
        let last = accept_within(&pipeline.results, last_stage, 0, secret, control_deadline)?;
        pipeline.replies = read_replies(last);
        pipeline.reply(request, control_deadline)?;
        Ok(pipeline)
    }

    fn connect_first(
        first: SocketAddr,
        epoch: u64,
        secret: &[u8],
        patience: Duration,
    ) -> Result<BufWriter<TcpStream>, ProcessError> {
        let to_first = connect(first, patience)?;
        say_hello(&to_first, secret, DRIVER, epoch)?;
        Ok(BufWriter::new(to_first))
    }

    /// The epoch it is in: the last recovery's (0: none yet).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Moves to a new epoch (a recovery's): replacements are started in it, and from now on a new
    /// last stage must say it (or a newer one) to be taken.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = self.epoch.max(epoch);
    }

    fn write(&mut self, kind: Kind, ids: [u32; 4], payload: &[u8]) -> Result<u64, ProcessError> {
        let request = self.next_request;
        self.next_request += 1;
        let mut header = FrameHeader::new(kind, u32::MAX, 0, request);
        header.ids = ids;
        let sent = if closed_by_peer(self.to_first.get_ref()) {
            Err(std::io::Error::from(std::io::ErrorKind::ConnectionReset))
        } else {
            write_frame(&mut self.to_first, &header, payload).and_then(|()| self.to_first.flush())
        };
        if sent.is_err() {
            // The connection broke (a reset, or a first stage that went away): connect again,
            // once, and send the frame there.
            self.to_first = Self::connect_first(self.first, self.epoch, &self.secret, self.deadline)?;
            write_frame(&mut self.to_first, &header, payload)?;
            self.to_first.flush()?;
        }
        Ok(request)
    }

    /// The reply to `request`, skipping late replies to earlier requests. When the last stage's
    /// connection breaks (a reset, a corrupted frame), the reply it carried is lost: this returns
    /// at once, and the next wait first takes the connection the last stage makes again as it next
    /// sends something.
    fn reply(&mut self, request: u64, deadline: Duration) -> Result<Frame, ProcessError> {
        let until = Instant::now() + deadline;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match self.replies.recv_timeout(left) {
                Ok(Ok(frame)) if frame.header.request == request => return Ok(frame),
                Ok(Ok(_late)) => continue,
                Err(RecvTimeoutError::Timeout) => return Err(ProcessError::Timeout(deadline)),
                Ok(Err(reason)) => {
                    let (_, closed) = crossbeam_channel::bounded(0);
                    self.replies = closed;
                    return Err(ProcessError::Protocol(reason));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let epoch = self.last_stage_epoch;
                    match accept_within(&self.results, self.last_stage, epoch, &self.secret, left) {
                        Ok(stream) => self.replies = read_replies(stream),
                        Err(ProcessError::Timeout(_)) => return Err(ProcessError::Timeout(deadline)),
                        Err(e) => return Err(e),
                    }
                }
            }
        }
    }

    fn control(
        &mut self,
        op: u8,
        stage: u32,
        ids: [u32; 4],
        argument: &[u8],
    ) -> Result<Vec<u8>, ProcessError> {
        let request = self.write(Kind::Control, ids, &control_payload(op, stage, argument))?;
        Ok(self.reply(request, self.control_deadline)?.payload)
    }

    /// Runs `tokens` at `position` of `seat` through the chain; returns the next token.
    pub fn run(&mut self, seat: Seat, tokens: &[u32], position: u32) -> Result<u32, ProcessError> {
        Ok(self.step(seat, tokens, position)?.token)
    }

    /// Runs `tokens` at `position` of `seat` through the chain; returns the next token with what
    /// the last stage says it computed.
    pub fn step(&mut self, seat: Seat, tokens: &[u32], position: u32) -> Result<StepReply, ProcessError> {
        let ids = [seat.microbatch, seat.slot, position, tokens.len() as u32];
        let request = self.write(Kind::Activation, ids, &tokens_payload(tokens))?;
        let Frame { header, payload } = self.reply(request, self.deadline)?;
        let [microbatch, slot, position, count] = header.ids;
        match tokens_of(&payload)[..] {
            [token] => Ok(StepReply { token, seat: Seat { microbatch, slot }, kv_end: position + count }),
            _ => Err(ProcessError::Protocol("a step's reply is one token".into())),
        }
    }

    /// Tells stage `stage` to restore `seat`'s KV (prompt of `prompt_len`, KV of up to `kv_tokens`
    /// tokens) from the sidecar at `from` (`None`: its own); returns how many tokens it restored.
    pub fn restore(
        &mut self,
        stage: u32,
        seat: Seat,
        prompt_len: u32,
        kv_tokens: u32,
        from: Option<SocketAddr>,
    ) -> Result<u32, ProcessError> {
        let argument = from.map(|a| a.to_string()).unwrap_or_default();
        let ids = [seat.microbatch, seat.slot, prompt_len, kv_tokens];
        let reply = self.control(OP_RESTORE, stage, ids, argument.as_bytes())?;
        match parse_control(&reply) {
            Some((OP_RESTORE, s, count)) if s == stage && count.len() == 4 => {
                Ok(u32::from_le_bytes(count.try_into().expect("4 bytes")))
            }
            _ => Err(ProcessError::Protocol(format!("stage {stage} did not report a restore"))),
        }
    }

    /// Tells each of the first `stages` stages to load `seat`'s prompt KV (`prompt_len` tokens),
    /// handed over by a prompt pipeline; returns the fewest tokens a stage loaded (0: some stage
    /// could not, and the prompt must be computed here).
    pub fn load(&mut self, stages: u32, seat: Seat, prompt_len: u32) -> Result<u32, ProcessError> {
        let ids = [seat.microbatch, seat.slot, prompt_len, 0];
        // All sent at once: the loads run one after another down the chain, not one round trip each.
        let requests = (0..stages)
            .map(|stage| Ok((stage, self.write(Kind::Control, ids, &control_payload(OP_LOAD, stage, &[]))?)))
            .collect::<Result<Vec<_>, ProcessError>>()?;
        // A step's time, and each stage's patience for chunks on their way.
        let deadline = self.deadline + LOAD_PATIENCE * stages;
        let mut fewest = prompt_len;
        for (stage, request) in requests {
            let reply = self.reply(request, deadline)?.payload;
            match parse_control(&reply) {
                Some((OP_LOAD, s, count)) if s == stage && count.len() == 4 => {
                    fewest = fewest.min(u32::from_le_bytes(count.try_into().expect("4 bytes")));
                }
                _ => return Err(ProcessError::Protocol(format!("stage {stage} did not report a load"))),
            }
        }
        Ok(fewest)
    }

    /// Tells prompt stage `stage` to hand token stage `token_stage`'s prompts to the sidecar at
    /// `to` from now on.
    pub fn handoff_to(&mut self, stage: u32, token_stage: u32, to: SocketAddr) -> Result<(), ProcessError> {
        let mut argument = token_stage.to_le_bytes().to_vec();
        argument.extend_from_slice(to.to_string().as_bytes());
        let payload = control_payload(OP_HANDOFF_TO, stage, &argument);
        let request = self.write(Kind::Control, [NO_STAGE; 4], &payload)?;
        // Nothing to move: a step's deadline, so that a dead prompt pipeline does not hold the
        // token pipeline's recovery up for a control operation's.
        self.reply(request, self.deadline)?;
        Ok(())
    }

    /// Pauses (`on` false) or resumes stage `stage`'s replication of the steps it computes (a
    /// prompt loaded from a prompt pipeline is still replicated; a replacement starts with
    /// replication on). A step computed while paused is not in the stage's copies: a recovery
    /// restores a sequence up to its first such step and recomputes the rest. While paused, the
    /// stage does not look at its earlier copies' completions either, so its pending-copies
    /// metric and failures are counted once it resumes. For measuring what replication costs,
    /// in one run ([`crate::cluster::Cluster::set_replication`]).
    pub fn set_replication(&mut self, stage: u32, on: bool) -> Result<(), ProcessError> {
        self.control(OP_REPLICATION, stage, [NO_STAGE; 4], &[u8::from(on)])?;
        Ok(())
    }

    /// Recovers one sequence on replaced stages: restores each stage's KV from the sidecar its
    /// source names, up to the source's mark for the sequence if the controller found one (its
    /// first unreplicated token), then recomputes the steps the copies lacked (the replication
    /// lag; recomputing a step rewrites the same KV everywhere), checking that they give the
    /// tokens already generated.
    pub fn recover(
        &mut self,
        sources: &[RestoreSource],
        seat: Seat,
        prompt: &[u32],
        generated: &[u32],
    ) -> Result<SequenceRecovery, ProcessError> {
        let mut recovery = SequenceRecovery { recomputed: 0, lacked: vec![0; sources.len()] };
        if generated.is_empty() {
            return Ok(recovery);
        }
        let prompt_len = prompt.len() as u32;
        // KV exists for the prompt and every generated token but the last.
        let needed = prompt_len + generated.len() as u32 - 1;
        // Steps that rebuild KV up to `needed` from `restored` tokens (the prompt is one step).
        let steps_from = |restored: u32| {
            if restored < prompt_len {
                1 + u64::from(needed - prompt_len)
            } else {
                u64::from(needed - restored)
            }
        };
        let mut restored = needed;
        for (i, source) in sources.iter().enumerate() {
            let mark = source.orders.mark_of(seat.microbatch, seat.slot);
            let wanted = mark.map_or(needed, |mark| mark.min(needed));
            let this = self.restore(source.stage, seat, prompt_len, wanted, source.from)?;
            if mark.is_some() && this != wanted {
                // The copy changed since the controller looked: what was restored counts.
                warn!(stage = source.stage, ?seat, wanted, restored = this, "restored other than the mark");
            }
            recovery.lacked[i] = steps_from(this);
            restored = restored.min(this);
        }
        let mismatch = |position| {
            ProcessError::Protocol(format!("a recomputed step at position {position} gave another token"))
        };
        if restored < prompt_len {
            if self.run(seat, prompt, 0)? != generated[0] {
                return Err(mismatch(0));
            }
            restored = prompt_len;
            recovery.recomputed += 1;
        }
        for position in restored..needed {
            let index = (position - prompt_len) as usize;
            if self.run(seat, &[generated[index]], position)? != generated[index + 1] {
                return Err(mismatch(position));
            }
            recovery.recomputed += 1;
        }
        Ok(recovery)
    }

    /// Repairs the chain after stage `stage` was replaced by a process listening at `addr`: its
    /// predecessor sends there from now on (or, for the first stage, the driver does; for the last,
    /// the driver takes the replacement's connection). Returns once a frame has gone all the way
    /// round.
    pub fn replace(&mut self, stage: u32, addr: SocketAddr, last: bool) -> Result<(), ProcessError> {
        self.replace_all(&[(stage, addr)], last)
    }

    /// Repairs the chain after several stages were replaced at once (`replaced`: each stage and
    /// its replacement's address, `last_replaced`: whether the last stage is among them), in the
    /// only order that works: the driver connects to a new first stage, then each rewire travels
    /// the chain, then the driver takes a new last stage's connection, then every reply is awaited.
    pub fn replace_all(
        &mut self,
        replaced: &[(u32, SocketAddr)],
        last_replaced: bool,
    ) -> Result<(), ProcessError> {
        let mut requests = Vec::new();
        if let Some(&(_, addr)) = replaced.iter().find(|(stage, _)| *stage == 0) {
            self.to_first = Self::connect_first(addr, self.epoch, &self.secret, Duration::from_secs(30))?;
            self.first = addr;
        }
        // Each rewire takes effect at its stage before it is passed on, so it goes round the
        // repaired chain; a probe sent before the rewires would be lost at a stale link.
        for &(stage, addr) in replaced.iter().filter(|(stage, _)| *stage != 0) {
            let payload = control_payload(OP_REWIRE, stage - 1, addr.to_string().as_bytes());
            requests.push(self.write(Kind::Control, [NO_STAGE; 4], &payload)?);
        }
        if requests.is_empty() {
            // Only the first stage was replaced: a probe addressed to no stage proves the chain.
            requests.push(self.write(Kind::Control, [NO_STAGE; 4], &control_payload(0, NO_STAGE, &[]))?);
        }
        if last_replaced {
            let last = accept_within(
                &self.results,
                self.last_stage,
                self.epoch,
                &self.secret,
                self.control_deadline,
            )?;
            self.replies = read_replies(last);
            self.last_stage_epoch = self.epoch;
        }
        for request in requests {
            self.reply(request, self.control_deadline)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;

    const SECRET: &[u8] = b"test cluster";

    fn hello(addr: SocketAddr, epoch: u64) -> TcpStream {
        let stream = TcpStream::connect(addr).unwrap();
        say_hello(&stream, SECRET, 1, epoch).unwrap();
        stream
    }

    /// Whether the stage side closed `stream`: a read ends (at its end, or reset) rather than
    /// timing out.
    fn closed(stream: &mut TcpStream) -> bool {
        stream.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        match stream.read(&mut [0u8; 1]) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
        }
    }

    #[test]
    fn a_newer_predecessor_takes_over_and_an_older_one_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stats = Arc::new(StageStats::default());
        let upstreams = accept_upstreams(listener, 2, SECRET.to_vec(), stats.clone());
        let wait = || upstreams.recv_timeout(Duration::from_secs(5));

        let mut first = hello(addr, 3);
        wait().expect("the first predecessor is taken");
        // One from an older epoch (a fenced predecessor back from a pause) is refused and closed,
        // and the one in use stays.
        let mut stale = hello(addr, 2);
        assert!(closed(&mut stale));
        assert_eq!(stats.stale_connections_refused.load(Ordering::Relaxed), 1);
        assert!(upstreams.recv_timeout(Duration::from_millis(200)).is_err());
        assert!(!closed(&mut first), "the connection in use is untouched");
        // So is one from a process that is not its predecessor, whatever its epoch.
        let mut stranger = TcpStream::connect(addr).unwrap();
        say_hello(&stranger, SECRET, 5, 9).unwrap();
        assert!(closed(&mut stranger));
        // And one that cannot prove the cluster secret never gets to say hello; it stays open,
        // unanswered, without holding up the connections after it.
        let outsider = TcpStream::connect(addr).unwrap();
        assert!(say_hello(&outsider, b"another cluster", 1, 9).is_err());
        assert!(upstreams.recv_timeout(Duration::from_millis(200)).is_err());
        // A connection that does not say hello is refused too.
        let mut rude = TcpStream::connect(addr).unwrap();
        rude.write_all(format!("GET / HTTP/1.1\r\nHost: {}\r\n\r\n", "x".repeat(80)).as_bytes()).unwrap();
        assert!(closed(&mut rude));
        // The same epoch again (a reconnection after a reset) or a newer one (a replacement)
        // takes over, and the one before is shut.
        let _again = hello(addr, 3);
        wait().expect("a reconnection is taken");
        assert!(closed(&mut first));
        let _replacement = hello(addr, 4);
        wait().expect("a replacement is taken");
        assert_eq!(stats.stale_connections_refused.load(Ordering::Relaxed), 1);
    }
}
