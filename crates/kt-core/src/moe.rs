//! The MoE layer: route → gate/up (+SwiGLU) → down (+router weight) → sum over experts → merge
//! the NUMA parts.
//!
//! Every expert is split along the intermediate dimension into one slice per sub-pool ("part");
//! a part holds rows `r0..r1` of gate and up and the matching columns of down, computes a full
//! width fp32 partial output, and the partials are summed. Weights are packed once at load by
//! the part's own threads (so their pages live on its node); activations stay fp32 throughout.
use crate::dtype::{row_from_f32, row_to_f32, FloatType};
use crate::kernels::{Bf16Path, KernelSet, MAX_ROWS};
use crate::pack::{pack_panel, panel_len, AlignedBuf, MatrixView, PANEL};
use crate::pool::{Pool, Team};
use crate::routing::{Ids, Routing};
use crate::{kt_bail, kt_ensure, Error, Result};
use std::ops::Range;
use std::sync::Mutex;

/// Tokens processed per internal chunk: bounds the scratch memory whatever
/// `chunked_prefill_size` is, while keeping enough rows per expert for the blocked GEMM.
pub const CHUNK_TOKENS: usize = 1024;

/// Forwards with at most this many (row × hidden) down outputs use the row-wise down scheme.
const ROWWISE_DOWN_MAX: usize = 1 << 20;

/// Down panels per task in the row-wise scheme (a contiguous run of one expert's matrix).
const DOWN_GROUP_PANELS: usize = 4;

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
    fn check_blocks(&self, parts: usize, unit: usize) -> Result<()> {
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

/// Where expert weights come from at load time (tensors in memory, a checkpoint...).
pub trait ExpertSource: Sync {
    /// Number of (logical) experts available.
    fn num_experts(&self) -> usize;
    /// Full matrix of one projection of logical expert `expert`: gate/up `[I][H]`, down `[H][I]`.
    /// The view must stay valid while the source lives.
    fn matrix(&self, expert: usize, proj: Proj) -> Result<MatrixView>;
}

/// How expert weights are stored in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// ggml blocks as stored in a GGUF file (method LLAMAFILE); the file decides the types at
    /// [`MoeLayer::load_gguf`] (see [`MoeLayer::ggml_types`]).
    Gguf,
    /// bf16 panels (method BF16).
    Bf16,
    /// Per-row symmetric int8 in the original's tiled AMXINT8 layout (method AMXINT8).
    Int8,
    /// Per-row symmetric int4 (`16·v`) in the original's AMXINT4 nibble layout (method AMXINT4).
    Int4,
}

impl WeightFormat {
    /// Granularity of the intermediate split and required divisor of H: whole 32-output panels
    /// for bf16; for int8 also whole 64-input tiles (down's inputs are the part's slice).
    /// GGUF layers are planned in panels here and re-split at load for the file's down type.
    pub fn unit(self) -> usize {
        match self {
            WeightFormat::Bf16 | WeightFormat::Gguf => PANEL,
            WeightFormat::Int8 => 64,
            WeightFormat::Int4 => 128,
        }
    }

    /// True for the quantised formats.
    pub fn is_quantised(self) -> bool {
        self != WeightFormat::Bf16
    }

    /// Bytes of a quantised `n × k` matrix.
    fn matrix_bytes(self, n: usize, k: usize) -> usize {
        match self {
            WeightFormat::Int4 => n * k / 2,
            _ => n * k,
        }
    }
}

struct PartWeights {
    inter: Range<usize>,
    /// bf16: per expert, per panel p: gate panel p then up panel p, so the gate/up task of a
    /// panel streams one contiguous run.
    gate_up: AlignedBuf<u16>,
    down: AlignedBuf<u16>,
    /// int8: gate, up, down matrices of every expert (tiled), their per-row scales and row sums.
    q: Option<Int8Part>,
    /// GGUF: the file's blocks (allocated at load).
    g: Option<llamafile::GgmlPart>,
}

struct Int8Part {
    mats: [AlignedBuf<u8>; 3],
    scales: [AlignedBuf<f32>; 3],
    sums: [AlignedBuf<i32>; 3],
}

/// Raw pointer that tasks share to write disjoint ranges.
#[derive(Clone, Copy)]
struct SyncPtr<T>(*mut T);
// SAFETY: every user writes a range no other task touches during the same phase.
unsafe impl<T> Send for SyncPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    /// The address (a method, so closures capture the Sync wrapper, not the raw field).
    #[inline(always)]
    fn get(self) -> *mut T {
        self.0
    }
}

/// Where one int8 matrix of every expert of a part goes (tiled bytes, row scales, row sums).
#[derive(Clone, Copy)]
struct Int8Target {
    mat: SyncPtr<u8>,
    scale: SyncPtr<f32>,
    sum: SyncPtr<i32>,
}

/// Quantise `view` (`n × k`) as expert `slot` of `t` ([`crate::quant::quantise_matrix`]).
///
/// # Safety
/// `t`'s buffers hold at least `slot + 1` experts of `n × k`; no other thread writes expert
/// `slot` of this matrix; `view` is alive.
unsafe fn quantise_into(
    view: &MatrixView,
    n: usize,
    k: usize,
    slot: usize,
    t: Int8Target,
    format: WeightFormat,
) -> Result<()> {
    let bytes = format.matrix_bytes(n, k);
    // SAFETY: expert `slot`'s ranges of the three buffers belong to this call (contract).
    unsafe {
        let mat = std::slice::from_raw_parts_mut(t.mat.get().add(slot * bytes), bytes);
        let scales = std::slice::from_raw_parts_mut(t.scale.get().add(slot * n), n);
        let sums = std::slice::from_raw_parts_mut(t.sum.get().add(slot * n), n);
        crate::quant::quantise_matrix(view, format == WeightFormat::Int4, mat, scales, Some(sums))
    }
}

/// Quantise an fp32 row to an int8 kernels' activation row (biased `q + 128`, then the copies
/// of [`crate::kernels::int8::fill_activation_copies`]; `out` holds `ACT_COPIES · row.len()`);
/// returns the row's scale.
fn quantise_activation(row: &[f32], out: &mut [u8]) -> f32 {
    let biased = &mut out[..row.len()];
    // SAFETY: i8 and u8 have the same layout; the slice covers exactly `biased`.
    let signed =
        unsafe { std::slice::from_raw_parts_mut(biased.as_mut_ptr() as *mut i8, biased.len()) };
    let d = crate::quant::quantize_row_int8(row, signed);
    for b in biased.iter_mut() {
        *b ^= 0x80;
    }
    crate::kernels::int8::fill_activation_copies(out);
    // A NaN would quantise to 0 silently; a NaN scale keeps it visible in this row's output.
    if row.iter().any(|v| v.is_nan()) {
        f32::NAN
    } else {
        d
    }
}

/// One MoE layer with its packed weights.
pub struct MoeLayer {
    config: MoeConfig,
    kernels: KernelSet,
    parts: Vec<PartWeights>,
    loaded: bool,
    rowwise_down_max: usize,
    format: WeightFormat,
    /// GGUF: types and dot kernels, set by `load_gguf`.
    ggml: Option<llamafile::GgmlPlan>,
}

/// Scratch of forward calls, grown when a layer needs more, shared by the layers that one
/// caller (e.g. the engine thread) runs one after another.
#[derive(Default)]
pub struct Workspace {
    routing: Routing,
    parts: Vec<PartScratch>,
    /// Addresses of `parts`' buffers, refreshed by `reserve` (so forward allocates nothing).
    ptrs: Vec<PartPtrs>,
}

/// Buffer addresses of one part's scratch (null where a buffer is not needed).
#[derive(Clone, Copy)]
struct PartPtrs {
    x: SyncPtr<f32>,
    act: SyncPtr<f32>,
    partial: SyncPtr<f32>,
    down_rows: SyncPtr<f32>,
    x_bf16: SyncPtr<u32>,
    act_bf16: SyncPtr<u32>,
    x_q: SyncPtr<u8>,
    x_scale: SyncPtr<f32>,
    act_q: SyncPtr<u8>,
    act_scale: SyncPtr<f32>,
}

#[derive(Default)]
struct PartScratch {
    x: Option<AlignedBuf<f32>>,
    act: Option<AlignedBuf<f32>>,
    partial: Option<AlignedBuf<f32>>,
    /// Weighted down outputs per row (row-wise scheme only).
    down_rows: Option<AlignedBuf<f32>>,
    /// bf16-pair copies of x and act for the bf16 dot path.
    x_bf16: Option<AlignedBuf<u32>>,
    act_bf16: Option<AlignedBuf<u32>>,
    /// Quantised (biased u8) x and act with per-row scales, for int8 weights.
    x_q: Option<AlignedBuf<u8>>,
    x_scale: Option<AlignedBuf<f32>>,
    act_q: Option<AlignedBuf<u8>>,
    act_scale: Option<AlignedBuf<f32>>,
}

fn grow<T: Copy>(buf: &mut Option<AlignedBuf<T>>, len: usize) -> Result<()> {
    if buf.as_ref().is_none_or(|b| b.len() < len) {
        *buf = Some(AlignedBuf::zeroed(len)?);
    }
    Ok(())
}

impl Workspace {
    /// Empty workspace; [`Workspace::reserve`] sizes it for a layer.
    pub fn new() -> Workspace {
        Workspace::default()
    }

    /// Make room for `layer` (allocates only when the layer needs more than any before).
    pub fn reserve(&mut self, layer: &MoeLayer) -> Result<()> {
        let c = &layer.config;
        let tokens = c.max_tokens.min(CHUNK_TOKENS);
        let rows = tokens * c.top_k;
        if self.parts.len() < layer.parts.len() {
            self.parts
                .resize_with(layer.parts.len(), PartScratch::default);
        }
        for (s, p) in self.parts.iter_mut().zip(&layer.parts) {
            grow(&mut s.x, tokens * c.hidden)?;
            grow(&mut s.act, rows * p.inter.len())?;
            grow(&mut s.partial, tokens * c.hidden)?;
            grow(&mut s.down_rows, (rows * c.hidden).min(ROWWISE_DOWN_MAX))?;
            let bf16_staging = !layer.format.is_quantised()
                && (layer.kernels.bf16().is_some() || layer.kernels.amx().is_some());
            if bf16_staging {
                grow(&mut s.x_bf16, tokens * c.hidden / 2)?;
                grow(&mut s.act_bf16, rows * p.inter.len() / 2)?;
            }
            if layer.format.is_quantised() {
                // Bytes of a quantised x / act row: the int8 kernels' activation rows, or the
                // activation format's blocks for GGUF.
                let copies = crate::kernels::int8::ACT_COPIES;
                let (xb, ab) = match (&layer.ggml, &p.g) {
                    (Some(plan), Some(g)) => (plan.x_stride, g.act_stride),
                    _ => (copies * c.hidden, copies * p.inter.len()),
                };
                grow(&mut s.x_q, tokens * xb)?;
                grow(&mut s.x_scale, tokens)?;
                grow(&mut s.act_q, rows * ab)?;
                grow(&mut s.act_scale, rows)?;
            }
        }
        fn addr<T: Copy>(b: &mut Option<AlignedBuf<T>>) -> SyncPtr<T> {
            SyncPtr(b.as_mut().map_or(std::ptr::null_mut(), |b| b.as_mut_ptr()))
        }
        self.ptrs.clear();
        for s in &mut self.parts {
            self.ptrs.push(PartPtrs {
                x: addr(&mut s.x),
                act: addr(&mut s.act),
                partial: addr(&mut s.partial),
                down_rows: addr(&mut s.down_rows),
                x_bf16: addr(&mut s.x_bf16),
                act_bf16: addr(&mut s.act_bf16),
                x_q: addr(&mut s.x_q),
                x_scale: addr(&mut s.x_scale),
                act_q: addr(&mut s.act_q),
                act_scale: addr(&mut s.act_scale),
            });
        }
        Ok(())
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.parts
            .iter()
            .flat_map(|p| [&p.x, &p.act, &p.partial, &p.down_rows])
            .map(|b| b.as_ref().map_or(0, |b| b.len() * 4))
            .sum::<usize>()
            + self
                .parts
                .iter()
                .flat_map(|p| [&p.x_bf16, &p.act_bf16])
                .map(|b| b.as_ref().map_or(0, |b| b.len() * 4))
                .sum::<usize>()
    }
}

/// Inputs and outputs of one forward call, as raw memory (the Python binding's form).
#[derive(Clone, Copy, Debug)]
pub struct ForwardArgs {
    /// Tokens in this call (≤ `max_tokens`).
    pub qlen: usize,
    /// `[qlen][H]` activations.
    pub hidden: *const u8,
    /// Their element type.
    pub hidden_type: FloatType,
    /// `[qlen][top_k]` expert ids (physical slots).
    pub ids: *const u8,
    /// Whether ids are int64 (else int32).
    pub ids_i64: bool,
    /// `[qlen][top_k]` fp32 router weights.
    pub weights: *const f32,
    /// `[qlen][H]` output.
    pub out: *mut u8,
    /// Output element type.
    pub out_type: FloatType,
    /// Optional `[qlen][H]` addend (the previous layer's deferred experts).
    pub residual: *const u8,
    /// Element type of `residual`.
    pub residual_type: FloatType,
    /// Optional `[num_experts]` bytes, non-zero = expert runs on the GPU (read now, live).
    pub gpu_mask: *const u8,
}

// SAFETY: plain addresses; `forward_raw`'s contract makes them valid for the call, and tasks
// only write disjoint rows of `out`.
unsafe impl Send for ForwardArgs {}
// SAFETY: as above.
unsafe impl Sync for ForwardArgs {}

impl MoeLayer {
    /// An unloaded layer for a pool with `parts` sub-pools, using `kernels`.
    pub fn new(config: MoeConfig, parts: usize, kernels: KernelSet) -> Result<MoeLayer> {
        Self::with_format(config, parts, kernels, WeightFormat::Bf16)
    }

    /// An unloaded layer storing its experts in `format`.
    pub fn with_format(
        config: MoeConfig,
        parts: usize,
        kernels: KernelSet,
        format: WeightFormat,
    ) -> Result<MoeLayer> {
        config.validate(parts)?;
        let unit = format.unit();
        let l = config.layer_idx;
        kt_ensure!(
            config.hidden.is_multiple_of(unit) && config.intermediate.is_multiple_of(unit),
            Invalid,
            "layer {l}: {format:?} weights need hidden_size ({}) and moe_intermediate_size ({}) to be \
             multiples of {unit}",
            config.hidden,
            config.intermediate
        );
        config.check_blocks(parts, unit)?;
        let ranges = config.part_ranges_in_units(parts, unit);
        let e = config.num_experts;
        let parts = ranges
            .into_iter()
            .map(|inter| {
                let n = e * config.hidden * inter.len();
                let (bf, q) = match format {
                    WeightFormat::Bf16 => (n, None),
                    WeightFormat::Gguf => (0, None),
                    WeightFormat::Int8 | WeightFormat::Int4 => {
                        let rows = [e * inter.len(), e * inter.len(), e * config.hidden];
                        let bytes = format.matrix_bytes(n, 1);
                        let q = Int8Part {
                            mats: [
                                AlignedBuf::zeroed(bytes)?,
                                AlignedBuf::zeroed(bytes)?,
                                AlignedBuf::zeroed(bytes)?,
                            ],
                            scales: [
                                AlignedBuf::zeroed(rows[0])?,
                                AlignedBuf::zeroed(rows[1])?,
                                AlignedBuf::zeroed(rows[2])?,
                            ],
                            sums: [
                                AlignedBuf::zeroed(rows[0])?,
                                AlignedBuf::zeroed(rows[1])?,
                                AlignedBuf::zeroed(rows[2])?,
                            ],
                        };
                        (0, Some(q))
                    }
                };
                Ok(PartWeights {
                    inter,
                    gate_up: AlignedBuf::zeroed(2 * bf)?,
                    down: AlignedBuf::zeroed(bf)?,
                    q,
                    g: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(MoeLayer {
            config,
            kernels,
            parts,
            loaded: false,
            rowwise_down_max: ROWWISE_DOWN_MAX,
            format,
            ggml: None,
        })
    }

    /// How the experts are stored.
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// Forwards with at most `elems` (rows × hidden) down outputs use the row-wise down scheme
    /// (decode-sized); larger ones the column-block scheme. Both give the same result; this
    /// is a tuning knob (and lets tests cover both).
    pub fn set_rowwise_down_limit(&mut self, elems: usize) {
        self.rowwise_down_max = elems.min(ROWWISE_DOWN_MAX);
    }

    /// The layer's configuration.
    pub fn config(&self) -> &MoeConfig {
        &self.config
    }

    /// The kernels in use.
    pub fn kernels(&self) -> &KernelSet {
        &self.kernels
    }

    /// True once weights are loaded.
    pub fn is_loaded(&self) -> bool {
        self.loaded
    }

    /// Intermediate slice of each part.
    pub fn part_ranges(&self) -> Vec<Range<usize>> {
        self.parts.iter().map(|p| p.inter.clone()).collect()
    }

    /// Pack weights from `source`. Physical slot `p` receives logical expert `map[p]` (identity
    /// when `map` is None). Each part packs its own slice on its own threads.
    pub fn load(
        &mut self,
        pool: &Pool,
        source: &dyn ExpertSource,
        map: Option<&[i64]>,
    ) -> Result<()> {
        let c = self.config.clone();
        let l = c.layer_idx;
        kt_ensure!(
            self.format != WeightFormat::Gguf,
            Invalid,
            "layer {l} stores GGUF blocks; load it from a GGUF file (load_gguf)"
        );
        kt_ensure!(
            pool.parts() == self.parts.len(),
            Invalid,
            "layer {l} was built for {} NUMA parts but the pool has {}",
            self.parts.len(),
            pool.parts()
        );
        let logical = self.logical_experts(map, source.num_experts())?;
        // Check every matrix's shape before touching memory.
        for &e in &logical {
            for (proj, rows, cols) in [
                (Proj::Gate, c.intermediate, c.hidden),
                (Proj::Up, c.intermediate, c.hidden),
                (Proj::Down, c.hidden, c.intermediate),
            ] {
                let m = source.matrix(e, proj)?;
                kt_ensure!(
                    m.rows == rows && m.cols == cols,
                    Invalid,
                    "layer {l}: expert {e} {proj:?} weight is {}x{}, expected {rows}x{cols}",
                    m.rows,
                    m.cols
                );
            }
        }
        let targets: Vec<[SyncPtr<u16>; 3]> = self
            .parts
            .iter_mut()
            .map(|p| {
                [
                    SyncPtr(p.gate_up.as_mut_ptr()),
                    SyncPtr(p.gate_up.as_mut_ptr()),
                    SyncPtr(p.down.as_mut_ptr()),
                ]
            })
            .collect();
        let int8_targets: Vec<Option<[Int8Target; 3]>> = self
            .parts
            .iter_mut()
            .map(|p| {
                p.q.as_mut().map(|q| {
                    let mk = |i: usize, q: &mut Int8Part| Int8Target {
                        mat: SyncPtr(q.mats[i].as_mut_ptr()),
                        scale: SyncPtr(q.scales[i].as_mut_ptr()),
                        sum: SyncPtr(q.sums[i].as_mut_ptr()),
                    };
                    [mk(0, q), mk(1, q), mk(2, q)]
                })
            })
            .collect();
        let ranges = self.part_ranges();
        let first_error: Mutex<Option<Error>> = Mutex::new(None);
        let (h, e_count) = (c.hidden, c.num_experts);
        let fmt = self.format;
        pool.run_parts(&|part, team: &Team| {
            let inter = ranges[part].clone();
            let ip = inter.len();
            let dst = &targets[part];
            // One task per (physical expert, projection): big enough to amortise, many enough to balance.
            team.parallel_for(e_count * 3, &|task| {
                let (slot, which) = (task / 3, task % 3);
                let result = (|| -> Result<()> {
                    let e = logical[slot];
                    let (view, n, k) = match which {
                        0 => (
                            source.matrix(e, Proj::Gate)?.sub(inter.start, ip, 0, h)?,
                            ip,
                            h,
                        ),
                        1 => (
                            source.matrix(e, Proj::Up)?.sub(inter.start, ip, 0, h)?,
                            ip,
                            h,
                        ),
                        _ => (
                            source.matrix(e, Proj::Down)?.sub(0, h, inter.start, ip)?,
                            h,
                            ip,
                        ),
                    };
                    if let Some(q) = &int8_targets[part] {
                        // SAFETY: the task owns expert `slot` of matrix `which` in this part.
                        return unsafe { quantise_into(&view, n, k, slot, q[which], fmt) };
                    }
                    let base = dst[which].0;
                    for p in 0..n / PANEL {
                        // gate panel p at slot 2p, up panel p at 2p+1 of the expert's gate_up run.
                        let off = match which {
                            0 => slot * 2 * n * k + 2 * p * panel_len(k),
                            1 => slot * 2 * n * k + (2 * p + 1) * panel_len(k),
                            _ => slot * n * k + p * panel_len(k),
                        };
                        // SAFETY: each (slot, which, p) owns a disjoint panel inside its buffer
                        // (2*E*n*k elements for gate_up, E*n*k for down); shapes checked above.
                        unsafe {
                            let panel = std::slice::from_raw_parts_mut(base.add(off), panel_len(k));
                            pack_panel(&view, p, panel);
                        }
                    }
                    Ok(())
                })();
                if let Err(err) = result {
                    first_error.lock().unwrap().get_or_insert(err);
                }
            });
        })?;
        if let Some(err) = first_error.into_inner().unwrap() {
            return Err(err);
        }
        self.loaded = true;
        Ok(())
    }

    /// Copy weights converted by the original (AMXINT8/AMXINT4 files, see
    /// [`crate::converted`]) into this layer: physical slot `p` gets file expert `map[p]`
    /// (identity when None). The files must be split into as many parts as this layer has.
    pub fn load_converted(
        &mut self,
        pool: &Pool,
        files: &crate::converted::ConvertedLayer,
        map: Option<&[i64]>,
    ) -> Result<()> {
        let c = self.config.clone();
        let l = c.layer_idx;
        let shape = *files.shape();
        kt_ensure!(
            self.format.is_quantised() && shape.format == self.format,
            Invalid,
            "layer {l} stores {:?} weights; the files hold {:?}",
            self.format,
            shape.format
        );
        kt_ensure!(
            shape.parts == self.parts.len()
                && pool.parts() == self.parts.len()
                && shape.hidden == c.hidden
                && shape.intermediate == c.intermediate,
            Invalid,
            "layer {l}: files for H={} I={} in {} parts, layer H={} I={} in {} parts (pool {})",
            shape.hidden,
            shape.intermediate,
            shape.parts,
            c.hidden,
            c.intermediate,
            self.parts.len(),
            pool.parts()
        );
        let ranges = self.part_ranges();
        let even = c.intermediate / self.parts.len();
        kt_ensure!(
            ranges.iter().all(|r| r.len() == even),
            Invalid,
            "layer {l}: the original splits I={} evenly into {} parts; this layer's parts are {:?}",
            c.intermediate,
            self.parts.len(),
            ranges
        );
        let logical = self.logical_experts(map, shape.experts)?;
        let targets: Vec<[Int8Target; 3]> = self
            .parts
            .iter_mut()
            .map(|p| {
                let q = p.q.as_mut().expect("quantised layers have int8 parts");
                let mk = |i: usize, q: &mut Int8Part| Int8Target {
                    mat: SyncPtr(q.mats[i].as_mut_ptr()),
                    scale: SyncPtr(q.scales[i].as_mut_ptr()),
                    sum: SyncPtr(q.sums[i].as_mut_ptr()),
                };
                [mk(0, q), mk(1, q), mk(2, q)]
            })
            .collect();
        let fmt = self.format;
        let first_error: Mutex<Option<Error>> = Mutex::new(None);
        pool.run_parts(&|part, team: &Team| {
            team.parallel_for(c.num_experts * 3, &|task| {
                let (slot, which) = (task / 3, task % 3);
                let proj = crate::converted::PROJS[which].0;
                let result = {
                    let (n, k) = shape.part_dims(proj);
                    let t = targets[part][which];
                    let int4 = fmt == WeightFormat::Int4;
                    let bytes = fmt.matrix_bytes(n, k);
                    // SAFETY: this task owns expert `slot` of matrix `which` in this part; the
                    // buffers hold E experts of n rows (sizes checked when the files opened).
                    let (mat, scales, sums) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(t.mat.get().add(slot * bytes), bytes),
                            std::slice::from_raw_parts_mut(t.scale.get().add(slot * n), n),
                            std::slice::from_raw_parts_mut(t.sum.get().add(slot * n), n),
                        )
                    };
                    let group_bytes = fmt.matrix_bytes(PANEL, k);
                    // Row sums of each piece as it arrives, while its bytes are in cache.
                    let mut sum_piece = |mat: &[u8], bytes: Range<usize>| {
                        for g in bytes.start / group_bytes..bytes.end / group_bytes {
                            let group = &mat[g * group_bytes..(g + 1) * group_bytes];
                            sums[g * PANEL..(g + 1) * PANEL].copy_from_slice(
                                &crate::kernels::int8::row_sums_fast(group, k, int4),
                            );
                        }
                    };
                    files.read_into(logical[slot], proj, part, mat, scales, &mut sum_piece)
                };
                if let Err(err) = result {
                    first_error.lock().unwrap().get_or_insert(err);
                }
            });
        })?;
        if let Some(err) = first_error.into_inner().unwrap() {
            return Err(err);
        }
        self.loaded = true;
        Ok(())
    }

    /// Logical expert of every physical slot, checked against `available` experts.
    fn logical_experts(&self, map: Option<&[i64]>, available: usize) -> Result<Vec<usize>> {
        let c = &self.config;
        let l = c.layer_idx;
        match map {
            None => {
                kt_ensure!(
                    available >= c.num_experts,
                    Invalid,
                    "layer {l}: the weights hold {available} experts, the layer needs {}",
                    c.num_experts
                );
                Ok((0..c.num_experts).collect())
            }
            Some(m) => {
                kt_ensure!(
                    m.len() == c.num_experts,
                    Invalid,
                    "layer {l}: physical_to_logical_map has {} entries, expected num_experts={}",
                    m.len(),
                    c.num_experts
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

    /// One part of one slot's quantised projection, borrowed from the layer: the matrix bytes in
    /// the in-memory layout (the original's file layout after
    /// [`crate::quant::to_file_layout`]) and the row scales.
    pub fn quantised_part(&self, slot: usize, proj: Proj, part: usize) -> Result<(&[u8], &[f32])> {
        let q = self
            .parts
            .get(part)
            .and_then(|p| p.q.as_ref())
            .ok_or_else(|| Error::Invalid(format!("no quantised part {part} in this layer")))?;
        kt_ensure!(
            self.loaded,
            Invalid,
            "layer {} is not loaded",
            self.config.layer_idx
        );
        kt_ensure!(
            slot < self.config.num_experts,
            Invalid,
            "expert slot {slot} out of range"
        );
        let ip = self.parts[part].inter.len();
        let (which, n, k) = match proj {
            Proj::Gate => (0, ip, self.config.hidden),
            Proj::Up => (1, ip, self.config.hidden),
            Proj::Down => (2, self.config.hidden, ip),
        };
        let start = self.format.matrix_bytes(slot * n, k);
        let bytes = &q.mats[which].as_slice()[start..start + self.format.matrix_bytes(n, k)];
        let scales = &q.scales[which].as_slice()[slot * n..(slot + 1) * n];
        Ok((bytes, scales))
    }

    /// Forward with fp32 slices (for Rust callers and tests): `x [qlen][H]`, `ids/weights
    /// [qlen][top_k]`, `out [qlen][H]`.
    pub fn forward_f32(
        &self,
        pool: &Pool,
        ws: &mut Workspace,
        x: &[f32],
        ids: &[i64],
        weights: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        let c = &self.config;
        let qlen = x.len() / c.hidden;
        kt_ensure!(
            x.len() == qlen * c.hidden && out.len() == x.len(),
            Invalid,
            "hidden states and output must both be [qlen, {}]",
            c.hidden
        );
        kt_ensure!(
            ids.len() == qlen * c.top_k && weights.len() == ids.len(),
            Invalid,
            "ids and weights must be [{qlen}, {}]",
            c.top_k
        );
        let args = ForwardArgs {
            qlen,
            hidden: x.as_ptr() as *const u8,
            hidden_type: FloatType::F32,
            ids: ids.as_ptr() as *const u8,
            ids_i64: true,
            weights: weights.as_ptr(),
            out: out.as_mut_ptr() as *mut u8,
            out_type: FloatType::F32,
            residual: std::ptr::null(),
            residual_type: FloatType::F32,
            gpu_mask: std::ptr::null(),
        };
        // SAFETY: every pointer comes from a slice whose length was checked above.
        unsafe { self.forward_raw(pool, ws, &args) }
    }

    /// Forward over raw memory.
    ///
    /// # Safety
    /// Every pointer in `args` must be valid for the extent its comment gives, for the whole
    /// call, and `out` must not overlap the inputs. Null `residual`/`gpu_mask` mean "none".
    pub unsafe fn forward_raw(
        &self,
        pool: &Pool,
        ws: &mut Workspace,
        args: &ForwardArgs,
    ) -> Result<()> {
        let c = &self.config;
        let l = c.layer_idx;
        kt_ensure!(
            self.loaded,
            Runtime,
            "layer {l}: forward called before the weights were loaded"
        );
        kt_ensure!(
            pool.parts() == self.parts.len(),
            Invalid,
            "layer {l} was built for {} NUMA parts but the pool has {}",
            self.parts.len(),
            pool.parts()
        );
        kt_ensure!(
            args.qlen <= c.max_tokens,
            Invalid,
            "layer {l}: {} tokens exceed chunked_prefill_size={}",
            args.qlen,
            c.max_tokens
        );
        if args.qlen == 0 {
            return Ok(());
        }
        ws.reserve(self)?;
        let (h, k) = (c.hidden, c.top_k);
        // SAFETY: the caller guarantees num_experts readable bytes when non-null.
        let mask = (!args.gpu_mask.is_null())
            .then(|| unsafe { std::slice::from_raw_parts(args.gpu_mask, c.num_experts) });
        let mut t0 = 0;
        while t0 < args.qlen {
            let t1 = (t0 + CHUNK_TOKENS).min(args.qlen);
            let n = t1 - t0;
            // SAFETY: [t0, t1) is inside the caller's qlen rows.
            let (ids, weights) = unsafe {
                let ids = if args.ids_i64 {
                    Ids::I64(std::slice::from_raw_parts(
                        (args.ids as *const i64).add(t0 * k),
                        n * k,
                    ))
                } else {
                    Ids::I32(std::slice::from_raw_parts(
                        (args.ids as *const i32).add(t0 * k),
                        n * k,
                    ))
                };
                (
                    ids,
                    std::slice::from_raw_parts(args.weights.add(t0 * k), n * k),
                )
            };
            ws.routing.build(ids, weights, n, k, c.num_experts, mask);
            let offset = |p: *const u8, t: FloatType| {
                // SAFETY: row t0 is within the caller's buffer.
                if p.is_null() {
                    p
                } else {
                    unsafe { p.add(t0 * h * t.size()) }
                }
            };
            let chunk = ForwardArgs {
                qlen: n,
                hidden: offset(args.hidden, args.hidden_type),
                out: offset(args.out, args.out_type) as *mut u8,
                residual: offset(args.residual, args.residual_type),
                ..*args
            };
            // SAFETY: forwarded contract, restricted to this chunk.
            unsafe { self.forward_chunk(pool, ws, &chunk)? };
            t0 = t1;
        }
        Ok(())
    }

    /// One chunk (≤ CHUNK_TOKENS tokens) whose routing is already in `ws.routing`.
    unsafe fn forward_chunk(
        &self,
        pool: &Pool,
        ws: &mut Workspace,
        args: &ForwardArgs,
    ) -> Result<()> {
        let c = &self.config;
        let (h, qlen) = (c.hidden, args.qlen);
        let routing = &ws.routing;
        let scratch = &ws.ptrs;
        let single = self.parts.len() == 1;
        let kern = &self.kernels;
        let rows_per_block = kern.rows_per_block();
        let total_rows = routing.rows();
        let bf16 = kern.bf16().copied();
        // The integer kernel of a quantised format (same contract for int8 and int4 groups).
        let qdot = match self.format {
            WeightFormat::Int4 => kern.int4_fn(),
            _ => kern.int8_fn(),
        };
        let amx = kern.amx().copied();
        let quantised = self.format.is_quantised();
        // The bf16 kernel for an expert with `rows` rows on a projection with `k` inputs: AMX
        // tiles, else the vector bf16 dot, for experts with enough rows to be compute-bound;
        // None means the exact fp32 path (or an integer format).
        let bf16_for = |rows: usize, k: usize| -> Option<Bf16Path> {
            if quantised {
                return None;
            }
            amx.filter(|a| a.applies(rows))
                .and_then(|a| a.bf16_path(k))
                .or(bf16.filter(|b| b.min_rows > 0 && rows >= b.min_rows))
        };
        // The integer kernel and its row block for an expert with `rows` rows.
        let int_for = |rows: usize| match amx.filter(|a| a.applies(rows)) {
            Some(a) if self.format == WeightFormat::Int4 => (a.int4, crate::kernels::amx::ROWS),
            Some(a) => (a.int8, crate::kernels::amx::ROWS),
            None => (qdot, kern.int8_rows()),
        };
        let any_bf16 = routing
            .offsets
            .windows(2)
            .any(|w| bf16_for(w[1] - w[0], h).is_some());
        let hidden_in = SyncPtr(args.hidden as *mut u8);
        let out = SyncPtr(args.out);
        let residual = SyncPtr(args.residual as *mut u8);

        pool.run_parts(&|part, team: &Team| {
            let pw = &self.parts[part];
            let ip = pw.inter.len();
            let PartPtrs {
                x,
                act,
                partial,
                down_rows,
                x_bf16,
                act_bf16,
                x_q,
                x_scale,
                act_q,
                act_scale,
            } = scratch[part];
            let q = pw.q.as_ref();
            // GGUF: this part's blocks and the layer's plan; quantised rows are then blocks
            // of the types' activation formats (strides in bytes).
            let gguf = pw.g.as_ref().zip(self.ggml.as_ref());
            let copies = crate::kernels::int8::ACT_COPIES;
            let xq_stride = gguf.map_or(copies * h, |(_, plan)| plan.x_stride);
            let aq_stride = gguf.map_or(copies * ip, |(g, _)| g.act_stride);
            // 1. Activations to fp32, once per part (NUMA-local copy), and to bf16 pairs if any
            //    expert takes the bf16 path.
            team.parallel_for(qlen, &|t| {
                // SAFETY: row t of the input and of this part's x buffers (tokens × H).
                unsafe {
                    let dst = std::slice::from_raw_parts_mut(x.get().add(t * h), h);
                    row_to_f32(
                        hidden_in.get().add(t * h * args.hidden_type.size()),
                        args.hidden_type,
                        dst,
                    );
                    if any_bf16 {
                        let staged =
                            std::slice::from_raw_parts_mut(x_bf16.get().add(t * h / 2), h / 2);
                        kern.stage_bf16(dst, staged);
                    }
                    let xq = x_q.get().wrapping_add(t * xq_stride); // null unless quantised
                    if q.is_some() {
                        let xq = std::slice::from_raw_parts_mut(xq, xq_stride);
                        *x_scale.get().add(t) = quantise_activation(dst, xq);
                    }
                    if let Some((_, plan)) = gguf {
                        plan.quantise_x(dst, std::slice::from_raw_parts_mut(xq, xq_stride));
                    }
                }
            });
            // 2. gate & up for each (expert, panel of this part's intermediate slice), SwiGLU.
            let gate_panels = ip / PANEL;
            let n_experts = routing.experts.len();
            team.parallel_for(n_experts * gate_panels, &|task| {
                let (ei, p) = (task / gate_panels, task % gate_panels);
                let e = routing.experts[ei] as usize;
                let rows = routing.offsets[ei]..routing.offsets[ei + 1];
                let (gate, up) = if !quantised {
                    let off = e * 2 * ip * h + 2 * p * panel_len(h);
                    let gu = pw.gate_up.as_slice();
                    (
                        &gu[off..off + panel_len(h)],
                        &gu[off + panel_len(h)..off + 2 * panel_len(h)],
                    )
                } else {
                    (&[][..], &[][..])
                };
                // int8: this panel's 32 rows of gate and up (tiled), their scales and row sums.
                let qrow = e * ip + p * PANEL;
                let mut scratch = PanelScratch::take();
                let PanelScratch { acc, g, u, a } = &mut *scratch;
                let mut ptrs_q = [std::ptr::null::<u8>(); MAX_ROWS];
                let mut ptrs = [std::ptr::null::<f32>(); MAX_ROWS];
                let mut ptrs_bf16 = [std::ptr::null::<u32>(); MAX_ROWS];
                let bf = bf16_for(rows.len(), h);
                let stage_act = bf16_for(rows.len(), ip).is_some();
                let (qfn, qblock) = int_for(rows.len());
                let block = match (q, bf) {
                    _ if gguf.is_some() => MAX_ROWS,
                    (Some(_), _) => qblock,
                    (None, Some(b)) => b.rows_per_block,
                    (None, None) => rows_per_block,
                };
                let mut r0 = rows.start;
                while r0 < rows.end {
                    let nr = block.min(rows.end - r0);
                    for i in 0..nr {
                        let t = routing.row_token[r0 + i] as usize;
                        // SAFETY: token index < qlen rows of x / x_bf16 / x_q.
                        unsafe {
                            ptrs[i] = x.get().add(t * h);
                            ptrs_bf16[i] = x_bf16.get().add(t * h / 2);
                            ptrs_q[i] = x_q.get().add(t * xq_stride);
                        }
                    }
                    if let Some(qw) = q {
                        for (which, dst) in [(0usize, &mut *g), (1, &mut *u)] {
                            // SAFETY: panel rows qrow..qrow+32 of an E*ip x h matrix; x_q rows
                            // are activation rows of h values; acc holds nr*32.
                            unsafe {
                                qfn(
                                    &ptrs_q[..nr],
                                    h,
                                    qw.mats[which]
                                        .as_ptr()
                                        .add(self.format.matrix_bytes(qrow, h)),
                                    qw.sums[which].as_ptr().add(qrow),
                                    acc.as_mut_ptr(),
                                );
                            }
                            let sw = &qw.scales[which].as_slice()[qrow..qrow + PANEL];
                            for i in 0..nr {
                                // SAFETY: x_scale has a value per token.
                                let sa = unsafe {
                                    *x_scale.get().add(routing.row_token[r0 + i] as usize)
                                };
                                scale_panel_row(acc, sw, sa, i, dst);
                            }
                        }
                    }
                    if let Some((gp, plan)) = gguf {
                        let mut xs = [&[][..]; MAX_ROWS];
                        for (x, &ptr) in xs.iter_mut().zip(&ptrs_q[..nr]) {
                            // SAFETY: each pointer is a quantised x row of xq_stride bytes.
                            *x = unsafe { std::slice::from_raw_parts(ptr, xq_stride) };
                        }
                        plan.gate_up_panel(gp, e, p, &xs[..nr], g, u);
                    }
                    // SAFETY: rows of x have h floats (h/2 pairs staged); panels panel_len(h).
                    unsafe {
                        match bf {
                            _ if quantised => {}
                            Some(b) => {
                                (b.dot)(&ptrs_bf16[..nr], h, gate.as_ptr(), g.as_mut_ptr());
                                (b.dot)(&ptrs_bf16[..nr], h, up.as_ptr(), u.as_mut_ptr());
                            }
                            None => {
                                kern.panel_dot_raw(&ptrs[..nr], h, gate.as_ptr(), g.as_mut_ptr());
                                kern.panel_dot_raw(&ptrs[..nr], h, up.as_ptr(), u.as_mut_ptr());
                            }
                        }
                    }
                    let m = nr * PANEL;
                    kern.swiglu(
                        &g[..m],
                        &u[..m],
                        &mut a[..m],
                        c.swiglu_limit,
                        c.swiglu_alpha,
                    );
                    for i in 0..nr {
                        let src = &a[i * PANEL..(i + 1) * PANEL];
                        // SAFETY: row r0+i of act (rows × ip), columns of panel p: this task's.
                        unsafe {
                            let row = (r0 + i) * ip + p * PANEL;
                            std::ptr::copy_nonoverlapping(src.as_ptr(), act.get().add(row), PANEL);
                            if stage_act {
                                let dst = std::slice::from_raw_parts_mut(
                                    act_bf16.get().add(row / 2),
                                    PANEL / 2,
                                );
                                kern.stage_bf16(src, dst);
                            }
                        }
                    }
                    r0 += nr;
                }
                PanelScratch::give_back(scratch);
            });
            // 2b. int8 / GGUF: quantise each act row (its scales span every panel, hence a
            //     phase).
            if q.is_some() || gguf.is_some() {
                team.parallel_for(total_rows, &|row| {
                    // SAFETY: row `row` of act / act_q / act_scale belongs to this task.
                    unsafe {
                        let src = std::slice::from_raw_parts(act.get().add(row * ip), ip);
                        let dst = std::slice::from_raw_parts_mut(
                            act_q.get().add(row * aq_stride),
                            aq_stride,
                        );
                        match gguf {
                            Some((g, plan)) => plan.quantise_act(g, src, dst),
                            None => *act_scale.get().add(row) = quantise_activation(src, dst),
                        }
                    }
                });
            }
            // 3. down. `down_panels(ei, panels, sink)` computes expert ei's rows against a range
            //    of down panels and hands each (row, panel, 32 values) to `sink`.
            let out_panels = h / PANEL;
            let down_panels =
                |ei: usize,
                 panels: Range<usize>,
                 before_block: &dyn Fn(Range<usize>, usize),
                 sink: &mut dyn FnMut(usize, usize, &[f32])| {
                    let e = routing.experts[ei] as usize;
                    let rows = routing.offsets[ei]..routing.offsets[ei + 1];
                    let bf = bf16_for(rows.len(), ip);
                    let (qfn, qblock) = int_for(rows.len());
                    let block = match (q, bf) {
                        _ if gguf.is_some() => MAX_ROWS,
                        (Some(_), _) => qblock,
                        (None, Some(b)) => b.rows_per_block,
                        (None, None) => rows_per_block,
                    };
                    let mut scratch = PanelScratch::take();
                    let PanelScratch { acc, g: o, .. } = &mut *scratch;
                    let mut ptrs = [std::ptr::null::<f32>(); MAX_ROWS];
                    let mut ptrs_bf16 = [std::ptr::null::<u32>(); MAX_ROWS];
                    let mut ptrs_q = [std::ptr::null::<u8>(); MAX_ROWS];
                    for p in panels {
                        let panel = if !quantised {
                            let off = e * h * ip + p * panel_len(ip);
                            &pw.down.as_slice()[off..off + panel_len(ip)]
                        } else {
                            &[][..]
                        };
                        let mut r0 = rows.start;
                        while r0 < rows.end {
                            let nr = block.min(rows.end - r0);
                            before_block(r0..r0 + nr, p);
                            for i in 0..nr {
                                // SAFETY: act row r0+i exists (rows ≤ capacity).
                                unsafe {
                                    ptrs[i] = act.get().add((r0 + i) * ip);
                                    ptrs_bf16[i] = act_bf16.get().add((r0 + i) * ip / 2);
                                    ptrs_q[i] = act_q.get().add((r0 + i) * aq_stride);
                                }
                            }
                            if let Some(qw) = q {
                                let qrow = e * h + p * PANEL;
                                // SAFETY: down rows qrow..qrow+32 of an E*h x ip matrix; act_q rows
                                // are activation rows of ip values.
                                unsafe {
                                    qfn(
                                        &ptrs_q[..nr],
                                        ip,
                                        qw.mats[2].as_ptr().add(self.format.matrix_bytes(qrow, ip)),
                                        qw.sums[2].as_ptr().add(qrow),
                                        acc.as_mut_ptr(),
                                    );
                                }
                                let sw = &qw.scales[2].as_slice()[qrow..qrow + PANEL];
                                for i in 0..nr {
                                    // SAFETY: act_scale has a value per row.
                                    let sa = unsafe { *act_scale.get().add(r0 + i) };
                                    scale_panel_row(acc, sw, sa, i, o);
                                }
                            }
                            if let Some((gp, plan)) = gguf {
                                let mut acts = [&[][..]; MAX_ROWS];
                                for (a, &ptr) in acts.iter_mut().zip(&ptrs_q[..nr]) {
                                    // SAFETY: each pointer is a quantised act row of aq_stride
                                    // bytes.
                                    *a = unsafe { std::slice::from_raw_parts(ptr, aq_stride) };
                                }
                                plan.down_panel(gp, e, p, &acts[..nr], o);
                            }
                            // SAFETY: act rows have ip floats (ip/2 staged pairs); panel_len(ip).
                            unsafe {
                                match bf {
                                    _ if quantised => {}
                                    Some(b) => (b.dot)(
                                        &ptrs_bf16[..nr],
                                        ip,
                                        panel.as_ptr(),
                                        o.as_mut_ptr(),
                                    ),
                                    None => kern.panel_dot_raw(
                                        &ptrs[..nr],
                                        ip,
                                        panel.as_ptr(),
                                        o.as_mut_ptr(),
                                    ),
                                }
                            }
                            for i in 0..nr {
                                sink(r0 + i, p, &o[i * PANEL..(i + 1) * PANEL]);
                            }
                            r0 += nr;
                        }
                    }
                    PanelScratch::give_back(scratch);
                };
            let zero_columns = |cols: Range<usize>| {
                for t in 0..qlen {
                    // SAFETY: the calling task owns these columns of every token's partial row.
                    unsafe {
                        std::ptr::write_bytes(partial.get().add(t * h + cols.start), 0, cols.len())
                    };
                }
            };
            if total_rows * h <= self.rowwise_down_max {
                // Few rows (decode): tasks are (expert, run of panels), so each streams one
                // contiguous piece of an expert's down matrix; weighted rows go to `down_rows`,
                // then a column-parallel pass sums them per token.
                let group = DOWN_GROUP_PANELS.min(out_panels);
                let per_expert = out_panels.div_ceil(group);
                team.parallel_for(n_experts * per_expert, &|task| {
                    let (ei, g) = (task / per_expert, task % per_expert);
                    let panels = g * group..((g + 1) * group).min(out_panels);
                    down_panels(ei, panels, &|_, _| {}, &mut |row, p, vals| {
                        let w = routing.row_weight[row];
                        // SAFETY: (row, panel p) of down_rows is written by this task only.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(
                                down_rows.get().add(row * h + p * PANEL),
                                PANEL,
                            )
                        };
                        for (d, v) in dst.iter_mut().zip(vals) {
                            *d = w * v;
                        }
                    });
                });
                team.parallel_for(per_expert, &|g| {
                    let cols = g * group * PANEL..((g + 1) * group).min(out_panels) * PANEL;
                    zero_columns(cols.clone());
                    for row in 0..total_rows {
                        let t = routing.row_token[row] as usize;
                        // SAFETY: columns `cols` of token t's partial row belong to this task.
                        unsafe {
                            let dst = std::slice::from_raw_parts_mut(
                                partial.get().add(t * h + cols.start),
                                cols.len(),
                            );
                            let src = std::slice::from_raw_parts(
                                down_rows.get().add(row * h + cols.start),
                                cols.len(),
                            );
                            for (d, v) in dst.iter_mut().zip(src) {
                                *d += v;
                            }
                        }
                    }
                });
            } else {
                // Many rows (prefill): tasks own column blocks of the output, so the weighted
                // sum over experts accumulates without races; experts go outer so each
                // expert's act rows stay in cache across the block's panels.
                let per_task = out_panels.div_ceil(team.threads() * 4).max(1);
                let n_tasks = out_panels.div_ceil(per_task);
                team.parallel_for(n_tasks, &|task| {
                    let panels = task * per_task..((task + 1) * per_task).min(out_panels);
                    zero_columns(panels.start * PANEL..panels.end * PANEL);
                    // The sink adds to partial rows scattered by token: fetch a block's
                    // lines while its kernel runs, or every add stalls on a cache miss.
                    let fetch_partials = |rows: Range<usize>, p: usize| {
                        for row in rows {
                            let t = routing.row_token[row] as usize;
                            crate::kernels::prefetch::lines(
                                partial.get().wrapping_add(t * h + p * PANEL) as *const u8,
                                PANEL * std::mem::size_of::<f32>(),
                            );
                        }
                    };
                    for ei in 0..n_experts {
                        down_panels(ei, panels.clone(), &fetch_partials, &mut |row, p, vals| {
                            let t = routing.row_token[row] as usize;
                            let w = routing.row_weight[row];
                            // SAFETY: columns of panel p in token t's partial row: this task's.
                            let dst = unsafe {
                                std::slice::from_raw_parts_mut(
                                    partial.get().add(t * h + p * PANEL),
                                    PANEL,
                                )
                            };
                            for (d, v) in dst.iter_mut().zip(vals) {
                                *d += w * v;
                            }
                        });
                    }
                });
            }
            // 4. With one part, finish here: add the residual, convert to the output type.
            if single {
                team.parallel_for(qlen, &|t| {
                    // SAFETY: token t's rows of partial, residual and out belong to this task.
                    unsafe { finish_row(&scratch[..1], h, t, args, residual, out) };
                });
            }
        })?;
        if !single {
            // Sum the parts' partials (reading every node's memory once), add the residual.
            let merge = |t: usize| {
                // SAFETY: as in the single-part case.
                unsafe { finish_row(scratch, h, t, args, residual, out) };
            };
            if qlen * h <= 1 << 16 {
                (0..qlen).for_each(merge);
            } else {
                pool.parallel_for_all(qlen, &merge)?;
            }
        }
        Ok(())
    }
}

/// One thread's panel buffers (products, gate, up, activation of up to [`MAX_ROWS`] rows). The
/// kernels overwrite the rows they are given, so the buffers are zeroed once per thread rather
/// than once per task: a decode task streams about 64 KiB of weights, and clearing 16 KiB of
/// stack arrays each time cost several percent of it.
struct PanelScratch {
    acc: [i32; MAX_ROWS * PANEL],
    g: [f32; MAX_ROWS * PANEL],
    u: [f32; MAX_ROWS * PANEL],
    a: [f32; MAX_ROWS * PANEL],
}

thread_local! {
    static PANEL_SCRATCH: std::cell::Cell<Option<Box<PanelScratch>>> =
        const { std::cell::Cell::new(None) };
}

impl PanelScratch {
    /// This thread's buffers (new ones if they are out, e.g. a task inside a task).
    fn take() -> Box<PanelScratch> {
        PANEL_SCRATCH.take().unwrap_or_else(|| {
            Box::new(PanelScratch {
                acc: [0; MAX_ROWS * PANEL],
                g: [0.0; MAX_ROWS * PANEL],
                u: [0.0; MAX_ROWS * PANEL],
                a: [0.0; MAX_ROWS * PANEL],
            })
        })
    }

    fn give_back(scratch: Box<PanelScratch>) {
        PANEL_SCRATCH.set(Some(scratch));
    }
}

/// Row `i` of a panel's integer results to floats: `dst = (acc · w_scale) · a_scale` (the
/// same two roundings as the scalar reference), on whole arrays so it vectorises.
#[inline(always)]
fn scale_panel_row(acc: &[i32], w_scale: &[f32], a_scale: f32, i: usize, dst: &mut [f32]) {
    let acc: &[i32; PANEL] = acc[i * PANEL..(i + 1) * PANEL].try_into().unwrap();
    let w_scale: &[f32; PANEL] = w_scale.try_into().unwrap();
    let dst: &mut [f32; PANEL] = (&mut dst[i * PANEL..(i + 1) * PANEL]).try_into().unwrap();
    for j in 0..PANEL {
        dst[j] = (acc[j] as f32 * w_scale[j]) * a_scale;
    }
}

/// out[t] = Σ over parts of partial[t] + residual[t], converted to the output type.
///
/// # Safety
/// Each part's partial buffer has row `t` of `h` floats; `out`/`residual` rows `t` exist.
unsafe fn finish_row(
    parts: &[PartPtrs],
    h: usize,
    t: usize,
    args: &ForwardArgs,
    residual: SyncPtr<u8>,
    out: SyncPtr<u8>,
) {
    const STRIP: usize = 256;
    let mut acc = [0f32; STRIP];
    let mut res = [0f32; STRIP];
    let mut c0 = 0;
    while c0 < h {
        let n = STRIP.min(h - c0);
        // SAFETY: per the contract, all reads/writes are inside row t.
        unsafe {
            std::ptr::copy_nonoverlapping(
                parts[0].partial.get().add(t * h + c0),
                acc.as_mut_ptr(),
                n,
            );
            for p in &parts[1..] {
                let r = p.partial.get().add(t * h + c0);
                for (a, i) in acc[..n].iter_mut().zip(0..n) {
                    *a += *r.add(i);
                }
            }
            if !residual.0.is_null() {
                let rt = args.residual_type;
                row_to_f32(residual.0.add((t * h + c0) * rt.size()), rt, &mut res[..n]);
                for (a, r) in acc[..n].iter_mut().zip(&res[..n]) {
                    *a += r;
                }
            }
            row_from_f32(
                &acc[..n],
                out.0.add((t * h + c0) * args.out_type.size()),
                args.out_type,
            );
        }
        c0 += n;
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

mod llamafile;
pub use llamafile::GgmlTypes;

#[cfg(test)]
mod tests;
