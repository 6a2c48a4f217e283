//! Remote flush / fetch over real TCP sockets on loopback: round trips, authentication, limits,
//! and reconnection after the peer restarts.

use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::Ordering;

use dejavulib::chunk::ChunkDescriptor;
use dejavulib::peer::{PeerConfig, PeerServer, PeerStore};
use dejavulib::store::StoreError;
use dejavulib::wire::{write_frame, FrameHeader, Kind};
use dejavulib::{ChunkStore, DType, HostStore, KvCache, KvLayout, KvRegion, KvSpec, Packing, WorkerId};

const SECRET: &[u8] = b"cluster secret";

fn chunk(tokens: u32) -> (ChunkDescriptor, Vec<u8>) {
    let spec = KvSpec::new(2, 2, 64, DType::F16).unwrap();
    let region = KvRegion::new(0..2, 0..1, 0..2, 0..tokens);
    let cache = KvCache::new(KvLayout::faster_transformer(spec, 1, tokens).unwrap()).unwrap();
    let mut bytes = vec![0u8; cache.packed_len(&region) as usize];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }
    let packing = Packing::token_major(&spec);
    cache.scatter(&region, packing, &bytes).unwrap();
    let mut payload = vec![0u8; bytes.len()];
    cache.gather(&region, packing, &mut payload).unwrap();
    assert_eq!(payload, bytes);
    let descriptor = ChunkDescriptor {
        source: WorkerId { stage: 0, rank: 0 },
        destination: WorkerId { stage: 1, rank: 0 },
        microbatch: 0,
        region,
        spec,
        packing,
    };
    (descriptor, payload)
}

#[test]
fn chunks_round_trip_through_a_peer() {
    let server = PeerServer::bind("127.0.0.1:0", PeerConfig::new(SECRET, 1), HostStore::new()).unwrap();
    let mut store = PeerStore::new(server.addr(), PeerConfig::new(SECRET, 2));
    let (descriptor, payload) = chunk(64);
    store.put(&descriptor, &payload).unwrap();
    let mut back = Vec::new();
    let got = store.get(&descriptor.key(), &mut back).unwrap();
    assert_eq!(got, descriptor);
    assert_eq!(back, payload);
    assert_eq!(server.stats().puts.load(Ordering::Relaxed), 1);
    assert_eq!(server.store().len(), 1);
    let mut missing = descriptor.key();
    missing.microbatch = 9;
    assert!(matches!(store.get(&missing, &mut back), Err(StoreError::NotFound(_))));
}

#[test]
fn a_client_without_the_secret_is_refused_before_sending_kv() {
    let server = PeerServer::bind("127.0.0.1:0", PeerConfig::new(SECRET, 1), HostStore::new()).unwrap();
    let mut store = PeerStore::new(server.addr(), PeerConfig::new(b"wrong".to_vec(), 2));
    let (descriptor, payload) = chunk(8);
    let err = store.put(&descriptor, &payload).unwrap_err();
    assert!(err.to_string().contains("authentication failed"), "{err}");
    assert_eq!(server.stats().puts.load(Ordering::Relaxed), 0);
    assert!(server.store().is_empty());

    // A raw client that skips the handshake and sends a KV frame straight away.
    let mut raw = TcpStream::connect(server.addr()).unwrap();
    let (descriptor, payload) = chunk(8);
    let mut bytes = descriptor.encode_header(&payload).to_vec();
    bytes.extend_from_slice(&payload);
    let _ = write_frame(&mut raw, &FrameHeader::new(Kind::Put, 9, 0, 1), &bytes);
    let _ = raw.flush();
    let mut sink = Vec::new();
    let _ = std::io::Read::read_to_end(&mut raw, &mut sink); // the server closes the connection
    assert!(server.store().is_empty());
    assert!(server.stats().refused.load(Ordering::Relaxed) >= 2);
}

#[test]
fn oversized_frames_close_the_connection() {
    let mut config = PeerConfig::new(SECRET, 1);
    config.max_payload = 1024;
    let server = PeerServer::bind("127.0.0.1:0", config, HostStore::new()).unwrap();
    let mut store = PeerStore::new(server.addr(), PeerConfig::new(SECRET, 2));
    store.retries = 1;
    let (descriptor, payload) = chunk(64);
    assert!(payload.len() > 1024);
    assert!(store.put(&descriptor, &payload).is_err());
    assert!(server.store().is_empty());
    assert!(server.stats().bad_frames.load(Ordering::Relaxed) >= 1);
}

#[test]
fn the_client_reconnects_after_the_peer_restarts() {
    let first = PeerServer::bind("127.0.0.1:0", PeerConfig::new(SECRET, 1), HostStore::new()).unwrap();
    let addr = first.addr();
    let mut store = PeerStore::new(addr, PeerConfig::new(SECRET, 2));
    let (descriptor, payload) = chunk(16);
    store.put(&descriptor, &payload).unwrap();
    drop(first);
    let second = PeerServer::bind(addr, PeerConfig::new(SECRET, 1), HostStore::new()).unwrap();
    store.put(&descriptor, &payload).unwrap();
    assert_eq!(second.stats().authenticated.load(Ordering::Relaxed), 1);
    assert_eq!(second.store().len(), 1);
}
