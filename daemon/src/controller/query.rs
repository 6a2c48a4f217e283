//! The query protocol's refusal codes and node ids, shared by the controller's query port and
//! [`super::ControllerClient`]; its requests and answers are control messages
//! ([`dejavulib::message`]).

use std::io::ErrorKind;

use dejavulib::net::PeerError;
use dejavulib::wire::FrameError;

use super::ControllerError;
#[cfg(doc)]
use dejavulib::message::Message;

/// The code (first id) of an `Error` reply to a [`Message::FencedIn`] for a member not fenced.
pub(super) const REFUSED_NOT_FENCED: u32 = 1;
/// The code of an `Error` reply to a [`Message::Lifeline`] from a second process claiming a
/// member another live process of the same epoch holds.
pub(super) const REFUSED_CLAIMED: u32 = 2;
/// The code of any other refusal.
const REFUSED: u32 = 0;

/// The code of an `Error` reply refusing a request for `e`.
pub(super) fn refusal_code(e: &ControllerError) -> u32 {
    match e {
        ControllerError::NotFenced(_) => REFUSED_NOT_FENCED,
        ControllerError::Claimed { .. } => REFUSED_CLAIMED,
        _ => REFUSED,
    }
}

/// The node ids the query port proves the secret as, and its clients.
pub(super) const QUERY_SERVER_NODE: u32 = 0;
pub(super) const QUERY_CLIENT_NODE: u32 = u32::MAX;

/// What a failed handshake with the controller is: a refusal of the secret (one end is not of
/// this cluster), or, like any connection that breaks or stalls, an [`ControllerError::Io`], which
/// callers wait out (a controller paused, restarting, or at its connection limit).
pub(super) fn handshake_error(e: PeerError) -> ControllerError {
    match e {
        PeerError::Auth(reason) => ControllerError::Auth(reason),
        PeerError::Io(e) | PeerError::Frame(FrameError::Io(e)) => ControllerError::Io(e),
        PeerError::Timeout(_) => ControllerError::Io(ErrorKind::TimedOut.into()),
        other => ControllerError::Io(std::io::Error::new(ErrorKind::ConnectionAborted, other.to_string())),
    }
}
