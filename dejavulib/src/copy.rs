//! The CPU copy engine: executes [`CopyPlan`]s over host memory.
//!
//! It is the reference for every other engine (a CUDA engine runs the same plans as kernels). Each
//! block is bounds-checked against the buffers before any byte moves, so a bad plan is a typed
//! error, never an out-of-bounds access or a partial copy.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use thiserror::Error;

use crate::plan::{Axis, CopyBlock, CopyPlan};

/// Errors executing a copy plan.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum CopyError {
    /// A block names a buffer that was not supplied.
    #[error("{side} buffer {index} missing: {count} supplied")]
    MissingBuffer {
        /// "source" or "destination".
        side: &'static str,
        /// Buffer index named by the plan.
        index: u32,
        /// Buffers supplied.
        count: usize,
    },
    /// A block reaches past the end of a buffer.
    #[error("{side} buffer {index} holds {len} bytes, plan reaches byte {needed}")]
    OutOfBounds {
        /// "source" or "destination".
        side: &'static str,
        /// Buffer index.
        index: u32,
        /// Bytes the plan needs.
        needed: u64,
        /// Bytes the buffer has.
        len: u64,
    },
}

/// A source buffer as a raw pointer and a length.
#[derive(Clone, Copy, Debug)]
pub struct RawSrc {
    /// First byte.
    pub ptr: *const u8,
    /// Length in bytes.
    pub len: usize,
}

/// A destination buffer as a raw pointer and a length.
#[derive(Clone, Copy, Debug)]
pub struct RawDst {
    /// First byte.
    pub ptr: *mut u8,
    /// Length in bytes.
    pub len: usize,
}

impl From<&[u8]> for RawSrc {
    fn from(s: &[u8]) -> Self {
        Self { ptr: s.as_ptr(), len: s.len() }
    }
}

impl From<&mut [u8]> for RawDst {
    fn from(s: &mut [u8]) -> Self {
        Self { ptr: s.as_mut_ptr(), len: s.len() }
    }
}

/// Copies `plan` from `src` buffers into `dst` buffers. Returns the bytes copied.
pub fn execute(plan: &CopyPlan, src: &[&[u8]], dst: &mut [&mut [u8]]) -> Result<u64, CopyError> {
    let src: Vec<RawSrc> = src.iter().map(|s| RawSrc::from(*s)).collect();
    let dst: Vec<RawDst> = dst.iter_mut().map(|d| RawDst::from(&mut **d)).collect();
    // SAFETY: the slices are valid for their lengths for this call; `src` is borrowed shared and
    // `dst` exclusively, so no destination byte is read or written elsewhere meanwhile.
    unsafe { execute_raw(plan, &src, &dst) }
}

/// Copies `plan` between raw buffers. Returns the bytes copied.
///
/// # Safety
/// 1. Each `src[i]` is valid for reads of `len` bytes and each `dst[i]` for writes of `len` bytes.
/// 2. No byte the plan writes is read or written by anyone else during the call, and no
///    destination byte the plan writes lies in a source range the plan reads.
pub unsafe fn execute_raw(plan: &CopyPlan, src: &[RawSrc], dst: &[RawDst]) -> Result<u64, CopyError> {
    // SAFETY: forwarded contract; one thread needs no disjointness between blocks.
    unsafe { execute_raw_parallel(plan, src, dst, 1) }
}

/// Plans smaller than this run on the calling thread: spawning costs more than it saves.
pub const PARALLEL_MIN_BYTES: u64 = 1 << 20;

/// Like [`execute_raw`], splitting the blocks over up to `threads` threads (the caller's included).
///
/// A scattered gather (a decode step's 16-byte pieces, each in its own cache line) is bound by how
/// many cache misses one core keeps in flight; more cores keep more in flight.
///
/// # Safety
/// The conditions of [`execute_raw`], and: 3. no two blocks of the plan write the same byte (true
/// of every plan whose destination is a packed buffer or an injective layout).
pub unsafe fn execute_raw_parallel(
    plan: &CopyPlan,
    src: &[RawSrc],
    dst: &[RawDst],
    threads: usize,
) -> Result<u64, CopyError> {
    for block in plan.blocks() {
        check_block(block, src, dst)?;
    }
    let threads = threads.clamp(1, plan.blocks().len().max(1));
    let stores = Stores::for_bytes(plan.bytes());
    if threads == 1 || plan.bytes() < PARALLEL_MIN_BYTES {
        // SAFETY: every block was checked against the buffers (safety 1); the caller guarantees
        // exclusivity (safety 2).
        unsafe { run_blocks(plan.blocks(), src, dst, stores) };
        return Ok(plan.bytes());
    }
    let groups = split_by_bytes(plan.blocks(), threads);
    let shared = SharedBuffers { src, dst };
    std::thread::scope(|scope| {
        let (last, rest) = groups.split_last().expect("at least one group");
        for group in rest {
            let shared = &shared;
            // SAFETY: blocks were checked (safety 1); groups write disjoint bytes (safety 3) that
            // nobody else touches (safety 2), and the scope joins every thread before returning.
            scope.spawn(move || unsafe { run_blocks(group, shared.src, shared.dst, stores) });
        }
        // SAFETY: as above, for the caller's own share.
        unsafe { run_blocks(last, src, dst, stores) };
    });
    Ok(plan.bytes())
}

/// Checks every block of `plan` against the buffers, before any byte moves: what
/// [`run_groups`] needs.
pub(crate) fn check_plan(plan: &CopyPlan, src: &[RawSrc], dst: &[RawDst]) -> Result<(), CopyError> {
    plan.blocks().iter().try_for_each(|block| check_block(block, src, dst))
}

/// Runs `groups` (from [`ordered_groups`]) on up to `threads` threads, the caller's included,
/// each thread taking the first group no thread has taken yet, so that the groups finish about in
/// order. `done(i)` is called on the thread that ran group `i`, once its bytes are written.
///
/// # Safety
/// 1. The groups' blocks were checked against `src` and `dst` with [`check_plan`].
/// 2. The bytes the blocks read are not written by anyone during the call.
/// 3. No two blocks write the same byte, and the bytes of group `i`'s range are neither read nor
///    written by anyone else until `done(i)` is called (afterwards they may be read: no block
///    writes them again).
pub(crate) unsafe fn run_groups(
    groups: &[(Range<u64>, &[CopyBlock])],
    src: &[RawSrc],
    dst: &[RawDst],
    threads: usize,
    done: &(impl Fn(usize) + Sync),
) {
    let threads = threads.clamp(1, groups.len().max(1));
    let shared = SharedBuffers { src, dst };
    let next = AtomicUsize::new(0);
    let work = || {
        // The whole table, not its fields: the table is what may be shared between threads.
        let SharedBuffers { src, dst } = &shared;
        loop {
            let group = next.fetch_add(1, Ordering::Relaxed);
            let Some((_, blocks)) = groups.get(group) else { return };
            // SAFETY: checked blocks (forwarded contract); each group is taken by one thread, and
            // blocks write disjoint bytes, so no two threads write the same byte. Each group is
            // handed on as soon as it is written, to be read while in cache: cached stores.
            unsafe { run_blocks(blocks, src, dst, Stores::Cached) };
            done(group);
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(work);
        }
        work();
    });
}

/// The blocks of `plan`, which all write destination buffer 0 of `len` bytes, in consecutive
/// groups of about `piece` bytes each, with the range of the destination each group finishes:
/// the ranges follow one another and cover `0..len` (a group's range holds every byte its blocks
/// write and none that a later group writes). `None` when the blocks do not write the
/// destination in order, one after another.
pub(crate) fn ordered_groups(
    plan: &CopyPlan,
    len: u64,
    piece: u64,
) -> Option<Vec<(Range<u64>, &[CopyBlock])>> {
    let blocks = plan.blocks();
    let mut groups = Vec::new();
    let (mut group_start, mut range_start, mut written, mut bytes) = (0, 0, 0u64, 0u64);
    for (i, block) in blocks.iter().enumerate() {
        let end = block.dst_end()?;
        if block.dst_buffer != 0 || block.dst_offset < written || end > len {
            return None;
        }
        written = end;
        bytes += block.bytes();
        if bytes >= piece.max(1) {
            groups.push((range_start..written, &blocks[group_start..=i]));
            (group_start, range_start, bytes) = (i + 1, written, 0);
        }
    }
    if group_start < blocks.len() || groups.is_empty() {
        groups.push((range_start..len, &blocks[group_start..]));
    } else if let Some((last, _)) = groups.last_mut() {
        last.end = len;
    }
    Some(groups)
}

/// Buffer tables handed to copy threads.
struct SharedBuffers<'a> {
    src: &'a [RawSrc],
    dst: &'a [RawDst],
}

// SAFETY: the raw pointers are only dereferenced under the contract of `execute_raw_parallel`,
// which makes the bytes each thread writes its own and the bytes it reads stable.
unsafe impl Sync for SharedBuffers<'_> {}

/// Contiguous groups of blocks with about equal bytes each.
fn split_by_bytes(blocks: &[CopyBlock], groups: usize) -> Vec<&[CopyBlock]> {
    let total: u64 = blocks.iter().map(CopyBlock::bytes).sum();
    let share = total.div_ceil(groups as u64).max(1);
    let mut out = Vec::with_capacity(groups);
    let (mut start, mut acc) = (0, 0);
    for (i, block) in blocks.iter().enumerate() {
        acc += block.bytes();
        if acc >= share && out.len() + 1 < groups {
            out.push(&blocks[start..=i]);
            start = i + 1;
            acc = 0;
        }
    }
    if start < blocks.len() || out.is_empty() {
        out.push(&blocks[start..]);
    }
    out
}

/// How a copy's large runs are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stores {
    /// Through the cache, as `memcpy` does: what is written next is read soon.
    Cached,
    /// Around the cache (non-temporal stores), for a copy far larger than the last-level cache: its
    /// first bytes are out of the cache before anyone reads them, and an ordinary store first reads
    /// each destination line from memory, a third of the traffic for nothing.
    Streaming,
}

/// Copies of this many bytes or more stream their large runs around the cache.
pub const STREAMING_FROM: u64 = 64 << 20;

/// Runs shorter than this are stored through the cache even in a streaming copy: the aligned head
/// and tail would be most of them.
const STREAMING_MIN_RUN: usize = 1024;

impl Stores {
    fn for_bytes(bytes: u64) -> Self {
        if bytes >= STREAMING_FROM && cfg!(target_arch = "x86_64") {
            Stores::Streaming
        } else {
            Stores::Cached
        }
    }
}

/// # Safety
/// Every block was checked against `src` and `dst` with [`check_block`], and the bytes it writes
/// are this caller's alone.
unsafe fn run_blocks(blocks: &[CopyBlock], src: &[RawSrc], dst: &[RawDst], stores: Stores) {
    for (i, block) in blocks.iter().enumerate() {
        // The next block's first runs are not covered by its own prefetch cursor: warm them now.
        if let Some(next) = blocks.get(i + 1).filter(|b| b.run <= SMALL_RUN) {
            prefetch_first_runs(next, src[next.src_buffer as usize].ptr);
        }
        let s = src[block.src_buffer as usize].ptr;
        let d = dst[block.dst_buffer as usize].ptr;
        // SAFETY: the block lies inside both buffers (checked), and its bytes are ours.
        unsafe {
            let (s, d) = (s.add(block.src_offset as usize), d.add(block.dst_offset as usize));
            if block.run <= SMALL_RUN {
                walk_small_runs(s, d, block.axes(), block.run as usize)
            } else {
                walk(s, d, block.axes(), block.run as usize, stores)
            }
        };
    }
    if stores == Stores::Streaming {
        // Non-temporal stores are not ordered with the release that publishes the copy (a
        // thread's end, a channel's send): fence them first.
        fence_streaming_stores();
    }
}

fn check_block(block: &CopyBlock, src: &[RawSrc], dst: &[RawDst]) -> Result<(), CopyError> {
    let src_len = src
        .get(block.src_buffer as usize)
        .ok_or(CopyError::MissingBuffer { side: "source", index: block.src_buffer, count: src.len() })?
        .len as u64;
    let dst_len = dst
        .get(block.dst_buffer as usize)
        .ok_or(CopyError::MissingBuffer { side: "destination", index: block.dst_buffer, count: dst.len() })?
        .len as u64;
    let src_end = block.src_end().unwrap_or(u64::MAX);
    if src_end > src_len {
        return Err(CopyError::OutOfBounds {
            side: "source",
            index: block.src_buffer,
            needed: src_end,
            len: src_len,
        });
    }
    let dst_end = block.dst_end().unwrap_or(u64::MAX);
    if dst_end > dst_len {
        return Err(CopyError::OutOfBounds {
            side: "destination",
            index: block.dst_buffer,
            needed: dst_end,
            len: dst_len,
        });
    }
    Ok(())
}

/// Runs up to this size are latency-bound (one cache miss each): they get software prefetching.
const SMALL_RUN: u64 = 256;
/// How many runs ahead to prefetch: enough misses in flight to cover DRAM latency (tuned on the
/// FasterTransformer decode step; 16..96 all help, 64 was best).
const PREFETCH_AHEAD: usize = 64;

/// Copies a nest of small runs, prefetching the source `PREFETCH_AHEAD` runs ahead so that many
/// cache misses are in flight at once (a decode step's K pieces are each in a different cache line,
/// 16 KiB apart). The run size is matched once per block, not once per run.
///
/// # Safety
/// Every run of the nest rooted at (`src`, `dst`) is valid to read and write.
unsafe fn walk_small_runs(src: *const u8, dst: *mut u8, axes: &[Axis], run: usize) {
    // SAFETY: forwarded contract; in every arm the mover moves exactly `run` bytes.
    unsafe {
        match run {
            4 => walk_rows(src, dst, axes, run, &Fixed::<u32>::new()),
            8 => walk_rows(src, dst, axes, run, &Fixed::<u64>::new()),
            16 => walk_rows(src, dst, axes, run, &Fixed::<u128>::new()),
            32 => walk_rows(src, dst, axes, run, &Fixed::<[u128; 2]>::new()),
            64 => walk_rows(src, dst, axes, run, &Fixed::<[u128; 4]>::new()),
            _ => walk_rows(src, dst, axes, run, &Bytes(run)),
        }
    }
}

/// Moves one run of a fixed length.
trait MoveRun {
    /// Copies the run at `src` to `dst`.
    ///
    /// # Safety
    /// 1. `src` is valid for reads and `dst` for writes of the run's length.
    /// 2. The two ranges do not overlap.
    unsafe fn move_run(&self, src: *const u8, dst: *mut u8);
}

/// A run the size of `T`, moved as one unaligned load and store.
struct Fixed<T>(std::marker::PhantomData<T>);

impl<T> Fixed<T> {
    fn new() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<T: Copy> MoveRun for Fixed<T> {
    #[inline(always)]
    unsafe fn move_run(&self, src: *const u8, dst: *mut u8) {
        // SAFETY: both ranges hold size_of::<T>() valid bytes (contract 1); unaligned access is
        // allowed for any T: Copy.
        unsafe { std::ptr::write_unaligned(dst as *mut T, std::ptr::read_unaligned(src as *const T)) }
    }
}

/// A run of any length, moved with `memcpy`.
struct Bytes(usize);

impl MoveRun for Bytes {
    #[inline(always)]
    unsafe fn move_run(&self, src: *const u8, dst: *mut u8) {
        // SAFETY: contracts 1 and 2 of `move_run` are those of `copy_nonoverlapping`.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, self.0) }
    }
}

/// Peels outer axes until two remain, then runs [`rows`].
///
/// # Safety
/// Every run of the nest is valid to read and write, runs never overlap their destinations, and
/// `copy` moves exactly `run` bytes.
unsafe fn walk_rows(src: *const u8, dst: *mut u8, axes: &[Axis], run: usize, copy: &impl MoveRun) {
    let one = Axis { count: 1, src_stride: 0, dst_stride: 0 };
    match axes {
        // SAFETY: the single run is valid (forwarded contract).
        [] => unsafe { copy.move_run(src, dst) },
        // SAFETY: forwarded contract.
        [row] => unsafe { rows(src, dst, &one, row, run, copy) },
        // SAFETY: forwarded contract.
        [outer, row] => unsafe { rows(src, dst, outer, row, run, copy) },
        [first, rest @ ..] => {
            for i in 0..first.count as usize {
                // SAFETY: offsets stay within the nest the caller vouched for.
                unsafe {
                    walk_rows(
                        src.add(i * first.src_stride as usize),
                        dst.add(i * first.dst_stride as usize),
                        rest,
                        run,
                        copy,
                    )
                }
            }
        }
    }
}

/// Two nested loops of runs, with a prefetch cursor running `PREFETCH_AHEAD` runs ahead.
///
/// # Safety
/// Every run of the nest is valid to read and write, runs never overlap their destinations, and
/// `copy` moves exactly `run` bytes.
#[inline(always)]
unsafe fn rows(src: *const u8, dst: *mut u8, outer: &Axis, row: &Axis, run: usize, copy: &impl MoveRun) {
    let (n0, s0, d0) = (outer.count as usize, outer.src_stride as usize, outer.dst_stride as usize);
    let (n1, s1, d1) = (row.count as usize, row.src_stride as usize, row.dst_stride as usize);
    // The prefetch cursor (pi, pj) starts PREFETCH_AHEAD runs in; it only computes addresses.
    let (mut pi, mut pj) = (PREFETCH_AHEAD / n1, PREFETCH_AHEAD % n1);
    let mut ahead = src.wrapping_add(pi * s0 + pj * s1);
    for i in 0..n0 {
        // SAFETY: row i lies within the nest.
        let (s, d) = unsafe { (src.add(i * s0), dst.add(i * d0)) };
        for j in 0..n1 {
            if pi < n0 {
                prefetch_run(ahead, run);
                pj += 1;
                if pj == n1 {
                    pj = 0;
                    pi += 1;
                    ahead = src.wrapping_add(pi * s0);
                } else {
                    ahead = ahead.wrapping_add(s1);
                }
            }
            // SAFETY: run (i, j) lies within the nest (forwarded contract).
            unsafe { copy.move_run(s.add(j * s1), d.add(j * d1)) };
        }
    }
}

/// Prefetches the source lines of the first `PREFETCH_AHEAD` runs of `block` in `src`.
fn prefetch_first_runs(block: &CopyBlock, src: *const u8) {
    let base = src.wrapping_add(block.src_offset as usize);
    let (outer, row) = match block.axes() {
        [] => (None, None),
        [row] => (None, Some(row)),
        [.., outer, row] => (Some(outer), Some(row)),
    };
    let n1 = row.map_or(1, |r| r.count as usize);
    let n0 = outer.map_or(1, |o| o.count as usize);
    let (s0, s1) = (outer.map_or(0, |o| o.src_stride as usize), row.map_or(0, |r| r.src_stride as usize));
    for k in 0..PREFETCH_AHEAD.min(n0 * n1) {
        prefetch_run(base.wrapping_add((k / n1) * s0 + (k % n1) * s1), block.run as usize);
    }
}

/// Prefetches every cache line of a run of `len` bytes at `p`.
#[inline(always)]
fn prefetch_run(p: *const u8, len: usize) {
    if len == 0 {
        return;
    }
    let mut off = 0;
    while off < len {
        prefetch(p.wrapping_add(off));
        off += 64;
    }
    prefetch(p.wrapping_add(len - 1));
}

/// Prefetches one line into L2, not L1: KV layouts have power-of-two strides (FasterTransformer's K
/// pieces are `max_tokens * 16` bytes apart), so dozens of lines in flight map to one L1 set and
/// would evict each other before use.
#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; it never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// # Safety
/// Every run of the nest rooted at (`src`, `dst`) is valid to read and write.
unsafe fn walk(src: *const u8, dst: *mut u8, axes: &[Axis], run: usize, stores: Stores) {
    match axes {
        [] => {
            // SAFETY: one run, valid per this function's contract.
            unsafe { copy_strided(src, dst, (1, 0, 0), run, stores) }
        }
        [last] => {
            let strides = (last.count as usize, last.src_stride as usize, last.dst_stride as usize);
            // SAFETY: the innermost loop's runs are valid per the contract.
            unsafe { copy_strided(src, dst, strides, run, stores) }
        }
        [outer, rest @ ..] => {
            for i in 0..outer.count as usize {
                // SAFETY: offsets stay within the nest the caller vouched for.
                unsafe {
                    walk(
                        src.add(i * outer.src_stride as usize),
                        dst.add(i * outer.dst_stride as usize),
                        rest,
                        run,
                        stores,
                    )
                }
            }
        }
    }
}

/// Copies `count` runs of `run` bytes, advancing by the strides: the path for large runs, where a
/// `memcpy` per run is the fastest move (small runs go through [`walk_small_runs`]).
///
/// # Safety
/// Every run is valid to read at `src + i * src_stride` and write at `dst + i * dst_stride`, and the
/// two never overlap.
#[inline]
unsafe fn copy_strided(
    src: *const u8,
    dst: *mut u8,
    (count, ss, ds): (usize, usize, usize),
    run: usize,
    stores: Stores,
) {
    let streaming = stores == Stores::Streaming && run >= STREAMING_MIN_RUN;
    for i in 0..count {
        let (s, d) = (src.wrapping_add(i * ss), dst.wrapping_add(i * ds));
        if streaming {
            // SAFETY: the run is valid and non-overlapping per the contract.
            unsafe { copy_streaming(s, d, run) }
        } else {
            // SAFETY: as above.
            unsafe { std::ptr::copy_nonoverlapping(s, d, run) }
        }
    }
}

/// Copies `len` bytes from `src` to `dst` with non-temporal stores where the destination is
/// 16-byte aligned (ordinary ones for the unaligned head and the tail). The caller fences them
/// ([`fence_streaming_stores`]) before the copy is published.
///
/// # Safety
/// `src` is valid for reads and `dst` for writes of `len` bytes, and the two do not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn copy_streaming(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    const LANE: usize = 16;
    const STEP: usize = 4 * LANE;
    let head = dst.align_offset(LANE).min(len);
    // SAFETY: the first `head` bytes of both ranges are valid per the contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let mut done = head;
    while len - done >= STEP {
        // SAFETY: `done + STEP <= len`, so the 64 bytes read and written are in the ranges; `dst +
        // done` is 16-byte aligned (the head brought it there, and steps keep it), as
        // `_mm_stream_si128` needs; SSE2, which these use, is part of every x86-64 CPU.
        unsafe {
            let (s, d) = (src.add(done), dst.add(done));
            let lanes = [0, 1, 2, 3].map(|i| _mm_loadu_si128(s.add(i * LANE).cast::<__m128i>()));
            for (i, lane) in lanes.into_iter().enumerate() {
                _mm_stream_si128(d.add(i * LANE).cast::<__m128i>(), lane);
            }
        }
        done += STEP;
    }
    // SAFETY: the tail, `done..len`, is in both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done) };
}

/// Elsewhere a streaming copy is an ordinary one.
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`].
#[cfg(not(target_arch = "x86_64"))]
unsafe fn copy_streaming(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: forwarded contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// Copies `src` into `dst` (of the same length) as a copy of [`STREAMING_FROM`] bytes or more
/// stores its large runs: around the cache, on x86-64. What a gather far larger than the cache is
/// held to, beside `memcpy`.
///
/// # Panics
/// If the lengths differ.
pub fn copy_around_cache(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "a copy around the cache between slices of different lengths");
    // SAFETY: both slices are valid for their common length, and a `&mut` cannot overlap a `&`.
    unsafe { copy_streaming(src.as_ptr(), dst.as_mut_ptr(), src.len()) };
    fence_streaming_stores();
}

/// Orders the calling thread's non-temporal stores before its later stores.
fn fence_streaming_stores() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no preconditions; SSE, which it belongs to, is part of every x86-64 CPU.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::KvLayout;
    use crate::plan::{plan_copy, Order};
    use crate::region::{Coord, Shape};
    use crate::spec::{DType, KvSpec};

    #[test]
    fn a_streaming_copy_moves_every_byte_at_any_alignment_and_length() {
        let src: Vec<u8> = (0..6000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        for offset in 0..17 {
            for len in [0, 1, 15, 16, 63, 64, 65, 127, 1000, 4096, 5000] {
                let mut dst = vec![0u8; 6100];
                // SAFETY: both ranges are inside their vectors, which do not overlap.
                unsafe { copy_streaming(src.as_ptr().add(3), dst.as_mut_ptr().add(offset), len) };
                fence_streaming_stores();
                assert_eq!(&dst[offset..offset + len], &src[3..3 + len], "offset {offset}, {len} bytes");
                assert!(dst[..offset].iter().chain(&dst[offset + len..]).all(|&b| b == 0));
            }
        }
    }

    #[test]
    fn a_gather_larger_than_the_streaming_threshold_is_exact() {
        // Runs of 16 KiB from a strided source, 72 MiB in all: the streaming stores' path.
        let spec = KvSpec::new(9, 16, 8, DType::F16).unwrap();
        let layout = KvLayout::faster_transformer(spec, 2, 16 * 1024).unwrap();
        let shape = Shape { layers: 9, slots: 1, heads: 16, tokens: 16 * 1024 };
        let packed = KvLayout::packed(&spec, shape, layout.preferred_packing()).unwrap();
        let plan =
            plan_copy(&layout, Coord::default(), &packed, Coord::default(), shape, Order::Src).unwrap();
        assert!(plan.bytes() >= STREAMING_FROM);
        assert_eq!(Stores::for_bytes(plan.bytes()) == Stores::Streaming, cfg!(target_arch = "x86_64"));
        let sources: Vec<Vec<u8>> = layout
            .buffer_sizes()
            .iter()
            .enumerate()
            .map(|(b, &n)| (0..n).map(|i| (i * 13 + i / 4099 + b as u64) as u8).collect())
            .collect();
        let src: Vec<&[u8]> = sources.iter().map(Vec::as_slice).collect();
        let mut streamed = vec![0u8; plan.bytes() as usize];
        let mut cached = vec![0u8; plan.bytes() as usize];
        execute(&plan, &src, &mut [&mut streamed]).unwrap();
        // The same plan, block by block through the cache, for the reference.
        let raw_src: Vec<RawSrc> = src.iter().map(|s| RawSrc::from(*s)).collect();
        let raw_dst = [RawDst::from(&mut cached[..])];
        // SAFETY: the blocks were checked by the `execute` above against buffers of these sizes.
        unsafe { run_blocks(plan.blocks(), &raw_src, &raw_dst, Stores::Cached) };
        assert!(streamed == cached, "the streaming copy differs from the cached one");
    }

    #[test]
    fn short_buffers_are_rejected_before_copying() {
        let spec = KvSpec::new(1, 1, 8, DType::F16).unwrap();
        let layout = KvLayout::faster_transformer(spec, 1, 4).unwrap();
        let shape = Shape { layers: 1, slots: 1, heads: 1, tokens: 4 };
        let packed = KvLayout::packed(&spec, shape, layout.preferred_packing()).unwrap();
        let plan =
            plan_copy(&layout, Coord::default(), &packed, Coord::default(), shape, Order::Src).unwrap();
        let k = vec![1u8; 64];
        let v = vec![2u8; 63];
        let mut out = vec![0u8; 128];
        let err = execute(&plan, &[&k, &v], &mut [&mut out]).unwrap_err();
        assert!(matches!(err, CopyError::OutOfBounds { side: "source", index: 1, .. }));
        assert!(out.iter().all(|&b| b == 0), "nothing copied on error");
        let err = execute(&plan, &[&k], &mut [&mut out]).unwrap_err();
        assert!(matches!(err, CopyError::MissingBuffer { side: "source", index: 1, .. }));
    }
}
