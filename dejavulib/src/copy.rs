//! The CPU copy engine: executes [`CopyPlan`]s over host memory.
//!
//! It is the reference for every other engine (a CUDA engine runs the same plans as kernels). Each
//! block is bounds-checked against the buffers before any byte moves, so a bad plan is a typed
//! error, never an out-of-bounds access or a partial copy.

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
    for block in plan.blocks() {
        check_block(block, src, dst)?;
    }
    for block in plan.blocks() {
        let s = src[block.src_buffer as usize].ptr;
        let d = dst[block.dst_buffer as usize].ptr;
        // SAFETY: check_block proved every run of the block lies inside both buffers (safety 1),
        // and the caller guarantees exclusivity (safety 2).
        unsafe {
            let (s, d) = (s.add(block.src_offset as usize), d.add(block.dst_offset as usize));
            if block.run <= SMALL_RUN && block.runs() > PREFETCH_AHEAD as u64 {
                walk_small_runs(s, d, block.axes(), block.run as usize)
            } else {
                walk(s, d, block.axes(), block.run as usize)
            }
        };
    }
    Ok(plan.bytes())
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
/// How many runs ahead to prefetch: enough misses in flight to cover DRAM latency.
const PREFETCH_AHEAD: usize = 32;

/// A position in a block's loop nest, advanced like an odometer.
struct Cursor<'a> {
    axes: &'a [Axis],
    index: [u64; crate::plan::MAX_AXES],
    src: usize,
    dst: usize,
}

impl<'a> Cursor<'a> {
    fn new(axes: &'a [Axis]) -> Self {
        Self { axes, index: [0; crate::plan::MAX_AXES], src: 0, dst: 0 }
    }

    /// Moves to the next run; false after the last.
    #[inline(always)]
    fn advance(&mut self) -> bool {
        for level in (0..self.axes.len()).rev() {
            let a = &self.axes[level];
            if self.index[level] + 1 < a.count {
                self.index[level] += 1;
                self.src += a.src_stride as usize;
                self.dst += a.dst_stride as usize;
                return true;
            }
            self.src -= (a.count - 1) as usize * a.src_stride as usize;
            self.dst -= (a.count - 1) as usize * a.dst_stride as usize;
            self.index[level] = 0;
        }
        false
    }
}

/// Copies a nest of small runs in one flat loop, prefetching the source `PREFETCH_AHEAD` runs
/// ahead so that many cache misses are in flight at once (a decode step's K pieces are each in a
/// different cache line, 16 KiB apart).
///
/// # Safety
/// Every run of the nest rooted at (`src`, `dst`) is valid to read and write.
unsafe fn walk_small_runs(src: *const u8, dst: *mut u8, axes: &[Axis], run: usize) {
    let mut ahead = Cursor::new(axes);
    let mut more_ahead = true;
    for _ in 0..PREFETCH_AHEAD {
        more_ahead = more_ahead && ahead.advance();
    }
    let mut at = Cursor::new(axes);
    loop {
        if more_ahead {
            prefetch(src.wrapping_add(ahead.src));
            more_ahead = ahead.advance();
        }
        // SAFETY: the cursor stays on runs of the nest, valid per the contract.
        unsafe { copy_strided(src.add(at.src), dst.add(at.dst), 1, 0, 0, run) };
        if !at.advance() {
            break;
        }
    }
}

#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; it never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// # Safety
/// Every run of the nest rooted at (`src`, `dst`) is valid to read and write.
unsafe fn walk(src: *const u8, dst: *mut u8, axes: &[Axis], run: usize) {
    match axes {
        [] => {
            // SAFETY: one run, valid per this function's contract.
            unsafe { copy_strided(src, dst, 1, 0, 0, run) }
        }
        [last] => {
            // SAFETY: the innermost loop's runs are valid per the contract.
            unsafe {
                copy_strided(
                    src,
                    dst,
                    last.count as usize,
                    last.src_stride as usize,
                    last.dst_stride as usize,
                    run,
                )
            }
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
                    )
                }
            }
        }
    }
}

/// Copies `count` runs of `run` bytes, advancing by the strides. Small runs (FasterTransformer's
/// 16-byte K pieces) use fixed-size moves instead of a `memcpy` call each.
///
/// # Safety
/// Every run is valid to read at `src + i * src_stride` and write at `dst + i * dst_stride`, and the
/// two never overlap.
#[inline]
unsafe fn copy_strided(src: *const u8, dst: *mut u8, count: usize, ss: usize, ds: usize, run: usize) {
    macro_rules! fixed {
        ($ty:ty) => {
            for i in 0..count {
                // SAFETY: the run is valid per the contract; unaligned access is allowed.
                unsafe {
                    let v = std::ptr::read_unaligned(src.add(i * ss) as *const $ty);
                    std::ptr::write_unaligned(dst.add(i * ds) as *mut $ty, v);
                }
            }
        };
    }
    match run {
        4 => fixed!(u32),
        8 => fixed!(u64),
        16 => fixed!(u128),
        32 => fixed!([u128; 2]),
        64 => fixed!([u128; 4]),
        _ => {
            for i in 0..count {
                // SAFETY: the run is valid and non-overlapping per the contract.
                unsafe { std::ptr::copy_nonoverlapping(src.add(i * ss), dst.add(i * ds), run) }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::KvLayout;
    use crate::plan::{plan_copy, Order};
    use crate::region::{Coord, Shape};
    use crate::spec::{DType, KvSpec};

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
