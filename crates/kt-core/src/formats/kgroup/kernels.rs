//! Kernels of the group-scaled formats: codes in panel order, one scale per row and group.
//!
//! A panel *line* is one input pair of 32 rows: 64 one-byte codes (value `v` is byte `v`) or 32
//! bytes of nibbles (byte `j` is row `j`, low nibble the even input). Either way row `j`'s two
//! values are the `j`-th 32-bit lane of the decoded line, so one f32 vector of 16 row scales
//! serves both inputs, with no shuffles:
//! - [`DecodeFn`]: lines to the bf16 panel the bf16 kernels read, each value times its group
//!   scale, rounded to nearest even (exact for E4M3/E2M1 times a power of two or an E4M3
//!   scale; int4 times a bf16/f16 scale rounds once);
//! - [`FusedFn`]: one to four token rows straight from the codes, in fp32: per group the
//!   products are summed unscaled, then the sum times the rows' scales is added (two FMAs per
//!   code and row, one per group and row);
//! - [`FusedPow2Fn`]: E4M3 codes with E8M0 scales against 3 to 12 rows (AVX2): each 128-input
//!   block decoded once without its scales, the rows' sums carried in units of the current
//!   group's power of two; the decoded-block path's bits.
//!
//! Values come from a 16-entry table for nibbles (`vpermps` on AVX-512; two 8-entry lookups
//! and a blend on the nibble's top bit on AVX2) and from the exact E4M3 decoders of
//! [`crate::formats::fp8::kernels`] for bytes. The scalar twins ([`decode_scalar`],
//! [`fused_scalar`]) do the same operations in the same order: every variant is bit-identical.
use crate::codes::{CodeKind, ScaleType};
use crate::dtype::{e4m3_to_f32, f32_to_bf16_bits};
use crate::isa::Level;

/// Rows per call of the fused kernels.
pub const FUSED_ROWS: usize = 4;

/// Decode `lines` panel lines of `codes` into bf16 values at `out` (64 per line), each times
/// its group's scale (`scales`: 32 per group as stored, of `scale_type`, a group being
/// `group_lines` lines). The vector decoders widen the stored scales themselves: converting
/// them one by one beforehand took a third of the decoding time of NVFP4's E4M3 scales.
///
/// # Safety
/// `codes` holds `lines` lines of the kernel's code width, `scales` `32·lines/group_lines`
/// scales of `scale_type` (none NaN), `out` `64·lines` writable u16; `group_lines` divides
/// `lines`; `table` is the value table of nibble codes (ignored for bytes); no NaN codes; the
/// CPU has the variant's features.
pub type DecodeFn = unsafe fn(
    codes: *const u8,
    lines: usize,
    group_lines: usize,
    scales: *const u8,
    scale_type: ScaleType,
    table: &[f32; 16],
    out: *mut u16,
);

/// `out[r·32 + j] += Σ_g scales[32g + j] · (Σ_{lines q of g} v[j][2q]·a[r][2q] + Σ_q v[j][2q+1]·a[r][2q+1])`
/// for `lines` lines (`a[r]` points at the first line's even input); the even and odd sums
/// are separate FMA chains.
///
/// # Safety
/// `a` holds 1..=[`FUSED_ROWS`] rows (the variant's `rows` at most) of `2·lines` readable f32;
/// `out` 32 per row; the rest as [`DecodeFn`].
pub type FusedFn = unsafe fn(
    a: &[*const f32],
    lines: usize,
    group_lines: usize,
    codes: *const u8,
    scales: *const u8,
    scale_type: ScaleType,
    out: *mut f32,
);

/// [`DecodeFn`] for power-of-two scales given as exponents (E8M0 bytes: the scale of a byte
/// `e` is 2^(e−127)): each value's bf16 exponent field is moved by `e − 127`, with no
/// multiply. Exact, and equal to [`DecodeFn`] with the scales as f32, when every product is
/// a normal number: exponents inside the decoder's [`Pow2Decoder::exponents`].
///
/// # Safety
/// As [`DecodeFn`], with `exps` holding `32·lines/group_lines` bytes inside the decoder's
/// exponent range.
pub type DecodePow2Fn = unsafe fn(
    codes: *const u8,
    lines: usize,
    group_lines: usize,
    exps: *const u8,
    table: &[f32; 16],
    out: *mut u16,
);

/// Lines per block of [`FusedPow2Fn`]: 128 inputs, as the decoded-block path takes them.
pub const POW2_BLOCK_LINES: usize = 64;

/// What [`FusedPow2Fn`] multiplies its rows by first (2⁶⁴: with the codes as value · 2⁻¹²⁰,
/// no product comes near fp32's denormals); a caller may hand it rows already multiplied.
pub const POW2_ROW_SCALE: f32 = crate::formats::ROWS_UP64;

/// `out[r·32 + j] =` the decoded-block path's result for E4M3 codes and E8M0 group scales
/// (exponents `exps`, 32 per group): per block of [`POW2_BLOCK_LINES`] lines, one FMA chain
/// per row and output over the block's inputs (input 2q, then 2q+1) of `value · 2^(e − 127)`,
/// the block sums added in block order ([`fused_many_pow2_scalar`]). A kernel for many rows
/// that never decodes the scaled values: it is bit-identical to the twin while every
/// intermediate is a normal float, which [`FusedPow2::applies`] checks on the exponents;
/// results that come out non-finite mean an intermediate overflowed (redo them another way).
///
/// # Safety
/// As [`FusedFn`] with up to [`crate::kernels::MAX_ROWS`] rows, `exps` holding
/// `32·lines/group_lines` bytes; `lines` a multiple of [`POW2_BLOCK_LINES`] and `group_lines`
/// a divisor of it; `out` 32 writable f32 per row. With `scaled`, the rows hold the inputs
/// times [`POW2_ROW_SCALE`] (exactly: no overflow).
pub type FusedPow2Fn = unsafe fn(
    a: &[*const f32],
    scaled: bool,
    lines: usize,
    group_lines: usize,
    codes: *const u8,
    exps: *const u8,
    out: *mut f32,
);

/// A [`FusedPow2Fn`] and the rows for which it beats the decoded-block path.
#[derive(Debug, Clone)]
pub struct FusedPow2 {
    /// The kernel.
    pub kernel: FusedPow2Fn,
    /// The row counts it takes (fewer go to the few-row fused kernel; with more, one decode
    /// per block serves enough rows to beat its per-group steps).
    pub rows: std::ops::RangeInclusive<usize>,
}

impl FusedPow2 {
    /// Exponents apart by more than this keep the decoded-block path: the kernel carries a
    /// block's sums in units of the current group's scale, and a wider spread could push
    /// them out of fp32's normal range.
    pub const MAX_SPREAD: u8 = 64;

    /// Whether the kernel gives the twin's bits for a panel with these exponents (every
    /// product normal: [`E4M3_POW2_EXPONENTS`], and at most [`Self::MAX_SPREAD`] apart).
    pub fn applies(exps: &[u8]) -> bool {
        // A branch-free fold (vector min/max), as the decoded-block path's range test.
        let (least, most) = exps
            .iter()
            .fold((u8::MAX, u8::MIN), |(a, b), &e| (a.min(e), b.max(e)));
        E4M3_POW2_EXPONENTS.contains(&least)
            && E4M3_POW2_EXPONENTS.contains(&most)
            && most - least <= Self::MAX_SPREAD
    }
}

/// A [`DecodePow2Fn`] and the E8M0 exponents for which its products stay normal numbers.
#[derive(Debug, Clone)]
pub struct Pow2Decoder {
    /// The decoder.
    pub decode: DecodePow2Fn,
    /// E2M1 (magnitudes 0.5..=6): 2..=252; E4M3 (2⁻⁹..=448): 10..=246.
    pub exponents: std::ops::RangeInclusive<u8>,
}

/// E8M0 exponents for which E2M1 values times 2^(e−127) are normal numbers
/// (0.5·2^(2−127) = 2⁻¹²⁶ up to 6·2^(252−127) < 2¹²⁸).
pub const E2M1_POW2_EXPONENTS: std::ops::RangeInclusive<u8> = 2..=252;

/// The same for E4M3 values (2⁻⁹·2^(10−127) = 2⁻¹²⁶ up to 448·2^(246−127) < 2¹²⁸).
pub const E4M3_POW2_EXPONENTS: std::ops::RangeInclusive<u8> = 10..=246;

/// The kernels of one code kind at one ISA level.
#[derive(Debug, Clone)]
pub struct KGroupKernels {
    /// The decoder ([`DecodeFn`]).
    pub decode: DecodeFn,
    /// The power-of-two decoder, where the level has one.
    pub decode_pow2: Option<Pow2Decoder>,
    /// The fused few-row kernel, if the level has one, and the rows it takes.
    pub fused: Option<(FusedFn, usize)>,
    /// The many-row kernel for E8M0 scales, where the level has one.
    pub fused_pow2: Option<FusedPow2>,
    /// Name, as the layer's `kernel` reports it.
    pub name: &'static str,
}

/// The widest kernels `level` allows for `kind`.
pub fn kernels_for(kind: CodeKind, level: Level) -> KGroupKernels {
    let bytes = kind.bits() == 8;
    #[cfg(target_arch = "x86_64")]
    {
        if level >= Level::Avx512Base {
            // With AVX512-BF16 the decoders round with vcvtne2ps2bf16 (2 instructions per 32
            // values instead of 10): 40% of a 512-token RAWINT4 layer was the decoder on AMX.
            let bf16 = level >= Level::Avx512Bf16;
            return if bytes {
                KGroupKernels {
                    decode: if bf16 {
                        x86::decode_bytes_avx512bf16
                    } else {
                        x86::decode_bytes_avx512
                    },
                    fused: fused_bytes_for(level, crate::isa::flush_subnormal_codes()),
                    // The exact E4M3 decode needs VBMI's byte lookups.
                    decode_pow2: (level >= Level::Avx512Vbmi).then_some(Pow2Decoder {
                        decode: x86::decode_bytes_pow2_vbmi,
                        exponents: E4M3_POW2_EXPONENTS,
                    }),
                    name: "avx512",
                    fused_pow2: None,
                }
            } else {
                KGroupKernels {
                    decode: if bf16 {
                        x86::decode_nibbles_avx512bf16
                    } else {
                        x86::decode_nibbles_avx512
                    },
                    // 4-bit codes take the integer kernels ([`super::int_dot`]).
                    fused: None,
                    decode_pow2: Some(Pow2Decoder {
                        decode: x86::decode_nibbles_pow2_avx512,
                        exponents: E2M1_POW2_EXPONENTS,
                    }),
                    name: "avx512",
                    fused_pow2: None,
                }
            };
        }
        if level >= Level::Avx2 {
            return if bytes {
                KGroupKernels {
                    decode: x86::decode_bytes_avx2,
                    fused: fused_bytes_for(level, crate::isa::flush_subnormal_codes()),
                    fused_pow2: Some(fused_pow2_avx2(crate::isa::flush_subnormal_codes())),
                    decode_pow2: Some(Pow2Decoder {
                        decode: x86::decode_bytes_pow2_avx2,
                        exponents: E4M3_POW2_EXPONENTS,
                    }),
                    name: "avx2",
                }
            } else {
                KGroupKernels {
                    decode: x86::decode_nibbles_avx2,
                    fused: None,
                    decode_pow2: None,
                    name: "avx2",
                    fused_pow2: None,
                }
            };
        }
    }
    let _ = level;
    KGroupKernels {
        decode: if bytes {
            decode_scalar::<8>
        } else {
            decode_scalar::<4>
        },
        fused: None,
        decode_pow2: None,
        name: "scalar",
        fused_pow2: None,
    }
}

/// The fused kernel for E4M3 codes `level` allows, if any, and the rows it takes: subnormal
/// codes read as zero (`flush`) or exactly ([`crate::isa::flush_subnormal_codes`]).
pub fn fused_bytes_for(level: Level, flush: bool) -> Option<(FusedFn, usize)> {
    #[cfg(target_arch = "x86_64")]
    {
        return match (level >= Level::Avx512Base, flush) {
            _ if level < Level::Avx2 => None,
            (true, false) => Some((x86::fused_bytes_avx512::<false>, FUSED_ROWS)),
            (true, true) => Some((x86::fused_bytes_avx512::<true>, FUSED_ROWS)),
            (false, false) => Some((x86::fused_bytes_avx2::<false>, 2)),
            (false, true) => Some((x86::fused_bytes_avx2::<true>, 2)),
        };
    }
    #[allow(unreachable_code)]
    {
        let _ = (level, flush);
        None
    }
}

/// The byte holding row `j`'s two nibbles of line `q` in a panel of 4-bit codes: per block of
/// 8 inputs, each row's 4 bytes (its 8 nibbles, in input order) in one 32-bit word, the 32
/// rows' words in row order. A 64-byte load is then 16 rows × 8 inputs, which both the
/// bf16 decoder (a shift picks the line) and the integer dot kernels (a mask picks the even
/// or odd inputs) read without byte shuffles.
#[inline(always)]
pub fn nibble_byte(q: usize, j: usize) -> usize {
    (q / 4) * 128 + 4 * j + q % 4
}

/// Row `j`'s two values in line `q` (even input, odd input).
///
/// # Safety
/// `codes` holds line `q` of `BITS`-bit codes; `j < 32`.
#[inline(always)]
unsafe fn line_values<const BITS: usize>(
    codes: *const u8,
    q: usize,
    j: usize,
    table: &[f32; 16],
) -> (f32, f32) {
    // SAFETY: the contract.
    unsafe {
        if BITS == 8 {
            let line = codes.add(q * 64);
            (
                e4m3_to_f32(*line.add(2 * j)),
                e4m3_to_f32(*line.add(2 * j + 1)),
            )
        } else {
            let b = *codes.add(nibble_byte(q, j));
            (table[(b & 0xF) as usize], table[(b >> 4) as usize])
        }
    }
}

/// The AVX2 [`FusedPow2`] kernel, subnormal codes read as zero (`flush`) or exactly.
#[cfg(target_arch = "x86_64")]
fn fused_pow2_avx2(flush: bool) -> FusedPow2 {
    FusedPow2 {
        kernel: if flush {
            x86::fused_pow2_avx2::<true>
        } else {
            x86::fused_pow2_avx2::<false>
        },
        // Up to 2 rows the few-row fused kernel runs (AVX2's takes 2). AMD Zen 3, one core,
        // K = 2048 (`pow2_rows`, GFLOP/s best/median, this kernel against the decoded
        // blocks): from cache 3 rows 32.0/29.5 against 21.4/20.8, 8 rows 44.8/39.4 against
        // 38.7/35.7, 12 rows even, 32 rows 46.5/45.3 against 53.8/52.2.
        rows: 3..=12,
    }
}

/// The scalar twin of [`FusedPow2Fn`] (codes valued as
/// [`crate::formats::fp8::kernels::fused_code_value`]; exact, it is the decoded-block path:
/// the E4M3 decoders and the fp32 kernels' chains, blocks added as `add_decoded_block` adds).
///
/// # Safety
/// The [`FusedPow2Fn`] contract (any number of rows).
pub unsafe fn fused_pow2_scalar<const FLUSH: bool>(
    a: &[*const f32],
    scaled: bool,
    lines: usize,
    group_lines: usize,
    codes: *const u8,
    exps: *const u8,
    out: *mut f32,
) {
    use crate::formats::fp8::kernels::fused_code_value;
    // SAFETY: the contract.
    unsafe {
        for (r, &x) in a.iter().enumerate() {
            for j in 0..32 {
                let mut total = 0f32;
                for b in 0..lines / POW2_BLOCK_LINES {
                    let mut sum = 0f32;
                    for q in b * POW2_BLOCK_LINES..(b + 1) * POW2_BLOCK_LINES {
                        // 2^(e − 127): the f32 with exponent field e.
                        let e = *exps.add((q / group_lines) * 32 + j);
                        let s = f32::from_bits(u32::from(e) << 23);
                        let line = codes.add(q * 64 + 2 * j);
                        let (even, odd) = (*line, *line.add(1));
                        // The rows' inputs, as given (a scaled row is scaled back exactly).
                        let input = |i: usize| match scaled {
                            true => *x.add(i) / POW2_ROW_SCALE,
                            false => *x.add(i),
                        };
                        sum = (fused_code_value::<FLUSH>(even) * s).mul_add(input(2 * q), sum);
                        sum = (fused_code_value::<FLUSH>(odd) * s).mul_add(input(2 * q + 1), sum);
                    }
                    total = if b == 0 { sum } else { total + sum };
                }
                *out.add(r * 32 + j) = total;
            }
        }
    }
}

/// The scalar twin of the decoders (and the decoder of CPUs without AVX2).
///
/// # Safety
/// The [`DecodeFn`] contract.
pub unsafe fn decode_scalar<const BITS: usize>(
    codes: *const u8,
    lines: usize,
    group_lines: usize,
    scales: *const u8,
    scale_type: ScaleType,
    table: &[f32; 16],
    out: *mut u16,
) {
    // SAFETY: the contract.
    unsafe {
        for q in 0..lines {
            let g = (q / group_lines) * 32;
            for j in 0..32 {
                let s = scale_type.value(scale_type.read(scales, g + j));
                let (lo, hi) = line_values::<BITS>(codes, q, j, table);
                *out.add(q * 64 + 2 * j) = f32_to_bf16_bits(lo * s);
                *out.add(q * 64 + 2 * j + 1) = f32_to_bf16_bits(hi * s);
            }
        }
    }
}

/// The scalar twin of the fused kernels (E4M3 codes, valued as
/// [`crate::formats::fp8::kernels::fused_code_value`]).
///
/// # Safety
/// The [`FusedFn`] contract (any number of rows).
pub unsafe fn fused_scalar<const FLUSH: bool>(
    a: &[*const f32],
    lines: usize,
    group_lines: usize,
    codes: *const u8,
    scales: *const u8,
    st: ScaleType,
    out: *mut f32,
) {
    use crate::formats::fp8::kernels::fused_code_value;
    // SAFETY: the contract.
    unsafe {
        for (r, &x) in a.iter().enumerate() {
            for j in 0..32 {
                let mut total = 0f32;
                for g in 0..lines / group_lines {
                    let (mut even, mut odd) = (0f32, 0f32);
                    for q in g * group_lines..(g + 1) * group_lines {
                        let line = codes.add(q * 64 + 2 * j);
                        let (lo, hi) = (
                            fused_code_value::<FLUSH>(*line),
                            fused_code_value::<FLUSH>(*line.add(1)),
                        );
                        even = lo.mul_add(*x.add(2 * q), even);
                        odd = hi.mul_add(*x.add(2 * q + 1), odd);
                    }
                    let s = st.value(st.read(scales, g * 32 + j));
                    total = (even + odd).mul_add(s, total);
                }
                *out.add(r * 32 + j) += total;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::int_dot::x86::{scales16, scales8};
    use crate::codes::ScaleType;
    use crate::formats::fp8::kernels::x86::{
        decode16_bf16_times, decode16_down120, decode8, e4m3x32_to_bf16, prefetch_ahead,
        top_codes256, top_codes512,
    };
    use std::arch::x86_64::*;

    /// Round f32 lanes to bf16, nearest even (in the upper 16 bits of each lane).
    #[inline(always)]
    unsafe fn rne512(v: __m512) -> __m512i {
        // SAFETY: register arithmetic; the caller has AVX-512F.
        unsafe {
            let x = _mm512_castps_si512(v);
            let odd = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
            _mm512_add_epi32(x, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)))
        }
    }

    /// Two rounded lanes (even input `lo`, odd `hi`) as one lane of two bf16.
    #[inline(always)]
    unsafe fn pair512(lo: __m512, hi: __m512) -> __m512i {
        // SAFETY: register arithmetic; the caller has AVX-512F.
        unsafe {
            // 0xD8: bits of b where the mask c is set, else bits of a.
            _mm512_ternarylogic_epi32(
                _mm512_srli_epi32(rne512(lo), 16),
                rne512(hi),
                _mm512_set1_epi32(0xFFFF_0000u32 as i32),
                0xD8,
            )
        }
    }

    /// Rows `16h..16h+16` of nibble line `q`: (even-input values, odd-input values).
    #[inline(always)]
    unsafe fn nibbles512(codes: *const u8, q: usize, h: usize, table: __m512) -> (__m512, __m512) {
        // SAFETY: the caller's contract: the 8-input block of line q exists. `vpermps` reads
        // the low 4 bits of each lane: the line's byte shifted down is its even nibble.
        unsafe {
            let words = codes.add((q / 4) * 128 + 64 * h) as *const __m512i;
            let d = _mm512_srlv_epi32(
                _mm512_loadu_si512(words),
                _mm512_set1_epi32(8 * (q % 4) as i32),
            );
            (
                _mm512_permutexvar_ps(d, table),
                _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table),
            )
        }
    }

    /// Rows `16h..16h+16` of byte line `q` (E4M3).
    #[inline(always)]
    unsafe fn bytes512(codes: *const u8, q: usize, h: usize) -> (__m512, __m512) {
        // SAFETY: the caller's contract: 32 bytes of line q exist; no NaN codes.
        unsafe {
            let w = e4m3x32_to_bf16(_mm256_loadu_si256(
                codes.add(q * 64 + 32 * h) as *const __m256i
            ));
            (
                _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)),
                _mm512_castsi512_ps(_mm512_and_si512(
                    w,
                    _mm512_set1_epi32(0xFFFF_0000u32 as i32),
                )),
            )
        }
    }

    /// [`bytes512`] with the (unused) table argument of the nibble variant.
    #[inline(always)]
    unsafe fn bytes512_t(codes: *const u8, q: usize, h: usize, _t: __m512) -> (__m512, __m512) {
        // SAFETY: forwarded.
        unsafe { bytes512(codes, q, h) }
    }

    /// [`pair512`] with `vcvtne2ps2bf16`: both halves rounded to nearest even in one
    /// instruction, then interleaved with one `vpermw`. Equal to [`pair512`] for every value
    /// but denormal ones, which the instruction flushes to signed zero (a weight below 1e-38;
    /// [`pair512`] rounds it).
    #[inline(always)]
    unsafe fn pair512_bf16(lo: __m512, hi: __m512) -> __m512i {
        /// 16-bit lane i of the result: lo[i/2] for even i, hi[i/2] (at 16 + i/2) for odd i.
        const INTERLEAVE: [u16; 32] = {
            let mut idx = [0u16; 32];
            let mut i = 0;
            while i < 32 {
                idx[i] = (i / 2 + 16 * (i % 2)) as u16;
                i += 1;
            }
            idx
        };
        // SAFETY: register arithmetic and a 64-byte read of a constant; the caller has
        // AVX-512F/BW/BF16.
        unsafe {
            // Lanes 0..16 from the second operand, 16..32 from the first.
            let both: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            let idx = _mm512_loadu_si512(INTERLEAVE.as_ptr() as *const __m512i);
            _mm512_permutexvar_epi16(idx, both)
        }
    }

    /// Code bytes per line (two inputs of the panel's 32 rows) of 4-bit and 8-bit codes.
    const NIBBLE_LINE: usize = 32;
    /// See [`NIBBLE_LINE`].
    const BYTE_LINE: usize = 64;

    macro_rules! decoder512 {
        ($decode:ident, $values:ident, $line_bytes:expr) => {
            decoder512!($decode, $values, $line_bytes, pair512, "avx512f,avx512bw");
        };
        ($decode:ident, $values:ident, $line_bytes:expr, $pair:ident, $features:literal) => {
            #[target_feature(enable = $features)]
            unsafe fn $decode(
                codes: *const u8,
                lines: usize,
                group_lines: usize,
                scales: *const u8,
                scale_type: ScaleType,
                table: &[f32; 16],
                out: *mut u16,
            ) {
                // SAFETY: the DecodeFn contract.
                unsafe {
                    let t = _mm512_loadu_ps(table.as_ptr());
                    let line_bytes: usize = $line_bytes;
                    let ss = scale_type.size();
                    // Groups outer: no division per line.
                    for g in 0..lines / group_lines {
                        let s = scales.add(g * 32 * ss);
                        let sv = [
                            scales16(s, scale_type),
                            scales16(s.add(16 * ss), scale_type),
                        ];
                        for q in g * group_lines..(g + 1) * group_lines {
                            if (q * line_bytes) % 64 == 0 {
                                prefetch_ahead(codes, q * line_bytes, lines * line_bytes);
                            }
                            for (h, sv) in sv.iter().enumerate() {
                                let (lo, hi) = $values(codes, q, h, t);
                                let v = $pair(_mm512_mul_ps(lo, *sv), _mm512_mul_ps(hi, *sv));
                                _mm512_storeu_si512(out.add(q * 64 + 32 * h) as *mut __m512i, v);
                            }
                        }
                    }
                }
            }
        };
    }

    /// Activations times 2⁶⁴ and group scales times 2⁵⁶ cancel the 2⁻¹²⁰ of [`small512`]'s
    /// values, keeping every product far from fp32's denormals: powers of two, so each sum is
    /// the unscaled one exactly scaled.
    const UP: f32 = super::POW2_ROW_SCALE; // 2⁶⁴
    /// See [`UP`].
    const DOWN: f32 = crate::formats::SCALES_DOWN56;
    /// Lines whose activations the AVX2 fused kernel scales by [`UP`] at a time (an MXFP8
    /// group).
    const WINDOW_LINES: usize = 16;

    /// Line `q`'s E4M3 codes as value · 2⁻¹²⁰ in two pairs of f32 vectors, (input `2q`, input
    /// `2q+1`) for the rows fed by `vpunpcklbw` and by `vpunpckhbw` (see [`ROWS_512`]). A code
    /// at the top of a 16-bit lane, shifted right arithmetically by 4 and masked to `s000 0eee
    /// emmm 0000`, is the bf16 of that value (subnormal codes exact as bf16 denormals, or zero
    /// with `FLUSH`: [`top_codes512`]); a shift or a mask makes it an f32. Five integer ops per
    /// 32 codes.
    #[inline(always)]
    unsafe fn small512<const FLUSH: bool>(codes: *const u8, q: usize) -> [(__m512, __m512); 2] {
        // SAFETY: the caller's contract: line q's 64 bytes exist; AVX-512BW.
        unsafe {
            let v = _mm512_loadu_si512(codes.add(q * 64) as *const __m512i);
            let zero = _mm512_setzero_si512();
            let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
            // No closures here: one left out of line calls every intrinsic out of line (the
            // MXFP8 kernel ran at 130 ns per line so on AMD Zen 4).
            let lo = top_codes512::<FLUSH>(_mm512_unpacklo_epi8(zero, v));
            let hi = top_codes512::<FLUSH>(_mm512_unpackhi_epi8(zero, v));
            [
                (
                    _mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)),
                    _mm512_castsi512_ps(_mm512_and_si512(lo, high)),
                ),
                (
                    _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)),
                    _mm512_castsi512_ps(_mm512_and_si512(hi, high)),
                ),
            ]
        }
    }

    /// Row of lane `i` of [`small512`]'s vectors `u` (0: `vpunpcklbw`, 1: `vpunpckhbw`): the
    /// 128-bit lane `i / 4` holds rows `8·(i / 4)..+8` of the line, two bytes per row, and the
    /// low (high) 8 bytes of it are its first (last) four rows.
    const fn row_512(u: usize, i: usize) -> i32 {
        (8 * (i / 4) + 4 * u + i % 4) as i32
    }

    /// [`row_512`] of every lane, as `vpermt2ps` indices into (rows 0..16, rows 16..32).
    const ROWS_512: [[i32; 16]; 2] = {
        let mut rows = [[0; 16]; 2];
        let mut i = 0;
        while i < 32 {
            rows[i / 16][i % 16] = row_512(i / 16, i % 16);
            i += 1;
        }
        rows
    };

    /// For rows `16h..16h+16`, the (vector, lane) of [`small512`]'s layout as `vpermt2ps`
    /// indices into (vector 0, vector 1): the inverse of [`ROWS_512`].
    const LANES_512: [[i32; 16]; 2] = {
        let mut lanes = [[0; 16]; 2];
        let mut i = 0;
        while i < 32 {
            let row = row_512(i / 16, i % 16) as usize;
            lanes[row / 16][row % 16] = i as i32;
            i += 1;
        }
        lanes
    };

    /// The AVX-512 fused kernel on `R` rows: per line, one 64-byte load and [`small512`]
    /// feed `4·R` FMAs. Each output lane keeps the scalar twin's even and odd sums and its
    /// order of operations; only the lanes' rows are permuted (the group scales to match, the
    /// totals back at the end).
    #[target_feature(enable = "avx512f,avx512bw")]
    #[allow(clippy::needless_range_loop)] // register blocks read best as indexed loops
    unsafe fn fused_bytes_rows512<const R: usize, const FLUSH: bool>(
        a: &[*const f32],
        lines: usize,
        group_lines: usize,
        codes: *const u8,
        scales: *const u8,
        scale_type: ScaleType,
        out: *mut f32,
    ) {
        // SAFETY: the FusedFn contract with exactly R rows: every line, input, scale and output
        // read or written below is inside the caller's buffers.
        unsafe {
            let ss = scale_type.size();
            let load = |t: &[i32; 16]| _mm512_loadu_si512(t.as_ptr() as *const __m512i);
            let rows = [load(&ROWS_512[0]), load(&ROWS_512[1])];
            let mut total = [[_mm512_setzero_ps(); 2]; R];
            let dist =
                crate::kernels::prefetch::distance_of(crate::kernels::prefetch::Family::CodeGroups);
            for g in 0..lines / group_lines {
                // Even and odd inputs in separate sums: four FMA chains per row.
                let mut even = [[_mm512_setzero_ps(); 2]; R];
                let mut odd = [[_mm512_setzero_ps(); 2]; R];
                for q in g * group_lines..(g + 1) * group_lines {
                    crate::kernels::prefetch::ahead(codes.add(q * 64), dist);
                    let values = small512::<FLUSH>(codes, q);
                    for r in 0..R {
                        let x = a[r].add(2 * q);
                        let (x0, x1) = (_mm512_set1_ps(*x * UP), _mm512_set1_ps(*x.add(1) * UP));
                        for (u, &(lo, hi)) in values.iter().enumerate() {
                            even[r][u] = _mm512_fmadd_ps(lo, x0, even[r][u]);
                            odd[r][u] = _mm512_fmadd_ps(hi, x1, odd[r][u]);
                        }
                    }
                }
                let at = |h: usize| scales16(scales.add((g * 32 + 16 * h) * ss), scale_type);
                let (s0, s1) = (at(0), at(1));
                for u in 0..2 {
                    let sv = _mm512_mul_ps(
                        _mm512_set1_ps(DOWN),
                        _mm512_permutex2var_ps(s0, rows[u], s1),
                    );
                    for r in 0..R {
                        let sum = _mm512_add_ps(even[r][u], odd[r][u]);
                        total[r][u] = _mm512_fmadd_ps(sum, sv, total[r][u]);
                    }
                }
            }
            let lanes = [load(&LANES_512[0]), load(&LANES_512[1])];
            for r in 0..R {
                for h in 0..2 {
                    let o = out.add(r * 32 + 16 * h);
                    let t = _mm512_permutex2var_ps(total[r][0], lanes[h], total[r][1]);
                    _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), t));
                }
            }
        }
    }

    /// A public fused kernel: `$rows::<R>` for the listed row counts, with the
    /// [`super::FusedFn`] signature.
    macro_rules! fused_entry {
        ($(#[$doc:meta])* $name:ident, $rows:ident, $label:literal, $($r:literal)+) => {
            $(#[$doc])*
            pub unsafe fn $name<const FLUSH: bool>(
                a: &[*const f32],
                lines: usize,
                group_lines: usize,
                codes: *const u8,
                scales: *const u8,
                scale_type: ScaleType,
                out: *mut f32,
            ) {
                // SAFETY: forwarded.
                unsafe {
                    crate::kernels::dispatch_rows!(
                        $rows<FLUSH>, $label, a,
                        (a, lines, group_lines, codes, scales, scale_type, out); $($r)+
                    )
                }
            }
        };
    }

    fused_entry!(
        /// The AVX-512 fused kernel (1 to 4 rows).
        ///
        /// # Safety
        /// The [`super::FusedFn`] contract; AVX-512F/BW available.
        fused_bytes_avx512, fused_bytes_rows512, "kgroup avx512 fused panel", 1 2 3 4
    );

    decoder512!(decode_nibbles512, nibbles512, NIBBLE_LINE);
    decoder512!(decode_bytes512, bytes512_t, BYTE_LINE);
    decoder512!(
        decode_nibbles512bf16,
        nibbles512,
        NIBBLE_LINE,
        pair512_bf16,
        "avx512f,avx512bw,avx512bf16"
    );
    decoder512!(
        decode_bytes512bf16,
        bytes512_t,
        BYTE_LINE,
        pair512_bf16,
        "avx512f,avx512bw,avx512bf16"
    );

    /// Round f32 lanes to bf16, nearest even (upper 16 bits of each lane).
    #[inline(always)]
    unsafe fn rne256(v: __m256) -> __m256i {
        // SAFETY: register arithmetic; the caller has AVX2.
        unsafe {
            let x = _mm256_castps_si256(v);
            let odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
            _mm256_add_epi32(x, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)))
        }
    }

    /// The table entries of nibbles `i` (low 4 bits of each lane) from a 16-entry table held
    /// as two halves: the nibble's bit 3 moved to the sign bit picks the upper half.
    #[inline(always)]
    unsafe fn look256(t: (__m256, __m256), i: __m256i) -> __m256 {
        // SAFETY: register arithmetic; the caller has AVX2.
        unsafe {
            _mm256_blendv_ps(
                _mm256_permutevar8x32_ps(t.0, i),
                _mm256_permutevar8x32_ps(t.1, i),
                _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)),
            )
        }
    }

    /// 64-bit quarters 0, 2, 1, 3 of `v`.
    #[inline(always)]
    unsafe fn lanes_in_order(v: __m256) -> __m256 {
        // SAFETY: register arithmetic; the caller has AVX2.
        unsafe { _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0b11_01_10_00)) }
    }

    /// Rows `8o..8o+8` of nibble line `q`, from a 16-entry table held as two halves.
    #[inline(always)]
    unsafe fn nibbles256(
        codes: *const u8,
        q: usize,
        o: usize,
        t: (__m256, __m256),
    ) -> (__m256, __m256) {
        // SAFETY: the caller's contract: the 8-input block of line q exists. The table lookup
        // reads the low 4 bits of each lane (the blend bit 3).
        unsafe {
            let words = codes.add((q / 4) * 128 + 32 * o) as *const __m256i;
            let d = _mm256_srlv_epi32(
                _mm256_loadu_si256(words),
                _mm256_set1_epi32(8 * (q % 4) as i32),
            );
            (look256(t, d), look256(t, _mm256_srli_epi32(d, 4)))
        }
    }

    /// Rows `8o..8o+8` of byte line `q` (E4M3).
    #[inline(always)]
    unsafe fn bytes256(codes: *const u8, q: usize, o: usize) -> (__m256, __m256) {
        // SAFETY: the caller's contract: 16 bytes of line q exist; F16C available.
        unsafe {
            let p = codes.add(q * 64 + 16 * o);
            let (v0, v1) = (decode8(p), decode8(p.add(8)));
            // Per 128-bit lane: [v0 0 2, v1 0 2] and [v0 1 3, v1 1 3]; then lanes in order.
            let even = _mm256_shuffle_ps(v0, v1, 0b10_00_10_00);
            let odd = _mm256_shuffle_ps(v0, v1, 0b11_01_11_01);
            (lanes_in_order(even), lanes_in_order(odd))
        }
    }

    /// [`bytes256`] with the (unused) table argument of the nibble variant.
    #[inline(always)]
    unsafe fn bytes256_t(
        codes: *const u8,
        q: usize,
        o: usize,
        _t: (__m256, __m256),
    ) -> (__m256, __m256) {
        // SAFETY: forwarded.
        unsafe { bytes256(codes, q, o) }
    }

    macro_rules! decoder256 {
        ($decode:ident, $values:ident, $line_bytes:expr) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn $decode(
                codes: *const u8,
                lines: usize,
                group_lines: usize,
                scales: *const u8,
                scale_type: ScaleType,
                table: &[f32; 16],
                out: *mut u16,
            ) {
                // SAFETY: the DecodeFn contract.
                unsafe {
                    let t = (
                        _mm256_loadu_ps(table.as_ptr()),
                        _mm256_loadu_ps(table.as_ptr().add(8)),
                    );
                    let high = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
                    let line_bytes: usize = $line_bytes;
                    let ss = scale_type.size();
                    // Groups outer: no division per line.
                    for g in 0..lines / group_lines {
                        let s = scales.add(g * 32 * ss);
                        // No closure: it would not inherit the target features.
                        let svs = [
                            scales8(s, scale_type),
                            scales8(s.add(8 * ss), scale_type),
                            scales8(s.add(16 * ss), scale_type),
                            scales8(s.add(24 * ss), scale_type),
                        ];
                        for q in g * group_lines..(g + 1) * group_lines {
                            if (q * line_bytes) % 64 == 0 {
                                prefetch_ahead(codes, q * line_bytes, lines * line_bytes);
                            }
                            for (o, &sv) in svs.iter().enumerate() {
                                let (lo, hi) = $values(codes, q, o, t);
                                let v = _mm256_or_si256(
                                    _mm256_srli_epi32(rne256(_mm256_mul_ps(lo, sv)), 16),
                                    _mm256_and_si256(rne256(_mm256_mul_ps(hi, sv)), high),
                                );
                                _mm256_storeu_si256(out.add(q * 64 + 16 * o) as *mut __m256i, v);
                            }
                        }
                    }
                }
            }
        };
    }

    /// [`small512`] on the 32-byte half `h` of line `q` (rows `16h..16h+16`); the row of lane
    /// `i` of vectors `u` is `16h + 8·(i / 4) + 4u + i % 4`.
    #[inline(always)]
    unsafe fn small256<const FLUSH: bool>(
        codes: *const u8,
        q: usize,
        h: usize,
    ) -> [(__m256, __m256); 2] {
        // SAFETY: the caller's contract: line q's 64 bytes exist; AVX2.
        unsafe {
            let v = _mm256_loadu_si256(codes.add(q * 64 + 32 * h) as *const __m256i);
            let zero = _mm256_setzero_si256();
            let high = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
            // No closures here, as in `small512`.
            let lo = top_codes256::<FLUSH>(_mm256_unpacklo_epi8(zero, v));
            let hi = top_codes256::<FLUSH>(_mm256_unpackhi_epi8(zero, v));
            [
                (
                    _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),
                    _mm256_castsi256_ps(_mm256_and_si256(lo, high)),
                ),
                (
                    _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16)),
                    _mm256_castsi256_ps(_mm256_and_si256(hi, high)),
                ),
            ]
        }
    }

    /// The AVX2 fused kernel on `R` rows ([`fused_bytes_rows512`] on 32-byte halves):
    /// accumulator `2h + u` holds [`small256`]`(h)`'s vectors `u`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // register blocks read best as indexed loops
    unsafe fn fused_bytes_rows256<const R: usize, const FLUSH: bool>(
        a: &[*const f32],
        lines: usize,
        group_lines: usize,
        codes: *const u8,
        scales: *const u8,
        scale_type: ScaleType,
        out: *mut f32,
    ) {
        // SAFETY: the FusedFn contract with exactly R rows.
        unsafe {
            let ss = scale_type.size();
            let mut total = [[_mm256_setzero_ps(); 4]; R];
            let dist =
                crate::kernels::prefetch::distance_of(crate::kernels::prefetch::Family::CodeGroups);
            // Two rows' activations times 2⁶⁴, a window of lines at a time.
            let mut x = [[0f32; 2 * WINDOW_LINES]; R];
            for g in 0..lines / group_lines {
                let mut even = [[_mm256_setzero_ps(); 4]; R];
                let mut odd = [[_mm256_setzero_ps(); 4]; R];
                let group = g * group_lines..(g + 1) * group_lines;
                if R == 1 {
                    for q in group {
                        crate::kernels::prefetch::ahead(codes.add(q * 64), dist);
                        for h in 0..2 {
                            let values = small256::<FLUSH>(codes, q, h);
                            for r in 0..R {
                                let x = a[r].add(2 * q);
                                let (x0, x1) =
                                    (_mm256_set1_ps(*x * UP), _mm256_set1_ps(*x.add(1) * UP));
                                for (u, &(lo, hi)) in values.iter().enumerate() {
                                    even[r][2 * h + u] =
                                        _mm256_fmadd_ps(lo, x0, even[r][2 * h + u]);
                                    odd[r][2 * h + u] = _mm256_fmadd_ps(hi, x1, odd[r][2 * h + u]);
                                }
                            }
                        }
                    }
                } else {
                    // Half by half, the group's lines staying in L1 for the second: 4 sums per
                    // row in the loop rather than 8, which two rows spilled, and broadcasts
                    // that are plain loads (Zen 3 from cache, `byte_cycles` ROWS=2: 8.0-9.9 ->
                    // 5.6-6.1 ns per line; one row keeps the line loop, 3.7 against 4.2).
                    for h in 0..2 {
                        let mut e = [[_mm256_setzero_ps(); 2]; R];
                        let mut o = [[_mm256_setzero_ps(); 2]; R];
                        for w in group.clone().step_by(WINDOW_LINES) {
                            let end = (w + WINDOW_LINES).min(group.end);
                            // A group of one window keeps its scaled inputs for the second half.
                            if h == 0 || group_lines > WINDOW_LINES {
                                crate::kernels::scaled_inputs(a, 2 * w, 2 * (end - w), UP, &mut x);
                            }
                            for q in w..end {
                                crate::kernels::prefetch::ahead(codes.add(q * 64 + 32 * h), dist);
                                let i = 2 * (q - w);
                                let values = small256::<FLUSH>(codes, q, h);
                                for r in 0..R {
                                    let (x0, x1) =
                                        (_mm256_set1_ps(x[r][i]), _mm256_set1_ps(x[r][i + 1]));
                                    for (u, &(lo, hi)) in values.iter().enumerate() {
                                        e[r][u] = _mm256_fmadd_ps(lo, x0, e[r][u]);
                                        o[r][u] = _mm256_fmadd_ps(hi, x1, o[r][u]);
                                    }
                                }
                            }
                        }
                        for r in 0..R {
                            for u in 0..2 {
                                (even[r][2 * h + u], odd[r][2 * h + u]) = (e[r][u], o[r][u]);
                            }
                        }
                    }
                }
                let down = _mm256_set1_ps(DOWN);
                for h in 0..2 {
                    // Rows 16h + 0..4 and 16h + 8..12 (u = 0), 16h + 4..8 and 16h + 12..16 (u = 1).
                    let at = |o: usize| scales8(scales.add((g * 32 + 8 * o) * ss), scale_type);
                    let (sa, sb) = (at(2 * h), at(2 * h + 1));
                    let sv = [
                        _mm256_mul_ps(down, _mm256_permute2f128_ps(sa, sb, 0x20)),
                        _mm256_mul_ps(down, _mm256_permute2f128_ps(sa, sb, 0x31)),
                    ];
                    for u in 0..2 {
                        for r in 0..R {
                            let sum = _mm256_add_ps(even[r][2 * h + u], odd[r][2 * h + u]);
                            total[r][2 * h + u] = _mm256_fmadd_ps(sum, sv[u], total[r][2 * h + u]);
                        }
                    }
                }
            }
            for r in 0..R {
                for h in 0..2 {
                    let (t0, t1) = (total[r][2 * h], total[r][2 * h + 1]);
                    let rows = [
                        _mm256_permute2f128_ps(t0, t1, 0x20),
                        _mm256_permute2f128_ps(t0, t1, 0x31),
                    ];
                    for (half, t) in rows.into_iter().enumerate() {
                        let p = out.add(r * 32 + 16 * h + 8 * half);
                        _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), t));
                    }
                }
            }
        }
    }

    /// 8 exponent bytes at `e` widened to i32 lanes.
    ///
    /// # Safety
    /// AVX2 available; 8 readable bytes at `e`.
    #[inline(always)]
    unsafe fn widen8(e: *const u8) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(e.cast())) }
    }

    /// [`super::FusedPow2Fn`] on AVX2 + FMA. Per block of 128 inputs: its codes decoded once
    /// into an L1 buffer as the bf16 of value · 2⁻¹²⁰ (3 instructions per 16 codes, where
    /// the power-of-two decoder takes 14 to apply the scales), the rows' inputs times 2⁶⁴
    /// into another, then the bf16 FMA kernel ([`crate::kernels::avx2::chunk_rows`]) one
    /// group at a time. The block's sums stay in units of the current group's scale: between
    /// groups each output's sum is multiplied by 2^(e_prev − e_next), at the block's end by
    /// 2⁵⁶ and then by its last group's 2^(e − 127), and added to `out`. Every step is a
    /// power-of-two multiple of the twin's (the same chains, the same adds), hence its bits
    /// while all stay normal numbers.
    ///
    /// # Safety
    /// The [`super::FusedPow2Fn`] contract; AVX2 and FMA available.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fused_pow2_avx2<const FLUSH: bool>(
        a: &[*const f32],
        scaled: bool,
        lines: usize,
        group_lines: usize,
        codes: *const u8,
        exps: *const u8,
        out: *mut f32,
    ) {
        use crate::kernels::MAX_ROWS;
        const LINES: usize = super::POW2_BLOCK_LINES;
        #[repr(align(64))]
        struct Weights([u16; 64 * LINES]);
        #[repr(align(64))]
        struct Inputs([f32; MAX_ROWS * 2 * LINES]);
        #[repr(align(64))]
        struct Sums([f32; MAX_ROWS * 32]);
        let n = a.len();
        assert!(
            n <= MAX_ROWS
                && lines.is_multiple_of(LINES)
                && group_lines > 0
                && LINES.is_multiple_of(group_lines),
            "kgroup avx2 pow2 kernel: {n} rows, {lines} lines, groups of {group_lines}"
        );
        if lines == 0 {
            // SAFETY: out holds 32 floats per row.
            unsafe { std::ptr::write_bytes(out, 0, n * 32) };
            return;
        }
        // None of the buffers is read before this call writes it.
        let mut weights = std::mem::MaybeUninit::<Weights>::uninit();
        let mut inputs = std::mem::MaybeUninit::<Inputs>::uninit();
        let mut sums = std::mem::MaybeUninit::<Sums>::uninit();
        // SAFETY: field addresses of the buffers, nothing read.
        let (w, x, sums) = unsafe {
            (
                std::ptr::addr_of_mut!((*weights.as_mut_ptr()).0).cast::<u16>(),
                std::ptr::addr_of_mut!((*inputs.as_mut_ptr()).0).cast::<f32>(),
                std::ptr::addr_of_mut!((*sums.as_mut_ptr()).0).cast::<f32>(),
            )
        };
        let groups = LINES / group_lines;
        for b in 0..lines / LINES {
            // SAFETY: block b's codes, inputs and exponents lie inside the contract's
            // buffers; the three buffers hold a block's codes, inputs and sums.
            unsafe {
                let block = codes.add(b * LINES * 64);
                for i in (0..64 * LINES).step_by(16) {
                    _mm256_store_si256(w.add(i).cast(), decode16_down120::<FLUSH>(block.add(i)));
                }
                let up = _mm256_set1_ps(UP);
                let mut rows = [std::ptr::null::<f32>(); MAX_ROWS];
                // Where row r's block starts, and the stride of its groups.
                let mut starts = [std::ptr::null::<f32>(); MAX_ROWS];
                for (r, &row) in a.iter().enumerate() {
                    if scaled {
                        starts[r] = row.add(b * 2 * LINES);
                        continue;
                    }
                    for j in (0..2 * LINES).step_by(8) {
                        let v = _mm256_mul_ps(_mm256_loadu_ps(row.add(b * 2 * LINES + j)), up);
                        _mm256_store_ps(x.add(r * 2 * LINES + j), v);
                    }
                    starts[r] = x.add(r * 2 * LINES);
                }
                let next = block.wrapping_add(LINES * 64);
                for l in 0..groups {
                    let g = b * groups + l;
                    if l > 0 {
                        // 2^(e_prev − e) per output: the f32 with exponent field 127 + the
                        // difference.
                        let (prev, e) = (exps.add((g - 1) * 32), exps.add(g * 32));
                        let mut ratio = [_mm256_setzero_ps(); 4];
                        for (o, ratio) in ratio.iter_mut().enumerate() {
                            let d = _mm256_sub_epi32(widen8(prev.add(8 * o)), widen8(e.add(8 * o)));
                            let bits = _mm256_add_epi32(d, _mm256_set1_epi32(127));
                            *ratio = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(bits));
                        }
                        for r in 0..n {
                            for (o, ratio) in ratio.iter().enumerate() {
                                let p = sums.add(r * 32 + 8 * o);
                                _mm256_store_ps(p, _mm256_mul_ps(_mm256_load_ps(p), *ratio));
                            }
                        }
                    }
                    for (row, start) in rows.iter_mut().zip(&starts).take(n) {
                        *row = start.add(2 * l * group_lines);
                    }
                    // This group's share of the next block's codes (after the last block, the
                    // next panel's, which a task usually reads next).
                    let share = (next.wrapping_add(l * group_lines * 64), group_lines);
                    let chunk = w.add(l * group_lines * 64);
                    crate::kernels::avx2::chunk_rows(
                        &rows[..n],
                        group_lines,
                        chunk,
                        sums,
                        l > 0,
                        0,
                        share,
                    );
                }
                let last = exps.add((b * groups + groups - 1) * 32);
                // 2^(e − 127): the f32 with exponent field e (10 at least).
                let mut scale = [_mm256_setzero_ps(); 4];
                for (o, scale) in scale.iter_mut().enumerate() {
                    *scale = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(widen8(last.add(8 * o))));
                }
                let down = _mm256_set1_ps(DOWN);
                for r in 0..n {
                    for (o, scale) in scale.iter().enumerate() {
                        let s = _mm256_load_ps(sums.add(r * 32 + 8 * o));
                        let v = _mm256_mul_ps(_mm256_mul_ps(s, down), *scale);
                        let p = out.add(r * 32 + 8 * o);
                        let v = if b == 0 {
                            v
                        } else {
                            _mm256_add_ps(_mm256_loadu_ps(p), v)
                        };
                        _mm256_storeu_ps(p, v);
                    }
                }
            }
        }
    }

    fused_entry!(
        /// The AVX2 fused kernel (1 or 2 rows).
        ///
        /// # Safety
        /// The [`super::FusedFn`] contract with at most 2 rows; AVX2, FMA and F16C available.
        fused_bytes_avx2, fused_bytes_rows256, "kgroup avx2 fused panel", 1 2
    );

    decoder256!(decode_nibbles256, nibbles256, NIBBLE_LINE);
    decoder256!(decode_bytes256, bytes256_t, BYTE_LINE);

    /// [`super::DecodePow2Fn`] on AVX-512BW: per line, a 32-bit lane per output holds the
    /// line's two nibbles in its low byte; the even nibble indexes the low 16-bit word, the odd
    /// one (moved up by 12 bits) the high word, one `vpermw` looks both up as bf16 (a 16-entry
    /// table seen twice, so bit 4 of an index does not matter), and a masked 16-bit add moves
    /// every nonzero value's exponent: 6 instructions per 32 values, against 10 with fp32
    /// products.
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn decode_nibbles_pow2(
        codes: *const u8,
        lines: usize,
        group_lines: usize,
        exps: *const u8,
        table: &[f32; 16],
        out: *mut u16,
    ) {
        let mut words = [0u16; 32];
        for (i, w) in words.iter_mut().enumerate() {
            *w = crate::dtype::f32_to_bf16_bits(table[i % 16]);
        }
        // Nibble codes come in words of 4 lines and 4-bit groups span a multiple of 8 inputs
        // (checked at load), so groups hold whole words.
        debug_assert!(group_lines.is_multiple_of(4) && lines.is_multiple_of(group_lines));
        // SAFETY: the DecodePow2Fn contract: lines of codes, their groups' exponents, 64
        // outputs per line; 64-byte reads of local arrays.
        unsafe {
            let t = _mm512_loadu_si512(words.as_ptr().cast());
            let magnitude = _mm512_set1_epi16(0x7FFF);
            // Groups outer and each 128-byte word block (4 lines) loaded once: no division
            // and a quarter of the loads per line.
            for g in 0..lines / group_lines {
                let e = exps.add(g * 32);
                let mut shift = [_mm512_setzero_si512(); 2];
                for (h, s) in shift.iter_mut().enumerate() {
                    // (e − 127) << 7 in both 16-bit halves of each output's lane.
                    let x = _mm512_cvtepu8_epi32(_mm_loadu_si128(e.add(16 * h).cast()));
                    let x = _mm512_slli_epi32(_mm512_sub_epi32(x, _mm512_set1_epi32(127)), 7);
                    *s = _mm512_or_si512(
                        _mm512_and_si512(x, _mm512_set1_epi32(0xFFFF)),
                        _mm512_slli_epi32(x, 16),
                    );
                }
                for q4 in g * group_lines / 4..(g + 1) * group_lines / 4 {
                    prefetch_ahead(codes, q4 * 128, lines * NIBBLE_LINE);
                    prefetch_ahead(codes, q4 * 128 + 64, lines * NIBBLE_LINE);
                    for (h, s) in shift.iter().enumerate() {
                        let w = _mm512_loadu_si512(codes.add(q4 * 128 + 64 * h).cast());
                        for sub in 0..4 {
                            let d = _mm512_srlv_epi32(w, _mm512_set1_epi32(8 * sub as i32));
                            // Even words index by the low nibble, odd words by the high one.
                            let idx =
                                _mm512_mask_blend_epi16(0xAAAA_AAAA, d, _mm512_slli_epi32(d, 12));
                            let v = _mm512_permutexvar_epi16(idx, t);
                            let nonzero = _mm512_test_epi16_mask(v, magnitude);
                            let r = _mm512_mask_add_epi16(v, nonzero, v, *s);
                            let q = 4 * q4 + sub;
                            _mm512_storeu_si512(out.add(q * 64 + 32 * h) as *mut __m512i, r);
                        }
                    }
                }
            }
        }
    }

    /// [`super::DecodePow2Fn`] for E4M3 bytes: the exact bf16 of each code (the FP8 format's
    /// VBMI table decoder, in order: a line's byte `2j + p` is output word `2j + p`), then per
    /// line a masked 16-bit add moves each nonzero value's exponent by its output's group
    /// exponent, spread to both words of the output's pair with one `vpermw`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn decode_bytes_pow2(
        codes: *const u8,
        lines: usize,
        group_lines: usize,
        exps: *const u8,
        _table: &[f32; 16],
        out: *mut u16,
    ) {
        /// Word `w` of half `h` takes output `16h + w/2`'s exponent.
        const SPREAD: [[u16; 32]; 2] = {
            let mut t = [[0u16; 32]; 2];
            let mut w = 0;
            while w < 32 {
                t[0][w] = (w / 2) as u16;
                t[1][w] = (16 + w / 2) as u16;
                w += 1;
            }
            t
        };
        // SAFETY: the DecodePow2Fn contract: 64 codes and 64 outputs per line, 32 exponent
        // bytes per group, no NaN code. One pass, groups outer: decoding all lines first and
        // shifting them after stored and reloaded every word, and `q % group_lines` divided
        // per line.
        unsafe {
            let tables = crate::formats::fp8::kernels::x86::LineTables::exact();
            let spread = [
                _mm512_loadu_si512(SPREAD[0].as_ptr().cast()),
                _mm512_loadu_si512(SPREAD[1].as_ptr().cast()),
            ];
            let magnitude = _mm512_set1_epi16(0x7FFF);
            for g in 0..lines.div_ceil(group_lines) {
                let e = _mm256_loadu_si256(exps.add(g * 32).cast());
                let e = _mm512_cvtepu8_epi16(e);
                let e = _mm512_slli_epi16(_mm512_sub_epi16(e, _mm512_set1_epi16(127)), 7);
                let shift = [
                    _mm512_permutexvar_epi16(spread[0], e),
                    _mm512_permutexvar_epi16(spread[1], e),
                ];
                for q in g * group_lines..((g + 1) * group_lines).min(lines) {
                    let words = tables.line(codes.add(q * 64));
                    for h in 0..2 {
                        let v = words[h];
                        let nonzero = _mm512_test_epi16_mask(v, magnitude);
                        let p = out.add(q * 64 + 32 * h) as *mut __m512i;
                        _mm512_storeu_si512(p, _mm512_mask_add_epi16(v, nonzero, v, shift[h]));
                    }
                }
            }
        }
    }

    /// [`super::DecodePow2Fn`] for E4M3 bytes on AVX2 + F16C: each code as the
    /// half-precision `value · 2⁻⁸` ([`decode16_bf16_times`]), times `2^(e − 119)` per output
    /// (an exponent inside [`super::E4M3_POW2_EXPONENTS`] keeps that multiplier and every
    /// product a normal float), the float's upper half the exact bf16: about 14 instructions
    /// per 16 codes, where the multiply-and-round decoder takes about 33.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode_bytes_pow2_256(
        codes: *const u8,
        lines: usize,
        group_lines: usize,
        exps: *const u8,
        _table: &[f32; 16],
        out: *mut u16,
    ) {
        // SAFETY: the DecodePow2Fn contract: 64 codes and 64 outputs per line, 32 exponent
        // bytes per group inside the range.
        unsafe {
            // Output j's multiplier to both words of its pair: lanes 2j, 2j + 1 of a half.
            let pairs_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
            let pairs_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
            let mut m = [_mm256_setzero_ps(); 8];
            // Groups outer: no division per line.
            for g in 0..lines / group_lines {
                let e = exps.add(g * 32);
                for (o, m) in m.chunks_exact_mut(2).enumerate() {
                    // f32 bits (e + 8) << 23: 2^(e − 119).
                    let x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(e.add(8 * o).cast()));
                    let x = _mm256_add_epi32(x, _mm256_set1_epi32(8));
                    let x = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(x));
                    m[0] = _mm256_permutevar8x32_ps(x, pairs_lo);
                    m[1] = _mm256_permutevar8x32_ps(x, pairs_hi);
                }
                for q in g * group_lines..(g + 1) * group_lines {
                    prefetch_ahead(codes, q * 64, lines * 64);
                    for o in 0..4 {
                        let at = q * 64 + 16 * o;
                        let v = decode16_bf16_times(codes.add(at), m[2 * o], m[2 * o + 1]);
                        _mm256_storeu_si256(out.add(at).cast(), v);
                    }
                }
            }
        }
    }

    macro_rules! public_decoder {
        ($name:ident, $inner:ident, $what:literal) => {
            public_decoder!(
                $name, $inner, $what, "DecodeFn", scales: *const u8, scale_type: ScaleType
            );
        };
        (
            $name:ident, $inner:ident, $what:literal, $contract:literal,
            $($scales:ident: $ty:ty),+
        ) => {
            #[doc = concat!("The ", $what, " decoder.")]
            ///
            /// # Safety
            #[doc = concat!("The [`super::", $contract, "`] contract; the named features available.")]
            pub unsafe fn $name(
                codes: *const u8,
                lines: usize,
                group_lines: usize,
                $($scales: $ty,)+
                table: &[f32; 16],
                out: *mut u16,
            ) {
                // SAFETY: forwarded.
                unsafe { $inner(codes, lines, group_lines, $($scales,)+ table, out) }
            }
        };
    }
    public_decoder!(
        decode_nibbles_pow2_avx512,
        decode_nibbles_pow2,
        "AVX-512F/BW power-of-two nibble",
        "DecodePow2Fn",
        exps: *const u8
    );
    public_decoder!(
        decode_bytes_pow2_vbmi,
        decode_bytes_pow2,
        "AVX512-VBMI power-of-two E4M3",
        "DecodePow2Fn",
        exps: *const u8
    );
    public_decoder!(
        decode_nibbles_avx512,
        decode_nibbles512,
        "AVX-512F/BW nibble"
    );
    public_decoder!(decode_bytes_avx512, decode_bytes512, "AVX-512F/BW E4M3");
    public_decoder!(
        decode_nibbles_avx512bf16,
        decode_nibbles512bf16,
        "AVX-512F/BW/BF16 nibble"
    );
    public_decoder!(
        decode_bytes_avx512bf16,
        decode_bytes512bf16,
        "AVX-512F/BW/BF16 E4M3"
    );
    public_decoder!(
        decode_nibbles_avx2,
        decode_nibbles256,
        "AVX2+FMA+F16C nibble"
    );
    public_decoder!(decode_bytes_avx2, decode_bytes256, "AVX2+FMA+F16C E4M3");
    public_decoder!(
        decode_bytes_pow2_avx2,
        decode_bytes_pow2_256,
        "AVX2+FMA+F16C power-of-two E4M3",
        "DecodePow2Fn",
        exps: *const u8
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codes::{E2M1_VALUES, INT4_VALUES};

    /// Random codes of `bits` for `lines` lines (no NaN bytes; zeros and E4M3 subnormals
    /// among them) and positive scales spanning a few binades.
    fn data(bits: usize, lines: usize, groups: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
        let mut rng = crate::rng::Rng::new(seed);
        let codes = (0..lines * 32 * bits / 4)
            .map(|i| match (i % 53, rng.below(256) as u8) {
                (0, _) => 0,
                (1, _) if bits == 8 => 0x83,
                (_, b) if bits == 8 && b & 0x7F == 0x7F => b & 0xF0,
                (_, b) => b,
            })
            .collect();
        let scales = (0..groups * 32)
            .map(|_| (rng.normal() * 0.3).exp() * 0.01)
            .collect();
        (codes, scales)
    }

    fn levels() -> Vec<Level> {
        let mut v = vec![Level::Generic];
        for l in [Level::Avx2, Level::Avx512Base, Level::Avx512Bf16] {
            if crate::isa::allows(l) {
                v.push(l);
            }
        }
        v
    }

    /// `values` as stored scales of `st` (little-endian), every 13th an edge case: an E4M3
    /// subnormal, and with `tiny_e8m0` E8M0's 2⁻¹²⁷ (whose products are fp32 denormals,
    /// which `vcvtne2ps2bf16` flushes: the bf16 decoders differ from the twin there).
    fn stored(st: ScaleType, values: &[f32], tiny_e8m0: bool) -> Vec<u8> {
        values
            .iter()
            .enumerate()
            .flat_map(|(i, &v)| {
                let bits = match (st, i % 13) {
                    (ScaleType::E8M0, 0) if tiny_e8m0 => 0, // 2⁻¹²⁷
                    (ScaleType::E4M3, 0) => 0x05,           // a subnormal
                    _ => st.encode_at_least(v),
                };
                bits.to_le_bytes()[..st.size()].to_vec()
            })
            .collect()
    }

    /// Every scale type the decoders read.
    const SCALE_TYPES: [ScaleType; 4] = [
        ScaleType::E8M0,
        ScaleType::E4M3,
        ScaleType::Bf16,
        ScaleType::F16,
    ];

    /// `decode` over `lines` lines of `codes` into a buffer first filled with `fill`.
    ///
    /// # Safety
    /// `codes` holds `lines` lines as [`data`] makes them, `scales` their groups' stored
    /// scales of `st`; the CPU runs `decode`.
    unsafe fn decoded(
        decode: DecodeFn,
        (codes, scales, st): (&[u8], &[u8], ScaleType),
        lines: usize,
        group_lines: usize,
        table: &[f32; 16],
        fill: u16,
    ) -> Vec<u16> {
        let mut out = vec![fill; lines * 64];
        // SAFETY: the caller's contract; `out` holds every line.
        unsafe {
            decode(
                codes.as_ptr(),
                lines,
                group_lines,
                scales.as_ptr(),
                st,
                table,
                out.as_mut_ptr(),
            )
        };
        out
    }

    #[test]
    fn decoders_equal_their_scalar_twin() {
        for (kind, table) in [
            (CodeKind::Int4, INT4_VALUES),
            (CodeKind::E2M1, E2M1_VALUES),
            (CodeKind::E4M3, E2M1_VALUES),
        ] {
            for ((lines, group_lines), st) in [(64usize, 16usize), (64, 8), (48, 48), (8, 8)]
                .into_iter()
                .flat_map(|shape| SCALE_TYPES.map(|st| (shape, st)))
            {
                let (codes, values) = data(kind.bits(), lines, lines / group_lines, 3);
                let raw = stored(st, &values, false);
                let scales: Vec<f32> = (0..values.len())
                    // SAFETY: `raw` holds one stored scale per value.
                    .map(|i| st.value(unsafe { st.read(raw.as_ptr(), i) }))
                    .collect();
                let twin = kernels_for(kind, Level::Generic).decode;
                let values = (codes.as_slice(), raw.as_slice(), st);
                // SAFETY: sizes as `data` made them; scalar code.
                let want = unsafe { decoded(twin, values, lines, group_lines, &table, 0) };
                // The twin itself against the definition: value · scale rounded to bf16.
                for q in [0, lines - 1] {
                    for j in [0, 17, 31] {
                        for p in 0..2 {
                            let code = if kind.bits() == 8 {
                                codes[q * 64 + 2 * j + p]
                            } else {
                                (codes[nibble_byte(q, j)] >> (4 * p)) & 0xF
                            };
                            let v = if kind == CodeKind::E4M3 {
                                kind.value(code)
                            } else {
                                table[code as usize]
                            };
                            let s = scales[(q / group_lines) * 32 + j];
                            assert_eq!(want[q * 64 + 2 * j + p], f32_to_bf16_bits(v * s));
                        }
                    }
                }
                for level in levels() {
                    let k = kernels_for(kind, level);
                    // SAFETY: as above; the level is allowed on this CPU.
                    let got =
                        unsafe { decoded(k.decode, values, lines, group_lines, &table, 0xFFFF) };
                    assert_eq!(got, want, "{kind:?} {st:?} {} lines={lines}", k.name);
                }
            }
        }
    }

    /// The power-of-two decoders give the scalar twin's bits with the exponents as f32
    /// scales, for every exponent they accept (both ends included) and every code.
    #[test]
    fn power_of_two_decoders_equal_the_scalar_twin() {
        let mut rng = crate::rng::Rng::new(8);
        for (kind, table) in [(CodeKind::E2M1, E2M1_VALUES), (CodeKind::E4M3, E2M1_VALUES)] {
            let pow2: Vec<(Level, Pow2Decoder)> = levels()
                .into_iter()
                .filter_map(|l| kernels_for(kind, l).decode_pow2.map(|d| (l, d)))
                .collect();
            #[cfg(target_arch = "x86_64")]
            if crate::isa::allows(Level::Avx512Vbmi) {
                assert!(!pow2.is_empty(), "{kind:?}");
            }
            #[cfg(target_arch = "x86_64")]
            if kind == CodeKind::E4M3 && crate::isa::allows(Level::Avx2) {
                assert!(pow2.iter().any(|(l, _)| *l == Level::Avx2), "AVX2 E4M3");
            }
            for (lines, group_lines) in [(64usize, 16usize), (48, 48), (8, 8)] {
                let (codes, _) = data(kind.bits(), lines, 1, 9);
                for (level, d) in &pow2 {
                    let (lo, hi) = (*d.exponents.start(), *d.exponents.end());
                    let mut exps: Vec<u8> = (0..lines / group_lines * 32)
                        .map(|_| lo + rng.below((hi - lo) as usize + 1) as u8)
                        .collect();
                    exps[0] = lo;
                    exps[1] = hi;
                    let twin = kernels_for(kind, Level::Generic).decode;
                    // The exponents are E8M0 scales as stored.
                    let values = (codes.as_slice(), exps.as_slice(), ScaleType::E8M0);
                    // SAFETY: sizes as `data` made them; scalar code.
                    let want = unsafe { decoded(twin, values, lines, group_lines, &table, 0) };
                    let mut got = vec![0xFFFFu16; lines * 64];
                    // SAFETY: sizes as the contract asks; exponents inside the decoder's range;
                    // the level is allowed on this CPU.
                    unsafe {
                        (d.decode)(
                            codes.as_ptr(),
                            lines,
                            group_lines,
                            exps.as_ptr(),
                            &table,
                            got.as_mut_ptr(),
                        )
                    };
                    assert_eq!(got, want, "{kind:?} {level:?} lines={lines}");
                }
            }
        }
    }

    /// The many-row power-of-two kernels give their scalar twin's bits for exponents that
    /// [`FusedPow2::applies`] accepts (windows of the widest spread from scales 2⁻⁶⁷ up to
    /// 2⁵⁷, where no intermediate of either overflows or turns denormal; every code, both
    /// subnormal settings, row counts across register blocks), and
    /// the twin is the decoded-block path: the scalar decoder's values (which the power-of-two
    /// decoders equal) through the scalar fp32 kernel, block sums added.
    #[test]
    fn pow2_many_row_kernels_equal_their_scalar_twin() {
        #[cfg(target_arch = "x86_64")]
        if crate::isa::allows(Level::Avx2) {
            assert!(kernels_for(CodeKind::E4M3, Level::Avx2)
                .fused_pow2
                .is_some());
        }
        let (lo, hi) = (*E4M3_POW2_EXPONENTS.start(), *E4M3_POW2_EXPONENTS.end());
        let spread = FusedPow2::MAX_SPREAD;
        assert!(!FusedPow2::applies(&[lo - 1, lo]) && !FusedPow2::applies(&[hi, hi + 1]));
        assert!(!FusedPow2::applies(&[100, 100 + spread + 1]));
        let mut rng = crate::rng::Rng::new(12);
        let shapes = [(64usize, 16usize), (192, 16), (128, 64), (64, 8), (128, 32)];
        for ((lines, group_lines), least) in shapes.into_iter().zip([60, 100, 120, 90, 75]) {
            let (codes, _) = data(8, lines, 1, 13);
            let mut exps: Vec<u8> = (0..lines / group_lines * 32)
                .map(|_| least + rng.below(spread as usize + 1) as u8)
                .collect();
            exps[5] = least;
            exps[40] = least + spread;
            assert!(FusedPow2::applies(&exps));
            let (c, e) = (codes.as_ptr(), exps.as_ptr());
            for rows in [3usize, 5, 8, 13, 32] {
                let xs: Vec<Vec<f32>> = (0..rows).map(|_| rng.normals(2 * lines, 1.0)).collect();
                let ptrs: Vec<*const f32> = xs.iter().map(|x| x.as_ptr()).collect();
                let mut want = vec![f32::NAN; 32 * rows];
                // SAFETY: sizes as the contract asks; scalar code.
                unsafe {
                    fused_pow2_scalar::<false>(
                        &ptrs,
                        false,
                        lines,
                        group_lines,
                        c,
                        e,
                        want.as_mut_ptr(),
                    )
                };
                if rows == 3 {
                    // The decoded-block path: bf16 values (E8M0 scales as stored), then per
                    // block the fp32 kernels' chains, block sums added.
                    let twin = kernels_for(CodeKind::E4M3, Level::Generic).decode;
                    let values = (codes.as_slice(), exps.as_slice(), ScaleType::E8M0);
                    // SAFETY: sizes as `data` made them; scalar code.
                    let panel =
                        unsafe { decoded(twin, values, lines, group_lines, &E2M1_VALUES, 0) };
                    let mut path = vec![0f32; 32 * rows];
                    for b in 0..lines / POW2_BLOCK_LINES {
                        let at = b * 2 * POW2_BLOCK_LINES;
                        let block_rows: Vec<*const f32> =
                            xs.iter().map(|x| x[at..].as_ptr()).collect();
                        let mut sums = vec![0f32; 32 * rows];
                        // SAFETY: 128 inputs per row from `at`, the block's 32·128 values.
                        unsafe {
                            crate::kernels::scalar::panel_dot_fma(
                                &block_rows,
                                2 * POW2_BLOCK_LINES,
                                panel[b * 64 * POW2_BLOCK_LINES..].as_ptr(),
                                sums.as_mut_ptr(),
                            )
                        };
                        for (p, s) in path.iter_mut().zip(&sums) {
                            *p = if b == 0 { *s } else { *p + *s };
                        }
                    }
                    assert_eq!(path, want, "twin against the decoded path, lines={lines}");
                }
                #[cfg(target_arch = "x86_64")]
                if crate::isa::allows(Level::Avx2) {
                    for flush in [false, true] {
                        let mut model = vec![f32::NAN; 32 * rows];
                        let mut got = vec![f32::NAN; 32 * rows];
                        let kernel = fused_pow2_avx2(flush).kernel;
                        // SAFETY: as above; AVX2 and FMA allowed.
                        unsafe {
                            let m = model.as_mut_ptr();
                            if flush {
                                fused_pow2_scalar::<true>(
                                    &ptrs,
                                    false,
                                    lines,
                                    group_lines,
                                    c,
                                    e,
                                    m,
                                );
                            } else {
                                fused_pow2_scalar::<false>(
                                    &ptrs,
                                    false,
                                    lines,
                                    group_lines,
                                    c,
                                    e,
                                    m,
                                );
                            }
                            kernel(&ptrs, false, lines, group_lines, c, e, got.as_mut_ptr());
                        }
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        let case = format!("flush={flush} rows={rows} lines={lines}/{group_lines}");
                        assert_eq!(bits(&got), bits(&model), "{case}");
                        // Rows handed over already scaled: the same bits.
                        let up: Vec<Vec<f32>> = xs
                            .iter()
                            .map(|x| x.iter().map(|v| v * POW2_ROW_SCALE).collect())
                            .collect();
                        let up_ptrs: Vec<*const f32> = up.iter().map(|x| x.as_ptr()).collect();
                        let mut pre = vec![f32::NAN; 32 * rows];
                        // SAFETY: as above.
                        unsafe {
                            kernel(&up_ptrs, true, lines, group_lines, c, e, pre.as_mut_ptr())
                        };
                        assert_eq!(bits(&pre), bits(&model), "{case}, scaled rows");
                    }
                }
            }
        }
    }

    #[test]
    fn fused_kernels_equal_their_scalar_twin() {
        #[cfg(target_arch = "x86_64")]
        if crate::isa::allows(Level::Avx2) {
            assert!(kernels_for(CodeKind::E4M3, Level::Avx2).fused.is_some());
        }
        // Only E4M3 codes take the fp32 fused kernels (4-bit codes take the integer ones);
        // scales as stored, of every type the kernels read.
        let kind = CodeKind::E4M3;
        for st in SCALE_TYPES {
            for (lines, group_lines) in [(64usize, 16usize), (128, 64), (24, 8)] {
                let (codes, values) = data(kind.bits(), lines, lines / group_lines, 11);
                let scales = stored(st, &values, true);
                let mut rng = crate::rng::Rng::new(4);
                let variants = levels().into_iter().flat_map(|l| [(l, false), (l, true)]);
                for (level, flush) in variants {
                    let Some((fused, max_rows)) = fused_bytes_for(level, flush) else {
                        continue;
                    };
                    let model = if flush {
                        fused_scalar::<true>
                    } else {
                        fused_scalar::<false>
                    };
                    for rows in 1..=max_rows {
                        let xs: Vec<Vec<f32>> =
                            (0..rows).map(|_| rng.normals(2 * lines, 1.0)).collect();
                        let ptrs: Vec<*const f32> = xs.iter().map(|x| x.as_ptr()).collect();
                        let start: Vec<f32> = rng.normals(32 * rows, 1.0);
                        let (mut want, mut got) = (start.clone(), start.clone());
                        let (c, s) = (codes.as_ptr(), scales.as_ptr());
                        // SAFETY: sizes as the contract asks; the level is allowed.
                        unsafe {
                            model(&ptrs, lines, group_lines, c, s, st, want.as_mut_ptr());
                            fused(&ptrs, lines, group_lines, c, s, st, got.as_mut_ptr());
                        }
                        let case = format!("{st:?} {level:?} flush={flush} rows={rows}");
                        assert_eq!(got, want, "{case} lines={lines}");
                    }
                }
            }
        }
    }
}
