//! Gather of a 13B-class worker's decode step and prompt into staging, against memcpy of the same
//! bytes measured in the same run.
// criterion_group! and criterion_main! generate undocumented items.
#![allow(missing_docs)]

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use dejavu_benches::{memcpy, source_lines_bytes, Geometry, Workload};

fn gather(c: &mut Criterion) {
    let w = Workload::new(Geometry::thirteen_b());
    let packing = w.packing();
    for (name, region) in [("decode_step", &w.decode), ("prompt_1000", &w.prompt)] {
        let len = w.cache.packed_len(region) as usize;
        let plan = w.cache.gather_plan(region, packing).expect("plan");
        let touched = source_lines_bytes(plan.copy_plan());
        eprintln!(
            "{name}: {len} useful bytes, {touched} bytes of cache lines touched, {} runs",
            plan.copy_plan().run_count()
        );
        let mut staging = vec![0u8; len];
        let src = vec![1u8; len];
        let mut group = c.benchmark_group(name);
        group.throughput(Throughput::Bytes(len as u64));
        group.sample_size(if len > 100 << 20 { 10 } else { 50 });
        group.bench_function("gather", |b| {
            b.iter(|| w.cache.gather_with(&plan, black_box(&mut staging)).expect("gather"))
        });
        w.cache.set_copy_threads(2);
        group.bench_function("gather_2_threads", |b| {
            b.iter(|| w.cache.gather_with(&plan, black_box(&mut staging)).expect("gather"))
        });
        w.cache.set_copy_threads(1);
        group.bench_function("gather_with_planning", |b| {
            b.iter(|| w.cache.gather(region, packing, black_box(&mut staging)).expect("gather"))
        });
        group.bench_function("memcpy_same_bytes", |b| b.iter(|| memcpy(black_box(&mut staging), &src)));
        group.finish();
    }
}

criterion_group!(benches, gather);
criterion_main!(benches);
