"""The original's low-level module: the task engine (``CPUInfer``), the pool config
(``WorkerPoolConfig``), ``QuantConfig``, the metadata attributes, and ``moe`` with
``MOEConfig`` and the per-method MoE classes (``kt_kernel._ext_moe``). ``import kt_kernel_ext``
and ``from kt_kernel_ext.moe import MOEConfig`` work after ``import kt_kernel``."""

from __future__ import annotations

import sys

from . import _ext_moe as moe
from . import _kt_core
from ._ext_moe import QuantConfig  # noqa: F401  (the original exports it here)

sys.modules.setdefault(__name__ + ".moe", moe)
sys.modules.setdefault("kt_kernel_ext.moe", moe)

# Layerwise prefill's expert transport (kt_core::layerwise).
FP8LayerwiseTransport = _kt_core.FP8LayerwiseTransport
initialize_fp8_layerwise_control = _kt_core.initialize_fp8_layerwise_control
FP8_LAYERWISE_CONTROL_BYTES = _kt_core.FP8_LAYERWISE_CONTROL_BYTES
FP8_LAYERWISE_MAX_TP_SIZE = _kt_core.FP8_LAYERWISE_MAX_TP_SIZE

__cpu_variant__ = _kt_core.cpu_variant()
__int8_weight_layout__ = "kt-int8-n32-k64-vnni-v1"


def __getattr__(name: str) -> str:
    # As in kt_kernel: looked up on first access, since cpu_info() calibrates prefetching.
    if name == "__int8_kernel__":
        return _kt_core.cpu_info()["kernels"]["AMXINT8"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class WorkerPoolConfig:
    """Sub-pool layout: ``subpool_count`` pools on ``subpool_numa_map`` nodes with
    ``subpool_thread_count`` threads each (the original's fields)."""

    def __init__(self) -> None:
        self.subpool_count = 0
        self.subpool_numa_map: list[int] = []
        self.subpool_thread_count: list[int] = []


class CPUInfer:
    """FIFO task engine with a pinned worker pool. ``CPUInfer(n)`` = one sub-pool of n threads;
    ``CPUInfer(WorkerPoolConfig)`` = the given layout."""

    def __init__(self, config: int | WorkerPoolConfig, pin: bool = True) -> None:
        if isinstance(config, bool) or not isinstance(config, int | WorkerPoolConfig):
            raise TypeError("CPUInfer takes a thread count (int) or a WorkerPoolConfig")
        if isinstance(config, int):
            if config < 1:
                raise ValueError(f"CPUInfer needs at least one thread, got {config}")
            threads, nodes = [config], [0]
        else:
            threads = list(config.subpool_thread_count)
            nodes = list(config.subpool_numa_map) or list(range(len(threads)))
            if config.subpool_count and config.subpool_count != len(threads):
                raise ValueError(
                    f"subpool_count={config.subpool_count} but "
                    f"{len(threads)} subpool_thread_count entries"
                )
            if len(nodes) != len(threads) or not threads:
                raise ValueError("subpool_numa_map and subpool_thread_count must have equal length")
        self.engine = _kt_core.Engine(threads, nodes, pin)
        self.backend_ = self.engine

    def submit(self, task) -> None:
        """Queue ``task`` (a ``forward_task``/``stream_task``) and return; load and warm-up
        tasks run right here."""
        if callable(task):
            task()
            return
        self.engine.submit_task(_task_address(task))

    def sync(self, allow_n_pending: int = 0) -> None:
        """Block until at most ``allow_n_pending`` tasks remain; raises a task's error."""
        self.engine.sync(allow_n_pending)

    def submit_with_cuda_stream(self, user_cuda_stream: int, task) -> None:
        """Queue ``task`` when CUDA stream ``user_cuda_stream`` reaches this point (a host
        function on the stream, capturable into a CUDA graph); returns at once. Without a CUDA
        driver this is ``submit``."""
        if _stream_driver_found() and not callable(task):
            self.engine.start_on_stream(int(user_cuda_stream), _task_address(task))
        else:
            self.submit(task)

    def sync_with_cuda_stream(self, user_cuda_stream: int, allow_n_pending: int = 0) -> None:
        """Make work enqueued later on the stream wait until at most ``allow_n_pending`` tasks
        remain; returns at once. Without a CUDA driver this is ``sync``."""
        if _stream_driver_found():
            self.engine.sync_on_stream(int(user_cuda_stream), allow_n_pending)
            errors = _kt_core.stream_errors()
            if errors:
                raise RuntimeError(
                    "a CPU task ordered on a CUDA stream failed: " + "; ".join(errors)
                )
        else:
            self.engine.sync(allow_n_pending)


def _task_address(task) -> int:
    address = getattr(task, "address", task)
    if isinstance(address, bool) or not isinstance(address, int):
        raise TypeError(f"expected a task from forward_task/stream_task, got {type(task).__name__}")
    return address


def _stream_driver_found() -> bool:
    return _kt_core.cuda_driver_status()[0]
