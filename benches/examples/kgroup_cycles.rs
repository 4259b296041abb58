//! Diagnostic: the group-scaled 4-bit few-row kernel's compute rate on one core, from a panel
//! that stays in L1/L2 (no memory limit): the best of many repetitions, so a shared VM's
//! noise (other tenants, clock changes) drops out. Reports GB/s of codes and scales and
//! nanoseconds per 128-byte block (8 inputs of a 32-row panel) for 1 and 2 rows
//! (`FUSED_ROWS=3`: up to 3, the most the AVX-512 kernel takes), every code kind.
//! `KERNEL=gemm` (8-bit many-row) or `KERNEL=fine` (15-bit many-row) measures the prefill
//! kernels instead (`KERNEL=reuse`: the 15-bit one as the forward calls it, keeping what it
//! made of the rows across calls, where it has that form), at every row count they take, in ns per block and row; a list
//! (`KERNEL=fused,fine`) measures them in alternation, trial by trial.
//! `ONLY=MXFP4` and `ROWS=3` restrict the cases (for `perf record`); `K=512` shrinks the panel
//! (L1-resident); `PANELS=2000` streams the panels from memory instead. Each line also gives
//! the median trial, per row.
//! `cargo run --release -p kt-benches --example kgroup_cycles`
use kt_core::codes::{CodeKind, ScaleType};
use kt_core::formats::kgroup::int_dot::{
    int_fine_gemm_for, int_fine_gemm_reusing_for, int_fused_for, int_gemm_for, prepare_row,
    row_bytes, IntFusedFn, WeightBytes,
};
use kt_core::kernels::KernelSet;
use std::time::Instant;

/// The reusing 15-bit many-row kernel under one key for every call (the rows never change).
///
/// # Safety
/// The [`IntFusedFn`] contract.
#[allow(clippy::too_many_arguments)] // the IntFusedFn signature
unsafe fn fine_reusing(
    rows: &[*const u8],
    k: usize,
    range: (usize, usize),
    chunk: usize,
    group: usize,
    codes: *const u8,
    scales: *const u8,
    w: &WeightBytes,
    out: *mut f32,
) {
    let level = KernelSet::best().unwrap().level();
    let kernel = int_fine_gemm_reusing_for(level).expect("a reusing kernel");
    // SAFETY: forwarded; the rows stay as they are for the whole run.
    unsafe { kernel(1, rows, k, range, chunk, group, codes, scales, w, out) }
}

fn main() {
    let k: usize = kt_benches::env_or("K", 2048);
    // Every case's group (up to GPTQ's 128) must divide the panel's inputs.
    assert!(
        k > 0 && k.is_multiple_of(128),
        "K must be a positive multiple of 128, got {k}"
    );
    let level = KernelSet::best().unwrap().level();
    // One or more families, measured in alternation trial by trial (this machine's speed
    // drifts between runs; alternating keeps a comparison fair).
    let families: Vec<(String, IntFusedFn, usize)> = std::env::var("KERNEL")
        .unwrap_or_else(|_| "fused".into())
        .split(',')
        .map(|family| {
            let (kernel, max_rows) = match family {
                "gemm" => int_gemm_for(level),
                "fine" => int_fine_gemm_for(level),
                // The forward's form: what the kernel makes of the rows kept across calls.
                "reuse" => int_fine_gemm_for(level)
                    .filter(|_| int_fine_gemm_reusing_for(level).is_some())
                    .map(|(_, rows)| (fine_reusing as IntFusedFn, rows)),
                "fused" => int_fused_for(level)
                    .map(|(f, r)| (f, r.min(kt_benches::env_or("FUSED_ROWS", 2)))),
                other => panic!("KERNEL takes fused, gemm, fine or reuse, not {other}"),
            }
            .expect("an integer kernel");
            (family.to_string(), kernel, max_rows)
        })
        .collect();
    let max_rows = families.iter().map(|f| f.2).max().unwrap_or(1);
    // PANELS=n cycles through n distinct panels (thousands: streamed from memory, as a
    // prefill streams experts) instead of one that stays in cache.
    let panels: usize = kt_benches::env_or("PANELS", 1);
    let codes: Vec<u8> = (0..16 * k * panels).map(|i| (i * 37 + 11) as u8).collect();
    let x: Vec<f32> = (0..k).map(|i| ((i % 17) as f32 - 8.0) * 0.125).collect();
    let cases = [
        ("MXFP4", CodeKind::E2M1, ScaleType::E8M0, 32),
        ("NVFP4", CodeKind::E2M1, ScaleType::E4M3, 16),
        ("RAWINT4", CodeKind::Int4, ScaleType::Bf16, 32),
        ("GPTQ_INT4", CodeKind::Int4, ScaleType::F16, 128),
    ];
    let only = std::env::var("ONLY").ok();
    let only_rows: Option<usize> = std::env::var("ROWS").ok().and_then(|v| v.parse().ok());
    for (name, kind, st, group) in cases {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let chunk = group.min(32);
        let panel_scales = 32 * (k / group) * st.size();
        let scales = vec![0x38u8; panel_scales * panels];
        // One prepared row per kernel row (as in a layer), each from shifted inputs.
        let w = WeightBytes::of(kind, st);
        let prepared: Vec<Vec<u8>> = (0..max_rows)
            .map(|r| {
                let shifted: Vec<f32> = (0..k).map(|i| x[(i + 7 * r) % k]).collect();
                let mut row = vec![0u8; row_bytes(k, chunk)];
                prepare_row(&shifted, chunk, &w, &mut row);
                row
            })
            .collect();
        for rows in (1..=max_rows).filter(|r| only_rows.is_none_or(|o| o == *r)) {
            let ptrs: Vec<*const u8> = prepared[..rows].iter().map(|r| r.as_ptr()).collect();
            let mut out = vec![0f32; 32 * rows];
            let reps = 200.max(panels);
            let takers: Vec<_> = families.iter().filter(|f| f.2 >= rows).collect();
            let mut best = vec![f64::MAX; takers.len()];
            // Every trial's time too: the median shows what a long run gets on this VM.
            let mut all = vec![Vec::new(); takers.len()];
            for _ in 0..kt_benches::env_or("TRIALS", 60) {
                for ((b, times), (_, kernel, _)) in best.iter_mut().zip(&mut all).zip(&takers) {
                    let t = Instant::now();
                    for rep in 0..reps {
                        let p = rep % panels;
                        // SAFETY: prepared rows of k inputs, 16·k code bytes, the panel's
                        // scales, 32 outputs per row; the level allows the kernel.
                        unsafe {
                            kernel(
                                &ptrs[..rows],
                                k,
                                (0, k),
                                chunk,
                                group,
                                codes[p * 16 * k..].as_ptr(),
                                scales[p * panel_scales..].as_ptr(),
                                &w,
                                out.as_mut_ptr(),
                            )
                        };
                        std::hint::black_box(&mut out);
                    }
                    let per_call = t.elapsed().as_secs_f64() / reps as f64;
                    *b = b.min(per_call);
                    times.push(per_call);
                }
            }
            let bytes = (codes.len() + scales.len()) as f64 / panels as f64;
            for ((best, times), (family, _, _)) in best.iter().zip(&mut all).zip(&takers) {
                times.sort_by(f64::total_cmp);
                let median = times[times.len() / 2];
                let per_block = |t: f64| t * 1e9 / (k / 8) as f64;
                println!(
                    "{name:10} {family:5} rows {rows:2}: {:6.1} GB/s, {:5.2} ns per 128-byte \
                     block, {:5.2} per row (median {:5.2})",
                    bytes / best / 1e9,
                    per_block(*best),
                    per_block(*best) / rows as f64,
                    per_block(median) / rows as f64
                );
            }
        }
    }
}
