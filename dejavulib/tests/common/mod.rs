//! Helpers shared by the integration tests: a seeded generator, a value function of KV coordinates,
//! and an enumeration of every vector of a layout.

// Each test binary uses its own subset of these helpers.
#![allow(dead_code)]

use dejavulib::{Coord, KvLayout, Part};

/// SplitMix64's finaliser: a well-mixed 64-bit hash of `x`.
pub fn mix(x: u64) -> u64 {
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// SplitMix64: every random choice of a test comes from its seed, so failures replay.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
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
        (0..n).map(|_| self.next() as u8).collect()
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
        x = mix(x.wrapping_add(v).wrapping_add(0x9e37_79b9_7f4a_7c15));
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
