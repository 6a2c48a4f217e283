//! The running controller's machine ([`dejavu_proto::Controller`]: its liveness and its spares)
//! under faults, in virtual milliseconds: the machine `dejavud controller` runs, driven as its
//! shell drives it.
//!
//! Every stage has an engine and a sidecar process, and there are spares; each beats every
//! interval with some jitter and holds a lifeline. Beats are lost, delayed (and so reordered) and
//! replayed; processes are killed (their lifeline closes a little later), whole workers are killed
//! at once, processes pause for shorter or longer than the timeout, the state file cannot be
//! written for a while, and the controller crashes and restarts from its record. Whoever drives
//! the pipeline replaces each fenced member with a process started in the fence's epoch, sometimes
//! leaving the old one running (a machine cut off that could not be killed). The detector runs at
//! the machine's `poll_timeout`, and shortly after a lifeline closes, as the shell runs it.
//!
//! Invariants, checked as the run goes:
//! - epochs only grow, and no epoch is handed out twice, across controller restarts;
//! - no beat of a process started before its member's fence is ever taken;
//! - no member is fenced while its process lives, runs and its beats arrive within the timeout
//!   (but the engine of a fenced sidecar), and spares are never fenced;
//! - a fenced sidecar takes its engine into the same epoch, if the engine was not fenced already;
//! - every stage member whose process died (once a beat of it was taken, by this controller or
//!   one whose record this controller started from) is fenced within the
//!   timeout, the grace, the delays and the settling time, counted from its death, the
//!   controller's restart, or the last beat of it the controller took (a replay a restarted
//!   controller cannot tell from a beat);
//! - a replacement's first beat ends the member's wait;
//! - a fence that could not be written changes nothing.
//!
//! With [`LivenessSimConfig::leadership`], the record is kept as on etcd (`controller --etcd`):
//! several controllers, one leading, every write guarded by the writer's leadership. A leader that
//! is killed, or paused past its lease, is followed by another, started from the record once the
//! lease has lapsed; the paused one comes back later, with its own view of the cluster, and its
//! shell goes on as after any wait until it finds it no longer leads. Further invariants:
//! - a deposed leader writes nothing and hands no spare over (its shell confirms its leadership,
//!   a guarded write, before it tells a spare);
//! - the writes that reach the store come from leaders in the order they led: no write of an
//!   earlier leader after a later one's.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

use dejavu_proto::liveness::{
    Beat, Divergence, Entry, Health, Heard, LifelineRefused, Liveness, LivenessConfig, Member, Record, Role,
    Start, SPARE_MEMBERS,
};

use dejavu_proto::rng::SplitMix64;
use dejavu_proto::spares::Assignment;
use dejavu_proto::Controller;

/// The shape and fault rates of a liveness run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LivenessSimConfig {
    /// Stages (each an engine and a sidecar).
    pub stages: u32,
    /// Spare workers (each an engine and a sidecar).
    pub spares: u32,
    /// Heartbeat interval, ms.
    pub interval: u64,
    /// Failure timeout, ms.
    pub timeout: u64,
    /// Longest delivery delay of a beat or a lifeline's end, ms.
    pub max_delay: u64,
    /// A beat is lost.
    pub drop: f64,
    /// A beat is delivered again later (a replay).
    pub replay: f64,
    /// Faults injected over the run, each at a random time.
    pub faults: u32,
    /// Milliseconds of chaos; the run goes on as long again without new faults.
    pub chaos_ms: u64,
    /// Whether the record is kept as on etcd, by several controllers of which one leads (see
    /// the module's documentation); otherwise one controller keeps it in its state file.
    pub leadership: bool,
    /// With `leadership`: how long a leader that stopped renewing its lease still holds it, ms.
    pub lease: u64,
}

impl Default for LivenessSimConfig {
    fn default() -> Self {
        Self {
            stages: 4,
            spares: 1,
            interval: 10,
            timeout: 40,
            max_delay: 5,
            drop: 0.02,
            replay: 0.02,
            faults: 12,
            chaos_ms: 3_000,
            leadership: false,
            lease: 100,
        }
    }
}

impl LivenessSimConfig {
    /// A shape and rates drawn from `seed`.
    pub fn varied(seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed ^ 0x11fe_11fe_0000_0000);
        let pick = |rng: &mut SplitMix64, options: &[u64]| options[rng.below(options.len() as u64) as usize];
        let interval = pick(&mut rng, &[5, 10, 20]);
        Self {
            stages: pick(&mut rng, &[1, 2, 4, 6]) as u32,
            spares: pick(&mut rng, &[0, 1, 2]) as u32,
            interval,
            timeout: interval * pick(&mut rng, &[3, 4, 8]),
            max_delay: pick(&mut rng, &[0, 2, 5, 15]),
            drop: [0.0, 0.02, 0.1][rng.below(3) as usize],
            faults: pick(&mut rng, &[4, 12, 30]) as u32,
            ..Self::default()
        }
    }

    /// As `self`, the record kept as on etcd, with a lease drawn from `seed`.
    pub fn on_etcd(self, seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed ^ 0x1ead_e125_0000_0000);
        let lease = self.timeout * [1, 2, 4][rng.below(3) as usize];
        Self { leadership: true, lease, ..self }
    }
}

/// What a liveness run found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LivenessReport {
    /// Invariants broken, in order.
    pub violations: Vec<String>,
    /// Fences the controller made.
    pub fences: u32,
    /// Faults injected, by class.
    pub faults: BTreeMap<&'static str, u32>,
}

/// Time the shell's detector waits, after a lifeline closes, for others to close.
const SETTLE: u64 = 2;
/// How long after a failed write the shell tries a fence again.
const FENCE_RETRY: u64 = 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// Process `p`'s beat timer.
    Beat(usize),
    /// A beat reaches the controller.
    Deliver(Beat),
    /// Process `p`'s lifeline (number `n` of controller incarnation `i`) ends at the controller.
    LifelineEnds { process: usize, number: u64, incarnation: u64 },
    /// The detector runs (generation `g`: only the latest scheduled counts, or a forced one).
    Detect { generation: u64 },
    /// The `n`th fault of the run.
    Fault(u32),
    /// A paused process `p` goes on.
    Resume(usize),
    /// The controller comes back (with `leadership`: the next leader takes over).
    ControllerStarts,
    /// A deposed leader's shell runs its detector, as after any wait (it was paused).
    StaleDetect,
    /// The state file can be written again.
    DiskHeals,
    /// Whoever drives the pipeline replaces `member`'s fenced process.
    Replace(Member),
    /// The controller's shell hands spare `spare` over to take `member`'s place in `epoch`.
    TakeUp { spare: Member, member: Member, epoch: u64 },
}

#[derive(Clone, Debug)]
struct Process {
    member: Member,
    epoch: u64,
    sequence: u64,
    alive: bool,
    died_at: Option<u64>,
    paused: bool,
    /// Whether the controller has taken a beat of it (it is watched from then on).
    taken: bool,
    /// Its lifeline: the number and the controller incarnation that gave it.
    lifeline: Option<(u64, u64)>,
}

/// One seeded run.
struct LivenessSim {
    cfg: LivenessSimConfig,
    rng: SplitMix64,
    now: u64,
    queue: BinaryHeap<Reverse<(u64, u64, Event)>>,
    order: u64,
    processes: Vec<Process>,
    current: BTreeMap<Member, usize>,
    controller: Option<Controller>,
    incarnation: u64,
    /// The controller incarnation whose writes the store takes: the leader's (with a state
    /// file, the one controller's); 0 while none leads.
    leader: u64,
    /// The incarnation of the last write the store took.
    last_writer: u64,
    /// A leader paused past its lease, with its incarnation, while another leads.
    stale: Option<(Controller, u64)>,
    started_at: u64,
    /// The members named in the record the controller started from.
    started_from: Vec<Member>,
    disk: Record,
    disk_broken: bool,
    last_failed_write: Option<u64>,
    detect_generation: u64,
    /// When a beat of each member was last taken (this controller's incarnation).
    last_taken: BTreeMap<Member, u64>,
    highest_epoch: u64,
    replacing: BTreeMap<Member, u64>,
    /// Spares handed out by this controller: never handed out twice by one controller.
    spares_used: BTreeSet<Member>,
    /// Spares that took a place, with their process's last beat then: never handed out again by
    /// any controller, but one that took a beat sent before (a replay, which a controller that
    /// never saw the original cannot tell from a beat). The spare then refuses the place, having
    /// taken one (its sidecar's [`dejavu_proto::Worker`] takes up one place only).
    spares_gone: BTreeMap<Member, u64>,
    /// The newest beat of each member this controller took.
    newest_taken: BTreeMap<Member, u64>,
    report: LivenessReport,
    /// Prints every event (`DEJAVU_SIM_TRACE=1`).
    trace: bool,
}

/// Runs liveness seed `seed` with `cfg`.
pub fn run_liveness_seed(seed: u64, cfg: &LivenessSimConfig) -> LivenessReport {
    LivenessSim::new(seed, *cfg).run()
}

impl LivenessSim {
    fn new(seed: u64, cfg: LivenessSimConfig) -> Self {
        let mut sim = Self {
            cfg,
            rng: SplitMix64::new(seed),
            now: 0,
            queue: BinaryHeap::new(),
            order: 0,
            processes: Vec::new(),
            current: BTreeMap::new(),
            controller: None,
            incarnation: 0,
            leader: 0,
            last_writer: 0,
            stale: None,
            started_at: 0,
            started_from: Vec::new(),
            disk: Record::default(),
            disk_broken: false,
            last_failed_write: None,
            detect_generation: 0,
            last_taken: BTreeMap::new(),
            highest_epoch: 0,
            replacing: BTreeMap::new(),
            spares_used: BTreeSet::new(),
            spares_gone: BTreeMap::new(),
            newest_taken: BTreeMap::new(),
            report: LivenessReport::default(),
            trace: std::env::var_os("DEJAVU_SIM_TRACE").is_some(),
        };
        sim.start_controller();
        let indices = (0..cfg.stages).chain((0..cfg.spares).map(|n| SPARE_MEMBERS + n));
        for index in indices.collect::<Vec<_>>() {
            for role in [Role::Engine, Role::Sidecar] {
                sim.spawn((role, index), 0);
            }
        }
        for n in 0..cfg.faults {
            let at = 1 + sim.rng.below(cfg.chaos_ms);
            sim.schedule(at, Event::Fault(n));
        }
        sim
    }

    fn run(mut self) -> LivenessReport {
        let end = 2 * self.cfg.chaos_ms;
        while let Some(Reverse((at, _, event))) = self.queue.pop() {
            if at > end {
                break;
            }
            self.now = at;
            if self.trace && !matches!(event, Event::Beat(_)) {
                println!("{at:>6} {event:?}");
            }
            self.handle(event);
            self.check_deaths();
        }
        self.report
    }

    fn schedule(&mut self, at: u64, event: Event) {
        self.order += 1;
        self.queue.push(Reverse((at, self.order, event)));
    }

    fn violation(&mut self, what: String) {
        if self.report.violations.len() < 20 {
            self.report.violations.push(format!("at {} ms: {what}", self.now));
        }
    }

    fn fault(&mut self, class: &'static str) {
        *self.report.faults.entry(class).or_default() += 1;
    }

    fn delay(&mut self) -> u64 {
        self.rng.below(self.cfg.max_delay + 1)
    }

    /// Starts a process for `member`, started in `epoch`.
    fn spawn(&mut self, member: Member, epoch: u64) {
        let p = self.processes.len();
        let sequence = self.now * 1_000;
        self.processes.push(Process {
            member,
            epoch,
            sequence,
            alive: true,
            died_at: None,
            paused: false,
            taken: false,
            lifeline: None,
        });
        self.current.insert(member, p);
        self.open_lifeline(p);
        let first = self.rng.below(self.cfg.interval);
        self.schedule(self.now + first, Event::Beat(p));
    }

    fn open_lifeline(&mut self, p: usize) {
        let (member, epoch) = (self.processes[p].member, self.processes[p].epoch);
        let Some(controller) = self.controller.as_mut() else { return };
        let lifeline =
            controller.lifeline_opened(member, epoch, p as u32).ok().map(|n| (n, self.incarnation));
        self.processes[p].lifeline = lifeline;
    }

    fn kill(&mut self, p: usize) {
        if !self.processes[p].alive {
            return;
        }
        self.processes[p].alive = false;
        self.processes[p].died_at = Some(self.now);
        if let Some((number, incarnation)) = self.processes[p].lifeline.take() {
            let at = self.now + self.delay();
            self.schedule(at, Event::LifelineEnds { process: p, number, incarnation });
        }
    }

    fn start_controller(&mut self) {
        let timeout_ms = self.cfg.timeout;
        let config = LivenessConfig { timeout_ms, grace_ms: timeout_ms };
        let liveness = Controller::start(config, self.disk.clone(), self.now);
        if liveness.record().epoch < self.highest_epoch {
            self.violation(format!("a restart went back to epoch {}", liveness.record().epoch));
        }
        self.incarnation += 1;
        // It campaigned and won: the store takes its writes, and no older leader's.
        self.leader = self.incarnation;
        self.started_at = self.now;
        self.started_from = self.disk.members.keys().copied().collect();
        self.last_taken.clear();
        self.newest_taken.clear();
        // A restarted controller has handed no spare over yet.
        self.spares_used.clear();
        self.controller = Some(liveness);
        // The shell writes the record (its incarnation) before answering anyone.
        self.write_record();
        // Whoever drives the pipeline replaces the members the census says await a replacement.
        let awaiting: Vec<Member> =
            self.disk.members.iter().filter(|(_, m)| m.awaiting).map(|(&member, _)| member).collect();
        for member in awaiting {
            if member.1 < SPARE_MEMBERS && !self.replacing.contains_key(&member) {
                self.replacing.insert(member, 0);
                let at = self.now + 1 + self.rng.below(5 * self.cfg.interval);
                self.schedule(at, Event::Replace(member));
            }
        }
        // The members' current processes first: a process left running that was started in the
        // same epoch (a replacement replaced again) would otherwise hold the lifeline instead.
        let current: Vec<usize> = self.current.values().copied().collect();
        let others = (0..self.processes.len()).filter(|p| !current.contains(p));
        for p in current.iter().copied().chain(others).collect::<Vec<_>>() {
            if self.processes[p].alive {
                self.open_lifeline(p);
            }
        }
        self.schedule_detect(self.now);
    }

    fn schedule_detect(&mut self, at: u64) {
        self.detect_generation += 1;
        let generation = self.detect_generation;
        self.schedule(at, Event::Detect { generation });
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Beat(p) => self.beat(p),
            Event::Deliver(beat) => self.deliver(beat),
            Event::LifelineEnds { process, number, incarnation } => {
                let member = self.processes[process].member;
                let Some(controller) = self.controller.as_mut().filter(|_| incarnation == self.incarnation)
                else {
                    return;
                };
                if controller.lifeline_closed(member, number, self.now) {
                    self.schedule_detect(self.now + SETTLE);
                }
            }
            Event::Detect { generation } if generation == self.detect_generation => self.detect(),
            Event::Detect { .. } => {}
            Event::Fault(_) => self.inject(),
            Event::Resume(p) => self.processes[p].paused = false,
            Event::ControllerStarts => self.start_controller(),
            Event::StaleDetect => self.stale_detect(),
            Event::DiskHeals => self.disk_broken = false,
            Event::Replace(member) => self.replace(member),
            Event::TakeUp { spare, member, epoch } => self.take_up(spare, member, epoch),
        }
    }

    fn beat(&mut self, p: usize) {
        if !self.processes[p].alive {
            return;
        }
        let jitter = self.rng.below(self.cfg.interval / 10 + 1);
        self.schedule(self.now + self.cfg.interval + jitter, Event::Beat(p));
        if self.processes[p].paused {
            return;
        }
        let process = &mut self.processes[p];
        process.sequence += 1;
        let beat = Beat { member: process.member, epoch: process.epoch, sequence: process.sequence };
        if self.rng.chance(self.cfg.drop) {
            self.fault("beat lost");
            return;
        }
        let at = self.now + self.delay();
        self.schedule(at, Event::Deliver(beat));
        if self.rng.chance(self.cfg.replay) {
            self.fault("beat replayed");
            let later = at + 1 + self.rng.below(3 * self.cfg.timeout);
            self.schedule(later, Event::Deliver(beat));
        }
    }

    fn deliver(&mut self, beat: Beat) {
        let now = self.now;
        let Some(controller) = self.controller.as_mut() else { return };
        let fenced_in = controller.membership(beat.member).map_or(0, |m| m.fenced_in);
        let heard = controller.heartbeat(beat, now);
        let health = controller.health(beat.member, now);
        if let Heard::Taken { .. } = heard {
            if beat.epoch < fenced_in {
                self.violation(format!("{beat:?}, from before its fence in epoch {fenced_in}, was taken"));
            }
            if health == Health::Fenced {
                self.violation(format!("{beat:?} was taken, yet its member still awaits a replacement"));
            }
            self.last_taken.insert(beat.member, now);
            let newest = self.newest_taken.entry(beat.member).or_default();
            *newest = (*newest).max(beat.sequence);
            if let Some(&p) = self.current.get(&beat.member) {
                let process = &mut self.processes[p];
                process.taken |= process.epoch == beat.epoch;
            }
            self.write_record();
        }
    }

    /// Writes the machine's record if it changed, as the shell does after a beat and before
    /// each detection (it fails while the state file cannot be written).
    fn write_record(&mut self) {
        let writable = self.writable(self.incarnation);
        let Some(controller) = self.controller.as_mut() else { return };
        if let Some(record) = controller.unwritten_record().filter(|_| writable) {
            self.disk = record.clone();
            controller.record_written();
            self.took_write(self.incarnation);
        }
    }

    /// Whether the store takes a write of controller incarnation `incarnation`: the state file
    /// can be written, and (on etcd) the writer still leads.
    fn writable(&self, incarnation: u64) -> bool {
        !self.disk_broken && self.leader == incarnation
    }

    /// The store took a write of `incarnation`.
    fn took_write(&mut self, incarnation: u64) {
        if incarnation < self.last_writer {
            self.violation(format!("leader {incarnation} wrote after leader {}", self.last_writer));
        }
        self.last_writer = incarnation;
    }

    fn detect(&mut self) {
        self.write_record();
        let now = self.now;
        let longest = now + self.cfg.timeout / 2;
        let Some(controller) = self.controller.as_mut() else { return };
        let dead = controller.tick(now);
        if self.trace {
            println!("       census {:?} record {:?}", controller.census(now), controller.record());
        }
        let next = controller.poll_timeout(now).map_or(longest, |at| at.min(longest));
        self.schedule_detect(next);
        self.assign_spares();
        if dead.is_empty() {
            return;
        }
        if self.trace {
            println!("       fence {dead:?}");
        }
        let writable = self.writable(self.incarnation);
        let controller = self.controller.as_mut().expect("running");
        let before = controller.record().clone();
        let written = controller.fence(&dead, None, now, |_| if writable { Ok(()) } else { Err(()) });
        match written {
            Err(()) => {
                if controller.record() != &before {
                    self.violation("a fence that could not be written changed the record".into());
                }
                self.last_failed_write = Some(now);
                self.schedule_detect(now + FENCE_RETRY);
            }
            Ok(epoch) => {
                self.disk = controller.record().clone();
                self.took_write(self.incarnation);
                self.fenced(epoch, &dead, &before);
            }
        }
    }

    /// Checks a fence in `epoch` of `members`, the record having been `before`.
    fn fenced(&mut self, epoch: u64, members: &[Member], before: &Record) {
        self.report.fences += 1;
        if epoch <= self.highest_epoch {
            self.violation(format!("epoch {epoch} handed out after {}", self.highest_epoch));
        }
        self.highest_epoch = epoch;
        for &member in members {
            let (role, index) = member;
            if index >= SPARE_MEMBERS {
                self.violation(format!("spare {member:?} was fenced"));
            }
            let engine_of_fenced_sidecar = role == Role::Engine && members.contains(&(Role::Sidecar, index));
            let p = self.current[&member];
            let process = &self.processes[p];
            let not_healthy = !process.alive
                || process.paused
                || process.epoch < before.members.get(&member).map_or(0, |m| m.fenced_in);
            let heard_at = self.last_taken.get(&member).copied().unwrap_or(self.started_at);
            let silent = self.now.saturating_sub(heard_at) >= self.cfg.timeout;
            if !(not_healthy || silent || engine_of_fenced_sidecar) {
                self.violation(format!(
                    "{member:?} was fenced, alive and heard {} ms ago",
                    self.now - heard_at
                ));
            }
            if role == Role::Sidecar {
                let engine = (Role::Engine, index);
                let was_awaiting = before.members.get(&engine).is_some_and(|m| m.awaiting);
                let known = before.members.contains_key(&engine);
                if known && !was_awaiting && !members.contains(&engine) {
                    self.violation(format!("sidecar {index} was fenced without its engine"));
                }
            }
            if index < SPARE_MEMBERS && !self.replacing.contains_key(&member) {
                let at = self.now + 1 + self.rng.below(5 * self.cfg.interval);
                self.replacing.insert(member, epoch);
                self.schedule(at, Event::Replace(member));
            }
        }
    }

    fn replace(&mut self, member: Member) {
        let Some(controller) = self.controller.as_ref() else {
            let at = self.now + self.cfg.interval;
            self.schedule(at, Event::Replace(member));
            return;
        };
        let Some(m) = controller.membership(member).filter(|m| m.awaiting) else {
            self.replacing.remove(&member);
            return;
        };
        let old = self.current[&member];
        if self.rng.chance(0.3) {
            // Left running: a process cut off from the cluster could not be killed.
            self.fault("fenced process left running");
            self.processes[old].lifeline = None;
        } else {
            self.kill(old);
        }
        self.spawn(member, m.fenced_in);
        // A replacement that has not beaten by then (it died, or its beats were lost) is replaced
        // again, as whoever drives the pipeline would.
        let check = self.now + 3 * self.cfg.timeout;
        self.schedule(check, Event::Replace(member));
    }

    /// The controller's spare assignments at this detection, checked: each hands a live spare of
    /// the member's role, never handed out before by this controller nor ever taken up, to a
    /// member that awaits its replacement from
    /// a fence in the assignment's epoch; and no member that awaits one is left without a spare
    /// while a live one is free.
    fn assign_spares(&mut self) {
        let now = self.now;
        for role in [Role::Sidecar, Role::Engine] {
            let Some(controller) = self.controller.as_mut() else { return };
            let assignments = controller.assign_spares(role, now);
            let census = controller.census(now);
            let mut violations = Vec::new();
            for a in &assignments {
                if a.spare.0 != role
                    || a.spare.1 < SPARE_MEMBERS
                    || controller.health(a.spare, now) != Health::Alive
                {
                    violations.push(format!("{a:?}: not a live spare of its role"));
                }
                let membership = controller.membership(a.member);
                if a.member.1 >= SPARE_MEMBERS
                    || !membership.is_some_and(|m| m.awaiting && m.fenced_in == a.epoch)
                {
                    violations
                        .push(format!("{a:?}: {:?} does not await a replacement in that epoch", a.member));
                }
                if !self.spares_used.insert(a.spare) {
                    violations.push(format!("{a:?}: the spare was handed out before"));
                }
                if let Some(&gone_at) = self.spares_gone.get(&a.spare) {
                    if self.newest_taken.get(&a.spare).is_some_and(|&newest| newest <= gone_at) {
                        self.report
                            .faults
                            .entry("spare handed out on a replayed beat")
                            .and_modify(|n| *n += 1)
                            .or_insert(1);
                    } else {
                        violations.push(format!("{a:?}: the spare took another place before"));
                    }
                }
            }
            let outstanding: BTreeSet<Member> = controller.outstanding_spares().map(|a| a.member).collect();
            let awaiting_without = census.iter().any(|&(member, health)| {
                member.0 == role
                    && member.1 < SPARE_MEMBERS
                    && health == Health::Fenced
                    && !outstanding.contains(&member)
            });
            let free_spare = census.iter().any(|&(member, health)| {
                member.0 == role
                    && member.1 >= SPARE_MEMBERS
                    && health == Health::Alive
                    && controller.heard_since_start(member)
                    && !self.spares_used.contains(&member)
            });
            if awaiting_without && free_spare {
                violations.push(format!("a {role:?} awaits its replacement while a spare is free"));
            }
            for v in violations {
                self.violation(v);
            }
            for a in assignments {
                if !self.writable(self.incarnation) && self.cfg.leadership {
                    // Its shell confirms it still leads before it tells a spare, and cannot.
                    self.controller.as_mut().expect("running").spare_failed(a);
                    continue;
                }
                if self.rng.chance(0.1) {
                    // The spare could not be told (its control listener is cut off).
                    self.fault("spare hand-over failed");
                    self.controller.as_mut().expect("running").spare_failed(a);
                } else {
                    let at = self.now + self.delay();
                    self.schedule(at, Event::TakeUp { spare: a.spare, member: a.member, epoch: a.epoch });
                }
            }
        }
    }

    /// The shell tells spare `spare` to become `member` in `epoch`: it does if it still lives
    /// and the member still awaits that replacement (the shell checks before it tells the spare),
    /// and beats as the member from then on; otherwise the hand-over fails.
    fn take_up(&mut self, spare: Member, member: Member, epoch: u64) {
        let assignment = Assignment { spare, member, epoch };
        let Some(&p) = self.current.get(&spare) else { return };
        let Some(controller) = self.controller.as_ref() else { return };
        let awaited = controller.membership(member).is_some_and(|m| m.awaiting && m.fenced_in == epoch);
        if !self.processes[p].alive || self.processes[p].paused || !awaited {
            self.controller.as_mut().expect("checked above").spare_failed(assignment);
            return;
        }
        self.fault("spare took a place");
        let now = self.now;
        self.controller.as_mut().expect("checked above").spare_handed_over(assignment, now);
        self.spares_gone.insert(spare, self.processes[p].sequence);
        self.kill(p);
        if let Some(&old) = self.current.get(&member) {
            self.kill(old);
        }
        self.spawn(member, epoch);
    }

    fn inject(&mut self) {
        let stage = self.rng.below(u64::from(self.cfg.stages)) as u32;
        let role = if self.rng.chance(0.5) { Role::Engine } else { Role::Sidecar };
        let p = self.current[&(role, stage)];
        match self.rng.below(7) {
            0 | 1 => {
                self.fault("process killed");
                self.kill(p);
            }
            2 => {
                self.fault("worker killed");
                for role in [Role::Engine, Role::Sidecar] {
                    let p = self.current[&(role, stage)];
                    self.kill(p);
                }
            }
            3 => {
                self.fault("process paused");
                let length = self.rng.below(3 * self.cfg.timeout);
                self.processes[p].paused = true;
                self.schedule(self.now + length, Event::Resume(p));
            }
            4 => {
                if self.cfg.spares > 0 {
                    self.fault("spare killed");
                    let spare = SPARE_MEMBERS + self.rng.below(u64::from(self.cfg.spares)) as u32;
                    let p = self.current[&(Role::Engine, spare)];
                    self.kill(p);
                }
            }
            5 if self.rng.chance(0.3) => self.claim_twice(p),
            5 if self.cfg.leadership && self.controller.is_some() && self.rng.chance(0.5) => {
                self.pause_leader()
            }
            5 if self.controller.is_some() => {
                self.fault("controller crash");
                self.controller = None;
                // On etcd, the next leader takes over once the dead one's lease lapses.
                let downtime = match self.cfg.leadership {
                    true => self.cfg.lease + self.rng.below(self.cfg.interval),
                    false => self.rng.below(4 * self.cfg.timeout),
                };
                self.schedule(self.now + downtime, Event::ControllerStarts);
            }
            _ => {
                self.fault("state file unwritable");
                self.disk_broken = true;
                let length = self.rng.below(2 * self.cfg.timeout);
                self.schedule(self.now + length, Event::DiskHeals);
            }
        }
    }

    /// The leader is paused (SIGSTOP) past its lease: the lease lapses, the next leader takes over
    /// from the record, and the paused one goes on some time after (SIGCONT), knowing nothing of
    /// it. Beats and lifelines reach it no more: the members follow the new leader.
    fn pause_leader(&mut self) {
        if self.stale.is_some() {
            return;
        }
        self.fault("leader paused past its lease");
        let old = self.controller.take().expect("a leader to pause");
        self.stale = Some((old, self.incarnation));
        self.leader = 0;
        let takeover = self.now + self.cfg.lease + self.rng.below(self.cfg.interval);
        self.schedule(takeover, Event::ControllerStarts);
        let back = takeover + self.rng.below(4 * self.cfg.timeout);
        self.schedule(back, Event::StaleDetect);
    }

    /// A deposed leader back from its pause: its shell writes what it had not written, runs its
    /// detector and fences the dead, and hands spares over, as after any wait. Every write fails,
    /// for another leads: at its first, the shell learns it was deposed and stops. Until then it
    /// runs its detector at the machine's deadlines.
    fn stale_detect(&mut self) {
        let Some((mut old, incarnation)) = self.stale.take() else { return };
        let now = self.now;
        let writable = self.writable(incarnation);
        if writable {
            self.violation(format!("leader {incarnation}, paused past its lease, still leads"));
        }
        let store = self.disk.clone();
        let mut tried = old.unwritten_record().is_some();
        let dead = old.tick(now);
        if !tried && !dead.is_empty() {
            tried = true;
            let before = old.record().clone();
            match old.fence(&dead, None, now, |_| if writable { Ok(()) } else { Err(()) }) {
                Ok(epoch) => {
                    self.violation(format!("deposed leader {incarnation} fenced {dead:?} in epoch {epoch}"))
                }
                Err(()) if old.record() != &before => {
                    self.violation("a deposed leader's failed fence changed its record".into())
                }
                Err(()) => {}
            }
        }
        for role in [Role::Sidecar, Role::Engine] {
            for assignment in old.assign_spares(role, now) {
                // Its shell confirms its leadership before it tells the spare (a guarded write).
                tried = true;
                if writable {
                    self.violation(format!("deposed leader {incarnation} handed {assignment:?} over"));
                }
                old.spare_failed(assignment);
            }
        }
        if self.disk != store {
            self.violation(format!("a write of deposed leader {incarnation} reached the store"));
        }
        if !tried {
            let next = old.poll_timeout(now).map_or(now + self.cfg.timeout / 2, |at| at.max(now + 1));
            self.stale = Some((old, incarnation));
            self.schedule(next, Event::StaleDetect);
        }
    }

    /// A second process of `p`'s member, started in the same epoch (a second sidecar started for
    /// the same stage), asks for the member's lifeline. While `p` lives and holds it with this
    /// controller, it must be refused as claimed by `p`; the second process then exits, having
    /// changed nothing.
    fn claim_twice(&mut self, p: usize) {
        let holds = self.processes[p].alive
            && self.processes[p].lifeline.is_some_and(|(_, incarnation)| incarnation == self.incarnation);
        if !holds || self.controller.is_none() {
            return;
        }
        let controller = self.controller.as_mut().expect("checked above");
        let (member, epoch) = (self.processes[p].member, self.processes[p].epoch);
        let stranger = u32::MAX - self.processes.len() as u32;
        // A process left running after its fence is stale, and so is a second one of its epoch;
        // while the member awaits its replacement, a second replacement may take over.
        let membership = controller.membership(member).unwrap_or_default();
        if membership.awaiting {
            return;
        }
        *self.report.faults.entry("duplicate claim").or_default() += 1;
        let expected = if epoch < membership.fenced_in {
            LifelineRefused::Stale { epoch, fenced_in: membership.fenced_in }
        } else {
            LifelineRefused::Claimed { epoch, by: p as u32 }
        };
        let claimed = controller.lifeline_opened(member, epoch, stranger);
        if claimed != Err(expected) {
            self.violation(format!("a second process claiming {member:?} in epoch {epoch} got {claimed:?}"));
        }
    }

    /// Every stage member whose process died, once the controller had taken a beat of it, is
    /// fenced in time (a replacement that dies before its first beat leaves its member awaiting
    /// a replacement still: whoever started it finds out).
    fn check_deaths(&mut self) {
        if self.controller.is_none() {
            return;
        }
        let bound = 2 * self.cfg.timeout + self.cfg.max_delay + SETTLE + 2;
        let retry = self.last_failed_write.map_or(0, |at| at + FENCE_RETRY + bound);
        let mut late = Vec::new();
        for (&member, &p) in &self.current {
            let process = &self.processes[p];
            // Known to this controller: a beat of it taken by it, or its member in the record it
            // started from (a join whose write failed dies with the controller that took it).
            let known = self.last_taken.contains_key(&member) || self.started_from.contains(&member);
            let Some(died) = process.died_at.filter(|_| member.1 < SPARE_MEMBERS && process.taken && known)
            else {
                continue;
            };
            let controller = self.controller.as_ref().expect("checked above");
            // Fenced: its process no longer counts, or the member awaits a replacement (a
            // controller restarted from a record written before the process's first beat).
            let fenced =
                controller.membership(member).is_some_and(|m| m.awaiting || m.fenced_in > process.epoch);
            // A beat it sent before it died may still arrive (late, or replayed to a restarted
            // controller, which cannot tell a replay it never saw the original of): the silence
            // counts from the last beat taken.
            let heard = self.last_taken.get(&member).copied().unwrap_or(0);
            let deadline = (died.max(self.started_at).max(heard) + bound).max(retry);
            if !fenced && self.now > deadline {
                late.push((member, died));
            }
        }
        for (member, died) in late {
            self.violation(format!("{member:?} died at {died} ms and is not fenced"));
            // Reported once.
            let p = self.current[&member];
            self.processes[p].died_at = None;
        }
    }
}

/// Replays a journal the running controller wrote (`dejavud controller --journal`; one run per
/// `start` line, a restarted controller appending its own) through fresh machines, checking
/// that each answers every call as the controller's did; returns the entries replayed.
pub fn replay_journal(text: &str) -> Result<usize, String> {
    let mut machine: Option<(Liveness, usize)> = None;
    let mut replayed = 0;
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        if line.starts_with("start ") {
            let start = Start::parse(line).map_err(|e| format!("line {}: {e}", n + 1))?;
            machine = Some((Liveness::start(start.config, start.record, start.now), 0));
            continue;
        }
        let (liveness, index) =
            machine.as_mut().ok_or_else(|| format!("line {}: an entry before any start", n + 1))?;
        let recorded = Entry::parse(line).map_err(|e| format!("line {}: {e}", n + 1))?;
        let answer = liveness.replay(&recorded);
        if answer != recorded {
            let divergence = Divergence { index: *index, recorded, replayed: answer };
            return Err(format!("line {}: {divergence:?}", n + 1));
        }
        *index += 1;
        replayed += 1;
    }
    Ok(replayed)
}
