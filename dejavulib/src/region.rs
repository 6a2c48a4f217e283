//! Rectangular pieces of a KV cache: layers x slots x heads x tokens.

use std::ops::Range;

use crate::spec::KvSpec;

/// A point in a cache's logical index space (all K/V parts share it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Coord {
    /// Layer index, local to the cache.
    pub layer: u32,
    /// Batch slot (sequence) index.
    pub slot: u32,
    /// KV head index, local to the cache.
    pub head: u32,
    /// Token position within the sequence.
    pub token: u32,
}

/// Extent of a region along each logical axis.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Number of layers.
    pub layers: u32,
    /// Number of slots.
    pub slots: u32,
    /// Number of heads.
    pub heads: u32,
    /// Number of tokens.
    pub tokens: u32,
}

impl Shape {
    /// Whether the shape holds no element.
    pub fn is_empty(&self) -> bool {
        self.layers == 0 || self.slots == 0 || self.heads == 0 || self.tokens == 0
    }

    /// Number of (layer, slot, head, token) vectors per part.
    ///
    /// Saturates at `u64::MAX` (no region of real memory comes near it).
    pub fn vectors(&self) -> u64 {
        self.checked_vectors().unwrap_or(u64::MAX)
    }

    /// Bytes of KV (all parts) the shape covers under `spec`, saturating at `u64::MAX`.
    pub fn bytes(&self, spec: &KvSpec) -> u64 {
        self.checked_bytes(spec).unwrap_or(u64::MAX)
    }

    /// Vectors per part, or `None` on overflow.
    pub fn checked_vectors(&self) -> Option<u64> {
        (self.layers as u64)
            .checked_mul(self.slots as u64)?
            .checked_mul(self.heads as u64)?
            .checked_mul(self.tokens as u64)
    }

    /// Bytes of KV (all parts), or `None` on overflow: use it on untrusted shapes (headers).
    pub fn checked_bytes(&self, spec: &KvSpec) -> Option<u64> {
        let per_vector: u64 = spec.parts().iter().map(|&p| spec.vector_bytes(p)).sum();
        per_vector.checked_mul(self.checked_vectors()?)
    }
}

/// A rectangular region of a KV cache: every K/V part of the given layers, slots, heads and tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct KvRegion {
    /// Layer range.
    pub layers: Range<u32>,
    /// Slot range.
    pub slots: Range<u32>,
    /// Head range.
    pub heads: Range<u32>,
    /// Token range.
    pub tokens: Range<u32>,
}

impl KvRegion {
    /// A region from its four ranges.
    pub fn new(layers: Range<u32>, slots: Range<u32>, heads: Range<u32>, tokens: Range<u32>) -> Self {
        Self { layers, slots, heads, tokens }
    }

    /// The region covering `shape` starting at `origin` (saturating at `u32::MAX`, so a region
    /// running past it fails the bounds checks instead of wrapping).
    pub fn at(origin: Coord, shape: Shape) -> Self {
        Self {
            layers: origin.layer..origin.layer.saturating_add(shape.layers),
            slots: origin.slot..origin.slot.saturating_add(shape.slots),
            heads: origin.head..origin.head.saturating_add(shape.heads),
            tokens: origin.token..origin.token.saturating_add(shape.tokens),
        }
    }

    /// The lowest corner.
    pub fn origin(&self) -> Coord {
        Coord {
            layer: self.layers.start,
            slot: self.slots.start,
            head: self.heads.start,
            token: self.tokens.start,
        }
    }

    /// Extent along each axis (zero for an inverted range).
    pub fn shape(&self) -> Shape {
        let len = |r: &Range<u32>| r.end.saturating_sub(r.start);
        Shape {
            layers: len(&self.layers),
            slots: len(&self.slots),
            heads: len(&self.heads),
            tokens: len(&self.tokens),
        }
    }

    /// Whether the region holds no element.
    pub fn is_empty(&self) -> bool {
        self.shape().is_empty()
    }
}
