//! Ten thousand seeds of the running controller's liveness machine under faults (process and
//! worker kills, pauses, lost, delayed and replayed beats, an unwritable state file, controller
//! restarts), each checked against every invariant: half on the default cluster, half on shapes
//! and timings drawn from the seed.

use dejavu_sim::{run_liveness_seed, LivenessSimConfig};

#[test]
fn ten_thousand_liveness_seeds_hold_every_invariant() {
    let mut failures = Vec::new();
    let mut faults = std::collections::BTreeMap::new();
    let mut fences = 0u64;
    for seed in 0..10_000 {
        let cfg = if seed % 2 == 0 { LivenessSimConfig::default() } else { LivenessSimConfig::varied(seed) };
        let report = run_liveness_seed(seed, &cfg);
        fences += u64::from(report.fences);
        for (class, n) in &report.faults {
            *faults.entry(*class).or_insert(0u64) += u64::from(*n);
        }
        if !report.violations.is_empty() {
            let flag = if seed % 2 == 0 { "" } else { " --varied" };
            failures.push(format!(
                "seed {seed}: {:?}\n  replay: cargo run --release -p dejavu-sim -- --liveness --seed {seed}{flag}",
                report.violations
            ));
        }
    }
    println!("{fences} fences; faults injected over 10,000 seeds: {faults:?}");
    for class in [
        "beat lost",
        "spare took a place",
        "spare hand-over failed",
        "beat replayed",
        "process killed",
        "worker killed",
        "process paused",
        "spare killed",
        "controller crash",
        "state file unwritable",
        "fenced process left running",
        "duplicate claim",
    ] {
        assert!(faults.get(class).copied().unwrap_or(0) > 0, "no {class} was injected");
    }
    assert!(fences > 10_000, "only {fences} fences in 10,000 seeds");
    assert!(failures.is_empty(), "{} seeds broke invariants:\n{}", failures.len(), failures.join("\n"));
}

/// The same, the record kept as on etcd: leaders killed and paused past their lease, each
/// followed by another started from the record, and the paused ones back with their own view.
#[test]
fn ten_thousand_seeds_on_etcd_hold_every_invariant_across_leadership_changes() {
    let mut failures = Vec::new();
    let mut faults = std::collections::BTreeMap::new();
    let mut fences = 0u64;
    for seed in 0..10_000 {
        let cfg = if seed % 2 == 0 { LivenessSimConfig::default() } else { LivenessSimConfig::varied(seed) };
        let report = run_liveness_seed(seed, &cfg.on_etcd(seed));
        fences += u64::from(report.fences);
        for (class, n) in &report.faults {
            *faults.entry(*class).or_insert(0u64) += u64::from(*n);
        }
        if !report.violations.is_empty() {
            let flag = if seed % 2 == 0 { "" } else { " --varied" };
            failures.push(format!(
                "seed {seed}: {:?}\n  replay: cargo run --release -p dejavu-sim -- --liveness --etcd --seed {seed}{flag}",
                report.violations
            ));
        }
    }
    println!("{fences} fences; faults injected over 10,000 seeds on etcd: {faults:?}");
    for class in ["leader paused past its lease", "controller crash", "process killed", "worker killed"] {
        assert!(faults.get(class).copied().unwrap_or(0) > 0, "no {class} was injected");
    }
    assert!(fences > 10_000, "only {fences} fences in 10,000 seeds");
    assert!(failures.is_empty(), "{} seeds broke invariants:\n{}", failures.len(), failures.join("\n"));
}
