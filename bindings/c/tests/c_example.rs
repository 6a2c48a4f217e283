//! Compiles `examples/roundtrip.c` with the system C compiler against the static library and runs
//! it: a gather, a flush to a file, a fetch and a scatter, checked byte for byte from C.

use std::path::{Path, PathBuf};
use std::process::Command;

/// This crate's static library. `cargo test` leaves it beside the test executable in
/// `target/<profile>/deps`; only `cargo build` also copies it up to `target/<profile>`.
fn static_library() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let deps = exe.parent().expect("target/<profile>/deps/<test>");
    let candidates = [deps.join("libdejavu.a"), deps.parent().expect("target/<profile>").join("libdejavu.a")];
    candidates.iter().find(|path| path.exists()).cloned().unwrap_or_else(|| {
        panic!("libdejavu.a was not built (looked for {candidates:?})");
    })
}

#[test]
fn the_c_example_round_trips_through_a_file() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = static_library();
    let work = tempfile::tempdir().unwrap();
    let exe = work.path().join("roundtrip");
    let compiled = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(crate_dir.join("include"))
        .arg(crate_dir.join("examples/roundtrip.c"))
        .arg(&lib)
        .args(["-lpthread", "-ldl", "-lm", "-o"])
        .arg(&exe)
        .output()
        .expect("run the C compiler");
    assert!(compiled.status.success(), "cc failed:\n{}", String::from_utf8_lossy(&compiled.stderr));
    let chunks = work.path().join("chunks");
    let run = Command::new(&exe).arg(&chunks).output().expect("run the example");
    assert!(
        run.status.success(),
        "the example failed:\n{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(String::from_utf8_lossy(&run.stdout).contains("every byte in place"));
    assert_eq!(std::fs::read_dir(&chunks).unwrap().count(), 1, "one chunk file was flushed");
}
