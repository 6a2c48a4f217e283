//! `dejavud plan`: reads a cluster description, runs the planner of `dejavulib::planner`, and
//! renders the answer as a table or JSON.
//!
//! Units in the file: bytes for weights, GB (1e9 bytes) for memory, milliseconds for times, GB/s
//! for host-device bandwidth, Gbit/s for network links.

use std::fmt::Write as _;
use std::path::Path;

use dejavulib::planner::disaggregation::{Eq4, Recommendation};
use dejavulib::planner::{
    check_stage_memory, plan_disaggregation, prompt_transfer, swapping_pays, DisaggregationInput,
    DisaggregationPlan, KvSizing, Link, PlanError, StageMemory, SwapInput, SwapVerdict, TransferEstimate,
};
use dejavulib::{DType, KvSpec, ScaleMode, Setup, StageSpec, WorkerId};
use serde::Deserialize;
use serde_json::{json, Value};
use thiserror::Error;

/// Errors of `dejavud plan`.
#[derive(Debug, Error)]
pub enum PlanCliError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not valid TOML/JSON for the schema (the message names the field).
    #[error("parsing {path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// What is wrong, from the parser.
        message: String,
    },
    /// A value is out of range.
    #[error("invalid {field}: {message}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// Why.
        message: String,
    },
    /// The planner rejected the input.
    #[error(transparent)]
    Plan(#[from] PlanError),
}

/// The model.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelInput {
    /// Transformer layers.
    pub layers: u32,
    /// KV heads (fewer than query heads under GQA/MQA).
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// `f32`, `f16`, `bf16`, `fp8` or `int8`.
    pub dtype: String,
    /// Bytes of weights per layer.
    pub weights_per_layer: f64,
    /// Whether int8/fp8 KV carries per-token scales.
    #[serde(default)]
    pub scales: bool,
}

/// The requests.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadInput {
    /// Prompt tokens per request.
    pub prompt_tokens: u32,
    /// Tokens generated per request.
    pub output_tokens: u32,
    /// Requests per microbatch.
    pub batch: u32,
    /// Microbatches in flight.
    pub microbatches: u32,
}

/// The machines.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterInput {
    /// Machines available.
    pub machines: u32,
    /// Memory per machine in GB.
    pub memory_gb: f64,
}

/// Measured or estimated times.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimingInput {
    /// Prompt time of one microbatch through the whole model, ms.
    pub prompt_ms: Option<f64>,
    /// Token step time of one microbatch through the whole model, ms.
    pub token_ms: Option<f64>,
    /// Token step time at twice the batch, ms (defaults to `token_ms`).
    pub token_ms_double_batch: Option<f64>,
    /// Prompt slowdown while streaming, `m` (defaults to 1).
    pub streaming_overhead: Option<f64>,
}

/// Microbatch swapping parameters.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SwapSection {
    /// Host-device bandwidth, GB/s.
    pub host_bandwidth_gbs: f64,
    /// Layers one worker holds (defaults to layers / machines, rounded up).
    pub layers_per_worker: Option<u32>,
}

/// A network link.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkInput {
    /// Name shown in the report.
    pub name: String,
    /// Latency, ms.
    pub latency_ms: f64,
    /// Bandwidth, Gbit/s.
    pub bandwidth_gbps: f64,
}

/// One stage of a layer split, for the memory check.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageInput {
    /// Layers the stage holds (stages take consecutive layers in order).
    pub layers: u32,
    /// Tensor-parallel degree.
    pub tp: u32,
    /// Memory per rank in GB (defaults to the cluster's).
    pub memory_gb: Option<f64>,
}

/// The whole description.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanInput {
    /// The model.
    pub model: ModelInput,
    /// The requests.
    pub workload: WorkloadInput,
    /// The machines.
    pub cluster: ClusterInput,
    /// Times (needed for disaggregation, swapping and transfers).
    #[serde(default)]
    pub timing: TimingInput,
    /// Swapping parameters.
    pub swap: Option<SwapSection>,
    /// Links to price prompt transfers on.
    #[serde(default)]
    pub links: Vec<LinkInput>,
    /// A layer split to check memory for.
    #[serde(default)]
    pub stages: Vec<StageInput>,
}

/// Timing values given on the command line or from a calibration file.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Overrides {
    /// Overrides `timing.prompt_ms`.
    pub prompt_ms: Option<f64>,
    /// Overrides `timing.token_ms`.
    pub token_ms: Option<f64>,
    /// Overrides `timing.streaming_overhead`.
    pub streaming_overhead: Option<f64>,
}

impl Overrides {
    fn apply(&self, timing: &mut TimingInput) {
        timing.prompt_ms = self.prompt_ms.or(timing.prompt_ms);
        timing.token_ms = self.token_ms.or(timing.token_ms);
        timing.streaming_overhead = self.streaming_overhead.or(timing.streaming_overhead);
    }
}

/// Everything the planner found.
#[derive(Clone, Debug)]
pub struct PlanReport {
    /// The model's spec.
    pub spec: KvSpec,
    /// KV sizes.
    pub sizing: KvSizing,
    /// Derived per-layer prompt KV in flight, `C0`.
    pub prompt_kv_per_layer: f64,
    /// Derived per-layer token KV in flight, `K0`.
    pub token_kv_per_layer: f64,
    /// Disaggregation, when times are known.
    pub disaggregation: Option<DisaggregationPlan>,
    /// Swapping, when times and a `[swap]` section are known.
    pub swapping: Option<SwapVerdict>,
    /// Prompt transfer per link, when the prompt time is known.
    pub transfers: Vec<(String, TransferEstimate)>,
    /// Memory per stage, when a split is given.
    pub memory: Vec<StageMemory>,
    /// KV bytes per token of one request held by the fullest rank of each stage, when a split is
    /// given (its layers and its head shard).
    pub stage_kv_per_token: Vec<u64>,
}

/// Reads `path` (TOML, or JSON by extension), applies the calibration file then the flags, and plans.
pub fn run(path: &Path, calibration: Option<&Path>, flags: Overrides) -> Result<PlanReport, PlanCliError> {
    let mut input: PlanInput = parse_file(path)?;
    if let Some(cal) = calibration {
        let measured: Overrides = parse_file(cal)?;
        measured.apply(&mut input.timing);
    }
    flags.apply(&mut input.timing);
    plan(&input)
}

fn parse_file<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, PlanCliError> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| PlanCliError::Io { path: path.display().to_string(), source })?;
    let parse_err = |message: String| PlanCliError::Parse { path: path.display().to_string(), message };
    if path.extension().is_some_and(|e| e == "json") {
        serde_json::from_str(&text).map_err(|e| parse_err(e.to_string()))
    } else {
        toml::from_str(&text).map_err(|e| parse_err(e.to_string()))
    }
}

fn dtype(name: &str) -> Result<DType, PlanCliError> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "f32" | "fp32" | "float32" => DType::F32,
        "f16" | "fp16" | "float16" => DType::F16,
        "bf16" | "bfloat16" => DType::BF16,
        "fp8" | "fp8-e4m3" | "e4m3" => DType::Fp8E4M3,
        "int8" | "i8" => DType::Int8,
        other => {
            return Err(PlanCliError::Invalid {
                field: "model.dtype",
                message: format!("{other:?} is not one of f32, f16, bf16, fp8, int8"),
            })
        }
    })
}

fn invalid(field: &'static str, message: impl Into<String>) -> PlanCliError {
    PlanCliError::Invalid { field, message: message.into() }
}

/// Checks the numbers of the file, naming fields as the file spells them.
fn validate(input: &PlanInput) -> Result<(), PlanCliError> {
    let positive = |field: &'static str, v: f64| {
        if v.is_finite() && v > 0.0 {
            Ok(())
        } else {
            Err(invalid(field, format!("must be positive, got {v}")))
        }
    };
    positive("cluster.machines", input.cluster.machines as f64)?;
    positive("cluster.memory_gb", input.cluster.memory_gb)?;
    if !(input.model.weights_per_layer.is_finite() && input.model.weights_per_layer >= 0.0) {
        return Err(invalid("model.weights_per_layer", "must not be negative"));
    }
    positive("model.layers", input.model.layers as f64)?;
    positive("model.kv_heads", input.model.kv_heads as f64)?;
    positive("model.head_dim", input.model.head_dim as f64)?;
    positive("workload.prompt_tokens", input.workload.prompt_tokens as f64)?;
    positive("workload.output_tokens", input.workload.output_tokens as f64)?;
    positive("workload.batch", input.workload.batch as f64)?;
    positive("workload.microbatches", input.workload.microbatches as f64)?;
    let t = &input.timing;
    for (field, value) in [
        ("timing.prompt_ms", t.prompt_ms),
        ("timing.token_ms", t.token_ms),
        ("timing.token_ms_double_batch", t.token_ms_double_batch),
    ] {
        if let Some(v) = value {
            positive(field, v)?;
        }
    }
    // The prompt's slowdown while it streams its KV out: 1 is none, less would be a speedup.
    if let Some(m) = t.streaming_overhead.filter(|m| !(m.is_finite() && *m >= 1.0)) {
        return Err(invalid("timing.streaming_overhead", format!("must be at least 1, got {m}")));
    }
    if let Some(swap) = &input.swap {
        positive("swap.host_bandwidth_gbs", swap.host_bandwidth_gbs)?;
    }
    for link in &input.links {
        positive("links.bandwidth_gbps", link.bandwidth_gbps)?;
        if !(link.latency_ms.is_finite() && link.latency_ms >= 0.0) {
            return Err(invalid(
                "links.latency_ms",
                format!("must not be negative, got {}", link.latency_ms),
            ));
        }
    }
    for stage in &input.stages {
        positive("stages.layers", stage.layers as f64)?;
        positive("stages.tp", stage.tp as f64)?;
        if let Some(m) = stage.memory_gb {
            positive("stages.memory_gb", m)?;
        }
    }
    Ok(())
}

/// Plans an already parsed description.
pub fn plan(input: &PlanInput) -> Result<PlanReport, PlanCliError> {
    validate(input)?;
    let m = &input.model;
    let scales = if m.scales { ScaleMode::PerTokenHead } else { ScaleMode::None };
    let spec = KvSpec::with_scales(m.layers, m.kv_heads, m.head_dim, dtype(&m.dtype)?, scales)
        .map_err(|e| invalid("model", e.to_string()))?;
    let w = &input.workload;
    let sizing = KvSizing::new(&spec, w.prompt_tokens as u64, w.output_tokens as u64, w.batch as u64);
    let in_flight = w.batch as f64 * w.microbatches as f64;
    let per_token_layer = sizing.bytes_per_token_layer as f64;
    let prompt_kv_per_layer = per_token_layer * w.prompt_tokens as f64 * in_flight;
    let token_kv_per_layer = per_token_layer * (w.prompt_tokens + w.output_tokens) as f64 * in_flight;
    let memory = input.cluster.memory_gb * 1e9;

    let t = &input.timing;
    let m_overhead = t.streaming_overhead.unwrap_or(1.0);
    let disaggregation = match (t.prompt_ms, t.token_ms) {
        (Some(prompt_time), Some(token_time)) => Some(plan_disaggregation(&DisaggregationInput {
            machines: input.cluster.machines,
            memory,
            layers: m.layers,
            weights_per_layer: m.weights_per_layer,
            prompt_kv_per_layer,
            token_kv_per_layer,
            prompt_time,
            token_time,
            tokens: w.output_tokens,
            streaming_overhead: m_overhead,
        })?),
        _ => None,
    };

    let swapping = match (&input.swap, t.token_ms) {
        (Some(swap), Some(token_ms)) => {
            let machines = input.cluster.machines.max(1);
            let layers_per_worker = swap.layers_per_worker.unwrap_or(m.layers.div_ceil(machines));
            Some(swapping_pays(&SwapInput {
                tokens: w.output_tokens,
                step_time: token_ms,
                step_time_double: t.token_ms_double_batch.unwrap_or(token_ms),
                prompt: w.prompt_tokens,
                batch: w.batch,
                kv_bytes_per_token: per_token_layer * layers_per_worker as f64,
                // GB/s to bytes per ms.
                host_bandwidth: swap.host_bandwidth_gbs * 1e6,
            })?)
        }
        _ => None,
    };

    let mut transfers = Vec::new();
    if let Some(prefill) = t.prompt_ms {
        let prompt_bytes = sizing.bytes_per_token as f64 * w.prompt_tokens as f64 * w.batch as f64;
        for link in &input.links {
            let l = Link::from_gbps(link.latency_ms, link.bandwidth_gbps);
            transfers.push((link.name.clone(), prompt_transfer(prompt_bytes, m.layers, prefill, l)?));
        }
    }

    let (memory_report, stage_kv_per_token) = if input.stages.is_empty() {
        (Vec::new(), Vec::new())
    } else {
        let mut start = 0;
        let mut stages = Vec::new();
        for s in &input.stages {
            stages.push(StageSpec { layers: start..start + s.layers, tp: s.tp });
            start += s.layers;
        }
        let setup = Setup::new(spec, stages, w.batch, w.microbatches)
            .map_err(|e| invalid("stages", e.to_string()))?;
        let per_stage: Vec<f64> =
            input.stages.iter().map(|s| s.memory_gb.unwrap_or(input.cluster.memory_gb) * 1e9).collect();
        let tokens = (w.prompt_tokens + w.output_tokens) as u64;
        let kv: Vec<u64> = (0..setup.stages().len() as u32)
            .map(|stage| {
                (0..setup.stages()[stage as usize].tp)
                    .filter_map(|rank| KvSizing::worker_bytes_per_token(&setup, WorkerId { stage, rank }))
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        (check_stage_memory(&setup, m.weights_per_layer, tokens, &per_stage)?, kv)
    };

    Ok(PlanReport {
        spec,
        sizing,
        prompt_kv_per_layer,
        token_kv_per_layer,
        disaggregation,
        swapping,
        transfers,
        memory: memory_report,
        stage_kv_per_token,
    })
}

fn recommendation_json(r: &Recommendation) -> Value {
    match *r {
        Recommendation::Disaggregate { prompt, token, inverse_throughput } => {
            json!({"kind": "disaggregate", "prompt_machines": prompt, "token_machines": token, "inverse_throughput_ms": inverse_throughput})
        }
        Recommendation::Colocate { inverse_throughput } => {
            json!({"kind": "colocate", "inverse_throughput_ms": inverse_throughput})
        }
    }
}

fn eq4_json(e: &Eq4) -> Value {
    match *e {
        Eq4::Pays { threshold } => json!({"verdict": "pays", "threshold_y_over_t": threshold}),
        Eq4::DoesNotPay { threshold } => json!({"verdict": "does_not_pay", "threshold_y_over_t": threshold}),
        Eq4::NeverPays => json!({"verdict": "never_pays", "reason": "D (2 - m) <= 1"}),
    }
}

impl PlanReport {
    /// The report as JSON.
    pub fn to_json(&self) -> Value {
        let s = &self.sizing;
        let mut out = json!({
            "kv": {
                "bytes_per_token": s.bytes_per_token,
                "bytes_per_token_layer": s.bytes_per_token_layer,
                "bytes_per_request": s.bytes_per_request,
                "bytes_per_microbatch": s.bytes_per_microbatch,
                "prompt_kv_per_layer": self.prompt_kv_per_layer,
                "token_kv_per_layer": self.token_kv_per_layer,
            }
        });
        if let Some(d) = &self.disaggregation {
            out["disaggregation"] = json!({
                "min_prompt_depth": d.min_prompt_depth,
                "min_token_depth": d.min_token_depth,
                "colocated_inverse_throughput_ms": d.colocated_inverse_throughput,
                "eq4": eq4_json(&d.eq4),
                "balanced_token_depth": d.balanced_token_depth,
                "balanced_prompt_depth": d.balanced_prompt_depth,
                "balanced_inverse_throughput_ms": d.balanced_inverse_throughput,
                "best_split": d.best_split.map(|(p, t, i)| json!({"prompt_machines": p, "token_machines": t, "inverse_throughput_ms": i})),
                "recommendation": recommendation_json(&d.recommendation),
            });
        }
        if let Some(v) = &self.swapping {
            out["swapping"] = json!({
                "swap_time_ms": v.swap_time,
                "no_swap_time_ms": v.no_swap_time,
                "pays": v.pays,
                "speedup": v.speedup,
                "first_exposed_step": v.first_exposed_step,
            });
        }
        if !self.transfers.is_empty() {
            out["transfers"] = self
                .transfers
                .iter()
                .map(|(name, e)| {
                    json!({
                        "link": name,
                        "whole_ms": e.whole_ms,
                        "per_layer_ms": e.per_layer_ms,
                        "streamed_exposed_ms": e.streamed_exposed_ms,
                        "hidden_behind_prefill": e.hidden_behind_prefill,
                    })
                })
                .collect();
        }
        if !self.memory.is_empty() {
            out["memory"] = self
                .memory
                .iter()
                .zip(&self.stage_kv_per_token)
                .map(|(m, kv)| {
                    json!({"stage": m.stage, "kv_bytes_per_token": kv, "needed_bytes": m.needed, "available_bytes": m.available, "fits": m.fits(), "shortfall_bytes": m.shortfall()})
                })
                .collect();
        }
        out
    }

    /// The report as a human-readable table.
    pub fn to_table(&self) -> String {
        let mut o = String::new();
        let s = &self.sizing;
        let gb = |b: f64| b / 1e9;
        let _ = writeln!(o, "KV sizing ({:?})", self.spec);
        let _ = writeln!(o, "  bytes per token            {}", s.bytes_per_token);
        let _ = writeln!(o, "  bytes per token per layer  {}", s.bytes_per_token_layer);
        let _ = writeln!(o, "  per request                {:.3} GB", gb(s.bytes_per_request as f64));
        let _ = writeln!(o, "  per microbatch             {:.3} GB", gb(s.bytes_per_microbatch as f64));
        let _ = writeln!(o, "  prompt KV in flight/layer  {:.3} GB (C0)", gb(self.prompt_kv_per_layer));
        let _ = writeln!(o, "  token KV in flight/layer   {:.3} GB (K0)", gb(self.token_kv_per_layer));
        match &self.disaggregation {
            None => {
                let _ = writeln!(o, "\nDisaggregation: give timing.prompt_ms and timing.token_ms");
            }
            Some(d) => {
                let _ = writeln!(o, "\nDisaggregation (paper eq. 1-6)");
                let _ = writeln!(o, "  min prompt depth (eq. 1)   {:.3}", d.min_prompt_depth);
                let _ = writeln!(o, "  min token depth (eq. 2)    {:.3}", d.min_token_depth);
                match d.colocated_inverse_throughput {
                    Some(i) => {
                        let _ = writeln!(o, "  colocated I_c (eq. 3)      {i:.3} ms");
                    }
                    None => {
                        let _ = writeln!(o, "  colocated I_c (eq. 3)      does not fit in the machines");
                    }
                }
                let eq4 = match d.eq4 {
                    Eq4::Pays { threshold } => format!("pays (Y/t above {threshold:.3})"),
                    Eq4::DoesNotPay { threshold } => format!("does not pay (Y/t at most {threshold:.3})"),
                    Eq4::NeverPays => "never pays: D (2 - m) <= 1, eq. 4 has no threshold".into(),
                };
                let _ = writeln!(o, "  eq. 4                      {eq4}");
                let _ = writeln!(
                    o,
                    "  D_t, D_p (eq. 5, 6)        {:.3}, {:.3}",
                    d.balanced_token_depth, d.balanced_prompt_depth
                );
                let _ = writeln!(o, "  balanced I_dis             {:.3} ms", d.balanced_inverse_throughput);
                let rec = match d.recommendation {
                    Recommendation::Disaggregate { prompt, token, inverse_throughput } => format!(
                        "disaggregate: {prompt} prompt + {token} token machines, I_dis {inverse_throughput:.3} ms"
                    ),
                    Recommendation::Colocate { inverse_throughput } => {
                        format!("colocate all machines, I_c {inverse_throughput:.3} ms")
                    }
                };
                let _ = writeln!(o, "  recommendation             {rec}");
            }
        }
        if let Some(v) = &self.swapping {
            let _ = writeln!(o, "\nMicrobatch swapping (Appendix E: batch 2B with swapping vs B without)");
            let _ = writeln!(o, "  time with swapping         {:.3} ms", v.swap_time);
            let _ = writeln!(o, "  time without (same tokens) {:.3} ms", v.no_swap_time);
            let exposed = v.first_exposed_step.map_or("none".to_string(), |s| format!("from step {s}"));
            let _ = writeln!(o, "  swap-in exposed            {exposed}");
            let verdict = if v.pays { "pays" } else { "does not pay" };
            let _ = writeln!(o, "  verdict                    {verdict} ({:.3}x throughput)", v.speedup);
        }
        if !self.transfers.is_empty() {
            let _ = writeln!(o, "\nPrompt KV transfer (one microbatch)");
            for (name, e) in &self.transfers {
                let hidden = if e.hidden_behind_prefill { "hidden behind prefill" } else { "exposed" };
                let _ = writeln!(
                    o,
                    "  {name:<26} whole {:.1} ms; layer by layer {:.1} ms/layer, {:.1} ms after prefill ({hidden})",
                    e.whole_ms, e.per_layer_ms, e.streamed_exposed_ms
                );
            }
        }
        if !self.memory.is_empty() {
            let _ = writeln!(o, "\nMemory per stage (fullest rank)");
            for (m, kv) in self.memory.iter().zip(&self.stage_kv_per_token) {
                let verdict = if m.fits() {
                    "fits".to_string()
                } else {
                    format!("DOES NOT FIT: {:.3} GB short", gb(m.shortfall()))
                };
                let _ = writeln!(
                    o,
                    "  stage {:<3} KV {kv} B/token; needs {:.3} GB of {:.3} GB: {verdict}",
                    m.stage,
                    gb(m.needed),
                    gb(m.available)
                );
            }
        }
        o
    }
}
