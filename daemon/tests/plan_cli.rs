//! `dejavud plan` through the real binary: tables, JSON, calibration overrides and input errors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn dejavud(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dejavud")).args(args).output().expect("run dejavud")
}

fn example() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("plans/llama2-13b.toml")
}

fn json(args: &[&str]) -> serde_json::Value {
    let out = dejavud(args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("JSON output")
}

fn close(v: &serde_json::Value, expected: f64) -> bool {
    (v.as_f64().expect("number") - expected).abs() < 1e-6 * expected.abs().max(1.0)
}

#[test]
fn shipped_example_reproduces_the_paper_vector() {
    let path = example();
    let v = json(&["plan", path.to_str().unwrap(), "--json"]);
    assert_eq!(v["kv"]["bytes_per_token"], 819_200);
    let d = &v["disaggregation"];
    assert!(close(&d["balanced_token_depth"], 10.0 / 3.0));
    assert!(close(&d["balanced_prompt_depth"], 2.0 / 3.0));
    assert!(close(&d["balanced_inverse_throughput_ms"], 6000.0));
    assert!(close(&d["colocated_inverse_throughput_ms"], 6712.5));
    assert_eq!(d["recommendation"]["kind"], "disaggregate");
    assert_eq!(d["recommendation"]["prompt_machines"], 1);
    assert_eq!(v["memory"].as_array().unwrap().len(), 4);
    // 10 of 40 layers at TP 1: a quarter of 819,200 B per token.
    assert_eq!(v["memory"][0]["kv_bytes_per_token"], 204_800);
    assert_eq!(v["transfers"].as_array().unwrap().len(), 2);

    let table = dejavud(&["plan", path.to_str().unwrap()]);
    let text = String::from_utf8(table.stdout).unwrap();
    assert!(text.contains("disaggregate: 1 prompt + 3 token machines"), "{text}");
}

#[test]
fn calibration_file_and_flags_override_the_timing() {
    let dir = tempfile::tempdir().unwrap();
    let cal = dir.path().join("measured.json");
    // The paper's second vector: Y = 100, t = 10, m = 1.9 gives no gain.
    std::fs::write(&cal, r#"{"prompt_ms": 100, "token_ms": 10, "streaming_overhead": 1.9}"#).unwrap();
    let path = example();
    let v = json(&["plan", path.to_str().unwrap(), "--json", "--calibration", cal.to_str().unwrap()]);
    let d = &v["disaggregation"];
    assert!(close(&d["balanced_inverse_throughput_ms"], 1190.0));
    assert!(close(&d["colocated_inverse_throughput_ms"], 1167.5));
    assert_eq!(d["eq4"]["verdict"], "never_pays");
    assert_eq!(d["recommendation"]["kind"], "colocate");
    // A flag beats the calibration file.
    let v = json(&[
        "plan",
        path.to_str().unwrap(),
        "--json",
        "--calibration",
        cal.to_str().unwrap(),
        "--streaming-overhead",
        "1.0",
    ]);
    assert!(close(&v["disaggregation"]["balanced_inverse_throughput_ms"], 1100.0));
}

#[test]
fn json_input_works_too() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plan.json");
    std::fs::write(
        &path,
        r#"{"model": {"layers": 80, "kv_heads": 8, "head_dim": 128, "dtype": "f16", "weights_per_layer": 1.6e9},
            "workload": {"prompt_tokens": 512, "output_tokens": 512, "batch": 4, "microbatches": 2},
            "cluster": {"machines": 8, "memory_gb": 80}}"#,
    )
    .unwrap();
    let v = json(&["plan", path.to_str().unwrap(), "--json"]);
    assert_eq!(v["kv"]["bytes_per_token"], 327_680);
    assert!(v.get("disaggregation").is_none(), "no timing, no disaggregation");
}

#[test]
fn bad_input_names_the_field_and_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("zero machines", "machines = 0", "cluster.machines"),
        ("negative time", "token_ms = -5", "timing.token_ms"),
        ("unknown dtype", r#"dtype = "fp4""#, "model.dtype"),
        ("missing field", "", "missing field `layers`"),
        ("does not fit", "memory_gb = 0.5", "does not fit"),
        (
            "a speedup while streaming",
            "streaming_overhead = 0.5",
            "timing.streaming_overhead: must be at least 1",
        ),
        ("no output", "output_tokens = 0", "workload.output_tokens: must be positive"),
        ("no layers", "layers = 0\n", "model.layers: must be positive"),
    ];
    let base = std::fs::read_to_string(example()).unwrap();
    for (name, line, expected) in cases {
        let text = match name {
            "zero machines" => base.replace("machines = 4", line),
            "negative time" => base.replace("token_ms = 50", line),
            "unknown dtype" => base.replace(r#"dtype = "bf16""#, line),
            "missing field" => base.replace("layers = 40\n", line),
            "a speedup while streaming" => base.replace("streaming_overhead = 1.0", line),
            "no output" => base.replace("output_tokens = 100", line),
            "no layers" => base.replace("layers = 40\n", line),
            _ => base.replace("memory_gb = 80", line),
        };
        let path = dir.path().join(format!("{}.toml", name.replace(' ', "_")));
        std::fs::write(&path, text).unwrap();
        let out = dejavud(&["plan", path.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {err}");
        assert!(err.contains(expected), "{name}: {err}");
    }
    let out = dejavud(&["plan", "/nonexistent/plan.toml"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn a_reader_that_goes_away_ends_the_output_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dejavud"))
        .args(["plan", "--json", example().to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The reader is gone before anything is written: the first write finds the pipe broken.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
