//! The report's rows for a region between GPU memory and the host, on the layout PyTorch engines
//! use (per-layer `[B][H][S][D]` tensors): the library's pipelined gather and scatter, from Rust
//! and from Python, against one plain copy of the same bytes on the same card, and what an engine
//! would write without the library (`torch.stack` then one pinned copy; one copy per tensor).
//! The Python rows come from `benches/python/gpu_host.py`, run by the interpreter in
//! `DEJAVU_BENCH_PYTHON` (default `python3`) where it can import `torch` and `dejavu`.

use std::process::Command;
use std::time::Duration;

use dejavulib::cuda::{CudaEngine, CudaError, HostMemory, HostPath};
use dejavulib::layout::PerLayerOrder;
use dejavulib::{KvLayout, KvRegion, KvSpec};

use crate::gbps;
use crate::{median_of, Row, Workload};

/// Warm-up rounds before each measurement: the first pinned copies of a sitting run slower
/// (0.76x against 0.93x in two sittings on an H200).
const WARM_UP: usize = 10;

/// Timed runs per measurement (their median is reported).
const RUNS: usize = 21;

/// The median time of `f` after `WARM_UP` untimed runs.
fn timed(f: &mut dyn FnMut() -> Result<(), CudaError>) -> Result<Duration, CudaError> {
    for _ in 0..WARM_UP {
        f()?;
    }
    let mut failed = None;
    let t = median_of(RUNS, || {
        if let Err(e) = f() {
            failed = Some(e);
        }
    });
    failed.map_or(Ok(t), Err)
}

/// The rows from Rust, then those of the Python script (or a row-less note of why not).
pub fn rows(engine: &CudaEngine, w: &Workload) -> Result<Vec<Row>, CudaError> {
    let layout = w.cache.layout();
    // The workload's geometry: valid, since the FasterTransformer cache was made of it.
    let spec = KvSpec::new(layout.spec().layers(), layout.spec().kv_heads(), 128, dejavulib::DType::F16)
        .expect("the workload's spec");
    let bhsd = KvLayout::per_layer(spec, layout.slots(), layout.max_tokens(), PerLayerOrder::Bhsd)
        .expect("the workload's geometry");
    let kv = engine.alloc_kv(bhsd)?;
    let mut rows = Vec::new();
    for (name, region) in [("decode step", &w.decode), ("1000-token prompt", &w.prompt)] {
        rows.extend(rust_rows(engine, &kv, name, region)?);
    }
    drop(kv);
    match python_rows(w) {
        Ok(python) => rows.extend(python),
        Err(why) => eprintln!("GPU host rows from Python: {why}"),
    }
    Ok(rows)
}

fn rust_rows(
    engine: &CudaEngine,
    kv: &dejavulib::cuda::DeviceKv,
    name: &str,
    region: &KvRegion,
) -> Result<Vec<Row>, CudaError> {
    let packing = kv.layout().preferred_packing();
    let len = kv.packed_len(region) as usize;
    let mut pinned = engine.pinned_pool().lease(len)?;
    let mut pageable = vec![0u8; len];
    let mut device = engine.alloc(len)?;
    let mut plain = engine.pinned(len)?;
    assert_eq!(engine.host_memory(pinned.as_slice()?)?, HostMemory::Pinned);
    let t_down = timed(&mut || {
        engine.download_pinned(&device, &mut plain)?;
        engine.synchronize()
    })?;
    let t_up = timed(&mut || {
        engine.upload_pinned(&plain, &mut device)?;
        engine.synchronize()
    })?;
    let staging = engine.alloc(len)?;
    let prepared = engine.prepare_gather(kv, region, packing, &staging)?;
    let t_kernel = timed(&mut || {
        engine.launch(&prepared, kv, &staging)?;
        engine.synchronize()
    })?;
    let mut copy = engine.alloc(len)?;
    let t_device = timed(&mut || {
        engine.copy_device(&staging, &mut copy)?;
        engine.synchronize()
    })?;
    drop((staging, copy));
    let t_down_pageable = timed(&mut || engine.download(&device, &mut pageable))?;
    let t_up_pageable = timed(&mut || {
        engine.upload(&pageable, &mut device)?;
        engine.synchronize()
    })?;
    let t_gather = timed(&mut || engine.gather_into_host(kv, region, packing, pinned.as_mut_slice()?))?;
    let t_scatter = timed(&mut || engine.scatter_from_host(pinned.as_slice()?, kv, region, packing))?;
    let mut paths = Vec::new();
    for path in [
        HostPath::Direct,
        HostPath::Staged { pieces: 1 },
        HostPath::Staged { pieces: 2 },
        HostPath::Staged { pieces: 4 },
    ] {
        let down =
            timed(&mut || engine.gather_into_host_by(kv, region, packing, pinned.as_mut_slice()?, path))?;
        let up = timed(&mut || engine.scatter_from_host_by(pinned.as_slice()?, kv, region, packing, path))?;
        paths.push((path, down, up));
    }
    let t_gather_pageable = timed(&mut || engine.gather_into_host(kv, region, packing, &mut pageable))?;
    let t_scatter_pageable = timed(&mut || engine.scatter_from_host(&pageable, kv, region, packing))?;
    let row = |what: &str, t: Duration, limit_name: &str, limit: Duration, target| Row {
        name: format!("GPU per-layer BHSD {name}, {what} (Rust)"),
        value: gbps(len as u64, t),
        unit: "GB/s",
        limit_name: limit_name.into(),
        limit: gbps(len as u64, limit),
        target,
        higher_is_better: true,
    };
    let down = "one plain pinned device-to-host copy of the same bytes";
    let up = "one plain pinned host-to-device copy of the same bytes";
    let auto = HostPath::auto(HostMemory::Pinned);
    let mut rows = vec![
        row(
            "gather kernel into device staging (prepared)",
            t_kernel,
            "device-to-device copy of the same bytes",
            t_device,
            0.0,
        ),
        row(&format!("gather into pinned memory ({auto:?})"), t_gather, down, t_down, 0.9),
        row(&format!("scatter from pinned memory ({auto:?})"), t_scatter, up, t_up, 0.9),
    ];
    for (path, t_path_down, t_path_up) in paths {
        rows.push(row(&format!("gather into pinned memory, {path:?}"), t_path_down, down, t_down, 0.0));
        rows.push(row(&format!("scatter from pinned memory, {path:?}"), t_path_up, up, t_up, 0.0));
    }
    rows.extend([
        row(
            "gather into pageable memory",
            t_gather_pageable,
            "one plain device-to-host copy of the same bytes into pageable memory",
            t_down_pageable,
            0.0,
        ),
        row(
            "scatter from pageable memory",
            t_scatter_pageable,
            "one plain host-to-device copy of the same bytes from pageable memory",
            t_up_pageable,
            0.0,
        ),
    ]);
    Ok(rows)
}

/// The Python script, carried in the executable: a `bench-report` copied to a GPU machine finds
/// it there without the source tree.
const PYTHON_SCRIPT: &str = include_str!("../python/gpu_host.py");

/// Runs the Python script on `w`'s geometry and reads its rows.
fn python_rows(w: &Workload) -> Result<Vec<Row>, String> {
    let script = "gpu_host.py";
    let python = std::env::var("DEJAVU_BENCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let layout = w.cache.layout();
    let output = Command::new(&python)
        .args(["-c", PYTHON_SCRIPT])
        .args(["--layers", &layout.spec().layers().to_string()])
        .args(["--heads", &layout.spec().kv_heads().to_string()])
        .args(["--slots", &layout.slots().to_string()])
        .args(["--max-tokens", &layout.max_tokens().to_string()])
        .args(["--decode-token", &w.decode.tokens.start.to_string()])
        .args(["--prompt-tokens", &w.prompt.tokens.end.to_string()])
        .output()
        .map_err(|e| format!("could not run {python} {script}: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "{python} {script} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).lines().last().unwrap_or("")
        ));
    }
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|line| line.starts_with('{'))
        .map(|line| {
            // One JSON object a line: name, value, limit_name, limit, target.
            let row: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("{e}: {line}"))?;
            let text = |key: &str| row[key].as_str().map(str::to_string).ok_or(format!("no {key} in {line}"));
            let number = |key: &str| row[key].as_f64().ok_or(format!("no {key} in {line}"));
            Ok(Row {
                name: text("name")?,
                value: number("value")?,
                unit: "GB/s",
                limit_name: text("limit_name")?,
                limit: number("limit")?,
                target: number("target")?,
                higher_is_better: true,
            })
        })
        .collect()
}
