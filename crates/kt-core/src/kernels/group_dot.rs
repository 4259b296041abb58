//! Group dot products on bytes: the activation rows and the multiply-accumulate toolbox that
//! the integer formats' kernels are built from ([`crate::formats::int8`],
//! [`crate::formats::int4`]).
//!
//! A kernel multiplies up to a few token rows against one 32-row group of a weight matrix;
//! activations arrive quantized per token row and biased to unsigned (`a + 128`), which
//! `vpdpbusd` needs; `out = Σ a_u8·w − 128·Σ w` (the row sums are precomputed at load) is the
//! exact signed dot product. Every variant returns the same i32 values as its format's scalar
//! twin.
//!
//! An activation row is [`ACT_COPIES`] copies of its `k` values: biased (`a + 128`, read by the
//! scalar twins, VNNI and AMX), signed `a`, and `|a|` — the operands of the sign trick, so the
//! AVX2 kernels broadcast them instead of recomputing them for every weight line
//! ([`fill_activation_copies`]).
use crate::isa::Level;

/// Copies of its values in an activation row (biased, signed, absolute).
pub const ACT_COPIES: usize = 3;

/// Complete an activation row whose first `k` bytes hold the biased values: the signed values
/// and their magnitudes follow.
#[inline(always)]
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

/// `out[r*32 + j] = Σ_kk (a_rows[r][kk] − 128) · W[j][kk]` for one 32-row group of a format's
/// weights (`W` as the format defines it, e.g. `16·v` for AMXINT4).
///
/// Values are those the quantizer produces: weights in [−127, 127], activations in [1, 255]
/// (signed [−127, 127] biased by 128); within that range every variant is exact.
///
/// # Safety
/// The CPU supports the variant; each `a_rows[r]` points to an activation row of
/// `ACT_COPIES · k` bytes (see the module docs); `group` to one 32-row group in the
/// format's layout; `row_sums` to 32 values `Σ_kk W[j][kk]`; `out` to `32*rows` i32;
/// `k % 64 == 0`; rows ≤ the variant's block.
pub type GroupDotFn = unsafe fn(
    a_rows: &[*const u8],
    k: usize,
    group: *const u8,
    row_sums: *const i32,
    out: *mut i32,
);

/// A [`GroupDotFn`] on rows packed by 64-byte column block
/// ([`crate::kernels::amx::PackedRows`]): `m` rows, block `c` of row `r` at
/// `packed + c·step_bytes + 64·r`.
///
/// # Safety
/// As [`GroupDotFn`], with `packed` holding `k/64` steps of `step_bytes` (≥ 64·m) bytes in
/// place of the row pointers.
pub type PackedGroupDotFn = unsafe fn(
    packed: *const u8,
    step_bytes: usize,
    m: usize,
    k: usize,
    group: *const u8,
    row_sums: *const i32,
    out: *mut i32,
);

/// A format's vector group kernel for one ISA level, chosen once per layer.
#[derive(Debug, Clone, Copy)]
pub struct VectorKernel {
    /// The kernel ([`GroupDotFn`] contract; the level's ISA is guaranteed by who chose it).
    pub dot: GroupDotFn,
    /// Token rows per call.
    pub rows: usize,
    /// Name, as `__int8_kernel__` reports it ("avx512-vnni", "avx2", ...).
    pub name: &'static str,
}

impl VectorKernel {
    /// A prefetch calibration workload ([`crate::kernels::calibrate::Workload`]) for this
    /// kernel: `gate` and `up` as 32-row groups of `group_bytes` bytes each (2048 inputs per
    /// row), alternating group by group, one activation row.
    pub fn stream_groups(&self, group_bytes: usize, gate: &[u8], up: &[u8]) {
        let k = 2048;
        let a = activation_row(&vec![129u8; k]);
        let sums = [0i32; 32];
        let mut out = [0i32; 32];
        super::calibrate::alternate_panels(gate, up, group_bytes, |group| {
            // SAFETY: a whole group at `group`; one activation row of k values; 32 sums and
            // outputs; the kernel was picked for a level the process runs at.
            unsafe { (self.dot)(&[a.as_ptr()], k, group, sums.as_ptr(), out.as_mut_ptr()) };
            out[0]
        });
    }
}

/// One format's group kernels, one per instruction mix (scalar = its twin).
pub struct GroupDotVariants {
    /// The scalar twin.
    pub scalar: GroupDotFn,
    /// AVX2, sign trick.
    pub avx2: GroupDotFn,
    /// AVX-VNNI (256-bit `vpdpbusd`).
    pub avx_vnni: GroupDotFn,
    /// AVX-512BW, sign trick.
    pub avx512bw: GroupDotFn,
    /// AVX512-VNNI.
    pub avx512_vnni: GroupDotFn,
    /// The most rows one AVX512-VNNI call takes (at most [`crate::kernels::MAX_ROWS`]).
    pub avx512_vnni_rows: usize,
}

impl GroupDotVariants {
    /// The fastest variant at `level` (`KT_KERNEL_CPU_VARIANT` is in `level` already); AVX-VNNI
    /// serves AVX2-level CPUs that have it.
    pub fn pick(&self, level: Level) -> VectorKernel {
        let (dot, rows, name) = if level >= Level::Avx512Vnni {
            (self.avx512_vnni, self.avx512_vnni_rows, "avx512-vnni")
        } else if level >= Level::Avx512Base {
            (self.avx512bw, 6, "avx512bw")
        } else if level >= Level::Avx2 && crate::isa::has_feature("avx_vnni") {
            (self.avx_vnni, 4, "avx-vnni")
        } else if level >= Level::Avx2 {
            (self.avx2, 4, "avx2")
        } else {
            (self.scalar, ROWS, "scalar")
        };
        VectorKernel { dot, rows, name }
    }
}

/// Rows per call of the 512-bit VNNI variants (the largest vector row block).
pub const ROWS: usize = 8;

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    //! The byte multiply-accumulate ops the integer loops are generic over: the VNNI
    //! instruction (`vpdpbusd`, on biased unsigned activations, fixed up by the row sums at the
    //! end) or the sign trick without VNNI (`vpmaddubsw` on |a| and sign-moved weights, then
    //! `vpmaddwd` with ones; with |a|, |w| ≤ 127 every i16 pair sum ≤ 32258 is exact, and −128
    //! never occurs because the quantizers do not produce it). The nibble ops serve 4-bit
    //! weights: AVX2 multiplies the unsigned nibbles `v + 8` with the signed activations,
    //! AVX-VNNI the sign-extended nibbles with the biased ones (`Op256::dot_nibbles`). Each op
    //! is a few instructions; the loops, layouts and epilogues are shared, so the variants this
    //! CPU cannot run differ from tested code only in that op.
    use std::arch::x86_64::*;

    /// The multiply-accumulate on 512-bit lanes: `acc += Σ_4 a_u8 · w_i8` per i32 lane.
    ///
    /// # Safety
    /// Every method needs the CPU features of the kernel that instantiates it (they are
    /// register-only operations: nothing is read or written through a pointer).
    pub(crate) trait Op512 {
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

    /// The items an op on biased activations shares at either width: the quad as it is, and
    /// `$dpbusd` (a `vpdpbusd` on `$vec` lanes) as the multiply-accumulate.
    macro_rules! biased_dpbusd_items {
        ($vec:ty, $dpbusd:ident) => {
            const BIASED: bool = true;
            type Act = $vec;
            #[inline(always)]
            unsafe fn prep(quad: $vec) -> $vec {
                quad
            }
            #[inline(always)]
            unsafe fn dot(acc: $vec, a: $vec, w: $vec) -> $vec {
                // SAFETY: only inlined into functions with the op's features enabled.
                unsafe { $dpbusd(acc, a, w) }
            }
        };
    }

    pub(crate) struct Vnni512;
    impl Op512 for Vnni512 {
        biased_dpbusd_items!(__m512i, _mm512_dpbusd_epi32);
    }

    /// AVX-512BW without VNNI: the sign trick (AVX-512 has no `vpsignb`: negate under a mask).
    pub(crate) struct Bw512;
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
    pub(crate) trait Op256 {
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
    pub(crate) const NIBBLE_LINES_PER_WIDEN: usize = 4;

    /// AVX2: the sign trick with `vpsignb`.
    pub(crate) struct Avx2Sign;
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

    /// An [`Op256`] on biased activations with a `vpdpbusd` of 256-bit lanes, `$dpbusd`.
    macro_rules! vnni256_op {
        ($(#[$doc:meta])* $name:ident, $dpbusd:ident) => {
            $(#[$doc])*
            pub(crate) struct $name;
            impl Op256 for $name {
                biased_dpbusd_items!(__m256i, $dpbusd);
                /// A partial is already i32 lanes.
                #[inline(always)]
                unsafe fn dot_nibbles(
                    partial: __m256i,
                    a_lo: __m256i,
                    w_lo: __m256i,
                    a_hi: __m256i,
                    w_hi: __m256i,
                ) -> __m256i {
                    // SAFETY: only inlined into functions with the op's features enabled.
                    unsafe { $dpbusd($dpbusd(partial, a_lo, w_lo), a_hi, w_hi) }
                }
                #[inline(always)]
                unsafe fn widen_nibbles(acc: __m256i, partial: __m256i) -> __m256i {
                    // SAFETY: as above.
                    unsafe { _mm256_add_epi32(acc, partial) }
                }
            }
        };
    }

    vnni256_op!(
        /// AVX-VNNI (VEX-encoded `vpdpbusd`, CPUs with AVX2 but no AVX-512).
        AvxVnni,
        _mm256_dpbusd_avx_epi32
    );
    #[cfg(test)]
    vnni256_op!(
        /// [`AvxVnni`] with [`dpbusd_avx2`]: its loops on any AVX2 CPU (tests).
        EmulatedAvxVnni,
        dpbusd_avx2
    );

    /// `vpdpbusd` on 256-bit lanes with AVX2 alone, exactly: `acc + Σ_4 u·s` per i32 lane
    /// (`u` unsigned, `s` signed bytes; wrapping, as the instruction). The even and odd bytes
    /// widened to i16 meet in two `vpmaddwd`, whose pair sums (at most 2·255·128) cannot
    /// overflow. For tests: the AVX-VNNI kernels' loops run with it where the CPU lacks AVX-VNNI.
    ///
    /// # Safety
    /// AVX2 in the caller.
    #[cfg(test)]
    #[inline(always)]
    pub(crate) unsafe fn dpbusd_avx2(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        // SAFETY: register-only AVX2 operations (the contract).
        unsafe {
            let u_even = _mm256_and_si256(u, _mm256_set1_epi16(0x00FF));
            let u_odd = _mm256_srli_epi16::<8>(u);
            let s_even = _mm256_srai_epi16::<8>(_mm256_slli_epi16::<8>(s));
            let s_odd = _mm256_srai_epi16::<8>(s);
            let even = _mm256_madd_epi16(u_even, s_even);
            let odd = _mm256_madd_epi16(u_odd, s_odd);
            _mm256_add_epi32(acc, _mm256_add_epi32(even, odd))
        }
    }

    /// Line `line` of a warm group's first half and the same line of its second (1 KiB on),
    /// for the kernels that take both halves in step: both prefetched `pf` ahead, and two
    /// lines of the side stream asked for.
    ///
    /// # Safety
    /// 64 readable bytes at `line` and at `line + 1024`; AVX-512F in the caller.
    #[inline(always)]
    pub(crate) unsafe fn warm_line_pair512(
        line: *const u8,
        pf: usize,
        side: &mut crate::kernels::prefetch::SideStream,
    ) -> [__m512i; 2] {
        crate::kernels::prefetch::ahead(line, pf);
        crate::kernels::prefetch::ahead(line.wrapping_add(1024), pf);
        side.step();
        side.step();
        // SAFETY: the contract above.
        unsafe {
            [
                _mm512_loadu_si512(line as *const __m512i),
                _mm512_loadu_si512(line.add(1024) as *const __m512i),
            ]
        }
    }

    /// Broadcast the 4 activation bytes at `p`.
    ///
    /// # Safety
    /// 4 readable bytes at `p`; AVX-512F in the caller.
    #[inline(always)]
    pub(crate) unsafe fn quad512(p: *const u8) -> __m512i {
        // SAFETY: the contract above.
        unsafe { _mm512_set1_epi32((p as *const i32).read_unaligned()) }
    }

    /// # Safety
    /// 4 readable bytes at `p`; AVX2 in the caller.
    #[inline(always)]
    pub(crate) unsafe fn quad256(p: *const u8) -> __m256i {
        // SAFETY: the contract above.
        unsafe { _mm256_set1_epi32((p as *const i32).read_unaligned()) }
    }

    /// Store the accumulators; for biased ops `out = acc − 128·row_sum` undoes the +128.
    ///
    /// # Safety
    /// AVX-512F in the caller; `s` points to 32 row sums, `o` to `32·R` i32.
    #[inline(always)]
    pub(crate) unsafe fn store512<const R: usize, O: Op512>(
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

    /// `Σ` of the `k` signed bytes at `p` (`k % 32 == 0`), in every i32 lane.
    ///
    /// # Safety
    /// `k` readable bytes at `p`; AVX2 in the caller.
    #[inline(always)]
    pub(crate) unsafe fn signed_sum256(p: *const u8, k: usize) -> __m256i {
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
    pub(crate) unsafe fn store256<const R: usize, O: Op256>(
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

    /// Entry points: a `#[target_feature]` wrapper per (loop, op), dispatched on the row count.
    macro_rules! group_dot_entry {
        ($(#[$doc:meta])* $name:ident, $inner:ident, $body:ident, $op:ty, $features:literal,
         $label:literal; $($r:literal)+) => {
            $(#[$doc])*
            ///
            /// # Safety
            /// The CPU has the features named in the wrapper; the
            /// [`GroupDotFn`](crate::kernels::group_dot::GroupDotFn) contract.
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
    pub(crate) use group_dot_entry;
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use std::arch::x86_64::*;

    /// Eight i32 lanes of `acc + Σ_4 u·s`, as the instruction defines it.
    fn dpbusd_scalar(acc: [i32; 8], u: [u8; 32], s: [u8; 32]) -> [i32; 8] {
        std::array::from_fn(|l| {
            (0..4).fold(acc[l], |sum, b| {
                sum.wrapping_add(u[4 * l + b] as i32 * s[4 * l + b] as i8 as i32)
            })
        })
    }

    /// The emulated `vpdpbusd` that runs the AVX-VNNI kernels' loops on AVX2 CPUs (tests) is
    /// the instruction: against its definition on random and extreme bytes (0, 255 against
    /// −128, 127) and wrapping accumulators, and against the real EVEX and VEX instructions
    /// where the CPU has them.
    #[test]
    fn the_emulated_vpdpbusd_is_the_instruction() {
        if !std::is_x86_feature_detected!("avx2") {
            return;
        }
        let mut rng = crate::rng::Rng::new(41);
        let extremes = [0u8, 1, 127, 128, 129, 255];
        for trial in 0..2000 {
            let byte = |rng: &mut crate::rng::Rng| match trial % 3 {
                0 => rng.below(256) as u8,
                1 => extremes[rng.below(extremes.len())],
                _ => [0u8, 255, 128, 127][rng.below(4)],
            };
            let u: [u8; 32] = std::array::from_fn(|_| byte(&mut rng));
            let s: [u8; 32] = std::array::from_fn(|_| byte(&mut rng));
            let acc: [i32; 8] = std::array::from_fn(|l| match (trial + l) % 4 {
                0 => i32::MAX - rng.below(70000) as i32,
                1 => i32::MIN + rng.below(70000) as i32,
                _ => rng.below(1 << 20) as i32 - (1 << 19),
            });
            let want = dpbusd_scalar(acc, u, s);
            let load = |v: &[u8]| {
                // SAFETY: 32 bytes; AVX available (checked above).
                unsafe { _mm256_loadu_si256(v.as_ptr() as *const __m256i) }
            };
            let lanes = |v: __m256i| {
                let mut out = [0i32; 8];
                // SAFETY: 8 writable i32.
                unsafe { _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, v) };
                out
            };
            // SAFETY: as above.
            let acc_v = unsafe { _mm256_loadu_si256(acc.as_ptr() as *const __m256i) };
            // SAFETY: AVX2 checked above.
            let got = unsafe { emulated(acc_v, load(&u), load(&s)) };
            assert_eq!(lanes(got), want, "trial {trial}");
            if std::is_x86_feature_detected!("avx512vnni")
                && std::is_x86_feature_detected!("avx512vl")
            {
                // SAFETY: the features are checked.
                let real = unsafe { evex(acc_v, load(&u), load(&s)) };
                assert_eq!(lanes(real), want, "evex, trial {trial}");
            }
            if std::is_x86_feature_detected!("avxvnni") {
                // SAFETY: the feature is checked.
                let real = unsafe { vex(acc_v, load(&u), load(&s)) };
                assert_eq!(lanes(real), want, "vex, trial {trial}");
            }
        }
    }

    #[target_feature(enable = "avx2")]
    unsafe fn emulated(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        // SAFETY: AVX2 enabled here.
        unsafe { super::x86::dpbusd_avx2(acc, u, s) }
    }

    #[target_feature(enable = "avx512vnni,avx512vl")]
    unsafe fn evex(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, u, s)
    }

    #[target_feature(enable = "avxvnni")]
    unsafe fn vex(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(acc, u, s)
    }
}
