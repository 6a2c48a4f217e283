//! The wire format: one framing for everything that crosses a process boundary.
//!
//! A frame is a 72-byte header and a payload. The header carries the message kind, the sender's
//! epoch and id, a request id, four kind-specific ids (microbatch, step, layer range, ...), the
//! payload length and two xxh3-64 checksums: one of the payload, one of the header's first 64 bytes
//! (which include the payload's), so together they cover header and payload. All integers are
//! little-endian:
//!
//! | offset | field |
//! | --- | --- |
//! | 0 | magic `DJVF` |
//! | 4 | version (u16, 1) |
//! | 6 | kind (u16) |
//! | 8 | flags (u32, 0) |
//! | 12 | sender (u32) |
//! | 16 | epoch (u64) |
//! | 24 | request id (u64) |
//! | 32 | ids (4 x u32, meaning set by the kind) |
//! | 48 | payload length (u64) |
//! | 56 | xxh3-64 of the payload |
//! | 64 | xxh3-64 of bytes 0..64 |
//!
//! A reader checks the header checksum before trusting any field, rejects a payload length above
//! its maximum before allocating, and checks the payload checksum before handing the frame on: a
//! malformed, truncated, oversized or corrupted frame is a typed error, never a partial payload.
//!
//! One flag is defined: [`FLAG_CHUNK`] marks a payload that is a whole chunk (its 104-byte header,
//! then its bytes). The chunk header already carries a checksum of the bytes after it, so the frame's
//! payload checksum covers only the chunk header, and readers check the rest against the checksum
//! the chunk header records: a chunk frame is checked end to end like any other, and each side hashes
//! the KV bytes once, not twice.

use std::io::{self, Read, Write};

use crate::checksum::{xxh3_64, Checksum};
use thiserror::Error;

use crate::chunk::HEADER_LEN as CHUNK_HEADER_LEN;

/// Magic bytes of every frame.
pub const FRAME_MAGIC: [u8; 4] = *b"DJVF";
/// Current frame version.
pub const FRAME_VERSION: u16 = 1;
/// Bytes of a frame header.
pub const FRAME_HEADER_LEN: usize = 72;
/// Flag: the payload is a chunk, and the payload checksum covers only the chunk's header.
pub const FLAG_CHUNK: u32 = 1;
/// Default maximum payload: 1 GiB (a layer of a large model's prompt KV fits).
pub const DEFAULT_MAX_PAYLOAD: u64 = 1 << 30;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Kind {
    /// Connection setup: the client's identity and nonce.
    Hello = 1,
    /// The server's nonce and its proof of the cluster secret.
    Challenge = 2,
    /// The client's proof of the cluster secret.
    Proof = 3,
    /// The server accepted the proof.
    Welcome = 4,
    /// A chunk to store (payload: chunk header and payload).
    Put = 10,
    /// Acknowledgment of a put (ids carry the payload checksum).
    PutAck = 11,
    /// A request for a chunk (payload: the key).
    Get = 12,
    /// The chunk asked for.
    GetReply = 13,
    /// A put's chunk is kept where it was sent, whose sender may reuse the memory it crossed (a
    /// sidecar's shared region); the put's `PutAck` or `Error` follows.
    Taken = 14,
    /// A control-plane message (payload: its encoding).
    Control = 20,
    /// Liveness.
    Heartbeat = 21,
    /// Pipeline activations or tokens between engine stages (ids: microbatch, slot, position,
    /// token count).
    Activation = 22,
    /// The peer refuses a request (payload: UTF-8 reason).
    Error = 30,
}

impl Kind {
    /// The kind with code `code`.
    pub fn from_code(code: u16) -> Option<Self> {
        Some(match code {
            1 => Kind::Hello,
            2 => Kind::Challenge,
            3 => Kind::Proof,
            4 => Kind::Welcome,
            10 => Kind::Put,
            11 => Kind::PutAck,
            12 => Kind::Get,
            13 => Kind::GetReply,
            14 => Kind::Taken,
            20 => Kind::Control,
            21 => Kind::Heartbeat,
            22 => Kind::Activation,
            30 => Kind::Error,
            _ => return None,
        })
    }
}

/// Why a peer refused a request: carried in `ids[0]` of a [`Kind::Error`] frame (the payload holds
/// the reason in words).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ErrorCode {
    /// Anything not listed below.
    Other = 0,
    /// The handshake failed.
    Auth = 1,
    /// The request's epoch is older than the peer's.
    StaleEpoch = 2,
    /// No chunk under the key asked for.
    NotFound = 3,
    /// The chunk failed verification and was not stored.
    BadChunk = 4,
    /// A frame kind the peer does not serve.
    Unexpected = 5,
}

impl ErrorCode {
    /// The code numbered `code` (unknown numbers read as [`ErrorCode::Other`]).
    pub fn from_code(code: u32) -> Self {
        match code {
            1 => ErrorCode::Auth,
            2 => ErrorCode::StaleEpoch,
            3 => ErrorCode::NotFound,
            4 => ErrorCode::BadChunk,
            5 => ErrorCode::Unexpected,
            _ => ErrorCode::Other,
        }
    }
}

/// Errors reading or checking a frame. After any of them the connection must be closed.
#[derive(Debug, Error)]
pub enum FrameError {
    /// The bytes do not start with [`FRAME_MAGIC`].
    #[error("not a frame: bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// A version this build cannot read.
    #[error("unsupported frame version {0}")]
    UnsupportedVersion(u16),
    /// A kind this build does not know.
    #[error("unknown frame kind {0}")]
    UnknownKind(u16),
    /// Flags this build does not know.
    #[error("unknown frame flags {0:#x}")]
    UnknownFlags(u32),
    /// A frame flagged as carrying a chunk is shorter than a chunk header.
    #[error("chunk frame of {0} bytes is shorter than a chunk header")]
    ChunkTooShort(u64),
    /// The header checksum does not match.
    #[error("frame header checksum mismatch")]
    HeaderCorrupt,
    /// The payload checksum does not match.
    #[error("frame payload checksum mismatch")]
    PayloadCorrupt,
    /// The payload length is above the reader's maximum (rejected before allocating).
    #[error("frame payload of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// Announced length.
        len: u64,
        /// The maximum.
        max: u64,
    },
    /// The stream ended inside a frame.
    #[error("truncated frame: the stream ended after {got} of {expected} bytes")]
    Truncated {
        /// Bytes expected.
        expected: u64,
        /// Bytes read.
        got: u64,
    },
    /// The frame is from an epoch older than the reader's.
    #[error("frame from stale epoch {got}, current is {current}")]
    StaleEpoch {
        /// The frame's epoch.
        got: u64,
        /// The reader's.
        current: u64,
    },
    /// The stream failed.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
}

/// The fields of a frame header (everything but the checksums).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the frame carries.
    pub kind: Kind,
    /// The sender's node id.
    pub sender: u32,
    /// The sender's epoch.
    pub epoch: u64,
    /// Request id, echoed in the reply.
    pub request: u64,
    /// Kind-specific ids.
    pub ids: [u32; 4],
    /// Flags ([`FLAG_CHUNK`] or 0).
    pub flags: u32,
}

/// A checked frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// Its header.
    pub header: FrameHeader,
    /// Its payload (checksum verified).
    pub payload: Vec<u8>,
}

impl FrameHeader {
    /// A header of `kind` with zero ids.
    pub fn new(kind: Kind, sender: u32, epoch: u64, request: u64) -> Self {
        Self { kind, sender, epoch, request, ids: [0; 4], flags: 0 }
    }

    /// Bytes of the payload the payload checksum covers, for a payload of `len` bytes.
    pub fn checksummed_len(&self, len: u64) -> u64 {
        if self.flags & FLAG_CHUNK != 0 {
            len.min(CHUNK_HEADER_LEN as u64)
        } else {
            len
        }
    }

    /// Encodes the header for `payload`.
    pub fn encode(&self, payload: &[u8]) -> [u8; FRAME_HEADER_LEN] {
        self.encode_parts(&[payload])
    }

    /// Encodes the header for a payload made of `parts` in order (no need to join them first).
    pub fn encode_parts(&self, parts: &[&[u8]]) -> [u8; FRAME_HEADER_LEN] {
        let len: u64 = parts.iter().map(|p| p.len() as u64).sum();
        let mut hasher = Checksum::new();
        let mut left = self.checksummed_len(len) as usize;
        for part in parts {
            let n = part.len().min(left);
            hasher.update(&part[..n]);
            left -= n;
        }
        let mut h = [0u8; FRAME_HEADER_LEN];
        h[0..4].copy_from_slice(&FRAME_MAGIC);
        h[4..6].copy_from_slice(&FRAME_VERSION.to_le_bytes());
        h[6..8].copy_from_slice(&(self.kind as u16).to_le_bytes());
        h[8..12].copy_from_slice(&self.flags.to_le_bytes());
        h[12..16].copy_from_slice(&self.sender.to_le_bytes());
        h[16..24].copy_from_slice(&self.epoch.to_le_bytes());
        h[24..32].copy_from_slice(&self.request.to_le_bytes());
        for (i, id) in self.ids.iter().enumerate() {
            h[32 + 4 * i..36 + 4 * i].copy_from_slice(&id.to_le_bytes());
        }
        h[48..56].copy_from_slice(&len.to_le_bytes());
        h[56..64].copy_from_slice(&hasher.digest().to_le_bytes());
        let sum = xxh3_64(&h[..64]);
        h[64..72].copy_from_slice(&sum.to_le_bytes());
        h
    }

    /// Decodes and checks a header; returns it, the payload length and the payload checksum.
    pub fn decode(h: &[u8; FRAME_HEADER_LEN]) -> Result<(Self, u64, u64), FrameError> {
        let u16_at = |i: usize| u16::from_le_bytes([h[i], h[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
        let magic: [u8; 4] = h[0..4].try_into().expect("4 bytes");
        if magic != FRAME_MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        if xxh3_64(&h[..64]) != u64_at(64) {
            return Err(FrameError::HeaderCorrupt);
        }
        let version = u16_at(4);
        if version != FRAME_VERSION {
            return Err(FrameError::UnsupportedVersion(version));
        }
        let kind = Kind::from_code(u16_at(6)).ok_or(FrameError::UnknownKind(u16_at(6)))?;
        let flags = u32_at(8);
        if flags & !FLAG_CHUNK != 0 {
            return Err(FrameError::UnknownFlags(flags));
        }
        let len = u64_at(48);
        if flags & FLAG_CHUNK != 0 && len < CHUNK_HEADER_LEN as u64 {
            return Err(FrameError::ChunkTooShort(len));
        }
        let header = FrameHeader {
            kind,
            sender: u32_at(12),
            epoch: u64_at(16),
            request: u64_at(24),
            ids: [u32_at(32), u32_at(36), u32_at(40), u32_at(44)],
            flags,
        };
        Ok((header, len, u64_at(56)))
    }
}

/// Writes one frame (header and payload) to `w`.
pub fn write_frame(w: &mut impl Write, header: &FrameHeader, payload: &[u8]) -> io::Result<()> {
    write_frame_parts(w, header, &[payload])
}

/// Writes one frame whose payload is `parts` in order, without copying them together.
pub fn write_frame_parts(w: &mut impl Write, header: &FrameHeader, parts: &[&[u8]]) -> io::Result<()> {
    w.write_all(&header.encode_parts(parts))?;
    for part in parts {
        w.write_all(part)?;
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes, reporting how far it got on a clean end of stream.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> Result<(), (u64, io::Error)> {
    let mut at = 0;
    while at < buf.len() {
        match r.read(&mut buf[at..]) {
            Ok(0) => return Err((at as u64, io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err((at as u64, e)),
        }
    }
    Ok(())
}

/// Reads and checks one frame from `r`, refusing payloads above `max_payload` before allocating.
/// `Ok(None)` is a clean end of stream between frames.
pub fn read_frame(r: &mut impl Read, max_payload: u64) -> Result<Option<Frame>, FrameError> {
    let mut h = [0u8; FRAME_HEADER_LEN];
    match read_full(r, &mut h) {
        Ok(()) => {}
        Err((0, e)) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err((got, e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
            return Err(FrameError::Truncated { expected: FRAME_HEADER_LEN as u64, got })
        }
        Err((_, e)) => return Err(e.into()),
    }
    let (header, len, sum) = FrameHeader::decode(&h)?;
    if len > max_payload {
        return Err(FrameError::TooLarge { len, max: max_payload });
    }
    let mut payload = vec![0u8; len as usize];
    match read_full(r, &mut payload) {
        Ok(()) => {}
        Err((got, e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
            let expected = FRAME_HEADER_LEN as u64 + len;
            return Err(FrameError::Truncated { expected, got: FRAME_HEADER_LEN as u64 + got });
        }
        Err((_, e)) => return Err(e.into()),
    }
    let covered = header.checksummed_len(len) as usize;
    let body_sum = (covered < payload.len()).then(|| xxh3_64(&payload[covered..]));
    verify_sums(&header, &payload[..covered], xxh3_64(&payload[..covered]), sum, body_sum)?;
    Ok(Some(Frame { header, payload }))
}

/// Checks a payload's checksums: `covered_sum` (of the bytes the header's checksum covers,
/// `covered`) against the header's `sum`, and for a chunk frame `body_sum` (of the bytes after the
/// chunk header) against the checksum the chunk header records.
pub(crate) fn verify_sums(
    header: &FrameHeader,
    covered: &[u8],
    covered_sum: u64,
    sum: u64,
    body_sum: Option<u64>,
) -> Result<(), FrameError> {
    if covered_sum != sum {
        return Err(FrameError::PayloadCorrupt);
    }
    if header.flags & FLAG_CHUNK != 0 {
        let chunk_header: &[u8; CHUNK_HEADER_LEN] = covered.try_into().expect("a whole chunk header");
        let body = body_sum.unwrap_or_else(|| xxh3_64(&[]));
        if body != crate::chunk::header_payload_checksum(chunk_header) {
            return Err(FrameError::PayloadCorrupt);
        }
    }
    Ok(())
}

/// Rejects a frame from an epoch older than `current` (fencing at the transport).
pub fn check_epoch(frame: &Frame, current: u64) -> Result<(), FrameError> {
    if dejavu_proto::fencing::fenced_since(frame.header.epoch, current) {
        return Err(FrameError::StaleEpoch { got: frame.header.epoch, current });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame_bytes(payload: &[u8]) -> Vec<u8> {
        let mut header = FrameHeader::new(Kind::Put, 7, 3, 99);
        header.ids = [1, 2, 3, 4];
        let mut out = Vec::new();
        write_frame(&mut out, &header, payload).unwrap();
        out
    }

    #[test]
    fn frames_round_trip_back_to_back() {
        let mut stream = frame_bytes(b"hello");
        stream.extend(frame_bytes(&[]));
        let mut r = &stream[..];
        let a = read_frame(&mut r, 1024).unwrap().unwrap();
        assert_eq!(a.payload, b"hello");
        assert_eq!((a.header.kind, a.header.sender, a.header.epoch, a.header.request), (Kind::Put, 7, 3, 99));
        assert_eq!(a.header.ids, [1, 2, 3, 4]);
        assert!(read_frame(&mut r, 1024).unwrap().unwrap().payload.is_empty());
        assert!(read_frame(&mut r, 1024).unwrap().is_none(), "clean end of stream");
    }

    #[test]
    fn a_frame_written_in_parts_reads_back_whole() {
        let header = FrameHeader::new(Kind::GetReply, 2, 1, 5);
        let mut out = Vec::new();
        write_frame_parts(&mut out, &header, &[b"head", b"", b"er and payload"]).unwrap();
        let frame = read_frame(&mut &out[..], 64).unwrap().unwrap();
        assert_eq!(frame.payload, b"header and payload");
        assert_eq!(header.encode_parts(&[b"head", b"er and payload"]), header.encode(b"header and payload"));
    }

    #[test]
    fn every_bit_flip_and_every_truncation_is_an_error() {
        let bytes = frame_bytes(b"some payload bytes");
        for bit in 0..bytes.len() * 8 {
            let mut bad = bytes.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            let result = read_frame(&mut &bad[..], 1024);
            assert!(result.is_err(), "bit {bit} undetected: {result:?}");
        }
        for cut in 1..bytes.len() {
            let result = read_frame(&mut &bytes[..cut], 1024);
            assert!(matches!(result, Err(FrameError::Truncated { .. })), "cut at {cut}: {result:?}");
        }
    }

    #[test]
    fn oversized_frames_are_refused_before_reading_the_payload() {
        let header = FrameHeader::new(Kind::Put, 1, 1, 1);
        let mut h = header.encode(&[]);
        // Announce 2^40 bytes with a valid header checksum, and send no payload at all.
        h[48..56].copy_from_slice(&(1u64 << 40).to_le_bytes());
        let sum = xxh3_64(&h[..64]);
        h[64..72].copy_from_slice(&sum.to_le_bytes());
        let result = read_frame(&mut &h[..], DEFAULT_MAX_PAYLOAD);
        assert!(matches!(result, Err(FrameError::TooLarge { len, .. }) if len == 1 << 40), "{result:?}");
    }

    #[test]
    fn unknown_kinds_and_stale_epochs_are_typed_errors() {
        let mut h = FrameHeader::new(Kind::Heartbeat, 1, 5, 0).encode(&[]);
        h[6..8].copy_from_slice(&999u16.to_le_bytes());
        let sum = xxh3_64(&h[..64]);
        h[64..72].copy_from_slice(&sum.to_le_bytes());
        assert!(matches!(read_frame(&mut &h[..], 16), Err(FrameError::UnknownKind(999))));
        let frame = read_frame(&mut &frame_bytes(b"x")[..], 16).unwrap().unwrap();
        assert!(matches!(check_epoch(&frame, 4), Err(FrameError::StaleEpoch { got: 3, current: 4 })));
        assert!(check_epoch(&frame, 3).is_ok());
    }
}
