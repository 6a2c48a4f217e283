//! Errors of remote flush / fetch.

use std::io;
use std::time::Duration;

use thiserror::Error;

use crate::store::StoreError;
use crate::wire::{ErrorCode, FrameError};

/// Errors of the peer protocol, whatever the transport.
#[derive(Debug, Error)]
pub enum PeerError {
    /// The other side did not prove it belongs to the cluster (or refused our proof).
    #[error("authentication failed: {0}")]
    Auth(String),
    /// A frame was malformed, corrupted or oversized; the connection was closed.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The request carried an epoch older than the peer's: the sender has been fenced.
    #[error("fenced: request epoch {sent} is older than the peer's epoch")]
    StaleEpoch {
        /// The epoch the request carried.
        sent: u64,
    },
    /// The peer holds no chunk under the key asked for.
    #[error("the peer holds no such chunk")]
    NotFound,
    /// The peer refused the request for another reason.
    #[error("peer refused ({code:?}): {reason}")]
    Refused {
        /// Why, as a code.
        code: ErrorCode,
        /// Why, in words.
        reason: String,
    },
    /// The peer broke the protocol (a reply to nothing, a wrong acknowledgment).
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// No reply within the configured time.
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    /// The connection failed while the request was in flight; the next request reconnects.
    #[error("connection lost: {0}")]
    ConnectionLost(String),
    /// The peer could not be reached after every retry.
    #[error("peer unreachable after {attempts} attempts: {last}")]
    Unreachable {
        /// Connection attempts made.
        attempts: u32,
        /// The last failure.
        last: String,
    },
    /// Certificates or TLS configuration are unusable.
    #[error("tls: {0}")]
    Tls(String),
    /// A local I/O failure.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
}

impl From<PeerError> for StoreError {
    fn from(e: PeerError) -> Self {
        match e {
            PeerError::Frame(FrameError::Io(source)) | PeerError::Io(source) => {
                StoreError::Io { op: "remote", path: "peer".into(), source }
            }
            other => StoreError::Io { op: "remote", path: "peer".into(), source: io::Error::other(other) },
        }
    }
}

/// Whether `e` is a TLS refusal (a bad, missing or foreign certificate), on either transport.
fn tls_refusal(e: &io::Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = e.get_ref().map(|inner| inner as _);
    while let Some(err) = source {
        if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            return Some(tls.to_string());
        }
        if let Some(quic) = err.downcast_ref::<quinn::ConnectionError>() {
            let code = match quic {
                quinn::ConnectionError::TransportError(t) => Some(t.code),
                quinn::ConnectionError::ConnectionClosed(c) => Some(c.error_code),
                _ => None,
            };
            // QUIC carries TLS alerts as the crypto error codes 0x100..=0x1ff.
            if code.is_some_and(|c| (0x100..0x200).contains(&u64::from(c))) {
                return Some(quic.to_string());
            }
        }
        source = err.source();
    }
    None
}

impl PeerError {
    /// Classifies a connection-time failure: a TLS refusal is an [`PeerError::Auth`] failure (no
    /// point retrying), anything else stays as it is.
    pub(super) fn at_connect(self) -> Self {
        match self {
            PeerError::Io(e) | PeerError::Frame(FrameError::Io(e)) => match tls_refusal(&e) {
                Some(reason) => PeerError::Auth(format!("tls: {reason}")),
                None => PeerError::Io(e),
            },
            other => other,
        }
    }
}
