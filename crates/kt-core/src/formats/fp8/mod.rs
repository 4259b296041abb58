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
//! Inside a panel the codes sit in the order of the bf16 panels ([`crate::pack`]): per input
//! pair, 32 outputs × 2 inputs, so each 128-input block of a panel decodes ([`kernels`]) into
//! exactly the packed bf16 panel of a 128-input matrix, and the bf16 panel kernels (fp32 FMA,
//! `vdpbf16ps`, AMX tiles, chosen per expert as for method BF16) multiply it; the block's
//! scale then multiplies the block's 32 results per row. A panel call takes up to 32 rows, so
//! an expert's codes are decoded once per forward, not once per kernel row block.
//!
//! Loading from an FP8 checkpoint copies codes and scales; from bf16/fp16/fp32 tensors or
//! checkpoints it quantizes each 128 × 128 block to `amax / 448` (the usual FP8 block recipe).
use super::{bf16, locate, ExpertFormat, GpuRankDst, PanelAcc, PanelAt, RowBlock, RowShare, Stage};
use crate::codes::CodeKind;
use crate::dtype::FloatType;
use crate::expert::{MoeConfig, Proj};
use crate::kernels::{KernelSet, MAX_ROWS};
use crate::method::Method;
use crate::pack::{AlignedBuf, MatrixView, PANEL};
use crate::sync_ptr::SyncPtr;
use crate::{kt_bail, kt_ensure, Result};
use std::any::Any;
use std::ops::Range;

pub mod kernels;

use kernels::{Fp8Decoder, BLOCK};

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

/// The registry's builder for FP8 ([`super::build`]).
pub fn experts(
    config: &MoeConfig,
    parts: usize,
    kernels: KernelSet,
) -> Result<Box<dyn ExpertFormat>> {
    Ok(Box::new(Fp8Experts::new(
        config,
        parts,
        kernels,
        Scaling::Block,
    )?))
}

/// The registry's builder for FP8_PERCHANNEL.
pub fn experts_per_channel(
    config: &MoeConfig,
    parts: usize,
    kernels: KernelSet,
) -> Result<Box<dyn ExpertFormat>> {
    Ok(Box::new(Fp8Experts::new(
        config,
        parts,
        kernels,
        Scaling::PerChannel,
    )?))
}

/// How the codes of a projection are scaled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scaling {
    /// One f32 per 128 × 128 block (method FP8; `weight_scale_inv`).
    Block,
    /// One f32 per output row (method FP8_PERCHANNEL; `weight_scale`).
    PerChannel,
}

/// Values all 1: the block scales of a per-channel panel (its scales apply per row).
static ONES: [f32; 1024] = [1.0; 1024];

/// What an FP8 layer built with `kernels` reports as its kernel: the decoder, then the bf16
/// panel kernels it feeds ("fp8-avx512+avx512-fma+bf16dot").
pub fn kernel_name(kernels: &KernelSet) -> String {
    let decoder = kernels::decoder_for(kernels.level()).name;
    let vector = kernels.name();
    match kernels.amx_name() {
        Some(amx) => format!("fp8-{decoder}+{amx}+{vector}"),
        None => format!("fp8-{decoder}+{vector}"),
    }
}

/// Copy columns `cols` (even bounds) of a panel's 32 rows (`panel`: their codes in panel order)
/// into row-major memory: row j at `dst + j·stride`, column c at offset `c − cols.start`. Each
/// 64-byte line of the panel holds one input pair of every row ([`crate::lines`]).
///
/// # Safety
/// `dst` has 32 rows of `stride` bytes, each with room for `cols.len()` bytes, writable.
unsafe fn unpanel(panel: &[u8], cols: Range<usize>, dst: *mut u8, stride: usize) {
    debug_assert!(cols.start.is_multiple_of(2) && cols.end.is_multiple_of(2));
    let lines = &panel[cols.start * PANEL..cols.end * PANEL];
    // SAFETY: `lines` holds (cols.len() / 2) lines of 32 two-byte elements; the rows are the
    // caller's.
    unsafe { crate::lines::lines_to_rows(lines.as_ptr(), cols.len() / 2, 2, dst, stride) };
}

/// The FP8 experts of one layer.
pub struct Fp8Experts {
    scaling: Scaling,
    kernels: KernelSet,
    decoder: Fp8Decoder,
    fused: Option<kernels::Fused>,
    hidden: usize,
    experts: usize,
    ranges: Vec<Range<usize>>,
    parts: Vec<Part>,
}

impl Fp8Experts {
    /// Room for `config.num_experts` experts in `parts` parts (whole 128-row scale blocks each).
    pub fn new(
        config: &MoeConfig,
        parts: usize,
        kernels: KernelSet,
        scaling: Scaling,
    ) -> Result<Fp8Experts> {
        prefetch_distance()?;
        let method = match scaling {
            Scaling::Block => Method::Fp8,
            Scaling::PerChannel => Method::Fp8PerChannel,
        };
        crate::kt_ensure!(
            config.hidden <= ONES.len() * BLOCK && config.intermediate <= ONES.len() * BLOCK,
            Invalid,
            "{method} supports projections of at most {} inputs",
            ONES.len() * BLOCK
        );
        let ranges = super::split_in_units(config, parts, BLOCK, method)?;
        let (e, h) = (config.num_experts, config.hidden);
        let parts = ranges
            .iter()
            .map(|inter| {
                let ip = inter.len();
                let (gate_up_per, down_per) = match scaling {
                    Scaling::Block => ((h / BLOCK) * (ip / BLOCK), (h / BLOCK) * (ip / BLOCK)),
                    Scaling::PerChannel => (ip, h),
                };
                let mut gate_up = AlignedBuf::zeroed(e * 2 * ip * h)?;
                let mut down = AlignedBuf::zeroed(e * h * ip)?;
                let mut gate_up_scales = AlignedBuf::zeroed(e * 2 * gate_up_per)?;
                let mut down_scales = AlignedBuf::zeroed(e * down_per)?;
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
            scaling,
            decoder: kernels::decoder_for(kernels.level()),
            fused: kernels::fused_for(kernels.level()),
            kernels,
            hidden: h,
            experts: e,
            ranges,
            parts,
        })
    }

    /// Byte offset of the panel holding row `row` of `proj` of `slot` in its part buffer, and
    /// the index of the first scale of the row (block scaling: its row block's `k/128` scales;
    /// per-channel: its own).
    fn offsets(&self, part: usize, slot: usize, proj: Proj, row: usize) -> (usize, usize) {
        let (h, ip) = (self.hidden, self.ranges[part].len());
        let k = if proj == Proj::Down { ip } else { h };
        let (per_expert, scale_row) = match self.scaling {
            Scaling::Block => ((h / BLOCK) * (ip / BLOCK), (row / BLOCK) * (k / BLOCK)),
            Scaling::PerChannel => (if proj == Proj::Down { h } else { ip }, row),
        };
        let p = row / PANEL;
        match proj {
            Proj::Gate | Proj::Up => {
                let which = (proj == Proj::Up) as usize;
                let bytes = ((slot * ip / PANEL + p) * 2 + which) * PANEL * h;
                (bytes, (slot * 2 + which) * per_expert + scale_row)
            }
            Proj::Down => (
                (slot * h / PANEL + p) * PANEL * ip,
                slot * per_expert + scale_row,
            ),
        }
    }

    /// Position of `W[row][col]` inside its panel: the bf16 panel order ([`crate::pack`]).
    fn in_panel(row: usize, col: usize) -> usize {
        let (h, j) = ((row % PANEL) / 16, row % 16);
        (col / 2) * 64 + h * 32 + j * 2 + col % 2
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
        debug_assert!(n.is_multiple_of(PANEL) && k.is_multiple_of(2));
        for r in 0..n {
            let (at, scale_at) = self.offsets(part, slot, proj, r);
            // SAFETY: row r of the view holds k one-byte codes (the view is alive); the
            // destination panel belongs to this (part, slot, proj) alone (the caller's contract).
            let (src, out) = unsafe {
                (
                    std::slice::from_raw_parts(view.ptr.add(r * view.row_stride), k),
                    std::slice::from_raw_parts_mut(dst.get().add(at), PANEL * k),
                )
            };
            if crate::codes::any_e4m3_nan(src) {
                let c = src.iter().position(|&b| b & 0x7F == 0x7F).unwrap_or(0);
                kt_bail!(
                    Invalid,
                    "FP8 weight of expert slot {slot} {proj:?} holds a NaN code ({:#04x}) at \
                     row {r}, column {c} of this part",
                    src[c]
                );
            }
            if r % PANEL == PANEL - 1 {
                // The panel's rows are checked: its codes, transposed a byte pair at a time
                // (each line holds an input pair of every row, [`Self::in_panel`]).
                let first = r + 1 - PANEL;
                // SAFETY: rows first..=r of the live view, k codes each; the panel's k/2 lines.
                unsafe {
                    crate::lines::rows_to_lines(
                        view.ptr.add(first * view.row_stride),
                        view.row_stride,
                        k / 2,
                        2,
                        out.as_mut_ptr(),
                    )
                };
            }
            if self.scaling == Scaling::PerChannel {
                // SAFETY: (r, 0) is inside the view; its scales are alive.
                let s = unsafe { view.block_scale_at(r, 0) }.unwrap_or(1.0);
                kt_ensure!(
                    s.is_finite(),
                    Invalid,
                    "FP8 weight_scale of expert slot {slot} {proj:?} is {s} at row {r} of this part"
                );
                // SAFETY: row r's scale, this (part, slot, proj)'s alone.
                unsafe { *scale_dst.get().add(scale_at) = s };
            } else if r % BLOCK == 0 {
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
                    unsafe { *scale_dst.get().add(scale_at + b) = s };
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
        // Codes go row-major into a buffer first and into the panels a whole panel at a time,
        // as a file load copies them ([`crate::lines::rows_to_lines`]).
        let to_panel = |codes: &[u8], first_row: usize| {
            let (at, _) = self.offsets(part, slot, proj, first_row);
            // SAFETY: `codes` holds 32 rows of k codes; the panel of rows first_row.. (k/2
            // lines of 64 bytes) belongs to this (part, slot, proj) alone.
            unsafe { crate::lines::rows_to_lines(codes.as_ptr(), k, k / 2, 2, dst.get().add(at)) };
        };
        if self.scaling == Scaling::PerChannel {
            let mut row = vec![0f32; k];
            let mut codes = vec![0u8; PANEL * k];
            for r in 0..n {
                // SAFETY: row r < n of the live view; `row` has k values.
                unsafe { view.row_f32(r, &mut row) };
                let Some(amax) = crate::quant::finite_abs_max(&row) else {
                    kt_bail!(
                        Invalid,
                        "expert slot {slot} {proj:?} holds a non-finite weight in row {r}"
                    );
                };
                let scale = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
                let out = &mut codes[(r % PANEL) * k..][..k];
                crate::encode::encode_scaled(CodeKind::E4M3, &row, scale, out);
                let (_, scale_at) = self.offsets(part, slot, proj, r);
                // SAFETY: row r's scale, this (part, slot, proj)'s alone.
                unsafe { *scale_dst.get().add(scale_at) = scale };
                if r % PANEL == PANEL - 1 {
                    to_panel(&codes, r + 1 - PANEL);
                }
            }
            return Ok(());
        }
        let mut rows = vec![0f32; BLOCK * k];
        let mut codes = vec![0u8; BLOCK * k];
        for rb in 0..n / BLOCK {
            for (i, row) in rows.chunks_exact_mut(k).enumerate() {
                // SAFETY: row rb·128 + i < n of the live view; `row` has k values.
                unsafe { view.row_f32(rb * BLOCK + i, row) };
            }
            for b in 0..k / BLOCK {
                let cols = b * BLOCK..(b + 1) * BLOCK;
                let amax = rows
                    .chunks_exact(k)
                    .map(|row| crate::quant::finite_abs_max(&row[cols.clone()]))
                    .try_fold(0f32, |m, a| a.map(|a| m.max(a)));
                let Some(amax) = amax else {
                    kt_bail!(
                        Invalid,
                        "expert slot {slot} {proj:?} holds a non-finite weight in block ({rb}, {b})"
                    );
                };
                let scale = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
                for (row, out) in rows.chunks_exact(k).zip(codes.chunks_exact_mut(k)) {
                    let (values, out) = (&row[cols.clone()], &mut out[cols.clone()]);
                    crate::encode::encode_scaled(CodeKind::E4M3, values, scale, out);
                }
                let (_, scale_at) = self.offsets(part, slot, proj, rb * BLOCK);
                // SAFETY: the block's scale, this (part, slot, proj)'s alone.
                unsafe { *scale_dst.get().add(scale_at + b) = scale };
            }
            for (p, panel) in codes.chunks_exact(PANEL * k).enumerate() {
                to_panel(panel, rb * BLOCK + p * PANEL);
            }
        }
        Ok(())
    }

    /// The codes and scales of `slot`'s `proj` in `part` as a checkpoint holds them: `[n][k]`
    /// E4M3 bytes and `[n/128][k/128]` (block) or `[n]` (per-channel) scales (for tests and the
    /// GPU write path).
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
            codes.extend((0..k).map(|c| bytes[at + Self::in_panel(r, c)]));
            if self.scaling == Scaling::PerChannel {
                s.push(scales[scale_at]);
            } else if r % BLOCK == 0 {
                s.extend_from_slice(&scales[scale_at..scale_at + k / BLOCK]);
            }
        }
        (codes, s)
    }
}

impl Fp8Experts {
    /// The layer's intermediate size (all parts).
    fn intermediate(&self) -> usize {
        self.ranges.last().map_or(0, |r| r.end)
    }

    /// This format's activation staging (as method BF16's).
    fn staging(&self) -> bf16::Staging<'_> {
        bf16::Staging {
            kernels: &self.kernels,
            hidden: self.hidden,
            ranges: &self.ranges,
        }
    }

    /// [`Fp8Experts::panel`] with the panel's scales as stored from its first one on: the
    /// next `k/128` block scales, or 32 row scales applied to the results.
    ///
    /// # Safety
    /// As [`Fp8Experts::panel`].
    unsafe fn scaled_panel(
        &self,
        rows: &RowBlock,
        k: usize,
        codes: &[u8],
        scales: &[f32],
        out: &mut [f32],
    ) {
        match self.scaling {
            // SAFETY: forwarded.
            Scaling::Block => unsafe { self.panel(rows, k, codes, &scales[..k / BLOCK], out) },
            Scaling::PerChannel => {
                // SAFETY: forwarded.
                unsafe { self.panel(rows, k, codes, &ONES[..k / BLOCK], out) };
                apply_row_scales(rows.len(), &scales[..PANEL], out);
            }
        }
    }

    /// [`Fp8Experts::scaled_panel`] for two panels of `k` inputs at once through the fused
    /// pair kernel ([`kernels::FusedPairFn`]), where it applies: few rows, no bf16 path, results
    /// finite. Returns false, with `outs` garbage, where it does not (the caller then runs each
    /// panel on its own).
    ///
    /// # Safety
    /// As [`Fp8Experts::scaled_panel`] for each panel.
    unsafe fn scaled_panel_pair(
        &self,
        rows: &RowBlock,
        k: usize,
        codes: [&[u8]; 2],
        scales: [&[f32]; 2],
        outs: [&mut [f32]; 2],
    ) -> bool {
        let n = rows.len();
        let Some((pair, max_rows)) = self.fused.and_then(|f| f.pair) else {
            return false;
        };
        if n == 0 || n > max_rows || bf16::path_for(&self.kernels, rows.expert_rows, k).is_some() {
            return false;
        }
        let block_scales = |s: &[f32]| match self.scaling {
            Scaling::Block => s.as_ptr(),
            Scaling::PerChannel => ONES.as_ptr(),
        };
        let scale_count = match self.scaling {
            Scaling::Block => k / BLOCK,
            Scaling::PerChannel => PANEL,
        };
        for p in 0..2 {
            assert!(codes[p].len() == PANEL * k && scales[p].len() >= scale_count);
            assert!(outs[p].len() >= n * PANEL);
        }
        assert!(rows.f32_rows.len() == n && k / BLOCK <= ONES.len());
        let [g, u] = outs;
        // SAFETY: n rows of k floats, 32·k codes and k/128 scales per panel (checked above),
        // 32 outputs per row per panel; the kernel's ISA was checked when it was chosen.
        unsafe {
            pair(
                rows.f32_rows,
                false,
                k,
                [codes[0].as_ptr(), codes[1].as_ptr()],
                [block_scales(scales[0]), block_scales(scales[1])],
                [g.as_mut_ptr(), u.as_mut_ptr()],
            )
        };
        // As in `panel`: a non-finite result goes to the unscaled general path.
        if !crate::quant::all_finite(&g[..n * PANEL]) || !crate::quant::all_finite(&u[..n * PANEL])
        {
            return false;
        }
        if self.scaling == Scaling::PerChannel {
            apply_row_scales(n, &scales[0][..PANEL], g);
            apply_row_scales(n, &scales[1][..PANEL], u);
        }
        true
    }

    /// Down panels `at.panel` (into `o`) and `at.panel + 1` (into `o_next`) through the pair
    /// kernel ([`Fp8Experts::scaled_panel_pair`]); false, the outputs garbage, where it does
    /// not apply.
    ///
    /// # Safety
    /// [`ExpertFormat::down_panel`]'s contract for both panels, which exist.
    unsafe fn down_panel_pair(
        &self,
        at: PanelAt,
        rows: &RowBlock,
        o: &mut [f32],
        o_next: &mut [f32],
    ) -> bool {
        let PanelAt { part, slot, panel } = at;
        let ip = self.ranges[part].len();
        let p = &self.parts[part];
        let panel_of = |panel: usize| {
            let (at, scale_at) = self.offsets(part, slot, Proj::Down, panel * PANEL);
            (
                &p.down.as_slice()[at..at + PANEL * ip],
                &p.down_scales.as_slice()[scale_at..],
            )
        };
        let ((first, first_scales), (next, next_scales)) = (panel_of(panel), panel_of(panel + 1));
        // SAFETY: the contract above, forwarded for rows of ip SwiGLU values.
        unsafe {
            self.scaled_panel_pair(
                rows,
                ip,
                [first, next],
                [first_scales, next_scales],
                [o, o_next],
            )
        }
    }

    /// `out` (32 per row) = one panel's codes (`32·k` bytes in panel order) with their `k/128`
    /// block scales against `rows`: per 128-input block, decode to a bf16 panel once, run the
    /// bf16 panel kernel the expert's row count picks over every row, add `scale · result`.
    ///
    /// # Safety
    /// The [`ExpertFormat::gate_up_panel`] contract for rows of `k` values (staged bf16 rows
    /// present whenever [`bf16::path_for`] picks a bf16 path for this expert).
    unsafe fn panel(
        &self,
        rows: &RowBlock,
        k: usize,
        codes: &[u8],
        scales: &[f32],
        out: &mut [f32],
    ) {
        /// One decoded 128-input block of a panel, aligned for the kernels' loads.
        #[repr(align(64))]
        struct Decoded([u16; PANEL * BLOCK]);
        let n = rows.len();
        assert!(codes.len() == PANEL * k && scales.len() == k / BLOCK);
        assert!(n <= MAX_ROWS && rows.prepared.len() == n && out.len() >= n * PANEL);
        let path = bf16::path_for(&self.kernels, rows.expert_rows, k);
        if let (None, Some(fused)) = (path, self.fused) {
            if n <= fused.rows {
                let (c, s, o) = (codes.as_ptr(), scales.as_ptr(), out.as_mut_ptr());
                let run = |a: &[*const f32], scaled: bool| {
                    // SAFETY: n rows of k floats (the scaled ones: the packing below), 32·k
                    // codes, k/128 scales, 32 outputs per row.
                    unsafe { (fused.run)(a, scaled, k, c, s, o) }
                };
                // From three rows the rows times 2⁶⁴ once for every panel of the phase, not
                // per block of every panel.
                if n >= 3 {
                    super::with_rows_up64(rows, k, run);
                } else {
                    run(rows.f32_rows, false);
                }
                // The fused kernels scale activations by 2⁶⁴ and block scales by 2⁵⁶, which
                // overflows for values no model has (about 1e19) though the result is finite:
                // then the general path below, in unscaled arithmetic, redoes the panel (its
                // first block assigns `out`).
                if crate::quant::all_finite(&out[..n * PANEL]) {
                    return;
                }
            }
        }
        if let Some(path) = path {
            // Decode the whole panel and multiply once over all k: the tiles' per-call cost is
            // paid once, and the rows' packing serves the next panels. Per-channel panels have
            // unit block scales (the row scales apply to the outputs afterwards); a block
            // scale is folded into its decoded values, each product rounded to bf16 (at most
            // 2⁻⁸ relative, as the bf16 activations; AMX, 512-token S1 layer: FP8 107 -> 71 ms).
            let decode = |b: usize, dst: &mut [u16]| {
                let block = &codes[b * PANEL * BLOCK..(b + 1) * PANEL * BLOCK];
                assert!(dst.len() >= block.len());
                let (n, scale) = (block.len(), scales[b]);
                // SAFETY: 32·128 codes in, as many values out; as below.
                unsafe {
                    match (self.scaling, self.decoder.decode_scaled) {
                        (Scaling::PerChannel, _) => {
                            (self.decoder.decode)(block.as_ptr(), n, dst.as_mut_ptr())
                        }
                        (Scaling::Block, Some(scaled)) => {
                            scaled(block.as_ptr(), n, scale, dst.as_mut_ptr())
                        }
                        (Scaling::Block, None) => {
                            (self.decoder.decode)(block.as_ptr(), n, dst.as_mut_ptr());
                            bf16::scale_bf16(&self.kernels, &mut dst[..n], scale);
                        }
                    }
                }
            };
            // SAFETY: the caller's contract; `path` reads the staged rows.
            unsafe {
                bf16::multiply_decoded_panel(
                    &self.kernels,
                    path,
                    rows,
                    k,
                    BLOCK,
                    codes,
                    decode,
                    out,
                )
            };
            return;
        }
        let mut decoded = Decoded([0; PANEL * BLOCK]);
        for (b, &scale) in scales.iter().enumerate() {
            let block = &codes[b * PANEL * BLOCK..(b + 1) * PANEL * BLOCK];
            // SAFETY: 32·128 codes in, as many values out; the decoder's ISA was checked when
            // the KernelSet was built; NaN codes were refused at load.
            unsafe { (self.decoder.decode)(block.as_ptr(), block.len(), decoded.0.as_mut_ptr()) };
            // SAFETY: the caller's contract, block b of k inputs.
            unsafe {
                bf16::add_decoded_block(
                    &self.kernels,
                    path,
                    rows,
                    BLOCK,
                    b,
                    &decoded.0,
                    scale,
                    out,
                    None,
                    0,
                )
            };
        }
    }
}

/// Multiply each of the `n` rows of `out` (32 per row) by the panel's 32 row scales.
fn apply_row_scales(n: usize, row_scales: &[f32], out: &mut [f32]) {
    for row in out[..n * PANEL].chunks_exact_mut(PANEL) {
        for (o, s) in row.iter_mut().zip(row_scales) {
            *o *= s;
        }
    }
}

impl ExpertFormat for Fp8Experts {
    fn method(&self) -> Method {
        match self.scaling {
            Scaling::Block => Method::Fp8,
            Scaling::PerChannel => Method::Fp8PerChannel,
        }
    }

    fn kernel_name(&self) -> String {
        kernel_name(&self.kernels)
    }

    fn part_ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    bf16::staged_activations!();

    fn block_rows(&self, _part: usize, _expert_rows: usize, _stage: Stage) -> usize {
        // Every row of a block shares each decoded 128-input block (see `panel`).
        MAX_ROWS
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
        let p = &self.parts[part];
        let panel_of = |proj: Proj| {
            let (at, scale_at) = self.offsets(part, slot, proj, panel * PANEL);
            (
                &p.gate_up.as_slice()[at..at + PANEL * h],
                &p.gate_up_scales.as_slice()[scale_at..],
            )
        };
        let ((gate, gate_scales), (up, up_scales)) = (panel_of(Proj::Gate), panel_of(Proj::Up));
        // A decode's few rows stream the gate and up panels together (twice the FMA chains).
        // SAFETY: the trait's contract, forwarded for rows of H values.
        if unsafe { self.scaled_panel_pair(rows, h, [gate, up], [gate_scales, up_scales], [g, u]) }
        {
            return;
        }
        for (codes, scales, out) in [(gate, gate_scales, g), (up, up_scales, u)] {
            // SAFETY: the trait's contract, forwarded for rows of H values.
            unsafe { self.scaled_panel(rows, h, codes, scales, out) };
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
        let p = &self.parts[part];
        let (at, scale_at) = self.offsets(part, slot, Proj::Down, panel * PANEL);
        let codes = &p.down.as_slice()[at..at + PANEL * ip];
        // SAFETY: the trait's contract, forwarded for rows of ip SwiGLU values.
        unsafe { self.scaled_panel(rows, ip, codes, &p.down_scales.as_slice()[scale_at..], o) };
    }

    unsafe fn down_run(
        &self,
        at: PanelAt,
        n: usize,
        rows: &RowBlock,
        scratch: &mut PanelAcc,
        o: &mut [f32],
    ) {
        // Two panels at a time through the pair kernel where it applies (a decode's few rows:
        // twice the independent FMA chains), else one.
        let m = rows.len() * PANEL;
        let mut i = 0;
        while i < n {
            let at = at.after(i);
            if i + 1 < n {
                let (first, next) = o[i * m..(i + 2) * m].split_at_mut(m);
                // SAFETY: the trait's contract for panels i and i + 1 of the run.
                if unsafe { self.down_panel_pair(at, rows, first, next) } {
                    i += 2;
                    continue;
                }
            }
            // SAFETY: the trait's contract for panel i of the run.
            unsafe { self.down_panel(at, rows, scratch, &mut o[i * m..(i + 1) * m]) };
            i += 1;
        }
    }

    fn packs_from_source(&self) -> bool {
        true
    }

    fn gpu_rank_bytes(&self, gpu_tp: usize) -> Result<[usize; 4]> {
        let (h, i) = (self.hidden, self.intermediate());
        let unit = match self.scaling {
            Scaling::Block => BLOCK,
            Scaling::PerChannel => PANEL,
        };
        kt_ensure!(
            gpu_tp >= 1 && i.is_multiple_of(gpu_tp) && (i / gpu_tp).is_multiple_of(unit),
            Invalid,
            "{}: moe_intermediate_size {i} does not split into {gpu_tp} GPU ranks of whole \
             {unit}-row scale blocks",
            self.method()
        );
        let ir = i / gpu_tp;
        Ok(match self.scaling {
            Scaling::Block => [
                2 * ir * h,
                2 * (ir / BLOCK) * (h / BLOCK) * 4,
                h * ir,
                (h / BLOCK) * (ir / BLOCK) * 4,
            ],
            Scaling::PerChannel => [2 * ir * h, 2 * ir * 4, h * ir, h * 4],
        })
    }

    unsafe fn write_gpu_rank(
        &self,
        slot: usize,
        gpu_tp: usize,
        rank: usize,
        share: RowShare,
        dst: &GpuRankDst,
    ) -> Result<()> {
        let (h, ir) = (self.hidden, self.intermediate() / gpu_tp);
        let r0 = rank * ir;
        let put_scale = |base: *mut u8, index: usize, v: f32| {
            // SAFETY: the caller's contract: index < the buffer's scales (gpu_rank_bytes).
            unsafe { (base as *mut f32).add(index).write_unaligned(v) };
        };
        // w13: the rank's gate rows then its up rows, row-major codes; their scales likewise.
        for (which, proj) in [(0, Proj::Gate), (1, Proj::Up)] {
            for row in (0..ir).filter(|r| share.has(which * ir + r)) {
                let (part, local) = locate(&self.ranges, r0 + row);
                let (at, scale_at) = self.offsets(part, slot, proj, local);
                let (codes, scales) = (
                    self.parts[part].gate_up.as_slice(),
                    self.parts[part].gate_up_scales.as_slice(),
                );
                if row % PANEL == 0 {
                    // SAFETY: rows which·ir + row .. +32 of the w13 buffer (2·ir·h bytes, the
                    // contract; ir is a multiple of 32, checked by gpu_rank_bytes).
                    unsafe {
                        unpanel(
                            &codes[at..at + PANEL * h],
                            0..h,
                            dst.w13.add((which * ir + row) * h),
                            h,
                        )
                    };
                }
                match self.scaling {
                    Scaling::Block if row % BLOCK == 0 => {
                        let first = (which * ir / BLOCK + row / BLOCK) * (h / BLOCK);
                        for b in 0..h / BLOCK {
                            put_scale(dst.w13_scale, first + b, scales[scale_at + b]);
                        }
                    }
                    Scaling::Block => {}
                    Scaling::PerChannel => {
                        put_scale(dst.w13_scale, which * ir + row, scales[scale_at])
                    }
                }
            }
        }
        // w2: every output row over the rank's columns, row-major; block scales per 128 × 128,
        // per-channel scales per output row (one value per row across the rank's columns).
        let mut row_scales: Vec<Option<f32>> = vec![None; h];
        for (part, range) in self.ranges.iter().enumerate() {
            // The rank's columns this part holds, as local columns and an offset in the rank.
            let (g0, g1) = (range.start.max(r0), range.end.min(r0 + ir));
            if g0 >= g1 {
                continue;
            }
            let (l0, l1, c0) = (g0 - range.start, g1 - range.start, g0 - r0);
            let (codes, scales) = (
                self.parts[part].down.as_slice(),
                self.parts[part].down_scales.as_slice(),
            );
            for (hrow, row_scale) in row_scales.iter_mut().enumerate() {
                if !share.has(hrow) {
                    continue;
                }
                let (at, scale_at) = self.offsets(part, slot, Proj::Down, hrow);
                if hrow % PANEL == 0 {
                    let ip = range.len();
                    // SAFETY: columns c0 .. c0 + l1 − l0 of rows hrow .. +32 of the w2 buffer
                    // (h·ir bytes, the contract); l0 and l1 are even (ir is a multiple of 32).
                    unsafe {
                        unpanel(
                            &codes[at..at + PANEL * ip],
                            l0..l1,
                            dst.w2.add(hrow * ir + c0),
                            ir,
                        )
                    };
                }
                match self.scaling {
                    Scaling::Block if hrow % BLOCK == 0 => {
                        for lc in (l0..l1).step_by(BLOCK) {
                            let index = (hrow / BLOCK) * (ir / BLOCK) + (c0 + lc - l0) / BLOCK;
                            put_scale(dst.w2_scale, index, scales[scale_at + lc / BLOCK]);
                        }
                    }
                    Scaling::Block => {}
                    Scaling::PerChannel => {
                        let s = scales[scale_at];
                        kt_ensure!(
                            row_scale.is_none_or(|r| r == s),
                            Invalid,
                            "FP8_PERCHANNEL down row {hrow} of expert slot {slot} has different \
                             scales in the NUMA parts that GPU rank {rank} spans (weights \
                             quantized per part); load them from a per-channel checkpoint"
                        );
                        *row_scale = Some(s);
                    }
                }
            }
        }
        for (hrow, s) in row_scales.iter().enumerate() {
            if let Some(s) = s {
                put_scale(dst.w2_scale, hrow, *s);
            }
        }
        Ok(())
    }

    unsafe fn pack(&self, part: usize, slot: usize, proj: Proj, view: &MatrixView) -> Result<()> {
        let (h, ip) = (self.hidden, self.ranges[part].len());
        let (n, k) = match proj {
            Proj::Gate | Proj::Up => (ip, h),
            Proj::Down => (h, ip),
        };
        assert!(slot < self.experts && view.rows == n && view.cols == k);
        match (view.dtype, view.block_scale, self.scaling) {
            (FloatType::F8E4M3, Some(b), Scaling::Block)
                if b.block_rows == BLOCK && b.block_cols == BLOCK =>
            {
                kt_ensure!(
                    b.row0 % BLOCK == 0 && b.col0 % BLOCK == 0,
                    Invalid,
                    "FP8 scale blocks must align with this layer's split; this part starts at \
                     ({}, {})",
                    b.row0,
                    b.col0
                );
                // SAFETY: forwarded (the view is E4M3 with aligned 128-blocks, checked).
                unsafe { self.copy_codes(part, slot, proj, view) }
            }
            (FloatType::F8E4M3, Some(b), Scaling::PerChannel)
                if b.block_rows == 1 && b.cols == 1 =>
            {
                // SAFETY: forwarded (the view is E4M3 with one scale per row).
                unsafe { self.copy_codes(part, slot, proj, view) }
            }
            // Plain floats, or codes scaled the other way: quantize the values they stand for.
            // SAFETY: forwarded.
            _ => unsafe { self.quantize(part, slot, proj, view) },
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The prefetch distance of FP8's decode kernels, measured once per process (or
/// `KT_KERNEL_PREFETCH`); see [`crate::kernels::prefetch`].
pub fn prefetch_distance() -> Result<usize> {
    crate::kernels::calibrate::ensure_prefetch_chosen(
        crate::kernels::prefetch::Family::Fp8Codes,
        kernels::calibration_workload,
    )
}
