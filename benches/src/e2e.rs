//! The report's end-to-end rows: the reference engine's cluster (stage, sidecar and controller
//! processes started from the `dejavud` executable) run through [`dejavud::demo`] in the same run as
//! the other rows, each demo run beside the demo's own failure-free run.
//!
//! Two demos run: the demo's default workload (8 requests, 2 microbatches, one device cache per
//! microbatch) and the same model at twice the batch (16 requests, 4 microbatches) with only two
//! device caches per stage, so that microbatches are swapped to host memory and back. The first one
//! gives the replication, failure and recovery rows and is also the baseline of the swapping row.

use std::path::{Path, PathBuf};

use dejavud::demo::{self, DemoConfig, DemoReport, DemoSettings, Kill};

use crate::Row;

/// The environment variable that names the `dejavud` executable to start the processes from.
pub const DEJAVUD_ENV: &str = "DEJAVUD";

/// The command that builds the `dejavud` executable next to `bench-report`.
pub const BUILD_DEJAVUD: &str = "cargo build --release --bin dejavud";

/// Design target: replication and streaming cost the decode at most 2% (the paper's figure), as
/// the ratio unreplicated time / replicated time.
pub const REPLICATION_TARGET: f64 = 0.98;

/// Design target: a run with one failure takes at most 1.10x the failure-free time.
pub const FAILURE_SLOWDOWN: f64 = 1.10;

/// Requests per microbatch in the demo (fixed by the demo's workload).
const REQUESTS_PER_MICROBATCH: u32 = 4;

/// The demo's default requests (B: two microbatches).
const REQUESTS: u32 = 2 * REQUESTS_PER_MICROBATCH;

/// Device caches per stage in the swapping run: the default run's microbatches, so the swapping run
/// holds its 2B requests in the device memory of the B run.
const SWAP_DEVICE_CACHES: u32 = REQUESTS / REQUESTS_PER_MICROBATCH;

/// What the end-to-end section measured.
#[derive(Debug, Default)]
pub struct E2e {
    /// The table's end-to-end rows (none when skipped).
    pub rows: Vec<Row>,
    /// Lines to print under the table: the workload, what was skipped or failed, and why.
    pub notes: Vec<String>,
    /// The default demo's own report, for the JSON output.
    pub demo: Option<DemoReport>,
    /// The swapping demo's own report, for the JSON output.
    pub swapping: Option<DemoReport>,
}

impl E2e {
    /// A section with no rows, only the reason it was skipped.
    pub fn skipped(reason: impl Into<String>) -> Self {
        Self { notes: vec![format!("end to end: skipped: {}", reason.into())], ..Self::default() }
    }
}

/// The `dejavud` executable: `$DEJAVUD` if set, else `dejavud` next to the running executable
/// (`target/release/` for `bench-report`). The error says where it looked and how to build it.
pub fn find_dejavud() -> Result<PathBuf, String> {
    let exe = match std::env::var_os(DEJAVUD_ENV) {
        Some(path) => PathBuf::from(path),
        None => std::env::current_exe()
            .map_err(|e| format!("cannot find the running executable: {e}"))?
            .with_file_name(format!("dejavud{}", std::env::consts::EXE_SUFFIX)),
    };
    if exe.is_file() {
        Ok(exe)
    } else {
        Err(format!(
            "no dejavud executable at {}: build it with `{BUILD_DEJAVUD}` (or set {DEJAVUD_ENV} to its path)",
            exe.display()
        ))
    }
}

/// Runs both demos with `new_tokens` generated per request, starting processes from `exe`, and
/// turns them into rows. A demo that fails leaves a note instead of its rows; the demos' processes
/// are stopped by the demo itself, whether it succeeds or not.
pub fn measure(exe: &Path, new_tokens: u32) -> E2e {
    let mut e2e = E2e::default();
    let base = DemoSettings { new_tokens: Some(new_tokens), ..DemoSettings::default() };
    let (config, report) = match run_demo("default", base.clone().resolve(exe.to_path_buf())) {
        Ok(done) => done,
        Err(e) => {
            e2e.notes.push(format!("end to end: the demo failed: {e}"));
            return e2e;
        }
    };
    e2e.notes.push(format!(
        "end to end: reference engine (8 layers) as {} stage processes with a sidecar each and a \
         controller, {} requests of {} prompt + {} new tokens ({} tokens per run), stage {}'s {} \
         SIGKILLed halfway{}",
        config.stages,
        config.requests,
        config.prompt_tokens,
        config.new_tokens,
        report.tokens,
        config.victim,
        match config.kill {
            Kill::Worker => "engine and sidecar",
            Kill::Engine => "engine",
        },
        config.cpus.as_ref().map_or(String::new(), |split| format!(
            "; the stages compute on CPUs {}, their streamers and sidecars copy on CPUs {}",
            split.compute, split.replication
        )),
    ));
    e2e.rows.extend(demo_rows(&config, &report));

    let swap_settings =
        DemoSettings { requests: Some(2 * REQUESTS), device_caches: Some(SWAP_DEVICE_CACHES), ..base };
    let swapping = match run_demo("swapping", swap_settings.resolve(exe.to_path_buf())) {
        Ok((swap_config, swap)) => {
            e2e.notes.push(format!(
                "swapping: {} requests in {} device caches per stage, {} bytes swapped in and out{}",
                swap_config.requests,
                SWAP_DEVICE_CACHES,
                swap.swapped_bytes,
                // No bytes swapped would mean the row compares two runs without swapping.
                if swap.swapped_bytes == 0 { " (NONE: swapping did not happen)" } else { "" },
            ));
            e2e.rows.push(swap_row(&config, &report, &swap_config, &swap));
            Some(swap)
        }
        Err(e) => {
            e2e.notes.push(format!("end to end: the swapping demo failed: {e}"));
            None
        }
    };
    e2e.rows.push(matched_row(&report, swapping.as_ref()));
    e2e.notes.push(format!(
        "outputs identical to the failure-free run: {} (restart from scratch: {}){}",
        yes_no(report.matched),
        yes_no(report.restart_matched),
        swapping.as_ref().map_or(String::new(), |s| format!(
            "; swapping demo: {} (restart from scratch: {})",
            yes_no(s.matched),
            yes_no(s.restart_matched)
        )),
    ));
    e2e.demo = Some(report);
    e2e.swapping = swapping;
    e2e
}

fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "NO"
    }
}

/// Runs one demo, its progress on standard error (standard output is the report's).
fn run_demo(label: &str, config: DemoConfig) -> Result<(DemoConfig, DemoReport), String> {
    eprintln!(
        "end to end ({label}): {} requests of {} + {} tokens, {} stages...",
        config.requests, config.prompt_tokens, config.new_tokens, config.stages
    );
    let report = demo::run(&config, |line| eprintln!("  {line}")).map_err(|e| e.to_string())?;
    Ok((config, report))
}

/// The replication, failure and recovery rows of one demo.
fn demo_rows(config: &DemoConfig, r: &DemoReport) -> Vec<Row> {
    // The mean failure-free decode step (one generated token), replicated.
    let step_ms = r.failure_free_s * 1e3 / r.tokens as f64;
    let rec = &r.recovery;
    vec![
        Row {
            name: "e2e decode step (median), KV replicated".into(),
            value: r.interleaved_replicated_step_ms,
            unit: "ms",
            limit_name: format!(
                "same run, replication paused every other {} steps (design: <= 2% overhead)",
                r.interleaved_block
            ),
            limit: r.interleaved_paused_step_ms,
            target: REPLICATION_TARGET,
            higher_is_better: false,
        },
        Row {
            name: "e2e decode step (median), KV replicated every step".into(),
            value: r.failure_free_step_ms,
            unit: "ms",
            limit_name: "another run without replication".into(),
            limit: r.unreplicated_step_ms,
            target: 0.0,
            higher_is_better: false,
        },
        Row {
            name: "e2e failure-free decode, KV replicated every step".into(),
            value: r.failure_free_s,
            unit: "s",
            limit_name: "same run without replication (total time)".into(),
            limit: r.unreplicated_s,
            target: 0.0,
            higher_is_better: false,
        },
        Row {
            name: format!("e2e one failure (stage {}), recovered", config.victim),
            value: r.with_failure_s,
            unit: "s",
            limit_name: format!("failure-free run (design: <= {FAILURE_SLOWDOWN:.2}x its time)"),
            limit: r.failure_free_s,
            target: 1.0 / FAILURE_SLOWDOWN,
            higher_is_better: false,
        },
        Row {
            name: "e2e one failure, restarted from scratch".into(),
            value: r.restart_s,
            unit: "s",
            limit_name: "failure-free run (paper: restart takes 1.91x)".into(),
            limit: r.failure_free_s,
            target: 0.0,
            higher_is_better: false,
        },
        Row {
            name: "e2e recovery: detection".into(),
            value: rec.detection_ms,
            unit: "ms",
            limit_name: "the step deadline (setting), what a stopped process costs".into(),
            limit: config.deadline.as_secs_f64() * 1e3,
            target: 0.0,
            higher_is_better: false,
        },
        Row {
            name: format!(
                "e2e recovery: restore ({} recomputed)",
                plural(rec.tokens_recomputed, "token", "tokens")
            ),
            value: rec.restore_ms,
            unit: "ms",
            // What the restore saves: a restart recomputes these steps at the failure-free rate.
            limit_name: format!(
                "recomputing a restart's {} tokens at the failure-free step time",
                r.restart_tokens_recomputed
            ),
            limit: step_ms * r.restart_tokens_recomputed as f64,
            target: 0.0,
            higher_is_better: false,
        },
        Row {
            name: "e2e recovery: resume (the interrupted step again)".into(),
            value: rec.resume_ms,
            unit: "ms",
            limit_name: "mean failure-free step".into(),
            limit: step_ms,
            target: 0.0,
            higher_is_better: false,
        },
    ]
}

/// Throughput at twice the batch with swapping against the default batch without, each the demo's
/// failure-free replicated run.
fn swap_row(config: &DemoConfig, r: &DemoReport, swap_config: &DemoConfig, swap: &DemoReport) -> Row {
    Row {
        name: format!(
            "e2e throughput, {} requests swapping in {} device caches",
            swap_config.requests, SWAP_DEVICE_CACHES
        ),
        value: swap.tokens as f64 / swap.failure_free_s,
        unit: "tokens/s",
        limit_name: format!("{} requests without swapping", config.requests),
        limit: r.tokens as f64 / r.failure_free_s,
        target: 0.0,
        higher_is_better: true,
    }
}

/// Demos whose recovered, unreplicated and restarted runs all produced the failure-free tokens:
/// any mismatch makes the row miss its target.
fn matched_row(r: &DemoReport, swap: Option<&DemoReport>) -> Row {
    let demos: Vec<&DemoReport> = std::iter::once(r).chain(swap).collect();
    let matched = demos.iter().filter(|d| d.matched && d.restart_matched).count();
    Row {
        name: "e2e outputs identical to the failure-free run".into(),
        value: matched as f64,
        unit: "demos",
        limit_name: "demos run".into(),
        limit: demos.len() as f64,
        target: 1.0,
        higher_is_better: true,
    }
}
