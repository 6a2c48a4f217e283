//! The C ABI's recovery feed against a real controller (the `dejavud controller` code, on a
//! thread of this test) over TCP: no recovery yet is an epoch of 0; acknowledging an epoch not
//! opened, a controller that carries out no recoveries, a bad address and an unreachable
//! controller are each a status with a message. (The feed's recoveries themselves, after real
//! failures, are tested from Rust in `daemon/tests/deployment.rs` and from Python in the
//! walkthrough.)

use std::ffi::{CStr, CString};
use std::net::SocketAddr;
use std::ptr;
use std::time::Duration;

use dejavu::*;
use dejavud::controller::{serve_controller, ControllerConfig, Leaving, StoreConfig};

fn last_error() -> String {
    // SAFETY: djv_last_error returns a NUL-terminated string owned by this thread.
    unsafe { CStr::from_ptr(djv_last_error()) }.to_string_lossy().into_owned()
}

/// A controller on a thread, told the ring's size or not; its query address.
fn controller(dir: &std::path::Path, stages: Option<u32>) -> SocketAddr {
    let config = ControllerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        store: StoreConfig::File(dir.join("state")),
        leaving: Leaving::default(),
        timeout: Duration::from_millis(500),
        interval: Duration::from_millis(50),
        metrics: None,
        secret: b"dejavu reference cluster".to_vec(),
        journal: None,
        stages,
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || serve_controller(config, |addr, _| tx.send(addr).unwrap()));
    rx.recv_timeout(Duration::from_secs(5)).unwrap()
}

/// Opens a feed of the controller at `addr` with the default secret.
fn open(addr: &str) -> (DjvStatus, *mut DjvRecoveryFeed) {
    let addr = CString::new(addr).unwrap();
    let mut feed = ptr::null_mut();
    // SAFETY: a NUL-terminated address, no secret, a writable output pointer.
    let status = unsafe { djv_recovery_feed_open(addr.as_ptr(), ptr::null(), 0, &mut feed) };
    (status, feed)
}

/// Watches `feed` for 100 ms: the status, the epoch and the sequences written.
fn watch(feed: *mut DjvRecoveryFeed) -> (DjvStatus, u64, usize) {
    let (mut epoch, mut count) = (u64::MAX, usize::MAX);
    let mut resume = [DjvResume::default(); 4];
    // SAFETY: a live feed, writable outputs, `resume` has room for 4.
    let status =
        unsafe { djv_recovery_feed_watch(feed, 0, 100, &mut epoch, resume.as_mut_ptr(), 4, &mut count) };
    (status, epoch, count)
}

#[test]
fn a_feed_without_a_recovery_reads_epoch_zero_and_refusals_say_why() {
    let dir = tempfile::tempdir().unwrap();
    let addr = controller(dir.path(), Some(2));
    let (status, feed) = open(&addr.to_string());
    assert_eq!(status, DjvStatus::Ok, "{}", last_error());
    assert_eq!(watch(feed), (DjvStatus::Ok, 0, 0));
    // SAFETY: a live feed.
    assert_eq!(unsafe { djv_recovery_feed_acknowledge(feed, 7) }, DjvStatus::InvalidArgument);
    assert!(last_error().contains("not one yet"), "{}", last_error());
    // SAFETY: a live feed, freed once; NULL is ignored.
    unsafe {
        djv_recovery_feed_free(feed);
        djv_recovery_feed_free(ptr::null_mut());
    }

    let other = tempfile::tempdir().unwrap();
    let (_, feed) = open(&controller(other.path(), None).to_string());
    let (status, _, _) = watch(feed);
    assert_eq!(status, DjvStatus::InvalidArgument);
    assert!(last_error().contains("--stages"), "{}", last_error());
    // SAFETY: a live feed, freed once.
    unsafe { djv_recovery_feed_free(feed) };

    assert_eq!(open("nowhere").0, DjvStatus::InvalidArgument);
    assert!(last_error().contains("HOST:PORT"), "{}", last_error());
    let unused = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let (_, feed) = open(&unused.to_string());
    assert_eq!(watch(feed).0, DjvStatus::Io, "nothing listens there");
    // SAFETY: a live feed, freed once.
    unsafe { djv_recovery_feed_free(feed) };
}
