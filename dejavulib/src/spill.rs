//! The spill tier of a [`crate::HostStore`]: chunks beyond its memory budget go to files in a
//! directory, optionally capped in size (a size-capped directory, whatever the file system: the
//! cap counts every file in it, the store's own and any other).
//!
//! A spill that cannot be written (the directory is full or over its cap, the disk failed) is not
//! an error for the caller: the chunk stays in memory, over the budget, and the failure is
//! counted. Nothing is lost to a full disk; memory grows instead, and the counters say so.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

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
}

static TEMP: AtomicU64 = AtomicU64::new(0);

impl Spill {
    /// Writes `encoded` as `name` in the directory: to a temporary file first, renamed into
    /// place, so a failed write leaves nothing that looks like a chunk.
    pub(crate) fn write(&self, name: &str, encoded: &[u8]) -> io::Result<PathBuf> {
        fs::create_dir_all(&self.dir)?;
        if let Some(cap) = self.dir_bytes {
            let used = dir_usage(&self.dir)?;
            if used + encoded.len() as u64 > cap {
                let full = format!("spill directory {} holds {used} of its {cap} bytes", self.dir.display());
                return Err(io::Error::other(full));
            }
        }
        let path = self.dir.join(name);
        let temp = self.dir.join(format!(
            ".{name}.{}.{}.tmp",
            std::process::id(),
            TEMP.fetch_add(1, Ordering::Relaxed)
        ));
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
