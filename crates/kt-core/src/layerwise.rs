//! Layerwise prefill's expert transport (the original's `FP8LayerwiseTransport`).
//!
//! For a long prompt the serving engine runs a whole MoE layer on its GPUs, so the experts
//! that live on the CPU are streamed to every GPU tensor-parallel rank, one layer at a time.
//! Rank zero's process owns the CPU experts: its *producer* writes expert `e` of the layer
//! into host slot `e % 2` of every rank (the bytes of `write_weight_scale_to_buffer`), while
//! each rank's *consumer* thread copies the expert it last received from its own host slot to
//! its GPU buffer at expert offset `e` (host to device). Two slots let writing expert `e + 1`
//! overlap the copies of expert `e`.
//!
//! The ranks are separate processes. They meet in a *control block*: at least
//! [`CONTROL_BYTES`] of memory every rank maps (64-byte aligned, made once by
//! [`initialize_control`]), holding only atomics:
//! - rank zero publishes the layer (`epoch`, `layer_id`, `expert_count`) and counts the experts
//!   written (`generation`);
//! - each rank records the epoch it joined, how many experts it has copied, and the last
//!   epoch it returned from;
//! - any participant that fails *poisons* the block (code, rank, message), so every other
//!   one stops with that error instead of waiting out its timeout.
//!
//! Every wait polls with back-off and gives up after `timeout_ms` without progress. Epochs
//! start at 1 and only grow. The GPU copies use the CUDA driver found at run time
//! ([`crate::cuda_bridge::symbol`]); with `cuda_device < 0` the destinations are host memory
//! and the copies are `memcpy` (CPU-only machines, tests).
use crate::formats::GpuRankDst;
use crate::{kt_bail, kt_ensure, Error, Result};
use std::ffi::c_void;
use std::sync::atomic::{AtomicI32, AtomicI64, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Bytes a control block needs.
pub const CONTROL_BYTES: usize = 8192;
/// The most tensor-parallel ranks a block serves.
pub const MAX_TP_SIZE: usize = 8;
/// Host slots per rank.
pub const SLOTS: usize = 2;
/// Buffers per expert: w13 weight, w13 scale, w2 weight, w2 scale.
pub const KINDS: usize = 4;

const MAGIC: u64 = u64::from_le_bytes(*b"KTLWFP8\0");
const ABI_VERSION: u64 = 1;
const MESSAGE_BYTES: usize = 240;

/// Poison codes.
const POISON_TIMEOUT: i32 = 1;
const POISON_WRITER: i32 = 2;
const POISON_COPY: i32 = 3;
const POISON_MISMATCH: i32 = 4;

/// What one rank publishes.
#[repr(C, align(64))]
struct RankState {
    joined_epoch: AtomicU64,
    joined_layer: AtomicI64,
    joined_count: AtomicU64,
    /// Experts this rank has copied to its GPU in `joined_epoch`.
    consumed: AtomicU64,
    /// The last epoch this rank's `wait` returned from (its host slots are free again).
    returned_epoch: AtomicU64,
}

/// The shared control block.
#[repr(C, align(64))]
struct Control {
    magic: AtomicU64,
    abi: AtomicU64,
    tp_size: AtomicU64,
    _header: [u64; 5],
    epoch: AtomicU64,
    layer_id: AtomicI64,
    expert_count: AtomicU64,
    /// Experts rank zero has written in `epoch`.
    generation: AtomicU64,
    _publication: [u64; 4],
    /// 0: none, 1: being written, 2: published.
    poison_state: AtomicU32,
    poison_code: AtomicI32,
    poison_rank: AtomicI32,
    poison_len: AtomicU32,
    poison_message: [AtomicU8; MESSAGE_BYTES],
    ranks: [RankState; MAX_TP_SIZE],
}

const _: () = assert!(std::mem::size_of::<Control>() <= CONTROL_BYTES);

/// The block at `ptr`, checked for null, alignment and size.
///
/// # Safety
/// `ptr` points to `size` bytes of memory that stays mapped while the reference is used;
/// every other user of the bytes goes through this module's atomics.
unsafe fn control_at(ptr: usize, size: usize) -> Result<&'static Control> {
    kt_ensure!(ptr != 0, Invalid, "FP8 layerwise control pointer is null");
    kt_ensure!(
        ptr.is_multiple_of(64),
        Invalid,
        "FP8 layerwise control pointer must be 64-byte aligned"
    );
    kt_ensure!(
        size >= CONTROL_BYTES,
        Invalid,
        "FP8 layerwise control region must be at least {CONTROL_BYTES} bytes"
    );
    // SAFETY: the contract; all-atomic fields accept any bit pattern.
    Ok(unsafe { &*(ptr as *const Control) })
}

fn check_tp(tp_size: usize) -> Result<()> {
    kt_ensure!(
        (1..=MAX_TP_SIZE).contains(&tp_size),
        Invalid,
        "FP8 layerwise transport supports TP sizes 1 through {MAX_TP_SIZE}, got {tp_size}"
    );
    Ok(())
}

/// Make a fresh control block for `tp_size` ranks (once, before any rank opens a transport).
///
/// # Safety
/// As [`control_at`]; no transport uses the block while it is initialized.
pub unsafe fn initialize_control(ptr: usize, size: usize, tp_size: usize) -> Result<()> {
    // SAFETY: forwarded.
    let c = unsafe { control_at(ptr, size)? };
    check_tp(tp_size)?;
    // SAFETY: `size` bytes at `ptr` are ours to clear (the contract).
    unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, size) };
    c.tp_size.store(tp_size as u64, Ordering::Relaxed);
    c.abi.store(ABI_VERSION, Ordering::Relaxed);
    c.magic.store(MAGIC, Ordering::Release);
    Ok(())
}

/// Where one rank's buffers are.
#[derive(Debug, Clone)]
pub struct TransportConfig {
    /// This rank.
    pub rank: usize,
    /// Ranks in all.
    pub tp_size: usize,
    /// CUDA device ordinal of this rank's GPU; negative: destinations are host memory.
    pub cuda_device: i32,
    /// This rank's host slots, `[slot][kind]`.
    pub local_host: [[usize; KINDS]; SLOTS],
    /// This rank's GPU buffers (expert `e` at `e · expert_nbytes[kind]`), per kind.
    pub local_gpu: [usize; KINDS],
    /// Rank zero only: every rank's host slots, `[slot][rank][kind]` (empty elsewhere).
    pub all_rank_host: Vec<Vec<[usize; KINDS]>>,
    /// Bytes of one expert per kind.
    pub expert_nbytes: [usize; KINDS],
    /// Experts the GPU buffers hold.
    pub num_experts: usize,
    /// Give up after this long without progress.
    pub timeout: Duration,
}

/// Figures of one layer, as `wait` returns them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerStats {
    /// The layer's epoch.
    pub epoch: u64,
    /// Its layer id.
    pub layer_id: i64,
    /// Experts moved.
    pub expert_count: u64,
    /// Rank zero: time spent writing experts into the host slots.
    pub writer_ms: f64,
    /// Rank zero: time spent waiting for ranks to free a slot.
    pub slot_wait_ms: f64,
    /// Time this rank's copies to the GPU took.
    pub h2d_ms: f64,
    /// From joining to the last copy.
    pub total_ms: f64,
}

/// The consumer thread's mailbox.
#[derive(Default)]
struct Mailbox {
    /// A layer to copy: (epoch, expert count).
    job: Option<(u64, u64)>,
    /// The finished layer's figures (or error), by epoch.
    done: Option<(u64, std::result::Result<LayerStats, Error>)>,
    stop: bool,
}

struct Shared {
    control: &'static Control,
    config: TransportConfig,
    mailbox: Mutex<Mailbox>,
    signal: Condvar,
}

/// One rank's end of the transport (see the module docs).
pub struct Transport {
    shared: Arc<Shared>,
    consumer: Mutex<Option<std::thread::JoinHandle<()>>>,
    joined: Mutex<Option<(u64, i64, u64, Instant)>>,
}

impl Transport {
    /// Open rank `config.rank`'s end on the control block at `control_ptr` and start its
    /// consumer thread (which binds the CUDA device first, when there is one).
    ///
    /// # Safety
    /// As [`initialize_control`] for the block (initialized, mapped for the transport's life);
    /// every address in `config` points to a buffer of the documented size that stays
    /// allocated while the transport is open, and the GPU addresses belong to
    /// `config.cuda_device` (host memory when it is negative).
    pub unsafe fn open(
        control_ptr: usize,
        control_size: usize,
        config: TransportConfig,
    ) -> Result<Self> {
        // SAFETY: forwarded.
        let control = unsafe { control_at(control_ptr, control_size)? };
        check_tp(config.tp_size)?;
        kt_ensure!(
            control.magic.load(Ordering::Acquire) == MAGIC
                && control.abi.load(Ordering::Relaxed) == ABI_VERSION,
            Invalid,
            "FP8 layerwise control is uninitialized or has an incompatible ABI \
             (call initialize_fp8_layerwise_control first)"
        );
        kt_ensure!(
            control.tp_size.load(Ordering::Relaxed) == config.tp_size as u64,
            Invalid,
            "FP8 layerwise control TP size {} does not match transport TP size {}",
            control.tp_size.load(Ordering::Relaxed),
            config.tp_size
        );
        kt_ensure!(
            config.rank < config.tp_size,
            Invalid,
            "FP8 layerwise rank {} is outside TP range 0..{}",
            config.rank,
            config.tp_size
        );
        kt_ensure!(
            config.num_experts > 0,
            Invalid,
            "FP8 layerwise num_experts must be positive"
        );
        kt_ensure!(
            !config.timeout.is_zero(),
            Invalid,
            "FP8 layerwise timeout_ms must be positive"
        );
        let all_ok = if config.rank == 0 {
            config.all_rank_host.len() == SLOTS
                && config
                    .all_rank_host
                    .iter()
                    .all(|s| s.len() == config.tp_size)
        } else {
            config.all_rank_host.is_empty()
        };
        kt_ensure!(
            all_ok,
            Invalid,
            "FP8 layerwise all_rank_host_ptrs must be [slot][rank][kind] ({SLOTS} x {} x \
             {KINDS}) on rank zero and empty on other ranks",
            config.tp_size
        );
        let nonzero = config.local_host.iter().flatten().all(|&p| p != 0)
            && config.local_gpu.iter().all(|&p| p != 0)
            && config.expert_nbytes.iter().all(|&n| n != 0)
            && config
                .all_rank_host
                .iter()
                .flatten()
                .flatten()
                .all(|&p| p != 0);
        kt_ensure!(
            nonzero,
            Invalid,
            "FP8 layerwise buffer pointers and expert byte sizes must be non-zero"
        );
        for (k, (&base, &n)) in config
            .local_gpu
            .iter()
            .zip(&config.expert_nbytes)
            .enumerate()
        {
            kt_ensure!(
                n.checked_mul(config.num_experts)
                    .and_then(|b| base.checked_add(b))
                    .is_some(),
                Invalid,
                "FP8 layerwise GPU expert offset overflows uintptr_t (kind {k})"
            );
        }
        let copier = Copier::new(config.cuda_device)?;
        let shared = Arc::new(Shared {
            control,
            config,
            mailbox: Mutex::new(Mailbox::default()),
            signal: Condvar::new(),
        });
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let worker = shared.clone();
        let consumer = std::thread::Builder::new()
            .name(format!("kt-layerwise-h2d-{}", worker.config.rank))
            .spawn(move || consumer_loop(worker, copier, ready_tx))
            .map_err(|e| Error::Runtime(format!("cannot start the H2D consumer thread: {e}")))?;
        let started = ready_rx.recv().unwrap_or_else(|_| {
            Err(Error::Runtime(
                "the H2D consumer thread died while starting".into(),
            ))
        });
        let t = Transport {
            shared,
            consumer: Mutex::new(Some(consumer)),
            joined: Mutex::new(None),
        };
        started?;
        Ok(t)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.shared.config.rank
    }

    /// Ranks in all.
    pub fn tp_size(&self) -> usize {
        self.shared.config.tp_size
    }

    /// Experts the GPU buffers hold.
    pub fn num_experts(&self) -> usize {
        self.shared.config.num_experts
    }

    /// Bytes of one expert per kind.
    pub fn expert_nbytes(&self) -> [usize; KINDS] {
        self.shared.config.expert_nbytes
    }

    /// Whether [`Transport::close`] ran.
    pub fn closed(&self) -> bool {
        self.consumer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }

    fn ensure_open(&self) -> Result<()> {
        kt_ensure!(!self.closed(), Runtime, "FP8 layerwise transport is closed");
        Ok(())
    }

    /// Take part in layer `epoch`: this rank's consumer copies its `expert_count` experts as
    /// rank zero writes them. Every rank joins with the same `layer_id` and `expert_count`.
    pub fn join(&self, epoch: u64, layer_id: i64, expert_count: u64) -> Result<()> {
        self.ensure_open()?;
        self.shared.check_poison()?;
        kt_ensure!(epoch != 0, Invalid, "FP8 layerwise epoch zero is reserved");
        kt_ensure!(
            layer_id >= 0,
            Invalid,
            "FP8 layerwise layer_id must be non-negative"
        );
        let n = self.shared.config.num_experts as u64;
        kt_ensure!(
            (1..=n).contains(&expert_count),
            Invalid,
            "FP8 layerwise expert_count {expert_count} is outside the configured expert range \
             1..={n}"
        );
        let mut joined = self.joined.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((e, ..)) = *joined {
            kt_ensure!(
                epoch > e,
                Invalid,
                "this rank already joined epoch {e}; epochs must grow (got {epoch})"
            );
        }
        let me = self.shared.me();
        me.consumed.store(0, Ordering::Relaxed);
        me.joined_layer.store(layer_id, Ordering::Relaxed);
        me.joined_count.store(expert_count, Ordering::Relaxed);
        me.joined_epoch.store(epoch, Ordering::Release);
        *joined = Some((epoch, layer_id, expert_count, Instant::now()));
        let mut mb = self
            .shared
            .mailbox
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        mb.job = Some((epoch, expert_count));
        mb.done = None;
        self.shared.signal.notify_all();
        Ok(())
    }

    /// Block until this rank's copies of layer `epoch` and rank zero's writes are complete;
    /// then its host slots are free for the next layer. Returns the layer's figures.
    pub fn wait(&self, epoch: u64) -> Result<LayerStats> {
        self.ensure_open()?;
        let joined = *self.joined.lock().unwrap_or_else(|e| e.into_inner());
        let Some((e, ..)) = joined.filter(|j| j.0 == epoch) else {
            kt_bail!(
                Invalid,
                "wait called before this rank joined the epoch {epoch} (joined: {:?})",
                joined.map(|j| j.0)
            );
        };
        let sh = &self.shared;
        let mut mb = sh.mailbox.lock().unwrap_or_else(|e| e.into_inner());
        let stats = loop {
            if let Some((done_epoch, result)) = &mb.done {
                if *done_epoch == e {
                    break result.clone()?;
                }
            }
            if mb.stop {
                kt_bail!(Runtime, "FP8 layerwise transport is stopping");
            }
            mb = sh
                .signal
                .wait_timeout(mb, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        drop(mb);
        sh.me().returned_epoch.store(epoch, Ordering::Release);
        Ok(stats)
    }

    /// Rank zero: write layer `epoch`'s `expert_count` experts into every rank's host slots
    /// with `write(expert, dst)` (`dst[rank]` = that rank's slot buffers), publishing each,
    /// and return this rank's figures once its own copies are done. Joins this rank to the
    /// epoch first if it has not.
    pub fn run_batch(
        &self,
        epoch: u64,
        layer_id: i64,
        expert_count: u64,
        write: &mut dyn FnMut(usize, &[GpuRankDst]) -> Result<()>,
    ) -> Result<LayerStats> {
        self.ensure_open()?;
        let sh = &self.shared;
        kt_ensure!(
            sh.config.rank == 0,
            Invalid,
            "run_layerwise_fp8_batch is rank-zero only"
        );
        sh.check_poison()?;
        kt_ensure!(epoch != 0, Invalid, "FP8 layerwise epoch zero is reserved");
        let c = sh.control;
        let previous = c.epoch.load(Ordering::Acquire);
        kt_ensure!(
            epoch > previous,
            Invalid,
            "rank zero attempted to reuse or decrease a layerwise epoch ({epoch} after {previous})"
        );
        let tp = sh.config.tp_size;
        sh.wait_for("all ranks returning from the previous layer", || {
            let done = sh
                .ranks()
                .filter(|r| r.returned_epoch.load(Ordering::Acquire) >= previous);
            Ok((done.count() == tp, 0))
        })?;
        let joined = *self.joined.lock().unwrap_or_else(|e| e.into_inner());
        if joined.is_none_or(|j| j.0 != epoch) {
            self.join(epoch, layer_id, expert_count)?;
        }
        c.generation.store(0, Ordering::Relaxed);
        c.layer_id.store(layer_id, Ordering::Relaxed);
        c.expert_count.store(expert_count, Ordering::Relaxed);
        c.epoch.store(epoch, Ordering::Release);
        sh.wait_for("all ranks joining the epoch", || {
            let joined = sh
                .ranks()
                .filter(|r| r.joined_epoch.load(Ordering::Acquire) == epoch);
            Ok((joined.count() == tp, 0))
        })?;
        for (rank, r) in sh.ranks().enumerate() {
            let (l, n) = (
                r.joined_layer.load(Ordering::Relaxed),
                r.joined_count.load(Ordering::Relaxed),
            );
            if (l, n) != (layer_id, expert_count) {
                let e = Error::Invalid(format!(
                    "FP8 layerwise ranks supplied inconsistent layer_id or expert_count: rank 0 \
                     has ({layer_id}, {expert_count}), rank {rank} ({l}, {n})"
                ));
                return Err(sh.poison(POISON_MISMATCH, e));
            }
        }
        let dst: Vec<Vec<GpuRankDst>> = sh
            .config
            .all_rank_host
            .iter()
            .map(|ranks| {
                ranks
                    .iter()
                    .map(|k| GpuRankDst {
                        w13: k[0] as *mut u8,
                        w13_scale: k[1] as *mut u8,
                        w2: k[2] as *mut u8,
                        w2_scale: k[3] as *mut u8,
                    })
                    .collect()
            })
            .collect();
        let (mut writer, mut slot_wait) = (Duration::ZERO, Duration::ZERO);
        for e in 0..expert_count {
            if e >= SLOTS as u64 {
                // Slot e % 2 last held expert e - 2: every rank must have copied it.
                let t = Instant::now();
                sh.wait_for("all ranks acknowledging a reused host slot", || {
                    let min = sh.ranks().map(|r| r.consumed.load(Ordering::Acquire)).min();
                    let min = min.unwrap_or(0);
                    Ok((min >= e - 1, min))
                })?;
                slot_wait += t.elapsed();
            }
            let t = Instant::now();
            if let Err(err) = write(e as usize, &dst[e as usize % SLOTS]) {
                return Err(sh.poison(POISON_WRITER, err));
            }
            writer += t.elapsed();
            c.generation.store(e + 1, Ordering::Release);
        }
        let mut stats = self.wait(epoch)?;
        stats.writer_ms = writer.as_secs_f64() * 1e3;
        stats.slot_wait_ms = slot_wait.as_secs_f64() * 1e3;
        Ok(stats)
    }

    /// Stop the consumer thread; later calls fail. Idempotent.
    pub fn close(&self) {
        let handle = self
            .consumer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(h) = handle {
            {
                let mut mb = self
                    .shared
                    .mailbox
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                mb.stop = true;
                self.shared.signal.notify_all();
            }
            let _ = h.join();
        }
    }
}

impl Drop for Transport {
    fn drop(&mut self) {
        self.close();
    }
}

impl Shared {
    fn me(&self) -> &RankState {
        &self.control.ranks[self.config.rank]
    }

    fn ranks(&self) -> impl Iterator<Item = &RankState> {
        self.control.ranks[..self.config.tp_size].iter()
    }

    fn stopping(&self) -> bool {
        self.mailbox.lock().unwrap_or_else(|e| e.into_inner()).stop
    }

    /// The published poison as an error, if any.
    fn check_poison(&self) -> Result<()> {
        let c = self.control;
        match c.poison_state.load(Ordering::Acquire) {
            0 => Ok(()),
            2 => {
                let len = (c.poison_len.load(Ordering::Relaxed) as usize).min(MESSAGE_BYTES);
                let bytes: Vec<u8> = c.poison_message[..len]
                    .iter()
                    .map(|b| b.load(Ordering::Relaxed))
                    .collect();
                Err(Error::Runtime(format!(
                    "FP8 layerwise transport poisoned (code={}, rank={}): {}",
                    c.poison_code.load(Ordering::Relaxed),
                    c.poison_rank.load(Ordering::Relaxed),
                    String::from_utf8_lossy(&bytes)
                )))
            }
            _ => Ok(()), // being written: the next check sees it (or times out, below)
        }
    }

    /// Publish `err` as the block's poison (the first one wins) and return it.
    fn poison(&self, code: i32, err: Error) -> Error {
        let c = self.control;
        if c.poison_state
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            let text = err.to_string();
            let mut len = text.len().min(MESSAGE_BYTES);
            while !text.is_char_boundary(len) {
                len -= 1;
            }
            for (dst, &b) in c.poison_message.iter().zip(&text.as_bytes()[..len]) {
                dst.store(b, Ordering::Relaxed);
            }
            c.poison_len.store(len as u32, Ordering::Relaxed);
            c.poison_code.store(code, Ordering::Relaxed);
            c.poison_rank
                .store(self.config.rank as i32, Ordering::Relaxed);
            c.poison_state.store(2, Ordering::Release);
        }
        err
    }

    /// Poll `ready` (→ (done, progress marker)) with back-off until done; fails on poison, on
    /// stop, or after the timeout without the marker moving (and then poisons the block).
    fn wait_for(&self, what: &str, ready: impl FnMut() -> Result<(bool, u64)>) -> Result<()> {
        self.wait_within(self.config.timeout, what, ready)
    }

    /// [`Shared::wait_for`] with its own `timeout`.
    fn wait_within(
        &self,
        timeout: Duration,
        what: &str,
        mut ready: impl FnMut() -> Result<(bool, u64)>,
    ) -> Result<()> {
        let (mut since, mut last, mut polls) = (Instant::now(), None, 0u32);
        let mut claimed_at: Option<Instant> = None;
        loop {
            self.check_poison()?;
            if self.control.poison_state.load(Ordering::Acquire) == 1 {
                let t = *claimed_at.get_or_insert_with(Instant::now);
                kt_ensure!(
                    t.elapsed() < timeout,
                    Runtime,
                    "FP8 layerwise transport poisoned, but poison publication did not complete \
                     (claim owner may have died)"
                );
            }
            if self.stopping() {
                kt_bail!(Runtime, "FP8 layerwise transport is stopping");
            }
            let (done, marker) = ready()?;
            if done {
                return Ok(());
            }
            if last != Some(marker) {
                (last, since) = (Some(marker), Instant::now());
            }
            if since.elapsed() >= timeout {
                let err = Error::Runtime(format!(
                    "FP8 layerwise: timed out after {} ms without progress while waiting for {what}",
                    timeout.as_millis()
                ));
                return Err(self.poison(POISON_TIMEOUT, err));
            }
            polls += 1;
            if polls < 200 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(if polls < 2000 { 20 } else { 200 }));
            }
        }
    }

    /// Copy layer `epoch`'s experts as they are published (the consumer's job). Its waits
    /// last twice the timeout: they wait on the producer, which, when alive, meets the cause
    /// (a missing or slow rank) first and reports it.
    fn consume(&self, copier: &Copier, epoch: u64, count: u64) -> Result<LayerStats> {
        let c = self.control;
        let start = Instant::now();
        let patience = self.config.timeout * 2;
        self.wait_within(patience, "rank zero publishing the requested epoch", || {
            let now = c.epoch.load(Ordering::Acquire);
            kt_ensure!(
                now <= epoch,
                Runtime,
                "FP8 layerwise active epoch advanced before consumer completed ({now} > {epoch})"
            );
            Ok((now == epoch, 0))
        })?;
        let published = c.expert_count.load(Ordering::Relaxed);
        kt_ensure!(
            published == count,
            Runtime,
            "FP8 layerwise consumer observed an invalid expert_count {published} (joined with \
             {count})"
        );
        let cfg = &self.config;
        let mut h2d = Duration::ZERO;
        for e in 0..count {
            self.wait_within(patience, "the next expert generation", || {
                kt_ensure!(
                    c.epoch.load(Ordering::Acquire) == epoch,
                    Runtime,
                    "FP8 layerwise active epoch advanced before consumer completed"
                );
                let g = c.generation.load(Ordering::Acquire);
                Ok((g > e, g))
            })?;
            let t = Instant::now();
            let slot = &cfg.local_host[e as usize % SLOTS];
            let copies: [(usize, usize, usize); KINDS] = std::array::from_fn(|k| {
                let n = cfg.expert_nbytes[k];
                (cfg.local_gpu[k] + e as usize * n, slot[k], n)
            });
            // SAFETY: `open`'s contract: host slots and GPU buffers of these sizes exist (the
            // offset was checked against num_experts ≥ count), and rank zero finished writing
            // this slot (generation > e, acquired).
            if let Err(err) = unsafe { copier.copy(&copies) } {
                return Err(self.poison(POISON_COPY, err));
            }
            h2d += t.elapsed();
            self.me().consumed.store(e + 1, Ordering::Release);
        }
        Ok(LayerStats {
            epoch,
            layer_id: c.layer_id.load(Ordering::Relaxed),
            expert_count: count,
            h2d_ms: h2d.as_secs_f64() * 1e3,
            total_ms: start.elapsed().as_secs_f64() * 1e3,
            ..LayerStats::default()
        })
    }
}

fn consumer_loop(sh: Arc<Shared>, copier: Copier, ready: std::sync::mpsc::Sender<Result<()>>) {
    let copier = match copier.bind() {
        Ok(c) => {
            let _ = ready.send(Ok(()));
            c
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    loop {
        let job = {
            let mut mb = sh.mailbox.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if mb.stop {
                    return;
                }
                if let Some(job) = mb.job.take() {
                    break job;
                }
                mb = sh.signal.wait(mb).unwrap_or_else(|e| e.into_inner());
            }
        };
        let (epoch, count) = job;
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            sh.consume(&copier, epoch, count)
        }))
        .unwrap_or_else(|_| {
            Err(Error::Runtime(
                "unknown exception in FP8 layerwise H2D consumer".into(),
            ))
        });
        let mut mb = sh.mailbox.lock().unwrap_or_else(|e| e.into_inner());
        mb.done = Some((epoch, result));
        sh.signal.notify_all();
    }
}

/// Host-to-device copies: the CUDA driver on this rank's device, or `memcpy` for host
/// destinations.
enum Copier {
    Host,
    Cuda {
        device: i32,
        api: CudaApi,
        stream: usize,
    },
}

/// The driver entry points the consumer uses.
#[derive(Clone, Copy)]
struct CudaApi {
    init: unsafe extern "C" fn(u32) -> i32,
    device_get: unsafe extern "C" fn(*mut i32, i32) -> i32,
    primary_ctx_retain: unsafe extern "C" fn(*mut *mut c_void, i32) -> i32,
    ctx_set_current: unsafe extern "C" fn(*mut c_void) -> i32,
    stream_create: unsafe extern "C" fn(*mut *mut c_void, u32) -> i32,
    memcpy_htod_async: unsafe extern "C" fn(u64, *const c_void, usize, *mut c_void) -> i32,
    stream_synchronize: unsafe extern "C" fn(*mut c_void) -> i32,
}

// SAFETY: function pointers and a stream handle used only by the consumer thread.
unsafe impl Send for Copier {}

fn cuda_call(what: &str, code: i32) -> Result<()> {
    kt_ensure!(
        code == 0,
        Runtime,
        "FP8 layerwise {what} failed with CUresult {code}"
    );
    Ok(())
}

impl Copier {
    fn new(cuda_device: i32) -> Result<Copier> {
        if cuda_device < 0 {
            return Ok(Copier::Host);
        }
        macro_rules! sym {
            ($name:literal, $ty:ty) => {
                // SAFETY: the driver's documented signature for this entry point.
                unsafe {
                    std::mem::transmute::<*mut c_void, $ty>(crate::cuda_bridge::symbol($name)?)
                }
            };
        }
        type Status = i32;
        let api = CudaApi {
            init: sym!(c"cuInit", unsafe extern "C" fn(u32) -> Status),
            device_get: sym!(
                c"cuDeviceGet",
                unsafe extern "C" fn(*mut i32, i32) -> Status
            ),
            primary_ctx_retain: sym!(
                c"cuDevicePrimaryCtxRetain",
                unsafe extern "C" fn(*mut *mut c_void, i32) -> Status
            ),
            ctx_set_current: sym!(
                c"cuCtxSetCurrent",
                unsafe extern "C" fn(*mut c_void) -> Status
            ),
            stream_create: sym!(
                c"cuStreamCreate",
                unsafe extern "C" fn(*mut *mut c_void, u32) -> Status
            ),
            memcpy_htod_async: sym!(
                c"cuMemcpyHtoDAsync_v2",
                unsafe extern "C" fn(u64, *const c_void, usize, *mut c_void) -> Status
            ),
            stream_synchronize: sym!(
                c"cuStreamSynchronize",
                unsafe extern "C" fn(*mut c_void) -> Status
            ),
        };
        Ok(Copier::Cuda {
            device: cuda_device,
            api,
            stream: 0,
        })
    }

    /// Bind this (the consumer) thread to the device and make its stream.
    fn bind(self) -> Result<Copier> {
        let Copier::Cuda { device, api, .. } = self else {
            return Ok(self);
        };
        let (mut dev, mut ctx, mut stream) = (0i32, std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: driver calls with out-pointers to locals; flag 1 = CU_STREAM_NON_BLOCKING.
        unsafe {
            cuda_call("cuInit", (api.init)(0))?;
            cuda_call("cuDeviceGet", (api.device_get)(&mut dev, device))?;
            cuda_call(
                "cuDevicePrimaryCtxRetain",
                (api.primary_ctx_retain)(&mut ctx, dev),
            )?;
            cuda_call("cuCtxSetCurrent", (api.ctx_set_current)(ctx))?;
            cuda_call("cuStreamCreate", (api.stream_create)(&mut stream, 1))?;
        }
        Ok(Copier::Cuda {
            device,
            api,
            stream: stream as usize,
        })
    }

    /// Copy each `(dst, src, bytes)` and wait until all have landed.
    ///
    /// # Safety
    /// Each source has `bytes` readable bytes, each destination `bytes` writable ones (device
    /// memory of the bound device, or host memory for [`Copier::Host`]), not overlapping.
    unsafe fn copy(&self, copies: &[(usize, usize, usize)]) -> Result<()> {
        match self {
            Copier::Host => {
                for &(dst, src, n) in copies {
                    // SAFETY: the contract.
                    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, n) };
                }
                Ok(())
            }
            Copier::Cuda { api, stream, .. } => {
                let s = *stream as *mut c_void;
                for &(dst, src, n) in copies {
                    // SAFETY: the contract; the stream belongs to this thread's context.
                    let code =
                        unsafe { (api.memcpy_htod_async)(dst as u64, src as *const c_void, n, s) };
                    cuda_call("cudaMemcpyAsync(H2D)", code)?;
                }
                // SAFETY: as above.
                cuda_call("H2D completion", unsafe { (api.stream_synchronize)(s) })
            }
        }
    }
}

#[cfg(test)]
mod tests;
