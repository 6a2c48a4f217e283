//! Liveness: every stage and sidecar process sends a heartbeat datagram every interval to the
//! controller ([`crate::controller`]), which declares a process dead once it has been silent for a
//! few intervals. Failure detection then depends on neither the pipeline's traffic nor on being
//! the processes' parent.
//!
//! A heartbeat is a frame header ([`dejavulib::wire`]) of kind `Heartbeat` with no payload: the
//! epoch field holds the epoch the process was started in (so beats from a fenced process can be
//! told from its replacement's), the sender field its process id (for logs), the first two ids
//! the role and the stage, and the third the port of the sender's control listener, if it has one
//! (a sidecar's, on the address the datagram comes from: the controller drives recoveries
//! through it).

use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dejavulib::wire::{FrameHeader, Kind, FRAME_HEADER_LEN};

/// Which kind of process beats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// A stage's engine.
    Engine = 0,
    /// A stage's sidecar.
    Sidecar = 1,
}

/// A thread sending heartbeats; it stops when this is dropped (or [`Heartbeat::stop`]ped).
#[derive(Debug)]
pub struct Heartbeat {
    stop: Arc<AtomicBool>,
}

impl Heartbeat {
    /// Stops beating (within one interval).
    pub fn stop(self) {}
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// What a heartbeat datagram says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Beat {
    /// Whose it is.
    pub member: (Role, u32),
    /// The sender's process id.
    pub pid: u32,
    /// The epoch the sender was started in.
    pub epoch: u64,
    /// The port of the sender's control listener, on the datagram's source address.
    pub control_port: Option<u16>,
}

/// Sends a heartbeat for (`role`, `index`), from a process started in `epoch` (serving control
/// requests on `control_port`, if given), to `controller` every `interval`, from a thread of its
/// own, until the returned handle is dropped.
pub fn beat(
    controller: SocketAddr,
    (role, index): (Role, u32),
    epoch: u64,
    interval: Duration,
    control_port: Option<u16>,
) -> std::io::Result<Heartbeat> {
    // Bound to no address in particular: the route to the controller picks the source, on
    // loopback or from a network namespace of the worker's own.
    let unspecified: SocketAddr = match controller {
        SocketAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = UdpSocket::bind(unspecified)?;
    let mut header = FrameHeader::new(Kind::Heartbeat, std::process::id(), epoch, 0);
    header.ids = [role as u32, index, control_port.map_or(0, u32::from), 0];
    let datagram = header.encode(&[]);
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    std::thread::Builder::new().name("heartbeat".into()).spawn(move || {
        while !stopped.load(Ordering::Relaxed) {
            // A lost datagram is a missed beat; the controller tolerates a few.
            let _ = socket.send_to(&datagram, controller);
            std::thread::sleep(interval);
        }
    })?;
    Ok(Heartbeat { stop })
}

/// What a heartbeat datagram says; `None` for anything else.
pub fn decode(datagram: &[u8]) -> Option<Beat> {
    let header = <&[u8; FRAME_HEADER_LEN]>::try_from(datagram).ok()?;
    let (header, 0, _) = FrameHeader::decode(header).ok()? else { return None };
    let role = match header.ids[0] {
        0 if header.kind == Kind::Heartbeat => Role::Engine,
        1 if header.kind == Kind::Heartbeat => Role::Sidecar,
        _ => return None,
    };
    let control_port = u16::try_from(header.ids[2]).ok().filter(|&port| port != 0);
    Some(Beat { member: (role, header.ids[1]), pid: header.sender, epoch: header.epoch, control_port })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heartbeat_names_its_member_and_process_and_nothing_else_decodes() {
        let receiver = UdpSocket::bind("127.0.0.1:0").unwrap();
        receiver.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let to = receiver.local_addr().unwrap();
        let beating = beat(to, (Role::Sidecar, 3), 7, Duration::from_millis(10), Some(4242)).unwrap();
        let mut buf = [0u8; 256];
        let n = receiver.recv(&mut buf).unwrap();
        let expected =
            Beat { member: (Role::Sidecar, 3), pid: std::process::id(), epoch: 7, control_port: Some(4242) };
        assert_eq!(decode(&buf[..n]), Some(expected));
        beating.stop();
        let silent = beat(to, (Role::Engine, 1), 0, Duration::from_millis(10), None).unwrap();
        let n = receiver.recv(&mut buf).unwrap();
        assert_eq!(decode(&buf[..n]).map(|b| (b.member, b.control_port)), Some(((Role::Engine, 1), None)));
        silent.stop();
        assert_eq!(decode(b"not a heartbeat"), None);
        let mut other = FrameHeader::new(Kind::Put, 1, 0, 0);
        other.ids = [0, 1, 0, 0];
        assert_eq!(decode(&other.encode(&[])), None, "another kind of frame");
        let mut flipped = FrameHeader::new(Kind::Heartbeat, 1, 0, 0).encode(&[]);
        flipped[20] ^= 1;
        assert_eq!(decode(&flipped), None, "a corrupted header");
    }
}
