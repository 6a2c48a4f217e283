//! The one seam between the peer protocol and the ways bytes travel: dial and accept duplex streams.

use std::future::Future;
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A boxed future, so transports can be used as trait objects.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A byte stream in both directions.
pub trait Duplex: AsyncRead + AsyncWrite + Send + Unpin {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin> Duplex for T {}

/// The reading half of a [`Stream`].
pub type ReadHalf = Box<dyn AsyncRead + Send + Unpin>;

/// The writing half of a [`Stream`].
pub type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;

/// A connected stream, not yet authenticated at the cluster level (see [`super::auth`]).
///
/// It is made of two halves that separate tasks can use at once ([`Stream::into_split`]): a reply
/// reader and the requests' writer. Where the transport's streams come in independent halves
/// (plain TCP, QUIC) they are kept as they are; a shared lock between the halves would hold a
/// reader up for the whole of a writer's system call (a multi-MB write) and block its thread.
pub struct Stream {
    read: ReadHalf,
    write: WriteHalf,
}

impl Stream {
    /// A stream of two independent halves.
    pub fn from_halves(
        read: impl AsyncRead + Send + Unpin + 'static,
        write: impl AsyncWrite + Send + Unpin + 'static,
    ) -> Self {
        Self { read: Box::new(read), write: Box::new(write) }
    }

    /// A stream whose halves share one state (a TLS session, an in-memory pipe): each half takes a
    /// lock for the time of each read or write.
    pub fn shared(stream: impl Duplex + 'static) -> Self {
        let (read, write) = tokio::io::split(stream);
        Self::from_halves(read, write)
    }

    /// Its halves, for a reader and a writer on separate tasks.
    pub fn into_split(self) -> (ReadHalf, WriteHalf) {
        (self.read, self.write)
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.read).poll_read(cx, buf)
    }
}

impl AsyncWrite for Stream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.write).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.write).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.write.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.write).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.write).poll_shutdown(cx)
    }
}

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
