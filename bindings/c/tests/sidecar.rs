//! The C ABI's sidecar store against a real sidecar (the `dejavud sidecar` code, on a thread of
//! this test) and a real successor over TCP: a region flushed through the C calls crosses shared
//! memory, is forwarded, and comes back byte for byte; a sidecar that is not there is an I/O status
//! with a message.

use std::ffi::{CStr, CString};
use std::ptr;

use dejavu::*;
use dejavud::sidecar::{serve_sidecar, SidecarConfig};
use dejavulib::net::tcp::TcpTransport;
use dejavulib::net::{PeerServer, ServerConfig};
use dejavulib::HostStore;

const SECRET: &str = "dejavu reference cluster";

fn last_error() -> String {
    // SAFETY: djv_last_error returns a NUL-terminated string owned by this thread (or NULL).
    unsafe { CStr::from_ptr(djv_last_error()) }.to_string_lossy().into_owned()
}

/// A successor's transport in this process, and a sidecar of stage 1 (on a thread) forwarding to
/// it, with its local socket in `dir`.
struct Sidecar {
    _runtime: tokio::runtime::Runtime,
    successor: PeerServer,
    successor_store: HostStore,
    socket: std::path::PathBuf,
}

fn sidecar(dir: &std::path::Path) -> Sidecar {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let successor_store = HostStore::new();
    let successor = runtime
        .block_on(PeerServer::bind(
            &TcpTransport::plain(),
            "127.0.0.1:0".parse().unwrap(),
            ServerConfig::new(SECRET, 2),
            successor_store.clone(),
        ))
        .unwrap();
    let socket = dir.join("sidecar.sock");
    let config = SidecarConfig {
        fenced: None,
        engine_membership: None,
        engine_epoch: None,
        index: 1,
        listen: "127.0.0.1:0".parse().unwrap(),
        local: socket.clone(),
        shm_dir: dir.to_owned(),
        region_bytes: 1 << 20,
        secret: SECRET.as_bytes().to_vec(),
        skip_forwarding: false,
        spill: None,
        spare: None,
        transport: dejavud::transport::Transports::tcp(),
    };
    let (ready, listening) = std::sync::mpsc::channel();
    std::thread::spawn(move || serve_sidecar(config, None, None, |addr, _| ready.send(addr).unwrap()));
    listening.recv().unwrap();
    Sidecar { _runtime: runtime, successor, successor_store, socket }
}

/// A FasterTransformer layout (2 layers, 3 KV heads of 40, f16, 2 slots of 32 tokens) and two caches
/// of it: the engine's, and one to restore into. Freed when dropped.
struct Caches {
    layout: *mut DjvLayout,
    engine: *mut DjvCache,
    restored: *mut DjvCache,
}

impl Caches {
    fn new() -> Self {
        let mut caches = Self { layout: ptr::null_mut(), engine: ptr::null_mut(), restored: ptr::null_mut() };
        // SAFETY: the out-pointers are fields of a live local; the layout passed is the one made.
        unsafe {
            assert_eq!(
                djv_layout_faster_transformer(2, 3, 40, DjvElement::F16, 2, 32, &mut caches.layout),
                DjvStatus::Ok
            );
            assert_eq!(djv_cache_new(caches.layout, &mut caches.engine), DjvStatus::Ok);
            assert_eq!(djv_cache_new(caches.layout, &mut caches.restored), DjvStatus::Ok);
        }
        caches
    }
}

impl Drop for Caches {
    fn drop(&mut self) {
        // SAFETY: handles made by `Caches::new`, each freed once, here.
        unsafe {
            djv_cache_free(self.engine);
            djv_cache_free(self.restored);
            djv_layout_free(self.layout);
        }
    }
}

#[test]
fn a_region_flushed_to_the_sidecar_is_forwarded_and_comes_back() {
    let dir = tempfile::tempdir().unwrap();
    let Sidecar { _runtime, successor, successor_store, socket } = sidecar(dir.path());
    let region = DjvRegion {
        layers_start: 0,
        layers_end: 2,
        slots_start: 0,
        slots_end: 2,
        heads_start: 0,
        heads_end: 3,
        tokens_start: 4,
        tokens_end: 21,
    };
    let worker = DjvWorker { stage: 1, rank: 0 };
    let socket = CString::new(socket.to_str().unwrap()).unwrap();
    let successor_addr = CString::new(successor.addr().to_string()).unwrap();
    let caches = Caches::new();
    let (engine, restored) = (caches.engine, caches.restored);
    let mut store = ptr::null_mut();
    // SAFETY: every pointer passed is a live local or a handle these calls returned; lengths match
    // the buffers given.
    unsafe {
        let mut len = 0u64;
        assert_eq!(djv_packed_len(engine, &region, &mut len), DjvStatus::Ok);
        let noise: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        assert_eq!(djv_scatter(engine, &region, noise.as_ptr(), noise.len()), DjvStatus::Ok);

        let status = djv_sidecar_store_open(socket.as_ptr(), successor_addr.as_ptr(), 1, &mut store);
        assert_eq!(status, DjvStatus::Ok, "{}", last_error());
        assert_eq!(djv_flush(store, engine, &region, worker, worker, 2), DjvStatus::Ok, "{}", last_error());
        assert_eq!(successor_store.len(), 1, "forwarded to the successor");
        assert_eq!(djv_fetch(store, restored, &region, worker, worker, 2), DjvStatus::Ok, "{}", last_error());
        let mut back = vec![0u8; len as usize];
        assert_eq!(djv_gather(restored, &region, back.as_mut_ptr(), back.len()), DjvStatus::Ok);
        assert_eq!(back, noise);
        assert_eq!(djv_fetch(store, restored, &region, worker, worker, 7), DjvStatus::NotFound);

        // The sequence is finished: released here and at the successor, once.
        let mut released = 0u64;
        assert_eq!(djv_release(store, worker, 2, 0, 2, &mut released), DjvStatus::Ok, "{}", last_error());
        assert_eq!(released, 1);
        assert_eq!(successor_store.len(), 0, "the replica is released too");
        assert_eq!(djv_fetch(store, restored, &region, worker, worker, 2), DjvStatus::NotFound);
        assert_eq!(djv_release(store, worker, 2, 0, 2, ptr::null_mut()), DjvStatus::Ok);
        assert_eq!(djv_release(store, worker, 2, 2, 0, ptr::null_mut()), DjvStatus::InvalidArgument);

        let nowhere = CString::new(dir.path().join("nobody.sock").to_str().unwrap()).unwrap();
        let mut none = ptr::null_mut();
        assert_eq!(
            djv_sidecar_store_open(nowhere.as_ptr(), successor_addr.as_ptr(), 0, &mut none),
            DjvStatus::Io
        );
        assert!(last_error().contains("sidecar at"), "{}", last_error());
        assert!(none.is_null());
        let bad = CString::new("not an address").unwrap();
        assert_eq!(
            djv_sidecar_store_open(socket.as_ptr(), bad.as_ptr(), 0, &mut none),
            DjvStatus::InvalidArgument
        );

        djv_store_free(store);
    }
}

#[test]
fn a_restarted_engine_restores_what_its_sidecar_keeps_and_learns_where_to_resume() {
    let dir = tempfile::tempdir().unwrap();
    let Sidecar { _runtime, successor, socket, .. } = sidecar(dir.path());
    let socket = CString::new(socket.to_str().unwrap()).unwrap();
    let successor_addr = CString::new(successor.addr().to_string()).unwrap();
    let worker = DjvWorker { stage: 1, rank: 0 };
    let sequence = |slot: u32, tokens: std::ops::Range<u32>| DjvRegion {
        layers_start: 0,
        layers_end: 2,
        slots_start: slot,
        slots_end: slot + 1,
        heads_start: 0,
        heads_end: 3,
        tokens_start: tokens.start,
        tokens_end: tokens.end,
    };
    let caches = Caches::new();
    let (engine, restored) = (caches.engine, caches.restored);
    let mut store = ptr::null_mut();
    // SAFETY: every pointer passed is a live local or a handle these calls returned; lengths match
    // the buffers given.
    unsafe {
        let whole = DjvRegion { slots_end: 2, tokens_end: 32, ..sequence(0, 0..32) };
        let mut len = 0u64;
        assert_eq!(djv_packed_len(engine, &whole, &mut len), DjvStatus::Ok);
        let noise: Vec<u8> = (0..len).map(|i| (i * 13 + 5) as u8).collect();
        assert_eq!(djv_scatter(engine, &whole, noise.as_ptr(), noise.len()), DjvStatus::Ok);

        // Microbatch 0: slot 0 has a prompt of 6 tokens and 4 steps, slot 1 a prompt of 6.
        assert_eq!(
            djv_sidecar_store_open(socket.as_ptr(), successor_addr.as_ptr(), 1, &mut store),
            DjvStatus::Ok
        );
        let flushes =
            [sequence(0, 0..6), sequence(1, 0..6)].into_iter().chain((6..10).map(|t| sequence(0, t..t + 1)));
        for region in flushes {
            assert_eq!(
                djv_flush(store, engine, &region, worker, worker, 0),
                DjvStatus::Ok,
                "{}",
                last_error()
            );
        }
        djv_store_free(store);

        // The engine restarts.
        assert_eq!(
            djv_sidecar_store_open(socket.as_ptr(), successor_addr.as_ptr(), 2, &mut store),
            DjvStatus::Ok
        );
        let (mut stage, mut epoch) = (0u32, 0u64);
        assert_eq!(djv_sidecar_serves(store, &mut stage, &mut epoch), DjvStatus::Ok, "{}", last_error());
        assert_eq!((stage, epoch), (1, 2));
        let caches = [restored as *const DjvCache];
        let mut count = 0usize;
        let status = djv_sidecar_restore(store, worker, caches.as_ptr(), 1, ptr::null_mut(), 0, &mut count);
        assert_eq!((status, count), (DjvStatus::Ok, 2), "capacity 0 only counts");
        let mut one = [DjvResumePoint { destination: worker, microbatch: 9, held: sequence(9, 0..0) }];
        let status = djv_sidecar_restore(store, worker, caches.as_ptr(), 1, one.as_mut_ptr(), 1, &mut count);
        assert_eq!((status, count), (DjvStatus::InvalidArgument, 2), "too little room: nothing restored");
        assert!(last_error().contains("room for 1"), "{}", last_error());
        let status = djv_sidecar_restore(store, worker, ptr::null(), 1, one.as_mut_ptr(), 1, &mut count);
        assert_eq!(status, DjvStatus::InvalidArgument, "NULL caches");
        let mut points = [DjvResumePoint { destination: worker, microbatch: 9, held: sequence(9, 0..0) }; 2];
        let status =
            djv_sidecar_restore(store, worker, caches.as_ptr(), 1, points.as_mut_ptr(), 2, &mut count);
        assert_eq!(status, DjvStatus::Ok, "{}", last_error());
        let got: Vec<(u32, u32, u32)> =
            points.iter().map(|p| (p.microbatch, p.held.slots_start, p.held.tokens_end)).collect();
        assert_eq!(got, [(0, 0, 10), (0, 1, 6)]);
        for point in &points {
            let mut len = 0u64;
            assert_eq!(djv_packed_len(engine, &point.held, &mut len), DjvStatus::Ok);
            let (mut want, mut back) = (vec![0u8; len as usize], vec![1u8; len as usize]);
            assert_eq!(djv_gather(engine, &point.held, want.as_mut_ptr(), want.len()), DjvStatus::Ok);
            assert_eq!(djv_gather(restored, &point.held, back.as_mut_ptr(), back.len()), DjvStatus::Ok);
            assert!(want == back, "slot {} restored byte for byte", point.held.slots_start);
        }
        // A file store has no sidecar to ask.
        let files = CString::new(dir.path().join("chunks").to_str().unwrap()).unwrap();
        let mut file_store = ptr::null_mut();
        assert_eq!(djv_file_store_open(files.as_ptr(), &mut file_store), DjvStatus::Ok);
        assert_eq!(djv_sidecar_serves(file_store, &mut stage, &mut epoch), DjvStatus::InvalidArgument);
        assert!(last_error().contains("not a sidecar store"), "{}", last_error());

        djv_store_free(file_store);
        djv_store_free(store);
    }
}

#[test]
fn an_engine_that_joins_gets_its_epoch_from_the_sidecar() {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = sidecar(dir.path());
    let socket = CString::new(sidecar.socket.to_str().unwrap()).unwrap();
    let successor = CString::new(sidecar.successor.addr().to_string()).unwrap();
    let mut epochs = Vec::new();
    for _ in 0..2 {
        let mut store = ptr::null_mut();
        let mut epoch = u64::MAX;
        // SAFETY: NUL-terminated strings and a writable out-pointer; the store is freed below.
        unsafe {
            assert_eq!(
                djv_sidecar_join(socket.as_ptr(), successor.as_ptr(), &mut store),
                DjvStatus::Ok,
                "{}",
                last_error()
            );
            assert_eq!(djv_sidecar_epoch(store, &mut epoch), DjvStatus::Ok);
            djv_store_free(store);
        }
        epochs.push(epoch);
    }
    // Without a controller, each engine that joins takes over from the last in a newer epoch.
    assert_eq!(epochs, [0, 1]);
    // SAFETY: a NULL store is refused, not read.
    assert_eq!(unsafe { djv_sidecar_epoch(ptr::null_mut(), &mut 0) }, DjvStatus::InvalidArgument);
}
