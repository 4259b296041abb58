"""Torch glue shared by every backend: the process-wide engine, argument validation, output
buffers, expert deferral and the submit/sync protocol."""

from __future__ import annotations

import collections
import operator
import os
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass

import torch

from . import _kt_core, _stream
from .kt_kernel_ext import CPUInfer, WorkerPoolConfig


class _Required:
    def __repr__(self) -> str:
        return "<required>"


_REQUIRED = _Required()

_FLOAT_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_ID_DTYPES = {torch.int32: "int32", torch.int64: "int64"}
_CPU = torch.device("cpu")
# chunked_prefill_size <= 0 means "no limit" (SGLang uses -1 when chunking is off); the native
# layer chunks internally, so no buffer grows with it.
_UNLIMITED_TOKENS = 1 << 31

# References to a recycled output buffer when nothing outside its cache holds it: the cache's
# dict, the caller's local name and getrefcount's argument.
_CACHE_ONLY_REFS = 3
_CAN_COUNT_USES = hasattr(torch.Tensor, "_use_count") and hasattr(torch._C, "_storage_Use_Count")


def _only_cached(buf: torch.Tensor) -> bool:
    """Whether nothing but the wrapper's cache can reach ``buf``: no Python reference, no
    tensor sharing its storage (views, ``.detach()``), no C++ holder (a DLPack capsule, a
    queued task's inputs). Such a buffer can be written again without anyone seeing it."""
    return (
        sys.getrefcount(buf) == _CACHE_ONLY_REFS + 1  # + this function's argument
        and buf._use_count() == 1
        and torch._C._storage_Use_Count(buf.untyped_storage()._cdata) == 2
    )


def _as_int(value):
    """``value`` as an int if it is integer-like (int, numpy or 0-d torch integer), else
    unchanged, so that ``_check_int`` refuses it by type rather than truncating a float."""
    if isinstance(value, int):  # bool too: _check_int refuses it by type
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def _check_dense(name: str, t: torch.Tensor) -> None:
    """Refuse tensors without ordinary storage: sparse layouts and zero tensors."""
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got {t.layout}")
    if t._is_zerotensor():
        raise ValueError(
            f"{name} is a zero tensor without storage (torch._efficientzerotensor); "
            "pass a materialised tensor, e.g. torch.zeros_like(...)"
        )


def _check_int(name: str, value, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def generate_gpu_experts_masks(activation_freq: torch.Tensor, num_gpu_experts: int) -> torch.Tensor:
    """Bool ``[layers, experts]`` mask of the ``num_gpu_experts`` most frequently activated
    (layer, expert) pairs over the whole model. Ties go to the lower (layer, expert) index."""
    if not isinstance(activation_freq, torch.Tensor) or activation_freq.dim() != 2:
        raise ValueError("activation_freq must be a 2-D tensor [num_layers, num_experts]")
    n = _check_int("num_gpu_experts", num_gpu_experts, 0)
    freq = activation_freq.detach().to("cpu", torch.float64).reshape(-1)
    n = min(n, freq.numel())
    mask = torch.zeros(freq.numel(), dtype=torch.bool)
    if n > 0:
        order = torch.argsort(-freq, stable=True)
        mask[order[:n]] = True
    return mask.reshape(activation_freq.shape)


@dataclass
class _Pending:
    ticket: int
    out: torch.Tensor
    device: torch.device
    keep_alive: tuple


def _out_dtype(hidden_states: torch.Tensor) -> torch.dtype:
    """Outputs come in the hidden states' float type (float32 for any other)."""
    return hidden_states.dtype if hidden_states.dtype in _FLOAT_DTYPES else torch.float32


class BaseMoEWrapper:
    """One MoE layer on the CPU. Backends set ``self.moe`` (the native layer) and implement
    ``load_weights``/``load_weights_from_tensors``."""

    _cpu_infer: CPUInfer | None = None
    _cpu_infer_pid: int | None = None
    _class_lock = threading.Lock()
    _capture_batch_sizes: list[int] = []
    _instances: weakref.WeakSet = weakref.WeakSet()
    # layer_idx -> (deferred output [B, H] fp32, B): folded into layer_idx + 1's next forward.
    _pending_deferred: dict[int, tuple[torch.Tensor, int]] = {}

    def __init__(
        self,
        layer_idx: int,
        num_experts: int,
        num_experts_per_tok: int,
        hidden_size: int,
        moe_intermediate_size: int,
        gpu_experts_mask: torch.Tensor | None,
        cpuinfer_threads: int | None,
        threadpool_count: int,
        weight_path: str,
        chunked_prefill_size: int | None,
        cpu_save: bool = False,
        max_deferred_experts_per_token: int | None = None,
        method: str = "BF16",
        numa_nodes: list[int] | None = None,
        num_gpu_experts: int = 0,
        swiglu_limit: float = 0.0,
        swiglu_alpha: float = 0.0,
    ) -> None:
        self.layer_idx = _check_int("layer_idx", layer_idx, 0)
        self.num_experts = _check_int("num_experts", num_experts, 1)
        self.num_experts_per_tok = _check_int("num_experts_per_tok", num_experts_per_tok, 1)
        self.hidden_size = _check_int("hidden_size", hidden_size, 1)
        self.moe_intermediate_size = _check_int("moe_intermediate_size", moe_intermediate_size, 1)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={num_experts_per_tok} exceeds num_experts={num_experts}"
            )
        self.weight_path = weight_path
        if chunked_prefill_size is None or (
            isinstance(chunked_prefill_size, int) and chunked_prefill_size <= 0
        ):
            self.chunked_prefill_size = _UNLIMITED_TOKENS
        else:
            self.chunked_prefill_size = _check_int("chunked_prefill_size", chunked_prefill_size, 1)
        self.cpu_save = bool(cpu_save)
        deferred = 0 if max_deferred_experts_per_token is None else max_deferred_experts_per_token
        self.max_deferred_experts_per_token = _check_int(
            "max_deferred_experts_per_token", deferred, 0
        )
        self.method = method
        for name, v in (("swiglu_limit", swiglu_limit), ("swiglu_alpha", swiglu_alpha)):
            if not isinstance(v, int | float) or v != v or v < 0 or v == float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        self.swiglu_limit = float(swiglu_limit)
        self.swiglu_alpha = float(swiglu_alpha)
        self.gpu_experts_mask = self._make_mask(gpu_experts_mask, num_gpu_experts)
        self.cpu_infer = self._get_cpu_infer(cpuinfer_threads, threadpool_count, numa_nodes)
        self.threadpool_count = self.cpu_infer.engine.parts
        self._lock = threading.Lock()
        self._pending: collections.deque[_Pending | None] = collections.deque()
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._deferred_alive: collections.deque[tuple[int, tuple]] = collections.deque()
        self.moe = None
        self._stream_state = _stream.State()
        self._force_sync_submit = _stream.force_sync_submit()
        BaseMoEWrapper._instances.add(self)

    # ----------------------------------------------------------------------------- set-up
    @property
    def num_gpu_experts(self) -> int:
        return int(self.gpu_experts_mask.sum().item())

    def _make_mask(self, mask: torch.Tensor | None, num_gpu_experts: int) -> torch.Tensor:
        # Our own CPU tensor: SGLang updates it in place (.copy_) and we read it at every forward.
        own = torch.zeros(self.num_experts, dtype=torch.bool)
        if torch.cuda.is_available():
            own = own.pin_memory()
        if mask is not None:
            if not isinstance(mask, torch.Tensor):
                raise TypeError("gpu_experts_mask must be a torch.Tensor of bools or None")
            # Integers are 0/1 flags (non-zero: on the GPU); a float mask would turn 0.5 into
            # True, so it is refused rather than guessed at.
            if mask.is_floating_point() or mask.is_complex():
                raise TypeError(f"gpu_experts_mask must hold bools, got {mask.dtype}")
            if mask.dim() != 1:
                raise ValueError(
                    f"gpu_experts_mask must be 1-D ([num_experts]), got shape {tuple(mask.shape)}"
                )
            if mask.numel() != self.num_experts:
                raise ValueError(
                    f"gpu_experts_mask has {mask.numel()} entries, expected num_experts="
                    f"{self.num_experts}"
                )
            own.copy_(mask.detach().reshape(-1).to("cpu", torch.bool))
        else:
            n = _check_int("num_gpu_experts", num_gpu_experts, 0)
            if n > self.num_experts:
                raise ValueError(f"num_gpu_experts={n} exceeds num_experts={self.num_experts}")
            own[:n] = True
        return own

    @classmethod
    def _get_cpu_infer(cls, threads, threadpool_count, numa_nodes) -> CPUInfer:
        count = _check_int("threadpool_count", threadpool_count, 1, _kt_core.MAX_THREADS)
        if numa_nodes is not None:
            numa_nodes = [_check_int("numa_nodes[i]", n, 0) for n in numa_nodes]
            if len(numa_nodes) != count:
                raise ValueError(
                    f"numa_nodes has {len(numa_nodes)} entries but threadpool_count is {count}"
                )
        if threads is not None:
            threads = _check_int("cpuinfer_threads", threads, 1, _kt_core.MAX_THREADS)
        # State lives on BaseMoEWrapper itself, not on whichever subclass calls this.
        cls = BaseMoEWrapper
        with cls._class_lock:
            # Like the original, the first wrapper creates the process-wide engine; later ones
            # share it. A forked child gets a fresh one (the parent's threads do not exist there).
            if cls._cpu_infer is not None and cls._cpu_infer_pid == os.getpid():
                engine = cls._cpu_infer.engine
                asked_threads = threads if threads is not None else engine.total_threads
                if (count, asked_threads) != (engine.parts, engine.total_threads):
                    warnings.warn(
                        f"kt_kernel: this process's CPU engine was created with "
                        f"threadpool_count={engine.parts}, cpuinfer_threads="
                        f"{engine.total_threads}; every wrapper shares it, so the requested "
                        f"threadpool_count={count}, cpuinfer_threads={threads} are not used",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                return cls._cpu_infer
            if threads is None:
                threads = max(count, _kt_core.physical_cores())
            cfg = WorkerPoolConfig()
            cfg.subpool_count = count
            cfg.subpool_thread_count, cfg.subpool_numa_map = _kt_core.pool_split(
                threads, count, numa_nodes
            )
            cls._cpu_infer = CPUInfer(cfg)
            cls._cpu_infer_pid = os.getpid()
            return cls._cpu_infer

    @staticmethod
    def _map_arg(physical_to_logical_map_cpu) -> tuple[int, int, torch.Tensor | None]:
        """(address, length, tensor kept alive) of an int64 map, or (0, 0, None) for identity."""
        if physical_to_logical_map_cpu is None:
            return 0, 0, None
        m = physical_to_logical_map_cpu
        if not isinstance(m, torch.Tensor):
            try:
                m = torch.as_tensor(m)
            except Exception as e:  # dicts, strings, ...
                raise TypeError(
                    "physical_to_logical_map_cpu must be an integer tensor/sequence or None, "
                    f"got {type(physical_to_logical_map_cpu).__name__}"
                ) from e
        if m.dtype.is_floating_point or m.dtype == torch.bool or m.is_complex():
            raise TypeError(f"physical_to_logical_map_cpu must hold integers, got {m.dtype}")
        if m.dim() != 1:
            raise ValueError(f"physical_to_logical_map_cpu must be 1-D, got shape {tuple(m.shape)}")
        if m.numel() == 0:
            raise ValueError("physical_to_logical_map_cpu is empty; pass None for the identity map")
        m = m.to("cpu", torch.int64).resolve_neg().contiguous()
        return m.data_ptr(), m.numel(), m

    # ----------------------------------------------------------------------------- buffers
    @classmethod
    def set_capture_batch_sizes(cls, batch_sizes) -> None:
        sizes = sorted({_check_int("batch size", _as_int(b), 1) for b in batch_sizes})
        cls._capture_batch_sizes = sizes

    @classmethod
    def get_capture_batch_sizes(cls) -> list[int]:
        return list(cls._capture_batch_sizes)

    @classmethod
    def clear_buffer_cache(cls) -> None:
        for w in list(cls._instances):
            with w._lock:
                w._buffers.clear()
        with cls._class_lock:
            cls._pending_deferred.clear()

    def _buffer(self, kind: str, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """Output storage: stable per (kind, rows, dtype) for captured batch sizes; otherwise
        the previous call's buffer of that key once nothing but this cache holds it (a later
        call never writes memory a caller may still read), else fresh. Allocating costs a
        decode 30-70 µs on caches the weights have just flushed."""
        if rows in BaseMoEWrapper._capture_batch_sizes:
            key = (kind, rows, dtype)
            buf = self._buffers.get(key)
            if buf is not None and any(p is not None and p.out is buf for p in self._pending):
                # A second submit before the sync: the first result still lives there.
                return torch.empty((rows, self.hidden_size), dtype=dtype)
            if buf is None:
                buf = torch.empty((rows, self.hidden_size), dtype=dtype)
                self._buffers[key] = buf
            return buf
        key = (kind, rows, dtype, None)
        buf = self._buffers.get(key)
        if buf is not None and _CAN_COUNT_USES and _only_cached(buf):
            return buf
        buf = torch.empty((rows, self.hidden_size), dtype=dtype)
        self._buffers[key] = buf
        return buf

    # ----------------------------------------------------------------------------- forward
    def _check_forward_inputs(self, hidden_states, topk_ids, topk_weights):
        """Validate, then bring the inputs to the CPU in the dtypes the kernels take."""
        if self._kernel_ready(hidden_states, topk_ids, topk_weights):
            return hidden_states, topk_ids, topk_weights, _CPU
        x = self._validate_forward_inputs(hidden_states, topk_ids, topk_weights)
        return self._to_cpu(x, hidden_states.device, topk_ids, topk_weights)

    def _kernel_ready(self, x, ids, w) -> bool:
        """Whether the inputs are already exactly what the kernels take (plain dense CPU
        tensors, ``[T, H]`` in a float type, ``[T, k]`` int ids and f32 weights, contiguous,
        with storage) and the mask is intact. Any other input goes the general way, which
        converts or explains. Written as few cheap torch calls: a decode runs this on caches
        its weights have just flushed, where the general checks cost it 20-40 us."""
        tensor = torch.Tensor
        if type(x) is not tensor or type(ids) is not tensor or type(w) is not tensor:
            return False
        if not (x.is_cpu and ids.is_cpu and w.is_cpu):
            return False
        shape = x.shape
        if len(shape) != 2 or shape[1] != self.hidden_size:
            return False
        qlen = shape[0]
        k = self.num_experts_per_tok
        if not 0 < qlen <= self.chunked_prefill_size or ids.shape != (qlen, k):
            return False
        if w.shape != (qlen, k) or w.dtype is not torch.float32:
            return False
        if x.dtype not in _FLOAT_DTYPES or ids.dtype not in _ID_DTYPES:
            return False
        strided = torch.strided
        if x.layout is not strided or ids.layout is not strided or w.layout is not strided:
            return False
        if not (x.is_contiguous() and ids.is_contiguous() and w.is_contiguous()):
            return False
        # A negated view's memory holds the values before negation.
        if x.is_neg() or ids.is_neg() or w.is_neg():
            return False
        # Zero tensors (torch._efficientzerotensor) have no storage: address 0.
        if not (x.data_ptr() and ids.data_ptr() and w.data_ptr()):
            return False
        mask = self.gpu_experts_mask
        return (
            type(mask) is tensor
            and mask.is_cpu
            and mask.numel() == self.num_experts
            and (mask.dtype is torch.bool or mask.dtype is torch.uint8)
            and mask.layout is strided
            and mask.is_contiguous()
        )

    def _validate_forward_inputs(self, hidden_states, topk_ids, topk_weights) -> torch.Tensor:
        """Check types, shapes and the mask without copying anything; returns the ``[T, H]``
        view of the hidden states."""
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError("hidden_states must be a torch.Tensor")
        _check_dense("hidden_states", hidden_states)
        if not hidden_states.is_floating_point():
            raise TypeError(f"hidden_states must be floating point, got {hidden_states.dtype}")
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states has shape {tuple(hidden_states.shape)}; its last dimension must "
                f"be hidden_size={self.hidden_size} (layer {self.layer_idx})"
            )
        x = (
            hidden_states
            if hidden_states.dim() == 2
            else hidden_states.reshape(-1, self.hidden_size)
        )
        qlen = x.shape[0]
        if not isinstance(topk_ids, torch.Tensor) or not isinstance(topk_weights, torch.Tensor):
            raise TypeError("topk_ids and topk_weights must be torch.Tensors")
        _check_dense("topk_ids", topk_ids)
        _check_dense("topk_weights", topk_weights)
        if topk_ids.is_floating_point() or topk_ids.dtype == torch.bool or topk_ids.is_complex():
            raise TypeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
        if not topk_weights.is_floating_point():
            raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
        k = self.num_experts_per_tok
        if tuple(topk_ids.shape) != (qlen, k):
            raise ValueError(
                f"topk_ids has shape {tuple(topk_ids.shape)}, expected [{qlen}, {k}] "
                f"(tokens, num_experts_per_tok)"
            )
        if tuple(topk_weights.shape) != (qlen, k):
            raise ValueError(
                f"topk_weights has shape {tuple(topk_weights.shape)}, expected [{qlen}, {k}]"
            )
        if qlen > self.chunked_prefill_size:
            raise ValueError(
                f"{qlen} tokens exceed chunked_prefill_size={self.chunked_prefill_size} "
                f"(layer {self.layer_idx}); split the batch or raise chunked_prefill_size"
            )
        mask = self.gpu_experts_mask
        if (
            not isinstance(mask, torch.Tensor)
            or mask.numel() != self.num_experts
            or mask.dtype not in (torch.bool, torch.uint8)
            or mask.device.type != "cpu"
            or not mask.is_contiguous()
        ):
            raise ValueError(
                "gpu_experts_mask must stay a contiguous CPU bool tensor of num_experts entries "
                "(update it in place with .copy_())"
            )
        return x

    @staticmethod
    def _to_cpu(x, device, topk_ids, topk_weights):
        # Conversions only where needed: each torch call costs about a microsecond, and a
        # one-token decode is about a millisecond.
        if device.type != "cpu":
            x = x.to("cpu")
        if x.dtype not in _FLOAT_DTYPES:
            x = x.to(torch.float32)
        # A negated view (torch's neg bit) reports contiguous, yet its memory holds the values
        # before negation: resolve_neg materialises it (and returns the tensor itself otherwise).
        x = x.resolve_neg()
        if not x.is_contiguous():
            x = x.contiguous()
        ids = topk_ids.resolve_neg()
        if ids.device.type != "cpu":
            ids = ids.to("cpu")
        if ids.dtype not in _ID_DTYPES:
            ids = ids.to(torch.int64)
        if not ids.is_contiguous():
            ids = ids.contiguous()
        w = topk_weights.resolve_neg()
        if w.device.type != "cpu" or w.dtype != torch.float32:
            w = w.to("cpu", torch.float32)
        if not w.is_contiguous():
            w = w.contiguous()
        return x, ids, w, device

    @staticmethod
    def select_deferred_experts(expert_ids, expert_scores, protected_k: int, num_experts=None):
        """Split ``[B, k]`` ids into (immediate, deferred): the union over the batch of each
        token's top-``protected_k`` experts (by score) is protected and runs now; every other
        (token, slot) is deferred to the next layer. Entries not in a tensor are -1.
        ``num_experts`` (default: from the ids) sizes the membership table."""
        if expert_ids.dim() != 2 or tuple(expert_scores.shape) != tuple(expert_ids.shape):
            raise ValueError(
                f"expert_ids and expert_scores must share one [B, k] shape, got "
                f"{tuple(expert_ids.shape)} and {tuple(expert_scores.shape)}"
            )
        if num_experts is not None and int(num_experts) < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        k = expert_ids.shape[1]
        if expert_ids.numel() == 0:
            return expert_ids.clone(), expert_ids.clone()
        if protected_k <= 0:
            return torch.full_like(expert_ids, -1), expert_ids.clone()
        if protected_k >= k:
            return expert_ids.clone(), torch.full_like(expert_ids, -1)
        top = expert_scores.topk(protected_k, dim=1).indices
        protected = expert_ids.gather(1, top)
        # A membership table over the ids instead of torch.unique/isin: fixed shapes, so on a
        # GPU nothing waits for the device (the stream path must not block the host).
        ceiling = int(num_experts) if num_experts is not None else int(expert_ids.max()) + 1
        ceiling = max(ceiling, 0)
        if ceiling > 1 << 24:  # a table of that many flags is a mistake, not a layer
            raise ValueError(f"expert ids reach {ceiling - 1}; pass num_experts")

        def slot(ids):  # -1 and ids beyond the table land on the spare last entry
            return torch.where((ids < 0) | (ids >= ceiling), ceiling, ids).long()

        table = torch.zeros(ceiling + 1, dtype=torch.bool, device=expert_ids.device)
        table[slot(protected).reshape(-1)] = True
        table[ceiling] = False
        is_protected = table[slot(expert_ids)]
        minus = torch.full_like(expert_ids, -1)
        return torch.where(is_protected, expert_ids, minus), torch.where(
            is_protected, minus, expert_ids
        )

    def _check_loaded(self) -> None:
        if self.moe is None or not self.moe.loaded:
            raise RuntimeError(
                f"layer {self.layer_idx}: load_weights() or load_weights_from_tensors() must "
                "be called before forward"
            )

    def _submit(self, x, ids, w, out, residual) -> int:
        self._check_loaded()
        return self.moe.submit_forward(*self._forward_args(x, ids, w, out, residual))

    def _forward_args(self, x, ids, w, out, residual) -> tuple:
        return (
            x.shape[0],
            x.data_ptr(),
            _FLOAT_DTYPES[x.dtype],
            ids.data_ptr(),
            _ID_DTYPES[ids.dtype],
            w.data_ptr(),
            out.data_ptr(),
            _FLOAT_DTYPES[out.dtype],
            0 if residual is None else residual.data_ptr(),
            "float32" if residual is None else _FLOAT_DTYPES[residual.dtype],
            self.gpu_experts_mask.data_ptr(),
        )

    def submit_write_weight_scale_to_buffer(
        self,
        gpu_tp_count: int,
        expert_id: int,
        w13_weight_ptrs,
        w13_scale_ptrs,
        w2_weight_ptrs,
        w2_scale_ptrs,
    ) -> None:
        """Queue the write of expert ``expert_id`` (a physical slot) into each GPU
        tensor-parallel rank's buffers: ``w13`` = the rank's gate rows then its up rows, ``w2`` =
        down cut to the rank's intermediate columns, with their scales, in the byte layout of
        the method's GPU kernels (the original's). Each list holds one address per rank; the
        buffers must hold ``self.moe.gpu_rank_bytes(gpu_tp_count)`` bytes and stay alive and
        untouched until ``sync_write_weight_scale_to_buffer``. Methods without a GPU layout
        (AMXINT8, AMXINT4, LLAMAFILE) raise NotImplementedError, as in the original."""
        lists = [w13_weight_ptrs, w13_scale_ptrs, w2_weight_ptrs, w2_scale_ptrs]
        ptrs = [[int(p) for p in lst] for lst in lists]
        ticket = self.moe.submit_write_weight_scale_to_buffer(
            int(gpu_tp_count), int(expert_id), *ptrs
        )
        self.__dict__.setdefault("_write_tickets", []).append(ticket)

    def sync_write_weight_scale_to_buffer(self) -> None:
        """Wait for every queued ``submit_write_weight_scale_to_buffer``; raises the first
        error one of them met."""
        tickets = self.__dict__.pop("_write_tickets", [])
        for ticket in tickets:
            self.cpu_infer.engine.wait(ticket)

    def run_layerwise_fp8_batch(self, transport, epoch: int, layer_id: int, expert_count: int):
        """Rank zero of layerwise prefill (block FP8, as the original): write this layer's
        first ``expert_count`` experts into every GPU rank's host slots of ``transport`` (a
        ``kt_kernel_ext.FP8LayerwiseTransport``), each rank's copy thread moving them to its
        GPU as they land; returns this rank's figures (``writer_ms``, ``slot_wait_ms``,
        ``h2d_ms``, ``total_ms``, ...) once its own copies are done. Queued work of this
        process's engine is finished first."""
        if self.method != "FP8":
            raise RuntimeError(
                "run_layerwise_fp8_batch is only valid for the block-FP8 backend "
                f"(this layer is {self.method})"
            )
        self.cpu_infer.engine.sync(0)
        return self.moe.run_layerwise_fp8_batch(
            transport, int(epoch), int(layer_id), int(expert_count)
        )

    def submit_forward(self, hidden_states, topk_ids, topk_weights, cuda_stream=None) -> None:
        """Queue this layer's CPU experts for ``hidden_states`` and return at once.

        CPU tensors are used in place. CUDA tensors with a ``cuda_stream`` (a ``cudaStream_t``
        int) take the stream path (``kt_kernel._stream``): copies into pinned buffers and the
        CPU work are enqueued on that stream and nothing here waits. Tensors on another device
        without a stream (or with ``KT_FORCE_SYNC_SUBMIT=1``) are copied to the CPU first.
        """
        dev = _stream.device_for(hidden_states, cuda_stream, self._force_sync_submit)
        if dev is not None:
            x = self._validate_forward_inputs(hidden_states, topk_ids, topk_weights)
            for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
                if t.device != hidden_states.device:
                    raise ValueError(
                        f"{name} is on {t.device} but hidden_states on {hidden_states.device}"
                    )
            self._check_loaded()
            with self._lock:
                _stream.submit(self, dev, x, topk_ids, topk_weights, int(cuda_stream))
                self._pending.append(None)  # a stream entry: sync_forward asks _stream
            return
        x, ids, w, device = self._check_forward_inputs(hidden_states, topk_ids, topk_weights)
        qlen = x.shape[0]
        out_dtype = _out_dtype(hidden_states)
        d = self.max_deferred_experts_per_token
        with BaseMoEWrapper._class_lock:
            prev = BaseMoEWrapper._pending_deferred.pop(self.layer_idx - 1, None)
        # Only a residual of exactly this batch's shape is added: layer indices are global, so
        # the previous index may belong to another model (another hidden size) or batch.
        residual = (
            prev[0]
            if prev is not None and tuple(prev[0].shape) == (qlen, self.hidden_size)
            else None
        )
        with self._lock:
            if d > 0:
                immediate, deferred = self.select_deferred_experts(
                    ids, w, self.num_experts_per_tok - d, self.num_experts
                )
                immediate, deferred = immediate.contiguous(), deferred.contiguous()
            else:
                immediate, deferred = ids, None
            out = self._buffer("out", qlen, out_dtype)
            ticket = self._submit(x, immediate, w, out, residual)
            self._pending.append(
                _Pending(ticket, out, device, (x, immediate, w, residual, self.gpu_experts_mask))
            )
            if deferred is not None:
                dout = self._buffer("deferred", qlen, torch.float32)
                dticket = self._submit(x, deferred, w, dout, None)
                # FIFO order on the engine guarantees it finishes before layer+1's forward runs;
                # its inputs stay referenced until a later ticket of this layer completes.
                self._deferred_alive.append((dticket, (x, deferred, w, dout)))
                with BaseMoEWrapper._class_lock:
                    BaseMoEWrapper._pending_deferred[self.layer_idx] = (dout, qlen)

    def sync_forward(self, hidden_states=None, cuda_stream=None) -> torch.Tensor:
        """Wait for the oldest submitted forward of this layer; returns ``[B, H]`` in the dtype
        (and on the device) of the hidden states it was given."""
        with self._lock:
            if not self._pending:
                raise RuntimeError(
                    f"layer {self.layer_idx}: sync_forward() without a matching submit_forward()"
                )
            p = self._pending.popleft()
            if p is None:
                return _stream.sync(self)
        self.cpu_infer.engine.wait(p.ticket)
        with self._lock:
            while self._deferred_alive and self._deferred_alive[0][0] < p.ticket:
                self._deferred_alive.popleft()
        out = p.out
        if p.device.type != "cpu":
            out = out.to(p.device)
        return out

    def __del__(self) -> None:
        # Queued tasks still read this wrapper's tensors: let them finish before those go.
        try:
            if getattr(self, "_pending", None) or getattr(self, "_deferred_alive", None):
                self.cpu_infer.engine.sync(0)
        except Exception:
            pass

    def forward(self, hidden_states, topk_ids, topk_weights, cuda_stream=None) -> torch.Tensor:
        """``submit_forward`` then ``sync_forward``; output has ``hidden_states``' shape."""
        # Checked inline, cheapest first: right after a decode flushed the caches every call
        # here costs microseconds.
        stream_path = (
            None
            if cuda_stream is None
            else _stream.device_for(hidden_states, cuda_stream, self._force_sync_submit)
        )
        if stream_path is None and self._can_run_now():
            x, ids, w, device = self._check_forward_inputs(hidden_states, topk_ids, topk_weights)
            out = self._buffer("out", x.shape[0], _out_dtype(hidden_states))
            self._check_loaded()
            # On this thread when the engine is idle: no hand-off to the engine thread and back.
            self.moe.forward_now(*self._forward_args(x, ids, w, out, None))
            if x is hidden_states:  # already [T, H] on the CPU (kernel-ready inputs, say)
                return out
            if device is not _CPU and device.type != "cpu":
                out = out.to(device)
        else:
            self.submit_forward(hidden_states, topk_ids, topk_weights, cuda_stream)
            out = self.sync_forward(hidden_states, cuda_stream)
        return out if out.shape == hidden_states.shape else out.reshape(hidden_states.shape)

    def _can_run_now(self) -> bool:
        """A forward may skip the queue: nothing of this layer pending, no deferred experts
        to split off, none from the previous layer to add."""
        if self._pending or self.max_deferred_experts_per_token > 0:
            return False
        # One dict lookup is atomic: no lock needed to read (a deferred result that appears
        # right after is as good as one that appears right after a locked read).
        return (self.layer_idx - 1) not in BaseMoEWrapper._pending_deferred
