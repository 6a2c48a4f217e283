//! The transport between a cluster's processes where KV crosses machines: sidecar to sidecar
//! (replicas), stage to a sidecar (restores, copies, prompt handoffs). Plain TCP, or QUIC with
//! mutual TLS on the cluster's certificates (`dejavud certs`); either way every connection also
//! proves the cluster secret.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use dejavulib::net::quic::QuicTransport;
use dejavulib::net::tcp::TcpTransport;
use dejavulib::net::tls::NodeIdentity;
use dejavulib::net::Transport;

/// A QUIC peer silent this long is dropped (keep-alives go four times as often): a peer that dies
/// says nothing, so this bounds how long a forward to a dead successor can hang.
const QUIC_IDLE: Duration = Duration::from_millis(400);

/// Which transport.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum TransportKind {
    /// TCP (the cluster secret authenticates each connection).
    #[default]
    Tcp,
    /// QUIC with mutual TLS on the cluster's certificates (and the cluster secret).
    Quic,
}

/// A process's transport settings, as flags.
#[derive(Clone, Debug, Args)]
pub struct TransportArgs {
    /// The transport to other sidecars.
    #[arg(long, value_enum, default_value = "tcp")]
    pub transport: TransportKind,
    /// The cluster's certificates (`dejavud certs`), for QUIC.
    #[arg(long)]
    pub certs: Option<PathBuf>,
    /// The name of this process's certificate in `--certs` (`NAME.pem`, `NAME.key`).
    #[arg(long, default_value = "member")]
    pub cert_name: String,
}

/// Makes a process's connections to other sidecars and its listener for them.
#[derive(Clone, Debug, Default)]
pub struct Transports {
    /// The identity QUIC presents; none for TCP.
    identity: Option<NodeIdentity>,
}

impl Transports {
    /// Plain TCP.
    pub fn tcp() -> Self {
        Self::default()
    }

    /// QUIC, presenting `identity`.
    pub fn quic(identity: NodeIdentity) -> Self {
        Self { identity: Some(identity) }
    }

    /// Whether the transport is QUIC.
    pub fn is_quic(&self) -> bool {
        self.identity.is_some()
    }

    /// A transport (each holds its own sockets).
    pub fn make(&self) -> Result<Arc<dyn Transport>, TransportError> {
        Ok(match &self.identity {
            None => Arc::new(TcpTransport::plain()),
            Some(identity) => {
                Arc::new(QuicTransport::new(identity).map_err(TransportError::Quic)?.idle_timeout(QUIC_IDLE))
            }
        })
    }

    /// Whether the transport can listen at `at` now: binds its protocol's socket there (TCP, or
    /// UDP for QUIC) and lets it go. A process checks before it asks for an epoch, so that a start
    /// whose port is taken fails without using one up.
    pub fn check_free(&self, at: std::net::SocketAddr) -> std::io::Result<()> {
        match self.identity {
            None => std::net::TcpListener::bind(at).map(drop),
            Some(_) => std::net::UdpSocket::bind(at).map(drop),
        }
    }

    /// The transport's name.
    pub fn name(&self) -> &'static str {
        if self.identity.is_some() {
            "quic"
        } else {
            "tcp"
        }
    }
}

/// Why a process's transport cannot be had.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// QUIC without the cluster's certificates.
    #[error("--transport quic needs --certs")]
    NeedsCerts,
    /// The node's certificate could not be loaded.
    #[error("certificate {name:?} in {}: {source}", dir.display())]
    Certificate {
        /// The certificate's name.
        name: String,
        /// The certificates' directory.
        dir: PathBuf,
        /// Why.
        source: dejavulib::net::PeerError,
    },
    /// The QUIC endpoint could not be made.
    #[error("cannot make the QUIC endpoint: {0}")]
    Quic(#[source] dejavulib::net::PeerError),
}

impl TransportArgs {
    /// The transports these flags describe, with QUIC's certificate loaded (checked now, so a
    /// missing or bad one stops the process at start).
    pub fn transports(&self) -> Result<Transports, TransportError> {
        match self.transport {
            TransportKind::Tcp => Ok(Transports::tcp()),
            TransportKind::Quic => {
                let dir = self.certs.as_ref().ok_or(TransportError::NeedsCerts)?;
                let identity = NodeIdentity::load(dir, &self.cert_name).map_err(|source| {
                    TransportError::Certificate { name: self.cert_name.clone(), dir: dir.clone(), source }
                })?;
                let transports = Transports::quic(identity);
                transports.make()?;
                Ok(transports)
            }
        }
    }
}
