//! `stream_out` / `stream_in`: moving KV between two pipeline setups.
//!
//! Planning is pure: [`plan_stream_out`] lists, for one source worker of setup A, every
//! (destination worker of B, source region, destination region) it must send, in each side's local
//! coordinates. It covers a different pipeline depth, a different TP degree (head shards merge or
//! split), a different microbatch size (a 16-slot microbatch splits into two 8-slot ones and back),
//! asymmetric layer splits and GQA head replicas (only a head's primary holder sends; every replica
//! in B receives). [`plan_stream_in`] is the receiving side's view of the same transfers.
//!
//! Execution composes the primitives: [`stream_out`] gathers each source region into a staging
//! buffer and flushes it as one chunk; [`stream_in`] fetches each expected chunk, verifies it and
//! scatters it into place.

use std::ops::Range;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::cache::{CacheError, KvCache};
use crate::chunk::{ChunkDescriptor, ChunkKey};
use crate::layout::KvLayout;
use crate::memory::StagingPool;
use crate::placement::{Setup, SetupError, WorkerId};
use crate::region::KvRegion;
use crate::store::{ChunkStore, Started, StoreError};

/// Errors of `stream_out` / `stream_in`.
#[derive(Debug, Error)]
pub enum StreamError {
    /// The setups do not fit together.
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// Gather or scatter failed.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// Flush or fetch failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A transfer names a microbatch with no cache.
    #[error("no cache for microbatch {0}")]
    NoCache(u32),
    /// A fetched chunk is not the one the plan expects.
    #[error("unexpected chunk: {0}")]
    Unexpected(String),
    /// A copy on the GPU failed.
    #[error(transparent)]
    Cuda(#[from] crate::cuda::CudaError),
}

/// A worker-local region: which microbatch cache, and which layers, slots and heads in it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LocalRegion {
    /// Microbatch (cache) index on that worker.
    pub microbatch: u32,
    /// Local layers.
    pub layers: Range<u32>,
    /// Local slots.
    pub slots: Range<u32>,
    /// Local heads.
    pub heads: Range<u32>,
}

impl LocalRegion {
    /// The cache region for `tokens`.
    pub fn with_tokens(&self, tokens: Range<u32>) -> KvRegion {
        KvRegion::new(self.layers.clone(), self.slots.clone(), self.heads.clone(), tokens)
    }
}

/// One piece of KV a source worker sends to a destination worker.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Transfer {
    /// Sending worker (setup A).
    pub source: WorkerId,
    /// Receiving worker (setup B).
    pub destination: WorkerId,
    /// Region at the source.
    pub from: LocalRegion,
    /// Region at the destination (same shape).
    pub to: LocalRegion,
}

impl Transfer {
    /// A transfer that keeps its coordinates: `region`'s layers, slots and heads of microbatch
    /// `microbatch`, from `source` to `destination` (tokens are chosen at each send). What a
    /// flush to a store and the fetch back into the same place use.
    pub fn in_place(source: WorkerId, destination: WorkerId, microbatch: u32, region: &KvRegion) -> Self {
        let local = LocalRegion {
            microbatch,
            layers: region.layers.clone(),
            slots: region.slots.clone(),
            heads: region.heads.clone(),
        };
        Self { source, destination, from: local.clone(), to: local }
    }
}

fn intersect(a: &Range<u32>, b: &Range<u32>) -> Option<Range<u32>> {
    let r = a.start.max(b.start)..a.end.min(b.end);
    (r.start < r.end).then_some(r)
}

fn shift(r: &Range<u32>, base: u32) -> Range<u32> {
    r.start - base..r.end - base
}

/// What `source` (a worker of `a`) must send so that every worker of `b` holds its KV.
///
/// A worker holding a non-primary GQA replica sends nothing: the primary holder covers its heads.
pub fn plan_stream_out(a: &Setup, source: WorkerId, b: &Setup) -> Result<Vec<Transfer>, StreamError> {
    a.check_compatible(b)?;
    let src = a.holding(source)?;
    if !src.primary {
        return Ok(Vec::new());
    }
    let mut transfers = Vec::new();
    for destination in b.workers() {
        let dst = b.holding(destination)?;
        let (Some(layers), Some(heads)) =
            (intersect(&src.layers, &dst.layers), intersect(&src.heads, &dst.heads))
        else {
            continue;
        };
        for ma in 0..a.microbatches() {
            let reqs_a = a.microbatch_requests(ma);
            for mb in 0..b.microbatches() {
                let reqs_b = b.microbatch_requests(mb);
                let Some(reqs) = intersect(&reqs_a, &reqs_b) else {
                    continue;
                };
                transfers.push(Transfer {
                    source,
                    destination,
                    from: LocalRegion {
                        microbatch: ma,
                        layers: shift(&layers, src.layers.start),
                        slots: shift(&reqs, reqs_a.start),
                        heads: shift(&heads, src.heads.start),
                    },
                    to: LocalRegion {
                        microbatch: mb,
                        layers: shift(&layers, dst.layers.start),
                        slots: shift(&reqs, reqs_b.start),
                        heads: shift(&heads, dst.heads.start),
                    },
                });
            }
        }
    }
    Ok(transfers)
}

/// Every transfer `destination` (a worker of `b`) receives from the workers of `a`.
pub fn plan_stream_in(a: &Setup, b: &Setup, destination: WorkerId) -> Result<Vec<Transfer>, StreamError> {
    b.holding(destination)?;
    let mut transfers = Vec::new();
    for source in a.workers() {
        transfers.extend(plan_stream_out(a, source, b)?.into_iter().filter(|t| t.destination == destination));
    }
    Ok(transfers)
}

/// Totals of a stream operation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Chunks moved.
    pub chunks: u64,
    /// Payload bytes moved.
    pub bytes: u64,
    /// Time spent gathering or scattering.
    pub copy_time: Duration,
    /// Time spent flushing or fetching.
    pub io_time: Duration,
}

/// The chunk key `transfer` is stored under for `tokens`.
pub fn transfer_key(transfer: &Transfer, tokens: Range<u32>) -> ChunkKey {
    ChunkKey {
        destination: transfer.destination,
        microbatch: transfer.to.microbatch,
        region: transfer.to.with_tokens(tokens),
    }
}

/// What one chunk cost to send or receive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkReceipt {
    /// The chunk's key.
    pub key: ChunkKey,
    /// Payload bytes.
    pub bytes: u64,
    /// Time gathering or scattering, as a step of its own (zero where a store took the bytes as
    /// they were gathered: [`ChunkStore::put_gathered`]).
    pub copy_time: Duration,
    /// Time flushing or fetching (with the gather, where it was part of the flush).
    pub io_time: Duration,
}

impl StreamStats {
    fn add(&mut self, r: &ChunkReceipt) {
        // An empty token range moves no chunk.
        if r.bytes == 0 {
            return;
        }
        self.chunks += 1;
        self.bytes += r.bytes;
        self.copy_time += r.copy_time;
        self.io_time += r.io_time;
    }
}

/// Sends `tokens` of one transfer from `cache` (the source's cache of `transfer.from.microbatch`):
/// gathers the region into a pooled staging buffer and flushes it to `store` as one chunk.
pub fn send(
    cache: &KvCache,
    transfer: &Transfer,
    tokens: Range<u32>,
    pool: &StagingPool,
    store: &mut dyn ChunkStore,
) -> Result<ChunkReceipt, StreamError> {
    send_with(cache, transfer, tokens, pool, store, Flush::Whole).map(|(receipt, _)| receipt)
}

/// A send the store may leave in flight ([`start_send`]).
#[derive(Debug)]
pub enum Sending {
    /// The chunk is flushed.
    Done(ChunkReceipt),
    /// The store no longer needs the cache's bytes, and finishes the put later
    /// ([`ChunkStore::finish_put`]); [`InFlight::finish`] makes the receipt of its outcome.
    InFlight(InFlight),
}

/// A send left in flight by its store.
#[derive(Debug)]
pub struct InFlight {
    /// The receipt as the store left the put, timed until then.
    receipt: ChunkReceipt,
    /// When the store left the put in flight.
    left: Instant,
    ticket: u64,
}

impl InFlight {
    /// What names its put to [`ChunkStore::finish_put`].
    pub fn ticket(&self) -> u64 {
        self.ticket
    }

    /// The receipt of the send, now that its put is over, timed until now: its `io_time` runs
    /// until the put is over, and so takes in whatever the caller did meanwhile (the next send's
    /// gather), so that the `io_time`s of overlapping sends add up to more than their wall time.
    pub fn finish(mut self) -> ChunkReceipt {
        self.receipt.io_time += self.left.elapsed();
        self.receipt
    }
}

/// As [`send`], but a store that keeps the chunk before its put is over (a sidecar, which then
/// forwards it) may leave the put in flight ([`ChunkStore::start_put_gathered`]): the next send's
/// gather then overlaps its end. The caller finishes it with [`ChunkStore::finish_put`].
pub fn start_send(
    cache: &KvCache,
    transfer: &Transfer,
    tokens: Range<u32>,
    pool: &StagingPool,
    store: &mut dyn ChunkStore,
) -> Result<Sending, StreamError> {
    let receipt = send_with(cache, transfer, tokens, pool, store, Flush::MayStayInFlight)?;
    Ok(match receipt {
        (receipt, None) => Sending::Done(receipt),
        (receipt, Some(ticket)) => Sending::InFlight(InFlight { receipt, left: Instant::now(), ticket }),
    })
}

/// Whether a send waits for its put to be over.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Flush {
    Whole,
    MayStayInFlight,
}

/// [`send`] and [`start_send`]: the receipt, and the ticket of the put if it was left in flight.
fn send_with(
    cache: &KvCache,
    transfer: &Transfer,
    tokens: Range<u32>,
    pool: &StagingPool,
    store: &mut dyn ChunkStore,
    flush: Flush,
) -> Result<(ChunkReceipt, Option<u64>), StreamError> {
    let region = transfer.from.with_tokens(tokens.clone());
    let packing = cache.layout().preferred_packing();
    // Checked before sizing the staging lease, so a bad region is an error, not a huge allocation.
    cache.layout().check_region(&region).map_err(CacheError::from)?;
    if region.is_empty() {
        // Nothing to move (a step with no new tokens).
        let key = transfer_key(transfer, tokens);
        let receipt = ChunkReceipt { key, bytes: 0, copy_time: Duration::ZERO, io_time: Duration::ZERO };
        return Ok((receipt, None));
    }
    let started = Instant::now();
    let mut staging = pool.lease(cache.packed_len(&region) as usize);
    let plan = cache.gather_plan(&region, packing)?;
    let descriptor = describe(cache.layout(), transfer, tokens)?;
    // Gathered into the store's own memory where it has some (a sidecar's shared region): the
    // gather and the hand-over are then one step, timed as the flush.
    let (copy_time, in_flight) = match flush {
        Flush::Whole => (store.put_gathered(&descriptor, cache, &plan, &mut staging)?, None),
        Flush::MayStayInFlight => match store.start_put_gathered(&descriptor, cache, &plan, &mut staging)? {
            Started::Done(copy_time) => (copy_time, None),
            Started::InFlight { gathered, ticket } => (gathered, Some(ticket)),
        },
    };
    let receipt = ChunkReceipt {
        key: descriptor.key(),
        bytes: staging.len() as u64,
        copy_time,
        io_time: started.elapsed().saturating_sub(copy_time),
    };
    Ok((receipt, in_flight))
}

/// The descriptor of the chunk that carries `tokens` of one transfer out of a cache laid out as
/// `layout`.
pub(crate) fn describe(
    layout: &KvLayout,
    transfer: &Transfer,
    tokens: Range<u32>,
) -> Result<ChunkDescriptor, StreamError> {
    let shape = transfer.from.with_tokens(tokens.clone()).shape();
    Ok(ChunkDescriptor {
        source: transfer.source,
        destination: transfer.destination,
        microbatch: transfer.to.microbatch,
        region: transfer.to.with_tokens(tokens),
        spec: layout.spec().share(shape.layers, shape.heads).map_err(SetupError::from)?,
        packing: layout.preferred_packing(),
    })
}

/// Gathers `tokens` of one transfer from `cache` into a chunk of its own, to flush later (or many
/// at once): what [`send`] flushes, as its descriptor and an owned payload.
pub fn pack(
    cache: &KvCache,
    transfer: &Transfer,
    tokens: Range<u32>,
) -> Result<(ChunkDescriptor, Vec<u8>), StreamError> {
    let region = transfer.from.with_tokens(tokens.clone());
    cache.layout().check_region(&region).map_err(CacheError::from)?;
    let descriptor = describe(cache.layout(), transfer, tokens)?;
    let mut payload = vec![0u8; cache.packed_len(&region) as usize];
    cache.gather(&region, descriptor.packing, &mut payload)?;
    Ok((descriptor, payload))
}

/// Receives `tokens` of one transfer into `cache` (the destination's cache of
/// `transfer.to.microbatch`): fetches the chunk into `payload`, checks that it is the region the plan
/// expects and that its checksum holds, then scatters it.
pub fn receive(
    cache: &KvCache,
    transfer: &Transfer,
    tokens: Range<u32>,
    store: &mut dyn ChunkStore,
    payload: &mut Vec<u8>,
) -> Result<ChunkReceipt, StreamError> {
    let key = transfer_key(transfer, tokens.clone());
    if key.region.is_empty() {
        cache.layout().check_region(&key.region).map_err(CacheError::from)?;
        return Ok(ChunkReceipt { key, bytes: 0, copy_time: Duration::ZERO, io_time: Duration::ZERO });
    }
    let started = Instant::now();
    // Scattered from the store's own bytes where it holds them in memory: no copy first.
    let (descriptor, fetched) = store.get_payload(&key, payload)?;
    let io_time = started.elapsed();
    let mut receipt = install(cache, transfer, tokens, &descriptor, &fetched)?;
    receipt.io_time = io_time;
    Ok(receipt)
}

/// Scatters a chunk fetched for `tokens` of one transfer (`descriptor` and `payload`, its checksum
/// already verified by the store) into `cache`, after checking that it is the region the plan
/// expects: what [`receive`] does once it has the chunk, for callers that fetch many at once.
pub fn install(
    cache: &KvCache,
    transfer: &Transfer,
    tokens: Range<u32>,
    descriptor: &ChunkDescriptor,
    payload: &[u8],
) -> Result<ChunkReceipt, StreamError> {
    let key = transfer_key(transfer, tokens);
    let started = Instant::now();
    if descriptor.key() != key
        || descriptor.source != transfer.source
        || !descriptor.spec.same_elements(cache.layout().spec())
    {
        return Err(StreamError::Unexpected(format!(
            "chunk {} from {:?} holding {:?}; plan expects {} from {:?} holding {:?}",
            descriptor.key().file_name(),
            descriptor.source,
            descriptor.spec,
            key.file_name(),
            transfer.source,
            cache.layout().spec()
        )));
    }
    cache.scatter(&descriptor.region, descriptor.packing, payload)?;
    Ok(ChunkReceipt {
        key,
        bytes: payload.len() as u64,
        copy_time: started.elapsed(),
        io_time: Duration::ZERO,
    })
}

/// `stream_out` at one source worker: sends `tokens` of every transfer, taking each source region
/// from `caches[transfer.from.microbatch]`.
pub fn stream_out(
    caches: &[&KvCache],
    transfers: &[Transfer],
    tokens: Range<u32>,
    pool: &StagingPool,
    store: &mut dyn ChunkStore,
) -> Result<StreamStats, StreamError> {
    let mut stats = StreamStats::default();
    for t in transfers {
        let cache = caches.get(t.from.microbatch as usize).ok_or(StreamError::NoCache(t.from.microbatch))?;
        stats.add(&send(cache, t, tokens.clone(), pool, store)?);
    }
    Ok(stats)
}

/// `stream_in` at one destination worker: receives `tokens` of every expected transfer into
/// `caches[transfer.to.microbatch]`. A missing, corrupt or unexpected chunk is an error and is
/// never scattered.
pub fn stream_in(
    caches: &[&KvCache],
    expected: &[Transfer],
    tokens: Range<u32>,
    store: &mut dyn ChunkStore,
) -> Result<StreamStats, StreamError> {
    let mut stats = StreamStats::default();
    let mut payload = Vec::new();
    for t in expected {
        let cache = caches.get(t.to.microbatch as usize).ok_or(StreamError::NoCache(t.to.microbatch))?;
        stats.add(&receive(cache, t, tokens.clone(), store, &mut payload)?);
    }
    Ok(stats)
}

impl Transfer {
    /// A transfer that keeps the same region (swap-out, replication to a peer of the same shape).
    pub fn same_region(source: WorkerId, destination: WorkerId, region: LocalRegion) -> Self {
        Self { source, destination, from: region.clone(), to: region }
    }

    /// The part of this transfer that carries source-local layer `layer`, if any.
    pub fn layer(&self, layer: u32) -> Option<Transfer> {
        if !self.from.layers.contains(&layer) {
            return None;
        }
        let to_layer = self.to.layers.start + (layer - self.from.layers.start);
        Some(Transfer {
            source: self.source,
            destination: self.destination,
            from: LocalRegion { layers: layer..layer + 1, ..self.from.clone() },
            to: LocalRegion { layers: to_layer..to_layer + 1, ..self.to.clone() },
        })
    }
}
