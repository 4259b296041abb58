//! Diagnostic: the multiply-accumulates per cycle that AVX2 byte dot-product instruction mixes
//! sustain on this core (clock calibrated with a chain of dependent scalar adds), and the bound
//! that puts on the AMXINT8 prefill of one Qwen3-30B-A3B layer. Without VNNI each 32 byte MACs
//! of the int8 kernel cost `vpsignb`, `vpmaddubsw`, `vpmaddwd` and `vpaddd`.
//! Then the row mixes of the AVX2 15-bit many-row kernel (i16 activations, `vpmaddwd`): where
//! its cycles per quarter block go (broadcast activation words, weights in registers or
//! memory, the nibble unpacking), and the same products with tokens in the lanes (decoded
//! weight pairs broadcast, two vectors of 8 tokens' activation pairs per input pair).
//! On AVX-512 VNNI CPUs, last, which instructions share the pipes of `vpdpbusd`: cycles per 8
//! independent `vpdpbusd` alone and with each kind of the group-scaled kernels' other work
//! (the per-group epilogue's `vmulps`/`vfmadd231ps`/`vcvtdq2ps`, the nibble unpacking, the
//! broadcasts, the Q8_0 kernels' `vinserti64x4` joins).
//! `cargo run --release -p kt-benches --example ports`
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;
    use std::time::Instant;

    const ITERS: u32 = 20_000_000;

    /// Seconds per iteration of `$body` (register-only AVX2 code on ymm0..ymm15).
    macro_rules! per_iter {
        ($($body:literal),+) => {{
            let t = Instant::now();
            for _ in 0..ITERS {
                // SAFETY: register-only AVX2 arithmetic on clobbered registers; `run` checked
                // AVX2 first.
                unsafe {
                    asm!(
                        $($body),+,
                        out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                        out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                        out("ymm8") _, out("ymm9") _, out("ymm14") _, out("ymm15") _,
                        options(nostack, nomem),
                    )
                }
            }
            t.elapsed().as_secs_f64() / ITERS as f64
        }};
    }

    /// The i16 kernel's 4 rows against one quarter block's weights in ymm0..ymm3: per row, 4
    /// activation words broadcast from `{x}`, 4 `vpmaddwd` and 4 `vpaddd` into ymm8..ymm11.
    macro_rules! i16_rows {
        () => {
            concat!(
                ".irp r,8,9,10,11\n",
                "vpbroadcastd ymm4, dword ptr [{x} + 16*(\\r-8)]\n",
                "vpbroadcastd ymm5, dword ptr [{x} + 16*(\\r-8) + 4]\n",
                "vpbroadcastd ymm6, dword ptr [{x} + 16*(\\r-8) + 8]\n",
                "vpbroadcastd ymm7, dword ptr [{x} + 16*(\\r-8) + 12]\n",
                "vpmaddwd ymm4, ymm4, ymm0\n",
                "vpmaddwd ymm5, ymm5, ymm1\n",
                "vpmaddwd ymm6, ymm6, ymm2\n",
                "vpmaddwd ymm7, ymm7, ymm3\n",
                "vpaddd ymm4, ymm4, ymm5\n",
                "vpaddd ymm6, ymm6, ymm7\n",
                "vpaddd ymm4, ymm4, ymm6\n",
                "vpaddd ymm\\r, ymm\\r, ymm4\n",
                ".endr",
            )
        };
    }

    /// Seconds per iteration of `$body`, which may read 64 bytes at `{x}` and 256 at `{w}`.
    macro_rules! per_iter_reading {
        ($x:expr, $w:expr, $($body:expr),+) => {{
            let t = Instant::now();
            for _ in 0..ITERS {
                // SAFETY: AVX2 arithmetic on clobbered registers and loads inside the two
                // buffers; `run` checked AVX2 first.
                unsafe {
                    asm!(
                        "/* reads {x} and {w} */",
                        $($body),+,
                        x = in(reg) $x,
                        w = in(reg) $w,
                        out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                        out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                        out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                        out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
                        options(nostack, readonly),
                    )
                }
            }
            t.elapsed().as_secs_f64() / ITERS as f64
        }};
    }

    /// The i16 kernel's inner mixes: 4 rows (accumulators ymm8..ymm11) against one quarter
    /// block (8 outputs x 8 inputs), 256 products per iteration.
    fn i16_row_mixes(hz: f64) {
        #[repr(align(64))]
        struct Buf([u8; 256]);
        let x = Buf([1; 256]);
        let w = Buf([3; 256]);
        let (x, w) = (x.0.as_ptr(), w.0.as_ptr());
        let mixes = [
            (
                "4 broadcast words + 4 vpmaddwd + 4 vpaddd per row, weights in registers",
                per_iter_reading!(x, w, i16_rows!()),
            ),
            (
                "the same with the weights as memory operands (4 more loads per row)",
                per_iter_reading!(
                    x,
                    w,
                    ".irp r,8,9,10,11",
                    "vpbroadcastd ymm4, dword ptr [{x} + 16*(\\r-8)]",
                    "vpbroadcastd ymm5, dword ptr [{x} + 16*(\\r-8) + 4]",
                    "vpbroadcastd ymm6, dword ptr [{x} + 16*(\\r-8) + 8]",
                    "vpbroadcastd ymm7, dword ptr [{x} + 16*(\\r-8) + 12]",
                    "vpmaddwd ymm4, ymm4, [{w}]",
                    "vpmaddwd ymm5, ymm5, [{w} + 32]",
                    "vpmaddwd ymm6, ymm6, [{w} + 64]",
                    "vpmaddwd ymm7, ymm7, [{w} + 96]",
                    "vpaddd ymm4, ymm4, ymm5",
                    "vpaddd ymm6, ymm6, ymm7",
                    "vpaddd ymm4, ymm4, ymm6",
                    "vpaddd ymm\\r, ymm\\r, ymm4",
                    ".endr"
                ),
            ),
            (
                "no broadcasts (activation words in registers): 4 vpmaddwd + 4 vpaddd per row",
                per_iter_reading!(
                    x,
                    w,
                    ".irp r,8,9,10,11",
                    "vpmaddwd ymm4, ymm12, ymm0",
                    "vpmaddwd ymm5, ymm13, ymm1",
                    "vpmaddwd ymm6, ymm14, ymm2",
                    "vpmaddwd ymm7, ymm15, ymm3",
                    "vpaddd ymm4, ymm4, ymm5",
                    "vpaddd ymm6, ymm6, ymm7",
                    "vpaddd ymm4, ymm4, ymm6",
                    "vpaddd ymm\\r, ymm\\r, ymm4",
                    ".endr"
                ),
            ),
            (
                "token lanes: per input pair 4 broadcast weight words x 2 vectors of 8 tokens",
                per_iter_reading!(
                    x,
                    w,
                    ".irp p,0,1",
                    "vmovdqu ymm0, [{w} + 64*\\p]",
                    "vmovdqu ymm1, [{w} + 64*\\p + 32]",
                    "vpbroadcastd ymm2, dword ptr [{x} + 16*\\p + 0]",
                    "vpmaddwd ymm6, ymm2, ymm0",
                    "vpmaddwd ymm7, ymm2, ymm1",
                    "vpaddd ymm8, ymm8, ymm6",
                    "vpaddd ymm9, ymm9, ymm7",
                    "vpbroadcastd ymm2, dword ptr [{x} + 16*\\p + 4]",
                    "vpmaddwd ymm6, ymm2, ymm0",
                    "vpmaddwd ymm7, ymm2, ymm1",
                    "vpaddd ymm10, ymm10, ymm6",
                    "vpaddd ymm11, ymm11, ymm7",
                    "vpbroadcastd ymm2, dword ptr [{x} + 16*\\p + 8]",
                    "vpmaddwd ymm6, ymm2, ymm0",
                    "vpmaddwd ymm7, ymm2, ymm1",
                    "vpaddd ymm12, ymm12, ymm6",
                    "vpaddd ymm13, ymm13, ymm7",
                    "vpbroadcastd ymm2, dword ptr [{x} + 16*\\p + 12]",
                    "vpmaddwd ymm6, ymm2, ymm0",
                    "vpmaddwd ymm7, ymm2, ymm1",
                    "vpaddd ymm14, ymm14, ymm6",
                    "vpaddd ymm15, ymm15, ymm7",
                    ".endr"
                ),
            ),
            (
                "the kernel's block body: load + unpack (11 ops) once, then the first mix",
                per_iter_reading!(
                    x,
                    w,
                    "vmovdqu ymm0, [{w}]",
                    "vpsrlw ymm2, ymm0, 4",
                    "vpand ymm0, ymm0, ymm14",
                    "vpand ymm2, ymm2, ymm14",
                    "vpshufb ymm0, ymm15, ymm0",
                    "vpshufb ymm2, ymm15, ymm2",
                    "vpsllw ymm1, ymm0, 8",
                    "vpsraw ymm1, ymm1, 8",
                    "vpsraw ymm0, ymm0, 8",
                    "vpsllw ymm3, ymm2, 8",
                    "vpsraw ymm3, ymm3, 8",
                    "vpsraw ymm2, ymm2, 8",
                    i16_rows!()
                ),
            ),
        ];
        println!("the AVX2 15-bit many-row kernel's inner mixes (4 rows, one quarter block):");
        for (name, secs) in mixes {
            let cycles = secs * hz;
            println!(
                "{:5.2} cycles per row ({:4.1} MAC/cycle)  {name}",
                cycles / 4.0,
                256.0 / cycles
            );
        }
    }

    pub fn run() {
        if !is_x86_feature_detected!("avx2") {
            println!("no AVX2: nothing to measure");
            return;
        }
        // 64 dependent adds: 64 cycles per iteration.
        let t = Instant::now();
        for _ in 0..ITERS {
            // SAFETY: scalar arithmetic on a clobbered register.
            unsafe {
                asm!(".rept 64", "add {x}, {x}", ".endr", x = out(reg) _, options(nostack, nomem))
            }
        }
        let hz = 64.0 / (t.elapsed().as_secs_f64() / ITERS as f64);
        println!("core clock (dependent adds): {:.2} GHz", hz / 1e9);
        // Each iteration: eight independent 32-MAC steps (accumulators ymm0..ymm7).
        // (name, exact for int8 x int8, seconds per iteration)
        let mixes = [
            (
                "sign trick: vpsignb + vpmaddubsw + vpmaddwd + vpaddd (the AVX2 int8 kernel)",
                true,
                per_iter!(
                    ".irp r,0,1,2,3,4,5,6,7",
                    "vpsignb ymm8, ymm9, ymm10",
                    "vpmaddubsw ymm8, ymm11, ymm8",
                    "vpmaddwd ymm8, ymm8, ymm12",
                    "vpaddd ymm\\r, ymm\\r, ymm8",
                    ".endr"
                ),
            ),
            (
                "no sign op: vpmaddubsw + vpmaddwd + vpaddd (saturates for int8 x int8)",
                false,
                per_iter!(
                    ".irp r,0,1,2,3,4,5,6,7",
                    "vpmaddubsw ymm8, ymm11, ymm10",
                    "vpmaddwd ymm8, ymm8, ymm12",
                    "vpaddd ymm\\r, ymm\\r, ymm8",
                    ".endr"
                ),
            ),
            (
                "activation nibbles: 2 x (vpmaddubsw + vpaddw), widened every 8 steps",
                true,
                per_iter!(
                    ".irp r,0,1,2,3,4,5,6,7",
                    "vpmaddubsw ymm8, ymm10, ymm11",
                    "vpaddw ymm\\r, ymm\\r, ymm8",
                    "vpmaddubsw ymm9, ymm12, ymm11",
                    "vpaddw ymm\\r, ymm\\r, ymm9",
                    ".endr",
                    "vpmaddwd ymm8, ymm0, ymm13",
                    "vpaddd ymm14, ymm14, ymm8",
                    "vpmaddwd ymm9, ymm1, ymm13",
                    "vpaddd ymm15, ymm15, ymm9"
                ),
            ),
        ];
        let mut best = 0f64;
        for (name, exact, secs) in mixes {
            let per_cycle = 256.0 / (secs * hz);
            if exact {
                best = best.max(per_cycle);
            }
            println!("{per_cycle:5.1} MAC/cycle  {name}");
        }
        // One layer, 512 tokens, top-8: 3 projections of 2048 x 768 per token and expert.
        let macs = 512.0 * 8.0 * 3.0 * 2048.0 * 768.0;
        let cores = 2.0;
        println!(
            "AMXINT8 prefill bound, Qwen3-30B-A3B layer, 512 tokens, {cores} cores at this clock \
             and the best exact mix: {:.0} ms",
            macs / (cores * hz * best) * 1e3
        );
        i16_row_mixes(hz);
        if is_x86_feature_detected!("avx512vnni") {
            // SAFETY: AVX-512 VNNI detected just above.
            unsafe { vnni512_mixes(hz) };
        }
    }

    /// Cycles per 8 independent `vpdpbusd` (zmm0..zmm7) with `$extra` beside them.
    macro_rules! per_8_dpbusd {
        ($hz:expr, $x:expr, $($extra:literal),*) => {{
            let t = Instant::now();
            for _ in 0..ITERS {
                // SAFETY: AVX-512 arithmetic on clobbered registers and loads of the 64-byte
                // buffer at {x}; the caller checked AVX-512 VNNI.
                unsafe {
                    asm!(
                        "/* reads {x} */",
                        ".irp r,0,1,2,3,4,5,6,7",
                        "vpdpbusd zmm\\r, zmm20, zmm21",
                        ".endr",
                        $($extra,)*
                        x = in(reg) $x,
                        out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                        out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                        out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                        out("zmm20") _, out("zmm21") _,
                        options(nostack, readonly),
                    )
                }
            }
            t.elapsed().as_secs_f64() / ITERS as f64 * $hz
        }};
    }

    /// Which work shares the pipes of `vpdpbusd` (AMD Zen 5: `vmulps`, `vfmadd231ps` and
    /// `vinserti64x4` do; conversions, integer adds, logic, shifts and broadcasts do not):
    /// the group-scaled kernels' per-group `vmulps` + `vfmadd231ps` (8 `vpdpbusd` per row and
    /// 16 outputs for groups of 32) then cap them at 8/10 of the multiply-add peak.
    ///
    /// # Safety
    /// AVX-512 VNNI available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn vnni512_mixes(hz: f64) {
        #[repr(align(64))]
        struct Line([u8; 64]);
        let line = Line([1; 64]);
        let x = line.0.as_ptr();
        println!("AVX-512 VNNI: cycles per 8 independent vpdpbusd (zmm) with beside them");
        let mixes = [
            ("nothing", per_8_dpbusd!(hz, x,)),
            (
                "2 vmulps",
                per_8_dpbusd!(
                    hz,
                    x,
                    "vmulps zmm8, zmm20, zmm21",
                    "vmulps zmm9, zmm20, zmm21"
                ),
            ),
            (
                "2 vfmadd231ps",
                per_8_dpbusd!(
                    hz,
                    x,
                    "vfmadd231ps zmm8, zmm20, zmm21",
                    "vfmadd231ps zmm9, zmm20, zmm21"
                ),
            ),
            (
                "2 vcvtdq2ps",
                per_8_dpbusd!(hz, x, "vcvtdq2ps zmm8, zmm20", "vcvtdq2ps zmm9, zmm21"),
            ),
            (
                "4 vpaddd",
                per_8_dpbusd!(
                    hz,
                    x,
                    ".irp r,8,9,10,11",
                    "vpaddd zmm\\r, zmm20, zmm21",
                    ".endr"
                ),
            ),
            (
                "2 vpandd + 2 vpsrld",
                per_8_dpbusd!(
                    hz,
                    x,
                    "vpandd zmm8, zmm20, zmm21",
                    "vpandd zmm9, zmm20, zmm21",
                    "vpsrld zmm10, zmm20, 4",
                    "vpsrld zmm11, zmm21, 4"
                ),
            ),
            (
                "4 vpbroadcastd from memory",
                per_8_dpbusd!(
                    hz,
                    x,
                    ".irp r,8,9,10,11",
                    "vpbroadcastd zmm\\r, dword ptr [{x}]",
                    ".endr"
                ),
            ),
            (
                "2 vinserti64x4 (registers)",
                per_8_dpbusd!(
                    hz,
                    x,
                    "vinserti64x4 zmm8, zmm20, ymm21, 1",
                    "vinserti64x4 zmm9, zmm20, ymm21, 1"
                ),
            ),
        ];
        for (name, cycles) in mixes {
            println!("{cycles:5.2} cycles  {name}");
        }
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    x86::run();
}
