//! The replication path at real sizes: an engine's step, gathered from its cache, through shared
//! memory to its `dejavud sidecar`, kept there and forwarded to the successor's sidecar (another
//! process), acknowledged back. The steps are decode steps of a 13B-class worker (40 layers x 40
//! KV heads x 128, fp16, FasterTransformer layout) for 1, 8 and 32 sequences: 0.8, 6.6 and 26 MB.
//!
//! Each size is measured two ways, each against a limit measured in the same run:
//! - synchronously, as `SidecarClient.step_done` runs: the step returns once both sidecars hold
//!   it. Its limit is the gather of the same region alone plus raw loopback TCP of the same bytes
//!   with a one-byte acknowledgment (the one network hop the path cannot avoid).
//! - streamed: the engine submits steps to a [`Streamer`] and goes on; the streamer thread sends
//!   them with its queue full. Its limit is raw TCP moving the same messages with as many in
//!   flight as the streamer's queue holds; the engine's own thread time per step is held to the
//!   gather's. Beside it, the CPU time a streamed step costs the three processes, against the raw
//!   link's two ends: shared among the machine's cores, it bounds the streamed throughput however
//!   well the processes overlap (on two cores, below the target; see `docs/benchmarks.md`).
//!
//! Both are measured with the sidecars on TCP, against raw tokio TCP, and on QUIC, against a raw
//! quinn stream. The synchronous steps over TCP are timed from Python too
//! (`benches/python/sidecar_path.py`, when a `python3` with the `dejavu` package is there), as
//! engines call them.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dejavud::proc::{spawn, Spawned};
use dejavulib::local::LocalSidecar;
use dejavulib::memory::StagingPool;
use dejavulib::reshard::{send, Transfer};
use dejavulib::streamer::{StreamJob, Streamer, StreamerConfig};
use dejavulib::{DType, KvCache, KvLayout, KvRegion, KvSpec, WorkerId};

use crate::net::{Case, RawLink};
use crate::{cpu_time, Row};

/// The synchronous path's target: at most 1.5x the time of its limit.
pub const SYNC_TARGET: f64 = 1.0 / 1.5;

/// The streamed path's target: at least 0.7x of the raw link's throughput.
pub const STREAMED_TARGET: f64 = 0.7;

/// Sequences per measured step (0.8, 6.6 and 26 MB).
const BATCHES: [u32; 3] = [1, 8, 32];

/// Steps timed per size in a full report (the median is reported), and in a quick one.
pub const STEPS: usize = 40;

/// Steps in flight in the streamed runs: the streamer's queue, and the raw link's window.
const QUEUE: usize = 4;

/// Bytes of a shared region: the largest step and its header fit.
const REGION_BYTES: usize = 64 << 20;

/// The transport between the sidecars, and the raw link that is its limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Link {
    /// TCP, against raw tokio TCP.
    Tcp,
    /// QUIC with the cluster's certificates, against a raw quinn stream.
    Quic,
}

impl Link {
    /// How rows name the link (nothing for TCP, the default), and its raw limit.
    fn names(self) -> (&'static str, &'static str) {
        match self {
            Link::Tcp => ("", "raw TCP"),
            Link::Quic => (" over QUIC", "raw quinn"),
        }
    }

    async fn raw(self, len: usize, buffers: usize) -> RawLink {
        match self {
            Link::Tcp => RawLink::tcp(len, buffers).await,
            Link::Quic => RawLink::quic(len, buffers, &crate::net::identities()).await,
        }
    }
}

/// The two sidecars of a ring of two, each the other's successor.
struct Ring {
    sidecars: [Spawned; 2],
    /// The first's local socket, and the second's address.
    engine_at: (std::path::PathBuf, std::net::SocketAddr),
    _dir: tempfile::TempDir,
    _shm: tempfile::TempDir,
}

impl Ring {
    fn start(exe: &Path, link: Link) -> Result<Self, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let shm = crate::shm_tempdir().map_err(|e| e.to_string())?;
        let certs = dir.path().join("certs");
        if link == Link::Quic {
            let args = ["certs", "--cluster=bench", &format!("--out={}", certs.display()), "member"];
            let made = std::process::Command::new(exe).args(args).output().map_err(|e| e.to_string())?;
            if !made.status.success() {
                return Err(format!("dejavud certs: {}", String::from_utf8_lossy(&made.stderr)));
            }
        }
        let sidecar = |index: u32| {
            let mut args = vec![
                "sidecar".to_owned(),
                format!("--index={index}"),
                format!("--local={}", dir.path().join(format!("s{index}.sock")).display()),
                format!("--shm-dir={}", shm.path().display()),
                format!("--region-bytes={REGION_BYTES}"),
                "--listen=127.0.0.1:0".to_owned(),
            ];
            if link == Link::Quic {
                args.extend(["--transport=quic".to_owned(), format!("--certs={}", certs.display())]);
            }
            spawn(exe, &args, "a sidecar", Duration::from_secs(30)).map_err(|e| e.to_string())
        };
        let (first, second) = (sidecar(0)?, sidecar(1)?);
        let engine_at = (dir.path().join("s0.sock"), second.addr);
        Ok(Self { sidecars: [first, second], engine_at, _dir: dir, _shm: shm })
    }

    /// CPU time the two sidecar processes have used so far.
    fn sidecars_cpu(&self) -> Result<[Duration; 2], String> {
        Ok([
            cpu_time::of_process(self.sidecars[0].proc.pid())?,
            cpu_time::of_process(self.sidecars[1].proc.pid())?,
        ])
    }

    /// The engine's connection to the first sidecar (one at a time).
    fn engine(&self) -> Result<LocalSidecar, String> {
        LocalSidecar::connect(&self.engine_at.0, 0, self.engine_at.1).map_err(|e| e.to_string())
    }
}

/// A decode step's cache: every byte written, so that no zero page flatters a read.
fn cache() -> KvCache {
    let spec = KvSpec::new(40, 40, 128, DType::F16).expect("a valid spec");
    let slots = *BATCHES.iter().max().expect("sizes");
    let layout = KvLayout::faster_transformer(spec, slots, 2).expect("a valid layout");
    let cache = KvCache::new(layout).expect("a layer-major layout");
    crate::fill(&cache);
    cache
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort_unstable();
    times[times.len() / 2]
}

/// One step size's measurements.
struct Measured {
    bytes: usize,
    /// Medians: the synchronous step, the gather alone, the raw link's transfer of one step.
    sync: Duration,
    gather: Duration,
    raw: Duration,
    /// Streamed: the steps' bytes over the time to the last acknowledgment (with a put in flight
    /// while the next step is gathered, and with each put awaited), the raw link's with the same
    /// window, and the engine thread's CPU time per step.
    streamed_bytes_per_s: f64,
    awaited_bytes_per_s: f64,
    raw_bytes_per_s: f64,
    engine_per_step: Duration,
    /// CPU time per streamed step (a put in flight) of the engine's process, its sidecar and the
    /// successor's; and of the raw link's two ends.
    streamed_cpu: [Duration; 3],
    raw_cpu: Duration,
}

/// The rows: for each transport and size, the synchronous step against its limit, the streamed
/// throughput against the raw link's, and the engine thread's time per streamed step against the
/// gather's; and a note per size on where the time goes.
pub fn measure(exe: &Path, steps: usize) -> Result<(Vec<Row>, Vec<String>), String> {
    let cache = Arc::new(cache());
    let runtime = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    let (mut rows, mut notes) = (Vec::new(), Vec::new());
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut raw_tcp = Vec::new();
    for link in [Link::Tcp, Link::Quic] {
        let ring = Ring::start(exe, link)?;
        let (over, raw) = link.names();
        for batch in BATCHES {
            let m = measure_size(&ring, &runtime, &cache, batch, steps, link)?;
            let mb = m.bytes as f64 / 1e6;
            rows.push(Row {
                name: format!("a {mb:.1} MB decode step through two sidecars{over}, synchronous"),
                value: ms(m.sync),
                unit: "ms",
                limit_name: format!("gather + {raw} of its bytes"),
                limit: ms(m.gather + m.raw),
                target: SYNC_TARGET,
                higher_is_better: false,
            });
            rows.push(Row {
                name: format!(
                    "{mb:.1} MB decode steps through two sidecars{over}, streamed ({QUEUE} queued)"
                ),
                value: m.streamed_bytes_per_s / 1e9,
                unit: "GB/s",
                limit_name: format!("{raw}, {QUEUE} in flight"),
                limit: m.raw_bytes_per_s / 1e9,
                target: STREAMED_TARGET,
                higher_is_better: true,
            });
            rows.push(Row {
                name: format!(
                    "{mb:.1} MB decode steps through two sidecars{over}, streamed, each put awaited \
                     before the next gather"
                ),
                value: m.awaited_bytes_per_s / 1e9,
                unit: "GB/s",
                limit_name: format!("{raw}, {QUEUE} in flight"),
                limit: m.raw_bytes_per_s / 1e9,
                target: 0.0,
                higher_is_better: true,
            });
            rows.push(Row {
                name: format!("engine thread per streamed {mb:.1} MB step{over}"),
                value: ms(m.engine_per_step),
                unit: "ms",
                limit_name: "the step's gather".into(),
                limit: ms(m.gather),
                target: 1.0,
                higher_is_better: false,
            });
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let cpu_per_step: Duration = m.streamed_cpu.iter().sum();
            rows.push(Row {
                name: format!(
                    "CPU per streamed {mb:.1} MB step{over}: the engine's process and both sidecars"
                ),
                value: ms(cpu_per_step),
                unit: "ms",
                limit_name: format!("{raw}'s CPU per step, both ends"),
                limit: ms(m.raw_cpu),
                target: 0.0,
                higher_is_better: false,
            });
            // However well the processes overlap, the cores cannot run a step in less than its CPU
            // time shared among them: the streamed rows' ceiling on this machine.
            let ceiling = m.bytes as f64 * cores as f64 / cpu_per_step.as_secs_f64();
            rows.push(Row {
                name: format!(
                    "{mb:.1} MB decode steps through two sidecars{over}, streamed: the most {cores} cores allow \
                     (bytes x cores / CPU per step)"
                ),
                value: ceiling / 1e9,
                unit: "GB/s",
                limit_name: format!("{raw}, {QUEUE} in flight"),
                limit: m.raw_bytes_per_s / 1e9,
                target: 0.0,
                higher_is_better: true,
            });
            let [engine_cpu, sidecar_cpu, successor_cpu] = m.streamed_cpu;
            notes.push(format!(
                "{mb:.1} MB steps{over}, streamed: {:.2} ms of CPU a step (the engine's process {:.2}, its sidecar \
                 {:.2}, the successor's {:.2}) against {:.2} ms for {raw} (both ends): on {cores} cores at best \
                 {:.2} GB/s, {:.2}x of {raw}'s {:.2} GB/s",
                ms(cpu_per_step),
                ms(engine_cpu),
                ms(sidecar_cpu),
                ms(successor_cpu),
                ms(m.raw_cpu),
                ceiling / 1e9,
                ceiling / m.raw_bytes_per_s,
                m.raw_bytes_per_s / 1e9,
            ));
            notes.push(format!(
                "{mb:.1} MB step{over} ({batch} sequences of a 13B-class worker): synchronous {:.2} ms = gather \
                 {:.2} ms + {raw} {:.2} ms + {:.2} ms for the rest (shared memory, keeping, acknowledgments)",
                ms(m.sync),
                ms(m.gather),
                ms(m.raw),
                ms(m.sync.saturating_sub(m.gather + m.raw))
            ));
            if link == Link::Tcp {
                raw_tcp.push(m.raw);
            }
        }
        if link == Link::Tcp {
            python_rows(&ring, steps, &raw_tcp, &mut rows, &mut notes);
        }
    }
    Ok((rows, notes))
}

/// The synchronous rows from Python, against Python's gather plus `raw_tcp` of each size, or a
/// note on why there are none.
fn python_rows(
    ring: &Ring,
    steps: usize,
    raw_tcp: &[Duration],
    rows: &mut Vec<Row>,
    notes: &mut Vec<String>,
) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    match from_python(ring, steps) {
        Ok(steps) => {
            for (step, &tcp) in steps.iter().zip(raw_tcp) {
                rows.push(Row {
                    name: format!(
                        "a {:.1} MB decode step through two sidecars, from Python (step_done, BHSD numpy)",
                        step.bytes as f64 / 1e6
                    ),
                    value: ms(step.step),
                    unit: "ms",
                    limit_name: "Python's gather + raw TCP of its bytes".into(),
                    limit: ms(step.gather + tcp),
                    target: SYNC_TARGET,
                    higher_is_better: false,
                });
            }
        }
        Err(why) => notes.push(format!("the path from Python: skipped: {why}")),
    }
}

/// The Python half: `sidecar_path.py` run by the interpreter `DEJAVU_PYTHON` names (`python3` by
/// default), which must have the `dejavu` package (`pip install ./bindings/python`).
const PYTHON_SCRIPT: &str = include_str!("../python/sidecar_path.py");

/// One step size timed from Python.
#[derive(serde::Deserialize)]
struct PythonStep {
    bytes: u64,
    #[serde(deserialize_with = "seconds")]
    step: Duration,
    #[serde(deserialize_with = "seconds")]
    gather: Duration,
}

fn seconds<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let s = <f64 as serde::Deserialize>::deserialize(d)?;
    Duration::try_from_secs_f64(s).map_err(serde::de::Error::custom)
}

/// Times `SidecarClient.step_done` of each size from Python, as an engine newer than the Rust
/// ones before it; an error says why it could not.
fn from_python(ring: &Ring, steps: usize) -> Result<Vec<PythonStep>, String> {
    let python = std::env::var("DEJAVU_PYTHON").unwrap_or_else(|_| "python3".into());
    let run = |args: &[String]| {
        std::process::Command::new(&python)
            .args(args)
            .output()
            .map_err(|e| format!("cannot run {python}: {e}"))
    };
    let probe = run(&["-c".into(), "import dejavu".into()])?;
    if !probe.status.success() {
        return Err(format!("{python} has no dejavu package (pip install ./bindings/python)"));
    }
    let (socket, successor) = &ring.engine_at;
    let mut args = vec![
        "-c".to_owned(),
        PYTHON_SCRIPT.to_owned(),
        format!("--socket={}", socket.display()),
        format!("--successor={successor}"),
        "--epoch=1".to_owned(),
        format!("--steps={steps}"),
        "--batches".to_owned(),
    ];
    args.extend(BATCHES.iter().map(u32::to_string));
    let out = run(&args)?;
    if !out.status.success() {
        return Err(format!("{python} failed: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).map_err(|e| format!("{line:?}: {e}")))
        .collect()
}

fn measure_size(
    ring: &Ring,
    runtime: &tokio::runtime::Runtime,
    cache: &Arc<KvCache>,
    batch: u32,
    steps: usize,
    link: Link,
) -> Result<Measured, String> {
    let region = KvRegion::new(0..40, 0..batch, 0..40, 1..2);
    let bytes = cache.packed_len(&region) as usize;
    let engine = WorkerId { stage: 0, rank: 0 };
    let transfer = Transfer::in_place(engine, engine, 0, &region);
    let packing = cache.layout().preferred_packing();
    let pool = StagingPool::default();
    let mut raw = runtime.block_on(link.raw(bytes, QUEUE));
    let message = Arc::new(vec![crate::net::noise(bytes)]);
    let mut staging = vec![0u8; bytes];

    // Synchronous steps, each beside the gather alone and the raw link moving the same bytes.
    let mut sidecar = ring.engine()?;
    let mut step = || send(cache, &transfer, 1..2, &pool, &mut sidecar).map_err(|e| e.to_string());
    // One untimed step: the region's and the buffers' pages touched before any clock runs.
    step()?;
    let one = Case { name: "one step", size: bytes, count: 1, window: 1 };
    let (mut sync, mut gather, mut over_raw) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..steps {
        let started = Instant::now();
        step()?;
        sync.push(started.elapsed());
        let started = Instant::now();
        cache.gather(&region, packing, &mut staging).map_err(|e| e.to_string())?;
        gather.push(started.elapsed());
        over_raw.push(runtime.block_on(raw.run(one, message.clone())));
    }

    drop(sidecar);

    // Streamed: the same steps, queued, with the engine's thread timed apart; rounds with a put
    // left in flight while the next step is gathered (the streamer's default) take turns with
    // rounds that wait for each put, and the raw link's with its window, so that the three see
    // the same machine.
    let job = StreamJob { cache: cache.clone(), transfer, tokens: 1..2 };
    let streamed_steps = steps.max(STREAMED_MIN_BYTES.div_ceil(bytes));
    let windowed = Case { name: "streamed steps", size: bytes, count: streamed_steps, window: QUEUE };
    let (mut in_flight, mut awaited, mut over_raw_windowed) = (Vec::new(), Vec::new(), Vec::new());
    let (mut streamed_cpu, mut raw_cpu) = ([Duration::ZERO; 3], Duration::ZERO);
    for _ in 0..STREAMED_ROUNDS {
        let round = streamed(ring, &job, streamed_steps, 1)?;
        for (total, used) in streamed_cpu.iter_mut().zip(round.cpu) {
            *total += used;
        }
        in_flight.push((round.wall, round.engine_thread));
        let round = streamed(ring, &job, streamed_steps, 0)?;
        awaited.push((round.wall, round.engine_thread));
        let cpu_before = cpu_time::this_process();
        over_raw_windowed.push(runtime.block_on(raw.run(windowed, message.clone())));
        raw_cpu += cpu_time::this_process() - cpu_before;
    }
    let total = (bytes * streamed_steps) as f64;
    let (streamed, engine_time) = median_round(in_flight);
    let (streamed_awaited, _) = median_round(awaited);
    let per_step = (STREAMED_ROUNDS * streamed_steps) as u32;
    Ok(Measured {
        bytes,
        sync: median(sync),
        gather: median(gather),
        raw: median(over_raw),
        streamed_bytes_per_s: total / streamed.as_secs_f64(),
        awaited_bytes_per_s: total / streamed_awaited.as_secs_f64(),
        raw_bytes_per_s: total / median(over_raw_windowed).as_secs_f64(),
        engine_per_step: engine_time / streamed_steps as u32,
        streamed_cpu: streamed_cpu.map(|used| used / per_step),
        raw_cpu: raw_cpu / per_step,
    })
}

/// Bytes a round of streamed steps moves at least (small steps take more of them): the sidecars'
/// CPU time is counted in the kernel's 10 ms ticks, so a round must last far longer than one.
const STREAMED_MIN_BYTES: usize = 256 << 20;

/// Rounds of streamed steps per way of streaming (and of the raw link's), taking turns.
const STREAMED_ROUNDS: usize = 3;

/// The round of median time of `rounds` (time, engine thread's time).
fn median_round(mut rounds: Vec<(Duration, Duration)>) -> (Duration, Duration) {
    rounds.sort_unstable();
    rounds[rounds.len() / 2]
}

/// One round of streamed steps.
struct Round {
    /// From the first submission to the last completion.
    wall: Duration,
    /// The engine thread's CPU time meanwhile.
    engine_thread: Duration,
    /// CPU time meanwhile of this process (the engine's: its streamer, its gathers), of the first
    /// sidecar and of the second.
    cpu: [Duration; 3],
}

/// `steps` copies of `job` through a streamer over a new connection to the ring's first sidecar
/// that leaves `puts_in_flight` puts in flight (after one untimed step).
fn streamed(ring: &Ring, job: &StreamJob, steps: usize, puts_in_flight: usize) -> Result<Round, String> {
    let config = StreamerConfig { queue_depth: QUEUE, puts_in_flight, ..StreamerConfig::default() };
    let streamer = Streamer::spawn(config, Box::new(ring.engine()?)).map_err(|e| e.to_string())?;
    streamer.submit(job.clone()).and_then(|c| c.wait()).map_err(|e| e.to_string())?;
    let cpu_before = (cpu_time::this_process(), ring.sidecars_cpu()?);
    let (started, engine_started) = (Instant::now(), cpu_time::this_thread());
    let mut pending = VecDeque::new();
    for _ in 0..steps {
        pending.push_back(streamer.submit(job.clone()).map_err(|e| e.to_string())?);
        // Completions are collected as they come, as an engine's loop would.
        while pending.front().is_some_and(|c| c.is_finished()) {
            pending.pop_front().expect("a completion").wait().map_err(|e| e.to_string())?;
        }
    }
    for completion in pending {
        completion.wait().map_err(|e| e.to_string())?;
    }
    let (wall, engine_thread) = (started.elapsed(), cpu_time::this_thread() - engine_started);
    let [first, second] = ring.sidecars_cpu()?;
    let [first_before, second_before] = cpu_before.1;
    let cpu = [cpu_time::this_process() - cpu_before.0, first - first_before, second - second_before];
    Ok(Round { wall, engine_thread, cpu })
}
