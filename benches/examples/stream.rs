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
    let one_row = vec![kt_core::kernels::group_dot::activation_row(&vec![
        129u8;
        kk
    ])];
    let best_int8 = best_group_gbps(&pool, int8.dot, &one_row, kk, base, groups, 32 * kk);
    println!(
        "R=1 int8 kernel: best {best_int8:.1} GB/s ({:.0}%)",
        100.0 * best_int8 / best_probe
    );
    // The int4 kernel: the same bytes as 32-row int4 groups of k = 2048 (32 KiB each).
    let groups4 = panels * panel * 2 / (32 * kk / 2);
    let best_int4 = best_group_gbps(&pool, int4.dot, &one_row, kk, base, groups4, 16 * kk);
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
            let best_amx = best_group_gbps(&pool, amx.int8, &rows[..m], kk, base, groups, 32 * kk);
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

/// Best GB/s over 6 rounds of `kernel` on each of the `groups` groups of `group_bytes` at
/// `base`, with `rows` (1 to 32 activation rows of `k` inputs), on every thread of the pool.
fn best_group_gbps(
    pool: &kt_core::pool::Pool,
    kernel: kt_core::kernels::group_dot::GroupDotFn,
    rows: &[Vec<u8>],
    k: usize,
    base: usize,
    groups: usize,
    group_bytes: usize,
) -> f64 {
    let sums = [0i32; 32];
    let mut best = 0f64;
    for _round in 0..6 {
        let t = Instant::now();
        pool.parallel_for_all(groups, &|g| {
            let mut ptrs = [std::ptr::null::<u8>(); 32];
            for (p, r) in ptrs.iter_mut().zip(rows) {
                *p = r.as_ptr();
            }
            let mut out = [0i32; 32 * 32];
            // SAFETY: group g lies inside the buffer; rows.len() activation rows of k inputs
            // and 32 outputs per row, as the kernel's contract requires.
            unsafe {
                kernel(
                    &ptrs[..rows.len()],
                    k,
                    (base as *const u8).add(g * group_bytes),
                    sums.as_ptr(),
                    out.as_mut_ptr(),
                )
            };
            std::hint::black_box(out);
        })
        .unwrap();
        best = best.max((groups * group_bytes) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}
