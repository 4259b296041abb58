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
/// Dispatch a row count known at run time to a `const R` kernel instance, so each block size
/// gets its own fully unrolled register allocation.
macro_rules! dispatch_rows {
    ($kernel:ident <$g:tt>, $name:literal, $a:expr, $args:tt; $($r:literal)+) => {
        match $a.len() {
            $($r => $kernel::<$r, $g> $args,)+
            n => panic!("{} takes at most {} rows, got {n}", $name, [$($r),+].len()),
        }
    };
    ($kernel:ident, $name:literal, $a:expr, $args:tt; $($r:literal)+) => {
        match $a.len() {
            $($r => $kernel::<$r> $args,)+
            n => panic!("{} takes at most {} rows, got {n}", $name, [$($r),+].len()),
        }
    };
}
pub(crate) use dispatch_rows;

/// The rows of the next register block with `left` rows to go, at most `block`: the rows left
/// split into as few blocks as `block` allows, as evenly as they go (32 rows at 5:
/// 5,5,5,5,4,4,4, not six 5s and a 2, which runs at about half the rate).
pub(crate) fn even_block(left: usize, block: usize) -> usize {
    left.div_ceil(left.div_ceil(block))
}

/// Inputs `at..at + n` of each row of `a` (at most `R`), times `factor`, into `dst` (`n` at
/// most `N`): the fused decode kernels scale a block of activations once here rather than
/// each line's broadcasts (the same IEEE product either way, so bit-identical).
///
/// # Safety
/// Each row of `a` has `at + n` readable f32.
#[inline(always)]
pub(crate) unsafe fn scaled_inputs<const R: usize, const N: usize>(
    a: &[*const f32],
    at: usize,
    n: usize,
    factor: f32,
    dst: &mut [[f32; N]; R],
) {
    for (row, out) in a.iter().zip(dst.iter_mut()) {
        // SAFETY: the caller's contract.
        let src = unsafe { std::slice::from_raw_parts(row.add(at), n) };
        for (d, s) in out[..n].iter_mut().zip(src) {
            *d = s * factor;
        }
    }
}

pub mod amx;
pub mod calibrate;
pub mod group_dot;
pub mod prefetch;
pub mod row_cache;
pub mod scalar;

/// Largest row block any kernel takes (the AMX kernels' two 16-row tiles).
pub const MAX_ROWS: usize = amx::ROWS;

/// `out[r*32 + j] = Σ_kk a_rows[r][kk] · W[j][kk]` over one packed panel, for `r < a_rows.len()`.
///
/// # Safety
/// The CPU supports the kernel's ISA; each `a_rows[r]` points to `k` readable f32; `panel` to
/// `32*k` bf16; `out` to `32*a_rows.len()` writable f32; `k` is even; rows ≤ the kernel's block.
pub type PanelDotFn = unsafe fn(a_rows: &[*const f32], k: usize, panel: *const u16, out: *mut f32);

/// Like [`PanelDotFn`] but activations are staged bf16 pairs (`u32` = inputs 2q | 2q+1 << 16).
///
/// # Safety
/// As [`PanelDotFn`], with each `a_rows[r]` pointing to `k/2` readable pairs.
pub type PanelDotBf16Fn =
    unsafe fn(a_rows: &[*const u32], k: usize, panel: *const u16, out: *mut f32);

/// A bf16 panel kernel on rows packed by 64-byte column block ([`amx::PackedRows`]): `m` rows,
/// block `c` of row `r` at `packed + c·step_bytes + 64·r`.
///
/// # Safety
/// The CPU supports the kernel's ISA; `packed` holds `k/32` steps of `step_bytes` (≥ 64·m)
/// bytes, `panel` a 32 × `k` panel, `out` 32 values per row; `1 ≤ m ≤ 32`, `k % 32 == 0`.
pub type PackedDotBf16Fn = unsafe fn(
    packed: *const u8,
    step_bytes: usize,
    m: usize,
    k: usize,
    panel: *const u16,
    out: *mut f32,
);

/// A [`PackedDotBf16Fn`] over a panel that `decode(b)` writes block by block (`block` inputs
/// each) while the tiles multiply the blocks before it (AMX): on return all of `panel` is
/// written, for the expert's further row blocks.
///
/// # Safety
/// As [`PackedDotBf16Fn`]; `panel` is writable for 32·`k` values, `decode(b)` writes exactly
/// block b of it and nothing the kernel reads otherwise; `block % 32 == 0`, `k % block == 0`.
pub type PackedDecodingBf16Fn = unsafe fn(
    packed: *const u8,
    step_bytes: usize,
    m: usize,
    k: usize,
    block: usize,
    panel: *mut u16,
    decode: &mut dyn FnMut(usize),
    out: *mut f32,
);

/// Round fp32 to bf16 pairs.
///
/// # Safety
/// The CPU supports the kernel's ISA; `src.len() == 2 * dst.len()`.
pub type StageFn = unsafe fn(src: &[f32], dst: &mut [u32]);

/// `out[i] = act(gate[i], up[i])` for SwiGLU with optional clamp `limit` and OAI `alpha`.
///
/// # Safety
/// The CPU supports the kernel's ISA; the three slices have equal length.
pub type SwigluFn = unsafe fn(gate: &[f32], up: &[f32], out: &mut [f32], limit: f32, alpha: f32);

/// The bf16 dot-product path: staged activations, `vdpbf16ps` (or its scalar model).
#[derive(Clone, Copy)]
pub struct Bf16Path {
    /// Kernel on staged activations.
    pub dot: PanelDotBf16Fn,
    /// Rows per call.
    pub rows_per_block: usize,
    /// fp32 → bf16 pairs.
    pub stage: StageFn,
    /// Use this path for experts with at least this many rows in a forward (0 = never).
    pub min_rows: usize,
    /// The same kernel on packed rows (AMX), for rows that several panels reuse.
    pub packed: Option<PackedDotBf16Fn>,
    /// `dot` and `packed` for panels already in cache ([`Bf16Path::for_cached_panels`]).
    pub dot_cached: PanelDotBf16Fn,
    /// See `dot_cached`.
    pub packed_cached: Option<PackedDotBf16Fn>,
    /// The packed kernel decoding its panel as it goes (AMX).
    pub packed_decoding: Option<PackedDecodingBf16Fn>,
}

impl Bf16Path {
    /// This path for panels a decoder has just written (in cache): the AMX kernels without
    /// their weight prefetch; the vector kernels are the same.
    pub fn for_cached_panels(self) -> Bf16Path {
        Bf16Path {
            dot: self.dot_cached,
            packed: self.packed_cached,
            ..self
        }
    }
}

/// The AMX tile path: experts with at least `min_rows` rows in a forward use the tile kernels,
/// the others the vector kernels (AMX only pays off when a tile's 16 rows are mostly used).
#[derive(Clone, Copy)]
pub struct AmxPath {
    /// Tile program for 32-row groups of int8 bytes (AMXINT8's layout).
    pub int8: group_dot::GroupDotFn,
    /// Tile program for 32-row groups of int4 nibbles (AMXINT4's layout).
    pub int4: group_dot::GroupDotFn,
    /// The int8 program on packed rows.
    pub int8_packed: group_dot::PackedGroupDotFn,
    /// The int4 program on packed rows.
    pub int4_packed: group_dot::PackedGroupDotFn,
    /// bf16 panel kernel (`k % 32 == 0`).
    pub bf16: PanelDotBf16Fn,
    /// The same on packed rows.
    pub bf16_packed: PackedDotBf16Fn,
    /// `bf16` and `bf16_packed` for panels already in cache (no weight prefetch).
    pub bf16_cached: PanelDotBf16Fn,
    /// See `bf16_cached`.
    pub bf16_packed_cached: PackedDotBf16Fn,
    /// The packed bf16 program decoding its panel as it goes.
    pub bf16_packed_decoding: PackedDecodingBf16Fn,
    /// fp32 → bf16 pairs for the bf16 kernel.
    pub stage: StageFn,
    /// Use the tile kernels for experts with at least this many rows (0 = never).
    pub min_rows: usize,
    /// Whether `min_rows` was asked for (`KT_KERNEL_AMX_MIN_ROWS`, a test): formats then keep
    /// it instead of their measured default ([`KernelSet::with_amx_rows_default`]).
    pub min_rows_fixed: bool,
    /// The kernels run on the software tile emulator (tests), not the hardware.
    pub emulated: bool,
}

impl AmxPath {
    /// Whether an expert with `rows` rows takes the tile kernels.
    pub fn applies(&self, rows: usize) -> bool {
        self.min_rows > 0 && rows >= self.min_rows
    }

    /// The bf16 tile kernel as a [`Bf16Path`] for a projection with `k` inputs, if `k` suits it.
    pub fn bf16_path(&self, k: usize) -> Option<Bf16Path> {
        k.is_multiple_of(amx::BF16_K_STEP).then_some(Bf16Path {
            dot: self.bf16,
            rows_per_block: amx::ROWS,
            stage: self.stage,
            min_rows: self.min_rows,
            packed: Some(self.bf16_packed),
            dot_cached: self.bf16_cached,
            packed_cached: Some(self.bf16_packed_cached),
            packed_decoding: Some(self.bf16_packed_decoding),
        })
    }
}

/// Default minimum rows per expert for the AMX tile kernels (`KT_KERNEL_AMX_MIN_ROWS`); a
/// format may set its own measured default ([`KernelSet::with_amx_rows_default`]).
pub const AMX_MIN_ROWS: usize = 4;

/// The AMX threshold from `KT_KERNEL_AMX_MIN_ROWS` (0 disables AMX), or the default.
pub fn amx_min_rows_from_env() -> Result<usize> {
    Ok(amx_min_rows_env()?.unwrap_or(AMX_MIN_ROWS))
}

/// `KT_KERNEL_AMX_MIN_ROWS` when set (0 disables AMX).
pub fn amx_min_rows_env() -> Result<Option<usize>> {
    if std::env::var_os("KT_KERNEL_AMX_MIN_ROWS").is_none() {
        return Ok(None);
    }
    count_from_env(
        "KT_KERNEL_AMX_MIN_ROWS",
        AMX_MIN_ROWS,
        "a row count (use 0 to disable AMX)",
    )
    .map(Some)
}

/// The AMX weight prefetch distance from `KT_KERNEL_AMX_PREFETCH` (bytes, 0 = off), or None
/// when unset (the process's first prefills tune it, [`amx::amx_tune_begin`]).
pub fn amx_prefetch_env() -> Result<Option<usize>> {
    if std::env::var_os("KT_KERNEL_AMX_PREFETCH").is_none() {
        return Ok(None);
    }
    count_from_env(
        "KT_KERNEL_AMX_PREFETCH",
        amx::PREFETCH_BYTES,
        "a byte count (use 0 to turn it off)",
    )
    .map(Some)
}

/// A whole number from environment variable `var`, `default` when unset; a set value that is
/// not one is an error naming the variable and `what` it should be.
fn count_from_env(var: &str, default: usize, what: &str) -> Result<usize> {
    match std::env::var(var) {
        Err(_) => Ok(default),
        Ok(v) => v
            .trim()
            .parse()
            .map_err(|_| Error::Invalid(format!("{var}={v:?} is not {what}"))),
    }
}

/// Function pointers for one ISA level, selected once.
#[derive(Clone, Copy)]
pub struct KernelSet {
    level: Level,
    name: &'static str,
    rows_per_block: usize,
    dot: PanelDotFn,
    swiglu: SwigluFn,
    bf16: Option<Bf16Path>,
    amx: Option<AmxPath>,
}

impl std::fmt::Debug for KernelSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelSet")
            .field("level", &self.level)
            .field("name", &self.name())
            .field("rows_per_block", &self.rows_per_block)
            .finish()
    }
}

/// Default minimum rows per expert for the bf16 path: below it the weights dominate and the
/// exact fp32 path costs nothing extra.
pub const BF16_MIN_ROWS: usize = 4;

impl KernelSet {
    /// fp32-FMA kernels for `level` (no bf16 path). Fails if this CPU cannot run them.
    pub fn for_level(level: Level) -> Result<KernelSet> {
        let sel = isa::global()?;
        if level > sel.detected {
            return Err(Error::Unsupported(format!(
                "kernels for {} requested but this CPU offers {} (missing: {})",
                level.name(),
                sel.detected.name(),
                sel.features.missing(level).join(", ")
            )));
        }
        let mut set = KernelSet::scalar_twin();
        set.level = level;
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
        Ok(set)
    }

    /// `for_level` plus the bf16 dot path for experts with at least `min_rows` rows (needs the
    /// avx512_bf16 level).
    pub fn with_bf16(level: Level, min_rows: usize) -> Result<KernelSet> {
        let mut set = Self::for_level(level)?;
        #[cfg(target_arch = "x86_64")]
        if level >= Level::Avx512Bf16 {
            set.bf16 = Some(Bf16Path {
                dot: avx512_bf16::panel_dot_bf16,
                rows_per_block: avx512_bf16::ROWS,
                stage: avx512_bf16::stage_bf16,
                packed: None,
                dot_cached: avx512_bf16::panel_dot_bf16,
                packed_cached: None,
                packed_decoding: None,
                min_rows,
            });
            return Ok(set);
        }
        Err(Error::Unsupported(format!(
            "the bf16 dot-product kernels need avx512_bf16; level {} was chosen",
            level.name()
        )))
    }

    /// The scalar oracle (fp32 FMA, plus the scalar model of the bf16 path).
    pub fn scalar_twin() -> KernelSet {
        KernelSet {
            level: Level::Generic,
            name: "scalar",
            rows_per_block: scalar::ROWS,
            dot: scalar::panel_dot_fma,
            swiglu: scalar::swiglu,
            bf16: None,
            amx: None,
        }
    }

    /// The scalar model of the bf16 path, used with `min_rows`.
    pub fn scalar_twin_bf16(min_rows: usize) -> KernelSet {
        KernelSet {
            bf16: Some(Bf16Path {
                dot: scalar::panel_dot_bf16,
                rows_per_block: scalar::ROWS,
                stage: scalar::stage_bf16,
                min_rows,
                packed: None,
                dot_cached: scalar::panel_dot_bf16,
                packed_cached: None,
                packed_decoding: None,
            }),
            ..Self::scalar_twin()
        }
    }

    /// Best kernels for the process's chosen level. Where AVX512-BF16 exists, the bf16 path is
    /// used for prefill-sized experts only if it measured faster than fp32 FMA on this CPU (it
    /// is on AMD Zen 4, it is not on Intel Sapphire/Emerald Rapids); `KT_BF16_KERNEL=fma` or
    /// `=bf16dot` forces the choice. Choose the prefetch distance before the first call
    /// (`formats::kernels_for` does both), so the calibration times the kernels as they run.
    pub fn best() -> Result<KernelSet> {
        let level = isa::global()?.chosen;
        if level < Level::Avx512Bf16 {
            return Self::for_level(level)?.with_best_amx();
        }
        let force = std::env::var("KT_BF16_KERNEL").unwrap_or_default();
        let use_bf16 = match force.as_str() {
            "fma" => false,
            "bf16dot" => true,
            _ => calibrate::bf16_dot_is_faster(level),
        };
        let set = if use_bf16 {
            Self::with_bf16(level, BF16_MIN_ROWS)?
        } else {
            Self::for_level(level)?
        };
        set.with_best_amx()
    }

    /// The kernels a caller names: `None`/`"auto"` ([`KernelSet::best`]), `"fma"` (fp32 FMA at
    /// the chosen level), `"bf16dot"`, `"scalar"` (the twin), `"amx"` (hardware tiles, or an
    /// error), `"amx-emulated"` (the tile programs on the software emulator).
    pub fn from_choice(choice: Option<&str>) -> Result<KernelSet> {
        let level = isa::global()?.chosen;
        match choice {
            None | Some("auto") => KernelSet::best(),
            Some("fma") => KernelSet::for_level(level),
            Some("bf16dot") => KernelSet::with_bf16(level, BF16_MIN_ROWS),
            Some("scalar") => Ok(KernelSet::scalar_twin()),
            Some("amx") => KernelSet::best()?.with_env_amx(false),
            Some("amx-emulated") => KernelSet::best()?.with_env_amx(true),
            Some(other) => Err(Error::Invalid(format!(
                "kernel={other:?}: expected 'auto', 'fma', 'bf16dot', 'scalar', 'amx' or \
                 'amx-emulated'"
            ))),
        }
    }

    /// Add the AMX path the process allows: emulated if `KT_KERNEL_AMX_EMULATE=1`, the hardware
    /// kernels at the amx level, none otherwise; threshold from `KT_KERNEL_AMX_MIN_ROWS`.
    fn with_best_amx(self) -> Result<KernelSet> {
        amx_min_rows_env()?; // a malformed value is an error on every CPU, AMX or not
        let emulate = std::env::var("KT_KERNEL_AMX_EMULATE").unwrap_or_default();
        if !matches!(emulate.as_str(), "" | "0" | "1") {
            return Err(Error::Invalid(format!(
                "KT_KERNEL_AMX_EMULATE={emulate:?}: use 1 (emulate the AMX tile programs) or 0"
            )));
        }
        if emulate == "1" {
            self.with_env_amx(true)
        } else if self.level >= Level::Amx && amx::HARDWARE_BUILT {
            self.with_env_amx(false)
        } else {
            Ok(self)
        }
    }

    /// The AMX path (emulated or hardware) with the threshold `KT_KERNEL_AMX_MIN_ROWS` names,
    /// which formats keep; unset, formats choose their own ([`KernelSet::with_amx_rows_default`]).
    fn with_env_amx(self, emulated: bool) -> Result<KernelSet> {
        let asked = amx_min_rows_env()?;
        let rows = asked.unwrap_or(AMX_MIN_ROWS);
        let mut set = if emulated {
            self.with_emulated_amx(rows)
        } else {
            self.with_amx(rows)?
        };
        if let Some(a) = &mut set.amx {
            a.min_rows_fixed = asked.is_some();
        }
        Ok(set)
    }

    /// These kernels with AMX taking experts from `rows` rows on, unless the threshold was
    /// asked for (`KT_KERNEL_AMX_MIN_ROWS`, or [`KernelSet::with_amx`] by a test). Each format
    /// passes the row count its own measurements favour: where the tiles start to pay off
    /// depends on what the vector kernels below them cost (`benches/kernel_switch.py`).
    pub fn with_amx_rows_default(mut self, rows: usize) -> KernelSet {
        if let Some(a) = self.amx.as_mut().filter(|a| !a.min_rows_fixed) {
            a.min_rows = rows;
        }
        self
    }

    /// The staging kernel of this set's ISA (bit-identical across ISAs).
    fn stage_fn(&self) -> StageFn {
        #[cfg(target_arch = "x86_64")]
        if self.level >= Level::Avx512Bf16 {
            return avx512_bf16::stage_bf16;
        }
        scalar::stage_bf16
    }

    /// These kernels plus the hardware AMX tile kernels for experts with at least `min_rows`
    /// rows. Fails unless AMX is usable (CPUID, XCR0 and Linux permission) and built in.
    pub fn with_amx(self, min_rows: usize) -> Result<KernelSet> {
        if self.level < Level::Amx {
            let sel = isa::global()?;
            return Err(Error::Unsupported(format!(
                "the AMX kernels need the amx level; {} was chosen (missing: {})",
                self.level.name(),
                sel.features.missing(Level::Amx).join(", ")
            )));
        }
        #[cfg(kt_amx_hw)]
        {
            if let Some(bytes) = amx_prefetch_env()? {
                amx::freeze_amx(bytes);
            }
            Ok(KernelSet {
                amx: Some(AmxPath {
                    int8: amx::dot_int8,
                    int4: amx::dot_int4,
                    int8_packed: amx::dot_int8_packed,
                    int4_packed: amx::dot_int4_packed,
                    bf16: amx::panel_dot_bf16,
                    bf16_packed: amx::panel_dot_bf16_packed,
                    bf16_cached: amx::panel_dot_bf16_cached,
                    bf16_packed_cached: amx::panel_dot_bf16_packed_cached,
                    bf16_packed_decoding: amx::panel_dot_bf16_packed_decoding,
                    stage: self.stage_fn(),
                    min_rows,
                    min_rows_fixed: true,
                    emulated: false,
                }),
                ..self
            })
        }
        #[cfg(not(kt_amx_hw))]
        {
            let _ = min_rows;
            Err(Error::Unsupported(
                "this build has no AMX kernels (its C++ compiler lacked -mamx-*)".into(),
            ))
        }
    }

    /// These kernels plus the AMX tile programs on the software emulator (any CPU; slow). For
    /// tests of the tile programs inside whole layers.
    pub fn with_emulated_amx(self, min_rows: usize) -> KernelSet {
        KernelSet {
            amx: Some(AmxPath {
                int8: amx::emulated::dot_int8,
                int4: amx::emulated::dot_int4,
                int8_packed: amx::emulated::dot_int8_packed,
                int4_packed: amx::emulated::dot_int4_packed,
                bf16: amx::emulated::panel_dot_bf16,
                bf16_packed: amx::emulated::panel_dot_bf16_packed,
                bf16_cached: amx::emulated::panel_dot_bf16_cached,
                bf16_packed_cached: amx::emulated::panel_dot_bf16_packed_cached,
                bf16_packed_decoding: amx::emulated::panel_dot_bf16_packed_decoding,
                stage: self.stage_fn(),
                min_rows,
                min_rows_fixed: true,
                emulated: true,
            }),
            ..self
        }
    }

    /// The AMX path, if enabled.
    pub fn amx(&self) -> Option<&AmxPath> {
        self.amx.as_ref()
    }

    /// "amx", "amx-emulated", or None.
    pub fn amx_name(&self) -> Option<&'static str> {
        self.amx
            .map(|a| if a.emulated { "amx-emulated" } else { "amx" })
    }

    /// ISA level these kernels need.
    pub fn level(&self) -> Level {
        self.level
    }

    /// Short name, e.g. "avx512-fma" or "avx512-fma+bf16dot".
    pub fn name(&self) -> &'static str {
        match (self.name, self.bf16.is_some()) {
            ("avx512-fma", true) => "avx512-fma+bf16dot",
            ("scalar", true) => "scalar+bf16dot",
            (n, _) => n,
        }
    }

    /// Token rows per fp32 kernel call.
    pub fn rows_per_block(&self) -> usize {
        self.rows_per_block
    }

    /// The bf16 path, if enabled.
    pub fn bf16(&self) -> Option<&Bf16Path> {
        self.bf16.as_ref()
    }

    /// Safe panel dot product: checks every length, then calls the ISA kernel.
    pub fn panel_dot(&self, a_rows: &[&[f32]], panel: &[u16], out: &mut [f32]) {
        let k = panel.len() / PANEL;
        assert!(
            panel.len() == k * PANEL && k.is_multiple_of(2),
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

    /// Safe bf16 panel dot product on staged rows (panics without a bf16 path).
    pub fn panel_dot_bf16(&self, a_rows: &[&[u32]], panel: &[u16], out: &mut [f32]) {
        let path = self.bf16.expect("no bf16 path in this kernel set");
        let k = panel.len() / PANEL;
        assert!(
            panel.len() == k * PANEL && k.is_multiple_of(2),
            "panel length {} invalid",
            panel.len()
        );
        assert!(!a_rows.is_empty() && a_rows.len() <= path.rows_per_block);
        assert!(out.len() >= a_rows.len() * PANEL);
        let mut ptrs = [std::ptr::null::<u32>(); MAX_ROWS];
        for (p, row) in ptrs.iter_mut().zip(a_rows) {
            assert!(row.len() >= k / 2, "staged row shorter than k/2={}", k / 2);
            *p = row.as_ptr();
        }
        // SAFETY: lengths checked above; the constructor checked the ISA.
        unsafe { (path.dot)(&ptrs[..a_rows.len()], k, panel.as_ptr(), out.as_mut_ptr()) }
    }

    /// Stage fp32 into bf16 pairs (panics without a bf16 or AMX path, or on a length mismatch).
    pub fn stage_bf16(&self, src: &[f32], dst: &mut [u32]) {
        let stage = self
            .bf16
            .map(|p| p.stage)
            .or(self.amx.map(|a| a.stage))
            .expect("no bf16 path in this kernel set");
        assert_eq!(src.len(), 2 * dst.len());
        // SAFETY: lengths checked; ISA checked at construction.
        unsafe { stage(src, dst) }
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
    let shifted = x * LOG2E + MAGIC;
    let n = shifted - MAGIC;
    // Cody-Waite split of ln 2 keeps r accurate.
    let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (0.166_666_67 + r * (0.041_666_52 + r * (0.008_333_7 + r * 0.001_394_2)))));
    // n as an integer from the same sum's bits (the unit of `shifted` is 1): `n as i32` is a
    // saturating conversion that does not vectorise. NaN gives garbage bits, but p is NaN.
    let n_int = shifted.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
    let bits = (n_int.wrapping_add(127) as u32) << 23;
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
