//! Which spare takes the place of which fenced member: the controller's assignment of spares,
//! decided from what its [`Liveness`] machine knows.
//!
//! Spares are members numbered from [`SPARE_MEMBERS`] that beat while they wait. A member of a
//! stage that was fenced and awaits its replacement gets the lowest-numbered live spare of its
//! role that is not spoken for, in the epoch of its fence. Only a spare this controller has heard
//! itself counts: a restarted controller counts the members it knew alive for a timeout, and a
//! spare that took a place just before the restart is silent as a spare, not alive. An assignment stands until:
//!
//! - the member's replacement beats (the spare, now beating as the member, or a process a
//!   supervisor started): done;
//! - the member is fenced again, in a newer epoch: the spare would start in a stale epoch, so the
//!   member gets a spare again in the new one;
//! - the spare dies before the shell has handed it over, the shell could not hand it over
//!   ([`Spares::failed`]), or, handed over ([`Spares::handed_over`]), it has not beaten as the
//!   member within a timeout: the member gets another spare, and that one is not tried again.
//!   (A spare handed over stops beating as a spare at once: its death as a spare then says
//!   nothing.)
//!
//! A spare is handed out once: a spare that took a member's place beats as that member from then
//! on, and its number stays silent.

use std::collections::{BTreeMap, BTreeSet};

use crate::liveness::{Health, Liveness, Member, Role, SPARE_MEMBERS};

/// A spare to hand over: `spare` becomes `member`, started in `epoch` (the member's fence's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Assignment {
    /// The spare.
    pub spare: Member,
    /// Whose place it takes.
    pub member: Member,
    /// The epoch it starts in as the member.
    pub epoch: u64,
}

/// The controller's spare assignments (see the module's documentation).
#[derive(Clone, Debug, Default)]
pub struct Spares {
    /// Each member's outstanding assignment, and when the shell handed its spare over.
    assigned: BTreeMap<Member, (Assignment, Option<u64>)>,
    /// Spares handed out, or that failed to take a place: never handed out again.
    used: BTreeSet<Member>,
}

impl Spares {
    /// No assignments yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The assignments still outstanding.
    pub fn outstanding(&self) -> impl Iterator<Item = &Assignment> {
        self.assigned.values().map(|(assignment, _)| assignment)
    }

    /// The new assignments at `now`, for members of `role`: the shell hands each spare over,
    /// and reports a failure with [`Spares::failed`].
    pub fn assign(&mut self, liveness: &Liveness, role: Role, now: u64) -> Vec<Assignment> {
        // Settle what stands: done, fenced again, or a spare that died waiting.
        let timeout = liveness.config().timeout_ms;
        self.assigned.retain(|&member, (assignment, handed_over)| {
            let membership = liveness.membership(member);
            let still_awaited = membership.is_some_and(|m| m.awaiting && m.fenced_in == assignment.epoch);
            let spare_in_time = match *handed_over {
                Some(at) => now.saturating_sub(at) < timeout,
                None => liveness.health(assignment.spare, now) != Health::Dead,
            };
            still_awaited && spare_in_time
        });
        let census = liveness.census(now);
        let free: Vec<Member> = census
            .iter()
            .filter(|&&((r, index), health)| {
                r == role
                    && index >= SPARE_MEMBERS
                    && health == Health::Alive
                    && liveness.heard_since_start((r, index))
                    && !self.used.contains(&(r, index))
            })
            .map(|&(spare, _)| spare)
            .collect();
        let mut free = free.into_iter();
        let mut new = Vec::new();
        for &(member, health) in &census {
            let (r, index) = member;
            if r != role || index >= SPARE_MEMBERS || health != Health::Fenced {
                continue;
            }
            if self.assigned.contains_key(&member) {
                continue;
            }
            let Some(epoch) = liveness.membership(member).map(|m| m.fenced_in) else { continue };
            let Some(spare) = free.next() else { break };
            let assignment = Assignment { spare, member, epoch };
            self.used.insert(spare);
            self.assigned.insert(member, (assignment, None));
            new.push(assignment);
        }
        new
    }

    /// The shell could not hand `assignment`'s spare over: the member gets another one at the
    /// next [`Spares::assign`].
    pub fn failed(&mut self, assignment: Assignment) {
        if self.assigned.get(&assignment.member).is_some_and(|(a, _)| *a == assignment) {
            self.assigned.remove(&assignment.member);
        }
    }

    /// The shell handed `assignment`'s spare over at `now` (it answered that it takes the
    /// place): its replacement must beat as the member within a timeout.
    pub fn handed_over(&mut self, assignment: Assignment, now: u64) {
        if let Some((a, at)) = self.assigned.get_mut(&assignment.member) {
            if *a == assignment {
                *at = Some(now);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::liveness::{Beat, LivenessConfig, Record};

    const CONFIG: LivenessConfig = LivenessConfig { timeout_ms: 300, grace_ms: 0 };

    fn beat(liveness: &mut Liveness, member: Member, epoch: u64, sequence: u64, now: u64) {
        liveness.heartbeat(Beat { member, epoch, sequence }, now);
    }

    #[test]
    fn a_fenced_sidecar_gets_the_lowest_live_spare_once_and_another_if_that_one_dies() {
        let mut liveness = Liveness::start(CONFIG, Record::default(), 0);
        let (stage0, stage1) = ((Role::Sidecar, 0), (Role::Sidecar, 1));
        let spares = [(Role::Sidecar, SPARE_MEMBERS), (Role::Sidecar, SPARE_MEMBERS + 1)];
        for member in [stage0, stage1, spares[0], spares[1], (Role::Engine, SPARE_MEMBERS)] {
            beat(&mut liveness, member, 0, 1, 0);
        }
        let mut machine = Spares::new();
        assert!(machine.assign(&liveness, Role::Sidecar, 10).is_empty(), "nobody is fenced");
        let epoch = liveness.fence(&[stage0], None, 10, |_| Ok::<_, ()>(())).unwrap();
        let first = machine.assign(&liveness, Role::Sidecar, 20);
        assert_eq!(first, vec![Assignment { spare: spares[0], member: stage0, epoch }]);
        assert!(machine.assign(&liveness, Role::Sidecar, 30).is_empty(), "assigned once");
        // The first spare dies before it takes the place: the second is assigned.
        beat(&mut liveness, spares[1], 0, 2, 200);
        beat(&mut liveness, stage1, 0, 2, 200);
        let second = machine.assign(&liveness, Role::Sidecar, 320);
        assert_eq!(second, vec![Assignment { spare: spares[1], member: stage0, epoch }]);
        // Handed over, the second stops beating as a spare: that says nothing until a timeout.
        machine.handed_over(second[0], 320);
        assert!(machine.assign(&liveness, Role::Sidecar, 619).is_empty());
        // It beats as stage 0 in the fence's epoch: done, nothing more to assign.
        beat(&mut liveness, stage0, epoch, 1, 619);
        assert!(machine.assign(&liveness, Role::Sidecar, 700).is_empty());
        assert_eq!(machine.outstanding().count(), 0);
    }

    #[test]
    fn a_failed_hand_over_or_a_newer_fence_assigns_again_and_spares_are_never_reused() {
        let mut liveness = Liveness::start(CONFIG, Record::default(), 0);
        let stage0 = (Role::Sidecar, 0);
        let spares: Vec<Member> = (0..3).map(|n| (Role::Sidecar, SPARE_MEMBERS + n)).collect();
        beat(&mut liveness, stage0, 0, 1, 0);
        for &spare in &spares {
            beat(&mut liveness, spare, 0, 1, 0);
        }
        let mut machine = Spares::new();
        let first = liveness.fence(&[stage0], None, 10, |_| Ok::<_, ()>(())).unwrap();
        let [a] = machine.assign(&liveness, Role::Sidecar, 10)[..] else { panic!() };
        machine.failed(a);
        let [b] = machine.assign(&liveness, Role::Sidecar, 20)[..] else { panic!() };
        assert_eq!((b.spare, b.epoch), (spares[1], first));
        // Fenced again before its spare beat as it: a spare of the new epoch.
        let second = liveness.fence(&[stage0], None, 30, |_| Ok::<_, ()>(())).unwrap();
        let [c] = machine.assign(&liveness, Role::Sidecar, 30)[..] else { panic!() };
        assert_eq!((c.spare, c.epoch), (spares[2], second));
        // No spare left: the member waits for a supervisor's replacement.
        machine.failed(c);
        assert!(machine.assign(&liveness, Role::Sidecar, 40).is_empty());
        assert!(machine.assign(&liveness, Role::Engine, 40).is_empty(), "engines are not sidecars' spares");
    }
}
