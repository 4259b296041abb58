//! The public method strings of `KTMoEWrapper(method=...)`, in one enum.
//!
//! This is the only spelling of "which weight format" that travels through the crate: Python
//! hands the string to [`Method::parse`], the layer is built for the [`Method`], and the format
//! registry (`formats::build`, which also says which methods this build computes) maps it to
//! the code that stores and multiplies its experts.
use crate::isa::Level;
use crate::{Error, Result};

/// An inference method of the original kt-kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Method {
    /// bf16/fp16/fp32 checkpoints packed as bf16 panels.
    Bf16,
    /// Per-row symmetric int8 in the original's tiled AMXINT8 layout.
    AmxInt8,
    /// Per-row symmetric int4 in the original's AMXINT4 nibble layout.
    AmxInt4,
    /// GGUF experts in ggml block formats.
    Llamafile,
    /// Block-FP8 checkpoints.
    Fp8,
    /// Per-channel FP8 checkpoints.
    Fp8PerChannel,
    /// Packed int4 with group scales (Kimi-K2).
    RawInt4,
    /// GPTQ int4 checkpoints.
    GptqInt4,
    /// GPTQ int4 on SYCL devices.
    SyclGptqInt4,
    /// MX FP4 (e2m1 with e8m0 block scales).
    MxFp4,
    /// NVIDIA FP4 (e2m1 with fp8 block scales).
    NvFp4,
    /// MX FP8 (e4m3 with e8m0 block scales).
    MxFp8,
    /// The original's generic int4 MoE.
    MoeInt4,
    /// The original's generic int8 MoE.
    MoeInt8,
}

impl Method {
    /// Every method, in the order the original documents them.
    pub const ALL: [Method; 14] = [
        Method::AmxInt4,
        Method::AmxInt8,
        Method::RawInt4,
        Method::Fp8,
        Method::Bf16,
        Method::Fp8PerChannel,
        Method::GptqInt4,
        Method::SyclGptqInt4,
        Method::MxFp4,
        Method::NvFp4,
        Method::MxFp8,
        Method::Llamafile,
        Method::MoeInt4,
        Method::MoeInt8,
    ];

    /// The public string (`"AMXINT8"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Method::Bf16 => "BF16",
            Method::AmxInt8 => "AMXINT8",
            Method::AmxInt4 => "AMXINT4",
            Method::Llamafile => "LLAMAFILE",
            Method::Fp8 => "FP8",
            Method::Fp8PerChannel => "FP8_PERCHANNEL",
            Method::RawInt4 => "RAWINT4",
            Method::GptqInt4 => "GPTQ_INT4",
            Method::SyclGptqInt4 => "SYCL_GPTQ_INT4",
            Method::MxFp4 => "MXFP4",
            Method::NvFp4 => "NVFP4",
            Method::MxFp8 => "MXFP8",
            Method::MoeInt4 => "MOE_INT4",
            Method::MoeInt8 => "MOE_INT8",
        }
    }

    /// The method named by its public string (exact, as the original compares).
    pub fn parse(s: &str) -> Result<Method> {
        Method::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                let mut names: Vec<_> = Method::ALL.iter().map(|m| m.name()).collect();
                names.sort_unstable();
                Error::Invalid(format!(
                    "unknown method {s:?}; valid methods: {}",
                    names.join(", ")
                ))
            })
    }

    /// Lowest ISA level the method runs on. Every implemented method has a scalar twin, so it
    /// runs on any x86-64 CPU; faster kernels are picked from the level at layer construction.
    pub fn min_level(self) -> Level {
        Level::Generic
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back_to_its_method() {
        for m in Method::ALL {
            assert_eq!(Method::parse(m.name()).unwrap(), m);
        }
        let e = Method::parse("amxint8").unwrap_err().to_string();
        assert!(e.contains("AMXINT8") && e.contains("valid methods"), "{e}");
    }
}
