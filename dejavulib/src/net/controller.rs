//! The client end of the controller's query port (`dejavud controller`): [`QueryConnection`], one
//! blocking connection that proves the cluster secret and exchanges control messages
//! ([`crate::message`]), and [`RecoveryFeed`], what whoever feeds a pipeline watches to learn
//! where each sequence resumes after a recovery.
//!
//! Blocking on purpose: its users are plain threads (a feeder, the daemon's cluster supervisor,
//! a binding's caller), and a query is one request and one answer.

use std::io::{BufReader, BufWriter, ErrorKind, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use thiserror::Error;

use super::auth::client_handshake_blocking;
use super::PeerError;
use crate::message::{Message, RecoveryOrders};
use crate::wire::{read_frame, write_frame, FrameError, FrameHeader, Kind};

/// The node id the controller's query port proves the secret as.
pub const QUERY_SERVER_NODE: u32 = 0;
/// The node id its clients prove the secret as.
pub const QUERY_CLIENT_NODE: u32 = u32::MAX;

/// The largest answer a client reads (a census of thousands of members, a recovery's marks).
const MAX_ANSWER: u64 = 1 << 20;

/// Why a query failed.
#[derive(Debug, Error)]
pub enum QueryError {
    /// The controller cannot be reached, did not answer in time, or closed the connection: a
    /// controller paused, restarting or at its connection limit, which callers may wait out.
    #[error("the controller: {0}")]
    Io(#[from] std::io::Error),
    /// The controller refused this client's secret, or this client the controller's.
    #[error("the controller's handshake: {0}")]
    Auth(String),
    /// An answer that is not one the request calls for.
    #[error("the controller's answer: {0}")]
    Protocol(String),
    /// The controller refused the request: `code` and `detail` are the refusal's ids.
    #[error("the controller refused: {reason}")]
    Refused {
        /// What kind of refusal (the query port's codes).
        code: u32,
        /// A number that goes with it (the process holding a claimed member, say).
        detail: u32,
        /// The controller's words.
        reason: String,
    },
}

/// What a failed handshake is: a refusal of the secret, or, like any connection that breaks or
/// stalls, an [`QueryError::Io`].
fn handshake_error(e: PeerError) -> QueryError {
    match e {
        PeerError::Auth(reason) => QueryError::Auth(reason),
        PeerError::Io(e) | PeerError::Frame(FrameError::Io(e)) => QueryError::Io(e),
        PeerError::Timeout(_) => QueryError::Io(ErrorKind::TimedOut.into()),
        other => QueryError::Io(std::io::Error::new(ErrorKind::ConnectionAborted, other.to_string())),
    }
}

/// A connection to a controller's query port, opened at the first call and again after one that
/// failed (it may hold half an exchange); every call has a deadline.
pub struct QueryConnection {
    addr: SocketAddr,
    deadline: Duration,
    /// How long opening a connection (connect and handshake) may take.
    opening: Duration,
    secret: Vec<u8>,
    connection: Option<(BufReader<TcpStream>, BufWriter<TcpStream>)>,
    next_request: u64,
}

impl QueryConnection {
    /// A connection to the controller at `addr`, proving the cluster secret `secret`; a call
    /// slower than `deadline` fails.
    pub fn new(addr: SocketAddr, deadline: Duration, secret: impl Into<Vec<u8>>) -> Self {
        Self { addr, deadline, opening: deadline, secret: secret.into(), connection: None, next_request: 1 }
    }

    /// As `self`, a connection given up if it is not open (connected, the secret proven) within
    /// `opening`: a controller standing by on etcd holds its port without serving it, so its
    /// connections are accepted but never answered.
    pub fn opening_within(self, opening: Duration) -> Self {
        Self { opening, ..self }
    }

    /// The controller's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether a connection is open (from an earlier call).
    pub fn connected(&self) -> bool {
        self.connection.is_some()
    }

    /// Drops the connection: the next call opens a new one.
    pub fn disconnect(&mut self) {
        self.connection = None;
    }

    /// Sends `message`; returns the epoch its answer came in, and the answer.
    pub fn call(&mut self, message: &Message) -> Result<(u64, Message), QueryError> {
        self.call_payload(message.encode(), self.deadline)
    }

    /// As [`QueryConnection::call`], for a request the controller may take up to `deadline` to
    /// answer (one that waits for an event, or moves KV).
    pub fn call_within(
        &mut self,
        message: &Message,
        deadline: Duration,
    ) -> Result<(u64, Message), QueryError> {
        self.call_payload(message.encode(), deadline)
    }

    /// A request whose payload is given as it is (tests send malformed ones).
    pub fn call_payload(
        &mut self,
        payload: Vec<u8>,
        deadline: Duration,
    ) -> Result<(u64, Message), QueryError> {
        let result = self.try_call(payload, deadline);
        if result.is_err() {
            self.connection = None;
        }
        result
    }

    /// The connection's stream, once a call succeeded on it (a lifeline keeps it open).
    pub fn into_stream(self) -> Option<TcpStream> {
        self.connection.map(|(reader, _)| reader.into_inner())
    }

    fn try_call(&mut self, payload: Vec<u8>, deadline: Duration) -> Result<(u64, Message), QueryError> {
        if self.connection.is_none() {
            let stream = TcpStream::connect_timeout(&self.addr, self.opening)?;
            stream.set_nodelay(true)?;
            stream.set_write_timeout(Some(self.deadline))?;
            stream.set_read_timeout(Some(self.opening))?;
            client_handshake_blocking(&stream, &self.secret, QUERY_CLIENT_NODE, self.opening)
                .map_err(handshake_error)?;
            self.connection = Some((BufReader::new(stream.try_clone()?), BufWriter::new(stream)));
        }
        let (reader, writer) = self.connection.as_mut().expect("connected above");
        reader.get_ref().set_read_timeout(Some(deadline))?;
        let request = self.next_request;
        self.next_request += 1;
        write_frame(writer, &FrameHeader::new(Kind::Control, QUERY_CLIENT_NODE, 0, request), &payload)?;
        writer.flush()?;
        let frame = match read_frame(reader, MAX_ANSWER) {
            Ok(Some(frame)) => frame,
            Ok(None) | Err(FrameError::Truncated { .. }) => {
                return Err(QueryError::Io(std::io::Error::new(
                    ErrorKind::UnexpectedEof,
                    "the controller closed the connection",
                )))
            }
            Err(FrameError::Io(e)) => return Err(QueryError::Io(e)),
            Err(e) => return Err(QueryError::Protocol(e.to_string())),
        };
        match frame.header.kind {
            _ if frame.header.request != request => {
                Err(QueryError::Protocol(format!("a reply to {} for {request}", frame.header.request)))
            }
            Kind::Control => match Message::of_frame(&frame) {
                Ok(answer) => Ok((frame.header.epoch, answer)),
                Err(e) => Err(QueryError::Protocol(e.to_string())),
            },
            Kind::Error => Err(QueryError::Refused {
                code: frame.header.ids[0],
                detail: frame.header.ids[1],
                reason: String::from_utf8_lossy(&frame.payload).into_owned(),
            }),
            other => Err(QueryError::Protocol(format!("an unexpected {other:?}"))),
        }
    }
}

/// The controllers named in `text`: `HOST:PORT`, or several, comma-separated (each controller
/// of a cluster on etcd); `Err` names the first that is not an address.
pub fn parse_controllers(text: &str) -> Result<Vec<SocketAddr>, String> {
    let addrs = text
        .split(',')
        .map(|one| one.trim().parse().map_err(|e| format!("controller {one:?} is not HOST:PORT ({e})")))
        .collect::<Result<Vec<SocketAddr>, String>>()?;
    Ok(addrs)
}

/// The longest a single watch waits at the controller (it answers sooner if a recovery is ready).
pub const MAX_WATCH: Duration = Duration::from_secs(10);

/// What whoever feeds a pipeline (it alone holds the requests' tokens) watches: the recoveries
/// the controller carries out, each with where every sequence of each failed stage resumes, in
/// epoch order; and where it says that it fed them again.
///
/// A feeder keeps the epoch of the last recovery it handled, asks for the next one, feeds every
/// sequence of it again from its mark on (the tokens after it are recomputed through the whole
/// pipeline, as the first time), and acknowledges it:
///
/// ```no_run
/// # use dejavulib::net::controller::RecoveryFeed;
/// # use std::time::Duration;
/// let mut feed = RecoveryFeed::new("127.0.0.1:7400".parse().unwrap(), b"secret".to_vec());
/// let mut handled = 0;
/// loop {
///     if let Some(orders) = feed.watch(handled, Duration::from_secs(5)).unwrap() {
///         for stage in &orders.stages {
///             for mark in &stage.marks {
///                 // Feed `mark.slots` of `mark.microbatch` again from token `mark.tokens`.
///             }
///         }
///         feed.acknowledge(orders.epoch).unwrap();
///         handled = orders.epoch;
///     }
/// }
/// ```
///
/// Where several controllers run on etcd, the feed follows whichever leads
/// ([`RecoveryFeed::following`]): the new leader serves the same feed, from the record the old
/// one kept in etcd.
pub struct RecoveryFeed {
    /// One connection per controller.
    links: Vec<QueryConnection>,
    /// The one that answered last.
    current: usize,
}

/// How long a feed waits for an answer (beyond a watch's own wait).
const FEED_DEADLINE: Duration = Duration::from_secs(5);

/// How long a feed that follows several controllers waits for one to open a connection before it
/// tries the next: one standing by never does.
const FOLLOWER_OPENING: Duration = Duration::from_millis(500);

impl RecoveryFeed {
    /// The feed of the controller at `addr`, proving the cluster secret `secret`.
    pub fn new(addr: SocketAddr, secret: impl Into<Vec<u8>>) -> Self {
        Self { links: vec![QueryConnection::new(addr, FEED_DEADLINE, secret)], current: 0 }
    }

    /// The feed of a cluster whose controllers are at `controllers` (several on etcd, of which
    /// one leads and the others stand by): each request goes to the one that answered last, and
    /// on to the others in turn when it cannot be reached or opens no connection within half a
    /// second (a controller standing by holds its port but serves nothing). `None` if
    /// `controllers` is empty.
    pub fn following(controllers: &[SocketAddr], secret: impl Into<Vec<u8>>) -> Option<Self> {
        let secret = secret.into();
        let opening = if controllers.len() > 1 { FOLLOWER_OPENING } else { FEED_DEADLINE };
        let links: Vec<QueryConnection> = controllers
            .iter()
            .map(|&addr| QueryConnection::new(addr, FEED_DEADLINE, secret.clone()).opening_within(opening))
            .collect();
        (!links.is_empty()).then_some(Self { links, current: 0 })
    }

    /// The address of the controller that answered last (the first, before any answer).
    pub fn controller(&self) -> SocketAddr {
        self.links[self.current].addr()
    }

    /// The recovery of the first epoch after `after` in which the controller fenced a stage, once
    /// every stage it fenced has its replacement in place (the engine joined its sidecar; a
    /// replaced sidecar restored too), or `None` if none is ready within `wait` (at most
    /// [`MAX_WATCH`]). Each stage's marks say, per sequence, the first token whose KV it does not
    /// hold: the feeder feeds that sequence again from there (a sequence without a mark, from its
    /// first token). A controller started without the ring's size (`--stages`) carries out no
    /// recoveries and refuses.
    pub fn watch(&mut self, after: u64, wait: Duration) -> Result<Option<RecoveryOrders>, QueryError> {
        let wait = wait.min(MAX_WATCH);
        let wait_ms = wait.as_millis() as u32;
        match self.call(&Message::WatchRecovery { after, wait_ms }, wait + FEED_DEADLINE)? {
            (_, Message::Orders(orders)) if orders.epoch > after => Ok(Some(orders)),
            (_, Message::Epoch(_)) => Ok(None),
            (_, other) => Err(QueryError::Protocol(format!("a recovery watch answered with {other:?}"))),
        }
    }

    /// Tells the controller that every sequence of the recovery of `epoch` was fed again (saying
    /// it twice counts once).
    pub fn acknowledge(&mut self, epoch: u64) -> Result<(), QueryError> {
        match self.call(&Message::AcknowledgeRecovery(epoch), FEED_DEADLINE)? {
            (_, Message::Epoch(_)) => Ok(()),
            (_, other) => Err(QueryError::Protocol(format!("an acknowledgement answered with {other:?}"))),
        }
    }

    /// A request to the controller that answered last, then to each other in turn while one
    /// cannot be reached. On each, it is sent again once on a new connection if the one it went
    /// out on, opened by an earlier call, broke (a controller restarted on its address): both
    /// requests are idempotent. The last failure to reach one is returned if none answers.
    fn call(&mut self, message: &Message, deadline: Duration) -> Result<(u64, Message), QueryError> {
        let n = self.links.len();
        let mut unreachable = None;
        for k in 0..n {
            let i = (self.current + k) % n;
            let link = &mut self.links[i];
            let reused = link.connected();
            let answer = match link.call_within(message, deadline) {
                Err(QueryError::Io(_)) if reused => link.call_within(message, deadline),
                other => other,
            };
            match answer {
                Err(QueryError::Io(e)) => unreachable = Some(e),
                answer => {
                    self.current = i;
                    return answer;
                }
            }
        }
        Err(QueryError::Io(unreachable.expect("a feed has a controller")))
    }
}
