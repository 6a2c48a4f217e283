//! The paper's baseline: one transfer per extent instead of one buffered transfer.
//!
//! Used by benchmarks to measure what buffered copies save; it writes the same bytes, in the same
//! chunk format, as a buffered flush to a [`crate::store::FileStore`].

use std::fs::OpenOptions;
use std::path::Path;

use crate::checksum::Checksum;

use crate::cache::{ExtentError, KvCache};
use crate::chunk::{ChunkDescriptor, HEADER_LEN};
use crate::file_io::FileIo;
use crate::region::KvRegion;
use crate::store::StoreError;

/// Flushes `descriptor`'s chunk to the file at `path` with one positional write per extent of
/// `source_region` in `cache`, then the header. Returns the number of writes.
pub fn flush_per_extent(
    cache: &KvCache,
    source_region: &KvRegion,
    descriptor: &ChunkDescriptor,
    io: &FileIo,
    path: &Path,
) -> Result<u64, ExtentError<StoreError>> {
    let io_err = |op| move |source| StoreError::Io { op, path: path.to_path_buf(), source };
    if source_region.shape() != descriptor.region.shape() {
        let expected = descriptor.payload_len();
        let got = cache.packed_len(source_region);
        return Err(ExtentError::Callback(StoreError::PayloadLength { expected, got }));
    }
    let file = OpenOptions::new()
        .write(true)
        .read(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(|e| ExtentError::Callback(io_err("create")(e)))?;
    let mut writes = 0;
    let mut hasher = Checksum::new();
    let mut next = Some(0u64);
    cache.for_each_extent(source_region, descriptor.packing, |piece, offset| {
        writes += 1;
        // Extents of a layout's own packing arrive in packed order, so the checksum streams.
        next = next.filter(|&n| n == offset).map(|n| n + piece.len() as u64);
        if next.is_some() {
            hasher.update(piece);
        }
        io.write_all_at(&file, piece, HEADER_LEN as u64 + offset).map_err(io_err("write"))
    })?;
    let checksum = match next {
        Some(_) => hasher.digest(),
        None => {
            let mut payload = vec![0u8; descriptor.payload_len() as usize];
            io.read_exact_at(&file, &mut payload, HEADER_LEN as u64)
                .map_err(|e| ExtentError::Callback(io_err("read")(e)))?;
            crate::checksum::xxh3_64(&payload)
        }
    };
    let header = descriptor.encode_header_with_checksum(descriptor.payload_len(), checksum);
    io.write_all_at(&file, &header, 0).map_err(|e| ExtentError::Callback(io_err("write")(e)))?;
    Ok(writes + 1)
}
