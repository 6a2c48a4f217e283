//! Ten thousand seeds of the running recovery machine under faults during the recovery itself
//! (engines and whole workers killed, replacements included, the controller unreachable, a census
//! that misses a death), each checked against every invariant: half on a four-stage ring, half on
//! shapes and fault rates drawn from the seed.

use dejavu_sim::{run_recovery_seed, RecoverySimConfig};

#[test]
fn ten_thousand_recovery_seeds_hold_every_invariant() {
    let mut failures = Vec::new();
    let mut faults = std::collections::BTreeMap::new();
    let (mut recoveries, mut retries, mut given_up) = (0u64, 0u64, 0u64);
    for seed in 0..10_000 {
        let cfg = if seed % 2 == 0 { RecoverySimConfig::default() } else { RecoverySimConfig::varied(seed) };
        let report = run_recovery_seed(seed, &cfg);
        recoveries += u64::from(report.recoveries);
        retries += u64::from(report.retries);
        given_up += u64::from(report.given_up);
        for (class, n) in &report.faults {
            *faults.entry(*class).or_insert(0u64) += u64::from(*n);
        }
        if !report.violations.is_empty() {
            let flag = if seed % 2 == 0 { "" } else { " --varied" };
            failures.push(format!(
                "seed {seed}: {:?}\n  replay: cargo run --release -p dejavu-sim -- --recovery --seed {seed}{flag}",
                report.violations
            ));
        }
    }
    println!(
        "{recoveries} recoveries, {retries} attempts tried again, {given_up} given up; faults: {faults:?}"
    );
    for class in ["engine killed", "worker killed", "controller unreachable", "death the census misses"] {
        assert!(faults.get(class).copied().unwrap_or(0) > 0, "no {class} was injected");
    }
    assert!(retries > 1_000, "only {retries} attempts were tried again");
    assert!(failures.is_empty(), "{} seeds broke invariants:\n{}", failures.len(), failures.join("\n"));
}
