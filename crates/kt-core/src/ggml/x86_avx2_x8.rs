//! AVX2 kernels on the x8 layout ([`super::x8`]): one 8-lane vector per token holds the eight
//! rows' results. Equal to the scalar twin bit for bit (exact integer sums, the twin's f32
//! operations lane by lane).
use super::blocks::{Q8_0_BYTES, Q8_K_BYTES};
use super::x8::{q6_k_x8_nibbles, q6_k_x8_top, GROUP, Q4_K_X8_BYTES, Q6_K_X8_BYTES, Q8_0_X8_BYTES};
#[cfg(test)]
use crate::kernels::group_dot::x86::dpbusd_avx2;
use crate::kernels::prefetch::Family::GgufBlocks as GGUF;
use std::arch::x86_64::*;

/// The byte multiply of the Q8_0 and Q4_K x8 kernels (Q6_K's sub-blocks of 16 values change
/// scale every other step, so it keeps `vpmaddubsw` pairs weighed by `vpmaddwd`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum X8Mul {
    /// `vpmaddubsw` + `vpmaddwd` (every AVX2 CPU).
    Avx2,
    /// AVX-VNNI's VEX `vpdpbusd`.
    AvxVnni,
    /// AVX512-VNNI's EVEX `vpdpbusd` on 256-bit vectors (AVX512-VL).
    Avx512Vnni,
    /// The AVX-VNNI loops with an emulated `vpdpbusd`, on any AVX2 CPU (tests).
    #[cfg(test)]
    EmulatedAvxVnni,
}

impl X8Mul {
    /// The multiply this CPU runs best at `level` (AVX-512 VNNI, else AVX-VNNI, else AVX2).
    pub(super) fn best(level: crate::isa::Level) -> X8Mul {
        if level >= crate::isa::Level::Avx512Vnni {
            X8Mul::Avx512Vnni
        } else if crate::isa::has_feature("avx_vnni") {
            X8Mul::AvxVnni
        } else {
            X8Mul::Avx2
        }
    }

    /// Whether this process may run it.
    #[cfg(test)]
    pub(super) fn usable(self) -> bool {
        match self {
            X8Mul::Avx2 => crate::isa::allows(crate::isa::Level::Avx2),
            X8Mul::AvxVnni => {
                crate::isa::allows(crate::isa::Level::Avx2) && crate::isa::has_feature("avx_vnni")
            }
            X8Mul::Avx512Vnni => crate::isa::allows(crate::isa::Level::Avx512Vnni),
            X8Mul::EmulatedAvxVnni => crate::isa::allows(crate::isa::Level::Avx2),
        }
    }

    /// Every multiply, for the twin tests.
    #[cfg(test)]
    pub(super) const ALL: [X8Mul; 4] = [
        X8Mul::Avx2,
        X8Mul::AvxVnni,
        X8Mul::Avx512Vnni,
        X8Mul::EmulatedAvxVnni,
    ];
}

/// The x8 kernel for `ty` with Q8_0's multiply `mul`, if `ty` has one.
pub(super) fn x8_fn(ty: super::GgmlType, mul: X8Mul) -> Option<super::RawX8Fn> {
    match (ty, mul) {
        (super::GgmlType::Q4_K, X8Mul::Avx2) => Some(q4_k),
        (super::GgmlType::Q4_K, X8Mul::AvxVnni) => Some(q4_k_avxvnni),
        (super::GgmlType::Q4_K, X8Mul::Avx512Vnni) => Some(q4_k_avx512vnni),
        (super::GgmlType::Q6_K, X8Mul::Avx512Vnni) => Some(q6_k_avx512),
        (super::GgmlType::Q6_K, _) => Some(q6_k),
        (super::GgmlType::Q8_0, X8Mul::Avx2) => Some(q8_0),
        (super::GgmlType::Q8_0, X8Mul::AvxVnni) => Some(q8_0_avxvnni),
        (super::GgmlType::Q8_0, X8Mul::Avx512Vnni) => Some(q8_0_avx512vnni),
        #[cfg(test)]
        (super::GgmlType::Q4_K, X8Mul::EmulatedAvxVnni) => Some(q4_k_emulated_vnni),
        #[cfg(test)]
        (super::GgmlType::Q8_0, X8Mul::EmulatedAvxVnni) => Some(q8_0_emulated_vnni),
        _ => None,
    }
}

thread_local! {
    /// See [`set_pair_share`].
    static PAIR_SHARE: std::cell::Cell<(usize, usize)> = const { std::cell::Cell::new((0, 1)) };
}

/// Have the next many-row call on this thread (sixteen-row kernels; x8 Q8_0 from 4 rows)
/// prefetch the next pair's (group's) lines of every `period`-th block only, from block
/// `phase` on: the `period` calls on a pair (one per 8 token rows) share the stream, spread
/// over all of them (the first call alone, at its own pace, would ask for them faster than
/// one core's DRAM share delivers).
pub(super) fn set_pair_share(phase: usize, period: usize) {
    PAIR_SHARE.with(|s| s.set((phase, period.max(1))));
}

/// Which blocks of a call prefetch the next pair ([`set_pair_share`]; every block unless set).
pub(super) struct PairShare {
    /// Blocks until the next one that prefetches.
    until: usize,
    period: usize,
}

impl PairShare {
    /// Every block prefetches.
    pub(super) const EVERY_BLOCK: PairShare = PairShare {
        until: 0,
        period: 1,
    };

    /// This thread's share for this call (and every block for the next call).
    #[inline(always)]
    pub(super) fn take() -> PairShare {
        let (phase, period) = PAIR_SHARE.with(|s| s.replace((0, 1)));
        PairShare {
            until: phase,
            period,
        }
    }

    /// Whether the next block prefetches.
    #[inline(always)]
    pub(super) fn step(&mut self) -> bool {
        if self.until == 0 {
            self.until = self.period - 1;
            true
        } else {
            self.until -= 1;
            false
        }
    }
}

/// The public entry of each x8 kernel: dispatch on the activation row count.
macro_rules! x8_entry {
    ($(#[$doc:meta])* $name:ident => $rows:ident) => {
        x8_entry!($(#[$doc])* $name => $rows, "x8 kernel");
    };
    ($(#[$doc:meta])* $name:ident => $rows:ident, $label:literal) => {
        x8_entry!($(#[$doc])* $name => $rows, $label; 1 2 3 4 5 6 7 8);
    };
    // For the row counts listed; `rows<G>` for a kernel generic over one more constant.
    ($(#[$doc:meta])* $name:ident => $rows:ident $(<$g:tt>)?, $label:literal; $($r:literal)+) => {
        $(#[$doc])*
        pub(super) unsafe fn $name(
            k: usize,
            group: &[u8],
            acts: &[&[u8]],
            sums32: &[&[[i32; 4]]],
            out: &mut [f32],
            stride: usize,
        ) {
            // SAFETY: forwarded.
            unsafe {
                crate::kernels::dispatch_rows!($rows $(<$g>)?, $label, acts, (k, group, acts, sums32, out, stride); $($r)+)
            }
        }
    };
}
pub(super) use x8_entry;

x8_entry!(
    /// Q4_K x8 against up to [`super::X8_ROWS`] Q8_K rows: `out[i · stride + r]` for the
    /// group's rows r; `sums32[i]` holds row i's 32-value sums, one entry per super-block.
    ///
    /// # Safety
    /// AVX2, FMA and F16C available; `group` holds `k/256` x8 super-blocks, each `acts[i]` a
    /// Q8_K row of `k` values, `1 ≤ acts.len() ≤ ROWS`, `out` holds `(acts.len() − 1) · stride + 8`.
    q4_k => q4_k_rows_avx2
);
x8_entry!(
    /// [`q4_k`] with AVX-VNNI.
    ///
    /// # Safety
    /// As [`q4_k`], and the CPU has AVX-VNNI.
    q4_k_avxvnni => q4_k_rows_avxvnni
);
x8_entry!(
    /// [`q4_k`] with AVX512-VNNI on 256-bit vectors.
    ///
    /// # Safety
    /// As [`q4_k`], and the CPU has AVX512-VNNI and AVX512-VL.
    q4_k_avx512vnni => q4_k_rows_avx512vnni
);
#[cfg(test)]
x8_entry!(
    /// [`q4_k_avxvnni`]'s loops with an emulated `vpdpbusd` (tests).
    ///
    /// # Safety
    /// As [`q4_k`].
    q4_k_emulated_vnni => q4_k_rows_emulated_vnni
);
x8_entry!(
    /// Q6_K x8 against up to [`super::X8_ROWS`] Q8_K rows (contract of [`q4_k`]; no sums).
    ///
    /// # Safety
    /// As [`q4_k`].
    q6_k => q6_k_rows
);
x8_entry!(
    /// Q8_0 x8 against up to [`super::X8_ROWS`] Q8_0 rows (contract of [`q4_k`]; no sums).
    ///
    /// # Safety
    /// As [`q4_k`].
    q8_0 => q8_0_rows_avx2
);
x8_entry!(
    /// [`q8_0`] with AVX-VNNI.
    ///
    /// # Safety
    /// As [`q4_k`], and the CPU has AVX-VNNI.
    q8_0_avxvnni => q8_0_rows_avxvnni
);
x8_entry!(
    /// [`q8_0`] with AVX512-VNNI on 256-bit vectors.
    ///
    /// # Safety
    /// As [`q4_k`], and the CPU has AVX512-VNNI and AVX512-VL.
    q8_0_avx512vnni => q8_0_rows_avx512vnni
);
#[cfg(test)]
x8_entry!(
    /// [`q8_0_avxvnni`]'s loops with an emulated `vpdpbusd` (tests).
    ///
    /// # Safety
    /// As [`q4_k`].
    q8_0_emulated_vnni => q8_0_rows_emulated_vnni
);

/// Q8_0: `Σ w·x` of signed weight and activation bytes over groups of four, added to the
/// i32 lanes of `isum`, by way of an unsigned form of the weights made once per weight vector
/// ([`SignedDot::unsigned`]) and a per-block correction ([`SignedDot::correct`]). Every
/// implementation gives the same exact sums.
trait SignedDot {
    /// Whether [`SignedDot::correct`] reads the activation blocks' sums.
    const BIASED: bool;

    /// The weights `w` as the unsigned operand.
    ///
    /// # Safety
    /// AVX2 and the implementation's feature in the caller.
    unsafe fn unsigned(w: __m256i) -> __m256i;

    /// `isum` plus the products of weights `w` (and their unsigned form `u`) with the
    /// broadcast activation word `x`.
    ///
    /// # Safety
    /// As [`SignedDot::unsigned`].
    unsafe fn acc(isum: __m256i, u: __m256i, w: __m256i, x: __m256i) -> __m256i;

    /// A finished block's sums given the sum of its 32 activation bytes.
    ///
    /// # Safety
    /// As [`SignedDot::unsigned`].
    unsafe fn correct(isum: __m256i, block_sum: i32) -> __m256i;

    /// Q4_K: `partial` gathers one sub-block's products of nibbles `lo`, `hi` (unsigned) with
    /// activation words `a0`, `a1` (signed) per lane, in the implementation's own form.
    ///
    /// # Safety
    /// As [`SignedDot::acc`].
    unsafe fn nibbles(
        partial: __m256i,
        lo: __m256i,
        a0: __m256i,
        hi: __m256i,
        a1: __m256i,
    ) -> __m256i;

    /// Q4_K: the rows' scales (eight unsigned bytes at `p`, one per lane) in the form
    /// [`SignedDot::weigh`] takes.
    ///
    /// # Safety
    /// As [`SignedDot::acc`]; 8 readable bytes at `p`.
    unsafe fn scales(p: *const u8) -> __m256i;

    /// Q4_K: `sumi` plus a finished sub-block's `partial` times the rows' `scales`.
    ///
    /// # Safety
    /// As [`SignedDot::acc`].
    unsafe fn weigh(sumi: __m256i, partial: __m256i, scales: __m256i) -> __m256i;
}

/// `|w| · (x · sign w)`: `vpmaddubsw` pairs (≤ 2·128·127, exact in i16) widened by
/// `vpmaddwd`; no correction.
struct Maddubs;
impl SignedDot for Maddubs {
    const BIASED: bool = false;
    #[inline(always)]
    unsafe fn unsigned(w: __m256i) -> __m256i {
        // SAFETY: only inlined into functions with avx2 enabled.
        unsafe { _mm256_abs_epi8(w) }
    }
    #[inline(always)]
    unsafe fn acc(isum: __m256i, u: __m256i, w: __m256i, x: __m256i) -> __m256i {
        // SAFETY: as above.
        unsafe {
            let pairs = _mm256_maddubs_epi16(u, _mm256_sign_epi8(x, w));
            _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
        }
    }
    #[inline(always)]
    unsafe fn correct(isum: __m256i, _block_sum: i32) -> __m256i {
        isum
    }
    /// 16-bit sums: `|pair| ≤ 2·15·127`, eight of them still fit an i16 lane.
    #[inline(always)]
    unsafe fn nibbles(p: __m256i, lo: __m256i, a0: __m256i, hi: __m256i, a1: __m256i) -> __m256i {
        // SAFETY: as above.
        unsafe {
            let p = _mm256_add_epi16(p, _mm256_maddubs_epi16(lo, a0));
            _mm256_add_epi16(p, _mm256_maddubs_epi16(hi, a1))
        }
    }
    /// The scales as (s, s) 16-bit pairs for `vpmaddwd`.
    #[inline(always)]
    unsafe fn scales(p: *const u8) -> __m256i {
        // SAFETY: as above; 8 bytes at p.
        unsafe { u8_pairs(p) }
    }
    #[inline(always)]
    unsafe fn weigh(sumi: __m256i, partial: __m256i, scales: __m256i) -> __m256i {
        // SAFETY: as above.
        unsafe { _mm256_add_epi32(sumi, _mm256_madd_epi16(partial, scales)) }
    }
}

/// `vpdpbusd` for both encodings: Q8_0 as `(w + 128) · x` less `128 · Σx` per block (one
/// instruction per activation row and weight vector, the sign trick's `vpsignb` gone); Q4_K's
/// sub-blocks as i32 sums weighed by `vpmulld`.
macro_rules! vnni_ops {
    ($dpbusd:ident) => {
        const BIASED: bool = true;
        #[inline(always)]
        unsafe fn unsigned(w: __m256i) -> __m256i {
            // SAFETY: only inlined into functions with the implementation's feature enabled.
            unsafe { _mm256_xor_si256(w, _mm256_set1_epi8(-128)) }
        }
        #[inline(always)]
        unsafe fn acc(isum: __m256i, u: __m256i, _w: __m256i, x: __m256i) -> __m256i {
            // SAFETY: as above.
            unsafe { $dpbusd(isum, u, x) }
        }
        /// `|Σx| ≤ 32·128`, so `128·Σx` fits easily.
        #[inline(always)]
        unsafe fn correct(isum: __m256i, block_sum: i32) -> __m256i {
            // SAFETY: as above.
            unsafe { _mm256_sub_epi32(isum, _mm256_set1_epi32(block_sum << 7)) }
        }
        #[inline(always)]
        unsafe fn nibbles(
            p: __m256i,
            lo: __m256i,
            a0: __m256i,
            hi: __m256i,
            a1: __m256i,
        ) -> __m256i {
            // SAFETY: only inlined into functions with the implementation's feature enabled.
            unsafe { $dpbusd($dpbusd(p, lo, a0), hi, a1) }
        }
        #[inline(always)]
        unsafe fn scales(p: *const u8) -> __m256i {
            // SAFETY: as above; 8 bytes at p.
            unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)) }
        }
        #[inline(always)]
        unsafe fn weigh(sumi: __m256i, partial: __m256i, scales: __m256i) -> __m256i {
            // SAFETY: as above.
            unsafe { _mm256_add_epi32(sumi, _mm256_mullo_epi32(partial, scales)) }
        }
    };
}

/// AVX-VNNI (VEX).
struct VexVnni;
impl SignedDot for VexVnni {
    vnni_ops!(_mm256_dpbusd_avx_epi32);
}

/// AVX-VNNI's loops with the emulated `vpdpbusd` (tests).
#[cfg(test)]
struct EmulatedVnni;
#[cfg(test)]
impl SignedDot for EmulatedVnni {
    vnni_ops!(dpbusd_avx2);
}
/// AVX512-VNNI (EVEX, 256-bit).
struct EvexVnni;
impl SignedDot for EvexVnni {
    vnni_ops!(_mm256_dpbusd_epi32);
}

/// A kernel body per multiply, each wrapper enabling its features.
macro_rules! x8_wrapper {
    ($name:ident, $body:ident, $mul:ty, $features:literal) => {
        /// # Safety
        /// The CPU has the features named here; the kernel's contract with `R` rows.
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize>(
            k: usize,
            group: &[u8],
            acts: &[&[u8]],
            sums32: &[&[[i32; 4]]],
            out: &mut [f32],
            stride: usize,
        ) {
            // SAFETY: forwarded; the features are enabled here.
            unsafe { $body::<R, $mul>(k, group, acts, sums32, out, stride) }
        }
    };
}
x8_wrapper!(q8_0_rows_avx2, q8_0_rows, Maddubs, "avx2,fma,f16c");
x8_wrapper!(
    q8_0_rows_avxvnni,
    q8_0_rows,
    VexVnni,
    "avx2,fma,f16c,avxvnni"
);
x8_wrapper!(
    q8_0_rows_avx512vnni,
    q8_0_rows,
    EvexVnni,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
);
#[cfg(test)]
x8_wrapper!(
    q8_0_rows_emulated_vnni,
    q8_0_rows,
    EmulatedVnni,
    "avx2,fma,f16c"
);
x8_wrapper!(q4_k_rows_avx2, q4_k_rows, Maddubs, "avx2,fma,f16c");
x8_wrapper!(
    q4_k_rows_avxvnni,
    q4_k_rows,
    VexVnni,
    "avx2,fma,f16c,avxvnni"
);
#[cfg(test)]
x8_wrapper!(
    q4_k_rows_emulated_vnni,
    q4_k_rows,
    EmulatedVnni,
    "avx2,fma,f16c"
);
x8_wrapper!(
    q4_k_rows_avx512vnni,
    q4_k_rows,
    EvexVnni,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
);

/// Eight unsigned bytes at `p` as (v, v) 16-bit pairs, one per 32-bit lane (the rows' scales
/// for `vpmaddwd`).
///
/// # Safety
/// 8 readable bytes at `p`; AVX2 in the caller.
#[inline(always)]
unsafe fn u8_pairs(p: *const u8) -> __m256i {
    // SAFETY: the contract above.
    unsafe {
        let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        _mm256_or_si256(v, _mm256_slli_epi32::<16>(v))
    }
}

/// Eight signed bytes at `p` as (v, v) 16-bit pairs.
///
/// # Safety
/// As [`u8_pairs`].
#[inline(always)]
unsafe fn i8_pairs(p: *const u8) -> __m256i {
    // SAFETY: the contract above.
    unsafe {
        let v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i));
        _mm256_or_si256(
            _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)),
            _mm256_slli_epi32::<16>(v),
        )
    }
}

/// Prefetch a super-block's first three lines (its headers: scales, minima).
#[inline(always)]
fn prefetch_headers(g: *const u8, pf: usize) {
    for line in 0..3 {
        crate::kernels::prefetch::ahead(g.wrapping_add(64 * line), pf);
    }
}

/// Store each token's eight row results at `out[r · stride..]`.
///
/// # Safety
/// `out` holds `(R − 1) · stride + 8` (checked by [`starts`]); AVX2 in the caller.
#[inline(always)]
unsafe fn store_rows<const R: usize>(acc: &[__m256; R], out: &mut [f32], stride: usize) {
    for (r, v) in acc.iter().enumerate() {
        // SAFETY: the contract above.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(r * stride), *v) };
    }
}

/// The activation rows' starts, checked to hold `bytes` each; and `out` checked for R rows of
/// `width` results.
#[inline(always)]
pub(super) fn starts<const R: usize>(
    acts: &[&[u8]],
    bytes: usize,
    out: &[f32],
    stride: usize,
    width: usize,
) -> [*const u8; R] {
    let mut a = [std::ptr::null::<u8>(); R];
    for (p, row) in a.iter_mut().zip(acts) {
        assert!(row.len() >= bytes, "activation row too short");
        *p = row.as_ptr();
    }
    assert!(out.len() >= (R - 1) * stride + width, "output too short");
    a
}

/// Q8_0 x8 for exactly `R` activation rows; inlined into a wrapper that enables the
/// features of `D`.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C and `D`'s feature; the [`q8_0`] contract with `R` rows.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn q8_0_rows<const R: usize, D: SignedDot>(
    k: usize,
    group: &[u8],
    acts: &[&[u8]],
    sums32: &[&[[i32; 4]]],
    out: &mut [f32],
    stride: usize,
) {
    let blocks = k / 32;
    assert!(group.len() >= blocks * Q8_0_X8_BYTES);
    // The biased multiplies read each activation block's sum (four blocks per entry).
    let mut sums: [&[[i32; 4]]; R] = [&[]; R];
    if D::BIASED {
        assert!(
            sums32.len() >= R && sums32[..R].iter().all(|s| s.len() * 4 >= blocks),
            "block sums missing"
        );
        sums.copy_from_slice(&sums32[..R]);
    }
    let a = starts::<R>(acts, blocks * Q8_0_BYTES, out, stride, GROUP);
    let pf = crate::kernels::prefetch::for_panel_rows_of(GGUF, R);
    // From 4 rows (a prefill) the next group's lines, as the sixteen-row kernels do
    // (`x86_avx512_x16::next_pair`), shared over the group's calls: AMD Zen 4 with the AVX2
    // kernels, Q8_0 at 512 tokens 206.0 -> 196.6 ms (median; min 173.0 -> 168.8). Q4_K
    // showed no gap between weights from cache and from DRAM here, so it keeps the setting.
    let next_group = R >= 4;
    let gb = blocks * Q8_0_X8_BYTES;
    // (A decode's calls leave the thread-local alone.)
    let mut share = if next_group {
        PairShare::take()
    } else {
        PairShare::EVERY_BLOCK
    };
    // SAFETY: every load is at an offset inside the checked group and activation blocks; the
    // caller enables the features.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); R];
        // With the AVX2 multiply a prefill's calls (4+ rows) keep the loop over a block's quads
        // rolled: AMD Zen 4, 8 rows 10.04 -> 8.18 us per call (`ggml_cycles`). The VNNI
        // multiplies, and a decode's 1-3 rows, run faster unrolled: AMD Zen 5, AVX-VNNI
        // (`KT_KERNEL_CPU_VARIANT=avx2`), 4 rows 1.83 -> 1.74 us, 8 rows 3.57 -> 3.46.
        let quads = if R >= 4 && !D::BIASED {
            std::hint::black_box(8)
        } else {
            8
        };
        for blk in 0..blocks {
            let g = group.as_ptr().add(blk * Q8_0_X8_BYTES);
            let ours = share.step();
            let mut isum = [_mm256_setzero_si256(); R];
            for p in 0..quads {
                let at = g.add(16 + 32 * p);
                if p % 2 == 0 {
                    if !next_group {
                        crate::kernels::prefetch::ahead(at, pf);
                    } else if ours {
                        crate::kernels::prefetch::line_into_l1(at.wrapping_add(gb));
                    }
                }
                let w = _mm256_loadu_si256(at as *const __m256i);
                let u = D::unsigned(w);
                for r in 0..R {
                    let q = a[r].add(blk * Q8_0_BYTES + 2 + 4 * p);
                    let x = _mm256_set1_epi32((q as *const i32).read_unaligned());
                    isum[r] = D::acc(isum[r], u, w, x);
                }
            }
            if D::BIASED {
                for r in 0..R {
                    let block_sum = sums[r].get_unchecked(blk / 4)[blk % 4];
                    isum[r] = D::correct(isum[r], block_sum);
                }
            }
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(g as *const __m128i));
            for r in 0..R {
                let da = a[r].add(blk * Q8_0_BYTES);
                let da = _mm256_cvtph_ps(_mm_set1_epi16((da as *const i16).read_unaligned()));
                let term = _mm256_mul_ps(_mm256_mul_ps(dw, da), _mm256_cvtepi32_ps(isum[r]));
                acc[r] = _mm256_add_ps(acc[r], term);
            }
        }
        store_rows(&acc, out, stride);
    }
}

/// A Q6_K x8 super-block's scales of sub-blocks 2q, 2q + 1 per row as 16-bit pairs, made once
/// for every token row. (A loop rather than `std::array::from_fn`, which stayed out of line.)
///
/// # Safety
/// `g` is a Q6_K x8 super-block; AVX2 in the caller.
#[inline(always)]
unsafe fn q6_k_scale_pairs(g: *const u8) -> [__m256i; 8] {
    // SAFETY: the contract above: the 128 scale bytes from offset 16.
    unsafe {
        let mut pairs = [_mm256_setzero_si256(); 8];
        for (q, pair) in pairs.iter_mut().enumerate() {
            let s_lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64(g.add(16 + 16 * q) as *const __m128i));
            let s_hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(g.add(24 + 16 * q) as *const __m128i));
            *pair = _mm256_or_si256(
                _mm256_and_si256(s_lo, _mm256_set1_epi32(0xFFFF)),
                _mm256_slli_epi32::<16>(s_hi),
            );
        }
        pairs
    }
}

/// One token row's term of a Q6_K x8 super-block: `d · da · (sumi − 32 · Σ_j scale_j ·
/// bsums[j])`, the 6-bit offset the twin removes, for the row's Q8_K block at `ab`.
///
/// # Safety
/// `ab` is a Q8_K block; AVX2 in the caller.
#[inline(always)]
unsafe fn q6_k_term(d: __m256, pairs: &[__m256i; 8], ab: *const u8, sumi: __m256i) -> __m256 {
    // SAFETY: the contract above: the block's scale and its bsums from offset 260.
    unsafe {
        let mut offset = _mm256_setzero_si256();
        for (q, pair) in pairs.iter().enumerate() {
            // The bsums of sub-blocks 2q, 2q + 1 in every lane.
            let b = _mm256_set1_epi32((ab.add(260 + 4 * q) as *const i32).read_unaligned());
            offset = _mm256_add_epi32(offset, _mm256_madd_epi16(*pair, b));
        }
        let s = _mm256_sub_epi32(sumi, _mm256_slli_epi32::<5>(offset));
        let da = _mm256_set1_ps((ab as *const f32).read_unaligned());
        _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(s))
    }
}

/// [`q6_k`] with one activation row on 512-bit vectors (more rows: [`q6_k`]).
///
/// # Safety
/// As [`q6_k`], and the CPU has AVX-512 F/BW/VL/DQ.
pub(super) unsafe fn q6_k_avx512(
    k: usize,
    group: &[u8],
    acts: &[&[u8]],
    sums32: &[&[[i32; 4]]],
    out: &mut [f32],
    stride: usize,
) {
    // SAFETY: forwarded.
    unsafe {
        if acts.len() == 1 {
            q6_k_row512(k, group, acts, out, stride)
        } else {
            q6_k(k, group, acts, sums32, out, stride)
        }
    }
}

/// A Q6_K step's 6-bit values on 512-bit vectors: `x` holds the nibbles (low nibbles the
/// first four inputs of each word, high nibbles the next four) and `bits` the step's top bits
/// (two per input: bits 0-1 for the low nibbles, 2-3 for the high); returns the two words'
/// values `(lo, hi)` as unsigned bytes.
///
/// # Safety
/// AVX-512 F/BW in the caller.
#[inline(always)]
pub(super) unsafe fn q6_k_values512(x: __m512i, bits: __m512i) -> (__m512i, __m512i) {
    // SAFETY: the contract above.
    unsafe {
        let low4 = _mm512_set1_epi8(0x0F);
        let lo = _mm512_or_si512(
            _mm512_and_si512(x, low4),
            _mm512_slli_epi16::<4>(_mm512_and_si512(bits, _mm512_set1_epi8(0x03))),
        );
        let hi = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<4>(x), low4),
            _mm512_slli_epi16::<2>(_mm512_and_si512(bits, _mm512_set1_epi8(0x0C))),
        );
        (lo, hi)
    }
}

/// One row against a Q6_K x8 group, a sub-block (two steps) per 512-bit vector: the 64 bytes
/// of its two steps' nibbles are one load, and their top bits one 32-byte vector shifted by
/// 0 and 4 for the two halves. A decode's one row bound [`q6_k_rows`] by its instructions per
/// step (AMD Zen 5, `ggml_cycles`, 128 weight rows from cache: 48 GB/s, below a core's DRAM
/// share). The integer sums are [`q6_k_rows`]'s, regrouped (exact), and the per-super-block
/// steps the same, so the bits are too.
///
/// # Safety
/// As [`q6_k_avx512`] with one row.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")]
unsafe fn q6_k_row512(k: usize, group: &[u8], acts: &[&[u8]], out: &mut [f32], stride: usize) {
    let blocks = k / 256;
    assert!(group.len() >= blocks * Q6_K_X8_BYTES);
    let [a] = starts::<1>(acts, blocks * Q8_K_BYTES, out, stride, GROUP);
    let pf = crate::kernels::prefetch::for_panel_rows_of(GGUF, 1);
    // SAFETY: every load is at an offset inside the checked group and activation blocks.
    unsafe {
        let low4 = _mm512_set1_epi8(0x0F);
        // Dwords 0, 1 of a step pair's 16 activation bytes to the low half, 2, 3 to the high.
        let first = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
        let second = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3);
        let mut acc = _mm256_setzero_ps();
        for sb in 0..blocks {
            let g = group.as_ptr().add(sb * Q6_K_X8_BYTES);
            prefetch_headers(g, pf);
            let mut sumi = _mm512_setzero_si512();
            for t in 0..16 {
                let top_at = g.add(q6_k_x8_top(t));
                crate::kernels::prefetch::ahead(top_at, pf);
                crate::kernels::prefetch::ahead(top_at.add(64), pf);
                let top = _mm256_loadu_si256(top_at as *const __m256i);
                // Step 2t's four top bits per byte in the low half, step 2t + 1's (the upper
                // nibble) in the high half.
                let bits = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(top),
                    _mm256_srli_epi16::<4>(top),
                );
                let bits = _mm512_and_si512(bits, low4);
                let x = _mm512_loadu_si512(g.add(q6_k_x8_nibbles(2 * t)) as *const __m512i);
                let (lo, hi) = q6_k_values512(x, bits);
                let quads = _mm512_castsi128_si512(_mm_loadu_si128(
                    a.add(sb * Q8_K_BYTES + 4 + 16 * t) as *const __m128i,
                ));
                let a0 = _mm512_permutexvar_epi32(first, quads);
                let a1 = _mm512_permutexvar_epi32(second, quads);
                let s16 =
                    _mm512_add_epi16(_mm512_maddubs_epi16(lo, a0), _mm512_maddubs_epi16(hi, a1));
                let scales = _mm512_broadcast_i64x4(i8_pairs(g.add(16 + 8 * t)));
                sumi = _mm512_add_epi32(sumi, _mm512_madd_epi16(s16, scales));
            }
            let sumi = _mm256_add_epi32(
                _mm512_castsi512_si256(sumi),
                _mm512_extracti64x4_epi64::<1>(sumi),
            );
            let d = _mm256_cvtph_ps(_mm_loadu_si128(g as *const __m128i));
            let pairs = q6_k_scale_pairs(g);
            let term = q6_k_term(d, &pairs, a.add(sb * Q8_K_BYTES), sumi);
            acc = _mm256_add_ps(acc, term);
        }
        store_rows(&[acc], out, stride);
    }
}

/// Q6_K x8 for exactly `R` activation rows.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; the [`q6_k`] contract with `R` rows.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)]
unsafe fn q6_k_rows<const R: usize>(
    k: usize,
    group: &[u8],
    acts: &[&[u8]],
    _sums32: &[&[[i32; 4]]],
    out: &mut [f32],
    stride: usize,
) {
    let blocks = k / 256;
    assert!(group.len() >= blocks * Q6_K_X8_BYTES);
    let a = starts::<R>(acts, blocks * Q8_K_BYTES, out, stride, GROUP);
    let low4 = _mm256_set1_epi8(0x0F);
    let two = _mm256_set1_epi8(0x03);
    let mut acc = [_mm256_setzero_ps(); R];
    let pf = crate::kernels::prefetch::for_panel_rows_of(GGUF, R);
    // SAFETY: every load is at an offset inside the checked group and activation blocks.
    unsafe {
        for sb in 0..blocks {
            let g = group.as_ptr().add(sb * Q6_K_X8_BYTES);
            prefetch_headers(g, pf);
            let mut sumi = [_mm256_setzero_si256(); R];
            for t in 0..16 {
                // Two steps (one sub-block of 16 values): their top bits share one vector.
                let top_at = g.add(q6_k_x8_top(t));
                let top = _mm256_loadu_si256(top_at as *const __m256i);
                // The sub-block's 96 bytes (lines 64 apart cover every line of the stream).
                crate::kernels::prefetch::ahead(top_at, pf);
                crate::kernels::prefetch::ahead(top_at.add(64), pf);
                // The rows' signed scale of sub-block t as (s, s) 16-bit pairs.
                let scales = i8_pairs(g.add(16 + 8 * t));
                for half in 0..2 {
                    let step = 2 * t + half;
                    let x = _mm256_loadu_si256(g.add(q6_k_x8_nibbles(step)) as *const __m256i);
                    // This step's four top bits per byte: bits 0–1 (low nibble's value),
                    // 2–3 (high nibble's).
                    let bits = if half == 0 {
                        top
                    } else {
                        _mm256_srli_epi16::<4>(top)
                    };
                    let bits = _mm256_and_si256(bits, low4);
                    let lo = _mm256_or_si256(
                        _mm256_and_si256(x, low4),
                        _mm256_slli_epi16::<4>(_mm256_and_si256(bits, two)),
                    );
                    let hi = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(x), low4),
                        _mm256_slli_epi16::<2>(_mm256_and_si256(bits, _mm256_set1_epi8(0x0C))),
                    );
                    for r in 0..R {
                        let q = a[r].add(sb * Q8_K_BYTES + 4 + 8 * step);
                        let a0 = _mm256_set1_epi32((q as *const i32).read_unaligned());
                        let a1 = _mm256_set1_epi32((q.add(4) as *const i32).read_unaligned());
                        // Values ≤ 63: two pairs of products fit an i16 lane.
                        let s16 = _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo, a0),
                            _mm256_maddubs_epi16(hi, a1),
                        );
                        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(s16, scales));
                    }
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(g as *const __m128i));
            let pairs = q6_k_scale_pairs(g);
            for r in 0..R {
                let term = q6_k_term(d, &pairs, a[r].add(sb * Q8_K_BYTES), sumi[r]);
                acc[r] = _mm256_add_ps(acc[r], term);
            }
        }
        store_rows(&acc, out, stride);
    }
}

/// Q4_K x8 for exactly `R` activation rows; inlined into a wrapper that enables the features
/// of `D`.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C and `D`'s feature; the [`q4_k`] contract with `R` rows.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register blocks read best as indexed loops
unsafe fn q4_k_rows<const R: usize, D: SignedDot>(
    k: usize,
    group: &[u8],
    acts: &[&[u8]],
    sums32: &[&[[i32; 4]]],
    out: &mut [f32],
    stride: usize,
) {
    let blocks = k / 256;
    assert!(group.len() >= blocks * Q4_K_X8_BYTES);
    assert!(
        sums32.len() >= R && sums32[..R].iter().all(|s| s.len() >= blocks),
        "32-value sums missing"
    );
    // (Not `std::array::from_fn`: generic and compiled without the target features, it and
    // its closure stayed out of line, 1.6% of a prefill's cycles.)
    let mut sums: [&[[i32; 4]]; R] = [&[]; R];
    sums.copy_from_slice(&sums32[..R]);
    let a = starts::<R>(acts, blocks * Q8_K_BYTES, out, stride, GROUP);
    // From 4 rows (a prefill) the panel kernels' setting rather than the decode's: AMD Zen 4
    // with the AVX2 kernels, Q4_K at 512 tokens 124.2 -> 121.4 ms (median; min 103.6 -> 97.9).
    let pf = crate::kernels::prefetch::for_panel_rows_of(GGUF, R);
    // SAFETY: every load is at an offset inside the checked group and activation blocks; the
    // caller enables the features.
    unsafe {
        let low4 = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); R];
        for sb in 0..blocks {
            let g = group.as_ptr().add(sb * Q4_K_X8_BYTES);
            // The super-block's header lines, then one line per two steps.
            prefetch_headers(g, pf);
            let mut sumi = [_mm256_setzero_si256(); R];
            for j in 0..8 {
                let scales = D::scales(g.add(32 + 8 * j));
                let mut partial = [_mm256_setzero_si256(); R];
                // The sub-block's two lines (prefetched here, so the step loop has no branch).
                let nibbles = g.add(160 + j * 128);
                crate::kernels::prefetch::ahead(nibbles.add(32), pf);
                crate::kernels::prefetch::ahead(nibbles.add(96), pf);
                for p in 0..4 {
                    let at = nibbles.add(p * 32);
                    let x = _mm256_loadu_si256(at as *const __m256i);
                    let lo = _mm256_and_si256(x, low4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(x), low4);
                    for r in 0..R {
                        let q = a[r].add(sb * Q8_K_BYTES + 4 + 32 * j + 8 * p);
                        let a0 = _mm256_set1_epi32((q as *const i32).read_unaligned());
                        let a1 = _mm256_set1_epi32((q.add(4) as *const i32).read_unaligned());
                        partial[r] = D::nibbles(partial[r], lo, a0, hi, a1);
                    }
                }
                // Weighed by the rows' scales (one byte per row).
                for r in 0..R {
                    sumi[r] = D::weigh(sumi[r], partial[r], scales);
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(g as *const __m128i));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(g.add(16) as *const __m128i));
            let mut mins = [_mm256_setzero_si256(); 4];
            for (q, m) in mins.iter_mut().enumerate() {
                *m = _mm256_cvtepu8_epi16(_mm_loadu_si128(g.add(96 + 16 * q) as *const __m128i));
            }
            for r in 0..R {
                let ab = a[r].add(sb * Q8_K_BYTES);
                // Pair q of the row's 32-value sums in every lane, times the rows' minima pairs.
                let s32 = sums[r].get_unchecked(sb);
                let pairs = [
                    _mm256_set1_epi32(s32[0]),
                    _mm256_set1_epi32(s32[1]),
                    _mm256_set1_epi32(s32[2]),
                    _mm256_set1_epi32(s32[3]),
                ];
                let mut summs = _mm256_madd_epi16(mins[0], pairs[0]);
                for q in 1..4 {
                    summs = _mm256_add_epi32(summs, _mm256_madd_epi16(mins[q], pairs[q]));
                }
                let da = _mm256_set1_ps((ab as *const f32).read_unaligned());
                let term = _mm256_sub_ps(
                    _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(sumi[r])),
                    _mm256_mul_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(summs)),
                );
                acc[r] = _mm256_add_ps(acc[r], term);
            }
        }
        store_rows(&acc, out, stride);
    }
}
