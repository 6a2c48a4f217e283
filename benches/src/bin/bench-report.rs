//! Prints the benchmark report: each measurement beside its limit, measured in the same run, and
//! the end-to-end rows of the reference engine's cluster (started from the `dejavud` executable).
//!
//! `cargo build --release --bin dejavud && cargo run --release -p dejavu-benches --bin bench-report
//! [-- --json] [--quick] [--no-e2e] [--gpu-only] [--controller-only] [--path-only]`

use std::process::Command;
use std::time::Duration;

use dejavu_benches::e2e::{self, E2e};
use dejavu_benches::{medians_interleaved, memcpy, source_lines_bytes, Geometry, LineTouch, Row, Workload};
use dejavulib::baseline::flush_per_extent;
use dejavulib::file_io::{FileBackend, FileIo};
use dejavulib::store::{ChunkStore, FileStore};
use dejavulib::StagingPool;

const USAGE: &str =
    "usage: bench-report [--json] [--quick] [--no-e2e] [--gpu-only] [--controller-only] [--path-only]";

/// The command line.
struct Options {
    /// Print JSON instead of the table.
    json: bool,
    /// A smaller workload and shorter demos.
    quick: bool,
    /// Skip the end-to-end section.
    no_e2e: bool,
    /// Only the GPU section (for a GPU machine's short lease).
    gpu_only: bool,
    /// Only the scale of one controller (simulated members), as a table.
    controller_only: bool,
    /// Only the replication path at real sizes (engine, two sidecars), as a table.
    path_only: bool,
}

impl Options {
    fn parse() -> Result<Self, String> {
        let mut options = Self {
            json: false,
            quick: false,
            no_e2e: false,
            gpu_only: false,
            controller_only: false,
            path_only: false,
        };
        for arg in std::env::args().skip(1) {
            match arg.as_str() {
                "--json" => options.json = true,
                "--quick" => options.quick = true,
                "--no-e2e" => options.no_e2e = true,
                "--gpu-only" => {
                    options.gpu_only = true;
                    options.no_e2e = true;
                }
                "--controller-only" => options.controller_only = true,
                "--path-only" => options.path_only = true,
                other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
            }
        }
        Ok(options)
    }
}

fn median(runs: usize, f: impl FnMut()) -> Duration {
    dejavu_benches::median_of(runs, f)
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// A row of two times, in milliseconds (lower is better).
fn time_row(name: &str, value: Duration, limit_name: &str, limit: Duration, target: f64) -> Row {
    Row {
        name: name.into(),
        value: value.as_secs_f64() * 1e3,
        unit: "ms",
        limit_name: limit_name.into(),
        limit: limit.as_secs_f64() * 1e3,
        target,
        higher_is_better: false,
    }
}

/// Tokens generated per request in the end-to-end demos: the demo's default, and a quarter of it
/// with `--quick`. The two demos (eight runs) take under a minute on two cores, about 15 s quick.
const E2E_NEW_TOKENS: u32 = 256;
const E2E_NEW_TOKENS_QUICK: u32 = 64;

fn main() -> std::process::ExitCode {
    let options = match Options::parse() {
        Ok(options) => options,
        Err(e) => {
            eprintln!("bench-report: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let geometry = if options.quick {
        Geometry { layers: 8, heads: 40, slots: 8, max_tokens: 1024, prompt_tokens: 1000 }
    } else {
        Geometry::thirteen_b()
    };
    // First, on a machine nothing of ours loads yet.
    let machine = dejavu_benches::machine::Machine::read();
    eprintln!("{}", machine.line());
    if options.controller_only {
        return controller_only(&machine, options.quick);
    }
    if options.path_only {
        return path_only(&machine, options.quick);
    }
    let mut micro = micro_rows(geometry, options.quick, options.gpu_only);
    if !options.gpu_only {
        eprintln!("a prompt's handoff between pipeline setups, in one process...");
        let runs = if options.quick { 3 } else { 7 };
        micro.rows.extend(dejavu_benches::handoff::measure(geometry.prompt_tokens, runs));
    }
    // Last, so that the demos' processes do not share the cores with the measurements above.
    let e2e = end_to_end(&options);
    micro.rows.extend(e2e.rows.iter().cloned());
    print_report(&machine, &micro, &e2e, options.json);
    std::process::ExitCode::SUCCESS
}

/// Adds a measurement's rows and note to `e2e`, or a note that `what` failed.
fn record(e2e: &mut E2e, what: &str, measured: Result<(Vec<Row>, String), String>) {
    match measured {
        Ok((rows, note)) => {
            e2e.rows.extend(rows);
            e2e.notes.push(note);
        }
        Err(e) => e2e.notes.push(format!("{what}: failed: {e}")),
    }
}

/// The controller's rows alone (`--controller-only`): its scale, and, where etcd is installed, the
/// failover time and a member's detection during a failover.
fn controller_only(machine: &dejavu_benches::machine::Machine, quick: bool) -> std::process::ExitCode {
    let measured = e2e::find_dejavud().and_then(|exe| {
        let (window, detections) = controller_load_settings(quick);
        let (mut rows, note) =
            dejavu_benches::controller_load::measure(&exe, CONTROLLER_MEMBERS, window, detections)?;
        let mut notes = vec![note];
        if Command::new("etcd").arg("--version").output().is_ok() {
            let runs = if quick { FAILOVERS_QUICK } else { FAILOVERS };
            for measured in [
                dejavu_benches::failover::measure(&exe, runs),
                dejavu_benches::failover::measure_detection(&exe, runs),
            ] {
                let (more, note) = measured?;
                rows.extend(more);
                notes.push(note);
            }
        }
        Ok((rows, notes.join("\n")))
    });
    match measured {
        Ok((rows, note)) => {
            println!("{}\n", machine.line());
            print_rows(&rows);
            println!("\n{note}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bench-report: controller scale: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The replication path's rows alone (`--path-only`), as a table.
fn path_only(machine: &dejavu_benches::machine::Machine, quick: bool) -> std::process::ExitCode {
    let steps = if quick { PATH_STEPS_QUICK } else { dejavu_benches::path::STEPS };
    match e2e::find_dejavud().and_then(|exe| dejavu_benches::path::measure(&exe, steps)) {
        Ok((rows, notes)) => {
            println!("{}\n", machine.line());
            print_rows(&rows);
            println!("\n{}", notes.join("\n"));
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bench-report: the path at real sizes: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The window the controller's CPU is measured over, and the detections timed.
fn controller_load_settings(quick: bool) -> (Duration, u32) {
    if quick {
        (Duration::from_secs(2), 5)
    } else {
        (Duration::from_secs(5), 20)
    }
}

/// The end-to-end section, or the reason it was skipped.
fn end_to_end(options: &Options) -> E2e {
    if options.no_e2e {
        return E2e::skipped("--no-e2e");
    }
    match e2e::find_dejavud() {
        Ok(exe) => {
            let mut e2e =
                e2e::measure(&exe, if options.quick { E2E_NEW_TOKENS_QUICK } else { E2E_NEW_TOKENS });
            let steps = if options.quick { PATH_STEPS_QUICK } else { dejavu_benches::path::STEPS };
            match dejavu_benches::path::measure(&exe, steps) {
                Ok((rows, notes)) => {
                    e2e.rows.extend(rows);
                    e2e.notes.extend(notes);
                }
                Err(e) => e2e.notes.push(format!("the path at real sizes: failed: {e}")),
            }
            let requests = if options.quick { HELD_REQUESTS_QUICK } else { HELD_REQUESTS };
            match dejavu_benches::held::measure(&exe, requests) {
                Ok((row, note)) => {
                    e2e.rows.push(row);
                    e2e.notes.push(note);
                }
                Err(e) => e2e.notes.push(format!("sidecar memory: failed: {e}")),
            }
            if Command::new("etcd").arg("--version").output().is_ok() {
                let failovers = if options.quick { FAILOVERS_QUICK } else { FAILOVERS };
                eprintln!("controller failovers on a local etcd cluster...");
                record(&mut e2e, "controller failover", dejavu_benches::failover::measure(&exe, failovers));
                eprintln!("a member dying as the leading controller does...");
                let detection = dejavu_benches::failover::measure_detection(&exe, failovers);
                record(&mut e2e, "detection during a failover", detection);
            } else {
                e2e.notes
                    .push("controller failover: skipped, no etcd on the PATH (Debian's etcd-server)".into());
            }
            eprintln!("one controller under {CONTROLLER_MEMBERS} simulated members...");
            let (window, detections) = controller_load_settings(options.quick);
            let scale =
                dejavu_benches::controller_load::measure(&exe, CONTROLLER_MEMBERS, window, detections);
            record(&mut e2e, "controller scale", scale);
            e2e
        }
        Err(e) => {
            eprintln!("bench-report: {e}; skipping the end-to-end rows");
            E2e::skipped(e)
        }
    }
}

/// Members heartbeating at 10 Hz to the one controller whose scale is measured.
const CONTROLLER_MEMBERS: u32 = 1000;

/// Controller failovers measured, and in a quick report.
const FAILOVERS: usize = 20;
const FAILOVERS_QUICK: usize = 5;

/// Steps per size through the sidecars in a quick report.
const PATH_STEPS_QUICK: usize = 10;

/// Requests through one sidecar slot in the long run whose memory must stay flat, and in a quick
/// report.
const HELD_REQUESTS: usize = 10_000;
const HELD_REQUESTS_QUICK: usize = 2_000;

/// The rows measured in this process, and what the table's header says about them.
struct Micro {
    rows: Vec<Row>,
    workload: String,
    backend: &'static str,
    decode_len: u64,
    touched: u64,
    /// Why the GPU section has no rows, if it has none.
    gpu_note: Option<String>,
}

/// The GPU rows, where a CUDA driver is present, or why there are none.
fn gpu_rows(w: &Workload, rows: &mut Vec<Row>) -> Option<String> {
    match dejavu_benches::gpu::rows(w) {
        Ok(gpu) => {
            rows.extend(gpu);
            None
        }
        Err(why) => Some(format!("GPU section: {why}")),
    }
}

/// The gather, file and transport rows (or, `gpu_only`, none of them), then the GPU rows.
fn micro_rows(geometry: Geometry, quick: bool, gpu_only: bool) -> Micro {
    eprintln!("building and filling the workload cache ({geometry:?})...");
    let w = Workload::new(geometry);
    let packing = w.packing();
    let mut rows = Vec::new();

    // Decode step gather against the cache-line limit.
    let decode_len = w.cache.packed_len(&w.decode);
    let plan = w.cache.gather_plan(&w.decode, packing).expect("plan");
    let touched = source_lines_bytes(plan.copy_plan());
    if gpu_only {
        let gpu_note = gpu_rows(&w, &mut rows);
        let backend = "not measured (--gpu-only)";
        return Micro { rows, workload: format!("{geometry:?}"), backend, decode_len, touched, gpu_note };
    }
    // As many as the cache allows (it caps gather threads at the machine's parallelism).
    let parallelism = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cores = std::env::var("GATHER_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(parallelism, |n| n.clamp(1, parallelism));
    let lines = LineTouch::new(&w.cache, &w.decode, packing);
    let mut staging = vec![0u8; decode_len as usize];
    let cache = &w.cache;
    let gather_on = |threads: usize, staging: &mut [u8]| {
        cache.set_copy_threads(threads);
        cache.gather_with(&plan, staging).expect("gather");
    };
    // Repeated: each run finds part of the step's 16 MB of lines still in the last-level cache,
    // left there by the run before (what criterion measures). The three take turns, run by run.
    let (mut one, mut all) = (staging.clone(), staging.clone());
    let [t_gather_par, t_touch_par, t_gather] = medians_interleaved(
        31,
        [
            &mut || gather_on(cores, &mut all),
            &mut || {
                // SAFETY: nothing writes the cache while the benches run.
                std::hint::black_box(unsafe { lines.run(cores) });
            },
            &mut || gather_on(1, &mut one),
        ],
    );
    // From memory: a copy of 256 MiB, far more than the last-level cache, before each run leaves
    // none of the step's lines in cache; those copies are the DRAM memcpy bandwidth.
    let big = 256 << 20;
    let (big_src, mut big_dst) = (vec![5u8; big], vec![0u8; big]);
    let (evict_src, mut evict_dst) = (vec![6u8; big], vec![0u8; big]);
    let [t_big, t_gather_cold, _, t_touch_cold] = medians_interleaved(
        15,
        [
            &mut || memcpy(&mut big_dst, &big_src),
            &mut || gather_on(cores, &mut all),
            &mut || memcpy(&mut evict_dst, &evict_src),
            &mut || {
                // SAFETY: nothing writes the cache while the benches run.
                std::hint::black_box(unsafe { lines.run(cores) });
            },
        ],
    );
    w.cache.set_copy_threads(1);
    drop((big_src, big_dst, evict_src, evict_dst));
    let src = vec![3u8; decode_len as usize];
    let t_memcpy_small = median(31, || memcpy(&mut staging, &src));
    let dram = gbps(big as u64, t_big);
    let line_limit = dram * decode_len as f64 / touched as f64;
    let line_limit_name = "cache-line limit (DRAM memcpy x useful/touched)";
    let info = |name: &str, value: Duration, limit_name: &str, limit: f64| Row {
        name: name.into(),
        value: gbps(decode_len, value),
        unit: "GB/s",
        limit_name: limit_name.into(),
        limit,
        target: 0.0,
        higher_is_better: true,
    };
    // The target is against what bounds the gather: reading the same lines from memory, measured
    // in the same run. The cache-line limit (DRAM memcpy scaled to the lines touched) stays as
    // information: on these machines even reading the lines, copying nothing, falls short of it.
    rows.push(info(
        "gather decode step (FT, 16 B K pieces), all cores, every line from memory",
        t_gather_cold,
        line_limit_name,
        line_limit,
    ));
    rows.push(Row {
        target: 0.9,
        ..info(
            "gather decode step, all cores, every line from memory",
            t_gather_cold,
            "reading the same lines from memory, all cores, nothing copied",
            gbps(decode_len, t_touch_cold),
        )
    });
    rows.push(info(
        "gather decode step, all cores, repeated (lines partly in cache)",
        t_gather_par,
        line_limit_name,
        line_limit,
    ));
    rows.push(info(
        "gather decode step, all cores, repeated (lines partly in cache)",
        t_gather_par,
        "reading the same lines, repeated, all cores, nothing copied",
        gbps(decode_len, t_touch_par),
    ));
    rows.push(info(
        "reading the decode step's lines from memory, all cores, nothing copied",
        t_touch_cold,
        line_limit_name,
        line_limit,
    ));
    rows.push(info("gather decode step, one thread, repeated", t_gather, line_limit_name, line_limit));
    rows.push(info(
        "gather decode step, one thread, repeated",
        t_gather,
        "memcpy of the same bytes (cache-resident)",
        gbps(decode_len, t_memcpy_small),
    ));

    // Prompt gather against memcpy of the same bytes.
    let prompt_len = w.cache.packed_len(&w.prompt) as usize;
    let prompt_plan = w.cache.gather_plan(&w.prompt, packing).expect("plan");
    let mut prompt_out = vec![0u8; prompt_len];
    let t_prompt = median(7, || {
        w.cache.gather_with(&prompt_plan, &mut prompt_out).expect("gather");
    });
    let prompt_src = vec![9u8; prompt_len];
    let t_prompt_memcpy = median(7, || memcpy(&mut prompt_out, &prompt_src));
    let t_prompt_around = median(7, || dejavulib::copy::copy_around_cache(&mut prompt_out, &prompt_src));
    rows.push(Row {
        name: "gather 1000-token prompt".into(),
        value: gbps(prompt_len as u64, t_prompt),
        unit: "GB/s",
        limit_name: "memcpy of the same bytes".into(),
        limit: gbps(prompt_len as u64, t_prompt_memcpy),
        target: 0.8,
        higher_is_better: true,
    });
    // A gather far larger than the cache stores around it, which memcpy here does not: the copy
    // that does the same is its limit too.
    rows.push(Row {
        name: "gather 1000-token prompt".into(),
        value: gbps(prompt_len as u64, t_prompt),
        unit: "GB/s",
        limit_name: "a copy of the same bytes around the cache (non-temporal stores)".into(),
        limit: gbps(prompt_len as u64, t_prompt_around),
        target: 0.0,
        higher_is_better: true,
    });
    drop((prompt_out, prompt_src));

    // Decode step to a file: buffered against one write per extent.
    let dir = tempfile::tempdir().expect("tempdir");
    let descriptor = w.descriptor(&w.decode);
    let pool = StagingPool::default();
    let store =
        FileStore::open(dir.path().join("buffered"), FileBackend::Auto).expect("store").without_sync();
    // The three take turns, run by run. A cell, since `put` takes the store mutably.
    let shared_store = std::cell::RefCell::new(store);
    let streamed = |threads| {
        w.cache.set_copy_threads(threads);
        let mut staging = pool.lease(decode_len as usize);
        shared_store.borrow().put_gathered(&descriptor, &w.cache, &plan, &mut staging).expect("flush");
    };
    let [t_streamed, t_streamed_one, t_buffered] = medians_interleaved(
        15,
        [&mut || streamed(cores), &mut || streamed(1), &mut || {
            w.cache.set_copy_threads(cores);
            let mut staging = pool.lease(decode_len as usize);
            w.cache.gather_with(&plan, &mut staging).expect("gather");
            shared_store.borrow_mut().put(&descriptor, &staging).expect("flush");
        }],
    );
    let store = shared_store.into_inner();
    w.cache.set_copy_threads(1);
    let io = FileIo::new(FileBackend::Posix).expect("io");
    let path = dir.path().join("baseline.djv");
    let t_per_extent = median(3, || {
        flush_per_extent(&w.cache, &w.decode, &descriptor, &io, &path).expect("baseline");
    });
    let raw_path = dir.path().join("raw.bin");
    let t_raw = median(11, || std::fs::write(&raw_path, &src).expect("write"));
    let baseline = "one write per extent (paper's baseline)";
    let streamed = "decode step to file, buffered, all cores gathering (each piece written as gathered)";
    // The target is against what bounds a flush: a raw sequential write of the same bytes to the
    // same file system. The paper's ratio over one write per extent stays as information: where
    // that baseline is less than 50 raw writes, no code reaches 50x.
    rows.push(time_row(streamed, t_streamed, baseline, t_per_extent, 0.0));
    rows.push(time_row(
        "decode step to file, buffered, one thread gathering (each piece written as gathered)",
        t_streamed_one,
        baseline,
        t_per_extent,
        0.0,
    ));
    rows.push(time_row(
        "decode step to file, buffered, all cores gathering (gather, then 1 write)",
        t_buffered,
        baseline,
        t_per_extent,
        0.0,
    ));
    rows.push(time_row(streamed, t_streamed, "raw sequential write of the same bytes", t_raw, 0.9));

    // A decode step to a remote peer: buffered against one put per KV vector. The target is on
    // all cores gathering, as the file flush's; one thread's figure stays as information.
    let ([t_remote, t_remote_one], t_per_vector, vectors) =
        dejavu_benches::net::remote_decode_step(&w, if quick { 1 } else { 5 }, [cores, 1]);
    let remote_row = |name: &str, t: Duration, target: f64| Row {
        name: name.into(),
        value: t.as_secs_f64() * 1e3,
        unit: "ms",
        limit_name: format!("one put per KV vector ({vectors} puts)"),
        limit: t_per_vector.as_secs_f64() * 1e3,
        target,
        higher_is_better: false,
    };
    rows.push(remote_row(
        "decode step to a TCP peer, buffered, all cores gathering (gather + 1 put)",
        t_remote,
        50.0,
    ));
    rows.push(remote_row(
        "decode step to a TCP peer, buffered, one thread gathering (gather + 1 put)",
        t_remote_one,
        0.0,
    ));

    // The transports against raw streams moving the same bytes.
    for c in dejavu_benches::net::compare_transports(if quick { 1 } else { 15 }) {
        let raw = if c.transport == "tcp" { "raw tokio TCP" } else { "raw quinn stream" };
        let row = |limit_name: String, limit: Duration, target: f64| Row {
            name: format!("{} transport, {} ({} in flight)", c.transport, c.case.name, c.case.window),
            value: gbps(c.bytes(), c.peer),
            unit: "GB/s",
            limit_name,
            limit: gbps(c.bytes(), limit),
            target,
            higher_is_better: true,
        };
        rows.push(row(format!("{raw}, same bytes, buffers and acks"), c.raw, 0.9));
        if let Some(one_buffer) = c.raw_one_buffer {
            let limit_name = format!("{raw}, one message and one receive buffer (in cache where it fits)");
            rows.push(row(limit_name, one_buffer, 0.0));
        }
    }

    // The GPU section, where a CUDA driver is present.
    let gpu_note = gpu_rows(&w, &mut rows);

    Micro {
        rows,
        workload: format!("{geometry:?}"),
        backend: store.backend_name(),
        decode_len,
        touched,
        gpu_note,
    }
}

/// A string as a JSON string literal.
fn json_str(s: &str) -> String {
    serde_json::Value::from(s).to_string()
}

/// A number as JSON: four decimals, or `null` for one that is not finite (a ratio over a zero).
fn json_num(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.4}")
    } else {
        "null".into()
    }
}

/// A target as the table shows it: at most three decimals.
fn target_text(target: f64) -> String {
    let text = format!("{target:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn print_report(machine: &dejavu_benches::machine::Machine, micro: &Micro, e2e: &E2e, json: bool) {
    let Micro { rows, workload, backend, decode_len, touched, gpu_note } = micro;
    if json {
        let items: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"name\":{},\"value\":{},\"unit\":\"{}\",\"limit_name\":{},\"limit\":{},\"ratio\":{},\"target\":{},\"met\":{}}}",
                    json_str(&r.name),
                    json_num(r.value),
                    r.unit,
                    json_str(&r.limit_name),
                    json_num(r.limit),
                    json_num(r.ratio()),
                    r.target,
                    r.met()
                )
            })
            .collect();
        let notes: Vec<String> = gpu_note.iter().chain(&e2e.notes).map(|n| json_str(n)).collect();
        let demo = |d: &Option<dejavud::demo::DemoReport>| {
            d.as_ref().map_or("null".into(), |d| serde_json::to_string(d).expect("JSON of numbers"))
        };
        let machine = format!(
            "{{\"cpu\":{},\"cores\":{},\"l2_bytes\":{},\"l3_bytes\":{},\"transparent_huge_pages\":{},\"memcpy_gbps\":{}}}",
            json_str(&machine.cpu),
            machine.cores,
            machine.l2.map_or("null".into(), |b| b.to_string()),
            machine.l3.map_or("null".into(), |b| b.to_string()),
            json_str(&machine.huge_pages),
            json_num(machine.memcpy_gbps),
        );
        println!(
            "{{\"machine\":{machine},\"workload\":{},\"file_backend\":\"{backend}\",\"rows\":[{}],\"notes\":[{}],\"e2e\":{{\"demo\":{},\"swapping\":{}}}}}",
            json_str(workload),
            items.join(","),
            notes.join(","),
            demo(&e2e.demo),
            demo(&e2e.swapping),
        );
        return;
    }
    println!("{}", machine.line());
    println!("workload: {workload}; file I/O: {backend}");
    println!(
        "decode step: {decode_len} useful bytes in {touched} bytes of touched cache lines ({:.0}% useful)\n",
        100.0 * *decode_len as f64 / *touched as f64
    );
    print_rows(rows);
    println!();
    for note in gpu_note.iter().chain(&e2e.notes) {
        println!("{note}");
    }
}

/// The table of `rows`, in markdown.
fn print_rows(rows: &[Row]) {
    println!("| measurement | value | limit | limit value | ratio | target | met |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for r in rows {
        let (target, met) = if r.has_target() {
            (format!(">= {}x", target_text(r.target)), if r.met() { "yes" } else { "NO" })
        } else {
            ("info".into(), "-")
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
