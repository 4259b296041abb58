//! Measurements made once per process that pick among equivalent kernels: whether the
//! AVX512-BF16 dot product beats fp32 FMA for prefill, and how far ahead each family of
//! streaming kernels prefetches. Each measurement is a few milliseconds; an environment variable overrides it.
use super::prefetch::{self, parse_setting, Family};
use super::{KernelSet, MAX_ROWS};
use crate::isa::Level;
use crate::pack::PANEL;
use crate::{Error, Result};
use std::sync::OnceLock;

static CHOSEN: [OnceLock<std::result::Result<usize, Error>>; prefetch::FAMILIES] =
    [const { OnceLock::new() }; prefetch::FAMILIES];

/// Bytes a calibration streams per pass (far beyond any cache).
pub const CALIBRATION_BYTES: usize = 64 << 20;

/// A family's calibration workload: stream two buffers of equal size (every byte below
/// `0x80`) once through one of the family's decode kernels at `level`, one activation row, on
/// the calling thread, alternating between them panel by panel as a decode alternates between
/// an expert's gate and up matrices (two streams per core: a lone stream is what hardware
/// prefetchers follow best, and no decode reads one).
pub type Workload = fn(Level, &[u8], &[u8]);

/// The start of each `panel`-byte panel of `gate` and `up`, alternating (gate's first, up's
/// first, gate's second, ...) as a decode walks an expert's two matrices: what a
/// [`Workload`] streams through its kernel, one call of `run` per panel. `run`'s result is
/// kept from the optimizer.
pub fn alternate_panels<T>(
    gate: &[u8],
    up: &[u8],
    panel: usize,
    mut run: impl FnMut(*const u8) -> T,
) {
    let panels = gate.len().min(up.len()) / panel;
    for (p, buf) in (0..panels).flat_map(|p| [(p, gate), (p, up)]) {
        std::hint::black_box(run(buf[p * panel..].as_ptr()));
    }
}

/// Choose `family`'s distance once per process (`KT_KERNEL_PREFETCH`, else a calibration with
/// `workload`) and apply it; returns it.
pub fn ensure_prefetch_chosen(family: Family, workload: Workload) -> Result<usize> {
    let chosen = CHOSEN[family as usize]
        .get_or_init(|| {
            let d = match from_env()? {
                Some(d) => {
                    prefetch::freeze(family);
                    d
                }
                None => calibrate(family, workload),
            };
            if std::env::var("KT_KERNEL_DEBUG").is_ok_and(|v| v == "1") {
                let (bytes, l2) = prefetch::describe(d);
                let into = if l2 { " into L2" } else { "" };
                eprintln!("[kt_kernel] prefetch distance ({family:?}): {bytes} bytes{into}");
            }
            Ok(d)
        })
        .clone()?;
    prefetch::set_unless_tuned(family, chosen);
    Ok(prefetch::describe(prefetch::distance_of(family)).0)
}

/// `KT_KERNEL_PREFETCH`, if set to anything but `auto`.
fn from_env() -> Result<Option<usize>> {
    match std::env::var("KT_KERNEL_PREFETCH") {
        Ok(v) => parse_setting("KT_KERNEL_PREFETCH", &v),
        Err(_) => Ok(None),
    }
}

/// Rounds of the prefetch calibration, each one pass without and one with prefetching.
const ROUNDS: usize = 5;

/// The median of `v` (non-empty).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Threads a calibration streams on: the machine's cores (the decode kernels run on all of
/// them and share the memory system), at most 8.
fn calibration_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8)
}

/// Stream [`CALIBRATION_BYTES`] through `workload` at the process's level, split over
/// [`calibration_threads`] threads running at once, caches flushed before each pass, without
/// and with prefetching in [`ROUNDS`] paired rounds. Prefetching is chosen when the median of
/// the rounds' speed ratios is above 1.05.
fn calibrate(family: Family, workload: Workload) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        let level = crate::isa::global().map_or(Level::Generic, |s| s.chosen);
        if level < Level::Avx2 {
            return 0;
        }
        let Ok(mut buf) = crate::pack::AlignedBuf::<u8>::zeroed(CALIBRATION_BYTES) else {
            return 0;
        };
        // Bytes below 0x80 in a period of 251, copied a period at a time (a byte loop with a
        // remainder per byte was a tenth of the calibration).
        let period: Vec<u8> = (0..251u8).map(|i| i & 0x7f).collect();
        for chunk in buf.as_mut_slice().chunks_mut(period.len()) {
            chunk.copy_from_slice(&period[..chunk.len()]);
        }
        let threads = calibration_threads();
        let rate = |d: usize| {
            prefetch::set_of(family, d);
            // SAFETY: the buffer is ours; flushing only evicts lines.
            unsafe { flush(buf.as_slice()) };
            let share = CALIBRATION_BYTES / threads;
            let t = std::time::Instant::now();
            std::thread::scope(|s| {
                for chunk in buf.as_slice().chunks(share) {
                    let (a, b) = chunk.split_at(chunk.len() / 2);
                    s.spawn(move || workload(level, a, b));
                }
            });
            CALIBRATION_BYTES as f64 / t.elapsed().as_secs_f64()
        };
        // Paired rounds: the VM's bandwidth drifts between rounds, so each round's ratio is
        // taken against its own neighbour and the median ratio decides.
        let mut ratios = Vec::with_capacity(ROUNDS);
        let (mut off, mut on) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let (a, b) = (rate(0), rate(prefetch::CANDIDATE));
            ratios.push(b / a);
            off.push(a);
            on.push(b);
        }
        let gain = median(&mut ratios);
        let chosen = if gain > 1.05 { prefetch::CANDIDATE } else { 0 };
        if std::env::var("KT_KERNEL_DEBUG").is_ok_and(|v| v == "1") {
            eprintln!(
                "[kt_kernel] prefetch calibration ({family:?}, {threads} threads, from DRAM): \
                 off {:.1} GB/s, {} B ahead {:.1} GB/s (medians of {ROUNDS}; median gain \
                 {gain:.3})",
                median(&mut off) / 1e9,
                prefetch::CANDIDATE,
                median(&mut on) / 1e9
            );
        }
        chosen
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (family, workload);
        0
    }
}

/// Evict `buf` from every cache level: with CLFLUSHOPT where the CPU has it (CLFLUSH is
/// serialized line by line: 64 MiB took 150 ms on an Emerald Rapids VM, CLFLUSHOPT 3 ms, and a
/// read after either came from DRAM at the same rate).
///
/// # Safety
/// `buf` is readable memory.
#[cfg(target_arch = "x86_64")]
unsafe fn flush(buf: &[u8]) {
    use std::arch::x86_64::{_mm_clflush, _mm_mfence};
    let lines = (0..buf.len()).step_by(64);
    if has_clflushopt() {
        for i in lines {
            // SAFETY: inside `buf`; CPUID reports the instruction, which only evicts a line.
            unsafe {
                std::arch::asm!("clflushopt [{p}]", p = in(reg) buf.as_ptr().add(i),
                    options(nostack, preserves_flags));
            }
        }
    } else {
        for i in lines {
            // SAFETY: inside `buf`.
            unsafe { _mm_clflush(buf.as_ptr().add(i)) };
        }
    }
    // SAFETY: a fence has no memory operands; it also orders the CLFLUSHOPTs before the reads.
    unsafe { _mm_mfence() };
}

/// Whether CPUID.(EAX=7,ECX=0):EBX bit 23 reports CLFLUSHOPT.
#[cfg(target_arch = "x86_64")]
fn has_clflushopt() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| __cpuid(0).eax >= 7 && __cpuid_count(7, 0).ebx & (1 << 23) != 0)
}

static BF16_FASTER: OnceLock<bool> = OnceLock::new();

/// Whether the bf16 dot kernels beat fp32 FMA on this CPU at `level` (measured once).
pub fn bf16_dot_is_faster(level: Level) -> bool {
    *BF16_FASTER.get_or_init(|| calibrate_bf16(level))
}

/// Time the fp32-FMA and bf16 kernels on an in-cache panel (a few ms, best of three rounds
/// each, interleaved so machine noise hits both) and report whether bf16 is clearly faster.
fn calibrate_bf16(level: Level) -> bool {
    let (Ok(fma), Ok(bf)) = (KernelSet::for_level(level), KernelSet::with_bf16(level, 1)) else {
        return false;
    };
    let k = 1024;
    let panel: Vec<u16> = (0..PANEL * k)
        .map(|i| (0x3f80 + (i % 97) as u16) & 0x3fff)
        .collect();
    let a: Vec<f32> = (0..k).map(|i| (i % 13) as f32 * 0.1).collect();
    let mut staged = vec![0u32; k / 2];
    bf.stage_bf16(&a, &mut staged);
    let mut out = vec![0f32; MAX_ROWS * PANEL];
    let rate = |f: &mut dyn FnMut(), rows: usize| {
        let t = std::time::Instant::now();
        let mut n = 0usize;
        while t.elapsed().as_micros() < 1500 {
            f();
            n += 1;
        }
        (n * rows) as f64 / t.elapsed().as_secs_f64()
    };
    let (mut best_fma, mut best_bf) = (0f64, 0f64);
    let fr = fma.rows_per_block();
    let br = bf.bf16().map_or(1, |p| p.rows_per_block);
    let fma_rows: Vec<&[f32]> = (0..fr).map(|_| a.as_slice()).collect();
    let bf_rows: Vec<&[u32]> = (0..br).map(|_| staged.as_slice()).collect();
    for _ in 0..3 {
        best_fma = best_fma.max(rate(&mut || fma.panel_dot(&fma_rows, &panel, &mut out), fr));
        best_bf = best_bf.max(rate(
            &mut || bf.panel_dot_bf16(&bf_rows, &panel, &mut out),
            br,
        ));
    }
    let faster = best_bf > 1.15 * best_fma;
    if std::env::var("KT_KERNEL_DEBUG").is_ok_and(|v| v == "1") {
        eprintln!(
            "[kt_kernel] bf16 calibration: fp32-FMA {:.1} vs bf16-dot {:.1} Mrow-panels/s -> {}",
            best_fma / 1e6,
            best_bf / 1e6,
            if faster {
                "bf16 dot for prefill"
            } else {
                "fp32 FMA everywhere"
            }
        );
    }
    faster
}

#[cfg(test)]
mod tests {
    #[test]
    fn settings_are_checked() {
        let p = |v| super::parse_setting("KT_KERNEL_PREFETCH", v);
        assert_eq!(p("4096"), Ok(Some(4096)));
        assert_eq!(p(" 0 "), Ok(Some(0)));
        assert_eq!(p("off"), Ok(Some(0)));
        assert_eq!(p("auto"), Ok(None));
        assert_eq!(p(""), Ok(None));
        let l2 = crate::kernels::prefetch::INTO_L2;
        assert_eq!(p("4096:l2"), Ok(Some(4096 | l2)));
        assert_eq!(p("0:l2"), Ok(Some(0)));
        for bad in [
            "100", "lots", "1048576", "-64", ":l2", "auto:l2", "100:l2", "4096:l3",
        ] {
            assert!(p(bad).is_err(), "{bad}");
        }
    }
}
