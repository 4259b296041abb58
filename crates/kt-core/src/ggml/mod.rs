//! ggml tensor types: the type table, scalar dequantizers and quantizers, activation
//! quantization and dot products of one quantized weight row with one quantized activation row.
//!
//! Everything here is written from the published block layouts (see [`blocks`]); it is the
//! arithmetic the LLAMAFILE method needs for GGUF experts.
//!
//! How a weight row meets an activation (`k` = input dimension = row length):
//!
//! | weight type | activation ([`ActivationFormat`]) | `k` must be a multiple of |
//! |---|---|---|
//! | F32, F16, BF16 | F32 (little-endian f32 bytes) | 1 |
//! | Q4_0, Q5_0, Q8_0, IQ4_NL | Q8_0 | 32 |
//! | Q4_1, Q5_1 | Q8_1 | 32 |
//! | Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS | Q8_K | 256 |
//!
//! Activation blocks (all little-endian):
//! - Q8_0 (34 bytes per 32 values): fp16 `d = amax/127`, then `q = round_half_even(x · (127/amax))`
//!   with the product rounded to f32 first.
//! - Q8_1 (36 bytes per 32 values): fp16 `d`, fp16 `s = d · Σq` (the f32 `d` before rounding),
//!   then the 32 `q` as in Q8_0. Q4_1/Q5_1 need `s` because their weights carry an offset `m`:
//!   `Σ (d_w q_w + m)(d_a q_a) = d_w d_a Σ q_w q_a + m s`.
//! - Q8_K (292 bytes per 256 values): f32 `d`, 256 × i8, 16 × i16 `bsums` (the sum of each run
//!   of 16 `q`). The value of largest magnitude `m` (sign kept) maps to −127:
//!   `q = round_half_even(x · (−127/m))` on the exact product, `d = 1/(−127/m)`.
//!
//! Quantized activations always lie in [−127, 127] (the SIMD kernels rely on it). A block with a
//! NaN or infinity gets a NaN scale, so a non-finite input poisons its own dot products only.
//!
//! [`DotKernel`] picks the kernel at run time: AVX-512 VNNI or AVX2 for Q4_0, Q5_0, Q8_0,
//! IQ4_NL, Q4_K, Q5_K, Q6_K and IQ4_XS; the scalar twin for the other types. Every SIMD kernel
//! returns exactly the scalar twin's f32 (integer block sums, then the same f32 operations in
//! the same order). With these activation rules the Q8_0 kernels reproduce the original
//! kt-kernel's LLAMAFILE outputs bit for bit on its fixtures (see the tests).
use crate::isa::{self, Level};
use crate::{kt_bail, kt_ensure, Error, Result};

pub mod blocks;
mod dequant;
mod dot;
mod quantize;
pub mod x8;
#[cfg(target_arch = "x86_64")]
mod x86_avx2;
#[cfg(target_arch = "x86_64")]
mod x86_avx2_rows;
#[cfg(target_arch = "x86_64")]
mod x86_avx2_x8;
#[cfg(target_arch = "x86_64")]
mod x86_avx512;
#[cfg(target_arch = "x86_64")]
mod x86_avx512_x16;

#[cfg(test)]
mod tests;

/// ggml tensor element types, with their official numeric ids (as stored in GGUF files).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)] // the official spellings (Q4_K, IQ4_XS) are what users search for
pub enum GgmlType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// 32 values: fp16 scale, 4-bit values offset by 8.
    Q4_0,
    /// 32 values: fp16 scale and minimum, 4-bit values.
    Q4_1,
    /// 32 values: fp16 scale, 5-bit values offset by 16.
    Q5_0,
    /// 32 values: fp16 scale and minimum, 5-bit values.
    Q5_1,
    /// 32 values: fp16 scale, int8 values.
    Q8_0,
    /// 32 values: fp16 scale, fp16 scaled sum, int8 values (an activation format).
    Q8_1,
    /// 256 values: 2-bit, 16 sub-blocks with 4-bit scales and minima.
    Q2_K,
    /// 256 values: 3-bit, 16 sub-blocks with 6-bit signed scales.
    Q3_K,
    /// 256 values: 4-bit, 8 sub-blocks with 6-bit scales and minima.
    Q4_K,
    /// 256 values: 5-bit, 8 sub-blocks with 6-bit scales and minima.
    Q5_K,
    /// 256 values: 6-bit, 16 sub-blocks with int8 scales.
    Q6_K,
    /// 256 values: f32 scale, int8 values, 16 int16 partial sums (an activation format).
    Q8_K,
    /// Importance-matrix 2-bit type (size known, no arithmetic here).
    IQ2_XXS,
    /// Importance-matrix 2-bit type (size known, no arithmetic here).
    IQ2_XS,
    /// Importance-matrix 3-bit type (size known, no arithmetic here).
    IQ3_XXS,
    /// Importance-matrix 1-bit type (size known, no arithmetic here).
    IQ1_S,
    /// 32 values: fp16 scale, 4-bit indices into a fixed non-linear table.
    IQ4_NL,
    /// Importance-matrix 3-bit type (size known, no arithmetic here).
    IQ3_S,
    /// Importance-matrix 2-bit type (size known, no arithmetic here).
    IQ2_S,
    /// 256 values: fp16 scale, 8 sub-blocks with 6-bit scales, 4-bit non-linear indices.
    IQ4_XS,
    /// int8.
    I8,
    /// int16.
    I16,
    /// int32.
    I32,
    /// int64.
    I64,
    /// IEEE binary64.
    F64,
    /// Importance-matrix 1-bit type (size known, no arithmetic here).
    IQ1_M,
    /// bfloat16.
    BF16,
    /// Ternary type (size known, no arithmetic here).
    TQ1_0,
    /// Ternary type (size known, no arithmetic here).
    TQ2_0,
    /// 32 values: e8m0 shared exponent, fp4 (e2m1) values (size known, no arithmetic here).
    MXFP4,
}

/// Every type, in id order.
pub const ALL_TYPES: [GgmlType; 32] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_K,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ3_XXS,
    GgmlType::IQ1_S,
    GgmlType::IQ4_NL,
    GgmlType::IQ3_S,
    GgmlType::IQ2_S,
    GgmlType::IQ4_XS,
    GgmlType::I8,
    GgmlType::I16,
    GgmlType::I32,
    GgmlType::I64,
    GgmlType::F64,
    GgmlType::IQ1_M,
    GgmlType::BF16,
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
    GgmlType::MXFP4,
];

/// Weight types with a dequantizer, a quantizer and a dot product here.
pub const SUPPORTED_TYPES: [GgmlType; 15] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
];

impl GgmlType {
    /// The numeric id stored in GGUF tensor infos.
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2_K => 10,
            Q3_K => 11,
            Q4_K => 12,
            Q5_K => 13,
            Q6_K => 14,
            Q8_K => 15,
            IQ2_XXS => 16,
            IQ2_XS => 17,
            IQ3_XXS => 18,
            IQ1_S => 19,
            IQ4_NL => 20,
            IQ3_S => 21,
            IQ2_S => 22,
            IQ4_XS => 23,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            IQ1_M => 29,
            BF16 => 30,
            TQ1_0 => 34,
            TQ2_0 => 35,
            MXFP4 => 39,
        }
    }

    /// The type with this id; `None` for ids that were never assigned or have been retired
    /// (4, 5, 31–33, 36–38) and for ids newer than this table.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        ALL_TYPES.iter().copied().find(|t| t.id() == id)
    }

    /// The official name (`"Q4_K"`, `"BF16"`, ...).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2_K => "Q2_K",
            Q3_K => "Q3_K",
            Q4_K => "Q4_K",
            Q5_K => "Q5_K",
            Q6_K => "Q6_K",
            Q8_K => "Q8_K",
            IQ2_XXS => "IQ2_XXS",
            IQ2_XS => "IQ2_XS",
            IQ3_XXS => "IQ3_XXS",
            IQ1_S => "IQ1_S",
            IQ4_NL => "IQ4_NL",
            IQ3_S => "IQ3_S",
            IQ2_S => "IQ2_S",
            IQ4_XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            IQ1_M => "IQ1_M",
            BF16 => "BF16",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
            MXFP4 => "MXFP4",
        }
    }

    /// Parse a name, case-insensitively (`"q4_k"`, `"BF16"`).
    pub fn parse(name: &str) -> Result<GgmlType> {
        let wanted = name.trim();
        ALL_TYPES
            .iter()
            .copied()
            .find(|t| t.name().eq_ignore_ascii_case(wanted))
            .ok_or_else(|| {
                let names: Vec<_> = ALL_TYPES.iter().map(|t| t.name()).collect();
                Error::Invalid(format!(
                    "unknown ggml type {name:?}; known types: {}",
                    names.join(", ")
                ))
            })
    }

    /// Values per block.
    pub fn block_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | IQ4_NL | MXFP4 => 32,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S
            | IQ3_S | IQ2_S | IQ4_XS | IQ1_M | TQ1_0 | TQ2_0 => 256,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 => 4,
            F16 | BF16 => 2,
            I8 => 1,
            I16 => 2,
            I32 => 4,
            I64 | F64 => 8,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 36,
            Q2_K => 84,
            Q3_K => 110,
            Q4_K => 144,
            Q5_K => 176,
            Q6_K => 210,
            Q8_K => 292,
            IQ2_XXS => 66,
            IQ2_XS => 74,
            IQ3_XXS => 98,
            IQ1_S => 50,
            IQ4_NL => 18,
            IQ3_S => 110,
            IQ2_S => 82,
            IQ4_XS => 136,
            IQ1_M => 56,
            TQ1_0 => 54,
            TQ2_0 => 66,
            MXFP4 => 17,
        }
    }

    /// Bytes of a row of `n` values; fails unless `n` is a multiple of the block size (or the
    /// size overflows).
    pub fn row_bytes(self, n: usize) -> Result<usize> {
        let bs = self.block_size();
        kt_ensure!(
            n.is_multiple_of(bs),
            Invalid,
            "a {} row holds whole blocks of {bs} values; {n} values is not a multiple of {bs}",
            self.name()
        );
        (n / bs).checked_mul(self.type_size()).ok_or_else(|| {
            Error::Invalid(format!(
                "a {} row of {n} values overflows the address space",
                self.name()
            ))
        })
    }

    /// Whether this crate can dequantize, quantize and dot-multiply this type.
    pub fn is_supported(self) -> bool {
        SUPPORTED_TYPES.contains(&self)
    }

    /// The format activations must be quantized to for [`vec_dot`] with this weight type.
    pub fn activation_format(self) -> Result<ActivationFormat> {
        use GgmlType::*;
        Ok(match self {
            F32 | F16 | BF16 => ActivationFormat::F32,
            Q4_0 | Q5_0 | Q8_0 | IQ4_NL => ActivationFormat::Q8_0,
            Q4_1 | Q5_1 => ActivationFormat::Q8_1,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_XS => ActivationFormat::Q8_K,
            _ => return Err(unsupported(self, "dot products")),
        })
    }

    /// The input dimension `k` must be a multiple of this for dot products (the larger of the
    /// weight block and the activation block).
    pub fn k_multiple(self) -> Result<usize> {
        Ok(self
            .block_size()
            .max(self.activation_format()?.block_size()))
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn unsupported(ty: GgmlType, what: &str) -> Error {
    let names: Vec<_> = SUPPORTED_TYPES.iter().map(|t| t.name()).collect();
    Error::Unsupported(format!(
        "ggml type {} (id {}) has no {what} here; supported: {}",
        ty.name(),
        ty.id(),
        names.join(", ")
    ))
}

/// How activations are stored for a dot product (see the module docs for the block layouts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum ActivationFormat {
    /// Plain little-endian f32.
    F32,
    /// 32 values per 34-byte block.
    Q8_0,
    /// 32 values per 36-byte block (with the scaled sum).
    Q8_1,
    /// 256 values per 292-byte block (with partial sums).
    Q8_K,
}

impl ActivationFormat {
    /// Values per block.
    pub fn block_size(self) -> usize {
        match self {
            ActivationFormat::F32 => 1,
            ActivationFormat::Q8_0 | ActivationFormat::Q8_1 => 32,
            ActivationFormat::Q8_K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            ActivationFormat::F32 => 4,
            ActivationFormat::Q8_0 => blocks::Q8_0_BYTES,
            ActivationFormat::Q8_1 => blocks::Q8_1_BYTES,
            ActivationFormat::Q8_K => blocks::Q8_K_BYTES,
        }
    }

    /// The name of the matching ggml type.
    pub fn name(self) -> &'static str {
        match self {
            ActivationFormat::F32 => "F32",
            ActivationFormat::Q8_0 => "Q8_0",
            ActivationFormat::Q8_1 => "Q8_1",
            ActivationFormat::Q8_K => "Q8_K",
        }
    }

    /// Bytes for `k` values; fails unless `k` is a multiple of the block size.
    pub fn row_bytes(self, k: usize) -> Result<usize> {
        let bs = self.block_size();
        kt_ensure!(
            k.is_multiple_of(bs),
            Invalid,
            "{} activations come in blocks of {bs} values; {k} is not a multiple of {bs}",
            self.name()
        );
        (k / bs)
            .checked_mul(self.block_bytes())
            .ok_or_else(|| Error::Invalid(format!("{k} {} activations overflow", self.name())))
    }
}

/// Dequantize one row of `out.len()` values stored as `ty` in `data`.
pub fn dequantize_row(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<()> {
    check_row(ty, data.len(), out.len())?;
    dequant::row(ty, data, out)
}

/// Dequantize `n` values stored as `ty`.
pub fn dequantize(ty: GgmlType, data: &[u8], n: usize) -> Result<Vec<f32>> {
    // Sizes first: `n` comes from the caller and must not size an allocation unchecked.
    check_row(ty, data.len(), n)?;
    let mut out = vec![0.0; n];
    dequantize_row(ty, data, &mut out)?;
    Ok(out)
}

/// Quantize one row `x` to `ty` into `out` (exactly `ty.row_bytes(x.len())` bytes). The
/// quantizers are plain round-to-nearest without a search: deterministic and valid, though less
/// accurate than llama.cpp's for the K and IQ types. Quantized types reject non-finite input.
pub fn quantize_row(ty: GgmlType, x: &[f32], out: &mut [u8]) -> Result<()> {
    check_row(ty, out.len(), x.len())?;
    quantize::weight_row(ty, x, out)
}

/// Quantize `x` to `ty`.
pub fn quantize(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>> {
    let mut out = vec![0u8; ty.row_bytes(x.len())?];
    quantize_row(ty, x, &mut out)?;
    Ok(out)
}

/// Quantize little-endian values of `src_type` (`data`) to `ty` on `threads` threads (0 = all
/// cores). Blocks are independent, so each thread converts its share a chunk at a time (no
/// full-size f32 copy).
pub fn quantize_bytes(
    ty: GgmlType,
    data: &[u8],
    src_type: crate::dtype::FloatType,
    threads: usize,
) -> Result<Vec<u8>> {
    let width = src_type.size();
    kt_ensure!(
        data.len().is_multiple_of(width),
        Invalid,
        "data holds {} bytes, not whole {} values",
        data.len(),
        src_type.name()
    );
    let n = data.len() / width;
    let mut out = vec![0u8; ty.row_bytes(n)?];
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let blocks = n / bs;
    let threads = match threads {
        0 => std::thread::available_parallelism().map_or(1, |t| t.get()),
        t => t.min(crate::pool::MAX_THREADS),
    }
    .clamp(1, blocks.max(1));
    let per = blocks.div_ceil(threads).max(1);
    let chunk = (65536 / bs).max(1);
    std::thread::scope(|s| {
        let jobs: Vec<_> = data
            .chunks(per * bs * width)
            .zip(out.chunks_mut(per * ts))
            .map(|(src, dst)| {
                s.spawn(move || -> Result<()> {
                    let mut values = vec![0f32; chunk * bs];
                    for (src, dst) in src
                        .chunks(chunk * bs * width)
                        .zip(dst.chunks_mut(chunk * ts))
                    {
                        let x = &mut values[..src.len() / width];
                        // SAFETY: `src` holds exactly x.len() values of src_type.
                        unsafe { crate::dtype::row_to_f32(src.as_ptr(), src_type, x) };
                        quantize_row(ty, x, dst)?;
                    }
                    Ok(())
                })
            })
            .collect();
        jobs.into_iter().try_for_each(|j| {
            j.join()
                .unwrap_or_else(|_| Err(Error::Runtime("a quantizer thread panicked".into())))
        })
    })?;
    Ok(out)
}

fn check_row(ty: GgmlType, bytes: usize, n: usize) -> Result<()> {
    if !ty.is_supported() {
        return Err(unsupported(ty, "quantizer/dequantizer"));
    }
    let need = ty.row_bytes(n)?;
    kt_ensure!(
        bytes == need,
        Invalid,
        "{n} {} values take {need} bytes, got {bytes}",
        ty.name()
    );
    Ok(())
}

/// Quantize activations `x` into `out` (exactly `format.row_bytes(x.len())` bytes).
pub fn quantize_activation_into(format: ActivationFormat, x: &[f32], out: &mut [u8]) -> Result<()> {
    let need = format.row_bytes(x.len())?;
    kt_ensure!(
        out.len() == need,
        Invalid,
        "{} {} activations take {need} bytes, got {}",
        x.len(),
        format.name(),
        out.len()
    );
    quantize::activation_row(format, x, out);
    Ok(())
}

/// Quantize activations `x` to `format`.
pub fn quantize_activation(format: ActivationFormat, x: &[f32]) -> Result<Vec<u8>> {
    let mut out = vec![0u8; format.row_bytes(x.len())?];
    quantize_activation_into(format, x, &mut out)?;
    Ok(out)
}

/// The values a quantized activation row stands for (`d · q` per value).
pub fn dequantize_activation(format: ActivationFormat, data: &[u8], k: usize) -> Result<Vec<f32>> {
    let need = format.row_bytes(k)?;
    kt_ensure!(
        data.len() == need,
        Invalid,
        "{k} {} activations take {need} bytes, got {}",
        format.name(),
        data.len()
    );
    Ok(dequant::activation(format, data, k))
}

/// Dot product of one `ty` weight row of `k` values with one activation row quantized to
/// `ty.activation_format()`, computed by the scalar reference code (the twin every SIMD kernel
/// must equal bit for bit). For speed use [`DotKernel`].
pub fn vec_dot(ty: GgmlType, k: usize, weight_row: &[u8], activation: &[u8]) -> Result<f32> {
    let kernel = DotKernel::scalar(ty)?;
    kernel.check(k, weight_row.len(), activation.len())?;
    Ok(kernel.dot(k, weight_row, activation))
}

/// A dot kernel: `(k, weight row, activation row) → f32`.
///
/// # Safety
/// The CPU has the kernel's features; `weight_row` holds exactly one row of `k` values of the
/// kernel's type, `activation` exactly `k` values in its activation format, `k` a valid multiple.
type RawDotFn = unsafe fn(usize, &[u8], &[u8]) -> f32;

/// A multi-row kernel: `out[r] = dot(weight_row, activations[r])` for up to
/// [`DOT_MANY_ROWS`] activation rows, each result equal to the single-row twin's.
///
/// # Safety
/// As [`RawDotFn`] for every row; `1 ≤ activations.len() ≤ DOT_MANY_ROWS`; `out` holds as many.
type RawRowsFn = unsafe fn(usize, &[u8], &[&[u8]], &mut [f32]);

/// Activation rows a multi-row kernel takes per call.
pub const DOT_MANY_ROWS: usize = 4;

/// An x8 kernel ([`x8`]): `out[i · stride + r] = dot(row r of an interleaved group of eight,
/// activations[i])` for up to [`X8_ROWS`] activation rows.
///
/// `sums32[i]` holds, for Q4_K, activation row i's [`x8::q8_k_pair_sums`] (`k/256` entries),
/// made once per activation row ([`DotKernel::x8_sums`]) rather than per group; the other
/// types ignore it.
///
/// # Safety
/// The group holds eight rows of `k` values in the type's x8 layout; the [`RawRowsFn`]
/// contract for the activations; `out` holds `(activations.len() − 1) · stride + 8`.
type RawX8Fn = unsafe fn(usize, &[u8], &[&[u8]], &[&[[i32; 4]]], &mut [f32], usize);

/// Activation rows an x8 kernel takes per call: each decoded weight vector serves this many
/// token rows (8 rather than 4 made Q6_K, whose decoding is the costly part, about 30% faster
/// in `cargo bench`, and left Q4_K and Q8_0 unchanged).
pub const X8_ROWS: usize = 8;

/// Activation rows from which [`DotKernel::dot_x8_presummed`] takes the sixteen-row kernels.
/// Below, decoding streams each group on its own: two groups at once ran one token 1.4-1.6×
/// slower on AMD Zen 4 (memory-bound, the streams interleaved).
pub const X16_MIN_ROWS: usize = 4;

/// Activation rows from which [`DotKernel::dot_x8_presummed`] takes the 32-row kernel (Q8_0
/// on AVX-512 VNNI), where the sixteen-row kernels would need two calls too. With fewer rows
/// the 32-row kernel ran an S1 layer's mid sizes slower (AMD Zen 5, two threads, LLAMAFILE
/// Q8_0, `scripts/ab_bench.sh`, three alternated rounds, from 4 rows: 32 tokens 7.25 -> 7.47
/// ms, 128 tokens 13.08 -> 13.51; 512 tokens 46.5 -> 39.3).
pub const X32_MIN_ROWS: usize = X8_ROWS + 1;

/// Activation rows from which `ty` takes its sixteen-row kernel: [`X16_MIN_ROWS`], but from two
/// rows for Q6_K, whose x8 kernel (`vpmaddubsw`, no VNNI) is compute-bound with few rows. AMD
/// Zen 4: `ggml_cycles`, one core, 8192 weight rows from DRAM, k 2048, us: 2 rows 718 -> 410,
/// 3 rows 902 -> 502 (1 row 651 -> 360); one S1 layer, `benches/ab_loop.py`, median ms: 32
/// tokens 31.2 -> 24.0 (from one row 30.7-32.9 -> 21.7-22.6), but 1 token 1.07-1.20 -> 1.53-1.57
/// from one row (two cores streaming two groups each, as for the other types; 1.31x slower
/// again after Q6_K's x8 layout became one stream), so one row keeps the x8 kernel.
pub fn x16_min_rows(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q6_K => 2,
        _ => X16_MIN_ROWS,
    }
}

/// Rows `first..end` of share `c` when `n` rows go out in `calls` near-equal shares (sizes differ
/// by at most one, larger last): 9 rows in two calls go 4 + 5, not 8 + 1. A one-row call reads
/// and unpacks the whole group for one row (`ggml_cycles`, AMD Zen 4, from cache: 9 rows 3.7-4.0
/// us as 8 + 1, 3.4-3.8 as 4 + 5; 17 rows, Q8_0, 7.8-8.0 as 8 + 8 + 1, 6.3 as 5 + 6 + 6).
fn even_share(n: usize, calls: usize, c: usize) -> (usize, usize) {
    (c * n / calls, (c + 1) * n / calls)
}

/// The prefetch distance the single-row (decode) loops use: the GGUF kernels' own family.
#[inline]
fn decode_prefetch() -> usize {
    crate::kernels::prefetch::distance_of(crate::kernels::prefetch::Family::GgufBlocks)
}

/// A dot-product kernel for one weight type, chosen once for this CPU.
#[derive(Clone, Copy)]
pub struct DotKernel {
    weight_type: GgmlType,
    name: &'static str,
    raw: RawDotFn,
    /// One weight row against several activation rows (prefill), where the type has one.
    rows: Option<RawRowsFn>,
    /// Eight interleaved rows ([`x8`]) against activation rows, where the type has a layout.
    x8: Option<RawX8Fn>,
    /// Two consecutive x8 groups at once (512-bit vectors), where the CPU and type have one.
    x16: Option<RawX8Fn>,
    /// Four consecutive x8 groups (a 32-row panel) at once, for at most
    /// [`x86_avx512_x16::X32_ROWS`] rows a call, where the CPU and type have one.
    x32: Option<RawX8Fn>,
}

impl std::fmt::Debug for DotKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DotKernel({} {})", self.weight_type, self.name)
    }
}

impl DotKernel {
    /// The scalar reference kernel.
    pub fn scalar(ty: GgmlType) -> Result<DotKernel> {
        Ok(DotKernel {
            weight_type: ty,
            name: "scalar",
            raw: dot::scalar_fn(ty).ok_or_else(|| unsupported(ty, "dot product"))?,
            rows: None,
            x8: None,
            x16: None,
            x32: None,
        })
    }

    /// The fastest kernel at or below `level`; fails if this CPU cannot run `level`. Types
    /// without a SIMD kernel get the scalar one.
    pub fn for_level(ty: GgmlType, level: Level) -> Result<DotKernel> {
        let sel = isa::global()?;
        if level > sel.detected {
            kt_bail!(
                Unsupported,
                "{} dot kernels for {} requested but this CPU offers {} (missing: {})",
                ty.name(),
                level.name(),
                sel.detected.name(),
                sel.features.missing(level).join(", ")
            );
        }
        let mut kernel = Self::scalar(ty)?;
        #[cfg(target_arch = "x86_64")]
        {
            if level >= Level::Avx512Vnni {
                if let Some(raw) = x86_avx512::dot_fn(ty) {
                    kernel.name = "avx512-vnni";
                    kernel.raw = raw;
                    // Prefill: the AVX2 multi-row kernels (AVX-512 CPUs have AVX2).
                    kernel.rows = x86_avx2_rows::rows_fn(ty);
                    kernel.x8 = x86_avx2_x8::x8_fn(ty, x86_avx2_x8::X8Mul::best(level));
                    kernel.x16 = x86_avx512_x16::x16_fn(ty);
                    kernel.x32 = x86_avx512_x16::x32_fn(ty);
                    return Ok(kernel);
                }
            }
            if level >= Level::Avx2 {
                if let Some(raw) = x86_avx2::dot_fn(ty) {
                    kernel.name = "avx2";
                    kernel.raw = raw;
                }
                kernel.rows = x86_avx2_rows::rows_fn(ty);
                kernel.x8 = x86_avx2_x8::x8_fn(ty, x86_avx2_x8::X8Mul::best(level));
            }
        }
        Ok(kernel)
    }

    /// The fastest kernel for the process's chosen level (`KT_KERNEL_CPU_VARIANT` caps it).
    pub fn best(ty: GgmlType) -> Result<DotKernel> {
        Self::for_level(ty, isa::global()?.chosen)
    }

    /// `"scalar"`, `"avx2"` or `"avx512-vnni"`.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The weight type.
    pub fn weight_type(&self) -> GgmlType {
        self.weight_type
    }

    /// The activation format this kernel reads.
    pub fn activation_format(&self) -> ActivationFormat {
        // Only supported types get a kernel, and they all have a format.
        self.weight_type
            .activation_format()
            .unwrap_or(ActivationFormat::F32)
    }

    /// Check that `k`, a weight row of `weight_bytes` and an activation row of
    /// `activation_bytes` fit this kernel.
    pub fn check(&self, k: usize, weight_bytes: usize, activation_bytes: usize) -> Result<()> {
        let ty = self.weight_type;
        let multiple = ty.k_multiple()?;
        kt_ensure!(
            k.is_multiple_of(multiple),
            Invalid,
            "{ty} dot products need k (the input dimension) to be a multiple of {multiple}, got {k}"
        );
        let w = ty.row_bytes(k)?;
        let a = self.activation_format().row_bytes(k)?;
        kt_ensure!(
            weight_bytes == w,
            Invalid,
            "a {ty} row of {k} values takes {w} bytes, got {weight_bytes}"
        );
        kt_ensure!(
            activation_bytes == a,
            Invalid,
            "{k} {} activations take {a} bytes, got {activation_bytes}",
            self.activation_format().name()
        );
        Ok(())
    }

    /// Dot product of one weight row with one activation row.
    ///
    /// # Panics
    /// If the sizes do not fit (see [`DotKernel::check`]); check once per shape beforehand.
    #[inline]
    pub fn dot(&self, k: usize, weight_row: &[u8], activation: &[u8]) -> f32 {
        if let Err(e) = self.check(k, weight_row.len(), activation.len()) {
            panic!("DotKernel::dot: {e}");
        }
        // SAFETY: the constructor checked the CPU features; the sizes were checked just above.
        unsafe { (self.raw)(k, weight_row, activation) }
    }

    /// Dot product without the size check, for loops that checked their shape once.
    ///
    /// # Safety
    /// [`DotKernel::check`]`(k, weight_row.len(), activation.len())` succeeds.
    #[inline(always)]
    pub unsafe fn dot_unchecked(&self, k: usize, weight_row: &[u8], activation: &[u8]) -> f32 {
        // SAFETY: the constructor checked the CPU features; the caller checked the sizes.
        unsafe { (self.raw)(k, weight_row, activation) }
    }

    /// `out[r] = dot(row r of rows, activation)` for `out.len()` contiguous weight rows (the
    /// sizes are checked once for all rows).
    ///
    /// # Panics
    /// If the sizes do not fit.
    pub fn dot_rows(&self, k: usize, rows: &[u8], activation: &[u8], out: &mut [f32]) {
        let row_bytes = match self.weight_type.row_bytes(k) {
            Ok(b) => b,
            Err(e) => panic!("DotKernel::dot_rows: {e}"),
        };
        assert!(
            rows.len() == row_bytes * out.len(),
            "DotKernel::dot_rows: {} rows of {k} {} values need {} bytes, got {}",
            out.len(),
            self.weight_type,
            row_bytes * out.len(),
            rows.len()
        );
        if let Err(e) = self.check(k, row_bytes, activation.len()) {
            panic!("DotKernel::dot_rows: {e}");
        }
        let pf = decode_prefetch();
        for (r, o) in out.iter_mut().enumerate() {
            let row = &rows[r * row_bytes..(r + 1) * row_bytes];
            // Streaming (decode): ask for the bytes `pf` ahead of this row before using it.
            #[cfg(target_arch = "x86_64")]
            if pf != 0 {
                for line in (0..row_bytes).step_by(64) {
                    crate::kernels::prefetch::ahead(row.as_ptr().wrapping_add(line), pf);
                }
            }
            // SAFETY: every row has row_bytes bytes, checked against k and the activation.
            *o = unsafe { self.dot_unchecked(k, row, activation) };
        }
    }

    /// Whether this kernel works on the x8 layout ([`x8`]): layers then store this type's
    /// rows interleaved in groups of eight ([`DotKernel::repack_x8`]).
    pub fn has_x8(&self) -> bool {
        self.x8.is_some()
    }

    /// Bytes of `k` values of one row in the layout this kernel reads (x8 groups count an
    /// eighth of a group per row).
    pub fn memory_row_bytes(&self, k: usize) -> Result<usize> {
        if self.has_x8() {
            Ok(x8::group_bytes(self.weight_type, k) / x8::GROUP)
        } else {
            self.weight_type.row_bytes(k)
        }
    }

    /// Repack eight consecutive file rows of `k` values into one x8 group.
    ///
    /// # Panics
    /// Without an x8 layout, or if the sizes do not fit.
    pub fn repack_x8(&self, rows: &[u8], k: usize, out: &mut [u8]) {
        assert!(self.has_x8(), "{} has no x8 layout here", self.weight_type);
        x8::repack(self.weight_type, rows, k, out);
    }

    /// Entries of [`DotKernel::x8_sums`] per activation row of `k` values: `k/256` for Q4_K's
    /// x8 kernels, 0 for the others (they need none).
    pub fn x8_sums_per_row(&self, k: usize) -> usize {
        match (self.weight_type, self.has_x8()) {
            (GgmlType::Q4_K, true) => k / 256,
            // The block sums of the VNNI kernels (four blocks of 32 per entry), then for the
            // sixteen-row kernel the blocks' scales as f32 bits (no conversion per group).
            (GgmlType::Q8_0, true) if self.x16.is_some() => 2 * k.div_ceil(128),
            (GgmlType::Q8_0, true) => k.div_ceil(128),
            _ => 0,
        }
    }

    /// An activation row's per-super-block 32-value sums for the x8 kernels (`out` holds
    /// [`DotKernel::x8_sums_per_row`] entries): made once per row, they serve every group of
    /// every call (a prefill's gate, up and each panel).
    ///
    /// # Panics
    /// If `out` or `activation` does not fit `k`.
    pub fn x8_sums(&self, k: usize, activation: &[u8], out: &mut [[i32; 4]]) {
        assert_eq!(
            out.len(),
            self.x8_sums_per_row(k),
            "DotKernel::x8_sums: bad output"
        );
        if !out.is_empty() {
            let need = self.activation_format().row_bytes(k).unwrap_or(usize::MAX);
            assert_eq!(
                activation.len(),
                need,
                "DotKernel::x8_sums: bad activation row"
            );
        }
        let sums = k.div_ceil(128);
        for (c, o) in out.iter_mut().enumerate() {
            *o = match self.weight_type {
                GgmlType::Q8_0 if c < sums => x8::q8_0_block_sums(activation, c),
                GgmlType::Q8_0 => x8::q8_0_block_scale_bits(activation, c - sums),
                _ => x8::q8_k_pair_sums(activation, c),
            };
        }
    }

    /// `out[i · out_stride + r] = dot(row r, activations[i])` for the x8 groups in `groups`
    /// (rows 8g.. of group g) and every activation row, each result equal to
    /// [`DotKernel::dot`]'s on the file rows.
    ///
    /// # Panics
    /// Without an x8 kernel, or if the sizes do not fit.
    pub fn dot_x8(
        &self,
        k: usize,
        groups: &[u8],
        activations: &[&[u8]],
        out: &mut [f32],
        out_stride: usize,
    ) {
        // The shape first, so a bad k gets the kernel's own message.
        self.check_x8_activations(k, activations);
        let per_row = self.x8_sums_per_row(k);
        let mut sums = vec![[0i32; 4]; activations.len() * per_row];
        if per_row > 0 {
            for (a, s) in activations.iter().zip(sums.chunks_mut(per_row)) {
                self.x8_sums(k, a, s);
            }
        }
        let rows: Vec<&[[i32; 4]]> = match per_row {
            0 => vec![&[][..]; activations.len()],
            n => sums.chunks(n).collect(),
        };
        // (dot_x8 is for tests and benches: the layer calls dot_x8_presummed, which checks the
        // activations again here.)
        self.dot_x8_presummed(k, groups, activations, &rows, out, out_stride);
    }

    /// The full shape check of x8 activation rows (once per call, then only lengths: this runs
    /// per panel in prefill).
    fn check_x8_activations(&self, k: usize, activations: &[&[u8]]) {
        if let Some(first) = activations.first() {
            let row_bytes = self.weight_type.row_bytes(k).unwrap_or(0);
            if let Err(e) = self.check(k, row_bytes, first.len()) {
                panic!("DotKernel::dot_x8: {e}");
            }
            assert!(
                activations.iter().all(|a| a.len() == first.len()),
                "DotKernel::dot_x8: activation rows of different lengths"
            );
        }
    }

    /// [`DotKernel::dot_x8`] with each activation row's [`DotKernel::x8_sums`] made by the
    /// caller (`sums[i]` for `activations[i]`; empty slices where the type needs none).
    ///
    /// # Panics
    /// Without an x8 kernel, or if the sizes do not fit.
    pub fn dot_x8_presummed(
        &self,
        k: usize,
        groups: &[u8],
        activations: &[&[u8]],
        sums: &[&[[i32; 4]]],
        out: &mut [f32],
        out_stride: usize,
    ) {
        self.check_x8_activations(k, activations);
        let f = self.x8.expect("dot_x8 needs an x8 kernel");
        let gb = x8::group_bytes(self.weight_type, k);
        let n = groups.len() / gb;
        assert!(
            groups.len() == n * gb && n * x8::GROUP <= out_stride,
            "DotKernel::dot_x8: bad group bytes"
        );
        if let Some(last) = activations.len().checked_sub(1) {
            assert!(
                out.len() >= last * out_stride + n * x8::GROUP,
                "DotKernel::dot_x8: output too short"
            );
        }
        let per_row = self.x8_sums_per_row(k);
        assert!(
            sums.len() == activations.len() && sums.iter().all(|s| s.len() == per_row),
            "DotKernel::dot_x8: {per_row} sums per activation row needed"
        );
        // (The kernels prefetch as they stream: a burst per group would stall on the core's
        // few outstanding misses.)
        let pairs = self
            .x16
            .filter(|_| activations.len() >= x16_min_rows(self.weight_type));
        let quads = self.x32.filter(|_| activations.len() >= X32_MIN_ROWS);
        let mut g = 0;
        while g < n {
            // Four groups at once where a 32-row kernel exists, else pairs where a sixteen-row
            // kernel exists, an odd group last on its own.
            let (span, kernel, per_call) = match (quads, pairs) {
                #[cfg(target_arch = "x86_64")]
                (Some(quad), _) if g + 3 < n => (4, quad, x86_avx512_x16::X32_ROWS),
                (_, Some(pair)) if g + 1 < n => (2, pair, X8_ROWS),
                _ => (1, f, X8_ROWS),
            };
            let group = &groups[g * gb..(g + span) * gb];
            let calls = activations.len().div_ceil(per_call);
            for c in 0..calls {
                let (first, end) = even_share(activations.len(), calls, c);
                let acts = &activations[first..end];
                let at = first * out_stride + g * x8::GROUP;
                let rows = &sums[first..end];
                // A prefill's calls share the prefetch of the next group (pair); a decode
                // (1-3 rows) keeps the calibrated distance.
                #[cfg(target_arch = "x86_64")]
                if activations.len() >= X16_MIN_ROWS {
                    x86_avx2_x8::set_pair_share(c, calls);
                }
                // SAFETY: sizes checked above; the constructor checked the CPU.
                unsafe { kernel(k, group, acts, rows, &mut out[at..], out_stride) };
            }
            g += span;
        }
    }

    /// Whether this kernel has a multi-row form (used by [`DotKernel::dot_many`] for two or
    /// more activation rows).
    pub fn has_rows_kernel(&self) -> bool {
        self.rows.is_some()
    }

    /// `out[i · out_stride + j] = dot(weight row j, activations[i])` for the contiguous weight
    /// rows in `rows` and every activation row: each result equal to [`DotKernel::dot`]'s,
    /// computed with the multi-row kernel (a weight row decoded once per
    /// [`DOT_MANY_ROWS`] activation rows) when there is one and more than one row.
    ///
    /// # Panics
    /// If the sizes do not fit.
    pub fn dot_many(
        &self,
        k: usize,
        rows: &[u8],
        activations: &[&[u8]],
        out: &mut [f32],
        out_stride: usize,
    ) {
        let row_bytes = match self.weight_type.row_bytes(k) {
            Ok(b) => b,
            Err(e) => panic!("DotKernel::dot_many: {e}"),
        };
        let n = rows.len() / row_bytes.max(1);
        assert!(
            rows.len() == n * row_bytes && n <= out_stride,
            "DotKernel::dot_many: {} bytes are not whole rows of {k} {} values, or {n} rows \
             exceed the output stride {out_stride}",
            rows.len(),
            self.weight_type
        );
        if let Some(last) = activations.len().checked_sub(1) {
            assert!(
                out.len() >= last * out_stride + n,
                "DotKernel::dot_many: output too short"
            );
        }
        for a in activations {
            if let Err(e) = self.check(k, row_bytes, a.len()) {
                panic!("DotKernel::dot_many: {e}");
            }
        }
        let multi = self.rows.filter(|_| activations.len() > 1);
        let pf = decode_prefetch();
        let mut lanes = [0f32; DOT_MANY_ROWS];
        for j in 0..n {
            let row = &rows[j * row_bytes..(j + 1) * row_bytes];
            #[cfg(target_arch = "x86_64")]
            if pf != 0 {
                for line in (0..row_bytes).step_by(64) {
                    crate::kernels::prefetch::ahead(row.as_ptr().wrapping_add(line), pf);
                }
            }
            match multi {
                Some(f) => {
                    for (c, acts) in activations.chunks(DOT_MANY_ROWS).enumerate() {
                        // SAFETY: sizes checked above; the constructor checked the CPU.
                        unsafe { f(k, row, acts, &mut lanes[..acts.len()]) };
                        for (i, v) in lanes[..acts.len()].iter().enumerate() {
                            out[(c * DOT_MANY_ROWS + i) * out_stride + j] = *v;
                        }
                    }
                }
                None => {
                    for (i, a) in activations.iter().enumerate() {
                        // SAFETY: sizes checked above.
                        out[i * out_stride + j] = unsafe { self.dot_unchecked(k, row, a) };
                    }
                }
            }
        }
    }
}
