//! Helpers shared by the integration tests: a seeded generator, a value function of KV coordinates,
//! and an enumeration of every vector of a layout.

// Each test binary uses its own subset of these helpers.
#![allow(dead_code)]

use dejavulib::{Coord, KvLayout, Part};

pub use dejavu_proto::rng::mix;
use dejavu_proto::rng::{SplitMix64, GOLDEN};

/// The project's SplitMix64 with the draws the tests need: every random choice of a test comes
/// from its seed, so failures replay.
pub struct Rng(SplitMix64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(SplitMix64::new(seed))
    }

    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// A value in `lo..=hi`.
    pub fn range(&mut self, lo: u32, hi: u32) -> u32 {
        assert!(lo <= hi);
        lo + (self.next() % (hi - lo + 1) as u64) as u32
    }

    /// A value in `0..n` (`n >= 1`).
    pub fn below(&mut self, n: u32) -> u32 {
        (self.next() % n as u64) as u32
    }

    /// One of `items`.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u32) as usize]
    }

    /// A non-empty sub-range of `0..limit` (`limit >= 1`).
    pub fn sub_range(&mut self, limit: u32) -> std::ops::Range<u32> {
        let start = self.range(0, limit - 1);
        let end = self.range(start + 1, limit);
        start..end
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        self.0.bytes(n)
    }

    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.range(0, i as u32) as usize;
            v.swap(i, j);
        }
    }
}

/// Byte `byte` of the (part, layer, request, head, token) vector under `seed`. Never 0, so a
/// zeroed element that should have been written is always caught.
pub fn kv_byte(seed: u64, part: Part, layer: u32, request: u32, head: u32, token: u32, byte: u32) -> u8 {
    let mut x = seed;
    for v in [part.index() as u64, layer as u64, request as u64, head as u64, token as u64, byte as u64] {
        x = mix(x.wrapping_add(v).wrapping_add(GOLDEN));
    }
    (x as u8) | 1
}

/// Every (part, coordinate) of `layout`, each slot up to its token capacity.
pub fn every_vector(layout: &KvLayout) -> Vec<(Part, Coord)> {
    let spec = layout.spec();
    let mut out = Vec::new();
    for &part in spec.parts() {
        for layer in 0..spec.layers() {
            for slot in 0..layout.slots() {
                for head in 0..spec.kv_heads() {
                    for token in 0..layout.token_capacity(slot) {
                        out.push((part, Coord { layer, slot, head, token }));
                    }
                }
            }
        }
    }
    out
}
