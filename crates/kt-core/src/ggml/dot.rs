//! Scalar dot products of one weight row with one quantized activation row: the twins every SIMD
//! kernel must equal bit for bit.
//!
//! Shape of every quantized twin: exact integer sums inside a block (or super-block), then one
//! f32 term per block from the `*_term` functions below, added to an f32 accumulator in block
//! order. The SIMD kernels vectorise only the integer part and call the same term functions in
//! the same order, which is what makes them exact. Sizes are checked by `DotKernel`.
use super::blocks::*;
use super::dequant::{fives32, nibbles32, q2_bits, q3_value, q6_value, qh_at};
use super::{GgmlType, RawDotFn};

/// Term of a symmetric 32-value block: `(d_w · d_a) · Σ q_w q_a`.
#[inline(always)]
pub(super) fn legacy_term(dw: f32, da: f32, isum: i32) -> f32 {
    (dw * da) * isum as f32
}

/// Term of an affine 32-value block (Q4_1/Q5_1 × Q8_1): `(d_w · d_a) · Σ q_w q_a + m_w · s_a`.
#[inline(always)]
pub(super) fn affine_term(dw: f32, da: f32, isum: i32, mw: f32, sa: f32) -> f32 {
    (dw * da) * isum as f32 + mw * sa
}

/// Term of a K super-block without minima: `(d_w · d_a) · Σ_sub scale · Σ q_w q_a`.
#[inline(always)]
pub(super) fn k_term(dw: f32, da: f32, sumi: i32) -> f32 {
    (dw * da) * sumi as f32
}

/// Term of a K super-block with minima: the scaled sum minus `(dmin_w · d_a) · Σ_sub min · Σ q_a`.
#[inline(always)]
pub(super) fn k_min_term(dw: f32, dmin: f32, da: f32, sumi: i32, summs: i32) -> f32 {
    (dw * da) * sumi as f32 - (dmin * da) * summs as f32
}

/// `Σ_j min_j · (bsums[2j] + bsums[2j+1])` for Q4_K/Q5_K (sub-blocks of 32 values).
#[inline(always)]
pub(super) fn k4_min_sum(mn: &[u8; 8], bsums: &[i32; 16]) -> i32 {
    (0..8)
        .map(|j| mn[j] as i32 * (bsums[2 * j] + bsums[2 * j + 1]))
        .sum()
}

/// `32 · Σ_j scale_j · bsums[j]`: what the 6-bit offset removes from a Q6_K super-block.
#[inline(always)]
pub(super) fn q6_k_offset(scales: &[u8], bsums: &[i32; 16]) -> i32 {
    32 * (0..16)
        .map(|j| (scales[j] as i8) as i32 * bsums[j])
        .sum::<i32>()
}

/// The scalar twin for `ty`, if it has one.
pub(super) fn scalar_fn(ty: GgmlType) -> Option<RawDotFn> {
    use GgmlType::*;
    Some(match ty {
        F32 => f32_dot,
        F16 => f16_dot,
        BF16 => bf16_dot,
        Q4_0 => q4_0,
        Q4_1 => q4_1,
        Q5_0 => q5_0,
        Q5_1 => q5_1,
        Q8_0 => q8_0,
        IQ4_NL => iq4_nl,
        Q2_K => q2_k,
        Q3_K => q3_k,
        Q4_K => q4_k,
        Q5_K => q5_k,
        Q6_K => q6_k,
        IQ4_XS => iq4_xs,
        _ => return None,
    })
}

fn float_dot(w: &[u8], a: &[u8], width: usize, value: fn(&[u8], usize) -> f32) -> f32 {
    let mut acc = 0.0f32;
    for (wb, ab) in w.chunks_exact(width).zip(a.chunks_exact(4)) {
        acc += value(wb, 0) * f32_at(ab, 0);
    }
    acc
}

fn f32_dot(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    float_dot(w, a, 4, f32_at)
}

fn f16_dot(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    float_dot(w, a, 2, f16_at)
}

fn bf16_dot(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    float_dot(w, a, 2, bf16_at)
}

/// Σ over blocks of `legacy_term` with the weight values given by `values(block)`.
#[inline(always)]
fn symmetric_blocks(w: &[u8], a: &[u8], width: usize, values: impl Fn(&[u8]) -> [i32; 32]) -> f32 {
    let mut acc = 0.0f32;
    for (wb, ab) in w.chunks_exact(width).zip(a.chunks_exact(Q8_0_BYTES)) {
        let isum: i32 = values(wb)
            .iter()
            .zip(&ab[2..34])
            .map(|(&q, &x)| q * (x as i8) as i32)
            .sum();
        acc += legacy_term(f16_at(wb, 0), f16_at(ab, 0), isum);
    }
    acc
}

fn q4_0(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    symmetric_blocks(w, a, Q4_0_BYTES, |b| {
        nibbles32(&b[2..18]).map(|q| q as i32 - 8)
    })
}

fn q5_0(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    symmetric_blocks(w, a, Q5_0_BYTES, |b| {
        fives32(qh_at(b, 2), &b[6..22]).map(|q| q as i32 - 16)
    })
}

fn q8_0(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    symmetric_blocks(w, a, Q8_0_BYTES, |b| {
        std::array::from_fn(|i| (b[2 + i] as i8) as i32)
    })
}

fn iq4_nl(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    symmetric_blocks(w, a, IQ4_NL_BYTES, |b| {
        nibbles32(&b[2..18]).map(|q| IQ4_TABLE[q as usize] as i32)
    })
}

/// Σ over blocks of `affine_term` (Q4_1/Q5_1 weights, Q8_1 activations).
#[inline(always)]
fn affine_blocks(w: &[u8], a: &[u8], width: usize, values: impl Fn(&[u8]) -> [u8; 32]) -> f32 {
    let mut acc = 0.0f32;
    for (wb, ab) in w.chunks_exact(width).zip(a.chunks_exact(Q8_1_BYTES)) {
        let isum: i32 = values(wb)
            .iter()
            .zip(&ab[4..36])
            .map(|(&q, &x)| q as i32 * (x as i8) as i32)
            .sum();
        acc += affine_term(
            f16_at(wb, 0),
            f16_at(ab, 0),
            isum,
            f16_at(wb, 2),
            f16_at(ab, 2),
        );
    }
    acc
}

fn q4_1(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    affine_blocks(w, a, Q4_1_BYTES, |b| nibbles32(&b[4..20]))
}

fn q5_1(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    affine_blocks(w, a, Q5_1_BYTES, |b| fives32(qh_at(b, 4), &b[8..24]))
}

/// Activation value `e` of a Q8_K block.
#[inline(always)]
fn q8k(ab: &[u8], e: usize) -> i32 {
    (ab[4 + e] as i8) as i32
}

/// Σ over super-blocks of `term(weight block, activation block)`.
#[inline(always)]
fn super_blocks(w: &[u8], a: &[u8], width: usize, term: impl Fn(&[u8], &[u8]) -> f32) -> f32 {
    let mut acc = 0.0f32;
    for (wb, ab) in w.chunks_exact(width).zip(a.chunks_exact(Q8_K_BYTES)) {
        acc += term(wb, ab);
    }
    acc
}

fn q2_k(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    super_blocks(w, a, Q2_K_BYTES, |wb, ab| {
        let bsums = q8_k_bsums(ab);
        let (mut sumi, mut summs) = (0i32, 0i32);
        for sub in 0..16 {
            let s: i32 = (0..16)
                .map(|l| q2_bits(&wb[16..80], sub * 16 + l) as i32 * q8k(ab, sub * 16 + l))
                .sum();
            sumi += (wb[sub] & 0x0F) as i32 * s;
            summs += (wb[sub] >> 4) as i32 * bsums[sub];
        }
        k_min_term(f16_at(wb, 80), f16_at(wb, 82), f32_at(ab, 0), sumi, summs)
    })
}

fn q3_k(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    super_blocks(w, a, Q3_K_BYTES, |wb, ab| {
        let codes = unpack_q3_k_scales(&wb[96..108]);
        let mut sumi = 0i32;
        for (sub, &c) in codes.iter().enumerate() {
            let s: i32 = (0..16)
                .map(|l| q3_value(wb, sub * 16 + l) * q8k(ab, sub * 16 + l))
                .sum();
            sumi += (c as i32 - 32) * s;
        }
        k_term(f16_at(wb, 108), f32_at(ab, 0), sumi)
    })
}

/// Q4_K (`qh` = None) and Q5_K (fifth bits at 16..48, nibbles at 48).
#[inline(always)]
fn k_affine(wb: &[u8], ab: &[u8], five_bits: bool) -> f32 {
    let (sc, mn) = unpack_k4_scales(&wb[4..16]);
    let qs_at = if five_bits { 48 } else { 16 };
    let mut sumi = 0i32;
    for sub in 0..8 {
        let chunk = &wb[qs_at + 32 * (sub / 2)..][..32];
        let s: i32 = (0..32)
            .map(|l| {
                let mut q = (chunk[l] >> (4 * (sub % 2))) & 0x0F;
                if five_bits {
                    q |= ((wb[16 + l] >> sub) & 1) << 4;
                }
                q as i32 * q8k(ab, sub * 32 + l)
            })
            .sum();
        sumi += sc[sub] as i32 * s;
    }
    let summs = k4_min_sum(&mn, &q8_k_bsums(ab));
    k_min_term(f16_at(wb, 0), f16_at(wb, 2), f32_at(ab, 0), sumi, summs)
}

fn q4_k(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    super_blocks(w, a, Q4_K_BYTES, |wb, ab| k_affine(wb, ab, false))
}

fn q5_k(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    super_blocks(w, a, Q5_K_BYTES, |wb, ab| k_affine(wb, ab, true))
}

fn q6_k(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    super_blocks(w, a, Q6_K_BYTES, |wb, ab| {
        // The unsigned 6-bit values times the scales, minus 32 · Σ scale · bsum: the same
        // integer as Σ scale · (value − 32) · q, in the form the SIMD kernels compute.
        let mut sumi = 0i32;
        for sub in 0..16 {
            let s: i32 = (0..16)
                .map(|l| q6_value(wb, sub * 16 + l) * q8k(ab, sub * 16 + l))
                .sum();
            sumi += (wb[192 + sub] as i8) as i32 * s;
        }
        sumi -= q6_k_offset(&wb[192..208], &q8_k_bsums(ab));
        k_term(f16_at(wb, 208), f32_at(ab, 0), sumi)
    })
}

fn iq4_xs(_k: usize, w: &[u8], a: &[u8]) -> f32 {
    super_blocks(w, a, IQ4_XS_BYTES, |wb, ab| {
        let codes = unpack_iq4_xs_scales(wb);
        let mut sumi = 0i32;
        for (sub, &c) in codes.iter().enumerate() {
            let s: i32 = nibbles32(&wb[8 + 16 * sub..][..16])
                .iter()
                .enumerate()
                .map(|(l, &q)| IQ4_TABLE[q as usize] as i32 * q8k(ab, sub * 32 + l))
                .sum();
            sumi += (c as i32 - 32) * s;
        }
        k_term(f16_at(wb, 0), f32_at(ab, 0), sumi)
    })
}
