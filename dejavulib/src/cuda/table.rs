//! A copy plan as the GPU kernels take it (`kernels/copy_blocks.cu`): each strided block as 17
//! words with the addresses of its first run, and the CPU reference twin that defines what the
//! kernels do with it. Pure data and host code: tested on any machine.

use crate::plan::{CopyPlan, MAX_AXES};

/// Words per block in a table.
pub const WORDS: usize = 17;

/// Runs at most this long are copied one per thread; longer ones one per thread block.
pub const SHORT_RUN: u64 = 64;

/// A plan encoded for the kernels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    /// [`WORDS`] words per block (see `kernels/copy_blocks.cu`).
    pub words: Vec<u64>,
    /// Blocks.
    pub blocks: u32,
    /// Runs of all blocks.
    pub runs: u64,
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

/// Encodes `plan` with each source buffer starting at `src_bases[i]` and each destination buffer
/// at `dst_bases[i]` (device addresses for the kernels, offsets into one arena for the twin).
pub fn encode(plan: &CopyPlan, src_bases: &[u64], dst_bases: &[u64]) -> Result<Table, TableError> {
    let base = |bases: &[u64], buffer: u32| {
        bases.get(buffer as usize).copied().ok_or(TableError::NoBase { buffer, bases: bases.len() })
    };
    let mut table =
        Table { words: Vec::with_capacity(plan.blocks().len() * WORDS), blocks: 0, runs: 0, longest_run: 0 };
    for block in plan.blocks().iter().filter(|b| b.runs() > 0) {
        let src =
            base(src_bases, block.src_buffer)?.checked_add(block.src_offset).ok_or(TableError::Overflow)?;
        let dst =
            base(dst_bases, block.dst_buffer)?.checked_add(block.dst_offset).ok_or(TableError::Overflow)?;
        let axes = block.axes();
        let mut words = [0u64; WORDS];
        words[..4].copy_from_slice(&[src, dst, block.run, axes.len() as u64]);
        for (i, axis) in axes.iter().enumerate() {
            words[4 + i] = axis.count;
            words[4 + MAX_AXES + i] = axis.src_stride;
            words[4 + 2 * MAX_AXES + i] = axis.dst_stride;
        }
        words[16] = table.runs;
        table.words.extend_from_slice(&words);
        table.blocks += 1;
        table.runs += block.runs();
        table.longest_run = table.longest_run.max(block.run);
    }
    Ok(table)
}

/// One run as the kernels find it: global run `r`'s source and destination addresses and length.
fn run_of(table: &Table, r: u64) -> (u64, u64, u64) {
    // The last block whose first run is at most `r`, as the kernels search.
    let mut b = 0;
    while b + 1 < table.blocks as usize && table.words[(b + 1) * WORDS + 16] <= r {
        b += 1;
    }
    let w = &table.words[b * WORDS..(b + 1) * WORDS];
    let (mut local, mut src, mut dst) = (r - w[16], w[0], w[1]);
    for axis in (0..w[3] as usize).rev() {
        let i = local % w[4 + axis];
        local /= w[4 + axis];
        src += i * w[4 + MAX_AXES + axis];
        dst += i * w[4 + 2 * MAX_AXES + axis];
    }
    (src, dst, w[2])
}

/// The kernels' semantics on the CPU: every run of `table`, whose addresses are offsets into
/// `memory`, copied there. Panics on a run outside `memory` (a test twin, not a copy engine).
pub fn copy_reference(table: &Table, memory: &mut [u8]) {
    for r in 0..table.runs {
        let (src, dst, len) = run_of(table, r);
        let (src, dst, len) = (src as usize, dst as usize, len as usize);
        memory.copy_within(src..src + len, dst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
        for (l, layout) in layouts.into_iter().enumerate() {
            let cache = KvCache::new(layout).unwrap();
            fill(&cache, l as u64 + 1);
            for (r, region) in regions.iter().enumerate() {
                let packing = cache.layout().preferred_packing();
                let len = cache.packed_len(region) as usize;
                let (mut memory, bases, staging) = arena(&cache, len);
                // Gather: the twin's staging equals the CPU engine's.
                let plan = cache.gather_plan(region, packing).unwrap();
                let table = encode(plan.copy_plan(), &bases, &[staging]).unwrap();
                copy_reference(&table, &mut memory);
                let mut expected = vec![0u8; len];
                cache.gather_with(&plan, &mut expected).unwrap();
                assert_eq!(&memory[staging as usize..], &expected[..], "layout {l} region {r}");
                // Scatter other bytes back: the twin's cache equals the CPU engine's.
                let input: Vec<u8> = (0..len).map(|i| (i * 7 + l + r) as u8).collect();
                memory[staging as usize..].copy_from_slice(&input);
                let scatter = cache.scatter_plan(region, packing).unwrap();
                let table = encode(&scatter, &[staging], &bases).unwrap();
                copy_reference(&table, &mut memory);
                cache.scatter(region, packing, &input).unwrap();
                for (i, buffer) in cache.snapshot().iter().enumerate() {
                    let base = bases[i] as usize;
                    assert_eq!(&memory[base..base + buffer.len()], &buffer[..], "layout {l} region {r}");
                }
            }
        }
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
