//! FP8 (E4M3FN) panel kernels: 32 weight rows of `k` bytes against up to [`MAX_ROWS`] fp32
//! activation rows, one f32 scale per 128-input block (all 32 rows of a panel lie in one
//! 128-row scale block).
//!
//! Decoding: an E4M3FN byte `s eeee mmm` placed as the half-precision bits `s 0eeee mmm0000000`
//! is the same value times 2⁻⁸ (exponent bias 15 instead of 7, subnormals included), so the
//! vector kernels widen bytes to 16 bits, shift them into place and convert with
//! `vcvtph2ps`; the 2⁸ is folded into the stored block scales ([`SCALE_FOLD`]). NaN codes
//! (`0x7F`, `0xFF`) would decode as finite values: loading refuses them.
//!
//! Arithmetic, identical in every variant: per row and per 128-input block, an fp32 dot
//! product of the decoded weights with the activations; then `acc += block_sum · scale`.
use crate::isa::Level;
use crate::pack::PANEL;

/// Inputs per scale block (DeepSeek-V3 block FP8: 128 × 128).
pub const BLOCK: usize = 128;

/// The factor between an E4M3FN value and its byte read as half-precision bits shifted left
/// by 7 (see the module docs); stored scales carry it.
pub const SCALE_FOLD: f32 = 256.0;

/// One panel: `out[r·32 + j] = Σ_b scales[b] · Σ_{k ∈ block b} w[j][k] · a[r][k]`, with `w` the
/// panel's 32 rows of `k` E4M3 bytes (row-major) decoded as `value / SCALE_FOLD`.
///
/// # Safety
/// `a` holds at most the variant's rows, each pointing to `k` readable f32; `w` points to
/// `32·k` bytes, `scales` to `k / 128` f32, `out` to `32·a.len()` writable f32; `k` is a
/// multiple of 128; the CPU has the variant's features.
pub type Fp8PanelFn =
    unsafe fn(a: &[*const f32], k: usize, w: *const u8, scales: *const f32, out: *mut f32);

/// A panel kernel and its rows per call.
#[derive(Debug, Clone, Copy)]
pub struct Fp8Kernel {
    /// The kernel ([`Fp8PanelFn`] contract; the level's ISA is guaranteed by who chose it).
    pub dot: Fp8PanelFn,
    /// Token rows per call.
    pub rows: usize,
    /// Name, as the layer's `kernel` reports it after "fp8-".
    pub name: &'static str,
}

/// The widest kernel `level` allows.
pub fn kernel_for(level: Level) -> Fp8Kernel {
    #[cfg(target_arch = "x86_64")]
    {
        if level >= Level::Avx512Base {
            return Fp8Kernel {
                dot: x86::panel_avx512,
                rows: 8,
                name: "avx512",
            };
        }
        if level >= Level::Avx2 {
            return Fp8Kernel {
                dot: x86::panel_avx2,
                rows: 4,
                name: "avx2",
            };
        }
    }
    let _ = level;
    Fp8Kernel {
        dot: panel_scalar,
        rows: 8,
        name: "scalar",
    }
}

/// A byte as the vector kernels decode it: the half-precision value of `s 0eeee mmm0000000`.
pub fn decode_scaled(b: u8) -> f32 {
    let bits = ((b as u16 & 0x80) << 8) | ((b as u16 & 0x7F) << 7);
    half::f16::from_bits(bits).to_f32()
}

/// The scalar twin (and the kernel of CPUs without AVX2).
///
/// # Safety
/// The [`Fp8PanelFn`] contract.
pub unsafe fn panel_scalar(
    a: &[*const f32],
    k: usize,
    w: *const u8,
    scales: *const f32,
    out: *mut f32,
) {
    // SAFETY: the contract: k values per row, 32·k weight bytes, k/128 scales, 32 outputs per row.
    unsafe {
        for (r, &row) in a.iter().enumerate() {
            let x = std::slice::from_raw_parts(row, k);
            for j in 0..PANEL {
                let wj = std::slice::from_raw_parts(w.add(j * k), k);
                let mut acc = 0f32;
                for b in 0..k / BLOCK {
                    let mut sum = 0f32;
                    for i in b * BLOCK..(b + 1) * BLOCK {
                        sum += decode_scaled(wj[i]) * x[i];
                    }
                    acc += sum * *scales.add(b);
                }
                *out.add(r * PANEL + j) = acc;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{BLOCK, PANEL};
    use std::arch::x86_64::*;

    /// 16 E4M3 bytes at `p` as 16 floats (each `value / SCALE_FOLD`).
    ///
    /// # Safety
    /// AVX-512F and AVX2 available; 16 readable bytes at `p`.
    #[inline(always)]
    unsafe fn decode16(p: *const u8) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe {
            let v = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
            let sign = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8);
            let mag = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7F)), 7);
            _mm512_cvtph_ps(_mm256_or_si256(sign, mag))
        }
    }

    /// 8 E4M3 bytes at `p` as 8 floats (each `value / SCALE_FOLD`).
    ///
    /// # Safety
    /// AVX2 and F16C available; 8 readable bytes at `p`.
    #[inline(always)]
    unsafe fn decode8(p: *const u8) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe {
            let v = _mm_cvtepu8_epi16(_mm_loadl_epi64(p as *const __m128i));
            let sign = _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x80)), 8);
            let mag = _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x7F)), 7);
            _mm256_cvtph_ps(_mm_or_si128(sign, mag))
        }
    }

    /// 512-bit panel kernel for `R` rows: each weight vector is decoded once and multiplied
    /// with every row; per-block sums are scaled into the row's total.
    ///
    /// # Safety
    /// The [`super::Fp8PanelFn`] contract with `a.len() == R`; AVX-512F/BW, AVX2 available.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // register blocks read best as indexed loops
    unsafe fn panel512<const R: usize>(
        a: &[*const f32],
        k: usize,
        w: *const u8,
        scales: *const f32,
        out: *mut f32,
    ) {
        // SAFETY: the contract: reads stay inside row j's k bytes, the rows' k floats and the
        // k/128 scales; writes go to the R·32 outputs.
        unsafe {
            for j in 0..PANEL {
                let wj = w.add(j * k);
                let mut total = [_mm512_setzero_ps(); R];
                for b in 0..k / BLOCK {
                    let mut sum = [_mm512_setzero_ps(); R];
                    for c in 0..BLOCK / 16 {
                        let i = b * BLOCK + c * 16;
                        let wv = decode16(wj.add(i));
                        for r in 0..R {
                            sum[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(a[r].add(i)), sum[r]);
                        }
                    }
                    let s = _mm512_set1_ps(*scales.add(b));
                    for r in 0..R {
                        total[r] = _mm512_fmadd_ps(sum[r], s, total[r]);
                    }
                }
                for r in 0..R {
                    *out.add(r * PANEL + j) = _mm512_reduce_add_ps(total[r]);
                }
            }
        }
    }

    /// 256-bit panel kernel for `R` rows (as [`panel512`]).
    ///
    /// # Safety
    /// The [`super::Fp8PanelFn`] contract with `a.len() == R`; AVX2, FMA and F16C available.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)]
    unsafe fn panel256<const R: usize>(
        a: &[*const f32],
        k: usize,
        w: *const u8,
        scales: *const f32,
        out: *mut f32,
    ) {
        // SAFETY: as in `panel512`.
        unsafe {
            for j in 0..PANEL {
                let wj = w.add(j * k);
                let mut total = [_mm256_setzero_ps(); R];
                for b in 0..k / BLOCK {
                    let mut sum = [_mm256_setzero_ps(); R];
                    for c in 0..BLOCK / 8 {
                        let i = b * BLOCK + c * 8;
                        let wv = decode8(wj.add(i));
                        for r in 0..R {
                            sum[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(a[r].add(i)), sum[r]);
                        }
                    }
                    let s = _mm256_set1_ps(*scales.add(b));
                    for r in 0..R {
                        total[r] = _mm256_fmadd_ps(sum[r], s, total[r]);
                    }
                }
                for r in 0..R {
                    let t = total[r];
                    let h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
                    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
                    let h = _mm_add_ss(h, _mm_movehdup_ps(h));
                    *out.add(r * PANEL + j) = _mm_cvtss_f32(h);
                }
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn rows512<const R: usize>(
        a: &[*const f32],
        k: usize,
        w: *const u8,
        s: *const f32,
        o: *mut f32,
    ) {
        // SAFETY: forwarded; the features are enabled here.
        unsafe { panel512::<R>(a, k, w, s, o) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows256<const R: usize>(
        a: &[*const f32],
        k: usize,
        w: *const u8,
        s: *const f32,
        o: *mut f32,
    ) {
        // SAFETY: forwarded; the features are enabled here.
        unsafe { panel256::<R>(a, k, w, s, o) }
    }

    /// AVX-512 kernel, 1 to 8 rows.
    ///
    /// # Safety
    /// The [`super::Fp8PanelFn`] contract; AVX-512F/BW, AVX2, FMA, F16C available.
    pub unsafe fn panel_avx512(
        a: &[*const f32],
        k: usize,
        w: *const u8,
        s: *const f32,
        o: *mut f32,
    ) {
        // SAFETY: forwarded.
        unsafe {
            crate::kernels::dispatch_rows!(rows512, "fp8 avx512 panel", a, (a, k, w, s, o); 1 2 3 4 5 6 7 8)
        }
    }

    /// AVX2 kernel, 1 to 4 rows.
    ///
    /// # Safety
    /// The [`super::Fp8PanelFn`] contract; AVX2, FMA, F16C available.
    pub unsafe fn panel_avx2(a: &[*const f32], k: usize, w: *const u8, s: *const f32, o: *mut f32) {
        // SAFETY: forwarded.
        unsafe {
            crate::kernels::dispatch_rows!(rows256, "fp8 avx2 panel", a, (a, k, w, s, o); 1 2 3 4)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::e4m3_to_f32;

    #[test]
    fn the_shifted_half_decoding_is_the_value_over_256_for_every_finite_code() {
        for b in 0..=255u8 {
            if b & 0x7F == 0x7F {
                continue; // NaN codes: refused at load
            }
            assert_eq!(decode_scaled(b) * SCALE_FOLD, e4m3_to_f32(b), "code {b:#x}");
        }
    }

    /// Random panel data: every finite code, scales spread over decades.
    fn data(k: usize, rows: usize, seed: u64) -> (Vec<u8>, Vec<f32>, Vec<Vec<f32>>) {
        let mut rng = crate::rng::Rng::new(seed);
        let w: Vec<u8> = (0..PANEL * k)
            .map(|_| {
                let b = rng.below(256) as u8;
                if b & 0x7F == 0x7F {
                    b & 0xF0
                } else {
                    b
                }
            })
            .collect();
        let scales: Vec<f32> = (0..k / BLOCK)
            .map(|i| [1e-3f32, 0.5, 7.0][i % 3] * (1.0 + rng.uniform()))
            .collect();
        let a = (0..rows).map(|_| rng.normals(k, 1.0)).collect();
        (w, scales, a)
    }

    /// A float64 model of the panel from the exact decoded values.
    fn reference(w: &[u8], scales: &[f32], a: &[Vec<f32>], k: usize) -> Vec<f64> {
        let mut out = vec![0f64; a.len() * PANEL];
        for (r, x) in a.iter().enumerate() {
            for j in 0..PANEL {
                out[r * PANEL + j] = (0..k)
                    .map(|i| {
                        e4m3_to_f32(w[j * k + i]) as f64 / SCALE_FOLD as f64
                            * scales[i / BLOCK] as f64
                            * x[i] as f64
                    })
                    .sum();
            }
        }
        out
    }

    fn run(kernel: Fp8PanelFn, w: &[u8], scales: &[f32], a: &[Vec<f32>], k: usize) -> Vec<f32> {
        let ptrs: Vec<*const f32> = a.iter().map(|x| x.as_ptr()).collect();
        let mut out = vec![f32::NAN; a.len() * PANEL];
        // SAFETY: every buffer is sized as the contract asks; the caller checked the ISA.
        unsafe { kernel(&ptrs, k, w.as_ptr(), scales.as_ptr(), out.as_mut_ptr()) };
        out
    }

    fn check(kernel: &Fp8Kernel) {
        for (k, seed) in [(128usize, 1u64), (384, 2), (1024, 3)] {
            for rows in 1..=kernel.rows {
                let (w, scales, a) = data(k, rows, seed + rows as u64);
                let want = reference(&w, &scales, &a, k);
                let twin = run(panel_scalar, &w, &scales, &a, k);
                let got = run(kernel.dot, &w, &scales, &a, k);
                // Magnitude of the terms, for a tolerance relative to what was summed.
                let norm: f64 = want.iter().map(|v| v.abs()).sum::<f64>() / want.len() as f64;
                for i in 0..want.len() {
                    let (e_twin, e_got) = (
                        (twin[i] as f64 - want[i]).abs(),
                        (got[i] as f64 - twin[i] as f64).abs(),
                    );
                    assert!(
                        e_twin <= 1e-4 * norm,
                        "scalar k={k} rows={rows} [{i}]: {} vs {}",
                        twin[i],
                        want[i]
                    );
                    assert!(
                        e_got <= 1e-4 * norm,
                        "{} k={k} rows={rows} [{i}]: {} vs twin {}",
                        kernel.name,
                        got[i],
                        twin[i]
                    );
                }
            }
        }
    }

    #[test]
    fn every_variant_matches_the_scalar_twin_and_a_float64_model() {
        check(&kernel_for(Level::Generic));
        if crate::isa::allows(Level::Avx2) {
            let k = kernel_for(Level::Avx2);
            assert_eq!(k.name, "avx2");
            check(&k);
        }
        if crate::isa::allows(Level::Avx512Base) {
            let k = kernel_for(Level::Avx512Base);
            assert_eq!(k.name, "avx512");
            check(&k);
        }
    }
}
