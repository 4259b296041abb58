//! AVX-512 VNNI dot kernels (the `avx512_vnni` level: AVX-512 F/BW/VL/DQ + VNNI, with AVX2,
//! FMA and F16C underneath). Exact against the scalar twins, like the AVX2 kernels.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes and adds groups of four into int32 without
//! saturation. The 32-value types use it on 256-bit vectors (one block each); the K types on
//! 512-bit vectors covering two sub-blocks of 32 (or four of 16) at once, then multiply the
//! int32 lanes by their sub-block scales.
use super::blocks::*;
use super::dot::{k_min_term, k_term};
use super::x86_avx2::{
    decode_iq4_nl, decode_q4_0, decode_q5_0, decode_q8_0, f16_one_at, f16_pair_at, hsum2, hsum_i32,
    iq4_table, k4_min_lanes, load16, load32, q6_k_offset_lanes, symmetric_kernel,
};
use super::{GgmlType, RawDotFn};
use std::arch::x86_64::*;

/// The AVX-512 VNNI kernel for `ty`, if there is one.
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

/// The first 64 bytes of `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
fn load64(b: &[u8]) -> __m512i {
    let b: &[u8; 64] = b.first_chunk().expect("a SIMD load needs 64 bytes");
    // SAFETY: `b` is 64 readable bytes; the load is unaligned.
    unsafe { _mm512_loadu_si512(b.as_ptr().cast()) }
}

/// Eight int32 partial sums of 32 signed × signed int8 products (|w| ≤ 128, a ∈ [−127, 127]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
fn mul_sum_i8(w: __m256i, a: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(
        _mm256_setzero_si256(),
        _mm256_sign_epi8(w, w),
        _mm256_sign_epi8(a, w),
    )
}

/// `[lo ×8, hi ×8]` as int32 lanes: one scale per half of a 512-bit product.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
fn halves(lo: i32, hi: i32) -> __m512i {
    _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(_mm256_set1_epi32(lo)),
        _mm256_set1_epi32(hi),
    )
}

/// Two 256-bit vectors as the low and high half of one 512-bit vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

symmetric_kernel!(
    /// Q8_0 × Q8_0.
    q8_0, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni", Q8_0_BYTES,
    decode_q8_0, mul_sum_i8
);
symmetric_kernel!(
    /// Q4_0 × Q8_0.
    q4_0, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni", Q4_0_BYTES,
    decode_q4_0, mul_sum_i8
);
symmetric_kernel!(
    /// Q5_0 × Q8_0.
    q5_0, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni", Q5_0_BYTES,
    decode_q5_0, mul_sum_i8
);
symmetric_kernel!(
    /// IQ4_NL × Q8_0.
    iq4_nl, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni", IQ4_NL_BYTES,
    decode_iq4_nl, mul_sum_i8
);

/// Q4_K × Q8_K.
///
/// # Safety
/// The `avx512_vnni` level's features available; the `RawDotFn` size contract.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
unsafe fn q4_k(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    k_affine(w, a, false)
}

/// Q5_K × Q8_K.
///
/// # Safety
/// The `avx512_vnni` level's features available; the `RawDotFn` size contract.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
unsafe fn q5_k(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    k_affine(w, a, true)
}

/// Q4_K or Q5_K super-blocks: chunk c (sub-blocks 2c and 2c+1) is one 512-bit vector of 64
/// values matching 64 consecutive activations.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
fn k_affine(w: &[u8], a: &[u8], five_bits: bool) -> f32 {
    let width = if five_bits { Q5_K_BYTES } else { Q4_K_BYTES };
    let qs_at = if five_bits { 48 } else { 16 };
    let low4 = _mm256_set1_epi8(0x0F);
    let (bit0, bit1) = (_mm256_set1_epi8(1), _mm256_set1_epi8(2));
    // Lane i of chunk c's products belongs to sub-block 2c + i / 8.
    let sub_of_lane: [__m512i; 4] = std::array::from_fn(|c| halves(2 * c as i32, 2 * c as i32 + 1));
    let mut acc = 0.0f32;
    for (wb, ab) in w.chunks_exact(width).zip(a.chunks_exact(Q8_K_BYTES)) {
        let (sc, mn) = unpack_k4_scales_u64(&wb[4..16]);
        let scales = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128(sc as i64));
        let mut high = if five_bits {
            load32(&wb[16..])
        } else {
            _mm256_setzero_si256()
        };
        let mut sums = _mm512_setzero_si512();
        for (c, lanes) in sub_of_lane.iter().enumerate() {
            let x = load32(&wb[qs_at + 32 * c..]);
            let mut lo = _mm256_and_si256(x, low4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(x), low4);
            if five_bits {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(high, bit0)));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16::<3>(_mm256_and_si256(high, bit1)));
                high = _mm256_srli_epi16::<2>(high);
            }
            let dots = _mm512_dpbusd_epi32(
                _mm512_setzero_si512(),
                join(lo, hi),
                load64(&ab[4 + 64 * c..]),
            );
            let lane_scales = _mm512_permutexvar_epi32(*lanes, scales);
            sums = _mm512_add_epi32(sums, _mm512_mullo_epi32(dots, lane_scales));
        }
        let (sumi, summs) = hsum2(fold256(sums), k4_min_lanes(mn, ab));
        let (d, dmin) = f16_pair_at(wb, 0);
        acc += k_min_term(d, dmin, f32_at(ab, 0), sumi, summs);
    }
    acc
}

/// The low and high halves of `v` added.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
fn fold256(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
}

/// Q6_K × Q8_K: each half of 128 values is two 512-bit vectors of 64 consecutive values; int32
/// lane i of a product covers values 4i..4i+3, so its sub-block of 16 is i / 4.
///
/// # Safety
/// The `avx512_vnni` level's features available; the `RawDotFn` size contract.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
unsafe fn q6_k(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    let low4 = _mm512_set1_epi8(0x0F);
    let low2 = _mm512_set1_epi8(3);
    let quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    let mut acc = 0.0f32;
    for (wb, ab) in w.chunks_exact(Q6_K_BYTES).zip(a.chunks_exact(Q8_K_BYTES)) {
        let scales = _mm512_cvtepi8_epi32(load16(&wb[192..]));
        let sub_scales = |first: i32| {
            _mm512_permutexvar_epi32(_mm512_add_epi32(quarter, _mm512_set1_epi32(first)), scales)
        };
        let mut sums = _mm512_setzero_si512();
        for n in 0..2 {
            let ql = load64(&wb[64 * n..]);
            let qh = load32(&wb[128 + 32 * n..]);
            let qh_01 = join(qh, _mm256_srli_epi16::<2>(qh));
            let qh_23 = join(_mm256_srli_epi16::<4>(qh), _mm256_srli_epi16::<6>(qh));
            let top = |bits: __m512i| _mm512_slli_epi16::<4>(_mm512_and_si512(bits, low2));
            let first = _mm512_or_si512(_mm512_and_si512(ql, low4), top(qh_01));
            let second = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16::<4>(ql), low4),
                top(qh_23),
            );
            let zero = _mm512_setzero_si512();
            let d_first = _mm512_dpbusd_epi32(zero, first, load64(&ab[4 + 128 * n..]));
            let d_second = _mm512_dpbusd_epi32(zero, second, load64(&ab[68 + 128 * n..]));
            let base = 8 * n as i32;
            sums = _mm512_add_epi32(sums, _mm512_mullo_epi32(d_first, sub_scales(base)));
            sums = _mm512_add_epi32(sums, _mm512_mullo_epi32(d_second, sub_scales(base + 4)));
        }
        let sums = _mm256_sub_epi32(fold256(sums), q6_k_offset_lanes(&wb[192..], ab));
        acc += k_term(f16_one_at(wb, 208), f32_at(ab, 0), hsum_i32(sums));
    }
    acc
}

/// IQ4_XS × Q8_K: two sub-blocks of 32 per 512-bit vector. The signed table values are split
/// into |v| (unsigned operand) and the activations negated where v < 0.
///
/// # Safety
/// The `avx512_vnni` level's features available; the `RawDotFn` size contract.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
unsafe fn iq4_xs(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    let table = _mm512_broadcast_i32x4(iq4_table());
    let low4 = _mm256_set1_epi8(0x0F);
    let zero = _mm512_setzero_si512();
    let sub_of_lane: [__m512i; 4] = std::array::from_fn(|p| halves(2 * p as i32, 2 * p as i32 + 1));
    let mut acc = 0.0f32;
    for (wb, ab) in w.chunks_exact(IQ4_XS_BYTES).zip(a.chunks_exact(Q8_K_BYTES)) {
        let codes = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128(unpack_iq4_xs_scales_u64(wb) as i64));
        let scales = _mm512_sub_epi32(codes, _mm512_set1_epi32(32));
        let mut sums = _mm512_setzero_si512();
        for (p, lanes) in sub_of_lane.iter().enumerate() {
            let x = load32(&wb[8 + 32 * p..]);
            let lo = _mm256_and_si256(x, low4);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(x), low4);
            // 128-bit lanes [lo 2p, lo 2p+1, hi 2p, hi 2p+1] → [lo 2p, hi 2p, lo 2p+1, hi 2p+1].
            let idx = _mm512_shuffle_i64x2::<0b11_01_10_00>(join(lo, hi), join(lo, hi));
            let v = _mm512_shuffle_epi8(table, idx);
            let x8 = load64(&ab[4 + 64 * p..]);
            let signed = _mm512_mask_sub_epi8(x8, _mm512_movepi8_mask(v), zero, x8);
            let dots = _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(v), signed);
            let lane_scales = _mm512_permutexvar_epi32(*lanes, scales);
            sums = _mm512_add_epi32(sums, _mm512_mullo_epi32(dots, lane_scales));
        }
        acc += k_term(f16_one_at(wb, 0), f32_at(ab, 0), hsum_i32(fold256(sums)));
    }
    acc
}
