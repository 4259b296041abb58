//! AVX2 kernels on the x8 layout ([`super::x8`]): one 8-lane vector per token holds the eight
//! rows' results. Equal to the scalar twin bit for bit (exact integer sums, the twin's f32
//! operations lane by lane).
use super::blocks::Q8_K_BYTES;
use super::x8::{GROUP, Q4_K_X8_BYTES};
use std::arch::x86_64::*;

/// Token rows per call.
pub(super) const ROWS: usize = super::X8_ROWS;

/// The x8 kernel for `ty`, if it has one.
pub(super) fn x8_fn(ty: super::GgmlType) -> Option<super::RawX8Fn> {
    match ty {
        super::GgmlType::Q4_K => Some(q4_k),
        _ => None,
    }
}

/// Q4_K x8 against up to [`ROWS`] Q8_K rows: `out[i · stride + r]` for the group's rows r.
///
/// # Safety
/// AVX2, FMA and F16C available; `group` holds `k/256` x8 super-blocks, each `acts[i]` a
/// Q8_K row of `k` values, `1 ≤ acts.len() ≤ ROWS`, `out` holds `(acts.len() − 1) · stride + 8`.
pub(super) unsafe fn q4_k(k: usize, group: &[u8], acts: &[&[u8]], out: &mut [f32], stride: usize) {
    // SAFETY: forwarded.
    unsafe {
        match acts.len() {
            1 => q4_k_rows::<1>(k, group, acts, out, stride),
            2 => q4_k_rows::<2>(k, group, acts, out, stride),
            3 => q4_k_rows::<3>(k, group, acts, out, stride),
            4 => q4_k_rows::<4>(k, group, acts, out, stride),
            n => panic!("x8 kernels take 1..={ROWS} token rows, got {n}"),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // register blocks read best as indexed loops
unsafe fn q4_k_rows<const R: usize>(
    k: usize,
    group: &[u8],
    acts: &[&[u8]],
    out: &mut [f32],
    stride: usize,
) {
    let blocks = k / 256;
    assert!(group.len() >= blocks * Q4_K_X8_BYTES);
    let mut a = [std::ptr::null::<u8>(); R];
    for (p, row) in a.iter_mut().zip(acts) {
        assert!(row.len() >= blocks * Q8_K_BYTES);
        *p = row.as_ptr();
    }
    assert!(out.len() >= (R - 1) * stride + GROUP);
    let low4 = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    let pf = crate::kernels::prefetch::distance();
    // SAFETY (all loads): offsets inside the checked group and activation blocks.
    unsafe {
        for sb in 0..blocks {
            let g = group.as_ptr().add(sb * Q4_K_X8_BYTES);
            // The super-block's header lines (scales and minima), then one line per two steps.
            crate::kernels::prefetch::ahead(g, pf);
            crate::kernels::prefetch::ahead(g.add(64), pf);
            crate::kernels::prefetch::ahead(g.add(128), pf);
            let mut sumi = [_mm256_setzero_si256(); R];
            for j in 0..8 {
                // The rows' scales as (s, s) 16-bit pairs, one pair per 32-bit lane.
                let s32 =
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(g.add(32 + 8 * j) as *const __m128i));
                let scales = _mm256_or_si256(s32, _mm256_slli_epi32::<16>(s32));
                let mut acc16 = [_mm256_setzero_si256(); R];
                for p in 0..4 {
                    let at = g.add(160 + (j * 4 + p) * 32);
                    if p % 2 == 0 {
                        crate::kernels::prefetch::ahead(at.add(32), pf);
                    }
                    let x = _mm256_loadu_si256(at as *const __m256i);
                    let lo = _mm256_and_si256(x, low4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(x), low4);
                    for r in 0..R {
                        let q = a[r].add(sb * Q8_K_BYTES + 4 + 32 * j + 8 * p);
                        let a0 = _mm256_set1_epi32((q as *const i32).read_unaligned());
                        let a1 = _mm256_set1_epi32((q.add(4) as *const i32).read_unaligned());
                        // |pair| ≤ 2·15·127: eight of them still fit an i16 lane.
                        acc16[r] = _mm256_add_epi16(acc16[r], _mm256_maddubs_epi16(lo, a0));
                        acc16[r] = _mm256_add_epi16(acc16[r], _mm256_maddubs_epi16(hi, a1));
                    }
                }
                for r in 0..R {
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(acc16[r], scales));
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(g as *const __m128i));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(g.add(16) as *const __m128i));
            let min_pairs = |q: usize| {
                _mm256_cvtepu8_epi16(_mm_loadu_si128(g.add(96 + 16 * q) as *const __m128i))
            };
            let mins = [min_pairs(0), min_pairs(1), min_pairs(2), min_pairs(3)];
            for r in 0..R {
                let ab = a[r].add(sb * Q8_K_BYTES);
                // Σ per 32 values (pairs of the 16-value bsums), as eight i16 (|·| ≤ 32·127).
                let b32 =
                    _mm256_madd_epi16(_mm256_loadu_si256(ab.add(260) as *const __m256i), ones);
                let b16 = _mm_packs_epi32(
                    _mm256_castsi256_si128(b32),
                    _mm256_extracti128_si256::<1>(b32),
                );
                // Pair q of the 32-value sums in every lane, times the rows' minima pairs.
                let pairs = [
                    _mm256_broadcastd_epi32(b16),
                    _mm256_broadcastd_epi32(_mm_shuffle_epi32::<0x55>(b16)),
                    _mm256_broadcastd_epi32(_mm_shuffle_epi32::<0xAA>(b16)),
                    _mm256_broadcastd_epi32(_mm_shuffle_epi32::<0xFF>(b16)),
                ];
                let mut summs = _mm256_madd_epi16(mins[0], pairs[0]);
                for q in 1..4 {
                    summs = _mm256_add_epi32(summs, _mm256_madd_epi16(mins[q], pairs[q]));
                }
                let da = _mm256_set1_ps((ab as *const f32).read_unaligned());
                let term = _mm256_sub_ps(
                    _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(sumi[r])),
                    _mm256_mul_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(summs)),
                );
                acc[r] = _mm256_add_ps(acc[r], term);
            }
        }
        for r in 0..R {
            _mm256_storeu_ps(out.as_mut_ptr().add(r * stride), acc[r]);
        }
    }
}
