//! Diagnostic: how fast does the AMX int8 prefill tile program stream 32-output groups from
//! DRAM on packed rows, all threads at once, against the read probe in the same minute? This
//! is the ceiling the AMXINT8 layer's phases can reach; the layer adds routing, packing and
//! the weighted sums around it.
//!
//! `K` inputs per row (768: a down group of S1; 2048: gate/up), `M` rows per expert (32; more
//! than 32 go in blocks of at most 32 as the forward cuts them, `BALANCED=1` in blocks of equal
//! size), `PF` prefetch bytes (8192), `THREADS` (2), `BATCH` groups per visit before jumping
//! elsewhere (8: one down task's panels of an expert).
//!
//! Emerald Rapids VM, 2 threads, probe 30-32 GB/s (2026-11-30): K 768 M 32 streams 20-21 GB/s,
//! M 16 24, M 1 25.7, K 2048 M 32 24; a plain vector read of the same groups in the same order
//! 32. Prefetch distance barely matters (off 19.6-20.8, 8 KiB 20.4-21.7); M 38 in blocks of
//! 32 + 6 19.0, in 19 + 19 20.0.
//! `cargo run --release -p kt-benches --example amx_stream`
use kt_core::kernels::amx::{prefetch_bytes, set_prefetch_bytes, AmxStream};
use kt_core::kernels::KernelSet;
use kt_core::pack::AlignedBuf;
use std::time::Instant;

fn main() {
    let threads = kt_benches::env_or("THREADS", 2);
    let pool = kt_benches::pool(threads);
    let k: usize = kt_benches::env_or("K", 768);
    let m: usize = kt_benches::env_or("M", 32).max(1);
    let batch: usize = kt_benches::env_or("BATCH", 8).max(1);
    let balanced = kt_benches::env_or("BALANCED", 0) == 1;
    set_prefetch_bytes(AmxStream::Tiles, kt_benches::env_or("PF", 8192));
    assert!(k.is_multiple_of(64), "K must be a multiple of 64");
    let set = KernelSet::best().unwrap();
    let Some(amx) = set.amx().filter(|a| !a.emulated) else {
        println!("no AMX hardware");
        return;
    };
    let kernel = amx.int8_packed;
    let group = 32 * k;
    let groups = ((1usize << 30) / group) / (threads * batch) * (threads * batch);
    let buf = AlignedBuf::<u8>::zeroed(groups * group).unwrap();
    let base = buf.as_ptr() as usize;
    pool.parallel_for_all(groups, &|g| {
        // SAFETY: task g fills only group g of the buffer.
        let s = unsafe { std::slice::from_raw_parts_mut((base as *mut u8).add(g * group), group) };
        for (i, v) in s.iter_mut().enumerate() {
            *v = (i * 37 + g) as u8 & 0x77;
        }
    })
    .unwrap();
    let per_thread = groups / threads;
    let visits = per_thread / batch;
    // The rows packed as the forward packs them: a step of 32 rows (2 KiB) per 64 inputs.
    let step = 2048;
    let block = if balanced {
        m.div_ceil(m.div_ceil(32))
    } else {
        32
    };
    let times: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            pool.parallel_for_all(threads, &|th| {
                let a = AlignedBuf::<u8>::zeroed(step * (k / 64) + m * 64).unwrap();
                let sums = [0i32; 32];
                let mut out = vec![0i32; 32 * 32];
                // Visits in a scattered order (as experts are), each `batch` groups in a row.
                for v in 0..visits {
                    let visit = (v * 7919) % visits;
                    for b in 0..batch {
                        let g = th * per_thread + visit * batch + b;
                        let mut r0 = 0;
                        while r0 < m {
                            let nr = block.min(m - r0);
                            // SAFETY: nr ≤ 32 packed rows of k inputs (the rows past 32 are
                            // the first ones again, 64 bytes on), a whole group, 32 sums,
                            // room for 32·32 outputs.
                            unsafe {
                                kernel(
                                    a.as_ptr().add(r0 % 32 * 64),
                                    step,
                                    nr,
                                    k,
                                    (base as *const u8).add(g * group),
                                    sums.as_ptr(),
                                    out.as_mut_ptr(),
                                )
                            };
                            r0 += nr;
                        }
                    }
                }
            })
            .unwrap();
            t.elapsed().as_secs_f64()
        })
        .collect();
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let gb = (groups * group) as f64 / 1e9;
    let probe = kt_core::probe::dram_read_gbps(&pool, 512 << 20, 3).unwrap();
    println!(
        "K {k} M {m} batch {batch}{} PF {}: median {:.1} GB/s best {:.1} GB/s of weights; \
         probe {probe:.1} GB/s",
        if balanced { " balanced" } else { "" },
        prefetch_bytes(AmxStream::Tiles),
        gb / sorted[2],
        gb / sorted[0]
    );
}
