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
