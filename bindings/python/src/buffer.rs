//! Python objects as raw memory, without copies: anything with `__array_interface__` (numpy
//! arrays, many array libraries), PyTorch CPU tensors (`data_ptr`), `bytearray` and `bytes`.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyTuple};

/// Memory of a Python object, kept alive by holding the object.
pub struct RawBuffer {
    /// First byte.
    pub ptr: *mut u8,
    /// Bytes.
    pub len: usize,
    /// The object owning the memory.
    _owner: Py<PyAny>,
}

// SAFETY: the pointer is memory of `_owner`, which the buffer keeps alive; the struct never
// dereferences it itself, and every copy through it runs under the cache's locks.
unsafe impl Send for RawBuffer {}
// SAFETY: as above; shared references only read the pointer value.
unsafe impl Sync for RawBuffer {}

/// A pointer and length that may cross into a section that runs without the GIL.
#[derive(Clone, Copy)]
pub struct RawParts(pub *mut u8, pub usize);

// SAFETY: the memory belongs to an object the caller keeps alive (a `RawBuffer`) for the duration
// of the GIL-free section; the pointer itself is plain data.
unsafe impl Send for RawParts {}
// SAFETY: as above; shared use only reads the pointer value.
unsafe impl Sync for RawParts {}

impl RawBuffer {
    /// The pointer and length, for a section without the GIL.
    pub fn parts(&self) -> RawParts {
        RawParts(self.ptr, self.len)
    }
}

fn itemsize(typestr: &str) -> PyResult<usize> {
    typestr
        .get(2..)
        .and_then(|digits| digits.parse().ok())
        .ok_or_else(|| PyValueError::new_err(format!("unsupported array typestr {typestr:?}")))
}

/// The memory of `obj`, which must be C-contiguous and, when `writable`, writable.
pub fn raw_buffer(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> PyResult<RawBuffer> {
    if obj.hasattr("__cuda_array_interface__")? {
        return Err(PyTypeError::new_err(format!(
            "{what} is in GPU memory; this build of dejavu works on host memory (pass a CPU array or tensor)"
        )));
    }
    if let Ok(bytes) = obj.cast::<PyByteArray>() {
        let len = bytes.len();
        // SAFETY: the object is kept alive in the returned buffer; callers must not resize it while
        // a copy runs (documented on every function that takes buffers).
        let ptr = unsafe { bytes.as_bytes_mut() }.as_mut_ptr();
        return Ok(RawBuffer { ptr, len, _owner: obj.clone().unbind() });
    }
    if let Ok(bytes) = obj.cast::<PyBytes>() {
        if writable {
            return Err(PyTypeError::new_err(format!(
                "{what} must be writable; bytes are immutable (use a bytearray or a numpy array)"
            )));
        }
        let data = bytes.as_bytes();
        return Ok(RawBuffer {
            ptr: data.as_ptr() as *mut u8,
            len: data.len(),
            _owner: obj.clone().unbind(),
        });
    }
    if obj.hasattr("__array_interface__")? {
        let interface = obj.getattr("__array_interface__")?;
        let interface = interface.cast::<PyDict>()?;
        let get = |key: &str| {
            interface
                .get_item(key)?
                .ok_or_else(|| PyValueError::new_err(format!("__array_interface__ lacks {key:?}")))
        };
        let data = get("data")?;
        let data = data.cast::<PyTuple>()?;
        let address: usize = data.get_item(0)?.extract()?;
        let readonly: bool = data.get_item(1)?.extract()?;
        let shape: Vec<usize> = get("shape")?.extract()?;
        let item = itemsize(&get("typestr")?.extract::<String>()?)?;
        let strides = interface.get_item("strides")?;
        if let Some(strides) = strides.filter(|s| !s.is_none()) {
            let strides: Vec<isize> = strides.extract()?;
            let mut expected = item as isize;
            for (&dim, &stride) in shape.iter().zip(&strides).rev() {
                if dim > 1 && stride != expected {
                    return Err(PyValueError::new_err(format!(
                        "{what} must be C-contiguous (strides {strides:?} for shape {shape:?}); use numpy.ascontiguousarray"
                    )));
                }
                expected *= dim as isize;
            }
        }
        if writable && readonly {
            return Err(PyValueError::new_err(format!("{what} is read-only but is written to")));
        }
        let len = shape.iter().product::<usize>() * item;
        if address == 0 && len > 0 {
            return Err(PyValueError::new_err(format!("{what} has a NULL data pointer")));
        }
        return Ok(RawBuffer { ptr: address as *mut u8, len, _owner: obj.clone().unbind() });
    }
    if obj.hasattr("data_ptr")? && obj.hasattr("is_contiguous")? {
        // A PyTorch tensor.
        let device: String = obj.getattr("device")?.getattr("type")?.extract()?;
        if device != "cpu" {
            return Err(PyTypeError::new_err(format!(
                "{what} is on device {device:?}; this build of dejavu works on host memory (use .cpu())"
            )));
        }
        if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
            return Err(PyValueError::new_err(format!("{what} must be contiguous; use .contiguous()")));
        }
        let address: usize = obj.call_method0("data_ptr")?.extract()?;
        let numel: usize = obj.call_method0("numel")?.extract()?;
        let item: usize = obj.call_method0("element_size")?.extract()?;
        return Ok(RawBuffer { ptr: address as *mut u8, len: numel * item, _owner: obj.clone().unbind() });
    }
    Err(PyTypeError::new_err(format!(
        "{what} must be a numpy array, a CPU torch tensor, a bytearray or bytes, not {}",
        obj.get_type().name()?
    )))
}
