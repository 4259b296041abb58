//! Measurements made once per process that pick among equivalent kernels: whether the
//! AVX512-BF16 dot product beats fp32 FMA for prefill, and how far ahead the streaming kernels
//! prefetch. Each measurement is a few milliseconds; an environment variable overrides it.
use super::group_dot::VectorKernel;
use super::{prefetch, KernelSet, MAX_ROWS};
use crate::isa::Level;
use crate::pack::PANEL;
use crate::{Error, Result};
use std::sync::OnceLock;

static CHOSEN: OnceLock<std::result::Result<usize, Error>> = OnceLock::new();

/// Largest distance accepted from the environment.
const MAX_DISTANCE: usize = 1 << 16;

/// Choose the distance once per process (environment, else calibration) and apply it;
/// returns it.
pub fn ensure_prefetch_chosen(probe: fn(Level) -> VectorKernel) -> Result<usize> {
    let chosen = CHOSEN
        .get_or_init(|| {
            let d = match from_env()? {
                Some(d) => d,
                None => calibrate(probe),
            };
            if std::env::var("KT_KERNEL_DEBUG").is_ok_and(|v| v == "1") {
                eprintln!("[kt_kernel] prefetch distance: {d} bytes");
            }
            Ok(d)
        })
        .clone()?;
    prefetch::set(chosen);
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

/// Stream 64 MiB through `probe`'s vector kernel at the process's level (one row, one thread),
/// caches flushed before each pass, with and without prefetching; three interleaved rounds,
/// best of each. Prefetching must win by 5% to be chosen. The probe is a byte group kernel
/// (groups of `32·k` bytes, AMXINT8's), the one whose streaming rate decode depends on most.
fn calibrate(probe: fn(Level) -> VectorKernel) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        let level = crate::isa::global().map_or(Level::Generic, |s| s.chosen);
        if level < Level::Avx2 {
            return 0;
        }
        let kernel = probe(level);
        let k = 2048;
        let group = 32 * k;
        let groups = (64 << 20) / group;
        let Ok(mut buf) = crate::pack::AlignedBuf::<u8>::zeroed(groups * group) else {
            return 0;
        };
        for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 251) as u8 & 0x7f;
        }
        let a = super::group_dot::activation_row(&vec![129u8; k]);
        let sums = [0i32; 32];
        let rate = |d: usize| {
            prefetch::set(d);
            // SAFETY: the buffer is ours; clflush only evicts lines.
            unsafe { flush(buf.as_slice()) };
            let t = std::time::Instant::now();
            let mut out = [0i32; 32];
            for g in 0..groups {
                // SAFETY: group g lies inside the buffer; one activation row of k values; 32
                // sums; the probe's kernel runs at the process's level.
                unsafe {
                    (kernel.dot)(
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
            on = on.max(rate(prefetch::CANDIDATE));
        }
        let chosen = if on > 1.05 * off {
            prefetch::CANDIDATE
        } else {
            0
        };
        if std::env::var("KT_KERNEL_DEBUG").is_ok_and(|v| v == "1") {
            eprintln!(
                "[kt_kernel] prefetch calibration (1 thread, int8 kernel from DRAM): off {:.1} GB/s, \
                 {} B ahead {:.1} GB/s",
                off / 1e9,
                prefetch::CANDIDATE,
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
