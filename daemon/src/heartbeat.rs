//! Liveness: every stage and sidecar process sends a heartbeat datagram every interval to the
//! controller ([`crate::controller`]), which declares a process dead once it has been silent for a
//! few intervals. Failure detection then depends on neither the pipeline's traffic nor on being
//! the processes' parent. A process that dies is seen sooner through its lifeline
//! ([`crate::controller::Lifeline`], held with the beats in a [`crate::membership::Membership`]);
//! the beats are what detect a process that lives on but is stopped, hung or cut off.
//!
//! A heartbeat is a frame ([`dejavulib::wire`]) of kind `Heartbeat`: the epoch field holds the
//! epoch the process was started in (so beats from a fenced process can be told from its
//! replacement's), the sender field its process id (for logs), the request field the beat's
//! sequence number, the first two ids the role and the stage, and the third the port of the
//! sender's control listener, if it has one (a sidecar's, on the address the datagram comes from:
//! the controller drives recoveries through it).
//!
//! Its payload signs it ([`dejavulib::net::auth::sign`]: HMAC-SHA256 keyed by the cluster secret,
//! over the frame header encoded without payload), so that only a member of the cluster can keep
//! a member alive, register one or stand in for a fenced one. The sequence numbers of a process's
//! beats grow (they start at its clock's microseconds), and the controller takes a beat only if
//! it is newer than the last it took for that member: a recorded beat replayed is ignored.

use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use dejavulib::net::auth::{sign, verify, SIGNATURE_LEN};
use dejavulib::wire::{FrameHeader, Kind, FRAME_HEADER_LEN};
use parking_lot::{Condvar, Mutex};

/// What a signature of a heartbeat is over, besides the header (never a signature of anything else).
const SIGNED_AS: &[u8] = b"dejavu heartbeat";

/// Bytes of a heartbeat datagram: a frame header and its signature.
pub const DATAGRAM_LEN: usize = FRAME_HEADER_LEN + SIGNATURE_LEN;

/// Which kind of process beats.
pub use dejavulib::message::Role;

pub use dejavu_proto::liveness::SPARE_MEMBERS;

/// The member index a spare numbered `n` beats as.
pub fn spare_member(n: u32) -> u32 {
    SPARE_MEMBERS + n
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
    /// The beat's sequence number: each beat of a process has a larger one than the last.
    pub sequence: u64,
    /// The port of the sender's control listener, on the datagram's source address.
    pub control_port: Option<u16>,
    /// The port of the sender's KV transport (a sidecar's `--listen`), on the same address, once
    /// it listens: where a recovery sends a replaced sidecar the KV it must hold.
    pub data_port: Option<u16>,
}

/// The port of a member's KV transport, as its beats name it: fixed from the start, or named
/// once the transport listens on a port the system picked (none until then). Clones share it;
/// naming it sends a beat at once, so the controller need not wait an interval to learn it.
#[derive(Clone, Debug, Default)]
pub struct DataPort(Arc<(Mutex<u16>, Condvar)>);

impl DataPort {
    /// Port `port` (0: none yet).
    pub fn new(port: u16) -> Self {
        Self(Arc::new((Mutex::new(port), Condvar::new())))
    }

    /// No KV transport: the beats name none.
    pub fn none() -> Self {
        Self::default()
    }

    /// The transport listens on `port` now: the beats name it, starting with one sent at once.
    pub fn name(&self, port: u16) {
        *self.0 .0.lock() = port;
        self.0 .1.notify_all();
    }

    /// The port, if named.
    pub fn get(&self) -> Option<u16> {
        Some(*self.0 .0.lock()).filter(|&port| port != 0)
    }

    /// Waits up to `interval`, or until the port is named (differs from `known`).
    fn wait(&self, known: Option<u16>, interval: Duration) {
        let (port, named) = &*self.0;
        let mut port = port.lock();
        if Some(*port).filter(|&p| p != 0) == known {
            let _ = named.wait_for(&mut port, interval);
        }
    }
}

impl Beat {
    /// The signed datagram that says this, for a cluster of secret `secret`.
    pub fn encode(&self, secret: &[u8]) -> [u8; DATAGRAM_LEN] {
        let (role, index) = self.member;
        let mut header = FrameHeader::new(Kind::Heartbeat, self.pid, self.epoch, self.sequence);
        header.ids =
            [role as u32, index, self.control_port.map_or(0, u32::from), self.data_port.map_or(0, u32::from)];
        let signature = sign(secret, SIGNED_AS, &header.encode(&[]));
        let mut datagram = [0u8; DATAGRAM_LEN];
        datagram[..FRAME_HEADER_LEN].copy_from_slice(&header.encode(&signature));
        datagram[FRAME_HEADER_LEN..].copy_from_slice(&signature);
        datagram
    }
}

/// Sends a heartbeat for (`role`, `index`), from a process started in `epoch` (serving control
/// requests on `control_port`, if given), signed with the cluster secret `secret`, to `controller`
/// every `interval`, from a thread of its own, until the returned handle is dropped.
pub fn beat(
    controller: SocketAddr,
    member: (Role, u32),
    epoch: u64,
    interval: Duration,
    control_port: Option<u16>,
    secret: &[u8],
) -> std::io::Result<Heartbeat> {
    beat_serving(&[controller], member, epoch, interval, (control_port, DataPort::none()), secret, None)
}

/// As [`beat`], to each of `controllers` (several on etcd: whichever leads takes them), naming
/// the sender's control listener's port and its KV transport's port, sent from `source` if
/// given (the address those listen at: the controller reaches them at the beats' source).
pub fn beat_serving(
    controllers: &[SocketAddr],
    member: (Role, u32),
    epoch: u64,
    interval: Duration,
    (control_port, data_port): (Option<u16>, DataPort),
    secret: &[u8],
    source: Option<std::net::IpAddr>,
) -> std::io::Result<Heartbeat> {
    let Some(&first) = controllers.first() else {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "no controller to beat to"));
    };
    let controllers = controllers.to_vec();
    // Without a source, bound to no address in particular: the route to the controller picks
    // it, on loopback or from a network namespace of the worker's own.
    let from: SocketAddr = match (source, first) {
        (Some(ip), _) => (ip, 0).into(),
        (None, SocketAddr::V4(_)) => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
        (None, SocketAddr::V6(_)) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = UdpSocket::bind(from)?;
    let mut beat =
        Beat { member, pid: std::process::id(), epoch, sequence: 0, control_port, data_port: None };
    let secret = secret.to_vec();
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    std::thread::Builder::new().name("heartbeat".into()).spawn(move || {
        while !stopped.load(Ordering::Relaxed) {
            // The clock, so that a process started later for the same member in the same epoch
            // (replacements start in a newer one, but nothing else forbids it) goes on above its
            // predecessor; never backwards, whatever the clock does.
            beat.sequence = clock_micros().max(beat.sequence + 1);
            beat.data_port = data_port.get();
            // A lost datagram is a missed beat; the controller tolerates a few.
            let datagram = beat.encode(&secret);
            for &controller in &controllers {
                let _ = socket.send_to(&datagram, controller);
            }
            data_port.wait(beat.data_port, interval);
        }
    })?;
    Ok(Heartbeat { stop })
}

/// Microseconds since the Unix epoch (0 for a clock set before it).
fn clock_micros() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// What a heartbeat datagram of a cluster of secret `secret` says; `None` for anything else: a
/// datagram that is not a well-formed heartbeat, or whose signature does not hold.
pub fn decode(datagram: &[u8], secret: &[u8]) -> Option<Beat> {
    let frame = dejavulib::wire::read_frame(&mut &datagram[..], SIGNATURE_LEN as u64).ok()??;
    if datagram.len() != DATAGRAM_LEN || frame.header.kind != Kind::Heartbeat {
        return None;
    }
    let header = frame.header;
    if !verify(secret, SIGNED_AS, &header.encode(&[]), &frame.payload) {
        return None;
    }
    let role = match header.ids[0] {
        0 => Role::Engine,
        1 => Role::Sidecar,
        _ => return None,
    };
    let port = |id: u32| u16::try_from(id).ok().filter(|&port| port != 0);
    Some(Beat {
        member: (role, header.ids[1]),
        pid: header.sender,
        epoch: header.epoch,
        sequence: header.request,
        control_port: port(header.ids[2]),
        data_port: port(header.ids[3]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"test cluster";

    #[test]
    fn a_heartbeat_names_its_member_and_process_and_nothing_else_decodes() {
        let receiver = UdpSocket::bind("127.0.0.1:0").unwrap();
        receiver.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let to = receiver.local_addr().unwrap();
        let every = Duration::from_millis(10);
        let beating = beat(to, (Role::Sidecar, 3), 7, every, Some(4242), SECRET).unwrap();
        let mut buf = [0u8; 256];
        let n = receiver.recv(&mut buf).unwrap();
        let first = decode(&buf[..n], SECRET).unwrap();
        assert_eq!(
            (first.member, first.pid, first.epoch, first.control_port),
            ((Role::Sidecar, 3), std::process::id(), 7, Some(4242))
        );
        let n = receiver.recv(&mut buf).unwrap();
        let second = decode(&buf[..n], SECRET).unwrap();
        assert!(second.epoch == first.epoch && second.sequence > first.sequence, "numbered in order");
        assert_eq!(decode(&buf[..n], b"another cluster"), None, "signed with another secret");
        beating.stop();
        let silent = beat(to, (Role::Engine, 1), 0, every, None, SECRET).unwrap();
        let n = receiver.recv(&mut buf).unwrap();
        let engine = decode(&buf[..n], SECRET).map(|b| (b.member, b.control_port));
        assert_eq!(engine, Some(((Role::Engine, 1), None)));
        silent.stop();
    }

    #[test]
    fn forged_corrupted_and_foreign_datagrams_are_refused() {
        let beat = Beat {
            member: (Role::Engine, 2),
            pid: 9,
            epoch: 4,
            sequence: 77,
            control_port: None,
            data_port: None,
        };
        let datagram = beat.encode(SECRET);
        assert_eq!(decode(&datagram, SECRET), Some(beat));
        for bit in 0..DATAGRAM_LEN * 8 {
            let mut flipped = datagram;
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(decode(&flipped, SECRET), None, "bit {bit}");
        }
        for cut in 0..DATAGRAM_LEN {
            assert_eq!(decode(&datagram[..cut], SECRET), None, "cut at {cut}");
        }
        assert_eq!(decode(&[&datagram[..], b"!"].concat(), SECRET), None, "a byte too many");
        // A signed beat with any field changed, its checksums made whole again: the signature no
        // longer holds.
        let (signed, _, _) = FrameHeader::decode(datagram[..FRAME_HEADER_LEN].try_into().unwrap()).unwrap();
        let signature = &datagram[FRAME_HEADER_LEN..];
        let changes: [fn(&mut FrameHeader); 6] = [
            |h| h.epoch += 1,
            |h| h.request += 1,
            |h| h.sender += 1,
            |h| h.ids[0] = 1,
            |h| h.ids[1] = 3,
            |h| h.ids[2] = 4242,
        ];
        for (i, change) in changes.iter().enumerate() {
            let mut header = signed;
            change(&mut header);
            let altered = [&header.encode(signature)[..], signature].concat();
            assert_eq!(decode(&altered, SECRET), None, "change {i}");
        }
        // A forger without the secret: a well-formed frame whose signature is of anything else.
        let mut header = FrameHeader::new(Kind::Heartbeat, 9, 5, 78);
        header.ids = [0, 2, 0, 0];
        let tag = [0u8; SIGNATURE_LEN];
        let forged = [&header.encode(&tag)[..], &tag].concat();
        assert_eq!(decode(&forged, SECRET), None, "an unsigned beat");
        let mut other = FrameHeader::new(Kind::Put, 1, 0, 0);
        other.ids = [0, 1, 0, 0];
        let signature = sign(SECRET, SIGNED_AS, &other.encode(&[]));
        assert_eq!(
            decode(&[&other.encode(&signature)[..], &signature].concat(), SECRET),
            None,
            "another kind"
        );
        assert_eq!(decode(b"not a heartbeat", SECRET), None);
    }
}
