//! Python face of `kt_core::layerwise`: the original's `FP8LayerwiseTransport`,
//! `initialize_fp8_layerwise_control` and `FP8_LAYERWISE_*` constants.
use crate::errors::{to_py, IntoPy};
use kt_core::layerwise::{self, LayerStats, Transport, TransportConfig, KINDS, SLOTS};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::Arc;
use std::time::Duration;

/// One rank's end of the layerwise expert transport (see `kt_core::layerwise`).
#[pyclass(module = "kt_kernel._kt_core", name = "FP8LayerwiseTransport", frozen)]
pub struct Fp8LayerwiseTransport {
    pub(crate) inner: Arc<Transport>,
}

/// `values` as exactly `n` addresses (`what` names them in the error).
fn exactly<const N: usize>(values: Vec<usize>, what: &str) -> PyResult<[usize; N]> {
    <[usize; N]>::try_from(values).map_err(|v| {
        to_py(kt_core::Error::Invalid(format!(
            "FP8 layerwise {what} must contain {N} entries, got {}",
            v.len()
        )))
    })
}

/// `[slot][rank][kind]` addresses, nested or flat, as per-slot lists of per-rank kinds.
fn slot_rank_kind(obj: &Bound<'_, PyAny>, tp: usize) -> PyResult<Vec<Vec<[usize; KINDS]>>> {
    let flat: Vec<usize> = match obj.extract::<Vec<usize>>() {
        Ok(v) => v,
        Err(_) => obj
            .extract::<Vec<Vec<Vec<usize>>>>()?
            .into_iter()
            .flat_map(|slot| {
                let shape_ok = slot.len() == tp && slot.iter().all(|k| k.len() == KINDS);
                // A ragged list cannot be flattened into the right count: make it too short.
                if shape_ok {
                    slot.into_iter().flatten().collect()
                } else {
                    vec![0; 1]
                }
            })
            .collect(),
    };
    if flat.is_empty() {
        return Ok(vec![]);
    }
    if flat.len() != SLOTS * tp * KINDS {
        return Err(to_py(kt_core::Error::Invalid(format!(
            "FP8 layerwise all_rank_host_ptrs must be [slot][rank][kind] ({SLOTS} x {tp} x \
             {KINDS}) on rank zero and empty on other ranks; got {} addresses",
            flat.len()
        ))));
    }
    Ok(flat
        .chunks_exact(tp * KINDS)
        .map(|slot| {
            slot.chunks_exact(KINDS)
                .map(|k| [k[0], k[1], k[2], k[3]])
                .collect()
        })
        .collect())
}

/// The figures of one layer as the original's `wait` dict.
pub fn stats_dict<'py>(py: Python<'py>, s: &LayerStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("epoch", s.epoch)?;
    d.set_item("layer_id", s.layer_id)?;
    d.set_item("expert_count", s.expert_count)?;
    d.set_item("writer_ms", s.writer_ms)?;
    d.set_item("slot_wait_ms", s.slot_wait_ms)?;
    d.set_item("h2d_ms", s.h2d_ms)?;
    d.set_item("total_ms", s.total_ms)?;
    // A poisoned layer raises instead of returning; these keys keep the original's shape.
    d.set_item("poisoned", false)?;
    d.set_item("error_code", 0)?;
    d.set_item("error_rank", -1)?;
    d.set_item("error_message", "")?;
    Ok(d)
}

#[pymethods]
impl Fp8LayerwiseTransport {
    /// Open rank `rank`'s end on the control block at `control_ptr` (made by
    /// `initialize_fp8_layerwise_control`). `local_host_ptrs`: 8 addresses `[slot][kind]`
    /// (kinds: w13 weight, w13 scale, w2 weight, w2 scale); `local_gpu_ptrs`: 4 (expert `e`
    /// at `e · expert_nbytes[kind]`); `all_rank_host_ptrs`: rank zero's view of every rank's
    /// slots `[slot][rank][kind]` (empty on other ranks); `cuda_device < 0`: the destinations
    /// are host memory. The caller keeps every buffer alive until `close`.
    #[new]
    #[pyo3(signature = (control_ptr, control_size, rank, tp_size, cuda_device, local_host_ptrs,
                        local_gpu_ptrs, all_rank_host_ptrs, expert_nbytes, num_experts,
                        timeout_ms=60000))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        control_ptr: usize,
        control_size: usize,
        rank: usize,
        tp_size: usize,
        cuda_device: i32,
        local_host_ptrs: Vec<usize>,
        local_gpu_ptrs: Vec<usize>,
        all_rank_host_ptrs: &Bound<'_, PyAny>,
        expert_nbytes: Vec<usize>,
        num_experts: usize,
        timeout_ms: u64,
    ) -> PyResult<Self> {
        let host: [usize; SLOTS * KINDS] =
            exactly(local_host_ptrs, "local_host_ptrs [slot][kind]")?;
        let config = TransportConfig {
            rank,
            tp_size,
            cuda_device,
            local_host: [
                [host[0], host[1], host[2], host[3]],
                [host[4], host[5], host[6], host[7]],
            ],
            local_gpu: exactly(local_gpu_ptrs, "local_gpu_ptrs")?,
            all_rank_host: slot_rank_kind(all_rank_host_ptrs, tp_size.max(1))?,
            expert_nbytes: exactly(expert_nbytes, "expert_nbytes")?,
            num_experts,
            timeout: Duration::from_millis(timeout_ms),
        };
        // SAFETY: the documented contract of this constructor (as the original's): the block
        // and every buffer stay allocated while the transport is open.
        let inner = py
            .detach(|| unsafe { Transport::open(control_ptr, control_size, config) })
            .py()?;
        Ok(Fp8LayerwiseTransport {
            inner: Arc::new(inner),
        })
    }

    /// Take part in layer `epoch` (every rank, with the same `layer_id` and `expert_count`).
    fn join(&self, epoch: u64, layer_id: i64, expert_count: u64) -> PyResult<()> {
        self.inner.join(epoch, layer_id, expert_count).py()
    }

    /// Block until this rank's copies of layer `epoch` are done; returns its figures.
    fn wait<'py>(&self, py: Python<'py>, epoch: u64) -> PyResult<Bound<'py, PyDict>> {
        let t = self.inner.clone();
        let stats = py.detach(move || t.wait(epoch)).py()?;
        stats_dict(py, &stats)
    }

    /// Stop this rank's copy thread; later calls raise.
    fn close(&self, py: Python<'_>) {
        let t = self.inner.clone();
        py.detach(move || t.close());
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner.closed()
    }

    #[getter]
    fn num_experts(&self) -> usize {
        self.inner.num_experts()
    }

    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    #[getter]
    fn tp_size(&self) -> usize {
        self.inner.tp_size()
    }

    fn __repr__(&self) -> String {
        format!(
            "FP8LayerwiseTransport(rank={}, tp_size={}, num_experts={}, closed={})",
            self.inner.rank(),
            self.inner.tp_size(),
            self.inner.num_experts(),
            self.inner.closed()
        )
    }
}

/// Make a fresh control block for `tp_size` ranks at `control_ptr` (64-byte aligned, at
/// least `FP8_LAYERWISE_CONTROL_BYTES`), before any rank opens a transport on it.
#[pyfunction]
fn initialize_fp8_layerwise_control(
    control_ptr: usize,
    control_size: usize,
    tp_size: usize,
) -> PyResult<()> {
    // SAFETY: the caller hands over `control_size` bytes it owns and no transport uses yet.
    unsafe { layerwise::initialize_control(control_ptr, control_size, tp_size) }.py()
}

/// Add the transport's class, function and constants to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("FP8_LAYERWISE_CONTROL_BYTES", layerwise::CONTROL_BYTES)?;
    m.add("FP8_LAYERWISE_MAX_TP_SIZE", layerwise::MAX_TP_SIZE)?;
    m.add_function(wrap_pyfunction!(initialize_fp8_layerwise_control, m)?)?;
    m.add_class::<Fp8LayerwiseTransport>()
}
