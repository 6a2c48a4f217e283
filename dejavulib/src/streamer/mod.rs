//! The background streamer: moves KV while the engine computes.
//!
//! The engine says "layer `l` of microbatch `m` is ready" (prompt streaming) or "step `t` is done"
//! (decode deltas); the streamer thread gathers that region and flushes it while the engine goes on
//! with the next layer or step. Jobs run in submission order on one thread, so layers of a
//! microbatch arrive in order. The queue is bounded (a full queue blocks `submit`: backpressure).
//! Each job returns a [`Completion`] to wait on or poll; nothing spins.
//!
//! The same thread drives the GPU path ([`Streamer::submit_device`], [`Streamer::device_layer_ready`]):
//! the engine marks a point on its compute stream, and the copy stream, not the host, waits for it
//! before the gather kernel and the copy to pinned memory; the streamer thread sleeps until they
//! are done and flushes the chunk.

mod device;

pub use device::{send_from_device, DeviceJob, DeviceStaging};

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender, TryRecvError};
use thiserror::Error;

use crate::affinity::CpuList;
use crate::cache::KvCache;
use crate::cuda::{CudaEngine, DeviceKv};
use crate::memory::StagingPool;
use crate::reshard::{send, start_send, ChunkReceipt, InFlight, Sending, StreamError, Transfer};
use crate::store::ChunkStore;

/// Errors a streamer job or the streamer itself reports.
#[derive(Debug, Error)]
pub enum StreamerError {
    /// The job ran and failed.
    #[error(transparent)]
    Stream(#[from] StreamError),
    /// The job was cancelled by a cancelling shutdown before it ran.
    #[error("cancelled before it ran")]
    Cancelled,
    /// The streamer no longer accepts jobs.
    #[error("streamer is shut down")]
    ShutDown,
    /// The store panicked while the streamer used it: this job, and every later one, is not sent.
    #[error("streamer's store panicked; the streamer no longer sends")]
    WorkerGone,
    /// `wait_timeout` ran out.
    #[error("timed out waiting for the job")]
    Timeout,
}

/// One unit of work: send `tokens` of `transfer` from `cache`.
#[derive(Clone, Debug)]
pub struct StreamJob {
    /// The source cache (the engine keeps writing other layers of it meanwhile).
    pub cache: Arc<KvCache>,
    /// What to send, and where it lands.
    pub transfer: Transfer,
    /// Token range.
    pub tokens: Range<u32>,
}

/// A job of either kind.
enum Work {
    Host(StreamJob),
    Device(DeviceJob),
}

struct Envelope {
    work: Work,
    done: Sender<Result<ChunkReceipt, StreamerError>>,
}

/// A handle on one submitted job.
pub struct Completion {
    rx: Receiver<Result<ChunkReceipt, StreamerError>>,
    taken: std::cell::Cell<bool>,
}

impl Completion {
    /// Blocks until the job finishes.
    pub fn wait(self) -> Result<ChunkReceipt, StreamerError> {
        self.rx.recv().unwrap_or(Err(StreamerError::WorkerGone))
    }

    /// Blocks at most `timeout`; on timeout the job is still running and `self` can be waited again.
    ///
    /// Like [`Completion::poll`], it yields the result once; after that it times out.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<ChunkReceipt, StreamerError> {
        if self.taken.get() {
            std::thread::sleep(timeout);
            return Err(StreamerError::Timeout);
        }
        let result = match self.rx.recv_timeout(timeout) {
            Ok(result) => result,
            Err(RecvTimeoutError::Timeout) => return Err(StreamerError::Timeout),
            Err(RecvTimeoutError::Disconnected) => Err(StreamerError::WorkerGone),
        };
        self.taken.set(true);
        result
    }

    /// Whether the job has finished (its result may still be taken with [`Completion::poll`] or
    /// [`Completion::wait`]). A job whose streamer is gone never finishes.
    pub fn is_finished(&self) -> bool {
        self.taken.get() || !self.rx.is_empty()
    }

    /// The result if the job has finished, without blocking. Yields the result once, then `None`.
    pub fn poll(&self) -> Option<Result<ChunkReceipt, StreamerError>> {
        if self.taken.get() {
            return None;
        }
        let result = match self.rx.try_recv() {
            Ok(result) => result,
            Err(TryRecvError::Empty) => return None,
            Err(TryRecvError::Disconnected) => Err(StreamerError::WorkerGone),
        };
        self.taken.set(true);
        Some(result)
    }
}

/// How [`Streamer::shutdown`] treats queued jobs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shutdown {
    /// Run every queued job, then stop.
    Drain,
    /// Answer queued jobs with [`StreamerError::Cancelled`], then stop.
    Cancel,
}

/// Totals reported at shutdown.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamerStats {
    /// Jobs that succeeded.
    pub completed: u64,
    /// Jobs that failed.
    pub failed: u64,
    /// Jobs cancelled.
    pub cancelled: u64,
    /// Payload bytes sent.
    pub bytes: u64,
}

/// Settings of a streamer.
#[derive(Clone, Debug)]
pub struct StreamerConfig {
    /// Jobs queued before `submit` blocks.
    pub queue_depth: usize,
    /// Thread name.
    pub name: String,
    /// CPUs the thread runs on (see [`crate::affinity`]); `None`: those of the thread spawning it.
    pub cpus: Option<CpuList>,
    /// Puts the streamer may leave in flight while it gathers the next job, with a store that
    /// keeps a chunk before its put is over ([`ChunkStore::start_put_gathered`]: a sidecar, which
    /// then forwards it): 1 by default, so that a step crosses to the successor while the next
    /// is gathered; 0 waits for each put before the next gather. Jobs complete in order either
    /// way, each once its put is over.
    pub puts_in_flight: usize,
}

impl Default for StreamerConfig {
    fn default() -> Self {
        Self { queue_depth: 64, name: "dejavu-streamer".into(), cpus: None, puts_in_flight: 1 }
    }
}

/// A background thread that gathers and flushes KV regions in submission order.
pub struct Streamer {
    tx: Option<Sender<Envelope>>,
    thread: Option<JoinHandle<Outcome>>,
    cancel: Arc<AtomicBool>,
}

impl Streamer {
    /// Starts the thread; it flushes every chunk to `store`. An error if the thread cannot start
    /// or cannot run on `config.cpus`.
    pub fn spawn(config: StreamerConfig, store: Box<dyn ChunkStore>) -> std::io::Result<Self> {
        let (tx, rx) = bounded::<Envelope>(config.queue_depth.max(1));
        let cancel = Arc::new(AtomicBool::new(false));
        let flag = cancel.clone();
        let (pinned_tx, pinned) = bounded(1);
        let (cpus, window) = (config.cpus, config.puts_in_flight);
        let thread = std::thread::Builder::new().name(config.name).spawn(move || {
            let pin = cpus.map_or(Ok(()), |cpus| cpus.pin_current_thread());
            let refused = pin.is_err();
            let _ = pinned_tx.send(pin);
            if refused {
                return Outcome { stats: StreamerStats::default(), store_panicked: false };
            }
            run(rx, store, flag, window)
        })?;
        if let Ok(Err(e)) = pinned.recv() {
            let _ = thread.join();
            return Err(std::io::Error::other(e));
        }
        Ok(Self { tx: Some(tx), thread: Some(thread), cancel })
    }

    /// Queues a job, blocking while the queue is full.
    pub fn submit(&self, job: StreamJob) -> Result<Completion, StreamerError> {
        self.queue(Work::Host(job))
    }

    /// Queues a job that sends out of device memory (see [`DeviceJob`]), blocking while the queue
    /// is full. Its copies wait for its ready point on the GPU; this call does not.
    pub fn submit_device(&self, job: DeviceJob) -> Result<Completion, StreamerError> {
        self.queue(Work::Device(job))
    }

    fn queue(&self, work: Work) -> Result<Completion, StreamerError> {
        let tx = self.tx.as_ref().ok_or(StreamerError::ShutDown)?;
        let (done, rx) = bounded(1);
        tx.send(Envelope { work, done }).map_err(|_| StreamerError::ShutDown)?;
        Ok(Completion { rx, taken: std::cell::Cell::new(false) })
    }

    /// Layer-by-layer streaming: source-local `layer` of microbatch `microbatch` is ready in `cache`;
    /// queues its part of every transfer in `plan` (one job per destination region).
    pub fn layer_ready(
        &self,
        cache: &Arc<KvCache>,
        plan: &[Transfer],
        microbatch: u32,
        layer: u32,
        tokens: Range<u32>,
    ) -> Result<Vec<Completion>, StreamerError> {
        layer_transfers(plan, microbatch, layer)
            .map(|transfer| self.submit(StreamJob { cache: cache.clone(), transfer, tokens: tokens.clone() }))
            .collect()
    }

    /// Layer-by-layer streaming out of device memory: the engine has just launched the kernels
    /// that write source-local `layer` of microbatch `microbatch` on its stream `compute`. Marks
    /// that point (an event, recorded without blocking) and queues the layer's part of every
    /// transfer in `plan`, each copied once the GPU has passed the mark.
    ///
    /// # Safety
    /// `compute` must be a live stream of `engine`'s context, and `kv` must be the memory those
    /// kernels write.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn device_layer_ready(
        &self,
        engine: &Arc<CudaEngine>,
        kv: &Arc<DeviceKv>,
        compute: cudarc::driver::sys::CUstream,
        plan: &[Transfer],
        microbatch: u32,
        layer: u32,
        tokens: Range<u32>,
    ) -> Result<Vec<Completion>, StreamerError> {
        // SAFETY: the caller's promise on `compute`, passed on.
        let ready = unsafe { engine.mark_ready(compute) }.map_err(StreamError::from)?;
        let ready = Some(Arc::new(ready));
        layer_transfers(plan, microbatch, layer)
            .map(|transfer| {
                self.submit_device(DeviceJob {
                    engine: engine.clone(),
                    kv: kv.clone(),
                    transfer,
                    tokens: tokens.clone(),
                    ready: ready.clone(),
                })
            })
            .collect()
    }

    /// Cancels every job not yet started (they complete with [`StreamerError::Cancelled`]), and
    /// every job submitted later; the job running now finishes. Does not wait.
    pub fn cancel_pending(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }

    /// Stops the thread, draining or cancelling queued jobs, and waits for it to exit.
    pub fn shutdown(mut self, mode: Shutdown) -> Result<StreamerStats, StreamerError> {
        self.stop(mode)
    }

    fn stop(&mut self, mode: Shutdown) -> Result<StreamerStats, StreamerError> {
        if mode == Shutdown::Cancel {
            self.cancel.store(true, Ordering::SeqCst);
        }
        drop(self.tx.take());
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(Outcome { stats, store_panicked: false })) => Ok(stats),
            Some(_) => Err(StreamerError::WorkerGone),
            None => Err(StreamerError::ShutDown),
        }
    }
}

impl Drop for Streamer {
    fn drop(&mut self) {
        if self.thread.is_some() {
            // Errors here mean the thread panicked; nothing more to release.
            let _ = self.stop(Shutdown::Cancel);
        }
    }
}

/// The part of every transfer in `plan` that carries source-local `layer` of `microbatch`.
fn layer_transfers(plan: &[Transfer], microbatch: u32, layer: u32) -> impl Iterator<Item = Transfer> + '_ {
    plan.iter().filter(move |t| t.from.microbatch == microbatch).filter_map(move |t| t.layer(layer))
}

/// What the streamer thread reports when it exits.
struct Outcome {
    stats: StreamerStats,
    store_panicked: bool,
}

/// The streamer thread: runs the jobs in order, leaving at most `window` puts in flight.
fn run(
    rx: Receiver<Envelope>,
    store: Box<dyn ChunkStore>,
    cancel: Arc<AtomicBool>,
    window: usize,
) -> Outcome {
    let pool = StagingPool::default();
    let mut device_staging = DeviceStaging::default();
    let mut jobs = Jobs {
        store,
        stats: StreamerStats::default(),
        store_panicked: false,
        in_flight: VecDeque::new(),
        window,
    };
    // The loop runs until every sender is gone, so every queued job gets an answer, even after a
    // panic: a job's Completion never hangs while the Streamer is alive.
    loop {
        let Envelope { work, done } = match rx.try_recv() {
            Ok(envelope) => envelope,
            Err(TryRecvError::Empty) => {
                // Nothing queued: what is in flight is finished before the thread sleeps, so that
                // a job's completion does not wait for the next job.
                jobs.finish_all();
                match rx.recv() {
                    Ok(envelope) => envelope,
                    Err(_) => break,
                }
            }
            Err(TryRecvError::Disconnected) => break,
        };
        if jobs.store_panicked {
            jobs.stats.failed += 1;
            let _ = done.send(Err(StreamerError::WorkerGone));
        } else if cancel.load(Ordering::SeqCst) {
            jobs.finish_all();
            jobs.stats.cancelled += 1;
            let _ = done.send(Err(StreamerError::Cancelled));
        } else {
            jobs.run(&work, done, &pool, &mut device_staging);
        }
    }
    jobs.finish_all();
    Outcome { stats: jobs.stats, store_panicked: jobs.store_panicked }
}

/// The streamer thread's store, what it has counted, and the sends its store left in flight, each
/// with its job's answer channel, oldest first. Jobs are answered in the order they were queued.
struct Jobs {
    store: Box<dyn ChunkStore>,
    stats: StreamerStats,
    store_panicked: bool,
    in_flight: VecDeque<(InFlight, Sender<Result<ChunkReceipt, StreamerError>>)>,
    /// Puts left in flight at most ([`StreamerConfig::puts_in_flight`]).
    window: usize,
}

impl Jobs {
    /// Runs one job: answers it, or leaves its put in flight and finishes the one before.
    fn run(
        &mut self,
        work: &Work,
        done: Sender<Result<ChunkReceipt, StreamerError>>,
        pool: &StagingPool,
        device_staging: &mut DeviceStaging,
    ) {
        let (store, window) = (self.store.as_mut(), self.window);
        let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match work {
            Work::Host(job) if window == 0 => {
                send(&job.cache, &job.transfer, job.tokens.clone(), pool, store).map(Sending::Done)
            }
            Work::Host(job) => start_send(&job.cache, &job.transfer, job.tokens.clone(), pool, store),
            Work::Device(job) => send_from_device(job, device_staging, store).map(Sending::Done),
        }));
        match started {
            Ok(Ok(Sending::InFlight(sending))) => {
                self.in_flight.push_back((sending, done));
                while self.in_flight.len() > self.window {
                    self.finish_oldest();
                }
            }
            // The puts before it are answered first.
            Ok(Ok(Sending::Done(receipt))) => {
                self.finish_all();
                self.answer(done, Ok(receipt));
            }
            Ok(Err(e)) => {
                self.finish_all();
                self.answer(done, Err(e.into()));
            }
            Err(_) => {
                self.give_up();
                self.answer(done, Err(StreamerError::WorkerGone));
            }
        }
    }

    /// Waits for the oldest put in flight and answers its job.
    fn finish_oldest(&mut self) {
        let Some((sending, done)) = self.in_flight.pop_front() else { return };
        let (store, ticket) = (self.store.as_mut(), sending.ticket());
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| store.finish_put(ticket))) {
            Ok(Some(outcome)) => {
                let result = outcome.map(|()| sending.finish()).map_err(|e| StreamError::from(e).into());
                self.answer(done, result);
            }
            // The store lost track of a put it left in flight: its state is unknown.
            Ok(None) | Err(_) => {
                self.in_flight.push_front((sending, done));
                self.give_up();
            }
        }
    }

    /// Answers every job whose put is in flight.
    fn finish_all(&mut self) {
        while !self.in_flight.is_empty() {
            self.finish_oldest();
        }
    }

    /// Counts and sends a job's result. The submitter may have dropped its Completion; that is
    /// fine.
    fn answer(
        &mut self,
        done: Sender<Result<ChunkReceipt, StreamerError>>,
        result: Result<ChunkReceipt, StreamerError>,
    ) {
        match &result {
            Ok(receipt) => {
                self.stats.completed += 1;
                self.stats.bytes += receipt.bytes;
            }
            Err(_) => self.stats.failed += 1,
        }
        let _ = done.send(result);
    }

    /// The store panicked (or lost track of a put): its state is unknown, so it is used no more.
    /// The jobs whose puts are in flight fail, in order, and so does every later one.
    fn give_up(&mut self) {
        self.store_panicked = true;
        for (_, done) in std::mem::take(&mut self.in_flight) {
            self.answer(done, Err(StreamerError::WorkerGone));
        }
    }
}
