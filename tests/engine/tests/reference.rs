//! The reference engine is deterministic, indifferent to how it is split and laid out, and a
//! sequence whose KV is restored from a flushed copy continues exactly where it stopped.

// Layer splits are lists of ranges; a one-stage pipeline is a list of one range.
#![allow(clippy::single_range_in_vec_init)]

use std::ops::Range;

use dejavu_engine::{CacheLayout, ModelConfig, Pipeline, StageError};
use dejavulib::file_io::FileBackend;
use dejavulib::reshard::{receive, send};
use dejavulib::{FileStore, KvRegion, StagingPool, Transfer, WorkerId};

const NEW_TOKENS: usize = 12;
const MAX_TOKENS: u32 = 64;

fn prompts() -> Vec<Vec<u32>> {
    vec![vec![1, 17, 300, 42, 7], vec![5, 5, 5], (0..20).map(|i| (i * 37 + 11) % 512).collect()]
}

fn pipeline(splits: &[Range<u32>], layout: CacheLayout) -> Pipeline {
    Pipeline::new(ModelConfig::reference(), splits, layout, 2, 2, MAX_TOKENS).unwrap()
}

fn whole() -> Vec<Range<u32>> {
    vec![0..8]
}

#[test]
fn generation_is_bit_reproducible_and_not_degenerate() {
    let a = pipeline(&whole(), CacheLayout::FasterTransformer).generate(&prompts(), NEW_TOKENS).unwrap();
    let b = pipeline(&whole(), CacheLayout::FasterTransformer).generate(&prompts(), NEW_TOKENS).unwrap();
    assert_eq!(a, b);
    assert!(a.iter().all(|out| out.len() == NEW_TOKENS));
    let distinct: std::collections::HashSet<_> = a.iter().flatten().collect();
    assert!(distinct.len() > 5, "the model says something: {a:?}");
    assert_ne!(a[0], a[1], "different prompts, different continuations");
}

#[test]
fn stage_splits_and_cache_layouts_do_not_change_the_tokens() {
    let reference =
        pipeline(&whole(), CacheLayout::FasterTransformer).generate(&prompts(), NEW_TOKENS).unwrap();
    for (splits, layout) in [
        (vec![0..2, 2..4, 4..6, 6..8], CacheLayout::FasterTransformer),
        (vec![0..5, 5..8], CacheLayout::PerLayer),
        (whole(), CacheLayout::PerLayer),
    ] {
        let got = pipeline(&splits, layout).generate(&prompts(), NEW_TOKENS).unwrap();
        assert_eq!(got, reference, "{splits:?} {layout:?}");
    }
}

/// Decodes `steps` tokens after the prompt of request 0, from `first`; returns them.
fn continue_decoding(p: &Pipeline, prompt_len: usize, first: u32, done: usize, steps: usize) -> Vec<u32> {
    let seat = p.seat(0);
    let mut token = first;
    let mut out = Vec::new();
    for i in done..done + steps {
        token = p.decode(seat, token, (prompt_len + i - 1) as u32).unwrap();
        out.push(token);
    }
    out
}

#[test]
fn a_sequence_restored_from_flushed_kv_continues_bit_identically() {
    let splits = vec![0..3, 3..8];
    let prompt = &prompts()[0];
    let reference = pipeline(&splits, CacheLayout::FasterTransformer)
        .generate(std::slice::from_ref(prompt), NEW_TOKENS)
        .unwrap();
    let reference = &reference[0];

    // Run 5 tokens, then flush every stage's KV of the sequence (what replication keeps).
    let done = 5;
    let original = pipeline(&splits, CacheLayout::FasterTransformer);
    let seat = original.seat(0);
    let mut produced = vec![original.prefill(seat, prompt).unwrap()];
    produced.extend(continue_decoding(&original, prompt.len(), produced[0], 1, done - 1));
    assert_eq!(produced, reference[..done]);
    // Tokens whose KV is in the caches: the prompt and every produced token but the last.
    let kv_tokens = (prompt.len() + done - 1) as u32;
    let dir = tempfile::tempdir().unwrap();
    let mut store = FileStore::open(dir.path(), FileBackend::Auto).unwrap();
    let pool = StagingPool::default();
    let transfer = |stage: usize, p: &Pipeline| {
        let layers = p.stages()[stage].layers().len() as u32;
        let region =
            KvRegion::new(0..layers, seat.slot..seat.slot + 1, 0..ModelConfig::reference().kv_heads, 0..0);
        let worker = WorkerId { stage: stage as u32, rank: 0 };
        Transfer::in_place(worker, worker, seat.microbatch, &region)
    };
    for stage in 0..splits.len() {
        let cache = &original.caches(stage)[seat.microbatch as usize];
        send(cache, &transfer(stage, &original), 0..kv_tokens, &pool, &mut store).unwrap();
    }
    drop(original);

    // A replacement with empty caches in another layout: without the KV it goes astray...
    let blank = pipeline(&splits, CacheLayout::PerLayer);
    let astray = continue_decoding(&blank, prompt.len(), produced[done - 1], done, NEW_TOKENS - done);
    assert_ne!(astray, reference[done..], "the check must depend on the restored KV");

    // ...with it, it continues exactly where the original stopped.
    let replacement = pipeline(&splits, CacheLayout::PerLayer);
    let mut payload = Vec::new();
    for stage in 0..splits.len() {
        let cache = &replacement.caches(stage)[seat.microbatch as usize];
        receive(cache, &transfer(stage, &replacement), 0..kv_tokens, &mut store, &mut payload).unwrap();
    }
    let resumed = continue_decoding(&replacement, prompt.len(), produced[done - 1], done, NEW_TOKENS - done);
    assert_eq!(resumed, reference[done..]);
}

#[test]
fn bad_input_is_a_typed_error() {
    let config = ModelConfig::reference();
    assert!(matches!(
        Pipeline::new(config, &[0..3, 4..8], CacheLayout::PerLayer, 1, 1, 8),
        Err(StageError::Invalid(_))
    ));
    assert!(matches!(
        Pipeline::new(config, &[0..9], CacheLayout::PerLayer, 1, 1, 8),
        Err(StageError::Invalid(_))
    ));
    let bad_shape = ModelConfig { kv_heads: 3, ..config };
    assert!(matches!(
        Pipeline::new(bad_shape, &[0..8], CacheLayout::PerLayer, 1, 1, 8),
        Err(StageError::Invalid(_))
    ));
    let small = Pipeline::new(config, &[0..4, 4..8], CacheLayout::FasterTransformer, 1, 1, 8).unwrap();
    let seat = small.seat(0);
    assert!(matches!(small.prefill(seat, &[512]), Err(StageError::Input(_))), "outside the vocabulary");
    assert!(matches!(small.prefill(seat, &[1; 9]), Err(StageError::Cache(_))), "longer than the cache");
    assert!(matches!(small.prefill(small.seat(1), &[1]), Err(StageError::Input(_))), "no such microbatch");
}
