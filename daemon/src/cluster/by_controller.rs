//! Recoveries the controller carries out ([`Recoveries::ByController`]), from the cluster's side.
//! The controller detects and fences the dead, hands spare sidecars over and restores replaced
//! sidecars (`dejavud controller --stages`). The cluster does only what a deployment's own parts
//! do beside it:
//!
//! - as a supervisor, it starts the replacements the controller waits for (`--replace`), unless
//!   a spare sidecar was handed the place, and repairs the chain between the engines;
//! - as whoever feeds the pipeline, it watches the recovery feed
//!   ([`dejavulib::net::controller::RecoveryFeed`]), has each replaced engine restore from its own
//!   sidecar up to the mark the feed gives, feeds the steps after it again, and acknowledges.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use dejavu_proto::plan::Source;
use dejavulib::message::{RecoveryOrders, StageOrders};
use dejavulib::net::controller::{QueryError, RecoveryFeed};

use super::{
    secret, Cluster, ClusterError, Kill, Recovered, Recoveries, RecoveryHooks, Role, Sequence,
    RECOVERY_ATTEMPTS, RECOVERY_PATIENCE,
};
use crate::cli::ASSIGNED;
use crate::controller::ControllerError;
use crate::proc::Spawned;
use crate::process::RestoreSource;

/// How long a fenced sidecar's place waits for the controller to hand it a spare, when the
/// cluster keeps spare sidecars, before a replacement is started instead: long enough for a
/// controller started again meanwhile to hear the spares (a spare handed over after that races
/// the replacement for the place).
const HANDOVER_PATIENCE: Duration = Duration::from_secs(10);

/// Heartbeats a failed attempt waits for the controller to fence a stage that died during it.
const FENCING_PATIENCE: u32 = 10;

impl Cluster {
    /// Recovers `victims`, which the controller fenced, as [`Recoveries::ByController`] says:
    /// starts their replacements, waits for the controller's recovery on the feed, and resumes
    /// every sequence in `sequences` where its marks say. A step that fails (another stage died
    /// meanwhile) starts a new attempt that replaces whatever the controller fenced since; after
    /// [`RECOVERY_ATTEMPTS`] the last failure is returned.
    pub(super) fn recover_by_controller(
        &mut self,
        hooks: &mut dyn RecoveryHooks,
        victims: &[(usize, Kill)],
        sequences: &[Sequence<'_>],
    ) -> Result<Recovered, ClusterError> {
        debug_assert_eq!(self.config.recoveries, Recoveries::ByController);
        let used = self.spares.used;
        let mut fenced = victims.to_vec();
        // The feed's recoveries before this one have resumed.
        let mut recovery = Resumption { epoch: self.acknowledged, ..Resumption::default() };
        let mut failures: Vec<ClusterError> = Vec::new();
        for attempt in 1..=RECOVERY_ATTEMPTS {
            match self.resume_attempt(hooks, &fenced, &mut recovery, sequences) {
                Ok(()) => {
                    // The spares used are replaced in the background, off the recovery.
                    let (stages, sidecars) = (self.spares.used.0 - used.0, self.spares.used.1 - used.1);
                    self.start_spares((stages, sidecars), false)?;
                    let failures = failures.iter().map(ToString::to_string).collect();
                    return Ok(recovery.recovered(attempt, failures));
                }
                Err(e) => {
                    tracing::warn!(attempt, error = %e, "a recovery attempt failed");
                    failures.push(e);
                    fenced = self.fenced_after_failed_attempt()?;
                }
            }
        }
        Err(failures.pop().expect("a recovery gives up after a failed attempt"))
    }

    /// One attempt: replaces the `fenced` stages, then follows the feed up to the current epoch
    /// and resumes the sequences of every stage replaced so far in this recovery.
    fn resume_attempt(
        &mut self,
        hooks: &mut dyn RecoveryHooks,
        fenced: &[(usize, Kill)],
        recovery: &mut Resumption,
        sequences: &[Sequence<'_>],
    ) -> Result<(), ClusterError> {
        // A process presumed dead may only be slow: it is killed before its replacement takes
        // its place (when it can be). Its fence keeps it out either way.
        let spare = hooks.leave_presumed_dead_running();
        for &(victim, what) in fenced.iter().filter(|_| !spare) {
            let _ = self.stages[victim].proc.kill();
            if what == Kill::Worker {
                let _ = self.sidecars[victim].proc.kill();
            }
        }
        hooks.after_fence(self)?;
        let epoch = self.census()?.epoch;
        self.remote.set_epoch(epoch);
        for &(victim, what) in fenced {
            if what == Kill::Worker {
                let (new, socket) = self.sidecar_in_place_of(victim)?;
                self.sockets[victim] = socket;
                let old = std::mem::replace(&mut self.sidecars[victim], new);
                self.retire(old, spare);
                self.wait_alive((Role::Sidecar, victim as u32))?;
                self.hand_prompts_to(victim);
            }
        }
        // The last first, so that each knows where to send.
        let n = self.len();
        for &(victim, _) in fenced.iter().rev() {
            let next = if victim + 1 == n { self.driver } else { self.stages[victim + 1].addr };
            let new = self.replacement_stage(victim, epoch, next)?;
            let old = std::mem::replace(&mut self.stages[victim], new);
            self.retire(old, spare);
            self.wait_alive((Role::Engine, victim as u32))?;
        }
        let replaced: Vec<u32> = fenced.iter().map(|&(stage, _)| stage as u32).collect();
        self.repair_chain(&replaced)?;
        recovery.victims.extend(fenced.iter().copied());
        hooks.before_restore(self, fenced)?;
        let census = self.census()?;
        let unreplaced = self.victims_in(&census, crate::controller::Census::is_fenced);
        if !unreplaced.is_empty() {
            // Another fence since: the next attempt replaces those first.
            return Err(ClusterError::Invalid(format!("fenced during the recovery: {unreplaced:?}")));
        }
        // Every recovery the controller opened up to now, in order: a stage replaced in more than
        // one resumes where the newest says.
        while recovery.epoch < census.epoch {
            let orders = self.next_recovery(recovery.epoch)?;
            recovery.take(orders);
        }
        recovery.resume(self, sequences)?;
        let epoch = recovery.epoch;
        self.feed(|feed| feed.acknowledge(epoch))?;
        self.acknowledged = epoch;
        Ok(())
    }

    /// Stage `victim`'s sidecar in place of its fenced one: the spare the controller handed the
    /// place, if the cluster keeps spare sidecars and one is handed it in time, else a new process
    /// that asks for the place (`--replace`). Returns it with its local socket.
    fn sidecar_in_place_of(&mut self, victim: usize) -> Result<(Spawned, std::path::PathBuf), ClusterError> {
        if self.spares.has_sidecars() {
            // A spare says which place it was handed (`assigned STAGE EPOCH`), in a recovery
            // after the last one resumed.
            let acknowledged = self.acknowledged;
            let handed = |spare: &Spawned| {
                let place = spare.proc.said_later(ASSIGNED).and_then(|(_, line)| {
                    let mut words = line.split_whitespace().map(str::parse::<u64>);
                    Some((words.next()?.ok()?, words.next()?.ok()?))
                });
                place.is_some_and(|(stage, epoch)| stage == victim as u64 && epoch > acknowledged)
            };
            let start = Instant::now();
            while start.elapsed() < HANDOVER_PATIENCE {
                if let Some(spare) = self.spares.take_sidecar_where(handed) {
                    self.spares.used.1 += 1;
                    return Ok((spare.process, spare.socket));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            tracing::warn!(stage = victim, "no spare sidecar was handed the place: starting one");
        }
        self.new_replacement_sidecar(victim)
    }

    /// The controller's next recovery after epoch `after`, once its replacements are in place.
    fn next_recovery(&mut self, after: u64) -> Result<RecoveryOrders, ClusterError> {
        let start = Instant::now();
        while start.elapsed() < RECOVERY_PATIENCE {
            if let Some(orders) = self.feed(|feed| feed.watch(after, Duration::from_secs(1)))? {
                return Ok(orders);
            }
        }
        Err(ClusterError::Invalid(format!(
            "the controller published no recovery after epoch {after} within {RECOVERY_PATIENCE:?}; its last \
             words:\n{}",
            self.controllers.last_words()
        )))
    }

    /// A call on the recovery feed. A controller that cannot be reached is replaced (or its
    /// successor followed) through a census, and the call made again.
    fn feed<T>(
        &mut self,
        mut call: impl FnMut(&mut RecoveryFeed) -> Result<T, QueryError>,
    ) -> Result<T, ClusterError> {
        let feed = self.recovery_feed.get_or_insert_with(|| {
            RecoveryFeed::following(&self.controllers.addrs(), secret()).expect("a cluster has a controller")
        });
        match call(feed) {
            Err(QueryError::Io(e)) => {
                tracing::warn!(error = %e, "the recovery feed's controller did not answer");
                self.census()?;
                let feed = self.recovery_feed.as_mut().expect("made above");
                Ok(call(feed).map_err(ControllerError::from)?)
            }
            answer => Ok(answer.map_err(ControllerError::from)?),
        }
    }

    /// The stages the controller fenced after an attempt failed: waits for it to fence one (a
    /// stage that died during the attempt can fail it before the controller has seen it die), up
    /// to [`FENCING_PATIENCE`] heartbeats; none means the attempt failed for another reason, and
    /// the next tries again with nothing new to replace.
    fn fenced_after_failed_attempt(&mut self) -> Result<Vec<(usize, Kill)>, ClusterError> {
        self.detect(self.config.heartbeat * FENCING_PATIENCE)
    }
}

/// What a recovery by the controller has found and done so far, across its attempts.
#[derive(Default)]
struct Resumption {
    /// The newest recovery taken from the feed (or resumed before this one).
    epoch: u64,
    /// Every stage replaced, with what of it, in the order replaced.
    victims: Vec<(usize, Kill)>,
    /// The newest orders for each stage the feed named.
    orders: BTreeMap<u32, StageOrders>,
    recomputed: u64,
    lag: Vec<(usize, u64)>,
}

impl Resumption {
    /// Takes a recovery from the feed.
    fn take(&mut self, orders: RecoveryOrders) {
        self.epoch = orders.epoch;
        for stage in orders.stages {
            self.orders.insert(stage.plan.stage, stage);
        }
    }

    /// Resumes every sequence on the stages the feed named: each stage's engine restores the
    /// sequence's KV from its own sidecar (the controller handed a replaced sidecar its copy) up to
    /// the stage's mark, and the steps after the lowest mark are fed again.
    fn resume(&mut self, cluster: &mut Cluster, sequences: &[Sequence<'_>]) -> Result<(), ClusterError> {
        let sources: Vec<RestoreSource> = self
            .orders
            .values()
            .map(|orders| RestoreSource { stage: orders.plan.stage, from: None, orders: orders.clone() })
            .collect();
        let (mut recomputed, mut lag) = (0, vec![0u64; sources.len()]);
        for s in sequences {
            let sequence = cluster.remote.recover(&sources, s.seat, s.prompt, s.generated)?;
            recomputed += sequence.recomputed;
            for (total, lacked) in lag.iter_mut().zip(sequence.lacked) {
                *total += lacked;
            }
        }
        // An attempt that resumed counts alone: an earlier one that failed midway is done again.
        self.recomputed = recomputed;
        self.lag = sources.iter().map(|s| s.stage as usize).zip(lag).collect();
        Ok(())
    }

    fn recovered(self, attempts: u32, failures: Vec<String>) -> Recovered {
        let mut victims = self.victims;
        victims.sort_by_key(|&(stage, what)| (stage, what == Kill::Worker));
        victims.dedup();
        Recovered {
            epoch: self.epoch,
            victims,
            attempts,
            failures,
            recomputed: self.recomputed,
            lag: self.lag,
            copies_lost: self
                .orders
                .values()
                .filter(|o| o.plan.source == Source::Lost)
                .map(|o| o.plan.stage as usize)
                .collect(),
            transcript: Default::default(),
        }
    }
}
