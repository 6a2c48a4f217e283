//! A sidecar under faults: the running sidecar's machine ([`dejavu_proto::Worker`]), driven as the
//! sidecar drives it for every engine that connects and every chunk its engine writes, against a
//! model successor that goes down and comes back, refuses the chunks of a stale engine, is
//! replaced by a recovery (re-seeded with everything the sidecar keeps) in the middle of a
//! forward, and drops what the engine releases. Engines are replaced by newer ones, and an older
//! one sometimes comes back.
//!
//! Invariants, checked after every answer:
//! - a chunk answered [`Answer::Forwarded`] is held at the current successor, and so is every
//!   chunk kept before it that the sidecar still holds and did not give up on (refused, or pushed
//!   out of a full backlog);
//! - the successor of a generation receives forwards in the order the chunks were kept, and only
//!   while it is the current one;
//! - a chunk is refused only when a newer engine wrote at the successor;
//! - a newer engine takes the sidecar over, and an older one is refused;
//! - the backlog never exceeds its capacity, and after an answer with the successor up and
//!   nothing refused, nothing waits;
//! - every chunk the engine heard was forwarded stays held at the successor until released.

use std::collections::{BTreeMap, BTreeSet};

use dejavu_proto::fencing::Claim;
use dejavu_proto::forwarding::{Answer, Kept, Next, Sent};
use dejavu_proto::rng::SplitMix64;
use dejavu_proto::worker::{Place, Worker};

/// The shape and fault rates of a forwarding run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ForwardingSimConfig {
    /// Chunks the engine writes.
    pub chunks: u32,
    /// The backlog's capacity.
    pub capacity: usize,
    /// Chance, before a chunk, that the successor goes down or comes back.
    pub flap: f64,
    /// Chance, before a chunk or in the middle of a forward, that a recovery names a new
    /// successor.
    pub replace: f64,
    /// Chance, before a chunk, that a newer engine of the stage writes at the successor (this
    /// engine's chunks are stale there from then), and that this engine is replaced by a newer
    /// one.
    pub stale: f64,
    /// Chance, before a chunk, that the engine releases a sequence (a chunk it wrote).
    pub release: f64,
}

impl Default for ForwardingSimConfig {
    fn default() -> Self {
        Self { chunks: 200, capacity: 16, flap: 0.05, replace: 0.01, stale: 0.01, release: 0.05 }
    }
}

impl ForwardingSimConfig {
    /// A shape and rates drawn from `seed`.
    pub fn varied(seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed ^ 0x0f0a_7d00_0000_0000);
        let rate = |rng: &mut SplitMix64| [0.0, 0.01, 0.05, 0.2][rng.below(4) as usize];
        Self {
            chunks: 20 + rng.below(400) as u32,
            capacity: 1 + rng.below(32) as usize,
            flap: rate(&mut rng),
            replace: rate(&mut rng),
            stale: rate(&mut rng),
            release: rate(&mut rng),
        }
    }
}

/// What a forwarding run found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ForwardingReport {
    /// Invariants broken, in order.
    pub violations: Vec<String>,
    /// Answers the engine heard, by kind.
    pub answers: BTreeMap<String, u32>,
    /// Faults injected, by class.
    pub faults: BTreeMap<&'static str, u32>,
}

/// A successor sidecar, as the model holds it.
#[derive(Debug, Default)]
struct Successor {
    up: bool,
    /// Chunks it holds.
    held: BTreeSet<u32>,
    /// The newest epoch of the stage's engines that wrote here.
    newest: u64,
    /// The last chunk forwarded here (not re-seeded), to check the order.
    last_forwarded: Option<u32>,
}

/// The run's world: the sidecar's machine and local copy, and the successors.
struct World {
    rng: SplitMix64,
    cfg: ForwardingSimConfig,
    machine: Worker<u32>,
    /// Chunks the sidecar holds (its local copy), by the epoch that wrote them.
    local: BTreeMap<u32, u64>,
    /// Chunks given up on: refused, or pushed out of the backlog.
    given_up: BTreeSet<u32>,
    /// Chunks answered forwarded, and not released since.
    confirmed: BTreeSet<u32>,
    successors: BTreeMap<u64, Successor>,
    current: u64,
    engine_epoch: u64,
    report: ForwardingReport,
}

impl World {
    fn fault(&mut self, class: &'static str) {
        *self.report.faults.entry(class).or_insert(0) += 1;
    }

    fn violation(&mut self, what: String) {
        self.report.violations.push(what);
    }

    /// A recovery names a new successor and re-seeds it with every chunk kept here.
    fn replace_successor(&mut self) {
        self.fault("successor replaced");
        let generation = self.machine.successor_named();
        let held = self.local.keys().copied().collect();
        let newest = self.successors.get(&self.current).map_or(0, |s| s.newest);
        self.successors.insert(generation, Successor { up: true, held, newest, last_forwarded: None });
        self.current = generation;
    }

    /// The sidecar sends chunk `key` of `epoch` to the successor of `generation`.
    fn send(&mut self, key: u32, epoch: u64, generation: u64) -> Sent {
        if generation != self.current {
            self.violation(format!(
                "chunk {key} sent to successor {generation}, not the current {}",
                self.current
            ));
        }
        if !self.local.contains_key(&key) {
            return Sent::Gone;
        }
        let Some(successor) = self.successors.get_mut(&generation) else { return Sent::Failed };
        if !successor.up {
            return Sent::Failed;
        }
        if epoch < successor.newest {
            return Sent::Refused;
        }
        let out_of_order = successor.last_forwarded.is_some_and(|last| key <= last);
        let last = successor.last_forwarded.replace(key);
        successor.held.insert(key);
        if out_of_order {
            self.violation(format!("chunk {key} forwarded after chunk {last:?}"));
        }
        Sent::Stored
    }

    /// The engine writes chunk `key`; the sidecar keeps it and forwards it as the machine says.
    fn write(&mut self, key: u32) {
        self.local.insert(key, self.engine_epoch);
        let Kept { ticket, mut next, given_up } = self.machine.kept(key, self.engine_epoch);
        if let Some(oldest) = given_up {
            self.given_up.insert(oldest);
        }
        let answer = loop {
            match next {
                Next::Answer(answer) => break answer,
                Next::Send { key: sent_key, epoch, successor } => {
                    let outcome = self.send(sent_key, epoch, successor);
                    if outcome == Sent::Refused {
                        self.given_up.insert(sent_key);
                        if epoch >= self.successors[&successor].newest {
                            self.violation(format!("chunk {sent_key} of epoch {epoch} refused"));
                        }
                    }
                    if self.rng.chance(self.cfg.replace) {
                        self.replace_successor();
                    }
                    next = self.machine.sent(ticket, successor, outcome);
                }
            }
        };
        *self.report.answers.entry(format!("{answer:?}")).or_insert(0) += 1;
        if self.machine.waiting() > self.cfg.capacity {
            self.violation(format!("{} chunks wait, beyond {}", self.machine.waiting(), self.cfg.capacity));
        }
        match answer {
            Answer::Forwarded => self.forwarded(key),
            // Only a successor that is down makes a chunk wait.
            Answer::Waiting if self.successors[&self.current].up => {
                self.violation(format!("chunk {key} waits with its successor up"));
            }
            Answer::Waiting => {}
            Answer::NoSuccessor if !self.successors.is_empty() => {
                self.violation(format!("chunk {key} found no successor"));
            }
            _ if self.machine.waiting() > 0 && self.successors[&self.current].up => {
                self.violation(format!("{} chunks wait with the successor up", self.machine.waiting()));
            }
            _ => {}
        }
    }

    /// Chunk `key` was answered forwarded: check it and every older chunk still held.
    fn forwarded(&mut self, key: u32) {
        let successor = &self.successors[&self.current];
        let missing: Vec<u32> = self
            .local
            .keys()
            .copied()
            .filter(|&k| k <= key && !successor.held.contains(&k) && !self.given_up.contains(&k))
            .collect();
        if !missing.is_empty() {
            self.violation(format!("chunk {key} answered forwarded, but the successor lacks {missing:?}"));
        }
        self.confirmed.insert(key);
    }

    /// An engine of `epoch` connects; it must be served exactly when it is the newest.
    fn engine_connects(&mut self, epoch: u64, newest: bool) {
        let claim = self.machine.engine_connects(epoch);
        if matches!(claim, Claim::Admitted { .. }) != newest {
            self.violation(format!("an engine of epoch {epoch} (newest: {newest}) got {claim:?}"));
        }
    }

    fn release(&mut self) {
        let Some(&key) = self.local.keys().nth(self.rng.below(self.local.len() as u64) as usize) else {
            return;
        };
        self.fault("release");
        self.local.remove(&key);
        self.confirmed.remove(&key);
        if let Some(successor) = self.successors.get_mut(&self.current) {
            successor.held.remove(&key);
        }
    }

    fn check_confirmed(&mut self) {
        let successor = &self.successors[&self.current];
        let lost: Vec<u32> = self.confirmed.iter().copied().filter(|k| !successor.held.contains(k)).collect();
        if !lost.is_empty() {
            self.violation(format!("chunks {lost:?} were answered forwarded, but the successor lost them"));
        }
    }
}

/// Runs one seed of the forwarding machine with `cfg`.
pub fn run_forwarding_seed(seed: u64, cfg: &ForwardingSimConfig) -> ForwardingReport {
    let mut world = World {
        rng: SplitMix64::new(seed),
        cfg: *cfg,
        machine: Worker::new(Place::Stage { stage: 0, epoch: 0 }, cfg.capacity),
        local: BTreeMap::new(),
        given_up: BTreeSet::new(),
        confirmed: BTreeSet::new(),
        successors: BTreeMap::new(),
        current: 0,
        engine_epoch: 0,
        report: ForwardingReport::default(),
    };
    // Some chunks are kept before any successor is named.
    let before = world.rng.below(3) as u32;
    for key in 0..before {
        world.write(key);
    }
    world.engine_connects(0, true);
    world.replace_successor();
    for key in before..cfg.chunks {
        if world.rng.chance(cfg.flap) {
            world.fault("successor flapped");
            let current = world.current;
            let successor = world.successors.get_mut(&current).expect("the current successor");
            successor.up = !successor.up;
        }
        if world.rng.chance(cfg.replace) {
            world.replace_successor();
        }
        if world.rng.chance(cfg.stale) {
            world.fault("newer engine elsewhere");
            let current = world.current;
            let successor = world.successors.get_mut(&current).expect("the current successor");
            successor.newest += 1;
        }
        if world.rng.chance(cfg.stale) {
            world.fault("engine replaced");
            world.engine_epoch += 1;
            world.engine_connects(world.engine_epoch, true);
            if world.rng.chance(0.5) {
                world.fault("stale engine back");
                world.engine_connects(world.engine_epoch - 1, false);
            }
        }
        if world.rng.chance(cfg.release) {
            world.release();
        }
        world.write(key);
        world.check_confirmed();
    }
    world.report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quiet_run_forwards_everything() {
        let cfg =
            ForwardingSimConfig { flap: 0.0, replace: 0.0, stale: 0.0, release: 0.0, ..Default::default() };
        let report = run_forwarding_seed(1, &cfg);
        assert!(report.violations.is_empty(), "{:?}", report.violations);
        let forwarded = report.answers.get("Forwarded").copied().unwrap_or(0);
        assert!(forwarded >= cfg.chunks - 2, "{:?}", report.answers);
    }
}
