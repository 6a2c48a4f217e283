//! `dejavu-sim`: runs seeds of the control-plane simulator and reports violations.
//!
//! `dejavu-sim [--seed N | --seeds A..B] [--varied] [--liveness [--etcd] | --recovery | --forwarding] [--quiet]`:
//! `--varied` draws each seed's cluster shape and delays from the seed (`SimConfig::varied`);
//! `--liveness` runs the controller's liveness machine instead (`dejavu_sim::liveness`;
//! `DEJAVU_SIM_TRACE=1` prints its events; `--etcd` keeps its record as on etcd, where leaders
//! are killed and paused past their lease and others take over), `--recovery` the cluster's recovery machine
//! (`dejavu_sim::recovery`), `--forwarding` a sidecar's forwarding machine
//! (`dejavu_sim::forwarding`). `dejavu-sim --journal FILE` replays a journal `dejavud controller --journal FILE` wrote
//! through fresh machines, and fails where one decides otherwise.

use std::process::ExitCode;
use std::time::Instant;

use dejavu_sim::{
    replay_journal, run_forwarding_seed, run_liveness_seed, run_recovery_seed, run_seed, ForwardingSimConfig,
    LivenessSimConfig, RecoverySimConfig, SimConfig,
};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, path] = args.as_slice() {
        if flag == "--journal" {
            return replay(path);
        }
    }
    let mut range = 0..1000u64;
    let mut quiet = false;
    let mut varied = false;
    let mut liveness = false;
    let mut etcd = false;
    let mut recovery = false;
    let mut forwarding = false;
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--seed" => {
                let Some(n) = args.get(i + 1).and_then(|v| v.parse().ok()) else { return usage() };
                range = n..n + 1;
                i += 1;
            }
            "--seeds" => {
                let parsed = args.get(i + 1).and_then(|v| {
                    let (a, b) = v.split_once("..")?;
                    Some(a.parse().ok()?..b.parse().ok()?)
                });
                let Some(r) = parsed else { return usage() };
                range = r;
                i += 1;
            }
            "--quiet" => quiet = true,
            "--varied" => varied = true,
            "--liveness" => liveness = true,
            "--etcd" => etcd = true,
            "--recovery" => recovery = true,
            "--forwarding" => forwarding = true,
            _ => return usage(),
        }
        i += 1;
    }
    let config = |seed: u64| if varied { SimConfig::varied(seed) } else { SimConfig::default() };
    let started = Instant::now();
    let (mut runs, mut failed) = (0u64, 0u64);
    let machine = match (liveness, recovery, forwarding) {
        (true, false, false) if etcd => " --liveness --etcd",
        (true, false, false) => " --liveness",
        (false, true, false) => " --recovery",
        (false, false, true) => " --forwarding",
        (false, false, false) if !etcd => "",
        _ => return usage(),
    };
    let flags = format!("{}{machine}", if varied { " --varied" } else { "" });
    for seed in range.clone() {
        runs += 1;
        // The running machines: their violations, or what a single seed's run did.
        let machine_run = if liveness {
            let cfg = if varied { LivenessSimConfig::varied(seed) } else { LivenessSimConfig::default() };
            let cfg = if etcd { cfg.on_etcd(seed) } else { cfg };
            let report = run_liveness_seed(seed, &cfg);
            Some((report.violations, format!("{} fences, faults {:?}", report.fences, report.faults)))
        } else if recovery {
            let cfg = if varied { RecoverySimConfig::varied(seed) } else { RecoverySimConfig::default() };
            let r = run_recovery_seed(seed, &cfg);
            let did = format!(
                "{} recoveries, {} attempts tried again, {} given up, faults {:?}",
                r.recoveries, r.retries, r.given_up, r.faults
            );
            Some((r.violations, did))
        } else if forwarding {
            let cfg = if varied { ForwardingSimConfig::varied(seed) } else { ForwardingSimConfig::default() };
            let r = run_forwarding_seed(seed, &cfg);
            Some((r.violations, format!("answers {:?}, faults {:?}", r.answers, r.faults)))
        } else {
            None
        };
        if let Some((violations, did)) = machine_run {
            if !violations.is_empty() {
                failed += 1;
                println!("seed {seed}: {violations:?} (replay: cargo run --release -p dejavu-sim -- --seed {seed}{flags})");
            } else if !quiet && range.end - range.start == 1 {
                println!("seed {seed}: ok, {did}");
            }
            continue;
        }
        let report = run_seed(seed, &config(seed));
        if !report.violations.is_empty() {
            failed += 1;
            println!(
                "seed {seed}: {} violations (replay: cargo run --release -p dejavu-sim -- --seed {seed}{flags})",
                report.violations.len()
            );
            for v in &report.violations {
                println!("  {v}");
            }
        } else if !quiet && range.end - range.start == 1 {
            println!(
                "seed {seed}: ok in {} ticks, {} plans, {} tokens recomputed, faults {:?}, trace {:016x}",
                report.ticks, report.plans, report.recomputed_tokens, report.faults, report.trace_hash
            );
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!("{runs} seeds in {secs:.2} s ({:.0} seeds/s), {failed} with violations", runs as f64 / secs);
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Replays the controller journal at `path`.
fn replay(path: &str) -> ExitCode {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) => {
            eprintln!("{path}: {e}");
            return ExitCode::from(2);
        }
    };
    match replay_journal(&text) {
        Ok(n) => {
            println!("{n} entries replayed: every decision is the same");
            ExitCode::SUCCESS
        }
        Err(divergence) => {
            println!("the replay diverges at {divergence}");
            ExitCode::FAILURE
        }
    }
}

fn usage() -> ExitCode {
    eprintln!(
        "usage: dejavu-sim [--seed N | --seeds A..B] [--varied] [--liveness [--etcd] | --recovery | --forwarding] [--quiet] | --journal FILE"
    );
    ExitCode::from(2)
}
