//! A store that keeps only the current sequence of each place (`HostStore::keeping_current_sequences`,
//! what a sidecar runs): a sequence's token-0 chunk drops the chunks put before it for the same
//! worker and microbatch whose layers, slots and heads overlap it, and nothing else; the bytes
//! held stay bounded however many requests pass through a slot.

mod common;

use std::ops::Range;

use dejavulib::chunk::{ChunkDescriptor, ChunkKey, SequencePlace};
use dejavulib::net::tcp::TcpTransport;
use dejavulib::net::{ClientConfig, PeerServer, PeerStore, ServerConfig};
use dejavulib::spill::Spill;
use dejavulib::store::StoreError;
use dejavulib::{ChunkStore, DType, HostStore, KvRegion, KvSpec, Packing, WorkerId};

/// A chunk for `worker` (stage), `microbatch`, of `slots`, every layer and head, `tokens`.
fn chunk(worker: u32, microbatch: u32, slots: Range<u32>, tokens: Range<u32>) -> (ChunkDescriptor, Vec<u8>) {
    chunk_of(worker, microbatch, KvRegion::new(0..2, slots, 0..2, tokens))
}

/// A chunk of `region` (int8 heads of 4), for `worker` and `microbatch`.
fn chunk_of(worker: u32, microbatch: u32, region: KvRegion) -> (ChunkDescriptor, Vec<u8>) {
    let shape = region.shape();
    let spec = KvSpec::new(shape.layers, shape.heads, 4, DType::Int8).unwrap();
    let bytes = region.shape().bytes(&spec) as usize;
    let descriptor = ChunkDescriptor {
        source: WorkerId { stage: worker, rank: 0 },
        destination: WorkerId { stage: worker, rank: 0 },
        microbatch,
        region,
        spec,
        packing: Packing::token_major(&spec),
    };
    let payload = common::Rng::new(u64::from(worker) * 7 + u64::from(microbatch) + bytes as u64).bytes(bytes);
    (descriptor, payload)
}

fn put(store: &mut HostStore, (descriptor, payload): (ChunkDescriptor, Vec<u8>)) -> ChunkKey {
    store.put(&descriptor, &payload).unwrap();
    descriptor.key()
}

fn held(store: &HostStore) -> Vec<ChunkKey> {
    let mut keys: Vec<ChunkKey> = store.keys().into_iter().map(|(k, _)| k).collect();
    keys.sort_by_key(|k| (k.destination.stage, k.microbatch, k.region.slots.start, k.region.tokens.start));
    keys
}

#[test]
fn a_sequence_start_drops_the_sequences_before_it_where_they_overlap_and_nothing_else() {
    let mut store = HostStore::new().keeping_current_sequences();
    // Sequence A in slots 0..2 of microbatch 0: its prompt, then two decode steps.
    let a: Vec<ChunkKey> =
        [0..5, 5..6, 6..7].into_iter().map(|t| put(&mut store, chunk(1, 0, 0..2, t))).collect();
    // Elsewhere: another microbatch, another worker, and slots 4..6 of microbatch 0.
    let other_microbatch = put(&mut store, chunk(1, 1, 0..2, 0..3));
    let other_worker = put(&mut store, chunk(2, 0, 0..2, 0..3));
    let other_slots = put(&mut store, chunk(1, 0, 4..6, 0..3));
    // A new sequence in slots 1..3 overlaps A in slot 1: A goes, whole.
    let b = put(&mut store, chunk(1, 0, 1..3, 0..4));
    let mut expected = vec![other_microbatch, other_worker, other_slots, b.clone()];
    expected
        .sort_by_key(|k| (k.destination.stage, k.microbatch, k.region.slots.start, k.region.tokens.start));
    assert_eq!(held(&store), expected);
    assert!(a.iter().all(|k| !store.keys().iter().any(|(held, _)| held == k)));
    // B's decode steps drop nothing.
    let steps: Vec<ChunkKey> =
        [4..5, 5..6].into_iter().map(|t| put(&mut store, chunk(1, 0, 1..3, t))).collect();
    assert!(steps.iter().all(|s| store.keys().iter().any(|(k, _)| k == s)));
    assert_eq!(store.len(), 6);
    // A token-0 chunk put again is a start again: what came before it counts no more for a
    // restore ([`dejavulib::resume`]), and goes. (Re-seeds send each start before what follows
    // it, in put order, so a copy never receives a sequence's start after its later steps.)
    put(&mut store, chunk(1, 0, 1..3, 0..4));
    assert_eq!(store.len(), 4);
    let usage = store.usage();
    assert_eq!(usage.replaced_chunks, 5);
    let in_memory: u64 = store.keys().iter().map(|(k, _)| store.encoded_len(k).unwrap() as u64).sum();
    assert_eq!(usage.memory_bytes, in_memory, "the memory count follows what is held");
}

#[test]
fn a_layer_by_layer_prompt_drops_each_layer_of_the_old_sequence_as_its_own_arrives() {
    let mut store = HostStore::new().keeping_current_sequences();
    let old = |layer: u32| chunk_of(1, 0, KvRegion::new(layer..layer + 1, 0..1, 0..2, 0..9));
    let (old0, old1) = (put(&mut store, old(0)), put(&mut store, old(1)));
    // The new prompt's layer 0 arrives: layer 1 of the old sequence stays until its own does.
    let new0 = put(&mut store, chunk_of(1, 0, KvRegion::new(0..1, 0..1, 0..2, 0..3)));
    assert_eq!(held(&store).len(), 2);
    assert!(store.keys().iter().any(|(k, _)| *k == old1) && !store.keys().iter().any(|(k, _)| *k == old0));
    let new1 = put(&mut store, chunk_of(1, 0, KvRegion::new(1..2, 0..1, 0..2, 0..3)));
    let mut expected = vec![new0, new1];
    expected.sort_by_key(|k| k.region.layers.start);
    let mut keys = held(&store);
    keys.sort_by_key(|k| k.region.layers.start);
    assert_eq!(keys, expected);
}

#[test]
fn a_plain_store_keeps_every_chunk() {
    let mut store = HostStore::new();
    put(&mut store, chunk(1, 0, 0..2, 0..5));
    put(&mut store, chunk(1, 0, 0..2, 0..3));
    assert_eq!(store.len(), 2);
    assert_eq!(store.usage().replaced_chunks, 0);
}

#[test]
fn many_requests_of_random_lengths_in_one_slot_hold_one_sequence_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    // A small memory budget, so that chunks spill too and their files are removed with them.
    let spill = Spill { dir: dir.path().to_path_buf(), memory_bytes: 4096, dir_bytes: None };
    let mut store = HostStore::with_spill(spill).keeping_current_sequences();
    let mut rng = common::Rng::new(2024);
    let per_token = 2 * 2 * 4 * 2; // layers x heads x head_dim x (K, V), int8
    let mut most = 0;
    for _ in 0..400 {
        let prompt = rng.range(1, 200);
        put(&mut store, chunk(1, 0, 0..1, 0..prompt));
        for step in 0..8 {
            put(&mut store, chunk(1, 0, 0..1, prompt + step..prompt + step + 1));
        }
        let usage = store.usage();
        let held_bytes = usage.memory_bytes + usage.spilled_bytes;
        most = most.max(held_bytes);
        // One sequence of at most 208 tokens, and its chunks' headers.
        assert!(held_bytes <= (208 * per_token + 9 * 256) as u64, "{held_bytes} bytes held");
        assert_eq!(store.len(), 9);
    }
    let files = std::fs::read_dir(dir.path()).unwrap().count() as u64;
    assert_eq!(files, store.usage().spilled_chunks, "a dropped chunk's spill file went with it");
    assert!(most > 0);
}

/// A released place drops every chunk of it (any layers, heads and tokens, and partly overlapping
/// slot ranges), in a plain store too; releasing again drops nothing. Over a peer, a release from
/// a fenced sender is refused, as its puts are.
#[test]
fn a_release_drops_the_place_whole_and_a_fenced_sender_cannot_release() {
    let mut store = HostStore::new();
    let a: Vec<ChunkKey> = [0..5, 5..6].into_iter().map(|t| put(&mut store, chunk(1, 0, 0..2, t))).collect();
    let neighbour = put(&mut store, chunk(1, 0, 2..4, 0..3));
    let other_microbatch = put(&mut store, chunk(1, 1, 0..2, 0..3));
    let layer = put(&mut store, chunk_of(1, 0, KvRegion::new(1..2, 1..2, 0..1, 0..9)));
    let place = SequencePlace { destination: WorkerId { stage: 1, rank: 0 }, microbatch: 0, slots: 1..2 };
    assert_eq!(store.release(&place).unwrap(), 3, "both of A's chunks and the one-layer chunk");
    assert_eq!(held(&store), [neighbour.clone(), other_microbatch.clone()]);
    assert_eq!(store.release(&place).unwrap(), 0);
    let usage = store.usage();
    assert_eq!(usage.released_chunks, 3);
    assert!(usage.released_bytes > 0 && usage.replaced_chunks == 0);
    drop((a, layer));

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let peer_store = HostStore::new();
    let server = runtime
        .block_on(PeerServer::bind(
            &TcpTransport::plain(),
            "127.0.0.1:0".parse().unwrap(),
            ServerConfig::new("release", 9),
            peer_store.clone(),
        ))
        .unwrap();
    let client_of = |epoch| {
        let mut config = ClientConfig::new("release", 1);
        config.epoch = epoch;
        PeerStore::new(
            runtime.handle().clone(),
            std::sync::Arc::new(TcpTransport::plain()),
            server.addr(),
            config,
        )
    };
    let (mut newer, mut older) = (client_of(2), client_of(1));
    put_into(&mut newer, chunk(1, 0, 0..2, 0..5));
    put_into(&mut newer, chunk(1, 0, 2..4, 0..5));
    let whole = SequencePlace { slots: 0..2, ..place };
    let stale = older.release(&whole).unwrap_err();
    assert!(matches!(stale, StoreError::Io { .. }) && stale.to_string().contains("older"), "{stale}");
    assert_eq!(peer_store.len(), 2, "the stale release dropped nothing");
    assert_eq!(newer.release(&whole).unwrap(), 1);
    assert_eq!(peer_store.len(), 1);
}

fn put_into(store: &mut PeerStore, (descriptor, payload): (ChunkDescriptor, Vec<u8>)) {
    store.put(&descriptor, &payload).unwrap();
}

#[test]
fn a_chunk_given_back_after_the_store_replaced_it_serves_the_next_chunk() {
    let store = HostStore::new();
    // 256 KiB payloads: large enough to be pooled.
    let region = KvRegion::new(0..2, 0..1, 0..2, 0..8192);
    let encoded = |(descriptor, payload): (ChunkDescriptor, Vec<u8>)| {
        let mut chunk = descriptor.encode_header(&payload).to_vec();
        chunk.extend_from_slice(&payload);
        chunk
    };
    let first = encoded(chunk_of(1, 0, region.clone()));
    let (descriptor, kept) = store.put_copied(&first).unwrap();

    // Given back while the store still holds it: nothing changes.
    store.give_back(kept.clone());
    assert_eq!(store.pooled_bytes(), 0);
    let mut back = Vec::new();
    store.clone().get(&descriptor.key(), &mut back).unwrap();
    assert!(back == first[first.len() - back.len()..], "the chunk held is intact");

    // Replaced while a forward still holds it: its buffer cannot be reused yet.
    let second = encoded(chunk_of(1, 0, region));
    let (_, replacing) = store.put_copied(&second).unwrap();
    assert_eq!(store.pooled_bytes(), 0, "a buffer someone holds is not pooled");

    // Given back once the forward is over: it waits for the next chunk of its size.
    store.give_back(kept);
    let pooled = store.pooled_bytes();
    assert!(pooled >= first.len() as u64, "{pooled} bytes pooled, for a chunk of {}", first.len());
    drop(replacing);
    let (_, third) = store.put_copied(&second).unwrap();
    assert_eq!(store.pooled_bytes(), pooled, "the next chunk took the buffer given back");
    assert!(**third == second);
}
