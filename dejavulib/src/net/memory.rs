//! An in-process transport for deterministic tests: "sockets" are tokio duplex pipes, addresses are
//! entries in a shared [`MemoryNetwork`].

use std::collections::HashMap;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::io::DuplexStream;
use tokio::sync::mpsc;

use super::transport::{Accepted, BoxFuture, Listener, Stream, Transport};

/// Bytes a pipe buffers in each direction by default.
const DEFAULT_PIPE_BYTES: usize = 4 << 20;

#[derive(Default)]
struct Net {
    listeners: HashMap<SocketAddr, mpsc::Sender<DuplexStream>>,
    next_port: u16,
}

/// The address space the in-memory transports of one test share.
#[derive(Clone, Default)]
pub struct MemoryNetwork {
    net: Arc<Mutex<Net>>,
}

/// The in-memory transport: connects to listeners of the same [`MemoryNetwork`].
#[derive(Clone)]
pub struct MemoryTransport {
    network: MemoryNetwork,
    pipe_bytes: usize,
}

impl MemoryTransport {
    /// A transport on `network`.
    pub fn new(network: &MemoryNetwork) -> Self {
        Self { network: network.clone(), pipe_bytes: DEFAULT_PIPE_BYTES }
    }
}

impl Transport for MemoryTransport {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn connect(&self, addr: SocketAddr) -> BoxFuture<'_, io::Result<Stream>> {
        Box::pin(async move {
            let listener = self.network.net.lock().listeners.get(&addr).cloned();
            let refused = || io::Error::from(io::ErrorKind::ConnectionRefused);
            let listener = listener.ok_or_else(refused)?;
            let (ours, theirs) = tokio::io::duplex(self.pipe_bytes);
            listener.send(theirs).await.map_err(|_| refused())?;
            Ok(Stream::shared(ours))
        })
    }

    fn listen(&self, addr: SocketAddr) -> BoxFuture<'_, io::Result<Box<dyn Listener>>> {
        Box::pin(async move {
            let mut net = self.network.net.lock();
            let addr = if addr.port() == 0 {
                loop {
                    net.next_port = net.next_port.wrapping_add(1).max(1);
                    let candidate = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), net.next_port);
                    if !net.listeners.contains_key(&candidate) {
                        break candidate;
                    }
                }
            } else {
                addr
            };
            if net.listeners.contains_key(&addr) {
                return Err(io::ErrorKind::AddrInUse.into());
            }
            let (tx, rx) = mpsc::channel(64);
            net.listeners.insert(addr, tx);
            Ok(Box::new(MemoryListener { addr, incoming: rx, network: self.network.clone() })
                as Box<dyn Listener>)
        })
    }
}

struct MemoryListener {
    addr: SocketAddr,
    incoming: mpsc::Receiver<DuplexStream>,
    network: MemoryNetwork,
}

impl Listener for MemoryListener {
    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn accept(&mut self) -> BoxFuture<'_, io::Result<Accepted>> {
        Box::pin(async move {
            let stream = self.incoming.recv().await.ok_or(io::ErrorKind::NotConnected)?;
            Ok(Box::pin(async move { Ok(Stream::shared(stream)) }) as Accepted)
        })
    }
}

impl Drop for MemoryListener {
    fn drop(&mut self) {
        self.network.net.lock().listeners.remove(&self.addr);
    }
}
