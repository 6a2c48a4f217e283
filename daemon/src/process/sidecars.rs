//! A stage's sidecars: its own through shared memory (the streamer hands it each step's KV through
//! [`ToSidecar`]), others (a recovery's restore sources) over the transport.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dejavulib::cache::GatherPlan;
use dejavulib::chunk::{ChunkDescriptor, ChunkKey, SequencePlace};
use dejavulib::local::LocalSidecar;
use dejavulib::net::{ClientConfig, PeerStore};
use dejavulib::store::{Started, StoreError};
use dejavulib::{ChunkStore, KvCache};
use parking_lot::Mutex;

use super::{ProcessError, Replication, StageStats};
use crate::transport::Transports;

/// A store on a sidecar, used by one writer at a time.
pub(super) type SharedStore = Arc<Mutex<dyn ChunkStore>>;

/// The stage's own sidecar as the streamer sees it: every chunk crosses shared memory, counted.
pub(super) struct ToSidecar {
    pub(super) local: Arc<Mutex<LocalSidecar>>,
    pub(super) stats: Arc<StageStats>,
    /// Set once the sidecar has closed the connection ([`Sidecars::lost`]).
    pub(super) lost: Arc<AtomicBool>,
    /// The ticket and bytes of each put left in flight: counted once it is over.
    pub(super) in_flight: VecDeque<(u64, usize)>,
}

impl ToSidecar {
    /// Counts a chunk of `bytes` the sidecar took, or notes that it is gone if `result` failed
    /// because it closed the connection.
    fn counted<T>(&self, result: Result<T, StoreError>, bytes: usize) -> Result<T, StoreError> {
        match &result {
            Ok(_) => {
                StageStats::add(&self.stats.copied_chunks, 1);
                StageStats::add(&self.stats.copied_bytes, bytes as u64);
            }
            Err(_) if self.local.lock().is_closed() => self.lost.store(true, Ordering::Relaxed),
            Err(_) => {}
        }
        result
    }
}

impl ChunkStore for ToSidecar {
    fn put(&mut self, descriptor: &ChunkDescriptor, payload: &[u8]) -> Result<(), StoreError> {
        let result = self.local.lock().put(descriptor, payload);
        self.counted(result, payload.len())
    }

    fn put_gathered(
        &mut self,
        descriptor: &ChunkDescriptor,
        cache: &KvCache,
        plan: &GatherPlan,
        staging: &mut [u8],
    ) -> Result<Duration, StoreError> {
        let result = self.local.lock().put_gathered(descriptor, cache, plan, staging);
        self.counted(result, staging.len())
    }

    /// Leaves the put in flight, as the sidecar connection does: the step's forward overlaps the
    /// next step's gather.
    fn start_put_gathered(
        &mut self,
        descriptor: &ChunkDescriptor,
        cache: &KvCache,
        plan: &GatherPlan,
        staging: &mut [u8],
    ) -> Result<Started, StoreError> {
        let started = self.local.lock().start_put_gathered(descriptor, cache, plan, staging);
        if let Ok(Started::InFlight { ticket, .. }) = started {
            self.in_flight.push_back((ticket, staging.len()));
            return started;
        }
        self.counted(started, staging.len())
    }

    fn finish_put(&mut self, ticket: u64) -> Option<Result<(), StoreError>> {
        let outcome = self.local.lock().finish_put(ticket)?;
        let at = self.in_flight.iter().position(|&(t, _)| t == ticket);
        let bytes = at.and_then(|at| self.in_flight.remove(at)).map_or(0, |(_, bytes)| bytes);
        Some(self.counted(outcome, bytes))
    }

    fn get(&mut self, key: &ChunkKey, out: &mut Vec<u8>) -> Result<ChunkDescriptor, StoreError> {
        self.local.lock().get(key, out)
    }

    fn release(&mut self, place: &SequencePlace) -> Result<u64, StoreError> {
        self.local.lock().release(place)
    }
}

/// The sidecars of a replicating stage: its own, through shared memory, and others over the
/// transport (its successor's, to restore from after a replacement or to copy KV to).
pub(super) struct Sidecars {
    pub(super) local: Arc<Mutex<LocalSidecar>>,
    /// Whether the stage's own sidecar closed the connection (it died, a newer engine took its
    /// place, or it dropped the connection after an error). The stage then computes no more
    /// steps, none of which could be kept or copied: the next one it is sent stops the process,
    /// so the controller hears it fall silent and fences it (with its sidecar, if that died), and
    /// the steps to recompute stay as few as the copies in flight.
    pub(super) lost: Arc<AtomicBool>,
    /// How the stage talks to another sidecar: as its node, in its epoch, over its transport.
    client: ClientConfig,
    transports: Transports,
    /// Stores on other sidecars, kept: a recovery restores or copies one sequence after another
    /// from the same sidecar, over one connection (a QUIC handshake each would add up).
    peers: Mutex<std::collections::HashMap<SocketAddr, Arc<PeerStore>>>,
    runtime: tokio::runtime::Runtime,
}

impl Sidecars {
    pub(super) fn new(
        replication: &Replication,
        (node, epoch): (u32, u64),
        secret: &[u8],
        transports: Transports,
    ) -> Result<Self, ProcessError> {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let mut client = ClientConfig::new(secret.to_vec(), node);
        client.epoch = epoch;
        // A dead sidecar is given up on quickly: two connection attempts of at most 500 ms.
        client.connect_attempts = 2;
        client.connect_timeout = Duration::from_millis(500);
        let local = LocalSidecar::connect(&replication.local, epoch, replication.successor)
            .map_err(|e| ProcessError::Sidecar(format!("{}: {e}", replication.local.display())))?;
        let peers = Mutex::new(std::collections::HashMap::new());
        let (local, lost) = (Arc::new(Mutex::new(local)), Arc::new(AtomicBool::new(false)));
        Ok(Self { local, lost, client, transports, peers, runtime })
    }

    /// A store on the sidecar at `addr`, over the transport (the same one each time).
    pub(super) fn peer_store(&self, addr: SocketAddr) -> Result<Arc<PeerStore>, ProcessError> {
        if let Some(store) = self.peers.lock().get(&addr) {
            return Ok(store.clone());
        }
        let transport = self.transports.make().map_err(|e| ProcessError::Sidecar(e.to_string()))?;
        let store =
            Arc::new(PeerStore::new(self.runtime.handle().clone(), transport, addr, self.client.clone()));
        self.peers.lock().insert(addr, store.clone());
        Ok(store)
    }
}
