//! Experts handed over by address, one tensor per expert and projection: the original's
//! `MOEConfig.gate_projs`/`gate_scales` lists (`[numa][expert]` addresses, one NUMA entry), in
//! the layouts its native loaders leave in memory.
//!
//! Per method, for a matrix of `n` outputs × `k` inputs (gate/up: `I × H`, down: `H × I`):
//!
//! | method | weight | scale |
//! |---|---|---|
//! | BF16 | bf16 `[n][k]` | none |
//! | FP8 | e4m3 `[n][k]` | f32 `[⌈n/128⌉][⌈k/128⌉]` |
//! | FP8_PERCHANNEL | e4m3 `[n][k]` | f32 `[n]` |
//! | RAWINT4 | bytes `[n][k/2]` (nibble = q + 8, even input low) | bf16 `[n][k/g]` |
//! | GPTQ_INT4 | i32 `[k/8][n]` | f32 `[k/g][n]` (fp16 values widened) |
//! | MXFP4, NVFP4 | e2m1 bytes `[n][k/2]` | bf16 `[n][k/g]` (E8M0, or NVFP4's folded scale) |
//! | MXFP8 | e4m3 `[n][k]` | E8M0 bytes `[n][k/g]` |
//!
//! The views read that memory in place; only GPTQ's f32 scales are narrowed back to the
//! fp16 the format stores (refused when a value is not an fp16 number).
use crate::codes::{CodeKind, CodeLayout, CodedMatrix, ScaleLayout, ScaleType};
use crate::dtype::FloatType;
use crate::expert::{ExpertSource, Proj};
use crate::method::Method;
use crate::pack::{BlockScale, MatrixView};
use crate::{kt_bail, kt_ensure, Error, Result};

/// FP8 block size of DeepSeek-style checkpoints.
const FP8_BLOCK: usize = 128;

/// The addresses of one layer's experts: `[proj][expert]` with proj in gate, up, down order.
#[derive(Debug, Clone, Default)]
pub struct ExpertAddresses {
    /// Weight tensors.
    pub weights: [Vec<usize>; 3],
    /// Scale tensors (empty or zeros for BF16).
    pub scales: [Vec<usize>; 3],
}

/// An [`ExpertSource`] over caller memory (see the module docs).
pub struct PointerSource {
    views: Vec<[MatrixView; 3]>,
    /// GPTQ scales narrowed to fp16, one buffer per (expert, proj); the views point into them.
    _narrowed: Vec<Vec<u16>>,
}

// SAFETY: read-only views of memory the creator keeps alive (see `PointerSource::new`).
unsafe impl Sync for PointerSource {}

impl PointerSource {
    /// Views of every expert of a `method` layer with `hidden`/`intermediate` sizes and group
    /// size `group` (the original's `quant_config.group_size`; FP8: 0 or 128, unused by
    /// BF16 and FP8_PERCHANNEL).
    ///
    /// # Safety
    /// Every non-zero address points to a live tensor of the layout the module docs give for
    /// `method` and these sizes, unchanged while the source (and any load from it) lives.
    pub unsafe fn new(
        method: Method,
        hidden: usize,
        intermediate: usize,
        group: usize,
        addrs: &ExpertAddresses,
    ) -> Result<PointerSource> {
        kt_ensure!(
            !matches!(
                method,
                Method::AmxInt8
                    | Method::AmxInt4
                    | Method::Llamafile
                    | Method::SyclGptqInt4
                    | Method::MoeInt4
                    | Method::MoeInt8
            ),
            Unsupported,
            "{method} weights are not taken by address; load them from files (config.path)"
        );
        let experts = addrs.weights[0].len();
        kt_ensure!(
            experts > 0,
            Invalid,
            "no expert weight addresses were given"
        );
        let scaled = method != Method::Bf16;
        for (p, name) in ["gate", "up", "down"].iter().enumerate() {
            kt_ensure!(
                addrs.weights[p].len() == experts,
                Invalid,
                "{} {name} weight addresses for {experts} gate weights",
                addrs.weights[p].len()
            );
            kt_ensure!(
                !scaled || addrs.scales[p].len() == experts,
                Invalid,
                "{method} needs one {name} scale address per expert: got {} for {experts} experts",
                addrs.scales[p].len()
            );
        }
        let mut src = PointerSource {
            views: Vec::with_capacity(experts),
            _narrowed: Vec::new(),
        };
        for e in 0..experts {
            let mut views = [MatrixView::empty(); 3];
            for (p, proj) in [Proj::Gate, Proj::Up, Proj::Down].into_iter().enumerate() {
                let (n, k) = match proj {
                    Proj::Down => (hidden, intermediate),
                    _ => (intermediate, hidden),
                };
                let w = addrs.weights[p][e];
                let s = addrs.scales[p].get(e).copied().unwrap_or(0);
                kt_ensure!(
                    w != 0,
                    Invalid,
                    "expert {e} {proj:?}: the weight address is null"
                );
                kt_ensure!(
                    !scaled || s != 0,
                    Invalid,
                    "expert {e} {proj:?}: {method} needs a scale tensor but its address is null"
                );
                // SAFETY: forwarded (the caller's layout promise for this method).
                views[p] = unsafe { src.view(method, (n, k), group, w, s) }
                    .map_err(|err| err.context(&format!("expert {e} {proj:?}")))?;
            }
            src.views.push(views);
        }
        Ok(src)
    }

    /// One matrix's view (see `new`).
    ///
    /// # Safety
    /// As [`PointerSource::new`] for this matrix.
    unsafe fn view(
        &mut self,
        method: Method,
        (n, k): (usize, usize),
        group: usize,
        w: usize,
        s: usize,
    ) -> Result<MatrixView> {
        let plain = |dtype| MatrixView {
            ptr: w as *const u8,
            dtype,
            rows: n,
            cols: k,
            row_stride: k,
            block_scale: None,
            coded: None,
        };
        let grouped = |need_even: bool| -> Result<usize> {
            kt_ensure!(
                group > 0 && k.is_multiple_of(group) && (!need_even || group.is_multiple_of(2)),
                Invalid,
                "{method}: quant_config.group_size {group} must be a positive {}divisor of the \
                 {k} inputs",
                if need_even { "even " } else { "" }
            );
            Ok(group)
        };
        let coded = |kind, layout, scales, scale_type, scale_layout, group| MatrixView {
            coded: Some(CodedMatrix {
                kind,
                codes: w as *const u8,
                layout,
                scales,
                scale_type,
                scale_layout,
                group,
                global: 1.0,
                rows: n,
                cols: k,
                row0: 0,
                col0: 0,
            }),
            ..plain(FloatType::F8E4M3)
        };
        Ok(match method {
            Method::Bf16 => plain(FloatType::BF16),
            Method::Fp8 => {
                kt_ensure!(
                    group == 0 || group == FP8_BLOCK,
                    Unsupported,
                    "FP8 reads 128x128 block scales; quant_config.group_size is {group}"
                );
                MatrixView {
                    block_scale: Some(BlockScale {
                        scales: s as *const u8,
                        cols: k.div_ceil(FP8_BLOCK),
                        block_rows: FP8_BLOCK,
                        block_cols: FP8_BLOCK,
                        row0: 0,
                        col0: 0,
                    }),
                    ..plain(FloatType::F8E4M3)
                }
            }
            Method::Fp8PerChannel => MatrixView {
                block_scale: Some(BlockScale {
                    scales: s as *const u8,
                    cols: 1,
                    block_rows: 1,
                    block_cols: k.max(1),
                    row0: 0,
                    col0: 0,
                }),
                ..plain(FloatType::F8E4M3)
            },
            Method::RawInt4 => coded(
                CodeKind::Int4,
                CodeLayout::RowMajor,
                s as *const u8,
                ScaleType::Bf16,
                ScaleLayout::RowMajor,
                grouped(true)?,
            ),
            Method::MxFp4 | Method::NvFp4 => coded(
                CodeKind::E2M1,
                CodeLayout::RowMajor,
                s as *const u8,
                ScaleType::Bf16,
                ScaleLayout::RowMajor,
                grouped(true)?,
            ),
            Method::MxFp8 => coded(
                CodeKind::E4M3,
                CodeLayout::RowMajor,
                s as *const u8,
                ScaleType::E8M0,
                ScaleLayout::RowMajor,
                grouped(false)?,
            ),
            Method::GptqInt4 => {
                let g = grouped(true)?;
                kt_ensure!(
                    k.is_multiple_of(8),
                    Invalid,
                    "GPTQ packs 8 inputs per int32; {k} inputs"
                );
                let count = (k / g) * n;
                // SAFETY: the caller's promise: f32 [k/g][n] at s.
                let wide = unsafe { std::slice::from_raw_parts(s as *const f32, count) };
                let narrow = narrow_to_f16(wide)?;
                let at = narrow.as_ptr() as *const u8;
                self._narrowed.push(narrow);
                coded(
                    CodeKind::Int4,
                    CodeLayout::GptqColumns,
                    at,
                    ScaleType::F16,
                    ScaleLayout::Transposed,
                    g,
                )
            }
            other => kt_bail!(
                Unsupported,
                "{other} weights are not taken by address; load them from files (config.path)"
            ),
        })
    }
}

/// `wide` as fp16 bits, refusing values fp16 cannot hold exactly (GPTQ scales are fp16).
fn narrow_to_f16(wide: &[f32]) -> Result<Vec<u16>> {
    wide.iter()
        .enumerate()
        .map(|(i, &v)| {
            let h = half::f16::from_f32(v);
            if h.to_f32() == v || v.is_nan() {
                Ok(h.to_bits())
            } else {
                Err(Error::Invalid(format!(
                    "GPTQ scale {i} is {v}, which is not an fp16 value (GPTQ stores fp16 scales)"
                )))
            }
        })
        .collect()
}

impl ExpertSource for PointerSource {
    fn num_experts(&self) -> usize {
        self.views.len()
    }

    fn matrix(&self, expert: usize, proj: Proj) -> Result<MatrixView> {
        let v = self.views.get(expert).ok_or_else(|| {
            Error::Invalid(format!("expert {expert} outside 0..{}", self.views.len()))
        })?;
        Ok(v[proj.index()])
    }
}
