//! AVX2 dot kernels (with FMA and F16C: the `avx2` level). Each equals its scalar twin in
//! `dot.rs` bit for bit: the block integer sums are exact in any order, and the f32 terms are
//! formed the same way and added in the same order.
//!
//! Signed × signed int8 products use `maddubs` on |w| and a·sign(w); that is exact because
//! quantized activations lie in [−127, 127] and |w| ≤ 128, so no pair of products saturates
//! int16 (2 · 128 · 127 < 32768).
use super::blocks::*;
use super::dot::{k_min_term, k_term};
use super::{GgmlType, RawDotFn};
use std::arch::x86_64::*;

/// The AVX2 kernel for `ty`, if there is one.
pub(super) fn dot_fn(ty: GgmlType) -> Option<RawDotFn> {
    Some(match ty {
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q8_0 => q8_0,
        GgmlType::IQ4_NL => iq4_nl,
        GgmlType::Q4_K => q4_k,
        GgmlType::Q5_K => q5_k,
        GgmlType::Q6_K => q6_k,
        GgmlType::IQ4_XS => iq4_xs,
        _ => return None,
    })
}

/// The first 32 bytes of `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn load32(b: &[u8]) -> __m256i {
    let b: &[u8; 32] = b.first_chunk().expect("a SIMD load needs 32 bytes");
    // SAFETY: `b` is 32 readable bytes; the load is unaligned.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

/// The first 16 bytes of `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn load16(b: &[u8]) -> __m128i {
    let b: &[u8; 16] = b.first_chunk().expect("a SIMD load needs 16 bytes");
    // SAFETY: `b` is 16 readable bytes; the load is unaligned.
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

/// The 32 values of 16 nibble bytes in value order: low nibbles, then high nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn nibbles(qs: &[u8]) -> __m256i {
    let x = load16(qs);
    let mask = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(x, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(x), mask);
    _mm256_set_m128i(hi, lo)
}

/// 0x10 in byte j where bit j of `qh` is set (the fifth bits of a Q5_0 block).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn fifth_bits(qh: u32) -> __m256i {
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(qh as i32),
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// The IQ4 table in one 128-bit register (for byte shuffles).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn iq4_table() -> __m128i {
    let t = IQ4_TABLE;
    _mm_setr_epi8(
        t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], t[10], t[11], t[12], t[13],
        t[14], t[15],
    )
}

/// Eight int32 partial sums of 32 signed × signed int8 products.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn mul_sum_i8(w: __m256i, a: __m256i) -> __m256i {
    let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
    _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
}

/// Eight int32 partial sums of `scale · q · a` for unsigned `q` ≤ 63 (pairs stay < 2^15).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn scaled_mul_sum_u8(q: __m256i, a: __m256i, scales: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), scales)
}

/// Sum of the eight int32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// The lane sums of four vectors, as the four lanes of one.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum4(v: [__m256i; 4]) -> __m128i {
    let ab = _mm256_hadd_epi32(v[0], v[1]);
    let cd = _mm256_hadd_epi32(v[2], v[3]);
    let abcd = _mm256_hadd_epi32(ab, cd);
    _mm_add_epi32(
        _mm256_castsi256_si128(abcd),
        _mm256_extracti128_si256::<1>(abcd),
    )
}

/// The lane sums of two vectors.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum2(a: __m256i, b: __m256i) -> (i32, i32) {
    let ab = _mm256_hadd_epi32(a, b); // a01 a23 b01 b23 | a45 a67 b45 b67
    let s = _mm_add_epi32(
        _mm256_castsi256_si128(ab),
        _mm256_extracti128_si256::<1>(ab),
    );
    let s = _mm_hadd_epi32(s, s); // a b a b
    (_mm_cvtsi128_si32(s), _mm_extract_epi32::<1>(s))
}

/// The two fp16 values at `b[at..at + 4]` (exact, like `f16_at`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn f16_pair_at(b: &[u8], at: usize) -> (f32, f32) {
    let bits = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

/// The fp16 value at `b[at..at + 2]` (exact, like `f16_at`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn f16_one_at(b: &[u8], at: usize) -> f32 {
    let bits = u16::from_le_bytes([b[at], b[at + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// Eight int32 lanes summing to `Σ_j min_j · (bsums[2j] + bsums[2j+1])` (`k4_min_sum`), for
/// the minima as the bytes of a u64 and the bsums of Q8_K block `ab`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn k4_min_lanes(mins: u64, ab: &[u8]) -> __m256i {
    let m = _mm_cvtsi64_si128(mins as i64);
    let pairs = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m)); // m0 m0 m1 m1 … m7 m7
    _mm256_madd_epi16(load32(&ab[260..]), pairs)
}

/// Eight int32 lanes summing to `q6_k_offset`: 32 · Σ_j scale_j · bsums[j].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q6_k_offset_lanes(scales: &[u8], ab: &[u8]) -> __m256i {
    let s16 = _mm256_cvtepi8_epi16(load16(scales));
    _mm256_slli_epi32::<5>(_mm256_madd_epi16(load32(&ab[260..]), s16))
}

/// `legacy_term` for four blocks at once (same f32 operations, lane by lane), in block order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn legacy_terms4(dw: [u16; 4], da: [u16; 4], isums: __m128i) -> [f32; 4] {
    let halves = |h: [u16; 4]| {
        _mm_cvtph_ps(_mm_set_epi16(
            0,
            0,
            0,
            0,
            h[3] as i16,
            h[2] as i16,
            h[1] as i16,
            h[0] as i16,
        ))
    };
    let terms = _mm_mul_ps(_mm_mul_ps(halves(dw), halves(da)), _mm_cvtepi32_ps(isums));
    let mut out = [0.0f32; 4];
    // SAFETY: `out` is 4 writable f32; the store is unaligned.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), terms) };
    out
}

#[inline(always)]
pub(super) fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// A dot kernel over 32-value weight blocks with the fp16 scale at byte 0 and Q8_0 activations:
/// `$decode` turns a weight block into 32 signed int8 values, `$mul_sum` multiplies them with
/// 32 activations into 8 int32 lanes. Four blocks share one reduction and one f16 conversion;
/// their terms are still added one by one in block order, as in the twin.
macro_rules! symmetric_kernel {
    ($(#[$doc:meta])* $name:ident, $features:literal, $width:expr, $decode:path, $mul_sum:path) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// The CPU has the features enabled here; the `RawDotFn` size contract.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $name(_k: usize, w: &[u8], a: &[u8]) -> f32 {
            use $crate::ggml::blocks::Q8_0_BYTES;
            use $crate::ggml::x86_avx2::{hsum4, hsum_i32, legacy_terms4, load32, u16_at};
            use std::arch::x86_64::*;
            let mut acc = 0.0f32;
            let w4 = w.chunks_exact(4 * $width);
            let a4 = a.chunks_exact(4 * Q8_0_BYTES);
            let (w_rest, a_rest) = (w4.remainder(), a4.remainder());
            for (wq, aq) in w4.zip(a4) {
                let mut sums = [_mm256_setzero_si256(); 4];
                let (mut dw, mut da) = ([0u16; 4], [0u16; 4]);
                for i in 0..4 {
                    let (wb, ab) = (&wq[i * $width..], &aq[i * Q8_0_BYTES..]);
                    sums[i] = $mul_sum($decode(wb), load32(&ab[2..]));
                    dw[i] = u16_at(wb, 0);
                    da[i] = u16_at(ab, 0);
                }
                for t in legacy_terms4(dw, da, hsum4(sums)) {
                    acc += t;
                }
            }
            for (wb, ab) in w_rest.chunks_exact($width).zip(a_rest.chunks_exact(Q8_0_BYTES)) {
                let isum = hsum_i32($mul_sum($decode(wb), load32(&ab[2..])));
                acc += $crate::ggml::dot::legacy_term(
                    $crate::ggml::blocks::f16_at(wb, 0),
                    $crate::ggml::blocks::f16_at(ab, 0),
                    isum,
                );
            }
            acc
        }
    };
}
pub(super) use symmetric_kernel;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn decode_q8_0(b: &[u8]) -> __m256i {
    load32(&b[2..])
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn decode_q4_0(b: &[u8]) -> __m256i {
    _mm256_sub_epi8(nibbles(&b[2..]), _mm256_set1_epi8(8))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn decode_q5_0(b: &[u8]) -> __m256i {
    let q = _mm256_or_si256(
        nibbles(&b[6..]),
        fifth_bits(u32::from_le_bytes([b[2], b[3], b[4], b[5]])),
    );
    _mm256_sub_epi8(q, _mm256_set1_epi8(16))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn decode_iq4_nl(b: &[u8]) -> __m256i {
    _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(iq4_table()), nibbles(&b[2..]))
}

symmetric_kernel!(
    /// Q8_0 × Q8_0.
    q8_0, "avx2,fma,f16c", Q8_0_BYTES, decode_q8_0, mul_sum_i8
);
symmetric_kernel!(
    /// Q4_0 × Q8_0.
    q4_0, "avx2,fma,f16c", Q4_0_BYTES, decode_q4_0, mul_sum_i8
);
symmetric_kernel!(
    /// Q5_0 × Q8_0.
    q5_0, "avx2,fma,f16c", Q5_0_BYTES, decode_q5_0, mul_sum_i8
);
symmetric_kernel!(
    /// IQ4_NL × Q8_0.
    iq4_nl, "avx2,fma,f16c", IQ4_NL_BYTES, decode_iq4_nl, mul_sum_i8
);

/// Q4_K × Q8_K.
///
/// # Safety
/// AVX2, FMA and F16C available; the `RawDotFn` size contract.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    k_affine(w, a, false)
}

/// Q5_K × Q8_K.
///
/// # Safety
/// AVX2, FMA and F16C available; the `RawDotFn` size contract.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_k(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    k_affine(w, a, true)
}

/// Q4_K (`five_bits` false) or Q5_K super-blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn k_affine(w: &[u8], a: &[u8], five_bits: bool) -> f32 {
    let width = if five_bits { Q5_K_BYTES } else { Q4_K_BYTES };
    let qs_at = if five_bits { 48 } else { 16 };
    let low4 = _mm256_set1_epi8(0x0F);
    let (bit0, bit1) = (_mm256_set1_epi8(1), _mm256_set1_epi8(2));
    let mut acc = 0.0f32;
    for (wb, ab) in w.chunks_exact(width).zip(a.chunks_exact(Q8_K_BYTES)) {
        let (sc, mn) = unpack_k4_scales_u64(&wb[4..16]);
        let sc = sc.to_le_bytes();
        // Fifth bits: bit i of byte l belongs to sub-block i; shifted down by 2 per chunk.
        let mut high = if five_bits {
            load32(&wb[16..])
        } else {
            _mm256_setzero_si256()
        };
        let mut sums = _mm256_setzero_si256();
        for c in 0..4 {
            let x = load32(&wb[qs_at + 32 * c..]);
            let mut lo = _mm256_and_si256(x, low4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(x), low4);
            if five_bits {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(high, bit0)));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16::<3>(_mm256_and_si256(high, bit1)));
                high = _mm256_srli_epi16::<2>(high);
            }
            let s_lo = _mm256_set1_epi16(sc[2 * c] as i16);
            let s_hi = _mm256_set1_epi16(sc[2 * c + 1] as i16);
            let x_lo = load32(&ab[4 + 64 * c..]);
            let x_hi = load32(&ab[36 + 64 * c..]);
            sums = _mm256_add_epi32(sums, scaled_mul_sum_u8(lo, x_lo, s_lo));
            sums = _mm256_add_epi32(sums, scaled_mul_sum_u8(hi, x_hi, s_hi));
        }
        let (sumi, summs) = hsum2(sums, k4_min_lanes(mn, ab));
        let (d, dmin) = f16_pair_at(wb, 0);
        acc += k_min_term(d, dmin, f32_at(ab, 0), sumi, summs);
    }
    acc
}

/// The four vectors of unsigned 6-bit values (32 each) of half `n` of a Q6_K block, in value
/// order: values 0–31, 32–63, 64–95, 96–127 of the half.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q6_k_half(wb: &[u8], n: usize) -> [__m256i; 4] {
    let (low4, low2) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3));
    let ql0 = load32(&wb[64 * n..]);
    let ql1 = load32(&wb[64 * n + 32..]);
    let qh = load32(&wb[128 + 32 * n..]);
    let top = |bits: __m256i| _mm256_slli_epi16::<4>(_mm256_and_si256(bits, low2));
    [
        _mm256_or_si256(_mm256_and_si256(ql0, low4), top(qh)),
        _mm256_or_si256(_mm256_and_si256(ql1, low4), top(_mm256_srli_epi16::<2>(qh))),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low4),
            top(_mm256_srli_epi16::<4>(qh)),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), low4),
            top(_mm256_srli_epi16::<6>(qh)),
        ),
    ]
}

/// Q6_K × Q8_K.
///
/// # Safety
/// AVX2, FMA and F16C available; the `RawDotFn` size contract.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut acc = 0.0f32;
    for (wb, ab) in w.chunks_exact(Q6_K_BYTES).zip(a.chunks_exact(Q8_K_BYTES)) {
        let mut sums = _mm256_setzero_si256();
        for n in 0..2 {
            for (i, q) in q6_k_half(wb, n).into_iter().enumerate() {
                // Each vector spans two sub-blocks of 16: one scale per 128-bit half.
                let sub = 8 * n + 2 * i;
                let scales = _mm256_setr_m128i(
                    _mm_set1_epi16((wb[192 + sub] as i8) as i16),
                    _mm_set1_epi16((wb[193 + sub] as i8) as i16),
                );
                let x = load32(&ab[4 + 128 * n + 32 * i..]);
                sums = _mm256_add_epi32(sums, scaled_mul_sum_u8(q, x, scales));
            }
        }
        let sums = _mm256_sub_epi32(sums, q6_k_offset_lanes(&wb[192..], ab));
        acc += k_term(f16_one_at(wb, 208), f32_at(ab, 0), hsum_i32(sums));
    }
    acc
}

/// IQ4_XS × Q8_K.
///
/// # Safety
/// AVX2, FMA and F16C available; the `RawDotFn` size contract.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq4_xs(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    let table = _mm256_broadcastsi128_si256(iq4_table());
    let mut acc = 0.0f32;
    for (wb, ab) in w.chunks_exact(IQ4_XS_BYTES).zip(a.chunks_exact(Q8_K_BYTES)) {
        let codes = unpack_iq4_xs_scales_u64(wb).to_le_bytes();
        let mut sums = _mm256_setzero_si256();
        for (sub, &c) in codes.iter().enumerate() {
            let v = _mm256_shuffle_epi8(table, nibbles(&wb[8 + 16 * sub..]));
            let x = load32(&ab[4 + 32 * sub..]);
            let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(x, v));
            let scale = _mm256_set1_epi16(c as i16 - 32);
            sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, scale));
        }
        acc += k_term(f16_one_at(wb, 0), f32_at(ab, 0), hsum_i32(sums));
    }
    acc
}
