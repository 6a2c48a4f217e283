//! Pinned host memory handed to Python: what `DeviceKvCache.gather` returns when no buffer is
//! given. numpy and torch take it without a copy (`numpy.asarray(buf)`, then
//! `torch.from_numpy`), and the memory goes back to the engine's pool once nothing holds it.

use dejavulib::cuda::PooledPinned;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

/// Page-locked host memory from a CUDA engine's pool, exposed through `__array_interface__` (a
/// one-dimensional `uint8` array) and as bytes.
#[pyclass(name = "PinnedBuffer", module = "dejavu", frozen)]
pub(crate) struct PyPinnedBuffer {
    memory: PooledPinned,
    /// The first byte, taken once: the memory never moves.
    address: usize,
}

impl PyPinnedBuffer {
    pub(crate) fn new(mut memory: PooledPinned) -> PyResult<Self> {
        let address = memory.as_mut_slice().map_err(crate::errors::cuda_err)?.as_mut_ptr() as usize;
        Ok(Self { memory, address })
    }
}

#[pymethods]
impl PyPinnedBuffer {
    fn __len__(&self) -> usize {
        self.memory.len()
    }

    /// A copy of the bytes.
    fn __bytes__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let (from, len) = (self.address as *const u8, self.memory.len());
        PyBytes::new_with(py, len, |to| {
            // SAFETY: `from` is `len` bytes of memory this object owns (alive while `self` is);
            // copied as raw bytes, not through a shared slice, since numpy may write the memory
            // meanwhile (the bytes are then those of some moment of the write).
            unsafe { std::ptr::copy_nonoverlapping(from, to.as_mut_ptr(), len) };
            Ok(())
        })
    }

    /// numpy's array interface: writable `uint8` of `len` bytes, at an address that holds while
    /// this object lives (numpy keeps it as the array's base).
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let interface = PyDict::new(py);
        interface.set_item("shape", (self.memory.len(),))?;
        interface.set_item("typestr", "|u1")?;
        interface.set_item("data", (self.address, false))?;
        interface.set_item("version", 3)?;
        Ok(interface)
    }

    fn __repr__(&self) -> String {
        format!("PinnedBuffer({} bytes)", self.memory.len())
    }
}
