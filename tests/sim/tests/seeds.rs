//! Ten thousand seeds of mixed faults (drops, duplicates, delays and reorders, partitions and
//! isolation, worker crashes and pauses, controller crashes), each checked against every
//! invariant: half on the default cluster, half on shapes and delays drawn from the seed.

use dejavu_sim::{run_seed, SimConfig};

#[test]
fn ten_thousand_seeds_hold_every_invariant() {
    let mut failures = Vec::new();
    let mut faults = std::collections::BTreeMap::new();
    for seed in 0..10_000 {
        let (cfg, flag) =
            if seed % 2 == 0 { (SimConfig::default(), "") } else { (SimConfig::varied(seed), " --varied") };
        let report = run_seed(seed, &cfg);
        for (class, n) in &report.faults {
            *faults.entry(*class).or_insert(0u64) += *n as u64;
        }
        if !report.violations.is_empty() {
            failures.push(format!(
                "seed {seed}: {:?}\n  replay: cargo run --release -p dejavu-sim -- --seed {seed}{flag}",
                report.violations
            ));
        }
    }
    println!("faults injected over 10,000 seeds: {faults:?}");
    for class in
        ["message drop", "message duplicate", "partition", "worker crash", "worker pause", "controller crash"]
    {
        assert!(faults.get(class).copied().unwrap_or(0) > 0, "no {class} was injected");
    }
    assert!(failures.is_empty(), "{} seeds broke invariants:\n{}", failures.len(), failures.join("\n"));
}
