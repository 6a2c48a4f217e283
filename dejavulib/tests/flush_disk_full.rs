//! A flush that fails midway, as on a full disk: with `RLIMIT_FSIZE` at 1 MiB (and `SIGXFSZ`
//! ignored, so the write fails with `EFBIG` instead of killing the process), putting a 4 MiB chunk
//! must fail with an I/O error on both file backends and leave no file behind, neither the chunk nor
//! its temporary.
//!
//! A host store's spill to such a disk fails the same way, and the chunk stays in memory instead.
//!
//! Resource limits are per process, so this is the only test in this binary.

use std::fs;
use std::path::Path;

use dejavulib::chunk::{ChunkDescriptor, HEADER_LEN};
use dejavulib::file_io::FileBackend;
use dejavulib::spill::Spill;
use dejavulib::store::StoreError;
use dejavulib::{ChunkStore, DType, FileStore, HostStore, KvRegion, KvSpec, Packing, WorkerId};

const LIMIT: u64 = 1 << 20;

/// Lowers `RLIMIT_FSIZE` for its lifetime; restores the old limit on drop, even on panic.
struct FileSizeLimit {
    old: libc::rlimit,
}

impl FileSizeLimit {
    fn set(bytes: u64) -> Self {
        let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: `old` is a valid, writable rlimit.
        let rc = unsafe { libc::getrlimit(libc::RLIMIT_FSIZE, &mut old) };
        assert_eq!(rc, 0, "getrlimit: {}", std::io::Error::last_os_error());
        let new = libc::rlimit { rlim_cur: bytes as libc::rlim_t, rlim_max: old.rlim_max };
        // SAFETY: `new` is a valid rlimit; lowering the soft limit is always permitted.
        let rc = unsafe { libc::setrlimit(libc::RLIMIT_FSIZE, &new) };
        assert_eq!(rc, 0, "setrlimit: {}", std::io::Error::last_os_error());
        Self { old }
    }
}

impl Drop for FileSizeLimit {
    fn drop(&mut self) {
        // SAFETY: `old` is the limit getrlimit returned, with the unchanged hard limit.
        let rc = unsafe { libc::setrlimit(libc::RLIMIT_FSIZE, &self.old) };
        assert_eq!(rc, 0, "restoring RLIMIT_FSIZE failed");
    }
}

fn entries(dir: &Path) -> Vec<String> {
    fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect()
}

#[test]
fn a_flush_past_the_file_size_limit_fails_and_leaves_no_file() {
    // SAFETY: ignoring SIGXFSZ installs no handler; oversized writes then fail with EFBIG.
    let previous = unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    assert_ne!(previous, libc::SIG_ERR);

    // 1 layer, 1 slot, 8 heads of 128 f32, 512 tokens: 2 * 8 * 512 * 512 bytes = 4 MiB.
    let spec = KvSpec::new(1, 8, 128, DType::F32).unwrap();
    let descriptor = ChunkDescriptor {
        source: WorkerId { stage: 0, rank: 0 },
        destination: WorkerId { stage: 1, rank: 0 },
        microbatch: 0,
        region: KvRegion::new(0..1, 0..1, 0..8, 0..512),
        spec,
        packing: Packing::token_major(&spec),
    };
    let payload: Vec<u8> = (0..descriptor.payload_len()).map(|i| (i * 31 % 251) as u8).collect();
    assert_eq!(payload.len(), 4 << 20);

    for backend in [FileBackend::Posix, FileBackend::Auto] {
        let dir = tempfile::tempdir().unwrap();
        let mut store = FileStore::open(dir.path(), backend).unwrap();
        let name = store.backend_name();
        eprintln!("{backend:?}: {name}");

        let result = {
            let _limit = FileSizeLimit::set(LIMIT);
            store.put(&descriptor, &payload)
        };
        match &result {
            Err(StoreError::Io { op, source, .. }) => {
                assert_eq!(*op, "write", "{name}: {source}");
                assert_eq!(source.raw_os_error(), Some(libc::EFBIG), "{name}: {source}");
            }
            other => panic!("{name}: expected an I/O error, got {other:?}"),
        }
        assert_eq!(entries(dir.path()), Vec::<String>::new(), "{name}: a failed flush left files");
        let mut out = Vec::new();
        assert!(matches!(store.get(&descriptor.key(), &mut out), Err(StoreError::NotFound(_))));

        // With the limit lifted the same flush succeeds: the failure was the limit.
        store.put(&descriptor, &payload).unwrap();
        store.get(&descriptor.key(), &mut out).unwrap();
        assert!(out == payload, "{name}: round trip after the limit");
        assert_eq!(
            fs::metadata(store.path_of(&descriptor.key())).unwrap().len(),
            (HEADER_LEN + payload.len()) as u64
        );
        assert_eq!(entries(dir.path()).len(), 1);

        // A replacing flush writes into the file the last one displaced: one failing there keeps
        // the chunk it would have replaced, and drops the half-written spare.
        let replacement: Vec<u8> = payload.iter().map(|b| b ^ 0x5a).collect();
        store.put(&descriptor, &replacement).unwrap();
        assert_eq!(entries(dir.path()).len(), 2, "{name}: the chunk and the spare");
        let result = {
            let _limit = FileSizeLimit::set(LIMIT);
            store.put(&descriptor, &payload)
        };
        assert!(matches!(&result, Err(StoreError::Io { op: "write", .. })), "{name}: {result:?}");
        assert_eq!(entries(dir.path()).len(), 1, "{name}: the failed spare is gone");
        store.get(&descriptor.key(), &mut out).unwrap();
        assert!(out == replacement, "{name}: the last good flush stands");
    }

    // A host store that spills everything: the spill fails at the limit, the chunk stays in memory.
    let dir = tempfile::tempdir().unwrap();
    let spill = Spill { dir: dir.path().to_owned(), memory_bytes: 0, dir_bytes: None };
    let mut store = HostStore::with_spill(spill);
    {
        let _limit = FileSizeLimit::set(LIMIT);
        store.put(&descriptor, &payload).unwrap();
    }
    let usage = store.usage();
    assert_eq!((usage.spill_failures, usage.spilled_chunks), (1, 0));
    assert_eq!(usage.memory_bytes, (HEADER_LEN + payload.len()) as u64);
    assert_eq!(entries(dir.path()), Vec::<String>::new(), "a failed spill left files");
    let mut out = Vec::new();
    store.get(&descriptor.key(), &mut out).unwrap();
    assert!(out == payload, "the chunk kept in memory");
    // With the limit lifted, the same chunk spills and leaves memory.
    store.put(&descriptor, &payload).unwrap();
    let usage = store.usage();
    assert_eq!((usage.spilled_chunks, usage.memory_bytes), (1, 0));
    store.get(&descriptor.key(), &mut out).unwrap();
    assert!(out == payload, "the chunk read back from its spill file");

    // SAFETY: puts back the disposition `signal` returned above.
    unsafe { libc::signal(libc::SIGXFSZ, previous) };
}
