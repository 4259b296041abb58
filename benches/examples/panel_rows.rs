//! Diagnostic: the fp32-FMA panel kernel's GFLOP/s on one thread, `ROWS` token rows per panel
//! in calls of the kernel's row block, over `PANELS` distinct panels of `K` inputs (1: from
//! cache; thousands: streamed from memory as a prefill streams experts).
//! `BF16DOT=1` times the bf16-pair kernel on staged rows instead, where the set has one.
//! `ROWS=32 PANELS=2000 cargo run --release -p kt-benches --example panel_rows`
use kt_core::kernels::KernelSet;
use kt_core::rng::Rng;
use std::time::Instant;

fn main() {
    let k: usize = kt_benches::env_or("K", 2048);
    let rows: usize = kt_benches::env_or("ROWS", 32);
    let panels: usize = kt_benches::env_or("PANELS", 1);
    let set = KernelSet::best().unwrap();
    // PF=<bytes> prefetches panel lines that far ahead (PF_L2=1: into L2), as a decode's tuner
    // may set it; by default off (this example runs no calibration).
    let pf: usize = kt_benches::env_or("PF", 0);
    let into_l2 = kt_benches::env_or("PF_L2", 0) == 1;
    kt_core::kernels::prefetch::set(
        pf | if into_l2 {
            kt_core::kernels::prefetch::INTO_L2
        } else {
            0
        },
    );
    let mut rng = Rng::new(3);
    let one: Vec<u16> = (0..32 * k)
        .map(|_| kt_core::dtype::f32_to_bf16_bits(rng.normal()))
        .collect();
    // In huge pages, as the layer keeps its weights (4 KiB pages add a TLB walk every 32
    // lines of a streamed panel). HUGE=0 for default pages.
    let mut all = if kt_benches::env_or("HUGE", 1) == 1 {
        kt_core::pack::AlignedBuf::<u16>::zeroed(panels * 32 * k).unwrap()
    } else {
        kt_core::pack::AlignedBuf::<u16>::zeroed_default_pages(panels * 32 * k).unwrap()
    };
    for (dst, &src) in all.as_mut_slice().iter_mut().zip(one.iter().cycle()) {
        *dst = src;
    }
    let a: Vec<Vec<f32>> = (0..rows).map(|_| rng.normals(k, 1.0)).collect();
    let refs: Vec<&[f32]> = a.iter().map(|r| r.as_slice()).collect();
    let mut out = vec![0f32; rows * 32];
    // BF16DOT=1: the bf16-pair kernel (`vdpbf16ps` where it exists) on staged rows instead.
    let bf16dot = kt_benches::env_or("BF16DOT", 0) == 1 && set.bf16().is_some();
    let staged: Vec<Vec<u32>> = if bf16dot {
        a.iter()
            .map(|r| {
                let mut s = vec![0u32; k / 2];
                set.stage_bf16(r, &mut s);
                s
            })
            .collect()
    } else {
        Vec::new()
    };
    let staged_refs: Vec<&[u32]> = staged.iter().map(|r| r.as_slice()).collect();
    let block = if bf16dot {
        set.bf16().unwrap().rows_per_block
    } else {
        set.rows_per_block()
    };
    let reps = (200_000_000 / (rows * k * panels)).max(1);
    let mut times = Vec::new();
    for _ in 0..9 {
        let t = Instant::now();
        for _ in 0..reps {
            for panel in all.as_slice().chunks_exact(32 * k) {
                let mut r0 = 0;
                while r0 < rows {
                    let nr = block.min(rows - r0);
                    if bf16dot {
                        set.panel_dot_bf16(&staged_refs[r0..r0 + nr], panel, &mut out[r0 * 32..]);
                    } else {
                        set.panel_dot(&refs[r0..r0 + nr], panel, &mut out[r0 * 32..]);
                    }
                    r0 += nr;
                }
            }
        }
        times.push(t.elapsed().as_secs_f64() / (reps * panels) as f64);
    }
    times.sort_by(f64::total_cmp);
    let flops = 2.0 * (rows * 32 * k) as f64;
    println!(
        "{}{} rows={rows} (calls of {block}) k={k} panels={panels}: median {:.1} GFLOP/s, best {:.1}",
        set.name(),
        if bf16dot { " (bf16 pairs)" } else { "" },
        flops / times[4] / 1e9,
        flops / times[0] / 1e9
    );
}
