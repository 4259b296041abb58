//! AVX2 kernels for one weight row against up to [`super::DOT_MANY_ROWS`] activation rows at once (prefill) for
//! types without an x8 layout (Q5_K): a super-block's weights are decoded once and multiplied
//! with every row, instead of once per row. Each row's result equals the single-row scalar twin bit for bit: the integer sums are
//! exact in any order, and the f32 terms are the twin's operations, one row per lane, added in
//! super-block order.
use super::blocks::*;
use super::x86_avx2::{f16_pair_at, k4_min_lanes, load32, scaled_mul_sum_u8};
use super::{GgmlType, RawRowsFn};
use std::arch::x86_64::*;

/// The multi-row AVX2 kernel for `ty`, if there is one.
pub(super) fn rows_fn(ty: GgmlType) -> Option<RawRowsFn> {
    Some(match ty {
        GgmlType::Q5_K => q5_k_rows,
        _ => return None,
    })
}

/// Q5_K × Q8_K rows.
///
/// # Safety
/// AVX2, FMA and F16C available; the `RawRowsFn` size contract.
unsafe fn q5_k_rows(_k: usize, w: &[u8], a: &[&[u8]], out: &mut [f32]) {
    // SAFETY: forwarded.
    unsafe {
        crate::kernels::dispatch_rows!(k_affine_rows, "Q5_K rows", a, (w, a, out, true); 1 2 3 4)
    }
}

/// Store lanes `0..R` of `acc` to `out`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn store_lanes<const R: usize>(acc: __m128, out: &mut [f32]) {
    let mut lanes = [0f32; 4];
    // SAFETY: four lanes into a four-element array.
    unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), acc) };
    out[..R].copy_from_slice(&lanes[..R]);
}

/// The lane sums of four vectors as the four lanes of one (row r's sum in lane r).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum4(v: [__m256i; 4]) -> __m128i {
    let q = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    _mm_add_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q))
}

/// Lane r of the result is row r's term `(d · d_a) · sumi − (dmin · d_a) · summs` (the twin's
/// `k_min_term`), from lane vectors.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn min_terms4(d: f32, dmin: f32, da: __m128, sumi: __m128i, summs: __m128i) -> __m128 {
    _mm_sub_ps(
        _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(d), da), _mm_cvtepi32_ps(sumi)),
        _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(dmin), da), _mm_cvtepi32_ps(summs)),
    )
}

/// `d_a` of the Q8_K blocks of rows `0..R` (lanes beyond R are 0). Plain SSE and
/// `inline(always)`: a call here would clear the callers' vector registers.
#[inline(always)]
fn scales4<const R: usize>(ab: &[&[u8]; R]) -> __m128 {
    let mut lanes = [0f32; 4];
    for (l, a) in lanes.iter_mut().zip(ab) {
        *l = f32_at(a, 0);
    }
    // SAFETY: SSE is part of x86-64; four lanes from a four-element array.
    unsafe { _mm_loadu_ps(lanes.as_ptr()) }
}

/// The start of every activation row, after checking that each holds `blocks` Q8_K blocks.
#[inline(always)]
fn row_starts<const R: usize>(a: &[&[u8]], blocks: usize) -> [*const u8; R] {
    let mut p = [std::ptr::null(); R];
    for (p, row) in p.iter_mut().zip(a) {
        assert!(row.len() >= blocks * Q8_K_BYTES, "activation row too short");
        *p = row.as_ptr();
    }
    p
}

/// Q5_K super-blocks (Q4_K with `five_bits` false) of one weight row against R rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // register blocks read best as indexed loops
fn k_affine_rows<const R: usize>(w: &[u8], a: &[&[u8]], out: &mut [f32], five_bits: bool) {
    let width = if five_bits { Q5_K_BYTES } else { Q4_K_BYTES };
    let qs_at = if five_bits { 48 } else { 16 };
    let blocks = w.len() / width;
    let rows = row_starts::<R>(a, blocks);
    let low4 = _mm256_set1_epi8(0x0F);
    let (bit0, bit1) = (_mm256_set1_epi8(1), _mm256_set1_epi8(2));
    let mut acc = _mm_setzero_ps();
    for (sb, wb) in w.chunks_exact(width).enumerate() {
        // SAFETY (every activation access below): row_starts checked `blocks` blocks per row.
        let ab: [&[u8]; R] = {
            let mut ab = [&[][..]; R];
            for r in 0..R {
                // SAFETY: each activation row holds the k/256 Q8_K blocks the caller checked.
                ab[r] =
                    unsafe { std::slice::from_raw_parts(rows[r].add(sb * Q8_K_BYTES), Q8_K_BYTES) };
            }
            ab
        };
        let (sc, mn) = unpack_k4_scales_u64(&wb[4..16]);
        // The eight sub-block scales as 16-bit words in both lanes.
        let scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
        let mut high = if five_bits {
            load32(&wb[16..])
        } else {
            _mm256_setzero_si256()
        };
        let mut sums = [_mm256_setzero_si256(); 4];
        for c in 0..4 {
            let x = load32(&wb[qs_at + 32 * c..]);
            let mut lo = _mm256_and_si256(x, low4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(x), low4);
            if five_bits {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(high, bit0)));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16::<3>(_mm256_and_si256(high, bit1)));
                high = _mm256_srli_epi16::<2>(high);
            }
            // vpshufb with a mask selecting 16-bit word j: scale j in every word.
            let word = |j: usize| _mm256_set1_epi16((((2 * j + 1) << 8) | (2 * j)) as i16);
            let s_lo = _mm256_shuffle_epi8(scales, word(2 * c));
            let s_hi = _mm256_shuffle_epi8(scales, word(2 * c + 1));
            for r in 0..R {
                // SAFETY: bytes 4 + 64c .. 4 + 64c + 64 of the row's block (see above).
                let (x_lo, x_hi) = unsafe {
                    let p = rows[r].add(sb * Q8_K_BYTES + 4 + 64 * c);
                    (
                        _mm256_loadu_si256(p as *const __m256i),
                        _mm256_loadu_si256(p.add(32) as *const __m256i),
                    )
                };
                sums[r] = _mm256_add_epi32(sums[r], scaled_mul_sum_u8(lo, x_lo, s_lo));
                sums[r] = _mm256_add_epi32(sums[r], scaled_mul_sum_u8(hi, x_hi, s_hi));
            }
        }
        let mut mins = [_mm256_setzero_si256(); 4];
        for r in 0..R {
            mins[r] = k4_min_lanes(mn, ab[r]);
        }
        let (d, dmin) = f16_pair_at(wb, 0);
        let terms = min_terms4(d, dmin, scales4(&ab), hsum4(sums), hsum4(mins));
        acc = _mm_add_ps(acc, terms);
    }
    store_lanes::<R>(acc, out);
}
