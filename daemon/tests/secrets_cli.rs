//! The cluster secret through the real binary: a process listening beyond loopback refuses the
//! built-in default secret and says how to give one; one from `--secret-file` or the environment
//! is taken, an empty secret file refused.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Command, Stdio};

/// Runs `dejavud args...` until it announces where it listens (then kills it: `Ok` with the
/// line) or exits (`Err` with what it said on standard error).
fn listens(args: &[&str], env: &[(&str, &str)]) -> Result<String, String> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dejavud"))
        .args(args)
        .env_remove("DEJAVU_SECRET")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let listening = lines.map_while(Result::ok).find(|line| line.starts_with("listening "));
    let _ = child.kill();
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    match listening {
        Some(line) => Ok(line),
        None => {
            assert!(!status.success(), "it exited without listening, successfully: {stderr}");
            Err(stderr)
        }
    }
}

/// `sidecar` flags with a local socket of its own in `dir` (a killed sidecar leaves its socket).
fn sidecar(dir: &Path, listen: &str, extra: &[&str]) -> Vec<String> {
    static STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let local = dir.join(format!("s{n}.sock")).display().to_string();
    let mut args: Vec<String> = ["sidecar", "--local", &local, "--listen", listen].map(String::from).to_vec();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn refusal_says_how(stderr: &str) {
    assert!(stderr.contains("default cluster secret"), "{stderr}");
    assert!(stderr.contains("--secret-file") && stderr.contains("DEJAVU_SECRET"), "{stderr}");
}

#[test]
fn a_sidecar_beyond_loopback_refuses_the_default_secret_and_takes_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let args = sidecar(dir.path(), "0.0.0.0:0", &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    refusal_says_how(&listens(&args, &[]).unwrap_err());
    // On loopback the default still serves a cluster on one machine.
    let args = sidecar(dir.path(), "127.0.0.1:0", &["--index", "0"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    listens(&args, &[]).unwrap();
    // A secret of its own, from a file or from the environment.
    let file = dir.path().join("secret");
    std::fs::write(&file, "a secret of this cluster\n").unwrap();
    let args = sidecar(dir.path(), "0.0.0.0:0", &["--secret-file", file.to_str().unwrap()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    listens(&args, &[]).unwrap();
    let args = sidecar(dir.path(), "0.0.0.0:0", &["--index", "0", "--epoch", "0"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    listens(&args, &[("DEJAVU_SECRET", "another secret")]).unwrap();
}

#[test]
fn a_controller_beyond_loopback_refuses_the_default_secret() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state").display().to_string();
    let args = ["controller", "--state", &state, "--listen", "0.0.0.0:0"];
    refusal_says_how(&listens(&args, &[]).unwrap_err());
    assert!(!Path::new(&state).exists(), "a refused controller wrote its state file");
    let file = dir.path().join("secret");
    std::fs::write(&file, "a secret of this cluster").unwrap();
    let args =
        ["controller", "--state", &state, "--listen", "0.0.0.0:0", "--secret-file", file.to_str().unwrap()];
    listens(&args, &[]).unwrap();
}

#[test]
fn an_empty_or_missing_secret_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "\n").unwrap();
    let state = dir.path().join("state").display().to_string();
    let args = ["controller", "--state", &state, "--secret-file", empty.to_str().unwrap()];
    let stderr = listens(&args, &[]).unwrap_err();
    assert!(stderr.contains("is empty"), "{stderr}");
    let missing = dir.path().join("missing").display().to_string();
    let args = ["controller", "--state", &state, "--secret-file", &missing];
    let stderr = listens(&args, &[]).unwrap_err();
    assert!(stderr.contains("cannot read the secret file"), "{stderr}");
}
