//! Method FP8: block-quantized E4M3FN weights with one f32 scale per 128 × 128 block, as in
//! DeepSeek-V3/R1 and Qwen3 FP8 checkpoints (`weight` float8_e4m3fn, `weight_scale_inv` f32
//! `[N/128][K/128]`, value = code · scale). The codes stay one byte each in memory.
//!
//! Memory of one part (intermediate slice of `ip` rows, a multiple of 128):
//! - `gate_up`: per expert, per 32-row panel `p` of the slice, the panel's 32 gate rows then
//!   its 32 up rows (`H` bytes each), so a gate/up task streams one contiguous run;
//!   `gate_up_scales`: per expert, gate's `[ip/128][H/128]` block scales then up's;
//! - `down`: per expert, its `H` rows cut to the part's `ip` columns; `down_scales`: per expert
//!   `[H/128][ip/128]`.
//!
//! Stored scales are the checkpoint's times [`kernels::SCALE_FOLD`] (see [`kernels`]). Loading
//! from an FP8 checkpoint copies codes and scales; from bf16/fp16/fp32 tensors or checkpoints
//! it quantizes each 128 × 128 block to `amax / 448` (the usual FP8 block recipe).
use super::{ExpertFormat, PanelAcc, PanelAt, RowBlock, Stage};
use crate::dtype::{f32_to_e4m3, FloatType};
use crate::expert::{MoeConfig, Proj};
use crate::kernels::KernelSet;
use crate::method::Method;
use crate::pack::{AlignedBuf, MatrixView, PANEL};
use crate::sync_ptr::SyncPtr;
use crate::{kt_bail, kt_ensure, Result};
use std::any::Any;
use std::ops::Range;

pub mod kernels;

use kernels::{Fp8Kernel, BLOCK, SCALE_FOLD};

/// Largest finite E4M3FN magnitude.
const E4M3_MAX: f32 = 448.0;

/// One part's codes and scales (layout in the module docs), with write addresses for `pack`.
struct Part {
    gate_up: AlignedBuf<u8>,
    down: AlignedBuf<u8>,
    gate_up_scales: AlignedBuf<f32>,
    down_scales: AlignedBuf<f32>,
    dst: [SyncPtr<u8>; 2],
    scale_dst: [SyncPtr<f32>; 2],
}

/// The registry's builder ([`super::build`]).
pub fn experts(
    config: &MoeConfig,
    parts: usize,
    kernels: KernelSet,
) -> Result<Box<dyn ExpertFormat>> {
    Ok(Box::new(Fp8Experts::new(config, parts, &kernels)?))
}

/// The FP8 experts of one layer.
pub struct Fp8Experts {
    kernel: Fp8Kernel,
    hidden: usize,
    experts: usize,
    ranges: Vec<Range<usize>>,
    parts: Vec<Part>,
}

impl Fp8Experts {
    /// Room for `config.num_experts` experts in `parts` parts (whole 128-row scale blocks each).
    pub fn new(config: &MoeConfig, parts: usize, kernels: &KernelSet) -> Result<Fp8Experts> {
        let ranges = super::split_in_units(config, parts, BLOCK, Method::Fp8)?;
        let (e, h) = (config.num_experts, config.hidden);
        let parts = ranges
            .iter()
            .map(|inter| {
                let ip = inter.len();
                let blocks = (h / BLOCK) * (ip / BLOCK);
                let mut gate_up = AlignedBuf::zeroed(e * 2 * ip * h)?;
                let mut down = AlignedBuf::zeroed(e * h * ip)?;
                let mut gate_up_scales = AlignedBuf::zeroed(e * 2 * blocks)?;
                let mut down_scales = AlignedBuf::zeroed(e * blocks)?;
                Ok(Part {
                    dst: [
                        SyncPtr::new(gate_up.as_mut_ptr()),
                        SyncPtr::new(down.as_mut_ptr()),
                    ],
                    scale_dst: [
                        SyncPtr::new(gate_up_scales.as_mut_ptr()),
                        SyncPtr::new(down_scales.as_mut_ptr()),
                    ],
                    gate_up,
                    down,
                    gate_up_scales,
                    down_scales,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Fp8Experts {
            kernel: kernels::kernel_for(kernels.level()),
            hidden: h,
            experts: e,
            ranges,
            parts,
        })
    }

    /// Byte offset of row `row` of `proj` of `slot` in its part buffer, and the offset of the
    /// scale row (k/128 scales) that covers it.
    fn offsets(&self, part: usize, slot: usize, proj: Proj, row: usize) -> (usize, usize) {
        let (h, ip) = (self.hidden, self.ranges[part].len());
        let blocks = (h / BLOCK) * (ip / BLOCK);
        match proj {
            Proj::Gate | Proj::Up => {
                let which = (proj == Proj::Up) as usize;
                let (p, i) = (row / PANEL, row % PANEL);
                let bytes = ((slot * ip / PANEL + p) * 2 + which) * PANEL * h + i * h;
                let scales = (slot * 2 + which) * blocks + (row / BLOCK) * (h / BLOCK);
                (bytes, scales)
            }
            Proj::Down => (
                (slot * h + row) * ip,
                slot * blocks + (row / BLOCK) * (ip / BLOCK),
            ),
        }
    }

    /// Copy an FP8 view's codes and block scales, refusing NaN codes.
    ///
    /// # Safety
    /// As [`ExpertFormat::pack`]; `view` is E4M3 with 128-aligned block scales.
    unsafe fn copy_codes(
        &self,
        part: usize,
        slot: usize,
        proj: Proj,
        view: &MatrixView,
    ) -> Result<()> {
        let (n, k) = (view.rows, view.cols);
        let idx = (proj == Proj::Down) as usize;
        let (dst, scale_dst) = (self.parts[part].dst[idx], self.parts[part].scale_dst[idx]);
        for r in 0..n {
            let (at, scale_at) = self.offsets(part, slot, proj, r);
            // SAFETY: row r of the view holds k one-byte codes (the view is alive); the
            // destination row belongs to this (part, slot, proj) alone (the caller's contract).
            let (src, out) = unsafe {
                (
                    std::slice::from_raw_parts(view.ptr.add(r * view.row_stride), k),
                    std::slice::from_raw_parts_mut(dst.get().add(at), k),
                )
            };
            if let Some(c) = src.iter().position(|&b| b & 0x7F == 0x7F) {
                kt_bail!(
                    Invalid,
                    "FP8 weight of expert slot {slot} {proj:?} holds a NaN code ({:#04x}) at \
                     row {r}, column {c} of this part",
                    src[c]
                );
            }
            out.copy_from_slice(src);
            if r % BLOCK == 0 {
                for b in 0..k / BLOCK {
                    // SAFETY: (r, 128·b) is inside the view; its scales are alive.
                    let s = unsafe { view.block_scale_at(r, b * BLOCK) }.unwrap_or(1.0);
                    kt_ensure!(
                        s.is_finite(),
                        Invalid,
                        "FP8 weight_scale_inv of expert slot {slot} {proj:?} is {s} at block \
                         ({}, {b}) of this part",
                        r / BLOCK
                    );
                    // SAFETY: scale row of this row block, this (part, slot, proj)'s alone.
                    unsafe { *scale_dst.get().add(scale_at + b) = s * SCALE_FOLD };
                }
            }
        }
        Ok(())
    }

    /// Quantize a float view to E4M3 codes with one `amax / 448` scale per 128 × 128 block.
    ///
    /// # Safety
    /// As [`ExpertFormat::pack`].
    unsafe fn quantize(
        &self,
        part: usize,
        slot: usize,
        proj: Proj,
        view: &MatrixView,
    ) -> Result<()> {
        let (n, k) = (view.rows, view.cols);
        let idx = (proj == Proj::Down) as usize;
        let (dst, scale_dst) = (self.parts[part].dst[idx], self.parts[part].scale_dst[idx]);
        let mut rows = vec![0f32; BLOCK * k];
        for rb in 0..n / BLOCK {
            for (i, row) in rows.chunks_exact_mut(k).enumerate() {
                // SAFETY: row rb·128 + i < n of the live view; `row` has k values.
                unsafe { view.row_f32(rb * BLOCK + i, row) };
            }
            for b in 0..k / BLOCK {
                let cols = b * BLOCK..(b + 1) * BLOCK;
                let amax = rows
                    .chunks_exact(k)
                    .flat_map(|row| &row[cols.clone()])
                    .fold(0f32, |m, v| m.max(v.abs()));
                kt_ensure!(
                    amax.is_finite(),
                    Invalid,
                    "expert slot {slot} {proj:?} holds a non-finite weight in block ({rb}, {b})"
                );
                let scale = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
                for (i, row) in rows.chunks_exact(k).enumerate() {
                    let (at, _) = self.offsets(part, slot, proj, rb * BLOCK + i);
                    for c in cols.clone() {
                        // SAFETY: byte c of a destination row of this (part, slot, proj).
                        unsafe { *dst.get().add(at + c) = f32_to_e4m3(row[c] / scale) };
                    }
                }
                let (_, scale_at) = self.offsets(part, slot, proj, rb * BLOCK);
                // SAFETY: the block's scale, this (part, slot, proj)'s alone.
                unsafe { *scale_dst.get().add(scale_at + b) = scale * SCALE_FOLD };
            }
        }
        Ok(())
    }

    /// The codes and scales of `slot`'s `proj` in `part` as a checkpoint holds them: `[n][k]`
    /// E4M3 bytes and `[n/128][k/128]` scales (for tests and the GPU write path).
    pub fn expert_codes(&self, part: usize, slot: usize, proj: Proj) -> (Vec<u8>, Vec<f32>) {
        let (h, ip) = (self.hidden, self.ranges[part].len());
        let (n, k) = match proj {
            Proj::Gate | Proj::Up => (ip, h),
            Proj::Down => (h, ip),
        };
        let p = &self.parts[part];
        let (bytes, scales) = match proj {
            Proj::Down => (p.down.as_slice(), p.down_scales.as_slice()),
            _ => (p.gate_up.as_slice(), p.gate_up_scales.as_slice()),
        };
        let mut codes = Vec::with_capacity(n * k);
        let mut s = Vec::with_capacity((n / BLOCK) * (k / BLOCK));
        for r in 0..n {
            let (at, scale_at) = self.offsets(part, slot, proj, r);
            codes.extend_from_slice(&bytes[at..at + k]);
            if r % BLOCK == 0 {
                s.extend(
                    scales[scale_at..scale_at + k / BLOCK]
                        .iter()
                        .map(|v| v / SCALE_FOLD),
                );
            }
        }
        (codes, s)
    }
}

impl ExpertFormat for Fp8Experts {
    fn method(&self) -> Method {
        Method::Fp8
    }

    fn kernel_name(&self) -> String {
        format!("fp8-{}", self.kernel.name)
    }

    fn part_ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    fn x_stride(&self, _part: usize) -> usize {
        0
    }

    fn act_stride(&self, _part: usize) -> usize {
        0
    }

    fn prepares_x(&self, _max_rows: usize) -> bool {
        false
    }

    fn prepares_act(&self, _max_rows: usize) -> bool {
        false
    }

    fn prepare_x(&self, _part: usize, _x: &[f32], _out: &mut [u8]) -> f32 {
        1.0
    }

    fn prepare_act(&self, _part: usize, _act: &[f32], _out: &mut [u8]) -> f32 {
        1.0
    }

    fn block_rows(&self, _part: usize, _expert_rows: usize, _stage: Stage) -> usize {
        self.kernel.rows
    }

    unsafe fn gate_up_panel(
        &self,
        at: PanelAt,
        rows: &RowBlock,
        _scratch: &mut PanelAcc,
        g: &mut [f32],
        u: &mut [f32],
    ) {
        let PanelAt { part, slot, panel } = at;
        let h = self.hidden;
        assert!(rows.len() <= self.kernel.rows && g.len().min(u.len()) >= rows.len() * PANEL);
        let p = &self.parts[part];
        for (proj, out) in [(Proj::Gate, g), (Proj::Up, u)] {
            let (at, scale_at) = self.offsets(part, slot, proj, panel * PANEL);
            let w = &p.gate_up.as_slice()[at..at + PANEL * h];
            let s = &p.gate_up_scales.as_slice()[scale_at..scale_at + h / BLOCK];
            // SAFETY: 32 rows of H codes and their H/128 scales (sliced above); the rows
            // are fp32 rows of H values (the trait's contract); `out` has 32 per row.
            unsafe {
                (self.kernel.dot)(rows.f32_rows, h, w.as_ptr(), s.as_ptr(), out.as_mut_ptr())
            };
        }
    }

    unsafe fn down_panel(
        &self,
        at: PanelAt,
        rows: &RowBlock,
        _scratch: &mut PanelAcc,
        o: &mut [f32],
    ) {
        let PanelAt { part, slot, panel } = at;
        let ip = self.ranges[part].len();
        assert!(rows.len() <= self.kernel.rows && o.len() >= rows.len() * PANEL);
        let p = &self.parts[part];
        let (at, scale_at) = self.offsets(part, slot, Proj::Down, panel * PANEL);
        let w = &p.down.as_slice()[at..at + PANEL * ip];
        let s = &p.down_scales.as_slice()[scale_at..scale_at + ip / BLOCK];
        // SAFETY: as in gate_up_panel, for rows of ip SwiGLU values.
        unsafe { (self.kernel.dot)(rows.f32_rows, ip, w.as_ptr(), s.as_ptr(), o.as_mut_ptr()) };
    }

    fn packs_from_source(&self) -> bool {
        true
    }

    unsafe fn pack(&self, part: usize, slot: usize, proj: Proj, view: &MatrixView) -> Result<()> {
        let (h, ip) = (self.hidden, self.ranges[part].len());
        let (n, k) = match proj {
            Proj::Gate | Proj::Up => (ip, h),
            Proj::Down => (h, ip),
        };
        assert!(slot < self.experts && view.rows == n && view.cols == k);
        match (view.dtype, view.block_scale) {
            (FloatType::F8E4M3, Some(b)) => {
                kt_ensure!(
                    b.block == BLOCK && b.row0 % BLOCK == 0 && b.col0 % BLOCK == 0,
                    Invalid,
                    "FP8 weights need {BLOCK}x{BLOCK} scale blocks aligned with this layer's \
                     split; got blocks of {} at ({}, {})",
                    b.block,
                    b.row0,
                    b.col0
                );
                // SAFETY: forwarded (the view is E4M3 with aligned 128-blocks, checked).
                unsafe { self.copy_codes(part, slot, proj, view) }
            }
            // Codes without scales (or scaled otherwise) and plain floats: quantize the values.
            // SAFETY: forwarded.
            _ => unsafe { self.quantize(part, slot, proj, view) },
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
