//! The background streamer and its completions.

use std::sync::Arc;
use std::time::Duration;

use dejavulib::affinity::CpuList;
use dejavulib::streamer::{Completion, DeviceJob, Shutdown, StreamJob, StreamerError};
use dejavulib::{plan_stream_out, Streamer, StreamerConfig};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::cache::PyCache;
use crate::errors::cuda_err;
use crate::errors::*;
use crate::gpu::{stream_arg, PyDeviceCache};
use crate::layout::*;
use crate::reshard::PySetup;
use crate::store::{local_transfer, worker, PyStore};

/// One job handed to a `Streamer`.
#[pyclass(name = "Completion", module = "dejavu")]
pub(crate) struct PyCompletion {
    pub(crate) inner: Mutex<Completion>,
    /// The job's outcome once known: bytes, copy and I/O seconds, or its error.
    pub(crate) outcome: Option<Result<(u64, f64, f64), PyErr>>,
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
pub(crate) struct PyStreamer {
    pub(crate) inner: Mutex<Option<Streamer>>,
}

#[pymethods]
impl PyStreamer {
    /// Starts the thread; it flushes to `store`. `submit`-style calls block (GIL released) once
    /// `queue_depth` jobs wait. `cpus` (a list such as "4-7") puts the thread on those CPUs, away
    /// from an engine computing on the others. With a sidecar store, `puts_in_flight` puts (1 by
    /// default) cross to the successor while the next chunk is gathered; 0 waits for each. A
    /// completion comes once its chunk is kept and replicated either way.
    #[new]
    #[pyo3(signature = (store, queue_depth = 64, cpus = None, puts_in_flight = 1))]
    fn new(store: &PyStore, queue_depth: usize, cpus: Option<&str>, puts_in_flight: usize) -> PyResult<Self> {
        let cpus = cpus.map(str::parse::<CpuList>).transpose().map_err(|e| Error::new_err(e.to_string()))?;
        let config = StreamerConfig { queue_depth, cpus, puts_in_flight, ..StreamerConfig::default() };
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

    /// The GPU path of `layer_ready`: the engine has just queued the kernels that write local
    /// `layer` of `microbatch` of `cache` (GPU memory) on `stream` (a raw `CUstream` or an object
    /// with `.cuda_stream`, as `torch.cuda.current_stream()`). Marks that point on the stream
    /// without waiting and queues the layer's part of every transfer toward setup `b`; each copy
    /// waits on the GPU for the mark. Returns one `Completion` per chunk.
    #[allow(clippy::too_many_arguments)]
    fn device_layer_ready(
        &self,
        py: Python<'_>,
        a: &PySetup,
        source: (u32, u32),
        b: &PySetup,
        cache: &PyDeviceCache,
        stream: &Bound<'_, PyAny>,
        microbatch: u32,
        layer: u32,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<PyCompletion>> {
        let tokens = range_arg(tokens, "tokens")?;
        // Crosses into the GIL-free section as a number.
        let stream = stream_arg(Some(stream))? as usize;
        let plan = plan_stream_out(&a.0, worker(source), &b.0).map_err(stream_err)?;
        let guard = self.inner.lock();
        let streamer = guard.as_ref().ok_or_else(|| Error::new_err("the streamer is shut down"))?;
        let (engine, kv) = (&cache.engine, &cache.kv);
        // A full queue blocks: without the GIL.
        let completions = py
            .detach(|| {
                // SAFETY: `stream` is a live stream of the cache's device, and the kernels queued
                // on it write `cache` (the documented contract of this method).
                unsafe {
                    streamer.device_layer_ready(
                        engine,
                        kv,
                        stream as dejavulib::cuda::RawStream,
                        &plan,
                        microbatch,
                        layer,
                        tokens,
                    )
                }
            })
            .map_err(|e| match e {
                StreamerError::Stream(dejavulib::reshard::StreamError::Cuda(e)) => cuda_err(e),
                other => streamer_err(other),
            })?;
        Ok(completions.into_iter().map(|c| PyCompletion { inner: Mutex::new(c), outcome: None }).collect())
    }

    /// `region` of `cache` is written: queues it as one chunk, the one `flush` would write with the
    /// same `source`, `destination` and `microbatch` (a sidecar store keeps it and forwards it to
    /// its successor). `cache` must stay alive and unchanged in `region` until the completion is
    /// waited for. Returns the job's `Completion`.
    #[pyo3(signature = (cache, region, source = (0, 0), destination = (0, 0), microbatch = 0))]
    fn region_ready(
        &self,
        py: Python<'_>,
        cache: &PyCache,
        region: &PyRegion,
        source: (u32, u32),
        destination: (u32, u32),
        microbatch: u32,
    ) -> PyResult<PyCompletion> {
        cache.cache.layout().check_region(&region.0).map_err(|e| cache_err(e.into()))?;
        let transfer = local_transfer(&region.0, source, destination, microbatch);
        let job = StreamJob { cache: cache.cache.clone(), transfer, tokens: region.0.tokens.clone() };
        let guard = self.inner.lock();
        let streamer = guard.as_ref().ok_or_else(|| Error::new_err("the streamer is shut down"))?;
        // A full queue blocks: without the GIL.
        let completion = py.detach(|| streamer.submit(job)).map_err(streamer_err)?;
        Ok(PyCompletion { inner: Mutex::new(completion), outcome: None })
    }

    /// The GPU path of `region_ready`: the engine has just queued the kernels that write `region`
    /// of `cache` (GPU memory) on `stream` (a raw `CUstream` or an object with `.cuda_stream`, as
    /// `torch.cuda.current_stream()`). Marks that point on the stream without waiting and queues
    /// the region as one chunk, the one `flush` of the same region would write; its copies wait
    /// on the GPU for the mark. Returns the job's `Completion`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (cache, stream, region, source = (0, 0), destination = (0, 0), microbatch = 0))]
    fn device_region_ready(
        &self,
        py: Python<'_>,
        cache: &PyDeviceCache,
        stream: &Bound<'_, PyAny>,
        region: &PyRegion,
        source: (u32, u32),
        destination: (u32, u32),
        microbatch: u32,
    ) -> PyResult<PyCompletion> {
        cache.kv.layout().check_region(&region.0).map_err(|e| cache_err(e.into()))?;
        // Crosses into the GIL-free section as a number.
        let stream = stream_arg(Some(stream))? as usize;
        let transfer = local_transfer(&region.0, source, destination, microbatch);
        let guard = self.inner.lock();
        let streamer = guard.as_ref().ok_or_else(|| Error::new_err("the streamer is shut down"))?;
        let (engine, kv) = (&cache.engine, &cache.kv);
        let completion = py
            .detach(|| {
                // SAFETY: `stream` is a live stream of the cache's device, and the kernels queued
                // on it write `cache` (the documented contract of this method).
                let ready = unsafe { engine.mark_ready(stream as dejavulib::cuda::RawStream) }?;
                let job = DeviceJob {
                    engine: engine.clone(),
                    kv: kv.clone(),
                    transfer,
                    tokens: region.0.tokens.clone(),
                    ready: Some(Arc::new(ready)),
                };
                Ok(streamer.submit_device(job))
            })
            .map_err(cuda_err)?
            .map_err(streamer_err)?;
        Ok(PyCompletion { inner: Mutex::new(completion), outcome: None })
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
