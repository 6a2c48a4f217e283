//! Copy plans: a region copy between two layouts, as a few nested strided loops of contiguous runs.
//!
//! [`plan_copy`] walks the region once per (layer, part, slot, linear token segment) and describes
//! the rest (heads, tokens, chunks of a head vector) as strided axes. Axes that are contiguous on both
//! sides collapse into longer runs, so a whole-prompt region of a contiguous layout becomes a few large
//! runs while a decode step of FasterTransformer's K cache stays one 16-byte run per chunk. Copy engines
//! execute plans; the plan itself is pure data (a GPU kernel takes the same description).

use crate::layout::{KvLayout, LayoutError};
use crate::region::{Coord, KvRegion, Shape};
use crate::spec::Part;

/// Most strided axes a block can have (heads, tokens, two for chunk re-tiling).
pub const MAX_AXES: usize = 4;

/// One strided loop: `count` iterations, advancing both sides by their stride.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Axis {
    /// Iterations.
    pub count: u64,
    /// Source bytes per iteration.
    pub src_stride: u64,
    /// Destination bytes per iteration.
    pub dst_stride: u64,
}

/// Nested loops of equal-length contiguous runs between one source and one destination buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyBlock {
    /// Source buffer index.
    pub src_buffer: u32,
    /// Destination buffer index.
    pub dst_buffer: u32,
    /// Source offset of the first run.
    pub src_offset: u64,
    /// Destination offset of the first run.
    pub dst_offset: u64,
    /// Bytes of each contiguous run.
    pub run: u64,
    axes: [Axis; MAX_AXES],
    depth: u8,
}

impl CopyBlock {
    /// The loops, outermost first.
    pub fn axes(&self) -> &[Axis] {
        &self.axes[..self.depth as usize]
    }

    /// Runs in the block.
    pub fn runs(&self) -> u64 {
        self.axes().iter().map(|a| a.count).product()
    }

    /// Bytes the block copies.
    pub fn bytes(&self) -> u64 {
        self.runs() * self.run
    }

    /// One past the last source byte touched, relative to the buffer start.
    pub fn src_end(&self) -> Option<u64> {
        self.end(self.src_offset, |a| a.src_stride)
    }

    /// One past the last destination byte touched.
    pub fn dst_end(&self) -> Option<u64> {
        self.end(self.dst_offset, |a| a.dst_stride)
    }

    fn end(&self, offset: u64, stride: impl Fn(&Axis) -> u64) -> Option<u64> {
        self.axes().iter().try_fold(offset.checked_add(self.run)?, |acc, a| {
            acc.checked_add((a.count - 1).checked_mul(stride(a))?)
        })
    }

    /// Calls `f(src_offset, dst_offset, len)` for every run, in loop order.
    pub fn for_each_run(&self, mut f: impl FnMut(u64, u64, u64)) {
        fn walk(axes: &[Axis], src: u64, dst: u64, run: u64, f: &mut impl FnMut(u64, u64, u64)) {
            match axes.split_first() {
                None => f(src, dst, run),
                Some((a, rest)) => {
                    for i in 0..a.count {
                        walk(rest, src + i * a.src_stride, dst + i * a.dst_stride, run, f);
                    }
                }
            }
        }
        walk(self.axes(), self.src_offset, self.dst_offset, self.run, &mut f);
    }
}

/// One contiguous run of a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// Source buffer.
    pub src_buffer: u32,
    /// Source byte offset.
    pub src_offset: u64,
    /// Destination buffer.
    pub dst_buffer: u32,
    /// Destination byte offset.
    pub dst_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// A region copy between two layouts, ready for a copy engine.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CopyPlan {
    blocks: Vec<CopyBlock>,
    bytes: u64,
}

impl CopyPlan {
    /// The blocks, in planning order.
    pub fn blocks(&self) -> &[CopyBlock] {
        &self.blocks
    }

    /// Bytes the plan copies.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Contiguous runs the plan copies (its extents).
    pub fn run_count(&self) -> u64 {
        self.blocks.iter().map(CopyBlock::runs).sum()
    }

    /// Every run, in order.
    pub fn runs(&self) -> Vec<Run> {
        let mut runs = Vec::new();
        for b in &self.blocks {
            b.for_each_run(|src_offset, dst_offset, len| {
                runs.push(Run {
                    src_buffer: b.src_buffer,
                    src_offset,
                    dst_buffer: b.dst_buffer,
                    dst_offset,
                    len,
                })
            });
        }
        runs
    }

    fn push(&mut self, block: CopyBlock) {
        self.bytes += block.bytes();
        if let Some(last) = self.blocks.last_mut() {
            if last.depth == 0
                && block.depth == 0
                && last.src_buffer == block.src_buffer
                && last.dst_buffer == block.dst_buffer
                && last.src_offset + last.run == block.src_offset
                && last.dst_offset + last.run == block.dst_offset
            {
                last.run += block.run;
                return;
            }
        }
        self.blocks.push(block);
    }
}

/// Which side's memory order the loops follow (the side that is not the packed staging buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// Follow the source (gather).
    Src,
    /// Follow the destination (scatter).
    Dst,
}

/// Plans the copy of `shape` elements from `src` at `src_at` to `dst` at `dst_at`.
///
/// Both layouts must hold the same elements (head size, dtype, scales); their chunk sizes must
/// divide one another (true for every built-in layout). Both regions are bounds-checked.
pub fn plan_copy(
    src: &KvLayout,
    src_at: Coord,
    dst: &KvLayout,
    dst_at: Coord,
    shape: Shape,
    order: Order,
) -> Result<CopyPlan, LayoutError> {
    let spec = *src.spec();
    if !spec.same_elements(dst.spec()) {
        return Err(LayoutError::ElementMismatch(format!(
            "source holds {:?}, destination {:?}",
            src.spec(),
            dst.spec()
        )));
    }
    src.check_region(&KvRegion::at(src_at, shape))?;
    dst.check_region(&KvRegion::at(dst_at, shape))?;
    let mut plan = CopyPlan::default();
    if shape.is_empty() {
        return Ok(plan);
    }
    for layer in 0..shape.layers {
        for &part in spec.parts() {
            let chunking = Chunking::new(src, dst, part)?;
            for slot in 0..shape.slots {
                let mut token = 0;
                while token < shape.tokens {
                    let s = offset(src_at, layer, slot, token);
                    let d = offset(dst_at, layer, slot, token);
                    let segment = (shape.tokens - token)
                        .min(src.linear_tokens_from(part, s.token))
                        .min(dst.linear_tokens_from(part, d.token));
                    let (src_buffer, src_offset) = src.vector_base(part, s);
                    let (dst_buffer, dst_offset) = dst.vector_base(part, d);
                    let mut builder = BlockBuilder::default();
                    builder.axis(
                        shape.heads as u64,
                        src.part_map(part).head_stride,
                        dst.part_map(part).head_stride,
                    );
                    builder.axis(segment as u64, src.token_stride(part), dst.token_stride(part));
                    chunking.add_axes(&mut builder);
                    plan.push(builder.finish(
                        src_buffer,
                        src_offset,
                        dst_buffer,
                        dst_offset,
                        chunking.atom,
                        order,
                    ));
                    token += segment;
                }
            }
        }
    }
    Ok(plan)
}

fn offset(at: Coord, layer: u32, slot: u32, token: u32) -> Coord {
    Coord { layer: at.layer + layer, slot: at.slot + slot, head: at.head, token: at.token + token }
}

/// How a head vector splits into runs when both sides store it in chunks of different sizes.
struct Chunking {
    /// Contiguous bytes on both sides: the smaller chunk.
    atom: u64,
    /// Axis over the larger chunks.
    outer: Axis,
    /// Axis over small chunks inside one large chunk.
    inner: Axis,
}

impl Chunking {
    fn new(src: &KvLayout, dst: &KvLayout, part: Part) -> Result<Self, LayoutError> {
        let spec = src.spec();
        let vec_elems = spec.vector_elems(part) as u64;
        let elem = spec.elem_bytes(part) as u64;
        let (sm, dm) = (src.part_map(part), dst.part_map(part));
        let (xs, xd) = (sm.chunk_elems as u64, dm.chunk_elems as u64);
        let (small, large) = (xs.min(xd), xs.max(xd));
        if large % small != 0 {
            return Err(LayoutError::ElementMismatch(format!(
                "part {part:?}: chunks of {xs} and {xd} elements do not nest"
            )));
        }
        let per_large = large / small;
        // Chunk stride of the side with small chunks, and the element stride inside a large chunk.
        let stride_small = |m: &crate::layout::PartMap, x: u64| {
            if x == small {
                m.chunk_stride
            } else {
                small * elem
            }
        };
        let stride_large = |m: &crate::layout::PartMap, x: u64| {
            if x == large {
                m.chunk_stride
            } else {
                per_large * m.chunk_stride
            }
        };
        Ok(Self {
            atom: small * elem,
            outer: Axis {
                count: vec_elems / large,
                src_stride: stride_large(sm, xs),
                dst_stride: stride_large(dm, xd),
            },
            inner: Axis {
                count: per_large,
                src_stride: stride_small(sm, xs),
                dst_stride: stride_small(dm, xd),
            },
        })
    }

    fn add_axes(&self, builder: &mut BlockBuilder) {
        builder.axis(self.outer.count, self.outer.src_stride, self.outer.dst_stride);
        builder.axis(self.inner.count, self.inner.src_stride, self.inner.dst_stride);
    }
}

#[derive(Default)]
struct BlockBuilder {
    axes: [Axis; MAX_AXES],
    depth: usize,
}

impl BlockBuilder {
    fn axis(&mut self, count: u64, src_stride: u64, dst_stride: u64) {
        if count > 1 {
            self.axes[self.depth] = Axis { count, src_stride, dst_stride };
            self.depth += 1;
        }
    }

    /// Orders the axes by stride on the followed side, then folds contiguous axes into the run
    /// and adjacent axes into one another.
    fn finish(
        mut self,
        src_buffer: u32,
        src_offset: u64,
        dst_buffer: u32,
        dst_offset: u64,
        atom: u64,
        order: Order,
    ) -> CopyBlock {
        let axes = &mut self.axes[..self.depth];
        match order {
            Order::Src => axes.sort_by_key(|a| std::cmp::Reverse((a.src_stride, a.dst_stride))),
            Order::Dst => axes.sort_by_key(|a| std::cmp::Reverse((a.dst_stride, a.src_stride))),
        }
        let mut axes: Vec<Axis> = axes.to_vec();
        let mut run = atom;
        while let Some(last) = axes.last() {
            if last.src_stride == run && last.dst_stride == run {
                run *= last.count;
                axes.pop();
            } else {
                break;
            }
        }
        let mut i = axes.len();
        while i >= 2 {
            let (outer, inner) = (axes[i - 2], axes[i - 1]);
            if outer.src_stride == inner.count * inner.src_stride
                && outer.dst_stride == inner.count * inner.dst_stride
            {
                axes[i - 2] = Axis { count: outer.count * inner.count, ..inner };
                axes.remove(i - 1);
            }
            i -= 1;
        }
        let mut block = CopyBlock {
            src_buffer,
            dst_buffer,
            src_offset,
            dst_offset,
            run,
            axes: [Axis::default(); MAX_AXES],
            depth: axes.len() as u8,
        };
        block.axes[..axes.len()].copy_from_slice(&axes);
        block
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{Packing, PerLayerOrder};
    use crate::spec::{DType, KvSpec};

    fn gather_plan(layout: &KvLayout, region: &KvRegion) -> CopyPlan {
        let packed = KvLayout::packed(layout.spec(), region.shape(), layout.preferred_packing()).unwrap();
        plan_copy(layout, region.origin(), &packed, Coord::default(), region.shape(), Order::Src).unwrap()
    }

    #[test]
    fn whole_prompt_of_contiguous_layout_is_a_few_large_runs() {
        let spec = KvSpec::new(4, 8, 128, DType::F16).unwrap();
        let layout = KvLayout::per_layer(spec, 2, 1000, PerLayerOrder::Bhsd).unwrap();
        let region = KvRegion::new(0..4, 0..2, 0..8, 0..1000);
        let plan = gather_plan(&layout, &region);
        // One run per (layer, part): the whole per-layer tensor.
        assert_eq!(plan.run_count(), 8);
        assert_eq!(plan.bytes(), region.shape().bytes(&spec));
    }

    #[test]
    fn prompt_prefix_of_faster_transformer_is_runs_of_whole_token_ranges() {
        let spec = KvSpec::new(2, 4, 128, DType::F16).unwrap();
        let layout = KvLayout::faster_transformer(spec, 1, 2048).unwrap();
        let region = KvRegion::new(0..2, 0..1, 0..4, 0..1000);
        let plan = gather_plan(&layout, &region);
        let runs = plan.runs();
        // K: one 16-byte piece x 1000 tokens per (layer, head, chunk); V: one run per (layer, head).
        let k_runs = 2 * 4 * 16;
        let v_runs = 2 * 4;
        assert_eq!(runs.len(), k_runs + v_runs);
        assert!(runs.iter().all(|r| r.len >= 16_000));
    }

    #[test]
    fn decode_step_of_faster_transformer_k_is_one_16_byte_piece_per_chunk() {
        let spec = KvSpec::new(1, 2, 128, DType::F16).unwrap();
        let layout = KvLayout::faster_transformer(spec, 1, 64).unwrap();
        let region = KvRegion::new(0..1, 0..1, 0..2, 10..11);
        let plan = gather_plan(&layout, &region);
        let k: Vec<Run> = plan.runs().into_iter().filter(|r| r.len == 16).collect();
        assert_eq!(k.len(), 2 * 16);
    }

    #[test]
    fn re_tiling_between_chunk_sizes_covers_every_byte_once() {
        let spec = KvSpec::new(1, 1, 32, DType::F16).unwrap();
        let ft = KvLayout::faster_transformer(spec, 1, 4).unwrap();
        let shape = Shape { layers: 1, slots: 1, heads: 1, tokens: 4 };
        let packed = KvLayout::packed(&spec, shape, Packing::token_major(&spec)).unwrap();
        let plan = plan_copy(&ft, Coord::default(), &packed, Coord::default(), shape, Order::Src).unwrap();
        let mut dst: Vec<u64> = plan.runs().iter().flat_map(|r| r.dst_offset..r.dst_offset + r.len).collect();
        dst.sort_unstable();
        let expected: Vec<u64> = (0..shape.bytes(&spec)).collect();
        assert_eq!(dst, expected);
    }

    #[test]
    fn mismatched_elements_are_rejected() {
        let a = KvLayout::faster_transformer(KvSpec::new(1, 1, 16, DType::F16).unwrap(), 1, 4).unwrap();
        let b = KvLayout::faster_transformer(KvSpec::new(1, 1, 16, DType::BF16).unwrap(), 1, 4).unwrap();
        let shape = Shape { layers: 1, slots: 1, heads: 1, tokens: 1 };
        let err = plan_copy(&a, Coord::default(), &b, Coord::default(), shape, Order::Src);
        assert!(matches!(err, Err(LayoutError::ElementMismatch(_))));
        let too_far = Coord { token: 4, ..Coord::default() };
        let err = plan_copy(&a, too_far, &a, Coord::default(), shape, Order::Src);
        assert!(matches!(err, Err(LayoutError::OutOfBounds { axis: "token", .. })));
    }
}
