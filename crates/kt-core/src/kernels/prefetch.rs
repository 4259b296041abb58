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
//! only the starting point: the process's first decodes of each family time runs without
//! prefetching, with lines prefetched 4 KiB ahead into L1 or into L2 and 16 KiB ahead into L2
//! ([`tune_begin`], [`tune_end`]) and keep the fastest.
//! `KT_KERNEL_PREFETCH=<bytes>|<bytes>:l2|0|auto` overrides both. Prefetching never changes a result,
//! only speed.
use crate::{Error, Result};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Kernel families whose prefetch distances are chosen separately: whether the hardware
/// prefetchers keep enough lines in flight depends on how much work the loop does per byte
/// (on Zen 4 the int8 byte-group kernel streams at full speed without help while the 4-bit
/// group-scaled kernels, with a table lookup and scale conversion per line, gain 8–12%).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// The streaming kernels with little work per byte: AMXINT4's nibble groups, the BF16 /
    /// fp32 panel dots (measured with the AMXINT4 kernel).
    ByteGroups = 0,
    /// The group-scaled native kernels (RAWINT4, GPTQ_INT4, MXFP4, NVFP4, MXFP8).
    CodeGroups = 1,
    /// AMXINT8's byte groups (a multiply-accumulate per byte: the hardware prefetchers keep
    /// up on more cores than for the others).
    Int8Groups = 2,
    /// FP8's decode kernels (FP8, FP8_PERCHANNEL): an E4M3 decode and two fp32 FMAs per four
    /// bytes, so a core computes about as fast as it can read (AMD Zen 4, one core from cache:
    /// 24-27 GB/s, `byte_cycles`). With the byte groups' setting, which a BF16 layer in the
    /// same process had tuned, FP8 decoded at 33 GB/s where 4 KiB into L1 gave 39 (Zen 4 VM,
    /// two threads, memory reading 57-60 GB/s), so FP8 tunes its own.
    Fp8Codes = 3,
    /// LLAMAFILE's GGUF block kernels (Q4_K, Q6_K, Q8_0, ...). Their best setting differs from
    /// the byte groups' (AMD Zen 4, one S1 layer at 1 token: Q4_K and Q8_0 fastest with 4 KiB
    /// into L1, while BF16 and AMXINT4 were fastest with 16 KiB into L2, where Q8_0 ran 1.2x
    /// slower), so a process holding both tunes each on its own decodes.
    GgufBlocks = 4,
}

/// Families in all.
pub const FAMILIES: usize = 5;

/// Bytes ahead of the current load that each family's streaming kernels prefetch (0 = none).
/// Kernels read it once per call.
static DISTANCE: [AtomicUsize; FAMILIES] = [const { AtomicUsize::new(0) }; FAMILIES];

/// What the many-row (prefill) panel kernels prefetch by default: lines 8 KiB ahead into L2.
/// A prefill multiplies each panel by many rows, so the decode tuner's measurement does not
/// apply; on AMD Zen 4 (S1, 512 tokens, `prefill BF16 512`, four alternated rounds) the
/// bf16-pair kernel ran 135-160 ms without prefetching and 116-143 with this, the fp32 FMA
/// kernel 220-310 against 190-214 (one core, 12 rows streamed from memory: 99-110 against
/// 152-173 GFLOP/s, `BF16DOT=1 PF=8192 PF_L2=1 ROWS=12 PANELS=2000 panel_rows`).
pub const PANEL_DEFAULT: usize = 8192 | INTO_L2;

/// The panel kernels' setting for calls of 4 rows and more: [`PANEL_DEFAULT`], or
/// `KT_KERNEL_PANEL_PREFETCH` (the syntax of `KT_KERNEL_PREFETCH`; `0` turns it off); an
/// error for a value that is not a setting (layer builds check it first).
pub fn panel_setting() -> Result<usize> {
    static SETTING: std::sync::OnceLock<Result<usize>> = std::sync::OnceLock::new();
    SETTING
        .get_or_init(|| match std::env::var("KT_KERNEL_PANEL_PREFETCH") {
            Ok(v) => Ok(parse_setting("KT_KERNEL_PANEL_PREFETCH", &v)?.unwrap_or(PANEL_DEFAULT)),
            Err(_) => Ok(PANEL_DEFAULT),
        })
        .clone()
}

/// [`panel_setting`] where it is valid, else [`PANEL_DEFAULT`] (a layer build has refused it).
#[inline]
pub fn panel_distance() -> usize {
    panel_setting().unwrap_or(PANEL_DEFAULT)
}

/// The setting a panel kernel of `rows` rows uses: [`panel_distance`] from 4 rows (a
/// prefill's blocks), else the byte-group family's decode setting.
#[inline(always)]
pub fn for_panel_rows(rows: usize) -> usize {
    for_panel_rows_of(Family::ByteGroups, rows)
}

/// [`for_panel_rows`] for a kernel of `family`: its decode setting below 4 rows.
#[inline(always)]
pub fn for_panel_rows_of(family: Family, rows: usize) -> usize {
    if rows >= 4 {
        panel_distance()
    } else {
        distance_of(family)
    }
}

/// Largest distance accepted from the environment.
const MAX_DISTANCE: usize = 1 << 16;

/// A byte count (multiple of 64, ≤ 64 KiB; with `:l2` the lines go to L2 rather than L1),
/// `0`/`off`, or `auto`/empty (= None: calibrate).
pub(crate) fn parse_setting(name: &str, v: &str) -> Result<Option<usize>> {
    let s = v.trim();
    let (bytes, into_l2) = match s.strip_suffix(":l2") {
        Some(b) => (b, true),
        None => (s, false),
    };
    match bytes {
        "" if !into_l2 => Ok(None),
        "auto" if !into_l2 => Ok(None),
        "off" if !into_l2 => Ok(Some(0)),
        b => match b.parse::<usize>() {
            Ok(n) if n <= MAX_DISTANCE && n.is_multiple_of(64) => {
                Ok(Some(if into_l2 && n > 0 { n | INTO_L2 } else { n }))
            }
            _ => Err(Error::Invalid(format!(
                "{name}={v:?}: use a byte count that is a multiple of 64 and at most \
                 {MAX_DISTANCE} (into L1; `<bytes>:l2` into L2), 0/off, or auto"
            ))),
        },
    }
}

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

/// Set `family`'s distance (a multiple of 64 bytes, plus [`INTO_L2`] for lines into L2 rather
/// than L1; 0 turns prefetching off).
pub fn set_of(family: Family, setting: usize) {
    let bytes = setting & !63;
    let into_l2 = if bytes > 0 { setting & INTO_L2 } else { 0 };
    DISTANCE[family as usize].store(bytes | into_l2, Ordering::Relaxed);
}

/// Marks a distance whose lines go to L2 (`prefetcht1`) rather than L1: distances are
/// multiples of 64, so the low bit is free.
pub const INTO_L2: usize = 1;

/// The distance in bytes and whether lines go to L2, of a stored setting.
pub fn describe(setting: usize) -> (usize, bool) {
    (setting & !63, setting & INTO_L2 != 0)
}

/// The method's kernel family.
pub fn family_of(method: crate::method::Method) -> Family {
    use crate::method::Method as M;
    match method {
        M::AmxInt8 => Family::Int8Groups,
        M::RawInt4 | M::GptqInt4 | M::MxFp4 | M::NvFp4 | M::MxFp8 => Family::CodeGroups,
        M::Fp8 | M::Fp8PerChannel => Family::Fp8Codes,
        M::Llamafile => Family::GgufBlocks,
        _ => Family::ByteGroups,
    }
}

/// Decodes timed per setting before the tuner decides.
const TUNE_SAMPLES: usize = 40;

/// Decodes timed in a row with one setting.
const TUNE_RUN: usize = 8;

/// Decodes of a family run before the tuner starts timing (first touches, cold caches).
const TUNE_WARMUP: usize = 8;

/// The tuner's far arm: bytes ahead, into L2.
pub const FAR: usize = 16384;

/// The settings the tuner compares: off, [`CANDIDATE`] bytes ahead into L1, the same into L2,
/// and [`FAR`] bytes ahead into L2. The far arm serves a core that streams faster than one
/// [`CANDIDATE`] ahead covers: AMD Zen 4 VM, MXFP4 panels on one thread (`kgroup_stream`),
/// 73-75% of the read probe at 4096 bytes into L2 against 88-92% at 16-64 KiB; with two
/// threads it paid only where the VM's memory read 50-60 GB/s, and cost 10-20% where it read
/// 30-36, so the process's own decodes decide.
const SETTINGS: [usize; 4] = [0, CANDIDATE, CANDIDATE | INTO_L2, FAR | INTO_L2];

/// Most arms any tuner compares.
const MAX_ARMS: usize = 4;

/// Decodes of a family between the end of one tuning and the start of the next. The best
/// setting depends on how fast memory answers, and that changes while a process serves: on
/// the AMD Zen 4 VM, MXFP4 decodes in a minute when the read probe gave 56 GB/s ran 0.54 ms
/// with [`FAR`] into L2 against 0.60 with [`CANDIDATE`] into L2 (RAWINT4 0.62 against 0.87),
/// while at 31-34 GB/s no setting led in both rounds (`benches/decode_loop.py`). Retuning costs
/// the settings' runs: 4 × [`TUNE_SAMPLES`] decodes in this many, a few of them slower.
pub(crate) const RETUNE_EVERY: usize = 4096;

/// What a tuner compares, and how: its settings, the one kept unless another is 2% faster,
/// samples per setting, calls timed in a row with one setting, calls run before timing starts,
/// and calls between one decision and the next tuning.
pub(crate) struct Plan {
    pub(crate) settings: &'static [usize],
    pub(crate) default_arm: usize,
    pub(crate) samples: usize,
    pub(crate) run: usize,
    pub(crate) warmup: usize,
    pub(crate) retune_every: usize,
}

/// The decode tuner's plan (one per [`Family`]).
static DECODE_PLAN: Plan = Plan {
    settings: &SETTINGS,
    default_arm: 0,
    samples: TUNE_SAMPLES,
    run: TUNE_RUN,
    warmup: TUNE_WARMUP,
    retune_every: RETUNE_EVERY,
};

/// A tuning in the serving process: the calibration (a synthetic stream) only guesses; the
/// first [`Plan::samples`] calls with each of the plan's settings, in alternating runs, are
/// timed, and the fastest median is kept until the next tuning, every [`Plan::retune_every`]
/// calls.
struct Tune {
    plan: &'static Plan,
    /// Calls seen before timing started.
    warmup: usize,
    /// The timings of the calls run with each setting.
    samples: [Vec<f64>; MAX_ARMS],
    /// Decided until the next tuning (or for good when `fixed`).
    done: bool,
    /// The distance came from the environment: never tuned.
    fixed: bool,
}

impl Tune {
    const fn new(plan: &'static Plan) -> Tune {
        assert!(plan.settings.len() >= 2 && plan.settings.len() <= MAX_ARMS);
        assert!(plan.default_arm < plan.settings.len());
        Tune {
            plan,
            warmup: 0,
            samples: [const { Vec::new() }; MAX_ARMS],
            done: false,
            fixed: false,
        }
    }

    /// Start a new tuning after a decision (its warm-up is behind it); false when `fixed`.
    fn reopen(&mut self) -> bool {
        if self.fixed {
            return false;
        }
        self.samples.iter_mut().for_each(Vec::clear);
        self.done = false;
        true
    }

    /// The index into the plan's settings to time the next call with, or None (warming up,
    /// done).
    fn next_arm(&mut self) -> Option<usize> {
        if self.done {
            return None;
        }
        if self.warmup < self.plan.warmup {
            self.warmup += 1;
            return None;
        }
        // Runs of calls per setting, alternating: the hardware prefetchers train on what
        // runs, so a setting flipped every decode measures the mix (seen: no difference per
        // decode where runs differed by 8%).
        let taken: usize = self.samples.iter().map(Vec::len).sum();
        Some((taken / self.plan.run) % self.plan.settings.len())
    }

    /// Record a call; once every setting has its samples, the decision: the setting with the
    /// fastest median if that is 2% faster than the plan's default (the default otherwise),
    /// and the medians.
    fn record(&mut self, arm: usize, secs: f64) -> Option<(usize, Vec<f64>)> {
        let arms = self.plan.settings.len();
        if self.done || !secs.is_finite() || arm >= arms {
            return None;
        }
        self.samples[arm].push(secs);
        if self.samples[..arms]
            .iter()
            .any(|v| v.len() < self.plan.samples)
        {
            return None;
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let m: Vec<f64> = self.samples[..arms].iter_mut().map(median).collect();
        let default = self.plan.default_arm;
        let best = (0..arms)
            .filter(|&a| a != default)
            .min_by(|&a, &b| m[a].total_cmp(&m[b]))
            .unwrap_or(default);
        self.done = true;
        let chosen = if m[best] * 1.02 < m[default] {
            self.plan.settings[best]
        } else {
            self.plan.settings[default]
        };
        Some((chosen, m))
    }
}

/// One tuned setting's state: the tuning, whether it is under way (checked before locking
/// anything), and the calls since its last decision.
pub(crate) struct Tuner {
    retune_every: usize,
    tune: std::sync::Mutex<Tune>,
    tuning: std::sync::atomic::AtomicBool,
    since: AtomicUsize,
}

impl Tuner {
    pub(crate) const fn new(plan: &'static Plan) -> Tuner {
        Tuner {
            retune_every: plan.retune_every,
            tune: std::sync::Mutex::new(Tune::new(plan)),
            tuning: std::sync::atomic::AtomicBool::new(true),
            since: AtomicUsize::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tune> {
        self.tune.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stop tuning: the environment fixed the setting.
    pub(crate) fn freeze(&self) {
        self.tuning.store(false, Ordering::Relaxed);
        let mut t = self.lock();
        t.done = true;
        t.fixed = true;
    }

    /// Before a call: the setting to time it with (arm, setting), or None when it is not
    /// timed.
    pub(crate) fn begin(&self) -> Option<(usize, usize)> {
        if !self.tuning.load(Ordering::Relaxed)
            && self.since.fetch_add(1, Ordering::Relaxed) + 1 < self.retune_every
        {
            return None;
        }
        let mut t = self.lock();
        if t.done {
            // retune_every calls since the last decision: tune again (unless fixed).
            self.since.store(0, Ordering::Relaxed);
            if !t.reopen() {
                return None;
            }
            self.tuning.store(true, Ordering::Relaxed);
        }
        let arm = t.next_arm()?;
        Some((arm, t.plan.settings[arm]))
    }

    /// After that call: it took `secs`. Once every setting has its samples, the chosen
    /// setting and each setting's median (the caller applies the choice).
    pub(crate) fn end(&self, arm: usize, secs: f64) -> Option<(usize, Vec<f64>)> {
        let decided = self.lock().record(arm, secs)?;
        self.tuning.store(false, Ordering::Relaxed);
        Some(decided)
    }

    /// The settings with their medians, for a debug line.
    pub(crate) fn report(&self, medians: &[f64], unit: f64) -> String {
        let t = self.lock();
        let arms: Vec<String> = t
            .plan
            .settings
            .iter()
            .zip(medians)
            .map(|(&setting, secs)| format!("{} {:.1}", arm_name(setting), secs * unit))
            .collect();
        arms.join(", ")
    }

    /// Whether the setting is final (decided, or fixed).
    pub(crate) fn settled(&self) -> bool {
        !self.tuning.load(Ordering::Relaxed)
    }

    /// Whether a tuning has decided from samples (not the environment).
    fn decided_by_samples(&self) -> bool {
        let t = self.lock();
        t.done && t.samples.iter().any(|v| !v.is_empty())
    }
}

static TUNERS: [Tuner; FAMILIES] = [const { Tuner::new(&DECODE_PLAN) }; FAMILIES];

/// Stop tuning `family` (its distance is the one set now): the environment fixed it.
pub fn freeze(family: Family) {
    TUNERS[family as usize].freeze();
}

/// Before a decode of `family`: the setting to time it with (its distance is applied now), or
/// None when this decode is not timed.
pub fn tune_begin(family: Family) -> Option<usize> {
    let (arm, setting) = TUNERS[family as usize].begin()?;
    DISTANCE[family as usize].store(setting, Ordering::Relaxed);
    Some(arm)
}

/// After that decode: it took `secs_per_expert`. Once every setting has its samples the
/// decision stays for the next [`RETUNE_EVERY`] decodes.
pub fn tune_end(family: Family, arm: usize, secs_per_expert: f64) {
    let tuner = &TUNERS[family as usize];
    let Some((chosen, m)) = tuner.end(arm, secs_per_expert) else {
        return;
    };
    DISTANCE[family as usize].store(chosen, Ordering::Relaxed);
    if debug() {
        eprintln!(
            "[kt_kernel] prefetch tuned on {TUNE_SAMPLES} decodes each ({family:?}), µs/expert: \
             {} -> {}",
            tuner.report(&m, 1e6),
            arm_name(chosen)
        );
    }
}

/// `KT_KERNEL_DEBUG=1`: the tuners report their decisions.
pub(crate) fn debug() -> bool {
    std::env::var("KT_KERNEL_DEBUG").is_ok_and(|v| v == "1")
}

/// A setting in words: "off", or "N B into L1/L2".
pub(crate) fn arm_name(setting: usize) -> String {
    match describe(setting) {
        (0, _) => "off".to_string(),
        (bytes, l2) => format!("{bytes} B into {}", if l2 { "L2" } else { "L1" }),
    }
}

/// Set `family`'s distance unless decodes have tuned it (the tuned value stays).
pub fn set_unless_tuned(family: Family, bytes: usize) {
    if !TUNERS[family as usize].decided_by_samples() {
        set_of(family, bytes);
    }
}

/// Whether `family` is tuned (or fixed) and its distance final.
pub fn tuned(family: Family) -> bool {
    TUNERS[family as usize].settled()
}

/// `_mm_prefetch` hints: into L1, and into L2 (a streaming decode on an Emerald Rapids VM ran
/// 4–10% faster so than into L1: the L1 fill buffers stay free for the loads themselves).
#[cfg(target_arch = "x86_64")]
const INTO_L1_HINT: i32 = std::arch::x86_64::_MM_HINT_T0;
#[cfg(target_arch = "x86_64")]
const INTO_L2_HINT: i32 = std::arch::x86_64::_MM_HINT_T1;
#[cfg(not(target_arch = "x86_64"))]
const INTO_L1_HINT: i32 = 0;
#[cfg(not(target_arch = "x86_64"))]
const INTO_L2_HINT: i32 = 0;

/// Prefetch the line holding `p` with `_mm_prefetch` hint `HINT` (nothing off x86-64). Any
/// address is fine: prefetches never fault.
#[inline(always)]
fn prefetch_with<const HINT: i32>(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch has no architectural effect and does not fault on any address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<HINT>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Prefetch the line `distance` bytes after `p` (no-op when `distance` is 0). The address may
/// lie past the end of the buffer.
#[inline(always)]
pub(crate) fn ahead(p: *const u8, distance: usize) {
    if distance != 0 {
        let at = p.wrapping_add(distance & !63);
        if distance & INTO_L2 != 0 {
            prefetch_with::<INTO_L2_HINT>(at);
        } else {
            prefetch_with::<INTO_L1_HINT>(at);
        }
    }
}

/// Prefetch the line at `p` into L2 (the address may lie past the end of the buffer).
#[inline(always)]
pub(crate) fn line_into_l2(p: *const u8) {
    prefetch_with::<INTO_L2_HINT>(p);
}

/// Prefetch the line at `p` into L1 (the address may lie past the end of the buffer).
#[inline(always)]
pub(crate) fn line_into_l1(p: *const u8) {
    prefetch_with::<INTO_L1_HINT>(p);
}

thread_local! {
    /// See [`set_side_stream`].
    static SIDE_STREAM: std::cell::Cell<(usize, usize)> = const { std::cell::Cell::new((0, 0)) };
}

/// Have the next many-row bf16 panel call on this thread prefetch the `bytes` bytes at `p`
/// into L2 as it multiplies, one line per input pair: the codes of the panel a decoder reads
/// next, so its DRAM reads overlap this panel's arithmetic. `p` need not be valid memory.
pub(crate) fn set_side_stream(p: *const u8, bytes: usize) {
    SIDE_STREAM.with(|s| s.set((p as usize, bytes)));
}

/// The side stream set for this call (and none for the next).
#[inline]
pub(crate) fn take_side_stream() -> (*const u8, usize) {
    let (p, bytes) = SIDE_STREAM.with(|s| s.replace((0, 0)));
    (p as *const u8, bytes)
}

/// The fewest rows a many-row integer kernel needs to take a side stream: with fewer, its
/// own weight reads are the DRAM stream and the extra lines would compete with them.
pub(crate) const SIDE_STREAM_ROWS: usize = 4;

/// A side stream as a kernel consumes it: one line into L2 per [`SideStream::step`] until its
/// bytes are asked for, so the prefetches spread over the kernel's own loads.
pub(crate) struct SideStream {
    next: *const u8,
    left: usize,
}

impl SideStream {
    /// The side stream set for this call ([`take_side_stream`]); none when `take` is false
    /// (kernels with too few rows to hide the extra reads).
    #[inline(always)]
    pub(crate) fn take_if(take: bool) -> SideStream {
        let (next, left) = if take {
            take_side_stream()
        } else {
            (std::ptr::null(), 0)
        };
        SideStream { next, left }
    }

    /// Whether the caller set a stream: it does so only on blocks whose own weights are in
    /// cache already.
    #[inline(always)]
    pub(crate) fn is_set(&self) -> bool {
        !self.next.is_null()
    }

    /// Ask for the stream's next line, if any is left.
    #[inline(always)]
    pub(crate) fn step(&mut self) {
        if self.left > 0 {
            line_into_l2(self.next);
            self.next = self.next.wrapping_add(64);
            self.left = self.left.saturating_sub(64);
        }
    }
}

/// Prefetch every line of the `bytes` bytes at `p` (for data about to be read and written
/// at scattered places, which the hardware prefetchers cannot predict).
#[inline(always)]
pub(crate) fn lines(p: *const u8, bytes: usize) {
    for off in (0..bytes).step_by(64) {
        prefetch_with::<INTO_L1_HINT>(p.wrapping_add(off));
    }
}

/// Prefetch into L2 the lines of slice `i` of `n` of the `bytes` bytes at `p` (spread over `n`
/// steps of work, so that no step asks for more lines than the core can have in flight).
#[inline]
pub(crate) fn slice_into_l2(p: *const u8, bytes: usize, i: usize, n: usize) {
    let (lo, hi) = (bytes * i / n, bytes * (i + 1) / n);
    for off in (lo & !63..hi).step_by(64) {
        line_into_l2(p.wrapping_add(off));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_side_stream_serves_one_call_of_its_thread() {
        let bytes = [0u8; 4];
        set_side_stream(bytes.as_ptr(), 4096);
        std::thread::spawn(|| assert_eq!(take_side_stream().1, 0))
            .join()
            .unwrap();
        assert_eq!(take_side_stream(), (bytes.as_ptr(), 4096));
        assert_eq!(take_side_stream(), (std::ptr::null(), 0));
    }

    #[test]
    fn panel_kernels_of_four_rows_and_more_take_the_panel_setting() {
        if std::env::var("KT_KERNEL_PANEL_PREFETCH").is_err() {
            assert_eq!(panel_distance(), PANEL_DEFAULT);
            assert_eq!(describe(PANEL_DEFAULT), (8192, true));
        }
        assert_eq!(for_panel_rows(4), panel_distance());
        assert_eq!(for_panel_rows(12), panel_distance());
        for rows in 1..4 {
            assert_eq!(for_panel_rows(rows), distance());
        }
    }

    /// Drive a tuner with per-decode times `time(arm)` until it decides.
    fn decide(time: impl Fn(usize) -> f64) -> (usize, usize) {
        decide_with(&mut Tune::new(&DECODE_PLAN), time)
    }

    fn decide_with(t: &mut Tune, time: impl Fn(usize) -> f64) -> (usize, usize) {
        let (mut decodes, mut runs, mut last) = (0, 0, None);
        loop {
            decodes += 1;
            let Some(arm) = t.next_arm() else {
                assert!(decodes <= t.plan.warmup, "no arm after the warm-up");
                continue;
            };
            if last != Some(arm) {
                (last, runs) = (Some(arm), runs + 1);
            }
            if let Some((chosen, ..)) = t.record(arm, time(arm)) {
                assert!(t.next_arm().is_none(), "decided until reopened");
                return (chosen, runs);
            }
        }
    }

    #[test]
    fn the_tuner_keeps_the_faster_setting_and_times_runs_of_each() {
        // The fastest setting if 2% faster than off; otherwise off.
        assert_eq!(decide(|arm| [1.0, 0.9, 0.95, 0.93][arm]).0, CANDIDATE);
        assert_eq!(
            decide(|arm| [1.0, 0.95, 0.9, 0.93][arm]).0,
            CANDIDATE | INTO_L2
        );
        assert_eq!(decide(|arm| [1.0, 0.95, 0.93, 0.9][arm]).0, FAR | INTO_L2);
        assert_eq!(decide(|arm| [1.0, 1.1, 1.2, 1.05][arm]).0, 0);
        assert_eq!(decide(|arm| [1.0, 0.99, 0.995, 0.985][arm]).0, 0);
        assert_eq!(arm_name(FAR | INTO_L2), "16384 B into L2");
        assert_eq!(arm_name(0), "off");
        assert_eq!(describe(CANDIDATE | INTO_L2), (CANDIDATE, true));
        // Alternating runs of TUNE_RUN, not single decodes.
        assert_eq!(decide(|_| 1.0).1, SETTINGS.len() * TUNE_SAMPLES / TUNE_RUN);
        // A non-finite time is ignored.
        let mut t = Tune::new(&DECODE_PLAN);
        while t.next_arm().is_none() {}
        assert!(t.record(0, f64::NAN).is_none() && t.samples[0].is_empty());
    }

    #[test]
    fn the_prefill_tuner_keeps_the_amx_distance_only_where_it_pays() {
        use crate::kernels::amx::{self, amx_stream_of, AmxStream, PREFILL_PLANS};
        for (plan, near) in PREFILL_PLANS
            .iter()
            .zip([amx::PREFETCH_BYTES, amx::INT4_PREFETCH_BYTES])
        {
            let prefill = |time: [f64; 3]| decide_with(&mut Tune::new(plan), |a| time[a]);
            let (near, far) = (near | INTO_L2, amx::FAR_PREFETCH_BYTES | INTO_L2);
            assert_eq!(prefill([1.0, 0.9, 0.95]).0, near);
            assert_eq!(prefill([0.9, 1.0, 1.0]).0, 0);
            assert_eq!(prefill([1.0, 1.0, 0.9]).0, far);
            assert_eq!(
                prefill([0.99, 1.0, 0.995]).0,
                near,
                "another only if 2% faster"
            );
            assert_eq!(prefill([1.0, 0.99, 1.0]).0, near);
            // Runs of two calls, alternating, until each setting has its samples.
            assert_eq!(prefill([1.0, 1.0, 1.0]).1, 3 * plan.samples / plan.run);
            // A timing of an arm the plan does not have is ignored.
            let mut t = Tune::new(plan);
            while t.next_arm().is_none() {}
            assert!(t.record(3, 1.0).is_none() && t.samples.iter().all(Vec::is_empty));
        }
        use crate::method::Method as M;
        assert_eq!(amx_stream_of(M::AmxInt8), Some(AmxStream::Tiles));
        assert_eq!(amx_stream_of(M::Bf16), Some(AmxStream::Tiles));
        assert_eq!(amx_stream_of(M::AmxInt4), Some(AmxStream::Int4));
        assert_eq!(
            amx_stream_of(M::Fp8),
            None,
            "FP8 tiles read panels it just decoded"
        );
    }

    #[test]
    fn a_reopened_tuner_decides_again_without_a_warm_up_unless_fixed() {
        let mut t = Tune::new(&DECODE_PLAN);
        assert_eq!(
            decide_with(&mut t, |arm| [1.0, 0.95, 0.9, 0.93][arm]).0,
            CANDIDATE | INTO_L2
        );
        // The machine's memory got faster: the far arm wins the next tuning.
        assert!(t.reopen());
        assert_eq!(
            t.next_arm(),
            Some(0),
            "timing starts at once, with every arm's samples new"
        );
        assert_eq!(
            decide_with(&mut t, |arm| [1.0, 0.9, 0.95, 0.8][arm]).0,
            FAR | INTO_L2
        );
        // A distance from the environment is never retuned.
        let mut fixed = Tune::new(&DECODE_PLAN);
        (fixed.done, fixed.fixed) = (true, true);
        assert!(!fixed.reopen() && fixed.next_arm().is_none());
        const {
            assert!(
                RETUNE_EVERY > 10 * SETTINGS.len() * TUNE_SAMPLES,
                "retuning stays a small share"
            )
        };
    }
}
