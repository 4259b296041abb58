//! AVX512-BF16 kernels: `vdpbf16ps` on (activation pair, weight pair). Activations arrive
//! already rounded to bf16 pairs (staged once per forward by [`stage_bf16`]).
use std::arch::x86_64::*;

/// Token rows per call: 12 rows × 2 accumulators.
pub const ROWS: usize = 12;

/// bf16 panel kernel on staged activations (see [`super::PanelDotBf16Fn`]).
///
/// # Safety
/// AVX512-BF16 (and F/BW) available; the [`super::PanelDotBf16Fn`] contract.
pub unsafe fn panel_dot_bf16(a_rows: &[*const u32], k: usize, panel: *const u16, out: *mut f32) {
    // SAFETY: forwarded; each arm passes exactly R pointers.
    unsafe {
        super::dispatch_rows!(dot_rows, "avx512_bf16 panel kernel", a_rows, (a_rows, k, panel, out); 1 2 3 4 5 6 7 8 9 10 11 12)
    }
}

/// `R` rows against one panel with `vdpbf16ps`.
///
/// # Safety
/// The CPU has AVX512-BF16; `a_rows` holds exactly `R` pointers; the rest is the
/// [`super::PanelDotBf16Fn`] contract.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn dot_rows<const R: usize>(
    a_rows: &[*const u32],
    k: usize,
    panel: *const u16,
    out: *mut f32,
) {
    let mut a = [std::ptr::null::<u32>(); R];
    a.copy_from_slice(&a_rows[..R]);
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    let pf = super::prefetch::for_panel_rows(R);
    let (side, side_bytes) = if R >= 4 {
        super::prefetch::take_side_stream()
    } else {
        (std::ptr::null(), 0)
    };
    for q in 0..k / 2 {
        if q * 64 < side_bytes {
            super::prefetch::line_into_l2(side.wrapping_add(q * 64));
        }
        // SAFETY: panel offset within 32*k; pair q < k/2 of every row.
        unsafe {
            let p = panel.add(q * 64);
            super::prefetch::ahead(p as *const u8, pf);
            super::prefetch::ahead(p.add(32) as *const u8, pf);
            let w0: __m512bh = std::mem::transmute(_mm512_loadu_si512(p as *const __m512i));
            let w1: __m512bh = std::mem::transmute(_mm512_loadu_si512(p.add(32) as *const __m512i));
            for r in 0..R {
                let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a[r].add(q) as i32));
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, w1);
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

/// Round an fp32 row to bf16 pairs (`dst[i]` = elements 2i | 2i+1 << 16), nearest even.
///
/// # Safety
/// AVX512-BF16 available; `src.len() == 2 * dst.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub unsafe fn stage_bf16(src: &[f32], dst: &mut [u32]) {
    let n = src.len();
    let mut i = 0;
    while i + 32 <= n {
        // SAFETY: i+32 ≤ n elements of src, (i+32)/2 ≤ dst.len().
        unsafe {
            let lo = _mm512_loadu_ps(src.as_ptr().add(i));
            let hi = _mm512_loadu_ps(src.as_ptr().add(i + 16));
            // cvtne2ps: the second operand fills the lower half.
            let pairs: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(dst.as_mut_ptr().add(i / 2) as *mut __m512i, pairs);
        }
        i += 32;
    }
    super::scalar::stage_bf16_tail(&src[i..], &mut dst[i / 2..]);
}
