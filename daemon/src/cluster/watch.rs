//! The driver's ear on the controller: a thread that waits on the controller for each fence it
//! opens and tells the driver at once, so that a step in flight when the controller declares a
//! stage dead fails then rather than at its deadline.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use dejavu_proto::fencing::fenced_since;
use tracing::debug;

use super::controllers::LeaderAddr;
use crate::controller::ControllerClient;

/// How long one wait on the controller lasts before the watcher asks again (and sees whether it
/// was dropped).
const WAIT: Duration = Duration::from_secs(1);

/// How long the watcher waits before asking again after a failed call (a controller stopped,
/// restarting or replaced).
const RETRY: Duration = Duration::from_millis(50);

/// Watches the controller for fences until dropped.
#[derive(Debug)]
pub(super) struct FenceWatch {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl FenceWatch {
    /// Watches the controller in charge, at `controller` (proving the cluster secret `secret`),
    /// for epochs after `epoch`; each new epoch it opens comes out of the receiver, in order.
    pub(super) fn start(
        controller: LeaderAddr,
        secret: &[u8],
        epoch: u64,
    ) -> std::io::Result<(Self, Receiver<u64>)> {
        let (opened, fences) = crossbeam_channel::unbounded();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let secret = secret.to_vec();
        let thread = std::thread::Builder::new()
            .name("fence-watch".into())
            .spawn(move || watch(&controller, &secret, epoch, &opened, &stopped))?;
        Ok((Self { stop, thread: Some(thread) }, fences))
    }
}

impl Drop for FenceWatch {
    /// Stops the thread and waits for it: at most the wait in progress ([`WAIT`]), and no time
    /// at all once the controller is gone (its connection fails at once).
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Sends each epoch after `known` the controller in charge opens into `opened`, until `stop`.
fn watch(controller: &LeaderAddr, secret: &[u8], mut known: u64, opened: &Sender<u64>, stop: &AtomicBool) {
    let client_of = |addr: SocketAddr| ControllerClient::new(addr, WAIT * 3, secret);
    let mut client = client_of(*controller.lock());
    while !stop.load(Ordering::Relaxed) {
        let leader = *controller.lock();
        if leader != client.addr() {
            client = client_of(leader);
        }
        match client.await_fence(known, WAIT) {
            Ok(epoch) if fenced_since(known, epoch) => {
                known = epoch;
                if opened.send(epoch).is_err() {
                    return;
                }
            }
            Ok(_) => {}
            Err(e) => {
                debug!(error = %e, "cannot wait for fences");
                std::thread::sleep(RETRY);
            }
        }
    }
}
