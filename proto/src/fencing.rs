//! Epoch fencing as every process of the cluster applies it to its peers: a process says the
//! epoch it was started in; the newest one to claim a place holds it, an older one is refused, and
//! a fence announced in a newer epoch than a process's own ends what that process started.
//!
//! The sidecar admits engines with it (a stale engine back from a pause cannot take its sidecar
//! back), a stage admits its predecessor's connection with it, and whoever feeds a pipeline
//! learns with [`fenced_since`] that a step in flight will never be answered.

/// Who holds a place (a sidecar's engine, a stage's input): the process of the newest epoch that
/// claimed it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Newest {
    epoch: Option<u64>,
}

/// What became of a claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The claimant holds the place now; `took_over` if another held it before (it must be cut
    /// off: a replacement, or the same process reconnecting).
    Admitted {
        /// Whether a holder was displaced.
        took_over: bool,
    },
    /// The claimant was started before the holder: refused.
    Stale {
        /// The holder's epoch.
        newest: u64,
    },
}

impl Newest {
    /// A place nobody holds yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The epoch of the holder, if any.
    pub fn epoch(&self) -> Option<u64> {
        self.epoch
    }

    /// Whether a process of `epoch` would be admitted (nothing changes).
    pub fn admits(&self, epoch: u64) -> Result<(), u64> {
        match self.epoch {
            Some(newest) if epoch < newest => Err(newest),
            _ => Ok(()),
        }
    }

    /// A process of `epoch` claims the place: it holds it unless one of a newer epoch does. An
    /// equal epoch is admitted (a process reconnecting takes its own place back).
    pub fn claim(&mut self, epoch: u64) -> Claim {
        match self.admits(epoch) {
            Err(newest) => Claim::Stale { newest },
            Ok(()) => {
                let took_over = self.epoch.is_some();
                self.epoch = Some(epoch);
                Claim::Admitted { took_over }
            }
        }
    }
}

/// Whether a fence announced in epoch `announced` ends what was started in epoch `known`: a
/// newer epoch has begun, in which nothing from `known` is answered. A message of epoch `known`
/// reaching a process fenced in `announced` is therefore stale and refused.
pub fn fenced_since(known: u64, announced: u64) -> bool {
    announced > known
}

/// The epoch a process is in once it hears of `announced` while in `current`: epochs never go
/// back, so a late or replayed announcement of an older one changes nothing.
pub fn newest_of(current: u64, announced: u64) -> u64 {
    current.max(announced)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_holds_and_the_stale_are_refused() {
        let mut place = Newest::new();
        assert_eq!(place.admits(0), Ok(()));
        assert_eq!(place.claim(2), Claim::Admitted { took_over: false });
        assert_eq!(place.claim(2), Claim::Admitted { took_over: true }, "the same epoch reconnecting");
        assert_eq!(place.claim(1), Claim::Stale { newest: 2 });
        assert_eq!(place.admits(1), Err(2));
        assert_eq!(place.claim(5), Claim::Admitted { took_over: true });
        assert_eq!(place.epoch(), Some(5));
        assert!(fenced_since(4, 5) && !fenced_since(5, 5) && !fenced_since(6, 5));
        assert_eq!((newest_of(4, 5), newest_of(5, 4)), (5, 5));
    }
}
