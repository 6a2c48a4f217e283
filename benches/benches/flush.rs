//! A decode step flushed to a file: buffered (gather, then one write; or each piece written as
//! soon as it is gathered) against the paper's baseline (one write per extent), and a raw
//! sequential write of the same bytes.
// criterion_group! and criterion_main! generate undocumented items.
#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use dejavu_benches::{Geometry, Workload};
use dejavulib::baseline::flush_per_extent;
use dejavulib::file_io::{FileBackend, FileIo};
use dejavulib::store::{ChunkStore, FileStore};
use dejavulib::StagingPool;

fn flush(c: &mut Criterion) {
    let w = Workload::new(Geometry::thirteen_b());
    let dir = tempfile::tempdir().expect("tempdir");
    let region = &w.decode;
    let descriptor = w.descriptor(region);
    let len = descriptor.payload_len();
    let pool = StagingPool::default();
    let mut group = c.benchmark_group("decode_step_to_file");
    group.throughput(Throughput::Bytes(len));
    group.sample_size(10);
    for backend in [FileBackend::Auto, FileBackend::Posix] {
        let mut store = FileStore::open(dir.path().join("buffered"), backend).expect("store").without_sync();
        let name = store.backend_name();
        group.bench_function(format!("buffered/{name}"), |b| {
            b.iter(|| {
                let mut staging = pool.lease(len as usize);
                w.cache.gather(region, descriptor.packing, &mut staging).expect("gather");
                store.put(&descriptor, &staging).expect("flush");
            })
        });
        let plan = w.cache.gather_plan(region, descriptor.packing).expect("plan");
        group.bench_function(format!("written_as_gathered/{name}"), |b| {
            b.iter(|| {
                let mut staging = pool.lease(len as usize);
                store.put_gathered(&descriptor, &w.cache, &plan, &mut staging).expect("flush");
            })
        });
        let io = FileIo::new(backend).expect("io");
        let path = dir.path().join("baseline.djv");
        group.bench_function(format!("per_extent/{name}"), |b| {
            b.iter(|| flush_per_extent(&w.cache, region, &descriptor, &io, &path).expect("baseline"))
        });
    }
    let bytes = vec![7u8; len as usize];
    let path = dir.path().join("raw.bin");
    group
        .bench_function("raw_sequential_write", |b| b.iter(|| std::fs::write(&path, &bytes).expect("write")));
    group.finish();
}

criterion_group!(benches, flush);
criterion_main!(benches);
