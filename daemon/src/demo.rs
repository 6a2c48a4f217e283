//! `dejavud demo`: the reference engine as a pipeline of stage processes on loopback, each with a
//! sidecar process that keeps a local copy of its KV and a replica of its ring predecessor's; one
//! worker (engine alone, or engine and sidecar) SIGKILLed in the middle of decoding, and its
//! replacement restoring the KV and resuming; compared with a failure-free run and with a restart
//! from scratch, all in the same run.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use crate::cluster::Kill;
use crate::cluster::{Cluster, ClusterConfig, ClusterError, CpuSplit, Recoveries, Role, TransportKind};
use crate::driver::{drive, DriverConfig, Failed, OnFailure, Run, Workload};
use crate::metrics::value_of;
use crate::netns::Fabric;
use crate::process::EngineCommand;
use dejavu_engine::ModelConfig;
use dejavulib::affinity::CpuList;
use serde::Serialize;
use thiserror::Error;

/// What the demo runs.
#[derive(Clone, Debug)]
pub struct DemoConfig {
    /// Pipeline stages (separate processes); the model's 8 layers are split evenly.
    pub stages: u32,
    /// The stage killed mid-decode.
    pub victim: u32,
    /// Requests (4 per microbatch).
    pub requests: u32,
    /// Prompt tokens per request.
    pub prompt_tokens: u32,
    /// Tokens generated per request.
    pub new_tokens: u32,
    /// A step with no answer after this long makes the driver look for a dead stage.
    pub deadline: Duration,
    /// Time between heartbeats; a process silent for three is dead.
    pub heartbeat: Duration,
    /// What dies: the victim's engine, or its whole worker (engine and sidecar).
    pub kill: Kill,
    /// KV caches each stage keeps in device memory, if fewer than microbatches (swapping).
    pub device_caches: Option<u32>,
    /// Time each stage's step takes on top of the reference model's arithmetic.
    pub step_time: Duration,
    /// Spare workers (a stage and a sidecar process each) started ahead, which a recovery makes
    /// the dead stage's instead of starting processes.
    pub spares: u32,
    /// The transport between sidecars (and from stages to sidecars).
    pub transport: TransportKind,
    /// Each worker in a network namespace of its own, with its own address (needs root).
    pub namespaces: bool,
    /// CPUs set apart for the stages' compute and for replication, if any (see
    /// [`DemoSettings::split_cpus`]).
    pub cpus: Option<CpuSplit>,
    /// Who carries out the recovery: the controller, the cluster feeding the pipeline from its
    /// recovery feed, or the cluster step by step.
    pub recoveries: Recoveries,
    /// The `dejavud` executable to start stage and sidecar processes with.
    pub exe: PathBuf,
    /// The engine each stage runs: the reference model, or an engine process.
    pub engine: DemoEngine,
}

/// The engine of the demo's stages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DemoEngine {
    /// The reference model, in each stage process.
    Reference,
    /// The PyTorch engine (`dejavu.torch_engine`): a Hugging Face `transformers` Llama of the
    /// reference model's shape with seeded random weights, an engine process under each stage,
    /// started with this Python interpreter.
    Torch {
        /// The Python interpreter that has the `dejavu` package, torch and transformers.
        python: String,
    },
}

impl DemoEngine {
    /// Its name in reports.
    pub fn name(&self) -> &'static str {
        match self {
            DemoEngine::Reference => "reference",
            DemoEngine::Torch { .. } => "torch",
        }
    }

    /// The engine process each stage runs, if not the reference model.
    pub fn command(&self) -> Option<EngineCommand> {
        let DemoEngine::Torch { python } = self else { return None };
        let m = ModelConfig::reference();
        // The reference model's shape (float32, the reference model's seed): the same sizes,
        // computed by transformers' Llama layers instead.
        let shape = format!(
            "{{\"layers\": {}, \"hidden\": {}, \"heads\": {}, \"kv_heads\": {}, \"intermediate\": {}, \"vocab\": {}, \"seed\": {}, \"dtype\": \"float32\"}}",
            m.layers, m.d_model, m.q_heads, m.kv_heads, m.ffn, m.vocab, m.seed
        );
        let argv =
            [python.as_str(), "-m", "dejavu.torch_engine", "member", "--shape", &shape, "--threads", "1"];
        Some(EngineCommand::new(argv.iter().map(|a| a.to_string()).collect()).expect("a program"))
    }
}

/// The engine of the stages, as a setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineSetting {
    /// The reference model, in each stage process.
    Reference,
    /// The PyTorch engine (`python3 -m dejavu.torch_engine member`, with `--python`): a
    /// `transformers` Llama of the same shape with seeded random weights, as an engine process
    /// under each stage.
    Torch,
}

/// What to kill, as a setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KillSetting {
    /// The engine and its sidecar: the KV comes back from the successor's sidecar.
    Worker,
    /// The engine alone: the KV comes back from its own sidecar.
    Engine,
}

/// The demo's settings, from flags or a TOML file with the same names (`stages = 4`,
/// `kill = "engine"`, `deadline_ms = 300`, ...); a flag overrides the file.
#[derive(Clone, Debug, Default, clap::Args, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DemoSettings {
    /// Pipeline stages (processes); the model's 8 layers are split evenly [default: 4].
    #[arg(long)]
    pub stages: Option<u32>,
    /// The stage to kill [default: 2].
    #[arg(long)]
    pub victim: Option<u32>,
    /// What to kill: the victim's whole worker (engine and sidecar) or its engine alone
    /// [default: worker].
    #[arg(long, value_enum)]
    pub kill: Option<KillSetting>,
    /// Requests, 4 per microbatch [default: 8].
    #[arg(long)]
    pub requests: Option<u32>,
    /// Prompt tokens per request [default: 32].
    #[arg(long)]
    pub prompt_tokens: Option<u32>,
    /// Tokens generated per request [default: 256].
    #[arg(long)]
    pub new_tokens: Option<u32>,
    /// A step with no answer after this many milliseconds makes the driver look for a dead
    /// stage [default: 300].
    #[arg(long)]
    pub deadline_ms: Option<u64>,
    /// Milliseconds between heartbeats; a process silent for three is dead [default: 100].
    #[arg(long)]
    pub heartbeat_ms: Option<u64>,
    /// KV caches each stage keeps in device memory; fewer than the microbatches (requests / 4)
    /// turns microbatch swapping on [default: one per microbatch].
    #[arg(long)]
    pub device_caches: Option<u32>,
    /// Milliseconds each stage's step takes on top of the reference model's arithmetic, as a
    /// real model's kernels would on a GPU (the stage waits without using a CPU) [default: 0].
    #[arg(long)]
    pub step_ms: Option<f64>,
    /// Spare workers started ahead (a stage and a sidecar process each), registered with the
    /// controller; a recovery makes them the dead stage's instead of starting processes
    /// [default: 0].
    #[arg(long)]
    pub spares: Option<u32>,
    /// The transport between sidecars and from stages to sidecars: TCP, or QUIC with mutual TLS
    /// on certificates the demo generates [default: tcp].
    #[arg(long, value_enum)]
    pub transport: Option<TransportSetting>,
    /// Run each worker (a stage and its sidecar) in a network namespace of its own, at its own
    /// address on a bridge, as on machines of their own; needs root and iproute2
    /// (`--namespaces=false` turns a file's setting off) [default: false].
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub namespaces: Option<bool>,
    /// Set the CPUs apart: the stages compute on the first half of the CPUs this process may run
    /// on, and the streamer threads and sidecars copy KV on the rest, as on a GPU server, where
    /// the engine computes on the GPU and the host's cores stream; otherwise replication's wakeups
    /// preempt the CPU engine's compute (`--split-cpus=false`: every process on any CPU; with one
    /// CPU there is nothing to split) [default: true].
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub split_cpus: Option<bool>,
    /// Who carries out the recovery: the controller (`controller --stages`: it fences, restores
    /// the replaced sidecar and publishes where each sequence resumes, which the demo's driver
    /// reads from its recovery feed, as any engine's feeder would), or the driver step by step,
    /// with the controller's help [default: controller].
    #[arg(long, value_enum)]
    pub recoveries: Option<RecoveriesSetting>,
    /// The engine each stage runs: the reference model, or the PyTorch engine as an engine
    /// process under each stage (needs the `dejavu` Python package, torch and transformers)
    /// [default: reference].
    #[arg(long, value_enum)]
    pub engine: Option<EngineSetting>,
    /// The Python interpreter of `--engine torch` [default: python3].
    #[arg(long)]
    pub python: Option<String>,
}

/// Who carries out recoveries, as a setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RecoveriesSetting {
    /// The controller; the driver resumes the sequences from its recovery feed.
    Controller,
    /// The driver, step by step.
    Driver,
}

impl From<RecoveriesSetting> for Recoveries {
    fn from(setting: RecoveriesSetting) -> Self {
        match setting {
            RecoveriesSetting::Controller => Recoveries::ByController,
            RecoveriesSetting::Driver => Recoveries::Driven,
        }
    }
}

/// The CPUs this process may run on, in halves: compute, then replication; `None` with one CPU.
fn split_available_cpus() -> Option<CpuSplit> {
    let available = CpuList::of_current_thread().ok()?;
    let (compute, replication) = available.halves()?;
    Some(CpuSplit { compute, replication })
}

/// The transport between sidecars, as a setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportSetting {
    /// TCP (the cluster secret authenticates every connection).
    Tcp,
    /// QUIC with mutual TLS on the cluster's certificates, and the secret.
    Quic,
}

impl DemoSettings {
    /// Settings from a TOML file; unknown keys and wrong types are errors that name them.
    pub fn load(path: &std::path::Path) -> Result<Self, DemoError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| DemoError::Invalid(format!("cannot read {}: {e}", path.display())))?;
        toml::from_str(&text).map_err(|e| DemoError::Invalid(format!("{}: {}", path.display(), e.message())))
    }

    /// These settings, falling back to `base` for the ones not given.
    pub fn or(self, base: DemoSettings) -> DemoSettings {
        DemoSettings {
            stages: self.stages.or(base.stages),
            victim: self.victim.or(base.victim),
            kill: self.kill.or(base.kill),
            requests: self.requests.or(base.requests),
            prompt_tokens: self.prompt_tokens.or(base.prompt_tokens),
            new_tokens: self.new_tokens.or(base.new_tokens),
            deadline_ms: self.deadline_ms.or(base.deadline_ms),
            heartbeat_ms: self.heartbeat_ms.or(base.heartbeat_ms),
            device_caches: self.device_caches.or(base.device_caches),
            step_ms: self.step_ms.or(base.step_ms),
            spares: self.spares.or(base.spares),
            transport: self.transport.or(base.transport),
            namespaces: self.namespaces.or(base.namespaces),
            split_cpus: self.split_cpus.or(base.split_cpus),
            recoveries: self.recoveries.or(base.recoveries),
            engine: self.engine.or(base.engine),
            python: self.python.or(base.python),
        }
    }

    /// The configuration, with defaults for what is not given, starting processes from `exe`.
    pub fn resolve(self, exe: PathBuf) -> DemoConfig {
        DemoConfig {
            stages: self.stages.unwrap_or(4),
            victim: self.victim.unwrap_or(2),
            requests: self.requests.unwrap_or(8),
            prompt_tokens: self.prompt_tokens.unwrap_or(32),
            new_tokens: self.new_tokens.unwrap_or(256),
            deadline: Duration::from_millis(self.deadline_ms.unwrap_or(300)),
            heartbeat: Duration::from_millis(self.heartbeat_ms.unwrap_or(100)),
            kill: match self.kill.unwrap_or(KillSetting::Worker) {
                KillSetting::Worker => Kill::Worker,
                KillSetting::Engine => Kill::Engine,
            },
            device_caches: self.device_caches,
            step_time: Duration::from_secs_f64(self.step_ms.unwrap_or(0.0).clamp(0.0, 600_000.0) / 1e3),
            spares: self.spares.unwrap_or(0),
            transport: match self.transport {
                Some(TransportSetting::Quic) => TransportKind::Quic,
                Some(TransportSetting::Tcp) | None => TransportKind::Tcp,
            },
            namespaces: self.namespaces.unwrap_or(false),
            cpus: if self.split_cpus.unwrap_or(true) { split_available_cpus() } else { None },
            recoveries: self.recoveries.unwrap_or(RecoveriesSetting::Controller).into(),
            exe,
            engine: match self.engine.unwrap_or(EngineSetting::Reference) {
                EngineSetting::Reference => DemoEngine::Reference,
                EngineSetting::Torch => {
                    DemoEngine::Torch { python: self.python.unwrap_or_else(|| "python3".into()) }
                }
            },
        }
    }
}

/// Why the demo could not run.
#[derive(Debug, Error)]
pub enum DemoError {
    /// A setting is out of range.
    #[error("invalid demo setting: {0}")]
    Invalid(String),
    /// The cluster could not start, recover or go on.
    #[error(transparent)]
    Run(#[from] Failed),
}

/// Timings of one recovery.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Recovery {
    /// From sending the step the kill broke (the kill comes just before it) to the heartbeat
    /// controller declaring the process dead.
    pub detection_ms: f64,
    /// Starting the replacement, repairing the chain, restoring its KV (from its own sidecar, or
    /// from its successor's when its sidecar died too), recomputing the steps replication had not
    /// kept yet, and re-replicating the predecessor's KV to a replacement sidecar.
    pub restore_ms: f64,
    /// Running the interrupted step again.
    pub resume_ms: f64,
    /// Steps computed twice because of the failure: the replication lag, plus the interrupted step.
    pub tokens_recomputed: u64,
}

/// The demo's results.
#[derive(Clone, Debug, Serialize)]
pub struct DemoReport {
    /// The engine the stages ran: `reference` or `torch`.
    pub engine: &'static str,
    /// Tokens generated per run.
    pub tokens: u64,
    /// Failure-free run without replication (no fault tolerance), seconds. Every run's time is
    /// serving time: from its cluster being up to its last token (a restart's new cluster counted).
    pub unreplicated_s: f64,
    /// Failure-free run, seconds.
    pub failure_free_s: f64,
    /// Run with one stage killed and recovered, seconds.
    pub with_failure_s: f64,
    /// Run with one stage killed and everything restarted from scratch, seconds.
    pub restart_s: f64,
    /// Median decode-step time of the run without replication, ms (from sending a step to its
    /// token; see [`Run::decode_steps`]).
    pub unreplicated_step_ms: f64,
    /// Median decode-step time of the failure-free run, KV replicated every step, ms.
    pub failure_free_step_ms: f64,
    /// Steps in each block of the interleaved run: replication runs in the first block, is
    /// paused in the second, and so on.
    pub interleaved_block: u64,
    /// Median time of the interleaved run's decode steps while replication ran, ms. The two
    /// interleaved medians come from one run, whose steps alternate in blocks between the two
    /// settings: load that comes and goes over seconds weighs on both alike.
    pub interleaved_replicated_step_ms: f64,
    /// Median time of the interleaved run's decode steps while replication was paused, ms.
    pub interleaved_paused_step_ms: f64,
    /// The recovery of the run with a failure.
    pub recovery: Recovery,
    /// Tokens recomputed by the restart from scratch.
    pub restart_tokens_recomputed: u64,
    /// Bytes of KV replicated to successors' sidecars per generated token (all stages; each stage
    /// writes as many again to its own sidecar).
    pub kv_bytes_replicated_per_token: u64,
    /// Bytes the stages swapped between their device caches and host memory in the failure-free
    /// run, before its last step (0 without `--device-caches` below the microbatches).
    pub swapped_bytes: u64,
    /// Spare processes (stages and sidecars) the recovery made the dead stage's, instead of
    /// starting processes (0 without `--spares`).
    pub spares_used: u64,
    /// Whether the run with a failure (and the ones without replication and interleaved) produced
    /// exactly the failure-free tokens.
    pub matched: bool,
    /// Whether the restart from scratch did.
    pub restart_matched: bool,
    /// The first request's prompt and the tokens the failure-free run generated for it: what
    /// another run of the same model (in one process, say) must generate too.
    pub first_request: FirstRequest,
}

/// A request and what it generated.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FirstRequest {
    /// Its prompt's tokens.
    pub prompt: Vec<u32>,
    /// The tokens generated.
    pub tokens: Vec<u32>,
}

/// Even consecutive layer ranges for `stages` stages.
fn splits(layers: u32, stages: u32) -> Vec<std::ops::Range<u32>> {
    (0..stages).map(|s| s * layers / stages..(s + 1) * layers / stages).collect()
}

/// The demo's requests: deterministic prompts, 4 per microbatch.
fn workload(config: &DemoConfig) -> Workload {
    Workload::synthetic(
        config.requests,
        config.prompt_tokens,
        config.new_tokens,
        4,
        ModelConfig::reference().vocab,
    )
}

fn start_cluster(
    config: &DemoConfig,
    fabric: Option<&Arc<Fabric>>,
    workload: &Workload,
    replicate: bool,
) -> Result<Cluster, ClusterError> {
    Cluster::start(ClusterConfig {
        splits: splits(ModelConfig::reference().layers, config.stages),
        slots: workload.slots,
        microbatches: workload.microbatches(),
        max_tokens: workload.max_tokens(),
        step_time: config.step_time,
        replicate,
        deadline: config.deadline,
        heartbeat: config.heartbeat,
        device_caches: config.device_caches,
        spares: config.spares,
        transport: config.transport,
        fabric: fabric.cloned(),
        cpus: config.cpus.clone(),
        recoveries: config.recoveries,
        engine: config.engine.command(),
        ..ClusterConfig::new(config.exe.clone())
    })
}

/// Failed attempts at one step with no dead stage before the demo gives up.
const RETRIES: u32 = 2;

/// What a run's cluster said before its last step.
#[derive(Clone, Copy, Debug, Default)]
struct Seen {
    /// Bytes its stages had swapped between device caches and host memory (from their metrics).
    swapped: u64,
    /// Spare processes its recoveries made stages' processes of.
    spares_used: u64,
}

/// Runs the workload, recovering or restarting after a failure. With `kill_at`, the victim is
/// SIGKILLed before that step. Returns the run and what its cluster said before its last step.
fn run_once(
    config: &DemoConfig,
    fabric: Option<&Arc<Fabric>>,
    kill_at: Option<u64>,
    on_failure: OnFailure,
) -> Result<(Run, Seen), DemoError> {
    run_with(config, fabric, kill_at, on_failure, None)
}

/// Steps per block of the interleaved run for a run of `steps` steps: an eighth of them (so about
/// four blocks of each setting, the prompts' steps counted), at most 64. Runs so short that a
/// setting gets no decode step report its median as 0.
fn interleaved_block(steps: u64) -> u64 {
    (steps / 8).clamp(1, 64)
}

/// Whether the interleaved run replicates step `step`: in every other block, from the first.
fn replicated_in_block(step: u64, block: u64) -> bool {
    (step / block) % 2 == 0
}

/// [`run_once`], and with `interleave` a block size: replication is paused and resumed at
/// every block's first step (see [`replicated_in_block`]).
fn run_with(
    config: &DemoConfig,
    fabric: Option<&Arc<Fabric>>,
    kill_at: Option<u64>,
    on_failure: OnFailure,
    interleave: Option<u64>,
) -> Result<(Run, Seen), DemoError> {
    let workload = workload(config);
    let replicate = on_failure == OnFailure::Recover;
    let driver = DriverConfig {
        on_failure,
        detect_patience: config.heartbeat * 6,
        watch_every: config.heartbeat,
        retries: RETRIES,
    };
    // Without replication there is no sidecar to kill: the engine dies alone.
    let what = if replicate { config.kill } else { Kill::Engine };
    let (mut killed, mut seen) = (false, Seen::default());
    let last = workload.steps() - 1;
    let mut inject = |step: u64, cluster: &mut Cluster| {
        if kill_at == Some(step) && !killed {
            killed = true;
            cluster.faults().kill(config.victim as usize, what)?;
        }
        if let Some(block) = interleave.filter(|&block| step > 0 && step % block == 0) {
            cluster.set_replication(replicated_in_block(step, block))?;
        }
        if step == last {
            seen = Seen { swapped: swapped_bytes(cluster)?, spares_used: cluster.spares_used() };
        }
        Ok(())
    };
    let run =
        drive(&workload, &driver, &mut || start_cluster(config, fabric, &workload, replicate), &mut inject)?;
    Ok((run, seen))
}

/// Bytes every stage of `cluster` has swapped in and out so far.
fn swapped_bytes(cluster: &mut Cluster) -> Result<u64, ClusterError> {
    let mut total = 0.0;
    for stage in 0..cluster.len() {
        let page = cluster.metrics(stage, Role::Engine)?;
        for name in ["dejavu_stage_swap_in_bytes_total", "dejavu_stage_swap_out_bytes_total"] {
            total += value_of(&page, name, &[]).unwrap_or(0.0);
        }
    }
    Ok(total as u64)
}

/// The demo's summary of a run's one recovery (zeros if none happened).
fn recovery_of(run: &Run) -> Recovery {
    run.recoveries.first().map_or_else(Recovery::default, |r| Recovery {
        detection_ms: ms(r.detection),
        restore_ms: ms(r.restore),
        resume_ms: ms(r.resume),
        tokens_recomputed: r.recomputed,
    })
}

impl DemoConfig {
    /// Checks the settings: shapes the model and the pipeline can take, and a workload that fits
    /// in the memory available ([`DemoConfig::memory_estimate`]).
    pub fn validate(&self) -> Result<(), DemoError> {
        let model = ModelConfig::reference();
        if self.stages == 0 || self.stages > model.layers {
            return Err(DemoError::Invalid(format!("stages must be 1..={}", model.layers)));
        }
        if self.kill == Kill::Worker && self.stages < 2 {
            return Err(DemoError::Invalid(
                "killing a worker needs two stages or more (its KV comes back from its successor)".into(),
            ));
        }
        if self.victim >= self.stages {
            return Err(DemoError::Invalid(format!(
                "victim {} is not one of {} stages",
                self.victim, self.stages
            )));
        }
        if self.heartbeat.is_zero() || self.deadline.is_zero() {
            return Err(DemoError::Invalid(
                "the deadline and the heartbeat interval must be positive".into(),
            ));
        }
        if self.requests == 0 || self.prompt_tokens == 0 || self.new_tokens < 2 {
            return Err(DemoError::Invalid(
                "requests and prompt tokens must be positive, new tokens at least 2".into(),
            ));
        }
        if self.engine != DemoEngine::Reference
            && (self.transport != TransportKind::Tcp || !self.step_time.is_zero())
        {
            return Err(DemoError::Invalid(
                "--engine torch runs without --step-ms, over TCP (it reads a peer sidecar over TCP)".into(),
            ));
        }
        if self.device_caches == Some(0) {
            return Err(DemoError::Invalid("device caches must be at least 1".into()));
        }
        let needed = self.memory_estimate();
        if let Some(available) = available_memory().filter(|&available| needed > available) {
            return Err(DemoError::Invalid(format!(
                "{} requests of {} tokens need about {:.1} GB (each token's KV in its stage's cache, its \
                 own sidecar and its successor's, and the tokens themselves); {:.1} GB is available",
                self.requests,
                self.prompt_tokens + self.new_tokens,
                needed as f64 / 1e9,
                available as f64 / 1e9
            )));
        }
        Ok(())
    }

    /// Bytes the runs hold at their largest: each token's KV three times (the stage's cache, its
    /// own sidecar's copy and its successor's replica) and what the driver keeps of each token.
    pub fn memory_estimate(&self) -> u64 {
        let tokens = u64::from(self.requests) * (u64::from(self.prompt_tokens) + u64::from(self.new_tokens));
        let kv = ModelConfig::reference().kv_spec().bytes_per_token();
        tokens.saturating_mul(3 * kv + DRIVER_BYTES_PER_TOKEN)
    }
}

/// Runs the demo, reporting progress through `say`.
pub fn run(config: &DemoConfig, mut say: impl FnMut(&str)) -> Result<DemoReport, DemoError> {
    config.validate()?;
    let model = ModelConfig::reference();
    let steps = config.requests as u64 * config.new_tokens as u64;
    let kill_at = steps / 2;
    let fabric = if config.namespaces {
        Some(Arc::new(Fabric::create().map_err(|e| DemoError::Invalid(e.to_string()))?))
    } else {
        None
    };
    let fabric = fabric.as_ref();

    say("failure-free run without replication...");
    let (unreplicated, _) = run_once(config, fabric, None, OnFailure::Restart)?;
    say("failure-free run, KV replicated every step...");
    let (reference, failure_free) = run_once(config, fabric, None, OnFailure::Recover)?;
    let block = interleaved_block(steps);
    say(&format!("failure-free run, replication paused and resumed every {block} steps..."));
    let (interleaved, _) = run_with(config, fabric, None, OnFailure::Recover, Some(block))?;
    let interleaved_ms = |replicated: bool| {
        median_ms(interleaved.median_decode_step_where(|step| replicated_in_block(step, block) == replicated))
    };
    say(&format!(
        "run with stage {}'s {} SIGKILLed at step {kill_at} of {steps}, recovered from {}...",
        config.victim,
        match config.kill {
            Kill::Engine => "engine",
            Kill::Worker => "engine and sidecar",
        },
        match config.kill {
            Kill::Engine => "its own sidecar's copy",
            Kill::Worker => "its successor's sidecar",
        },
    ));
    let (recovered, after_failure) = run_once(config, fabric, Some(kill_at), OnFailure::Recover)?;
    say("run with the same failure, restarted from scratch...");
    let (restarted, _) = run_once(config, fabric, Some(kill_at), OnFailure::Restart)?;
    Ok(DemoReport {
        engine: config.engine.name(),
        tokens: steps,
        unreplicated_s: unreplicated.elapsed.as_secs_f64(),
        failure_free_s: reference.elapsed.as_secs_f64(),
        with_failure_s: recovered.elapsed.as_secs_f64(),
        restart_s: restarted.elapsed.as_secs_f64(),
        unreplicated_step_ms: median_ms(unreplicated.median_decode_step()),
        failure_free_step_ms: median_ms(reference.median_decode_step()),
        interleaved_block: block,
        interleaved_replicated_step_ms: interleaved_ms(true),
        interleaved_paused_step_ms: interleaved_ms(false),
        recovery: recovery_of(&recovered),
        restart_tokens_recomputed: recovery_of(&restarted).tokens_recomputed,
        kv_bytes_replicated_per_token: model.kv_spec().bytes_per_token(),
        swapped_bytes: failure_free.swapped,
        spares_used: after_failure.spares_used,
        matched: recovered.tokens == reference.tokens
            && unreplicated.tokens == reference.tokens
            && interleaved.tokens == reference.tokens,
        restart_matched: restarted.tokens == reference.tokens,
        first_request: FirstRequest {
            prompt: workload(config).prompts.first().cloned().unwrap_or_default(),
            tokens: reference.tokens.first().cloned().unwrap_or_default(),
        },
    })
}

/// A duration in milliseconds.
fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A median decode-step time in milliseconds (0 where there were no decode steps).
fn median_ms(median: Option<Duration>) -> f64 {
    median.map_or(0.0, ms)
}

impl DemoReport {
    /// A human-readable summary.
    pub fn to_text(&self, config: &DemoConfig) -> String {
        let r = &self.recovery;
        let tps = |s: f64| self.tokens as f64 / s;
        format!(
            "\
no replication:          {:7.3} s  ({:.0} tokens/s)
failure-free:            {:7.3} s  ({:.0} tokens/s; replication overhead {:+.1}%)
decode step (median):    {:.3} ms without replication, {:.3} ms replicated ({:+.1}%)
  in one run, alternating every {} steps: {:.3} ms replication paused, {:.3} ms replicated ({})
one failure, recovered:  {:7.3} s  ({:.2}x)  detection {:.0} ms, restore {:.1} ms, resume {:.1} ms, tokens recomputed {}
one failure, restarted:  {:7.3} s  ({:.2}x)  tokens recomputed {}
KV per token: {} bytes to the successors' sidecars, as many to the local ones (all {} stages)
{}{}output identical to the failure-free run: {} (restart from scratch: {})
",
            self.unreplicated_s,
            tps(self.unreplicated_s),
            self.failure_free_s,
            tps(self.failure_free_s),
            (self.failure_free_s / self.unreplicated_s - 1.0) * 100.0,
            self.unreplicated_step_ms,
            self.failure_free_step_ms,
            (self.failure_free_step_ms / self.unreplicated_step_ms - 1.0) * 100.0,
            self.interleaved_block,
            self.interleaved_paused_step_ms,
            self.interleaved_replicated_step_ms,
            if self.interleaved_replicated_step_ms > 0.0 && self.interleaved_paused_step_ms > 0.0 {
                format!("{:+.1}%", (self.interleaved_replicated_step_ms / self.interleaved_paused_step_ms - 1.0) * 100.0)
            } else {
                "too few steps to compare".to_owned()
            },
            self.with_failure_s,
            self.with_failure_s / self.failure_free_s,
            r.detection_ms,
            r.restore_ms,
            r.resume_ms,
            r.tokens_recomputed,
            self.restart_s,
            self.restart_s / self.failure_free_s,
            self.restart_tokens_recomputed,
            self.kv_bytes_replicated_per_token,
            config.stages,
            if config.step_time.is_zero() {
                String::new()
            } else {
                format!(
                    "each stage's step takes {:.1} ms on top of its arithmetic (--step-ms), as a real model's kernels\n",
                    config.step_time.as_secs_f64() * 1e3
                )
            },
            match config.device_caches {
                Some(n) => format!(
                    "microbatch swapping: {n} device caches per stage, {} bytes swapped in and out\n",
                    self.swapped_bytes
                ),
                None => String::new(),
            } + &match config.spares {
                0 => String::new(),
                n => format!(
                    "{n} spare worker(s) started ahead: the recovery made {} spare process(es) the dead stage's\n",
                    self.spares_used
                ),
            },
            if self.matched { "yes" } else { "NO" },
            if self.restart_matched { "yes" } else { "NO" },
        )
    }
}

/// What the driver keeps of each token of each run: the token, its delivery record, the
/// reference's token to compare with.
const DRIVER_BYTES_PER_TOKEN: u64 = 64;

/// `MemAvailable` from `/proc/meminfo`, in bytes (`None` where it cannot be read).
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
