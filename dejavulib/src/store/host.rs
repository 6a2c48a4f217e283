//! [`HostStore`]: chunks in host memory, spilling beyond a budget to a directory.

use std::collections::{HashMap, VecDeque};
use std::fs;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::pool::BufferPool;
use super::{check_gathered, check_payload, gather_encoded, ChunkStore, Payload, StoreError};
use crate::cache::{GatherPlan, KvCache};
use crate::checksum::{copy_summed, xxh3_64};
use crate::chunk::{verify_payload, ChunkDescriptor, ChunkError, ChunkKey, SequencePlace, HEADER_LEN};
use crate::spill::{Spill, SpillDir, StoreUsage};

/// Where a [`HostStore`] holds one chunk, encoded as on disk and on the wire: header, then payload.
enum Held {
    Memory(Arc<Vec<u8>>),
    /// In a spill file of this many bytes.
    Spilled(PathBuf, u64),
}

impl Held {
    fn len(&self) -> usize {
        match self {
            Held::Memory(bytes) => bytes.len(),
            Held::Spilled(_, len) => *len as usize,
        }
    }
}

#[derive(Default)]
struct HostInner {
    chunks: HashMap<ChunkKey, Held>,
    /// Where chunks beyond the memory budget go, if anywhere.
    spill: Option<Arc<SpillDir>>,
    usage: StoreUsage,
    /// The most recent [`PUT_LOG_LEN`] keys put, if the store logs them
    /// ([`HostStore::logging_puts`]).
    log: Option<VecDeque<ChunkKey>>,
    /// When each chunk held was last put: the number of puts before it.
    put_numbers: HashMap<ChunkKey, u64>,
    /// Puts so far.
    puts: u64,
    /// Buffers of dropped and replaced chunks, kept for the next chunks received: a fresh
    /// allocation of MiB costs a page fault per 4 KiB when first written, and leaves holes behind
    /// that keep a long-running process's memory creeping up.
    spare: BufferPool,
    /// Whether a sequence's start drops the chunks of the sequences before it in the same place
    /// ([`HostStore::keeping_current_sequences`]).
    current_sequences_only: bool,
}

impl HostInner {
    /// Drops every chunk held for `start`'s worker and microbatch whose layers, slots and heads
    /// overlap `start`'s (but `start` itself, which is being put again): the sequences that
    /// `start`, a token-0 chunk, replaces there.
    fn drop_before(&mut self, start: &ChunkKey) {
        let overlap = |a: &std::ops::Range<u32>, b: &std::ops::Range<u32>| a.start < b.end && b.start < a.end;
        let (s, r) = (start, &start.region);
        let place =
            SequencePlace { destination: s.destination, microbatch: s.microbatch, slots: r.slots.clone() };
        let (chunks, bytes) = self.drop_where(|k| {
            k != s
                && place.holds(k)
                && overlap(&k.region.layers, &r.layers)
                && overlap(&k.region.heads, &r.heads)
        });
        self.usage.replaced_chunks += chunks;
        self.usage.replaced_bytes += bytes;
    }

    /// Drops every chunk whose key `drop` picks; returns (chunks, bytes) dropped.
    fn drop_where(&mut self, drop: impl Fn(&ChunkKey) -> bool) -> (u64, u64) {
        let dropped: Vec<ChunkKey> = self.chunks.keys().filter(|k| drop(k)).cloned().collect();
        let (mut chunks, mut bytes) = (0, 0);
        for key in dropped {
            self.put_numbers.remove(&key);
            let Some(held) = self.chunks.remove(&key) else { continue };
            chunks += 1;
            bytes += held.len() as u64;
            match held {
                Held::Memory(bytes) => {
                    self.usage.memory_bytes -= bytes.len() as u64;
                    if let Ok(buffer) = Arc::try_unwrap(bytes) {
                        self.spare.give(buffer);
                    }
                }
                Held::Spilled(path, len) => {
                    self.usage.spilled_bytes -= len;
                    self.usage.spilled_chunks -= 1;
                    // Small and rare (a sequence start or release): removed under the lock.
                    let _ = fs::remove_file(path);
                }
            }
        }
        (chunks, bytes)
    }
}

impl Drop for HostInner {
    fn drop(&mut self) {
        // Spill files are the store's alone: they go with it.
        for held in self.chunks.values() {
            if let Held::Spilled(path, _) = held {
                let _ = fs::remove_file(path);
            }
        }
    }
}

/// Keys a [`HostStore`] remembers in its put log.
pub const PUT_LOG_LEN: usize = 1 << 16;

/// Chunks in host memory (a peer's buffer, a swap space). Clones share the same store.
#[derive(Clone, Default)]
pub struct HostStore {
    inner: Arc<Mutex<HostInner>>,
}

impl HostStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store that keeps at most `spill.memory_bytes` in memory and writes the chunks
    /// beyond to files in `spill.dir` (see [`crate::spill`]).
    pub fn with_spill(spill: Spill) -> Self {
        let store = Self::default();
        store.inner.lock().spill = Some(Arc::new(SpillDir::new(spill)));
        store
    }

    /// From now on, holds only the current sequence's chunks in each place: a chunk that starts
    /// a sequence (its tokens start at 0) drops every chunk put before it for the same worker and
    /// microbatch whose layers, slots and heads overlap its own. Those chunks belong to requests
    /// that occupied the slots before, which no restore uses ([`crate::resume`]), so a store that
    /// serves traffic holds at most the caches' worth of KV instead of every request's. A
    /// sidecar keeps its engine's chunks and its predecessor's this way; the same chunk reaches
    /// both, so both drop the same ones.
    pub fn keeping_current_sequences(self) -> Self {
        self.inner.lock().current_sequences_only = true;
        self
    }

    /// How its bytes are split between memory and the spill directory.
    pub fn usage(&self) -> StoreUsage {
        self.inner.lock().usage
    }

    /// From now on, logs the keys put, in order ([`HostStore::put_log`]): for tests of what
    /// reaches a store in which order. A store that serves traffic does not: the log takes up to
    /// [`PUT_LOG_LEN`] keys of memory.
    pub fn logging_puts(self) -> Self {
        self.inner.lock().log = Some(VecDeque::new());
        self
    }

    /// Keys in the order they were put (a key put twice appears twice), the most recent
    /// [`PUT_LOG_LEN`] of them, since [`HostStore::logging_puts`] (none if not logging).
    pub fn put_log(&self) -> Vec<ChunkKey> {
        self.inner.lock().log.iter().flatten().cloned().collect()
    }

    /// Keys of the chunks held (in memory or spilled), each with when it was last put (the
    /// number of puts to this store before it), in no particular order.
    pub fn keys(&self) -> Vec<(ChunkKey, u64)> {
        let inner = self.inner.lock();
        inner.chunks.keys().map(|k| (k.clone(), inner.put_numbers.get(k).copied().unwrap_or(0))).collect()
    }

    /// Number of chunks held.
    pub fn len(&self) -> usize {
        self.inner.lock().chunks.len()
    }

    /// Whether the store is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of the chunk under `key` (header and payload), if held.
    pub fn encoded_len(&self, key: &ChunkKey) -> Option<usize> {
        self.inner.lock().chunks.get(key).map(|c| c.len())
    }

    /// Flips one payload byte of a held chunk (for fault tests): the next `get` must report it.
    pub fn corrupt(&self, key: &ChunkKey, byte: usize) -> bool {
        let mut inner = self.inner.lock();
        let held = match inner.chunks.get_mut(key) {
            Some(Held::Memory(bytes)) => Arc::make_mut(bytes).get_mut(HEADER_LEN + byte),
            _ => None,
        };
        match held {
            Some(b) => {
                *b ^= 0x5a;
                true
            }
            None => false,
        }
    }

    /// Keeps an encoded chunk (header and payload, as on the wire and on disk) without copying it,
    /// after checking it: a header that decodes, a payload of the length it says and with the
    /// checksum it says. Returns its descriptor and the bytes kept, shared (to send them on).
    pub fn put_encoded(&self, encoded: Vec<u8>) -> Result<(ChunkDescriptor, Arc<Vec<u8>>), StoreError> {
        self.put_encoded_summed(encoded, xxh3_64)
    }

    /// Keeps a copy of an encoded chunk whose bytes may change under it (a shared region another
    /// process writes): copied into a buffer of the store's, the payload hashed piece by piece as
    /// it is copied, and the copy checked as [`HostStore::put_encoded`] checks a chunk. Returns
    /// its descriptor and the bytes kept, shared.
    pub fn put_copied(&self, encoded: &[u8]) -> Result<(ChunkDescriptor, Arc<Vec<u8>>), StoreError> {
        let mut buffer = self.buffer_for(encoded.len());
        let (header, payload) = encoded.split_at(HEADER_LEN.min(encoded.len()));
        buffer.extend_from_slice(header);
        let sum = copy_summed(payload, &mut buffer);
        self.put_encoded_summed(buffer, |_| sum)
    }

    fn put_encoded_summed(
        &self,
        encoded: Vec<u8>,
        payload_sum: impl FnOnce(&[u8]) -> u64,
    ) -> Result<(ChunkDescriptor, Arc<Vec<u8>>), StoreError> {
        let corrupt = |source| StoreError::Chunk { key: "an encoded chunk".into(), source };
        if encoded.len() < HEADER_LEN {
            return Err(StoreError::PayloadLength { expected: HEADER_LEN as u64, got: encoded.len() as u64 });
        }
        let (descriptor, len, sum) =
            ChunkDescriptor::decode_header(&encoded[..HEADER_LEN]).map_err(corrupt)?;
        let payload = &encoded[HEADER_LEN..];
        if payload.len() as u64 != len {
            return Err(StoreError::PayloadLength { expected: len, got: payload.len() as u64 });
        }
        let actual = payload_sum(payload);
        if actual != sum {
            return Err(corrupt(ChunkError::PayloadCorrupt { expected: sum, actual }));
        }
        let kept = self.insert_encoded(descriptor.key(), encoded);
        Ok((descriptor, kept))
    }

    /// Keeps an encoded chunk (header and payload) the caller has verified, without copying it:
    /// in memory, or in a spill file once the memory budget is used (in memory still if the
    /// spill fails). Returns the bytes, shared (to send them on).
    pub(crate) fn insert_encoded(&self, key: ChunkKey, encoded: Vec<u8>) -> Arc<Vec<u8>> {
        let len = encoded.len() as u64;
        let kept = Arc::new(encoded);
        // Whether it spills is decided under the lock, the file written outside it: a slow disk
        // holds up no reader or writer of other chunks.
        let spill = {
            let mut inner = self.inner.lock();
            if inner.current_sequences_only && key.region.tokens.start == 0 && !key.region.is_empty() {
                inner.drop_before(&key);
            }
            if let Some(log) = inner.log.as_mut() {
                if log.len() == PUT_LOG_LEN {
                    log.pop_front();
                }
                log.push_back(key.clone());
            }
            let put = inner.puts;
            inner.put_numbers.insert(key.clone(), put);
            inner.puts += 1;
            let (memory, ours) = (inner.usage.memory_bytes, inner.usage.spilled_bytes);
            inner.spill.clone().filter(|s| memory + len > s.memory_bytes()).map(|s| (s, ours))
        };
        let spilled = spill.map(|(dir, ours)| dir.write(&key.file_name(), &kept, ours));
        let mut inner = self.inner.lock();
        let held = match spilled {
            Some(Ok(path)) => {
                inner.usage.spilled_bytes += len;
                inner.usage.spilled_chunks += 1;
                Held::Spilled(path, len)
            }
            not_spilled => {
                if not_spilled.is_some() {
                    inner.usage.spill_failures += 1;
                }
                inner.usage.memory_bytes += len;
                Held::Memory(kept.clone())
            }
        };
        let in_memory = matches!(held, Held::Memory(_));
        match inner.chunks.insert(key, held) {
            Some(Held::Memory(old)) => {
                inner.usage.memory_bytes -= old.len() as u64;
                // A buffer still being sent to a reader is not reusable yet; it comes back to the
                // pool if its holder gives it back (`give_back`), and is freed otherwise.
                if let Ok(buffer) = Arc::try_unwrap(old) {
                    inner.spare.give(buffer);
                }
            }
            Some(Held::Spilled(path, old_len)) => {
                inner.usage.spilled_bytes -= old_len;
                inner.usage.spilled_chunks -= 1;
                // A new spill took the same file name; a chunk kept in memory leaves it stale.
                if in_memory {
                    let _ = fs::remove_file(&path);
                }
            }
            None => {}
        }
        kept
    }

    /// Chunks held and their bytes (in memory or spilled), split by `first`: those whose key
    /// it takes, then the others. One pass under the store's lock.
    pub fn held_split(&self, first: impl Fn(&ChunkKey) -> bool) -> [(u64, u64); 2] {
        let inner = self.inner.lock();
        let mut split = [(0, 0); 2];
        for (key, held) in &inner.chunks {
            let side = &mut split[usize::from(!first(key))];
            side.0 += 1;
            side.1 += held.len() as u64;
        }
        split
    }

    /// Takes back a chunk the store handed out ([`HostStore::put_copied`],
    /// [`HostStore::put_encoded`]) once its holder is done with it (a forward, say). If the store
    /// replaced or dropped it meanwhile and nobody else holds it, its buffer waits for the next
    /// chunk of its size, as the buffer of a chunk dropped while nobody held it does, instead of
    /// going back to the system (to be faulted in again, page by page, for the next chunk).
    pub fn give_back(&self, chunk: Arc<Vec<u8>>) {
        if let Ok(buffer) = Arc::try_unwrap(chunk) {
            self.inner.lock().spare.give(buffer);
        }
    }

    /// Bytes of dropped and replaced chunks' buffers kept for the next chunks of their size (on
    /// top of what the store holds).
    pub fn pooled_bytes(&self) -> u64 {
        self.inner.lock().spare.bytes() as u64
    }

    /// An empty buffer with room for `len` bytes, to receive an encoded chunk into before
    /// [`HostStore::put_encoded`]: the buffer of a chunk the store dropped or replaced if one of
    /// the same size class waits, otherwise a new one. A sidecar copies its
    /// engine's chunks into them, the peer server reads chunks from the network into them.
    pub fn buffer_for(&self, len: usize) -> Vec<u8> {
        self.inner.lock().spare.take(len)
    }

    /// The encoded chunk under `key`, shared rather than copied (not verified: readers check it).
    /// A spill file that cannot be read whole counts as no chunk; it is read outside the lock.
    pub(crate) fn encoded(&self, key: &ChunkKey) -> Option<Arc<Vec<u8>>> {
        let (path, len) = match self.inner.lock().chunks.get(key)? {
            Held::Memory(bytes) => return Some(bytes.clone()),
            Held::Spilled(path, len) => (path.clone(), *len),
        };
        fs::read(path).ok().filter(|bytes| bytes.len() as u64 == len).map(Arc::new)
    }
}

impl HostStore {
    /// Drops every chunk of the sequence at `place` ([`ChunkStore::release`]); returns how many.
    pub fn release_place(&self, place: &SequencePlace) -> u64 {
        let mut inner = self.inner.lock();
        let (chunks, bytes) = inner.drop_where(|k| place.holds(k));
        inner.usage.released_chunks += chunks;
        inner.usage.released_bytes += bytes;
        chunks
    }
}

impl ChunkStore for HostStore {
    fn put(&mut self, descriptor: &ChunkDescriptor, payload: &[u8]) -> Result<(), StoreError> {
        check_payload(descriptor, payload)?;
        let mut encoded = self.buffer_for(HEADER_LEN + payload.len());
        encoded.extend_from_slice(&[0; HEADER_LEN]);
        let sum = copy_summed(payload, &mut encoded);
        let header = descriptor.encode_header_with_checksum(payload.len() as u64, sum);
        encoded[..HEADER_LEN].copy_from_slice(&header);
        self.insert_encoded(descriptor.key(), encoded);
        Ok(())
    }

    /// Gathers straight into a buffer of the store's, checksumming each piece as it is gathered.
    fn put_gathered(
        &mut self,
        descriptor: &ChunkDescriptor,
        cache: &KvCache,
        plan: &GatherPlan,
        staging: &mut [u8],
    ) -> Result<Duration, StoreError> {
        check_gathered(descriptor, plan, staging)?;
        let mut encoded = self.inner.lock().spare.take_len(HEADER_LEN + staging.len());
        gather_encoded(descriptor, cache, plan, &mut encoded)?;
        self.insert_encoded(descriptor.key(), encoded);
        Ok(Duration::ZERO)
    }

    /// The chunk as the store holds it, shared rather than copied, once verified.
    fn get_payload<'a>(
        &mut self,
        key: &ChunkKey,
        _buffer: &'a mut Vec<u8>,
    ) -> Result<(ChunkDescriptor, Payload<'a>), StoreError> {
        let chunk = self.encoded(key).ok_or_else(|| StoreError::NotFound(Box::new(key.clone())))?;
        if chunk.len() < HEADER_LEN {
            return Err(StoreError::PayloadLength { expected: HEADER_LEN as u64, got: chunk.len() as u64 });
        }
        let corrupt = |source| StoreError::Chunk { key: key.file_name(), source };
        let (descriptor, _, sum) = ChunkDescriptor::decode_header(&chunk[..HEADER_LEN]).map_err(corrupt)?;
        verify_payload(&chunk[HEADER_LEN..], sum).map_err(corrupt)?;
        Ok((descriptor, Payload::Shared(chunk)))
    }

    fn get(&mut self, key: &ChunkKey, out: &mut Vec<u8>) -> Result<ChunkDescriptor, StoreError> {
        let mut unused = Vec::new();
        let (descriptor, payload) = self.get_payload(key, &mut unused)?;
        out.clear();
        out.extend_from_slice(&payload);
        Ok(descriptor)
    }

    fn release(&mut self, place: &SequencePlace) -> Result<u64, StoreError> {
        Ok(self.release_place(place))
    }
}
