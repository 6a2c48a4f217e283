//! The running controller's liveness and fencing, as a state machine: who is alive, suspect, dead
//! or fenced; which heartbeats and lifelines count; when the dead are fenced, in which epoch; and
//! what a restarted controller keeps.
//!
//! `dejavud controller` is an I/O shell around [`Liveness`]: it turns heartbeat datagrams,
//! lifeline connections, fence queries and its clock into calls, writes the [`Record`] it is
//! handed before anything depends on it, and answers with what the machine decided. The
//! simulator (`dejavu-sim`, `liveness` module) drives the same machine through kills, pauses,
//! replays and controller restarts.
//!
//! Time is milliseconds on the shell's monotonic clock, passed with every call.
//!
//! The rules:
//!
//! - Every member beats with the epoch its process was started in. A fence opens a new epoch `e`
//!   in which its members are fenced: they await a replacement, and beats from processes started
//!   before `e` are stale from then on. The first beat of a process started in `e` or later
//!   ends the wait.
//! - A member's beat counts only if it is newer than the last one taken for it (epoch, then
//!   sequence number): an older one is a replay.
//! - A member is suspect once silent for half the timeout, dead once silent for the timeout, or
//!   at once when its current lifeline closes (a process that exits or is killed closes its
//!   sockets). Only a member's latest lifeline counts, and only from a process not fenced.
//! - The detector ([`Liveness::tick`]) fences the dead stage members (spares, from
//!   [`SPARE_MEMBERS`], are not watched). Suspects may hold the fence up by the grace, to beat
//!   again or die too, so that workers that failed together are fenced in one epoch; a dead
//!   sidecar takes its engine with it.
//! - Every fence is durable before it takes effect: the machine hands the shell the next
//!   [`Record`] and commits only once the shell has written it. A controller restarted from its
//!   record never hands out an epoch twice, keeps every fence, and gives every live member it
//!   knew a full timeout to beat.

use std::collections::{BTreeMap, BTreeSet};

mod journal;

pub use journal::{Divergence, Entry, Start};

/// Which kind of process a member of the cluster is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// A stage's engine.
    Engine = 0,
    /// A stage's sidecar.
    Sidecar = 1,
}

impl Role {
    /// The role of code `code` (its discriminant).
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(Self::Engine),
            1 => Some(Self::Sidecar),
            _ => None,
        }
    }
}

/// A process of the cluster, as the controller knows it: its role and its stage (or spare number).
pub type Member = (Role, u32);

/// Added to a spare's number to make its member index: spares beat as (engine or sidecar, this
/// plus their number), apart from every stage.
pub const SPARE_MEMBERS: u32 = 1 << 20;

/// What the controller says of a member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    /// Beat within half the timeout.
    Alive = 0,
    /// Silent for half the timeout or more: perhaps dying.
    Suspect = 1,
    /// Silent for the timeout, never heard from, or its lifeline broke.
    Dead = 2,
    /// Fenced, and no replacement has beaten since: a recovery's victim.
    Fenced = 3,
}

impl Health {
    /// The health of code `code` (its discriminant).
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(Self::Alive),
            1 => Some(Self::Suspect),
            2 => Some(Self::Dead),
            3 => Some(Self::Fenced),
            _ => None,
        }
    }
}

/// What the controller keeps of a member across its restarts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Membership {
    /// The epoch of its last fence (0: never fenced): only processes started in it or later
    /// count for the member.
    pub fenced_in: u64,
    /// Whether it was fenced and no replacement has beaten since.
    pub awaiting: bool,
}

/// What survives a controller crash (the shell writes it whole, durably).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Record {
    /// The last epoch handed out (0: none yet).
    pub epoch: u64,
    /// How many controllers have run on this record, this one included.
    pub incarnation: u64,
    /// Every member heard from.
    pub members: BTreeMap<Member, Membership>,
    /// Stages whose replaced sidecar the controller restores itself and has not restored yet
    /// ([`Liveness::restore_begun`]): a controller restarted, or a new leader, restores them.
    pub restoring: BTreeSet<u32>,
}

/// A heartbeat, as the shell read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Beat {
    /// Who beats.
    pub member: Member,
    /// The epoch its process was started in.
    pub epoch: u64,
    /// Its sequence number: later beats of a process number higher.
    pub sequence: u64,
}

/// What became of a heartbeat.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Heard {
    /// Taken. `first_of_process` when it is the first from a new member or from a fenced
    /// member's replacement: the record changed, and the shell must write it
    /// ([`Liveness::unwritten_record`]). `fenced_for_ms`: for a replacement, how long after the
    /// fence.
    Taken {
        /// The record changed.
        first_of_process: bool,
        /// How long the member awaited this replacement, if this controller fenced it.
        fenced_for_ms: Option<u64>,
        /// Milliseconds since the member's previous beat, if any.
        gap_ms: Option<u64>,
    },
    /// From a process started before the member's last fence: ignored.
    Stale,
    /// No newer than the last beat taken for the member: ignored.
    Replay,
}

/// Why a lifeline is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LifelineRefused {
    /// The process was started before the member's last fence.
    Stale {
        /// The epoch the process was started in.
        epoch: u64,
        /// The epoch the member was fenced in since.
        fenced_in: u64,
    },
    /// Another process of the same epoch holds the member's lifeline: two processes claim one
    /// place (a second sidecar started for the same stage, say). The holder keeps it; a process
    /// that replaces a dead one waits for the dead one's lifeline to close.
    Claimed {
        /// The epoch both were started in.
        epoch: u64,
        /// The holder's process.
        by: u32,
    },
}

/// A member's current lifeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    number: u64,
    epoch: u64,
    process: u32,
}

/// A fence the machine decided or was asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fence {
    /// Its epoch.
    pub epoch: u64,
    /// The members fenced in it.
    pub members: Vec<Member>,
}

/// Settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LivenessConfig {
    /// Silence after which a member is dead, in milliseconds.
    pub timeout_ms: u64,
    /// How long suspects may hold up the fence of the dead, in milliseconds.
    pub grace_ms: u64,
}

/// The controller's liveness and fencing state machine.
#[derive(Clone, Debug)]
pub struct Liveness {
    config: LivenessConfig,
    record: Record,
    /// When each member was last heard from.
    seen: BTreeMap<Member, u64>,
    /// The last beat taken for each member (epoch, sequence): an older one is a replay.
    last_beats: BTreeMap<Member, (u64, u64)>,
    /// When each member awaiting a replacement was fenced (by this controller).
    fenced_at: BTreeMap<Member, u64>,
    /// Each member's current lifeline: its number, and the epoch and process of its holder.
    lifelines: BTreeMap<Member, Held>,
    /// Members whose current lifeline closed: dead, until a new process of theirs holds one or
    /// they are fenced.
    severed: BTreeMap<Member, u64>,
    next_lifeline: u64,
    /// When the first member of the failure being decided was seen dead.
    first_dead: Option<u64>,
    /// Whether the record changed since the shell last wrote it.
    unwritten: bool,
    /// Every call and its answer since the start, if journaled ([`Liveness::start_journaled`]),
    /// until drained.
    journal: Option<Vec<Entry>>,
}

impl Liveness {
    /// A controller starting at `now` from `record` (the default for a fresh cluster): it counts
    /// itself as one more incarnation, and every live member it knew gets a full timeout from
    /// `now`. The shell must write the record ([`Liveness::unwritten_record`]) before it answers
    /// anyone.
    pub fn start(config: LivenessConfig, mut record: Record, now: u64) -> Self {
        record.incarnation += 1;
        let seen =
            record.members.iter().filter(|(_, m)| !m.awaiting).map(|(&member, _)| (member, now)).collect();
        Self {
            config,
            record,
            seen,
            last_beats: BTreeMap::new(),
            fenced_at: BTreeMap::new(),
            lifelines: BTreeMap::new(),
            severed: BTreeMap::new(),
            next_lifeline: 1,
            first_dead: None,
            unwritten: true,
            journal: None,
        }
    }

    /// As [`Liveness::start`], keeping a journal of every call that can change the machine and
    /// its answer ([`Liveness::drain_journal`]), which replays through a machine started from the
    /// returned [`Start`].
    pub fn start_journaled(config: LivenessConfig, record: Record, now: u64) -> (Self, Start) {
        let start = Start { config, record: record.clone(), now };
        let mut liveness = Self::start(config, record, now);
        liveness.journal = Some(Vec::new());
        (liveness, start)
    }

    /// The journal's entries since the last drain (none if not journaled).
    pub fn drain_journal(&mut self) -> Vec<Entry> {
        self.journal.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn log(&mut self, entry: impl FnOnce() -> Entry) {
        if let Some(journal) = self.journal.as_mut() {
            journal.push(entry());
        }
    }

    /// The record, if it changed since the shell last wrote it (a member joined, a replacement
    /// beat, the controller started): the shell writes it, then says so with
    /// [`Liveness::record_written`], or tries again later. A member the record lacks is unknown
    /// to a controller restarted from it.
    pub fn unwritten_record(&self) -> Option<&Record> {
        self.unwritten.then_some(&self.record)
    }

    /// The shell wrote the record it was handed by [`Liveness::unwritten_record`].
    pub fn record_written(&mut self) {
        self.unwritten = false;
        self.log(|| Entry::RecordWritten);
    }

    /// What the shell keeps durable.
    pub fn record(&self) -> &Record {
        &self.record
    }

    /// The last epoch handed out.
    pub fn epoch(&self) -> u64 {
        self.record.epoch
    }

    /// The settings.
    pub fn config(&self) -> LivenessConfig {
        self.config
    }

    /// The controller begins restoring stage `stage`'s replaced sidecar: the record keeps it
    /// until [`Liveness::restore_done`], so that a controller restarted meanwhile (or a new
    /// leader) finishes it. The shell writes the record before it starts.
    pub fn restore_begun(&mut self, stage: u32) {
        self.unwritten |= self.record.restoring.insert(stage);
    }

    /// Stage `stage`'s replaced sidecar is restored.
    pub fn restore_done(&mut self, stage: u32) {
        self.unwritten |= self.record.restoring.remove(&stage);
    }

    /// The stages whose replaced sidecar awaits its restore.
    pub fn restores_pending(&self) -> impl Iterator<Item = u32> + '_ {
        self.record.restoring.iter().copied()
    }

    /// What the controller knows of `member`.
    pub fn membership(&self, member: Member) -> Option<Membership> {
        self.record.members.get(&member).copied()
    }

    /// Whether this controller has taken a beat of `member` since it started (a restarted one
    /// counts the members it knew alive for a timeout without having heard them).
    pub fn heard_since_start(&self, member: Member) -> bool {
        self.last_beats.contains_key(&member)
    }

    /// Lifelines held now.
    pub fn lifelines_held(&self) -> usize {
        self.lifelines.len()
    }

    /// The health of `member` at `now`.
    pub fn health(&self, member: Member, now: u64) -> Health {
        if self.record.members.get(&member).is_some_and(|m| m.awaiting) {
            return Health::Fenced;
        }
        if self.severed.contains_key(&member) {
            return Health::Dead;
        }
        match self.seen.get(&member) {
            None => Health::Dead,
            Some(&at) if now.saturating_sub(at) >= self.config.timeout_ms => Health::Dead,
            Some(&at) if 2 * now.saturating_sub(at) >= self.config.timeout_ms => Health::Suspect,
            Some(_) => Health::Alive,
        }
    }

    /// Every member the controller knows, and its health at `now`.
    pub fn census(&self, now: u64) -> Vec<(Member, Health)> {
        self.record.members.keys().map(|&member| (member, self.health(member, now))).collect()
    }

    /// Takes in a heartbeat that arrived at `now`.
    pub fn heartbeat(&mut self, beat: Beat, now: u64) -> Heard {
        let heard = self.take_heartbeat(beat, now);
        self.log(|| Entry::Heartbeat { beat, now, heard });
        heard
    }

    fn take_heartbeat(&mut self, beat: Beat, now: u64) -> Heard {
        let Beat { member, epoch, sequence } = beat;
        let known = self.record.members.get(&member).copied();
        if known.is_some_and(|m| epoch < m.fenced_in) {
            return Heard::Stale;
        }
        if self.last_beats.get(&member).is_some_and(|&last| (epoch, sequence) <= last) {
            return Heard::Replay;
        }
        self.last_beats.insert(member, (epoch, sequence));
        let gap_ms = self.seen.insert(member, now).map(|previous| now.saturating_sub(previous));
        let fenced_for_ms = self.fenced_at.remove(&member).map(|at| now.saturating_sub(at));
        let first_of_process = match known {
            Some(m) if !m.awaiting => false,
            _ => {
                let fenced_in = known.map_or(0, |m| m.fenced_in);
                self.record.members.insert(member, Membership { fenced_in, awaiting: false });
                self.unwritten = true;
                true
            }
        };
        Heard::Taken { first_of_process, fenced_for_ms, gap_ms }
    }

    /// `member`'s process `process`, started in `epoch`, holds a lifeline from now on; returns its
    /// number, now the member's current one (the end of an older one says nothing any more). A
    /// process fenced since it started is refused, and so is a second process of the same epoch
    /// while the first holds the member's lifeline (unless the member awaits its replacement); the
    /// same process opening it again (its connection broke) and a process of a newer epoch (a
    /// replacement) take it over.
    pub fn lifeline_opened(
        &mut self,
        member: Member,
        epoch: u64,
        process: u32,
    ) -> Result<u64, LifelineRefused> {
        let known = self.record.members.get(&member);
        let fenced = known.filter(|m| epoch < m.fenced_in);
        // While the member awaits its replacement, whoever drives the pipeline may start another
        // (the last one never beat): the newest takes the lifeline over.
        let awaiting = known.is_some_and(|m| m.awaiting);
        let holder =
            self.lifelines.get(&member).filter(|h| h.epoch == epoch && h.process != process && !awaiting);
        let result = match (fenced, holder) {
            (Some(m), _) => Err(LifelineRefused::Stale { epoch, fenced_in: m.fenced_in }),
            (None, Some(h)) => Err(LifelineRefused::Claimed { epoch, by: h.process }),
            (None, None) => {
                let number = self.next_lifeline;
                self.next_lifeline += 1;
                self.lifelines.insert(member, Held { number, epoch, process });
                self.severed.remove(&member);
                Ok(number)
            }
        };
        self.log(|| Entry::LifelineOpened { member, epoch, process, result });
        result
    }

    /// Lifeline `number` of `member` closed at `now`; returns whether it was the member's
    /// current one (the member is then dead, and the detector should run soon).
    pub fn lifeline_closed(&mut self, member: Member, number: u64, now: u64) -> bool {
        let current = self.lifelines.get(&member).is_some_and(|h| h.number == number);
        if current {
            self.lifelines.remove(&member);
            self.severed.insert(member, now);
        }
        self.log(|| Entry::LifelineClosed { member, number, now, current });
        current
    }

    /// Fences `members` in a new epoch, written with `persist` before it takes effect; returns
    /// the epoch. With `reuse` (the lowest epoch acceptable), members that all await their
    /// replacements from a fence in the current epoch, at least that one, are fenced already:
    /// that epoch is returned and none opened. If `persist` fails, nothing changes.
    pub fn fence<E>(
        &mut self,
        members: &[Member],
        reuse: Option<u64>,
        now: u64,
        persist: impl FnOnce(&Record) -> Result<(), E>,
    ) -> Result<u64, E> {
        let result = self.fence_with(members, reuse, now, persist);
        let (written, epoch) = (result.is_ok(), result.as_ref().ok().copied());
        self.log(|| Entry::Fence { members: members.to_vec(), reuse, now, written, epoch });
        result
    }

    fn fence_with<E>(
        &mut self,
        members: &[Member],
        reuse: Option<u64>,
        now: u64,
        persist: impl FnOnce(&Record) -> Result<(), E>,
    ) -> Result<u64, E> {
        let current = |member: &Member| {
            let m = self.record.members.get(member);
            m.is_some_and(|m| m.awaiting && m.fenced_in == self.record.epoch)
        };
        if reuse.is_some_and(|lowest| self.record.epoch >= lowest)
            && !members.is_empty()
            && members.iter().all(current)
        {
            return Ok(self.record.epoch);
        }
        let mut next = self.record.clone();
        next.epoch += 1;
        for &member in members {
            next.members.insert(member, Membership { fenced_in: next.epoch, awaiting: true });
        }
        persist(&next)?;
        self.unwritten = false;
        for member in members {
            self.seen.remove(member);
            self.fenced_at.insert(*member, now);
            // The fenced process's beats are stale from now on: the replacement's are the only
            // ones taken, whatever they number; its lifeline is no longer the member's.
            self.last_beats.remove(member);
            self.lifelines.remove(member);
            self.severed.remove(member);
        }
        self.record = next;
        Ok(self.record.epoch)
    }

    /// The detector, run at `now`: the members to fence (empty: none yet). The shell fences them
    /// with [`Liveness::fence`].
    pub fn tick(&mut self, now: u64) -> Vec<Member> {
        let dead = self.detect(now);
        self.log(|| Entry::Tick { now, dead: dead.clone() });
        dead
    }

    fn detect(&mut self, now: u64) -> Vec<Member> {
        let census = self.census(now);
        let watched = || census.iter().filter(|&&((_, index), _)| index < SPARE_MEMBERS);
        let mut dead: Vec<Member> =
            watched().filter(|&&(_, health)| health == Health::Dead).map(|&(member, _)| member).collect();
        if dead.is_empty() {
            self.first_dead = None;
            return dead;
        }
        let since = *self.first_dead.get_or_insert(now);
        let dying = watched().any(|&(_, health)| health == Health::Suspect);
        if dying && now.saturating_sub(since) < self.config.grace_ms {
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

    /// The next time at which a member's health changes by the clock alone (a suspect, a death,
    /// the end of a grace), if any: the shell need not run the detector before it.
    pub fn poll_timeout(&self, now: u64) -> Option<u64> {
        let timeout = self.config.timeout_ms;
        let live = self.seen.iter().filter(|(member, _)| {
            !self.severed.contains_key(member) && !self.record.members.get(member).is_some_and(|m| m.awaiting)
        });
        let changes = live.flat_map(|(_, &at)| [at + timeout.div_ceil(2), at + timeout]);
        let grace = self.first_dead.map(|since| since + self.config.grace_ms);
        changes.chain(grace).filter(|&at| at > now).min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: LivenessConfig = LivenessConfig { timeout_ms: 400, grace_ms: 400 };

    fn engine(i: u32) -> Member {
        (Role::Engine, i)
    }

    fn sidecar(i: u32) -> Member {
        (Role::Sidecar, i)
    }

    fn beat(member: Member, epoch: u64, sequence: u64) -> Beat {
        Beat { member, epoch, sequence }
    }

    fn durable(_: &Record) -> Result<(), ()> {
        Ok(())
    }

    fn live(members: &[Member]) -> Liveness {
        let mut l = Liveness::start(CONFIG, Record::default(), 0);
        for &m in members {
            assert!(matches!(l.heartbeat(beat(m, 0, 1), 0), Heard::Taken { first_of_process: true, .. }));
        }
        l
    }

    #[test]
    fn health_follows_silence_and_lifelines() {
        let mut l = live(&[engine(0), engine(1)]);
        assert_eq!(l.health(engine(0), 199), Health::Alive);
        assert_eq!(l.health(engine(0), 200), Health::Suspect);
        assert_eq!(l.health(engine(0), 400), Health::Dead);
        assert_eq!(l.health(engine(9), 0), Health::Dead, "never heard of");
        let number = l.lifeline_opened(engine(1), 0, 1).unwrap();
        assert!(l.lifeline_closed(engine(1), number, 10));
        assert_eq!(l.health(engine(1), 10), Health::Dead, "its lifeline broke");
        assert!(!l.lifeline_closed(engine(1), number, 11), "no longer its lifeline");
        assert_eq!(l.poll_timeout(10), Some(200));
    }

    #[test]
    fn a_second_process_of_the_same_epoch_cannot_take_a_held_lifeline() {
        let mut l = live(&[sidecar(0)]);
        let first = l.lifeline_opened(sidecar(0), 0, 100).unwrap();
        assert_eq!(
            l.lifeline_opened(sidecar(0), 0, 200),
            Err(LifelineRefused::Claimed { epoch: 0, by: 100 })
        );
        let again = l.lifeline_opened(sidecar(0), 0, 100).unwrap();
        assert!(!l.lifeline_closed(sidecar(0), first, 5), "the holder's connection opened again");
        assert!(l.lifeline_closed(sidecar(0), again, 6), "the holder died");
        // Its lifeline gone, another process takes the place; a newer epoch's takes it over.
        assert!(l.lifeline_opened(sidecar(0), 0, 200).is_ok());
        assert!(l.lifeline_opened(sidecar(0), 1, 300).is_ok(), "a replacement");
    }

    #[test]
    fn fenced_processes_are_stale_and_replays_are_refused() {
        let mut l = live(&[engine(0)]);
        assert_eq!(l.heartbeat(beat(engine(0), 0, 1), 5), Heard::Replay);
        assert_eq!(l.fence(&[engine(0)], None, 10, durable), Ok(1));
        assert_eq!(l.health(engine(0), 10), Health::Fenced);
        assert_eq!(l.heartbeat(beat(engine(0), 0, 99), 20), Heard::Stale);
        assert_eq!(
            l.lifeline_opened(engine(0), 0, 7),
            Err(LifelineRefused::Stale { epoch: 0, fenced_in: 1 })
        );
        let heard = l.heartbeat(beat(engine(0), 1, 1), 30);
        assert_eq!(heard, Heard::Taken { first_of_process: true, fenced_for_ms: Some(20), gap_ms: None });
        assert_eq!(l.health(engine(0), 30), Health::Alive);
    }

    #[test]
    fn a_fence_that_cannot_be_written_changes_nothing_and_a_retry_reuses_the_epoch() {
        let mut l = live(&[engine(0), engine(1)]);
        assert_eq!(l.fence(&[engine(0)], None, 10, |_| Err("disk full")), Err("disk full"));
        assert_eq!(l.epoch(), 0);
        assert_eq!(l.health(engine(0), 10), Health::Alive);
        assert_eq!(l.fence(&[engine(0)], Some(0), 10, durable), Ok(1));
        assert_eq!(l.fence(&[engine(0)], Some(1), 20, durable), Ok(1), "fenced already");
        assert_eq!(l.fence(&[engine(0)], Some(2), 20, durable), Ok(2), "a newer one asked for");
        assert_eq!(l.fence(&[engine(0), engine(1)], Some(0), 20, durable), Ok(3), "not all of them");
    }

    #[test]
    fn the_detector_groups_failures_and_takes_a_dead_sidecars_engine() {
        let mut l = live(&[engine(0), sidecar(0), engine(1), sidecar(1), engine(2)]);
        for m in [engine(1), sidecar(1), engine(2)] {
            l.heartbeat(beat(m, 0, 2), 250);
        }
        // Engine 0 and sidecar 0 are dead at 400, engine 1 (beat at 250) is not suspect yet.
        assert_eq!(l.tick(400), [engine(0), sidecar(0)]);
        let mut l = live(&[engine(0), engine(1), sidecar(1)]);
        l.heartbeat(beat(engine(1), 0, 2), 100);
        l.heartbeat(beat(sidecar(1), 0, 2), 399);
        // Engine 0 is dead at 400 and engine 1 is suspect: the fence waits for it.
        assert!(l.tick(400).is_empty());
        assert_eq!(l.poll_timeout(400), Some(500), "engine 1 dies at 500");
        assert_eq!(l.tick(500), [engine(0), engine(1)], "one epoch for both");
        // A sidecar whose lifeline breaks takes its engine, once the suspects are settled.
        let mut l = live(&[engine(0), sidecar(0)]);
        let n0 = l.lifeline_opened(sidecar(0), 0, 2).unwrap();
        l.lifeline_closed(sidecar(0), n0, 50);
        assert_eq!(l.tick(50), [engine(0), sidecar(0)]);
    }

    #[test]
    fn spares_are_not_watched_and_the_grace_is_bounded() {
        let spare = (Role::Engine, SPARE_MEMBERS + 1);
        let mut l = live(&[engine(0), engine(1), spare]);
        l.heartbeat(beat(engine(1), 0, 2), 300);
        assert!(l.tick(500).is_empty(), "engine 1, suspect, holds engine 0's fence up");
        // Engine 1 stays suspect without dying: it holds the fence up for the grace at most.
        l.heartbeat(beat(engine(1), 0, 3), 550);
        assert!(l.tick(800).is_empty());
        assert_eq!(l.poll_timeout(800), Some(900), "the grace ends at 900");
        assert_eq!(l.tick(900), [engine(0)], "the dead spare is not fenced");
    }

    #[test]
    fn the_record_is_unwritten_until_the_shell_writes_it() {
        let mut l = Liveness::start(CONFIG, Record::default(), 0);
        assert_eq!(l.unwritten_record().map(|r| r.incarnation), Some(1), "a start changes it");
        l.record_written();
        assert!(matches!(l.heartbeat(beat(engine(0), 0, 1), 1), Heard::Taken { first_of_process: true, .. }));
        // The shell could not write it: it stays unwritten, whatever comes next.
        assert!(l.unwritten_record().is_some_and(|r| r.members.contains_key(&engine(0))));
        l.heartbeat(beat(engine(0), 0, 2), 2);
        assert!(l.unwritten_record().is_some(), "still to be written");
        l.record_written();
        l.heartbeat(beat(engine(0), 0, 3), 3);
        assert!(l.unwritten_record().is_none(), "nothing new");
        l.fence(&[engine(0)], None, 4, durable).unwrap();
        assert!(l.unwritten_record().is_none(), "a fence writes it whole");
    }

    #[test]
    fn a_journal_survives_its_text_and_replays_to_the_same_answers() {
        let (mut l, start) = Liveness::start_journaled(CONFIG, Record::default(), 0);
        l.record_written();
        l.heartbeat(beat(engine(0), 0, 1), 1);
        l.heartbeat(beat(sidecar(0), 0, 1), 1);
        l.heartbeat(beat(sidecar(0), 0, 1), 2);
        let n = l.lifeline_opened(sidecar(0), 0, 2).unwrap();
        l.lifeline_closed(sidecar(0), n, 30);
        let dead = l.tick(30);
        assert_eq!(l.fence(&dead, None, 31, |_| Err("disk full")), Err("disk full"));
        l.fence(&dead, None, 32, durable).unwrap();
        l.heartbeat(beat(engine(0), 0, 9), 40);
        let _ = l.lifeline_opened(engine(0), 0, 1);
        l.heartbeat(beat(engine(0), 1, 1), 41);
        let entries = l.drain_journal();
        assert_eq!(entries.len(), 12);
        let start = Start::parse(&start.encode()).unwrap();
        let mut replayed = Liveness::start(start.config, start.record, start.now);
        for entry in entries {
            let parsed = Entry::parse(&entry.encode()).unwrap();
            assert_eq!(parsed, entry, "{}", entry.encode());
            assert_eq!(replayed.replay(&parsed), entry);
        }
        assert_eq!(replayed.record(), l.record());
        assert!(l.drain_journal().is_empty(), "drained");
        for garbage in ["", "beat engine:0 1 2", "fence gpu:1 - 3 1 -> 2", "tick x -> -", "start 1 2"] {
            assert!(Entry::parse(garbage).is_err() && Start::parse(garbage).is_err(), "{garbage:?}");
        }
    }

    #[test]
    fn a_restarted_controller_keeps_epochs_and_fences_and_gives_members_a_timeout() {
        let mut l = live(&[engine(0), engine(1)]);
        l.fence(&[engine(0)], None, 10, durable).unwrap();
        let record = l.record().clone();
        let mut restarted = Liveness::start(CONFIG, record, 5_000);
        assert_eq!(restarted.record().incarnation, 2);
        assert_eq!(restarted.health(engine(0), 5_000), Health::Fenced);
        assert_eq!(restarted.health(engine(1), 5_000), Health::Alive, "a full timeout from the restart");
        assert_eq!(restarted.heartbeat(beat(engine(0), 0, 7), 5_001), Heard::Stale);
        assert_eq!(restarted.fence(&[engine(1)], None, 5_002, durable), Ok(2), "no epoch twice");
    }
}
