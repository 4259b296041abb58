//! Diagnostic: the group-scaled 4-bit few-row kernel's compute rate on one core, from a panel
//! that stays in L1/L2 (no memory limit): the best of many repetitions, so a shared VM's
//! noise (other tenants, clock changes) drops out. Reports GB/s of codes and scales and
//! nanoseconds per 128-byte block (8 inputs of a 32-row panel) for 1 and 2 rows, every code
//! kind. `KERNEL=gemm` (8-bit many-row) or `KERNEL=fine` (15-bit many-row) measures the prefill
//! kernels instead, at every row count they take, in ns per block and row.
//! `ONLY=MXFP4` and `ROWS=3` restrict the cases (for `perf record`).
//! `cargo run --release -p kt-benches --example kgroup_cycles`
use kt_core::codes::{CodeKind, ScaleType};
use kt_core::formats::kgroup::int_dot::{
    int_fine_gemm_for, int_fused_for, int_gemm_for, prepare_row, row_bytes, WeightBytes,
};
use kt_core::kernels::KernelSet;
use std::time::Instant;

fn main() {
    let k = 2048usize;
    let level = KernelSet::best().unwrap().level();
    let family = std::env::var("KERNEL").unwrap_or_default();
    let (kernel, max_rows) = match family.as_str() {
        "gemm" => int_gemm_for(level),
        "fine" => int_fine_gemm_for(level),
        _ => int_fused_for(level).map(|(f, r)| (f, r.min(2))),
    }
    .expect("an integer kernel");
    let codes: Vec<u8> = (0..16 * k).map(|i| (i * 37 + 11) as u8).collect();
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
        let scales = vec![0x38u8; 32 * (k / group) * st.size()];
        let mut row = vec![0u8; row_bytes(k, chunk)];
        prepare_row(&x, chunk, &mut row);
        let w = WeightBytes::of(kind, st);
        for rows in (1..=max_rows).filter(|r| only_rows.is_none_or(|o| o == *r)) {
            let ptrs = vec![row.as_ptr(); rows];
            let mut out = vec![0f32; 32 * rows];
            let reps = 200;
            let mut best = f64::MAX;
            for _ in 0..kt_benches::env_or("TRIALS", 60) {
                let t = Instant::now();
                for _ in 0..reps {
                    // SAFETY: prepared rows of k inputs, 16·k code bytes, the panel's scales,
                    // 32 outputs per row; the level allows the kernel.
                    unsafe {
                        kernel(
                            &ptrs[..rows],
                            k,
                            (0, k),
                            chunk,
                            group,
                            codes.as_ptr(),
                            scales.as_ptr(),
                            &w,
                            out.as_mut_ptr(),
                        )
                    };
                    std::hint::black_box(&mut out);
                }
                best = best.min(t.elapsed().as_secs_f64() / reps as f64);
            }
            let bytes = (codes.len() + scales.len()) as f64;
            println!(
                "{name:10} rows {rows:2}: {:6.1} GB/s, {:5.2} ns per 128-byte block, {:5.2} per row",
                bytes / best / 1e9,
                best * 1e9 / (k / 8) as f64,
                best * 1e9 / (k / 8) as f64 / rows as f64
            );
        }
    }
}
