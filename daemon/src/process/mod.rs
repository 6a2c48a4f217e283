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
//! Every connection on the chain (driver to stage 0, stage to stage, last stage to driver) proves
//! the cluster secret and then says hello (the `chain` module): a `Hello` frame whose epoch is the
//! one its sender was started in (a replacement's is the epoch of the recovery that started it)
//! and whose sender is the stage's predecessor. A receiver takes a connection with an epoch at
//! least that of the one in use, which it then shuts (a replacement takes over; it connects as
//! soon as it starts), and refuses an older one: a stage presumed dead and replaced, but back
//! from a pause or a partition, cannot take its link back.
//! Its sidecar, taken over by the replacement (a newer epoch on the local socket), has closed its
//! connection too, so none of its KV is kept.
//!
//! Every stage passes a control frame on, so its arrival back at the driver says the operation is
//! done and the chain whole. A stage whose predecessor goes away accepts the next connection (the
//! replacement); a frame it cannot pass on (its successor died) is dropped, and the driver sends it
//! again once the chain is repaired. A frame a stage cannot carry out is reported on its standard
//! error and dropped: the driver's deadline notices.
//!
//! The driver's end is [`RemotePipeline`] (the `remote` module); a stage's counters and metrics
//! page are [`StageStats`] (`stats`), and the `sidecars` module reaches its own sidecar and a
//! recovery's restore sources.

use std::collections::VecDeque;
use std::io::{BufReader, BufWriter, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use dejavulib::affinity::CpuList;
use dejavulib::chunk::ChunkKey;
use dejavulib::local::LocalSidecar;
use dejavulib::message::Message;
use dejavulib::net::PeerStore;
use dejavulib::reshard::{install, receive, transfer_key, StreamError};
use dejavulib::store::StoreError;
use dejavulib::streamer::{Completion, StreamJob};
use dejavulib::wire::{read_frame, write_frame, Frame, FrameHeader, Kind, DEFAULT_MAX_PAYLOAD};
use dejavulib::{ChunkStore, KvCache, KvRegion, Streamer, StreamerConfig, Transfer, WorkerId};
use parking_lot::Mutex;
use thiserror::Error;
use tracing::{error, info, warn};

use crate::handoff::{HandoffReceiver, HandoffSender, Shapes};
use crate::swap::SwapCaches;
use crate::transport::Transports;
use dejavu_engine::model::ModelConfig;
use dejavu_engine::pipeline::{cache_layout, CacheLayout, Seat};
use dejavu_engine::stage::{Stage, StageError};

mod chain;
mod remote;
mod sidecars;
mod stats;

use chain::{accept_upstreams, closed_by_peer, connect, say_hello};
pub use remote::{RemotePipeline, RestoreSource, SequenceRecovery, StepReply};
use sidecars::{SharedStore, Sidecars, ToSidecar};
pub use stats::StageStats;

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
    /// The stage's part in a handoff between prompt and token pipelines.
    #[error(transparent)]
    Handoff(#[from] crate::handoff::HandoffError),
    /// A sidecar refused or failed.
    #[error("sidecar: {0}")]
    Sidecar(String),
    /// A message that does not belong in the chain.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The stage's KV caches cannot be made.
    #[error(transparent)]
    Cache(#[from] dejavulib::CacheError),
    /// The last stage closed its connection to whoever feeds the pipeline.
    #[error("the last stage closed its connection")]
    LastStageClosed,
    /// No reply within the deadline: a stage is presumed dead.
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    /// The controller fenced members in this epoch, one the pipeline has not recovered from,
    /// while a step was in flight: a stage was declared dead, and the step's reply may never come.
    #[error("the controller fenced members in epoch {0} while a step was in flight")]
    Fenced(u64),
}

/// Where a stage keeps copies of its KV.
#[derive(Clone, Debug)]
pub struct Replication {
    /// Its own sidecar's local socket: the local copy, through shared memory, which the sidecar
    /// forwards to the successor.
    pub local: PathBuf,
    /// Its ring successor's sidecar (the replica), or none (a ring of one stage: local copies
    /// only).
    pub successor: dejavulib::local::Successor,
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
    /// Time each step takes on top of the reference model's arithmetic (a real model's kernels;
    /// the stage sleeps, leaving the CPU free as while a GPU computes).
    pub step_time: Duration,
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
        let make = || KvCache::new(layout.clone());
        let caches = SwapCaches::new(device_caches, config.index, region, make, stats.swap.clone())?;
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
                in_flight: VecDeque::new(),
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
                shapes.check_stage(true, index, &c.layers, c.slots, c.microbatches)?;
                if c.device_caches.is_some_and(|d| d < c.microbatches) {
                    // The handoff reads each prompt's cache in the background; swapping would
                    // refill it meanwhile.
                    return Err(ProcessError::Protocol(
                        "a prompt stage keeps every microbatch: no --device-caches".into(),
                    ));
                }
                let transports = &process.config.transport;
                let sender = HandoffSender::new(shapes, spec, (index, epoch), sidecars, secret, transports)?;
                Some(HandoffEnd::Sender(sender))
            }
            Some(Handoff::Token { shapes }) => {
                let c = &process.config;
                shapes.check_stage(false, index, &c.layers, c.slots, c.microbatches)?;
                if process.sidecars.is_none() {
                    return Err(ProcessError::Protocol(
                        "a token stage loads prompts from its sidecar: it needs one".into(),
                    ));
                }
                Some(HandoffEnd::Receiver(HandoffReceiver::new(shapes, spec, index)?))
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
        if !self.config.step_time.is_zero() {
            std::thread::sleep(self.config.step_time);
        }
        self.caches.grew(microbatch, slot, position + count);
        StageStats::add(&self.stats.steps, 1);
        StageStats::add(&self.stats.tokens, count as u64);
        if let Some(HandoffEnd::Sender(sender)) = &mut self.handoff {
            if position == 0 {
                sender.prompt_done(&cache, seat, 0..count)?;
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
    fn load(&mut self, seat: Seat, prompt_len: u32) -> u32 {
        let Seat { microbatch, slot } = seat;
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

    /// Carries out a control message if it is addressed to this stage; returns the payload to
    /// pass on (the message's answer, or the message itself).
    fn control(&mut self, payload: Vec<u8>) -> Result<Vec<u8>, ProcessError> {
        let message = Message::decode(&payload).map_err(|e| ProcessError::Protocol(e.to_string()))?;
        if let Message::Rewire(rewires) = &message {
            if let Some(&(_, next)) = rewires.iter().find(|(stage, _)| *stage == self.config.index) {
                self.config.next = next;
            }
            return Ok(payload);
        }
        if message.stage() != self.config.index {
            return Ok(payload);
        }
        match message {
            Message::Restore { stage, seat, prompt_len, kv_tokens, from } => {
                let seat = Seat { microbatch: seat.microbatch, slot: seat.slot };
                let tokens = self.restore(seat, prompt_len, kv_tokens, from);
                Ok(Message::Restored { stage, tokens }.encode())
            }
            Message::Load { stage, seat, prompt_len } => {
                let tokens = self.load(Seat { microbatch: seat.microbatch, slot: seat.slot }, prompt_len);
                Ok(Message::Loaded { stage, tokens }.encode())
            }
            Message::HandoffTo { token_stage, to, .. } => {
                let Some(HandoffEnd::Sender(sender)) = &self.handoff else {
                    return Err(ProcessError::Protocol(
                        "a handoff target for a stage that is not a prompt stage".into(),
                    ));
                };
                sender.retarget(token_stage, to)?;
                Ok(payload)
            }
            Message::Replication { on, .. } => {
                self.replication_paused = !on;
                Ok(payload)
            }
            other => Err(ProcessError::Protocol(format!("unexpected {other:?}"))),
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
    fn restore(&mut self, seat: Seat, prompt_len: u32, kv_tokens: u32, from: Option<SocketAddr>) -> u32 {
        let Seat { microbatch, slot } = seat;
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
                Kind::Control => process.control(payload),
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
