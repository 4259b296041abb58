//! Method AMXINT4: per-row symmetric int4 (`16·v`, two weights a byte) in the original's
//! AMXINT4 nibble layout ([`crate::quant`]). Storage, loading and the forward are AMXINT8's
//! ([`super::int8::IntExperts`]); this width differs in its matrix bytes, its split unit (whole
//! 128-input tiles) and its kernels.
use super::int8::{IntExperts, IntLayout};
use super::ExpertFormat;
use crate::expert::MoeConfig;
use crate::kernels::KernelSet;
use crate::method::Method;
use crate::Result;

pub mod kernels;

/// The registry's builder ([`super::build`]): AMXINT8's storage with this layout.
pub fn experts(
    config: &MoeConfig,
    parts: usize,
    kernels: KernelSet,
) -> Result<Box<dyn ExpertFormat>> {
    Ok(Box::new(IntExperts::new(config, parts, kernels, INT4)?))
}

/// AMXINT4.
pub const INT4: IntLayout = IntLayout {
    method: Method::AmxInt4,
    bits: 4,
    unit: 128,
    vector_kernel: kernels::vector_kernel,
    amx_kernel: |a| a.int4,
    amx_packed: |a| a.int4_packed,
};
