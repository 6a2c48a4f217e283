//! Microbatch swapping with real KV: four microbatches of requests share two device caches per
//! stage; before a microbatch runs, the one holding its cache slot is swapped out to host memory
//! (one flush per stage) and its own KV swapped back in (one fetch). The tokens equal those of a
//! pipeline with a cache per microbatch.

use std::collections::HashMap;

use dejavu_engine::pipeline::CacheLayout;
use dejavu_engine::{ModelConfig, Pipeline, Seat};
use dejavulib::reshard::{receive, send};
use dejavulib::{HostStore, KvRegion, StagingPool, Transfer, WorkerId};

const SLOTS: u32 = 2;
const MICROBATCHES: u32 = 4;
const DEVICE_CACHES: u32 = 2;
const NEW_TOKENS: usize = 6;
const MAX_TOKENS: u32 = 32;

fn splits() -> Vec<std::ops::Range<u32>> {
    vec![0..3, 3..8]
}

fn prompts() -> Vec<Vec<u32>> {
    (0..SLOTS * MICROBATCHES).map(|r| (0..5 + r % 3).map(|t| (r * 97 + t * 31 + 1) % 512).collect()).collect()
}

/// Swaps microbatches between the device caches of `pipeline` and host memory.
struct Swapper {
    host: HostStore,
    pool: StagingPool,
    /// Which microbatch each device cache holds, and how many tokens of KV it had when last
    /// swapped out (the key it went under).
    resident: Vec<Option<u32>>,
    swapped_len: HashMap<u32, u32>,
    swaps: u32,
}

impl Swapper {
    fn transfer(pipeline: &Pipeline, stage: usize, microbatch: u32) -> Transfer {
        let layers = pipeline.stages()[stage].layers().len() as u32;
        let region = KvRegion::new(0..layers, 0..SLOTS, 0..ModelConfig::reference().kv_heads, 0..0);
        let worker = WorkerId { stage: stage as u32, rank: 0 };
        Transfer::in_place(worker, worker, microbatch, &region)
    }

    /// Makes `microbatch` resident in device cache `microbatch % DEVICE_CACHES` of every stage;
    /// `kv_len` gives the tokens of KV each microbatch has.
    fn bring_in(&mut self, pipeline: &Pipeline, microbatch: u32, kv_len: &dyn Fn(u32) -> u32) {
        let slot = (microbatch % DEVICE_CACHES) as usize;
        if self.resident[slot] == Some(microbatch) {
            return;
        }
        for stage in 0..pipeline.stages().len() {
            let cache = &pipeline.caches(stage)[slot];
            if let Some(out) = self.resident[slot] {
                let len = kv_len(out);
                send(
                    cache,
                    &Self::transfer(pipeline, stage, out),
                    0..len,
                    &self.pool,
                    &mut self.host.clone(),
                )
                .unwrap();
                self.swapped_len.insert(out, len);
            }
            if let Some(&len) = self.swapped_len.get(&microbatch) {
                let mut payload = Vec::new();
                receive(
                    cache,
                    &Self::transfer(pipeline, stage, microbatch),
                    0..len,
                    &mut self.host.clone(),
                    &mut payload,
                )
                .unwrap();
            }
        }
        self.resident[slot] = Some(microbatch);
        self.swaps += 1;
    }
}

#[test]
fn four_microbatches_share_two_device_caches_with_identical_tokens() {
    let config = ModelConfig::reference();
    let prompts = prompts();
    let reference =
        Pipeline::new(config, &splits(), CacheLayout::FasterTransformer, SLOTS, MICROBATCHES, MAX_TOKENS)
            .unwrap()
            .generate(&prompts, NEW_TOKENS)
            .unwrap();

    // Only two device caches per stage: the pool never holds more than 2 microbatches.
    let device =
        Pipeline::new(config, &splits(), CacheLayout::FasterTransformer, SLOTS, DEVICE_CACHES, MAX_TOKENS)
            .unwrap();
    let mut swapper = Swapper {
        host: HostStore::new(),
        pool: StagingPool::default(),
        resident: vec![None; DEVICE_CACHES as usize],
        swapped_len: HashMap::new(),
        swaps: 0,
    };
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    // Microbatch by microbatch, round after round, as a pipeline schedules them.
    while out.iter().any(|t| t.len() < NEW_TOKENS) {
        for microbatch in 0..MICROBATCHES {
            let lens: Vec<u32> = (0..MICROBATCHES)
                .map(|m| {
                    (0..SLOTS)
                        .map(|s| {
                            let r = (m * SLOTS + s) as usize;
                            (prompts[r].len() + out[r].len()).saturating_sub(1) as u32
                        })
                        .max()
                        .unwrap()
                })
                .collect();
            swapper.bring_in(&device, microbatch, &|m| lens[m as usize]);
            let seat_of = |slot| Seat { microbatch: microbatch % DEVICE_CACHES, slot };
            for slot in 0..SLOTS {
                let r = (microbatch * SLOTS + slot) as usize;
                let token = match out[r].last() {
                    None => device.prefill(seat_of(slot), &prompts[r]).unwrap(),
                    Some(&t) if out[r].len() < NEW_TOKENS => {
                        device.decode(seat_of(slot), t, (prompts[r].len() + out[r].len() - 1) as u32).unwrap()
                    }
                    Some(_) => continue,
                };
                out[r].push(token);
            }
        }
    }
    assert_eq!(out, reference);
    assert!(
        swapper.swaps as usize >= NEW_TOKENS * MICROBATCHES as usize,
        "every round swapped: {}",
        swapper.swaps
    );
    assert!(!swapper.host.is_empty());
}

/// The same swapping in stage processes: each keeps two device caches for four microbatches
/// (`--device-caches 2`), swaps deltas out to host memory and prefetches the next microbatch
/// while the rest of the pipeline computes; a worker killed mid-decode is replaced, its KV
/// restored into its own swapped caches, and every token equals the in-process pipeline's.
#[test]
fn stage_processes_with_two_device_caches_swap_and_recover_bit_identically() {
    use std::path::PathBuf;
    use std::time::Duration;

    use dejavud::cluster::{Cluster, ClusterConfig, Kill, Role};
    use dejavud::driver::{drive, DriverConfig, OnFailure, Workload};
    use dejavud::metrics::value_of;

    let workload = Workload::synthetic(8, 6, NEW_TOKENS as u32, SLOTS, ModelConfig::reference().vocab);
    assert_eq!(workload.microbatches(), MICROBATCHES);
    let expected = Pipeline::new(
        ModelConfig::reference(),
        &splits(),
        CacheLayout::FasterTransformer,
        SLOTS,
        MICROBATCHES,
        MAX_TOKENS,
    )
    .unwrap()
    .generate(&workload.prompts, NEW_TOKENS)
    .unwrap();
    let config = ClusterConfig {
        splits: splits(),
        slots: SLOTS,
        microbatches: MICROBATCHES,
        device_caches: Some(DEVICE_CACHES),
        max_tokens: MAX_TOKENS,
        deadline: Duration::from_secs(1),
        ..ClusterConfig::new(PathBuf::from(env!("CARGO_BIN_EXE_dejavud")))
    };
    let driver = DriverConfig {
        on_failure: OnFailure::Recover,
        detect_patience: Duration::from_secs(3),
        watch_every: Duration::from_millis(100),
        retries: 3,
    };
    // Metrics of every stage, read just before the cluster goes away.
    let mut seen = Vec::new();
    let mut inject = |step: u64, cluster: &mut Cluster| {
        if step == 20 {
            cluster.faults().kill(1, Kill::Worker)?;
        }
        if step + 1 == workload.steps() {
            seen = (0..cluster.len())
                .map(|s| cluster.metrics(s, Role::Engine))
                .collect::<Result<Vec<_>, _>>()?;
        }
        Ok(())
    };
    let mut start = || Cluster::start(config.clone());
    let run = drive(&workload, &driver, &mut start, &mut inject).unwrap();
    assert_eq!(run.tokens, expected);
    assert_eq!(run.recoveries.len(), 1);

    let value = |page: &str, name: &str| value_of(page, name, &[]).unwrap();
    assert_eq!(seen.len(), splits().len(), "every stage's metrics were read");
    for page in &seen {
        // The device pool holds two caches, never four; the rest went to host memory and back.
        let per_cache = value(page, "dejavu_stage_device_kv_bytes") / DEVICE_CACHES as f64;
        assert!(per_cache > 0.0);
        assert!(value(page, "dejavu_stage_swap_ins_total") > 0.0, "{page}");
        assert!(value(page, "dejavu_stage_swap_out_bytes_total") > 0.0, "{page}");
        assert!(value(page, "dejavu_stage_host_kv_bytes") <= MICROBATCHES as f64 * per_cache, "{page}");
    }
}
