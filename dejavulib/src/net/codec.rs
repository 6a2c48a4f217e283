//! [`crate::wire`] frames on async streams.
//!
//! Writes go out as one vectored write of header and payload parts (no joined copy). Reads check the
//! header before trusting it, refuse a payload above the maximum before allocating, read the payload
//! into uninitialised capacity (no zeroing pass) and hash it as it arrives, while it is still in cache.

use std::io::{self, IoSlice};

use crate::checksum::Checksum;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::wire::{verify_sums, Frame, FrameError, FrameHeader, FRAME_HEADER_LEN};

/// The most one read takes in: hashed straight after, it is still in the core's L2 cache, where
/// whole socket-buffer reads of several MB would have to be read back from L3 or memory.
const READ_PIECE: usize = 256 << 10;

/// Writes one frame whose payload is `parts` in order, then flushes (TLS buffers records).
pub async fn write_frame<W: AsyncWrite + Unpin + ?Sized>(
    w: &mut W,
    header: &FrameHeader,
    parts: &[&[u8]],
) -> io::Result<()> {
    let encoded = header.encode_parts(parts);
    let mut slices: Vec<IoSlice<'_>> = std::iter::once(&encoded[..])
        .chain(parts.iter().copied())
        .filter(|p| !p.is_empty())
        .map(IoSlice::new)
        .collect();
    let mut pending = &mut slices[..];
    while !pending.is_empty() {
        let n = w.write_vectored(pending).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut pending, n);
    }
    w.flush().await
}

/// Reads and checks one frame, refusing payloads above `max_payload` before allocating.
/// `Ok(None)` is a clean end of stream between frames.
pub async fn read_frame<R: AsyncRead + Unpin + ?Sized>(
    r: &mut R,
    max_payload: u64,
) -> Result<Option<Frame>, FrameError> {
    read_frame_into(r, max_payload, Vec::with_capacity).await
}

/// [`read_frame`], with the payload read into `buffer(len)` (an empty vector with room for `len`
/// bytes, a reused one for instance), called only once the length has been checked.
pub async fn read_frame_into<R: AsyncRead + Unpin + ?Sized>(
    r: &mut R,
    max_payload: u64,
    buffer: impl FnOnce(usize) -> Vec<u8>,
) -> Result<Option<Frame>, FrameError> {
    let mut h = [0u8; FRAME_HEADER_LEN];
    let mut got = 0;
    while got < FRAME_HEADER_LEN {
        match r.read(&mut h[got..]).await? {
            0 if got == 0 => return Ok(None),
            0 => return Err(FrameError::Truncated { expected: FRAME_HEADER_LEN as u64, got: got as u64 }),
            n => got += n,
        }
    }
    let (header, len, sum) = FrameHeader::decode(&h)?;
    if len > max_payload {
        return Err(FrameError::TooLarge { len, max: max_payload });
    }
    let len = len as usize;
    let covered = header.checksummed_len(len as u64) as usize;
    let mut payload = buffer(len);
    payload.clear();
    payload.reserve_exact(len);
    // Hash each piece as it arrives, while it is in cache: the covered part against the frame's
    // checksum, and for a chunk frame the rest against the chunk header's.
    let (mut covered_hash, mut body_hash) = (Checksum::new(), Checksum::new());
    while payload.len() < len {
        let before = payload.len();
        // Limited to the frame (the buffer may have room beyond it) and to a piece that is still
        // in the core's cache when it is hashed. Reads land in spare capacity, never zeroed first.
        let piece = (len - before).min(READ_PIECE) as u64;
        let n = (&mut *r).take(piece).read_buf(&mut payload).await?;
        if n == 0 {
            let got = (FRAME_HEADER_LEN + before) as u64;
            return Err(FrameError::Truncated { expected: (FRAME_HEADER_LEN + len) as u64, got });
        }
        let split = covered.clamp(before, payload.len());
        covered_hash.update(&payload[before..split]);
        body_hash.update(&payload[split..]);
    }
    let body_sum = (covered < len).then(|| body_hash.digest());
    verify_sums(&header, &payload[..covered], covered_hash.digest(), sum, body_sum)?;
    Ok(Some(Frame { header, payload }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{Kind, FLAG_CHUNK};

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
    }

    #[test]
    fn async_and_blocking_codecs_agree() {
        block_on(async {
            let mut header = FrameHeader::new(Kind::Put, 3, 9, 1);
            header.ids = [4, 3, 2, 1];
            let mut bytes = Vec::new();
            write_frame(&mut bytes, &header, &[b"abc", b"", b"defg"]).await.unwrap();
            write_frame(&mut bytes, &FrameHeader::new(Kind::Heartbeat, 3, 9, 2), &[]).await.unwrap();
            let blocking = crate::wire::read_frame(&mut &bytes[..], 64).unwrap().unwrap();
            let mut r = &bytes[..];
            let frame = read_frame(&mut r, 64).await.unwrap().unwrap();
            assert_eq!(frame, blocking);
            assert_eq!(frame.payload, b"abcdefg");
            assert_eq!(read_frame(&mut r, 64).await.unwrap().unwrap().header.kind, Kind::Heartbeat);
            assert!(read_frame(&mut r, 64).await.unwrap().is_none());
        });
    }

    #[test]
    fn every_bit_flip_and_truncation_of_a_plain_frame_is_caught() {
        block_on(async {
            let mut bytes = Vec::new();
            write_frame(&mut bytes, &FrameHeader::new(Kind::Control, 1, 1, 1), &[b"payload!"]).await.unwrap();
            for bit in 0..bytes.len() * 8 {
                let mut bad = bytes.clone();
                bad[bit / 8] ^= 1 << (bit % 8);
                assert!(read_frame(&mut &bad[..], 64).await.is_err(), "bit {bit}");
            }
            for cut in 1..bytes.len() {
                let result = read_frame(&mut &bytes[..cut], 64).await;
                assert!(matches!(result, Err(FrameError::Truncated { .. })), "cut {cut}: {result:?}");
            }
        });
    }

    #[test]
    fn a_chunk_frame_is_checked_against_the_chunk_headers_checksum() {
        block_on(async {
            let mut header = FrameHeader::new(Kind::Put, 1, 1, 1);
            header.flags = FLAG_CHUNK;
            let mut chunk_header = [7u8; crate::chunk::HEADER_LEN];
            chunk_header[88..96].copy_from_slice(&crate::checksum::xxh3_64(b"body").to_le_bytes());
            let mut bytes = Vec::new();
            write_frame(&mut bytes, &header, &[&chunk_header, b"body"]).await.unwrap();
            assert_eq!(read_frame(&mut &bytes[..], 1024).await.unwrap().unwrap().payload.len(), 108);
            // A flip in the chunk header is the frame's to catch...
            let mut bad = bytes.clone();
            bad[FRAME_HEADER_LEN + 5] ^= 1;
            assert!(matches!(read_frame(&mut &bad[..], 1024).await, Err(FrameError::PayloadCorrupt)));
            // ...one in the body is caught against the checksum the chunk header records.
            let mut body_flip = bytes.clone();
            *body_flip.last_mut().unwrap() ^= 1;
            assert!(matches!(read_frame(&mut &body_flip[..], 1024).await, Err(FrameError::PayloadCorrupt)));
            // A chunk frame too short to hold a chunk header is refused outright.
            let mut short = Vec::new();
            write_frame(&mut short, &header, &[b"tiny"]).await.unwrap();
            assert!(matches!(read_frame(&mut &short[..], 1024).await, Err(FrameError::ChunkTooShort(4))));
        });
    }
}
