//! Diagnostic: the AMX bf16 panel kernel's rate (GFLOP/s, one thread) on 32 packed rows, with
//! the rows and the panel resident in L1 (small k) or L2 (large k), and with panels rotating
//! through a larger set (weights from L2 or DRAM); with `TWO=1`, both cores streaming panels from
//! DRAM at once (GB/s of weights, 16 and 32 rows).
//! `cargo run --release -p kt-benches --example amx_panel`
use kt_core::kernels::KernelSet;
use kt_core::pack::AlignedBuf;
use std::time::Instant;

fn main() {
    let set = KernelSet::best().unwrap();
    let Some(amx) = set.amx().filter(|a| !a.emulated) else {
        println!("no AMX hardware");
        return;
    };
    if std::env::var_os("TWO").is_some() {
        for m in [16, 32] {
            println!("2 threads, {m} rows: {:.1} GB/s", two_threads(m));
        }
        return;
    }
    let m = 32;
    for &k in &[128usize, 256, 512, 1024, 2048] {
        for &panels in &[1usize, 8, 64, 512] {
            let step = m * 64;
            let mut a = AlignedBuf::<u8>::zeroed(step * (k * 2 / 64)).unwrap();
            for (i, v) in a.as_mut_slice().iter_mut().enumerate() {
                *v = if i % 2 == 0 { (i / 2) as u8 } else { 0x3f };
            }
            let len = 32 * k;
            let mut w = AlignedBuf::<u16>::zeroed(len * panels).unwrap();
            for (i, v) in w.as_mut_slice().iter_mut().enumerate() {
                *v = 0x3f80 ^ (i as u16 & 0xff);
            }
            let mut out = vec![0f32; m * 32];
            let calls = (400_000_000 / (2 * m * 32 * k)).max(panels * 4);
            let best = best_seconds(5, amx, &a, m, k, &w, &mut out, calls, panels);
            let flops = (2 * m * 32 * k * calls) as f64;
            println!(
                "k {k:5} panels {panels:4} ({:6} KiB of weights): {:7.0} GFLOP/s",
                panels * len * 2 / 1024,
                flops / best / 1e9
            );
        }
    }
}

/// Both cores at once, each streaming its own 256 MiB of panels from DRAM (k = 2048, 32 rows):
/// GB/s of weights in total.
fn two_threads(m: usize) -> f64 {
    let k = 2048;
    let len = 32 * k;
    let panels = (256usize << 20) / (2 * len);
    let results: Vec<f64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(move || {
                    let set = KernelSet::best().unwrap();
                    let amx = set.amx().unwrap();
                    let step = 32 * 64;
                    let a = AlignedBuf::<u8>::zeroed(step * (k * 2 / 64)).unwrap();
                    let mut w = AlignedBuf::<u16>::zeroed(len * panels).unwrap();
                    w.as_mut_slice()
                        .iter_mut()
                        .enumerate()
                        .for_each(|(i, v)| *v = i as u16);
                    let mut out = vec![0f32; 32 * 32];
                    let best = best_seconds(4, amx, &a, m, k, &w, &mut out, panels, panels);
                    (panels * len * 2) as f64 / best / 1e9
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    results.iter().sum()
}

/// The fastest of `rounds` timings of `calls` calls of the packed bf16 tile program on `m` packed
/// rows of `k` inputs, call `c` against panel `c % panels` of `w`.
#[allow(clippy::too_many_arguments)] // the program's operands and the loop's counts
fn best_seconds(
    rounds: usize,
    amx: &kt_core::kernels::AmxPath,
    a: &AlignedBuf<u8>,
    m: usize,
    k: usize,
    w: &AlignedBuf<u16>,
    out: &mut [f32],
    calls: usize,
    panels: usize,
) -> f64 {
    let (step, len) = (32 * 64, 32 * k);
    let mut best = f64::MAX;
    for _ in 0..rounds {
        let t = Instant::now();
        for c in 0..calls {
            // SAFETY: packed rows of k inputs (steps of 32 rows), a panel of k inputs, m·32
            // outputs.
            unsafe {
                (amx.bf16_packed)(
                    a.as_ptr(),
                    step,
                    m,
                    k,
                    w.as_ptr().add(c % panels * len),
                    out.as_mut_ptr(),
                )
            };
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}
