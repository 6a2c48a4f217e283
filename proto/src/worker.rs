//! The running sidecar's machine: which engine it serves ([`Newest`]: the newest epoch to connect
//! holds it, an older one is refused), which stage it is (its own, or a spare's until a recovery
//! assigns it one, once), and how it forwards the engine's KV to the ring successor
//! ([`Forwarding`]). `dejavud sidecar` holds one and is its I/O shell; the simulator
//! (`dejavu-sim`'s `forwarding` module) drives the same type.
//!
//! A [`Worker`] dereferences to its [`Forwarding`]: keeping a chunk, reporting a forward and
//! naming a new successor are its calls.

use std::ops::{Deref, DerefMut};

use crate::fencing::{Claim, Newest};
use crate::forwarding::Forwarding;

/// What a sidecar is to its ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// Stage `stage`'s sidecar, since `epoch` (0 for one started as that stage; a spare's
    /// assignment's epoch otherwise).
    Stage {
        /// The stage.
        stage: u32,
        /// The epoch it took the place in.
        epoch: u64,
    },
    /// A spare, waiting for a stage.
    Spare,
}

/// An assignment reached a sidecar that is not a spare waiting for a stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotASpare;

/// The running sidecar's machine (see the module's documentation).
#[derive(Clone, Debug)]
pub struct Worker<K> {
    place: Place,
    engine: Newest,
    forwarding: Forwarding<K>,
}

impl<K: Clone> Worker<K> {
    /// A sidecar at `place`, whose forwarding backlog holds at most `backlog` chunks.
    pub fn new(place: Place, backlog: usize) -> Self {
        Self { place, engine: Newest::new(), forwarding: Forwarding::new(backlog) }
    }

    /// What it is to its ring.
    pub fn place(&self) -> Place {
        self.place
    }

    /// As a spare, becomes stage `stage`'s sidecar in `epoch`, once.
    pub fn take_up(&mut self, stage: u32, epoch: u64) -> Result<(), NotASpare> {
        match self.place {
            Place::Spare => {
                self.place = Place::Stage { stage, epoch };
                Ok(())
            }
            Place::Stage { .. } => Err(NotASpare),
        }
    }

    /// The epoch of the engine it serves, if one connected.
    pub fn engine_epoch(&self) -> Option<u64> {
        self.engine.epoch()
    }

    /// Whether an engine of `epoch` would be admitted (nothing changes): `Err` with the epoch of
    /// the newer one in use.
    pub fn admits_engine(&self, epoch: u64) -> Result<(), u64> {
        self.engine.admits(epoch)
    }

    /// An engine of `epoch` connects: it is served unless one of a newer epoch is.
    pub fn engine_connects(&mut self, epoch: u64) -> Claim {
        self.engine.claim(epoch)
    }

    /// The epoch it acts in toward its peers: its engine's, or, before any engine connected,
    /// the epoch it took its place in.
    pub fn epoch(&self) -> u64 {
        let taken = match self.place {
            Place::Stage { epoch, .. } => epoch,
            Place::Spare => 0,
        };
        self.engine.epoch().unwrap_or(taken)
    }
}

impl<K> Deref for Worker<K> {
    type Target = Forwarding<K>;

    fn deref(&self) -> &Forwarding<K> {
        &self.forwarding
    }
}

impl<K> DerefMut for Worker<K> {
    fn deref_mut(&mut self) -> &mut Forwarding<K> {
        &mut self.forwarding
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spare_takes_one_place_and_the_newest_engine_holds_the_sidecar() {
        let mut worker: Worker<u32> = Worker::new(Place::Spare, 8);
        assert_eq!(worker.epoch(), 0);
        assert_eq!(worker.take_up(2, 5), Ok(()));
        assert_eq!(worker.take_up(3, 6), Err(NotASpare), "assigned once");
        assert_eq!(worker.place(), Place::Stage { stage: 2, epoch: 5 });
        assert_eq!(worker.epoch(), 5, "the assignment's epoch before any engine");
        assert_eq!(worker.engine_connects(6), Claim::Admitted { took_over: false });
        assert_eq!(worker.engine_connects(4), Claim::Stale { newest: 6 });
        assert_eq!((worker.epoch(), worker.admits_engine(5)), (6, Err(6)));
        worker.successor_named();
        assert_eq!(worker.successor(), Some(1), "forwarding through the worker");
    }
}
