//! Quantisation of expert weights to the original kt-kernel's AMXINT8 / AMXINT4 formats, and
//! the byte order of its converted files.
//!
//! Rules (reproducing the original 0.7.2 bit for bit, see `shared/fixtures/README.md` §2.3):
//! - INT8: per output row `d = amax × fp32(1/127)`; `q = sat_i8(round_half_even(w × fp32(1/d)))`.
//! - INT4: per output row `d = amax / 112` (in f64, stored f32); the INT8 rule with that `d`, then
//!   `v = q / 16` rounded half away from zero, `v ∈ [−7, 7]`; the weight is `v × 16 × d`.
//! - Byte order: rows in groups of 32; the input axis in steps of 64 (INT8) or 128 (INT4) gives one
//!   2048-byte tile; tiles follow row-group-major. Inside a tile each row owns 64 bytes (INT4: byte
//!   j = column j in the low nibble, column 64+j in the high nibble) and each 16-row half is a 16×16
//!   matrix of 4-byte words stored transposed — i.e. every 64-byte line holds 16 rows × 4
//!   consecutive inputs, exactly the operand shape of `vpdpbusd` and of AMX int8 tiles.
//!
//! Only inputs up to 3584 wide are covered by the original's own files (its column blocking
//! beyond that is not reproduced yet); the packers reject wider matrices.

use crate::{kt_ensure, Result};

/// Largest input width whose byte order is known (the original blocks columns by 3584).
pub const MAX_VERIFIED_K: usize = 3584;

/// Quantise one row to INT8; returns the fp32 scale.
pub fn quantize_row_int8(row: &[f32], q: &mut [i8]) -> f32 {
    let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax * (1.0f32 / 127.0);
    fill_q8(row, d, q);
    d
}

/// Quantise one row to INT4 values in [−7, 7] (one per i8); returns the fp32 scale `d`
/// (weights are `v × 16 × d`).
pub fn quantize_row_int4(row: &[f32], v: &mut [i8]) -> f32 {
    let amax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
    let d = (amax as f64 / 112.0) as f32;
    fill_q8(row, d, v);
    for x in v.iter_mut() {
        // Round |q8| / 16 half away from zero, keep the sign.
        let m = ((x.unsigned_abs() as i32 + 8) / 16).min(7) as i8;
        *x = if *x < 0 { -m } else { m };
    }
    d
}

fn fill_q8(row: &[f32], d: f32, q: &mut [i8]) {
    if d == 0.0 {
        q.fill(0);
        return;
    }
    let inv = 1.0f32 / d;
    for (o, &w) in q.iter_mut().zip(row) {
        *o = round_half_even(w * inv).clamp(-128.0, 127.0) as i8;
    }
}

/// Round half to even with plain arithmetic (`f32::round_ties_even` becomes a libm call on
/// baseline x86-64, which made quantisation slow). Exact for |x| < 2^22; larger values only
/// occur beyond the int8 range, where the caller saturates anyway.
#[inline(always)]
fn round_half_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23
    if x.abs() < 4_194_304.0 {
        (x + MAGIC) - MAGIC
    } else {
        x
    }
}

/// Byte offset of element (row `r`, column `c`) of an INT8 matrix with `k` columns.
pub fn amx_int8_offset(r: usize, c: usize, k: usize) -> usize {
    let (n0, rr) = (r / 32 * 32, r % 32);
    let (k0, cc) = (c / 64 * 64, c % 64);
    let (half, row16) = (rr / 16, rr % 16);
    n0 * k + k0 * 32 + half * 1024 + (cc / 4) * 64 + row16 * 4 + cc % 4
}

fn check_shape(n: usize, k: usize, kstep: usize) -> Result<()> {
    kt_ensure!(
        n.is_multiple_of(32) && k.is_multiple_of(kstep) && k <= MAX_VERIFIED_K,
        Unsupported,
        "AMX layout of a {n}x{k} matrix: rows must be a multiple of 32, columns a multiple of \
         {kstep} and at most {MAX_VERIFIED_K}"
    );
    Ok(())
}

/// Row-major INT8 values `[n][k]` → the original's tiled bytes.
pub fn pack_amx_int8(q: &[i8], n: usize, k: usize) -> Result<Vec<u8>> {
    check_shape(n, k, 64)?;
    let mut out = vec![0u8; n * k];
    for r in 0..n {
        for c in 0..k {
            out[amx_int8_offset(r, c, k)] = q[r * k + c] as u8;
        }
    }
    Ok(out)
}

/// The original's tiled INT8 bytes → row-major values.
pub fn unpack_amx_int8(bytes: &[u8], n: usize, k: usize) -> Result<Vec<i8>> {
    check_shape(n, k, 64)?;
    kt_ensure!(
        bytes.len() == n * k,
        Format,
        "INT8 matrix {n}x{k} needs {} bytes, got {}",
        n * k,
        bytes.len()
    );
    let mut q = vec![0i8; n * k];
    for r in 0..n {
        for c in 0..k {
            q[r * k + c] = bytes[amx_int8_offset(r, c, k)] as i8;
        }
    }
    Ok(q)
}

/// Byte offset and nibble (0 = low) of INT4 element (row `r`, column `c`) with `k` columns.
pub fn amx_int4_position(r: usize, c: usize, k: usize) -> (usize, u32) {
    let (n0, rr) = (r / 32 * 32, r % 32);
    let (k0, cc) = (c / 128 * 128, c % 128);
    let (j, nibble) = (cc % 64, (cc / 64) as u32);
    let (half, row16) = (rr / 16, rr % 16);
    (
        (n0 * k + k0 * 32) / 2 + half * 1024 + (j / 4) * 64 + row16 * 4 + j % 4,
        nibble,
    )
}

/// Row-major INT4 values `[n][k]` (each in [−8, 7]) → the original's tiled bytes.
pub fn pack_amx_int4(v: &[i8], n: usize, k: usize) -> Result<Vec<u8>> {
    check_shape(n, k, 128)?;
    let mut out = vec![0u8; n * k / 2];
    for r in 0..n {
        for c in 0..k {
            let (off, nib) = amx_int4_position(r, c, k);
            out[off] |= ((v[r * k + c] as u8) & 0x0F) << (4 * nib);
        }
    }
    Ok(out)
}

/// The original's tiled INT4 bytes → row-major values in [−8, 7].
pub fn unpack_amx_int4(bytes: &[u8], n: usize, k: usize) -> Result<Vec<i8>> {
    check_shape(n, k, 128)?;
    kt_ensure!(
        bytes.len() * 2 == n * k,
        Format,
        "INT4 matrix {n}x{k} needs {} bytes, got {}",
        n * k / 2,
        bytes.len()
    );
    let mut v = vec![0i8; n * k];
    for r in 0..n {
        for c in 0..k {
            let (off, nib) = amx_int4_position(r, c, k);
            // Sign-extend the nibble.
            v[r * k + c] = (((bytes[off] >> (4 * nib)) << 4) as i8) >> 4;
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod rounding_tests {
    #[test]
    fn round_half_even_matches_std() {
        let mut x = -300.0f32;
        while x < 300.0 {
            assert_eq!(super::round_half_even(x), x.round_ties_even(), "{x}");
            x += 0.125;
        }
        for v in [1e7f32, -1e9, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 127.5] {
            assert_eq!(super::round_half_even(v), v.round_ties_even(), "{v}");
        }
    }
}
