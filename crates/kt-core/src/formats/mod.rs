//! Weight formats: how one method stores its experts and multiplies them.
//!
//! The MoE layer ([`crate::moe`]) knows no format by name. It owns the routing, the scratch
//! and the order of the phases; everything that depends on the bytes of the weights sits behind
//! [`ExpertFormat`]:
//!
//! 1. **layout and load**: the format allocates its experts for the layer's NUMA parts (one
//!    intermediate slice each) and packs or quantizes each `(part, expert, projection)` from an
//!    [`crate::expert::ExpertSource`] ([`ExpertFormat::pack`]), or reads files written for it
//!    ([`ExpertFormat::load_files`]);
//! 2. **prepare x**: each token's fp32 row may be turned into the format's activation bytes
//!    (bf16 pairs, biased int8 copies, ggml Q8 blocks) once per part;
//! 3. **gate/up panel**: 32 intermediate rows of gate and up against a block of token rows;
//! 4. **prepare act**: each SwiGLU row, like x;
//! 5. **down panel**: 32 output columns of down against a block of rows.
//!
//! Each format picks its kernels once, when the layer is built, from the [`KernelSet`] of one
//! ISA level. Adding a format is a folder here, a [`Method`] variant and a line in [`build`].
use crate::expert::{MoeConfig, Proj};
use crate::kernels::{KernelSet, AMX_MIN_ROWS, MAX_ROWS};
use crate::method::Method;
use crate::pack::PANEL;
use crate::pool::Pool;
use crate::{kt_bail, Result};
use std::any::Any;
use std::ops::Range;

pub mod bf16;
pub mod fp8;
pub mod ggml;
pub mod int4;
pub mod int8;
pub mod kgroup;

/// Files a format may read its experts from (besides a [`crate::expert::ExpertSource`]).
pub enum LayerFiles<'a> {
    /// The original's converted AMXINT8/AMXINT4 files of one layer.
    Converted(&'a crate::converted::ConvertedLayer),
    /// A GGUF model and the layer index whose `blk.{L}.ffn_*_exps` tensors to read.
    Gguf(&'a crate::gguf::GgufModel, usize),
    /// Gate, up and down stacked-expert tensors in GGUF's layout, already located (a
    /// caller's memory: the original's `MOE` class takes them by address).
    Ggml([crate::gguf::ExpertTensor<'a>; 3]),
}

/// Which matrix a block of rows is multiplied with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// gate and up (`k = H`).
    GateUp,
    /// down (`k` = the part's intermediate slice).
    Down,
}

/// Up to [`MAX_ROWS`] activation rows of one expert, as the forward hands them to a panel.
pub struct RowBlock<'a> {
    /// A key under which the prepared rows do not change ([`next_reuse_key`]): blocks with the
    /// same key and the same row addresses hold the same bytes, so a kernel may keep what it
    /// made of them (AMX's packed rows) for the next panel. None: no such promise.
    pub reuse: Option<u64>,
    /// Rows this expert has in the forward (formats choose their kernel path from it).
    pub expert_rows: usize,
    /// fp32 rows (`k` values each).
    pub f32_rows: &'a [*const f32],
    /// The same rows as prepared by the format (its bytes; dangling when it prepares none).
    pub prepared: &'a [*const u8],
    /// What the format's prepare returned for each row (e.g. its int8 scale).
    pub scales: &'a [f32],
    /// The panel the calling thread most likely multiplies next, on a block whose panel is
    /// already in cache (not the expert's first): the format may bring this block's slice
    /// of that panel's weights into L2 while its kernel multiplies ([`NextPanel`]).
    pub next: Option<NextPanel>,
    /// Whether this block's weights are likely in cache: a later block of the expert, or the
    /// first of an expert with several, whose panel the thread's previous task brought in
    /// through [`RowBlock::next`]. Kernels may then order their loads for the arithmetic
    /// rather than for the DRAM stream.
    pub warm: bool,
}

/// See [`RowBlock::next`]: slice `slice` of `slices` of panel `at`'s weights (the expert's
/// later blocks share the panel out between them).
#[derive(Debug, Clone, Copy)]
pub struct NextPanel {
    /// The panel (same stage as the call).
    pub at: PanelAt,
    /// This block's slice.
    pub slice: usize,
    /// How many slices the panel is cut into.
    pub slices: usize,
}

impl NextPanel {
    /// This slice of `len` bytes: its byte range.
    pub fn range(&self, len: usize) -> std::ops::Range<usize> {
        len * self.slice / self.slices..len * (self.slice + 1) / self.slices
    }
}

/// A fresh [`RowBlock::reuse`] key. The forward takes one per phase, after the phase before
/// finished writing the rows this phase reads.
pub fn next_reuse_key() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl RowBlock<'_> {
    /// Rows in the block.
    pub fn len(&self) -> usize {
        self.f32_rows.len()
    }

    /// True for an empty block.
    pub fn is_empty(&self) -> bool {
        self.f32_rows.is_empty()
    }
}

/// What [`with_rows_up64`] multiplies rows by: 2⁶⁴. Kernels that take codes as value · 2⁻¹²⁰
/// (E4M3 moved into a bf16 by two integer ops) keep every product far from fp32's denormals.
pub const ROWS_UP64: f32 = 18_446_744_073_709_551_616.0;

/// What those kernels multiply their scales by to undo both [`ROWS_UP64`] and the codes'
/// 2⁻¹²⁰: 2⁵⁶ (powers of two, so each sum is the unscaled one exactly scaled).
pub const SCALES_DOWN56: f32 = 72_057_594_037_927_936.0;

/// The packing layout tag of [`with_rows_up64`]'s rows ([`crate::kernels::row_cache`]).
const ROWS_UP64_LAYOUT: u64 = 3;

/// `f(rows, true)` with `rows` (each `k` floats) times [`ROWS_UP64`] (exact short of overflow),
/// packed once per reuse key and row set for every panel of the phase, not per panel; or
/// `f(rows.f32_rows, false)` for a block without a reuse key (the kernel scales as it goes).
/// The packed rows lie `k + 16` floats apart: at 8 KiB apart the rows' slices of a 128-input
/// block would share L1 sets.
pub(crate) fn with_rows_up64<R>(
    rows: &RowBlock,
    k: usize,
    f: impl FnOnce(&[*const f32], bool) -> R,
) -> R {
    use crate::kernels::row_cache::{with_packing, PackingKey};
    let Some(reuse) = rows.reuse else {
        return f(rows.f32_rows, false);
    };
    let n = rows.len();
    let stride = k + 16;
    let mut addrs = [std::ptr::null::<u8>(); MAX_ROWS];
    for (a, r) in addrs.iter_mut().zip(rows.f32_rows) {
        *a = r.cast::<u8>();
    }
    let key = PackingKey::new(reuse, [ROWS_UP64_LAYOUT, k as u64, 0], &addrs[..n]);
    let pack = |dst: &mut [u8]| {
        assert!(dst.as_ptr().cast::<f32>().is_aligned() && dst.len().is_multiple_of(4));
        // SAFETY: an aligned buffer of whole f32s (checked), any bits valid.
        let dst: &mut [f32] =
            unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast(), dst.len() / 4) };
        for (r, &row) in rows.f32_rows.iter().enumerate() {
            // SAFETY: the forward's rows hold k floats.
            let src = unsafe { std::slice::from_raw_parts(row, k) };
            for (d, s) in dst[r * stride..][..k].iter_mut().zip(src) {
                *d = s * ROWS_UP64;
            }
        }
    };
    with_packing(key, n * stride * 4, pack, |buf| {
        let mut a = [std::ptr::null::<f32>(); MAX_ROWS];
        for (r, p) in a.iter_mut().take(n).enumerate() {
            *p = buf[r * stride * 4..].as_ptr().cast::<f32>();
        }
        f(&a[..n], true)
    })
}

/// Which panel a call computes: 32 rows of the part's gate/up slice, or 32 output columns of
/// down, of the expert in physical `slot`.
#[derive(Debug, Clone, Copy)]
pub struct PanelAt {
    /// NUMA part.
    pub part: usize,
    /// Physical expert slot.
    pub slot: usize,
    /// Panel index (rows `32p..32p+32` of the slice, or output columns `32p..`).
    pub panel: usize,
}

impl PanelAt {
    /// The panel `i` places after this one, of the same part and expert (a run's `i`-th).
    pub fn after(self, i: usize) -> PanelAt {
        PanelAt {
            panel: self.panel + i,
            ..self
        }
    }
}

/// Per-thread buffers a panel call may use (integer accumulators of every row of a block).
pub struct PanelAcc {
    /// `MAX_ROWS × 32` integer results.
    pub acc: [i32; MAX_ROWS * PANEL],
}

/// The buffers of one GPU tensor-parallel rank that [`ExpertFormat::write_gpu_rank`] fills.
#[derive(Debug, Clone, Copy)]
pub struct GpuRankDst {
    /// gate‖up: the rank's slice of gate's rows, then up's.
    pub w13: *mut u8,
    /// Their scales (empty for BF16).
    pub w13_scale: *mut u8,
    /// down: every output row, cut to the rank's slice of the intermediate columns.
    pub w2: *mut u8,
    /// Its scales.
    pub w2_scale: *mut u8,
}

// SAFETY: plain addresses; `write_gpu_rank`'s contract gives each rank's buffers to one task.
unsafe impl Send for GpuRankDst {}
// SAFETY: as above.
unsafe impl Sync for GpuRankDst {}

/// A share of one GPU rank's write ([`ExpertFormat::write_gpu_rank`]): the w13 and w2 rows of
/// every `count`-th 32-row panel from panel `index`, so that several threads fill one rank
/// (one GPU rank, the usual case, would otherwise be written by one thread).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowShare {
    /// This share's first panel.
    pub index: usize,
    /// Shares of the rank.
    pub count: usize,
}

impl RowShare {
    /// The whole rank.
    pub const WHOLE: RowShare = RowShare { index: 0, count: 1 };

    /// Whether buffer row `row` (of w13's `2·ir` rows or w2's `H`) is this share's to write.
    pub fn has(self, row: usize) -> bool {
        (row / PANEL) % self.count == self.index
    }
}

/// The part holding intermediate row `row` of a layer split into `ranges`, and the row's index
/// in it.
pub(crate) fn locate(ranges: &[Range<usize>], row: usize) -> (usize, usize) {
    let part = ranges
        .iter()
        .position(|r| r.contains(&row))
        .expect("row inside the layer");
    (part, row - ranges[part].start)
}

/// [`ExpertFormat::gate_up_run`] panel by panel through [`ExpertFormat::gate_up_panel`]: the
/// default, and what a format's own run falls back to for rows it has no faster path for.
///
/// # Safety
/// As [`ExpertFormat::gate_up_run`].
pub(crate) unsafe fn gate_up_panel_by_panel<F: ExpertFormat + ?Sized>(
    format: &F,
    at: PanelAt,
    n: usize,
    rows: &RowBlock,
    scratch: &mut PanelAcc,
    g: &mut [f32],
    u: &mut [f32],
) {
    let m = rows.len() * crate::pack::PANEL;
    for i in 0..n {
        let at = at.after(i);
        let (g, u) = (&mut g[i * m..(i + 1) * m], &mut u[i * m..(i + 1) * m]);
        // SAFETY: the caller's contract, panel by panel.
        unsafe { format.gate_up_panel(at, rows, scratch, g, u) };
    }
}

/// One method's experts of one layer: storage in every NUMA part and the kernels that read it.
///
/// Concurrency: the forward calls the `&self` methods from many threads at once, each with its
/// own output slices. [`ExpertFormat::pack`] writes through `&self` into storage that each
/// `(part, slot, proj)` owns alone, hence `unsafe`.
pub trait ExpertFormat: Send + Sync + Any {
    /// The method this format computes.
    fn method(&self) -> Method;

    /// Name of the kernels in use, as `MoeLayer.kernel` reports it.
    fn kernel_name(&self) -> String;

    /// Intermediate slice of every NUMA part.
    fn part_ranges(&self) -> &[Range<usize>];

    /// Bytes of one prepared x row of `part` (0: the format reads the fp32 rows only).
    fn x_stride(&self, part: usize) -> usize;

    /// Bytes of one prepared SwiGLU row of `part` (0: fp32 only).
    fn act_stride(&self, part: usize) -> usize;

    /// Whether x rows are prepared in a forward whose largest expert has `max_rows` rows.
    fn prepares_x(&self, max_rows: usize) -> bool;

    /// Whether SwiGLU rows are prepared in such a forward.
    fn prepares_act(&self, max_rows: usize) -> bool;

    /// Whether the SwiGLU preparation is element-wise, so each 32-value panel is prepared as
    /// it is made, while in cache ([`ExpertFormat::prepare_act_panel`]), instead of in a phase
    /// of its own over whole rows ([`ExpertFormat::prepare_act`], for scales that span a row).
    fn prepares_act_per_panel(&self) -> bool {
        false
    }

    /// Prepare 32 SwiGLU values (one panel of one row) of an expert with `expert_rows` rows
    /// into `out` (those values' bytes of the prepared row); a format prepares only the rows
    /// its kernels will read prepared. Only called when
    /// [`ExpertFormat::prepares_act_per_panel`] says so.
    fn prepare_act_panel(&self, part: usize, expert_rows: usize, act: &[f32], out: &mut [u8]) {
        let _ = (part, expert_rows, act, out);
        unreachable!("{} prepares SwiGLU rows whole", self.method())
    }

    /// Prepare one token's x (`H` values) into `out` ([`ExpertFormat::x_stride`] bytes);
    /// returns the row's scale (formats without one return 1).
    fn prepare_x(&self, part: usize, x: &[f32], out: &mut [u8]) -> f32;

    /// Prepare one SwiGLU row (the part's `ip` values) into `out`; returns its scale.
    fn prepare_act(&self, part: usize, act: &[f32], out: &mut [u8]) -> f32;

    /// Rows per kernel call for an expert with `expert_rows` rows at `stage`.
    fn block_rows(&self, part: usize, expert_rows: usize, stage: Stage) -> usize;

    /// `g`, `u` (32 values per row, row i at `32·i`): intermediate rows `32p..32p+32` of the
    /// part's slice of expert `at.slot`, against `rows` (`k = H`).
    ///
    /// # Safety
    /// `at` names an existing part, slot (`< num_experts`) and panel; the three slices of
    /// `rows` have one entry per row, at most [`ExpertFormat::block_rows`] of them for
    /// `rows.expert_rows`; each f32 row points to `H` readable values and, when the forward
    /// prepared x ([`ExpertFormat::prepares_x`]), each prepared row to
    /// [`ExpertFormat::x_stride`] readable bytes made by [`ExpertFormat::prepare_x`] (else it
    /// may dangle); `g` and `u` hold 32 values per row.
    unsafe fn gate_up_panel(
        &self,
        at: PanelAt,
        rows: &RowBlock,
        scratch: &mut PanelAcc,
        g: &mut [f32],
        u: &mut [f32],
    );

    /// [`ExpertFormat::gate_up_panel`] for `n` panels from `at.panel` on, one block of rows
    /// (`m` = 32 values per row): panel `at.panel + i` goes to `g[i·m..]` and `u[i·m..]`. A
    /// decode task takes such a run so that a core reads long runs of one matrix; formats whose
    /// gate and up matrices lie apart read all of the run's gate panels first, then its up
    /// panels (the default goes panel by panel).
    ///
    /// # Safety
    /// As [`ExpertFormat::gate_up_panel`] for each of the `n` panels, which all exist; `g` and
    /// `u` hold `n·m` values.
    unsafe fn gate_up_run(
        &self,
        at: PanelAt,
        n: usize,
        rows: &RowBlock,
        scratch: &mut PanelAcc,
        g: &mut [f32],
        u: &mut [f32],
    ) {
        // SAFETY: the caller's contract.
        unsafe { gate_up_panel_by_panel(self, at, n, rows, scratch, g, u) }
    }

    /// Where down panel `at`'s weight bytes lie, where the format keeps them in one run (the
    /// forward prefetches the next expert's first panel while the current one computes):
    /// `(start, bytes)`, or `None` (the default: no such prefetch). `at` must name an
    /// existing part, slot and panel.
    fn down_panel_bytes(&self, at: PanelAt) -> Option<(*const u8, usize)> {
        let _ = at;
        None
    }

    /// `o` (32 values per row): output columns `32p..32p+32` of expert `at.slot`'s down slice
    /// against the SwiGLU rows `rows`.
    ///
    /// # Safety
    /// As [`ExpertFormat::gate_up_panel`], with rows of the part's `ip` SwiGLU values and
    /// prepared rows of [`ExpertFormat::act_stride`] bytes (made per row or per panel, see
    /// [`ExpertFormat::prepares_act_per_panel`]); `o` holds 32 values per row.
    unsafe fn down_panel(
        &self,
        at: PanelAt,
        rows: &RowBlock,
        scratch: &mut PanelAcc,
        o: &mut [f32],
    );

    /// [`ExpertFormat::down_panel`] for `n` panels from `at.panel` on, one block of rows (`m`
    /// = 32 values per row): panel `at.panel + i` goes to `o[i·m..]`. A decode's down phase
    /// hands its panels over in such runs (the rows gathered once, a run's values summed at
    /// once); the default goes panel by panel, a format may skip its per-panel choices.
    ///
    /// # Safety
    /// As [`ExpertFormat::down_panel`] for each of the `n` panels, which all exist; `o` holds
    /// `n·m` values.
    unsafe fn down_run(
        &self,
        at: PanelAt,
        n: usize,
        rows: &RowBlock,
        scratch: &mut PanelAcc,
        o: &mut [f32],
    ) {
        let m = rows.len() * crate::pack::PANEL;
        for i in 0..n {
            let at = at.after(i);
            // SAFETY: the caller's contract, panel by panel.
            unsafe { self.down_panel(at, rows, scratch, &mut o[i * m..(i + 1) * m]) };
        }
    }

    /// Whether experts come from an [`crate::expert::ExpertSource`] ([`ExpertFormat::pack`]).
    fn packs_from_source(&self) -> bool;

    /// Pack (or quantize) `view`, the part's slice of physical `slot`'s projection `proj`.
    ///
    /// # Safety
    /// `part` and `slot` (`< num_experts`) exist; `view` has exactly the shape of that part's
    /// projection (gate/up: the part's `ip` rows × `H`; down: `H` × `ip`) and its memory is
    /// alive; no other call writes the same `(part, slot, proj)` at the same time, and no
    /// forward runs during loading (the layer holds `&mut` while it calls this from its pool).
    unsafe fn pack(
        &self,
        part: usize,
        slot: usize,
        proj: Proj,
        view: &crate::pack::MatrixView,
    ) -> Result<()>;

    /// Adapt the layout to the checkpoint about to be packed, given the first expert's gate
    /// and down views (e.g. take the group size its scales imply). Called once per load,
    /// before any [`ExpertFormat::pack`].
    fn adapt_to_source(
        &mut self,
        config: &MoeConfig,
        gate: &crate::pack::MatrixView,
        down: &crate::pack::MatrixView,
    ) -> Result<()> {
        let _ = (config, gate, down);
        Ok(())
    }

    /// Load every physical slot from files (`logical[slot]` is the file's expert). Formats
    /// that cannot read `files` refuse them.
    fn load_files(
        &mut self,
        pool: &Pool,
        config: &MoeConfig,
        files: &LayerFiles,
        map: Option<&[i64]>,
    ) -> Result<()> {
        let _ = (pool, files, map);
        kt_bail!(
            Invalid,
            "layer {}: {} weights are not read from these files",
            config.layer_idx,
            self.method()
        )
    }

    /// Bytes that [`ExpertFormat::write_gpu_rank`] writes into each of a rank's buffers (w13,
    /// w13 scales, w2, w2 scales) for one expert at `gpu_tp` ranks; refuses a split the method's
    /// blocks do not allow, and methods without a GPU layout.
    fn gpu_rank_bytes(&self, gpu_tp: usize) -> Result<[usize; 4]> {
        let _ = gpu_tp;
        kt_bail!(
            Unsupported,
            "write_weight_scale_to_buffer is not implemented for {} weights",
            self.method()
        )
    }

    /// Write `share`'s rows of physical `slot`'s weights and scales for GPU tensor-parallel
    /// rank `rank` of `gpu_tp` into `dst`, in the bytes that method's GPU kernels read (the
    /// original's `write_weight_scale_to_buffer`). A row's scales go with the row (a block
    /// scale with the block's first row); other shares' bytes are not touched.
    ///
    /// # Safety
    /// `slot < num_experts`, `rank < gpu_tp`, [`ExpertFormat::gpu_rank_bytes`] succeeded for
    /// `gpu_tp`, and each buffer of `dst` has that many writable bytes that nothing but other
    /// shares' calls reads or writes meanwhile.
    unsafe fn write_gpu_rank(
        &self,
        slot: usize,
        gpu_tp: usize,
        rank: usize,
        share: RowShare,
        dst: &GpuRankDst,
    ) -> Result<()> {
        let _ = (slot, rank, share, dst);
        self.gpu_rank_bytes(gpu_tp).map(|_| ())
    }

    /// The format as [`Any`], for callers that need its own API (e.g. the converter reading
    /// quantized bytes back).
    fn as_any(&self) -> &dyn Any;
}

/// Builds one method's experts for a layer (see [`build`]).
type Builder = fn(&MoeConfig, usize, KernelSet) -> Result<Box<dyn ExpertFormat>>;

/// One method's entry in the [`REGISTRY`].
struct Entry {
    method: Method,
    build: Builder,
    /// Rows per expert from which AMX tiles take an expert (unless `KT_KERNEL_AMX_MIN_ROWS`
    /// says otherwise): where the tiles start to beat the format's own vector kernels, which
    /// depends on what those cost. Measured with `benches/kernel_switch.py` on an Emerald
    /// Rapids VM (`benches/records/2026-11-26-kernel-switch.md`); the only AMX machines seen.
    amx_min_rows: usize,
}

/// The registry: every method this build computes and how its experts are built. A new format
/// is one line here (and its `pub mod` above).
const REGISTRY: &[Entry] = &[
    entry(Method::Bf16, bf16::experts, AMX_MIN_ROWS),
    entry(Method::AmxInt8, int8::experts, AMX_MIN_ROWS),
    entry(Method::AmxInt4, int4::experts, 8),
    entry(Method::Llamafile, ggml::experts, 0), // no tile kernels
    // Formats whose tiles need each panel decoded to bf16 first gain from them later: from 8
    // rows (FP8, MXFP8, the 4-bit group-scaled methods, whose many-row integer kernels keep
    // up until then), RAWINT4 (an 8-bit many-row kernel) from 16. FP8_PERCHANNEL measured
    // best at 4.
    entry(Method::Fp8, fp8::experts, 8),
    entry(
        Method::Fp8PerChannel,
        fp8::experts_per_channel,
        AMX_MIN_ROWS,
    ),
    entry(Method::RawInt4, kgroup::rawint4, 16),
    entry(Method::GptqInt4, kgroup::gptq_int4, 8),
    entry(Method::MxFp4, kgroup::mxfp4, 8),
    entry(Method::NvFp4, kgroup::nvfp4, 8),
    entry(Method::MxFp8, kgroup::mxfp8, 8),
];

const fn entry(method: Method, build: Builder, amx_min_rows: usize) -> Entry {
    Entry {
        method,
        build,
        amx_min_rows,
    }
}

fn entry_of(method: Method) -> Option<&'static Entry> {
    REGISTRY.iter().find(|e| e.method == method)
}

/// Rows per expert from which `method`'s experts take the AMX tiles by default (see
/// [`Entry::amx_min_rows`]); `KT_KERNEL_AMX_MIN_ROWS` overrides it for every method.
pub fn amx_min_rows_default(method: Method) -> usize {
    entry_of(method).map_or(AMX_MIN_ROWS, |e| e.amx_min_rows)
}

/// The methods [`build`] knows, in [`Method::ALL`] order.
pub fn implemented() -> Vec<Method> {
    Method::ALL
        .into_iter()
        .filter(|&m| is_registered(m))
        .collect()
}

/// Whether [`build`] knows `method`.
pub fn is_registered(method: Method) -> bool {
    entry_of(method).is_some()
}

/// Fails with `Unsupported` (NotImplementedError in Python) for a method this build
/// recognises but does not compute.
pub fn ensure_registered(method: Method) -> Result<()> {
    if is_registered(method) {
        return Ok(());
    }
    let names: Vec<_> = implemented().iter().map(|m| m.name()).collect();
    kt_bail!(
        Unsupported,
        "method {:?} is recognised but not built into this kt_kernel yet (available: {})",
        method.name(),
        names.join(", ")
    )
}

/// The format of `method` for a layer of `config` split into `parts` NUMA parts, with kernels
/// from `kernels`.
pub fn build(
    method: Method,
    config: &MoeConfig,
    parts: usize,
    kernels: KernelSet,
) -> Result<Box<dyn ExpertFormat>> {
    ensure_registered(method)?;
    prefetch_distance()?;
    // Settings read inside the kernels, refused here rather than ignored there.
    crate::kernels::prefetch::panel_setting()?;
    crate::isa::fp8_subnormal_setting()?;
    let e = entry_of(method).expect("registered");
    (e.build)(config, parts, kernels.with_amx_rows_default(e.amx_min_rows))
}

/// The prefetch distance the byte-group kernels use, measured once per process with the
/// AMXINT4 kernel (or `KT_KERNEL_PREFETCH`), after AMXINT8's own, measured with its kernel;
/// see [`crate::kernels::prefetch`]. The group-scaled methods choose theirs when their first
/// layer is built.
pub fn prefetch_distance() -> Result<usize> {
    use crate::kernels::{calibrate::ensure_prefetch_chosen, prefetch::Family};
    ensure_prefetch_chosen(Family::Int8Groups, int8::kernels::calibration_workload)?;
    ensure_prefetch_chosen(Family::ByteGroups, int4::kernels::calibration_workload)
}

/// AMXINT8's prefetch distance (chosen by [`prefetch_distance`]).
pub fn prefetch_distance_int8() -> Result<usize> {
    use crate::kernels::{calibrate::ensure_prefetch_chosen, prefetch::Family};
    ensure_prefetch_chosen(Family::Int8Groups, int8::kernels::calibration_workload)
}

/// The kernels a caller names ([`KernelSet::from_choice`]), with the prefetch distance chosen
/// first: the bf16-vs-FMA calibration inside [`KernelSet::best`] times kernels that prefetch.
pub fn kernels_for(choice: Option<&str>) -> Result<KernelSet> {
    prefetch_distance()?;
    KernelSet::from_choice(choice)
}

/// Check that `config` splits into `parts` slices of whole `unit`s (and `H` is a multiple of
/// `unit`), then return the slices.
pub fn split_in_units(
    config: &MoeConfig,
    parts: usize,
    unit: usize,
    method: Method,
) -> Result<Vec<Range<usize>>> {
    let l = config.layer_idx;
    crate::kt_ensure!(
        config.hidden.is_multiple_of(unit) && config.intermediate.is_multiple_of(unit),
        Invalid,
        "layer {l}: {method} weights need hidden_size ({}) and moe_intermediate_size ({}) to be \
         multiples of {unit}",
        config.hidden,
        config.intermediate
    );
    config.check_blocks(parts, unit)?;
    Ok(config.part_ranges_in_units(parts, unit))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn implemented_methods_are_the_registered_formats() {
        let names: Vec<_> = implemented().iter().map(|m| m.name()).collect();
        assert_eq!(
            names,
            [
                "AMXINT4",
                "AMXINT8",
                "RAWINT4",
                "FP8",
                "BF16",
                "FP8_PERCHANNEL",
                "GPTQ_INT4",
                "MXFP4",
                "NVFP4",
                "MXFP8",
                "LLAMAFILE"
            ]
        );
        let e = ensure_registered(Method::SyclGptqInt4).unwrap_err();
        assert!(matches!(e, crate::Error::Unsupported(_)), "{e}");
    }
}
