//! Diagnostic: MXFP8 panels (E4M3 codes, E8M0 group scales) against many rows on one core, the
//! two ways the layer can take them, alternated trial by trial: `decoded` (the power-of-two
//! decoder per 128-input block, then the fp32 kernel and the block sums added, as the
//! decoded-block path does) and `pow2` (the many-row kernel that never decodes scaled values;
//! `pow2-scaled`: rows handed over times 2⁶⁴, as the layer's packing gives them). Prints
//! GFLOP/s, best and median trial, per row count (`ROWS=3,8,32`); `PANELS=n` streams n
//! distinct panels from memory instead of one that stays in cache; `K` inputs (2048).
//! `cargo run --release -p kt-benches --example pow2_rows`
use kt_core::codes::CodeKind;
use kt_core::formats::kgroup::kernels as kgroup;
use kt_core::kernels::KernelSet;
use std::time::Instant;

fn main() {
    let k: usize = kt_benches::env_or("K", 2048);
    let panels: usize = kt_benches::env_or("PANELS", 1);
    let trials: usize = kt_benches::env_or("TRIALS", 15);
    let row_counts: Vec<usize> = std::env::var("ROWS")
        .unwrap_or_else(|_| "3,4,6,8,12,16,24,32".into())
        .split(',')
        .map(|r| r.trim().parse().expect("ROWS: a list of row counts"))
        .collect();
    let kernels = KernelSet::best().unwrap();
    let codes_kernels = kgroup::kernels_for(CodeKind::E4M3, kernels.level());
    let (Some(many), Some(pow2)) = (codes_kernels.fused_pow2, codes_kernels.decode_pow2) else {
        println!("no pow2 kernels at {:?}", kernels.level());
        return;
    };
    let lines = k / 2;
    let group_lines = 16;
    // Finite codes of both signs (no NaN bytes), exponents near 2⁻⁷.
    let codes: Vec<u8> = (0..64 * lines * panels)
        .map(|i| ((i * 37 + 11) % 127) as u8 ^ (i as u8 & 0x80))
        .collect();
    let exps: Vec<u8> = (0..32 * lines / group_lines * panels)
        .map(|i| 115 + (i % 13) as u8)
        .collect();
    let block = kgroup::POW2_BLOCK_LINES;
    let mut decoded = vec![0u16; 64 * block];
    for &n in &row_counts {
        let x = kt_benches::pattern_rows(n, k);
        let up: Vec<Vec<f32>> = x
            .iter()
            .map(|r| r.iter().map(|v| v * kgroup::POW2_ROW_SCALE).collect())
            .collect();
        let a: Vec<*const f32> = x.iter().map(|r| r.as_ptr()).collect();
        let a_up: Vec<*const f32> = up.iter().map(|r| r.as_ptr()).collect();
        let mut out = vec![0f32; 32 * n];
        let mut partial = vec![0f32; 32 * n];
        let step = kernels.rows_per_block();
        let reps = (2000 / n).max(4).min(panels.max(4 * 200 / n));
        let mut arms: Vec<(&str, Vec<f64>)> = vec![
            ("decoded", vec![]),
            ("pow2", vec![]),
            ("pow2-scaled", vec![]),
        ];
        for _ in 0..trials {
            for (arm, times) in arms.iter_mut() {
                let t = Instant::now();
                for rep in 0..reps {
                    let p = rep % panels;
                    let c = codes[p * 64 * lines..].as_ptr();
                    let e = exps[p * 32 * lines / group_lines..].as_ptr();
                    // SAFETY: sizes as the kernels' contracts ask; the level allows them.
                    unsafe {
                        match *arm {
                            "pow2" => {
                                (many.kernel)(&a, false, lines, group_lines, c, e, out.as_mut_ptr())
                            }
                            "pow2-scaled" => (many.kernel)(
                                &a_up,
                                true,
                                lines,
                                group_lines,
                                c,
                                e,
                                out.as_mut_ptr(),
                            ),
                            _ => {
                                for b in 0..lines / block {
                                    let tbl = &kt_core::codes::E2M1_VALUES;
                                    let (cb, eb) = (
                                        c.add(b * 64 * block),
                                        e.add(b * 32 * block / group_lines),
                                    );
                                    (pow2.decode)(
                                        cb,
                                        block,
                                        group_lines,
                                        eb,
                                        tbl,
                                        decoded.as_mut_ptr(),
                                    );
                                    for r0 in (0..n).step_by(step) {
                                        let m = step.min(n - r0);
                                        let rows: Vec<*const f32> = a[r0..r0 + m]
                                            .iter()
                                            .map(|r| r.add(2 * b * block))
                                            .collect();
                                        kernels.panel_dot_raw(
                                            &rows,
                                            2 * block,
                                            decoded.as_ptr(),
                                            partial.as_mut_ptr(),
                                        );
                                        let dst = &mut out[r0 * 32..(r0 + m) * 32];
                                        for (d, s) in dst.iter_mut().zip(&partial) {
                                            *d = if b == 0 { *s } else { *d + *s };
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
                times.push(t.elapsed().as_secs_f64() / reps as f64);
            }
        }
        let flop = 2.0 * 32.0 * k as f64 * n as f64;
        let line: Vec<String> = arms
            .iter_mut()
            .map(|(arm, times)| {
                times.sort_by(f64::total_cmp);
                let (best, median) = (flop / times[0] / 1e9, flop / times[times.len() / 2] / 1e9);
                format!("{arm} {best:.1}/{median:.1}")
            })
            .collect();
        println!("rows {n:2}: GFLOP/s best/median: {}", line.join(", "));
    }
}
