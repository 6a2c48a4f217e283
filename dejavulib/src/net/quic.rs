//! QUIC (quinn) with mutual TLS: both ends present a certificate of the cluster's authority.
//!
//! A connection carries one bidirectional stream, which the peer protocol multiplexes by request
//! id exactly as it does a TCP connection.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::Mutex;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Connection, Endpoint, RecvStream, SendStream, TransportConfig, VarInt};
use tokio::io::AsyncWrite;

use super::error::PeerError;
use super::tls::{NodeIdentity, SERVER_NAME};
use super::transport::{Accepted, BoxFuture, Listener, Stream, Transport};

/// How long a QUIC peer may stay silent before its connection is dropped, by default. A peer
/// that dies says nothing (no reset, unlike TCP): this is how long a request to it can hang.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// Flow-control windows large enough for a 64 MiB chunk in flight on a fast link; keep-alives
/// four times per `idle` timeout, so only a dead or cut-off peer reaches it.
fn transport_config(idle: Duration) -> Arc<TransportConfig> {
    let mut config = TransportConfig::default();
    config.stream_receive_window(VarInt::from_u32(32 << 20));
    config.receive_window(VarInt::from_u32(64 << 20));
    config.send_window(64 << 20);
    config.keep_alive_interval(Some(idle / 4));
    // Beyond quinn's range (about 146 years) means never.
    config.max_idle_timeout(idle.try_into().ok());
    Arc::new(config)
}

/// The quinn server and client configurations this transport uses: TLS 1.3 with the cluster's
/// certificates, and flow-control windows sized for large chunks. Public so that benchmarks can
/// compare against a raw quinn stream set up exactly alike.
pub fn endpoint_configs(
    identity: &NodeIdentity,
    client: rustls::ClientConfig,
) -> Result<(quinn::ServerConfig, quinn::ClientConfig), PeerError> {
    let tls = |e: &dyn std::fmt::Display| PeerError::Tls(e.to_string());
    let server_crypto = QuicServerConfig::try_from(identity.server_config()?).map_err(|e| tls(&e))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
    server.transport_config(transport_config(DEFAULT_IDLE_TIMEOUT));
    let client_crypto = QuicClientConfig::try_from(client).map_err(|e| tls(&e))?;
    let mut client = quinn::ClientConfig::new(Arc::new(client_crypto));
    client.transport_config(transport_config(DEFAULT_IDLE_TIMEOUT));
    Ok((server, client))
}

/// The QUIC transport.
pub struct QuicTransport {
    server: quinn::ServerConfig,
    client: quinn::ClientConfig,
    /// One client endpoint (one UDP socket) per address family, made on first use.
    endpoints: Mutex<[Option<Endpoint>; 2]>,
}

impl QuicTransport {
    /// A transport that presents `identity` and accepts only peers of the same cluster.
    pub fn new(identity: &NodeIdentity) -> Result<Self, PeerError> {
        Self::with_client(identity, identity.client_config()?)
    }

    /// The server side of `identity` with an explicit client configuration (tests use it to connect
    /// without a certificate or with another cluster's).
    pub fn with_client(identity: &NodeIdentity, client: rustls::ClientConfig) -> Result<Self, PeerError> {
        let (server, client) = endpoint_configs(identity, client)?;
        Ok(Self { server, client, endpoints: Mutex::new([None, None]) })
    }

    /// Drops connections to a peer silent for `idle` (keep-alives go four times as often), on both
    /// ends of the connections this transport makes or accepts. The default is
    /// [`DEFAULT_IDLE_TIMEOUT`]; a cluster that must notice a dead peer sooner sets less.
    pub fn idle_timeout(mut self, idle: Duration) -> Self {
        self.server.transport_config(transport_config(idle));
        self.client.transport_config(transport_config(idle));
        self
    }

    fn endpoint(&self, peer: SocketAddr) -> io::Result<Endpoint> {
        let mut endpoints = self.endpoints.lock();
        let slot = &mut endpoints[usize::from(peer.is_ipv6())];
        if let Some(endpoint) = slot {
            return Ok(endpoint.clone());
        }
        let any: SocketAddr = if peer.is_ipv6() {
            (Ipv6Addr::UNSPECIFIED, 0).into()
        } else {
            (Ipv4Addr::UNSPECIFIED, 0).into()
        };
        let endpoint = Endpoint::client(any)?;
        *slot = Some(endpoint.clone());
        Ok(endpoint)
    }
}

impl Transport for QuicTransport {
    fn name(&self) -> &'static str {
        "quic"
    }

    fn connect(&self, addr: SocketAddr) -> BoxFuture<'_, io::Result<Stream>> {
        Box::pin(async move {
            let endpoint = self.endpoint(addr)?;
            let connecting =
                endpoint.connect_with(self.client.clone(), addr, SERVER_NAME).map_err(io::Error::other)?;
            let connection = connecting.await.map_err(io::Error::other)?;
            let (send, recv) = connection.open_bi().await.map_err(io::Error::other)?;
            Ok(quic_stream(send, recv, connection))
        })
    }

    fn listen(&self, addr: SocketAddr) -> BoxFuture<'_, io::Result<Box<dyn Listener>>> {
        Box::pin(async move {
            let endpoint = Endpoint::server(self.server.clone(), addr)?;
            Ok(Box::new(QuicListener { endpoint }) as Box<dyn Listener>)
        })
    }
}

struct QuicListener {
    endpoint: Endpoint,
}

impl Listener for QuicListener {
    fn local_addr(&self) -> SocketAddr {
        self.endpoint.local_addr().expect("a bound endpoint has an address")
    }

    fn accept(&mut self) -> BoxFuture<'_, io::Result<Accepted>> {
        Box::pin(async move {
            let incoming = self.endpoint.accept().await.ok_or(io::ErrorKind::NotConnected)?;
            Ok(Box::pin(async move {
                let connection = incoming.await.map_err(io::Error::other)?;
                let (send, recv) = connection.accept_bi().await.map_err(io::Error::other)?;
                Ok(quic_stream(send, recv, connection))
            }) as Accepted)
        })
    }
}

impl Drop for QuicListener {
    fn drop(&mut self) {
        // Like a process exit: peers learn at once instead of after the idle timeout.
        self.endpoint.close(VarInt::from_u32(0), b"listener closed");
    }
}

/// One bidirectional QUIC stream: its halves are QUIC's own receive and send streams (each keeps
/// the connection open). Called within the runtime, whose handle the send half keeps for its drop.
fn quic_stream(send: SendStream, recv: RecvStream, connection: Connection) -> Stream {
    let runtime = tokio::runtime::Handle::current();
    Stream::from_halves(recv, QuicSend { send, connection, runtime })
}

/// The sending half of a QUIC stream.
struct QuicSend {
    send: SendStream,
    connection: Connection,
    /// Where the drop lets the connection linger: a send half may be dropped on a thread outside
    /// the runtime (a blocking `PeerStore`'s).
    runtime: tokio::runtime::Handle,
}

/// How long a dropped send half keeps its connection open for the peer to receive what was
/// written.
const LINGER: Duration = Duration::from_secs(2);

impl Drop for QuicSend {
    fn drop(&mut self) {
        // Closing a QUIC connection abandons data not yet delivered (a refusal, a last reply), so
        // finish the stream and let the connection live until the peer has it, as TCP's close does.
        let _ = self.send.finish();
        let delivered = self.send.stopped();
        let connection = self.connection.clone();
        // A runtime already shut down cancels the task at once: nothing is left to deliver to.
        self.runtime.spawn(async move {
            let _ = tokio::time::timeout(LINGER, delivered).await;
            drop(connection);
        });
    }
}

impl AsyncWrite for QuicSend {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        AsyncWrite::poll_write(Pin::new(&mut self.send), cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        AsyncWrite::poll_flush(Pin::new(&mut self.send), cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        AsyncWrite::poll_shutdown(Pin::new(&mut self.send), cx)
    }
}
