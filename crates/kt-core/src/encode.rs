//! Codes of scaled values, many at a time: the inner loops of the online quantizers
//! (`load_weights_from_tensors` for the native formats).
//!
//! A value's code takes a division by its group's scale and then the rounding of
//! [`CodeKind::encode`]: up to seven compares for E2M1, the branches of E4M3. One value at a
//! time, that held online quantization to 0.7-1.5 GiB of bf16 per second on two Zen 4 cores,
//! a quarter of the int8 path's rate. The variants here run 16 (AVX-512) or 8 (AVX2) values
//! per step with the same IEEE operations in the same order (a true division, not a
//! reciprocal), so they write the bytes the scalar code writes for every input, NaN and
//! infinities included; the scalar loops are the twins, and a test holds each variant to them.
//! The row quantizers also find the E8M0, E4M3 and bf16 group scales of 16 (8) groups at once:
//! with groups of 16 or 32 values, one group's scalar scale cost as much as encoding its values.
use crate::codes::{group_scale, CodeKind, ScaleType};
#[cfg(target_arch = "x86_64")]
use crate::isa::{self, Level};

/// The codes of `values[i] / scale` ([`CodeKind::encode`]) as a checkpoint's row holds them:
/// a byte each, or (4-bit kinds) two to a byte, the even input in the low nibble.
pub fn encode_scaled(kind: CodeKind, values: &[f32], scale: f32, out: &mut [u8]) {
    check_lengths(kind, values.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    {
        if isa::allows(Level::Avx512Base) {
            // SAFETY: the CPU has AVX-512 F (the level says so); lengths checked above.
            return unsafe { x86::encode_avx512(kind, values, scale, out) };
        }
        if isa::allows(Level::Avx2) {
            // SAFETY: the CPU has AVX2; lengths checked above.
            return unsafe { x86::encode_avx2(kind, values, scale, out) };
        }
    }
    encode_scalar(kind, values, scale, out)
}

/// The twin of [`encode_scaled`].
pub fn encode_scalar(kind: CodeKind, values: &[f32], scale: f32, out: &mut [u8]) {
    if kind.bits() == 8 {
        for (c, &v) in out.iter_mut().zip(values) {
            *c = kind.encode(v / scale);
        }
    } else {
        for (c, pair) in out.iter_mut().zip(values.chunks_exact(2)) {
            *c = kind.encode(pair[0] / scale) | (kind.encode(pair[1] / scale) << 4);
        }
    }
}

/// `values` values make `bytes` bytes of `kind`'s codes (4-bit codes in whole bytes).
fn check_lengths(kind: CodeKind, values: usize, bytes: usize) {
    assert!(
        values * kind.bits() == 8 * bytes && (kind.bits() == 8 || values.is_multiple_of(2)),
        "{values} {kind:?} codes do not fill {bytes} bytes"
    );
}

/// Quantize `row` in groups of `group` values as [`crate::codes::quantize_group`] quantizes
/// each: the codes into `codes` as [`encode_scaled`] lays them out, each group's scale bits
/// into `scales`.
pub fn quantize_row(
    kind: CodeKind,
    scale_type: ScaleType,
    global: f32,
    row: &[f32],
    group: usize,
    codes: &mut [u8],
    scales: &mut [u16],
) {
    assert!(
        group > 0 && row.len().is_multiple_of(group),
        "a row of {} values in groups of {group}",
        row.len()
    );
    check_lengths(kind, group, group * kind.bits() / 8);
    check_lengths(kind, row.len(), codes.len());
    assert_eq!(scales.len(), row.len() / group, "one scale per group");
    #[cfg(target_arch = "x86_64")]
    {
        let vector = |lanes: usize| group.is_multiple_of(lanes);
        if isa::allows(Level::Avx512Base) && vector(16) {
            // SAFETY: the CPU has AVX-512 F; whole 16-value steps per group; lengths checked.
            return unsafe {
                x86::quantize_row_avx512(kind, scale_type, global, row, group, codes, scales)
            };
        }
        if isa::allows(Level::Avx2) && vector(8) {
            // SAFETY: the CPU has AVX2; whole 8-value steps per group; lengths checked.
            return unsafe {
                x86::quantize_row_avx2(kind, scale_type, global, row, group, codes, scales)
            };
        }
    }
    quantize_row_scalar(kind, scale_type, global, row, group, codes, scales)
}

/// The twin of [`quantize_row`]: [`crate::codes::quantize_group`] on each group, its codes
/// packed as [`encode_scalar`] packs them.
pub fn quantize_row_scalar(
    kind: CodeKind,
    scale_type: ScaleType,
    global: f32,
    row: &[f32],
    group: usize,
    codes: &mut [u8],
    scales: &mut [u16],
) {
    let mut one_each = vec![0u8; group];
    let group_bytes = group * kind.bits() / 8;
    let groups = row
        .chunks_exact(group)
        .zip(codes.chunks_exact_mut(group_bytes));
    for ((values, codes), bits) in groups.zip(scales.iter_mut()) {
        *bits = crate::codes::quantize_group(kind, scale_type, global, values, &mut one_each);
        if kind.bits() == 8 {
            codes.copy_from_slice(&one_each);
        } else {
            for (b, pair) in codes.iter_mut().zip(one_each.chunks_exact(2)) {
                *b = pair[0] | (pair[1] << 4);
            }
        }
    }
}

/// Fill `out` with the codes of zero: a group whose scale is unusable ([`group_scale`]).
fn zero_codes(kind: CodeKind, out: &mut [u8]) {
    let zero = kind.encode(0.0);
    out.fill(if kind.bits() == 8 { zero } else { zero * 0x11 });
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::codes::{E2M1_MIDPOINTS, ROUND_MAGIC};
    use std::arch::x86_64::*;

    /// bf16 bits of 1.0: the scale of a group without a positive magnitude.
    const BF16_ONE: i32 = 0x3F80;

    /// # Safety
    /// AVX-512 F; the lengths [`encode_scaled`] checks.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn encode_avx512(kind: CodeKind, values: &[f32], scale: f32, out: &mut [u8]) {
        let per = 16 * kind.bits() / 8;
        let whole = values.len() / 16;
        let s = _mm512_set1_ps(scale);
        let steps = values.chunks_exact(16).zip(out.chunks_exact_mut(per));
        for (v, o) in steps {
            // SAFETY: 16 values in, `per` bytes out.
            unsafe {
                let q = _mm512_div_ps(_mm512_loadu_ps(v.as_ptr()), s);
                match kind {
                    CodeKind::E4M3 => {
                        let code = e4m3_512(q);
                        _mm_storeu_si128(o.as_mut_ptr() as *mut __m128i, _mm512_cvtepi32_epi8(code))
                    }
                    _ => {
                        let code = if kind == CodeKind::E2M1 {
                            e2m1_512(q)
                        } else {
                            int4_512(q)
                        };
                        let pairs = _mm512_cvtepi64_epi8(nibble_pairs512(code));
                        _mm_storel_epi64(o.as_mut_ptr() as *mut __m128i, pairs)
                    }
                }
            }
        }
        encode_scalar(kind, &values[whole * 16..], scale, &mut out[whole * per..]);
    }

    /// Each 64-bit lane's low byte: its even code (low half) in the low nibble, its odd code
    /// (high half) in the high nibble (codes below 16).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn nibble_pairs512(code: __m512i) -> __m512i {
        _mm512_or_si512(code, _mm512_srli_epi64::<28>(code))
    }

    /// E2M1 codes of 16 lanes: the count of midpoints below `|q|` (ties up only to even codes),
    /// the sign bit on non-zero codes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn e2m1_512(q: __m512) -> __m512i {
        // `min` returns its second operand for NaN: NaN counts as 6, as in the scalar code.
        let a = _mm512_min_ps(_mm512_abs_ps(q), _mm512_set1_ps(6.0));
        let one = _mm512_set1_epi32(1);
        let mut code = _mm512_setzero_si512();
        for (c, &mid) in E2M1_MIDPOINTS.iter().enumerate() {
            let mid = _mm512_set1_ps(mid);
            let above = if c % 2 == 1 {
                _mm512_cmp_ps_mask::<_CMP_GE_OQ>(a, mid)
            } else {
                _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, mid)
            };
            code = _mm512_mask_add_epi32(code, above, code, one);
        }
        let nonzero = _mm512_test_epi32_mask(code, code);
        let negative =
            _mm512_mask_cmplt_epi32_mask(nonzero, _mm512_castps_si512(q), _mm512_setzero_si512());
        _mm512_mask_or_epi32(code, negative, code, _mm512_set1_epi32(8))
    }

    /// Int4 codes of 16 lanes: rounded ties to even, clamped to [−8, 7], plus 8; NaN gives 8.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn int4_512(q: __m512) -> __m512i {
        let magic = _mm512_set1_ps(ROUND_MAGIC);
        let t = _mm512_sub_ps(_mm512_add_ps(q, magic), magic);
        let t = _mm512_max_ps(_mm512_min_ps(t, _mm512_set1_ps(7.0)), _mm512_set1_ps(-8.0));
        let code = _mm512_add_epi32(_mm512_cvttps_epi32(t), _mm512_set1_epi32(8));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(q, q);
        _mm512_mask_blend_epi32(nan, code, _mm512_set1_epi32(8))
    }

    /// E4M3 codes of 16 lanes ([`crate::dtype::f32_to_e4m3`] without branches): the mantissa
    /// rounded to 3 bits ties to even, multiples of 2⁻⁹ below 2⁻⁶, 448 and beyond saturating,
    /// NaN to 0x7F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn e4m3_512(q: __m512) -> __m512i {
        let bits = _mm512_castps_si512(q);
        let sign = _mm512_and_si512(_mm512_srli_epi32::<24>(bits), _mm512_set1_epi32(0x80));
        let a = _mm512_abs_ps(q);
        let ab = _mm512_castps_si512(a);
        let odd = _mm512_and_si512(_mm512_srli_epi32::<20>(ab), _mm512_set1_epi32(1));
        let rounded = _mm512_add_epi32(_mm512_add_epi32(ab, _mm512_set1_epi32(0x7_FFFF)), odd);
        let exponent = _mm512_sub_epi32(_mm512_srli_epi32::<23>(rounded), _mm512_set1_epi32(120));
        let normal = _mm512_or_si512(
            _mm512_slli_epi32::<3>(exponent),
            _mm512_and_si512(_mm512_srli_epi32::<20>(rounded), _mm512_set1_epi32(7)),
        );
        let tiny = _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(a, _mm512_set1_ps(512.0)),
        );
        let is_tiny = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, _mm512_set1_ps(1.0 / 64.0));
        let is_large = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(a, _mm512_set1_ps(448.0));
        let code = _mm512_mask_blend_epi32(is_tiny, normal, tiny);
        let code = _mm512_mask_blend_epi32(is_large, code, _mm512_set1_epi32(0x7E));
        let code = _mm512_or_si512(code, sign);
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(q, q);
        _mm512_mask_blend_epi32(nan, code, _mm512_set1_epi32(0x7F))
    }

    /// # Safety
    /// AVX-512 F; the lengths [`quantize_row`] checks; `group` a multiple of 16.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn quantize_row_avx512(
        kind: CodeKind,
        scale_type: ScaleType,
        global: f32,
        row: &[f32],
        group: usize,
        codes: &mut [u8],
        scales: &mut [u16],
    ) {
        let one_group = |values: &[f32]| {
            let mut largest = _mm512_setzero_ps();
            for v in values.chunks_exact(16) {
                // SAFETY: 16 values. `max` returns its second operand for NaN: NaN values are
                // passed over, as `f32::max` passes them over in the scalar code.
                largest =
                    unsafe { _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(v.as_ptr())), largest) };
            }
            group_scale(kind, scale_type, global, _mm512_reduce_max_ps(largest))
        };
        let rows = RowJob {
            kind,
            scale_type,
            row,
            group,
        };
        rows.run::<16>(
            codes,
            scales,
            // SAFETY: 16 whole groups of whole 16-value steps (the caller's contract).
            |values| unsafe { batch_scales(kind, scale_type, global, values, group) },
            one_group,
            // SAFETY: AVX-512 F here.
            |values, scale, out| unsafe { encode_avx512(kind, values, scale, out) },
        );
    }

    /// [`group_scale`] of 16 consecutive groups of `group` values (a multiple of 16) with E8M0,
    /// E4M3 or bf16 scales, lane g for group g: the stored bits, the scales, and a mask of the
    /// usable ones. The same operations on the same values as the scalar code, so the same
    /// bits: the groups' largest magnitudes (NaN passed over), `amax / global / max`, the
    /// scale type's rounding up (E8M0) or to nearest (E4M3, through [`e4m3_512`]), its value.
    ///
    /// # Safety
    /// AVX-512 F; `values` holds 16 groups of `group` values, `group` a multiple of 16.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn batch_scales(
        kind: CodeKind,
        scale_type: ScaleType,
        global: f32,
        values: &[f32],
        group: usize,
    ) -> ([u32; 16], [f32; 16], u32) {
        let mut lanes = [_mm512_setzero_ps(); 16];
        for (m, values) in lanes.iter_mut().zip(values.chunks_exact(group)) {
            for v in values.chunks_exact(16) {
                // SAFETY: 16 values; NaN passed over as in [`quantize_row_avx512`].
                *m = unsafe { _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(v.as_ptr())), *m) };
            }
        }
        let amax = lane_maxima(&lanes);
        let wanted = _mm512_div_ps(
            _mm512_div_ps(amax, _mm512_set1_ps(global)),
            _mm512_set1_ps(kind.max()),
        );
        let positive = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(amax, _mm512_setzero_ps());
        let (bits, value) = match scale_type {
            ScaleType::E8M0 => {
                // ⌈log2 s⌉: the exponent, plus one unless s is a power of two; 127 (1.0) for
                // NaN, zero and values below the smallest normal, as `encode_at_least`.
                let s = _mm512_castps_si512(wanted);
                let exponent =
                    _mm512_and_si512(_mm512_srli_epi32::<23>(s), _mm512_set1_epi32(0xFF));
                let fraction = _mm512_test_epi32_mask(s, _mm512_set1_epi32(0x7F_FFFF));
                let up = _mm512_mask_add_epi32(exponent, fraction, exponent, _mm512_set1_epi32(1));
                let up = _mm512_max_epi32(
                    _mm512_min_epi32(up, _mm512_set1_epi32(254)),
                    _mm512_set1_epi32(1),
                );
                let normal =
                    _mm512_cmp_ps_mask::<_CMP_GE_OQ>(wanted, _mm512_set1_ps(f32::MIN_POSITIVE));
                let bits = _mm512_mask_blend_epi32(normal & positive, _mm512_set1_epi32(127), up);
                (bits, _mm512_castsi512_ps(_mm512_slli_epi32::<23>(bits)))
            }
            ScaleType::Bf16 => {
                // Round to nearest, ties to even, on the bits (as `bf16::from_f32` for values
                // that are not NaN; a finite value past the largest bf16 rounds to infinity).
                let s = _mm512_castps_si512(wanted);
                let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(s), _mm512_set1_epi32(1));
                let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(
                    _mm512_add_epi32(s, _mm512_set1_epi32(0x7FFF)),
                    odd,
                ));
                let one = _mm512_set1_epi32(BF16_ONE);
                let bits = _mm512_mask_blend_epi32(positive, one, rounded);
                (bits, _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits)))
            }
            _ => {
                let one = CodeKind::E4M3.encode(1.0) as i32;
                let bits =
                    _mm512_mask_blend_epi32(positive, _mm512_set1_epi32(one), e4m3_512(wanted));
                (bits, e4m3_value512(bits))
            }
        };
        let scale = _mm512_mul_ps(value, _mm512_set1_ps(global));
        let usable = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(scale, _mm512_setzero_ps())
            & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(scale, _mm512_set1_ps(f32::INFINITY));
        let (mut b, mut v) = ([0u32; 16], [0f32; 16]);
        // SAFETY: 16 lanes into 16 elements each.
        unsafe {
            _mm512_storeu_si512(b.as_mut_ptr() as *mut __m512i, bits);
            _mm512_storeu_ps(v.as_mut_ptr(), scale);
        }
        (b, v, usable as u32)
    }

    /// Lane g: the largest lane of `m[g]` (maxima of non-NaN values, so the order of the
    /// comparisons does not matter). Halves, then quarters, then pairs and single lanes of two
    /// vectors at a time are compared, which leaves group `L + 4e` at lane `4L + e`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn lane_maxima(m: &[__m512; 16]) -> __m512 {
        let halves: [__m512; 8] = std::array::from_fn(|i| {
            let (a, b) = (m[2 * i], m[2 * i + 1]);
            _mm512_max_ps(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
            )
        });
        let quarters: [__m512; 4] = std::array::from_fn(|i| {
            let (a, b) = (halves[2 * i], halves[2 * i + 1]);
            _mm512_max_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
            )
        });
        let pairs: [__m512; 2] = std::array::from_fn(|i| {
            let (a, b) = (quarters[2 * i], quarters[2 * i + 1]);
            _mm512_max_ps(
                _mm512_shuffle_ps::<0b10_00_10_00>(a, b),
                _mm512_shuffle_ps::<0b11_01_11_01>(a, b),
            )
        });
        let (a, b) = (pairs[0], pairs[1]);
        let lanes = _mm512_max_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(a, b),
            _mm512_shuffle_ps::<0b11_01_11_01>(a, b),
        );
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(order, lanes)
    }

    /// The values of 16 E4M3 codes (the scale table's, without NaN: the encoder saturates).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn e4m3_value512(bits: __m512i) -> __m512 {
        let exponent = _mm512_and_si512(_mm512_srli_epi32::<3>(bits), _mm512_set1_epi32(0xF));
        let mantissa = _mm512_and_si512(bits, _mm512_set1_epi32(7));
        let normal = _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_slli_epi32::<23>(_mm512_add_epi32(exponent, _mm512_set1_epi32(120))),
            _mm512_slli_epi32::<20>(mantissa),
        ));
        // m · 2⁻⁹ below the smallest normal code.
        let tiny = _mm512_mul_ps(_mm512_cvtepi32_ps(mantissa), _mm512_set1_ps(1.0 / 512.0));
        let is_tiny = _mm512_cmpeq_epi32_mask(exponent, _mm512_setzero_si512());
        let magnitude = _mm512_mask_blend_ps(is_tiny, normal, tiny);
        let negative = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x80));
        _mm512_mask_sub_ps(magnitude, negative, _mm512_setzero_ps(), magnitude)
    }

    /// # Safety
    /// AVX2; the lengths [`encode_scaled`] checks.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn encode_avx2(kind: CodeKind, values: &[f32], scale: f32, out: &mut [u8]) {
        let per = 8 * kind.bits() / 8;
        let whole = values.len() / 8;
        let s = _mm256_set1_ps(scale);
        // Byte 0 of each 32-bit lane (bytes) or each 64-bit lane (nibble pairs) to the low
        // bytes of its 128-bit half.
        let (dword_bytes, qword_bytes) = (
            _mm256_setr_epi8(
                0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1,
                -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
            ),
            _mm256_setr_epi8(
                0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 8, -1, -1, -1, -1,
                -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
            ),
        );
        let steps = values.chunks_exact(8).zip(out.chunks_exact_mut(per));
        for (v, o) in steps {
            // SAFETY: 8 values in, `per` bytes out.
            unsafe {
                let q = _mm256_div_ps(_mm256_loadu_ps(v.as_ptr()), s);
                match kind {
                    CodeKind::E4M3 => {
                        let b = _mm256_shuffle_epi8(e4m3_256(q), dword_bytes);
                        let both = _mm_unpacklo_epi32(
                            _mm256_castsi256_si128(b),
                            _mm256_extracti128_si256::<1>(b),
                        );
                        _mm_storel_epi64(o.as_mut_ptr() as *mut __m128i, both);
                    }
                    _ => {
                        let code = if kind == CodeKind::E2M1 {
                            e2m1_256(q)
                        } else {
                            int4_256(q)
                        };
                        let pairs = _mm256_or_si256(code, _mm256_srli_epi64::<28>(code));
                        let b = _mm256_shuffle_epi8(pairs, qword_bytes);
                        let both = _mm_unpacklo_epi16(
                            _mm256_castsi256_si128(b),
                            _mm256_extracti128_si256::<1>(b),
                        );
                        (o.as_mut_ptr() as *mut i32).write_unaligned(_mm_cvtsi128_si32(both));
                    }
                }
            }
        }
        encode_scalar(kind, &values[whole * 8..], scale, &mut out[whole * per..]);
    }

    /// All-ones lanes where `m` (a compare's result) holds, as integers.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn lanes(m: __m256) -> __m256i {
        _mm256_castps_si256(m)
    }

    /// `|q|` (the sign bit cleared).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn abs256(q: __m256) -> __m256 {
        _mm256_castsi256_ps(_mm256_and_si256(
            _mm256_castps_si256(q),
            _mm256_set1_epi32(0x7FFF_FFFF),
        ))
    }

    /// As [`e2m1_512`] on 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn e2m1_256(q: __m256) -> __m256i {
        let a = _mm256_min_ps(abs256(q), _mm256_set1_ps(6.0));
        let mut code = _mm256_setzero_si256();
        for (c, &mid) in E2M1_MIDPOINTS.iter().enumerate() {
            let mid = _mm256_set1_ps(mid);
            let above = if c % 2 == 1 {
                _mm256_cmp_ps::<_CMP_GE_OQ>(a, mid)
            } else {
                _mm256_cmp_ps::<_CMP_GT_OQ>(a, mid)
            };
            // An all-ones lane is −1: subtracting it counts the midpoint.
            code = _mm256_sub_epi32(code, lanes(above));
        }
        let zero = _mm256_cmpeq_epi32(code, _mm256_setzero_si256());
        let negative = _mm256_andnot_si256(zero, _mm256_srai_epi32::<31>(_mm256_castps_si256(q)));
        _mm256_or_si256(code, _mm256_and_si256(negative, _mm256_set1_epi32(8)))
    }

    /// As [`int4_512`] on 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn int4_256(q: __m256) -> __m256i {
        let magic = _mm256_set1_ps(ROUND_MAGIC);
        let t = _mm256_sub_ps(_mm256_add_ps(q, magic), magic);
        let t = _mm256_max_ps(_mm256_min_ps(t, _mm256_set1_ps(7.0)), _mm256_set1_ps(-8.0));
        let code = _mm256_add_epi32(_mm256_cvttps_epi32(t), _mm256_set1_epi32(8));
        let nan = lanes(_mm256_cmp_ps::<_CMP_UNORD_Q>(q, q));
        _mm256_blendv_epi8(code, _mm256_set1_epi32(8), nan)
    }

    /// As [`e4m3_512`] on 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn e4m3_256(q: __m256) -> __m256i {
        let bits = _mm256_castps_si256(q);
        let sign = _mm256_and_si256(_mm256_srli_epi32::<24>(bits), _mm256_set1_epi32(0x80));
        let a = abs256(q);
        let ab = _mm256_castps_si256(a);
        let odd = _mm256_and_si256(_mm256_srli_epi32::<20>(ab), _mm256_set1_epi32(1));
        let rounded = _mm256_add_epi32(_mm256_add_epi32(ab, _mm256_set1_epi32(0x7_FFFF)), odd);
        let exponent = _mm256_sub_epi32(_mm256_srli_epi32::<23>(rounded), _mm256_set1_epi32(120));
        let normal = _mm256_or_si256(
            _mm256_slli_epi32::<3>(exponent),
            _mm256_and_si256(_mm256_srli_epi32::<20>(rounded), _mm256_set1_epi32(7)),
        );
        // `cvtps` rounds as MXCSR says: to nearest, ties to even, unless a caller changed it,
        // which nothing in this process does.
        let tiny = _mm256_cvtps_epi32(_mm256_mul_ps(a, _mm256_set1_ps(512.0)));
        let is_tiny = lanes(_mm256_cmp_ps::<_CMP_LT_OQ>(a, _mm256_set1_ps(1.0 / 64.0)));
        let is_large = lanes(_mm256_cmp_ps::<_CMP_GE_OQ>(a, _mm256_set1_ps(448.0)));
        let code = _mm256_blendv_epi8(normal, tiny, is_tiny);
        let code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7E), is_large);
        let code = _mm256_or_si256(code, sign);
        let nan = lanes(_mm256_cmp_ps::<_CMP_UNORD_Q>(q, q));
        _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), nan)
    }

    /// # Safety
    /// AVX2; the lengths [`quantize_row`] checks; `group` a multiple of 8.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_row_avx2(
        kind: CodeKind,
        scale_type: ScaleType,
        global: f32,
        row: &[f32],
        group: usize,
        codes: &mut [u8],
        scales: &mut [u16],
    ) {
        let one_group = |values: &[f32]| {
            let mut largest = _mm256_setzero_ps();
            for v in values.chunks_exact(8) {
                // SAFETY: 8 values; NaN passed over as in [`quantize_row_avx512`].
                largest = unsafe { _mm256_max_ps(abs256(_mm256_loadu_ps(v.as_ptr())), largest) };
            }
            let mut lane = [0f32; 8];
            // SAFETY: 8 floats.
            unsafe { _mm256_storeu_ps(lane.as_mut_ptr(), largest) };
            let amax = lane.iter().fold(0f32, |m, &v| m.max(v));
            group_scale(kind, scale_type, global, amax)
        };
        let rows = RowJob {
            kind,
            scale_type,
            row,
            group,
        };
        rows.run::<8>(
            codes,
            scales,
            // SAFETY: 8 whole groups of whole 8-value steps (the caller's contract).
            |values| unsafe { batch_scales256(kind, scale_type, global, values, group) },
            one_group,
            // SAFETY: AVX2 here.
            |values, scale, out| unsafe { encode_avx2(kind, values, scale, out) },
        );
    }

    /// [`batch_scales`] on 8 groups with AVX2.
    ///
    /// # Safety
    /// AVX2; `values` holds 8 groups of `group` values, `group` a multiple of 8.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn batch_scales256(
        kind: CodeKind,
        scale_type: ScaleType,
        global: f32,
        values: &[f32],
        group: usize,
    ) -> ([u32; 8], [f32; 8], u32) {
        let mut maxima = [_mm256_setzero_ps(); 8];
        for (m, values) in maxima.iter_mut().zip(values.chunks_exact(group)) {
            for v in values.chunks_exact(8) {
                // SAFETY: 8 values; NaN passed over as in [`quantize_row_avx512`].
                *m = unsafe { _mm256_max_ps(abs256(_mm256_loadu_ps(v.as_ptr())), *m) };
            }
        }
        let amax = lane_maxima256(&maxima);
        let wanted = _mm256_div_ps(
            _mm256_div_ps(amax, _mm256_set1_ps(global)),
            _mm256_set1_ps(kind.max()),
        );
        let positive = lanes(_mm256_cmp_ps::<_CMP_GT_OQ>(amax, _mm256_setzero_ps()));
        let (bits, value) = match scale_type {
            ScaleType::E8M0 => {
                let s = _mm256_castps_si256(wanted);
                let exponent =
                    _mm256_and_si256(_mm256_srli_epi32::<23>(s), _mm256_set1_epi32(0xFF));
                let exact = _mm256_cmpeq_epi32(
                    _mm256_and_si256(s, _mm256_set1_epi32(0x7F_FFFF)),
                    _mm256_setzero_si256(),
                );
                // Plus one where a fraction is left: subtract the all-ones of "not exact".
                let up = _mm256_sub_epi32(exponent, _mm256_xor_si256(exact, _mm256_set1_epi32(-1)));
                let up = _mm256_max_epi32(
                    _mm256_min_epi32(up, _mm256_set1_epi32(254)),
                    _mm256_set1_epi32(1),
                );
                let normal = lanes(_mm256_cmp_ps::<_CMP_GE_OQ>(
                    wanted,
                    _mm256_set1_ps(f32::MIN_POSITIVE),
                ));
                let take = _mm256_and_si256(normal, positive);
                let bits = _mm256_blendv_epi8(_mm256_set1_epi32(127), up, take);
                (bits, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(bits)))
            }
            ScaleType::Bf16 => {
                // As in [`batch_scales`].
                let s = _mm256_castps_si256(wanted);
                let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(s), _mm256_set1_epi32(1));
                let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(
                    _mm256_add_epi32(s, _mm256_set1_epi32(0x7FFF)),
                    odd,
                ));
                let bits = _mm256_blendv_epi8(_mm256_set1_epi32(BF16_ONE), rounded, positive);
                (bits, _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bits)))
            }
            _ => {
                let one = _mm256_set1_epi32(CodeKind::E4M3.encode(1.0) as i32);
                let bits = _mm256_blendv_epi8(one, e4m3_256(wanted), positive);
                (bits, e4m3_value256(bits))
            }
        };
        let scale = _mm256_mul_ps(value, _mm256_set1_ps(global));
        let usable = _mm256_and_ps(
            _mm256_cmp_ps::<_CMP_GT_OQ>(scale, _mm256_setzero_ps()),
            _mm256_cmp_ps::<_CMP_LT_OQ>(scale, _mm256_set1_ps(f32::INFINITY)),
        );
        let (mut b, mut v) = ([0u32; 8], [0f32; 8]);
        // SAFETY: 8 lanes into 8 elements each.
        unsafe {
            _mm256_storeu_si256(b.as_mut_ptr() as *mut __m256i, bits);
            _mm256_storeu_ps(v.as_mut_ptr(), scale);
        }
        (b, v, _mm256_movemask_ps(usable) as u32)
    }

    /// As [`lane_maxima`] on 8 vectors: halves, then pairs and single lanes, which leaves
    /// group `L + 2e` at lane `4L + e`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn lane_maxima256(m: &[__m256; 8]) -> __m256 {
        let halves: [__m256; 4] = std::array::from_fn(|i| {
            let (a, b) = (m[2 * i], m[2 * i + 1]);
            _mm256_max_ps(
                _mm256_permute2f128_ps::<0x20>(a, b),
                _mm256_permute2f128_ps::<0x31>(a, b),
            )
        });
        let pairs: [__m256; 2] = std::array::from_fn(|i| {
            let (a, b) = (halves[2 * i], halves[2 * i + 1]);
            _mm256_max_ps(
                _mm256_shuffle_ps::<0b10_00_10_00>(a, b),
                _mm256_shuffle_ps::<0b11_01_11_01>(a, b),
            )
        });
        let (a, b) = (pairs[0], pairs[1]);
        let lanes = _mm256_max_ps(
            _mm256_shuffle_ps::<0b10_00_10_00>(a, b),
            _mm256_shuffle_ps::<0b11_01_11_01>(a, b),
        );
        _mm256_permutevar8x32_ps(lanes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }

    /// As [`e4m3_value512`] on 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn e4m3_value256(bits: __m256i) -> __m256 {
        let exponent = _mm256_and_si256(_mm256_srli_epi32::<3>(bits), _mm256_set1_epi32(0xF));
        let mantissa = _mm256_and_si256(bits, _mm256_set1_epi32(7));
        let normal = _mm256_castsi256_ps(_mm256_or_si256(
            _mm256_slli_epi32::<23>(_mm256_add_epi32(exponent, _mm256_set1_epi32(120))),
            _mm256_slli_epi32::<20>(mantissa),
        ));
        let tiny = _mm256_mul_ps(_mm256_cvtepi32_ps(mantissa), _mm256_set1_ps(1.0 / 512.0));
        let is_tiny = _mm256_cmpeq_epi32(exponent, _mm256_setzero_si256());
        let magnitude = _mm256_blendv_ps(normal, tiny, _mm256_castsi256_ps(is_tiny));
        // The sign bit moved to bit 31.
        let sign = _mm256_slli_epi32::<24>(_mm256_and_si256(bits, _mm256_set1_epi32(0x80)));
        _mm256_or_ps(magnitude, _mm256_castsi256_ps(sign))
    }
}

/// One row for a vector row quantizer: the loop both ISAs share.
#[cfg(target_arch = "x86_64")]
struct RowJob<'a> {
    kind: CodeKind,
    scale_type: ScaleType,
    row: &'a [f32],
    group: usize,
}

#[cfg(target_arch = "x86_64")]
impl RowJob<'_> {
    /// Scales of `N` groups at a time through `batch` (bits, scales, usable mask) where the
    /// scale type is E8M0, E4M3 or bf16, of one group through `one` elsewhere and for the groups
    /// left over; each group's codes through `encode`, or zero's where its scale is unusable.
    #[inline(always)]
    fn run<const N: usize>(
        &self,
        codes: &mut [u8],
        scales: &mut [u16],
        batch: impl Fn(&[f32]) -> ([u32; N], [f32; N], u32),
        one: impl Fn(&[f32]) -> (u16, Option<f32>),
        encode: impl Fn(&[f32], f32, &mut [u8]),
    ) {
        let (kind, group) = (self.kind, self.group);
        let group_bytes = group * kind.bits() / 8;
        // With groups of 16 or 32 values the scalar scale of each group cost as much as
        // encoding its values.
        let batched = if self.scale_type != ScaleType::F16 {
            scales.len() / N * N
        } else {
            0
        };
        for first in (0..batched).step_by(N) {
            let values = &self.row[first * group..(first + N) * group];
            let (bits, scale, usable) = batch(values);
            for g in 0..N {
                scales[first + g] = bits[g] as u16;
                let values = &values[g * group..(g + 1) * group];
                let out = &mut codes[(first + g) * group_bytes..][..group_bytes];
                if usable >> g & 1 == 1 {
                    encode(values, scale[g], out);
                } else {
                    zero_codes(kind, out);
                }
            }
        }
        let groups = self.row[batched * group..]
            .chunks_exact(group)
            .zip(codes[batched * group_bytes..].chunks_exact_mut(group_bytes));
        for ((values, codes), bits) in groups.zip(scales[batched..].iter_mut()) {
            let (b, scale) = one(values);
            *bits = b;
            match scale {
                Some(scale) => encode(values, scale, codes),
                None => zero_codes(kind, codes),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    type Encoder = unsafe fn(CodeKind, &[f32], f32, &mut [u8]);
    type RowQuantizer = unsafe fn(CodeKind, ScaleType, f32, &[f32], usize, &mut [u8], &mut [u16]);

    /// Values that reach every rounding case: random spreads, each kind's codes, ties and
    /// midpoints on both sides, the E4M3 subnormal and saturation edges, zeros of both signs,
    /// infinities and NaNs of both signs.
    fn awkward_values(rng: &mut Rng) -> Vec<f32> {
        let mut v: Vec<f32> = rng.normals(4000, 3.0);
        v.extend(rng.normals(1000, 300.0));
        v.extend(rng.normals(1000, 0.01));
        for i in -80..=80 {
            v.push(i as f32 * 0.125);
        }
        for m in crate::codes::E2M1_MIDPOINTS.iter().chain(&[
            448.0,
            464.0,
            1.0 / 64.0,
            1.0 / 512.0,
            17.0 / 1024.0,
        ]) {
            for x in [*m, m.next_up(), m.next_down()] {
                v.extend([x, -x]);
            }
        }
        v.extend([0.0, -0.0, 1e-30, -1e-40, 7.5, -8.5, 1e9, f32::MAX, f32::MIN]);
        v.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN]);
        v
    }

    fn encoders() -> Vec<(&'static str, Encoder)> {
        let mut list: Vec<(&str, Encoder)> =
            vec![("dispatched", |k, v, s, o| encode_scaled(k, v, s, o))];
        #[cfg(target_arch = "x86_64")]
        {
            if isa::allows(Level::Avx2) {
                list.push(("avx2", x86::encode_avx2));
            }
            if isa::allows(Level::Avx512Base) {
                list.push(("avx512", x86::encode_avx512));
            }
        }
        list
    }

    /// Every variant this CPU has writes the twin's codes for every kind, several scales and
    /// lengths that leave remainders; the twin is `CodeKind::encode` by construction.
    #[test]
    fn every_encoder_writes_the_twins_codes() {
        let mut rng = Rng::new(23);
        let values = awkward_values(&mut rng);
        for kind in [CodeKind::E2M1, CodeKind::Int4, CodeKind::E4M3] {
            for scale in [1.0f32, 0.5, 3.0, 1.0 / 448.0, 1e-3] {
                // Lengths that leave every remainder: odd ones for the byte kind.
                let odd = (kind.bits() == 8) as usize;
                for len in [values.len() / 2 * 2 - 2, 2, 6, 14, 16, 18, 34] {
                    let len = len + odd;
                    let v = &values[values.len() - len..];
                    let bytes = len * kind.bits() / 8;
                    let mut twin = vec![0u8; bytes];
                    encode_scalar(kind, v, scale, &mut twin);
                    for (i, &b) in twin.iter().enumerate() {
                        let code = |at: usize| kind.encode(v[at] / scale);
                        let want = match kind.bits() {
                            8 => code(i),
                            _ => code(2 * i) | (code(2 * i + 1) << 4),
                        };
                        assert_eq!(b, want, "twin {kind:?} byte {i}");
                    }
                    for (name, f) in encoders() {
                        let mut out = vec![0xA5u8; bytes];
                        // SAFETY: the list holds only variants this CPU runs; lengths match.
                        unsafe { f(kind, v, scale, &mut out) };
                        for i in 0..bytes {
                            let at = i * 8 / kind.bits();
                            assert_eq!(
                                out[i], twin[i],
                                "{name} {kind:?} scale {scale} byte {i} of {bytes} (value {})",
                                v[at]
                            );
                        }
                    }
                }
            }
        }
    }

    /// Every row quantizer this CPU has gives the twin's codes and scale bits for every kind,
    /// scale type and group size the formats use, at several magnitudes, with NaN and
    /// infinite values, and an all-zero and a denormal-only group.
    #[test]
    fn every_row_quantizer_matches_the_twin() {
        let mut variants: Vec<(&str, RowQuantizer, usize)> = vec![(
            "dispatched",
            |a, b, c, d, e, f, g| quantize_row(a, b, c, d, e, f, g),
            1,
        )];
        #[cfg(target_arch = "x86_64")]
        {
            if isa::allows(Level::Avx2) {
                variants.push(("avx2", x86::quantize_row_avx2, 8));
            }
            if isa::allows(Level::Avx512Base) {
                variants.push(("avx512", x86::quantize_row_avx512, 16));
            }
        }
        let mut rng = Rng::new(29);
        let cases = [
            (CodeKind::E2M1, ScaleType::E8M0, 1.0, 32),
            (CodeKind::E2M1, ScaleType::E4M3, 0.0123, 16),
            (CodeKind::Int4, ScaleType::Bf16, 1.0, 128),
            (CodeKind::Int4, ScaleType::Bf16, 1.0, 32),
            (CodeKind::Int4, ScaleType::Bf16, 1.0, 16),
            (CodeKind::Int4, ScaleType::F16, 1.0, 64),
            (CodeKind::E4M3, ScaleType::E8M0, 1.0, 32),
            (CodeKind::E4M3, ScaleType::E8M0, 1.0, 8),
            (CodeKind::E4M3, ScaleType::E8M0, 1.0, 4),
        ];
        for (kind, st, global, group) in cases {
            for spread in [1.0f32, 1e-3, 1e4, 1e-38] {
                // 40 groups: two batches of 16 where the scales go 16 at a time, and 8 more.
                let mut row: Vec<f32> = rng.normals(group * 40, spread);
                for batch in [0, 16, 32] {
                    let at = |g: usize| (batch + g) * group;
                    row[at(0) + 3] = f32::NAN;
                    row[at(1) + 5] = f32::INFINITY;
                    row[at(2) + 1] = -f32::INFINITY;
                    row[at(3)..at(4)].fill(0.0);
                    row[at(4)..at(5)].fill(-1e-45);
                    row[at(7)..at(8)].fill(f32::NAN);
                }
                // Every group a different magnitude, so a scale in the wrong lane shows.
                for (g, values) in row.chunks_exact_mut(group).enumerate() {
                    values.iter_mut().for_each(|v| *v *= 1.0 + g as f32 / 8.0);
                }
                // A group whose largest magnitude over the largest code is a power of two
                // (3 / 6 = 0.5 for E2M1): the E8M0 scale must not round it up.
                for batch in [0, 16, 30] {
                    let g9 = &mut row[(batch + 9) * group..(batch + 10) * group];
                    g9.iter_mut().for_each(|v| *v = v.clamp(-1.0, 1.0));
                    g9[1] = -3.0;
                }
                // Groups whose int4 scale (largest / 7) is a bf16 tie: 1 + 2⁻⁸ rounds down to
                // the even 1.0, 1 + 3·2⁻⁸ up to 1 + 2⁻⁶.
                for (g, largest) in [(10, 7.027_343_8), (11, -7.082_031_3)] {
                    let values = &mut row[g * group..(g + 1) * group];
                    values.iter_mut().for_each(|v| *v = v.clamp(-1.0, 1.0));
                    values[2] = largest;
                }
                let groups = row.len() / group;
                let bytes = row.len() * kind.bits() / 8;
                let mut twin = (vec![0u8; bytes], vec![0u16; groups]);
                quantize_row_scalar(kind, st, global, &row, group, &mut twin.0, &mut twin.1);
                for (name, f, lanes) in &variants {
                    if group % lanes != 0 {
                        continue;
                    }
                    let mut out = (vec![0xA5u8; bytes], vec![0xA5A5u16; groups]);
                    // SAFETY: variants this CPU runs, groups of whole steps; lengths match.
                    unsafe { f(kind, st, global, &row, group, &mut out.0, &mut out.1) };
                    assert_eq!(
                        out.1, twin.1,
                        "{name} {kind:?} {st:?} group {group} scales, {spread}"
                    );
                    assert_eq!(
                        out.0, twin.0,
                        "{name} {kind:?} {st:?} group {group} codes, {spread}"
                    );
                }
            }
        }
    }
}
