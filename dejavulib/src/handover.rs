//! Pieces of a buffer being gathered, handed to a consumer in order as soon as they and those
//! before them are gathered ([`crate::KvCache::gather_streamed`]): on a thread of the consumer's
//! own ([`in_order`]), or by the gathering threads themselves ([`Handover`]).

use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crossbeam_channel::Receiver;
use parking_lot::Mutex;

/// The bytes of `range` of the buffer at `base`.
///
/// # Safety
/// `range` lies in a live buffer at `base`, whose bytes in it were written before this call (in
/// an order another thread's write is visible to this one) and are not written while the slice
/// lives.
pub(crate) unsafe fn piece_at<'a>(base: usize, range: &Range<u64>) -> &'a [u8] {
    // SAFETY: forwarded contract.
    unsafe {
        std::slice::from_raw_parts(
            (base + range.start as usize) as *const u8,
            (range.end - range.start) as usize,
        )
    }
}

/// Hands the pieces of a buffer that several threads gather to a sink, in order, on whichever
/// gathering thread finds the next piece gathered and the sink free.
pub(crate) struct Handover<'a, S> {
    /// Each piece's range of the buffer, in order.
    ranges: &'a [Range<u64>],
    /// The buffer's address.
    base: usize,
    /// Whether each piece is gathered.
    gathered: Vec<AtomicBool>,
    /// How many pieces are gathered.
    gathered_count: AtomicUsize,
    /// The sink, the next piece to hand it, and whether it wants more.
    sink: Mutex<(S, usize, bool)>,
}

impl<'a, S: FnMut(&[u8]) -> bool> Handover<'a, S> {
    /// A handover of the pieces `ranges` of the buffer at `base` to `sink`; none gathered yet.
    pub(crate) fn new(ranges: &'a [Range<u64>], base: usize, sink: S) -> Self {
        let gathered = ranges.iter().map(|_| AtomicBool::new(false)).collect();
        Self {
            ranges,
            base,
            gathered,
            gathered_count: AtomicUsize::new(0),
            sink: Mutex::new((sink, 0, true)),
        }
    }

    /// Piece `group` is gathered: unless another thread holds the sink, hands over the pieces
    /// that are gathered, in order, while the gather goes on. Once the last piece is gathered,
    /// the rest waits for [`Handover::finish`], so that the layers' locks are not held for more
    /// than the piece a thread is handing over then.
    pub(crate) fn gathered(&self, group: usize) {
        self.gathered[group].store(true, Ordering::Release);
        self.gathered_count.fetch_add(1, Ordering::AcqRel);
        if let Some(mut sink) = self.sink.try_lock() {
            self.hand_over(&mut sink, || self.gathered_count.load(Ordering::Acquire) < self.ranges.len());
        }
    }

    /// Every piece is gathered: hands over those left.
    pub(crate) fn finish(self) {
        let mut sink = self.sink.lock();
        self.hand_over(&mut sink, || true);
        debug_assert_eq!(sink.1, self.ranges.len(), "every piece was gathered");
    }

    /// Hands over pieces, in order, as long as the next one is gathered and `go_on` says so.
    fn hand_over(&self, (sink, next, wanted): &mut (S, usize, bool), go_on: impl Fn() -> bool) {
        while go_on() {
            let Some(range) = self.ranges.get(*next).filter(|_| self.gathered[*next].load(Ordering::Acquire))
            else {
                return;
            };
            // Moved on first: a sink that panics (the lock does not poison) is never handed the
            // same piece again, nor any other.
            *next += 1;
            if std::mem::take(wanted) {
                // SAFETY: the piece lies in the buffer being gathered (the pieces cover it), which
                // the gather borrows exclusively until it returns, after `finish`; its bytes were
                // written before its flag was set (release, read above with acquire), and no
                // thread writes them again (the pieces are disjoint).
                *wanted = sink(unsafe { piece_at(self.base, range) });
            }
        }
    }
}

/// The ranges of the groups announced on `arrivals`, in the order of `ranges`: a group that
/// finishes before those ahead of it (gathered by another thread) waits for them.
pub(crate) fn in_order(
    arrivals: Receiver<usize>,
    ranges: &[Range<u64>],
) -> impl Iterator<Item = Range<u64>> + '_ {
    let mut waiting = BTreeSet::new();
    let mut next = 0;
    let mut arrivals = arrivals.into_iter();
    std::iter::from_fn(move || {
        while !waiting.remove(&next) {
            waiting.insert(arrivals.next()?);
        }
        next += 1;
        Some(ranges[next - 1].clone())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_handover_gives_pieces_in_order_while_the_gather_goes_on_and_stops_with_its_sink() {
        let buffer: Vec<u8> = (0..100).collect();
        let ranges: Vec<Range<u64>> = (0..10).map(|i| i * 10..i * 10 + 10).collect();
        let base = buffer.as_ptr() as usize;
        let handed = std::cell::RefCell::new(Vec::new());
        let sink = |bytes: &[u8]| {
            handed.borrow_mut().push(bytes.to_vec());
            true
        };
        let handover = Handover::new(&ranges, base, sink);
        // Pieces gathered out of order wait for those before them; once the last is gathered,
        // what is left waits for `finish`.
        let counts: Vec<usize> = [3, 1, 0, 2, 9, 4, 5, 8, 6, 7]
            .into_iter()
            .map(|group| {
                handover.gathered(group);
                handed.borrow().len()
            })
            .collect();
        assert_eq!(counts, [0, 0, 2, 4, 4, 5, 6, 6, 7, 7]);
        handover.finish();
        assert_eq!(handed.borrow().concat(), buffer, "every piece, once, in order");

        // A sink that wants no more, or panics, is handed nothing after.
        for panics in [false, true] {
            let calls = std::cell::Cell::new(0);
            let handover = Handover::new(&ranges, base, |_: &[u8]| {
                calls.set(calls.get() + 1);
                assert!(!panics || calls.get() < 2, "the sink fails");
                calls.get() < 2
            });
            for group in 0..10 {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handover.gathered(group)));
            }
            handover.finish();
            assert_eq!(calls.get(), 2, "panics: {panics}");
        }
    }
}
