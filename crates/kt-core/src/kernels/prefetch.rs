//! Software prefetch for the kernels that stream expert weights from DRAM (decode).
//!
//! Whether it helps depends on the core: on AMD Zen 3 a one-row int8 dot product streams at
//! 8 GB/s per core without it and 17–18 GB/s with loads prefetched 4 KiB ahead (the hardware
//! prefetchers do not keep enough lines in flight behind a compute loop); an earlier
//! measurement on Zen 4 found prefetching slower for that kernel and faster for the 4-bit
//! group-scaled ones; on an Intel Sapphire/Emerald Rapids VM with two threads streaming,
//! prefetching 4 KiB ahead made the int8 decode 5% slower and FP8, MXFP8, BF16, the 4-bit
//! kernels 8–40% faster. So the distance is measured once per process and kernel [`Family`]
//! ([`super::calibrate::ensure_prefetch_chosen`]): a kernel of the family streams a
//! cache-flushed buffer with and without prefetching on as many threads as the machine has
//! cores (up to 8: the memory system is shared, and a lone thread gets a bandwidth no decode
//! sees), and the faster wins. That stream is still not a decode (on the Emerald Rapids VM
//! the AMXINT4 stream showed no gain where FP8 decodes ran 30% faster), so the calibration is
//! only the starting point: the process's first decodes of each family time runs with and
//! without prefetching ([`tune_begin`], [`tune_end`]) and keep the faster.
//! `KT_KERNEL_PREFETCH=<bytes>|0|auto` overrides both. Prefetching never changes a result,
//! only speed.
use std::sync::atomic::{AtomicUsize, Ordering};

/// Kernel families whose prefetch distances are chosen separately: whether the hardware
/// prefetchers keep enough lines in flight depends on how much work the loop does per byte
/// (on Zen 4 the int8 byte-group kernel streams at full speed without help while the 4-bit
/// group-scaled kernels, with a table lookup and scale conversion per line, gain 8–12%).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// The streaming kernels with little work per byte: AMXINT4's nibble groups, the BF16 /
    /// fp32 panel dots, the GGUF dots, the FP8 decoders (measured with the AMXINT4 kernel).
    ByteGroups = 0,
    /// The group-scaled native kernels (RAWINT4, GPTQ_INT4, MXFP4, NVFP4, MXFP8).
    CodeGroups = 1,
    /// AMXINT8's byte groups (a multiply-accumulate per byte: the hardware prefetchers keep
    /// up on more cores than for the others).
    Int8Groups = 2,
}

/// Families in all.
pub const FAMILIES: usize = 3;

/// Bytes ahead of the current load that each family's streaming kernels prefetch (0 = none).
/// Kernels read it once per call.
static DISTANCE: [AtomicUsize; FAMILIES] = [const { AtomicUsize::new(0) }; FAMILIES];

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

/// The method's kernel family.
pub fn family_of(method: crate::method::Method) -> Family {
    use crate::method::Method as M;
    match method {
        M::AmxInt8 => Family::Int8Groups,
        M::RawInt4 | M::GptqInt4 | M::MxFp4 | M::NvFp4 | M::MxFp8 => Family::CodeGroups,
        _ => Family::ByteGroups,
    }
}

/// Decodes timed per setting before the tuner decides.
const TUNE_SAMPLES: usize = 40;

/// Decodes timed in a row with one setting.
const TUNE_RUN: usize = 8;

/// Decodes of a family run before the tuner starts timing (first touches, cold caches).
const TUNE_WARMUP: usize = 8;

/// A family's tuning in the serving process: the calibration (a synthetic stream) only
/// guesses; the first [`TUNE_SAMPLES`] decodes of each setting (off, [`CANDIDATE`]),
/// alternating, are timed per expert, and the faster median is kept from then on.
struct Tune {
    /// Decodes seen before timing started.
    warmup: usize,
    /// Seconds per expert of the decodes run with setting 0 (off) and 1 (on).
    samples: [Vec<f64>; 2],
    /// Decided (or never to be tuned: the distance came from the environment).
    done: bool,
}

static TUNES: [std::sync::Mutex<Tune>; FAMILIES] =
    [const { std::sync::Mutex::new(Tune::new()) }; FAMILIES];

/// Whether any family is still being tuned (checked before locking anything).
static TUNING: [std::sync::atomic::AtomicBool; FAMILIES] =
    [const { std::sync::atomic::AtomicBool::new(true) }; FAMILIES];

/// Stop tuning `family` (its distance is the one set now): the environment fixed it.
pub fn freeze(family: Family) {
    TUNING[family as usize].store(false, Ordering::Relaxed);
    TUNES[family as usize]
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .done = true;
}

impl Tune {
    const fn new() -> Tune {
        Tune {
            warmup: 0,
            samples: [Vec::new(), Vec::new()],
            done: false,
        }
    }

    /// The setting (0 off, 1 on) to time the next decode with, or None (warming up, done).
    fn next_arm(&mut self) -> Option<usize> {
        if self.done {
            return None;
        }
        if self.warmup < TUNE_WARMUP {
            self.warmup += 1;
            return None;
        }
        // Runs of TUNE_RUN decodes per setting, alternating: the hardware prefetchers train
        // on what runs, so a setting flipped every decode measures the mix (seen: no
        // difference per decode where runs differed by 8%).
        let taken = self.samples[0].len() + self.samples[1].len();
        Some((taken / TUNE_RUN) % 2)
    }

    /// Record a decode; once both settings have their samples, the decision: the distance
    /// whose median is faster by 2% (prefetching off otherwise) and both medians.
    fn record(&mut self, arm: usize, secs_per_expert: f64) -> Option<(usize, f64, f64)> {
        if self.done || !secs_per_expert.is_finite() {
            return None;
        }
        self.samples[arm].push(secs_per_expert);
        if self.samples.iter().any(|v| v.len() < TUNE_SAMPLES) {
            return None;
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let [a, b] = &mut self.samples;
        let (off, on) = (median(a), median(b));
        self.done = true;
        Some((if on * 1.02 < off { CANDIDATE } else { 0 }, off, on))
    }
}

/// Before a decode of `family`: the setting to time it with (its distance is applied now), or
/// None when this decode is not timed.
pub fn tune_begin(family: Family) -> Option<usize> {
    if !TUNING[family as usize].load(Ordering::Relaxed) {
        return None;
    }
    let mut t = TUNES[family as usize]
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let arm = t.next_arm()?;
    set_of(family, [0, CANDIDATE][arm]);
    Some(arm)
}

/// After that decode: it took `secs_per_expert`. Once both settings have their samples the
/// decision stays for the process.
pub fn tune_end(family: Family, arm: usize, secs_per_expert: f64) {
    let mut t = TUNES[family as usize]
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let Some((chosen, off, on)) = t.record(arm, secs_per_expert) else {
        return;
    };
    set_of(family, chosen);
    TUNING[family as usize].store(false, Ordering::Relaxed);
    if std::env::var("KT_KERNEL_DEBUG").is_ok_and(|v| v == "1") {
        eprintln!(
            "[kt_kernel] prefetch tuned on {TUNE_SAMPLES} decodes each ({family:?}): off \
             {:.1} µs/expert, {CANDIDATE} B ahead {:.1} µs/expert -> {chosen} bytes",
            off * 1e6,
            on * 1e6
        );
    }
}

/// Set `family`'s distance unless decodes have tuned it (the tuned value stays).
pub fn set_unless_tuned(family: Family, bytes: usize) {
    let t = TUNES[family as usize]
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if !(t.done && t.samples.iter().any(|v| !v.is_empty())) {
        set_of(family, bytes);
    }
}

/// Whether `family` is tuned (or fixed) and its distance final.
pub fn tuned(family: Family) -> bool {
    !TUNING[family as usize].load(Ordering::Relaxed)
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
    use super::*;

    /// Drive a tuner with per-decode times `time(arm)` until it decides.
    fn decide(time: impl Fn(usize) -> f64) -> (usize, usize) {
        let mut t = Tune::new();
        let (mut decodes, mut runs, mut last) = (0, 0, None);
        loop {
            decodes += 1;
            let Some(arm) = t.next_arm() else {
                assert!(decodes <= TUNE_WARMUP, "no arm after the warm-up");
                continue;
            };
            if last != Some(arm) {
                (last, runs) = (Some(arm), runs + 1);
            }
            if let Some((chosen, ..)) = t.record(arm, time(arm)) {
                assert!(t.next_arm().is_none(), "decided for good");
                return (chosen, runs);
            }
        }
    }

    #[test]
    fn the_tuner_keeps_the_faster_setting_and_times_runs_of_each() {
        // Prefetching 10% faster: on; 10% slower or within 2%: off.
        assert_eq!(decide(|arm| [1.0, 0.9][arm]).0, CANDIDATE);
        assert_eq!(decide(|arm| [1.0, 1.1][arm]).0, 0);
        assert_eq!(decide(|arm| [1.0, 0.99][arm]).0, 0);
        // Alternating runs of TUNE_RUN, not single decodes.
        assert_eq!(decide(|_| 1.0).1, 2 * TUNE_SAMPLES / TUNE_RUN);
        // A non-finite time is ignored.
        let mut t = Tune::new();
        while t.next_arm().is_none() {}
        assert!(t.record(0, f64::NAN).is_none() && t.samples[0].is_empty());
    }
}
