//! Disaggregated serving with real KV: a prompt pipeline (2 stages, microbatches of 4, the
//! FasterTransformer layout) computes the prompts, its KV is resharded with `stream_out` /
//! `stream_in` into a token pipeline of another shape (3 unequal stages, microbatches of 2,
//! per-layer tensors), which decodes; the tokens equal those of one colocated pipeline.

// Layer splits are lists of ranges; a one-stage pipeline is a list of one range.
#![allow(clippy::single_range_in_vec_init)]

use std::ops::Range;

use dejavu_engine::pipeline::CacheLayout;
use dejavu_engine::{ModelConfig, Pipeline, Seat};
use dejavulib::{
    plan_stream_in, plan_stream_out, stream_in, stream_out, HostStore, KvCache, Setup, StageSpec, StagingPool,
};

const REQUESTS: usize = 4;
const NEW_TOKENS: usize = 8;
const MAX_TOKENS: u32 = 48;

fn prompts() -> Vec<Vec<u32>> {
    // The same length for every request: the prompt pipeline streams one token range for all.
    (0..REQUESTS as u32).map(|r| (0..12).map(|t| (r * 131 + t * 17 + 5) % 512).collect()).collect()
}

fn setup(splits: &[Range<u32>], slots: u32, microbatches: u32) -> Setup {
    let stages = splits.iter().map(|layers| StageSpec { layers: layers.clone(), tp: 1 }).collect();
    Setup::new(ModelConfig::reference().kv_spec(), stages, slots, microbatches).unwrap()
}

fn caches(p: &Pipeline, stage: usize) -> Vec<&KvCache> {
    p.caches(stage).iter().map(|c| &**c).collect()
}

#[test]
fn a_prompt_pipeline_hands_its_kv_to_a_differently_shaped_token_pipeline() {
    let config = ModelConfig::reference();
    let prompts = prompts();
    let colocated = Pipeline::new(config, &[0..8], CacheLayout::FasterTransformer, 4, 1, MAX_TOKENS)
        .unwrap()
        .generate(&prompts, NEW_TOKENS)
        .unwrap();

    let (prompt_splits, token_splits) = (vec![0..4, 4..8], vec![0..3, 3..5, 5..8]);
    let prompt =
        Pipeline::new(config, &prompt_splits, CacheLayout::FasterTransformer, 4, 1, MAX_TOKENS).unwrap();
    let token = Pipeline::new(config, &token_splits, CacheLayout::PerLayer, 2, 2, MAX_TOKENS).unwrap();
    let (a, b) = (setup(&prompt_splits, 4, 1), setup(&token_splits, 2, 2));

    // The prompt pipeline runs every prompt and yields each request's first token.
    let first: Vec<u32> =
        prompts.iter().enumerate().map(|(r, p)| prompt.prefill(prompt.seat(r), p).unwrap()).collect();

    // Its KV moves to the token pipeline: each prompt worker streams out, each token worker in.
    let store = HostStore::new();
    let pool = StagingPool::default();
    let tokens = 0..prompts[0].len() as u32;
    let mut sent = 0;
    for worker in a.workers() {
        let plan = plan_stream_out(&a, worker, &b).unwrap();
        let stats = stream_out(
            &caches(&prompt, worker.stage as usize),
            &plan,
            tokens.clone(),
            &pool,
            &mut store.clone(),
        )
        .unwrap();
        sent += stats.bytes;
    }
    let mut received = 0;
    for worker in b.workers() {
        let plan = plan_stream_in(&a, &b, worker).unwrap();
        let stats =
            stream_in(&caches(&token, worker.stage as usize), &plan, tokens.clone(), &mut store.clone())
                .unwrap();
        received += stats.bytes;
    }
    let kv_bytes = config.kv_spec().bytes_per_token() * tokens.len() as u64 * REQUESTS as u64;
    assert_eq!((sent, received), (kv_bytes, kv_bytes), "every prompt token's KV, once");

    // The token pipeline decodes: request r sits in microbatch r / 2, slot r % 2 there.
    for (r, prompt_tokens) in prompts.iter().enumerate() {
        let seat = Seat { microbatch: r as u32 / 2, slot: r as u32 % 2 };
        let mut out = vec![first[r]];
        while out.len() < NEW_TOKENS {
            let position = (prompt_tokens.len() + out.len() - 1) as u32;
            out.push(token.decode(seat, *out.last().unwrap(), position).unwrap());
        }
        assert_eq!(out, colocated[r], "request {r}");
    }
}
