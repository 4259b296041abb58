//! Integer dot products for AMXINT8 weights, read straight from the original's tiled layout
//! (see [`crate::quant`]): a 32-row group of a `[n][k]` matrix is `k/64` tiles of 2048 bytes; in
//! tile `t`, line `w` of half `h` (64 bytes at `t*2048 + h*1024 + w*64`) holds rows `16h..16h+16`
//! × inputs `64t + 4w .. +4`. That is the `vpdpbusd` operand shape, so no repacking is needed.
//!
//! Activations arrive quantised per token row and biased to unsigned (`a + 128`), which
//! `vpdpbusd` needs; `out = Σ a_u8·w − 128·Σ w` (the row sums are precomputed at load) is the
//! exact signed dot product. Every variant returns the same i32 values as the scalar twin.

/// `out[r*32 + j] = Σ_kk (a_rows[r][kk] − 128) · W[j][kk]` for one 32-row group.
///
/// Values are those the quantiser produces: weights in [−127, 127], activations in [1, 255]
/// (signed [−127, 127] biased by 128); within that range every variant is exact.
///
/// # Safety
/// The CPU supports the variant; each `a_rows[r]` points to `k` bytes; `group` to `32*k` bytes
/// in the tiled layout; `row_sums` to 32 values `Σ_kk W[j][kk]`; `out` to `32*rows` i32;
/// `k % 64 == 0`; rows ≤ the variant's block.
pub type Int8DotFn = unsafe fn(
    a_rows: &[*const u8],
    k: usize,
    group: *const u8,
    row_sums: *const i32,
    out: *mut i32,
);

/// Row sums `Σ_kk W[j][kk]` of a 32-row group in the tiled layout (for the unsigned-bias fix-up).
pub fn group_row_sums(group: &[u8], k: usize) -> [i32; 32] {
    let mut sums = [0i32; 32];
    for (j, s) in sums.iter_mut().enumerate() {
        for kk in 0..k {
            *s += group[crate::quant::amx_int8_offset(j, kk, k)] as i8 as i32;
        }
    }
    sums
}

/// Scalar twin: index arithmetic through the layout's own offset function.
///
/// # Safety
/// See [`Int8DotFn`].
pub unsafe fn dot_scalar(
    a_rows: &[*const u8],
    k: usize,
    group: *const u8,
    _row_sums: *const i32,
    out: *mut i32,
) {
    for (r, &a) in a_rows.iter().enumerate() {
        for j in 0..32 {
            let mut acc = 0i32;
            for kk in 0..k {
                // SAFETY: offsets < 32*k, kk < k by the contract.
                unsafe {
                    let w = *group.add(crate::quant::amx_int8_offset(j, kk, k)) as i8 as i32;
                    acc += (*a.add(kk) as i32 - 128) * w;
                }
            }
            // SAFETY: out holds 32 per row.
            unsafe { *out.add(r * 32 + j) = acc };
        }
    }
}

/// Like [`Int8DotFn`] for AMXINT4 groups (`32*k/2` bytes in the original's nibble layout; each
/// weight is `16·v`, `v ∈ [−7, 7]`); `row_sums` are sums of `16·v`.
pub type Int4DotFn = Int8DotFn;

/// Row sums `Σ_kk 16·v[j][kk]` of a 32-row AMXINT4 group.
pub fn group_row_sums_int4(group: &[u8], k: usize) -> [i32; 32] {
    let mut sums = [0i32; 32];
    for (j, s) in sums.iter_mut().enumerate() {
        for kk in 0..k {
            *s += int4_weight(group, j, kk, k);
        }
    }
    sums
}

/// The weight `16·v` of (row `j`, column `kk`) in an AMXINT4 group.
fn int4_weight(group: &[u8], j: usize, kk: usize, k: usize) -> i32 {
    let (off, nib) = crate::quant::amx_int4_position(j, kk, k);
    let b = group[off];
    // The nibble moved to the top of a byte is 16·v as a signed byte.
    (if nib == 0 { b << 4 } else { b & 0xF0 }) as i8 as i32
}

/// Scalar twin of the AMXINT4 dot product.
///
/// # Safety
/// See [`Int4DotFn`].
pub unsafe fn dot_int4_scalar(
    a_rows: &[*const u8],
    k: usize,
    group: *const u8,
    _s: *const i32,
    out: *mut i32,
) {
    // SAFETY: the group holds 32*k/2 bytes by the contract.
    let g = unsafe { std::slice::from_raw_parts(group, 32 * k / 2) };
    for (r, &a) in a_rows.iter().enumerate() {
        for j in 0..32 {
            let mut acc = 0i32;
            for kk in 0..k {
                // SAFETY: kk < k.
                acc += (unsafe { *a.add(kk) } as i32 - 128) * int4_weight(g, j, kk, k);
            }
            // SAFETY: out holds 32 per row.
            unsafe { *out.add(r * 32 + j) = acc };
        }
    }
}

/// Rows per call of the SIMD variants.
pub const ROWS: usize = 8;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// AVX512-VNNI: one `vpdpbusd` per (row, half, input quad).
    ///
    /// # Safety
    /// AVX512-F/BW/VNNI available; [`super::Int8DotFn`] contract.
    pub unsafe fn dot_avx512vnni(
        a: &[*const u8],
        k: usize,
        g: *const u8,
        s: *const i32,
        o: *mut i32,
    ) {
        // SAFETY: forwarded.
        unsafe {
            crate::kernels::dispatch_rows!(vnni512, "avx512vnni int8 dot", a, (a, k, g, s, o); 1 2 3 4 5 6 7 8)
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[allow(clippy::needless_range_loop)] // register blocks read best as indexed loops
    unsafe fn vnni512<const R: usize>(
        a: &[*const u8],
        k: usize,
        g: *const u8,
        s: *const i32,
        o: *mut i32,
    ) {
        let mut acc = [[_mm512_setzero_si512(); 2]; R];
        // Addresses strictly ascending (half 0's 16 lines, then half 1's): reading both halves
        // in step made two streams 1 KiB apart and halved the DRAM rate (measured).
        for t in 0..k / 64 {
            for h in 0..2 {
                for w in 0..16 {
                    // SAFETY: tile t, half h, line w inside the group; quad 16t+w in each row.
                    unsafe {
                        let line = g.add(t * 2048 + h * 1024 + w * 64);
                        let wv = _mm512_loadu_si512(line as *const __m512i);
                        for r in 0..R {
                            let quad = (a[r].add(t * 64 + w * 4) as *const i32).read_unaligned();
                            acc[r][h] = _mm512_dpbusd_epi32(acc[r][h], _mm512_set1_epi32(quad), wv);
                        }
                    }
                }
            }
        }
        // SAFETY: 32 row sums; out holds 32 per row.
        unsafe { store_unbiased(&acc, s, o) }
    }

    /// `out = acc − 128·row_sum`: undo the +128 bias of the unsigned activations.
    ///
    /// # Safety
    /// AVX-512F available; `s` points to 32 row sums, `o` to `32·R` i32.
    #[target_feature(enable = "avx512f")]
    unsafe fn store_unbiased<const R: usize>(acc: &[[__m512i; 2]; R], s: *const i32, o: *mut i32) {
        // SAFETY: the contract above.
        unsafe {
            let bias = [
                _mm512_slli_epi32::<7>(_mm512_loadu_si512(s as *const __m512i)),
                _mm512_slli_epi32::<7>(_mm512_loadu_si512(s.add(16) as *const __m512i)),
            ];
            for (r, row) in acc.iter().enumerate() {
                for (h, v) in row.iter().enumerate() {
                    _mm512_storeu_si512(
                        o.add(r * 32 + h * 16) as *mut __m512i,
                        _mm512_sub_epi32(*v, bias[h]),
                    );
                }
            }
        }
    }

    /// AVX2 without VNNI: `vpmaddubsw` on |a| and sign-adjusted weights, then `vpmaddwd` with
    /// ones. With |a|, |w| ≤ 127 every i16 pair sum (≤ 32258) is exact; −128 would overflow,
    /// which is why the quantisers never produce it.
    ///
    /// # Safety
    /// AVX2 available; [`super::Int8DotFn`] contract.
    pub unsafe fn dot_avx2(a: &[*const u8], k: usize, g: *const u8, s: *const i32, o: *mut i32) {
        // SAFETY: forwarded.
        unsafe {
            crate::kernels::dispatch_rows!(avx2, "avx2 int8 dot", a, (a, k, g, s, o); 1 2 3 4)
        }
    }

    #[target_feature(enable = "avx2")]
    #[allow(clippy::needless_range_loop)]
    unsafe fn avx2<const R: usize>(
        a: &[*const u8],
        k: usize,
        g: *const u8,
        _s: *const i32,
        o: *mut i32,
    ) {
        let ones = _mm256_set1_epi16(1);
        let flip = _mm256_set1_epi8(-128);
        // Four 8-row quarters of the 32 outputs per pass keep 4R accumulators in registers.
        let mut acc = [[_mm256_setzero_si256(); 4]; R];
        for t in 0..k / 64 {
            for h in 0..2 {
                for w in 0..16 {
                    // SAFETY: as in the AVX-512 variant; each 32-byte half-line is 8 rows × 4
                    // inputs; addresses ascend as there.
                    unsafe {
                        let line = g.add(t * 2048 + h * 1024 + w * 64);
                        let ws = [
                            _mm256_loadu_si256(line as *const __m256i),
                            _mm256_loadu_si256(line.add(32) as *const __m256i),
                        ];
                        for r in 0..R {
                            let quad = (a[r].add(t * 64 + w * 4) as *const i32).read_unaligned();
                            // Back to signed activations, then |a| and the sign moved onto w.
                            let x = _mm256_xor_si256(_mm256_set1_epi32(quad), flip);
                            let ax = _mm256_abs_epi8(x);
                            for q in 0..2 {
                                let sw = _mm256_sign_epi8(ws[q], x);
                                let p16 = _mm256_maddubs_epi16(ax, sw);
                                let sum = _mm256_madd_epi16(p16, ones);
                                acc[r][2 * h + q] = _mm256_add_epi32(acc[r][2 * h + q], sum);
                            }
                        }
                    }
                }
            }
        }
        for r in 0..R {
            for q in 0..4 {
                // SAFETY: out holds 32 per row; quarter q = outputs 8q..8q+8.
                unsafe { _mm256_storeu_si256(o.add(r * 32 + q * 8) as *mut __m256i, acc[r][q]) };
            }
        }
    }

    /// AVX512-VNNI AMXINT4: each 64-byte line gives two int8 operands, the low nibbles shifted
    /// up (columns 4w..4w+4 of the tile) and the high nibbles masked (columns 64+4w..).
    ///
    /// # Safety
    /// AVX512-F/BW/VNNI available; [`super::Int4DotFn`] contract.
    pub unsafe fn dot_int4_avx512vnni(
        a: &[*const u8],
        k: usize,
        g: *const u8,
        s: *const i32,
        o: *mut i32,
    ) {
        // SAFETY: forwarded.
        unsafe {
            crate::kernels::dispatch_rows!(int4_vnni512, "avx512vnni int4 dot", a, (a, k, g, s, o); 1 2 3 4 5 6 7 8)
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[allow(clippy::needless_range_loop)]
    unsafe fn int4_vnni512<const R: usize>(
        a: &[*const u8],
        k: usize,
        g: *const u8,
        s: *const i32,
        o: *mut i32,
    ) {
        let mut acc = [[_mm512_setzero_si512(); 2]; R];
        let high = _mm512_set1_epi8(0xF0u8 as i8);
        for t in 0..k / 128 {
            for h in 0..2 {
                for w in 0..16 {
                    // SAFETY: tile t (2048 bytes), half h, line w inside the group; columns
                    // 128t + 4w and 128t + 64 + 4w inside each row.
                    unsafe {
                        let b = _mm512_loadu_si512(
                            g.add(t * 2048 + h * 1024 + w * 64) as *const __m512i
                        );
                        let lo = _mm512_and_si512(_mm512_slli_epi16::<4>(b), high);
                        let hi = _mm512_and_si512(b, high);
                        for r in 0..R {
                            let base = a[r].add(t * 128 + w * 4);
                            let q0 = _mm512_set1_epi32((base as *const i32).read_unaligned());
                            let q1 =
                                _mm512_set1_epi32((base.add(64) as *const i32).read_unaligned());
                            acc[r][h] = _mm512_dpbusd_epi32(acc[r][h], q0, lo);
                            acc[r][h] = _mm512_dpbusd_epi32(acc[r][h], q1, hi);
                        }
                    }
                }
            }
        }
        // SAFETY: 32 row sums; out holds 32 per row.
        unsafe { store_unbiased(&acc, s, o) }
    }

    /// AVX2 AMXINT4 with the sign trick (|16·v| ≤ 112 keeps the i16 pair sums exact).
    ///
    /// # Safety
    /// AVX2 available; [`super::Int4DotFn`] contract.
    pub unsafe fn dot_int4_avx2(
        a: &[*const u8],
        k: usize,
        g: *const u8,
        s: *const i32,
        o: *mut i32,
    ) {
        // SAFETY: forwarded.
        unsafe {
            crate::kernels::dispatch_rows!(int4_avx2, "avx2 int4 dot", a, (a, k, g, s, o); 1 2 3 4)
        }
    }

    #[target_feature(enable = "avx2")]
    #[allow(clippy::needless_range_loop)]
    unsafe fn int4_avx2<const R: usize>(
        a: &[*const u8],
        k: usize,
        g: *const u8,
        _s: *const i32,
        o: *mut i32,
    ) {
        let ones = _mm256_set1_epi16(1);
        let flip = _mm256_set1_epi8(-128);
        let high = _mm256_set1_epi8(0xF0u8 as i8);
        let mut acc = [[_mm256_setzero_si256(); 4]; R];
        for t in 0..k / 128 {
            for h in 0..2 {
                for w in 0..16 {
                    // SAFETY: as in the AVX-512 variant, in 32-byte halves (8 rows each).
                    unsafe {
                        let line = g.add(t * 2048 + h * 1024 + w * 64);
                        for half in 0..2 {
                            let b = _mm256_loadu_si256(line.add(half * 32) as *const __m256i);
                            let ops = [
                                _mm256_and_si256(_mm256_slli_epi16::<4>(b), high),
                                _mm256_and_si256(b, high),
                            ];
                            for r in 0..R {
                                let base = a[r].add(t * 128 + w * 4);
                                for (c, wv) in ops.iter().enumerate() {
                                    let quad = (base.add(64 * c) as *const i32).read_unaligned();
                                    let x = _mm256_xor_si256(_mm256_set1_epi32(quad), flip);
                                    let p16 = _mm256_maddubs_epi16(
                                        _mm256_abs_epi8(x),
                                        _mm256_sign_epi8(*wv, x),
                                    );
                                    let q = 2 * h + half;
                                    acc[r][q] =
                                        _mm256_add_epi32(acc[r][q], _mm256_madd_epi16(p16, ones));
                                }
                            }
                        }
                    }
                }
            }
        }
        for r in 0..R {
            for q in 0..4 {
                // SAFETY: out holds 32 per row; quarter q = outputs 8q..8q+8.
                unsafe { _mm256_storeu_si256(o.add(r * 32 + q * 8) as *mut __m256i, acc[r][q]) };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub use x86::{dot_avx2, dot_avx512vnni, dot_int4_avx2, dot_int4_avx512vnni};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::pack_amx_int8;
    use crate::rng::Rng;

    /// One integer format under test: how to draw, pack and sum its weights, and its twin.
    struct Format {
        ks: &'static [usize],
        /// Drawn values (INT8: q in [-127, 127]; INT4: v in [-7, 7]).
        draw: fn(&mut Rng) -> i8,
        /// Multiplier from a drawn value to the weight the dot product uses.
        weight: i64,
        pack: fn(&[i8], usize, usize) -> crate::Result<Vec<u8>>,
        sums: fn(&[u8], usize) -> [i32; 32],
        twin: Int8DotFn,
    }

    const INT8: Format = Format {
        ks: &[64, 192, 1024],
        draw: |rng| (rng.below(255) as i32 - 127) as i8, // -128 never occurs
        weight: 1,
        pack: pack_amx_int8,
        sums: group_row_sums,
        twin: dot_scalar,
    };

    const INT4: Format = Format {
        ks: &[128, 384],
        draw: |rng| (rng.below(15) as i32 - 7) as i8,
        weight: 16,
        pack: crate::quant::pack_amx_int4,
        sums: group_row_sums_int4,
        twin: dot_int4_scalar,
    };

    /// `f` equals the format's scalar twin exactly, and the twin equals plain row-major
    /// arithmetic, on random data over the quantisers' whole range.
    fn check(fmt: &Format, f: Int8DotFn, rows_max: usize, name: &str) {
        let mut rng = Rng::new(99);
        for &k in fmt.ks {
            let w: Vec<i8> = (0..32 * k).map(|_| (fmt.draw)(&mut rng)).collect();
            let group = (fmt.pack)(&w, 32, k).unwrap();
            let sums = (fmt.sums)(&group, k);
            for rows in 1..=rows_max {
                let a: Vec<Vec<u8>> = (0..rows)
                    .map(|_| (0..k).map(|_| 1 + rng.below(255) as u8).collect())
                    .collect();
                let ptrs: Vec<*const u8> = a.iter().map(|r| r.as_ptr()).collect();
                let mut got = vec![0i32; rows * 32];
                let mut want = vec![0i32; rows * 32];
                unsafe {
                    f(&ptrs, k, group.as_ptr(), sums.as_ptr(), got.as_mut_ptr());
                    (fmt.twin)(&ptrs, k, group.as_ptr(), sums.as_ptr(), want.as_mut_ptr());
                }
                assert_eq!(got, want, "{name} rows={rows} k={k}");
                for r in 0..rows {
                    for j in 0..32 {
                        let exact: i64 = (0..k)
                            .map(|kk| (a[r][kk] as i64 - 128) * fmt.weight * w[j * k + kk] as i64)
                            .sum();
                        assert_eq!(want[r * 32 + j] as i64, exact);
                    }
                }
            }
        }
    }

    #[test]
    fn int4_variants_match_the_scalar_twin_exactly() {
        check(&INT4, dot_int4_scalar, 2, "scalar");
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") {
                check(&INT4, dot_int4_avx2, 4, "avx2");
            }
            if std::is_x86_feature_detected!("avx512vnni")
                && std::is_x86_feature_detected!("avx512bw")
            {
                check(&INT4, dot_int4_avx512vnni, ROWS, "avx512vnni");
            }
        }
    }

    #[test]
    fn int8_variants_match_the_scalar_twin_exactly() {
        check(&INT8, dot_scalar, 3, "scalar");
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") {
                check(&INT8, dot_avx2, 4, "avx2");
            }
            if std::is_x86_feature_detected!("avx512vnni")
                && std::is_x86_feature_detected!("avx512bw")
            {
                check(&INT8, dot_avx512vnni, ROWS, "avx512vnni");
            }
        }
    }
}
