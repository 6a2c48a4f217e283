//! Stages as separate processes that pass activations over TCP, and the driver that feeds them.
//!
//! The stages form a chain: the driver sends a step's tokens to stage 0, each stage runs its layers
//! and sends the hidden states on, and the last stage sends the next token back to the driver.
//! Every message is one [`dejavulib::wire`] frame of kind `Activation` whose ids are (microbatch,
//! slot, position, token count); the payload is tokens (`u32`) into stage 0 and out of the last
//! stage, hidden states (`f32`) in between, all little-endian.
//!
//! With a replica peer configured, a stage flushes the KV it wrote in each step (the prompt's,
//! then each token's) to the peer before passing the step on, so a replacement stage can restore a
//! sequence: a `Control` frame addressed to it (the request id names the stage; ids are microbatch,
//! slot, prompt length and tokens with KV) makes it fetch those chunks into its cache; the frame
//! then travels on around the chain to tell the driver.

use std::io::{BufReader, BufWriter, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dejavulib::net::tcp::TcpTransport;
use dejavulib::net::{ClientConfig, PeerStore};
use dejavulib::reshard::{receive, send, LocalRegion};
use dejavulib::wire::{read_frame, write_frame, FrameHeader, Kind, DEFAULT_MAX_PAYLOAD};
use dejavulib::{ChunkStore, KvCache, StagingPool, Transfer, WorkerId};
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
}

/// A replica peer: where a stage flushes its KV, and where a replacement restores it from.
#[derive(Clone, Debug)]
pub struct Replica {
    /// The peer's address.
    pub addr: SocketAddr,
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
    /// Where to keep replicas of its KV, if anywhere.
    pub replica: Option<Replica>,
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

/// A running stage: its layers, caches and replica store.
struct StageProcess {
    config: StageConfig,
    stage: Stage,
    caches: Vec<Arc<KvCache>>,
    replica: Option<PeerStore>,
    pool: StagingPool,
    _runtime: Option<tokio::runtime::Runtime>,
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
        let (replica, runtime) = match &config.replica {
            None => (None, None),
            Some(r) => {
                let runtime =
                    tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
                let transport = Arc::new(TcpTransport::plain());
                let store = PeerStore::new(
                    runtime.handle().clone(),
                    transport,
                    r.addr,
                    ClientConfig::new(r.secret.clone(), config.index),
                );
                (Some(store), Some(runtime))
            }
        };
        Ok(Self { config, stage, caches, replica, pool: StagingPool::default(), _runtime: runtime })
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
        let transfer = self.transfer(seat);
        if let Some(replica) = self.replica.as_mut() {
            send(&cache, &transfer, position..position + count, &self.pool, replica as &mut dyn ChunkStore)
                .map_err(|e| ProcessError::Replica(e.to_string()))?;
        }
        let out = if self.stage.layers().end == self.config.model.layers {
            let d = self.config.model.d_model as usize;
            tokens_payload(&[self.stage.next_token(&hidden[hidden.len() - d..])?])
        } else {
            floats_payload(&hidden)
        };
        Ok((*header, out))
    }

    /// Restores a sequence's KV from the replica peer: the prompt's chunk, then one per token.
    fn restore(&mut self, header: &FrameHeader) -> Result<(), ProcessError> {
        let [microbatch, slot, prompt_len, kv_tokens] = header.ids;
        let seat = Seat { microbatch, slot };
        let transfer = self.transfer(seat);
        let cache = self.cache(seat)?.clone();
        let replica = self
            .replica
            .as_mut()
            .ok_or_else(|| ProcessError::Replica("no replica peer configured".into()))?;
        let mut payload = Vec::new();
        let steps = std::iter::once(0..prompt_len).chain((prompt_len..kv_tokens).map(|t| t..t + 1));
        for tokens in steps {
            receive(&cache, &transfer, tokens, replica as &mut dyn ChunkStore, &mut payload)
                .map_err(|e| ProcessError::Replica(e.to_string()))?;
        }
        Ok(())
    }
}

/// Runs a stage: listens at `listen`, reports the bound address through `ready`, takes one
/// upstream connection, and serves it until it closes.
pub fn serve_stage(
    config: StageConfig,
    listen: SocketAddr,
    ready: impl FnOnce(SocketAddr),
) -> Result<(), ProcessError> {
    let mut process = StageProcess::new(config)?;
    let listener = TcpListener::bind(listen)?;
    ready(listener.local_addr()?);
    let (upstream, _) = listener.accept()?;
    upstream.set_nodelay(true)?;
    let downstream = connect(process.config.next, Duration::from_secs(30))?;
    let mut r = BufReader::with_capacity(1 << 20, upstream);
    let mut w = BufWriter::with_capacity(1 << 20, downstream);
    while let Some(frame) = read_frame(&mut r, DEFAULT_MAX_PAYLOAD)? {
        match frame.header.kind {
            Kind::Activation => {
                let (header, out) = process.step(&frame.header, &frame.payload)?;
                write_frame(&mut w, &header, &out)?;
            }
            Kind::Control => {
                if frame.header.request == process.config.index as u64 {
                    process.restore(&frame.header)?;
                }
                write_frame(&mut w, &frame.header, &frame.payload)?;
            }
            other => return Err(ProcessError::Protocol(format!("unexpected {other:?} frame"))),
        }
        w.flush()?;
    }
    Ok(())
}

/// The driver's end of a chain of stage processes.
pub struct RemotePipeline {
    to_first: BufWriter<TcpStream>,
    from_last: BufReader<TcpStream>,
}

impl RemotePipeline {
    /// Accepts the last stage's connection on `results` and connects to the first stage at
    /// `first`.
    pub fn connect(first: SocketAddr, results: &TcpListener) -> Result<Self, ProcessError> {
        let to_first = connect(first, Duration::from_secs(30))?;
        let (from_last, _) = results.accept()?;
        Ok(Self { to_first: BufWriter::new(to_first), from_last: BufReader::new(from_last) })
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
        let reply = read_frame(&mut self.from_last, DEFAULT_MAX_PAYLOAD)?
            .ok_or_else(|| ProcessError::Protocol("the chain closed".into()))?;
        if reply.header.kind != kind || reply.header.ids != ids {
            return Err(ProcessError::Protocol(format!("reply {:?} to {kind:?} {ids:?}", reply.header)));
        }
        Ok(reply.payload)
    }

    /// Runs `tokens` at `position` of `seat` through the chain; returns the next token.
    pub fn run(&mut self, seat: Seat, tokens: &[u32], position: u32) -> Result<u32, ProcessError> {
        let ids = [seat.microbatch, seat.slot, position, tokens.len() as u32];
        match tokens_of(&self.send(Kind::Activation, 0, ids, &tokens_payload(tokens))?)[..] {
            [token] => Ok(token),
            _ => Err(ProcessError::Protocol("a step's reply is one token".into())),
        }
    }

    /// Tells stage `stage` to restore `seat`'s KV (prompt of `prompt_len`, KV of `kv_tokens`
    /// tokens) from its replica peer; returns once it has.
    pub fn restore(
        &mut self,
        stage: u32,
        seat: Seat,
        prompt_len: u32,
        kv_tokens: u32,
    ) -> Result<(), ProcessError> {
        self.send(Kind::Control, stage as u64, [seat.microbatch, seat.slot, prompt_len, kv_tokens], &[])?;
        Ok(())
    }
}
