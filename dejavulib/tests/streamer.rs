//! Integration tests of the background streamer: layer-by-layer prompt streaming while an engine
//! thread keeps writing, error propagation from a failing store, cancellation, completion polling,
//! a panicking store, and that no streamer thread outlives `shutdown`.
//!
//! Every blocking store used here waits on a channel with a generous timeout, so a broken streamer
//! makes a test fail instead of hanging it.

mod common;

use std::collections::HashSet;
use std::io;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use dejavulib::cache::GatherPlan;
use dejavulib::chunk::{ChunkDescriptor, ChunkKey};
use dejavulib::reshard::{StreamError, Transfer};
use dejavulib::store::{Started, StoreError};
use dejavulib::streamer::{Completion, Shutdown, StreamJob, StreamerError};
use dejavulib::{
    plan_stream_out, ChunkStore, Coord, DType, HostStore, KvCache, KvLayout, KvSpec, Part, Setup, Streamer,
    StreamerConfig, WorkerId,
};

const LAYERS: u32 = 4;
const SLOTS: u32 = 2;
const TOKENS: u32 = 5;
const W0: WorkerId = WorkerId { stage: 0, rank: 0 };
/// Longest any test waits for something that should happen promptly.
const PATIENCE: Duration = Duration::from_secs(20);

/// Byte `byte` of the (part, layer, request, head, token) vector. Never 0.
fn f(part: Part, layer: u32, request: u32, head: u32, token: u32, byte: u32) -> u8 {
    common::kv_byte(0x2545_f491_4f6c_dd1d, part, layer, request, head, token, byte)
}

fn spec() -> KvSpec {
    KvSpec::new(LAYERS, 2, 16, DType::F16).unwrap()
}

/// The source: one worker holding the whole model, two microbatches of `SLOTS` slots.
fn source_setup() -> Setup {
    Setup::uniform(spec(), 1, 1, SLOTS, 2).unwrap()
}

/// The destination: two stages (layers 0..2 and 2..4), same batching.
fn destination_setup() -> Setup {
    Setup::uniform(spec(), 2, 1, SLOTS, 2).unwrap()
}

fn plan() -> Vec<Transfer> {
    plan_stream_out(&source_setup(), W0, &destination_setup()).unwrap()
}

/// A FasterTransformer cache (K chunked, so the packed payload is not token-major).
fn new_cache() -> Arc<KvCache> {
    let layout = KvLayout::faster_transformer(spec(), SLOTS, TOKENS).unwrap();
    Arc::new(KvCache::new(layout).unwrap())
}

/// The engine computing layer `layer` of microbatch `m`: writes every vector of that layer.
fn write_layer(cache: &KvCache, m: u32, layer: u32) {
    let spec = *cache.layout().spec();
    for &part in spec.parts() {
        let len = spec.vector_bytes(part) as u32;
        for slot in 0..SLOTS {
            for head in 0..spec.kv_heads() {
                for token in 0..TOKENS {
                    let data: Vec<u8> =
                        (0..len).map(|b| f(part, layer, m * SLOTS + slot, head, token, b)).collect();
                    let at = Coord { layer, slot, head, token };
                    cache.write_vector(part, at, &data).unwrap();
                }
            }
        }
    }
}

/// One job per layer of microbatch `m` (layers `layers`), each carrying `tokens`.
fn layer_jobs(cache: &Arc<KvCache>, m: u32, layers: Range<u32>) -> Vec<StreamJob> {
    let plan = plan();
    layers
        .map(|l| {
            let transfer = plan
                .iter()
                .filter(|t| t.from.microbatch == m)
                .find_map(|t| t.layer(l))
                .expect("every layer goes somewhere");
            StreamJob { cache: cache.clone(), transfer, tokens: 0..TOKENS }
        })
        .collect()
}

/// Whether a thread named `name` exists in this process.
fn thread_named(name: &str) -> bool {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(Result::ok)
        .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
        .any(|comm| comm.trim_end() == name)
}

/// Waits (bounded) until a thread named `name` exists: a new thread names itself once it runs.
fn wait_for_thread_named(name: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !thread_named(name) {
        assert!(Instant::now() < deadline, "thread {name:?} never appeared");
        thread::sleep(Duration::from_millis(1));
    }
}

/// Waits (bounded) until no thread named `name` exists; a joined thread can linger in /proc for
/// a moment after `pthread_join` returns, a leaked one stays forever.
fn assert_no_thread_named(name: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while thread_named(name) {
        assert!(Instant::now() < deadline, "thread {name:?} still alive");
        thread::sleep(Duration::from_millis(5));
    }
}

// ---------------------------------------------------------------------------------------------
// Test stores.
// ---------------------------------------------------------------------------------------------

/// Fails the `fail_on`-th put (1-based) with an I/O error; otherwise forwards to a [`HostStore`].
struct FailingStore {
    inner: HostStore,
    puts: usize,
    fail_on: usize,
}

impl ChunkStore for FailingStore {
    fn put(&mut self, descriptor: &ChunkDescriptor, payload: &[u8]) -> Result<(), StoreError> {
        self.puts += 1;
        if self.puts == self.fail_on {
            return Err(StoreError::Io {
                op: "write",
                path: PathBuf::from("/injected"),
                source: io::Error::other("injected failure"),
            });
        }
        self.inner.put(descriptor, payload)
    }

    fn get(&mut self, key: &ChunkKey, out: &mut Vec<u8>) -> Result<ChunkDescriptor, StoreError> {
        self.inner.get(key, out)
    }
}

/// What a [`GateStore`] does once its first put is released.
#[derive(Clone, Copy, PartialEq, Eq)]
enum AfterGate {
    Store,
    Panic,
}

/// Its first put reports "started", then blocks until released (or `PATIENCE` runs out), then
/// stores or panics. Later puts store at once.
struct GateStore {
    inner: HostStore,
    started: mpsc::Sender<()>,
    release: mpsc::Receiver<()>,
    first: bool,
    after: AfterGate,
}

/// The test's side of a [`GateStore`].
struct Gate {
    started: mpsc::Receiver<()>,
    release: mpsc::Sender<()>,
}

impl Gate {
    fn wait_started(&self) {
        self.started.recv_timeout(PATIENCE).expect("the first put never started");
    }
    fn open(&self) {
        self.release.send(()).unwrap();
    }
}

fn gate_store(inner: HostStore, after: AfterGate) -> (GateStore, Gate) {
    let (started_tx, started_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel();
    (
        GateStore { inner, started: started_tx, release: release_rx, first: true, after },
        Gate { started: started_rx, release: release_tx },
    )
}

impl ChunkStore for GateStore {
    fn put(&mut self, descriptor: &ChunkDescriptor, payload: &[u8]) -> Result<(), StoreError> {
        if std::mem::take(&mut self.first) {
            let _ = self.started.send(());
            // A dropped Gate (the test failed) releases too: never hang.
            let _ = self.release.recv_timeout(PATIENCE);
            if self.after == AfterGate::Panic {
                panic!("injected panic in ChunkStore::put");
            }
        }
        self.inner.put(descriptor, payload)
    }

    fn get(&mut self, key: &ChunkKey, out: &mut Vec<u8>) -> Result<ChunkDescriptor, StoreError> {
        self.inner.get(key, out)
    }
}

/// Leaves every gathered put in flight ([`ChunkStore::start_put_gathered`]), as a sidecar does
/// once it keeps a chunk, and stores it in `inner` when finished; the `fail_finish`-th put to
/// finish (1-based) fails instead. The first start waits for `first_start` (or `PATIENCE`), so that
/// a test can queue every job before any runs. `events` says what the streamer asked, in order.
struct InFlightStore {
    inner: HostStore,
    /// Each put in flight: its ticket, descriptor and payload.
    pending: std::collections::VecDeque<(u64, ChunkDescriptor, Vec<u8>)>,
    events: Arc<std::sync::Mutex<Vec<String>>>,
    started: usize,
    finished: usize,
    fail_finish: usize,
    first_start: Option<mpsc::Receiver<()>>,
}

/// An [`InFlightStore`] over `inner` whose `fail_finish`-th finished put fails (none for 0), the
/// events it logs, and the sender that lets its first put start.
fn in_flight_store(
    inner: HostStore,
    fail_finish: usize,
) -> (InFlightStore, Arc<std::sync::Mutex<Vec<String>>>, mpsc::Sender<()>) {
    let events = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (open, first_start) = mpsc::channel();
    let store = InFlightStore {
        inner,
        pending: Default::default(),
        events: events.clone(),
        started: 0,
        finished: 0,
        fail_finish,
        first_start: Some(first_start),
    };
    (store, events, open)
}

impl InFlightStore {
    fn log(&self, event: String) {
        self.events.lock().unwrap().push(event);
    }
}

impl ChunkStore for InFlightStore {
    fn put(&mut self, descriptor: &ChunkDescriptor, payload: &[u8]) -> Result<(), StoreError> {
        self.inner.put(descriptor, payload)
    }

    fn get(&mut self, key: &ChunkKey, out: &mut Vec<u8>) -> Result<ChunkDescriptor, StoreError> {
        self.inner.get(key, out)
    }

    fn start_put_gathered(
        &mut self,
        descriptor: &ChunkDescriptor,
        cache: &KvCache,
        plan: &GatherPlan,
        staging: &mut [u8],
    ) -> Result<Started, StoreError> {
        if let Some(gate) = self.first_start.take() {
            let _ = gate.recv_timeout(PATIENCE);
        }
        cache.gather_with(plan, staging).map_err(|e| StoreError::Gather(Box::new(e)))?;
        let ticket = self.started as u64;
        self.pending.push_back((ticket, descriptor.clone(), staging.to_vec()));
        self.log(format!("start {ticket}"));
        self.started += 1;
        Ok(Started::InFlight { gathered: Duration::ZERO, ticket })
    }

    fn finish_put(&mut self, ticket: u64) -> Option<Result<(), StoreError>> {
        let at = self.pending.iter().position(|(t, _, _)| *t == ticket)?;
        let (_, descriptor, payload) = self.pending.remove(at)?;
        self.log(format!("finish {}", self.finished));
        self.finished += 1;
        if self.finished == self.fail_finish {
            let source = io::Error::other("injected failure of a forward");
            return Some(Err(StoreError::Io { op: "forward", path: PathBuf::from("/injected"), source }));
        }
        Some(self.inner.put(&descriptor, &payload))
    }
}

fn config(name: &str, queue_depth: usize) -> StreamerConfig {
    StreamerConfig { queue_depth, name: name.into(), ..StreamerConfig::default() }
}

fn wait(c: Completion) -> Result<dejavulib::reshard::ChunkReceipt, StreamerError> {
    // `wait_timeout` instead of `wait`: a lost completion fails the test instead of hanging it.
    let r = c.wait_timeout(PATIENCE);
    assert!(!matches!(r, Err(StreamerError::Timeout)), "job never finished");
    r
}

// ---------------------------------------------------------------------------------------------
// Tests.
// ---------------------------------------------------------------------------------------------

/// Two engine threads (one per microbatch) write layer `l`, announce it and go straight on to
/// `l + 1`; every layer of every microbatch is delivered exactly once, in order, with the bytes
/// the engine wrote.
#[test]
fn layer_by_layer_prompt_streaming_delivers_every_layer_once_in_order() {
    let store = HostStore::new().logging_puts();
    let streamer = Streamer::spawn(config("djv-layers", 2), Box::new(store.clone())).unwrap();
    let plan = plan();
    let caches = [new_cache(), new_cache()];

    let completions: Vec<(u32, u32, Completion)> = thread::scope(|s| {
        let engines: Vec<_> = (0..2u32)
            .map(|m| {
                let (streamer, plan, cache) = (&streamer, &plan, &caches[m as usize]);
                s.spawn(move || {
                    let mut out = Vec::new();
                    for l in 0..LAYERS {
                        write_layer(cache, m, l);
                        let done = streamer.layer_ready(cache, plan, m, l, 0..TOKENS).unwrap();
                        assert_eq!(done.len(), 1, "one destination per layer");
                        out.extend(done.into_iter().map(|c| (m, l, c)));
                    }
                    out
                })
            })
            .collect();
        engines.into_iter().flat_map(|e| e.join().unwrap()).collect()
    });

    let mut receipt_bytes = 0;
    let mut receipt_keys = HashSet::new();
    for (m, l, c) in completions {
        let receipt = wait(c).unwrap_or_else(|e| panic!("mb {m} layer {l}: {e}"));
        assert_eq!(receipt.key.microbatch, m);
        receipt_bytes += receipt.bytes;
        assert!(receipt_keys.insert(receipt.key));
    }
    let stats = streamer.shutdown(Shutdown::Drain).unwrap();
    assert_eq!(stats.completed, 2 * LAYERS as u64);
    assert_eq!((stats.failed, stats.cancelled), (0, 0));
    assert_eq!(stats.bytes, receipt_bytes);
    let layer_bytes = spec().share(1, 2).unwrap().bytes_per_token() * (SLOTS * TOKENS) as u64;
    assert_eq!(stats.bytes, 2 * LAYERS as u64 * layer_bytes);

    // Exactly once, in order per microbatch.
    let dst = destination_setup();
    let log = store.put_log();
    assert_eq!(log.len(), 2 * LAYERS as usize);
    assert_eq!(log.iter().collect::<HashSet<_>>(), receipt_keys.iter().collect());
    for m in 0..2 {
        let layers: Vec<u32> = log
            .iter()
            .filter(|k| k.microbatch == m)
            .map(|k| {
                assert_eq!(k.region.layers.len(), 1);
                assert_eq!(k.region.tokens, 0..TOKENS);
                dst.stages()[k.destination.stage as usize].layers.start + k.region.layers.start
            })
            .collect();
        assert_eq!(layers, (0..LAYERS).collect::<Vec<_>>(), "microbatch {m}");
    }

    // Every byte of every chunk is what the engine wrote.
    let mut fetch = store.clone();
    let mut payload = Vec::new();
    for key in &log {
        let d = fetch.get(key, &mut payload).unwrap();
        let global_layer = dst.stages()[d.destination.stage as usize].layers.start + d.region.layers.start;
        let packed = KvLayout::packed(&d.spec, d.region.shape(), d.packing).unwrap();
        assert_eq!(payload.len() as u64, packed.buffer_sizes()[0]);
        for &part in d.spec.parts() {
            let elem = d.spec.elem_bytes(part) as u32;
            for slot in 0..d.region.slots.len() as u32 {
                for head in 0..d.spec.kv_heads() {
                    for token in 0..TOKENS {
                        let at = Coord { layer: 0, slot, head, token };
                        for b in 0..d.spec.vector_bytes(part) as u32 {
                            let (buffer, off) = packed.element_offset(part, at, b / elem).unwrap();
                            assert_eq!(buffer, 0);
                            let request = key.microbatch * SLOTS + d.region.slots.start + slot;
                            assert_eq!(
                                payload[(off + (b % elem) as u64) as usize],
                                f(part, global_layer, request, head, token, b),
                                "{key:?} {part:?} {at:?} byte {b}"
                            );
                        }
                    }
                }
            }
        }
    }
    assert_no_thread_named("djv-layers");
}

#[test]
fn a_failing_put_fails_only_its_own_job() {
    let inner = HostStore::new().logging_puts();
    let store = FailingStore { inner: inner.clone(), puts: 0, fail_on: 3 };
    let streamer = Streamer::spawn(config("djv-failing", 8), Box::new(store)).unwrap();
    let cache = new_cache();
    for l in 0..LAYERS {
        write_layer(&cache, 0, l);
    }
    let jobs = layer_jobs(&cache, 0, 0..LAYERS);
    let expected_keys: Vec<ChunkKey> =
        jobs.iter().map(|j| dejavulib::reshard::transfer_key(&j.transfer, j.tokens.clone())).collect();
    let completions: Vec<Completion> = jobs.into_iter().map(|j| streamer.submit(j).unwrap()).collect();
    for (i, c) in completions.into_iter().enumerate() {
        let r = wait(c);
        if i == 2 {
            assert!(
                matches!(&r, Err(StreamerError::Stream(StreamError::Store(StoreError::Io { .. })))),
                "job {i}: {r:?}"
            );
        } else {
            assert_eq!(r.unwrap().key, expected_keys[i], "job {i}");
        }
    }
    let stats = streamer.shutdown(Shutdown::Drain).unwrap();
    assert_eq!((stats.completed, stats.failed, stats.cancelled), (LAYERS as u64 - 1, 1, 0));
    let log = inner.put_log();
    assert_eq!(log, vec![expected_keys[0].clone(), expected_keys[1].clone(), expected_keys[3].clone()]);
    assert_no_thread_named("djv-failing");
}

/// With a store that leaves puts in flight, the streamer starts each job before it finishes the
/// one before (whose put then overlaps the next gather), finishes the last once nothing more is
/// queued, answers the jobs in order, and a put that fails when finished fails its own job only.
#[test]
fn puts_left_in_flight_overlap_the_next_job_and_are_answered_in_order() {
    let inner = HostStore::new().logging_puts();
    let (store, events, open) = in_flight_store(inner.clone(), 3);
    let streamer = Streamer::spawn(config("djv-inflight", 8), Box::new(store)).unwrap();
    let cache = new_cache();
    for l in 0..LAYERS {
        write_layer(&cache, 0, l);
    }
    let jobs = layer_jobs(&cache, 0, 0..LAYERS);
    let keys: Vec<ChunkKey> =
        jobs.iter().map(|j| dejavulib::reshard::transfer_key(&j.transfer, j.tokens.clone())).collect();
    let completions: Vec<Completion> = jobs.into_iter().map(|j| streamer.submit(j).unwrap()).collect();
    open.send(()).unwrap();
    // Each waited for without a shutdown: the last is finished once the queue is empty.
    for (i, c) in completions.into_iter().enumerate() {
        let r = wait(c);
        if i == 2 {
            assert!(
                matches!(&r, Err(StreamerError::Stream(StreamError::Store(StoreError::Io { .. })))),
                "job {i}: {r:?}"
            );
        } else {
            assert_eq!(r.unwrap().key, keys[i], "job {i}");
        }
    }
    let events = events.lock().unwrap().clone();
    let want = ["start 0", "start 1", "finish 0", "start 2", "finish 1", "start 3", "finish 2", "finish 3"];
    assert_eq!(events, want);
    let stats = streamer.shutdown(Shutdown::Drain).unwrap();
    assert_eq!((stats.completed, stats.failed, stats.cancelled), (LAYERS as u64 - 1, 1, 0));
    assert_eq!(inner.put_log(), vec![keys[0].clone(), keys[1].clone(), keys[3].clone()]);
    assert_no_thread_named("djv-inflight");
}

/// A job that completes at once (an empty token range) while puts are in flight is answered after
/// them: the streamer finishes them first.
#[test]
fn a_job_done_at_once_is_answered_after_the_puts_in_flight_before_it() {
    let (store, events, open) = in_flight_store(HostStore::new(), 0);
    let streamer = Streamer::spawn(config("djv-inflight-mix", 8), Box::new(store)).unwrap();
    let cache = new_cache();
    let mut jobs = layer_jobs(&cache, 0, 0..3);
    let empty = StreamJob { tokens: 0..0, ..jobs[0].clone() };
    jobs.insert(2, empty);
    let completions: Vec<Completion> = jobs.into_iter().map(|j| streamer.submit(j).unwrap()).collect();
    open.send(()).unwrap();
    let mut completions: Vec<Option<Completion>> = completions.into_iter().map(Some).collect();
    // Once the empty job is answered, the two before it are: the streamer answered them first.
    let empty = wait(completions[2].take().unwrap()).unwrap();
    assert_eq!(empty.bytes, 0, "the empty job moves nothing");
    for (i, c) in completions.iter().enumerate().take(2) {
        assert!(c.as_ref().unwrap().is_finished(), "job {i} answered before the empty job");
    }
    for c in completions.into_iter().flatten() {
        wait(c).unwrap();
    }
    let events = events.lock().unwrap().clone();
    assert_eq!(events, ["start 0", "start 1", "finish 0", "finish 1", "start 2", "finish 2"]);
    streamer.shutdown(Shutdown::Drain).unwrap();
}

#[test]
fn cancel_pending_cancels_queued_jobs_but_not_the_running_one() {
    let inner = HostStore::new().logging_puts();
    let (store, gate) = gate_store(inner.clone(), AfterGate::Store);
    let streamer = Streamer::spawn(config("djv-cancel", 8), Box::new(store)).unwrap();
    // Declared after the streamer, so a failing test drops (opens) the gate before the streamer.
    let gate = gate;
    let cache = new_cache();
    let mut jobs = layer_jobs(&cache, 0, 0..LAYERS).into_iter();
    let first = streamer.submit(jobs.next().unwrap()).unwrap();
    gate.wait_started();
    let queued: Vec<Completion> = (&mut jobs).take(2).map(|j| streamer.submit(j).unwrap()).collect();
    assert!(queued.iter().all(|c| c.poll().is_none()));

    streamer.cancel_pending();
    let late = streamer.submit(jobs.next().unwrap()).unwrap();
    gate.open();

    let receipt = wait(first).unwrap();
    for c in queued.into_iter().chain([late]) {
        let r = wait(c);
        assert!(matches!(r, Err(StreamerError::Cancelled)), "{r:?}");
    }
    let stats = streamer.shutdown(Shutdown::Drain).unwrap();
    assert_eq!((stats.completed, stats.failed, stats.cancelled), (1, 0, 3));
    assert_eq!(stats.bytes, receipt.bytes);
    assert_eq!(inner.put_log(), vec![receipt.key]);
    assert_no_thread_named("djv-cancel");
}

/// `shutdown(Shutdown::Cancel)` from another thread while a put is blocked: the running job
/// finishes, every queued one resolves (cancelled, or sent if the worker got to it first), and
/// nothing hangs. Which of the two a queued job gets depends on timing; the totals may not.
#[test]
fn shutdown_cancel_from_another_thread_resolves_every_job() {
    let inner = HostStore::new().logging_puts();
    let (store, gate) = gate_store(inner.clone(), AfterGate::Store);
    let streamer = Streamer::spawn(config("djv-shutcancel", 8), Box::new(store)).unwrap();
    let gate = gate;
    let cache = new_cache();
    let completions: Vec<Completion> =
        layer_jobs(&cache, 0, 0..3).into_iter().map(|j| streamer.submit(j).unwrap()).collect();
    gate.wait_started();
    let stopper = thread::spawn(move || streamer.shutdown(Shutdown::Cancel));
    // Give the stopper time to set the flag (the usual outcome); the assertions hold either way.
    thread::sleep(Duration::from_millis(20));
    gate.open();
    let stats = stopper.join().unwrap().unwrap();

    let mut results = completions.into_iter().map(wait);
    assert!(results.next().unwrap().is_ok(), "the running job finishes");
    let (mut sent, mut cancelled) = (1, 0);
    for r in results {
        match r {
            Ok(_) => sent += 1,
            Err(StreamerError::Cancelled) => cancelled += 1,
            Err(e) => panic!("queued job neither sent nor cancelled: {e}"),
        }
    }
    assert_eq!((stats.completed, stats.cancelled, stats.failed), (sent, cancelled, 0));
    assert_eq!(inner.put_log().len() as u64, sent);
    assert_no_thread_named("djv-shutcancel");
}

/// Dropping a streamer with queued jobs (from another thread, since the drop joins the blocked
/// worker) resolves every completion and leaves no thread behind.
#[test]
fn dropping_the_streamer_resolves_every_completion() {
    let inner = HostStore::new().logging_puts();
    let (store, gate) = gate_store(inner.clone(), AfterGate::Store);
    let streamer = Streamer::spawn(config("djv-dropped", 8), Box::new(store)).unwrap();
    let gate = gate;
    let cache = new_cache();
    let completions: Vec<Completion> =
        layer_jobs(&cache, 0, 0..3).into_iter().map(|j| streamer.submit(j).unwrap()).collect();
    gate.wait_started();
    let dropper = thread::spawn(move || drop(streamer));
    thread::sleep(Duration::from_millis(20));
    gate.open();
    dropper.join().unwrap();
    let mut results = completions.into_iter().map(wait);
    assert!(results.next().unwrap().is_ok());
    for r in results {
        assert!(matches!(r, Ok(_) | Err(StreamerError::Cancelled)), "{r:?}");
    }
    assert_no_thread_named("djv-dropped");
}

#[test]
fn poll_and_wait_timeout_while_a_job_is_blocked() {
    let (store, gate) = gate_store(HostStore::new().logging_puts(), AfterGate::Store);
    let streamer = Streamer::spawn(config("djv-poll", 8), Box::new(store)).unwrap();
    let gate = gate;
    let cache = new_cache();
    let mut jobs = layer_jobs(&cache, 0, 0..2).into_iter();
    let first = streamer.submit(jobs.next().unwrap()).unwrap();
    let second = streamer.submit(jobs.next().unwrap()).unwrap();
    gate.wait_started();

    assert!(first.poll().is_none());
    assert!(second.poll().is_none());
    assert!(matches!(first.wait_timeout(Duration::from_millis(30)), Err(StreamerError::Timeout)));
    assert!(matches!(second.wait_timeout(Duration::from_millis(1)), Err(StreamerError::Timeout)));

    gate.open();
    // Jobs finish in order: once the second is done, the first's result is waiting.
    let second_receipt = wait(second).unwrap();
    let first_receipt = match first.poll() {
        Some(Ok(r)) => r,
        other => panic!("first job not finished after the second: {other:?}"),
    };
    assert_ne!(first_receipt.key, second_receipt.key);
    let stats = streamer.shutdown(Shutdown::Drain).unwrap();
    assert_eq!(stats.completed, 2);
    assert_no_thread_named("djv-poll");
}

/// With a queue of one, `submit` blocks while the queue is full (backpressure) and resumes when
/// the worker frees a place.
#[test]
fn a_full_queue_blocks_submit() {
    let (store, gate) = gate_store(HostStore::new().logging_puts(), AfterGate::Store);
    let streamer = Streamer::spawn(config("djv-backpres", 1), Box::new(store)).unwrap();
    let gate = gate;
    let cache = new_cache();
    let mut jobs = layer_jobs(&cache, 0, 0..3).into_iter();
    let first = streamer.submit(jobs.next().unwrap()).unwrap();
    gate.wait_started();
    let second = streamer.submit(jobs.next().unwrap()).unwrap(); // fills the queue
    let third_job = jobs.next().unwrap();
    thread::scope(|s| {
        let (tx, rx) = mpsc::channel();
        let streamer = &streamer;
        s.spawn(move || {
            let c = streamer.submit(third_job).unwrap();
            tx.send(c).unwrap();
        });
        assert!(
            rx.recv_timeout(Duration::from_millis(50)).is_err(),
            "submit returned while the queue was full"
        );
        gate.open();
        let third = rx.recv_timeout(PATIENCE).expect("submit never unblocked");
        for c in [first, second, third] {
            wait(c).unwrap();
        }
    });
    let stats = streamer.shutdown(Shutdown::Drain).unwrap();
    assert_eq!(stats.completed, 3);
    assert_no_thread_named("djv-backpres");
}

#[test]
fn a_panicking_store_reports_worker_gone_and_shutdown_does_not_hang() {
    let (store, gate) = gate_store(HostStore::new().logging_puts(), AfterGate::Panic);
    let streamer = Streamer::spawn(config("djv-panic", 8), Box::new(store)).unwrap();
    let gate = gate;
    let cache = new_cache();
    let mut jobs = layer_jobs(&cache, 0, 0..3).into_iter();
    let first = streamer.submit(jobs.next().unwrap()).unwrap();
    gate.wait_started();
    let queued = streamer.submit(jobs.next().unwrap()).unwrap();
    gate.open();

    assert!(matches!(wait(first), Err(StreamerError::WorkerGone)));
    // The thread stays to answer: later submissions are accepted and refused, never lost or hung.
    let late = streamer.submit(jobs.next().unwrap()).unwrap();
    assert!(matches!(wait(late), Err(StreamerError::WorkerGone)));

    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(streamer.shutdown(Shutdown::Drain));
    });
    let result = rx.recv_timeout(PATIENCE).expect("shutdown hung");
    assert!(matches!(result, Err(StreamerError::WorkerGone)), "{result:?}");
    // The job queued behind the panic is answered too, and the thread is gone after shutdown.
    assert!(matches!(wait(queued), Err(StreamerError::WorkerGone)));
    assert_no_thread_named("djv-panic");
}

/// A job queued behind the one whose store panicked must resolve with `WorkerGone` right away,
/// without the caller first shutting the streamer down: an engine typically waits
/// on its completions *before* calling `shutdown`.
#[test]
fn jobs_queued_behind_a_panic_resolve_without_shutdown() {
    let (store, gate) = gate_store(HostStore::new().logging_puts(), AfterGate::Panic);
    let streamer = Streamer::spawn(config("djv-panicq", 8), Box::new(store)).unwrap();
    let gate = gate;
    let cache = new_cache();
    let mut jobs = layer_jobs(&cache, 0, 0..2).into_iter();
    let first = streamer.submit(jobs.next().unwrap()).unwrap();
    gate.wait_started();
    let queued = streamer.submit(jobs.next().unwrap()).unwrap();
    gate.open();
    assert!(matches!(wait(first), Err(StreamerError::WorkerGone)));

    let r = queued.wait_timeout(Duration::from_secs(2));
    // Release the streamer from another thread whatever happened, so a failure cannot hang.
    thread::spawn(move || drop(streamer));
    assert!(
        matches!(r, Err(StreamerError::WorkerGone)),
        "queued job still pending after the store panicked: {r:?}"
    );
}

#[test]
fn no_streamer_thread_is_left_behind() {
    let streamer = Streamer::spawn(config("djv-leakcheck", 4), Box::new(HostStore::new())).unwrap();
    wait_for_thread_named("djv-leakcheck");
    let cache = new_cache();
    write_layer(&cache, 0, 0);
    let done = streamer.layer_ready(&cache, &plan(), 0, 0, 0..TOKENS).unwrap();
    for c in done {
        wait(c).unwrap();
    }
    let stats = streamer.shutdown(Shutdown::Drain).unwrap();
    assert_eq!(stats.completed, 1);
    assert_no_thread_named("djv-leakcheck");

    // Dropping without shutdown joins the thread too.
    let streamer = Streamer::spawn(config("djv-leakdrop", 4), Box::new(HostStore::new())).unwrap();
    wait_for_thread_named("djv-leakdrop");
    drop(streamer);
    assert_no_thread_named("djv-leakdrop");
}

#[test]
fn layer_ready_for_a_layer_or_microbatch_outside_the_plan_queues_nothing() {
    let store = HostStore::new();
    let streamer = Streamer::spawn(config("djv-empty", 4), Box::new(store.clone())).unwrap();
    let cache = new_cache();
    let plan = plan();
    assert!(streamer.layer_ready(&cache, &plan, 0, LAYERS, 0..TOKENS).unwrap().is_empty());
    assert!(streamer.layer_ready(&cache, &plan, 7, 0, 0..TOKENS).unwrap().is_empty());
    let stats = streamer.shutdown(Shutdown::Drain).unwrap();
    assert_eq!(stats.completed + stats.failed + stats.cancelled, 0);
    assert!(store.put_log().is_empty());
}

/// A store that records the CPUs of the thread each put runs on.
struct CpuRecordingStore {
    inner: HostStore,
    seen: Arc<std::sync::Mutex<Vec<dejavulib::affinity::CpuList>>>,
}

impl ChunkStore for CpuRecordingStore {
    fn put(&mut self, descriptor: &ChunkDescriptor, payload: &[u8]) -> Result<(), StoreError> {
        self.seen.lock().unwrap().push(dejavulib::affinity::CpuList::of_current_thread().unwrap());
        self.inner.put(descriptor, payload)
    }

    fn get(&mut self, key: &ChunkKey, out: &mut Vec<u8>) -> Result<ChunkDescriptor, StoreError> {
        self.inner.get(key, out)
    }
}

#[test]
fn a_streamer_runs_on_the_cpus_it_is_given_or_refuses_to_start() {
    use dejavulib::affinity::{CpuList, MAX_CPUS};
    let available = CpuList::of_current_thread().unwrap();
    let last = CpuList::new([*available.cpus().last().unwrap()]).unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let store = CpuRecordingStore { inner: HostStore::new(), seen: seen.clone() };
    let pinned = StreamerConfig { cpus: Some(last.clone()), ..config("djv-pinned", 4) };
    let streamer = Streamer::spawn(pinned, Box::new(store)).unwrap();
    let cache = new_cache();
    write_layer(&cache, 0, 0);
    for job in layer_jobs(&cache, 0, 0..1) {
        wait(streamer.submit(job).unwrap()).unwrap();
    }
    streamer.shutdown(Shutdown::Drain).unwrap();
    let seen = seen.lock().unwrap();
    assert!(!seen.is_empty() && seen.iter().all(|cpus| *cpus == last), "{seen:?}");
    // The caller's own affinity is left as it was.
    assert_eq!(CpuList::of_current_thread().unwrap(), available);

    // A CPU the machine does not have (the last a list can name): the spawn fails and no thread
    // is left behind.
    let missing = MAX_CPUS - 1;
    let refused = StreamerConfig { cpus: CpuList::new([missing]), ..config("djv-refused", 4) };
    assert!(Streamer::spawn(refused, Box::new(HostStore::new())).is_err());
    assert_no_thread_named("djv-refused");
}
