//! Host memory: page-aligned buffers and the reusable staging pool of buffered copies.

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

/// Alignment of host buffers: a page, so they suit `O_DIRECT` I/O and DMA registration.
pub const HOST_ALIGN: usize = 4096;

/// Size of a transparent huge page on x86-64 and most aarch64 kernels.
pub const HUGE_PAGE: usize = 2 << 20;

/// How a [`HostBuffer`]'s memory was obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backing {
    /// The global allocator, page-aligned.
    Heap,
    /// An anonymous mapping aligned to [`HUGE_PAGE`] and advised to use huge pages: a KV cache's
    /// scattered small reads then cost one TLB entry per 2 MiB instead of per 4 KiB.
    Mapped { kept_len: usize },
    /// Memory someone else owns (an engine's tensor); never freed here.
    Borrowed,
}

/// A zero-initialised, page-aligned host allocation. Buffers of at least [`HUGE_PAGE`] bytes are
/// huge-page aligned and advised to use transparent huge pages where the kernel offers them.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

// SAFETY: HostBuffer owns its allocation exclusively, like Vec<u8>.
unsafe impl Send for HostBuffer {}
// SAFETY: shared references only give out &[u8], like Vec<u8>.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocates `len` zeroed bytes. Aborts on allocation failure, like `Vec`.
    pub fn zeroed(len: usize) -> Self {
        Self::try_zeroed(len).unwrap_or_else(|| alloc::handle_alloc_error(Self::layout(len.max(1))))
    }

    /// Allocates `len` zeroed bytes, or `None` if the memory cannot be had.
    pub fn try_zeroed(len: usize) -> Option<Self> {
        if len == 0 {
            return Some(Self { ptr: NonNull::dangling(), len: 0, backing: Backing::Heap });
        }
        if len >= HUGE_PAGE {
            if let Some(buffer) = Self::mapped(len) {
                return Some(buffer);
            }
        }
        let layout = Layout::from_size_align(len, HOST_ALIGN).ok()?;
        // SAFETY: layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        Some(Self { ptr: NonNull::new(raw)?, len, backing: Backing::Heap })
    }

    /// A huge-page aligned anonymous mapping (zero-filled by the kernel), or `None` if mmap fails.
    fn mapped(len: usize) -> Option<Self> {
        let body = len.checked_next_multiple_of(HOST_ALIGN)?;
        let mapped_len = body.checked_add(HUGE_PAGE)?;
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return None;
        }
        let base = raw as usize;
        let aligned = (base + HUGE_PAGE - 1) & !(HUGE_PAGE - 1);
        let head = aligned - base;
        let tail = mapped_len - head - body;
        // SAFETY: both trimmed ranges lie inside the mapping just made and outside the kept range
        // [aligned, aligned + body); madvise only gives advice about the kept range.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((aligned + body) as *mut libc::c_void, tail);
            }
            // Advice only: without THP the buffer still works with normal pages.
            libc::madvise(aligned as *mut libc::c_void, body, libc::MADV_HUGEPAGE);
        }
        Some(Self {
            ptr: NonNull::new(aligned as *mut u8)?,
            len,
            backing: Backing::Mapped { kept_len: body },
        })
    }

    /// A buffer over `len` bytes at `ptr` that the caller owns (an engine's tensor): it is read
    /// and written in place and never freed.
    ///
    /// # Safety
    ///
    /// 1. `ptr` is valid for reads and writes of `len` bytes, which are initialised, for as long as
    ///    the returned buffer (and anything made from it, such as a [`crate::KvCache`]) lives.
    /// 2. No one else accesses those bytes while a copy through this buffer runs, except as the
    ///    owner of this buffer synchronises (a cache's layer locks order its own copies; an engine
    ///    writing the same bytes concurrently must order itself against them).
    pub unsafe fn borrowed(ptr: *mut u8, len: usize) -> Option<Self> {
        Some(Self { ptr: NonNull::new(ptr)?, len, backing: Backing::Borrowed })
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len, HOST_ALIGN).expect("buffer length overflows isize")
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Raw pointer to the first byte.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Raw mutable pointer to the first byte. Writing through it while a slice from `Deref` is
    /// alive, or from two threads at once, is undefined behaviour: callers synchronise (as
    /// [`crate::KvCache`] does with its layer locks).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        match self.backing {
            _ if self.len == 0 => {}
            Backing::Borrowed => {}
            Backing::Heap => {
                // SAFETY: allocated in `zeroed` with this exact layout.
                unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) };
            }
            Backing::Mapped { kept_len } => {
                // SAFETY: the range is exactly what `mapped` kept mapped, and nothing borrows it.
                unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, kept_len) };
            }
        }
    }
}

impl Deref for HostBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised bytes, owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for HostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for len initialised bytes, and &mut self is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer").field("len", &self.len).finish()
    }
}

/// Counters of a [`StagingPool`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Buffers allocated since the pool was made.
    pub allocations: u64,
    /// Leases served from a pooled buffer.
    pub reuses: u64,
    /// Buffers now idle in the pool.
    pub idle: usize,
}

struct PoolInner {
    idle: Mutex<Vec<HostBuffer>>,
    max_idle: usize,
    allocations: AtomicU64,
    reuses: AtomicU64,
}

/// A pool of reusable staging buffers: each buffered copy leases one, and the lease returns it.
///
/// Cloning shares the pool.
#[derive(Clone)]
pub struct StagingPool {
    inner: Arc<PoolInner>,
}

impl Default for StagingPool {
    fn default() -> Self {
        Self::new(8)
    }
}

impl StagingPool {
    /// A pool keeping at most `max_idle` buffers between leases.
    pub fn new(max_idle: usize) -> Self {
        Self {
            inner: Arc::new(PoolInner {
                idle: Mutex::new(Vec::new()),
                max_idle,
                allocations: AtomicU64::new(0),
                reuses: AtomicU64::new(0),
            }),
        }
    }

    /// Leases a buffer of at least `len` bytes; the lease shows exactly `len`.
    pub fn lease(&self, len: usize) -> Staging {
        let reused = {
            let mut idle = self.inner.idle.lock();
            // The smallest idle buffer that fits: keeps big buffers for big requests.
            let best = idle
                .iter()
                .enumerate()
                .filter(|(_, b)| b.len() >= len)
                .min_by_key(|(_, b)| b.len())
                .map(|(i, _)| i);
            best.map(|i| idle.swap_remove(i))
        };
        let buffer = match reused {
            Some(b) => {
                self.inner.reuses.fetch_add(1, Ordering::Relaxed);
                b
            }
            None => {
                self.inner.allocations.fetch_add(1, Ordering::Relaxed);
                HostBuffer::zeroed(len)
            }
        };
        Staging { buffer: Some(buffer), len, pool: self.clone() }
    }

    /// Current counters.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            allocations: self.inner.allocations.load(Ordering::Relaxed),
            reuses: self.inner.reuses.load(Ordering::Relaxed),
            idle: self.inner.idle.lock().len(),
        }
    }

    fn give_back(&self, buffer: HostBuffer) {
        let mut idle = self.inner.idle.lock();
        if idle.len() < self.inner.max_idle {
            idle.push(buffer);
        } else if let Some(smallest) = idle.iter_mut().min_by_key(|b| b.len()) {
            if smallest.len() < buffer.len() {
                *smallest = buffer;
            }
        }
    }
}

/// A staging buffer leased from a [`StagingPool`]; returned to the pool on drop.
pub struct Staging {
    buffer: Option<HostBuffer>,
    len: usize,
    pool: StagingPool,
}

impl Deref for Staging {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buffer.as_ref().expect("present until drop")[..self.len]
    }
}

impl DerefMut for Staging {
    fn deref_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.buffer.as_mut().expect("present until drop")[..len]
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            self.pool.give_back(buffer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_buffers_are_aligned_and_zeroed() {
        let b = HostBuffer::zeroed(10_000);
        assert_eq!(b.as_ptr() as usize % HOST_ALIGN, 0);
        assert!(b.iter().all(|&x| x == 0));
        assert!(HostBuffer::zeroed(0).is_empty());
        let mut big = HostBuffer::zeroed(HUGE_PAGE + 5);
        assert_eq!(big.as_ptr() as usize % HUGE_PAGE, 0);
        assert!(big.iter().all(|&x| x == 0));
        big[HUGE_PAGE + 4] = 9;
        assert_eq!(big.len(), HUGE_PAGE + 5);
    }

    #[test]
    fn pool_reuses_buffers() {
        let pool = StagingPool::new(2);
        {
            let mut a = pool.lease(1000);
            a[999] = 7;
            assert_eq!(a.len(), 1000);
        }
        let b = pool.lease(500);
        assert_eq!(b.len(), 500);
        let stats = pool.stats();
        assert_eq!((stats.allocations, stats.reuses, stats.idle), (1, 1, 0));
        drop(b);
        let _big = pool.lease(2000);
        assert_eq!(pool.stats().allocations, 2);
    }
}
