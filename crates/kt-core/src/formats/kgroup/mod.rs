//! The group-scaled methods: small codes with one scale per row and group of inputs.
//!
//! | method | codes | scale per group | GPU write (`write_weight_scale_to_buffer`) |
//! |---|---|---|---|
//! | RAWINT4 (Kimi-K2) | int4 `q + 8` | bf16, group 32 | checkpoint bytes |
//! | GPTQ_INT4 | int4 `q + 8` | f16, group 128 | GPTQ `qweight [K/8, N]` / `scales [K/g, N]` |
//! | MXFP4 (DeepSeek-V4-Flash) | E2M1 | E8M0, group 32 | codes; scales as bf16 |
//! | NVFP4 | E2M1 | E4M3 × per-tensor f32, group 16 | codes; scale × global as bf16 |
//! | MXFP8 (MiniMax-M3) | E4M3 | E8M0, group 32 | checkpoint bytes |
//!
//! The codes stay in their bits (one byte, or two nibbles a byte) and the scales in their own
//! type, so an expert takes the memory it takes in the file. Memory of one part (intermediate
//! slice of `ip` rows, a multiple of 32 and of the group):
//! - `gate_up`: per expert, per 32-row panel, the panel's gate codes then its up codes, each
//!   in panel lines ([`kernels`]): input pair `q` of the panel's 32 rows;
//! - `down`: per expert, its `H/32` panels over the slice's `ip` inputs;
//! - the scales alike: per panel, per group, the 32 rows' scales; NVFP4's per-tensor scale per
//!   (expert, projection).
//!
//! A panel call with one to four rows (decode) runs the fused kernel on the codes; more rows
//! decode each block of 128 (or 32) inputs to a bf16 panel with the scales folded in, once per
//! call, and the bf16 panel kernels (fp32 FMA, `vdpbf16ps`, AMX tiles, as method BF16 picks
//! them) multiply it.
//!
//! Loading copies the codes and scales of a checkpoint in the method's own format and group
//! size; anything else (bf16/fp16/fp32 tensors, another format) is quantized per group
//! ([`crate::encode::quantize_row`]) into those codes, which then take the same copy.
use super::{bf16, locate, ExpertFormat, GpuRankDst, PanelAcc, PanelAt, RowBlock, RowShare, Stage};
use crate::codes::{CodeKind, CodeLayout, CodedMatrix, ScaleLayout, ScaleType};
use crate::expert::{MoeConfig, Proj};
use crate::isa::Level;
use crate::kernels::{KernelSet, MAX_ROWS};
use crate::method::Method;
use crate::pack::{AlignedBuf, MatrixView, PANEL};
use crate::sync_ptr::SyncPtr;
use crate::{kt_bail, kt_ensure, Result};
use std::any::Any;
use std::ops::Range;

pub mod int_dot;
pub mod kernels;

use kernels::KGroupKernels;

/// How a method's scales reach the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GpuScales {
    /// The stored bytes.
    Native,
    /// Each scale's value (times the per-tensor scale) as bf16.
    Bf16Value,
}

/// One group-scaled method.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// The method.
    pub method: Method,
    /// Its codes.
    pub kind: CodeKind,
    /// Its scales.
    pub scale_type: ScaleType,
    /// Group size when quantizing (a checkpoint's own group size wins when loading it).
    pub default_group: usize,
    /// Whether a per-tensor f32 multiplies each projection (NVFP4).
    pub global: bool,
    /// Whether prefill may cut activations to 8 bits per chunk of 32 (the many-row integer
    /// kernel at twice the rate): only where the original's own error leaves room (RAWINT4,
    /// whose original computes with int8 activations); the others keep 15 bits.
    pub coarse_prefill: bool,
    gpu_scales: GpuScales,
    /// The original's backend variable for this method.
    backend_var: Option<&'static str>,
}

/// `out` times a projection's per-tensor scale (NVFP4's; 1, left alone, for the others).
fn times_global(out: &mut [f32], global: f32) {
    if global != 1.0 {
        out.iter_mut().for_each(|o| *o *= global);
    }
}

/// Rows per expert that the few-row (decode) integer kernels take; more go to the many-row ones
/// (unless [`int_dot::fine_few_rows`] says fewer for a 15-bit method).
const FEW_ROWS: usize = 4;

/// RAWINT4.
pub const RAWINT4: Spec = Spec {
    method: Method::RawInt4,
    kind: CodeKind::Int4,
    scale_type: ScaleType::Bf16,
    default_group: 32,
    global: false,
    coarse_prefill: true,
    gpu_scales: GpuScales::Native,
    backend_var: Some("KT_RAWINT4_BACKEND"),
};
/// GPTQ_INT4.
pub const GPTQ_INT4: Spec = Spec {
    method: Method::GptqInt4,
    kind: CodeKind::Int4,
    scale_type: ScaleType::F16,
    default_group: 128,
    global: false,
    coarse_prefill: false,
    gpu_scales: GpuScales::Native,
    backend_var: Some("KT_GPTQ_INT4_BACKEND"),
};
/// MXFP4.
pub const MXFP4: Spec = Spec {
    method: Method::MxFp4,
    kind: CodeKind::E2M1,
    scale_type: ScaleType::E8M0,
    default_group: 32,
    global: false,
    coarse_prefill: false,
    gpu_scales: GpuScales::Bf16Value,
    backend_var: Some("KT_MXFP4_BACKEND"),
};
/// NVFP4.
pub const NVFP4: Spec = Spec {
    method: Method::NvFp4,
    kind: CodeKind::E2M1,
    scale_type: ScaleType::E4M3,
    default_group: 16,
    global: true,
    coarse_prefill: false,
    gpu_scales: GpuScales::Bf16Value,
    backend_var: None,
};
/// MXFP8.
pub const MXFP8: Spec = Spec {
    method: Method::MxFp8,
    kind: CodeKind::E4M3,
    scale_type: ScaleType::E8M0,
    default_group: 32,
    global: false,
    coarse_prefill: false,
    gpu_scales: GpuScales::Native,
    backend_var: Some("KT_MXFP8_BACKEND"),
};

/// The prefetch distance of this family's decode kernels, measured once per process (or
/// `KT_KERNEL_PREFETCH`); see [`crate::kernels::prefetch`].
pub fn prefetch_distance() -> Result<usize> {
    crate::kernels::calibrate::ensure_prefetch_chosen(
        crate::kernels::prefetch::Family::CodeGroups,
        int_dot::calibration_workload,
    )
}

macro_rules! builder {
    ($name:ident, $spec:ident) => {
        #[doc = concat!("The registry's builder for ", stringify!($spec), ".")]
        pub fn $name(
            config: &MoeConfig,
            parts: usize,
            kernels: KernelSet,
        ) -> Result<Box<dyn ExpertFormat>> {
            Ok(Box::new(KGroupExperts::new(
                config,
                parts,
                kernels,
                $spec,
                $spec.default_group,
                $spec.default_group,
            )?))
        }
    };
}
builder!(rawint4, RAWINT4);
builder!(gptq_int4, GPTQ_INT4);
builder!(mxfp4, MXFP4);
builder!(nvfp4, NVFP4);
builder!(mxfp8, MXFP8);

/// What decodes `spec`'s codes for one to four rows at `level` (for `cpu_info`): the integer
/// kernel for 4-bit codes, the fp32 one for E4M3, else the bf16-panel decoder.
pub fn decode_kernel_name(spec: &Spec, level: Level) -> &'static str {
    if spec.kind.bits() == 4 {
        #[cfg(target_arch = "x86_64")]
        {
            if level >= Level::Avx512Vnni {
                return "int-avx512-vnni";
            }
            if level >= Level::Avx2 {
                return if int_dot::avx_vnni() {
                    "int-avx-vnni"
                } else {
                    "int-avx2"
                };
            }
        }
    } else if kernels::kernels_for(spec.kind, level).fused.is_some() {
        return if level >= Level::Avx512Base {
            "fp32-avx512"
        } else {
            "fp32-avx2"
        };
    }
    kernels::kernels_for(spec.kind, level).name
}

/// Rows per expert from which the 15-bit kinds (GPTQ_INT4, MXFP4, NVFP4) multiply decoded bf16
/// panels instead of running the two-pass 15-bit kernel, on CPUs whose bf16 dot product beat
/// fp32 FMA in the calibration (both compute at the same peak: one bf16 pair per int8 pair
/// of two passes). Measured on an AMD Zen 4 (S1 layer, `examples/prefill`, medians): at 512
/// tokens (32 rows per expert) MXFP4 140 -> 109 ms, NVFP4 195 -> 119, GPTQ_INT4 143 -> 117; at
/// 256 tokens thresholds 12-16 beat 24 and never; at 128 tokens (8 rows) the 15-bit kernel
/// is as fast or faster. With fp32 FMA (AVX2) the decoded panels lose at every size.
pub const BF16_PANELS_FROM_ROWS: usize = 16;

/// The rows per expert from which `spec`'s prefill may take bf16 panels instead of its integer
/// kernel ([`BF16_PANELS_FROM_ROWS`] for the 15-bit kinds; the others never switch).
fn bf16_panels_from(spec: &Spec) -> Option<usize> {
    (spec.kind.bits() == 4 && !spec.coarse_prefill).then_some(BF16_PANELS_FROM_ROWS)
}

/// What multiplies `spec`'s codes for experts with more rows (prefill) with `kernels` where AMX
/// does not take them: [`int_prefill_kernel_name`], followed for the 15-bit kinds by
/// `; bf16-panels from 16 rows` where the set has a bf16 dot path.
pub fn prefill_kernel_name(spec: &Spec, kernels: &KernelSet) -> String {
    let int = int_prefill_kernel_name(spec, kernels.level());
    match bf16_panels_from(spec).filter(|_| kernels.bf16().is_some()) {
        Some(rows) => format!("{int}; bf16-panels from {rows} rows"),
        None => int.to_string(),
    }
}

/// The many-row integer kernel for 4-bit codes at `level` (`int8-…`: 8-bit activations,
/// `int15-…`: the two-byte 15-bit ones), else bf16 panels from the decoder.
pub fn int_prefill_kernel_name(spec: &Spec, level: Level) -> &'static str {
    if spec.kind.bits() == 4 {
        #[cfg(target_arch = "x86_64")]
        {
            let vnni = level >= Level::Avx512Vnni;
            if level >= Level::Avx2 {
                let avx_vnni = int_dot::avx_vnni();
                return match (spec.coarse_prefill, vnni, avx_vnni) {
                    (true, true, _) => "int8-gemm-avx512-vnni",
                    (true, false, true) => "int8-gemm-avx-vnni",
                    (true, false, false) => "int8-gemm-avx2",
                    (false, true, _) => "int15-gemm-avx512-vnni",
                    (false, false, true) => "int15-gemm-avx-vnni",
                    (false, false, false) => "int15-gemm-avx2",
                };
            }
        }
    }
    "bf16-panels"
}

/// The kernels a method runs with: the original's backend variable may ask for the AVX2 ones
/// (`avx2`); its other names (`amx`, `amx_blocked`, `blocked`, `avxvnni`, `packed`) name
/// kernels of the original and mean the best ones here.
fn backend_kernels(spec: &Spec, kernels: KernelSet) -> Result<KernelSet> {
    let Some(var) = spec.backend_var else {
        return Ok(kernels);
    };
    let Ok(value) = std::env::var(var) else {
        return Ok(kernels);
    };
    let debug = std::env::var("KT_KERNEL_DEBUG").is_ok_and(|v| v == "1");
    match value.trim().to_ascii_lowercase().as_str() {
        "avx2" if kernels.level() > Level::Avx2 && crate::isa::allows(Level::Avx2) => {
            if debug {
                eprintln!(
                    "kt_kernel: {var}=avx2: {} runs the AVX2 kernels",
                    spec.method
                );
            }
            KernelSet::for_level(Level::Avx2)
        }
        "" | "auto" => Ok(kernels),
        other => {
            if debug {
                eprintln!(
                    "kt_kernel: {var}={other}: no such backend here; {} runs its best kernels \
                     ({})",
                    spec.method,
                    kernels.name()
                );
            }
            Ok(kernels)
        }
    }
}

/// One part's codes and scales (layout in the module docs), with write addresses for `pack`.
struct Part {
    gate_up: AlignedBuf<u8>,
    down: AlignedBuf<u8>,
    gate_up_scales: AlignedBuf<u8>,
    down_scales: AlignedBuf<u8>,
    /// Per (expert, projection) per-tensor scale (1 unless NVFP4).
    globals: AlignedBuf<f32>,
    dst: [SyncPtr<u8>; 2],
    scale_dst: [SyncPtr<u8>; 2],
    global_dst: SyncPtr<f32>,
}

/// The GPU bytes (bf16) of every one-byte scale code times one per-tensor scale, built once
/// per per-tensor scale while writing an expert for a GPU.
struct GpuScaleTable {
    /// The per-tensor scale's bits the table was built for.
    global: Option<u32>,
    bytes: [[u8; 2]; 256],
}

/// The experts of one layer in a group-scaled method.
pub struct KGroupExperts {
    spec: Spec,
    kernels: KernelSet,
    code_kernels: KGroupKernels,
    /// The integer few-row kernel (4-bit kinds from AVX2 on) and the rows it takes.
    int: Option<(int_dot::IntFusedFn, usize)>,
    /// The integer many-row kernel (prefill; where `int` exists) and the rows it takes.
    int_gemm: Option<(int_dot::IntFusedFn, usize)>,
    /// `int_gemm` in the form that keeps what it made of a row block across panels, where
    /// it has one.
    int_gemm_reusing: Option<int_dot::IntReusingFn>,
    /// Rows per expert up to which `int` runs rather than `int_gemm`.
    few_rows: usize,
    /// Rows per expert from which decoded bf16 panels replace `int_gemm` where the kernel set
    /// has a bf16 dot path ([`BF16_PANELS_FROM_ROWS`] for the 15-bit kinds, else never).
    bf16_panels_from: usize,
    weight_bytes: int_dot::WeightBytes,
    /// Whether any kernel reads the staged bf16 rows (else preparing skips them).
    reads_staged: bool,
    /// Whether prepared rows get their `x16` inputs ([`int_dot::reads_wide`]).
    wide_rows: bool,
    /// Inputs per scale of gate/up (over `H`) and of down (over `I`).
    groups: [usize; 2],
    hidden: usize,
    experts: usize,
    ranges: Vec<Range<usize>>,
    parts: Vec<Part>,
}

impl KGroupExperts {
    /// Room for `config.num_experts` experts in `parts` parts, with `group_gu` inputs per scale
    /// in gate/up and `group_down` in down.
    pub fn new(
        config: &MoeConfig,
        parts: usize,
        kernels: KernelSet,
        spec: Spec,
        group_gu: usize,
        group_down: usize,
    ) -> Result<KGroupExperts> {
        prefetch_distance()?;
        let method = spec.method;
        let (h, i) = (config.hidden, config.intermediate);
        kt_ensure!(
            group_gu >= 2
                && group_down >= 2
                && group_gu.is_multiple_of(2)
                && group_down.is_multiple_of(2)
                && h.is_multiple_of(group_gu)
                && i.is_multiple_of(group_down),
            Invalid,
            "{method}: group sizes {group_gu} (gate/up) and {group_down} (down) must be even and \
             divide hidden_size {h} and moe_intermediate_size {i}"
        );
        kt_ensure!(
            spec.kind.bits() == 8 || (group_gu.is_multiple_of(8) && group_down.is_multiple_of(8)),
            Invalid,
            "{method}: group sizes {group_gu} and {group_down} must be multiples of 8 (4-bit \
             codes are kept in words of 8)"
        );
        // The integer kernels cut activations in chunks of 32 inputs and the decoder works in
        // blocks of 32 or 128 inputs: a group must tile them or be tiled by them. A group such
        // as 24, 40 or 48 straddles the chunks (the kernels gave wrong sums, without an error).
        let tiles =
            |g: usize| 32 % g == 0 || (g.is_multiple_of(32) && (g <= 128 || g.is_multiple_of(128)));
        for (g, which) in [(group_gu, "gate/up"), (group_down, "down")] {
            kt_ensure!(
                tiles(g),
                Invalid,
                "{method}: group size {g} ({which}) is not supported: groups must divide 32 or \
                 be 64, 96 or 128, or a multiple of 128"
            );
        }
        // Each part's down slice holds whole groups and whole panels.
        let unit = lcm(PANEL, group_down);
        kt_ensure!(
            h.is_multiple_of(PANEL),
            Invalid,
            "{method} needs hidden_size ({h}) to be a multiple of {PANEL}"
        );
        kt_ensure!(
            i.is_multiple_of(unit),
            Invalid,
            "{method} needs moe_intermediate_size ({i}) to be a multiple of {unit}"
        );
        config.check_blocks(parts, unit)?;
        let ranges = config.part_ranges_in_units(parts, unit);
        let kernels = backend_kernels(&spec, kernels)?;
        let (e, bits, ss) = (config.num_experts, spec.kind.bits(), spec.scale_type.size());
        let parts = ranges
            .iter()
            .map(|inter| {
                let ip = inter.len();
                let codes = ip * h * bits / 8;
                let mut gate_up = AlignedBuf::zeroed(e * 2 * codes)?;
                let mut down = AlignedBuf::zeroed(e * codes)?;
                let mut gate_up_scales = AlignedBuf::zeroed(e * 2 * ip * (h / group_gu) * ss)?;
                let mut down_scales = AlignedBuf::zeroed(e * h * (ip / group_down) * ss)?;
                let mut globals = AlignedBuf::zeroed(e * 3)?;
                globals.as_mut_slice().fill(1.0);
                Ok(Part {
                    dst: [
                        SyncPtr::new(gate_up.as_mut_ptr()),
                        SyncPtr::new(down.as_mut_ptr()),
                    ],
                    scale_dst: [
                        SyncPtr::new(gate_up_scales.as_mut_ptr()),
                        SyncPtr::new(down_scales.as_mut_ptr()),
                    ],
                    global_dst: SyncPtr::new(globals.as_mut_ptr()),
                    gate_up,
                    down,
                    gate_up_scales,
                    down_scales,
                    globals,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // The many-row kernel (15-bit activations unless the method's prefill is coarse) and,
        // for the 15-bit one, its form that keeps a row block's packing across panels.
        let (int_gemm, int_gemm_reusing) = match (spec.kind.bits(), spec.coarse_prefill) {
            (4, true) => (int_dot::int_gemm_for(kernels.level()), None),
            (4, false) => (
                int_dot::int_fine_gemm_for(kernels.level()),
                int_dot::int_fine_gemm_reusing_for(kernels.level()),
            ),
            _ => (None, None),
        };
        // Staged bf16 rows feed AMX tiles and the bf16 panels; RAWINT4's integer kernels
        // take every block of rows elsewhere.
        let reads_staged =
            kernels.amx().is_some() || int_gemm.is_none() || bf16_panels_from(&spec).is_some();
        Ok(KGroupExperts {
            reads_staged,
            code_kernels: kernels::kernels_for(spec.kind, kernels.level()),
            int: if spec.kind.bits() == 4 {
                int_dot::int_fused_for(kernels.level())
            } else {
                None
            },
            int_gemm,
            int_gemm_reusing,
            few_rows: if spec.coarse_prefill {
                FEW_ROWS
            } else {
                int_dot::fine_few_rows(kernels.level()).min(FEW_ROWS)
            },
            bf16_panels_from: bf16_panels_from(&spec).unwrap_or(usize::MAX),
            weight_bytes: int_dot::WeightBytes::of(spec.kind, spec.scale_type),
            wide_rows: int_dot::reads_wide(kernels.level()),
            spec,
            kernels,
            groups: [group_gu, group_down],
            hidden: h,
            experts: e,
            ranges,
            parts,
        })
    }

    /// Inputs per scale of `proj`.
    fn group(&self, proj: Proj) -> usize {
        self.groups[(proj == Proj::Down) as usize]
    }

    /// Bytes of one panel line (an input pair of 32 rows).
    fn line_bytes(&self) -> usize {
        PANEL * 2 * self.spec.kind.bits() / 8
    }

    /// The codes of a panel line as one element per row ([`crate::lines`]): its bytes and the
    /// inputs it holds (a byte pair of 2 inputs for 8-bit codes, a word of 8 for 4-bit).
    fn line_element(&self) -> (usize, usize) {
        if self.spec.kind.bits() == 8 {
            (2, 2)
        } else {
            (4, 8)
        }
    }

    /// `(n, k)` of `proj` in `part`.
    fn shape(&self, part: usize, proj: Proj) -> (usize, usize) {
        let (h, ip) = (self.hidden, self.ranges[part].len());
        match proj {
            Proj::Gate | Proj::Up => (ip, h),
            Proj::Down => (h, ip),
        }
    }

    /// Byte offsets of the panel holding row `row` of `proj` of `slot` in its part's code
    /// buffer and scale buffer.
    fn offsets(&self, part: usize, slot: usize, proj: Proj, row: usize) -> (usize, usize) {
        let (n, k) = self.shape(part, proj);
        let (lb, ss) = (self.line_bytes(), self.spec.scale_type.size());
        let (panel_codes, panel_scales) = ((k / 2) * lb, (k / self.group(proj)) * PANEL * ss);
        let p = row / PANEL;
        let index = match proj {
            Proj::Gate | Proj::Up => (slot * (n / PANEL) + p) * 2 + (proj == Proj::Up) as usize,
            Proj::Down => slot * (n / PANEL) + p,
        };
        (index * panel_codes, index * panel_scales)
    }

    /// The code buffer, scale buffer and per-tensor scales of `proj` in `part`.
    fn buffers(&self, part: usize, proj: Proj) -> (&[u8], &[u8], &[f32]) {
        let p = &self.parts[part];
        match proj {
            Proj::Down => (
                p.down.as_slice(),
                p.down_scales.as_slice(),
                p.globals.as_slice(),
            ),
            _ => (
                p.gate_up.as_slice(),
                p.gate_up_scales.as_slice(),
                p.globals.as_slice(),
            ),
        }
    }

    /// Index of `(slot, proj)`'s per-tensor scale.
    fn global_index(slot: usize, proj: Proj) -> usize {
        slot * 3
            + match proj {
                Proj::Gate => 0,
                Proj::Up => 1,
                Proj::Down => 2,
            }
    }

    /// [`KGroupExperts::copy_codes`] a panel at a time, where the view's codes are whole
    /// elements of the panel lines ([`crate::lines`]: rows of bytes, or GPTQ's words, which
    /// are the lines already) and every code and scale passes the checks; false (nothing
    /// written) otherwise, for the element-wise copy to run and name what it finds.
    ///
    /// # Safety
    /// As [`ExpertFormat::pack`]; `m` is `view`'s codes in this method's kind, scale type and
    /// group size.
    unsafe fn copy_panels(
        &self,
        part: usize,
        slot: usize,
        proj: Proj,
        view: &MatrixView,
        m: &CodedMatrix,
    ) -> bool {
        let (n, k, group) = (view.rows, view.cols, self.group(proj));
        let (bits, ss) = (self.spec.kind.bits(), self.spec.scale_type.size());
        let (elem, per_elem) = self.line_element();
        let gptq = m.layout == CodeLayout::GptqColumns;
        // GPTQ's words are 4-bit codes only.
        if !n.is_multiple_of(PANEL)
            || !k.is_multiple_of(per_elem)
            || !m.col0.is_multiple_of(per_elem)
            || (gptq && bits == 8)
        {
            return false;
        }
        let (groups, all_groups) = (k / group, m.cols / group);
        let scale_index = |r: usize, g: usize| match m.scale_layout {
            ScaleLayout::RowMajor => (m.row0 + r) * all_groups + m.col0 / group + g,
            ScaleLayout::Transposed => (m.col0 / group + g) * m.rows + m.row0 + r,
        };
        // The checks of the element-wise copy, on every scale and code first.
        let kind = self.spec.kind;
        let scale_ok = |bits: u16| {
            self.spec.scale_type.is_valid(bits)
                && (self.spec.scale_type.value(bits) * kind.max() * m.global).is_finite()
        };
        // The view's scales as runs of contiguous stored scales: a row's groups, or (GPTQ) a
        // group's rows.
        let runs: Vec<&[u8]> = match m.scale_layout {
            ScaleLayout::RowMajor => (0..n)
                .map(|r| (scale_index(r, 0), groups))
                .collect::<Vec<_>>(),
            ScaleLayout::Transposed => (0..groups).map(|g| (scale_index(0, g), n)).collect(),
        }
        .into_iter()
        // SAFETY: each run is inside the live view's scales.
        .map(|(i, len)| unsafe { std::slice::from_raw_parts(m.scales.add(i * ss), len * ss) })
        .collect();
        let all_ok = if ss == 1 {
            let ok: [bool; 256] = std::array::from_fn(|b| scale_ok(b as u16));
            runs.iter().all(|run| run.iter().all(|&b| ok[b as usize]))
        } else {
            // bf16 and f16 order their magnitudes as their bits without the sign (infinities,
            // then NaNs, above every finite value), and the check is monotonic in the
            // magnitude: the largest magnitude passing clears them all.
            let largest = runs
                .iter()
                .flat_map(|run| run.chunks_exact(2))
                .map(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7FFF)
                .max()
                .unwrap_or(0);
            scale_ok(largest)
        };
        if !all_ok {
            return false;
        }
        let row_bytes = m.cols * bits / 8;
        let row_start = |r: usize| (m.row0 + r) * row_bytes + m.col0 * bits / 8;
        if kind == CodeKind::E4M3 {
            debug_assert!(bits == 8 && !gptq);
            for r in 0..n {
                // SAFETY: row r's k codes of the live view.
                let codes = unsafe { std::slice::from_raw_parts(m.codes.add(row_start(r)), k) };
                if crate::codes::any_e4m3_nan(codes) {
                    return false;
                }
            }
        }
        let idx = (proj == Proj::Down) as usize;
        let p = &self.parts[part];
        let (dst, scale_dst) = (p.dst[idx], p.scale_dst[idx]);
        let line = PANEL * elem;
        for r0 in (0..n).step_by(PANEL) {
            let (at, scale_at) = self.offsets(part, slot, proj, r0);
            // SAFETY: the panel's k/per_elem lines and its groups' scales, this (part, slot,
            // proj)'s alone (the caller's contract); the sources are rows r0..r0+32 of the live
            // view (rows of row_bytes, or GPTQ's word columns of m.rows words).
            unsafe {
                let (codes, scales) = (dst.get().add(at), scale_dst.get().add(scale_at));
                if gptq {
                    for w in 0..k / 8 {
                        let word = (m.col0 / 8 + w) * m.rows + m.row0 + r0;
                        std::ptr::copy_nonoverlapping(
                            m.codes.add(word * 4),
                            codes.add(w * line),
                            line,
                        );
                    }
                } else {
                    crate::lines::rows_to_lines(
                        m.codes.add(row_start(r0)),
                        row_bytes,
                        k / per_elem,
                        elem,
                        codes,
                    );
                }
                match m.scale_layout {
                    ScaleLayout::RowMajor => crate::lines::rows_to_lines(
                        m.scales.add(scale_index(r0, 0) * ss),
                        all_groups * ss,
                        groups,
                        ss,
                        scales,
                    ),
                    ScaleLayout::Transposed => {
                        for g in 0..groups {
                            std::ptr::copy_nonoverlapping(
                                m.scales.add(scale_index(r0, g) * ss),
                                scales.add(g * PANEL * ss),
                                PANEL * ss,
                            );
                        }
                    }
                }
            }
        }
        // SAFETY: this (part, slot, proj)'s per-tensor scale, written by this task alone.
        unsafe { *p.global_dst.get().add(Self::global_index(slot, proj)) = m.global };
        true
    }

    /// Copy a view of this method's own codes and group size.
    ///
    /// # Safety
    /// As [`ExpertFormat::pack`].
    unsafe fn copy_codes(
        &self,
        part: usize,
        slot: usize,
        proj: Proj,
        view: &MatrixView,
        m: &CodedMatrix,
    ) -> Result<()> {
        let (n, k) = (view.rows, view.cols);
        let (bits, ss, group) = (
            self.spec.kind.bits(),
            self.spec.scale_type.size(),
            self.group(proj),
        );
        let idx = (proj == Proj::Down) as usize;
        let p = &self.parts[part];
        let (dst, scale_dst) = (p.dst[idx], p.scale_dst[idx]);
        kt_ensure!(
            m.global.is_finite(),
            Invalid,
            "{} expert slot {slot} {proj:?}: per-tensor scale {} is not finite",
            self.spec.method,
            m.global
        );
        // SAFETY: forwarded.
        if unsafe { self.copy_panels(part, slot, proj, view, m) } {
            return Ok(());
        }
        for r in 0..n {
            let (at, scale_at) = self.offsets(part, slot, proj, r);
            let j = r % PANEL;
            for q in 0..k / 2 {
                // SAFETY: (r, 2q + 1) is inside the live view.
                let (lo, hi) = unsafe { (m.code(r, 2 * q), m.code(r, 2 * q + 1)) };
                if self.spec.kind.is_nan(lo) || self.spec.kind.is_nan(hi) {
                    kt_bail!(
                        Invalid,
                        "{} weight of expert slot {slot} {proj:?} holds a NaN code at row {r}, \
                         column {} of this part",
                        self.spec.method,
                        2 * q + self.spec.kind.is_nan(hi) as usize
                    );
                }
                // SAFETY: bytes of row r in line q of this (part, slot, proj)'s panel, which
                // only this task writes (the caller's contract).
                unsafe {
                    if bits == 8 {
                        let b = dst.get().add(at + q * 64 + 2 * j);
                        *b = lo;
                        *b.add(1) = hi;
                    } else {
                        *dst.get().add(at + kernels::nibble_byte(q, j)) = lo | (hi << 4);
                    }
                }
            }
            for g in 0..k / group {
                // SAFETY: (r, g·group) is inside the live view.
                let bits = unsafe { m.scale_bits(r, g * group) };
                kt_ensure!(
                    self.spec.scale_type.is_valid(bits),
                    Invalid,
                    "{} scale of expert slot {slot} {proj:?} row {r}, group {g} of this part is \
                     not a finite number ({:?} bits {bits:#x})",
                    self.spec.method,
                    self.spec.scale_type
                );
                // E8M0 reaches 2^127: its largest codes would be infinite weights.
                let widest = self.spec.scale_type.value(bits) * self.spec.kind.max() * m.global;
                kt_ensure!(
                    widest.is_finite(),
                    Invalid,
                    "{} scale of expert slot {slot} {proj:?} row {r}, group {g} of this part \
                     ({:?} bits {bits:#x}) makes the group's largest code {widest}, beyond f32",
                    self.spec.method,
                    self.spec.scale_type
                );
                let at = scale_at + (g * PANEL + j) * ss;
                // SAFETY: this row's scale of group g, this (part, slot, proj)'s alone.
                unsafe {
                    let d = scale_dst.get().add(at);
                    *d = bits as u8;
                    if ss == 2 {
                        *d.add(1) = (bits >> 8) as u8;
                    }
                }
            }
        }
        // SAFETY: this (part, slot, proj)'s per-tensor scale, written by this task alone.
        unsafe { *p.global_dst.get().add(Self::global_index(slot, proj)) = m.global };
        Ok(())
    }

    /// Quantize any view (floats, FP8, another group format) per group.
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
        let (kind, st) = (self.spec.kind, self.spec.scale_type);
        let (ss, group) = (st.size(), self.group(proj));
        // Two passes over the view, a row at a time: the largest magnitude first (NVFP4's
        // per-tensor scale and the range check need it before any code), then the codes. A
        // row stays in L1 where a whole matrix of f32 (6 MB for an S1 projection) went through
        // memory twice.
        let mut row = vec![0f32; k];
        let mut amax = 0f32;
        for r in 0..n {
            // SAFETY: row r < n of the live view; `row` has k values.
            unsafe { view.row_f32(r, &mut row) };
            let Some(a) = crate::quant::finite_abs_max(&row) else {
                kt_bail!(
                    Invalid,
                    "expert slot {slot} {proj:?} holds a non-finite weight in row {r}"
                );
            };
            amax = amax.max(a);
        }
        // NVFP4: a per-tensor scale that maps the largest weight to the largest code times the
        // largest E4M3 scale; the others have none.
        let global = if self.spec.global && amax > 0.0 {
            amax / (kind.max() * 448.0)
        } else {
            1.0
        };
        // The largest group scale must have a finite code (GPTQ_INT4's fp16 scales end at 65504,
        // beyond which the group would decode to NaN).
        let widest = st.encode_at_least(amax / global / kind.max());
        kt_ensure!(
            st.value(widest).is_finite(),
            Invalid,
            "expert slot {slot} {proj:?}: a weight of magnitude {amax} needs a group scale of \
             {}, beyond the range of the format's {st:?} scales",
            amax / global / kind.max()
        );
        // The codes and scales a checkpoint of this method would hold, row-major, then the
        // copy a file load takes: the same bytes as a load of that file, by construction.
        let (bits, groups) = (kind.bits(), k / group);
        let row_bytes = k * bits / 8;
        let mut codes = vec![0u8; n * row_bytes];
        let mut scales = vec![0u8; n * groups * ss];
        let mut row_scales = vec![0u16; groups];
        for r in 0..n {
            // SAFETY: as in the first pass.
            unsafe { view.row_f32(r, &mut row) };
            let out = &mut codes[r * row_bytes..][..row_bytes];
            crate::encode::quantize_row(kind, st, global, &row, group, out, &mut row_scales);
            let out = scales[r * groups * ss..][..groups * ss].chunks_exact_mut(ss);
            for (o, b) in out.zip(&row_scales) {
                o.copy_from_slice(&b.to_le_bytes()[..ss]);
            }
        }
        let m = CodedMatrix {
            kind,
            codes: codes.as_ptr(),
            layout: CodeLayout::RowMajor,
            scales: scales.as_ptr(),
            scale_type: st,
            scale_layout: ScaleLayout::RowMajor,
            group,
            global,
            rows: n,
            cols: k,
            row0: 0,
            col0: 0,
        };
        // SAFETY: forwarded; `m` holds the view's n × k values in this method's kind, scale
        // type and group size, alive until the copy returns.
        unsafe { self.copy_codes(part, slot, proj, view, &m) }
    }

    /// Bytes this layer's experts occupy (codes, scales, per-tensor scales).
    pub fn resident_bytes(&self) -> usize {
        self.parts
            .iter()
            .map(|p| {
                p.gate_up.as_slice().len()
                    + p.down.as_slice().len()
                    + p.gate_up_scales.as_slice().len()
                    + p.down_scales.as_slice().len()
                    + 4 * p.globals.as_slice().len()
            })
            .sum()
    }

    /// Bytes of the integer activation region of a row of `k` inputs (0 without the integer
    /// kernel).
    fn int_stride(&self, k: usize, group: usize) -> usize {
        match self.int {
            Some(_) => int_dot::row_bytes(k, group.min(32)),
            None => 0,
        }
    }

    /// A prepared row: the bf16 pairs (`bf16_bytes`, when the kernels stage) and the integer
    /// region ([`int_dot::prepare_row`]) when the integer kernel exists.
    fn prepare_row(&self, values: &[f32], bf16_bytes: usize, group: usize, out: &mut [u8]) -> f32 {
        let (staged, int) = out.split_at_mut(bf16_bytes);
        if bf16_bytes > 0 && self.reads_staged {
            self.staging().stage(values, staged);
        }
        if self.int.is_some() {
            let (chunk, w) = (group.min(32), &self.weight_bytes);
            int_dot::prepare_row_parts(values, chunk, w, self.wide_rows, int);
        }
        1.0
    }

    /// This format's activation staging (as method BF16's).
    fn staging(&self) -> bf16::Staging<'_> {
        bf16::Staging {
            kernels: &self.kernels,
            hidden: self.hidden,
            ranges: &self.ranges,
        }
    }

    /// Gate or up (`proj`) panel `at`'s codes, scales and per-tensor scale, as the kernels
    /// read them.
    fn gate_up_codes(&self, at: PanelAt, proj: Proj) -> PanelCodes<'_> {
        let PanelAt { part, slot, panel } = at;
        let (h, lb, ss) = (self.hidden, self.line_bytes(), self.spec.scale_type.size());
        let group = self.groups[0];
        let (codes, scales, globals) = self.buffers(part, Proj::Gate);
        let (at, scale_at) = self.offsets(part, slot, proj, panel * PANEL);
        PanelCodes {
            k: h,
            group,
            codes: &codes[at..at + (h / 2) * lb],
            scales: &scales[scale_at..scale_at + (h / group) * PANEL * ss],
            global: globals[Self::global_index(slot, proj)],
            int_at: self.staging().x_stride(),
        }
    }

    /// The few-row integer kernel where [`Self::panel`] would run it on `rows` for panels of
    /// `k` inputs, in one block: the runs ([`ExpertFormat::gate_up_run`],
    /// [`ExpertFormat::down_run`]) then call it panel after panel without the choice.
    fn few_row_kernel(&self, rows: &RowBlock, k: usize) -> Option<int_dot::IntFusedFn> {
        let (kernel, max_rows) = self.int?;
        let n = rows.len();
        let few = n <= self.few_rows.min(max_rows);
        (few && bf16::path_for(&self.kernels, rows.expert_rows, k).is_none()).then_some(kernel)
    }

    /// `out` (32 per row) = panel `p` against `rows` through the few-row integer kernel (one
    /// block of rows).
    ///
    /// # Safety
    /// As [`Self::panel`], for rows [`Self::few_row_kernel`] gave `kernel` for.
    unsafe fn few_rows(
        &self,
        kernel: int_dot::IntFusedFn,
        rows: &RowBlock,
        p: PanelCodes,
        out: &mut [f32],
    ) {
        let n = rows.len();
        assert!(n <= MAX_ROWS && rows.prepared.len() == n && out.len() >= n * PANEL);
        assert!(p.codes.len() == (p.k / 2) * self.line_bytes());
        assert!(p.scales.len() == (p.k / p.group) * PANEL * self.spec.scale_type.size());
        let out = &mut out[..n * PANEL];
        out.fill(0.0);
        let mut int_rows = [std::ptr::null::<u8>(); MAX_ROWS];
        for (d, &row) in int_rows.iter_mut().zip(rows.prepared) {
            *d = row.wrapping_add(p.int_at);
        }
        let (c, s, w) = (p.codes.as_ptr(), p.scales.as_ptr(), &self.weight_bytes);
        let (k, group) = (p.k, p.group);
        // SAFETY: the forward prepared every row (the integer kernel exists, so prepares_x and
        // prepares_act say yes), int regions of k inputs at `int_at`; the panel's codes and
        // scales (checked above), 32 outputs per row; the level allows the kernel.
        unsafe {
            kernel(
                &int_rows[..n],
                k,
                (0, k),
                group.min(32),
                group,
                c,
                s,
                w,
                out.as_mut_ptr(),
            )
        };
        times_global(out, p.global);
    }

    /// Down panel `at`'s codes, scales and per-tensor scale, as the kernels read them.
    fn down_codes(&self, at: PanelAt) -> PanelCodes<'_> {
        let PanelAt { part, slot, panel } = at;
        let (ip, lb, ss) = (
            self.ranges[part].len(),
            self.line_bytes(),
            self.spec.scale_type.size(),
        );
        let group = self.groups[1];
        let (codes, scales, globals) = self.buffers(part, Proj::Down);
        let (at, scale_at) = self.offsets(part, slot, Proj::Down, panel * PANEL);
        PanelCodes {
            k: ip,
            group,
            codes: &codes[at..at + (ip / 2) * lb],
            scales: &scales[scale_at..scale_at + (ip / group) * PANEL * ss],
            global: globals[Self::global_index(slot, Proj::Down)],
            int_at: self.staging().act_stride(part),
        }
    }

    /// `out` (32 per row) = one panel (`codes`: its `k/2` lines; `scales`: its groups' stored
    /// scales) against `rows`, times `global`.
    ///
    /// # Safety
    /// The [`ExpertFormat::gate_up_panel`] contract for rows of `k` values (staged bf16 rows
    /// present whenever [`bf16::path_for`] picks a bf16 path for this expert).
    unsafe fn panel(&self, rows: &RowBlock, p: PanelCodes, out: &mut [f32]) {
        let PanelCodes {
            k,
            group,
            codes,
            scales,
            global,
            int_at,
        } = p;
        /// A decoded block of a panel, aligned for the kernels' loads.
        #[repr(align(64))]
        struct Decoded([u16; PANEL * 128]);
        let n = rows.len();
        let (lb, ss, gl) = (self.line_bytes(), self.spec.scale_type.size(), group / 2);
        let table = self
            .spec
            .kind
            .nibble_table()
            .unwrap_or(&crate::codes::INT4_VALUES);
        assert!(codes.len() == (k / 2) * lb && scales.len() == (k / group) * PANEL * ss);
        assert!(n <= MAX_ROWS && rows.prepared.len() == n && out.len() >= n * PANEL);
        let out = &mut out[..n * PANEL];
        if let Some(kernel) = self.few_row_kernel(rows, k) {
            // SAFETY: the caller's contract; the kernel is the one chosen for these rows.
            unsafe { self.few_rows(kernel, rows, p, out) };
            return;
        }
        let path = bf16::path_for(&self.kernels, rows.expert_rows, k);
        // The integer kernels: the few-row one (15-bit activations) for decode, the many-row
        // one (8-bit for RAWINT4, else 15-bit) for larger blocks unless AMX tiles take the
        // expert. Up to 4 rows count as few on every ISA (AVX2's kernel takes them 2 at a
        // time), so their results do not depend on the ISA, except where the 15-bit many-row
        // kernel is the faster from fewer rows (`int_dot::fine_few_rows`; the same 15-bit
        // activations, only the fp32 steps per chunk differ).
        let few = path.is_none() && n <= self.few_rows;
        let amx = self
            .kernels
            .amx()
            .is_some_and(|a| a.applies(rows.expert_rows));
        let int = match (few, amx) {
            (true, _) => self.int,
            // bf16 panels decoded once per call (a path exists only where the bf16 dot
            // product beat fp32 FMA, or AMX runs) beat the two-pass 15-bit kernel from
            // `bf16_panels_from` rows (see the constant).
            (false, false) if path.is_some() && rows.expert_rows >= self.bf16_panels_from => None,
            (false, false) => self.int_gemm,
            (false, true) => None,
        };
        let reusing = match (int, few, rows.reuse) {
            (Some(_), false, Some(key)) => self.int_gemm_reusing.map(|f| (f, key)),
            _ => None,
        };
        if let Some((kernel, max_rows)) = int {
            out.fill(0.0);
            let chunk = group.min(32);
            let mut int_rows = [std::ptr::null::<u8>(); MAX_ROWS];
            for (p, &row) in int_rows.iter_mut().zip(rows.prepared) {
                *p = row.wrapping_add(int_at);
            }
            // Even blocks (25 rows: 9 + 8 + 8, not 12 + 12 + 1): a kernel's rate grows with
            // its rows.
            let blocks = n.div_ceil(max_rows);
            for b in 0..blocks {
                let (first, last) = (b * n / blocks, (b + 1) * n / blocks);
                let block = &int_rows[first..last];
                // SAFETY: the forward prepared every row of this block (prepares_x and
                // prepares_act say yes whenever the integer kernels exist), int regions of k
                // inputs at `int_at`; 16·k code bytes, the panel's stored scales, 32 outputs
                // per row from row `first`; the level allows the kernel.
                unsafe {
                    let (c, s, w) = (codes.as_ptr(), scales.as_ptr(), &self.weight_bytes);
                    let o = out[first * PANEL..].as_mut_ptr();
                    match reusing {
                        // The forward's promise: the rows do not change under their key.
                        Some((f, key)) => f(key, block, k, (0, k), chunk, group, c, s, w, o),
                        None => kernel(block, k, (0, k), chunk, group, c, s, w, o),
                    }
                };
            }
            times_global(out, global);
            return;
        }
        if let (None, Some((fused, max_rows))) = (path, self.code_kernels.fused) {
            if n <= max_rows {
                out.fill(0.0);
                // SAFETY: rows of k floats, k/2 lines of codes, the panel's stored scales, 32
                // outputs per row; the level allows the kernel.
                unsafe {
                    fused(
                        rows.f32_rows,
                        k / 2,
                        gl,
                        codes.as_ptr(),
                        scales.as_ptr(),
                        self.spec.scale_type,
                        out.as_mut_ptr(),
                    )
                };
                times_global(out, global);
                // The fused kernels scale activations by 2⁶⁴ and group scales by 2⁵⁶, which
                // overflows for values no model has (about 1e19) though the result is finite:
                // then the decoded blocks below, in unscaled arithmetic, redo the panel.
                if crate::quant::all_finite(&out[..n * PANEL]) {
                    return;
                }
            }
        }
        // More rows of E4M3 codes with E8M0 scales: the kernel that never applies the scales
        // to the decoded values (the decoded-block path's bits where it applies).
        if let (None, Some(many)) = (path, &self.code_kernels.fused_pow2) {
            let lines = k / 2;
            if many.rows.contains(&n)
                && self.spec.scale_type == ScaleType::E8M0
                && lines.is_multiple_of(kernels::POW2_BLOCK_LINES)
                && kernels::POW2_BLOCK_LINES.is_multiple_of(gl)
                && kernels::FusedPow2::applies(scales)
            {
                let (c, e, o) = (codes.as_ptr(), scales.as_ptr(), out.as_mut_ptr());
                let run = |a: &[*const f32], scaled: bool| {
                    // SAFETY: n rows of k floats (the scaled ones: the packing below), k/2
                    // lines of codes in blocks of whole groups, the panel's exponents (checked
                    // above), 32 outputs per row; the level allows the kernel.
                    unsafe { (many.kernel)(a, scaled, lines, gl, c, e, o) }
                };
                // The rows times 2⁶⁴ once for every panel of the phase, not per panel.
                crate::formats::with_rows_up64(rows, k, run);
                times_global(out, global);
                // An overflow inside (scales near 2¹²⁸) leaves infinities: the blocks below redo
                // the panel.
                if crate::quant::all_finite(out) {
                    return;
                }
            }
        }
        // Decode blocks of 128 inputs (32 when k is not a multiple of 128, or the group when
        // that is larger) and multiply each with the bf16 kernels.
        let block = if k.is_multiple_of(128) && 128 % group == 0 {
            128
        } else {
            group.clamp(32, 128)
        };
        assert!(
            k.is_multiple_of(block) && (block.is_multiple_of(group) || group.is_multiple_of(block))
        );
        // Decode block b (scales folded in) into `dst` (PANEL·block values, panel order).
        // Power-of-two scales (MXFP4, MXFP8) move exponents instead of multiplying, where the
        // results stay normal numbers (then the bits are the same).
        let pow2 = self
            .code_kernels
            .decode_pow2
            .as_ref()
            .filter(|_| self.spec.scale_type == ScaleType::E8M0);
        let decode_block = |b: usize, dst: &mut [u16]| {
            let (line0, lines) = (b * block / 2, block / 2);
            let (g0, groups) = (line0 / gl, (lines / gl).max(1));
            let raw = &scales[g0 * PANEL * ss..(g0 + groups) * PANEL * ss];
            let in_range = |p: &&kernels::Pow2Decoder| {
                // The least and greatest exponent (a branch-free fold: vector min/max), not
                // `all`: the per-byte test took 8% of a 512-token MXFP4 layer.
                let (least, most) = raw
                    .iter()
                    .fold((u8::MAX, u8::MIN), |(a, b), &e| (a.min(e), b.max(e)));
                p.exponents.contains(&least) && p.exponents.contains(&most)
            };
            if let Some(p) = pow2.filter(in_range) {
                assert!(dst.len() >= PANEL * block);
                // SAFETY: as below, with the group exponents (one byte per output) checked
                // inside the decoder's range just above.
                unsafe {
                    (p.decode)(
                        codes[line0 * lb..].as_ptr(),
                        lines,
                        gl.min(lines),
                        raw.as_ptr(),
                        table,
                        dst.as_mut_ptr(),
                    )
                };
                return;
            }
            assert!(dst.len() >= PANEL * block);
            // SAFETY: `lines` lines of codes in, 64 values each out (≤ dst), the groups'
            // stored scales (`raw`, 32 per group); the decoder's ISA was checked when the
            // layer was built; NaN codes and scales were refused at load.
            unsafe {
                (self.code_kernels.decode)(
                    codes[line0 * lb..].as_ptr(),
                    lines,
                    gl.min(lines),
                    raw.as_ptr(),
                    self.spec.scale_type,
                    table,
                    dst.as_mut_ptr(),
                )
            };
        };
        if let Some(path) = path {
            // With staged bf16 rows, decode the whole panel and multiply once over all k (AMX,
            // 512-token S1 layer: RAWINT4 123 -> 91 ms).
            // SAFETY: the caller's contract; `path` reads the staged rows.
            unsafe {
                bf16::multiply_decoded_panel(
                    &self.kernels,
                    path,
                    rows,
                    k,
                    block,
                    codes,
                    decode_block,
                    out,
                )
            };
            times_global(out, global);
            return;
        }
        let mut decoded = Decoded([0; PANEL * 128]);
        for b in 0..k / block {
            decode_block(b, &mut decoded.0);
            // SAFETY: the caller's contract, block b of k inputs; scales are folded in.
            unsafe {
                bf16::add_decoded_block(
                    &self.kernels,
                    path,
                    rows,
                    block,
                    b,
                    &decoded.0,
                    1.0,
                    out,
                    None,
                    0,
                )
            };
        }
        times_global(out, global);
    }

    /// The layer's intermediate size (all parts).
    fn intermediate(&self) -> usize {
        self.ranges.last().map_or(0, |r| r.end)
    }

    /// Row `row` (local to `part`) of `slot`'s `proj`: its codes over local inputs `cols` (even
    /// bounds) as a checkpoint stores them (row-major bytes, nibbles low first) into `out`.
    fn row_codes(
        &self,
        part: usize,
        slot: usize,
        proj: Proj,
        row: usize,
        cols: Range<usize>,
        out: &mut [u8],
    ) {
        let (codes, _, _) = self.buffers(part, proj);
        let (at, _) = self.offsets(part, slot, proj, row);
        let j = row % PANEL;
        if self.spec.kind.bits() == 4 && cols.start.is_multiple_of(8) && cols.end.is_multiple_of(8)
        {
            // A row's 8 inputs are one 4-byte word of the panel: whole words.
            for (m, b) in (cols.start / 8..cols.end / 8).enumerate() {
                let w = at + b * 128 + 4 * j;
                out[4 * m..4 * m + 4].copy_from_slice(&codes[w..w + 4]);
            }
            return;
        }
        for (i, q) in (cols.start / 2..cols.end / 2).enumerate() {
            if self.spec.kind.bits() == 8 {
                let b = at + q * 64 + 2 * j;
                out[2 * i] = codes[b];
                out[2 * i + 1] = codes[b + 1];
            } else {
                out[i] = codes[at + kernels::nibble_byte(q, j)];
            }
        }
    }

    /// The stored bits of row `row`'s scale of group `g` (local to `part`).
    fn scale_bits(&self, part: usize, slot: usize, proj: Proj, row: usize, g: usize) -> u16 {
        let (_, scales, _) = self.buffers(part, proj);
        let (_, at) = self.offsets(part, slot, proj, row);
        let ss = self.spec.scale_type.size();
        let i = at + (g * PANEL + row % PANEL) * ss;
        match ss {
            1 => scales[i] as u16,
            _ => u16::from_le_bytes([scales[i], scales[i + 1]]),
        }
    }

    /// The GPU bytes of the scales of groups `groups` of the panel holding local row `row0`
    /// of `slot`'s `proj` in `part`, in line order (per group, the panel's 32 rows) into `out`.
    /// One-byte codes converted to bf16 values go through `table`, filled for `global`.
    #[allow(clippy::too_many_arguments)]
    fn panel_gpu_scales(
        &self,
        part: usize,
        slot: usize,
        proj: Proj,
        row0: usize,
        groups: Range<usize>,
        global: f32,
        table: &mut GpuScaleTable,
        out: &mut Vec<u8>,
    ) {
        let (_, scales, _) = self.buffers(part, proj);
        let (_, at) = self.offsets(part, slot, proj, row0);
        let (stored, gss) = (self.spec.scale_type.size(), self.gpu_scale_size());
        let stored_lines =
            &scales[at + groups.start * PANEL * stored..at + groups.end * PANEL * stored];
        out.clear();
        if self.spec.gpu_scales == GpuScales::Native {
            out.extend_from_slice(stored_lines);
            return;
        }
        out.resize(stored_lines.len() / stored * gss, 0);
        if stored == 1 {
            if table.global != Some(global.to_bits()) {
                for (code, v) in table.bytes.iter_mut().enumerate() {
                    let mut b = [0u8; 2];
                    self.gpu_scale(code as u16, global, &mut b);
                    *v = b;
                }
                table.global = Some(global.to_bits());
            }
            for (&code, o) in stored_lines.iter().zip(out.chunks_exact_mut(2)) {
                o.copy_from_slice(&table.bytes[code as usize]);
            }
            return;
        }
        for (bytes, o) in stored_lines
            .chunks_exact(stored)
            .zip(out.chunks_exact_mut(gss))
        {
            let bits = u16::from_le_bytes([bytes[0], bytes[1]]);
            self.gpu_scale(bits, global, o);
        }
    }

    /// The bytes of one scale as the GPU reads them.
    fn gpu_scale(&self, bits: u16, global: f32, out: &mut [u8]) {
        match self.spec.gpu_scales {
            GpuScales::Native => {
                out.copy_from_slice(&bits.to_le_bytes()[..self.spec.scale_type.size()])
            }
            GpuScales::Bf16Value => {
                let v = self.spec.scale_type.value(bits) * global;
                out.copy_from_slice(&crate::dtype::f32_to_bf16_bits(v).to_le_bytes());
            }
        }
    }

    /// Bytes per scale on the GPU.
    fn gpu_scale_size(&self) -> usize {
        match self.spec.gpu_scales {
            GpuScales::Native => self.spec.scale_type.size(),
            GpuScales::Bf16Value => 2,
        }
    }

    /// The codes and scales of `slot`'s `proj` in `part` as a checkpoint holds them: `[n][k]`
    /// row-major code bytes and `[n][k/group]` stored scale bits (tests, GPU write).
    pub fn expert_codes(&self, part: usize, slot: usize, proj: Proj) -> (Vec<u8>, Vec<u16>, f32) {
        let (n, k) = self.shape(part, proj);
        let row_bytes = k * self.spec.kind.bits() / 8;
        let mut codes = vec![0u8; n * row_bytes];
        let mut scales = Vec::with_capacity(n * (k / self.group(proj)));
        for r in 0..n {
            self.row_codes(
                part,
                slot,
                proj,
                r,
                0..k,
                &mut codes[r * row_bytes..(r + 1) * row_bytes],
            );
            for g in 0..k / self.group(proj) {
                scales.push(self.scale_bits(part, slot, proj, r, g));
            }
        }
        let (_, _, globals) = self.buffers(part, proj);
        (codes, scales, globals[Self::global_index(slot, proj)])
    }
}

/// One panel's codes as [`KGroupExperts::panel`] reads them.
#[derive(Clone, Copy)]
struct PanelCodes<'a> {
    /// Inputs.
    k: usize,
    /// Inputs per scale.
    group: usize,
    /// The panel's `k/2` lines.
    codes: &'a [u8],
    /// Its groups' stored scales.
    scales: &'a [u8],
    /// The per-tensor scale.
    global: f32,
    /// Offset of the integer activation region in a prepared row.
    int_at: usize,
}

/// Least common multiple.
fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut x: usize, mut y: usize| {
        while y != 0 {
            (x, y) = (y, x % y);
        }
        x
    };
    a / gcd(a, b) * b
}

/// Rows per block of an expert with `expert_rows` rows where the AVX2 i16 kernel takes groups
/// of 8 rows in vector lanes and the rest ([`int_dot::lane_rows`]) 2 to 4 rows per call,
/// slower per row. The forward cuts blocks of this size and a last one of what remains: of 32,
/// 24 and 16, the size that leaves the row kernel the fewest rows without more blocks than 32
/// would make (the larger on a tie: each block unpacks the panel's weights again). 40 rows go as 24 + 16 rather than 32 + 8, 45 as
/// 24 + 21 (5 rows by the row kernel) rather than 32 + 13 (13).
fn lane_block_rows(expert_rows: usize) -> usize {
    let blocks = expert_rows.div_ceil(MAX_ROWS);
    let row_kernel_rows = |size: usize| {
        let last = expert_rows - (blocks - 1) * size;
        last - int_dot::lane_rows(last)
    };
    [MAX_ROWS, 24, 16]
        .into_iter()
        .filter(|&size| expert_rows.div_ceil(size) == blocks)
        .min_by_key(|&size| row_kernel_rows(size))
        .unwrap_or(MAX_ROWS)
}

impl ExpertFormat for KGroupExperts {
    fn method(&self) -> Method {
        self.spec.method
    }

    fn kernel_name(&self) -> String {
        let vector = self.kernels.name();
        let codes = self.code_kernels.name;
        match self.kernels.amx_name() {
            Some(amx) => format!("kgroup-{codes}+{amx}+{vector}"),
            None => format!("kgroup-{codes}+{vector}"),
        }
    }

    fn part_ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    fn x_stride(&self, _part: usize) -> usize {
        self.staging().x_stride() + self.int_stride(self.hidden, self.groups[0])
    }

    fn act_stride(&self, part: usize) -> usize {
        let ip = self.ranges[part].len();
        self.staging().act_stride(part) + self.int_stride(ip, self.groups[1])
    }

    fn prepares_x(&self, max_rows: usize) -> bool {
        self.int.is_some() || self.staging().prepares_x(max_rows)
    }

    fn prepares_act(&self, max_rows: usize) -> bool {
        self.int.is_some() || self.staging().prepares_act(max_rows)
    }

    fn prepare_x(&self, _part: usize, x: &[f32], out: &mut [u8]) -> f32 {
        self.prepare_row(x, self.staging().x_stride(), self.groups[0], out)
    }

    fn prepare_act(&self, part: usize, act: &[f32], out: &mut [u8]) -> f32 {
        self.prepare_row(act, self.staging().act_stride(part), self.groups[1], out)
    }

    fn prepares_act_per_panel(&self) -> bool {
        // The integer rows' chunk scales need whole chunks of a row: rows are prepared whole.
        self.int.is_none()
    }

    fn prepare_act_panel(&self, part: usize, expert_rows: usize, act: &[f32], out: &mut [u8]) {
        self.staging().stage_panel(part, expert_rows, act, out)
    }

    fn block_rows(&self, _part: usize, expert_rows: usize, _stage: Stage) -> usize {
        // Every row of a block shares each decoded block (see `panel`).
        match self.int_gemm_reusing {
            Some(_) => lane_block_rows(expert_rows),
            None => MAX_ROWS,
        }
    }

    unsafe fn gate_up_panel(
        &self,
        at: PanelAt,
        rows: &RowBlock,
        _scratch: &mut PanelAcc,
        g: &mut [f32],
        u: &mut [f32],
    ) {
        for (proj, out) in [(Proj::Gate, g), (Proj::Up, u)] {
            // SAFETY: the trait's contract, forwarded for rows of H values.
            unsafe { self.panel(rows, self.gate_up_codes(at, proj), out) };
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
        let m = rows.len() * PANEL;
        let Some(kernel) = self.few_row_kernel(rows, self.hidden) else {
            // SAFETY: the caller's contract.
            unsafe { super::gate_up_panel_by_panel(self, at, n, rows, scratch, g, u) };
            return;
        };
        for i in 0..n {
            for (proj, out) in [(Proj::Gate, &mut *g), (Proj::Up, &mut *u)] {
                let codes = self.gate_up_codes(at.after(i), proj);
                // SAFETY: the trait's contract for rows of H values, which the kernel takes.
                unsafe { self.few_rows(kernel, rows, codes, &mut out[i * m..(i + 1) * m]) };
            }
        }
    }

    unsafe fn down_run(
        &self,
        at: PanelAt,
        n: usize,
        rows: &RowBlock,
        scratch: &mut PanelAcc,
        o: &mut [f32],
    ) {
        let m = rows.len() * PANEL;
        let k = self.ranges[at.part].len();
        let kernel = self.few_row_kernel(rows, k);
        for i in 0..n {
            let at = at.after(i);
            let o = &mut o[i * m..(i + 1) * m];
            // SAFETY: the trait's contract, panel by panel, for rows of ip values.
            unsafe {
                match kernel {
                    Some(kernel) => self.few_rows(kernel, rows, self.down_codes(at), o),
                    None => self.down_panel(at, rows, scratch, o),
                }
            }
        }
    }

    fn down_panel_bytes(&self, at: PanelAt) -> Option<(*const u8, usize)> {
        let codes = self.down_codes(at).codes;
        Some((codes.as_ptr(), codes.len()))
    }

    unsafe fn down_panel(
        &self,
        at: PanelAt,
        rows: &RowBlock,
        _scratch: &mut PanelAcc,
        o: &mut [f32],
    ) {
        // SAFETY: the trait's contract, forwarded for rows of ip SwiGLU values.
        unsafe { self.panel(rows, self.down_codes(at), o) };
    }

    fn packs_from_source(&self) -> bool {
        true
    }

    fn adapt_to_source(
        &mut self,
        config: &MoeConfig,
        gate: &MatrixView,
        down: &MatrixView,
    ) -> Result<()> {
        // Codes of this kind are kept as they come, scales in the source's own type (the
        // kernels read every scale type): MXFP4 handed over with bf16 scales, as the original's
        // loader leaves them in memory, stays bf16. A per-tensor factor needs a format that
        // stores one.
        let own = |v: &MatrixView| {
            v.coded
                .filter(|m| m.kind == self.spec.kind && (m.global == 1.0 || self.spec.global))
        };
        let (g, d) = (own(gate), own(down));
        let scale_type = match (g, d) {
            (Some(a), Some(b)) if a.scale_type != b.scale_type => self.spec.scale_type,
            (Some(m), _) | (_, Some(m)) => m.scale_type,
            _ => self.spec.scale_type,
        };
        let same_type = |m: CodedMatrix| m.scale_type == scale_type;
        let groups = [
            g.filter(|&m| same_type(m))
                .map_or(self.groups[0], |m| m.group),
            d.filter(|&m| same_type(m))
                .map_or(self.groups[1], |m| m.group),
        ];
        if groups != self.groups || scale_type != self.spec.scale_type {
            let parts = self.parts.len();
            let spec = Spec {
                scale_type,
                ..self.spec
            };
            *self = KGroupExperts::new(config, parts, self.kernels, spec, groups[0], groups[1])?;
        }
        Ok(())
    }

    fn gpu_rank_bytes(&self, gpu_tp: usize) -> Result<[usize; 4]> {
        let (h, i) = (self.hidden, self.intermediate());
        let [ggu, gdown] = self.groups;
        kt_ensure!(
            gpu_tp >= 1 && i.is_multiple_of(gpu_tp) && (i / gpu_tp).is_multiple_of(lcm(gdown, 8)),
            Invalid,
            "{}: moe_intermediate_size {i} does not split into {gpu_tp} GPU ranks of whole \
             {}-input groups",
            self.spec.method,
            lcm(gdown, 8)
        );
        let ir = i / gpu_tp;
        let (bits, ss) = (self.spec.kind.bits(), self.gpu_scale_size());
        Ok([
            2 * ir * h * bits / 8,
            2 * ir * (h / ggu) * ss,
            h * ir * bits / 8,
            h * (ir / gdown) * ss,
        ])
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
        let [ggu, gdown] = self.groups;
        let (bits, ss) = (self.spec.kind.bits(), self.gpu_scale_size());
        let gptq = self.spec.method == Method::GptqInt4;
        let put = |base: *mut u8, at: usize, bytes: &[u8]| {
            // SAFETY: every write below lands inside the rank's buffers, whose sizes
            // gpu_rank_bytes gave (the caller's contract).
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), base.add(at), bytes.len()) }
        };
        let mut row = vec![0u8; h.max(ir) * bits / 8];
        let mut row_scales = vec![0u8; (h / ggu).max(ir / gdown) * ss];
        let mut panel_scales = Vec::new();
        let mut table = GpuScaleTable {
            global: None,
            bytes: [[0; 2]; 256],
        };
        let (elem, per_elem) = self.line_element();
        let elem_line = PANEL * elem;
        // w13: gate rows of the rank, then up rows. Row-major codes `[2·ir][H]` and scales
        // `[2·ir][H/g]`; GPTQ: `qweight [H/8][2·ir]` (one u32 per 8 inputs of a row) and
        // `scales [H/g][2·ir]`. A part's panel that is a whole 32-row block of the buffer goes
        // at once (GPTQ's lines are already its rows of words); other rows one at a time.
        let n13 = 2 * ir;
        for (which, proj) in [(0, Proj::Gate), (1, Proj::Up)] {
            let mut r = 0;
            while r < ir {
                let (part, local) = locate(&self.ranges, r0 + r);
                let n = which * ir + r;
                let whole =
                    local.is_multiple_of(PANEL) && n.is_multiple_of(PANEL) && r + PANEL <= ir;
                let global = self.buffers(part, proj).2[Self::global_index(slot, proj)];
                if whole && share.has(n) {
                    let (codes, _, _) = self.buffers(part, proj);
                    let (at, _) = self.offsets(part, slot, proj, local);
                    let lines = &codes[at..at + h / per_elem * elem_line];
                    self.panel_gpu_scales(
                        part,
                        slot,
                        proj,
                        local,
                        0..h / ggu,
                        global,
                        &mut table,
                        &mut panel_scales,
                    );
                    if gptq {
                        for (w, line) in lines.chunks_exact(elem_line).enumerate() {
                            put(dst.w13, (w * n13 + n) * 4, line);
                        }
                        for (g, line) in panel_scales.chunks_exact(PANEL * ss).enumerate() {
                            put(dst.w13_scale, (g * n13 + n) * ss, line);
                        }
                    } else {
                        let (row_bytes, scale_bytes) = (h * bits / 8, (h / ggu) * ss);
                        // SAFETY: h/per_elem lines of the panel; buffer rows n..n+32 of
                        // row_bytes codes and scale_bytes scales (the caller's contract).
                        unsafe {
                            crate::lines::lines_to_rows(
                                lines.as_ptr(),
                                h / per_elem,
                                elem,
                                dst.w13.add(n * row_bytes),
                                row_bytes,
                            );
                            crate::lines::lines_to_rows(
                                panel_scales.as_ptr(),
                                h / ggu,
                                ss,
                                dst.w13_scale.add(n * scale_bytes),
                                scale_bytes,
                            );
                        }
                    }
                } else if !whole && share.has(n) {
                    let bytes = &mut row[..h * bits / 8];
                    self.row_codes(part, slot, proj, local, 0..h, bytes);
                    if gptq {
                        for (w, word) in bytes.chunks_exact(4).enumerate() {
                            put(dst.w13, (w * n13 + n) * 4, word);
                        }
                    } else {
                        put(dst.w13, n * bytes.len(), bytes);
                    }
                    for g in 0..h / ggu {
                        let bits = self.scale_bits(part, slot, proj, local, g);
                        self.gpu_scale(bits, global, &mut row_scales[g * ss..(g + 1) * ss]);
                        if gptq {
                            put(
                                dst.w13_scale,
                                (g * n13 + n) * ss,
                                &row_scales[g * ss..(g + 1) * ss],
                            );
                        }
                    }
                    if !gptq {
                        // The row's scales are contiguous in the row-major buffer: one copy.
                        let len = (h / ggu) * ss;
                        put(dst.w13_scale, n * len, &row_scales[..len]);
                    }
                }
                r += if whole { PANEL } else { 1 };
            }
        }
        // w2: every output row over the rank's columns r0..r0+ir, which may span parts; a
        // panel's 32 rows at once (H is a multiple of 32, and the columns of a part are whole
        // groups of at least 8 inputs, so whole lines and groups).
        let mut globals_seen: Vec<Option<f32>> = vec![None; 1];
        for (part, range) in self.ranges.iter().enumerate() {
            let (g0, g1) = (range.start.max(r0), range.end.min(r0 + ir));
            if g0 >= g1 {
                continue;
            }
            let (l0, l1, c0) = (g0 - range.start, g1 - range.start, g0 - r0);
            let global = self.buffers(part, Proj::Down).2[Self::global_index(slot, Proj::Down)];
            kt_ensure!(
                globals_seen[0].is_none_or(|s| s == global),
                Invalid,
                "{} down of expert slot {slot} has different per-tensor scales in the NUMA \
                 parts that GPU rank {rank} spans (weights quantized per part); load them from \
                 an {} checkpoint",
                self.spec.method,
                self.spec.method
            );
            globals_seen[0] = Some(global);
            debug_assert!(l0.is_multiple_of(per_elem) && l1.is_multiple_of(gdown));
            let (first, groups) = (l0 / gdown, (l1 - l0) / gdown);
            let lines = (l1 - l0) / per_elem;
            let (codes, _, _) = self.buffers(part, Proj::Down);
            for p0 in (0..h).step_by(PANEL).filter(|&r| share.has(r)) {
                let (at, _) = self.offsets(part, slot, Proj::Down, p0);
                let from = at + l0 / per_elem * elem_line;
                let panel_lines = &codes[from..from + lines * elem_line];
                let groups_range = first..first + groups;
                self.panel_gpu_scales(
                    part,
                    slot,
                    Proj::Down,
                    p0,
                    groups_range,
                    global,
                    &mut table,
                    &mut panel_scales,
                );
                if gptq {
                    for (w, line) in panel_lines.chunks_exact(elem_line).enumerate() {
                        put(dst.w2, ((c0 / 8 + w) * h + p0) * 4, line);
                    }
                    for (i, line) in panel_scales.chunks_exact(PANEL * ss).enumerate() {
                        put(dst.w2_scale, ((c0 / gdown + i) * h + p0) * ss, line);
                    }
                } else {
                    let (row_bytes, scale_bytes) = (ir * bits / 8, (ir / gdown) * ss);
                    // SAFETY: `lines` lines of the panel from input l0; buffer rows p0..p0+32,
                    // from column c0 (codes) and group c0/gdown (scales), inside the rank's
                    // buffers (the caller's contract).
                    unsafe {
                        crate::lines::lines_to_rows(
                            panel_lines.as_ptr(),
                            lines,
                            elem,
                            dst.w2.add(p0 * row_bytes + c0 * bits / 8),
                            row_bytes,
                        );
                        crate::lines::lines_to_rows(
                            panel_scales.as_ptr(),
                            groups,
                            ss,
                            dst.w2_scale.add(p0 * scale_bytes + c0 / gdown * ss),
                            scale_bytes,
                        );
                    }
                }
            }
        }
        Ok(())
    }

    unsafe fn pack(&self, part: usize, slot: usize, proj: Proj, view: &MatrixView) -> Result<()> {
        let (n, k) = self.shape(part, proj);
        assert!(slot < self.experts && view.rows == n && view.cols == k);
        match view.coded {
            Some(m)
                if m.kind == self.spec.kind
                    && m.scale_type == self.spec.scale_type
                    && m.group == self.group(proj) =>
            {
                kt_ensure!(
                    m.col0.is_multiple_of(m.group),
                    Invalid,
                    "{} groups must align with this layer's split; this part starts at input {}",
                    self.spec.method,
                    m.col0
                );
                // SAFETY: forwarded (the view holds this method's codes and group size).
                unsafe { self.copy_codes(part, slot, proj, view, &m) }
            }
            // SAFETY: forwarded.
            _ => unsafe { self.quantize(part, slot, proj, view) },
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The forward's blocks of `lane_block_rows`: as many as 32-row blocks would be, every one
    /// but the last a multiple of 8, and never more rows for the row kernel than 32-row
    /// blocks leave it.
    #[test]
    fn lane_blocks_are_whole_groups_of_8_but_the_last() {
        let blocks_of = |n: usize, b: usize| -> Vec<usize> {
            (0..n).step_by(b).map(|r0| b.min(n - r0)).collect()
        };
        let row_kernel_rows =
            |sizes: &[usize]| -> usize { sizes.iter().map(|&s| s - int_dot::lane_rows(s)).sum() };
        for n in 1..=600 {
            let sizes = blocks_of(n, lane_block_rows(n));
            assert_eq!(sizes.len(), n.div_ceil(MAX_ROWS), "{n}: {sizes:?}");
            let (_, before) = sizes.split_last().unwrap();
            assert!(
                before.iter().all(|&s| s % 8 == 0 && s <= MAX_ROWS),
                "{n}: {sizes:?}"
            );
            let plain = row_kernel_rows(&blocks_of(n, MAX_ROWS));
            assert!(row_kernel_rows(&sizes) <= plain, "{n}: {sizes:?}");
        }
        assert_eq!(blocks_of(40, lane_block_rows(40)), [24, 16]);
        assert_eq!(blocks_of(45, lane_block_rows(45)), [24, 21]);
        assert_eq!(blocks_of(36, lane_block_rows(36)), [32, 4]);
        assert_eq!(blocks_of(64, lane_block_rows(64)), [32, 32]);
    }

    #[test]
    fn resident_memory_is_the_files_expert_bytes() {
        let config = MoeConfig {
            layer_idx: 0,
            num_experts: 4,
            top_k: 2,
            hidden: 2048,
            intermediate: 768,
            max_tokens: 16,
            swiglu_limit: 0.0,
            swiglu_alpha: 0.0,
        };
        let kernels = KernelSet::scalar_twin();
        let weights = 4 * 3 * 2048 * 768;
        for spec in [RAWINT4, GPTQ_INT4, MXFP4, NVFP4, MXFP8] {
            for parts in [1, 2] {
                let g = spec.default_group;
                let experts = KGroupExperts::new(&config, parts, kernels, spec, g, g).unwrap();
                // The file: codes, one scale per group, and NVFP4's f32 per matrix.
                let file = weights * spec.kind.bits() / 8
                    + weights / g * spec.scale_type.size()
                    + if spec.global { 4 * 3 * 4 } else { 0 };
                let ours = experts.resident_bytes();
                assert!(
                    ours >= file && (ours - file) as f64 <= 0.05 * file as f64,
                    "{} parts={parts}: {ours} vs {file}",
                    spec.method
                );
            }
        }
    }
}
