//! `kt_kernel._kt_core`: PyO3 bindings of kt-core. Argument conversion, GIL release and error
//! mapping only; tensors arrive as addresses already checked by `kt_kernel` (shape, dtype,
//! device, contiguity).
#![deny(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)]
use kt_core::convert::{ConversionJob, ConvertOptions, ConvertReport, InputType};
use kt_core::dtype::FloatType;
use kt_core::engine::{Engine as CoreEngine, Task};
use kt_core::expert_pointers::{ExpertAddresses, PointerSource};
use kt_core::formats::GpuRankDst;
use kt_core::ggml::{self, GgmlType};
use kt_core::isa;
use kt_core::kernels::KernelSet;
use kt_core::method::Method;
use kt_core::moe::{ForwardArgs, MoeConfig, MoeLayer as CoreLayer, TensorSource};
use kt_core::pool::{Pool, PoolConfig};
use kt_core::topology::Topology;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock};

mod errors;
mod layerwise;
use errors::IntoPy;

/// Variant name in force (raises if `KT_KERNEL_CPU_VARIANT` is invalid or too high).
#[pyfunction]
fn cpu_variant() -> PyResult<&'static str> {
    Ok(isa::global().py()?.chosen.name())
}

/// Errors met by stream tasks on the CUDA driver's thread since the last call.
#[pyfunction]
fn stream_errors() -> Vec<String> {
    kt_core::cuda_bridge::take_errors()
}

/// Process-lifetime stream descriptors made so far (a steady loop does not add any).
#[pyfunction]
fn stream_descriptor_count() -> usize {
    kt_core::cuda_bridge::descriptor_count()
}

/// Use the `cuLaunchHostFunc` of `library` from now on (a stand-in driver for tests).
#[pyfunction]
fn use_cuda_driver(library: &str) -> PyResult<()> {
    kt_core::cuda_bridge::use_driver(library).py()
}

/// (found, message): whether `cuLaunchHostFunc` can be opened from the CUDA driver.
#[pyfunction]
fn cuda_driver_status() -> (bool, String) {
    kt_core::cuda_bridge::driver_status()
}

/// The machine's physical cores (hwloc), without the prefetch calibrations `cpu_info` runs.
#[pyfunction]
fn physical_cores() -> usize {
    Topology::global().total_physical_cores()
}

/// Everything known about this CPU and process, as a dict.
#[pyfunction]
fn cpu_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let sel = isa::global().py()?;
    // First: the bf16 calibration inside KernelSet::best times kernels that prefetch.
    let prefetch_bytes = kt_core::formats::prefetch_distance().py()?;
    let d = PyDict::new(py);
    d.set_item("vendor", &sel.features.vendor)?;
    d.set_item("brand", &sel.features.brand)?;
    d.set_item("variant", sel.chosen.name())?;
    d.set_item("detected_variant", sel.detected.name())?;
    d.set_item("requested_variant", sel.requested.clone())?;
    let flags = PyDict::new(py);
    for (name, ok) in &sel.features.flags {
        flags.set_item(*name, *ok)?;
    }
    d.set_item("flags", flags)?;
    d.set_item("amx_hardware", sel.features.amx_hardware)?;
    d.set_item("amx_permission", sel.features.amx_permission)?;
    let topo = Topology::global();
    d.set_item("topology", topo.describe())?;
    let nodes: Vec<(u32, usize)> = topo
        .nodes
        .iter()
        .map(|n| (n.os_index, n.cores.len()))
        .collect();
    d.set_item("numa_nodes", nodes)?;
    d.set_item("physical_cores", topo.total_physical_cores())?;
    let kernels = PyDict::new(py);
    let prefill_kernels = PyDict::new(py);
    let best = KernelSet::best().py()?;
    kernels.set_item("BF16", best.name())?;
    let level = best.level();
    let int8 = kt_core::formats::int8::kernels::vector_kernel(level);
    kernels.set_item("AMXINT8", int8.name)?;
    kernels.set_item("FP8", kt_core::formats::fp8::kernel_name(&best))?;
    for spec in [
        kt_core::formats::kgroup::RAWINT4,
        kt_core::formats::kgroup::GPTQ_INT4,
        kt_core::formats::kgroup::MXFP4,
        kt_core::formats::kgroup::NVFP4,
        kt_core::formats::kgroup::MXFP8,
    ] {
        let decode = kt_core::formats::kgroup::decode_kernel_name(&spec, level);
        kernels.set_item(spec.method.name(), decode)?;
        let prefill = kt_core::formats::kgroup::prefill_kernel_name(&spec, &best);
        prefill_kernels.set_item(spec.method.name(), prefill)?;
    }
    kernels.set_item("AMX", best.amx_name())?;
    // What the group-scaled methods multiply with once an expert has more than a few rows.
    d.set_item("prefill_kernels", prefill_kernels)?;
    d.set_item(
        "amx_min_rows",
        kt_core::kernels::amx_min_rows_from_env().py()?,
    )?;
    // Per method: KT_KERNEL_AMX_MIN_ROWS when set, else the method's measured default.
    let amx_rows = PyDict::new(py);
    let asked = kt_core::kernels::amx_min_rows_env().py()?;
    for m in kt_core::formats::implemented() {
        let rows = asked.unwrap_or(kt_core::formats::amx_min_rows_default(m));
        amx_rows.set_item(m.name(), rows)?;
    }
    d.set_item("amx_min_rows_by_method", amx_rows)?;
    // The tile-load programs' distance now: KT_KERNEL_AMX_PREFETCH's, else what prefills
    // tuned (amx_prefetch_state).
    let amx_prefetch = kt_core::kernels::amx_prefetch_env().py()?;
    d.set_item(
        "amx_prefetch_bytes",
        amx_prefetch.unwrap_or_else(|| {
            kt_core::kernels::amx::prefetch_bytes(kt_core::kernels::amx::AmxStream::Tiles)
        }),
    )?;
    d.set_item("kernels", kernels)?;
    d.set_item("prefetch_bytes", prefetch_bytes)?;
    d.set_item(
        "prefetch_bytes_int8",
        kt_core::formats::prefetch_distance_int8().py()?,
    )?;
    // The group-scaled methods' kernels choose their own distance (kernels::prefetch).
    d.set_item(
        "prefetch_bytes_group_scaled",
        kt_core::formats::kgroup::prefetch_distance().py()?,
    )?;
    d.set_item(
        "prefetch_bytes_fp8",
        kt_core::formats::fp8::prefetch_distance().py()?,
    )?;
    d.set_item(
        "prefetch_bytes_gguf",
        kt_core::formats::ggml::prefetch_distance().py()?,
    )?;
    // The instruction mix each yardstick probe runs (the benchmark reports it beside the figures).
    let probes = PyDict::new(py);
    probes.set_item("read", kt_core::probe::read_probe_width())?;
    for kind in kt_core::probe::PEAK_KINDS {
        probes.set_item(kind, kt_core::probe::peak_variant(kind))?;
    }
    d.set_item("probes", probes)?;
    Ok(d)
}

/// Whether `path` holds files converted by the original for layer `layer_idx`.
#[pyfunction]
fn has_converted_layer(path: PathBuf, layer_idx: usize) -> PyResult<bool> {
    kt_core::converted::has_converted_layer(&path, layer_idx).py()
}

/// Build facts: version, profile, compiled ISA paths.
#[pyfunction]
fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", env!("CARGO_PKG_VERSION"))?;
    d.set_item("core_version", kt_core::VERSION)?;
    d.set_item("git_revision", env!("KT_GIT_REVISION"))?;
    d.set_item(
        "profile",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
    )?;
    let mut kernels = vec![
        "scalar",
        "avx2-fma",
        "avx512-fma",
        "avx512-bf16dot",
        "amx-emulated",
    ];
    if kt_core::kernels::amx::HARDWARE_BUILT {
        kernels.push("amx");
    }
    d.set_item("kernels", kernels)?;
    d.set_item("hwloc", cfg!(feature = "hwloc"))?;
    Ok(d)
}

/// Dequantize `n` values of ggml type `type_name` (e.g. "Q4_K", case-insensitive) from `data`;
/// returns the values as little-endian float32 bytes. ValueError for an unknown name or a size
/// that does not fit; NotImplementedError for a known type without a dequantizer here.
#[pyfunction]
fn ggml_dequantize<'py>(
    py: Python<'py>,
    type_name: &str,
    data: &[u8],
    n: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let ty = GgmlType::parse(type_name).py()?;
    let values = py.detach(|| ggml::dequantize(ty, data, n)).py()?;
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    Ok(PyBytes::new(py, &bytes))
}

/// Quantize little-endian values (`data`, of `dtype` float32, bfloat16 or float16) to ggml type
/// `type_name`; returns the block bytes, made on `threads` threads (0 = all cores). ValueError for a size that is
/// not whole blocks or a non-finite value; TypeError for another dtype; NotImplementedError for
/// a type without a quantizer here.
#[pyfunction]
#[pyo3(signature = (type_name, data, threads=0, dtype="float32"))]
fn ggml_quantize<'py>(
    py: Python<'py>,
    type_name: &str,
    data: &[u8],
    threads: usize,
    dtype: &str,
) -> PyResult<Bound<'py, PyBytes>> {
    let ty = GgmlType::parse(type_name).py()?;
    let src_type = FloatType::parse(dtype).py()?;
    let out = py
        .detach(|| ggml::quantize_bytes(ty, data, src_type, threads))
        .py()?;
    Ok(PyBytes::new(py, &out))
}

/// `(threads per sub-pool, NUMA node per sub-pool)` for `total_threads` over `subpool_count`
/// sub-pools, as the original splits them.
#[pyfunction]
#[pyo3(signature = (total_threads, subpool_count, numa_nodes=None))]
fn pool_split(
    total_threads: usize,
    subpool_count: usize,
    numa_nodes: Option<Vec<u32>>,
) -> PyResult<(Vec<usize>, Vec<u32>)> {
    let cfg = PoolConfig::split(total_threads, subpool_count, numa_nodes.as_deref()).py()?;
    Ok((cfg.threads, cfg.numa_nodes))
}

/// The read probe's pages: huge pages (as the weights) or what a plain allocation gets.
fn probe_pages(huge_pages: bool) -> kt_core::probe::Pages {
    if huge_pages {
        kt_core::probe::Pages::Huge
    } else {
        kt_core::probe::Pages::Default
    }
}

fn stream_copies(copies: &[(usize, usize, usize)]) -> Vec<kt_core::cuda_bridge::StreamCopy> {
    copies
        .iter()
        .map(|&(dst, src, bytes)| kt_core::cuda_bridge::StreamCopy { dst, src, bytes })
        .collect()
}

/// The task engine and its worker pool (the original's `CPUInfer`).
#[pyclass(module = "kt_kernel._kt_core", frozen)]
struct Engine {
    inner: Arc<CoreEngine>,
}

#[pymethods]
impl Engine {
    /// `threads[i]` workers on NUMA node `numa_nodes[i]`, one sub-pool each.
    #[new]
    #[pyo3(signature = (threads, numa_nodes, pin=true))]
    fn new(py: Python<'_>, threads: Vec<usize>, numa_nodes: Vec<u32>, pin: bool) -> PyResult<Self> {
        let cfg = PoolConfig {
            numa_nodes,
            threads,
            pin,
        };
        let inner = py
            .detach(|| Pool::new(cfg).and_then(CoreEngine::new))
            .py()?;
        Ok(Engine {
            inner: Arc::new(inner),
        })
    }

    /// Sub-pools.
    #[getter]
    fn parts(&self) -> usize {
        self.inner.pool().parts()
    }

    /// Threads across all sub-pools.
    #[getter]
    fn total_threads(&self) -> usize {
        self.inner.pool().total_threads()
    }

    /// Planned CPU per thread, per sub-pool (None = unpinned).
    fn pinning(&self) -> Vec<Vec<Option<u32>>> {
        self.inner.pool().pinning().to_vec()
    }

    /// Notes from thread placement.
    fn warnings(&self) -> Vec<String> {
        self.inner.pool().warnings().to_vec()
    }

    /// Wait for task `ticket`; raises that task's error.
    fn wait(&self, py: Python<'_>, ticket: u64) -> PyResult<()> {
        let e = self.inner.clone();
        py.detach(move || e.wait(ticket)).py()
    }

    /// Wait until at most `allow_n_pending` tasks remain; raises the first error seen.
    #[pyo3(signature = (allow_n_pending=0))]
    fn sync(&self, py: Python<'_>, allow_n_pending: usize) -> PyResult<()> {
        let e = self.inner.clone();
        py.detach(move || e.sync(allow_n_pending)).py()
    }

    /// Tasks queued or running.
    fn pending(&self) -> u64 {
        self.inner.pending()
    }

    /// Queue a stream task (`MoeLayer.stream_task`) on this engine now; returns its ticket.
    fn submit_task(&self, task: usize) -> PyResult<u64> {
        Ok(kt_core::cuda_bridge::task_at(task).py()?.submit())
    }

    /// Enqueue on CUDA stream `stream` (a `cudaStream_t` as int) the `copies_before`
    /// (`(dst, src, bytes)` addresses, `cuMemcpyAsync`), then the start of a stream task: the
    /// engine queues it when the stream gets there. Returns at once.
    #[pyo3(signature = (stream, task, copies_before=Vec::new()))]
    fn start_on_stream(
        &self,
        stream: usize,
        task: usize,
        copies_before: Vec<(usize, usize, usize)>,
    ) -> PyResult<()> {
        let task = kt_core::cuda_bridge::task_at(task).py()?;
        kt_core::cuda_bridge::start_on_stream(stream, task, &stream_copies(&copies_before)).py()
    }

    /// Enqueue a wait on CUDA stream `stream`, then `copies_after` (`(dst, src, bytes)`): work
    /// enqueued after the wait runs once at most `allow_n_pending` of this engine's tasks
    /// remain. Returns at once.
    #[pyo3(signature = (stream, allow_n_pending=0, copies_after=Vec::new()))]
    fn sync_on_stream(
        &self,
        stream: usize,
        allow_n_pending: usize,
        copies_after: Vec<(usize, usize, usize)>,
    ) -> PyResult<()> {
        let copies = stream_copies(&copies_after);
        kt_core::cuda_bridge::sync_on_stream(stream, &self.inner, allow_n_pending, &copies).py()
    }

    /// Best-of-`repeats` DRAM read bandwidth in GB/s over `bytes`, using every thread; the
    /// buffer in huge pages (as the weights) unless `huge_pages` is false.
    #[pyo3(signature = (bytes=1 << 30, repeats=5, huge_pages=true))]
    fn measure_read_bandwidth(
        &self,
        py: Python<'_>,
        bytes: usize,
        repeats: usize,
        huge_pages: bool,
    ) -> PyResult<f64> {
        let pages = probe_pages(huge_pages);
        let e = self.inner.clone();
        py.detach(move || kt_core::probe::dram_read_gbps_in(e.pool(), bytes, repeats, pages))
            .py()
    }

    /// The DRAM read bandwidth (GB/s) of each of `passes` passes over one buffer of `bytes`,
    /// after one untimed pass, in huge pages unless `huge_pages` is false (for a median).
    #[pyo3(signature = (bytes=1 << 30, passes=5, huge_pages=true))]
    fn measure_read_passes(
        &self,
        py: Python<'_>,
        bytes: usize,
        passes: usize,
        huge_pages: bool,
    ) -> PyResult<Vec<f64>> {
        let pages = probe_pages(huge_pages);
        let e = self.inner.clone();
        py.detach(move || kt_core::probe::dram_read_passes_in(e.pool(), bytes, passes, pages))
            .py()
    }

    /// Peak rate (G operations/s) of "fma" (fp32 FMA), "int8" (u8·s8 multiply-add) or "bf16"
    /// (bf16 dot) on every thread, or None where the CPU lacks the instructions.
    #[pyo3(signature = (kind, millis=300))]
    fn measure_peak_gflops(
        &self,
        py: Python<'_>,
        kind: String,
        millis: u64,
    ) -> PyResult<Option<f64>> {
        let e = self.inner.clone();
        py.detach(move || kt_core::probe::simd_peak_gflops(e.pool(), &kind, millis))
            .py()
    }

    /// Bytes of forward scratch currently held.
    fn workspace_bytes(&self) -> usize {
        self.inner.with_workspace(|w| w.bytes())
    }
}

/// One MoE layer bound to an engine.
#[pyclass(module = "kt_kernel._kt_core", frozen)]
struct MoeLayer {
    engine: Arc<CoreEngine>,
    layer: Arc<RwLock<CoreLayer>>,
    /// Unique per layer object for the life of the process (keys its stream descriptors).
    serial: usize,
}

/// Serial numbers of layer objects.
static LAYER_SERIAL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);

fn run_blocking(
    py: Python<'_>,
    engine: &Arc<CoreEngine>,
    task: kt_core::engine::Task,
) -> PyResult<()> {
    let e = engine.clone();
    py.detach(move || {
        let t = e.submit(task);
        e.wait(t)
    })
    .py()
}

fn parse_map(map_ptr: usize, map_len: usize) -> Option<Vec<i64>> {
    // SAFETY: the Python layer passes the address of a live, contiguous int64 CPU tensor of
    // `map_len` elements (it checked dtype, device and shape), or 0 for "identity".
    (map_ptr != 0)
        .then(|| unsafe { std::slice::from_raw_parts(map_ptr as *const i64, map_len) }.to_vec())
}

#[pymethods]
impl MoeLayer {
    #[new]
    #[pyo3(signature = (engine, layer_idx, num_experts, top_k, hidden_size, intermediate_size,
                        max_tokens, swiglu_limit=0.0, swiglu_alpha=0.0, kernel=None,
                        method="BF16"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        engine: &Engine,
        layer_idx: usize,
        num_experts: usize,
        top_k: usize,
        hidden_size: usize,
        intermediate_size: usize,
        max_tokens: usize,
        swiglu_limit: f32,
        swiglu_alpha: f32,
        kernel: Option<&str>,
        method: &str,
    ) -> PyResult<Self> {
        let method = Method::parse(method).py()?;
        let config = MoeConfig {
            layer_idx,
            num_experts,
            top_k,
            hidden: hidden_size,
            intermediate: intermediate_size,
            max_tokens,
            swiglu_limit,
            swiglu_alpha,
        };
        let kernels = kt_core::formats::kernels_for(kernel).py()?;
        let layer =
            CoreLayer::with_method(config, engine.inner.pool().parts(), kernels, method).py()?;
        // Plan the forward scratch now (shared by all layers of the engine), not on first use.
        engine.inner.with_workspace(|w| w.reserve(&layer)).py()?;
        Ok(MoeLayer {
            engine: engine.inner.clone(),
            layer: Arc::new(RwLock::new(layer)),
            serial: LAYER_SERIAL.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// Kernel name in use.
    #[getter]
    fn kernel(&self) -> String {
        self.layer.read().unwrap().kernel_name()
    }

    /// Bytes the layer's expert weights take in bf16 (2 per weight for every method: a size
    /// for GB/s and GFLOP/s figures, not what a quantized method holds in memory).
    #[getter]
    fn weight_bytes(&self) -> usize {
        self.layer.read().unwrap().config().weight_bytes()
    }

    /// Whether weights are loaded.
    #[getter]
    fn loaded(&self) -> bool {
        self.layer.read().unwrap().is_loaded()
    }

    /// Pack weights from three contiguous CPU tensors gate/up `[E,I,H]`, down `[E,H,I]` of
    /// `dtype`; `map_ptr` = int64 `[map_len]` physical→logical (0 = identity). Blocks.
    #[pyo3(signature = (gate_ptr, up_ptr, down_ptr, dtype, experts, map_ptr=0, map_len=0))]
    #[allow(clippy::too_many_arguments)]
    fn load_from_tensors(
        &self,
        py: Python<'_>,
        gate_ptr: usize,
        up_ptr: usize,
        down_ptr: usize,
        dtype: &str,
        experts: usize,
        map_ptr: usize,
        map_len: usize,
    ) -> PyResult<()> {
        let dtype = FloatType::parse(dtype).py()?;
        let (hidden, intermediate) = {
            let l = self.layer.read().unwrap();
            (l.config().hidden, l.config().intermediate)
        };
        let source = TensorSource {
            gate: gate_ptr as *const u8,
            up: up_ptr as *const u8,
            down: down_ptr as *const u8,
            dtype,
            experts,
            hidden,
            intermediate,
        };
        // SAFETY-relevant: the Python caller keeps the tensors alive until this call returns,
        // and the call blocks until the engine has run the load.
        let source = SendSource(source);
        self.load_blocking(py, map_ptr, map_len, move |l, pool, map| {
            let s = source;
            l.load(pool, &s.0, map)
        })
    }

    /// Pack experts handed over one tensor per expert and projection, by address, in the
    /// layouts the original's native loaders leave in memory (`kt_core::expert_pointers`):
    /// `weights`/`scales` are `[gate, up, down]` lists of one address per logical expert
    /// (scales empty for BF16); `group_size` is the original's `quant_config.group_size`.
    /// Blocks until loaded.
    #[pyo3(signature = (weights, scales, group_size, map_ptr=0, map_len=0))]
    fn load_from_addresses(
        &self,
        py: Python<'_>,
        weights: [Vec<usize>; 3],
        scales: [Vec<usize>; 3],
        group_size: usize,
        map_ptr: usize,
        map_len: usize,
    ) -> PyResult<()> {
        let (method, hidden, intermediate) = {
            let l = self.layer.read().unwrap();
            (l.method(), l.config().hidden, l.config().intermediate)
        };
        let addrs = ExpertAddresses { weights, scales };
        // SAFETY: the caller (the ext layer's load_weights) passes addresses of live tensors
        // of the documented layouts and keeps them alive until this blocking call returns.
        let source =
            unsafe { PointerSource::new(method, hidden, intermediate, group_size, &addrs) }.py()?;
        let source = SendSource(source);
        self.load_blocking(py, map_ptr, map_len, move |l, pool, map| {
            let s = source;
            l.load(pool, &s.0, map)
        })
    }

    /// Read this layer's experts from a Hugging Face safetensors checkpoint. Blocks.
    #[pyo3(signature = (path, layer_idx, map_ptr=0, map_len=0))]
    fn load_from_checkpoint(
        &self,
        py: Python<'_>,
        path: PathBuf,
        layer_idx: usize,
        map_ptr: usize,
        map_len: usize,
    ) -> PyResult<()> {
        self.load_blocking(py, map_ptr, map_len, move |l, pool, map| {
            l.load_checkpoint(pool, &path, layer_idx, map)
        })
    }

    /// Read this layer's experts from files converted by the original (AMXINT8/AMXINT4, merged
    /// safetensors or `_layer_L/_numa_N/*.kt`). Blocks. The maps are released before returning.
    #[pyo3(signature = (path, layer_idx, map_ptr=0, map_len=0))]
    fn load_from_converted(
        &self,
        py: Python<'_>,
        path: PathBuf,
        layer_idx: usize,
        map_ptr: usize,
        map_len: usize,
    ) -> PyResult<()> {
        self.load_blocking(py, map_ptr, map_len, move |l, pool, map| {
            l.load_converted_path(pool, &path, layer_idx, map)
        })
    }

    /// Read this AMXINT8/AMXINT4 layer's converted experts from tensors by address:
    /// `weights`/`scales` are `[gate, up, down]` lists of `[numa][expert]` addresses of the
    /// converted matrices (file layout) and f32 row scales (the original's
    /// `MOEConfig.gate_projs`/`gate_scales` for its merged converted files). Blocks.
    #[pyo3(signature = (weights, scales, map_ptr=0, map_len=0))]
    fn load_converted_from_addresses(
        &self,
        py: Python<'_>,
        weights: [Vec<Vec<usize>>; 3],
        scales: [Vec<Vec<usize>>; 3],
        map_ptr: usize,
        map_len: usize,
    ) -> PyResult<()> {
        let addrs = kt_core::converted::ConvertedAddresses { weights, scales };
        self.load_blocking(py, map_ptr, map_len, move |l, pool, map| {
            // SAFETY: the caller (the ext layer's load_weights) passes addresses of live
            // tensors of the converted sizes and keeps them until this call returns.
            unsafe { l.load_converted_addresses(pool, &addrs, map) }
        })
    }

    /// Copy this LLAMAFILE layer's experts from stacked tensors in GGUF's layout by address
    /// (gate/up `[E][I][H]`, down `[E][H][I]` in ggml blocks of `*_type`, the ggml type ids),
    /// as the original's `MOE` class takes them. Blocks.
    #[pyo3(signature = (gate_ptr, up_ptr, down_ptr, gate_type, up_type, down_type, map_ptr=0,
                        map_len=0))]
    #[allow(clippy::too_many_arguments)]
    fn load_ggml_from_addresses(
        &self,
        py: Python<'_>,
        gate_ptr: usize,
        up_ptr: usize,
        down_ptr: usize,
        gate_type: u32,
        up_type: u32,
        down_type: u32,
        map_ptr: usize,
        map_len: usize,
    ) -> PyResult<()> {
        let tensors = [
            (gate_ptr, gate_type),
            (up_ptr, up_type),
            (down_ptr, down_type),
        ];
        self.load_blocking(py, map_ptr, map_len, move |l, pool, map| {
            // SAFETY: the caller (the ext layer's load_weights, as the original's) keeps the
            // three tensors of the stated types alive until this call returns.
            unsafe { l.load_ggml_addresses(pool, tensors, map) }
        })
    }

    /// Copy layer `layer_idx`'s experts from a GGUF file or a folder of GGUF shards into this
    /// `format="gguf"` layer (the file decides the ggml types). Blocks; the files are unmapped
    /// before returning.
    #[pyo3(signature = (path, layer_idx, map_ptr=0, map_len=0))]
    fn load_from_gguf(
        &self,
        py: Python<'_>,
        path: PathBuf,
        layer_idx: usize,
        map_ptr: usize,
        map_len: usize,
    ) -> PyResult<()> {
        let map = parse_map(map_ptr, map_len);
        let layer = self.layer.clone();
        run_blocking(
            py,
            &self.engine,
            Box::new(move |ctx| {
                let mut l = layer.write().unwrap();
                l.load_gguf_path(ctx.pool, &path, layer_idx, map.as_deref())?;
                // Plan the forward scratch for the file's activation formats now.
                ctx.workspace.reserve(&l)
            }),
        )
    }

    /// ggml types of a loaded GGUF layer as `(gate_up, down)` names, else None.
    #[getter]
    fn ggml_types(&self) -> Option<(&'static str, &'static str)> {
        let l = self.layer.read().unwrap();
        l.ggml_types().map(|t| (t.gate_up.name(), t.down.name()))
    }

    /// Queue a forward; returns a ticket for `Engine.wait`. All addresses must stay valid
    /// until then (the Python layer keeps the tensors referenced).
    #[pyo3(signature = (qlen, hidden_ptr, hidden_dtype, ids_ptr, ids_dtype, weights_ptr, out_ptr,
                        out_dtype, residual_ptr=0, residual_dtype="float32", mask_ptr=0))]
    #[allow(clippy::too_many_arguments)]
    fn submit_forward(
        &self,
        qlen: usize,
        hidden_ptr: usize,
        hidden_dtype: &str,
        ids_ptr: usize,
        ids_dtype: &str,
        weights_ptr: usize,
        out_ptr: usize,
        out_dtype: &str,
        residual_ptr: usize,
        residual_dtype: &str,
        mask_ptr: usize,
    ) -> PyResult<u64> {
        let task = self.forward_task(
            qlen,
            [
                hidden_ptr,
                ids_ptr,
                weights_ptr,
                out_ptr,
                residual_ptr,
                mask_ptr,
            ],
            [hidden_dtype, ids_dtype, out_dtype, residual_dtype],
        )?;
        Ok(self.engine.submit(task))
    }

    /// Bytes of each GPU rank's (w13, w13 scales, w2, w2 scales) buffers for one expert at
    /// `gpu_tp_count` ranks; NotImplementedError for methods without a GPU layout.
    fn gpu_rank_bytes(&self, gpu_tp_count: usize) -> PyResult<[usize; 4]> {
        self.layer.read().unwrap().gpu_rank_bytes(gpu_tp_count).py()
    }

    /// Rank zero of layerwise prefill: write this layer's first `expert_count` experts into
    /// every rank's host slots of `transport`, publishing each as it is written, and return
    /// this rank's figures once its own copies are done (the original's
    /// `run_layerwise_fp8_batch`). Blocks, on the engine's pool.
    fn run_layerwise_fp8_batch<'py>(
        &self,
        py: Python<'py>,
        transport: &layerwise::Fp8LayerwiseTransport,
        epoch: u64,
        layer_id: i64,
        expert_count: u64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let t = transport.inner.clone();
        let (experts, bytes) = {
            let l = self.layer.read().unwrap();
            (l.config().num_experts, l.gpu_rank_bytes(t.tp_size()).py()?)
        };
        if bytes != t.expert_nbytes() {
            return Err(kt_core::Error::Invalid(format!(
                "the transport's expert_nbytes {:?} differ from the {:?} bytes this layer writes                  per expert at {} ranks",
                t.expert_nbytes(),
                bytes,
                t.tp_size()
            )))
            .py();
        }
        if expert_count as usize > experts {
            return Err(kt_core::Error::Invalid(format!(
                "expert_count {expert_count} exceeds this layer's {experts} experts"
            )))
            .py();
        }
        let layer = self.layer.clone();
        let out = Arc::new(Mutex::new(None));
        let result = out.clone();
        run_blocking(
            py,
            &self.engine,
            Box::new(move |ctx| {
                let l = layer.read().unwrap();
                let stats = t.run_batch(epoch, layer_id, expert_count, &mut |e, dst| {
                    // SAFETY: the transport's contract: each rank's slot buffers hold the
                    // sizes checked above and only the producer writes them until published.
                    unsafe { l.write_weight_scale_to_buffer(ctx.pool, e, dst) }
                })?;
                *result.lock().unwrap() = Some(stats);
                Ok(())
            }),
        )?;
        let stats = out.lock().unwrap().take().expect("the batch ran");
        layerwise::stats_dict(py, &stats)
    }

    /// Queue the write of one expert into every GPU rank's buffers (the original's
    /// `write_weight_scale_to_buffer`); returns the engine ticket. Counts, the expert id, the
    /// method and null pointers are checked here, before anything is queued.
    fn submit_write_weight_scale_to_buffer(
        &self,
        gpu_tp_count: usize,
        expert_id: i64,
        w13_weight_ptrs: Vec<usize>,
        w13_scale_ptrs: Vec<usize>,
        w2_weight_ptrs: Vec<usize>,
        w2_scale_ptrs: Vec<usize>,
    ) -> PyResult<u64> {
        let lists = [
            &w13_weight_ptrs,
            &w13_scale_ptrs,
            &w2_weight_ptrs,
            &w2_scale_ptrs,
        ];
        let counts: Vec<usize> = lists.iter().map(|l| l.len()).collect();
        if gpu_tp_count == 0 || expert_id < 0 {
            return Err(kt_core::Error::Invalid(format!(
                "gpu_tp_count ({gpu_tp_count}) must be >= 1 and expert_id ({expert_id}) >= 0"
            )))
            .py();
        }
        if counts.iter().any(|&n| n != gpu_tp_count) {
            return Err(kt_core::Error::Invalid(format!(
                "gpu_tp_count={gpu_tp_count} but the pointer lists hold {counts:?} entries"
            )))
            .py();
        }
        let dst: Vec<GpuRankDst> = (0..gpu_tp_count)
            .map(|r| GpuRankDst {
                w13: w13_weight_ptrs[r] as *mut u8,
                w13_scale: w13_scale_ptrs[r] as *mut u8,
                w2: w2_weight_ptrs[r] as *mut u8,
                w2_scale: w2_scale_ptrs[r] as *mut u8,
            })
            .collect();
        let slot = usize::try_from(expert_id).unwrap_or(usize::MAX);
        let layer = self.layer.clone();
        layer.read().unwrap().check_gpu_write(slot, &dst).py()?;
        Ok(self.engine.submit(Box::new(move |ctx| {
            let l = layer.read().unwrap();
            // SAFETY: the caller (the Python wrapper's documented contract, as the
            // original's) keeps each rank's buffers of `gpu_rank_bytes` bytes alive and
            // untouched until the matching sync.
            unsafe { l.write_weight_scale_to_buffer(ctx.pool, slot, &dst) }
        })))
    }

    /// Run a forward now and return when it is done (arguments as `submit_forward`): on the
    /// calling thread, with the GIL released, when the engine has nothing queued; else queued
    /// behind the pending work and waited for.
    #[pyo3(signature = (qlen, hidden_ptr, hidden_dtype, ids_ptr, ids_dtype, weights_ptr, out_ptr,
                        out_dtype, residual_ptr=0, residual_dtype="float32", mask_ptr=0))]
    #[allow(clippy::too_many_arguments)]
    fn forward_now(
        &self,
        py: Python<'_>,
        qlen: usize,
        hidden_ptr: usize,
        hidden_dtype: &str,
        ids_ptr: usize,
        ids_dtype: &str,
        weights_ptr: usize,
        out_ptr: usize,
        out_dtype: &str,
        residual_ptr: usize,
        residual_dtype: &str,
        mask_ptr: usize,
    ) -> PyResult<()> {
        let task = self.forward_task(
            qlen,
            [
                hidden_ptr,
                ids_ptr,
                weights_ptr,
                out_ptr,
                residual_ptr,
                mask_ptr,
            ],
            [hidden_dtype, ids_dtype, out_dtype, residual_dtype],
        )?;
        let engine = &self.engine;
        py.detach(move || engine.run_now(task)).py()
    }

    /// A forward a CUDA stream (or a replayed graph) may start any number of times: the
    /// address of a process-lifetime descriptor, the same for the same arguments. With
    /// `bsz_ptr` ≠ 0 the token count is read from that int32 cell when the task runs (1 to
    /// `qlen`; the buffers are sized for `qlen`). The layer is not kept alive by it: a task of
    /// a freed layer fails with an error.
    #[pyo3(signature = (qlen, hidden_ptr, hidden_dtype, ids_ptr, ids_dtype, weights_ptr, out_ptr,
                        out_dtype, residual_ptr=0, residual_dtype="float32", mask_ptr=0,
                        bsz_ptr=0))]
    #[allow(clippy::too_many_arguments)]
    fn stream_task(
        &self,
        qlen: usize,
        hidden_ptr: usize,
        hidden_dtype: &str,
        ids_ptr: usize,
        ids_dtype: &str,
        weights_ptr: usize,
        out_ptr: usize,
        out_dtype: &str,
        residual_ptr: usize,
        residual_dtype: &str,
        mask_ptr: usize,
        bsz_ptr: usize,
    ) -> PyResult<usize> {
        let ptrs = [
            hidden_ptr,
            ids_ptr,
            weights_ptr,
            out_ptr,
            residual_ptr,
            mask_ptr,
        ];
        let dtypes = [hidden_dtype, ids_dtype, out_dtype, residual_dtype];
        let args = self.forward_args(qlen, ptrs, dtypes)?;
        if !bsz_ptr.is_multiple_of(4) {
            return Err(kt_core::Error::Invalid(format!(
                "bsz_ptr 0x{bsz_ptr:x} is not aligned for an int32"
            )))
            .py();
        }
        let mut key = vec![self.serial, qlen, bsz_ptr, usize::from(args.ids_i64)];
        key.extend_from_slice(&ptrs);
        key.extend([args.hidden_type, args.out_type, args.residual_type].map(|t| t as usize));
        let layer = Arc::downgrade(&self.layer);
        let task = kt_core::cuda_bridge::persistent_task(key, &self.engine, move || {
            Arc::new(move |ctx| {
                let Some(layer) = layer.upgrade() else {
                    return Err(kt_core::Error::Runtime(
                        "a stream task ran after its layer was freed".into(),
                    ));
                };
                let mut run = args;
                if bsz_ptr != 0 {
                    // SAFETY: the caller keeps the int32 cell alive as long as the task may
                    // run (the Python layer's buffers live for the process); a volatile read
                    // because the stream writes it behind the compiler's back.
                    let n = unsafe { std::ptr::read_volatile(bsz_ptr as *const i32) };
                    if n < 1 || n as usize > args.qlen {
                        return Err(kt_core::Error::Invalid(format!(
                            "the batch-size cell holds {n}, outside 1..={}",
                            args.qlen
                        )));
                    }
                    run.qlen = n as usize;
                }
                let l = layer.read().unwrap();
                // SAFETY: as `forward_task`: the Python layer validated every tensor against
                // qlen and the layer shape and keeps them alive for the process.
                unsafe { l.forward_raw(ctx.pool, ctx.workspace, &run) }
            })
        });
        Ok(task as *const kt_core::cuda_bridge::StreamTask as usize)
    }
}

impl MoeLayer {
    /// Run `load` on the engine with this layer locked for writing and the parsed
    /// physical→logical map (`map_ptr` = int64 `[map_len]`, 0 = identity); blocks.
    fn load_blocking(
        &self,
        py: Python<'_>,
        map_ptr: usize,
        map_len: usize,
        load: impl FnOnce(&mut CoreLayer, &Pool, Option<&[i64]>) -> kt_core::Result<()> + Send + 'static,
    ) -> PyResult<()> {
        let map = parse_map(map_ptr, map_len);
        let layer = self.layer.clone();
        run_blocking(
            py,
            &self.engine,
            Box::new(move |ctx| load(&mut layer.write().unwrap(), ctx.pool, map.as_deref())),
        )
    }

    /// The engine task of one forward. `ptrs`: hidden, ids, weights, out, residual, mask
    /// (0 = none for the last two); `dtypes`: hidden, ids, out, residual.
    fn forward_task(&self, qlen: usize, ptrs: [usize; 6], dtypes: [&str; 4]) -> PyResult<Task> {
        let args = self.forward_args(qlen, ptrs, dtypes)?;
        let layer = self.layer.clone();
        Ok(Box::new(move |ctx| {
            let l = layer.read().unwrap();
            // SAFETY: the Python layer validated every tensor against qlen and the layer shape,
            // and keeps them alive until the forward is done.
            unsafe { l.forward_raw(ctx.pool, ctx.workspace, &args) }
        }))
    }

    /// The checked arguments of one forward (see `forward_task`).
    fn forward_args(
        &self,
        qlen: usize,
        ptrs: [usize; 6],
        dtypes: [&str; 4],
    ) -> PyResult<ForwardArgs> {
        let [hidden_ptr, ids_ptr, weights_ptr, out_ptr, residual_ptr, mask_ptr] = ptrs;
        let [hidden_dtype, ids_dtype, out_dtype, residual_dtype] = dtypes;
        let ids_i64 = match kt_core::dtype::IdType::parse(ids_dtype).py()? {
            kt_core::dtype::IdType::I64 => true,
            kt_core::dtype::IdType::I32 => false,
        };
        let args = ForwardArgs {
            qlen,
            hidden: hidden_ptr as *const u8,
            hidden_type: FloatType::parse(hidden_dtype).py()?,
            ids: ids_ptr as *const u8,
            ids_i64,
            weights: weights_ptr as *const f32,
            out: out_ptr as *mut u8,
            out_type: FloatType::parse(out_dtype).py()?,
            residual: residual_ptr as *const u8,
            residual_type: FloatType::parse(residual_dtype).py()?,
            gpu_mask: mask_ptr as *const u8,
        };
        args.check_addresses().py()?;
        Ok(args)
    }
}

/// Moves an expert source (a TensorSource, a PointerSource: raw addresses) into an engine
/// task of a blocking load.
struct SendSource<S>(S);
// SAFETY: the blocking loads (load_from_tensors, load_from_addresses) keep the memory the
// source points to alive and unchanged until the engine has run the load.
unsafe impl<S> Send for SendSource<S> {}

/// A weight conversion running on its own threads (see `kt_core::convert::ConversionJob`):
/// `wait` polls it without holding the GIL, so the caller can show progress and cancel on
/// Ctrl-C.
#[pyclass(module = "kt_kernel._kt_core", frozen)]
struct Conversion {
    job: ConversionJob,
    report: Mutex<Option<ConvertReport>>,
}

#[pymethods]
impl Conversion {
    /// Start converting `input` (a Hugging Face checkpoint folder) into `output`.
    #[new]
    #[pyo3(signature = (input, output, method, input_type=None, threads=0, threadpool_count=2,
                        merge=true, resume_layer=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        input: PathBuf,
        output: PathBuf,
        method: &str,
        input_type: Option<&str>,
        threads: usize,
        threadpool_count: usize,
        merge: bool,
        resume_layer: usize,
    ) -> PyResult<Self> {
        let opts = ConvertOptions {
            input,
            output,
            method: kt_core::convert::quant_method(method).py()?,
            input_type: input_type.map(InputType::parse).transpose().py()?,
            parts: threadpool_count,
            merge,
            resume_layer,
        };
        Ok(Conversion {
            job: ConversionJob::start(opts, threads).py()?,
            report: Mutex::new(None),
        })
    }

    /// Wait up to `timeout` seconds (None: until done). True once finished; raises the
    /// conversion's error if it failed.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let deadline = timeout
            .map(|t| std::time::Instant::now() + std::time::Duration::from_secs_f64(t.max(0.0)));
        match py.detach(|| self.job.wait(deadline)) {
            Some(result) => {
                *self.report.lock().unwrap() = Some(result.py()?);
                Ok(true)
            }
            // Still running, or it ended at an earlier call.
            None => Ok(self.job.is_done()),
        }
    }

    /// Ask the conversion to stop at the next matrix (nothing partial stays under a final name).
    fn cancel(&self) {
        self.job.cancel();
    }

    /// Progress so far: layers and input bytes, total and done, and the current layer.
    fn progress<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let p = self.job.progress();
        let d = PyDict::new(py);
        d.set_item("layers_total", p.layers_total.load(Ordering::Relaxed))?;
        d.set_item("layers_done", p.layers_done.load(Ordering::Relaxed))?;
        d.set_item("layer", p.layer.load(Ordering::Relaxed))?;
        d.set_item("bytes_total", p.bytes_total.load(Ordering::Relaxed))?;
        d.set_item("bytes_done", p.bytes_done.load(Ordering::Relaxed))?;
        Ok(d)
    }

    /// What the finished conversion did (None before it finished).
    fn report<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(r) = self.report.lock().unwrap().clone() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("layers", r.layers)?;
        d.set_item("converted", r.converted)?;
        d.set_item("input_bytes", r.input_bytes)?;
        d.set_item("output_bytes", r.output_bytes)?;
        d.set_item("seconds", r.seconds)?;
        d.set_item("buffer_bound_bytes", r.buffer_bound_bytes)?;
        Ok(Some(d))
    }
}

/// Whether the prefetch setting of `method`'s kernels is final (tuned on decodes, or fixed
/// by `KT_KERNEL_PREFETCH`), its distance in bytes, and whether lines go to L2.
#[pyfunction]
fn prefetch_state(method: &str) -> PyResult<(bool, usize, bool)> {
    use kt_core::kernels::prefetch;
    let family = prefetch::family_of(Method::parse(method).py()?);
    let (bytes, into_l2) = prefetch::describe(prefetch::distance_of(family));
    Ok((prefetch::tuned(family), bytes, into_l2))
}

/// For a method whose AMX prefill streams weights into tiles: whether that stream's weight
/// prefetch is final (tuned on prefills, or fixed by `KT_KERNEL_AMX_PREFETCH`) and its distance
/// in bytes (0: off); None for the other methods.
#[pyfunction]
fn amx_prefetch_state(method: &str) -> PyResult<Option<(bool, usize)>> {
    use kt_core::kernels::amx;
    let stream = amx::amx_stream_of(Method::parse(method).py()?);
    Ok(stream.map(|s| (amx::amx_tuned(s), amx::prefetch_bytes(s))))
}

#[pymodule]
fn _kt_core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("MAX_THREADS", kt_core::pool::MAX_THREADS)?;
    let names = |ms: &[Method]| ms.iter().map(|m| m.name()).collect::<Vec<_>>();
    m.add("METHODS", names(&Method::ALL))?;
    m.add(
        "IMPLEMENTED_METHODS",
        names(&kt_core::formats::implemented()),
    )?;
    m.add_function(wrap_pyfunction!(pool_split, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_variant, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_info, m)?)?;
    m.add_function(wrap_pyfunction!(physical_cores, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(has_converted_layer, m)?)?;
    m.add_function(wrap_pyfunction!(ggml_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(ggml_quantize, m)?)?;
    m.add_function(wrap_pyfunction!(stream_errors, m)?)?;
    m.add_function(wrap_pyfunction!(stream_descriptor_count, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_driver_status, m)?)?;
    m.add_function(wrap_pyfunction!(use_cuda_driver, m)?)?;
    m.add_function(wrap_pyfunction!(prefetch_state, m)?)?;
    m.add_function(wrap_pyfunction!(amx_prefetch_state, m)?)?;
    m.add_class::<Engine>()?;
    m.add_class::<MoeLayer>()?;
    m.add_class::<Conversion>()?;
    layerwise::register(m)?;
    Ok(())
}
