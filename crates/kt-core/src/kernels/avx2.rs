//! AVX2 + FMA kernels: bf16 weights widened to fp32 in registers, fp32 FMA.
use std::arch::x86_64::*;

/// Token rows per call (16 ymm registers: 8 accumulators, 4 weight vectors, a broadcast).
pub const ROWS: usize = 4;

/// fp32-FMA panel dot product (see [`super::PanelDotFn`]).
///
/// # Safety
/// AVX2 and FMA available; the [`super::PanelDotFn`] contract.
pub unsafe fn panel_dot_fma(a_rows: &[*const f32], k: usize, panel: *const u16, out: *mut f32) {
    // SAFETY: forwarded; each arm passes exactly R pointers.
    unsafe {
        if a_rows.len() == 1 {
            return dot_one_row(a_rows[0], k, panel, out);
        }
        super::dispatch_rows!(dot_rows, "avx2 panel_dot_fma", a_rows, (a_rows, k, panel, out); 2 3 4)
    }
}

/// One row (decode): both halves of the panel in one pass. Each accumulator takes two
/// dependent FMAs per input pair, so with only the two of one half in flight the loop waits
/// on FMA latency (8 cycles per 64 bytes); four chains halve that. Every lane still adds its
/// products in the twin's order.
///
/// # Safety
/// The CPU has AVX2 and FMA; `a` points to `k` readable f32; the rest is the
/// [`super::PanelDotFn`] contract.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_one_row(a: *const f32, k: usize, panel: *const u16, out: *mut f32) {
    let hi_mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    let pf = super::prefetch::distance();
    let mut acc = [_mm256_setzero_ps(); 4];
    for q in 0..k / 2 {
        // SAFETY: within the panel and the row by the contract.
        unsafe {
            let p = panel.add(q * 64);
            super::prefetch::ahead(p as *const u8, pf);
            super::prefetch::ahead(p.add(32) as *const u8, pf);
            let x0 = _mm256_broadcast_ss(&*a.add(2 * q));
            let x1 = _mm256_broadcast_ss(&*a.add(2 * q + 1));
            for (c, acc) in acc.iter_mut().enumerate() {
                let w = _mm256_loadu_si256(p.add(c * 16) as *const __m256i);
                let w_even = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w));
                let w_odd = _mm256_castsi256_ps(_mm256_and_si256(w, hi_mask));
                *acc = _mm256_fmadd_ps(x0, w_even, *acc);
                *acc = _mm256_fmadd_ps(x1, w_odd, *acc);
            }
        }
    }
    for (c, v) in acc.iter().enumerate() {
        // SAFETY: out holds 32 floats.
        unsafe { _mm256_storeu_ps(out.add(c * 8), *v) };
    }
}

/// One half (16 outputs) of the panel per pass keeps the accumulators in registers.
///
/// # Safety
/// The CPU has AVX2 and FMA; `a_rows` holds exactly `R` pointers; the rest is the
/// [`super::PanelDotFn`] contract.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)] // register blocks read best as indexed loops
unsafe fn dot_rows<const R: usize>(
    a_rows: &[*const f32],
    k: usize,
    panel: *const u16,
    out: *mut f32,
) {
    let mut a = [std::ptr::null::<f32>(); R];
    a.copy_from_slice(&a_rows[..R]);
    let hi_mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    // The first pass prefetches both lines of each input pair; the second finds them cached.
    let pf = super::prefetch::distance();
    for h in 0..2 {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let pf = if h == 0 { pf } else { 0 };
        for q in 0..k / 2 {
            // SAFETY: within the panel and rows by the contract.
            unsafe {
                let p = panel.add(q * 64 + h * 32);
                super::prefetch::ahead(p as *const u8, pf);
                super::prefetch::ahead(p.add(32) as *const u8, pf);
                for g in 0..2 {
                    let w = _mm256_loadu_si256(p.add(g * 16) as *const __m256i);
                    let w_even = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w));
                    let w_odd = _mm256_castsi256_ps(_mm256_and_si256(w, hi_mask));
                    for r in 0..R {
                        let x0 = _mm256_broadcast_ss(&*a[r].add(2 * q));
                        let x1 = _mm256_broadcast_ss(&*a[r].add(2 * q + 1));
                        acc[r][g] = _mm256_fmadd_ps(x0, w_even, acc[r][g]);
                        acc[r][g] = _mm256_fmadd_ps(x1, w_odd, acc[r][g]);
                    }
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            // SAFETY: out holds 32 floats per row.
            unsafe {
                _mm256_storeu_ps(out.add(r * 32 + h * 16), row[0]);
                _mm256_storeu_ps(out.add(r * 32 + h * 16 + 8), row[1]);
            }
        }
    }
}

/// SwiGLU, auto-vectorised for AVX2.
///
/// # Safety
/// AVX2 and FMA available; equal lengths.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32], limit: f32, alpha: f32) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = super::swiglu_one(g, u, limit, alpha);
    }
}
