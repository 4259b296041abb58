//! Diagnostic: the LLAMAFILE many-row (x8 / x16) kernels' compute rate on one core, from
//! groups and activation rows that stay in L1/L2 (no memory limit), against the int8
//! multiply-add peak measured in the same run: the best of many repetitions, so a shared VM's
//! noise drops out. Block sums are made once, as the forward does (`dot_x8_presummed`).
//! `TYPE=Q8_0|Q4_K|Q6_K` (default all), `ROWS=8` activation rows per call, `WEIGHT_GROUPS=4` x8 groups
//! (32 weight rows; 1024 streams them from DRAM), `K=2048` inputs, `PF=0` prefetch setting.
//! `cargo run --release -p kt-benches --example ggml_cycles`
use kt_core::ggml::{quantize, quantize_activation, DotKernel, GgmlType};
use kt_core::rng::Rng;
use std::time::Instant;

fn main() {
    let k: usize = kt_benches::env_or("K", 2048);
    let rows: usize = kt_benches::env_or("ROWS", 8);
    let groups_n: usize = kt_benches::env_or("WEIGHT_GROUPS", 4);
    assert!(
        k > 0 && k.is_multiple_of(256),
        "K must be a positive multiple of 256"
    );
    let only = std::env::var("TYPE").ok();
    // PF=<bytes>[+1]: the GGUF kernels' decode prefetch setting (+1: lines into L2); 0 = off.
    kt_core::kernels::prefetch::set_of(
        kt_core::kernels::prefetch::Family::GgufBlocks,
        kt_benches::env_or("PF", 0),
    );
    let pool = kt_benches::pool(1);
    // The int8 peak of one core (GOP/s, two ops per multiply-add).
    let int8 = kt_core::probe::simd_peak_gflops(&pool, "int8", 300)
        .ok()
        .flatten()
        .unwrap_or(f64::NAN);
    println!("int8 peak, one core: {int8:.1} GOP/s");
    let mut rng = Rng::new(3);
    for ty in [GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K] {
        if only.as_deref().is_some_and(|o| o != ty.name()) {
            continue;
        }
        let kernel = DotKernel::best(ty).unwrap();
        if !kernel.has_x8() {
            println!("{}: no x8 kernel here", ty.name());
            continue;
        }
        let n = 8 * groups_n;
        let w = quantize(ty, &rng.normals(n * k, 0.02)).unwrap();
        let rb = ty.row_bytes(k).unwrap();
        let gb = kernel.memory_row_bytes(k).unwrap() * 8;
        let mut groups = vec![0u8; groups_n * gb];
        for g in 0..groups_n {
            kernel.repack_x8(
                &w[g * 8 * rb..(g + 1) * 8 * rb],
                k,
                &mut groups[g * gb..(g + 1) * gb],
            );
        }
        let format = ty.activation_format().unwrap();
        let acts: Vec<Vec<u8>> = (0..rows)
            .map(|_| quantize_activation(format, &rng.normals(k, 1.0)).unwrap())
            .collect();
        let refs: Vec<&[u8]> = acts.iter().map(|a| a.as_slice()).collect();
        let per_row = kernel.x8_sums_per_row(k);
        let sums: Vec<Vec<[i32; 4]>> = acts
            .iter()
            .map(|a| {
                let mut s = vec![[0i32; 4]; per_row];
                kernel.x8_sums(k, a, &mut s);
                s
            })
            .collect();
        let sum_refs: Vec<&[[i32; 4]]> = sums.iter().map(|s| s.as_slice()).collect();
        let mut out = vec![0f32; rows * n];
        let reps = 50;
        let mut times = Vec::new();
        for _ in 0..kt_benches::env_or("TRIALS", 200) {
            let t = Instant::now();
            for _ in 0..reps {
                kernel.dot_x8_presummed(k, &groups, &refs, &sum_refs, &mut out, n);
                std::hint::black_box(&mut out);
            }
            times.push(t.elapsed().as_secs_f64() / reps as f64);
        }
        times.sort_by(f64::total_cmp);
        let gops = |t: f64| 2.0 * (n * k * rows) as f64 / t / 1e9;
        println!(
            "{:5} {} rows {rows}, {n} weight rows, k {k}: best {:7.2} us ({:6.1} GOP/s, {:.2}x \
             the int8 peak), median {:7.2} us",
            ty.name(),
            kernel.name(),
            times[0] * 1e6,
            gops(times[0]),
            int8 / gops(times[0]),
            times[times.len() / 2] * 1e6,
        );
    }
}
