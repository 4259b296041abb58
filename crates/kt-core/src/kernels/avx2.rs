//! AVX2 + FMA kernels: bf16 weights widened to fp32 in registers, fp32 FMA.
use std::arch::x86_64::*;

/// Token rows per call: any number up to the largest block, which the kernel runs as
/// five-row (or fewer) register blocks over each k chunk of the panel.
pub const ROWS: usize = super::MAX_ROWS;

/// Rows per register block of the many-row kernel ([`five_row_pairs`]: all sixteen ymm
/// registers).
const BLOCK: usize = 5;

/// fp32-FMA panel dot product (see [`super::PanelDotFn`]).
///
/// # Safety
/// AVX2 and FMA available; the [`super::PanelDotFn`] contract.
pub unsafe fn panel_dot_fma(a_rows: &[*const f32], k: usize, panel: *const u16, out: *mut f32) {
    assert!(
        a_rows.len() <= ROWS,
        "avx2 panel_dot_fma takes at most {ROWS} rows"
    );
    // SAFETY: forwarded.
    unsafe {
        if a_rows.len() == 1 {
            return dot_one_row(a_rows[0], k, panel, out);
        }
        many_rows(a_rows, k, panel, out)
    }
}

/// One row (decode): both halves of the panel in one pass ([`row_groups`] with four groups).
/// Each accumulator takes two dependent FMAs per input pair, so with only the two of one half
/// in flight the loop waits on FMA latency (8 cycles per 64 bytes); four chains halve that.
/// Every lane still adds its products in the twin's order.
///
/// # Safety
/// The CPU has AVX2 and FMA; `a` points to `k` readable f32; the rest is the
/// [`super::PanelDotFn`] contract.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_one_row(a: *const f32, k: usize, panel: *const u16, out: *mut f32) {
    let mut rows = [std::ptr::null::<f32>(); BLOCK];
    rows[0] = a;
    // SAFETY: the contract: k/2 pairs of the row and of the panel (both halves); `out` holds
    // the row's 32 outputs, written (not added to) without `reload`.
    unsafe {
        let ahead = Ahead::both_lines(super::prefetch::distance(), panel);
        row_groups::<1, 4, 4>(ahead, &rows, panel, k / 2, out, false)
    };
}

/// Input pairs per k chunk: 8 KiB of panel (both halves) and 512 bytes of each row, so a
/// chunk's panel lines and all 32 rows' inputs stay in L1 while every register block of rows
/// reads them.
const CHUNK_PAIRS: usize = 64;

/// Many rows, k chunk by k chunk: every register block of rows ([`super::even_block`] of at
/// most five) takes the chunk before the next chunk is read. The panel then streams from
/// memory once per call at the pace of all the rows' FMAs, where a call per row block would
/// stream it at one block's pace the first time (memory-bound) and find it in L2 after. A
/// chunk after the first reloads each block's sums from `out`, so every lane still adds its
/// products in the twin's order: `x0·even`, then `x1·odd`, per pair.
///
/// # Safety
/// The CPU has AVX2 and FMA; 2 to [`ROWS`] rows; the rest is the [`super::PanelDotFn`]
/// contract.
#[target_feature(enable = "avx2,fma")]
unsafe fn many_rows(a_rows: &[*const f32], k: usize, panel: *const u16, out: *mut f32) {
    let setting = super::prefetch::for_panel_rows(a_rows.len());
    let pairs = k / 2;
    if pairs == 0 {
        // No inputs: every sum is zero (the chunk loop below would leave `out` as it was).
        // SAFETY: out holds 32 floats per row.
        unsafe { std::ptr::write_bytes(out, 0, a_rows.len() * 32) };
        return;
    }
    let mut rows = [std::ptr::null::<f32>(); ROWS];
    let mut c0 = 0;
    while c0 < pairs {
        let n = CHUNK_PAIRS.min(pairs - c0);
        for (dst, &src) in rows.iter_mut().zip(a_rows) {
            // Pair c0 of each row (inside it by the contract).
            *dst = src.wrapping_add(2 * c0);
        }
        // Calls of up to [`STREAM_ROWS`] rows prefetch the setting's distance ahead as every
        // pass over every chunk goes, a share each (the lines after the last chunk are the
        // next panel's, which a task usually reads next). Larger ones prefetch so during the
        // first chunk's first pass, then take each next chunk's 128 lines in bursts, a share
        // before each block.
        let single = a_rows.len() <= STREAM_ROWS && setting != 0;
        let fetch = if c0 == 0 || single { setting } else { 0 };
        let next = (panel as *const u8).wrapping_add((c0 + n) * 128);
        let next_lines = if single { 0 } else { CHUNK_PAIRS * 128 / 64 };
        // SAFETY: the contract; pairs c0..c0+n lie within every row and the panel.
        unsafe {
            chunk_rows(
                &rows[..a_rows.len()],
                n,
                panel.add(c0 * 64),
                out,
                c0 > 0,
                fetch,
                (next, next_lines),
            )
        };
        c0 += n;
    }
}

/// Rows up to which a call prefetches the setting's distance ahead as its passes go, rather
/// than in a burst of the next chunk's 128 lines before each block's share of it. With few
/// blocks the bursts are large and outran the core's outstanding misses. Measured when only
/// the first block's first pass prefetched (a window too short with many blocks): AMD Zen 3,
/// S1 layer, 2 threads, old and new alternated every 8-10 calls in one process
/// (`prefill BF16 N`), median ms: up to 5 rows (before) -> up to 16: 128 tokens 187 -> 162
/// (also 167 -> 153, 188 -> 163 up to 32 and 182 -> 154 up to 12), 256 tokens 239 -> 220;
/// up to 32 rows made 512 tokens slower (332 -> 372) and up to 20 left it as it was
/// (365 -> 356). One core, 8 rows streamed from memory (`ROWS=8 PANELS=4000 panel_rows`):
/// 33-34 -> 42-44 GFLOP/s. With every pass taking a share (`PF=8192 PF_L2=1 PANELS=4000`,
/// old and new binaries alternated): 8 rows 42.6 -> 61.4-63.3, 4 rows 31-33 -> 45-46, 16
/// rows 51-54 -> 64-72. The layer at 128 tokens (`prefill BF16 128`, binaries alternated,
/// median ms): 123-132 -> 93-95 in two rounds of three (130 in the first). With the shares,
/// up to 32 rows measured the same as up to 16 at 256 and 512 tokens (within this VM's
/// noise), so the setting stayed.
const STREAM_ROWS: usize = 16;

/// Every row over one k chunk of `n ≥ 1` input pairs, in register blocks of at most five
/// rows ([`super::even_block`]): each block's 32 sums per row are written to `out` (or, with
/// `reload`, added to what it holds there), a lane's products in pair order, `x0·even` then
/// `x1·odd`. A block of one or two rows takes both halves in one pass ([`row_groups`]),
/// larger ones half by half. `rows[r]` points to the chunk's first input of row r, `chunk` to
/// its first pair (128 bytes per pair, both halves). `fetch` is a prefetch setting
/// ([`super::prefetch::set_of`], 0 = none): without `next` lines every pass prefetches its
/// share of the chunk's lines that far ahead, with them the first pass both lines of each
/// pair; the `next.1` lines from
/// `next.0` are prefetched into L2, a share before each block, so memory fetches the next
/// chunk while the blocks compute on this one.
///
/// # Safety
/// The CPU has AVX2 and FMA; at most [`ROWS`] rows, each with `2n` readable f32; the panel
/// 128·n − 64 readable bytes at `chunk`; `out` 32 floats per row, readable with `reload`,
/// writable. Prefetched lines may lie anywhere (they never fault).
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn chunk_rows(
    rows: &[*const f32],
    n: usize,
    chunk: *const u16,
    out: *mut f32,
    reload: bool,
    fetch: usize,
    next: (*const u8, usize),
) {
    static HI_MASK: [u32; 8] = [0xFFFF_0000; 8];
    debug_assert!(n >= 1 && rows.len() <= ROWS);
    let (next, next_lines) = next;
    let blocks = rows.len().div_ceil(BLOCK);
    // Every pass over the chunk (one per block of one or two rows, one per half of larger
    // blocks) takes an equal share of the prefetches, so misses stay in flight while all of
    // them compute rather than in a burst during the first (AMD Zen 3, one core, 8 rows
    // streamed: the first-pass burst let memory and FMAs take turns).
    // A call that also takes the next chunk in bursts (more than [`STREAM_ROWS`] rows, the
    // first chunk) prefetches in its first pass only, both lines of each pair, as before the
    // shares: with them, 512 tokens ran 1-9% slower in four of five alternated rounds (within
    // this VM's noise, but nothing there to gain).
    let share = next_lines == 0;
    // One pass per block of one or two rows (only when there are no more rows), two (a half
    // each) per larger block: [`super::even_block`] makes every block of 3+ rows at least 3.
    let passes = match (share, rows.len()) {
        (false, _) | (true, 0..=2) => 1,
        (true, _) => 2 * blocks,
    };
    let step = 128usize.div_ceil(passes);
    let ahead_of = |pass: usize| Ahead {
        setting: if share || pass == 0 { fetch } else { 0 },
        start: (chunk as *const u8).wrapping_add(pass * n * step),
        step,
    };
    let mut pass = 0;
    let mut r0 = 0;
    let mut b = 0;
    while r0 < rows.len() {
        let nr = super::even_block(rows.len() - r0, BLOCK);
        for line in b * next_lines / blocks..(b + 1) * next_lines / blocks {
            super::prefetch::line_into_l2(next.wrapping_add(line * 64));
        }
        let mut block_rows = [std::ptr::null::<f32>(); BLOCK];
        block_rows[..nr].copy_from_slice(&rows[r0..r0 + nr]);
        if nr <= 2 {
            let ahead = ahead_of(pass);
            pass += 1;
            let sums = out.wrapping_add(r0 * 32);
            // SAFETY: the contract: n pairs of every row and of the chunk (both halves);
            // `sums` leads nr rows of 32 outputs.
            unsafe {
                if nr == 2 {
                    row_groups::<2, 4, 8>(ahead, &block_rows, chunk, n, sums, reload);
                } else {
                    row_groups::<1, 4, 4>(ahead, &block_rows, chunk, n, sums, reload);
                }
            }
            r0 += nr;
            b += 1;
            continue;
        }
        for h in 0..2 {
            let ahead = ahead_of(pass);
            pass += 1;
            // The first of this half's 8-lane groups of block row 0 in `out`.
            let sums = out.wrapping_add(r0 * 32 + h * 16);
            // SAFETY: the contract: n pairs of every row and of the chunk; `sums` leads nr
            // rows of 32 outputs; the five-row mask is 8 u32.
            unsafe {
                let p = chunk.add(h * 32);
                match nr {
                    5 => {
                        let mut acc = load_sums::<2, 10>(sums, reload);
                        five_row_pairs(ahead, block_rows, p, n, HI_MASK.as_ptr(), &mut acc);
                        store_sums::<2, 10>(sums, &acc);
                    }
                    4 => row_groups::<4, 2, 8>(ahead, &block_rows, p, n, sums, reload),
                    _ => row_groups::<3, 2, 6>(ahead, &block_rows, p, n, sums, reload),
                }
            }
        }
        r0 += nr;
        b += 1;
    }
    debug_assert!(!share || pass == passes);
}

/// The prefetches one pass issues as it goes: at input pair q, the line `setting`'s distance
/// past `start + q·step` (and the line after it when `step` exceeds a line), into the cache
/// the setting names; nothing when `setting` is 0.
#[derive(Clone, Copy)]
struct Ahead {
    setting: usize,
    start: *const u8,
    step: usize,
}

impl Ahead {
    /// Both lines of each pair of a one-pass call over the panel at `panel`.
    fn both_lines(setting: usize, panel: *const u16) -> Self {
        Ahead {
            setting,
            start: panel as *const u8,
            step: 128,
        }
    }
}

/// The `S` 8-lane sums of a register block of `G` groups per row (`acc[G·r + g]` at
/// `sums + 32r + 8g`), or zeros for the first chunk.
///
/// # Safety
/// AVX2; with `reload`, `sums` leads `S / G` rows of 32 readable floats.
#[target_feature(enable = "avx2")]
unsafe fn load_sums<const G: usize, const S: usize>(sums: *const f32, reload: bool) -> [__m256; S] {
    let mut acc = [_mm256_setzero_ps(); S];
    if reload {
        for (i, v) in acc.iter_mut().enumerate() {
            // SAFETY: the caller's contract.
            *v = unsafe { _mm256_loadu_ps(sums.add((i / G) * 32 + (i % G) * 8)) };
        }
    }
    acc
}

/// Store what [`load_sums`] loads.
///
/// # Safety
/// AVX2; `sums` leads `S / G` rows of 32 writable floats.
#[target_feature(enable = "avx2")]
unsafe fn store_sums<const G: usize, const S: usize>(sums: *mut f32, acc: &[__m256; S]) {
    for (i, v) in acc.iter().enumerate() {
        // SAFETY: the caller's contract.
        unsafe { _mm256_storeu_ps(sums.add((i / G) * 32 + (i % G) * 8), *v) };
    }
}

/// Up to four rows over `n` input pairs of `G` 8-lane groups of each pair's panel bytes at
/// `p` (`S = G·R` accumulators), adding into (or, for the first chunk, writing) the sums at
/// `sums`; `ahead` names the prefetches it issues as it goes.
/// - `G = 2`: one half (`p` at it, `sums` at its first output); three or four rows (6 or 8
///   accumulators, 4 weight vectors and the broadcasts: LLVM keeps them in registers).
/// - `G = 4`: both halves in one pass, for one or two rows. With the halves in separate
///   passes, two rows keep only four FMA chains in flight, each taking two dependent FMAs per
///   pair, and wait on FMA latency (AMD Zen 3, from cache: two rows ran at the GFLOP/s of
///   one, 38-41 GFLOP/s, 50-63 in one pass; three rows in one pass spilled and ran at 34-37
///   against 58-61).
///
/// # Safety
/// The CPU has AVX2 and FMA; `rows[..R]` each have `2n` readable f32; the `G·32` panel bytes
/// of each pair `q` at `p + 128q` are readable; `sums` leads R rows of 32 floats.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)] // register blocks read best as indexed loops
unsafe fn row_groups<const R: usize, const G: usize, const S: usize>(
    ahead: Ahead,
    rows: &[*const f32; BLOCK],
    p: *const u16,
    n: usize,
    sums: *mut f32,
    reload: bool,
) {
    let hi_mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    // SAFETY: the caller's contract.
    let mut acc = unsafe { load_sums::<G, S>(sums, reload) };
    let second_line = ahead.step > 64;
    for q in 0..n {
        // SAFETY: within the panel and rows by the contract; prefetches do not fault.
        unsafe {
            let w_at = p.add(q * 64);
            let fetch_at = ahead.start.wrapping_add(q * ahead.step);
            super::prefetch::ahead(fetch_at, ahead.setting);
            if second_line {
                super::prefetch::ahead(fetch_at.wrapping_add(64), ahead.setting);
            }
            for g in 0..G {
                let w = _mm256_loadu_si256(w_at.add(g * 16) as *const __m256i);
                let w_even = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w));
                let w_odd = _mm256_castsi256_ps(_mm256_and_si256(w, hi_mask));
                for r in 0..R {
                    let x0 = _mm256_broadcast_ss(&*rows[r].add(2 * q));
                    let x1 = _mm256_broadcast_ss(&*rows[r].add(2 * q + 1));
                    acc[G * r + g] = _mm256_fmadd_ps(x0, w_even, acc[G * r + g]);
                    acc[G * r + g] = _mm256_fmadd_ps(x1, w_odd, acc[G * r + g]);
                }
            }
        }
    }
    // SAFETY: the caller's contract.
    unsafe { store_sums::<G, S>(sums, &acc) };
}

/// The five-row loop body over `n ≥ 1` input pairs, with the prefetch lines given.
macro_rules! five_row_loop {
    ($rows:expr, $p:expr, $n:expr, $ahead:expr, $distance:expr, $mask:expr, $acc:expr;
     $($prefetch:literal),*) => {
        std::arch::asm!(
            "2:",
            $($prefetch,)*
            "vmovdqu ymm10, ymmword ptr [{p}]",
            "vmovdqu ymm12, ymmword ptr [{p} + 32]",
            "vpand ymm11, ymm10, ymmword ptr [{mask}]",
            "vpslld ymm10, ymm10, 16",
            "vpand ymm13, ymm12, ymmword ptr [{mask}]",
            "vpslld ymm12, ymm12, 16",
            "vbroadcastss ymm14, dword ptr [{a0} + {off}]",
            "vbroadcastss ymm15, dword ptr [{a0} + {off} + 4]",
            "vfmadd231ps ymm0, ymm14, ymm10",
            "vfmadd231ps ymm1, ymm14, ymm12",
            "vfmadd231ps ymm0, ymm15, ymm11",
            "vfmadd231ps ymm1, ymm15, ymm13",
            "vbroadcastss ymm14, dword ptr [{a1} + {off}]",
            "vbroadcastss ymm15, dword ptr [{a1} + {off} + 4]",
            "vfmadd231ps ymm2, ymm14, ymm10",
            "vfmadd231ps ymm3, ymm14, ymm12",
            "vfmadd231ps ymm2, ymm15, ymm11",
            "vfmadd231ps ymm3, ymm15, ymm13",
            "vbroadcastss ymm14, dword ptr [{a2} + {off}]",
            "vbroadcastss ymm15, dword ptr [{a2} + {off} + 4]",
            "vfmadd231ps ymm4, ymm14, ymm10",
            "vfmadd231ps ymm5, ymm14, ymm12",
            "vfmadd231ps ymm4, ymm15, ymm11",
            "vfmadd231ps ymm5, ymm15, ymm13",
            "vbroadcastss ymm14, dword ptr [{a3} + {off}]",
            "vbroadcastss ymm15, dword ptr [{a3} + {off} + 4]",
            "vfmadd231ps ymm6, ymm14, ymm10",
            "vfmadd231ps ymm7, ymm14, ymm12",
            "vfmadd231ps ymm6, ymm15, ymm11",
            "vfmadd231ps ymm7, ymm15, ymm13",
            "vbroadcastss ymm14, dword ptr [{a4} + {off}]",
            "vbroadcastss ymm15, dword ptr [{a4} + {off} + 4]",
            "vfmadd231ps ymm8, ymm14, ymm10",
            "vfmadd231ps ymm9, ymm14, ymm12",
            "vfmadd231ps ymm8, ymm15, ymm11",
            "vfmadd231ps ymm9, ymm15, ymm13",
            "add {p}, 128",
            "add {off}, 8",
            "dec {n}",
            "jnz 2b",
            p = inout(reg) $p => _,
            n = inout(reg) $n => _,
            off = inout(reg) 0usize => _,
            fetch_at = inout(reg) $ahead.start => _,
            step = in(reg) $ahead.step,
            distance = in(reg) $distance,
            mask = in(reg) $mask,
            a0 = in(reg) $rows[0],
            a1 = in(reg) $rows[1],
            a2 = in(reg) $rows[2],
            a3 = in(reg) $rows[3],
            a4 = in(reg) $rows[4],
            inout("ymm0") $acc[0],
            inout("ymm1") $acc[1],
            inout("ymm2") $acc[2],
            inout("ymm3") $acc[3],
            inout("ymm4") $acc[4],
            inout("ymm5") $acc[5],
            inout("ymm6") $acc[6],
            inout("ymm7") $acc[7],
            inout("ymm8") $acc[8],
            inout("ymm9") $acc[9],
            out("ymm10") _,
            out("ymm11") _,
            out("ymm12") _,
            out("ymm13") _,
            out("ymm14") _,
            out("ymm15") _,
            options(nostack, readonly),
        )
    };
}

/// `acc[2r + g]` += row r's products with the 8 lanes of group g of the half at `p`, over `n`
/// input pairs (pair i: `rows[r][2i]`, `rows[r][2i + 1]`; panel bytes `p + 128·i ..+ 64`).
///
/// Per input pair the two weight vectors of the half, even and odd, are widened once and each
/// row's two broadcasts serve both (ten accumulators, four weight vectors, two broadcasts: all
/// sixteen registers). Each accumulator takes two dependent FMAs per pair, so ten chains cover
/// the FMA latency where the eight of four rows did not, and the loads per pair fall from
/// 2R + 2 to R + 2. The loop is assembly because LLVM hoists every row's broadcasts ahead of
/// the FMAs and spills the accumulators (measured: 1.5× slower than four rows).
///
/// # Safety
/// The CPU has AVX2 and FMA; `n ≥ 1`; each row has `2n` readable f32 and the panel 128·n − 64
/// readable bytes after `p`; `mask` points to 8 u32 of `0xFFFF_0000`. `ahead` (a step of at
/// most two lines) names the prefetches it issues as it goes.
#[target_feature(enable = "avx2,fma")]
unsafe fn five_row_pairs(
    ahead: Ahead,
    rows: [*const f32; 5],
    p: *const u16,
    n: usize,
    mask: *const u32,
    acc: &mut [__m256; 10],
) {
    debug_assert!(n >= 1 && ahead.step <= 128);
    let (distance, into_l2) = super::prefetch::describe(ahead.setting);
    // SAFETY: the caller's contract; the assembly reads only what it states and writes only
    // the registers it names.
    unsafe {
        match (ahead.setting, into_l2, ahead.step > 64) {
            // The comment names the operands the other arms use.
            (0, _, _) => five_row_loop!(rows, p, n, ahead, distance, mask, acc;
                "/* {distance} {fetch_at} {step} */"),
            (_, false, false) => five_row_loop!(rows, p, n, ahead, distance, mask, acc;
                "prefetcht0 byte ptr [{fetch_at} + {distance}]",
                "add {fetch_at}, {step}"),
            (_, true, false) => five_row_loop!(rows, p, n, ahead, distance, mask, acc;
                "prefetcht1 byte ptr [{fetch_at} + {distance}]",
                "add {fetch_at}, {step}"),
            (_, false, true) => five_row_loop!(rows, p, n, ahead, distance, mask, acc;
                "prefetcht0 byte ptr [{fetch_at} + {distance}]",
                "prefetcht0 byte ptr [{fetch_at} + {distance} + 64]",
                "add {fetch_at}, {step}"),
            (_, true, true) => five_row_loop!(rows, p, n, ahead, distance, mask, acc;
                "prefetcht1 byte ptr [{fetch_at} + {distance}]",
                "prefetcht1 byte ptr [{fetch_at} + {distance} + 64]",
                "add {fetch_at}, {step}"),
        }
    }
}

/// SwiGLU, auto-vectorised for AVX2.
///
/// # Safety
/// AVX2 and FMA available; equal lengths.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32], limit: f32, alpha: f32) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = super::swiglu_one(g, u, limit, alpha);
    }
}
