//! Software prefetch for the kernels that stream expert weights from DRAM (decode).
//!
//! Whether it helps depends on the core: on AMD Zen 3 a one-row int8 dot product streams at
//! 8 GB/s per core without it and 17–18 GB/s with loads prefetched 4 KiB ahead (the hardware
//! prefetchers do not keep enough lines in flight behind a compute loop); an earlier
//! measurement on Zen 4 found prefetching slower. So the distance is measured once per process
//! ([`ensure_chosen`]): the vector int8 kernel streams a cache-flushed buffer with and without
//! prefetching, single-threaded, and the faster wins. `KT_KERNEL_PREFETCH=<bytes>|0|auto`
//! overrides. Prefetching never changes a result, only speed.
use crate::{Error, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Bytes ahead of the current load that streaming kernels prefetch (0 = none). Kernels read
/// it once per call.
static DISTANCE: AtomicUsize = AtomicUsize::new(0);

static CHOSEN: OnceLock<std::result::Result<usize, Error>> = OnceLock::new();

/// The distance tried by the calibration.
pub const CANDIDATE: usize = 4096;

/// Largest distance accepted from the environment.
const MAX_DISTANCE: usize = 1 << 16;

/// The prefetch distance in bytes the kernels use now (0 = off).
#[inline(always)]
pub fn distance() -> usize {
    DISTANCE.load(Ordering::Relaxed)
}

/// Set the distance (a multiple of 64 bytes; 0 turns prefetching off). For tests and tools;
/// [`ensure_chosen`] sets it for real use.
pub fn set(bytes: usize) {
    DISTANCE.store(bytes / 64 * 64, Ordering::Relaxed);
}

/// Choose the distance once per process (environment, else calibration) and apply it;
/// returns it.
pub fn ensure_chosen() -> Result<usize> {
    let chosen = CHOSEN
        .get_or_init(|| {
            let d = match from_env()? {
                Some(d) => d,
                None => calibrate(),
            };
            if std::env::var("KT_KERNEL_DEBUG").is_ok_and(|v| v == "1") {
                eprintln!("[kt_kernel] prefetch distance: {d} bytes");
            }
            Ok(d)
        })
        .clone()?;
    set(chosen);
    Ok(chosen)
}

/// `KT_KERNEL_PREFETCH`, if set to anything but `auto`.
fn from_env() -> Result<Option<usize>> {
    match std::env::var("KT_KERNEL_PREFETCH") {
        Ok(v) => parse_setting(&v),
        Err(_) => Ok(None),
    }
}

/// A byte count (multiple of 64, ≤ 64 KiB), `0`/`off`, or `auto`/empty (= None: calibrate).
fn parse_setting(v: &str) -> Result<Option<usize>> {
    match v.trim() {
        "" | "auto" => Ok(None),
        "off" => Ok(Some(0)),
        s => match s.parse::<usize>() {
            Ok(n) if n <= MAX_DISTANCE && n.is_multiple_of(64) => Ok(Some(n)),
            _ => Err(Error::Invalid(format!(
                "KT_KERNEL_PREFETCH={v:?}: use a byte count that is a multiple of 64 and at most \
                 {MAX_DISTANCE}, 0/off, or auto"
            ))),
        },
    }
}

/// Stream 64 MiB through the best vector int8 kernel (one row, one thread), caches flushed
/// before each pass, with and without prefetching; three interleaved rounds, best of each.
/// Prefetching must win by 5% to be chosen.
fn calibrate() -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        let Ok(kernels) = super::KernelSet::for_level(
            crate::isa::global().map_or(crate::isa::Level::Generic, |s| s.chosen),
        ) else {
            return 0;
        };
        if kernels.level() < crate::isa::Level::Avx2 {
            return 0;
        }
        let k = 2048;
        let group = 32 * k;
        let groups = (64 << 20) / group;
        let Ok(mut buf) = crate::pack::AlignedBuf::<u8>::zeroed(groups * group) else {
            return 0;
        };
        for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 251) as u8 & 0x7f;
        }
        let a = super::int8::activation_row(&vec![129u8; k]);
        let sums = [0i32; 32];
        let rate = |d: usize| {
            set(d);
            // SAFETY: the buffer is ours; clflush only evicts lines.
            unsafe { flush(buf.as_slice()) };
            let t = std::time::Instant::now();
            let mut out = [0i32; 32];
            for g in 0..groups {
                // SAFETY: group g lies inside the buffer; one row of k bytes; 32 sums.
                unsafe {
                    kernels.int8_dot_raw(
                        &[a.as_ptr()],
                        k,
                        buf.as_ptr().add(g * group),
                        sums.as_ptr(),
                        out.as_mut_ptr(),
                    )
                };
                std::hint::black_box(&out);
            }
            (groups * group) as f64 / t.elapsed().as_secs_f64()
        };
        let (mut off, mut on) = (0f64, 0f64);
        for _ in 0..3 {
            off = off.max(rate(0));
            on = on.max(rate(CANDIDATE));
        }
        let chosen = if on > 1.05 * off { CANDIDATE } else { 0 };
        if std::env::var("KT_KERNEL_DEBUG").is_ok_and(|v| v == "1") {
            eprintln!(
                "[kt_kernel] prefetch calibration (1 thread, int8 kernel from DRAM): off {:.1} GB/s, \
                 {CANDIDATE} B ahead {:.1} GB/s",
                off / 1e9,
                on / 1e9
            );
        }
        chosen
    }
    #[cfg(not(target_arch = "x86_64"))]
    0
}

/// Evict `buf` from every cache level.
///
/// # Safety
/// `buf` is readable memory.
#[cfg(target_arch = "x86_64")]
unsafe fn flush(buf: &[u8]) {
    use std::arch::x86_64::{_mm_clflush, _mm_mfence};
    for i in (0..buf.len()).step_by(64) {
        // SAFETY: inside `buf`.
        unsafe { _mm_clflush(buf.as_ptr().add(i)) };
    }
    // SAFETY: a fence has no memory operands.
    unsafe { _mm_mfence() };
}

/// Prefetch the line holding `p` into L1 (nothing off x86-64). Any address is fine:
/// prefetches never fault.
#[inline(always)]
fn line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch has no architectural effect and does not fault on any address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Prefetch the line `distance` bytes after `p` (no-op when `distance` is 0). The address may
/// lie past the end of the buffer.
#[inline(always)]
pub(crate) fn ahead(p: *const u8, distance: usize) {
    if distance != 0 {
        line(p.wrapping_add(distance));
    }
}

/// Prefetch every line of the `bytes` bytes at `p` (for data about to be read and written
/// at scattered places, which the hardware prefetchers cannot predict).
#[inline(always)]
pub(crate) fn lines(p: *const u8, bytes: usize) {
    for off in (0..bytes).step_by(64) {
        line(p.wrapping_add(off));
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn settings_are_checked() {
        let p = super::parse_setting;
        assert_eq!(p("4096"), Ok(Some(4096)));
        assert_eq!(p(" 0 "), Ok(Some(0)));
        assert_eq!(p("off"), Ok(Some(0)));
        assert_eq!(p("auto"), Ok(None));
        assert_eq!(p(""), Ok(None));
        for bad in ["100", "lots", "1048576", "-64"] {
            assert!(p(bad).is_err(), "{bad}");
        }
    }
}
