//! Scalar oracles. Plain loops, the same summation order as the SIMD kernels.
use crate::dtype::{bf16_bits_to_f32, f32_to_bf16_bits};

/// Row block of the scalar kernels: the largest any kernel takes, so every twin test can
/// compare whole blocks.
pub const ROWS: usize = super::MAX_ROWS;

/// fp32-FMA panel dot: per output, one `mul_add` chain over k (input 2q, then 2q+1).
///
/// # Safety
/// See [`super::PanelDotFn`].
pub unsafe fn panel_dot_fma(a_rows: &[*const f32], k: usize, panel: *const u16, out: *mut f32) {
    for (r, &a) in a_rows.iter().enumerate() {
        for lane in 0..32 {
            let (h, j) = (lane / 16, lane % 16);
            let mut acc = 0.0f32;
            for q in 0..k / 2 {
                let base = q * 64 + h * 32 + j * 2;
                // SAFETY: indices < 32*k and < k by the contract.
                unsafe {
                    let w0 = bf16_bits_to_f32(*panel.add(base));
                    let w1 = bf16_bits_to_f32(*panel.add(base + 1));
                    acc = (*a.add(2 * q)).mul_add(w0, acc);
                    acc = (*a.add(2 * q + 1)).mul_add(w1, acc);
                }
            }
            // SAFETY: out holds 32 per row.
            unsafe { *out.add(r * 32 + lane) = acc };
        }
    }
}

/// Model of `vdpbf16ps` on staged bf16 pairs: per pair the odd product is added first, then
/// the even one, each add rounded (products of bf16 values are exact in fp32); denormal inputs
/// and results are flushed to zero as the instruction does.
///
/// # Safety
/// See [`super::PanelDotBf16Fn`].
pub unsafe fn panel_dot_bf16(a_rows: &[*const u32], k: usize, panel: *const u16, out: *mut f32) {
    for (r, &a) in a_rows.iter().enumerate() {
        for lane in 0..32 {
            let (h, j) = (lane / 16, lane % 16);
            let mut acc = 0.0f32;
            for q in 0..k / 2 {
                let base = q * 64 + h * 32 + j * 2;
                // SAFETY: indices < 32*k and pair q < k/2 by the contract.
                unsafe {
                    let w0 = ftz(bf16_bits_to_f32(*panel.add(base)));
                    let w1 = ftz(bf16_bits_to_f32(*panel.add(base + 1)));
                    let pair = *a.add(q);
                    let x0 = ftz(bf16_bits_to_f32(pair as u16));
                    let x1 = ftz(bf16_bits_to_f32((pair >> 16) as u16));
                    acc = ftz(acc + x1 * w1);
                    acc = ftz(acc + x0 * w0);
                }
            }
            // SAFETY: out holds 32 per row.
            unsafe { *out.add(r * 32 + lane) = acc };
        }
    }
}

fn ftz(x: f32) -> f32 {
    if x.is_subnormal() {
        0.0f32.copysign(x)
    } else {
        x
    }
}

/// Round an fp32 row to bf16 pairs, nearest even (the tail of the SIMD version too).
pub fn stage_bf16_tail(src: &[f32], dst: &mut [u32]) {
    for (d, pair) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f32_to_bf16_bits(pair[0]) as u32 | (f32_to_bf16_bits(pair[1]) as u32) << 16;
    }
}

/// Staging, scalar twin.
///
/// # Safety
/// None beyond `src.len() == 2 * dst.len()` (kept `unsafe` to share the pointer type).
pub unsafe fn stage_bf16(src: &[f32], dst: &mut [u32]) {
    stage_bf16_tail(src, dst);
}

/// SwiGLU, scalar.
///
/// # Safety
/// None beyond equal lengths (kept `unsafe` to share the function-pointer type).
pub unsafe fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32], limit: f32, alpha: f32) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = super::swiglu_one(g, u, limit, alpha);
    }
}
