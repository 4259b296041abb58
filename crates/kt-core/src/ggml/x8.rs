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
//! Q8_0 x8, per block of 32 inputs, 272 bytes (file: 8 × 34): `0..16` the rows' `d` (fp16),
//! `16..272` the values `[quad p][row r][4 bytes]` (quad p = values 4p..4p + 4).
//!
//! Q6_K x8, per super-block of 256 inputs, 1680 bytes (file: 8 × 210): `0..16` the rows' `d`
//! (fp16); `16..144` the signed scales `[sub-block j of 16][row r]`; then per sub-block t
//! (steps `2t`, `2t + 1` of 8 values) 96 bytes at [`q6_k_x8_top`]`(t)`: its top two bits
//! `[row r][byte b]` (bits 0–1 and 2–3 for step `2t`'s low and high nibble, 4–5 and 6–7 for
//! step `2t + 1`'s), then each step's low four bits as Q4_K's nibbles ([`q6_k_x8_nibbles`],
//! `[row r][byte b]`: low nibble value `8s + b`, high nibble `8s + 4 + b`). One sequential
//! stream: with the top bits in a region of their own, 512 bytes after the nibbles, a
//! one-token decode streamed at 13 GB/s without software prefetch (AMD Zen 4, two threads).
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

/// Bytes of one Q8_0 x8 block (eight rows).
pub const Q8_0_X8_BYTES: usize = 272;

/// Bytes of one Q6_K x8 super-block (eight rows).
pub const Q6_K_X8_BYTES: usize = 1680;

/// Offset in a Q6_K x8 super-block of sub-block `t`'s top bits (32 bytes).
#[inline(always)]
pub const fn q6_k_x8_top(t: usize) -> usize {
    144 + 96 * t
}

/// Offset in a Q6_K x8 super-block of step `step`'s nibbles (32 bytes), after its sub-block's
/// top bits.
#[inline(always)]
pub const fn q6_k_x8_nibbles(step: usize) -> usize {
    q6_k_x8_top(step / 2) + 32 + 32 * (step % 2)
}

/// Bytes of a group of eight rows of `k` values of `ty` in the x8 layout (`ty` must have one).
pub fn group_bytes(ty: GgmlType, k: usize) -> usize {
    match ty {
        GgmlType::Q4_K => k / 256 * Q4_K_X8_BYTES,
        GgmlType::Q6_K => k / 256 * Q6_K_X8_BYTES,
        GgmlType::Q8_0 => k / 32 * Q8_0_X8_BYTES,
        _ => unreachable!("{ty} has no x8 layout"),
    }
}

/// Whether `ty` has an x8 layout.
pub fn has_layout(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K | GgmlType::Q8_0)
}

/// Repack eight consecutive file rows of `k` values of `ty` (`rows`) into one x8 group (`out`,
/// [`group_bytes`]).
pub fn repack(ty: GgmlType, rows: &[u8], k: usize, out: &mut [u8]) {
    match ty {
        GgmlType::Q4_K => repack_q4_k(rows, k, out),
        GgmlType::Q6_K => repack_q6_k(rows, k, out),
        GgmlType::Q8_0 => repack_q8_0(rows, k, out),
        _ => unreachable!("{ty} has no x8 layout"),
    }
}

/// The scalar twin of `ty`'s x8 kernels (see [`dot_q4_k_scalar`] for the contract).
pub fn dot_scalar(
    ty: GgmlType,
    k: usize,
    group: &[u8],
    acts: &[&[u8]],
    out: &mut [f32],
    stride: usize,
) {
    match ty {
        GgmlType::Q4_K => dot_q4_k_scalar(k, group, acts, out, stride),
        GgmlType::Q6_K => dot_q6_k_scalar(k, group, acts, out, stride),
        GgmlType::Q8_0 => dot_q8_0_scalar(k, group, acts, out, stride),
        _ => unreachable!("{ty} has no x8 layout"),
    }
}

/// Super-block `sb` of a Q8_K activation row as Q4_K's x8 kernels use it: the sums of its
/// eight 32-value sub-blocks (`bsums[2j] + bsums[2j + 1]`, at most 32 · 128 in magnitude), as
/// pairs `j = 2q, 2q + 1` of i16 packed into one i32 each (low half first).
pub fn q8_k_pair_sums(row: &[u8], sb: usize) -> [i32; 4] {
    let b = &row[sb * Q8_K_BYTES..(sb + 1) * Q8_K_BYTES];
    let bsum = |i: usize| i16::from_le_bytes([b[260 + 2 * i], b[261 + 2 * i]]) as i32;
    let sum32 = |j: usize| (bsum(2 * j) + bsum(2 * j + 1)) as i16 as u16 as u32;
    std::array::from_fn(|q| (sum32(2 * q) | (sum32(2 * q + 1) << 16)) as i32)
}

/// Blocks `4c..4c + 4` of a Q8_0 activation row as Q8_0's biased x8 kernels use them: the
/// sums of each block's 32 values (blocks past the row's end count 0).
pub fn q8_0_block_sums(row: &[u8], c: usize) -> [i32; 4] {
    std::array::from_fn(|i| {
        let at = (4 * c + i) * Q8_0_BYTES;
        row.get(at + 2..at + Q8_0_BYTES)
            .map_or(0, |q| q.iter().map(|&v| v as i8 as i32).sum())
    })
}

/// The f32 bits of the scales of Q8_0 activation blocks `4c..4c + 4` of `row` (0 past its
/// end): the sixteen-row kernel multiplies by them without converting fp16 per group.
pub fn q8_0_block_scale_bits(row: &[u8], c: usize) -> [i32; 4] {
    std::array::from_fn(|i| {
        let at = (4 * c + i) * Q8_0_BYTES;
        if at + Q8_0_BYTES <= row.len() {
            f16_at(row, at).to_bits() as i32
        } else {
            0
        }
    })
}

/// Q8_0 rows into x8 blocks.
pub fn repack_q8_0(rows: &[u8], k: usize, out: &mut [u8]) {
    let blocks = k / 32;
    let row_bytes = blocks * Q8_0_BYTES;
    assert!(rows.len() == GROUP * row_bytes && out.len() == blocks * Q8_0_X8_BYTES);
    for blk in 0..blocks {
        let o = &mut out[blk * Q8_0_X8_BYTES..(blk + 1) * Q8_0_X8_BYTES];
        for r in 0..GROUP {
            let b = &rows[r * row_bytes + blk * Q8_0_BYTES..][..Q8_0_BYTES];
            o[2 * r..2 * r + 2].copy_from_slice(&b[0..2]);
            for p in 0..8 {
                o[16 + (p * GROUP + r) * 4..][..4].copy_from_slice(&b[2 + 4 * p..2 + 4 * p + 4]);
            }
        }
    }
}

/// Scalar twin of the Q8_0 x8 kernels (Q8_0 activations).
pub fn dot_q8_0_scalar(k: usize, group: &[u8], acts: &[&[u8]], out: &mut [f32], stride: usize) {
    for (i, a) in acts.iter().enumerate() {
        let mut acc = [0f32; GROUP];
        for blk in 0..k / 32 {
            let g = &group[blk * Q8_0_X8_BYTES..(blk + 1) * Q8_0_X8_BYTES];
            let ab = &a[blk * Q8_0_BYTES..(blk + 1) * Q8_0_BYTES];
            for (r, acc) in acc.iter_mut().enumerate() {
                let mut isum = 0i32;
                for p in 0..8 {
                    for b in 0..4 {
                        let w = (g[16 + (p * GROUP + r) * 4 + b] as i8) as i32;
                        isum += w * (ab[2 + 4 * p + b] as i8) as i32;
                    }
                }
                *acc += super::dot::legacy_term(f16_at(g, 2 * r), f16_at(ab, 0), isum);
            }
        }
        out[i * stride..i * stride + GROUP].copy_from_slice(&acc);
    }
}

/// Q6_K rows into x8 super-blocks.
pub fn repack_q6_k(rows: &[u8], k: usize, out: &mut [u8]) {
    let blocks = k / 256;
    let row_bytes = blocks * Q6_K_BYTES;
    assert!(rows.len() == GROUP * row_bytes && out.len() == blocks * Q6_K_X8_BYTES);
    out.fill(0);
    for sb in 0..blocks {
        let o = &mut out[sb * Q6_K_X8_BYTES..(sb + 1) * Q6_K_X8_BYTES];
        for r in 0..GROUP {
            let b = &rows[r * row_bytes + sb * Q6_K_BYTES..][..Q6_K_BYTES];
            o[2 * r..2 * r + 2].copy_from_slice(&b[208..210]);
            for j in 0..16 {
                o[16 + j * GROUP + r] = b[192 + j];
            }
            let v = |e: usize| super::dequant::q6_value(b, e) as u8;
            for step in 0..32 {
                for byte in 0..4 {
                    let (lo, hi) = (v(8 * step + byte), v(8 * step + 4 + byte));
                    o[q6_k_x8_nibbles(step) + r * 4 + byte] = (lo & 0x0F) | ((hi & 0x0F) << 4);
                    let top = ((lo >> 4) | ((hi >> 4) << 2)) << (4 * (step % 2));
                    o[q6_k_x8_top(step / 2) + r * 4 + byte] |= top;
                }
            }
        }
    }
}

/// Value `8·step + b` (low nibble) or `8·step + 4 + b` (high) of row r of a Q6_K x8 block.
fn q6_x8_value(g: &[u8], step: usize, r: usize, b: usize, high: bool) -> i32 {
    let nib = g[q6_k_x8_nibbles(step) + r * 4 + b];
    let top = g[q6_k_x8_top(step / 2) + r * 4 + b] >> (4 * (step % 2));
    let (low4, top2) = if high {
        (nib >> 4, (top >> 2) & 3)
    } else {
        (nib & 0x0F, top & 3)
    };
    (low4 | (top2 << 4)) as i32
}

/// Scalar twin of the Q6_K x8 kernels (Q8_K activations).
pub fn dot_q6_k_scalar(k: usize, group: &[u8], acts: &[&[u8]], out: &mut [f32], stride: usize) {
    for (i, a) in acts.iter().enumerate() {
        let mut acc = [0f32; GROUP];
        for sb in 0..k / 256 {
            let g = &group[sb * Q6_K_X8_BYTES..(sb + 1) * Q6_K_X8_BYTES];
            let ab = &a[sb * Q8_K_BYTES..(sb + 1) * Q8_K_BYTES];
            let bsums = q8_k_bsums(ab);
            let da = f32_at(ab, 0);
            for (r, acc) in acc.iter_mut().enumerate() {
                let mut sumi = 0i32;
                let mut scales = [0u8; 16];
                for j in 0..16 {
                    scales[j] = g[16 + j * GROUP + r];
                    let mut s = 0i32;
                    for step in 2 * j..2 * j + 2 {
                        for b in 0..4 {
                            let q8 = |e: usize| (ab[4 + e] as i8) as i32;
                            s += q6_x8_value(g, step, r, b, false) * q8(8 * step + b);
                            s += q6_x8_value(g, step, r, b, true) * q8(8 * step + 4 + b);
                        }
                    }
                    sumi += (scales[j] as i8) as i32 * s;
                }
                sumi -= super::dot::q6_k_offset(&scales, &bsums);
                *acc += super::dot::k_term(f16_at(g, 2 * r), da, sumi);
            }
        }
        out[i * stride..i * stride + GROUP].copy_from_slice(&acc);
    }
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
