//! Python objects as raw memory, without copies: anything with `__array_interface__` (numpy
//! arrays, many array libraries), anything with `__dlpack__` (a DLPack capsule: JAX, CuPy's host
//! arrays, PyTorch, numpy), PyTorch CPU tensors (`data_ptr`), `bytearray` and `bytes`.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyCapsule, PyCapsuleMethods, PyDict, PyTuple};

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

/// What an array interface (numpy's `__array_interface__`, or `__cuda_array_interface__`, which
/// has the same form) says of a C-contiguous array's memory.
pub struct ArrayMemory {
    /// First byte.
    pub address: u64,
    /// Bytes.
    pub len: usize,
    /// Whether it must not be written.
    pub readonly: bool,
}

/// Reads `obj.<attribute>` (an array interface dict): its memory, which must be C-contiguous
/// (else a `ValueError` that suggests `fix`) and not NULL.
pub fn array_interface(
    obj: &Bound<'_, PyAny>,
    attribute: &str,
    what: &str,
    fix: &str,
) -> PyResult<ArrayMemory> {
    let interface = obj.getattr(attribute)?;
    let interface = interface.cast::<PyDict>()?;
    let get = |key: &str| {
        interface.get_item(key)?.ok_or_else(|| PyValueError::new_err(format!("{attribute} lacks {key:?}")))
    };
    let data = get("data")?;
    let data = data.cast::<PyTuple>()?;
    let address: u64 = data.get_item(0)?.extract()?;
    let readonly: bool = data.get_item(1)?.extract()?;
    let shape: Vec<usize> = get("shape")?.extract()?;
    let item = itemsize(&get("typestr")?.extract::<String>()?)?;
    if let Some(strides) = interface.get_item("strides")?.filter(|s| !s.is_none()) {
        let strides: Vec<isize> = strides.extract()?;
        let mut expected = item as isize;
        for (&dim, &stride) in shape.iter().zip(&strides).rev() {
            if dim > 1 && stride != expected {
                return Err(PyValueError::new_err(format!(
                    "{what} must be C-contiguous (strides {strides:?} for shape {shape:?}); use {fix}"
                )));
            }
            expected *= dim as isize;
        }
    }
    let len = shape.iter().product::<usize>() * item;
    if address == 0 && len > 0 {
        return Err(PyValueError::new_err(format!("{what} has a NULL data pointer")));
    }
    Ok(ArrayMemory { address, len, readonly })
}

/// The memory of `obj`, which must be C-contiguous and, when `writable`, writable.
pub fn raw_buffer(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> PyResult<RawBuffer> {
    if obj.hasattr("__cuda_array_interface__")? {
        return Err(PyTypeError::new_err(format!(
            "{what} is in GPU memory; a host cache takes host memory (for GPU tensors use dejavu.CudaEngine().wrap)"
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
        let array = array_interface(obj, "__array_interface__", what, "numpy.ascontiguousarray")?;
        if writable && array.readonly {
            return Err(PyValueError::new_err(format!("{what} is read-only but is written to")));
        }
        let (address, len) = (array.address as usize, array.len);
        return Ok(RawBuffer { ptr: address as *mut u8, len, _owner: obj.clone().unbind() });
    }
    if obj.hasattr("data_ptr")? && obj.hasattr("is_contiguous")? {
        // A PyTorch tensor.
        let device: String = obj.getattr("device")?.getattr("type")?.extract()?;
        if device != "cpu" {
            return Err(PyTypeError::new_err(format!(
                "{what} is on device {device:?}; a host cache takes host memory (for GPU tensors use dejavu.CudaEngine().wrap)"
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
    if obj.hasattr("__dlpack__")? {
        return dlpack_buffer(obj, writable, what);
    }
    Err(PyTypeError::new_err(format!(
        "{what} must be a numpy array, a DLPack tensor, a CPU torch tensor, a bytearray or bytes, not {}",
        obj.get_type().name()?
    )))
}

/// DLPack's device type of host memory (`kDLCPU`); pinned CUDA host memory (`kDLCUDAHost`) is
/// host memory too.
const DL_CPU: i32 = 1;
const DL_CUDA_HOST: i32 = 3;

/// `DLDevice` of the DLPack ABI.
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// `DLDataType` of the DLPack ABI.
#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// `DLTensor` of the DLPack ABI (the first member of `DLManagedTensor`, which a `"dltensor"`
/// capsule points to).
#[repr(C)]
struct DlTensor {
    data: *mut std::ffi::c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// The head of `DLManagedTensorVersioned` (DLPack 1.0), up to its tensor.
#[repr(C)]
struct DlManagedVersioned {
    major: u32,
    minor: u32,
    manager_ctx: *mut std::ffi::c_void,
    deleter: Option<unsafe extern "C" fn(*mut std::ffi::c_void)>,
    flags: u64,
    dl_tensor: DlTensor,
}

/// `DLPACK_FLAG_BITMASK_READ_ONLY`.
const DL_READ_ONLY: u64 = 1;

/// The memory of an object exporting a DLPack capsule. The capsule is kept (not consumed): its
/// producer frees the tensor when the capsule is collected, after the buffer is dropped. DLPack
/// 1.0 capsules are asked for first, since they say whether the memory may be written; an older
/// producer's tensor is only read.
fn dlpack_buffer(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> PyResult<RawBuffer> {
    if obj.hasattr("__dlpack_device__")? {
        let (device, _): (i32, i32) = obj.call_method0("__dlpack_device__")?.extract()?;
        if device != DL_CPU && device != DL_CUDA_HOST {
            return Err(PyTypeError::new_err(format!(
                "{what} is on DLPack device type {device}, not host memory; this build of dejavu works on host memory"
            )));
        }
    }
    let py = obj.py();
    let kwargs = PyDict::new(py);
    kwargs.set_item("max_version", (1, 0))?;
    let capsule = match obj.call_method("__dlpack__", (), Some(&kwargs)) {
        Ok(capsule) => capsule,
        // A producer older than DLPack 1.0 does not know `max_version`.
        Err(e) if e.is_instance_of::<PyTypeError>(py) => obj.call_method0("__dlpack__")?,
        Err(e) => return Err(e),
    };
    let capsule = capsule
        .cast::<PyCapsule>()
        .map_err(|_| PyTypeError::new_err(format!("{what}.__dlpack__() did not return a capsule")))?;
    let tensor: &DlTensor = if let Ok(pointer) = capsule.pointer_checked(Some(c"dltensor_versioned")) {
        // SAFETY: a valid "dltensor_versioned" capsule points to a DLManagedTensorVersioned; the
        // capsule is alive (held below) and its producer keeps the tensor until the capsule is
        // collected. Only the fields are read, here, under the GIL.
        let managed = unsafe { pointer.cast::<DlManagedVersioned>().as_ref() };
        if managed.major != 1 {
            return Err(PyValueError::new_err(format!(
                "{what} is a DLPack {}.x tensor; 1.x is read",
                managed.major
            )));
        }
        if writable && managed.flags & DL_READ_ONLY != 0 {
            return Err(PyValueError::new_err(format!("{what} is read-only but is written to")));
        }
        &managed.dl_tensor
    } else if let Ok(pointer) = capsule.pointer_checked(Some(c"dltensor")) {
        if writable {
            return Err(PyValueError::new_err(format!(
                "{what} comes from a producer older than DLPack 1.0, which cannot say whether it may be \
                 written: pass a numpy array or another writable buffer"
            )));
        }
        // SAFETY: a valid "dltensor" capsule points to a DLManagedTensor, whose first member is
        // the DLTensor; held and read as above.
        unsafe { pointer.cast::<DlTensor>().as_ref() }
    } else {
        return Err(PyValueError::new_err(format!(
            "{what}.__dlpack__() returned a capsule that is not an unused DLPack tensor"
        )));
    };
    if tensor.device.device_type != DL_CPU && tensor.device.device_type != DL_CUDA_HOST {
        return Err(PyTypeError::new_err(format!(
            "{what} is on DLPack device type {}, not host memory",
            tensor.device.device_type
        )));
    }
    let item = (tensor.dtype.bits as usize * tensor.dtype.lanes as usize).div_ceil(8);
    let ndim = usize::try_from(tensor.ndim)
        .map_err(|_| PyValueError::new_err(format!("{what} has a negative ndim")))?;
    let shape: &[i64] = if ndim == 0 {
        &[]
    } else {
        // SAFETY: a DLTensor's shape points to `ndim` int64 values, alive with the tensor.
        unsafe { std::slice::from_raw_parts(tensor.shape, ndim) }
    };
    if tensor.dtype.bits % 8 != 0 || shape.iter().any(|&d| d < 0) {
        return Err(PyValueError::new_err(format!("{what} has an unsupported DLPack dtype or shape")));
    }
    if !tensor.strides.is_null() && ndim > 0 {
        // SAFETY: non-null strides point to `ndim` int64 values (in elements), alive with the tensor.
        let strides = unsafe { std::slice::from_raw_parts(tensor.strides, ndim) };
        let mut expected = 1i64;
        for (&dim, &stride) in shape.iter().zip(strides).rev() {
            if dim > 1 && stride != expected {
                return Err(PyValueError::new_err(format!(
                    "{what} must be C-contiguous (DLPack strides {strides:?} for shape {shape:?})"
                )));
            }
            expected = expected.saturating_mul(dim);
        }
    }
    let too_large = || PyValueError::new_err(format!("{what} is larger than this machine can address"));
    let elements = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d as usize)).ok_or_else(too_large)?;
    let len = elements.checked_mul(item).ok_or_else(too_large)?;
    if tensor.data.is_null() && len > 0 {
        return Err(PyValueError::new_err(format!("{what} has a NULL data pointer")));
    }
    let ptr = (tensor.data as *mut u8).wrapping_add(tensor.byte_offset as usize);
    Ok(RawBuffer { ptr, len, _owner: capsule.clone().into_any().unbind() })
}
