//! Workloads and limits shared by the criterion benches and the `bench-report` binary.
//!
//! The workload is one worker of a 13B-class model (40 layers, 40 KV heads, head_dim 128, fp16,
//! batch 8) in FasterTransformer's layout, where a decode step writes one 16-byte K piece per
//! 64-byte cache line.

pub mod controller_load;
pub mod controller_process;
pub mod cpu_time;
pub mod e2e;
pub mod failover;
pub mod gpu;
pub mod gpu_host;
pub mod handoff;
pub mod held;
pub mod machine;
pub mod net;
pub mod path;

use dejavulib::chunk::ChunkDescriptor;
use dejavulib::plan::CopyPlan;
use dejavulib::{DType, KvCache, KvLayout, KvRegion, KvSpec, Packing, WorkerId};

/// One line of the `bench-report` table: a measurement beside a limit measured in the same run.
///
/// The ratio is oriented so that higher is better: `value / limit` for throughputs, `limit / value`
/// for times. A slowdown bound ("at most 1.10x the time of X") is a target of `1 / 1.10` on it.
#[derive(Clone, Debug)]
pub struct Row {
    /// What was measured.
    pub name: String,
    /// The measurement, in `unit`.
    pub value: f64,
    /// The unit of `value` and `limit`.
    pub unit: &'static str,
    /// What the limit is.
    pub limit_name: String,
    /// The limit, in `unit`.
    pub limit: f64,
    /// The ratio the measurement must reach; 0 for a row given for information only.
    pub target: f64,
    /// Whether a larger value is better (throughput) or a smaller one (time).
    pub higher_is_better: bool,
}

impl Row {
    /// The measurement against its limit, higher is better (1 = at the limit).
    pub fn ratio(&self) -> f64 {
        if self.higher_is_better {
            self.value / self.limit
        } else {
            self.limit / self.value
        }
    }

    /// Whether the row has a target (rather than being information only).
    pub fn has_target(&self) -> bool {
        self.target > 0.0
    }

    /// Whether the ratio reaches the target (always true for an information row).
    pub fn met(&self) -> bool {
        self.ratio() >= self.target
    }
}

/// Bytes of a CPU cache line.
pub const CACHE_LINE: u64 = 64;

/// A filled cache and the regions the benches move.
pub struct Workload {
    /// The worker's cache.
    pub cache: KvCache,
    /// One decode step: token `decode_token` of every slot, layer and head.
    pub decode: KvRegion,
    /// A whole prompt of one sequence: tokens `0..prompt_tokens` of slot 0.
    pub prompt: KvRegion,
}

/// Shape of the workload (the full one is [`Geometry::thirteen_b`]).
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    /// Layers.
    pub layers: u32,
    /// KV heads.
    pub heads: u32,
    /// Batch slots.
    pub slots: u32,
    /// Token capacity per slot.
    pub max_tokens: u32,
    /// Prompt length.
    pub prompt_tokens: u32,
}

impl Geometry {
    /// The 13B-class worker of DESIGN.md: 40 layers, 40 heads, batch 8, 1000-token prompt.
    pub fn thirteen_b() -> Self {
        Self { layers: 40, heads: 40, slots: 8, max_tokens: 1024, prompt_tokens: 1000 }
    }
}

impl Workload {
    /// Builds and fills the cache (every byte written, so no zero pages flatter the reads).
    pub fn new(g: Geometry) -> Self {
        let spec = KvSpec::new(g.layers, g.heads, 128, DType::F16).expect("valid spec");
        let layout = KvLayout::faster_transformer(spec, g.slots, g.max_tokens).expect("valid layout");
        let cache = KvCache::new(layout).expect("layer-major layout");
        fill(&cache);
        let decode_token = g.prompt_tokens;
        Self {
            decode: KvRegion::new(0..g.layers, 0..g.slots, 0..g.heads, decode_token..decode_token + 1),
            prompt: KvRegion::new(0..g.layers, 0..1, 0..g.heads, 0..g.prompt_tokens),
            cache,
        }
    }

    /// The cache's own packing.
    pub fn packing(&self) -> Packing {
        self.cache.layout().preferred_packing()
    }

    /// A chunk descriptor for `region` of this worker, sent from worker (0, 0) to worker (1, 0).
    pub fn descriptor(&self, region: &KvRegion) -> ChunkDescriptor {
        let shape = region.shape();
        ChunkDescriptor {
            source: WorkerId { stage: 0, rank: 0 },
            destination: WorkerId { stage: 1, rank: 0 },
            microbatch: 0,
            region: region.clone(),
            spec: self.cache.layout().spec().share(shape.layers, shape.heads).expect("spec"),
            packing: self.packing(),
        }
    }
}

/// Writes a byte pattern into every byte of the cache, one layer at a time.
pub fn fill(cache: &KvCache) {
    let layout = cache.layout();
    let spec = layout.spec();
    for layer in 0..spec.layers() {
        let region =
            KvRegion::new(layer..layer + 1, 0..layout.slots(), 0..spec.kv_heads(), 0..layout.max_tokens());
        let bytes: Vec<u8> = (0..cache.packed_len(&region)).map(|i| (i * 31 + layer as u64) as u8).collect();
        cache.scatter(&region, layout.preferred_packing(), &bytes).expect("fill");
    }
}

/// Bytes of the distinct cache lines a plan reads: what a gather must pull from memory.
pub fn source_lines_bytes(plan: &CopyPlan) -> u64 {
    source_granules_bytes(plan, CACHE_LINE)
}

/// Bytes of the distinct `granule`-byte pieces of memory a plan reads (cache lines on a CPU,
/// 32-byte sectors on a GPU), with its buffers aligned to `granule`.
pub fn source_granules_bytes(plan: &CopyPlan, granule: u64) -> u64 {
    // Each run covers lines [first, last]; merge overlapping intervals per buffer and count.
    let mut lines: Vec<(u32, u64, u64)> = plan
        .runs()
        .iter()
        .map(|r| (r.src_buffer, r.src_offset / granule, (r.src_offset + r.len - 1) / granule))
        .collect();
    lines.sort_unstable();
    let mut total = 0;
    let mut current: Option<(u32, u64, u64)> = None;
    for (buffer, first, last) in lines {
        current = match current {
            Some((b, lo, hi)) if b == buffer && first <= hi + 1 => Some((b, lo, hi.max(last))),
            Some((_, lo, hi)) => {
                total += hi - lo + 1;
                Some((buffer, first, last))
            }
            None => Some((buffer, first, last)),
        };
    }
    if let Some((_, lo, hi)) = current {
        total += hi - lo + 1;
    }
    total * granule
}

/// The hardware's limit for a gather's access pattern: one read of each cache line the gather
/// reads, in the same order and with the same software prefetching, but nothing copied.
pub struct LineTouch<'a> {
    /// The cache whose lines are read: borrowed, so that it outlives the addresses below.
    _cache: &'a KvCache,
    /// For every line the gather reads, in its order, the address of its first byte the gather
    /// reads.
    lines: Vec<usize>,
}

/// How many lines ahead [`LineTouch`] prefetches, as the gather does for small runs.
const TOUCH_AHEAD: usize = 64;

impl<'a> LineTouch<'a> {
    /// The lines a gather of `region` from `cache` reads.
    pub fn new(cache: &'a KvCache, region: &KvRegion, packing: Packing) -> Self {
        let line = CACHE_LINE as usize;
        let mut lines: Vec<usize> = Vec::new();
        cache
            .for_each_extent(region, packing, |bytes, _| {
                let (start, end) = (bytes.as_ptr() as usize, bytes.as_ptr() as usize + bytes.len());
                // The run's first byte, then the first byte of each further line it covers.
                let mut at = start;
                while at < end {
                    // A run that starts in the line the last one ended in reads it once.
                    if lines.last().is_none_or(|&last| last / line != at / line) {
                        lines.push(at);
                    }
                    at = (at / line + 1) * line;
                }
                Ok::<(), ()>(())
            })
            .expect("the region fits the cache");
        Self { _cache: cache, lines }
    }

    /// Reads one byte of every line, the list split over `threads` threads; returns a sum of what
    /// was read, so that the reads cannot be left out.
    ///
    /// # Safety
    /// Nothing writes the region's bytes of the cache while this runs (the benches only read it;
    /// a gather would hold the layers' read locks, which this does not take).
    pub unsafe fn run(&self, threads: usize) -> u64 {
        let share = self.lines.len().div_ceil(threads.max(1)).max(1);
        std::thread::scope(|scope| {
            let mut parts = self.lines.chunks(share);
            let mine = parts.next().unwrap_or(&[]);
            let others: Vec<_> = parts
                .map(|part| {
                    // SAFETY: forwarded contract (the addresses are the cache's, which outlives us).
                    scope.spawn(move || unsafe { touch(part) })
                })
                .collect();
            // SAFETY: as above.
            let sum = unsafe { touch(mine) };
            others.into_iter().fold(sum, |sum, t| sum.wrapping_add(t.join().expect("touch thread")))
        })
    }
}

/// Reads the byte at each address, prefetching [`TOUCH_AHEAD`] lines ahead.
///
/// # Safety
/// Each address is that of a byte of a live cache buffer (a byte a gather reads) that nothing
/// writes meanwhile.
unsafe fn touch(lines: &[usize]) -> u64 {
    let mut sum = 0u64;
    for (i, &at) in lines.iter().enumerate() {
        if let Some(&ahead) = lines.get(i + TOUCH_AHEAD) {
            prefetch_l2(ahead);
        }
        // SAFETY: forwarded contract: a byte inside a live buffer, not written meanwhile.
        sum = sum.wrapping_add(u64::from(unsafe { std::ptr::read_volatile(at as *const u8) }));
    }
    sum
}

/// Prefetches the line at `address` into L2, as the gather does.
fn prefetch_l2(address: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; it never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(address as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = address;
}

/// A plain copy of `src` into `dst`: the memcpy limit.
pub fn memcpy(dst: &mut [u8], src: &[u8]) {
    dst.copy_from_slice(src);
}

/// Median wall times of `runs` rounds in which each of `fs` is called once, in turn, after one
/// warm-up round: a measurement and its limits taken this way see the same machine, so their
/// ratio does not depend on which of them ran while a neighbour was busy.
pub fn medians_interleaved<const N: usize>(
    runs: usize,
    mut fs: [&mut dyn FnMut(); N],
) -> [std::time::Duration; N] {
    for f in fs.iter_mut() {
        f();
    }
    let mut times: [Vec<std::time::Duration>; N] = std::array::from_fn(|_| Vec::with_capacity(runs));
    for _ in 0..runs.max(1) {
        for (f, times) in fs.iter_mut().zip(times.iter_mut()) {
            let start = std::time::Instant::now();
            f();
            times.push(start.elapsed());
        }
    }
    times.map(|mut t| {
        t.sort();
        t[t.len() / 2]
    })
}

/// A temporary folder for a sidecar's shared regions (`--shm-dir`): in `/dev/shm`, memory, as
/// the sidecar's default is, where it exists. A region in a disk's file system is written back
/// while the engine writes it, which no deployment pays.
pub fn shm_tempdir() -> std::io::Result<tempfile::TempDir> {
    match std::path::Path::new("/dev/shm") {
        shm if shm.is_dir() => tempfile::tempdir_in(shm),
        _ => tempfile::tempdir(),
    }
}

/// GB/s of `bytes` moved in `d`.
pub fn gbps(bytes: u64, d: std::time::Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// Median wall time of `runs` calls of `f` after one warm-up call.
pub fn median_of(runs: usize, mut f: impl FnMut()) -> std::time::Duration {
    let [median] = medians_interleaved(runs, [&mut f]);
    median
}
