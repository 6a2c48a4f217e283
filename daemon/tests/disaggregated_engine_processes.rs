//! Prompt-token disaggregation with engine processes: every stage of both pipelines runs the
//! PyTorch engine (`python3 -m dejavu.torch_engine member`) under its stage host. The prompt
//! stages' hosts read each prompt's KV out of their engines and hand it over to the token
//! stages' sidecars; the token stages' hosts load it from there and write it into their engines,
//! which decode. The tokens equal the whole model's, computed by `TorchStage` in one process.
//!
//! Needs `python3` with the `dejavu` package, torch and transformers. Without them the test says
//! so and passes, unless `DEJAVU_REQUIRE_TORCH` is set (CI sets it, having installed them).

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use dejavud::cluster::{Cluster, ClusterConfig, Disaggregation, Kill, Role};
use dejavud::demo::DemoEngine;
use dejavud::driver::{drive, DriverConfig, OnFailure, Workload};
use dejavud::metrics::value_of;

const REQUESTS: u32 = 4;
const TOKEN_SLOTS: u32 = 2;
const PROMPT_SLOTS: u32 = 4;
const NEW_TOKENS: u32 = 6;

/// Greedy tokens of each prompt through the whole model in one `TorchStage`, one thread (as the
/// engine processes run): argv is the model's shape (JSON), the prompts (JSON) and the tokens
/// to generate.
const WHOLE_MODEL: &str = r#"
import json, sys, torch
from dejavu.torch_engine import ModelShape, TorchStage
torch.set_num_threads(1)
shape, prompts, new = ModelShape.from_json(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
stage = TorchStage(shape, range(0, shape.layers), 1, max(map(len, prompts)) + new)
out = []
for prompt in prompts:
    x = stage.forward(torch.tensor([prompt]), range(1), 0)
    tokens = [int(x[0])]
    for position in range(len(prompt), len(prompt) + new - 1):
        x = stage.forward(x.view(1, 1), range(1), position)
        tokens.append(int(x[0]))
    out.append(tokens)
print(json.dumps(out))
"#;

fn torch_engine_available() -> bool {
    let probe = Command::new("python3").args(["-c", "import dejavu.torch_engine, transformers"]).output();
    match probe {
        Ok(out) if out.status.success() => true,
        _ if std::env::var_os("DEJAVU_REQUIRE_TORCH").is_some() => {
            panic!(
                "DEJAVU_REQUIRE_TORCH is set, but python3 cannot import dejavu.torch_engine and transformers"
            )
        }
        _ => {
            eprintln!("skipped: python3 cannot import dejavu.torch_engine and transformers");
            false
        }
    }
}

fn workload() -> Workload {
    // Prompts of different lengths: each sequence is handed over on its own.
    let prompts =
        (0..REQUESTS).map(|r| (0..5 + 3 * r).map(|t| (r * 131 + t * 17 + 5) % 512).collect()).collect();
    Workload { prompts, new_tokens: NEW_TOKENS, slots: TOKEN_SLOTS, seats: REQUESTS }
}

fn engine() -> dejavud::process::external::EngineCommand {
    DemoEngine::Torch { python: "python3".into() }.command().expect("an engine process")
}

fn whole_model(workload: &Workload) -> Vec<Vec<u32>> {
    let argv = engine().argv().to_vec();
    let shape = &argv[argv.iter().position(|a| a == "--shape").expect("the engine's shape") + 1];
    let prompts = serde_json::to_string(&workload.prompts).unwrap();
    let out = Command::new("python3")
        .args(["-c", WHOLE_MODEL, shape, &prompts, &NEW_TOKENS.to_string()])
        .output()
        .expect("python3 runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("tokens as JSON")
}

fn config(workload: &Workload) -> ClusterConfig {
    ClusterConfig {
        splits: vec![0..5, 5..8],
        slots: TOKEN_SLOTS,
        microbatches: workload.microbatches(),
        max_tokens: workload.max_tokens(),
        disaggregation: Some(Disaggregation { splits: vec![0..3, 3..8], slots: PROMPT_SLOTS }),
        deadline: Duration::from_secs(2),
        engine: Some(engine()),
        ..ClusterConfig::new(PathBuf::from(env!("CARGO_BIN_EXE_dejavud")))
    }
}

fn counter(page: &str, name: &str) -> f64 {
    value_of(page, name, &[]).unwrap_or_else(|| panic!("no {name} in\n{page}"))
}

#[test]
fn engine_processes_hand_prompts_over_to_a_token_pipeline_and_a_killed_token_worker_recovers() {
    if !torch_engine_available() {
        return;
    }
    let workload = workload();
    let expected = whole_model(&workload);
    let driver = DriverConfig {
        on_failure: OnFailure::Recover,
        detect_patience: Duration::from_secs(5),
        watch_every: Duration::from_millis(100),
        retries: 3,
    };
    let mut pages = None;
    let mut inject = |step: u64, cluster: &mut Cluster| {
        if step + 2 == workload.steps() {
            let token = (0..cluster.len())
                .map(|s| cluster.metrics(s, Role::Engine))
                .collect::<Result<Vec<_>, _>>()?;
            let prompt = (0..2).map(|s| cluster.prompt_metrics(s)).collect::<Result<Vec<_>, _>>()?;
            pages = Some((token, prompt, cluster.prompt_fallbacks()));
            // After every prompt was handed over: a token worker dies mid-decode, and its
            // replacement restores the loaded prompts and the tokens since from the successor.
            cluster.faults().kill(1, Kill::Worker)?;
        }
        Ok(())
    };
    let config = config(&workload);
    let run = drive(&workload, &driver, &mut || Cluster::start(config.clone()), &mut inject).unwrap();
    assert_eq!(run.tokens, expected);
    assert_eq!(run.recoveries.len(), 1, "{:?}", run.recoveries);

    let (token, prompt, fallbacks) = pages.expect("metrics read before the kill");
    assert_eq!(fallbacks, 0, "every prompt was handed over");
    for page in &prompt {
        // At least a chunk per prompt; the last prompt's are counted once a later request
        // collects them, and none came after it.
        assert!(counter(page, "dejavu_stage_handoff_chunks_total") >= (REQUESTS - 1) as f64, "{page}");
        assert_eq!(counter(page, "dejavu_stage_handoff_failures_total"), 0.0, "{page}");
    }
    let prompt_tokens: u32 = workload.prompts.iter().map(|p| p.len() as u32).sum();
    let kv_per_token = dejavu_engine::ModelConfig::reference().kv_spec().bytes_per_token() as f64;
    let mut loaded = 0.0;
    for page in &token {
        assert_eq!(counter(page, "dejavu_stage_loaded_sequences_total"), REQUESTS as f64, "{page}");
        assert_eq!(counter(page, "dejavu_stage_load_failures_total"), 0.0, "{page}");
        loaded += counter(page, "dejavu_stage_loaded_bytes_total");
    }
    assert_eq!(loaded, prompt_tokens as f64 * kv_per_token, "every prompt token's KV, once");
}
