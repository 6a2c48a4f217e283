//! A blocking [`ChunkStore`] over a [`PeerClient`], for the streamer thread and resharding.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::runtime::Handle;

use super::client::{ClientConfig, Fetched, PeerClient};
use super::error::PeerError;
use super::transport::Transport;
use crate::chunk::{ChunkDescriptor, ChunkKey, SequencePlace};
use crate::store::{ChunkStore, StoreError};
use crate::wire::ErrorCode;

/// A [`ChunkStore`] whose chunks live on a [`super::PeerServer`]: remote flush and fetch.
///
/// Its calls block the calling thread on `runtime`; call them from outside the runtime's worker
/// threads (the streamer thread, a plain thread). A request cut off by a broken connection, or a
/// put whose chunk the peer found corrupted on arrival, is tried once more: puts and gets are
/// idempotent.
pub struct PeerStore {
    client: PeerClient,
    runtime: Handle,
}

impl PeerStore {
    /// A store on the peer at `addr`, driven by `runtime`.
    pub fn new(
        runtime: Handle,
        transport: Arc<dyn Transport>,
        addr: SocketAddr,
        config: ClientConfig,
    ) -> Self {
        Self { client: PeerClient::new(transport, addr, config), runtime }
    }

    /// The client underneath (for concurrent async use, epochs and counters).
    pub fn client(&self) -> &PeerClient {
        &self.client
    }

    /// Pushes a chunk already encoded (header, then payload, as a store keeps it) without hashing
    /// it again ([`PeerClient::put_encoded`]); tried once more as [`ChunkStore::put`] is.
    pub fn put_encoded(&mut self, encoded: &[u8]) -> Result<(), StoreError> {
        let result = match self.runtime.block_on(self.client.put_encoded(encoded)) {
            Err(PeerError::ConnectionLost(_) | PeerError::Refused { code: ErrorCode::BadChunk, .. }) => {
                self.runtime.block_on(self.client.put_encoded(encoded))
            }
            other => other,
        };
        result.map_err(StoreError::from)
    }

    /// Fetches the chunks under `keys`, as many in flight at once as the client allows (one round
    /// trip each would leave the link idle most of the time); each verified, each result in the
    /// order of `keys`. A request cut off by a broken connection is tried once more.
    pub fn get_many(&self, keys: &[ChunkKey]) -> Vec<Result<Fetched, StoreError>> {
        let tasks: Vec<_> = keys
            .iter()
            .map(|key| {
                let (client, key) = (self.client.clone(), key.clone());
                self.runtime.spawn(async move {
                    let fetched = match client.get(&key).await {
                        Err(PeerError::ConnectionLost(_)) => client.get(&key).await,
                        other => other,
                    };
                    fetched.map_err(|e| fetch_error(&key, e))
                })
            })
            .collect();
        tasks.into_iter().map(|task| self.runtime.block_on(task).unwrap_or_else(|e| Err(joined(e)))).collect()
    }

    /// Pushes `chunks` (descriptor and payload each), as many in flight at once as the client's
    /// byte budget allows; each result in the order of `chunks`. A put cut off by a broken
    /// connection, or whose chunk arrived corrupted, is tried once more.
    pub fn put_many(&self, chunks: Vec<(ChunkDescriptor, Vec<u8>)>) -> Vec<Result<(), StoreError>> {
        let tasks: Vec<_> = chunks
            .into_iter()
            .map(|(descriptor, payload)| {
                let client = self.client.clone();
                self.runtime.spawn(async move {
                    let put = match client.put(&descriptor, &payload).await {
                        Err(
                            PeerError::ConnectionLost(_)
                            | PeerError::Refused { code: ErrorCode::BadChunk, .. },
                        ) => client.put(&descriptor, &payload).await,
                        other => other,
                    };
                    put.map_err(StoreError::from)
                })
            })
            .collect();
        tasks.into_iter().map(|task| self.runtime.block_on(task).unwrap_or_else(|e| Err(joined(e)))).collect()
    }
}

fn fetch_error(key: &ChunkKey, e: PeerError) -> StoreError {
    match e {
        PeerError::NotFound => StoreError::NotFound(Box::new(key.clone())),
        e => e.into(),
    }
}

/// A request task that panicked or was cancelled, as a store error.
fn joined(e: tokio::task::JoinError) -> StoreError {
    StoreError::from(PeerError::Protocol(format!("a request task failed: {e}")))
}

impl ChunkStore for PeerStore {
    fn put(&mut self, descriptor: &ChunkDescriptor, payload: &[u8]) -> Result<(), StoreError> {
        let result = match self.runtime.block_on(self.client.put(descriptor, payload)) {
            Err(PeerError::ConnectionLost(_) | PeerError::Refused { code: ErrorCode::BadChunk, .. }) => {
                self.runtime.block_on(self.client.put(descriptor, payload))
            }
            other => other,
        };
        result.map_err(StoreError::from)
    }

    fn get(&mut self, key: &ChunkKey, out: &mut Vec<u8>) -> Result<ChunkDescriptor, StoreError> {
        let fetched = match self.runtime.block_on(self.client.get(key)) {
            Err(PeerError::ConnectionLost(_)) => self.runtime.block_on(self.client.get(key)),
            other => other,
        };
        let chunk = fetched.map_err(|e| fetch_error(key, e))?;
        out.clear();
        out.extend_from_slice(chunk.payload());
        Ok(chunk.descriptor)
    }

    fn release(&mut self, place: &SequencePlace) -> Result<u64, StoreError> {
        let released = match self.runtime.block_on(self.client.release(place)) {
            Err(PeerError::ConnectionLost(_)) => self.runtime.block_on(self.client.release(place)),
            other => other,
        };
        released.map_err(StoreError::from)
    }
}
