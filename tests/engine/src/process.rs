//! Stages as separate processes that pass activations over TCP, and the driver that feeds them.
//!
//! The stages form a chain: the driver sends a step's tokens to stage 0, each stage runs its layers
//! and sends the hidden states on, and the last stage sends the next token back to the driver.
//! Every message is one [`dejavulib::wire`] frame of kind `Activation` whose ids are (microbatch,
//! slot, position, token count); the payload is tokens (`u32`) into stage 0 and out of the last
//! stage, hidden states (`f32`) in between, all little-endian.
//!
//! With replication configured, a stage hands the KV it wrote in each step (the prompt's, then each
//! token's) to a background streamer and passes the step on at once (replication is off the
//! critical path and may lag a few steps). The streamer flushes every chunk twice: to the stage's
//! own sidecar (a local copy: an engine that dies alone restores from it without the network) and
//! to its ring successor's sidecar (a replica: a worker that dies with its sidecar restores from
//! there). `Control` frames travel the same chain; the request id names the stage they are for, the
//! first payload byte the operation:
//!
//! - restore (ids: microbatch, slot, prompt length, tokens with KV; payload: a peer address, or
//!   none for the stage's own sidecar): fetch that sequence's KV into the cache, in order, as far as
//!   the peer has it; the number of tokens restored travels on in the payload, and the driver
//!   recomputes the steps after it ([`RemotePipeline::recover`]);
//! - rewire (payload: the new next address): send to another next stage from now on (its successor
//!   was replaced);
//! - replicate to (ids as for restore; payload: the successor's new sidecar): replicate there from
//!   now on, and flush that sequence's KV so far to it (the replica died with its sidecar).
//!
//! Every stage passes a control frame on, so its arrival back at the driver says the chain is whole
//! and the operation done. A stage whose predecessor goes away accepts the next connection (its
//! predecessor's replacement); a frame it cannot pass on (its successor died) is dropped, and the
//! driver sends the step again once the chain is repaired.

use std::collections::VecDeque;
use std::io::{BufReader, BufWriter, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dejavulib::chunk::{ChunkDescriptor, ChunkKey};
use dejavulib::net::tcp::TcpTransport;
use dejavulib::net::{ClientConfig, PeerStore};
use dejavulib::reshard::{receive, send, LocalRegion, StreamError};
use dejavulib::store::StoreError;
use dejavulib::streamer::{Completion, StreamJob};
use dejavulib::wire::{read_frame, write_frame, FrameHeader, Kind, DEFAULT_MAX_PAYLOAD};
use dejavulib::{ChunkStore, KvCache, Streamer, StreamerConfig, Transfer, WorkerId};
use thiserror::Error;

use crate::model::ModelConfig;
use crate::pipeline::{cache_layout, CacheLayout, Seat};
use crate::stage::{Stage, StageError};

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
    /// The replica peer refused or failed.
    #[error("replica: {0}")]
    Replica(String),
    /// A message that does not belong in the chain.
    #[error("protocol: {0}")]
    Protocol(String),
    /// No reply within the driver's deadline: a stage is presumed dead.
    #[error("no reply within {0:?}")]
    Timeout(Duration),
}

/// Control operation: restore a sequence's KV from the replica peer.
const OP_RESTORE: u8 = 1;
/// Control operation: send output to another address from now on.
const OP_REWIRE: u8 = 2;
/// Control operation: replicate to another successor sidecar, starting with a sequence's KV so far.
const OP_REPLICATE_TO: u8 = 3;

/// Where a stage keeps copies of its KV.
#[derive(Clone, Debug)]
pub struct Replication {
    /// Its own sidecar: the local copy.
    pub local: SocketAddr,
    /// Its ring successor's sidecar: the replica.
    pub successor: SocketAddr,
    /// The cluster secret.
    pub secret: Vec<u8>,
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
}

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

/// A store on a peer, shared by the streamer thread and the stage (which swaps it for another
/// peer when the successor's sidecar is replaced).
type SharedPeer = Arc<parking_lot::Mutex<PeerStore>>;

/// Flushes each chunk to the local sidecar and to the successor's sidecar.
struct Tee {
    local: SharedPeer,
    successor: SharedPeer,
}

impl ChunkStore for Tee {
    fn put(&mut self, descriptor: &ChunkDescriptor, payload: &[u8]) -> Result<(), StoreError> {
        self.local.lock().put(descriptor, payload)?;
        self.successor.lock().put(descriptor, payload)
    }

    fn get(&mut self, key: &ChunkKey, out: &mut Vec<u8>) -> Result<ChunkDescriptor, StoreError> {
        self.local.lock().get(key, out)
    }
}

/// A running stage: its layers, caches and replication.
struct StageProcess {
    config: StageConfig,
    stage: Stage,
    caches: Vec<Arc<KvCache>>,
    /// Its own sidecar and its successor's, when replicating.
    peers: Option<(SharedPeer, SharedPeer)>,
    /// Flushes each step's KV to both sidecars in the background.
    streamer: Option<Streamer>,
    /// Replications not known to be done yet.
    pending: VecDeque<Completion>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl StageProcess {
    fn new(config: StageConfig) -> Result<Self, ProcessError> {
        let stage = Stage::new(config.model, config.layers.clone())?;
        let caches = (0..config.microbatches)
            .map(|_| {
                Ok(Arc::new(
                    KvCache::new(cache_layout(&stage, config.layout, config.slots, config.max_tokens)?)
                        .map_err(StageError::from)?,
                ))
            })
            .collect::<Result<Vec<_>, ProcessError>>()?;
        let mut process = Self {
            config,
            stage,
            caches,
            peers: None,
            streamer: None,
            pending: VecDeque::new(),
            runtime: None,
        };
        if let Some(r) = process.config.replication.clone() {
            let runtime =
                tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
            process.runtime = Some(runtime);
            let (local, successor) = (process.peer(r.local), process.peer(r.successor));
            let tee = Tee { local: local.clone(), successor: successor.clone() };
            process.streamer = Some(Streamer::spawn(StreamerConfig::default(), Box::new(tee))?);
            process.peers = Some((local, successor));
        }
        Ok(process)
    }

    /// A store on the peer at `addr`.
    fn peer(&self, addr: SocketAddr) -> SharedPeer {
        let runtime = self.runtime.as_ref().expect("replication has a runtime");
        let secret = self.config.replication.as_ref().map(|r| r.secret.clone()).unwrap_or_default();
        let client = ClientConfig::new(secret, self.config.index);
        Arc::new(parking_lot::Mutex::new(PeerStore::new(
            runtime.handle().clone(),
            Arc::new(TcpTransport::plain()),
            addr,
            client,
        )))
    }

    /// The transfer that names this stage's KV of one sequence (kept under its own worker id).
    fn transfer(&self, seat: Seat) -> Transfer {
        let worker = WorkerId { stage: self.config.index, rank: 0 };
        let local = LocalRegion {
            microbatch: seat.microbatch,
            layers: 0..self.config.layers.len() as u32,
            slots: seat.slot..seat.slot + 1,
            heads: 0..self.config.model.kv_heads,
        };
        Transfer { source: worker, destination: worker, from: local.clone(), to: local }
    }

    fn cache(&self, seat: Seat) -> Result<&Arc<KvCache>, ProcessError> {
        self.caches
            .get(seat.microbatch as usize)
            .ok_or_else(|| ProcessError::Protocol(format!("no microbatch {}", seat.microbatch)))
    }

    /// Runs one step and returns the frame to pass on.
    fn step(&mut self, header: &FrameHeader, payload: &[u8]) -> Result<(FrameHeader, Vec<u8>), ProcessError> {
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
        let cache = self.cache(seat)?.clone();
        self.stage.forward(&cache, slot, position, &mut hidden)?;
        if let Some(streamer) = &self.streamer {
            let job = StreamJob {
                cache: cache.clone(),
                transfer: self.transfer(seat),
                tokens: position..position + count,
            };
            self.pending.push_back(streamer.submit(job).map_err(|e| ProcessError::Replica(e.to_string()))?);
            // Report failed replications; a replacement recomputes what the replica lacks.
            while let Some(done) = self.pending.front().and_then(Completion::poll) {
                self.pending.pop_front();
                if let Err(e) = done {
                    eprintln!("stage {}: a replication failed: {e}", self.config.index);
                }
            }
        }
        let out = if self.stage.layers().end == self.config.model.layers {
            let d = self.config.model.d_model as usize;
            tokens_payload(&[self.stage.next_token(&hidden[hidden.len() - d..])?])
        } else {
            floats_payload(&hidden)
        };
        Ok((*header, out))
    }

    /// Carries out a control frame addressed to this stage; returns the payload to pass on.
    fn control(&mut self, header: &FrameHeader, payload: Vec<u8>) -> Result<Vec<u8>, ProcessError> {
        if header.request != self.config.index as u64 {
            return Ok(payload);
        }
        let address = |bytes: &[u8]| -> Result<Option<SocketAddr>, ProcessError> {
            if bytes.is_empty() {
                return Ok(None);
            }
            let addr = std::str::from_utf8(bytes).ok().and_then(|a| a.parse().ok());
            addr.map(Some).ok_or_else(|| ProcessError::Protocol("a control frame with a bad address".into()))
        };
        match payload.split_first() {
            Some((&OP_RESTORE, from)) => {
                let restored = self.restore(header, address(from)?)?;
                let mut reply = vec![OP_RESTORE];
                reply.extend_from_slice(&restored.to_le_bytes());
                Ok(reply)
            }
            Some((&OP_REWIRE, next)) => {
                self.config.next = address(next)?
                    .ok_or_else(|| ProcessError::Protocol("a rewire without an address".into()))?;
                Ok(payload)
            }
            Some((&OP_REPLICATE_TO, to)) => {
                let to = address(to)?
                    .ok_or_else(|| ProcessError::Protocol("no sidecar to replicate to".into()))?;
                self.replicate_to(header, to)?;
                Ok(payload)
            }
            _ => Err(ProcessError::Protocol("unknown control operation".into())),
        }
    }

    /// The chunks a sequence's KV is kept in: the prompt's, then one per token.
    fn chunks(prompt_len: u32, kv_tokens: u32) -> impl Iterator<Item = Range<u32>> {
        std::iter::once(0..prompt_len).chain((prompt_len..kv_tokens).map(|t| t..t + 1))
    }

    /// Restores a sequence's KV from `from` (or the stage's own sidecar), in order, as far as that
    /// peer has it; returns the number of tokens restored (0 if not even the prompt).
    fn restore(&mut self, header: &FrameHeader, from: Option<SocketAddr>) -> Result<u32, ProcessError> {
        let [microbatch, slot, prompt_len, kv_tokens] = header.ids;
        let seat = Seat { microbatch, slot };
        let transfer = self.transfer(seat);
        let cache = self.cache(seat)?.clone();
        let (local, _) =
            self.peers.clone().ok_or_else(|| ProcessError::Replica("no replication configured".into()))?;
        let source = match from {
            Some(addr) => self.peer(addr),
            None => local,
        };
        let mut store = source.lock();
        let mut payload = Vec::new();
        let mut restored = 0;
        for tokens in Self::chunks(prompt_len, kv_tokens) {
            match receive(&cache, &transfer, tokens.clone(), &mut *store as &mut dyn ChunkStore, &mut payload)
            {
                Ok(_) => restored = tokens.end,
                Err(StreamError::Store(StoreError::NotFound(_))) => break,
                Err(e) => return Err(ProcessError::Replica(e.to_string())),
            }
        }
        Ok(restored)
    }

    /// Replicates to the successor sidecar at `to` from now on, and flushes the sequence's KV so
    /// far there (what the old sidecar held died with it).
    fn replicate_to(&mut self, header: &FrameHeader, to: SocketAddr) -> Result<(), ProcessError> {
        let [microbatch, slot, prompt_len, kv_tokens] = header.ids;
        let seat = Seat { microbatch, slot };
        let (_, successor) =
            self.peers.clone().ok_or_else(|| ProcessError::Replica("no replication configured".into()))?;
        let fresh = self.peer(to);
        // Swap the store the streamer writes to: later steps go to the new sidecar.
        std::mem::swap(&mut *successor.lock(), &mut *fresh.lock());
        let transfer = self.transfer(seat);
        let cache = self.cache(seat)?.clone();
        let pool = dejavulib::StagingPool::default();
        let mut store = successor.lock();
        for tokens in Self::chunks(prompt_len, kv_tokens) {
            send(&cache, &transfer, tokens, &pool, &mut *store as &mut dyn ChunkStore)
                .map_err(|e| ProcessError::Replica(e.to_string()))?;
        }
        Ok(())
    }
}

/// Runs a stage: listens at `listen`, reports the bound address through `ready`, then serves one
/// upstream connection at a time (a predecessor's replacement connects after it) until killed.
pub fn serve_stage(
    config: StageConfig,
    listen: SocketAddr,
    ready: impl FnOnce(SocketAddr),
) -> Result<(), ProcessError> {
    let mut process = StageProcess::new(config)?;
    let listener = TcpListener::bind(listen)?;
    ready(listener.local_addr()?);
    let mut downstream: Option<(SocketAddr, BufWriter<TcpStream>)> = None;
    loop {
        let (upstream, _) = listener.accept()?;
        upstream.set_nodelay(true)?;
        let mut r = BufReader::with_capacity(1 << 20, upstream);
        // A predecessor that goes away (closed or broken) is replaced by the next connection.
        while let Ok(Some(frame)) = read_frame(&mut r, DEFAULT_MAX_PAYLOAD) {
            let (header, out) = match frame.header.kind {
                Kind::Activation => process.step(&frame.header, &frame.payload)?,
                Kind::Control => {
                    let header = frame.header;
                    (header, process.control(&header, frame.payload)?)
                }
                other => return Err(ProcessError::Protocol(format!("unexpected {other:?} frame"))),
            };
            let next = process.config.next;
            if downstream.as_ref().is_some_and(|(addr, _)| *addr != next) {
                downstream = None;
            }
            if downstream.is_none() {
                downstream = connect(next, Duration::from_secs(2))
                    .ok()
                    .map(|s| (next, BufWriter::with_capacity(1 << 20, s)));
            }
            if let Some((_, w)) = downstream.as_mut() {
                if write_frame(w, &header, &out).and_then(|()| w.flush()).is_err() {
                    // The successor died: the frame is lost until the driver repairs the chain.
                    downstream = None;
                }
            }
        }
    }
}

/// The driver's end of a chain of stage processes.
pub struct RemotePipeline {
    to_first: BufWriter<TcpStream>,
    results: TcpListener,
    from_last: BufReader<TcpStream>,
    deadline: Duration,
}

impl RemotePipeline {
    /// Connects to the first stage at `first` and accepts the last stage's connection on
    /// `results`; a reply slower than `deadline` is a [`ProcessError::Timeout`].
    pub fn connect(
        first: SocketAddr,
        results: TcpListener,
        deadline: Duration,
    ) -> Result<Self, ProcessError> {
        let mut to_first = BufWriter::new(connect(first, Duration::from_secs(30))?);
        // The last stage connects when it first passes something on: send a no-op through.
        let mut hello = FrameHeader::new(Kind::Control, u32::MAX, 0, u64::MAX);
        hello.ids = [u32::MAX; 4];
        write_frame(&mut to_first, &hello, &[])?;
        to_first.flush()?;
        let (from_last, _) = results.accept()?;
        from_last.set_read_timeout(Some(deadline))?;
        let mut pipeline = Self { to_first, results, from_last: BufReader::new(from_last), deadline };
        pipeline.reply(Kind::Control, [u32::MAX; 4])?;
        Ok(pipeline)
    }

    /// Sends one frame into the chain and reads what comes out of its end.
    fn send(
        &mut self,
        kind: Kind,
        request: u64,
        ids: [u32; 4],
        payload: &[u8],
    ) -> Result<Vec<u8>, ProcessError> {
        let mut header = FrameHeader::new(kind, u32::MAX, 0, request);
        header.ids = ids;
        write_frame(&mut self.to_first, &header, payload)?;
        self.to_first.flush()?;
        self.reply(kind, ids)
    }

    /// The reply to the frame of `kind` and `ids` just sent, skipping late replies to frames sent
    /// before (a step that timed out and was sent again).
    fn reply(&mut self, kind: Kind, ids: [u32; 4]) -> Result<Vec<u8>, ProcessError> {
        loop {
            let reply = match read_frame(&mut self.from_last, DEFAULT_MAX_PAYLOAD) {
                Ok(Some(reply)) => reply,
                Ok(None) => return Err(ProcessError::Protocol("the chain closed".into())),
                Err(dejavulib::wire::FrameError::Io(e))
                    if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) =>
                {
                    return Err(ProcessError::Timeout(self.deadline))
                }
                Err(e) => return Err(e.into()),
            };
            if reply.header.kind == kind && reply.header.ids == ids {
                return Ok(reply.payload);
            }
        }
    }

    /// Runs `tokens` at `position` of `seat` through the chain; returns the next token.
    pub fn run(&mut self, seat: Seat, tokens: &[u32], position: u32) -> Result<u32, ProcessError> {
        let ids = [seat.microbatch, seat.slot, position, tokens.len() as u32];
        match tokens_of(&self.send(Kind::Activation, 0, ids, &tokens_payload(tokens))?)[..] {
            [token] => Ok(token),
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
        let ids = [seat.microbatch, seat.slot, prompt_len, kv_tokens];
        let mut payload = vec![OP_RESTORE];
        if let Some(addr) = from {
            payload.extend_from_slice(addr.to_string().as_bytes());
        }
        match self.send(Kind::Control, stage as u64, ids, &payload)?[..] {
            [OP_RESTORE, a, b, c, d] => Ok(u32::from_le_bytes([a, b, c, d])),
            _ => Err(ProcessError::Protocol(format!("stage {stage} did not report a restore"))),
        }
    }

    /// Tells stage `stage` to replicate to the sidecar at `to` from now on, and to copy `seat`'s
    /// KV so far (prompt of `prompt_len`, `kv_tokens` tokens) there.
    pub fn replicate_to(
        &mut self,
        stage: u32,
        seat: Seat,
        prompt_len: u32,
        kv_tokens: u32,
        to: SocketAddr,
    ) -> Result<(), ProcessError> {
        let mut payload = vec![OP_REPLICATE_TO];
        payload.extend_from_slice(to.to_string().as_bytes());
        self.send(
            Kind::Control,
            stage as u64,
            [seat.microbatch, seat.slot, prompt_len, kv_tokens],
            &payload,
        )?;
        Ok(())
    }

    /// Recovers one sequence on replaced `stages`: restores their KV from the sidecar at `from` (or
    /// each stage's own), then
    /// recomputes the steps that copy lacked (the replication lag; recomputing a step rewrites
    /// the same KV everywhere), checking that they give the tokens already generated. Returns the
    /// number of steps recomputed.
    pub fn recover(
        &mut self,
        stages: &[u32],
        seat: Seat,
        prompt: &[u32],
        generated: &[u32],
        from: Option<SocketAddr>,
    ) -> Result<u64, ProcessError> {
        if generated.is_empty() {
            return Ok(0);
        }
        let prompt_len = prompt.len() as u32;
        // KV exists for the prompt and every generated token but the last.
        let needed = prompt_len + generated.len() as u32 - 1;
        let mut restored = needed;
        for &stage in stages {
            restored = restored.min(self.restore(stage, seat, prompt_len, needed, from)?);
        }
        let mut recomputed = 0;
        let mismatch = |position| {
            ProcessError::Protocol(format!("a recomputed step at position {position} gave another token"))
        };
        if restored < prompt_len {
            if self.run(seat, prompt, 0)? != generated[0] {
                return Err(mismatch(0));
            }
            restored = prompt_len;
            recomputed += 1;
        }
        for position in restored..needed {
            let index = (position - prompt_len) as usize;
            if self.run(seat, &[generated[index]], position)? != generated[index + 1] {
                return Err(mismatch(position));
            }
            recomputed += 1;
        }
        Ok(recomputed)
    }

    /// Repairs the chain after stage `stage` was replaced by a process listening at `addr`:
    /// its predecessor sends there from now on (or, for the first stage, the driver does; for the
    /// last, the driver takes the replacement's connection). Returns once a frame has gone all the
    /// way round.
    pub fn replace(&mut self, stage: u32, addr: SocketAddr, last: bool) -> Result<(), ProcessError> {
        let ids = [u32::MAX; 4];
        if stage == 0 {
            self.to_first = BufWriter::new(connect(addr, Duration::from_secs(30))?);
        }
        let mut header = FrameHeader::new(Kind::Control, u32::MAX, 0, stage.saturating_sub(1) as u64);
        header.ids = ids;
        let mut payload = vec![OP_REWIRE];
        payload.extend_from_slice(addr.to_string().as_bytes());
        if stage == 0 {
            // No predecessor to rewire: a no-op addressed to nobody proves the chain whole.
            header.request = u64::MAX;
        }
        write_frame(&mut self.to_first, &header, &payload)?;
        self.to_first.flush()?;
        if last {
            let (from_last, _) = self.results.accept()?;
            from_last.set_read_timeout(Some(self.deadline))?;
            self.from_last = BufReader::new(from_last);
        }
        self.reply(Kind::Control, ids)?;
        Ok(())
    }
}
