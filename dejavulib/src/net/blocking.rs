//! A blocking [`ChunkStore`] over a [`PeerClient`], for the streamer thread and resharding.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::runtime::Handle;

use super::client::{ClientConfig, PeerClient};
use super::error::PeerError;
use super::transport::Transport;
use crate::chunk::{ChunkDescriptor, ChunkKey};
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
        match fetched {
            Ok(chunk) => {
                out.clear();
                out.extend_from_slice(chunk.payload());
                Ok(chunk.descriptor)
            }
            Err(PeerError::NotFound) => Err(StoreError::NotFound(Box::new(key.clone()))),
            Err(e) => Err(e.into()),
        }
    }
}
