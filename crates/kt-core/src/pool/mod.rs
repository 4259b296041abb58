//! NUMA-aware worker pools.
//!
//! A [`Pool`] has one sub-pool per NUMA part. Sub-pool 0 is led by the calling thread (so a
//! layer with one part wakes no extra thread); every other sub-pool has a dedicated, pinned
//! leader. [`Pool::run_parts`] runs a closure once per part, each on its own sub-pool, and inside
//! it [`Team::parallel_for`] hands tasks to that sub-pool's workers through a shared counter.
//!
//! Every wait spins for a bounded time (`KT_SPIN_US`, 1 ms by default: phases of one forward, and
//! the layers of one decode step, follow each other within it), yielding the core to any other
//! thread that wants it, and then parks, so an idle process uses no CPU.
use crate::topology::{plan_pinning, Topology};
use crate::{Error, Result};
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

/// Most worker threads a pool takes: far above any CPU Linux runs on (8192 CPUs), low enough
/// that a mistyped count is an error rather than an allocation failure or a thread storm.
pub const MAX_THREADS: usize = 8192;

fn check_thread_count(total: usize) -> Result<()> {
    if total > MAX_THREADS {
        return Err(Error::Invalid(format!(
            "{total} worker threads requested; at most {MAX_THREADS} are allowed"
        )));
    }
    Ok(())
}

/// How a pool is laid out: one entry per sub-pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// NUMA node of each sub-pool (may repeat).
    pub numa_nodes: Vec<u32>,
    /// Threads of each sub-pool, counting its leader (≥ 1).
    pub threads: Vec<usize>,
    /// Pin dedicated threads to physical cores and prefer their node's memory.
    pub pin: bool,
}

impl PoolConfig {
    /// Split `total_threads` over `subpool_count` sub-pools as the original does (the first
    /// `total % count` get one more); nodes default to `0..count`.
    pub fn split(
        total_threads: usize,
        subpool_count: usize,
        numa_nodes: Option<&[u32]>,
    ) -> Result<PoolConfig> {
        if subpool_count == 0 {
            return Err(Error::Invalid("threadpool_count must be at least 1".into()));
        }
        check_thread_count(total_threads)?;
        if total_threads < subpool_count {
            return Err(Error::Invalid(format!(
                "cpuinfer_threads={total_threads} is less than threadpool_count={subpool_count}; \
                 every sub-pool needs at least one thread"
            )));
        }
        let nodes: Vec<u32> = match numa_nodes {
            Some(n) if n.len() != subpool_count => {
                return Err(Error::Invalid(format!(
                    "numa_nodes has {} entries but threadpool_count is {subpool_count}",
                    n.len()
                )))
            }
            Some(n) => n.to_vec(),
            None => (0..subpool_count as u32).collect(),
        };
        let threads = (0..subpool_count)
            .map(|i| total_threads / subpool_count + usize::from(i < total_threads % subpool_count))
            .collect();
        Ok(PoolConfig {
            numa_nodes: nodes,
            threads,
            pin: true,
        })
    }
}

/// Default spin before parking. A pause takes 8 ns on this project's Xeon VM and about 140
/// cycles on Skylake-generation cores, so the budget is time, not rounds. Waking a parked thread costs tens of microseconds (far more in a
/// VM, where it goes through the hypervisor), and a decode step calls layer after layer with
/// gaps of a few hundred microseconds, so workers keep spinning across such gaps.
const DEFAULT_SPIN_US: u64 = 1000;

/// The longest spin `KT_SPIN_US` may ask for: one second.
const MAX_SPIN_US: u64 = 1_000_000;

/// `KT_SPIN_US` if set; a set but unusable value is an error (checked when a pool starts, so it
/// is never a silent default). `KT_SPIN_ROUNDS`, its predecessor, is refused with the new name.
fn spin_setting() -> Result<Option<Duration>> {
    if let Ok(v) = std::env::var("KT_SPIN_ROUNDS") {
        return Err(Error::Invalid(format!(
            "KT_SPIN_ROUNDS={v:?} is no longer read: the spin before parking is now a time, \
             set KT_SPIN_US (microseconds, default {DEFAULT_SPIN_US})"
        )));
    }
    match std::env::var("KT_SPIN_US") {
        Ok(v) => match v.parse::<u64>() {
            Ok(us) if us <= MAX_SPIN_US => Ok(Some(Duration::from_micros(us))),
            _ => Err(Error::Invalid(format!(
                "KT_SPIN_US={v:?} is not a time in microseconds from 0 to {MAX_SPIN_US} (one \
                 second; longer would keep idle workers spinning; default {DEFAULT_SPIN_US})"
            ))),
        },
        Err(_) => Ok(None),
    }
}

/// The most values a phase may touch for [`Team::parallel_for_sized`] to run it on the leader
/// alone.
pub const INLINE_VALUES: usize = 1 << 15;

/// How long a waiting thread spins before it parks (override with `KT_SPIN_US`).
fn spin_budget() -> Duration {
    static BUDGET: OnceLock<Duration> = OnceLock::new();
    *BUDGET.get_or_init(|| {
        spin_setting()
            .ok()
            .flatten()
            .unwrap_or(Duration::from_micros(DEFAULT_SPIN_US))
    })
}

/// Spin for up to `budget`, yielding the core between rounds, then park until `ready()`.
/// `sleeping` tells notifiers to unpark us.
fn wait_until(ready: impl Fn() -> bool, sleeping: &AtomicBool, budget: Duration) {
    if ready() {
        return;
    }
    let start = Instant::now();
    // The clock is read once per 32 pauses: cheap next to them, fine-grained next to the budget.
    while start.elapsed() < budget {
        for _ in 0..32 {
            if ready() {
                return;
            }
            std::hint::spin_loop();
        }
        // A thread that wants this core (torch's, between two layers on a CPU-only host) gets
        // it: spinning without yielding made a 0.65 ms torch op take 1.5 ms.
        thread::yield_now();
    }
    loop {
        sleeping.store(true, SeqCst);
        if ready() {
            sleeping.store(false, SeqCst);
            return;
        }
        thread::park();
        sleeping.store(false, SeqCst);
        if ready() {
            return;
        }
    }
}

/// Wake a waiter after making its condition true (the store must come before this call).
fn notify(sleeping: &AtomicBool, thread: &Thread) {
    if sleeping.load(SeqCst) {
        thread.unpark();
    }
}

type Payload = Box<dyn Any + Send>;

/// A parallel-for posted by a team leader to its helpers.
struct TeamJob<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n_tasks: usize,
    /// Threads taking tasks (guided chunk sizes are a share of the rest per thread).
    threads: usize,
    next: AtomicUsize,
    remaining_helpers: AtomicUsize,
    leader: Thread,
    panic: Mutex<Option<Payload>>,
}

impl TeamJob<'_> {
    /// Guided hand-out: each take is half of the remaining tasks' share per thread, at least
    /// one. Neighbouring tasks (a matrix's consecutive panels) then run on one thread, which
    /// streams them in address order (prefetchers see one sequential stream per core instead
    /// of every other panel), while the last, small takes still balance uneven tasks.
    fn run_tasks(&self) {
        loop {
            let start = self.next.load(SeqCst);
            if start >= self.n_tasks {
                return;
            }
            let take = ((self.n_tasks - start) / (2 * self.threads)).max(1);
            if self
                .next
                .compare_exchange_weak(start, start + take, SeqCst, SeqCst)
                .is_err()
            {
                continue;
            }
            for i in start..start + take {
                if let Err(p) = catch_unwind(AssertUnwindSafe(|| (self.f)(i))) {
                    // Skip the remaining tasks; the leader re-raises the first panic.
                    self.next.store(self.n_tasks, SeqCst);
                    self.panic.lock().unwrap().get_or_insert(p);
                    return;
                }
            }
        }
    }
}

/// Per-thread mailbox.
struct Slot<J> {
    job: AtomicPtr<J>,
    sleeping: AtomicBool,
    thread: OnceLock<Thread>,
    /// Linux thread id, for per-thread CPU accounting.
    tid: OnceLock<i64>,
}

impl<J> Slot<J> {
    fn new() -> Self {
        Slot {
            job: AtomicPtr::new(std::ptr::null_mut()),
            sleeping: AtomicBool::new(false),
            thread: OnceLock::new(),
            tid: OnceLock::new(),
        }
    }

    fn post(&self, job: *mut J) {
        self.job.store(job, SeqCst);
        if let Some(t) = self.thread.get() {
            notify(&self.sleeping, t);
        }
    }
}

/// A per-part closure posted by [`Pool::run_parts`] to the leaders of sub-pools 1...
struct PartJob<'a> {
    f: &'a (dyn Fn(usize, &Team) + Sync),
    remaining: AtomicUsize,
    caller: Thread,
    panic: Mutex<Option<Payload>>,
}

struct SubShared {
    index: usize,
    node: u32,
    threads: usize,
    /// Helpers 1..threads (index 0 unused: the leader never takes team jobs).
    helpers: Vec<Slot<TeamJob<'static>>>,
    /// The dedicated leader's mailbox (sub-pools ≥ 1).
    leader: Slot<PartJob<'static>>,
    /// Set while this sub-pool's leader is parked waiting for its helpers. Lives here, not in
    /// the job, because the last helper touches it after the job may be gone.
    leader_sleeping: AtomicBool,
    /// Set while the caller of `run_parts` is parked (shared by all sub-pools of a pool).
    caller_sleeping: Arc<AtomicBool>,
    shutdown: AtomicBool,
}

/// The workers of one sub-pool as seen by its leader.
pub struct Team {
    shared: Arc<SubShared>,
}

impl Team {
    /// Index of this sub-pool (= NUMA part).
    pub fn index(&self) -> usize {
        self.shared.index
    }

    /// NUMA node of this sub-pool.
    pub fn node(&self) -> u32 {
        self.shared.node
    }

    /// Threads in this team, the leader included.
    pub fn threads(&self) -> usize {
        self.shared.threads
    }

    /// [`Team::parallel_for`] for tasks that read and write about `values` values in all:
    /// below [`INLINE_VALUES`] the leader runs them alone, as handing tasks to helpers and
    /// waiting for them costs more than such work (a decode's SwiGLU-row and down-sum phases:
    /// 4.5 and 7 µs on two threads of an AMD Zen 5, each the work of about a microsecond).
    pub fn parallel_for_sized(&self, n_tasks: usize, values: usize, f: &(dyn Fn(usize) + Sync)) {
        if values <= INLINE_VALUES {
            (0..n_tasks).for_each(f);
        } else {
            self.parallel_for(n_tasks, f);
        }
    }

    /// Run `f(i)` for every `i < n_tasks` on this team (the leader takes part) and wait.
    /// Tasks are handed out one at a time from a shared counter, so uneven tasks balance.
    /// A panic in any task is re-raised here after every helper has stopped.
    pub fn parallel_for(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        let helpers = (self.shared.threads - 1).min(n_tasks.saturating_sub(1));
        if helpers == 0 {
            (0..n_tasks).for_each(f);
            return;
        }
        let job = TeamJob {
            f,
            n_tasks,
            threads: helpers + 1,
            next: AtomicUsize::new(0),
            remaining_helpers: AtomicUsize::new(helpers),
            leader: thread::current(),
            panic: Mutex::new(None),
        };
        // SAFETY (lifetime erasure): the pointer is only dereferenced by helpers before they
        // decrement `remaining_helpers`, and we do not return until that count reaches zero.
        let ptr = &job as *const TeamJob<'_> as *mut TeamJob<'static>;
        for slot in &self.shared.helpers[1..=helpers] {
            slot.post(ptr);
        }
        job.run_tasks();
        // Every task is taken. A helper that has not picked the job up yet (descheduled: the
        // core is shared, e.g. with torch's spinning threads) is not waited for: the post is
        // withdrawn, so a late helper never holds up the leader.
        for slot in &self.shared.helpers[1..=helpers] {
            if slot
                .job
                .compare_exchange(ptr, std::ptr::null_mut(), SeqCst, SeqCst)
                .is_ok()
            {
                job.remaining_helpers.fetch_sub(1, SeqCst);
            }
        }
        wait_until(
            || job.remaining_helpers.load(SeqCst) == 0,
            &self.shared.leader_sleeping,
            spin_budget(),
        );
        let panicked = job.panic.lock().unwrap().take();
        if let Some(p) = panicked {
            std::panic::resume_unwind(p);
        }
    }
}

fn helper_loop(shared: Arc<SubShared>, me: usize) {
    let slot = &shared.helpers[me];
    loop {
        wait_until(
            || !slot.job.load(SeqCst).is_null() || shared.shutdown.load(SeqCst),
            &slot.sleeping,
            spin_budget(),
        );
        let ptr = slot.job.swap(std::ptr::null_mut(), SeqCst);
        if ptr.is_null() {
            if shared.shutdown.load(SeqCst) {
                return;
            }
            continue; // the leader withdrew the job before we took it
        }
        // SAFETY: the leader keeps the job alive until we decrement remaining_helpers (or
        // until it has withdrawn the post, which the swap above would then have seen).
        let job = unsafe { &*ptr };
        job.run_tasks();
        let leader = job.leader.clone();
        // After this decrement the job may be gone: only the cloned handle and the sub-pool's
        // own flag are used below.
        if job.remaining_helpers.fetch_sub(1, SeqCst) == 1 {
            notify(&shared.leader_sleeping, &leader);
        }
    }
}

fn leader_loop(shared: Arc<SubShared>) {
    let team = Team {
        shared: shared.clone(),
    };
    let slot = &shared.leader;
    loop {
        wait_until(
            || !slot.job.load(SeqCst).is_null() || shared.shutdown.load(SeqCst),
            &slot.sleeping,
            spin_budget(),
        );
        let ptr = slot.job.swap(std::ptr::null_mut(), SeqCst);
        if ptr.is_null() {
            return;
        }
        // SAFETY: run_parts keeps the job alive until `remaining` reaches zero.
        let job = unsafe { &*ptr };
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| (job.f)(shared.index, &team))) {
            job.panic.lock().unwrap().get_or_insert(p);
        }
        let caller = job.caller.clone();
        if job.remaining.fetch_sub(1, SeqCst) == 1 {
            notify(&shared.caller_sleeping, &caller);
        }
    }
}

/// Sub-pools of pinned worker threads. Dropping the pool stops and joins its threads.
pub struct Pool {
    config: PoolConfig,
    subs: Vec<Arc<SubShared>>,
    handles: Vec<JoinHandle<()>>,
    caller_cpu: Option<u32>,
    pinning: Vec<Vec<Option<u32>>>,
    warnings: Vec<String>,
    pid: u32,
    caller_sleeping: Arc<AtomicBool>,
    /// One `run_parts` at a time: sub-pool 0's helpers serve one leader.
    busy: Mutex<()>,
}

impl Pool {
    /// Start the threads of `config` on the detected topology.
    pub fn new(config: PoolConfig) -> Result<Pool> {
        Self::with_topology(config, Topology::global())
    }

    /// Start the threads of `config`, planning pinning on `topo`.
    pub fn with_topology(config: PoolConfig, topo: &Topology) -> Result<Pool> {
        if config.threads.is_empty() || config.threads.len() != config.numa_nodes.len() {
            return Err(Error::Invalid(format!(
                "pool config needs one thread count per NUMA node entry (threads {:?}, nodes {:?})",
                config.threads, config.numa_nodes
            )));
        }
        if let Some(i) = config.threads.iter().position(|&t| t == 0) {
            return Err(Error::Invalid(format!("sub-pool {i} has no threads")));
        }
        spin_setting()?;
        check_thread_count(
            config
                .threads
                .iter()
                .fold(0usize, |sum, &t| sum.saturating_add(t)),
        )?;
        let plan = plan_pinning(topo, &config.numa_nodes, &config.threads);
        let caller_sleeping = Arc::new(AtomicBool::new(false));
        let mut subs = Vec::new();
        let mut handles = Vec::new();
        for (i, (&node, &n)) in config.numa_nodes.iter().zip(&config.threads).enumerate() {
            let shared = Arc::new(SubShared {
                index: i,
                node,
                threads: n,
                helpers: (0..n).map(|_| Slot::new()).collect(),
                leader: Slot::new(),
                leader_sleeping: AtomicBool::new(false),
                caller_sleeping: caller_sleeping.clone(),
                shutdown: AtomicBool::new(false),
            });
            let cpus = plan.cpus.get(i).cloned().unwrap_or_default();
            let first = if i == 0 { 1 } else { 0 };
            for t in first..n {
                let sh = shared.clone();
                let cpu = if config.pin {
                    cpus.get(t).copied().flatten()
                } else {
                    None
                };
                let pin_node = config.pin && topo.node(node).is_some();
                let name = format!("kt_numa{node}_t{t}");
                let handle = thread::Builder::new()
                    .name(name)
                    .spawn(move || {
                        if let Some(cpu) = cpu {
                            let _ = crate::affinity::pin_current_thread(cpu);
                        }
                        if pin_node {
                            let _ = crate::affinity::prefer_node_for_current_thread(node);
                        }
                        // SAFETY: gettid has no preconditions.
                        let tid = unsafe { libc::syscall(libc::SYS_gettid) } as i64;
                        if t == 0 {
                            let _ = sh.leader.tid.set(tid);
                            let _ = sh.leader.thread.set(thread::current());
                            leader_loop(sh)
                        } else {
                            let _ = sh.helpers[t].tid.set(tid);
                            let _ = sh.helpers[t].thread.set(thread::current());
                            helper_loop(sh, t)
                        }
                    })
                    .map_err(|e| Error::Runtime(format!("cannot spawn worker thread: {e}")))?;
                handles.push(handle);
            }
            subs.push(shared);
        }
        // Wait until every thread registered its handle so posts can wake it.
        for s in &subs {
            let first = if s.index == 0 { 1 } else { 0 };
            while (first..s.threads).any(|t| {
                if t == 0 {
                    s.leader.thread.get().is_none()
                } else {
                    s.helpers[t].thread.get().is_none()
                }
            }) {
                thread::yield_now();
            }
        }
        let caller_cpu = if config.pin {
            plan.cpus.first().and_then(|c| c.first().copied().flatten())
        } else {
            None
        };
        Ok(Pool {
            config,
            subs,
            handles,
            caller_cpu,
            pinning: plan.cpus,
            warnings: plan.warnings,
            pid: std::process::id(),
            caller_sleeping,
            busy: Mutex::new(()),
        })
    }

    /// The layout this pool was built from.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Number of sub-pools (= NUMA parts of a layer).
    pub fn parts(&self) -> usize {
        self.subs.len()
    }

    /// Total threads, the calling thread counted as sub-pool 0's leader.
    pub fn total_threads(&self) -> usize {
        self.config.threads.iter().sum()
    }

    /// The CPU planned for sub-pool 0's leader; a dedicated caller (the engine) pins itself there.
    pub fn caller_cpu(&self) -> Option<u32> {
        self.caller_cpu
    }

    /// Planned CPU of every thread, per sub-pool (None = not pinned).
    pub fn pinning(&self) -> &[Vec<Option<u32>>] {
        &self.pinning
    }

    /// Linux thread ids of the pool's own threads (not the caller's).
    pub fn thread_ids(&self) -> Vec<i64> {
        let mut v = Vec::new();
        for s in &self.subs {
            v.extend(s.leader.tid.get().copied());
            v.extend(s.helpers.iter().filter_map(|h| h.tid.get().copied()));
        }
        v
    }

    /// Notes from pinning (oversubscription, unknown nodes).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Run `f(part, team)` for every part concurrently: part 0 on the calling thread with
    /// sub-pool 0's helpers, the others on their own leaders. Re-raises the first panic.
    pub fn run_parts(&self, f: &(dyn Fn(usize, &Team) + Sync)) -> Result<()> {
        if std::process::id() != self.pid {
            return Err(Error::Runtime(
                "this worker pool was created before fork(); its threads do not exist in the child \
                 process (create the layer in the child)"
                    .into(),
            ));
        }
        let _guard = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        let others = self.subs.len() - 1;
        let job = PartJob {
            f,
            remaining: AtomicUsize::new(others),
            caller: thread::current(),
            panic: Mutex::new(None),
        };
        let ptr = &job as *const PartJob<'_> as *mut PartJob<'static>;
        for s in &self.subs[1..] {
            s.leader.post(ptr);
        }
        let team0 = Team {
            shared: self.subs[0].clone(),
        };
        let mine = catch_unwind(AssertUnwindSafe(|| f(0, &team0)));
        // Wait for the other parts even if ours panicked: they still hold `job`.
        wait_until(
            || job.remaining.load(SeqCst) == 0,
            &self.caller_sleeping,
            spin_budget(),
        );
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        let panicked = job.panic.lock().unwrap().take();
        if let Some(p) = panicked {
            std::panic::resume_unwind(p);
        }
        Ok(())
    }

    /// Run `f(i)` for `i < n` across every thread of every sub-pool (for work that has no
    /// NUMA affinity, e.g. merging outputs). Each part takes a contiguous share of the range.
    pub fn parallel_for_all(&self, n: usize, f: &(dyn Fn(usize) + Sync)) -> Result<()> {
        let total = self.total_threads();
        let parts = self.parts();
        let bounds: Vec<usize> = {
            let mut acc = 0;
            let mut b = vec![0];
            for t in &self.config.threads {
                acc += t;
                b.push(n * acc / total);
            }
            b
        };
        debug_assert_eq!(bounds.len(), parts + 1);
        self.run_parts(&|part, team| {
            let (lo, hi) = (bounds[part], bounds[part + 1]);
            team.parallel_for(hi - lo, &|i| f(lo + i));
        })
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            return; // after fork the threads are not ours to join
        }
        for s in &self.subs {
            s.shutdown.store(true, SeqCst);
            if let Some(t) = s.leader.thread.get() {
                t.unpark();
            }
            for h in &s.helpers {
                if let Some(t) = h.thread.get() {
                    t.unpark();
                }
            }
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests;
