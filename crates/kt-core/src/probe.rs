//! Measure this machine's limits in the same run as a benchmark: DRAM read bandwidth and the
//! fp32-FMA and bf16-dot peaks, each using every thread of a pool.
use crate::pool::Pool;
use crate::Result;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Best-of-`repeats` read bandwidth (GB/s) over a buffer of `bytes` (≫ L3), all threads.
pub fn dram_read_gbps(pool: &Pool, bytes: usize, repeats: usize) -> Result<f64> {
    let threads = pool.total_threads();
    let n = (bytes / 8 / threads / 64) * 64 * threads;
    let mut buf = crate::pack::AlignedBuf::<u64>::zeroed(n)?;
    // Touch every page in parallel so the timing excludes page faults (first touch per thread).
    let base = buf.as_mut_ptr() as usize;
    let per = n / threads;
    pool.parallel_for_all(threads, &|t| {
        let p = base as *mut u64;
        for i in (t * per..(t + 1) * per).step_by(512) {
            // SAFETY: i < n, inside the buffer.
            unsafe { p.add(i).write(i as u64) };
        }
    })?;
    let sink = AtomicU64::new(0);
    let mut best = 0f64;
    for _ in 0..repeats.max(1) {
        let t0 = Instant::now();
        pool.parallel_for_all(threads, &|t| {
            // SAFETY: each thread reads its own slice of the buffer.
            let s = unsafe { std::slice::from_raw_parts((base as *const u64).add(t * per), per) };
            sink.fetch_add(sum_u64(s), Ordering::Relaxed);
        })?;
        best = best.max((n * 8) as f64 / t0.elapsed().as_secs_f64() / 1e9);
    }
    std::hint::black_box(sink.load(Ordering::Relaxed));
    Ok(best)
}

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

/// Peak GFLOP/s of the kernel family `kind` ("fma" = fp32 FMA, "bf16" = bf16 dot products) on
/// every thread; None when the CPU lacks the instructions.
pub fn simd_peak_gflops(pool: &Pool, kind: &str, millis: u64) -> Result<Option<f64>> {
    let Some(f) = peak_loop(kind) else {
        return Ok(None);
    };
    let threads = pool.total_threads();
    let flops = AtomicU64::new(0);
    let t0 = Instant::now();
    pool.parallel_for_all(threads, &|_| {
        let mut done = 0u64;
        let start = Instant::now();
        while start.elapsed().as_millis() < millis as u128 {
            done += f(1 << 16);
        }
        flops.fetch_add(done, Ordering::Relaxed);
    })?;
    Ok(Some(
        flops.load(Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64() / 1e9,
    ))
}

type PeakFn = fn(u64) -> u64;

fn peak_loop(kind: &str) -> Option<PeakFn> {
    #[cfg(target_arch = "x86_64")]
    {
        let sel = crate::isa::global().ok()?;
        match kind {
            "fma" if sel.detected >= crate::isa::Level::Avx512Base => Some(|n| {
                // SAFETY: AVX-512F checked above.
                unsafe { x86::fma512(n) }
            }),
            "fma" if sel.detected >= crate::isa::Level::Avx2 => Some(|n| {
                // SAFETY: AVX2+FMA checked above.
                unsafe { x86::fma256(n) }
            }),
            "bf16" if sel.detected >= crate::isa::Level::Avx512Bf16 => Some(|n| {
                // SAFETY: AVX512-BF16 checked above.
                unsafe { x86::dpbf16(n) }
            }),
            _ => None,
        }
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

    /// # Safety
    /// AVX-512F available. 12 independent FMA chains hide the 4-cycle latency on two ports. Returns flops done.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma512(iters: u64) -> u64 {
        let mut acc = [_mm512_set1_ps(0.0); 12];
        let a = _mm512_set1_ps(0.999_999);
        let b = _mm512_set1_ps(1e-6);
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm512_fmadd_ps(*v, a, b);
            }
        }
        std::hint::black_box(acc);
        iters * 12 * 16 * 2
    }

    /// # Safety
    /// AVX2 and FMA available.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma256(iters: u64) -> u64 {
        let mut acc = [_mm256_set1_ps(0.0); 12];
        let a = _mm256_set1_ps(0.999_999);
        let b = _mm256_set1_ps(1e-6);
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm256_fmadd_ps(*v, a, b);
            }
        }
        std::hint::black_box(acc);
        iters * 12 * 8 * 2
    }

    /// # Safety
    /// AVX512-BF16 available.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn dpbf16(iters: u64) -> u64 {
        let mut acc = [_mm512_set1_ps(0.0); 12];
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
        iters * 12 * 32 * 2
    }
}
