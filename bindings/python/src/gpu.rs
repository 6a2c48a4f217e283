//! The CUDA engine from Python: KV caches over an engine's own GPU tensors (anything with
//! `__cuda_array_interface__`: PyTorch CUDA tensors, CuPy arrays), used in place, their gather and
//! scatter to and from host buffers, and the streamer's GPU path (`Streamer.device_layer_ready`).

use std::sync::Arc;

use dejavulib::cuda::{CudaEngine, DeviceKv};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::buffer::{array_interface, raw_buffer};
use crate::errors::*;
use crate::layout::*;
use crate::pinned::PyPinnedBuffer;

/// A GPU: the library's copy kernels compiled for it, and its copy stream.
#[pyclass(name = "CudaEngine", module = "dejavu", frozen)]
pub(crate) struct PyCudaEngine {
    pub(crate) engine: Arc<CudaEngine>,
}

#[pymethods]
impl PyCudaEngine {
    /// Opens GPU `device`. Raises `dejavu.CudaError` where there is no driver, no NVRTC or no
    /// such device.
    #[new]
    #[pyo3(signature = (device = 0))]
    fn new(py: Python<'_>, device: usize) -> PyResult<Self> {
        let engine = py.detach(|| CudaEngine::open(device)).map_err(cuda_err)?;
        Ok(Self { engine: Arc::new(engine) })
    }

    /// A cache of `layout` over `tensors` (one per layout buffer, each C-contiguous GPU memory of
    /// this device, exactly the buffer's size), used in place: no copy is made.
    fn wrap(&self, layout: &PyLayout, tensors: Vec<Bound<'_, PyAny>>) -> PyResult<PyDeviceCache> {
        let sizes = layout.0.buffer_sizes();
        if tensors.len() != sizes.len() {
            return Err(PyValueError::new_err(format!(
                "the layout has {} buffers, {} tensors were given",
                sizes.len(),
                tensors.len()
            )));
        }
        let mut addresses = Vec::with_capacity(tensors.len());
        for (i, (tensor, &size)) in tensors.iter().zip(sizes.iter()).enumerate() {
            let what = format!("tensor {i}");
            let (address, len) = cuda_array(tensor, &what)?;
            if len as u64 != size {
                return Err(PyValueError::new_err(format!(
                    "{what}: {len} bytes where the layout's buffer has {size}"
                )));
            }
            self.engine.check_device_memory(&what, address, len as u64).map_err(cuda_err)?;
            addresses.push(address);
        }
        let owners: Vec<Py<PyAny>> = tensors.into_iter().map(Bound::unbind).collect();
        // SAFETY: each address is device memory of this engine's device covering its layout
        // buffer (checked above), owned by a tensor the cache itself keeps alive (so every copy
        // queued on the cache keeps it too); an engine writing it while a copy runs orders that
        // work with the copy through the `stream` arguments.
        let kv = unsafe { DeviceKv::borrowed(layout.0.clone(), &addresses) }.map_err(cuda_err)?;
        let kv = kv.keeping(Box::new(owners));
        Ok(PyDeviceCache { engine: self.engine.clone(), kv: Arc::new(kv) })
    }

    /// A cache of `layout` in zeroed GPU memory the library allocates.
    fn alloc(&self, py: Python<'_>, layout: &PyLayout) -> PyResult<PyDeviceCache> {
        let kv = py.detach(|| self.engine.alloc_kv(layout.0.clone())).map_err(cuda_err)?;
        Ok(PyDeviceCache { engine: self.engine.clone(), kv: Arc::new(kv) })
    }
}

/// A KV cache in GPU memory (over the engine's tensors, which it keeps alive, as does every copy
/// queued on it).
#[pyclass(name = "DeviceKvCache", module = "dejavu", frozen)]
pub(crate) struct PyDeviceCache {
    pub(crate) engine: Arc<CudaEngine>,
    pub(crate) kv: Arc<DeviceKv>,
}

#[pymethods]
impl PyDeviceCache {
    #[getter]
    fn layout(&self) -> PyLayout {
        PyLayout(self.kv.layout().clone())
    }

    /// Bytes a gather of `region` produces.
    fn packed_len(&self, region: &PyRegion) -> PyResult<u64> {
        self.kv.layout().check_region(&region.0).map_err(|e| cache_err(e.into()))?;
        Ok(self.kv.packed_len(&region.0))
    }

    /// Gathers `region` into host buffer `out` (exactly `packed_len` bytes) or, without one, into
    /// a `PinnedBuffer` from the engine's pool; returns it. Kernels and copies run in pieces of
    /// whole layers on two streams, each piece's kernel overlapping the copy of the one before:
    /// into pinned memory (a pinned torch tensor, a `PinnedBuffer`) a prompt moves at the speed
    /// of one plain copy, a decode step somewhat slower (its kernel is not all hidden). The work
    /// first waits for what is already queued on `stream` (a raw `CUstream` or an object with
    /// `.cuda_stream`, as `torch.cuda.current_stream()`; `None`, the default, is the legacy
    /// default stream).
    #[pyo3(signature = (region, out = None, stream = None))]
    fn gather<'py>(
        &self,
        py: Python<'py>,
        region: &PyRegion,
        out: Option<Bound<'py, PyAny>>,
        stream: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let len = self.packed_len(region)? as usize;
        // Crosses into the GIL-free section as a number.
        let stream = stream_arg(stream.as_ref())? as usize;
        let (engine, kv, region) = (self.engine.clone(), self.kv.clone(), region.0.clone());
        let Some(out) = out else {
            let pinned = py
                .detach(move || {
                    let mut pinned = engine.pinned_pool().lease(len)?;
                    // SAFETY: `stream` is the caller's live stream of this device (documented).
                    unsafe { engine.after(stream as dejavulib::cuda::RawStream) }?;
                    engine.gather_into_host(
                        &kv,
                        &region,
                        kv.layout().preferred_packing(),
                        pinned.as_mut_slice()?,
                    )?;
                    Ok(pinned)
                })
                .map_err(cuda_err)?;
            return Ok(Bound::new(py, PyPinnedBuffer::new(pinned)?)?.into_any());
        };
        let target = raw_buffer(&out, true, "out")?;
        if target.len != len {
            return Err(PyValueError::new_err(format!("out: {} bytes where {len} are needed", target.len)));
        }
        let parts = target.parts();
        py.detach(move || {
            // Moved whole: its fields alone are not `Send`.
            let parts = parts;
            // SAFETY: `target` keeps the object alive; the buffer is writable and contiguous.
            let out = unsafe { std::slice::from_raw_parts_mut(parts.0, parts.1) };
            // SAFETY: `stream` is the caller's live stream of this device (documented).
            unsafe { engine.after(stream as dejavulib::cuda::RawStream) }?;
            engine.gather_into_host(&kv, &region, kv.layout().preferred_packing(), out)
        })
        .map_err(cuda_err)?;
        drop(target);
        Ok(out)
    }

    /// Scatters host buffer `data` (packed as `gather` packs, exactly `packed_len` bytes) into
    /// `region`, after the work already queued on `stream` (as for `gather`); returns once it is
    /// in place. In pieces, as `gather`.
    #[pyo3(signature = (region, data, stream = None))]
    fn scatter(
        &self,
        py: Python<'_>,
        region: &PyRegion,
        data: &Bound<'_, PyAny>,
        stream: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let len = self.packed_len(region)? as usize;
        let stream = stream_arg(stream.as_ref())? as usize;
        let source = raw_buffer(data, false, "data")?;
        if source.len != len {
            return Err(PyValueError::new_err(format!("data: {} bytes where {len} are needed", source.len)));
        }
        let (parts, engine, kv, region) =
            (source.parts(), self.engine.clone(), self.kv.clone(), region.0.clone());
        py.detach(move || {
            // Moved whole: its fields alone are not `Send`.
            let parts = parts;
            // SAFETY: `source` keeps the object alive; the buffer is contiguous.
            let input = unsafe { std::slice::from_raw_parts(parts.0, parts.1) };
            // SAFETY: `stream` is the caller's live stream of this device (documented).
            unsafe { engine.after(stream as dejavulib::cuda::RawStream) }?;
            engine.scatter_from_host(input, &kv, &region, kv.layout().preferred_packing())
        })
        .map_err(cuda_err)?;
        drop(source);
        Ok(())
    }
}

/// A raw `CUstream`: an int, or an object with `.cuda_stream` (a PyTorch or CuPy stream); `None`
/// is the legacy default stream (0).
pub(crate) fn stream_arg(stream: Option<&Bound<'_, PyAny>>) -> PyResult<dejavulib::cuda::RawStream> {
    let Some(stream) = stream else { return Ok(std::ptr::null_mut()) };
    let handle = if stream.hasattr("cuda_stream")? { stream.getattr("cuda_stream")? } else { stream.clone() };
    let handle: usize = handle.extract().map_err(|_| {
        PyTypeError::new_err("stream must be a CUDA stream handle (an int) or have .cuda_stream")
    })?;
    Ok(handle as dejavulib::cuda::RawStream)
}

/// The device address and byte length of a C-contiguous array with `__cuda_array_interface__`.
fn cuda_array(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<(u64, usize)> {
    if !obj.hasattr("__cuda_array_interface__")? {
        return Err(PyTypeError::new_err(format!(
            "{what} must be GPU memory with __cuda_array_interface__ (a CUDA torch tensor, a CuPy array), not {}",
            obj.get_type().name()?
        )));
    }
    let array = array_interface(obj, "__cuda_array_interface__", what, ".contiguous()")?;
    if array.readonly {
        return Err(PyValueError::new_err(format!("{what} is read-only but a cache is written to")));
    }
    let (address, len) = (array.address, array.len);
    Ok((address, len))
}
