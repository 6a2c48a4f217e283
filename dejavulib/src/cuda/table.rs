//! A copy plan as the GPU kernels take it (`kernels/copy_blocks.cu`): each strided block as
//! [`WORDS`] words with the addresses of its first run, and the CPU reference twin that defines
//! what the kernels do with it. Pure data and host code: tested on any machine.

use crate::plan::{Axis, CopyPlan, MAX_AXES};

/// Words per block in a table.
pub const WORDS: usize = 19;

/// Tables whose runs are all at most this long are copied one item (up to 16 aligned bytes) per
/// thread, so a decode step's 16-byte pieces and 256-byte rows keep every thread busy; tables with
/// longer runs are copied one run per thread block (a prompt's).
pub const ITEM_RUN_LIMIT: u64 = 4096;

/// A plan encoded for the kernels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    /// [`WORDS`] words per block (see `kernels/copy_blocks.cu`).
    pub words: Vec<u64>,
    /// Blocks.
    pub blocks: u32,
    /// Runs of all blocks.
    pub runs: u64,
    /// Items of all blocks (each block's runs cut into its unit: see [`unit_of`]).
    pub items: u64,
    /// The longest run, in bytes (which kernel copies it).
    pub longest_run: u64,
}

/// Why a plan cannot be encoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TableError {
    /// A block names a buffer with no base address.
    #[error("the plan names buffer {buffer}, but only {bases} base addresses were given")]
    NoBase {
        /// The buffer.
        buffer: u32,
        /// Base addresses given.
        bases: usize,
    },
    /// An address does not fit in 64 bits.
    #[error("an address beyond 64 bits")]
    Overflow,
}

/// Most blocks a table passes to the kernels by value, as a kernel parameter (no upload): the
/// words and the block count must fit in the 4 KiB every CUDA device takes.
pub const INLINE_BLOCKS: usize = 24;

/// Encodes `plan` with each source buffer starting at `src_bases[i]` and each destination buffer
/// at `dst_bases[i]` (device addresses for the kernels, offsets into one arena for the twin).
///
/// Blocks of the same shape whose addresses advance by a constant step are folded into one block
/// with one more axis: a decode step's 640 blocks (one per layer, part and slot) become two, small
/// enough to travel as a kernel parameter. The blocks are grouped by shape first, so the runs may
/// come in another order than the plan's; a plan's runs have distinct destinations, so a copy does
/// not depend on their order.
pub fn encode(plan: &CopyPlan, src_bases: &[u64], dst_bases: &[u64]) -> Result<Table, TableError> {
    let base = |bases: &[u64], buffer: u32| {
        bases.get(buffer as usize).copied().ok_or(TableError::NoBase { buffer, bases: bases.len() })
    };
    let mut shapes = Vec::new();
    let mut blocks = Vec::with_capacity(plan.blocks().len());
    for block in plan.blocks().iter().filter(|b| b.runs() > 0) {
        let src =
            base(src_bases, block.src_buffer)?.checked_add(block.src_offset).ok_or(TableError::Overflow)?;
        let dst =
            base(dst_bases, block.dst_buffer)?.checked_add(block.dst_offset).ok_or(TableError::Overflow)?;
        let mut axes = [Axis::default(); MAX_AXES];
        axes[..block.axes().len()].copy_from_slice(block.axes());
        let shape = Shape { run: block.run, depth: block.axes().len(), axes };
        blocks.push(Placed { shape: shape_id(&mut shapes, shape), src, dst });
    }
    // Each pass groups the blocks by shape, each shape's blocks in the plan's order (K pieces and
    // V rows alternate in a plan per layer; grouped, each kind's layers and slots line up), and
    // folds what it can, adding at most one axis to a block. Stop when a pass folds nothing.
    loop {
        blocks.sort_by_key(|b| b.shape);
        let folded = fold(&blocks, &mut shapes);
        if folded.len() == blocks.len() {
            break;
        }
        blocks = folded;
    }
    let blocks = blocks.iter().map(|block| {
        let shape = &shapes[block.shape];
        let mut words = [0u64; WORDS];
        words[..4].copy_from_slice(&[block.src, block.dst, shape.run, shape.depth as u64]);
        for (i, axis) in shape.axes[..shape.depth].iter().enumerate() {
            words[4 + i] = axis.count;
            words[4 + MAX_AXES + i] = axis.src_stride;
            words[4 + 2 * MAX_AXES + i] = axis.dst_stride;
        }
        words
    });
    Ok(finish(blocks))
}

/// A table of `blocks` (words 0 to 15 set): each block's first run and item (prefix sums) and its
/// unit filled in.
fn finish(blocks: impl ExactSizeIterator<Item = [u64; WORDS]>) -> Table {
    let mut table = Table {
        words: Vec::with_capacity(blocks.len() * WORDS),
        blocks: 0,
        runs: 0,
        items: 0,
        longest_run: 0,
    };
    for mut words in blocks {
        let unit = unit_of(&words);
        let runs = (0..words[3] as usize).map(|axis| words[4 + axis]).product::<u64>();
        words[16] = table.runs;
        words[17] = table.items;
        words[18] = unit;
        table.words.extend_from_slice(&words);
        table.blocks += 1;
        table.runs += runs;
        table.items += runs * (words[2] / unit);
        table.longest_run = table.longest_run.max(words[2]);
    }
    table
}

/// The tables of one copy at every token offset, from its tables at two neighbouring offsets:
/// where every address of a cache is affine in the token (every layout but the paged ones), the
/// tables of a region moved along the tokens differ only in each block's first addresses, which
/// move by a constant step per token. A decode step's table then costs a few additions instead of
/// planning and encoding hundreds of blocks.
#[derive(Clone, Debug)]
pub struct TokenSteps {
    base: Table,
    token: u32,
    /// Per block, the source and destination steps per token.
    steps: Vec<(u64, u64)>,
}

impl TokenSteps {
    /// From `at`, the table for tokens from `token`, and `next`, the table for tokens from
    /// `token + 1`; `None` when they differ in more than their blocks' first addresses.
    pub fn new(at: Table, token: u32, next: &Table) -> Option<Self> {
        if at.blocks != next.blocks || at.words.len() != next.words.len() {
            return None;
        }
        let mut steps = Vec::with_capacity(at.blocks as usize);
        for (a, b) in at.words.chunks_exact(WORDS).zip(next.words.chunks_exact(WORDS)) {
            if a[2..16] != b[2..16] {
                return None;
            }
            steps.push((b[0].wrapping_sub(a[0]), b[1].wrapping_sub(a[1])));
        }
        Some(Self { base: at, token, steps })
    }

    /// The table for tokens from `token`, every source address moved by `src_shift` and every
    /// destination address by `dst_shift` (a staging buffer's base, when the steps were made with
    /// the staging buffer at 0).
    pub fn at(&self, token: u32, src_shift: u64, dst_shift: u64) -> Table {
        // Two's complement: a negative distance wraps as the addresses do.
        let distance = (i64::from(token) - i64::from(self.token)) as u64;
        let blocks = self.base.words.chunks_exact(WORDS).zip(&self.steps).map(|(words, &(src, dst))| {
            let mut words: [u64; WORDS] = words.try_into().expect("whole blocks");
            words[0] = words[0].wrapping_add(distance.wrapping_mul(src)).wrapping_add(src_shift);
            words[1] = words[1].wrapping_add(distance.wrapping_mul(dst)).wrapping_add(dst_shift);
            words
        });
        finish(blocks)
    }
}

/// A block's loops without its addresses: what blocks that fold together share.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Shape {
    run: u64,
    depth: usize,
    axes: [Axis; MAX_AXES],
}

/// A block as folding sees it: its shape (an index into the shapes seen) and where its first
/// run is on both sides.
#[derive(Clone, Copy)]
struct Placed {
    shape: usize,
    src: u64,
    dst: u64,
}

/// The index of `shape` among `shapes`, added if new (plans have a few shapes).
fn shape_id(shapes: &mut Vec<Shape>, shape: Shape) -> usize {
    shapes.iter().position(|s| *s == shape).unwrap_or_else(|| {
        shapes.push(shape);
        shapes.len() - 1
    })
}

/// One greedy pass: each maximal sequence of same-shaped blocks (below [`MAX_AXES`] axes) whose
/// addresses advance by a constant step becomes one block with that step as its new outermost
/// axis. The runs stay in the same order.
fn fold(blocks: &[Placed], shapes: &mut Vec<Shape>) -> Vec<Placed> {
    let mut out = Vec::with_capacity(blocks.len());
    let mut i = 0;
    while i < blocks.len() {
        let first = blocks[i];
        let shape = shapes[first.shape];
        let mut count = 1;
        let (mut src_step, mut dst_step) = (0, 0);
        if shape.depth < MAX_AXES {
            if let Some(next) = blocks.get(i + 1) {
                src_step = next.src.wrapping_sub(first.src);
                dst_step = next.dst.wrapping_sub(first.dst);
            }
            while let Some(next) = blocks.get(i + count) {
                let k = count as u64;
                if next.shape != first.shape
                    || next.src != first.src.wrapping_add(k.wrapping_mul(src_step))
                    || next.dst != first.dst.wrapping_add(k.wrapping_mul(dst_step))
                {
                    break;
                }
                count += 1;
            }
        }
        if count == 1 {
            out.push(first);
            i += 1;
            continue;
        }
        let mut axes = [Axis::default(); MAX_AXES];
        axes[0] = Axis { count: count as u64, src_stride: src_step, dst_stride: dst_step };
        axes[1..=shape.depth].copy_from_slice(&shape.axes[..shape.depth]);
        let folded = Shape { run: shape.run, depth: shape.depth + 1, axes };
        out.push(Placed { shape: shape_id(shapes, folded), ..first });
        i += count;
    }
    out
}

/// The bytes one thread moves at a time in a block: the largest of 16, 8, 4, 2 and 1 that its
/// addresses, run length and strides are all multiples of (16: one vector load and store).
pub fn unit_of(words: &[u64; WORDS]) -> u64 {
    let depth = words[3] as usize;
    let mut all = words[0] | words[1] | words[2];
    for axis in 0..depth {
        all |= words[4 + MAX_AXES + axis] | words[4 + 2 * MAX_AXES + axis];
    }
    1 << all.trailing_zeros().min(4)
}

/// The block holding global run (`first` = 16) or item (`first` = 17) `index`: the last whose
/// first one is at most `index`, by binary search as the kernels do.
fn block_of(table: &Table, first: usize, index: u64) -> &[u64] {
    let (mut low, mut high) = (0usize, table.blocks as usize - 1);
    while low < high {
        let middle = (low + high).div_ceil(2);
        if table.words[middle * WORDS + first] <= index {
            low = middle;
        } else {
            high = middle - 1;
        }
    }
    &table.words[low * WORDS..(low + 1) * WORDS]
}

/// One item as the item kernel finds it: global item `i`'s source and destination addresses and
/// length (its block's unit).
fn item_of(table: &Table, i: u64) -> (u64, u64, u64) {
    let w = block_of(table, 17, i);
    let unit = w[18];
    let per_run = w[2] / unit;
    let local = i - w[17];
    let (src, dst) = run_start(w, local / per_run);
    let within = (local % per_run) * unit;
    (src.wrapping_add(within), dst.wrapping_add(within), unit)
}

/// One run as the run kernel finds it: global run `r`'s source and destination addresses and
/// length.
fn run_of(table: &Table, r: u64) -> (u64, u64, u64) {
    let w = block_of(table, 16, r);
    let (src, dst) = run_start(w, r - w[16]);
    (src, dst, w[2])
}

/// Where run `local` of block `w` starts on both sides.
fn run_start(w: &[u64], local: u64) -> (u64, u64) {
    let (mut local, mut src, mut dst) = (local, w[0], w[1]);
    // Unsigned arithmetic wraps, as on the GPU: a folded axis may step backwards.
    for axis in (0..w[3] as usize).rev() {
        let i = local % w[4 + axis];
        local /= w[4 + axis];
        src = src.wrapping_add(i.wrapping_mul(w[4 + MAX_AXES + axis]));
        dst = dst.wrapping_add(i.wrapping_mul(w[4 + 2 * MAX_AXES + axis]));
    }
    (src, dst)
}

/// The kernels' semantics on the CPU: `table`, whose addresses are offsets into `memory`, copied
/// there as the kernel the engine picks for it does (item by item, or run by run). Panics on a run
/// outside `memory` (a test twin, not a copy engine).
pub fn copy_reference(table: &Table, memory: &mut [u8]) {
    copy_as(table, memory, by_items(table));
}

/// Finds piece `i` of a table: (source, destination, bytes).
type PieceOf = fn(&Table, u64) -> (u64, u64, u64);

/// The item kernel's copy (`items`) or the run kernel's.
fn copy_as(table: &Table, memory: &mut [u8], items: bool) {
    let (count, piece): (u64, PieceOf) = if items { (table.items, item_of) } else { (table.runs, run_of) };
    for i in 0..count {
        let (src, dst, len) = piece(table, i);
        let (src, dst, len) = (src as usize, dst as usize, len as usize);
        memory.copy_within(src..src + len, dst);
    }
}

/// Whether the item kernel copies `table` (else the run kernel does).
pub fn by_items(table: &Table) -> bool {
    table.longest_run <= ITEM_RUN_LIMIT
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{gather_copy_plan, scatter_copy_plan};
    use crate::layout::{BlockTables, KvInterleave, PagedConfig, PagedOrder, PerLayerOrder};
    use crate::{DType, KvCache, KvLayout, KvRegion, KvSpec};

    /// Fills every byte of `cache`'s KV with noise (not zeros), through the CPU engine.
    fn fill(cache: &KvCache, seed: u64) {
        let spec = cache.layout().spec();
        let whole = KvRegion::new(0..spec.layers(), 0..3, 0..spec.kv_heads(), 0..40);
        let mut state = seed | 1;
        let noise: Vec<u8> = (0..cache.packed_len(&whole))
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        cache.scatter(&whole, cache.layout().preferred_packing(), &noise).unwrap();
    }

    /// `cache`'s buffers one after the other in an arena, with room for `staging` bytes after them;
    /// returns the arena, each buffer's offset and the staging buffer's.
    fn arena(cache: &KvCache, staging: usize) -> (Vec<u8>, Vec<u64>, u64) {
        let (mut arena, mut bases) = (Vec::new(), Vec::new());
        for buffer in cache.snapshot() {
            bases.push(arena.len() as u64);
            arena.extend_from_slice(&buffer);
        }
        let staging_base = arena.len() as u64;
        arena.resize(arena.len() + staging, 0);
        (arena, bases, staging_base)
    }

    #[test]
    fn the_twin_gathers_and_scatters_what_the_cpu_engine_does_for_every_layout() {
        let spec = KvSpec::new(3, 5, 24, DType::F16).unwrap();
        // Five blocks of eight tokens per slot, out of order.
        let paged = PagedConfig {
            block_size: 8,
            num_blocks: 16,
            order: PagedOrder::Hnd,
            interleave: KvInterleave::Separate,
        };
        let tables = BlockTables::from_tables(vec![
            vec![9, 3, 14, 0, 6],
            vec![1, 12, 5, 15, 8],
            vec![2, 11, 7, 4, 13],
        ]);
        let layouts = [
            KvLayout::faster_transformer(spec, 3, 40).unwrap(),
            KvLayout::per_layer(spec, 3, 40, PerLayerOrder::Bhsd).unwrap(),
            KvLayout::per_layer(spec, 3, 40, PerLayerOrder::Bshd).unwrap(),
            KvLayout::paged(spec, 3, paged, Some(tables)).unwrap(),
        ];
        let regions = [
            KvRegion::new(0..3, 0..3, 0..5, 17..18),
            KvRegion::new(1..3, 1..2, 2..5, 0..33),
            KvRegion::new(0..1, 0..3, 0..1, 5..9),
        ];
        let whole = KvRegion::new(0..3, 0..3, 0..5, 0..40);
        for (l, layout) in layouts.into_iter().enumerate() {
            let cache = KvCache::new(layout).unwrap();
            fill(&cache, l as u64 + 1);
            for (r, region) in regions.iter().enumerate() {
                let packing = cache.layout().preferred_packing();
                let len = cache.packed_len(region) as usize;
                let input: Vec<u8> = (0..len).map(|i| (i * 7 + l + r) as u8).collect();
                let mut expected = vec![0u8; len];
                let plan = cache.gather_plan(region, packing).unwrap();
                cache.gather_with(&plan, &mut expected).unwrap();
                // What the CPU engine's scatter of `input` makes of a copy of the cache.
                let scattered = KvCache::new(cache.layout().clone()).unwrap();
                let mut all = vec![0u8; cache.packed_len(&whole) as usize];
                cache.gather(&whole, packing, &mut all).unwrap();
                scattered.scatter(&whole, packing, &all).unwrap();
                scattered.scatter(region, packing, &input).unwrap();
                // Both kernels' ways of cutting the work (items, runs) give the CPU engine's bytes.
                for items in [true, false] {
                    let what = format!("layout {l} region {r} items {items}");
                    let (mut memory, bases, staging) = arena(&cache, len);
                    // Gather: the twin's staging equals the CPU engine's.
                    let table = encode(plan.copy_plan(), &bases, &[staging]).unwrap();
                    copy_as(&table, &mut memory, items);
                    assert_eq!(&memory[staging as usize..], &expected[..], "{what}");
                    // Scatter other bytes back: the twin's cache equals the CPU engine's.
                    memory[staging as usize..].copy_from_slice(&input);
                    let scatter = cache.scatter_plan(region, packing).unwrap();
                    let table = encode(&scatter, &[staging], &bases).unwrap();
                    copy_as(&table, &mut memory, items);
                    for (i, buffer) in scattered.snapshot().iter().enumerate() {
                        let base = bases[i] as usize;
                        assert_eq!(&memory[base..base + buffer.len()], &buffer[..], "{what}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_decode_step_folds_into_a_table_small_enough_to_pass_inline() {
        // The benchmark's worker, fewer heads and tokens: 320 blocks of 16-byte runs unfolded.
        let spec = KvSpec::new(40, 8, 128, DType::F16).unwrap();
        let layout = KvLayout::faster_transformer(spec, 4, 64).unwrap();
        let region = KvRegion::new(0..40, 0..4, 0..8, 50..51);
        let cache = KvCache::new(layout.clone()).unwrap();
        let plan = cache.gather_plan(&region, layout.preferred_packing()).unwrap();
        let bases: Vec<u64> = (0..layout.buffer_sizes().len() as u64).map(|i| i << 36).collect();
        let table = encode(plan.copy_plan(), &bases, &[1 << 40]).unwrap();
        assert!(plan.copy_plan().blocks().len() >= 320);
        // K pieces and V rows: one block each.
        assert_eq!(table.blocks, 2);
        assert!(table.blocks as usize <= INLINE_BLOCKS);
        assert_eq!(table.runs, plan.copy_plan().blocks().iter().map(|b| b.runs()).sum::<u64>());
        // Every run is still one of the unfolded plan's, each once.
        let mut expected = Vec::new();
        for block in plan.copy_plan().blocks() {
            block.for_each_run(|src, dst, len| {
                expected.push((bases[block.src_buffer as usize] + src, (1 << 40) + dst, len))
            });
        }
        let mut got: Vec<_> = (0..table.runs).map(|r| run_of(&table, r)).collect();
        got.sort_unstable();
        expected.sort_unstable();
        assert_eq!(got, expected);
        // Items cut every run into aligned 16-byte pieces, each once.
        assert!(by_items(&table));
        let mut items: Vec<_> = (0..table.items).map(|i| item_of(&table, i)).collect();
        items.sort_unstable();
        let pieces: Vec<_> = expected
            .iter()
            .flat_map(|&(src, dst, len)| (0..len / 16).map(move |k| (src + 16 * k, dst + 16 * k, 16)))
            .collect();
        assert_eq!(items, pieces);
    }

    /// Every run of `table` (source, destination, length), sorted.
    fn runs(table: &Table) -> Vec<(u64, u64, u64)> {
        let mut runs: Vec<_> = (0..table.runs).map(|r| run_of(table, r)).collect();
        runs.sort_unstable();
        runs
    }

    #[test]
    fn token_steps_give_the_runs_of_a_fresh_plan_at_every_token() {
        let spec = KvSpec::new(3, 5, 24, DType::F16).unwrap();
        let layouts = [
            KvLayout::faster_transformer(spec, 3, 40).unwrap(),
            KvLayout::per_layer(spec, 3, 40, PerLayerOrder::Bhsd).unwrap(),
            KvLayout::per_layer(spec, 3, 40, PerLayerOrder::Bshd).unwrap(),
        ];
        // A decode step, a few tokens of some heads, a prompt's worth.
        let shapes = [(0..3, 0..3, 0..5, 1), (1..3, 1..2, 2..5, 3), (0..2, 0..3, 0..5, 17)];
        let staging = 1 << 40;
        for (l, layout) in layouts.iter().enumerate() {
            let bases: Vec<u64> = (0..layout.buffer_sizes().len() as u64).map(|i| (i + 1) << 32).collect();
            let packing = layout.preferred_packing();
            for (layers, slots, heads, count) in shapes.clone() {
                let at = |t: u32| KvRegion::new(layers.clone(), slots.clone(), heads.clone(), t..t + count);
                let gather =
                    |t| encode(&gather_copy_plan(layout, &at(t), packing).unwrap(), &bases, &[staging]);
                let scatter =
                    |t| encode(&scatter_copy_plan(layout, &at(t), packing).unwrap(), &[staging], &bases);
                // Learned at tokens 5 and 6, staging at 0; asked for at every token.
                let learn =
                    |t| encode(&gather_copy_plan(layout, &at(t), packing).unwrap(), &bases, &[0]).unwrap();
                let steps = TokenSteps::new(learn(5), 5, &learn(6)).expect("affine layouts step");
                let unlearn =
                    |t| encode(&scatter_copy_plan(layout, &at(t), packing).unwrap(), &[0], &bases).unwrap();
                let back = TokenSteps::new(unlearn(5), 5, &unlearn(6)).expect("affine layouts step");
                for t in 0..=40 - count {
                    let what = format!("layout {l}, {count} tokens from {t}");
                    assert_eq!(runs(&steps.at(t, 0, staging)), runs(&gather(t).unwrap()), "{what}");
                    assert_eq!(runs(&back.at(t, staging, 0)), runs(&scatter(t).unwrap()), "{what}");
                }
            }
        }
    }

    #[test]
    fn tables_that_differ_in_more_than_addresses_have_no_token_steps() {
        let spec = KvSpec::new(2, 2, 16, DType::F16).unwrap();
        let layout = KvLayout::per_layer(spec, 2, 16, PerLayerOrder::Bhsd).unwrap();
        let packing = layout.preferred_packing();
        let table = |region: KvRegion| {
            encode(&gather_copy_plan(&layout, &region, packing).unwrap(), &[0; 4], &[0]).unwrap()
        };
        let one = table(KvRegion::new(0..2, 0..2, 0..2, 3..4));
        let two = table(KvRegion::new(0..2, 0..2, 0..2, 3..5));
        assert!(TokenSteps::new(one, 3, &two).is_none());
    }

    #[test]
    fn a_plan_naming_a_buffer_without_a_base_is_refused() {
        let spec = KvSpec::new(2, 2, 16, DType::F16).unwrap();
        let cache = KvCache::new(KvLayout::per_layer(spec, 1, 8, PerLayerOrder::Bhsd).unwrap()).unwrap();
        let region = KvRegion::new(0..2, 0..1, 0..2, 0..4);
        let plan = cache.gather_plan(&region, cache.layout().preferred_packing()).unwrap();
        assert!(matches!(encode(plan.copy_plan(), &[0], &[0]), Err(TableError::NoBase { .. })));
    }
}
