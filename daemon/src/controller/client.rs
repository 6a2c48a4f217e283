//! The other end of the controller's query port: [`ControllerClient`], used by
//! [`crate::cluster`] and by replacements asking for their epoch.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use dejavulib::message::{Message, RecoveryOrders};
use dejavulib::net::controller::QueryConnection;

use super::query::{REFUSED_CLAIMED, REFUSED_NOT_FENCED};
use super::{ControllerError, Health, Member};

/// Who is alive, as the controller said at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Census {
    /// The last epoch handed out.
    pub epoch: u64,
    /// Every member it knows of.
    pub members: BTreeMap<Member, Health>,
}

impl Census {
    /// The health of `member` (dead if the controller never heard of it).
    pub fn health(&self, member: Member) -> Health {
        self.members.get(&member).copied().unwrap_or(Health::Dead)
    }

    /// Whether `member` is dead, fenced or not.
    pub fn is_dead(&self, member: Member) -> bool {
        matches!(self.health(member), Health::Dead | Health::Fenced)
    }

    /// Whether `member` is fenced and awaits its replacement.
    pub fn is_fenced(&self, member: Member) -> bool {
        self.health(member) == Health::Fenced
    }

    /// Whether `member` is suspect (silent for half the timeout, not yet dead).
    pub fn is_suspect(&self, member: Member) -> bool {
        self.health(member) == Health::Suspect
    }
}

/// A connection to a controller; every call has a deadline, and a broken connection is
/// re-established by the next call.
pub struct ControllerClient {
    link: QueryConnection,
}

impl ControllerClient {
    /// A client of the controller at `addr`, proving the cluster secret `secret` on each
    /// connection; a call slower than `deadline` fails.
    pub fn new(addr: SocketAddr, deadline: Duration, secret: impl Into<Vec<u8>>) -> Self {
        Self { link: QueryConnection::new(addr, deadline, secret) }
    }

    /// The controller's address (also where heartbeats go).
    pub fn addr(&self) -> SocketAddr {
        self.link.addr()
    }

    /// Drops the connection: the next call opens a new one (to a controller replaced on the
    /// same port, say).
    pub fn disconnect(&mut self) {
        self.link.disconnect();
    }

    /// Who is alive.
    pub fn census(&mut self) -> Result<Census, ControllerError> {
        match self.call(&Message::Census)? {
            (_, Message::CensusReply { epoch, members }) => {
                Ok(Census { epoch, members: members.into_iter().collect() })
            }
            (_, other) => Err(unexpected("a census", &other)),
        }
    }

    /// Fences `members` in a new epoch, which it returns once the controller has made it durable.
    /// Their heartbeats are ignored from then on; they count as dead until a replacement beats.
    pub fn fence(&mut self, members: &[Member]) -> Result<u64, ControllerError> {
        self.epoch_of(&Message::Fence { members: members.to_vec(), reuse: None })
    }

    /// As [`ControllerClient::fence`], unless the controller has fenced exactly these members
    /// already (all of them await their replacements from a fence in its current epoch), in an
    /// epoch `lowest` or later: then that epoch is returned and none opened. A recovery of what
    /// the controller fenced uses its fence; one tried again after a failed attempt (whose
    /// replacements may have started in that epoch) passes a `lowest` above it.
    pub fn fence_unless_fenced(&mut self, members: &[Member], lowest: u64) -> Result<u64, ControllerError> {
        self.epoch_of(&Message::Fence { members: members.to_vec(), reuse: Some(lowest) })
    }

    /// Waits until the controller opens an epoch after `after` (a fence), or for `wait` at most
    /// (10 s at most); returns its epoch then. The call's deadline must be longer than `wait`.
    pub fn await_fence(&mut self, after: u64, wait: Duration) -> Result<u64, ControllerError> {
        let wait_ms = wait.as_millis().min(u32::MAX as u128) as u32;
        self.epoch_of(&Message::AwaitFence { after, wait_ms })
    }

    /// Asks the controller to take this client's connection as `member`'s lifeline (see
    /// [`super::Lifeline`]), for a process started in `epoch`, and gives the connection up: held
    /// open, with no read timeout, it is the lifeline.
    pub(super) fn into_lifeline(
        mut self,
        member: Member,
        epoch: u64,
        process: u32,
    ) -> Result<TcpStream, ControllerError> {
        match self.call(&Message::Lifeline { member, epoch, process }) {
            Err(ControllerError::Refused { code: REFUSED_CLAIMED, detail, .. }) => {
                return Err(ControllerError::Claimed { member, by: detail });
            }
            other => other?,
        };
        let stream = self.link.into_stream().expect("a call that succeeded left its connection");
        stream.set_read_timeout(None)?;
        Ok(stream)
    }

    /// The epoch fenced `member` was fenced in, which its replacement starts in;
    /// [`ControllerError::NotFenced`] if it awaits no replacement.
    pub fn fenced_in(&mut self, member: Member) -> Result<u64, ControllerError> {
        match self.epoch_of(&Message::FencedIn(member)) {
            Err(ControllerError::Refused { code: REFUSED_NOT_FENCED, .. }) => {
                Err(ControllerError::NotFenced(member))
            }
            other => other,
        }
    }

    /// Has the controller carry out its part of the recovery of epoch `epoch` (its current one)
    /// once the replacements beat: plan the ring, re-seed replaced sidecars, find each sequence's
    /// first unreplicated token ([`RecoveryOrders`]), for a ring whose stage `k` reaches its
    /// successor's sidecar at `book[k]`; returns what it did and found. Re-seeds move KV: the
    /// call waits up to `patience` for the answer. Carrying a recovery out again is harmless (a
    /// re-seed sends the same chunks again).
    pub fn recover(
        &mut self,
        epoch: u64,
        book: &[SocketAddr],
        patience: Duration,
    ) -> Result<RecoveryOrders, ControllerError> {
        match self.call_patiently(&Message::Recover { epoch, book: book.to_vec() }, patience)? {
            Message::Orders(orders) if orders.epoch == epoch => Ok(orders),
            other => Err(unexpected("a recovery", &other)),
        }
    }

    /// The last of the controller's part of the recovery of epoch `epoch`: once the replaced
    /// stages have restored (or recomputed) their KV, the new sidecar of each replaced stage
    /// whose successor was replaced too re-seeds that successor's; see
    /// [`ControllerClient::recover`]. Returns the chunks sent.
    pub fn reseed_restored(
        &mut self,
        epoch: u64,
        book: &[SocketAddr],
        patience: Duration,
    ) -> Result<u64, ControllerError> {
        match self.call_patiently(&Message::ReseedRestored { epoch, book: book.to_vec() }, patience)? {
            Message::Reseeded { chunks } => Ok(chunks),
            other => Err(unexpected("a re-seed", &other)),
        }
    }

    /// A recovery request, waiting up to `patience` for the answer (it moves KV).
    fn call_patiently(&mut self, request: &Message, patience: Duration) -> Result<Message, ControllerError> {
        Ok(self.link.call_within(request, patience)?.1)
    }

    /// A request whose answer is an epoch.
    fn epoch_of(&mut self, request: &Message) -> Result<u64, ControllerError> {
        match self.call(request)? {
            (_, Message::Epoch(epoch)) => Ok(epoch),
            (_, other) => Err(unexpected("an epoch", &other)),
        }
    }

    /// A request; returns the epoch its answer came in, and the answer. A controller that cannot
    /// be reached, does not answer in time or closes the connection is an
    /// [`ControllerError::Io`]; one that refuses, a [`ControllerError::Refused`].
    pub(super) fn call(&mut self, request: &Message) -> Result<(u64, Message), ControllerError> {
        Ok(self.link.call(request)?)
    }

    /// As [`ControllerClient::call`], with the request's payload as it is (tests send malformed
    /// ones).
    #[cfg(test)]
    pub(super) fn call_with_payload(&mut self, request: Vec<u8>) -> Result<(u64, Message), ControllerError> {
        Ok(self.link.call_payload(request, Duration::from_secs(5))?)
    }
}

/// An answer that is not the one `what` calls for.
fn unexpected(what: &str, answer: &Message) -> ControllerError {
    ControllerError::Protocol(format!("{what} answered with {answer:?}"))
}
