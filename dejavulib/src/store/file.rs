//! [`FileStore`]: one file per chunk in a directory (the SSD tier), replaced atomically.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{check_gathered, check_payload, ChunkStore, StoreError, GATHERED_PIECE};
use crate::cache::GatherPlan;
use crate::checksum::Checksum;
use crate::chunk::{verify_payload, ChunkDescriptor, ChunkError, ChunkKey, HEADER_LEN};
use crate::file_io::{FileBackend, FileIo};
use crate::KvCache;

/// Chunks as files in a directory, one per key (the SSD tier).
///
/// A flush writes a temporary file, syncs it, then renames it into place: a flush that fails midway
/// (disk full) leaves no file that looks valid, and a fetch never sees half a chunk.
///
/// A flush that replaces a chunk swaps the new file in atomically (`RENAME_EXCHANGE`) and keeps the
/// file it displaced, under a hidden temporary name, to write the next flush into: overwriting
/// pages the file system already holds is a copy, where a new file costs block allocation and, on
/// ext4, a forced writeback when renamed over the old one (about 25x the time for a decode step's
/// 6.5 MB). A fetch holds a shared `flock` on the file it reads and a flush writes its file only
/// under an exclusive one, so no file is rewritten while a fetch reads it; with syncing on, the
/// displaced file is kept only once the exchange is durable (the directory synced), so a crash
/// never finds a chunk's name on a file being rewritten. The store keeps at most one spare; the
/// last clone removes it when dropped, and opening a store removes the temporary files nobody is
/// writing: those of flushes a crash interrupted, and spares (another store loses only its reuse).
///
/// The directory must be on a local file system: the locks are `flock`s, which network file
/// systems emulate with per-process record locks. A flush whose final directory sync fails
/// returns an error although its chunk is in place (and readable), as its durability is unknown.
#[derive(Clone)]
pub struct FileStore {
    dir: PathBuf,
    io: Arc<FileIo>,
    sync: bool,
    spare: Arc<Spare>,
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// The suffix of temporary files: a flush in progress, or a displaced chunk kept for reuse.
const TEMP_SUFFIX: &str = ".tmp";

impl FileStore {
    /// A store in `dir` (created if missing) using `backend` for I/O; files are synced before rename.
    pub fn open(dir: impl Into<PathBuf>, backend: FileBackend) -> Result<Self, StoreError> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(|source| StoreError::Io {
            op: "create",
            path: dir.clone(),
            source,
        })?;
        let io = FileIo::new(backend).map_err(|source| StoreError::Io {
            op: "io_uring setup",
            path: dir.clone(),
            source,
        })?;
        remove_unheld_temps(&dir);
        Ok(Self { dir, io: Arc::new(io), sync: true, spare: Arc::default() })
    }

    /// Skips `fsync` (for benchmarks of the copy path, or a scratch tier that need not survive a
    /// crash). After a crash, any chunk may then be damaged, not only those being flushed: a
    /// replaced chunk's file is rewritten for the next flush before its replacement is durable.
    /// A fetch detects the damage (checksums, key, length) and reports it.
    pub fn without_sync(mut self) -> Self {
        self.sync = false;
        self
    }

    /// The I/O backend in use.
    pub fn backend_name(&self) -> &'static str {
        self.io.name()
    }

    /// Where the chunk under `key` lives.
    pub fn path_of(&self, key: &ChunkKey) -> PathBuf {
        self.dir.join(key.file_name())
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A temporary name for a chunk under `key`: `.{key}.{token}.{n}.tmp`, hidden, and unique
    /// also across processes (of other PID namespaces, too) sharing the directory.
    fn temp_path(&self, key: &ChunkKey) -> PathBuf {
        let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        self.dir.join(format!(".{}.{:016x}.{n}{TEMP_SUFFIX}", key.file_name(), process_token()))
    }

    /// Opens the file to write a chunk under `key` into, locked exclusively until the returned
    /// file is dropped: the kept spare where no reader holds it, else a new temporary file.
    fn open_temp(&self, key: &ChunkKey) -> Result<Temp, StoreError> {
        if let Some(spare) = self.spare.take() {
            let reusable = OpenOptions::new().write(true).open(&spare).ok().filter(|f| locked_as(f, &spare));
            if let Some(file) = reusable {
                return Ok(Temp { path: spare, file, reused: true });
            }
            // A fetch that opened it while it was still the chunk is reading it (leave it to them),
            // or a store opening this directory removed it.
            let _ = fs::remove_file(&spare);
        }
        for _ in 0..CREATE_ATTEMPTS {
            let temp = self.temp_path(key);
            let created = OpenOptions::new().write(true).create_new(true).open(&temp);
            let file = match created {
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                other => {
                    other.map_err(|source| StoreError::Io { op: "create", path: temp.clone(), source })?
                }
            };
            // A store opening this directory between the create and the lock removes the file.
            match try_lock_exclusive(&file) {
                Ok(true) if is_named(&file, &temp) => return Ok(Temp { path: temp, file, reused: false }),
                Ok(_) => continue,
                Err(source) => {
                    let _ = fs::remove_file(&temp);
                    return Err(StoreError::Io { op: "lock", path: temp, source });
                }
            }
        }
        Err(StoreError::Io {
            op: "create",
            path: self.dir.clone(),
            source: io::Error::other("temporary files kept vanishing before they could be locked"),
        })
    }

    /// Starts flushing a chunk as `descriptor` says, whose payload comes in pieces, in order
    /// ([`ChunkWriter::append`]): the pieces go to the chunk's file as they come, so that a
    /// payload still being produced (gathered, say: [`crate::KvCache::gather_streamed`]) is
    /// written meanwhile. [`ChunkWriter::finish`] puts the chunk in place, as
    /// [`ChunkStore::put`] does; a writer dropped before leaves no chunk and no file behind.
    pub fn begin_put(&self, descriptor: &ChunkDescriptor) -> Result<ChunkWriter<'_>, StoreError> {
        descriptor
            .validate()
            .map_err(|source| StoreError::Chunk { key: descriptor.key().file_name(), source })?;
        let key = descriptor.key();
        let temp = self.open_temp(&key)?;
        Ok(ChunkWriter {
            store: self,
            path: self.path_of(&key),
            descriptor: descriptor.clone(),
            temp: Some(temp),
            written: 0,
            checksum: Checksum::new(),
        })
    }

    /// Flushes the region `plan` gathers from `cache` as `descriptor` says, through `staging`
    /// (exactly the region's packed length): the buffered flush, with each piece of the payload
    /// checksummed and written as soon as it and those before it are gathered
    /// ([`KvCache::gather_streamed`], with as many gather threads as the cache allows:
    /// [`KvCache::set_copy_threads`]), so that the write costs little more than the gather.
    pub fn put_gathered(
        &self,
        descriptor: &ChunkDescriptor,
        cache: &KvCache,
        plan: &GatherPlan,
        staging: &mut [u8],
    ) -> Result<(), StoreError> {
        check_gathered(descriptor, plan, staging)?;
        let mut writer = self.begin_put(descriptor)?;
        let mut failed = None;
        cache
            .gather_streamed(plan, staging, GATHERED_PIECE, |piece| match writer.append(piece) {
                Ok(()) => true,
                Err(e) => {
                    failed = Some(e);
                    false
                }
            })
            .map_err(|e| StoreError::Gather(Box::new(e)))?;
        match failed {
            Some(e) => Err(e),
            None => writer.finish(),
        }
    }

    /// Writes `header` into `temp`, whose payload of `payload_len` bytes is in; a reused spare
    /// longer than them is cut after.
    fn seal(&self, temp: &Temp, header: &[u8], payload_len: u64) -> Result<(), StoreError> {
        let Temp { path, file, reused } = temp;
        let io_err = |op| move |source| StoreError::Io { op, path: path.to_path_buf(), source };
        self.io.write_all_at(file, header, 0).map_err(io_err("write"))?;
        if *reused {
            file.set_len(header.len() as u64 + payload_len).map_err(io_err("resize"))?;
        }
        if self.sync {
            file.sync_data().map_err(io_err("sync"))?;
        }
        Ok(())
    }

    /// Opens the chunk file under `key` and locks it shared, so that no flush rewrites it (as a
    /// spare) while it is read; opened again while flushes swap another file in under the name.
    fn open_for_reading(&self, key: &ChunkKey, path: &Path) -> Result<File, StoreError> {
        let io_err = |op| move |source| StoreError::Io { op, path: path.to_path_buf(), source };
        let not_found = || StoreError::NotFound(Box::new(key.clone()));
        for _ in 0..READ_ATTEMPTS {
            let file = match File::open(path) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(not_found()),
                other => other.map_err(io_err("open"))?,
            };
            lock_shared(&file).map_err(io_err("lock"))?;
            // The name may have moved on to another file between the open and the lock: open
            // it again (which reports a name now gone, too).
            if is_named(&file, path) {
                return Ok(file);
            }
        }
        Err(io_err("open")(io::Error::other("the chunk was replaced faster than it could be read")))
    }

    /// Moves the written `temp` to `path`. Where a chunk file is already there, the two are
    /// exchanged atomically; returns the displaced file (now at `temp`), if any.
    fn install(&self, temp: &Path, path: &Path) -> Result<Option<PathBuf>, StoreError> {
        let replaces_a_file = fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_file());
        if replaces_a_file {
            match exchange(temp, path) {
                Ok(()) => match fs::symlink_metadata(temp) {
                    Ok(m) if m.file_type().is_file() => return Ok(Some(temp.to_path_buf())),
                    // Removed at once by a store opening this directory: nothing to keep.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
                    // Something other than a chunk was put there meanwhile: put it back.
                    _ => {
                        let _ = exchange(temp, path);
                        return Err(StoreError::Io {
                            op: "rename",
                            path: path.to_path_buf(),
                            source: io::Error::other("the chunk's name is not a regular file"),
                        });
                    }
                },
                // Gone meanwhile, or a file system without exchange: a plain rename does.
                Err(e) if is_exchange_unavailable(&e) => {}
                Err(source) => return Err(StoreError::Io { op: "rename", path: path.to_path_buf(), source }),
            }
        }
        fs::rename(temp, path).map(|()| None).map_err(|source| StoreError::Io {
            op: "rename",
            path: path.to_path_buf(),
            source,
        })
    }
}

/// A file a flush writes before moving it into place.
struct Temp {
    path: PathBuf,
    /// Open for writing and locked exclusively: no fetch reads it, no store opening the
    /// directory removes it.
    file: File,
    /// A spare that held a chunk before, perhaps longer than this one.
    reused: bool,
}

/// A chunk being flushed to a [`FileStore`] piece by piece: see [`FileStore::begin_put`].
pub struct ChunkWriter<'a> {
    store: &'a FileStore,
    descriptor: ChunkDescriptor,
    /// Where the chunk goes once finished.
    path: PathBuf,
    /// The file written meanwhile (`None` once finished).
    temp: Option<Temp>,
    /// Payload bytes appended so far.
    written: u64,
    checksum: Checksum,
}

impl ChunkWriter<'_> {
    /// Writes the next `bytes` of the payload.
    pub fn append(&mut self, bytes: &[u8]) -> Result<(), StoreError> {
        let expected = self.descriptor.payload_len();
        let got = self.written + bytes.len() as u64;
        if got > expected {
            return Err(StoreError::PayloadLength { expected, got });
        }
        let temp = self.temp.as_ref().expect("a writer holds its file until finished");
        self.store
            .io
            .write_all_at(&temp.file, bytes, HEADER_LEN as u64 + self.written)
            .map_err(|source| StoreError::Io { op: "write", path: temp.path.clone(), source })?;
        self.checksum.update(bytes);
        self.written = got;
        Ok(())
    }

    /// Writes the header, once the whole payload is in, and puts the chunk in place (replacing
    /// one with the same key). A payload shorter than the descriptor says is refused, and
    /// nothing is left behind.
    pub fn finish(mut self) -> Result<(), StoreError> {
        let expected = self.descriptor.payload_len();
        if self.written != expected {
            return Err(StoreError::PayloadLength { expected, got: self.written });
        }
        let temp = self.temp.take().expect("a writer holds its file until finished");
        let store = self.store;
        let header = self.descriptor.encode_header_with_checksum(self.written, self.checksum.digest());
        // The file stays open, and locked, until it is in place.
        let installed =
            store.seal(&temp, &header, self.written).and_then(|()| store.install(&temp.path, &self.path));
        let Temp { path: temp, file, .. } = temp;
        drop(file);
        let displaced = match installed {
            Ok(displaced) => displaced,
            Err(e) => {
                let _ = fs::remove_file(&temp);
                return Err(e);
            }
        };
        if store.sync {
            // The displaced file is rewritten only once the exchange is on disk: before, a crash
            // could find the chunk's name still on it.
            if let Err(source) = File::open(&store.dir).and_then(|d| d.sync_all()) {
                if let Some(displaced) = displaced {
                    let _ = fs::remove_file(displaced);
                }
                return Err(StoreError::Io { op: "sync directory", path: store.dir.clone(), source });
            }
        }
        if let Some(displaced) = displaced {
            store.spare.keep(displaced);
        }
        Ok(())
    }
}

impl std::fmt::Debug for ChunkWriter<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkWriter")
            .field("path", &self.path)
            .field("written", &self.written)
            .field("expected", &self.descriptor.payload_len())
            .finish()
    }
}

impl Drop for ChunkWriter<'_> {
    fn drop(&mut self) {
        // Abandoned before it was put in place (a write failed, say: the disk is full), so
        // never under the chunk's name: removed, a spare it reused too.
        if let Some(Temp { path, file, .. }) = self.temp.take() {
            drop(file);
            let _ = fs::remove_file(path);
        }
    }
}

/// Times a fetch opens a chunk again because a flush replaced it meanwhile.
const READ_ATTEMPTS: usize = 64;

/// Times a flush makes a new temporary file because another store removed the last one first.
const CREATE_ATTEMPTS: usize = 8;

/// Whether `file` is now locked exclusively by us and still the file named `path` (a store
/// opening the directory may have removed it before the lock).
fn locked_as(file: &File, path: &Path) -> bool {
    try_lock_exclusive(file).unwrap_or(false) && is_named(file, path)
}

/// Whether `path` names `file`.
fn is_named(file: &File, path: &Path) -> bool {
    match (file.metadata(), fs::symlink_metadata(path)) {
        (Ok(opened), Ok(named)) => opened.dev() == named.dev() && opened.ino() == named.ino(),
        _ => false,
    }
}

/// Locks `file` exclusively if nobody holds a lock on it: `Ok(false)` if someone does.
fn try_lock_exclusive(file: &File) -> io::Result<bool> {
    try_flock(file, libc::LOCK_EX)
}

/// `flock(file, how | LOCK_NB)`: `Ok(false)` if another holds a conflicting lock.
fn try_flock(file: &File, how: i32) -> io::Result<bool> {
    loop {
        // SAFETY: flock on a descriptor `file` owns; the lock goes with the descriptor when it closes.
        if unsafe { libc::flock(file.as_raw_fd(), how | libc::LOCK_NB) } == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(false),
            _ => return Err(e),
        }
    }
}

/// How long a fetch waits for a flush's exclusive lock on the file it opened. A flush holds it
/// for one write; longer means its holder is stopped, or a child forked meanwhile inherited it
/// (flock locks belong to the open file, which a fork shares).
const LOCK_PATIENCE: Duration = Duration::from_secs(10);

/// Locks `file` shared, waiting (polling, backing off up to 5 ms) at most [`LOCK_PATIENCE`] for
/// an exclusive holder (a flush writing it) to finish.
fn lock_shared(file: &File) -> io::Result<()> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(50);
    while !try_flock(file, libc::LOCK_SH)? {
        if start.elapsed() > LOCK_PATIENCE {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("a writer has held the file locked for over {LOCK_PATIENCE:?}"),
            ));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(5));
    }
    Ok(())
}

/// A random number fixed for the life of the process, naming its temporary files.
fn process_token() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static TOKEN: OnceLock<u64> = OnceLock::new();
    // The standard library seeds each `RandomState` from the OS's random source.
    *TOKEN.get_or_init(|| {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        hasher.finish()
    })
}

/// The one displaced chunk file a [`FileStore`] keeps to write into; removed with the last clone.
#[derive(Default)]
struct Spare(Mutex<Option<PathBuf>>);

impl Spare {
    fn take(&self) -> Option<PathBuf> {
        self.0.lock().take()
    }

    /// Keeps `path` unless a spare is already kept, in which case `path` is removed.
    fn keep(&self, path: PathBuf) {
        let mut slot = self.0.lock();
        if slot.is_none() {
            *slot = Some(path);
        } else {
            drop(slot);
            let _ = fs::remove_file(path);
        }
    }
}

impl Drop for Spare {
    fn drop(&mut self) {
        if let Some(path) = self.0.get_mut().take() {
            let _ = fs::remove_file(path);
        }
    }
}

/// Atomically exchanges the directory entries `a` and `b` (`renameat2` with `RENAME_EXCHANGE`).
fn exchange(a: &Path, b: &Path) -> io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).map_err(io::Error::other);
    let (a, b) = (c(a)?, c(b)?);
    // SAFETY: both are valid NUL-terminated paths that outlive the call; relative paths resolve
    // against the working directory, as `fs::rename`'s do.
    let rc = unsafe {
        libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), libc::RENAME_EXCHANGE)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether an exchange failed because a plain rename must do: the target vanished, or the file
/// system (or kernel) has no exchange.
fn is_exchange_unavailable(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP))
}

/// Removes the temporary files in `dir` that nobody is writing (a flush holds an exclusive lock on
/// its file until it is in place) or reading (a fetch of a chunk just displaced): those of flushes
/// a crash interrupted, and spares. Best effort; a file it cannot lock or remove is left alone.
fn remove_unheld_temps(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        if !entry.file_name().to_str().is_some_and(is_temp_name) {
            continue;
        }
        let path = entry.path();
        // Held while removed: a flush that opened it as its spare meanwhile finds it gone. (Opened
        // for writing: where flock is emulated with record locks, an exclusive one needs it.)
        if let Ok(file) = OpenOptions::new().write(true).open(&path) {
            if locked_as(&file, &path) {
                let _ = fs::remove_file(&path);
            }
        }
    }
}

/// Whether `name` is one of [`FileStore::temp_path`]'s: `.{key}.{token}.{n}.tmp`, the key a
/// chunk file's name (`.djv`), the token 16 hex digits.
fn is_temp_name(name: &str) -> bool {
    let Some(stem) = name.strip_prefix('.').and_then(|n| n.strip_suffix(TEMP_SUFFIX)) else { return false };
    let mut fields = stem.rsplitn(3, '.');
    let n = fields.next().is_some_and(|f| f.parse::<u64>().is_ok());
    let token = fields.next().is_some_and(|f| f.len() == 16 && u64::from_str_radix(f, 16).is_ok());
    n && token && fields.next().is_some_and(|key| key.ends_with(".djv"))
}

impl ChunkStore for FileStore {
    fn put(&mut self, descriptor: &ChunkDescriptor, payload: &[u8]) -> Result<(), StoreError> {
        check_payload(descriptor, payload)?;
        let mut writer = self.begin_put(descriptor)?;
        writer.append(payload)?;
        writer.finish()
    }

    fn put_gathered(
        &mut self,
        descriptor: &ChunkDescriptor,
        cache: &KvCache,
        plan: &GatherPlan,
        staging: &mut [u8],
    ) -> Result<Duration, StoreError> {
        FileStore::put_gathered(self, descriptor, cache, plan, staging)?;
        Ok(Duration::ZERO)
    }

    fn get(&mut self, key: &ChunkKey, out: &mut Vec<u8>) -> Result<ChunkDescriptor, StoreError> {
        let path = self.path_of(key);
        let io_err = |op| {
            let path = path.clone();
            move |source| StoreError::Io { op, path, source }
        };
        let file = self.open_for_reading(key, &path)?;
        let size = file.metadata().map_err(io_err("stat"))?.len();
        let corrupt = |source| StoreError::Chunk { key: path.display().to_string(), source };
        if size < HEADER_LEN as u64 {
            return Err(corrupt(ChunkError::Truncated { expected: HEADER_LEN as u64, got: size }));
        }
        let mut header = [0u8; HEADER_LEN];
        self.io.read_exact_at(&file, &mut header, 0).map_err(io_err("read"))?;
        let (descriptor, len, sum) = ChunkDescriptor::decode_header(&header).map_err(corrupt)?;
        let expected = (HEADER_LEN as u64).saturating_add(len);
        if size != expected {
            return Err(corrupt(ChunkError::Truncated { expected, got: size }));
        }
        if descriptor.key() != *key {
            return Err(corrupt(ChunkError::Invalid(format!("file holds {:?}", descriptor.key()))));
        }
        out.clear();
        out.resize(len as usize, 0);
        self.io.read_exact_at(&file, out, HEADER_LEN as u64).map_err(io_err("read"))?;
        verify_payload(out, sum).map_err(corrupt)?;
        Ok(descriptor)
    }
}
