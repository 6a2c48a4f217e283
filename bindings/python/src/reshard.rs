//! Pipeline setups and resharding between them.

use std::sync::Arc;

use dejavulib::reshard::StreamStats;
use dejavulib::{
    plan_stream_in, plan_stream_out, stream_in, stream_out, KvCache, Setup, StageSpec, StagingPool,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::cache::PyCache;
use crate::errors::*;
use crate::layout::*;
use crate::store::{worker, PyStore};

pub(crate) fn stats(py: Python<'_>, s: StreamStats) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("chunks", s.chunks)?;
    d.set_item("bytes", s.bytes)?;
    d.set_item("copy_seconds", s.copy_time.as_secs_f64())?;
    d.set_item("io_seconds", s.io_time.as_secs_f64())?;
    Ok(d)
}

/// A pipeline: the model's KV spec, its stages (layer range and tensor-parallel degree each), and
/// how requests are batched.
#[pyclass(name = "Setup", module = "dejavu", frozen)]
pub(crate) struct PySetup(pub(crate) Setup);

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
        let holding = self.0.holding(crate::store::worker(worker)).map_err(value_err)?;
        let spec = self
            .0
            .spec()
            .share(holding.layers.len() as u32, holding.heads.len() as u32)
            .map_err(value_err)?;
        Ok(PySpec(spec))
    }

    /// What `worker` holds: global `layers` and `heads` ranges, and whether it is their primary.
    fn holding<'py>(&self, py: Python<'py>, worker: (u32, u32)) -> PyResult<Bound<'py, PyDict>> {
        let h = self.0.holding(crate::store::worker(worker)).map_err(value_err)?;
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
pub(crate) fn py_stream_out<'py>(
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
pub(crate) fn py_stream_in<'py>(
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
