//! A sidecar's replication of its engine's KV to the ring successor's sidecar: what it forwards,
//! in which order, what waits after a failed forward, what it gives up on, and what it answers the
//! engine for each chunk.
//!
//! The sidecar keeps each chunk its engine writes (the local copy), then forwards it. Chunks whose
//! forward failed wait in a backlog, oldest first, and go before the next chunk: the successor
//! receives a stage's chunks in the order they were kept. The engine hears
//! [`Answer::Forwarded`] for a chunk only once the successor stored it and every chunk kept before
//! it: a step reported done is held locally and at the successor.
//!
//! A new successor (after a recovery re-seeded it with every chunk this sidecar keeps) clears the
//! backlog: what the old successor lacked, the new one got whole. A forward still under way to the
//! old one when the successor changed answers nothing about the new one
//! ([`Answer::SuccessorChanged`]).
//!
//! The machine holds keys only; the sidecar holds the chunks, sends them and reports each
//! outcome ([`Forwarding::sent`]). One chunk is forwarded at a time.

use std::collections::VecDeque;

/// Chunks that may wait for a forward, by default: beyond, the oldest are given up on (a
/// recovery that needs them recomputes them).
pub const DEFAULT_BACKLOG: usize = 4096;

/// What became of one forward, as the sidecar saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sent {
    /// The successor stored the chunk.
    Stored,
    /// The forward failed (the successor is down, slow or cut off): the chunk waits.
    Failed,
    /// The successor refused it for good: a newer engine of this stage wrote there.
    Refused,
    /// The sidecar no longer holds the chunk (its engine released the sequence): nothing to send.
    Gone,
}

/// What the engine hears about the chunk it wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Kept here, and stored at the successor with every chunk kept before it.
    Forwarded,
    /// Kept here; its forward (or an older chunk's) failed, and it waits in the backlog.
    Waiting,
    /// Kept here; no successor is named, so nothing is forwarded.
    NoSuccessor,
    /// Kept here; the successor refused it: a newer engine of this stage has written there.
    Refused,
    /// Kept here, then released before it was forwarded.
    Released,
    /// Kept here; the successor changed while it was forwarded. The new successor is re-seeded
    /// with everything kept here, but this forward answers nothing about it.
    SuccessorChanged,
}

/// What the sidecar does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next<K> {
    /// Send chunk `key`, as its engine of `epoch` wrote it, to the successor of `successor`
    /// (a generation: [`Forwarding::successor_named`]), then report with [`Forwarding::sent`].
    Send {
        /// The chunk.
        key: K,
        /// The epoch of the engine that wrote it.
        epoch: u64,
        /// Which successor it goes to.
        successor: u64,
    },
    /// Answer the engine: the chunk's forward is settled, for now.
    Answer(Answer),
}

/// A chunk waiting for its forward.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Waiting<K> {
    /// Its place in keep order.
    number: u64,
    key: K,
    epoch: u64,
}

/// What a forwarding has done, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Forwards the successor stored.
    pub stored: u64,
    /// Of those, chunks that had waited after a failed forward.
    pub caught_up: u64,
    /// Forwards that failed.
    pub failed: u64,
    /// Chunks given up on: refused by the successor, or pushed out of a full backlog.
    pub dropped: u64,
}

/// A sidecar's forwarding to its successor (see the module's documentation).
#[derive(Clone, Debug)]
pub struct Forwarding<K> {
    /// The current successor's generation, if one is named.
    successor: Option<u64>,
    /// Generations handed out so far.
    generations: u64,
    /// Chunks kept but not yet stored at the successor, oldest first.
    backlog: VecDeque<Waiting<K>>,
    capacity: usize,
    /// Chunks kept so far (numbers them).
    kept: u64,
    counts: Counts,
}

/// A ticket for one chunk's forward: pass it back to [`Forwarding::sent`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket(u64);

/// What keeping a chunk starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kept<K> {
    /// The chunk's ticket.
    pub ticket: Ticket,
    /// What to do next.
    pub next: Next<K>,
    /// The oldest waiting chunk, given up on to make room in a full backlog.
    pub given_up: Option<K>,
}

impl<K: Clone> Forwarding<K> {
    /// A forwarding with no successor yet, whose backlog holds at most `capacity` chunks (at
    /// least one).
    pub fn new(capacity: usize) -> Self {
        Self {
            successor: None,
            generations: 0,
            backlog: VecDeque::new(),
            capacity: capacity.max(1),
            kept: 0,
            counts: Counts::default(),
        }
    }

    /// A new successor is named (it is re-seeded with everything kept here): returns its
    /// generation. The backlog is cleared.
    pub fn successor_named(&mut self) -> u64 {
        self.generations += 1;
        self.successor = Some(self.generations);
        self.backlog.clear();
        self.generations
    }

    /// The current successor's generation, if one is named.
    pub fn successor(&self) -> Option<u64> {
        self.successor
    }

    /// Chunks waiting for their forward.
    pub fn waiting(&self) -> usize {
        self.backlog.len()
    }

    /// What it has done so far.
    pub fn counts(&self) -> Counts {
        self.counts
    }

    /// The engine of `epoch` wrote chunk `key`, and the sidecar kept it: it waits behind the
    /// backlog.
    pub fn kept(&mut self, key: K, epoch: u64) -> Kept<K> {
        self.kept += 1;
        let ticket = Ticket(self.kept);
        if self.successor.is_none() {
            return Kept { ticket, next: Next::Answer(Answer::NoSuccessor), given_up: None };
        }
        let mut given_up = None;
        if self.backlog.len() == self.capacity {
            given_up = self.backlog.pop_front().map(|oldest| oldest.key);
            self.counts.dropped += 1;
        }
        self.backlog.push_back(Waiting { number: ticket.0, key, epoch });
        Kept { ticket, next: self.next(ticket), given_up }
    }

    /// The forward `next` asked for (to successor generation `successor`) ended with `outcome`.
    /// Returns what to do next for the chunk of `ticket`.
    pub fn sent(&mut self, ticket: Ticket, successor: u64, outcome: Sent) -> Next<K> {
        if self.successor != Some(successor) {
            return Next::Answer(Answer::SuccessorChanged);
        }
        let Some(front) = self.backlog.front() else {
            // Nothing was in flight: a report of nothing; the ticket's chunk left the backlog.
            return Next::Answer(Answer::SuccessorChanged);
        };
        let number = front.number;
        let caught_up = number != ticket.0;
        match outcome {
            Sent::Failed => {
                self.counts.failed += 1;
                return Next::Answer(Answer::Waiting);
            }
            Sent::Stored => {
                self.counts.stored += 1;
                self.counts.caught_up += u64::from(caught_up);
            }
            Sent::Refused => self.counts.dropped += 1,
            Sent::Gone => {}
        }
        self.backlog.pop_front();
        if number == ticket.0 {
            return Next::Answer(match outcome {
                Sent::Stored => Answer::Forwarded,
                Sent::Refused => Answer::Refused,
                Sent::Gone => Answer::Released,
                Sent::Failed => unreachable!("a failed forward answered above"),
            });
        }
        self.next(ticket)
    }

    /// The oldest waiting chunk's forward (the ticket's chunk waits behind it, or is it).
    fn next(&self, ticket: Ticket) -> Next<K> {
        match (self.backlog.front(), self.successor) {
            (Some(front), Some(successor)) => {
                debug_assert!(front.number <= ticket.0, "one forward at a time");
                Next::Send { key: front.key.clone(), epoch: front.epoch, successor }
            }
            (_, None) => Next::Answer(Answer::NoSuccessor),
            (None, Some(_)) => Next::Answer(Answer::SuccessorChanged),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the forward of one kept chunk against `outcome`, returning the keys sent and the
    /// answer.
    fn forward(
        f: &mut Forwarding<u32>,
        key: u32,
        mut outcome: impl FnMut(u32) -> Sent,
    ) -> (Vec<u32>, Answer) {
        let Kept { ticket, mut next, .. } = f.kept(key, 0);
        let mut sent = Vec::new();
        loop {
            match next {
                Next::Send { key, successor, .. } => {
                    sent.push(key);
                    next = f.sent(ticket, successor, outcome(key));
                }
                Next::Answer(answer) => return (sent, answer),
            }
        }
    }

    #[test]
    fn a_chunk_is_answered_forwarded_only_after_everything_kept_before_it() {
        let mut f = Forwarding::new(8);
        assert_eq!(forward(&mut f, 1, |_| Sent::Stored), (vec![], Answer::NoSuccessor));
        f.successor_named();
        assert_eq!(forward(&mut f, 2, |_| Sent::Stored), (vec![2], Answer::Forwarded));
        assert_eq!(forward(&mut f, 3, |_| Sent::Failed), (vec![3], Answer::Waiting));
        // 4 waits behind 3, which fails again: 4 is not even tried.
        assert_eq!(forward(&mut f, 4, |_| Sent::Failed), (vec![3], Answer::Waiting));
        assert_eq!(f.waiting(), 2);
        assert_eq!(forward(&mut f, 5, |_| Sent::Stored), (vec![3, 4, 5], Answer::Forwarded));
        assert_eq!(f.counts(), Counts { stored: 4, caught_up: 2, failed: 2, dropped: 0 });
    }

    #[test]
    fn refused_and_released_chunks_leave_the_backlog() {
        let mut f = Forwarding::new(8);
        f.successor_named();
        assert_eq!(forward(&mut f, 1, |_| Sent::Failed).1, Answer::Waiting);
        assert_eq!(forward(&mut f, 2, |_| Sent::Failed).1, Answer::Waiting);
        let outcome = |key| match key {
            1 => Sent::Refused,
            2 => Sent::Gone,
            _ => Sent::Stored,
        };
        assert_eq!(forward(&mut f, 3, outcome), (vec![1, 2, 3], Answer::Forwarded));
        assert_eq!(forward(&mut f, 4, |_| Sent::Refused), (vec![4], Answer::Refused));
        assert_eq!(f.waiting(), 0);
    }

    #[test]
    fn a_full_backlog_gives_up_its_oldest_and_a_new_successor_clears_it() {
        let mut f = Forwarding::new(2);
        f.successor_named();
        for key in 1..=3 {
            forward(&mut f, key, |_| Sent::Failed);
        }
        assert_eq!((f.waiting(), f.counts().dropped), (2, 1));
        assert_eq!(forward(&mut f, 4, |_| Sent::Stored), (vec![3, 4], Answer::Forwarded));
        forward(&mut f, 5, |_| Sent::Failed);
        let Kept { ticket, next, .. } = f.kept(6, 0);
        let Next::Send { successor, .. } = next else { panic!("{next:?}") };
        let newer = f.successor_named();
        assert_eq!(f.waiting(), 0, "the re-seed carries what waited");
        assert_eq!(f.sent(ticket, successor, Sent::Stored), Next::Answer(Answer::SuccessorChanged));
        assert_eq!(forward(&mut f, 7, |_| Sent::Stored), (vec![7], Answer::Forwarded));
        assert_eq!(f.successor(), Some(newer));
    }
}
