//! Prompt-token disaggregation with real processes: a prompt pipeline (2 stage processes,
//! microbatches of 4, FasterTransformer layout) computes every prompt and hands its KV over to the
//! sidecars of a token pipeline of another shape (3 unequal stage processes, microbatches of 2,
//! per-layer tensors), whose stages load it from there and decode. The tokens equal a colocated
//! pipeline's, also when a token worker is killed mid-decode and recovered.

use std::path::PathBuf;
use std::time::Duration;

use dejavu_engine::{CacheLayout, ModelConfig, Pipeline};
use dejavud::cluster::{Cluster, ClusterConfig, Disaggregation, Kill, Role};
use dejavud::driver::{drive, DriverConfig, OnFailure, Workload};
use dejavud::metrics::value_of;

const REQUESTS: u32 = 8;
const TOKEN_SLOTS: u32 = 2;
const PROMPT_SLOTS: u32 = 4;
const NEW_TOKENS: u32 = 8;

fn workload() -> Workload {
    // Prompts of different lengths: each sequence is handed over on its own.
    let prompts =
        (0..REQUESTS).map(|r| (0..5 + 3 * r).map(|t| (r * 131 + t * 17 + 5) % 512).collect()).collect();
    Workload { prompts, new_tokens: NEW_TOKENS, slots: TOKEN_SLOTS, seats: REQUESTS }
}

fn colocated(workload: &Workload) -> Vec<Vec<u32>> {
    let config = ModelConfig::reference();
    Pipeline::new(config, &[0..2, 2..8], CacheLayout::FasterTransformer, 4, 2, workload.max_tokens())
        .unwrap()
        .generate(&workload.prompts, NEW_TOKENS as usize)
        .unwrap()
}

fn config(workload: &Workload) -> ClusterConfig {
    ClusterConfig {
        splits: vec![0..3, 3..5, 5..8],
        slots: TOKEN_SLOTS,
        microbatches: workload.microbatches(),
        max_tokens: workload.max_tokens(),
        layout: CacheLayout::PerLayer,
        disaggregation: Some(Disaggregation { splits: vec![0..4, 4..8], slots: PROMPT_SLOTS }),
        deadline: Duration::from_secs(1),
        ..ClusterConfig::new(PathBuf::from(env!("CARGO_BIN_EXE_dejavud")))
    }
}

fn driver() -> DriverConfig {
    DriverConfig {
        on_failure: OnFailure::Recover,
        detect_patience: Duration::from_secs(3),
        watch_every: Duration::from_millis(100),
        retries: 3,
    }
}

fn counter(page: &str, name: &str) -> f64 {
    value_of(page, name, &[]).unwrap_or_else(|| panic!("no {name} in\n{page}"))
}

#[test]
fn prompts_computed_by_a_prompt_pipeline_decode_in_a_token_pipeline_of_another_shape() {
    let workload = workload();
    let config = config(&workload);
    let mut pages = None;
    let mut inject = |step: u64, cluster: &mut Cluster| {
        if step + 1 == workload.steps() {
            let token = (0..cluster.len())
                .map(|s| cluster.metrics(s, Role::Engine))
                .collect::<Result<Vec<_>, _>>()?;
            let prompt = (0..2).map(|s| cluster.prompt_metrics(s)).collect::<Result<Vec<_>, _>>()?;
            pages = Some((token, prompt, cluster.prompt_fallbacks()));
        }
        Ok(())
    };
    let run = drive(&workload, &driver(), &mut || Cluster::start(config.clone()), &mut inject).unwrap();
    assert_eq!(run.tokens, colocated(&workload));
    assert!(run.recoveries.is_empty());

    let (token, prompt, fallbacks) = pages.expect("metrics read before the last step");
    assert_eq!(fallbacks, 0, "every prompt was handed over");
    for page in &prompt {
        assert!(counter(page, "dejavu_stage_handoff_chunks_total") >= REQUESTS as f64, "{page}");
        assert_eq!(counter(page, "dejavu_stage_handoff_failures_total"), 0.0, "{page}");
    }
    let prompt_tokens: u32 = workload.prompts.iter().map(|p| p.len() as u32).sum();
    let kv_per_token = ModelConfig::reference().kv_spec().bytes_per_token() as f64;
    let mut loaded = 0.0;
    for page in &token {
        assert_eq!(counter(page, "dejavu_stage_loaded_sequences_total"), REQUESTS as f64, "{page}");
        assert_eq!(counter(page, "dejavu_stage_load_failures_total"), 0.0, "{page}");
        // Token stages computed no prompt: only the generated tokens (but the last's, read
        // before it ran) went through them.
        let decoded = REQUESTS * (NEW_TOKENS - 1) - 1;
        assert_eq!(counter(page, "dejavu_stage_tokens_total"), decoded as f64, "{page}");
        loaded += counter(page, "dejavu_stage_loaded_bytes_total");
    }
    assert_eq!(loaded, prompt_tokens as f64 * kv_per_token, "every prompt token's KV, once");
}

#[test]
fn a_token_worker_killed_after_the_handoff_recovers_bit_identically() {
    let workload = workload();
    let config = config(&workload);
    let mut inject = |step: u64, cluster: &mut Cluster| {
        // Every prompt is in by step 8; kill in the middle of decoding.
        if step == 30 {
            cluster.faults().kill(1, Kill::Worker)?;
        }
        Ok(())
    };
    let run = drive(&workload, &driver(), &mut || Cluster::start(config.clone()), &mut inject).unwrap();
    assert_eq!(run.tokens, colocated(&workload));
    assert_eq!(run.recoveries.len(), 1);
    // The loaded prompts were replicated like computed ones: at most the lag is recomputed.
    assert!(run.recoveries[0].recomputed <= 1 + REQUESTS as u64, "{:?}", run.recoveries[0]);
}

#[test]
fn a_token_worker_killed_while_prompts_arrive_gets_the_rest_at_its_replacement() {
    let workload = workload();
    let config = config(&workload);
    let mut seen = None;
    let mut inject = |step: u64, cluster: &mut Cluster| {
        // Two prompts handed over; the third's load finds stage 1 dead.
        if step == 2 {
            cluster.faults().kill(1, Kill::Worker)?;
        }
        if step + 1 == workload.steps() {
            seen = Some((cluster.prompt_fallbacks(), cluster.metrics(1, Role::Engine)?));
        }
        Ok(())
    };
    let run = drive(&workload, &driver(), &mut || Cluster::start(config.clone()), &mut inject).unwrap();
    assert_eq!(run.tokens, colocated(&workload));
    assert_eq!(run.recoveries.len(), 1);
    let (fallbacks, page) = seen.expect("read before the last step");
    // The prompt stages were told where the replacement's sidecar is: the prompts after the
    // failure were handed over there, none computed by the token pipeline.
    assert_eq!(fallbacks, 0);
    assert_eq!(counter(&page, "dejavu_stage_loaded_sequences_total"), (REQUESTS - 2) as f64, "{page}");
}

#[test]
fn prompts_a_dead_prompt_pipeline_cannot_hand_over_are_computed_by_the_token_pipeline() {
    let workload = workload();
    let config = config(&workload);
    let mut fallbacks = 0;
    let mut inject = |step: u64, cluster: &mut Cluster| {
        // Three prompts handed over, then the prompt pipeline loses a stage.
        if step == 3 {
            cluster.faults().kill_prompt_stage(1)?;
        }
        if step + 1 == workload.steps() {
            fallbacks = cluster.prompt_fallbacks();
        }
        Ok(())
    };
    let run = drive(&workload, &driver(), &mut || Cluster::start(config.clone()), &mut inject).unwrap();
    assert_eq!(run.tokens, colocated(&workload));
    assert!(run.recoveries.is_empty(), "no token stage died");
    assert_eq!(fallbacks, REQUESTS as u64 - 3);
    assert_eq!(run.prompt_fallbacks, fallbacks);
}

#[test]
fn shapes_that_do_not_fit_are_refused_before_anything_starts() {
    let workload = workload();
    // 8 requests do not fill prompt microbatches of 3.
    let odd = ClusterConfig {
        disaggregation: Some(Disaggregation { splits: vec![0..4, 4..8], slots: 3 }),
        ..config(&workload)
    };
    let error = Cluster::start(odd).err().expect("refused").to_string();
    assert!(error.contains("microbatches of 3"), "{error}");
    // Prompt stages that do not cover the model.
    let short = ClusterConfig {
        disaggregation: Some(Disaggregation { splits: vec![0..4, 4..7], slots: 4 }),
        ..config(&workload)
    };
    let error = Cluster::start(short).err().expect("refused").to_string();
    assert!(error.contains("layer"), "{error}");
}
