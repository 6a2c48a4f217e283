//! The query protocol's refusal codes and node ids, shared by the controller's query port and
//! [`super::ControllerClient`]; its requests and answers are control messages
//! ([`dejavulib::message`]).

use dejavulib::net::controller::QueryError;

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

pub(super) use dejavulib::net::controller::QUERY_SERVER_NODE;

impl From<QueryError> for ControllerError {
    fn from(e: QueryError) -> Self {
        match e {
            QueryError::Io(e) => ControllerError::Io(e),
            QueryError::Auth(reason) => ControllerError::Auth(reason),
            QueryError::Protocol(what) => ControllerError::Protocol(what),
            QueryError::Refused { code, detail, reason } => ControllerError::Refused { code, detail, reason },
        }
    }
}
