//! The copy engines, each test body written once and run on every backend: the CPU engine, and
//! the CUDA engine (planned per copy, and prepared once) where a GPU is present. On random data (not zeros), over every layout, with
//! odd head counts and sizes that are not multiples of 16: a scatter of what a gather gave leaves
//! the cache as it was, a gather after a scatter gives back what was scattered, and both agree
//! byte for byte with the CPU engine's (the reference) on the whole cache.
//!
//! The CUDA instance says "skipped: no GPU" and passes only where no CUDA driver can be loaded;
//! anywhere else an error fails it.

use dejavulib::cuda::{driver_present, CudaEngine, CudaError, DeviceKv};
use dejavulib::layout::{BlockTables, KvInterleave, PagedConfig, PagedOrder, PerLayerOrder};
use dejavulib::{DType, KvCache, KvLayout, KvRegion, KvSpec, Packing};

const SLOTS: u32 = 3;
const TOKENS: u32 = 37;

/// A copy engine under test, working on a copy of a host cache's bytes.
trait Backend {
    /// Gathers `region` of a cache holding `cache`'s bytes, packed as `packing`.
    fn gather(&mut self, cache: &KvCache, region: &KvRegion, packing: Packing) -> Vec<u8>;
    /// Scatters `input` into `region` of a cache holding `cache`'s bytes; returns its buffers.
    fn scatter(&mut self, cache: &KvCache, region: &KvRegion, packing: Packing, input: &[u8])
        -> Vec<Vec<u8>>;
}

/// The CPU engine, on a cache of its own rebuilt from the bytes.
struct Cpu;

/// A cache of `layout` holding `buffers`, through the CPU engine.
fn rebuilt(layout: &KvLayout, source: &KvCache) -> KvCache {
    let cache = KvCache::new(layout.clone()).unwrap();
    let whole = whole(layout);
    let packing = layout.preferred_packing();
    let mut bytes = vec![0u8; source.packed_len(&whole) as usize];
    source.gather(&whole, packing, &mut bytes).unwrap();
    cache.scatter(&whole, packing, &bytes).unwrap();
    cache
}

impl Backend for Cpu {
    fn gather(&mut self, cache: &KvCache, region: &KvRegion, packing: Packing) -> Vec<u8> {
        let mut out = vec![0u8; cache.packed_len(region) as usize];
        cache.gather(region, packing, &mut out).unwrap();
        out
    }

    fn scatter(
        &mut self,
        cache: &KvCache,
        region: &KvRegion,
        packing: Packing,
        input: &[u8],
    ) -> Vec<Vec<u8>> {
        let copy = rebuilt(cache.layout(), cache);
        copy.scatter(region, packing, input).unwrap();
        copy.snapshot()
    }
}

/// A device copy of `cache`'s bytes.
fn uploaded(engine: &CudaEngine, cache: &KvCache) -> DeviceKv {
    let mut kv = engine.alloc_kv(cache.layout().clone()).unwrap();
    engine.upload_kv(&cache.snapshot(), &mut kv).unwrap();
    kv
}

/// The CUDA engine, planning each copy from the layout: the cache's buffers uploaded to device
/// memory, the result downloaded.
struct Cuda(CudaEngine);

impl Backend for Cuda {
    fn gather(&mut self, cache: &KvCache, region: &KvRegion, packing: Packing) -> Vec<u8> {
        let kv = uploaded(&self.0, cache);
        let mut staging = self.0.alloc(cache.packed_len(region) as usize).unwrap();
        let bytes = self.0.gather_region(&kv, region, packing, &mut staging).unwrap();
        assert_eq!(bytes, staging.len() as u64);
        let mut out = vec![0u8; staging.len()];
        self.0.download(&staging, &mut out).unwrap();
        out
    }

    fn scatter(
        &mut self,
        cache: &KvCache,
        region: &KvRegion,
        packing: Packing,
        input: &[u8],
    ) -> Vec<Vec<u8>> {
        let kv = uploaded(&self.0, cache);
        let mut staging = self.0.alloc(input.len()).unwrap();
        self.0.upload(input, &mut staging).unwrap();
        self.0.scatter_region(&staging, &kv, region, packing).unwrap();
        self.0.download_kv(&kv).unwrap()
    }
}

/// The CUDA engine through prepared copies, into and out of staging buffers longer than the
/// region, launched twice each.
struct CudaPrepared(CudaEngine);

impl Backend for CudaPrepared {
    fn gather(&mut self, cache: &KvCache, region: &KvRegion, packing: Packing) -> Vec<u8> {
        let kv = uploaded(&self.0, cache);
        let len = kv.packed_len(region) as usize;
        let staging = self.0.alloc(len + 48).unwrap();
        let gather = self.0.prepare_gather(&kv, region, packing, &staging).unwrap();
        assert_eq!(gather.bytes(), len as u64);
        self.0.launch(&gather, &kv, &staging).unwrap();
        self.0.launch(&gather, &kv, &staging).unwrap();
        let mut pinned = self.0.pinned(len).unwrap();
        self.0.download_prefix(&staging, len as u64, &mut pinned).unwrap();
        self.0.synchronize().unwrap();
        pinned.as_slice().unwrap().to_vec()
    }

    fn scatter(
        &mut self,
        cache: &KvCache,
        region: &KvRegion,
        packing: Packing,
        input: &[u8],
    ) -> Vec<Vec<u8>> {
        let kv = uploaded(&self.0, cache);
        let mut staging = self.0.alloc(input.len() + 48).unwrap();
        let mut padded = input.to_vec();
        padded.resize(staging.len(), 0xA5);
        self.0.upload(&padded, &mut staging).unwrap();
        let scatter = self.0.prepare_scatter(&staging, &kv, region, packing).unwrap();
        self.0.launch(&scatter, &kv, &staging).unwrap();
        self.0.launch(&scatter, &kv, &staging).unwrap();
        // Launched with other buffers than it was prepared for: refused.
        let other = self.0.alloc(staging.len()).unwrap();
        assert!(matches!(self.0.launch(&scatter, &kv, &other), Err(CudaError::NotPreparedFor)));
        // Memory of another engine is refused: it would be freed without waiting for this one.
        let second = CudaEngine::open(0).unwrap();
        let foreign = second.alloc(staging.len()).unwrap();
        assert!(matches!(self.0.launch(&scatter, &kv, &foreign), Err(CudaError::OtherEngine)));
        assert!(matches!(
            self.0.download(&foreign, &mut vec![0; foreign.len()]),
            Err(CudaError::OtherEngine)
        ));
        self.0.download_kv(&kv).unwrap()
    }
}

fn whole(layout: &KvLayout) -> KvRegion {
    let spec = layout.spec();
    KvRegion::new(0..spec.layers(), 0..SLOTS, 0..spec.kv_heads(), 0..TOKENS)
}

fn noise(len: usize, seed: u64) -> Vec<u8> {
    dejavu_proto::rng::SplitMix64::new(seed).bytes(len)
}

/// Every layout of the core, with an odd head count and sizes that are not multiples of 16.
fn layouts() -> Vec<KvLayout> {
    let spec = KvSpec::new(3, 5, 24, DType::F16).unwrap();
    let paged =
        |order| PagedConfig { block_size: 8, num_blocks: 16, order, interleave: KvInterleave::Separate };
    vec![
        KvLayout::faster_transformer(spec, SLOTS, TOKENS).unwrap(),
        KvLayout::per_layer(spec, SLOTS, TOKENS, PerLayerOrder::Bhsd).unwrap(),
        KvLayout::per_layer(spec, SLOTS, TOKENS, PerLayerOrder::Bshd).unwrap(),
        KvLayout::paged(spec, SLOTS, paged(PagedOrder::Nhd), Some(tables())).unwrap(),
        KvLayout::paged(spec, SLOTS, paged(PagedOrder::Hnd), Some(tables())).unwrap(),
    ]
}

/// Each slot's blocks, out of order (5 blocks of 8 tokens hold 37).
fn tables() -> BlockTables {
    BlockTables::from_tables(vec![vec![9, 3, 14, 0, 6], vec![1, 12, 5, 15, 8], vec![2, 11, 7, 4, 13]])
}

fn regions() -> Vec<KvRegion> {
    vec![
        KvRegion::new(0..3, 0..SLOTS, 0..5, 17..18), // a decode step
        KvRegion::new(1..3, 1..2, 2..5, 0..33),      // a prompt's worth, some heads
        KvRegion::new(0..1, 0..SLOTS, 0..1, 5..9),
        // Everything: tens of blocks in a paged layout, too many to pass inline.
        KvRegion::new(0..3, 0..SLOTS, 0..5, 0..TOKENS),
    ]
}

/// The test body, once for every backend.
fn round_trips_agree_with_the_cpu_engine(backend: &mut dyn Backend) {
    for (l, layout) in layouts().into_iter().enumerate() {
        let cache = KvCache::new(layout.clone()).unwrap();
        let whole = whole(&layout);
        let packing = layout.preferred_packing();
        cache.scatter(&whole, packing, &noise(cache.packed_len(&whole) as usize, l as u64 + 1)).unwrap();
        for (r, region) in regions().iter().enumerate() {
            let what = format!("layout {l}, region {r}");
            let gathered = backend.gather(&cache, region, packing);
            assert_eq!(gathered, Cpu.gather(&cache, region, packing), "{what}: gather");
            // Scattering what was gathered changes nothing.
            assert_eq!(
                backend.scatter(&cache, region, packing, &gathered),
                cache.snapshot(),
                "{what}: round trip"
            );
            // Scattering new bytes: the cache is the CPU engine's, and a gather gives them back.
            let input = noise(gathered.len(), 100 + r as u64);
            let after = backend.scatter(&cache, region, packing, &input);
            assert_eq!(after, Cpu.scatter(&cache, region, packing, &input), "{what}: scatter");
        }
    }
}

#[test]
fn cpu_engine() {
    round_trips_agree_with_the_cpu_engine(&mut Cpu);
}

#[test]
fn cuda_engine() {
    if !driver_present() {
        // A typed error, never cudarc's panic.
        assert!(matches!(CudaEngine::open(0), Err(CudaError::NoDriver)));
        eprintln!("skipped: no GPU (no CUDA driver on this machine)");
        return;
    }
    // A driver is here: anything short of a working engine is a failure.
    let engine = CudaEngine::open(0).expect("a CUDA driver is present but the engine does not open");
    round_trips_agree_with_the_cpu_engine(&mut Cuda(engine));
}

#[test]
fn cuda_engine_prepared_copies() {
    if !driver_present() {
        eprintln!("skipped: no GPU (no CUDA driver on this machine)");
        return;
    }
    let engine = CudaEngine::open(0).expect("a CUDA driver is present but the engine does not open");
    round_trips_agree_with_the_cpu_engine(&mut CudaPrepared(engine));
}
