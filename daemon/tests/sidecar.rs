//! The sidecar as a real process: an engine's chunks cross shared memory, are kept and forwarded to
//! a real successor over TCP, come back through shared memory; a newer engine takes the sidecar
//! over and an older one is refused; a successor from another cluster is refused (the local copy
//! is kept); a shared-memory file of the wrong size stops an engine with a clear error.

use std::io::{BufRead, BufReader, BufWriter, Write};
use std::net::SocketAddr;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use dejavud::heartbeat::decode;
use dejavud::sidecar::control::{ControlError, SidecarControl};
use dejavulib::chunk::{ChunkDescriptor, SequencePlace, HEADER_LEN};
use dejavulib::local::{LocalError, LocalSidecar, Successor};
use dejavulib::memory::StagingPool;
use dejavulib::net::tcp::TcpTransport;
use dejavulib::net::{PeerServer, ServerConfig};
use dejavulib::reshard::{send, Transfer};
use dejavulib::resume::{resume_points, HeldChunk};
use dejavulib::store::{Started, StoreError};
use dejavulib::streamer::{Shutdown, StreamJob};
use dejavulib::wire::{read_frame, write_frame, FrameHeader, Kind};
use dejavulib::{
    ChunkStore, DType, HostStore, KvCache, KvLayout, KvRegion, KvSpec, Packing, Streamer, StreamerConfig,
    WorkerId,
};
use std::time::Duration;

const EXE: &str = env!("CARGO_BIN_EXE_dejavud");
const SECRET: &str = "dejavu reference cluster";

/// A child process, killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a sidecar with its local socket and regions in `dir`, forwarding its engine's KV.
fn sidecar(dir: &Path) -> (Killed, PathBuf) {
    let (sidecar, socket, _) = sidecar_with_region(dir, 65536);
    (sidecar, socket)
}

/// Starts a sidecar of stage 1 whose shared regions hold `region_bytes`; returns it, its local
/// socket and its transport's address.
fn sidecar_with_region(dir: &Path, region_bytes: usize) -> (Killed, PathBuf, SocketAddr) {
    start_sidecar(dir, &["--index", "1", "--region-bytes", &region_bytes.to_string()])
}

/// Starts `sidecar FLAGS` with its local socket and regions in `dir`; returns it, its local
/// socket and its transport's address.
fn start_sidecar(dir: &Path, flags: &[&str]) -> (Killed, PathBuf, SocketAddr) {
    let (sidecar, socket, addr, _) = start_sidecar_serving(dir, flags);
    (sidecar, socket, addr)
}

/// As [`start_sidecar`], with where it serves its metrics if `flags` ask for them (`--metrics`).
fn start_sidecar_serving(dir: &Path, flags: &[&str]) -> (Killed, PathBuf, SocketAddr, Option<SocketAddr>) {
    let socket = dir.join("sidecar.sock");
    let mut child = Command::new(EXE)
        .arg("sidecar")
        .args(flags)
        .arg(format!("--local={}", socket.display()))
        .arg(format!("--shm-dir={}", dir.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    lines.read_line(&mut line).unwrap();
    let metrics = line.trim().strip_prefix("metrics ").map(|a| a.parse().unwrap());
    if metrics.is_some() {
        line.clear();
        lines.read_line(&mut line).unwrap();
    }
    let addr = line.strip_prefix("listening ").and_then(|a| a.trim().parse().ok());
    let addr = addr.unwrap_or_else(|| panic!("not a listening line: {line:?}"));
    (Killed(child), socket, addr, metrics)
}

/// A ring successor's sidecar transport in this process, keeping what it is sent in `store`.
fn successor(runtime: &tokio::runtime::Runtime, store: &HostStore) -> PeerServer {
    runtime
        .block_on(PeerServer::bind(
            &TcpTransport::plain(),
            "127.0.0.1:0".parse().unwrap(),
            ServerConfig::new(SECRET, 2),
            store.clone(),
        ))
        .unwrap()
}

/// The prompt of `tokens` tokens of one layer and head of a request in slot `seed` (each its own
/// slot, so that none replaces another), as stage 1 of microbatch 0 would flush it.
fn chunk(tokens: u32, seed: u8) -> (ChunkDescriptor, Vec<u8>) {
    chunk_in(u32::from(seed), 0..tokens, seed)
}

/// As [`chunk`], of tokens `tokens` of the request in slot 0.
fn chunk_of(tokens: std::ops::Range<u32>, seed: u8) -> (ChunkDescriptor, Vec<u8>) {
    chunk_in(0, tokens, seed)
}

/// As [`chunk`], of tokens `tokens` of the request in slot `slot`.
fn chunk_in(slot: u32, tokens: std::ops::Range<u32>, seed: u8) -> (ChunkDescriptor, Vec<u8>) {
    let spec = KvSpec::new(1, 1, 4, DType::F32).unwrap();
    let descriptor = ChunkDescriptor {
        source: WorkerId { stage: 1, rank: 0 },
        destination: WorkerId { stage: 1, rank: 0 },
        microbatch: 0,
        region: KvRegion::new(0..1, slot..slot + 1, 0..1, tokens),
        spec,
        packing: Packing::token_major(&spec),
    };
    let len = descriptor.payload_len() as usize;
    (descriptor, (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect())
}

#[test]
fn chunks_cross_shared_memory_are_kept_and_forwarded() {
    let dir = tempfile::tempdir().unwrap();
    let (_sidecar, socket) = sidecar(dir.path());
    // The successor: a real sidecar transport in this process.
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let successor_store = HostStore::new();
    let successor = successor(&runtime, &successor_store);

    let mut engine = LocalSidecar::connect(&socket, 0, successor.addr()).unwrap();
    let (prompt, prompt_kv) = chunk(100, 1);
    engine.put(&prompt, &prompt_kv).unwrap();
    let (token, token_kv) = chunk(1, 2);
    engine.put(&token, &token_kv).unwrap();
    // Kept: it comes back through shared memory, byte for byte.
    let mut out = Vec::new();
    assert_eq!(engine.get(&prompt.key(), &mut out).unwrap(), prompt);
    assert_eq!(out, prompt_kv);
    // Forwarded: the successor holds both.
    let mut replica = successor_store.clone();
    assert_eq!(replica.get(&token.key(), &mut out).unwrap(), token);
    assert_eq!(out, token_kv);
    assert_eq!(successor_store.len(), 2);
    // The region file is gone once both sides mapped it.
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(left, ["sidecar.sock"], "{left:?}");
    // A chunk too large for the region is a typed error, and the connection goes on.
    let (huge, huge_kv) = chunk(5000, 3);
    let too_large = engine.put(&huge, &huge_kv);
    assert!(matches!(too_large, Err(StoreError::Io { .. })), "{too_large:?}");
    let message = too_large.unwrap_err().to_string();
    assert!(message.contains("--region-bytes"), "the error says how to make room: {message}");
    let (missing, _) = chunk(7, 4);
    assert!(matches!(engine.get(&missing.key(), &mut out), Err(StoreError::NotFound(_))));

    // A replacement engine (a newer epoch) takes the sidecar over, still finds the KV, and the
    // old engine's connection is closed.
    let mut replacement = LocalSidecar::connect(&socket, 3, successor.addr()).unwrap();
    assert_eq!(replacement.get(&prompt.key(), &mut out).unwrap(), prompt);
    assert!(engine.put(&token, &token_kv).is_err(), "the fenced engine is cut off");
    // An engine from an older epoch (back from a pause) is refused.
    match LocalSidecar::connect(&socket, 2, successor.addr()) {
        Err(LocalError::Protocol(reason)) => assert!(reason.contains("older"), "{reason}"),
        other => panic!("a stale engine: {:?}", other.err()),
    }
    replacement.put(&token, &token_kv).unwrap();
}

#[test]
fn a_region_gathered_straight_into_shared_memory_is_kept_and_forwarded_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let (_sidecar, socket, _) = sidecar_with_region(dir.path(), 1 << 20);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let successor_store = HostStore::new();
    let successor = successor(&runtime, &successor_store);
    let mut engine = LocalSidecar::connect(&socket, 0, successor.addr()).unwrap();

    // A cache whose every byte differs from its neighbours', so a misplaced byte shows.
    let spec = KvSpec::new(4, 4, 32, DType::F16).unwrap();
    let cache = KvCache::new(KvLayout::faster_transformer(spec, 4, 64).unwrap()).unwrap();
    let all = KvRegion::new(0..4, 0..4, 0..4, 0..64);
    let packing = cache.layout().preferred_packing();
    let pattern: Vec<u8> = (0..cache.packed_len(&all)).map(|i| (i * 7 + i / 253) as u8).collect();
    cache.scatter(&all, packing, &pattern).unwrap();

    // A prompt of two sequences (larger than one gathered piece) and a decode step of all four.
    let worker = WorkerId { stage: 1, rank: 0 };
    for region in [KvRegion::new(0..4, 1..3, 0..4, 0..60), KvRegion::new(0..4, 0..4, 0..4, 60..61)] {
        let transfer = Transfer::in_place(worker, worker, 0, &region);
        let receipt =
            send(&cache, &transfer, region.tokens.clone(), &StagingPool::default(), &mut engine).unwrap();
        assert_eq!(receipt.copy_time, Duration::ZERO, "gathered as part of the put");
        let mut want = vec![0; cache.packed_len(&region) as usize];
        cache.gather(&region, packing, &mut want).unwrap();
        let mut got = Vec::new();
        engine.get(&receipt.key, &mut got).unwrap();
        assert_eq!(got, want, "kept as gathered");
        successor_store.clone().get(&receipt.key, &mut got).unwrap();
        assert_eq!(got, want, "forwarded as gathered");
    }

    // A plan of another shape of region is refused before anything is written.
    let region = KvRegion::new(0..4, 0..1, 0..4, 0..8);
    let transfer = Transfer::in_place(worker, worker, 0, &region);
    let other = cache.gather_plan(&KvRegion::new(0..4, 1..2, 0..4, 0..4), packing).unwrap();
    let descriptor = ChunkDescriptor {
        source: worker,
        destination: worker,
        microbatch: 0,
        region: transfer.to.with_tokens(0..8),
        spec: cache.layout().spec().share(4, 4).unwrap(),
        packing,
    };
    let mut staging = vec![0; cache.packed_len(&region) as usize];
    let refused = engine.put_gathered(&descriptor, &cache, &other, &mut staging);
    assert!(matches!(refused, Err(StoreError::Chunk { .. })), "{refused:?}");
}

#[test]
fn chunks_a_successor_missed_while_down_reach_it_once_it_is_back_and_keep_is_not_forwarded() {
    let dir = tempfile::tempdir().unwrap();
    let (_sidecar, socket) = sidecar(dir.path());
    // A successor address nobody listens on yet.
    let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let mut engine = LocalSidecar::connect(&socket, 0, addr).unwrap();
    let (first, first_kv) = chunk(10, 6);
    assert!(engine.put(&first, &first_kv).is_err(), "the forward failed");
    // The successor comes up there; the next put forwards the one it missed first.
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let successor_store = HostStore::new();
    let _successor = runtime
        .block_on(PeerServer::bind(
            &TcpTransport::plain(),
            addr,
            ServerConfig::new(SECRET, 2),
            successor_store.clone(),
        ))
        .unwrap();
    let (second, second_kv) = chunk(11, 7);
    engine.put(&second, &second_kv).unwrap();
    let mut out = Vec::new();
    let mut replica = successor_store.clone();
    assert_eq!(replica.get(&first.key(), &mut out).unwrap(), first);
    assert_eq!(out, first_kv);
    assert_eq!(replica.get(&second.key(), &mut out).unwrap(), second);
    // Chunks handed over to keep (restored from that replica) are kept and not forwarded.
    let (third, third_kv) = chunk(12, 8);
    let encoded = [third.encode_header(&third_kv).to_vec(), third_kv.clone()].concat();
    engine.keep(&[&encoded]).unwrap();
    assert_eq!(engine.get(&third.key(), &mut out).unwrap(), third);
    assert_eq!(out, third_kv);
    assert_eq!(successor_store.len(), 2, "kept chunks are not forwarded");
    // A chunk that does not match its checksum is refused.
    let mut bad = encoded.clone();
    *bad.last_mut().unwrap() ^= 1;
    assert!(engine.keep(&[&bad]).is_err());
}

#[test]
fn a_new_successor_named_on_a_connection_of_its_own_takes_effect_and_a_stale_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (_sidecar, socket) = sidecar(dir.path());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (old_store, new_store) = (HostStore::new(), HostStore::new());
    let (old, new) = (successor(&runtime, &old_store), successor(&runtime, &new_store));
    let mut engine = LocalSidecar::connect(&socket, 2, old.addr()).unwrap();
    let (first, first_kv) = chunk(3, 9);
    engine.put(&first, &first_kv).unwrap();
    // An engine older than the one in use cannot move its forwards.
    match LocalSidecar::retarget_now(&socket, new.addr(), 1) {
        Err(LocalError::Protocol(reason)) => assert!(reason.contains("older"), "{reason}"),
        other => panic!("a stale retarget: {other:?}"),
    }
    LocalSidecar::retarget_now(&socket, new.addr(), 2).unwrap();
    let (second, second_kv) = chunk(4, 10);
    engine.put(&second, &second_kv).unwrap();
    assert_eq!((old_store.len(), new_store.len()), (1, 1), "the second chunk went to the new successor");
}

#[test]
fn a_successor_pointed_at_the_controller_says_so_and_the_local_copy_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let (_sidecar, socket) = sidecar(dir.path());
    let config = dejavud::controller::ControllerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        store: dejavud::controller::StoreConfig::File(dir.path().join("controller.state")),
        leaving: dejavud::controller::Leaving::default(),
        timeout: Duration::from_millis(300),
        interval: Duration::from_millis(100),
        metrics: None,
        secret: dejavud::cli::DEFAULT_SECRET.as_bytes().to_vec(),
        journal: None,
        stages: None,
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        dejavud::controller::serve_controller(config, |addr, _| tx.send(addr).unwrap())
    });
    let controller = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let mut engine = LocalSidecar::connect(&socket, 0, controller).unwrap();
    let (token, token_kv) = chunk(1, 6);
    let error = engine.put(&token, &token_kv).unwrap_err().to_string();
    assert!(error.contains("the DéjàVu controller's query port") && error.contains("--listen"), "{error}");
    let mut out = Vec::new();
    assert_eq!(engine.get(&token.key(), &mut out).unwrap(), token, "kept locally all the same");
}

#[test]
fn a_successor_from_another_cluster_is_refused_and_the_local_copy_kept() {
    let dir = tempfile::tempdir().unwrap();
    let (_sidecar, socket) = sidecar(dir.path());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let foreign_store = HostStore::new();
    let foreign = runtime
        .block_on(PeerServer::bind(
            &TcpTransport::plain(),
            "127.0.0.1:0".parse().unwrap(),
            ServerConfig::new("another cluster's secret", 2),
            foreign_store.clone(),
        ))
        .unwrap();
    let mut engine = LocalSidecar::connect(&socket, 0, foreign.addr()).unwrap();
    let (token, token_kv) = chunk(1, 5);
    let error = engine.put(&token, &token_kv).unwrap_err().to_string();
    assert!(error.contains("authentication"), "{error}");
    assert_eq!(foreign_store.len(), 0, "nothing reached the other cluster");
    // The local copy was kept all the same.
    let mut out = Vec::new();
    assert_eq!(engine.get(&token.key(), &mut out).unwrap(), token);
    assert_eq!(out, token_kv);
}

#[test]
fn a_shared_memory_file_of_the_wrong_size_stops_the_engine_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    // A sidecar that announces a region of 65536 bytes but hands over a shorter file.
    let socket = dir.path().join("liar.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let region = dir.path().join("region");
    std::fs::write(&region, vec![0u8; 1000]).unwrap();
    let announced = region.clone();
    let liar = std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let hello = read_frame(&mut reader, 1 << 16).unwrap().unwrap();
        assert_eq!(hello.header.kind, Kind::Hello);
        let mut welcome = FrameHeader::new(Kind::Welcome, 1, hello.header.epoch, hello.header.request);
        welcome.ids = [65536, 0, 0, 0];
        let mut writer = BufWriter::new(stream);
        write_frame(&mut writer, &welcome, announced.display().to_string().as_bytes()).unwrap();
        writer.flush().unwrap();
        // Wait for the engine to go away.
        let _ = read_frame(&mut reader, 1 << 16);
    });
    let next: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let out = Command::new(EXE)
        .args(["stage", "--index", "0", "--layers", "0..8", "--listen", "127.0.0.1:0"])
        .arg(format!("--next={next}"))
        .arg(format!("--local={}", socket.display()))
        .arg("--successor=127.0.0.1:9")
        .stdout(Stdio::null())
        .output()
        .unwrap();
    liar.join().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is 1000 bytes, not the 65600 announced"), "{err}");
    assert_eq!(std::fs::read(&region).unwrap(), vec![0u8; 1000], "the file is left as it was");
}

/// A chunk of stage 1's KV (4 layers, 2 heads) for slot `slot` of microbatch 0 and `tokens`, as
/// the engine flushes a prompt or a step, with its bytes encoded (header, then payload).
fn step_chunk(slot: u32, tokens: std::ops::Range<u32>) -> (ChunkDescriptor, Vec<u8>) {
    let spec = KvSpec::new(4, 2, 4, DType::F32).unwrap();
    let descriptor = ChunkDescriptor {
        source: WorkerId { stage: 1, rank: 0 },
        destination: WorkerId { stage: 1, rank: 0 },
        microbatch: 0,
        region: KvRegion::new(0..4, slot..slot + 1, 0..2, tokens.clone()),
        spec,
        packing: Packing::token_major(&spec),
    };
    let len = descriptor.payload_len() as usize;
    let seed = slot.wrapping_mul(7919) ^ tokens.start.wrapping_mul(104_729);
    let payload: Vec<u8> = (0..len).map(|i| (i as u32).wrapping_mul(31).wrapping_add(seed) as u8).collect();
    (descriptor, payload)
}

#[test]
fn a_restarted_engine_learns_what_its_sidecar_keeps_and_where_each_sequence_resumes() {
    let dir = tempfile::tempdir().unwrap();
    // A small region: the keys come back in several pages.
    let (_sidecar, socket, sidecar_addr) = sidecar_with_region(dir.path(), 4096);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let successor = successor(&runtime, &HostStore::new());

    // Slot 0: a prompt of 5 tokens, then 120 steps. Slot 1: a prompt, 125 steps, a lost step,
    // and one more: it can resume only before the gap.
    let mut engine = LocalSidecar::connect(&socket, 1, successor.addr()).unwrap();
    let mut chunks = vec![step_chunk(0, 0..5), step_chunk(1, 0..5)];
    chunks.extend((5..125).map(|t| step_chunk(0, t..t + 1)));
    chunks.extend((5..130).map(|t| step_chunk(1, t..t + 1)));
    chunks.push(step_chunk(1, 131..132));
    for (descriptor, payload) in &chunks[..4] {
        engine.put(descriptor, payload).unwrap();
    }
    let encoded: Vec<Vec<u8>> =
        chunks[4..].iter().map(|(d, p)| [d.encode_header(p).to_vec(), p.clone()].concat()).collect();
    engine.keep(&encoded.iter().map(Vec::as_slice).collect::<Vec<_>>()).unwrap();
    // The predecessor's replica, received over the network, is not this stage's to restore.
    let mut predecessor = step_chunk(0, 0..5);
    predecessor.0.destination.stage = 0;
    predecessor.0.source.stage = 0;
    let mut config = dejavulib::net::ClientConfig::new(SECRET, 0);
    config.epoch = 0;
    let mut peer = dejavulib::net::PeerStore::new(
        runtime.handle().clone(),
        std::sync::Arc::new(TcpTransport::plain()),
        sidecar_addr,
        config,
    );
    peer.put(&predecessor.0, &predecessor.1).unwrap();
    drop(engine);

    // The engine restarts, in a newer epoch, beside the sidecar that survived.
    let mut restarted = LocalSidecar::connect(&socket, 2, successor.addr()).unwrap();
    let recovery = restarted.recovery().unwrap();
    let serving = &recovery.serving;
    assert_eq!((serving.stage, serving.epoch, serving.successor), (1, 2, Some(successor.addr())));
    assert_eq!(restarted.serving().unwrap(), *serving);
    assert_eq!(recovery.held.len(), chunks.len(), "every own chunk, over several pages");
    assert!(recovery.held.iter().all(|h| h.key.destination.stage == 1), "no replica of the predecessor");
    let points = recovery.resume_points();
    let summary: Vec<(u32, u32, usize)> =
        points.iter().map(|p| (p.slots.start, p.tokens, p.chunks.len())).collect();
    assert_eq!(summary, [(0, 125, 121), (1, 130, 126)]);
    // Each chunk named comes back byte for byte.
    let mut out = Vec::new();
    for point in &points {
        for region in &point.chunks {
            let (descriptor, payload) = step_chunk(point.slots.start, region.tokens.clone());
            let key = dejavulib::chunk::ChunkKey {
                destination: point.destination,
                microbatch: point.microbatch,
                region: region.clone(),
            };
            assert_eq!(restarted.get(&key, &mut out).unwrap(), descriptor);
            assert_eq!(out, payload);
        }
    }
    // A new request's prompt in slot 0: the old request's chunks there are dropped, slot 1's
    // stay.
    let (prompt, prompt_kv) = step_chunk(0, 0..3);
    restarted.put(&prompt, &prompt_kv).unwrap();
    let summary: Vec<(u32, u32, usize)> = restarted
        .recovery()
        .unwrap()
        .resume_points()
        .iter()
        .map(|p| (p.slots.start, p.tokens, p.chunks.len()))
        .collect();
    assert_eq!(summary, [(0, 3, 1), (1, 130, 126)]);
}

#[test]
fn a_spare_sidecar_has_no_stage_to_tell_until_it_is_assigned() {
    let dir = tempfile::tempdir().unwrap();
    let (_spare, socket, _) = start_sidecar(dir.path(), &["--spare", "3", "--region-bytes", "65536"]);
    let nowhere: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let mut engine = LocalSidecar::connect(&socket, 1, nowhere).unwrap();
    match engine.serving() {
        Err(LocalError::Protocol(reason)) => assert!(reason.contains("not assigned"), "{reason}"),
        other => panic!("an unassigned spare answered {other:?}"),
    }
    // Assigned to stage 2 by the recovery of epoch 7: it says so, with that epoch.
    dejavud::spare::assign_sidecar(&socket, 2, 7, std::time::Duration::from_secs(5)).unwrap();
    let serving = engine.serving().unwrap();
    assert_eq!((serving.stage, serving.epoch), (2, 7));
}

#[test]
fn the_control_listener_its_heartbeats_name_lists_what_it_holds_and_reseeds_a_new_successor() {
    let dir = tempfile::tempdir().unwrap();
    let (_sidecar, socket, control) = sidecar_under_control(dir.path());

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (first_store, second_store) = (HostStore::new(), HostStore::new());
    let (first, second) = (successor(&runtime, &first_store), successor(&runtime, &second_store));
    let mut engine = LocalSidecar::connect(&socket, 0, first.addr()).unwrap();
    let chunks: Vec<_> =
        [(100, 1), (1, 2), (2, 3)].into_iter().map(|(tokens, seed)| chunk(tokens, seed)).collect();
    for (descriptor, kv) in &chunks {
        engine.put(descriptor, kv).unwrap();
    }
    assert!(control.held_of(0).unwrap().is_empty(), "nothing for another stage");
    let held = control.held_of(1).unwrap();
    let mut keys: Vec<_> = held.iter().map(|h| h.key.clone()).collect();
    keys.sort_by_key(|k| k.encode());
    let mut expected: Vec<_> = chunks.iter().map(|(d, _)| d.key()).collect();
    expected.sort_by_key(|k| k.encode());
    assert_eq!(keys, expected);
    // Asked for page after page, the listing is the same, in the order of the keys.
    for page in [1, 2, 3] {
        assert_eq!(control.clone().with_page(page).held_of(1).unwrap(), held, "pages of {page}");
    }
    assert_eq!(keys, held.iter().map(|h| h.key.clone()).collect::<Vec<_>>(), "in key order");

    // Re-seeded: the new successor gets every chunk, in the order they were put, and the
    // engine's next chunk goes there too.
    assert_eq!(control.reseed(second.addr()).unwrap(), 3);
    let mut out = Vec::new();
    for (descriptor, kv) in &chunks {
        assert_eq!(second_store.clone().get(&descriptor.key(), &mut out).unwrap(), *descriptor);
        assert_eq!(out, *kv);
    }
    let order: Vec<_> = second_store.keys().into_iter().map(|(key, put)| (put, key)).collect();
    let mut by_put = order.clone();
    by_put.sort_by_key(|(put, _)| *put);
    let firsts: Vec<_> = by_put.iter().map(|(_, key)| key.clone()).collect();
    let puts_in_order: Vec<_> = chunks.iter().map(|(d, _)| d.key()).collect();
    assert_eq!(firsts, puts_in_order, "the new successor saw them in put order");
    let (later, later_kv) = chunk(3, 4);
    engine.put(&later, &later_kv).unwrap();
    assert_eq!(second_store.len(), 4);
    assert_eq!(first_store.len(), 3, "the old successor gets nothing more");

    // A client that cannot prove the cluster secret is refused before any request is read.
    let stranger = SidecarControl::new(control.addr(), Duration::from_secs(10), b"another cluster's secret");
    assert!(matches!(stranger.held_of(1), Err(ControlError::Auth { .. })), "a stranger lists nothing");
    assert!(matches!(stranger.reseed(second.addr()), Err(ControlError::Auth { .. })));
    assert_eq!(second_store.len(), 4, "and redirects nothing");

    // Garbage is refused with a reason, not a crash.
    let unreachable = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    assert!(control.reseed(unreachable).is_err(), "a successor nobody serves");
    assert!(!control.held_of(1).unwrap().is_empty(), "still serving");
}

/// Starts a sidecar of stage 1 beating to a controller played by this test; returns it, its local
/// socket and a client of the control listener its heartbeats name.
fn sidecar_under_control(dir: &Path) -> (Killed, PathBuf, SidecarControl) {
    // The controller's side of the heartbeats: a UDP socket of this test.
    let beats = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    beats.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let heartbeat = format!("--heartbeat={}", beats.local_addr().unwrap());
    let (sidecar, socket, _) = start_sidecar(dir, &["--index", "1", "--heartbeat-ms", "20", &heartbeat]);
    let mut datagram = [0u8; 256];
    let (n, from) = beats.recv_from(&mut datagram).unwrap();
    let beat = decode(&datagram[..n], SECRET.as_bytes()).expect("a heartbeat");
    let port = beat.control_port.expect("a sidecar's beats name its control listener");
    let control = SocketAddr::new(from.ip(), port);
    (sidecar, socket, SidecarControl::new(control, Duration::from_secs(10), SECRET.as_bytes()))
}

#[test]
fn a_reseeded_successor_finds_the_same_resume_points_though_the_steps_between_starts_travel_together() {
    let dir = tempfile::tempdir().unwrap();
    let (_sidecar, socket, control) = sidecar_under_control(dir.path());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (first_store, second_store) = (HostStore::new(), HostStore::new());
    let (first, second) = (successor(&runtime, &first_store), successor(&runtime, &second_store));
    let mut engine = LocalSidecar::connect(&socket, 0, first.addr()).unwrap();
    // A request of a 5-token prompt and 8 steps in slot 0, then a shorter one in the same slot:
    // the first's later steps are stale, and must arrive before the second's start to stay so.
    let first_request = [0..5, 5..6, 6..7, 7..8, 8..9, 9..10, 10..11, 11..12, 12..13];
    let second_request = [0..3, 3..4, 4..5, 5..6];
    for (i, tokens) in first_request.into_iter().chain(second_request).enumerate() {
        let (descriptor, kv) = chunk_of(tokens, i as u8);
        engine.put(&descriptor, &kv).unwrap();
    }
    let source = resume_points(&control.held_of(1).unwrap());
    assert_eq!(source.len(), 1);
    assert_eq!(source[0].tokens, 6, "the second request's KV, not the first's stale steps");

    // Every chunk it keeps goes: the second request's 4 (its start dropped the first's).
    assert_eq!(control.reseed(second.addr()).unwrap(), 4);
    let held: Vec<HeldChunk> =
        second_store.keys().into_iter().map(|(key, put)| HeldChunk { key, put }).collect();
    assert_eq!(resume_points(&held), source, "the new successor resumes where this sidecar does");
}

#[test]
fn a_new_request_in_a_slot_drops_the_old_ones_chunks_and_the_gauges_say_what_is_held() {
    let dir = tempfile::tempdir().unwrap();
    let (_sidecar, socket, _, metrics) =
        start_sidecar_serving(dir.path(), &["--index", "1", "--metrics", "127.0.0.1:0"]);
    let metrics = metrics.expect("it serves metrics");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let successor_store = HostStore::new();
    let successor = successor(&runtime, &successor_store);
    let mut engine = LocalSidecar::connect(&socket, 0, successor.addr()).unwrap();
    // A request in slot 0 (a 5-token prompt, two steps), then the next one in the same slot.
    for (i, tokens) in [0..5, 5..6, 6..7, 0..3].into_iter().enumerate() {
        let (descriptor, kv) = chunk_of(tokens, i as u8);
        engine.put(&descriptor, &kv).unwrap();
    }
    let (kept, kept_kv) = chunk_of(0..3, 3);
    let mut out = Vec::new();
    assert_eq!(engine.get(&kept.key(), &mut out).unwrap(), kept);
    let (old, _) = chunk_of(5..6, 1);
    assert!(
        matches!(engine.get(&old.key(), &mut out), Err(StoreError::NotFound(_))),
        "the old request's step"
    );
    let page = dejavud::metrics::scrape(metrics).unwrap();
    let value = |name: &str, role: Option<&str>| {
        let labels: Vec<(&str, &str)> = role.map(|r| ("role", r)).into_iter().collect();
        dejavud::metrics::value_of(&page, name, &labels).unwrap_or_else(|| panic!("no {name}: {page}"))
    };
    assert_eq!(value("dejavu_sidecar_held_chunks", Some("own")), 1.0);
    assert_eq!(value("dejavu_sidecar_held_chunks", Some("replica")), 0.0);
    let encoded = (kept.encode_header(&kept_kv).len() + kept_kv.len()) as f64;
    assert_eq!(value("dejavu_sidecar_held_bytes", Some("own")), encoded);
    assert_eq!(value("dejavu_sidecar_replaced_chunks_total", None), 3.0);
    // The successor (a plain store here) got every forward; a sidecar there drops the same ones.
    assert_eq!(successor_store.len(), 4);

    // Small chunks' buffers go back to the allocator; a dropped prompt of 64 KiB or more leaves
    // its buffer waiting for the next chunk of its size.
    assert_eq!(value("dejavu_sidecar_pooled_bytes", None), 0.0);
    let (long, long_kv) = chunk_of(0..3000, 4);
    engine.put(&long, &long_kv).unwrap();
    let (next, next_kv) = chunk_of(0..4, 5);
    engine.put(&next, &next_kv).unwrap();
    let page = dejavud::metrics::scrape(metrics).unwrap();
    let pooled = dejavud::metrics::value_of(&page, "dejavu_sidecar_pooled_bytes", &[]).unwrap();
    assert!(pooled >= long_kv.len() as f64, "{pooled} bytes pooled: {page}");
}

/// An engine that finished a sequence releases it: its sidecar drops the sequence's chunks and
/// its successor drops the replica, others stay; a second release drops nothing and succeeds.
#[test]
fn a_released_sequence_is_dropped_here_and_at_the_replica_and_releasing_again_is_harmless() {
    let dir = tempfile::tempdir().unwrap();
    let (_sidecar, socket, _, metrics) =
        start_sidecar_serving(dir.path(), &["--index", "1", "--metrics", "127.0.0.1:0"]);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let successor_store = HostStore::new();
    let successor = successor(&runtime, &successor_store);
    let mut engine = LocalSidecar::connect(&socket, 0, successor.addr()).unwrap();
    // Requests in slots 0, 1 and 2: a prompt and a step each.
    for slot in 0..3 {
        for tokens in [0..4, 4..5] {
            let (descriptor, kv) = chunk_in(slot, tokens, slot as u8);
            engine.put(&descriptor, &kv).unwrap();
        }
    }
    let place = |slots| SequencePlace { destination: WorkerId { stage: 1, rank: 0 }, microbatch: 0, slots };
    assert_eq!(engine.release(&place(1..2)).unwrap(), 2, "the prompt and the step of slot 1");
    let mut out = Vec::new();
    for slot in 0..3 {
        let (descriptor, _) = chunk_in(slot, 4..5, slot as u8);
        let here = engine.get(&descriptor.key(), &mut out);
        let replica = successor_store.encoded_len(&descriptor.key());
        if slot == 1 {
            assert!(matches!(here, Err(StoreError::NotFound(_))), "released here");
            assert!(replica.is_none(), "released at the replica");
        } else {
            assert!(here.is_ok() && replica.is_some(), "slot {slot} is kept");
        }
    }
    assert_eq!(successor_store.len(), 4);
    assert_eq!(engine.release(&place(1..2)).unwrap(), 0, "released already");
    // Another worker's place, or another microbatch, holds nothing of this one.
    let elsewhere = SequencePlace { microbatch: 1, ..place(0..3) };
    assert_eq!(engine.release(&elsewhere).unwrap(), 0);
    let page = dejavud::metrics::scrape(metrics.expect("it serves metrics")).unwrap();
    let value = |name: &str| dejavud::metrics::value_of(&page, name, &[]).unwrap_or_else(|| panic!("{page}"));
    assert_eq!(value("dejavu_sidecar_released_chunks_total"), 2.0);
    assert_eq!(value("dejavu_sidecar_replaced_chunks_total"), 0.0);
}

/// Issue-sized traffic through a ring of two real sidecars: 240 requests one after another in
/// partly overlapping slot ranges, each a prompt of a random length and a few decode steps, with
/// the successor paused under load and the engine restarted (and restoring) in the middle. After
/// every request, what each sidecar holds of the engine's KV (its own copy, the successor's
/// replica) stays within the engine's cache, and the restore is bit-identical.
#[test]
fn held_kv_stays_within_the_cache_over_many_requests_of_random_lengths_through_a_pause_and_a_restart() {
    const SLOTS: u32 = 4;
    const MAX_TOKENS: u32 = 64;
    let (here, there) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let metrics = ["--metrics", "127.0.0.1:0"];
    let (_own, socket, _, own_metrics) =
        start_sidecar_serving(here.path(), &[&["--index", "1"][..], &metrics].concat());
    let (replica, _, replica_addr, replica_metrics) =
        start_sidecar_serving(there.path(), &[&["--index", "2"][..], &metrics].concat());
    let (own_metrics, replica_metrics) = (own_metrics.unwrap(), replica_metrics.unwrap());
    // KV bytes the engine's cache holds (every slot full), and what one token of one slot takes.
    let (descriptor, _) = chunk_in(0, 0..1, 0);
    let per_token = descriptor.payload_len();
    let cache_bytes = u64::from(SLOTS * MAX_TOKENS) * per_token;
    // The KV a sidecar holds of stage 1, without the chunk headers.
    let held = |at: SocketAddr, role: &str| {
        let page = dejavud::metrics::scrape(at).unwrap();
        let value = |name| dejavud::metrics::value_of(&page, name, &[("role", role)]).unwrap() as u64;
        value("dejavu_sidecar_held_bytes") - value("dejavu_sidecar_held_chunks") * HEADER_LEN as u64
    };

    let mut rng = dejavu_proto::rng::SplitMix64::new(30);
    let places = [0..1, 1..2, 2..3, 3..4, 0..2, 1..3, 2..4];
    let mut engine = LocalSidecar::connect(&socket, 0, replica_addr).unwrap();
    // What each slot holds now: the request's seed and its tokens.
    let mut current: Vec<Option<(u8, u32)>> = vec![None; SLOTS as usize];
    for request in 0..240u32 {
        let slots = places[rng.below(places.len() as u64) as usize].clone();
        let prompt = 1 + rng.below(48) as u32;
        let steps = rng.below(9) as u32;
        let seed = request as u8;
        if request == 120 {
            // The successor stops for a while as the next request starts: forwards wait for it.
            let pid = replica.0.id() as libc::pid_t;
            // SAFETY: kill(2) with a live child's pid and a signal number has no memory effects.
            unsafe { libc::kill(pid, libc::SIGSTOP) };
            let resume = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                // SAFETY: as above.
                unsafe { libc::kill(pid, libc::SIGCONT) };
            });
            put_sequence(&mut engine, slots.clone(), prompt, steps, seed);
            resume.join().unwrap();
        } else {
            put_sequence(&mut engine, slots.clone(), prompt, steps, seed);
        }
        // A request that shared a slot with this one was dropped whole, in all its slots.
        let replaced: Vec<u8> =
            slots.clone().filter_map(|slot| current[slot as usize].map(|(s, _)| s)).collect();
        for place in current.iter_mut().filter(|c| c.is_some_and(|(s, _)| replaced.contains(&s))) {
            *place = None;
        }
        for slot in slots {
            current[slot as usize] = Some((seed, prompt + steps));
        }
        assert!(
            held(own_metrics, "own") <= cache_bytes,
            "request {request}: the sidecar holds more than the cache"
        );
        assert!(
            held(replica_metrics, "replica") <= cache_bytes,
            "request {request}: the successor holds more than the cache"
        );
        if request == 160 {
            // The engine restarts beside its sidecar and restores every running sequence.
            drop(engine);
            engine = LocalSidecar::connect(&socket, 1, replica_addr).unwrap();
            let points = engine.recovery().unwrap().resume_points();
            let running: Vec<u32> = (0..SLOTS).filter(|&s| current[s as usize].is_some()).collect();
            let restored: Vec<u32> = points.iter().flat_map(|p| p.slots.clone()).collect();
            assert_eq!(restored, running, "a point for every slot of a running sequence");
            let mut out = Vec::new();
            for point in &points {
                let (seed, tokens) = current[point.slots.start as usize].unwrap();
                assert_eq!(point.tokens, tokens, "{point:?}");
                for region in &point.chunks {
                    let (descriptor, expected) =
                        sequence_chunk(point.slots.clone(), region.tokens.clone(), seed);
                    assert_eq!(engine.get(&descriptor.key(), &mut out).unwrap(), descriptor);
                    assert_eq!(out, expected, "bit-identical");
                }
            }
        }
    }
}

/// A request in `slots`: a prompt of `prompt` tokens, then `steps` decode steps.
fn put_sequence(engine: &mut LocalSidecar, slots: std::ops::Range<u32>, prompt: u32, steps: u32, seed: u8) {
    let (descriptor, kv) = sequence_chunk(slots.clone(), 0..prompt, seed);
    engine.put(&descriptor, &kv).unwrap();
    for token in prompt..prompt + steps {
        let (descriptor, kv) = sequence_chunk(slots.clone(), token..token + 1, seed);
        engine.put(&descriptor, &kv).unwrap();
    }
}

/// As [`chunk_in`], over the slots `slots`.
fn sequence_chunk(
    slots: std::ops::Range<u32>,
    tokens: std::ops::Range<u32>,
    seed: u8,
) -> (ChunkDescriptor, Vec<u8>) {
    let (mut descriptor, _) = chunk_in(0, tokens, seed);
    descriptor.region.slots = slots;
    let len = descriptor.payload_len() as usize;
    let kv = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    (descriptor, kv)
}

#[test]
fn an_engine_naming_its_own_sidecar_as_successor_is_refused_and_none_keeps_local_copies_only() {
    let dir = tempfile::tempdir().unwrap();
    let (_sidecar, socket, addr, metrics) =
        start_sidecar_serving(dir.path(), &["--index", "0", "--metrics", "127.0.0.1:0"]);
    // Its copies would die with it: refused, with what to give instead.
    let error = LocalSidecar::connect(&socket, 0, addr).map(|_| ()).unwrap_err().to_string();
    assert!(error.contains("its own successor") && error.contains("`none`"), "{error}");
    // No successor: the chunk is kept here and acknowledged, and a restarted engine gets it back.
    let mut engine = LocalSidecar::connect(&socket, 1, Successor::LocalOnly).unwrap();
    let (token, token_kv) = chunk(1, 6);
    engine.put(&token, &token_kv).unwrap();
    drop(engine);
    let mut restarted = LocalSidecar::connect(&socket, 2, Successor::LocalOnly).unwrap();
    let mut out = Vec::new();
    assert_eq!(restarted.get(&token.key(), &mut out).unwrap(), token);
    assert_eq!(out, token_kv);
    assert_eq!(restarted.recovery().unwrap().serving.successor, None);
    // Named itself later (a recovery of a ring of one stage names the stage its own
    // predecessor), it still keeps the local copy only.
    LocalSidecar::retarget_now(&socket, addr, 2).unwrap();
    let (next, next_kv) = chunk(7, 6);
    restarted.put(&next, &next_kv).unwrap();
    assert_eq!(restarted.recovery().unwrap().serving.successor, None);
    let page = dejavud::metrics::scrape(metrics.expect("it serves metrics")).unwrap();
    let forwarded = dejavud::metrics::value_of(&page, "dejavu_sidecar_forwarded_chunks_total", &[]);
    assert_eq!(forwarded, Some(0.0), "nothing forwarded: {page}");
}

#[test]
fn a_caller_with_little_patience_gives_up_on_a_stopped_sidecar_before_the_request_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let (sidecar, _socket, control) = sidecar_under_control(dir.path());
    assert!(control.held_of(1).is_ok(), "answers while running");
    let signal = |name: &str| {
        let status = Command::new("kill").args([name, &sidecar.0.id().to_string()]).status().unwrap();
        assert!(status.success(), "kill {name}");
    };
    // A stopped process: its kernel still accepts the connection, but nothing proves the secret.
    signal("-STOP");
    let started = std::time::Instant::now();
    let impatient = control.clone().reaching_within(Duration::from_millis(300));
    assert!(matches!(impatient.held_of(1), Err(ControlError::Auth { .. })), "gave up on the handshake");
    let waited = started.elapsed();
    // The request's own deadline is 10 s: the caller waited its patience, not that.
    assert!(waited < Duration::from_secs(5), "waited {waited:?}");
    signal("-CONT");
    assert!(control.held_of(1).is_ok(), "answers again once running");
}

/// A cache of 4 layers x 4 heads of 32, fp16, 4 slots of 64 tokens, every byte differing from its
/// neighbours' so that a misplaced byte shows.
fn patterned_cache() -> KvCache {
    let spec = KvSpec::new(4, 4, 32, DType::F16).unwrap();
    let cache = KvCache::new(KvLayout::faster_transformer(spec, 4, 64).unwrap()).unwrap();
    let all = KvRegion::new(0..4, 0..4, 0..4, 0..64);
    let pattern: Vec<u8> = (0..cache.packed_len(&all)).map(|i| (i * 7 + i / 253) as u8).collect();
    cache.scatter(&all, cache.layout().preferred_packing(), &pattern).unwrap();
    cache
}

/// `region` of `cache`, gathered in the cache's packing.
fn gathered(cache: &KvCache, region: &KvRegion) -> Vec<u8> {
    let mut out = vec![0; cache.packed_len(region) as usize];
    cache.gather(region, cache.layout().preferred_packing(), &mut out).unwrap();
    out
}

/// A streamer over a sidecar leaves each step's put in flight: the sidecar keeps the next step
/// while it forwards the one before. A step completes only once the successor holds it, bit for
/// bit; the sidecar keeps every one; a release after the steps drops them here and at the replica.
#[test]
fn steps_streamed_with_their_puts_in_flight_are_held_by_the_successor_once_they_complete() {
    let dir = tempfile::tempdir().unwrap();
    let (_sidecar, socket, _) = sidecar_with_region(dir.path(), 1 << 20);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let successor_store = HostStore::new();
    let successor = successor(&runtime, &successor_store);
    let engine = LocalSidecar::connect(&socket, 0, successor.addr()).unwrap();
    let cache = Arc::new(patterned_cache());
    let streamer = Streamer::spawn(StreamerConfig::default(), Box::new(engine)).unwrap();

    // A prompt of all four slots, then decode steps, queued at once.
    let worker = WorkerId { stage: 1, rank: 0 };
    let steps = (40..56).map(|t| KvRegion::new(0..4, 0..4, 0..4, t..t + 1));
    let regions: Vec<KvRegion> =
        std::iter::once(KvRegion::new(0..4, 0..4, 0..4, 0..40)).chain(steps).collect();
    let completions: Vec<_> = regions
        .iter()
        .map(|region| {
            let transfer = Transfer::in_place(worker, worker, 0, region);
            streamer
                .submit(StreamJob { cache: cache.clone(), transfer, tokens: region.tokens.clone() })
                .unwrap()
        })
        .collect();
    let mut keys = Vec::new();
    for (region, completion) in regions.iter().zip(completions) {
        let receipt = completion.wait_timeout(Duration::from_secs(30)).unwrap();
        // Complete means replicated: the successor holds it already, as gathered.
        let mut replica = Vec::new();
        successor_store.clone().get(&receipt.key, &mut replica).unwrap();
        assert_eq!(replica, gathered(&cache, region), "{:?}", region.tokens);
        keys.push(receipt.key);
    }
    let stats = streamer.shutdown(Shutdown::Drain).unwrap();
    assert_eq!((stats.completed, stats.failed), (regions.len() as u64, 0));

    // Kept too, by the sidecar itself.
    let mut engine = LocalSidecar::connect(&socket, 1, successor.addr()).unwrap();
    let mut kept = Vec::new();
    for (region, key) in regions.iter().zip(&keys) {
        engine.get(key, &mut kept).unwrap();
        assert_eq!(kept, gathered(&cache, region), "{:?}", region.tokens);
    }
    let place = SequencePlace { destination: worker, microbatch: 0, slots: 0..4 };
    assert_eq!(engine.release(&place).unwrap(), regions.len() as u64);
    assert_eq!(successor_store.len(), 0, "released at the replica");
}

/// With the successor gone, each put left in flight is answered with the forward's failure, in
/// order, once the sidecar has kept it: nothing waits for ever, the local copies are kept, and the
/// connection goes on.
#[test]
fn puts_in_flight_to_a_successor_that_is_gone_fail_each_in_turn_and_are_kept_locally() {
    let dir = tempfile::tempdir().unwrap();
    let (_sidecar, socket, _) = sidecar_with_region(dir.path(), 1 << 20);
    // An address nothing listens on.
    let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let mut engine = LocalSidecar::connect(&socket, 0, gone).unwrap();
    let cache = patterned_cache();
    let packing = cache.layout().preferred_packing();
    let worker = WorkerId { stage: 1, rank: 0 };
    let regions: Vec<KvRegion> = (10..14).map(|t| KvRegion::new(0..4, 0..2, 0..4, t..t + 1)).collect();
    let mut keys = Vec::new();
    for region in &regions {
        let descriptor = ChunkDescriptor {
            source: worker,
            destination: worker,
            microbatch: 0,
            region: region.clone(),
            spec: cache.layout().spec().share(4, 4).unwrap(),
            packing,
        };
        let plan = cache.gather_plan(region, packing).unwrap();
        let mut staging = vec![0; cache.packed_len(region) as usize];
        match engine.start_put_gathered(&descriptor, &cache, &plan, &mut staging).unwrap() {
            Started::InFlight { ticket, .. } => keys.push((descriptor.key(), ticket)),
            other => panic!("left in flight: {other:?}"),
        }
    }
    for (key, ticket) in &keys {
        let outcome = engine.finish_put(*ticket).expect("a put in flight");
        assert!(outcome.is_err(), "{key:?} cannot be forwarded");
        assert!(engine.finish_put(*ticket).is_none(), "handed out once");
    }
    let keys: Vec<_> = keys.into_iter().map(|(key, _)| key).collect();
    let mut kept = Vec::new();
    for (region, key) in regions.iter().zip(&keys) {
        engine.get(key, &mut kept).unwrap();
        assert_eq!(kept, gathered(&cache, region), "kept locally: {:?}", region.tokens);
    }
}

/// While the successor is stopped, a put in flight is kept (`Taken`: the next put's gather goes
/// on) but not answered: its outcome waits for the successor, and so does a streamed job's
/// completion. Once the successor runs again, every put is answered in turn, and the successor
/// holds each chunk.
#[test]
fn a_put_in_flight_frees_the_region_at_once_but_is_answered_only_once_the_successor_holds_it() {
    let (here, there) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (_own, socket, _) = start_sidecar(here.path(), &["--index", "1", "--region-bytes", "1048576"]);
    let (replica, replica_socket, replica_addr) = start_sidecar(there.path(), &["--index", "2"]);
    let signal = |name: &str| {
        let status = Command::new("kill").args([name, &replica.0.id().to_string()]).status().unwrap();
        assert!(status.success(), "kill {name}");
    };
    let cache = Arc::new(patterned_cache());
    let packing = cache.layout().preferred_packing();
    let worker = WorkerId { stage: 1, rank: 0 };
    let steps: Vec<KvRegion> = (20..23).map(|t| KvRegion::new(0..4, 0..4, 0..4, t..t + 1)).collect();
    let descriptor = |region: &KvRegion| ChunkDescriptor {
        source: worker,
        destination: worker,
        microbatch: 0,
        region: region.clone(),
        spec: cache.layout().spec().share(4, 4).unwrap(),
        packing,
    };
    let mut engine = LocalSidecar::connect(&socket, 0, replica_addr).unwrap();
    // Connected to the successor before it stops, so that each forward waits on its answer.
    let (warm_up, warm_up_kv) = chunk_in(3, 0..1, 9);
    engine.put(&warm_up, &warm_up_kv).unwrap();
    signal("-STOP");

    // Each put is kept and the region freed while the successor cannot answer: with puts that
    // waited for their forwards, the second start would wait for ever.
    let (started_tx, started) = std::sync::mpsc::channel();
    let (engine_back, engine_returned) = std::sync::mpsc::channel();
    let starting = {
        let (cache, steps) = (cache.clone(), steps.clone());
        let descriptors: Vec<ChunkDescriptor> = steps.iter().map(descriptor).collect();
        std::thread::spawn(move || {
            let mut tickets = Vec::new();
            for (region, descriptor) in steps.iter().zip(&descriptors) {
                let plan = cache.gather_plan(region, packing).unwrap();
                let mut staging = vec![0; cache.packed_len(region) as usize];
                match engine.start_put_gathered(descriptor, &cache, &plan, &mut staging).unwrap() {
                    Started::InFlight { ticket, .. } => tickets.push(ticket),
                    other => panic!("left in flight: {other:?}"),
                }
                started_tx.send(()).unwrap();
            }
            // Then the first put's outcome, which waits for the successor.
            let first = engine.finish_put(tickets[0]).expect("in flight");
            engine_back.send((engine, tickets, first)).unwrap();
        })
    };
    for _ in &steps {
        started.recv_timeout(Duration::from_secs(20)).expect("a put in flight was kept at once");
    }
    assert!(
        engine_returned.recv_timeout(Duration::from_millis(500)).is_err(),
        "a put is answered only once the successor holds its chunk"
    );
    signal("-CONT");
    let (mut engine, tickets, first) = engine_returned.recv_timeout(Duration::from_secs(20)).unwrap();
    starting.join().unwrap();
    first.unwrap();
    for &ticket in &tickets[1..] {
        engine.finish_put(ticket).expect("in flight").unwrap();
    }
    assert!(engine.finish_put(tickets[0]).is_none(), "each outcome is handed out once");
    // The successor holds each chunk, as gathered.
    let mut reader = LocalSidecar::reader(&replica_socket).unwrap();
    let mut replica_kv = Vec::new();
    for region in &steps {
        reader.get(&descriptor(region).key(), &mut replica_kv).unwrap();
        assert_eq!(replica_kv, gathered(&cache, region), "{:?}", region.tokens);
    }
}
