//! Where an engine resumes from the chunks a store keeps for it.
//!
//! A restarted engine asks its sidecar which of its own chunks it keeps
//! ([`crate::local::LocalSidecar::recovery`]). [`resume_points`] turns that list into what to
//! do: for each sequence (a destination worker, microbatch and slot range), the tokens whose KV
//! is held for every layer and head the chunks name, counted from token 0, and the chunks to
//! fetch to restore them. KV after a gap is useless (the steps after the gap need the missing
//! one), so a resume point stops at the first token some layer or head lacks; the engine
//! recomputes from there.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::chunk::ChunkKey;
use crate::placement::WorkerId;
use crate::region::KvRegion;

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

/// Groups `keys` by destination, microbatch and slot range, and finds each group's resume point
/// (see the module's documentation). Groups come out in that order; a group whose KV lacks
/// token 0 somewhere has `tokens == 0` and no chunks.
pub fn resume_points(keys: &[ChunkKey]) -> Vec<ResumePoint> {
    let mut groups: BTreeMap<SequenceId, Vec<&KvRegion>> = BTreeMap::new();
    for key in keys.iter().filter(|k| !k.region.is_empty()) {
        let slots = (key.region.slots.start, key.region.slots.end);
        groups.entry((key.destination, key.microbatch, slots)).or_default().push(&key.region);
    }
    groups
        .into_iter()
        .map(|((destination, microbatch, (first, end)), regions)| {
            let layers = span(regions.iter().map(|r| &r.layers));
            let heads = span(regions.iter().map(|r| &r.heads));
            let tokens = held_prefix(&regions, &layers, &heads);
            let mut chunks: Vec<KvRegion> =
                regions.iter().filter(|r| r.tokens.start < tokens).map(|r| (*r).clone()).collect();
            chunks.sort_by_key(|r| (r.tokens.start, r.layers.start, r.heads.start));
            ResumePoint { destination, microbatch, slots: first..end, layers, heads, tokens, chunks }
        })
        .collect()
}

/// The smallest range holding all of `ranges` (one at least).
fn span<'a>(mut ranges: impl Iterator<Item = &'a Range<u32>>) -> Range<u32> {
    let first = ranges.next().cloned().unwrap_or_default();
    ranges.fold(first, |acc, r| acc.start.min(r.start)..acc.end.max(r.end))
}

/// Tokens from 0 held in every cell of `layers` x `heads`: the cells are cut at every chunk's
/// layer and head boundaries, and each cell's prefix counts only chunks that cover it whole.
fn held_prefix(regions: &[&KvRegion], layers: &Range<u32>, heads: &Range<u32>) -> u32 {
    let cells = |pick: fn(&KvRegion) -> &Range<u32>, whole: &Range<u32>| {
        let mut cuts: Vec<u32> = regions.iter().flat_map(|r| [pick(r).start, pick(r).end]).collect();
        cuts.extend([whole.start, whole.end]);
        cuts.sort_unstable();
        cuts.dedup();
        cuts.windows(2).map(|w| w[0]..w[1]).collect::<Vec<_>>()
    };
    let layer_cells = cells(|r| &r.layers, layers);
    let head_cells = cells(|r| &r.heads, heads);
    let mut prefix = u32::MAX;
    for l in &layer_cells {
        for h in &head_cells {
            let mut runs: Vec<Range<u32>> = regions
                .iter()
                .filter(|r| covers(&r.layers, l) && covers(&r.heads, h))
                .map(|r| r.tokens.clone())
                .collect();
            runs.sort_by_key(|t| t.start);
            let mut reach = 0;
            for t in &runs {
                if t.start > reach {
                    break;
                }
                reach = reach.max(t.end);
            }
            prefix = prefix.min(reach);
        }
    }
    if prefix == u32::MAX {
        0
    } else {
        prefix
    }
}

fn covers(outer: &Range<u32>, inner: &Range<u32>) -> bool {
    outer.start <= inner.start && inner.end <= outer.end
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

    #[test]
    fn a_prompt_then_steps_resume_after_the_last_step() {
        let keys =
            vec![key(1, 0, 0..4, 0..1, 5..6), key(1, 0, 0..4, 0..1, 0..4), key(1, 0, 0..4, 0..1, 4..5)];
        let points = resume_points(&keys);
        assert_eq!(points.len(), 1);
        let p = &points[0];
        assert_eq!((p.tokens, p.layers.clone(), p.heads.clone()), (6, 0..4, 0..2));
        let starts: Vec<u32> = p.chunks.iter().map(|r| r.tokens.start).collect();
        assert_eq!(starts, [0, 4, 5]);
    }

    #[test]
    fn a_gap_stops_the_resume_point_and_what_follows_is_left_out() {
        let keys = vec![key(1, 0, 0..4, 0..1, 0..4), key(1, 0, 0..4, 0..1, 5..6)];
        let p = &resume_points(&keys)[0];
        assert_eq!(p.tokens, 4);
        assert_eq!(p.chunks.len(), 1);
    }

    #[test]
    fn a_prompt_streamed_layer_by_layer_counts_only_when_every_layer_is_there() {
        let mut keys: Vec<ChunkKey> = (0..4).map(|l| key(1, 0, l..l + 1, 0..1, 0..8)).collect();
        keys.push(key(1, 0, 0..4, 0..1, 8..9));
        assert_eq!(resume_points(&keys)[0].tokens, 9);
        keys.remove(2);
        let p = &resume_points(&keys)[0];
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
        assert_eq!(resume_points(&keys)[0].tokens, 4);
        keys.push(ChunkKey {
            region: KvRegion { layers: 0..4, slots: 0..1, heads: 1..2, tokens: 4..5 },
            ..keys[0].clone()
        });
        assert_eq!(resume_points(&keys)[0].tokens, 5);
    }

    #[test]
    fn sequences_and_microbatches_are_apart() {
        let keys = vec![
            key(1, 0, 0..4, 0..1, 0..3),
            key(1, 0, 0..4, 1..2, 0..7),
            key(1, 1, 0..4, 0..1, 0..2),
            key(2, 0, 0..4, 0..1, 0..9),
        ];
        let got: Vec<(u32, u32, u32, u32)> = resume_points(&keys)
            .iter()
            .map(|p| (p.destination.stage, p.microbatch, p.slots.start, p.tokens))
            .collect();
        assert_eq!(got, [(1, 0, 0, 3), (1, 0, 1, 7), (1, 1, 0, 2), (2, 0, 0, 9)]);
    }

    #[test]
    fn nothing_held_is_no_resume_point() {
        assert!(resume_points(&[]).is_empty());
        assert!(resume_points(&[key(1, 0, 0..4, 0..1, 3..3)]).is_empty());
    }
}
