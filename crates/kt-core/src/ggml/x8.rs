//! Eight weight rows interleaved ("x8"), so SIMD lanes hold output rows: a kernel broadcasts
//! four activation bytes and multiplies them with four values of all eight rows at once, the
//! sums stay in their lanes across the whole row (no horizontal reduction), and one decoded
//! weight vector serves every token row of a call. Layers that store a type in this layout
//! repack the file's blocks at load.
//!
//! Q4_K x8, per super-block of 256 inputs, 1184 bytes for the eight rows (file: 8 × 144):
//! - `0..16`: the eight rows' `d` (fp16), `16..32`: their `dmin` (fp16);
//! - `32..96`: 6-bit scales as bytes, `[sub-block j][row r]`;
//! - `96..160`: 6-bit minima as byte pairs, `[pair q][row r][j = 2q, 2q + 1]`;
//! - `160..1184`: nibbles, `[sub-block j][step p][row r][byte b]`: the low nibble is value
//!   `8p + b` of sub-block j of row r, the high nibble value `8p + 4 + b`.
//!
//! Every result equals the single-row scalar twin (`dot.rs`) bit for bit: the same exact
//! integer sums per super-block and the same f32 operations per (row, token), in super-block
//! order. The scalar kernel here is the twin of the SIMD ones on this layout.
use super::blocks::*;
use super::GgmlType;

/// Rows per interleaved group.
pub const GROUP: usize = 8;

/// Bytes of one Q4_K x8 super-block (eight rows).
pub const Q4_K_X8_BYTES: usize = 1184;

/// Bytes of a group of eight rows of `k` values of `ty` in the x8 layout (`ty` must have one).
pub fn group_bytes(ty: GgmlType, k: usize) -> usize {
    match ty {
        GgmlType::Q4_K => k / 256 * Q4_K_X8_BYTES,
        _ => unreachable!("{ty} has no x8 layout"),
    }
}

/// Whether `ty` has an x8 layout.
pub fn has_layout(ty: GgmlType) -> bool {
    ty == GgmlType::Q4_K
}

/// Repack eight consecutive file rows of `k` Q4_K values (`rows`, `8 · k/256 · 144` bytes)
/// into one x8 group (`out`, [`group_bytes`]).
pub fn repack_q4_k(rows: &[u8], k: usize, out: &mut [u8]) {
    let blocks = k / 256;
    let row_bytes = blocks * Q4_K_BYTES;
    assert!(rows.len() == GROUP * row_bytes && out.len() == blocks * Q4_K_X8_BYTES);
    for sb in 0..blocks {
        let o = &mut out[sb * Q4_K_X8_BYTES..(sb + 1) * Q4_K_X8_BYTES];
        for r in 0..GROUP {
            let b = &rows[r * row_bytes + sb * Q4_K_BYTES..][..Q4_K_BYTES];
            o[2 * r..2 * r + 2].copy_from_slice(&b[0..2]);
            o[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&b[2..4]);
            let (sc, mn) = unpack_k4_scales(&b[4..16]);
            for j in 0..8 {
                o[32 + j * GROUP + r] = sc[j];
                o[96 + (j / 2) * 16 + r * 2 + j % 2] = mn[j];
            }
            for j in 0..8 {
                for p in 0..4 {
                    for byte in 0..4 {
                        let (lo, hi) = (
                            q4_k_value(b, j, 8 * p + byte),
                            q4_k_value(b, j, 8 * p + 4 + byte),
                        );
                        o[160 + ((j * 4 + p) * GROUP + r) * 4 + byte] = lo | (hi << 4);
                    }
                }
            }
        }
    }
}

/// Value `l` (0..32) of sub-block `j` of a Q4_K block: sub-block 2c in the low nibbles of
/// chunk c, 2c + 1 in the high nibbles.
fn q4_k_value(b: &[u8], j: usize, l: usize) -> u8 {
    (b[16 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F
}

/// Scalar twin of the x8 kernels: `out[i · stride + r] = dot(row r of the group, acts[i])`
/// for the eight rows and every activation row (Q8_K), with the single-row twin's arithmetic.
pub fn dot_q4_k_scalar(k: usize, group: &[u8], acts: &[&[u8]], out: &mut [f32], stride: usize) {
    let blocks = k / 256;
    for (i, a) in acts.iter().enumerate() {
        let mut acc = [0f32; GROUP];
        for sb in 0..blocks {
            let g = &group[sb * Q4_K_X8_BYTES..(sb + 1) * Q4_K_X8_BYTES];
            let ab = &a[sb * Q8_K_BYTES..(sb + 1) * Q8_K_BYTES];
            let bsums = q8_k_bsums(ab);
            let da = f32_at(ab, 0);
            for (r, acc) in acc.iter_mut().enumerate() {
                let mut sumi = 0i32;
                let mut summs = 0i32;
                for j in 0..8 {
                    let mut s = 0i32;
                    for p in 0..4 {
                        for byte in 0..4 {
                            let v = g[160 + ((j * 4 + p) * GROUP + r) * 4 + byte];
                            let q8 = |l: usize| (ab[4 + 32 * j + l] as i8) as i32;
                            s += (v & 0x0F) as i32 * q8(8 * p + byte);
                            s += (v >> 4) as i32 * q8(8 * p + 4 + byte);
                        }
                    }
                    sumi += g[32 + j * GROUP + r] as i32 * s;
                    let mn = g[96 + (j / 2) * 16 + r * 2 + j % 2] as i32;
                    summs += mn * (bsums[2 * j] + bsums[2 * j + 1]);
                }
                let (d, dmin) = (f16_at(g, 2 * r), f16_at(g, 16 + 2 * r));
                *acc += super::dot::k_min_term(d, dmin, da, sumi, summs);
            }
        }
        out[i * stride..i * stride + GROUP].copy_from_slice(&acc);
    }
}
