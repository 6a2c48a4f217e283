//! The C ABI's sidecar store against a real sidecar (the `dejavud sidecar` code, on a thread of
//! this test) and a real successor over TCP: a region flushed through the C calls crosses shared
//! memory, is forwarded, and comes back byte for byte; a sidecar that is not there is an I/O status
//! with a message.

use std::ffi::{CStr, CString};
use std::ptr;

use dejavu::*;
use dejavu_engine::sidecar::{serve_sidecar, SidecarConfig};
use dejavulib::net::tcp::TcpTransport;
use dejavulib::net::{PeerServer, ServerConfig};
use dejavulib::HostStore;

const SECRET: &str = "dejavu reference cluster";

fn last_error() -> String {
    // SAFETY: djv_last_error returns a NUL-terminated string owned by this thread (or NULL).
    unsafe { CStr::from_ptr(djv_last_error()) }.to_string_lossy().into_owned()
}

#[test]
fn a_region_flushed_to_the_sidecar_is_forwarded_and_comes_back() {
    let dir = tempfile::tempdir().unwrap();
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
    let socket = dir.path().join("sidecar.sock");
    let config = SidecarConfig {
        index: 1,
        listen: "127.0.0.1:0".parse().unwrap(),
        local: socket.clone(),
        shm_dir: dir.path().to_owned(),
        region_bytes: 1 << 20,
        secret: SECRET.as_bytes().to_vec(),
        skip_forwarding: false,
        spill: None,
        spare: None,
        transport: dejavu_engine::transport::Transports::tcp(),
    };
    let (ready, listening) = std::sync::mpsc::channel();
    std::thread::spawn(move || serve_sidecar(config, None, |addr, _| ready.send(addr).unwrap()));
    listening.recv().unwrap();

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
    let (mut layout, mut engine, mut restored, mut store) =
        (ptr::null_mut(), ptr::null_mut(), ptr::null_mut(), ptr::null_mut());
    // SAFETY: every pointer passed is a live local or a handle these calls returned; lengths match
    // the buffers given.
    unsafe {
        assert_eq!(
            djv_layout_faster_transformer(2, 3, 40, DjvElement::F16, 2, 32, &mut layout),
            DjvStatus::Ok
        );
        assert_eq!(djv_cache_new(layout, &mut engine), DjvStatus::Ok);
        assert_eq!(djv_cache_new(layout, &mut restored), DjvStatus::Ok);
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
        djv_cache_free(engine);
        djv_cache_free(restored);
        djv_layout_free(layout);
    }
}
