//! Memory an engine keeps between copies, because allocating it is slow: device staging for the
//! pipelined host copies ([`StagingPool`]) and pinned host buffers handed to callers that gave no
//! buffer of their own ([`PinnedPool`]). A pinned allocation of a few megabytes costs a
//! millisecond or more, and freeing one synchronises the whole device.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, PinnedHostSlice};
use parking_lot::Mutex;

use super::memory::{DeviceBuffer, PinnedBuffer};
use super::CudaError;

/// Staging pieces in the ring of a pipelined host copy: one being filled by a kernel, one being
/// copied, one spare; the engine's pool keeps as many.
pub(super) const RING: usize = 3;

/// Device staging buffers kept for the next copy: at most `keep` of them, the largest.
pub(super) struct StagingPool {
    free: Mutex<Vec<DeviceBuffer>>,
    keep: usize,
}

impl StagingPool {
    pub(super) fn new(keep: usize) -> Self {
        Self { free: Mutex::new(Vec::new()), keep }
    }

    /// A kept buffer of at least `bytes` (the smallest such), if there is one.
    pub(super) fn take(&self, bytes: usize) -> Option<DeviceBuffer> {
        let mut free = self.free.lock();
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.len() >= bytes)
            .min_by_key(|(_, b)| b.len())
            .map(|(i, _)| i)?;
        Some(free.swap_remove(best))
    }

    /// Keeps `buffer` for a later copy, once the copies that used it are done (the caller's
    /// duty); the smallest kept buffer goes when there are too many.
    pub(super) fn give_back(&self, buffer: DeviceBuffer) {
        let evicted = {
            let mut free = self.free.lock();
            free.push(buffer);
            (free.len() > self.keep).then(|| {
                let smallest = (0..free.len()).min_by_key(|&i| free[i].len()).expect("not empty");
                free.swap_remove(smallest)
            })
        };
        // Freed outside the lock: dropping device memory synchronises the copy stream.
        drop(evicted);
    }
}

/// Events (without timing) kept between copies: the pipelined copies take two per piece, and
/// making one is a driver call the first piece's copy would wait behind.
pub(super) struct EventPool {
    ctx: Arc<CudaContext>,
    free: Mutex<Vec<CudaEvent>>,
}

impl EventPool {
    pub(super) fn new(ctx: Arc<CudaContext>) -> Self {
        Self { ctx, free: Mutex::new(Vec::new()) }
    }

    /// A kept event, or a new one.
    pub(super) fn take(&self) -> Result<CudaEvent, CudaError> {
        match self.free.lock().pop() {
            Some(event) => Ok(event),
            None => Ok(self.ctx.new_event(None)?),
        }
    }

    /// Keeps `events` for later copies. (A stream's wait on an event is fixed when it is queued,
    /// so an event may be recorded again while a queued wait on it is pending; the copies give
    /// theirs back once done all the same.)
    pub(super) fn give_back(&self, events: Vec<CudaEvent>) {
        self.free.lock().extend(events);
    }
}

/// Pinned host buffers, handed out as [`PooledPinned`] and kept when those are dropped, up to a
/// byte budget: the next gather of the same size reuses one instead of allocating.
pub struct PinnedPool {
    ctx: Arc<CudaContext>,
    free: Mutex<Vec<PinnedBuffer>>,
    keep_bytes: usize,
}

impl std::fmt::Debug for PinnedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedPool").field("keep_bytes", &self.keep_bytes).finish_non_exhaustive()
    }
}

/// Pinned memory a pool keeps besides its largest buffer: the largest one handed back is always
/// kept, so that a caller alternating one large gather with small ones does not allocate the
/// large one again, and up to this much more in smaller ones.
pub const PINNED_POOL_BYTES: usize = 1 << 30;

impl PinnedPool {
    pub(super) fn new(ctx: Arc<CudaContext>, keep_bytes: usize) -> Self {
        Self { ctx, free: Mutex::new(Vec::new()), keep_bytes }
    }

    /// `bytes` of pinned host memory (flags 0: cached for CPU reads): a kept buffer of between
    /// `bytes` and twice that, or a new one.
    pub fn lease(self: &Arc<Self>, bytes: usize) -> Result<PooledPinned, CudaError> {
        let kept = {
            let mut free = self.free.lock();
            let fit = free
                .iter()
                .enumerate()
                .filter(|(_, b)| b.len() >= bytes && b.len() <= bytes.saturating_mul(2).max(1))
                .min_by_key(|(_, b)| b.len())
                .map(|(i, _)| i);
            fit.map(|i| free.swap_remove(i))
        };
        let buffer = match kept {
            Some(buffer) => buffer,
            None => {
                // SAFETY: the memory is not initialised; it is only handed out as bytes, which any
                // bit pattern is, and the copies that fill it are waited for before it is read.
                let slice: PinnedHostSlice<u8> =
                    unsafe { self.ctx.alloc_pinned_with_flags(bytes.max(1), 0) }?;
                PinnedBuffer { slice }
            }
        };
        Ok(PooledPinned { buffer: Some(buffer), len: bytes, pool: self.clone() })
    }

    /// Bytes of the buffers kept now.
    pub fn kept_bytes(&self) -> usize {
        self.free.lock().iter().map(PinnedBuffer::len).sum()
    }

    fn give_back(&self, buffer: PinnedBuffer) {
        let mut evicted = Vec::new();
        {
            let mut free = self.free.lock();
            free.push(buffer);
            // Over budget (the largest buffer aside): drop the smallest first.
            let over = |free: &[PinnedBuffer]| {
                let all: usize = free.iter().map(PinnedBuffer::len).sum();
                all - free.iter().map(PinnedBuffer::len).max().unwrap_or(0) > self.keep_bytes
            };
            while free.len() > 1 && over(&free) {
                let smallest = (0..free.len()).min_by_key(|&i| free[i].len()).expect("not empty");
                evicted.push(free.swap_remove(smallest));
            }
        }
        // Freed outside the lock: freeing pinned memory synchronises the device.
        drop(evicted);
    }
}

/// Pinned host memory leased from a [`PinnedPool`], `len` bytes of it visible; it goes back to
/// the pool when dropped.
pub struct PooledPinned {
    buffer: Option<PinnedBuffer>,
    len: usize,
    pool: Arc<PinnedPool>,
}

impl std::fmt::Debug for PooledPinned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PooledPinned").field("len", &self.len).finish_non_exhaustive()
    }
}

impl PooledPinned {
    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes. The library's copies into them ([`super::CudaEngine::gather_into_host`]) are
    /// done when they return.
    pub fn as_slice(&self) -> Result<&[u8], CudaError> {
        Ok(&self.buffer().as_slice()?[..self.len])
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], CudaError> {
        let len = self.len;
        let buffer = self.buffer.as_mut().expect("present until dropped");
        Ok(&mut buffer.as_mut_slice()?[..len])
    }

    fn buffer(&self) -> &PinnedBuffer {
        self.buffer.as_ref().expect("present until dropped")
    }
}

impl Drop for PooledPinned {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            self.pool.give_back(buffer);
        }
    }
}
