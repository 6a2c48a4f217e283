//! Property tests of buffered gather and scatter across every built-in layout.
//!
//! Each case draws a random [`KvSpec`], a source layout (FasterTransformer, per-layer or paged with
//! scattered block tables), a region inside it, a packing, and a destination layout of a different
//! kind. The source is filled with random bytes through the logical accessor; the region is gathered
//! and scattered into the destination, and the result is checked element by element (through
//! [`KvCache::read_vector`]) and byte by byte (through [`KvCache::snapshot`] and
//! [`KvLayout::element_offset`]), against offsets the test computes itself.

mod common;

use common::{every_vector, Rng};

use dejavulib::layout::{BlockTables, KvInterleave, PagedConfig, PagedOrder, PerLayerOrder};
use dejavulib::{
    CacheError, Coord, DType, KvCache, KvLayout, KvRegion, KvSpec, LayoutError, Packing, Part, ScaleMode,
    Shape,
};
use proptest::prelude::*;

/// A layout family with its variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Ft,
    PerLayer(PerLayerOrder),
    Paged(PagedOrder, KvInterleave),
}

const KINDS: [Kind; 11] = [
    Kind::Ft,
    Kind::PerLayer(PerLayerOrder::Bhsd),
    Kind::PerLayer(PerLayerOrder::Bshd),
    Kind::Paged(PagedOrder::Nhd, KvInterleave::Separate),
    Kind::Paged(PagedOrder::Nhd, KvInterleave::Interleaved),
    Kind::Paged(PagedOrder::Hnd, KvInterleave::Separate),
    Kind::Paged(PagedOrder::Hnd, KvInterleave::Interleaved),
    Kind::Paged(PagedOrder::Hnd, KvInterleave::PerHead { k_chunk: 1 }),
    Kind::Paged(PagedOrder::Hnd, KvInterleave::PerHead { k_chunk: 2 }),
    Kind::Paged(PagedOrder::Nhd, KvInterleave::PerToken),
    Kind::Paged(PagedOrder::Hnd, KvInterleave::PerToken),
];

/// Whether FasterTransformer's 16-byte K pieces fit `spec`'s head size.
fn ft_fits(spec: &KvSpec) -> bool {
    spec.head_dim() % (16 / spec.dtype().size() as u32) == 0
}

/// Layout kinds usable for `spec`, leaving out `except`.
fn kinds_for(spec: &KvSpec, except: Option<Kind>) -> Vec<Kind> {
    KINDS.iter().copied().filter(|&k| k != Kind::Ft || ft_fits(spec)).filter(|&k| Some(k) != except).collect()
}

/// What a layout must hold: `slots` slots at least, and every slot of `busy` at least `tokens`
/// tokens.
struct Needs {
    slots: u32,
    busy: std::ops::Range<u32>,
    tokens: u32,
}

fn build_layout(spec: KvSpec, kind: Kind, needs: &Needs, rng: &mut Rng) -> KvLayout {
    let slots = needs.slots + rng.range(0, 1);
    match kind {
        Kind::Ft | Kind::PerLayer(_) => {
            let max_tokens = needs.tokens.max(1) + rng.range(0, 3);
            let layout = match kind {
                Kind::Ft => KvLayout::faster_transformer(spec, slots, max_tokens),
                Kind::PerLayer(order) => KvLayout::per_layer(spec, slots, max_tokens, order),
                Kind::Paged(..) => unreachable!(),
            };
            layout.unwrap_or_else(|e| panic!("{kind:?} of {spec:?}: {e}"))
        }
        Kind::Paged(order, interleave) => {
            let block_size = rng.range(2, 4);
            let counts: Vec<u32> = (0..slots)
                .map(|s| {
                    if needs.busy.contains(&s) {
                        needs.tokens.div_ceil(block_size) + rng.range(0, 1)
                    } else {
                        rng.range(0, 2)
                    }
                })
                .collect();
            let used: u32 = counts.iter().sum();
            let num_blocks = (used + rng.range(0, 3)).max(1);
            let mut pool: Vec<u32> = (0..num_blocks).collect();
            rng.shuffle(&mut pool);
            let mut free = pool.into_iter();
            let tables: Vec<Vec<u32>> =
                counts.iter().map(|&n| free.by_ref().take(n as usize).collect()).collect();
            let config = PagedConfig { block_size, num_blocks, order, interleave };
            let layout = KvLayout::paged(spec, slots, config, Some(BlockTables::from_tables(tables)))
                .unwrap_or_else(|e| panic!("{kind:?} of {spec:?}: {e}"));
            for s in needs.busy.clone() {
                assert!(layout.token_capacity(s) >= needs.tokens);
            }
            layout
        }
    }
}

fn read(cache: &KvCache, part: Part, at: Coord) -> Vec<u8> {
    let mut out = vec![0u8; cache.layout().spec().vector_bytes(part) as usize];
    cache.read_vector(part, at, &mut out).unwrap();
    out
}

/// Writes random bytes into every vector of `cache`.
fn fill(cache: &KvCache, rng: &mut Rng) {
    let spec = *cache.layout().spec();
    for (part, at) in every_vector(cache.layout()) {
        let data = rng.bytes(spec.vector_bytes(part) as usize);
        cache.write_vector(part, at, &data).unwrap();
    }
}

fn contains(region: &KvRegion, at: Coord) -> bool {
    region.layers.contains(&at.layer)
        && region.slots.contains(&at.slot)
        && region.heads.contains(&at.head)
        && region.tokens.contains(&at.token)
}

/// `at` moved from `from`'s origin to `to`'s origin.
fn translate(at: Coord, from: &KvRegion, to: &KvRegion) -> Coord {
    Coord {
        layer: at.layer - from.layers.start + to.layers.start,
        slot: at.slot - from.slots.start + to.slots.start,
        head: at.head - from.heads.start + to.heads.start,
        token: at.token - from.tokens.start + to.tokens.start,
    }
}

/// Every (relative coordinate, part, element) of a region shape.
fn region_elements(spec: &KvSpec, shape: Shape) -> Vec<(Part, Coord, u32)> {
    let mut out = Vec::new();
    for &part in spec.parts() {
        for layer in 0..shape.layers {
            for slot in 0..shape.slots {
                for head in 0..shape.heads {
                    for token in 0..shape.tokens {
                        for elem in 0..spec.vector_elems(part) {
                            let at = Coord { layer, slot, head, token };
                            out.push((part, at, elem));
                        }
                    }
                }
            }
        }
    }
    out
}

fn offset_by(at: Coord, origin: Coord) -> Coord {
    Coord {
        layer: at.layer + origin.layer,
        slot: at.slot + origin.slot,
        head: at.head + origin.head,
        token: at.token + origin.token,
    }
}

/// (bytes per element, elements per vector) of `part`, from the spec's documented sizes.
fn elem_info(spec: &KvSpec, part: Part) -> (u64, u64) {
    if part.is_scale() {
        (4, 1)
    } else {
        (spec.dtype().size() as u64, spec.head_dim() as u64)
    }
}

/// Byte offset of an element in a packed buffer, from the documented order alone:
/// `[layer][part][slot][head]`, then `[chunk][token][element in chunk]` (scales: `[token]`).
fn packed_offset(spec: &KvSpec, shape: Shape, packing: Packing, part: Part, at: Coord, elem: u32) -> u64 {
    let present: Vec<Part> = [Part::K, Part::V, Part::KScale, Part::VScale]
        .into_iter()
        .filter(|p| spec.parts().contains(p))
        .collect();
    let t = shape.tokens as u64;
    let part_block = |p: Part| {
        let (eb, ve) = elem_info(spec, p);
        shape.slots as u64 * shape.heads as u64 * t * ve * eb
    };
    let layer_bytes: u64 = present.iter().map(|&p| part_block(p)).sum();
    let before: u64 = present.iter().take_while(|&&p| p != part).map(|&p| part_block(p)).sum();
    let chunk = match part {
        Part::K => packing.k_chunk,
        Part::V => packing.v_chunk,
        Part::KScale | Part::VScale => 1,
    } as u64;
    let (eb, ve) = elem_info(spec, part);
    let head_block = t * ve * eb;
    let e = elem as u64;
    at.layer as u64 * layer_bytes
        + before
        + (at.slot as u64 * shape.heads as u64 + at.head as u64) * head_block
        + (e / chunk) * t * chunk * eb
        + at.token as u64 * chunk * eb
        + (e % chunk) * eb
}

/// One drawn case: a filled source cache, a region in it, a packing, and a destination layout with
/// a region of the same shape.
struct Case {
    spec: KvSpec,
    src: KvCache,
    region: KvRegion,
    packing: Packing,
    dst_layout: KvLayout,
    dst_region: KvRegion,
    rng: Rng,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Case")
            .field("spec", &self.spec)
            .field("src", &self.src.layout())
            .field("region", &self.region)
            .field("packing", &self.packing)
            .field("dst", &self.dst_layout)
            .field("dst_region", &self.dst_region)
            .finish()
    }
}

#[derive(Clone, Debug)]
struct Params {
    spec: KvSpec,
    src_kind: usize,
    dst_kind: usize,
    packing: u8,
    seed: u64,
}

fn spec_strategy() -> impl Strategy<Value = KvSpec> {
    let dtypes = vec![DType::F32, DType::F16, DType::BF16, DType::Fp8E4M3, DType::Int8];
    (
        1u32..=3,
        1u32..=4,
        prop::sample::select(vec![8u32, 16, 32]),
        prop::sample::select(dtypes),
        any::<bool>(),
    )
        .prop_map(|(layers, heads, head_dim, dtype, scales)| {
            let scales =
                if scales && dtype.is_quantized() { ScaleMode::PerTokenHead } else { ScaleMode::None };
            KvSpec::with_scales(layers, heads, head_dim, dtype, scales).unwrap()
        })
}

fn params() -> impl Strategy<Value = Params> {
    (spec_strategy(), 0usize..7, 0usize..6, 0u8..4, any::<u64>()).prop_map(
        |(spec, src_kind, dst_kind, packing, seed)| Params { spec, src_kind, dst_kind, packing, seed },
    )
}

fn draw(p: &Params) -> Case {
    let spec = p.spec;
    let mut rng = Rng::new(p.seed);
    let src_kinds = kinds_for(&spec, None);
    let src_kind = src_kinds[p.src_kind % src_kinds.len()];
    if !ft_fits(&spec) {
        assert!(matches!(KvLayout::faster_transformer(spec, 1, 1), Err(LayoutError::Invalid(_))));
    }
    // Source: any size; every slot can hold at least one token.
    let src_slots = rng.range(1, 3);
    let src_tokens = rng.range(1, 8);
    let src_layout =
        build_layout(spec, src_kind, &Needs { slots: src_slots, busy: 0..src_slots, tokens: 1 }, &mut rng);
    let src_layout = match src_kind {
        // Linear layouts: widen to the drawn token count.
        Kind::Ft | Kind::PerLayer(_) if src_layout.max_tokens() < src_tokens => build_layout(
            spec,
            src_kind,
            &Needs { slots: src_slots, busy: 0..src_slots, tokens: src_tokens },
            &mut rng,
        ),
        _ => src_layout,
    };
    let slots = rng.sub_range(src_slots);
    let cap = slots.clone().map(|s| src_layout.token_capacity(s)).min().unwrap();
    let region = KvRegion::new(
        rng.sub_range(spec.layers()),
        slots,
        rng.sub_range(spec.kv_heads()),
        rng.sub_range(cap),
    );
    src_layout.check_region(&region).unwrap();
    let shape = region.shape();

    // Destination: a different kind, large enough for the shape at a random origin.
    let dst_kinds = kinds_for(&spec, Some(src_kind));
    let dst_kind = dst_kinds[p.dst_kind % dst_kinds.len()];
    let origin = Coord {
        layer: rng.range(0, spec.layers() - shape.layers),
        slot: rng.range(0, 1),
        head: rng.range(0, spec.kv_heads() - shape.heads),
        token: rng.range(0, 2),
    };
    let dst_region = KvRegion::at(origin, shape);
    let dst_layout = build_layout(
        spec,
        dst_kind,
        &Needs { slots: dst_region.slots.end, busy: dst_region.slots.clone(), tokens: dst_region.tokens.end },
        &mut rng,
    );
    dst_layout.check_region(&dst_region).unwrap();

    let divisors: Vec<u32> = (0..6).map(|i| 1u32 << i).filter(|d| spec.head_dim() % d == 0).collect();
    let packing = match p.packing {
        0 => src_layout.preferred_packing(),
        1 => dst_layout.preferred_packing(),
        2 => Packing::token_major(&spec),
        _ => Packing {
            k_chunk: divisors[rng.range(0, divisors.len() as u32 - 1) as usize],
            v_chunk: divisors[rng.range(0, divisors.len() as u32 - 1) as usize],
        },
    };

    let src = KvCache::new(src_layout).unwrap();
    fill(&src, &mut rng);
    Case { spec, src, region, packing, dst_layout, dst_region, rng }
}

fn gather(cache: &KvCache, region: &KvRegion, packing: Packing) -> Vec<u8> {
    let mut out = vec![0u8; cache.packed_len(region) as usize];
    let n = cache.gather(region, packing, &mut out).unwrap();
    assert_eq!(n, out.len() as u64, "gather reports the bytes it copied");
    out
}

/// Element bytes of `part` at `at` in a snapshot of `layout`.
fn element_bytes<'a>(
    layout: &KvLayout,
    snapshot: &'a [Vec<u8>],
    part: Part,
    at: Coord,
    elem: u32,
) -> (&'a [u8], u32, u64) {
    let (buffer, offset) = layout.element_offset(part, at, elem).unwrap();
    let n = layout.spec().elem_bytes(part);
    let bytes = &snapshot[buffer as usize][offset as usize..offset as usize + n];
    (bytes, buffer, offset)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Gather from one layout, scatter into another: exactly the region moves, nothing else changes.
    #[test]
    fn gather_then_scatter_moves_exactly_the_region(p in params()) {
        let mut case = draw(&p);
        let spec = case.spec;
        let dst = KvCache::new(case.dst_layout.clone()).unwrap();
        fill(&dst, &mut case.rng);
        let before: Vec<(Part, Coord, Vec<u8>)> = every_vector(dst.layout())
            .into_iter()
            .map(|(part, at)| (part, at, read(&dst, part, at)))
            .collect();
        let snap_before = dst.snapshot();
        let src_snap = case.src.snapshot();

        let packed = gather(&case.src, &case.region, case.packing);
        prop_assert_eq!(packed.len() as u64, case.region.shape().bytes(&spec));
        prop_assert_eq!(case.src.snapshot(), src_snap.clone(), "gather left the source alone");
        let n = dst.scatter(&case.dst_region, case.packing, &packed).unwrap();
        prop_assert_eq!(n, packed.len() as u64);

        // Logical view: the region holds the source's vectors, every other vector is unchanged.
        let mut moved = 0u64;
        for (part, at, old) in &before {
            let now = read(&dst, *part, *at);
            if contains(&case.dst_region, *at) {
                let from = translate(*at, &case.dst_region, &case.region);
                prop_assert_eq!(&now, &read(&case.src, *part, from), "{:?} {:?} <- {:?} in {:?}", part, at, from, case);
                moved += 1;
            } else {
                prop_assert_eq!(&now, old, "{:?} {:?} outside the region changed in {:?}", part, at, case);
            }
        }
        prop_assert_eq!(moved, case.region.shape().vectors() * spec.parts().len() as u64);

        // Byte view: region bytes come from the source element, every other byte is unchanged.
        let snap_after = dst.snapshot();
        let mut mask: Vec<Vec<bool>> = snap_after.iter().map(|b| vec![false; b.len()]).collect();
        for (part, rel, elem) in region_elements(&spec, case.region.shape()) {
            let (want, _, _) = element_bytes(case.src.layout(), &src_snap, part, offset_by(rel, case.region.origin()), elem);
            let (got, buffer, offset) = element_bytes(dst.layout(), &snap_after, part, offset_by(rel, case.dst_region.origin()), elem);
            prop_assert_eq!(got, want, "{:?} {:?} elem {} in {:?}", part, rel, elem, case);
            for b in offset..offset + spec.elem_bytes(part) as u64 {
                let m = &mut mask[buffer as usize][b as usize];
                prop_assert!(!*m, "two region elements share byte {} of buffer {}", b, buffer);
                *m = true;
            }
        }
        let marked: usize = mask.iter().map(|m| m.iter().filter(|&&x| x).count()).sum();
        prop_assert_eq!(marked as u64, packed.len() as u64);
        for (buffer, (old, new)) in snap_before.iter().zip(&snap_after).enumerate() {
            prop_assert_eq!(old.len(), new.len());
            for (i, (a, b)) in old.iter().zip(new).enumerate() {
                if !mask[buffer][i] {
                    prop_assert_eq!(a, b, "byte {} of buffer {} outside the region changed in {:?}", i, buffer, case);
                }
            }
        }
    }

    /// Clobbering a region and scattering its earlier gather back restores every byte.
    #[test]
    fn scatter_of_gather_restores_a_clobbered_region(p in params()) {
        let case = draw(&p);
        let spec = case.spec;
        let original = case.src.snapshot();
        let packed = gather(&case.src, &case.region, case.packing);
        // Clobber every vector of the region with its own bytes inverted.
        for (part, at) in every_vector(case.src.layout()) {
            if contains(&case.region, at) {
                let bad: Vec<u8> = read(&case.src, part, at).iter().map(|b| !b).collect();
                case.src.write_vector(part, at, &bad).unwrap();
            }
        }
        let clobbered = case.src.snapshot();
        prop_assert_ne!(&clobbered, &original, "the clobber changed the cache");
        let changed: usize = clobbered
            .iter()
            .zip(&original)
            .map(|(a, b)| a.iter().zip(b).filter(|(x, y)| x != y).count())
            .sum();
        prop_assert_eq!(changed as u64, case.region.shape().bytes(&spec));
        case.src.scatter(&case.region, case.packing, &packed).unwrap();
        prop_assert!(case.src.snapshot() == original, "scatter(gather(x)) != x in {:?}", case);
    }

    /// Packed bytes sit where the documented `[layer][part][slot][head]([chunk])[token][elem]`
    /// order puts them.
    #[test]
    fn packed_bytes_follow_the_documented_order(p in params()) {
        let case = draw(&p);
        let spec = case.spec;
        let shape = case.region.shape();
        let src_snap = case.src.snapshot();
        for packing in [case.packing, Packing::token_major(&spec)] {
            let packed = gather(&case.src, &case.region, packing);
            let mut covered = vec![false; packed.len()];
            for (part, rel, elem) in region_elements(&spec, shape) {
                let at = offset_by(rel, case.region.origin());
                let (want, _, _) = element_bytes(case.src.layout(), &src_snap, part, at, elem);
                let off = packed_offset(&spec, shape, packing, part, rel, elem) as usize;
                let n = want.len();
                prop_assert_eq!(&packed[off..off + n], want, "{:?} {:?} elem {} packed {:?} in {:?}", part, rel, elem, packing, case);
                for c in &mut covered[off..off + n] {
                    prop_assert!(!*c, "packed byte {} claimed twice", off);
                    *c = true;
                }
            }
            prop_assert!(covered.iter().all(|&c| c), "every packed byte belongs to one element");
        }
    }

    /// Wrong buffer sizes and out-of-bounds regions are typed errors that write nothing.
    #[test]
    fn bad_lengths_and_regions_are_errors_that_write_nothing(
        p in params(),
        delta in prop::sample::select(vec![-3i64, -1, 1, 2, 64]),
        axis in 0usize..4,
        shift in any::<bool>(),
    ) {
        let case = draw(&p);
        let cache = &case.src;
        let snap = cache.snapshot();
        let needed = cache.packed_len(&case.region);
        let len = (needed as i64 + delta).max(0) as u64;
        let mut out = vec![0xeeu8; len as usize];
        let err = cache.gather(&case.region, case.packing, &mut out).unwrap_err();
        prop_assert_eq!(err, CacheError::WrongLength { needed, len });
        prop_assert!(out.iter().all(|&b| b == 0xee), "a failed gather wrote its buffer");
        let err = cache.scatter(&case.region, case.packing, &out).unwrap_err();
        prop_assert_eq!(err, CacheError::WrongLength { needed, len });
        prop_assert!(cache.snapshot() == snap, "a failed scatter wrote the cache");

        // Push one axis past its limit, either by its end or as a whole.
        let layout = cache.layout();
        let mut bad = case.region.clone();
        let limit = match axis {
            0 => layout.spec().layers(),
            1 => layout.slots(),
            2 => layout.spec().kv_heads(),
            _ => bad.slots.clone().map(|s| layout.token_capacity(s)).min().unwrap(),
        };
        let range = match axis {
            0 => &mut bad.layers,
            1 => &mut bad.slots,
            2 => &mut bad.heads,
            _ => &mut bad.tokens,
        };
        if shift {
            let len = range.end - range.start;
            *range = limit..limit + len;
        } else {
            range.end = limit + 1;
        }
        let (start, end) = (range.start as u64, range.end as u64);
        let (name, limit) = match axis {
            0 => ("layer", limit),
            1 => ("slot", limit),
            2 => ("head", limit),
            // Slots are checked in order: the first one too short for the tokens is reported.
            _ => (
                "token",
                bad.slots
                    .clone()
                    .map(|s| layout.token_capacity(s))
                    .find(|&c| (c as u64) < end)
                    .unwrap(),
            ),
        };
        let expected = || {
            CacheError::Layout(LayoutError::OutOfBounds {
                axis: name,
                start,
                end,
                limit: limit as u64,
            })
        };
        let mut out = vec![0xeeu8; cache.packed_len(&bad) as usize];
        prop_assert_eq!(cache.gather(&bad, case.packing, &mut out).unwrap_err(), expected());
        prop_assert!(out.iter().all(|&b| b == 0xee), "a failed gather wrote its buffer");
        prop_assert_eq!(cache.scatter(&bad, case.packing, &out).unwrap_err(), expected());
        prop_assert!(cache.snapshot() == snap, "a failed scatter wrote the cache");
    }
}

/// A region far out of bounds, so large that its packed size (2^58 vectors of 64 bytes = 2^64
/// bytes) does not fit a `u64`, is still just an out-of-bounds region: a typed error, no panic and
/// no write.
#[test]
fn a_region_whose_packed_size_overflows_is_out_of_bounds_not_a_panic() {
    let spec = KvSpec::new(2, 2, 16, DType::F16).unwrap();
    let cache = KvCache::new(KvLayout::faster_transformer(spec, 2, 4).unwrap()).unwrap();
    let mut rng = Rng::new(1);
    fill(&cache, &mut rng);
    let snap = cache.snapshot();
    let huge = KvRegion::new(0..1 << 29, 0..1 << 29, 0..1, 0..1);
    assert!(cache.layout().check_region(&huge).is_err());
    let packing = cache.layout().preferred_packing();
    let ok = |r: &Result<u64, CacheError>| {
        matches!(
            r,
            Err(CacheError::Layout(LayoutError::OutOfBounds { .. })) | Err(CacheError::WrongLength { .. })
        )
    };
    for len in [0usize, 64] {
        let mut out = vec![0xeeu8; len];
        let got =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cache.gather(&huge, packing, &mut out)));
        match got {
            Ok(r) => assert!(ok(&r), "gather of {len} bytes: {r:?}"),
            Err(_) => panic!("gather panicked on a region whose packed size overflows u64"),
        }
        assert!(out.iter().all(|&b| b == 0xee));
        let got =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cache.scatter(&huge, packing, &out)));
        match got {
            Ok(r) => assert!(ok(&r), "scatter of {len} bytes: {r:?}"),
            Err(_) => panic!("scatter panicked on a region whose packed size overflows u64"),
        }
        assert!(cache.snapshot() == snap);
    }
}

#[test]
fn a_cache_over_engine_buffers_works_in_place() {
    let spec = KvSpec::new(2, 2, 16, DType::F16).unwrap();
    let layout = KvLayout::per_layer(spec, 2, 8, dejavulib::layout::PerLayerOrder::Bhsd).unwrap();
    let mut engine: Vec<Vec<u8>> = layout.buffer_sizes().iter().map(|&n| vec![0u8; n as usize]).collect();
    let raw: Vec<(*mut u8, usize)> = engine.iter_mut().map(|b| (b.as_mut_ptr(), b.len())).collect();
    // SAFETY: the vectors outlive the cache and nothing else touches them while it lives.
    let cache = unsafe { KvCache::from_raw_buffers(layout.clone(), &raw) }.unwrap();
    let region = KvRegion::new(0..2, 0..2, 0..2, 0..8);
    let packing = layout.preferred_packing();
    let input: Vec<u8> = (0..cache.packed_len(&region)).map(|i| (i % 251) as u8).collect();
    cache.scatter(&region, packing, &input).unwrap();
    let mut back = vec![0u8; input.len()];
    cache.gather(&region, packing, &mut back).unwrap();
    assert_eq!(back, input);
    drop(cache);
    assert!(engine.iter().all(|b| b.iter().any(|&x| x != 0)), "the engine's own buffers were written");

    // Wrong count, short buffers and null pointers are typed errors.
    let short: Vec<(*mut u8, usize)> = raw.iter().map(|&(p, n)| (p, n - 1)).collect();
    let null: Vec<(*mut u8, usize)> = raw.iter().map(|&(_, n)| (std::ptr::null_mut(), n)).collect();
    for bad in [&raw[..1], &short[..], &null[..]] {
        // SAFETY: every non-null pointer is valid as above; the calls must fail before using any.
        let result = unsafe { KvCache::from_raw_buffers(layout.clone(), bad) };
        assert!(matches!(result, Err(dejavulib::CacheError::Buffers(_))), "{result:?}");
    }
}
