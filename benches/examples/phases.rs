//! Diagnostic: this VM's slow phases. Window by window (about 0.3 ms each) it alternates a
//! register-only int8 mix (`vpmaddubsw` + `vpmaddwd` + `vpaddd`, the int8 probe's kind), the
//! same kind of mix with its activation broadcast from L1 (`vpbroadcastd` from memory, as every
//! many-row kernel does), and RAWINT4's AVX2 8-bit many-row kernel from L2 in calls of 4 and
//! of 12 rows. Windows whose broadcast mix ran at most 1.1× its fastest are "calm", at least
//! 1.2× "slowed"; each class's medians show which work a slow phase slows (the register mix
//! does not: a probe of that kind cannot see the phase).
//! `PHASE_SECONDS=6 cargo run --release -p kt-benches --example phases`
#[cfg(target_arch = "x86_64")]
mod x86 {
    use kt_core::codes::{CodeKind, ScaleType};
    use kt_core::formats::kgroup::int_dot::{int_gemm_for, prepare_row, row_bytes, WeightBytes};
    use kt_core::kernels::KernelSet;
    use std::arch::asm;
    use std::time::Instant;

    const STEPS: u32 = 320_000;

    /// ns per step of `$body` (one asm block of 32 steps, reading 16 bytes at `{x}`).
    macro_rules! ns_per_step {
        ($x:expr, $($body:literal),+) => {{
            let t = Instant::now();
            for _ in 0..STEPS / 32 {
                // SAFETY: AVX2 arithmetic on clobbered registers and 4-byte loads inside `x`
                // (64 bytes); `run` checked AVX2.
                unsafe {
                    asm!(
                        "/* {x} */",
                        ".rept 8",
                        $($body),+,
                        ".endr",
                        x = in(reg) $x.as_ptr(),
                        out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                        out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                        out("ymm12") _, out("ymm13") _, out("ymm14") _,
                        options(nostack, readonly),
                    )
                }
            }
            t.elapsed().as_secs_f64() * 1e9 / STEPS as f64
        }};
    }

    /// ns per 32-MAC step of four independent register-only int8 chains.
    fn register_mix(x: &[u8; 64]) -> f64 {
        ns_per_step!(
            x,
            "vpmaddubsw ymm8, ymm12, ymm13",
            "vpmaddwd ymm8, ymm8, ymm14",
            "vpaddd ymm0, ymm0, ymm8",
            "vpmaddubsw ymm9, ymm12, ymm13",
            "vpmaddwd ymm9, ymm9, ymm14",
            "vpaddd ymm1, ymm1, ymm9",
            "vpmaddubsw ymm10, ymm12, ymm13",
            "vpmaddwd ymm10, ymm10, ymm14",
            "vpaddd ymm2, ymm2, ymm10",
            "vpmaddubsw ymm11, ymm12, ymm13",
            "vpmaddwd ymm11, ymm11, ymm14",
            "vpaddd ymm3, ymm3, ymm11"
        )
    }

    /// ns per step of the same kind with the activation word broadcast from L1 (`x`).
    fn broadcast_mix(x: &[u8; 64]) -> f64 {
        ns_per_step!(
            x,
            "vpbroadcastd ymm8, dword ptr [{x}]",
            "vpmaddubsw ymm8, ymm12, ymm8",
            "vpaddw ymm0, ymm0, ymm8",
            "vpbroadcastd ymm9, dword ptr [{x} + 4]",
            "vpmaddubsw ymm9, ymm12, ymm9",
            "vpaddw ymm1, ymm1, ymm9",
            "vpbroadcastd ymm10, dword ptr [{x} + 8]",
            "vpmaddubsw ymm10, ymm12, ymm10",
            "vpaddw ymm2, ymm2, ymm10",
            "vpbroadcastd ymm11, dword ptr [{x} + 12]",
            "vpmaddubsw ymm11, ymm12, ymm11",
            "vpaddw ymm3, ymm3, ymm11"
        )
    }

    fn median(v: &mut [f64]) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

    pub fn run() {
        let level = KernelSet::best().unwrap().level();
        if !is_x86_feature_detected!("avx2") || level >= kt_core::isa::Level::Avx512Vnni {
            println!("measures the AVX2 kernel: needs AVX2 and no AVX-512 VNNI");
            return;
        }
        let (kernel, max_rows) = int_gemm_for(level).expect("an AVX2 kernel");
        let seconds = kt_benches::env_or("PHASE_SECONDS", 6) as f64;
        let (k, chunk, rows_n) = (2048, 32, 48);
        let w = WeightBytes::of(CodeKind::Int4, ScaleType::Bf16);
        let codes: Vec<u8> = (0..16 * k).map(|i| (i * 37 + 11) as u8).collect();
        let scales = vec![0x3Fu8; 32 * (k / chunk) * 2];
        let rows: Vec<Vec<u8>> = (0..rows_n)
            .map(|r| {
                let x: Vec<f32> = (0..k)
                    .map(|i| (((i + 7 * r) % 17) as f32 - 8.0) / 8.0)
                    .collect();
                let mut row = vec![0u8; row_bytes(k, chunk)];
                prepare_row(&x, chunk, &w, &mut row);
                row
            })
            .collect();
        let ptrs: Vec<*const u8> = rows.iter().map(|r| r.as_ptr()).collect();
        let mut out = vec![0f32; 32 * rows_n];
        let blocks: Vec<usize> = [4, 12].into_iter().filter(|&b| b <= max_rows).collect();
        let x = [1u8; 64];
        // Per window: register mix, broadcast mix, then the kernel per row block (ns per row
        // and 128-byte block).
        let mut windows: Vec<Vec<f64>> = Vec::new();
        let start = Instant::now();
        while start.elapsed().as_secs_f64() < seconds {
            let mut window = vec![register_mix(&x), broadcast_mix(&x)];
            for &b in &blocks {
                let t = Instant::now();
                for first in (0..rows_n).step_by(b) {
                    // SAFETY: b prepared rows of k inputs, 16·k code bytes, the scales of
                    // k/chunk groups, 32 outputs per row from row `first`; AVX2 allowed.
                    unsafe {
                        kernel(
                            &ptrs[first..first + b],
                            k,
                            (0, k),
                            chunk,
                            chunk,
                            codes.as_ptr(),
                            scales.as_ptr(),
                            &w,
                            out.as_mut_ptr().add(first * 32),
                        )
                    };
                }
                std::hint::black_box(&mut out);
                window.push(t.elapsed().as_secs_f64() * 1e9 / (rows_n * k / 8) as f64);
            }
            windows.push(window);
        }
        let fastest = windows.iter().map(|w| w[1]).fold(f64::MAX, f64::min);
        let mut names = vec![
            "register mix ns/step".to_string(),
            "L1 broadcast mix ns/step".into(),
        ];
        names.extend(
            blocks
                .iter()
                .map(|b| format!("kernel, calls of {b} rows, ns/row-block")),
        );
        let classes = [("calm", 0.0, 1.1), ("slowed", 1.2, f64::MAX)];
        let mut medians = Vec::new();
        for (label, lo, hi) in classes {
            let class: Vec<&Vec<f64>> = windows
                .iter()
                .filter(|w| (lo * fastest..=hi * fastest).contains(&w[1]))
                .collect();
            println!("{label}: {} of {} windows", class.len(), windows.len());
            let m: Vec<f64> = (0..names.len())
                .map(|i| {
                    let mut v: Vec<f64> = class.iter().map(|w| w[i]).collect();
                    if v.is_empty() {
                        f64::NAN
                    } else {
                        median(&mut v)
                    }
                })
                .collect();
            for (name, value) in names.iter().zip(&m) {
                println!("  {name:44} {value:7.3}");
            }
            medians.push(m);
        }
        println!("slowed / calm:");
        for (i, name) in names.iter().enumerate() {
            println!("  {name:44} {:7.2}", medians[1][i] / medians[0][i]);
        }
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    x86::run();
}
