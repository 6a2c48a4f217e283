//! The spill tier of a [`crate::HostStore`]: chunks beyond its memory budget go to files in a
//! directory, optionally capped in size (a size-capped directory, whatever the file system: the
//! cap counts every file in it, the store's own and any other; the others are measured at most
//! every 50 ms). The directory is the store's: chunk files found there when it starts, left by a
//! store before it, are removed. Files are written and read outside the store's lock.
//!
//! A spill that cannot be written (the directory is full or over its cap, the disk failed) is not
//! an error for the caller: the chunk stays in memory, over the budget, and the failure is
//! counted. Nothing is lost to a full disk; memory grows instead, and the counters say so.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Where and when a [`crate::HostStore`] spills.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spill {
    /// The directory (created if missing), one file per spilled chunk.
    pub dir: PathBuf,
    /// Bytes of chunks held in memory before new ones go to the directory.
    pub memory_bytes: u64,
    /// Bytes the directory may hold in all, if capped: a spill that would exceed it fails as on a
    /// full disk.
    pub dir_bytes: Option<u64>,
}

/// How a store's bytes are split between memory and its spill directory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreUsage {
    /// Bytes of chunks in memory (header and payload).
    pub memory_bytes: u64,
    /// Bytes of chunks in spill files.
    pub spilled_bytes: u64,
    /// Chunks in spill files.
    pub spilled_chunks: u64,
    /// Chunks that should have been spilled but could not be (kept in memory instead).
    pub spill_failures: u64,
    /// Chunks dropped because a new sequence started where they were
    /// ([`crate::HostStore::keeping_current_sequences`]).
    pub replaced_chunks: u64,
    /// Bytes of those chunks.
    pub replaced_bytes: u64,
    /// Chunks dropped because their sequence was released ([`crate::ChunkStore::release`]).
    pub released_chunks: u64,
    /// Bytes of those chunks.
    pub released_bytes: u64,
}

static TEMP: AtomicU64 = AtomicU64::new(0);

/// How often a capped directory is measured again: what other files take changes rarely, and a
/// scan per spill would cost one `stat` per file already there.
const RESCAN: Duration = Duration::from_millis(50);

/// A store's spill directory in use: its settings, and what other files took up when last
/// measured.
#[derive(Debug)]
pub(crate) struct SpillDir {
    config: Spill,
    /// When the directory was last measured, and the bytes of the files that were not the
    /// store's.
    others: Mutex<Option<(Instant, u64)>>,
}

impl SpillDir {
    /// The spill directory `config` names. Chunk files a store left there before (a sidecar
    /// killed, then started again on the same directory) are removed: no store knows them.
    pub(crate) fn new(config: Spill) -> Self {
        if let Ok(entries) = fs::read_dir(&config.dir) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.ends_with(".djv") || (name.starts_with('.') && name.ends_with(".tmp")) {
                    let _ = fs::remove_file(entry.path());
                }
            }
        }
        Self { config, others: Mutex::new(None) }
    }

    /// Bytes of chunks held in memory before new ones spill.
    pub(crate) fn memory_bytes(&self) -> u64 {
        self.config.memory_bytes
    }

    /// Writes `encoded` as `name` in the directory, where the store's own spill files take
    /// `ours` bytes: to a temporary file first, renamed into place, so a failed write leaves
    /// nothing that looks like a chunk. Fails, as on a full disk, if the directory's cap would be
    /// exceeded.
    pub(crate) fn write(&self, name: &str, encoded: &[u8], ours: u64) -> io::Result<PathBuf> {
        let dir = &self.config.dir;
        fs::create_dir_all(dir)?;
        if let Some(cap) = self.config.dir_bytes {
            let mut measured = self.others.lock();
            let others = match *measured {
                Some((at, others)) if at.elapsed() < RESCAN => others,
                _ => {
                    let others = dir_usage(dir)?.saturating_sub(ours);
                    *measured = Some((Instant::now(), others));
                    others
                }
            };
            let used = ours + others;
            if used + encoded.len() as u64 > cap {
                let full = format!("spill directory {} holds {used} of its {cap} bytes", dir.display());
                return Err(io::Error::other(full));
            }
        }
        let dir = &self.config.dir;
        let path = dir.join(name);
        let temp =
            dir.join(format!(".{name}.{}.{}.tmp", std::process::id(), TEMP.fetch_add(1, Ordering::Relaxed)));
        let written = fs::write(&temp, encoded).and_then(|()| fs::rename(&temp, &path));
        if let Err(e) = written {
            let _ = fs::remove_file(&temp);
            return Err(e);
        }
        Ok(path)
    }
}

/// Bytes of the files directly in `dir`.
fn dir_usage(dir: &Path) -> io::Result<u64> {
    let mut used = 0;
    for entry in fs::read_dir(dir)? {
        let meta = entry?.metadata()?;
        if meta.is_file() {
            used += meta.len();
        }
    }
    Ok(used)
}
