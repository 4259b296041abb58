//! Panel lines to rows and back: `write_weight_scale_to_buffer` and loading checkpoints.
//!
//! The packed layouts hold a 32-row panel as *lines*: line `q` is one element (2 or 4 bytes:
//! an input pair of 8-bit codes, an input pair of bf16, 8 inputs of 4-bit codes) of each of the
//! 32 rows, row `j` at byte `j·elem`. The GPU buffers and the checkpoints hold rows. Moving
//! each element on its own made those copies 5-10 times slower than a copy of the same bytes;
//! the SIMD variants transpose a square block in registers (a register per line in, a register
//! per row out, or the other way) and store whole registers.
//!
//! The block transpose swaps the off-diagonal halves of every 2×2 block of registers, from the
//! largest distance down to one element: at distance `s`, register `i` (bit `s` of `i` clear)
//! takes the elements of register `i + s` that sit `s` lower, and that one takes `i`'s upper
//! ones. After the last distance, element `r` of register `i` is element `i` of register `r`
//! before. [`lines_to_rows_scalar`] is the twin: every variant writes the same bytes.
use crate::isa::{self, Level};

/// Rows of a panel (one element each per line): [`crate::pack::PANEL`], which checks that the
/// two agree (this module sits below `pack`, which uses it).
pub const ROWS: usize = 32;

/// Which way [`transpose`] moves the elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// Panel lines (contiguous) to 32 rows of a stride.
    LinesToRows,
    /// 32 rows of a stride to panel lines.
    RowsToLines,
}

/// `dst[j·stride + q·elem ..][..elem] = src[(q·32 + j)·elem ..][..elem]` for lines `q < lines`
/// and rows `j < 32`, with the widest registers this process may use.
///
/// # Safety
/// `src` has `lines·32·elem` readable bytes; each of the 32 rows at `dst + j·stride` has
/// `lines·elem` writable bytes that nothing else reads or writes meanwhile and that do not
/// overlap `src`.
pub unsafe fn lines_to_rows(
    src: *const u8,
    lines: usize,
    elem: usize,
    dst: *mut u8,
    stride: usize,
) {
    // SAFETY: forwarded.
    unsafe { transpose(Way::LinesToRows, src, lines, elem, dst, stride) }
}

/// The way back: `dst[(q·32 + j)·elem ..][..elem] = src[j·stride + q·elem ..][..elem]` for lines
/// `q < lines` and rows `j < 32`.
///
/// # Safety
/// Each of the 32 rows at `src + j·stride` has `lines·elem` readable bytes; `dst` has
/// `lines·32·elem` writable bytes that nothing else reads or writes meanwhile and that do not
/// overlap the rows.
pub unsafe fn rows_to_lines(
    src: *const u8,
    stride: usize,
    lines: usize,
    elem: usize,
    dst: *mut u8,
) {
    // SAFETY: forwarded (the rows are `src`'s, the lines `dst`).
    unsafe { transpose(Way::RowsToLines, src, lines, elem, dst, stride) }
}

/// # Safety
/// As [`lines_to_rows`] or [`rows_to_lines`] for `way` (`stride` is the rows').
unsafe fn transpose(
    way: Way,
    src: *const u8,
    lines: usize,
    elem: usize,
    dst: *mut u8,
    stride: usize,
) {
    assert!(
        matches!(elem, 1 | 2 | 4),
        "elements of 1, 2 or 4 bytes, got {elem}"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if elem > 1 && isa::allows(Level::Avx512Base) {
            // SAFETY: forwarded; the CPU has AVX-512 F/BW (the level says so).
            return unsafe { x86::transpose_avx512(way, src, lines, elem, dst, stride) };
        }
        if elem > 1 && isa::allows(Level::Avx2) {
            // SAFETY: forwarded; the CPU has AVX2.
            return unsafe { x86::transpose_avx2(way, src, lines, elem, dst, stride) };
        }
    }
    // SAFETY: forwarded.
    unsafe { transpose_scalar(way, src, lines, elem, dst, stride) }
}

/// The twin of [`lines_to_rows`]: one element at a time.
///
/// # Safety
/// As [`lines_to_rows`].
pub unsafe fn lines_to_rows_scalar(
    src: *const u8,
    lines: usize,
    elem: usize,
    dst: *mut u8,
    stride: usize,
) {
    // SAFETY: forwarded.
    unsafe { transpose_scalar(Way::LinesToRows, src, lines, elem, dst, stride) }
}

/// The twin of [`rows_to_lines`]: one element at a time.
///
/// # Safety
/// As [`rows_to_lines`].
pub unsafe fn rows_to_lines_scalar(
    src: *const u8,
    stride: usize,
    lines: usize,
    elem: usize,
    dst: *mut u8,
) {
    // SAFETY: forwarded.
    unsafe { transpose_scalar(Way::RowsToLines, src, lines, elem, dst, stride) }
}

/// # Safety
/// As [`transpose`].
unsafe fn transpose_scalar(
    way: Way,
    src: *const u8,
    lines: usize,
    elem: usize,
    dst: *mut u8,
    stride: usize,
) {
    // A copy of a constant size per element (a call to memmove per element otherwise).
    unsafe fn copy<const E: usize>(
        way: Way,
        src: *const u8,
        lines: usize,
        dst: *mut u8,
        stride: usize,
    ) {
        for q in 0..lines {
            for j in 0..ROWS {
                let (line, row) = ((q * ROWS + j) * E, j * stride + q * E);
                let (from, to) = match way {
                    Way::LinesToRows => (line, row),
                    Way::RowsToLines => (row, line),
                };
                // SAFETY: inside the line and the row (the caller's contract).
                unsafe {
                    let v = (src.add(from) as *const [u8; E]).read_unaligned();
                    (dst.add(to) as *mut [u8; E]).write_unaligned(v);
                }
            }
        }
    }
    // SAFETY: forwarded.
    unsafe {
        match elem {
            1 => copy::<1>(way, src, lines, dst, stride),
            2 => copy::<2>(way, src, lines, dst, stride),
            4 => copy::<4>(way, src, lines, dst, stride),
            _ => unreachable!("elements of 1, 2 or 4 bytes"),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{transpose_scalar, Way, ROWS};
    use std::arch::x86_64::*;

    /// Blocks of lines in registers of `N·elem` bytes: the lines of a block are as many as a
    /// register holds elements, and a line is `32·elem / (N·elem)` registers (row groups),
    /// each transposed on its own. Lines past the last whole block go to the twin.
    ///
    /// # Safety
    /// As [`super::transpose`]; `load`, `store` and `transpose` need only what the caller's
    /// target features give.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn blocks<R: Copy, const N: usize>(
        way: Way,
        src: *const u8,
        lines: usize,
        elem: usize,
        dst: *mut u8,
        stride: usize,
        load: impl Fn(*const u8) -> R,
        store: impl Fn(*mut u8, R),
        transpose: impl Fn(&mut [R; N]),
    ) {
        let reg = N * elem;
        let (line_bytes, groups) = (ROWS * elem, ROWS * elem / reg);
        let whole = lines / N * N;
        // Register i of a block: line q0 + i's row group g, or row g·N + i from line q0 on,
        // as byte steps per (q0, g, i).
        let line_steps = [line_bytes, reg, line_bytes];
        let row_steps = [elem, N * stride, stride];
        let (from, to) = match way {
            Way::LinesToRows => (line_steps, row_steps),
            Way::RowsToLines => (row_steps, line_steps),
        };
        let at = |s: [usize; 3], q0: usize, g: usize, i: usize| q0 * s[0] + g * s[1] + i * s[2];
        for q0 in (0..whole).step_by(N) {
            for g in 0..groups {
                // Lines q0..q0+N exist (q0 + N ≤ lines), register g of each is inside its line
                // (g·reg + reg ≤ line_bytes), and rows g·N.. < 32 hold elements q0..q0+N.
                let mut z: [R; N] = [load(src.wrapping_add(at(from, q0, g, 0))); N];
                for (i, v) in z.iter_mut().enumerate().skip(1) {
                    *v = load(src.wrapping_add(at(from, q0, g, i)));
                }
                transpose(&mut z);
                for (i, &v) in z.iter().enumerate() {
                    store(dst.wrapping_add(at(to, q0, g, i)), v);
                }
            }
        }
        let (rest_src, rest_dst) = match way {
            Way::LinesToRows => (whole * line_bytes, whole * elem),
            Way::RowsToLines => (whole * elem, whole * line_bytes),
        };
        // SAFETY: the remaining lines, rows as the contract gives them.
        unsafe {
            transpose_scalar(
                way,
                src.add(rest_src),
                lines - whole,
                elem,
                dst.add(rest_dst),
                stride,
            )
        };
    }

    /// Swap the off-diagonal halves of registers `a` (upper elements) and `b` (lower ones)
    /// at a distance of `bytes`.
    #[inline(always)]
    unsafe fn swap512(bytes: usize, a: __m512i, b: __m512i) -> (__m512i, __m512i) {
        // SAFETY: register operations; the caller has AVX-512 F/BW.
        unsafe {
            match bytes {
                32 => (
                    _mm512_shuffle_i64x2::<0x44>(a, b),
                    _mm512_shuffle_i64x2::<0xEE>(a, b),
                ),
                16 => {
                    let lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
                    let hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
                    (
                        _mm512_permutex2var_epi64(a, lo, b),
                        _mm512_permutex2var_epi64(a, hi, b),
                    )
                }
                8 => (_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b)),
                4 => (
                    _mm512_mask_blend_epi32(0xAAAA, a, _mm512_slli_epi64::<32>(b)),
                    _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64::<32>(a), b),
                ),
                2 => (
                    _mm512_mask_blend_epi16(0xAAAA_AAAA, a, _mm512_slli_epi32::<16>(b)),
                    _mm512_mask_blend_epi16(0xAAAA_AAAA, _mm512_srli_epi32::<16>(a), b),
                ),
                _ => unreachable!("distances of 2 to 32 bytes"),
            }
        }
    }

    /// Swap as [`swap512`] in 32-byte registers.
    #[inline(always)]
    unsafe fn swap256(bytes: usize, a: __m256i, b: __m256i) -> (__m256i, __m256i) {
        // SAFETY: register operations; the caller has AVX2.
        unsafe {
            match bytes {
                16 => (
                    _mm256_permute2x128_si256::<0x20>(a, b),
                    _mm256_permute2x128_si256::<0x31>(a, b),
                ),
                8 => (_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b)),
                4 => (
                    _mm256_blend_epi32::<0xAA>(a, _mm256_slli_epi64::<32>(b)),
                    _mm256_blend_epi32::<0xAA>(_mm256_srli_epi64::<32>(a), b),
                ),
                2 => (
                    _mm256_blend_epi16::<0xAA>(a, _mm256_slli_epi32::<16>(b)),
                    _mm256_blend_epi16::<0xAA>(_mm256_srli_epi32::<16>(a), b),
                ),
                _ => unreachable!("distances of 2 to 16 bytes"),
            }
        }
    }

    /// One distance of the transpose: registers `i` and `i + S` for every `i` with bit `S`
    /// clear, swapped by `swap` (at `S` elements' distance in bytes). Constant indices, so the
    /// block stays in registers.
    #[inline(always)]
    fn stage<R: Copy, const N: usize, const S: usize>(
        z: &mut [R; N],
        swap: impl Fn(R, R) -> (R, R),
    ) {
        for base in (0..N).step_by(2 * S) {
            for i in base..base + S {
                (z[i], z[i + S]) = swap(z[i], z[i + S]);
            }
        }
    }

    /// The whole transpose of `N` registers of `N` elements of `elem` bytes: every distance
    /// from `N/2` elements down to one, swapped by `swap(bytes, a, b)` (its distance in bytes
    /// is a constant once inlined into a variant's `elem` arm).
    #[inline(always)]
    fn all_stages<R: Copy, const N: usize>(
        z: &mut [R; N],
        elem: usize,
        swap: impl Fn(usize, R, R) -> (R, R),
    ) {
        if N > 16 {
            stage::<R, N, 16>(z, |a, b| swap(16 * elem, a, b));
        }
        if N > 8 {
            stage::<R, N, 8>(z, |a, b| swap(8 * elem, a, b));
        }
        stage::<R, N, 4>(z, |a, b| swap(4 * elem, a, b));
        stage::<R, N, 2>(z, |a, b| swap(2 * elem, a, b));
        stage::<R, N, 1>(z, |a, b| swap(elem, a, b));
    }

    /// # Safety
    /// As [`super::transpose`], `elem` 2 or 4, and the CPU has AVX-512 F/BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn transpose_avx512(
        way: Way,
        src: *const u8,
        lines: usize,
        elem: usize,
        dst: *mut u8,
        stride: usize,
    ) {
        // SAFETY: the loads and stores stay inside what `blocks` hands them (the contract).
        let load = |p: *const u8| unsafe { _mm512_loadu_si512(p as *const _) };
        // SAFETY: as the load.
        let store = |p: *mut u8, v| unsafe { _mm512_storeu_si512(p as *mut _, v) };
        // SAFETY (the swaps): register operations (AVX-512 F/BW, this function's features).
        // SAFETY: forwarded.
        unsafe {
            match elem {
                2 => blocks::<_, 32>(way, src, lines, 2, dst, stride, load, store, |z| {
                    all_stages(z, 2, |d, a, b| swap512(d, a, b))
                }),
                4 => blocks::<_, 16>(way, src, lines, 4, dst, stride, load, store, |z| {
                    all_stages(z, 4, |d, a, b| swap512(d, a, b))
                }),
                _ => unreachable!("elements of 2 or 4 bytes"),
            }
        }
    }

    /// # Safety
    /// As [`super::transpose`], `elem` 2 or 4, and the CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn transpose_avx2(
        way: Way,
        src: *const u8,
        lines: usize,
        elem: usize,
        dst: *mut u8,
        stride: usize,
    ) {
        // SAFETY: as in the AVX-512 variant.
        let load = |p: *const u8| unsafe { _mm256_loadu_si256(p as *const _) };
        // SAFETY: as the load.
        let store = |p: *mut u8, v| unsafe { _mm256_storeu_si256(p as *mut _, v) };
        // SAFETY (the swaps): register operations (AVX2, this function's feature).
        // SAFETY: forwarded.
        unsafe {
            match elem {
                2 => blocks::<_, 16>(way, src, lines, 2, dst, stride, load, store, |z| {
                    all_stages(z, 2, |d, a, b| swap256(d, a, b))
                }),
                4 => blocks::<_, 8>(way, src, lines, 4, dst, stride, load, store, |z| {
                    all_stages(z, 4, |d, a, b| swap256(d, a, b))
                }),
                _ => unreachable!("elements of 2 or 4 bytes"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    type Variant = unsafe fn(Way, *const u8, usize, usize, *mut u8, usize);

    /// Every variant this CPU has writes what the twin writes, both ways, for whole blocks and
    /// remainders, with padded row strides, and touches no byte between the rows; the twin
    /// writes what the definition says, and the way back restores the lines.
    #[test]
    fn every_variant_writes_what_the_twin_writes() {
        let mut variants: Vec<(&str, Variant)> = vec![("dispatched", transpose)];
        #[cfg(target_arch = "x86_64")]
        {
            if crate::isa::allows(Level::Avx2) {
                variants.push(("avx2", x86::transpose_avx2));
            }
            if crate::isa::allows(Level::Avx512Base) {
                variants.push(("avx512", x86::transpose_avx512));
            }
        }
        let mut rng = Rng::new(11);
        for elem in [1usize, 2, 4] {
            for lines in [0usize, 1, 7, 8, 15, 16, 17, 32, 33, 64, 100] {
                let src: Vec<u8> = (0..lines * ROWS * elem)
                    .map(|_| rng.next_u64() as u8)
                    .collect();
                let stride = lines * elem + 3 * elem;
                let rows_of = |f: Variant, lines_in: &[u8]| {
                    let mut dst = vec![0xA5u8; ROWS * stride];
                    // SAFETY: lines_in holds the lines, dst 32 rows of stride ≥ lines·elem.
                    unsafe {
                        f(
                            Way::LinesToRows,
                            lines_in.as_ptr(),
                            lines,
                            elem,
                            dst.as_mut_ptr(),
                            stride,
                        )
                    };
                    dst
                };
                let lines_of = |f: Variant, rows: &[u8]| {
                    let mut dst = vec![0x5Au8; lines * ROWS * elem];
                    // SAFETY: rows holds 32 rows of stride ≥ lines·elem, dst the lines.
                    unsafe {
                        f(
                            Way::RowsToLines,
                            rows.as_ptr(),
                            lines,
                            elem,
                            dst.as_mut_ptr(),
                            stride,
                        )
                    };
                    dst
                };
                let twin = rows_of(transpose_scalar, &src);
                for (j, row) in twin.chunks(stride).enumerate() {
                    for q in 0..lines {
                        let at = (q * ROWS + j) * elem;
                        assert_eq!(&row[q * elem..(q + 1) * elem], &src[at..at + elem]);
                    }
                    assert!(row[lines * elem..].iter().all(|&b| b == 0xA5));
                }
                assert_eq!(
                    lines_of(transpose_scalar, &twin),
                    src,
                    "twin back, {elem} {lines}"
                );
                for (name, f) in &variants {
                    if elem == 1 && *name != "dispatched" {
                        continue; // one-byte elements (scales) always take the twin
                    }
                    assert_eq!(
                        rows_of(*f, &src),
                        twin,
                        "{name} to rows, elem {elem}, {lines}"
                    );
                    assert_eq!(
                        lines_of(*f, &twin),
                        src,
                        "{name} to lines, elem {elem}, {lines}"
                    );
                }
            }
        }
    }
}
