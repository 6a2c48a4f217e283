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

pub mod auth;
pub mod blocking;
pub mod client;
pub mod codec;
pub mod controller;
pub mod error;
pub mod memory;
pub mod quic;
pub mod server;
pub mod tcp;
pub mod tls;
pub mod transport;

pub use blocking::PeerStore;
pub use client::{ClientConfig, PeerClient};
pub use error::PeerError;
pub use server::{PeerServer, PeerStats, ServerConfig};
pub use transport::{Accepted, BoxFuture, Duplex, Listener, Stream, Transport};
