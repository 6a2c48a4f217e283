//! Feeds arbitrary bytes to the frame decoder: it must return frames or a typed error, never
//! panic, and never hand out a payload above the maximum.
//!
//! `cargo +nightly fuzz run frame_decoder` (from the repository root; needs `cargo install cargo-fuzz`).
#![no_main]

use dejavulib::wire::read_frame;
use libfuzzer_sys::fuzz_target;

const MAX: u64 = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let mut stream = data;
    while let Ok(Some(frame)) = read_frame(&mut stream, MAX) {
        assert!(frame.payload.len() as u64 <= MAX);
    }
});
