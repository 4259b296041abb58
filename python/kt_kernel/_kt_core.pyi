# Type stubs of the native module (crates/kt-py). Addresses are ints (tensor.data_ptr()).
from collections.abc import Sequence
from os import PathLike
from typing import Any

__version__: str
MAX_THREADS: int
METHODS: list[str]
IMPLEMENTED_METHODS: list[str]
FP8_LAYERWISE_CONTROL_BYTES: int
FP8_LAYERWISE_MAX_TP_SIZE: int

def cpu_variant() -> str: ...
def cpu_info() -> dict[str, Any]: ...
def physical_cores() -> int: ...
def build_info() -> dict[str, Any]: ...
def has_converted_layer(path: str | PathLike[str], layer_idx: int) -> bool: ...
def ggml_dequantize(type_name: str, data: bytes, n: int) -> bytes: ...
def ggml_quantize(
    type_name: str, data: bytes, threads: int = 0, dtype: str = "float32"
) -> bytes: ...
def pool_split(
    total_threads: int, subpool_count: int, numa_nodes: list[int] | None = None
) -> tuple[list[int], list[int]]: ...
def stream_errors() -> list[str]: ...
def stream_descriptor_count() -> int: ...
def use_cuda_driver(library: str) -> None: ...
def cuda_driver_status() -> tuple[bool, str]: ...
def prefetch_state(method: str) -> tuple[bool, int, bool]: ...
def amx_prefetch_state(method: str) -> tuple[bool, int] | None: ...
def initialize_fp8_layerwise_control(control_ptr: int, control_size: int, tp_size: int) -> None: ...

class Engine:
    def __init__(self, threads: list[int], numa_nodes: list[int], pin: bool = True) -> None: ...
    @property
    def parts(self) -> int: ...
    @property
    def total_threads(self) -> int: ...
    def pinning(self) -> list[list[int | None]]: ...
    def warnings(self) -> list[str]: ...
    def wait(self, ticket: int) -> None: ...
    def sync(self, allow_n_pending: int = 0) -> None: ...
    def pending(self) -> int: ...
    def submit_task(self, task: int) -> int: ...
    def start_on_stream(
        self, stream: int, task: int, copies_before: Sequence[tuple[int, int, int]] = ()
    ) -> None: ...
    def sync_on_stream(
        self,
        stream: int,
        allow_n_pending: int = 0,
        copies_after: Sequence[tuple[int, int, int]] = (),
    ) -> None: ...
    def measure_read_bandwidth(
        self, bytes: int = 1 << 30, repeats: int = 5, huge_pages: bool = True
    ) -> float: ...
    def measure_read_passes(
        self, bytes: int = 1 << 30, passes: int = 5, huge_pages: bool = True
    ) -> list[float]: ...
    def measure_peak_gflops(self, kind: str, millis: int = 300) -> float | None: ...
    def workspace_bytes(self) -> int: ...

class MoeLayer:
    def __init__(
        self,
        engine: Engine,
        layer_idx: int,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        max_tokens: int,
        swiglu_limit: float = 0.0,
        swiglu_alpha: float = 0.0,
        kernel: str | None = None,
        method: str = "BF16",
    ) -> None: ...
    @property
    def kernel(self) -> str: ...
    @property
    def weight_bytes(self) -> int: ...
    @property
    def loaded(self) -> bool: ...
    @property
    def ggml_types(self) -> tuple[str, str] | None: ...
    def load_from_tensors(
        self,
        gate_ptr: int,
        up_ptr: int,
        down_ptr: int,
        dtype: str,
        experts: int,
        map_ptr: int = 0,
        map_len: int = 0,
    ) -> None: ...
    def load_from_addresses(
        self,
        weights: Sequence[Sequence[int]],
        scales: Sequence[Sequence[int]],
        group_size: int,
        map_ptr: int = 0,
        map_len: int = 0,
    ) -> None: ...
    def load_converted_from_addresses(
        self,
        weights: Sequence[Sequence[Sequence[int]]],
        scales: Sequence[Sequence[Sequence[int]]],
        map_ptr: int = 0,
        map_len: int = 0,
    ) -> None: ...
    def load_ggml_from_addresses(
        self,
        gate_ptr: int,
        up_ptr: int,
        down_ptr: int,
        gate_type: int,
        up_type: int,
        down_type: int,
        map_ptr: int = 0,
        map_len: int = 0,
    ) -> None: ...
    def load_from_checkpoint(
        self, path: str | PathLike[str], layer_idx: int, map_ptr: int = 0, map_len: int = 0
    ) -> None: ...
    def load_from_converted(
        self, path: str | PathLike[str], layer_idx: int, map_ptr: int = 0, map_len: int = 0
    ) -> None: ...
    def load_from_gguf(
        self, path: str | PathLike[str], layer_idx: int, map_ptr: int = 0, map_len: int = 0
    ) -> None: ...
    def submit_forward(
        self,
        qlen: int,
        hidden_ptr: int,
        hidden_dtype: str,
        ids_ptr: int,
        ids_dtype: str,
        weights_ptr: int,
        out_ptr: int,
        out_dtype: str,
        residual_ptr: int = 0,
        residual_dtype: str = "float32",
        mask_ptr: int = 0,
    ) -> int: ...
    def forward_now(
        self,
        qlen: int,
        hidden_ptr: int,
        hidden_dtype: str,
        ids_ptr: int,
        ids_dtype: str,
        weights_ptr: int,
        out_ptr: int,
        out_dtype: str,
        residual_ptr: int = 0,
        residual_dtype: str = "float32",
        mask_ptr: int = 0,
    ) -> None: ...
    def stream_task(
        self,
        qlen: int,
        hidden_ptr: int,
        hidden_dtype: str,
        ids_ptr: int,
        ids_dtype: str,
        weights_ptr: int,
        out_ptr: int,
        out_dtype: str,
        residual_ptr: int = 0,
        residual_dtype: str = "float32",
        mask_ptr: int = 0,
        bsz_ptr: int = 0,
    ) -> int: ...
    def gpu_rank_bytes(self, gpu_tp_count: int) -> list[int]: ...
    def submit_write_weight_scale_to_buffer(
        self,
        gpu_tp_count: int,
        expert_id: int,
        w13_weight_ptrs: list[int],
        w13_scale_ptrs: list[int],
        w2_weight_ptrs: list[int],
        w2_scale_ptrs: list[int],
    ) -> int: ...
    def run_layerwise_fp8_batch(
        self, transport: FP8LayerwiseTransport, epoch: int, layer_id: int, expert_count: int
    ) -> dict[str, Any]: ...

class FP8LayerwiseTransport:
    def __init__(
        self,
        control_ptr: int,
        control_size: int,
        rank: int,
        tp_size: int,
        cuda_device: int,
        local_host_ptrs: Sequence[int],
        local_gpu_ptrs: Sequence[int],
        all_rank_host_ptrs: Sequence[Any],
        expert_nbytes: Sequence[int],
        num_experts: int,
        timeout_ms: int = 60000,
    ) -> None: ...
    def join(self, epoch: int, layer_id: int, expert_count: int) -> None: ...
    def wait(self, epoch: int) -> dict[str, Any]: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...

class Conversion:
    def __init__(
        self,
        input: str | PathLike[str],
        output: str | PathLike[str],
        method: str,
        input_type: str | None = None,
        threads: int = 0,
        threadpool_count: int = 2,
        merge: bool = True,
        resume_layer: int = 0,
    ) -> None: ...
    def wait(self, timeout: float | None = None) -> bool: ...
    def cancel(self) -> None: ...
    def progress(self) -> dict[str, Any]: ...
    def report(self) -> dict[str, Any] | None: ...
