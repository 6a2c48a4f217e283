//! Where each KV element lives in memory.
//!
//! Every layout is a [`KvLayout`]: for each [`Part`] a [`PartMap`] of strides that maps
//! (layer, slot, head, token, element) to (buffer index, byte offset). The engines' layouts
//! (FasterTransformer, per-layer HF/PyTorch tensors, vLLM paged blocks) and the packed staging
//! format are all built from this one strided description (see [`builders`]), so one copy planner
//! ([`crate::plan`]) serves every pair of them.

pub mod builders;

use std::ops::Range;

use thiserror::Error;

use crate::region::{Coord, KvRegion, Shape};
use crate::spec::{KvSpec, Part};

pub use builders::{KvInterleave, PagedConfig, PagedOrder, PerLayerOrder};

/// Errors in layouts, regions and copy plans.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum LayoutError {
    /// A layout parameter is invalid.
    #[error("invalid layout: {0}")]
    Invalid(String),
    /// A part's strides reach past the end of its buffer.
    #[error("part {part:?} reaches byte {needed} of buffer {buffer}, which holds {size}")]
    BufferTooSmall {
        /// Offending part.
        part: Part,
        /// Buffer index.
        buffer: u32,
        /// Bytes the part needs.
        needed: u64,
        /// Bytes the buffer has.
        size: u64,
    },
    /// A region does not fit in the layout.
    #[error("region out of bounds on {axis}: {start}..{end} not within 0..{limit}")]
    OutOfBounds {
        /// Axis name.
        axis: &'static str,
        /// Region start on that axis.
        start: u64,
        /// Region end on that axis.
        end: u64,
        /// Layout extent on that axis.
        limit: u64,
    },
    /// Two layouts hold different elements (head size, dtype or scales differ).
    #[error("element mismatch: {0}")]
    ElementMismatch(String),
    /// A paged block id is not below the number of blocks.
    #[error("block {block} of slot {slot} is not below the {num_blocks} blocks of the pool")]
    BadBlock {
        /// Slot whose table holds it.
        slot: u32,
        /// The block id.
        block: u32,
        /// Blocks in the pool.
        num_blocks: u32,
    },
    /// An operation needs a paged layout.
    #[error("layout is not paged")]
    NotPaged,
}

/// Which buffer a part of a layer lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufferMap {
    /// All layers in one buffer, `layer_stride` bytes apart.
    Shared {
        /// Buffer index.
        buffer: u32,
        /// Bytes between consecutive layers.
        layer_stride: u64,
    },
    /// One buffer per layer: layer `l` lives in buffer `first + l * step`.
    PerLayer {
        /// Buffer of layer 0.
        first: u32,
        /// Buffer index step between layers.
        step: u32,
    },
}

/// How a token index becomes a byte offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenMap {
    /// Token `t` is `t * stride` bytes in.
    Linear {
        /// Bytes between consecutive tokens.
        stride: u64,
    },
    /// Token `t` of slot `s` is in physical block `table[s][t / block_size]`, row `t % block_size`.
    Paged {
        /// Tokens per block.
        block_size: u32,
        /// Bytes between consecutive physical blocks.
        block_stride: u64,
        /// Bytes between consecutive tokens of a block.
        token_stride: u64,
    },
}

/// Strides of one part (K, V or a scale array) of a layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartMap {
    /// Buffer selection per layer.
    pub buffer: BufferMap,
    /// Byte offset of element (0, 0, 0, 0, 0) within its buffer.
    pub offset: u64,
    /// Bytes between consecutive slots (0 for paged layouts: the block table names the slot's memory).
    pub slot_stride: u64,
    /// Bytes between consecutive heads.
    pub head_stride: u64,
    /// Token addressing.
    pub tokens: TokenMap,
    /// Elements of a head vector stored contiguously (FasterTransformer's `x`; the vector length if whole).
    pub chunk_elems: u32,
    /// Bytes between consecutive chunks of one head vector.
    pub chunk_stride: u64,
}

/// The family a layout was built as; carried for diagnostics and chunk headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutKind {
    /// FasterTransformer: K `[L][B][H][D/x][S][x]`, V `[L][B][H][S][D]`.
    FasterTransformer,
    /// One tensor per layer and part, as HF/PyTorch engines hold them.
    PerLayer(PerLayerOrder),
    /// vLLM-style paged blocks addressed through block tables.
    Paged(PagedConfig),
    /// The contiguous staging format of a region (see [`Packing`]).
    Packed(Packing),
    /// Built directly from strides.
    Strided,
}

/// How K and V vectors are ordered inside a packed (staging) buffer.
///
/// A packed buffer holds the region `[layer][part][slot][head]`, and inside each (slot, head) either
/// `[token][element]` (chunk = whole vector) or `[chunk][token][element in chunk]` (FasterTransformer's
/// K order), so a gather from that layout reads long runs. Scales are always `[token]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Packing {
    /// Contiguous elements per chunk of a K vector.
    pub k_chunk: u32,
    /// Contiguous elements per chunk of a V vector.
    pub v_chunk: u32,
}

impl Packing {
    /// Token-major packing: each head vector whole.
    pub fn token_major(spec: &KvSpec) -> Self {
        Self { k_chunk: spec.head_dim(), v_chunk: spec.head_dim() }
    }

    /// Chunk size for `part`.
    pub fn chunk(&self, part: Part, spec: &KvSpec) -> u32 {
        match part {
            Part::K => self.k_chunk,
            Part::V => self.v_chunk,
            Part::KScale | Part::VScale => spec.vector_elems(part),
        }
    }
}

/// Block tables of a paged layout: for each slot, the physical blocks holding its tokens in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockTables {
    tables: Vec<Vec<u32>>,
}

impl BlockTables {
    /// Tables for `slots` slots, all empty.
    pub fn empty(slots: u32) -> Self {
        Self { tables: vec![Vec::new(); slots as usize] }
    }

    /// Tables from explicit block lists, one per slot.
    pub fn from_tables(tables: Vec<Vec<u32>>) -> Self {
        Self { tables }
    }

    /// The block list of `slot`.
    pub fn table(&self, slot: u32) -> &[u32] {
        self.tables.get(slot as usize).map(Vec::as_slice).unwrap_or(&[])
    }
}

/// A complete map from logical KV coordinates to (buffer, byte offset), for every part.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    kind: LayoutKind,
    spec: KvSpec,
    slots: u32,
    max_tokens: u32,
    parts: [Option<PartMap>; 4],
    buffer_sizes: Vec<u64>,
    block_tables: Option<BlockTables>,
}

impl KvLayout {
    /// A layout from raw strides: the general form every other layout is built from.
    ///
    /// `parts` must give a map for every part of `spec` (K, V and, with scales, both scale arrays).
    /// Every reachable byte is checked against `buffer_sizes`. Overlap between parts is the caller's
    /// responsibility.
    pub fn strided(
        spec: KvSpec,
        slots: u32,
        max_tokens: u32,
        parts: &[(Part, PartMap)],
        buffer_sizes: Vec<u64>,
    ) -> Result<Self, LayoutError> {
        if parts.iter().any(|(_, m)| matches!(m.tokens, TokenMap::Paged { .. })) {
            return Err(LayoutError::Invalid(
                "paged token maps need block tables: use KvLayout::paged".into(),
            ));
        }
        Self::from_parts(LayoutKind::Strided, spec, slots, max_tokens, parts, buffer_sizes, None)
    }

    pub(crate) fn from_parts(
        kind: LayoutKind,
        spec: KvSpec,
        slots: u32,
        max_tokens: u32,
        parts: &[(Part, PartMap)],
        buffer_sizes: Vec<u64>,
        block_tables: Option<BlockTables>,
    ) -> Result<Self, LayoutError> {
        if slots == 0 {
            return Err(LayoutError::Invalid("slots must be at least 1".into()));
        }
        let mut maps = [None; 4];
        for &(part, map) in parts {
            if maps[part.index()].replace(map).is_some() {
                return Err(LayoutError::Invalid(format!("part {part:?} given twice")));
            }
        }
        for &part in spec.parts() {
            if maps[part.index()].is_none() {
                return Err(LayoutError::Invalid(format!("missing map for part {part:?}")));
            }
        }
        for part in Part::ALL {
            if !spec.parts().contains(&part) && maps[part.index()].is_some() {
                return Err(LayoutError::Invalid(format!("spec has no part {part:?}")));
            }
        }
        let layout = Self { kind, spec, slots, max_tokens, parts: maps, buffer_sizes, block_tables };
        for &part in spec.parts() {
            layout.check_part_fits(part)?;
        }
        Ok(layout)
    }

    /// Bytes from a part's first element of a layer to one past its last, within that layer's
    /// buffer; `None` on overflow.
    fn part_extent(&self, part: Part) -> Option<u64> {
        let map = self.part_map(part);
        let elem = self.spec.elem_bytes(part) as u64;
        let chunks = (self.spec.vector_elems(part) / map.chunk_elems) as u64;
        let token_extent = match map.tokens {
            TokenMap::Linear { stride } => (self.max_tokens.max(1) as u64 - 1).checked_mul(stride)?,
            TokenMap::Paged { block_size, block_stride, token_stride } => {
                let blocks = match self.kind {
                    LayoutKind::Paged(cfg) => cfg.num_blocks as u64,
                    _ => 1,
                };
                (blocks - 1)
                    .checked_mul(block_stride)?
                    .checked_add((block_size as u64 - 1).checked_mul(token_stride)?)?
            }
        };
        [
            (self.slots as u64 - 1).checked_mul(map.slot_stride)?,
            (self.spec.kv_heads() as u64 - 1).checked_mul(map.head_stride)?,
            token_extent,
            (chunks - 1).checked_mul(map.chunk_stride)?,
            map.chunk_elems as u64 * elem,
        ]
        .into_iter()
        .try_fold(0u64, |acc, x| acc.checked_add(x))
    }

    fn check_part_fits(&self, part: Part) -> Result<(), LayoutError> {
        let map = self.part_map(part);
        let vec_elems = self.spec.vector_elems(part);
        if map.chunk_elems == 0 || vec_elems % map.chunk_elems != 0 {
            return Err(LayoutError::Invalid(format!(
                "part {part:?}: chunk of {} elements does not divide the vector of {vec_elems}",
                map.chunk_elems
            )));
        }
        let overflow = || LayoutError::Invalid(format!("part {part:?}: offsets overflow 64 bits"));
        let inner = self.part_extent(part).and_then(|e| e.checked_add(map.offset)).ok_or_else(overflow)?;
        let check = |buffer: u32, needed: u64| -> Result<(), LayoutError> {
            let size =
                self.buffer_sizes.get(buffer as usize).copied().ok_or_else(|| {
                    LayoutError::Invalid(format!("part {part:?} uses missing buffer {buffer}"))
                })?;
            if needed > size {
                return Err(LayoutError::BufferTooSmall { part, buffer, needed, size });
            }
            Ok(())
        };
        match map.buffer {
            BufferMap::Shared { buffer, layer_stride } => {
                let layers = self.spec.layers() as u64 - 1;
                let needed = layers.checked_mul(layer_stride).and_then(|l| l.checked_add(inner));
                check(buffer, needed.ok_or_else(overflow)?)
            }
            BufferMap::PerLayer { first, step } => {
                for layer in 0..self.spec.layers() {
                    let buffer = layer.checked_mul(step).and_then(|b| b.checked_add(first));
                    check(buffer.ok_or_else(overflow)?, inner)?;
                }
                Ok(())
            }
        }
    }

    /// The family this layout was built as.
    pub fn kind(&self) -> LayoutKind {
        self.kind
    }

    /// The elements it holds.
    pub fn spec(&self) -> &KvSpec {
        &self.spec
    }

    /// Batch slots.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Token capacity of each slot for linear layouts; paged layouts use [`KvLayout::token_capacity`].
    pub fn max_tokens(&self) -> u32 {
        self.max_tokens
    }

    /// Tokens that `slot` can hold.
    pub fn token_capacity(&self, slot: u32) -> u32 {
        match (&self.block_tables, self.kind) {
            (Some(tables), LayoutKind::Paged(cfg)) => {
                (tables.table(slot).len() as u64 * cfg.block_size as u64).min(u32::MAX as u64) as u32
            }
            _ => self.max_tokens,
        }
    }

    /// Bytes each buffer must hold.
    pub fn buffer_sizes(&self) -> &[u64] {
        &self.buffer_sizes
    }

    /// The strides of `part`.
    ///
    /// # Panics
    /// If the spec has no such part; use [`KvSpec::parts`] to list them.
    pub fn part_map(&self, part: Part) -> &PartMap {
        self.parts[part.index()].as_ref().expect("part present in spec")
    }

    /// The packing whose order matches this layout's own (long runs for gather and scatter).
    pub fn preferred_packing(&self) -> Packing {
        let chunk = |p: Part| self.part_map(p).chunk_elems;
        Packing { k_chunk: chunk(Part::K), v_chunk: chunk(Part::V) }
    }

    /// Block tables of a paged layout.
    pub fn block_tables(&self) -> Option<&BlockTables> {
        self.block_tables.as_ref()
    }

    /// Replace the block table of `slot` in a paged layout (checked against the pool size).
    pub fn set_block_table(&mut self, slot: u32, blocks: Vec<u32>) -> Result<(), LayoutError> {
        let LayoutKind::Paged(cfg) = self.kind else {
            return Err(LayoutError::NotPaged);
        };
        check_bound("slot", slot as u64, slot as u64 + 1, self.slots as u64)?;
        if let Some(&block) = blocks.iter().find(|&&b| b >= cfg.num_blocks) {
            return Err(LayoutError::BadBlock { slot, block, num_blocks: cfg.num_blocks });
        }
        let tables = self.block_tables.get_or_insert_with(|| BlockTables::empty(self.slots));
        tables.tables[slot as usize] = blocks;
        Ok(())
    }

    /// Whether every element of `region` (inside this layout) has bytes of its own: true of the
    /// layouts the builders make, and of a paged one unless two of the region's tokens lie in the
    /// same block (a prefix shared between slots, say); a layout built from strides may map two
    /// elements to the same bytes, so it is never assumed to. A copy into such a region may split
    /// its blocks among threads.
    pub fn region_is_injective(&self, region: &KvRegion) -> bool {
        match self.kind {
            LayoutKind::FasterTransformer | LayoutKind::PerLayer(_) | LayoutKind::Packed(_) => true,
            LayoutKind::Strided => false,
            LayoutKind::Paged(cfg) => {
                if region.is_empty() {
                    return true;
                }
                let Some(tables) = &self.block_tables else { return true };
                let bs = cfg.block_size.max(1);
                let blocks = (region.tokens.start / bs) as usize..=((region.tokens.end - 1) / bs) as usize;
                let mut seen = std::collections::HashSet::new();
                region
                    .slots
                    .clone()
                    .flat_map(|slot| tables.table(slot).get(blocks.clone()).unwrap_or(&[]))
                    .all(|block| seen.insert(*block))
            }
        }
    }

    /// Checks that `region` lies inside this layout, including every slot's token capacity.
    pub fn check_region(&self, region: &KvRegion) -> Result<(), LayoutError> {
        check_range("layer", &region.layers, self.spec.layers())?;
        check_range("slot", &region.slots, self.slots)?;
        check_range("head", &region.heads, self.spec.kv_heads())?;
        let tokens = &region.tokens;
        check_bound("token", tokens.start as u64, tokens.end as u64, u32::MAX as u64)?;
        for slot in region.slots.clone() {
            check_range("token", &region.tokens, self.token_capacity(slot))?;
        }
        Ok(())
    }

    /// Buffer and byte offset of one element. Bounds-checked: the logical accessor.
    pub fn element_offset(&self, part: Part, at: Coord, elem: u32) -> Result<(u32, u64), LayoutError> {
        if !self.spec.parts().contains(&part) {
            return Err(LayoutError::Invalid(format!("spec has no part {part:?}")));
        }
        let one = Shape { layers: 1, slots: 1, heads: 1, tokens: 1 };
        self.check_region(&KvRegion::at(at, one))?;
        check_bound("element", elem as u64, elem as u64 + 1, self.spec.vector_elems(part) as u64)?;
        let map = self.part_map(part);
        let (buffer, base) = self.vector_base(part, at);
        let chunk = (elem / map.chunk_elems) as u64;
        let within = (elem % map.chunk_elems) as u64;
        Ok((buffer, base + chunk * map.chunk_stride + within * self.spec.elem_bytes(part) as u64))
    }

    /// Buffer and offset of element 0 of a vector; `at` must be in bounds.
    pub(crate) fn vector_base(&self, part: Part, at: Coord) -> (u32, u64) {
        let map = self.part_map(part);
        let (buffer, layer_offset) = match map.buffer {
            BufferMap::Shared { buffer, layer_stride } => (buffer, at.layer as u64 * layer_stride),
            BufferMap::PerLayer { first, step } => (first + at.layer * step, 0),
        };
        let token_offset = match map.tokens {
            TokenMap::Linear { stride } => at.token as u64 * stride,
            TokenMap::Paged { block_size, block_stride, token_stride } => {
                let tables = self.block_tables.as_ref().expect("paged layouts carry tables");
                let block = tables.table(at.slot)[(at.token / block_size) as usize];
                block as u64 * block_stride + (at.token % block_size) as u64 * token_stride
            }
        };
        let offset = map.offset
            + layer_offset
            + at.slot as u64 * map.slot_stride
            + at.head as u64 * map.head_stride
            + token_offset;
        (buffer, offset)
    }

    /// How many tokens from `token` on are at a constant stride (the rest of a paged block).
    pub(crate) fn linear_tokens_from(&self, part: Part, token: u32) -> u32 {
        match self.part_map(part).tokens {
            TokenMap::Linear { .. } => u32::MAX,
            TokenMap::Paged { block_size, .. } => block_size - token % block_size,
        }
    }

    /// Byte stride between consecutive tokens inside a linear run.
    pub(crate) fn token_stride(&self, part: Part) -> u64 {
        match self.part_map(part).tokens {
            TokenMap::Linear { stride } => stride,
            TokenMap::Paged { token_stride, .. } => token_stride,
        }
    }

    /// Byte span `[lo, hi)` of every (buffer, layer) pair, for checking that layers are disjoint.
    pub(crate) fn layer_spans(&self) -> Vec<(u32, u32, Range<u64>)> {
        let mut spans = Vec::new();
        for &part in self.spec.parts() {
            let map = self.part_map(part);
            // Construction checked that every part fits its buffers, so nothing here overflows.
            let extent = self.part_extent(part).expect("checked at construction");
            for layer in 0..self.spec.layers() {
                let (buffer, base) = match map.buffer {
                    BufferMap::Shared { buffer, layer_stride } => {
                        (buffer, map.offset + layer as u64 * layer_stride)
                    }
                    BufferMap::PerLayer { first, step } => (first + layer * step, map.offset),
                };
                spans.push((buffer, layer, base..base + extent));
            }
        }
        spans
    }

    /// Whether the bytes of different layers never share a buffer range, so one layer can be
    /// written while another is read.
    pub fn layers_are_disjoint(&self) -> bool {
        // Every pair, not just neighbours: a long span can overlap a later, non-adjacent one.
        // (layers x parts spans per buffer: a few hundred at most.)
        let spans = self.layer_spans();
        spans.iter().enumerate().all(|(i, (b0, l0, s0))| {
            spans[i + 1..]
                .iter()
                .all(|(b1, l1, s1)| b0 != b1 || l0 == l1 || s0.end <= s1.start || s1.end <= s0.start)
        })
    }
}

fn check_range(axis: &'static str, range: &Range<u32>, limit: u32) -> Result<(), LayoutError> {
    check_bound(axis, range.start as u64, range.end as u64, limit as u64)
}

fn check_bound(axis: &'static str, start: u64, end: u64, limit: u64) -> Result<(), LayoutError> {
    if start > end || end > limit {
        return Err(LayoutError::OutOfBounds { axis, start, end, limit });
    }
    Ok(())
}
