//! Where an engine resumes from the chunks a store keeps for it.
//!
//! A restarted engine asks its sidecar which of its own chunks it keeps
//! ([`crate::local::LocalSidecar::recovery`]). [`resume_points`] turns that list into what to
//! do: for each sequence (a destination worker, microbatch and slot range), the tokens whose KV
//! is held for every layer and head the chunks name, counted from token 0, and the chunks to
//! fetch to restore them. KV after a gap is useless (the steps after the gap need the missing
//! one), so a resume point stops at the first token some layer or head lacks; the engine
//! recomputes from there.
//!
//! A slot range may have held other requests before: a sequence's KV starts at token 0, so in
//! each layer and head only the chunks put since the last token-0 chunk there count (a chunk that
//! is stale anywhere it reaches counts nowhere). A prompt streamed in pieces is fine as long as
//! each layer's token-0 piece comes before its later ones.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::chunk::ChunkKey;
use crate::placement::WorkerId;
use crate::region::KvRegion;

/// A chunk a store keeps, and when it was put.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldChunk {
    /// Its key.
    pub key: ChunkKey,
    /// When it was last put: puts to the store before it.
    pub put: u64,
}

impl HeldChunk {
    /// Bytes of [`HeldChunk::encode`].
    pub const ENCODED_LEN: usize = ChunkKey::ENCODED_LEN + 8;

    /// The key ([`ChunkKey::encode`]), then the put number (little-endian).
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = self.key.encode();
        bytes.extend_from_slice(&self.put.to_le_bytes());
        bytes
    }

    /// Inverse of [`HeldChunk::encode`]; `None` if malformed.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != Self::ENCODED_LEN {
            return None;
        }
        let (key, put) = bytes.split_at(ChunkKey::ENCODED_LEN);
        Some(Self { key: ChunkKey::decode(key)?, put: u64::from_le_bytes(put.try_into().ok()?) })
    }
}

/// A sequence's KV as held, and where its engine resumes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResumePoint {
    /// Worker the chunks are for.
    pub destination: WorkerId,
    /// Microbatch at the destination.
    pub microbatch: u32,
    /// Slots of the sequence (the chunks' slot range, exactly).
    pub slots: Range<u32>,
    /// Layers the chunks cover, together.
    pub layers: Range<u32>,
    /// Heads the chunks cover, together.
    pub heads: Range<u32>,
    /// KV of tokens `0..tokens` is held for every layer and head: the engine restores it and
    /// computes from token `tokens` on.
    pub tokens: u32,
    /// The chunks to fetch to restore it, by first token (those starting at or after `tokens`
    /// are left out).
    pub chunks: Vec<KvRegion>,
}

/// A sequence's chunks: destination, microbatch, and slot range as `(start, end)`.
type SequenceId = (WorkerId, u32, (u32, u32));

/// Groups `held` by destination, microbatch and slot range, and finds each group's resume point
/// (see the module's documentation). Groups come out in that order; a group whose KV lacks
/// token 0 somewhere has `tokens == 0` and no chunks.
pub fn resume_points(held: &[HeldChunk]) -> Vec<ResumePoint> {
    let mut groups: BTreeMap<SequenceId, Vec<(&KvRegion, u64)>> = BTreeMap::new();
    for chunk in held.iter().filter(|c| !c.key.region.is_empty()) {
        let key = &chunk.key;
        let slots = (key.region.slots.start, key.region.slots.end);
        groups.entry((key.destination, key.microbatch, slots)).or_default().push((&key.region, chunk.put));
    }
    groups
        .into_iter()
        .map(|((destination, microbatch, (first, end)), chunks)| {
            let current = current_sequence(&chunks);
            let layers = span(current.iter().map(|r| &r.layers));
            let heads = span(current.iter().map(|r| &r.heads));
            let tokens = held_prefix(&current);
            let mut chunks: Vec<KvRegion> =
                current.iter().filter(|r| r.tokens.start < tokens).map(|r| (*r).clone()).collect();
            chunks.sort_by_key(|r| (r.tokens.start, r.layers.start, r.heads.start));
            ResumePoint { destination, microbatch, slots: first..end, layers, heads, tokens, chunks }
        })
        .collect()
}

/// The chunks of a slot range's current sequence: those put, in every layer and head they cover,
/// no earlier than the last token-0 chunk covering that layer and head.
fn current_sequence<'a>(chunks: &[(&'a KvRegion, u64)]) -> Vec<&'a KvRegion> {
    let regions: Vec<&KvRegion> = chunks.iter().map(|&(r, _)| r).collect();
    // For each cell, when its last token-0 chunk was put.
    let starts: Vec<(Range<u32>, Range<u32>, u64)> = grid(&regions)
        .into_iter()
        .map(|(l, h)| {
            let start = chunks
                .iter()
                .filter(|(r, _)| r.tokens.start == 0 && covers(&r.layers, &l) && covers(&r.heads, &h))
                .map(|&(_, put)| put)
                .max();
            (l, h, start.unwrap_or(0))
        })
        .collect();
    chunks
        .iter()
        .filter(|&&(r, put)| {
            starts
                .iter()
                .all(|(l, h, start)| !(overlaps(&r.layers, l) && overlaps(&r.heads, h)) || put >= *start)
        })
        .map(|&(r, _)| r)
        .collect()
}

/// The smallest range holding all of `ranges` (one at least).
fn span<'a>(mut ranges: impl Iterator<Item = &'a Range<u32>>) -> Range<u32> {
    let first = ranges.next().cloned().unwrap_or_default();
    ranges.fold(first, |acc, r| acc.start.min(r.start)..acc.end.max(r.end))
}

/// Tokens from 0 held in every cell of `regions`' grid; each cell's prefix counts only chunks
/// that cover it whole.
fn held_prefix(regions: &[&KvRegion]) -> u32 {
    let prefix = grid(regions).into_iter().map(|(l, h)| {
        let mut runs: Vec<Range<u32>> = regions
            .iter()
            .filter(|r| covers(&r.layers, &l) && covers(&r.heads, &h))
            .map(|r| r.tokens.clone())
            .collect();
        runs.sort_by_key(|t| t.start);
        // By start: once one leaves a gap, so do all after it.
        runs.iter().fold(0, |reach, t| if t.start <= reach { reach.max(t.end) } else { reach })
    });
    prefix.min().unwrap_or(0)
}

/// The layer x head cells the regions' boundaries cut their span into.
fn grid(regions: &[&KvRegion]) -> Vec<(Range<u32>, Range<u32>)> {
    let heads = cells(regions, |r| &r.heads);
    cells(regions, |r| &r.layers)
        .into_iter()
        .flat_map(|l| heads.iter().map(move |h| (l.clone(), h.clone())))
        .collect()
}

/// The span of `pick` of `regions`, cut at every start and end.
fn cells(regions: &[&KvRegion], pick: fn(&KvRegion) -> &Range<u32>) -> Vec<Range<u32>> {
    let mut cuts: Vec<u32> = regions.iter().flat_map(|r| [pick(r).start, pick(r).end]).collect();
    cuts.sort_unstable();
    cuts.dedup();
    cuts.windows(2).map(|w| w[0]..w[1]).collect()
}

fn covers(outer: &Range<u32>, inner: &Range<u32>) -> bool {
    outer.start <= inner.start && inner.end <= outer.end
}

fn overlaps(a: &Range<u32>, b: &Range<u32>) -> bool {
    a.start < b.end && b.start < a.end
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(
        stage: u32,
        microbatch: u32,
        layers: Range<u32>,
        slots: Range<u32>,
        tokens: Range<u32>,
    ) -> ChunkKey {
        ChunkKey {
            destination: WorkerId { stage, rank: 0 },
            microbatch,
            region: KvRegion { layers, slots, heads: 0..2, tokens },
        }
    }

    /// The keys as put one after the other.
    fn in_order(keys: &[ChunkKey]) -> Vec<HeldChunk> {
        keys.iter().enumerate().map(|(put, key)| HeldChunk { key: key.clone(), put: put as u64 }).collect()
    }

    #[test]
    fn a_prompt_then_steps_resume_after_the_last_step() {
        // Listed in any order; the prompt was put first.
        let held = [
            (key(1, 0, 0..4, 0..1, 5..6), 2),
            (key(1, 0, 0..4, 0..1, 0..4), 0),
            (key(1, 0, 0..4, 0..1, 4..5), 1),
        ];
        let held: Vec<HeldChunk> = held.into_iter().map(|(key, put)| HeldChunk { key, put }).collect();
        let points = resume_points(&held);
        assert_eq!(points.len(), 1);
        let p = &points[0];
        assert_eq!((p.tokens, p.layers.clone(), p.heads.clone()), (6, 0..4, 0..2));
        let starts: Vec<u32> = p.chunks.iter().map(|r| r.tokens.start).collect();
        assert_eq!(starts, [0, 4, 5]);
    }

    #[test]
    fn a_gap_stops_the_resume_point_and_what_follows_is_left_out() {
        let keys = vec![key(1, 0, 0..4, 0..1, 0..4), key(1, 0, 0..4, 0..1, 5..6)];
        let p = &resume_points(&in_order(&keys))[0];
        assert_eq!(p.tokens, 4);
        assert_eq!(p.chunks.len(), 1);
    }

    #[test]
    fn a_prompt_streamed_layer_by_layer_counts_only_when_every_layer_is_there() {
        let mut keys: Vec<ChunkKey> = (0..4).map(|l| key(1, 0, l..l + 1, 0..1, 0..8)).collect();
        keys.push(key(1, 0, 0..4, 0..1, 8..9));
        assert_eq!(resume_points(&in_order(&keys))[0].tokens, 9);
        keys.remove(2);
        let p = &resume_points(&in_order(&keys))[0];
        assert_eq!(p.tokens, 0, "layer 2 lacks the prompt: nothing can be resumed");
        assert!(p.chunks.is_empty());
    }

    #[test]
    fn a_missing_head_shard_stops_it_too() {
        let mut keys = vec![key(1, 0, 0..4, 0..1, 0..4)];
        keys.push(ChunkKey {
            region: KvRegion { layers: 0..4, slots: 0..1, heads: 0..1, tokens: 4..5 },
            ..keys[0].clone()
        });
        assert_eq!(resume_points(&in_order(&keys))[0].tokens, 4);
        keys.push(ChunkKey {
            region: KvRegion { layers: 0..4, slots: 0..1, heads: 1..2, tokens: 4..5 },
            ..keys[0].clone()
        });
        assert_eq!(resume_points(&in_order(&keys))[0].tokens, 5);
    }

    #[test]
    fn sequences_and_microbatches_are_apart() {
        let keys = vec![
            key(1, 0, 0..4, 0..1, 0..3),
            key(1, 0, 0..4, 1..2, 0..7),
            key(1, 1, 0..4, 0..1, 0..2),
            key(2, 0, 0..4, 0..1, 0..9),
        ];
        let got: Vec<(u32, u32, u32, u32)> = resume_points(&in_order(&keys))
            .iter()
            .map(|p| (p.destination.stage, p.microbatch, p.slots.start, p.tokens))
            .collect();
        assert_eq!(got, [(1, 0, 0, 3), (1, 0, 1, 7), (1, 1, 0, 2), (2, 0, 0, 9)]);
    }

    #[test]
    fn nothing_held_is_no_resume_point() {
        assert!(resume_points(&[]).is_empty());
        assert!(resume_points(&in_order(&[key(1, 0, 0..4, 0..1, 3..3)])).is_empty());
    }

    #[test]
    fn a_new_request_in_the_same_slots_leaves_the_old_ones_chunks_out() {
        let mut keys = vec![key(1, 0, 0..4, 0..1, 0..5)];
        keys.extend((5..9).map(|t| key(1, 0, 0..4, 0..1, t..t + 1)));
        // A shorter prompt, then one step: tokens 3.. of the old request must not count.
        keys.push(key(1, 0, 0..4, 0..1, 0..3));
        keys.push(key(1, 0, 0..4, 0..1, 3..4));
        let p = &resume_points(&in_order(&keys))[0];
        assert_eq!(p.tokens, 4);
        assert_eq!(p.chunks.iter().map(|r| r.tokens.clone()).collect::<Vec<_>>(), [0..3, 3..4]);
    }

    #[test]
    fn a_prompt_in_pieces_layer_by_layer_and_token_by_token_is_one_sequence() {
        let keys = vec![
            key(1, 0, 0..1, 0..1, 0..4),
            key(1, 0, 0..1, 0..1, 4..8),
            key(1, 0, 1..2, 0..1, 0..4),
            key(1, 0, 1..2, 0..1, 4..8),
            key(1, 0, 0..2, 0..1, 8..9),
        ];
        let p = &resume_points(&in_order(&keys))[0];
        assert_eq!((p.tokens, p.chunks.len()), (9, 5));
    }

    #[test]
    fn held_chunks_encode_and_decode() {
        let held = HeldChunk { key: key(3, 2, 1..4, 0..8, 10..11), put: u64::MAX - 7 };
        let bytes = held.encode();
        assert_eq!(bytes.len(), HeldChunk::ENCODED_LEN);
        assert_eq!(HeldChunk::decode(&bytes), Some(held));
        assert_eq!(HeldChunk::decode(&bytes[1..]), None);
    }
}
