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
    standing_by: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Door {
    /// Starts closing every connection `listener` (bound at `addr`) accepts.
    pub(super) fn open(listener: &TcpListener) -> std::io::Result<Self> {
        let listener = listener.try_clone()?;
        let standing_by = Arc::new(AtomicBool::new(true));
        let still = standing_by.clone();
        let thread = std::thread::Builder::new().name("standby".into()).spawn(move || {
            for stream in listener.incoming() {
                if !still.load(Ordering::SeqCst) {
                    return;
                }
                drop(stream);
            }
        })?;
        Ok(Self { standing_by, thread: Some(thread) })
    }

    /// Stops closing connections, once the controller at `addr` serves them: the thread is woken
    /// by a connection of its own, and the next connections wait for the controller's loop.
    pub(super) fn shut(mut self, addr: SocketAddr) {
        self.standing_by.store(false, Ordering::SeqCst);
        // Its accept may have taken a client's connection meanwhile: the client tries again.
        let _ = TcpStream::connect_timeout(&addr, Duration::from_secs(1));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
