"""The CUDA-stream path of ``submit_forward`` / ``sync_forward`` (what SGLang uses on a GPU
server): nothing blocks the calling thread.

``submit_forward`` enqueues, on the caller's stream: copies of the inputs into pinned staging
buffers (``cuMemcpyAsync``), then a host callback that queues the CPU experts on the engine
(``cuLaunchHostFunc``; both opened from the CUDA driver at first use, see
``kt_core::cuda_bridge``), all in one call into the core. ``sync_forward`` enqueues a host
callback that holds the stream until the CPU work is done, then a copy of the result into a
device buffer, and returns that buffer at once (valid until this layer's next forward of the
same batch size). Torch runs on the stream only where the inputs need converting (dtype,
layout) or splitting (deferred experts).

Every address a captured CUDA graph may replay (staging buffers, the batch-size cell, the
task descriptors) lives as long as the process for the batch sizes given to
``set_capture_batch_sizes``; other sizes share one slot per layer that is released only once
the stream has passed its last use (an event). Errors met on the driver's thread are raised by
the next call.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field

import torch

from . import _kt_core

_FLOAT_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_ID_DTYPES = {torch.int32: "int32", torch.int64: "int64"}


class TorchCuda:
    """Torch work and events on a CUDA stream given as a ``cudaStream_t`` int."""

    pinned = True
    keep = None  # CUDA's caching allocator orders reuse of freed inputs on the stream

    def __init__(self) -> None:
        self._streams: dict[tuple[int, int], torch.cuda.ExternalStream] = {}

    def on(self, stream: int, device: torch.device):
        key = (stream, device.index or 0)
        s = self._streams.get(key)
        if s is None:
            # Handle 0 is the legacy default stream, which ExternalStream does not wrap.
            if stream == 0:
                s = torch.cuda.default_stream(device)
            else:
                s = torch.cuda.ExternalStream(stream, device=device)
            self._streams[key] = s
        return torch.cuda.stream(s)

    def device_buffer(self, shape, dtype, device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    def event(self, stream: int, device: torch.device):
        e = torch.cuda.Event()
        e.record(self._streams[(stream, device.index or 0)])
        return e


# Tests replace this with a stand-in device whose "stream" is the fake driver's.
DEVICE = None


def force_sync_submit() -> bool:
    """``KT_FORCE_SYNC_SUBMIT=1``: CUDA callers get the plain blocking path (read when a
    wrapper is made: an environment lookup per call costs about a microsecond)."""
    return os.environ.get("KT_FORCE_SYNC_SUBMIT", "0") not in ("", "0")


def device_for(hidden_states: torch.Tensor, cuda_stream, force_sync: bool = False):
    """The device object for the stream path, or None when the plain path applies."""
    if cuda_stream is None or force_sync:
        return None
    if DEVICE is not None:
        return DEVICE
    if hidden_states.device.type == "cuda":
        global _TORCH_CUDA
        if _TORCH_CUDA is None:
            _TORCH_CUDA = TorchCuda()
        return _TORCH_CUDA
    return None


_TORCH_CUDA: TorchCuda | None = None


@dataclass
class Slot:
    """Staging buffers and task descriptors of one layer at one batch size."""

    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor
    bsz: torch.Tensor
    device_out: torch.Tensor
    task: int
    deferred_ids: torch.Tensor | None = None
    deferred_out: torch.Tensor | None = None
    deferred_task: int | None = None
    keep: tuple = ()
    # (address, bytes) of the staging buffers the inputs are copied to, and the copy back.
    x_to: tuple = ()
    ids_to: tuple = ()
    weights_to: tuple = ()
    deferred_ids_to: tuple = ()
    copy_back: tuple = ()


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel() * t.element_size()


@dataclass
class State:
    """Per-wrapper stream state. A state with slots is also kept in ``_KEPT``: a captured graph
    may replay a slot's addresses after its wrapper is gone, so slots are never freed."""

    slots: dict[tuple, Slot] = field(default_factory=dict)
    temp_key: tuple | None = None
    retired: collections.deque = field(default_factory=collections.deque)
    pending: collections.deque = field(default_factory=collections.deque)
    kept: bool = False


_KEPT: list[State] = []


def raise_stream_errors() -> None:
    errors = _kt_core.stream_errors()
    if errors:
        raise RuntimeError(
            "kt_kernel: a CPU task ordered on a CUDA stream failed: " + "; ".join(errors)
        )


def _make_slot(wrapper, dev, t, x, ids_dtype, out_dtype, residual, deferred: bool) -> Slot:
    h, k = wrapper.hidden_size, wrapper.num_experts_per_tok
    pin = dev.pinned

    def host(shape, dtype):
        return torch.zeros(shape, dtype=dtype, pin_memory=pin)

    slot = Slot(
        x=host((t, h), x.dtype),
        ids=host((t, k), ids_dtype),
        weights=host((t, k), torch.float32),
        out=host((t, h), out_dtype),
        bsz=host((1,), torch.int32),
        device_out=dev.device_buffer((t, h), out_dtype, x.device),
        task=0,
    )
    slot.bsz.fill_(t)
    mask = wrapper.gpu_experts_mask.data_ptr()

    def task(ids, out, res):
        return wrapper.moe.stream_task(
            t,
            slot.x.data_ptr(),
            _FLOAT_DTYPES[slot.x.dtype],
            ids.data_ptr(),
            _ID_DTYPES[ids.dtype],
            slot.weights.data_ptr(),
            out.data_ptr(),
            _FLOAT_DTYPES[out.dtype],
            0 if res is None else res.data_ptr(),
            "float32" if res is None else _FLOAT_DTYPES[res.dtype],
            mask,
            slot.bsz.data_ptr(),
        )

    slot.task = task(slot.ids, slot.out, residual)
    if deferred:
        slot.deferred_ids = host((t, k), ids_dtype)
        slot.deferred_out = host((t, h), torch.float32)
        slot.deferred_task = task(slot.deferred_ids, slot.deferred_out, None)
        slot.deferred_ids_to = _span(slot.deferred_ids)
    slot.x_to, slot.ids_to, slot.weights_to = _span(slot.x), _span(slot.ids), _span(slot.weights)
    slot.copy_back = ((slot.device_out.data_ptr(), *_span(slot.out)),)
    return slot


def _slot(wrapper, state: State, dev, stream, x, ids_dtype, out_dtype, residual, deferred):
    t = x.shape[0]
    res_ptr = 0 if residual is None else residual.data_ptr()
    key = (t, x.dtype, ids_dtype, out_dtype, res_ptr, deferred)
    slot = state.slots.get(key)
    if slot is not None:
        return slot
    # Release retired slots the stream has passed.
    while state.retired and state.retired[0][1].query():
        state.retired.popleft()
    if t not in type(wrapper)._capture_batch_sizes:
        # One slot for sizes no graph captures: the previous one retires once the stream is past
        # its last use (its descriptors stay, pointing at memory no call will use again).
        old = state.slots.pop(state.temp_key, None) if state.temp_key is not None else None
        if old is not None:
            state.retired.append((old, dev.event(stream, x.device)))
        state.temp_key = key
    slot = _make_slot(wrapper, dev, t, x, ids_dtype, out_dtype, residual, deferred)
    state.slots[key] = slot
    if not state.kept:
        _KEPT.append(state)
        state.kept = True
    return slot


def _ready(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the inputs can be copied as they are (no torch work on the stream)."""
    return (
        x.dtype in _FLOAT_DTYPES
        and ids.dtype in _ID_DTYPES
        and w.dtype == torch.float32
        and x.is_contiguous()
        and ids.is_contiguous()
        and w.is_contiguous()
        and not (x.is_neg() or ids.is_neg() or w.is_neg())
    )


def submit(wrapper, dev, hidden_states, topk_ids, topk_weights, stream: int) -> None:
    """Enqueue this layer's CPU experts on ``stream`` (inputs validated by the caller;
    ``hidden_states`` already ``[T, H]``)."""
    raise_stream_errors()
    # The class-wide lock and deferred-results map of BaseMoEWrapper, reached through the
    # instance (importing experts_base here would be a cycle).
    lock, deferred_map = wrapper._class_lock, wrapper._pending_deferred
    state: State = wrapper._stream_state
    h = wrapper.hidden_size
    d = wrapper.max_deferred_experts_per_token
    with lock:
        prev = deferred_map.pop(wrapper.layer_idx - 1, None)
    x, ids, w = hidden_states, topk_ids, topk_weights
    t = x.shape[0]
    residual = prev[0] if prev is not None and tuple(prev[0].shape) == (t, h) else None
    key = (t, x.dtype, ids.dtype, x.dtype, 0 if residual is None else residual.data_ptr(), d > 0)
    slot = state.slots.get(key)
    deferred = None
    if slot is None or d > 0 or not _ready(x, ids, w):
        # Torch work on the caller's stream: conversions, the deferred split, a new slot.
        with dev.on(stream, hidden_states.device):
            if x.dtype not in _FLOAT_DTYPES:
                x = x.to(torch.float32)
            # resolve_neg: a negated view's memory holds the values before negation.
            x = x.resolve_neg().contiguous()
            ids = topk_ids if topk_ids.dtype in _ID_DTYPES else topk_ids.to(torch.int64)
            ids = ids.resolve_neg().contiguous()
            w = topk_weights.to(torch.float32).resolve_neg().contiguous()
            if d > 0:
                ids, deferred = wrapper.select_deferred_experts(
                    ids, w, wrapper.num_experts_per_tok - d, wrapper.num_experts
                )
                ids, deferred = ids.contiguous(), deferred.contiguous()
            slot = _slot(wrapper, state, dev, stream, x, ids.dtype, x.dtype, residual, d > 0)
    copies = [
        (slot.x_to[0], x.data_ptr(), slot.x_to[1]),
        (slot.weights_to[0], w.data_ptr(), slot.weights_to[1]),
        (slot.ids_to[0], ids.data_ptr(), slot.ids_to[1]),
    ]
    if deferred is not None:
        copies.append((slot.deferred_ids_to[0], deferred.data_ptr(), slot.deferred_ids_to[1]))
    slot.keep = (x, w, ids, deferred)
    if dev.keep is not None:
        dev.keep.append(slot.keep)
    engine = wrapper.cpu_infer.engine
    engine.start_on_stream(stream, slot.task, copies)
    if deferred is not None:
        engine.start_on_stream(stream, slot.deferred_task)
        with lock:
            deferred_map[wrapper.layer_idx] = (slot.deferred_out, t)
    state.pending.append((slot, stream))


def sync(wrapper) -> torch.Tensor:
    """Enqueue the wait and the copy back for the oldest submitted forward; returns the device
    buffer the result will be in (in stream order)."""
    state: State = wrapper._stream_state
    slot, stream = state.pending.popleft()
    # With deferred experts this layer's deferred task may stay queued (one pending task).
    allow = 1 if slot.deferred_task is not None else 0
    wrapper.cpu_infer.engine.sync_on_stream(stream, allow, slot.copy_back)
    raise_stream_errors()
    return slot.device_out
