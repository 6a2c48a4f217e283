//! Flush and fetch: where chunks go and come back from, verified on the way in.
//!
//! A [`ChunkStore`] keeps chunks by [`ChunkKey`]. `put` is the paper's `flush` (one contiguous chunk
//! out), `get` its `fetch`. Every store checks the chunk's checksums on `get`, so a truncated or
//! corrupted chunk is reported and never handed to a scatter. Remote peers implement the same trait
//! over a transport.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::cache::{GatherPlan, KvCache};
use crate::checksum::{xxh3_64, Checksum};
use crate::chunk::{ChunkDescriptor, ChunkError, ChunkKey, SequencePlace, HEADER_LEN};
use crate::copy;

mod file;
mod host;
mod pool;

pub use file::{ChunkWriter, FileStore};
pub use host::{HostStore, PUT_LOG_LEN};

/// Errors of chunk stores.
#[derive(Debug, Error)]
pub enum StoreError {
    /// No chunk under that key.
    #[error("no chunk {0:?}")]
    NotFound(Box<ChunkKey>),
    /// The chunk failed verification.
    #[error("chunk {key}: {source}")]
    Chunk {
        /// Where it was read from.
        key: String,
        /// What is wrong with it.
        source: ChunkError,
    },
    /// The payload does not match its descriptor.
    #[error("payload of {got} bytes, descriptor needs {expected}")]
    PayloadLength {
        /// Bytes the descriptor's region takes.
        expected: u64,
        /// Bytes given.
        got: u64,
    },
    /// The payload could not be gathered (a plan of another cache, a staging buffer of the
    /// wrong length).
    #[error("gather: {0}")]
    Gather(Box<crate::CacheError>),
    /// The store cannot do this.
    #[error("this store cannot {0}")]
    Unsupported(&'static str),
    /// An I/O error (disk full, permissions, ...).
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
}

/// A place chunks are flushed to and fetched from.
pub trait ChunkStore: Send {
    /// Flushes one chunk: `payload` packed as `descriptor` says. Replaces a chunk with the same key.
    fn put(&mut self, descriptor: &ChunkDescriptor, payload: &[u8]) -> Result<(), StoreError>;

    /// Flushes the region `plan` gathers from `cache` as `descriptor` says, through `staging`
    /// (exactly the region's packed length). By default it gathers into `staging` and puts that;
    /// a store that can take the bytes where they are gathered (a file as each piece is gathered,
    /// a sidecar's shared region) saves that copy and checksums each piece while it is in cache.
    /// Returns the time the gather took as a step of its own: zero where it was part of the put.
    fn put_gathered(
        &mut self,
        descriptor: &ChunkDescriptor,
        cache: &KvCache,
        plan: &GatherPlan,
        staging: &mut [u8],
    ) -> Result<Duration, StoreError> {
        check_plan(descriptor, plan)?;
        let started = Instant::now();
        cache.gather_with(plan, staging).map_err(|e| StoreError::Gather(Box::new(e)))?;
        let gathered = started.elapsed();
        self.put(descriptor, staging)?;
        Ok(gathered)
    }

    /// Starts flushing the region `plan` gathers from `cache`, as [`ChunkStore::put_gathered`]
    /// does, but a store that keeps a chunk before it finishes the put (a sidecar, which keeps it,
    /// then forwards it to its successor) may return as soon as it no longer needs `staging` or
    /// its own memory: [`Started::InFlight`], with a ticket. The put is then over only once
    /// [`ChunkStore::finish_put`] says so for that ticket; the next put's gather overlaps its end.
    /// Any other call of the store waits for the puts in flight first (their outcomes are kept
    /// for `finish_put`). By default the put is over on return.
    fn start_put_gathered(
        &mut self,
        descriptor: &ChunkDescriptor,
        cache: &KvCache,
        plan: &GatherPlan,
        staging: &mut [u8],
    ) -> Result<Started, StoreError> {
        self.put_gathered(descriptor, cache, plan, staging).map(Started::Done)
    }

    /// Waits for the put [`ChunkStore::start_put_gathered`] left in flight with `ticket` and
    /// returns its outcome; `None` when no put in flight has that ticket (it was finished
    /// already, or never started).
    fn finish_put(&mut self, ticket: u64) -> Option<Result<(), StoreError>> {
        let _ = ticket;
        None
    }

    /// Fetches the chunk under `key` after verifying it, and returns its payload: by default
    /// fetched into `buffer` ([`ChunkStore::get`]); a store that holds it in memory hands out its
    /// own bytes, shared, saving the copy.
    fn get_payload<'a>(
        &mut self,
        key: &ChunkKey,
        buffer: &'a mut Vec<u8>,
    ) -> Result<(ChunkDescriptor, Payload<'a>), StoreError> {
        let descriptor = self.get(key, buffer)?;
        Ok((descriptor, Payload::Buffer(buffer)))
    }

    /// Fetches the chunk under `key` into `out` (resized to the payload) after verifying it.
    fn get(&mut self, key: &ChunkKey, out: &mut Vec<u8>) -> Result<ChunkDescriptor, StoreError>;

    /// Releases the sequence at `place`: drops every chunk kept there (any layers, heads and
    /// tokens); returns how many this store dropped. Releasing again drops nothing. A store that
    /// replicates (a sidecar) releases the replica too. Stores that keep no sequences apart
    /// refuse it ([`StoreError::Unsupported`]).
    fn release(&mut self, place: &SequencePlace) -> Result<u64, StoreError> {
        let _ = place;
        Err(StoreError::Unsupported("release"))
    }
}

/// How [`ChunkStore::start_put_gathered`] left a put. Each carries the time the gather took as a
/// step of its own, as [`ChunkStore::put_gathered`] returns it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Started {
    /// The put is over.
    Done(Duration),
    /// The store no longer needs the bytes; [`ChunkStore::finish_put`] with the ticket says when
    /// the put is over.
    InFlight {
        /// The time the gather took as a step of its own.
        gathered: Duration,
        /// What names this put to [`ChunkStore::finish_put`].
        ticket: u64,
    },
}

/// A fetched chunk's payload ([`ChunkStore::get_payload`]): in the caller's buffer, or the
/// store's own encoded chunk (header, then payload), shared.
pub enum Payload<'a> {
    /// Fetched into the caller's buffer.
    Buffer(&'a [u8]),
    /// The store's encoded chunk.
    Shared(Arc<Vec<u8>>),
}

impl std::ops::Deref for Payload<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Payload::Buffer(bytes) => bytes,
            Payload::Shared(chunk) => &chunk[HEADER_LEN..],
        }
    }
}

/// Bytes gathered before each piece is checksummed and handed on (written to a file, hashed in a
/// shared region): small enough to be checksummed (and written) while still in the last-level
/// cache, large enough that a write costs far more than a system call.
pub(crate) const GATHERED_PIECE: usize = 512 << 10;

/// Gathers `plan` from `cache` into `encoded` as the encoded chunk `descriptor` says: its header
/// (with the payload's checksum) in the first [`HEADER_LEN`] bytes, the payload after them
/// ([`gather_summed`]). `encoded` is exactly the header and the region's packed length long.
pub(crate) fn gather_encoded(
    descriptor: &ChunkDescriptor,
    cache: &KvCache,
    plan: &GatherPlan,
    encoded: &mut [u8],
) -> Result<(), StoreError> {
    let (header, payload) = encoded.split_at_mut(HEADER_LEN);
    let sum = gather_summed(cache, plan, payload)?;
    header.copy_from_slice(&descriptor.encode_header_with_checksum(payload.len() as u64, sum));
    Ok(())
}

/// Gathers `plan` from `cache` into `payload` (exactly the region's packed length) and returns the
/// payload's xxh3-64, each piece hashed as soon as it is gathered, while it is in cache. A small
/// region is hashed once gathered, still in cache: handing pieces to a hashing thread would cost
/// more than it overlaps.
fn gather_summed(cache: &KvCache, plan: &GatherPlan, payload: &mut [u8]) -> Result<u64, StoreError> {
    let gather_failed = |e| StoreError::Gather(Box::new(e));
    if (payload.len() as u64) < copy::PARALLEL_MIN_BYTES {
        cache.gather_with(plan, payload).map_err(gather_failed)?;
        return Ok(xxh3_64(payload));
    }
    let mut sum = Checksum::new();
    cache
        .gather_streamed(plan, payload, GATHERED_PIECE, |piece| {
            sum.update(piece);
            true
        })
        .map_err(gather_failed)?;
    Ok(sum.digest())
}

/// Refuses a gathered put that could not be read back ([`check_payload`]: `staging` is the
/// payload's place) or whose plan gathers another payload ([`check_plan`]).
pub(crate) fn check_gathered(
    descriptor: &ChunkDescriptor,
    plan: &GatherPlan,
    staging: &[u8],
) -> Result<(), StoreError> {
    check_payload(descriptor, staging)?;
    check_plan(descriptor, plan)
}

/// Refuses a plan whose payload is not the one `descriptor` describes: another shape of region,
/// or another packing. (The coordinates may differ: a resharding transfer gathers from its source
/// and describes the chunk where it lands.)
pub(crate) fn check_plan(descriptor: &ChunkDescriptor, plan: &GatherPlan) -> Result<(), StoreError> {
    if plan.region().shape() != descriptor.region.shape() || plan.packing() != descriptor.packing {
        return Err(StoreError::Chunk {
            key: descriptor.key().file_name(),
            source: ChunkError::Invalid("the plan gathers another shape of region or packing".into()),
        });
    }
    Ok(())
}

pub(crate) fn check_payload(descriptor: &ChunkDescriptor, payload: &[u8]) -> Result<(), StoreError> {
    // Refuse what a fetch would refuse: a chunk that cannot be read back is not flushed.
    descriptor
        .validate()
        .map_err(|source| StoreError::Chunk { key: descriptor.key().file_name(), source })?;
    let expected = descriptor.payload_len();
    if payload.len() as u64 != expected {
        return Err(StoreError::PayloadLength { expected, got: payload.len() as u64 });
    }
    Ok(())
}
