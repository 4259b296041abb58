//! Diagnostic: the LLAMAFILE many-row kernels as a 512-token prefill calls them, on every
//! thread of the pool at once: each thread walks its own huge-page buffer of weight groups in
//! panels of 32 weight rows (`dot_x8_presummed` per panel, as the forward's gate/up tasks do)
//! against `ROWS` token rows, so the weights stream from DRAM while the tokens stay in cache.
//! Reports the rate against the int8 multiply-add peak of the same threads measured in the same
//! run. `TYPE=Q8_0|Q4_K`, `ROWS=32`, `K=2048`, `WGROUPS=512` x8 groups per thread (4096: past
//! a 32 MiB L3; the name avoids bash's `GROUPS`), `THREADS=2`; `INTERLEAVE=1` has the threads
//! take the panels of one buffer from a shared counter, as the forward hands out its tasks.
//! `cargo run --release -p kt-benches --example ggml_stream`
use kt_core::ggml::{quantize, quantize_activation, DotKernel, GgmlType};
use kt_core::pack::AlignedBuf;
use kt_core::rng::Rng;
use std::time::Instant;

fn main() {
    let k: usize = kt_benches::env_or("K", 2048);
    let rows: usize = kt_benches::env_or("ROWS", 32);
    let groups_n: usize = kt_benches::env_or("WGROUPS", 512);
    let threads: usize = kt_benches::env_or("THREADS", 2);
    let trials: usize = kt_benches::env_or("TRIALS", 15);
    assert!(
        k > 0 && k.is_multiple_of(256),
        "K must be a positive multiple of 256"
    );
    let only = std::env::var("TYPE").ok();
    let pool = kt_benches::pool(threads);
    let int8 = kt_core::probe::simd_peak_gflops(&pool, "int8", 300)
        .ok()
        .flatten()
        .unwrap_or(f64::NAN);
    println!("int8 peak, {threads} threads: {int8:.1} GOP/s");
    let mut rng = Rng::new(5);
    for ty in [GgmlType::Q8_0, GgmlType::Q4_K] {
        if only.as_deref().is_some_and(|o| o != ty.name()) {
            continue;
        }
        let kernel = DotKernel::best(ty).unwrap();
        if !kernel.has_x8() {
            println!("{}: no x8 kernel here", ty.name());
            continue;
        }
        let rb = ty.row_bytes(k).unwrap();
        let gb = kernel.memory_row_bytes(k).unwrap() * 8;
        // One panel's groups, quantized once and copied through each thread's buffer.
        let panel_groups = 4;
        let w = quantize(ty, &rng.normals(panel_groups * 8 * k, 0.02)).unwrap();
        let mut panel = vec![0u8; panel_groups * gb];
        for g in 0..panel_groups {
            kernel.repack_x8(
                &w[g * 8 * rb..(g + 1) * 8 * rb],
                k,
                &mut panel[g * gb..(g + 1) * gb],
            );
        }
        let bufs: Vec<AlignedBuf<u8>> = (0..threads)
            .map(|_| {
                let mut b = AlignedBuf::<u8>::zeroed(groups_n * gb).unwrap();
                for (i, chunk) in b.as_mut_slice().chunks_mut(panel.len()).enumerate() {
                    let n = chunk.len();
                    chunk.copy_from_slice(&panel[..n]);
                    chunk[0] ^= i as u8; // distinct pages
                }
                b
            })
            .collect();
        let format = ty.activation_format().unwrap();
        let acts: Vec<Vec<Vec<u8>>> = (0..threads)
            .map(|_| {
                (0..rows)
                    .map(|_| quantize_activation(format, &rng.normals(k, 1.0)).unwrap())
                    .collect()
            })
            .collect();
        let per_row = kernel.x8_sums_per_row(k);
        let sums: Vec<Vec<Vec<[i32; 4]>>> = acts
            .iter()
            .map(|rows| {
                rows.iter()
                    .map(|a| {
                        let mut s = vec![[0i32; 4]; per_row];
                        kernel.x8_sums(k, a, &mut s);
                        s
                    })
                    .collect()
            })
            .collect();
        let pass = |t: usize| {
            let refs: Vec<&[u8]> = acts[t].iter().map(|a| a.as_slice()).collect();
            let sum_refs: Vec<&[[i32; 4]]> = sums[t].iter().map(|s| s.as_slice()).collect();
            let mut out = vec![0f32; rows * 32];
            for p in bufs[t].as_slice().chunks_exact(panel_groups * gb) {
                kernel.dot_x8_presummed(k, p, &refs, &sum_refs, &mut out, 32);
                std::hint::black_box(&mut out);
            }
        };
        let interleave = kt_benches::env_or("INTERLEAVE", 0) == 1;
        let refs: Vec<&[u8]> = acts[0].iter().map(|a| a.as_slice()).collect();
        let sum_refs: Vec<&[[i32; 4]]> = sums[0].iter().map(|s| s.as_slice()).collect();
        let shared = |p: usize| {
            let mut out = vec![0f32; rows * 32];
            let pb = panel_groups * gb;
            let all = bufs[0].as_slice();
            let panel = &all[p * pb..(p + 1) * pb];
            kernel.dot_x8_presummed(k, panel, &refs, &sum_refs, &mut out, 32);
            std::hint::black_box(&mut out);
        };
        let panels = groups_n / panel_groups;
        let mut times = Vec::new();
        for _ in 0..trials {
            let t = Instant::now();
            if interleave {
                for _ in 0..threads {
                    pool.parallel_for_all(panels, &shared).unwrap();
                }
            } else {
                pool.parallel_for_all(threads, &pass).unwrap();
            }
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let ops = 2.0 * (threads * groups_n * 8 * k * rows) as f64;
        let gops = |t: f64| ops / t / 1e9;
        let bytes = (threads * groups_n * gb) as f64;
        println!(
            "{:5} {} rows {rows}, k {k}, {threads} threads: best {:.2} ms ({:.1} GOP/s, {:.2}x \
             the int8 peak, weights {:.1} GB/s), median {:.2} ms ({:.2}x)",
            ty.name(),
            kernel.name(),
            times[0] * 1e3,
            gops(times[0]),
            int8 / gops(times[0]),
            bytes / times[0] / 1e9,
            times[times.len() / 2] * 1e3,
            int8 / gops(times[times.len() / 2]),
        );
    }
}
