//! FP8 (E4M3FN) decoding: codes to the exact bf16 values they stand for, so the bf16 panel
//! kernels (fp32 FMA, `vdpbf16ps`, AMX tiles) multiply FP8 weights. Every E4M3FN value has at
//! most 4 significant bits and an exponent in `[-9, 8]`, so bf16 holds each one exactly.
//!
//! Vector variants, bit-identical to the scalar twin:
//! - AVX-512BW, 32 codes per step: normal codes by integer arithmetic (exponent rebias from 7
//!   to 127: `(code & 0x7F) << 4` plus `120 << 7`), the 8 subnormal magnitudes from a
//!   `vpermw` table, the sign moved from bit 7 to bit 15;
//! - AVX2 + F16C, 16 codes per step: the code placed as half-precision bits
//!   `s 0eeee mmm0000000` is the value times 2⁻⁸ (bias 15 instead of 7, subnormals included);
//!   `vcvtph2ps`, times 2⁸, and the upper 16 bits of the float are the bf16.
//!
//! For one to four rows (two on AVX2) the fused kernels skip the decoded copy: a code moved to
//! the top of a 16-bit lane, shifted right arithmetically by 4 and masked is the bf16 of its
//! value times 2⁻¹²⁰, multiplied in fp32 with activations taken times 2⁶⁴, each block's sums
//! added to the totals times the block's scale · 2⁵⁶; [`fused_scalar`] is their twin (the same
//! bits while every intermediate is a normal float). Subnormal codes are fp32 denormals there:
//! exact, or read as zero on CPUs that take an assist for each
//! ([`crate::isa::flush_subnormal_codes`]).
//!
//! NaN codes (`0x7F`, `0xFF`) are refused at load and never reach these kernels.
use crate::dtype::e4m3_to_f32;
use crate::isa::Level;

/// Inputs per scale block (DeepSeek-V3 block FP8: 128 × 128).
pub const BLOCK: usize = 128;

/// A code's value in the fused kernels: its exact value, or zero for a subnormal code where
/// `FLUSH` ([`crate::isa::flush_subnormal_codes`]; the error is below 2⁻⁶ of the block scale
/// per such weight).
pub fn fused_code_value<const FLUSH: bool>(code: u8) -> f32 {
    if FLUSH && code & 0x78 == 0 {
        0.0
    } else {
        e4m3_to_f32(code)
    }
}

/// Decode `n` codes (a multiple of 32) at `codes` into bf16 bits at `out`, in order.
///
/// # Safety
/// `n` readable bytes at `codes`, `n` writable u16 at `out`; the CPU has the variant's
/// features; no NaN codes.
pub type DecodeFn = unsafe fn(codes: *const u8, n: usize, out: *mut u16);

/// Decode `n` codes (a multiple of 32) times `scale` into bf16 bits, each product rounded in
/// fp32 and then to the nearest bf16 (ties to even): a block scale folded into its values.
///
/// # Safety
/// As [`DecodeFn`].
pub type DecodeScaledFn = unsafe fn(codes: *const u8, n: usize, scale: f32, out: *mut u16);

/// A decoder and its name.
#[derive(Debug, Clone, Copy)]
pub struct Fp8Decoder {
    /// The decoder ([`DecodeFn`] contract; the level's ISA is guaranteed by who chose it).
    pub decode: DecodeFn,
    /// The scaling decoder where the level has a fast one (else decode, then scale).
    pub decode_scaled: Option<DecodeScaledFn>,
    /// Name, as the layer's `kernel` reports it.
    pub name: &'static str,
}

/// Rows per call of the AVX-512 fused decode kernel.
pub const FUSED_ROWS: usize = 4;

/// Fused kernel: `out[r·32 + j] = Σ_b scales[b] · Σ_{kk ∈ block b} W[j][kk] · a[r][kk]` for
/// one panel of codes in panel order (`32·k` bytes), with no exact decoded copy of the panel
/// (few rows decode in registers as they stream; the AVX2 kernel's many-row path decodes one
/// 128-input block at a time into L1).
///
/// Every variant computes [`fused_scalar`]'s arithmetic: per block of 128 inputs one fp32 FMA
/// chain per row and output from zero, in input order, and the block's sum added to the row's
/// total as `fma(sum, scale, total)` in block order. Its bits while every intermediate is a
/// normal float (the kernels work in powers of two apart from it), so AVX2 and AVX-512, one
/// row or many, agree. With `scaled`, the rows hold the inputs times
/// [`crate::formats::ROWS_UP64`] (exactly: no overflow).
///
/// # Safety
/// `a` holds 1..= the kernel's [`Fused::rows`] rows of `k` readable f32; `codes` `32·k`
/// bytes, `scales` `k/128` f32, `out` `32·a.len()` writable f32; `k` a multiple of 128; no NaN
/// codes; the CPU has the variant's features.
pub type FusedFn = unsafe fn(
    a: &[*const f32],
    scaled: bool,
    k: usize,
    codes: *const u8,
    scales: *const f32,
    out: *mut f32,
);

/// [`FusedFn`] on two panels at once: `codes[p]`, `scales[p]` and `out[p]` as the single
/// kernel's for panel `p`, with the same bits per panel. Two panels run twice the independent
/// FMA chains, which is what limits one row.
///
/// # Safety
/// [`FusedFn`]'s contract for each panel; `a` holds 1..= [`Fused::pair`]'s rows.
pub type FusedPairFn = unsafe fn(
    a: &[*const f32],
    scaled: bool,
    k: usize,
    codes: [*const u8; 2],
    scales: [*const f32; 2],
    out: [*mut f32; 2],
);

/// Rows per call of the AVX-512 two-panel kernel (the AVX2 one takes one).
pub const FUSED_PAIR_ROWS: usize = 2;

/// A fused kernel and the rows it takes per call.
#[derive(Debug, Clone, Copy)]
pub struct Fused {
    /// The kernel ([`FusedFn`] contract; the level's ISA is guaranteed by who chose it).
    pub run: FusedFn,
    /// Rows per call.
    pub rows: usize,
    /// The two-panel kernel and the rows it takes, where the level has one.
    pub pair: Option<(FusedPairFn, usize)>,
    /// Whether it reads subnormal codes as zero ([`fused_code_value`]).
    pub flushes_subnormals: bool,
}

/// The fused kernel `level` allows, if any (AVX-512 or AVX2; scalar CPUs decode into bf16
/// panels), valuing subnormal codes as [`crate::isa::flush_subnormal_codes`] says.
pub fn fused_for(level: Level) -> Option<Fused> {
    fused_variant(level, crate::isa::flush_subnormal_codes())
}

/// [`fused_for`] with subnormal codes read as zero (`flush`) or exactly.
pub fn fused_variant(level: Level, flush: bool) -> Option<Fused> {
    #[cfg(target_arch = "x86_64")]
    {
        let (run, rows): (FusedFn, usize) = match (level >= Level::Avx512Base, flush) {
            _ if level < Level::Avx2 => return None,
            (true, false) => (x86::fused_avx512::<false>, FUSED_ROWS),
            (true, true) => (x86::fused_avx512::<true>, FUSED_ROWS),
            (false, false) => (x86::fused_avx2::<false>, crate::kernels::MAX_ROWS),
            (false, true) => (x86::fused_avx2::<true>, crate::kernels::MAX_ROWS),
        };
        let pair: (FusedPairFn, usize) = match (level >= Level::Avx512Base, flush) {
            (true, false) => (x86::fused_pair_avx512::<false>, FUSED_PAIR_ROWS),
            (true, true) => (x86::fused_pair_avx512::<true>, FUSED_PAIR_ROWS),
            (false, false) => (x86::fused_pair_avx2::<false>, 1),
            (false, true) => (x86::fused_pair_avx2::<true>, 1),
        };
        return Some(Fused {
            run,
            rows,
            pair: Some(pair),
            flushes_subnormals: flush,
        });
    }
    #[allow(unreachable_code)]
    {
        let _ = (level, flush);
        None
    }
}

/// FP8's prefetch calibration workload ([`crate::kernels::calibrate::Workload`]): `gate` and
/// `up` as 32-row panels of 2048 E4M3 codes (block scales 1) through the one-row fused kernel
/// of `level`, alternating panel by panel. The buffers' bytes are below `0x80`, so a few are
/// NaN codes: their sums are garbage nobody reads, the timing is a decode's.
pub fn calibration_workload(level: Level, gate: &[u8], up: &[u8]) {
    let Some(fused) = fused_for(level) else {
        return;
    };
    let k = 2048;
    let x: Vec<f32> = (0..k).map(|i| ((i % 17) as f32 - 8.0) * 0.125).collect();
    let scales = vec![1f32; k / BLOCK];
    let mut out = [0f32; 32];
    crate::kernels::calibrate::alternate_panels(gate, up, 32 * k, |codes| {
        // SAFETY: a whole panel (32·k codes) at `codes`; one row of k f32; k/128 scales; 32
        // outputs; k a multiple of 128; the kernel was picked for `level`, which the process
        // runs at. NaN codes only make garbage sums.
        unsafe {
            (fused.run)(
                &[x.as_ptr()],
                false,
                k,
                codes,
                scales.as_ptr(),
                out.as_mut_ptr(),
            )
        };
        out[0]
    });
}

/// The widest decoder `level` allows.
pub fn decoder_for(level: Level) -> Fp8Decoder {
    #[cfg(target_arch = "x86_64")]
    {
        if level >= Level::Avx512Vbmi {
            return Fp8Decoder {
                decode: x86::decode_avx512vbmi,
                decode_scaled: Some(x86::decode_scaled_avx512vbmi),
                name: "avx512-vbmi",
            };
        }
        if level >= Level::Avx512Base {
            return Fp8Decoder {
                decode: x86::decode_avx512,
                decode_scaled: None,
                name: "avx512",
            };
        }
        if level >= Level::Avx2 {
            return Fp8Decoder {
                decode: x86::decode_avx2,
                decode_scaled: None,
                name: "avx2",
            };
        }
    }
    let _ = level;
    Fp8Decoder {
        decode: decode_scalar,
        decode_scaled: Some(decode_scaled_scalar),
        name: "scalar",
    }
}

/// One code as bf16 bits (exact).
#[inline]
pub fn code_to_bf16(b: u8) -> u16 {
    (e4m3_to_f32(b).to_bits() >> 16) as u16
}

/// The scalar twin of the scaling decoders.
///
/// # Safety
/// The [`DecodeScaledFn`] contract.
pub unsafe fn decode_scaled_scalar(codes: *const u8, n: usize, scale: f32, out: *mut u16) {
    // SAFETY: the contract: n codes in, n values out.
    unsafe {
        for i in 0..n {
            *out.add(i) = crate::dtype::f32_to_bf16_bits(e4m3_to_f32(*codes.add(i)) * scale);
        }
    }
}

/// The scalar twin (and the decoder of CPUs without AVX2).
///
/// # Safety
/// The [`DecodeFn`] contract.
pub unsafe fn decode_scalar(codes: *const u8, n: usize, out: *mut u16) {
    // SAFETY: the contract: n codes in, n values out.
    unsafe {
        for i in 0..n {
            *out.add(i) = code_to_bf16(*codes.add(i));
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    /// Activations' factor in the fused kernels (see [`fused512`]).
    const UP: f32 = crate::formats::ROWS_UP64;
    /// Block scales' factor in the fused kernels (with the codes' 2⁻¹²⁰, undoes `UP`).
    const DOWN: f32 = crate::formats::SCALES_DOWN56;

    /// bf16 bits of the subnormal E4M3 magnitudes `m · 2⁻⁹`, `m = 0..8`, indexed by `m`.
    const SUBNORMAL_BF16: [u16; 32] = {
        let mut t = [0u16; 32];
        // m · 2⁻⁹ for m = 1..7: exponents 118..120, mantissas .0/.5 (m = 3), .25/.5/.75.
        let v = [0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60];
        let mut i = 0;
        while i < 8 {
            t[i] = v[i];
            i += 1;
        }
        t
    };

    /// 32 codes (bytes of `v`) as the bf16 bits of their exact values.
    ///
    /// # Safety
    /// AVX-512F/BW available; no NaN codes (they decode to garbage).
    #[inline(always)]
    pub(crate) unsafe fn e4m3x32_to_bf16(v: __m256i) -> __m512i {
        // SAFETY: the table is 64 readable bytes; the caller vouches for the features.
        unsafe {
            let table = _mm512_loadu_si512(SUBNORMAL_BF16.as_ptr() as *const __m512i);
            let v = _mm512_cvtepu8_epi16(v);
            let mag = _mm512_and_si512(v, _mm512_set1_epi16(0x7F));
            let sign = _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x80)), 8);
            let normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
            let subnormal = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8));
            let sub = _mm512_permutexvar_epi16(mag, table);
            _mm512_or_si512(_mm512_mask_blend_epi16(subnormal, normal, sub), sign)
        }
    }

    /// E4M3 codes in the top byte of 16-bit lanes (`vpunpck*bw` with zeros below) as the bf16
    /// bits of value · 2⁻¹²⁰: shifted right arithmetically by 4 and masked to `s000 0eee emmm
    /// 0000`. A subnormal code would be a bf16 denormal there and an fp32 denormal as an FMA
    /// input, which costs an Intel core a microcode assist (an Intel Xeon ran FP8 at 150-180
    /// ns per 64-byte line with 7 such codes in 127, against 3-4 without), so codes with a zero
    /// exponent field read as zero with `FLUSH`: a zero-masked shift, one more instruction per
    /// 32 codes (AMD Zen 4 from cache: 2.4-2.6 -> 2.8 ns per line, so only where it pays).
    ///
    /// # Safety
    /// AVX-512F/BW available.
    #[inline(always)]
    pub(crate) unsafe fn top_codes512<const FLUSH: bool>(half: __m512i) -> __m512i {
        // SAFETY: the caller vouches for the features.
        unsafe {
            let keep = _mm512_set1_epi16(0x87F0u16 as i16);
            let shifted = if FLUSH {
                let normal = _mm512_test_epi16_mask(half, _mm512_set1_epi16(0x7800));
                _mm512_maskz_srai_epi16::<4>(normal, half)
            } else {
                _mm512_srai_epi16::<4>(half)
            };
            _mm512_and_si512(shifted, keep)
        }
    }

    /// [`top_codes512`] on 256-bit vectors: without mask registers, `vpsignw` by the exponent
    /// bits (zero or positive) zeroes the codes with none with `FLUSH`, two more instructions
    /// per 16 codes.
    ///
    /// # Safety
    /// AVX2 available.
    #[inline(always)]
    pub(crate) unsafe fn top_codes256<const FLUSH: bool>(half: __m256i) -> __m256i {
        // SAFETY: the caller vouches for the features.
        unsafe {
            let keep = _mm256_set1_epi16(0x87F0u16 as i16);
            let pairs = _mm256_and_si256(_mm256_srai_epi16::<4>(half), keep);
            if FLUSH {
                // The code's exponent field, `0eeee000 00000000`, is what `keep` clears: no
                // constant register more (that spilled two rows' FP8 sums) and no shift.
                _mm256_sign_epi16(pairs, _mm256_andnot_si256(keep, half))
            } else {
                pairs
            }
        }
    }

    /// Into L2, the line of the block two calls ahead that matches code `i` of this call's
    /// `n`: a panel's blocks are decoded one after the other with a block's multiply between
    /// two decodes, and without this every decode waited on DRAM (the code loads held 70% of
    /// the decoder's samples in `perf`; S1 at 512 tokens: median 155 → 143 ms over 6 runs
    /// each). Two blocks ahead, the lines arrive before they are read; a prefetch never
    /// faults, past the end included.
    /// The group-scaled decoders (`formats::kgroup`) stream their codes the same way.
    #[inline(always)]
    pub(crate) unsafe fn prefetch_ahead(codes: *const u8, i: usize, n: usize) {
        // SAFETY: a prefetch has no architectural effect; SSE is baseline on x86-64.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(codes.wrapping_add(i + 2 * n) as *const i8) }
    }

    /// bf16 bits of the E4M3 magnitude `m` (`m < 0x7F`; 0x7F is NaN and never decoded).
    const fn magnitude_bf16(m: u8) -> u16 {
        let (e, f) = ((m >> 3) as u16, (m & 7) as u16);
        if e > 0 {
            // 2^(e−7)·(1 + f/8): bf16 exponent e + 120, the 3 mantissa bits on top.
            ((e + 120) << 7) | (f << 4)
        } else if f == 0 {
            0
        } else {
            // f·2⁻⁹ = 2^(p−9)·(f/2^p) for p the top bit of f.
            let p = 15 - f.leading_zeros() as u16;
            ((118 + p) << 7) | ((f - (1 << p)) << (7 - p))
        }
    }

    /// Low (`[0]`) and high (`[1]`) bytes of [`magnitude_bf16`] of the 128 magnitudes: the two
    /// 128-byte tables `vpermi2b` looks up.
    const MAGNITUDE_BYTES: [[u8; 128]; 2] = {
        let mut t = [[0u8; 128]; 2];
        let mut m = 0;
        while m < 128 {
            let v = magnitude_bf16(m as u8);
            t[0][m] = v as u8;
            t[1][m] = (v >> 8) as u8;
            m += 1;
        }
        t
    };

    /// Where `vpermb` moves the 64 codes so that `vpunpck{l,h}bw` of the looked-up bytes store
    /// codes 0..32 and 32..64 in order: lane `L` of the low unpack takes bytes `16L..16L+8`
    /// (codes `8L..8L+8`), of the high one bytes `16L+8..16L+16` (codes `32+8L..`).
    const UNPACK_ORDER: [u8; 64] = {
        let mut t = [0u8; 64];
        let mut i = 0;
        while i < 64 {
            let (lane, pos) = (i / 16, i % 16);
            t[i] = if pos < 8 {
                (8 * lane + pos) as u8
            } else {
                (32 + 8 * lane + pos - 8) as u8
            };
            i += 1;
        }
        t
    };

    /// The exact bf16 values of E4M3 codes by the VBMI tables, one 64-code line at a time
    /// (in registers, for decoders that change the words before storing them).
    pub(crate) struct LineTables {
        lo: [__m512i; 2],
        hi: [__m512i; 2],
        order: __m512i,
        sign: __m512i,
        flip: __m512i,
    }

    impl LineTables {
        /// `tables`: low and high bytes of the 128 magnitudes' bf16; `flip` (0 or 0x80) is
        /// xored into each sign.
        #[inline(always)]
        unsafe fn new(tables: &[[u8; 128]; 2], flip: u8) -> LineTables {
            let half = |b: &[u8; 128], h: usize| {
                // SAFETY: 64-byte halves of a 128-byte array; the caller has AVX-512F.
                unsafe { _mm512_loadu_si512(b[64 * h..].as_ptr().cast()) }
            };
            // SAFETY: the caller has AVX-512F/BW (the constructor's callers' features).
            unsafe {
                LineTables {
                    lo: [half(&tables[0], 0), half(&tables[0], 1)],
                    hi: [half(&tables[1], 0), half(&tables[1], 1)],
                    order: _mm512_loadu_si512(UNPACK_ORDER.as_ptr().cast()),
                    sign: _mm512_set1_epi8(0x80u8 as i8),
                    flip: _mm512_set1_epi8(flip as i8),
                }
            }
        }

        /// The exact (unscaled) values' tables, no sign flip.
        #[inline(always)]
        pub(crate) unsafe fn exact() -> LineTables {
            // SAFETY: forwarded.
            unsafe { LineTables::new(&MAGNITUDE_BYTES, 0) }
        }

        /// The bf16 words of the 64 codes at `codes`: codes 0..32, then 32..64.
        ///
        /// # Safety
        /// 64 readable bytes at `codes`, no NaN code; AVX-512F/BW/VBMI available.
        #[inline(always)]
        pub(crate) unsafe fn line(&self, codes: *const u8) -> [__m512i; 2] {
            // SAFETY: the caller's contract.
            unsafe {
                let raw = _mm512_loadu_si512(codes.cast());
                let c = _mm512_permutexvar_epi8(self.order, raw);
                // The index's bit 7 (the sign) is ignored by the lookups.
                let lo = _mm512_permutex2var_epi8(self.lo[0], c, self.lo[1]);
                let hi = _mm512_permutex2var_epi8(self.hi[0], c, self.hi[1]);
                // hi | ((c ^ flip) & 0x80).
                let hi =
                    _mm512_ternarylogic_epi32(hi, _mm512_xor_si512(c, self.flip), self.sign, 0xF8);
                [_mm512_unpacklo_epi8(lo, hi), _mm512_unpackhi_epi8(lo, hi)]
            }
        }
    }

    /// 64 codes per step by two 128-byte table lookups (`vpermi2b`: the bf16's low and high
    /// byte of the magnitude) and the sign bit: 9 instructions per 64 codes. `tables` are the
    /// low and high bytes of the 128 magnitudes' bf16; `flip` (0 or 0x80) is xored into each
    /// sign. Codes past the last whole 64 are looked up one by one.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn decode_by_tables(
        codes: *const u8,
        n: usize,
        out: *mut u16,
        tables: &[[u8; 128]; 2],
        flip: u8,
    ) -> usize {
        // SAFETY: the DecodeFn contract: 64-code steps stay inside the n codes and n outputs.
        unsafe {
            let tables = LineTables::new(tables, flip);
            let mut i = 0;
            while i + 64 <= n {
                prefetch_ahead(codes, i, n);
                let [first, second] = tables.line(codes.add(i));
                _mm512_storeu_si512(out.add(i).cast(), first);
                _mm512_storeu_si512(out.add(i + 32).cast(), second);
                i += 64;
            }
            i
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn decode512_vbmi(codes: *const u8, n: usize, out: *mut u16) {
        // SAFETY: the DecodeFn contract; the tail is one 32-code step inside n.
        unsafe {
            let i = decode_by_tables(codes, n, out, &MAGNITUDE_BYTES, 0);
            if i < n {
                let v = _mm256_loadu_si256(codes.add(i) as *const __m256i);
                _mm512_storeu_si512(out.add(i) as *mut __m512i, e4m3x32_to_bf16(v));
            }
        }
    }

    /// The 128 magnitudes' exact values (0x7F, NaN, never decoded, reads as 480).
    const MAGNITUDE_F32: [f32; 128] = {
        let mut t = [0f32; 128];
        let mut m = 0;
        while m < 128 {
            t[m] = f32::from_bits((magnitude_bf16(m as u8) as u32) << 16);
            m += 1;
        }
        t
    };

    /// [`decode512_vbmi`] with tables of the magnitudes times `|scale|` (rounded like the
    /// scalar twin: fp32 product, then nearest-even bf16), built per call: 128 products for
    /// a block of thousands of codes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn decode512_vbmi_scaled(codes: *const u8, n: usize, scale: f32, out: *mut u16) {
        #[repr(align(64))]
        struct Words([u16; 128]);
        let mut words = Words([0; 128]);
        let mut tables = [[0u8; 128]; 2];
        // SAFETY: 8 steps of 16 values inside the 128-entry arrays; 4 steps of 32 words.
        unsafe {
            let s = _mm512_set1_ps(scale.abs());
            let (half, one) = (_mm512_set1_epi32(0x7FFF), _mm512_set1_epi32(1));
            for c in 0..8 {
                let f = _mm512_mul_ps(_mm512_loadu_ps(MAGNITUDE_F32[16 * c..].as_ptr()), s);
                let bits = _mm512_castps_si512(f);
                let lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
                let r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(half, lsb)), 16);
                _mm256_store_si256(
                    words.0[16 * c..].as_mut_ptr().cast(),
                    _mm512_cvtepi32_epi16(r),
                );
            }
            for c in 0..4 {
                let w = _mm512_load_si512(words.0[32 * c..].as_ptr().cast());
                _mm256_storeu_si256(
                    tables[0][32 * c..].as_mut_ptr().cast(),
                    _mm512_cvtepi16_epi8(w),
                );
                _mm256_storeu_si256(
                    tables[1][32 * c..].as_mut_ptr().cast(),
                    _mm512_cvtepi16_epi8(_mm512_srli_epi16(w, 8)),
                );
            }
        }
        let flip = if scale.is_sign_negative() { 0x80 } else { 0 };
        // SAFETY: the DecodeScaledFn contract.
        let done = unsafe { decode_by_tables(codes, n, out, &tables, flip) };
        for i in done..n {
            // SAFETY: i < n: code i and output i exist.
            unsafe {
                let c = *codes.add(i);
                let m = (c & 0x7F) as usize;
                let sign = ((c ^ flip) & 0x80) as u16;
                *out.add(i) = words.0[m] | (sign << 8);
            }
        }
    }

    /// AVX512-VBMI scaling decoder.
    ///
    /// # Safety
    /// The [`super::DecodeScaledFn`] contract; AVX-512F/BW/VBMI available.
    pub unsafe fn decode_scaled_avx512vbmi(codes: *const u8, n: usize, scale: f32, out: *mut u16) {
        // SAFETY: forwarded.
        unsafe { decode512_vbmi_scaled(codes, n, scale, out) }
    }

    /// AVX512-VBMI decoder.
    ///
    /// # Safety
    /// The [`super::DecodeFn`] contract; AVX-512F/BW/VBMI available.
    pub unsafe fn decode_avx512vbmi(codes: *const u8, n: usize, out: *mut u16) {
        debug_assert!(n.is_multiple_of(32));
        // SAFETY: forwarded.
        unsafe { decode512_vbmi(codes, n, out) }
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn decode512(codes: *const u8, n: usize, out: *mut u16) {
        // SAFETY: the DecodeFn contract: 32-code steps stay inside the n codes and n outputs.
        unsafe {
            for i in (0..n).step_by(32) {
                prefetch_ahead(codes, i, n);
                let v = _mm256_loadu_si256(codes.add(i) as *const __m256i);
                _mm512_storeu_si512(out.add(i) as *mut __m512i, e4m3x32_to_bf16(v));
            }
        }
    }

    /// The fused kernels' prefetch setting (their own tuner family), read once per call.
    #[inline(always)]
    fn fp8_distance() -> usize {
        crate::kernels::prefetch::distance_of(crate::kernels::prefetch::Family::Fp8Codes)
    }

    /// Output row of lane `i` of the fused kernel's two accumulators (`i < 16`: the one fed by
    /// `vpunpcklbw`, else `vpunpckhbw`): within each 128-bit lane `l` of a 64-byte pair line
    /// the low 8 bytes are rows `16·(l/2) + 8·(l%2) + 0..4`, the high 8 bytes rows `+ 4..8`.
    const fn fused_lane_row(i: usize) -> usize {
        let (half, lane, m) = (i / 16, (i % 16) / 4, i % 4);
        16 * (lane / 2) + 8 * (lane % 2) + 4 * half + m
    }

    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // register blocks read best as indexed loops
    unsafe fn fused512<const R: usize, const P: usize, const FLUSH: bool>(
        a: &[*const f32],
        scaled: bool,
        k: usize,
        codes: [*const u8; P],
        scales: [*const f32; P],
        out: [*mut f32; P],
    ) {
        // Decoding in two integer ops per 32 codes: a byte moved to the top of a 16-bit lane
        // and shifted right arithmetically by 4, masked to `s000 0eee emmm 0000`, is a bf16
        // worth value · 2⁻¹²⁰ for every code, subnormals included (as bf16 denormals). The
        // activations are taken times 2⁶⁴ so the products stay far from fp32's denormals, and
        // each block's sums are scaled by scale · 2⁵⁶: powers of two, so nothing is rounded
        // differently from the unscaled arithmetic.
        // P panels at once (the pair kernels) run P times as many independent FMA chains: one
        // panel's two chains per row, two FMAs per line each, bound one row to 32 GB/s of codes
        // from cache on AMD Zen 5 (`byte_cycles`), below one core's DRAM share.
        // SAFETY: the FusedFn contract, per panel: pair q's 64 codes, inputs 2q and 2q+1 of
        // every row and block b's scale are inside the caller's buffers; outputs 32 per row.
        unsafe {
            let zero = _mm512_setzero_si512();
            let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
            let mut total = [[[_mm512_setzero_ps(); 2]; R]; P];
            // The block's activations times 2⁶⁴, so each line's broadcasts are plain loads (AVX2
            // one row from cache, AMD Zen 3: 4.0 -> 3.3 ns per 64-byte line, `byte_cycles`).
            let mut x = [[0f32; super::BLOCK]; R];
            let pf = fp8_distance();
            let up = if scaled { 1.0 } else { UP };
            for b in 0..k / super::BLOCK {
                crate::kernels::scaled_inputs(a, b * super::BLOCK, super::BLOCK, up, &mut x);
                let mut sum = [[[_mm512_setzero_ps(); 2]; R]; P];
                for q in b * super::BLOCK / 2..(b + 1) * super::BLOCK / 2 {
                    let i = 2 * q - b * super::BLOCK;
                    let x0: [__m512; R] = std::array::from_fn(|r| _mm512_set1_ps(x[r][i]));
                    let x1: [__m512; R] = std::array::from_fn(|r| _mm512_set1_ps(x[r][i + 1]));
                    for pn in 0..P {
                        let line = codes[pn].add(q * 64);
                        crate::kernels::prefetch::ahead(line, pf);
                        let v = _mm512_loadu_si512(line as *const __m512i);
                        let halves = [_mm512_unpacklo_epi8(zero, v), _mm512_unpackhi_epi8(zero, v)];
                        for h in 0..2 {
                            // 16 outputs × (input 2q, 2q+1) as bf16 pairs in 32-bit lanes.
                            let pairs = top_codes512::<FLUSH>(halves[h]);
                            let w0 = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
                            let w1 = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
                            for r in 0..R {
                                let acc = &mut sum[pn][r][h];
                                *acc = _mm512_fmadd_ps(w0, x0[r], *acc);
                                *acc = _mm512_fmadd_ps(w1, x1[r], *acc);
                            }
                        }
                    }
                }
                for pn in 0..P {
                    let s = _mm512_set1_ps(*scales[pn].add(b) * DOWN);
                    for r in 0..R {
                        for h in 0..2 {
                            let t = &mut total[pn][r][h];
                            *t = _mm512_fmadd_ps(sum[pn][r][h], s, *t);
                        }
                    }
                }
            }
            let mut lanes = [0f32; 32];
            for pn in 0..P {
                for r in 0..R {
                    _mm512_storeu_ps(lanes.as_mut_ptr(), total[pn][r][0]);
                    _mm512_storeu_ps(lanes.as_mut_ptr().add(16), total[pn][r][1]);
                    for (i, v) in lanes.iter().enumerate() {
                        *out[pn].add(r * 32 + fused_lane_row(i)) = *v;
                    }
                }
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn fused_rows512<const R: usize, const FLUSH: bool>(
        a: &[*const f32],
        scaled: bool,
        k: usize,
        c: *const u8,
        s: *const f32,
        o: *mut f32,
    ) {
        // SAFETY: forwarded; the features are enabled here.
        unsafe { fused512::<R, 1, FLUSH>(a, scaled, k, [c], [s], [o]) }
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn fused_pair_rows512<const R: usize, const FLUSH: bool>(
        a: &[*const f32],
        scaled: bool,
        k: usize,
        c: [*const u8; 2],
        s: [*const f32; 2],
        o: [*mut f32; 2],
    ) {
        // SAFETY: forwarded; the features are enabled here.
        unsafe { fused512::<R, 2, FLUSH>(a, scaled, k, c, s, o) }
    }

    /// AVX-512 fused decode kernel on two panels at once, 1 or 2 rows.
    ///
    /// # Safety
    /// The [`super::FusedPairFn`] contract; AVX-512F/BW available.
    pub unsafe fn fused_pair_avx512<const FLUSH: bool>(
        a: &[*const f32],
        scaled: bool,
        k: usize,
        c: [*const u8; 2],
        s: [*const f32; 2],
        o: [*mut f32; 2],
    ) {
        // SAFETY: forwarded.
        unsafe {
            crate::kernels::dispatch_rows!(fused_pair_rows512<FLUSH>, "fp8 fused panel pair", a, (a, scaled, k, c, s, o); 1 2)
        }
    }

    /// AVX-512 fused decode kernel, 1 to 4 rows.
    ///
    /// # Safety
    /// The [`super::FusedFn`] contract; AVX-512F/BW available.
    pub unsafe fn fused_avx512<const FLUSH: bool>(
        a: &[*const f32],
        scaled: bool,
        k: usize,
        c: *const u8,
        s: *const f32,
        o: *mut f32,
    ) {
        // SAFETY: forwarded.
        unsafe {
            crate::kernels::dispatch_rows!(fused_rows512<FLUSH>, "fp8 fused panel", a, (a, scaled, k, c, s, o); 1 2 3 4)
        }
    }

    /// 256-bit fused kernel: the decode and arithmetic of `fused512` on 32-byte halves (so the
    /// same bits). With two rows the block sums alone take 8 of the 16 registers; the totals,
    /// touched once per block, are kept in memory.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)]
    unsafe fn fused256<const R: usize, const P: usize, const FLUSH: bool>(
        a: &[*const f32],
        scaled: bool,
        k: usize,
        codes: [*const u8; P],
        scales: [*const f32; P],
        out: [*mut f32; P],
    ) {
        // SAFETY: as in `fused512` (P panels likewise).
        unsafe {
            let zero = _mm256_setzero_si256();
            let high = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
            // The totals live in `out` until the end, row r's slot 2h + u (the outputs of half
            // h fed by vpunpcklbw (u = 0) or vpunpckhbw (u = 1)) at `out + 32r + 8(2h + u)`:
            // in memory the compiler cannot keep them in the registers the line loop needs
            // (AMD Zen 3 from cache, two rows: totals in a local array 6.4 ns per line, here
            // 5.6-5.8, the block scale in the activations before 5.5-5.7).
            for o in out {
                std::ptr::write_bytes(o, 0, R * 32);
            }
            // The block's activations times 2⁶⁴, so each line's broadcasts are plain loads.
            let mut x = [[0f32; super::BLOCK]; R];
            let pf = fp8_distance();
            let up = if scaled { 1.0 } else { UP };
            for b in 0..k / super::BLOCK {
                crate::kernels::scaled_inputs(a, b * super::BLOCK, super::BLOCK, up, &mut x);
                let lines = b * super::BLOCK / 2..(b + 1) * super::BLOCK / 2;
                let s: [__m256; P] =
                    std::array::from_fn(|pn| _mm256_set1_ps(*scales[pn].add(b) * DOWN));
                // With `FLUSH`, two rows take the block half by half (its 4 KB of codes stay
                // in L1 for the second): 4 sums live rather than 8, which spilled with the
                // extra register (AMD Zen 4 from cache, two rows: 7.6 -> 4.4 ns per line;
                // without `FLUSH` the line loop keeps 2.9 against 4.4).
                let passes: &[(usize, usize)] = if R > 1 && FLUSH {
                    &[(0, 1), (1, 2)]
                } else {
                    &[(0, 2)]
                };
                for &(h0, h1) in passes {
                    let mut acc = [[[_mm256_setzero_ps(); 4]; R]; P];
                    for q in lines.clone() {
                        let i = 2 * q - b * super::BLOCK;
                        let x0: [__m256; R] = std::array::from_fn(|r| _mm256_set1_ps(x[r][i]));
                        let x1: [__m256; R] = std::array::from_fn(|r| _mm256_set1_ps(x[r][i + 1]));
                        for pn in 0..P {
                            let line = codes[pn].add(q * 64);
                            if h0 == 0 {
                                crate::kernels::prefetch::ahead(line, pf);
                            }
                            for h in h0..h1 {
                                let v = _mm256_loadu_si256(line.add(32 * h) as *const __m256i);
                                let halves =
                                    [_mm256_unpacklo_epi8(zero, v), _mm256_unpackhi_epi8(zero, v)];
                                for (u, half) in halves.into_iter().enumerate() {
                                    let pairs = top_codes256::<FLUSH>(half);
                                    let w0 = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
                                    let w1 = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
                                    for r in 0..R {
                                        let c = &mut acc[pn][r][2 * h + u];
                                        *c = _mm256_fmadd_ps(w0, x0[r], *c);
                                        *c = _mm256_fmadd_ps(w1, x1[r], *c);
                                    }
                                }
                            }
                        }
                    }
                    for pn in 0..P {
                        for r in 0..R {
                            for slot in 2 * h0..2 * h1 {
                                let t = out[pn].add(32 * r + 8 * slot);
                                _mm256_storeu_ps(
                                    t,
                                    _mm256_fmadd_ps(acc[pn][r][slot], s[pn], _mm256_loadu_ps(t)),
                                );
                            }
                        }
                    }
                }
            }
            for o in out {
                for r in 0..R {
                    let mut lanes = [0f32; 32];
                    std::ptr::copy_nonoverlapping(o.add(32 * r), lanes.as_mut_ptr(), 32);
                    for (at, x) in lanes.iter().enumerate() {
                        // Slot 2h + u, lane i: 128-bit lane i/4, byte pair 4u + i%4 of it.
                        let (h, u, i) = (at / 16, (at / 8) % 2, at % 8);
                        *o.add(r * 32 + 16 * h + 8 * (i / 4) + 4 * u + i % 4) = *x;
                    }
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn fused_rows256<const R: usize, const FLUSH: bool>(
        a: &[*const f32],
        scaled: bool,
        k: usize,
        c: *const u8,
        s: *const f32,
        o: *mut f32,
    ) {
        // SAFETY: forwarded; the features are enabled here.
        unsafe { fused256::<R, 1, FLUSH>(a, scaled, k, [c], [s], [o]) }
    }

    /// AVX2 fused decode kernel on two panels at once, one row (eight chains of 8 lanes: more
    /// rows would spill).
    ///
    /// # Safety
    /// The [`super::FusedPairFn`] contract with one row; AVX2 and FMA available.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fused_pair_avx2<const FLUSH: bool>(
        a: &[*const f32],
        scaled: bool,
        k: usize,
        c: [*const u8; 2],
        s: [*const f32; 2],
        o: [*mut f32; 2],
    ) {
        assert!(a.len() == 1, "fp8 avx2 fused panel pair takes one row");
        // SAFETY: forwarded; the features are enabled here.
        unsafe { fused256::<1, 2, FLUSH>(a, scaled, k, c, s, o) }
    }

    /// AVX2 fused decode kernel, 1 to [`crate::kernels::MAX_ROWS`] rows: one or two rows
    /// decode in registers ([`fused256`]), more through a decoded block ([`fused_many256`]).
    ///
    /// # Safety
    /// The [`super::FusedFn`] contract with at most [`crate::kernels::MAX_ROWS`] rows; AVX2,
    /// FMA and F16C available.
    pub unsafe fn fused_avx2<const FLUSH: bool>(
        a: &[*const f32],
        scaled: bool,
        k: usize,
        c: *const u8,
        s: *const f32,
        o: *mut f32,
    ) {
        // SAFETY: forwarded.
        unsafe {
            if a.len() > 2 {
                return fused_many256::<FLUSH>(a, scaled, k, c, s, o);
            }
            crate::kernels::dispatch_rows!(fused_rows256<FLUSH>, "fp8 avx2 fused panel", a, (a, scaled, k, c, s, o); 1 2)
        }
    }

    /// 16 codes at `p` as the bf16 bits of their values times 2⁻¹²⁰, in order: sign-extended
    /// to 16 bits and shifted left by 4, a code's `s eeee mmm` lands on bits 15 and 10..4 (a
    /// bf16 with exponent field `eeee`, mantissa `mmm`, subnormal for `eeee = 0` as the code
    /// is), the sign's copies on bits 14..11 masked off.
    ///
    /// # Safety
    /// AVX2 available; 16 readable bytes at `p`.
    #[inline(always)]
    pub(crate) unsafe fn decode16_down120<const FLUSH: bool>(p: *const u8) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe {
            let v = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.cast()));
            top_codes256::<FLUSH>(_mm256_slli_epi16::<8>(v))
        }
    }

    /// Three rows and more: per 128-input block, the block's 32 × 128 codes decoded once into
    /// an L1 buffer as bf16 of value · 2⁻¹²⁰ (3 instructions per 16 codes, where the exact
    /// decode takes 13), and the bf16 FMA kernel's five-row register blocks
    /// ([`crate::kernels::avx2::chunk_rows`]) over it and the rows times 2⁶⁴ (`scaled` rows as
    /// they are, else copied times 2⁶⁴ into another L1 buffer); each block's sums are added to
    /// `out` as `fma(sum, scale · 2⁵⁶, total)`. The next block's codes are prefetched while
    /// the kernel runs. Per lane this is [`fused256`]'s arithmetic in its order, so each row
    /// equals the one-row kernel's result bit for bit.
    ///
    /// # Safety
    /// The [`super::FusedFn`] contract with at most [`crate::kernels::MAX_ROWS`] rows; AVX2
    /// and FMA available.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn fused_many256<const FLUSH: bool>(
        a: &[*const f32],
        scaled: bool,
        k: usize,
        codes: *const u8,
        scales: *const f32,
        out: *mut f32,
    ) {
        use crate::kernels::MAX_ROWS;
        const BLOCK: usize = super::BLOCK;
        #[repr(align(64))]
        struct Weights([u16; 32 * BLOCK]);
        #[repr(align(64))]
        struct Inputs([f32; MAX_ROWS * BLOCK]);
        #[repr(align(64))]
        struct Sums([f32; MAX_ROWS * 32]);
        let n = a.len();
        assert!(
            n <= MAX_ROWS,
            "fp8 avx2 fused kernel takes at most {MAX_ROWS} rows"
        );
        // Out starts as the totals' zeros (fma(sum, s, 0) is fused256's first block too).
        // SAFETY: out holds 32 floats per row.
        unsafe { std::ptr::write_bytes(out, 0, n * 32) };
        // No buffer is read before this call writes it (a block's codes, inputs and sums).
        let mut weights = std::mem::MaybeUninit::<Weights>::uninit();
        let mut inputs = std::mem::MaybeUninit::<Inputs>::uninit();
        let mut sums = std::mem::MaybeUninit::<Sums>::uninit();
        // SAFETY: field addresses of the buffers, nothing read.
        let (w, x, sums) = unsafe {
            (
                std::ptr::addr_of_mut!((*weights.as_mut_ptr()).0).cast::<u16>(),
                std::ptr::addr_of_mut!((*inputs.as_mut_ptr()).0).cast::<f32>(),
                std::ptr::addr_of_mut!((*sums.as_mut_ptr()).0).cast::<f32>(),
            )
        };
        let mut rows = [std::ptr::null::<f32>(); MAX_ROWS];
        let up = _mm256_set1_ps(UP);
        for b in 0..k / BLOCK {
            // SAFETY: block b's 32·128 codes, k/128 scales and 128 inputs of every row lie
            // inside the contract's buffers; the buffers hold a block's codes, 32 rows of its
            // inputs and 32 rows of sums.
            unsafe {
                let block = codes.add(b * 32 * BLOCK);
                for i in (0..32 * BLOCK).step_by(16) {
                    _mm256_store_si256(w.add(i).cast(), decode16_down120::<FLUSH>(block.add(i)));
                }
                for (r, &row) in a.iter().enumerate() {
                    let at = row.add(b * BLOCK);
                    if scaled {
                        rows[r] = at;
                        continue;
                    }
                    for j in (0..BLOCK).step_by(8) {
                        let v = _mm256_mul_ps(_mm256_loadu_ps(at.add(j)), up);
                        _mm256_store_ps(x.add(r * BLOCK + j), v);
                    }
                    rows[r] = x.add(r * BLOCK);
                }
                // The next block's codes (after the last, the next panel's, which a task
                // usually reads next).
                let next = (block.wrapping_add(32 * BLOCK), 32 * BLOCK / 64);
                crate::kernels::avx2::chunk_rows(&rows[..n], BLOCK / 2, w, sums, false, 0, next);
                let s = _mm256_set1_ps(*scales.add(b) * DOWN);
                for i in (0..n * 32).step_by(8) {
                    let total = _mm256_fmadd_ps(
                        _mm256_load_ps(sums.add(i)),
                        s,
                        _mm256_loadu_ps(out.add(i)),
                    );
                    _mm256_storeu_ps(out.add(i), total);
                }
            }
        }
    }

    /// 8 codes at `p` as 8 floats (exact values).
    ///
    /// # Safety
    /// AVX2 and F16C available; 8 readable bytes at `p`.
    #[inline(always)]
    pub(crate) unsafe fn decode8(p: *const u8) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe {
            let v = _mm_cvtepu8_epi16(_mm_loadl_epi64(p as *const __m128i));
            let sign = _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x80)), 8);
            let mag = _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x7F)), 7);
            _mm256_mul_ps(
                _mm256_cvtph_ps(_mm_or_si128(sign, mag)),
                _mm256_set1_ps(256.0),
            )
        }
    }

    /// 16 codes at `p` as the bf16 bits of their exact values, in order.
    ///
    /// # Safety
    /// AVX2 and F16C available; 16 readable bytes at `p`.
    #[inline(always)]
    unsafe fn decode16_bf16(p: *const u8) -> __m256i {
        // SAFETY: forwarded.
        unsafe {
            let up = _mm256_set1_ps(256.0);
            decode16_bf16_times(p, up, up)
        }
    }

    /// 16 codes at `p` as the bf16 bits of their values times `2⁻⁸ · m`, in order (codes
    /// 0..8 times the lanes of `m_lo`, 8..16 of `m_hi`). Sign-extended to 16 bits and shifted
    /// left by 7, a code's bits 15 and 13..7 are `s eeee mmm` placed as the half-precision
    /// number `value · 2⁻⁸` (bit 14, a copy of the sign, masked off): every E4M3 value,
    /// subnormals included, is then a half-precision number with at most 4 significant bits.
    /// The float's upper 16 bits are the exact bf16 of the product when it is a normal number
    /// (a power-of-two `m` keeps the 4 bits) or zero.
    ///
    /// # Safety
    /// AVX2 and F16C available; 16 readable bytes at `p`.
    #[inline(always)]
    pub(crate) unsafe fn decode16_bf16_times(p: *const u8, m_lo: __m256, m_hi: __m256) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe {
            let halves = _mm256_and_si256(
                _mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(_mm_loadu_si128(p.cast()))),
                _mm256_set1_epi16(0xBF80u16 as i16),
            );
            let lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(halves)), m_lo);
            let hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256::<1>(halves)), m_hi);
            let lo = _mm256_srli_epi32::<16>(_mm256_castps_si256(lo));
            let hi = _mm256_srli_epi32::<16>(_mm256_castps_si256(hi));
            // packus interleaves 128-bit lanes: [lo 0-3, hi 0-3, lo 4-7, hi 4-7].
            _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(lo, hi))
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    unsafe fn decode256(codes: *const u8, n: usize, out: *mut u16) {
        // SAFETY: as in decode512: 16-code steps inside the n codes and n outputs; the
        // prefetch (one per 64-byte line, two blocks ahead) never faults.
        unsafe {
            for i in (0..n).step_by(16) {
                if i % 64 == 0 {
                    prefetch_ahead(codes, i, n);
                }
                _mm256_storeu_si256(out.add(i).cast(), decode16_bf16(codes.add(i)));
            }
        }
    }

    /// AVX-512BW decoder.
    ///
    /// # Safety
    /// The [`super::DecodeFn`] contract; AVX-512F/BW available.
    pub unsafe fn decode_avx512(codes: *const u8, n: usize, out: *mut u16) {
        debug_assert!(n.is_multiple_of(32));
        // SAFETY: forwarded.
        unsafe { decode512(codes, n, out) }
    }

    /// AVX2 + F16C decoder.
    ///
    /// # Safety
    /// The [`super::DecodeFn`] contract; AVX2 and F16C available.
    pub unsafe fn decode_avx2(codes: *const u8, n: usize, out: *mut u16) {
        debug_assert!(n.is_multiple_of(16));
        // SAFETY: forwarded.
        unsafe { decode256(codes, n, out) }
    }
}

/// The scalar twin of [`FusedFn`]: its FMA chains in fp32 from the codes' values
/// ([`fused_code_value`]; codes in panel order: `W[j][kk]` at
/// `(kk/2)·64 + (j/16)·32 + (j%16)·2 + kk%2`), on unscaled rows.
///
/// # Safety
/// The [`FusedFn`] contract (any number of rows).
pub unsafe fn fused_scalar<const FLUSH: bool>(
    a: &[*const f32],
    k: usize,
    codes: *const u8,
    scales: *const f32,
    out: *mut f32,
) {
    // SAFETY: the contract.
    unsafe {
        for (r, &row) in a.iter().enumerate() {
            for j in 0..32 {
                let mut total = 0f32;
                for b in 0..k / BLOCK {
                    let mut sum = 0f32;
                    for kk in b * BLOCK..(b + 1) * BLOCK {
                        let at = (kk / 2) * 64 + (j / 16) * 32 + (j % 16) * 2 + kk % 2;
                        sum = fused_code_value::<FLUSH>(*codes.add(at)).mul_add(*row.add(kk), sum);
                    }
                    total = sum.mul_add(*scales.add(b), total);
                }
                *out.add(r * 32 + j) = total;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_kernels_match_the_scalar_model() {
        let mut variants = Vec::new();
        for level in [Level::Avx2, Level::Avx512Base] {
            if crate::isa::allows(level) {
                for flush in [false, true] {
                    let fused = fused_variant(level, flush).expect("a fused kernel from AVX2 up");
                    assert_eq!(fused.flushes_subnormals, flush);
                    variants.push(fused);
                }
            }
        }
        for fused in variants {
            check_fused(fused);
        }
    }

    #[test]
    fn fused_code_values_zero_only_subnormal_codes_when_flushing() {
        for code in (0..=255u8).filter(|b| b & 0x7F != 0x7F) {
            let exact = e4m3_to_f32(code);
            assert_eq!(fused_code_value::<false>(code).to_bits(), exact.to_bits());
            let flushed = fused_code_value::<true>(code);
            if exact.abs() < 2f32.powi(-6) {
                assert_eq!(flushed, 0.0, "code {code:#04x}");
            } else {
                assert_eq!(flushed.to_bits(), exact.to_bits(), "code {code:#04x}");
            }
        }
        // The policy: zero on Intel, exact elsewhere, unless the environment says otherwise.
        if std::env::var("KT_KERNEL_FP8_SUBNORMALS").is_err() {
            let intel = crate::isa::global().is_ok_and(|s| s.features.vendor == "GenuineIntel");
            assert_eq!(crate::isa::flush_subnormal_codes(), intel);
        }
    }

    #[test]
    fn avx2_many_row_calls_equal_one_row_calls_bit_for_bit() {
        // From three rows the AVX2 kernel takes the decoded-block path; per lane its
        // arithmetic is the one-row kernel's.
        if !crate::isa::allows(Level::Avx2) {
            return;
        }
        let variants = [false, true].map(|f| fused_variant(Level::Avx2, f).expect("AVX2 kernel"));
        let mut rng = crate::rng::Rng::new(10);
        let k = 512;
        // Every finite code, cycled (zeros and subnormals included).
        let codes: Vec<u8> = (0..=255u8)
            .filter(|b| b & 0x7F != 0x7F)
            .cycle()
            .take(32 * k)
            .collect();
        let scales = [0.5f32, 3e-3, 17.0, 1.0];
        for fused in variants {
            for rows in [2, 3, 5, 7, 13, fused.rows] {
                // Rows of very different magnitudes: small activations must not underflow.
                let xs: Vec<Vec<f32>> = (0..rows)
                    .map(|r| rng.normals(k, 10f32.powi(r as i32 % 7 - 4)))
                    .collect();
                let ptrs: Vec<*const f32> = xs.iter().map(|x| x.as_ptr()).collect();
                // The same rows handed over times 2⁶⁴, as the layer packs them.
                let up: Vec<Vec<f32>> = xs
                    .iter()
                    .map(|x| x.iter().map(|v| v * crate::formats::ROWS_UP64).collect())
                    .collect();
                let up_ptrs: Vec<*const f32> = up.iter().map(|x| x.as_ptr()).collect();
                let (c, s) = (codes.as_ptr(), scales.as_ptr());
                for (scaled, a) in [(false, &ptrs), (true, &up_ptrs)] {
                    let mut all = vec![f32::NAN; rows * 32];
                    // SAFETY: buffers sized as the contract asks; the level allows the kernel.
                    unsafe { (fused.run)(a, scaled, k, c, s, all.as_mut_ptr()) };
                    for (r, &row) in ptrs.iter().enumerate() {
                        let mut one = [f32::NAN; 32];
                        // SAFETY: as above, one row.
                        unsafe { (fused.run)(&[row], false, k, c, s, one.as_mut_ptr()) };
                        let got = &all[r * 32..(r + 1) * 32];
                        assert!(
                            got.iter()
                                .zip(&one)
                                .all(|(g, o)| g.to_bits() == o.to_bits()),
                            "rows={rows} scaled={scaled} row {r}: {got:?} vs {one:?}"
                        );
                    }
                }
            }
        }
    }

    /// The kernel equals its twin bit for bit, on rows as they are and on rows handed over
    /// times 2⁶⁴.
    fn check_fused(fused: Fused) {
        let mut rng = crate::rng::Rng::new(9);
        for k in [128usize, 384, 2048] {
            let codes: Vec<u8> = (0..32 * k)
                .map(|i| match i % 97 {
                    0 => 0x00, // zero
                    1 => 0x83, // a negative subnormal
                    _ => match rng.below(256) as u8 {
                        b if b & 0x7F == 0x7F => b & 0xF0, // no NaN codes
                        b => b,
                    },
                })
                .collect();
            let scales: Vec<f32> = (0..k / BLOCK).map(|b| 0.01 * (b + 1) as f32).collect();
            for rows in 1..=fused.rows {
                let xs: Vec<Vec<f32>> = (0..rows).map(|_| rng.normals(k, 1.0)).collect();
                let ptrs: Vec<*const f32> = xs.iter().map(|x| x.as_ptr()).collect();
                let up: Vec<Vec<f32>> = xs
                    .iter()
                    .map(|x| x.iter().map(|v| v * crate::formats::ROWS_UP64).collect())
                    .collect();
                let up_ptrs: Vec<*const f32> = up.iter().map(|x| x.as_ptr()).collect();
                let mut want = vec![0f32; rows * 32];
                let model = if fused.flushes_subnormals {
                    fused_scalar::<true>
                } else {
                    fused_scalar::<false>
                };
                // SAFETY: buffers sized as the contract asks.
                unsafe { model(&ptrs, k, codes.as_ptr(), scales.as_ptr(), want.as_mut_ptr()) };
                for (scaled, a) in [(false, &ptrs), (true, &up_ptrs)] {
                    let mut got = vec![f32::NAN; rows * 32];
                    // SAFETY: as above; the level allows the kernel.
                    unsafe {
                        let (c, s) = (codes.as_ptr(), scales.as_ptr());
                        (fused.run)(a, scaled, k, c, s, got.as_mut_ptr())
                    };
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "k={k} rows={rows} scaled={scaled} [{i}] {g} vs {w}"
                        );
                    }
                }
                // The two-panel kernel: each panel's bits as the scalar model's, the second
                // panel with other codes and scales.
                let Some((pair, max_rows)) = fused.pair.filter(|&(_, max)| rows <= max) else {
                    continue;
                };
                assert!(max_rows <= fused.rows);
                let other: Vec<u8> = codes.iter().rev().copied().collect();
                let other_scales: Vec<f32> = scales.iter().map(|s| -0.5 * s).collect();
                let mut want2 = vec![0f32; rows * 32];
                // SAFETY: as above.
                unsafe {
                    let (c, s) = (other.as_ptr(), other_scales.as_ptr());
                    model(&ptrs, k, c, s, want2.as_mut_ptr())
                };
                for (scaled, a) in [(false, &ptrs), (true, &up_ptrs)] {
                    let mut got = [vec![f32::NAN; rows * 32], vec![f32::NAN; rows * 32]];
                    let [g0, g1] = &mut got;
                    // SAFETY: as above, per panel.
                    unsafe {
                        pair(
                            a,
                            scaled,
                            k,
                            [codes.as_ptr(), other.as_ptr()],
                            [scales.as_ptr(), other_scales.as_ptr()],
                            [g0.as_mut_ptr(), g1.as_mut_ptr()],
                        )
                    };
                    for (p, want) in [&want, &want2].into_iter().enumerate() {
                        for (i, (g, w)) in got[p].iter().zip(want).enumerate() {
                            assert_eq!(
                                g.to_bits(),
                                w.to_bits(),
                                "pair k={k} rows={rows} scaled={scaled} panel {p} [{i}]"
                            );
                        }
                    }
                }
            }
        }
    }

    fn decode(d: &Fp8Decoder, codes: &[u8]) -> Vec<u16> {
        let mut out = vec![0xFFFFu16; codes.len()];
        // SAFETY: sizes match; the caller checked the ISA; no NaN codes.
        unsafe { (d.decode)(codes.as_ptr(), codes.len(), out.as_mut_ptr()) };
        out
    }

    /// The scaling decoders equal their scalar twin on every finite code in every lane, for
    /// scales of both signs and magnitudes from tiny to huge, and stay within a bf16 rounding of
    /// the exact product.
    #[test]
    fn scaling_decoders_equal_their_scalar_twin() {
        let finite: Vec<u8> = (0..=255u8).filter(|b| b & 0x7F != 0x7F).collect();
        let mut codes = Vec::new();
        for shift in 0..64 {
            codes.extend(finite.iter().cycle().skip(shift).take(finite.len()));
        }
        codes.truncate(codes.len() / 32 * 32 - 32); // not a whole number of 64-code steps
        let mut rng = crate::rng::Rng::new(5);
        let mut scales = vec![1.0f32, -1.0, 3.7e-5, -2.5e-3, 1.0e30, 0.0];
        scales.extend((0..8).map(|_| rng.normal() * 0.01));
        let mut decoders = vec![decoder_for(Level::Generic)];
        if crate::isa::allows(Level::Avx512Vbmi) {
            decoders.push(decoder_for(Level::Avx512Vbmi));
        }
        #[cfg(target_arch = "x86_64")]
        if crate::isa::allows(Level::Avx512Vbmi) {
            assert!(decoders.iter().any(|d| d.name == "avx512-vbmi"));
        }
        for &scale in &scales {
            let mut want = vec![0u16; codes.len()];
            // SAFETY: sizes match; no NaN codes.
            unsafe { decode_scaled_scalar(codes.as_ptr(), codes.len(), scale, want.as_mut_ptr()) };
            for (&c, &w) in codes.iter().zip(&want) {
                let exact = e4m3_to_f32(c) as f64 * scale as f64;
                let got = half::bf16::from_bits(w).to_f64();
                assert!(
                    (got - exact).abs() <= exact.abs() * 2f64.powi(-8),
                    "{c:#x} {scale}"
                );
            }
            for d in &decoders {
                let mut got = vec![0xFFFFu16; codes.len()];
                let f = d.decode_scaled.expect("these decoders scale");
                // SAFETY: as above; the ISA was checked.
                unsafe { f(codes.as_ptr(), codes.len(), scale, got.as_mut_ptr()) };
                assert_eq!(got, want, "{} scale {scale}", d.name);
            }
        }
    }

    #[test]
    fn every_decoder_gives_the_exact_bf16_of_every_finite_code() {
        // Every finite code, in an order that puts each in every lane position.
        let finite: Vec<u8> = (0..=255u8).filter(|b| b & 0x7F != 0x7F).collect();
        let mut codes = Vec::new();
        for shift in 0..32 {
            codes.extend(finite.iter().cycle().skip(shift).take(finite.len()));
        }
        codes.truncate(codes.len() / 32 * 32);
        let want: Vec<u16> = codes.iter().map(|&b| code_to_bf16(b)).collect();
        for (&b, &w) in codes.iter().zip(&want) {
            let v = half::bf16::from_bits(w).to_f32();
            assert!(
                v == e4m3_to_f32(b) && v.is_sign_negative() == (b & 0x80 != 0),
                "{b:#x}"
            );
        }
        let mut decoders = vec![decoder_for(Level::Generic)];
        if crate::isa::allows(Level::Avx2) {
            decoders.push(decoder_for(Level::Avx2));
        }
        if crate::isa::allows(Level::Avx512Base) {
            decoders.push(decoder_for(Level::Avx512Base));
        }
        if crate::isa::allows(Level::Avx512Vbmi) {
            decoders.push(decoder_for(Level::Avx512Vbmi));
        }
        #[cfg(target_arch = "x86_64")]
        if crate::isa::allows(Level::Avx2) {
            assert!(decoders.iter().any(|d| d.name == "avx2"));
        }
        #[cfg(target_arch = "x86_64")]
        if crate::isa::allows(Level::Avx512Vbmi) {
            assert!(decoders.iter().any(|d| d.name == "avx512-vbmi"));
        }
        // An odd number of 32-code steps exercises the VBMI decoder's tail.
        let odd = &codes[..codes.len() / 64 * 64 - 32];
        for d in &decoders {
            assert_eq!(decode(d, &codes), want, "{}", d.name);
            assert_eq!(decode(d, odd), want[..odd.len()], "{} (odd)", d.name);
        }
    }
}
