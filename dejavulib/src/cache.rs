//! A KV cache in host memory that an engine writes while a streamer reads other layers of it.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use thiserror::Error;

use crate::copy::{self, CopyError, RawDst, RawSrc};
use crate::handover::{in_order, piece_at, Handover};
use crate::layout::{KvLayout, LayoutError, Packing};
use crate::memory::HostBuffer;
use crate::plan::{plan_copy, CopyPlan, Order};
use crate::region::{Coord, KvRegion};
use crate::spec::Part;

/// Errors of cache operations.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum CacheError {
    /// The layout or region is invalid.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The copy could not run.
    #[error(transparent)]
    Copy(#[from] CopyError),
    /// The layout lets two layers share bytes, so per-layer locking would not be sound.
    #[error("layout is not layer-disjoint: two layers share bytes of one buffer")]
    LayersOverlap,
    /// A cache buffer could not be allocated.
    #[error("cannot allocate a cache buffer of {0} bytes")]
    OutOfMemory(u64),
    /// A gather plan made by another cache.
    #[error("the gather plan was made by another cache")]
    ForeignPlan,
    /// Buffers handed to [`KvCache::from_raw_buffers`] do not fit the layout.
    #[error("engine buffers do not fit the layout: {0}")]
    Buffers(String),
    /// A staging or vector buffer has the wrong size.
    #[error("buffer of {len} bytes, {needed} needed")]
    WrongLength {
        /// Bytes needed.
        needed: u64,
        /// Bytes given.
        len: u64,
    },
}

/// Errors of [`KvCache::for_each_extent`]: the cache's own, or the callback's.
#[derive(Debug, Error)]
pub enum ExtentError<E> {
    /// Planning or bounds failed.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// The callback failed.
    #[error("extent callback failed: {0}")]
    Callback(#[source] E),
}

/// A KV cache in page-aligned host memory, laid out by a [`KvLayout`].
///
/// Each layer has its own reader-writer lock: a gather of layer `l` runs while the engine writes
/// layer `l + 1`, which is what layer-by-layer streaming needs. Share it with `Arc`.
///
/// Thread safety rests on two checks: `new` refuses layouts whose layers share bytes, and every
/// copy runs a plan this cache made for the region whose layer locks it holds.
pub struct KvCache {
    id: u64,
    layout: KvLayout,
    buffers: Vec<HostBuffer>,
    layer_locks: Vec<RwLock<()>>,
    copy_threads: AtomicUsize,
    /// Whether no two buffers share a byte: always so for the cache's own; an engine's may be
    /// views of one tensor, and a scatter then stays on one thread.
    buffers_apart: bool,
}

/// Whether no two of `buffers` share a byte.
fn apart(buffers: &[HostBuffer]) -> bool {
    let mut spans: Vec<(usize, usize)> =
        buffers.iter().map(|b| (b.as_ptr() as usize, b.as_ptr() as usize + b.len())).collect();
    spans.sort_unstable();
    spans.windows(2).all(|pair| pair[0].1 <= pair[1].0)
}

/// Source of cache identities, so a [`GatherPlan`] only runs on the cache that made it.
static NEXT_CACHE_ID: AtomicU64 = AtomicU64::new(1);

/// A gather of one region of one cache, planned once and run many times (the same region every
/// time: the plan holds absolute offsets, so the next decode step needs a plan of its own).
#[derive(Clone, Debug)]
pub struct GatherPlan {
    cache: u64,
    region: KvRegion,
    packing: Packing,
    plan: CopyPlan,
}

impl GatherPlan {
    /// The region it gathers.
    pub fn region(&self) -> &KvRegion {
        &self.region
    }

    /// The packing it produces.
    pub fn packing(&self) -> Packing {
        self.packing
    }

    /// The copy it runs, for inspection (runs, bytes).
    pub fn copy_plan(&self) -> &CopyPlan {
        &self.plan
    }
}

/// The copy that gathers `region` of a cache laid out as `layout` into a packed buffer with
/// `packing`: what every copy engine (CPU or GPU) runs for a gather.
pub fn gather_copy_plan(
    layout: &KvLayout,
    region: &KvRegion,
    packing: Packing,
) -> Result<CopyPlan, CacheError> {
    packed_copy_plan(layout, region, packing, Order::Src)
}

/// The copy that scatters a packed buffer with `packing` into `region` of a cache laid out as
/// `layout`.
pub fn scatter_copy_plan(
    layout: &KvLayout,
    region: &KvRegion,
    packing: Packing,
) -> Result<CopyPlan, CacheError> {
    packed_copy_plan(layout, region, packing, Order::Dst)
}

/// The copy between `region` of `layout` and its packed form: out of the cache (`Order::Src`, a
/// gather) or into it (`Order::Dst`, a scatter).
fn packed_copy_plan(
    layout: &KvLayout,
    region: &KvRegion,
    packing: Packing,
    order: Order,
) -> Result<CopyPlan, CacheError> {
    layout.check_region(region)?;
    if region.is_empty() {
        return Ok(CopyPlan::default());
    }
    let packed = KvLayout::packed(layout.spec(), region.shape(), packing)?;
    let (at, shape) = (region.origin(), region.shape());
    Ok(match order {
        Order::Src => plan_copy(layout, at, &packed, Coord::default(), shape, order)?,
        Order::Dst => plan_copy(&packed, Coord::default(), layout, at, shape, order)?,
    })
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache").field("layout", &self.layout.kind()).finish()
    }
}

impl KvCache {
    /// Allocates zeroed buffers for `layout`.
    pub fn new(layout: KvLayout) -> Result<Self, CacheError> {
        if !layout.layers_are_disjoint() {
            return Err(CacheError::LayersOverlap);
        }
        let buffers = layout
            .buffer_sizes()
            .iter()
            .map(|&n| {
                usize::try_from(n).ok().and_then(HostBuffer::try_zeroed).ok_or(CacheError::OutOfMemory(n))
            })
            .collect::<Result<_, _>>()?;
        let layer_locks = (0..layout.spec().layers()).map(|_| RwLock::new(())).collect();
        let id = NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed);
        // Allocations of their own: apart.
        Ok(Self { id, layout, buffers, layer_locks, copy_threads: AtomicUsize::new(1), buffers_apart: true })
    }

    /// A cache over buffers someone else owns (an engine's KV tensors), used in place: one
    /// `(pointer, length)` per buffer of `layout`, in [`KvLayout::buffer_sizes`] order, each at
    /// least as long as the layout needs.
    ///
    /// # Safety
    ///
    /// Every `(pointer, length)` pair must satisfy [`HostBuffer::borrowed`]'s conditions for as long
    /// as the cache lives: valid for reads and writes, initialised, and not accessed by others
    /// while the cache's copies run except as the caller orders it.
    pub unsafe fn from_raw_buffers(
        layout: KvLayout,
        buffers: &[(*mut u8, usize)],
    ) -> Result<Self, CacheError> {
        if !layout.layers_are_disjoint() {
            return Err(CacheError::LayersOverlap);
        }
        let needed = layout.buffer_sizes();
        if buffers.len() != needed.len() {
            return Err(CacheError::Buffers(format!(
                "{} buffers given, the layout has {}",
                buffers.len(),
                needed.len()
            )));
        }
        let mut owned = Vec::with_capacity(buffers.len());
        for (i, (&(ptr, len), &need)) in buffers.iter().zip(needed).enumerate() {
            if (len as u64) < need {
                return Err(CacheError::Buffers(format!(
                    "buffer {i} has {len} bytes, the layout needs {need}"
                )));
            }
            // SAFETY: the caller guarantees `HostBuffer::borrowed`'s conditions for each pair.
            let buffer = unsafe { HostBuffer::borrowed(ptr, need as usize) }
                .ok_or_else(|| CacheError::Buffers(format!("buffer {i} is a null pointer")))?;
            owned.push(buffer);
        }
        let layer_locks = (0..layout.spec().layers()).map(|_| RwLock::new(())).collect();
        let id = NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed);
        let buffers_apart = apart(&owned);
        Ok(Self { id, layout, buffers: owned, layer_locks, copy_threads: AtomicUsize::new(1), buffers_apart })
    }

    /// Lets gathers and scatters of at least [`copy::PARALLEL_MIN_BYTES`] use up to `threads`
    /// threads (1, the default, keeps them on the caller's thread). A decode step's scattered
    /// pieces are bound by the cache misses one core keeps in flight, and a prompt's long runs by
    /// what one core copies: a second core raises both. A scatter into a region two of whose
    /// elements share a byte ([`KvLayout::region_is_injective`]), or into buffers that overlap
    /// one another, stays on the caller's thread.
    /// At most the machine's parallelism is used.
    pub fn set_copy_threads(&self, threads: usize) {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        self.copy_threads.store(threads.clamp(1, cores), Ordering::Relaxed);
    }

    /// Gives `slot` of a paged cache a new block table (a sequence grew or was moved). Plans made
    /// before the change are refused afterwards ([`CacheError::ForeignPlan`]): they hold the old
    /// block offsets.
    pub fn set_block_table(&mut self, slot: u32, blocks: Vec<u32>) -> Result<(), CacheError> {
        self.layout.set_block_table(slot, blocks)?;
        self.id = NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Bytes a packed copy of `region` takes.
    pub fn packed_len(&self, region: &KvRegion) -> u64 {
        region.shape().bytes(self.layout.spec())
    }

    /// Plans the gather of `region` into a packed buffer with `packing`, to run with
    /// [`KvCache::gather_with`] as often as needed.
    pub fn gather_plan(&self, region: &KvRegion, packing: Packing) -> Result<GatherPlan, CacheError> {
        self.layout.check_region(region)?;
        Ok(GatherPlan {
            cache: self.id,
            region: region.clone(),
            packing,
            plan: self.gather_copy_plan(region, packing)?,
        })
    }

    fn gather_copy_plan(&self, region: &KvRegion, packing: Packing) -> Result<CopyPlan, CacheError> {
        gather_copy_plan(&self.layout, region, packing)
    }

    /// The copy that scatters a packed buffer with `packing` into `region`, for inspection.
    pub fn scatter_plan(&self, region: &KvRegion, packing: Packing) -> Result<CopyPlan, CacheError> {
        scatter_copy_plan(&self.layout, region, packing)
    }

    /// Read locks on `layers`: no one writes them while they are held.
    fn read_layers(&self, layers: &Range<u32>) -> Vec<RwLockReadGuard<'_, ()>> {
        self.layer_locks[layers.start as usize..layers.end as usize].iter().map(RwLock::read).collect()
    }

    /// Write locks on `layers`: no one reads or writes them while they are held.
    fn write_layers(&self, layers: &Range<u32>) -> Vec<RwLockWriteGuard<'_, ()>> {
        self.layer_locks[layers.start as usize..layers.end as usize].iter().map(RwLock::write).collect()
    }

    /// Buffered copy out: gathers `region` into `out` (exactly [`KvCache::packed_len`] bytes).
    pub fn gather(&self, region: &KvRegion, packing: Packing, out: &mut [u8]) -> Result<u64, CacheError> {
        self.layout.check_region(region)?;
        self.check_len(region, out.len())?;
        if region.is_empty() {
            return Ok(0);
        }
        let plan = self.gather_plan(region, packing)?;
        self.gather_with(&plan, out)
    }

    /// Runs a plan made by [`KvCache::gather_plan`] of this cache into `out` (exactly the packed
    /// length of the plan's region).
    pub fn gather_with(&self, plan: &GatherPlan, out: &mut [u8]) -> Result<u64, CacheError> {
        if plan.cache != self.id {
            return Err(CacheError::ForeignPlan);
        }
        let region = &plan.region;
        self.check_len(region, out.len())?;
        let plan = &plan.plan;
        let _guards = self.read_layers(&region.layers);
        let src = self.raw_src();
        let dst = [RawDst::from(out)];
        let threads = self.copy_threads.load(Ordering::Relaxed);
        // SAFETY: cache buffers are valid for their lengths; this cache planned the copy for
        // `region` (checked against its layout), so it only reads bytes of the region's layers
        // (layers are disjoint, checked in `new`), which we hold read locks for, so nobody writes
        // them; `out` is exclusively borrowed and not part of the cache; the destination is a
        // packed layout, so no two blocks write the same byte.
        Ok(unsafe { copy::execute_raw_parallel(plan, &src, &dst, threads) }?)
    }

    /// Runs a plan made by [`KvCache::gather_plan`] of this cache into `out`, as
    /// [`KvCache::gather_with`] does, in pieces of about `piece` bytes in the order of `out`, and
    /// hands `sink` each piece, in order, as soon as it and those before it are gathered, so that
    /// whatever consumes the packed bytes (a checksum and a write to a file, say) runs while the
    /// rest is gathered. With one gather thread ([`KvCache::set_copy_threads`]), or a region
    /// under [`copy::PARALLEL_MIN_BYTES`], the sink runs on a thread of its own; with more, each
    /// thread gathers the next piece no thread has taken and, after each, hands over the pieces
    /// that are ready if no other thread is doing so, as long as the gather goes on; what is left
    /// is handed over once the gather is done.
    ///
    /// `sink` returns whether it wants more; once it says no (or panics), the rest is still
    /// gathered, but not handed over. The pieces handed over are `out` whole, one after another.
    /// A plan whose blocks do not fill `out` in order is gathered first
    /// ([`KvCache::gather_with`]) and handed over in one piece. The layers read are locked against
    /// writers until the gather is done (and, with several threads, the piece one of them may be
    /// handing over then), not until the sink is: `sink` must not write to this cache.
    pub fn gather_streamed(
        &self,
        plan: &GatherPlan,
        out: &mut [u8],
        piece: usize,
        sink: impl FnMut(&[u8]) -> bool + Send,
    ) -> Result<u64, CacheError> {
        if plan.cache != self.id {
            return Err(CacheError::ForeignPlan);
        }
        self.check_len(&plan.region, out.len())?;
        let len = out.len();
        let Some(groups) = copy::ordered_groups(&plan.plan, len as u64, piece as u64) else {
            let gathered = self.gather_with(plan, out)?;
            let mut sink = sink;
            sink(out);
            return Ok(gathered);
        };
        let region = &plan.region;
        let guards = self.read_layers(&region.layers);
        let src = self.raw_src();
        let dst = [RawDst::from(&mut *out)];
        copy::check_plan(&plan.plan, &src, &dst)?;
        // The sink reads pieces through this address while other threads write the next: `out`
        // is not used again until all are done.
        let base = dst[0].ptr as usize;
        let ranges: Vec<Range<u64>> = groups.iter().map(|(range, _)| range.clone()).collect();
        let threads = match plan.plan.bytes() {
            bytes if bytes < copy::PARALLEL_MIN_BYTES => 1,
            _ => self.copy_threads.load(Ordering::Relaxed).min(groups.len()),
        };
        if threads > 1 {
            // Every core gathers; after each piece, a thread that finds the sink free hands over
            // the pieces ready while the gather goes on (a thread of the sink's own would take a
            // core from the gather). What is left when it ends is handed over once the locks are
            // gone.
            let handover = Handover::new(&ranges, base, sink);
            // SAFETY: the plan was checked against these buffers above; the cache's bytes are read
            // under the layers' read locks; the destination is packed (no byte written twice), and
            // the sink reads only groups already gathered, which no thread writes again.
            unsafe { copy::run_groups(&groups, &src, &dst, threads, &|group| handover.gathered(group)) };
            // The cache is read no more: writers to these layers need not wait for the sink.
            drop(guards);
            handover.finish();
            return Ok(plan.plan.bytes());
        }
        let (finished, arrivals) = crossbeam_channel::unbounded::<usize>();
        std::thread::scope(|scope| {
            scope.spawn(move || {
                let mut sink = sink;
                let mut wanted = true;
                for range in in_order(arrivals, &ranges) {
                    if wanted {
                        // SAFETY: as in `Handover::hand_over`: the gathering thread wrote the
                        // range before announcing it (the channel orders it).
                        wanted = sink(unsafe { piece_at(base, &range) });
                    }
                }
            });
            // The sink thread only ends once the sender is dropped: it cannot be gone.
            let announce = |group: usize| {
                let _ = finished.send(group);
            };
            // SAFETY: as above.
            unsafe { copy::run_groups(&groups, &src, &dst, 1, &announce) };
            drop(guards);
            drop(finished);
        });
        Ok(plan.plan.bytes())
    }

    /// Buffered copy in: scatters packed `input` (exactly [`KvCache::packed_len`] bytes) into `region`.
    pub fn scatter(&self, region: &KvRegion, packing: Packing, input: &[u8]) -> Result<u64, CacheError> {
        self.layout.check_region(region)?;
        self.check_len(region, input.len())?;
        if region.is_empty() {
            return Ok(0);
        }
        let plan = self.scatter_plan(region, packing)?;
        let _guards = self.write_layers(&region.layers);
        let src = [RawSrc::from(input)];
        let dst = self.raw_dst();
        // Threads write disjoint bytes only where no two elements of the region share one; the
        // check (a set of a paged region's blocks) is made only for a scatter that would split.
        let threads = self.copy_threads.load(Ordering::Relaxed);
        let split = threads > 1
            && plan.bytes() >= copy::PARALLEL_MIN_BYTES
            && self.buffers_apart
            && self.layout.region_is_injective(region);
        let threads = if split { threads } else { 1 };
        // SAFETY: the plan only writes bytes of the region's layers, which we hold write locks for;
        // `input` is a shared borrow that cannot alias the cache's private buffers; with more than
        // one thread, the region maps each element to bytes of its own buffer and the buffers
        // share no byte (both checked just above), so no two blocks of the plan write the same
        // byte.
        Ok(unsafe { copy::execute_raw_parallel(&plan, &src, &dst, threads) }?)
    }

    /// Hands every contiguous extent of `region` to `f` as (bytes, offset in the packed buffer), in
    /// plan order, under the region's read locks: the unbuffered path, one transfer per extent.
    ///
    /// `f` runs while the region's layers are read-locked: it must not write to this cache (that
    /// would deadlock, or invert the lock order on another layer).
    pub fn for_each_extent<E>(
        &self,
        region: &KvRegion,
        packing: Packing,
        mut f: impl FnMut(&[u8], u64) -> Result<(), E>,
    ) -> Result<(), ExtentError<E>> {
        self.layout.check_region(region).map_err(CacheError::from)?;
        if region.is_empty() {
            return Ok(());
        }
        let plan = self.gather_copy_plan(region, packing)?;
        let _guards = self.read_layers(&region.layers);
        for block in plan.blocks() {
            let buffer = self.buffers.get(block.src_buffer as usize);
            let end = block.src_end().unwrap_or(u64::MAX);
            let Some(buffer) = buffer.filter(|b| end <= b.len() as u64) else {
                return Err(CacheError::Copy(CopyError::OutOfBounds {
                    side: "source",
                    index: block.src_buffer,
                    needed: end,
                    len: buffer.map_or(0, |b| b.len() as u64),
                })
                .into());
            };
            let mut result = Ok(());
            block.for_each_run(|src, dst, len| {
                if result.is_ok() {
                    // SAFETY: the run lies inside the buffer (checked above) and belongs to a layer
                    // we hold a read lock on, so no one writes it while the slice lives.
                    let piece = unsafe {
                        std::slice::from_raw_parts(buffer.as_ptr().add(src as usize), len as usize)
                    };
                    result = f(piece, dst);
                }
            });
            result.map_err(ExtentError::Callback)?;
        }
        Ok(())
    }

    /// Writes one (token, head) vector of `part`: the logical accessor engines use to fill a cache.
    pub fn write_vector(&self, part: Part, at: Coord, data: &[u8]) -> Result<(), CacheError> {
        self.vector_io(
            part,
            at,
            data.len(),
            |offset, dst, len| {
                // SAFETY: `vector_io` checked the element range and holds the layer's write lock.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr().add(offset), dst, len) }
            },
            true,
        )
    }

    /// Reads one (token, head) vector of `part` into `out`.
    pub fn read_vector(&self, part: Part, at: Coord, out: &mut [u8]) -> Result<(), CacheError> {
        let out_ptr = out.as_mut_ptr();
        self.vector_io(
            part,
            at,
            out.len(),
            |offset, src, len| {
                // SAFETY: `vector_io` checked the element range and holds the layer's read lock; `out`
                // is exclusively borrowed and distinct from the cache.
                unsafe { std::ptr::copy_nonoverlapping(src, out_ptr.add(offset), len) }
            },
            false,
        )
    }

    /// Visits each contiguous chunk of one vector as (offset in vector, pointer into cache, length).
    fn vector_io(
        &self,
        part: Part,
        at: Coord,
        len: usize,
        mut f: impl FnMut(usize, *mut u8, usize),
        write: bool,
    ) -> Result<(), CacheError> {
        let spec = self.layout.spec();
        let needed = spec.vector_bytes(part);
        if len as u64 != needed {
            return Err(CacheError::WrongLength { needed, len: len as u64 });
        }
        // Bounds-checks coordinates and the part.
        self.layout.element_offset(part, at, 0)?;
        let lock = &self.layer_locks[at.layer as usize];
        let (_read, _write) = if write { (None, Some(lock.write())) } else { (Some(lock.read()), None) };
        let map = self.layout.part_map(part);
        let chunk_bytes = map.chunk_elems as usize * spec.elem_bytes(part);
        for (i, elem) in (0..spec.vector_elems(part)).step_by(map.chunk_elems as usize).enumerate() {
            let (buffer, offset) = self.layout.element_offset(part, at, elem)?;
            let index = buffer;
            let buffer = &self.buffers[index as usize];
            let len = buffer.len() as u64;
            let end = offset.saturating_add(chunk_bytes as u64);
            if end > len {
                return Err(CopyError::OutOfBounds { side: "cache", index, needed: end, len }.into());
            }
            // SAFETY: the whole chunk lies inside the buffer (checked just above).
            let ptr = unsafe { buffer.as_mut_ptr().add(offset as usize) };
            f(i * chunk_bytes, ptr, chunk_bytes);
        }
        Ok(())
    }

    /// A copy of every buffer (takes every layer's read lock): for checks and debugging.
    pub fn snapshot(&self) -> Vec<Vec<u8>> {
        let _guards: Vec<_> = self.layer_locks.iter().map(RwLock::read).collect();
        self.buffers.iter().map(|b| b.to_vec()).collect()
    }

    fn check_len(&self, region: &KvRegion, len: usize) -> Result<(), CacheError> {
        let needed = self.packed_len(region);
        if needed != len as u64 {
            return Err(CacheError::WrongLength { needed, len: len as u64 });
        }
        Ok(())
    }

    fn raw_src(&self) -> Vec<RawSrc> {
        self.buffers.iter().map(|b| RawSrc { ptr: b.as_ptr(), len: b.len() }).collect()
    }

    fn raw_dst(&self) -> Vec<RawDst> {
        self.buffers.iter().map(|b| RawDst { ptr: b.as_mut_ptr(), len: b.len() }).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::copy::PARALLEL_MIN_BYTES;
    use crate::spec::{DType, KvSpec};

    fn filled_cache() -> KvCache {
        let spec = KvSpec::new(4, 8, 128, DType::F16).unwrap();
        let cache = KvCache::new(KvLayout::faster_transformer(spec, 4, 256).unwrap()).unwrap();
        let full = KvRegion::new(0..4, 0..4, 0..8, 0..256);
        let bytes: Vec<u8> =
            (0..cache.packed_len(&full)).map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8).collect();
        cache.scatter(&full, Packing::token_major(&spec), &bytes).unwrap();
        cache
    }

    #[test]
    fn parallel_gather_matches_single_threaded() {
        let cache = filled_cache();
        let packing = cache.layout().preferred_packing();
        for region in [KvRegion::new(0..4, 0..4, 0..8, 0..200), KvRegion::new(0..4, 0..4, 0..8, 100..101)] {
            let len = cache.packed_len(&region) as usize;
            let mut one = vec![0u8; len];
            cache.gather(&region, packing, &mut one).unwrap();
            for threads in [2, 3, 64] {
                cache.set_copy_threads(threads);
                let mut many = vec![0u8; len];
                cache.gather(&region, packing, &mut many).unwrap();
                assert!(one == many, "{threads} threads, {len} bytes");
            }
            cache.set_copy_threads(1);
        }
        assert!(cache.packed_len(&KvRegion::new(0..4, 0..4, 0..8, 0..200)) >= PARALLEL_MIN_BYTES);
    }

    #[test]
    fn parallel_scatter_matches_single_threaded() {
        let source = filled_cache();
        let packing = source.layout().preferred_packing();
        let region = KvRegion::new(0..4, 0..4, 0..8, 0..200);
        let len = source.packed_len(&region) as usize;
        assert!(len as u64 >= PARALLEL_MIN_BYTES);
        let mut packed = vec![0u8; len];
        source.gather(&region, packing, &mut packed).unwrap();
        let layout = source.layout().clone();
        let one = KvCache::new(layout.clone()).unwrap();
        one.scatter(&region, packing, &packed).unwrap();
        for threads in [2, 3, 64] {
            let many = KvCache::new(layout.clone()).unwrap();
            many.set_copy_threads(threads);
            many.scatter(&region, packing, &packed).unwrap();
            let full = KvRegion::new(0..4, 0..4, 0..8, 0..256);
            let (mut a, mut b) =
                (vec![0u8; one.packed_len(&full) as usize], vec![1u8; one.packed_len(&full) as usize]);
            one.gather(&full, packing, &mut a).unwrap();
            many.gather(&full, packing, &mut b).unwrap();
            assert!(a == b, "{threads} threads");
        }
    }

    #[test]
    fn buffers_that_overlap_are_told_from_buffers_apart() {
        let mut memory = vec![0u8; 256];
        let base = memory.as_mut_ptr();
        // SAFETY: each view lies inside `memory`, which outlives them; nothing is read or
        // written through them.
        let view = |at: usize, len: usize| unsafe { HostBuffer::borrowed(base.add(at), len) }.unwrap();
        assert!(apart(&[view(128, 128), view(0, 128)]));
        assert!(!apart(&[view(0, 129), view(128, 128)]));
        assert!(!apart(&[view(64, 64), view(0, 256)]));
        assert!(!apart(&[view(0, 64), view(0, 64)]));
    }

    #[test]
    fn a_scatter_into_a_shared_block_writes_what_one_thread_would() {
        use crate::layout::{KvInterleave, PagedConfig, PagedOrder};
        let spec = KvSpec::new(2, 8, 128, DType::F16).unwrap();
        let cfg = PagedConfig {
            block_size: 16,
            num_blocks: 40,
            order: PagedOrder::Hnd,
            interleave: KvInterleave::Separate,
        };
        let paged = |tables: Vec<Vec<u32>>| {
            let mut cache = KvCache::new(KvLayout::paged(spec, 2, cfg, None).unwrap()).unwrap();
            for (slot, table) in tables.into_iter().enumerate() {
                cache.set_block_table(slot as u32, table).unwrap();
            }
            cache
        };
        // Slot 1's table repeats slot 0's blocks: its scatter overwrites what slot 0's wrote.
        let shared: Vec<u32> = (0..20).collect();
        let region = KvRegion::new(0..2, 0..2, 0..8, 0..320);
        let packing = Packing::token_major(&spec);
        let len = spec.bytes_per_token() as usize * 2 * 320;
        assert!(len as u64 >= PARALLEL_MIN_BYTES);
        let packed: Vec<u8> = (0..len).map(|i| (i.wrapping_mul(2_654_435_761) >> 9) as u8).collect();
        let one = paged(vec![shared.clone(), shared.clone()]);
        assert!(!one.layout().region_is_injective(&region));
        one.scatter(&region, packing, &packed).unwrap();
        let many = paged(vec![shared.clone(), shared]);
        many.set_copy_threads(2);
        many.scatter(&region, packing, &packed).unwrap();
        let slot = KvRegion::new(0..2, 0..1, 0..8, 0..320);
        let (mut a, mut b) = (vec![0u8; len / 2], vec![1u8; len / 2]);
        one.gather(&slot, packing, &mut a).unwrap();
        many.gather(&slot, packing, &mut b).unwrap();
        assert!(a == b, "the last slot's bytes win, as with one thread");
        // Distinct blocks: threads may split it.
        let apart = paged(vec![(0..20).collect(), (20..40).collect()]);
        assert!(apart.layout().region_is_injective(&region));
        assert!(apart.layout().region_is_injective(&KvRegion::new(0..2, 0..2, 0..8, 5..5)));
    }

    #[test]
    fn a_streamed_gather_hands_over_every_byte_in_order_whatever_the_piece() {
        let cache = filled_cache();
        let packing = cache.layout().preferred_packing();
        for region in [KvRegion::new(0..4, 0..4, 0..8, 0..200), KvRegion::new(1..3, 0..4, 2..8, 100..101)] {
            let plan = cache.gather_plan(&region, packing).unwrap();
            let len = cache.packed_len(&region) as usize;
            let mut expected = vec![0u8; len];
            cache.gather_with(&plan, &mut expected).unwrap();
            for (piece, threads) in
                [1, 4096, 64 << 10, usize::MAX].into_iter().flat_map(|p| [(p, 1), (p, 2), (p, 5)])
            {
                // Several threads finish groups out of order: the sink still sees them in order.
                cache.set_copy_threads(threads);
                let mut out = vec![0u8; len];
                let mut handed = Vec::new();
                let mut pieces = 0;
                let n = cache
                    .gather_streamed(&plan, &mut out, piece, |bytes| {
                        handed.extend_from_slice(bytes);
                        pieces += 1;
                        true
                    })
                    .unwrap();
                assert_eq!(n, len as u64);
                assert!(out == expected, "piece {piece}, {threads} threads: gathered");
                assert!(handed == expected, "piece {piece}, {threads} threads: handed over in order");
                if piece == usize::MAX {
                    assert_eq!(pieces, 1);
                } else if piece == 1 {
                    assert!(pieces > 1, "one piece per block");
                }
                // A sink that wants no more after the first piece still leaves `out` gathered.
                let mut out = vec![0u8; len];
                let mut calls = 0;
                cache
                    .gather_streamed(&plan, &mut out, piece, |_| {
                        calls += 1;
                        false
                    })
                    .unwrap();
                assert_eq!(calls, 1);
                assert!(out == expected, "piece {piece}, {threads} threads: gathered after the sink stopped");
            }
            cache.set_copy_threads(1);
            // Wrong lengths and another cache's plans are refused before anything moves.
            let mut short = vec![0u8; len - 1];
            assert!(cache.gather_streamed(&plan, &mut short, 4096, |_| true).is_err());
            let other = filled_cache();
            let mut out = vec![0u8; len];
            let foreign = other.gather_streamed(&plan, &mut out, 4096, |_| panic!("nothing is handed over"));
            assert!(matches!(foreign, Err(CacheError::ForeignPlan)), "{foreign:?}");
        }
    }

    #[test]
    fn impossible_allocations_and_overflowing_strides_are_errors() {
        use crate::layout::{BufferMap, PartMap, TokenMap};
        let spec = KvSpec::new(1, 1, 4, DType::F32).unwrap();
        let map = |offset, stride| PartMap {
            buffer: BufferMap::Shared { buffer: 0, layer_stride: 0 },
            offset,
            slot_stride: 0,
            head_stride: 0,
            tokens: TokenMap::Linear { stride },
            chunk_elems: 4,
            chunk_stride: 0,
        };
        let huge = 1u64 << 50;
        let layout =
            KvLayout::strided(spec, 1, 2, &[(Part::K, map(0, 16)), (Part::V, map(32, 16))], vec![huge])
                .unwrap();
        assert!(matches!(KvCache::new(layout), Err(CacheError::OutOfMemory(n)) if n == huge));
        let wraps = KvLayout::strided(
            spec,
            1,
            3,
            &[(Part::K, map(0, u64::MAX / 2)), (Part::V, map(0, 16))],
            vec![64],
        );
        assert!(matches!(wraps, Err(LayoutError::Invalid(_))), "{wraps:?}");
    }

    #[test]
    fn a_plan_only_runs_on_the_cache_that_made_it() {
        let a = filled_cache();
        let b = filled_cache();
        let region = KvRegion::new(0..1, 0..1, 0..1, 0..4);
        let plan = a.gather_plan(&region, a.layout().preferred_packing()).unwrap();
        let mut out = vec![0u8; a.packed_len(&region) as usize];
        assert_eq!(b.gather_with(&plan, &mut out), Err(CacheError::ForeignPlan));
        assert_eq!(a.gather_with(&plan, &mut out), Ok(out.len() as u64));
        let mut short = vec![0u8; out.len() - 1];
        assert!(matches!(a.gather_with(&plan, &mut short), Err(CacheError::WrongLength { .. })));
    }

    #[test]
    fn a_paged_cache_grows_and_old_plans_are_refused() {
        use crate::layout::{KvInterleave, PagedConfig, PagedOrder};
        let spec = KvSpec::new(1, 2, 8, DType::F16).unwrap();
        let cfg = PagedConfig {
            block_size: 4,
            num_blocks: 4,
            order: PagedOrder::Nhd,
            interleave: KvInterleave::Separate,
        };
        let mut cache = KvCache::new(KvLayout::paged(spec, 1, cfg, None).unwrap()).unwrap();
        let short = KvRegion::new(0..1, 0..1, 0..2, 0..4);
        assert!(matches!(cache.gather_plan(&short, Packing::token_major(&spec)), Err(CacheError::Layout(_))));
        cache.set_block_table(0, vec![2]).unwrap();
        let plan = cache.gather_plan(&short, Packing::token_major(&spec)).unwrap();
        cache.set_block_table(0, vec![2, 0]).unwrap();
        let mut out = vec![0u8; cache.packed_len(&short) as usize];
        assert_eq!(cache.gather_with(&plan, &mut out), Err(CacheError::ForeignPlan));
        let longer = KvRegion::new(0..1, 0..1, 0..2, 0..8);
        let mut out = vec![0u8; cache.packed_len(&longer) as usize];
        cache.gather(&longer, Packing::token_major(&spec), &mut out).unwrap();
        assert!(matches!(
            cache.set_block_table(0, vec![4]),
            Err(CacheError::Layout(LayoutError::BadBlock { .. }))
        ));
    }

    #[test]
    fn region_errors_come_before_length_errors() {
        let cache = filled_cache();
        #[allow(clippy::reversed_empty_ranges)] // the inverted range is the point of the test
        let inverted = KvRegion::new(0..1, 0..1, 0..1, 5..3);
        let err = cache.gather(&inverted, cache.layout().preferred_packing(), &mut []).unwrap_err();
        assert!(matches!(err, CacheError::Layout(LayoutError::OutOfBounds { axis: "token", .. })));
    }
}
