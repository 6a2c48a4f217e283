//! The reference model as the engine of a stage process: its layers and caches in the process,
//! each step's KV handed to the sidecar by a streamer thread, restores and prompt loads done here.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use dejavulib::chunk::ChunkKey;
use dejavulib::local::LocalSidecar;
use dejavulib::net::PeerStore;
use dejavulib::reshard::{install, receive, transfer_key, StreamError};
use dejavulib::store::StoreError;
use dejavulib::streamer::{Completion, StreamJob};
use dejavulib::{ChunkStore, KvCache, KvRegion, Streamer, StreamerConfig, Transfer, WorkerId};
use parking_lot::Mutex;
use tracing::{info, warn};

use super::sidecars::{SharedStore, Sidecars, ToSidecar};
use super::{
    tokens_of, tokens_payload, Handoff, ProcessError, StageConfig, StageEngine, StageStats, LOAD_PATIENCE,
};
use crate::handoff::{HandoffReceiver, HandoffSender};
use crate::swap::SwapCaches;
use dejavu_engine::pipeline::{cache_layout, Seat};
use dejavu_engine::stage::Stage;

/// What a stage does with handed-over prompts, running.
enum HandoffEnd {
    Sender(HandoffSender),
    Receiver(HandoffReceiver),
}

fn floats_of(payload: &[u8]) -> Vec<f32> {
    payload.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

fn floats_payload(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The reference model's stage: its layers, caches and replication.
pub(super) struct ReferenceStage {
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

impl ReferenceStage {
    /// Builds the stage `config` describes, counting what it does in `stats`; connects it to its
    /// sidecar if it replicates.
    pub(super) fn new(config: StageConfig, stats: Arc<StageStats>) -> Result<Self, ProcessError> {
        let stage = Stage::new(config.model, config.layers.clone())?;
        let layout = cache_layout(&stage, config.layout, config.slots, config.max_tokens)?;
        let device_caches =
            config.device_caches.unwrap_or(config.microbatches).clamp(1, config.microbatches.max(1));
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

    /// Runs one step and returns the payload to pass on ([`StageEngine::step`]).
    fn run_step(
        &mut self,
        seat: Seat,
        position: u32,
        count: u32,
        payload: &[u8],
    ) -> Result<Vec<u8>, ProcessError> {
        if self.sidecar_lost() {
            return Err(ProcessError::Sidecar(
                "its sidecar closed the connection: the stage stops, to be replaced".into(),
            ));
        }
        let Seat { microbatch, slot } = seat;
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

    /// As [`ReferenceStage::restore_from`], from a peer's sidecar with every fetch in flight at once;
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

impl StageEngine for ReferenceStage {
    fn step(&mut self, seat: Seat, position: u32, count: u32, input: &[u8]) -> Result<Vec<u8>, ProcessError> {
        self.run_step(seat, position, count, input)
    }

    fn restore(
        &mut self,
        seat: Seat,
        prompt_len: u32,
        kv_tokens: u32,
        from: Option<SocketAddr>,
    ) -> Result<u32, ProcessError> {
        Ok(ReferenceStage::restore(self, seat, prompt_len, kv_tokens, from))
    }

    fn load(&mut self, seat: Seat, prompt_len: u32) -> u32 {
        ReferenceStage::load(self, seat, prompt_len)
    }

    fn handoff_to(&mut self, token_stage: u32, to: SocketAddr) -> Result<(), ProcessError> {
        let Some(HandoffEnd::Sender(sender)) = &mut self.handoff else {
            return Err(ProcessError::Protocol(
                "a handoff target for a stage that is not a prompt stage".into(),
            ));
        };
        Ok(sender.retarget(token_stage, to)?)
    }

    fn set_replication(&mut self, on: bool) {
        self.replication_paused = !on;
    }

    fn passed_on(&mut self, microbatch: u32) {
        self.prefetch_after(microbatch);
    }

    fn lost(&self) -> bool {
        self.sidecar_lost()
    }
}
