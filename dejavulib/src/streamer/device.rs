//! Sending KV out of device memory: the streamer's GPU path. Once the engine's compute stream has
//! passed the point it marked, a gather kernel packs the region into device staging and one copy
//! moves it into pinned host memory ([`CudaEngine::gather_to_host`]); the chunk then goes to a
//! store like any other.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use crate::cuda::{CopiesDone, CudaEngine, CudaError, DeviceBuffer, DeviceKv, PinnedBuffer, ReadyMarker};
use crate::reshard::{describe, ChunkReceipt, StreamError, Transfer};
use crate::store::ChunkStore;

/// One unit of GPU work for the streamer: send `tokens` of `transfer` out of `kv`, a cache in
/// device memory, once the engine's compute stream has passed `ready`.
#[derive(Clone)]
pub struct DeviceJob {
    /// The engine whose copy stream does the copies.
    pub engine: Arc<CudaEngine>,
    /// The source cache in device memory (the engine goes on writing other layers of it).
    pub kv: Arc<DeviceKv>,
    /// What to send, and where it lands.
    pub transfer: Transfer,
    /// Token range.
    pub tokens: Range<u32>,
    /// Where the engine's compute stream wrote the region (see [`CudaEngine::mark_ready`]);
    /// `None` when it is already written.
    pub ready: Option<Arc<ReadyMarker>>,
}

impl std::fmt::Debug for DeviceJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceJob")
            .field("transfer", &self.transfer)
            .field("tokens", &self.tokens)
            .finish_non_exhaustive()
    }
}

/// Device staging and pinned host memory a sending thread keeps between jobs: allocating
/// either is slow, so they grow to the largest chunk seen and are reused.
#[derive(Default)]
pub struct DeviceStaging {
    buffers: Option<(Arc<CudaEngine>, DeviceBuffer, PinnedBuffer)>,
}

impl DeviceStaging {
    /// Buffers of `engine` holding at least `bytes`.
    fn lease(
        &mut self,
        engine: &Arc<CudaEngine>,
        bytes: u64,
    ) -> Result<(&mut DeviceBuffer, &mut PinnedBuffer), CudaError> {
        let fits = matches!(&self.buffers, Some((owner, device, _)) if Arc::ptr_eq(owner, engine) && device.len() as u64 >= bytes);
        if !fits {
            // Free the old pair first: the new one may need the room.
            self.buffers = None;
            let size = (bytes as usize).next_power_of_two();
            self.buffers = Some((engine.clone(), engine.alloc(size)?, engine.pinned(size)?));
        }
        let (_, device, pinned) = self.buffers.as_mut().expect("just filled");
        Ok((device, pinned))
    }
}

/// Runs `job`: waits (on the copy stream) for its ready point, gathers, downloads, sleeps until
/// the copies are done, and puts the chunk into `store`.
pub fn send_from_device(
    job: &DeviceJob,
    staging: &mut DeviceStaging,
    store: &mut dyn ChunkStore,
) -> Result<ChunkReceipt, StreamError> {
    let layout = job.kv.layout();
    let region = job.transfer.from.with_tokens(job.tokens.clone());
    let packing = layout.preferred_packing();
    layout.check_region(&region).map_err(crate::cache::CacheError::from)?;
    let descriptor = describe(layout, &job.transfer, job.tokens.clone())?;
    let bytes = job.kv.packed_len(&region);
    if bytes == 0 {
        return Ok(ChunkReceipt {
            key: descriptor.key(),
            bytes: 0,
            copy_time: Default::default(),
            io_time: Default::default(),
        });
    }
    let started = Instant::now();
    let (device, pinned) = staging.lease(&job.engine, bytes)?;
    if let Some(ready) = &job.ready {
        job.engine.wait_for(ready)?;
    }
    let done: CopiesDone = job.engine.gather_to_host(&job.kv, &region, packing, device, pinned)?;
    done.wait()?;
    let copied = Instant::now();
    store.put(&descriptor, &pinned.as_slice()?[..bytes as usize])?;
    Ok(ChunkReceipt { key: descriptor.key(), bytes, copy_time: copied - started, io_time: copied.elapsed() })
}
