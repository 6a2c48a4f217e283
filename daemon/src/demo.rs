//! `dejavud demo`: the reference engine as a pipeline of stage processes on loopback, each with a
//! sidecar process that keeps a local copy of its KV and a replica of its ring predecessor's; one
//! worker (engine alone, or engine and sidecar) SIGKILLed in the middle of decoding, and its
//! replacement restoring the KV and resuming; compared with a failure-free run and with a restart
//! from scratch, all in the same run.

use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpListener};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dejavu_engine::process::{ProcessError, RemotePipeline};
use dejavu_engine::{ModelConfig, Seat};
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
    /// A step with no answer after this long means a stage failed.
    pub deadline: Duration,
    /// What dies: the victim's engine, or its whole worker (engine and sidecar).
    pub kill: Kill,
    /// The `dejavud` executable to start stage and sidecar processes with.
    pub exe: PathBuf,
}

/// Why the demo could not run.
#[derive(Debug, Error)]
pub enum DemoError {
    /// A setting is out of range.
    #[error("invalid demo setting: {0}")]
    Invalid(String),
    /// A child process could not start.
    #[error("cannot start {what}: {why}")]
    Spawn {
        /// Which process.
        what: String,
        /// Why.
        why: String,
    },
    /// The pipeline failed in a way recovery does not cover.
    #[error(transparent)]
    Pipeline(#[from] ProcessError),
    /// A local socket failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// Timings of one recovery.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Recovery {
    /// From the kill to the missed deadline that revealed it.
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
    /// Tokens generated per run.
    pub tokens: u64,
    /// Failure-free run without replication (no fault tolerance), seconds.
    pub unreplicated_s: f64,
    /// Failure-free run, seconds.
    pub failure_free_s: f64,
    /// Run with one stage killed and recovered, seconds.
    pub with_failure_s: f64,
    /// Run with one stage killed and everything restarted from scratch, seconds.
    pub restart_s: f64,
    /// The recovery of the run with a failure.
    pub recovery: Recovery,
    /// Tokens recomputed by the restart from scratch.
    pub restart_tokens_recomputed: u64,
    /// Bytes of KV replicated to successors' sidecars per generated token (all stages; each stage
    /// writes as many again to its own sidecar).
    pub kv_bytes_replicated_per_token: u64,
    /// Whether the run with a failure (and the one without replication) produced exactly the
    /// failure-free tokens.
    pub matched: bool,
    /// Whether the restart from scratch did.
    pub restart_matched: bool,
}

/// A child process, killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `exe args...` and waits for its `listening ADDR` line.
fn start(exe: &Path, args: &[String], what: &str) -> Result<(Proc, SocketAddr), DemoError> {
    let spawn_err = |why: String| DemoError::Spawn { what: what.to_owned(), why };
    let mut child = Command::new(exe)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| spawn_err(e.to_string()))?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
    match line.trim().strip_prefix("listening ").and_then(|a| a.parse().ok()) {
        Some(addr) => Ok((Proc(child), addr)),
        None => {
            let mut err = String::new();
            let _ = child.stderr.take().expect("piped").read_to_string(&mut err);
            let _ = child.kill();
            let _ = child.wait();
            Err(spawn_err(format!("{}{}", line.trim(), err.trim())))
        }
    }
}

/// Even consecutive layer ranges for `stages` stages.
fn splits(layers: u32, stages: u32) -> Vec<Range<u32>> {
    (0..stages).map(|s| s * layers / stages..(s + 1) * layers / stages).collect()
}

/// What the demo kills.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Kill {
    /// The engine process alone: its sidecar lives on with the local copy of its KV.
    Engine,
    /// The whole worker, engine and sidecar: its KV comes back from its ring successor's sidecar.
    Worker,
}

/// A running pipeline: stage processes, their sidecars (when replicating) and the driver's end.
struct Cluster {
    config: DemoConfig,
    /// One per stage; stage `k` keeps its local copy in sidecar `k` and its replica in `k + 1`.
    sidecars: Vec<(Proc, SocketAddr)>,
    stages: Vec<Proc>,
    addrs: Vec<SocketAddr>,
    driver: SocketAddr,
    remote: RemotePipeline,
}

impl Cluster {
    fn slots(config: &DemoConfig) -> u32 {
        config.requests.min(4)
    }

    fn args_for(
        config: &DemoConfig,
        sidecars: Option<(SocketAddr, SocketAddr)>,
        index: usize,
        next: SocketAddr,
    ) -> Vec<String> {
        let layers = &splits(ModelConfig::reference().layers, config.stages)[index];
        let slots = Self::slots(config);
        let mut args = vec![
            "stage".to_owned(),
            format!("--index={index}"),
            format!("--layers={}..{}", layers.start, layers.end),
            format!("--next={next}"),
            format!("--slots={slots}"),
            format!("--microbatches={}", config.requests.div_ceil(slots)),
            format!("--max-tokens={}", config.prompt_tokens + config.new_tokens + 1),
        ];
        if let Some((local, successor)) = sidecars {
            args.push(format!("--local={local}"));
            args.push(format!("--successor={successor}"));
        }
        args
    }

    /// Sidecar addresses of stage `index`: its own and its successor's.
    fn copies(sidecars: &[(Proc, SocketAddr)], index: usize) -> Option<(SocketAddr, SocketAddr)> {
        (!sidecars.is_empty()).then(|| (sidecars[index].1, sidecars[(index + 1) % sidecars.len()].1))
    }

    fn start(config: &DemoConfig, replicate: bool) -> Result<Self, DemoError> {
        let n = config.stages as usize;
        let sidecars = if replicate {
            (0..n)
                .map(|i| start(&config.exe, &["sidecar".to_owned()], &format!("sidecar {i}")))
                .collect::<Result<Vec<_>, _>>()?
        } else {
            Vec::new()
        };
        let results = TcpListener::bind("127.0.0.1:0")?;
        let driver = results.local_addr()?;
        let (mut stages, mut addrs, mut next) = (Vec::new(), Vec::new(), driver);
        for index in (0..n).rev() {
            let args = Self::args_for(config, Self::copies(&sidecars, index), index, next);
            let (proc, addr) = start(&config.exe, &args, &format!("stage {index}"))?;
            stages.push(proc);
            addrs.push(addr);
            next = addr;
        }
        stages.reverse();
        addrs.reverse();
        let remote = RemotePipeline::connect(next, results, config.deadline)?;
        Ok(Self { config: config.clone(), sidecars, stages, addrs, driver, remote })
    }

    fn seat(&self, request: usize) -> Seat {
        let slots = Self::slots(&self.config) as usize;
        Seat { microbatch: (request / slots) as u32, slot: (request % slots) as u32 }
    }

    /// Kills stage `victim`'s engine, and with `Kill::Worker` its sidecar too.
    fn kill(&mut self, victim: usize, what: Kill) -> Result<(), DemoError> {
        self.stages[victim].0.kill()?;
        self.stages[victim].0.wait()?;
        if what == Kill::Worker {
            self.sidecars[victim].0 .0.kill()?;
            self.sidecars[victim].0 .0.wait()?;
        }
        Ok(())
    }

    /// The stage whose engine process has exited, if any.
    fn dead_stage(&mut self) -> Option<usize> {
        self.stages.iter_mut().position(|p| matches!(p.0.try_wait(), Ok(Some(_))))
    }

    /// Replaces dead stage `victim` (and its sidecar, if that died too), restores the KV of every
    /// sequence from the surviving copy and recomputes what replication had not yet kept; returns
    /// the steps recomputed.
    fn replace(
        &mut self,
        victim: usize,
        prompts: &[Vec<u32>],
        progress: &[Vec<u32>],
    ) -> Result<u64, DemoError> {
        let n = self.stages.len();
        let sidecar_died = matches!(self.sidecars[victim].0 .0.try_wait(), Ok(Some(_)));
        // 1. Where the KV comes back from: the engine's own sidecar, or its successor's.
        let from = if sidecar_died {
            self.sidecars[victim] =
                start(&self.config.exe, &["sidecar".to_owned()], "a replacement sidecar")?;
            Some(self.sidecars[(victim + 1) % n].1)
        } else {
            None
        };
        // 2. A replacement engine joins the chain.
        let last = victim + 1 == n;
        let next = if last { self.driver } else { self.addrs[victim + 1] };
        let args = Self::args_for(&self.config, Self::copies(&self.sidecars, victim), victim, next);
        let (proc, addr) = start(&self.config.exe, &args, "a replacement stage")?;
        self.stages[victim] = proc;
        self.addrs[victim] = addr;
        self.remote.replace(victim as u32, addr, last)?;
        // 3. It restores every sequence and recomputes the replication lag.
        let mut recomputed = 0;
        for (request, tokens) in progress.iter().enumerate() {
            let seat = self.seat(request);
            recomputed += self.remote.recover(&[victim as u32], seat, &prompts[request], tokens, from)?;
            // 4. The predecessor's replica died with the sidecar: it replicates to the new one.
            if sidecar_died && !tokens.is_empty() {
                let prompt_len = prompts[request].len() as u32;
                let kv_tokens = prompt_len + tokens.len() as u32 - 1;
                let predecessor = ((victim + n - 1) % n) as u32;
                self.remote.replicate_to(
                    predecessor,
                    seat,
                    prompt_len,
                    kv_tokens,
                    self.sidecars[victim].1,
                )?;
            }
        }
        Ok(recomputed)
    }
}

/// Deterministic prompts.
fn prompts(config: &DemoConfig) -> Vec<Vec<u32>> {
    let vocab = ModelConfig::reference().vocab;
    (0..config.requests)
        .map(|r| (0..config.prompt_tokens).map(|t| (r * 7919 + t * 104_729 + 13) % vocab).collect())
        .collect()
}

/// What happens when a step fails.
#[derive(Clone, Copy, PartialEq, Eq)]
enum OnFailure {
    /// Replace the dead stage and restore its KV (DéjàVu).
    Recover,
    /// Start everything again from the first token.
    Restart,
}

/// Runs the workload: every prompt, then one token per request per round. With `kill_at`, the
/// victim is SIGKILLed before that step.
fn workload(
    config: &DemoConfig,
    kill_at: Option<u64>,
    on_failure: OnFailure,
) -> Result<(Vec<Vec<u32>>, Recovery, Duration), DemoError> {
    let prompts = prompts(config);
    let prompt_len = config.prompt_tokens;
    let started = Instant::now();
    let mut cluster = Cluster::start(config, on_failure == OnFailure::Recover)?;
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut recovery = Recovery::default();
    let mut step = 0u64;
    let mut killed_at: Option<Instant> = None;
    'rounds: loop {
        for request in 0..prompts.len() {
            if out[request].len() == config.new_tokens as usize {
                continue;
            }
            if kill_at == Some(step) && killed_at.is_none() {
                let what = if on_failure == OnFailure::Recover { config.kill } else { Kill::Engine };
                cluster.kill(config.victim as usize, what)?;
                killed_at = Some(Instant::now());
            }
            step += 1;
            let seat = cluster.seat(request);
            let result = match out[request].last() {
                None => cluster.remote.run(seat, &prompts[request], 0),
                Some(&token) => {
                    cluster.remote.run(seat, &[token], prompt_len + out[request].len() as u32 - 1)
                }
            };
            match result {
                Ok(token) => out[request].push(token),
                Err(_) => {
                    let detected = Instant::now();
                    recovery.detection_ms = killed_at.map_or(0.0, |k| (detected - k).as_secs_f64() * 1e3);
                    let Some(victim) = cluster.dead_stage() else {
                        // A slow step, not a dead stage: send it again.
                        continue;
                    };
                    match on_failure {
                        OnFailure::Recover => {
                            recovery.tokens_recomputed += cluster.replace(victim, &prompts, &out)?;
                            let restored = Instant::now();
                            recovery.restore_ms = (restored - detected).as_secs_f64() * 1e3;
                            // The interrupted step runs again.
                            recovery.tokens_recomputed += 1;
                            let token = match out[request].last() {
                                None => cluster.remote.run(seat, &prompts[request], 0)?,
                                Some(&t) => cluster.remote.run(
                                    seat,
                                    &[t],
                                    prompt_len + out[request].len() as u32 - 1,
                                )?,
                            };
                            out[request].push(token);
                            recovery.resume_ms = restored.elapsed().as_secs_f64() * 1e3;
                        }
                        OnFailure::Restart => {
                            recovery.tokens_recomputed = out.iter().map(|t| t.len() as u64).sum();
                            drop(cluster);
                            cluster = Cluster::start(config, false)?;
                            out.iter_mut().for_each(Vec::clear);
                            recovery.restore_ms = detected.elapsed().as_secs_f64() * 1e3;
                            continue 'rounds;
                        }
                    }
                }
            }
        }
        if out.iter().all(|t| t.len() == config.new_tokens as usize) {
            break;
        }
    }
    Ok((out, recovery, started.elapsed()))
}

/// Runs the demo, reporting progress through `say`.
pub fn run(config: &DemoConfig, mut say: impl FnMut(&str)) -> Result<DemoReport, DemoError> {
    let model = ModelConfig::reference();
    if config.stages == 0 || config.stages > model.layers {
        return Err(DemoError::Invalid(format!("stages must be 1..={}", model.layers)));
    }
    if config.victim >= config.stages {
        return Err(DemoError::Invalid(format!(
            "victim {} is not one of {} stages",
            config.victim, config.stages
        )));
    }
    if config.requests == 0 || config.prompt_tokens == 0 || config.new_tokens < 2 {
        return Err(DemoError::Invalid(
            "requests and prompt tokens must be positive, new tokens at least 2".into(),
        ));
    }
    let steps = config.requests as u64 * config.new_tokens as u64;
    let kill_at = steps / 2;

    say("failure-free run without replication...");
    let (unreplicated_tokens, _, unreplicated) = workload(config, None, OnFailure::Restart)?;
    say("failure-free run, KV replicated every step...");
    let (reference, _, failure_free) = workload(config, None, OnFailure::Recover)?;
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
    let (recovered, recovery, with_failure) = workload(config, Some(kill_at), OnFailure::Recover)?;
    say("run with the same failure, restarted from scratch...");
    let (restarted, restart, restart_time) = workload(config, Some(kill_at), OnFailure::Restart)?;
    Ok(DemoReport {
        tokens: steps,
        unreplicated_s: unreplicated.as_secs_f64(),
        failure_free_s: failure_free.as_secs_f64(),
        with_failure_s: with_failure.as_secs_f64(),
        restart_s: restart_time.as_secs_f64(),
        recovery,
        restart_tokens_recomputed: restart.tokens_recomputed,
        kv_bytes_replicated_per_token: model.kv_spec().bytes_per_token(),
        matched: recovered == reference && unreplicated_tokens == reference,
        restart_matched: restarted == reference,
    })
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
one failure, recovered:  {:7.3} s  ({:.2}x)  detection {:.0} ms, restore {:.1} ms, resume {:.1} ms, tokens recomputed {}
one failure, restarted:  {:7.3} s  ({:.2}x)  tokens recomputed {}
KV per token: {} bytes to the successors' sidecars, as many to the local ones (all {} stages)
output identical to the failure-free run: {} (restart from scratch: {})
",
            self.unreplicated_s,
            tps(self.unreplicated_s),
            self.failure_free_s,
            tps(self.failure_free_s),
            (self.failure_free_s / self.unreplicated_s - 1.0) * 100.0,
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
            if self.matched { "yes" } else { "NO" },
            if self.restart_matched { "yes" } else { "NO" },
        )
    }
}
