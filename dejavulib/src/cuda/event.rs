//! Points in a stream's work: how the copy stream and an engine's compute stream order their work
//! without the host blocking either.

use cudarc::driver::{sys, CudaEvent};

use super::CudaError;

/// The work an engine had enqueued on its compute stream when it was marked (a layer or a step it
/// has just launched): a copy the library orders after it reads what that work wrote.
pub struct ReadyMarker {
    pub(super) event: CudaEvent,
}

impl std::fmt::Debug for ReadyMarker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadyMarker").finish_non_exhaustive()
    }
}

/// The copies enqueued on the copy stream up to a point (a swap-in, a gather and its download).
/// The host can poll or sleep on it; an engine's compute stream can be made to wait for it.
pub struct CopiesDone {
    pub(super) event: CudaEvent,
}

impl std::fmt::Debug for CopiesDone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopiesDone").finish_non_exhaustive()
    }
}

impl CopiesDone {
    /// Whether the copies are done, without waiting. An error of any of them is reported here.
    pub fn is_done(&self) -> Result<bool, CudaError> {
        Ok(self.event.try_is_complete()?)
    }

    /// Blocks the calling thread until the copies are done; it sleeps, it does not spin (the event
    /// is made with blocking synchronisation).
    pub fn wait(&self) -> Result<(), CudaError> {
        Ok(self.event.synchronize()?)
    }

    /// Makes `stream` (an engine's compute stream) wait for the copies before its later work: what
    /// an engine calls before the layer that reads a prefetched microbatch. Neither the host nor
    /// the copy stream blocks.
    ///
    /// # Safety
    /// `stream` must be a live stream of the context the copies ran in.
    pub unsafe fn make_wait(&self, stream: sys::CUstream) -> Result<(), CudaError> {
        self.event.context().bind_to_thread()?;
        // SAFETY: `stream` is live (the caller's promise) and the event is alive for the call.
        unsafe {
            cudarc::driver::result::stream::wait_event(
                stream,
                self.event.cu_event(),
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }?;
        Ok(())
    }
}
