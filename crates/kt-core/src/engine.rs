//! A FIFO task queue with one worker thread, like the original's `CPUInfer`: `submit` returns at
//! once with a ticket, `wait`/`sync` block until work is done, and an error (or panic) inside a
//! task comes back from the wait that covers it. The worker parks on a condition variable when
//! the queue is empty, so an idle engine uses no CPU.
use crate::moe::Workspace;
use crate::pool::Pool;
use crate::{Error, Result};
use std::collections::{BTreeMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// What a task gets to run with: the pool and the shared forward scratch.
pub struct Context<'a> {
    /// Worker pool.
    pub pool: &'a Pool,
    /// Scratch shared by all tasks (they run one at a time).
    pub workspace: &'a mut Workspace,
}

/// A unit of work.
pub type Task = Box<dyn FnOnce(&mut Context<'_>) -> Result<()> + Send>;

struct State {
    queue: VecDeque<(u64, Task)>,
    submitted: u64,
    completed: u64,
    errors: BTreeMap<u64, Error>,
    shutdown: bool,
}

struct Shared {
    state: Mutex<State>,
    work: Condvar,
    done: Condvar,
}

/// The task queue and its worker thread (which also leads sub-pool 0 of the pool).
pub struct Engine {
    shared: Arc<Shared>,
    pool: Arc<Pool>,
    workspace: Arc<Mutex<Workspace>>,
    thread: Option<JoinHandle<()>>,
    pid: u32,
    /// Whether `run_now` may run a task on the caller's thread: only with one NUMA node, since
    /// an unpinned caller could sit on another node than sub-pool 0's memory.
    inline_allowed: bool,
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

impl Engine {
    /// Start the worker thread for `pool`.
    pub fn new(pool: Pool) -> Result<Engine> {
        let pool = Arc::new(pool);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                submitted: 0,
                completed: 0,
                errors: BTreeMap::new(),
                shutdown: false,
            }),
            work: Condvar::new(),
            done: Condvar::new(),
        });
        let workspace = Arc::new(Mutex::new(Workspace::new()));
        let (sh, pl, ws) = (shared.clone(), pool.clone(), workspace.clone());
        let thread = std::thread::Builder::new()
            .name("kt_engine".into())
            .spawn(move || {
                // The engine thread leads sub-pool 0, so it takes that sub-pool's first core.
                if let Some(cpu) = pl.caller_cpu() {
                    let _ = crate::affinity::pin_current_thread(cpu);
                }
                worker(sh, pl, ws)
            })
            .map_err(|e| Error::Runtime(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine {
            shared,
            pool,
            workspace,
            thread: Some(thread),
            pid: std::process::id(),
            inline_allowed: crate::topology::Topology::global().nodes.len() <= 1,
        })
    }

    /// The pool tasks run on.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Run `f` with exclusive access to the shared workspace (e.g. to reserve room up front).
    pub fn with_workspace<R>(&self, f: impl FnOnce(&mut Workspace) -> R) -> R {
        f(&mut self.workspace.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Queue a task; returns its ticket at once.
    pub fn submit(&self, task: Task) -> u64 {
        let mut st = self.shared.state.lock().unwrap();
        st.submitted += 1;
        let ticket = st.submitted;
        st.queue.push_back((ticket, task));
        self.shared.work.notify_one();
        ticket
    }

    /// Run `task` on the calling thread when the engine is idle (nothing queued or running),
    /// else queue it and wait for it. The result is the same as `submit` + `wait`, without the
    /// two thread hand-offs (tens of µs on a VM: a one-token decode is about a millisecond).
    /// Order is kept: a task submitted meanwhile runs after this one. On machines with several
    /// NUMA nodes tasks always go through the engine thread, which is pinned to sub-pool 0's.
    pub fn run_now(&self, task: Task) -> Result<()> {
        self.check_not_forked()?;
        if !self.inline_allowed {
            let ticket = self.submit(task);
            return self.wait(ticket);
        }
        let mut st = self.shared.state.lock().unwrap();
        // Idle means the worker has released the workspace too (it does so before it marks a
        // task completed), so this only fails if another thread is running a task inline.
        let workspace = if st.submitted != st.completed {
            None
        } else {
            match self.workspace.try_lock() {
                Ok(ws) => Some(ws),
                Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            }
        };
        let Some(mut ws) = workspace else {
            drop(st);
            let ticket = self.submit(task);
            return self.wait(ticket);
        };
        st.submitted += 1;
        let ticket = st.submitted;
        drop(st);
        let result = run_task(task, &self.pool, &mut ws);
        // Completed before the workspace is released: a task queued meanwhile is blocked on
        // the workspace until then, so tickets complete in order.
        let mut st = self.shared.state.lock().unwrap();
        st.completed = ticket;
        self.shared.done.notify_all();
        drop(st);
        drop(ws);
        result
    }

    /// After fork() the worker thread does not exist in the child: waiting would hang forever.
    fn check_not_forked(&self) -> Result<()> {
        if std::process::id() != self.pid {
            return Err(Error::Runtime(
                "this engine was created before fork(); its worker thread does not exist in the \
                 child process (create the layers in the child)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Block until task `ticket` has run; return its error, if any.
    pub fn wait(&self, ticket: u64) -> Result<()> {
        self.check_not_forked()?;
        let mut st = self.shared.state.lock().unwrap();
        while st.completed < ticket {
            st = self.shared.done.wait(st).unwrap();
        }
        st.errors.remove(&ticket).map_or(Ok(()), Err)
    }

    /// Block until at most `allow_pending` tasks are queued or running (the original's
    /// `sync(allow_n_pending)`); return the first error of the tasks finished so far.
    pub fn sync(&self, allow_pending: usize) -> Result<()> {
        self.check_not_forked()?;
        let mut st = self.shared.state.lock().unwrap();
        while st.submitted - st.completed > allow_pending as u64 {
            st = self.shared.done.wait(st).unwrap();
        }
        match st.errors.pop_first() {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    /// Tasks queued or running.
    pub fn pending(&self) -> u64 {
        let st = self.shared.state.lock().unwrap();
        st.submitted - st.completed
    }
}

/// Run one task, turning a panic into an error.
fn run_task(task: Task, pool: &Pool, workspace: &mut Workspace) -> Result<()> {
    let mut ctx = Context { pool, workspace };
    catch_unwind(AssertUnwindSafe(|| task(&mut ctx))).unwrap_or_else(|p| {
        Err(Error::Runtime(format!(
            "task panicked: {}",
            panic_message(&*p)
        )))
    })
}

fn worker(shared: Arc<Shared>, pool: Arc<Pool>, workspace: Arc<Mutex<Workspace>>) {
    loop {
        let (ticket, task) = {
            let mut st = shared.state.lock().unwrap();
            loop {
                if let Some(item) = st.queue.pop_front() {
                    break item;
                }
                if st.shutdown {
                    return;
                }
                st = shared.work.wait(st).unwrap();
            }
        };
        let result = {
            let mut ws = workspace.lock().unwrap_or_else(|e| e.into_inner());
            run_task(task, &pool, &mut ws)
        };
        let mut st = shared.state.lock().unwrap();
        if let Err(e) = result {
            st.errors.insert(ticket, e);
        }
        st.completed = ticket;
        shared.done.notify_all();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // A forked child: the thread is not ours to join (it does not exist here).
            std::mem::forget(self.thread.take());
            return;
        }
        if let Ok(mut st) = self.shared.state.lock() {
            st.shutdown = true;
        }
        self.shared.work.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolConfig;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn engine() -> Engine {
        let mut cfg = PoolConfig::split(2, 1, None).unwrap();
        cfg.pin = false;
        Engine::new(Pool::new(cfg).unwrap()).unwrap()
    }

    type Gate = Arc<(Mutex<bool>, Condvar)>;

    /// Submit a task that blocks until the returned gate is opened (`open(&gate)`).
    fn submit_blocked(e: &Engine) -> Gate {
        let gate: Gate = Arc::new((Mutex::new(false), Condvar::new()));
        let g2 = gate.clone();
        e.submit(Box::new(move |_| {
            let (m, cv) = &*g2;
            let mut open = m.lock().unwrap();
            while !*open {
                open = cv.wait(open).unwrap();
            }
            Ok(())
        }));
        gate
    }

    fn open(gate: &Gate) {
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
    }

    #[test]
    fn fifo_order_and_sync() {
        let e = engine();
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut last = 0;
        for i in 0..50 {
            let log = log.clone();
            last = e.submit(Box::new(move |_| {
                log.lock().unwrap().push(i);
                Ok(())
            }));
        }
        e.sync(0).unwrap();
        assert_eq!(*log.lock().unwrap(), (0..50).collect::<Vec<_>>());
        assert_eq!(e.pending(), 0);
        e.wait(last).unwrap();
    }

    #[test]
    fn errors_and_panics_surface_at_wait() {
        let e = engine();
        let bad = e.submit(Box::new(|_| Err(Error::Invalid("boom".into()))));
        let panicky = e.submit(Box::new(|_| panic!("kaboom")));
        let good = e.submit(Box::new(|_| Ok(())));
        assert_eq!(e.wait(bad).unwrap_err(), Error::Invalid("boom".into()));
        let msg = e.wait(panicky).unwrap_err().to_string();
        assert!(msg.contains("kaboom"), "{msg}");
        e.wait(good).unwrap();
        // The engine still works after a panic.
        let n = Arc::new(AtomicUsize::new(0));
        let n2 = n.clone();
        let t = e.submit(Box::new(move |ctx| {
            ctx.pool.run_parts(&|_, team| {
                team.parallel_for(100, &|_| {
                    n2.fetch_add(1, Ordering::SeqCst);
                })
            })
        }));
        e.wait(t).unwrap();
        assert_eq!(n.load(Ordering::SeqCst), 100);
    }

    #[test]
    fn run_now_runs_inline_when_idle_and_keeps_order() {
        let e = Arc::new(engine());
        let caller = std::thread::current().id();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        // Submits while the inline task runs; that task must not start before it ends.
        let submitter = {
            let (e, log) = (e.clone(), log.clone());
            std::thread::spawn(move || {
                rx.recv().unwrap();
                e.submit(Box::new(move |_| {
                    log.lock().unwrap().push("queued");
                    Ok(())
                }))
            })
        };
        let (e2, log2) = (e.clone(), log.clone());
        e.run_now(Box::new(move |_| {
            // Idle: on the caller (with one NUMA node; else on the pinned engine thread).
            let inline = crate::topology::Topology::global().nodes.len() <= 1;
            assert_eq!(std::thread::current().id() == caller, inline);
            tx.send(()).unwrap();
            while e2.pending() < 2 {
                std::thread::yield_now();
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
            log2.lock().unwrap().push("inline");
            Ok(())
        }))
        .unwrap();
        e.wait(submitter.join().unwrap()).unwrap();
        assert_eq!(*log.lock().unwrap(), ["inline", "queued"]);
        assert_eq!(e.pending(), 0);
    }

    #[test]
    fn run_now_queues_behind_busy_work_and_reports_errors() {
        let e = engine();
        let gate = submit_blocked(&e);
        let caller = std::thread::current().id();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(std::time::Duration::from_millis(20));
                open(&gate);
            });
            // Busy: runs on the worker, after the blocked task.
            e.run_now(Box::new(move |_| {
                assert_ne!(std::thread::current().id(), caller);
                Ok(())
            }))
            .unwrap();
        });
        assert_eq!(
            e.run_now(Box::new(|_| Err(Error::Invalid("boom".into()))))
                .unwrap_err(),
            Error::Invalid("boom".into())
        );
        let msg = e.run_now(Box::new(|_| panic!("kaboom"))).unwrap_err();
        assert!(msg.to_string().contains("kaboom"), "{msg}");
        let t = e.submit(Box::new(|ctx| {
            ctx.pool
                .run_parts(&|_, team| team.parallel_for(10, &|_| {}))
        }));
        e.wait(t).unwrap();
        assert_eq!(e.pending(), 0);
    }

    #[test]
    fn sync_allows_pending() {
        let e = engine();
        let gate = submit_blocked(&e);
        // One task still blocked: sync(1) returns, sync(0) would wait.
        e.sync(1).unwrap();
        assert_eq!(e.pending(), 1);
        open(&gate);
        e.sync(0).unwrap();
    }
}
