//! Element types that cross the API boundary, and conversions to fp32.
use crate::{Error, Result};
use half::{bf16, f16};

/// Floating-point element types of activations and weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FloatType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16 (the top half of an fp32).
    BF16,
    /// FP8 E4M3 ("fn": no infinities, 0x7F/0xFF are NaN, max 448); checkpoint weights only,
    /// usually with a per-block scale (see [`crate::pack::BlockScale`]).
    F8E4M3,
}

impl FloatType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            FloatType::F32 => 4,
            FloatType::F16 | FloatType::BF16 => 2,
            FloatType::F8E4M3 => 1,
        }
    }

    /// Parse the torch/numpy/safetensors spellings ("bfloat16", "BF16", "float32", ...).
    pub fn parse(name: &str) -> Result<FloatType> {
        let n = name
            .trim()
            .trim_start_matches("torch.")
            .to_ascii_lowercase();
        Ok(match n.as_str() {
            "float32" | "f32" | "fp32" | "float" => FloatType::F32,
            "float16" | "f16" | "fp16" | "half" => FloatType::F16,
            "bfloat16" | "bf16" => FloatType::BF16,
            _ => {
                return Err(Error::Dtype(format!(
                "unsupported floating-point dtype {name:?}; expected bfloat16, float16 or float32"
            )))
            }
        })
    }

    /// The torch name of the type.
    pub fn name(self) -> &'static str {
        match self {
            FloatType::F32 => "float32",
            FloatType::F16 => "float16",
            FloatType::BF16 => "bfloat16",
            FloatType::F8E4M3 => "float8_e4m3fn",
        }
    }
}

/// Integer types accepted for expert ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdType {
    /// int32.
    I32,
    /// int64.
    I64,
}

impl IdType {
    /// Parse "int32"/"int64".
    pub fn parse(name: &str) -> Result<IdType> {
        match name.trim().trim_start_matches("torch.") {
            "int32" | "i32" => Ok(IdType::I32),
            "int64" | "i64" | "long" => Ok(IdType::I64),
            _ => Err(Error::Dtype(format!(
                "unsupported expert-id dtype {name:?}; expected int32 or int64"
            ))),
        }
    }
}

/// bf16 bits → f32 (exact).
#[inline(always)]
pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 → bf16 bits, rounding to nearest even; NaN stays NaN (quiet).
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}

/// FP8 E4M3FN → f32 (exact): 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0 is
/// subnormal (m/8 · 2⁻⁶); `S.1111.111` is NaN; there is no infinity.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let (e, m) = ((b >> 3) & 0xF, b & 0x7);
    if e == 0xF && m == 0x7 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        m as f32 / 8.0 * (2.0f32).powi(-6)
    } else {
        (1.0 + m as f32 / 8.0) * (2.0f32).powi(e as i32 - 7)
    };
    sign * mag
}

/// f32 → FP8 E4M3FN, nearest (ties to even code), saturating at ±448; NaN → 0x7F.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    let a = x.abs();
    if a >= 448.0 {
        return sign | 0x7E;
    }
    if a < 1.0 / 64.0 {
        // Subnormal codes are multiples of 2⁻⁹; 8 · 2⁻⁹ rounds up into the first normal code.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Round the 23-bit mantissa to 3 bits, ties to even, letting a carry bump the exponent;
    // below 448 the result stays at or below code 0x7E.
    let bits = a.to_bits();
    let rounded = bits + 0x7_FFFF + ((bits >> 20) & 1);
    let exponent = (rounded >> 23) + 7 - 127;
    sign | ((exponent << 3) | ((rounded >> 20) & 0x7)) as u8
}

/// Read element `i` of a raw float buffer of type `t` as f32.
///
/// # Safety
/// `ptr` must point to at least `i + 1` readable elements of type `t`.
#[inline(always)]
pub unsafe fn load_f32(ptr: *const u8, t: FloatType, i: usize) -> f32 {
    // SAFETY: the caller guarantees element `i` is in bounds; unaligned reads are used because
    // torch may hand us storage offsets that are only element-aligned.
    unsafe {
        match t {
            FloatType::F32 => (ptr as *const f32).add(i).read_unaligned(),
            FloatType::F16 => f16::from_bits((ptr as *const u16).add(i).read_unaligned()).to_f32(),
            FloatType::BF16 => bf16_bits_to_f32((ptr as *const u16).add(i).read_unaligned()),
            FloatType::F8E4M3 => e4m3_to_f32(*ptr.add(i)),
        }
    }
}

/// Convert a row of `src_type` elements to f32.
///
/// # Safety
/// `src` must point to `dst.len()` readable elements of type `src_type`.
#[inline(always)]
pub unsafe fn row_to_f32(src: *const u8, src_type: FloatType, dst: &mut [f32]) {
    // SAFETY: forwarded contract.
    unsafe {
        match src_type {
            FloatType::F32 => {
                std::ptr::copy_nonoverlapping(src as *const f32, dst.as_mut_ptr(), dst.len())
            }
            FloatType::BF16 => {
                let s = src as *const u16;
                for (i, d) in dst.iter_mut().enumerate() {
                    *d = bf16_bits_to_f32(s.add(i).read_unaligned());
                }
            }
            FloatType::F16 => {
                let s = src as *const u16;
                for (i, d) in dst.iter_mut().enumerate() {
                    *d = f16::from_bits(s.add(i).read_unaligned()).to_f32();
                }
            }
            FloatType::F8E4M3 => {
                for (i, d) in dst.iter_mut().enumerate() {
                    *d = e4m3_to_f32(*src.add(i));
                }
            }
        }
    }
}

/// Write an f32 row as `dst_type` (round to nearest even).
///
/// # Safety
/// `dst` must point to `src.len()` writable elements of type `dst_type`.
pub unsafe fn row_from_f32(src: &[f32], dst: *mut u8, dst_type: FloatType) {
    // SAFETY: forwarded contract.
    unsafe {
        match dst_type {
            FloatType::F32 => {
                std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut f32, src.len())
            }
            FloatType::BF16 => {
                let d = dst as *mut u16;
                for (i, &v) in src.iter().enumerate() {
                    d.add(i).write_unaligned(f32_to_bf16_bits(v));
                }
            }
            FloatType::F16 => {
                let d = dst as *mut u16;
                for (i, &v) in src.iter().enumerate() {
                    d.add(i).write_unaligned(f16::from_f32(v).to_bits());
                }
            }
            FloatType::F8E4M3 => {
                for (i, &v) in src.iter().enumerate() {
                    *dst.add(i) = f32_to_e4m3(v);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_and_rounding() {
        assert_eq!(bf16_bits_to_f32(f32_to_bf16_bits(1.5)), 1.5);
        // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (1.0).
        assert_eq!(bf16_bits_to_f32(f32_to_bf16_bits(1.0 + 1.0 / 256.0)), 1.0);
        assert!(bf16_bits_to_f32(f32_to_bf16_bits(f32::NAN)).is_nan());
    }

    #[test]
    fn rows_convert_each_type() {
        let src = [1.0f32, -2.5, 3.25, 1e-3];
        for t in [FloatType::F32, FloatType::F16, FloatType::BF16] {
            let mut raw = vec![0u8; src.len() * t.size()];
            let mut back = [0f32; 4];
            // SAFETY: `raw` holds 4 values of `t`, `back` 4 floats.
            unsafe {
                row_from_f32(&src, raw.as_mut_ptr(), t);
                row_to_f32(raw.as_ptr(), t, &mut back);
            }
            for (a, b) in src.iter().zip(back) {
                assert!((a - b).abs() <= a.abs() * 1e-2, "{t:?}: {a} vs {b}");
            }
        }
        assert_eq!(FloatType::parse("torch.bfloat16").unwrap(), FloatType::BF16);
        // FP8 E4M3: known codes, and every finite code survives a round trip.
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0xB8), -1.0);
        assert!(e4m3_to_f32(0x7F).is_nan());
        for code in (0u8..=0xFF).filter(|c| c & 0x7F != 0x7F) {
            let v = e4m3_to_f32(code);
            assert_eq!(f32_to_e4m3(v), code, "code {code:#x}");
        }
        assert_eq!(f32_to_e4m3(1e9), 0x7E);
        // The fast rounding against a plain nearest-code search (ties to the even code), on
        // every code, every midpoint between neighbours and random values of every decade.
        let search = |x: f32| -> u8 {
            let sign = if x.is_sign_negative() { 0x80 } else { 0 };
            let a = x.abs().min(448.0);
            let mut best = 0u8;
            for code in 1u8..=0x7E {
                let (d, db) = ((e4m3_to_f32(code) - a).abs(), (e4m3_to_f32(best) - a).abs());
                if d < db || (d == db && code % 2 == 0) {
                    best = code;
                }
            }
            sign | best
        };
        let mut probes = vec![0.0f32, -0.0, 448.0, 449.0, 470.0, 1e30, -1e-30, 1.0 / 64.0];
        for code in 0u8..0x7E {
            let (lo, hi) = (e4m3_to_f32(code), e4m3_to_f32(code + 1));
            probes.extend([lo, (lo + hi) / 2.0, hi, -(lo + hi) / 2.0]);
        }
        let mut rng = crate::rng::Rng::new(5);
        for _ in 0..20000 {
            let decade = (rng.below(40) as i32 - 30) as f32;
            probes.push(rng.normal() * 2f32.powf(decade / 2.0));
        }
        for x in probes {
            assert_eq!(f32_to_e4m3(x), search(x), "x = {x:e}");
        }
        assert!(matches!(FloatType::parse("int8"), Err(Error::Dtype(_))));
    }
}
