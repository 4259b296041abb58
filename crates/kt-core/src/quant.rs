//! Quantization of expert weights to the original kt-kernel's AMXINT8 / AMXINT4 formats, and
//! the byte order of its converted files.
//!
//! Rules (reproducing the original 0.7.2 bit for bit, see `shared/fixtures/README.md` §2.3):
//! - INT8: per output row `d = amax × fp32(1/127)`; `q = sat_i8(round_half_even(w × fp32(1/d)))`.
//! - INT4: per output row `d = amax / 112` (in f64, stored f32); the INT8 rule with that `d`, then
//!   `v = q / 16` rounded half away from zero, `v ∈ [−7, 7]`; the weight is `v × 16 × d`.
//! - Byte order: rows in groups of 32; the input axis in steps of 64 (INT8) or 128 (INT4) gives one
//!   2048-byte tile; tiles follow row-group-major. Inside a tile each row owns 64 bytes (INT4: byte
//!   j = column j in the low nibble, column 64+j in the high nibble) and each 16-row half is a 16×16
//!   matrix of 4-byte words stored transposed — i.e. every 64-byte line holds 16 rows × 4
//!   consecutive inputs, exactly the operand shape of `vpdpbusd` and of AMX int8 tiles.
//!
//! That byte order is also this crate's in-memory layout, with one difference for wide matrices:
//! the original's files block columns by [`FILE_K_BLOCK`] (3584) and rows by [`file_n_block`]
//! (64 for INT8, 128 for INT4), so beyond 3584 inputs a 32-row group's tiles are no longer
//! contiguous in a file. In memory they always are (the kernels stream one group as one run);
//! [`file_runs`] maps between the two, a handful of large copies per matrix.

use crate::pack::MatrixView;
use crate::{kt_bail, kt_ensure, Result};

/// Rows of one group: the kernels' and the tiles' output block (the original's N_STEP).
pub const GROUP_ROWS: usize = 32;

/// The original's column block (K_BLOCK) in its converted files.
pub const FILE_K_BLOCK: usize = 3584;

/// The original's row block (N_BLOCK) in its converted files: 64 for INT8, 128 for INT4.
pub fn file_n_block(int4: bool) -> usize {
    if int4 {
        128
    } else {
        64
    }
}

/// Inputs per tile: 64 for INT8, 128 for INT4 (two nibbles per byte).
pub fn k_step(int4: bool) -> usize {
    if int4 {
        128
    } else {
        64
    }
}

/// Bytes of a quantized `n × k` matrix.
pub fn matrix_bytes(int4: bool, n: usize, k: usize) -> usize {
    if int4 {
        n * k / 2
    } else {
        n * k
    }
}

/// Quantize one row to INT8; returns the fp32 scale.
#[inline(always)]
pub fn quantize_row_int8(row: &[f32], q: &mut [i8]) -> f32 {
    let amax = abs_max(row);
    let d = amax * (1.0f32 / 127.0);
    fill_q8(row, d, q);
    d
}

/// Quantize one row to INT4 values in [−7, 7] (one per i8); returns the fp32 scale `d`
/// (weights are `v × 16 × d`).
#[inline(always)]
pub fn quantize_row_int4(row: &[f32], v: &mut [i8]) -> f32 {
    let amax = abs_max(row);
    let d = (amax as f64 / 112.0) as f32;
    fill_q8(row, d, v);
    for x in v.iter_mut() {
        // Round |q8| / 16 half away from zero, keep the sign.
        let m = ((x.unsigned_abs() as i32 + 8) / 16).min(7) as i8;
        *x = if *x < 0 { -m } else { m };
    }
    d
}

#[inline(always)]
fn fill_q8(row: &[f32], d: f32, q: &mut [i8]) {
    if d == 0.0 {
        q.fill(0);
        return;
    }
    let inv = 1.0f32 / d;
    for (o, &w) in q.iter_mut().zip(row) {
        *o = round_to_i8(w * inv);
    }
}

/// Byte offset of element (row `r`, column `c`) of an INT8 matrix with `k` columns.
pub fn amx_int8_offset(r: usize, c: usize, k: usize) -> usize {
    let (n0, rr) = (r / 32 * 32, r % 32);
    let (k0, cc) = (c / 64 * 64, c % 64);
    let (half, row16) = (rr / 16, rr % 16);
    n0 * k + k0 * 32 + half * 1024 + (cc / 4) * 64 + row16 * 4 + cc % 4
}

fn check_shape(n: usize, k: usize, kstep: usize) -> Result<()> {
    kt_ensure!(
        n.is_multiple_of(GROUP_ROWS) && k > 0 && k.is_multiple_of(kstep),
        Invalid,
        "AMX layout of a {n}x{k} matrix: rows must be a multiple of {GROUP_ROWS} and columns a \
         positive multiple of {kstep}"
    );
    Ok(())
}

/// The runs that the in-memory layout and the original's file layout share, as (memory offset,
/// file offset, length) in bytes; together they cover the matrix once. In a file, rows come in
/// blocks of [`file_n_block`] and columns in blocks of [`FILE_K_BLOCK`] (the last ones may be
/// short); inside a (row block, column block) each 32-row group's tiles are contiguous, as they
/// are across the whole width in memory. With `k ≤ 3584` there is one run.
pub fn file_runs(int4: bool, n: usize, k: usize) -> Result<Vec<(usize, usize, usize)>> {
    check_shape(n, k, k_step(int4))?;
    if k <= FILE_K_BLOCK {
        return Ok(vec![(0, 0, matrix_bytes(int4, n, k))]);
    }
    let mut runs = Vec::new();
    for nb0 in (0..n).step_by(file_n_block(int4)) {
        let nbs = file_n_block(int4).min(n - nb0);
        for kb0 in (0..k).step_by(FILE_K_BLOCK) {
            let kbs = FILE_K_BLOCK.min(k - kb0);
            for rg in (0..nbs).step_by(GROUP_ROWS) {
                // In values; INT4 halves every term (all are even).
                let file = nb0 * k + kb0 * nbs + rg * kbs;
                let mem = (nb0 + rg) * k + kb0 * GROUP_ROWS;
                let len = kbs * GROUP_ROWS;
                runs.push((
                    matrix_bytes(int4, mem, 1),
                    matrix_bytes(int4, file, 1),
                    matrix_bytes(int4, len, 1),
                ));
            }
        }
    }
    Ok(runs)
}

/// Copy a matrix from the in-memory layout to the original's file layout.
pub fn to_file_layout(int4: bool, n: usize, k: usize, mem: &[u8], file: &mut [u8]) -> Result<()> {
    relayout(int4, n, k, mem, file, false)
}

/// Copy a matrix from the original's file layout to the in-memory layout.
pub fn from_file_layout(int4: bool, n: usize, k: usize, file: &[u8], mem: &mut [u8]) -> Result<()> {
    relayout(int4, n, k, file, mem, true)
}

fn relayout(
    int4: bool,
    n: usize,
    k: usize,
    src: &[u8],
    dst: &mut [u8],
    from_file: bool,
) -> Result<()> {
    let bytes = matrix_bytes(int4, n, k);
    kt_ensure!(
        src.len() == bytes && dst.len() == bytes,
        Invalid,
        "a {n}x{k} {} matrix has {bytes} bytes; got {} and {}",
        if int4 { "INT4" } else { "INT8" },
        src.len(),
        dst.len()
    );
    for (m, f, len) in file_runs(int4, n, k)? {
        let (s, d) = if from_file { (f, m) } else { (m, f) };
        dst[d..d + len].copy_from_slice(&src[s..s + len]);
    }
    Ok(())
}

/// Quantize `view` (rows = outputs, `n × k`) to INT8 or INT4 in the in-memory tiled layout:
/// `out` gets the matrix bytes, `scales` one fp32 per row, `sums` (if given) each row's sum of
/// the int8 operands the kernels multiply (`16·v` for INT4).
///
/// Each weight is first rounded to bf16: the original converter quantizes bf16 tensors (it
/// casts fp16 and block-FP8 inputs to bf16), so every input precision gives its bytes.
///
/// # Safety
/// `view`'s memory is alive.
pub unsafe fn quantize_matrix(
    view: &MatrixView,
    int4: bool,
    out: &mut [u8],
    scales: &mut [f32],
    mut sums: Option<&mut [i32]>,
) -> Result<()> {
    let (n, k) = (view.rows, view.cols);
    check_shape(n, k, k_step(int4))?;
    kt_ensure!(
        out.len() == matrix_bytes(int4, n, k)
            && scales.len() == n
            && sums.as_ref().is_none_or(|s| s.len() == n),
        Invalid,
        "quantize_matrix: buffers do not fit a {n}x{k} matrix"
    );
    let mut row = vec![0f32; k];
    let mut q = vec![0i8; GROUP_ROWS * k];
    for g in 0..n / GROUP_ROWS {
        let rows = g * GROUP_ROWS..(g + 1) * GROUP_ROWS;
        let group_sums = sums.as_deref_mut().map(|s| &mut s[rows.clone()]);
        // SAFETY: rows of the view (contract); buffers sized above.
        let bad = unsafe {
            quantize_group(
                view,
                rows.start,
                int4,
                &mut row,
                &mut q,
                &mut scales[rows],
                group_sums,
            )
        };
        if let Some(r) = bad {
            kt_bail!(
                Invalid,
                "weight row {r} of a {n}x{k} matrix holds a non-finite value (NaN or Inf), \
                 which {} cannot quantize",
                if int4 { "AMXINT4" } else { "AMXINT8" }
            );
        }
        let group = &mut out[matrix_bytes(int4, g * GROUP_ROWS * k, 1)..]
            [..matrix_bytes(int4, GROUP_ROWS * k, 1)];
        scatter_group(&q, k, int4, group);
    }
    Ok(())
}

/// Quantize the 32 rows from `r0` into `q` (row-major), with AVX2 where the CPU has it: the
/// same code compiled twice, so both give identical bytes (the AVX2 copy is vectorised).
///
/// # Safety
/// Rows `r0..r0+32` of `view` exist and its memory is alive; `row` holds `k` values, `q`
/// `32·k`, `scales` 32, `sums` 32. Returns the first row holding a non-finite value, if any
/// (the group's outputs are then incomplete).
unsafe fn quantize_group(
    view: &MatrixView,
    r0: usize,
    int4: bool,
    row: &mut [f32],
    q: &mut [i8],
    scales: &mut [f32],
    sums: Option<&mut [i32]>,
) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::allows(crate::isa::Level::Avx2) {
        // SAFETY: the process's ISA level includes AVX2 and FMA; the rest is the caller's
        // contract.
        return unsafe { quantize_group_avx2(view, r0, int4, row, q, scales, sums) };
    }
    // SAFETY: the caller's contract.
    unsafe { quantize_group_body(view, r0, int4, row, q, scales, sums) }
}

/// [`quantize_group`] compiled for AVX2.
///
/// # Safety
/// The CPU has AVX2 and FMA; [`quantize_group`]'s contract.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_group_avx2(
    view: &MatrixView,
    r0: usize,
    int4: bool,
    row: &mut [f32],
    q: &mut [i8],
    scales: &mut [f32],
    sums: Option<&mut [i32]>,
) -> Option<usize> {
    // SAFETY: forwarded.
    unsafe { quantize_group_body(view, r0, int4, row, q, scales, sums) }
}

/// The quantizer of [`quantize_group`], compiled into each ISA wrapper.
///
/// # Safety
/// As [`quantize_group`] (the caller's CPU runs the wrapper it is inlined into).
#[inline(always)]
unsafe fn quantize_group_body(
    view: &MatrixView,
    r0: usize,
    int4: bool,
    row: &mut [f32],
    q: &mut [i8],
    scales: &mut [f32],
    mut sums: Option<&mut [i32]>,
) -> Option<usize> {
    let k = row.len();
    // bf16 inputs are already bf16 values: the rounding below would change nothing.
    let round = view.dtype != crate::dtype::FloatType::BF16;
    for i in 0..GROUP_ROWS {
        // SAFETY: row r0 + i exists (contract); `row` holds cols values.
        unsafe { view.row_f32(r0 + i, row) };
        if !all_finite(row) {
            return Some(r0 + i);
        }
        if round {
            for x in row.iter_mut() {
                *x = round_to_bf16(*x);
            }
        }
        let qr = &mut q[i * k..(i + 1) * k];
        scales[i] = if int4 {
            quantize_row_int4(row, qr)
        } else {
            quantize_row_int8(row, qr)
        };
        if let Some(s) = sums.as_deref_mut() {
            let mult = if int4 { 16 } else { 1 };
            s[i] = qr.iter().map(|&v| mult * v as i32).sum();
        }
    }
    None
}

/// `x` rounded half to even and saturated to i8 (NaN → 0), branch-free so loops vectorise
/// (`f32::round_ties_even` is a libm call on baseline x86-64, and `as i8` a scalar one).
#[inline(always)]
fn round_to_i8(x: f32) -> i8 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23
                                     // Exact for |x| < 2^22; larger values saturate below exactly as after exact rounding.
    let r = ((x + MAGIC) - MAGIC).clamp(-128.0, 127.0);
    let r = if r.is_nan() { 0.0 } else { r };
    // SAFETY: r is integral, finite and within [-128, 127].
    unsafe { r.to_int_unchecked::<i32>() as i8 }
}

/// Round to the nearest bf16 value, ties to even (NaN stays NaN), with plain integer
/// arithmetic so it vectorises.
#[inline(always)]
fn round_to_bf16(x: f32) -> f32 {
    let b = x.to_bits();
    let r = (b.wrapping_add(0x7FFF + ((b >> 16) & 1))) & 0xFFFF_0000;
    if x.is_nan() {
        x
    } else {
        f32::from_bits(r)
    }
}

/// Largest |x| of a row, NaN ignored (as `f32::max` does), on the bit patterns so it vectorises.
#[inline(always)]
fn abs_max(row: &[f32]) -> f32 {
    f32::from_bits(max_lane(row, |v| {
        let b = v.to_bits() & 0x7FFF_FFFF;
        if b > 0x7F80_0000 {
            0
        } else {
            b
        }
    }))
}

/// Whether every value is finite (no NaN, no ±Inf).
#[inline]
pub fn all_finite(values: &[f32]) -> bool {
    finite_abs_max(values).is_some()
}

/// The largest |v| of `values` (0 when empty), or None when one is NaN or ±Inf, in one pass:
/// positive floats order as their bit patterns, infinity's below NaN's, where `f32::max` would
/// drop a NaN. One integer max per value, so it vectorises.
#[inline]
pub fn finite_abs_max(values: &[f32]) -> Option<f32> {
    let bits = max_lane(values, |v| v.to_bits() & 0x7FFF_FFFF);
    (bits < 0x7F80_0000).then(|| f32::from_bits(bits))
}

/// The largest `lane(v)` over `row` (0 for an empty row).
#[inline(always)]
fn max_lane(row: &[f32], lane: impl Fn(f32) -> u32) -> u32 {
    // Eight independent lanes: the shape the vectoriser turns into one register.
    let mut acc = [0u32; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = (*a).max(lane(v));
        }
    }
    tail.iter()
        .fold(acc.into_iter().max().unwrap_or(0), |m, &v| m.max(lane(v)))
}

/// Row-major values of one 32-row group → its tiled bytes: tile t of 64 inputs (INT4: 128,
/// byte j = input j low nibble, 64 + j high nibble), 16-row halves, each line 16 rows × 4 bytes.
fn scatter_group(q: &[i8], k: usize, int4: bool, out: &mut [u8]) {
    let step = k_step(int4);
    for t in 0..k / step {
        let tile = &mut out[t * 2048..(t + 1) * 2048];
        for h in 0..2 {
            for row16 in 0..16 {
                let src = &q[(h * 16 + row16) * k + t * step..][..step];
                for w in 0..16 {
                    let at = h * 1024 + w * 64 + row16 * 4;
                    let word: [u8; 4] = std::array::from_fn(|b| {
                        let j = w * 4 + b;
                        if int4 {
                            (src[j] as u8 & 0x0F) | ((src[64 + j] as u8) << 4)
                        } else {
                            src[j] as u8
                        }
                    });
                    tile[at..at + 4].copy_from_slice(&word);
                }
            }
        }
    }
}

/// Row-major INT8 values `[n][k]` → the original's tiled bytes.
pub fn pack_amx_int8(q: &[i8], n: usize, k: usize) -> Result<Vec<u8>> {
    check_shape(n, k, 64)?;
    let mut out = vec![0u8; n * k];
    for r in 0..n {
        for c in 0..k {
            out[amx_int8_offset(r, c, k)] = q[r * k + c] as u8;
        }
    }
    Ok(out)
}

/// The original's tiled INT8 bytes → row-major values.
pub fn unpack_amx_int8(bytes: &[u8], n: usize, k: usize) -> Result<Vec<i8>> {
    check_shape(n, k, 64)?;
    kt_ensure!(
        bytes.len() == n * k,
        Format,
        "INT8 matrix {n}x{k} needs {} bytes, got {}",
        n * k,
        bytes.len()
    );
    let mut q = vec![0i8; n * k];
    for r in 0..n {
        for c in 0..k {
            q[r * k + c] = bytes[amx_int8_offset(r, c, k)] as i8;
        }
    }
    Ok(q)
}

/// Byte offset and nibble (0 = low) of INT4 element (row `r`, column `c`) with `k` columns.
pub fn amx_int4_position(r: usize, c: usize, k: usize) -> (usize, u32) {
    let (n0, rr) = (r / 32 * 32, r % 32);
    let (k0, cc) = (c / 128 * 128, c % 128);
    let (j, nibble) = (cc % 64, (cc / 64) as u32);
    let (half, row16) = (rr / 16, rr % 16);
    (
        (n0 * k + k0 * 32) / 2 + half * 1024 + (j / 4) * 64 + row16 * 4 + j % 4,
        nibble,
    )
}

/// Row-major INT4 values `[n][k]` (each in [−8, 7]) → the original's tiled bytes.
pub fn pack_amx_int4(v: &[i8], n: usize, k: usize) -> Result<Vec<u8>> {
    check_shape(n, k, 128)?;
    let mut out = vec![0u8; n * k / 2];
    for r in 0..n {
        for c in 0..k {
            let (off, nib) = amx_int4_position(r, c, k);
            out[off] |= ((v[r * k + c] as u8) & 0x0F) << (4 * nib);
        }
    }
    Ok(out)
}

/// The original's tiled INT4 bytes → row-major values in [−8, 7].
pub fn unpack_amx_int4(bytes: &[u8], n: usize, k: usize) -> Result<Vec<i8>> {
    check_shape(n, k, 128)?;
    kt_ensure!(
        bytes.len() * 2 == n * k,
        Format,
        "INT4 matrix {n}x{k} needs {} bytes, got {}",
        n * k / 2,
        bytes.len()
    );
    let mut v = vec![0i8; n * k];
    for r in 0..n {
        for c in 0..k {
            let (off, nib) = amx_int4_position(r, c, k);
            // Sign-extend the nibble.
            v[r * k + c] = (((bytes[off] >> (4 * nib)) << 4) as i8) >> 4;
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod rounding_tests {
    #[test]
    fn rounding_to_i8_matches_std() {
        let want = |x: f32| x.round_ties_even().clamp(-128.0, 127.0) as i8;
        let mut x = -300.0f32;
        while x < 300.0 {
            assert_eq!(super::round_to_i8(x), want(x), "{x}");
            x += 0.125;
        }
        for v in [
            1e7f32,
            -1e9,
            0.5,
            1.5,
            2.5,
            -0.5,
            -2.5,
            126.5,
            127.5,
            -128.5,
            4194303.5,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1e-40,
        ] {
            assert_eq!(super::round_to_i8(v), want(v), "{v}");
        }
    }

    #[test]
    fn bf16_rounding_matches_the_half_crate() {
        let mut rng = crate::rng::Rng::new(3);
        for _ in 0..100_000 {
            let x = f32::from_bits(rng.next_u64() as u32);
            let want = crate::dtype::bf16_bits_to_f32(crate::dtype::f32_to_bf16_bits(x));
            let got = super::round_to_bf16(x);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{x}"
            );
        }
    }
}
