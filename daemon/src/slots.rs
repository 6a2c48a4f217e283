//! A bound on connections served at once, each on a thread of its own: a [`Slot`] is taken before
//! the thread starts and given back when dropped, whether the thread ended, panicked or never
//! started.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// One of at most `limit` slots of a shared count.
#[derive(Debug)]
pub(crate) struct Slot(Arc<AtomicUsize>);

impl Slot {
    /// A slot of `taken`, if fewer than `limit` are taken.
    pub(crate) fn take(taken: &Arc<AtomicUsize>, limit: usize) -> Option<Self> {
        let took = taken.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < limit).then_some(n + 1));
        took.ok().map(|_| Self(taken.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_run_out_at_the_limit_and_come_back_when_dropped() {
        let taken = Arc::new(AtomicUsize::new(0));
        let first = Slot::take(&taken, 2).unwrap();
        let second = Slot::take(&taken, 2).unwrap();
        assert!(Slot::take(&taken, 2).is_none());
        drop(first);
        let third = Slot::take(&taken, 2).unwrap();
        assert!(Slot::take(&taken, 2).is_none());
        // A slot moved into a closure that never runs comes back with the closure.
        let never = move || drop(third);
        drop(never);
        drop(second);
        assert_eq!(taken.load(Ordering::SeqCst), 0);
    }
}
