//! Software prefetch for the kernels that stream expert weights from DRAM (decode).
//!
//! Whether it helps depends on the core: on AMD Zen 3 a one-row int8 dot product streams at
//! 8 GB/s per core without it and 17–18 GB/s with loads prefetched 4 KiB ahead (the hardware
//! prefetchers do not keep enough lines in flight behind a compute loop); an earlier
//! measurement on Zen 4 found prefetching slower for that kernel and faster for the 4-bit
//! group-scaled ones. So the distance is measured once per process and kernel [`Family`]
//! ([`super::calibrate::ensure_prefetch_chosen`]): a kernel of the family streams a
//! cache-flushed buffer with and without prefetching, single-threaded, and the faster wins. `KT_KERNEL_PREFETCH=<bytes>|0|auto`
//! overrides. Prefetching never changes a result, only speed.
use std::sync::atomic::{AtomicUsize, Ordering};

/// Kernel families whose prefetch distances are chosen separately: whether the hardware
/// prefetchers keep enough lines in flight depends on how much work the loop does per byte
/// (on Zen 4 the int8 byte-group kernel streams at full speed without help while the 4-bit
/// group-scaled kernels, with a table lookup and scale conversion per line, gain 8–12%).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// The byte-group kernels: AMXINT8/AMXINT4, BF16, the GGUF dots, FP8.
    ByteGroups = 0,
    /// The group-scaled native kernels (RAWINT4, GPTQ_INT4, MXFP4, NVFP4, MXFP8).
    CodeGroups = 1,
}

/// Bytes ahead of the current load that each family's streaming kernels prefetch (0 = none).
/// Kernels read it once per call.
static DISTANCE: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];

/// The distance tried by the calibration.
pub const CANDIDATE: usize = 4096;

/// The prefetch distance in bytes the byte-group kernels use now (0 = off).
#[inline(always)]
pub fn distance() -> usize {
    distance_of(Family::ByteGroups)
}

/// The prefetch distance in bytes `family`'s kernels use now (0 = off).
#[inline(always)]
pub fn distance_of(family: Family) -> usize {
    DISTANCE[family as usize].load(Ordering::Relaxed)
}

/// Set the byte-group kernels' distance (a multiple of 64 bytes; 0 turns prefetching off).
/// For tests and tools; [`super::calibrate::ensure_prefetch_chosen`] sets it for real use.
pub fn set(bytes: usize) {
    set_of(Family::ByteGroups, bytes);
}

/// Set `family`'s distance (a multiple of 64 bytes; 0 turns prefetching off).
pub fn set_of(family: Family, bytes: usize) {
    DISTANCE[family as usize].store(bytes / 64 * 64, Ordering::Relaxed);
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
