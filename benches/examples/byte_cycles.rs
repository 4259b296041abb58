//! Diagnostic: the 8-bit fused decode kernels (FP8 block-scaled, MXFP8) from cache, one core,
//! best of `TRIALS` trials of `REPS` passes over one 32-row panel of `K` inputs, as ns per
//! 64-byte line and GB/s of codes. `ROWS` activation rows per call (MXFP8: as many as its
//! few-row kernel takes).
//! `cargo run --release -p kt-benches --example byte_cycles`
use kt_core::codes::{CodeKind, ScaleType};
use kt_core::formats::fp8::kernels as fp8;
use kt_core::formats::kgroup::kernels as kgroup;
use kt_core::kernels::KernelSet;
use std::time::Instant;

fn main() {
    let k: usize = kt_benches::env_or("K", 2048);
    let rows: usize = kt_benches::env_or("ROWS", 1);
    let trials: usize = kt_benches::env_or("TRIALS", 30);
    let reps: usize = kt_benches::env_or("REPS", 200);
    let level = KernelSet::best().unwrap().level();
    // Finite E4M3 codes of both signs (no 0x7F/0xFF NaNs), E8M0 scales near 1. SUBNORMALS=1
    // keeps the codes with a zero exponent field and nonzero mantissa (7 in 127 here): the fused
    // kernels' values for them are fp32 denormals, which cost Intel cores a microcode assist per
    // instruction (an Intel Xeon (Sapphire Rapids class) ran FP8 at 150-180 ns per line with
    // them, against about 3 ns on AMD Zen 3). By default they are moved to the next exponent.
    // The kernels read them as zero where `KT_KERNEL_FP8_SUBNORMALS` says (by default on Intel).
    let subnormals = kt_benches::env_or("SUBNORMALS", 0) == 1;
    let codes: Vec<u8> = (0..32 * k)
        .map(|i| {
            let c = ((i * 37 + 11) % 127) as u8 ^ (i as u8 & 0x80);
            if !subnormals && c & 0x78 == 0 && c & 0x07 != 0 {
                c | 0x08
            } else {
                c
            }
        })
        .collect();
    let fp8_scales: Vec<f32> = (0..k / fp8::BLOCK).map(|b| 0.5 + b as f32 * 0.01).collect();
    let mx_scales: Vec<u8> = (0..32 * k / 32).map(|i| 120 + (i % 13) as u8).collect();
    let x = kt_benches::pattern_rows(rows, k);
    let a: Vec<*const f32> = x.iter().map(|r| r.as_ptr()).collect();
    let mut out = vec![0f32; 32 * rows];
    let lines = k / 2;
    // Panels per call of the kernel being timed (the pair kernels stream two).
    let lines_scale = std::cell::Cell::new(1usize);
    let mut time = |name: &str, run: &mut dyn FnMut(&mut [f32])| {
        let mut best = f64::MAX;
        for _ in 0..trials {
            let t = Instant::now();
            for _ in 0..reps {
                run(&mut out);
            }
            best = best.min(t.elapsed().as_secs_f64() / reps as f64);
        }
        let ns = best * 1e9 / (lines * lines_scale.get()) as f64;
        println!(
            "{name} rows {rows}: {ns:.2} ns per line, {:.1} GB/s",
            64.0 / ns
        );
    };
    if let Some(fused) = fp8::fused_for(level) {
        time("FP8", &mut |o| unsafe {
            (fused.run)(
                &a,
                false,
                k,
                codes.as_ptr(),
                fp8_scales.as_ptr(),
                o.as_mut_ptr(),
            )
        });
        if let Some((pair, _)) = fused.pair.filter(|&(_, max)| rows <= max) {
            // Two panels per call (the second panel's codes reversed): `lines` counts both.
            let other: Vec<u8> = codes.iter().rev().copied().collect();
            let mut second = vec![0f32; 32 * rows];
            lines_scale.set(2);
            time("FP8 panel pair", &mut |o| unsafe {
                pair(
                    &a,
                    false,
                    k,
                    [codes.as_ptr(), other.as_ptr()],
                    [fp8_scales.as_ptr(), fp8_scales.as_ptr()],
                    [o.as_mut_ptr(), second.as_mut_ptr()],
                )
            });
            lines_scale.set(1);
        }
        if rows > 2 {
            // The rows handed over times 2⁶⁴, as the layer packs them from three rows on.
            let up: Vec<Vec<f32>> = x
                .iter()
                .map(|r| r.iter().map(|v| v * kt_core::formats::ROWS_UP64).collect())
                .collect();
            let a_up: Vec<*const f32> = up.iter().map(|r| r.as_ptr()).collect();
            time("FP8 (rows scaled)", &mut |o| unsafe {
                (fused.run)(
                    &a_up,
                    true,
                    k,
                    codes.as_ptr(),
                    fp8_scales.as_ptr(),
                    o.as_mut_ptr(),
                )
            });
        }
    }
    let mxfp8 = kgroup::kernels_for(CodeKind::E4M3, level).fused;
    // The fused MXFP8 kernel takes a few rows (more go to other kernels: `pow2_rows`).
    if let Some((run, _)) = mxfp8.filter(|&(_, max_rows)| rows <= max_rows) {
        let group_lines = 16;
        time("MXFP8", &mut |o| unsafe {
            run(
                &a,
                lines,
                group_lines,
                codes.as_ptr(),
                mx_scales.as_ptr(),
                ScaleType::E8M0,
                o.as_mut_ptr(),
            )
        });
    }
}
