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
}

impl FloatType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            FloatType::F32 => 4,
            FloatType::F16 | FloatType::BF16 => 2,
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
        }
    }
}

/// Convert a row of `src_type` elements to f32.
///
/// # Safety
/// `src` must point to `dst.len()` readable elements of type `src_type`.
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
            unsafe {
                row_from_f32(&src, raw.as_mut_ptr(), t);
                row_to_f32(raw.as_ptr(), t, &mut back);
            }
            for (a, b) in src.iter().zip(back) {
                assert!((a - b).abs() <= a.abs() * 1e-2, "{t:?}: {a} vs {b}");
            }
        }
        assert_eq!(FloatType::parse("torch.bfloat16").unwrap(), FloatType::BF16);
        assert!(matches!(FloatType::parse("int8"), Err(Error::Dtype(_))));
    }
}
