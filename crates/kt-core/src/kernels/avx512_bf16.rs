//! AVX512-BF16 kernel: `vdpbf16ps` on (activation pair, weight pair). Activations are rounded to
//! bf16 once per call into a small stack buffer per row block.
use std::arch::x86_64::*;

/// Token rows per call.
pub const ROWS: usize = 12;

/// Longest k handled per activation-staging chunk (keeps the staging buffer on the stack).
const K_CHUNK: usize = 512;

/// bf16 dot-product panel kernel (see [`super::PanelDotFn`]).
///
/// # Safety
/// AVX512-BF16 (and F/BW) available; the [`super::PanelDotFn`] contract.
pub unsafe fn panel_dot_bf16(a_rows: &[*const f32], k: usize, panel: *const u16, out: *mut f32) {
    // SAFETY: forwarded; each arm passes exactly R pointers.
    unsafe {
        match a_rows.len() {
            1 => dot_rows::<1>(a_rows, k, panel, out),
            2 => dot_rows::<2>(a_rows, k, panel, out),
            3 => dot_rows::<3>(a_rows, k, panel, out),
            4 => dot_rows::<4>(a_rows, k, panel, out),
            5 => dot_rows::<5>(a_rows, k, panel, out),
            6 => dot_rows::<6>(a_rows, k, panel, out),
            7 => dot_rows::<7>(a_rows, k, panel, out),
            8 => dot_rows::<8>(a_rows, k, panel, out),
            9 => dot_rows::<9>(a_rows, k, panel, out),
            10 => dot_rows::<10>(a_rows, k, panel, out),
            11 => dot_rows::<11>(a_rows, k, panel, out),
            12 => dot_rows::<12>(a_rows, k, panel, out),
            n => panic!("avx512_bf16 panel kernel takes 1..={ROWS} rows, got {n}"),
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn dot_rows<const R: usize>(
    a_rows: &[*const f32],
    k: usize,
    panel: *const u16,
    out: *mut f32,
) {
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    // Activation pairs as bf16, one u32 (= two bf16) per input pair.
    let mut staged = [[0u32; K_CHUNK / 2]; R];
    let mut k0 = 0;
    while k0 < k {
        let kc = K_CHUNK.min(k - k0);
        for r in 0..R {
            let mut i = 0;
            while i < kc {
                // SAFETY: k0+i+16 ≤ k0+kc ≤ k when a full vector remains; the tail is scalar.
                unsafe {
                    if i + 32 <= kc {
                        let lo = _mm512_loadu_ps(a_rows[r].add(k0 + i));
                        let hi = _mm512_loadu_ps(a_rows[r].add(k0 + i + 16));
                        // cvtne2ps: upper half from the first operand, lower from the second.
                        let pairs = _mm512_cvtne2ps_pbh(hi, lo);
                        _mm512_storeu_si512(
                            staged[r].as_mut_ptr().add(i / 2) as *mut __m512i,
                            std::mem::transmute::<__m512bh, __m512i>(pairs),
                        );
                        i += 32;
                    } else {
                        let x0 = crate::dtype::f32_to_bf16_bits(*a_rows[r].add(k0 + i)) as u32;
                        let x1 = crate::dtype::f32_to_bf16_bits(*a_rows[r].add(k0 + i + 1)) as u32;
                        staged[r][i / 2] = x0 | (x1 << 16);
                        i += 2;
                    }
                }
            }
        }
        for q in 0..kc / 2 {
            // SAFETY: panel offset within 32*k.
            unsafe {
                let p = panel.add((k0 / 2 + q) * 64);
                _mm_prefetch::<_MM_HINT_T0>(p.add(512) as *const i8);
                let w0: __m512bh = std::mem::transmute(_mm512_loadu_si512(p as *const __m512i));
                let w1: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(p.add(32) as *const __m512i));
                for r in 0..R {
                    let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(staged[r][q] as i32));
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, w0);
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, w1);
                }
            }
        }
        k0 += kc;
    }
    for (r, row) in acc.iter().enumerate() {
        // SAFETY: out holds 32 floats per row.
        unsafe {
            _mm512_storeu_ps(out.add(r * 32), row[0]);
            _mm512_storeu_ps(out.add(r * 32 + 16), row[1]);
        }
    }
}
