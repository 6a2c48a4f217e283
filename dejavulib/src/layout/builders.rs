//! The layouts engines use, each expressed as strides over [`KvLayout`].

use crate::region::Shape;
use crate::spec::{KvSpec, Part, SCALE_BYTES};

use super::{BlockTables, BufferMap, KvLayout, LayoutError, LayoutKind, Packing, PartMap, TokenMap};

/// Axis order of per-layer tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PerLayerOrder {
    /// `[B][H][S][D]`: HF transformers' past_key_values.
    Bhsd,
    /// `[B][S][H][D]`: flash-attention style caches.
    Bshd,
}

/// Order within a paged block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PagedOrder {
    /// `[block_size][H][D]` per block.
    Nhd,
    /// `[H][block_size][D]` per block.
    Hnd,
}

/// Where V blocks live relative to K blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvInterleave {
    /// One K buffer and one V buffer per layer, `[num_blocks][block]` each.
    Separate,
    /// One buffer per layer, `[num_blocks][2][block]`: each block holds its K rows then its V rows.
    Interleaved,
    /// One buffer per layer, `[num_blocks][H][2][block_size * D]`: within a block, each head's K
    /// then its V (vLLM's CPU attention backend). V is `[block_size][D]`; K is
    /// `[D / k_chunk][block_size][k_chunk]`, pieces of `k_chunk` elements of each token's vector
    /// (`k_chunk == D`: rows, as V; 1: transposed, as that backend's portable kernels keep it).
    /// Head-major, so the block's order must be [`PagedOrder::Hnd`].
    PerHead {
        /// Elements of a token's K vector kept together; divides the head size.
        k_chunk: u32,
    },
    /// One buffer per layer in which each token's K vector of a head is followed by its V vector:
    /// `[num_blocks][block_size][H][2][D]` ([`PagedOrder::Nhd`]) or `[num_blocks][H][block_size][2][D]`
    /// ([`PagedOrder::Hnd`]). This is vLLM's unified KV cache (a layer's logical
    /// `[num_blocks][H][block_size][2 * D]`, whose last axis its GPU backends split into K and V),
    /// in its layer-major layouts (`LBNHC`, `LBHNC`).
    PerToken,
}

/// Geometry of a paged KV pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PagedConfig {
    /// Tokens per block.
    pub block_size: u32,
    /// Physical blocks per layer.
    pub num_blocks: u32,
    /// Order within a block.
    pub order: PagedOrder,
    /// K/V placement.
    pub interleave: KvInterleave,
}

fn linear(stride: u64) -> TokenMap {
    TokenMap::Linear { stride }
}

/// Checks that a layout of these dimensions has a byte size far from `u64::MAX`, so the unchecked
/// stride products below cannot overflow (each is at most the total).
fn check_size(spec: &KvSpec, dims: &[u64]) -> Result<(), LayoutError> {
    let per_vector: u64 = spec.parts().iter().map(|&p| spec.vector_bytes(p)).sum();
    let start = per_vector.checked_mul(spec.layers() as u64 * 2);
    let total = dims.iter().fold(start, |acc, &d| acc.and_then(|a| a.checked_mul(d)));
    match total {
        Some(t) if t <= u64::MAX / 4 => Ok(()),
        _ => Err(LayoutError::Invalid(format!(
            "a layout of {spec:?} x {dims:?} does not fit in 64-bit offsets"
        ))),
    }
}

impl KvLayout {
    /// FasterTransformer's cache (the DéjàVu paper's engine): K `[L][B][H][D/x][S][x]` with
    /// `x = 16 / element size` (one 16-byte piece per token and chunk), V `[L][B][H][S][D]`,
    /// in buffers 0 (K) and 1 (V); scales `[L][B][H][S]` f32 in buffers 2 and 3.
    pub fn faster_transformer(spec: KvSpec, slots: u32, max_tokens: u32) -> Result<Self, LayoutError> {
        if max_tokens == 0 {
            return Err(LayoutError::Invalid("max_tokens must be at least 1".into()));
        }
        let elem = spec.dtype().size() as u64;
        let x = (16 / elem) as u32;
        if spec.head_dim() % x != 0 {
            return Err(LayoutError::Invalid(format!(
                "FasterTransformer needs head_dim divisible by x = {x}, got {}",
                spec.head_dim()
            )));
        }
        check_size(&spec, &[slots as u64, spec.kv_heads() as u64, max_tokens as u64])?;
        let (s, h, b, d) = (max_tokens as u64, spec.kv_heads() as u64, slots as u64, spec.head_dim() as u64);
        let head = d * s * elem;
        let layer = b * h * head;
        let k = PartMap {
            buffer: BufferMap::Shared { buffer: 0, layer_stride: layer },
            offset: 0,
            slot_stride: h * head,
            head_stride: head,
            tokens: linear(x as u64 * elem),
            chunk_elems: x,
            chunk_stride: s * x as u64 * elem,
        };
        let v = PartMap {
            tokens: linear(d * elem),
            chunk_elems: d as u32,
            chunk_stride: 0,
            buffer: BufferMap::Shared { buffer: 1, layer_stride: layer },
            ..k
        };
        let scale = |buffer| {
            let head = s * SCALE_BYTES as u64;
            PartMap {
                buffer: BufferMap::Shared { buffer, layer_stride: b * h * head },
                offset: 0,
                slot_stride: h * head,
                head_stride: head,
                tokens: linear(SCALE_BYTES as u64),
                chunk_elems: 1,
                chunk_stride: 0,
            }
        };
        let mut parts = vec![(Part::K, k), (Part::V, v)];
        let total = spec.layers() as u64 * layer;
        let mut sizes = vec![total, total];
        if spec.parts().len() == 4 {
            parts.push((Part::KScale, scale(2)));
            parts.push((Part::VScale, scale(3)));
            let scale_total = spec.layers() as u64 * b * h * s * SCALE_BYTES as u64;
            sizes.extend([scale_total, scale_total]);
        }
        Self::from_parts(LayoutKind::FasterTransformer, spec, slots, max_tokens, &parts, sizes, None)
    }

    /// One tensor per layer and part, as HF/PyTorch engines hold them: buffer `2l` is layer `l`'s K,
    /// `2l + 1` its V, each `[B][H][S][D]` or `[B][S][H][D]`; with scales, buffers `2L + 2l` and
    /// `2L + 2l + 1` hold `[B][H][S]` / `[B][S][H]` f32 scales.
    pub fn per_layer(
        spec: KvSpec,
        slots: u32,
        max_tokens: u32,
        order: PerLayerOrder,
    ) -> Result<Self, LayoutError> {
        if max_tokens == 0 {
            return Err(LayoutError::Invalid("max_tokens must be at least 1".into()));
        }
        let layers = spec.layers();
        check_size(&spec, &[slots as u64, spec.kv_heads() as u64, max_tokens as u64])?;
        let (s, h) = (max_tokens as u64, spec.kv_heads() as u64);
        let map = |part: Part, first: u32| {
            let vec = spec.vector_bytes(part);
            let (head_stride, token_stride) = match order {
                PerLayerOrder::Bhsd => (s * vec, vec),
                PerLayerOrder::Bshd => (vec, h * vec),
            };
            PartMap {
                buffer: BufferMap::PerLayer { first, step: 2 },
                offset: 0,
                slot_stride: h * s * vec,
                head_stride,
                tokens: linear(token_stride),
                chunk_elems: spec.vector_elems(part),
                chunk_stride: 0,
            }
        };
        let size = |part: Part| slots as u64 * h * s * spec.vector_bytes(part);
        let mut parts = vec![(Part::K, map(Part::K, 0)), (Part::V, map(Part::V, 1))];
        let mut sizes: Vec<u64> = (0..2 * layers).map(|_| size(Part::K)).collect();
        if spec.parts().len() == 4 {
            parts.push((Part::KScale, map(Part::KScale, 2 * layers)));
            parts.push((Part::VScale, map(Part::VScale, 2 * layers + 1)));
            sizes.extend((0..2 * layers).map(|_| size(Part::KScale)));
        }
        Self::from_parts(LayoutKind::PerLayer(order), spec, slots, max_tokens, &parts, sizes, None)
    }

    /// vLLM-style paged blocks. With [`KvInterleave::Separate`], buffer `2l` is layer `l`'s K pool
    /// and `2l + 1` its V pool; with [`KvInterleave::Interleaved`], buffer `l` holds both, each block
    /// K rows then V rows; with [`KvInterleave::PerHead`], buffer `l` holds both, each head of a
    /// block its K rows then its V rows; with [`KvInterleave::PerToken`], buffer `l` holds both, each
    /// token's K vector of a head then its V vector. Scale pools (if any) follow in buffers of their own, `[num_blocks][block]`
    /// in the block's order with one f32 per (token, head).
    ///
    /// Each slot starts with an empty block table: give it blocks with [`KvLayout::set_block_table`]
    /// (or pass `tables`).
    pub fn paged(
        spec: KvSpec,
        slots: u32,
        config: PagedConfig,
        tables: Option<BlockTables>,
    ) -> Result<Self, LayoutError> {
        if config.block_size == 0 || config.num_blocks == 0 {
            return Err(LayoutError::Invalid("block_size and num_blocks must be at least 1".into()));
        }
        let layers = spec.layers();
        check_size(&spec, &[config.num_blocks as u64, config.block_size as u64, spec.kv_heads() as u64])?;
        let (bs, h) = (config.block_size as u64, spec.kv_heads() as u64);
        if let KvInterleave::PerHead { k_chunk } = config.interleave {
            if config.order != PagedOrder::Hnd {
                return Err(LayoutError::Invalid(
                    "K and V interleaved per head need the HND block order".into(),
                ));
            }
            if k_chunk == 0 || spec.head_dim() % k_chunk != 0 {
                return Err(LayoutError::Invalid(format!(
                    "a K piece of {k_chunk} elements does not divide the head size {}",
                    spec.head_dim()
                )));
            }
        }
        let block_map = |part: Part, first: u32, step: u32, offset: u64, parts_per_block: u64| {
            let vec = spec.vector_bytes(part);
            let block_bytes = bs * h * vec;
            let (head_stride, token_stride) = match config.order {
                PagedOrder::Nhd => (vec, h * vec),
                PagedOrder::Hnd => (bs * vec, vec),
            };
            PartMap {
                buffer: BufferMap::PerLayer { first, step },
                offset,
                slot_stride: 0,
                head_stride,
                tokens: TokenMap::Paged {
                    block_size: config.block_size,
                    block_stride: parts_per_block * block_bytes,
                    token_stride,
                },
                chunk_elems: spec.vector_elems(part),
                chunk_stride: 0,
            }
        };
        let kv_block = bs * h * spec.vector_bytes(Part::K);
        let pool = config.num_blocks as u64 * kv_block;
        // One head's K then its V, heads one after the other in each block; a token's vector in
        // pieces of `chunk` elements, each piece of every token of the block together.
        let per_head = |part: Part, offset: u64, chunk: u32| {
            let vec = spec.vector_bytes(part);
            let piece = chunk as u64 * spec.elem_bytes(part) as u64;
            PartMap {
                buffer: BufferMap::PerLayer { first: 0, step: 1 },
                offset,
                slot_stride: 0,
                head_stride: 2 * bs * vec,
                tokens: TokenMap::Paged {
                    block_size: config.block_size,
                    block_stride: 2 * h * bs * vec,
                    token_stride: piece,
                },
                chunk_elems: chunk,
                chunk_stride: bs * piece,
            }
        };
        // Each token's and head's K vector then its V vector, `pair` bytes together.
        let per_token = |part: Part, offset: u64| {
            let pair = spec.vector_bytes(Part::K) + spec.vector_bytes(Part::V);
            let (head_stride, token_stride) = match config.order {
                PagedOrder::Nhd => (pair, h * pair),
                PagedOrder::Hnd => (bs * pair, pair),
            };
            PartMap {
                buffer: BufferMap::PerLayer { first: 0, step: 1 },
                offset,
                slot_stride: 0,
                head_stride,
                tokens: TokenMap::Paged {
                    block_size: config.block_size,
                    block_stride: bs * h * pair,
                    token_stride,
                },
                chunk_elems: spec.vector_elems(part),
                chunk_stride: 0,
            }
        };
        let (k, v, mut sizes, next) = match config.interleave {
            KvInterleave::Separate => (
                block_map(Part::K, 0, 2, 0, 1),
                block_map(Part::V, 1, 2, 0, 1),
                vec![pool; 2 * layers as usize],
                2 * layers,
            ),
            KvInterleave::Interleaved => (
                block_map(Part::K, 0, 1, 0, 2),
                block_map(Part::V, 0, 1, kv_block, 2),
                vec![2 * pool; layers as usize],
                layers,
            ),
            KvInterleave::PerHead { k_chunk } => (
                per_head(Part::K, 0, k_chunk),
                per_head(Part::V, bs * spec.vector_bytes(Part::K), spec.vector_elems(Part::V)),
                vec![2 * pool; layers as usize],
                layers,
            ),
            KvInterleave::PerToken => (
                per_token(Part::K, 0),
                per_token(Part::V, spec.vector_bytes(Part::K)),
                vec![2 * pool; layers as usize],
                layers,
            ),
        };
        let mut parts = vec![(Part::K, k), (Part::V, v)];
        if spec.parts().len() == 4 {
            parts.push((Part::KScale, block_map(Part::KScale, next, 2, 0, 1)));
            parts.push((Part::VScale, block_map(Part::VScale, next + 1, 2, 0, 1)));
            let scale_pool = config.num_blocks as u64 * bs * h * SCALE_BYTES as u64;
            sizes.extend((0..2 * layers).map(|_| scale_pool));
        }
        let tables = tables.unwrap_or_else(|| BlockTables::empty(slots));
        let mut layout = Self::from_parts(
            LayoutKind::Paged(config),
            spec,
            slots,
            0,
            &parts,
            sizes,
            Some(BlockTables::empty(slots)),
        )?;
        for slot in 0..slots {
            layout.set_block_table(slot, tables.table(slot).to_vec())?;
        }
        Ok(layout)
    }

    /// The contiguous staging format of a region of `shape`: one buffer (index 0) laid out
    /// `[layer][part][slot][head]`, each (slot, head) block in the order `packing` names.
    /// `spec` gives the elements; its layer and head counts are replaced by the shape's.
    pub fn packed(spec: &KvSpec, shape: Shape, packing: Packing) -> Result<Self, LayoutError> {
        if shape.is_empty() {
            return Err(LayoutError::Invalid(format!("cannot pack an empty region {shape:?}")));
        }
        let local = spec.share(shape.layers, shape.heads).map_err(|e| LayoutError::Invalid(e.to_string()))?;
        check_size(&local, &[shape.slots as u64, shape.heads as u64, shape.tokens as u64])?;
        let (b, h, t) = (shape.slots as u64, shape.heads as u64, shape.tokens as u64);
        let mut parts = Vec::new();
        let mut offset = 0;
        let mut dense = Vec::new();
        for &part in local.parts() {
            let chunk = packing.chunk(part, &local);
            let head_bytes = t * local.vector_bytes(part);
            dense.push((part, chunk, offset, head_bytes));
            offset += b * h * head_bytes;
        }
        let layer_stride = offset;
        for (part, chunk, offset, head_bytes) in dense {
            let elem = local.elem_bytes(part) as u64;
            parts.push((
                part,
                PartMap {
                    buffer: BufferMap::Shared { buffer: 0, layer_stride },
                    offset,
                    slot_stride: h * head_bytes,
                    head_stride: head_bytes,
                    tokens: linear(chunk as u64 * elem),
                    chunk_elems: chunk,
                    chunk_stride: t * chunk as u64 * elem,
                },
            ));
        }
        let size = layer_stride * shape.layers as u64;
        Self::from_parts(
            LayoutKind::Packed(packing),
            local,
            shape.slots,
            shape.tokens,
            &parts,
            vec![size],
            None,
        )
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use crate::region::{Coord, KvRegion};
    use crate::spec::{DType, ScaleMode};

    /// Every element of every part maps to its own bytes: no two elements share a byte.
    fn assert_injective(layout: &KvLayout) {
        let spec = *layout.spec();
        let mut seen = HashSet::new();
        for &part in spec.parts() {
            let elem = spec.elem_bytes(part) as u64;
            for layer in 0..spec.layers() {
                for slot in 0..layout.slots() {
                    for head in 0..spec.kv_heads() {
                        for token in 0..layout.token_capacity(slot) {
                            for e in 0..spec.vector_elems(part) {
                                let at = Coord { layer, slot, head, token };
                                let (buf, off) = layout.element_offset(part, at, e).unwrap();
                                let size = layout.buffer_sizes()[buf as usize];
                                assert!(off + elem <= size, "{part:?} {at:?} {e} past end");
                                assert!(seen.insert((buf, off)), "{part:?} {at:?} {e} aliases");
                            }
                        }
                    }
                }
            }
        }
    }

    fn spec(dtype: DType, scales: ScaleMode) -> KvSpec {
        KvSpec::with_scales(2, 3, 16, dtype, scales).unwrap()
    }

    #[test]
    fn builders_are_injective_and_in_bounds() {
        for (dtype, scales) in [
            (DType::F16, ScaleMode::None),
            (DType::F32, ScaleMode::None),
            (DType::Int8, ScaleMode::PerTokenHead),
        ] {
            let s = spec(dtype, scales);
            assert_injective(&KvLayout::faster_transformer(s, 2, 5).unwrap());
            for order in [PerLayerOrder::Bhsd, PerLayerOrder::Bshd] {
                assert_injective(&KvLayout::per_layer(s, 2, 5, order).unwrap());
            }
            for order in [PagedOrder::Nhd, PagedOrder::Hnd] {
                let per_head = [1, 4, 16].map(|k_chunk| KvInterleave::PerHead { k_chunk });
                let per_head = per_head.into_iter().filter(|_| order == PagedOrder::Hnd);
                let shared = [KvInterleave::Separate, KvInterleave::Interleaved, KvInterleave::PerToken];
                for interleave in shared.into_iter().chain(per_head) {
                    let cfg = PagedConfig { block_size: 4, num_blocks: 5, order, interleave };
                    let tables = BlockTables::from_tables(vec![vec![3, 0], vec![4, 1, 2]]);
                    let layout = KvLayout::paged(s, 2, cfg, Some(tables)).unwrap();
                    assert_eq!(layout.token_capacity(1), 12);
                    assert_injective(&layout);
                    assert!(layout.layers_are_disjoint());
                }
            }
            let shape = Shape { layers: 2, slots: 2, heads: 3, tokens: 5 };
            for packing in [Packing::token_major(&s), Packing { k_chunk: 4, v_chunk: 8 }] {
                let packed = KvLayout::packed(&s, shape, packing).unwrap();
                assert_eq!(packed.buffer_sizes()[0], shape.bytes(&s));
                assert_injective(&packed);
            }
        }
    }

    #[test]
    fn per_head_interleave_is_the_vllm_cpu_backends_block() {
        // vLLM's CPU backend: per block and head, K as `[D / x][block_size][x]`, then V as
        // `[block_size][D]`.
        let (bs, h, d, blocks) = (4u64, 3u64, 16u64, 5u32);
        let s = KvSpec::new(2, h as u32, d as u32, DType::F16).unwrap();
        let tables = || Some(BlockTables::from_tables(vec![vec![3, 1]]));
        for x in [1u64, 2, 16] {
            let interleave = KvInterleave::PerHead { k_chunk: x as u32 };
            let cfg =
                PagedConfig { block_size: bs as u32, num_blocks: blocks, order: PagedOrder::Hnd, interleave };
            let layout = KvLayout::paged(s, 1, cfg, tables()).unwrap();
            assert_eq!(layout.buffer_sizes(), &[blocks as u64 * h * 2 * bs * d * 2; 2][..]);
            for (token, block) in [(2u64, 3u64), (6, 1)] {
                let at = Coord { layer: 1, slot: 0, head: 2, token: token as u32 };
                let head = (block * h + 2) * 2 * bs * d;
                let (t, e) = (token % bs, 5);
                let k = head + (e / x) * bs * x + t * x + e % x;
                let v = head + bs * d + t * d + e;
                assert_eq!(
                    layout.element_offset(Part::K, at, e as u32).unwrap(),
                    (1, k * 2),
                    "K {x} {token}"
                );
                assert_eq!(
                    layout.element_offset(Part::V, at, e as u32).unwrap(),
                    (1, v * 2),
                    "V {x} {token}"
                );
            }
        }
        let rows = KvInterleave::PerHead { k_chunk: 16 };
        let nhd = PagedConfig { block_size: 4, num_blocks: 5, order: PagedOrder::Nhd, interleave: rows };
        assert!(matches!(KvLayout::paged(s, 1, nhd, None), Err(LayoutError::Invalid(_))));
        let uneven = KvInterleave::PerHead { k_chunk: 3 };
        let uneven = PagedConfig { order: PagedOrder::Hnd, interleave: uneven, ..nhd };
        assert!(matches!(KvLayout::paged(s, 1, uneven, None), Err(LayoutError::Invalid(_))));
    }

    #[test]
    fn per_token_interleave_is_vllms_unified_block() {
        // vLLM's unified cache: a layer's `[num_blocks][H][block_size][2 * D]`, stored with the
        // token axis outside the head axis (NHD) or inside it (HND); K then V in the last axis.
        let (bs, h, d, blocks) = (4u64, 3u64, 16u64, 5u32);
        let s = KvSpec::new(2, h as u32, d as u32, DType::F16).unwrap();
        for order in [PagedOrder::Nhd, PagedOrder::Hnd] {
            let interleave = KvInterleave::PerToken;
            let cfg = PagedConfig { block_size: bs as u32, num_blocks: blocks, order, interleave };
            let tables = BlockTables::from_tables(vec![vec![3, 1]]);
            let layout = KvLayout::paged(s, 1, cfg, Some(tables)).unwrap();
            assert_eq!(layout.buffer_sizes(), &[blocks as u64 * bs * h * 2 * d * 2; 2][..]);
            for (token, block) in [(2u64, 3u64), (6, 1)] {
                let at = Coord { layer: 1, slot: 0, head: 2, token: token as u32 };
                let (t, e) = (token % bs, 5);
                let vector = match order {
                    PagedOrder::Nhd => ((block * bs + t) * h + 2) * 2 * d,
                    PagedOrder::Hnd => ((block * h + 2) * bs + t) * 2 * d,
                };
                let k = layout.element_offset(Part::K, at, e as u32).unwrap();
                let v = layout.element_offset(Part::V, at, e as u32).unwrap();
                assert_eq!(k, (1, (vector + e) * 2), "K {order:?} {token}");
                assert_eq!(v, (1, (vector + d + e) * 2), "V {order:?} {token}");
            }
        }
    }

    #[test]
    fn faster_transformer_k_piece_is_16_bytes() {
        let s = KvSpec::new(1, 1, 128, DType::F16).unwrap();
        let layout = KvLayout::faster_transformer(s, 1, 10).unwrap();
        let (_, a) = layout.element_offset(Part::K, Coord::default(), 7).unwrap();
        let (_, b) = layout.element_offset(Part::K, Coord::default(), 8).unwrap();
        assert_eq!(a, 14);
        assert_eq!(b, 10 * 16, "next chunk is S * 16 bytes on");
    }

    #[test]
    fn bad_paged_blocks_and_regions_are_errors() {
        let s = spec(DType::F16, ScaleMode::None);
        let cfg = PagedConfig {
            block_size: 4,
            num_blocks: 2,
            order: PagedOrder::Nhd,
            interleave: KvInterleave::Separate,
        };
        let mut layout = KvLayout::paged(s, 1, cfg, None).unwrap();
        assert!(matches!(layout.set_block_table(0, vec![2]), Err(LayoutError::BadBlock { .. })));
        layout.set_block_table(0, vec![1]).unwrap();
        let at = Coord { token: 4, ..Coord::default() };
        assert!(matches!(
            layout.element_offset(Part::K, at, 0),
            Err(LayoutError::OutOfBounds { axis: "token", .. })
        ));
        let ft = KvLayout::faster_transformer(KvSpec::new(1, 1, 12, DType::F16).unwrap(), 1, 1);
        assert!(matches!(ft, Err(LayoutError::Invalid(_))));
    }

    #[test]
    fn overlapping_layers_are_found_even_when_not_adjacent() {
        // K spans [0, 80) for layer 0; V's layer 1 span [64, 96) overlaps it, but V's layer 0 span
        // [16, 48) sorts between them.
        let s = KvSpec::new(2, 1, 4, DType::F32).unwrap();
        let base = PartMap {
            buffer: BufferMap::Shared { buffer: 0, layer_stride: 1000 },
            offset: 0,
            slot_stride: 64,
            head_stride: 0,
            tokens: TokenMap::Linear { stride: 0 },
            chunk_elems: 4,
            chunk_stride: 0,
        };
        let v = PartMap {
            buffer: BufferMap::Shared { buffer: 0, layer_stride: 48 },
            offset: 16,
            slot_stride: 16,
            ..base
        };
        let layout = KvLayout::strided(s, 2, 1, &[(Part::K, base), (Part::V, v)], vec![1080]).unwrap();
        assert!(!layout.layers_are_disjoint());
    }

    #[test]
    fn huge_dimensions_are_errors_not_overflows() {
        let s = KvSpec::new(1 << 20, 1 << 20, 1 << 20, DType::F16).unwrap();
        assert!(matches!(KvLayout::faster_transformer(s, 1 << 20, 1 << 20), Err(LayoutError::Invalid(_))));
        assert!(matches!(
            KvLayout::per_layer(s, 1 << 20, 1 << 20, PerLayerOrder::Bhsd),
            Err(LayoutError::Invalid(_))
        ));
        let shape = Shape { layers: 1 << 20, slots: 1 << 20, heads: 1 << 20, tokens: 1 << 20 };
        assert!(matches!(
            KvLayout::packed(&s, shape, Packing::token_major(&s)),
            Err(LayoutError::Invalid(_))
        ));
        let cfg = PagedConfig {
            block_size: u32::MAX,
            num_blocks: u32::MAX,
            order: PagedOrder::Nhd,
            interleave: KvInterleave::Separate,
        };
        assert!(matches!(KvLayout::paged(s, 1, cfg, None), Err(LayoutError::Invalid(_))));
    }

    #[test]
    fn strided_layout_checks_buffer_sizes() {
        let s = KvSpec::new(1, 1, 4, DType::F32).unwrap();
        let map = PartMap {
            buffer: BufferMap::Shared { buffer: 0, layer_stride: 0 },
            offset: 0,
            slot_stride: 0,
            head_stride: 0,
            tokens: TokenMap::Linear { stride: 16 },
            chunk_elems: 4,
            chunk_stride: 0,
        };
        let v = PartMap { offset: 32, ..map };
        let ok = KvLayout::strided(s, 1, 2, &[(Part::K, map), (Part::V, v)], vec![64]);
        // Strides may map two elements to one byte: never split among threads.
        let region = KvRegion::new(0..1, 0..1, 0..1, 0..2);
        assert!(!ok.unwrap().region_is_injective(&region));
        assert!(KvLayout::faster_transformer(s, 1, 2).unwrap().region_is_injective(&region));
        let small = KvLayout::strided(s, 1, 2, &[(Part::K, map), (Part::V, v)], vec![63]);
        assert!(matches!(small, Err(LayoutError::BufferTooSmall { needed: 64, .. })));
    }
}
