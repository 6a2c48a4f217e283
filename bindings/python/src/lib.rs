//! `dejavu._dejavu`: the native half of the Python package `dejavu` (see `dejavu/__init__.py` and
//! `dejavu/_dejavu.pyi` for the documented API).
//!
//! Buffers pass without copies (see the `buffer` module); copies and file I/O run with the GIL released.
//! Library errors become `dejavu.Error` subclasses, argument errors `ValueError` / `TypeError`.

mod buffer;
mod cache;
mod errors;
mod feed;
mod gpu;
mod layout;
mod pinned;
mod reshard;
mod store;
mod streamer;

use pyo3::prelude::*;

use crate::cache::PyCache;
use crate::errors::{
    ControllerError, CorruptChunkError, CudaError, Error, LayoutError, NotFoundError, StoreError,
};
use crate::feed::PyRecoveryFeed;
use crate::gpu::{PyCudaEngine, PyDeviceCache};
use crate::layout::{PyLayout, PyRegion, PySpec};
use crate::pinned::PyPinnedBuffer;
use crate::reshard::{py_stream_in, py_stream_out, PySetup};
use crate::store::{fetch, fetch_chunks, flush, PyPeerServer, PyStore};
use crate::streamer::{PyCompletion, PyStreamer};

#[pymodule]
fn _dejavu(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("LayoutError", py.get_type::<LayoutError>())?;
    m.add("StoreError", py.get_type::<StoreError>())?;
    m.add("CorruptChunkError", py.get_type::<CorruptChunkError>())?;
    m.add("NotFoundError", py.get_type::<NotFoundError>())?;
    m.add("CudaError", py.get_type::<CudaError>())?;
    m.add("ControllerError", py.get_type::<ControllerError>())?;
    m.add_class::<PySpec>()?;
    m.add_class::<PyLayout>()?;
    m.add_class::<PyRegion>()?;
    m.add_class::<PyCache>()?;
    m.add_class::<PyStore>()?;
    m.add_class::<PySetup>()?;
    m.add_class::<PyStreamer>()?;
    m.add_class::<PyPeerServer>()?;
    m.add_class::<PyCompletion>()?;
    m.add_class::<PyCudaEngine>()?;
    m.add_class::<PyDeviceCache>()?;
    m.add_class::<PyPinnedBuffer>()?;
    m.add_class::<PyRecoveryFeed>()?;
    m.add_function(wrap_pyfunction!(flush, m)?)?;
    m.add_function(wrap_pyfunction!(fetch, m)?)?;
    m.add_function(wrap_pyfunction!(fetch_chunks, m)?)?;
    m.add_function(wrap_pyfunction!(py_stream_out, m)?)?;
    m.add_function(wrap_pyfunction!(py_stream_in, m)?)?;
    Ok(())
}
