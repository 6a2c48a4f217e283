//! Feeds arbitrary bytes to the control-message decoder: it must return a message or a typed
//! error, never panic, and whatever it decodes must encode back to the same bytes (one encoding
//! per message).
//!
//! `cargo +nightly fuzz run message_decoder` (from the repository root; needs `cargo install cargo-fuzz`).
#![no_main]

use dejavulib::message::Message;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(message) = Message::decode(data) {
        assert_eq!(message.encode(), data);
    }
});
