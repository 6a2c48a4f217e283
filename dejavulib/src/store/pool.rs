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
        let class = class_of(len);
        self.largest = self.largest.max(class);
        match self.waiting.get_mut(&class).and_then(Vec::pop) {
            Some(mut buffer) => {
                self.bytes -= class;
                buffer.clear();
                buffer
            }
            None => Vec::with_capacity(class),
        }
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
