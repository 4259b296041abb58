//! Scalar dequantizers: one block of bytes → its values as f32. Sizes are checked by the
//! callers in `mod.rs`.
use super::blocks::*;
use super::{ActivationFormat, GgmlType};
use crate::Result;

/// Dequantize a whole row (`data.len()` and `out.len()` already match `ty`).
pub(super) fn row(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<()> {
    use GgmlType::*;
    let per_block: fn(&[u8], &mut [f32]) = match ty {
        F32 => |b, y| y[0] = f32_at(b, 0),
        F16 => |b, y| y[0] = f16_at(b, 0),
        BF16 => |b, y| y[0] = bf16_at(b, 0),
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
        other => return Err(super::unsupported(other, "dequantizer")),
    };
    for (b, y) in data
        .chunks_exact(ty.type_size())
        .zip(out.chunks_exact_mut(ty.block_size()))
    {
        per_block(b, y);
    }
    Ok(())
}

/// Values of a quantized activation row (sizes already checked).
pub(super) fn activation(format: ActivationFormat, data: &[u8], k: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; k];
    match format {
        ActivationFormat::F32 => {
            for (y, b) in out.iter_mut().zip(data.chunks_exact(4)) {
                *y = f32_at(b, 0);
            }
        }
        ActivationFormat::Q8_0 => {
            for (b, y) in data.chunks_exact(Q8_0_BYTES).zip(out.chunks_exact_mut(QK)) {
                q8_0(b, y);
            }
        }
        ActivationFormat::Q8_1 => {
            for (b, y) in data.chunks_exact(Q8_1_BYTES).zip(out.chunks_exact_mut(QK)) {
                let d = f16_at(b, 0);
                for (v, &q) in y.iter_mut().zip(&b[4..36]) {
                    *v = d * (q as i8) as f32;
                }
            }
        }
        ActivationFormat::Q8_K => {
            for (b, y) in data
                .chunks_exact(Q8_K_BYTES)
                .zip(out.chunks_exact_mut(QK_K))
            {
                let d = f32_at(b, 0);
                for (v, &q) in y.iter_mut().zip(&b[4..260]) {
                    *v = d * (q as i8) as f32;
                }
            }
        }
    }
    out
}

/// The 32 four-bit values of a legacy block's 16 nibble bytes, in value order.
#[inline(always)]
pub(super) fn nibbles32(qs: &[u8]) -> [u8; 32] {
    let mut q = [0u8; 32];
    for j in 0..16 {
        q[j] = qs[j] & 0x0F;
        q[j + 16] = qs[j] >> 4;
    }
    q
}

/// The 32 five-bit values of a Q5_0/Q5_1 block (`qh` = the u32 of fifth bits).
#[inline(always)]
pub(super) fn fives32(qh: u32, qs: &[u8]) -> [u8; 32] {
    let mut q = nibbles32(qs);
    for (j, v) in q.iter_mut().enumerate() {
        *v |= (((qh >> j) & 1) as u8) << 4;
    }
    q
}

#[inline(always)]
pub(super) fn qh_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (v, q) in y.iter_mut().zip(nibbles32(&b[2..18])) {
        *v = d * (q as i32 - 8) as f32;
    }
}

fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (v, q) in y.iter_mut().zip(nibbles32(&b[4..20])) {
        *v = d * q as f32 + m;
    }
}

fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (v, q) in y.iter_mut().zip(fives32(qh_at(b, 2), &b[6..22])) {
        *v = d * (q as i32 - 16) as f32;
    }
}

fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (v, q) in y.iter_mut().zip(fives32(qh_at(b, 4), &b[8..24])) {
        *v = d * q as f32 + m;
    }
}

fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (v, &q) in y.iter_mut().zip(&b[2..34]) {
        *v = d * (q as i8) as f32;
    }
}

fn iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (v, q) in y.iter_mut().zip(nibbles32(&b[2..18])) {
        *v = d * IQ4_TABLE[q as usize] as f32;
    }
}

/// Value `e` (0..256) of a Q2_K/Q3_K block lives in 2-bit field `(e % 128) / 32` of byte
/// `32·(e / 128) + e % 32` of the packed bits; its sub-block of 16 is `e / 16`.
#[inline(always)]
pub(super) fn q2_bits(qs: &[u8], e: usize) -> u8 {
    (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3
}

fn q2_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (sub, ys) in y.chunks_exact_mut(16).enumerate() {
        let sc = b[sub];
        let dl = d * (sc & 0x0F) as f32;
        let ml = dmin * (sc >> 4) as f32;
        for (l, v) in ys.iter_mut().enumerate() {
            *v = dl * q2_bits(&b[16..80], sub * 16 + l) as f32 - ml;
        }
    }
}

/// The signed 3-bit value (−4..=3) `e` of a Q3_K block: two low bits as in Q2_K, and the high
/// bit (bit `e / 32` of mask byte `e % 32`) set means "no −4".
#[inline(always)]
pub(super) fn q3_value(b: &[u8], e: usize) -> i32 {
    let low = q2_bits(&b[32..96], e) as i32;
    let high_set = (b[e % 32] >> (e / 32)) & 1 == 1;
    low - if high_set { 0 } else { 4 }
}

fn q3_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 108);
    let codes = unpack_q3_k_scales(&b[96..108]);
    for (sub, ys) in y.chunks_exact_mut(16).enumerate() {
        let dl = d * (codes[sub] as i32 - 32) as f32;
        for (l, v) in ys.iter_mut().enumerate() {
            *v = dl * q3_value(b, sub * 16 + l) as f32;
        }
    }
}

fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, mn) = unpack_k4_scales(&b[4..16]);
    for (sub, ys) in y.chunks_exact_mut(32).enumerate() {
        let dl = d * sc[sub] as f32;
        let ml = dmin * mn[sub] as f32;
        let chunk = &b[16 + 32 * (sub / 2)..][..32];
        let shift = 4 * (sub % 2);
        for (v, &q) in ys.iter_mut().zip(chunk) {
            *v = dl * ((q >> shift) & 0x0F) as f32 - ml;
        }
    }
}

fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, mn) = unpack_k4_scales(&b[4..16]);
    let qh = &b[16..48];
    for (sub, ys) in y.chunks_exact_mut(32).enumerate() {
        let dl = d * sc[sub] as f32;
        let ml = dmin * mn[sub] as f32;
        let chunk = &b[48 + 32 * (sub / 2)..][..32];
        let shift = 4 * (sub % 2);
        for (l, v) in ys.iter_mut().enumerate() {
            let q = ((chunk[l] >> shift) & 0x0F) | (((qh[l] >> sub) & 1) << 4);
            *v = dl * q as f32 - ml;
        }
    }
}

/// The unsigned 6-bit value (0..64, the weight is `value − 32`) `e` of a Q6_K block. In each
/// half of 128 values (h = e / 128, r = e % 128): low 4 bits from byte `64h + r % 64` of the
/// low part (low nibble if r < 64 else high), top 2 bits from bit pair `r / 32` of byte
/// `128 + 32h + r % 32`.
#[inline(always)]
pub(super) fn q6_value(b: &[u8], e: usize) -> i32 {
    let (h, r) = (e / 128, e % 128);
    let low = (b[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
    let high = (b[128 + 32 * h + r % 32] >> (2 * (r / 32))) & 3;
    (low | (high << 4)) as i32
}

fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for (sub, ys) in y.chunks_exact_mut(16).enumerate() {
        let dl = d * (b[192 + sub] as i8) as f32;
        for (l, v) in ys.iter_mut().enumerate() {
            *v = dl * (q6_value(b, sub * 16 + l) - 32) as f32;
        }
    }
}

fn iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let codes = unpack_iq4_xs_scales(b);
    for (sub, ys) in y.chunks_exact_mut(32).enumerate() {
        let dl = d * (codes[sub] as i32 - 32) as f32;
        for (v, q) in ys.iter_mut().zip(nibbles32(&b[8 + 16 * sub..][..16])) {
            *v = dl * IQ4_TABLE[q as usize] as f32;
        }
    }
}
