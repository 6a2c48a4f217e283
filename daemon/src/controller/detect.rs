//! The controller's failure detector: which dead members to fence, and when.
//!
//! A pure decision over the members' health (dead: silent for the timeout, or its lifeline
//! broke), run every tick, and after each broken lifeline, by the controller's detector thread, so
//! its rules are tested without sockets or sleeps:
//!
//! - only stage members are watched: spares (indices from [`SPARE_MEMBERS`]) are not part of the
//!   pipeline, and members already fenced are waiting for their replacements;
//! - once a watched member is dead, members silent for half the timeout (suspect) get up to
//!   `grace` more to beat again or die too, so that workers that failed together are fenced in
//!   one epoch and recovered together;
//! - a dead sidecar takes its engine with it: an engine without its sidecar can neither keep nor
//!   forward its KV, so the whole worker is replaced.

use std::time::{Duration, Instant};

use super::{Health, Member};
use crate::heartbeat::Role;
use crate::heartbeat::SPARE_MEMBERS;

/// Decides, tick after tick, which members to fence.
#[derive(Debug)]
pub(super) struct Detector {
    /// How long suspects may keep the fence of the dead waiting.
    grace: Duration,
    /// When the first member of the failure being decided was seen dead.
    first_dead: Option<Instant>,
}

impl Detector {
    /// A detector that lets suspects delay a fence by at most `grace`.
    pub(super) fn new(grace: Duration) -> Self {
        Self { grace, first_dead: None }
    }

    /// The members to fence at `now`, given every member's health (empty: none yet).
    pub(super) fn decide(&mut self, members: &[(Member, Health)], now: Instant) -> Vec<Member> {
        let watched = || members.iter().filter(|&&((_, index), _)| index < SPARE_MEMBERS);
        let mut dead: Vec<Member> =
            watched().filter(|&&(_, health)| health == Health::Dead).map(|&(member, _)| member).collect();
        if dead.is_empty() {
            self.first_dead = None;
            return dead;
        }
        let since = *self.first_dead.get_or_insert(now);
        let dying = watched().any(|&(_, health)| health == Health::Suspect);
        if dying && now.duration_since(since) < self.grace {
            return Vec::new();
        }
        self.first_dead = None;
        let engines_of_dead_sidecars: Vec<Member> = dead
            .iter()
            .filter(|&&(role, _)| role == Role::Sidecar)
            .map(|&(_, index)| (Role::Engine, index))
            .filter(|&engine| watched().any(|&(member, health)| member == engine && health != Health::Fenced))
            .collect();
        dead.extend(engines_of_dead_sidecars);
        dead.sort();
        dead.dedup();
        dead
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_millis(300);

    fn engine(i: u32) -> Member {
        (Role::Engine, i)
    }

    fn sidecar(i: u32) -> Member {
        (Role::Sidecar, i)
    }

    #[test]
    fn nothing_is_fenced_while_everyone_beats() {
        let mut detector = Detector::new(GRACE);
        let members = [(engine(0), Health::Alive), (engine(1), Health::Suspect), (sidecar(0), Health::Alive)];
        assert!(detector.decide(&members, Instant::now()).is_empty());
    }

    #[test]
    fn a_dead_engine_alone_is_fenced_at_once_and_its_sidecar_is_left_alone() {
        let mut detector = Detector::new(GRACE);
        let members = [(engine(2), Health::Dead), (sidecar(2), Health::Alive), (engine(1), Health::Alive)];
        assert_eq!(detector.decide(&members, Instant::now()), [engine(2)]);
    }

    #[test]
    fn a_dead_sidecar_takes_its_engine_with_it() {
        let mut detector = Detector::new(GRACE);
        let members = [(engine(1), Health::Alive), (sidecar(1), Health::Dead), (engine(0), Health::Alive)];
        assert_eq!(detector.decide(&members, Instant::now()), [engine(1), sidecar(1)]);
    }

    #[test]
    fn suspects_delay_the_fence_until_they_die_too_or_the_grace_ends() {
        let start = Instant::now();
        let mut detector = Detector::new(GRACE);
        let dying = [(engine(0), Health::Dead), (engine(1), Health::Suspect), (engine(2), Health::Alive)];
        assert!(detector.decide(&dying, start).is_empty(), "engine 1 may be dying too");
        let both = [(engine(0), Health::Dead), (engine(1), Health::Dead), (engine(2), Health::Alive)];
        assert_eq!(detector.decide(&both, start + GRACE / 2), [engine(0), engine(1)], "one epoch for both");
        // Another failure: a suspect that never dies delays it by the grace at most.
        assert!(detector.decide(&dying, start + GRACE).is_empty());
        assert!(detector.decide(&dying, start + GRACE + GRACE / 2).is_empty());
        assert_eq!(detector.decide(&dying, start + GRACE * 2), [engine(0)]);
    }

    #[test]
    fn spares_and_fenced_members_are_not_watched() {
        let mut detector = Detector::new(GRACE);
        let members = [
            ((Role::Engine, SPARE_MEMBERS), Health::Dead),
            ((Role::Sidecar, SPARE_MEMBERS + 3), Health::Dead),
            (engine(0), Health::Fenced),
            (sidecar(1), Health::Fenced),
            (engine(1), Health::Alive),
        ];
        assert!(detector.decide(&members, Instant::now()).is_empty());
        // A dead sidecar whose engine is already fenced: only the sidecar is new.
        let members = [(engine(3), Health::Fenced), (sidecar(3), Health::Dead)];
        assert_eq!(detector.decide(&members, Instant::now()), [sidecar(3)]);
        // A spare suspect does not hold up a stage's fence.
        let members = [(engine(0), Health::Dead), ((Role::Engine, SPARE_MEMBERS), Health::Suspect)];
        assert_eq!(detector.decide(&members, Instant::now()), [engine(0)]);
    }
}
