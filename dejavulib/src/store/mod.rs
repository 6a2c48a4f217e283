//! Flush and fetch: where chunks go and come back from, verified on the way in.
//!
//! A [`ChunkStore`] keeps chunks by [`ChunkKey`]. `put` is the paper's `flush` (one contiguous chunk
//! out), `get` its `fetch`. Every store checks the chunk's checksums on `get`, so a truncated or
//! corrupted chunk is reported and never handed to a scatter. Remote peers implement the same trait
//! over a transport.

use std::io;
use std::path::PathBuf;

use thiserror::Error;

use crate::chunk::{ChunkDescriptor, ChunkError, ChunkKey, SequencePlace};

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

fn check_payload(descriptor: &ChunkDescriptor, payload: &[u8]) -> Result<(), StoreError> {
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
