//! `cargo bench`: the BF16 panel kernels (per ISA, GFLOP/s) and whole-layer decode/prefill on
//! the Qwen3-30B-A3B shape (GB/s of expert weights, GFLOP/s).
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kt_benches::{pool, routing, synthetic_layer};
use kt_core::kernels::{runnable_levels, KernelSet};
use kt_core::moe::Workspace;
use kt_core::rng::Rng;

fn panel_kernels(c: &mut Criterion) {
    let k = 2048;
    let mut rng = Rng::new(3);
    let panel: Vec<u16> = (0..32 * k)
        .map(|_| kt_core::dtype::f32_to_bf16_bits(rng.normal()))
        .collect();
    let mut g = c.benchmark_group("panel_dot_k2048");
    let mut sets: Vec<KernelSet> = runnable_levels()
        .into_iter()
        .map(|l| KernelSet::for_level(l).unwrap())
        .collect();
    sets.dedup_by_key(|s| s.name());

    for set in sets {
        for rows in [1, set.rows_per_block()] {
            let a: Vec<Vec<f32>> = (0..rows).map(|_| rng.normals(k, 1.0)).collect();
            let refs: Vec<&[f32]> = a.iter().map(|r| r.as_slice()).collect();
            let mut out = vec![0f32; rows * 32];
            g.throughput(Throughput::Elements((2 * rows * 32 * k) as u64));
            g.bench_function(BenchmarkId::new(set.name(), rows), |b| {
                b.iter(|| set.panel_dot(&refs, &panel, &mut out))
            });
        }
    }
    if let Ok(set) = KernelSet::with_bf16(kt_core::isa::global().unwrap().detected, 1) {
        let rows = set.bf16().unwrap().rows_per_block;
        let a: Vec<Vec<u32>> = (0..rows)
            .map(|_| (0..k / 2).map(|i| 0x3f80_3f80 ^ i as u32).collect())
            .collect();
        let refs: Vec<&[u32]> = a.iter().map(|r| r.as_slice()).collect();
        let mut out = vec![0f32; rows * 32];
        g.throughput(Throughput::Elements((2 * rows * 32 * k) as u64));
        g.bench_function(BenchmarkId::new("avx512-bf16dot", rows), |b| {
            b.iter(|| set.panel_dot_bf16(&refs, &panel, &mut out))
        });
    }
    g.finish();
}

fn layer(c: &mut Criterion) {
    let (e, k, h, i) = (128, 8, 2048, 768);
    let pool = pool(2);
    // Two layers, alternated, so weights (2.4 GB) come from DRAM.
    let layers = [
        synthetic_layer(&pool, e, k, h, i, 512, KernelSet::best().unwrap()),
        synthetic_layer(&pool, e, k, h, i, 512, KernelSet::best().unwrap()),
    ];
    let mut ws = Workspace::new();
    let mut rng = Rng::new(5);
    let mut g = c.benchmark_group("moe_bf16_qwen3_30b_a3b");
    g.sample_size(10);
    for tokens in [1usize, 32, 512] {
        let x = rng.normals(tokens * h, 1.0);
        let (ids, w) = routing(&mut rng, tokens, e, k);
        let mut out = vec![0f32; tokens * h];
        let distinct = {
            let mut v = ids.clone();
            v.sort();
            v.dedup();
            v.len()
        };
        g.throughput(Throughput::Bytes((distinct * 3 * h * i * 2) as u64));
        let mut which = 0;
        g.bench_function(BenchmarkId::new("tokens", tokens), |b| {
            b.iter(|| {
                which ^= 1;
                layers[which]
                    .forward_f32(&pool, &mut ws, &x, &ids, &w, &mut out)
                    .unwrap()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, panel_kernels, layer);
criterion_main!(benches);
