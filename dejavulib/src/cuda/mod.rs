//! The CUDA copy engine: KV caches in device memory, gathered into and scattered out of a device
//! staging buffer by NVRTC-compiled kernels that execute the same copy plans as the CPU engine
//! ([`crate::plan`]), pinned host memory for the copies to and from the host, and a copy stream
//! that waits for the engine's compute stream through events, never blocking it.
//!
//! The driver and NVRTC are loaded at run time (`cudarc` with dynamic loading): the crate builds
//! and runs on machines with no CUDA at all, where [`CudaEngine::open`] returns
//! [`CudaError::NoDriver`]. The kernels (`kernels/copy_blocks.cu`) are compiled for the device's
//! architecture when an engine opens (NVRTC 11.7 or later: the tables travel as
//! `__grid_constant__` kernel parameters); [`table::copy_reference`] is their CPU twin, which
//! defines what they do and is tested everywhere.

mod engine;
mod event;
mod host;
mod kernels;
mod memory;
mod pool;
pub mod table;
mod upload;

pub use engine::{CudaEngine, PreparedCopy};
pub use event::{CopiesDone, ReadyMarker};
pub use host::{HostMemory, HostPath};
pub use memory::{DeviceBuffer, DeviceKv, PinnedBuffer};
pub use pool::{PinnedPool, PooledPinned, PINNED_POOL_BYTES};

/// A raw CUDA stream handle, as engines hand theirs over (PyTorch's `cuda_stream`); null is the
/// legacy default stream.
pub type RawStream = cudarc::driver::sys::CUstream;

use thiserror::Error;

/// Errors of the CUDA engine.
#[derive(Debug, Error)]
pub enum CudaError {
    /// No CUDA driver library (`libcuda`) on this machine.
    #[error("no CUDA driver: libcuda could not be loaded")]
    NoDriver,
    /// No NVRTC library, to compile the kernels.
    #[error("no NVRTC: the CUDA toolkit's libnvrtc could not be loaded (put its lib64 on LD_LIBRARY_PATH)")]
    NoNvrtc,
    /// The driver sees no device of that ordinal.
    #[error("no CUDA device {ordinal}: the driver sees {count}")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver sees.
        count: usize,
    },
    /// A driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// The kernels did not compile.
    #[error("compiling the copy kernels: {0}")]
    Compile(String),
    /// A plan that cannot run on these buffers.
    #[error(transparent)]
    Table(#[from] table::TableError),
    /// Buffers of the wrong size for the copy asked.
    #[error("{what}: {got} bytes where {needed} are needed")]
    Size {
        /// Which buffer.
        what: &'static str,
        /// Bytes needed.
        needed: u64,
        /// Bytes it has.
        got: u64,
    },
    /// Planning the copy failed.
    #[error(transparent)]
    Cache(#[from] crate::cache::CacheError),
    /// Device memory another engine allocated (it would be freed without waiting for this
    /// engine's copies).
    #[error("device memory of another CUDA engine")]
    OtherEngine,
    /// A prepared copy launched with other buffers than those it was prepared for.
    #[error("a prepared copy launched with other buffers than it was prepared for")]
    NotPreparedFor,
    /// Memory handed over as device memory is not device memory of this engine's device.
    #[error("{what}: {why}")]
    NotDeviceMemory {
        /// Which buffer.
        what: String,
        /// What it is instead.
        why: String,
    },
}

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(e.to_string())
    }
}

/// Whether the CUDA driver library can be loaded here (without it, cudarc's calls panic).
pub fn driver_present() -> bool {
    // SAFETY: this only tries to load libcuda (running its initialisers, as any use of CUDA
    // does) and reports whether it could; no CUDA call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether NVRTC can be loaded here.
pub fn nvrtc_present() -> bool {
    // SAFETY: as for `driver_present`, with libnvrtc.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}
