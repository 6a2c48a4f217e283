//! Integration tests of resharding: `stream_out` from every worker of one pipeline setup into a
//! [`HostStore`], `stream_in` at every worker of another, then an element-by-element check of every
//! destination cache against a value function of *global* coordinates.
//!
//! The value function is never zero, so a zeroed destination element that should have been
//! streamed is caught, and elements outside the streamed token range must stay zero, so stray
//! writes are caught too. Global coordinates are computed here with the test's own arithmetic,
//! independently of `Setup::holding` and of the planner.

mod common;

use common::Rng;

use std::collections::HashSet;
use std::ops::Range;

use dejavulib::layout::{BlockTables, KvInterleave, PagedConfig, PagedOrder, PerLayerOrder};
use dejavulib::placement::SetupError;
use dejavulib::reshard::{StreamError, StreamStats};
use dejavulib::store::StoreError;
use dejavulib::{
    plan_stream_in, plan_stream_out, stream_in, stream_out, Coord, DType, KvCache, KvLayout, KvSpec, Part,
    ScaleMode, Setup, StageSpec, StagingPool, WorkerId,
};
use dejavulib::{ChunkStore, HostStore};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------------
// The value function and the test's own view of who holds what.
// ---------------------------------------------------------------------------------------------

/// Byte `byte` of the (part, layer, request, head, token) vector, in global coordinates. Never 0.
fn f(part: Part, layer: u32, request: u32, head: u32, token: u32, byte: u32) -> u8 {
    common::kv_byte(0x9e37_79b9_7f4a_7c15, part, layer, request, head, token, byte)
}

/// What a worker holds, computed from the stage list with the test's own arithmetic.
#[derive(Clone, Debug)]
struct Share {
    layers: Range<u32>,
    heads: Range<u32>,
    primary: bool,
}

fn share(setup: &Setup, w: WorkerId) -> Share {
    let stage = &setup.stages()[w.stage as usize];
    let kv = setup.spec().kv_heads();
    let tp = stage.tp;
    let (heads, primary) = if tp <= kv {
        (w.rank * kv / tp..(w.rank + 1) * kv / tp, true)
    } else {
        let replicas = tp / kv;
        let head = w.rank / replicas;
        (head..head + 1, w.rank % replicas == 0)
    };
    Share { layers: stage.layers.clone(), heads, primary }
}

fn workers(setup: &Setup) -> Vec<WorkerId> {
    let mut out = Vec::new();
    for (s, stage) in setup.stages().iter().enumerate() {
        for rank in 0..stage.tp {
            out.push(WorkerId { stage: s as u32, rank });
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Caches.
// ---------------------------------------------------------------------------------------------

/// Which engine layout a worker's caches use.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Ft,
    PerLayer(PerLayerOrder),
    Paged { block_size: u32, order: PagedOrder, interleave: KvInterleave },
}

const BHSD: Kind = Kind::PerLayer(PerLayerOrder::Bhsd);
const BSHD: Kind = Kind::PerLayer(PerLayerOrder::Bshd);
const PAGED_NHD: Kind =
    Kind::Paged { block_size: 4, order: PagedOrder::Nhd, interleave: KvInterleave::Separate };
const PAGED_HND: Kind =
    Kind::Paged { block_size: 3, order: PagedOrder::Hnd, interleave: KvInterleave::Interleaved };

/// A zeroed cache holding at least `tokens` tokens per slot. Paged caches get scattered,
/// non-monotonic block tables (plus one unused block).
fn make_cache(spec: KvSpec, slots: u32, tokens: u32, kind: Kind) -> KvCache {
    let layout = match kind {
        Kind::Ft => KvLayout::faster_transformer(spec, slots, tokens).unwrap(),
        Kind::PerLayer(order) => KvLayout::per_layer(spec, slots, tokens, order).unwrap(),
        Kind::Paged { block_size, order, interleave } => {
            let per_slot = tokens.div_ceil(block_size);
            let num_blocks = slots * per_slot + 1;
            let tables = (0..slots)
                .map(|s| (0..per_slot).map(|j| num_blocks - 1 - (j * slots + s)).collect())
                .collect();
            let config = PagedConfig { block_size, num_blocks, order, interleave };
            KvLayout::paged(spec, slots, config, Some(BlockTables::from_tables(tables))).unwrap()
        }
    };
    KvCache::new(layout).unwrap()
}

/// One pipeline setup with a cache per (worker, microbatch).
struct Side {
    setup: Setup,
    workers: Vec<WorkerId>,
    /// `caches[worker index][microbatch]`.
    caches: Vec<Vec<KvCache>>,
}

impl Side {
    /// Zeroed caches; worker `i` uses `kinds[i % kinds.len()]`.
    fn new(setup: Setup, kinds: &[Kind], tokens: u32) -> Self {
        let workers = workers(&setup);
        assert_eq!(workers, setup.workers().collect::<Vec<_>>());
        let caches = workers
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                let sh = share(&setup, w);
                let spec = setup.local_spec(w).unwrap();
                // The library's local spec must agree with the test's own arithmetic.
                assert_eq!(spec.layers(), sh.layers.len() as u32, "{w:?}");
                assert_eq!(spec.kv_heads(), sh.heads.len() as u32, "{w:?}");
                let kind = kinds[i % kinds.len()];
                (0..setup.microbatches())
                    .map(|_| make_cache(spec, setup.microbatch_slots(), tokens, kind))
                    .collect()
            })
            .collect();
        Self { setup, workers, caches }
    }

    /// Writes `f` at global coordinates into every vector of `tokens` of every cache.
    fn fill(&self, tokens: Range<u32>) {
        let slots = self.setup.microbatch_slots();
        for (i, &w) in self.workers.iter().enumerate() {
            let sh = share(&self.setup, w);
            for (m, cache) in self.caches[i].iter().enumerate() {
                let spec = *cache.layout().spec();
                for &part in spec.parts() {
                    let len = spec.vector_bytes(part) as u32;
                    for layer in 0..spec.layers() {
                        for slot in 0..slots {
                            for head in 0..spec.kv_heads() {
                                for token in tokens.clone() {
                                    let data: Vec<u8> = (0..len)
                                        .map(|b| {
                                            f(
                                                part,
                                                sh.layers.start + layer,
                                                m as u32 * slots + slot,
                                                sh.heads.start + head,
                                                token,
                                                b,
                                            )
                                        })
                                        .collect();
                                    let at = Coord { layer, slot, head, token };
                                    cache.write_vector(part, at, &data).unwrap();
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Checks every vector of every cache, over each slot's whole token capacity: `f` where
    /// `streamed(token)`, zero elsewhere. Panics with the first mismatches and their count.
    fn check(&self, what: &str, streamed: impl Fn(u32) -> bool) {
        let slots = self.setup.microbatch_slots();
        let mut bad = Vec::new();
        let mut count = 0u64;
        let mut checked = 0u64;
        for (i, &w) in self.workers.iter().enumerate() {
            let sh = share(&self.setup, w);
            for (m, cache) in self.caches[i].iter().enumerate() {
                let spec = *cache.layout().spec();
                for &part in spec.parts() {
                    let len = spec.vector_bytes(part) as u32;
                    let mut got = vec![0u8; len as usize];
                    for layer in 0..spec.layers() {
                        for slot in 0..slots {
                            for head in 0..spec.kv_heads() {
                                for token in 0..cache.layout().token_capacity(slot) {
                                    let at = Coord { layer, slot, head, token };
                                    cache.read_vector(part, at, &mut got).unwrap();
                                    let expected: Vec<u8> = (0..len)
                                        .map(|b| {
                                            if streamed(token) {
                                                f(
                                                    part,
                                                    sh.layers.start + layer,
                                                    m as u32 * slots + slot,
                                                    sh.heads.start + head,
                                                    token,
                                                    b,
                                                )
                                            } else {
                                                0
                                            }
                                        })
                                        .collect();
                                    checked += 1;
                                    if got != expected {
                                        count += 1;
                                        if bad.len() < 5 {
                                            bad.push(format!(
                                                "worker {w:?} mb {m} {part:?} local {at:?} \
                                                 (global layer {}, head {}, request {}): \
                                                 got {got:?}, expected {expected:?}",
                                                sh.layers.start + layer,
                                                sh.heads.start + head,
                                                m as u32 * slots + slot
                                            ));
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 0, "{what}: nothing checked");
        assert!(bad.is_empty(), "{what}: {count} of {checked} vectors wrong; first: \n{}", bad.join("\n"));
    }

    /// KV bytes this side holds for `tokens` tokens of every request, replicas included.
    fn bytes_for(&self, tokens: u32) -> u64 {
        self.workers
            .iter()
            .map(|&w| {
                let sh = share(&self.setup, w);
                let spec = self.setup.spec().share(sh.layers.len() as u32, sh.heads.len() as u32).unwrap();
                spec.bytes_per_token() * self.setup.requests() as u64 * tokens as u64
            })
            .sum()
    }
}

/// Totals of one resharding round.
#[derive(Debug, Default)]
struct Round {
    out: StreamStats,
    into: StreamStats,
}

/// `stream_out` at every worker of `a`, then `stream_in` at every worker of `b`, for `tokens`.
fn reshard(a: &Side, b: &Side, tokens: Range<u32>, store: &HostStore) -> Round {
    let pool = StagingPool::new(4);
    let mut round = Round::default();
    for (i, &w) in a.workers.iter().enumerate() {
        let transfers = plan_stream_out(&a.setup, w, &b.setup).unwrap();
        if !share(&a.setup, w).primary {
            assert!(
                transfers.is_empty(),
                "non-primary GQA replica {w:?} must send nothing, plans {transfers:?}"
            );
        }
        for t in &transfers {
            assert_eq!(t.source, w);
        }
        let caches: Vec<&KvCache> = a.caches[i].iter().collect();
        let mut sink = store.clone();
        let stats = stream_out(&caches, &transfers, tokens.clone(), &pool, &mut sink).unwrap();
        assert_eq!(stats.chunks, transfers.len() as u64);
        round.out.chunks += stats.chunks;
        round.out.bytes += stats.bytes;
    }
    // Each chunk sent leased exactly one staging buffer from the pool.
    let pool_stats = pool.stats();
    assert_eq!(pool_stats.allocations + pool_stats.reuses, round.out.chunks);
    for (j, &w) in b.workers.iter().enumerate() {
        let expected = plan_stream_in(&a.setup, &b.setup, w).unwrap();
        assert!(!expected.is_empty(), "{w:?} of B receives nothing");
        for t in &expected {
            assert_eq!(t.destination, w);
        }
        let caches: Vec<&KvCache> = b.caches[j].iter().collect();
        let mut source = store.clone();
        let stats = stream_in(&caches, &expected, tokens.clone(), &mut source).unwrap();
        assert_eq!(stats.chunks, expected.len() as u64);
        round.into.chunks += stats.chunks;
        round.into.bytes += stats.bytes;
    }
    round
}

/// Asserts the put log holds no key twice, and as many keys as chunks were sent.
fn assert_unique_keys(store: &HostStore, sent_chunks: u64) {
    let log = store.put_log();
    let unique: HashSet<_> = log.iter().collect();
    assert_eq!(unique.len(), log.len(), "a chunk key was put twice");
    assert_eq!(log.len() as u64, sent_chunks);
    assert_eq!(store.len(), log.len());
}

/// The full scenario: fill A over `0..tokens`, stream the prompt `0..tokens-1`, check B, then
/// stream the last token alone (a decode step), check B again. Byte totals must equal what B holds.
fn run_case(a: Setup, a_kinds: &[Kind], b: Setup, b_kinds: &[Kind], tokens: u32) {
    assert!(tokens >= 1);
    // One spare token of capacity: it must stay zero everywhere in B.
    let a = Side::new(a, a_kinds, tokens + 1);
    let b = Side::new(b, b_kinds, tokens + 1);
    a.fill(0..tokens);
    let store = HostStore::new().logging_puts();
    let mut sent = 0;
    let prompt = tokens - 1;
    if prompt > 0 {
        let r = reshard(&a, &b, 0..prompt, &store);
        assert_eq!(r.into.bytes, b.bytes_for(prompt), "received bytes (prompt)");
        assert_eq!(r.out.bytes, r.into.bytes, "sent bytes (prompt)");
        assert_eq!(r.out.chunks, r.into.chunks);
        sent += r.out.chunks;
        assert_unique_keys(&store, sent);
        b.check("after prompt", |t| t < prompt);
    }
    let r = reshard(&a, &b, prompt..tokens, &store);
    assert_eq!(r.into.bytes, b.bytes_for(1), "received bytes (decode step)");
    assert_eq!(r.out.bytes, r.into.bytes, "sent bytes (decode step)");
    sent += r.out.chunks;
    assert_unique_keys(&store, sent);
    b.check("after decode step", |t| t < tokens);
}

fn f16(layers: u32, kv_heads: u32) -> KvSpec {
    KvSpec::new(layers, kv_heads, 16, DType::F16).unwrap()
}

fn stages(split: &[(u32, u32)]) -> Vec<StageSpec> {
    let mut start = 0;
    split
        .iter()
        .map(|&(layers, tp)| {
            let s = StageSpec { layers: start..start + layers, tp };
            start += layers;
            s
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Named cases.
// ---------------------------------------------------------------------------------------------

#[test]
fn depth_change_four_stages_to_two() {
    let spec = f16(8, 2);
    let a = Setup::uniform(spec, 4, 1, 3, 2).unwrap();
    let b = Setup::uniform(spec, 2, 1, 3, 2).unwrap();
    run_case(a, &[Kind::Ft, BHSD, PAGED_NHD], b, &[PAGED_HND, BSHD], 5);
}

#[test]
fn depth_change_two_stages_to_four() {
    let spec = f16(8, 2);
    let a = Setup::uniform(spec, 2, 1, 3, 2).unwrap();
    let b = Setup::uniform(spec, 4, 1, 3, 2).unwrap();
    run_case(a, &[PAGED_NHD, Kind::Ft], b, &[BSHD, PAGED_HND, Kind::Ft], 5);
}

#[test]
fn tp_merge_two_to_one() {
    let spec = f16(4, 4);
    let a = Setup::uniform(spec, 2, 2, 2, 2).unwrap();
    let b = Setup::uniform(spec, 2, 1, 2, 2).unwrap();
    run_case(a, &[Kind::Ft, PAGED_NHD, BHSD], b, &[PAGED_HND, BSHD], 6);
}

#[test]
fn tp_split_one_to_two() {
    let spec = f16(4, 4);
    let a = Setup::uniform(spec, 2, 1, 2, 2).unwrap();
    let b = Setup::uniform(spec, 2, 2, 2, 2).unwrap();
    run_case(a, &[BHSD, Kind::Ft], b, &[PAGED_HND, BSHD, Kind::Ft, PAGED_NHD], 6);
}

#[test]
fn batch_split_sixteen_slots_into_two_microbatches_of_eight() {
    let spec = f16(2, 2);
    let a = Setup::uniform(spec, 1, 2, 16, 1).unwrap();
    let b = Setup::uniform(spec, 2, 1, 8, 2).unwrap();
    run_case(a, &[Kind::Ft, PAGED_NHD], b, &[PAGED_HND, BSHD], 4);
}

#[test]
fn batch_merge_two_microbatches_of_eight_into_sixteen_slots() {
    let spec = f16(2, 2);
    let a = Setup::uniform(spec, 2, 1, 8, 2).unwrap();
    let b = Setup::uniform(spec, 1, 2, 16, 1).unwrap();
    run_case(a, &[PAGED_HND, BSHD], b, &[Kind::Ft, PAGED_NHD], 4);
}

#[test]
fn batch_regroup_with_unaligned_microbatches() {
    // 12 requests: 3 x 4 -> 2 x 6, so B's microbatch 0 takes A's 0 and half of A's 1.
    let spec = f16(3, 2);
    let a = Setup::uniform(spec, 3, 2, 4, 3).unwrap();
    let b = Setup::uniform(spec, 1, 1, 6, 2).unwrap();
    run_case(a, &[Kind::Ft, BHSD, PAGED_NHD], b, &[PAGED_HND], 3);
}

#[test]
fn hexgen_asymmetric_split_6_3_1_at_tp_4_2_2_to_5_5_at_tp_1_4() {
    let spec = f16(10, 4);
    let a = Setup::new(spec, stages(&[(6, 4), (3, 2), (1, 2)]), 2, 2).unwrap();
    let b = Setup::new(spec, stages(&[(5, 1), (5, 4)]), 4, 1).unwrap();
    run_case(a, &[Kind::Ft, BHSD, PAGED_NHD], b, &[PAGED_HND, BSHD, Kind::Ft], 4);
}

#[test]
fn hexgen_back_5_5_at_tp_1_4_to_6_3_1_at_tp_4_2_2() {
    let spec = f16(10, 4);
    let a = Setup::new(spec, stages(&[(5, 1), (5, 4)]), 4, 1).unwrap();
    let b = Setup::new(spec, stages(&[(6, 4), (3, 2), (1, 2)]), 2, 2).unwrap();
    run_case(a, &[BSHD, PAGED_HND], b, &[PAGED_NHD, Kind::Ft, BHSD], 4);
}

#[test]
fn gqa_tp4_to_tp8_with_two_kv_heads_every_replica_receives() {
    let spec = f16(4, 2);
    let a = Setup::uniform(spec, 2, 4, 2, 2).unwrap();
    let b = Setup::uniform(spec, 1, 8, 2, 2).unwrap();
    // The primaries of A are ranks 0 and 2; the others must plan nothing.
    let primaries: Vec<_> =
        a.workers().filter(|&w| !plan_stream_out(&a, w, &b).unwrap().is_empty()).collect();
    let expected: Vec<_> = workers(&a).into_iter().filter(|&w| w.rank % 2 == 0).collect();
    assert_eq!(primaries, expected);
    run_case(a, &[Kind::Ft, PAGED_NHD, BHSD], b, &[PAGED_HND, BSHD, Kind::Ft], 4);
}

#[test]
fn gqa_tp8_to_tp2_with_two_kv_heads_only_primaries_send() {
    let spec = f16(4, 2);
    let a = Setup::uniform(spec, 1, 8, 2, 2).unwrap();
    let b = Setup::uniform(spec, 2, 2, 2, 2).unwrap();
    for w in a.workers() {
        let plan = plan_stream_out(&a, w, &b).unwrap();
        assert_eq!(plan.is_empty(), w.rank % 4 != 0, "{w:?}: {plan:?}");
    }
    run_case(a, &[BSHD, Kind::Ft], b, &[PAGED_NHD, BHSD], 4);
}

#[test]
fn gqa_tp8_to_tp4_replicas_on_both_sides() {
    let spec = f16(2, 2);
    let a = Setup::uniform(spec, 1, 8, 2, 1).unwrap();
    let b = Setup::uniform(spec, 2, 4, 1, 2).unwrap();
    run_case(a, &[PAGED_HND, Kind::Ft, BHSD], b, &[BSHD, PAGED_NHD], 3);
}

#[test]
fn mqa_single_kv_head_tp1_to_tp4() {
    let spec = f16(3, 1);
    let a = Setup::uniform(spec, 3, 1, 2, 2).unwrap();
    let b = Setup::uniform(spec, 1, 4, 4, 1).unwrap();
    run_case(a, &[Kind::Ft, PAGED_NHD], b, &[BSHD, PAGED_HND, Kind::Ft, BHSD], 3);
}

#[test]
fn quantized_int8_with_per_token_head_scales_travels_with_scales() {
    let spec = KvSpec::with_scales(4, 4, 16, DType::Int8, ScaleMode::PerTokenHead).unwrap();
    assert_eq!(spec.parts().len(), 4);
    let a = Setup::new(spec, stages(&[(3, 2), (1, 4)]), 2, 2).unwrap();
    let b = Setup::new(spec, stages(&[(1, 1), (3, 2)]), 4, 1).unwrap();
    run_case(a, &[Kind::Ft, PAGED_NHD, BHSD], b, &[PAGED_HND, BSHD, Kind::Ft], 5);
}

#[test]
fn quantized_int8_gqa_tp_above_kv_heads() {
    let spec = KvSpec::with_scales(2, 2, 16, DType::Int8, ScaleMode::PerTokenHead).unwrap();
    let a = Setup::uniform(spec, 2, 4, 2, 1).unwrap();
    let b = Setup::uniform(spec, 1, 1, 1, 2).unwrap();
    run_case(a, &[PAGED_HND, Kind::Ft], b, &[BSHD], 3);
}

#[test]
fn f32_identity_reshard_same_setup_different_layouts() {
    let spec = KvSpec::new(2, 2, 8, DType::F32).unwrap();
    let a = Setup::uniform(spec, 2, 2, 3, 2).unwrap();
    let b = a.clone();
    run_case(a, &[Kind::Ft, BHSD], b, &[PAGED_NHD, PAGED_HND], 7);
}

// ---------------------------------------------------------------------------------------------
// Errors.
// ---------------------------------------------------------------------------------------------

#[test]
fn incompatible_setups_are_errors() {
    let spec = f16(4, 2);
    let a = Setup::uniform(spec, 2, 1, 4, 2).unwrap();
    let w0 = WorkerId { stage: 0, rank: 0 };

    // Different request count: 8 vs 6.
    let fewer = Setup::uniform(spec, 2, 1, 3, 2).unwrap();
    let incompatible = |r: Result<Vec<dejavulib::Transfer>, StreamError>| {
        matches!(r, Err(StreamError::Setup(SetupError::Incompatible(_))))
    };
    assert!(incompatible(plan_stream_out(&a, w0, &fewer)));
    assert!(incompatible(plan_stream_in(&a, &fewer, w0)));
    assert!(incompatible(plan_stream_out(&fewer, w0, &a)));

    // Same requests, different models: layers, heads, head size, dtype, scales.
    let others = [
        Setup::uniform(f16(6, 2), 2, 1, 4, 2).unwrap(),
        Setup::uniform(f16(4, 4), 2, 1, 4, 2).unwrap(),
        Setup::uniform(KvSpec::new(4, 2, 32, DType::F16).unwrap(), 2, 1, 4, 2).unwrap(),
        Setup::uniform(KvSpec::new(4, 2, 16, DType::BF16).unwrap(), 2, 1, 4, 2).unwrap(),
        Setup::uniform(
            KvSpec::with_scales(4, 2, 16, DType::Int8, ScaleMode::PerTokenHead).unwrap(),
            2,
            1,
            4,
            2,
        )
        .unwrap(),
    ];
    for other in &others {
        assert!(incompatible(plan_stream_out(&a, w0, other)), "{other:?}");
        assert!(incompatible(plan_stream_in(&a, other, w0)), "{other:?}");
    }

    // Workers outside the setup.
    let ghost = WorkerId { stage: 0, rank: 1 };
    assert!(matches!(plan_stream_out(&a, ghost, &a), Err(StreamError::Setup(SetupError::NoSuchWorker(_)))));
    assert!(matches!(
        plan_stream_in(&a, &a, WorkerId { stage: 2, rank: 0 }),
        Err(StreamError::Setup(SetupError::NoSuchWorker(_)))
    ));
}

#[test]
fn missing_or_corrupt_chunks_are_errors_and_never_scattered() {
    let spec = f16(2, 2);
    let a_setup = Setup::uniform(spec, 1, 1, 2, 1).unwrap();
    let b_setup = Setup::uniform(spec, 1, 2, 2, 1).unwrap();
    let a = Side::new(a_setup, &[Kind::Ft], 4);
    let b = Side::new(b_setup, &[PAGED_NHD], 4);
    a.fill(0..4);
    let store = HostStore::new();
    let w = WorkerId { stage: 0, rank: 1 };
    let expected = plan_stream_in(&a.setup, &b.setup, w).unwrap();
    assert_eq!(expected.len(), 1);
    let caches: Vec<&KvCache> = b.caches[1].iter().collect();

    // Nothing streamed yet: NotFound.
    let r = stream_in(&caches, &expected, 0..4, &mut store.clone());
    assert!(matches!(r, Err(StreamError::Store(StoreError::NotFound(_)))), "{r:?}");

    // Streamed, then one payload byte flipped: a checksum error, and nothing scattered.
    let src: Vec<&KvCache> = a.caches[0].iter().collect();
    let plan = plan_stream_out(&a.setup, WorkerId { stage: 0, rank: 0 }, &b.setup).unwrap();
    stream_out(&src, &plan, 0..4, &StagingPool::new(1), &mut store.clone()).unwrap();
    let key = dejavulib::reshard::transfer_key(&expected[0], 0..4);
    assert!(store.corrupt(&key, 7));
    let r = stream_in(&caches, &expected, 0..4, &mut store.clone());
    assert!(matches!(r, Err(StreamError::Store(StoreError::Chunk { .. }))), "{r:?}");
    for snapshot in caches.iter().map(|c| c.snapshot()) {
        assert!(snapshot.iter().flatten().all(|&x| x == 0));
    }

    // The other destination's chunk is intact and lands.
    let other = plan_stream_in(&a.setup, &b.setup, WorkerId { stage: 0, rank: 0 }).unwrap();
    let caches0: Vec<&KvCache> = b.caches[0].iter().collect();
    let mut s = store.clone();
    let stats = stream_in(&caches0, &other, 0..4, &mut s).unwrap();
    assert_eq!(stats.chunks, 1);
    let mut payload = Vec::new();
    let descriptor = s.get(&dejavulib::reshard::transfer_key(&other[0], 0..4), &mut payload);
    assert_eq!(descriptor.unwrap().source, WorkerId { stage: 0, rank: 0 });
}

#[test]
fn stream_out_without_the_microbatch_cache_is_an_error() {
    let spec = f16(2, 2);
    let a = Setup::uniform(spec, 1, 1, 2, 2).unwrap();
    let b = Setup::uniform(spec, 1, 1, 4, 1).unwrap();
    let plan = plan_stream_out(&a, WorkerId { stage: 0, rank: 0 }, &b).unwrap();
    let only = make_cache(spec, 2, 2, Kind::Ft);
    let r = stream_out(&[&only], &plan, 0..2, &StagingPool::new(1), &mut HostStore::new());
    assert!(matches!(r, Err(StreamError::NoCache(1))), "{r:?}");
}

// ---------------------------------------------------------------------------------------------
// Random pairs of setups.
// ---------------------------------------------------------------------------------------------

fn random_setup(rng: &mut Rng, spec: KvSpec, requests: u32) -> Setup {
    let layers = spec.layers();
    let depth = 1 + rng.below(layers.min(3));
    // Distinct cut points in 1..layers.
    let mut cuts: Vec<u32> = Vec::new();
    while cuts.len() < depth as usize - 1 {
        let c = 1 + rng.below(layers - 1);
        if !cuts.contains(&c) {
            cuts.push(c);
        }
    }
    cuts.sort_unstable();
    cuts.push(layers);
    let kv = spec.kv_heads();
    let tps: Vec<u32> = [1, 2, 4, 8].into_iter().filter(|&t| kv % t == 0 || t % kv == 0).collect();
    let mut start = 0;
    let stages = cuts
        .into_iter()
        .map(|end| {
            let s = StageSpec { layers: start..end, tp: rng.pick(&tps) };
            start = end;
            s
        })
        .collect();
    let divisors: Vec<u32> = (1..=requests).filter(|d| requests % d == 0).collect();
    let slots = rng.pick(&divisors);
    Setup::new(spec, stages, slots, requests / slots).unwrap()
}

fn random_kinds(rng: &mut Rng) -> Vec<Kind> {
    let all = [Kind::Ft, BHSD, BSHD, PAGED_NHD, PAGED_HND];
    (0..3).map(|_| rng.pick(&all)).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Random pair of setups, random layouts, a random token sub-range streamed alone: exactly that
    /// range lands in B, every byte of it, nothing else, without duplicate chunks.
    #[test]
    fn random_setup_pairs_reshard_exactly(seed in any::<u64>()) {
        let mut rng = Rng::new(seed);
        let layers = 1 + rng.below(6);
        let kv = rng.pick(&[1, 2, 4]);
        let spec = if rng.below(3) == 0 {
            KvSpec::with_scales(layers, kv, 16, DType::Int8, ScaleMode::PerTokenHead).unwrap()
        } else {
            f16(layers, kv)
        };
        let requests = rng.pick(&[1, 2, 4, 6, 8]);
        let a_setup = random_setup(&mut rng, spec, requests);
        let b_setup = random_setup(&mut rng, spec, requests);
        let tokens = 1 + rng.below(5);
        let lo = rng.below(tokens);
        let hi = lo + 1 + rng.below(tokens - lo);
        let a_kinds = random_kinds(&mut rng);
        let b_kinds = random_kinds(&mut rng);

        let a = Side::new(a_setup, &a_kinds, tokens);
        let b = Side::new(b_setup, &b_kinds, tokens);
        a.fill(0..tokens);
        let store = HostStore::new().logging_puts();
        let r = reshard(&a, &b, lo..hi, &store);
        prop_assert_eq!(r.into.bytes, b.bytes_for(hi - lo));
        prop_assert_eq!(r.out.bytes, r.into.bytes);
        assert_unique_keys(&store, r.out.chunks);
        b.check(
            &format!("A {:?} {:?} -> B {:?} {:?}, tokens {lo}..{hi}", a.setup, a_kinds, b.setup, b_kinds),
            |t| (lo..hi).contains(&t),
        );
    }
}

/// An empty token range (a step that produced no token for this batch) must be handled the same
/// way on both sides: whatever `stream_out` accepts, `stream_in` of the same range must accept.
#[test]
fn empty_token_range_round_trips_consistently() {
    let spec = f16(2, 2);
    let setup = Setup::uniform(spec, 1, 1, 2, 1).unwrap();
    let a = Side::new(setup.clone(), &[Kind::Ft], 4);
    let b = Side::new(setup, &[BHSD], 4);
    a.fill(0..4);
    let store = HostStore::new().logging_puts();
    let w = WorkerId { stage: 0, rank: 0 };
    let plan = plan_stream_out(&a.setup, w, &b.setup).unwrap();
    let src: Vec<&KvCache> = a.caches[0].iter().collect();
    let out = stream_out(&src, &plan, 2..2, &StagingPool::new(1), &mut store.clone());
    let expected = plan_stream_in(&a.setup, &b.setup, w).unwrap();
    let dst: Vec<&KvCache> = b.caches[0].iter().collect();
    let into = stream_in(&dst, &expected, 2..2, &mut store.clone());
    match (&out, &into) {
        (Ok(o), Ok(i)) => {
            assert_eq!((o.bytes, i.bytes), (0, 0));
            b.check("empty range", |_| false);
        }
        (Err(_), _) => {}
        (Ok(o), Err(e)) => panic!(
            "stream_out accepted the empty range ({} chunks of {} bytes put, keys {:?}) \
             but stream_in of the same range fails: {e}",
            o.chunks,
            o.bytes,
            store.put_log()
        ),
    }
}
