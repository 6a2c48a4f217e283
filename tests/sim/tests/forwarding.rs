//! Ten thousand seeds of the sidecar's forwarding machine against a successor that goes down,
//! refuses stale chunks and is replaced in the middle of a forward, each checked against every
//! invariant: half with the default rates, half with shapes and rates drawn from the seed.

use dejavu_sim::{run_forwarding_seed, ForwardingSimConfig};

#[test]
fn ten_thousand_forwarding_seeds_hold_every_invariant() {
    let mut failures = Vec::new();
    let mut faults = std::collections::BTreeMap::new();
    let mut answers = std::collections::BTreeMap::new();
    for seed in 0..10_000 {
        let cfg =
            if seed % 2 == 0 { ForwardingSimConfig::default() } else { ForwardingSimConfig::varied(seed) };
        let report = run_forwarding_seed(seed, &cfg);
        for (class, n) in &report.faults {
            *faults.entry(*class).or_insert(0u64) += u64::from(*n);
        }
        for (answer, n) in &report.answers {
            *answers.entry(answer.clone()).or_insert(0u64) += u64::from(*n);
        }
        if !report.violations.is_empty() {
            let flag = if seed % 2 == 0 { "" } else { " --varied" };
            failures.push(format!(
                "seed {seed}: {:?}\n  replay: cargo run --release -p dejavu-sim -- --forwarding --seed {seed}{flag}",
                report.violations
            ));
        }
    }
    println!("answers: {answers:?}; faults: {faults:?}");
    for class in [
        "successor flapped",
        "successor replaced",
        "newer engine elsewhere",
        "engine replaced",
        "stale engine back",
        "release",
    ] {
        assert!(faults.get(class).copied().unwrap_or(0) > 0, "no {class} was injected");
    }
    // `Released` needs a release while the chunk itself is in flight, which one engine connection
    // cannot do: not required.
    for answer in ["Forwarded", "Waiting", "NoSuccessor", "Refused", "SuccessorChanged"] {
        assert!(answers.get(answer).copied().unwrap_or(0) > 0, "no chunk was answered {answer}");
    }
    assert!(failures.is_empty(), "{} seeds broke invariants:\n{}", failures.len(), failures.join("\n"));
}
