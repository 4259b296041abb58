"""The original's low-level module name. Offers the task engine (``CPUInfer``) and pool config
(``WorkerPoolConfig``) plus the metadata attributes; the per-method C++ MoE classes of the
original are not reproduced — use ``KTMoEWrapper``."""

from __future__ import annotations

from . import _kt_core

__cpu_variant__ = _kt_core.cpu_variant()
__int8_kernel__ = _kt_core.cpu_info()["kernels"]["AMXINT8"]
__int8_weight_layout__ = "kt-int8-n32-k64-vnni-v1"


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

    def sync(self, allow_n_pending: int = 0) -> None:
        """Block until at most ``allow_n_pending`` tasks remain; raises a task's error."""
        self.engine.sync(allow_n_pending)

    def sync_with_cuda_stream(self, user_cuda_stream: int, allow_n_pending: int = 0) -> None:
        """CPU-only build: there is no stream to order against, so this is ``sync``."""
        self.engine.sync(allow_n_pending)
