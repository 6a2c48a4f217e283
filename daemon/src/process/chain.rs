//! The chain's connections (driver to stage 0, stage to stage, last stage to driver): each proves
//! the cluster secret, then says who sends and the epoch it was started in; a receiver takes only
//! its predecessor's, and only from an epoch at least that of the connection in use.

use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use dejavu_proto::fencing::{fenced_since, Claim, Newest};
use dejavulib::net::auth::{client_handshake_blocking, server_handshake_blocking};
use dejavulib::wire::{read_frame, write_frame, FrameHeader, Kind};
use tracing::{info, warn};

use super::{ProcessError, StageStats};
use crate::slots::Slot;

/// The driver's node id on the chain: the first stage's predecessor, the last stage's successor.
pub(super) const DRIVER: u32 = u32::MAX;

/// Connects to `addr`, retrying for up to `patience` while the peer starts.
pub(super) fn connect(addr: SocketAddr, patience: Duration) -> std::io::Result<TcpStream> {
    let start = Instant::now();
    loop {
        match TcpStream::connect(addr) {
            Ok(stream) => {
                stream.set_nodelay(true)?;
                return Ok(stream);
            }
            Err(e) if start.elapsed() > patience => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Time a new connection on the chain has to say hello.
const HELLO_PATIENCE: Duration = Duration::from_secs(2);

/// Opens a connection on the chain: proves the cluster secret `secret` (the transports' HMAC
/// handshake), then says who sends and the epoch it was started in.
pub(super) fn say_hello(
    stream: &TcpStream,
    secret: &[u8],
    sender: u32,
    epoch: u64,
) -> Result<(), ProcessError> {
    client_handshake_blocking(stream, secret, sender, HELLO_PATIENCE)
        .map_err(|e| ProcessError::Protocol(format!("handshake on the chain: {e}")))?;
    let mut writer = stream;
    write_frame(&mut writer, &FrameHeader::new(Kind::Hello, sender, epoch, 0), &[])?;
    Ok(writer.flush()?)
}

/// Reads a new connection's proof of the cluster secret `secret` (answering as node `node`) and
/// its hello (and nothing after it); returns its sender and epoch.
fn hear_hello(stream: &TcpStream, secret: &[u8], node: u32) -> Result<(u32, u64), ProcessError> {
    server_handshake_blocking(stream, secret, node, HELLO_PATIENCE)
        .map_err(|e| ProcessError::Protocol(format!("handshake on the chain: {e}")))?;
    stream.set_read_timeout(Some(HELLO_PATIENCE))?;
    let frame = read_frame(&mut &*stream, 0)?
        .ok_or_else(|| ProcessError::Protocol("a connection closed before its hello".into()))?;
    stream.set_read_timeout(None)?;
    match frame.header.kind {
        Kind::Hello => Ok((frame.header.sender, frame.header.epoch)),
        other => Err(ProcessError::Protocol(format!("a connection opened with {other:?}, not a hello"))),
    }
}

/// Accepts a connection on `listener` whose hello comes from `sender` and says epoch `epoch` or
/// newer, waiting at most `patience`; others (fenced processes, strangers) are closed.
pub(super) fn accept_within(
    listener: &TcpListener,
    sender: u32,
    epoch: u64,
    secret: &[u8],
    patience: Duration,
) -> Result<TcpStream, ProcessError> {
    listener.set_nonblocking(true)?;
    let start = Instant::now();
    let accepted = loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false)?;
                match hear_hello(&stream, secret, DRIVER) {
                    Ok((from, said)) if from == sender && !fenced_since(said, epoch) => break Ok(stream),
                    Ok((from, _)) if from != sender => {
                        warn!(from, sender, "refused a connection from another sender")
                    }
                    Ok((_, said)) => warn!(said, epoch, "refused a last stage from an older epoch"),
                    Err(e) => warn!(error = %e, "refused a connection to the driver"),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && start.elapsed() < patience => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                break Err(ProcessError::Timeout(patience))
            }
            Err(e) => break Err(e.into()),
        }
    };
    listener.set_nonblocking(false)?;
    let stream = accepted?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// Whether the peer of `stream`, a connection on which it never sends, has closed or reset it:
/// anything readable there is its end. Checked before a write, so that a frame is not written
/// into a connection that is already gone (the write would succeed and the frame be lost).
pub(super) fn closed_by_peer(stream: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut byte = 0u8;
    // SAFETY: recv writes at most one byte into `byte`, a live local; the descriptor belongs to
    // `stream`, open for the call; MSG_PEEK leaves the data in place, MSG_DONTWAIT returns at once.
    let n = unsafe {
        libc::recv(stream.as_raw_fd(), (&mut byte as *mut u8).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT)
    };
    // Readable (data, or 0 for its end) means gone; an error other than "nothing yet" too.
    n >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock
}

/// Accepts a stage's input connections from a thread of its own and hands on each one that takes
/// over: one that proves the cluster secret and whose hello comes from its predecessor (the stage
/// before it, or the driver before stage 0) and says an epoch at least that of the connection in
/// use, which is then shut so that the stage's read on it ends. A connection from an older epoch
/// is refused and counted. Each connection's handshake runs on a thread of its own (at most
/// [`MAX_HELLOS`] at once), so one that stalls holds up no other.
pub(super) fn accept_upstreams(
    listener: TcpListener,
    index: u32,
    secret: Vec<u8>,
    stats: Arc<StageStats>,
) -> Receiver<TcpStream> {
    let predecessor = index.checked_sub(1).unwrap_or(DRIVER);
    let (heard, hellos) = crossbeam_channel::unbounded::<(u64, TcpStream)>();
    std::thread::spawn(move || {
        let pending = Arc::new(AtomicUsize::new(0));
        for stream in listener.incoming() {
            let stream = match stream {
                Ok(stream) => stream,
                Err(_) => {
                    // Out of descriptors, say: wait rather than spin.
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            let Some(slot) = Slot::take(&pending, MAX_HELLOS) else {
                warn!(stage = index, "too many connections saying hello: one closed");
                continue;
            };
            let (secret, heard) = (secret.clone(), heard.clone());
            let spawned = std::thread::Builder::new().name("hello".into()).spawn(move || {
                let _slot = slot;
                match hear_hello(&stream, &secret, index) {
                    Ok((sender, epoch)) if sender == predecessor => {
                        let _ = heard.send((epoch, stream));
                    }
                    Ok((sender, _)) => warn!(
                        stage = index,
                        sender, "refused a connection from a process that is not its predecessor"
                    ),
                    Err(e) => warn!(stage = index, error = %e, "refused a connection"),
                }
            });
            if let Err(e) = spawned {
                warn!(stage = index, error = %e, "cannot hear a connection's hello");
            }
        }
    });
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::spawn(move || {
        let mut newest = Newest::new();
        let mut in_use: Option<TcpStream> = None;
        for (epoch, stream) in hellos {
            let Ok(handle) = stream.try_clone() else { continue };
            if let Claim::Stale { newest } = newest.claim(epoch) {
                StageStats::add(&stats.stale_connections_refused, 1);
                warn!(stage = index, epoch, newest, "refused a predecessor from an older epoch");
                continue;
            }
            if let Some(old) = in_use.replace(handle) {
                let _ = old.shutdown(Shutdown::Both);
                info!(stage = index, epoch, "a predecessor took over the input");
            }
            if tx.send(stream).is_err() {
                return;
            }
        }
    });
    rx
}

/// Input connections that may be proving the secret and saying hello at once.
const MAX_HELLOS: usize = 16;

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::sync::atomic::Ordering;

    use super::*;

    const SECRET: &[u8] = b"test cluster";

    fn hello(addr: SocketAddr, epoch: u64) -> TcpStream {
        let stream = TcpStream::connect(addr).unwrap();
        say_hello(&stream, SECRET, 1, epoch).unwrap();
        stream
    }

    /// Whether the stage side closed `stream`: a read ends (at its end, or reset) rather than
    /// timing out.
    fn closed(stream: &mut TcpStream) -> bool {
        stream.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        match stream.read(&mut [0u8; 1]) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
        }
    }

    #[test]
    fn a_newer_predecessor_takes_over_and_an_older_one_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stats = Arc::new(StageStats::default());
        let upstreams = accept_upstreams(listener, 2, SECRET.to_vec(), stats.clone());
        let wait = || upstreams.recv_timeout(Duration::from_secs(5));

        let mut first = hello(addr, 3);
        wait().expect("the first predecessor is taken");
        // One from an older epoch (a fenced predecessor back from a pause) is refused and closed,
        // and the one in use stays.
        let mut stale = hello(addr, 2);
        assert!(closed(&mut stale));
        assert_eq!(stats.stale_connections_refused.load(Ordering::Relaxed), 1);
        assert!(upstreams.recv_timeout(Duration::from_millis(200)).is_err());
        assert!(!closed(&mut first), "the connection in use is untouched");
        // So is one from a process that is not its predecessor, whatever its epoch.
        let mut stranger = TcpStream::connect(addr).unwrap();
        say_hello(&stranger, SECRET, 5, 9).unwrap();
        assert!(closed(&mut stranger));
        // And one that cannot prove the cluster secret never gets to say hello; it stays open,
        // unanswered, without holding up the connections after it.
        let outsider = TcpStream::connect(addr).unwrap();
        assert!(say_hello(&outsider, b"another cluster", 1, 9).is_err());
        assert!(upstreams.recv_timeout(Duration::from_millis(200)).is_err());
        // A connection that does not say hello is refused too.
        let mut rude = TcpStream::connect(addr).unwrap();
        rude.write_all(format!("GET / HTTP/1.1\r\nHost: {}\r\n\r\n", "x".repeat(80)).as_bytes()).unwrap();
        assert!(closed(&mut rude));
        // The same epoch again (a reconnection after a reset) or a newer one (a replacement)
        // takes over, and the one before is shut.
        let _again = hello(addr, 3);
        wait().expect("a reconnection is taken");
        assert!(closed(&mut first));
        let _replacement = hello(addr, 4);
        wait().expect("a replacement is taken");
        assert_eq!(stats.stale_connections_refused.load(Ordering::Relaxed), 1);
    }
}
