//! Compute kernels, one file per ISA, chosen once per layer into a [`KernelSet`].
//!
//! `scalar` is the oracle: every SIMD kernel computes the same thing in the same order (one fused
//! multiply-add chain per output over k, even input before odd), so on finite data the fp32 FMA
//! kernels match it bit for bit. The AVX512-BF16 kernel rounds activations to bf16 and uses the
//! instruction's own summation order; its scalar twin models exactly that.
use crate::isa::{self, Level};
use crate::pack::PANEL;
use crate::{Error, Result};

#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
#[cfg(target_arch = "x86_64")]
pub mod avx512_bf16;
pub mod scalar;

/// Largest row block any kernel takes.
pub const MAX_ROWS: usize = 16;

/// `out[r*32 + j] = Σ_kk a_rows[r][kk] · W[j][kk]` over one packed panel, for `r < a_rows.len()`.
///
/// # Safety
/// The CPU supports the kernel's ISA; each `a_rows[r]` points to `k` readable f32; `panel` to
/// `32*k` bf16; `out` to `32*a_rows.len()` writable f32; `k` is even; rows ≤ the kernel's block.
pub type PanelDotFn = unsafe fn(a_rows: &[*const f32], k: usize, panel: *const u16, out: *mut f32);

/// `out[i] = act(gate[i], up[i])` for SwiGLU with optional clamp `limit` and OAI `alpha`.
///
/// # Safety
/// The CPU supports the kernel's ISA; the three slices have equal length.
pub type SwigluFn = unsafe fn(gate: &[f32], up: &[f32], out: &mut [f32], limit: f32, alpha: f32);

/// Which arithmetic the bf16 weight kernels use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DotKind {
    /// bf16 weights widened to fp32, fp32 activations, FMA (exact products, fp32 sums).
    Fp32Fma,
    /// `vdpbf16ps`: activations rounded to bf16, pairs of products per instruction.
    Bf16Dot,
}

/// Function pointers for one ISA level, selected once.
#[derive(Clone, Copy)]
pub struct KernelSet {
    level: Level,
    name: &'static str,
    rows_per_block: usize,
    dot: PanelDotFn,
    dot_kind: DotKind,
    swiglu: SwigluFn,
}

impl std::fmt::Debug for KernelSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelSet")
            .field("level", &self.level)
            .field("name", &self.name)
            .field("rows_per_block", &self.rows_per_block)
            .finish()
    }
}

impl KernelSet {
    /// The kernels for `level` with fp32-FMA arithmetic. Fails if this CPU cannot run them.
    pub fn for_level(level: Level) -> Result<KernelSet> {
        Self::with_kind(level, DotKind::Fp32Fma)
    }

    /// The kernels for `level` and a dot-product kind. `Bf16Dot` needs the avx512_bf16 level.
    pub fn with_kind(level: Level, kind: DotKind) -> Result<KernelSet> {
        let sel = isa::global()?;
        if level > sel.detected {
            return Err(Error::Unsupported(format!(
                "kernels for {} requested but this CPU offers {} (missing: {})",
                level.name(),
                sel.detected.name(),
                sel.features.missing(level).join(", ")
            )));
        }
        let mut set = KernelSet {
            level,
            name: "scalar",
            rows_per_block: scalar::ROWS,
            dot: scalar::panel_dot_fma,
            dot_kind: DotKind::Fp32Fma,
            swiglu: scalar::swiglu,
        };
        #[cfg(target_arch = "x86_64")]
        {
            if level >= Level::Avx2 {
                set.name = "avx2-fma";
                set.rows_per_block = avx2::ROWS;
                set.dot = avx2::panel_dot_fma;
                set.swiglu = avx2::swiglu;
            }
            if level >= Level::Avx512Base {
                set.name = "avx512-fma";
                set.rows_per_block = avx512::ROWS;
                set.dot = avx512::panel_dot_fma;
                set.swiglu = avx512::swiglu;
            }
        }
        if kind == DotKind::Bf16Dot {
            #[cfg(target_arch = "x86_64")]
            if level >= Level::Avx512Bf16 {
                set.name = "avx512-bf16dot";
                set.rows_per_block = avx512_bf16::ROWS;
                set.dot = avx512_bf16::panel_dot_bf16;
                set.dot_kind = DotKind::Bf16Dot;
                return Ok(set);
            }
            return Err(Error::Unsupported(format!(
                "the bf16 dot-product kernel needs avx512_bf16; level {} was chosen",
                level.name()
            )));
        }
        Ok(set)
    }

    /// The scalar oracle with the same arithmetic as `kind`.
    pub fn scalar_twin(kind: DotKind) -> KernelSet {
        KernelSet {
            level: Level::Generic,
            name: "scalar",
            rows_per_block: scalar::ROWS,
            dot: match kind {
                DotKind::Fp32Fma => scalar::panel_dot_fma,
                DotKind::Bf16Dot => scalar::panel_dot_bf16,
            },
            dot_kind: kind,
            swiglu: scalar::swiglu,
        }
    }

    /// Best kernels for the process's chosen level. On this generation of CPUs the fp32 FMA
    /// peak is above the bf16 dot peak, so FMA is the default; `KT_BF16_KERNEL=bf16dot` opts in.
    pub fn best() -> Result<KernelSet> {
        let level = isa::global()?.chosen;
        let want_dot = std::env::var("KT_BF16_KERNEL").is_ok_and(|v| v == "bf16dot");
        if want_dot && level >= Level::Avx512Bf16 {
            Self::with_kind(level, DotKind::Bf16Dot)
        } else {
            Self::for_level(level)
        }
    }

    /// ISA level these kernels need.
    pub fn level(&self) -> Level {
        self.level
    }

    /// Short name, e.g. "avx512-fma".
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Arithmetic of the dot kernel.
    pub fn dot_kind(&self) -> DotKind {
        self.dot_kind
    }

    /// Token rows per kernel call.
    pub fn rows_per_block(&self) -> usize {
        self.rows_per_block
    }

    /// Safe panel dot product: checks every length, then calls the ISA kernel.
    pub fn panel_dot(&self, a_rows: &[&[f32]], panel: &[u16], out: &mut [f32]) {
        let k = panel.len() / PANEL;
        assert!(
            panel.len() == k * PANEL && k % 2 == 0,
            "panel length {} invalid",
            panel.len()
        );
        assert!(!a_rows.is_empty() && a_rows.len() <= self.rows_per_block);
        assert!(out.len() >= a_rows.len() * PANEL);
        let mut ptrs = [std::ptr::null::<f32>(); MAX_ROWS];
        for (p, row) in ptrs.iter_mut().zip(a_rows) {
            assert!(row.len() >= k, "activation row shorter than k={k}");
            *p = row.as_ptr();
        }
        // SAFETY: lengths checked above; the constructor checked the ISA.
        unsafe { (self.dot)(&ptrs[..a_rows.len()], k, panel.as_ptr(), out.as_mut_ptr()) }
    }

    /// Unchecked panel dot product for the hot path.
    ///
    /// # Safety
    /// Same contract as [`PanelDotFn`] (the ISA part is guaranteed by construction).
    #[inline(always)]
    pub unsafe fn panel_dot_raw(
        &self,
        a_rows: &[*const f32],
        k: usize,
        panel: *const u16,
        out: *mut f32,
    ) {
        // SAFETY: forwarded.
        unsafe { (self.dot)(a_rows, k, panel, out) }
    }

    /// SwiGLU over equal-length slices.
    pub fn swiglu(&self, gate: &[f32], up: &[f32], out: &mut [f32], limit: f32, alpha: f32) {
        assert!(gate.len() == up.len() && up.len() == out.len());
        // SAFETY: lengths checked; ISA checked at construction.
        unsafe { (self.swiglu)(gate, up, out, limit, alpha) }
    }
}

/// Levels this machine can run, for tests that compare each with the scalar twin.
pub fn runnable_levels() -> Vec<Level> {
    let detected = isa::global().map(|s| s.detected).unwrap_or(Level::Generic);
    let mut v = vec![Level::Generic];
    for l in [Level::Avx2, Level::Avx512Base, Level::Avx512Bf16] {
        if l <= detected {
            v.push(l);
        }
    }
    v
}

/// Branch-free exp(x) for f32 (relative error ≈ 2e-7 on [-87, 88]); written with plain
/// arithmetic so each ISA wrapper auto-vectorises it under its own target features.
#[inline(always)]
pub(crate) fn exp_approx(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // Round to nearest with the 1.5·2^23 trick (exact for |t| < 2^22, which the clamp ensures).
    const MAGIC: f32 = 12_582_912.0;
    let n = (x * LOG2E + MAGIC) - MAGIC;
    // Cody-Waite split of ln 2 keeps r accurate.
    let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (0.166_666_67 + r * (0.041_666_52 + r * (0.008_333_7 + r * 0.001_394_2)))));
    let bits = ((n as i32 + 127) as u32) << 23;
    p * f32::from_bits(bits)
}

/// SwiGLU for one element; shared by every ISA wrapper (they differ only in target features).
#[inline(always)]
pub(crate) fn swiglu_one(g: f32, u: f32, limit: f32, alpha: f32) -> f32 {
    let (g, u) = if limit > 0.0 {
        (g.min(limit), u.clamp(-limit, limit))
    } else {
        (g, u)
    };
    if alpha > 0.0 {
        // "swigluoai": gate · σ(α·gate) · (up + 1)
        g / (1.0 + exp_approx(-alpha * g)) * (u + 1.0)
    } else {
        g / (1.0 + exp_approx(-g)) * u
    }
}

#[cfg(test)]
mod tests;
