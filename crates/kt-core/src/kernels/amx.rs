//! AMX tile kernels (C++ in `cpp_kernels/`, one tile program per format) and their software
//! emulator.
//!
//! The same C++ tile program runs on two backends: the real instructions (`amx_hw.cpp`, used
//! only at [`Level::Amx`](crate::isa::Level::Amx), i.e. when CPUID, XCR0 and Linux's permission
//! all agree) and a software emulator of the tile unit (`amx_emu.cpp`). The emulator is how the
//! layout and tile loop are proven on machines without AMX: tests compare it with the scalar
//! twins below, bit for bit. `KT_KERNEL_AMX_EMULATE=1` makes whole layers use the emulated
//! kernels (slow; for tests).
//!
//! Each call handles up to [`ROWS`] token rows (two 16-row tiles) against one 32-output group,
//! with the contracts of [`GroupDotFn`](super::group_dot::GroupDotFn) and
//! [`PanelDotBf16Fn`](super::PanelDotBf16Fn); bf16 additionally needs `k % 32 == 0`.

/// Token rows per call (two tile row blocks).
pub const ROWS: usize = 32;

/// Inputs per bf16 tile step: `k` must be a multiple of this for [`panel_dot_bf16`].
pub const BF16_K_STEP: usize = 32;

extern "C" {
    fn kt_amx_emu_int8_dot(
        a: *const *const u8,
        m: usize,
        k: usize,
        group: *const u8,
        sums: *const i32,
        out: *mut i32,
    ) -> i32;
    fn kt_amx_emu_int4_dot(
        a: *const *const u8,
        m: usize,
        k: usize,
        group: *const u8,
        sums: *const i32,
        out: *mut i32,
    ) -> i32;
    fn kt_amx_emu_bf16_dot(
        a: *const *const u32,
        m: usize,
        k: usize,
        panel: *const u16,
        out: *mut f32,
    ) -> i32;
    fn kt_amx_emu_self_test() -> i32;
}

#[cfg(kt_amx_hw)]
extern "C" {
    fn kt_amx_int8_dot(
        a: *const *const u8,
        m: usize,
        k: usize,
        group: *const u8,
        sums: *const i32,
        out: *mut i32,
    );
    fn kt_amx_int4_dot(
        a: *const *const u8,
        m: usize,
        k: usize,
        group: *const u8,
        sums: *const i32,
        out: *mut i32,
    );
    fn kt_amx_bf16_dot(a: *const *const u32, m: usize, k: usize, panel: *const u16, out: *mut f32);
    fn kt_amx_set_prefetch(bytes: usize);
    fn kt_amx_peak_int8(iters: u64) -> u64;
    fn kt_amx_peak_bf16(iters: u64) -> u64;
}

/// `iters` rounds of four independent `tdpbusd` on full tiles (the tile unit's int8 peak);
/// returns the operations done (2 per multiply-add). 0 in builds without the hardware kernels.
///
/// # Safety
/// AMX usable by this process (the amx level).
pub unsafe fn peak_int8_loop(iters: u64) -> u64 {
    #[cfg(kt_amx_hw)]
    // SAFETY: the caller's contract; the C++ side uses only its own tiles and constants.
    return unsafe { kt_amx_peak_int8(iters) };
    #[cfg(not(kt_amx_hw))]
    {
        let _ = iters;
        0
    }
}

/// As [`peak_int8_loop`] with `tdpbf16ps` (the tile unit's bf16 peak).
///
/// # Safety
/// AMX usable by this process (the amx level).
pub unsafe fn peak_bf16_loop(iters: u64) -> u64 {
    #[cfg(kt_amx_hw)]
    // SAFETY: as peak_int8_loop.
    return unsafe { kt_amx_peak_bf16(iters) };
    #[cfg(not(kt_amx_hw))]
    {
        let _ = iters;
        0
    }
}

/// Default distance, in bytes, at which the hardware tile programs prefetch weights.
pub const PREFETCH_BYTES: usize = 8192;

/// How far ahead of the tile being loaded the hardware tile programs prefetch weights into
/// L2 (0: off), process-wide. A tile load that misses the caches stalls the in-order tile unit
/// for the whole DRAM latency; the prefetches overlap it with the tiles before.
pub fn set_prefetch_bytes(bytes: usize) {
    #[cfg(kt_amx_hw)]
    // SAFETY: stores one integer the tile programs read.
    unsafe {
        kt_amx_set_prefetch(bytes)
    };
    #[cfg(not(kt_amx_hw))]
    let _ = bytes;
}

/// Whether this build contains the hardware AMX kernels (the compiler knew `-mamx-*`).
pub const HARDWARE_BUILT: bool = cfg!(kt_amx_hw);

fn check_rows(n: usize) {
    assert!(
        (1..=ROWS).contains(&n),
        "AMX kernels take 1..={ROWS} rows, got {n}"
    );
}

/// Hardware AMXINT8 group kernel.
///
/// # Safety
/// AMX usable by this process (tile data permission granted); the
/// [`GroupDotFn`](super::group_dot::GroupDotFn) contract with up to [`ROWS`] rows.
#[cfg(kt_amx_hw)]
pub unsafe fn dot_int8(a: &[*const u8], k: usize, g: *const u8, s: *const i32, o: *mut i32) {
    check_rows(a.len());
    // SAFETY: forwarded contract; the C++ side reads a.len() row pointers.
    unsafe { kt_amx_int8_dot(a.as_ptr(), a.len(), k, g, s, o) }
}

/// Hardware AMXINT4 group kernel (`k % 128 == 0`).
///
/// # Safety
/// As [`dot_int8`] for an AMXINT4 group.
#[cfg(kt_amx_hw)]
pub unsafe fn dot_int4(a: &[*const u8], k: usize, g: *const u8, s: *const i32, o: *mut i32) {
    check_rows(a.len());
    // SAFETY: forwarded contract.
    unsafe { kt_amx_int4_dot(a.as_ptr(), a.len(), k, g, s, o) }
}

/// Hardware bf16 panel kernel (`tdpbf16ps`, `k % 32 == 0`).
///
/// # Safety
/// AMX usable by this process; the [`PanelDotBf16Fn`](super::PanelDotBf16Fn) contract with up
/// to [`ROWS`] rows.
#[cfg(kt_amx_hw)]
pub unsafe fn panel_dot_bf16(a: &[*const u32], k: usize, panel: *const u16, out: *mut f32) {
    check_rows(a.len());
    debug_assert_eq!(k % BF16_K_STEP, 0);
    // SAFETY: forwarded contract.
    unsafe { kt_amx_bf16_dot(a.as_ptr(), a.len(), k, panel, out) }
}

/// What the emulator reported: the fault the hardware would have raised.
fn emulator_fault(code: i32) -> &'static str {
    match code {
        1 => "invalid tile configuration (#GP)",
        2 => "tile instruction before ldtilecfg (#UD)",
        3 => "use of an unconfigured tile (#UD)",
        4 => "tile shapes do not match (#UD)",
        _ => "unknown fault",
    }
}

fn check_emulated(code: i32, what: &str) {
    assert!(code == 0, "AMX emulator, {what}: {}", emulator_fault(code));
}

/// The emulated kernels: same tile programs, software tile unit. Any fault the hardware would
/// raise panics with its description.
pub mod emulated {
    use super::*;

    /// Emulated [`dot_int8`](super::dot_int8).
    ///
    /// # Safety
    /// The [`GroupDotFn`](crate::kernels::group_dot::GroupDotFn) contract with up to [`ROWS`] rows.
    pub unsafe fn dot_int8(a: &[*const u8], k: usize, g: *const u8, s: *const i32, o: *mut i32) {
        check_rows(a.len());
        // SAFETY: forwarded contract.
        let code = unsafe { kt_amx_emu_int8_dot(a.as_ptr(), a.len(), k, g, s, o) };
        check_emulated(code, "int8 group");
    }

    /// Emulated [`dot_int4`](super::dot_int4).
    ///
    /// # Safety
    /// As [`dot_int8`] for an AMXINT4 group.
    pub unsafe fn dot_int4(a: &[*const u8], k: usize, g: *const u8, s: *const i32, o: *mut i32) {
        check_rows(a.len());
        // SAFETY: forwarded contract.
        let code = unsafe { kt_amx_emu_int4_dot(a.as_ptr(), a.len(), k, g, s, o) };
        check_emulated(code, "int4 group");
    }

    /// Emulated [`panel_dot_bf16`](super::panel_dot_bf16).
    ///
    /// # Safety
    /// The [`PanelDotBf16Fn`](crate::kernels::PanelDotBf16Fn) contract with up to [`ROWS`]
    /// rows and `k % 32 == 0`.
    pub unsafe fn panel_dot_bf16(a: &[*const u32], k: usize, panel: *const u16, out: *mut f32) {
        check_rows(a.len());
        assert_eq!(k % BF16_K_STEP, 0, "AMX bf16 needs k % 32 == 0");
        // SAFETY: forwarded contract.
        let code = unsafe { kt_amx_emu_bf16_dot(a.as_ptr(), a.len(), k, panel, out) };
        check_emulated(code, "bf16 panel");
    }

    /// The emulator's own checks (fault detection, instruction arithmetic on random tiles):
    /// `Err(n)` names the first that failed.
    pub fn self_test() -> Result<(), i32> {
        // SAFETY: no arguments; the C++ side only touches its own stack.
        match unsafe { kt_amx_emu_self_test() } {
            0 => Ok(()),
            n => Err(n),
        }
    }
}

/// Scalar twin of the AMX bf16 panel kernel: per output, inputs in order, even then odd of each
/// pair, one rounded fp32 add per product (exact in fp32), denormal inputs read as zero and
/// denormal sums flushed — `tdpbf16ps` per Intel's pseudo-code.
///
/// # Safety
/// The [`PanelDotBf16Fn`](crate::kernels::PanelDotBf16Fn) contract.
pub unsafe fn panel_dot_bf16_twin(a: &[*const u32], k: usize, panel: *const u16, out: *mut f32) {
    let daz = |bits: u16| {
        let f = crate::dtype::bf16_bits_to_f32(bits);
        if f.is_subnormal() {
            0.0f32.copysign(f)
        } else {
            f
        }
    };
    let ftz = |f: f32| {
        if f.is_subnormal() {
            0.0f32.copysign(f)
        } else {
            f
        }
    };
    for (r, &row) in a.iter().enumerate() {
        for j in 0..crate::pack::PANEL {
            let mut acc = 0f32;
            for q in 0..k / 2 {
                // SAFETY: pair q < k/2 of the row; panel index < 32*k.
                unsafe {
                    let pair = *row.add(q);
                    for t in 0..2 {
                        let x = daz((pair >> (16 * t)) as u16);
                        let w = daz(*panel.add(crate::pack::packed_index(j, 2 * q + t, k)));
                        acc = ftz(acc + x * w);
                    }
                }
            }
            // SAFETY: out holds 32 per row.
            unsafe { *out.add(r * 32 + j) = acc };
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn emulator_passes_its_self_test() {
        assert_eq!(emulated::self_test(), Ok(()));
    }

    /// Activation rows both as one strided block (loaded straight) and scattered (gathered).
    fn row_sets(rows: usize, k: usize, rng: &mut Rng) -> (Vec<u8>, Vec<Vec<u8>>) {
        let block: Vec<u8> = (0..rows * k).map(|_| 1 + rng.below(255) as u8).collect();
        let scattered = (0..rows)
            .map(|_| (0..k).map(|_| 1 + rng.below(255) as u8).collect())
            .collect();
        (block, scattered)
    }

    type Pack = fn(&[i8], usize, usize) -> crate::Result<Vec<u8>>;

    /// A tile program (`emu`: emulated or hardware) equals a format's scalar twin on random
    /// groups, for row counts around the 16-row tiles, rows strided and scattered.
    pub(crate) fn check_int(
        ks: &[usize],
        draw: fn(&mut Rng) -> i8,
        pack: Pack,
        sums: fn(&[u8], usize) -> [i32; 32],
        emu: crate::kernels::group_dot::GroupDotFn,
        twin: crate::kernels::group_dot::GroupDotFn,
    ) {
        let mut rng = Rng::new(7);
        for &k in ks {
            let w: Vec<i8> = (0..32 * k).map(|_| draw(&mut rng)).collect();
            let group = pack(&w, 32, k).unwrap();
            let s = sums(&group, k);
            for rows in [1, 2, 5, 15, 16, 17, 31, 32] {
                let (block, scattered) = row_sets(rows, k, &mut rng);
                let strided: Vec<*const u8> = (0..rows).map(|r| block[r * k..].as_ptr()).collect();
                let apart: Vec<*const u8> = scattered.iter().map(|r| r.as_ptr()).collect();
                for ptrs in [&strided, &apart] {
                    let mut got = vec![0i32; rows * 32];
                    let mut want = vec![0i32; rows * 32];
                    // SAFETY: rows of k activation bytes, a whole tiled group, rows·32 outputs;
                    // the emulator and the twin run on any CPU.
                    unsafe {
                        emu(ptrs, k, group.as_ptr(), s.as_ptr(), got.as_mut_ptr());
                        twin(ptrs, k, group.as_ptr(), s.as_ptr(), want.as_mut_ptr());
                    }
                    assert_eq!(got, want, "rows={rows} k={k}");
                }
            }
        }
    }

    #[test]
    fn emulated_bf16_tile_program_matches_its_twin_and_fp64() {
        check_bf16(emulated::panel_dot_bf16, true);
    }

    /// The hardware tiles run the same program as the emulator. Their arithmetic is not the
    /// SDM's pseudo-code to the bit (measured on Sapphire/Emerald Rapids: one pair per
    /// instruction agrees, sixteen pairs differ in the last bits in about 15% of outputs), so
    /// they are held to a few units in the last place of the sum of |products| instead: a
    /// wrong layout or tile loop is off by O(1).
    #[cfg(kt_amx_hw)]
    #[test]
    fn hardware_bf16_tile_program_matches_its_twin_where_amx_runs() {
        if crate::isa::allows(crate::isa::Level::Amx) {
            check_bf16(panel_dot_bf16, false);
        }
    }

    /// A bf16 tile kernel against [`panel_dot_bf16_twin`] on random panels, rows strided and
    /// scattered: bit for bit where `bitwise`, else within 2^-21 of each output's sum of
    /// |products| per 32 inputs; the twin itself tracks fp64 on the bf16-rounded operands.
    fn check_bf16(kernel: crate::kernels::PanelDotBf16Fn, bitwise: bool) {
        let bf16 =
            |v: f32| crate::dtype::bf16_bits_to_f32(crate::dtype::f32_to_bf16_bits(v)) as f64;
        let mut rng = Rng::new(11);
        for k in [32, 96, 512] {
            let w: Vec<f32> = (0..32 * k).map(|_| rng.normal()).collect();
            let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
            let view =
                crate::pack::MatrixView::from_bytes(&bytes, crate::dtype::FloatType::F32, 32, k)
                    .unwrap();
            let panel = crate::pack::pack_matrix(&view).unwrap();
            for rows in [1, 3, 16, 20, 32] {
                let x: Vec<f32> = (0..rows * k).map(|_| rng.normal()).collect();
                let mut staged = vec![0u32; rows * k / 2];
                crate::kernels::scalar::stage_bf16_tail(&x, &mut staged);
                // (exact dot product, sum of |products|) per output, on the bf16 operands.
                let exact: Vec<(f64, f64)> = (0..rows * 32)
                    .map(|o| {
                        let (r, j) = (o / 32, o % 32);
                        (0..k).fold((0.0, 0.0), |(s, a), kk| {
                            let p = bf16(x[r * k + kk]) * bf16(w[j * k + kk]);
                            (s + p, a + p.abs())
                        })
                    })
                    .collect();
                // Strided rows, and the same rows reversed (scattered for the tile loads).
                let fwd: Vec<*const u32> =
                    (0..rows).map(|r| staged[r * k / 2..].as_ptr()).collect();
                let rev: Vec<*const u32> = fwd.iter().rev().copied().collect();
                for ptrs in [&fwd, &rev] {
                    let mut got = vec![0f32; rows * 32];
                    let mut want = vec![0f32; rows * 32];
                    // SAFETY: staged rows of k/2 pairs, a panel of 32·k, rows·32 outputs.
                    unsafe {
                        kernel(ptrs, k, panel.as_ptr(), got.as_mut_ptr());
                        panel_dot_bf16_twin(ptrs, k, panel.as_ptr(), want.as_mut_ptr());
                    }
                    if bitwise {
                        assert_eq!(got, want, "rows={rows} k={k}");
                        continue;
                    }
                    let steps = (k / BF16_K_STEP) as f64;
                    for (o, (&g, &t)) in got.iter().zip(&want).enumerate() {
                        // Output o of the reversed set is row rows-1-r of the exact table.
                        let r = if std::ptr::eq(ptrs, &rev) {
                            rows - 1 - o / 32
                        } else {
                            o / 32
                        };
                        let abs_sum = exact[r * 32 + o % 32].1;
                        let bound = steps * abs_sum * 2f64.powi(-21);
                        assert!(
                            (g as f64 - t as f64).abs() <= bound,
                            "rows={rows} k={k} out {o}: {g} vs twin {t} (bound {bound:e})"
                        );
                    }
                }
                // The twin itself against float64 on the bf16-rounded operands.
                let mut want = vec![0f32; rows * 32];
                // SAFETY: as above.
                unsafe { panel_dot_bf16_twin(&fwd, k, panel.as_ptr(), want.as_mut_ptr()) };
                for (got, (exact, _)) in want.iter().zip(&exact) {
                    assert!((*got as f64 - exact).abs() <= 1e-4 * (k as f64).sqrt() * 4.0);
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "AMX kernels take")]
    fn too_many_rows_are_refused() {
        let rows = vec![std::ptr::null::<u8>(); ROWS + 1];
        let mut out = vec![0i32; (ROWS + 1) * 32];
        // SAFETY: the kernel refuses the row count before it reads anything.
        unsafe {
            emulated::dot_int8(
                &rows,
                64,
                std::ptr::null(),
                std::ptr::null(),
                out.as_mut_ptr(),
            )
        };
    }
}
