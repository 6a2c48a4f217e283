//! Buffers of chunks a store no longer holds, kept for the next chunks it receives.
//!
//! A store that serves traffic receives chunks of every size, from a decode step's few KiB to a
//! prompt's MiB, and frees them as sequences end. Left to the allocator, the large ones leave holes
//! of every size behind, and the process's resident memory creeps up for thousands of requests
//! before it settles; a fresh large buffer also costs a page fault per 4 KiB when first written,
//! more than copying into it. So large buffers are made in a few size classes (a quarter of a
//! power of two apart: at most 25% of a buffer unused) and a freed one waits for the next chunk of
//! its class, up to a budget of bytes waiting.

use std::collections::BTreeMap;

/// Buffers smaller than this come from the allocator and go back to it: it reuses them well.
pub const POOLED_FROM: usize = 64 << 10;

/// The capacity of a pooled buffer that holds `len` bytes: the next size of the form `m << k`
/// with `m` in 4..=7.
fn class_of(len: usize) -> usize {
    if len <= 4 {
        return len;
    }
    let shift = usize::BITS - 1 - (len - 1).leading_zeros() - 2;
    let m = (len - 1) >> shift;
    (m + 1) << shift
}

/// Bytes a pool keeps waiting at least: room for a few prompts of a small model.
const MIN_BUDGET: usize = 4 << 20;

/// Bytes a pool keeps waiting at most, however large its chunks.
const MAX_BUDGET: usize = 256 << 20;

/// Freed buffers by capacity. Its budget follows the chunks it sees: room for two of the largest
/// ([`MIN_BUDGET`] at least, [`MAX_BUDGET`] at most), so that a sequence's prompt finds the buffer
/// of the one before it.
#[derive(Default)]
pub(crate) struct BufferPool {
    waiting: BTreeMap<usize, Vec<Vec<u8>>>,
    /// Bytes of the buffers waiting.
    bytes: usize,
    /// The largest buffer asked for so far.
    largest: usize,
}

impl BufferPool {
    /// Bytes of the buffers waiting.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// An empty buffer with room for `len` bytes.
    pub(crate) fn take(&mut self, len: usize) -> Vec<u8> {
        if len < POOLED_FROM {
            return Vec::with_capacity(len);
        }
        let mut buffer = self.pop(len).unwrap_or_else(|| Vec::with_capacity(class_of(len)));
        buffer.clear();
        buffer
    }

    /// A buffer of exactly `len` bytes, whatever they hold (a freed chunk's, or zeros): to be
    /// overwritten whole. A pooled one is not zeroed first.
    pub(crate) fn take_len(&mut self, len: usize) -> Vec<u8> {
        if len < POOLED_FROM {
            return vec![0; len];
        }
        match self.pop(len) {
            Some(mut buffer) => {
                // Its bytes up to its old length were written; only those beyond are zeroed.
                buffer.resize(len, 0);
                buffer
            }
            None => {
                // Zeroed pages from the system, faulted in as they are first written.
                let mut buffer = vec![0; class_of(len)];
                buffer.truncate(len);
                buffer
            }
        }
    }

    /// A waiting buffer of `len`'s class, as it was given back.
    fn pop(&mut self, len: usize) -> Option<Vec<u8>> {
        let class = class_of(len);
        self.largest = self.largest.max(class);
        let buffer = self.waiting.get_mut(&class).and_then(Vec::pop)?;
        self.bytes -= class;
        Some(buffer)
    }

    /// Keeps `buffer` for a later chunk of its class, if it is one of the pool's and the budget
    /// allows.
    pub(crate) fn give(&mut self, buffer: Vec<u8>) {
        let capacity = buffer.capacity();
        let budget = (2 * self.largest).clamp(MIN_BUDGET, MAX_BUDGET);
        if capacity < POOLED_FROM || class_of(capacity) != capacity || self.bytes + capacity > budget {
            return;
        }
        self.bytes += capacity;
        self.waiting.entry(capacity).or_default().push(buffer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_a_quarter_of_a_power_of_two_apart() {
        assert_eq!(class_of(64 << 10), 64 << 10);
        assert_eq!(class_of((64 << 10) + 1), 80 << 10);
        assert_eq!(class_of(100 << 10), 112 << 10);
        assert_eq!(class_of(1 << 20), 1 << 20);
        for len in [70_000, 1_000_000, 1_843_200, 6_553_600] {
            let class = class_of(len);
            assert!(class >= len && class < len + len / 4 + 1, "{len} -> {class}");
            assert_eq!(class_of(class), class);
        }
    }

    #[test]
    fn a_freed_buffer_serves_the_next_chunk_of_its_class() {
        let mut pool = BufferPool::default();
        let mut first = pool.take(1_000_000);
        first.extend_from_slice(&[7; 1_000_000]);
        let at = first.as_ptr();
        pool.give(first);
        let again = pool.take(990_000);
        assert_eq!(again.as_ptr(), at, "the same buffer, not a new one");
        assert!(again.is_empty());
        assert_eq!(pool.bytes, 0);
    }

    #[test]
    fn a_buffer_of_a_length_is_that_long_and_pooled_without_being_zeroed() {
        let mut pool = BufferPool::default();
        let fresh = pool.take_len(1_000_000);
        assert_eq!((fresh.len(), fresh.capacity()), (1_000_000, class_of(1_000_000)));
        assert!(fresh.iter().all(|&b| b == 0));
        let mut full = fresh;
        full.fill(5);
        let at = full.as_ptr();
        pool.give(full);
        let again = pool.take_len(950_000);
        assert_eq!((again.as_ptr(), again.len()), (at, 950_000), "the same buffer, cut to length");
        assert!(again.iter().all(|&b| b == 5), "not zeroed");
        pool.give(again);
        let longer = pool.take_len(1_000_000);
        assert!(longer[..950_000].iter().all(|&b| b == 5) && longer[950_000..].iter().all(|&b| b == 0));
    }

    #[test]
    fn small_and_foreign_buffers_go_back_to_the_allocator() {
        let mut pool = BufferPool::default();
        pool.give(Vec::with_capacity(POOLED_FROM - 1));
        pool.give(Vec::with_capacity(70_000));
        assert_eq!(pool.bytes, 0);
        assert!(pool.waiting.is_empty());
    }

    #[test]
    fn buffers_beyond_the_budget_are_freed() {
        let mut pool = BufferPool::default();
        let taken: Vec<_> = (0..8).map(|_| pool.take(1 << 20)).collect();
        for buffer in taken {
            pool.give(buffer);
        }
        // Two of the largest class seen, but never under the floor.
        assert_eq!(pool.bytes, MIN_BUDGET);
        let huge = pool.take(300 << 20);
        pool.give(huge);
        assert_eq!(pool.bytes, MIN_BUDGET, "a buffer larger than the ceiling is not kept");
    }
}
