#!/usr/bin/env bash
# Builds what benches/gpu/verify.sh runs on a GPU machine that has no Rust toolchain and no network,
# into carry/ at the repository root (git-ignored; about 40 MiB): dejavud, bench-report and the
# CUDA test executables, stripped, and the package's abi3 wheel. Needs cargo and maturin.
#
#     benches/gpu/pack.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf carry
mkdir -p carry/bin carry/wheel

cargo build --release -q -p dejavud --bin dejavud
cargo build --release -q -p dejavu-benches --bin bench-report
cp target/release/dejavud target/release/bench-report carry/bin/

# The test executables that run CUDA where a driver is present: their names are in cargo's
# build messages, not fixed paths.
executables() {
    cargo test --release -q -p dejavulib "$@" --no-run --message-format=json |
        python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["target"]["name"], m["executable"])'
}
{ executables --test cuda_streaming --test copy_backends; executables --lib; } |
    while read -r name path; do cp "$path" "carry/bin/test-$name"; done
strip carry/bin/*

(cd bindings/python && maturin build --release --quiet --out ../../carry/wheel)
du -sh carry
