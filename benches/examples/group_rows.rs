//! Diagnostic: the AMXINT8 / AMXINT4 vector group kernels' rate on one core at every row count
//! a call takes (1 up to the kernel's row block), from a group that stays in L1/L2: ns per
//! call and per row, and GOP/s against the int8 multiply-add peak measured in the same run.
//! A row count that is slower per row than a larger one points at code generation (spills),
//! not at the method. `K=2048` inputs per row.
//! `cargo run --release -p kt-benches --example group_rows`
use kt_core::formats::{int4, int8};
use kt_core::kernels::group_dot::{activation_row, VectorKernel};
use kt_core::rng::Rng;
use std::time::Instant;

fn main() {
    let k: usize = kt_benches::env_or("K", 2048);
    assert!(k.is_multiple_of(128), "K must be a multiple of 128");
    let pool = kt_benches::pool(1);
    let int8_peak = kt_core::probe::simd_peak_gflops(&pool, "int8", 300)
        .ok()
        .flatten()
        .unwrap_or(f64::NAN);
    println!("int8 peak, one core: {int8_peak:.1} GOP/s");
    let level = kt_core::kernels::KernelSet::best().unwrap().level();
    let mut rng = Rng::new(9);
    let kernels: [(&str, VectorKernel, usize); 2] = [
        ("AMXINT8", int8::kernels::vector_kernel(level), 8),
        ("AMXINT4", int4::kernels::vector_kernel(level), 4),
    ];
    for (name, kernel, bits) in kernels {
        // Any bytes serve for timing: the kernels' cost does not depend on the values.
        let group: Vec<u8> = (0..32 * k * bits / 8)
            .map(|_| rng.below(256) as u8)
            .collect();
        let sums = [0i32; 32];
        let rows: Vec<Vec<u8>> = (0..kernel.rows)
            .map(|_| {
                let biased: Vec<u8> = (0..k).map(|_| 1 + rng.below(255) as u8).collect();
                activation_row(&biased)
            })
            .collect();
        let ptrs: Vec<*const u8> = rows.iter().map(|r| r.as_ptr()).collect();
        let mut out = vec![0i32; 32 * kernel.rows];
        for r in 1..=kernel.rows {
            let reps = 50;
            let mut best = f64::INFINITY;
            for _ in 0..kt_benches::env_or("TRIALS", 200) {
                let t = Instant::now();
                for _ in 0..reps {
                    // SAFETY: the level's ISA is this CPU's; rows of ACT_COPIES·k bytes, a
                    // group of 32 rows of k inputs, 32 sums, 32·r outputs, r ≤ the block.
                    unsafe {
                        (kernel.dot)(
                            &ptrs[..r],
                            k,
                            group.as_ptr(),
                            sums.as_ptr(),
                            out.as_mut_ptr(),
                        )
                    };
                    std::hint::black_box(&mut out);
                }
                best = best.min(t.elapsed().as_secs_f64() / reps as f64);
            }
            let gops = 2.0 * (32 * k * r) as f64 / best / 1e9;
            println!(
                "{name} {} rows {r}: {:7.1} ns per call, {:6.1} per row, {gops:6.1} GOP/s \
                 ({:.2}x the int8 peak)",
                kernel.name,
                best * 1e9,
                best * 1e9 / r as f64,
                int8_peak / gops,
            );
        }
    }
}
