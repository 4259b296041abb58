//! CPU work ordered on a CUDA stream, without building or linking against CUDA.
//!
//! The one driver call needed is `cuLaunchHostFunc(stream, fn, arg)`: the driver runs
//! `fn(arg)` on its own thread when the stream reaches that point, and a CUDA graph captured
//! from the stream replays it with the same `arg`. The driver library is opened with `dlopen`
//! at first use (`libcuda.so.1`, or the file `KT_KERNEL_CUDA_DRIVER` names: the tests use a
//! stand-in), so CPU-only machines never need it.
//!
//! Two host functions:
//! - *start* a [`StreamTask`]: queue its work on the engine and return at once (the stream
//!   goes on; copies enqueued after it may run before the CPU work finishes, which is why a
//!   *sync* comes before copying results back);
//! - *sync*: block the stream until the engine has at most `allow_pending` tasks.
//!
//! Copies between the caller's device tensors and the pinned staging buffers are enqueued on
//! the same stream with `cuMemcpyAsync` (unified addressing: the driver infers the direction),
//! in the stream's own context, so a submit is one call from Python and none of torch's
//! per-copy dispatch.
//!
//! Every `arg` is a descriptor that lives for the rest of the process (a captured graph may
//! replay it at any time): they are interned by key, so a steady loop reuses a fixed set and
//! allocates none per call. Errors met on the driver's thread cannot be raised there; they
//! are kept and handed to the next host call ([`take_errors`]).
use crate::engine::{Context, Engine};
use crate::{Error, Result};
use std::collections::{HashMap, HashSet};
use std::ffi::{c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};

/// `CUhostFn`.
type HostFn = unsafe extern "C" fn(*mut c_void);
/// `CUresult cuLaunchHostFunc(CUstream, CUhostFn, void*)`.
type LaunchHostFunc = unsafe extern "C" fn(*mut c_void, HostFn, *mut c_void) -> i32;

/// `CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream)`.
type MemcpyAsync = unsafe extern "C" fn(u64, u64, usize, *mut c_void) -> i32;
/// `cuStreamGetCtx(CUstream, CUcontext*)`, `cuCtxGetCurrent(CUcontext*)`,
/// `cuCtxPushCurrent_v2(CUcontext)` and `cuCtxPopCurrent_v2(CUcontext*)`.
type StreamGetCtx = unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> i32;
type CtxGetCurrent = unsafe extern "C" fn(*mut *mut c_void) -> i32;
type CtxPush = unsafe extern "C" fn(*mut c_void) -> i32;
type CtxPop = unsafe extern "C" fn(*mut *mut c_void) -> i32;

/// The entry points that make a stream's context current on the calling thread.
struct ContextCalls {
    stream_ctx: StreamGetCtx,
    current: CtxGetCurrent,
    push: CtxPush,
    pop: CtxPop,
}

/// The opened driver: its handle (for other entry points, [`symbol`]), `cuLaunchHostFunc`,
/// and the optional entry points for copies and contexts (a stand-in may lack them).
struct Driver {
    handle: usize,
    launch: LaunchHostFunc,
    memcpy: Option<MemcpyAsync>,
    context: Option<ContextCalls>,
}

/// One copy enqueued on a stream: `bytes` from `src` to `dst`, each a device address or a
/// pinned host address (the driver tells which under unified addressing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamCopy {
    /// Where the bytes go.
    pub dst: usize,
    /// Where they come from.
    pub src: usize,
    /// How many (a copy of none is skipped).
    pub bytes: usize,
}

/// The driver in use, or why none could be opened (decided once; [`use_driver`] replaces it).
/// Drivers are leaked: host functions may run at any time.
static DRIVER: Mutex<Option<std::result::Result<&'static Driver, String>>> = Mutex::new(None);

/// The library opened for `cuLaunchHostFunc` by default.
pub fn driver_library() -> String {
    std::env::var("KT_KERNEL_CUDA_DRIVER").unwrap_or_else(|_| "libcuda.so.1".into())
}

fn open_driver(name: &str) -> Result<Driver> {
    let c_name =
        CString::new(name).map_err(|_| Error::Invalid(format!("bad library name {name:?}")))?;
    // SAFETY: dlopen/dlsym with NUL-terminated strings; the handle is never closed, so the
    // symbol stays valid for the life of the process.
    unsafe {
        let handle = libc::dlopen(c_name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if handle.is_null() {
            return Err(Error::Runtime(format!(
                "cannot open the CUDA driver {name:?} (dlopen failed)"
            )));
        }
        let sym = libc::dlsym(handle, c"cuLaunchHostFunc".as_ptr());
        if sym.is_null() {
            return Err(Error::Runtime(format!("{name:?} has no cuLaunchHostFunc")));
        }
        let find = |name: &std::ffi::CStr| {
            let p = libc::dlsym(handle, name.as_ptr());
            (!p.is_null()).then_some(p)
        };
        let memcpy =
            find(c"cuMemcpyAsync").map(|p| std::mem::transmute::<*mut c_void, MemcpyAsync>(p));
        let context = match (
            find(c"cuStreamGetCtx"),
            find(c"cuCtxGetCurrent"),
            find(c"cuCtxPushCurrent_v2"),
            find(c"cuCtxPopCurrent_v2"),
        ) {
            (Some(s), Some(c), Some(push), Some(pop)) => Some(ContextCalls {
                stream_ctx: std::mem::transmute::<*mut c_void, StreamGetCtx>(s),
                current: std::mem::transmute::<*mut c_void, CtxGetCurrent>(c),
                push: std::mem::transmute::<*mut c_void, CtxPush>(push),
                pop: std::mem::transmute::<*mut c_void, CtxPop>(pop),
            }),
            _ => None,
        };
        Ok(Driver {
            handle: handle as usize,
            launch: std::mem::transmute::<*mut c_void, LaunchHostFunc>(sym),
            memcpy,
            context,
        })
    }
}

/// Open `library` and use its `cuLaunchHostFunc` from now on (tests use a stand-in).
pub fn use_driver(library: &str) -> Result<()> {
    let d: &'static Driver = Box::leak(Box::new(open_driver(library)?));
    *DRIVER.lock().unwrap_or_else(|e| e.into_inner()) = Some(Ok(d));
    Ok(())
}

fn driver() -> Result<&'static Driver> {
    let mut slot = DRIVER.lock().unwrap_or_else(|e| e.into_inner());
    let found = slot.get_or_insert_with(|| {
        open_driver(&driver_library())
            .map(|d| &*Box::leak(Box::new(d)))
            .map_err(|e| e.to_string())
    });
    found.clone().map_err(Error::Runtime)
}

/// The address of driver entry point `name` (e.g. `cuMemcpyHtoDAsync_v2`) in the driver in use.
pub fn symbol(name: &std::ffi::CStr) -> Result<*mut c_void> {
    let d = driver()?;
    // SAFETY: a handle dlopen returned and that is never closed; a NUL-terminated name.
    let sym = unsafe { libc::dlsym(d.handle as *mut c_void, name.as_ptr()) };
    if sym.is_null() {
        return Err(Error::Runtime(format!(
            "the CUDA driver {:?} has no {}",
            driver_library(),
            name.to_string_lossy()
        )));
    }
    Ok(sym)
}

/// Whether the entry points of the stream path (`cuLaunchHostFunc`, `cuMemcpyAsync`) can be
/// found (opens the driver on first call), and what was found.
pub fn driver_status() -> (bool, String) {
    match driver() {
        Ok(d) if d.memcpy.is_some() => (true, "cuLaunchHostFunc and cuMemcpyAsync found".into()),
        Ok(_) => (
            false,
            "cuLaunchHostFunc found, cuMemcpyAsync missing".into(),
        ),
        Err(e) => (false, e.to_string()),
    }
}

/// Work a stream may start any number of times.
pub type Work = Arc<dyn Fn(&mut Context<'_>) -> Result<()> + Send + Sync>;

/// A descriptor for *start*: the engine and the work it queues.
pub struct StreamTask {
    engine: Arc<Engine>,
    work: Work,
}

impl StreamTask {
    /// Queue the work on the engine now (the plain, stream-less submit of the same task);
    /// returns the engine ticket.
    pub fn submit(&self) -> u64 {
        let work = self.work.clone();
        self.engine.submit(Box::new(move |ctx| work(ctx)))
    }
}

/// A descriptor for *sync*.
struct StreamSync {
    engine: Arc<Engine>,
    allow_pending: usize,
}

#[derive(Default)]
struct Registry {
    tasks: HashMap<Vec<usize>, &'static StreamTask>,
    syncs: HashMap<(usize, usize), &'static StreamSync>,
    /// Addresses of every task descriptor handed out (checked when a caller passes one back).
    known: HashSet<usize>,
}

static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
static ERRORS: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    REGISTRY
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// The descriptor for `key` (the caller's identity of the work: owner and every address it
/// reads), made by `make` the first time. Descriptors are never freed.
pub fn persistent_task(
    key: Vec<usize>,
    engine: &Arc<Engine>,
    make: impl FnOnce() -> Work,
) -> &'static StreamTask {
    let mut reg = registry();
    let engine_key = Arc::as_ptr(engine) as usize;
    let mut full = Vec::with_capacity(key.len() + 1);
    full.push(engine_key);
    full.extend_from_slice(&key);
    if let Some(t) = reg.tasks.get(&full) {
        return t;
    }
    let task: &'static StreamTask = Box::leak(Box::new(StreamTask {
        engine: engine.clone(),
        work: make(),
    }));
    reg.known.insert(task as *const StreamTask as usize);
    reg.tasks.insert(full, task);
    task
}

/// The descriptor at `address`, if it is one [`persistent_task`] handed out.
pub fn task_at(address: usize) -> Result<&'static StreamTask> {
    let reg = registry();
    if !reg.known.contains(&address) {
        return Err(Error::Invalid(format!(
            "0x{address:x} is not a task made by forward_task (or stream_task)"
        )));
    }
    // SAFETY: the address is a leaked, never-freed StreamTask (checked just above).
    Ok(unsafe { &*(address as *const StreamTask) })
}

/// Descriptors made so far (tasks and syncs): a steady loop must not grow it.
pub fn descriptor_count() -> usize {
    let reg = registry();
    reg.tasks.len() + reg.syncs.len()
}

fn sync_descriptor(engine: &Arc<Engine>, allow_pending: usize) -> &'static StreamSync {
    let mut reg = registry();
    let key = (Arc::as_ptr(engine) as usize, allow_pending);
    reg.syncs.entry(key).or_insert_with(|| {
        Box::leak(Box::new(StreamSync {
            engine: engine.clone(),
            allow_pending,
        }))
    })
}

/// Errors met on the driver's thread since the last call (oldest first).
pub fn take_errors() -> Vec<String> {
    std::mem::take(&mut *ERRORS.lock().unwrap_or_else(|e| e.into_inner()))
}

fn record(message: String) {
    ERRORS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(message);
}

/// Host function: queue the task's work.
unsafe extern "C" fn start_trampoline(arg: *mut c_void) {
    // SAFETY: `arg` is a &'static StreamTask (only `launch` passes this function).
    let task = unsafe { &*(arg as *const StreamTask) };
    if catch_unwind(AssertUnwindSafe(|| task.submit())).is_err() {
        record("submitting a stream task panicked".into());
    }
}

/// Host function: hold the stream until the engine has drained to `allow_pending`.
unsafe extern "C" fn sync_trampoline(arg: *mut c_void) {
    // SAFETY: `arg` is a &'static StreamSync (only `sync_on_stream` passes this function).
    let sync = unsafe { &*(arg as *const StreamSync) };
    match catch_unwind(AssertUnwindSafe(|| sync.engine.sync(sync.allow_pending))) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => record(e.to_string()),
        Err(_) => record("waiting for the CPU tasks on a stream panicked".into()),
    }
}

fn check(code: i32, what: &str, stream: usize) -> Result<()> {
    if code != 0 {
        return Err(Error::Runtime(format!(
            "{what} failed with CUresult {code} (stream 0x{stream:x})"
        )));
    }
    Ok(())
}

/// Run `f` with the context of `stream` current on this thread (pushed only when another one
/// is: the caller's thread normally has it already). Without the context entry points, or
/// for a stream whose context cannot be asked, `f` runs in whatever context is current.
fn in_stream_context<R>(d: &Driver, stream: usize, f: impl FnOnce() -> Result<R>) -> Result<R> {
    let Some(c) = &d.context else { return f() };
    let mut wanted = std::ptr::null_mut();
    let mut current = std::ptr::null_mut();
    // SAFETY: out-pointers to locals; the stream handle is the caller's (as for every call).
    let known = unsafe {
        (c.stream_ctx)(stream as *mut c_void, &mut wanted) == 0 && (c.current)(&mut current) == 0
    };
    if !known || wanted.is_null() || wanted == current {
        return f();
    }
    // SAFETY: a context the driver just named; popped again below whatever `f` returns.
    check(unsafe { (c.push)(wanted) }, "cuCtxPushCurrent", stream)?;
    let result = f();
    let mut popped = std::ptr::null_mut();
    // SAFETY: pops the context pushed above.
    let popped_ok = check(unsafe { (c.pop)(&mut popped) }, "cuCtxPopCurrent", stream);
    let value = result?;
    popped_ok.map(|_| value)
}

fn enqueue_copies(d: &Driver, stream: usize, copies: &[StreamCopy]) -> Result<()> {
    if copies.is_empty() {
        return Ok(());
    }
    let Some(memcpy) = d.memcpy else {
        return Err(Error::Runtime(format!(
            "the CUDA driver {:?} has no cuMemcpyAsync",
            driver_library()
        )));
    };
    for c in copies {
        if c.bytes == 0 {
            continue;
        }
        // SAFETY: addresses checked non-null by the caller; that they name `bytes` of live
        // device or pinned host memory until the stream has passed the copy is the caller's
        // contract, as for cudaMemcpyAsync.
        let code = unsafe { memcpy(c.dst as u64, c.src as u64, c.bytes, stream as *mut c_void) };
        check(code, "cuMemcpyAsync", stream)?;
    }
    Ok(())
}

fn check_copies(copies: &[StreamCopy]) -> Result<()> {
    for c in copies {
        if c.bytes > 0 && (c.dst == 0 || c.src == 0) {
            return Err(Error::Invalid(format!(
                "a stream copy of {} bytes has a null address (dst 0x{:x}, src 0x{:x})",
                c.bytes, c.dst, c.src
            )));
        }
    }
    Ok(())
}

fn launch(d: &Driver, stream: usize, f: HostFn, arg: *const c_void) -> Result<()> {
    // SAFETY: the driver's documented contract: a stream handle of the caller's context (the
    // caller's responsibility, as for every CUDA call made with a handle), a host function
    // and an argument that stays valid as long as the stream or a graph may call it ('static).
    let code = unsafe { (d.launch)(stream as *mut c_void, f, arg as *mut c_void) };
    check(code, "cuLaunchHostFunc", stream)
}

/// Enqueue `copies_before` and then *start* of `task` on `stream`; returns at once.
pub fn start_on_stream(
    stream: usize,
    task: &'static StreamTask,
    copies_before: &[StreamCopy],
) -> Result<()> {
    check_copies(copies_before)?;
    let d = driver()?;
    in_stream_context(d, stream, || {
        enqueue_copies(d, stream, copies_before)?;
        launch(
            d,
            stream,
            start_trampoline,
            task as *const StreamTask as *const c_void,
        )
    })
}

/// Enqueue *sync* on `stream` for `engine`, then `copies_after`: later work on the stream
/// (the copies first) waits until at most `allow_pending` engine tasks remain.
pub fn sync_on_stream(
    stream: usize,
    engine: &Arc<Engine>,
    allow_pending: usize,
    copies_after: &[StreamCopy],
) -> Result<()> {
    check_copies(copies_after)?;
    let d = driver()?;
    let sync = sync_descriptor(engine, allow_pending);
    in_stream_context(d, stream, || {
        launch(
            d,
            stream,
            sync_trampoline,
            sync as *const StreamSync as *const c_void,
        )?;
        enqueue_copies(d, stream, copies_after)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::{Pool, PoolConfig};

    fn engine() -> Arc<Engine> {
        let mut cfg = PoolConfig::split(1, 1, None).unwrap();
        cfg.pin = false;
        Arc::new(Engine::new(Pool::new(cfg).unwrap()).unwrap())
    }

    #[test]
    fn descriptors_are_interned_checked_and_runnable_without_a_stream() {
        let e = engine();
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let r = runs.clone();
        let make = move || -> Work {
            Arc::new(move |_: &mut Context<'_>| {
                r.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok(())
            })
        };
        let a = persistent_task(vec![7, 1, 2], &e, make.clone());
        let b = persistent_task(vec![7, 1, 2], &e, make.clone());
        let c = persistent_task(vec![7, 1, 3], &e, make);
        assert!(std::ptr::eq(a, b) && !std::ptr::eq(a, c));
        let address = a as *const StreamTask as usize;
        assert!(std::ptr::eq(task_at(address).unwrap(), a));
        assert!(task_at(address + 8).is_err());
        for _ in 0..3 {
            task_at(address).unwrap().submit();
        }
        e.sync(0).unwrap();
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 3);
    }

    #[test]
    fn a_missing_driver_is_an_error_not_a_crash() {
        let err = use_driver("/nonexistent/libcuda.so.1").unwrap_err();
        assert!(err.to_string().contains("dlopen failed"), "{err}");
        let err = use_driver("libc.so.6").unwrap_err();
        assert!(err.to_string().contains("no cuLaunchHostFunc"), "{err}");
    }
}
