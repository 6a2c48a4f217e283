//! The C interface of `dejavulib`: opaque handles, status codes and a thread-local error message.
//!
//! Every function returns a [`DjvStatus`] (or a plain value that cannot fail). On an error,
//! [`djv_last_error`] returns a message for the calling thread until its next failing call. No Rust
//! panic crosses the boundary: one is caught and reported as [`DjvStatus::Panic`]. Handles are
//! created by `djv_*_new` / `_open` / layout builders and released by the matching `_free`; passing
//! NULL where a handle or output pointer is required is [`DjvStatus::InvalidArgument`].
//!
//! The header `include/dejavu.h` is generated from this file by cbindgen (see `cbindgen.toml`); a
//! test fails when it is out of date.

mod feed;

pub use feed::*;

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use dejavulib::chunk::SequencePlace;
use dejavulib::file_io::FileBackend;
use dejavulib::layout::{BlockTables, KvInterleave, PagedConfig, PagedOrder, PerLayerOrder};
use dejavulib::local::LocalSidecar;
use dejavulib::reshard::{receive, send, StreamError};
use dejavulib::restore::{fetch_points, RestoreError, Restored};
use dejavulib::store::StoreError;
use dejavulib::{
    CacheError, ChunkStore, DType, FileStore, KvCache, KvLayout, KvRegion, KvSpec, StagingPool, Transfer,
    WorkerId,
};

/// Outcome of a call.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DjvStatus {
    /// Success.
    Ok = 0,
    /// A NULL pointer, a wrong length or an out-of-range value.
    InvalidArgument = 1,
    /// The layout or region is invalid for the cache.
    Layout = 2,
    /// An I/O error (disk full, permissions).
    Io = 3,
    /// A chunk failed verification (truncated, corrupted, not the one expected).
    Corrupt = 4,
    /// No chunk under the key asked for.
    NotFound = 5,
    /// A bug inside the library (a caught panic).
    Panic = 6,
}

/// Element type of the KV cache.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub enum DjvElement {
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 half precision.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit float (e4m3).
    Fp8E4m3,
    /// Signed 8-bit integer.
    Int8,
}

/// Axis order of per-layer tensors.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub enum DjvPerLayerOrder {
    /// `[B][H][S][D]` (HF transformers).
    Bhsd,
    /// `[B][S][H][D]` (flash-attention style).
    Bshd,
}

/// Order within a paged block.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub enum DjvPagedOrder {
    /// `[block_size][H][D]`.
    Nhd,
    /// `[H][block_size][D]`.
    Hnd,
}

/// A region of a cache: half-open ranges of layers, batch slots, KV heads and tokens.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DjvRegion {
    /// First layer.
    pub layers_start: u32,
    /// One past the last layer.
    pub layers_end: u32,
    /// First slot.
    pub slots_start: u32,
    /// One past the last slot.
    pub slots_end: u32,
    /// First KV head.
    pub heads_start: u32,
    /// One past the last KV head.
    pub heads_end: u32,
    /// First token.
    pub tokens_start: u32,
    /// One past the last token.
    pub tokens_end: u32,
}

/// A worker of a pipeline: stage and tensor-parallel rank.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DjvWorker {
    /// Pipeline stage.
    pub stage: u32,
    /// Rank within the stage.
    pub rank: u32,
}

/// A KV layout (opaque).
pub struct DjvLayout(KvLayout);

/// A KV cache, over library or engine memory (opaque).
pub struct DjvCache {
    cache: KvCache,
    pool: StagingPool,
}

/// Where chunks are flushed to and fetched from (opaque): a directory of chunk files, or the
/// engine's own sidecar process.
pub struct DjvStore(StoreKind);

enum StoreKind {
    Files(FileStore),
    Sidecar(LocalSidecar),
}

impl DjvStore {
    fn chunks(&mut self) -> &mut dyn ChunkStore {
        match &mut self.0 {
            StoreKind::Files(store) => store,
            StoreKind::Sidecar(local) => local,
        }
    }

    fn sidecar(&mut self) -> Result<&mut LocalSidecar, Failure> {
        match &mut self.0 {
            StoreKind::Sidecar(local) => Ok(local),
            StoreKind::Files(_) => Err(Failure::invalid("not a sidecar store")),
        }
    }
}

/// One sequence's KV as its sidecar keeps it (see [`djv_sidecar_restore`]).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DjvResumePoint {
    /// The worker the KV is for.
    pub destination: DjvWorker,
    /// Its microbatch.
    pub microbatch: u32,
    /// Its layers, slots and heads; tokens `0..tokens_end` are held (and restored): the engine
    /// computes from token `tokens_end` on.
    pub held: DjvRegion,
}

/// The name a store had when only files were stores; kept so that existing programs build.
pub type DjvFileStore = DjvStore;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Why a call failed: a status and a message.
struct Failure(DjvStatus, String);

impl Failure {
    fn invalid(message: impl Into<String>) -> Self {
        Failure(DjvStatus::InvalidArgument, message.into())
    }
}

impl From<CacheError> for Failure {
    fn from(e: CacheError) -> Self {
        let status = match e {
            CacheError::WrongLength { .. } | CacheError::Buffers(_) => DjvStatus::InvalidArgument,
            _ => DjvStatus::Layout,
        };
        Failure(status, e.to_string())
    }
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        let status = match e {
            StoreError::NotFound(_) => DjvStatus::NotFound,
            StoreError::Chunk { .. } => DjvStatus::Corrupt,
            StoreError::PayloadLength { .. } => DjvStatus::InvalidArgument,
            StoreError::Io { .. } => DjvStatus::Io,
            StoreError::Unsupported(_) => DjvStatus::InvalidArgument,
            StoreError::Gather(e) => return Self::from(*e),
        };
        Failure(status, e.to_string())
    }
}

impl From<StreamError> for Failure {
    fn from(e: StreamError) -> Self {
        match e {
            StreamError::Cache(e) => e.into(),
            StreamError::Store(e) => e.into(),
            StreamError::Unexpected(m) => Failure(DjvStatus::Corrupt, m),
            other => Failure(DjvStatus::InvalidArgument, other.to_string()),
        }
    }
}

/// Runs `body`, turning its error or panic into a status and the thread's last error message.
fn call(body: impl FnOnce() -> Result<(), Failure>) -> DjvStatus {
    let failure = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => return DjvStatus::Ok,
        Ok(Err(failure)) => failure,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown".into());
            Failure(DjvStatus::Panic, format!("internal error (panic): {what}"))
        }
    };
    let message = CString::new(failure.1.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = message);
    failure.0
}

/// A shared reference from a handle pointer, or an error if it is NULL.
///
/// # Safety
///
/// `ptr` is NULL or points to a live `T` made by this library and not freed.
unsafe fn handle<'a, T>(ptr: *const T, what: &str) -> Result<&'a T, Failure> {
    // SAFETY: per the contract, a non-null `ptr` points to a live `T`.
    unsafe { ptr.as_ref() }.ok_or_else(|| Failure::invalid(format!("{what} is NULL")))
}

/// Stores a new handle in `*out`.
///
/// # Safety
///
/// `out` is NULL (an error) or valid for a write of a pointer.
unsafe fn give<T>(out: *mut *mut T, value: T) -> Result<(), Failure> {
    if out.is_null() {
        return Err(Failure::invalid("the output pointer is NULL"));
    }
    // SAFETY: `out` is non-null and, per the contract, valid for writes.
    unsafe { out.write(Box::into_raw(Box::new(value))) };
    Ok(())
}

fn dtype(d: DjvElement) -> DType {
    match d {
        DjvElement::F32 => DType::F32,
        DjvElement::F16 => DType::F16,
        DjvElement::Bf16 => DType::BF16,
        DjvElement::Fp8E4m3 => DType::Fp8E4M3,
        DjvElement::Int8 => DType::Int8,
    }
}

fn spec(layers: u32, kv_heads: u32, head_dim: u32, d: DjvElement) -> Result<KvSpec, Failure> {
    KvSpec::new(layers, kv_heads, head_dim, dtype(d)).map_err(|e| Failure::invalid(e.to_string()))
}

fn layout_err(e: impl std::fmt::Display) -> Failure {
    Failure(DjvStatus::Layout, e.to_string())
}

fn region(r: &DjvRegion) -> KvRegion {
    KvRegion::new(
        r.layers_start..r.layers_end,
        r.slots_start..r.slots_end,
        r.heads_start..r.heads_end,
        r.tokens_start..r.tokens_end,
    )
}

/// The message of the calling thread's last failed call ("" if none). Valid until that thread's
/// next failing call; never NULL.
#[no_mangle]
pub extern "C" fn djv_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// A FasterTransformer layout: K `[L][B][H][D/x][S][x]` (x = 16 bytes of elements) and V
/// `[L][B][H][S][D]`.
///
/// # Safety
///
/// `out` must be valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn djv_layout_faster_transformer(
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    dtype: DjvElement,
    slots: u32,
    max_tokens: u32,
    out: *mut *mut DjvLayout,
) -> DjvStatus {
    call(|| {
        let layout =
            KvLayout::faster_transformer(spec(layers, kv_heads, head_dim, dtype)?, slots, max_tokens)
                .map_err(layout_err)?;
        // SAFETY: the caller passes a writable `out`.
        unsafe { give(out, DjvLayout(layout)) }
    })
}

/// Per-layer tensors, one K and one V buffer per layer, in `order`.
///
/// # Safety
///
/// `out` must be valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn djv_layout_per_layer(
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    dtype: DjvElement,
    slots: u32,
    max_tokens: u32,
    order: DjvPerLayerOrder,
    out: *mut *mut DjvLayout,
) -> DjvStatus {
    call(|| {
        let order = match order {
            DjvPerLayerOrder::Bhsd => PerLayerOrder::Bhsd,
            DjvPerLayerOrder::Bshd => PerLayerOrder::Bshd,
        };
        let layout = KvLayout::per_layer(spec(layers, kv_heads, head_dim, dtype)?, slots, max_tokens, order)
            .map_err(layout_err)?;
        // SAFETY: the caller passes a writable `out`.
        unsafe { give(out, DjvLayout(layout)) }
    })
}

/// vLLM-style paged blocks per layer, addressed through a block table per slot:
/// `block_tables[slot * blocks_per_slot + i]` is the physical block of the slot's `i`-th block.
///
/// # Safety
///
/// `block_tables` must point to `slots * blocks_per_slot` readable `uint32_t` (or be NULL when that
/// product is 0); `out` must be valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn djv_layout_paged(
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    dtype: DjvElement,
    slots: u32,
    block_size: u32,
    num_blocks: u32,
    order: DjvPagedOrder,
    interleaved: bool,
    block_tables: *const u32,
    blocks_per_slot: u32,
    out: *mut *mut DjvLayout,
) -> DjvStatus {
    call(|| {
        let count = slots as usize * blocks_per_slot as usize;
        let flat: &[u32] = match (block_tables.is_null(), count) {
            (_, 0) => &[],
            (true, _) => return Err(Failure::invalid("block_tables is NULL")),
            // SAFETY: the caller passes `count` readable values.
            (false, _) => unsafe { std::slice::from_raw_parts(block_tables, count) },
        };
        let tables = flat.chunks(blocks_per_slot.max(1) as usize).map(<[u32]>::to_vec).collect::<Vec<_>>();
        let tables = (count > 0).then(|| BlockTables::from_tables(tables));
        let config = PagedConfig {
            block_size,
            num_blocks,
            order: match order {
                DjvPagedOrder::Nhd => PagedOrder::Nhd,
                DjvPagedOrder::Hnd => PagedOrder::Hnd,
            },
            interleave: if interleaved { KvInterleave::Interleaved } else { KvInterleave::Separate },
        };
        let layout = KvLayout::paged(spec(layers, kv_heads, head_dim, dtype)?, slots, config, tables)
            .map_err(layout_err)?;
        // SAFETY: the caller passes a writable `out`.
        unsafe { give(out, DjvLayout(layout)) }
    })
}

/// Number of buffers a cache of `layout` has (0 if `layout` is NULL).
///
/// # Safety
///
/// `layout` is NULL or a live layout.
#[no_mangle]
pub unsafe extern "C" fn djv_layout_buffer_count(layout: *const DjvLayout) -> usize {
    // SAFETY: per the contract.
    unsafe { layout.as_ref() }.map_or(0, |l| l.0.buffer_sizes().len())
}

/// Bytes of buffer `index` of a cache of `layout` (0 if out of range or NULL).
///
/// # Safety
///
/// `layout` is NULL or a live layout.
#[no_mangle]
pub unsafe extern "C" fn djv_layout_buffer_size(layout: *const DjvLayout, index: usize) -> u64 {
    // SAFETY: per the contract.
    unsafe { layout.as_ref() }.and_then(|l| l.0.buffer_sizes().get(index).copied()).unwrap_or(0)
}

/// Releases a layout (NULL is ignored).
///
/// # Safety
///
/// `layout` is NULL or a live layout, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn djv_layout_free(layout: *mut DjvLayout) {
    if !layout.is_null() {
        // SAFETY: made by `Box::into_raw` in `give`, freed once per the contract.
        drop(unsafe { Box::from_raw(layout) });
    }
}

/// A cache of `layout` over zeroed memory the library allocates.
///
/// # Safety
///
/// `layout` is a live layout; `out` is valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn djv_cache_new(layout: *const DjvLayout, out: *mut *mut DjvCache) -> DjvStatus {
    call(|| {
        // SAFETY: per the contract.
        let layout = unsafe { handle(layout, "layout") }?;
        let cache = KvCache::new(layout.0.clone())?;
        // SAFETY: the caller passes a writable `out`.
        unsafe { give(out, DjvCache { cache, pool: StagingPool::default() }) }
    })
}

/// A cache of `layout` over the engine's own buffers, used in place: `count` buffers (as many as
/// [`djv_layout_buffer_count`] says), buffer `i` at `buffers[i]` with `lens[i]` bytes (at least
/// [`djv_layout_buffer_size`]).
///
/// # Safety
///
/// `layout` is a live layout; `buffers` and `lens` point to `count` readable elements; each buffer
/// is valid for reads and writes of its length for as long as the cache lives, and the engine does
/// not write the bytes a copy is reading or writing while that copy runs. `out` is valid for a
/// write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn djv_cache_wrap(
    layout: *const DjvLayout,
    buffers: *const *mut u8,
    lens: *const usize,
    count: usize,
    out: *mut *mut DjvCache,
) -> DjvStatus {
    call(|| {
        // SAFETY: per the contract.
        let layout = unsafe { handle(layout, "layout") }?;
        if count > 0 && (buffers.is_null() || lens.is_null()) {
            return Err(Failure::invalid("buffers or lens is NULL"));
        }
        let raw: Vec<(*mut u8, usize)> = (0..count)
            // SAFETY: both arrays hold `count` readable elements per the contract.
            .map(|i| unsafe { (*buffers.add(i), *lens.add(i)) })
            .collect();
        // SAFETY: the caller guarantees the buffers' validity for the cache's life.
        let cache = unsafe { KvCache::from_raw_buffers(layout.0.clone(), &raw) }?;
        // SAFETY: the caller passes a writable `out`.
        unsafe { give(out, DjvCache { cache, pool: StagingPool::default() }) }
    })
}

/// Releases a cache (NULL is ignored). Engine buffers it wrapped are left alone.
///
/// # Safety
///
/// `cache` is NULL or a live cache, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn djv_cache_free(cache: *mut DjvCache) {
    if !cache.is_null() {
        // SAFETY: made by `Box::into_raw` in `give`, freed once per the contract.
        drop(unsafe { Box::from_raw(cache) });
    }
}

/// Bytes a gather of `region` produces (the staging buffer size), in `*len`.
///
/// # Safety
///
/// `cache` is a live cache; `region` and `len` are valid pointers.
#[no_mangle]
pub unsafe extern "C" fn djv_packed_len(
    cache: *const DjvCache,
    region: *const DjvRegion,
    len: *mut u64,
) -> DjvStatus {
    call(|| {
        // SAFETY: per the contract.
        let (cache, r) = unsafe { (handle(cache, "cache")?, handle(region, "region")?) };
        let r = crate::region(r);
        cache.cache.layout().check_region(&r).map_err(CacheError::from)?;
        if len.is_null() {
            return Err(Failure::invalid("len is NULL"));
        }
        // SAFETY: non-null and writable per the contract.
        unsafe { len.write(cache.cache.packed_len(&r)) };
        Ok(())
    })
}

/// Gathers `region` of `cache` into `out` (`out_len` bytes, exactly [`djv_packed_len`]), packed in
/// the cache's preferred packing: many small KV pieces into one buffer.
///
/// # Safety
///
/// `cache` is a live cache; `region` is valid; `out` is valid for writes of `out_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn djv_gather(
    cache: *const DjvCache,
    region: *const DjvRegion,
    out: *mut u8,
    out_len: usize,
) -> DjvStatus {
    call(|| {
        // SAFETY: per the contract.
        let (cache, r) = unsafe { (handle(cache, "cache")?, handle(region, "region")?) };
        if out.is_null() {
            return Err(Failure::invalid("out is NULL"));
        }
        // SAFETY: `out` is valid for `out_len` writable bytes per the contract.
        let out = unsafe { std::slice::from_raw_parts_mut(out, out_len) };
        cache.cache.gather(&crate::region(r), cache.cache.layout().preferred_packing(), out)?;
        Ok(())
    })
}

/// Scatters `input` (`input_len` bytes, packed as [`djv_gather`] packs) into `region` of `cache`.
///
/// # Safety
///
/// `cache` is a live cache; `region` is valid; `input` is valid for reads of `input_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn djv_scatter(
    cache: *const DjvCache,
    region: *const DjvRegion,
    input: *const u8,
    input_len: usize,
) -> DjvStatus {
    call(|| {
        // SAFETY: per the contract.
        let (cache, r) = unsafe { (handle(cache, "cache")?, handle(region, "region")?) };
        if input.is_null() {
            return Err(Failure::invalid("input is NULL"));
        }
        // SAFETY: `input` is valid for `input_len` readable bytes per the contract.
        let input = unsafe { std::slice::from_raw_parts(input, input_len) };
        cache.cache.scatter(&crate::region(r), cache.cache.layout().preferred_packing(), input)?;
        Ok(())
    })
}

/// Opens (creating it if needed) a directory of chunk files, with io_uring where the kernel has it.
///
/// # Safety
///
/// `dir` is a NUL-terminated path; `out` is valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn djv_file_store_open(dir: *const c_char, out: *mut *mut DjvStore) -> DjvStatus {
    call(|| {
        if dir.is_null() {
            return Err(Failure::invalid("dir is NULL"));
        }
        // SAFETY: a NUL-terminated string per the contract.
        let dir =
            unsafe { CStr::from_ptr(dir) }.to_str().map_err(|_| Failure::invalid("dir is not UTF-8"))?;
        let store = FileStore::open(dir, FileBackend::Auto)?;
        // SAFETY: the caller passes a writable `out`.
        unsafe { give(out, DjvStore(StoreKind::Files(store))) }
    })
}

/// Connects to the engine's own sidecar (a `dejavud sidecar` process) at its local socket
/// `socket`, as an engine started in `epoch`: each chunk flushed crosses a memory region shared
/// with the sidecar, which keeps it and forwards it to the sidecar at `successor` ("ip:port", the
/// next stage's; "none" for local copies only, in a ring of one stage; the engine's own sidecar is
/// refused); a fetch comes back through shared memory. A newer epoch takes the sidecar over from
/// an older engine; an older one is refused.
///
/// # Safety
///
/// `socket` and `successor` are NUL-terminated strings; `out` is valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn djv_sidecar_store_open(
    socket: *const c_char,
    successor: *const c_char,
    epoch: u64,
    out: *mut *mut DjvStore,
) -> DjvStatus {
    call(|| {
        // SAFETY: per the contract.
        let (socket, successor) = unsafe { sidecar_addresses(socket, successor) }?;
        let local = LocalSidecar::connect(std::path::Path::new(socket), epoch, successor)
            .map_err(|e| Failure(DjvStatus::Io, format!("sidecar at {socket}: {e}")))?;
        // SAFETY: the caller passes a writable `out`.
        unsafe { give(out, DjvStore(StoreKind::Sidecar(local))) }
    })
}

/// As [`djv_sidecar_store_open`], for an engine that reports nothing itself and does not know its
/// epoch: the sidecar reports the engine's liveness to the controller for as long as the store is
/// open (its death is seen as soon as its process ends), and gives it its epoch
/// ([`djv_sidecar_epoch`]): the stage's first engine's, or, for a replacement, the epoch the
/// controller fenced the stage's engine in.
///
/// # Safety
///
/// As for [`djv_sidecar_store_open`].
#[no_mangle]
pub unsafe extern "C" fn djv_sidecar_join(
    socket: *const c_char,
    successor: *const c_char,
    out: *mut *mut DjvStore,
) -> DjvStatus {
    call(|| {
        // SAFETY: per the contract.
        let (socket, successor) = unsafe { sidecar_addresses(socket, successor) }?;
        let local = LocalSidecar::join(std::path::Path::new(socket), successor)
            .map_err(|e| Failure(DjvStatus::Io, format!("sidecar at {socket}: {e}")))?;
        // SAFETY: the caller passes a writable `out`.
        unsafe { give(out, DjvStore(StoreKind::Sidecar(local))) }
    })
}

/// The engine's epoch on its sidecar store: the one it gave, or the one its sidecar gave it
/// ([`djv_sidecar_join`]).
///
/// # Safety
///
/// `store` is a live handle; `epoch` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn djv_sidecar_epoch(store: *mut DjvStore, epoch: *mut u64) -> DjvStatus {
    call(|| {
        // SAFETY: per the contract.
        let store = unsafe { store.as_mut() }.ok_or_else(|| Failure::invalid("store is NULL"))?;
        let connection = store.sidecar()?.epoch();
        // SAFETY: per the contract.
        *unsafe { epoch.as_mut() }.ok_or_else(|| Failure::invalid("epoch is NULL"))? = connection;
        Ok(())
    })
}

/// The local socket's path and the successor's address, from C strings.
///
/// # Safety
///
/// Each is NULL or a NUL-terminated string that lives as long as the returned path.
unsafe fn sidecar_addresses<'a>(
    socket: *const c_char,
    successor: *const c_char,
) -> Result<(&'a str, dejavulib::local::Successor), Failure> {
    if socket.is_null() || successor.is_null() {
        return Err(Failure::invalid("socket or successor is NULL"));
    }
    // SAFETY: NUL-terminated strings per the contract.
    let (socket, successor) = unsafe { (CStr::from_ptr(socket), CStr::from_ptr(successor)) };
    let socket = socket.to_str().map_err(|_| Failure::invalid("socket is not UTF-8"))?;
    let successor = successor
        .to_str()
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| Failure::invalid("successor is neither an ip:port address nor \"none\""))?;
    Ok((socket, successor))
}

/// Releases a file store: the same as [`djv_store_free`], kept so that existing programs link.
///
/// # Safety
///
/// As for [`djv_store_free`].
#[no_mangle]
pub unsafe extern "C" fn djv_file_store_free(store: *mut DjvStore) {
    // SAFETY: the same contract.
    unsafe { djv_store_free(store) }
}

/// Releases a store (NULL is ignored); a file store's files stay, a sidecar keeps its copies.
///
/// # Safety
///
/// `store` is NULL or a live store, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn djv_store_free(store: *mut DjvStore) {
    if !store.is_null() {
        // SAFETY: made by `Box::into_raw` in `give`, freed once per the contract.
        drop(unsafe { Box::from_raw(store) });
    }
}

/// The handles of a flush or fetch.
///
/// # Safety
///
/// Each pointer is NULL (an error) or points to a live handle of this library; the store is used
/// through the returned exclusive borrow only, for the duration of the call.
unsafe fn operands<'a>(
    store: *mut DjvStore,
    cache: *const DjvCache,
    region: *const DjvRegion,
) -> Result<(&'a mut DjvStore, &'a DjvCache, &'a DjvRegion), Failure> {
    // SAFETY: per the contract.
    let store = unsafe { store.as_mut() }.ok_or_else(|| Failure::invalid("store is NULL"))?;
    // SAFETY: per the contract.
    unsafe { Ok((store, handle(cache, "cache")?, handle(region, "region")?)) }
}

fn transfer(r: &DjvRegion, source: DjvWorker, destination: DjvWorker, microbatch: u32) -> Transfer {
    let worker = |w: DjvWorker| WorkerId { stage: w.stage, rank: w.rank };
    Transfer::in_place(worker(source), worker(destination), microbatch, &region(r))
}

/// Flushes `region` of `cache` to `store` as one checksummed chunk (a gather into a staging buffer,
/// then one write), keyed by `destination`, `microbatch` and the region.
///
/// # Safety
///
/// `store` and `cache` are live handles; `region` is valid.
#[no_mangle]
pub unsafe extern "C" fn djv_flush(
    store: *mut DjvStore,
    cache: *const DjvCache,
    region: *const DjvRegion,
    source: DjvWorker,
    destination: DjvWorker,
    microbatch: u32,
) -> DjvStatus {
    call(|| {
        // SAFETY: per the contract.
        let (store, cache, r) = unsafe { operands(store, cache, region) }?;
        let t = transfer(r, source, destination, microbatch);
        send(&cache.cache, &t, r.tokens_start..r.tokens_end, &cache.pool, store.chunks())?;
        Ok(())
    })
}

/// Fetches the chunk [`djv_flush`] wrote for the same region, source, destination and microbatch,
/// verifies it, and scatters it into `region` of `cache`.
///
/// # Safety
///
/// `store` and `cache` are live handles; `region` is valid.
#[no_mangle]
pub unsafe extern "C" fn djv_fetch(
    store: *mut DjvStore,
    cache: *const DjvCache,
    region: *const DjvRegion,
    source: DjvWorker,
    destination: DjvWorker,
    microbatch: u32,
) -> DjvStatus {
    call(|| {
        // SAFETY: per the contract.
        let (store, cache, r) = unsafe { operands(store, cache, region) }?;
        let t = transfer(r, source, destination, microbatch);
        let mut payload = Vec::new();
        receive(&cache.cache, &t, r.tokens_start..r.tokens_end, store.chunks(), &mut payload)?;
        Ok(())
    })
}

/// Releases the finished sequence in slots `slots_start..slots_end` of `microbatch` for `worker`:
/// the store drops every chunk of it, and a sidecar store also has its successor's sidecar drop
/// the replica. `*released` (unless NULL) is the number of chunks this store dropped; releasing
/// again drops nothing. A file store cannot (`DJV_STATUS_INVALID_ARGUMENT`).
///
/// # Safety
///
/// `store` is a live handle; `released` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn djv_release(
    store: *mut DjvStore,
    worker: DjvWorker,
    microbatch: u32,
    slots_start: u32,
    slots_end: u32,
    released: *mut u64,
) -> DjvStatus {
    call(|| {
        // SAFETY: per the contract.
        let store = unsafe { store.as_mut() }.ok_or_else(|| Failure::invalid("store is NULL"))?;
        if slots_start > slots_end {
            return Err(Failure::invalid("slots_start is after slots_end"));
        }
        let destination = WorkerId { stage: worker.stage, rank: worker.rank };
        let place = SequencePlace { destination, microbatch, slots: slots_start..slots_end };
        let chunks = store.chunks().release(&place)?;
        // SAFETY: per the contract.
        if let Some(out) = unsafe { released.as_mut() } {
            *out = chunks;
        }
        Ok(())
    })
}

/// Asks the engine's sidecar which stage it serves (a spare learns the stage it was assigned) and
/// the newest engine epoch it has accepted.
///
/// # Safety
///
/// `store` is a live handle; `stage` and `epoch` are valid for writes.
#[no_mangle]
pub unsafe extern "C" fn djv_sidecar_serves(
    store: *mut DjvStore,
    stage: *mut u32,
    epoch: *mut u64,
) -> DjvStatus {
    call(|| {
        // SAFETY: per the contract.
        let store = unsafe { store.as_mut() }.ok_or_else(|| Failure::invalid("store is NULL"))?;
        let serving = store.sidecar()?.serving().map_err(|e| Failure(DjvStatus::Io, e.to_string()))?;
        // SAFETY: per the contract.
        unsafe {
            *stage.as_mut().ok_or_else(|| Failure::invalid("stage is NULL"))? = serving.stage;
            *epoch.as_mut().ok_or_else(|| Failure::invalid("epoch is NULL"))? = serving.epoch;
        }
        Ok(())
    })
}

/// Follows the sidecar's recovery instructions after an engine restart: for each sequence of
/// `worker` the sidecar keeps KV of, fetches it (up to the first gap) through shared memory into
/// `caches[microbatch]` (microbatches beyond `n_caches`, or with a NULL cache, are left alone) and
/// writes its resume point into `points`; `*count` is the number of points written.
///
/// With `capacity` 0, nothing is fetched and `*count` is the number of sequences (the room a
/// second call needs). With some room but less than that, nothing is fetched, `*count` is the
/// number needed and the status is `DJV_STATUS_INVALID_ARGUMENT`. If a fetch fails, `*count`
/// says how many points were restored before it.
///
/// # Safety
///
/// `store` is a live sidecar store; `caches` holds `n_caches` pointers, each NULL or a live cache
/// (NULL if `n_caches` is 0); `points` is valid for `capacity` writes (NULL if 0); `count` is
/// valid for a write.
#[no_mangle]
pub unsafe extern "C" fn djv_sidecar_restore(
    store: *mut DjvStore,
    worker: DjvWorker,
    caches: *const *const DjvCache,
    n_caches: usize,
    points: *mut DjvResumePoint,
    capacity: usize,
    count: *mut usize,
) -> DjvStatus {
    call(|| {
        // SAFETY: per the contract.
        let store = unsafe { store.as_mut() }.ok_or_else(|| Failure::invalid("store is NULL"))?;
        // SAFETY: per the contract.
        let count = unsafe { count.as_mut() }.ok_or_else(|| Failure::invalid("count is NULL"))?;
        *count = 0;
        let caches: &[*const DjvCache] = match n_caches {
            0 => &[],
            _ if caches.is_null() => return Err(Failure::invalid("caches is NULL")),
            // SAFETY: `caches` holds `n_caches` pointers per the contract (not NULL: checked).
            n => unsafe { std::slice::from_raw_parts(caches, n) },
        };
        let me = WorkerId { stage: worker.stage, rank: worker.rank };
        let sidecar = store.sidecar()?;
        let io = |e: &dyn std::fmt::Display| Failure(DjvStatus::Io, e.to_string());
        let recovery = sidecar.recovery().map_err(|e| io(&e))?;
        let mine: Vec<_> = recovery.resume_points().into_iter().filter(|p| p.destination == me).collect();
        let needed = mine.len();
        if capacity == 0 || needed > capacity {
            *count = needed;
            return match capacity {
                0 => Ok(()),
                _ => Err(Failure::invalid(format!("room for {capacity} resume points, {needed} needed"))),
            };
        }
        if points.is_null() {
            return Err(Failure::invalid("points is NULL"));
        }
        // SAFETY: each entry is NULL or a live cache per the contract.
        let cache_of = |microbatch: u32| unsafe { caches.get(microbatch as usize).and_then(|c| c.as_ref()) };
        let (restored, failed) = match fetch_points(sidecar, me, mine, |m| cache_of(m).map(|c| &c.cache)) {
            Ok(restored) => (restored, None),
            Err(RestoreError::Fetch { restored, error, .. }) => (restored, Some(Failure::from(error))),
            Err(e @ RestoreError::Sidecar(_)) => (Vec::new(), Some(io(&e))),
        };
        for (i, Restored { point, .. }) in restored.into_iter().enumerate() {
            let held = DjvRegion {
                layers_start: point.layers.start,
                layers_end: point.layers.end,
                slots_start: point.slots.start,
                slots_end: point.slots.end,
                heads_start: point.heads.start,
                heads_end: point.heads.end,
                tokens_start: 0,
                tokens_end: point.tokens,
            };
            let resume = DjvResumePoint { destination: worker, microbatch: point.microbatch, held };
            // SAFETY: `i < mine.len() <= capacity` (checked above), and `points` (not NULL:
            // checked) is valid for `capacity` writes.
            unsafe { points.add(i).write(resume) };
            *count = i + 1;
        }
        failed.map_or(Ok(()), Err)
    })
}
