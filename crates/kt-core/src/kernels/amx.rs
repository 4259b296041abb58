//! AMX tile kernels (C++ in `cpp_kernels/`, one tile program per format) and their software
//! emulator.
//!
//! The same C++ tile program runs on two backends: the real instructions (`amx_hw.cpp`, used
//! only at [`Level::Amx`](crate::isa::Level::Amx), i.e. when CPUID, XCR0 and Linux's permission
//! all agree) and a software emulator of the tile unit (`amx_emu.cpp`). The emulator is how the
//! layout and tile loop are proven on machines without AMX: tests compare it with the scalar
//! twins below, bit for bit. `KT_KERNEL_AMX_EMULATE=1` makes whole layers use the emulated
//! kernels (slow; for tests).
//!
//! Each call handles up to [`ROWS`] token rows (two 16-row tiles) against one 32-output group,
//! with the contracts of [`GroupDotFn`](super::group_dot::GroupDotFn) and
//! [`PanelDotBf16Fn`](super::PanelDotBf16Fn); bf16 additionally needs `k % 32 == 0`.

use super::prefetch;
use std::ffi::c_void;

/// Token rows per call (two tile row blocks).
pub const ROWS: usize = 32;

/// Inputs per bf16 tile step: `k` must be a multiple of this for [`panel_dot_bf16`].
pub const BF16_K_STEP: usize = 32;

extern "C" {
    fn kt_amx_emu_int8_dot(
        a: *const *const u8,
        m: usize,
        k: usize,
        group: *const u8,
        sums: *const i32,
        out: *mut i32,
    ) -> i32;
    fn kt_amx_emu_int4_dot(
        a: *const *const u8,
        m: usize,
        k: usize,
        group: *const u8,
        sums: *const i32,
        out: *mut i32,
    ) -> i32;
    fn kt_amx_emu_bf16_dot(
        a: *const *const u32,
        m: usize,
        k: usize,
        panel: *const u16,
        out: *mut f32,
    ) -> i32;
    fn kt_amx_emu_bf16_dot_packed(
        packed: *const u8,
        step_bytes: usize,
        m: usize,
        k: usize,
        panel: *const u16,
        out: *mut f32,
    ) -> i32;
    fn kt_amx_emu_bf16_dot_cached(
        a: *const *const u32,
        m: usize,
        k: usize,
        panel: *const u16,
        out: *mut f32,
    ) -> i32;
    fn kt_amx_emu_bf16_dot_packed_cached(
        packed: *const u8,
        step_bytes: usize,
        m: usize,
        k: usize,
        panel: *const u16,
        out: *mut f32,
    ) -> i32;
    fn kt_amx_emu_bf16_dot_packed_decoding(
        packed: *const u8,
        step_bytes: usize,
        m: usize,
        k: usize,
        block: usize,
        panel: *const u16,
        decode: DecodeBlockFn,
        ctx: *mut c_void,
        out: *mut f32,
    ) -> i32;
    fn kt_amx_emu_int8_dot_packed(
        packed: *const u8,
        step_bytes: usize,
        m: usize,
        k: usize,
        group: *const u8,
        sums: *const i32,
        out: *mut i32,
    ) -> i32;
    fn kt_amx_emu_int4_dot_packed(
        packed: *const u8,
        step_bytes: usize,
        m: usize,
        k: usize,
        group: *const u8,
        sums: *const i32,
        out: *mut i32,
    ) -> i32;
    fn kt_amx_emu_self_test() -> i32;
}

#[cfg(kt_amx_hw)]
extern "C" {
    fn kt_amx_int8_dot(
        a: *const *const u8,
        m: usize,
        k: usize,
        group: *const u8,
        sums: *const i32,
        out: *mut i32,
    );
    fn kt_amx_int4_dot(
        a: *const *const u8,
        m: usize,
        k: usize,
        group: *const u8,
        sums: *const i32,
        out: *mut i32,
    );
    fn kt_amx_bf16_dot(a: *const *const u32, m: usize, k: usize, panel: *const u16, out: *mut f32);
    fn kt_amx_bf16_dot_packed(
        packed: *const u8,
        step_bytes: usize,
        m: usize,
        k: usize,
        panel: *const u16,
        out: *mut f32,
    );
    fn kt_amx_bf16_dot_cached(
        a: *const *const u32,
        m: usize,
        k: usize,
        panel: *const u16,
        out: *mut f32,
    );
    fn kt_amx_bf16_dot_packed_cached(
        packed: *const u8,
        step_bytes: usize,
        m: usize,
        k: usize,
        panel: *const u16,
        out: *mut f32,
    );
    fn kt_amx_bf16_dot_packed_decoding(
        packed: *const u8,
        step_bytes: usize,
        m: usize,
        k: usize,
        block: usize,
        panel: *const u16,
        decode: DecodeBlockFn,
        ctx: *mut c_void,
        out: *mut f32,
    );
    fn kt_amx_int8_dot_packed(
        packed: *const u8,
        step_bytes: usize,
        m: usize,
        k: usize,
        group: *const u8,
        sums: *const i32,
        out: *mut i32,
    );
    fn kt_amx_int4_dot_packed(
        packed: *const u8,
        step_bytes: usize,
        m: usize,
        k: usize,
        group: *const u8,
        sums: *const i32,
        out: *mut i32,
    );
    fn kt_amx_set_prefetch(stream: usize, bytes: usize);
    fn kt_amx_peak_int8(iters: u64) -> u64;
    fn kt_amx_peak_bf16(iters: u64) -> u64;
}

/// `iters` rounds of four independent `tdpbusd` on full tiles (the tile unit's int8 peak);
/// returns the operations done (2 per multiply-add). 0 in builds without the hardware kernels.
///
/// # Safety
/// AMX usable by this process (the amx level).
pub unsafe fn peak_int8_loop(iters: u64) -> u64 {
    #[cfg(kt_amx_hw)]
    // SAFETY: the caller's contract; the C++ side uses only its own tiles and constants.
    return unsafe { kt_amx_peak_int8(iters) };
    #[cfg(not(kt_amx_hw))]
    {
        let _ = iters;
        0
    }
}

/// As [`peak_int8_loop`] with `tdpbf16ps` (the tile unit's bf16 peak).
///
/// # Safety
/// AMX usable by this process (the amx level).
pub unsafe fn peak_bf16_loop(iters: u64) -> u64 {
    #[cfg(kt_amx_hw)]
    // SAFETY: as peak_int8_loop.
    return unsafe { kt_amx_peak_bf16(iters) };
    #[cfg(not(kt_amx_hw))]
    {
        let _ = iters;
        0
    }
}

/// How far ahead the tile programs whose tile loads read the weights prefetch them until
/// tuned: half a K step (a step loads 2 KiB of weights: the two 1 KiB halves), so each step
/// asks for its own second half and the next step's first. Intel Emerald Rapids VM, 2 threads,
/// read probe 31 GB/s (`amx_stream`, K 2048 / K 768, 32 rows): 512 B 31.2 / 25.4 GB/s, 1 KiB
/// 32.3 / 26.8, 1.5 KiB 26.6 / 22.7, 2 KiB 25.2 / 22.1, 8 KiB 24.0 / 21.4, off 21.7 / 20.7;
/// the AMXINT8 layer at 512 tokens (`prefill`, processes alternated) 36.4-36.6 ms against
/// 37.5-39.0 at 768 B, 2 KiB and 8 KiB.
pub const PREFETCH_BYTES: usize = 1024;

/// The same for AMXINT4, whose vector unpacking reads the weights (2 KiB of nibbles per two
/// K steps). Same VM (`amx_stream INT4=1`, K 2048 / K 768): 3 KiB 19.2 / 16.6 GB/s, 4 KiB
/// 22.6 / 15.6, 6 KiB 17.7 / 15.6, 8 KiB 16.4 / 13.8, off 19.4 / 14.4, 1-2 KiB 16-17 / 13-14;
/// the layer at 512 tokens 31.4 ms against 32.3-32.5 at 8 KiB and 32.8-33.5 off.
pub const INT4_PREFETCH_BYTES: usize = 4096;

/// The farther distance each stream's tuner also tries: the one these programs used before
/// the shorter ones were measured, and the better one on some VMs (BF16 9-16% faster than
/// off on an Emerald Rapids VM of 2026-11-20).
pub const FAR_PREFETCH_BYTES: usize = 8192;

/// What [`set_prefetch_bytes`] set last, per stream (the C++ side keeps its own copy).
static PREFETCH: [std::sync::atomic::AtomicUsize; AMX_STREAMS] = [
    std::sync::atomic::AtomicUsize::new(PREFETCH_BYTES),
    std::sync::atomic::AtomicUsize::new(INT4_PREFETCH_BYTES),
];

/// How far ahead of the tile being loaded the hardware tile programs of `stream` prefetch
/// weights into L2 (0: off), process-wide. A tile load that misses the caches stalls the
/// in-order tile unit for the whole DRAM latency; the prefetches overlap it with the tiles
/// before, but they also take fill buffers the tile loads need, so whether they pay is tuned
/// ([`amx_tune_begin`]).
pub fn set_prefetch_bytes(stream: AmxStream, bytes: usize) {
    PREFETCH[stream as usize].store(bytes, std::sync::atomic::Ordering::Relaxed);
    #[cfg(kt_amx_hw)]
    // SAFETY: stores one integer the tile programs read.
    unsafe {
        kt_amx_set_prefetch(stream as usize, bytes)
    };
}

/// The distance `stream`'s tile programs prefetch at now (0: off).
pub fn prefetch_bytes(stream: AmxStream) -> usize {
    PREFETCH[stream as usize].load(std::sync::atomic::Ordering::Relaxed)
}

/// The AMX tile programs whose weight prefetch is tuned apart: the ones whose tile loads read
/// the weights (AMXINT8 groups, BF16 panels) and AMXINT4's, whose vector unpacking reads them.
/// On an Intel Emerald Rapids VM (S1, 512 tokens, `prefill`, processes alternated) prefetching
/// 8 KiB ahead made the first 10-14% slower for half an hour (AMXINT8 46.4-48.2 ms off against
/// 51.9-53.5, BF16 76.1-79.4 against 82.8-87.7) and AMXINT4 6-7% faster (36.4-37.0 against
/// 38.7-39.7); in the next hour the first prefills of a process found it 7-10% faster for
/// AMXINT8 and BF16; on a VM of that kind five days earlier BF16 ran 9-16% slower without it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AmxStream {
    /// Tile loads straight from the weights.
    Tiles = 0,
    /// AMXINT4's nibbles, unpacked by vector loads.
    Int4 = 1,
}

/// AMX tile programs tuned apart.
pub const AMX_STREAMS: usize = 2;

/// The settings each stream's tuner compares: off, its default distance, and
/// [`FAR_PREFETCH_BYTES`], all into L2 (the tile programs always prefetch into L2; the flag
/// names it so).
const TILES_SETTINGS: [usize; 3] = [
    0,
    PREFETCH_BYTES | prefetch::INTO_L2,
    FAR_PREFETCH_BYTES | prefetch::INTO_L2,
];
const INT4_SETTINGS: [usize; 3] = [
    0,
    INT4_PREFETCH_BYTES | prefetch::INTO_L2,
    FAR_PREFETCH_BYTES | prefetch::INTO_L2,
];

/// The prefill tuners' plans: a prefill call is long (tens of ms at 512 tokens), so fewer
/// samples and short runs; a model's forward calls every layer with the same tokens, so runs
/// of two calls compare like with like. The default distance stays unless another setting is
/// 2% faster: on the Emerald Rapids VM the winner changed within the hour (AMXINT8 at 512
/// tokens, in-process medians: off 10% faster in one phase, prefetching 7% faster in the
/// next).
const fn prefill_plan(settings: &'static [usize]) -> prefetch::Plan {
    prefetch::Plan {
        settings,
        default_arm: 1,
        samples: 12,
        run: 2,
        warmup: 4,
        retune_every: prefetch::RETUNE_EVERY,
    }
}

/// Per [`AmxStream`], in its order.
pub(crate) static PREFILL_PLANS: [prefetch::Plan; AMX_STREAMS] =
    [prefill_plan(&TILES_SETTINGS), prefill_plan(&INT4_SETTINGS)];

static AMX_TUNERS: [prefetch::Tuner; AMX_STREAMS] = [
    prefetch::Tuner::new(&PREFILL_PLANS[0]),
    prefetch::Tuner::new(&PREFILL_PLANS[1]),
];

/// The stream a method's AMX prefill reads its weights with, if it streams them into tiles
/// (the formats that decode panels first read them with their own kernels).
pub fn amx_stream_of(method: crate::method::Method) -> Option<AmxStream> {
    use crate::method::Method as M;
    match method {
        M::AmxInt8 | M::Bf16 => Some(AmxStream::Tiles),
        M::AmxInt4 => Some(AmxStream::Int4),
        _ => None,
    }
}

/// Fix every AMX stream's distance (`KT_KERNEL_AMX_PREFETCH` was set): never tuned.
pub fn freeze_amx(bytes: usize) {
    for stream in [AmxStream::Tiles, AmxStream::Int4] {
        set_prefetch_bytes(stream, bytes);
        AMX_TUNERS[stream as usize].freeze();
    }
}

/// Whether `stream`'s distance is final (tuned on prefills, or fixed).
pub fn amx_tuned(stream: AmxStream) -> bool {
    AMX_TUNERS[stream as usize].settled()
}

/// Before a prefill of a method on `stream`: the arm to time it with (its distance is applied
/// now), or None when this call is not timed.
pub fn amx_tune_begin(stream: AmxStream) -> Option<usize> {
    let (arm, setting) = AMX_TUNERS[stream as usize].begin()?;
    set_prefetch_bytes(stream, prefetch::describe(setting).0);
    Some(arm)
}

/// After that prefill: it took `secs_per_expert`.
pub fn amx_tune_end(stream: AmxStream, arm: usize, secs_per_expert: f64) {
    let tuner = &AMX_TUNERS[stream as usize];
    let Some((chosen, m)) = tuner.end(arm, secs_per_expert) else {
        return;
    };
    set_prefetch_bytes(stream, prefetch::describe(chosen).0);
    if prefetch::debug() {
        eprintln!(
            "[kt_kernel] AMX weight prefetch tuned on {} prefills each ({stream:?}), \
             µs/expert: {} -> {}",
            PREFILL_PLANS[stream as usize].samples,
            tuner.report(&m, 1e6),
            prefetch::arm_name(chosen)
        );
    }
}

/// Whether this build contains the hardware AMX kernels (the compiler knew `-mamx-*`).
pub const HARDWARE_BUILT: bool = cfg!(kt_amx_hw);

fn check_rows(n: usize) {
    assert!(
        (1..=ROWS).contains(&n),
        "AMX kernels take 1..={ROWS} rows, got {n}"
    );
}

/// Hardware AMXINT8 group kernel.
///
/// # Safety
/// AMX usable by this process (tile data permission granted); the
/// [`GroupDotFn`](super::group_dot::GroupDotFn) contract with up to [`ROWS`] rows.
#[cfg(kt_amx_hw)]
pub unsafe fn dot_int8(a: &[*const u8], k: usize, g: *const u8, s: *const i32, o: *mut i32) {
    check_rows(a.len());
    // SAFETY: forwarded contract; the C++ side reads a.len() row pointers.
    unsafe { kt_amx_int8_dot(a.as_ptr(), a.len(), k, g, s, o) }
}

/// Hardware AMXINT4 group kernel (`k % 128 == 0`).
///
/// # Safety
/// As [`dot_int8`] for an AMXINT4 group.
#[cfg(kt_amx_hw)]
pub unsafe fn dot_int4(a: &[*const u8], k: usize, g: *const u8, s: *const i32, o: *mut i32) {
    check_rows(a.len());
    // SAFETY: forwarded contract.
    unsafe { kt_amx_int4_dot(a.as_ptr(), a.len(), k, g, s, o) }
}

/// A bf16 panel kernel over one C++ entry point: the row and shape checks, then the call
/// (`$done` sees what the entry point returned: the emulator's fault code).
macro_rules! bf16_rows_kernel {
    ($(#[$doc:meta])* $name:ident, $ffi:ident, $done:expr) => {
        $(#[$doc])*
        pub unsafe fn $name(a: &[*const u32], k: usize, panel: *const u16, out: *mut f32) {
            check_rows(a.len());
            assert_eq!(k % BF16_K_STEP, 0, "AMX bf16 needs k % 32 == 0");
            // SAFETY: forwarded contract.
            let done = unsafe { $ffi(a.as_ptr(), a.len(), k, panel, out) };
            $done(done)
        }
    };
}

/// The same for the kernels on packed rows.
macro_rules! bf16_packed_kernel {
    ($(#[$doc:meta])* $name:ident, $ffi:ident, $done:expr) => {
        $(#[$doc])*
        pub unsafe fn $name(
            packed: *const u8,
            step_bytes: usize,
            m: usize,
            k: usize,
            panel: *const u16,
            out: *mut f32,
        ) {
            check_packed(step_bytes, m, k, BF16_K_STEP);
            // SAFETY: forwarded contract.
            let done = unsafe { $ffi(packed, step_bytes, m, k, panel, out) };
            $done(done)
        }
    };
}

#[cfg(kt_amx_hw)]
bf16_rows_kernel!(
    /// Hardware bf16 panel kernel (`tdpbf16ps`, `k % 32 == 0`).
    ///
    /// # Safety
    /// AMX usable by this process; the [`PanelDotBf16Fn`](super::PanelDotBf16Fn) contract
    /// with up to [`ROWS`] rows.
    panel_dot_bf16,
    kt_amx_bf16_dot,
    |()| ()
);

#[cfg(kt_amx_hw)]
bf16_packed_kernel!(
    /// Hardware bf16 panel kernel on packed rows ([`PackedRows`]).
    ///
    /// # Safety
    /// AMX usable by this process; the [`PackedDotBf16Fn`](super::PackedDotBf16Fn) contract.
    panel_dot_bf16_packed,
    kt_amx_bf16_dot_packed,
    |()| ()
);

#[cfg(kt_amx_hw)]
bf16_rows_kernel!(
    /// [`panel_dot_bf16`] for a panel already in cache (just decoded): no weight prefetch.
    ///
    /// # Safety
    /// As [`panel_dot_bf16`].
    panel_dot_bf16_cached,
    kt_amx_bf16_dot_cached,
    |()| ()
);

#[cfg(kt_amx_hw)]
bf16_packed_kernel!(
    /// [`panel_dot_bf16_packed`] for a panel already in cache (just decoded): no weight
    /// prefetch.
    ///
    /// # Safety
    /// As [`panel_dot_bf16_packed`].
    panel_dot_bf16_packed_cached,
    kt_amx_bf16_dot_packed_cached,
    |()| ()
);

/// The C++ side's `DecodeBlockFn`: `decode(ctx, b)`.
type DecodeBlockFn = unsafe extern "C" fn(ctx: *mut c_void, b: usize);

/// What a decoding tile program hands back to [`decode_block_trampoline`]: the decoder, and a
/// panic it raised (kept until the program returns: unwinding through C++ frames is not
/// allowed).
struct DecodeContext<'a> {
    decode: &'a mut dyn FnMut(usize),
    panic: Option<Box<dyn std::any::Any + Send>>,
}

/// Calls the decoder for block `b` (none after one has panicked).
unsafe extern "C" fn decode_block_trampoline(ctx: *mut c_void, b: usize) {
    // SAFETY: `ctx` is the DecodeContext that `with_decoder` passed, alive for the whole call.
    let ctx = unsafe { &mut *ctx.cast::<DecodeContext<'_>>() };
    if ctx.panic.is_none() {
        let decode = &mut ctx.decode;
        if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| decode(b))) {
            ctx.panic = Some(p);
        }
    }
}

/// Runs `program` with a C callback and context that call `decode`; a panic of the decoder is
/// raised again once the program has returned. Checks the decoding kernels' shape contract.
fn with_decoder<R>(
    k: usize,
    block: usize,
    decode: &mut dyn FnMut(usize),
    program: impl FnOnce(DecodeBlockFn, *mut c_void) -> R,
) -> R {
    assert!(
        block > 0 && block.is_multiple_of(BF16_K_STEP) && k.is_multiple_of(block),
        "decoding blocks of {block} inputs do not tile {k} inputs in steps of {BF16_K_STEP}"
    );
    let mut ctx = DecodeContext {
        decode,
        panic: None,
    };
    let result = program(
        decode_block_trampoline,
        (&mut ctx as *mut DecodeContext<'_>).cast(),
    );
    if let Some(p) = ctx.panic {
        std::panic::resume_unwind(p);
    }
    result
}

/// [`panel_dot_bf16_packed_cached`] over a panel that `decode` writes block by block as the
/// tiles go ([`PackedDecodingBf16Fn`](super::PackedDecodingBf16Fn)).
///
/// # Safety
/// AMX usable by this process; the [`PackedDecodingBf16Fn`](super::PackedDecodingBf16Fn)
/// contract.
#[cfg(kt_amx_hw)]
#[allow(clippy::too_many_arguments)] // the packed kernel's arguments plus the decoder's
pub unsafe fn panel_dot_bf16_packed_decoding(
    packed: *const u8,
    step_bytes: usize,
    m: usize,
    k: usize,
    block: usize,
    panel: *mut u16,
    decode: &mut dyn FnMut(usize),
    out: *mut f32,
) {
    check_packed(step_bytes, m, k, BF16_K_STEP);
    with_decoder(k, block, decode, |callback, ctx| {
        // SAFETY: forwarded contract; the callback and context live through the call.
        unsafe {
            kt_amx_bf16_dot_packed_decoding(
                packed, step_bytes, m, k, block, panel, callback, ctx, out,
            )
        }
    })
}

/// A [`PackedGroupDotFn`](super::group_dot::PackedGroupDotFn) over one C++ entry point: the
/// shape checks (`k` a multiple of `$unit`), then the call; `$done` sees what it returned (the
/// emulator's fault code).
macro_rules! packed_group_kernel {
    ($(#[$doc:meta])* $name:ident, $ffi:ident, $unit:expr, $done:expr) => {
        $(#[$doc])*
        pub unsafe fn $name(
            packed: *const u8,
            step: usize,
            m: usize,
            k: usize,
            g: *const u8,
            s: *const i32,
            o: *mut i32,
        ) {
            check_packed(step, m, k, $unit);
            // SAFETY: forwarded contract.
            let returned = unsafe { $ffi(packed, step, m, k, g, s, o) };
            $done(returned);
        }
    };
}

#[cfg(kt_amx_hw)]
packed_group_kernel!(
    /// Hardware AMXINT8 group kernel on packed rows ([`PackedRows`]).
    ///
    /// # Safety
    /// AMX usable by this process; the
    /// [`PackedGroupDotFn`](super::group_dot::PackedGroupDotFn) contract.
    dot_int8_packed,
    kt_amx_int8_dot_packed,
    64,
    |()| ()
);

#[cfg(kt_amx_hw)]
packed_group_kernel!(
    /// Hardware AMXINT4 group kernel on packed rows (`k % 128 == 0`).
    ///
    /// # Safety
    /// As [`dot_int8_packed`] for an AMXINT4 group.
    dot_int4_packed,
    kt_amx_int4_dot_packed,
    128,
    |()| ()
);

/// The shape checks of every packed kernel: rows, step size, and `k` a multiple of `unit`.
fn check_packed(step_bytes: usize, m: usize, k: usize, unit: usize) {
    check_rows(m);
    assert!(
        step_bytes >= 64 * m && k.is_multiple_of(unit),
        "packed rows: {m} rows in steps of {step_bytes} bytes, k = {k} (a multiple of {unit})"
    );
}

/// Activation rows packed for the tile loads: for each 64-byte column block ("step") of the
/// rows, the `m` rows' 64 bytes back to back, so a 16-row tile is 1 KiB of adjacent lines.
/// Gathering scattered rows costs as much as the tiles' work on one panel, so a thread keeps
/// its last few packings for the expert's next panels ([`with_packed_rows`],
/// [`super::row_cache`]).
/// Bytes per step of `m` packed rows: one 16-row tile, or two.
pub fn packed_step_bytes(m: usize) -> usize {
    if m > 16 {
        2048
    } else {
        1024
    }
}

/// Pack `rows` (each `steps · 64` bytes) into `dst` ([`PackedRows`]' layout); returns the step
/// size in bytes.
///
/// # Safety
/// Each row pointer is readable for `steps · 64` bytes; `1 ≤ rows.len() ≤ 32`.
pub unsafe fn pack_rows(rows: &[*const u8], steps: usize, dst: &mut [u8]) -> usize {
    check_rows(rows.len());
    let step = packed_step_bytes(rows.len());
    assert!(dst.len() >= steps * step);
    // The rows are scattered token rows, often out of L2: two rows ahead are asked for while
    // one is copied (the hardware prefetchers see only short streams).
    for &row in rows.iter().take(2) {
        super::prefetch::lines(row, steps * 64);
    }
    for (r, &row) in rows.iter().enumerate() {
        if let Some(&next) = rows.get(r + 2) {
            super::prefetch::lines(next, steps * 64);
        }
        for s in 0..steps {
            // SAFETY: 64 bytes of block s of row r (the contract) into its slot, in bounds.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    row.add(s * 64),
                    dst.as_mut_ptr().add(s * step + r * 64),
                    64,
                )
            };
        }
    }
    step
}

/// Run `f(packed, step_bytes)` on `rows` (each `steps · 64` bytes) packed by this thread,
/// reusing one of its last packings when `reuse` and the row addresses are the same as then
/// ([`super::row_cache::with_packing`]).
///
/// # Safety
/// As [`pack_rows`]; and the caller promises that the bytes behind the same row addresses do
/// not change while a `reuse` key is in use (each key names one state of the rows).
pub unsafe fn with_packed_rows<R>(
    reuse: u64,
    rows: &[*const u8],
    steps: usize,
    f: impl FnOnce(*const u8, usize) -> R,
) -> R {
    check_rows(rows.len());
    let step = packed_step_bytes(rows.len());
    /// The layout tag of these packings (see [`super::row_cache::PackingKey`]).
    const AMX_STEPS: u64 = 1;
    let key = super::row_cache::PackingKey::new(reuse, [AMX_STEPS, steps as u64, 0], rows);
    super::row_cache::with_packing(
        key,
        steps * step,
        // SAFETY: forwarded; the buffer holds `steps · step` bytes.
        |dst| unsafe {
            pack_rows(rows, steps, dst);
        },
        |packed| f(packed.as_ptr(), step),
    )
}

/// What the emulator reported: the fault the hardware would have raised.
fn emulator_fault(code: i32) -> &'static str {
    match code {
        1 => "invalid tile configuration (#GP)",
        2 => "tile instruction before ldtilecfg (#UD)",
        3 => "use of an unconfigured tile (#UD)",
        4 => "tile shapes do not match (#UD)",
        _ => "unknown fault",
    }
}

fn check_emulated(code: i32, what: &str) {
    assert!(code == 0, "AMX emulator, {what}: {}", emulator_fault(code));
}

/// The emulated kernels: same tile programs, software tile unit. Any fault the hardware would
/// raise panics with its description.
pub mod emulated {
    use super::*;

    /// Emulated [`dot_int8`](super::dot_int8).
    ///
    /// # Safety
    /// The [`GroupDotFn`](crate::kernels::group_dot::GroupDotFn) contract with up to [`ROWS`] rows.
    pub unsafe fn dot_int8(a: &[*const u8], k: usize, g: *const u8, s: *const i32, o: *mut i32) {
        check_rows(a.len());
        // SAFETY: forwarded contract.
        let code = unsafe { kt_amx_emu_int8_dot(a.as_ptr(), a.len(), k, g, s, o) };
        check_emulated(code, "int8 group");
    }

    /// Emulated [`dot_int4`](super::dot_int4).
    ///
    /// # Safety
    /// As [`dot_int8`] for an AMXINT4 group.
    pub unsafe fn dot_int4(a: &[*const u8], k: usize, g: *const u8, s: *const i32, o: *mut i32) {
        check_rows(a.len());
        // SAFETY: forwarded contract.
        let code = unsafe { kt_amx_emu_int4_dot(a.as_ptr(), a.len(), k, g, s, o) };
        check_emulated(code, "int4 group");
    }

    bf16_rows_kernel!(
        /// Emulated [`panel_dot_bf16`](super::panel_dot_bf16).
        ///
        /// # Safety
        /// The [`PanelDotBf16Fn`](crate::kernels::PanelDotBf16Fn) contract with up to
        /// [`ROWS`] rows and `k % 32 == 0`.
        panel_dot_bf16,
        kt_amx_emu_bf16_dot,
        |code| check_emulated(code, "bf16 panel")
    );

    bf16_packed_kernel!(
        /// Emulated [`panel_dot_bf16_packed`](super::panel_dot_bf16_packed).
        ///
        /// # Safety
        /// The [`PackedDotBf16Fn`](crate::kernels::PackedDotBf16Fn) contract.
        panel_dot_bf16_packed,
        kt_amx_emu_bf16_dot_packed,
        |code| check_emulated(code, "bf16 panel, packed rows")
    );

    bf16_rows_kernel!(
        /// Emulated [`panel_dot_bf16_cached`](super::panel_dot_bf16_cached).
        ///
        /// # Safety
        /// As [`panel_dot_bf16`].
        panel_dot_bf16_cached,
        kt_amx_emu_bf16_dot_cached,
        |code| check_emulated(code, "bf16 panel, cached")
    );

    bf16_packed_kernel!(
        /// Emulated [`panel_dot_bf16_packed_cached`](super::panel_dot_bf16_packed_cached).
        ///
        /// # Safety
        /// As [`panel_dot_bf16_packed`].
        panel_dot_bf16_packed_cached,
        kt_amx_emu_bf16_dot_packed_cached,
        |code| check_emulated(code, "bf16 panel, packed rows, cached")
    );

    /// Emulated [`panel_dot_bf16_packed_decoding`](super::panel_dot_bf16_packed_decoding).
    ///
    /// # Safety
    /// The [`PackedDecodingBf16Fn`](crate::kernels::PackedDecodingBf16Fn) contract.
    #[allow(clippy::too_many_arguments)] // as the hardware kernel
    pub unsafe fn panel_dot_bf16_packed_decoding(
        packed: *const u8,
        step_bytes: usize,
        m: usize,
        k: usize,
        block: usize,
        panel: *mut u16,
        decode: &mut dyn FnMut(usize),
        out: *mut f32,
    ) {
        check_packed(step_bytes, m, k, BF16_K_STEP);
        let code = with_decoder(k, block, decode, |callback, ctx| {
            // SAFETY: forwarded contract; the callback and context live through the call.
            unsafe {
                kt_amx_emu_bf16_dot_packed_decoding(
                    packed, step_bytes, m, k, block, panel, callback, ctx, out,
                )
            }
        });
        check_emulated(code, "bf16 panel, packed rows, decoding");
    }

    packed_group_kernel!(
        /// Emulated [`dot_int8_packed`](super::dot_int8_packed).
        ///
        /// # Safety
        /// The [`PackedGroupDotFn`](crate::kernels::group_dot::PackedGroupDotFn) contract.
        dot_int8_packed,
        kt_amx_emu_int8_dot_packed,
        64,
        |code| check_emulated(code, "int8 group, packed rows")
    );

    packed_group_kernel!(
        /// Emulated [`dot_int4_packed`](super::dot_int4_packed).
        ///
        /// # Safety
        /// As [`dot_int8_packed`] for an AMXINT4 group.
        dot_int4_packed,
        kt_amx_emu_int4_dot_packed,
        128,
        |code| check_emulated(code, "int4 group, packed rows")
    );

    /// The emulator's own checks (fault detection, instruction arithmetic on random tiles):
    /// `Err(n)` names the first that failed.
    pub fn self_test() -> Result<(), i32> {
        // SAFETY: no arguments; the C++ side only touches its own stack.
        match unsafe { kt_amx_emu_self_test() } {
            0 => Ok(()),
            n => Err(n),
        }
    }
}

/// Scalar twin of the AMX bf16 panel kernel: per output, inputs in order, even then odd of each
/// pair, one rounded fp32 add per product (exact in fp32), denormal inputs read as zero and
/// denormal sums flushed — `tdpbf16ps` per Intel's pseudo-code.
///
/// # Safety
/// The [`PanelDotBf16Fn`](crate::kernels::PanelDotBf16Fn) contract.
pub unsafe fn panel_dot_bf16_twin(a: &[*const u32], k: usize, panel: *const u16, out: *mut f32) {
    let daz = |bits: u16| {
        let f = crate::dtype::bf16_bits_to_f32(bits);
        if f.is_subnormal() {
            0.0f32.copysign(f)
        } else {
            f
        }
    };
    let ftz = |f: f32| {
        if f.is_subnormal() {
            0.0f32.copysign(f)
        } else {
            f
        }
    };
    for (r, &row) in a.iter().enumerate() {
        for j in 0..crate::pack::PANEL {
            let mut acc = 0f32;
            for q in 0..k / 2 {
                // SAFETY: pair q < k/2 of the row; panel index < 32*k.
                unsafe {
                    let pair = *row.add(q);
                    for t in 0..2 {
                        let x = daz((pair >> (16 * t)) as u16);
                        let w = daz(*panel.add(crate::pack::packed_index(j, 2 * q + t, k)));
                        acc = ftz(acc + x * w);
                    }
                }
            }
            // SAFETY: out holds 32 per row.
            unsafe { *out.add(r * 32 + j) = acc };
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn emulator_passes_its_self_test() {
        assert_eq!(emulated::self_test(), Ok(()));
    }

    /// Activation rows both as one strided block (loaded straight) and scattered (gathered).
    fn row_sets(rows: usize, k: usize, rng: &mut Rng) -> (Vec<u8>, Vec<Vec<u8>>) {
        let block: Vec<u8> = (0..rows * k).map(|_| 1 + rng.below(255) as u8).collect();
        let scattered = (0..rows)
            .map(|_| (0..k).map(|_| 1 + rng.below(255) as u8).collect())
            .collect();
        (block, scattered)
    }

    type Pack = fn(&[i8], usize, usize) -> crate::Result<Vec<u8>>;

    /// A tile program (`emu`: emulated or hardware) equals a format's scalar twin on random
    /// groups, for row counts around the 16-row tiles, rows strided and scattered.
    pub(crate) fn check_int(
        ks: &[usize],
        draw: fn(&mut Rng) -> i8,
        pack: Pack,
        sums: fn(&[u8], usize) -> [i32; 32],
        emu: crate::kernels::group_dot::GroupDotFn,
        twin: crate::kernels::group_dot::GroupDotFn,
    ) {
        let mut rng = Rng::new(7);
        for &k in ks {
            let w: Vec<i8> = (0..32 * k).map(|_| draw(&mut rng)).collect();
            let group = pack(&w, 32, k).unwrap();
            let s = sums(&group, k);
            for rows in [1, 2, 5, 15, 16, 17, 31, 32] {
                let (block, scattered) = row_sets(rows, k, &mut rng);
                let strided: Vec<*const u8> = (0..rows).map(|r| block[r * k..].as_ptr()).collect();
                let apart: Vec<*const u8> = scattered.iter().map(|r| r.as_ptr()).collect();
                for ptrs in [&strided, &apart] {
                    let mut got = vec![0i32; rows * 32];
                    let mut want = vec![0i32; rows * 32];
                    // SAFETY: rows of k activation bytes, a whole tiled group, rows·32 outputs;
                    // the emulator and the twin run on any CPU.
                    unsafe {
                        emu(ptrs, k, group.as_ptr(), s.as_ptr(), got.as_mut_ptr());
                        twin(ptrs, k, group.as_ptr(), s.as_ptr(), want.as_mut_ptr());
                    }
                    assert_eq!(got, want, "rows={rows} k={k}");
                }
            }
        }
    }

    #[test]
    fn emulated_bf16_tile_program_matches_its_twin_and_fp64() {
        check_bf16(emulated::panel_dot_bf16, true);
    }

    /// The hardware tiles run the same program as the emulator. Their arithmetic is not the
    /// SDM's pseudo-code to the bit (measured on Sapphire/Emerald Rapids: one pair per
    /// instruction agrees, sixteen pairs differ in the last bits in about 15% of outputs), so
    /// they are held to a few units in the last place of the sum of |products| instead: a
    /// wrong layout or tile loop is off by O(1).
    #[cfg(kt_amx_hw)]
    #[test]
    fn hardware_bf16_tile_program_matches_its_twin_where_amx_runs() {
        if crate::isa::allows(crate::isa::Level::Amx) {
            check_bf16(panel_dot_bf16, false);
        }
    }

    /// A bf16 tile kernel against [`panel_dot_bf16_twin`] on random panels, rows strided and
    /// scattered: bit for bit where `bitwise`, else within 2^-21 of each output's sum of
    /// |products| per 32 inputs; the twin itself tracks fp64 on the bf16-rounded operands.
    fn check_bf16(kernel: crate::kernels::PanelDotBf16Fn, bitwise: bool) {
        let bf16 =
            |v: f32| crate::dtype::bf16_bits_to_f32(crate::dtype::f32_to_bf16_bits(v)) as f64;
        let mut rng = Rng::new(11);
        for k in [32, 96, 512] {
            let w: Vec<f32> = (0..32 * k).map(|_| rng.normal()).collect();
            let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
            let view =
                crate::pack::MatrixView::from_bytes(&bytes, crate::dtype::FloatType::F32, 32, k)
                    .unwrap();
            let panel = crate::pack::pack_matrix(&view).unwrap();
            for rows in [1, 3, 16, 20, 32] {
                let x: Vec<f32> = (0..rows * k).map(|_| rng.normal()).collect();
                let mut staged = vec![0u32; rows * k / 2];
                crate::kernels::scalar::stage_bf16_tail(&x, &mut staged);
                // (exact dot product, sum of |products|) per output, on the bf16 operands.
                let exact: Vec<(f64, f64)> = (0..rows * 32)
                    .map(|o| {
                        let (r, j) = (o / 32, o % 32);
                        (0..k).fold((0.0, 0.0), |(s, a), kk| {
                            let p = bf16(x[r * k + kk]) * bf16(w[j * k + kk]);
                            (s + p, a + p.abs())
                        })
                    })
                    .collect();
                // Strided rows, and the same rows reversed (scattered for the tile loads).
                let fwd: Vec<*const u32> =
                    (0..rows).map(|r| staged[r * k / 2..].as_ptr()).collect();
                let rev: Vec<*const u32> = fwd.iter().rev().copied().collect();
                for ptrs in [&fwd, &rev] {
                    let mut got = vec![0f32; rows * 32];
                    let mut want = vec![0f32; rows * 32];
                    // SAFETY: staged rows of k/2 pairs, a panel of 32·k, rows·32 outputs.
                    unsafe {
                        kernel(ptrs, k, panel.as_ptr(), got.as_mut_ptr());
                        panel_dot_bf16_twin(ptrs, k, panel.as_ptr(), want.as_mut_ptr());
                    }
                    if bitwise {
                        assert_eq!(got, want, "rows={rows} k={k}");
                        continue;
                    }
                    let steps = (k / BF16_K_STEP) as f64;
                    for (o, (&g, &t)) in got.iter().zip(&want).enumerate() {
                        // Output o of the reversed set is row rows-1-r of the exact table.
                        let r = if std::ptr::eq(ptrs, &rev) {
                            rows - 1 - o / 32
                        } else {
                            o / 32
                        };
                        let abs_sum = exact[r * 32 + o % 32].1;
                        let bound = steps * abs_sum * 2f64.powi(-21);
                        assert!(
                            (g as f64 - t as f64).abs() <= bound,
                            "rows={rows} k={k} out {o}: {g} vs twin {t} (bound {bound:e})"
                        );
                    }
                }
                // The twin itself against float64 on the bf16-rounded operands.
                let mut want = vec![0f32; rows * 32];
                // SAFETY: as above.
                unsafe { panel_dot_bf16_twin(&fwd, k, panel.as_ptr(), want.as_mut_ptr()) };
                for (got, (exact, _)) in want.iter().zip(&exact) {
                    assert!((*got as f64 - exact).abs() <= 1e-4 * (k as f64).sqrt() * 4.0);
                }
            }
        }
    }

    /// Rows packed by [`pack_rows`], then the packed tile program (emulated).
    unsafe fn emulated_packed(a: &[*const u32], k: usize, panel: *const u16, out: *mut f32) {
        // SAFETY: forwarded.
        unsafe { emulated_packed_with(emulated::panel_dot_bf16_packed, a, k, panel, out) }
    }

    /// As [`emulated_packed`], the kernel for panels already in cache.
    unsafe fn emulated_packed_cached(a: &[*const u32], k: usize, panel: *const u16, out: *mut f32) {
        // SAFETY: forwarded.
        unsafe { emulated_packed_with(emulated::panel_dot_bf16_packed_cached, a, k, panel, out) }
    }

    /// Rows packed by [`pack_rows`], then `kernel` (an emulated packed tile program).
    unsafe fn emulated_packed_with(
        kernel: crate::kernels::PackedDotBf16Fn,
        a: &[*const u32],
        k: usize,
        panel: *const u16,
        out: *mut f32,
    ) {
        let rows: Vec<*const u8> = a.iter().map(|p| p.cast()).collect();
        let mut buf = vec![0u8; k / 32 * 2048 + 64];
        // 64-byte aligned start inside buf (the tile loads do not need it; the packing does
        // not assume it either, this only mirrors the kernels' buffers).
        let off = buf.as_ptr().align_offset(64);
        // SAFETY: rows of k/2 pairs = k/32 steps of 64 bytes; buf holds every step.
        unsafe {
            let step = pack_rows(&rows, k / 32, &mut buf[off..]);
            kernel(buf[off..].as_ptr(), step, a.len(), k, panel, out)
        }
    }

    /// A packed group program as a [`GroupDotFn`](crate::kernels::group_dot::GroupDotFn):
    /// the first `k` bytes of each row packed by [`pack_rows`], then the program.
    unsafe fn via_packing(
        packed: crate::kernels::group_dot::PackedGroupDotFn,
        a: &[*const u8],
        k: usize,
        g: *const u8,
        s: *const i32,
        o: *mut i32,
    ) {
        let mut buf = vec![0u8; k / 64 * 2048];
        // SAFETY: rows of at least k bytes = k/64 steps; buf holds every step.
        unsafe {
            let step = pack_rows(a, k / 64, &mut buf);
            packed(buf.as_ptr(), step, a.len(), k, g, s, o)
        }
    }

    /// The packed int8 program (emulated) through [`via_packing`], for `check_int`.
    pub(crate) unsafe fn emulated_int8_via_packing(
        a: &[*const u8],
        k: usize,
        g: *const u8,
        s: *const i32,
        o: *mut i32,
    ) {
        // SAFETY: forwarded.
        unsafe { via_packing(emulated::dot_int8_packed, a, k, g, s, o) }
    }

    /// The packed int4 program (emulated) through [`via_packing`], for `check_int`.
    pub(crate) unsafe fn emulated_int4_via_packing(
        a: &[*const u8],
        k: usize,
        g: *const u8,
        s: *const i32,
        o: *mut i32,
    ) {
        // SAFETY: forwarded.
        unsafe { via_packing(emulated::dot_int4_packed, a, k, g, s, o) }
    }

    /// The packed int8 program on the tiles through [`via_packing`].
    #[cfg(kt_amx_hw)]
    pub(crate) unsafe fn hardware_int8_via_packing(
        a: &[*const u8],
        k: usize,
        g: *const u8,
        s: *const i32,
        o: *mut i32,
    ) {
        // SAFETY: forwarded; the caller checked that AMX runs.
        unsafe { via_packing(dot_int8_packed, a, k, g, s, o) }
    }

    /// The packed int4 program on the tiles through [`via_packing`].
    #[cfg(kt_amx_hw)]
    pub(crate) unsafe fn hardware_int4_via_packing(
        a: &[*const u8],
        k: usize,
        g: *const u8,
        s: *const i32,
        o: *mut i32,
    ) {
        // SAFETY: forwarded; the caller checked that AMX runs.
        unsafe { via_packing(dot_int4_packed, a, k, g, s, o) }
    }

    #[test]
    fn emulated_packed_bf16_tile_program_matches_its_twin() {
        check_bf16(emulated_packed, true);
    }

    /// The kernels for panels already in cache run the same program without its prefetch.
    #[test]
    fn emulated_cached_bf16_tile_programs_match_their_twin() {
        check_bf16(emulated::panel_dot_bf16_cached, true);
        check_bf16(emulated_packed_cached, true);
    }

    /// `kernel` (a decoding tile program) on packed rows, its "decoder" copying block b of
    /// `panel` into a fresh buffer (32 inputs a block, the smallest k allows, so every k of
    /// [`check_bf16`] runs blocks two ahead), then checks that the buffer ends up whole.
    unsafe fn decoding_with(
        kernel: crate::kernels::PackedDecodingBf16Fn,
        a: &[*const u32],
        k: usize,
        panel: *const u16,
        out: *mut f32,
    ) {
        let block = 32;
        let n = 32 * block;
        // SAFETY: the panel holds 32·k values (check_bf16's contract).
        let source = unsafe { std::slice::from_raw_parts(panel, 32 * k) };
        let mut buf = vec![0u16; 32 * k];
        let dst = buf.as_mut_ptr();
        let mut decoded = vec![false; k / block];
        let mut decode = |b: usize| {
            // SAFETY: block b of the 32·k-value buffer.
            unsafe { std::ptr::copy_nonoverlapping(source[b * n..].as_ptr(), dst.add(b * n), n) };
            decoded[b] = true;
        };
        let rows: Vec<*const u8> = a.iter().map(|p| p.cast()).collect();
        // SAFETY: as emulated_packed; the decoder writes block b of `buf` alone.
        unsafe {
            with_packed_rows(u64::MAX - 1, &rows, k / 32, |pk, step| {
                kernel(pk, step, a.len(), k, block, dst, &mut decode, out)
            })
        };
        assert!(decoded.iter().all(|&d| d), "every block decoded");
        assert_eq!(buf, source, "the decoded panel is left whole");
    }

    unsafe fn emulated_decoding(a: &[*const u32], k: usize, panel: *const u16, out: *mut f32) {
        // SAFETY: forwarded.
        unsafe { decoding_with(emulated::panel_dot_bf16_packed_decoding, a, k, panel, out) }
    }

    /// The decoding program multiplies exactly what the plain one does: its own blocks,
    /// decoded two ahead of the tiles.
    #[test]
    fn emulated_decoding_bf16_tile_program_matches_its_twin() {
        check_bf16(emulated_decoding, true);
    }

    /// A decoder that panics: the panic reaches the caller after the tile program returns.
    #[test]
    #[should_panic(expected = "decoder failed")]
    fn a_decoder_panic_is_raised_after_the_tile_program() {
        let a = [0u8; 64];
        let mut panel = vec![0u16; 32 * 64];
        let mut out = vec![0f32; 32];
        let mut decode = |b: usize| {
            if b == 1 {
                panic!("decoder failed");
            }
        };
        let rows = [a.as_ptr()];
        // SAFETY: one row of 32 pairs (64 inputs), a 32 × 64 panel, 32 outputs.
        unsafe {
            with_packed_rows(u64::MAX - 2, &rows, 2, |pk, step| {
                emulated::panel_dot_bf16_packed_decoding(
                    pk,
                    step,
                    1,
                    64,
                    32,
                    panel.as_mut_ptr(),
                    &mut decode,
                    out.as_mut_ptr(),
                )
            })
        };
    }

    #[cfg(kt_amx_hw)]
    unsafe fn hardware_decoding(a: &[*const u32], k: usize, panel: *const u16, out: *mut f32) {
        // SAFETY: forwarded; AMX checked by the caller.
        unsafe { decoding_with(panel_dot_bf16_packed_decoding, a, k, panel, out) }
    }

    #[cfg(kt_amx_hw)]
    #[test]
    fn hardware_decoding_bf16_tile_program_matches_its_twin_where_amx_runs() {
        if crate::isa::allows(crate::isa::Level::Amx) {
            check_bf16(hardware_decoding, false);
        }
    }

    #[cfg(kt_amx_hw)]
    unsafe fn hardware_packed(a: &[*const u32], k: usize, panel: *const u16, out: *mut f32) {
        // SAFETY: forwarded.
        unsafe { hardware_packed_with(panel_dot_bf16_packed, a, k, panel, out) }
    }

    #[cfg(kt_amx_hw)]
    unsafe fn hardware_packed_cached(a: &[*const u32], k: usize, panel: *const u16, out: *mut f32) {
        // SAFETY: forwarded.
        unsafe { hardware_packed_with(panel_dot_bf16_packed_cached, a, k, panel, out) }
    }

    #[cfg(kt_amx_hw)]
    unsafe fn hardware_packed_with(
        kernel: crate::kernels::PackedDotBf16Fn,
        a: &[*const u32],
        k: usize,
        panel: *const u16,
        out: *mut f32,
    ) {
        let rows: Vec<*const u8> = a.iter().map(|p| p.cast()).collect();
        // SAFETY: as emulated_packed; AMX checked by the caller.
        unsafe {
            with_packed_rows(u64::MAX, &rows, k / 32, |pk, step| {
                kernel(pk, step, a.len(), k, panel, out)
            })
        }
    }

    #[cfg(kt_amx_hw)]
    #[test]
    fn hardware_packed_bf16_tile_program_matches_its_twin_where_amx_runs() {
        if crate::isa::allows(crate::isa::Level::Amx) {
            check_bf16(hardware_packed, false);
        }
    }

    #[cfg(kt_amx_hw)]
    #[test]
    fn hardware_cached_bf16_tile_programs_match_their_twin_where_amx_runs() {
        if crate::isa::allows(crate::isa::Level::Amx) {
            check_bf16(panel_dot_bf16_cached, false);
            check_bf16(hardware_packed_cached, false);
        }
    }

    /// A packing is reused only for the same key and the same row addresses: rows changed
    /// under the same key give the old packing (the key's promise is the caller's), a new key
    /// or other rows give a new one.
    #[test]
    fn packed_rows_are_reused_only_under_the_same_key_and_rows() {
        let steps = 3;
        let mut a = vec![1u8; 2 * steps * 64];
        let b = vec![7u8; steps * 64];
        let first = |buf: *const u8| {
            // SAFETY: the packing holds steps · step bytes; read step 2, row 0, byte 5.
            unsafe { *buf.add(2 * packed_step_bytes(2) + 5) }
        };
        let rows = |a: &[u8]| [a.as_ptr(), a[steps * 64..].as_ptr()];
        let key = 1 << 40;
        // SAFETY: each row holds `steps` blocks of 64 bytes.
        unsafe {
            assert_eq!(with_packed_rows(key, &rows(&a), steps, |p, _| first(p)), 1);
            a.iter_mut().for_each(|v| *v = 9);
            assert_eq!(with_packed_rows(key, &rows(&a), steps, |p, _| first(p)), 1);
            assert_eq!(
                with_packed_rows(key + 1, &rows(&a), steps, |p, _| first(p)),
                9
            );
            let other = [b.as_ptr(), a.as_ptr()];
            assert_eq!(with_packed_rows(key + 1, &other, steps, |p, _| first(p)), 7);
            // Row 1 of the packing is row `a` at byte 64 of each step.
            let second = with_packed_rows(key + 1, &other, steps, |p, _| *p.add(64));
            assert_eq!(second, 9);
        }
    }

    #[test]
    #[should_panic(expected = "AMX kernels take")]
    fn too_many_rows_are_refused() {
        let rows = vec![std::ptr::null::<u8>(); ROWS + 1];
        let mut out = vec![0i32; (ROWS + 1) * 32];
        // SAFETY: the kernel refuses the row count before it reads anything.
        unsafe {
            emulated::dot_int8(
                &rows,
                64,
                std::ptr::null(),
                std::ptr::null(),
                out.as_mut_ptr(),
            )
        };
    }
}
