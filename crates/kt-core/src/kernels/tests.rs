//! Every kernel against its scalar twin on random data, for every level this CPU can run.
use super::*;
use crate::dtype::{bf16_bits_to_f32, f32_to_bf16_bits};
use crate::rng::Rng;

fn random_panel(rng: &mut Rng, k: usize) -> Vec<u16> {
    (0..32 * k)
        .map(|_| f32_to_bf16_bits(rng.normal() * 0.1))
        .collect()
}

fn reference(a: &[f32], panel: &[u16], lane: usize, k: usize) -> (f64, f64) {
    let (mut exact, mut mag) = (0f64, 0f64);
    for (kk, &x) in a.iter().enumerate().take(k) {
        let w = bf16_bits_to_f32(panel[crate::pack::packed_index(lane, kk, k)]) as f64;
        exact += x as f64 * w;
        mag += (x as f64 * w).abs();
    }
    (exact, mag)
}

fn check_fma_against_twin(set: &KernelSet, ks: &[usize]) {
    // With software prefetching on (it must not change a result).
    super::prefetch::set(super::prefetch::CANDIDATE);
    let twin = KernelSet::scalar_twin();
    let mut rng = Rng::new(7 + set.level() as u64);
    for &k in ks {
        let panel = random_panel(&mut rng, k);
        for rows in 1..=set.rows_per_block() {
            let a: Vec<Vec<f32>> = (0..rows).map(|_| rng.normals(k, 1.0)).collect();
            let refs: Vec<&[f32]> = a.iter().map(|r| r.as_slice()).collect();
            let mut got = vec![0f32; rows * 32];
            let mut want = vec![0f32; rows * 32];
            set.panel_dot(&refs, &panel, &mut got);
            twin.panel_dot(&refs, &panel, &mut want);
            // Same operations in the same order: bit-exact.
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{} rows={rows} k={k} idx={i}: {g} vs {w}",
                    set.name()
                );
            }
            // And close to a float64 reference (catches a twin that is wrong in the same way).
            for r in 0..rows {
                for lane in 0..32 {
                    let (exact, mag) = reference(&a[r], &panel, lane, k);
                    let g = got[r * 32 + lane] as f64;
                    assert!(
                        (g - exact).abs() <= 1e-5 * mag + 1e-6,
                        "{}: {g} vs {exact}",
                        set.name()
                    );
                }
            }
        }
    }
}

#[test]
fn fma_kernels_match_scalar_twin_bit_exactly() {
    for level in runnable_levels() {
        let set = KernelSet::for_level(level).unwrap();
        check_fma_against_twin(&set, &[2, 34, 256, 1030]);
        // No inputs: zeros, whatever `out` held.
        for rows in [1, 2, 5, set.rows_per_block()] {
            let empty: Vec<&[f32]> = vec![&[]; rows];
            let mut out = vec![f32::NAN; rows * 32];
            set.panel_dot(&empty, &[], &mut out);
            assert!(out.iter().all(|&v| v == 0.0), "{} rows={rows}", set.name());
        }
    }
}

#[test]
fn bf16_kernels_match_their_twin() {
    let detected = isa::global().unwrap().detected;
    if detected < Level::Avx512Bf16 {
        eprintln!("skipping: no avx512_bf16 here");
        return;
    }
    let set = KernelSet::with_bf16(Level::Avx512Bf16, 1).unwrap();
    let twin = KernelSet::scalar_twin_bf16(1);
    let mut rng = Rng::new(17);
    for k in [2usize, 34, 64, 1030] {
        let panel = random_panel(&mut rng, k);
        let rows = set.bf16().unwrap().rows_per_block;
        for nr in 1..=rows {
            let a: Vec<Vec<f32>> = (0..nr).map(|_| rng.normals(k, 1.0)).collect();
            // Staging: SIMD (32 at a time + scalar tail) equals the scalar twin bit for bit.
            let staged: Vec<Vec<u32>> = a
                .iter()
                .map(|row| {
                    let mut s1 = vec![0u32; k / 2];
                    let mut s2 = vec![0u32; k / 2];
                    set.stage_bf16(row, &mut s1);
                    twin.stage_bf16(row, &mut s2);
                    assert_eq!(s1, s2);
                    s1
                })
                .collect();
            let refs: Vec<&[u32]> = staged.iter().map(|r| r.as_slice()).collect();
            let mut got = vec![0f32; nr * 32];
            let mut want = vec![0f32; nr * 32];
            set.panel_dot_bf16(&refs, &panel, &mut got);
            twin.panel_dot_bf16(&refs, &panel, &mut want);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "rows={nr} k={k} idx={i}: {g} vs {w}"
                );
            }
            for r in 0..nr {
                for lane in 0..32 {
                    let (exact, mag) = reference(&a[r], &panel, lane, k);
                    let g = got[r * 32 + lane] as f64;
                    assert!((g - exact).abs() <= 1e-2 * mag + 1e-6, "{g} vs {exact}");
                }
            }
        }
    }
}

#[test]
fn swiglu_matches_twin_and_float64() {
    let mut rng = Rng::new(3);
    let n = 1000;
    let g = rng.normals(n, 4.0);
    let u = rng.normals(n, 4.0);
    for level in runnable_levels() {
        let set = KernelSet::for_level(level).unwrap();
        for (limit, alpha) in [(0.0f32, 0.0f32), (2.5, 0.0), (0.0, 1.702), (3.0, 1.702)] {
            let mut out = vec![0f32; n];
            let mut twin = vec![0f32; n];
            set.swiglu(&g, &u, &mut out, limit, alpha);
            KernelSet::scalar_twin().swiglu(&g, &u, &mut twin, limit, alpha);
            for i in 0..n {
                assert_eq!(out[i].to_bits(), twin[i].to_bits());
                let (mut gg, mut uu) = (g[i] as f64, u[i] as f64);
                if limit > 0.0 {
                    gg = gg.min(limit as f64);
                    uu = uu.clamp(-limit as f64, limit as f64);
                }
                let want = if alpha > 0.0 {
                    gg / (1.0 + (-(alpha as f64) * gg).exp()) * (uu + 1.0)
                } else {
                    gg / (1.0 + (-gg).exp()) * uu
                };
                assert!(
                    (out[i] as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{} vs {want}",
                    out[i]
                );
            }
        }
    }
}

#[test]
fn exp_approx_is_accurate_and_propagates_nan_in_swiglu() {
    for i in -870..=880 {
        let x = i as f32 * 0.1;
        let (got, want) = (exp_approx(x) as f64, (x as f64).exp());
        assert!(
            (got - want).abs() <= 1e-6 * want,
            "exp({x}) = {got} vs {want}"
        );
    }
    assert!(swiglu_one(f32::NAN, 1.0, 0.0, 0.0).is_nan());
    assert!(swiglu_one(1.0, f32::NAN, 0.0, 0.0).is_nan());
}

#[test]
fn asking_for_more_than_the_cpu_has_is_an_error() {
    let detected = isa::global().unwrap().detected;
    if detected < Level::Amx {
        let err = KernelSet::for_level(Level::Amx).unwrap_err();
        assert!(err.to_string().contains("amx"), "{err}");
    }
}

#[test]
fn formats_choose_the_amx_threshold_unless_it_was_asked_for() {
    let asked = KernelSet::scalar_twin().with_emulated_amx(3);
    let rows = |s: KernelSet| s.amx().map(|a| a.min_rows);
    assert_eq!(rows(asked.with_amx_rows_default(16)), Some(3));
    let mut free = asked;
    free.amx.as_mut().unwrap().min_rows_fixed = false;
    assert_eq!(rows(free.with_amx_rows_default(16)), Some(16));
    // Without an AMX path there is nothing to set.
    assert_eq!(
        rows(KernelSet::scalar_twin().with_amx_rows_default(16)),
        None
    );
    // The registry's defaults.
    use crate::method::Method;
    assert_eq!(crate::formats::amx_min_rows_default(Method::RawInt4), 16);
    assert_eq!(
        crate::formats::amx_min_rows_default(Method::AmxInt8),
        AMX_MIN_ROWS
    );
}

#[test]
fn even_blocks_cover_the_rows_in_as_few_blocks_as_full_ones() {
    for block in 1..=8 {
        for rows in 1..=70 {
            let mut sizes = Vec::new();
            let mut left = rows;
            while left > 0 {
                let nr = even_block(left, block);
                assert!(
                    (1..=block).contains(&nr),
                    "{rows} rows at {block}: block {nr}"
                );
                sizes.push(nr);
                left -= nr;
            }
            assert_eq!(sizes.len(), rows.div_ceil(block), "{rows} rows at {block}");
            let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(hi - lo <= 1, "{rows} rows at {block}: {sizes:?}");
        }
    }
    let mut left = 32;
    let sizes: Vec<usize> = std::iter::from_fn(|| {
        (left > 0).then(|| {
            let nr = even_block(left, 5);
            left -= nr;
            nr
        })
    })
    .collect();
    assert_eq!(sizes, [5, 5, 5, 5, 4, 4, 4]);
}
