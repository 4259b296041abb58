//! One forward call, phase by phase, as the data flows: route the chunk's tokens, gather and
//! prepare x, gate/up panels and SwiGLU, prepare the SwiGLU rows, down panels with the router
//! weight, reduce over experts, and merge the NUMA parts' partial outputs.
//!
//! Every phase is a `parallel_for` of one part's team over tasks that write disjoint ranges of
//! the workspace (rows, panels or column blocks); the format ([`crate::formats`]) supplies the
//! arithmetic of each panel.
use super::phase_timing::{self, CallTimes, Phase};
use super::workspace::PartPtrs;
use super::{MoeLayer, Workspace, CHUNK_TOKENS};
use crate::dtype::{row_from_f32, row_to_f32, FloatType};
use crate::formats::{NextPanel, PanelAcc, PanelAt, RowBlock, Stage};
use crate::kernels::MAX_ROWS;
use crate::pack::PANEL;
use crate::pool::{Pool, Team};
use crate::routing::{Ids, Routing};
use crate::sync_ptr::SyncPtr;
use crate::{kt_ensure, Result};
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Forwards of at most this many tokens tune the prefetch distance.
const TUNE_MAX_TOKENS: usize = 4;

/// Forwards whose experts get at least this many rows each on average tune the AMX tile
/// programs' weight prefetch (the tiles then carry the work).
const AMX_TUNE_MIN_MEAN_ROWS: usize = 8;

/// Output panels per column block of the row-wise scheme's sum over experts.
const DOWN_GROUP_PANELS: usize = 4;

/// A decode's down phase gives each thread one block of output columns (panels) over every
/// expert, as a prefill's always does, when each block has at least this many panels; below
/// that (many threads on a narrow layer) the row-wise scheme keeps each thread's
/// stretches of weights long. With the columns each thread sums its own outputs over the
/// experts: no weighted rows to write and sum in a second pass, whose lines went from one
/// core to the other and back at every call. AMD Zen 5, two threads, one token, S1 layer
/// (`decode` example, medians of four alternated runs, ms, row-wise -> columns): GPTQ_INT4
/// 0.278 -> 0.256, MXFP4 0.287 -> 0.263, RAWINT4 0.297 -> 0.280, AMXINT4 0.237 -> 0.239,
/// AMXINT8 0.430 -> 0.436, FP8 0.50 either way; with 64-wide experts (`DECODE_I=64`), where
/// what is fixed per call shows, RAWINT4's down phase took 0.050 ms row-wise and 0.022 in
/// columns. (Not measured with more threads: the threshold is a guess that keeps a block's
/// stretch of each expert at 16 panels or more.)
const DECODE_SHARE_PANELS: usize = 16;

/// Share `i` of `threads` even shares of a phase's (expert, panel) tasks, `panels` per expert
/// of `experts`, cut at experts: the (expert, panels) pieces in order. Decode phases hand
/// each thread one share: every thread streams one long stretch of the experts' matrices, and
/// they finish together (AMXINT4, one token, two threads, AMD Zen 5: 0.256-0.259 ms with
/// tasks of a run of one expert's panels handed out from a counter, 0.238-0.243 with shares).
fn even_share(
    i: usize,
    threads: usize,
    experts: usize,
    panels: usize,
) -> impl Iterator<Item = (usize, Range<usize>)> {
    let (n, threads, panels) = (experts * panels, threads.max(1), panels.max(1));
    let share = i * n / threads..(i + 1) * n / threads;
    let mut t = share.start;
    std::iter::from_fn(move || {
        (t < share.end).then(|| {
            let (ei, p) = (t / panels, t % panels);
            let end = (share.end - ei * panels).min(panels);
            t = ei * panels + end;
            (ei, p..end)
        })
    })
}

/// Inputs and outputs of one forward call, as raw memory (the Python binding's form).
#[derive(Clone, Copy, Debug)]
pub struct ForwardArgs {
    /// Tokens in this call (≤ `max_tokens`).
    pub qlen: usize,
    /// `[qlen][H]` activations.
    pub hidden: *const u8,
    /// Their element type.
    pub hidden_type: FloatType,
    /// `[qlen][top_k]` expert ids (physical slots).
    pub ids: *const u8,
    /// Whether ids are int64 (else int32).
    pub ids_i64: bool,
    /// `[qlen][top_k]` fp32 router weights.
    pub weights: *const f32,
    /// `[qlen][H]` output.
    pub out: *mut u8,
    /// Output element type.
    pub out_type: FloatType,
    /// Optional `[qlen][H]` addend (the previous layer's deferred experts).
    pub residual: *const u8,
    /// Element type of `residual`.
    pub residual_type: FloatType,
    /// Optional `[num_experts]` bytes, non-zero = expert runs on the GPU (read now, live).
    pub gpu_mask: *const u8,
}

// SAFETY: plain addresses; `forward_raw`'s contract makes them valid for the call, and tasks
// only write disjoint rows of `out`.
unsafe impl Send for ForwardArgs {}
// SAFETY: as above.
unsafe impl Sync for ForwardArgs {}

impl ForwardArgs {
    /// The ids and router weights of tokens `tokens` (`k` per token).
    ///
    /// # Safety
    /// `tokens` lie inside the `qlen` rows that `ids` and `weights` point to.
    unsafe fn routing_of(&self, tokens: Range<usize>, k: usize) -> (Ids<'_>, &[f32]) {
        let (at, n) = (tokens.start * k, tokens.len() * k);
        // SAFETY: the contract above.
        unsafe {
            let ids = if self.ids_i64 {
                Ids::I64(std::slice::from_raw_parts(
                    (self.ids as *const i64).add(at),
                    n,
                ))
            } else {
                Ids::I32(std::slice::from_raw_parts(
                    (self.ids as *const i32).add(at),
                    n,
                ))
            };
            (ids, std::slice::from_raw_parts(self.weights.add(at), n))
        }
    }

    /// These arguments restricted to tokens `tokens` (rows of `h` values).
    ///
    /// # Safety
    /// `tokens` lie inside the `qlen` rows of every non-null buffer.
    unsafe fn rows(&self, tokens: Range<usize>, h: usize) -> ForwardArgs {
        let offset = |p: *const u8, t: FloatType| {
            if p.is_null() {
                p
            } else {
                // SAFETY: row tokens.start is within the caller's buffer (the contract).
                unsafe { p.add(tokens.start * h * t.size()) }
            }
        };
        ForwardArgs {
            qlen: tokens.len(),
            hidden: offset(self.hidden, self.hidden_type),
            out: offset(self.out, self.out_type) as *mut u8,
            residual: offset(self.residual, self.residual_type),
            ..*self
        }
    }

    /// Refuse null addresses where a forward of `qlen > 0` tokens needs memory (the residual
    /// and the mask may be null: "none").
    pub fn check_addresses(&self) -> Result<()> {
        if self.qlen == 0 {
            return Ok(());
        }
        for (name, null) in [
            ("hidden", self.hidden.is_null()),
            ("ids", self.ids.is_null()),
            ("weights", self.weights.is_null()),
            ("out", self.out.is_null()),
        ] {
            kt_ensure!(!null, Invalid, "{name} pointer is null");
        }
        kt_ensure!(
            !std::ptr::eq(self.residual, self.out) || self.residual_type == self.out_type,
            Invalid,
            "the residual is the output buffer but of another element type ({} vs {})",
            self.residual_type.name(),
            self.out_type.name()
        );
        Ok(())
    }
}

impl MoeLayer {
    /// Forward with fp32 slices (for Rust callers and tests): `x [qlen][H]`, `ids/weights
    /// [qlen][top_k]`, `out [qlen][H]`.
    pub fn forward_f32(
        &self,
        pool: &Pool,
        ws: &mut Workspace,
        x: &[f32],
        ids: &[i64],
        weights: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        let c = &self.config;
        let qlen = x.len() / c.hidden;
        kt_ensure!(
            x.len() == qlen * c.hidden && out.len() == x.len(),
            Invalid,
            "hidden states and output must both be [qlen, {}]",
            c.hidden
        );
        kt_ensure!(
            ids.len() == qlen * c.top_k && weights.len() == ids.len(),
            Invalid,
            "ids and weights must be [{qlen}, {}]",
            c.top_k
        );
        let args = ForwardArgs {
            qlen,
            hidden: x.as_ptr() as *const u8,
            hidden_type: FloatType::F32,
            ids: ids.as_ptr() as *const u8,
            ids_i64: true,
            weights: weights.as_ptr(),
            out: out.as_mut_ptr() as *mut u8,
            out_type: FloatType::F32,
            residual: std::ptr::null(),
            residual_type: FloatType::F32,
            gpu_mask: std::ptr::null(),
        };
        // SAFETY: every pointer comes from a slice whose length was checked above.
        unsafe { self.forward_raw(pool, ws, &args) }
    }

    /// Forward over raw memory.
    ///
    /// # Safety
    /// Every pointer in `args` must be valid for the extent its comment gives, for the whole
    /// call, and `out` must not overlap the inputs, except that `residual` may be `out` itself
    /// (same address and element type: each strip of a row is read before it is written, the
    /// original's `incremental` accumulation). Null `residual`/`gpu_mask` mean "none".
    pub unsafe fn forward_raw(
        &self,
        pool: &Pool,
        ws: &mut Workspace,
        args: &ForwardArgs,
    ) -> Result<()> {
        let c = &self.config;
        let l = c.layer_idx;
        kt_ensure!(
            self.loaded,
            Runtime,
            "layer {l}: forward called before the weights were loaded"
        );
        self.check_pool(pool)?;
        kt_ensure!(
            args.qlen <= c.max_tokens,
            Invalid,
            "layer {l}: {} tokens exceed chunked_prefill_size={}",
            args.qlen,
            c.max_tokens
        );
        if args.qlen == 0 {
            return Ok(());
        }
        ws.reserve(self)?;
        let (h, k) = (c.hidden, c.top_k);
        // SAFETY: the caller guarantees num_experts readable bytes when non-null.
        let mask = (!args.gpu_mask.is_null())
            .then(|| unsafe { std::slice::from_raw_parts(args.gpu_mask, c.num_experts) });
        // Decodes (a few tokens: memory-bound) tune the family's prefetch distance while the
        // process starts serving (kernels::prefetch).
        let family = crate::kernels::prefetch::family_of(self.method());
        let tuning = (args.qlen <= TUNE_MAX_TOKENS)
            .then(|| crate::kernels::prefetch::tune_begin(family))
            .flatten()
            .map(|arm| (arm, std::time::Instant::now()));
        // Prefills on hardware tiles tune the tile programs' weight prefetch the same way.
        let amx_tuning = self
            .kernels
            .amx()
            .filter(|a| !a.emulated)
            .and(crate::kernels::amx::amx_stream_of(self.method()))
            .filter(|_| args.qlen * c.top_k >= AMX_TUNE_MIN_MEAN_ROWS * c.num_experts)
            .and_then(|stream| {
                let arm = crate::kernels::amx::amx_tune_begin(stream)?;
                Some((stream, arm, std::time::Instant::now()))
            });
        let timing = phase_timing::interval().map(|every| (every, std::time::Instant::now()));
        let times = timing.map(|_| CallTimes::default());
        let times = times.as_ref();
        // Experts activated, summed over the chunks: the tuners' unit of work.
        let (mut t0, mut activated) = (0, 0);
        while t0 < args.qlen {
            let tokens = t0..(t0 + CHUNK_TOKENS).min(args.qlen);
            let mut lap = times.map(CallTimes::lap);
            // SAFETY: `tokens` lie inside the caller's qlen rows.
            let (ids, weights) = unsafe { args.routing_of(tokens.clone(), k) };
            ws.routing
                .build(ids, weights, tokens.len(), k, c.num_experts, mask);
            activated += ws.routing.experts.len();
            phase_timing::mark(&mut lap, Phase::Route);
            // SAFETY: forwarded contract, restricted to this chunk's rows; the workspace was
            // reserved for this layer and its routing is this chunk's.
            unsafe { self.forward_chunk(pool, ws, &args.rows(tokens.clone(), h), times)? };
            t0 = tokens.end;
        }
        let per_expert = |start: std::time::Instant| {
            (activated > 0).then(|| start.elapsed().as_secs_f64() / activated as f64)
        };
        if let Some((arm, secs)) = tuning.and_then(|(arm, t)| Some((arm, per_expert(t)?))) {
            crate::kernels::prefetch::tune_end(family, arm, secs);
        }
        if let Some((stream, arm, secs)) =
            amx_tuning.and_then(|(stream, arm, t)| Some((stream, arm, per_expert(t)?)))
        {
            crate::kernels::amx::amx_tune_end(stream, arm, secs);
        }
        if let (Some((every, start)), Some(times)) = (timing, times) {
            let total = start.elapsed();
            if let Some(line) = self.phase_stats.record(l, args.qlen, times, total, every) {
                eprintln!("{line}");
            }
        }
        Ok(())
    }

    /// One chunk (≤ CHUNK_TOKENS tokens) whose routing is already in `ws.routing`.
    ///
    /// # Safety
    /// `args` is valid as [`MoeLayer::forward_raw`] requires, `args.qlen ≤ CHUNK_TOKENS`,
    /// `ws` was reserved for this layer and `ws.routing` routes these `args.qlen` tokens.
    /// With `times`, the first part's phases are timed into it (`KT_MOE_PHASE_TIMING`).
    unsafe fn forward_chunk(
        &self,
        pool: &Pool,
        ws: &Workspace,
        args: &ForwardArgs,
        times: Option<&CallTimes>,
    ) -> Result<()> {
        let routing = &ws.routing;
        let max_rows = routing.offsets.windows(2).map(|w| w[1] - w[0]).max();
        let max_rows = max_rows.unwrap_or(0);
        let chunk = Chunk {
            layer: self,
            routing,
            args,
            max_rows,
            prepare_x: self.experts.prepares_x(max_rows),
            prepare_act: self.experts.prepares_act(max_rows),
            hidden_in: SyncPtr::new(args.hidden as *mut u8),
            residual: SyncPtr::new(args.residual as *mut u8),
            out: SyncPtr::new(args.out),
        };
        let parts = &ws.ptrs[..self.experts.part_ranges().len()];
        let single = parts.len() == 1;
        pool.run_parts(&|part, team: &Team| {
            let experts = &*self.experts;
            let (x_stride, act_stride) = (experts.x_stride(part), experts.act_stride(part));
            let prep_act = chunk.prepare_act && act_stride > 0;
            let f = PartForward {
                c: &chunk,
                part,
                team,
                s: parts[part],
                ip: experts.part_ranges()[part].len(),
                x_stride,
                act_stride,
                prep_x: chunk.prepare_x && x_stride > 0,
                prep_act,
                act_per_panel: prep_act && experts.prepares_act_per_panel(),
            };
            let mut lap = times.filter(|_| part == 0).map(CallTimes::lap);
            // SAFETY: the chunk's contract (forward_chunk's) covers every pointer the phases
            // use; each phase's tasks write disjoint ranges, and phases are separated by the
            // team's barriers.
            unsafe {
                f.gather_x();
                phase_timing::mark(&mut lap, Phase::GatherX);
                let prepared = f.gate_up_swiglu();
                phase_timing::mark(&mut lap, Phase::GateUp);
                if f.prep_act && !f.act_per_panel && !prepared {
                    f.prepare_act();
                }
                phase_timing::mark(&mut lap, Phase::SwigluRows);
                f.down_reduce();
                phase_timing::mark(&mut lap, Phase::Down);
                if single {
                    f.finish();
                }
                phase_timing::mark(&mut lap, Phase::Finish);
            }
        })?;
        let mut lap = times.map(CallTimes::lap);
        if !single {
            // Sum the parts' partials (reading every node's memory once), add the residual.
            let merge = |t: usize| {
                // SAFETY: token t's rows of every partial, of residual and of out exist.
                unsafe { chunk.finish_row(parts, t) };
            };
            let qlen = args.qlen;
            if qlen * self.config.hidden <= 1 << 16 {
                (0..qlen).for_each(merge);
            } else {
                pool.parallel_for_all(qlen, &merge)?;
            }
        }
        phase_timing::mark(&mut lap, Phase::Merge);
        Ok(())
    }
}

/// What every part of one chunk shares.
struct Chunk<'a> {
    layer: &'a MoeLayer,
    routing: &'a Routing,
    args: &'a ForwardArgs,
    /// Rows of the chunk's busiest expert.
    max_rows: usize,
    /// Whether the format prepares x / the SwiGLU rows in this chunk.
    prepare_x: bool,
    prepare_act: bool,
    hidden_in: SyncPtr<u8>,
    residual: SyncPtr<u8>,
    out: SyncPtr<u8>,
}

/// One part's view of the chunk: its team, its scratch, its intermediate slice `ip`.
struct PartForward<'a> {
    c: &'a Chunk<'a>,
    part: usize,
    team: &'a Team,
    s: PartPtrs,
    ip: usize,
    /// Prepared bytes per x row and per SwiGLU row (0: none).
    x_stride: usize,
    act_stride: usize,
    /// Whether this chunk prepares x rows, SwiGLU rows, and the latter panel by panel.
    prep_x: bool,
    prep_act: bool,
    act_per_panel: bool,
}

/// Gathered pointers of one block of rows (see [`RowBlock`]).
struct Gathered {
    f32_rows: [*const f32; MAX_ROWS],
    prepared: [*const u8; MAX_ROWS],
    scales: [f32; MAX_ROWS],
}

impl Gathered {
    fn new() -> Gathered {
        Gathered {
            f32_rows: [std::ptr::null(); MAX_ROWS],
            prepared: [std::ptr::null(); MAX_ROWS],
            scales: [0.0; MAX_ROWS],
        }
    }

    fn block(
        &self,
        expert_rows: usize,
        n: usize,
        reuse: u64,
        next: Option<NextPanel>,
        warm: bool,
    ) -> RowBlock<'_> {
        RowBlock {
            reuse: Some(reuse),
            next,
            warm,
            expert_rows,
            f32_rows: &self.f32_rows[..n],
            prepared: &self.prepared[..n],
            scales: &self.scales[..n],
        }
    }
}

impl PartForward<'_> {
    /// 1. Each token's input row to fp32 (a NUMA-local copy per part), prepared by the
    ///    format when it asks.
    ///
    /// # Safety
    /// The chunk's contract ([`MoeLayer::forward_chunk`]).
    unsafe fn gather_x(&self) {
        let (c, s) = (self.c, self.s);
        let experts = &*c.layer.experts;
        let h = c.layer.config.hidden;
        let (xs, prep) = (self.x_stride, self.prep_x);
        let ht = c.args.hidden_type;
        self.team
            .parallel_for_sized(c.args.qlen, c.args.qlen * h, &|t| {
                // SAFETY: row t of the input and of this part's x buffers (tokens × H, tokens ×
                // x_stride, tokens scales) belongs to this task.
                unsafe {
                    let x = std::slice::from_raw_parts_mut(s.x.get().add(t * h), h);
                    row_to_f32(c.hidden_in.get().add(t * h * ht.size()), ht, x);
                    if prep {
                        let out = std::slice::from_raw_parts_mut(s.x_prep.get().add(t * xs), xs);
                        *s.x_scale.get().add(t) = experts.prepare_x(self.part, x, out);
                    }
                }
            });
    }

    /// 2. gate and up for each (expert, 32-row panel of this part's slice), then SwiGLU into
    ///    the expert's rows of `act`. A decode also prepares each expert's SwiGLU rows here
    ///    (returns true), on the thread that finished the expert's last panels, where the
    ///    format prepares whole rows: phase 3 and its barrier then have nothing to do (AMD Zen
    ///    5, one-token MXFP4 decode: that phase took 5-7 µs of 0.26 ms).
    ///
    /// # Safety
    /// The chunk's contract.
    unsafe fn gate_up_swiglu(&self) -> bool {
        let (experts, panels) = (self.c.routing.experts.len(), self.ip / PANEL);
        let reuse = crate::formats::next_reuse_key();
        let max_rows = self.c.max_rows.max(1);
        let layer_experts = &*self.c.layer.experts;
        if max_rows <= layer_experts.block_rows(self.part, max_rows, Stage::GateUp) {
            // Every expert's rows fit one block (decode, small batches): one even share of
            // the (expert, panel) tasks per thread ([`even_share`]), read in runs.
            let threads = self.team.threads();
            let prepare = self.prep_act && !self.act_per_panel;
            // Panels of each expert done, where the rows are prepared here.
            let done: Vec<AtomicUsize> = (0..if prepare { experts } else { 0 })
                .map(|_| AtomicUsize::new(0))
                .collect();
            self.team.parallel_for(threads, &|i| {
                for (ei, own) in even_share(i, threads, experts, panels) {
                    let n = own.len();
                    // SAFETY: the chunk's contract; the shares are disjoint, and a task
                    // writes only its panels' columns of the expert's act rows.
                    unsafe { self.gate_up_task(ei, own, reuse) }
                    // The last panels of the expert done: its rows are complete (the
                    // acquire sees the other threads' panels, each released by its add).
                    if prepare && done[ei].fetch_add(n, Ordering::AcqRel) + n == panels {
                        let routing = self.c.routing;
                        for row in routing.offsets[ei]..routing.offsets[ei + 1] {
                            // SAFETY: every panel of the row is written; the row's prepared
                            // bytes and scale are written by this thread only.
                            unsafe { self.prepare_act_row(row) };
                        }
                    }
                }
            });
            return prepare;
        } else {
            self.team.parallel_for(experts * panels, &|task| {
                // SAFETY: the chunk's contract; task (expert, panel) writes only its panel's
                // columns of the expert's act rows.
                unsafe { self.gate_up_task(task / panels, task % panels..task % panels + 1, reuse) }
            });
        }
        false
    }

    /// Expert `ei`'s rows against gate/up panels `panels`, SwiGLU into those panels' columns
    /// of the rows' `act`: as one run where the rows fit one block of the format
    /// ([`ExpertFormat::gate_up_run`](crate::formats::ExpertFormat::gate_up_run)), else panel
    /// by panel in blocks that find the panel in cache after the first. `reuse` names this
    /// phase's x rows ([`RowBlock::reuse`]), so the kernels may keep what they made of a
    /// block's rows for the expert's next panels.
    ///
    /// # Safety
    /// The chunk's contract; no other task writes these panels of expert `ei`'s act rows.
    unsafe fn gate_up_task(&self, ei: usize, panels: Range<usize>, reuse: u64) {
        let (layer, routing) = (self.c.layer, self.c.routing);
        let rows = routing.offsets[ei]..routing.offsets[ei + 1];
        let block = layer
            .experts
            .block_rows(self.part, rows.len(), Stage::GateUp);
        let mut scratch = PanelScratch::take();
        let nr = rows.len();
        if nr <= block {
            let PanelScratch { acc, g, u, a } = &mut *scratch;
            let mut gathered = Gathered::new();
            // SAFETY: the expert's rows, at most one block; the chunk's contract.
            unsafe { self.gather_x_rows(&mut gathered, rows.clone()) };
            let rb = gathered.block(nr, nr, reuse, None, false);
            let m = nr.max(1) * PANEL;
            let cfg = &layer.config;
            let (limit, alpha) = (cfg.swiglu_limit, cfg.swiglu_alpha);
            // Runs as long as the scratch holds (MAX_ROWS·32 values per buffer).
            let run = MAX_ROWS / nr.max(1);
            for first in panels.clone().step_by(run) {
                let own = first..(first + run).min(panels.end);
                let n = own.len();
                let at = PanelAt {
                    part: self.part,
                    slot: routing.experts[ei] as usize,
                    panel: first,
                };
                // SAFETY: as in `gate_up_panel_task` for each panel of the run; g and u hold
                // MAX_ROWS·32 ≥ n·m values.
                unsafe { layer.experts.gate_up_run(at, n, &rb, acc, g, u) };
                let (g, u, a) = (&g[..n * m], &u[..n * m], &mut a[..n * m]);
                layer.kernels.swiglu(g, u, a, limit, alpha);
                for (p, vals) in own.zip(a.chunks_exact(m)) {
                    // SAFETY: this task owns panel p of these rows (the caller's contract).
                    unsafe { self.store_act(rows.clone(), p, nr, vals) };
                }
            }
        } else {
            for p in panels {
                // SAFETY: forwarded.
                unsafe { self.gate_up_panel_task(ei, p, block, reuse, &mut scratch) };
            }
        }
        PanelScratch::give_back(scratch);
    }

    /// Expert `ei`'s rows against gate/up panel `p` in blocks of `block` rows (see
    /// [`PartForward::gate_up_task`]).
    ///
    /// # Safety
    /// As [`PartForward::gate_up_task`] for the one panel.
    unsafe fn gate_up_panel_task(
        &self,
        ei: usize,
        p: usize,
        block: usize,
        reuse: u64,
        scratch: &mut PanelScratch,
    ) {
        let (layer, routing) = (self.c.layer, self.c.routing);
        let rows = routing.offsets[ei]..routing.offsets[ei + 1];
        let at = PanelAt {
            part: self.part,
            slot: routing.experts[ei] as usize,
            panel: p,
        };
        let PanelScratch { acc, g, u, a } = scratch;
        let mut gathered = Gathered::new();
        // The next task of this thread is most often the next one (tasks are handed out in
        // runs): the expert's next panel, or the next expert's first.
        let panels = self.ip / PANEL;
        let next_at = if p + 1 < panels {
            Some(PanelAt { panel: p + 1, ..at })
        } else {
            routing.experts.get(ei + 1).map(|&slot| PanelAt {
                slot: slot as usize,
                panel: 0,
                ..at
            })
        };
        let blocks = rows.len().div_ceil(block);
        let mut r0 = rows.start;
        while r0 < rows.end {
            let nr = block.min(rows.end - r0);
            // SAFETY: rows r0..r0+nr are this chunk's; the chunk's contract.
            unsafe { self.gather_x_rows(&mut gathered, r0..r0 + nr) };
            let bi = (r0 - rows.start) / block;
            let next = next_at.filter(|_| bi > 0).map(|at| NextPanel {
                at,
                slice: bi - 1,
                slices: blocks - 1,
            });
            let rb = gathered.block(rows.len(), nr, reuse, next, blocks > 1);
            // SAFETY: rows gathered above: nr ≤ the format's block, x rows of H values,
            // prepared rows of x_stride bytes when prep_x (the chunk's contract covers the
            // workspace), which no task writes in this phase; g and u hold MAX_ROWS·32.
            unsafe { layer.experts.gate_up_panel(at, &rb, acc, g, u) };
            let m = nr * PANEL;
            let cfg = &layer.config;
            let (limit, alpha) = (cfg.swiglu_limit, cfg.swiglu_alpha);
            layer
                .kernels
                .swiglu(&g[..m], &u[..m], &mut a[..m], limit, alpha);
            // SAFETY: this task owns panel p of these rows (the caller's contract).
            unsafe { self.store_act(r0..r0 + nr, p, rows.len(), &a[..m]) };
            r0 += nr;
        }
    }

    /// The x rows of routed rows `rows` (their tokens' fp32 rows, prepared rows and scales).
    ///
    /// # Safety
    /// The chunk's contract; `rows` are routed rows of this chunk, at most [`MAX_ROWS`].
    unsafe fn gather_x_rows(&self, at: &mut Gathered, rows: Range<usize>) {
        let (s, h, xs) = (self.s, self.c.layer.config.hidden, self.x_stride);
        for (i, r) in rows.enumerate() {
            let t = self.c.routing.row_token[r] as usize;
            // SAFETY: token t < qlen: a row of x, of x_prep (wrapping: dangling when the
            // format prepares none, and then never read) and a scale.
            unsafe {
                at.f32_rows[i] = s.x.get().add(t * h);
                at.prepared[i] = s.x_prep.get().wrapping_add(t * xs);
                at.scales[i] = if self.prep_x {
                    *s.x_scale.get().add(t)
                } else {
                    1.0
                };
            }
        }
    }

    /// Store SwiGLU values `vals` (32 per row) as panel `p` of act rows `rows`, prepared per
    /// panel too where the format does that.
    ///
    /// # Safety
    /// The chunk's contract; the calling task owns panel `p` of these rows.
    unsafe fn store_act(&self, rows: Range<usize>, p: usize, expert_rows: usize, vals: &[f32]) {
        let (s, ip) = (self.s, self.ip);
        // Element-wise SwiGLU preparation happens here, while the values are hot.
        let panel_bytes = if self.act_per_panel {
            self.act_stride / ip * PANEL
        } else {
            0
        };
        for (row, v) in rows.zip(vals.chunks_exact(PANEL)) {
            // SAFETY: row `row` of act (rows × ip), columns of panel p, and the same panel's
            // bytes of its prepared row: this task's.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    v.as_ptr(),
                    s.act.get().add(row * ip + p * PANEL),
                    PANEL,
                );
                if panel_bytes > 0 {
                    let dst = std::slice::from_raw_parts_mut(
                        s.act_prep
                            .get()
                            .add(row * self.act_stride + p * panel_bytes),
                        panel_bytes,
                    );
                    let experts = &*self.c.layer.experts;
                    experts.prepare_act_panel(self.part, expert_rows, v, dst);
                }
            }
        }
    }

    /// 3. Each SwiGLU row prepared by the format (a phase of its own: a row's scale spans
    ///    every panel).
    ///
    /// # Safety
    /// The chunk's contract.
    unsafe fn prepare_act(&self) {
        let rows = self.c.routing.rows();
        self.team.parallel_for_sized(rows, rows * self.ip, &|row| {
            // SAFETY: row `row` of act, act_prep and act_scale belongs to this task.
            unsafe { self.prepare_act_row(row) }
        });
    }

    /// SwiGLU row `row` prepared by the format, with its scale.
    ///
    /// # Safety
    /// The chunk's contract; the row's act values are complete, and no other thread reads
    /// or writes its prepared bytes and scale meanwhile.
    unsafe fn prepare_act_row(&self, row: usize) {
        let (s, ip, stride) = (self.s, self.ip, self.act_stride);
        let experts = &*self.c.layer.experts;
        // SAFETY: row `row` of act, act_prep and act_scale exist (the caller's contract).
        unsafe {
            let src = std::slice::from_raw_parts(s.act.get().add(row * ip), ip);
            let dst = std::slice::from_raw_parts_mut(s.act_prep.get().add(row * stride), stride);
            *s.act_scale.get().add(row) = experts.prepare_act(self.part, src, dst);
        }
    }

    /// Expert `ei`'s rows against a range of down panels; each row's values go to `sink` as
    /// (row, first panel, 32 values per panel of consecutive panels), after `before_block`
    /// saw the block's rows for each of those panels.
    ///
    /// # Safety
    /// The chunk's contract; the act rows are complete (phases 2 and 3 ran).
    unsafe fn down_panels(
        &self,
        ei: usize,
        panels: Range<usize>,
        before_block: &dyn Fn(Range<usize>, usize),
        sink: &mut dyn FnMut(usize, usize, &[f32]),
        reuse: u64,
    ) {
        let c = self.c;
        let (experts, routing) = (&*c.layer.experts, c.routing);
        // Per-row scales exist only where whole rows were prepared.
        let scaled = self.prep_act && !self.act_per_panel;
        let slot = routing.experts[ei] as usize;
        let rows = routing.offsets[ei]..routing.offsets[ei + 1];
        let block = experts.block_rows(self.part, rows.len(), Stage::Down);
        let mut scratch = PanelScratch::take();
        let PanelScratch { acc, g: o, .. } = &mut *scratch;
        let mut at = Gathered::new();
        let blocks = rows.len().div_ceil(block);
        if blocks == 1 {
            // One block of rows (a decode): runs of panels in one format call each, the rows
            // gathered once (AMD Zen 5, one-token S1 decode, AMXINT8: 0.435-0.438 ms panel by
            // panel, 0.418-0.419 in runs; the per-panel steps cost 13-17 µs a call).
            let nr = rows.len();
            for (i, r) in rows.clone().enumerate() {
                // SAFETY: act row r exists (rows ≤ capacity).
                unsafe { self.gather_act_row(&mut at, i, r, scaled) };
            }
            let row_block = at.block(nr, nr, reuse, None, false);
            let (m, run) = (nr.max(1) * PANEL, MAX_ROWS / nr.max(1));
            for first in panels.clone().step_by(run) {
                let own = first..(first + run).min(panels.end);
                own.clone().for_each(|p| before_block(rows.clone(), p));
                let panel = PanelAt {
                    part: self.part,
                    slot,
                    panel: first,
                };
                // SAFETY: the rows gathered above (one block: at most the format's block),
                // complete SwiGLU rows of ip values, prepared rows of act_stride bytes when
                // prep_act; each panel of the run exists; `o` holds MAX_ROWS·32 ≥ own.len()·m
                // values.
                unsafe { experts.down_run(panel, own.len(), &row_block, acc, o) };
                if nr == 1 {
                    // One row: the run's values lie in column order already.
                    sink(rows.start, first, &o[..own.len() * PANEL]);
                } else {
                    for (j, p) in own.enumerate() {
                        for i in 0..nr {
                            sink(rows.start + i, p, &o[j * m + i * PANEL..][..PANEL]);
                        }
                    }
                }
            }
            PanelScratch::give_back(scratch);
            return;
        }
        for p in panels.clone() {
            // As in gate/up: the later blocks bring in the panel this task takes next.
            let next_at = if p + 1 < panels.end {
                Some(PanelAt {
                    part: self.part,
                    slot,
                    panel: p + 1,
                })
            } else {
                routing.experts.get(ei + 1).map(|&s| PanelAt {
                    part: self.part,
                    slot: s as usize,
                    panel: panels.start,
                })
            };
            let mut r0 = rows.start;
            while r0 < rows.end {
                let nr = block.min(rows.end - r0);
                let bi = (r0 - rows.start) / block;
                let next = next_at.filter(|_| bi > 0).map(|at| NextPanel {
                    at,
                    slice: bi - 1,
                    slices: blocks - 1,
                });
                before_block(r0..r0 + nr, p);
                for (i, r) in (r0..r0 + nr).enumerate() {
                    // SAFETY: act row r exists (rows ≤ capacity).
                    unsafe { self.gather_act_row(&mut at, i, r, scaled) };
                }
                let panel = PanelAt {
                    part: self.part,
                    slot,
                    panel: p,
                };
                let row_block = at.block(rows.len(), nr, reuse, next, blocks > 1);
                // SAFETY: rows gathered above: nr ≤ the format's block, complete SwiGLU rows
                // of ip values, prepared rows of act_stride bytes when prep_act; `o` holds
                // MAX_ROWS·32.
                unsafe { experts.down_panel(panel, &row_block, acc, o) };
                for i in 0..nr {
                    sink(r0 + i, p, &o[i * PANEL..(i + 1) * PANEL]);
                }
                r0 += nr;
            }
        }
        PanelScratch::give_back(scratch);
    }

    /// Entry `i` of `at`: SwiGLU row `r`, its prepared row (dangling where none is made) and
    /// its scale (1 unless whole rows were prepared with scales: `scaled`).
    ///
    /// # Safety
    /// Row `r` is a routed row of this chunk.
    unsafe fn gather_act_row(&self, at: &mut Gathered, i: usize, r: usize, scaled: bool) {
        let s = self.s;
        // SAFETY: act row r exists (rows ≤ capacity); act_prep wraps when unused.
        unsafe {
            at.f32_rows[i] = s.act.get().add(r * self.ip);
            at.prepared[i] = s.act_prep.get().wrapping_add(r * self.act_stride);
            at.scales[i] = if scaled {
                *s.act_scale.get().add(r)
            } else {
                1.0
            };
        }
    }

    /// 4. down, times the router weight, summed over experts into the part's partial output.
    ///
    /// # Safety
    /// The chunk's contract; the act rows are complete.
    unsafe fn down_reduce(&self) {
        let c = self.c;
        let (h, total_rows) = (c.layer.config.hidden, c.routing.rows());
        let (out_panels, threads) = (h / PANEL, self.team.threads());
        // One block of columns per thread, for a prefill too: AMD Zen 5, two threads, S1
        // layer, 512 tokens (`prefill` example, two alternated runs each), the down phase in ms
        // with four blocks per thread -> one: AMXINT8 9.95 -> 8.51, AMXINT4 9.4 / 8.3 -> 8.0 /
        // 8.2, RAWINT4 13.3 -> 11.8, MXFP4 19.8 -> 18.0, BF16 17.3 -> 15.5 (each thread reads
        // an expert's SwiGLU rows once, and its weights in stretches of 32 panels, not 8).
        // (Not measured on more threads, where the blocks no longer balance a slow thread.)
        // SAFETY: forwarded.
        unsafe {
            if total_rows * h > c.layer.rowwise_down_max
                || out_panels >= threads * DECODE_SHARE_PANELS
            {
                self.down_column_blocks(threads);
            } else {
                self.down_rowwise();
            }
        }
    }

    /// Zero columns `cols` of every token's partial row.
    ///
    /// # Safety
    /// The calling task owns these columns.
    unsafe fn zero_columns(&self, cols: Range<usize>) {
        let h = self.c.layer.config.hidden;
        for t in 0..self.c.args.qlen {
            // SAFETY: columns `cols` of token t's partial row (tokens × H), the task's.
            unsafe {
                std::ptr::write_bytes(self.s.partial.get().add(t * h + cols.start), 0, cols.len())
            };
        }
    }

    /// Few rows (decode) on many threads for the layer's width ([`DECODE_SHARE_PANELS`]):
    /// each thread takes an even share of the (expert, panel) tasks ([`even_share`]), so it
    /// streams one long stretch of the experts' down matrices (runs of a whole expert's 64
    /// panels took AMXINT4's down phase from 101 to 85 µs against runs of 4: one token, two
    /// threads, AMD Zen 5); weighted rows go to `down_rows`, then a column-parallel pass sums
    /// them per token.
    ///
    /// # Safety
    /// As [`PartForward::down_reduce`].
    unsafe fn down_rowwise(&self) {
        let (c, s) = (self.c, self.s);
        let routing = c.routing;
        let h = c.layer.config.hidden;
        let out_panels = h / PANEL;
        let (threads, experts) = (self.team.threads(), routing.experts.len());
        let reuse = crate::formats::next_reuse_key();
        self.team.parallel_for(threads, &|i| {
            for (ei, panels) in even_share(i, threads, experts, out_panels) {
                let mut sink = |row: usize, p: usize, vals: &[f32]| {
                    let w = routing.row_weight[row];
                    // SAFETY: (row, panels p..) of down_rows are written by this task only.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(
                            s.down_rows.get().add(row * h + p * PANEL),
                            vals.len(),
                        )
                    };
                    for (d, v) in dst.iter_mut().zip(vals) {
                        *d = w * v;
                    }
                };
                // SAFETY: forwarded.
                unsafe { self.down_panels(ei, panels, &|_, _| {}, &mut sink, reuse) };
            }
        });
        let group = DOWN_GROUP_PANELS.min(out_panels);
        let values = routing.rows() * h;
        self.team
            .parallel_for_sized(out_panels.div_ceil(group), values, &|g| {
                let cols = g * group * PANEL..((g + 1) * group).min(out_panels) * PANEL;
                // SAFETY: this task owns columns `cols` of every partial row.
                unsafe { self.zero_columns(cols.clone()) };
                for row in 0..routing.rows() {
                    let t = routing.row_token[row] as usize;
                    // SAFETY: columns `cols` of token t's partial row belong to this task; rows of
                    // down_rows were completed by the phase above.
                    unsafe {
                        let dst = std::slice::from_raw_parts_mut(
                            s.partial.get().add(t * h + cols.start),
                            cols.len(),
                        );
                        let src = std::slice::from_raw_parts(
                            s.down_rows.get().add(row * h + cols.start),
                            cols.len(),
                        );
                        for (d, v) in dst.iter_mut().zip(src) {
                            *d += v;
                        }
                    }
                }
            });
    }

    /// Tasks own column blocks of the output (about `tasks` of them: one per thread), so the
    /// weighted sum over experts accumulates without races; experts go outer so each
    /// expert's act rows stay in cache across the block's panels.
    ///
    /// # Safety
    /// As [`PartForward::down_reduce`].
    unsafe fn down_column_blocks(&self, tasks: usize) {
        let (c, s) = (self.c, self.s);
        let routing = c.routing;
        let h = c.layer.config.hidden;
        let out_panels = h / PANEL;
        let per_task = out_panels.div_ceil(tasks.max(1)).max(1);
        let n_tasks = out_panels.div_ceil(per_task);
        let reuse = crate::formats::next_reuse_key();
        self.team.parallel_for(n_tasks, &|task| {
            let panels = task * per_task..((task + 1) * per_task).min(out_panels);
            // SAFETY: this task owns the block's columns of every partial row.
            unsafe { self.zero_columns(panels.start * PANEL..panels.end * PANEL) };
            // The sink adds to partial rows scattered by token: fetch a block's lines while
            // its kernel runs, or every add stalls on a cache miss.
            let fetch_partials = |rows: Range<usize>, p: usize| {
                for row in rows {
                    let t = routing.row_token[row] as usize;
                    crate::kernels::prefetch::lines(
                        s.partial.get().wrapping_add(t * h + p * PANEL) as *const u8,
                        PANEL * std::mem::size_of::<f32>(),
                    );
                }
            };
            let mut sink = |row: usize, p: usize, vals: &[f32]| {
                let t = routing.row_token[row] as usize;
                let w = routing.row_weight[row];
                // SAFETY: columns of panels p.. in token t's partial row: this task's.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(
                        s.partial.get().add(t * h + p * PANEL),
                        vals.len(),
                    )
                };
                for (d, v) in dst.iter_mut().zip(vals) {
                    *d += w * v;
                }
            };
            let n_experts = routing.experts.len();
            for ei in 0..n_experts {
                // Before each panel of this expert, a slice of the next one's SwiGLU rows
                // (the last phase wrote them on either core) and of its first panel's
                // weights: a task covers only a few panels of each expert, and the kernels
                // met both cold at every switch. AMD Zen 4, 512 tokens, kernel time per GFLOP
                // of down over that of gate/up: LLAMAFILE Q8_0 1.16-1.22 -> 1.10-1.12 (rows)
                // -> 1.05-1.08 (and weights); RAWINT4 1.10-1.15 -> 1.07-1.10.
                let first_row = routing.offsets[ei];
                let next_rows = routing.offsets[(ei + 1).min(n_experts)]
                    ..routing.offsets[(ei + 2).min(n_experts)];
                // The weights where the format says where they lie.
                let next_weights = routing.experts.get(ei + 1).and_then(|&slot| {
                    let at = PanelAt {
                        part: self.part,
                        slot: slot as usize,
                        panel: panels.start,
                    };
                    c.layer.experts.down_panel_bytes(at)
                });
                let before_block = |rows: Range<usize>, p: usize| {
                    if rows.start == first_row {
                        let (i, n) = (p - panels.start, panels.len());
                        self.prefetch_act_slice(next_rows.clone(), i, n);
                        if let Some((start, bytes)) = next_weights {
                            crate::kernels::prefetch::slice_into_l2(start, bytes, i, n);
                        }
                    }
                    fetch_partials(rows, p);
                };
                // SAFETY: forwarded.
                unsafe { self.down_panels(ei, panels.clone(), &before_block, &mut sink, reuse) };
            }
        });
    }

    /// Prefetch into L2 slice `i` of `n` of the bytes the down kernels read of SwiGLU rows
    /// `rows`: their prepared rows where the format prepares them, else their fp32 rows.
    fn prefetch_act_slice(&self, rows: Range<usize>, i: usize, n: usize) {
        let s = self.s;
        let (base, row_bytes) = if self.prep_act {
            (s.act_prep.get() as *const u8, self.act_stride)
        } else {
            (
                s.act.get() as *const u8,
                self.ip * std::mem::size_of::<f32>(),
            )
        };
        let start = base.wrapping_add(rows.start * row_bytes);
        crate::kernels::prefetch::slice_into_l2(start, rows.len() * row_bytes, i, n);
    }

    /// 5. With one part, finish here: add the residual, convert to the output type.
    ///
    /// # Safety
    /// The chunk's contract; the partial output is complete.
    unsafe fn finish(&self) {
        let parts = [self.s];
        let (qlen, h) = (self.c.args.qlen, self.c.layer.config.hidden);
        self.team.parallel_for_sized(qlen, qlen * h, &|t| {
            // SAFETY: token t's rows of partial, residual and out belong to this task.
            unsafe { self.c.finish_row(&parts, t) };
        });
    }
}

impl Chunk<'_> {
    /// out[t] = Σ over parts of partial[t] + residual[t], converted to the output type.
    ///
    /// # Safety
    /// Each part's partial buffer has row `t` of `H` floats; `out`/`residual` rows `t` exist,
    /// and no one else writes row `t` of `out` meanwhile. `residual` may be `out` (same type):
    /// each strip is read into `res` before the same strip of `out` is written.
    unsafe fn finish_row(&self, parts: &[PartPtrs], t: usize) {
        const STRIP: usize = 256;
        let (args, h) = (self.args, self.layer.config.hidden);
        let mut acc = [0f32; STRIP];
        let mut res = [0f32; STRIP];
        let mut c0 = 0;
        while c0 < h {
            let n = STRIP.min(h - c0);
            // SAFETY: per the contract, all reads/writes are inside row t.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    parts[0].partial.get().add(t * h + c0),
                    acc.as_mut_ptr(),
                    n,
                );
                for p in &parts[1..] {
                    let r = p.partial.get().add(t * h + c0);
                    for (a, i) in acc[..n].iter_mut().zip(0..n) {
                        *a += *r.add(i);
                    }
                }
                if !self.residual.is_null() {
                    let rt = args.residual_type;
                    let src = self.residual.get().add((t * h + c0) * rt.size());
                    row_to_f32(src, rt, &mut res[..n]);
                    for (a, r) in acc[..n].iter_mut().zip(&res[..n]) {
                        *a += r;
                    }
                }
                let dst = self.out.get().add((t * h + c0) * args.out_type.size());
                row_from_f32(&acc[..n], dst, args.out_type);
            }
            c0 += n;
        }
    }
}

/// One thread's panel buffers (integer products, gate, up, activation of up to [`MAX_ROWS`]
/// rows). The kernels overwrite the rows they are given, so the buffers are zeroed once per
/// thread rather than once per task: a decode task streams about 64 KiB of weights, and
/// clearing 16 KiB of stack arrays each time cost several percent of it.
struct PanelScratch {
    acc: PanelAcc,
    g: [f32; MAX_ROWS * PANEL],
    u: [f32; MAX_ROWS * PANEL],
    a: [f32; MAX_ROWS * PANEL],
}

thread_local! {
    static PANEL_SCRATCH: std::cell::Cell<Option<Box<PanelScratch>>> =
        const { std::cell::Cell::new(None) };
}

impl PanelScratch {
    /// This thread's buffers (new ones if they are out, e.g. a task inside a task).
    fn take() -> Box<PanelScratch> {
        PANEL_SCRATCH.take().unwrap_or_else(|| {
            Box::new(PanelScratch {
                acc: PanelAcc {
                    acc: [0; MAX_ROWS * PANEL],
                },
                g: [0.0; MAX_ROWS * PANEL],
                u: [0.0; MAX_ROWS * PANEL],
                a: [0.0; MAX_ROWS * PANEL],
            })
        })
    }

    fn give_back(scratch: Box<PanelScratch>) {
        PANEL_SCRATCH.set(Some(scratch));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_shares_cover_every_task_once_cut_at_experts() {
        let share = |i, t, e, p| even_share(i, t, e, p).collect::<Vec<_>>();
        // Two threads, eight experts of 24 panels: four experts each.
        assert_eq!(
            share(1, 2, 8, 24),
            (4..8).map(|e| (e, 0..24)).collect::<Vec<_>>()
        );
        // Three threads over two experts of 24: 16 tasks each, the middle share cut.
        assert_eq!(share(0, 3, 2, 24), vec![(0, 0..16)]);
        assert_eq!(share(1, 3, 2, 24), vec![(0, 16..24), (1, 0..8)]);
        assert_eq!(share(2, 3, 2, 24), vec![(1, 8..24)]);
        // More threads than tasks: empty shares.
        assert_eq!(share(0, 4, 1, 2), vec![]);
        for (experts, panels) in [(1, 1), (3, 5), (8, 24), (33, 64)] {
            for threads in [1, 2, 3, 16, 100] {
                let flat: Vec<usize> = (0..threads)
                    .flat_map(|i| share(i, threads, experts, panels))
                    .flat_map(|(e, ps)| ps.map(move |p| e * panels + p))
                    .collect();
                assert_eq!(flat, (0..experts * panels).collect::<Vec<_>>());
            }
        }
    }
}
