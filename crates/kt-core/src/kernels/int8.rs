//! Integer dot products for AMXINT8 weights, read straight from the original's tiled layout
//! (see [`crate::quant`]): a 32-row group of a `[n][k]` matrix is `k/64` tiles of 2048 bytes; in
//! tile `t`, line `w` of half `h` (64 bytes at `t*2048 + h*1024 + w*64`) holds rows `16h..16h+16`
//! × inputs `64t + 4w .. +4`. That is the `vpdpbusd` operand shape, so no repacking is needed.
//!
//! Activations arrive quantized per token row and biased to unsigned (`a + 128`), which
//! `vpdpbusd` needs; `out = Σ a_u8·w − 128·Σ w` (the row sums are precomputed at load) is the
//! exact signed dot product. Every variant returns the same i32 values as the scalar twin.
//!
//! An activation row is [`ACT_COPIES`] copies of its `k` values: biased (`a + 128`, read by the
//! scalar twin, VNNI and AMX), signed `a`, and `|a|` — the operands of the sign trick, so the
//! AVX2 kernels broadcast them instead of recomputing them for every weight line
//! ([`fill_activation_copies`]).

/// Copies of its values in an activation row (biased, signed, absolute).
pub const ACT_COPIES: usize = 3;

/// Complete an activation row whose first `k` bytes hold the biased values: the signed values
/// and their magnitudes follow.
pub fn fill_activation_copies(row: &mut [u8]) {
    let k = row.len() / ACT_COPIES;
    assert_eq!(
        row.len(),
        ACT_COPIES * k,
        "an activation row holds {ACT_COPIES} copies"
    );
    let (biased, rest) = row.split_at_mut(k);
    let (signed, abs) = rest.split_at_mut(k);
    for ((b, s), a) in biased.iter().zip(signed.iter_mut()).zip(abs.iter_mut()) {
        let v = (*b ^ 0x80) as i8;
        *s = v as u8;
        *a = v.unsigned_abs();
    }
}

/// An activation row of [`ACT_COPIES`] copies from biased values (tests and tools).
pub fn activation_row(biased: &[u8]) -> Vec<u8> {
    let mut row = [biased, biased, biased].concat();
    fill_activation_copies(&mut row);
    row
}

/// `out[r*32 + j] = Σ_kk (a_rows[r][kk] − 128) · W[j][kk]` for one 32-row group.
///
/// Values are those the quantizer produces: weights in [−127, 127], activations in [1, 255]
/// (signed [−127, 127] biased by 128); within that range every variant is exact.
///
/// # Safety
/// The CPU supports the variant; each `a_rows[r]` points to an activation row of
/// `ACT_COPIES · k` bytes (see the module docs); `group` to `32*k` bytes
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

/// Row sums of a 32-row group straight from the bytes (for loading converted files): byte
/// `4n + b` of every 64-byte line of half `h` belongs to row `16h + n`; an AMXINT4 byte holds
/// two of that row's weights, `16·v` each as the nibble moved to the top of a byte.
pub fn row_sums_fast(group: &[u8], k: usize, int4: bool) -> [i32; 32] {
    let bytes = if int4 { 32 * k / 2 } else { 32 * k };
    assert!(
        group.len() >= bytes && bytes.is_multiple_of(2048),
        "not a whole 32-row group"
    );
    #[cfg(target_arch = "x86_64")]
    if crate::isa::allows(crate::isa::Level::Avx2) {
        // SAFETY: the process's ISA level includes AVX2; the group holds `bytes` bytes of whole 2048-byte tiles.
        return unsafe { x86::row_sums_avx2(&group[..bytes], int4) };
    }
    row_sums_scalar(group, k, int4)
}

/// The scalar form of [`row_sums_fast`] (its twin in tests).
pub fn row_sums_scalar(group: &[u8], k: usize, int4: bool) -> [i32; 32] {
    let mut sums = [0i32; 32];
    let bytes = if int4 { 32 * k / 2 } else { 32 * k };
    for (l, line) in group[..bytes].chunks_exact(64).enumerate() {
        let half = (l / 16) % 2;
        for (n, word) in line.chunks_exact(4).enumerate() {
            let s: i32 = if int4 {
                word.iter()
                    .map(|&b| ((b << 4) as i8 as i32) + ((b & 0xF0) as i8 as i32))
                    .sum()
            } else {
                word.iter().map(|&b| b as i8 as i32).sum()
            };
            sums[16 * half + n] += s;
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
    //! One loop per (format, vector width), generic over the byte multiply-accumulate: the
    //! VNNI instruction (`vpdpbusd`, on biased unsigned activations, fixed up by the row sums
    //! at the end) or the sign trick without VNNI (`vpmaddubsw` on |a| and sign-moved weights,
    //! then `vpmaddwd` with ones; with |a|, |w| ≤ 127 every i16 pair sum ≤ 32258 is exact, and
    //! −128 never occurs because the quantizers do not produce it). The 256-bit AMXINT4 loop
    //! needs no sign op: AVX2 multiplies the unsigned nibbles `v + 8` with the signed
    //! activations, AVX-VNNI the sign-extended nibbles with the biased ones
    //! (`Op256::dot_nibbles`); each removes its offset at the end. Each op is a few
    //! instructions; the loops, layouts and epilogues are shared, so the variants this CPU
    //! cannot run (AVX-VNNI here) differ from tested code only in that op.
    use std::arch::x86_64::*;

    /// The multiply-accumulate on 512-bit lanes: `acc += Σ_4 a_u8 · w_i8` per i32 lane.
    ///
    /// # Safety
    /// Every method needs the CPU features of the kernel that instantiates it (they are
    /// register-only operations: nothing is read or written through a pointer).
    trait Op512 {
        /// Whether `dot` works on biased activations (then `Σ w · 128` is subtracted at the end).
        const BIASED: bool;
        type Act: Copy;
        /// Prepare a broadcast activation quad (biased unsigned bytes).
        ///
        /// # Safety
        /// The CPU has the implementing kernel's features.
        unsafe fn prep(quad: __m512i) -> Self::Act;
        /// `acc += Σ_4 a · w` per i32 lane.
        ///
        /// # Safety
        /// As `prep`.
        unsafe fn dot(acc: __m512i, a: Self::Act, w: __m512i) -> __m512i;
    }

    struct Vnni512;
    impl Op512 for Vnni512 {
        const BIASED: bool = true;
        type Act = __m512i;
        #[inline(always)]
        unsafe fn prep(quad: __m512i) -> __m512i {
            quad
        }
        #[inline(always)]
        unsafe fn dot(acc: __m512i, a: __m512i, w: __m512i) -> __m512i {
            // SAFETY: only inlined into functions with avx512vnni enabled.
            unsafe { _mm512_dpbusd_epi32(acc, a, w) }
        }
    }

    /// AVX-512BW without VNNI: the sign trick (AVX-512 has no `vpsignb`: negate under a mask).
    struct Bw512;
    impl Op512 for Bw512 {
        const BIASED: bool = false;
        type Act = (__m512i, __mmask64);
        #[inline(always)]
        unsafe fn prep(quad: __m512i) -> Self::Act {
            // SAFETY: only inlined into functions with avx512bw enabled.
            unsafe {
                let x = _mm512_xor_si512(quad, _mm512_set1_epi8(-128));
                (_mm512_abs_epi8(x), _mm512_movepi8_mask(x))
            }
        }
        #[inline(always)]
        unsafe fn dot(acc: __m512i, (ax, neg): Self::Act, w: __m512i) -> __m512i {
            // SAFETY: as above.
            unsafe {
                let sw = _mm512_mask_sub_epi8(w, neg, _mm512_setzero_si512(), w);
                let p16 = _mm512_maddubs_epi16(ax, sw);
                _mm512_add_epi32(acc, _mm512_madd_epi16(p16, _mm512_set1_epi16(1)))
            }
        }
    }

    /// The same on 256-bit lanes.
    ///
    /// # Safety
    /// As [`Op512`].
    trait Op256 {
        const BIASED: bool;
        type Act: Copy;
        /// Prepare a broadcast activation quad.
        ///
        /// # Safety
        /// The CPU has the implementing kernel's features.
        unsafe fn prep(quad: __m256i) -> Self::Act;
        /// `acc += Σ_4 a · w` per i32 lane.
        ///
        /// # Safety
        /// As `prep`.
        unsafe fn dot(acc: __m256i, a: Self::Act, w: __m256i) -> __m256i;
        /// The operand for the activation quad at `off` of the row at `row` (`k` values a
        /// copy): by default prepared from the biased copy.
        ///
        /// # Safety
        /// An activation row of `ACT_COPIES · k` bytes at `row`; `off + 4 ≤ k`.
        #[inline(always)]
        unsafe fn prep_at(row: *const u8, _k: usize, off: usize) -> Self::Act {
            // SAFETY: forwarded.
            unsafe { Self::prep(quad256(row.add(off))) }
        }
        /// Whether the AMXINT4 loop hands `dot_nibbles` the nibbles as unsigned `v + 8` and the
        /// *signed* activations (then `8·Σa` comes off at the end), rather than signed nibbles
        /// and the biased activations (then `128·Σv`, the row sums).
        const NIBBLES_UNSIGNED: bool = false;
        /// Adds the products of one weight line's nibbles to `partial`, a running sum over up
        /// to [`NIBBLE_LINES_PER_WIDEN`] lines: signed `v` (|v| ≤ 8) against biased
        /// activations, or, with [`Op256::NIBBLES_UNSIGNED`], unsigned `v + 8` against signed
        /// activations. What a partial holds (i16 or i32 lanes) is the op's business.
        ///
        /// # Safety
        /// As `prep`.
        unsafe fn dot_nibbles(
            partial: __m256i,
            a_lo: __m256i,
            w_lo: __m256i,
            a_hi: __m256i,
            w_hi: __m256i,
        ) -> __m256i;
        /// `acc + partial` as i32 lanes (each i32 lane: four inputs of one output).
        ///
        /// # Safety
        /// As `prep`.
        unsafe fn widen_nibbles(acc: __m256i, partial: __m256i) -> __m256i;
    }

    /// Weight lines whose nibble products [`Op256::dot_nibbles`] may sum before
    /// [`Op256::widen_nibbles`]: with AVX2 a partial is i16 lanes, each gaining at most
    /// 2 · 2 · 15 · 128 = 7680 per line, so four lines stay below 32768.
    const NIBBLE_LINES_PER_WIDEN: usize = 4;

    /// AVX2: the sign trick with `vpsignb`.
    struct Avx2Sign;
    impl Op256 for Avx2Sign {
        const BIASED: bool = false;
        type Act = (__m256i, __m256i);
        #[inline(always)]
        unsafe fn prep(quad: __m256i) -> Self::Act {
            // SAFETY: only inlined into functions with avx2 enabled.
            unsafe {
                let x = _mm256_xor_si256(quad, _mm256_set1_epi8(-128));
                (_mm256_abs_epi8(x), x)
            }
        }
        #[inline(always)]
        unsafe fn dot(acc: __m256i, (ax, x): Self::Act, w: __m256i) -> __m256i {
            // SAFETY: as above.
            unsafe {
                let p16 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w, x));
                _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)))
            }
        }
        /// |a| and a broadcast from their copies: no per-line work.
        #[inline(always)]
        unsafe fn prep_at(row: *const u8, k: usize, off: usize) -> Self::Act {
            // SAFETY: the signed copy starts at k, the absolute one at 2k (trait contract).
            unsafe { (quad256(row.add(2 * k + off)), quad256(row.add(k + off))) }
        }
        /// Unsigned nibbles: decoding them is two ops fewer per vector than sign-extending.
        const NIBBLES_UNSIGNED: bool = true;
        /// `vpmaddubsw` takes the nibbles (0..=15) as its unsigned operand and the signed
        /// activations as the other: |u·a| ≤ 15·128, so the pair sums of both nibbles of
        /// several lines share one i16 lane, and one `vpmaddwd` per
        /// [`NIBBLE_LINES_PER_WIDEN`] lines widens them (the multiply ports were the limit).
        #[inline(always)]
        unsafe fn dot_nibbles(
            partial: __m256i,
            a_lo: __m256i,
            w_lo: __m256i,
            a_hi: __m256i,
            w_hi: __m256i,
        ) -> __m256i {
            // SAFETY: only inlined into functions with avx2 enabled.
            unsafe {
                let p = _mm256_add_epi16(
                    _mm256_maddubs_epi16(w_lo, a_lo),
                    _mm256_maddubs_epi16(w_hi, a_hi),
                );
                _mm256_add_epi16(partial, p)
            }
        }
        #[inline(always)]
        unsafe fn widen_nibbles(acc: __m256i, partial: __m256i) -> __m256i {
            // SAFETY: as above.
            unsafe { _mm256_add_epi32(acc, _mm256_madd_epi16(partial, _mm256_set1_epi16(1))) }
        }
    }

    /// AVX-VNNI (VEX-encoded `vpdpbusd`, CPUs with AVX2 but no AVX-512).
    struct AvxVnni;
    impl Op256 for AvxVnni {
        const BIASED: bool = true;
        type Act = __m256i;
        #[inline(always)]
        unsafe fn prep(quad: __m256i) -> __m256i {
            quad
        }
        #[inline(always)]
        unsafe fn dot(acc: __m256i, a: __m256i, w: __m256i) -> __m256i {
            // SAFETY: only inlined into functions with avxvnni enabled.
            unsafe { _mm256_dpbusd_avx_epi32(acc, a, w) }
        }
        /// A partial is already i32 lanes.
        #[inline(always)]
        unsafe fn dot_nibbles(
            partial: __m256i,
            a_lo: __m256i,
            w_lo: __m256i,
            a_hi: __m256i,
            w_hi: __m256i,
        ) -> __m256i {
            // SAFETY: as above.
            unsafe {
                _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(partial, a_lo, w_lo), a_hi, w_hi)
            }
        }
        #[inline(always)]
        unsafe fn widen_nibbles(acc: __m256i, partial: __m256i) -> __m256i {
            // SAFETY: as above.
            unsafe { _mm256_add_epi32(acc, partial) }
        }
    }

    /// Broadcast the 4 activation bytes at `p`.
    ///
    /// # Safety
    /// 4 readable bytes at `p`; AVX-512F in the caller.
    #[inline(always)]
    unsafe fn quad512(p: *const u8) -> __m512i {
        // SAFETY: the contract above.
        unsafe { _mm512_set1_epi32((p as *const i32).read_unaligned()) }
    }

    /// # Safety
    /// 4 readable bytes at `p`; AVX2 in the caller.
    #[inline(always)]
    unsafe fn quad256(p: *const u8) -> __m256i {
        // SAFETY: the contract above.
        unsafe { _mm256_set1_epi32((p as *const i32).read_unaligned()) }
    }

    /// AMXINT8 group, 512-bit: one multiply-accumulate per (row, half, input quad).
    ///
    /// # Safety
    /// The [`super::Int8DotFn`] contract; the caller enables the op's features.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // register blocks read best as indexed loops
    unsafe fn int8_512<const R: usize, O: Op512>(
        a: &[*const u8],
        k: usize,
        g: *const u8,
        s: *const i32,
        o: *mut i32,
    ) {
        // SAFETY: tile t, half h, line w inside the group; quad 16t+w in each row.
        unsafe {
            let pf = crate::kernels::prefetch::distance();
            let mut acc = [[_mm512_setzero_si512(); 2]; R];
            // Addresses strictly ascending (half 0's 16 lines, then half 1's): reading both
            // halves in step made two streams 1 KiB apart and halved the DRAM rate (measured).
            for t in 0..k / 64 {
                for h in 0..2 {
                    for w in 0..16 {
                        let line = g.add(t * 2048 + h * 1024 + w * 64);
                        crate::kernels::prefetch::ahead(line, pf);
                        let wv = _mm512_loadu_si512(line as *const __m512i);
                        for r in 0..R {
                            let x = O::prep(quad512(a[r].add(t * 64 + w * 4)));
                            acc[r][h] = O::dot(acc[r][h], x, wv);
                        }
                    }
                }
            }
            store512::<R, O>(&acc, s, o)
        }
    }

    /// AMXINT4 group, 512-bit: each 64-byte line gives two int8 operands, the low nibbles
    /// shifted up (inputs 4w.. of the 128-input tile) and the high nibbles masked (64+4w..).
    ///
    /// # Safety
    /// The [`super::Int4DotFn`] contract; the caller enables the op's features.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)]
    unsafe fn int4_512<const R: usize, O: Op512>(
        a: &[*const u8],
        k: usize,
        g: *const u8,
        s: *const i32,
        o: *mut i32,
    ) {
        // SAFETY: tile t (2048 bytes), half h, line w inside the group; inputs 128t + 4w and
        // 128t + 64 + 4w inside each row.
        unsafe {
            // Low- and high-nibble products in separate chains, so one half already has the
            // parallelism the core needs and the halves can stay in address order.
            let mut acc = [[_mm512_setzero_si512(); 2]; R];
            let mut acc_hi = [[_mm512_setzero_si512(); 2]; R];
            let high = _mm512_set1_epi8(0xF0u8 as i8);
            let pf = crate::kernels::prefetch::distance();
            for t in 0..k / 128 {
                for h in 0..2 {
                    for w in 0..16 {
                        let line = g.add(t * 2048 + h * 1024 + w * 64);
                        crate::kernels::prefetch::ahead(line, pf);
                        let b = _mm512_loadu_si512(line as *const __m512i);
                        let lo = _mm512_and_si512(_mm512_slli_epi16::<4>(b), high);
                        let hi = _mm512_and_si512(b, high);
                        for r in 0..R {
                            let base = a[r].add(t * 128 + w * 4);
                            acc[r][h] = O::dot(acc[r][h], O::prep(quad512(base)), lo);
                            acc_hi[r][h] = O::dot(acc_hi[r][h], O::prep(quad512(base.add(64))), hi);
                        }
                    }
                    // Compiler barrier: without it LLVM interleaves the two halves' loads,
                    // two streams 1 KiB apart, which measured at half the DRAM rate.
                    std::arch::asm!("", options(nostack, preserves_flags));
                }
            }
            for (row, hi) in acc.iter_mut().zip(&acc_hi) {
                for (v, x) in row.iter_mut().zip(hi) {
                    *v = _mm512_add_epi32(*v, *x);
                }
            }
            store512::<R, O>(&acc, s, o)
        }
    }

    /// Store the accumulators; for biased ops `out = acc − 128·row_sum` undoes the +128.
    ///
    /// # Safety
    /// AVX-512F in the caller; `s` points to 32 row sums, `o` to `32·R` i32.
    #[inline(always)]
    unsafe fn store512<const R: usize, O: Op512>(
        acc: &[[__m512i; 2]; R],
        s: *const i32,
        o: *mut i32,
    ) {
        // SAFETY: the contract above.
        unsafe {
            let bias = if O::BIASED {
                [
                    _mm512_slli_epi32::<7>(_mm512_loadu_si512(s as *const __m512i)),
                    _mm512_slli_epi32::<7>(_mm512_loadu_si512(s.add(16) as *const __m512i)),
                ]
            } else {
                [_mm512_setzero_si512(); 2]
            };
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

    /// AMXINT8 group, 256-bit: each line is two 32-byte halves of 8 outputs × 4 inputs; four
    /// 8-output quarters of the 32 outputs keep 4R accumulators in registers.
    ///
    /// # Safety
    /// The [`super::Int8DotFn`] contract; the caller enables the op's features.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)]
    unsafe fn int8_256<const R: usize, O: Op256>(
        a: &[*const u8],
        k: usize,
        g: *const u8,
        s: *const i32,
        o: *mut i32,
    ) {
        // SAFETY: as in the 512-bit loop; addresses ascend as there.
        unsafe {
            let pf = crate::kernels::prefetch::distance();
            let mut acc = [[_mm256_setzero_si256(); 4]; R];
            for t in 0..k / 64 {
                for h in 0..2 {
                    for w in 0..16 {
                        let line = g.add(t * 2048 + h * 1024 + w * 64);
                        crate::kernels::prefetch::ahead(line, pf);
                        let ws = [
                            _mm256_loadu_si256(line as *const __m256i),
                            _mm256_loadu_si256(line.add(32) as *const __m256i),
                        ];
                        for r in 0..R {
                            let x = O::prep_at(a[r], k, t * 64 + w * 4);
                            for q in 0..2 {
                                acc[r][2 * h + q] = O::dot(acc[r][2 * h + q], x, ws[q]);
                            }
                        }
                    }
                }
            }
            store256::<R, O>(&acc, s, o)
        }
    }

    /// AMXINT4 group, 256-bit: `(b ^ 0x88) & 0x0F` is `v + 8` (once per weight vector for all
    /// rows). With [`Op256::NIBBLES_UNSIGNED`] that goes against the signed activations and
    /// `out = 16·Σ a·(v + 8) − 128·Σ a`; otherwise the nibbles are sign-extended (`− 8`) for
    /// the biased activations and `out = 16·Σ a_u8·v − 128·Σ 16·v`. Either is the scalar
    /// twin's integer; neither needs a per-row sign op.
    ///
    /// # Safety
    /// The [`super::Int4DotFn`] contract; the caller enables the op's features.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)]
    unsafe fn int4_256<const R: usize, O: Op256>(
        a: &[*const u8],
        k: usize,
        g: *const u8,
        s: *const i32,
        o: *mut i32,
    ) {
        // SAFETY: tile t, half h, line w inside the group (2048-byte tiles); inputs
        // 128t + 4w (+64) inside each row's biased copy.
        unsafe {
            let flip = _mm256_set1_epi8(0x88u8 as i8);
            let nibble = _mm256_set1_epi8(0x0F);
            let eight = _mm256_set1_epi8(8);
            let pf = crate::kernels::prefetch::distance();
            // The activation copy the op multiplies: signed (at k) or biased (at 0).
            let act_copy = if O::NIBBLES_UNSIGNED { k } else { 0 };
            let mut acc = [[_mm256_setzero_si256(); 4]; R];
            for t in 0..k / 128 {
                for h in 0..2 {
                    for w0 in (0..16).step_by(NIBBLE_LINES_PER_WIDEN) {
                        let mut partial = [[_mm256_setzero_si256(); 2]; R];
                        for w in w0..w0 + NIBBLE_LINES_PER_WIDEN {
                            let line = g.add(t * 2048 + h * 1024 + w * 64);
                            crate::kernels::prefetch::ahead(line, pf);
                            let mut lo = [_mm256_setzero_si256(); 2];
                            let mut hi = [_mm256_setzero_si256(); 2];
                            for half in 0..2 {
                                let b = _mm256_loadu_si256(line.add(half * 32) as *const __m256i);
                                let x = _mm256_xor_si256(b, flip);
                                lo[half] = _mm256_and_si256(x, nibble);
                                hi[half] = _mm256_and_si256(_mm256_srli_epi16::<4>(x), nibble);
                                if !O::NIBBLES_UNSIGNED {
                                    lo[half] = _mm256_sub_epi8(lo[half], eight);
                                    hi[half] = _mm256_sub_epi8(hi[half], eight);
                                }
                            }
                            for r in 0..R {
                                let act = a[r].add(act_copy + t * 128 + w * 4);
                                let (a_lo, a_hi) = (quad256(act), quad256(act.add(64)));
                                for half in 0..2 {
                                    partial[r][half] = O::dot_nibbles(
                                        partial[r][half],
                                        a_lo,
                                        lo[half],
                                        a_hi,
                                        hi[half],
                                    );
                                }
                            }
                        }
                        for r in 0..R {
                            for half in 0..2 {
                                let q = 2 * h + half;
                                acc[r][q] = O::widen_nibbles(acc[r][q], partial[r][half]);
                            }
                        }
                    }
                    // Keep the halves' loads in address order (see `int4_512`).
                    std::arch::asm!("", options(nostack, preserves_flags));
                }
            }
            for (r, row) in acc.iter().enumerate() {
                let act_sum = if O::NIBBLES_UNSIGNED {
                    signed_sum256(a[r].add(k), k)
                } else {
                    _mm256_setzero_si256()
                };
                for (q, v) in row.iter().enumerate() {
                    let offset = if O::NIBBLES_UNSIGNED {
                        act_sum
                    } else {
                        _mm256_loadu_si256(s.add(q * 8) as *const __m256i)
                    };
                    _mm256_storeu_si256(
                        o.add(r * 32 + q * 8) as *mut __m256i,
                        _mm256_sub_epi32(
                            _mm256_slli_epi32::<4>(*v),
                            _mm256_slli_epi32::<7>(offset),
                        ),
                    );
                }
            }
        }
    }

    /// `Σ` of the `k` signed bytes at `p` (`k % 32 == 0`), in every i32 lane.
    ///
    /// # Safety
    /// `k` readable bytes at `p`; AVX2 in the caller.
    #[inline(always)]
    unsafe fn signed_sum256(p: *const u8, k: usize) -> __m256i {
        // SAFETY: the contract above.
        unsafe {
            let ones8 = _mm256_set1_epi8(1);
            let ones16 = _mm256_set1_epi16(1);
            let mut acc = _mm256_setzero_si256();
            for i in (0..k).step_by(32) {
                let v = _mm256_loadu_si256(p.add(i) as *const __m256i);
                let pairs = _mm256_maddubs_epi16(ones8, v);
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones16));
            }
            // Horizontal sum, left in every lane.
            let acc = _mm256_add_epi32(acc, _mm256_shuffle_epi32::<0b01_00_11_10>(acc));
            let acc = _mm256_add_epi32(acc, _mm256_shuffle_epi32::<0b10_11_00_01>(acc));
            _mm256_add_epi32(acc, _mm256_permute2x128_si256::<0x01>(acc, acc))
        }
    }

    /// # Safety
    /// AVX2 in the caller; `s` points to 32 row sums, `o` to `32·R` i32.
    #[inline(always)]
    unsafe fn store256<const R: usize, O: Op256>(
        acc: &[[__m256i; 4]; R],
        s: *const i32,
        o: *mut i32,
    ) {
        // SAFETY: the contract above; quarter q = outputs 8q..8q+8.
        unsafe {
            for (r, row) in acc.iter().enumerate() {
                for (q, v) in row.iter().enumerate() {
                    let bias = if O::BIASED {
                        _mm256_slli_epi32::<7>(_mm256_loadu_si256(s.add(q * 8) as *const __m256i))
                    } else {
                        _mm256_setzero_si256()
                    };
                    _mm256_storeu_si256(
                        o.add(r * 32 + q * 8) as *mut __m256i,
                        _mm256_sub_epi32(*v, bias),
                    );
                }
            }
        }
    }

    /// [`super::row_sums_fast`] with AVX2: each 32-bit word of a line is one row's four
    /// bytes, summed by `vpmaddubsw`/`vpmaddwd` against ones (INT4: both nibbles moved to the
    /// top of a byte, i.e. `16·v`, summed the same way).
    ///
    /// # Safety
    /// AVX2 available; `group` is whole 2048-byte tiles.
    #[target_feature(enable = "avx2")]
    #[allow(clippy::needless_range_loop)] // (half, quarter) blocks read best as indices
    pub unsafe fn row_sums_avx2(group: &[u8], int4: bool) -> [i32; 32] {
        let ones8 = _mm256_set1_epi8(1);
        let ones16 = _mm256_set1_epi16(1);
        let high = _mm256_set1_epi8(0xF0u8 as i8);
        // acc[h][q]: rows 16h + 8q .. 16h + 8q + 8 (one 32-byte half of a line each).
        let mut acc = [[_mm256_setzero_si256(); 2]; 2];
        // Pair sums of 16 lines (one half's run) stay in i16: |pair| ≤ 2·128 per byte vector,
        // so ≤ 16·2·256 = 8192 with INT4's two nibble vectors; widened once per run.
        let pairs = |v: __m256i| _mm256_maddubs_epi16(ones8, v);
        for (run, lines) in group.chunks_exact(16 * 64).enumerate() {
            let h = run % 2;
            let mut acc16 = [_mm256_setzero_si256(); 2];
            for line in lines.chunks_exact(64) {
                for q in 0..2 {
                    // SAFETY: 32 bytes inside the 64-byte line.
                    let v =
                        unsafe { _mm256_loadu_si256(line.as_ptr().add(32 * q) as *const __m256i) };
                    let p = if int4 {
                        let lo = _mm256_and_si256(_mm256_slli_epi16::<4>(v), high);
                        let hi = _mm256_and_si256(v, high);
                        _mm256_add_epi16(pairs(lo), pairs(hi))
                    } else {
                        pairs(v)
                    };
                    acc16[q] = _mm256_add_epi16(acc16[q], p);
                }
            }
            for q in 0..2 {
                acc[h][q] = _mm256_add_epi32(acc[h][q], _mm256_madd_epi16(acc16[q], ones16));
            }
        }
        let mut sums = [0i32; 32];
        for h in 0..2 {
            for q in 0..2 {
                // SAFETY: eight i32 into eight array elements.
                unsafe {
                    _mm256_storeu_si256(
                        sums.as_mut_ptr().add(16 * h + 8 * q) as *mut __m256i,
                        acc[h][q],
                    )
                };
            }
        }
        sums
    }

    /// Entry points: a `#[target_feature]` wrapper per (loop, op), dispatched on the row count.
    macro_rules! entry {
        ($(#[$doc:meta])* $name:ident, $inner:ident, $body:ident, $op:ty, $features:literal,
         $label:literal; $($r:literal)+) => {
            $(#[$doc])*
            ///
            /// # Safety
            /// The CPU has the features named in the wrapper; the [`super::Int8DotFn`] contract.
            pub unsafe fn $name(a: &[*const u8], k: usize, g: *const u8, s: *const i32, o: *mut i32) {
                // SAFETY: forwarded.
                unsafe {
                    crate::kernels::dispatch_rows!($inner, $label, a, (a, k, g, s, o); $($r)+)
                }
            }

            /// The kernel for exactly `R` rows.
            ///
            /// # Safety
            /// As the entry above, with `a.len() == R`.
            #[target_feature(enable = $features)]
            unsafe fn $inner<const R: usize>(
                a: &[*const u8],
                k: usize,
                g: *const u8,
                s: *const i32,
                o: *mut i32,
            ) {
                // SAFETY: forwarded; the features are enabled here.
                unsafe { $body::<R, $op>(a, k, g, s, o) }
            }
        };
    }

    entry!(
        /// AMXINT8 with AVX512-VNNI.
        dot_avx512vnni, int8_vnni512, int8_512, Vnni512, "avx512f,avx512bw,avx512vnni",
        "avx512vnni int8 dot"; 1 2 3 4 5 6 7 8
    );
    entry!(
        /// AMXINT4 with AVX512-VNNI.
        dot_int4_avx512vnni, int4_vnni512, int4_512, Vnni512, "avx512f,avx512bw,avx512vnni",
        "avx512vnni int4 dot"; 1 2 3 4 5 6 7 8
    );
    entry!(
        /// AMXINT8 with AVX-512BW (no VNNI).
        dot_avx512bw, int8_bw512, int8_512, Bw512, "avx512f,avx512bw",
        "avx512bw int8 dot"; 1 2 3 4 5 6
    );
    entry!(
        /// AMXINT4 with AVX-512BW (no VNNI).
        dot_int4_avx512bw, int4_bw512, int4_512, Bw512, "avx512f,avx512bw",
        "avx512bw int4 dot"; 1 2 3 4 5 6
    );
    entry!(
        /// AMXINT8 with AVX-VNNI (256-bit).
        dot_avxvnni, int8_avxvnni, int8_256, AvxVnni, "avx2,avxvnni",
        "avxvnni int8 dot"; 1 2 3 4
    );
    entry!(
        /// AMXINT4 with AVX-VNNI (256-bit).
        dot_int4_avxvnni, int4_avxvnni, int4_256, AvxVnni, "avx2,avxvnni",
        "avxvnni int4 dot"; 1 2 3 4
    );
    entry!(
        /// AMXINT8 with AVX2 (sign trick).
        dot_avx2, int8_avx2, int8_256, Avx2Sign, "avx2", "avx2 int8 dot"; 1 2 3 4
    );
    entry!(
        /// AMXINT4 with AVX2 (unsigned nibbles against signed activations, i16 partials).
        dot_int4_avx2, int4_avx2, int4_256, Avx2Sign, "avx2", "avx2 int4 dot"; 1 2 3 4
    );
}

#[cfg(target_arch = "x86_64")]
pub use x86::{
    dot_avx2, dot_avx512bw, dot_avx512vnni, dot_avxvnni, dot_int4_avx2, dot_int4_avx512bw,
    dot_int4_avx512vnni, dot_int4_avxvnni,
};

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
        /// The largest drawn magnitude (127 or 7).
        max_draw: i8,
        /// Multiplier from a drawn value to the weight the dot product uses.
        weight: i64,
        pack: fn(&[i8], usize, usize) -> crate::Result<Vec<u8>>,
        sums: fn(&[u8], usize) -> [i32; 32],
        twin: Int8DotFn,
    }

    const INT8: Format = Format {
        ks: &[64, 192, 1024],
        draw: |rng| (rng.below(255) as i32 - 127) as i8, // -128 never occurs
        max_draw: 127,
        weight: 1,
        pack: pack_amx_int8,
        sums: group_row_sums,
        twin: dot_scalar,
    };

    const INT4: Format = Format {
        ks: &[128, 384],
        draw: |rng| (rng.below(15) as i32 - 7) as i8,
        max_draw: 7,
        weight: 16,
        pack: crate::quant::pack_amx_int4,
        sums: group_row_sums_int4,
        twin: dot_int4_scalar,
    };

    /// One case's weights and biased activations: `None` draws at random; `Some(±1)` is the
    /// format's largest weight of that sign everywhere, `Some(x)` an activation of `x`
    /// everywhere (the largest products, where an i16 partial sum could overflow).
    const CASES: [(Option<i8>, Option<u8>); 5] = [
        (None, None),
        (Some(1), Some(255)),
        (Some(1), Some(1)),
        (Some(-1), Some(255)),
        (Some(-1), Some(1)),
    ];

    /// `f` equals the format's scalar twin exactly, and the twin equals plain row-major
    /// arithmetic, on random data over the quantizers' whole range and at its extremes.
    fn check(fmt: &Format, f: Int8DotFn, rows_max: usize, name: &str) {
        // With software prefetching on (it must not change a result).
        crate::kernels::prefetch::set(crate::kernels::prefetch::CANDIDATE);
        let mut rng = Rng::new(99);
        for &k in fmt.ks {
            for case in CASES {
                check_case(fmt, f, rows_max, name, k, case, &mut rng);
            }
        }
    }

    fn check_case(
        fmt: &Format,
        f: Int8DotFn,
        rows_max: usize,
        name: &str,
        k: usize,
        (weight_sign, act): (Option<i8>, Option<u8>),
        rng: &mut Rng,
    ) {
        let w: Vec<i8> = (0..32 * k)
            .map(|_| weight_sign.map_or_else(|| (fmt.draw)(rng), |sign| sign * fmt.max_draw))
            .collect();
        let group = (fmt.pack)(&w, 32, k).unwrap();
        let sums = (fmt.sums)(&group, k);
        for rows in 1..=rows_max {
            let a: Vec<Vec<u8>> = (0..rows)
                .map(|_| {
                    let biased: Vec<u8> = (0..k)
                        .map(|_| act.unwrap_or_else(|| 1 + rng.below(255) as u8))
                        .collect();
                    activation_row(&biased)
                })
                .collect();
            let ptrs: Vec<*const u8> = a.iter().map(|r| r.as_ptr()).collect();
            let mut got = vec![0i32; rows * 32];
            let mut want = vec![0i32; rows * 32];
            // SAFETY: activation rows of the right size, a whole tiled group and its sums,
            // rows·32 outputs; each kernel runs only where its ISA was detected.
            unsafe {
                f(&ptrs, k, group.as_ptr(), sums.as_ptr(), got.as_mut_ptr());
                (fmt.twin)(&ptrs, k, group.as_ptr(), sums.as_ptr(), want.as_mut_ptr());
            }
            assert_eq!(
                got, want,
                "{name} rows={rows} k={k} case {weight_sign:?}/{act:?}"
            );
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

    #[test]
    fn fast_row_sums_equal_the_layout_oracle() {
        for fmt in [&INT8, &INT4] {
            let mut rng = Rng::new(5);
            for &k in fmt.ks {
                let w: Vec<i8> = (0..32 * k).map(|_| (fmt.draw)(&mut rng)).collect();
                let group = (fmt.pack)(&w, 32, k).unwrap();
                let want = (fmt.sums)(&group, k);
                assert_eq!(row_sums_fast(&group, k, fmt.weight == 16), want);
                assert_eq!(row_sums_scalar(&group, k, fmt.weight == 16), want);
            }
        }
        // Extreme bytes (every value or nibble −128/−8 or +127/+7) over a long row: the fast
        // path's i16 partial sums must not overflow.
        for int4 in [false, true] {
            let k = 4096;
            let bytes = if int4 { 16 * k } else { 32 * k };
            for b in [0x80u8, 0x88, 0x7F, 0x77, 0xFF] {
                let group = vec![b; bytes];
                assert_eq!(
                    row_sums_fast(&group, k, int4),
                    row_sums_scalar(&group, k, int4),
                    "byte {b:#x} int4={int4}"
                );
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
            if std::is_x86_feature_detected!("avx512bw") {
                check(&INT4, dot_int4_avx512bw, 6, "avx512bw");
            }
            if std::is_x86_feature_detected!("avxvnni") {
                check(&INT4, dot_int4_avxvnni, 4, "avxvnni");
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
            if std::is_x86_feature_detected!("avx512bw") {
                check(&INT8, dot_avx512bw, 6, "avx512bw");
            }
            if std::is_x86_feature_detected!("avxvnni") {
                check(&INT8, dot_avxvnni, 4, "avxvnni");
            }
            if std::is_x86_feature_detected!("avx512vnni")
                && std::is_x86_feature_detected!("avx512bw")
            {
                check(&INT8, dot_avx512vnni, ROWS, "avx512vnni");
            }
        }
    }
}
