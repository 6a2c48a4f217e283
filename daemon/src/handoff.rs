//! Prompt-token disaggregation across processes: a prompt pipeline computes each prompt, and its
//! stages stream the prompt's KV to the sidecars of a token pipeline of another shape (other layer
//! splits, another microbatch size, another cache layout); when the driver starts the sequence
//! there, each token stage loads its part from its own sidecar (host memory, through shared
//! memory) and decodes.
//!
//! Both sides plan with [`plan_stream_out`] / [`plan_stream_in`] over the two [`Setup`]s. A
//! transfer between a prompt microbatch and a token microbatch covers several sequences; it is
//! split per sequence, so that each prompt is handed over as soon as it has been computed and
//! each sequence is loaded alone. Sender and receiver split alike, so their chunk keys agree.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dejavulib::chunk::{ChunkDescriptor, ChunkKey};
use dejavulib::net::{ClientConfig, PeerStore};
use dejavulib::reshard::{receive, LocalRegion, StreamError};
use dejavulib::store::StoreError;
use dejavulib::streamer::{Completion, StreamJob};
use dejavulib::{
    plan_stream_in, plan_stream_out, ChunkStore, KvCache, KvSpec, Setup, StageSpec, Streamer, StreamerConfig,
    Transfer, WorkerId,
};
use parking_lot::Mutex;

use crate::transport::Transports;
use dejavu_engine::pipeline::Seat;

/// The shapes of the two pipelines, which both sides need to plan the handoff.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shapes {
    /// Layers of each prompt stage.
    pub prompt: Vec<Range<u32>>,
    /// Sequences per prompt microbatch.
    pub prompt_slots: u32,
    /// Layers of each token stage.
    pub token: Vec<Range<u32>>,
    /// Sequences per token microbatch.
    pub token_slots: u32,
    /// Requests in all (a multiple of both microbatch sizes).
    pub requests: u32,
}

/// Why a prompt or token stage cannot take part in a handoff.
#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    /// A stage given shapes that are not its own: it would hand over or load other requests' KV.
    #[error(
        "stage {index} runs layers {layers:?} with {microbatches} microbatches of {slots}, but the \
         {pipeline} pipeline's shapes give it {theirs:?} with {their_microbatches} microbatches of \
         {their_slots}"
    )]
    NotItsShape {
        /// The stage.
        index: u32,
        /// Its layers.
        layers: Range<u32>,
        /// Its microbatches.
        microbatches: u32,
        /// Its sequences per microbatch.
        slots: u32,
        /// `prompt` or `token`.
        pipeline: &'static str,
        /// The layers the shapes give it, if they give it any.
        theirs: Option<Range<u32>>,
        /// The microbatches they give it.
        their_microbatches: u32,
        /// The sequences per microbatch they give it.
        their_slots: u32,
    },
    /// The requests do not fill a pipeline's microbatches.
    #[error("{requests} requests do not fill microbatches of {slots}")]
    Microbatches {
        /// Requests in all.
        requests: u32,
        /// Sequences per microbatch.
        slots: u32,
    },
    /// The prompt and token setups are not setups, or do not fit together.
    #[error(transparent)]
    Setup(#[from] dejavulib::placement::SetupError),
    /// The handoff cannot be planned between them.
    #[error(transparent)]
    Plan(#[from] StreamError),
    /// Not one sidecar per token stage.
    #[error("{sidecars} token sidecars for {stages} token stages")]
    Sidecars {
        /// Sidecars given.
        sidecars: usize,
        /// Token stages.
        stages: usize,
    },
    /// A token stage the handoff does not know.
    #[error("no token stage {0}")]
    NoStage(u32),
    /// A connection to a token sidecar could not be made ready.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The handoff's thread or runtime could not start.
    #[error("cannot start the handoff: {0}")]
    Start(#[from] std::io::Error),
    /// A prompt could not be queued for handing over.
    #[error(transparent)]
    Streamer(#[from] dejavulib::streamer::StreamerError),
}

impl Shapes {
    /// Checks that stage `index` of the prompt pipeline (or of the token pipeline, if not
    /// `prompt`) is the one these shapes describe: its layers, sequences per microbatch and
    /// microbatches. A stage given other shapes than its own would hand over or load other
    /// requests' KV.
    pub fn check_stage(
        &self,
        prompt: bool,
        index: u32,
        layers: &Range<u32>,
        slots: u32,
        microbatches: u32,
    ) -> Result<(), HandoffError> {
        let (pipeline, splits, their_slots) = match prompt {
            true => ("prompt", &self.prompt, self.prompt_slots),
            false => ("token", &self.token, self.token_slots),
        };
        let theirs = splits.get(index as usize);
        let fits = theirs == Some(layers)
            && their_slots == slots
            && their_slots != 0
            && self.requests / their_slots == microbatches;
        if fits {
            return Ok(());
        }
        Err(HandoffError::NotItsShape {
            index,
            layers: layers.clone(),
            microbatches,
            slots,
            pipeline,
            theirs: theirs.cloned(),
            their_microbatches: self.requests.checked_div(their_slots).unwrap_or(0),
            their_slots,
        })
    }

    /// The prompt and token setups, or why they do not fit together.
    pub fn setups(&self, spec: KvSpec) -> Result<(Setup, Setup), HandoffError> {
        let setup = |splits: &[Range<u32>], slots: u32| {
            if slots == 0 || self.requests % slots != 0 {
                return Err(HandoffError::Microbatches { requests: self.requests, slots });
            }
            let stages = splits.iter().map(|layers| StageSpec { layers: layers.clone(), tp: 1 }).collect();
            Ok(Setup::new(spec, stages, slots, self.requests / slots)?)
        };
        let (prompt, token) =
            (setup(&self.prompt, self.prompt_slots)?, setup(&self.token, self.token_slots)?);
        prompt.check_compatible(&token)?;
        Ok((prompt, token))
    }

    /// Where request `request` sits in the prompt pipeline.
    pub fn prompt_seat(&self, request: u32) -> Seat {
        Seat { microbatch: request / self.prompt_slots, slot: request % self.prompt_slots }
    }
}

/// The node id prompt stage `index` uses with the token stages' sidecars: apart from the token
/// stages' own ids, whose epochs the sidecars fence per sender.
pub fn prompt_node(index: u32) -> u32 {
    const PROMPT_NODES: u32 = 1 << 16;
    PROMPT_NODES | index
}

/// Which end of the transfers a worker is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Source,
    Destination,
}

/// Added to a destination's rank in the keys of handed-over chunks: they live beside the token
/// stage's own copies in its sidecar, and must never be taken for them (or replace them).
const HANDOFF_RANKS: u32 = 1 << 16;

/// The one-sequence parts of `transfers` that concern `seat` at the given end, keyed apart from
/// the destination's own copies.
fn for_sequence(transfers: &[Transfer], seat: Seat, end: End) -> Vec<Transfer> {
    transfers
        .iter()
        .filter_map(|t| {
            let here = if end == End::Source { &t.from } else { &t.to };
            if here.microbatch != seat.microbatch || !here.slots.contains(&seat.slot) {
                return None;
            }
            let offset = seat.slot - here.slots.start;
            let one = |r: &LocalRegion| LocalRegion {
                slots: r.slots.start + offset..r.slots.start + offset + 1,
                ..r.clone()
            };
            let destination = WorkerId { rank: t.destination.rank | HANDOFF_RANKS, ..t.destination };
            Some(Transfer { source: t.source, destination, from: one(&t.from), to: one(&t.to) })
        })
        .collect()
}

/// The token stages' sidecars as one store: each chunk goes to its destination stage's.
struct TokenSidecars {
    /// Where each token stage's sidecar is now (a replaced one moves).
    targets: Arc<Mutex<Vec<SocketAddr>>>,
    /// A store on each, and the address it reaches.
    stores: Vec<(SocketAddr, PeerStore)>,
    client: ClientConfig,
    transports: Transports,
    runtime: tokio::runtime::Runtime,
}

impl TokenSidecars {
    fn store_on(&self, addr: SocketAddr) -> Result<PeerStore, StoreError> {
        let transport = self.transports.make().map_err(|e| StoreError::Io {
            op: "open a transport to",
            path: addr.to_string().into(),
            source: std::io::Error::other(e),
        })?;
        Ok(PeerStore::new(self.runtime.handle().clone(), transport, addr, self.client.clone()))
    }

    fn of(&mut self, stage: u32) -> Result<&mut PeerStore, StoreError> {
        // The plan names only token stages, and there is a sidecar for each (checked at start).
        let target = self.targets.lock().get(stage as usize).copied().ok_or_else(|| StoreError::Io {
            op: "hand over to",
            path: format!("token stage {stage}").into(),
            source: std::io::ErrorKind::NotFound.into(),
        })?;
        if self.stores[stage as usize].0 != target {
            self.stores[stage as usize] = (target, self.store_on(target)?);
        }
        Ok(&mut self.stores[stage as usize].1)
    }
}

impl ChunkStore for TokenSidecars {
    fn put(&mut self, descriptor: &ChunkDescriptor, payload: &[u8]) -> Result<(), StoreError> {
        self.of(descriptor.destination.stage)?.put(descriptor, payload)
    }

    fn put_gathered(
        &mut self,
        descriptor: &ChunkDescriptor,
        cache: &dejavulib::KvCache,
        plan: &dejavulib::cache::GatherPlan,
        staging: &mut [u8],
    ) -> Result<std::time::Duration, StoreError> {
        self.of(descriptor.destination.stage)?.put_gathered(descriptor, cache, plan, staging)
    }

    fn get(&mut self, key: &ChunkKey, out: &mut Vec<u8>) -> Result<ChunkDescriptor, StoreError> {
        self.of(key.destination.stage)?.get(key, out)
    }
}

/// A prompt stage's end: streams each computed prompt's KV to the token stages' sidecars in the
/// background, while the prompt pipeline goes on.
pub struct HandoffSender {
    plan: Vec<Transfer>,
    streamer: Streamer,
    pending: VecDeque<Completion>,
    /// Where each token stage's sidecar is (shared with the streamer's store).
    targets: Arc<Mutex<Vec<SocketAddr>>>,
}

/// What finished handoffs moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Handed {
    /// Chunks stored at token sidecars.
    pub chunks: u64,
    /// Their payload bytes.
    pub bytes: u64,
    /// Chunks that could not be stored (the token stage computes that prompt itself).
    pub failures: u64,
}

impl HandoffSender {
    /// The sender of prompt stage `index` (started in `epoch`), handing over to the token sidecars
    /// at `sidecars` (in token stage order) as node [`prompt_node`]`(index)` of the cluster with
    /// `secret`, over `transports`.
    pub fn new(
        shapes: &Shapes,
        spec: KvSpec,
        (index, epoch): (u32, u64),
        sidecars: &[SocketAddr],
        secret: &[u8],
        transports: &Transports,
    ) -> Result<Self, HandoffError> {
        let (prompt, token) = shapes.setups(spec)?;
        if sidecars.len() != token.stages().len() {
            return Err(HandoffError::Sidecars { sidecars: sidecars.len(), stages: token.stages().len() });
        }
        let plan = plan_stream_out(&prompt, WorkerId { stage: index, rank: 0 }, &token)?;
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let mut client = ClientConfig::new(secret.to_vec(), prompt_node(index));
        client.epoch = epoch;
        client.connect_attempts = 2;
        client.connect_timeout = Duration::from_millis(500);
        let targets = Arc::new(Mutex::new(sidecars.to_vec()));
        let mut store = TokenSidecars {
            targets: targets.clone(),
            stores: Vec::new(),
            client,
            transports: transports.clone(),
            runtime,
        };
        store.stores =
            sidecars.iter().map(|&addr| store.store_on(addr).map(|s| (addr, s))).collect::<Result<_, _>>()?;
        let config = StreamerConfig { name: format!("handoff-{index}"), ..StreamerConfig::default() };
        let streamer = Streamer::spawn(config, Box::new(store))?;
        Ok(Self { plan, streamer, pending: VecDeque::new(), targets })
    }

    /// Hands over to token stage `stage`'s sidecar at `to` from now on (it was replaced).
    pub fn retarget(&self, stage: u32, to: SocketAddr) -> Result<(), HandoffError> {
        let mut targets = self.targets.lock();
        let target = targets.get_mut(stage as usize).ok_or(HandoffError::NoStage(stage))?;
        *target = to;
        Ok(())
    }

    /// `seat`'s prompt (`tokens`) is in `cache`: streams its KV to the token stages that need it.
    pub fn prompt_done(
        &mut self,
        cache: &Arc<KvCache>,
        seat: Seat,
        tokens: Range<u32>,
    ) -> Result<(), HandoffError> {
        for transfer in for_sequence(&self.plan, seat, End::Source) {
            let job = StreamJob { cache: cache.clone(), transfer, tokens: tokens.clone() };
            self.pending.push_back(self.streamer.submit(job)?);
        }
        Ok(())
    }

    /// Collects the handoffs finished since the last call.
    pub fn finished(&mut self) -> Handed {
        let mut handed = Handed::default();
        while let Some(done) = self.pending.front().and_then(Completion::poll) {
            self.pending.pop_front();
            match done {
                Ok(receipt) => {
                    handed.chunks += 1;
                    handed.bytes += receipt.bytes;
                }
                Err(e) => {
                    handed.failures += 1;
                    tracing::warn!(error = %e, "a prompt handoff failed");
                }
            }
        }
        handed
    }
}

/// A token stage's end: loads a sequence's prompt KV from a store (its own sidecar).
pub struct HandoffReceiver {
    plan: Vec<Transfer>,
}

impl HandoffReceiver {
    /// The receiver of token stage `index`.
    pub fn new(shapes: &Shapes, spec: KvSpec, index: u32) -> Result<Self, HandoffError> {
        let (prompt, token) = shapes.setups(spec)?;
        let plan = plan_stream_in(&prompt, &token, WorkerId { stage: index, rank: 0 })?;
        Ok(Self { plan })
    }

    /// Loads `seat`'s prompt KV (`prompt_len` tokens) from `store` into `cache`, waiting up to
    /// `patience` for chunks still on their way; returns the payload bytes loaded.
    pub fn load(
        &self,
        cache: &KvCache,
        seat: Seat,
        prompt_len: u32,
        store: &Mutex<dyn ChunkStore>,
        patience: Duration,
    ) -> Result<u64, StreamError> {
        let until = Instant::now() + patience;
        let mut payload = Vec::new();
        let mut bytes = 0;
        let transfers = for_sequence(&self.plan, seat, End::Destination);
        if transfers.is_empty() {
            return Err(StreamError::Unexpected(format!("no prompt KV is planned for {seat:?}")));
        }
        for transfer in transfers {
            loop {
                // Locked per attempt: the stage's replication uses the same store meanwhile.
                let fetched = receive(cache, &transfer, 0..prompt_len, &mut *store.lock(), &mut payload);
                match fetched {
                    Ok(receipt) => {
                        bytes += receipt.bytes;
                        break;
                    }
                    Err(StreamError::Store(StoreError::NotFound(_))) if Instant::now() < until => {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dejavu_engine::ModelConfig;

    fn shapes() -> Shapes {
        Shapes {
            prompt: vec![0..4, 4..8],
            prompt_slots: 4,
            token: vec![0..3, 3..5, 5..8],
            token_slots: 2,
            requests: 8,
        }
    }

    #[test]
    fn per_sequence_parts_cover_each_sequence_once_on_both_ends() {
        let spec = ModelConfig::reference().kv_spec();
        let (prompt, token) = shapes().setups(spec).unwrap();
        let layers_per_token =
            |transfers: &[Transfer]| -> u32 { transfers.iter().map(|t| t.to.layers.len() as u32).sum() };
        for request in 0..8u32 {
            let (p, t) = (shapes().prompt_seat(request), Seat { microbatch: request / 2, slot: request % 2 });
            let mut sent = Vec::new();
            for worker in prompt.workers() {
                let plan = plan_stream_out(&prompt, worker, &token).unwrap();
                sent.extend(for_sequence(&plan, p, End::Source));
            }
            // Every layer of the sequence leaves the prompt side once, as one slot.
            assert_eq!(layers_per_token(&sent), 8, "request {request}");
            assert!(sent.iter().all(|x| x.from.slots.len() == 1 && x.to.slots.len() == 1));
            assert!(sent.iter().all(|x| x.to.microbatch == t.microbatch && x.to.slots.start == t.slot));
            let mut received = Vec::new();
            for worker in token.workers() {
                let plan = plan_stream_in(&prompt, &token, worker).unwrap();
                received.extend(for_sequence(&plan, t, End::Destination));
            }
            sent.sort_by_key(|x| (x.destination.stage, x.to.layers.start));
            received.sort_by_key(|x| (x.destination.stage, x.to.layers.start));
            assert_eq!(sent, received, "both ends agree on request {request}'s chunks");
        }
    }

    #[test]
    fn shapes_that_do_not_fit_are_refused() {
        let spec = ModelConfig::reference().kv_spec();
        let odd = Shapes { requests: 6, ..shapes() };
        assert!(matches!(odd.setups(spec), Err(HandoffError::Microbatches { requests: 6, slots: 4 })));
        let short = Shapes { token: vec![0..3, 3..7], ..shapes() };
        assert!(short.setups(spec).is_err());
    }
}
