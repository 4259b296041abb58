//! Block layouts (byte offsets inside one block, all little-endian) and the small helpers that
//! pack and unpack their sub-block scales. Shared by the quantizers, dequantizers, scalar dot
//! products and SIMD kernels so that every path reads a block the same way.
use half::{bf16, f16};

/// Values per block of the 32-value ("legacy") types.
pub const QK: usize = 32;
/// Values per super-block of the K and IQ4_XS types.
pub const QK_K: usize = 256;

/// Q4_0: fp16 `d` @0, 16 bytes of nibbles @2 (byte j: value j low, value j+16 high).
pub const Q4_0_BYTES: usize = 18;
/// Q4_1: fp16 `d` @0, fp16 `m` @2, nibbles @4.
pub const Q4_1_BYTES: usize = 20;
/// Q5_0: fp16 `d` @0, u32 fifth bits @2 (bit j for value j), nibbles @6.
pub const Q5_0_BYTES: usize = 22;
/// Q5_1: fp16 `d` @0, fp16 `m` @2, u32 fifth bits @4, nibbles @8.
pub const Q5_1_BYTES: usize = 24;
/// Q8_0: fp16 `d` @0, 32 × i8 @2.
pub const Q8_0_BYTES: usize = 34;
/// Q8_1: fp16 `d` @0, fp16 `s` @2, 32 × i8 @4.
pub const Q8_1_BYTES: usize = 36;
/// IQ4_NL: fp16 `d` @0, nibbles @2 (indices into [`IQ4_TABLE`]).
pub const IQ4_NL_BYTES: usize = 18;

/// Q2_K: 16 scale bytes @0 (low nibble scale, high nibble min), 64 bytes of 2-bit values @16,
/// fp16 `d` @80, fp16 `dmin` @82.
pub const Q2_K_BYTES: usize = 84;
/// Q3_K: 32 bytes high-bit mask @0, 64 bytes of low 2 bits @32, 12 bytes of 6-bit scales @96,
/// fp16 `d` @108.
pub const Q3_K_BYTES: usize = 110;
/// Q4_K: fp16 `d` @0, fp16 `dmin` @2, 12 bytes of 6-bit scales and mins @4, 128 bytes of
/// nibbles @16 (32-byte chunk c: sub-block 2c low nibbles, 2c+1 high nibbles).
pub const Q4_K_BYTES: usize = 144;
/// Q5_K: as Q4_K, plus 32 bytes of fifth bits @16 (bit i of byte l for sub-block i, value l);
/// nibbles @48.
pub const Q5_K_BYTES: usize = 176;
/// Q6_K: 128 bytes low 4 bits @0, 64 bytes high 2 bits @128, 16 × i8 scales @192, fp16 `d` @208.
pub const Q6_K_BYTES: usize = 210;
/// Q8_K: f32 `d` @0, 256 × i8 @4, 16 × i16 sums of 16 values @260.
pub const Q8_K_BYTES: usize = 292;
/// IQ4_XS: fp16 `d` @0, u16 high scale bits @2, 4 bytes low scale nibbles @4, nibbles @8.
pub const IQ4_XS_BYTES: usize = 136;

/// The 16 values an IQ4_NL / IQ4_XS nibble selects (before scaling).
pub const IQ4_TABLE: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// fp16 at `b[at..at + 2]` → f32 (exact).
#[inline(always)]
pub fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// f32 at `b[at..at + 4]`.
#[inline(always)]
pub fn f32_at(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// bf16 at `b[at..at + 2]` → f32 (exact).
#[inline(always)]
pub fn bf16_at(b: &[u8], at: usize) -> f32 {
    bf16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Store `x` rounded to fp16 at `b[at..at + 2]` and return the stored value as f32.
#[inline]
pub fn put_f16(b: &mut [u8], at: usize, x: f32) -> f32 {
    let h = f16::from_f32(x);
    b[at..at + 2].copy_from_slice(&h.to_bits().to_le_bytes());
    h.to_f32()
}

/// `x` rounded to fp16 and back (the value a stored scale will have).
#[inline]
pub fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// Scales and minima (6 bits each) of the 8 sub-blocks of a Q4_K / Q5_K block, from its
/// 12 packed bytes: bytes 0–3 hold scales 0–3 (low 6 bits) and the top 2 bits of scales 4–7;
/// bytes 4–7 the same for the minima; bytes 8–11 the low 4 bits of scale (low nibble) and
/// minimum (high nibble) 4–7.
#[inline(always)]
pub fn unpack_k4_scales(p: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (sc, mn) = unpack_k4_scales_u64(p);
    (sc.to_le_bytes(), mn.to_le_bytes())
}

/// [`unpack_k4_scales`] with the 8 scales and the 8 minima as the bytes of two u64 (byte j =
/// sub-block j), computed four sub-blocks at a time.
#[inline(always)]
pub fn unpack_k4_scales_u64(p: &[u8]) -> (u64, u64) {
    let word = |at: usize| u32::from_le_bytes([p[at], p[at + 1], p[at + 2], p[at + 3]]);
    let (p0, p1, p2) = (word(0), word(4), word(8));
    const LOW6: u32 = 0x3F3F_3F3F;
    const LOW4: u32 = 0x0F0F_0F0F;
    const BITS45: u32 = 0x3030_3030; // bits 6–7 of a byte, moved down to 4–5
    let sc_low = p0 & LOW6;
    let mn_low = p1 & LOW6;
    let sc_high = (p2 & LOW4) | ((p0 >> 2) & BITS45);
    let mn_high = ((p2 >> 4) & LOW4) | ((p1 >> 2) & BITS45);
    (
        sc_low as u64 | (sc_high as u64) << 32,
        mn_low as u64 | (mn_high as u64) << 32,
    )
}

/// Inverse of [`unpack_k4_scales`] (values must be < 64).
pub fn pack_k4_scales(sc: &[u8; 8], mn: &[u8; 8]) -> [u8; 12] {
    let mut p = [0u8; 12];
    for j in 0..4 {
        p[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        p[j + 4] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6);
        p[j + 8] = (sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4);
    }
    p
}

/// The 16 six-bit scale codes (0..64, the scale is `code − 32`) of a Q3_K block, from its 12
/// packed bytes: bytes 0–7 hold the low 4 bits of codes 0–7 (low nibbles) and 8–15 (high
/// nibbles); byte 8 + r holds the top 2 bits of codes r, r+4, r+8, r+12 in bit pairs 0–3.
#[inline(always)]
pub fn unpack_q3_k_scales(p: &[u8]) -> [u8; 16] {
    let mut codes = [0u8; 16];
    for (i, c) in codes.iter_mut().enumerate() {
        let low = if i < 8 { p[i] & 0x0F } else { p[i - 8] >> 4 };
        let high = (p[8 + i % 4] >> (2 * (i / 4))) & 3;
        *c = low | (high << 4);
    }
    codes
}

/// Inverse of [`unpack_q3_k_scales`] (codes must be < 64).
pub fn pack_q3_k_scales(codes: &[u8; 16]) -> [u8; 12] {
    let mut p = [0u8; 12];
    for i in 0..8 {
        p[i] = (codes[i] & 0x0F) | ((codes[i + 8] & 0x0F) << 4);
    }
    for (i, &c) in codes.iter().enumerate() {
        p[8 + i % 4] |= ((c >> 4) & 3) << (2 * (i / 4));
    }
    p
}

/// The 8 six-bit scale codes (the scale is `code − 32`) of an IQ4_XS block: low 4 bits from
/// the nibbles of bytes 4–7 (sub-block 2i low, 2i+1 high), top 2 bits from bit pair i of the
/// u16 at 2.
#[inline(always)]
pub fn unpack_iq4_xs_scales(b: &[u8]) -> [u8; 8] {
    unpack_iq4_xs_scales_u64(b).to_le_bytes()
}

/// [`unpack_iq4_xs_scales`] as the bytes of a u64 (byte i = sub-block i), by bit spreading.
#[inline(always)]
pub fn unpack_iq4_xs_scales_u64(b: &[u8]) -> u64 {
    // Byte i of a u32 → byte 2i of a u64.
    let spread_bytes = |x: u32| {
        let v = x as u64;
        let v = (v | v << 16) & 0x0000_FFFF_0000_FFFF;
        (v | v << 8) & 0x00FF_00FF_00FF_00FF
    };
    let nibbles = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let low = spread_bytes(nibbles & 0x0F0F_0F0F) | spread_bytes((nibbles >> 4) & 0x0F0F_0F0F) << 8;
    // Bit pair i of a u16 → bits 0–1 of byte i.
    let v = u16::from_le_bytes([b[2], b[3]]) as u64;
    let v = (v | v << 24) & 0x0000_00FF_0000_00FF;
    let v = (v | v << 12) & 0x000F_000F_000F_000F;
    let high = (v | v << 6) & 0x0303_0303_0303_0303;
    low | high << 4
}

/// Store 8 IQ4_XS scale codes (< 64) into bytes 2..8 of a block.
pub fn pack_iq4_xs_scales(codes: &[u8; 8], b: &mut [u8]) {
    let mut high = 0u16;
    let mut low = [0u8; 4];
    for (ib, &c) in codes.iter().enumerate() {
        low[ib / 2] |= (c & 0x0F) << (4 * (ib % 2));
        high |= (((c >> 4) & 3) as u16) << (2 * ib);
    }
    b[2..4].copy_from_slice(&high.to_le_bytes());
    b[4..8].copy_from_slice(&low);
}

/// The 16 partial sums of a Q8_K block.
#[inline(always)]
pub fn q8_k_bsums(a: &[u8]) -> [i32; 16] {
    let mut s = [0i32; 16];
    for (j, v) in s.iter_mut().enumerate() {
        let at = 260 + 2 * j;
        *v = i16::from_le_bytes([a[at], a[at + 1]]) as i32;
    }
    s
}
