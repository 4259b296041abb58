//! AMXINT4's kernels, reading the original's nibble layout straight (see [`crate::quant`]):
//! the tiles of AMXINT8 with each byte holding two weights `16·v`, `v ∈ [−7, 7]` (the low
//! nibble is input `4w..` of a 128-input tile, the high nibble input `64 + 4w..`).
//!
//! The scalar twin ([`dot_int4_scalar`]) indexes through the layout's own position function;
//! the vector variants are loops over the byte and nibble ops of [`crate::kernels::group_dot`]
//! and equal it exactly.
use crate::isa::Level;
use crate::kernels::group_dot::{GroupDotVariants, VectorKernel};

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
/// See [`GroupDotFn`](crate::kernels::group_dot::GroupDotFn).
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

/// The fastest vector kernel at `level` (`KT_KERNEL_CPU_VARIANT` is in `level` already).
pub fn vector_kernel(level: Level) -> VectorKernel {
    #[cfg(target_arch = "x86_64")]
    let variants = GroupDotVariants {
        scalar: dot_int4_scalar,
        avx2: x86::dot_int4_avx2,
        avx_vnni: x86::dot_int4_avxvnni,
        avx512bw: x86::dot_int4_avx512bw,
        avx512_vnni: x86::dot_int4_avx512vnni,
        avx512_vnni_rows: crate::kernels::group_dot::ROWS,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let variants = GroupDotVariants {
        scalar: dot_int4_scalar,
        avx2: dot_int4_scalar,
        avx_vnni: dot_int4_scalar,
        avx512bw: dot_int4_scalar,
        avx512_vnni: dot_int4_scalar,
        avx512_vnni_rows: crate::kernels::group_dot::ROWS,
    };
    variants.pick(level)
}

/// The byte-group family's prefetch calibration workload
/// ([`crate::kernels::calibrate::Workload`]): two streams of AMXINT4 groups of 32 rows × 2048
/// inputs through the vector kernel of `level`, one activation row.
pub fn calibration_workload(level: Level, gate: &[u8], up: &[u8]) {
    vector_kernel(level).stream_groups(32 * 2048 / 2, gate, up);
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    #[cfg(test)]
    use crate::kernels::group_dot::x86::EmulatedAvxVnni;
    use crate::kernels::group_dot::x86::{
        group_dot_entry, quad256, quad512, signed_sum256, store512, warm_line_pair512, Avx2Sign,
        AvxVnni, Bw512, Op256, Op512, Vnni512, NIBBLE_LINES_PER_WIDEN,
    };
    use crate::kernels::prefetch::{SideStream, SIDE_STREAM_ROWS};
    use std::arch::x86_64::*;

    /// AMXINT4 group, 512-bit: each 64-byte line gives two int8 operands, the low nibbles
    /// shifted up (inputs 4w.. of the 128-input tile) and the high nibbles masked (64+4w..).
    ///
    /// # Safety
    /// The [`crate::kernels::group_dot::GroupDotFn`] contract; the caller enables the op's features.
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
            let high = _mm512_set1_epi8(0xF0u8 as i8);
            let pf = crate::kernels::prefetch::distance();
            let mut side = SideStream::take_if(R >= SIDE_STREAM_ROWS);
            // A warm group (the caller set a side stream): both halves' lines in step, so each
            // activation broadcast serves two products and the loads stop limiting the
            // multiply-adds; low and high nibbles share a chain (2R chains of two).
            if side.is_set() {
                let mut acc = [[_mm512_setzero_si512(); 2]; R];
                for t in 0..k / 128 {
                    for w in 0..16 {
                        let [b0, b1] = warm_line_pair512(g.add(t * 2048 + w * 64), pf, &mut side);
                        let lo0 = _mm512_and_si512(_mm512_slli_epi16::<4>(b0), high);
                        let lo1 = _mm512_and_si512(_mm512_slli_epi16::<4>(b1), high);
                        let hi0 = _mm512_and_si512(b0, high);
                        let hi1 = _mm512_and_si512(b1, high);
                        for r in 0..R {
                            let base = a[r].add(t * 128 + w * 4);
                            let x_lo = O::prep(quad512(base));
                            let x_hi = O::prep(quad512(base.add(64)));
                            acc[r][0] = O::dot(acc[r][0], x_lo, lo0);
                            acc[r][1] = O::dot(acc[r][1], x_lo, lo1);
                            acc[r][0] = O::dot(acc[r][0], x_hi, hi0);
                            acc[r][1] = O::dot(acc[r][1], x_hi, hi1);
                        }
                    }
                }
                return store512::<R, O>(&acc, s, o);
            }
            // Low- and high-nibble products in separate chains, so one half already has the
            // parallelism the core needs and the halves can stay in address order.
            let mut acc = [[_mm512_setzero_si512(); 2]; R];
            let mut acc_hi = [[_mm512_setzero_si512(); 2]; R];
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
                    // The side stream between the halves: inside the line loop its counters
                    // cost the accumulators registers (gate/up 35 -> 40 ms, down 20 -> 27.5
                    // at 512 tokens without a stream set, Xeon AVX512-VNNI).
                    for _ in 0..16 {
                        side.step();
                    }
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

    /// AMXINT4 group, 256-bit: `(b ^ 0x88) & 0x0F` is `v + 8` (once per weight vector for all
    /// rows). With [`Op256::NIBBLES_UNSIGNED`] that goes against the signed activations and
    /// `out = 16·Σ a·(v + 8) − 128·Σ a`; otherwise the nibbles are sign-extended (`− 8`) for
    /// the biased activations and `out = 16·Σ a_u8·v − 128·Σ 16·v`. Either is the scalar
    /// twin's integer; neither needs a per-row sign op.
    ///
    /// # Safety
    /// The [`crate::kernels::group_dot::GroupDotFn`] contract; the caller enables the op's features.
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
            // No side stream: stepping it in this loop cost AMXINT4 512 tokens 54 -> 62 ms
            // (AVX2 kernels on an AMD Zen 5).
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

    group_dot_entry!(
        /// AMXINT4 with AVX512-VNNI.
        dot_int4_avx512vnni, int4_vnni512, int4_512, Vnni512, "avx512f,avx512bw,avx512vnni",
        "avx512vnni int4 dot"; 1 2 3 4 5 6 7 8
    );
    group_dot_entry!(
        /// AMXINT4 with AVX-512BW (no VNNI).
        dot_int4_avx512bw, int4_bw512, int4_512, Bw512, "avx512f,avx512bw",
        "avx512bw int4 dot"; 1 2 3 4 5 6
    );
    group_dot_entry!(
        /// AMXINT4 with AVX-VNNI (256-bit).
        dot_int4_avxvnni, int4_avxvnni, int4_256, AvxVnni, "avx2,avxvnni",
        "avxvnni int4 dot"; 1 2 3 4
    );
    #[cfg(test)]
    group_dot_entry!(
        /// The AVX-VNNI loops with an emulated `vpdpbusd`, on any AVX2 CPU (tests).
        dot_int4_avxvnni_emulated, int4_avxvnni_emulated, int4_256, EmulatedAvxVnni, "avx2",
        "emulated avxvnni int4 dot"; 1 2 3 4
    );
    group_dot_entry!(
        /// AMXINT4 with AVX2 (unsigned nibbles against signed activations, i16 partials).
        dot_int4_avx2, int4_avx2, int4_256, Avx2Sign, "avx2", "avx2 int4 dot"; 1 2 3 4
    );
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::formats::int8::twin_check::{check, Format};
    use crate::kernels::group_dot::ROWS;
    #[cfg(target_arch = "x86_64")]
    use x86::*;

    pub(crate) const INT4: Format = Format {
        ks: &[128, 384],
        draw: |rng| (rng.below(15) as i32 - 7) as i8,
        max_draw: 7,
        weight: 16,
        pack: crate::quant::pack_amx_int4,
        sums: group_row_sums_int4,
        twin: dot_int4_scalar,
    };

    #[test]
    fn fast_row_sums_equal_the_layout_oracle() {
        crate::formats::int8::kernels::tests::check_row_sums(&INT4, true);
    }

    /// The AMX tile program for this layout: emulated everywhere, on the tiles where the CPU
    /// and OS allow them.
    #[test]
    fn int4_tile_programs_match_the_scalar_twin() {
        let draw = |rng: &mut crate::rng::Rng| (rng.below(15) as i32 - 7) as i8;
        let check = |tile: crate::kernels::group_dot::GroupDotFn| {
            crate::kernels::amx::tests::check_int(
                &[128, 384],
                draw,
                crate::quant::pack_amx_int4,
                group_row_sums_int4,
                tile,
                dot_int4_scalar,
            )
        };
        check(crate::kernels::amx::emulated::dot_int4);
        // The same program on rows packed by column block (the prefill path).
        check(crate::kernels::amx::tests::emulated_int4_via_packing);
        #[cfg(kt_amx_hw)]
        if crate::isa::allows(crate::isa::Level::Amx) {
            check(crate::kernels::amx::dot_int4);
            check(crate::kernels::amx::tests::hardware_int4_via_packing);
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
            if std::is_x86_feature_detected!("avx2") {
                // The AVX-VNNI loops, where the CPU lacks the instruction too.
                check(&INT4, x86::dot_int4_avxvnni_emulated, 4, "emulated avxvnni");
            }
            if std::is_x86_feature_detected!("avx512vnni")
                && std::is_x86_feature_detected!("avx512bw")
            {
                check(&INT4, dot_int4_avx512vnni, ROWS, "avx512vnni");
            }
        }
    }
}
