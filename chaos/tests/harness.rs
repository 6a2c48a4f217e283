//! The harness end to end, with real processes: the shipped CI scenario survives every fault
//! class of a cluster with one controller, controllers on etcd every fault of the control plane,
//! the swapping, disaggregated and QUIC scenarios their faults; a deliberately broken build
//! (replicas skipped while claimed) is caught; a bad scenario is refused with a clear message.

use std::path::Path;
use std::process::{Command, Output};

fn chaos(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dejavu-chaos")).args(args).output().expect("run dejavu-chaos")
}

fn scenario(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios").join(name).display().to_string()
}

fn report(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("no JSON report ({e}):\n{}", String::from_utf8_lossy(&out.stderr));
    })
}

#[test]
fn the_ci_scenario_survives_every_fault_class() {
    let out = chaos(&["run", &scenario("ci-mixed.toml"), "--json"]);
    let report = report(&out);
    assert_eq!(out.status.code(), Some(0), "{report:#}");
    assert_eq!(report["passed"], true);
    assert_eq!(report["recovered_by"], "controller");
    let classes = report["classes"].as_array().unwrap();
    assert_eq!(classes.len(), 20, "every fault class injected: {classes:#?}");
    assert!(report["spares_used"].as_u64().unwrap() >= 2, "the spare worker replaced a dead one: {report:#}");
    for class in classes {
        assert!(class["injected"].as_u64().unwrap() >= 1);
        assert_eq!(class["violated"], 0);
    }
    // Six faults kill or stop processes: six recoveries (one leaves a stale engine running; a
    // killed sidecar takes its engine's place with it). Most restore from a copy and recompute
    // little; killing two adjacent workers loses the first one's copies with the second, which the
    // recovery reports, recomputing that stage's sequences from their prompts.
    // (A loaded machine may add a false detection, and with it a recovery: not a violation.)
    assert!(report["recoveries"].as_u64().unwrap() >= 6, "{report:#}");
    assert_eq!(report["copies_lost"], 1);
    // A worker killed during another's recovery failed that attempt; the next recovered both.
    assert!(report["retried_recoveries"].as_u64().unwrap() >= 1, "{report:#}");
    assert!(report["replication_lag_max"].as_u64().unwrap() <= 65);
    // The controller was killed, killed in a recovery and stopped past its deadline: each time the
    // cluster replaced it, and nothing was lost (the checks above).
    assert!(report["controller_restarts"].as_u64().unwrap() >= 3, "{report:#}");
    // The stale engine came back while its replacement ran, and was kept out.
    assert!(report["stale_heartbeats"].as_u64().unwrap() >= 1, "{report:#}");
    // Its requests took turns in four seats, with prompts of lengths drawn from the seed.
    let scenario =
        dejavu_chaos::scenario::Scenario::parse(&std::fs::read_to_string(scenario("ci-mixed.toml")).unwrap())
            .unwrap();
    assert!(scenario.workload.seats.unwrap() < scenario.workload.requests);
    assert!(scenario.workload.prompt_tokens_max.unwrap() > scenario.workload.prompt_tokens);
}

#[test]
fn recoveries_the_driver_carries_out_step_by_step_survive_every_fault_class_too() {
    // The mixed scenario again, its recoveries carried out by the harness's driver: each one's
    // steps replay through the simulated recovery machine (an invariant the report checks).
    let text = std::fs::read_to_string(scenario("ci-mixed.toml")).unwrap();
    let driven = text.replacen("[cluster]\n", "[cluster]\nrecoveries = \"driver\"\n", 1);
    assert_ne!(driven, text);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ci-mixed-driven.toml");
    std::fs::write(&path, driven).unwrap();
    let out = chaos(&["run", path.to_str().unwrap(), "--json"]);
    let report = report(&out);
    assert_eq!(out.status.code(), Some(0), "{report:#}");
    assert_eq!(report["recovered_by"], "driver");
    assert_eq!(report["classes"].as_array().unwrap().len(), 20, "{report:#}");
    assert!(report["recoveries"].as_u64().unwrap() >= 6, "{report:#}");
    assert!(report["retried_recoveries"].as_u64().unwrap() >= 1, "{report:#}");
}

#[test]
fn controllers_on_etcd_survive_every_fault_of_the_control_plane() {
    let out = chaos(&["run", &scenario("ha.toml"), "--json"]);
    let report = report(&out);
    assert_eq!(out.status.code(), Some(0), "{report:#}");
    assert_eq!(report["passed"], true);
    assert_eq!(report["recovered_by"], "controller");
    let classes = report["classes"].as_array().unwrap();
    for kind in [
        "kill-controller",
        "pause-controller",
        "kill-controller-in-recovery",
        "cut-leader-from-etcd",
        "kill-etcd-member",
    ] {
        let class =
            classes.iter().find(|c| c["class"] == kind).unwrap_or_else(|| panic!("no {kind}: {report:#}"));
        assert_eq!(class["injected"], 1, "{report:#}");
        assert_eq!(class["violated"], 0, "{report:#}");
    }
    // Each worker death was recovered under whichever controller led then.
    assert!(report["recoveries"].as_u64().unwrap() >= 4, "{report:#}");
    // The killed leaders, the one deposed by its pause and the one cut off from etcd each stopped,
    // and the cluster started them again to stand by.
    assert!(report["controller_restarts"].as_u64().unwrap() >= 4, "{report:#}");
}

#[test]
fn microbatch_swapping_survives_kills_a_stalled_sidecar_and_replica_faults() {
    let out = chaos(&["run", &scenario("swapping.toml"), "--json"]);
    let report = report(&out);
    assert_eq!(out.status.code(), Some(0), "{report:#}");
    assert_eq!(report["passed"], true);
    assert_eq!(report["recovered_by"], "controller");
    let classes = report["classes"].as_array().unwrap();
    assert_eq!(classes.len(), 6, "{classes:#?}");
    assert!(classes.iter().all(|c| c["violated"] == 0 && c["survived"].as_u64() >= Some(1)));
    // Both kills were recovered (the stalled sidecar may cost its worker a recovery too).
    assert!(report["recoveries"].as_u64().unwrap() >= 2, "{report:#}");
}

#[test]
fn a_disaggregated_cluster_survives_token_worker_faults() {
    let out = chaos(&["run", &scenario("disaggregated.toml"), "--json"]);
    let report = report(&out);
    assert_eq!(out.status.code(), Some(0), "{report:#}");
    assert_eq!(report["passed"], true);
    assert_eq!(report["prompt_stages"], 2);
    let classes = report["classes"].as_array().unwrap();
    assert_eq!(classes.len(), 4, "{classes:#?}");
    assert!(classes.iter().all(|c| c["violated"] == 0 && c["survived"].as_u64() >= Some(1)));
    assert!(report["recoveries"].as_u64().unwrap() >= 2, "{report:#}");
    // The prompts were handed over, not computed by the token pipeline.
    assert_eq!(report["prompt_fallbacks"], 0, "{report:#}");
}

#[test]
fn replication_over_quic_survives_kills_and_a_stalled_sidecar() {
    let out = chaos(&["run", &scenario("quic.toml"), "--json"]);
    let report = report(&out);
    assert_eq!(out.status.code(), Some(0), "{report:#}");
    assert_eq!(report["passed"], true);
    assert_eq!(report["recovered_by"], "controller");
    let classes = report["classes"].as_array().unwrap();
    assert_eq!(classes.len(), 4, "{classes:#?}");
    assert!(classes.iter().all(|c| c["violated"] == 0 && c["survived"].as_u64() >= Some(1)));
    assert!(report["recoveries"].as_u64().unwrap() >= 2, "{report:#}");
}

#[test]
fn a_build_that_loses_replicas_is_caught() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sabotaged.toml");
    std::fs::write(
        &path,
        r#"
name = "sabotaged replication"
[cluster]
stages = 3
test_only_sabotage_replicas = true
[workload]
requests = 4
prompt_tokens = 8
new_tokens = 40
[limits]
restart_baseline = false
[[fault]]
at_step = 120
kind = "kill-worker"
stage = 1
"#,
    )
    .unwrap();
    let out = chaos(&["run", path.to_str().unwrap(), "--json"]);
    let report = report(&out);
    assert_eq!(out.status.code(), Some(1), "a violation exits with 1: {report:#}");
    assert_eq!(report["passed"], false);
    let violations = report["violations"].as_array().unwrap();
    assert!(
        violations.iter().any(|v| v["invariant"] == "bounded recompute" && v["blamed"] == "kill-worker"),
        "{violations:#?}"
    );
    // Recomputing everything still gives the right tokens: only the recompute bound catches it.
    assert!(violations.iter().all(|v| v["invariant"] != "bit-identical output"));
}

#[test]
fn a_bad_scenario_is_refused_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("name = \"x\"\n[cluster]\nstages = 1\n", "cluster.stages must be 2..=8"),
        (
            "name = \"x\"\n[[fault]]\nat_step = 1\nkind = \"explode\"\nstage = 0\n",
            "unknown variant `explode`",
        ),
        (
            "name = \"x\"\n[[fault]]\nat_step = 1\nkind = \"reset\"\nstage = 2\nlink = \"input\"\n",
            "the input link feeds stage 0",
        ),
        ("name = \"x\"\n[[fault]]\nat_step = 1\nkind = \"kill-engine\"\n", "kill-engine needs a `stage`"),
        (
            "name = \"x\"\n[[fault]]\nat_step = 1\nkind = \"kill-controller\"\nstage = 1\n",
            "kill-controller acts on no stage",
        ),
        ("name = \"x\"\nstages = 4\n", "unknown field `stages`"),
        ("name = \"x\"\n[cluster]\nheartbeat_ms = 9000000000000\n", "must be 1..=600000"),
        (
            "name = \"x\"\n[[fault]]\nat_step = 1\nkind = \"delay\"\nstage = 0\ndelay_ms = 99999999\n",
            "delay_ms must be",
        ),
        (
            "name = \"x\"\n[cluster]\ntransport = \"quic\"\n[[fault]]\nat_step = 1\nkind = \"reset\"\nstage = 0\nlink = \"replica\"\n",
            "needs transport = \"tcp\"",
        ),
        (
            "name = \"x\"\n[[fault]]\nat_step = 1\nkind = \"fill-spill\"\nstage = 0\nduration_ms = 100\n",
            "fill-spill needs sidecars that spill",
        ),
        (
            "name = \"x\"\n[cluster]\nprompt_stages = 2\nprompt_slots = 3\n[workload]\nrequests = 8\n",
            "whole microbatches",
        ),
        (
            "name = \"x\"\n[workload]\nprompt_tokens = 16\nprompt_tokens_max = 8\n",
            "prompt_tokens_max must be at least",
        ),
        ("name = \"x\"\n[workload]\nseats = 0\n", "workload.seats must be at least 1"),
        (
            "name = \"x\"\n[[fault]]\nat_step = 1\nkind = \"kill-etcd-member\"\n",
            "kill-etcd-member needs controllers on etcd",
        ),
        ("name = \"x\"\n[cluster]\ncontrollers = 3\n", "several controllers keep their state in etcd"),
        (
            "name = \"x\"\n[cluster]\netcd_members = 3\n[[fault]]\nat_step = 1\nkind = \"kill-etcd-member\"\n\
             [[fault]]\nat_step = 2\nkind = \"kill-etcd-member\"\n",
            "2 kill-etcd-member faults leave 3 etcd members no quorum",
        ),
        (
            "name = \"x\"\n[cluster]\netcd_members = 3\n[random]\nrate = 0.1\nkinds = [\"cut-leader-from-etcd\"]\n",
            "cut-leader-from-etcd is scheduled",
        ),
        ("name = \"x\"\n[cluster]\nstep_ms = -1.5\n", "cluster.step_ms must be 0..=600000"),
        (
            "name = \"x\"\n[cluster]\nprompt_stages = 2\nprompt_slots = 4\n[workload]\nrequests = 8\nseats = 4\n",
            "a seat per request",
        ),
    ];
    for (i, (text, message)) in cases.iter().enumerate() {
        let path = dir.path().join(format!("{i}.toml"));
        std::fs::write(&path, text).unwrap();
        let out = chaos(&["run", path.to_str().unwrap()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(message), "{message:?} not in {stderr}");
    }
    let out = chaos(&["run", "/nonexistent/scenario.toml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read"));
}

#[test]
fn workers_in_network_namespaces_of_their_own_survive_their_faults() {
    let out = chaos(&["run", &scenario("namespaces.toml"), "--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(2) && (stderr.contains("need root") || stderr.contains("not available here"))
    {
        eprintln!("skipped: this machine cannot make network namespaces: {}", stderr.trim());
        return;
    }
    let report = report(&out);
    assert_eq!(out.status.code(), Some(0), "{report:#}");
    assert_eq!((&report["passed"], &report["namespaces"]), (&true.into(), &true.into()));
    let classes = report["classes"].as_array().unwrap();
    assert_eq!(classes.len(), 7, "{classes:#?}");
    assert!(classes.iter().all(|c| c["violated"] == 0 && c["survived"].as_u64() >= Some(1)));
    assert!(report["recoveries"].as_u64().unwrap() >= 3, "{report:#}");
}
