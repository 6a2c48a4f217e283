//! A region between a device cache and host memory, as close to the speed of one plain copy of
//! its bytes as the gather kernel allows, two ways ([`HostPath`]):
//!
//! - **Staged**: the gather (or scatter) kernel and the copy over the bus are cut into pieces of
//!   whole layers and run on two streams, so that the kernel of one piece overlaps the copy of
//!   another; only the first piece's kernel (the last one's, for a scatter) is not hidden. The
//!   staging pieces come from the engine's pool and form a small ring, so a prompt of any size
//!   needs a few tens of megabytes of device memory, not its own size.
//! - **Direct**: page-locked host memory is mapped into the device's address space, so the kernel
//!   reads or writes it over the bus itself: one launch, no staging, no second copy.
//!
//! The packed form is `[layer][part][slot][head]…` (see [`Packing`]), so the pieces of a region cut
//! at layer boundaries pack to consecutive byte ranges of the whole region's packed form.

use cudarc::driver::{result, sys, CudaEvent, CudaStream};

use super::engine::Direction;
use super::memory::{DeviceBuffer, DeviceKv};
use super::pool::RING;
use super::{CudaEngine, CudaError};
use crate::layout::Packing;
use crate::region::KvRegion;

/// Largest piece, in bytes, unless one layer alone is larger (a piece holds whole layers).
const MAX_PIECE_BYTES: u64 = 16 << 20;

/// Host memory as the driver sees it: page-locked memory is copied by the DMA engines straight
/// from and to the caller's buffer, pageable memory through the driver's own staging.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostMemory {
    /// Page-locked (pinned or registered) memory.
    Pinned,
    /// Ordinary pageable memory.
    Pageable,
}

/// How a copy between a device cache and host memory runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostPath {
    /// Through device staging, in at least `pieces` pieces of whole layers (more where a piece
    /// would exceed 16 MiB, fewer where the region has fewer layers).
    Staged {
        /// Pieces asked for.
        pieces: u32,
    },
    /// The kernel reads or writes page-locked host memory itself; pageable memory is staged.
    Direct,
}

impl HostPath {
    /// The path the engine takes for a copy to or from `memory`: two pieces for pinned memory
    /// (for a decode step of a 13B-class stage on an H200, one piece left the whole gather kernel
    /// unhidden and four paid more in copy setup than they hid; see docs/benchmarks.md), one for
    /// pageable memory.
    pub fn auto(memory: HostMemory) -> Self {
        match memory {
            HostMemory::Pinned => HostPath::Staged { pieces: 2 },
            // Each copy from or to pageable memory waits for the driver's own staging: one.
            HostMemory::Pageable => HostPath::Staged { pieces: 1 },
        }
    }
}

/// One piece of a pipelined copy: its layers, and where it lies in the packed form.
#[derive(Clone, Debug)]
struct Piece {
    region: KvRegion,
    offset: u64,
    bytes: u64,
}

impl CudaEngine {
    /// What kind of host memory `host` is (its first and last byte both page-locked: pinned).
    pub fn host_memory(&self, host: &[u8]) -> Result<HostMemory, CudaError> {
        self.context().bind_to_thread()?;
        let pinned = |address: *const u8| {
            let mut memory_type = 0u32;
            // SAFETY: `memory_type` is the unsigned int this attribute is; the driver only reads
            // `address` as a number and answers for any value (an error for unknown memory).
            let asked = unsafe {
                sys::cuPointerGetAttribute(
                    (&mut memory_type as *mut u32).cast(),
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                    address as sys::CUdeviceptr,
                )
            };
            asked == sys::CUresult::CUDA_SUCCESS
                && memory_type == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32
        };
        let last = host.len().saturating_sub(1);
        Ok(if !host.is_empty() && pinned(host.as_ptr()) && pinned(host[last..].as_ptr()) {
            HostMemory::Pinned
        } else {
            HostMemory::Pageable
        })
    }

    /// Gathers `region` of `kv` packed as `packing` into host memory `host` (exactly its packed
    /// length), after the work the copy stream already waits for ([`CudaEngine::after`]), and
    /// returns once it is there. Into pinned `host` memory the kernel of each piece overlaps the
    /// copy down of the one before: a prompt moves at the speed of one plain copy of its bytes;
    /// a decode step, whose kernel is a third as long as its copy, at 0.6x-0.7x of it on an
    /// H200 (see docs/benchmarks.md).
    pub fn gather_into_host(
        &self,
        kv: &DeviceKv,
        region: &KvRegion,
        packing: Packing,
        host: &mut [u8],
    ) -> Result<(), CudaError> {
        let path = HostPath::auto(self.host_memory(host)?);
        self.gather_into_host_by(kv, region, packing, host, path)
    }

    /// [`CudaEngine::gather_into_host`] along `path`.
    pub fn gather_into_host_by(
        &self,
        kv: &DeviceKv,
        region: &KvRegion,
        packing: Packing,
        host: &mut [u8],
        path: HostPath,
    ) -> Result<(), CudaError> {
        let pieces = self.pieces(kv, region, host.len(), path)?;
        if let (HostPath::Direct, Some(address)) = (path, self.mapped(host)?) {
            self.run(&self.table(kv, region, packing, Direction::Gather, address)?)?;
            return Ok(self.copy_stream().synchronize()?);
        }
        let mut filled = Vec::with_capacity(pieces.len() + 1);
        let ring = self.staging_ring(&pieces, &mut filled)?;
        // Into pinned memory nothing here blocks the host, so the kernel of the next piece is
        // queued while this one's copy runs; a copy into pageable memory returns once it is done.
        let mut copied = Vec::new();
        // One piece has nothing to overlap: its copy follows its kernel on the same stream.
        let (one, bus) = self.bus(&pieces);
        let mut queue = || -> Result<(), CudaError> {
            for (i, piece) in pieces.iter().enumerate() {
                let staging = &ring[i % RING];
                if let Some(j) = i.checked_sub(RING) {
                    // The copy out of this staging must be done before a kernel refills it (with
                    // more pieces than the ring, every copy is marked).
                    self.copy_stream().wait(&copied[j])?;
                }
                let address = self.address_of(staging)?;
                let table = self.table(kv, &piece.region, packing, Direction::Gather, address)?;
                self.run(&table)?;
                if !one {
                    let ready = self.mark(self.copy_stream(), &mut filled)?;
                    bus.wait(ready)?;
                }
                let out = &mut host[piece.offset as usize..(piece.offset + piece.bytes) as usize];
                // SAFETY: `address` is the staging buffer's, at least `piece.bytes` long (the
                // ring's buffers are as large as the largest piece), and stays allocated until
                // both streams are synchronised in `finish`; `out` is exactly `piece.bytes` long
                // and stays borrowed until then too.
                unsafe { result::memcpy_dtoh_async(out, address, bus.cu_stream()) }?;
                if pieces.len() > RING {
                    self.mark(bus, &mut copied)?;
                }
            }
            Ok(())
        };
        let queued = queue();
        self.finish(queued, one, ring, [filled, copied])
    }

    /// Scatters host memory `host` (packed as `packing`, exactly `region`'s packed length) into
    /// `region` of `kv`, after the work the copy stream already waits for, and returns once it is
    /// in place. From pinned memory the copy up of each piece overlaps the kernel of the one
    /// before (a prompt at the speed of one plain copy, a decode step at about 0.9x).
    pub fn scatter_from_host(
        &self,
        host: &[u8],
        kv: &DeviceKv,
        region: &KvRegion,
        packing: Packing,
    ) -> Result<(), CudaError> {
        let path = HostPath::auto(self.host_memory(host)?);
        self.scatter_from_host_by(host, kv, region, packing, path)
    }

    /// [`CudaEngine::scatter_from_host`] along `path`.
    pub fn scatter_from_host_by(
        &self,
        host: &[u8],
        kv: &DeviceKv,
        region: &KvRegion,
        packing: Packing,
        path: HostPath,
    ) -> Result<(), CudaError> {
        let pieces = self.pieces(kv, region, host.len(), path)?;
        if let (HostPath::Direct, Some(address)) = (path, self.mapped(host)?) {
            self.run(&self.table(kv, region, packing, Direction::Scatter, address)?)?;
            return Ok(self.copy_stream().synchronize()?);
        }
        let mut arrived = Vec::with_capacity(pieces.len() + 1);
        let ring = self.staging_ring(&pieces, &mut arrived)?;
        let mut scattered = Vec::new();
        let (one, bus) = self.bus(&pieces);
        let mut queue = || -> Result<(), CudaError> {
            for (i, piece) in pieces.iter().enumerate() {
                let staging = &ring[i % RING];
                if let Some(j) = i.checked_sub(RING) {
                    // The kernel that read this staging last must be done before a copy refills
                    // it (with more pieces than the ring, every kernel is marked).
                    bus.wait(&scattered[j])?;
                }
                let address = self.address_of(staging)?;
                let data = &host[piece.offset as usize..(piece.offset + piece.bytes) as usize];
                // SAFETY: `address` is the staging buffer's, at least `piece.bytes` long, and
                // stays allocated until both streams are synchronised in `finish`; `data` is that
                // long and stays borrowed until then too.
                unsafe { result::memcpy_htod_async(address, data, bus.cu_stream()) }?;
                if !one {
                    let up = self.mark(bus, &mut arrived)?;
                    self.copy_stream().wait(up)?;
                }
                let table = self.table(kv, &piece.region, packing, Direction::Scatter, address)?;
                self.run(&table)?;
                if pieces.len() > RING {
                    self.mark(self.copy_stream(), &mut scattered)?;
                }
            }
            Ok(())
        };
        let queued = queue();
        self.finish(queued, one, ring, [arrived, scattered])
    }

    /// The device address of `host`, if it is page-locked memory mapped into the device's address
    /// space as a whole (pinned memory allocated by CUDA is, on every 64-bit system).
    fn mapped(&self, host: &[u8]) -> Result<Option<u64>, CudaError> {
        if host.is_empty() {
            return Ok(None);
        }
        self.context().bind_to_thread()?;
        let device_address = |address: *const u8| {
            let mut device = 0;
            // SAFETY: `device` is the CUdeviceptr the call fills; the driver only looks `address`
            // up (an error for memory it did not lock) and flags must be 0.
            let asked = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, address as *mut _, 0) };
            (asked == sys::CUresult::CUDA_SUCCESS).then_some(device)
        };
        let last = host.len() - 1;
        Ok(match (device_address(host.as_ptr()), device_address(host[last..].as_ptr())) {
            // One mapping: the last byte where the first one's says.
            (Some(first), Some(end)) if end == first + last as u64 => Some(first),
            _ => None,
        })
    }

    /// `region` of `kv` cut into pieces of whole layers along `path`, checked against a host
    /// buffer of `len` bytes.
    fn pieces(
        &self,
        kv: &DeviceKv,
        region: &KvRegion,
        len: usize,
        path: HostPath,
    ) -> Result<Vec<Piece>, CudaError> {
        kv.layout().check_region(region).map_err(crate::cache::CacheError::from)?;
        let total = kv.packed_len(region);
        if total != len as u64 {
            return Err(CudaError::Size { what: "host buffer", needed: total, got: len as u64 });
        }
        let layers = region.layers.end - region.layers.start;
        if total == 0 {
            return Ok(Vec::new());
        }
        let per_layer = total / u64::from(layers);
        let asked = match path {
            HostPath::Staged { pieces } => u64::from(pieces.max(1)),
            HostPath::Direct => 1,
        };
        // As many as asked, or more where pieces would be too large; at most one per layer.
        let count = asked.max(total.div_ceil(MAX_PIECE_BYTES)).min(u64::from(layers));
        let at = |i: u64| region.layers.start + (u64::from(layers) * i / count) as u32;
        let pieces = (0..count)
            .map(|i| {
                let (first, end) = (at(i), at(i + 1));
                let piece = KvRegion::new(
                    first..end,
                    region.slots.clone(),
                    region.heads.clone(),
                    region.tokens.clone(),
                );
                let offset = u64::from(first - region.layers.start) * per_layer;
                Piece { region: piece, offset, bytes: u64::from(end - first) * per_layer }
            })
            .collect::<Vec<_>>();
        Ok(pieces)
    }

    /// Staging for the ring of `pieces`: `RING` buffers as large as the largest piece (fewer
    /// when there are fewer pieces), from the engine's pool. A buffer allocated here is zeroed on
    /// the copy stream: the transfer stream, which a scatter fills staging from first, is made to
    /// wait for that (`events` keeps the mark).
    fn staging_ring(
        &self,
        pieces: &[Piece],
        events: &mut Vec<CudaEvent>,
    ) -> Result<Vec<DeviceBuffer>, CudaError> {
        let largest = pieces.iter().map(|p| p.bytes).max().unwrap_or(0) as usize;
        let mut allocated = false;
        let ring = (0..pieces.len().min(RING))
            .map(|_| match self.staging_pool().take(largest) {
                Some(buffer) => Ok(buffer),
                None => {
                    allocated = true;
                    self.alloc(largest)
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        if allocated && ring.len() > 1 {
            let zeroed = self.mark(self.copy_stream(), events)?;
            self.transfer_stream().wait(zeroed)?;
        }
        Ok(ring)
    }

    /// Whether `pieces` is a single piece, and the stream its copies over the bus take: the copy
    /// stream itself for one piece (its copy and its kernel cannot overlap), else the transfer
    /// stream.
    fn bus(&self, pieces: &[Piece]) -> (bool, &std::sync::Arc<CudaStream>) {
        if pieces.len() == 1 {
            (true, self.copy_stream())
        } else {
            (false, self.transfer_stream())
        }
    }

    /// Records an event of the pool on `stream`, kept in `events`; returns it.
    fn mark<'a>(
        &self,
        stream: &CudaStream,
        events: &'a mut Vec<CudaEvent>,
    ) -> Result<&'a CudaEvent, CudaError> {
        let event = self.event_pool().take()?;
        event.record(stream)?;
        events.push(event);
        Ok(events.last().expect("just pushed"))
    }

    /// Waits for both streams (only the copy stream where the copy was `one` piece, which used
    /// no other), whether or not everything was queued (`queued`: the staging must not be reused
    /// or freed while a copy queued before an error still runs), then keeps the ring's buffers
    /// and the events for the next copy. Returns the first error.
    fn finish(
        &self,
        queued: Result<(), CudaError>,
        one: bool,
        ring: Vec<DeviceBuffer>,
        events: [Vec<CudaEvent>; 2],
    ) -> Result<(), CudaError> {
        let transfer = if one { Ok(()) } else { self.transfer_stream().synchronize() };
        let copy = self.copy_stream().synchronize();
        queued?;
        transfer?;
        copy?;
        for buffer in ring {
            self.staging_pool().give_back(buffer);
        }
        for kept in events {
            self.event_pool().give_back(kept);
        }
        Ok(())
    }
}
