//! A host store's spill tier: chunks beyond the memory budget go to files and come back verified;
//! a directory over its cap (another file filled it) keeps them in memory instead, counted; a
//! replaced or dropped store leaves no stale file.

use std::fs;
use std::path::Path;

use dejavulib::chunk::{ChunkDescriptor, HEADER_LEN};
use dejavulib::spill::Spill;
use dejavulib::store::StoreError;
use dejavulib::{ChunkStore, DType, HostStore, KvRegion, KvSpec, Packing, WorkerId};

/// A chunk of `tokens` tokens (1 KiB each) for token range starting at `first`.
fn chunk(first: u32, tokens: u32, fill: u8) -> (ChunkDescriptor, Vec<u8>) {
    let spec = KvSpec::new(1, 4, 64, DType::F16).unwrap();
    let descriptor = ChunkDescriptor {
        source: WorkerId { stage: 0, rank: 0 },
        destination: WorkerId { stage: 1, rank: 0 },
        microbatch: 0,
        region: KvRegion::new(0..1, 0..1, 0..4, first..first + tokens),
        spec,
        packing: Packing::token_major(&spec),
    };
    let payload = (0..descriptor.payload_len()).map(|i| (i as u8).wrapping_mul(7) ^ fill).collect();
    (descriptor, payload)
}

fn files(dir: &Path) -> usize {
    fs::read_dir(dir).map_or(0, |d| d.count())
}

const CHUNK: u64 = (HEADER_LEN + 4096) as u64;

/// Waits until a capped directory is measured again (what other files take is measured at most
/// every 50 ms).
fn rescanned() {
    std::thread::sleep(std::time::Duration::from_millis(60));
}

#[test]
fn chunks_beyond_the_memory_budget_go_to_files_and_come_back_verified() {
    let dir = tempfile::tempdir().unwrap();
    let spill = Spill { dir: dir.path().join("spill"), memory_bytes: 2 * CHUNK, dir_bytes: None };
    let mut store = HostStore::with_spill(spill);
    let chunks: Vec<_> = (0..5).map(|i| chunk(i * 4, 4, i as u8)).collect();
    for (d, p) in &chunks {
        store.put(d, p).unwrap();
    }
    let usage = store.usage();
    assert_eq!(usage.memory_bytes, 2 * CHUNK, "the budget is used first");
    assert_eq!((usage.spilled_chunks, usage.spilled_bytes, usage.spill_failures), (3, 3 * CHUNK, 0));
    assert_eq!(files(&dir.path().join("spill")), 3);
    let mut out = Vec::new();
    for (d, p) in &chunks {
        assert_eq!(store.get(&d.key(), &mut out).unwrap(), *d);
        assert_eq!(&out, p);
    }

    // A spill file damaged on disk is reported, never handed out.
    let (d, _) = &chunks[4];
    let path = dir.path().join("spill").join(d.key().file_name());
    let mut bytes = fs::read(&path).unwrap();
    bytes[HEADER_LEN + 10] ^= 0xff;
    fs::write(&path, bytes).unwrap();
    assert!(matches!(store.get(&d.key(), &mut out), Err(StoreError::Chunk { .. })));

    // Replacing a spilled chunk keeps one file; the store takes its files with it.
    let (d, p) = chunk(16, 4, 99);
    store.put(&d, &p).unwrap();
    assert_eq!(store.usage().spilled_chunks, 3);
    store.get(&d.key(), &mut out).unwrap();
    assert_eq!(out, p);
    drop(store);
    assert_eq!(files(&dir.path().join("spill")), 0);
}

#[test]
fn a_full_spill_directory_keeps_chunks_in_memory_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let spill_dir = dir.path().join("spill");
    fs::create_dir(&spill_dir).unwrap();
    let spill = Spill { dir: spill_dir.clone(), memory_bytes: 0, dir_bytes: Some(3 * CHUNK) };
    let mut store = HostStore::with_spill(spill);
    store.put(&chunk(0, 4, 1).0, &chunk(0, 4, 1).1).unwrap();
    assert_eq!(store.usage().spilled_chunks, 1);
    // Something else fills the directory (noticed within the rescan interval).
    fs::write(spill_dir.join("ballast"), vec![0u8; 2 * CHUNK as usize]).unwrap();
    rescanned();
    let (d, p) = chunk(4, 4, 2);
    store.put(&d, &p).unwrap();
    let usage = store.usage();
    assert_eq!((usage.spilled_chunks, usage.spill_failures, usage.memory_bytes), (1, 1, CHUNK));
    let mut out = Vec::new();
    store.get(&d.key(), &mut out).unwrap();
    assert_eq!(out, p, "nothing lost to the full directory");
    // Room again: the next chunks spill.
    fs::remove_file(spill_dir.join("ballast")).unwrap();
    rescanned();
    store.put(&chunk(8, 4, 3).0, &chunk(8, 4, 3).1).unwrap();
    assert_eq!(store.usage().spilled_chunks, 2);
}

#[test]
fn a_spilled_chunk_replaced_in_memory_leaves_no_file_and_stale_or_truncated_files_do_no_harm() {
    let dir = tempfile::tempdir().unwrap();
    let spill_dir = dir.path().join("spill");
    fs::create_dir(&spill_dir).unwrap();
    // Left by a store before this one (a sidecar killed and started again): removed at start.
    fs::write(spill_dir.join("w1.0-m0-l0_1-s0_1-h0_4-t0_4.djv"), b"old").unwrap();
    fs::write(spill_dir.join("ballast"), b"not a chunk").unwrap();
    let spill = Spill { dir: spill_dir.clone(), memory_bytes: 0, dir_bytes: Some(2 * CHUNK + 11) };
    let mut store = HostStore::with_spill(spill);
    assert_eq!(files(&spill_dir), 1, "only the other file is left");

    let (d, p) = chunk(0, 4, 1);
    store.put(&d, &p).unwrap();
    assert_eq!(store.usage().spilled_chunks, 1);
    // The directory fills up: the same key, put again, stays in memory and its file goes.
    fs::write(spill_dir.join("ballast"), vec![0u8; 2 * CHUNK as usize]).unwrap();
    rescanned();
    let (d2, p2) = chunk(0, 4, 2);
    store.put(&d2, &p2).unwrap();
    let usage = store.usage();
    assert_eq!((usage.spilled_chunks, usage.spilled_bytes, usage.memory_bytes), (0, 0, CHUNK));
    assert!(!spill_dir.join(d.key().file_name()).exists(), "no stale file");
    let mut out = Vec::new();
    store.get(&d2.key(), &mut out).unwrap();
    assert_eq!(out, p2);

    // A spill file cut short on disk is no chunk (never a panic, never half a chunk).
    fs::remove_file(spill_dir.join("ballast")).unwrap();
    rescanned();
    let (d3, p3) = chunk(4, 4, 3);
    store.put(&d3, &p3).unwrap();
    assert_eq!(store.usage().spilled_chunks, 1);
    fs::write(spill_dir.join(d3.key().file_name()), [1u8, 2, 3]).unwrap();
    assert!(matches!(store.get(&d3.key(), &mut out), Err(StoreError::NotFound(_))));
}
