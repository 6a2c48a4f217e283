//! TCP (tokio): TCP_NODELAY, vectored writes, optional TLS 1.3 with cluster certificates.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use rustls::pki_types::ServerName;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use super::error::PeerError;
use super::tls::{NodeIdentity, SERVER_NAME};
use super::transport::{Accepted, BoxFuture, Listener, Stream, Transport};

/// The TCP transport.
#[derive(Clone, Default)]
pub struct TcpTransport {
    tls: Option<(TlsAcceptor, TlsConnector)>,
    socket_buffer: Option<u32>,
}

impl TcpTransport {
    /// Plain TCP (peers still prove cluster membership with the HMAC handshake).
    pub fn plain() -> Self {
        Self::default()
    }

    /// TCP wrapped in TLS 1.3: encrypted, and both sides must hold a certificate of the cluster.
    pub fn with_tls(identity: &NodeIdentity) -> Result<Self, PeerError> {
        let acceptor = TlsAcceptor::from(Arc::new(identity.server_config()?));
        let connector = TlsConnector::from(Arc::new(identity.client_config()?));
        Ok(Self { tls: Some((acceptor, connector)), socket_buffer: None })
    }

    /// TLS client side from an explicit configuration (tests use it to connect without a certificate).
    pub fn with_client_tls(server: &NodeIdentity, client: rustls::ClientConfig) -> Result<Self, PeerError> {
        let acceptor = TlsAcceptor::from(Arc::new(server.server_config()?));
        Ok(Self { tls: Some((acceptor, TlsConnector::from(Arc::new(client)))), socket_buffer: None })
    }

    /// Fixes the kernel socket buffers at `bytes` (the default leaves them to the kernel's
    /// autotuning, which usually does better on loopback and LANs).
    pub fn socket_buffer(mut self, bytes: u32) -> Self {
        self.socket_buffer = Some(bytes);
        self
    }

    fn socket(&self, addr: SocketAddr) -> io::Result<TcpSocket> {
        let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
        if let Some(bytes) = self.socket_buffer {
            socket.set_send_buffer_size(bytes)?;
            socket.set_recv_buffer_size(bytes)?;
        }
        Ok(socket)
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        if self.tls.is_some() {
            "tcp+tls"
        } else {
            "tcp"
        }
    }

    fn connect(&self, addr: SocketAddr) -> BoxFuture<'_, io::Result<Stream>> {
        Box::pin(async move {
            let stream = self.socket(addr)?.connect(addr).await?;
            stream.set_nodelay(true)?;
            match &self.tls {
                None => Ok(plain(stream)),
                Some((_, connector)) => {
                    let name = ServerName::try_from(SERVER_NAME).expect("a valid DNS name");
                    Ok(Stream::shared(connector.connect(name, stream).await?))
                }
            }
        })
    }

    fn listen(&self, addr: SocketAddr) -> BoxFuture<'_, io::Result<Box<dyn Listener>>> {
        Box::pin(async move {
            let socket = self.socket(addr)?;
            socket.set_reuseaddr(true)?;
            socket.bind(addr)?;
            let listener = socket.listen(1024)?;
            let acceptor = self.tls.as_ref().map(|(a, _)| a.clone());
            Ok(Box::new(TcpIncoming { listener, acceptor }) as Box<dyn Listener>)
        })
    }
}

/// A plain TCP stream, in halves that need no lock between them.
fn plain(stream: TcpStream) -> Stream {
    let (read, write) = stream.into_split();
    Stream::from_halves(read, write)
}

struct TcpIncoming {
    listener: TcpListener,
    acceptor: Option<TlsAcceptor>,
}

fn finish(stream: TcpStream, acceptor: Option<TlsAcceptor>) -> Accepted {
    Box::pin(async move {
        stream.set_nodelay(true)?;
        match acceptor {
            None => Ok(plain(stream)),
            Some(acceptor) => Ok(Stream::shared(acceptor.accept(stream).await?)),
        }
    })
}

impl Listener for TcpIncoming {
    fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("a bound listener has an address")
    }

    fn accept(&mut self) -> BoxFuture<'_, io::Result<Accepted>> {
        Box::pin(async move {
            let (stream, _) = self.listener.accept().await?;
            Ok(finish(stream, self.acceptor.clone()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWrite;

    #[tokio::test]
    async fn streams_in_halves_still_write_vectored() {
        for transport in [TcpTransport::plain(), TcpTransport::plain().socket_buffer(1 << 20)] {
            let mut listener = transport.listen("127.0.0.1:0".parse().unwrap()).await.unwrap();
            let (dialled, accepted) =
                tokio::join!(transport.connect(listener.local_addr()), listener.accept());
            let (client, server) = (dialled.unwrap(), accepted.unwrap().await.unwrap());
            // A frame's header and payload parts go out in one system call, not one per part.
            assert!(client.is_write_vectored() && server.is_write_vectored());
        }
    }
}
