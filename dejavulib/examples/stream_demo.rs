//! Streams a prompt's KV cache from a prompt pipeline to a differently shaped token pipeline,
//! through a file tier and through a peer's host buffer over TCP, then checks every byte arrived.
//!
//! Prompt pipeline: 2 stages x TP 2, microbatches of 8, FasterTransformer layout.
//! Token pipeline: 4 stages x TP 1, microbatches of 4, vLLM-style paged layout.
//!
//! Run: `cargo run --release --example stream_demo [-- --tokens N --dir PATH]`

use std::path::PathBuf;
use std::time::Instant;

use dejavulib::file_io::FileBackend;
use dejavulib::layout::{BlockTables, KvInterleave, PagedConfig, PagedOrder};
use dejavulib::net::tcp::TcpTransport;
use dejavulib::net::{ClientConfig, PeerServer, PeerStore, ServerConfig};
use dejavulib::placement::Holding;
use dejavulib::reshard::StreamStats;
use dejavulib::streamer::{Shutdown, StreamerConfig};
use dejavulib::{
    plan_stream_in, plan_stream_out, stream_in, stream_out, ChunkStore, Coord, DType, FileStore, HostStore,
    KvCache, KvLayout, KvSpec, Part, Setup, StageSpec, StagingPool, Streamer, WorkerId,
};

const LAYERS: u32 = 16;
const KV_HEADS: u32 = 8;
const HEAD_DIM: u32 = 128;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (tokens, dir) = parse_args()?;
    let spec = KvSpec::new(LAYERS, KV_HEADS, HEAD_DIM, DType::F16)?;
    let prompt =
        Setup::new(spec, vec![StageSpec { layers: 0..8, tp: 2 }, StageSpec { layers: 8..16, tp: 2 }], 8, 2)?;
    let token = Setup::uniform(spec, 4, 1, 4, 4)?;
    println!(
        "model: {LAYERS} layers, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, fp16 ({} KiB/token); prompt of {tokens} tokens x {} requests",
        spec.bytes_per_token() / 1024,
        prompt.requests()
    );
    println!(
        "prompt pipeline: 2 stages x TP 2, microbatch 8 | token pipeline: 4 stages x TP 1, microbatch 4"
    );

    let sources = build_prompt_caches(&prompt, tokens)?;
    let kv_bytes = spec.bytes_per_token() * tokens as u64 * prompt.requests() as u64;
    let pool = StagingPool::default();
    let dir = dir.unwrap_or_else(|| std::env::temp_dir().join(format!("dejavu-demo-{}", std::process::id())));

    let file_store = FileStore::open(&dir, FileBackend::Auto)?;
    println!("\n[file tier] {} via {}", dir.display(), file_store.backend_name());
    run_transfer(&prompt, &token, &sources, tokens, &pool, Box::new(file_store), kv_bytes)?;
    std::fs::remove_dir_all(&dir)?;

    println!("\n[peer host buffer over TCP] authenticated peer on 127.0.0.1");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let transport = std::sync::Arc::new(TcpTransport::plain());
    let secret = b"demo cluster secret".to_vec();
    let peer = runtime.block_on(PeerServer::bind(
        &*transport,
        "127.0.0.1:0".parse()?,
        ServerConfig::new(secret.clone(), 100),
        HostStore::new(),
    ))?;
    let remote =
        PeerStore::new(runtime.handle().clone(), transport, peer.addr(), ClientConfig::new(secret, 0));
    run_transfer(&prompt, &token, &sources, tokens, &pool, Box::new(remote), kv_bytes)?;

    println!("\n[layer-by-layer streaming] prompt worker (0,0) streams each layer as it is computed");
    layer_by_layer(&prompt, &token, tokens)?;
    Ok(())
}

fn parse_args() -> Result<(u32, Option<PathBuf>), String> {
    let mut tokens = 512;
    let mut dir = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--tokens" => {
                tokens = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&t| t > 0)
                    .ok_or("--tokens needs a positive number")?
            }
            "--dir" => dir = Some(PathBuf::from(args.next().ok_or("--dir needs a path")?)),
            other => return Err(format!("unknown argument {other}; use --tokens N --dir PATH")),
        }
    }
    Ok((tokens, dir))
}

/// The byte every test and demo expects at a global coordinate: never zero.
fn value(part: Part, layer: u32, request: u32, head: u32, token: u32, byte: u32) -> u8 {
    let mut h = (part as u64) << 56
        ^ (layer as u64) << 40
        ^ (request as u64) << 28
        ^ (head as u64) << 20
        ^ (token as u64) << 8
        ^ byte as u64;
    h = h.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ((h >> 56) as u8) | 1
}

fn vector(spec: &KvSpec, part: Part, layer: u32, request: u32, head: u32, token: u32) -> Vec<u8> {
    (0..spec.vector_bytes(part) as u32).map(|b| value(part, layer, request, head, token, b)).collect()
}

type Caches = Vec<(WorkerId, Vec<KvCache>)>;

/// Writes every vector of local `layer` of `cache` (slot `s` holding global request
/// `first_request + s`) with the value function of its global coordinates.
fn fill_layer(
    cache: &KvCache,
    holding: &Holding,
    layer: u32,
    first_request: u32,
    tokens: u32,
) -> Result<(), Box<dyn std::error::Error>> {
    let local = *cache.layout().spec();
    for slot in 0..cache.layout().slots() {
        for head in 0..local.kv_heads() {
            for t in 0..tokens {
                for &part in local.parts() {
                    let global_layer = holding.layers.start + layer;
                    let global_head = holding.heads.start + head;
                    let data = vector(&local, part, global_layer, first_request + slot, global_head, t);
                    cache.write_vector(part, Coord { layer, slot, head, token: t }, &data)?;
                }
            }
        }
    }
    Ok(())
}

fn build_prompt_caches(setup: &Setup, tokens: u32) -> Result<Caches, Box<dyn std::error::Error>> {
    let started = Instant::now();
    let mut out = Vec::new();
    for worker in setup.workers() {
        let holding = setup.holding(worker)?;
        let local = setup.local_spec(worker)?;
        let mut caches = Vec::new();
        for m in 0..setup.microbatches() {
            let cache = KvCache::new(KvLayout::faster_transformer(local, setup.microbatch_slots(), tokens)?)?;
            for layer in 0..local.layers() {
                fill_layer(&cache, &holding, layer, m * setup.microbatch_slots(), tokens)?;
            }
            caches.push(cache);
        }
        out.push((worker, caches));
    }
    println!("filled prompt caches in {:.2?}", started.elapsed());
    Ok(out)
}

fn token_caches(setup: &Setup, tokens: u32) -> Result<Caches, Box<dyn std::error::Error>> {
    let block_size = 16;
    let blocks_per_slot = tokens.div_ceil(block_size);
    let mut out = Vec::new();
    for worker in setup.workers() {
        let local = setup.local_spec(worker)?;
        let slots = setup.microbatch_slots();
        let config = PagedConfig {
            block_size,
            num_blocks: slots * blocks_per_slot,
            order: PagedOrder::Nhd,
            interleave: KvInterleave::Separate,
        };
        // Interleave the slots' blocks so a sequence is not contiguous in the pool.
        let tables: Vec<Vec<u32>> =
            (0..slots).map(|s| (0..blocks_per_slot).map(|b| b * slots + s).collect()).collect();
        let mut caches = Vec::new();
        for _ in 0..setup.microbatches() {
            let tables = BlockTables::from_tables(tables.clone());
            caches.push(KvCache::new(KvLayout::paged(local, slots, config, Some(tables))?)?);
        }
        out.push((worker, caches));
    }
    Ok(out)
}

fn run_transfer(
    a: &Setup,
    b: &Setup,
    sources: &Caches,
    tokens: u32,
    pool: &StagingPool,
    mut store: Box<dyn ChunkStore>,
    kv_bytes: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut out = StreamStats::default();
    let started = Instant::now();
    for (worker, caches) in sources {
        let plan = plan_stream_out(a, *worker, b)?;
        let refs: Vec<&KvCache> = caches.iter().collect();
        let s = stream_out(&refs, &plan, 0..tokens, pool, store.as_mut())?;
        out = sum(out, s);
    }
    let out_wall = started.elapsed();
    let destinations = token_caches(b, tokens)?;
    let mut inn = StreamStats::default();
    let started = Instant::now();
    for (worker, caches) in &destinations {
        let plan = plan_stream_in(a, b, *worker)?;
        let refs: Vec<&KvCache> = caches.iter().collect();
        inn = sum(inn, stream_in(&refs, &plan, 0..tokens, store.as_mut())?);
    }
    let in_wall = started.elapsed();
    let gbps = |bytes: u64, d: std::time::Duration| bytes as f64 / d.as_secs_f64().max(1e-9) / 1e9;
    println!(
        "stream_out: {} chunks, {:.1} MiB in {:.2?} | gather {:.2} GB/s, flush {:.2} GB/s",
        out.chunks,
        out.bytes as f64 / (1 << 20) as f64,
        out_wall,
        gbps(out.bytes, out.copy_time),
        gbps(out.bytes, out.io_time)
    );
    println!(
        "stream_in:  {} chunks, {:.1} MiB in {:.2?} | fetch+verify {:.2} GB/s, scatter {:.2} GB/s",
        inn.chunks,
        inn.bytes as f64 / (1 << 20) as f64,
        in_wall,
        gbps(inn.bytes, inn.io_time),
        gbps(inn.bytes, inn.copy_time)
    );
    let checked = verify(b, &destinations, tokens)?;
    if out.bytes != kv_bytes || inn.bytes != kv_bytes {
        return Err(format!("moved {} / {} bytes, expected {kv_bytes}", out.bytes, inn.bytes).into());
    }
    println!("verified {checked} KV vectors at the token pipeline: every byte in place");
    Ok(())
}

fn sum(a: StreamStats, b: StreamStats) -> StreamStats {
    StreamStats {
        chunks: a.chunks + b.chunks,
        bytes: a.bytes + b.bytes,
        copy_time: a.copy_time + b.copy_time,
        io_time: a.io_time + b.io_time,
    }
}

fn verify(setup: &Setup, caches: &Caches, tokens: u32) -> Result<u64, Box<dyn std::error::Error>> {
    let mut checked = 0;
    for (worker, per_mb) in caches {
        let holding = setup.holding(*worker)?;
        let local = setup.local_spec(*worker)?;
        for (m, cache) in per_mb.iter().enumerate() {
            for layer in 0..local.layers() {
                for slot in 0..setup.microbatch_slots() {
                    for head in 0..local.kv_heads() {
                        for t in 0..tokens {
                            for &part in local.parts() {
                                let mut got = vec![0u8; local.vector_bytes(part) as usize];
                                cache.read_vector(part, Coord { layer, slot, head, token: t }, &mut got)?;
                                let request = m as u32 * setup.microbatch_slots() + slot;
                                let want = vector(
                                    &local,
                                    part,
                                    holding.layers.start + layer,
                                    request,
                                    holding.heads.start + head,
                                    t,
                                );
                                if got != want {
                                    return Err(format!("{worker:?} mb {m} layer {layer} slot {slot} head {head} token {t} {part:?} differs").into());
                                }
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(checked)
}

fn layer_by_layer(a: &Setup, b: &Setup, tokens: u32) -> Result<(), Box<dyn std::error::Error>> {
    let worker = WorkerId { stage: 0, rank: 0 };
    let local = a.local_spec(worker)?;
    let holding = a.holding(worker)?;
    let plan = plan_stream_out(a, worker, b)?;
    let store = HostStore::new();
    let streamer = Streamer::spawn(StreamerConfig::default(), Box::new(store.clone()))?;
    let cache = std::sync::Arc::new(KvCache::new(KvLayout::faster_transformer(
        local,
        a.microbatch_slots(),
        tokens,
    )?)?);
    let started = Instant::now();
    let mut pending = Vec::new();
    for layer in 0..local.layers() {
        // "Compute" the layer: write its KV, then hand it to the streamer and go on.
        fill_layer(&cache, &holding, layer, 0, tokens)?;
        pending.extend(streamer.layer_ready(&cache, &plan, 0, layer, 0..tokens)?);
    }
    let compute = started.elapsed();
    let mut bytes = 0;
    for c in pending {
        bytes += c.wait()?.bytes;
    }
    let total = started.elapsed();
    let stats = streamer.shutdown(Shutdown::Drain)?;
    println!(
        "{} layers computed in {compute:.2?}; {} chunks ({:.1} MiB) streamed meanwhile; all delivered {:.2?} after start ({} chunks in the peer store)",
        local.layers(),
        stats.completed,
        bytes as f64 / (1 << 20) as f64,
        total,
        store.len()
    );
    Ok(())
}
