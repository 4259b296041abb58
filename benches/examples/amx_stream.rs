//! Diagnostic: how fast does the AMX int8 (or, `INT4=1`, AMXINT4) prefill tile program stream
//! 32-output groups from DRAM on packed rows, all threads at once, against the read probe in
//! the same minute? This is the ceiling the AMX layers' phases can reach; the layer adds
//! routing, packing and the weighted sums around it.
//!
//! `K` inputs per row (768: a down group of S1; 2048: gate/up), `M` rows per expert (32; more
//! than 32 go in blocks of at most 32 as the forward cuts them, `BALANCED=1` in blocks of equal
//! size), `PF` prefetch bytes (the program's default), `THREADS` (2), `BATCH` groups per visit
//! before jumping elsewhere (8: one down task's panels of an expert), `BYTES` of weights (1 GiB;
//! 2 MiB with `REPS=20000` repeats keeps them in L2: the program's own compute rate).
//!
//! Emerald Rapids VM, 2 threads, probe 30-32 GB/s, int8, K 2048 / K 768, 32 rows (2026-12-01):
//! PF 512 31.2 / 25.4 GB/s, 1024 32.3 / 26.8, 1536 26.6 / 22.7, 2048 25.2 / 22.1, 8192 24.0 /
//! 21.4, off 21.7 / 20.7 (the tiles reach the probe at half a K step ahead); M 38 in blocks of
//! 32 + 6 at 1024: 23.6 / 22.3. AMXINT4, GB/s of nibbles: 4096 22.6 / 15.6, 3072 19.2 / 16.6,
//! 8192 16.4 / 13.8, off 19.4 / 14.4; in L2 47.6 (K 2048) and 65.8 (K 768), the unpacking
//! alone (tiles skipped) from DRAM 25.3 / 18.3 at 8 groups a visit, 27.2 / 24.2 at 64.
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
    assert!(k.is_multiple_of(128), "K must be a multiple of 128");
    let set = KernelSet::best().unwrap();
    let Some(amx) = set.amx().filter(|a| !a.emulated) else {
        println!("no AMX hardware");
        return;
    };
    let int4 = kt_benches::env_or("INT4", 0) == 1;
    let stream = if int4 {
        AmxStream::Int4
    } else {
        AmxStream::Tiles
    };
    set_prefetch_bytes(stream, kt_benches::env_or("PF", prefetch_bytes(stream)));
    let kernel = if int4 {
        amx.int4_packed
    } else {
        amx.int8_packed
    };
    // A group of 32 outputs: a byte per weight, or two (AMXINT4).
    let group = if int4 { 16 * k } else { 32 * k };
    let bytes: usize = kt_benches::env_or("BYTES", 1usize << 30);
    let groups = (bytes / group) / (threads * batch) * (threads * batch);
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
    let reps: usize = kt_benches::env_or("REPS", 1);
    let times: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            pool.parallel_for_all(threads, &|th| {
                let a = AlignedBuf::<u8>::zeroed(step * (k / 64) + m * 64).unwrap();
                let sums = [0i32; 32];
                let mut out = vec![0i32; 32 * 32];
                // Visits in a scattered order (as experts are), each `batch` groups in a row.
                for v in (0..visits * reps).map(|v| v % visits) {
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
    let gb = (groups * group * reps) as f64 / 1e9;
    let probe = kt_core::probe::dram_read_gbps(&pool, 512 << 20, 3).unwrap();
    println!(
        "K {k} M {m} batch {batch}{} PF {}: median {:.1} GB/s best {:.1} GB/s of weights; \
         probe {probe:.1} GB/s",
        if balanced { " balanced" } else { "" },
        prefetch_bytes(stream),
        gb / sorted[2],
        gb / sorted[0]
    );
}
