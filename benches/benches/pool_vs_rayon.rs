//! Why the layer uses its own pinned pool rather than rayon: the cost of one decode-shaped
//! parallel phase (a few hundred short tasks, then a barrier), and of a run of such phases as
//! one forward issues them. Both pools have 2 threads.
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use std::hint::black_box;

/// About `units` microseconds of arithmetic.
fn work(units: u64) -> u64 {
    let mut x = 1u64;
    for i in 0..units * 300 {
        x = black_box(x.wrapping_mul(6364136223846793005).wrapping_add(i));
    }
    x
}

fn phases(c: &mut Criterion) {
    let pool = kt_benches::pool(2);
    let rayon_pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let mut g = c.benchmark_group("parallel_phase");
    for (tasks, units) in [(192usize, 1u64), (64, 4), (8, 50)] {
        let label = format!("{tasks}x{units}us");
        g.bench_function(BenchmarkId::new("kt_pool", &label), |b| {
            b.iter(|| {
                pool.run_parts(&|_, team| {
                    team.parallel_for(tasks, &|_| {
                        black_box(work(units));
                    })
                })
                .unwrap()
            })
        });
        g.bench_function(BenchmarkId::new("rayon", &label), |b| {
            b.iter(|| {
                rayon_pool.install(|| {
                    use rayon::prelude::*;
                    (0..tasks).into_par_iter().for_each(|_| {
                        black_box(work(units));
                    })
                })
            })
        });
    }
    // One decode forward = four phases back to back, then the caller goes idle briefly.
    g.bench_function("kt_pool/forward_4_phases", |b| {
        b.iter(|| {
            pool.run_parts(&|_, team| {
                for _ in 0..4 {
                    team.parallel_for(64, &|_| {
                        black_box(work(1));
                    });
                }
            })
            .unwrap()
        })
    });
    g.bench_function("rayon/forward_4_phases", |b| {
        b.iter(|| {
            rayon_pool.install(|| {
                use rayon::prelude::*;
                for _ in 0..4 {
                    (0..64).into_par_iter().for_each(|_| {
                        black_box(work(1));
                    });
                }
            })
        })
    });
    g.finish();
}

criterion_group!(benches, phases);
criterion_main!(benches);
