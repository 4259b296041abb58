//! Method AMXINT8 (and the storage AMXINT4 shares): per-row symmetric integer weights in the
//! original's tiled byte layout ([`crate::quant`]), with per-row scales and row sums.
//!
//! Memory of one part: for each of gate, up and down, every expert's matrix (the part's `ip`
//! rows of gate/up, or `H` rows over the part's `ip` columns of down) in the tiled layout, one
//! f32 scale and one i32 row sum per row. Activations are quantized per row to biased int8
//! ([`crate::kernels::group_dot`]); a panel is 32 weight rows, computed as integers and scaled by
//! `w_scale · a_scale`.
//!
//! The two widths differ in a handful of facts, gathered in an [`IntLayout`]: the bytes of a
//! matrix, the split unit, and which kernel of a [`KernelSet`] reads them.
use super::{ExpertFormat, LayerFiles, PanelAcc, PanelAt, RowBlock, Stage};
use crate::error::FirstError;
use crate::expert::{MoeConfig, Proj};
use crate::isa::Level;
use crate::kernels::group_dot::{GroupDotFn, PackedGroupDotFn, VectorKernel, ACT_COPIES};
use crate::kernels::{AmxPath, KernelSet};
use crate::method::Method;
use crate::pack::{AlignedBuf, MatrixView, PANEL};
use crate::pool::{Pool, Team};
use crate::sync_ptr::SyncPtr;
use crate::{kt_ensure, Error, Result};
use std::any::Any;
use std::ops::Range;

pub mod kernels;
#[cfg(test)]
pub(crate) mod twin_check;

/// What distinguishes one integer width from another.
#[derive(Clone, Copy)]
pub struct IntLayout {
    /// The method stored this way.
    pub method: Method,
    /// Bits per weight (8 or 4).
    pub bits: usize,
    /// Split unit of the intermediate dimension and divisor of H (whole tiles of inputs).
    pub unit: usize,
    /// The fastest vector kernel at an ISA level.
    pub vector_kernel: fn(Level) -> VectorKernel,
    /// The tile kernel of an AMX path.
    pub amx_kernel: fn(&AmxPath) -> GroupDotFn,
    /// The same on packed rows.
    pub amx_packed: fn(&AmxPath) -> PackedGroupDotFn,
}

impl IntLayout {
    /// Bytes of a quantized `n × k` matrix.
    pub fn matrix_bytes(&self, n: usize, k: usize) -> usize {
        n * k * self.bits / 8
    }

    /// Whether weights are nibbles (the quantizer's and file readers' switch).
    pub fn is_int4(&self) -> bool {
        self.bits == 4
    }
}

/// AMXINT8.
pub const INT8: IntLayout = IntLayout {
    method: Method::AmxInt8,
    bits: 8,
    unit: 64,
    vector_kernel: kernels::vector_kernel,
    amx_kernel: |a| a.int8,
    amx_packed: |a| a.int8_packed,
};

/// The registry's builder ([`super::build`]).
pub fn experts(
    config: &MoeConfig,
    parts: usize,
    kernels: KernelSet,
) -> Result<Box<dyn ExpertFormat>> {
    Ok(Box::new(IntExperts::new(config, parts, kernels, INT8)?))
}

/// One matrix (gate, up or down) of every expert of a part.
struct Matrices {
    mats: AlignedBuf<u8>,
    scales: AlignedBuf<f32>,
    sums: AlignedBuf<i32>,
    /// The buffers' addresses, for writers that own disjoint experts (the buffers never move).
    mat_dst: SyncPtr<u8>,
    scale_dst: SyncPtr<f32>,
    sum_dst: SyncPtr<i32>,
}

impl Matrices {
    fn new(bytes: usize, rows: usize) -> Result<Matrices> {
        let (mut mats, mut scales, mut sums) = (
            AlignedBuf::zeroed(bytes)?,
            AlignedBuf::zeroed(rows)?,
            AlignedBuf::zeroed(rows)?,
        );
        Ok(Matrices {
            mat_dst: SyncPtr::new(mats.as_mut_ptr()),
            scale_dst: SyncPtr::new(scales.as_mut_ptr()),
            sum_dst: SyncPtr::new(sums.as_mut_ptr()),
            mats,
            scales,
            sums,
        })
    }

    /// Expert `slot`'s bytes, scales and row sums (`n` rows of `bytes` bytes in all).
    ///
    /// # Safety
    /// No one else reads or writes expert `slot` of this matrix while the slices live, and
    /// `slot` is inside the buffers.
    #[allow(clippy::mut_from_ref)]
    unsafe fn expert_mut(
        &self,
        slot: usize,
        n: usize,
        bytes: usize,
    ) -> (&mut [u8], &mut [f32], &mut [i32]) {
        assert!((slot + 1) * bytes <= self.mats.len() && (slot + 1) * n <= self.sums.len());
        // SAFETY: in bounds (the buffers hold every expert); exclusive per the contract.
        unsafe {
            (
                std::slice::from_raw_parts_mut(self.mat_dst.get().add(slot * bytes), bytes),
                std::slice::from_raw_parts_mut(self.scale_dst.get().add(slot * n), n),
                std::slice::from_raw_parts_mut(self.sum_dst.get().add(slot * n), n),
            )
        }
    }
}

/// The integer experts of one layer (AMXINT8 or AMXINT4).
pub struct IntExperts {
    layout: IntLayout,
    kernels: KernelSet,
    /// The vector kernel for the kernel set's level (AMX, when enabled, takes busy experts).
    vector: VectorKernel,
    hidden: usize,
    experts: usize,
    ranges: Vec<Range<usize>>,
    /// Per part: gate, up, down.
    parts: Vec<[Matrices; 3]>,
}

/// Where a panel's 32 rows start in its matrix, and where those of [`RowBlock::next`]'s
/// panel start (the slice the vector kernels bring into L2 as they go).
#[derive(Clone, Copy)]
struct PanelRows {
    first: usize,
    next_first: Option<usize>,
}

impl PanelRows {
    /// For panel `at` of a matrix with `slot_rows` rows per expert slot.
    fn of(at: PanelAt, rows: &RowBlock, slot_rows: usize) -> PanelRows {
        let first = |at: PanelAt| at.slot * slot_rows + at.panel * PANEL;
        PanelRows {
            first: first(at),
            next_first: rows.next.map(|n| first(n.at)),
        }
    }
}

impl IntExperts {
    /// Room for `config.num_experts` experts in `parts` parts (whole `layout.unit` slices).
    pub fn new(
        config: &MoeConfig,
        parts: usize,
        kernels: KernelSet,
        layout: IntLayout,
    ) -> Result<IntExperts> {
        let ranges = super::split_in_units(config, parts, layout.unit, layout.method)?;
        let (e, h) = (config.num_experts, config.hidden);
        let parts = ranges
            .iter()
            .map(|inter| {
                let ip = inter.len();
                let bytes = layout.matrix_bytes(e * h * ip, 1);
                Ok([
                    Matrices::new(bytes, e * ip)?,
                    Matrices::new(bytes, e * ip)?,
                    Matrices::new(bytes, e * h)?,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(IntExperts {
            layout,
            vector: (layout.vector_kernel)(kernels.level()),
            kernels,
            hidden: h,
            experts: e,
            ranges,
            parts,
        })
    }

    /// `(n, k)` of projection `proj` in `part`.
    fn dims(&self, part: usize, proj: Proj) -> (usize, usize) {
        let ip = self.ranges[part].len();
        match proj {
            Proj::Gate | Proj::Up => (ip, self.hidden),
            Proj::Down => (self.hidden, ip),
        }
    }

    /// The integer kernel and its row block for an expert with `rows` rows.
    fn kernel_for(&self, rows: usize) -> (GroupDotFn, usize) {
        match self.kernels.amx().filter(|a| a.applies(rows)) {
            Some(a) => ((self.layout.amx_kernel)(a), crate::kernels::amx::ROWS),
            None => (self.vector.dot, self.vector.rows),
        }
    }

    /// `out` (32 per row) = rows `q.first..q.first+32` of matrix `m` (k inputs) against
    /// `rows`.
    ///
    /// # Safety
    /// The [`ExpertFormat::gate_up_panel`] contract for prepared rows of `ACT_COPIES · k`
    /// bytes.
    unsafe fn panel(
        &self,
        m: &Matrices,
        q: PanelRows,
        k: usize,
        rows: &RowBlock,
        acc: &mut PanelAcc,
        out: &mut [f32],
    ) {
        let PanelRows {
            first: qrow,
            next_first: next_qrow,
        } = q;
        let start = self.layout.matrix_bytes(qrow, k);
        let group_bytes = self.layout.matrix_bytes(PANEL, k);
        let group = &m.mats.as_slice()[start..start + group_bytes];
        let sums = &m.sums.as_slice()[qrow..qrow + PANEL];
        assert!(rows.len() <= crate::kernels::MAX_ROWS && out.len() >= rows.len() * PANEL);
        assert!(rows.prepared.len() == rows.len() && rows.scales.len() == rows.len());
        let amx = self.kernels.amx().filter(|a| a.applies(rows.expert_rows));
        match (amx, rows.reuse) {
            // The tiles on rows packed once for all the panels of this block (see
            // `amx::with_packed_rows`): the first k bytes of each activation row.
            (Some(a), Some(key)) => {
                let packed = (self.layout.amx_packed)(a);
                let n = rows.len();
                // SAFETY: activation rows of at least k = (k/64)·64 bytes; the forward's
                // reuse promise; a group and its sums as below; the ISA was checked when the
                // KernelSet was built.
                unsafe {
                    crate::kernels::amx::with_packed_rows(key, rows.prepared, k / 64, |p, step| {
                        packed(
                            p,
                            step,
                            n,
                            k,
                            group.as_ptr(),
                            sums.as_ptr(),
                            acc.acc.as_mut_ptr(),
                        )
                    })
                };
            }
            _ => {
                // Later blocks find this group in cache: the memory system is idle while they
                // multiply, so they bring in the next panel's group (vector kernels of
                // SIDE_STREAM_ROWS rows and more take it, one line per weight line).
                // A set stream, even an empty one, also tells the kernel its group is warm.
                if let (Some(next), Some(nq)) = (rows.next, next_qrow) {
                    let slice = next.range(group_bytes);
                    let at = self.layout.matrix_bytes(nq, k) + slice.start;
                    crate::kernels::prefetch::set_side_stream(
                        m.mats.as_slice().as_ptr().wrapping_add(at),
                        slice.len(),
                    );
                } else if rows.warm {
                    crate::kernels::prefetch::set_side_stream(group.as_ptr(), 0);
                }
                // SAFETY: a 32-row group of k inputs and its 32 row sums (sliced above); the
                // prepared rows are activation rows of ACT_COPIES·k bytes (this fn's
                // contract); `acc` holds MAX_ROWS·32; the kernel's ISA was checked when the
                // KernelSet was built.
                unsafe {
                    (self.kernel_for(rows.expert_rows).0)(
                        rows.prepared,
                        k,
                        group.as_ptr(),
                        sums.as_ptr(),
                        acc.acc.as_mut_ptr(),
                    )
                };
                // Not left for an unrelated call when the kernel took none (few rows).
                crate::kernels::prefetch::take_side_stream();
            }
        }
        let w_scale = &m.scales.as_slice()[qrow..qrow + PANEL];
        scale_panel_rows(self.kernels.level(), &acc.acc, w_scale, rows.scales, out);
    }

    /// One part of one slot's quantized projection: the matrix bytes in the in-memory layout
    /// (the original's file layout after [`crate::quant::to_file_layout`]) and the row scales.
    pub fn quantized_part(&self, slot: usize, proj: Proj, part: usize) -> Result<(&[u8], &[f32])> {
        let m = self
            .parts
            .get(part)
            .ok_or_else(|| Error::Invalid(format!("no quantized part {part} in this layer")))?;
        kt_ensure!(
            slot < self.experts,
            Invalid,
            "expert slot {slot} out of range"
        );
        let (n, k) = self.dims(part, proj);
        let m = &m[proj.index()];
        let start = self.layout.matrix_bytes(slot * n, k);
        let bytes = &m.mats.as_slice()[start..start + self.layout.matrix_bytes(n, k)];
        let scales = &m.scales.as_slice()[slot * n..(slot + 1) * n];
        Ok((bytes, scales))
    }

    /// Read the original's converted files into every slot (see [`crate::converted`]).
    fn load_converted(
        &self,
        pool: &Pool,
        config: &MoeConfig,
        files: &crate::converted::ConvertedLayer,
        map: Option<&[i64]>,
    ) -> Result<()> {
        let l = config.layer_idx;
        let shape = *files.shape();
        kt_ensure!(
            shape.method == self.layout.method,
            Invalid,
            "layer {l} stores {} weights; the files hold {}",
            self.layout.method,
            shape.method
        );
        let parts = self.ranges.len();
        kt_ensure!(
            shape.parts == parts
                && pool.parts() == parts
                && shape.hidden == config.hidden
                && shape.intermediate == config.intermediate,
            Invalid,
            "layer {l}: files for H={} I={} in {} parts, layer H={} I={} in {} parts (pool {})",
            shape.hidden,
            shape.intermediate,
            shape.parts,
            config.hidden,
            config.intermediate,
            parts,
            pool.parts()
        );
        let even = config.intermediate / parts;
        kt_ensure!(
            self.ranges.iter().all(|r| r.len() == even),
            Invalid,
            "layer {l}: the original splits I={} evenly into {} parts; this layer's parts are {:?}",
            config.intermediate,
            parts,
            self.ranges
        );
        let logical = config.logical_experts(map, shape.experts)?;
        let int4 = self.layout.is_int4();
        let first_error = FirstError::new();
        pool.run_parts(&|part, team: &Team| {
            team.parallel_for(config.num_experts * 3, &|task| {
                let (slot, which) = (task / 3, task % 3);
                let proj = crate::converted::PROJS[which].0;
                let (n, k) = shape.part_dims(proj);
                let bytes = self.layout.matrix_bytes(n, k);
                // SAFETY: this task owns expert `slot` of matrix `which` in this part; the
                // buffers hold E experts of n rows (sizes checked when the files opened).
                let (mat, scales, sums) =
                    unsafe { self.parts[part][which].expert_mut(slot, n, bytes) };
                let group_bytes = self.layout.matrix_bytes(PANEL, k);
                // Row sums of each piece as it arrives, while its bytes are in cache.
                let mut sum_piece = |mat: &[u8], bytes: Range<usize>| {
                    for g in bytes.start / group_bytes..bytes.end / group_bytes {
                        let group = &mat[g * group_bytes..(g + 1) * group_bytes];
                        sums[g * PANEL..(g + 1) * PANEL]
                            .copy_from_slice(&kernels::row_sums_fast(group, k, int4));
                    }
                };
                first_error.record(files.read_into(
                    logical[slot],
                    proj,
                    part,
                    mat,
                    scales,
                    &mut sum_piece,
                ));
            });
        })?;
        first_error.into_result()
    }
}

impl ExpertFormat for IntExperts {
    fn method(&self) -> Method {
        self.layout.method
    }

    fn kernel_name(&self) -> String {
        let vector = self.vector.name;
        match self.kernels.amx_name() {
            Some(amx) => format!("{amx}+{vector}"),
            None => vector.to_string(),
        }
    }

    fn part_ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    fn x_stride(&self, _part: usize) -> usize {
        ACT_COPIES * self.hidden
    }

    fn act_stride(&self, part: usize) -> usize {
        ACT_COPIES * self.ranges[part].len()
    }

    fn prepares_x(&self, _max_rows: usize) -> bool {
        true
    }

    fn prepares_act(&self, _max_rows: usize) -> bool {
        true
    }

    fn prepare_x(&self, _part: usize, x: &[f32], out: &mut [u8]) -> f32 {
        quantize_activation(x, out)
    }

    fn prepare_act(&self, _part: usize, act: &[f32], out: &mut [u8]) -> f32 {
        quantize_activation(act, out)
    }

    fn block_rows(&self, _part: usize, expert_rows: usize, _stage: Stage) -> usize {
        match self.kernel_for(expert_rows).1 {
            // Vector blocks as even as they go: each block reads the whole group, so 33 rows
            // as 8+8+8+8+1 pay a fifth pass for one row.
            rows if rows < crate::kernels::amx::ROWS => {
                crate::kernels::even_block(expert_rows.max(1), rows)
            }
            rows => rows,
        }
    }

    unsafe fn gate_up_panel(
        &self,
        at: PanelAt,
        rows: &RowBlock,
        scratch: &mut PanelAcc,
        g: &mut [f32],
        u: &mut [f32],
    ) {
        let part = at.part;
        let (ip, h) = (self.ranges[part].len(), self.hidden);
        let q = PanelRows::of(at, rows, ip);
        let [gate, up, _] = &self.parts[part];
        // SAFETY: the trait's contract, forwarded (prepared rows of x_stride bytes).
        unsafe {
            self.panel(gate, q, h, rows, scratch, g);
            self.panel(up, q, h, rows, scratch, u);
        }
    }

    unsafe fn gate_up_run(
        &self,
        at: PanelAt,
        n: usize,
        rows: &RowBlock,
        scratch: &mut PanelAcc,
        g: &mut [f32],
        u: &mut [f32],
    ) {
        let part = at.part;
        let (ip, h) = (self.ranges[part].len(), self.hidden);
        let m = rows.len() * PANEL;
        let [gate, up, _] = &self.parts[part];
        // All the gate panels, then all the up panels: two long runs through memory rather
        // than a switch every 32 rows.
        for (mat, out) in [(gate, &mut *g), (up, &mut *u)] {
            for (i, out) in out[..n * m].chunks_exact_mut(m).enumerate() {
                let at = at.after(i);
                // SAFETY: the trait's contract, forwarded, panel by panel.
                unsafe { self.panel(mat, PanelRows::of(at, rows, ip), h, rows, scratch, out) };
            }
        }
    }

    unsafe fn down_panel(
        &self,
        at: PanelAt,
        rows: &RowBlock,
        scratch: &mut PanelAcc,
        o: &mut [f32],
    ) {
        let part = at.part;
        let ip = self.ranges[part].len();
        let q = PanelRows::of(at, rows, self.hidden);
        // SAFETY: the trait's contract, forwarded (prepared rows of act_stride bytes).
        unsafe { self.panel(&self.parts[part][2], q, ip, rows, scratch, o) }
    }

    fn packs_from_source(&self) -> bool {
        true
    }

    unsafe fn pack(&self, part: usize, slot: usize, proj: Proj, view: &MatrixView) -> Result<()> {
        let (n, k) = self.dims(part, proj);
        assert!(slot < self.experts && view.rows == n && view.cols == k);
        let bytes = self.layout.matrix_bytes(n, k);
        // SAFETY: slot exists (checked); the caller promises this call alone writes
        // (part, slot, proj).
        let (mat, scales, sums) =
            unsafe { self.parts[part][proj.index()].expert_mut(slot, n, bytes) };
        // SAFETY: the source keeps `view`'s memory alive while the layer loads.
        unsafe {
            crate::quant::quantize_matrix(view, self.layout.is_int4(), mat, scales, Some(sums))
        }
        .map_err(|e| e.context(&format!("expert slot {slot} {proj:?}")))
    }

    fn load_files(
        &mut self,
        pool: &Pool,
        config: &MoeConfig,
        files: &LayerFiles,
        map: Option<&[i64]>,
    ) -> Result<()> {
        match files {
            LayerFiles::Converted(files) => self.load_converted(pool, config, files, map),
            LayerFiles::Gguf(..) | LayerFiles::Ggml(..) => crate::kt_bail!(
                Invalid,
                "layer {}: {} weights are not read from GGUF files",
                config.layer_idx,
                self.layout.method
            ),
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Quantize an fp32 row to an int8 kernels' activation row (biased `q + 128`, then the copies
/// of [`crate::kernels::group_dot::fill_activation_copies`]; `out` holds `ACT_COPIES · row.len()`);
/// returns the row's scale.
fn quantize_activation(row: &[f32], out: &mut [u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::allows(crate::isa::Level::Avx512Base) {
        // SAFETY: the AVX-512 base level (F/BW/VL/DQ, with AVX2 and FMA below it) is allowed.
        return unsafe { quantize_activation_avx512(row, out) };
    } else if crate::isa::allows(crate::isa::Level::Avx2) {
        // SAFETY: AVX2 allowed (checked above).
        return unsafe { quantize_activation_avx2(row, out) };
    }
    quantize_activation_any(row, out)
}

/// [`quantize_activation_any`] vectorized for AVX-512: the same element-wise operations, so
/// the same bytes (a prefill quantizes every token and every SwiGLU row: 6% of an AMXINT8
/// layer at 512 tokens with SSE2's four lanes).
///
/// # Safety
/// AVX-512F/BW/VL, AVX2 and FMA available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn quantize_activation_avx512(row: &[f32], out: &mut [u8]) -> f32 {
    quantize_activation_any(row, out)
}

/// [`quantize_activation_any`] vectorized for AVX2.
///
/// # Safety
/// AVX2 and FMA available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_activation_avx2(row: &[f32], out: &mut [u8]) -> f32 {
    quantize_activation_any(row, out)
}

#[inline(always)]
fn quantize_activation_any(row: &[f32], out: &mut [u8]) -> f32 {
    let biased = &mut out[..row.len()];
    // SAFETY: i8 and u8 have the same layout; the slice covers exactly `biased`.
    let signed =
        unsafe { std::slice::from_raw_parts_mut(biased.as_mut_ptr() as *mut i8, biased.len()) };
    let d = crate::quant::quantize_row_int8(row, signed);
    for b in biased.iter_mut() {
        *b ^= 0x80;
    }
    crate::kernels::group_dot::fill_activation_copies(out);
    // A NaN would quantize to 0 silently; a NaN scale keeps it visible in this row's output.
    // (A fold without early exit, so it vectorizes.)
    if row.iter().fold(false, |nan, v| nan | v.is_nan()) {
        f32::NAN
    } else {
        d
    }
}

/// Rows `0..a_scales.len()` of a panel's integer results to floats: `dst = (acc · w_scale) ·
/// a_scale` (the same two roundings as the scalar reference) per row. Every output of a prefill
/// passes here once, so it runs on the widest vectors the level has: the portable loop
/// vectorises to SSE only (the crate's baseline). AMD Zen 4, one core, 512 tokens: 3.6% of the
/// layer's samples in SSE, 1.3-1.4% on 512-bit vectors.
fn scale_panel_rows(
    level: crate::isa::Level,
    acc: &[i32],
    w_scale: &[f32],
    a_scales: &[f32],
    dst: &mut [f32],
) {
    let rows = a_scales.len();
    assert!(acc.len() >= rows * PANEL && dst.len() >= rows * PANEL && w_scale.len() == PANEL);
    #[cfg(target_arch = "x86_64")]
    if level >= crate::isa::Level::Avx512Base {
        // SAFETY: the level includes AVX-512F; the lengths were checked above.
        return unsafe { scale_panel_rows_avx512(acc, w_scale, a_scales, dst) };
    } else if level >= crate::isa::Level::Avx2 {
        // SAFETY: the level includes AVX2; the lengths were checked above.
        return unsafe { scale_panel_rows_avx2(acc, w_scale, a_scales, dst) };
    }
    let _ = level;
    scale_panel_rows_scalar(acc, w_scale, a_scales, dst);
}

/// The portable form of [`scale_panel_rows`] (its twin in tests).
fn scale_panel_rows_scalar(acc: &[i32], w_scale: &[f32], a_scales: &[f32], dst: &mut [f32]) {
    let w_scale: &[f32; PANEL] = w_scale.try_into().unwrap();
    for (i, &a_scale) in a_scales.iter().enumerate() {
        let acc: &[i32; PANEL] = acc[i * PANEL..(i + 1) * PANEL].try_into().unwrap();
        let dst: &mut [f32; PANEL] = (&mut dst[i * PANEL..(i + 1) * PANEL]).try_into().unwrap();
        for j in 0..PANEL {
            dst[j] = (acc[j] as f32 * w_scale[j]) * a_scale;
        }
    }
}

/// [`scale_panel_rows`] on 256-bit vectors (four per row), for AVX2 CPUs.
///
/// # Safety
/// AVX2 available; the lengths of [`scale_panel_rows_avx512`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn scale_panel_rows_avx2(acc: &[i32], w_scale: &[f32], a_scales: &[f32], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    // SAFETY: every offset is inside the rows the contract gives.
    unsafe {
        let w: [__m256; 4] = std::array::from_fn(|q| _mm256_loadu_ps(w_scale.as_ptr().add(8 * q)));
        for (i, &a_scale) in a_scales.iter().enumerate() {
            let a = _mm256_set1_ps(a_scale);
            for (q, wq) in w.iter().enumerate() {
                let at = i * PANEL + 8 * q;
                let v = _mm256_loadu_si256(acc.as_ptr().add(at) as *const __m256i);
                let v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), *wq), a);
                _mm256_storeu_ps(dst.as_mut_ptr().add(at), v);
            }
        }
    }
}

/// [`scale_panel_rows`] on 512-bit vectors (two per row).
///
/// # Safety
/// AVX-512F available; `acc` and `dst` hold `a_scales.len()` rows of [`PANEL`] values, `w_scale`
/// [`PANEL`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn scale_panel_rows_avx512(acc: &[i32], w_scale: &[f32], a_scales: &[f32], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    // SAFETY: every offset is inside the rows the contract gives.
    unsafe {
        let w = [
            _mm512_loadu_ps(w_scale.as_ptr()),
            _mm512_loadu_ps(w_scale.as_ptr().add(16)),
        ];
        for (i, &a_scale) in a_scales.iter().enumerate() {
            let a = _mm512_set1_ps(a_scale);
            for (h, wh) in w.iter().enumerate() {
                let at = i * PANEL + 16 * h;
                let v = _mm512_cvtepi32_ps(_mm512_loadu_si512(acc.as_ptr().add(at) as *const _));
                let v = _mm512_mul_ps(_mm512_mul_ps(v, *wh), a);
                _mm512_storeu_ps(dst.as_mut_ptr().add(at), v);
            }
        }
    }
}

#[cfg(test)]
mod quantize_tests {
    use super::*;

    /// The vector form of the panel scaling writes the portable loop's floats, bit for bit,
    /// at every level this CPU runs (large and tiny sums, scales of both signs).
    #[test]
    fn scaled_panel_rows_equal_the_portable_loop() {
        let mut rng = crate::rng::Rng::new(23);
        for rows in [1, 3, 8, 12] {
            let acc: Vec<i32> = (0..rows * PANEL)
                .map(|i| (rng.below(1 << 24) as i32 - (1 << 23)) >> (i % 17))
                .collect();
            let w_scale = rng.normals(PANEL, 1e-3);
            let a_scales = rng.normals(rows, 0.1);
            let mut want = vec![0f32; rows * PANEL];
            scale_panel_rows_scalar(&acc, &w_scale, &a_scales, &mut want);
            assert!(want.iter().any(|&v| v != 0.0));
            for level in crate::kernels::runnable_levels() {
                let mut got = vec![f32::NAN; rows * PANEL];
                scale_panel_rows(level, &acc, &w_scale, &a_scales, &mut got);
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{level:?}, {rows} rows");
            }
        }
    }

    /// The vectorized clones of [`quantize_activation_any`] (whichever this CPU runs) write the
    /// same bytes and scale: random rows, a zero row, ties of the rounding, NaN and infinity.
    #[test]
    fn quantized_activations_equal_the_portable_code() {
        let mut rng = crate::rng::Rng::new(17);
        for trial in 0..30 {
            let k = 64 * (1 + trial % 5) + 8 * (trial % 3);
            let mut x = rng.normals(k, [1e-3, 1.0, 500.0][trial % 3]);
            match trial % 6 {
                1 => x.fill(0.0),
                2 => x[k / 3] = f32::NAN,
                3 => x[k - 1] = f32::INFINITY,
                4 => {
                    // Values whose quantized value is exactly halfway between two integers.
                    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                    x.iter_mut()
                        .for_each(|v| *v = ((*v / amax * 127.0).floor() + 0.5) * amax / 127.0);
                }
                _ => {}
            }
            let (mut want, mut got) = (vec![0u8; ACT_COPIES * k], vec![0u8; ACT_COPIES * k]);
            let d_want = quantize_activation_any(&x, &mut want);
            let d_got = quantize_activation(&x, &mut got);
            assert_eq!(got, want, "trial {trial}");
            assert_eq!(d_got.to_bits(), d_want.to_bits(), "trial {trial}");
        }
    }
}
