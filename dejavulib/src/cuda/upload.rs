//! Copy tables too large to travel as a kernel parameter, uploaded without blocking the host: a
//! ring of slots, each a piece of pinned host memory and a piece of device memory allocated once.
//! A table is written into a slot's pinned memory, copied up on the launching stream, and read by
//! its kernel there; an event after the kernel says when the slot is free again. Where the next
//! slot is still in use, the table goes up the slow way rather than wait. (A copy from
//! pageable memory, as `clone_htod` of a `Vec` is, goes through the driver's own staging and
//! costs an allocation and a free per launch.)

use std::sync::Arc;

use cudarc::driver::{result, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};
use parking_lot::Mutex;

use super::CudaError;

/// Slots in the ring: more than the kernels a copy keeps in flight at once.
const SLOTS: usize = 16;

/// Words a slot holds: 256 blocks of the table's 19 words (a stage's layers, K and V, each its
/// own buffer, with room to spare). A larger table is uploaded the slow way.
pub(super) const SLOT_WORDS: usize = 256 * super::table::WORDS;

/// The ring.
pub(super) struct TableUploads {
    /// Keeps the pinned memory at `host` allocated.
    _pinned: PinnedHostSlice<u64>,
    /// Keeps the device memory at `device` allocated.
    _device: CudaSlice<u64>,
    /// The first word of each ring, as numbers (taken once: neither moves).
    host: usize,
    device: u64,
    /// The next slot to use, and the event after the last kernel that read each slot.
    state: Mutex<(usize, Vec<Option<CudaEvent>>)>,
}

impl TableUploads {
    pub(super) fn new(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) -> Result<Self, CudaError> {
        // SAFETY: the memory is only written (a slot at a time, below) before it is read.
        let mut pinned = unsafe { ctx.alloc_pinned_with_flags::<u64>(SLOTS * SLOT_WORDS, 0) }?;
        let device = stream.alloc_zeros::<u64>(SLOTS * SLOT_WORDS)?;
        let host = pinned.as_mut_slice()?.as_mut_ptr() as usize;
        let (address, record) = device.device_ptr(stream);
        drop(record);
        stream.synchronize()?;
        let events = (0..SLOTS).map(|_| None).collect();
        Ok(Self { _pinned: pinned, _device: device, host, device: address, state: Mutex::new((0, events)) })
    }

    /// Uploads `words` (at most `SLOT_WORDS`) on `stream` into the next slot and calls `launch`
    /// with their device address, then marks the slot busy until the work queued on `stream` so
    /// far is done (the copy up and the kernel, also when the launch failed). Returns `None`,
    /// launching nothing, where the next slot is still busy (sixteen uploads queued behind a
    /// stream that has not run them): the caller uploads the slow way instead of waiting.
    pub(super) fn with_table(
        &self,
        stream: &Arc<CudaStream>,
        words: &[u64],
        launch: impl FnOnce(u64) -> Result<(), CudaError>,
    ) -> Result<Option<()>, CudaError> {
        assert!(words.len() <= SLOT_WORDS, "a table of {} words in a slot of {SLOT_WORDS}", words.len());
        let (next, events) = &mut *self.state.lock();
        let slot = *next;
        if let Some(busy) = &events[slot] {
            if !busy.is_complete() {
                return Ok(None);
            }
        }
        *next = (slot + 1) % SLOTS;
        let offset = slot * SLOT_WORDS;
        // SAFETY: the slot lies inside the pinned ring (`SLOTS * SLOT_WORDS` words at `host`),
        // and nothing reads it now: its last copy up finished before its event (complete).
        let host =
            unsafe { std::slice::from_raw_parts_mut((self.host as *mut u64).add(offset), words.len()) };
        host.copy_from_slice(words);
        let address = self.device + (offset * std::mem::size_of::<u64>()) as u64;
        // SAFETY: `address` is this slot of the device ring, `host` pinned memory as long; the
        // slot is not written again before the event recorded below (after the kernel) is done.
        unsafe { result::memcpy_htod_async(address, &*host, stream.cu_stream()) }?;
        let launched = launch(address);
        let done = match events[slot].take() {
            Some(event) => event,
            None => stream.context().new_event(None)?,
        };
        // Recorded whatever the launch did: the copy up is queued either way.
        done.record(stream)?;
        events[slot] = Some(done);
        launched.map(Some)
    }
}
