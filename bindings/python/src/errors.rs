//! The exceptions the package raises, and how library errors map to them.

use dejavulib::reshard::StreamError;
use dejavulib::store::StoreError as ChunkStoreError;
use dejavulib::streamer::StreamerError;
use dejavulib::CacheError;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;

create_exception!(dejavu, Error, PyException, "Base class of the errors dejavu raises.");
create_exception!(dejavu, LayoutError, Error, "A layout, region or cache buffer does not fit.");
create_exception!(dejavu, StoreError, Error, "Flush or fetch failed (I/O, disk full).");
create_exception!(dejavu, CorruptChunkError, StoreError, "A chunk failed verification.");
create_exception!(dejavu, NotFoundError, StoreError, "No chunk under the key asked for.");
create_exception!(dejavu, CudaError, Error, "No CUDA driver, NVRTC or device, or a CUDA call failed.");
create_exception!(
    dejavu,
    ControllerError,
    Error,
    "The controller cannot be reached, refused the cluster secret, or refused the request."
);

/// A CUDA engine's error as Python sees it: wrong sizes and memory a `ValueError`, layout errors
/// as `cache_err` says, the rest `dejavu.CudaError`.
pub(crate) fn cuda_err(e: dejavulib::cuda::CudaError) -> PyErr {
    use dejavulib::cuda::CudaError as Lib;
    match e {
        Lib::Size { .. } | Lib::NotDeviceMemory { .. } => PyValueError::new_err(e.to_string()),
        Lib::Cache(e) => cache_err(e),
        other => CudaError::new_err(other.to_string()),
    }
}

pub(crate) fn cache_err(e: CacheError) -> PyErr {
    match e {
        CacheError::WrongLength { .. } => PyValueError::new_err(e.to_string()),
        other => LayoutError::new_err(other.to_string()),
    }
}

pub(crate) fn store_err(e: ChunkStoreError) -> PyErr {
    match e {
        ChunkStoreError::NotFound(_) => NotFoundError::new_err(e.to_string()),
        ChunkStoreError::Chunk { .. } => CorruptChunkError::new_err(e.to_string()),
        ChunkStoreError::PayloadLength { .. } => PyValueError::new_err(e.to_string()),
        ChunkStoreError::Io { .. } | ChunkStoreError::Unsupported(_) => StoreError::new_err(e.to_string()),
        ChunkStoreError::Gather(e) => cache_err(*e),
    }
}

pub(crate) fn stream_err(e: StreamError) -> PyErr {
    match e {
        StreamError::Cache(e) => cache_err(e),
        StreamError::Store(e) => store_err(e),
        StreamError::Unexpected(m) => CorruptChunkError::new_err(m),
        other => LayoutError::new_err(other.to_string()),
    }
}

pub(crate) fn value_err(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

pub(crate) fn streamer_err(e: StreamerError) -> PyErr {
    match e {
        StreamerError::Stream(e) => stream_err(e),
        StreamerError::Timeout => pyo3::exceptions::PyTimeoutError::new_err("the job has not finished"),
        other => Error::new_err(other.to_string()),
    }
}
