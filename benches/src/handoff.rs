//! A prompt's handoff between pipeline setups, in one process: `stream_out` of a prompt of one
//! sequence of a 13B-class model (40 layers x 40 KV heads x 128, fp16) from 2 stages at TP 2 into
//! a [`HostStore`], then `stream_in` from it into 4 stages at TP 1, each side against a `memcpy`
//! of the same bytes. The caches are in the FasterTransformer layout; every side is timed warm
//! (the store's chunks replaced, not new), as a serving system hands over prompt after prompt.

use std::time::{Duration, Instant};

use dejavulib::reshard::{plan_stream_in, plan_stream_out, stream_in, stream_out, Transfer};
use dejavulib::{DType, HostStore, KvCache, KvLayout, KvSpec, Setup, StageSpec, StagingPool, WorkerId};

use crate::Row;

/// Each side's target: at least half a `memcpy` of the same bytes.
pub const TARGET: f64 = 0.5;

/// The caches of one setup's workers, each with the transfers it sends or receives.
type Workers = Vec<(WorkerId, KvCache, Vec<Transfer>)>;

/// The workers of `setup`, with caches of `tokens` tokens (filled when `filled`) and their plans.
fn workers(setup: &Setup, tokens: u32, filled: bool, plan: impl Fn(WorkerId) -> Vec<Transfer>) -> Workers {
    setup
        .workers()
        .map(|worker| {
            let local = setup.local_spec(worker).expect("a worker of the setup");
            let layout = KvLayout::faster_transformer(local, 1, tokens).expect("a valid layout");
            let cache = KvCache::new(layout).expect("a layer-major layout");
            if filled {
                crate::fill(&cache);
            }
            (worker, cache, plan(worker))
        })
        .collect()
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort_unstable();
    times[times.len() / 2]
}

/// The rows of `stream_out` and `stream_in` of a `tokens`-token prompt, each the median of
/// `runs` warm repetitions, with a `memcpy` of the same bytes timed between them: with every core
/// copying ([`KvCache::set_copy_threads`], as an engine sets it for a handoff), against the
/// target, then on one thread, for information. The two settings take turns, run by run.
pub fn measure(tokens: u32, runs: usize) -> Vec<Row> {
    let spec = KvSpec::new(40, 40, 128, DType::F16).expect("a valid spec");
    let prompt_stages = vec![StageSpec { layers: 0..20, tp: 2 }, StageSpec { layers: 20..40, tp: 2 }];
    let from = Setup::new(spec, prompt_stages, 1, 1).expect("a valid setup");
    let to = Setup::uniform(spec, 4, 1, 1, 1).expect("a valid setup");
    let sources = workers(&from, tokens, true, |w| plan_stream_out(&from, w, &to).expect("a plan"));
    let destinations = workers(&to, tokens, false, |w| plan_stream_in(&from, &to, w).expect("a plan"));
    let (store, pool) = (HostStore::new(), StagingPool::default());
    // Clones share the same store.
    let (mut store_out, mut store_in) = (store.clone(), store);
    let copy_threads = |threads: usize| {
        for (_, cache, _) in sources.iter().chain(&destinations) {
            cache.set_copy_threads(threads);
        }
    };
    let mut out = || {
        for (_, cache, plan) in &sources {
            stream_out(&[cache], plan, 0..tokens, &pool, &mut store_out).expect("stream_out");
        }
    };
    let mut inn = || {
        for (_, cache, plan) in &destinations {
            stream_in(&[cache], plan, 0..tokens, &mut store_in).expect("stream_in");
        }
    };
    let bytes = spec.bytes_per_token() * u64::from(tokens);
    let (src, mut dst) = (vec![7u8; bytes as usize], vec![0u8; bytes as usize]);
    // One untimed round: the store's chunks and every buffer's pages exist before any clock runs.
    out();
    inn();
    dst.copy_from_slice(&src);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let settings = [cores, 1];
    let (mut outs, mut ins) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
    let mut copies = Vec::new();
    let time = |f: &mut dyn FnMut()| {
        let started = Instant::now();
        f();
        started.elapsed()
    };
    for _ in 0..runs.max(1) {
        for (setting, threads) in settings.into_iter().enumerate() {
            copy_threads(threads);
            outs[setting].push(time(&mut out));
            copies.push(time(&mut || dst.copy_from_slice(&src)));
            ins[setting].push(time(&mut inn));
        }
    }
    copy_threads(1);
    let gbps = |d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;
    let memcpy = gbps(median(copies));
    let row = |name: String, took: Duration, target: f64| Row {
        name,
        value: gbps(took),
        unit: "GB/s",
        limit_name: "memcpy of the same bytes".into(),
        limit: memcpy,
        target,
        higher_is_better: true,
    };
    let mb = bytes as f64 / 1e6;
    let [outs_all, outs_one] = outs.map(median);
    let [ins_all, ins_one] = ins.map(median);
    let out_name =
        format!("stream_out of a {tokens}-token prompt ({mb:.0} MB), 2 stages x TP 2 to a host store");
    let in_name = "stream_in of the same prompt, from the host store to 4 stages x TP 1";
    vec![
        row(format!("{out_name}, all cores copying"), outs_all, TARGET),
        row(format!("{in_name}, all cores copying"), ins_all, TARGET),
        row(format!("{out_name}, one thread"), outs_one, 0.0),
        row(format!("{in_name}, one thread"), ins_one, 0.0),
    ]
}
