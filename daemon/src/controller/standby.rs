//! A controller standing by closes every query connection at once, so that members and clients
//! looking for the leader among several controllers move on to the next at once, rather than
//! after their deadline (a bound port that nobody serves would leave them waiting).

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Closes the connections to a listener until [`Door::shut`].
pub(super) struct Door {
    /// Where the listener listens (the thread is woken by a connection there).
    addr: SocketAddr,
    standing_by: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Door {
    /// Starts closing every connection `listener` accepts.
    pub(super) fn open(listener: &TcpListener) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let listener = listener.try_clone()?;
        let standing_by = Arc::new(AtomicBool::new(true));
        let still = standing_by.clone();
        let thread = std::thread::Builder::new().name("standby".into()).spawn(move || {
            for stream in listener.incoming() {
                if !still.load(Ordering::SeqCst) {
                    return;
                }
                if stream.is_err() {
                    // Out of descriptors, say: wait rather than spin.
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        })?;
        Ok(Self { addr, standing_by, thread: Some(thread) })
    }

    /// Stops closing connections (the controller leads and serves them, or gave up): the thread
    /// is woken by a connection of its own, and the next connections wait for the controller.
    pub(super) fn shut(mut self) {
        self.close();
    }

    fn close(&mut self) {
        let Some(thread) = self.thread.take() else { return };
        self.standing_by.store(false, Ordering::SeqCst);
        // Its accept may have taken a client's connection meanwhile: the client tries again.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        let _ = thread.join();
    }
}

impl Drop for Door {
    /// A campaign that failed leaves no thread closing the port's connections.
    fn drop(&mut self) {
        self.close();
    }
}
