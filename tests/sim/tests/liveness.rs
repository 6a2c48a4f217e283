//! Ten thousand seeds of the running controller's liveness machine under faults (process and
//! worker kills, pauses, lost, delayed and replayed beats, an unwritable state file, controller
//! restarts), each checked against every invariant: half on the default cluster, half on shapes
//! and timings drawn from the seed. Then ten thousand more with the record kept as on etcd, where
//! leaders are killed and paused past their lease.

use std::collections::BTreeMap;

use dejavu_sim::{run_liveness_seed, LivenessSimConfig};

/// What ten thousand seeds did.
struct Seeds {
    fences: u64,
    faults: BTreeMap<&'static str, u64>,
    /// Each seed that broke an invariant, with how to replay it.
    failures: Vec<String>,
}

/// Runs seeds 0 to 9,999, each on `config(seed)`: the default cluster for even seeds, a varied
/// one for odd seeds (`--varied`). `flags` are the simulator's flags that replay one.
fn ten_thousand_seeds(config: impl Fn(LivenessSimConfig, u64) -> LivenessSimConfig, flags: &str) -> Seeds {
    let mut seeds = Seeds { fences: 0, faults: BTreeMap::new(), failures: Vec::new() };
    for seed in 0..10_000 {
        let base = if seed % 2 == 0 { LivenessSimConfig::default() } else { LivenessSimConfig::varied(seed) };
        let report = run_liveness_seed(seed, &config(base, seed));
        seeds.fences += u64::from(report.fences);
        for (class, n) in &report.faults {
            *seeds.faults.entry(*class).or_insert(0) += u64::from(*n);
        }
        if !report.violations.is_empty() {
            let varied = if seed % 2 == 0 { "" } else { " --varied" };
            seeds.failures.push(format!(
                "seed {seed}: {:?}\n  replay: cargo run --release -p dejavu-sim -- {flags} --seed {seed}{varied}",
                report.violations
            ));
        }
    }
    println!("{} fences; faults injected over 10,000 seeds ({flags}): {:?}", seeds.fences, seeds.faults);
    seeds
}

/// Checks that every fault class of `classes` was injected, that the seeds fenced, and that none
/// broke an invariant.
fn check(seeds: &Seeds, classes: &[&str]) {
    for class in classes {
        assert!(seeds.faults.get(class).copied().unwrap_or(0) > 0, "no {class} was injected");
    }
    assert!(seeds.fences > 10_000, "only {} fences in 10,000 seeds", seeds.fences);
    assert!(
        seeds.failures.is_empty(),
        "{} seeds broke invariants:\n{}",
        seeds.failures.len(),
        seeds.failures.join("\n")
    );
}

#[test]
fn ten_thousand_liveness_seeds_hold_every_invariant() {
    let seeds = ten_thousand_seeds(|cfg, _| cfg, "--liveness");
    check(
        &seeds,
        &[
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
        ],
    );
}

/// The same, the record kept as on etcd: leaders killed and paused past their lease, each
/// followed by another started from the record, and the paused ones back with their own view.
#[test]
fn ten_thousand_seeds_on_etcd_hold_every_invariant_across_leadership_changes() {
    let seeds = ten_thousand_seeds(LivenessSimConfig::on_etcd, "--liveness --etcd");
    check(&seeds, &["leader paused past its lease", "controller crash", "process killed", "worker killed"]);
}
