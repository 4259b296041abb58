//! GGUF experts (method LLAMAFILE): the file's ggml blocks, copied once into each NUMA part and
//! multiplied with [`DotKernel`]s against activations quantized to each type's format.
//!
//! Memory of one part (its intermediate slice `r0..r1`, `ip = r1 − r0` rows):
//! - `gate_up`: per expert, per 32-row panel `p` of the slice: the 32 gate rows, then the 32 up
//!   rows (each `H` values in the gate/up type), so one gate/up task streams one contiguous run;
//! - `down`: per expert, its `H` rows, each cut to the part's columns `r0..r1` — a byte range of
//!   the file's row, which exists because `r0` and `r1` are multiples of the down type's block.
//!
//! Split: whole 256-value blocks (QK_K) as in the original whenever `I` allows it (`I % 256 ==
//! 0` and a block per part); otherwise the smallest unit the down type allows (its block and
//! its activation block, at least one 32-row panel), so e.g. Q8_0 layers with `I = 1408` run.
//!
//! Activations: each token's `x` is quantized once per part to the gate/up type's activation
//! format, each SwiGLU output row once to the down type's (they may differ: Q4_K gate/up with
//! Q6_K or Q8_0 down).
use super::{ExpertFormat, LayerFiles, PanelAcc, PanelAt, RowBlock, Stage};
use crate::error::FirstError;
use crate::expert::{MoeConfig, Proj};
use crate::ggml::{x8, DotKernel, GgmlType};
use crate::gguf::{ExpertProj, ExpertTensor, GgufModel};
use crate::isa::Level;
use crate::kernels::{KernelSet, MAX_ROWS};
use crate::method::Method;
use crate::pack::{AlignedBuf, MatrixView, PANEL};
use crate::pool::{Pool, Team};
use crate::sync_ptr::SyncPtr;
use crate::{kt_bail, kt_ensure, Result};
use std::any::Any;
use std::ops::Range;

/// Values per K super-block: the original's split unit.
const QK_K: usize = 256;

/// The ggml types of a GGUF layer's experts (gate and up share one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgmlTypes {
    /// Type of `ffn_gate_exps` and `ffn_up_exps`.
    pub gate_up: GgmlType,
    /// Type of `ffn_down_exps`.
    pub down: GgmlType,
}

/// How a loaded GGUF layer computes (fixed by the file's types at load).
#[derive(Debug, Clone, Copy)]
struct GgmlPlan {
    pub types: GgmlTypes,
    /// Dot kernel of the gate/up rows (k = H).
    pub gate_up: DotKernel,
    /// Dot kernel of the down rows (k = the part's slice).
    pub down: DotKernel,
    /// H.
    pub hidden: usize,
    /// Bytes of one gate/up row (H values) in memory: the file's blocks, or an eighth of an
    /// interleaved group when the kernel reads the x8 layout (`ggml::x8`).
    pub row_bytes: usize,
    /// Bytes of one token's x in the gate/up activation format.
    pub x_bytes: usize,
    /// Bytes of one token's quantized x row in the workspace: `x_bytes`, then the row's
    /// [`DotKernel::x8_sums`] for the gate/up kernel (made once per token, read by every panel).
    pub x_stride: usize,
}

/// One part's GGUF experts (layout in the module docs).
struct GgmlPart {
    /// The part's intermediate rows (`ip`).
    pub rows: usize,
    pub gate_up: AlignedBuf<u8>,
    pub down: AlignedBuf<u8>,
    /// Bytes of one down row's slice (`ip` values of the down type) in memory (x8 as above).
    pub down_row_bytes: usize,
    /// Bytes of one SwiGLU row (`ip` values) in the down activation format.
    pub act_bytes: usize,
    /// Bytes of one quantized SwiGLU row in the workspace: `act_bytes`, then its x8 sums.
    pub act_stride: usize,
}

impl GgmlPlan {
    /// Quantize `x` (one row) to the gate/up activation format, followed by its x8 sums.
    ///
    /// # Panics
    /// If `out` is not [`GgmlPlan::x_stride`] long (the workspace plans it).
    pub fn quantize_x(&self, x: &[f32], out: &mut [u8]) {
        quantize_row(&self.gate_up, self.x_bytes, x, out);
    }

    /// Quantize one SwiGLU row to the down activation format, followed by its x8 sums
    /// (`out` is [`GgmlPart::act_stride`] long).
    pub fn quantize_act(&self, part: &GgmlPart, act: &[f32], out: &mut [u8]) {
        quantize_row(&self.down, part.act_bytes, act, out);
    }

    /// `g`, `u` (32 values per x row, row i at `32·i`): panel `p` of expert `e` against the
    /// quantized x rows `xs` (one row streams the panel; several share each weight row).
    pub fn gate_up_panel(
        &self,
        part: &GgmlPart,
        e: usize,
        p: usize,
        xs: &[&[u8]],
        g: &mut [f32],
        u: &mut [f32],
    ) {
        let (h, run) = (self.hidden, PANEL * self.row_bytes);
        let at = (e * (part.rows / PANEL) + p) * 2 * run;
        let gu = &part.gate_up.as_slice()[at..at + 2 * run];
        let (rows, sums) = split_rows(xs, self.x_bytes);
        let (xs, sums) = (&rows[..xs.len()], &sums[..xs.len()]);
        if self.gate_up.has_x8() {
            self.gate_up
                .dot_x8_presummed(h, &gu[..run], xs, sums, g, PANEL);
            self.gate_up
                .dot_x8_presummed(h, &gu[run..], xs, sums, u, PANEL);
        } else if let [x] = xs {
            self.gate_up.dot_rows(h, &gu[..run], x, &mut g[..PANEL]);
            self.gate_up.dot_rows(h, &gu[run..], x, &mut u[..PANEL]);
        } else {
            self.gate_up.dot_many(h, &gu[..run], xs, g, PANEL);
            self.gate_up.dot_many(h, &gu[run..], xs, u, PANEL);
        }
    }

    /// The bytes of down rows `32p..32p+32` of expert `e` in `part`.
    fn down_rows<'a>(&self, part: &'a GgmlPart, e: usize, p: usize) -> &'a [u8] {
        let rb = part.down_row_bytes;
        let at = (e * self.hidden + p * PANEL) * rb;
        &part.down.as_slice()[at..at + PANEL * rb]
    }

    /// `o` (32 values per act row, row i at `32·i`): down rows `32p..32p+32` of expert `e`
    /// against the quantized act rows `acts`.
    pub fn down_panel(&self, part: &GgmlPart, e: usize, p: usize, acts: &[&[u8]], o: &mut [f32]) {
        let rows = self.down_rows(part, e, p);
        let (act_rows, sums) = split_rows(acts, part.act_bytes);
        let (acts, sums) = (&act_rows[..acts.len()], &sums[..acts.len()]);
        if self.down.has_x8() {
            self.down
                .dot_x8_presummed(part.rows, rows, acts, sums, o, PANEL);
        } else if let [act] = acts {
            self.down.dot_rows(part.rows, rows, act, &mut o[..PANEL]);
        } else {
            self.down.dot_many(part.rows, rows, acts, o, PANEL);
        }
    }
}

/// Where a workspace row's x8 sums start after `bytes` activation bytes: the next multiple of
/// 16, so they are aligned whatever the block size (Q8_0's 34-byte blocks).
fn sums_offset(bytes: usize) -> usize {
    bytes.next_multiple_of(16)
}

/// The sums part of `tail`, what follows a row's `bytes` activation bytes (empty without sums).
fn sums_in(tail: &[u8], bytes: usize) -> std::ops::Range<usize> {
    (sums_offset(bytes) - bytes).min(tail.len())..tail.len()
}

/// Quantize `x` for `kernel` into `out`: `bytes` of activation blocks, then (from
/// [`sums_offset`]) the row's x8 sums.
fn quantize_row(kernel: &DotKernel, bytes: usize, x: &[f32], out: &mut [u8]) {
    let (head, tail) = out.split_at_mut(bytes);
    if let Err(e) = crate::ggml::quantize_activation_into(kernel.activation_format(), x, head) {
        panic!("activation scratch does not fit the plan: {e}");
    }
    let sums = sums_in(tail, bytes);
    kernel.x8_sums(x.len(), head, as_sums_mut(&mut tail[sums]));
}

/// Bytes of a workspace row of `bytes` activation bytes plus `kernel`'s x8 sums for `k` inputs.
fn row_stride(kernel: &DotKernel, bytes: usize, k: usize) -> usize {
    match kernel.x8_sums_per_row(k) {
        0 => bytes,
        n => sums_offset(bytes) + n * std::mem::size_of::<[i32; 4]>(),
    }
}

/// Workspace rows (see [`quantize_row`]) as their activation blocks (`bytes` each) and sums.
fn split_rows<'a>(
    rows: &[&'a [u8]],
    bytes: usize,
) -> ([&'a [u8]; MAX_ROWS], [&'a [[i32; 4]]; MAX_ROWS]) {
    let mut blocks = [&[][..]; MAX_ROWS];
    let mut sums = [&[][..]; MAX_ROWS];
    for ((row, b), s) in rows.iter().zip(&mut blocks).zip(&mut sums) {
        let (head, tail) = row.split_at(bytes);
        *b = head;
        *s = as_sums(&tail[sums_in(tail, bytes)]);
    }
    (blocks, sums)
}

/// A row's sums bytes as entries (activation rows are 4-byte multiples in 64-byte-aligned
/// workspace buffers, so the sums are aligned; checked). Rows without sums may be unaligned.
fn as_sums(bytes: &[u8]) -> &[[i32; 4]] {
    if bytes.is_empty() {
        return &[];
    }
    check_sums(bytes.as_ptr(), bytes.len());
    // SAFETY: checked aligned and a whole number of entries; any bits are valid i32 values.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), bytes.len() / 16) }
}

/// [`as_sums`] for writing.
fn as_sums_mut(bytes: &mut [u8]) -> &mut [[i32; 4]] {
    if bytes.is_empty() {
        return &mut [];
    }
    check_sums(bytes.as_ptr(), bytes.len());
    // SAFETY: as in `as_sums`; the borrow is exclusive.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast(), bytes.len() / 16) }
}

fn check_sums(at: *const u8, len: usize) {
    assert!(
        len.is_multiple_of(16) && at.align_offset(4) == 0,
        "misaligned x8 sums"
    );
}

/// Split unit of the intermediate dimension for `parts` parts with down type `down` (see the
/// module docs); fails if `I` cannot be cut into whole blocks of the down type per part.
fn split_unit(config: &MoeConfig, parts: usize, down: GgmlType, name: &str) -> Result<usize> {
    let i = config.intermediate;
    if i.is_multiple_of(QK_K) && i / QK_K >= parts {
        return Ok(QK_K);
    }
    let unit = down.k_multiple()?.max(PANEL);
    kt_ensure!(
        i.is_multiple_of(unit) && i / unit >= parts,
        Invalid,
        "layer {}: {name} is {down}, so each of the threadpool_count={parts} NUMA parts needs whole \
         blocks of {unit} intermediate values; moe_intermediate_size={i} does not split that way",
        config.layer_idx
    );
    Ok(unit)
}

/// The three expert tensors of `layer`, checked against `config` (types, dims, expert count).
fn layer_tensors<'m>(
    model: &'m GgufModel,
    layer: usize,
    config: &MoeConfig,
) -> Result<[ExpertTensor<'m>; 3]> {
    let t = [
        model.layer_experts(layer, ExpertProj::Gate)?,
        model.layer_experts(layer, ExpertProj::Up)?,
        model.layer_experts(layer, ExpertProj::Down)?,
    ];
    check_tensors(t, config)
}

/// `t` (gate, up, down) checked against the layer: supported ggml types, gate and up sharing
/// one, the layer's shapes, one expert count.
fn check_tensors<'m>(
    t: [ExpertTensor<'m>; 3],
    config: &MoeConfig,
) -> Result<[ExpertTensor<'m>; 3]> {
    for x in &t {
        let ty = x.ggml_type();
        if !ty.is_supported() {
            let names: Vec<_> = crate::ggml::SUPPORTED_TYPES
                .iter()
                .map(|t| t.name())
                .collect();
            kt_bail!(
                Unsupported,
                "tensor {} is {ty} (ggml type {}), which LLAMAFILE cannot compute here; supported: {}",
                x.name(),
                ty.id(),
                names.join(", ")
            );
        }
    }
    kt_ensure!(
        t[0].ggml_type() == t[1].ggml_type(),
        Unsupported,
        "tensors {} ({}) and {} ({}) must share one ggml type",
        t[0].name(),
        t[0].ggml_type(),
        t[1].name(),
        t[1].ggml_type()
    );
    let (h, i) = (config.hidden, config.intermediate);
    let l = config.layer_idx;
    for (x, (k, n, what)) in t.iter().zip([
        (h, i, "[hidden_size, moe_intermediate_size, experts]"),
        (h, i, "[hidden_size, moe_intermediate_size, experts]"),
        (i, h, "[moe_intermediate_size, hidden_size, experts]"),
    ]) {
        kt_ensure!(
            x.k() == k && x.n() == n,
            Invalid,
            "layer {l}: tensor {} has dims {:?}; expected {what} = [{k}, {n}, E] for \
             hidden_size={h}, moe_intermediate_size={i}",
            x.name(),
            x.info().dims
        );
    }
    kt_ensure!(
        t[0].experts() == t[1].experts() && t[1].experts() == t[2].experts(),
        Format,
        "layer {l}: the expert tensors hold different expert counts: {} {}, {} {}, {} {}",
        t[0].name(),
        t[0].experts(),
        t[1].name(),
        t[1].experts(),
        t[2].name(),
        t[2].experts()
    );
    let multiple = t[0].ggml_type().k_multiple()?;
    kt_ensure!(
        h.is_multiple_of(multiple),
        Invalid,
        "layer {l}: {} is {} whose dot products need hidden_size to be a multiple of {multiple}, \
         got {h}",
        t[0].name(),
        t[0].ggml_type()
    );
    Ok(t)
}

/// The registry's builder ([`super::build`]).
pub fn experts(
    config: &MoeConfig,
    parts: usize,
    kernels: KernelSet,
) -> Result<Box<dyn ExpertFormat>> {
    prefetch_distance()?;
    Ok(Box::new(GgmlExperts::new(config, parts, kernels)?))
}

/// The prefetch distance of the GGUF block kernels, measured once per process (or
/// `KT_KERNEL_PREFETCH`); see [`crate::kernels::prefetch`].
pub fn prefetch_distance() -> Result<usize> {
    crate::kernels::calibrate::ensure_prefetch_chosen(
        crate::kernels::prefetch::Family::GgufBlocks,
        calibration_workload,
    )
}

/// The GGUF family's calibration workload ([`crate::kernels::calibrate::Workload`]): the bytes
/// as Q8_0 x8 groups of 2048 inputs, in panels of four groups (32 rows) alternating between
/// `gate` and `up`, each against one activation row, as a decode calls the kernel.
pub fn calibration_workload(level: Level, gate: &[u8], up: &[u8]) {
    const K: usize = 2048;
    let ty = GgmlType::Q8_0;
    let Ok(kernel) = DotKernel::for_level(ty, level) else {
        return;
    };
    if !kernel.has_x8() {
        return;
    }
    let Ok(act) = crate::ggml::quantize_activation(kernel.activation_format(), &[0.5; K]) else {
        return;
    };
    let mut sums = vec![[0i32; 4]; kernel.x8_sums_per_row(K)];
    kernel.x8_sums(K, &act, &mut sums);
    let panel = 4 * x8::group_bytes(ty, K);
    let mut out = [0f32; 4 * x8::GROUP];
    for (g, u) in gate.chunks_exact(panel).zip(up.chunks_exact(panel)) {
        for part in [g, u] {
            kernel.dot_x8_presummed(K, part, &[&act], &[&sums], &mut out, 4 * x8::GROUP);
            std::hint::black_box(&mut out);
        }
    }
}

/// The GGUF experts of one layer: nothing until [`GgmlExperts::load_gguf`] reads a file, which
/// decides the types, the kernels and the split of `I`.
pub struct GgmlExperts {
    level: Level,
    layer_idx: usize,
    ranges: Vec<Range<usize>>,
    plan: Option<GgmlPlan>,
    parts: Vec<GgmlPart>,
}

impl GgmlExperts {
    /// An empty layer; the file read by [`GgmlExperts::load_gguf`] fills it.
    pub fn new(config: &MoeConfig, parts: usize, kernels: KernelSet) -> Result<GgmlExperts> {
        // Planned in panels until the file's down type decides the split.
        let ranges = super::split_in_units(config, parts, PANEL, Method::Llamafile)?;
        Ok(GgmlExperts {
            level: kernels.level(),
            layer_idx: config.layer_idx,
            ranges,
            plan: None,
            parts: Vec::new(),
        })
    }

    /// The ggml types of a loaded layer.
    pub fn types(&self) -> Option<GgmlTypes> {
        self.plan.map(|p| p.types)
    }

    fn plan(&self) -> &GgmlPlan {
        self.plan
            .as_ref()
            .expect("the forward runs only on a loaded GGUF layer")
    }

    /// Quantized rows of `stride` bytes as slices (their addresses come from the workspace).
    ///
    /// # Safety
    /// Each prepared row of `rows` points to `stride` readable bytes that nobody writes while
    /// the slices live.
    unsafe fn row_slices<'a>(rows: &RowBlock<'a>, stride: usize) -> [&'a [u8]; MAX_ROWS] {
        assert!(rows.prepared.len() <= MAX_ROWS);
        let mut xs = [&[][..]; MAX_ROWS];
        for (x, &ptr) in xs.iter_mut().zip(rows.prepared) {
            // SAFETY: the contract above.
            *x = unsafe { std::slice::from_raw_parts(ptr, stride) };
        }
        xs
    }
}

impl ExpertFormat for GgmlExperts {
    fn method(&self) -> Method {
        Method::Llamafile
    }

    fn kernel_name(&self) -> String {
        self.plan.map_or_else(
            || "ggml (types chosen at load)".into(),
            |p| {
                format!(
                    "{} {} + {} {}",
                    p.types.gate_up,
                    p.gate_up.name(),
                    p.types.down,
                    p.down.name()
                )
            },
        )
    }

    fn part_ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    fn x_stride(&self, _part: usize) -> usize {
        self.plan.map_or(0, |p| p.x_stride)
    }

    fn act_stride(&self, part: usize) -> usize {
        self.parts.get(part).map_or(0, |g| g.act_stride)
    }

    fn prepares_x(&self, _max_rows: usize) -> bool {
        true
    }

    fn prepares_act(&self, _max_rows: usize) -> bool {
        true
    }

    fn prepare_x(&self, _part: usize, x: &[f32], out: &mut [u8]) -> f32 {
        self.plan().quantize_x(x, out);
        1.0
    }

    fn prepare_act(&self, part: usize, act: &[f32], out: &mut [u8]) -> f32 {
        self.plan().quantize_act(&self.parts[part], act, out);
        1.0
    }

    fn block_rows(&self, _part: usize, expert_rows: usize, _stage: Stage) -> usize {
        // Near-equal blocks (33 rows as 17 + 16, not 32 + 1): a one-row block reads and
        // unpacks the whole panel for one row (`ggml_cycles`, Q8_0 on AMD Zen 4: 32 + 1 rows
        // 11.6 + 0.9 us, 17 + 16 rows 6.3 + 5.8 us).
        crate::kernels::even_block(expert_rows.max(1), MAX_ROWS)
    }

    unsafe fn gate_up_panel(
        &self,
        at: PanelAt,
        rows: &RowBlock,
        _scratch: &mut PanelAcc,
        g: &mut [f32],
        u: &mut [f32],
    ) {
        let PanelAt {
            part,
            slot,
            panel: p,
        } = at;
        let plan = self.plan();
        // SAFETY: the trait's contract: prepared x rows of x_stride bytes.
        let xs = unsafe { Self::row_slices(rows, plan.x_stride) };
        plan.gate_up_panel(&self.parts[part], slot, p, &xs[..rows.len()], g, u);
    }

    fn down_panel_bytes(&self, at: PanelAt) -> Option<(*const u8, usize)> {
        let rows = self
            .plan()
            .down_rows(&self.parts[at.part], at.slot, at.panel);
        Some((rows.as_ptr(), rows.len()))
    }

    unsafe fn down_panel(
        &self,
        at: PanelAt,
        rows: &RowBlock,
        _scratch: &mut PanelAcc,
        o: &mut [f32],
    ) {
        let PanelAt {
            part,
            slot,
            panel: p,
        } = at;
        let gp = &self.parts[part];
        // SAFETY: the trait's contract: prepared SwiGLU rows of act_stride bytes.
        let acts = unsafe { Self::row_slices(rows, gp.act_stride) };
        self.plan().down_panel(gp, slot, p, &acts[..rows.len()], o);
    }

    fn packs_from_source(&self) -> bool {
        false
    }

    unsafe fn pack(
        &self,
        _part: usize,
        _slot: usize,
        _proj: Proj,
        _view: &MatrixView,
    ) -> Result<()> {
        kt_bail!(
            Invalid,
            "layer {} stores GGUF blocks; load it from a GGUF file (load_gguf)",
            self.layer_idx
        )
    }

    fn load_files(
        &mut self,
        pool: &Pool,
        config: &MoeConfig,
        files: &LayerFiles,
        map: Option<&[i64]>,
    ) -> Result<()> {
        match files {
            LayerFiles::Gguf(model, layer) => {
                let tensors = layer_tensors(model, *layer, config)?;
                self.load_tensors(pool, config, &tensors, map)
            }
            LayerFiles::Ggml(tensors) => {
                let tensors = check_tensors(*tensors, config)?;
                self.load_tensors(pool, config, &tensors, map)
            }
            LayerFiles::Converted(_) => kt_bail!(
                Invalid,
                "layer {} stores GGUF blocks; converted AMX files need method AMXINT8/AMXINT4",
                config.layer_idx
            ),
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl GgmlExperts {
    /// Copy layer `layer`'s experts from a GGUF model (`blk.{layer}.ffn_{gate,up,down}_exps.weight`,
    /// dims `[k, n, experts]`) into this layer. The file decides the ggml
    /// types (gate and up must share one; down may differ) and with them the split of `I`
    /// (module docs); each part's bytes are copied and first touched by its own threads.
    /// Physical slot `p` receives file expert `map[p]`; without a map slot `p` takes file expert
    /// `p` (the file holds at least `num_experts`). On error the layer keeps its previous
    /// weights.
    pub fn load_gguf(
        &mut self,
        pool: &Pool,
        config: &MoeConfig,
        model: &GgufModel,
        layer: usize,
        map: Option<&[i64]>,
    ) -> Result<()> {
        let tensors = layer_tensors(model, layer, config)?;
        self.load_tensors(pool, config, &tensors, map)
    }

    /// Copy the checked stacked-expert tensors (gate, up, down) into this layer (see
    /// [`GgmlExperts::load_gguf`]).
    fn load_tensors(
        &mut self,
        pool: &Pool,
        config: &MoeConfig,
        tensors: &[ExpertTensor; 3],
        map: Option<&[i64]>,
    ) -> Result<()> {
        let c = config;
        let l = c.layer_idx;
        let parts = self.ranges.len();
        kt_ensure!(
            pool.parts() == parts,
            Invalid,
            "layer {l} was built for {parts} NUMA parts but the pool has {}",
            pool.parts()
        );
        let [gate, up, down] = tensors;
        let experts = gate.experts();
        if map.is_none() {
            // As the original (which ignores the map): slot e takes file expert e, so the file
            // may hold more experts than the layer reads, never fewer.
            kt_ensure!(
                experts >= c.num_experts,
                Invalid,
                "layer {l}: {} holds {experts} experts but num_experts={}",
                gate.name(),
                c.num_experts
            );
        }
        let logical = c.logical_experts(map, experts)?;
        let types = GgmlTypes {
            gate_up: gate.ggml_type(),
            down: down.ggml_type(),
        };
        let level = self.level;
        let plan = GgmlPlan {
            types,
            gate_up: DotKernel::for_level(types.gate_up, level)?,
            down: DotKernel::for_level(types.down, level)?,
            hidden: c.hidden,
            row_bytes: 0,
            x_bytes: types.gate_up.activation_format()?.row_bytes(c.hidden)?,
            x_stride: 0,
        };
        let plan = GgmlPlan {
            row_bytes: plan.gate_up.memory_row_bytes(c.hidden)?,
            x_stride: row_stride(&plan.gate_up, plan.x_bytes, c.hidden),
            ..plan
        };
        let unit = split_unit(c, parts, types.down, down.name())?;
        let ranges = c.part_ranges_in_units(parts, unit);
        let (h, e_count) = (c.hidden, c.num_experts);
        let mut new_parts = Vec::with_capacity(parts);
        for inter in &ranges {
            let ip = inter.len();
            let down_row_bytes = plan.down.memory_row_bytes(ip)?;
            let act_bytes = types.down.activation_format()?.row_bytes(ip)?;
            let gate_up_bytes = e_count * 2 * ip * plan.row_bytes;
            new_parts.push(GgmlPart {
                rows: ip,
                gate_up: AlignedBuf::zeroed(gate_up_bytes)?,
                down: AlignedBuf::zeroed(e_count * h * down_row_bytes)?,
                down_row_bytes,
                act_bytes,
                act_stride: row_stride(&plan.down, act_bytes, ip),
            });
        }
        // Destination addresses per part (the buffers do not move; tasks write disjoint ranges).
        let dst: Vec<[SyncPtr<u8>; 2]> = new_parts
            .iter_mut()
            .map(|g| {
                [
                    SyncPtr::new(g.gate_up.as_mut_ptr()),
                    SyncPtr::new(g.down.as_mut_ptr()),
                ]
            })
            .collect();
        let geometry: Vec<(Range<usize>, usize)> = ranges
            .iter()
            .zip(&new_parts)
            .map(|(r, g)| (r.clone(), g.down_row_bytes))
            .collect();
        let first_error = FirstError::new();
        let (rb, file_rb) = (plan.row_bytes, gate.row_bytes());
        let down_block = types.down.block_size();
        let down_block_bytes = types.down.type_size();
        pool.run_parts(&|part, team: &Team| {
            let (inter, drb) = geometry[part].clone();
            let ip = inter.len();
            let [gu_dst, down_dst] = dst[part];
            team.parallel_for(e_count * 3, &|task| {
                let (slot, which) = (task / 3, task % 3);
                let e = logical[slot];
                first_error.record((|| -> Result<()> {
                    if which < 2 {
                        let src = [gate, up][which].expert(e)?;
                        for p in 0..ip / PANEL {
                            let from =
                                &src[(inter.start + p * PANEL) * file_rb..][..PANEL * file_rb];
                            let to = ((slot * (ip / PANEL) + p) * 2 + which) * PANEL * rb;
                            // SAFETY: (slot, which, p) owns this run of the part's gate_up
                            // buffer (E·2·ip rows of rb bytes).
                            let dst = unsafe {
                                std::slice::from_raw_parts_mut(gu_dst.get().add(to), PANEL * rb)
                            };
                            if plan.gate_up.has_x8() {
                                let group = x8::GROUP;
                                for (g, out) in dst.chunks_exact_mut(group * rb).enumerate() {
                                    let rows = &from[g * group * file_rb..][..group * file_rb];
                                    plan.gate_up.repack_x8(rows, h, out);
                                }
                            } else {
                                dst.copy_from_slice(from);
                            }
                        }
                    } else {
                        let src = down.expert(e)?;
                        let (src_rb, col) = (
                            down.row_bytes(),
                            inter.start / down_block * down_block_bytes,
                        );
                        let file_drb = types.down.row_bytes(ip)?;
                        // SAFETY: slot's down matrix in this part (h rows of drb bytes) is this
                        // task's.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(
                                down_dst.get().add(slot * h * drb),
                                h * drb,
                            )
                        };
                        if plan.down.has_x8() {
                            let group = x8::GROUP;
                            let mut rows = vec![0u8; group * file_drb];
                            for (g, out) in dst.chunks_exact_mut(group * drb).enumerate() {
                                for (i, row) in rows.chunks_exact_mut(file_drb).enumerate() {
                                    row.copy_from_slice(
                                        &src[(g * group + i) * src_rb + col..][..file_drb],
                                    );
                                }
                                plan.down.repack_x8(&rows, ip, out);
                            }
                        } else {
                            for (r, out) in dst.chunks_exact_mut(drb).enumerate() {
                                out.copy_from_slice(&src[r * src_rb + col..][..drb]);
                            }
                        }
                    }
                    Ok(())
                })());
            });
        })?;
        first_error.into_result()?;
        self.parts = new_parts;
        self.ranges = ranges;
        self.plan = Some(plan);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
