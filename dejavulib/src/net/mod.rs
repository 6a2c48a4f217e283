//! Remote flush / fetch over pluggable transports.
//!
//! Layering, bottom up:
//!
//! - a [`Transport`] dials and accepts duplex byte streams: [`tcp::TcpTransport`] (tokio, TCP_NODELAY,
//!   large socket buffers, optional TLS), [`quic::QuicTransport`] (quinn, mutual TLS pinned to the
//!   cluster's certificate authority) and [`memory::MemoryTransport`] (in-process, for deterministic
//!   tests). Everything above is written once against the trait, and one conformance suite runs over
//!   all three;
//! - [`codec`] reads and writes [`crate::wire`] frames on a stream (vectored writes; payload length
//!   checked before allocating; checksums verified while the bytes arrive);
//! - [`auth`]: every connection starts with a mutual HMAC challenge-response keyed by the cluster
//!   secret, so a peer outside the cluster is refused before it can send a KV frame, whatever the
//!   transport (QUIC and TLS-over-TCP add certificate checks underneath);
//! - [`PeerServer`] keeps chunks flushed to it ([`crate::HostStore`]), acknowledges each with its
//!   checksum and rejects frames from a stale epoch; [`PeerClient`] multiplexes many requests on one
//!   connection under a byte budget (backpressure), with timeouts and reconnection with exponential
//!   backoff; [`PeerStore`] is the blocking [`crate::ChunkStore`] the streamer and resharding use.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;

use tokio::io::{AsyncRead, AsyncWrite};

pub mod auth;
pub mod blocking;
pub mod client;
pub mod codec;
pub mod error;
pub mod memory;
pub mod quic;
pub mod server;
pub mod tcp;
pub mod tls;

pub use blocking::PeerStore;
pub use client::{ClientConfig, PeerClient};
pub use error::PeerError;
pub use server::{PeerServer, PeerStats, ServerConfig};

/// A boxed future, so transports can be used as trait objects.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A byte stream in both directions.
pub trait Duplex: AsyncRead + AsyncWrite + Send + Unpin {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin> Duplex for T {}

/// A connected stream, not yet authenticated at the cluster level (see [`auth`]).
pub type Stream = Box<dyn Duplex>;

/// A way to reach peers: dial and accept byte streams.
pub trait Transport: Send + Sync {
    /// A short name for logs and reports (`tcp`, `tls`, `quic`, `memory`).
    fn name(&self) -> &'static str;

    /// Opens a stream to the listener at `addr`.
    fn connect(&self, addr: SocketAddr) -> BoxFuture<'_, io::Result<Stream>>;

    /// Listens at `addr` (port 0 picks a free one).
    fn listen(&self, addr: SocketAddr) -> BoxFuture<'_, io::Result<Box<dyn Listener>>>;
}

/// Accepts streams dialled to one address.
pub trait Listener: Send {
    /// The address it listens at (with the port it was given).
    fn local_addr(&self) -> SocketAddr;

    /// The next incoming connection. What remains of its setup (a TLS or QUIC handshake) is the
    /// returned future's to do, so one slow peer never holds up the accept loop.
    fn accept(&mut self) -> BoxFuture<'_, io::Result<Accepted>>;
}

/// An accepted connection whose transport-level setup is still to finish.
pub type Accepted = BoxFuture<'static, io::Result<Stream>>;
