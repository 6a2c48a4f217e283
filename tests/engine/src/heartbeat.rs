//! Liveness: every stage and sidecar process sends a heartbeat datagram every interval to the
//! driver's monitor, which declares a process dead once it has been silent for a few intervals.
//! Failure detection then depends on neither the pipeline's traffic nor on being the processes'
//! parent.

use std::collections::HashMap;
use std::io::ErrorKind;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dejavulib::wire::{FrameHeader, Kind, FRAME_HEADER_LEN};
use parking_lot::Mutex;

/// Which kind of process beats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// A stage's engine.
    Engine = 0,
    /// A stage's sidecar.
    Sidecar = 1,
}

/// Sends a heartbeat for (`role`, `index`) to `monitor` every `interval`, from a thread of its own,
/// for the life of the process.
pub fn beat(monitor: SocketAddr, role: Role, index: u32, interval: Duration) -> std::io::Result<()> {
    let socket = UdpSocket::bind(("127.0.0.1", 0))?;
    let mut header = FrameHeader::new(Kind::Heartbeat, std::process::id(), 0, 0);
    header.ids = [role as u32, index, 0, 0];
    let datagram = header.encode(&[]);
    std::thread::Builder::new().name("heartbeat".into()).spawn(move || loop {
        // A lost datagram is a missed beat; the monitor tolerates a few.
        let _ = socket.send_to(&datagram, monitor);
        std::thread::sleep(interval);
    })?;
    Ok(())
}

/// When each process was last heard from.
type Seen = Arc<Mutex<HashMap<(Role, u32), Instant>>>;

/// Listens for heartbeats and says who fell silent.
pub struct Monitor {
    addr: SocketAddr,
    seen: Seen,
    /// Silence after which a process is dead.
    timeout: Duration,
    /// Tells the listening thread to end (it then closes its socket).
    stop: Arc<AtomicBool>,
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl Monitor {
    /// Listens on a loopback port; a process silent for `timeout` is dead.
    pub fn start(timeout: Duration) -> std::io::Result<Self> {
        let socket = UdpSocket::bind(("127.0.0.1", 0))?;
        let addr = socket.local_addr()?;
        // Wake up now and then to see whether the monitor was dropped.
        socket.set_read_timeout(Some(Duration::from_millis(50)))?;
        let seen: Seen = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (record, stopped) = (seen.clone(), stop.clone());
        std::thread::Builder::new().name("heartbeat-monitor".into()).spawn(move || {
            let mut buf = [0u8; FRAME_HEADER_LEN];
            while !stopped.load(Ordering::Relaxed) {
                let n = match socket.recv(&mut buf) {
                    Ok(n) => n,
                    Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
                    Err(_) => return,
                };
                let Ok(h) = <&[u8; FRAME_HEADER_LEN]>::try_from(&buf[..n]) else { continue };
                let Ok((header, 0, _)) = FrameHeader::decode(h) else { continue };
                let role = match header.ids[0] {
                    0 if header.kind == Kind::Heartbeat => Role::Engine,
                    1 if header.kind == Kind::Heartbeat => Role::Sidecar,
                    _ => continue,
                };
                record.lock().insert((role, header.ids[1]), Instant::now());
            }
        })?;
        Ok(Self { addr, seen, timeout, stop })
    }

    /// Where processes send their heartbeats.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether (`role`, `index`) has been silent for the timeout (or never beat).
    pub fn is_dead(&self, role: Role, index: u32) -> bool {
        self.seen.lock().get(&(role, index)).is_none_or(|last| last.elapsed() >= self.timeout)
    }

    /// Whether (`role`, `index`) has been silent for half the timeout or more: perhaps dying.
    pub fn is_suspect(&self, role: Role, index: u32) -> bool {
        self.seen.lock().get(&(role, index)).is_none_or(|last| last.elapsed() >= self.timeout / 2)
    }

    /// Forgets (`role`, `index`), so that its replacement counts as alive only once it beats.
    pub fn forget(&self, role: Role, index: u32) {
        self.seen.lock().remove(&(role, index));
    }

    /// Waits until (`role`, `index`) has beaten, at most `patience`.
    pub fn wait_alive(&self, role: Role, index: u32, patience: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < patience {
            if !self.is_dead(role, index) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silence_means_death_and_beats_mean_life() {
        let monitor = Monitor::start(Duration::from_millis(150)).unwrap();
        assert!(monitor.is_dead(Role::Engine, 3), "never heard from");
        beat(monitor.addr(), Role::Engine, 3, Duration::from_millis(20)).unwrap();
        assert!(monitor.wait_alive(Role::Engine, 3, Duration::from_secs(2)));
        assert!(monitor.is_dead(Role::Sidecar, 3), "another role");
        // Garbage on the port changes nothing.
        UdpSocket::bind(("127.0.0.1", 0)).unwrap().send_to(b"not a heartbeat", monitor.addr()).unwrap();
        assert!(!monitor.is_dead(Role::Engine, 3));
    }
}
