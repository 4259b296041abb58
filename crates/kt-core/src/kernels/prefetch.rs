//! Software prefetch for the kernels that stream expert weights from DRAM (decode).
//!
//! Whether it helps depends on the core: on AMD Zen 3 a one-row int8 dot product streams at
//! 8 GB/s per core without it and 17–18 GB/s with loads prefetched 4 KiB ahead (the hardware
//! prefetchers do not keep enough lines in flight behind a compute loop); an earlier
//! measurement on Zen 4 found prefetching slower. So the distance is measured once per process
//! ([`super::calibrate::ensure_prefetch_chosen`]): the vector int8 kernel streams a cache-flushed buffer with and without
//! prefetching, single-threaded, and the faster wins. `KT_KERNEL_PREFETCH=<bytes>|0|auto`
//! overrides. Prefetching never changes a result, only speed.
use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes ahead of the current load that streaming kernels prefetch (0 = none). Kernels read
/// it once per call.
static DISTANCE: AtomicUsize = AtomicUsize::new(0);

/// The distance tried by the calibration.
pub const CANDIDATE: usize = 4096;

/// The prefetch distance in bytes the kernels use now (0 = off).
#[inline(always)]
pub fn distance() -> usize {
    DISTANCE.load(Ordering::Relaxed)
}

/// Set the distance (a multiple of 64 bytes; 0 turns prefetching off). For tests and tools;
/// [`super::calibrate::ensure_prefetch_chosen`] sets it for real use.
pub fn set(bytes: usize) {
    DISTANCE.store(bytes / 64 * 64, Ordering::Relaxed);
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
