//! The one seam between the peer protocol and the ways bytes travel: dial and accept duplex streams.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;

use tokio::io::{AsyncRead, AsyncWrite};

/// A boxed future, so transports can be used as trait objects.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A byte stream in both directions.
pub trait Duplex: AsyncRead + AsyncWrite + Send + Unpin {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin> Duplex for T {}

/// A connected stream, not yet authenticated at the cluster level (see [`super::auth`]).
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
