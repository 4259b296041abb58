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
use crate::dtype::FloatType;
use crate::formats::{ExpertFormat, LayerFiles};
use crate::kernels::KernelSet;
use crate::method::Method;
use crate::pack::{MatrixView, PANEL};
use crate::pool::Pool;
use crate::{kt_bail, kt_ensure, Result};
use std::ops::Range;

mod forward;
mod load;
mod workspace;

pub use forward::{ForwardArgs, CHUNK_TOKENS};
pub use workspace::Workspace;

/// Shape and options of one MoE layer.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Layer index (for messages).
    pub layer_idx: usize,
    /// Routed experts.
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Model hidden size H.
    pub hidden: usize,
    /// Expert intermediate size I.
    pub intermediate: usize,
    /// Most tokens in one forward call (`chunked_prefill_size`).
    pub max_tokens: usize,
    /// SwiGLU clamp (0 = off): gate ≤ L, |up| ≤ L.
    pub swiglu_limit: f32,
    /// "swigluoai" α (0 = plain SiLU·up).
    pub swiglu_alpha: f32,
}

impl MoeConfig {
    /// Check the shape for `parts` NUMA parts; the message says exactly what is wrong.
    pub fn validate(&self, parts: usize) -> Result<()> {
        let l = self.layer_idx;
        kt_ensure!(
            self.num_experts > 0,
            Invalid,
            "layer {l}: num_experts must be positive"
        );
        kt_ensure!(
            self.top_k > 0 && self.top_k <= self.num_experts,
            Invalid,
            "layer {l}: num_experts_per_tok={} must be in 1..={}",
            self.top_k,
            self.num_experts
        );
        kt_ensure!(
            self.hidden > 0 && self.hidden.is_multiple_of(PANEL),
            Invalid,
            "layer {l}: hidden_size={} must be a positive multiple of {PANEL}",
            self.hidden
        );
        kt_ensure!(
            self.intermediate > 0 && self.intermediate.is_multiple_of(PANEL),
            Invalid,
            "layer {l}: moe_intermediate_size={} must be a positive multiple of {PANEL}",
            self.intermediate
        );
        self.check_blocks(parts, PANEL)?;
        kt_ensure!(
            self.max_tokens > 0,
            Invalid,
            "layer {l}: chunked_prefill_size must be at least 1"
        );
        kt_ensure!(
            self.swiglu_limit >= 0.0 && self.swiglu_limit.is_finite(),
            Invalid,
            "layer {l}: swiglu_limit must be a finite value ≥ 0, got {}",
            self.swiglu_limit
        );
        kt_ensure!(
            self.swiglu_alpha >= 0.0 && self.swiglu_alpha.is_finite(),
            Invalid,
            "layer {l}: swiglu_alpha must be a finite value ≥ 0, got {}",
            self.swiglu_alpha
        );
        Ok(())
    }

    /// Every NUMA part needs at least one block of `unit` intermediate rows.
    pub(crate) fn check_blocks(&self, parts: usize, unit: usize) -> Result<()> {
        let l = self.layer_idx;
        kt_ensure!(
            self.intermediate / unit >= parts,
            Invalid,
            "layer {l}: moe_intermediate_size={} has {} blocks of {unit}, fewer than \
             threadpool_count={parts}; every NUMA part needs at least one block",
            self.intermediate,
            self.intermediate / unit
        );
        Ok(())
    }

    /// Slice of the intermediate dimension owned by each part, in whole panels, as even as
    /// possible (earlier parts take the remainder).
    pub fn part_ranges(&self, parts: usize) -> Vec<Range<usize>> {
        self.part_ranges_in_units(parts, PANEL)
    }

    /// Like [`MoeConfig::part_ranges`] in blocks of `unit`.
    pub fn part_ranges_in_units(&self, parts: usize, unit: usize) -> Vec<Range<usize>> {
        let blocks = self.intermediate / unit;
        let mut start = 0;
        (0..parts)
            .map(|i| {
                let n = (blocks / parts + usize::from(i < blocks % parts)) * unit;
                let r = start..start + n;
                start += n;
                r
            })
            .collect()
    }

    /// Logical expert of every physical slot (`map[p]`, identity when None), checked against
    /// `available` experts.
    pub fn logical_experts(&self, map: Option<&[i64]>, available: usize) -> Result<Vec<usize>> {
        let l = self.layer_idx;
        match map {
            None => {
                kt_ensure!(
                    available >= self.num_experts,
                    Invalid,
                    "layer {l}: the weights hold {available} experts, the layer needs {}",
                    self.num_experts
                );
                Ok((0..self.num_experts).collect())
            }
            Some(m) => {
                kt_ensure!(
                    m.len() == self.num_experts,
                    Invalid,
                    "layer {l}: physical_to_logical_map has {} entries, expected num_experts={}",
                    m.len(),
                    self.num_experts
                );
                m.iter()
                    .enumerate()
                    .map(|(p, &e)| {
                        if e < 0 || e as u64 >= available as u64 {
                            kt_bail!(
                                Invalid,
                                "layer {l}: physical_to_logical_map[{p}]={e} is outside 0..{available}"
                            );
                        }
                        Ok(e as usize)
                    })
                    .collect()
            }
        }
    }

    /// Bytes of packed expert weights (bf16) in the whole layer.
    pub fn weight_bytes(&self) -> usize {
        3 * self.num_experts * self.hidden * self.intermediate * 2
    }
}

/// Which projection of an expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proj {
    /// gate_proj `[I][H]`.
    Gate,
    /// up_proj `[I][H]`.
    Up,
    /// down_proj `[H][I]`.
    Down,
}

impl Proj {
    /// Position in gate, up, down order.
    pub fn index(self) -> usize {
        match self {
            Proj::Gate => 0,
            Proj::Up => 1,
            Proj::Down => 2,
        }
    }
}

/// Where expert weights come from at load time (tensors in memory, a checkpoint...).
pub trait ExpertSource: Sync {
    /// Number of (logical) experts available.
    fn num_experts(&self) -> usize;
    /// Full matrix of one projection of logical expert `expert`: gate/up `[I][H]`, down `[H][I]`.
    /// The view must stay valid while the source lives.
    fn matrix(&self, expert: usize, proj: Proj) -> Result<MatrixView>;
}

/// One MoE layer with its experts in one format.
pub struct MoeLayer {
    config: MoeConfig,
    kernels: KernelSet,
    experts: Box<dyn ExpertFormat>,
    loaded: bool,
    rowwise_down_max: usize,
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
            rowwise_down_max: forward::ROWWISE_DOWN_MAX,
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

    /// Forwards with at most `elems` (rows × hidden) down outputs use the row-wise down scheme
    /// (decode-sized); larger ones the column-block scheme. Both give the same result; this
    /// is a tuning knob (and lets tests cover both).
    pub fn set_rowwise_down_limit(&mut self, elems: usize) {
        self.rowwise_down_max = elems.min(forward::ROWWISE_DOWN_MAX);
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
}

/// Expert weights held as full tensors in memory: gate/up `[E][I][H]`, down `[E][H][I]`.
pub struct TensorSource {
    /// Base of the gate tensor.
    pub gate: *const u8,
    /// Base of the up tensor.
    pub up: *const u8,
    /// Base of the down tensor.
    pub down: *const u8,
    /// Element type of all three.
    pub dtype: FloatType,
    /// Experts in the tensors.
    pub experts: usize,
    /// H.
    pub hidden: usize,
    /// I.
    pub intermediate: usize,
}

// SAFETY: read-only views of memory the creator keeps alive.
unsafe impl Sync for TensorSource {}

impl ExpertSource for TensorSource {
    fn num_experts(&self) -> usize {
        self.experts
    }

    fn matrix(&self, expert: usize, proj: Proj) -> Result<MatrixView> {
        kt_ensure!(
            expert < self.experts,
            Invalid,
            "expert {expert} outside 0..{}",
            self.experts
        );
        let (base, rows, cols) = match proj {
            Proj::Gate => (self.gate, self.intermediate, self.hidden),
            Proj::Up => (self.up, self.intermediate, self.hidden),
            Proj::Down => (self.down, self.hidden, self.intermediate),
        };
        let size = rows * cols * self.dtype.size();
        Ok(MatrixView {
            // SAFETY: the creator promised [experts][rows][cols] elements at `base`.
            ptr: unsafe { base.add(expert * size) },
            dtype: self.dtype,
            rows,
            cols,
            row_stride: cols,
            block_scale: None,
        })
    }
}

#[cfg(test)]
mod tests;
