//! Scalar quantizers: weights (plain round-to-nearest, no search) and activations (the Q8
//! formats the dot products read). Sizes are checked by the callers in `mod.rs`.
//!
//! Weight scales are rounded to their storage precision *before* the values are quantized
//! against them, so each value is the nearest representable one for the scale actually stored.
use super::blocks::*;
use super::dequant::q2_bits;
use super::{ActivationFormat, GgmlType};
use crate::{kt_bail, Result};
use half::{bf16, f16};

/// Quantize a weight row (sizes already checked, `ty` supported).
pub(super) fn weight_row(ty: GgmlType, x: &[f32], out: &mut [u8]) -> Result<()> {
    use GgmlType::*;
    let per_block: fn(&[f32], &mut [u8]) = match ty {
        F32 => |x, b| b.copy_from_slice(&x[0].to_le_bytes()),
        F16 => |x, b| b.copy_from_slice(&f16::from_f32(x[0]).to_bits().to_le_bytes()),
        BF16 => |x, b| b.copy_from_slice(&bf16::from_f32(x[0]).to_bits().to_le_bytes()),
        Q4_0 => q4_0,
        Q4_1 => q4_1,
        Q5_0 => q5_0,
        Q5_1 => q5_1,
        Q8_0 => q8_0,
        Q2_K => q2_k,
        Q3_K => q3_k,
        Q4_K => q4_k,
        Q5_K => q5_k,
        Q6_K => q6_k,
        IQ4_NL => iq4_nl,
        IQ4_XS => iq4_xs,
        other => return Err(super::unsupported(other, "quantizer")),
    };
    if ty.block_size() > 1 {
        if let Some(i) = x.iter().position(|v| !v.is_finite()) {
            kt_bail!(
                Invalid,
                "cannot quantize to {}: value {i} is {} (only finite values have a {} code)",
                ty.name(),
                x[i],
                ty.name()
            );
        }
        // Block scales are fp16: beyond its range they would become inf and decode to NaN.
        // (Conservative for the types whose codes reach above 1; real weights are far below.)
        if let Some(i) = x.iter().position(|v| v.abs() > f16::MAX.to_f32()) {
            kt_bail!(
                Invalid,
                "cannot quantize to {}: value {i} is {}, beyond the fp16 range ({}) of its block \
                 scales",
                ty.name(),
                x[i],
                f16::MAX
            );
        }
    }
    for (xs, b) in x
        .chunks_exact(ty.block_size())
        .zip(out.chunks_exact_mut(ty.type_size()))
    {
        b.fill(0);
        per_block(xs, b);
    }
    Ok(())
}

/// The value of largest magnitude, sign kept (the first one on ties); 0 for an empty slice.
#[inline(always)]
fn signed_absmax(x: &[f32]) -> f32 {
    // The first value of largest magnitude (as a strict-greater scan finds it), in two passes
    // that vectorise: the magnitude, then where it first occurs.
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 || amax.is_nan() {
        return 0.0;
    }
    x.iter().copied().find(|v| v.abs() == amax).unwrap_or(0.0)
}

/// 1/d, or 0 for d = 0 (a block of zeros quantizes to the zero code).
fn inverse(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

/// `round_half_even(v)` clamped to `[lo, hi]`.
#[inline(always)]
fn code(v: f32, lo: i32, hi: i32) -> i32 {
    (rne(v) as i32).clamp(lo, hi)
}

/// `v` rounded half to even like `f32::round_ties_even`, with plain arithmetic (on baseline
/// x86-64 that is a libm call, which dominated activation quantization). Exact for
/// |v| < 2^22; larger values come back unchanged, and every caller clamps to a range far
/// below that, where both saturate alike. NaN stays NaN.
#[inline(always)]
fn rne(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23
    if v.abs() < 4_194_304.0 {
        (v + MAGIC) - MAGIC
    } else {
        v
    }
}

/// The f64 form of [`rne`], exact for |v| < 2^51.
#[inline(always)]
fn rne64(v: f64) -> f64 {
    const MAGIC: f64 = 6_755_399_441_055_744.0; // 1.5 · 2^52
    if v.abs() < 2_251_799_813_685_248.0 {
        (v + MAGIC) - MAGIC
    } else {
        v
    }
}

/// Pack 32 four-bit values into 16 bytes (value j low nibble, value j+16 high nibble).
fn put_nibbles32(q: &[u8; 32], qs: &mut [u8]) {
    for j in 0..16 {
        qs[j] = (q[j] & 0x0F) | (q[j + 16] << 4);
    }
}

/// Symmetric block: `d = m / −half` (m = value of largest magnitude), `q = round(x/d) + half`,
/// in `[0, 2·half − 1]`. Returns the codes and stores d at `b[0..2]`.
fn symmetric32(x: &[f32], b: &mut [u8], half: i32) -> [u8; 32] {
    let d = put_f16(b, 0, signed_absmax(x) / -(half as f32));
    let id = inverse(d);
    let mut q = [0u8; 32];
    for (c, &v) in q.iter_mut().zip(x) {
        *c = code(v * id + half as f32, 0, 2 * half - 1) as u8;
    }
    q
}

/// Affine block: `d = (max − min) / levels`, `m = min`, `q = round((x − m)/d)` in
/// `[0, levels]`. Stores d at `b[0..2]` and m at `b[2..4]`.
fn affine32(x: &[f32], b: &mut [u8], levels: i32) -> [u8; 32] {
    let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let d = put_f16(b, 0, (hi - lo) / levels as f32);
    let m = put_f16(b, 2, lo);
    let id = inverse(d);
    let mut q = [0u8; 32];
    for (c, &v) in q.iter_mut().zip(x) {
        *c = code((v - m) * id, 0, levels) as u8;
    }
    q
}

fn q4_0(x: &[f32], b: &mut [u8]) {
    let q = symmetric32(x, b, 8);
    put_nibbles32(&q, &mut b[2..18]);
}

fn q4_1(x: &[f32], b: &mut [u8]) {
    let q = affine32(x, b, 15);
    put_nibbles32(&q, &mut b[4..20]);
}

/// Store 32 five-bit codes: fifth bits as a u32 at `qh_at`, nibbles at `qs_at`.
fn put_fives32(q: &[u8; 32], b: &mut [u8], qh_at: usize, qs_at: usize) {
    let mut qh = 0u32;
    let mut low = [0u8; 32];
    for (j, &c) in q.iter().enumerate() {
        qh |= ((c >> 4) as u32 & 1) << j;
        low[j] = c & 0x0F;
    }
    b[qh_at..qh_at + 4].copy_from_slice(&qh.to_le_bytes());
    put_nibbles32(&low, &mut b[qs_at..qs_at + 16]);
}

fn q5_0(x: &[f32], b: &mut [u8]) {
    let q = symmetric32(x, b, 16);
    put_fives32(&q, b, 2, 6);
}

fn q5_1(x: &[f32], b: &mut [u8]) {
    let q = affine32(x, b, 31);
    put_fives32(&q, b, 4, 8);
}

fn q8_0(x: &[f32], b: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = put_f16(b, 0, amax / 127.0);
    let id = inverse(d);
    for (o, &v) in b[2..34].iter_mut().zip(x) {
        *o = code(v * id, -127, 127) as i8 as u8;
    }
}

/// Index of the IQ4 table entry nearest to `v` (the lower one on ties).
fn nearest_iq4(v: f32) -> u8 {
    let distance = |i: usize| (IQ4_TABLE[i] as f32 - v).abs();
    (1..16).fold(0, |best, i| {
        if distance(i) < distance(best) {
            i
        } else {
            best
        }
    }) as u8
}

/// Nearest IQ4 codes of `x` for the (already stored) scale `d`.
fn iq4_codes(x: &[f32], d: f32) -> [u8; 32] {
    let id = inverse(d);
    let mut q = [0u8; 32];
    for (c, &v) in q.iter_mut().zip(x) {
        *c = nearest_iq4(v * id);
    }
    q
}

fn iq4_nl(x: &[f32], b: &mut [u8]) {
    // The value of largest magnitude maps onto the table's −127 end.
    let d = put_f16(b, 0, signed_absmax(x) / -127.0);
    put_nibbles32(&iq4_codes(x, d), &mut b[2..18]);
}

/// Affine sub-blocks of a Q2_K/Q4_K/Q5_K super-block: per sub-block of `len` values a scale
/// `(max − min)/levels` and a minimum `−min ≥ 0` (the minimum is clamped to ≤ 0 because the
/// format subtracts it). Both are coded on `code_levels` steps of the super-block scales
/// `d`, `dmin`. Returns (d, dmin, scale codes, min codes).
fn affine_sub_blocks(
    x: &[f32],
    len: usize,
    levels: f32,
    code_levels: f32,
) -> (f32, f32, Vec<u8>, Vec<u8>) {
    let (mut scales, mut mins) = (Vec::new(), Vec::new());
    for xs in x.chunks_exact(len) {
        let lo = xs.iter().copied().fold(0.0f32, f32::min);
        let hi = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        scales.push((hi - lo) / levels);
        mins.push(-lo);
    }
    let d = round_f16(scales.iter().copied().fold(0.0, f32::max) / code_levels);
    let dmin = round_f16(mins.iter().copied().fold(0.0, f32::max) / code_levels);
    let top = code_levels as i32;
    let sc = scales
        .iter()
        .map(|s| code(s * inverse(d), 0, top) as u8)
        .collect();
    let mn = mins
        .iter()
        .map(|m| code(m * inverse(dmin), 0, top) as u8)
        .collect();
    (d, dmin, sc, mn)
}

/// `q = round((x + dmin·m)/(d·s))` in `[0, levels]` for one affine sub-block.
fn affine_codes(xs: &[f32], d: f32, s: u8, dmin: f32, m: u8, levels: i32, q: &mut [u8]) {
    let dl = d * s as f32;
    let ml = dmin * m as f32;
    let idl = inverse(dl);
    for (c, &v) in q.iter_mut().zip(xs) {
        *c = code((v + ml) * idl, 0, levels) as u8;
    }
}

fn q2_k(x: &[f32], b: &mut [u8]) {
    let (d, dmin, sc, mn) = affine_sub_blocks(x, 16, 3.0, 15.0);
    put_f16(b, 80, d);
    put_f16(b, 82, dmin);
    let mut q = [0u8; QK_K];
    for sub in 0..16 {
        b[sub] = sc[sub] | (mn[sub] << 4);
        let r = sub * 16..sub * 16 + 16;
        affine_codes(&x[r.clone()], d, sc[sub], dmin, mn[sub], 3, &mut q[r]);
    }
    put_q2_bits(&q, &mut b[16..80]);
}

/// Inverse of `dequant::q2_bits` for a whole block of 2-bit values.
fn put_q2_bits(q: &[u8; QK_K], qs: &mut [u8]) {
    for (e, &c) in q.iter().enumerate() {
        qs[32 * (e / 128) + e % 32] |= (c & 3) << (2 * ((e % 128) / 32));
    }
    debug_assert!((0..QK_K).all(|e| q2_bits(qs, e) == q[e] & 3));
}

/// Symmetric sub-blocks of a Q3_K/Q6_K/IQ4_XS super-block: per sub-block a signed scale
/// `m / −half` (m = value of largest magnitude) and the super-block scale `d` that maps the
/// scale of largest magnitude to `−code_half`; codes in `[−code_half, code_half − 1]`.
fn symmetric_sub_blocks(x: &[f32], len: usize, half: f32, code_half: i32) -> (f32, Vec<i32>) {
    let scales: Vec<f32> = x
        .chunks_exact(len)
        .map(|xs| signed_absmax(xs) / -half)
        .collect();
    let d = round_f16(signed_absmax(&scales) / -(code_half as f32));
    let id = inverse(d);
    let codes = scales
        .iter()
        .map(|s| code(s * id, -code_half, code_half - 1))
        .collect();
    (d, codes)
}

fn q3_k(x: &[f32], b: &mut [u8]) {
    let (d, codes) = symmetric_sub_blocks(x, 16, 4.0, 32);
    put_f16(b, 108, d);
    let mut packed_codes = [0u8; 16];
    let mut low = [0u8; QK_K];
    for (sub, &c) in codes.iter().enumerate() {
        packed_codes[sub] = (c + 32) as u8;
        let idl = inverse(d * c as f32);
        for l in 0..16 {
            let e = sub * 16 + l;
            let u = (code(x[e] * idl, -4, 3) + 4) as u8; // 0..8; the high bit means "no −4"
            low[e] = u & 3;
            b[e % 32] |= (u >> 2) << (e / 32);
        }
    }
    b[96..108].copy_from_slice(&pack_q3_k_scales(&packed_codes));
    put_q2_bits(&low, &mut b[32..96]);
}

fn q4_k(x: &[f32], b: &mut [u8]) {
    k_affine(x, b, 15, 16);
}

fn q5_k(x: &[f32], b: &mut [u8]) {
    k_affine(x, b, 31, 48);
}

/// Q4_K (levels 15) / Q5_K (levels 31, fifth bits at 16..48): 8 affine sub-blocks of 32 with
/// 6-bit scale and min codes; nibbles at `qs_at`.
fn k_affine(x: &[f32], b: &mut [u8], levels: i32, qs_at: usize) {
    let (d, dmin, sc, mn) = affine_sub_blocks(x, 32, levels as f32, 63.0);
    put_f16(b, 0, d);
    put_f16(b, 2, dmin);
    let sc: [u8; 8] = sc.try_into().unwrap_or([0; 8]);
    let mn: [u8; 8] = mn.try_into().unwrap_or([0; 8]);
    b[4..16].copy_from_slice(&pack_k4_scales(&sc, &mn));
    let mut q = [0u8; 32];
    for sub in 0..8 {
        affine_codes(
            &x[sub * 32..][..32],
            d,
            sc[sub],
            dmin,
            mn[sub],
            levels,
            &mut q,
        );
        let chunk = qs_at + 32 * (sub / 2);
        for (l, &c) in q.iter().enumerate() {
            b[chunk + l] |= (c & 0x0F) << (4 * (sub % 2));
            if levels > 15 {
                b[16 + l] |= (c >> 4) << sub;
            }
        }
    }
}

fn q6_k(x: &[f32], b: &mut [u8]) {
    let (d, codes) = symmetric_sub_blocks(x, 16, 32.0, 128);
    put_f16(b, 208, d);
    for (sub, &c) in codes.iter().enumerate() {
        b[192 + sub] = c as i8 as u8;
        let idl = inverse(d * c as f32);
        for l in 0..16 {
            let e = sub * 16 + l;
            let u = (code(x[e] * idl, -32, 31) + 32) as u8;
            let (h, r) = (e / 128, e % 128);
            b[64 * h + r % 64] |= (u & 0x0F) << (4 * (r / 64));
            b[128 + 32 * h + r % 32] |= (u >> 4) << (2 * (r / 32));
        }
    }
}

fn iq4_xs(x: &[f32], b: &mut [u8]) {
    let (d, codes) = symmetric_sub_blocks(x, 32, 127.0, 32);
    put_f16(b, 0, d);
    let mut packed_codes = [0u8; 8];
    for (sub, &c) in codes.iter().enumerate() {
        packed_codes[sub] = (c + 32) as u8;
        let q = iq4_codes(&x[sub * 32..][..32], d * c as f32);
        put_nibbles32(&q, &mut b[8 + 16 * sub..][..16]);
    }
    pack_iq4_xs_scales(&packed_codes, b);
}

/// Quantize an activation row (sizes already checked).
pub(super) fn activation_row(format: ActivationFormat, x: &[f32], out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::allows(crate::isa::Level::Avx2) {
        // SAFETY: the process's ISA level includes AVX2.
        return unsafe { activation_row_avx2(format, x, out) };
    }
    activation_row_body(format, x, out)
}

/// [`activation_row`] compiled for AVX2: the same code (no contraction into FMA), vectorised.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn activation_row_avx2(format: ActivationFormat, x: &[f32], out: &mut [u8]) {
    if format == ActivationFormat::Q8_K {
        // The compiler leaves this one scalar (f64 products): written out it is ~4x faster.
        for (xs, b) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(Q8_K_BYTES)) {
            // SAFETY: AVX2 (this function's contract); whole blocks.
            unsafe { q8_k_avx2::block(xs, b) };
        }
        return;
    }
    if format == ActivationFormat::Q8_0 {
        // Vectorised by hand too: 5% of a Q8_0 prefill layer as the compiler left it.
        for (xs, b) in x.chunks_exact(QK).zip(out.chunks_exact_mut(Q8_0_BYTES)) {
            // SAFETY: AVX2 (this function's contract); whole blocks.
            unsafe { q8_0_avx2_block(xs, b) };
        }
        return;
    }
    activation_row_body(format, x, out)
}

/// One Q8_0 activation block (32 values into 34 bytes), equal byte for byte to
/// [`activation_row_body`]'s: `cvtps2dq` rounds half to even like [`rne`]; blocks with a
/// non-finite value or an infinite `127/amax` take the scalar path.
///
/// # Safety
/// AVX2 available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn q8_0_avx2_block(x: &[f32], b: &mut [u8]) {
    use std::arch::x86_64::*;
    assert!(x.len() == QK && b.len() == Q8_0_BYTES);
    let p = x.as_ptr();
    // SAFETY: 32 readable values at p; 34 writable bytes at b (asserted).
    unsafe {
        let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let inf = _mm256_set1_ps(f32::INFINITY);
        // (Plain arrays, no closures: a closure here stays out of line without the features.)
        let mut v = [_mm256_setzero_ps(); 4];
        for (i, vi) in v.iter_mut().enumerate() {
            *vi = _mm256_loadu_ps(p.add(8 * i));
        }
        let mut amax = _mm256_setzero_ps();
        let mut bad = _mm256_setzero_ps();
        for &vi in &v {
            let a = _mm256_and_ps(vi, magnitude);
            amax = _mm256_max_ps(amax, a);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps::<_CMP_NLT_UQ>(a, inf));
        }
        let half = _mm_max_ps(
            _mm256_castps256_ps128(amax),
            _mm256_extractf128_ps::<1>(amax),
        );
        let half = _mm_max_ps(half, _mm_movehl_ps(half, half));
        let amax = _mm_cvtss_f32(_mm_max_ss(half, _mm_shuffle_ps::<1>(half, half)));
        let id = if amax == 0.0 { 0.0 } else { 127.0 / amax };
        if _mm256_movemask_ps(bad) != 0 || !id.is_finite() {
            return activation_row_body(ActivationFormat::Q8_0, x, b);
        }
        let id = _mm256_set1_ps(id);
        let (lo, hi) = (_mm256_set1_epi32(-127), _mm256_set1_epi32(127));
        let mut q = [_mm256_setzero_si256(); 4];
        for (qi, &vi) in q.iter_mut().zip(&v) {
            let c = _mm256_cvtps_epi32(_mm256_mul_ps(vi, id));
            *qi = _mm256_min_epi32(_mm256_max_epi32(c, lo), hi);
        }
        // packs work per 128-bit lane: dwords come out as a0-3 b0-3 c0-3 d0-3 | a4-7 ...
        let words = _mm256_packs_epi16(
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        let bytes = _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(b.as_mut_ptr().add(2) as *mut __m256i, bytes);
        put_f16(b, 0, amax / 127.0);
    }
}

/// [`q8_k_block`] in AVX2 intrinsics, equal to it byte for byte.
#[cfg(target_arch = "x86_64")]
mod q8_k_avx2 {
    use super::{q8_k_block, QK_K};
    use crate::ggml::blocks::Q8_K_BYTES;
    use std::arch::x86_64::*;

    /// One Q8_K block of `x` (256 values) into `b` (292 bytes).
    ///
    /// # Safety
    /// AVX2 available.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn block(x: &[f32], b: &mut [u8]) {
        assert!(x.len() == QK_K && b.len() == Q8_K_BYTES);
        let p = x.as_ptr();
        // SAFETY: 256 readable values at p; 292 writable bytes at b (asserted).
        unsafe {
            let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
            let inf = _mm256_set1_ps(f32::INFINITY);
            let mut amax = _mm256_setzero_ps();
            let mut bad = _mm256_setzero_ps();
            for i in (0..QK_K).step_by(8) {
                let a = _mm256_and_ps(_mm256_loadu_ps(p.add(i)), magnitude);
                amax = _mm256_max_ps(amax, a);
                // |v| ≥ ∞ or unordered (NaN).
                bad = _mm256_or_ps(bad, _mm256_cmp_ps::<_CMP_NLT_UQ>(a, inf));
            }
            if _mm256_movemask_ps(bad) != 0 {
                return q8_k_block(x, b); // NaN block: the twin's rare path
            }
            let half = _mm_max_ps(
                _mm256_castps256_ps128(amax),
                _mm256_extractf128_ps::<1>(amax),
            );
            let half = _mm_max_ps(half, _mm_movehl_ps(half, half));
            let amax = _mm_cvtss_f32(_mm_max_ss(half, _mm_shuffle_ps::<1>(half, half)));
            if amax == 0.0 {
                b.fill(0);
                return;
            }
            // The first value of largest magnitude, sign kept (as `signed_absmax`).
            let target = _mm256_set1_ps(amax);
            let mut m = 0.0;
            for i in (0..QK_K).step_by(8) {
                let v = _mm256_loadu_ps(p.add(i));
                let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(
                    _mm256_and_ps(v, magnitude),
                    target,
                ));
                if hit != 0 {
                    m = x[i + hit.trailing_zeros() as usize];
                    break;
                }
            }
            let iscale = -127.0 / m;
            if !iscale.is_finite() {
                return q8_k_block(x, b); // subnormal extreme: 0 · ∞ codes, the twin's path
            }
            b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
            let scale = _mm256_set1_pd(iscale as f64);
            let (lo, hi) = (_mm256_set1_pd(-127.0), _mm256_set1_pd(127.0));
            // Four values as i32: the exact f64 product rounded half to even, clamped.
            let codes4 = |v: __m128| {
                let r = _mm256_round_pd::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm256_mul_pd(_mm256_cvtps_pd(v), scale),
                );
                _mm256_cvtpd_epi32(_mm256_min_pd(_mm256_max_pd(r, lo), hi))
            };
            let ones = _mm_set1_epi16(1);
            let q = b.as_mut_ptr();
            for j in 0..QK_K / 16 {
                let v0 = _mm256_loadu_ps(p.add(16 * j));
                let v1 = _mm256_loadu_ps(p.add(16 * j + 8));
                let w0 = _mm_packs_epi32(
                    codes4(_mm256_castps256_ps128(v0)),
                    codes4(_mm256_extractf128_ps::<1>(v0)),
                );
                let w1 = _mm_packs_epi32(
                    codes4(_mm256_castps256_ps128(v1)),
                    codes4(_mm256_extractf128_ps::<1>(v1)),
                );
                _mm_storeu_si128(q.add(4 + 16 * j) as *mut __m128i, _mm_packs_epi16(w0, w1));
                // Σ of the 16 codes (|Σ| ≤ 2032) as i16.
                let s = _mm_madd_epi16(_mm_add_epi16(w0, w1), ones);
                let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
                let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
                let sum = _mm_cvtsi128_si32(s) as i16;
                b[260 + 2 * j..262 + 2 * j].copy_from_slice(&sum.to_le_bytes());
            }
        }
    }
}

#[inline(always)]
fn activation_row_body(format: ActivationFormat, x: &[f32], out: &mut [u8]) {
    match format {
        ActivationFormat::F32 => {
            for (b, v) in out.chunks_exact_mut(4).zip(x) {
                b.copy_from_slice(&v.to_le_bytes());
            }
        }
        ActivationFormat::Q8_0 => {
            for (xs, b) in x.chunks_exact(QK).zip(out.chunks_exact_mut(Q8_0_BYTES)) {
                let (d, _) = q8_block(xs, &mut b[2..34]);
                put_f16(b, 0, d);
            }
        }
        ActivationFormat::Q8_1 => {
            for (xs, b) in x.chunks_exact(QK).zip(out.chunks_exact_mut(Q8_1_BYTES)) {
                let (d, sum) = q8_block(xs, &mut b[4..36]);
                put_f16(b, 0, d);
                put_f16(b, 2, d * sum as f32);
            }
        }
        ActivationFormat::Q8_K => {
            for (xs, b) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(Q8_K_BYTES)) {
                q8_k_block(xs, b);
            }
        }
    }
}

/// One Q8_0/Q8_1 block: `d = amax/127`, `q = round_half_even(x · (127/amax))` (product rounded
/// to f32). Returns (d, Σq); a block with a non-finite value gets d = NaN and zero codes.
#[inline(always)]
fn q8_block(x: &[f32], qs: &mut [u8]) -> (f32, i32) {
    if x.iter().any(|v| !v.is_finite()) {
        qs.fill(0);
        return (f32::NAN, 0);
    }
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let id = if amax == 0.0 { 0.0 } else { 127.0 / amax };
    let mut sum = 0;
    for (o, &v) in qs.iter_mut().zip(x) {
        let q = code(v * id, -127, 127);
        sum += q;
        *o = q as i8 as u8;
    }
    (amax / 127.0, sum)
}

/// One Q8_K block. The value of largest magnitude m (sign kept) maps to −127:
/// `q = round_half_even(x · (−127/m))` on the exact product (computed in f64, where the
/// product of two f32 is exact), `d = 1/(−127/m)`.
#[inline(always)]
fn q8_k_block(x: &[f32], b: &mut [u8]) {
    b.fill(0);
    if x.iter().any(|v| !v.is_finite()) {
        b[0..4].copy_from_slice(&f32::NAN.to_le_bytes());
        return;
    }
    let m = signed_absmax(x);
    if m == 0.0 {
        return; // d = 0, all codes 0, all sums 0
    }
    let iscale = -127.0 / m;
    b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    for (j, xs) in x.chunks_exact(16).enumerate() {
        let mut sum = 0i32;
        for (l, &v) in xs.iter().enumerate() {
            let q = (rne64(iscale as f64 * v as f64) as i32).clamp(-127, 127);
            sum += q;
            b[4 + 16 * j + l] = q as i8 as u8;
        }
        b[260 + 2 * j..262 + 2 * j].copy_from_slice(&(sum as i16).to_le_bytes());
    }
}

#[cfg(test)]
mod rounding_tests {
    /// Blocks of `n` values for the activation quantizers' twin tests: normals at four scales,
    /// zeros, a NaN, +Inf and −Inf block, subnormals, random bit patterns (NaN, ±Inf,
    /// subnormals, huge values), random finite bits, and exact ties m·(j + ½)/127 around
    /// random extremes m.
    fn twin_blocks(rng: &mut crate::rng::Rng, n: usize) -> Vec<Vec<f32>> {
        let mut blocks: Vec<Vec<f32>> = (0..400)
            .map(|i| rng.normals(n, [1.0, 1e-3, 300.0, 1e-30][i % 4]))
            .collect();
        blocks.push(vec![0.0; n]);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut b = rng.normals(n, 1.0);
            b[n * 3 / 4] = bad;
            blocks.push(b);
        }
        blocks.push((0..n).map(|i| (i as f32 - 10.0) * 1e-42).collect());
        for kind in 0..3000 {
            let m = rng.normal() * 10f32.powi(rng.below(60) as i32 - 30);
            blocks.push(
                (0..n)
                    .map(|i| match kind % 3 {
                        0 => f32::from_bits(rng.next_u64() as u32),
                        1 => f32::from_bits(rng.next_u64() as u32 & 0xBFFF_FFFF),
                        _ if i == 0 => m,
                        _ => m * (rng.below(254) as f32 - 127.0 + 0.5) / 127.0,
                    })
                    .collect(),
            );
        }
        blocks
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn q8_k_avx2_equals_the_scalar_twin() {
        use super::{q8_k_avx2, q8_k_block, QK_K};
        use crate::ggml::blocks::Q8_K_BYTES;
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        let mut rng = crate::rng::Rng::new(61);
        let mut blocks = twin_blocks(&mut rng, QK_K);
        // Exact ties (multiples of m/254), an extreme that repeats with the other sign first.
        let m = 3.0f32;
        blocks.push((0..QK_K).map(|i| m * (i as f32 - 128.0) / 254.0).collect());
        blocks.push((0..QK_K).map(|i| -m * (i as f32 % 255.0) / 254.0).collect());
        let mut b = rng.normals(QK_K, 1.0);
        b[7] = -5.0;
        b[3] = 5.0;
        blocks.push(b);
        for (n, x) in blocks.iter().enumerate() {
            let (mut want, mut got) = ([0xAAu8; Q8_K_BYTES], [0x55u8; Q8_K_BYTES]);
            q8_k_block(x, &mut want);
            // SAFETY: AVX2 detected above.
            unsafe { q8_k_avx2::block(x, &mut got) };
            assert_eq!(want[..], got[..], "block {n}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn q8_0_avx2_equals_the_scalar_twin() {
        use super::{activation_row_body, q8_0_avx2_block, ActivationFormat, QK};
        use crate::ggml::blocks::Q8_0_BYTES;
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        let mut rng = crate::rng::Rng::new(62);
        // (The tiny extremes of `twin_blocks` make 127/amax infinite: the scalar path.)
        let mut blocks = twin_blocks(&mut rng, QK);
        let m = 3.0f32;
        blocks.push((0..QK).map(|i| m * (i as f32 - 16.0) / 254.0).collect());
        for (n, x) in blocks.iter().enumerate() {
            let (mut want, mut got) = ([0xAAu8; Q8_0_BYTES], [0x55u8; Q8_0_BYTES]);
            activation_row_body(ActivationFormat::Q8_0, x, &mut want);
            // SAFETY: AVX2 detected above.
            unsafe { q8_0_avx2_block(x, &mut got) };
            assert_eq!(want[..], got[..], "block {n}");
        }
    }

    #[test]
    fn plain_rounding_equals_round_ties_even() {
        let mut rng = crate::rng::Rng::new(6);
        // Equal as the integers the callers convert them to (−0.0 and +0.0 both give 0).
        let check = |v: f32| {
            if v.abs() < 4_194_304.0 {
                assert_eq!(super::rne(v) as i32, v.round_ties_even() as i32, "{v}");
            }
            let w = v as f64 * 0.37;
            assert_eq!(super::rne64(w) as i64, w.round_ties_even() as i64, "{w}");
        };
        for i in -2000..2000 {
            check(i as f32 * 0.25);
        }
        for _ in 0..100_000 {
            check(rng.normal() * 300.0);
        }
        for v in [
            0.5f32,
            1.5,
            2.5,
            -0.5,
            -1.5,
            126.5,
            -127.5,
            4_194_303.5,
            1e30,
            -1e30,
        ] {
            check(v);
        }
        assert!(super::rne(f32::NAN).is_nan() && super::rne64(f64::NAN).is_nan());
        assert_eq!(super::code(1e30, -127, 127), 127);
        assert_eq!(super::code(-1e30, -127, 127), -127);
        assert_eq!(super::code(f32::NAN, -127, 127), 0);
    }
}
