//! The report's GPU rows, where a CUDA driver is present: the gather kernel against a
//! device-to-device copy of the same bytes, and a decode step's gather plus its copy to pinned
//! host memory against a plain pinned copy of the same bytes.

use std::time::Duration;

use dejavulib::cuda::{driver_present, CudaEngine, CudaError};

use crate::{median_of, Row, Workload};

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// The GPU rows for `w`'s decode step and prompt, or why there are none.
pub fn rows(w: &Workload) -> Result<Vec<Row>, String> {
    if !driver_present() {
        return Err("skipped: no CUDA driver on this machine".into());
    }
    measure(w).map_err(|e| format!("failed: {e}"))
}

fn measure(w: &Workload) -> Result<Vec<Row>, CudaError> {
    let engine = CudaEngine::open(0)?;
    let mut kv = engine.alloc_kv(w.cache.layout().clone())?;
    engine.upload_kv(&w.cache.snapshot(), &mut kv)?;
    let packing = w.packing();
    let mut rows = Vec::new();
    for (name, region) in [("decode step", &w.decode), ("1000-token prompt", &w.prompt)] {
        let plan = w.cache.gather_plan(region, packing)?;
        let len = w.cache.packed_len(region) as usize;
        let (mut staging, source) = (engine.alloc(len)?, engine.alloc(len)?);
        let mut copy = engine.alloc(len)?;
        let timed = |f: &mut dyn FnMut() -> Result<(), CudaError>| -> Result<Duration, CudaError> {
            f()?;
            engine.synchronize()?;
            let mut failed = None;
            let t = median_of(11, || {
                if let Err(e) = f().and_then(|()| engine.synchronize()) {
                    failed = Some(e);
                }
            });
            failed.map_or(Ok(t), Err)
        };
        let t_gather = timed(&mut || engine.gather(&kv, &plan, &mut staging))?;
        let t_copy = timed(&mut || engine.copy_device(&source, &mut copy))?;
        rows.push(Row {
            name: format!("GPU gather kernel, {name}"),
            value: gbps(len as u64, t_gather),
            unit: "GB/s",
            limit_name: "device-to-device copy of the same bytes".into(),
            limit: gbps(len as u64, t_copy),
            target: 0.8,
            higher_is_better: true,
        });
        if region == &w.decode {
            let mut pinned = engine.pinned(len)?;
            let t_plain = timed(&mut || engine.download_pinned(&staging, &mut pinned))?;
            let t_buffered = timed(&mut || {
                engine.gather(&kv, &plan, &mut staging)?;
                engine.download_pinned(&staging, &mut pinned)
            })?;
            rows.push(Row {
                name: "GPU decode step to pinned host memory (gather kernel + one copy)".into(),
                value: gbps(len as u64, t_buffered),
                unit: "GB/s",
                limit_name: "plain pinned device-to-host copy of the same bytes".into(),
                limit: gbps(len as u64, t_plain),
                target: 0.0,
                higher_is_better: true,
            });
        }
    }
    Ok(rows)
}
