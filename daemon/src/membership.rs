//! A process's membership of the cluster, as the controller sees it: its heartbeats
//! ([`crate::heartbeat`]), which show it alive, stopped or cut off, and its lifeline
//! ([`crate::controller::Lifeline`]), whose end shows at once that it died. Both are held
//! together and let go together.

use crate::controller::Lifeline;
use crate::heartbeat::Heartbeat;

/// A member's heartbeats and lifeline, both stopped when this is dropped.
#[derive(Debug)]
pub struct Membership {
    /// Dropped first: the beats stop before the lifeline ends.
    _heartbeat: Heartbeat,
    _lifeline: Lifeline,
}

impl Membership {
    /// Holds `heartbeat` and `lifeline` together.
    pub fn new(heartbeat: Heartbeat, lifeline: Lifeline) -> Self {
        Self { _heartbeat: heartbeat, _lifeline: lifeline }
    }

    /// Stops beating (within one interval) and lets go of the lifeline.
    pub fn stop(self) {}

    /// The epoch the controller fenced this process in, if it told it ([`Lifeline::fenced_in`]).
    pub fn fenced_in(&self) -> Option<u64> {
        self._lifeline.fenced_in()
    }
}
