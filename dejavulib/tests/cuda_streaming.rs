//! The GPU streaming path, where a GPU is present: the background streamer sending layers out of
//! device memory once the engine's compute stream has written them, and a swap-in prefetch that
//! the engine's compute stream waits for, and the pipelined copies between device caches and
//! host memory. Each ordering is made observable: the stream the copy must wait for is held back
//! by a host function until the test opens its gate, so a copy that did not wait would read the
//! memory before it is written, and the bytes would differ.
//!
//! A test that holds a stream back runs alone (`Device::Alone`): a call in another test that
//! synchronises the whole device (freeing pinned memory, loading a module) would wait for the
//! held stream while holding the driver's lock, and the holding test's own calls would queue
//! behind it. Seen on an H200: a prefetch blocked until the gate opened by itself.
//!
//! Each test says "skipped: no GPU" and passes only where no CUDA driver can be loaded; anywhere
//! else an error fails it.

mod common;

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr};
use dejavulib::cuda::{driver_present, CudaEngine, DeviceKv};
use dejavulib::reshard::{StreamError, Transfer};
use dejavulib::streamer::{Shutdown, StreamJob, StreamerError};
use dejavulib::{
    plan_stream_out, ChunkStore, DType, HostStore, KvCache, KvLayout, KvRegion, KvSpec, Setup, Streamer,
    StreamerConfig, WorkerId,
};

const LAYERS: u32 = 4;
const SLOTS: u32 = 3;
const TOKENS: u32 = 9;
const W0: WorkerId = WorkerId { stage: 0, rank: 0 };

/// The engine, or `None` (and a message) where no CUDA driver loads.
/// Tests that hold a stream back take it for writing, the others for reading.
static DEVICE: RwLock<()> = RwLock::new(());

/// How a test shares the device with the others of this binary.
enum Device {
    /// With the other tests that do not hold a stream back.
    Shared,
    /// Alone: it holds a stream back.
    Alone,
}

/// The device for a test, as `sharing` says, and the engine: `None` (and a message) where no
/// CUDA driver loads. Bound in this order, the engine is dropped (its module unloaded, which
/// synchronises the device) before the turn ends.
fn engine_for(sharing: Device) -> Option<(DeviceTurn, Arc<CudaEngine>)> {
    let turn = match sharing {
        Device::Shared => DeviceTurn::Shared(DEVICE.read().unwrap_or_else(|e| e.into_inner())),
        Device::Alone => DeviceTurn::Alone(DEVICE.write().unwrap_or_else(|e| e.into_inner())),
    };
    engine().map(|engine| (turn, engine))
}

/// A test's turn on the device, held for the whole test.
#[allow(dead_code)] // held for its drop only
enum DeviceTurn {
    Shared(RwLockReadGuard<'static, ()>),
    Alone(RwLockWriteGuard<'static, ()>),
}

fn engine() -> Option<Arc<CudaEngine>> {
    if !driver_present() {
        eprintln!("skipped: no GPU (no CUDA driver on this machine)");
        return None;
    }
    Some(Arc::new(CudaEngine::open(0).expect("a CUDA driver is present, so the engine must open")))
}

fn spec() -> KvSpec {
    KvSpec::new(LAYERS, 3, 24, DType::F16).unwrap()
}

fn layout() -> KvLayout {
    KvLayout::faster_transformer(spec(), SLOTS, TOKENS).unwrap()
}

/// A host cache of `layout()` full of noise (not zeros).
fn noisy_cache(seed: u64) -> Arc<KvCache> {
    let cache = KvCache::new(layout()).unwrap();
    let whole = KvRegion::new(0..LAYERS, 0..SLOTS, 0..spec().kv_heads(), 0..TOKENS);
    let mut rng = common::Rng::new(seed | 1);
    let noise = rng.bytes(cache.packed_len(&whole) as usize);
    cache.scatter(&whole, cache.layout().preferred_packing(), &noise).unwrap();
    Arc::new(cache)
}

/// A stream held back until the test opens it: work enqueued on the stream after
/// [`hold_back`] starts only once [`Gate::open`] is called (or the gate is dropped). The test
/// decides when, so an assertion that the work has not run yet cannot race the clock. A call that
/// blocked the host until the held stream ran would hang the test; the gate opens by itself after
/// `GATE_DEADLINE` instead, and the test then fails, saying so.
struct Gate(Arc<GateState>);

#[derive(Default)]
struct GateState {
    open: Mutex<bool>,
    changed: Condvar,
    /// Whether it had to open by itself.
    forced: AtomicBool,
}

/// Far longer than anything a test does before it opens its gate.
const GATE_DEADLINE: Duration = Duration::from_secs(20);

impl Gate {
    fn open(&self) {
        *self.0.open.lock().unwrap() = true;
        self.0.changed.notify_all();
        assert!(
            !self.0.forced.load(Ordering::SeqCst),
            "the gate had to open by itself: a call blocked the host until the held stream ran"
        );
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        *self.0.open.lock().unwrap() = true;
        self.0.changed.notify_all();
    }
}

unsafe extern "C" fn wait_for_gate(gate: *mut c_void) {
    // SAFETY: `gate` is the `Arc` that `hold_back` leaked for this call alone.
    let gate = unsafe { Arc::from_raw(gate as *const GateState) };
    let open = gate.open.lock().unwrap();
    let (_open, waited) = gate.changed.wait_timeout_while(open, GATE_DEADLINE, |open| !*open).unwrap();
    if waited.timed_out() {
        gate.forced.store(true, Ordering::SeqCst);
    }
}

/// Holds `stream` back until the returned gate opens.
fn hold_back(stream: &CudaStream) -> Gate {
    let gate = Arc::new(GateState::default());
    stream.context().bind_to_thread().unwrap();
    let data = Arc::into_raw(gate.clone()) as *mut c_void;
    // SAFETY: a live stream of the bound context; the host function takes the leaked `Arc` back
    // and only waits on it (it calls no CUDA).
    let result = unsafe { sys::cuLaunchHostFunc(stream.cu_stream(), Some(wait_for_gate), data) };
    assert_eq!(result, sys::CUresult::CUDA_SUCCESS);
    Gate(gate)
}

/// Device memory for every buffer of `layout`, allocated on `stream` as an engine would (zeroed),
/// and the cache the library sees over it.
fn engine_owned_kv(stream: &Arc<CudaStream>, layout: &KvLayout) -> (Vec<CudaSlice<u8>>, Arc<DeviceKv>) {
    let buffers: Vec<CudaSlice<u8>> =
        layout.buffer_sizes().iter().map(|&n| stream.alloc_zeros::<u8>(n as usize).unwrap()).collect();
    let addresses: Vec<u64> = buffers.iter().map(|b| b.device_ptr(stream).0).collect();
    stream.synchronize().unwrap();
    // SAFETY: each address is a live allocation of the engine's device as long as its layout
    // buffer, kept in `buffers` until after every copy of the test has finished; the test orders
    // its own writes with events.
    let kv = unsafe { DeviceKv::borrowed(layout.clone(), &addresses) }.unwrap();
    (buffers, Arc::new(kv))
}

/// Every chunk of `store`, by key, as bytes.
fn chunks(store: &HostStore) -> Vec<(String, Vec<u8>)> {
    let mut store = store.clone();
    let mut out = Vec::new();
    for (key, _) in store.keys() {
        let mut payload = Vec::new();
        store.get(&key, &mut payload).unwrap();
        out.push((format!("{key:?}"), payload));
    }
    out.sort();
    out
}

fn plan() -> Vec<Transfer> {
    let source = Setup::uniform(spec(), 1, 1, SLOTS, 1).unwrap();
    let destination = Setup::uniform(spec(), 2, 1, SLOTS, 1).unwrap();
    plan_stream_out(&source, W0, &destination).unwrap()
}

#[test]
fn the_streamer_sends_layers_out_of_device_memory_once_the_compute_stream_has_written_them() {
    let Some((_turn, engine)) = engine_for(Device::Alone) else { return };
    let compute = engine.context().new_stream().unwrap();
    let cache = noisy_cache(7);
    // The engine's new KV, uploaded to the side, and its (still zero) cache.
    let written: Vec<CudaSlice<u8>> =
        cache.snapshot().iter().map(|b| compute.clone_htod(b).unwrap()).collect();
    let (mut buffers, kv) = engine_owned_kv(&compute, &layout());
    // The "layer kernels": held back, then writing the new KV into the cache.
    let gate = hold_back(&compute);
    for (from, to) in written.iter().zip(&mut buffers) {
        compute.memcpy_dtod(from, to).unwrap();
    }
    let gpu = HostStore::new();
    let streamer = Streamer::spawn(StreamerConfig::default(), Box::new(gpu.clone())).unwrap();
    let plan = plan();
    let mut completions = Vec::new();
    for layer in 0..LAYERS {
        // SAFETY: `compute` is a live stream of the engine's context, and `kv` is what it writes.
        let sent = unsafe {
            streamer.device_layer_ready(&engine, &kv, compute.cu_stream(), &plan, 0, layer, 0..TOKENS)
        };
        completions.extend(sent.unwrap());
    }
    assert!(!completions.is_empty());
    // The host was not held back: nothing can be done while the compute stream sleeps.
    assert!(completions.iter().all(|c| !c.is_finished()), "a copy finished before its layer was written");
    gate.open();
    for completion in completions {
        assert!(completion.wait().unwrap().bytes > 0);
    }
    streamer.shutdown(Shutdown::Drain).unwrap();
    // The same layers sent by the CPU engine from the host cache: the same chunks, byte for byte.
    let cpu = HostStore::new();
    let host_streamer = Streamer::spawn(StreamerConfig::default(), Box::new(cpu.clone())).unwrap();
    for layer in 0..LAYERS {
        for completion in host_streamer.layer_ready(&cache, &plan, 0, layer, 0..TOKENS).unwrap() {
            completion.wait().unwrap();
        }
    }
    host_streamer.shutdown(Shutdown::Drain).unwrap();
    let (gpu, cpu) = (chunks(&gpu), chunks(&cpu));
    assert_eq!(gpu.len(), cpu.len());
    assert_eq!(gpu, cpu);
    drop(kv);
    drop(buffers);
}

#[test]
fn a_device_job_outside_its_cache_is_a_typed_error() {
    let Some((_turn, engine)) = engine_for(Device::Shared) else { return };
    let kv = Arc::new(engine.alloc_kv(layout()).unwrap());
    let streamer = Streamer::spawn(StreamerConfig::default(), Box::new(HostStore::new())).unwrap();
    let transfer = plan().into_iter().next().unwrap();
    // Tokens past the cache's capacity.
    let job = dejavulib::streamer::DeviceJob { engine, kv, transfer, tokens: 0..TOKENS + 5, ready: None };
    let result = streamer.submit_device(job).unwrap().wait();
    assert!(matches!(result, Err(StreamerError::Stream(StreamError::Cache(_)))), "{result:?}");
    // The streamer goes on working.
    let cache = noisy_cache(3);
    let job = StreamJob { cache, transfer: plan().into_iter().next().unwrap(), tokens: 0..TOKENS };
    streamer.submit(job).unwrap().wait().unwrap();
    streamer.shutdown(Shutdown::Drain).unwrap();
}

#[test]
fn a_prefetch_is_in_place_before_the_compute_stream_reads_it() {
    let Some((_turn, engine)) = engine_for(Device::Alone) else { return };
    let compute = engine.context().new_stream().unwrap();
    let cache = noisy_cache(11);
    let region = KvRegion::new(1..3, 0..SLOTS, 0..spec().kv_heads(), 0..TOKENS);
    let packing = cache.layout().preferred_packing();
    let mut packed = vec![0u8; cache.packed_len(&region) as usize];
    cache.gather(&region, packing, &mut packed).unwrap();
    let mut pinned = engine.pinned(packed.len()).unwrap();
    pinned.as_mut_slice().unwrap().copy_from_slice(&packed);
    let (buffers, kv) = engine_owned_kv(&compute, &layout());
    // Hold the copy stream back, so the prefetch is still pending when the engine reads.
    let blocker = engine.context().new_stream().unwrap();
    let gate = hold_back(&blocker);
    // SAFETY: `blocker` is a live stream of the engine's context.
    unsafe { engine.after(blocker.cu_stream()) }.unwrap();
    let mut staging = engine.alloc(packed.len() + 100).unwrap();
    let done = engine.prefetch(&pinned, &mut staging, &kv, &region, packing).unwrap();
    assert!(!done.is_done().unwrap(), "the prefetch returned only after its copies");
    // The engine's stream waits for the prefetch, then reads the cache.
    // SAFETY: `compute` is a live stream of the engine's context.
    unsafe { done.make_wait(compute.cu_stream()) }.unwrap();
    let read: Vec<CudaSlice<u8>> = buffers.iter().map(|b| compute.clone_dtod(b).unwrap()).collect();
    // The reads are queued behind the prefetch, which still waits for the gate.
    assert!(!done.is_done().unwrap());
    gate.open();
    let read: Vec<Vec<u8>> = read.iter().map(|b| compute.clone_dtoh(b).unwrap()).collect();
    done.wait().unwrap();
    assert!(done.is_done().unwrap());
    // What the CPU engine's scatter of the same bytes into a zeroed cache gives.
    let expected = KvCache::new(layout()).unwrap();
    expected.scatter(&region, packing, &packed).unwrap();
    assert_eq!(read, expected.snapshot());
    drop(kv);
}

#[test]
fn a_prefetch_of_the_wrong_length_is_refused() {
    let Some((_turn, engine)) = engine_for(Device::Shared) else { return };
    let kv = engine.alloc_kv(layout()).unwrap();
    let region = KvRegion::new(0..1, 0..1, 0..1, 0..TOKENS);
    let needed = kv.packed_len(&region) as usize;
    let pinned = engine.pinned(needed + 1).unwrap();
    let mut staging = engine.alloc(needed).unwrap();
    let packing = layout().preferred_packing();
    let refused = engine.prefetch(&pinned, &mut staging, &kv, &region, packing).unwrap_err();
    assert!(matches!(refused, dejavulib::cuda::CudaError::Size { .. }), "{refused}");
    let mut small = engine.alloc(needed - 1).unwrap();
    let pinned = engine.pinned(needed).unwrap();
    let refused = engine.prefetch(&pinned, &mut small, &kv, &region, packing).unwrap_err();
    assert!(matches!(refused, dejavulib::cuda::CudaError::Size { .. }), "{refused}");
}

#[test]
fn memory_handed_over_as_device_memory_is_checked() {
    let Some((_turn, engine)) = engine_for(Device::Shared) else { return };
    let stream = engine.context().new_stream().unwrap();
    let buffer = stream.alloc_zeros::<u8>(4096).unwrap();
    let address = buffer.device_ptr(&stream).0;
    engine.check_device_memory("buffer", address, 4096).unwrap();
    engine.check_device_memory("its second half", address + 2048, 2048).unwrap();
    let past = engine.check_device_memory("buffer", address + 1, 4096).unwrap_err();
    assert!(past.to_string().contains("past the end"), "{past}");
    let pinned = engine.pinned(4096).unwrap();
    let host = pinned.as_slice().unwrap().as_ptr() as u64;
    let refused = engine.check_device_memory("pinned", host, 4096).unwrap_err();
    assert!(refused.to_string().contains("host memory"), "{refused}");
    let pageable = vec![0u8; 4096];
    let refused = engine.check_device_memory("pageable", pageable.as_ptr() as u64, 4096).unwrap_err();
    assert!(matches!(refused, dejavulib::cuda::CudaError::NotDeviceMemory { .. }), "{refused}");
}

#[test]
fn long_runs_are_copied_a_run_per_thread_block_as_the_cpu_engine_copies_them() {
    let Some((_turn, engine)) = engine_for(Device::Shared) else { return };
    // Per-layer [B][H][S][D]: a head's 64 tokens are one run of 16 KiB.
    let spec = KvSpec::new(2, 3, 128, DType::F16).unwrap();
    let layout = KvLayout::per_layer(spec, 2, 64, dejavulib::layout::PerLayerOrder::Bhsd).unwrap();
    let region = KvRegion::new(0..2, 0..2, 0..3, 0..64);
    let packing = layout.preferred_packing();
    let plan = dejavulib::cache::gather_copy_plan(&layout, &region, packing).unwrap();
    let table = dejavulib::cuda::table::encode(&plan, &[0; 4], &[0]).unwrap();
    assert!(!dejavulib::cuda::table::by_items(&table), "the run kernel must copy this");
    let cache = KvCache::new(layout.clone()).unwrap();
    let noise = common::Rng::new(17).bytes(cache.packed_len(&region) as usize);
    cache.scatter(&region, packing, &noise).unwrap();
    let mut kv = engine.alloc_kv(layout).unwrap();
    engine.upload_kv(&cache.snapshot(), &mut kv).unwrap();
    let staging = engine.alloc(noise.len()).unwrap();
    let gather = engine.prepare_gather(&kv, &region, packing, &staging).unwrap();
    engine.launch(&gather, &kv, &staging).unwrap();
    let mut out = vec![0u8; noise.len()];
    engine.download(&staging, &mut out).unwrap();
    assert_eq!(out, noise);
}

#[test]
fn transfers_to_and_from_pinned_memory_move_what_the_cpu_engine_moves() {
    let Some((_turn, engine)) = engine_for(Device::Shared) else { return };
    // 8 MB over 8 layers.
    let spec = KvSpec::new(8, 8, 128, DType::F16).unwrap();
    let layout = KvLayout::faster_transformer(spec, 4, 96).unwrap();
    let region = KvRegion::new(0..8, 0..4, 0..8, 16..80);
    let packing = layout.preferred_packing();
    let cache = KvCache::new(layout.clone()).unwrap();
    let whole = KvRegion::new(0..8, 0..4, 0..8, 0..96);
    let noise = common::Rng::new(23).bytes(cache.packed_len(&whole) as usize);
    cache.scatter(&whole, packing, &noise).unwrap();
    let mut kv = engine.alloc_kv(layout.clone()).unwrap();
    engine.upload_kv(&cache.snapshot(), &mut kv).unwrap();
    let len = cache.packed_len(&region) as usize;
    assert!(len > 7 << 20);
    let mut expected = vec![0u8; len];
    cache.gather(&region, packing, &mut expected).unwrap();
    // Down: staging and pinned memory longer than the region.
    let staging = engine.alloc(len + 4096).unwrap();
    let mut pinned = engine.pinned(len + 100).unwrap();
    let done = engine.gather_to_host(&kv, &region, packing, &staging, &mut pinned).unwrap();
    // Reading waits for the copies by itself.
    assert_eq!(&pinned.as_slice().unwrap()[..len], &expected[..]);
    assert!(done.is_done().unwrap());
    // Up: other bytes into a zeroed cache, as the CPU engine scatters them.
    let incoming = common::Rng::new(29).bytes(len);
    let mut upload = engine.pinned(len).unwrap();
    upload.as_mut_slice().unwrap().copy_from_slice(&incoming);
    let target = engine.alloc_kv(layout.clone()).unwrap();
    let mut up_staging = engine.alloc(len).unwrap();
    engine.prefetch(&upload, &mut up_staging, &target, &region, packing).unwrap().wait().unwrap();
    let reference = KvCache::new(layout).unwrap();
    reference.scatter(&region, packing, &incoming).unwrap();
    assert_eq!(engine.download_kv(&target).unwrap(), reference.snapshot());
}

/// A per-layer `[B][H][S][D]` cache of `layers` layers, 2 MiB each, filled with noise on the host
/// and on the GPU, and a region of it: every layer, every slot and head, `tokens`.
fn per_layer_noise(
    engine: &CudaEngine,
    layers: u32,
    tokens: std::ops::Range<u32>,
) -> (KvCache, DeviceKv, KvRegion) {
    // 8 slots x 8 heads x 64 tokens x 128 elements x 2 bytes x K and V: 2 MiB a layer.
    let spec = KvSpec::new(layers, 8, 128, DType::F16).unwrap();
    let layout = KvLayout::per_layer(spec, 8, 64, dejavulib::layout::PerLayerOrder::Bhsd).unwrap();
    let cache = KvCache::new(layout.clone()).unwrap();
    let whole = KvRegion::new(0..layers, 0..8, 0..8, 0..64);
    let noise = common::Rng::new(u64::from(layers) * 31 + 1).bytes(cache.packed_len(&whole) as usize);
    cache.scatter(&whole, layout.preferred_packing(), &noise).unwrap();
    let mut kv = engine.alloc_kv(layout).unwrap();
    engine.upload_kv(&cache.snapshot(), &mut kv).unwrap();
    (cache, kv, KvRegion::new(0..layers, 0..8, 0..8, tokens))
}

#[test]
fn host_copies_in_pieces_move_what_the_cpu_engine_moves_into_pinned_and_pageable_memory() {
    let Some((_turn, engine)) = engine_for(Device::Shared) else { return };
    // 12 layers of 2 MiB: pieces of 3 layers, more pieces than the staging ring holds.
    let (cache, kv, region) = per_layer_noise(&engine, 12, 0..64);
    let packing = cache.layout().preferred_packing();
    let len = cache.packed_len(&region) as usize;
    assert_eq!(len, 24 << 20);
    let mut expected = vec![0u8; len];
    cache.gather(&region, packing, &mut expected).unwrap();
    // Pageable memory.
    let mut pageable = vec![0u8; len];
    assert_eq!(engine.host_memory(&pageable).unwrap(), dejavulib::cuda::HostMemory::Pageable);
    engine.gather_into_host(&kv, &region, packing, &mut pageable).unwrap();
    assert!(pageable == expected, "the gather into pageable memory differs from the CPU engine's");
    // Pinned memory from the pool, twice: the second lease reuses the first buffer.
    for round in 0..2 {
        let mut pinned = engine.pinned_pool().lease(len).unwrap();
        assert_eq!(
            engine.host_memory(pinned.as_slice().unwrap()).unwrap(),
            dejavulib::cuda::HostMemory::Pinned
        );
        engine.gather_into_host(&kv, &region, packing, pinned.as_mut_slice().unwrap()).unwrap();
        assert!(
            pinned.as_slice().unwrap() == expected.as_slice(),
            "round {round}: the pinned gather differs"
        );
        drop(pinned);
        assert!(engine.pinned_pool().kept_bytes() >= len, "the buffer went back to the pool");
    }
    // Up again, from pinned and from pageable memory, into a zeroed cache: what the CPU engine's
    // scatter of the same bytes gives.
    let incoming = common::Rng::new(41).bytes(len);
    let reference = KvCache::new(cache.layout().clone()).unwrap();
    reference.scatter(&region, packing, &incoming).unwrap();
    let target = engine.alloc_kv(cache.layout().clone()).unwrap();
    engine.scatter_from_host(&incoming, &target, &region, packing).unwrap();
    assert!(engine.download_kv(&target).unwrap() == reference.snapshot(), "the pageable scatter differs");
    let target = engine.alloc_kv(cache.layout().clone()).unwrap();
    let mut pinned = engine.pinned_pool().lease(len).unwrap();
    pinned.as_mut_slice().unwrap().copy_from_slice(&incoming);
    engine.scatter_from_host(pinned.as_slice().unwrap(), &target, &region, packing).unwrap();
    assert!(engine.download_kv(&target).unwrap() == reference.snapshot(), "the pinned scatter differs");
}

#[test]
fn a_decode_step_and_an_odd_layer_count_go_through_the_host_path_whole() {
    let Some((_turn, engine)) = engine_for(Device::Shared) else { return };
    // One token of 7 layers: a single piece; then 7 layers of 64 tokens: 7 pieces of a layer;
    // then one token of 40 layers in two pieces, as a decode step of a 13B-class stage.
    for (layers, tokens) in [(7, 40..41), (7, 0..64), (40, 40..41)] {
        let (cache, kv, region) = per_layer_noise(&engine, layers, tokens.clone());
        let packing = cache.layout().preferred_packing();
        let mut expected = vec![0u8; cache.packed_len(&region) as usize];
        cache.gather(&region, packing, &mut expected).unwrap();
        let mut pinned = engine.pinned_pool().lease(expected.len()).unwrap();
        engine.gather_into_host(&kv, &region, packing, pinned.as_mut_slice().unwrap()).unwrap();
        assert!(pinned.as_slice().unwrap() == expected.as_slice(), "tokens {tokens:?}");
    }
}

#[test]
fn the_host_path_refuses_a_buffer_of_the_wrong_length() {
    let Some((_turn, engine)) = engine_for(Device::Shared) else { return };
    let (cache, kv, region) = per_layer_noise(&engine, 2, 0..8);
    let packing = cache.layout().preferred_packing();
    let len = cache.packed_len(&region) as usize;
    let mut short = vec![0u8; len - 1];
    let error = engine.gather_into_host(&kv, &region, packing, &mut short).unwrap_err();
    assert!(matches!(error, dejavulib::cuda::CudaError::Size { .. }), "{error}");
    let error = engine.scatter_from_host(&vec![0u8; len + 1], &kv, &region, packing).unwrap_err();
    assert!(matches!(error, dejavulib::cuda::CudaError::Size { .. }), "{error}");
}

#[test]
fn a_host_gather_waits_for_the_compute_stream_the_engine_marked() {
    let Some((_turn, engine)) = engine_for(Device::Alone) else { return };
    let compute = engine.context().new_stream().unwrap();
    let (cache, _, region) = per_layer_noise(&engine, 4, 0..64);
    let layout = cache.layout().clone();
    let written: Vec<CudaSlice<u8>> =
        cache.snapshot().iter().map(|b| compute.clone_htod(b).unwrap()).collect();
    let (mut buffers, kv) = engine_owned_kv(&compute, &layout);
    // The "layer kernels", held back until the gather is queued behind them.
    let gate = hold_back(&compute);
    for (from, to) in written.iter().zip(&mut buffers) {
        compute.memcpy_dtod(from, to).unwrap();
    }
    // SAFETY: `compute` is a live stream of the engine's context.
    unsafe { engine.after(compute.cu_stream()) }.unwrap();
    let opener = std::thread::spawn(move || {
        // The gather below blocks until its copies are done, so the gate opens from here; had the
        // gather not waited for the compute stream, it would have read the zeroed cache.
        std::thread::sleep(Duration::from_millis(50));
        gate.open();
    });
    let mut out = engine.pinned_pool().lease(cache.packed_len(&region) as usize).unwrap();
    engine.gather_into_host(&kv, &region, layout.preferred_packing(), out.as_mut_slice().unwrap()).unwrap();
    opener.join().unwrap();
    let mut expected = vec![0u8; out.len()];
    cache.gather(&region, layout.preferred_packing(), &mut expected).unwrap();
    assert!(out.as_slice().unwrap() == expected.as_slice());
    drop(kv);
}

#[test]
fn a_scatter_into_new_staging_waits_for_its_zeroing_behind_a_held_copy_stream() {
    let Some((_turn, engine)) = engine_for(Device::Alone) else { return };
    // A fresh engine: its staging pool is empty, so the scatter allocates (and zeroes, on the copy
    // stream) the ring it fills from the transfer stream.
    let (cache, _, region) = per_layer_noise(&engine, 12, 0..64);
    let packing = cache.layout().preferred_packing();
    let fresh = Arc::new(CudaEngine::open(0).unwrap());
    let target = fresh.alloc_kv(cache.layout().clone()).unwrap();
    let incoming = common::Rng::new(43).bytes(cache.packed_len(&region) as usize);
    let blocker = fresh.context().new_stream().unwrap();
    let gate = hold_back(&blocker);
    // SAFETY: `blocker` is a live stream of the engine's context.
    unsafe { fresh.after(blocker.cu_stream()) }.unwrap();
    let opener = std::thread::spawn(move || {
        // The scatter blocks until its copies are done, so the gate opens from here.
        std::thread::sleep(Duration::from_millis(50));
        gate.open();
    });
    fresh.scatter_from_host(&incoming, &target, &region, packing).unwrap();
    opener.join().unwrap();
    let reference = KvCache::new(cache.layout().clone()).unwrap();
    reference.scatter(&region, packing, &incoming).unwrap();
    assert!(
        fresh.download_kv(&target).unwrap() == reference.snapshot(),
        "the staging was zeroed after it was filled"
    );
}
