//! The vocabulary of an MoE layer's experts, shared by the layer ([`crate::moe`]), the weight
//! formats ([`crate::formats`]) and the weight readers: the layer's shape ([`MoeConfig`]), the
//! three projections ([`Proj`]) and where expert matrices come from at load ([`ExpertSource`],
//! [`TensorSource`]).
use crate::dtype::FloatType;
use crate::pack::{MatrixView, PANEL};
use crate::{kt_bail, kt_ensure, Result};
use std::ops::Range;

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
            coded: None,
        })
    }
}
