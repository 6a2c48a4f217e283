//! Self-describing, checksummed chunks: what a flush writes and a fetch verifies.
//!
//! A chunk is a fixed 104-byte header followed by a packed payload (see [`crate::layout::Packing`]).
//! The header names the destination and the region, in the destination's local coordinates, so a
//! receiver can place a chunk without any other context. All integers are little-endian:
//!
//! | offset | field |
//! | --- | --- |
//! | 0 | magic `DJVK` |
//! | 4 | version (u16, 1) |
//! | 6 | header length (u16, 104) |
//! | 8 | flags (u32, 0) |
//! | 12 | source stage, source rank (u32 each) |
//! | 20 | destination stage, destination rank (u32 each) |
//! | 28 | microbatch (u32) |
//! | 32 | layers, slots, heads, tokens: start and end (u32 each) |
//! | 64 | head_dim (u32) |
//! | 68 | dtype code (u8), scale mode (u8), reserved (u16) |
//! | 72 | K chunk, V chunk of the packing (u32 each) |
//! | 80 | payload length (u64) |
//! | 88 | xxh3-64 of the payload |
//! | 96 | xxh3-64 of bytes 0..96 |

use std::ops::Range;

use crate::checksum::xxh3_64;
use thiserror::Error;

use crate::layout::Packing;
use crate::placement::WorkerId;
use crate::region::KvRegion;
use crate::spec::{DType, KvSpec, ScaleMode};

/// Magic bytes at the start of every chunk.
pub const CHUNK_MAGIC: [u8; 4] = *b"DJVK";
/// Current chunk format version.
pub const CHUNK_VERSION: u16 = 1;
/// Bytes of a chunk header.
pub const HEADER_LEN: usize = 104;

/// Errors decoding or verifying a chunk.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ChunkError {
    /// The bytes do not start with [`CHUNK_MAGIC`].
    #[error("not a chunk: bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// A version this build cannot read.
    #[error("unsupported chunk version {0}")]
    UnsupportedVersion(u16),
    /// Fewer bytes than the header or payload length says.
    #[error("truncated chunk: {got} bytes of {expected}")]
    Truncated {
        /// Bytes expected.
        expected: u64,
        /// Bytes present.
        got: u64,
    },
    /// The header checksum does not match.
    #[error("chunk header checksum mismatch")]
    HeaderCorrupt,
    /// The payload checksum does not match.
    #[error("chunk payload checksum mismatch: header says {expected:016x}, payload hashes to {actual:016x}")]
    PayloadCorrupt {
        /// Checksum in the header.
        expected: u64,
        /// Checksum of the bytes received.
        actual: u64,
    },
    /// A field holds an impossible value.
    #[error("invalid chunk header: {0}")]
    Invalid(String),
}

/// What a chunk holds and where it goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkDescriptor {
    /// Worker that produced it.
    pub source: WorkerId,
    /// Worker it is for.
    pub destination: WorkerId,
    /// Microbatch at the destination.
    pub microbatch: u32,
    /// Region at the destination, in its local coordinates.
    pub region: KvRegion,
    /// Elements of the payload (layers and heads equal the region's).
    pub spec: KvSpec,
    /// Order of the payload.
    pub packing: Packing,
}

/// Where a sequence's KV lives at a worker: a microbatch and its slots. Releasing it drops every
/// chunk kept there ([`crate::ChunkStore::release`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SequencePlace {
    /// The worker the KV is for.
    pub destination: WorkerId,
    /// Its microbatch there.
    pub microbatch: u32,
    /// Its slots.
    pub slots: std::ops::Range<u32>,
}

impl SequencePlace {
    /// Whether the chunk under `key` holds KV of this place: the same worker and microbatch, and
    /// slots that overlap.
    pub fn holds(&self, key: &ChunkKey) -> bool {
        let slots = &key.region.slots;
        key.destination == self.destination
            && key.microbatch == self.microbatch
            && slots.start < self.slots.end
            && self.slots.start < slots.end
    }
}

/// The identity of a chunk in a store: destination, microbatch and region.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ChunkKey {
    /// Worker it is for.
    pub destination: WorkerId,
    /// Microbatch at the destination.
    pub microbatch: u32,
    /// Region at the destination.
    pub region: KvRegion,
}

impl ChunkKey {
    /// Bytes of [`ChunkKey::encode`].
    pub const ENCODED_LEN: usize = 44;

    /// The eleven numbers that identify the chunk, in a fixed order.
    fn words(&self) -> [u32; 11] {
        let r = &self.region;
        [
            self.destination.stage,
            self.destination.rank,
            self.microbatch,
            r.layers.start,
            r.layers.end,
            r.slots.start,
            r.slots.end,
            r.heads.start,
            r.heads.end,
            r.tokens.start,
            r.tokens.end,
        ]
    }

    /// A name safe for file systems.
    pub fn file_name(&self) -> String {
        let [stage, rank, mb, l0, l1, s0, s1, h0, h1, t0, t1] = self.words();
        format!("w{stage}.{rank}-m{mb}-l{l0}_{l1}-s{s0}_{s1}-h{h0}_{h1}-t{t0}_{t1}.djv")
    }

    /// The key as little-endian bytes, for the wire.
    pub fn encode(&self) -> Vec<u8> {
        self.words().iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// Inverse of [`ChunkKey::encode`]; `None` for bytes of the wrong length.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != Self::ENCODED_LEN {
            return None;
        }
        let v: Vec<u32> =
            bytes.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
        Some(Self {
            destination: WorkerId { stage: v[0], rank: v[1] },
            microbatch: v[2],
            region: KvRegion::new(v[3]..v[4], v[5]..v[6], v[7]..v[8], v[9]..v[10]),
        })
    }
}

impl ChunkDescriptor {
    /// The store key.
    pub fn key(&self) -> ChunkKey {
        ChunkKey { destination: self.destination, microbatch: self.microbatch, region: self.region.clone() }
    }

    /// Checks what a decoder checks: a non-empty, non-inverted region whose size fits in 64 bits,
    /// a spec whose layers and heads are the region's, and chunk sizes that divide the head.
    pub fn validate(&self) -> Result<(), ChunkError> {
        let r = &self.region;
        if r.is_empty() || [&r.layers, &r.slots, &r.heads, &r.tokens].iter().any(|x| x.start > x.end) {
            return Err(ChunkError::Invalid(format!("empty or inverted region {r:?}")));
        }
        let shape = r.shape();
        if self.spec.layers() != shape.layers || self.spec.kv_heads() != shape.heads {
            return Err(ChunkError::Invalid(format!("spec {:?} does not match region {r:?}", self.spec)));
        }
        let head_dim = self.spec.head_dim();
        for chunk in [self.packing.k_chunk, self.packing.v_chunk] {
            if chunk == 0 || head_dim % chunk != 0 {
                return Err(ChunkError::Invalid(format!("packing chunk {chunk} for head_dim {head_dim}")));
            }
        }
        if shape.checked_bytes(&self.spec).is_none() {
            return Err(ChunkError::Invalid(format!("region {r:?} is larger than 2^64 bytes")));
        }
        Ok(())
    }

    /// Payload bytes the region takes.
    pub fn payload_len(&self) -> u64 {
        self.region.shape().bytes(&self.spec)
    }

    /// Encodes the header of a chunk carrying `payload`.
    pub fn encode_header(&self, payload: &[u8]) -> [u8; HEADER_LEN] {
        self.encode_header_with_checksum(payload.len() as u64, xxh3_64(payload))
    }

    /// Encodes a header for a payload of `payload_len` bytes whose xxh3-64 is `checksum`.
    pub fn encode_header_with_checksum(&self, payload_len: u64, checksum: u64) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        let mut w = Writer { buf: &mut h, at: 0 };
        w.bytes(&CHUNK_MAGIC);
        w.u16(CHUNK_VERSION);
        w.u16(HEADER_LEN as u16);
        w.u32(0);
        for id in [self.source, self.destination] {
            w.u32(id.stage);
            w.u32(id.rank);
        }
        w.u32(self.microbatch);
        for r in [&self.region.layers, &self.region.slots, &self.region.heads, &self.region.tokens] {
            w.u32(r.start);
            w.u32(r.end);
        }
        w.u32(self.spec.head_dim());
        w.bytes(&[self.spec.dtype().code(), scale_code(self.spec.scales()), 0, 0]);
        w.u32(self.packing.k_chunk);
        w.u32(self.packing.v_chunk);
        w.u64(payload_len);
        w.u64(checksum);
        let header_sum = xxh3_64(&h[..96]);
        h[96..].copy_from_slice(&header_sum.to_le_bytes());
        h
    }

    /// Decodes and checks a header; returns the descriptor, the payload length and its checksum.
    pub fn decode_header(bytes: &[u8]) -> Result<(ChunkDescriptor, u64, u64), ChunkError> {
        if bytes.len() < HEADER_LEN {
            return Err(ChunkError::Truncated { expected: HEADER_LEN as u64, got: bytes.len() as u64 });
        }
        let mut r = Reader { buf: bytes, at: 0 };
        let magic: [u8; 4] = r.array();
        if magic != CHUNK_MAGIC {
            return Err(ChunkError::BadMagic(magic));
        }
        let stored = u64::from_le_bytes(bytes[96..HEADER_LEN].try_into().expect("8 bytes"));
        if xxh3_64(&bytes[..96]) != stored {
            return Err(ChunkError::HeaderCorrupt);
        }
        let version = r.u16();
        if version != CHUNK_VERSION {
            return Err(ChunkError::UnsupportedVersion(version));
        }
        let header_len = r.u16();
        if header_len as usize != HEADER_LEN {
            return Err(ChunkError::Invalid(format!("header length {header_len}")));
        }
        let flags = r.u32();
        if flags != 0 {
            return Err(ChunkError::Invalid(format!("unknown flags {flags:#x}")));
        }
        let source = WorkerId { stage: r.u32(), rank: r.u32() };
        let destination = WorkerId { stage: r.u32(), rank: r.u32() };
        let microbatch = r.u32();
        let mut range = || -> Range<u32> { r.u32()..r.u32() };
        let region = KvRegion::new(range(), range(), range(), range());
        let head_dim = r.u32();
        let [dtype, scales, reserved_lo, reserved_hi]: [u8; 4] = r.array();
        if reserved_lo != 0 || reserved_hi != 0 {
            return Err(ChunkError::Invalid("reserved bytes are not zero".into()));
        }
        let dtype =
            DType::from_code(dtype).ok_or_else(|| ChunkError::Invalid(format!("dtype code {dtype}")))?;
        let scales = scale_from_code(scales)?;
        let packing = Packing { k_chunk: r.u32(), v_chunk: r.u32() };
        let payload_len = r.u64();
        let payload_sum = r.u64();
        let shape = region.shape();
        let spec = KvSpec::with_scales(shape.layers.max(1), shape.heads.max(1), head_dim, dtype, scales)
            .map_err(|e| ChunkError::Invalid(e.to_string()))?;
        let descriptor = ChunkDescriptor { source, destination, microbatch, region, spec, packing };
        descriptor.validate()?;
        if descriptor.region.shape().checked_bytes(&descriptor.spec) != Some(payload_len) {
            return Err(ChunkError::Invalid(format!(
                "payload length {payload_len} does not match the region's {} bytes",
                descriptor.payload_len()
            )));
        }
        Ok((descriptor, payload_len, payload_sum))
    }
}

/// The payload checksum recorded in an encoded chunk header (bytes 88..96), read without checking
/// the header: callers must have checked the header's integrity already.
pub fn header_payload_checksum(header: &[u8; HEADER_LEN]) -> u64 {
    u64::from_le_bytes(header[88..96].try_into().expect("8 bytes"))
}

/// Checks `payload` against the checksum from its header.
pub fn verify_payload(payload: &[u8], expected: u64) -> Result<(), ChunkError> {
    let actual = xxh3_64(payload);
    if actual != expected {
        return Err(ChunkError::PayloadCorrupt { expected, actual });
    }
    Ok(())
}

fn scale_code(mode: ScaleMode) -> u8 {
    match mode {
        ScaleMode::None => 0,
        ScaleMode::PerTokenHead => 1,
    }
}

fn scale_from_code(code: u8) -> Result<ScaleMode, ChunkError> {
    match code {
        0 => Ok(ScaleMode::None),
        1 => Ok(ScaleMode::PerTokenHead),
        other => Err(ChunkError::Invalid(format!("scale mode code {other}"))),
    }
}

struct Writer<'a> {
    buf: &'a mut [u8],
    at: usize,
}

impl Writer<'_> {
    fn bytes(&mut self, b: &[u8]) {
        self.buf[self.at..self.at + b.len()].copy_from_slice(b);
        self.at += b.len();
    }
    fn u16(&mut self, v: u16) {
        self.bytes(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn array<const N: usize>(&mut self) -> [u8; N] {
        let out = self.buf[self.at..self.at + N].try_into().expect("length checked by caller");
        self.at += N;
        out
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn descriptor() -> ChunkDescriptor {
        ChunkDescriptor {
            source: WorkerId { stage: 0, rank: 1 },
            destination: WorkerId { stage: 2, rank: 0 },
            microbatch: 3,
            region: KvRegion::new(4..6, 0..2, 1..3, 10..11),
            spec: KvSpec::new(2, 2, 8, DType::F16).unwrap(),
            packing: Packing { k_chunk: 8, v_chunk: 8 },
        }
    }

    #[test]
    fn header_round_trips() {
        let d = descriptor();
        let payload = vec![7u8; d.payload_len() as usize];
        let h = d.encode_header(&payload);
        let (back, len, sum) = ChunkDescriptor::decode_header(&h).unwrap();
        assert_eq!(back, d);
        assert_eq!(len, payload.len() as u64);
        verify_payload(&payload, sum).unwrap();
        let mut bad = payload.clone();
        bad[3] ^= 1;
        assert!(matches!(verify_payload(&bad, sum), Err(ChunkError::PayloadCorrupt { .. })));
    }

    #[test]
    fn nonzero_flags_or_reserved_bytes_are_rejected_even_with_a_valid_checksum() {
        let d = descriptor();
        let payload = vec![1u8; d.payload_len() as usize];
        for byte in [8, 70, 71] {
            let mut h = d.encode_header(&payload);
            h[byte] = 0xff;
            let sum = xxh3_64(&h[..96]);
            h[96..].copy_from_slice(&sum.to_le_bytes());
            assert!(matches!(ChunkDescriptor::decode_header(&h), Err(ChunkError::Invalid(_))), "byte {byte}");
        }
    }

    #[test]
    fn descriptors_a_decoder_would_refuse_do_not_validate() {
        let mut d = descriptor();
        d.packing.k_chunk = 0;
        assert!(d.validate().is_err());
        let mut d = descriptor();
        d.region.tokens = 11..11;
        assert!(d.validate().is_err());
        assert!(descriptor().validate().is_ok());
    }

    #[test]
    fn every_single_bit_flip_in_a_header_is_caught() {
        let d = descriptor();
        let payload = vec![1u8; d.payload_len() as usize];
        let h = d.encode_header(&payload);
        for bit in 0..HEADER_LEN * 8 {
            let mut bad = h;
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(ChunkDescriptor::decode_header(&bad).is_err(), "bit {bit} undetected");
        }
        assert!(matches!(
            ChunkDescriptor::decode_header(&h[..50]),
            Err(ChunkError::Truncated { expected: 104, got: 50 })
        ));
    }
}
