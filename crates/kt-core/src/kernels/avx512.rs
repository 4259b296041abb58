//! AVX-512F kernels: bf16 weights widened to fp32 in registers, fp32 FMA.
use std::arch::x86_64::*;

/// Token rows per call: 12 rows × 2 accumulators = 24 of the 32 zmm registers.
pub const ROWS: usize = 8;

/// fp32-FMA panel dot product (see [`super::PanelDotFn`]).
///
/// # Safety
/// AVX-512F available; the [`super::PanelDotFn`] contract.
pub unsafe fn panel_dot_fma(a_rows: &[*const f32], k: usize, panel: *const u16, out: *mut f32) {
    // SAFETY: forwarded; each arm passes exactly R pointers.
    unsafe {
        super::dispatch_rows!(dot_rows, "avx512 panel_dot_fma", a_rows, (a_rows, k, panel, out); 1 2 3 4 5 6 7 8)
    }
}

/// `R` rows against one panel, 16 outputs per register.
///
/// # Safety
/// The CPU has AVX-512F; `a_rows` holds exactly `R` pointers; the rest is the
/// [`super::PanelDotFn`] contract.
#[target_feature(enable = "avx512f")]
#[allow(clippy::needless_range_loop)] // register blocks read best as indexed loops
unsafe fn dot_rows<const R: usize>(
    a_rows: &[*const f32],
    k: usize,
    panel: *const u16,
    out: *mut f32,
) {
    let mut a = [std::ptr::null::<f32>(); R];
    a.copy_from_slice(&a_rows[..R]);
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    let hi_mask = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    let pf = super::prefetch::for_panel_rows(R);
    for q in 0..k / 2 {
        // SAFETY: q*64+64 ≤ 32*k elements of the panel; 2q+1 < k for each row.
        unsafe {
            let p = panel.add(q * 64);
            super::prefetch::ahead(p as *const u8, pf);
            super::prefetch::ahead(p.add(32) as *const u8, pf);
            for h in 0..2 {
                let w = _mm512_loadu_si512(p.add(h * 32) as *const __m512i);
                let w_even = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w));
                let w_odd = _mm512_castsi512_ps(_mm512_and_si512(w, hi_mask));
                for r in 0..R {
                    let x0 = _mm512_set1_ps(*a[r].add(2 * q));
                    let x1 = _mm512_set1_ps(*a[r].add(2 * q + 1));
                    acc[r][h] = _mm512_fmadd_ps(x0, w_even, acc[r][h]);
                    acc[r][h] = _mm512_fmadd_ps(x1, w_odd, acc[r][h]);
                }
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        // SAFETY: out holds 32 floats per row.
        unsafe {
            _mm512_storeu_ps(out.add(r * 32), row[0]);
            _mm512_storeu_ps(out.add(r * 32 + 16), row[1]);
        }
    }
}

/// SwiGLU, auto-vectorised for AVX-512.
///
/// # Safety
/// AVX-512F available; equal lengths.
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")]
pub unsafe fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32], limit: f32, alpha: f32) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = super::swiglu_one(g, u, limit, alpha);
    }
}
