//! The frame decoders (blocking and async) fed random and mutated byte streams: they never panic,
//! never deliver a frame that differs from what was sent, and never allocate more than the
//! maximum payload (a counting allocator records the largest single allocation).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use dejavulib::net::codec;
use dejavulib::wire::{self, FrameHeader, Kind, FLAG_CHUNK, FRAME_HEADER_LEN};
use proptest::prelude::*;

/// Records the largest allocation made while `TRACKING` is set.
struct Counting;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; the counter has no effect on
// the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which we pass on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout` (all allocations go through us).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: as for `dealloc`, and the caller upholds `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const MAX: u64 = 4096;

fn kind(code: u8) -> Kind {
    [Kind::Put, Kind::GetReply, Kind::Control, Kind::Heartbeat, Kind::Error][code as usize % 5]
}

fn encode(frames: &[(u8, Vec<u8>, bool)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, (code, payload, chunk)) in frames.iter().enumerate() {
        let mut header = FrameHeader::new(kind(*code), 3, 7, i as u64);
        if *chunk && payload.len() >= dejavulib::chunk::HEADER_LEN {
            header.flags = FLAG_CHUNK;
            let mut payload = payload.clone();
            let sum = dejavulib::checksum::xxh3_64(&payload[dejavulib::chunk::HEADER_LEN..]);
            payload[88..96].copy_from_slice(&sum.to_le_bytes());
            wire::write_frame(&mut out, &header, &payload).unwrap();
        } else {
            wire::write_frame(&mut out, &header, payload).unwrap();
        }
    }
    out
}

/// Decodes a whole stream both ways; returns the frames up to the first error (or the end).
fn decode_both(bytes: &[u8]) -> Vec<wire::Frame> {
    let mut blocking = Vec::new();
    let mut r = bytes;
    while let Ok(Some(frame)) = wire::read_frame(&mut r, MAX) {
        blocking.push(frame);
    }
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let asynchronous = runtime.block_on(async {
        let mut frames = Vec::new();
        let mut r = bytes;
        while let Ok(Some(frame)) = codec::read_frame(&mut r, MAX).await {
            frames.push(frame);
        }
        frames
    });
    assert_eq!(blocking, asynchronous, "the two decoders disagree");
    blocking
}

fn frames() -> impl Strategy<Value = Vec<(u8, Vec<u8>, bool)>> {
    prop::collection::vec((any::<u8>(), prop::collection::vec(any::<u8>(), 0..300), any::<bool>()), 1..5)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_bytes_never_panic_nor_allocate_beyond_the_maximum(bytes in prop::collection::vec(any::<u8>(), 0..2000)) {
        LARGEST.store(0, Ordering::Relaxed);
        let frames = decode_both(&bytes);
        prop_assert!(frames.iter().all(|f| f.payload.len() as u64 <= MAX));
        // Allocations are the payloads (at most MAX) and small runtime bookkeeping.
        prop_assert!(LARGEST.load(Ordering::Relaxed) as u64 <= MAX.max(64 << 10));
    }

    #[test]
    fn a_mutated_stream_delivers_only_frames_that_were_sent(
        sent in frames(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 1..4),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let clean = encode(&sent);
        let originals = decode_both(&clean);
        prop_assert_eq!(originals.len(), sent.len());
        let mut bytes = clean.clone();
        for (at, mask) in &flips {
            let i = at.index(bytes.len());
            bytes[i] ^= mask;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        let decoded = decode_both(&bytes);
        // Whatever comes out is a prefix of what went in: a damaged frame ends the stream.
        prop_assert!(decoded.len() <= originals.len());
        for (got, want) in decoded.iter().zip(&originals) {
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn announced_lengths_above_the_maximum_are_refused_before_allocating(len in MAX + 1..u64::MAX) {
        let mut h = FrameHeader::new(Kind::Put, 1, 1, 1).encode(&[]);
        h[48..56].copy_from_slice(&len.to_le_bytes());
        let sum = dejavulib::checksum::xxh3_64(&h[..64]);
        h[64..72].copy_from_slice(&sum.to_le_bytes());
        LARGEST.store(0, Ordering::Relaxed);
        let result = wire::read_frame(&mut &h[..FRAME_HEADER_LEN], MAX);
        let refused = matches!(result, Err(wire::FrameError::TooLarge { .. }));
        prop_assert!(refused, "{:?}", result);
        prop_assert!((LARGEST.load(Ordering::Relaxed) as u64) < 64 << 10);
    }
}
