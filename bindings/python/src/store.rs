//! Stores (files, host memory, a remote peer), the peer server, and flush / fetch.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, OnceLock};

use dejavulib::chunk::SequencePlace;
use dejavulib::file_io::FileBackend;
use dejavulib::local::LocalSidecar;
use dejavulib::net::tcp::TcpTransport;
use dejavulib::net::{ClientConfig, PeerServer, PeerStore, ServerConfig, Transport};
use dejavulib::reshard::{install, receive, send, transfer_key};
use dejavulib::restore::{restore_from_sidecar, RestoreError};
use dejavulib::resume::ResumePoint;
use dejavulib::store::StoreError as ChunkStoreError;
use dejavulib::{ChunkStore, FileStore, HostStore, KvCache, KvRegion, Transfer, WorkerId};
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::cache::PyCache;
use crate::errors::*;
use crate::layout::*;

/// A store shared by Python calls and a streamer thread, each use under the lock: any store, as a
/// [`SharedStore`], or the sidecar connection itself (for `recovery`), sharing the same lock.
pub(crate) struct Shared<S: ?Sized>(pub(crate) Arc<Mutex<S>>);

/// Any store, shared.
pub(crate) type SharedStore = Shared<dyn ChunkStore>;

impl<S: ?Sized> Clone for Shared<S> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<S: ChunkStore + ?Sized> ChunkStore for Shared<S> {
    fn put(
        &mut self,
        descriptor: &dejavulib::chunk::ChunkDescriptor,
        payload: &[u8],
    ) -> Result<(), ChunkStoreError> {
        self.0.lock().put(descriptor, payload)
    }

    fn put_gathered(
        &mut self,
        descriptor: &dejavulib::chunk::ChunkDescriptor,
        cache: &dejavulib::KvCache,
        plan: &dejavulib::cache::GatherPlan,
        staging: &mut [u8],
    ) -> Result<std::time::Duration, ChunkStoreError> {
        self.0.lock().put_gathered(descriptor, cache, plan, staging)
    }

    fn start_put_gathered(
        &mut self,
        descriptor: &dejavulib::chunk::ChunkDescriptor,
        cache: &dejavulib::KvCache,
        plan: &dejavulib::cache::GatherPlan,
        staging: &mut [u8],
    ) -> Result<dejavulib::store::Started, ChunkStoreError> {
        self.0.lock().start_put_gathered(descriptor, cache, plan, staging)
    }

    fn finish_put(&mut self, ticket: u64) -> Option<Result<(), ChunkStoreError>> {
        self.0.lock().finish_put(ticket)
    }

    fn get(
        &mut self,
        key: &dejavulib::chunk::ChunkKey,
        out: &mut Vec<u8>,
    ) -> Result<dejavulib::chunk::ChunkDescriptor, ChunkStoreError> {
        self.0.lock().get(key, out)
    }

    fn release(&mut self, place: &SequencePlace) -> Result<u64, ChunkStoreError> {
        self.0.lock().release(place)
    }
}

/// Where chunks are flushed to and fetched from: `Store.file(path)`, `Store.host()`,
/// `Store.peer(address, secret)` or `Store.sidecar(path, successor)`.
#[pyclass(name = "Store", module = "dejavu", frozen)]
pub(crate) struct PyStore {
    pub(crate) inner: SharedStore,
    pub(crate) kind: &'static str,
    /// The sidecar connection (the same as `inner`), for a sidecar store.
    sidecar: Option<Shared<LocalSidecar>>,
    /// The peer (the same as `inner`), for a peer store: `fetch_chunks` keeps its fetches in
    /// flight together.
    peer: Option<Shared<PeerStore>>,
}

impl PyStore {
    fn new(store: impl ChunkStore + 'static, kind: &'static str) -> Self {
        let shared: Arc<Mutex<dyn ChunkStore>> = Arc::new(Mutex::new(store));
        Self { inner: Shared(shared), kind, sidecar: None, peer: None }
    }

    /// The sidecar connection; a `TypeError` for other stores.
    fn connection(&self) -> PyResult<&Shared<LocalSidecar>> {
        self.sidecar.as_ref().ok_or_else(|| {
            pyo3::exceptions::PyTypeError::new_err(format!(
                "needs a sidecar store, not a {} store",
                self.kind
            ))
        })
    }
}

fn sidecar_err(e: dejavulib::local::LocalError) -> PyErr {
    Error::new_err(format!("sidecar: {e}"))
}

/// A resume point as a dict: `destination`, `microbatch`, `slots`, `layers`, `heads`, `tokens`
/// and `chunks` (the `KvRegion`s to fetch).
fn point_dict(py: Python<'_>, p: ResumePoint) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let point = pyo3::types::PyDict::new(py);
    point.set_item("destination", (p.destination.stage, p.destination.rank))?;
    point.set_item("microbatch", p.microbatch)?;
    point.set_item("slots", py_range(&p.slots))?;
    point.set_item("layers", py_range(&p.layers))?;
    point.set_item("heads", py_range(&p.heads))?;
    point.set_item("tokens", p.tokens)?;
    let chunks: Vec<PyRegion> = p.chunks.into_iter().map(PyRegion).collect();
    point.set_item("chunks", chunks)?;
    Ok(point)
}

/// `serving` as a dict: `stage`, `epoch`, `successor` ("host:port" or None).
fn serving_dict<'py>(
    py: Python<'py>,
    serving: &dejavulib::local::Serving,
) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
    let out = pyo3::types::PyDict::new(py);
    out.set_item("stage", serving.stage)?;
    out.set_item("epoch", serving.epoch)?;
    out.set_item("successor", serving.successor.map(|a| a.to_string()))?;
    Ok(out)
}

#[pymethods]
impl PyStore {
    /// Chunk files in `path` (created if needed): io_uring where available, write-then-rename.
    #[staticmethod]
    fn file(path: std::path::PathBuf) -> PyResult<Self> {
        let store = FileStore::open(path, FileBackend::Auto).map_err(store_err)?;
        Ok(Self::new(store, "file"))
    }

    /// Chunks on a remote peer (a `PeerServer`, here or in another process) at `address`
    /// ("host:port"), over TCP with the cluster's HMAC handshake.
    #[staticmethod]
    #[pyo3(signature = (address, secret, node = 0, epoch = 0))]
    fn peer(address: &str, secret: &[u8], node: u32, epoch: u64) -> PyResult<Self> {
        let addr = resolve(address)?;
        let mut config = ClientConfig::new(secret.to_vec(), node);
        config.epoch = epoch;
        let transport: Arc<dyn Transport> = Arc::new(TcpTransport::plain());
        let store =
            Arc::new(Mutex::new(PeerStore::new(runtime()?.handle().clone(), transport, addr, config)));
        let shared: Arc<Mutex<dyn ChunkStore>> = store.clone();
        Ok(Self { inner: Shared(shared), kind: "peer", sidecar: None, peer: Some(Shared(store)) })
    }

    /// The engine's own sidecar (a `dejavud sidecar` process) at its local socket `path`: each
    /// chunk crosses a memory region shared with it; the sidecar keeps it (the local copy, which a
    /// restarted engine fetches back through shared memory) and forwards it to the sidecar at
    /// `successor` ("host:port", the next stage's; `"none"` for local copies only, in a ring of
    /// one stage; the engine's own sidecar is refused). `epoch` is the engine's: a newer one takes the sidecar over
    /// from an older engine, an older one is refused. With `member`, the sidecar reports the
    /// engine's liveness to the controller for it, for as long as this connection lasts (the
    /// engine's death is seen as soon as its process's connection closes).
    #[staticmethod]
    /// With `epoch=None`, the engine joins as a member in the epoch its sidecar gives it: the one
    /// the controller fenced the stage's engine in, for a replacement (`Store.epoch()` says).
    #[pyo3(signature = (path, successor, epoch = Some(0), member = false))]
    fn sidecar(
        py: Python<'_>,
        path: std::path::PathBuf,
        successor: &str,
        epoch: Option<u64>,
        member: bool,
    ) -> PyResult<Self> {
        let addr = match successor.trim() {
            "none" => dejavulib::local::Successor::LocalOnly,
            host_port => dejavulib::local::Successor::Sidecar(resolve(host_port)?),
        };
        let local = py
            .detach(|| match (epoch, member) {
                (None, _) => LocalSidecar::join(&path, addr),
                (Some(epoch), true) => LocalSidecar::connect_as_member(&path, epoch, addr),
                (Some(epoch), false) => LocalSidecar::connect(&path, epoch, addr),
            })
            .map_err(|e| Error::new_err(format!("sidecar at {}: {e}", path.display())))?;
        let connection = Arc::new(Mutex::new(local));
        let shared: Arc<Mutex<dyn ChunkStore>> = connection.clone();
        Ok(Self { inner: Shared(shared), kind: "sidecar", sidecar: Some(Shared(connection)), peer: None })
    }

    /// A reader of the sidecar at its local socket `path`, beside the engine's own connection:
    /// `recovery()` lists what the sidecar keeps for its stage and `fetch` reads it; anything else
    /// is refused. For a scheduler in another process than its engine's workers.
    #[staticmethod]
    fn sidecar_reader(py: Python<'_>, path: std::path::PathBuf) -> PyResult<Self> {
        let local = py
            .detach(|| LocalSidecar::reader(&path))
            .map_err(|e| Error::new_err(format!("sidecar at {}: {e}", path.display())))?;
        let connection = Arc::new(Mutex::new(local));
        let shared: Arc<Mutex<dyn ChunkStore>> = connection.clone();
        Ok(Self { inner: Shared(shared), kind: "sidecar", sidecar: Some(Shared(connection)), peer: None })
    }

    /// The engine's epoch on its sidecar connection (sidecar stores only): the one it gave, or the
    /// one its sidecar gave it.
    fn epoch(&self) -> PyResult<u64> {
        Ok(self.connection()?.0.lock().epoch())
    }

    /// What the sidecar serves as (sidecar stores only): a dict with the `stage` (a spare's
    /// engine learns here the stage it was assigned), the `epoch` in force and the `successor`
    /// it forwards to (or None). A spare not assigned yet is an error.
    fn serving<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let connection = self.connection()?;
        let serving = py.detach(|| connection.0.lock().serving()).map_err(sidecar_err)?;
        serving_dict(py, &serving)
    }

    /// What the sidecar tells a (re)started engine (sidecar stores only): a dict with the
    /// `stage` it serves, the `epoch` in force, the `successor` it forwards to (or None), the
    /// number of the stage's own `chunks` it keeps, and `resume`: for each sequence
    /// (`destination`, `microbatch`, `slots`), the `layers` and `heads` its chunks cover, the
    /// `tokens` whose KV is held for all of them (from token 0, up to the first gap), and the
    /// `chunks` (`KvRegion`s) to `fetch` to restore it. The engine computes from `tokens` on.
    fn recovery<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let connection = self.connection()?;
        let recovery = py.detach(|| connection.0.lock().recovery()).map_err(sidecar_err)?;
        let resume =
            recovery.resume_points().into_iter().map(|p| point_dict(py, p)).collect::<PyResult<Vec<_>>>()?;
        let out = serving_dict(py, &recovery.serving)?;
        out.set_item("chunks", recovery.held.len())?;
        out.set_item("resume", resume)?;
        Ok(out)
    }

    /// What a restarted engine does first (sidecar stores only; `TypeError` otherwise): fetches
    /// each sequence of `worker` ((stage, rank)) that the sidecar keeps into `caches[microbatch]`
    /// (a dict of `KvCache`s; a microbatch not in it is listed, not fetched), through shared
    /// memory. Returns one dict per sequence, as `recovery()["resume"]` lists them, with
    /// `fetched`: the engine computes each from its `tokens` on.
    fn restore<'py>(
        &self,
        py: Python<'py>,
        worker: (u32, u32),
        caches: std::collections::HashMap<u32, PyRef<'py, PyCache>>,
    ) -> PyResult<Vec<Bound<'py, pyo3::types::PyDict>>> {
        let connection = self.connection()?;
        let me = WorkerId { stage: worker.0, rank: worker.1 };
        let caches: std::collections::HashMap<u32, Arc<KvCache>> =
            caches.into_iter().map(|(microbatch, cache)| (microbatch, cache.cache.clone())).collect();
        let restored = py.detach(|| {
            let mut sidecar = connection.0.lock();
            restore_from_sidecar(&mut sidecar, me, |microbatch| caches.get(&microbatch).map(|c| &**c))
        });
        let restored = restored.map_err(|e| match e {
            RestoreError::Sidecar(e) => sidecar_err(e),
            RestoreError::Fetch { error, .. } => stream_err(error),
        })?;
        restored
            .into_iter()
            .map(|r| {
                let point = point_dict(py, r.point)?;
                point.set_item("fetched", r.fetched)?;
                Ok(point)
            })
            .collect()
    }

    /// Releases the finished sequence in `slots` (a range, or (start, end)) of `microbatch` for
    /// `worker` ((stage, rank)): the store drops every chunk of it (a sidecar also has its
    /// successor drop the replica). Returns the chunks this store dropped; releasing again drops
    /// nothing. File stores cannot (`StoreError`).
    fn release(
        &self,
        py: Python<'_>,
        worker: (u32, u32),
        microbatch: u32,
        slots: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let place = SequencePlace {
            destination: self::worker(worker),
            microbatch,
            slots: range_arg(slots, "slots")?,
        };
        let mut store = self.inner.clone();
        py.detach(|| store.release(&place)).map_err(store_err)
    }

    /// Chunks in this process's memory.
    #[staticmethod]
    fn host() -> Self {
        Self::new(HostStore::new(), "host")
    }

    fn __repr__(&self) -> String {
        format!("Store({})", self.kind)
    }
}

/// The runtime that drives network I/O for this process's stores and servers.
pub(crate) fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    static RUNTIME: OnceLock<std::io::Result<tokio::runtime::Runtime>> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("dejavu-net")
                .enable_all()
                .build()
        })
        .as_ref()
        .map_err(|e| Error::new_err(format!("cannot start the network runtime: {e}")))
}

pub(crate) fn resolve(address: &str) -> PyResult<SocketAddr> {
    address
        .to_socket_addrs()
        .map_err(|e| PyValueError::new_err(format!("address {address:?}: {e}")))?
        .next()
        .ok_or_else(|| PyValueError::new_err(format!("address {address:?} resolves to nothing")))
}

/// A peer that keeps chunks flushed to it (a replica holder or swap space), serving TCP clients
/// that know the cluster secret. It stops when closed or garbage-collected.
#[pyclass(name = "PeerServer", module = "dejavu", frozen)]
pub(crate) struct PyPeerServer {
    pub(crate) server: Mutex<Option<PeerServer>>,
    pub(crate) address: SocketAddr,
}

#[pymethods]
impl PyPeerServer {
    /// Listens at `bind` ("host:port"; port 0 picks one) with the cluster `secret`.
    #[new]
    #[pyo3(signature = (secret, bind = "127.0.0.1:0", node = 0))]
    fn new(py: Python<'_>, secret: &[u8], bind: &str, node: u32) -> PyResult<Self> {
        let addr = resolve(bind)?;
        let config = ServerConfig::new(secret.to_vec(), node);
        let rt = runtime()?;
        let server = py
            .detach(|| rt.block_on(PeerServer::bind(&TcpTransport::plain(), addr, config, HostStore::new())))
            .map_err(|e| Error::new_err(format!("cannot listen at {bind}: {e}")))?;
        let address = server.addr();
        Ok(Self { server: Mutex::new(Some(server)), address })
    }

    /// "host:port" it listens at.
    #[getter]
    fn address(&self) -> String {
        self.address.to_string()
    }

    /// Chunks it holds.
    #[getter]
    fn chunks(&self) -> usize {
        self.server.lock().as_ref().map_or(0, |s| s.store().len())
    }

    /// Refuses requests from epochs below `epoch` from now on.
    fn set_epoch(&self, epoch: u64) {
        if let Some(server) = self.server.lock().as_ref() {
            server.set_epoch(epoch);
        }
    }

    /// Stops serving and closes every connection.
    fn close(&self) {
        if let Some(server) = self.server.lock().take() {
            // Dropped inside the runtime, which owns its tasks.
            let _guard = runtime().ok().map(|rt| rt.enter());
            drop(server);
        }
    }
}

pub(crate) fn worker(w: (u32, u32)) -> WorkerId {
    WorkerId { stage: w.0, rank: w.1 }
}

pub(crate) fn local_transfer(
    region: &KvRegion,
    source: (u32, u32),
    destination: (u32, u32),
    microbatch: u32,
) -> Transfer {
    Transfer::in_place(worker(source), worker(destination), microbatch, region)
}

/// Flushes `region` of `cache` to `store` as one checksummed chunk (gathered into one staging
/// buffer, written once). Returns the bytes flushed.
#[pyfunction]
#[pyo3(signature = (store, cache, region, source = (0, 0), destination = (0, 0), microbatch = 0))]
pub(crate) fn flush(
    py: Python<'_>,
    store: &PyStore,
    cache: &PyCache,
    region: &PyRegion,
    source: (u32, u32),
    destination: (u32, u32),
    microbatch: u32,
) -> PyResult<u64> {
    let transfer = local_transfer(&region.0, source, destination, microbatch);
    let tokens = region.0.tokens.clone();
    let receipt = py
        .detach(|| send(&cache.cache, &transfer, tokens, &cache.pool, &mut store.inner.clone()))
        .map_err(stream_err)?;
    Ok(receipt.bytes)
}

/// Fetches the chunk `flush` wrote for the same region, source, destination and microbatch,
/// verifies it and scatters it into `region` of `cache` (which may use another layout). With
/// `keep_in`, a sidecar store, that sidecar keeps the chunk as the engine's own and forwards it
/// nowhere: KV restored from a peer's replica becomes the local copy again. Returns the bytes
/// fetched.
#[pyfunction]
#[pyo3(signature = (store, cache, region, source = (0, 0), destination = (0, 0), microbatch = 0, keep_in = None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn fetch(
    py: Python<'_>,
    store: &PyStore,
    cache: &PyCache,
    region: &PyRegion,
    source: (u32, u32),
    destination: (u32, u32),
    microbatch: u32,
    keep_in: Option<&PyStore>,
) -> PyResult<u64> {
    let transfer = local_transfer(&region.0, source, destination, microbatch);
    let tokens = region.0.tokens.clone();
    let keeper = keep_in.map(PyStore::connection).transpose()?;
    let bytes = py
        .detach(|| {
            let mut payload = Vec::new();
            let mut store = store.inner.clone();
            let Some(keeper) = keeper.filter(|_| !tokens.is_empty()) else {
                return receive(&cache.cache, &transfer, tokens, &mut store, &mut payload).map(|r| r.bytes);
            };
            let descriptor = store.get(&transfer_key(&transfer, tokens.clone()), &mut payload)?;
            let receipt = install(&cache.cache, &transfer, tokens, &descriptor, &payload)?;
            let mut chunk = descriptor.encode_header(&payload).to_vec();
            chunk.extend_from_slice(&payload);
            keeper.0.lock().keep(&[&chunk])?;
            Ok(receipt.bytes)
        })
        .map_err(stream_err)?;
    Ok(bytes)
}

/// Chunks a peer's fetches keep in flight together, and at most in memory at once.
const FETCHES_IN_FLIGHT: usize = 64;

/// Fetches the chunks `flush` wrote for each of `regions` in turn (each with the same source,
/// destination and microbatch), verifies each and scatters it into its region of `cache`, until
/// one is not there. From a peer store the fetches are in flight together, up to 64 at once; from
/// others, one after another. With `keep_in`, a sidecar store, that sidecar keeps what was fetched
/// as the engine's own and forwards it nowhere, many chunks per request. Returns a dict:
/// `fetched`, the regions restored (a prefix of `regions`), `bytes`, their payload bytes, and
/// `error`, why it stopped early if not for a missing chunk (None otherwise).
#[pyfunction]
#[pyo3(signature = (store, cache, regions, source = (0, 0), destination = (0, 0), microbatch = 0, keep_in = None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn fetch_chunks<'py>(
    py: Python<'py>,
    store: &PyStore,
    cache: &PyCache,
    regions: Vec<PyRef<'py, PyRegion>>,
    source: (u32, u32),
    destination: (u32, u32),
    microbatch: u32,
    keep_in: Option<&PyStore>,
) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
    if let Some(i) = regions.iter().position(|r| r.0.tokens.is_empty()) {
        return Err(PyValueError::new_err(format!("region {i} has no tokens: no chunk holds it")));
    }
    let transfers: Vec<(Transfer, std::ops::Range<u32>)> = regions
        .iter()
        .map(|r| (local_transfer(&r.0, source, destination, microbatch), r.0.tokens.clone()))
        .collect();
    let keeper = keep_in.map(PyStore::connection).transpose()?;
    let (fetched, bytes, error) = py.detach(|| {
        let (mut fetched, mut bytes) = (0usize, 0u64);
        for batch in transfers.chunks(FETCHES_IN_FLIGHT) {
            let chunks = fetch_batch(store, batch);
            let mut kept: Vec<Vec<u8>> = Vec::new();
            let mut stopped = None;
            for ((transfer, tokens), chunk) in batch.iter().zip(chunks) {
                let installed = chunk.and_then(|(descriptor, chunk)| {
                    let receipt =
                        install(&cache.cache, transfer, tokens.clone(), &descriptor, chunk.payload())?;
                    Ok((receipt.bytes, descriptor, chunk))
                });
                match installed {
                    Ok((n, descriptor, chunk)) => {
                        (fetched, bytes) = (fetched + 1, bytes + n);
                        if keeper.is_some() {
                            kept.push(chunk.into_encoded(&descriptor));
                        }
                    }
                    Err(dejavulib::reshard::StreamError::Store(ChunkStoreError::NotFound(_))) => {
                        stopped = Some(None);
                        break;
                    }
                    Err(e) => {
                        stopped = Some(Some(e.to_string()));
                        break;
                    }
                }
            }
            if let Some(keeper) = keeper.filter(|_| !kept.is_empty()) {
                let chunks: Vec<&[u8]> = kept.iter().map(Vec::as_slice).collect();
                if let Err(e) = keeper.0.lock().keep(&chunks) {
                    return (fetched, bytes, Some(format!("keeping what was fetched: {e}")));
                }
            }
            if let Some(error) = stopped {
                return (fetched, bytes, error);
            }
        }
        (fetched, bytes, None)
    });
    let out = pyo3::types::PyDict::new(py);
    out.set_item("fetched", fetched)?;
    out.set_item("bytes", bytes)?;
    out.set_item("error", error)?;
    Ok(out)
}

/// A chunk `fetch_batch` fetched: from a peer as it travelled (header, then payload), from
/// another store its payload alone.
enum FetchedChunk {
    Encoded(Vec<u8>),
    Payload(Vec<u8>),
}

impl FetchedChunk {
    fn payload(&self) -> &[u8] {
        match self {
            FetchedChunk::Encoded(encoded) => &encoded[dejavulib::chunk::HEADER_LEN..],
            FetchedChunk::Payload(payload) => payload,
        }
    }

    /// The chunk as a sidecar keeps it (header, then payload), encoded only if it came bare.
    fn into_encoded(self, descriptor: &dejavulib::chunk::ChunkDescriptor) -> Vec<u8> {
        match self {
            FetchedChunk::Encoded(encoded) => encoded,
            FetchedChunk::Payload(payload) => {
                let mut encoded = descriptor.encode_header(&payload).to_vec();
                encoded.extend_from_slice(&payload);
                encoded
            }
        }
    }
}

/// The chunks of `batch`, each with its descriptor, from a peer all in flight at once, from
/// another store one by one until one fails.
fn fetch_batch(
    store: &PyStore,
    batch: &[(Transfer, std::ops::Range<u32>)],
) -> Vec<Result<(dejavulib::chunk::ChunkDescriptor, FetchedChunk), dejavulib::reshard::StreamError>> {
    let keys: Vec<_> =
        batch.iter().map(|(transfer, tokens)| transfer_key(transfer, tokens.clone())).collect();
    if let Some(peer) = &store.peer {
        let fetched = peer.0.lock().get_many(&keys);
        return fetched
            .into_iter()
            .map(|f| {
                f.map(|f| {
                    let (descriptor, encoded) = f.into_parts();
                    (descriptor, FetchedChunk::Encoded(encoded))
                })
                .map_err(Into::into)
            })
            .collect();
    }
    let mut inner = store.inner.clone();
    let mut out = Vec::with_capacity(keys.len());
    for key in &keys {
        let mut payload = Vec::new();
        let chunk =
            inner.get(key, &mut payload).map(|descriptor| (descriptor, FetchedChunk::Payload(payload)));
        let failed = chunk.is_err();
        out.push(chunk.map_err(Into::into));
        if failed {
            break;
        }
    }
    out
}
