//! Group-scaled codes of native checkpoints: small codes (E4M3, E2M1 or int4) with one scale
//! per `group` consecutive inputs of a row, as MXFP8, MXFP4, NVFP4, RAWINT4 and GPTQ_INT4
//! checkpoints store them. A [`CodedMatrix`] describes such a matrix where the file keeps it;
//! [`crate::pack::MatrixView`] reads its values through it, so every method can load every
//! checkpoint, and the group-scaled formats ([`crate::formats::kgroup`]) copy its codes.
//!
//! The quantizers here ([`quantize_group`]) are the recipes our own converter and the online
//! path use; a test reimplements them in numpy to write checkpoints.
use crate::dtype::{e4m3_to_f32, f32_to_e4m3};
use half::{bf16, f16};

/// What one code stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CodeKind {
    /// FP8 E4M3FN, one byte (`0x7F`/`0xFF` are NaN).
    E4M3,
    /// FP4 E2M1 nibble: sign bit 3, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
    E2M1,
    /// Symmetric int4 nibble holding `q + 8`, `q ∈ [−8, 7]`.
    Int4,
}

/// E2M1 values by nibble.
pub const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Midpoints between consecutive E2M1 magnitudes (codes 0..=7): `E2M1_MIDPOINTS[c]` lies
/// between codes `c` and `c + 1`.
pub(crate) const E2M1_MIDPOINTS: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];

/// 1.5 · 2²³: adding and subtracting it rounds an f32 below 2²² to an integer, ties to even.
pub(crate) const ROUND_MAGIC: f32 = 12_582_912.0;

/// Int4 values by nibble (`nibble − 8`).
pub const INT4_VALUES: [f32; 16] = [
    -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0,
];

impl CodeKind {
    /// Bits per code.
    pub fn bits(self) -> usize {
        match self {
            CodeKind::E4M3 => 8,
            CodeKind::E2M1 | CodeKind::Int4 => 4,
        }
    }

    /// The value of `code` (a byte, or a nibble in the low 4 bits).
    #[inline]
    pub fn value(self, code: u8) -> f32 {
        match self {
            CodeKind::E4M3 => e4m3_to_f32(code),
            CodeKind::E2M1 => E2M1_VALUES[(code & 0xF) as usize],
            CodeKind::Int4 => INT4_VALUES[(code & 0xF) as usize],
        }
    }

    /// The value table of a nibble kind.
    pub fn nibble_table(self) -> Option<&'static [f32; 16]> {
        match self {
            CodeKind::E4M3 => None,
            CodeKind::E2M1 => Some(&E2M1_VALUES),
            CodeKind::Int4 => Some(&INT4_VALUES),
        }
    }

    /// Largest magnitude a code holds.
    pub fn max(self) -> f32 {
        match self {
            CodeKind::E4M3 => 448.0,
            CodeKind::E2M1 => 6.0,
            CodeKind::Int4 => 7.0,
        }
    }

    /// The nearest code to `v` (ties to even; saturating).
    pub fn encode(self, v: f32) -> u8 {
        match self {
            CodeKind::E4M3 => f32_to_e4m3(v),
            CodeKind::E2M1 => {
                // The magnitude code is the number of midpoints below |v|; a tie goes up only
                // to an even code (mantissa bit 0). NaN counts as 6 (`min`), as the largest.
                // Branch-free (`|`, `&` on bools), so quantizing loops vectorise.
                let a = v.abs().min(6.0);
                let mut code = 0u8;
                for (c, mid) in E2M1_MIDPOINTS.iter().enumerate() {
                    code += ((a > *mid) | ((a == *mid) & (c % 2 == 1))) as u8;
                }
                let negative = (v.to_bits() >> 31) as u8 & (code != 0) as u8;
                code | (negative << 3)
            }
            CodeKind::Int4 => {
                // Ties to even by the 1.5·2²³ trick (exact below 2²², and anything larger
                // saturates alike): inline, where `round_ties_even` is a libm call on
                // baseline x86-64. NaN stays NaN through the clamp and casts to 0 → code 8.
                (((v + ROUND_MAGIC) - ROUND_MAGIC).clamp(-8.0, 7.0) as i32 + 8) as u8
            }
        }
    }

    /// Whether `code` is a NaN code.
    pub fn is_nan(self, code: u8) -> bool {
        self == CodeKind::E4M3 && code & 0x7F == 0x7F
    }
}

/// Whether any of `codes` is an E4M3 NaN (`S.1111.111`). Byte arithmetic without branches,
/// so the compiler vectorizes it (the byte-by-byte search held a checkpoint load's time):
/// `(b & 0x7F) + 1` reaches 0x80 only for the NaN codes.
pub fn any_e4m3_nan(codes: &[u8]) -> bool {
    codes.chunks(64).any(|chunk| {
        chunk
            .iter()
            .fold(0u8, |acc, &b| acc | (b & 0x7F).wrapping_add(1))
            & 0x80
            != 0
    })
}

/// How a group's scale is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScaleType {
    /// bfloat16 (RAWINT4).
    Bf16,
    /// IEEE half (GPTQ).
    F16,
    /// OCP E8M0: `2^(u − 127)`, 0xFF NaN (MXFP4, MXFP8).
    E8M0,
    /// FP8 E4M3FN (NVFP4, times a per-tensor f32).
    E4M3,
}

impl ScaleType {
    /// Bytes per scale.
    pub fn size(self) -> usize {
        match self {
            ScaleType::Bf16 | ScaleType::F16 => 2,
            ScaleType::E8M0 | ScaleType::E4M3 => 1,
        }
    }

    /// The value of the stored bits (little-endian bytes widened to u16).
    #[inline]
    pub fn value(self, bits: u16) -> f32 {
        match self {
            ScaleType::Bf16 => bf16::from_bits(bits).to_f32(),
            ScaleType::F16 => f16::from_bits(bits).to_f32(),
            ScaleType::E8M0 => e8m0_to_f32(bits as u8),
            ScaleType::E4M3 => E4M3_VALUES[bits as usize & 0xFF],
        }
    }

    /// Whether the stored bits are a usable scale (finite, not NaN).
    pub fn is_valid(self, bits: u16) -> bool {
        match self {
            ScaleType::E8M0 => bits as u8 != 0xFF,
            _ => self.value(bits).is_finite(),
        }
    }

    /// The stored scale nearest above `s` (≥ s so `amax / scale` stays in the code range; for
    /// E8M0 the next power of two).
    pub fn encode_at_least(self, s: f32) -> u16 {
        match self {
            ScaleType::Bf16 => bf16::from_f32(s).to_bits(),
            ScaleType::F16 => f16::from_f32(s).to_bits(),
            ScaleType::E8M0 => {
                if s.is_nan() || s < f32::MIN_POSITIVE {
                    return 127;
                }
                // ⌈log2 s⌉ from the bits: the exponent, plus one unless s is a power of two.
                let bits = s.to_bits();
                let e = ((bits >> 23) & 0xFF) as i32 - 127 + (bits & 0x7F_FFFF != 0) as i32;
                (e + 127).clamp(1, 254) as u16
            }
            ScaleType::E4M3 => f32_to_e4m3(s) as u16,
        }
    }

    /// Read scale `i` from `ptr`.
    ///
    /// # Safety
    /// `ptr` holds at least `i + 1` scales of this type.
    #[inline]
    pub unsafe fn read(self, ptr: *const u8, i: usize) -> u16 {
        // SAFETY: the contract; unaligned reads (file offsets need not be aligned).
        unsafe {
            match self.size() {
                1 => *ptr.add(i) as u16,
                _ => (ptr as *const u16).add(i).read_unaligned(),
            }
        }
    }
}

/// Every E4M3FN byte's value (NaN for `0x7F`/`0xFF`): scales are read per group of 16 in
/// NVFP4's inner loops, where the branches and `powi` of [`e4m3_to_f32`] cost more than the
/// codes they scale.
static E4M3_VALUES: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut b = 0;
    while b < 256 {
        let (e, m) = ((b >> 3) & 0xF, (b & 7) as u32);
        let mag = if e == 0xF && m == 7 {
            f32::NAN
        } else if e == 0 {
            // m/8 · 2⁻⁶ = m · 2⁻⁹.
            m as f32 * (1.0 / 512.0)
        } else {
            f32::from_bits(((e as u32 + 120) << 23) | (m << 20))
        };
        t[b] = if b & 0x80 != 0 { -mag } else { mag };
        b += 1;
    }
    t
};

/// `2^(u − 127)` (u = 0 is 2⁻¹²⁷, an f32 subnormal); 0xFF (NaN) gives NaN.
#[inline]
pub fn e8m0_to_f32(u: u8) -> f32 {
    match u {
        0xFF => f32::NAN,
        0 => f32::from_bits(0x0040_0000),
        _ => f32::from_bits((u as u32) << 23),
    }
}

/// Where the codes of row `r`, input `c` sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodeLayout {
    /// Row-major: `[rows][cols · bits / 8]` bytes, nibble kinds low nibble first (even input).
    RowMajor,
    /// GPTQ `qweight`: i32 `[cols / 8][rows]`; bits `4j..4j+4` of word `(c / 8, r)` hold
    /// input `c = 8·(c/8) + j`.
    GptqColumns,
}

/// Where the scale of row `r`, group `g` sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleLayout {
    /// `[rows][cols / group]`.
    RowMajor,
    /// `[cols / group][rows]` (GPTQ `scales`).
    Transposed,
}

/// A group-scaled matrix where its file keeps it (see the module docs). Positions are
/// absolute: a sub-view moves `row0`/`col0`.
#[derive(Debug, Clone, Copy)]
pub struct CodedMatrix {
    /// What the codes stand for.
    pub kind: CodeKind,
    /// The codes.
    pub codes: *const u8,
    /// Their layout.
    pub layout: CodeLayout,
    /// The group scales.
    pub scales: *const u8,
    /// Their type.
    pub scale_type: ScaleType,
    /// Their layout.
    pub scale_layout: ScaleLayout,
    /// Inputs per scale.
    pub group: usize,
    /// Per-tensor factor on every value (NVFP4 `weight_scale_2`; 1 elsewhere).
    pub global: f32,
    /// Rows of the whole matrix.
    pub rows: usize,
    /// Inputs of the whole matrix.
    pub cols: usize,
    /// Absolute position of the view's `[0][0]`.
    pub row0: usize,
    /// See `row0`.
    pub col0: usize,
}

// SAFETY: plain addresses of read-only memory its creator keeps alive.
unsafe impl Send for CodedMatrix {}
// SAFETY: as above.
unsafe impl Sync for CodedMatrix {}

impl CodedMatrix {
    /// The code of view element `[r][c]` (a byte, or a nibble in the low bits).
    ///
    /// # Safety
    /// The memory is alive and `[r][c]` inside the view.
    #[inline]
    pub unsafe fn code(&self, r: usize, c: usize) -> u8 {
        let (r, c) = (self.row0 + r, self.col0 + c);
        // SAFETY: the contract; every index below is inside the whole matrix.
        unsafe {
            match (self.layout, self.kind.bits()) {
                (CodeLayout::RowMajor, 8) => *self.codes.add(r * self.cols + c),
                (CodeLayout::RowMajor, _) => {
                    let b = *self.codes.add(r * self.cols / 2 + c / 2);
                    if c % 2 == 0 {
                        b & 0xF
                    } else {
                        b >> 4
                    }
                }
                (CodeLayout::GptqColumns, _) => {
                    let word = (self.codes as *const u32)
                        .add((c / 8) * self.rows + r)
                        .read_unaligned();
                    ((word >> (4 * (c % 8))) & 0xF) as u8
                }
            }
        }
    }

    /// The stored scale bits of view row `r`'s group holding input `c`.
    ///
    /// # Safety
    /// As [`CodedMatrix::code`].
    #[inline]
    pub unsafe fn scale_bits(&self, r: usize, c: usize) -> u16 {
        let (r, g) = (self.row0 + r, (self.col0 + c) / self.group);
        let groups = self.cols / self.group;
        let i = match self.scale_layout {
            ScaleLayout::RowMajor => r * groups + g,
            ScaleLayout::Transposed => g * self.rows + r,
        };
        // SAFETY: the contract: i < rows · groups.
        unsafe { self.scale_type.read(self.scales, i) }
    }

    /// The value of view element `[r][c]`: code × group scale × global.
    ///
    /// # Safety
    /// As [`CodedMatrix::code`].
    #[inline]
    pub unsafe fn value(&self, r: usize, c: usize) -> f32 {
        // SAFETY: forwarded.
        unsafe {
            self.kind.value(self.code(r, c))
                * self.scale_type.value(self.scale_bits(r, c))
                * self.global
        }
    }
}

/// Quantize one group of `values` to `kind` codes with a `scale_type` scale (divided by
/// `global` first: the NVFP4 per-tensor factor, 1 elsewhere). Returns the stored scale bits and
/// writes one code per value (nibbles in the low 4 bits). The scalar twin of
/// [`crate::encode::quantize_row`].
pub fn quantize_group(
    kind: CodeKind,
    scale_type: ScaleType,
    global: f32,
    values: &[f32],
    codes: &mut [u8],
) -> u16 {
    let amax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (bits, scale) = group_scale(kind, scale_type, global, amax);
    for (c, &v) in codes.iter_mut().zip(values) {
        *c = match scale {
            Some(scale) => kind.encode(v / scale),
            None => kind.encode(0.0),
        };
    }
    bits
}

/// The stored scale bits of a group whose largest magnitude is `amax`, and the scale its values
/// are divided by (`None` where that is zero or not finite: every code is then zero's).
#[inline]
pub fn group_scale(
    kind: CodeKind,
    scale_type: ScaleType,
    global: f32,
    amax: f32,
) -> (u16, Option<f32>) {
    let wanted = amax / global / kind.max();
    let bits = if amax > 0.0 {
        scale_type.encode_at_least(wanted)
    } else {
        scale_type.encode_at_least(1.0)
    };
    let scale = scale_type.value(bits) * global;
    (bits, (scale > 0.0 && scale.is_finite()).then_some(scale))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_e4m3_nan_finds_each_nan_code_anywhere() {
        for len in [1usize, 63, 64, 65, 200] {
            let clean: Vec<u8> = (0..len).map(|i| (i as u8) % 0x7F).collect();
            assert!(!any_e4m3_nan(&clean), "{len}");
            for at in [0, len / 2, len - 1] {
                for nan in [0x7Fu8, 0xFF] {
                    let mut v = clean.clone();
                    v[at] = nan;
                    assert!(any_e4m3_nan(&v), "{len} {at} {nan:#x}");
                }
            }
        }
        assert!((0..=255u8).all(|b| any_e4m3_nan(&[b]) == CodeKind::E4M3.is_nan(b)));
    }

    #[test]
    fn e2m1_encodes_every_value_back() {
        for (i, &v) in E2M1_VALUES.iter().enumerate() {
            let c = CodeKind::E2M1.encode(v);
            assert_eq!(CodeKind::E2M1.value(c), v, "nibble {i}");
        }
        // Halfway between 1.5 (odd code 3) and 2 (even code 4): the even code.
        assert_eq!(CodeKind::E2M1.encode(1.75), 4);
        assert_eq!(CodeKind::E2M1.encode(-5.0), 0xE);
        assert_eq!(CodeKind::E2M1.encode(100.0), 7);
    }

    /// The definition the encoders implement: the nearest code, ties to the even code
    /// (E2M1) or the even integer (int4), saturating, NaN to the largest E2M1 magnitude or 0.
    fn nearest_code(kind: CodeKind, v: f32) -> u8 {
        match kind {
            CodeKind::E2M1 => {
                let a = v.abs().min(6.0);
                let mut best = 0u8;
                for c in 1..8u8 {
                    let (d, db) = (
                        (E2M1_VALUES[c as usize] - a).abs(),
                        (E2M1_VALUES[best as usize] - a).abs(),
                    );
                    if d < db || (d == db && c % 2 == 0) {
                        best = c;
                    }
                }
                if v.is_sign_negative() && best != 0 {
                    best | 8
                } else {
                    best
                }
            }
            _ => (v.round_ties_even().clamp(-8.0, 7.0) as i32 + 8) as u8,
        }
    }

    #[test]
    fn encoders_pick_the_nearest_code() {
        let mut rng = crate::rng::Rng::new(17);
        let mut values: Vec<f32> = rng.normals(20_000, 3.0);
        // Every tie and code value of both kinds, either sign, and the awkward ones.
        for i in -40..=40 {
            values.push(i as f32 * 0.25);
        }
        values.extend(
            E2M1_MIDPOINTS
                .iter()
                .flat_map(|m| [*m, -*m, m.next_up(), m.next_down()]),
        );
        values.extend([0.0, -0.0, 1e-30, -1e-30, 7.5, -8.5, 1e9, -1e9, 4.2e6, 8.4e6]);
        values.extend([
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN,
        ]);
        for kind in [CodeKind::E2M1, CodeKind::Int4] {
            for &v in &values {
                assert_eq!(kind.encode(v), nearest_code(kind, v), "{kind:?} {v}");
            }
        }
    }

    #[test]
    fn the_e4m3_table_is_the_decoder() {
        for b in 0..=255u8 {
            let (t, d) = (ScaleType::E4M3.value(b as u16), e4m3_to_f32(b));
            assert!(
                t.to_bits() == d.to_bits() || (t.is_nan() && d.is_nan()),
                "{b:#x}"
            );
        }
    }

    #[test]
    fn int4_and_e8m0() {
        assert_eq!(CodeKind::Int4.encode(-9.0), 0);
        assert_eq!(CodeKind::Int4.encode(2.5), 10);
        assert_eq!(CodeKind::Int4.value(10), 2.0);
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(120), 2f32.powi(-7));
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
        assert_eq!(ScaleType::E8M0.encode_at_least(0.3), 126);
        assert!(!ScaleType::E8M0.is_valid(0xFF));
    }

    #[test]
    fn quantized_groups_reproduce_their_values_within_half_a_step() {
        let mut rng = crate::rng::Rng::new(5);
        for (kind, st) in [
            (CodeKind::Int4, ScaleType::Bf16),
            (CodeKind::Int4, ScaleType::F16),
            (CodeKind::E2M1, ScaleType::E8M0),
            (CodeKind::E4M3, ScaleType::E8M0),
        ] {
            let v: Vec<f32> = (0..32).map(|_| rng.normal() * 0.05).collect();
            let mut codes = [0u8; 32];
            let bits = quantize_group(kind, st, 1.0, &v, &mut codes);
            let s = st.value(bits);
            let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert!(s * kind.max() >= amax * 0.999, "{kind:?} scale too small");
            for (c, x) in codes.iter().zip(&v) {
                let back = kind.value(*c) * s;
                // The coarsest step of each kind relative to the scale.
                let step = match kind {
                    CodeKind::Int4 => s,
                    CodeKind::E2M1 => 2.0 * s,
                    CodeKind::E4M3 => 32.0 * s,
                };
                assert!(
                    (back - x).abs() <= step / 2.0 + 1e-7,
                    "{kind:?}: {x} -> {back}"
                );
            }
        }
    }
}
