//! The forwards of an engine connection's puts in flight ([`PUT_IN_FLIGHT`]): the connection's
//! thread keeps each chunk and answers `Taken` (the engine may gather its next step into the
//! region), then hands the chunk to a thread of the connection's own that forwards the chunks one
//! after another, in order, and answers each put once its forward is over. The engine's next step
//! is then gathered and kept while the one before crosses to the successor.

use std::io::{BufWriter, Write};
use std::os::unix::net::UnixStream;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::thread::Scope;

use crossbeam_channel::{unbounded, Receiver, Sender};
use dejavulib::chunk::ChunkDescriptor;
use dejavulib::wire::{write_frame, ErrorCode, Frame, FrameHeader, Kind};
use parking_lot::Mutex;
use tracing::warn;

use super::{reply_error, Sidecar};

#[cfg(doc)]
use dejavulib::local::PUT_IN_FLIGHT;

/// The engine connection's writer, shared by its thread and its forwarding thread: each frame is
/// written whole under the lock.
pub(super) type SharedWriter = Mutex<BufWriter<UnixStream>>;

/// A chunk kept from a put in flight, to forward.
pub(super) struct ForwardJob {
    /// The put (its payload is empty: the chunk crossed the region).
    pub(super) request: Frame,
    pub(super) descriptor: ChunkDescriptor,
    /// The chunk as kept: header, then payload.
    pub(super) kept: Arc<Vec<u8>>,
    /// The engine's epoch.
    pub(super) epoch: u64,
}

/// A connection's forwarding thread, started with its first put in flight, and how many of the
/// forwards handed to it are not answered yet.
pub(super) struct Forwards<'scope, 'env> {
    scope: &'scope Scope<'scope, 'env>,
    sidecar: &'env Sidecar,
    writer: &'env SharedWriter,
    /// The jobs' way to the thread, and each answer's way back, once the thread runs.
    thread: Option<(Sender<ForwardJob>, Receiver<()>)>,
    unanswered: usize,
}

impl<'scope, 'env> Forwards<'scope, 'env> {
    /// No thread yet: a connection that never puts in flight never starts one.
    pub(super) fn new(
        scope: &'scope Scope<'scope, 'env>,
        sidecar: &'env Sidecar,
        writer: &'env SharedWriter,
    ) -> Self {
        Self { scope, sidecar, writer, thread: None, unanswered: 0 }
    }

    /// Hands a kept chunk to the forwarding thread, behind those before it; gives it back if the
    /// thread is gone.
    pub(super) fn push(&mut self, job: ForwardJob) -> Result<(), Box<ForwardJob>> {
        let (sidecar, writer) = (self.sidecar, self.writer);
        let (jobs, _) = self.thread.get_or_insert_with(|| {
            let (jobs, queue) = unbounded();
            let (answered, answers) = unbounded();
            self.scope.spawn(move || forward_in_order(sidecar, writer, queue, answered));
            (jobs, answers)
        });
        jobs.send(job).map_err(|unsent| Box::new(unsent.0))?;
        self.unanswered += 1;
        Ok(())
    }

    /// Waits until every forward handed over so far is answered. If the forwarding thread is
    /// gone (it panicked), the puts it did not answer never will be: the connection is shut, so
    /// that the engine hears of it instead of waiting for ever.
    pub(super) fn drain(&mut self) {
        let Some((_, answers)) = &self.thread else { return };
        while self.unanswered > 0 {
            if answers.recv().is_err() {
                self.unanswered = 0;
                let _ = self.writer.lock().get_ref().shutdown(std::net::Shutdown::Both);
                return;
            }
            self.unanswered -= 1;
        }
    }
}

/// The forwarding thread: forwards each job's chunk, in order, and answers its put with `PutAck`
/// or `Error`. It ends once the connection's thread drops its end of `queue`, after the last job.
fn forward_in_order(
    sidecar: &Sidecar,
    writer: &SharedWriter,
    queue: Receiver<ForwardJob>,
    answered: Sender<()>,
) {
    for ForwardJob { request, descriptor, kept, epoch } in queue {
        // A forward that panics is answered as failed, so that its engine does not wait for
        // ever; the next ones are still tried.
        let forwarded =
            std::panic::catch_unwind(AssertUnwindSafe(|| sidecar.forward(&descriptor, &kept, epoch)));
        // The engine's next step of the same place may have replaced the chunk while it crossed:
        // its buffer then serves the next chunk instead of a fresh one.
        sidecar.store.give_back(kept);
        let mut writer = writer.lock();
        let written = match forwarded {
            Err(_) => reply_error(&mut *writer, &request, ErrorCode::Other, "the forward panicked"),
            Ok(Ok(())) => {
                let ack = FrameHeader::new(Kind::PutAck, sidecar.index(), epoch, request.header.request);
                write_frame(&mut *writer, &ack, &[]).and_then(|()| writer.flush()).map_err(Into::into)
            }
            Ok(Err(e)) => reply_error(&mut *writer, &request, ErrorCode::Other, &e.to_string()),
        };
        drop(writer);
        if let Err(e) = written {
            // The engine is gone; the chunks it handed over are still forwarded.
            warn!(stage = sidecar.index(), "a forward's answer was not delivered: {e}");
        }
        let _ = answered.send(());
    }
}
