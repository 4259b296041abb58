//! AVX-512 VNNI kernels on two consecutive x8 groups at once ([`super::x8`]): one 512-bit
//! vector per token holds sixteen rows' results. The 256-bit x8 kernels leave half of an Intel
//! core's `vpdpbusd` rate unused, and on every CPU they pay one activation broadcast and one
//! block epilogue (scale conversion, two multiplies, an add) per eight rows; here each serves
//! sixteen (and Q8_0's [`q8_0_x32`], on four groups, serves each broadcast to 32 rows). The
//! integer block sums and the f32 operations per (row, token) are the x8 kernels', so the
//! results equal the scalar twin bit for bit.
use super::blocks::{Q8_0_BYTES, Q8_K_BYTES};
use super::x8::{q6_k_x8_nibbles, q6_k_x8_top, GROUP, Q4_K_X8_BYTES, Q6_K_X8_BYTES, Q8_0_X8_BYTES};
use super::x86_avx2_x8::{q6_k_values512, starts, x8_entry, PairShare};
use std::arch::x86_64::*;

/// Rows per call: two x8 groups.
pub const ROWS: usize = 2 * GROUP;

/// The sixteen-row kernel for `ty`, if it has one.
pub(super) fn x16_fn(ty: super::GgmlType) -> Option<super::RawX8Fn> {
    match ty {
        super::GgmlType::Q8_0 => Some(q8_0),
        super::GgmlType::Q4_K => Some(q4_k),
        super::GgmlType::Q6_K => Some(q6_k),
        _ => None,
    }
}

x8_entry!(
    /// Q8_0 on two consecutive x8 groups against up to [`super::X8_ROWS`] Q8_0 rows:
    /// `out[i · stride + r]` for rows r of both groups (0..16); `sums32[i]` holds row i's block
    /// sums ([`super::x8::q8_0_block_sums`], four blocks per entry), then its block scales
    /// ([`super::x8::q8_0_block_scale_bits`]).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/DQ, VNNI, AVX2, FMA and F16C available; `group` holds two x8 groups of
    /// `k/32` blocks each, each `acts[i]` a Q8_0 row of `k` values, `1 ≤ acts.len() ≤ X8_ROWS`,
    /// `out` holds `(acts.len() − 1) · stride + 16`.
    q8_0 => q8_0_rows<1>, "x16 kernel"; 1 2 3 4 5 6 7 8
);

/// Q8_0 on `2·W` consecutive x8 groups (`16·W` weight rows) for exactly `R` activation rows.
///
/// Per block and quad of inputs, each pair of groups' 32-byte weight words form one vector
/// (made unsigned once, by flipping the sign bits), and each token row's four activation
/// bytes are broadcast into the pairs' `vpdpbusd`s. The sums start at `−128 · Σx` of the
/// block, which removes the flip's `128 · Σx` exactly.
///
/// # Safety
/// As [`q8_0`] (W = 1) or [`q8_0_x32`] (W = 2) with `acts.len() == R`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
#[allow(clippy::needless_range_loop)]
unsafe fn q8_0_rows<const R: usize, const W: usize>(
    k: usize,
    groups: &[u8],
    acts: &[&[u8]],
    sums32: &[&[[i32; 4]]],
    out: &mut [f32],
    stride: usize,
) {
    let blocks = k / 32;
    let gb = blocks * Q8_0_X8_BYTES;
    assert!(groups.len() >= 2 * W * gb, "{} x8 groups needed", 2 * W);
    // Each row's entries: the block sums, then the blocks' scales as f32 bits.
    let entries = blocks.div_ceil(4);
    assert!(
        sums32.len() >= R && sums32[..R].iter().all(|s| s.len() >= 2 * entries),
        "block sums and scales missing"
    );
    let a = starts::<R>(acts, blocks * Q8_0_BYTES, out, stride, W * ROWS);
    // The same place of the next 2·W groups: the next pair of a panel, or the next panel (a
    // forward walks an expert's panels in memory order); see [`next_pair`].
    let next =
        move |p: *const u8| crate::kernels::prefetch::line_into_l1(p.wrapping_add(2 * W * gb));
    let mut share = PairShare::take();
    // SAFETY: every load is at an offset inside the checked groups and activation blocks; the
    // caller's CPU has the features enabled here.
    unsafe {
        let flip = _mm512_set1_epi8(-128);
        let mut acc = [[_mm512_setzero_ps(); R]; W];
        // The loop over a block's quads is unrolled: the activation broadcasts fold into the
        // `vpdpbusd`s as memory operands (W = 1; for W = 2 each is loaded once for two).
        // (A Zen 4 build once hoisted them into spilled vectors and ran 2x slower unrolled;
        // AMD Zen 5, `ggml_cycles`, k 2048, 32 weight rows, us per call, rolled -> unrolled:
        // 4 rows 1.20 -> 1.09, 6 rows 1.66 -> 1.48, 8 rows 2.04 -> 1.89.) With W = 1 the loads
        // bound it: this core issues two vector loads per cycle, and each `vpdpbusd` takes one
        // for its broadcast.
        let quads = 8;
        for blk in 0..blocks {
            // This block of each group (W ≤ 2).
            let mut g = [std::ptr::null::<u8>(); 4];
            for (i, g) in g.iter_mut().enumerate().take(2 * W) {
                *g = groups.as_ptr().add(i * gb + blk * Q8_0_X8_BYTES);
            }
            let ours = share.step();
            let mut isum = [[_mm512_setzero_si512(); R]; W];
            for r in 0..R {
                let block_sum = sums32[r].get_unchecked(blk / 4)[blk % 4];
                let start = _mm512_set1_epi32(-(block_sum << 7));
                for h in 0..W {
                    isum[h][r] = start;
                }
            }
            for p in 0..quads {
                let mut u = [_mm512_setzero_si512(); W];
                for h in 0..W {
                    let (at0, at1) = (g[2 * h].add(16 + 32 * p), g[2 * h + 1].add(16 + 32 * p));
                    if ours && p % 2 == 0 {
                        next(at0);
                        next(at1);
                    }
                    u[h] = _mm512_xor_si512(join256(at0, at1), flip);
                }
                for r in 0..R {
                    let q = a[r].add(blk * Q8_0_BYTES + 2 + 4 * p);
                    let x = _mm512_set1_epi32((q as *const i32).read_unaligned());
                    for h in 0..W {
                        isum[h][r] = _mm512_dpbusd_epi32(isum[h][r], u[h], x);
                    }
                }
            }
            let mut dw = [_mm512_setzero_ps(); W];
            for h in 0..W {
                dw[h] = _mm512_cvtph_ps(join128(g[2 * h], g[2 * h + 1]));
            }
            for r in 0..R {
                let da = sums32[r].get_unchecked(entries + blk / 4)[blk % 4];
                let da = _mm512_set1_ps(f32::from_bits(da as u32));
                for h in 0..W {
                    let term =
                        _mm512_mul_ps(_mm512_mul_ps(dw[h], da), _mm512_cvtepi32_ps(isum[h][r]));
                    acc[h][r] = _mm512_add_ps(acc[h][r], term);
                }
            }
        }
        for r in 0..R {
            for h in 0..W {
                _mm512_storeu_ps(out.as_mut_ptr().add(r * stride + 16 * h), acc[h][r]);
            }
        }
    }
}

/// The 32-row kernel for `ty`, if it has one.
pub(super) fn x32_fn(ty: super::GgmlType) -> Option<super::RawX8Fn> {
    match ty {
        super::GgmlType::Q8_0 => Some(q8_0_x32),
        _ => None,
    }
}

/// Most activation rows per call of [`q8_0_x32`]: two accumulators of each kind per row
/// (integer block sums and f32 totals, one per sixteen weight rows) keep 24 of the 32 vector
/// registers for six rows.
pub const X32_ROWS: usize = 6;

x8_entry!(
    /// Q8_0 on four consecutive x8 groups (a whole 32-row panel) against up to [`X32_ROWS`] Q8_0
    /// rows: `out[i · stride + r]` for rows r of the four groups (0..32). Each activation
    /// broadcast serves two `vpdpbusd`s (the sixteen-row kernel pays one broadcast load per
    /// `vpdpbusd`, and a core's two loads per cycle bound it); per (row, token) the integer block
    /// sums and the f32 operations are the x8 kernels', so the results equal the scalar twin bit
    /// for bit. `sums32` as for [`q8_0`]. AMD Zen 5, one core from cache (`ggml_cycles`, k 2048,
    /// 32 weight rows), time over the int8 multiply-add peak's, sixteen-row kernel -> this one:
    /// 5 rows 2.08 -> 1.55, 6 rows 1.98 -> 1.54, 8 rows 1.90 -> 1.58, 12 rows 1.85 -> 1.52.
    ///
    /// # Safety
    /// As [`q8_0`], with `group` holding four x8 groups, `1 ≤ acts.len() ≤ X32_ROWS` and `out`
    /// holding `(acts.len() − 1) · stride + 32`.
    q8_0_x32 => q8_0_rows<2>, "x32 kernel"; 1 2 3 4 5 6
);

x8_entry!(
    /// Q4_K on two consecutive x8 groups against up to [`super::X8_ROWS`] Q8_K rows:
    /// `out[i · stride + r]` for rows r of both groups (0..16); `sums32[i]` holds row i's
    /// 32-value sums ([`super::x8::q8_k_pair_sums`], one entry per super-block).
    ///
    /// # Safety
    /// As [`q8_0`], with `group` holding two x8 groups of `k/256` super-blocks each and Q8_K
    /// rows.
    q4_k => q4_k_rows, "x16 kernel"
);

/// Prefetches the line at the same place of the next pair of groups (`2 · gb` bytes on, `gb` the
/// bytes of one group): the next pair of a panel, or the next panel (a forward walks an expert's
/// panels in memory order). The pair's calls (one per 8 token rows) share the stream
/// ([`super::x86_avx2_x8::set_pair_share`]), so a pair's first call finds its bytes in cache
/// instead of streaming them from DRAM at its own pace. AMD Zen 4, LLAMAFILE layer, 2 threads,
/// median ms (`benches/ab_loop.py`), lines into L2: Q4_K 512 tokens 85.3 -> 74.0, 128 tokens 27.2
/// -> 19.2; Q8_0 512 tokens 83.8 -> 80.2. Into L1 rather than L2: one core, weights from DRAM, 32
/// rows (`ggml_cycles`), Q8_0 1.83-1.89x -> 1.52-1.59x the int8 peak, Q4_K 1.52-1.61x ->
/// 1.45-1.52x; in the layer Q8_0 -5%, Q4_K +3% (noise-sized). (A separate prefetch loop per block
/// made the compiler spill the Q8_0 kernel's registers. Past a part's last pair the lines lie
/// outside it: a prefetch never faults.)
#[inline(always)]
fn next_pair(gb: usize) -> impl Fn(*const u8) {
    move |p: *const u8| crate::kernels::prefetch::line_into_l1(p.wrapping_add(2 * gb))
}

/// 32 bytes at `p` and 32 at `q` as one vector.
///
/// # Safety
/// 32 readable bytes at each; AVX-512 F in the caller.
#[inline(always)]
unsafe fn join256(p: *const u8, q: *const u8) -> __m512i {
    // SAFETY: the contract above.
    unsafe {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_loadu_si256(p as *const __m256i)),
            _mm256_loadu_si256(q as *const __m256i),
        )
    }
}

/// Prefetch through `next` (the next pair's lines, [`next_pair`]) the lines at offsets `at` of
/// both groups `g0` and `g1`.
#[inline(always)]
fn next_lines<const N: usize>(
    next: &impl Fn(*const u8),
    g0: *const u8,
    g1: *const u8,
    at: [usize; N],
) {
    for off in at {
        next(g0.wrapping_add(off));
        next(g1.wrapping_add(off));
    }
}

/// 8 bytes at `p` and 8 at `q` as one vector (the two groups' per-row bytes).
///
/// # Safety
/// 8 readable bytes at each; SSE2 in the caller.
#[inline(always)]
unsafe fn join64(p: *const u8, q: *const u8) -> __m128i {
    // SAFETY: the contract above.
    unsafe {
        _mm_unpacklo_epi64(
            _mm_loadl_epi64(p as *const __m128i),
            _mm_loadl_epi64(q as *const __m128i),
        )
    }
}

/// 16 bytes at `p` and 16 at `q` as one vector.
///
/// # Safety
/// 16 readable bytes at each; AVX2 in the caller.
#[inline(always)]
unsafe fn join128(p: *const u8, q: *const u8) -> __m256i {
    // SAFETY: the contract above.
    unsafe {
        _mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_loadu_si128(p as *const __m128i)),
            _mm_loadu_si128(q as *const __m128i),
        )
    }
}

/// Q4_K on two x8 groups for exactly `R` activation rows: the x8 kernel's steps (nibbles times
/// broadcast activation words, weighed per sub-block by the rows' 6-bit scales, minima times
/// the 32-value sums per super-block) on sixteen lanes.
///
/// # Safety
/// As [`q4_k`] with `acts.len() == R`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
#[allow(clippy::needless_range_loop)]
unsafe fn q4_k_rows<const R: usize>(
    k: usize,
    groups: &[u8],
    acts: &[&[u8]],
    sums32: &[&[[i32; 4]]],
    out: &mut [f32],
    stride: usize,
) {
    let blocks = k / 256;
    let gb = blocks * Q4_K_X8_BYTES;
    assert!(groups.len() >= 2 * gb, "two x8 groups needed");
    assert!(
        sums32.len() >= R && sums32[..R].iter().all(|s| s.len() >= blocks),
        "32-value sums missing"
    );
    let a = starts::<R>(acts, blocks * Q8_K_BYTES, out, stride, ROWS);
    let next = next_pair(gb);
    let mut share = PairShare::take();
    // SAFETY: every load is at an offset inside the checked groups and activation blocks; the
    // caller's CPU has the features enabled here.
    unsafe {
        let low4 = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); R];
        for sb in 0..blocks {
            let g0 = groups.as_ptr().add(sb * Q4_K_X8_BYTES);
            let g1 = g0.add(gb);
            let ours = share.step();
            if ours {
                next_lines(&next, g0, g1, [0, 64, 128]);
            }
            let mut sumi = [_mm512_setzero_si512(); R];
            for j in 0..8 {
                let scales = _mm512_cvtepu8_epi32(join64(g0.add(32 + 8 * j), g1.add(32 + 8 * j)));
                let mut partial = [_mm512_setzero_si512(); R];
                let (n0, n1) = (g0.add(160 + j * 128), g1.add(160 + j * 128));
                if ours {
                    next_lines(&next, n0, n1, [32, 96]);
                }
                for p in 0..4 {
                    let x = join256(n0.add(p * 32), n1.add(p * 32));
                    let lo = _mm512_and_si512(x, low4);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(x), low4);
                    for r in 0..R {
                        let q = a[r].add(sb * Q8_K_BYTES + 4 + 32 * j + 8 * p);
                        let a0 = _mm512_set1_epi32((q as *const i32).read_unaligned());
                        let a1 = _mm512_set1_epi32((q.add(4) as *const i32).read_unaligned());
                        partial[r] = _mm512_dpbusd_epi32(partial[r], lo, a0);
                        partial[r] = _mm512_dpbusd_epi32(partial[r], hi, a1);
                    }
                }
                for r in 0..R {
                    sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(partial[r], scales));
                }
            }
            let d = _mm512_cvtph_ps(join128(g0, g1));
            let dmin = _mm512_cvtph_ps(join128(g0.add(16), g1.add(16)));
            let mut mins = [_mm512_setzero_si512(); 4];
            for (q, m) in mins.iter_mut().enumerate() {
                *m = _mm512_cvtepu8_epi16(join128(g0.add(96 + 16 * q), g1.add(96 + 16 * q)));
            }
            for r in 0..R {
                let ab = a[r].add(sb * Q8_K_BYTES);
                // Pair q of the row's 32-value sums in every lane, times the rows' minima pairs.
                let s32 = sums32[r].get_unchecked(sb);
                let mut summs = _mm512_madd_epi16(mins[0], _mm512_set1_epi32(s32[0]));
                for q in 1..4 {
                    let pair = _mm512_set1_epi32(s32[q]);
                    summs = _mm512_add_epi32(summs, _mm512_madd_epi16(mins[q], pair));
                }
                let da = _mm512_set1_ps((ab as *const f32).read_unaligned());
                let term = _mm512_sub_ps(
                    _mm512_mul_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(sumi[r])),
                    _mm512_mul_ps(_mm512_mul_ps(dmin, da), _mm512_cvtepi32_ps(summs)),
                );
                acc[r] = _mm512_add_ps(acc[r], term);
            }
        }
        for (r, v) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(r * stride), *v);
        }
    }
}

x8_entry!(
    /// Q6_K on two consecutive x8 groups against up to [`super::X8_ROWS`] Q8_K rows:
    /// `out[i · stride + r]` for rows r of both groups (0..16); no sums (the Q8_K rows carry
    /// their 16-value sums).
    ///
    /// # Safety
    /// As [`q8_0`], with `group` holding two x8 groups of `k/256` super-blocks each and Q8_K
    /// rows.
    q6_k => q6_k_rows, "x16 kernel"
);

/// Q6_K on two x8 groups for exactly `R` activation rows. The x8 kernel multiplies with
/// `vpmaddubsw`/`vpmaddwd` (no VNNI there); here each 6-bit value (0..63, stored with its +32
/// offset) meets its activation byte in a `vpdpbusd`, per sub-block of 16 values, and the
/// sub-block's sum is weighed by the rows' 8-bit scales with `vpmulld`. The offset leaves as
/// in the x8 kernel: minus 32 · Σ scale · (the activation's 16-value sums), so the integer
/// sum per super-block, and the results, equal the scalar twin's.
///
/// # Safety
/// As [`q6_k`] with `acts.len() == R`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
#[allow(clippy::needless_range_loop)]
unsafe fn q6_k_rows<const R: usize>(
    k: usize,
    groups: &[u8],
    acts: &[&[u8]],
    _sums32: &[&[[i32; 4]]],
    out: &mut [f32],
    stride: usize,
) {
    let blocks = k / 256;
    let gb = blocks * Q6_K_X8_BYTES;
    assert!(groups.len() >= 2 * gb, "two x8 groups needed");
    let a = starts::<R>(acts, blocks * Q8_K_BYTES, out, stride, ROWS);
    let next = next_pair(gb);
    let mut share = PairShare::take();
    // SAFETY: every load is at an offset inside the checked groups and activation blocks; the
    // caller's CPU has the features enabled here.
    unsafe {
        let mut acc = [_mm512_setzero_ps(); R];
        for sb in 0..blocks {
            let g0 = groups.as_ptr().add(sb * Q6_K_X8_BYTES);
            let g1 = g0.add(gb);
            let ours = share.step();
            if ours {
                next_lines(&next, g0, g1, [0, 64, 128]);
            }
            let mut sumi = [_mm512_setzero_si512(); R];
            for t in 0..16 {
                if ours {
                    next_lines(&next, g0, g1, [q6_k_x8_top(t), q6_k_x8_top(t) + 64]);
                }
                // Sub-block t's two steps: their top bits share one vector.
                let top = join256(g0.add(q6_k_x8_top(t)), g1.add(q6_k_x8_top(t)));
                let scales = _mm512_cvtepi8_epi32(join64(g0.add(16 + 8 * t), g1.add(16 + 8 * t)));
                let mut partial = [_mm512_setzero_si512(); R];
                for half in 0..2 {
                    let step = 2 * t + half;
                    let (w0, w1) = (g0.add(q6_k_x8_nibbles(step)), g1.add(q6_k_x8_nibbles(step)));
                    let x = join256(w0, w1);
                    let bits = if half == 0 {
                        top
                    } else {
                        _mm512_srli_epi16::<4>(top)
                    };
                    let (lo, hi) = q6_k_values512(x, bits);
                    for r in 0..R {
                        let q = a[r].add(sb * Q8_K_BYTES + 4 + 8 * step);
                        let a0 = _mm512_set1_epi32((q as *const i32).read_unaligned());
                        let a1 = _mm512_set1_epi32((q.add(4) as *const i32).read_unaligned());
                        partial[r] = _mm512_dpbusd_epi32(partial[r], lo, a0);
                        partial[r] = _mm512_dpbusd_epi32(partial[r], hi, a1);
                    }
                }
                for r in 0..R {
                    sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(partial[r], scales));
                }
            }
            let d = _mm512_cvtph_ps(join128(g0, g1));
            // Scales of sub-blocks 2q, 2q + 1 per row as 16-bit pairs (for every token).
            let mut pairs = [_mm512_setzero_si512(); 8];
            for (q, pair) in pairs.iter_mut().enumerate() {
                let scales_of = |at: usize| _mm512_cvtepi8_epi32(join64(g0.add(at), g1.add(at)));
                let (s_lo, s_hi) = (scales_of(16 + 16 * q), scales_of(24 + 16 * q));
                *pair = _mm512_or_si512(
                    _mm512_and_si512(s_lo, _mm512_set1_epi32(0xFFFF)),
                    _mm512_slli_epi32::<16>(s_hi),
                );
            }
            for r in 0..R {
                let ab = a[r].add(sb * Q8_K_BYTES);
                let mut offset = _mm512_setzero_si512();
                for (q, pair) in pairs.iter().enumerate() {
                    // The bsums of sub-blocks 2q, 2q + 1 in every lane.
                    let b = _mm512_set1_epi32((ab.add(260 + 4 * q) as *const i32).read_unaligned());
                    offset = _mm512_add_epi32(offset, _mm512_madd_epi16(*pair, b));
                }
                let s = _mm512_sub_epi32(sumi[r], _mm512_slli_epi32::<5>(offset));
                let da = _mm512_set1_ps((ab as *const f32).read_unaligned());
                let term = _mm512_mul_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(s));
                acc[r] = _mm512_add_ps(acc[r], term);
            }
        }
        for (r, v) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(r * stride), *v);
        }
    }
}
