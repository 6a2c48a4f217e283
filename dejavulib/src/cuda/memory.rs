//! Memory the CUDA engine copies between: device buffers it allocates, KV caches in device memory
//! (its own or an engine's tensors), and pinned host memory.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};

use super::CudaError;
use crate::layout::KvLayout;
use crate::region::KvRegion;

/// Device memory the library allocated; the copy stream is synchronised before it is freed (the
/// kernels write through raw addresses, which cudarc does not track).
pub struct DeviceBuffer {
    pub(super) slice: CudaSlice<u8>,
    /// The copy stream of the engine that allocated it.
    pub(super) stream: Arc<CudaStream>,
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
    }
}

impl DeviceBuffer {
    /// Bytes.
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    /// Whether it holds no byte.
    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }

    pub(super) fn address(&self) -> u64 {
        let (ptr, _sync) = self.slice.device_ptr(&self.stream);
        ptr
    }
}

/// A KV cache in device memory, laid out as a [`KvLayout`]: one allocation per buffer, owned by
/// the library or by the engine that hands its own tensors over.
pub struct DeviceKv {
    pub(super) layout: KvLayout,
    pub(super) buffers: Vec<DeviceMem>,
    /// What keeps borrowed memory allocated (an engine's tensors), held as long as the cache:
    /// every queued copy holds the cache, so the memory outlives the copies.
    pub(super) keep_alive: Option<Box<dyn std::any::Any + Send + Sync>>,
}

pub(super) enum DeviceMem {
    Owned(DeviceBuffer),
    /// An engine's own memory: its address and length.
    Borrowed(u64),
}

impl DeviceKv {
    /// The layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// A cache over device memory the engine owns (as PyTorch hands a tensor out): buffer `i` of
    /// `layout` at device address `addresses[i]`.
    ///
    /// # Safety
    /// 1. Each address must be a device allocation of the engine's device, at least as long as
    ///    the layout's buffer `i`, and stay allocated while this cache is used.
    /// 2. Nothing may write it while a copy the library enqueued runs, but what the engine orders
    ///    with [`CudaEngine::after`](super::CudaEngine::after).
    pub unsafe fn borrowed(layout: KvLayout, addresses: &[u64]) -> Result<Self, CudaError> {
        let needed = layout.buffer_sizes().len() as u64;
        if addresses.len() as u64 != needed {
            return Err(CudaError::Size { what: "buffer addresses", needed, got: addresses.len() as u64 });
        }
        let buffers = addresses.iter().map(|&a| DeviceMem::Borrowed(a)).collect();
        Ok(Self { layout, buffers, keep_alive: None })
    }

    /// Keeps `owner` (what owns borrowed memory: an engine's tensors) as long as the cache, and
    /// so as long as any copy queued on it.
    pub fn keeping(mut self, owner: Box<dyn std::any::Any + Send + Sync>) -> Self {
        self.keep_alive = Some(owner);
        self
    }

    /// Bytes `region` takes packed (what a gather of it fills).
    pub fn packed_len(&self, region: &KvRegion) -> u64 {
        region.shape().bytes(self.layout.spec())
    }
}

/// Page-locked host memory, allocated with flags 0: cached for CPU reads (cudarc's default is
/// write-combined, very slow to read from the CPU).
pub struct PinnedBuffer {
    pub(super) slice: PinnedHostSlice<u8>,
}

impl PinnedBuffer {
    /// The bytes, once the copies that write them are done (it waits for them, sleeping).
    pub fn as_slice(&self) -> Result<&[u8], CudaError> {
        Ok(self.slice.as_slice()?)
    }

    /// The bytes, to fill before a copy to the device, once the copies that read them are done.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], CudaError> {
        Ok(self.slice.as_mut_slice()?)
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    /// Whether it holds no byte.
    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }
}
