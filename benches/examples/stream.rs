//! Diagnostic: how fast does the R=1 panel kernel stream packed weights from DRAM, against a
//! plain read of the same bytes? `cargo run --release -p kt-benches --example stream`
use kt_core::kernels::KernelSet;
use kt_core::pack::AlignedBuf;
use std::time::Instant;

fn main() {
    let pool = kt_benches::pool(2);
    let k = 2048;
    let panel = 32 * k;
    let panels = (1usize << 30) / 2 / panel; // 1 GiB of bf16
    let mut buf = AlignedBuf::<u16>::zeroed(panels * panel).unwrap();
    let base = buf.as_mut_ptr() as usize;
    pool.parallel_for_all(panels, &|p| unsafe {
        let s = std::slice::from_raw_parts_mut((base as *mut u16).add(p * panel), panel);
        for (i, v) in s.iter_mut().enumerate() {
            *v = 0x3f80 ^ (i as u16 & 0xff);
        }
    })
    .unwrap();
    let set = KernelSet::best().unwrap();
    let x: Vec<f32> = (0..k).map(|i| i as f32 * 1e-3).collect();
    // An earlier version of this probe compared software prefetch distances (512 B to 4 KiB
    // ahead: 55-66% of the read probe here, against 89% without); the kernels now rely on the
    // hardware prefetchers.
    let mut best = 0f64;
    let mut best_probe = 0f64;
    for _round in 0..12 {
        best_probe = best_probe.max(kt_core::probe::dram_read_gbps(&pool, 1 << 30, 1).unwrap());
        let t = Instant::now();
        pool.parallel_for_all(panels, &|p| {
            let mut out = [0f32; 32];
            // SAFETY: panel p lies inside the buffer.
            let s =
                unsafe { std::slice::from_raw_parts((base as *const u16).add(p * panel), panel) };
            set.panel_dot(&[&x], s, &mut out);
            std::hint::black_box(out);
        })
        .unwrap();
        best = best.max((panels * panel * 2) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    // The int8 kernel over the same bytes read as 32-row int8 groups of k = 2048.
    let int8 = kt_core::formats::int8::kernels::vector_kernel(set.level());
    let int4 = kt_core::formats::int4::kernels::vector_kernel(set.level());
    let kk = 2048;
    let groups = panels * panel * 2 / (32 * kk);
    let a = kt_core::kernels::group_dot::activation_row(&vec![129u8; kk]);
    let sums = [0i32; 32];
    let mut best_int8 = 0f64;
    for _round in 0..6 {
        let t = Instant::now();
        pool.parallel_for_all(groups, &|g| {
            let mut out = [0i32; 32];
            // SAFETY: group g lies inside the buffer; sizes as the kernel contract requires.
            unsafe {
                (int8.dot)(
                    &[a.as_ptr()],
                    kk,
                    (base as *const u8).add(g * 32 * kk),
                    sums.as_ptr(),
                    out.as_mut_ptr(),
                )
            };
            std::hint::black_box(out);
        })
        .unwrap();
        best_int8 = best_int8.max((groups * 32 * kk) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    println!(
        "R=1 int8 kernel: best {best_int8:.1} GB/s ({:.0}%)",
        100.0 * best_int8 / best_probe
    );
    // The int4 kernel: the same bytes as 32-row int4 groups of k = 2048 (32 KiB each).
    let groups4 = panels * panel * 2 / (32 * kk / 2);
    let mut best_int4 = 0f64;
    for _round in 0..6 {
        let t = Instant::now();
        pool.parallel_for_all(groups4, &|g| {
            let mut out = [0i32; 32];
            // SAFETY: group g lies inside the buffer; sizes as the kernel contract requires.
            unsafe {
                (int4.dot)(
                    &[a.as_ptr()],
                    kk,
                    (base as *const u8).add(g * 16 * kk),
                    sums.as_ptr(),
                    out.as_mut_ptr(),
                )
            };
            std::hint::black_box(out);
        })
        .unwrap();
        best_int4 = best_int4.max((groups4 * 16 * kk) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    println!(
        "R=1 int4 kernel: best {best_int4:.1} GB/s ({:.0}%)",
        100.0 * best_int4 / best_probe
    );
    // The AMX int8 kernel with m rows (a prefill expert's row block) over the same groups.
    if let Some(amx) = set.amx().filter(|a| !a.emulated) {
        let rows: Vec<Vec<u8>> = (0..32)
            .map(|r| kt_core::kernels::group_dot::activation_row(&vec![120 + r as u8; kk]))
            .collect();
        for m in [32usize, 16] {
            let ptrs: Vec<*const u8> = rows[..m].iter().map(|r| r.as_ptr()).collect();
            let ptrs_at = ptrs.as_ptr() as usize;
            let mut best_amx = 0f64;
            for _round in 0..6 {
                let t = Instant::now();
                pool.parallel_for_all(groups, &|g| {
                    let mut out = [0i32; 32 * 32];
                    // SAFETY: group g lies inside the buffer; m prepared rows of kk bytes; AMX
                    // allowed (the kernel set has it).
                    unsafe {
                        let a = std::slice::from_raw_parts(ptrs_at as *const *const u8, m);
                        (amx.int8)(
                            a,
                            kk,
                            (base as *const u8).add(g * 32 * kk),
                            sums.as_ptr(),
                            out.as_mut_ptr(),
                        )
                    };
                    std::hint::black_box(out);
                })
                .unwrap();
                best_amx =
                    best_amx.max((groups * 32 * kk) as f64 / t.elapsed().as_secs_f64() / 1e9);
            }
            println!(
                "AMX int8 kernel, {m} rows: best {best_amx:.1} GB/s ({:.0}%)",
                100.0 * best_amx / best_probe
            );
        }
    }
    println!("probe best {best_probe:.1} GB/s");
    println!(
        "R=1 panel kernel: best {best:.1} GB/s ({:.0}%)",
        100.0 * best / best_probe
    );
}
