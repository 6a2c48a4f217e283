//! Microbatch swapping: a stage keeps fewer KV caches in "device" memory than it has microbatches
//! in flight, and the others' KV in host memory.
//!
//! Each device cache holds one microbatch at a time. Before a microbatch runs, it is made resident:
//! if no cache holds it, the cache of another microbatch is taken, that microbatch's KV written
//! since it was last swapped out is flushed to host memory, and the incoming microbatch's KV is
//! fetched back, delta by delta. Deltas are kept per sequence: KV of a sequence's position never
//! changes once written, but the sequences of a microbatch advance unevenly (a failure can stop a
//! microbatch between two of its sequences' steps), so a range of positions swapped out for one
//! sequence may not be written yet for another.
//! [`SwapCaches::prefetch`] does the same for the microbatch expected next while the rest of the
//! pipeline computes, so a step rarely waits for a swap.
//!
//! On this CPU engine "device" memory is a separately accounted pool of caches: it never holds
//! more than `device_caches` of them, and host memory holds the rest (D microbatches of KV at
//! most). With as many device caches as microbatches, nothing is ever swapped.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dejavulib::reshard::{receive, send, StreamError};
use dejavulib::{CacheError, HostStore, KvCache, KvRegion, StagingPool, Transfer, WorkerId};

/// Counters of a stage's swapping.
#[derive(Debug, Default)]
pub struct SwapStats {
    /// Microbatches brought into a device cache from host memory (prefetches included).
    pub swap_ins: AtomicU64,
    /// Bytes fetched from host memory.
    pub bytes_in: AtomicU64,
    /// Deltas flushed to host memory.
    pub swap_outs: AtomicU64,
    /// Bytes flushed to host memory.
    pub bytes_out: AtomicU64,
    /// Bytes of KV held in host memory.
    pub host_bytes: AtomicU64,
}

/// A stage's KV caches: device caches and, when there are fewer than microbatches, host memory.
pub struct SwapCaches {
    device: Vec<Arc<KvCache>>,
    /// The microbatch each device cache holds, if any.
    resident: Vec<Option<u32>>,
    /// Swap traffic goes through here; one chunk per delta.
    host: HostStore,
    /// For each (microbatch, slot), the token ranges in host memory, in order (together `0..end`).
    swapped: HashMap<(u32, u32), Vec<Range<u32>>>,
    /// For each (microbatch, slot), the tokens of KV its sequence holds.
    kv_len: HashMap<(u32, u32), u32>,
    /// When each device cache was last used, to evict the least recently used.
    used: Vec<u64>,
    clock: u64,
    /// The region of a whole microbatch (all layers, slots and heads of the stage).
    region: KvRegion,
    worker: WorkerId,
    pool: StagingPool,
    stats: Arc<SwapStats>,
}

impl SwapCaches {
    /// `device_caches` caches made by `make` (at least one) for microbatches named by the stage
    /// index `stage`, covering `region` (its tokens are ignored).
    pub fn new(
        device_caches: u32,
        stage: u32,
        region: KvRegion,
        mut make: impl FnMut() -> Result<KvCache, CacheError>,
        stats: Arc<SwapStats>,
    ) -> Result<Self, CacheError> {
        let device =
            (0..device_caches.max(1)).map(|_| make().map(Arc::new)).collect::<Result<Vec<_>, _>>()?;
        let n = device.len();
        Ok(Self {
            device,
            resident: vec![None; n],
            host: HostStore::new(),
            swapped: HashMap::new(),
            kv_len: HashMap::new(),
            used: vec![0; n],
            clock: 0,
            region,
            worker: WorkerId { stage, rank: 0 },
            pool: StagingPool::default(),
            stats,
        })
    }

    /// Device caches.
    pub fn device_caches(&self) -> usize {
        self.device.len()
    }

    /// Records that the sequence in `slot` of `microbatch` holds KV up to token `end`.
    pub fn grew(&mut self, microbatch: u32, slot: u32, end: u32) {
        let len = self.kv_len.entry((microbatch, slot)).or_insert(0);
        *len = (*len).max(end);
    }

    /// The device cache holding `microbatch`, bringing it in first if needed. `quiesce` is called
    /// with a cache before it is given to another microbatch, and with `true`: it must wait until
    /// nothing reads the cache any more (the streamer's copies of its KV), and say so.
    pub fn resident(
        &mut self,
        microbatch: u32,
        quiesce: &mut Quiesce<'_>,
    ) -> Result<Arc<KvCache>, StreamError> {
        self.clock += 1;
        if let Some(i) = self.resident.iter().position(|&r| r == Some(microbatch)) {
            self.used[i] = self.clock;
            return Ok(self.device[i].clone());
        }
        let i = self.victim(None);
        self.bring_in(i, microbatch, quiesce, true)?;
        Ok(self.device[i].clone())
    }

    /// Brings `microbatch` in ahead of time, if a device cache holding neither it nor `keep` (the
    /// microbatch that just ran) can be taken now: `quiesce` is called with `false` and says
    /// whether nothing reads it any more, without waiting (a prefetch never stalls the stage;
    /// when it cannot run, the microbatch is brought in when it is needed).
    pub fn prefetch(
        &mut self,
        microbatch: u32,
        keep: u32,
        quiesce: &mut Quiesce<'_>,
    ) -> Result<(), StreamError> {
        if self.device.len() < 2 || self.resident.contains(&Some(microbatch)) {
            return Ok(());
        }
        let i = self.victim(Some(keep));
        self.bring_in(i, microbatch, quiesce, false).map(|_| ())
    }

    /// The device cache to take: a free one, else the least recently used, never `keep`'s.
    fn victim(&self, keep: Option<u32>) -> usize {
        if let Some(free) = self.resident.iter().position(Option::is_none) {
            return free;
        }
        (0..self.device.len())
            .filter(|&i| keep.is_none() || self.resident[i] != keep)
            .min_by_key(|&i| self.used[i])
            .expect("two device caches or more when one is kept")
    }

    /// The transfer naming one sequence's KV.
    fn transfer(&self, microbatch: u32, slot: u32) -> Transfer {
        let region = KvRegion { slots: slot..slot + 1, ..self.region.clone() };
        Transfer::in_place(self.worker, self.worker, microbatch, &region)
    }

    /// Swaps the occupant of device cache `i` out (its delta) and `microbatch` in; returns whether
    /// it did (not when the cache is still read and `wait` is false). A failure leaves the
    /// occupant resident if its KV was not all flushed, and the cache free if the incoming KV was
    /// not all fetched: no cache is ever marked as holding KV it does not hold.
    fn bring_in(
        &mut self,
        i: usize,
        microbatch: u32,
        quiesce: &mut Quiesce<'_>,
        wait: bool,
    ) -> Result<bool, StreamError> {
        let cache = self.device[i].clone();
        let slots = self.region.slots.clone();
        if let Some(out) = self.resident[i] {
            if !quiesce(&cache, wait) {
                return Ok(false);
            }
            for slot in slots.clone() {
                let held = self.swapped.get(&(out, slot)).and_then(|r| r.last()).map_or(0, |r| r.end);
                let len = self.kv_len.get(&(out, slot)).copied().unwrap_or(0);
                if len <= held {
                    continue;
                }
                let receipt = send(&cache, &self.transfer(out, slot), held..len, &self.pool, &mut self.host)?;
                self.swapped.entry((out, slot)).or_default().push(held..len);
                self.stats.swap_outs.fetch_add(1, Ordering::Relaxed);
                self.stats.bytes_out.fetch_add(receipt.bytes, Ordering::Relaxed);
                self.stats.host_bytes.fetch_add(receipt.bytes, Ordering::Relaxed);
            }
            // Everything the occupant wrote is in host memory now.
            self.resident[i] = None;
        }
        let mut payload = Vec::new();
        let mut fetched = false;
        for slot in slots {
            for range in self.swapped.get(&(microbatch, slot)).cloned().unwrap_or_default() {
                let transfer = self.transfer(microbatch, slot);
                let receipt = receive(&cache, &transfer, range, &mut self.host, &mut payload)?;
                self.stats.bytes_in.fetch_add(receipt.bytes, Ordering::Relaxed);
                fetched = true;
            }
        }
        if fetched {
            self.stats.swap_ins.fetch_add(1, Ordering::Relaxed);
        }
        self.resident[i] = Some(microbatch);
        self.used[i] = self.clock;
        Ok(true)
    }
}

/// Called with a device cache about to hold another microbatch, and whether to wait: makes sure
/// nothing reads it any more (waiting if asked), and says whether that is so.
pub type Quiesce<'a> = dyn FnMut(&Arc<KvCache>, bool) -> bool + 'a;

#[cfg(test)]
mod tests {
    use dejavulib::{Coord, DType, KvLayout, KvSpec, Part};

    use super::*;

    const SLOTS: u32 = 2;

    fn caches(device: u32) -> SwapCaches {
        let spec = KvSpec::new(2, 2, 4, DType::F32).unwrap();
        let region = KvRegion::new(0..2, 0..SLOTS, 0..2, 0..0);
        let make = || KvCache::new(KvLayout::faster_transformer(spec, SLOTS, 16).unwrap());
        SwapCaches::new(device, 1, region, make, Arc::default()).unwrap()
    }

    /// Writes a vector unique to (microbatch, token) at every layer, slot and head of `token`.
    fn write(cache: &KvCache, microbatch: u32, token: u32) {
        for (layer, slot, head) in
            (0..2).flat_map(|l| (0..SLOTS).flat_map(move |s| (0..2).map(move |h| (l, s, h))))
        {
            let at = Coord { layer, slot, head, token };
            let value = (microbatch * 1000 + token * 10 + layer + slot + head) as f32;
            cache.write_vector(Part::K, at, &value.to_le_bytes().repeat(4)).unwrap();
        }
    }

    fn read(cache: &KvCache, token: u32) -> f32 {
        let mut out = [0u8; 16];
        cache.read_vector(Part::K, Coord { layer: 0, slot: 0, head: 0, token }, &mut out).unwrap();
        f32::from_le_bytes(out[..4].try_into().unwrap())
    }

    #[test]
    fn four_microbatches_in_two_device_caches_keep_their_kv() {
        let mut caches = caches(2);
        let mut quiesced = 0;
        // Each microbatch runs three steps, round-robin, prefetching the next one.
        for token in 0..3 {
            for m in 0..4 {
                let cache = caches
                    .resident(m, &mut |_, _| {
                        quiesced += 1;
                        true
                    })
                    .unwrap();
                if token > 0 {
                    assert_eq!(
                        read(&cache, token - 1),
                        (m * 1000 + (token - 1) * 10) as f32,
                        "m {m} token {token}"
                    );
                }
                write(&cache, m, token);
                (0..SLOTS).for_each(|slot| caches.grew(m, slot, token + 1));
                caches
                    .prefetch((m + 1) % 4, m, &mut |_, _| {
                        quiesced += 1;
                        true
                    })
                    .unwrap();
            }
        }
        for m in 0..4 {
            let cache = caches.resident(m, &mut |_, _| true).unwrap();
            for token in 0..3 {
                assert_eq!(read(&cache, token), (m * 1000 + token * 10) as f32);
            }
        }
        let stats = &caches.stats;
        assert!(quiesced > 0);
        assert!(stats.swap_ins.load(Ordering::Relaxed) >= 8, "prefetched");
        // Deltas only: each microbatch's three tokens went out once each, the last one in the
        // final pass's swap-outs.
        let bytes_per_token = 2 * SLOTS as u64 * 2 * 4 * 4 * 2;
        assert!(stats.bytes_out.load(Ordering::Relaxed) <= 4 * 3 * bytes_per_token);
    }

    #[test]
    fn sequences_of_a_microbatch_that_advance_unevenly_keep_their_kv() {
        // Slot 0 of microbatch 0 reaches token 1 before it is swapped out; slot 1 only after it
        // came back (a failure stopped the microbatch between its two sequences' steps).
        let mut caches = caches(1);
        let write_slot = |cache: &KvCache, slot: u32, token: u32, value: f32| {
            let at = Coord { layer: 0, slot, head: 0, token };
            cache.write_vector(Part::K, at, &value.to_le_bytes().repeat(4)).unwrap();
        };
        let read_slot = |cache: &KvCache, slot: u32, token: u32| {
            let mut out = [0u8; 16];
            cache.read_vector(Part::K, Coord { layer: 0, slot, head: 0, token }, &mut out).unwrap();
            f32::from_le_bytes(out[..4].try_into().unwrap())
        };
        let cache = caches.resident(0, &mut |_, _| true).unwrap();
        write_slot(&cache, 0, 0, 1.0);
        write_slot(&cache, 1, 0, 2.0);
        write_slot(&cache, 0, 1, 3.0);
        caches.grew(0, 0, 2);
        caches.grew(0, 1, 1);
        caches.resident(1, &mut |_, _| true).unwrap(); // microbatch 0 out, with slot 1 one token behind
        let cache = caches.resident(0, &mut |_, _| true).unwrap();
        write_slot(&cache, 1, 1, 4.0);
        caches.grew(0, 1, 2);
        caches.resident(1, &mut |_, _| true).unwrap(); // out again: only slot 1's new token
        let cache = caches.resident(0, &mut |_, _| true).unwrap();
        assert_eq!([0, 1].map(|t| read_slot(&cache, 0, t)), [1.0, 3.0]);
        assert_eq!([0, 1].map(|t| read_slot(&cache, 1, t)), [2.0, 4.0]);
    }

    #[test]
    fn a_prefetch_never_waits_for_a_cache_still_read() {
        let mut caches = caches(2);
        for m in 0..2 {
            let cache = caches.resident(m, &mut |_, _| true).unwrap();
            write(&cache, m, 0);
            (0..SLOTS).for_each(|slot| caches.grew(m, slot, 1));
        }
        // Microbatch 0's cache is still being copied: the prefetch of 2 gives up, nothing moves.
        let mut asked = Vec::new();
        caches
            .prefetch(2, 1, &mut |_, wait| {
                asked.push(wait);
                false
            })
            .unwrap();
        assert_eq!(asked, [false], "asked once, not to wait");
        assert_eq!(caches.resident, [Some(0), Some(1)]);
        assert_eq!(caches.stats.swap_outs.load(Ordering::Relaxed), 0);
        // Needed now, it waits and takes the cache; microbatch 0 keeps its KV in host memory.
        let mut waited = false;
        caches
            .resident(2, &mut |_, wait| {
                waited = wait;
                true
            })
            .unwrap();
        assert!(waited);
        // Back into the cache that held microbatch 1 (whose token 0 reads 1000): microbatch 0's.
        let cache = caches.resident(0, &mut |_, _| true).unwrap();
        assert_eq!(read(&cache, 0), 0.0);
    }

    #[test]
    fn with_a_cache_per_microbatch_nothing_is_swapped() {
        let mut caches = caches(4);
        for m in 0..4 {
            let cache = caches.resident(m, &mut |_, _| panic!("no cache changes hands")).unwrap();
            write(&cache, m, 0);
            (0..SLOTS).for_each(|slot| caches.grew(m, slot, 1));
            caches.prefetch((m + 1) % 4, m, &mut |_, _| panic!("no cache changes hands")).unwrap_or(());
        }
        assert_eq!(caches.stats.swap_ins.load(Ordering::Relaxed), 0);
        assert_eq!(caches.stats.bytes_out.load(Ordering::Relaxed), 0);
    }
}
