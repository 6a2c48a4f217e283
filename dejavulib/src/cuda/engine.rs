//! The engine: a device, its compiled kernels and its copy stream.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaStream};

use super::event::{CopiesDone, ReadyMarker};
use super::kernels::Kernels;
use super::memory::{DeviceBuffer, DeviceKv, DeviceMem, PinnedBuffer};
use super::pool::{EventPool, PinnedPool, StagingPool, PINNED_POOL_BYTES, RING};
use super::table::{encode, Table, TokenSteps};
use super::{driver_present, nvrtc_present, CudaError};
use crate::cache::{gather_copy_plan, scatter_copy_plan};
use crate::layout::{KvLayout, LayoutKind, Packing};
use crate::region::KvRegion;

/// A device with the copy kernels loaded and a stream of its own for copies.
pub struct CudaEngine {
    ctx: Arc<CudaContext>,
    /// Where kernels and the copies ordered after an engine's compute stream run.
    copy: Arc<CudaStream>,
    /// The second stream of the pipelined host copies: copies over the bus, overlapping the
    /// kernels on `copy`.
    transfer: Arc<CudaStream>,
    kernels: Kernels,
    staging: StagingPool,
    events: EventPool,
    pinned: Arc<PinnedPool>,
    /// Copies seen before, at every token offset: the next decode step's table without planning.
    steps: parking_lot::Mutex<Vec<(StepsKey, TokenSteps)>>,
}

/// Most copies whose token steps an engine keeps (a stage's layers, each way, and a few more).
const KEPT_STEPS: usize = 256;

/// Which way a copy between a cache and a staging buffer goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Direction {
    /// Cache to staging.
    Gather,
    /// Staging to cache.
    Scatter,
}

/// What a copy's token steps hold for: the same cache (layout and addresses), the same region but
/// for where its tokens start, the same packing and direction.
#[derive(Clone, Debug)]
struct StepsKey {
    /// The region with its tokens starting at 0.
    region: KvRegion,
    direction: Direction,
    packing: Packing,
    bases: Vec<u64>,
    layout: KvLayout,
}

impl std::fmt::Debug for CudaEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaEngine").field("ordinal", &self.ctx.ordinal()).finish_non_exhaustive()
    }
}

/// A gather or scatter planned and encoded once ([`CudaEngine::prepare_gather`],
/// [`CudaEngine::prepare_scatter`]), with the addresses of its cache and staging buffer: it is
/// launched with them ([`CudaEngine::launch`] checks that they are the same).
#[derive(Debug)]
pub struct PreparedCopy {
    table: Table,
    bytes: u64,
    /// The cache's buffer addresses and sizes, and the staging buffer's address, it was made for.
    bases: Vec<u64>,
    sizes: Vec<u64>,
    staging: u64,
}

impl PreparedCopy {
    /// Bytes it moves.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl CudaEngine {
    /// Opens device `ordinal`: checks that the driver and NVRTC can be loaded (a typed error, not
    /// a panic, where they cannot), compiles and loads the kernels for its architecture, and makes
    /// its two streams (the copy stream, which kernels and the copies ordered after an engine's
    /// compute stream take, and the transfer stream of the pipelined host copies).
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        let count = CudaContext::device_count()? as usize;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        if !nvrtc_present() {
            return Err(CudaError::NoNvrtc);
        }
        let ctx = CudaContext::new(ordinal)?;
        let copy = ctx.new_stream()?;
        let kernels = Kernels::load(&ctx, &copy)?;
        kernels.warm(&copy)?;
        let transfer = ctx.new_stream()?;
        let pinned = Arc::new(PinnedPool::new(ctx.clone(), PINNED_POOL_BYTES));
        let events = EventPool::new(ctx.clone());
        Ok(Self {
            ctx,
            copy,
            transfer,
            kernels,
            staging: StagingPool::new(RING),
            events,
            pinned,
            steps: parking_lot::Mutex::new(Vec::new()),
        })
    }

    /// The pool of pinned host buffers this engine hands out where a caller gives none
    /// ([`PinnedPool::lease`]): a buffer dropped goes back to it.
    pub fn pinned_pool(&self) -> &Arc<PinnedPool> {
        &self.pinned
    }

    pub(super) fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy
    }

    pub(super) fn transfer_stream(&self) -> &Arc<CudaStream> {
        &self.transfer
    }

    pub(super) fn staging_pool(&self) -> &StagingPool {
        &self.staging
    }

    pub(super) fn event_pool(&self) -> &EventPool {
        &self.events
    }

    /// `bytes` of device memory, zeroed.
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer, CudaError> {
        Ok(DeviceBuffer { slice: self.copy.alloc_zeros::<u8>(bytes)?, stream: self.copy.clone() })
    }

    /// A KV cache of `layout` in device memory the library allocates, zeroed.
    pub fn alloc_kv(&self, layout: KvLayout) -> Result<DeviceKv, CudaError> {
        let buffers = layout
            .buffer_sizes()
            .iter()
            .map(|&bytes| self.alloc(bytes as usize).map(DeviceMem::Owned))
            .collect::<Result<_, _>>()?;
        Ok(DeviceKv { layout, buffers, keep_alive: None })
    }

    /// `bytes` of pinned host memory (flags 0, not write-combined).
    pub fn pinned(&self, bytes: usize) -> Result<PinnedBuffer, CudaError> {
        // SAFETY: the memory is not initialised; it is only handed out as bytes, which any bit
        // pattern is, and the copies that fill it are ordered on the copy stream.
        let slice = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }?;
        Ok(PinnedBuffer { slice })
    }

    /// Copies `host` into `device` on the copy stream (it must be as long).
    pub fn upload(&self, host: &[u8], device: &mut DeviceBuffer) -> Result<(), CudaError> {
        self.mine(device)?;
        same_len("device buffer", host.len(), device.len())?;
        Ok(self.copy.memcpy_htod(host, &mut device.slice)?)
    }

    /// Copies `device` into `host` on the copy stream and waits for it.
    pub fn download(&self, device: &DeviceBuffer, host: &mut [u8]) -> Result<(), CudaError> {
        self.mine(device)?;
        same_len("host buffer", device.len(), host.len())?;
        self.copy.memcpy_dtoh(&device.slice, host)?;
        Ok(self.copy.synchronize()?)
    }

    /// Copies `device` into pinned `host` on the copy stream without waiting (the DMA engine
    /// reads pinned memory directly); [`CudaEngine::synchronize`] before reading it.
    pub fn download_pinned(&self, device: &DeviceBuffer, host: &mut PinnedBuffer) -> Result<(), CudaError> {
        self.mine(device)?;
        same_len("pinned buffer", device.len(), host.slice.len())?;
        Ok(self.copy.memcpy_dtoh(&device.slice, &mut host.slice)?)
    }

    /// Copies `src` into `dst` (as long) on the device, on the copy stream: the limit a gather
    /// kernel is measured against.
    pub fn copy_device(&self, src: &DeviceBuffer, dst: &mut DeviceBuffer) -> Result<(), CudaError> {
        self.mine(src)?;
        self.mine(dst)?;
        same_len("device buffer", src.len(), dst.len())?;
        Ok(self.copy.memcpy_dtod(&src.slice, &mut dst.slice)?)
    }

    /// Copies pinned `host` into `device` on the copy stream without waiting (swap-in).
    pub fn upload_pinned(&self, host: &PinnedBuffer, device: &mut DeviceBuffer) -> Result<(), CudaError> {
        self.mine(device)?;
        same_len("device buffer", host.slice.len(), device.len())?;
        Ok(self.copy.memcpy_htod(&host.slice, &mut device.slice)?)
    }

    /// Plans and encodes the gather of `region` of `kv` (packed as `packing`) into the start of
    /// `staging` once, to launch with [`CudaEngine::launch`] as often as needed: the same region
    /// moved again and again (a microbatch swapped out every iteration) then costs one kernel
    /// launch each time, no planning on the host.
    pub fn prepare_gather(
        &self,
        kv: &DeviceKv,
        region: &KvRegion,
        packing: Packing,
        staging: &DeviceBuffer,
    ) -> Result<PreparedCopy, CudaError> {
        self.prepare(kv, region, packing, Direction::Gather, staging)
    }

    /// Plans and encodes the scatter of the start of `staging` (packed as `packing`) into
    /// `region` of `kv` once, to launch with [`CudaEngine::launch`] (a microbatch swapped in).
    pub fn prepare_scatter(
        &self,
        staging: &DeviceBuffer,
        kv: &DeviceKv,
        region: &KvRegion,
        packing: Packing,
    ) -> Result<PreparedCopy, CudaError> {
        self.prepare(kv, region, packing, Direction::Scatter, staging)
    }

    fn prepare(
        &self,
        kv: &DeviceKv,
        region: &KvRegion,
        packing: Packing,
        direction: Direction,
        staging: &DeviceBuffer,
    ) -> Result<PreparedCopy, CudaError> {
        kv.layout.check_region(region).map_err(crate::cache::CacheError::from)?;
        let bytes = kv.packed_len(region);
        at_least("staging buffer", bytes, staging.len())?;
        let (bases, staging) = (self.bases_of(kv)?, self.address_of(staging)?);
        let table = encode_copy(kv, &bases, region, packing, direction, staging)?;
        Ok(PreparedCopy { table, bytes, bases, sizes: kv.layout.buffer_sizes().to_vec(), staging })
    }

    /// Launches a prepared copy between `kv` and `staging` on the copy stream: one kernel,
    /// nothing planned. They must be the buffers it was prepared for (else
    /// [`CudaError::NotPreparedFor`]): its addresses are theirs.
    pub fn launch(
        &self,
        copy: &PreparedCopy,
        kv: &DeviceKv,
        staging: &DeviceBuffer,
    ) -> Result<(), CudaError> {
        // The same addresses can come back from the allocator for other buffers: the sizes must
        // be the ones the table's addresses were checked against too.
        if self.bases_of(kv)? != copy.bases
            || kv.layout.buffer_sizes() != copy.sizes.as_slice()
            || self.address_of(staging)? != copy.staging
            || (staging.len() as u64) < copy.bytes
        {
            return Err(CudaError::NotPreparedFor);
        }
        self.run(&copy.table)
    }

    /// The device's context: an engine makes its compute stream in it (or uses one of the same
    /// device's primary context, as PyTorch does), so that the two streams can wait on each other.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Checks that `len` bytes at `address` are device memory of this engine's device, inside one
    /// allocation: what an engine's tensor handed over as a cache buffer must be. Host memory,
    /// another device's memory, or a range running past its allocation is
    /// [`CudaError::NotDeviceMemory`].
    pub fn check_device_memory(&self, what: &str, address: u64, len: u64) -> Result<(), CudaError> {
        let refuse = |why: String| Err(CudaError::NotDeviceMemory { what: what.to_string(), why });
        self.ctx.bind_to_thread()?;
        let attribute = |attribute: sys::CUpointer_attribute, out: *mut std::ffi::c_void| {
            // SAFETY: `out` points to a value of the attribute's type (an unsigned int for the
            // memory type and ordinal, a device pointer or size_t, both 64 bits, for the range);
            // the driver only reads `address` as a number and answers for any value.
            unsafe { sys::cuPointerGetAttribute(out, attribute, address) }.result()
        };
        let mut memory_type = 0u32;
        if attribute(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            (&mut memory_type as *mut u32).cast(),
        )
        .is_err()
        {
            return refuse(format!("{address:#x} is not memory CUDA knows (pageable host memory?)"));
        }
        if memory_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return refuse(format!("{address:#x} is host memory, not device memory"));
        }
        let mut ordinal = 0u32;
        attribute(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            (&mut ordinal as *mut u32).cast(),
        )?;
        if ordinal as usize != self.ctx.ordinal() {
            return refuse(format!("memory of device {ordinal}, not of device {}", self.ctx.ordinal()));
        }
        let (mut start, mut size) = (0u64, 0u64);
        attribute(
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            (&mut start as *mut u64).cast(),
        )?;
        attribute(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE, (&mut size as *mut u64).cast())?;
        if address.saturating_add(len) > start.saturating_add(size) {
            return refuse(format!(
                "{len} bytes at {address:#x} run past the end of its allocation ({size} bytes at {start:#x})"
            ));
        }
        Ok(())
    }

    /// Gathers `region` of `kv` packed as `packing` into the start of `staging` with one kernel,
    /// on the copy stream; returns the bytes it fills. Planned from the layout, no host cache.
    pub fn gather_region(
        &self,
        kv: &DeviceKv,
        region: &KvRegion,
        packing: Packing,
        staging: &mut DeviceBuffer,
    ) -> Result<u64, CudaError> {
        let bytes = kv.packed_len(region);
        kv.layout.check_region(region).map_err(crate::cache::CacheError::from)?;
        at_least("staging buffer", bytes, staging.len())?;
        self.run(&self.table(kv, region, packing, Direction::Gather, self.address_of(staging)?)?)?;
        Ok(bytes)
    }

    /// Scatters the start of `staging` (packed as `packing`) into `region` of `kv` with one kernel,
    /// on the copy stream.
    pub fn scatter_region(
        &self,
        staging: &DeviceBuffer,
        kv: &DeviceKv,
        region: &KvRegion,
        packing: Packing,
    ) -> Result<(), CudaError> {
        kv.layout.check_region(region).map_err(crate::cache::CacheError::from)?;
        at_least("staging buffer", kv.packed_len(region), staging.len())?;
        self.run(&self.table(kv, region, packing, Direction::Scatter, self.address_of(staging)?)?)
    }

    /// Copies the first `bytes` of `device` into pinned `host` (at least as long) on the copy
    /// stream, without waiting.
    pub fn download_prefix(
        &self,
        device: &DeviceBuffer,
        bytes: u64,
        host: &mut PinnedBuffer,
    ) -> Result<(), CudaError> {
        self.mine(device)?;
        at_least("device buffer", bytes, device.len())?;
        at_least("pinned buffer", bytes, host.slice.len())?;
        let view = device.slice.slice(..bytes as usize);
        Ok(self.copy.memcpy_dtoh(&view, &mut host.slice)?)
    }

    /// Gathers `region` of `kv` packed as `packing` into pinned `host` memory (at least as long)
    /// through `staging`: one kernel, then one copy down, both on the copy stream. Returns the
    /// point where both are done; [`PinnedBuffer::as_slice`] waits for it too. The host does not
    /// wait. (Cutting the region so that a kernel overlaps the previous part's copy on a second
    /// stream was measured slower on an H100: the extra events and launches cost more than the
    /// kernel they hide.)
    pub fn gather_to_host(
        &self,
        kv: &DeviceKv,
        region: &KvRegion,
        packing: Packing,
        staging: &DeviceBuffer,
        host: &mut PinnedBuffer,
    ) -> Result<CopiesDone, CudaError> {
        let bytes = kv.packed_len(region);
        at_least("pinned buffer", bytes, host.len())?;
        kv.layout.check_region(region).map_err(crate::cache::CacheError::from)?;
        at_least("staging buffer", bytes, staging.len())?;
        self.run(&self.table(kv, region, packing, Direction::Gather, self.address_of(staging)?)?)?;
        self.download_prefix(staging, bytes, host)?;
        self.copies_done()
    }

    /// Swap-in prefetch: copies pinned `host` (`region` of `kv` packed as `packing`, exactly its
    /// length) to the device through `staging` and scatters it into `kv`, all on the copy stream;
    /// returns the point the engine's compute stream waits for ([`CopiesDone::make_wait`]) before
    /// the work that reads the region. The host does not wait. If the engine's queued work may
    /// still read the region's old contents, order the prefetch after it first
    /// ([`CudaEngine::wait_for`]).
    pub fn prefetch(
        &self,
        host: &PinnedBuffer,
        staging: &mut DeviceBuffer,
        kv: &DeviceKv,
        region: &KvRegion,
        packing: Packing,
    ) -> Result<CopiesDone, CudaError> {
        kv.layout.check_region(region).map_err(crate::cache::CacheError::from)?;
        let bytes = kv.packed_len(region);
        same_len("pinned buffer", bytes as usize, host.slice.len())?;
        at_least("staging buffer", bytes, staging.len())?;
        self.mine(staging)?;
        let mut view = staging.slice.slice_mut(..bytes as usize);
        self.copy.memcpy_htod(&host.slice, &mut view)?;
        self.run(&self.table(kv, region, packing, Direction::Scatter, self.address_of(staging)?)?)?;
        self.copies_done()
    }

    /// Marks the work enqueued so far on the engine's compute stream `compute` (a layer or step
    /// it has just launched), for a copy to be ordered after ([`CudaEngine::wait_for`]). Records
    /// an event there; nothing blocks.
    ///
    /// # Safety
    /// `compute` must be a live stream of this engine's context.
    pub unsafe fn mark_ready(&self, compute: sys::CUstream) -> Result<ReadyMarker, CudaError> {
        let event = self.ctx.new_event(None)?;
        // SAFETY: `compute` is a live stream of this context (the caller's promise) and the event
        // is this context's; `new_event` bound the context to this thread.
        unsafe { cudarc::driver::result::event::record(event.cu_event(), compute) }?;
        Ok(ReadyMarker { event })
    }

    /// Makes the copy stream wait, from now on, for the work `marker` marks. Nothing blocks.
    pub fn wait_for(&self, marker: &ReadyMarker) -> Result<(), CudaError> {
        Ok(self.copy.wait(&marker.event)?)
    }

    /// Makes the copy stream wait, from now on, for the work enqueued so far on the engine's
    /// compute stream `compute`: [`CudaEngine::mark_ready`] then [`CudaEngine::wait_for`]. The
    /// host never blocks, and neither does the compute stream.
    ///
    /// # Safety
    /// `compute` must be a live stream of this engine's device context.
    pub unsafe fn after(&self, compute: sys::CUstream) -> Result<(), CudaError> {
        // SAFETY: the caller's promise, passed on.
        let marker = unsafe { self.mark_ready(compute) }?;
        self.wait_for(&marker)
    }

    /// The copies enqueued on the copy stream so far, as a point to poll, sleep on, or make the
    /// engine's stream wait for.
    pub fn copies_done(&self) -> Result<CopiesDone, CudaError> {
        // Blocking synchronisation: a host thread waiting on it sleeps instead of spinning.
        let event = self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))?;
        event.record(&self.copy)?;
        Ok(CopiesDone { event })
    }

    /// Waits for every copy enqueued so far.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        Ok(self.copy.synchronize()?)
    }

    /// Copies every buffer of `host` into `kv` (same layout) and waits: for tests and checks.
    pub fn upload_kv(&self, host: &[Vec<u8>], kv: &mut DeviceKv) -> Result<(), CudaError> {
        self.bases_of(kv)?;
        same_len("buffers", kv.buffers.len(), host.len())?;
        for (bytes, buffer) in host.iter().zip(&mut kv.buffers) {
            match buffer {
                DeviceMem::Owned(device) => self.upload(bytes, device)?,
                DeviceMem::Borrowed(_) => {
                    return Err(CudaError::Driver("uploading into an engine's own memory".into()))
                }
            }
        }
        self.synchronize()
    }

    /// Every buffer of `kv` (library-owned), copied to the host: for tests and checks.
    pub fn download_kv(&self, kv: &DeviceKv) -> Result<Vec<Vec<u8>>, CudaError> {
        self.bases_of(kv)?;
        self.synchronize()?;
        kv.buffers
            .iter()
            .map(|buffer| match buffer {
                DeviceMem::Owned(device) => {
                    let mut host = vec![0u8; device.len()];
                    self.download(device, &mut host)?;
                    Ok(host)
                }
                DeviceMem::Borrowed(_) => Err(CudaError::Driver("downloading an engine's own memory".into())),
            })
            .collect()
    }

    /// The table of a copy between `region` of `kv` and a staging buffer at `staging`. A copy
    /// already seen at another token offset (the previous decode step) is moved along the tokens
    /// ([`TokenSteps`]); a new one is planned at two neighbouring offsets to learn its steps.
    /// Paged layouts, whose addresses jump between blocks, are planned every time.
    pub(super) fn table(
        &self,
        kv: &DeviceKv,
        region: &KvRegion,
        packing: Packing,
        direction: Direction,
        staging: u64,
    ) -> Result<Table, CudaError> {
        let bases = self.bases_of(kv)?;
        let encode_at =
            |region: &KvRegion, staging| encode_copy(kv, &bases, region, packing, direction, staging);
        let shift = |staging| match direction {
            Direction::Gather => (0, staging),
            Direction::Scatter => (staging, 0),
        };
        let paged = matches!(kv.layout.kind(), LayoutKind::Paged(_));
        if paged || region.is_empty() {
            return encode_at(region, staging);
        }
        let start = region.tokens.start;
        let shape = tokens_at(region, 0);
        let (src_shift, dst_shift) = shift(staging);
        // Compared field by field, so that a hit clones nothing.
        let same = |k: &StepsKey| {
            k.region == shape
                && k.direction == direction
                && k.packing == packing
                && k.bases == bases
                && k.layout == kv.layout
        };
        if let Some((_, steps)) = self.steps.lock().iter().find(|(k, _)| same(k)) {
            return Ok(steps.at(start, src_shift, dst_shift));
        }
        // Learn the steps: the tables one token apart, staging at 0.
        let moved = |by: i64| {
            let first = u32::try_from(i64::from(start) + by).ok()?;
            first.checked_add(region.tokens.end - start)?;
            let moved = tokens_at(region, first);
            kv.layout.check_region(&moved).ok().map(|()| (first, moved))
        };
        let here = encode_at(region, 0)?;
        let steps = match (moved(1), moved(-1)) {
            (Some((_, next)), _) => TokenSteps::new(here, start, &encode_at(&next, 0)?),
            (None, Some((before, previous))) => TokenSteps::new(encode_at(&previous, 0)?, before, &here),
            (None, None) => None,
        };
        let Some(steps) = steps else {
            return encode_at(region, staging);
        };
        let table = steps.at(start, src_shift, dst_shift);
        let key =
            StepsKey { region: shape, direction, packing, bases: bases.clone(), layout: kv.layout.clone() };
        let mut kept = self.steps.lock();
        if kept.len() >= KEPT_STEPS {
            kept.remove(0);
        }
        kept.push((key, steps));
        Ok(table)
    }

    /// Refuses memory another engine allocated: it is freed on that engine's stream, which does
    /// not wait for this engine's copies.
    fn mine(&self, buffer: &DeviceBuffer) -> Result<(), CudaError> {
        if Arc::ptr_eq(&buffer.stream, &self.copy) {
            Ok(())
        } else {
            Err(CudaError::OtherEngine)
        }
    }

    /// `buffer`'s device address, if this engine allocated it.
    pub(super) fn address_of(&self, buffer: &DeviceBuffer) -> Result<u64, CudaError> {
        self.mine(buffer)?;
        Ok(buffer.address())
    }

    /// The device addresses of `kv`'s buffers, if this engine allocated the ones the library owns
    /// (borrowed ones are the caller's promise: see [`DeviceKv::borrowed`]).
    fn bases_of(&self, kv: &DeviceKv) -> Result<Vec<u64>, CudaError> {
        kv.buffers
            .iter()
            .map(|b| match b {
                DeviceMem::Owned(buffer) => self.address_of(buffer),
                DeviceMem::Borrowed(address) => Ok(*address),
            })
            .collect()
    }

    /// Launches `table` on the copy stream.
    pub(super) fn run(&self, table: &Table) -> Result<(), CudaError> {
        // SAFETY: every table comes from `encode` over a plan made for the cache's layout and
        // the buffers' addresses, after the callers' length checks (so its addresses lie inside
        // them), and those buffers outlive the copy (owned ones synchronise the copy stream before
        // they are freed, and `mine` refuses another engine's; borrowed ones are the promise of
        // `DeviceKv::borrowed`).
        unsafe { self.kernels.launch(&self.copy, table) }
    }
}

/// The table of the copy of `region` of `kv` (its buffers at `bases`) to or from a staging
/// buffer at `staging`, planned and encoded.
fn encode_copy(
    kv: &DeviceKv,
    bases: &[u64],
    region: &KvRegion,
    packing: Packing,
    direction: Direction,
    staging: u64,
) -> Result<Table, CudaError> {
    Ok(match direction {
        Direction::Gather => encode(&gather_copy_plan(&kv.layout, region, packing)?, bases, &[staging])?,
        Direction::Scatter => encode(&scatter_copy_plan(&kv.layout, region, packing)?, &[staging], bases)?,
    })
}

/// `region` with its tokens moved to start at `first`.
fn tokens_at(region: &KvRegion, first: u32) -> KvRegion {
    let count = region.tokens.end - region.tokens.start;
    KvRegion::new(region.layers.clone(), region.slots.clone(), region.heads.clone(), first..first + count)
}

fn at_least(what: &'static str, needed: u64, got: usize) -> Result<(), CudaError> {
    if (got as u64) < needed {
        return Err(CudaError::Size { what, needed, got: got as u64 });
    }
    Ok(())
}

fn same_len(what: &'static str, needed: usize, got: usize) -> Result<(), CudaError> {
    if needed != got {
        return Err(CudaError::Size { what, needed: needed as u64, got: got as u64 });
    }
    Ok(())
}
