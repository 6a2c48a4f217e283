//! The shared-memory region between an engine and its sidecar: a file (under `/dev/shm` by
//! default) that both map. The engine writes a chunk (header and payload, as on the wire) into it
//! for its sidecar to keep and forward; the sidecar writes a chunk into it for the engine to
//! restore. The local control socket orders the requests, one at a time: each side touches the
//! region only between a request and its reply, so it needs no locks of its own. What one side
//! reads, it copies and verifies (the chunk's checksum) before trusting it, since the other process
//! could misbehave; each engine connection gets a region of its own, so a fenced engine can only
//! write into one nobody reads any more.
//!
//! What this cannot defend against: a process that truncates the file while the other has it
//! mapped makes the other's next access fault (SIGBUS). The file lives in a directory of the
//! cluster's own and is removed as soon as both sides have mapped it (after which no one can open
//! it to truncate it); until then, engine and sidecar trust each other not to.
//!
//! Layout: a 64-byte header (magic `DJVSHM01`, capacity `u64`, epoch `u64`, little-endian), then
//! `capacity` bytes. Opening checks the file's size, the magic, the capacity and the epoch
//! announced over the socket, so a file of the wrong size or another incarnation's file is a
//! typed error.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};

use memmap2::MmapMut;
use thiserror::Error;

/// The magic at the start of a region.
const MAGIC: [u8; 8] = *b"DJVSHM01";
/// Bytes of the header before the data.
pub const HEADER_LEN: usize = 64;

/// Errors of creating, opening and using a region.
#[derive(Debug, Error)]
pub enum ShmError {
    /// The file cannot be created, opened or mapped.
    #[error("shared memory {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not as long as the region announced.
    #[error("shared memory {path} is {found} bytes, not the {expected} announced")]
    WrongSize {
        /// The file.
        path: PathBuf,
        /// Header and capacity.
        expected: u64,
        /// Its length.
        found: u64,
    },
    /// The file does not hold the region announced (another magic, capacity or epoch).
    #[error("shared memory {path}: {what}")]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// What differs.
        what: String,
    },
    /// A chunk longer than the region. The sidecar sizes the region (`dejavud sidecar
    /// --region-bytes`); the largest chunk is a whole step's KV on the stage.
    #[error(
        "a chunk of {len} bytes does not fit the sidecar's shared region of {capacity} bytes: start \
         the sidecar with a larger --region-bytes, or report smaller steps (fewer slots or tokens at once)"
    )]
    TooLarge {
        /// The chunk's bytes.
        len: usize,
        /// The region's capacity.
        capacity: usize,
    },
}

/// A mapped region. The one that created it removes its file when dropped (the other side's
/// mapping stays valid until it unmaps).
pub struct SharedRegion {
    map: MmapMut,
    path: PathBuf,
    owner: bool,
}

impl SharedRegion {
    /// Creates a region of `capacity` data bytes for `epoch` at `path`, which must not exist.
    pub fn create(path: &Path, capacity: usize, epoch: u64) -> Result<Self, ShmError> {
        let io = |source| ShmError::Io { path: path.to_owned(), source };
        let file = OpenOptions::new().read(true).write(true).create_new(true).open(path).map_err(io)?;
        let made = (|| {
            file.set_len((HEADER_LEN + capacity) as u64)?;
            // SAFETY: the file was just created by this process with create_new, so nothing else
            // maps or truncates it yet; the mapping covers exactly the length set above.
            unsafe { MmapMut::map_mut(&file) }
        })();
        let mut map = match made {
            Ok(map) => map,
            Err(e) => {
                let _ = std::fs::remove_file(path);
                return Err(io(e));
            }
        };
        map[..8].copy_from_slice(&MAGIC);
        map[8..16].copy_from_slice(&(capacity as u64).to_le_bytes());
        map[16..24].copy_from_slice(&epoch.to_le_bytes());
        Ok(Self { map, path: path.to_owned(), owner: true })
    }

    /// Opens the region of `capacity` data bytes for `epoch` that the other side created at `path`.
    pub fn open(path: &Path, capacity: usize, epoch: u64) -> Result<Self, ShmError> {
        let io = |source| ShmError::Io { path: path.to_owned(), source };
        let mismatch = |what: String| ShmError::Mismatch { path: path.to_owned(), what };
        let file = OpenOptions::new().read(true).write(true).open(path).map_err(io)?;
        let expected = (HEADER_LEN + capacity) as u64;
        let found = file.metadata().map_err(io)?.len();
        if found != expected {
            return Err(ShmError::WrongSize { path: path.to_owned(), expected, found });
        }
        // SAFETY: the file has the length checked just above, and the mapping covers exactly it.
        // The sidecar that created it never truncates it and removes it once mapped, so nothing
        // else can (see the module's notes on what a misbehaving process could do). Writes by the
        // other process follow the request/reply protocol described above.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(io)?;
        if map[..8] != MAGIC {
            return Err(mismatch("not a DéjàVu shared region (bad magic)".into()));
        }
        let field = |at: usize| u64::from_le_bytes(map[at..at + 8].try_into().expect("8 bytes"));
        if field(8) != capacity as u64 {
            return Err(mismatch(format!("a capacity of {}, not {capacity}", field(8))));
        }
        if field(16) != epoch {
            return Err(mismatch(format!("the region of epoch {}, not {epoch}", field(16))));
        }
        Ok(Self { map, path: path.to_owned(), owner: false })
    }

    /// Its file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Data bytes it holds.
    pub fn capacity(&self) -> usize {
        self.map.len() - HEADER_LEN
    }

    /// Writes `parts`, one after the other, at the start of the data; returns the bytes written.
    pub fn write(&mut self, parts: &[&[u8]]) -> Result<usize, ShmError> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len > self.capacity() {
            return Err(ShmError::TooLarge { len, capacity: self.capacity() });
        }
        let mut at = HEADER_LEN;
        for part in parts {
            self.map[at..at + part.len()].copy_from_slice(part);
            at += part.len();
        }
        Ok(len)
    }

    /// The first `len` data bytes, to write in place (a gather straight into the region).
    pub fn data_mut(&mut self, len: usize) -> Result<&mut [u8], ShmError> {
        if len > self.capacity() {
            return Err(ShmError::TooLarge { len, capacity: self.capacity() });
        }
        Ok(&mut self.map[HEADER_LEN..HEADER_LEN + len])
    }

    /// The first `len` data bytes.
    pub fn read(&self, len: usize) -> Result<&[u8], ShmError> {
        if len > self.capacity() {
            return Err(ShmError::TooLarge { len, capacity: self.capacity() });
        }
        Ok(&self.map[HEADER_LEN..HEADER_LEN + len])
    }

    /// Removes the file now (both sides have mapped it: the memory lives until both unmap), so
    /// that a process killed later leaves nothing behind.
    pub fn unlink(&mut self) {
        if self.owner {
            let _ = std::fs::remove_file(&self.path);
            self.owner = false;
        }
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        self.unlink();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_one_side_writes_the_other_reads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("region");
        let mut sidecar = SharedRegion::create(&path, 1000, 7).unwrap();
        let mut engine = SharedRegion::open(&path, 1000, 7).unwrap();
        assert_eq!(engine.write(&[b"chunk ", b"header", b" and payload"]).unwrap(), 24);
        assert_eq!(sidecar.read(24).unwrap(), b"chunk header and payload");
        sidecar.write(&[&[9u8; 1000]]).unwrap();
        assert_eq!(engine.read(1000).unwrap(), &[9u8; 1000][..]);
        assert!(matches!(engine.write(&[&[0u8; 1001]]), Err(ShmError::TooLarge { len: 1001, .. })));
        assert!(matches!(engine.read(1001), Err(ShmError::TooLarge { .. })));
        // The file goes once both have mapped it; the memory stays shared.
        sidecar.unlink();
        assert!(!path.exists());
        engine.write(&[b"still shared"]).unwrap();
        assert_eq!(sidecar.read(12).unwrap(), b"still shared");
    }

    #[test]
    fn a_wrong_file_is_a_typed_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("region");
        let _sidecar = SharedRegion::create(&path, 4096, 2).unwrap();
        assert!(matches!(SharedRegion::create(&path, 4096, 2), Err(ShmError::Io { .. })), "it exists");
        let wrong = SharedRegion::open(&path, 8192, 2).err().unwrap();
        assert!(
            matches!(wrong, ShmError::WrongSize { expected, found, .. } if expected == 8256 && found == 4160)
        );
        assert!(wrong.to_string().contains("not the 8256 announced"), "{wrong}");
        let stale = SharedRegion::open(&path, 4096, 1).err().unwrap();
        assert!(stale.to_string().contains("epoch 2, not 1"), "{stale}");
        let other = dir.path().join("other");
        std::fs::write(&other, vec![0u8; HEADER_LEN + 16]).unwrap();
        let bad = SharedRegion::open(&other, 16, 0).err().unwrap();
        assert!(bad.to_string().contains("bad magic"), "{bad}");
        assert!(matches!(SharedRegion::open(&dir.path().join("none"), 16, 0), Err(ShmError::Io { .. })));
    }
}
