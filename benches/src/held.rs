//! What a sidecar holds over a long run: a `dejavud sidecar` process takes request after request in
//! the same slot (each a prompt of a random length and a few decode steps, through shared memory,
//! forwarded to a successor that keeps only current sequences as a sidecar does), and its resident
//! memory is read from `/proc` after each request. A sidecar that kept finished requests' KV would
//! grow by their bytes; one that holds only the current sequence stays flat.

use std::path::Path;
use std::time::Duration;

use dejavu_proto::rng::SplitMix64;
use dejavud::proc::spawn;
use dejavulib::chunk::ChunkDescriptor;
use dejavulib::local::LocalSidecar;
use dejavulib::net::tcp::TcpTransport;
use dejavulib::net::{PeerServer, ServerConfig};
use dejavulib::{ChunkStore, DType, HostStore, KvRegion, KvSpec, Packing, WorkerId};

use crate::Row;

/// The flatness the long run must show: the resident memory over the last requests within 5% of
/// the first's.
pub const FLAT_TARGET: f64 = 0.95;

/// Decode steps after each prompt.
const STEPS: u32 = 2;

/// Requests averaged at each end of the run.
const WINDOW: usize = 1_000;

/// The row of a run of `requests` requests through a sidecar started from `exe`, and a note on
/// the workload.
pub fn measure(exe: &Path, requests: usize) -> Result<(Row, String), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let shm = crate::shm_tempdir().map_err(|e| e.to_string())?;
    let socket = dir.path().join("sidecar.sock");
    let args = [
        "sidecar".to_owned(),
        "--index=1".to_owned(),
        format!("--local={}", socket.display()),
        format!("--shm-dir={}", shm.path().display()),
    ];
    let sidecar = spawn(exe, &args, "a sidecar", Duration::from_secs(30)).map_err(|e| e.to_string())?;
    // The successor keeps only current sequences, as the next sidecar of the ring does.
    let runtime = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    let successor_store = HostStore::new().keeping_current_sequences();
    let successor = runtime
        .block_on(PeerServer::bind(
            &TcpTransport::plain(),
            "127.0.0.1:0".parse().expect("an address"),
            ServerConfig::new(dejavud::cli::cluster_secret(), 2),
            successor_store,
        ))
        .map_err(|e| e.to_string())?;
    let mut engine = LocalSidecar::connect(&socket, 0, successor.addr()).map_err(|e| e.to_string())?;
    let pid = sidecar.proc.pid();
    let mut rng = SplitMix64::new(10_000);
    let mut rss = Vec::with_capacity(requests);
    for request in 0..requests {
        let prompt = 16 + rng.below(885) as u32;
        put(&mut engine, 0..prompt, request as u8)?;
        for token in prompt..prompt + STEPS {
            put(&mut engine, token..token + 1, request as u8)?;
        }
        rss.push(resident_bytes(pid)?);
    }
    let window = WINDOW.min(requests / 2).max(1);
    let mean = |values: &[u64]| values.iter().sum::<u64>() as f64 / values.len() as f64 / 1e6;
    let (first, last) = (mean(&rss[..window]), mean(&rss[rss.len() - window..]));
    let row = Row {
        name: format!("sidecar resident memory over the last {window} of {requests} requests in one slot"),
        value: last,
        unit: "MB",
        limit_name: format!("over the first {window}"),
        limit: first,
        target: FLAT_TARGET,
        higher_is_better: false,
    };
    let note = format!(
        "sidecar memory: {requests} requests one after another in slot 0 of a cache of 4 layers x 2 KV heads \
         of 64, fp16; each a prompt of 16-900 tokens (seeded) and {STEPS} decode steps, forwarded to a \
         successor keeping current sequences; {} KiB at most per sequence",
        (900 + STEPS) as u64 * bytes_per_token() / 1024
    );
    Ok((row, note))
}

/// The cache's spec: 4 layers, 2 KV heads of 64, fp16.
fn spec() -> KvSpec {
    KvSpec::new(4, 2, 64, DType::F16).expect("a valid spec")
}

fn bytes_per_token() -> u64 {
    spec().bytes_per_token()
}

/// Puts the KV of `tokens` of the request in slot 0 (its bytes drawn from `seed`).
fn put(engine: &mut LocalSidecar, tokens: std::ops::Range<u32>, seed: u8) -> Result<(), String> {
    let spec = spec();
    let descriptor = ChunkDescriptor {
        source: WorkerId { stage: 1, rank: 0 },
        destination: WorkerId { stage: 1, rank: 0 },
        microbatch: 0,
        region: KvRegion::new(0..spec.layers(), 0..1, 0..spec.kv_heads(), tokens),
        spec,
        packing: Packing::token_major(&spec),
    };
    let payload = SplitMix64::new(u64::from(seed)).bytes(descriptor.payload_len() as usize);
    engine.put(&descriptor, &payload).map_err(|e| e.to_string())
}

/// The resident memory of process `pid`, from `/proc/PID/status`.
fn resident_bytes(pid: u32) -> Result<u64, String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| e.to_string())?;
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .ok_or("no VmRSS line")?;
    Ok(kib * 1024)
}
