//! The running controller's machine: the liveness and fencing of every member ([`Liveness`]),
//! with the hand-over of spares to the fenced ([`Spares`]) on top. `dejavud controller` holds
//! one and is its I/O shell; the simulator (`dejavu-sim`'s `liveness` module) drives the same
//! type through kills, pauses, lost and replayed beats, an unwritable state file and controller
//! restarts.
//!
//! A [`Controller`] is a [`Liveness`] machine (it dereferences to one: heartbeats, lifelines,
//! the detector, fences, the record and the journal are its calls) that also decides which spare
//! takes which fenced member's place.

use std::ops::{Deref, DerefMut};

use crate::liveness::{Liveness, LivenessConfig, Record, Role, Start};
use crate::spares::{Assignment, Spares};

/// The running controller's machine (see the module's documentation).
#[derive(Clone, Debug)]
pub struct Controller {
    liveness: Liveness,
    spares: Spares,
}

impl Controller {
    /// A controller starting at `now` from `record` ([`Liveness::start`]); a restarted one has
    /// handed no spare over yet.
    pub fn start(config: LivenessConfig, record: Record, now: u64) -> Self {
        Self { liveness: Liveness::start(config, record, now), spares: Spares::new() }
    }

    /// As [`Controller::start`], journaling its liveness calls ([`Liveness::start_journaled`]).
    pub fn start_journaled(config: LivenessConfig, record: Record, now: u64) -> (Self, Start) {
        let (liveness, start) = Liveness::start_journaled(config, record, now);
        (Self { liveness, spares: Spares::new() }, start)
    }

    /// The spares to hand over at `now` to fenced members of `role` ([`Spares::assign`]).
    pub fn assign_spares(&mut self, role: Role, now: u64) -> Vec<Assignment> {
        self.spares.assign(&self.liveness, role, now)
    }

    /// The shell handed `assignment`'s spare over at `now` ([`Spares::handed_over`]).
    pub fn spare_handed_over(&mut self, assignment: Assignment, now: u64) {
        self.spares.handed_over(assignment, now);
    }

    /// The shell could not hand `assignment`'s spare over ([`Spares::failed`]).
    pub fn spare_failed(&mut self, assignment: Assignment) {
        self.spares.failed(assignment);
    }

    /// The spare assignments still outstanding.
    pub fn outstanding_spares(&self) -> impl Iterator<Item = &Assignment> {
        self.spares.outstanding()
    }
}

impl Deref for Controller {
    type Target = Liveness;

    fn deref(&self) -> &Liveness {
        &self.liveness
    }
}

impl DerefMut for Controller {
    fn deref_mut(&mut self) -> &mut Liveness {
        &mut self.liveness
    }
}
