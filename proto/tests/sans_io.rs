//! The protocol core must stay sans-IO: no dependencies, and no sockets, files, threads, clocks,
//! processes, environment or randomness in its sources.

use std::path::Path;

#[test]
fn the_crate_has_no_dependencies() {
    let manifest = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml")).unwrap();
    let deps = manifest.split("[dependencies]").nth(1).expect("a [dependencies] section");
    let body: Vec<&str> = deps
        .lines()
        .take_while(|l| !l.trim_start().starts_with('['))
        .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        .collect();
    assert!(body.is_empty(), "dejavu-proto must not depend on anything: {body:?}");
}

#[test]
fn sources_use_no_io_time_threads_or_randomness() {
    let forbidden = [
        "std::net",
        "std::fs",
        "std::io",
        "std::thread",
        "std::time",
        "std::process",
        "std::env",
        "Instant",
        "SystemTime",
        "rand::",
        "tokio",
        "unsafe",
    ];
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    // Every source file, in the modules' folders too.
    let mut folders = vec![src.clone()];
    let mut checked = 0;
    while let Some(folder) = folders.pop() {
        for entry in std::fs::read_dir(&folder).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                folders.push(path);
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for word in forbidden {
                assert!(!text.contains(word), "{} uses {word}", path.display());
            }
            checked += 1;
        }
    }
    assert!(checked >= 10, "expected the protocol sources under {}", src.display());
}
