//! `dejavud demo` through the real binary: real stage and sidecar processes on loopback, a worker
//! (engine and sidecar, or engine alone) SIGKILLed mid-decode and recovered, tokens identical to
//! the failure-free run, nothing left running afterwards; bad settings are refused.

use std::process::Command;

fn dejavud(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dejavud")).args(args).output().expect("run dejavud")
}

/// Processes started from this test's `dejavud` binary that are still alive.
fn leftovers() -> Vec<String> {
    let exe = env!("CARGO_BIN_EXE_dejavud");
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) {
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            let ours = [" stage ", " sidecar", " controller"].iter().any(|sub| cmdline.contains(sub));
            if cmdline.starts_with(exe) && ours {
                found.push(cmdline);
            }
        }
    }
    found
}

#[test]
fn the_demo_recovers_a_killed_stage_with_identical_tokens_also_when_swapping_or_with_spares() {
    for victim in ["0", "2", "3"] {
        let out = dejavud(&[
            "demo",
            "--json",
            "--victim",
            victim,
            "--requests",
            "5",
            "--prompt-tokens",
            "9",
            "--new-tokens",
            "12",
        ]);
        assert!(out.status.success(), "victim {victim}: {}", String::from_utf8_lossy(&out.stderr));
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
        assert_eq!(report["matched"], true, "{report}");
        assert_eq!(report["restart_matched"], true, "{report}");
        assert_eq!(report["tokens"], 60);
        let steps = ["unreplicated_step_ms", "failure_free_step_ms"];
        let interleaved = ["interleaved_replicated_step_ms", "interleaved_paused_step_ms"];
        for step in steps.into_iter().chain(interleaved) {
            let ms = report[step].as_f64().unwrap();
            assert!(ms > 0.0 && ms < 1000.0, "a decode step's median time: {report}");
        }
        // 60 steps: blocks of 7, so both settings have decode steps.
        assert_eq!(report["interleaved_block"], 7, "{report}");
        let recovery = &report["recovery"];
        assert!(recovery["tokens_recomputed"].as_u64().unwrap() >= 1, "{report}");
        assert!(recovery["detection_ms"].as_f64().unwrap() > 0.0, "{report}");
        assert!(report["restart_tokens_recomputed"].as_u64().unwrap() >= 1, "{report}");
        assert_eq!(report["swapped_bytes"], 0, "one device cache per microbatch: no swapping");
    }
    // With microbatch swapping on: three microbatches of four requests in two device caches per
    // stage. (In this test, not another: the check for leftovers sees every demo's processes.)
    let args = ["demo", "--json", "--requests", "12", "--prompt-tokens", "7", "--new-tokens", "8"];
    let out = dejavud(&[&args[..], &["--device-caches", "2"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    assert_eq!(report["matched"], true, "{report}");
    assert_eq!(report["restart_matched"], true, "{report}");
    assert_eq!(report["tokens"], 96);
    assert!(report["swapped_bytes"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(report["spares_used"], 0, "no spares asked for");
    // With a spare worker: the recovery makes its stage and sidecar processes the victim's (and
    // the spares started meanwhile go with the demo too).
    let out = dejavud(&[&args[..], &["--spares", "1"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    assert_eq!(report["matched"], true, "{report}");
    assert_eq!(report["spares_used"], 2, "{report}");
    // Each worker in a network namespace of its own (as root; elsewhere it says so, exit 2).
    let out = dejavud(&[&args[..], &["--namespaces"]].concat());
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(2) && (stderr.contains("need root") || stderr.contains("not available here"))
    {
        eprintln!("skipped --namespaces: {}", stderr.trim());
    } else {
        assert!(out.status.success(), "{stderr}");
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
        assert_eq!(
            (&report["matched"], &report["restart_matched"]),
            (&true.into(), &true.into()),
            "{report}"
        );
    }
    assert!(leftovers().is_empty(), "processes left behind: {:?}", leftovers());
}

#[test]
fn bad_demo_settings_are_refused() {
    for args in [
        &["demo", "--victim", "7"][..],
        &["demo", "--stages", "0"],
        &["demo", "--new-tokens", "1"],
        &["demo", "--device-caches", "0"],
    ] {
        let out = dejavud(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("invalid demo setting"), "{args:?}");
    }
    // A workload larger than the machine is refused before anything starts, not by the kernel's
    // out-of-memory killer.
    let out = dejavud(&["demo", "--requests", "100000000"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("100000000 requests of 288 tokens need about") && err.contains("available"),
        "{err}"
    );
}

#[test]
fn settings_come_from_a_toml_file_and_flags_override_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("demo.toml");
    std::fs::write(
        &file,
        "stages = 3\nkill = \"engine\"\nvictim = 0\nrequests = 3\nprompt_tokens = 5\nnew_tokens = 9\n",
    )
    .unwrap();
    let out = dejavud(&[
        "demo",
        "--json",
        "--config",
        file.to_str().unwrap(),
        "--victim",
        "2",
        "--new-tokens",
        "6",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["tokens"], 18, "3 requests from the file x 6 tokens from the flag");
    assert_eq!(report["matched"], true);

    for (text, complaint) in [
        ("stagez = 4\n", "unknown field"),
        ("stages = \"four\"\n", "invalid type"),
        ("kill = \"all\"\n", "unknown variant"),
    ] {
        std::fs::write(&file, text).unwrap();
        let out = dejavud(&["demo", "--config", file.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(2), "{text}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(complaint),
            "{text}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let missing = dejavud(&["demo", "--config", "/nonexistent/demo.toml"]);
    assert_eq!(missing.status.code(), Some(2));
}

#[test]
fn a_port_in_use_is_a_clear_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let next = "127.0.0.1:9".to_string();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("controller.state").display().to_string();
    let socket = dir.path().join("sidecar.sock").display().to_string();
    for args in [
        vec!["controller", "--listen", &addr, "--state", &state],
        vec!["sidecar", "--listen", &addr, "--local", &socket],
        vec!["stage", "--index", "0", "--layers", "0..8", "--next", &next, "--listen", &addr],
    ] {
        let out = dejavud(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("in use"), "{args:?}: {err}");
    }
    assert!(!dir.path().join("controller.state").exists(), "nothing written when the port is taken");
}

#[test]
fn the_cluster_secret_comes_from_the_environment_and_never_shows_in_help() {
    use dejavud::cli::{DEFAULT_SECRET, SECRET_ENV};
    use dejavud::controller::{ControllerClient, ControllerError};
    use std::io::BufRead;
    use std::time::Duration;

    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("controller.state").display().to_string();
    let mut controller = Command::new(env!("CARGO_BIN_EXE_dejavud"))
        .args(["controller", "--listen", "127.0.0.1:0", "--state", &state])
        .env(SECRET_ENV, "a secret from the environment")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start the controller");
    let mut lines = std::io::BufReader::new(controller.stdout.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("a line before the controller exits").unwrap();
        if let Some(addr) = line.strip_prefix("listening ") {
            break addr.parse().unwrap();
        }
    };
    let secret = b"a secret from the environment".as_slice();
    let census = ControllerClient::new(addr, Duration::from_secs(5), secret).census();
    let refused = ControllerClient::new(addr, Duration::from_secs(5), DEFAULT_SECRET).census();
    let _ = controller.kill();
    let _ = controller.wait();
    assert_eq!(census.expect("the environment's secret is the controller's").epoch, 0);
    assert!(matches!(refused, Err(ControllerError::Auth(_))), "the default is not: {refused:?}");

    let help = Command::new(env!("CARGO_BIN_EXE_dejavud"))
        .args(["controller", "--help"])
        .env(SECRET_ENV, "a secret from the environment")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains(SECRET_ENV), "the help names the variable: {help}");
    assert!(!help.contains("a secret from the environment"), "but not its value: {help}");
}
