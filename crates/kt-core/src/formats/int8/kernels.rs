//! AMXINT8's kernels, reading the original's tiled layout straight (see [`crate::quant`]): a
//! 32-row group of a `[n][k]` matrix is `k/64` tiles of 2048 bytes; in tile `t`, line `w` of
//! half `h` (64 bytes at `t*2048 + h*1024 + w*64`) holds rows `16h..16h+16` × inputs
//! `64t + 4w .. +4`. That is the `vpdpbusd` operand shape, so no repacking is needed.
//!
//! The scalar twin ([`dot_scalar`]) indexes through the layout's own offset function; the
//! vector variants (AVX2, AVX-VNNI, AVX-512BW, AVX512-VNNI) are loops over the byte ops of
//! [`crate::kernels::group_dot`] and equal it exactly. The row sums here serve AMXINT4 too
//! (same tiles, nibbles).
use crate::isa::Level;
use crate::kernels::group_dot::{GroupDotVariants, VectorKernel};

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
/// See [`GroupDotFn`](crate::kernels::group_dot::GroupDotFn).
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

/// Rows per AVX512-VNNI call: 2 accumulators a row in the many-row loop, 24 of the 32
/// registers at 12 rows; fewer blocks read each group fewer times.
pub const VNNI_ROWS: usize = 12;

/// The fastest vector kernel at `level` (`KT_KERNEL_CPU_VARIANT` is in `level` already).
pub fn vector_kernel(level: Level) -> VectorKernel {
    #[cfg(target_arch = "x86_64")]
    let variants = GroupDotVariants {
        scalar: dot_scalar,
        avx2: x86::dot_avx2,
        avx_vnni: x86::dot_avxvnni,
        avx512bw: x86::dot_avx512bw,
        avx512_vnni: x86::dot_avx512vnni,
        avx512_vnni_rows: VNNI_ROWS,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let variants = GroupDotVariants {
        scalar: dot_scalar,
        avx2: dot_scalar,
        avx_vnni: dot_scalar,
        avx512bw: dot_scalar,
        avx512_vnni: dot_scalar,
        avx512_vnni_rows: VNNI_ROWS,
    };
    variants.pick(level)
}

/// AMXINT8's prefetch calibration workload ([`crate::kernels::calibrate::Workload`]): two
/// streams of 32-row groups of 2048 int8 inputs through the one-row vector kernel.
pub fn calibration_workload(level: Level, gate: &[u8], up: &[u8]) {
    vector_kernel(level).stream_groups(32 * 2048, gate, up);
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    #[cfg(test)]
    use crate::kernels::group_dot::x86::EmulatedAvxVnni;
    use crate::kernels::group_dot::x86::{
        group_dot_entry, quad512, store256, store512, warm_line_pair512, Avx2Sign, AvxVnni, Bw512,
        Op256, Op512, Vnni512,
    };
    use crate::kernels::prefetch::{SideStream, SIDE_STREAM_ROWS};
    use std::arch::x86_64::*;

    /// AMXINT8 group, 512-bit: one multiply-accumulate per (row, half, input quad).
    ///
    /// # Safety
    /// The [`crate::kernels::group_dot::GroupDotFn`] contract; the caller enables the op's features.
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
            let pf =
                crate::kernels::prefetch::distance_of(crate::kernels::prefetch::Family::Int8Groups);
            let mut side = SideStream::take_if(R >= SIDE_STREAM_ROWS);
            let mut acc = [[_mm512_setzero_si512(); 2]; R];
            // A warm group (the caller set a side stream: a later block of the expert, or the
            // first of one with several, whose panel the previous task brought in): the order
            // of addresses matters less than the chains, so both halves go in step, 2R
            // independent sums instead of R and one broadcast per row for two products
            // (AMXINT8 512 tokens, gate/up 41-42 -> 35 ms, down 23-24 -> 20-21, Xeon
            // AVX512-VNNI). From DRAM the in-step order costs the stream rate: without the
            // warm test, 128 tokens took 17.5-18.4 ms against 12.5-12.9 (AMD Zen 5).
            if side.is_set() {
                for t in 0..k / 64 {
                    for w in 0..16 {
                        let [w0, w1] = warm_line_pair512(g.add(t * 2048 + w * 64), pf, &mut side);
                        for r in 0..R {
                            let x = O::prep(quad512(a[r].add(t * 64 + w * 4)));
                            acc[r][0] = O::dot(acc[r][0], x, w0);
                            acc[r][1] = O::dot(acc[r][1], x, w1);
                        }
                    }
                }
                return store512::<R, O>(&acc, s, o);
            }
            // Addresses strictly ascending (half 0's 16 lines, then half 1's): reading both
            // halves in step made two streams 1 KiB apart and halved the DRAM rate (measured).
            for t in 0..k / 64 {
                for h in 0..2 {
                    // Both halves take the same activation quads: left to itself the compiler
                    // broadcast them once per 64 inputs into a stack array (up to 192
                    // vectors) and read that back, a store per two multiply-adds.
                    let a = std::hint::black_box(a);
                    for w in 0..16 {
                        let line = g.add(t * 2048 + h * 1024 + w * 64);
                        crate::kernels::prefetch::ahead(line, pf);
                        side.step();
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

    /// AMXINT8 group, 256-bit: each line is two 32-byte halves of 8 outputs × 4 inputs; four
    /// 8-output quarters of the 32 outputs keep 4R accumulators in registers.
    ///
    /// # Safety
    /// The [`crate::kernels::group_dot::GroupDotFn`] contract; the caller enables the op's features.
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
            let pf =
                crate::kernels::prefetch::distance_of(crate::kernels::prefetch::Family::Int8Groups);
            let mut side = SideStream::take_if(R >= SIDE_STREAM_ROWS);
            let mut acc = [[_mm256_setzero_si256(); 4]; R];
            for t in 0..k / 64 {
                for h in 0..2 {
                    for w in 0..16 {
                        let line = g.add(t * 2048 + h * 1024 + w * 64);
                        crate::kernels::prefetch::ahead(line, pf);
                        side.step();
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

    group_dot_entry!(
        /// AMXINT8 with AVX512-VNNI.
        dot_avx512vnni, int8_vnni512, int8_512, Vnni512, "avx512f,avx512bw,avx512vnni",
        "avx512vnni int8 dot"; 1 2 3 4 5 6 7 8 9 10 11 12
    );
    group_dot_entry!(
        /// AMXINT8 with AVX-512BW (no VNNI).
        dot_avx512bw, int8_bw512, int8_512, Bw512, "avx512f,avx512bw",
        "avx512bw int8 dot"; 1 2 3 4 5 6
    );
    group_dot_entry!(
        /// AMXINT8 with AVX-VNNI (256-bit).
        dot_avxvnni, int8_avxvnni, int8_256, AvxVnni, "avx2,avxvnni",
        "avxvnni int8 dot"; 1 2 3 4
    );
    #[cfg(test)]
    group_dot_entry!(
        /// The AVX-VNNI loops with an emulated `vpdpbusd`, on any AVX2 CPU (tests).
        dot_avxvnni_emulated, int8_avxvnni_emulated, int8_256, EmulatedAvxVnni, "avx2",
        "emulated avxvnni int8 dot"; 1 2 3 4
    );
    group_dot_entry!(
        /// AMXINT8 with AVX2 (sign trick).
        dot_avx2, int8_avx2, int8_256, Avx2Sign, "avx2", "avx2 int8 dot"; 1 2 3 4
    );
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::formats::int8::twin_check::{check, Format};
    use crate::quant::pack_amx_int8;
    use crate::rng::Rng;
    #[cfg(target_arch = "x86_64")]
    use x86::*;

    pub(crate) const INT8: Format = Format {
        ks: &[64, 192, 1024],
        draw: |rng| (rng.below(255) as i32 - 127) as i8, // -128 never occurs
        max_draw: 127,
        weight: 1,
        pack: pack_amx_int8,
        sums: group_row_sums,
        twin: dot_scalar,
    };

    /// Row sums of a format's groups, fast and scalar, against its layout oracle; extreme
    /// bytes over a long row (the fast path's i16 partial sums must not overflow).
    pub(crate) fn check_row_sums(fmt: &Format, int4: bool) {
        let mut rng = Rng::new(5);
        for &k in fmt.ks {
            let w: Vec<i8> = (0..32 * k).map(|_| (fmt.draw)(&mut rng)).collect();
            let group = (fmt.pack)(&w, 32, k).unwrap();
            let want = (fmt.sums)(&group, k);
            assert_eq!(row_sums_fast(&group, k, int4), want);
            assert_eq!(row_sums_scalar(&group, k, int4), want);
        }
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

    #[test]
    fn fast_row_sums_equal_the_layout_oracle() {
        check_row_sums(&INT8, false);
    }

    /// The AMX tile program for this layout: emulated everywhere, on the tiles where the CPU
    /// and OS allow them.
    #[test]
    fn int8_tile_programs_match_the_scalar_twin() {
        let draw = |rng: &mut Rng| (rng.below(255) as i32 - 127) as i8;
        let check = |tile: crate::kernels::group_dot::GroupDotFn| {
            crate::kernels::amx::tests::check_int(
                &[64, 192, 640],
                draw,
                pack_amx_int8,
                group_row_sums,
                tile,
                dot_scalar,
            )
        };
        check(crate::kernels::amx::emulated::dot_int8);
        // The same program on rows packed by column block (the prefill path).
        check(crate::kernels::amx::tests::emulated_int8_via_packing);
        #[cfg(kt_amx_hw)]
        if crate::isa::allows(crate::isa::Level::Amx) {
            check(crate::kernels::amx::dot_int8);
            check(crate::kernels::amx::tests::hardware_int8_via_packing);
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
            if std::is_x86_feature_detected!("avx2") {
                // The AVX-VNNI loops, where the CPU lacks the instruction too.
                check(&INT8, x86::dot_avxvnni_emulated, 4, "emulated avxvnni");
            }
            if std::is_x86_feature_detected!("avx512vnni")
                && std::is_x86_feature_detected!("avx512bw")
            {
                check(&INT8, dot_avx512vnni, VNNI_ROWS, "avx512vnni");
            }
        }
    }
}
