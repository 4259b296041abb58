//! Method BF16: experts packed as bf16 panels ([`crate::pack`]), multiplied in fp32.
//!
//! Memory of one part (intermediate slice of `ip` rows): `gate_up` holds, per expert and per
//! 32-row panel `p`, gate panel `p` then up panel `p`, so a gate/up task streams one contiguous
//! run; `down` holds each expert's `H / 32` panels over the slice's `ip` inputs.
//!
//! Kernels, per expert and forward: the exact fp32 FMA kernel on fp32 activations, or, for
//! experts with enough rows to be compute-bound, a bf16 dot product (AMX tiles or
//! `vdpbf16ps`) on activations staged as bf16 pairs.
use super::{locate, ExpertFormat, GpuRankDst, PanelAcc, PanelAt, RowBlock, RowShare, Stage};
use crate::expert::{MoeConfig, Proj};
use crate::kernels::{Bf16Path, KernelSet};
use crate::method::Method;
use crate::pack::{pack_panel, packed_index, panel_len, AlignedBuf, MatrixView, PANEL};
use crate::sync_ptr::SyncPtr;
use crate::{kt_ensure, Result};
use std::any::Any;
use std::ops::Range;

struct Part {
    gate_up: AlignedBuf<u16>,
    down: AlignedBuf<u16>,
    /// Addresses of the two buffers for [`ExpertFormat::pack`] (the buffers never move).
    gate_up_dst: SyncPtr<u16>,
    down_dst: SyncPtr<u16>,
}

/// The registry's builder ([`super::build`]).
pub fn experts(
    config: &MoeConfig,
    parts: usize,
    kernels: KernelSet,
) -> Result<Box<dyn ExpertFormat>> {
    Ok(Box::new(Bf16Experts::new(config, parts, kernels)?))
}

/// The BF16 experts of one layer.
pub struct Bf16Experts {
    kernels: KernelSet,
    hidden: usize,
    experts: usize,
    ranges: Vec<Range<usize>>,
    parts: Vec<Part>,
}

impl Bf16Experts {
    /// Room for `config.num_experts` experts in `parts` parts (whole 32-row panels each).
    pub fn new(config: &MoeConfig, parts: usize, kernels: KernelSet) -> Result<Bf16Experts> {
        let ranges = super::split_in_units(config, parts, PANEL, Method::Bf16)?;
        let parts = ranges
            .iter()
            .map(|inter| {
                let n = config.num_experts * config.hidden * inter.len();
                let mut gate_up = AlignedBuf::zeroed(2 * n)?;
                let mut down = AlignedBuf::zeroed(n)?;
                Ok(Part {
                    gate_up_dst: SyncPtr::new(gate_up.as_mut_ptr()),
                    down_dst: SyncPtr::new(down.as_mut_ptr()),
                    gate_up,
                    down,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Bf16Experts {
            kernels,
            hidden: config.hidden,
            experts: config.num_experts,
            ranges,
            parts,
        })
    }

    /// This format's activation staging.
    fn staging(&self) -> Staging<'_> {
        Staging {
            kernels: &self.kernels,
            hidden: self.hidden,
            ranges: &self.ranges,
        }
    }

    /// See [`path_for`].
    fn bf16_for(&self, rows: usize, k: usize) -> Option<Bf16Path> {
        path_for(&self.kernels, rows, k)
    }

    /// One panel product through the path chosen for this block's expert.
    ///
    /// # Safety
    /// The [`ExpertFormat::gate_up_panel`] contract for rows of `k` values: in particular the
    /// prepared rows are staged whenever this expert takes a bf16 path.
    unsafe fn panel(&self, rows: &RowBlock, k: usize, panel: &[u16], out: &mut [f32]) {
        assert!(panel.len() == panel_len(k) && out.len() >= rows.len() * PANEL);
        assert!(rows.prepared.len() == rows.len() && rows.len() <= crate::kernels::MAX_ROWS);
        match self.bf16_for(rows.expert_rows, k) {
            Some(b) => {
                let mut staged = [std::ptr::null::<u32>(); crate::kernels::MAX_ROWS];
                for (s, &p) in staged.iter_mut().zip(rows.prepared) {
                    *s = p.cast();
                }
                // SAFETY: the forward stages every row this expert reads (prepares_x /
                // prepares_act said yes for its row count): k/2 pairs per row; the panel has
                // 32·k values and `out` 32 per row; the kernel's ISA was checked when the
                // KernelSet was built.
                unsafe {
                    dot_staged(
                        b,
                        rows.reuse,
                        &staged[..rows.len()],
                        k,
                        panel.as_ptr(),
                        out.as_mut_ptr(),
                    )
                }
            }
            // SAFETY: fp32 rows of k values, a panel of 32·k values, 32 outputs per row.
            None => unsafe {
                self.kernels
                    .panel_dot_raw(rows.f32_rows, k, panel.as_ptr(), out.as_mut_ptr())
            },
        }
    }
}

/// A whole decoded bf16 panel (32 × k values) and what it holds: the reuse key of the forward
/// phase and the address of the weights it was decoded from.
struct DecodedPanel {
    key: Option<(u64, usize, usize)>,
    buf: crate::pack::AlignedBuf<u16>,
}

thread_local! {
    /// This thread's last two decoded panels (gate's and up's of one expert), grown to the
    /// largest k seen.
    static WHOLE_PANELS: std::cell::RefCell<[Option<DecodedPanel>; 2]> =
        const { std::cell::RefCell::new([None, None]) };
}

/// `out` (32 per row) = one whole panel of `k` inputs against `rows`, decoded block by block
/// (`decode(b, dst)` writes block b's `PANEL·block` values, panel order, scales folded in) into
/// this thread's whole-panel buffer, then multiplied once over all k through `path`. The
/// panel layout is pair-major, so the blocks' panels laid end to end are the whole panel's;
/// the tile programs (or the bf16 dot) pay their per-call cost once per panel, not per block.
/// `weights` are the panel's stored bytes: while the rows' reuse key is the same (one forward
/// phase), a panel decoded for the expert's previous row block is used again. The vector
/// kernel's first row block prefetches as many bytes after them (the next panel, as panels lie
/// end to end) into L2, so the next decode's DRAM reads overlap this panel's arithmetic (Zen 4,
/// 512-token S1 layer, three alternations: FP8 122-126 -> 108-121 ms, MXFP8 135-143 -> 117-120;
/// the 4-bit formats, half the bytes, unchanged).
///
/// # Safety
/// The [`ExpertFormat::gate_up_panel`] contract for `rows` of `k` inputs, with staged bf16
/// rows (as `path`, a bf16 path, reads them); `decode` gives the same values for the same
/// `weights` within one reuse key.
#[allow(clippy::too_many_arguments)] // one panel's product: each argument a fact of it
pub(crate) unsafe fn multiply_decoded_panel(
    kernels: &KernelSet,
    path: Bf16Path,
    rows: &RowBlock,
    k: usize,
    block: usize,
    weights: &[u8],
    mut decode: impl FnMut(usize, &mut [u16]),
    out: &mut [f32],
) {
    WHOLE_PANELS.with(|cell| {
        let mut panels = cell.borrow_mut();
        let len = crate::pack::PANEL * k;
        let key = rows.reuse.map(|r| (r, weights.as_ptr() as usize, k));
        let hit = key.and_then(|key| {
            panels
                .iter()
                .position(|p| p.as_ref().is_some_and(|p| p.key == Some(key)))
        });
        // Decode into the slot not used last (slot 1 moves to slot 0 first: slot 0 is the
        // older), unless the panel is there already.
        // The slot holding the panel, and how many rows the decoding tile kernel has done.
        let (slot, done) = match hit {
            Some(i) => (i, 0),
            None => {
                panels.swap(0, 1);
                let entry = &mut panels[1];
                if entry.as_ref().is_none_or(|p| p.buf.len() < len) {
                    // A few hundred KiB at most (k = 7168: 448 KiB), once per thread and size.
                    *entry = Some(DecodedPanel {
                        key: None,
                        buf: crate::pack::AlignedBuf::zeroed(len)
                            .expect("allocating a decoded panel buffer"),
                    });
                }
                let p = entry.as_mut().expect("allocated above");
                p.key = None;
                let fused = path.packed_decoding.zip(rows.reuse);
                let done = match fused
                    .filter(|_| block.is_multiple_of(crate::kernels::amx::BF16_K_STEP))
                {
                    Some((kernel, reuse)) => {
                        // The tiles multiply the first row block while the panel is decoded.
                        let buf = p.buf.as_mut_ptr();
                        let mut decode_at = |b: usize| {
                            let n = crate::pack::PANEL * block;
                            // SAFETY: block b of the len-value buffer; the kernel reads only
                            // the blocks decoded before (its contract): no alias.
                            decode(b, unsafe {
                                std::slice::from_raw_parts_mut(buf.add(b * n), n)
                            })
                        };
                        // SAFETY: the caller's contract (staged rows of k inputs, the reuse
                        // promise); the buffer holds 32·k values.
                        unsafe {
                            decode_first_rows(
                                rows,
                                k,
                                block,
                                reuse,
                                kernel,
                                buf,
                                &mut decode_at,
                                out,
                            )
                        }
                    }
                    None => {
                        for (b, dst) in p.buf.as_mut_slice()[..len]
                            .chunks_exact_mut(crate::pack::PANEL * block)
                            .enumerate()
                        {
                            decode(b, dst);
                        }
                        0
                    }
                };
                p.key = key;
                (1, done)
            }
        };
        if slot == 0 {
            panels.swap(0, 1);
        }
        let decoded = &panels[1].as_ref().expect("filled above").buf.as_slice()[..len];
        let next = weights.as_ptr_range().end;
        crate::kernels::prefetch::set_side_stream(next, weights.len());
        // SAFETY: the caller's contract, all k inputs as one block, from the rows the decoding
        // kernel left; the rows are whole, so a packing of them serves every panel of this
        // block (`rows.reuse`).
        unsafe {
            add_decoded_block(
                kernels,
                Some(path),
                rows,
                k,
                0,
                decoded,
                1.0,
                out,
                rows.reuse,
                done,
            )
        };
        // Not left for an unrelated call when no vector kernel took it (AMX tiles).
        crate::kernels::prefetch::take_side_stream();
    })
}

/// The first row block of `rows` (up to the tile kernels' rows) against a panel that `kernel`
/// decodes as it multiplies (`decode(b)` writes block b into `panel`); their 32 outputs per row
/// into `out`. Returns how many rows it did.
///
/// # Safety
/// As [`multiply_decoded_panel`] with `kernel` an AMX decoding kernel; `panel` holds 32·k
/// values that `decode` writes.
#[allow(clippy::too_many_arguments)] // the decoding kernel's facts
unsafe fn decode_first_rows(
    rows: &RowBlock,
    k: usize,
    block: usize,
    reuse: u64,
    kernel: crate::kernels::PackedDecodingBf16Fn,
    panel: *mut u16,
    decode: &mut dyn FnMut(usize),
    out: &mut [f32],
) -> usize {
    let m = rows.len().min(crate::kernels::amx::ROWS);
    let mut staged = [std::ptr::null::<u8>(); crate::kernels::MAX_ROWS];
    for (s, &r) in staged.iter_mut().zip(rows.prepared) {
        *s = r.cast();
    }
    // The kernel writes (not adds) its m rows' outputs, straight into `out`.
    let out = &mut out[..m * PANEL];
    // SAFETY: staged rows of k/2 pairs = k/32 steps of 64 bytes (the caller's contract), the
    // reuse promise; the kernel's contract for the panel and the decoder; m·32 outputs.
    unsafe {
        crate::kernels::amx::with_packed_rows(reuse, &staged[..m], k / 32, |pk, step| {
            kernel(pk, step, m, k, block, panel, decode, out.as_mut_ptr())
        })
    };
    m
}

/// `path`'s kernel on staged rows (`k/2` pairs each). With a reuse key, the AMX kernel runs on
/// the rows packed by 64-byte column block, a packing this thread keeps while the next panels
/// read the same rows (gathering scattered rows per tile step cost as much as the tiles).
///
/// # Safety
/// The [`crate::kernels::PanelDotBf16Fn`] contract; with `reuse`, the
/// [`RowBlock::reuse`] promise for these row addresses.
pub(crate) unsafe fn dot_staged(
    path: Bf16Path,
    reuse: Option<u64>,
    staged: &[*const u32],
    k: usize,
    panel: *const u16,
    out: *mut f32,
) {
    match (path.packed, reuse) {
        (Some(packed), Some(key)) if k.is_multiple_of(crate::kernels::amx::BF16_K_STEP) => {
            let mut rows = [std::ptr::null::<u8>(); crate::kernels::MAX_ROWS];
            for (r, &s) in rows.iter_mut().zip(staged) {
                *r = s.cast();
            }
            let m = staged.len();
            // SAFETY: each row holds k/2 pairs = (k/32)·64 bytes; the caller's promise for the
            // key; the packed kernel gets m rows of k/32 steps, the panel and out as given.
            unsafe {
                crate::kernels::amx::with_packed_rows(key, &rows[..m], k / 32, |pk, step| {
                    packed(pk, step, m, k, panel, out)
                })
            }
        }
        // SAFETY: forwarded.
        _ => unsafe { (path.dot)(staged, k, panel, out) },
    }
}

/// Whether `kernels` can stage bf16 activations at all (a bf16 dot or AMX path).
pub(crate) fn stages(kernels: &KernelSet) -> bool {
    kernels.bf16().is_some() || kernels.amx().is_some()
}

/// The bf16 kernel for an expert with `rows` rows on a projection with `k` inputs: AMX tiles,
/// else the vector bf16 dot, for experts with enough rows to be compute-bound; None means the
/// exact fp32 path. Formats that multiply bf16 panels share this rule.
pub(crate) fn path_for(kernels: &KernelSet, rows: usize, k: usize) -> Option<Bf16Path> {
    let bf16 = kernels.bf16().copied();
    kernels
        .amx()
        .filter(|a| a.applies(rows))
        .and_then(|a| a.bf16_path(k))
        .or(bf16.filter(|b| b.min_rows > 0 && rows >= b.min_rows))
}

/// Add `scale ·` one decoded block to `out` (32 per row): `decoded` is the bf16 panel of
/// inputs `b·block .. (b+1)·block` (32 × `block` values, panel order), multiplied with those
/// inputs of every row of `rows` through `path` (staged bf16 pairs) or, for `None`, the fp32
/// kernel, in row blocks of the kernel's size. Block 0 assigns, the others add. FP8 and the
/// group-scaled formats feed their decoded blocks through here. `reuse` (whole rows only: one
/// block of all inputs) lets the AMX kernel keep its packing of the rows for the next panel.
/// Rows before `first` are left alone (a decoding tile kernel did them).
///
/// # Safety
/// The [`ExpertFormat::gate_up_panel`] contract for `rows` of at least `(b+1)·block` inputs
/// (staged rows present when `path` is Some); `decoded` holds `32·block` values and `out` 32
/// per row.
#[allow(clippy::too_many_arguments)] // one block's product: each argument a fact of it
pub(crate) unsafe fn add_decoded_block(
    kernels: &KernelSet,
    path: Option<Bf16Path>,
    rows: &RowBlock,
    block: usize,
    b: usize,
    decoded: &[u16],
    scale: f32,
    out: &mut [f32],
    reuse: Option<u64>,
    first: usize,
) {
    let n = rows.len();
    assert!(decoded.len() >= PANEL * block && out.len() >= n * PANEL);
    // The decoder has just written the panel: no weight prefetch.
    let path = path.map(Bf16Path::for_cached_panels);
    let step = path.map_or(kernels.rows_per_block(), |p| p.rows_per_block);
    // Not zeroed: the kernels write (not add to) 32 results per row before they are read,
    // and zeroing 4 KiB per decoded block showed as 3-5% of an FP8 layer's samples.
    let mut partial = std::mem::MaybeUninit::<[f32; crate::kernels::MAX_ROWS * PANEL]>::uninit();
    let partial = partial.as_mut_ptr().cast::<f32>();
    let mut r0 = first;
    while r0 < n {
        let m = step.min(n - r0);
        let mut f32_rows = [std::ptr::null::<f32>(); crate::kernels::MAX_ROWS];
        let mut staged = [std::ptr::null::<u32>(); crate::kernels::MAX_ROWS];
        for i in 0..m {
            // Block b's inputs of each row: `block` floats, or block/2 staged bf16 pairs.
            f32_rows[i] = rows.f32_rows[r0 + i].wrapping_add(b * block);
            staged[i] = rows.prepared[r0 + i]
                .cast::<u32>()
                .wrapping_add(b * block / 2);
        }
        // SAFETY: the decoded block is the packed bf16 panel of a `block`-input matrix; the
        // rows hold block b's inputs (the contract); `partial` holds 32 per row.
        unsafe {
            match path {
                Some(p) => dot_staged(p, reuse, &staged[..m], block, decoded.as_ptr(), partial),
                None => kernels.panel_dot_raw(&f32_rows[..m], block, decoded.as_ptr(), partial),
            }
        }
        // SAFETY: the kernel above wrote the first 32·m floats (the kernels' contract).
        let partial = unsafe { std::slice::from_raw_parts(partial, m * PANEL) };
        let dst = &mut out[r0 * PANEL..(r0 + m) * PANEL];
        scaled_into(kernels, dst, partial, scale, b == 0);
        r0 += m;
    }
}

/// `dst = scale·src` (`assign`) or `dst += scale·src`, each element a multiply then an add
/// rounded separately (no FMA), so every variant gives the scalar loop's bits. AVX-512 or AVX2
/// where the kernels may use them: the crate's plain loops compile for SSE2, and this runs
/// once per decoded block and row block.
pub(crate) fn scaled_into(
    kernels: &KernelSet,
    dst: &mut [f32],
    src: &[f32],
    scale: f32,
    assign: bool,
) {
    assert_eq!(dst.len(), src.len());
    #[cfg(target_arch = "x86_64")]
    if kernels.level() >= crate::isa::Level::Avx512Base {
        // SAFETY: the level guarantees AVX-512F; equal lengths checked above.
        unsafe { scaled_into_avx512(dst, src, scale, assign) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if kernels.level() >= crate::isa::Level::Avx2 {
        // SAFETY: the level guarantees AVX2; equal lengths checked above.
        unsafe { scaled_into_avx2(dst, src, scale, assign) };
        return;
    }
    let _ = kernels;
    scaled_into_scalar(dst, src, scale, assign);
}

/// The scalar twin of [`scaled_into`], and the loop its vector variants compile: Rust never
/// fuses the multiply and the add, so the vectorised loops give these bits.
#[inline(always)]
pub(crate) fn scaled_into_scalar(dst: &mut [f32], src: &[f32], scale: f32, assign: bool) {
    if assign {
        dst.iter_mut().zip(src).for_each(|(o, v)| *o = scale * v);
    } else {
        dst.iter_mut().zip(src).for_each(|(o, v)| *o += scale * v);
    }
}

/// [`scaled_into_scalar`] vectorised for AVX-512.
///
/// # Safety
/// AVX-512F available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn scaled_into_avx512(dst: &mut [f32], src: &[f32], scale: f32, assign: bool) {
    scaled_into_scalar(dst, src, scale, assign);
}

/// [`scaled_into_scalar`] vectorised for AVX2.
///
/// # Safety
/// AVX2 available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn scaled_into_avx2(dst: &mut [f32], src: &[f32], scale: f32, assign: bool) {
    scaled_into_scalar(dst, src, scale, assign);
}

/// `values` (bf16 bits) times `scale`, each rounded to the nearest bf16 (ties to even): folds a
/// block scale into a decoded panel so the tiles run over all k in one call. AVX-512 where the
/// kernels may use it (every CPU with a bf16 path has it).
pub(crate) fn scale_bf16(kernels: &KernelSet, values: &mut [u16], scale: f32) {
    #[cfg(target_arch = "x86_64")]
    if kernels.level() >= crate::isa::Level::Avx512Base {
        // SAFETY: the level guarantees AVX-512F/BW.
        unsafe { scale_bf16_avx512(values, scale) };
        return;
    }
    let _ = kernels;
    scale_bf16_scalar(values, scale);
}

/// The scalar twin of [`scale_bf16`].
pub(crate) fn scale_bf16_scalar(values: &mut [u16], scale: f32) {
    for v in values {
        *v = crate::dtype::f32_to_bf16_bits(crate::dtype::bf16_bits_to_f32(*v) * scale);
    }
}

/// # Safety
/// AVX-512F and BW available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn scale_bf16_avx512(values: &mut [u16], scale: f32) {
    use std::arch::x86_64::*;
    let s = _mm512_set1_ps(scale);
    let (half, one) = (_mm512_set1_epi32(0x7FFF), _mm512_set1_epi32(1));
    let n = values.len();
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: 16 values from i < n.
        unsafe {
            let p = values.as_mut_ptr().add(i);
            let wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
            let f = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)), s);
            // Round to nearest even on the bits (no NaN reaches here: codes and scales were
            // checked at load, and half's conversion agrees on the canonical NaN anyway).
            let bits = _mm512_castps_si512(f);
            let lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
            let rounded =
                _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(half, lsb)), 16);
            _mm256_storeu_si256(p.cast(), _mm512_cvtepi32_epi16(rounded));
        }
        i += 16;
    }
    scale_bf16_scalar(&mut values[i..], scale);
}

/// The activation side of a format that feeds the bf16 panel kernels: x and SwiGLU rows staged
/// as bf16 pairs for the experts whose row count picks a bf16 path ([`path_for`]), SwiGLU rows
/// panel by panel while in cache. BF16 and FP8 answer these trait questions through it.
pub(crate) struct Staging<'a> {
    pub kernels: &'a KernelSet,
    pub hidden: usize,
    pub ranges: &'a [Range<usize>],
}

impl Staging<'_> {
    /// [`ExpertFormat::x_stride`].
    pub fn x_stride(&self) -> usize {
        if stages(self.kernels) {
            2 * self.hidden
        } else {
            0
        }
    }

    /// [`ExpertFormat::act_stride`].
    pub fn act_stride(&self, part: usize) -> usize {
        if stages(self.kernels) {
            2 * self.ranges[part].len()
        } else {
            0
        }
    }

    /// [`ExpertFormat::prepares_x`].
    pub fn prepares_x(&self, max_rows: usize) -> bool {
        path_for(self.kernels, max_rows, self.hidden).is_some()
    }

    /// [`ExpertFormat::prepares_act`].
    pub fn prepares_act(&self, max_rows: usize) -> bool {
        self.ranges
            .iter()
            .any(|r| path_for(self.kernels, max_rows, r.len()).is_some())
    }

    /// [`ExpertFormat::prepare_x`] and [`ExpertFormat::prepare_act`]: bf16 pairs, scale 1.
    pub fn stage(&self, values: &[f32], out: &mut [u8]) -> f32 {
        self.kernels.stage_bf16(values, as_pairs(out));
        1.0
    }

    /// [`ExpertFormat::prepare_act_panel`]: only the experts whose down panels take a bf16
    /// path read staged rows.
    pub fn stage_panel(&self, part: usize, expert_rows: usize, act: &[f32], out: &mut [u8]) {
        if path_for(self.kernels, expert_rows, self.ranges[part].len()).is_some() {
            self.kernels.stage_bf16(act, as_pairs(out));
        }
    }
}

/// The activation methods of [`ExpertFormat`] for a format staged as BF16 is ([`Staging`]):
/// expands inside its `impl ExpertFormat`, whose type has `fn staging(&self) -> Staging<'_>`.
macro_rules! staged_activations {
    () => {
        fn x_stride(&self, _part: usize) -> usize {
            self.staging().x_stride()
        }

        fn act_stride(&self, part: usize) -> usize {
            self.staging().act_stride(part)
        }

        fn prepares_x(&self, max_rows: usize) -> bool {
            self.staging().prepares_x(max_rows)
        }

        fn prepares_act(&self, max_rows: usize) -> bool {
            self.staging().prepares_act(max_rows)
        }

        fn prepare_x(&self, _part: usize, x: &[f32], out: &mut [u8]) -> f32 {
            self.staging().stage(x, out)
        }

        fn prepare_act(&self, _part: usize, act: &[f32], out: &mut [u8]) -> f32 {
            self.staging().stage(act, out)
        }

        fn prepares_act_per_panel(&self) -> bool {
            true
        }

        fn prepare_act_panel(&self, part: usize, expert_rows: usize, act: &[f32], out: &mut [u8]) {
            self.staging().stage_panel(part, expert_rows, act, out)
        }
    };
}
pub(crate) use staged_activations;

/// `[u8]` scratch as the `u32` pairs the staging kernel writes.
pub(crate) fn as_pairs(out: &mut [u8]) -> &mut [u32] {
    assert!(
        out.as_ptr().align_offset(4) == 0 && out.len().is_multiple_of(4),
        "misaligned bf16 staging row"
    );
    // SAFETY: aligned and a whole number of u32 (checked); any bits are valid u32.
    unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast(), out.len() / 4) }
}

impl ExpertFormat for Bf16Experts {
    fn method(&self) -> Method {
        Method::Bf16
    }

    fn kernel_name(&self) -> String {
        let vector = self.kernels.name();
        match self.kernels.amx_name() {
            Some(amx) => format!("{amx}+{vector}"),
            None => vector.to_string(),
        }
    }

    fn part_ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    staged_activations!();

    fn block_rows(&self, part: usize, expert_rows: usize, stage: Stage) -> usize {
        let k = match stage {
            Stage::GateUp => self.hidden,
            Stage::Down => self.ranges[part].len(),
        };
        self.bf16_for(expert_rows, k)
            .map_or(self.kernels.rows_per_block(), |b| b.rows_per_block)
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
        let (h, ip) = (self.hidden, self.ranges[part].len());
        let len = panel_len(h);
        let off = slot * 2 * ip * h + 2 * p * len;
        let gu = &self.parts[part].gate_up.as_slice()[off..off + 2 * len];
        // SAFETY: the trait's contract, forwarded for rows of H values.
        unsafe {
            self.panel(rows, h, &gu[..len], g);
            self.panel(rows, h, &gu[len..], u);
        }
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
        let (h, ip) = (self.hidden, self.ranges[part].len());
        let off = slot * h * ip + p * panel_len(ip);
        let panel = &self.parts[part].down.as_slice()[off..off + panel_len(ip)];
        // SAFETY: the trait's contract, forwarded for rows of ip values.
        unsafe { self.panel(rows, ip, panel, o) }
    }

    fn packs_from_source(&self) -> bool {
        true
    }

    fn gpu_rank_bytes(&self, gpu_tp: usize) -> Result<[usize; 4]> {
        let (h, i) = (self.hidden, self.ranges.last().map_or(0, |r| r.end));
        kt_ensure!(
            gpu_tp >= 1 && i.is_multiple_of(gpu_tp),
            Invalid,
            "BF16: moe_intermediate_size {i} does not split into {gpu_tp} GPU ranks"
        );
        let ir = i / gpu_tp;
        Ok([2 * ir * h * 2, 0, h * ir * 2, 0])
    }

    unsafe fn write_gpu_rank(
        &self,
        slot: usize,
        gpu_tp: usize,
        rank: usize,
        share: RowShare,
        dst: &GpuRankDst,
    ) -> Result<()> {
        let h = self.hidden;
        let ir = self.ranges.last().map_or(0, |r| r.end) / gpu_tp;
        let r0 = rank * ir;
        // Row `n` of a buffer of rows of `len` bf16 values; only this share's rows are formed
        // (other shares write the others at the same time).
        let buffer_row = |base: *mut u8, n: usize, len: usize| {
            // SAFETY: the caller's contract: w13 holds 2·ir rows of h values, w2 h rows of ir.
            unsafe { std::slice::from_raw_parts_mut((base as *mut u16).add(n * len), len) }
        };
        // w13: the rank's gate rows then its up rows, row-major bf16. A whole panel of the
        // part that is a whole 32-row block of the buffer is transposed at once (each panel
        // line holds a pair of inputs of its 32 rows); rows off that grid one at a time.
        for which in 0..2 {
            let mut row = 0;
            while row < ir {
                let n = which * ir + row;
                let (part, local) = locate(&self.ranges, r0 + row);
                let ip = self.ranges[part].len();
                let (p, j) = (local / PANEL, local % PANEL);
                let off = slot * 2 * ip * h + (2 * p + which) * panel_len(h);
                let panel = &self.parts[part].gate_up.as_slice()[off..off + panel_len(h)];
                let whole = j == 0 && n.is_multiple_of(PANEL) && row + PANEL <= ir;
                if share.has(n) {
                    if whole {
                        // SAFETY: the panel holds h/2 lines of 32 input pairs; buffer rows
                        // n..n+32 of h values (the caller's contract), this share's.
                        unsafe {
                            crate::lines::lines_to_rows(
                                panel.as_ptr() as *const u8,
                                h / 2,
                                4,
                                dst.w13.add(n * h * 2),
                                h * 2,
                            )
                        };
                    } else {
                        let out = buffer_row(dst.w13, n, h);
                        for (c, o) in out.iter_mut().enumerate() {
                            *o = panel[packed_index(j, c, h)];
                        }
                    }
                }
                row += if whole { PANEL } else { 1 };
            }
        }
        // w2: every output row over the rank's columns, row-major bf16, part by part; a
        // panel's 32 rows at once where the columns are whole input pairs.
        for (part, range) in self.ranges.iter().enumerate() {
            let (g0, g1) = (range.start.max(r0), range.end.min(r0 + ir));
            if g0 >= g1 {
                continue;
            }
            let (l0, l1, c0, ip) = (g0 - range.start, g1 - range.start, g0 - r0, range.len());
            let down = &self.parts[part].down.as_slice()[slot * h * ip..(slot + 1) * h * ip];
            let pairs = l0.is_multiple_of(2) && l1.is_multiple_of(2);
            // h is a multiple of 32 (MoeConfig), so the buffer's rows are whole panels.
            for p0 in (0..h).step_by(PANEL).filter(|&r| share.has(r)) {
                if pairs {
                    let first = packed_index(p0, l0, ip);
                    // SAFETY: panel p0/32 from input pair l0/2 holds (l1 − l0)/2 lines;
                    // buffer rows p0..p0+32 of ir values from column c0 (the contract).
                    unsafe {
                        crate::lines::lines_to_rows(
                            down[first..].as_ptr() as *const u8,
                            (l1 - l0) / 2,
                            4,
                            dst.w2.add((p0 * ir + c0) * 2),
                            ir * 2,
                        )
                    };
                    continue;
                }
                for hrow in p0..p0 + PANEL {
                    let out = buffer_row(dst.w2, hrow, ir);
                    for (o, lc) in out[c0..c0 + l1 - l0].iter_mut().zip(l0..l1) {
                        *o = down[packed_index(hrow, lc, ip)];
                    }
                }
            }
        }
        Ok(())
    }

    unsafe fn pack(&self, part: usize, slot: usize, proj: Proj, view: &MatrixView) -> Result<()> {
        let (h, ip) = (self.hidden, self.ranges[part].len());
        let (base, n, k) = match proj {
            Proj::Gate | Proj::Up => (self.parts[part].gate_up_dst, ip, h),
            Proj::Down => (self.parts[part].down_dst, h, ip),
        };
        assert!(slot < self.experts && view.rows == n && view.cols == k);
        for p in 0..n / PANEL {
            // gate panel p at slot 2p, up panel p at 2p+1 of the expert's gate_up run.
            let off = match proj {
                Proj::Gate => slot * 2 * n * k + 2 * p * panel_len(k),
                Proj::Up => slot * 2 * n * k + (2 * p + 1) * panel_len(k),
                Proj::Down => slot * n * k + p * panel_len(k),
            };
            // SAFETY: each (part, slot, proj, p) owns a disjoint panel inside its buffer
            // (2·E·n·k values for gate_up, E·n·k for down; the caller checked the shapes and
            // promises no other writer of this (part, slot, proj)).
            unsafe {
                let panel = std::slice::from_raw_parts_mut(base.get().add(off), panel_len(k));
                pack_panel(view, p, panel);
            }
        }
        Ok(())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_bf16_equals_its_scalar_twin() {
        let mut rng = crate::rng::Rng::new(21);
        for kernels in crate::kernels::runnable_levels()
            .into_iter()
            .filter_map(|l| KernelSet::for_level(l).ok())
        {
            for n in [0, 1, 15, 16, 33, 4096] {
                let values: Vec<u16> = (0..n)
                    .map(|_| crate::dtype::f32_to_bf16_bits(rng.normal() * 300.0))
                    .collect();
                for scale in [1.0f32, 1.7e-4, 3.3, -0.5, 1e38] {
                    let mut got = values.clone();
                    let mut want = values.clone();
                    scale_bf16(&kernels, &mut got, scale);
                    scale_bf16_scalar(&mut want, scale);
                    assert_eq!(got, want, "{} n={n} scale={scale}", kernels.name());
                    // The twin rounds each product to the nearest bf16.
                    for (w, v) in want.iter().zip(&values) {
                        let exact = crate::dtype::bf16_bits_to_f32(*v) as f64 * scale as f64;
                        let got = crate::dtype::bf16_bits_to_f32(*w) as f64;
                        assert!(
                            (got - exact).abs() <= exact.abs() * 2f64.powi(-8) || got.is_infinite()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn scaled_into_equals_its_scalar_twin() {
        let mut rng = crate::rng::Rng::new(17);
        for level in [
            crate::isa::Level::Generic,
            crate::isa::Level::Avx2,
            crate::isa::Level::Avx512Base,
        ] {
            if !crate::isa::allows(level) {
                continue;
            }
            let kernels = KernelSet::for_level(level).unwrap();
            for n in [1, 16, 37, 384] {
                let src = rng.normals(n, 1.0);
                for assign in [true, false] {
                    let start = rng.normals(n, 1.0);
                    let (mut want, mut got) = (start.clone(), start);
                    scaled_into_scalar(&mut want, &src, 0.37, assign);
                    scaled_into(&kernels, &mut got, &src, 0.37, assign);
                    assert_eq!(got, want, "{level:?} n={n} assign={assign}");
                }
            }
        }
    }
}
