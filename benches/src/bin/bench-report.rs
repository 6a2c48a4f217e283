//! Prints the benchmark report: each measurement beside its physical limit, measured in the same run.
//!
//! `cargo run --release -p dejavu-benches --bin bench-report [-- --json] [--quick]`

use std::time::Duration;

use dejavu_benches::{memcpy, source_lines_bytes, Geometry, Workload};
use dejavulib::baseline::flush_per_extent;
use dejavulib::file_io::{FileBackend, FileIo};
use dejavulib::store::{ChunkStore, FileStore};
use dejavulib::StagingPool;

/// One line of the report.
struct Row {
    name: String,
    value: f64,
    unit: &'static str,
    limit_name: String,
    limit: f64,
    target: f64,
    higher_is_better: bool,
}

impl Row {
    fn ratio(&self) -> f64 {
        if self.higher_is_better {
            self.value / self.limit
        } else {
            self.limit / self.value
        }
    }
    fn met(&self) -> bool {
        self.ratio() >= self.target
    }
}

fn median(runs: usize, f: impl FnMut()) -> Duration {
    dejavu_benches::median_of(runs, f)
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn main() {
    let json = std::env::args().any(|a| a == "--json");
    let quick = std::env::args().any(|a| a == "--quick");
    let geometry = if quick {
        Geometry { layers: 8, heads: 40, slots: 8, max_tokens: 1024, prompt_tokens: 1000 }
    } else {
        Geometry::thirteen_b()
    };
    eprintln!("building and filling the workload cache ({geometry:?})...");
    let w = Workload::new(geometry);
    let packing = w.packing();
    let mut rows = Vec::new();

    // Decode step gather against the cache-line limit.
    let decode_len = w.cache.packed_len(&w.decode);
    let plan = w.cache.gather_plan(&w.decode, packing).expect("plan");
    let touched = source_lines_bytes(plan.copy_plan());
    let mut staging = vec![0u8; decode_len as usize];
    let t_gather = median(31, || {
        w.cache.gather_with(&plan, &mut staging).expect("gather");
    });
    let cores = std::env::var("GATHER_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    w.cache.set_gather_threads(cores);
    let t_gather_par = median(31, || {
        w.cache.gather_with(&plan, &mut staging).expect("gather");
    });
    w.cache.set_gather_threads(1);
    let src = vec![3u8; decode_len as usize];
    let t_memcpy_small = median(31, || memcpy(&mut staging, &src));
    // DRAM memcpy bandwidth: a copy far larger than the last-level cache.
    let big = 256 << 20;
    let (big_src, mut big_dst) = (vec![5u8; big], vec![0u8; big]);
    let t_big = median(9, || memcpy(&mut big_dst, &big_src));
    let dram = gbps(big as u64, t_big);
    let useful_fraction = decode_len as f64 / touched as f64;
    rows.push(Row {
        name: "gather decode step (FT, 16 B K pieces), all cores".into(),
        value: gbps(decode_len, t_gather_par),
        unit: "GB/s",
        limit_name: "cache-line limit (DRAM memcpy x useful/touched)".into(),
        limit: dram * useful_fraction,
        target: 0.8,
        higher_is_better: true,
    });
    rows.push(Row {
        name: "gather decode step, one thread".into(),
        value: gbps(decode_len, t_gather),
        unit: "GB/s",
        limit_name: "cache-line limit (DRAM memcpy x useful/touched)".into(),
        limit: dram * useful_fraction,
        target: 0.0,
        higher_is_better: true,
    });
    rows.push(Row {
        name: "gather decode step, one thread".into(),
        value: gbps(decode_len, t_gather),
        unit: "GB/s",
        limit_name: "memcpy of the same bytes (cache-resident)".into(),
        limit: gbps(decode_len, t_memcpy_small),
        target: 0.0,
        higher_is_better: true,
    });
    drop((big_src, big_dst));

    // Prompt gather against memcpy of the same bytes.
    let prompt_len = w.cache.packed_len(&w.prompt) as usize;
    let prompt_plan = w.cache.gather_plan(&w.prompt, packing).expect("plan");
    let mut prompt_out = vec![0u8; prompt_len];
    let t_prompt = median(7, || {
        w.cache.gather_with(&prompt_plan, &mut prompt_out).expect("gather");
    });
    let prompt_src = vec![9u8; prompt_len];
    let t_prompt_memcpy = median(7, || memcpy(&mut prompt_out, &prompt_src));
    rows.push(Row {
        name: "gather 1000-token prompt".into(),
        value: gbps(prompt_len as u64, t_prompt),
        unit: "GB/s",
        limit_name: "memcpy of the same bytes".into(),
        limit: gbps(prompt_len as u64, t_prompt_memcpy),
        target: 0.8,
        higher_is_better: true,
    });
    drop((prompt_out, prompt_src));

    // Decode step to a file: buffered against one write per extent.
    let dir = tempfile::tempdir().expect("tempdir");
    let descriptor = w.descriptor(&w.decode);
    let pool = StagingPool::default();
    let mut store =
        FileStore::open(dir.path().join("buffered"), FileBackend::Auto).expect("store").without_sync();
    let t_buffered = median(11, || {
        let mut staging = pool.lease(decode_len as usize);
        w.cache.gather_with(&plan, &mut staging).expect("gather");
        store.put(&descriptor, &staging).expect("flush");
    });
    let io = FileIo::new(FileBackend::Posix).expect("io");
    let path = dir.path().join("baseline.djv");
    let t_per_extent = median(3, || {
        flush_per_extent(&w.cache, &w.decode, &descriptor, &io, &path).expect("baseline");
    });
    let raw_path = dir.path().join("raw.bin");
    let t_raw = median(11, || std::fs::write(&raw_path, &src).expect("write"));
    rows.push(Row {
        name: "decode step to file, buffered (gather + 1 write)".into(),
        value: t_buffered.as_secs_f64() * 1e3,
        unit: "ms",
        limit_name: "one write per extent (paper's baseline)".into(),
        limit: t_per_extent.as_secs_f64() * 1e3,
        target: 50.0,
        higher_is_better: false,
    });
    rows.push(Row {
        name: "decode step to file, buffered".into(),
        value: t_buffered.as_secs_f64() * 1e3,
        unit: "ms",
        limit_name: "raw sequential write of the same bytes".into(),
        limit: t_raw.as_secs_f64() * 1e3,
        target: 0.0,
        higher_is_better: false,
    });

    // A decode step to a remote peer: buffered against one put per KV vector.
    let (t_remote, t_per_vector, vectors) =
        dejavu_benches::net::remote_decode_step(&w, if quick { 1 } else { 3 });
    rows.push(Row {
        name: "decode step to a TCP peer, buffered (gather + 1 put)".into(),
        value: t_remote.as_secs_f64() * 1e3,
        unit: "ms",
        limit_name: format!("one put per KV vector ({vectors} puts)"),
        limit: t_per_vector.as_secs_f64() * 1e3,
        target: 50.0,
        higher_is_better: false,
    });

    // The transports against raw streams moving the same bytes.
    for c in dejavu_benches::net::compare_transports(if quick { 1 } else { 3 }) {
        let raw = if c.transport == "tcp" { "raw tokio TCP" } else { "raw quinn stream" };
        rows.push(Row {
            name: format!("{} transport, {} ({} in flight)", c.transport, c.case.name, c.case.window),
            value: gbps(c.bytes(), c.peer),
            unit: "GB/s",
            limit_name: format!("{raw}, same bytes and acks"),
            limit: gbps(c.bytes(), c.raw),
            target: 0.9,
            higher_is_better: true,
        });
    }

    print_report(&rows, json, &format!("{geometry:?}"), store.backend_name(), decode_len, touched);
}

fn print_report(rows: &[Row], json: bool, workload: &str, backend: &str, decode_len: u64, touched: u64) {
    if json {
        let items: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"name\":\"{}\",\"value\":{:.4},\"unit\":\"{}\",\"limit_name\":\"{}\",\"limit\":{:.4},\"ratio\":{:.4},\"target\":{},\"met\":{}}}",
                    r.name, r.value, r.unit, r.limit_name, r.limit, r.ratio(), r.target, r.met()
                )
            })
            .collect();
        println!(
            "{{\"workload\":\"{workload}\",\"file_backend\":\"{backend}\",\"rows\":[{}]}}",
            items.join(",")
        );
        return;
    }
    println!("workload: {workload}; file I/O: {backend}");
    println!(
        "decode step: {decode_len} useful bytes in {touched} bytes of touched cache lines ({:.0}% useful)\n",
        100.0 * decode_len as f64 / touched as f64
    );
    println!("| measurement | value | limit | limit value | ratio | target | met |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for r in rows {
        let target = if r.target > 0.0 { format!(">= {}x", r.target) } else { "info".into() };
        let met = if r.target > 0.0 {
            if r.met() {
                "yes"
            } else {
                "NO"
            }
        } else {
            "-"
        };
        println!(
            "| {} | {:.3} {} | {} | {:.3} {} | {:.2}x | {} | {} |",
            r.name,
            r.value,
            r.unit,
            r.limit_name,
            r.limit,
            r.unit,
            r.ratio(),
            target,
            met
        );
    }
}
