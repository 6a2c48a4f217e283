//! Flush and fetch through [`FileStore`] (both file backends) and [`HostStore`]: round trips of real
//! gathered regions, and every way a stored chunk can go bad (truncation, flipped payload or header
//! bytes, missing keys, wrong payload lengths, unwritable directories), including through
//! `stream_in`, which must refuse a bad chunk and leave the destination cache untouched.

mod common;

use common::every_vector;

use std::fs::{self, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use dejavulib::chunk::{ChunkDescriptor, ChunkError, ChunkKey, HEADER_LEN};
use dejavulib::file_io::FileBackend;
use dejavulib::layout::PerLayerOrder;
use dejavulib::reshard::{LocalRegion, StreamError};
use dejavulib::store::StoreError;
use dejavulib::{
    stream_in, stream_out, ChunkStore, Coord, DType, FileStore, HostStore, KvCache, KvLayout, KvRegion,
    KvSpec, Packing, Part, ScaleMode, StagingPool, Transfer, WorkerId,
};

const BACKENDS: [FileBackend; 2] = [FileBackend::Auto, FileBackend::Posix];

/// Deterministic bytes: xorshift64 from `seed`.
fn noise(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// A cache of `layout` whose every vector holds noise derived from `seed`.
fn filled(layout: KvLayout, seed: u64) -> KvCache {
    let cache = KvCache::new(layout).unwrap();
    let spec = *cache.layout().spec();
    for (i, (part, at)) in every_vector(cache.layout()).into_iter().enumerate() {
        let data = noise(seed.wrapping_mul(1_000_003) + i as u64, spec.vector_bytes(part) as usize);
        cache.write_vector(part, at, &data).unwrap();
    }
    cache
}

fn read(cache: &KvCache, part: Part, at: Coord) -> Vec<u8> {
    let mut out = vec![0u8; cache.layout().spec().vector_bytes(part) as usize];
    cache.read_vector(part, at, &mut out).unwrap();
    out
}

fn in_region(region: &KvRegion, at: Coord) -> bool {
    region.layers.contains(&at.layer)
        && region.slots.contains(&at.slot)
        && region.heads.contains(&at.head)
        && region.tokens.contains(&at.token)
}

fn specs() -> [KvSpec; 2] {
    [
        KvSpec::new(2, 3, 16, DType::F16).unwrap(),
        KvSpec::with_scales(2, 2, 32, DType::Int8, ScaleMode::PerTokenHead).unwrap(),
    ]
}

/// A FasterTransformer source cache of `spec`, a region of it, and the region's gathered bytes.
fn gathered(spec: KvSpec, seed: u64) -> (KvCache, KvRegion, Packing, Vec<u8>) {
    let cache = filled(KvLayout::faster_transformer(spec, 3, 9).unwrap(), seed);
    let region = KvRegion::new(0..spec.layers(), 1..3, 1..spec.kv_heads(), 2..7);
    let packing = cache.layout().preferred_packing();
    let mut payload = vec![0u8; cache.packed_len(&region) as usize];
    cache.gather(&region, packing, &mut payload).unwrap();
    (cache, region, packing, payload)
}

fn descriptor(spec: &KvSpec, region: &KvRegion, packing: Packing) -> ChunkDescriptor {
    let shape = region.shape();
    ChunkDescriptor {
        source: WorkerId { stage: 0, rank: 1 },
        destination: WorkerId { stage: 1, rank: 0 },
        microbatch: 2,
        region: region.clone(),
        spec: spec.share(shape.layers, shape.heads).unwrap(),
        packing,
    }
}

fn dir_entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

/// The chunk error inside a store error, or a panic naming what came instead.
fn chunk_error<T: std::fmt::Debug>(r: Result<T, StoreError>) -> ChunkError {
    match r {
        Err(StoreError::Chunk { source, .. }) => source,
        other => panic!("expected a chunk error, got {other:?}"),
    }
}

/// Gathers from one layout, flushes, fetches and scatters into another: the region arrives intact
/// and nothing else is written.
fn round_trip(store: &mut dyn ChunkStore, what: &str) {
    for (i, spec) in specs().into_iter().enumerate() {
        let (src, region, packing, payload) = gathered(spec, 10 + i as u64);
        let d = descriptor(&spec, &region, packing);
        store.put(&d, &payload).unwrap();
        let mut back = vec![0xaa; 3];
        let got = store.get(&d.key(), &mut back).unwrap();
        assert_eq!(got, d, "{what}: descriptor round trip");
        assert!(back == payload, "{what}: payload round trip");

        let dst = KvCache::new(KvLayout::per_layer(spec, 3, 9, PerLayerOrder::Bshd).unwrap()).unwrap();
        let n = dst.scatter(&got.region, got.packing, &back).unwrap();
        assert_eq!(n, payload.len() as u64);
        let mut moved = 0;
        for (part, at) in every_vector(dst.layout()) {
            let now = read(&dst, part, at);
            if in_region(&region, at) {
                assert_eq!(now, read(&src, part, at), "{what}: {part:?} {at:?}");
                moved += 1;
            } else {
                assert!(now.iter().all(|&b| b == 0), "{what}: {part:?} {at:?} written");
            }
        }
        assert_eq!(moved, region.shape().vectors() * spec.parts().len() as u64);
    }
}

#[test]
fn file_store_round_trips_a_gathered_region() {
    for backend in BACKENDS {
        let dir = tempfile::tempdir().unwrap();
        let mut store = FileStore::open(dir.path(), backend).unwrap();
        let what = format!("{backend:?} ({})", store.backend_name());
        round_trip(&mut store, &what);
        // Two chunks, no temporary files left behind.
        let names = dir_entries(dir.path());
        assert_eq!(names.len(), 2, "{what}: {names:?}");
        assert!(names.iter().all(|n| n.ends_with(".djv") && !n.starts_with('.')));
    }
}

#[test]
fn file_store_without_sync_round_trips_too() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = FileStore::open(dir.path(), FileBackend::Posix).unwrap().without_sync();
    round_trip(&mut store, "posix without sync");
}

#[test]
fn host_store_round_trips_a_gathered_region() {
    let mut store = HostStore::new().logging_puts();
    round_trip(&mut store, "host");
    assert_eq!(store.len(), 2);
    assert_eq!(store.put_log().len(), 2);
}

#[test]
fn a_put_replaces_the_chunk_under_the_same_key() {
    for backend in BACKENDS {
        let dir = tempfile::tempdir().unwrap();
        let mut store = FileStore::open(dir.path(), backend).unwrap();
        let (_, region, packing, payload) = gathered(specs()[0], 1);
        let d = descriptor(&specs()[0], &region, packing);
        let chunk = d.key().file_name();
        store.put(&d, &payload).unwrap();
        assert_eq!(dir_entries(dir.path()), vec![chunk.clone()]);
        // Each replacing put writes into the file the one before displaced, and keeps one spare.
        let mut back = Vec::new();
        for seed in [99, 100, 101] {
            let other = noise(seed, payload.len());
            store.put(&d, &other).unwrap();
            store.get(&d.key(), &mut back).unwrap();
            assert!(back == other, "{backend:?}: the latest put wins (seed {seed})");
            let entries = dir_entries(dir.path());
            assert_eq!(entries.len(), 2, "{backend:?}: the chunk and one spare: {entries:?}");
            assert!(
                entries.contains(&chunk) && entries.iter().any(|e| e.starts_with('.') && e.ends_with(".tmp"))
            );
        }
        let clone = store.clone();
        drop(store);
        assert_eq!(dir_entries(dir.path()).len(), 2, "{backend:?}: a clone still holds the spare");
        drop(clone);
        assert_eq!(dir_entries(dir.path()), vec![chunk], "{backend:?}: the last clone removes the spare");
    }
}

#[test]
fn fetches_racing_replacing_flushes_read_whole_chunks() {
    // A flush writes into the file the last one displaced: it must never be one a fetch is still
    // reading. Readers see the old or the new chunk, never an error or a mix.
    // 256 KiB chunks (int8, one layer and head of dimension 128), so that reads take a while.
    let spec = KvSpec::new(1, 1, 128, DType::Int8).unwrap();
    let region = KvRegion::new(0..1, 0..1, 0..1, 0..1024);
    let d = descriptor(&spec, &region, Packing::token_major(&spec));
    // Three versions, so that the spare a flush rewrites never already holds what it writes.
    let versions: Vec<Vec<u8>> = (0..3).map(|i| noise(40 + i, d.payload_len() as usize)).collect();
    for backend in BACKENDS {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = FileStore::open(dir.path(), backend).unwrap().without_sync();
        writer.put(&d, &versions[0]).unwrap();
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            let readers: Vec<_> = (0..2)
                .map(|_| {
                    let mut reader = writer.clone();
                    let (done, d, versions) = (&done, &d, &versions);
                    scope.spawn(move || {
                        let (mut reads, mut back) = (0, Vec::new());
                        while !done.load(std::sync::atomic::Ordering::Relaxed) || reads == 0 {
                            reader.get(&d.key(), &mut back).unwrap_or_else(|e| panic!("{backend:?}: {e}"));
                            assert!(versions.contains(&back), "{backend:?}: a chunk mixing two flushes");
                            reads += 1;
                        }
                        reads
                    })
                })
                .collect();
            for i in 0..600 {
                writer.put(&d, &versions[i % 3]).unwrap();
            }
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            for reader in readers {
                assert!(reader.join().unwrap() > 0);
            }
        });
    }
}

#[test]
fn stores_opened_on_a_directory_in_use_never_break_its_flushes() {
    // Opening a store removes the temporary files nobody holds: never a flush's file in progress.
    let spec = KvSpec::new(1, 1, 64, DType::Int8).unwrap();
    let region = KvRegion::new(0..1, 0..1, 0..1, 0..256);
    let d = descriptor(&spec, &region, Packing::token_major(&spec));
    let versions: Vec<Vec<u8>> = (0..3).map(|i| noise(70 + i, d.payload_len() as usize)).collect();
    let dir = tempfile::tempdir().unwrap();
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let opener = scope.spawn(|| {
            let mut opened = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                drop(FileStore::open(dir.path(), FileBackend::Posix).unwrap());
                opened += 1;
            }
            opened
        });
        // Stops the opener however this thread ends: a failed put must fail the test, not hang it.
        struct Done<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let stop = Done(&done);
        let mut store = FileStore::open(dir.path(), FileBackend::Posix).unwrap().without_sync();
        let mut back = Vec::new();
        for i in 0..600 {
            store.put(&d, &versions[i % 3]).unwrap_or_else(|e| panic!("put {i}: {e}"));
            store.get(&d.key(), &mut back).unwrap_or_else(|e| panic!("get {i}: {e}"));
            assert!(back == versions[i % 3], "get {i}");
        }
        drop(stop);
        assert!(opener.join().unwrap() > 0);
    });
    assert_eq!(dir_entries(dir.path()), vec![d.key().file_name()], "no temporary file left behind");
}

#[test]
fn a_spare_of_another_size_holds_the_next_chunk_exactly() {
    for backend in BACKENDS {
        let dir = tempfile::tempdir().unwrap();
        let mut store = FileStore::open(dir.path(), backend).unwrap();
        let spec = specs()[0];
        let (cache, region, packing, payload) = gathered(spec, 2);
        let large = descriptor(&spec, &region, packing);
        store.put(&large, &payload).unwrap();
        store.put(&large, &payload).unwrap(); // leaves a spare the size of `large`

        // A smaller chunk under another key goes into the larger spare, cut to its size.
        let small_region = KvRegion::new(0..1, 1..2, 1..2, 2..3);
        let mut small_payload = vec![0u8; cache.packed_len(&small_region) as usize];
        cache.gather(&small_region, packing, &mut small_payload).unwrap();
        let small = descriptor(&spec, &small_region, packing);
        store.put(&small, &small_payload).unwrap();
        let on_disk = fs::metadata(store.path_of(&small.key())).unwrap().len();
        assert_eq!(on_disk, (HEADER_LEN + small_payload.len()) as u64, "{backend:?}");

        let mut back = Vec::new();
        store.get(&small.key(), &mut back).unwrap();
        assert!(back == small_payload, "{backend:?}: small chunk");
        store.get(&large.key(), &mut back).unwrap();
        assert!(back == payload, "{backend:?}: large chunk untouched");

        // And a larger one after a smaller spare: replace the small chunk, then grow into it.
        store.put(&small, &small_payload).unwrap();
        let grown = noise(5, payload.len());
        store.put(&large, &grown).unwrap();
        store.get(&large.key(), &mut back).unwrap();
        assert!(back == grown, "{backend:?}: large chunk grown from the small spare");
    }
}

#[test]
fn opening_a_store_removes_the_temporary_files_nobody_holds() {
    use std::os::unix::io::AsRawFd;
    let dir = tempfile::tempdir().unwrap();
    // Temporary files as flushes name them: `.{chunk file}.{16 hex digits}.{n}.tmp`.
    let left = ".w0.1-m2-l0_2.djv.00000000deadbeef.7.tmp";
    let held = ".w0.1-m2.djv.0123456789abcdef.8.tmp";
    let read = ".w0.1.djv.0123456789abcdef.9.tmp";
    let others = [".notes.tmp", ".x.1.tmp", ".w0.1.djv.4242.7.tmp", "w0.1-m2.djv"];
    for name in [left, held, read].into_iter().chain(others) {
        fs::write(dir.path().join(name), b"x").unwrap();
    }
    // A flush in progress (exclusive lock) and a fetch of a chunk just displaced (shared lock), of
    // this process or any other: their files stay.
    let lock = |name: &str, how: i32| {
        let file = fs::File::open(dir.path().join(name)).unwrap();
        // SAFETY: flock on a descriptor this test owns.
        assert_eq!(unsafe { libc::flock(file.as_raw_fd(), how | libc::LOCK_NB) }, 0);
        file
    };
    let (_writing, _reading) = (lock(held, libc::LOCK_EX), lock(read, libc::LOCK_SH));
    let _store = FileStore::open(dir.path(), FileBackend::Posix).unwrap();
    let mut expected: Vec<String> = [held, read].into_iter().chain(others).map(str::to_string).collect();
    expected.sort();
    assert_eq!(dir_entries(dir.path()), expected, "only the temporary file nobody held went");
}

/// A stored chunk file for tests that damage it.
struct Stored {
    _dir: tempfile::TempDir,
    store: FileStore,
    key: ChunkKey,
    descriptor: ChunkDescriptor,
    payload: Vec<u8>,
    path: std::path::PathBuf,
}

fn stored(backend: FileBackend) -> Stored {
    let dir = tempfile::tempdir().unwrap();
    let mut store = FileStore::open(dir.path(), backend).unwrap();
    let spec = specs()[1];
    let (_, region, packing, payload) = gathered(spec, 7);
    let descriptor = descriptor(&spec, &region, packing);
    store.put(&descriptor, &payload).unwrap();
    let key = descriptor.key();
    let path = store.path_of(&key);
    assert_eq!(fs::metadata(&path).unwrap().len(), (HEADER_LEN + payload.len()) as u64);
    Stored { _dir: dir, store, key, descriptor, payload, path }
}

fn set_len(path: &Path, len: u64) {
    OpenOptions::new().write(true).open(path).unwrap().set_len(len).unwrap();
}

fn flip_byte(path: &Path, at: u64) {
    let mut f = OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8];
    f.seek(SeekFrom::Start(at)).unwrap();
    f.read_exact(&mut b).unwrap();
    b[0] ^= 0x01;
    f.seek(SeekFrom::Start(at)).unwrap();
    f.write_all(&b).unwrap();
}

#[test]
fn truncated_files_are_reported_as_truncated() {
    for backend in BACKENDS {
        let mut s = stored(backend);
        let full = (HEADER_LEN + s.payload.len()) as u64;
        let mut out = Vec::new();
        for len in [full - 1, full / 2, HEADER_LEN as u64 + 1, HEADER_LEN as u64] {
            s.store.put(&s.descriptor, &s.payload).unwrap();
            set_len(&s.path, len);
            let err = chunk_error(s.store.get(&s.key, &mut out));
            assert_eq!(err, ChunkError::Truncated { expected: full, got: len }, "{backend:?} cut to {len}");
        }
        for len in [HEADER_LEN as u64 - 1, 50, 1, 0] {
            s.store.put(&s.descriptor, &s.payload).unwrap();
            set_len(&s.path, len);
            let err = chunk_error(s.store.get(&s.key, &mut out));
            assert_eq!(
                err,
                ChunkError::Truncated { expected: HEADER_LEN as u64, got: len },
                "{backend:?} cut to {len}"
            );
        }
        // Trailing bytes are no better than missing ones.
        s.store.put(&s.descriptor, &s.payload).unwrap();
        set_len(&s.path, full + 1);
        assert!(matches!(s.store.get(&s.key, &mut out), Err(StoreError::Chunk { .. })));
        // And the intact chunk still reads back.
        s.store.put(&s.descriptor, &s.payload).unwrap();
        s.store.get(&s.key, &mut out).unwrap();
        assert!(out == s.payload);
    }
}

#[test]
fn flipped_payload_bytes_are_reported_as_corrupt() {
    for backend in BACKENDS {
        let mut s = stored(backend);
        let mut out = Vec::new();
        let len = s.payload.len() as u64;
        for at in [0, 1, len / 2, len - 1] {
            s.store.put(&s.descriptor, &s.payload).unwrap();
            flip_byte(&s.path, HEADER_LEN as u64 + at);
            match chunk_error(s.store.get(&s.key, &mut out)) {
                ChunkError::PayloadCorrupt { expected, actual } => {
                    assert_ne!(expected, actual, "{backend:?} byte {at}")
                }
                other => panic!("{backend:?} byte {at}: {other:?}"),
            }
        }
    }
}

#[test]
fn flipped_header_bytes_are_decode_errors() {
    for backend in BACKENDS {
        let mut s = stored(backend);
        let mut out = Vec::new();
        for at in 0..HEADER_LEN as u64 {
            s.store.put(&s.descriptor, &s.payload).unwrap();
            flip_byte(&s.path, at);
            let err = chunk_error(s.store.get(&s.key, &mut out));
            assert!(
                matches!(
                    err,
                    ChunkError::HeaderCorrupt
                        | ChunkError::BadMagic(_)
                        | ChunkError::UnsupportedVersion(_)
                        | ChunkError::Invalid(_)
                ),
                "{backend:?} header byte {at}: {err:?}"
            );
            if (8..96).contains(&at) {
                assert_eq!(err, ChunkError::HeaderCorrupt, "{backend:?} byte {at}");
            }
        }
    }
}

#[test]
fn a_file_holding_another_key_is_rejected() {
    for backend in BACKENDS {
        let mut s = stored(backend);
        let mut other = s.key.clone();
        other.microbatch += 1;
        fs::copy(&s.path, s.store.path_of(&other)).unwrap();
        let mut out = Vec::new();
        assert!(matches!(chunk_error(s.store.get(&other, &mut out)), ChunkError::Invalid(_)));
    }
}

#[test]
fn missing_keys_are_not_found() {
    let spec = specs()[0];
    let (_, region, packing, payload) = gathered(spec, 3);
    let d = descriptor(&spec, &region, packing);
    let mut missing = d.key();
    missing.region.tokens = 0..1;
    let mut host = HostStore::new();
    host.put(&d, &payload).unwrap();
    let mut stores: Vec<(String, Box<dyn ChunkStore>, Option<tempfile::TempDir>)> =
        vec![("host".into(), Box::new(host), None)];
    for backend in BACKENDS {
        let dir = tempfile::tempdir().unwrap();
        let mut store = FileStore::open(dir.path(), backend).unwrap();
        store.put(&d, &payload).unwrap();
        stores.push((format!("{backend:?}"), Box::new(store), Some(dir)));
    }
    for (name, store, _dir) in &mut stores {
        let mut out = Vec::new();
        match store.get(&missing, &mut out) {
            Err(StoreError::NotFound(key)) => assert_eq!(*key, missing, "{name}"),
            other => panic!("{name}: {other:?}"),
        }
        store.get(&d.key(), &mut out).unwrap();
    }
}

#[test]
fn host_store_corruption_is_caught_on_get() {
    let spec = specs()[1];
    let (_, region, packing, payload) = gathered(spec, 5);
    let d = descriptor(&spec, &region, packing);
    let mut store = HostStore::new();
    store.put(&d, &payload).unwrap();
    let mut missing = d.key();
    missing.microbatch += 1;
    assert!(!store.corrupt(&missing, 0), "no chunk to corrupt");
    assert!(!store.corrupt(&d.key(), payload.len()), "past the payload");
    let mut out = Vec::new();
    store.get(&d.key(), &mut out).unwrap();
    assert!(out == payload);
    assert!(store.corrupt(&d.key(), payload.len() - 1));
    match chunk_error(store.get(&d.key(), &mut out)) {
        ChunkError::PayloadCorrupt { expected, actual } => assert_ne!(expected, actual),
        other => panic!("{other:?}"),
    }
}

#[test]
fn host_store_keeps_an_encoded_chunk_only_once_checked() {
    let spec = specs()[1];
    let (_, region, packing, payload) = gathered(spec, 6);
    let d = descriptor(&spec, &region, packing);
    let mut encoded = d.encode_header(&payload).to_vec();
    encoded.extend_from_slice(&payload);
    let mut store = HostStore::new();
    // A flipped payload byte, a cut payload, a cut header: refused, nothing kept.
    let mut flipped = encoded.clone();
    *flipped.last_mut().unwrap() ^= 1;
    assert!(matches!(chunk_error(store.put_encoded(flipped)), ChunkError::PayloadCorrupt { .. }));
    let cut = encoded[..encoded.len() - 1].to_vec();
    assert!(matches!(store.put_encoded(cut), Err(StoreError::PayloadLength { .. })));
    assert!(matches!(
        store.put_encoded(encoded[..HEADER_LEN - 1].to_vec()),
        Err(StoreError::PayloadLength { .. })
    ));
    assert!(store.is_empty());
    // A checksum computed while copying stands for hashing again: a copy whose sum is not the
    // header's is refused as corrupt.
    let mut flipped = encoded[..HEADER_LEN].to_vec();
    flipped.extend_from_slice(&flipped_payload(&payload));
    assert!(matches!(chunk_error(store.put_copied(&flipped)), ChunkError::PayloadCorrupt { .. }));
    assert!(store.is_empty());
    // Whole: kept as it came, and read back as any chunk.
    let (kept, bytes) = store.put_encoded(encoded.clone()).unwrap();
    assert_eq!(kept, d);
    assert!(*bytes == encoded);
    let mut out = Vec::new();
    assert_eq!(store.get(&d.key(), &mut out).unwrap(), d);
    assert!(out == payload);
}

/// `payload` with its first byte changed.
fn flipped_payload(payload: &[u8]) -> Vec<u8> {
    let mut flipped = payload.to_vec();
    flipped[0] ^= 0x40;
    flipped
}

#[test]
fn payload_length_must_match_the_descriptor() {
    let spec = specs()[0];
    let (_, region, packing, payload) = gathered(spec, 4);
    let d = descriptor(&spec, &region, packing);
    let expected = payload.len() as u64;
    let check = |r: Result<(), StoreError>, got: u64, what: &str| match r {
        Err(StoreError::PayloadLength { expected: e, got: g }) => {
            assert_eq!((e, g), (expected, got), "{what}")
        }
        other => panic!("{what}: {other:?}"),
    };
    for backend in BACKENDS {
        let dir = tempfile::tempdir().unwrap();
        let mut store = FileStore::open(dir.path(), backend).unwrap();
        let what = format!("{backend:?}");
        check(store.put(&d, &payload[1..]), expected - 1, &what);
        let mut long = payload.clone();
        long.push(0);
        check(store.put(&d, &long), expected + 1, &what);
        check(store.put(&d, &[]), 0, &what);
        assert!(dir_entries(dir.path()).is_empty(), "{what}: nothing written");
    }
    let mut host = HostStore::new().logging_puts();
    check(host.put(&d, &payload[..1]), 1, "host");
    assert!(host.is_empty() && host.put_log().is_empty());
}

#[test]
fn unwritable_locations_are_errors_that_leave_no_file() {
    let spec = specs()[0];
    let (_, region, packing, payload) = gathered(spec, 6);
    let d = descriptor(&spec, &region, packing);
    for backend in BACKENDS {
        let root = tempfile::tempdir().unwrap();

        // A store under a regular file cannot be opened.
        let file = root.path().join("plain");
        fs::write(&file, b"not a directory").unwrap();
        assert!(matches!(FileStore::open(file.join("store"), backend), Err(StoreError::Io { .. })));

        // The store's directory is replaced by a regular file: creating the chunk fails.
        let dir = root.path().join("gone");
        let mut store = FileStore::open(&dir, backend).unwrap();
        fs::remove_dir(&dir).unwrap();
        fs::write(&dir, b"in the way").unwrap();
        match store.put(&d, &payload) {
            Err(StoreError::Io { op, .. }) => assert_eq!(op, "create", "{backend:?}"),
            other => panic!("{backend:?}: {other:?}"),
        }
        assert_eq!(fs::read(&dir).unwrap(), b"in the way");

        // The store's directory was removed: the same.
        let dir = root.path().join("removed");
        let mut store = FileStore::open(&dir, backend).unwrap();
        fs::remove_dir(&dir).unwrap();
        assert!(matches!(store.put(&d, &payload), Err(StoreError::Io { .. })));
        assert!(!dir.exists());

        // The chunk's final name is taken by a directory: the rename fails, the temporary goes.
        let dir = root.path().join("blocked");
        let mut store = FileStore::open(&dir, backend).unwrap();
        let target = store.path_of(&d.key());
        fs::create_dir(&target).unwrap();
        fs::write(target.join("keep"), b"x").unwrap();
        match store.put(&d, &payload) {
            Err(StoreError::Io { op, .. }) => assert_eq!(op, "rename", "{backend:?}"),
            other => panic!("{backend:?}: {other:?}"),
        }
        assert_eq!(dir_entries(&dir), vec![d.key().file_name()], "{backend:?}: only the blocking directory");
        assert!(target.is_dir());

        assert_eq!(
            dir_entries(root.path()),
            vec!["blocked", "gone", "plain"],
            "{backend:?}: nothing else appeared"
        );
        assert_eq!(fs::read(&file).unwrap(), b"not a directory");
    }
}

/// A source cache, one transfer of a region of it, and the chunk flushed to `store`.
fn flushed(store: &mut dyn ChunkStore) -> (KvCache, Transfer, std::ops::Range<u32>) {
    let spec = specs()[1];
    let src = filled(KvLayout::faster_transformer(spec, 2, 8).unwrap(), 21);
    let transfer = Transfer::same_region(
        WorkerId { stage: 0, rank: 0 },
        WorkerId { stage: 1, rank: 0 },
        LocalRegion { microbatch: 0, layers: 0..2, slots: 0..2, heads: 0..2 },
    );
    let tokens = 1..6;
    let pool = StagingPool::new(2);
    let stats = stream_out(&[&src], std::slice::from_ref(&transfer), tokens.clone(), &pool, store).unwrap();
    assert_eq!(stats.chunks, 1);
    (src, transfer, tokens)
}

fn paged_destination(spec: KvSpec, seed: u64) -> KvCache {
    use dejavulib::layout::{BlockTables, KvInterleave, PagedConfig, PagedOrder};
    let config = PagedConfig {
        block_size: 4,
        num_blocks: 6,
        order: PagedOrder::Hnd,
        interleave: KvInterleave::Interleaved,
    };
    let tables = BlockTables::from_tables(vec![vec![4, 1], vec![0, 5, 2]]);
    filled(KvLayout::paged(spec, 2, config, Some(tables)).unwrap(), seed)
}

fn assert_stream_in_refuses(
    store: &mut dyn ChunkStore,
    transfer: &Transfer,
    tokens: std::ops::Range<u32>,
    want: fn(&ChunkError) -> bool,
    what: &str,
) {
    let dst = paged_destination(specs()[1], 77);
    let before = dst.snapshot();
    match stream_in(&[&dst], std::slice::from_ref(transfer), tokens, store) {
        Err(StreamError::Store(StoreError::Chunk { source, .. })) => {
            assert!(want(&source), "{what}: {source:?}")
        }
        other => panic!("{what}: expected a chunk error, got {other:?}"),
    }
    assert!(dst.snapshot() == before, "{what}: destination touched");
}

#[test]
fn stream_in_refuses_damaged_chunks_and_leaves_the_cache_untouched() {
    for backend in BACKENDS {
        let dir = tempfile::tempdir().unwrap();
        let mut store = FileStore::open(dir.path(), backend).unwrap();
        let (src, transfer, tokens) = flushed(&mut store);

        // Control: the intact chunk streams in.
        let good = paged_destination(specs()[1], 5);
        let stats = stream_in(&[&good], std::slice::from_ref(&transfer), tokens.clone(), &mut store).unwrap();
        assert_eq!(stats.chunks, 1);
        let region = transfer.to.with_tokens(tokens.clone());
        for (part, at) in every_vector(good.layout()) {
            if in_region(&region, at) {
                assert_eq!(read(&good, part, at), read(&src, part, at), "{part:?} {at:?}");
            }
        }

        let path = store.path_of(&dejavulib::reshard::transfer_key(&transfer, tokens.clone()));
        let len = fs::metadata(&path).unwrap().len();
        let what = format!("{backend:?}");

        flip_byte(&path, len - 3);
        assert_stream_in_refuses(
            &mut store,
            &transfer,
            tokens.clone(),
            |e| matches!(e, ChunkError::PayloadCorrupt { .. }),
            &format!("{what} payload flip"),
        );

        flushed(&mut store);
        set_len(&path, len - 1);
        assert_stream_in_refuses(
            &mut store,
            &transfer,
            tokens.clone(),
            |e| matches!(e, ChunkError::Truncated { .. }),
            &format!("{what} truncated"),
        );

        flushed(&mut store);
        flip_byte(&path, 40);
        assert_stream_in_refuses(
            &mut store,
            &transfer,
            tokens.clone(),
            |e| matches!(e, ChunkError::HeaderCorrupt),
            &format!("{what} header flip"),
        );

        // A missing chunk is an error too, and writes nothing.
        fs::remove_file(&path).unwrap();
        let dst = paged_destination(specs()[1], 78);
        let before = dst.snapshot();
        assert!(matches!(
            stream_in(&[&dst], std::slice::from_ref(&transfer), tokens.clone(), &mut store),
            Err(StreamError::Store(StoreError::NotFound(_)))
        ));
        assert!(dst.snapshot() == before);
    }
}

#[test]
fn stream_in_refuses_a_corrupted_host_chunk() {
    let mut store = HostStore::new();
    let (_, transfer, tokens) = flushed(&mut store);
    let key = dejavulib::reshard::transfer_key(&transfer, tokens.clone());
    assert!(store.corrupt(&key, 17));
    assert_stream_in_refuses(
        &mut store,
        &transfer,
        tokens,
        |e| matches!(e, ChunkError::PayloadCorrupt { .. }),
        "host corrupt",
    );
}

/// A descriptor whose region takes exactly 2^64 bytes (2^58 vectors of 64 bytes): its byte count
/// does not fit a `u64`, and wraps to 0 where overflow is not checked.
fn absurd_descriptor() -> ChunkDescriptor {
    let spec = KvSpec::new(1, 1, 16, DType::F16).unwrap();
    ChunkDescriptor {
        source: WorkerId { stage: 0, rank: 0 },
        destination: WorkerId { stage: 1, rank: 0 },
        microbatch: 0,
        region: KvRegion::new(0..1 << 29, 0..1 << 29, 0..1, 0..1),
        spec,
        packing: Packing::token_major(&spec),
    }
}

#[test]
fn a_header_whose_region_size_overflows_is_an_error_not_a_panic() {
    // The header is well-formed and its checksum holds; only the region is absurd. A fetch must
    // report it, never panic (debug build) nor accept the empty payload as the region's wrapped
    // length of 0 (release build).
    let d = absurd_descriptor();
    let header = d.encode_header(&[]);
    for backend in BACKENDS {
        let dir = tempfile::tempdir().unwrap();
        let mut store = FileStore::open(dir.path(), backend).unwrap();
        let path = store.path_of(&d.key());
        fs::write(&path, header).unwrap();
        let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut out = Vec::new();
            store.get(&d.key(), &mut out).map(|_| out.len())
        }));
        match got {
            Ok(Err(StoreError::Chunk { .. })) => {}
            Ok(other) => panic!("{backend:?}: expected a chunk error, got {other:?}"),
            Err(_) => panic!("{backend:?}: FileStore::get panicked on a header with a huge region"),
        }
    }
}

#[test]
fn a_put_whose_region_size_overflows_is_an_error_not_a_panic() {
    let d = absurd_descriptor();
    let dir = tempfile::tempdir().unwrap();
    let mut file = FileStore::open(dir.path(), FileBackend::Posix).unwrap();
    let mut host = HostStore::new();
    for (name, store) in
        [("file", &mut file as &mut dyn ChunkStore), ("host", &mut host as &mut dyn ChunkStore)]
    {
        // An empty payload: exactly the region's size once wrapped to 64 bits.
        let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| store.put(&d, &[])));
        match got {
            Ok(Err(_)) => {}
            Ok(Ok(())) => panic!("{name}: an empty payload was accepted for a 2^64-byte region"),
            Err(_) => panic!("{name}: put panicked on a descriptor with a huge region"),
        }
    }
    assert!(dir_entries(dir.path()).is_empty());
}

/// A chunk written piece by piece, and one gathered and written as it is gathered
/// (`put_gathered`), read back equal to the region's gather; a writer given too many bytes,
/// finished short or dropped leaves no new file and the chunk in place.
#[test]
fn chunks_written_in_pieces_and_as_they_are_gathered_read_back_whole() {
    for backend in BACKENDS {
        for (i, spec) in specs().into_iter().enumerate() {
            let dir = tempfile::tempdir().unwrap();
            let mut store = FileStore::open(dir.path(), backend).unwrap();
            let (cache, region, packing, payload) = gathered(spec, 40 + i as u64);
            let d = descriptor(&spec, &region, packing);

            let mut writer = store.begin_put(&d).unwrap();
            for piece in payload.chunks(7) {
                writer.append(piece).unwrap();
            }
            writer.finish().unwrap();
            let mut back = Vec::new();
            assert_eq!(store.get(&d.key(), &mut back).unwrap(), d);
            assert!(back == payload, "{backend:?}: written in pieces");

            // Replaced by the same region gathered again, as it is gathered.
            let other = filled(KvLayout::faster_transformer(spec, 3, 9).unwrap(), 99);
            let mut expected = vec![0u8; payload.len()];
            other.gather(&region, packing, &mut expected).unwrap();
            let plan = other.gather_plan(&region, packing).unwrap();
            let mut staging = vec![0u8; payload.len()];
            store.put_gathered(&d, &other, &plan, &mut staging).unwrap();
            assert!(staging == expected, "{backend:?}: the staging buffer holds the gather");
            store.get(&d.key(), &mut back).unwrap();
            assert!(back == expected, "{backend:?}: written as gathered");
            // A plan of another shape of region is refused, as is one of another cache; the
            // chunk stays. (One of the same shape elsewhere is a resharding transfer's.)
            let tokens = region.tokens.start..region.tokens.end - 1;
            let shorter =
                KvRegion::new(region.layers.clone(), region.slots.clone(), region.heads.clone(), tokens);
            let elsewhere = other.gather_plan(&shorter, packing).unwrap();
            let refused = store.put_gathered(&d, &other, &elsewhere, &mut staging);
            assert!(matches!(refused, Err(StoreError::Chunk { .. })), "{refused:?}");
            let foreign = cache.gather_plan(&region, packing).unwrap();
            let refused = store.put_gathered(&d, &other, &foreign, &mut staging);
            assert!(matches!(refused, Err(StoreError::Gather(_))), "{refused:?}");

            // Too many bytes, too few, or given up: nothing changes.
            let before = dir_entries(dir.path());
            let mut writer = store.begin_put(&d).unwrap();
            writer.append(&payload).unwrap();
            let over = writer.append(&[0]);
            assert!(matches!(over, Err(StoreError::PayloadLength { .. })), "{over:?}");
            drop(writer);
            let mut writer = store.begin_put(&d).unwrap();
            writer.append(&payload[..payload.len() - 1]).unwrap();
            let short = writer.finish();
            assert!(matches!(short, Err(StoreError::PayloadLength { .. })), "{short:?}");
            let after = dir_entries(dir.path());
            assert!(
                after.iter().all(|name| before.contains(name)),
                "{backend:?}: {after:?} after {before:?}"
            );
            store.get(&d.key(), &mut back).unwrap();
            assert!(back == expected, "{backend:?}: the chunk in place is untouched");
        }
    }
}
