//! Measure this machine's limits in the same run as a benchmark: DRAM read bandwidth and the
//! fp32-FMA, int8 multiply-add and bf16-dot peaks, each using every thread of a pool.
//!
//! Each probe runs the widest instructions the CPU has (512-bit where AVX-512 is usable,
//! else 256-bit, else scalar): a narrower probe under-reads what the hardware gives (the old
//! u64 read loop reported 23 GB/s where 512-bit loads read 31 GB/s on the same machine), and
//! every "fraction of the machine" is divided by these figures. The probes use the level the
//! hardware allows, not a `KT_KERNEL_CPU_VARIANT` cap: they measure the machine, not a kernel.
use crate::isa::Level;
use crate::pool::Pool;
use crate::{kt_ensure, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The load width the read probe uses at the current ISA level ("avx512", "avx2", "scalar").
pub fn read_probe_width() -> &'static str {
    read_loop().1
}

/// Best-of-`repeats` read bandwidth (GB/s) over a buffer of `bytes` (≫ L3), all threads, in
/// huge pages as the layers' weights are.
pub fn dram_read_gbps(pool: &Pool, bytes: usize, repeats: usize) -> Result<f64> {
    dram_read_gbps_in(pool, bytes, repeats, Pages::Huge)
}

/// The pages a read probe's buffer lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pages {
    /// 2 MiB transparent huge pages where the system allows them (what the weights get).
    Huge,
    /// What a plain allocation gets (4 KiB pages unless THP is "always"): the reference
    /// yardstick's setting. TLB misses cost 10–20% of the DRAM rate on some VMs.
    Default,
}

/// [`dram_read_gbps`] with the buffer in `pages`.
pub fn dram_read_gbps_in(pool: &Pool, bytes: usize, repeats: usize, pages: Pages) -> Result<f64> {
    let rates = dram_read_passes_in(pool, bytes, repeats, pages)?;
    Ok(rates.into_iter().fold(0.0, f64::max))
}

/// The read bandwidth (GB/s) of each of `passes` timed passes (at least one) over one buffer
/// of `bytes` in `pages`, after one untimed pass: for a median, as the reference yardstick
/// takes, where [`dram_read_gbps_in`] keeps the best.
pub fn dram_read_passes_in(
    pool: &Pool,
    bytes: usize,
    passes: usize,
    pages: Pages,
) -> Result<Vec<f64>> {
    let threads = pool.total_threads();
    // Each thread's slice is a whole number of 512-byte blocks (eight 64-byte vectors).
    let n = (bytes / 8 / threads / 64) * 64 * threads;
    kt_ensure!(n > 0, Invalid, "read probe of {bytes} bytes is too small");
    let mut buf = match pages {
        Pages::Huge => crate::pack::AlignedBuf::<u64>::zeroed(n)?,
        Pages::Default => crate::pack::AlignedBuf::<u64>::zeroed_default_pages(n)?,
    };
    // Fill every word in parallel (first touch per thread, so each thread reads memory it
    // placed): the timing excludes page faults, and no page is left zero for a hypervisor or
    // the kernel to share.
    let base = buf.as_mut_ptr() as usize;
    let per = n / threads;
    pool.parallel_for_all(threads, &|t| {
        // SAFETY: thread t writes only its own slice of the buffer.
        let s = unsafe { std::slice::from_raw_parts_mut((base as *mut u64).add(t * per), per) };
        for (i, v) in s.iter_mut().enumerate() {
            *v = (t * per + i) as u64 | 1;
        }
    })?;
    let (read, _) = read_loop();
    let sink = AtomicU64::new(0);
    let pass = || {
        pool.parallel_for_all(threads, &|t| {
            // SAFETY: each thread reads its own slice of the buffer, 64-byte aligned (the
            // buffer is, and `per` is a multiple of 64 words) and a multiple of 64 words long.
            let s = unsafe { std::slice::from_raw_parts((base as *const u64).add(t * per), per) };
            sink.fetch_add(read(s), Ordering::Relaxed);
        })
    };
    // One untimed pass first, as the reference does: the pass right after the fill also writes
    // the fill's dirty lines back and walks cold page tables (on this VM, in 4 KiB pages, it
    // read 0.6-0.8x the passes after it).
    pass()?;
    let mut rates = Vec::with_capacity(passes.max(1));
    for _ in 0..passes.max(1) {
        let t0 = Instant::now();
        pass()?;
        rates.push((n * 8) as f64 / t0.elapsed().as_secs_f64() / 1e9);
    }
    std::hint::black_box(sink.load(Ordering::Relaxed));
    Ok(rates)
}

/// Sums a 64-byte aligned slice whose length is a multiple of 64 words.
type ReadFn = fn(&[u64]) -> u64;

fn read_loop() -> (ReadFn, &'static str) {
    #[cfg(target_arch = "x86_64")]
    {
        let level = crate::isa::global().map_or(Level::Generic, |s| s.detected);
        if level >= Level::Avx512Base {
            // SAFETY: AVX-512F usable (the level says so); the slice contract of ReadFn.
            return (|s| unsafe { x86::sum512(s) }, "avx512");
        }
        if level >= Level::Avx2 {
            // SAFETY: AVX2 usable; the slice contract of ReadFn.
            return (|s| unsafe { x86::sum256(s) }, "avx2");
        }
    }
    (sum_u64, "scalar")
}

/// The scalar twin of the vector read loops (same sum).
fn sum_u64(s: &[u64]) -> u64 {
    // Eight independent lanes so the adds never limit a memory-bound loop.
    let mut acc = [0u64; 8];
    for c in s.chunks_exact(8) {
        for i in 0..8 {
            acc[i] = acc[i].wrapping_add(c[i]);
        }
    }
    acc.iter().fold(0, |a, b| a.wrapping_add(*b))
}

/// The instruction families [`simd_peak_gflops`] measures.
pub const PEAK_KINDS: [&str; 5] = ["fma", "int8", "bf16", "amx_int8", "amx_bf16"];

/// Peak rate of the instruction family `kind` on every thread, in G operations per second:
/// "fma" = fp32 FMA (2 flops per lane), "int8" = u8·s8 multiply-adds into i32 (2 ops per
/// byte pair), "bf16" = bf16 dot products (2 flops per pair), "amx_int8" / "amx_bf16" the same
/// on AMX tiles. None when the CPU (or this build) lacks them.
pub fn simd_peak_gflops(pool: &Pool, kind: &str, millis: u64) -> Result<Option<f64>> {
    kt_ensure!(
        PEAK_KINDS.contains(&kind),
        Invalid,
        "unknown peak kind {kind:?}; expected one of {PEAK_KINDS:?}"
    );
    let Some(f) = peak_loop(kind) else {
        return Ok(None);
    };
    let threads = pool.total_threads();
    let flops = AtomicU64::new(0);
    let t0 = Instant::now();
    pool.parallel_for_all(threads, &|_| {
        // A short untimed run first: wide units power up (and clocks settle) on first use.
        f.run(1 << 12);
        let mut done = 0u64;
        let start = Instant::now();
        while start.elapsed().as_millis() < millis as u128 {
            done += f.run(1 << 16);
        }
        flops.fetch_add(done, Ordering::Relaxed);
    })?;
    Ok(Some(
        flops.load(Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64() / 1e9,
    ))
}

/// A peak loop this CPU can run: `n` iterations, returns the operations done.
#[derive(Clone, Copy)]
struct PeakFn(PeakLoop);

/// `n` iterations of a peak loop, returning the operations done (needs its CPU features).
type PeakLoop = unsafe fn(u64) -> u64;

impl PeakFn {
    fn run(self, n: u64) -> u64 {
        // SAFETY: a PeakFn is only made by `peak_select` after checking the CPU runs it.
        unsafe { (self.0)(n) }
    }
}

/// The instruction mix each `kind` measures at the current level, by name.
pub fn peak_variant(kind: &str) -> Option<&'static str> {
    peak_select(kind).map(|(_, name)| name)
}

fn peak_loop(kind: &str) -> Option<PeakFn> {
    peak_select(kind).map(|(f, _)| f)
}

fn peak_select(kind: &str) -> Option<(PeakFn, &'static str)> {
    #[cfg(target_arch = "x86_64")]
    {
        let level = crate::isa::global().ok()?.detected;
        let vnni256 = crate::isa::has_feature("avx_vnni");
        // (kind, whether this CPU runs it, loop, name): the first that runs is the widest.
        let amx = level >= Level::Amx && crate::kernels::amx::HARDWARE_BUILT;
        let table: [(&str, bool, PeakLoop, &'static str); 9] = [
            ("fma", level >= Level::Avx512Base, x86::fma512, "avx512"),
            ("fma", level >= Level::Avx2, x86::fma256, "avx2"),
            (
                "int8",
                level >= Level::Avx512Vnni,
                x86::dpbusd512,
                "avx512-vnni",
            ),
            (
                "int8",
                level >= Level::Avx512Base,
                x86::maddubs512,
                "avx512bw",
            ),
            (
                "int8",
                level >= Level::Avx2 && vnni256,
                x86::dpbusd256,
                "avx-vnni",
            ),
            ("int8", level >= Level::Avx2, x86::maddubs256, "avx2"),
            (
                "bf16",
                level >= Level::Avx512Bf16,
                x86::dpbf16,
                "avx512-bf16",
            ),
            (
                "amx_int8",
                amx,
                crate::kernels::amx::peak_int8_loop,
                "amx-int8",
            ),
            (
                "amx_bf16",
                amx,
                crate::kernels::amx::peak_bf16_loop,
                "amx-bf16",
            ),
        ];
        let (_, _, f, name) = table
            .into_iter()
            .find(|(k, runs, _, _)| *k == kind && *runs)?;
        Some((PeakFn(f), name))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = kind;
        None
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Independent accumulator chains: enough to cover a 4–5 cycle latency on two ports.
    const CHAINS: usize = 12;

    /// Sum of `s` with 512-bit aligned loads into eight independent accumulators.
    ///
    /// # Safety
    /// AVX-512F available; `s` is 64-byte aligned and a multiple of 64 words long.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn sum512(s: &[u64]) -> u64 {
        debug_assert!(s.as_ptr().align_offset(64) == 0 && s.len().is_multiple_of(64));
        let mut acc = [_mm512_setzero_si512(); 8];
        let p = s.as_ptr() as *const __m512i;
        for block in 0..s.len() / 64 {
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: vector 8·block + j lies inside `s` and is aligned (the contract).
                *a = _mm512_add_epi64(*a, unsafe { _mm512_load_si512(p.add(8 * block + j)) });
            }
        }
        let mut total = acc[0];
        for a in &acc[1..] {
            total = _mm512_add_epi64(total, *a);
        }
        _mm512_reduce_add_epi64(total) as u64
    }

    /// Sum of `s` with 256-bit aligned loads into eight independent accumulators.
    ///
    /// # Safety
    /// AVX2 available; `s` is 32-byte aligned and a multiple of 32 words long.
    #[target_feature(enable = "avx2")]
    pub unsafe fn sum256(s: &[u64]) -> u64 {
        debug_assert!(s.as_ptr().align_offset(32) == 0 && s.len().is_multiple_of(32));
        let mut acc = [_mm256_setzero_si256(); 8];
        let p = s.as_ptr() as *const __m256i;
        for block in 0..s.len() / 32 {
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: vector 8·block + j lies inside `s` and is aligned (the contract).
                *a = _mm256_add_epi64(*a, unsafe { _mm256_load_si256(p.add(8 * block + j)) });
            }
        }
        let mut total = acc[0];
        for a in &acc[1..] {
            total = _mm256_add_epi64(total, *a);
        }
        let mut lanes = [0u64; 4];
        // SAFETY: `lanes` is 32 writable bytes (unaligned store).
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, total) };
        lanes.iter().fold(0, |a, b| a.wrapping_add(*b))
    }

    /// # Safety
    /// AVX-512F available. Returns flops done.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma512(iters: u64) -> u64 {
        let mut acc = [_mm512_set1_ps(0.0); CHAINS];
        let a = _mm512_set1_ps(0.999_999);
        let b = _mm512_set1_ps(1e-6);
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm512_fmadd_ps(*v, a, b);
            }
        }
        std::hint::black_box(acc);
        iters * (CHAINS * 16 * 2) as u64
    }

    /// # Safety
    /// AVX2 and FMA available. Returns flops done.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma256(iters: u64) -> u64 {
        let mut acc = [_mm256_set1_ps(0.0); CHAINS];
        let a = _mm256_set1_ps(0.999_999);
        let b = _mm256_set1_ps(1e-6);
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm256_fmadd_ps(*v, a, b);
            }
        }
        std::hint::black_box(acc);
        iters * (CHAINS * 8 * 2) as u64
    }

    /// Operands of the int8 loops, passed through an empty `asm!` in a register before every
    /// chain's step, so the multiply-adds can neither be hoisted out of the loop nor shared
    /// between chains: with one `asm!` per iteration the chains' `vpmaddubsw` + `vpmaddwd` of
    /// the same operands were computed once and only the adds repeated (an AMD Zen 3 read 2.8×
    /// the reference). (`black_box` would send the operands through memory: the store-to-load
    /// latency then paces the loop, and the probe read 75% of the reference on Intel
    /// Sapphire/Emerald Rapids.)
    macro_rules! int8_peak {
        ($(#[$doc:meta])* $name:ident, $features:literal, $zero:expr, $set8:ident, $lanes:expr,
         $reg:ident, |$acc:ident, $a:ident, $b:ident| $step:expr) => {
            $(#[$doc])*
            /// Returns operations done (2 per u8·s8 pair).
            ///
            /// # Safety
            /// The CPU has the features named here.
            #[target_feature(enable = $features)]
            pub unsafe fn $name(iters: u64) -> u64 {
                let mut acc = [$zero; CHAINS];
                let (mut $a, mut $b) = ($set8(3), $set8(-2));
                for _ in 0..iters {
                    for $acc in acc.iter_mut() {
                        // SAFETY: an empty template; the operands stay in their registers.
                        unsafe {
                            std::arch::asm!(
                                "/* {a} {b} */",
                                a = inout($reg) $a,
                                b = inout($reg) $b,
                                options(nomem, nostack, preserves_flags)
                            );
                        }
                        *$acc = $step;
                    }
                }
                std::hint::black_box(acc);
                iters * (CHAINS * $lanes * 4 * 2) as u64
            }
        };
    }

    int8_peak!(
        /// `vpdpbusd` on 512-bit registers.
        dpbusd512, "avx512f,avx512bw,avx512vnni", _mm512_setzero_si512(), _mm512_set1_epi8, 16, zmm_reg,
        |acc, a, b| _mm512_dpbusd_epi32(*acc, a, b)
    );
    int8_peak!(
        /// `vpmaddubsw` + `vpmaddwd` + `vpaddd` on 512-bit registers (no VNNI).
        maddubs512, "avx512f,avx512bw", _mm512_setzero_si512(), _mm512_set1_epi8, 16, zmm_reg,
        |acc, a, b| _mm512_add_epi32(
            *acc,
            _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1))
        )
    );
    int8_peak!(
        /// AVX-VNNI `vpdpbusd` on 256-bit registers.
        dpbusd256, "avx2,avxvnni", _mm256_setzero_si256(), _mm256_set1_epi8, 8, ymm_reg,
        |acc, a, b| _mm256_dpbusd_avx_epi32(*acc, a, b)
    );
    int8_peak!(
        /// `vpmaddubsw` + `vpmaddwd` + `vpaddd` on 256-bit registers.
        maddubs256, "avx2", _mm256_setzero_si256(), _mm256_set1_epi8, 8, ymm_reg,
        |acc, a, b| _mm256_add_epi32(
            *acc,
            _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1))
        )
    );

    /// # Safety
    /// AVX512-BF16 available.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn dpbf16(iters: u64) -> u64 {
        let mut acc = [_mm512_set1_ps(0.0); CHAINS];
        // SAFETY: __m512bh and __m512i are both 64 plain bytes.
        let (a, b): (__m512bh, __m512bh) = unsafe {
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi16(0x3f80)),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi16(0x3f00)),
            )
        };
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm512_dpbf16_ps(*v, a, b);
            }
        }
        std::hint::black_box(acc);
        iters * (CHAINS * 32 * 2) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector read loops give the scalar twin's sum on aligned random data.
    #[test]
    fn read_loops_match_the_scalar_twin() {
        let mut rng = crate::rng::Rng::new(7);
        let mut buf = crate::pack::AlignedBuf::<u64>::zeroed(64 * 37).unwrap();
        for v in buf.as_mut_slice() {
            *v = (rng.next_u64() >> 3) | 1;
        }
        let want = sum_u64(buf.as_slice());
        #[cfg(target_arch = "x86_64")]
        {
            if crate::isa::allows(Level::Avx2) {
                // SAFETY: AVX2 checked; the buffer is 64-byte aligned, 64·37 words.
                assert_eq!(unsafe { x86::sum256(buf.as_slice()) }, want);
            }
            if crate::isa::allows(Level::Avx512Base) {
                // SAFETY: AVX-512F checked; as above.
                assert_eq!(unsafe { x86::sum512(buf.as_slice()) }, want);
            }
        }
        assert_eq!(read_loop().0(buf.as_slice()), want);
    }
}
