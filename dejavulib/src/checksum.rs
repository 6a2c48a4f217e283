//! The checksum that chunks, frames and chunk files carry: xxh3-64.
//!
//! Computed with the widest vector instructions the CPU offers, chosen at run time (AVX2 on most
//! x86-64 servers), so a portable build hashes as fast as one built for the machine: every byte
//! a peer receives is hashed once, on the receive path's critical core.

use std::hash::Hasher;

use twox_hash::XxHash3_64;

/// The xxh3-64 checksum of `bytes` (seed 0).
pub fn xxh3_64(bytes: &[u8]) -> u64 {
    XxHash3_64::oneshot(bytes)
}

/// An xxh3-64 checksum computed piece by piece: the same value as [`xxh3_64`] of the pieces joined.
#[derive(Default)]
pub struct Checksum(XxHash3_64);

impl Checksum {
    /// A checksum of no bytes yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the bytes that follow those already added.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }

    /// The checksum of every byte added so far.
    pub fn digest(&self) -> u64 {
        self.0.finish()
    }
}

impl std::fmt::Debug for Checksum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Checksum").field(&self.digest()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values_and_pieces_agree_with_the_whole() {
        // Reference values of XXH3_64bits with seed 0.
        assert_eq!(xxh3_64(b""), 0x2d06_8005_38d3_94c2);
        let bytes: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let whole = xxh3_64(&bytes);
        for piece in [1, 63, 64, 240, 1024, 4096, 99_999] {
            let mut sum = Checksum::new();
            bytes.chunks(piece).for_each(|p| sum.update(p));
            assert_eq!(sum.digest(), whole, "pieces of {piece}");
        }
    }
}
