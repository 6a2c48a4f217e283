//! `dejavu._dejavu`: the native half of the Python package `dejavu` (see `dejavu/__init__.py` and
//! `dejavu/_dejavu.pyi` for the documented API).
//!
//! Buffers pass without copies (see the `buffer` module); copies and file I/O run with the GIL released.
//! Library errors become `dejavu.Error` subclasses, argument errors `ValueError` / `TypeError`.

use std::net::{SocketAddr, ToSocketAddrs};
use std::ops::Range;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use dejavulib::file_io::FileBackend;
use dejavulib::layout::{BlockTables, KvInterleave, PagedConfig, PagedOrder, PerLayerOrder};
use dejavulib::net::tcp::TcpTransport;
use dejavulib::net::{ClientConfig, PeerServer, PeerStore, ServerConfig, Transport};
use dejavulib::reshard::{receive, send, LocalRegion, StreamError, StreamStats};
use dejavulib::store::StoreError as ChunkStoreError;
use dejavulib::streamer::{Completion, Shutdown, StreamerError};
use dejavulib::{
    plan_stream_in, plan_stream_out, stream_in, stream_out, CacheError, ChunkStore, DType, FileStore,
    HostStore, KvCache, KvLayout, KvRegion, KvSpec, Setup, StageSpec, StagingPool, Streamer, StreamerConfig,
    Transfer, WorkerId,
};
use parking_lot::Mutex;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict, PyRange, PyRangeMethods};

mod buffer;

use buffer::{raw_buffer, RawBuffer};

create_exception!(dejavu, Error, PyException, "Base class of the errors dejavu raises.");
create_exception!(dejavu, LayoutError, Error, "A layout, region or cache buffer does not fit.");
create_exception!(dejavu, StoreError, Error, "Flush or fetch failed (I/O, disk full).");
create_exception!(dejavu, CorruptChunkError, StoreError, "A chunk failed verification.");
create_exception!(dejavu, NotFoundError, StoreError, "No chunk under the key asked for.");

fn cache_err(e: CacheError) -> PyErr {
    match e {
        CacheError::WrongLength { .. } => PyValueError::new_err(e.to_string()),
        other => LayoutError::new_err(other.to_string()),
    }
}

fn store_err(e: ChunkStoreError) -> PyErr {
    match e {
        ChunkStoreError::NotFound(_) => NotFoundError::new_err(e.to_string()),
        ChunkStoreError::Chunk { .. } => CorruptChunkError::new_err(e.to_string()),
        ChunkStoreError::PayloadLength { .. } => PyValueError::new_err(e.to_string()),
        ChunkStoreError::Io { .. } => StoreError::new_err(e.to_string()),
    }
}

fn stream_err(e: StreamError) -> PyErr {
    match e {
        StreamError::Cache(e) => cache_err(e),
        StreamError::Store(e) => store_err(e),
        StreamError::Unexpected(m) => CorruptChunkError::new_err(m),
        other => LayoutError::new_err(other.to_string()),
    }
}

fn value_err(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

fn dtype(name: &str) -> PyResult<DType> {
    Ok(match name {
        "float32" | "f32" => DType::F32,
        "float16" | "f16" => DType::F16,
        "bfloat16" | "bf16" => DType::BF16,
        "float8_e4m3" | "float8_e4m3fn" | "fp8" => DType::Fp8E4M3,
        "int8" | "i8" => DType::Int8,
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown dtype {other:?}: use float32, float16, bfloat16, float8_e4m3 or int8"
            )))
        }
    })
}

/// A `range` (step 1), a `(start, stop)` pair or a single index.
fn range_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Range<u32>> {
    if let Ok(r) = obj.cast::<PyRange>() {
        if r.step()? != 1 {
            return Err(PyValueError::new_err(format!("{what}: only ranges with step 1")));
        }
        let (start, stop) = (r.start()?, r.stop()?);
        return to_range(start, stop.max(start), what);
    }
    if let Ok((start, stop)) = obj.extract::<(i64, i64)>() {
        return to_range(start as isize, stop as isize, what);
    }
    if let Ok(i) = obj.extract::<i64>() {
        return to_range(i as isize, i as isize + 1, what);
    }
    Err(PyTypeError::new_err(format!("{what} must be a range, a (start, stop) pair or an int")))
}

fn to_range(start: isize, stop: isize, what: &str) -> PyResult<Range<u32>> {
    let ok = |v: isize| {
        u32::try_from(v).map_err(|_| PyValueError::new_err(format!("{what}: {v} is out of range")))
    };
    let (start, stop) = (ok(start)?, ok(stop)?);
    if stop < start {
        return Err(PyValueError::new_err(format!("{what}: stop {stop} is before start {start}")));
    }
    Ok(start..stop)
}

fn py_range(r: &Range<u32>) -> (u32, u32) {
    (r.start, r.end)
}

/// The shape of a model's KV cache: layers, KV heads, head size and element type.
#[pyclass(name = "KvSpec", module = "dejavu", frozen)]
#[derive(Clone)]
struct PySpec(KvSpec);

#[pymethods]
impl PySpec {
    #[new]
    #[pyo3(signature = (layers, kv_heads, head_dim, dtype = "float16"))]
    fn new(layers: u32, kv_heads: u32, head_dim: u32, dtype: &str) -> PyResult<Self> {
        Ok(Self(KvSpec::new(layers, kv_heads, head_dim, crate::dtype(dtype)?).map_err(value_err)?))
    }

    #[getter]
    fn layers(&self) -> u32 {
        self.0.layers()
    }

    #[getter]
    fn kv_heads(&self) -> u32 {
        self.0.kv_heads()
    }

    #[getter]
    fn head_dim(&self) -> u32 {
        self.0.head_dim()
    }

    /// Bytes of K and V one token takes across all layers and heads.
    #[getter]
    fn bytes_per_token(&self) -> u64 {
        self.0.bytes_per_token()
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.0)
    }
}

/// Where every KV element of a cache lives.
#[pyclass(name = "KvLayout", module = "dejavu", frozen)]
struct PyLayout(KvLayout);

#[pymethods]
impl PyLayout {
    /// FasterTransformer: K `[L][B][H][D/x][S][x]` (x = 16 bytes of elements), V `[L][B][H][S][D]`.
    #[staticmethod]
    fn faster_transformer(spec: &PySpec, slots: u32, max_tokens: u32) -> PyResult<Self> {
        Ok(Self(KvLayout::faster_transformer(spec.0, slots, max_tokens).map_err(value_err)?))
    }

    /// One K and one V tensor per layer, `[B][H][S][D]` ("bhsd", HF) or `[B][S][H][D]` ("bshd").
    #[staticmethod]
    #[pyo3(signature = (spec, slots, max_tokens, order = "bhsd"))]
    fn per_layer(spec: &PySpec, slots: u32, max_tokens: u32, order: &str) -> PyResult<Self> {
        let order = match order {
            "bhsd" => PerLayerOrder::Bhsd,
            "bshd" => PerLayerOrder::Bshd,
            other => return Err(PyValueError::new_err(format!("order {other:?}: use \"bhsd\" or \"bshd\""))),
        };
        Ok(Self(KvLayout::per_layer(spec.0, slots, max_tokens, order).map_err(value_err)?))
    }

    /// vLLM-style paged blocks per layer, NHD or HND, K and V separate or interleaved;
    /// `block_tables[slot]` lists the physical blocks of each sequence.
    #[staticmethod]
    #[pyo3(signature = (spec, slots, block_size, num_blocks, order = "nhd", interleaved = false, block_tables = None))]
    fn paged(
        spec: &PySpec,
        slots: u32,
        block_size: u32,
        num_blocks: u32,
        order: &str,
        interleaved: bool,
        block_tables: Option<Vec<Vec<u32>>>,
    ) -> PyResult<Self> {
        let order = match order {
            "nhd" => PagedOrder::Nhd,
            "hnd" => PagedOrder::Hnd,
            other => return Err(PyValueError::new_err(format!("order {other:?}: use \"nhd\" or \"hnd\""))),
        };
        let interleave = if interleaved { KvInterleave::Interleaved } else { KvInterleave::Separate };
        let config = PagedConfig { block_size, num_blocks, order, interleave };
        let tables = block_tables.map(BlockTables::from_tables);
        Ok(Self(KvLayout::paged(spec.0, slots, config, tables).map_err(value_err)?))
    }

    /// Bytes of each buffer a cache of this layout has.
    #[getter]
    fn buffer_sizes(&self) -> Vec<u64> {
        self.0.buffer_sizes().to_vec()
    }

    #[getter]
    fn spec(&self) -> PySpec {
        PySpec(*self.0.spec())
    }

    #[getter]
    fn slots(&self) -> u32 {
        self.0.slots()
    }

    #[getter]
    fn max_tokens(&self) -> u32 {
        self.0.max_tokens()
    }

    fn __repr__(&self) -> String {
        format!("KvLayout({:?}, buffers={:?})", self.0.kind(), self.0.buffer_sizes())
    }
}

/// Layers x slots x heads x tokens of a cache.
#[pyclass(name = "KvRegion", module = "dejavu", frozen)]
struct PyRegion(KvRegion);

#[pymethods]
impl PyRegion {
    #[new]
    fn new(
        layers: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
        heads: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        Ok(Self(KvRegion::new(
            range_arg(layers, "layers")?,
            range_arg(slots, "slots")?,
            range_arg(heads, "heads")?,
            range_arg(tokens, "tokens")?,
        )))
    }

    #[getter]
    fn layers(&self) -> (u32, u32) {
        py_range(&self.0.layers)
    }

    #[getter]
    fn slots(&self) -> (u32, u32) {
        py_range(&self.0.slots)
    }

    #[getter]
    fn heads(&self) -> (u32, u32) {
        py_range(&self.0.heads)
    }

    #[getter]
    fn tokens(&self) -> (u32, u32) {
        py_range(&self.0.tokens)
    }

    fn __repr__(&self) -> String {
        let r = &self.0;
        format!(
            "KvRegion(layers={:?}, slots={:?}, heads={:?}, tokens={:?})",
            r.layers, r.slots, r.heads, r.tokens
        )
    }
}

/// A KV cache over library memory, or over the engine's own arrays and tensors (`KvCache.wrap`).
#[pyclass(name = "KvCache", module = "dejavu", frozen)]
struct PyCache {
    cache: Arc<KvCache>,
    pool: StagingPool,
    /// The engine's buffers, kept alive as long as the cache.
    _engine: Vec<RawBuffer>,
}

#[pymethods]
impl PyCache {
    /// A cache of `layout` over zeroed memory the library allocates.
    #[new]
    fn new(layout: &PyLayout) -> PyResult<Self> {
        let cache = KvCache::new(layout.0.clone()).map_err(cache_err)?;
        Ok(Self { cache: Arc::new(cache), pool: StagingPool::default(), _engine: Vec::new() })
    }

    /// A cache of `layout` over `buffers` (numpy arrays, CPU torch tensors, bytearrays), one per
    /// layout buffer, used in place: no copy is made and writes land in them.
    #[staticmethod]
    fn wrap(layout: &PyLayout, buffers: Vec<Bound<'_, PyAny>>) -> PyResult<Self> {
        let engine = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| raw_buffer(b, true, &format!("buffer {i}")))
            .collect::<PyResult<Vec<_>>>()?;
        let raw: Vec<(*mut u8, usize)> = engine.iter().map(|b| (b.ptr, b.len)).collect();
        // SAFETY: each pointer is the memory of a contiguous writable object that `_engine` keeps
        // alive for the cache's life; Python code that resizes or frees it meanwhile is documented
        // as an error, as with any buffer handed to native code.
        let cache = unsafe { KvCache::from_raw_buffers(layout.0.clone(), &raw) }.map_err(cache_err)?;
        Ok(Self { cache: Arc::new(cache), pool: StagingPool::default(), _engine: engine })
    }

    #[getter]
    fn layout(&self) -> PyLayout {
        PyLayout(self.cache.layout().clone())
    }

    /// Bytes a gather of `region` produces.
    fn packed_len(&self, region: &PyRegion) -> PyResult<u64> {
        self.cache.layout().check_region(&region.0).map_err(|e| cache_err(e.into()))?;
        Ok(self.cache.packed_len(&region.0))
    }

    /// Gathers `region` into `out` (any writable contiguous buffer of exactly `packed_len` bytes),
    /// or into a new bytearray; returns the buffer.
    #[pyo3(signature = (region, out = None))]
    fn gather<'py>(
        &self,
        py: Python<'py>,
        region: &PyRegion,
        out: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let out = match out {
            Some(out) => out,
            None => {
                let len = self.packed_len(region)? as usize;
                PyByteArray::new_with(py, len, |_| Ok(()))?.into_any()
            }
        };
        let target = raw_buffer(&out, true, "out")?;
        let (parts, cache, region) = (target.parts(), self.cache.clone(), region.0.clone());
        py.detach(move || {
            let parts = parts; // moved whole: its fields alone are not `Send`
                               // SAFETY: `target` keeps the object alive and the buffer is writable and contiguous.
            let out = unsafe { std::slice::from_raw_parts_mut(parts.0, parts.1) };
            cache.gather(&region, cache.layout().preferred_packing(), out)
        })
        .map_err(cache_err)?;
        drop(target);
        Ok(out)
    }

    /// Scatters `data` (packed as `gather` packs, exactly `packed_len` bytes) into `region`.
    fn scatter(&self, py: Python<'_>, region: &PyRegion, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let source = raw_buffer(data, false, "data")?;
        let (parts, cache, region) = (source.parts(), self.cache.clone(), region.0.clone());
        py.detach(move || {
            let parts = parts; // moved whole: its fields alone are not `Send`
                               // SAFETY: `source` keeps the object alive; the buffer is contiguous.
            let input = unsafe { std::slice::from_raw_parts(parts.0, parts.1) };
            cache.scatter(&region, cache.layout().preferred_packing(), input)
        })
        .map_err(cache_err)?;
        drop(source);
        Ok(())
    }
}

/// A store shared by Python calls and a streamer thread, each use under the lock.
#[derive(Clone)]
struct SharedStore(Arc<Mutex<Box<dyn ChunkStore>>>);

impl ChunkStore for SharedStore {
    fn put(
        &mut self,
        descriptor: &dejavulib::chunk::ChunkDescriptor,
        payload: &[u8],
    ) -> Result<(), ChunkStoreError> {
        self.0.lock().put(descriptor, payload)
    }

    fn get(
        &mut self,
        key: &dejavulib::chunk::ChunkKey,
        out: &mut Vec<u8>,
    ) -> Result<dejavulib::chunk::ChunkDescriptor, ChunkStoreError> {
        self.0.lock().get(key, out)
    }
}

/// Where chunks are flushed to and fetched from: `Store.file(path)` or `Store.host()`.
#[pyclass(name = "Store", module = "dejavu", frozen)]
struct PyStore {
    inner: SharedStore,
    kind: &'static str,
}

#[pymethods]
impl PyStore {
    /// Chunk files in `path` (created if needed): io_uring where available, write-then-rename.
    #[staticmethod]
    fn file(path: std::path::PathBuf) -> PyResult<Self> {
        let store = FileStore::open(path, FileBackend::Auto).map_err(store_err)?;
        Ok(Self { inner: SharedStore(Arc::new(Mutex::new(Box::new(store)))), kind: "file" })
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
        let store = PeerStore::new(runtime()?.handle().clone(), transport, addr, config);
        Ok(Self { inner: SharedStore(Arc::new(Mutex::new(Box::new(store)))), kind: "peer" })
    }

    /// Chunks in this process's memory.
    #[staticmethod]
    fn host() -> Self {
        Self { inner: SharedStore(Arc::new(Mutex::new(Box::new(HostStore::new())))), kind: "host" }
    }

    fn __repr__(&self) -> String {
        format!("Store({})", self.kind)
    }
}

/// The runtime that drives network I/O for this process's stores and servers.
fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
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

fn resolve(address: &str) -> PyResult<SocketAddr> {
    address
        .to_socket_addrs()
        .map_err(|e| PyValueError::new_err(format!("address {address:?}: {e}")))?
        .next()
        .ok_or_else(|| PyValueError::new_err(format!("address {address:?} resolves to nothing")))
}

/// A peer that keeps chunks flushed to it (a replica holder or swap space), serving TCP clients
/// that know the cluster secret. It stops when closed or garbage-collected.
#[pyclass(name = "PeerServer", module = "dejavu", frozen)]
struct PyPeerServer {
    server: Mutex<Option<PeerServer>>,
    address: SocketAddr,
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

fn worker(w: (u32, u32)) -> WorkerId {
    WorkerId { stage: w.0, rank: w.1 }
}

fn stats(py: Python<'_>, s: StreamStats) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("chunks", s.chunks)?;
    d.set_item("bytes", s.bytes)?;
    d.set_item("copy_seconds", s.copy_time.as_secs_f64())?;
    d.set_item("io_seconds", s.io_time.as_secs_f64())?;
    Ok(d)
}

fn local_transfer(
    region: &KvRegion,
    source: (u32, u32),
    destination: (u32, u32),
    microbatch: u32,
) -> Transfer {
    let local = LocalRegion {
        microbatch,
        layers: region.layers.clone(),
        slots: region.slots.clone(),
        heads: region.heads.clone(),
    };
    Transfer { source: worker(source), destination: worker(destination), from: local.clone(), to: local }
}

/// Flushes `region` of `cache` to `store` as one checksummed chunk (gathered into one staging
/// buffer, written once). Returns the bytes flushed.
#[pyfunction]
#[pyo3(signature = (store, cache, region, source = (0, 0), destination = (0, 0), microbatch = 0))]
fn flush(
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
/// verifies it and scatters it into `region` of `cache` (which may use another layout). Returns
/// the bytes fetched.
#[pyfunction]
#[pyo3(signature = (store, cache, region, source = (0, 0), destination = (0, 0), microbatch = 0))]
fn fetch(
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
        .detach(|| {
            let mut payload = Vec::new();
            receive(&cache.cache, &transfer, tokens, &mut store.inner.clone(), &mut payload)
        })
        .map_err(stream_err)?;
    Ok(receipt.bytes)
}

/// A pipeline: the model's KV spec, its stages (layer range and tensor-parallel degree each), and
/// how requests are batched.
#[pyclass(name = "Setup", module = "dejavu", frozen)]
struct PySetup(Setup);

#[pymethods]
impl PySetup {
    #[new]
    fn new(
        spec: &PySpec,
        stages: Vec<(Bound<'_, PyAny>, u32)>,
        microbatch_slots: u32,
        microbatches: u32,
    ) -> PyResult<Self> {
        let stages = stages
            .iter()
            .map(|(layers, tp)| Ok(StageSpec { layers: range_arg(layers, "stage layers")?, tp: *tp }))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Self(Setup::new(spec.0, stages, microbatch_slots, microbatches).map_err(value_err)?))
    }

    /// Every worker, as `(stage, rank)`.
    fn workers(&self) -> Vec<(u32, u32)> {
        self.0.workers().map(|w| (w.stage, w.rank)).collect()
    }

    /// The KV spec of the part `worker` holds (its layers and heads), for building its caches.
    fn local_spec(&self, worker: (u32, u32)) -> PyResult<PySpec> {
        let holding = self.0.holding(crate::worker(worker)).map_err(value_err)?;
        let spec = self
            .0
            .spec()
            .share(holding.layers.len() as u32, holding.heads.len() as u32)
            .map_err(value_err)?;
        Ok(PySpec(spec))
    }

    /// What `worker` holds: global `layers` and `heads` ranges, and whether it is their primary.
    fn holding<'py>(&self, py: Python<'py>, worker: (u32, u32)) -> PyResult<Bound<'py, PyDict>> {
        let h = self.0.holding(crate::worker(worker)).map_err(value_err)?;
        let d = PyDict::new(py);
        d.set_item("layers", py_range(&h.layers))?;
        d.set_item("heads", py_range(&h.heads))?;
        d.set_item("primary", h.primary)?;
        Ok(d)
    }
}

/// Streams `tokens` of worker `source` of setup `a` (its caches, one per microbatch) into `store`,
/// cut and keyed for the workers of setup `b`. Returns chunk and byte counts and timings.
#[pyfunction]
#[pyo3(name = "stream_out")]
fn py_stream_out<'py>(
    py: Python<'py>,
    a: &PySetup,
    source: (u32, u32),
    b: &PySetup,
    caches: Vec<PyRef<'py, PyCache>>,
    tokens: &Bound<'py, PyAny>,
    store: &PyStore,
) -> PyResult<Bound<'py, PyDict>> {
    let tokens = range_arg(tokens, "tokens")?;
    let transfers = plan_stream_out(&a.0, worker(source), &b.0).map_err(stream_err)?;
    let caches: Vec<Arc<KvCache>> = caches.iter().map(|c| c.cache.clone()).collect();
    let pool = StagingPool::default();
    let s = py
        .detach(|| {
            let refs: Vec<&KvCache> = caches.iter().map(|c| &**c).collect();
            stream_out(&refs, &transfers, tokens, &pool, &mut store.inner.clone())
        })
        .map_err(stream_err)?;
    stats(py, s)
}

/// Receives what `stream_out` sent worker `destination` of setup `b` from every worker of setup
/// `a`, verifies it and scatters it into its caches (one per microbatch).
#[pyfunction]
#[pyo3(name = "stream_in")]
fn py_stream_in<'py>(
    py: Python<'py>,
    a: &PySetup,
    b: &PySetup,
    destination: (u32, u32),
    caches: Vec<PyRef<'py, PyCache>>,
    tokens: &Bound<'py, PyAny>,
    store: &PyStore,
) -> PyResult<Bound<'py, PyDict>> {
    let tokens = range_arg(tokens, "tokens")?;
    let transfers = plan_stream_in(&a.0, &b.0, worker(destination)).map_err(stream_err)?;
    let caches: Vec<Arc<KvCache>> = caches.iter().map(|c| c.cache.clone()).collect();
    let s = py
        .detach(|| {
            let refs: Vec<&KvCache> = caches.iter().map(|c| &**c).collect();
            stream_in(&refs, &transfers, tokens, &mut store.inner.clone())
        })
        .map_err(stream_err)?;
    stats(py, s)
}

fn streamer_err(e: StreamerError) -> PyErr {
    match e {
        StreamerError::Stream(e) => stream_err(e),
        StreamerError::Timeout => pyo3::exceptions::PyTimeoutError::new_err("the job has not finished"),
        other => Error::new_err(other.to_string()),
    }
}

/// One job handed to a `Streamer`.
#[pyclass(name = "Completion", module = "dejavu")]
struct PyCompletion {
    inner: Mutex<Completion>,
    /// The job's outcome once known: bytes, copy and I/O seconds, or its error.
    outcome: Option<Result<(u64, f64, f64), PyErr>>,
}

#[pymethods]
impl PyCompletion {
    /// Waits (GIL released) until the job has run, at most `timeout` seconds if given (then
    /// `TimeoutError`, and the job goes on). Returns `{"bytes", "copy_seconds", "io_seconds"}` or
    /// raises the job's error.
    #[pyo3(signature = (timeout = None))]
    fn wait<'py>(&mut self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyDict>> {
        if self.outcome.is_none() {
            let inner = &self.inner;
            let limit = Duration::from_secs_f64(timeout.unwrap_or(365.0 * 86400.0).max(0.0));
            match py.detach(|| inner.lock().wait_timeout(limit)) {
                Err(StreamerError::Timeout) => return Err(streamer_err(StreamerError::Timeout)),
                Ok(r) => {
                    self.outcome = Some(Ok((r.bytes, r.copy_time.as_secs_f64(), r.io_time.as_secs_f64())))
                }
                Err(e) => self.outcome = Some(Err(streamer_err(e))),
            }
        }
        match self.outcome.as_ref().expect("set above") {
            Ok((bytes, copy, io)) => {
                let d = PyDict::new(py);
                d.set_item("bytes", bytes)?;
                d.set_item("copy_seconds", copy)?;
                d.set_item("io_seconds", io)?;
                Ok(d)
            }
            Err(e) => Err(e.clone_ref(py)),
        }
    }
}

/// A background thread that gathers and flushes KV regions while the engine computes:
/// `layer_ready` queues a layer as soon as the engine has written it.
#[pyclass(name = "Streamer", module = "dejavu", frozen)]
struct PyStreamer {
    inner: Mutex<Option<Streamer>>,
}

#[pymethods]
impl PyStreamer {
    /// Starts the thread; it flushes to `store`. `submit`-style calls block (GIL released) once
    /// `queue_depth` jobs wait.
    #[new]
    #[pyo3(signature = (store, queue_depth = 64))]
    fn new(store: &PyStore, queue_depth: usize) -> PyResult<Self> {
        let config = StreamerConfig { queue_depth, ..StreamerConfig::default() };
        let streamer = Streamer::spawn(config, Box::new(store.inner.clone()))
            .map_err(|e| Error::new_err(e.to_string()))?;
        Ok(Self { inner: Mutex::new(Some(streamer)) })
    }

    /// Layer `layer` (local index) of microbatch `microbatch` of worker `source` of setup `a` is
    /// ready in `cache`: queues its part of every transfer toward setup `b`. Returns one
    /// `Completion` per chunk.
    #[allow(clippy::too_many_arguments)]
    fn layer_ready(
        &self,
        py: Python<'_>,
        a: &PySetup,
        source: (u32, u32),
        b: &PySetup,
        cache: &PyCache,
        microbatch: u32,
        layer: u32,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<PyCompletion>> {
        let tokens = range_arg(tokens, "tokens")?;
        let plan = plan_stream_out(&a.0, worker(source), &b.0).map_err(stream_err)?;
        let guard = self.inner.lock();
        let streamer = guard.as_ref().ok_or_else(|| Error::new_err("the streamer is shut down"))?;
        let completions = py
            .detach(|| streamer.layer_ready(&cache.cache, &plan, microbatch, layer, tokens))
            .map_err(streamer_err)?;
        Ok(completions.into_iter().map(|c| PyCompletion { inner: Mutex::new(c), outcome: None }).collect())
    }

    /// Stops the thread after running (or, with `cancel=True`, cancelling) the queued jobs.
    /// Returns `{"completed", "failed", "cancelled", "bytes"}`.
    #[pyo3(signature = (cancel = false))]
    fn shutdown<'py>(&self, py: Python<'py>, cancel: bool) -> PyResult<Bound<'py, PyDict>> {
        let streamer = self.inner.lock().take().ok_or_else(|| Error::new_err("the streamer is shut down"))?;
        let mode = if cancel { Shutdown::Cancel } else { Shutdown::Drain };
        let stats = py.detach(|| streamer.shutdown(mode)).map_err(streamer_err)?;
        let d = PyDict::new(py);
        d.set_item("completed", stats.completed)?;
        d.set_item("failed", stats.failed)?;
        d.set_item("cancelled", stats.cancelled)?;
        d.set_item("bytes", stats.bytes)?;
        Ok(d)
    }
}

#[pymodule]
fn _dejavu(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("LayoutError", py.get_type::<LayoutError>())?;
    m.add("StoreError", py.get_type::<StoreError>())?;
    m.add("CorruptChunkError", py.get_type::<CorruptChunkError>())?;
    m.add("NotFoundError", py.get_type::<NotFoundError>())?;
    m.add_class::<PySpec>()?;
    m.add_class::<PyLayout>()?;
    m.add_class::<PyRegion>()?;
    m.add_class::<PyCache>()?;
    m.add_class::<PyStore>()?;
    m.add_class::<PySetup>()?;
    m.add_class::<PyStreamer>()?;
    m.add_class::<PyPeerServer>()?;
    m.add_class::<PyCompletion>()?;
    m.add_function(wrap_pyfunction!(flush, m)?)?;
    m.add_function(wrap_pyfunction!(fetch, m)?)?;
    m.add_function(wrap_pyfunction!(py_stream_out, m)?)?;
    m.add_function(wrap_pyfunction!(py_stream_in, m)?)?;
    Ok(())
}
