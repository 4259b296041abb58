//! Integer dot products for the 4-bit group-scaled methods (RAWINT4, GPTQ_INT4, MXFP4, NVFP4)
//! when an expert has one to four rows (decode): 64 multiply-adds per `vpdpbusd` instead of
//! 16 per fp32 FMA, so the codes stream at memory speed.
//!
//! Weights become unsigned bytes `u = m·v + bias` by a mask (int4: the nibble itself, `v =
//! nibble − 8`, `m = 1`, bias 8) or a `vpshufb` table (E2M1: `m = 2`, bias 12, so `u ≤ 24`).
//! Activations are cut per chunk of `U` inputs (32, or the group when smaller) into
//! two signed bytes: `x ≈ s·(x8 + r8/254)` with `s = amax/127`, `r8` the rounded remainder, about
//! 15 bits in all. Per chunk and row the integer sums `A = Σ u·x8` and `B = Σ u·r8` are exact;
//! then, in fp32,
//!
//! `total += ((B − bias·R)/254 + (A − bias·X)) · (scale_w · (s/m))`
//!
//! where `X = Σ x8` and `R = Σ r8` of the chunk are stored with the activation row. The scalar
//! twin ([`int_fused_scalar`]) does the same integer sums and the same fp32 operations in the
//! same order: the AVX-512 VNNI and AVX-VNNI variants are bit-identical to it. The AVX2 one
//! without VNNI folds the two sums into the many-row kernels' `S` below (fewer accumulators)
//! and is bit-identical to their twin, [`int_fine_gemm_scalar`].
//!
//! An activation row for `k` inputs ([`row_bytes`]): `x8` (`k` bytes; within each 8 inputs the
//! order `0 2 4 6 1 3 5 7`, so one 32-bit broadcast meets the even nibbles of a weight word and
//! the next the odd ones), `r8` (the same), per chunk a [`ChunkRecord`] made for the layer's
//! [`WeightBytes`] (`−bias·X`, `−bias·R`, `s·inv_m`, `s·inv_m/254`), then `x16`:
//! each input once as the i16 `254·x8 + r8` (within each 8 inputs the order `0 4 2 6 1 5 3 7`,
//! [`WIDE_SLOTS`]), for the AVX2 many-row kernel without VNNI ([`x86::int_fine_gemm_avx2`]),
//! which from 16 rows puts 8 tokens in the lanes of a vector (their words transposed per
//! chunk) against broadcast weight pairs.
//!
//! The many-row 15-bit kernels (`int_fine_gemm_*`) sum `S = Σ (m·v)·x16` per chunk, exactly
//! (`|S| < 2²⁴`), and add `S · (scale_w · (s · inv_m/254))`: the byte-pair kernels form the
//! same `S` as `254·(A − bias·X) + (B − bias·R)`. Their twin is [`int_fine_gemm_scalar`].
use super::kernels::nibble_byte;
use crate::codes::{CodeKind, ScaleType};
use crate::isa::Level;

/// `out[r·32 + j] += Σ_chunks ((B − bias·R)/254 + (A − bias·X)) · (scales[g·32 + j] · (s·inv_m))`
/// (the few-row kernels; the many-row ones as their twins say) over inputs `i0..i0 + n` of a
/// 32-row panel of 4-bit codes (`codes`: the panel, all `k` inputs), `g` counting groups from
/// `i0 / group`.
///
/// # Safety
/// `rows` holds 1..=the variant's rows activation rows of [`row_bytes`]`(k, chunk)` bytes made by
/// [`prepare_row`]; `codes` `16·k` bytes; `scales` 32 stored scales (of `weights.scale_type`)
/// per group of the range; `i0` and `n` multiples of `chunk`, `chunk` a multiple of 8 up to 32
/// dividing `group`; `out` 32 writable f32 per row; the CPU has the variant's features.
pub type IntFusedFn = unsafe fn(
    rows: &[*const u8],
    k: usize,
    range: (usize, usize),
    chunk: usize,
    group: usize,
    codes: *const u8,
    scales: *const u8,
    weights: &WeightBytes,
    out: *mut f32,
);

/// How 4-bit codes become unsigned bytes for `vpdpbusd`: `u = lut[nibble] = m·value + bias`.
#[derive(Debug, Clone, Copy)]
pub struct WeightBytes {
    /// The byte of each nibble.
    pub lut: [u8; 16],
    /// Whether `lut` is the identity (no table lookup needed).
    pub identity: bool,
    /// Subtracted per activation unit.
    pub bias: i32,
    /// `1/m`.
    pub inv_m: f32,
    /// How the group scales are stored (the kernels read them as stored).
    pub scale_type: ScaleType,
    /// The largest chunk whose sums of byte products fit i16 lanes
    /// ([`WeightBytes::narrow_sums_fit`]), worked out once here rather than per kernel call.
    narrow_chunk: usize,
    /// Each nibble's signed value `m·v` (`lut − bias`), for the i16 kernels.
    pub signed: [i8; 16],
    /// `inv_m / 254`: the factor of a 15-bit chunk sum `S` ([`int_fine_gemm_scalar`]).
    pub inv_m254: f32,
}

impl WeightBytes {
    /// The bytes of `kind` (a 4-bit kind) with scales of `scale_type`.
    pub fn of(kind: CodeKind, scale_type: ScaleType) -> WeightBytes {
        let mut bytes = Self::bytes_of(kind, scale_type);
        // `vpmaddubsw` leaves 4 products per i16 lane and block of 8 inputs (`chunk/2` per
        // chunk), each at most the largest byte times 127.
        let largest = *bytes.lut.iter().max().unwrap_or(&0) as usize;
        bytes.narrow_chunk = 2 * (i16::MAX as usize / (127 * largest.max(1)));
        bytes.signed = std::array::from_fn(|i| (bytes.lut[i] as i32 - bytes.bias) as i8);
        bytes.inv_m254 = bytes.inv_m / 254.0;
        bytes
    }

    fn bytes_of(kind: CodeKind, scale_type: ScaleType) -> WeightBytes {
        match kind {
            CodeKind::E2M1 => {
                let mut lut = [0u8; 16];
                for (i, b) in lut.iter_mut().enumerate() {
                    *b = (2.0 * crate::codes::E2M1_VALUES[i] + 12.0) as u8;
                }
                WeightBytes {
                    lut,
                    identity: false,
                    bias: 12,
                    inv_m: 0.5,
                    scale_type,
                    narrow_chunk: 0,
                    signed: [0; 16],
                    inv_m254: 0.0,
                }
            }
            _ => WeightBytes {
                lut: std::array::from_fn(|i| i as u8),
                identity: true,
                bias: 8,
                inv_m: 1.0,
                scale_type,
                narrow_chunk: 0,
                signed: [0; 16],
                inv_m254: 0.0,
            },
        }
    }

    /// Whether a chunk's sums of byte products fit i16 lanes as `vpmaddubsw` leaves them
    /// (activation bytes up to 127 in magnitude): int4 codes with chunks up to 32, E2M1 ones
    /// with chunks up to 16.
    pub fn narrow_sums_fit(&self, chunk: usize) -> bool {
        chunk <= self.narrow_chunk
    }
}

/// Bytes of one activation row of `k` inputs cut in chunks of `chunk`.
pub fn row_bytes(k: usize, chunk: usize) -> usize {
    wide_at(k, chunk) + 2 * k
}

/// Where an activation row's `x16` inputs start.
#[inline(always)]
fn wide_at(k: usize, chunk: usize) -> usize {
    2 * k + RECORD_BYTES * (k / chunk)
}

/// Where each of 8 inputs goes within its 8 `x16` values: as i32 words `(0,4) (2,6) (1,5)
/// (3,7)`, the pairs an i16 lane pair of a weight word meets (inputs `2j` and `2j+1` are the
/// low and high nibbles of code byte `j`).
pub const WIDE_SLOTS: [usize; 8] = [0, 4, 2, 6, 1, 5, 3, 7];

/// Position of input `i` within the `x16` values.
#[inline(always)]
fn wide_slot(i: usize) -> usize {
    (i & !7) + WIDE_SLOTS[i % 8]
}

/// Position of input `i` within the `x8` (or `r8`) bytes.
#[inline(always)]
fn slot(i: usize) -> usize {
    (i & !7) + SLOTS[i % 8]
}

/// `1.5 · 2²³`: adding and subtracting it rounds an f32 below 2²² in magnitude to the nearest
/// integer, ties to even, in two vectorizable adds.
const ROUNDER: f32 = 12_582_912.0;

/// Where each of 8 inputs goes within its 8 bytes (even inputs first).
const SLOTS: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// Cut `x` (`k` values, a multiple of `chunk`) into an activation row (module docs), with
/// AVX-512 or AVX2 where the CPU has it (the same bytes as [`prepare_row_scalar`]): a decode
/// prepares its input row and every SwiGLU row, thousands of values per call.
pub fn prepare_row(x: &[f32], chunk: usize, w: &WeightBytes, out: &mut [u8]) {
    prepare_row_parts(x, chunk, w, true, out)
}

/// Whether the integer kernels at `level` read an activation row's `x16` inputs: only the
/// AVX2 i16 many-row kernel does ([`int_fine_gemm_for`] without VNNI).
pub fn reads_wide(level: Level) -> bool {
    takes_i16_kernel(level)
}

/// [`prepare_row`], writing the `x16` inputs only when `wide` ([`reads_wide`]; they are half
/// the row's bytes, and the other kernels leave them alone).
pub fn prepare_row_parts(x: &[f32], chunk: usize, w: &WeightBytes, wide: bool, out: &mut [u8]) {
    let k = x.len();
    assert!(k.is_multiple_of(chunk) && chunk.is_multiple_of(8) && out.len() >= row_bytes(k, chunk));
    #[cfg(target_arch = "x86_64")]
    {
        if chunk.is_multiple_of(16) && crate::isa::allows(Level::Avx512Base) {
            // SAFETY: AVX-512 allowed (checked above); lengths and chunk checked above.
            unsafe { x86::prepare_row_avx512(x, chunk, w, wide, out) };
            return;
        }
        if crate::isa::allows(Level::Avx2) {
            // SAFETY: AVX2 and FMA allowed (checked above); lengths checked above.
            unsafe { x86::prepare_row_avx2(x, chunk, w, wide, out) };
            return;
        }
    }
    prepare_row_scalar(x, chunk, w, wide, out);
}

/// The scalar twin of [`prepare_row_parts`] (same contract).
pub fn prepare_row_scalar(x: &[f32], chunk: usize, w: &WeightBytes, wide: bool, out: &mut [u8]) {
    let k = x.len();
    assert!(k.is_multiple_of(chunk) && chunk.is_multiple_of(8) && out.len() >= row_bytes(k, chunk));
    let (x8, rest) = out.split_at_mut(k);
    let (r8, rest) = rest.split_at_mut(k);
    let (sums, x16) = rest.split_at_mut(RECORD_BYTES * (k / chunk));
    for (c, values) in x.chunks_exact(chunk).enumerate() {
        let amax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
        let (s, inv) = chunk_scale(amax);
        let (mut xs, mut rs) = (0i32, 0i32);
        for (b, eight) in values.chunks_exact(8).enumerate() {
            let (mut q, mut r) = ([0f32; 8], [0f32; 8]);
            for t in 0..8 {
                let y = eight[t] * inv;
                q[t] = (y + ROUNDER) - ROUNDER;
                r[t] = ((y - q[t]) * 254.0 + ROUNDER) - ROUNDER;
            }
            let base = c * chunk + 8 * b;
            for t in 0..8 {
                let (qi, ri) = (q[t] as i32, r[t] as i32);
                x8[base + SLOTS[t]] = qi as i8 as u8;
                r8[base + SLOTS[t]] = ri as i8 as u8;
                if wide {
                    let at = 2 * (base + WIDE_SLOTS[t]);
                    x16[at..at + 2].copy_from_slice(&((254 * qi + ri) as i16).to_le_bytes());
                }
                xs += qi;
                rs += ri;
            }
        }
        put_chunk_record(sums, c, ChunkRecord::new(xs, rs, s, w));
    }
}

/// A chunk's `(s, 1/s)` from its largest magnitude: `|v · 127/amax| ≤ 127` and the remainder
/// times 254 stays within ±127, so nothing is clamped. A zero or non-finite chunk gets scale 0
/// (its NaN products become 0).
#[inline(always)]
fn chunk_scale(amax: f32) -> (f32, f32) {
    if amax > 0.0 && amax.is_finite() {
        (amax / 127.0, 127.0 / amax)
    } else {
        (0.0, 0.0)
    }
}

/// Bytes of a [`ChunkRecord`] in an activation row.
const RECORD_BYTES: usize = 16;

/// What the kernels need of a chunk of activations besides its bytes, made once per row for
/// the layer's [`WeightBytes`]: the many-row kernels read it for every chunk, row and panel,
/// and with the products ready each is one operand (an embedded broadcast) instead of an
/// integer multiply, a float multiply and two broadcasts (AMD Zen 4, RAWINT4 at 512 tokens:
/// 31% of the 8-bit kernel's samples sat in those per-chunk steps; the layer went from 70-72
/// to 64-65 ms).
#[derive(Debug, Clone, Copy, PartialEq)]
struct ChunkRecord {
    /// `−bias·X`, `X = Σ x8` of the chunk.
    neg_bias_x: i32,
    /// `−bias·R`, `R = Σ r8` of the chunk.
    neg_bias_r: i32,
    /// `s·inv_m`.
    s_inv_m: f32,
    /// `s·inv_m254` (`inv_m/254`).
    s_inv_m254: f32,
}

impl ChunkRecord {
    /// The record of a chunk with sums `xs`, `rs` and scale `s` against weights `w`.
    fn new(xs: i32, rs: i32, s: f32, w: &WeightBytes) -> ChunkRecord {
        ChunkRecord {
            neg_bias_x: -(w.bias * xs),
            neg_bias_r: -(w.bias * rs),
            s_inv_m: s * w.inv_m,
            s_inv_m254: s * w.inv_m254,
        }
    }
}

/// Store chunk `c`'s record.
#[inline(always)]
fn put_chunk_record(sums: &mut [u8], c: usize, rec: ChunkRecord) {
    let at = &mut sums[RECORD_BYTES * c..RECORD_BYTES * (c + 1)];
    at[0..4].copy_from_slice(&rec.neg_bias_x.to_le_bytes());
    at[4..8].copy_from_slice(&rec.neg_bias_r.to_le_bytes());
    at[8..12].copy_from_slice(&rec.s_inv_m.to_le_bytes());
    at[12..16].copy_from_slice(&rec.s_inv_m254.to_le_bytes());
}

/// Where chunk `c`'s record of an activation row of `k` inputs starts.
#[inline(always)]
fn record_at(row: *const u8, k: usize, c: usize) -> *const u8 {
    row.wrapping_add(2 * k + RECORD_BYTES * c)
}

/// Chunk `c`'s record of an activation row (each field one load, so that a kernel can take
/// it as a broadcast operand).
///
/// # Safety
/// `row` is an activation row of `k` inputs with chunk `c`.
#[inline(always)]
unsafe fn chunk_record(row: *const u8, k: usize, c: usize) -> ChunkRecord {
    // SAFETY: the contract: the record is inside the row.
    unsafe {
        let p = record_at(row, k, c);
        ChunkRecord {
            neg_bias_x: (p as *const i32).read_unaligned(),
            neg_bias_r: (p.add(4) as *const i32).read_unaligned(),
            s_inv_m: (p.add(8) as *const f32).read_unaligned(),
            s_inv_m254: (p.add(12) as *const f32).read_unaligned(),
        }
    }
}

/// The chunks of `chunk` inputs in `i0..i0 + n` with the index of each one's group counted
/// from `i0 / group`, `(c, g)`: counted, not divided (two 64-bit `div` per chunk sat in the
/// AVX2 one-row kernel's loop; on AMD Zen 3 that kernel is op-bound). `chunk` divides `group`.
fn chunks_with_groups(
    (i0, n): (usize, usize),
    chunk: usize,
    group: usize,
) -> impl Iterator<Item = (usize, usize)> {
    let per_group = group / chunk;
    let first = i0 / chunk;
    let skipped = first % per_group;
    (first..(i0 + n) / chunk).scan((0usize, skipped), move |(g, in_group), c| {
        let at = (c, *g);
        *in_group += 1;
        if *in_group == per_group {
            (*g, *in_group) = (*g + 1, 0);
        }
        Some(at)
    })
}

/// The scalar twin of the few-row kernels.
///
/// # Safety
/// The [`IntFusedFn`] contract (any number of rows).
#[allow(clippy::too_many_arguments)] // the IntFusedFn signature
pub unsafe fn int_fused_scalar(
    rows: &[*const u8],
    k: usize,
    range: (usize, usize),
    chunk: usize,
    group: usize,
    codes: *const u8,
    scales: *const u8,
    w: &WeightBytes,
    out: *mut f32,
) {
    // SAFETY: forwarded.
    unsafe { scalar_twin::<true>(rows, k, range, chunk, group, codes, scales, w, out) }
}

/// The scalar twin of the many-row (prefill) kernels with 8-bit activations: as
/// [`int_fused_scalar`] with only the first activation byte,
/// `out[r·32 + j] += Σ_chunks (A − bias·X) · (scales[g·32 + j] · (s·inv_m))` (about 8 bits per
/// input, per chunk of 32: the error budget of a prefill, half the `vpdpbusd` of the two-byte
/// sum).
///
/// # Safety
/// The [`IntFusedFn`] contract (any number of rows).
#[allow(clippy::too_many_arguments)] // the IntFusedFn signature
pub unsafe fn int_gemm_scalar(
    rows: &[*const u8],
    k: usize,
    range: (usize, usize),
    chunk: usize,
    group: usize,
    codes: *const u8,
    scales: *const u8,
    w: &WeightBytes,
    out: *mut f32,
) {
    // SAFETY: forwarded.
    unsafe { scalar_twin::<false>(rows, k, range, chunk, group, codes, scales, w, out) }
}

/// Both twins: `FINE` adds the second activation byte (`B`, `R`) of each chunk.
///
/// # Safety
/// The [`IntFusedFn`] contract (any number of rows).
#[allow(clippy::too_many_arguments)] // the IntFusedFn signature
unsafe fn scalar_twin<const FINE: bool>(
    rows: &[*const u8],
    k: usize,
    (i0, n): (usize, usize),
    chunk: usize,
    group: usize,
    codes: *const u8,
    scales: *const u8,
    w: &WeightBytes,
    out: *mut f32,
) {
    // SAFETY: the contract.
    unsafe {
        for (r, &row) in rows.iter().enumerate() {
            for j in 0..32 {
                let mut total = 0f32;
                for c in i0 / chunk..(i0 + n) / chunk {
                    let (mut a, mut b) = (0i32, 0i32);
                    for i in c * chunk..(c + 1) * chunk {
                        let byte = *codes.add(nibble_byte(i / 2, j));
                        let u = w.lut[((byte >> (4 * (i % 2))) & 0xF) as usize] as i32;
                        a += u * (*row.add(slot(i)) as i8 as i32);
                        if FINE {
                            b += u * (*row.add(k + slot(i)) as i8 as i32);
                        }
                    }
                    let rec = chunk_record(row, k, c);
                    let mut f = (a + rec.neg_bias_x) as f32;
                    if FINE {
                        f = ((b + rec.neg_bias_r) as f32).mul_add(1.0 / 254.0, f);
                    }
                    let g = (c * chunk) / group - i0 / group;
                    let st = w.scale_type;
                    let sw = st.value(st.read(scales, g * 32 + j));
                    total = f.mul_add(sw * rec.s_inv_m, total);
                }
                *out.add(r * 32 + j) += total;
            }
        }
    }
}

/// The scalar twin of the many-row kernels with 15-bit activations (`int_fine_gemm_*`):
/// `out[r·32 + j] += Σ_chunks S · (scales[g·32 + j] · (s·inv_m254))` with
/// `S = Σ (m·v)·x16` (module docs).
///
/// # Safety
/// The [`IntFusedFn`] contract (any number of rows).
#[allow(clippy::too_many_arguments)] // the IntFusedFn signature
pub unsafe fn int_fine_gemm_scalar(
    rows: &[*const u8],
    k: usize,
    (i0, n): (usize, usize),
    chunk: usize,
    group: usize,
    codes: *const u8,
    scales: *const u8,
    w: &WeightBytes,
    out: *mut f32,
) {
    // SAFETY: the contract.
    unsafe {
        for (r, &row) in rows.iter().enumerate() {
            let x16 = row.add(wide_at(k, chunk)) as *const i16;
            for j in 0..32 {
                let mut total = 0f32;
                for c in i0 / chunk..(i0 + n) / chunk {
                    let mut sum = 0i32;
                    for i in c * chunk..(c + 1) * chunk {
                        let byte = *codes.add(nibble_byte(i / 2, j));
                        let v = w.signed[((byte >> (4 * (i % 2))) & 0xF) as usize] as i32;
                        sum += v * x16.add(wide_slot(i)).read_unaligned() as i32;
                    }
                    let s = chunk_record(row, k, c).s_inv_m254;
                    let g = (c * chunk) / group - i0 / group;
                    let st = w.scale_type;
                    let sw = st.value(st.read(scales, g * 32 + j));
                    total = (sum as f32).mul_add(sw * s, total);
                }
                *out.add(r * 32 + j) += total;
            }
        }
    }
}

/// Whether the AVX2-level integer kernels use AVX-VNNI's `vpdpbusd` here: AVX2 CPUs from 2021 on
/// without AVX-512 have it (Alder Lake, Sierra Forest); the others take `vpmaddubsw` pairs.
pub fn avx_vnni() -> bool {
    crate::isa::has_feature("avx_vnni")
}

/// A family's two pickers: `$with(level, vnni)` ([`pick`] among its AVX-512 VNNI, AVX2 and
/// AVX-VNNI kernels, each with the rows it takes; none off x86) and `$for(level)`, the same
/// with this CPU's AVX-VNNI ([`avx_vnni`]).
macro_rules! family_pickers {
    (
        $(#[$for_doc:meta])* $for:ident,
        $(#[$with_doc:meta])* $with:ident,
        $avx512:expr, $avx2:expr, $avx_vnni:expr $(,)?
    ) => {
        $(#[$for_doc])*
        pub fn $for(level: Level) -> Option<(IntFusedFn, usize)> {
            $with(level, avx_vnni())
        }

        $(#[$with_doc])*
        pub fn $with(level: Level, vnni: bool) -> Option<(IntFusedFn, usize)> {
            #[cfg(target_arch = "x86_64")]
            {
                pick(level, vnni, $avx512, $avx2, $avx_vnni)
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                let _ = (level, vnni);
                None
            }
        }
    };
}

/// The kernel of one of the three integer families at `level`: AVX-512 VNNI where the level
/// allows it, else the AVX2-level one with the multiply `vnni` picks ([`avx_vnni`]).
#[cfg(target_arch = "x86_64")]
fn pick(
    level: Level,
    vnni: bool,
    avx512: (IntFusedFn, usize),
    avx2: (IntFusedFn, usize),
    avx_vnni: (IntFusedFn, usize),
) -> Option<(IntFusedFn, usize)> {
    if level >= Level::Avx512Vnni {
        Some(avx512)
    } else if level >= Level::Avx2 {
        Some(if vnni { avx_vnni } else { avx2 })
    } else {
        None
    }
}

family_pickers!(
    /// The many-row (prefill) integer kernel `level` allows and the rows it takes: AVX-512 VNNI
    /// (5 rows) or the AVX2 level (12 rows; AVX-VNNI, 4 rows, where the CPU has it). A 32-row
    /// panel's codes are read once per call for all rows.
    int_gemm_for,
    /// [`int_gemm_for`] with the AVX2-level multiply given (tests run both where they can).
    int_gemm_with,
    (x86::int_gemm_avx512vnni, x86::GEMM_ROWS_512),
    (x86::int_gemm_avx2, x86::GEMM_ROWS_AVX2),
    (x86::int_gemm_avxvnni, x86::GEMM_ROWS_AVXVNNI),
);

family_pickers!(
    /// The many-row kernel with the few-row kernels' 15-bit activations (bit-identical to
    /// [`int_fine_gemm_scalar`]) for methods whose error budget has no room for 8-bit ones:
    /// AVX-512 VNNI (3 rows), AVX-VNNI (3 rows) or AVX2 (the i16 kernel, 4 rows).
    int_fine_gemm_for,
    /// [`int_fine_gemm_for`] with the AVX2-level multiply given.
    int_fine_gemm_with,
    (x86::int_fine_gemm_avx512vnni, x86::FINE_ROWS_512),
    (x86::int_fine_gemm_avx2, x86::WIDE_ROWS_256),
    (x86::int_fine_gemm_avxvnni, x86::FINE_ROWS_256),
);

family_pickers!(
    /// The few-row (decode) integer kernel `level` allows and the rows it takes: AVX-512 VNNI (3)
    /// or the AVX2 level (2; AVX-VNNI, 1, where the CPU has it). Rows are independent, so four rows
    /// as 2 + 2 give the bits of one call of four: at four the six accumulators a row no longer
    /// fit the registers (AMD Zen 5, one core from cache, `FUSED_ROWS=4 KERNEL=fused
    /// kgroup_cycles`, ns per row and block at 3 / 4 rows: NVFP4 1.52 / 1.90, GPTQ_INT4 1.17 /
    /// 1.22, MXFP4 1.22 / 1.23, RAWINT4 1.19 / 1.22; two rows 1.58 / 1.22 / 1.26 / 1.22).
    int_fused_for,
    /// [`int_fused_for`] with the AVX2-level multiply given.
    int_fused_with,
    (x86::int_fused_avx512vnni, 3),
    (x86::int_fused_avx2, 2),
    (x86::int_fused_avxvnni, 1),
);

/// Rows per expert up to which the few-row kernel beats the 15-bit many-row one at `level`
/// (with this CPU's AVX-VNNI): 2 where that is the i16 kernel (AVX2 without VNNI), 4 elsewhere.
/// On an AMD Zen 3, alternating trial by trial from cache
/// (`KERNEL=fused,fine cargo run --release -p kt-benches --example kgroup_cycles`), ns per block
/// and row for MXFP4/NVFP4/GPTQ_INT4 (best trials, after the few-row kernel's folding): one row
/// 6.8/9.4/5.8 few against 8.7/10.7/8.7 many; two rows 6.4/11.3/7.5 against 6.5/9.8/8.1;
/// three rows (few: 2 + 1) about 8.8 against 5.6 before the folding.
pub fn fine_few_rows(level: Level) -> usize {
    if takes_i16_kernel(level) {
        2
    } else {
        4
    }
}

/// Whether the 15-bit many-row kernel at `level` is the AVX2 i16 one (AVX2 without VNNI, on
/// x86), whose token lanes read a packing of the rows.
fn takes_i16_kernel(level: Level) -> bool {
    cfg!(target_arch = "x86_64") && level >= Level::Avx2 && level < Level::Avx512Vnni && !avx_vnni()
}

/// Rows of a block of `n` that the AVX2 i16 kernel puts in token lanes, the rest going to its
/// row kernel: whole groups of 8, and a last group of 6 or 7 rows padded with zero tokens
/// (there the row kernel costs more than 8 lanes), from 2 groups on (a lone group unpacks the
/// panel's weights for too few rows). On an AMD Zen 3, NVFP4 from cache
/// (`KERNEL=reuse cargo run --release -p kt-benches --example kgroup_cycles`, best trials,
/// ns per 128-byte block): 23 rows 120 as 16 + 7 against 113 padded, 30 rows 157 against
/// 147, 31 rows 160 against 146, 14 rows 90 against 76; at 8 rows one group took 92
/// against 81 for two wide calls.
pub fn lane_rows(n: usize) -> usize {
    let lanes = if n % 8 >= 6 { n } else { n - n % 8 };
    if lanes >= 16 {
        lanes
    } else {
        0
    }
}

/// An [`IntFusedFn`] that first takes a reuse key ([`crate::formats::RowBlock::reuse`]): it may
/// keep what it made of the rows for the next panels of the same rows.
pub type IntReusingFn = unsafe fn(
    reuse: u64,
    rows: &[*const u8],
    k: usize,
    range: (usize, usize),
    chunk: usize,
    group: usize,
    codes: *const u8,
    scales: *const u8,
    weights: &WeightBytes,
    out: *mut f32,
);

/// The 15-bit many-row kernel of [`int_fine_gemm_for`] in its reusing form, where it has one:
/// the AVX2 i16 kernel keeps its token-lane packing of a row block for the expert's next
/// panels.
pub fn int_fine_gemm_reusing_for(level: Level) -> Option<IntReusingFn> {
    #[cfg(target_arch = "x86_64")]
    if takes_i16_kernel(level) {
        return Some(x86::int_fine_gemm_avx2_reusing);
    }
    let _ = level;
    None
}

/// The group-scaled family's prefetch calibration workload
/// ([`crate::kernels::calibrate::Workload`]): `buf` as 32-row panels of 2048 E2M1 codes with
/// E8M0 scales per 32 (MXFP4, the table-lookup variant) through the one-row decode kernel.
/// The scales of one panel are reused for all (they are 1/32 of the codes' bytes).
pub fn calibration_workload(level: Level, gate: &[u8], up: &[u8]) {
    let Some((kernel, _)) = int_fused_for(level) else {
        return;
    };
    let (k, chunk, group) = (2048, 32, 32);
    let x: Vec<f32> = (0..k).map(|i| ((i % 17) as f32 - 8.0) * 0.125).collect();
    let w = WeightBytes::of(CodeKind::E2M1, ScaleType::E8M0);
    let mut row = vec![0u8; row_bytes(k, chunk)];
    prepare_row(&x, chunk, &w, &mut row);
    let scales = vec![127u8; 32 * (k / group)]; // 2⁰
    let mut out = [0f32; 32];
    crate::kernels::calibrate::alternate_panels(gate, up, 16 * k, |codes| {
        // SAFETY: a whole panel (16·k bytes) at `codes`; one row of row_bytes(k, chunk); 32
        // scales per group of the whole range; 32 outputs; the kernel was picked for `level`,
        // which the process runs at.
        unsafe {
            kernel(
                &[row.as_ptr()],
                k,
                (0, k),
                chunk,
                group,
                codes,
                scales.as_ptr(),
                &w,
                out.as_mut_ptr(),
            )
        };
        out[0]
    });
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::{
        chunk_record, chunks_with_groups, put_chunk_record, ChunkRecord, WeightBytes, RECORD_BYTES,
        ROUNDER,
    };
    use crate::codes::ScaleType;
    use std::arch::x86_64::*;

    /// A scale type as a const generic argument (stable Rust takes no enum there): the
    /// few-row kernels, generic over it, decode each group's scales in straight-line code,
    /// where a `match` on the weights' type at run time took a jump-table branch per group and
    /// quarter. AMD Zen 3, one row from cache (`ROWS=1 kgroup_cycles`, old and new binaries
    /// alternated, best ns per block in calm rounds): RAWINT4 6.18-6.19 -> 5.71-5.75,
    /// GPTQ_INT4 6.09-6.13 -> 5.70-5.71, NVFP4 9.82-9.89 -> 9.19-9.57, MXFP4 within noise.
    pub(crate) const fn scale_type_of(code: u8) -> ScaleType {
        match code {
            0 => ScaleType::Bf16,
            1 => ScaleType::F16,
            2 => ScaleType::E8M0,
            _ => ScaleType::E4M3,
        }
    }

    /// `$body` with `$c` the const generic code ([`scale_type_of`]) of scale type `$st`.
    macro_rules! with_scale_type {
        ($st:expr, $c:ident => $body:expr) => {
            match $st {
                ScaleType::Bf16 => {
                    const $c: u8 = 0;
                    $body
                }
                ScaleType::F16 => {
                    const $c: u8 = 1;
                    $body
                }
                ScaleType::E8M0 => {
                    const $c: u8 = 2;
                    $body
                }
                ScaleType::E4M3 => {
                    const $c: u8 = 3;
                    $body
                }
            }
        };
    }

    /// `st` through [`with_scale_type`] and back (tests: the two must agree).
    #[cfg(test)]
    pub(crate) fn scale_type_round_trip(st: ScaleType) -> ScaleType {
        with_scale_type!(st, C => scale_type_of(C))
    }

    /// [`super::prepare_row_scalar`] eight inputs at a time: the same fp32 operations in the
    /// same order (no fused multiply-adds), so the same bytes.
    ///
    /// # Safety
    /// AVX2; the lengths [`super::prepare_row`] checks.
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn prepare_row_avx2(
        x: &[f32],
        chunk: usize,
        w: &WeightBytes,
        wide: bool,
        out: &mut [u8],
    ) {
        let k = x.len();
        let (x8, rest) = out.split_at_mut(k);
        let (r8, rest) = rest.split_at_mut(k);
        let (sums, x16) = rest.split_at_mut(RECORD_BYTES * (k / chunk));
        let sign = _mm256_set1_ps(-0.0);
        let times254i = _mm256_set1_epi32(254);
        // Lanes in WIDE_SLOTS order (an involution: position p holds input WIDE_SLOTS[p]).
        let wide_order = _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7);
        let rounder = _mm256_set1_ps(ROUNDER);
        let times254 = _mm256_set1_ps(254.0);
        // Evens first within each 8 (SLOTS), then byte 0 of each i32 lane gathered per half.
        let evens_first = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        let low_bytes = _mm256_setr_epi8(
            0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, //
            0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
        );
        let bytes8 = |v: __m256i| -> __m128i {
            let b = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(v, evens_first), low_bytes);
            _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256::<1>(b))
        };
        // The chunks' scales eight chunks at a time, before their bytes (as in
        // `prepare_row_avx512`; AMD Zen 5, this kernel: 0.60 -> 0.44 ns per input).
        let (mut scale, mut inverse) = ([0f32; 8], [0f32; 8]);
        let chunks = k / chunk;
        for c in 0..chunks {
            let base = c * chunk;
            if c % 8 == 0 {
                let mut amax = [0f32; 8];
                for (j, a) in amax.iter_mut().enumerate().take(chunks - c) {
                    let mut m = _mm256_setzero_ps();
                    for b in (0..chunk).step_by(8) {
                        // SAFETY: inputs of chunk c + j (k values; chunk divides k).
                        let v = unsafe { _mm256_loadu_ps(x.as_ptr().add(base + j * chunk + b)) };
                        // max(|v|, m) keeps m where v is NaN, as f32::max in the twin's fold.
                        m = _mm256_max_ps(_mm256_andnot_ps(sign, v), m);
                    }
                    let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
                    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
                    *a = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2)));
                }
                // chunk_scale's divisions, correctly rounded as its scalar ones; zero where
                // the largest magnitude is zero or infinite (never NaN).
                // SAFETY: 8 floats.
                let a = unsafe { _mm256_loadu_ps(amax.as_ptr()) };
                let ok = _mm256_and_ps(
                    _mm256_cmp_ps::<_CMP_GT_OQ>(a, _mm256_setzero_ps()),
                    _mm256_cmp_ps::<_CMP_LT_OQ>(a, _mm256_set1_ps(f32::INFINITY)),
                );
                let n127 = _mm256_set1_ps(127.0);
                // SAFETY: 8 floats each.
                unsafe {
                    _mm256_storeu_ps(
                        scale.as_mut_ptr(),
                        _mm256_and_ps(_mm256_div_ps(a, n127), ok),
                    );
                    _mm256_storeu_ps(
                        inverse.as_mut_ptr(),
                        _mm256_and_ps(_mm256_div_ps(n127, a), ok),
                    );
                }
            }
            let (s, inv) = (scale[c % 8], _mm256_set1_ps(inverse[c % 8]));
            let (mut xs, mut rs) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for b in (0..chunk).step_by(8) {
                // SAFETY: as above.
                let y = _mm256_mul_ps(unsafe { _mm256_loadu_ps(x.as_ptr().add(base + b)) }, inv);
                let q = _mm256_sub_ps(_mm256_add_ps(y, rounder), rounder);
                let r = _mm256_mul_ps(_mm256_sub_ps(y, q), times254);
                let r = _mm256_sub_ps(_mm256_add_ps(r, rounder), rounder);
                // NaN lanes become 0, as `NaN as i32` does.
                let ordered = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(y, y));
                let qi = _mm256_and_si256(_mm256_cvtps_epi32(q), ordered);
                let ri = _mm256_and_si256(_mm256_cvtps_epi32(r), ordered);
                xs = _mm256_add_epi32(xs, qi);
                rs = _mm256_add_epi32(rs, ri);
                // SAFETY: bytes base+b..base+b+8 of x8 and r8 (k bytes each).
                unsafe {
                    _mm_storel_epi64(x8.as_mut_ptr().add(base + b) as *mut __m128i, bytes8(qi));
                    _mm_storel_epi64(r8.as_mut_ptr().add(base + b) as *mut __m128i, bytes8(ri));
                }
                if !wide {
                    continue;
                }
                // 254·q + r fits i16 (|q|, |r| ≤ 127): no saturation in the pack.
                let wide = _mm256_permutevar8x32_epi32(
                    _mm256_add_epi32(_mm256_mullo_epi32(qi, times254i), ri),
                    wide_order,
                );
                let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_packs_epi32(wide, wide));
                // SAFETY: values base+b..base+b+8 of x16 (2k bytes).
                unsafe {
                    _mm_storeu_si128(
                        x16.as_mut_ptr().add(2 * (base + b)) as *mut __m128i,
                        _mm256_castsi256_si128(packed),
                    )
                };
            }
            put_chunk_record(sums, c, ChunkRecord::new(sum_i32(xs), sum_i32(rs), s, w));
        }
    }

    /// [`super::prepare_row_scalar`] sixteen inputs at a time, for chunks of a multiple of 16:
    /// the same fp32 operations in the same order, so the same bytes; the byte and word
    /// orders within each 8 inputs come from one lane permute and a truncating narrow.
    ///
    /// # Safety
    /// AVX-512F/BW; `chunk` a multiple of 16 and the lengths [`super::prepare_row`] checks.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(crate) unsafe fn prepare_row_avx512(
        x: &[f32],
        chunk: usize,
        w: &WeightBytes,
        wide: bool,
        out: &mut [u8],
    ) {
        let k = x.len();
        debug_assert!(chunk.is_multiple_of(16));
        let (x8, rest) = out.split_at_mut(k);
        let (r8, rest) = rest.split_at_mut(k);
        let (sums, x16) = rest.split_at_mut(RECORD_BYTES * (k / chunk));
        let rounder = _mm512_set1_ps(ROUNDER);
        let times254 = _mm512_set1_ps(254.0);
        // Lane p takes input SLOTS⁻¹[p] (evens first) and WIDE_SLOTS[p] within each 8.
        let evens_first = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
        let wide_order = _mm512_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7, 8, 12, 10, 14, 9, 13, 11, 15);
        let load = |i: usize| {
            // SAFETY: inputs i..i + 16 of x (callers pass i < k, a multiple of 16).
            unsafe { _mm512_loadu_ps(x.as_ptr().add(i)) }
        };
        // The chunks' scales sixteen chunks at a time, before their bytes: each chunk's
        // reduction and divisions then no longer sit in a chain in front of its bytes (AMD
        // Zen 5, one core from cache, K 768, chunks of 32: 0.45 -> 0.22 ns per input).
        let (mut scale, mut inverse) = ([0f32; 16], [0f32; 16]);
        let chunks = k / chunk;
        for c in 0..chunks {
            let base = c * chunk;
            if c % 16 == 0 {
                let mut amax = [0f32; 16];
                for (j, a) in amax.iter_mut().enumerate().take(chunks - c) {
                    let mut m = _mm512_setzero_ps();
                    for b in (0..chunk).step_by(16) {
                        // max(|v|, m) keeps m where v is NaN, as f32::max in the twin's fold.
                        m = _mm512_max_ps(_mm512_abs_ps(load(base + j * chunk + b)), m);
                    }
                    // No lane of m is NaN: the reduction's order does not matter.
                    *a = _mm512_reduce_max_ps(m);
                }
                // chunk_scale's divisions, correctly rounded as its scalar ones.
                // SAFETY: 16 floats.
                let a = unsafe { _mm512_loadu_ps(amax.as_ptr()) };
                let ok = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, _mm512_setzero_ps())
                    & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, _mm512_set1_ps(f32::INFINITY));
                let n127 = _mm512_set1_ps(127.0);
                // SAFETY: 16 floats each.
                unsafe {
                    _mm512_storeu_ps(scale.as_mut_ptr(), _mm512_maskz_div_ps(ok, a, n127));
                    _mm512_storeu_ps(inverse.as_mut_ptr(), _mm512_maskz_div_ps(ok, n127, a));
                }
            }
            let (s, inv) = (scale[c % 16], _mm512_set1_ps(inverse[c % 16]));
            let (mut xs, mut rs) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            for b in (0..chunk).step_by(16) {
                let y = _mm512_mul_ps(load(base + b), inv);
                let q = _mm512_sub_ps(_mm512_add_ps(y, rounder), rounder);
                let r = _mm512_mul_ps(_mm512_sub_ps(y, q), times254);
                let r = _mm512_sub_ps(_mm512_add_ps(r, rounder), rounder);
                // NaN lanes become 0, as `NaN as i32` does.
                let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(y, y);
                let qi = _mm512_maskz_cvtps_epi32(ordered, q);
                let ri = _mm512_maskz_cvtps_epi32(ordered, r);
                xs = _mm512_add_epi32(xs, qi);
                rs = _mm512_add_epi32(rs, ri);
                let bytes =
                    |v: __m512i| _mm512_cvtepi32_epi8(_mm512_permutexvar_epi32(evens_first, v));
                // SAFETY: bytes base+b..base+b+16 of x8 and r8 (k bytes each).
                unsafe {
                    _mm_storeu_si128(x8.as_mut_ptr().add(base + b) as *mut __m128i, bytes(qi));
                    _mm_storeu_si128(r8.as_mut_ptr().add(base + b) as *mut __m128i, bytes(ri));
                }
                if wide {
                    // 254·q + r fits i16 (|q|, |r| ≤ 127): the narrowing keeps it.
                    let v = _mm512_add_epi32(_mm512_mullo_epi32(qi, _mm512_set1_epi32(254)), ri);
                    let words = _mm512_cvtepi32_epi16(_mm512_permutexvar_epi32(wide_order, v));
                    // SAFETY: values base+b..base+b+16 of x16 (2k bytes).
                    unsafe {
                        _mm256_storeu_si256(
                            x16.as_mut_ptr().add(2 * (base + b)) as *mut __m256i,
                            words,
                        )
                    };
                }
            }
            let (xs, rs) = (_mm512_reduce_add_epi32(xs), _mm512_reduce_add_epi32(rs));
            put_chunk_record(sums, c, ChunkRecord::new(xs, rs, s, w));
        }
    }

    /// The sum of the eight lanes (wrapping, as the twin's i32 adds; they never overflow).
    #[inline(always)]
    fn sum_i32(v: __m256i) -> i32 {
        let mut lanes = [0i32; 8];
        // SAFETY: 32 writable bytes.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, v) };
        lanes.iter().fold(0i32, |a, &b| a.wrapping_add(b))
    }

    /// 16 stored scales at `p` as f32 (exactly [`ScaleType::value`]).
    ///
    /// # Safety
    /// AVX-512F; 16 scales of type `st` readable at `p`.
    #[inline(always)]
    pub(crate) unsafe fn scales16(p: *const u8, st: ScaleType) -> __m512 {
        // SAFETY: the contract.
        unsafe {
            match st {
                ScaleType::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i)),
                    16,
                )),
                ScaleType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
                // u << 23, and 2⁻¹²⁷ (an f32 subnormal) for u = 0.
                ScaleType::E8M0 => _mm512_castsi512_ps(_mm512_max_epu32(
                    _mm512_slli_epi32(
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i)),
                        23,
                    ),
                    _mm512_set1_epi32(0x0040_0000),
                )),
                // The code at the top of a lane, shifted right arithmetically by 4 and
                // masked, is an f32 worth value · 2⁻¹²⁰ (subnormals too): times 2¹²⁰, exact.
                ScaleType::E4M3 => {
                    let d = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
                    let bits = _mm512_and_si512(
                        _mm512_srai_epi32(_mm512_slli_epi32(d, 24), 4),
                        _mm512_set1_epi32(0x87F0_0000u32 as i32),
                    );
                    // `vscalefps`, not a multiply: exact alike, and on AMD Zen 4 it leaves the
                    // multiply pipes to `vpdpbusd`.
                    _mm512_scalef_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(120.0))
                }
            }
        }
    }

    /// 8 stored scales at `p` as f32.
    ///
    /// # Safety
    /// AVX2 and F16C; 8 scales of type `st` readable at `p`.
    #[inline(always)]
    pub(crate) unsafe fn scales8(p: *const u8, st: ScaleType) -> __m256 {
        // SAFETY: the contract.
        unsafe {
            match st {
                ScaleType::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i)),
                    16,
                )),
                ScaleType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                ScaleType::E8M0 => _mm256_castsi256_ps(_mm256_max_epu32(
                    _mm256_slli_epi32(
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)),
                        23,
                    ),
                    _mm256_set1_epi32(0x0040_0000),
                )),
                ScaleType::E4M3 => {
                    let d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
                    let bits = _mm256_and_si256(
                        _mm256_srai_epi32(_mm256_slli_epi32(d, 24), 4),
                        _mm256_set1_epi32(0x87F0_0000u32 as i32),
                    );
                    _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(2f32.powi(120)))
                }
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    unsafe fn rows512<const R: usize, const LUT: bool, const ST: u8>(
        rows: &[*const u8],
        k: usize,
        (i0, n): (usize, usize),
        chunk: usize,
        group: usize,
        codes: *const u8,
        scales: *const u8,
        w: &WeightBytes,
        out: *mut f32,
    ) {
        // SAFETY: the IntFusedFn contract with exactly R rows: every block, activation word,
        // chunk record and scale read below is inside the caller's buffers.
        unsafe {
            let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(w.lut.as_ptr() as *const __m128i));
            let nib = _mm512_set1_epi32(0x0F0F_0F0F);
            let inv254 = _mm512_set1_ps(1.0 / 254.0);
            let dist =
                crate::kernels::prefetch::distance_of(crate::kernels::prefetch::Family::CodeGroups);
            let mut total = [[_mm512_setzero_ps(); 2]; R];
            for (c, g) in chunks_with_groups((i0, n), chunk, group) {
                // The sums start at the chunk's bias terms (broadcast loads, no adds after the
                // loop). With `vscalefps` for E4M3 scales, AMD Zen 4, from cache
                // (`kgroup_cycles`), ns per 128-byte block, 1 / 2 rows: MXFP4 3.75 / 5.78 ->
                // 3.47 / 5.23, NVFP4 5.03 / 8.00 -> 4.75 / 6.56, RAWINT4 2.90 -> 2.77.
                let mut a = [[_mm512_setzero_si512(); 2]; R];
                let mut b = [[_mm512_setzero_si512(); 2]; R];
                for r in 0..R {
                    let rec = chunk_record(rows[r], k, c);
                    a[r] = [_mm512_set1_epi32(rec.neg_bias_x); 2];
                    b[r] = [_mm512_set1_epi32(rec.neg_bias_r); 2];
                }
                for blk in c * chunk / 8..(c + 1) * chunk / 8 {
                    for h in 0..2 {
                        let at = codes.add(blk * 128 + 64 * h);
                        crate::kernels::prefetch::ahead(at, dist);
                        let d = _mm512_loadu_si512(at as *const __m512i);
                        let mut we = _mm512_and_si512(d, nib);
                        let mut wo = _mm512_and_si512(_mm512_srli_epi32(d, 4), nib);
                        if LUT {
                            we = _mm512_shuffle_epi8(lut, we);
                            wo = _mm512_shuffle_epi8(lut, wo);
                        }
                        for r in 0..R {
                            let x = rows[r].add(8 * blk) as *const i32;
                            let rr = rows[r].add(k + 8 * blk) as *const i32;
                            let (xe, xo) = (x.read_unaligned(), x.add(1).read_unaligned());
                            let (re, ro) = (rr.read_unaligned(), rr.add(1).read_unaligned());
                            a[r][h] = _mm512_dpbusd_epi32(a[r][h], we, _mm512_set1_epi32(xe));
                            a[r][h] = _mm512_dpbusd_epi32(a[r][h], wo, _mm512_set1_epi32(xo));
                            b[r][h] = _mm512_dpbusd_epi32(b[r][h], we, _mm512_set1_epi32(re));
                            b[r][h] = _mm512_dpbusd_epi32(b[r][h], wo, _mm512_set1_epi32(ro));
                        }
                    }
                }
                for r in 0..R {
                    let rec = chunk_record(rows[r], k, c);
                    let sx = _mm512_set1_ps(rec.s_inv_m);
                    for h in 0..2 {
                        let fa = _mm512_cvtepi32_ps(a[r][h]);
                        let fb = _mm512_cvtepi32_ps(b[r][h]);
                        let f = _mm512_fmadd_ps(fb, inv254, fa);
                        let st = scale_type_of(ST);
                        let at = scales.add((g * 32 + 16 * h) * st.size());
                        let sw = _mm512_mul_ps(scales16(at, st), sx);
                        total[r][h] = _mm512_fmadd_ps(f, sw, total[r][h]);
                    }
                }
            }
            for r in 0..R {
                for h in 0..2 {
                    let o = out.add(r * 32 + 16 * h);
                    _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), total[r][h]));
                }
            }
        }
    }

    /// The 256-bit multiply-accumulate of the AVX2-level kernels: a block's 8 inputs (the even
    /// nibbles' bytes `we` against activation word `xe`, the odd ones against `xo`) summed into
    /// each row's i32 lanes of `a`. Both implementations give the same exact integers.
    pub(crate) trait Acc256 {
        /// # Safety
        /// AVX2 and the implementation's own feature available.
        unsafe fn acc(a: __m256i, we: __m256i, wo: __m256i, xe: __m256i, xo: __m256i) -> __m256i;
        /// Whether [`Acc256::acc_narrow`] keeps i16 lanes (widened by [`Acc256::widen`] once per
        /// chunk), saving the per-block widening where the sums fit in 16 bits.
        const NARROW: bool = false;
        /// `acc` into running sums of [`Acc256::NARROW`]'s width (by default `acc` itself).
        ///
        /// # Safety
        /// As `acc`.
        #[inline(always)]
        unsafe fn acc_narrow(
            a: __m256i,
            we: __m256i,
            wo: __m256i,
            xe: __m256i,
            xo: __m256i,
        ) -> __m256i {
            // SAFETY: forwarded.
            unsafe { Self::acc(a, we, wo, xe, xo) }
        }
        /// Running sums of `acc_narrow` as i32 lanes, one per row (by default as they are).
        ///
        /// # Safety
        /// As `acc`.
        #[inline(always)]
        unsafe fn widen(a: __m256i) -> __m256i {
            a
        }
    }

    /// `vpmaddubsw` pairs widened by `vpmaddwd` (every AVX2 CPU). It cannot saturate: a byte
    /// is at most 24, an activation byte at most 127 in magnitude, so two products and the sum
    /// of two such pairs stay below 2^15.
    pub(crate) struct Maddubs;
    impl Maddubs {
        /// A block's 8 inputs as i16 lanes of 4 products each.
        #[inline(always)]
        unsafe fn products(we: __m256i, wo: __m256i, xe: __m256i, xo: __m256i) -> __m256i {
            // SAFETY: only inlined into functions with avx2 enabled.
            unsafe { _mm256_add_epi16(_mm256_maddubs_epi16(we, xe), _mm256_maddubs_epi16(wo, xo)) }
        }
    }
    impl Acc256 for Maddubs {
        #[inline(always)]
        unsafe fn acc(a: __m256i, we: __m256i, wo: __m256i, xe: __m256i, xo: __m256i) -> __m256i {
            // SAFETY: only inlined into functions with avx2 enabled.
            unsafe { _mm256_add_epi32(a, Self::widen(Self::products(we, wo, xe, xo))) }
        }
        const NARROW: bool = true;
        /// i16 lanes, where [`super::WeightBytes::narrow_sums_fit`] says they hold a chunk
        /// (int4 codes up to 32 inputs: 16·15·127 = 30480; E2M1 up to 16): a quarter fewer
        /// multiplies per block in the many-row 8-bit kernel (`gemm256`; the few-row kernel,
        /// [`folded256`], keeps its own i16 pair sums).
        #[inline(always)]
        unsafe fn acc_narrow(
            a: __m256i,
            we: __m256i,
            wo: __m256i,
            xe: __m256i,
            xo: __m256i,
        ) -> __m256i {
            // SAFETY: only inlined into functions with avx2 enabled.
            unsafe { _mm256_add_epi16(a, Self::products(we, wo, xe, xo)) }
        }
        #[inline(always)]
        unsafe fn widen(a: __m256i) -> __m256i {
            // SAFETY: only inlined into functions with avx2 enabled.
            unsafe { _mm256_madd_epi16(a, _mm256_set1_epi16(1)) }
        }
    }

    /// AVX-VNNI's VEX `vpdpbusd` (AVX2 CPUs without AVX-512 from 2021 on: Alder Lake, Sierra
    /// Forest): two instructions where `Maddubs` takes five.
    pub(crate) struct Vnni256;
    impl Acc256 for Vnni256 {
        #[inline(always)]
        unsafe fn acc(a: __m256i, we: __m256i, wo: __m256i, xe: __m256i, xo: __m256i) -> __m256i {
            // SAFETY: only inlined into functions with avxvnni enabled.
            unsafe { _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(a, we, xe), wo, xo) }
        }
    }

    /// [`Vnni256`] with an emulated `vpdpbusd`
    /// ([`dpbusd_avx2`](crate::kernels::group_dot::x86::dpbusd_avx2)): the AVX-VNNI loops on
    /// any AVX2 CPU (tests).
    #[cfg(test)]
    pub(crate) struct EmulatedVnni256;
    #[cfg(test)]
    impl Acc256 for EmulatedVnni256 {
        #[inline(always)]
        unsafe fn acc(a: __m256i, we: __m256i, wo: __m256i, xe: __m256i, xo: __m256i) -> __m256i {
            use crate::kernels::group_dot::x86::dpbusd_avx2;
            // SAFETY: only inlined into functions with avx2 enabled.
            unsafe { dpbusd_avx2(dpbusd_avx2(a, we, xe), wo, xo) }
        }
    }

    /// One block into a chunk's running sums: i16 lanes where `narrow` (an [`Acc256::NARROW`]
    /// multiply and codes for which [`super::WeightBytes::narrow_sums_fit`] holds), else i32.
    ///
    /// # Safety
    /// As [`Acc256::acc`].
    #[inline(always)]
    unsafe fn step<M: Acc256>(
        narrow: bool,
        a: __m256i,
        we: __m256i,
        wo: __m256i,
        xe: __m256i,
        xo: __m256i,
    ) -> __m256i {
        // SAFETY: forwarded.
        unsafe {
            if narrow {
                M::acc_narrow(a, we, wo, xe, xo)
            } else {
                M::acc(a, we, wo, xe, xo)
            }
        }
    }

    /// Quarter `o` of block `blk` of a panel (8 rows × 8 inputs, 32 bytes) as the bytes of its
    /// even and odd nibbles, each row's four in one i32 lane (looked up in `lut` where `LUT`);
    /// on even quarters, a prefetch `dist` bytes ahead ([`crate::kernels::prefetch::ahead`];
    /// 0: none).
    ///
    /// # Safety
    /// AVX2; the block lies inside `codes`.
    #[inline(always)]
    unsafe fn quarter_bytes<const LUT: bool>(
        codes: *const u8,
        blk: usize,
        o: usize,
        dist: usize,
        lut: __m256i,
        nib: __m256i,
    ) -> (__m256i, __m256i) {
        // SAFETY: the contract; only inlined into functions with avx2 enabled.
        unsafe {
            let at = codes.add(blk * 128 + 32 * o);
            if o.is_multiple_of(2) {
                crate::kernels::prefetch::ahead(at, dist);
            }
            let d = _mm256_loadu_si256(at as *const __m256i);
            let (we, wo) = (
                _mm256_and_si256(d, nib),
                _mm256_and_si256(_mm256_srli_epi32(d, 4), nib),
            );
            if LUT {
                (_mm256_shuffle_epi8(lut, we), _mm256_shuffle_epi8(lut, wo))
            } else {
                (we, wo)
            }
        }
    }

    /// A chunk's running sums of [`step`] as i32 lanes.
    ///
    /// # Safety
    /// As [`Acc256::acc`].
    #[inline(always)]
    unsafe fn chunk_total<M: Acc256>(narrow: bool, a: __m256i) -> __m256i {
        // SAFETY: forwarded.
        unsafe {
            if narrow {
                M::widen(a)
            } else {
                a
            }
        }
    }

    /// The few-row kernel on 256-bit vectors with separate byte-pair sums `A` and `B` (as
    /// [`super::int_fused_scalar`]); inlined into a wrapper that enables the features of `M`
    /// ([`call256_vnni`]: `vpdpbusd` adds into i32 lanes directly, so the folding of
    /// [`folded256`] would gain nothing there).
    #[inline(always)]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    unsafe fn rows256<const R: usize, const LUT: bool, const ST: u8, M: Acc256>(
        rows: &[*const u8],
        k: usize,
        (i0, n): (usize, usize),
        chunk: usize,
        group: usize,
        codes: *const u8,
        scales: *const u8,
        w: &WeightBytes,
        out: *mut f32,
    ) {
        // SAFETY: as rows512, 8 rows per quarter (the caller enables M's features).
        unsafe {
            let table = _mm_loadu_si128(w.lut.as_ptr() as *const __m128i);
            let lut = _mm256_set_m128i(table, table);
            let nib = _mm256_set1_epi32(0x0F0F_0F0F);
            let inv254 = _mm256_set1_ps(1.0 / 254.0);
            let dist =
                crate::kernels::prefetch::distance_of(crate::kernels::prefetch::Family::CodeGroups);
            let mut total = [[_mm256_setzero_ps(); 4]; R];
            for (c, g) in chunks_with_groups((i0, n), chunk, group) {
                // The sums start at the chunk's bias terms, as in rows512.
                let mut a = [[_mm256_setzero_si256(); 4]; R];
                let mut b = [[_mm256_setzero_si256(); 4]; R];
                for r in 0..R {
                    let rec = chunk_record(rows[r], k, c);
                    a[r] = [_mm256_set1_epi32(rec.neg_bias_x); 4];
                    b[r] = [_mm256_set1_epi32(rec.neg_bias_r); 4];
                }
                for blk in c * chunk / 8..(c + 1) * chunk / 8 {
                    for o in 0..4 {
                        let (we, wo) = quarter_bytes::<LUT>(codes, blk, o, dist, lut, nib);
                        for r in 0..R {
                            let x = rows[r].add(8 * blk) as *const i32;
                            let rr = rows[r].add(k + 8 * blk) as *const i32;
                            let (xe, xo, re, ro) =
                                (word(x), word(x.add(1)), word(rr), word(rr.add(1)));
                            a[r][o] = M::acc(a[r][o], we, wo, xe, xo);
                            b[r][o] = M::acc(b[r][o], we, wo, re, ro);
                        }
                    }
                }
                for r in 0..R {
                    let rec = chunk_record(rows[r], k, c);
                    let sx = _mm256_set1_ps(rec.s_inv_m);
                    for o in 0..4 {
                        let fa = _mm256_cvtepi32_ps(a[r][o]);
                        let fb = _mm256_cvtepi32_ps(b[r][o]);
                        let f = _mm256_fmadd_ps(fb, inv254, fa);
                        let st = scale_type_of(ST);
                        let at = scales.add((g * 32 + 8 * o) * st.size());
                        let sw = _mm256_mul_ps(scales8(at, st), sx);
                        total[r][o] = _mm256_fmadd_ps(f, sw, total[r][o]);
                    }
                }
            }
            for r in 0..R {
                for o in 0..4 {
                    let p = out.add(r * 32 + 8 * o);
                    _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), total[r][o]));
                }
            }
        }
    }

    /// A few-row entry point with the [`super::IntFusedFn`] signature: `$call::<R, LUT, ST>` for
    /// each listed row count R, ST the weights' scale type ([`scale_type_of`]).
    macro_rules! fused_entry {
        ($(#[$doc:meta])* $name:ident, $call:ident, $label:literal, $($r:literal)+) => {
            $(#[$doc])*
            #[allow(clippy::too_many_arguments)] // the IntFusedFn signature
            pub unsafe fn $name(
                rows: &[*const u8],
                k: usize,
                range: (usize, usize),
                chunk: usize,
                group: usize,
                codes: *const u8,
                scales: *const u8,
                w: &WeightBytes,
                out: *mut f32,
            ) {
                let args = (rows, k, range, chunk, group, codes, scales, w, out);
                // SAFETY: forwarded; ST is the weights' scale type.
                unsafe {
                    with_scale_type!(w.scale_type, ST => match (rows.len(), w.identity) {
                        $(
                            ($r, true) => $call::<$r, false, ST>(args),
                            ($r, false) => $call::<$r, true, ST>(args),
                        )+
                        (n, _) => panic!("{} takes 1 to {} rows, got {n}", $label, [$($r),+].len()),
                    })
                }
            }
        };
    }

    fused_entry!(
        /// AVX-VNNI integer kernel, one row a call: its 12 running vectors a row and the
        /// constants already fill the 16 registers, and at two rows the spills made a call 3.5x
        /// one row's time (AMD Zen 5 with `KT_KERNEL_CPU_VARIANT=avx2`, from cache, RAWINT4: 1
        /// row 2.54 ns per block, 2 rows 8.9), so two rows take two calls, the second finding
        /// the codes in cache.
        ///
        /// # Safety
        /// The [`super::IntFusedFn`] contract with 1 row; AVX2, FMA, F16C and AVX-VNNI available.
        int_fused_avxvnni, call256_vnni, "the kgroup int avx-vnni kernel", 1
    );
    #[cfg(test)]
    fused_entry!(
        /// [`int_fused_avxvnni`]'s loops with an emulated `vpdpbusd`, on any AVX2 CPU (tests).
        ///
        /// # Safety
        /// The [`super::IntFusedFn`] contract with at most 2 rows; AVX2, FMA and F16C available.
        int_fused_avxvnni_emulated, call256_vnni_emulated,
        "the emulated kgroup int avx-vnni kernel", 1
    );
    fused_entry!(
        /// AVX-512 VNNI integer kernel, 1 to 3 rows.
        ///
        /// # Safety
        /// The [`super::IntFusedFn`] contract; AVX-512F/BW/VNNI available.
        int_fused_avx512vnni, call512, "the kgroup int avx512 kernel", 1 2 3
    );

    /// How far ahead of its codes the many-row kernels' first pass over a panel prefetches
    /// into L2 (both lines of the 8-input block there, so the later passes and the next
    /// panel's start find them). The first row block of a panel otherwise waited on DRAM:
    /// AMD Zen 4, 512 tokens, RAWINT4 75 -> 70 ms (AVX2 kernels: 143-150 -> 132-134 ms),
    /// GPTQ_INT4 at 128 tokens 36.5 -> 31-33 ms; 2048 bytes gained half, 8192 no more.
    const GEMM_PREFETCH_BYTES: usize = 4096;

    /// Prefetch into L2 both lines of the 8-input block [`GEMM_PREFETCH_BYTES`] after block
    /// `blk` of `codes` (the address may lie past the panel).
    #[inline(always)]
    fn prefetch_block_ahead(codes: *const u8, blk: usize) {
        let at = codes.wrapping_add(blk * 128 + GEMM_PREFETCH_BYTES);
        crate::kernels::prefetch::line_into_l2(at);
        crate::kernels::prefetch::line_into_l2(at.wrapping_add(64));
    }

    /// Rows per call of [`int_gemm_avx512vnni`]: 4 accumulators a row, the block's four weight
    /// vectors, two activation words and the constants nearly fill the 32 registers. Against 12
    /// rows one half at a time (fewer rows per read of the codes, but twice the activation
    /// words per multiply-add), AMD Zen 5,
    /// RAWINT4 `prefill` alternated, 2 threads: 512 tokens 41.8-41.9 -> 34.8-35.0 ms, 128
    /// tokens 12.4-12.8 -> 10.0-10.3. Five rather than six: at six the epilogue's vectors
    /// no longer fit and the rate per row fell (from cache, `KERNEL=gemm kgroup_cycles`: 0.64
    /// ns per row and block at 5 rows, 0.75 at 6), and 512 tokens went 33.2-33.3 -> 32.0-32.2
    /// ms (blocks of 4-5 rows instead of 5-6).
    pub(crate) const GEMM_ROWS_512: usize = 5;
    /// Rows per call of [`int_gemm_avxvnni`] (not measured on an AVX-VNNI CPU, so left at 4).
    pub(crate) const GEMM_ROWS_AVXVNNI: usize = 4;
    /// Rows per call of [`int_gemm_avx2`]: 12 i16 accumulators, the two weight vectors, the
    /// nibble mask and one product fill the 16 registers, and the codes' load and unpacking
    /// are shared by 12 rows instead of 4. AMD Zen 3, RAWINT4 `prefill` alternated in one
    /// process: 512 tokens 266 -> 223 ms (2 threads), 128 tokens 86 -> 67 ms; per row and
    /// block from L2, 3.75-3.98 -> 3.38-3.63 ns (calm minutes), 6.7 -> 4.9-5.2 ns (slowed).
    pub(crate) const GEMM_ROWS_AVX2: usize = 12;

    /// The many-row kernel on both 16-row halves of the panel at once, every row's
    /// accumulators in registers: per 8 inputs, two 64-byte loads of codes feed `4·R`
    /// `vpdpbusd` (`8·R` with 15-bit activations), and each row's activation words serve both
    /// halves. One half at a time, the broadcast loads were as many as the multiply-adds and
    /// the loads limited the loop (rows per call: [`GEMM_ROWS_512`], [`FINE_ROWS_512`]).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    unsafe fn gemm512<const R: usize, const LUT: bool, const FINE: bool>(
        rows: &[*const u8],
        k: usize,
        (i0, n): (usize, usize),
        chunk: usize,
        group: usize,
        codes: *const u8,
        scales: *const u8,
        w: &WeightBytes,
        out: *mut f32,
    ) {
        // SAFETY: the IntFusedFn contract with exactly R rows: every block, activation word,
        // chunk record and scale read below is inside the caller's buffers.
        unsafe {
            let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(w.lut.as_ptr() as *const __m128i));
            let nib = _mm512_set1_epi32(0x0F0F_0F0F);
            let mut total = [[_mm512_setzero_ps(); 2]; R];
            for (c, g) in chunks_with_groups((i0, n), chunk, group) {
                let mut a = [[_mm512_setzero_si512(); 2]; R];
                let mut b = [[_mm512_setzero_si512(); 2]; R];
                for blk in c * chunk / 8..(c + 1) * chunk / 8 {
                    prefetch_block_ahead(codes, blk);
                    let mut wv = [_mm512_setzero_si512(); 4];
                    for h in 0..2 {
                        let d = _mm512_loadu_si512(codes.add(blk * 128 + 64 * h) as *const __m512i);
                        wv[2 * h] = _mm512_and_si512(d, nib);
                        wv[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi32(d, 4), nib);
                        if LUT {
                            wv[2 * h] = _mm512_shuffle_epi8(lut, wv[2 * h]);
                            wv[2 * h + 1] = _mm512_shuffle_epi8(lut, wv[2 * h + 1]);
                        }
                    }
                    for r in 0..R {
                        let x = rows[r].add(8 * blk) as *const i32;
                        let xe = _mm512_set1_epi32(x.read_unaligned());
                        let xo = _mm512_set1_epi32(x.add(1).read_unaligned());
                        for h in 0..2 {
                            a[r][h] = _mm512_dpbusd_epi32(a[r][h], wv[2 * h], xe);
                            a[r][h] = _mm512_dpbusd_epi32(a[r][h], wv[2 * h + 1], xo);
                        }
                        if FINE {
                            let rr = rows[r].add(k + 8 * blk) as *const i32;
                            let re = _mm512_set1_epi32(rr.read_unaligned());
                            let ro = _mm512_set1_epi32(rr.add(1).read_unaligned());
                            for h in 0..2 {
                                b[r][h] = _mm512_dpbusd_epi32(b[r][h], wv[2 * h], re);
                                b[r][h] = _mm512_dpbusd_epi32(b[r][h], wv[2 * h + 1], ro);
                            }
                        }
                    }
                }
                for h in 0..2 {
                    let at = scales.add((g * 32 + 16 * h) * w.scale_type.size());
                    let sw = scales16(at, w.scale_type);
                    for r in 0..R {
                        let rec = chunk_record(rows[r], k, c);
                        let ax = _mm512_add_epi32(a[r][h], _mm512_set1_epi32(rec.neg_bias_x));
                        // FINE: S = 254·(A − bias·X) + (B − bias·R) in i32 (shifts, off the
                        // multiply-add pipes), the twin's exact sum (|S| < 2²⁴, module docs).
                        let (s, sx) = if FINE {
                            let br = _mm512_add_epi32(b[r][h], _mm512_set1_epi32(rec.neg_bias_r));
                            let ax254 = _mm512_sub_epi32(
                                _mm512_slli_epi32::<8>(ax),
                                _mm512_slli_epi32::<1>(ax),
                            );
                            (_mm512_add_epi32(ax254, br), rec.s_inv_m254)
                        } else {
                            (ax, rec.s_inv_m)
                        };
                        let f = _mm512_cvtepi32_ps(s);
                        let swx = _mm512_mul_ps(sw, _mm512_set1_ps(sx));
                        total[r][h] = _mm512_fmadd_ps(f, swx, total[r][h]);
                    }
                }
            }
            for r in 0..R {
                for h in 0..2 {
                    let o = out.add(r * 32 + 16 * h);
                    _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), total[r][h]));
                }
            }
        }
    }

    /// The many-row kernel on 256-bit vectors, one 8-row quarter of the panel at a time;
    /// inlined into wrappers that enable the features of `M`. The first quarter's pass reads
    /// the codes from memory (prefetched [`GEMM_PREFETCH_BYTES`] ahead), at the pace of a
    /// quarter of the arithmetic; the second and third prefetch the range that follows (the
    /// next panel) into L2, a line per block each, so the next call's first pass finds its
    /// codes there. AMD Zen 3, RAWINT4 `prefill`, three arms alternated every 10 calls in one
    /// process, median ms: 128 tokens (8 rows per expert) 83.4 -> 77.5 and 85.2 -> 79.3; 512
    /// tokens 281.7 -> 278.5. Calls over ranges of 512 inputs, each prefetching the next,
    /// gained 1-3% more at 128 tokens and lost 4% at 512, so calls take whole panels.
    #[inline(always)]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    unsafe fn gemm256<
        const R: usize,
        const LUT: bool,
        const FINE: bool,
        const NARROW: bool,
        M: Acc256,
    >(
        rows: &[*const u8],
        k: usize,
        (i0, n): (usize, usize),
        chunk: usize,
        group: usize,
        codes: *const u8,
        scales: *const u8,
        w: &WeightBytes,
        out: *mut f32,
    ) {
        // SAFETY: as gemm512, 8 rows per quarter (the caller enables M's features).
        unsafe {
            let table = _mm_loadu_si128(w.lut.as_ptr() as *const __m128i);
            let lut = _mm256_set_m128i(table, table);
            let nib = _mm256_set1_epi32(0x0F0F_0F0F);
            // i16 running sums where they fit (`WeightBytes::narrow_sums_fit`, checked by
            // the wrapper).
            let narrow = M::NARROW && NARROW;
            for o in 0..4 {
                let mut total = [_mm256_setzero_ps(); R];
                for (c, g) in chunks_with_groups((i0, n), chunk, group) {
                    let mut a = [_mm256_setzero_si256(); R];
                    let mut b = [_mm256_setzero_si256(); R];
                    for blk in c * chunk / 8..(c + 1) * chunk / 8 {
                        if o == 0 {
                            prefetch_block_ahead(codes, blk);
                        } else if o < 3 {
                            // The matching line of the block as far into the range after
                            // this one (for a whole panel, the next panel's, which a task
                            // usually reads next): its DRAM reads overlap this arithmetic.
                            let at = (i0 + n) / 8 + blk - i0 / 8;
                            crate::kernels::prefetch::line_into_l2(
                                codes.wrapping_add(at * 128 + 64 * (o - 1)),
                            );
                        }
                        let (we, wo) = quarter_bytes::<LUT>(codes, blk, o, 0, lut, nib);
                        for r in 0..R {
                            let x = rows[r].add(8 * blk) as *const i32;
                            a[r] = step::<M>(narrow, a[r], we, wo, word(x), word(x.add(1)));
                            if FINE {
                                let rr = rows[r].add(k + 8 * blk) as *const i32;
                                b[r] = step::<M>(narrow, b[r], we, wo, word(rr), word(rr.add(1)));
                            }
                        }
                    }
                    let at = scales.add((g * 32 + 8 * o) * w.scale_type.size());
                    let sw = scales8(at, w.scale_type);
                    for r in 0..R {
                        let rec = chunk_record(rows[r], k, c);
                        let mut f = _mm256_cvtepi32_ps(_mm256_add_epi32(
                            chunk_total::<M>(narrow, a[r]),
                            _mm256_set1_epi32(rec.neg_bias_x),
                        ));
                        // FINE: S = 254·(A − bias·X) + (B − bias·R), exact in f32 (module docs).
                        let sx = if FINE {
                            let fb = _mm256_cvtepi32_ps(_mm256_add_epi32(
                                chunk_total::<M>(narrow, b[r]),
                                _mm256_set1_epi32(rec.neg_bias_r),
                            ));
                            f = _mm256_fmadd_ps(f, _mm256_set1_ps(254.0), fb);
                            rec.s_inv_m254
                        } else {
                            rec.s_inv_m
                        };
                        let swx = _mm256_mul_ps(sw, _mm256_set1_ps(sx));
                        total[r] = _mm256_fmadd_ps(f, swx, total[r]);
                    }
                }
                for r in 0..R {
                    let p = out.add(r * 32 + 8 * o);
                    _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), total[r]));
                }
            }
        }
    }

    /// The activation word (4 bytes) at `p` in every lane.
    ///
    /// # Safety
    /// 4 readable bytes at `p`; AVX available (inlined into the kernels).
    #[inline(always)]
    unsafe fn word(p: *const i32) -> __m256i {
        // SAFETY: the contract.
        unsafe { _mm256_set1_epi32(p.read_unaligned()) }
    }

    /// `gemm256` with the multiply `$mul`, enabling its features.
    macro_rules! gemm256_wrapper {
        ($name:ident, $mul:ty, $features:literal) => {
            /// # Safety
            /// The many-row [`super::IntFusedFn`] contract with exactly R rows; the CPU has
            /// the features named here.
            #[target_feature(enable = $features)]
            #[allow(clippy::too_many_arguments)]
            unsafe fn $name<const R: usize, const LUT: bool, const FINE: bool>(
                rows: &[*const u8],
                k: usize,
                range: (usize, usize),
                chunk: usize,
                group: usize,
                codes: *const u8,
                scales: *const u8,
                w: &WeightBytes,
                out: *mut f32,
            ) {
                let args = (rows, k, range, chunk, group, codes, scales, w, out);
                // SAFETY: forwarded; the features are enabled here; the narrow sums fit.
                unsafe {
                    if <$mul as Acc256>::NARROW && w.narrow_sums_fit(chunk) {
                        gemm256::<R, LUT, FINE, true, $mul>(
                            args.0, args.1, args.2, args.3, args.4, args.5, args.6, args.7, args.8,
                        )
                    } else {
                        gemm256::<R, LUT, FINE, false, $mul>(
                            args.0, args.1, args.2, args.3, args.4, args.5, args.6, args.7, args.8,
                        )
                    }
                }
            }
        };
    }
    gemm256_wrapper!(gemm256_avx2, Maddubs, "avx2,fma,f16c");
    gemm256_wrapper!(gemm256_vnni, Vnni256, "avx2,fma,f16c,avxvnni");
    #[cfg(test)]
    gemm256_wrapper!(gemm256_vnni_emulated, EmulatedVnni256, "avx2,fma,f16c");

    /// Instantiate `$kernel::<R, LUT>` for every row count up to the kernel's block.
    macro_rules! dispatch_rows {
        ($kernel:ident, $fine:literal, $args:expr, $name:literal, $($r:literal)+) => {{
            let a: Args = $args;
            match (a.0.len(), a.7.identity) {
                $(
                    ($r, true) => {
                        $kernel::<$r, false, $fine>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8)
                    }
                    ($r, false) => {
                        $kernel::<$r, true, $fine>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8)
                    }
                )+
                (n, _) => panic!("{} takes 1 to {} rows, got {n}", $name, [$($r),+].len()),
            }
        }};
    }

    /// Rows per call of [`int_fine_gemm_avx512vnni`]: 6 accumulators a row. AMD Zen 5, 128
    /// tokens, 2 threads, `prefill` alternated: GPTQ_INT4 18.2-18.4 -> 15.0 ms, NVFP4
    /// 22.9-23.1 -> 19.7-19.8 (against 8 rows, one half at a time). At 512 tokens the bf16
    /// panels still win ([`super::BF16_PANELS_FROM_ROWS`] at 64: NVFP4 56 -> 79 ms).
    /// Three, not four: at four the 24 accumulators, the weight vectors and the constants
    /// overflow the registers, the running totals go to the stack every chunk, and the rate
    /// then hung on where that stack lay against other loads: the worker thread ran
    /// NVFP4's down panels 1.5x slower than the caller's in some builds and not in others
    /// (the code moved by an unrelated function). Whole layer, 128 tokens, Python benchmark
    /// (`ab_bench.sh`, 3 rounds): NVFP4 21.7 -> 18.3 ms, GPTQ_INT4 15.1 -> 14.6, MXFP4 15.9 ->
    /// 15.3; from cache (`KERNEL=fine kgroup_cycles`) 3 rows ran 1.59/1.20/1.27 ns per row and
    /// block against 4 rows' 1.63/1.23/1.30 (NVFP4/GPTQ_INT4/MXFP4), and the i32 form of
    /// `S` (no f32 constant, one conversion) took 3 rows to 1.56/1.18/1.23.
    pub(crate) const FINE_ROWS_512: usize = 3;
    /// Rows per call of [`int_fine_gemm_avxvnni`].
    pub(crate) const FINE_ROWS_256: usize = 3;
    /// Rows per call of [`int_fine_gemm_avx2`]: from 16 rows groups of 8 in vector lanes
    /// ([`token_lanes256`]), the rest 1 to [`ROW_BLOCK_256`] at a time ([`wide_gemm256`]).
    pub(crate) const WIDE_ROWS_256: usize = crate::kernels::MAX_ROWS;
    /// Rows per call of [`wide_gemm256`]: 8 accumulators and the 4 weight-pair vectors leave
    /// room for the products, and the codes' unpacking is shared by twice the rows of 4. AMD
    /// Zen 3, MXFP4 from L2 alternated in one process, ns per row and block: 8 rows 6.1-6.2
    /// -> 5.6 (calm minutes), 8.5-8.8 -> 7.5 (slowed); 6 rows 6.5 -> 5.6; `prefill MXFP4 128`
    /// one thread 144 -> 137 ms, GPTQ_INT4 two threads 91 -> 86 ms.
    const ROW_BLOCK_256: usize = 8;

    /// A public entry point: `$kernel::<R, LUT, $fine>` for 1 to the listed rows, with the
    /// [`super::IntFusedFn`] signature.
    macro_rules! gemm_entry {
        ($(#[$doc:meta])* $name:ident, $kernel:ident, $fine:literal, $label:literal, $($r:literal)+) => {
            $(#[$doc])*
            #[allow(clippy::too_many_arguments)] // the IntFusedFn signature
            pub unsafe fn $name(
                rows: &[*const u8],
                k: usize,
                range: (usize, usize),
                chunk: usize,
                group: usize,
                codes: *const u8,
                scales: *const u8,
                w: &WeightBytes,
                out: *mut f32,
            ) {
                // SAFETY: forwarded.
                unsafe {
                    dispatch_rows!(
                        $kernel,
                        $fine,
                        (rows, k, range, chunk, group, codes, scales, w, out),
                        $label,
                        $($r)+
                    )
                }
            }
        };
    }

    gemm_entry!(
        /// AVX-512 VNNI many-row kernel, 1 to [`GEMM_ROWS_512`] rows.
        ///
        /// # Safety
        /// The [`super::IntFusedFn`] contract; AVX-512F/BW/VNNI available.
        int_gemm_avx512vnni, gemm512, false, "the kgroup avx512 gemm kernel", 1 2 3 4 5
    );
    gemm_entry!(
        /// AVX2 many-row kernel, 1 to [`GEMM_ROWS_AVX2`] rows.
        ///
        /// # Safety
        /// The [`super::IntFusedFn`] contract; AVX2, FMA and F16C available.
        int_gemm_avx2, gemm256_avx2, false, "the kgroup avx2 gemm kernel",
        1 2 3 4 5 6 7 8 9 10 11 12
    );
    gemm_entry!(
        /// AVX-VNNI many-row kernel, 1 to [`GEMM_ROWS_AVXVNNI`] rows.
        ///
        /// # Safety
        /// The [`super::IntFusedFn`] contract; AVX2, FMA, F16C and AVX-VNNI available.
        int_gemm_avxvnni, gemm256_vnni, false, "the kgroup avx-vnni gemm kernel", 1 2 3 4
    );
    #[cfg(test)]
    gemm_entry!(
        /// [`int_gemm_avxvnni`]'s loops with an emulated `vpdpbusd`, on any AVX2 CPU (tests).
        ///
        /// # Safety
        /// The [`super::IntFusedFn`] contract; AVX2, FMA and F16C available.
        int_gemm_avxvnni_emulated, gemm256_vnni_emulated, false,
        "the emulated kgroup avx-vnni gemm kernel", 1 2 3 4
    );
    gemm_entry!(
        /// AVX-512 VNNI many-row kernel with 15-bit activations, 1 to [`FINE_ROWS_512`] rows.
        ///
        /// # Safety
        /// The [`super::IntFusedFn`] contract; AVX-512F/BW/VNNI available.
        int_fine_gemm_avx512vnni, gemm512, true, "the kgroup avx512 fine gemm kernel",
        1 2 3
    );
    /// AVX2 many-row kernel with 15-bit activations (`x16`, [`super::WIDE_SLOTS`]), 1 to
    /// [`WIDE_ROWS_256`] rows: from 16 rows groups of 8 in vector lanes ([`super::lane_rows`],
    /// [`pack_lanes256`], [`token_lanes256`]), the remaining rows in even blocks of up to
    /// [`ROW_BLOCK_256`] ([`wide_gemm256`]).
    ///
    /// # Safety
    /// The [`super::IntFusedFn`] contract; AVX2, FMA and F16C available.
    #[allow(clippy::too_many_arguments)] // the IntFusedFn signature
    pub unsafe fn int_fine_gemm_avx2(
        rows: &[*const u8],
        k: usize,
        range: (usize, usize),
        chunk: usize,
        group: usize,
        codes: *const u8,
        scales: *const u8,
        w: &WeightBytes,
        out: *mut f32,
    ) {
        // SAFETY: forwarded.
        unsafe { fine_gemm_avx2(None, (rows, k, range, chunk, group, codes, scales, w, out)) }
    }

    /// [`int_fine_gemm_avx2`] keeping the token-lane packing of the rows for the next panels
    /// of the same rows ([`crate::kernels::row_cache`], under `reuse`): packed once per row
    /// block and thread instead of transposed again for every 32-row panel.
    ///
    /// # Safety
    /// As [`int_fine_gemm_avx2`]; and the bytes of the rows do not change while `reuse` is in
    /// use (the [`crate::formats::RowBlock::reuse`] promise).
    #[allow(clippy::too_many_arguments)] // the IntFusedFn signature and the key
    pub unsafe fn int_fine_gemm_avx2_reusing(
        reuse: u64,
        rows: &[*const u8],
        k: usize,
        range: (usize, usize),
        chunk: usize,
        group: usize,
        codes: *const u8,
        scales: *const u8,
        w: &WeightBytes,
        out: *mut f32,
    ) {
        // SAFETY: forwarded.
        unsafe {
            fine_gemm_avx2(
                Some(reuse),
                (rows, k, range, chunk, group, codes, scales, w, out),
            )
        }
    }

    /// The layout tag of token-lane packings ([`crate::kernels::row_cache::PackingKey`]).
    const LANES_LAYOUT: u64 = 2;

    /// [`int_fine_gemm_avx2`], its token-lane packing kept under `reuse` when given.
    ///
    /// # Safety
    /// As [`int_fine_gemm_avx2_reusing`].
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fine_gemm_avx2(reuse: Option<u64>, a: Args) {
        let (rows, k, range, chunk, group, codes, scales, w, out) = a;
        let n = rows.len();
        assert!(
            (1..=WIDE_ROWS_256).contains(&n),
            "the kgroup avx2 fine gemm kernel takes 1 to {WIDE_ROWS_256} rows, got {n}"
        );
        let lanes = super::lane_rows(n);
        if lanes > 0 {
            let lane_rows = &rows[..lanes];
            let len = lanes_bytes(lanes, k, chunk);
            // SAFETY: the contract: rows of k inputs in chunks of `chunk`; the buffer holds
            // `len` bytes, 64-byte aligned, as the packer checks.
            let pack = |dst: &mut [u8]| unsafe { pack_lanes256(lane_rows, k, chunk, dst) };
            // SAFETY: the contract, for the first `lanes` rows, packed by `pack` with the same
            // `k` and `chunk`.
            let run = |packed: &[u8]| unsafe {
                token_lanes256(packed, lanes, range, chunk, group, codes, scales, w, out)
            };
            match reuse {
                Some(key) => {
                    let layout = [
                        LANES_LAYOUT,
                        ((k as u64) << 8) | chunk as u64,
                        w.inv_m254.to_bits() as u64,
                    ];
                    let key = crate::kernels::row_cache::PackingKey::new(key, layout, lane_rows);
                    crate::kernels::row_cache::with_packing(key, len, pack, run);
                }
                None => {
                    let mut buf = crate::pack::AlignedBuf::<u8>::zeroed(len)
                        .expect("a token-lane packing buffer");
                    pack(buf.as_mut_slice());
                    run(buf.as_slice());
                }
            }
        }
        let rest = n - lanes;
        let blocks = rest.div_ceil(ROW_BLOCK_256);
        for b in 0..blocks {
            let (first, last) = (lanes + b * rest / blocks, lanes + (b + 1) * rest / blocks);
            // SAFETY: forwarded: rows `first..last` with their outputs from row `first`.
            unsafe {
                let args = (
                    &rows[first..last],
                    k,
                    range,
                    chunk,
                    group,
                    codes,
                    scales,
                    w,
                    out.add(first * 32),
                );
                match last - first {
                    1 => wide_gemm256::<1>(args),
                    2 => wide_gemm256::<2>(args),
                    3 => wide_gemm256::<3>(args),
                    4 => wide_gemm256::<4>(args),
                    5 => wide_gemm256::<5>(args),
                    6 => wide_gemm256::<6>(args),
                    7 => wide_gemm256::<7>(args),
                    _ => wide_gemm256::<8>(args),
                }
            }
        }
    }

    /// Quarter `o` of block `blk` as the i16 weight pairs of its 8 rows, one vector per pair
    /// of inputs `(0,4) (2,6) (1,5) (3,7)` ([`super::WIDE_SLOTS`]): the looked-up bytes of the
    /// even and odd nibbles ([`quarter_bytes`], `lut` the signed values), each byte
    /// sign-extended in its 16-bit lane.
    ///
    /// # Safety
    /// AVX2; the block lies inside `codes`.
    #[inline(always)]
    unsafe fn signed_pairs(
        codes: *const u8,
        blk: usize,
        o: usize,
        lut: __m256i,
        nib: __m256i,
    ) -> [__m256i; 4] {
        // SAFETY: the contract; only inlined into functions with avx2 enabled.
        unsafe {
            let (even, odd) = quarter_bytes::<true>(codes, blk, o, 0, lut, nib);
            [
                _mm256_srai_epi16(_mm256_slli_epi16(even, 8), 8),
                _mm256_srai_epi16(even, 8),
                _mm256_srai_epi16(_mm256_slli_epi16(odd, 8), 8),
                _mm256_srai_epi16(odd, 8),
            ]
        }
    }

    /// Per-call scratch, all in L1: the chunk's unpacked weights `[quarter][block][pair
    /// slot]` (8 outputs per vector; a quarter's (block, slot) steps contiguous), the running
    /// totals `[output][token group]` and the chunk's weight scales.
    #[repr(C, align(32))]
    struct TokenScratch {
        weights: [[[__m256i; 4]; 4]; 4],
        totals: [[__m256; 4]; 32],
        scale_w: [f32; 32],
    }

    /// Bytes of one token group's record per chunk in a token-lane packing: `chunk/8` blocks
    /// of 4 transposed word vectors, then the 8 tokens' `s · inv_m/254`.
    fn lane_record_bytes(chunk: usize) -> usize {
        (chunk / 8) * 128 + 32
    }

    /// Bytes of the token-lane packing of `rows` rows (groups of 8, the last padded) of `k`
    /// inputs in chunks of `chunk` ([`pack_lanes256`]).
    pub(crate) fn lanes_bytes(rows: usize, k: usize, chunk: usize) -> usize {
        (k / chunk) * rows.div_ceil(8) * lane_record_bytes(chunk)
    }

    /// Packs prepared rows (at most 32; a last group of fewer than 8 is padded with zero
    /// tokens: zero words and scale) for [`token_lanes256`]: per chunk
    /// (all `k` inputs) and token group, each block's `x16` words transposed so a vector holds
    /// one word of 8 tokens (`[block][word]`, 32 bytes each: tokens i and i + 4 in one
    /// 128-bit lane each, then a 4 × 4 transpose within each lane), then the tokens' chunk
    /// scales times `inv_m254` (8 f32). Made once per row block, read by every panel.
    ///
    /// # Safety
    /// Each row holds [`super::row_bytes`]`(k, chunk)` bytes made by [`super::prepare_row`];
    /// AVX2 available.
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn pack_lanes256(rows: &[*const u8], k: usize, chunk: usize, dst: &mut [u8]) {
        let groups = rows.len().div_ceil(8);
        assert!((1..=4).contains(&groups));
        assert!(chunk.is_multiple_of(8) && chunk <= 32 && k.is_multiple_of(chunk));
        assert!(
            dst.len() >= lanes_bytes(rows.len(), k, chunk)
                && (dst.as_ptr() as usize).is_multiple_of(32)
        );
        let (wide, blocks, record) = (
            super::wide_at(k, chunk),
            chunk / 8,
            lane_record_bytes(chunk),
        );
        let dst = dst.as_mut_ptr();
        for c in 0..k / chunk {
            for tg in 0..groups {
                let group_rows = &rows[8 * tg..rows.len().min(8 * tg + 8)];
                // SAFETY: the contract: block c·chunk/8 + b's 16 x16 bytes and chunk c's record
                // lie inside each row; the record lies inside `dst` (checked above), aligned.
                unsafe {
                    let at = dst.add((c * groups + tg) * record);
                    for b in 0..blocks {
                        // Tokens past the rows (a padded last group): zero words.
                        let words = |i: usize| match group_rows.get(i) {
                            Some(row) => {
                                let p = row.add(wide + 16 * (c * blocks + b));
                                _mm_loadu_si128(p as *const __m128i)
                            }
                            None => _mm_setzero_si128(),
                        };
                        let y: [__m256i; 4] =
                            std::array::from_fn(|i| _mm256_set_m128i(words(i + 4), words(i)));
                        let (lo01, hi01) = (
                            _mm256_unpacklo_epi32(y[0], y[1]),
                            _mm256_unpackhi_epi32(y[0], y[1]),
                        );
                        let (lo23, hi23) = (
                            _mm256_unpacklo_epi32(y[2], y[3]),
                            _mm256_unpackhi_epi32(y[2], y[3]),
                        );
                        let v = at.add(128 * b) as *mut __m256i;
                        _mm256_store_si256(v, _mm256_unpacklo_epi64(lo01, lo23));
                        _mm256_store_si256(v.add(1), _mm256_unpackhi_epi64(lo01, lo23));
                        _mm256_store_si256(v.add(2), _mm256_unpacklo_epi64(hi01, hi23));
                        _mm256_store_si256(v.add(3), _mm256_unpackhi_epi64(hi01, hi23));
                    }
                    let sx = at.add(128 * blocks) as *mut f32;
                    for i in 0..8 {
                        *sx.add(i) = match group_rows.get(i) {
                            Some(&row) => chunk_record(row, k, c).s_inv_m254,
                            None => 0.0,
                        };
                    }
                }
            }
        }
    }

    /// The many-row kernel with tokens in the vector lanes, for 1 to 32 rows (groups of 8, the
    /// last one padded) packed by [`pack_lanes256`]: per chunk the panel's codes are unpacked
    /// once into i16 weight pairs (as [`wide_gemm256`] unpacks them) in an L1 scratch; then per
    /// 4 outputs and two token groups each input pair takes 4 broadcast weight words and 8
    /// `vpmaddwd` (one broadcast per two multiplies, where the row kernel takes one per
    /// multiply and unpacks per 4 rows). The same integer sums and fp32 steps as
    /// [`super::int_fine_gemm_scalar`], so bit-identical to it.
    ///
    /// # Safety
    /// The [`super::IntFusedFn`] contract for `rows` rows (at most 32), their
    /// packing `packed` ([`pack_lanes256`] with the same `k` and `chunk`) in place of the
    /// rows; AVX2, FMA and F16C available.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)] // the IntFusedFn arguments, packed rows for rows
    unsafe fn token_lanes256(
        packed: &[u8],
        rows: usize,
        (i0, n): (usize, usize),
        chunk: usize,
        group: usize,
        codes: *const u8,
        scales: *const u8,
        w: &WeightBytes,
        out: *mut f32,
    ) {
        let groups = rows.div_ceil(8);
        assert!((1..=4).contains(&groups) && chunk <= 32);
        let record = lane_record_bytes(chunk);
        assert!(packed.len() >= (i0 + n) / chunk * groups * record);
        // SAFETY: the contract: every block, chunk record and scale read below is inside the
        // caller's buffers (the packing's length checked above); the scratch indices stay
        // within its arrays (blocks per chunk ≤ 4, groups ≤ 4, outputs < 32).
        unsafe {
            let mut sc: TokenScratch = std::mem::zeroed();
            let table = _mm_loadu_si128(w.signed.as_ptr() as *const __m128i);
            let lut = _mm256_set_m128i(table, table);
            let nib = _mm256_set1_epi8(0x0F);
            let blocks = chunk / 8;
            for (c, g) in chunks_with_groups((i0, n), chunk, group) {
                let blk0 = c * chunk / 8;
                for b in 0..blocks {
                    prefetch_block_ahead(codes, blk0 + b);
                    for o in 0..4 {
                        sc.weights[o][b] = signed_pairs(codes, blk0 + b, o, lut, nib);
                    }
                }
                let at = scales.add(g * 32 * w.scale_type.size());
                for o in 0..4 {
                    let sw = scales8(at.add(8 * o * w.scale_type.size()), w.scale_type);
                    _mm256_storeu_ps(sc.scale_w.as_mut_ptr().add(8 * o), sw);
                }
                let chunk_records = packed.as_ptr().add(c * groups * record);
                let mut tg = 0;
                while tg < groups {
                    let first = chunk_records.add(tg * record);
                    if groups - tg >= 2 {
                        lanes_chunk::<2>(&mut sc, first, record, tg, blocks);
                        tg += 2;
                    } else {
                        lanes_chunk::<1>(&mut sc, first, record, tg, blocks);
                        tg += 1;
                    }
                }
            }
            for j in 0..32 {
                for tg in 0..groups {
                    let mut lanes = [0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), sc.totals[j][tg]);
                    // A padded last group's zero tokens have no output row.
                    for (i, v) in lanes.iter().enumerate().take(rows - 8 * tg) {
                        *out.add((8 * tg + i) * 32 + j) += v;
                    }
                }
            }
        }
    }

    /// One chunk of [`token_lanes256`] for token groups `tg..tg + G` (their packed records
    /// from `first`, `record` bytes apart), all 32 outputs: 4 outputs × G groups of i32 sums,
    /// then each added to its total as the twin does, `total = fma(S, scale_w · scale_x,
    /// total)`.
    ///
    /// # Safety
    /// AVX2 and FMA (inlined into [`token_lanes256`]); `blocks ≤ 4`, `tg + G ≤ 4`; G records
    /// of `blocks` word blocks and a scale vector from `first`, 32-byte aligned.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)]
    unsafe fn lanes_chunk<const G: usize>(
        sc: &mut TokenScratch,
        first: *const u8,
        record: usize,
        tg: usize,
        blocks: usize,
    ) {
        // SAFETY: the contract; the broadcast reads lanes `l0..l0 + 4 ≤ 8` of one vector.
        unsafe {
            let words: [*const __m256i; G] =
                std::array::from_fn(|gg| first.add(gg * record) as *const __m256i);
            // Read at each flush (a memory operand), not held in registers the loop needs.
            let scale_x: [*const f32; G] =
                std::array::from_fn(|gg| first.add(gg * record + 128 * blocks) as *const f32);
            for j0 in (0..32).step_by(4) {
                let (o, l0) = (j0 / 8, j0 % 8);
                let mut acc = [[_mm256_setzero_si256(); G]; 4];
                // One loop over (block, slot) steps through raw pointers: unrolled slots made
                // LLVM spill accumulators, indexing put bounds checks and index arithmetic in
                // the loop (about 10 scalar ops per 22 vector ones).
                let weights = sc.weights[o].as_ptr() as *const __m256i;
                for step in 0..4 * blocks {
                    let x: [__m256i; G] = std::array::from_fn(|gg| *words[gg].add(step));
                    let pairs = weights.add(step) as *const i32;
                    for jj in 0..4 {
                        let wb = _mm256_set1_epi32(*pairs.add(l0 + jj));
                        for gg in 0..G {
                            let p = _mm256_madd_epi16(wb, x[gg]);
                            acc[jj][gg] = _mm256_add_epi32(acc[jj][gg], p);
                        }
                    }
                }
                for jj in 0..4 {
                    let swj = _mm256_set1_ps(sc.scale_w[j0 + jj]);
                    for gg in 0..G {
                        let swx = _mm256_mul_ps(swj, _mm256_load_ps(scale_x[gg]));
                        let t = &mut sc.totals[j0 + jj][tg + gg];
                        *t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[jj][gg]), swx, *t);
                    }
                }
            }
        }
    }

    /// The many-row kernel on 256-bit vectors with 15-bit activations as one i16 each: a
    /// 32-byte quarter of a block (8 rows, 8 inputs) becomes four vectors of i16 pairs per
    /// row lane (inputs `(0,4) (2,6) (1,5) (3,7)`: the low and high bytes of the looked-up
    /// even and odd nibbles), each met by one broadcast `x16` word through `vpmaddwd`. Four
    /// multiplies per row and 64 products, where the byte pairs of [`gemm256`] take six
    /// (AMD Zen 3 runs two per cycle); the weights' sign-extension is shared by the rows.
    /// The first quarter prefetches its block's lines [`GEMM_PREFETCH_BYTES`] ahead (as does
    /// [`token_lanes256`]): without it the codes came at the hardware prefetchers' pace.
    /// AMD Zen 3, one core, 8 rows, panels from memory (`KERNEL=fine ROWS=8 PANELS=2000
    /// kgroup_cycles`, MXFP4, alternated trial by trial): 10.5-12.1 -> 7.7-9.7 ns per block
    /// and row (medians). S1 layer, alternated every 10 calls in one process (`prefill M
    /// N`), median ms: 128 tokens MXFP4 91.2 -> 78.2, GPTQ_INT4 84.3 -> 72.3; 256 tokens
    /// MXFP4 160.8 -> 154.3; 512 tokens GPTQ_INT4 298 -> 278, MXFP4 309 -> 291, NVFP4 355 ->
    /// 351 and 301 -> 322 (noise).
    ///
    /// # Safety
    /// The [`super::IntFusedFn`] contract with exactly R rows; AVX2, FMA and F16C available.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)]
    unsafe fn wide_gemm256<const R: usize>(a: Args) {
        let (rows, k, (i0, n), chunk, group, codes, scales, w, out) = a;
        // SAFETY: the contract: every block, x16 word, chunk record and scale read below is
        // inside the caller's buffers.
        unsafe {
            let table = _mm_loadu_si128(w.signed.as_ptr() as *const __m128i);
            let lut = _mm256_set_m128i(table, table);
            let nib = _mm256_set1_epi8(0x0F);
            let mut x16 = [std::ptr::null::<i32>(); R];
            for r in 0..R {
                x16[r] = rows[r].add(super::wide_at(k, chunk)) as *const i32;
            }
            // Chunk by chunk, all four quarters (each block's two lines read once), the
            // running totals in an L1 scratch: the same fp32 operations as totals in registers.
            let mut total = [[0f32; 32]; R];
            for (c, g) in chunks_with_groups((i0, n), chunk, group) {
                let at = scales.add(g * 32 * w.scale_type.size());
                let mut sx = [0f32; R];
                for r in 0..R {
                    sx[r] = chunk_record(rows[r], k, c).s_inv_m254;
                }
                for o in 0..4 {
                    let mut acc = [_mm256_setzero_si256(); R];
                    for blk in c * chunk / 8..(c + 1) * chunk / 8 {
                        if o == 0 {
                            prefetch_block_ahead(codes, blk);
                        }
                        let [w04, w26, w15, w37] = signed_pairs(codes, blk, o, lut, nib);
                        for r in 0..R {
                            let x = x16[r].add(4 * blk);
                            let s0 = _mm256_add_epi32(
                                _mm256_madd_epi16(w04, word(x)),
                                _mm256_madd_epi16(w26, word(x.add(1))),
                            );
                            let s1 = _mm256_add_epi32(
                                _mm256_madd_epi16(w15, word(x.add(2))),
                                _mm256_madd_epi16(w37, word(x.add(3))),
                            );
                            acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(s0, s1));
                        }
                    }
                    let sw = scales8(at.add(8 * o * w.scale_type.size()), w.scale_type);
                    for r in 0..R {
                        let swx = _mm256_mul_ps(sw, _mm256_set1_ps(sx[r]));
                        let t = total[r].as_mut_ptr().add(8 * o);
                        let sum =
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), swx, _mm256_loadu_ps(t));
                        _mm256_storeu_ps(t, sum);
                    }
                }
            }
            for r in 0..R {
                for o in 0..4 {
                    let p = out.add(r * 32 + 8 * o);
                    let t = _mm256_loadu_ps(total[r].as_ptr().add(8 * o));
                    _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), t));
                }
            }
        }
    }
    gemm_entry!(
        /// AVX-VNNI many-row kernel with 15-bit activations, 1 to [`FINE_ROWS_256`] rows.
        ///
        /// # Safety
        /// The [`super::IntFusedFn`] contract; AVX2, FMA, F16C and AVX-VNNI available.
        int_fine_gemm_avxvnni, gemm256_vnni, true, "the kgroup avx-vnni fine gemm kernel", 1 2 3
    );
    #[cfg(test)]
    gemm_entry!(
        /// [`int_fine_gemm_avxvnni`]'s loops with an emulated `vpdpbusd`, on any AVX2 CPU
        /// (tests).
        ///
        /// # Safety
        /// The [`super::IntFusedFn`] contract; AVX2, FMA and F16C available.
        int_fine_gemm_avxvnni_emulated, gemm256_vnni_emulated, true,
        "the emulated kgroup avx-vnni fine gemm kernel", 1 2 3
    );

    type Args<'a> = (
        &'a [*const u8],
        usize,
        (usize, usize),
        usize,
        usize,
        *const u8,
        *const u8,
        &'a WeightBytes,
        *mut f32,
    );

    /// # Safety
    /// As [`int_fused_avx512vnni`] with exactly R rows.
    unsafe fn call512<const R: usize, const LUT: bool, const ST: u8>(a: Args) {
        // SAFETY: forwarded.
        unsafe { rows512::<R, LUT, ST>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8) }
    }

    /// `rows256` with AVX-VNNI's multiply, enabling its features.
    ///
    /// # Safety
    /// The few-row [`super::IntFusedFn`] contract with exactly R rows; AVX2, FMA, F16C and
    /// AVX-VNNI available.
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn call256_vnni<const R: usize, const LUT: bool, const ST: u8>(a: Args) {
        // SAFETY: forwarded; the features are enabled here.
        unsafe { rows256::<R, LUT, ST, Vnni256>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8) }
    }

    /// `rows256` with the emulated AVX-VNNI multiply (tests).
    ///
    /// # Safety
    /// The few-row [`super::IntFusedFn`] contract with exactly R rows; AVX2, FMA and F16C
    /// available.
    #[cfg(test)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn call256_vnni_emulated<const R: usize, const LUT: bool, const ST: u8>(a: Args) {
        // SAFETY: forwarded; the features are enabled here.
        unsafe {
            rows256::<R, LUT, ST, EmulatedVnni256>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8)
        }
    }

    /// AVX2 integer kernel without VNNI, 1 or 2 rows: [`folded256`].
    ///
    /// # Safety
    /// The [`super::IntFusedFn`] contract with at most 2 rows; AVX2, FMA and F16C available.
    #[allow(clippy::too_many_arguments)] // the IntFusedFn signature
    pub unsafe fn int_fused_avx2(
        rows: &[*const u8],
        k: usize,
        range: (usize, usize),
        chunk: usize,
        group: usize,
        codes: *const u8,
        scales: *const u8,
        w: &WeightBytes,
        out: *mut f32,
    ) {
        let a = (rows, k, range, chunk, group, codes, scales, w, out);
        // One row keeps its byte-pair sums in i16 lanes for a whole chunk where they fit;
        // with two, the eight i16 running sums per row would not fit the registers.
        let narrow = rows.len() == 1 && w.narrow_sums_fit(chunk);
        // SAFETY: forwarded with exactly R rows; the narrow sums fit where chosen; ST is the
        // weights' scale type.
        unsafe {
            with_scale_type!(w.scale_type, ST => match (rows.len(), w.identity, narrow) {
                (1, true, true) => folded256::<1, false, true, ST>(a),
                (1, true, false) => folded256::<1, false, false, ST>(a),
                (1, false, true) => folded256::<1, true, true, ST>(a),
                (1, false, false) => folded256::<1, true, false, ST>(a),
                (2, true, _) => folded256::<2, false, false, ST>(a),
                (2, false, _) => folded256::<2, true, false, ST>(a),
                (n, _, _) => panic!("the kgroup int avx2 kernel takes 1 or 2 rows, got {n}"),
            })
        }
    }

    /// The few-row kernel on 256-bit vectors with `vpmaddubsw` pairs, each quarter's two
    /// byte-pair sums folded into the 15-bit sum of the many-row kernels,
    /// `S = 254·(A − bias·X) + (B − bias·R)`: `vpmaddwd` widens `A` by 254 and `B` by 1 into one
    /// i32 accumulator, four per row where separate `A` and `B` took eight and spilled (16
    /// registers). With `NARROW` the pairs run in i16 lanes through the chunk and are widened
    /// once. Bit-identical to [`super::int_fine_gemm_scalar`]. On an AMD Zen 3, from cache
    /// (`KERNEL=fused cargo run --release -p kt-benches --example kgroup_cycles`, alternating
    /// with the separate sums): one row MXFP4 6.7 against 7.7 ns per block; two rows 12-25%
    /// faster for every method.
    ///
    /// # Safety
    /// The [`super::IntFusedFn`] contract with exactly R rows; with `NARROW`,
    /// [`WeightBytes::narrow_sums_fit`] holds for `chunk`; AVX2, FMA and F16C available.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)]
    unsafe fn folded256<const R: usize, const LUT: bool, const NARROW: bool, const ST: u8>(
        a: Args,
    ) {
        let (rows, k, (i0, n), chunk, group, codes, scales, w, out) = a;
        let st = scale_type_of(ST);
        debug_assert_eq!(st, w.scale_type);
        // SAFETY: the contract: every block, activation word, chunk record and scale read
        // below is inside the caller's buffers.
        unsafe {
            let table = _mm_loadu_si128(w.lut.as_ptr() as *const __m128i);
            let lut = _mm256_set_m128i(table, table);
            let nib = _mm256_set1_epi32(0x0F0F_0F0F);
            let (by254, by1) = (_mm256_set1_epi16(254), _mm256_set1_epi16(1));
            let fold = |a16, b16| {
                _mm256_add_epi32(_mm256_madd_epi16(a16, by254), _mm256_madd_epi16(b16, by1))
            };
            let dist =
                crate::kernels::prefetch::distance_of(crate::kernels::prefetch::Family::CodeGroups);
            let mut total = [[_mm256_setzero_ps(); 4]; R];
            for (c, g) in chunks_with_groups((i0, n), chunk, group) {
                // S per quarter (i32), or with NARROW the pair sums A and B (i16).
                let mut acc = [[_mm256_setzero_si256(); 4]; R];
                let mut pairs = [[[_mm256_setzero_si256(); 2]; 4]; R];
                for blk in c * chunk / 8..(c + 1) * chunk / 8 {
                    for o in 0..4 {
                        let (we, wo) = quarter_bytes::<LUT>(codes, blk, o, dist, lut, nib);
                        for r in 0..R {
                            let x = rows[r].add(8 * blk) as *const i32;
                            let rr = rows[r].add(k + 8 * blk) as *const i32;
                            let a16 = _mm256_add_epi16(
                                _mm256_maddubs_epi16(we, word(x)),
                                _mm256_maddubs_epi16(wo, word(x.add(1))),
                            );
                            let b16 = _mm256_add_epi16(
                                _mm256_maddubs_epi16(we, word(rr)),
                                _mm256_maddubs_epi16(wo, word(rr.add(1))),
                            );
                            if NARROW {
                                let p = &mut pairs[r][o];
                                p[0] = _mm256_add_epi16(p[0], a16);
                                p[1] = _mm256_add_epi16(p[1], b16);
                            } else {
                                acc[r][o] = _mm256_add_epi32(acc[r][o], fold(a16, b16));
                            }
                        }
                    }
                }
                for r in 0..R {
                    let rec = chunk_record(rows[r], k, c);
                    let bias = _mm256_set1_epi32(254 * rec.neg_bias_x + rec.neg_bias_r);
                    let sx = _mm256_set1_ps(rec.s_inv_m254);
                    for o in 0..4 {
                        if NARROW {
                            acc[r][o] = fold(pairs[r][o][0], pairs[r][o][1]);
                        }
                        let f = _mm256_cvtepi32_ps(_mm256_add_epi32(acc[r][o], bias));
                        let at = scales.add((g * 32 + 8 * o) * st.size());
                        let sw = _mm256_mul_ps(scales8(at, st), sx);
                        total[r][o] = _mm256_fmadd_ps(f, sw, total[r][o]);
                    }
                }
            }
            for r in 0..R {
                for o in 0..4 {
                    let p = out.add(r * 32 + 8 * o);
                    _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), total[r][o]));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prepared_rows_equal_their_scalar_twin() {
        let mut rng = crate::rng::Rng::new(5);
        for chunk in [8, 16, 32] {
            for trial in 0..40 {
                // Up to 9 chunks, and for every fourth trial 16 more (the AVX-512 kernel takes
                // the chunks' scales 16 chunks at a time).
                let k = chunk * (1 + trial % 9 + 16 * (trial % 4 == 0) as usize);
                let mut x = rng.normals(k, [1e-3, 1.0, 300.0][trial % 3]);
                // Zero, NaN-holding and infinite chunks, and ties of the rounding.
                match trial % 5 {
                    1 => x[..chunk].fill(0.0),
                    2 => x[chunk / 2] = f32::NAN,
                    3 => x[k - 1] = f32::NEG_INFINITY,
                    4 => x.iter_mut().for_each(|v| *v = (*v * 4.0).round() / 4.0),
                    _ => {}
                }
                // Both weight kinds' records (bias 8 and 1/m = 1; bias 12 and 1/m = 1/2).
                let kind = [CodeKind::Int4, CodeKind::E2M1][trial % 2];
                let w = WeightBytes::of(kind, ScaleType::Bf16);
                let mut want = vec![0u8; row_bytes(k, chunk)];
                prepare_row_scalar(&x, chunk, &w, true, &mut want);
                let mut got = vec![0xAAu8; row_bytes(k, chunk)];
                prepare_row(&x, chunk, &w, &mut got);
                assert_eq!(got, want, "chunk {chunk}, trial {trial}");
                // Without the x16 inputs: the rest the same, the x16 bytes untouched.
                let wide = wide_at(k, chunk);
                let mut narrow_want = want.clone();
                narrow_want[wide..].fill(0x33);
                let mut narrow = vec![0x33u8; row_bytes(k, chunk)];
                prepare_row_scalar(&x, chunk, &w, false, &mut narrow);
                assert_eq!(
                    narrow, narrow_want,
                    "scalar narrow, chunk {chunk}, trial {trial}"
                );
                narrow.fill(0x33);
                prepare_row_parts(&x, chunk, &w, false, &mut narrow);
                assert_eq!(narrow, narrow_want, "narrow, chunk {chunk}, trial {trial}");
                #[cfg(target_arch = "x86_64")]
                for wide in [true, false] {
                    let mut want = if wide {
                        want.clone()
                    } else {
                        narrow_want.clone()
                    };
                    if !wide {
                        want[super::wide_at(k, chunk)..].fill(0x55);
                    }
                    if crate::isa::allows(Level::Avx2) {
                        got.fill(0x55);
                        // SAFETY: AVX2 allowed; lengths as prepare_row checks.
                        unsafe { x86::prepare_row_avx2(&x, chunk, &w, wide, &mut got) };
                        assert_eq!(got, want, "avx2 {wide}, chunk {chunk}, trial {trial}");
                    }
                    if chunk % 16 == 0 && crate::isa::allows(Level::Avx512Base) {
                        got.fill(0x55);
                        // SAFETY: AVX-512 allowed; chunk a multiple of 16; lengths as
                        // prepare_row checks.
                        unsafe { x86::prepare_row_avx512(&x, chunk, &w, wide, &mut got) };
                        assert_eq!(got, want, "avx512 {wide}, chunk {chunk}, trial {trial}");
                    }
                }
            }
        }
    }

    #[test]
    fn prepared_rows_hold_each_input_to_15_bits() {
        let mut rng = crate::rng::Rng::new(21);
        let x = rng.normals(256, 1.0);
        for chunk in [16, 32] {
            let mut row = vec![0u8; row_bytes(256, chunk)];
            let int4 = WeightBytes::of(CodeKind::Int4, ScaleType::Bf16);
            prepare_row(&x, chunk, &int4, &mut row);
            for (i, &v) in x.iter().enumerate() {
                // SAFETY: chunk i/chunk of a 256-input row; int4's 1/m is 1.
                let s = unsafe { chunk_record(row.as_ptr(), 256, i / chunk) }.s_inv_m;
                let (x8, r8) = (row[slot(i)] as i8 as i32, row[256 + slot(i)] as i8 as i32);
                let back = s * (x8 as f32 + r8 as f32 / 254.0);
                assert!((back - v).abs() <= s / 508.0 + 1e-7, "{i}: {v} vs {back}");
                // The same input once as an i16.
                let at = wide_at(256, chunk) + 2 * wide_slot(i);
                let x16 = i16::from_le_bytes([row[at], row[at + 1]]) as i32;
                assert_eq!(x16, 254 * x8 + r8, "{i}");
            }
        }
    }

    /// `n` random valid stored scales of `st` (little-endian bytes), values around 0.01.
    fn native_scales(st: ScaleType, n: usize, rng: &mut crate::rng::Rng) -> Vec<u8> {
        let mut out = Vec::with_capacity(n * st.size());
        for i in 0..n {
            let v = rng.normal().exp() * 0.01;
            let bits = match (st, i % 17) {
                (ScaleType::E8M0, 0) => 0,    // 2⁻¹²⁷
                (ScaleType::E4M3, 0) => 0x03, // a subnormal
                _ => st.encode_at_least(v),
            };
            out.extend_from_slice(&bits.to_le_bytes()[..st.size()]);
        }
        out
    }

    type KernelWith = fn(Level, bool) -> Option<(IntFusedFn, usize)>;
    /// A family's scalar twin for a variant (level, AVX-VNNI).
    type TwinOf = fn(Level, bool) -> IntFusedFn;

    /// The integer kernels' variants that this CPU (and the variant cap) allows, as (level,
    /// AVX-VNNI): the AVX2 level with both multiplies, AVX-VNNI's emulated where the CPU lacks
    /// it ([`runnable`]).
    fn allowed_variants() -> Vec<(Level, bool)> {
        [
            (Level::Avx2, false),
            (Level::Avx2, true),
            (Level::Avx512Vnni, false),
        ]
        .into_iter()
        .filter(|&(l, _)| crate::isa::allows(l))
        .collect()
    }

    /// `kernel_with(level, vnni)` as this CPU runs it: where it lacks AVX-VNNI, an AVX-VNNI
    /// kernel's loops with the emulated `vpdpbusd` (the one thing they do not test is the
    /// instruction, which `the_emulated_vpdpbusd_is_the_instruction` checks where it runs).
    fn runnable(kernel_with: KernelWith, level: Level, vnni: bool) -> Option<(IntFusedFn, usize)> {
        let (kernel, rows) = kernel_with(level, vnni)?;
        #[cfg(target_arch = "x86_64")]
        if vnni && level < Level::Avx512Vnni && !avx_vnni() {
            let emulated: [(IntFusedFn, IntFusedFn); 3] = [
                (x86::int_fused_avxvnni, x86::int_fused_avxvnni_emulated),
                (x86::int_gemm_avxvnni, x86::int_gemm_avxvnni_emulated),
                (
                    x86::int_fine_gemm_avxvnni,
                    x86::int_fine_gemm_avxvnni_emulated,
                ),
            ];
            let (_, stand_in) = emulated
                .into_iter()
                .find(|&(real, _)| real as usize == kernel as usize)
                .expect("every AVX-VNNI kernel has an emulated stand-in");
            return Some((stand_in, rows));
        }
        Some((kernel, rows))
    }

    /// The twin of the few-row kernel at `(level, vnni)`: the AVX2 one without VNNI folds its
    /// byte-pair sums into the many-row kernels' `S` (`x86::folded256`).
    fn fused_twin(level: Level, vnni: bool) -> IntFusedFn {
        if level < Level::Avx512Vnni && !vnni {
            int_fine_gemm_scalar
        } else {
            int_fused_scalar
        }
    }

    #[test]
    fn int_kernels_equal_their_scalar_twin() {
        check_kernels_against_twin(int_fused_with, fused_twin);
    }

    #[test]
    fn fewer_rows_stay_on_the_few_row_kernel_only_where_the_i16_kernel_runs() {
        for level in crate::isa::LEVELS {
            #[cfg(target_arch = "x86_64")]
            let wide = int_fine_gemm_for(level)
                .is_some_and(|(f, _)| f as usize == x86::int_fine_gemm_avx2 as IntFusedFn as usize);
            #[cfg(not(target_arch = "x86_64"))]
            let wide = false;
            assert_eq!(fine_few_rows(level), if wide { 2 } else { 4 }, "{level:?}");
            assert_eq!(
                int_fine_gemm_reusing_for(level).is_some(),
                wide,
                "{level:?}"
            );
        }
    }

    /// The reusing AVX2 kernel equals the twin on its first call under a key, and later calls
    /// under the same key and rows use what it packed then (the rows' bytes changed under the
    /// key give the old sums: the key's promise is the caller's); a new key packs again.
    #[test]
    fn the_reusing_kernel_keeps_its_packing_under_a_key() {
        #[cfg(target_arch = "x86_64")]
        if crate::isa::allows(Level::Avx2) {
            let mut rng = crate::rng::Rng::new(77);
            let k = 256;
            let codes: Vec<u8> = (0..16 * k).map(|_| rng.below(256) as u8).collect();
            for (kind, st, chunk, group) in [
                (CodeKind::E2M1, ScaleType::E8M0, 32, 32),
                (CodeKind::E2M1, ScaleType::E4M3, 16, 16),
                (CodeKind::Int4, ScaleType::F16, 32, 128),
            ] {
                let w = WeightBytes::of(kind, st);
                let scales = native_scales(st, (k / group) * 32, &mut rng);
                for rows in [16, 19, 23, 24, 30, 32] {
                    let mut data: Vec<Vec<u8>> = (0..rows)
                        .map(|_| {
                            let mut row = vec![0u8; row_bytes(k, chunk)];
                            prepare_row(&rng.normals(k, 1.0), chunk, &w, &mut row);
                            row
                        })
                        .collect();
                    let run = |data: &[Vec<u8>], key: Option<u64>, range: (usize, usize)| {
                        let ptrs: Vec<*const u8> = data.iter().map(|r| r.as_ptr()).collect();
                        let mut out = vec![0.5f32; 32 * rows];
                        let (c, sc, o) = (codes.as_ptr(), scales.as_ptr(), out.as_mut_ptr());
                        // SAFETY: prepared rows of k inputs, 16·k code bytes, the scales of
                        // k/group groups, 32 outputs per row; AVX2 allowed (checked above).
                        unsafe {
                            match key {
                                Some(key) => x86::int_fine_gemm_avx2_reusing(
                                    key, &ptrs, k, range, chunk, group, c, sc, &w, o,
                                ),
                                None => int_fine_gemm_scalar(
                                    &ptrs, k, range, chunk, group, c, sc, &w, o,
                                ),
                            }
                        }
                        out
                    };
                    let key = crate::formats::next_reuse_key();
                    let first = run(&data, Some(key), (0, k));
                    assert_eq!(
                        first,
                        run(&data, None, (0, k)),
                        "{kind:?} {st:?} rows {rows}"
                    );
                    let part = (group, k - group);
                    assert_eq!(run(&data, Some(key), part), run(&data, None, part));
                    // New activations behind the same addresses.
                    for row in &mut data {
                        prepare_row(&rng.normals(k, 1.0), chunk, &w, row);
                    }
                    let fresh = run(&data, None, (0, k));
                    assert_ne!(fresh, first);
                    let lanes = 32 * lane_rows(rows);
                    let kept = run(&data, Some(key), (0, k));
                    assert_eq!(kept[..lanes], first[..lanes], "same key: the old packing");
                    assert_eq!(
                        kept[lanes..],
                        fresh[lanes..],
                        "rows outside the lanes: read"
                    );
                    let new_key = crate::formats::next_reuse_key();
                    assert_eq!(run(&data, Some(new_key), (0, k)), fresh);
                }
            }
        }
    }

    #[test]
    fn the_avx2_level_takes_avx_vnni_where_the_cpu_has_it() {
        #[cfg(target_arch = "x86_64")]
        if crate::isa::allows(Level::Avx2) && !crate::isa::allows(Level::Avx512Vnni) {
            let want = if avx_vnni() {
                x86::int_fused_avxvnni as IntFusedFn
            } else {
                x86::int_fused_avx2 as IntFusedFn
            };
            assert_eq!(
                int_fused_for(Level::Avx2).unwrap().0 as usize,
                want as usize
            );
        }
        // The AVX-VNNI kernels' loops are tested on every AVX2 CPU, emulated where needed.
        assert_eq!(
            allowed_variants().contains(&(Level::Avx2, true)),
            crate::isa::allows(Level::Avx2)
        );
    }

    /// The largest integer sums the kernels can meet: every code at the largest byte (int4
    /// nibble 15, E2M1 code 7 = byte 24) against activations that cut to ±126 with remainder
    /// ±127 (or ±127 exactly), in chunks of 32: no 16-bit `vpmaddubsw` sum may saturate.
    #[test]
    fn narrow_sums_fit_where_the_bound_allows() {
        let int4 = WeightBytes::of(CodeKind::Int4, ScaleType::Bf16);
        let e2m1 = WeightBytes::of(CodeKind::E2M1, ScaleType::E8M0);
        assert!(int4.narrow_sums_fit(32) && int4.narrow_sums_fit(16));
        assert!(e2m1.narrow_sums_fit(16) && !e2m1.narrow_sums_fit(32));
    }

    #[test]
    fn extreme_sums_equal_the_scalar_twin() {
        let k = 256;
        let mut x = vec![0f32; k];
        for (i, v) in x.iter_mut().enumerate() {
            let sign = if (64..128).contains(&i) { -1.0 } else { 1.0 };
            *v = sign * if i % 16 == 0 { 127.0 } else { 126.5 };
        }
        let variants = allowed_variants();
        // The few-row kernels and both many-row ones (whose sums run in i16 lanes on AVX2
        // without VNNI where `narrow_sums_fit`: these are the largest they meet, at both
        // chunk sizes).
        let families: [(KernelWith, TwinOf); 3] = [
            (int_fused_with, fused_twin),
            (int_gemm_with, |_, _| int_gemm_scalar),
            (int_fine_gemm_with, |_, _| int_fine_gemm_scalar),
        ];
        for (chunk, (kind, byte), (kernel_with, twin_of)) in
            [32, 16].into_iter().flat_map(|chunk| {
                [(CodeKind::Int4, 0xFFu8), (CodeKind::E2M1, 0x77)]
                    .into_iter()
                    .flat_map(move |c| families.map(|f| (chunk, c, f)))
            })
        {
            let w = WeightBytes::of(kind, ScaleType::Bf16);
            let mut row = vec![0u8; row_bytes(k, chunk)];
            prepare_row(&x, chunk, &w, &mut row);
            let codes = vec![byte; 16 * k];
            let scales: Vec<u8> = (0..(k / chunk) * 32).flat_map(|_| [0x80u8, 0x3F]).collect();
            for &(level, vnni) in &variants {
                let Some((kernel, max_rows)) = runnable(kernel_with, level, vnni) else {
                    continue;
                };
                let twin = twin_of(level, vnni);
                let ptrs = vec![row.as_ptr(); max_rows];
                let (mut want, mut got) = (vec![0f32; 32 * max_rows], vec![0f32; 32 * max_rows]);
                for (f, out) in [(twin, &mut want), (kernel, &mut got)] {
                    let (c, sc) = (codes.as_ptr(), scales.as_ptr());
                    // SAFETY: max_rows prepared rows of k inputs, 16·k code bytes, the scales
                    // of k/chunk groups, 32 outputs per row; the level is allowed.
                    unsafe { f(&ptrs, k, (0, k), chunk, chunk, c, sc, &w, out.as_mut_ptr()) };
                }
                assert_eq!(
                    got, want,
                    "{kind:?}, chunk {chunk} at {level:?}, avx-vnni {vnni}"
                );
                assert!(want.iter().all(|v| v.abs() > 1e3), "{want:?}");
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn const_scale_types_name_the_weights_scale_type() {
        for st in [
            ScaleType::Bf16,
            ScaleType::F16,
            ScaleType::E8M0,
            ScaleType::E4M3,
        ] {
            assert_eq!(x86::scale_type_round_trip(st), st);
        }
    }

    #[test]
    fn int_gemm_kernels_equal_their_scalar_twin() {
        check_kernels_against_twin(int_gemm_with, |_, _| int_gemm_scalar);
        check_kernels_against_twin(int_fine_gemm_with, |_, _| int_fine_gemm_scalar);
    }

    fn check_kernels_against_twin(kernel_with: KernelWith, twin_of: TwinOf) {
        let variants = allowed_variants();
        #[cfg(target_arch = "x86_64")]
        for level in [Level::Avx2, Level::Avx512Vnni] {
            if crate::isa::allows(level) {
                assert!(variants.iter().any(|&(l, _)| l == level));
                assert!(kernel_with(level, false).is_some() && kernel_with(level, true).is_some());
            }
        }
        let mut rng = crate::rng::Rng::new(31);
        let k = 512;
        let codes: Vec<u8> = (0..16 * k).map(|_| rng.below(256) as u8).collect();
        for (kind, st) in [
            (CodeKind::Int4, ScaleType::Bf16),
            (CodeKind::Int4, ScaleType::F16),
            (CodeKind::E2M1, ScaleType::E8M0),
            (CodeKind::E2M1, ScaleType::E4M3),
        ] {
            let w = WeightBytes::of(kind, st);
            for (chunk, group, range) in [
                (32, 32, (0, 512)),
                (16, 16, (64, 256)),
                (32, 128, (128, 384)),
            ] {
                let scales = native_scales(st, (range.1 / group + 1) * 32, &mut rng);
                for &(level, vnni) in &variants {
                    let (kernel, max_rows) = runnable(kernel_with, level, vnni).unwrap();
                    let twin = twin_of(level, vnni);
                    for rows in 1..=max_rows {
                        let data: Vec<Vec<u8>> = (0..rows)
                            .map(|_| {
                                let mut row = vec![0u8; row_bytes(k, chunk)];
                                prepare_row(&rng.normals(k, 1.0), chunk, &w, &mut row);
                                row
                            })
                            .collect();
                        let ptrs: Vec<*const u8> = data.iter().map(|r| r.as_ptr()).collect();
                        let start = rng.normals(32 * rows, 1.0);
                        let (mut want, mut got) = (start.clone(), start.clone());
                        // SAFETY: buffers sized as the contract asks; the level is allowed.
                        unsafe {
                            twin(
                                &ptrs,
                                k,
                                range,
                                chunk,
                                group,
                                codes.as_ptr(),
                                scales.as_ptr(),
                                &w,
                                want.as_mut_ptr(),
                            );
                            kernel(
                                &ptrs,
                                k,
                                range,
                                chunk,
                                group,
                                codes.as_ptr(),
                                scales.as_ptr(),
                                &w,
                                got.as_mut_ptr(),
                            );
                        }
                        assert_eq!(
                            got, want,
                            "{kind:?} {st:?} {level:?} avx-vnni {vnni} rows={rows} chunk={chunk}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_twins_compute_the_dot_product() {
        // Each twin against fp64 on the decoded values: only the activations' rounding differs
        // (15 bits for the few-row kernels, 8 for the many-row ones).
        // Tolerances relative to Σ|6·scale·x|: 15-bit rounding, and 8-bit rounding at about
        // half its worst case (all 256 errors aligned).
        for (twin, tolerance) in [
            (int_fused_scalar as IntFusedFn, 1e-4),
            (int_fine_gemm_scalar as IntFusedFn, 1e-4),
            (int_gemm_scalar as IntFusedFn, 8e-3),
        ] {
            check_twin_against_fp64(twin, tolerance);
        }
    }

    fn check_twin_against_fp64(twin: IntFusedFn, tolerance: f64) {
        // The twin against fp64 on the decoded values: only the 15-bit activations differ.
        let mut rng = crate::rng::Rng::new(8);
        let k = 256;
        let codes: Vec<u8> = (0..16 * k).map(|_| rng.below(256) as u8).collect();
        let x = rng.normals(k, 1.0);
        // bf16 scales, exact in f32 (the reference reads the same values).
        let scales: Vec<f32> = (0..(k / 32) * 32)
            .map(|_| half::bf16::from_f32(rng.normal().exp() * 0.01).to_f32())
            .collect();
        let stored: Vec<u8> = scales
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        for kind in [CodeKind::Int4, CodeKind::E2M1] {
            let w = WeightBytes::of(kind, ScaleType::Bf16);
            let mut row = vec![0u8; row_bytes(k, 32)];
            prepare_row(&x, 32, &w, &mut row);
            let mut out = vec![0f32; 32];
            // SAFETY: buffers sized as the contract asks.
            unsafe {
                twin(
                    &[row.as_ptr()],
                    k,
                    (0, k),
                    32,
                    32,
                    codes.as_ptr(),
                    stored.as_ptr(),
                    &w,
                    out.as_mut_ptr(),
                )
            };
            let table = kind.nibble_table().unwrap();
            for j in 0..32 {
                let mut want = 0f64;
                for i in 0..k {
                    let b = codes[nibble_byte(i / 2, j)];
                    let v = table[((b >> (4 * (i % 2))) & 0xF) as usize] as f64;
                    want += v * scales[(i / 32) * 32 + j] as f64 * x[i] as f64;
                }
                let scale: f64 = (0..k)
                    .map(|i| (scales[(i / 32) * 32 + j] * x[i]).abs() as f64 * 6.0)
                    .sum();
                assert!(
                    (out[j] as f64 - want).abs() <= tolerance * scale,
                    "{kind:?} {j}: {} vs {want}",
                    out[j]
                );
            }
        }
    }
}
