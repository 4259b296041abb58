//! The MoE layer, generic over the weight format: route → gather and prepare x → gate/up →
//! SwiGLU → prepare act → down → weighted reduce → NUMA merge.
//!
//! Every expert is split along the intermediate dimension into one slice per sub-pool ("part");
//! a part holds rows `r0..r1` of gate and up and the matching columns of down, computes a full
//! width fp32 partial output, and the partials are summed. Weights are packed once at load by
//! the part's own threads (so their pages live on its node); activations stay fp32 between the
//! phases, and each format prepares its own copy of them ([`crate::formats`]).
//!
//! - [`load`](self::load): checks and the parallel packing from an [`ExpertSource`] or files;
//! - [`workspace`](self::workspace): the scratch of forward calls, planned per layer;
//! - [`forward`](self::forward): the phases of one forward.
use crate::formats::{ExpertFormat, LayerFiles, RowShare};
use crate::kernels::KernelSet;
use crate::method::Method;
use crate::pool::Pool;
use crate::{kt_bail, kt_ensure, Result};
use std::ops::Range;

mod forward;
mod load;
mod phase_timing;
mod workspace;

pub use crate::expert::{ExpertSource, MoeConfig, Proj, TensorSource};
pub use forward::ForwardArgs;
pub use workspace::Workspace;

/// Tokens processed per internal chunk: bounds the scratch memory whatever
/// `chunked_prefill_size` is, while keeping enough rows per expert for the blocked GEMM.
pub const CHUNK_TOKENS: usize = 1024;

/// Forwards with at most this many (row × hidden) down outputs use the decode's down scheme.
const ROWWISE_DOWN_MAX: usize = 1 << 20;

/// One MoE layer with its experts in one format.
pub struct MoeLayer {
    config: MoeConfig,
    kernels: KernelSet,
    experts: Box<dyn ExpertFormat>,
    loaded: bool,
    rowwise_down_max: usize,
    /// Phase times since the last report (`KT_MOE_PHASE_TIMING`).
    phase_stats: phase_timing::PhaseStats,
}

impl MoeLayer {
    /// An unloaded BF16 layer for a pool with `parts` sub-pools, using `kernels`.
    pub fn new(config: MoeConfig, parts: usize, kernels: KernelSet) -> Result<MoeLayer> {
        Self::with_method(config, parts, kernels, Method::Bf16)
    }

    /// An unloaded layer storing its experts as `method` does (the format registry,
    /// [`crate::formats::build`], says which methods exist).
    pub fn with_method(
        config: MoeConfig,
        parts: usize,
        kernels: KernelSet,
        method: Method,
    ) -> Result<MoeLayer> {
        config.validate(parts)?;
        let experts = crate::formats::build(method, &config, parts, kernels)?;
        Ok(MoeLayer {
            config,
            kernels,
            experts,
            loaded: false,
            rowwise_down_max: ROWWISE_DOWN_MAX,
            phase_stats: Default::default(),
        })
    }

    /// The method whose format holds the experts.
    pub fn method(&self) -> Method {
        self.experts.method()
    }

    /// The experts' format (its own API through [`ExpertFormat::as_any`]).
    pub fn experts(&self) -> &dyn ExpertFormat {
        &*self.experts
    }

    /// The format as its concrete type `T`, if it is one.
    pub fn experts_as<T: 'static>(&self) -> Option<&T> {
        self.experts.as_any().downcast_ref()
    }

    /// Name of the kernels in use (e.g. `"avx512-fma"`, `"amx+avx512-vnni"`, or the ggml types
    /// and kernels of a GGUF layer).
    pub fn kernel_name(&self) -> String {
        self.experts.kernel_name()
    }

    /// Forwards with at most `elems` (rows × hidden) down outputs use the decode's down scheme
    /// (one block of output columns per thread, or row-wise shares where the layer is narrow
    /// for its threads); larger ones one block of columns per thread whatever the width. All
    /// give the same result; this is a tuning knob (and lets tests cover each).
    pub fn set_rowwise_down_limit(&mut self, elems: usize) {
        self.rowwise_down_max = elems.min(ROWWISE_DOWN_MAX);
    }

    /// The layer's configuration.
    pub fn config(&self) -> &MoeConfig {
        &self.config
    }

    /// The kernel set the format chose its kernels from.
    pub fn kernels(&self) -> &KernelSet {
        &self.kernels
    }

    /// True once weights are loaded.
    pub fn is_loaded(&self) -> bool {
        self.loaded
    }

    /// Intermediate slice of each part.
    pub fn part_ranges(&self) -> Vec<Range<usize>> {
        self.experts.part_ranges().to_vec()
    }

    /// One part of one slot's quantized projection (AMXINT8/AMXINT4 layers): the matrix bytes
    /// in the in-memory layout (the original's file layout after
    /// [`crate::quant::to_file_layout`]) and the row scales.
    pub fn quantized_part(&self, slot: usize, proj: Proj, part: usize) -> Result<(&[u8], &[f32])> {
        let Some(q) = self.experts_as::<crate::formats::int8::IntExperts>() else {
            kt_bail!(Invalid, "no quantized part {part} in this layer");
        };
        kt_ensure!(
            self.loaded,
            Invalid,
            "layer {} is not loaded",
            self.config.layer_idx
        );
        q.quantized_part(slot, proj, part)
    }

    /// The ggml types of a loaded GGUF layer.
    pub fn ggml_types(&self) -> Option<crate::formats::ggml::GgmlTypes> {
        self.experts_as::<crate::formats::ggml::GgmlExperts>()
            .and_then(|g| g.types())
    }

    /// Copy the original's converted AMXINT8/AMXINT4 files (see [`crate::converted`]) into
    /// this layer: physical slot `p` gets file expert `map[p]` (identity when None). The files
    /// must be split into as many parts as this layer has.
    pub fn load_converted(
        &mut self,
        pool: &Pool,
        files: &crate::converted::ConvertedLayer,
        map: Option<&[i64]>,
    ) -> Result<()> {
        self.load_files(pool, &LayerFiles::Converted(files), map)
    }

    /// The bytes each GPU rank's four buffers receive from
    /// [`MoeLayer::write_weight_scale_to_buffer`] at `gpu_tp` ranks (w13, w13 scales, w2, w2
    /// scales); an error for methods without a GPU layout.
    pub fn gpu_rank_bytes(&self, gpu_tp: usize) -> Result<[usize; 4]> {
        self.experts.gpu_rank_bytes(gpu_tp)
    }

    /// Check a [`MoeLayer::write_weight_scale_to_buffer`] call before it runs: weights loaded,
    /// `slot` in range, a split the method allows, no null buffer that would receive bytes.
    pub fn check_gpu_write(&self, slot: usize, dst: &[crate::formats::GpuRankDst]) -> Result<()> {
        let c = &self.config;
        kt_ensure!(
            self.loaded,
            Runtime,
            "layer {}: write_weight_scale_to_buffer before the weights were loaded",
            c.layer_idx
        );
        kt_ensure!(
            slot < c.num_experts,
            Invalid,
            "expert_id {slot} is out of range for {} experts",
            c.num_experts
        );
        let bytes = self.experts.gpu_rank_bytes(dst.len())?;
        for (rank, d) in dst.iter().enumerate() {
            for (name, ptr, n) in [
                ("w13_weight", d.w13, bytes[0]),
                ("w13_scale", d.w13_scale, bytes[1]),
                ("w2_weight", d.w2, bytes[2]),
                ("w2_scale", d.w2_scale, bytes[3]),
            ] {
                kt_ensure!(
                    n == 0 || !ptr.is_null(),
                    Invalid,
                    "{name} pointer of GPU rank {rank} is null"
                );
            }
        }
        Ok(())
    }

    /// Write physical expert `slot`'s weights and scales into each GPU tensor-parallel rank's
    /// buffers (`dst[rank]`), ranks in parallel on `pool` (the original's
    /// `write_weight_scale_to_buffer`: w13 = the rank's gate‖up rows, w2 = down cut to its
    /// columns, in the method's GPU layout, whatever the NUMA split of this layer).
    ///
    /// # Safety
    /// Each buffer of `dst[rank]` has the bytes [`MoeLayer::gpu_rank_bytes`] gives, writable
    /// and not touched by anyone else until this returns (null buffers are refused).
    pub unsafe fn write_weight_scale_to_buffer(
        &self,
        pool: &Pool,
        slot: usize,
        dst: &[crate::formats::GpuRankDst],
    ) -> Result<()> {
        self.check_gpu_write(slot, dst)?;
        let gpu_tp = dst.len();
        // Every thread busy: a rank's rows split into shares when there are fewer ranks.
        let count = pool.total_threads().div_ceil(gpu_tp).max(1);
        let first = crate::error::FirstError::new();
        pool.parallel_for_all(gpu_tp * count, &|task| {
            let (rank, share) = (
                task / count,
                RowShare {
                    index: task % count,
                    count,
                },
            );
            // SAFETY: the caller's contract; rank `rank`'s buffers belong to its shares' tasks,
            // each of which writes its own rows.
            first.record(unsafe {
                self.experts
                    .write_gpu_rank(slot, gpu_tp, rank, share, &dst[rank])
            });
        })?;
        first.into_result()
    }

    /// Copy layer `layer`'s experts from a GGUF model (`blk.{layer}.ffn_{gate,up,down}_exps.weight`)
    /// into this LLAMAFILE layer; the file decides the ggml types. Physical slot `p` receives
    /// file expert `map[p]`; without a map slot `p` takes file expert `p` (the file holds at
    /// least `num_experts`). On error the layer keeps its previous weights.
    pub fn load_gguf(
        &mut self,
        pool: &Pool,
        model: &crate::gguf::GgufModel,
        layer: usize,
        map: Option<&[i64]>,
    ) -> Result<()> {
        self.load_files(pool, &LayerFiles::Gguf(model, layer), map)
    }

    /// Copy this LLAMAFILE layer's experts from stacked tensors in GGUF's layout in memory
    /// (the original's `MOE` class: `gate_proj`/`up_proj`/`down_proj` addresses with ggml
    /// type ids `gate_type`/`up_type`/`down_type`), `num_experts` experts each.
    ///
    /// # Safety
    /// Each address holds `num_experts` experts of its projection in ggml blocks of its type
    /// (gate/up: `I` rows of `H` inputs, down: `H` rows of `I` inputs, per expert), alive and
    /// unchanged for the call.
    pub unsafe fn load_ggml_addresses(
        &mut self,
        pool: &Pool,
        tensors: [(usize, u32); 3],
        map: Option<&[i64]>,
    ) -> Result<()> {
        let c = &self.config;
        let (e, h, i) = (c.num_experts, c.hidden, c.intermediate);
        let mut infos = Vec::with_capacity(3);
        for ((at, id), (name, k, n)) in
            tensors
                .into_iter()
                .zip([("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)])
        {
            let Some(ty) = crate::ggml::GgmlType::from_id(id) else {
                kt_bail!(Invalid, "{name}: {id} is not a ggml type id");
            };
            kt_ensure!(at != 0, Invalid, "{name} is a null address");
            kt_ensure!(
                k.is_multiple_of(ty.block_size()),
                Invalid,
                "{name} is {ty}, whose blocks of {} do not divide its {k} inputs",
                ty.block_size()
            );
            let size = e * n * (k / ty.block_size()) * ty.type_size();
            infos.push((
                at,
                crate::gguf::TensorInfo {
                    name: format!("{name} (address 0x{at:x}, {ty})"),
                    dims: vec![k, n, e],
                    ggml_type: ty,
                    offset: 0,
                    data_start: 0,
                    size,
                },
            ));
        }
        let tensor = |j: usize| {
            let (at, info) = &infos[j];
            // SAFETY: the contract: `info.size` bytes of that projection at `at`.
            let data = unsafe { std::slice::from_raw_parts(*at as *const u8, info.size) };
            crate::gguf::ExpertTensor::new(info, data)
        };
        let tensors = [tensor(0)?, tensor(1)?, tensor(2)?];
        self.load_files(pool, &LayerFiles::Ggml(tensors), map)
    }
}

#[cfg(test)]
mod tests;
