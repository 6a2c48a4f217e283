//! The report's GPU rows, where a CUDA driver is present: the gather kernel against a
//! device-to-device copy of the same bytes; a decode step's gather plus its copy to pinned host
//! memory against a plain pinned copy of the same bytes, and the swap-in the other way; and the
//! overlap overhead: a synthetic decode loop of about 10 ms per step, streaming each layer's new
//! token out of device memory while the next layers compute, against the same loop not streaming.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::compile_ptx;
use dejavulib::cuda::{driver_present, CudaEngine, CudaError};
use dejavulib::reshard::Transfer;
use dejavulib::streamer::Shutdown;
use dejavulib::{HostStore, KvRegion, Streamer, StreamerConfig, WorkerId};

use crate::e2e::REPLICATION_TARGET;
use crate::{gbps, median_of, Row, Workload};

/// The synthetic layer kernel's source.
const LAYER_KERNEL: &str = dejavu_kernels::SYNTHETIC_LAYER;

/// A synthetic decode step's length, the paper's order of magnitude for a 13B-class stage.
const STEP: Duration = Duration::from_millis(10);

/// Steps per block of the overlap run; blocks alternate streaming on and off.
const OVERLAP_BLOCK: usize = 8;

/// The GPU rows for `w`'s decode step and prompt, or why there are none.
pub fn rows(w: &Workload) -> Result<Vec<Row>, String> {
    if !driver_present() {
        return Err("skipped: no CUDA driver on this machine".into());
    }
    measure(w).map_err(|e| format!("failed: {e}"))
}

fn measure(w: &Workload) -> Result<Vec<Row>, CudaError> {
    let engine = Arc::new(CudaEngine::open(0)?);
    let layers = w.cache.layout().spec().layers();
    let synthetic = SyntheticEngine::new(&engine, layers)?;
    // A second of work first: an idle GPU runs at low clocks, and these copies last microseconds.
    for _ in 0..100 {
        synthetic.time_step(layers)?;
    }
    let mut kv = engine.alloc_kv(w.cache.layout().clone())?;
    engine.upload_kv(&w.cache.snapshot(), &mut kv)?;
    let packing = w.packing();
    let mut rows = Vec::new();
    for (name, region) in [("decode step", &w.decode), ("1000-token prompt", &w.prompt)] {
        let len = w.cache.packed_len(region) as usize;
        let (staging, source) = (engine.alloc(len)?, engine.alloc(len)?);
        let mut copy = engine.alloc(len)?;
        let timed = |f: &mut dyn FnMut() -> Result<(), CudaError>| -> Result<Duration, CudaError> {
            f()?;
            engine.synchronize()?;
            let mut failed = None;
            let t = median_of(11, || {
                if let Err(e) = f().and_then(|()| engine.synchronize()) {
                    failed = Some(e);
                }
            });
            failed.map_or(Ok(t), Err)
        };
        // Both sides are one launch and a wait: the kernel prepared once, as a copy moved again
        // and again is (a microbatch swapped out every iteration).
        let gather = engine.prepare_gather(&kv, region, packing, &staging)?;
        let t_gather = timed(&mut || engine.launch(&gather, &kv, &staging))?;
        let t_copy = timed(&mut || engine.copy_device(&source, &mut copy))?;
        let is_decode = region == &w.decode;
        if is_decode {
            rows.push(same_traffic_row(engine.as_ref(), w, region, len as u64, t_gather, &timed)?);
        }
        rows.push(Row {
            name: format!("GPU gather kernel, {name} (prepared: one launch)"),
            value: gbps(len as u64, t_gather),
            unit: "GB/s",
            limit_name: "device-to-device copy of the same bytes".into(),
            limit: gbps(len as u64, t_copy),
            // A decode step reads whole 32-byte sectors for its 16-byte pieces: its target is
            // against the copy of the same traffic (the row above).
            target: if is_decode { 0.0 } else { 0.8 },
            higher_is_better: true,
        });
        // A new region every time (the next token, as decode steps go): the engine moves the table
        // it learned along the tokens instead of planning it again.
        let mut planned = engine.alloc(len)?;
        let mut next = tokens_walk(region, w.cache.layout().max_tokens());
        let t_planned = timed(&mut || engine.gather_region(&kv, &next(), packing, &mut planned).map(drop))?;
        rows.push(Row {
            name: format!("GPU gather, {name}, a new token range each call (not prepared)"),
            value: gbps(len as u64, t_planned),
            unit: "GB/s",
            limit_name: "device-to-device copy of the same bytes".into(),
            limit: gbps(len as u64, t_copy),
            target: 0.0,
            higher_is_better: true,
        });
        if region == &w.decode {
            rows.extend(host_copies(engine.as_ref(), &kv, region, packing, &gather, &staging, &timed)?);
        }
    }
    drop(kv);
    rows.extend(crate::gpu_host::rows(&engine, w)?);
    rows.push(overlap(&engine, &synthetic, w)?);
    Ok(rows)
}

/// The decode-step gather against a device-to-device copy that moves the same DRAM traffic: its
/// bytes read plus bytes written equal the 32-byte sectors the gather reads plus the bytes it
/// writes. Both are reported in the gather's useful bytes per second.
fn same_traffic_row(
    engine: &CudaEngine,
    w: &Workload,
    region: &KvRegion,
    len: u64,
    t_gather: Duration,
    timed: &Timed<'_>,
) -> Result<Row, CudaError> {
    let plan = dejavulib::cache::gather_copy_plan(w.cache.layout(), region, w.packing())?;
    let sectors = crate::source_granules_bytes(&plan, 32);
    let copied = ((sectors + len) / 2) as usize;
    let (source, mut copy) = (engine.alloc(copied)?, engine.alloc(copied)?);
    let t_same = timed(&mut || engine.copy_device(&source, &mut copy))?;
    Ok(Row {
        name: format!("GPU gather kernel, decode step (prepared), {sectors} bytes of 32-byte sectors read"),
        value: gbps(len, t_gather),
        unit: "GB/s",
        limit_name: format!("device-to-device copy of {copied} bytes (the same traffic), per useful byte"),
        limit: gbps(len, t_same),
        target: 0.8,
        higher_is_better: true,
    })
}

/// `region` moved one token further at each call (then back to the start), as decode steps move:
/// the same shape, new addresses.
fn tokens_walk(region: &KvRegion, max_tokens: u32) -> impl FnMut() -> KvRegion {
    let (start, count) = (region.tokens.start, region.tokens.end - region.tokens.start);
    let room = max_tokens.saturating_sub(start + count) + 1;
    let mut step = 0;
    let region = region.clone();
    move || {
        let first = start + step % room;
        step += 1;
        KvRegion::new(region.layers.clone(), region.slots.clone(), region.heads.clone(), first..first + count)
    }
}

/// A timer: the median of a few runs of a closure and a wait for the copy stream.
pub(crate) type Timed<'a> =
    dyn Fn(&mut dyn FnMut() -> Result<(), CudaError>) -> Result<Duration, CudaError> + 'a;

/// The decode step between the GPU and pinned host memory: the library's plain copies against
/// the card's pinned peak (one 256 MiB copy each way), and the buffered step (gather kernel + one
/// copy down; one copy up + scatter kernel) against a plain copy of the same bytes.
fn host_copies(
    engine: &CudaEngine,
    kv: &dejavulib::cuda::DeviceKv,
    region: &KvRegion,
    packing: dejavulib::Packing,
    gather: &dejavulib::cuda::PreparedCopy,
    staging: &dejavulib::cuda::DeviceBuffer,
    timed: &Timed<'_>,
) -> Result<Vec<Row>, CudaError> {
    let len = staging.len() as u64;
    let peak: u64 = 256 << 20;
    let (mut peak_device, mut peak_host) = (engine.alloc(peak as usize)?, engine.pinned(peak as usize)?);
    let t_peak_down = timed(&mut || engine.download_pinned(&peak_device, &mut peak_host))?;
    let t_peak_up = timed(&mut || engine.upload_pinned(&peak_host, &mut peak_device))?;
    drop((peak_device, peak_host));
    let mut pinned = engine.pinned(len as usize)?;
    let mut incoming = engine.alloc(len as usize)?;
    let t_down = timed(&mut || engine.download_pinned(staging, &mut pinned))?;
    let t_up = timed(&mut || engine.upload_pinned(&pinned, &mut incoming))?;
    let mut next = tokens_walk(region, kv.layout().max_tokens());
    let t_gathered =
        timed(&mut || engine.gather_to_host(kv, &next(), packing, staging, &mut pinned).map(drop))?;
    let t_prepared = timed(&mut || {
        engine.launch(gather, kv, staging)?;
        engine.download_pinned(staging, &mut pinned)
    })?;
    let t_swap_in = timed(&mut || engine.prefetch(&pinned, &mut incoming, kv, &next(), packing).map(drop))?;
    let row = |name: &str,
               value: Duration,
               bytes: u64,
               limit_name: &str,
               limit: Duration,
               limit_bytes: u64,
               target| Row {
        name: name.into(),
        value: gbps(bytes, value),
        unit: "GB/s",
        limit_name: limit_name.into(),
        limit: gbps(limit_bytes, limit),
        target,
        higher_is_better: true,
    };
    let peak_down = "the card's pinned device-to-host peak (one 256 MiB copy)";
    let peak_up = "the card's pinned host-to-device peak (one 256 MiB copy)";
    Ok(vec![
        row(
            "GPU -> host: a decode step copied into the library's pinned memory",
            t_down,
            len,
            peak_down,
            t_peak_down,
            peak,
            0.9,
        ),
        row(
            "host -> GPU: a decode step copied from the library's pinned memory",
            t_up,
            len,
            peak_up,
            t_peak_up,
            peak,
            0.9,
        ),
        row(
            "GPU decode step to pinned host memory (gather of a new token each call + one copy)",
            t_gathered,
            len,
            "plain pinned device-to-host copy of the same bytes",
            t_down,
            len,
            0.0,
        ),
        row(
            "GPU decode step to pinned host memory (prepared gather kernel, then one copy)",
            t_prepared,
            len,
            "plain pinned device-to-host copy of the same bytes",
            t_down,
            len,
            0.0,
        ),
        row(
            "GPU swap-in of a decode step from pinned memory (one copy + scatter of a new token each call)",
            t_swap_in,
            len,
            "plain pinned host-to-device copy of the same bytes",
            t_up,
            len,
            0.0,
        ),
    ])
}

/// The synthetic engine: a compute stream, "weights" to stream through, and the layer kernel.
struct SyntheticEngine {
    stream: Arc<CudaStream>,
    weights: CudaSlice<f32>,
    sink: CudaSlice<f32>,
    layer: cudarc::driver::CudaFunction,
    rounds: u32,
}

impl SyntheticEngine {
    /// 256 MiB of weights; the rounds per layer are set so that `layers` layers take about `STEP`.
    fn new(engine: &CudaEngine, layers: u32) -> Result<Self, CudaError> {
        let ctx = engine.context();
        let ptx = compile_ptx(LAYER_KERNEL).map_err(|e| CudaError::Compile(e.to_string()))?;
        let layer = ctx.load_module(ptx)?.load_function("djv_bench_layer")?;
        let stream = ctx.new_stream()?;
        let weights = stream.alloc_zeros::<f32>(64 << 20)?;
        let sink = stream.alloc_zeros::<f32>(1)?;
        let mut synthetic = Self { stream, weights, sink, layer, rounds: 1 };
        let one = synthetic.time_step(layers)?;
        let rounds = STEP.as_secs_f64() / one.as_secs_f64();
        synthetic.rounds = rounds.round().max(1.0) as u32;
        Ok(synthetic)
    }

    fn launch_layer(&self) -> Result<(), CudaError> {
        let n = (self.weights.len() / 4) as u64;
        let config = LaunchConfig { grid_dim: (1024, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut launch = self.stream.launch_builder(&self.layer);
        launch.arg(&self.weights).arg(&n).arg(&self.rounds).arg(&self.sink);
        // SAFETY: the kernel's arguments in order: `n` float4s of weights (the buffer holds
        // exactly that many floats x4), the rounds, and a one-float sink.
        unsafe { launch.launch(config) }?;
        Ok(())
    }

    fn time_step(&self, layers: u32) -> Result<Duration, CudaError> {
        let started = Instant::now();
        for _ in 0..layers {
            self.launch_layer()?;
        }
        self.stream.synchronize()?;
        Ok(started.elapsed())
    }
}

/// The overlap overhead: decode steps of `w`'s layer count on the synthetic engine, each layer's
/// new token (every slot and head) streamed out of a device cache of `w`'s shape to a host store
/// as soon as its layer is launched, against the same steps without streaming, in alternating
/// blocks of one run; each side's median step.
fn overlap(engine: &Arc<CudaEngine>, synthetic: &SyntheticEngine, w: &Workload) -> Result<Row, CudaError> {
    let layout = w.cache.layout().clone();
    let spec = *layout.spec();
    let layers = spec.layers();
    let kv = Arc::new(engine.alloc_kv(layout)?);
    let whole = KvRegion::new(0..layers, w.decode.slots.clone(), 0..spec.kv_heads(), 0..1);
    let worker = WorkerId { stage: 0, rank: 0 };
    let plan = [Transfer::in_place(worker, worker, 0, &whole)];
    let streamer = Streamer::spawn(StreamerConfig::default(), Box::new(HostStore::new()))
        .map_err(|e| CudaError::Driver(e.to_string()))?;
    let stream_error = |e: dejavulib::streamer::StreamerError| CudaError::Driver(e.to_string());
    let token = w.decode.tokens.start;
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for block in 0..2 * 12 + 1 {
        // The first block warms both paths up and is not counted.
        let streaming = block % 2 == 1 || block == 0;
        for _ in 0..OVERLAP_BLOCK {
            let started = Instant::now();
            let mut completions = Vec::new();
            for layer in 0..layers {
                synthetic.launch_layer()?;
                if streaming {
                    // SAFETY: the synthetic engine's stream is a live stream of the engine's
                    // context (made from it), and `kv` is the cache its layers stand for.
                    let sent = unsafe {
                        streamer.device_layer_ready(
                            engine,
                            &kv,
                            synthetic.stream.cu_stream(),
                            &plan,
                            0,
                            layer,
                            token..token + 1,
                        )
                    };
                    completions.extend(sent.map_err(stream_error)?);
                }
            }
            synthetic.stream.synchronize()?;
            // A step ends when its layers are computed and its chunks are in the store: a
            // streamer that fell behind shows here instead of piling up.
            for completion in completions {
                completion.wait().map_err(stream_error)?;
            }
            let step = started.elapsed();
            if block > 0 {
                if streaming {
                    on.push(step)
                } else {
                    off.push(step)
                }
            }
        }
    }
    streamer.shutdown(Shutdown::Drain).map_err(stream_error)?;
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let (on, off) = (median(on), median(off));
    Ok(Row {
        name: format!(
            "GPU decode step ({layers} synthetic layers, {} rounds), each layer's token streamed out",
            synthetic.rounds
        ),
        value: on.as_secs_f64() * 1e3,
        unit: "ms",
        limit_name: "the same steps, not streaming (alternating blocks)".into(),
        limit: off.as_secs_f64() * 1e3,
        target: REPLICATION_TARGET,
        higher_is_better: false,
    })
}
