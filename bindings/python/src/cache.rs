//! Caches over library memory or the engine's own arrays, and their gather / scatter.

use std::sync::Arc;

use dejavulib::{KvCache, StagingPool};
use pyo3::prelude::*;
use pyo3::types::PyByteArray;

use crate::buffer::{raw_buffer, RawBuffer};
use crate::errors::*;
use crate::layout::*;

/// A KV cache over library memory, or over the engine's own arrays and tensors (`KvCache.wrap`).
#[pyclass(name = "KvCache", module = "dejavu", frozen)]
pub(crate) struct PyCache {
    pub(crate) cache: Arc<KvCache>,
    pub(crate) pool: StagingPool,
    /// The engine's buffers, kept alive as long as the cache.
    pub(crate) _engine: Vec<RawBuffer>,
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
