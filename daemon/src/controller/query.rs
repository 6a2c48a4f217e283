//! The query protocol's operations, refusal codes and member encoding, shared by the controller's
//! query port and [`super::ControllerClient`].

use std::io::ErrorKind;

use dejavulib::net::PeerError;
use dejavulib::wire::FrameError;

use super::{ControllerError, Member};
use crate::heartbeat::Role;

/// Query operations (the first id of a control frame).
pub(super) const OP_CENSUS: u32 = 1;
pub(super) const OP_FENCE: u32 = 2;
/// The epoch a fenced member was fenced in, which its replacement starts in.
pub(super) const OP_FENCED_IN: u32 = 3;
/// Carry out a recovery once its replacements are up (the `recovery` module).
pub(super) const OP_RECOVER: u32 = 4;
/// Re-seed the replaced sidecars whose predecessors were replaced too, once those have restored.
pub(super) const OP_RESEED_RESTORED: u32 = 5;
/// Hold this connection open as the sender's lifeline (the `lifeline` module).
pub(super) const OP_LIFELINE: u32 = 6;
/// Answer once an epoch after the one named is opened, or once the wait named has passed.
pub(super) const OP_AWAIT_FENCE: u32 = 7;

/// The code (first id) of an `Error` reply to [`OP_FENCED_IN`] for a member not fenced.
pub(super) const REFUSED_NOT_FENCED: u32 = 1;
/// The code of any other refusal.
const REFUSED: u32 = 0;

/// The code of an `Error` reply refusing a request for `e`.
pub(super) fn refusal_code(e: &ControllerError) -> u32 {
    match e {
        ControllerError::NotFenced(_) => REFUSED_NOT_FENCED,
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

pub(super) const MEMBER_LEN: usize = 5;

pub(super) fn encode_member(out: &mut Vec<u8>, (role, index): Member) {
    out.push(role as u8);
    out.extend_from_slice(&index.to_le_bytes());
}

pub(super) fn decode_member(bytes: &[u8]) -> Option<Member> {
    let role = match bytes[0] {
        0 => Role::Engine,
        1 => Role::Sidecar,
        _ => return None,
    };
    Some((role, u32::from_le_bytes(bytes[1..MEMBER_LEN].try_into().ok()?)))
}

pub(super) fn decode_members(payload: &[u8]) -> Result<Vec<Member>, ControllerError> {
    if payload.len() % MEMBER_LEN != 0 {
        return Err(ControllerError::Protocol("a member list of a partial member".into()));
    }
    payload
        .chunks_exact(MEMBER_LEN)
        .map(|m| decode_member(m).ok_or_else(|| ControllerError::Protocol("an unknown role".into())))
        .collect()
}
