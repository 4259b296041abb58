//! kt-core: CPU Mixture-of-Experts kernels for hybrid CPU/GPU serving.
//!
//! Pure Rust, no Python. The pieces, bottom up:
//! - [`isa`]: what the CPU and OS allow (CPUID + XCR0 + Linux AMX permission), capped by
//!   `KT_KERNEL_CPU_VARIANT`.
//! - [`kernels`]: a [`kernels::KernelSet`] of function pointers chosen once per layer; every SIMD
//!   kernel has a scalar twin in [`kernels::scalar`].
//! - [`topology`], [`affinity`], [`pool`]: NUMA nodes and physical cores, pinned worker groups
//!   (one per sub-pool) that spin briefly and then park.
//! - [`engine`]: a FIFO task queue (submit returns at once, sync waits) like the original's CPUInfer.
//! - [`method`]: the public method strings as one enum.
//! - [`formats`]: one folder per weight format behind the `ExpertFormat` trait, and the registry.
//! - [`moe`]: the MoE layer, generic over the format: route, gather, gate/up, SwiGLU, down,
//!   weighted sum, NUMA merge.
//! - [`weights`]: expert weights from tensors in memory or Hugging Face safetensors checkpoints.
//!
//! Threading model: a layer is split along the intermediate dimension into one part per sub-pool;
//! each part runs on its own pinned workers and the fp32 partial outputs are summed.
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)]
#![warn(missing_docs)]

/// This crate's version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

pub mod affinity;
pub mod codes;
pub mod convert;
pub mod converted;
pub mod cuda_bridge;
pub mod dtype;
pub mod encode;
pub mod engine;
pub mod error;
pub mod expert;
pub mod expert_pointers;
pub mod file_stamp;
pub mod formats;
#[doc(hidden)]
pub mod fuzzing;
pub mod ggml;
pub mod gguf;
pub mod isa;
pub mod kernels;
pub mod layerwise;
pub mod lines;
pub mod method;
pub mod moe;
pub mod pack;
pub mod pool;
pub mod probe;
pub mod quant;
pub mod rng;
pub mod routing;
pub mod safetensors_file;
pub mod shard_index;
pub mod sync_ptr;
#[cfg(test)]
mod testutil;
pub mod topology;
pub mod weights;

pub use error::{Error, Result};
