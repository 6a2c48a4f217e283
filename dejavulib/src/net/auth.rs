//! Cluster membership proof: a mutual HMAC-SHA256 challenge-response keyed by the cluster secret.
//!
//! ```text
//! client -> Hello     { client nonce }                                   (32 bytes, nothing else read)
//! server -> Challenge { server nonce, HMAC(secret, "server" | client nonce | server nonce) }
//! client -> Proof     { HMAC(secret, "client" | server nonce | client nonce) }
//! server -> Welcome   (or Error with code Auth, then close)
//! ```
//!
//! Both nonces are fresh per connection, so a recorded handshake replayed to a server fails: the
//! server's new nonce makes the old proof worthless. Each side proves it knows the secret without
//! sending it; the server reads nothing but these fixed-size frames before the client has proven it.

use std::io;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncWrite};

use super::codec::{read_frame, write_frame};
use super::error::PeerError;
use crate::wire::{ErrorCode, Frame, FrameHeader, Kind};

type HmacSha256 = Hmac<Sha256>;

/// The cluster secret of every process given none: a cluster of processes all started without
/// one works, and is no more closed than its network. Give every process of a real cluster a
/// secret of its own.
pub const DEFAULT_SECRET: &str = "dejavu reference cluster";

/// The environment variable a process of the daemon takes its cluster secret from when no flag
/// gives it: unlike a flag, it does not show in the process list.
pub const SECRET_ENV: &str = "DEJAVU_SECRET";

/// Bytes of a handshake nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of an HMAC-SHA256 tag.
const TAG_LEN: usize = 32;

/// A fresh random nonce from the kernel.
pub fn nonce() -> io::Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    std::fs::File::open("/dev/urandom").and_then(|mut f| io::Read::read_exact(&mut f, &mut n))?;
    Ok(n)
}

fn hmac(secret: &[u8], role: &[u8], first: &[u8], second: &[u8]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes keys of any length");
    m.update(role);
    m.update(first);
    m.update(second);
    m
}

/// Bytes of a [`sign`] tag.
pub const SIGNATURE_LEN: usize = TAG_LEN;

/// A tag proving that a cluster member sent `message` (a datagram, which no handshake precedes):
/// HMAC-SHA256 keyed by the cluster secret, over `context` (what kind of message it is, so that
/// a tag of one kind is never accepted for another) and the message.
pub fn sign(secret: &[u8], context: &[u8], message: &[u8]) -> [u8; SIGNATURE_LEN] {
    signature(secret, context, message).finalize().into_bytes().into()
}

/// Whether `tag` is [`sign`]'s tag of `message` in `context` (compared in constant time).
pub fn verify(secret: &[u8], context: &[u8], message: &[u8], tag: &[u8]) -> bool {
    signature(secret, context, message).verify_slice(tag).is_ok()
}

/// The MAC of a signature: the context's length leads, so that no (context, message) pair reads
/// as another, nor as a handshake's tag (whose role strings lead with no length).
fn signature(secret: &[u8], context: &[u8], message: &[u8]) -> HmacSha256 {
    let length = (context.len() as u64).to_le_bytes();
    hmac(secret, &length, context, message)
}

/// The reply of kind `kind`, or the reason the other side refused.
pub(super) fn expect(frame: Option<Frame>, kind: Kind) -> Result<Frame, PeerError> {
    match frame {
        Some(f) if f.header.kind == kind => Ok(f),
        Some(f) if f.header.kind == Kind::Error => Err(refusal(&f)),
        Some(f) => Err(PeerError::Protocol(format!("expected {kind:?}, got {:?}", f.header.kind))),
        None => Err(PeerError::ConnectionLost("the peer closed the connection".into())),
    }
}

/// The typed error an [`Kind::Error`] frame stands for.
pub(super) fn refusal(frame: &Frame) -> PeerError {
    let reason = String::from_utf8_lossy(&frame.payload).into_owned();
    match ErrorCode::from_code(frame.header.ids[0]) {
        ErrorCode::Auth => PeerError::Auth(reason),
        ErrorCode::NotFound => PeerError::NotFound,
        ErrorCode::StaleEpoch => PeerError::StaleEpoch { sent: frame.header.epoch },
        code => PeerError::Refused { code, reason },
    }
}

/// The client side: proves membership to the server and checks the server's proof.
pub async fn client_handshake<S: AsyncRead + AsyncWrite + Unpin + ?Sized>(
    stream: &mut S,
    secret: &[u8],
    node: u32,
) -> Result<(), PeerError> {
    let ours = nonce()?;
    write_frame(stream, &FrameHeader::new(Kind::Hello, node, 0, 0), &[&ours]).await?;
    let challenge = expect(read_frame(stream, (NONCE_LEN + TAG_LEN) as u64).await?, Kind::Challenge)?;
    if challenge.payload.len() != NONCE_LEN + TAG_LEN {
        return Err(PeerError::Auth("malformed challenge".into()));
    }
    let (theirs, tag) = challenge.payload.split_at(NONCE_LEN);
    if hmac(secret, b"server", &ours, theirs).verify_slice(tag).is_err() {
        return Err(PeerError::Auth("the server does not know the cluster secret".into()));
    }
    let proof = hmac(secret, b"client", theirs, &ours).finalize().into_bytes();
    write_frame(stream, &FrameHeader::new(Kind::Proof, node, 0, 0), &[&proof]).await?;
    match expect(read_frame(stream, 256).await?, Kind::Welcome) {
        Ok(_) => Ok(()),
        Err(PeerError::ConnectionLost(_)) => Err(PeerError::Auth("the server closed the handshake".into())),
        Err(e) => Err(e),
    }
}

/// The server side: checks the client's proof (and proves itself). On failure the client is told
/// why, and the caller must close the stream.
pub async fn server_handshake<S: AsyncRead + AsyncWrite + Unpin + ?Sized>(
    stream: &mut S,
    secret: &[u8],
    node: u32,
) -> Result<(), PeerError> {
    // Hello carries only a nonce: a frame announcing more is refused before it is read.
    let hello = expect(read_frame(stream, NONCE_LEN as u64).await?, Kind::Hello)?;
    if hello.payload.len() != NONCE_LEN {
        return Err(PeerError::Auth("malformed hello".into()));
    }
    let ours = nonce()?;
    let tag = hmac(secret, b"server", &hello.payload, &ours).finalize().into_bytes();
    write_frame(stream, &FrameHeader::new(Kind::Challenge, node, 0, 0), &[&ours, &tag]).await?;
    let proof = expect(read_frame(stream, TAG_LEN as u64).await?, Kind::Proof)?;
    if hmac(secret, b"client", &ours, &hello.payload).verify_slice(&proof.payload).is_err() {
        let mut refusal = FrameHeader::new(Kind::Error, node, 0, 0);
        refusal.ids[0] = ErrorCode::Auth as u32;
        let reason = b"authentication failed: wrong cluster secret";
        let _ = write_frame(stream, &refusal, &[reason]).await;
        return Err(PeerError::Auth("the client does not know the cluster secret".into()));
    }
    write_frame(stream, &FrameHeader::new(Kind::Welcome, node, 0, 0), &[]).await?;
    Ok(())
}

/// [`client_handshake`] on a blocking std stream (a control connection outside any runtime), for
/// at most `deadline` (the stream's own timeouts do not bound it).
pub fn client_handshake_blocking(
    stream: &std::net::TcpStream,
    secret: &[u8],
    node: u32,
    deadline: std::time::Duration,
) -> Result<(), PeerError> {
    on_blocking_stream(stream, deadline, Side::Client, secret, node)
}

/// [`server_handshake`] on a blocking std stream; see [`client_handshake_blocking`].
pub fn server_handshake_blocking(
    stream: &std::net::TcpStream,
    secret: &[u8],
    node: u32,
    deadline: std::time::Duration,
) -> Result<(), PeerError> {
    on_blocking_stream(stream, deadline, Side::Server, secret, node)
}

/// Which end of a handshake.
#[derive(Clone, Copy)]
enum Side {
    Client,
    Server,
}

/// Runs `side`'s handshake on a blocking `stream`, on a runtime of its own, for at most
/// `deadline`; the stream is blocking again afterwards. One handshake per connection, so the
/// runtime's cost does not matter.
fn on_blocking_stream(
    stream: &std::net::TcpStream,
    deadline: std::time::Duration,
    side: Side,
    secret: &[u8],
    node: u32,
) -> Result<(), PeerError> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build()?;
    // A duplicate of the descriptor, driven by the runtime; both share one open file, so the
    // mode set here is the stream's, and is set back below.
    let twin = stream.try_clone()?;
    twin.set_nonblocking(true)?;
    let outcome = runtime.block_on(async {
        let mut twin = tokio::net::TcpStream::from_std(twin)?;
        let handshake = async {
            match side {
                Side::Client => client_handshake(&mut twin, secret, node).await,
                Side::Server => server_handshake(&mut twin, secret, node).await,
            }
        };
        tokio::time::timeout(deadline, handshake).await.unwrap_or(Err(PeerError::Timeout(deadline)))
    });
    stream.set_nonblocking(false)?;
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    const DEADLINE: Duration = Duration::from_secs(5);

    #[test]
    fn a_signature_holds_only_for_its_secret_context_and_message() {
        let tag = sign(b"secret", b"beat", b"message");
        assert!(verify(b"secret", b"beat", b"message", &tag));
        assert!(!verify(b"other secret", b"beat", b"message", &tag));
        assert!(!verify(b"secret", b"query", b"message", &tag));
        assert!(!verify(b"secret", b"beat", b"messagf", &tag));
        assert!(!verify(b"secret", b"beat", b"message", &tag[..31]));
        assert!(!verify(b"secret", b"bea", b"tmessage", &tag), "the same bytes split otherwise");
        let mut flipped = tag;
        flipped[0] ^= 1;
        assert!(!verify(b"secret", b"beat", b"message", &flipped));
    }

    /// Runs a blocking server handshake with `server_secret` against a blocking client with
    /// `client_secret`; returns both outcomes, and whether the server's stream still works
    /// blocking afterwards.
    fn handshake(server_secret: &'static [u8], client_secret: &[u8]) -> (bool, bool, bool) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let ok = server_handshake_blocking(&stream, server_secret, 1, DEADLINE).is_ok();
            let mut byte = [0u8; 1];
            let blocking = ok && io::Read::read_exact(&mut &stream, &mut byte).is_ok() && byte == [7];
            (ok, blocking)
        });
        let client = TcpStream::connect(addr).unwrap();
        let client_ok = client_handshake_blocking(&client, client_secret, 2, DEADLINE).is_ok();
        if client_ok {
            io::Write::write_all(&mut &client, &[7]).unwrap();
        }
        drop(client);
        let (server_ok, blocking) = server.join().unwrap();
        (server_ok, client_ok, blocking)
    }

    #[test]
    fn blocking_streams_prove_the_secret_and_stay_blocking_and_a_wrong_secret_is_refused() {
        assert_eq!(handshake(b"cluster", b"cluster"), (true, true, true));
        let (server_ok, client_ok, _) = handshake(b"cluster", b"another cluster");
        assert!(!server_ok && !client_ok);
    }

    #[test]
    fn a_silent_peer_times_out() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let _client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (stream, _) = listener.accept().unwrap();
        let refused = server_handshake_blocking(&stream, b"cluster", 1, Duration::from_millis(50));
        assert!(matches!(refused, Err(PeerError::Timeout(_))), "{refused:?}");
    }
}
