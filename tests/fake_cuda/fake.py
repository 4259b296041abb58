"""The stand-in CUDA driver (``fake_cuda.c``) for tests and benchmarks on machines without a
GPU: ``build(folder)`` compiles and loads it (and makes kt-kernel use it), ``FakeDevice`` is
the stream path's device object with copies enqueued on its streams."""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import subprocess
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "fake_cuda.c"
HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def build(folder: Path):
    """Compile the stand-in into ``folder``, load it, and point kt-kernel's stream path at it;
    returns the ctypes library, or None without a C compiler."""
    from kt_kernel import _kt_core

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    out = Path(folder) / "libfakecuda.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-pthread", "-o", out, SOURCE], check=True)
    lib = ctypes.CDLL(str(out))
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    lib.fake_stream_create.restype = vp
    for name, args in {
        "fake_memcpy_async": [vp, vp, vp, sz],
        "fake_gate": [vp],
        "fake_gate_open": [vp],
        "fake_mark": [vp],
        "fake_stream_synchronize": [vp],
        "fake_capture_begin": [vp],
        "fake_graph_launch": [vp, vp],
        "cuLaunchHostFunc": [vp, HOST_FN, vp],
    }.items():
        getattr(lib, name).argtypes = args
    for name in ("fake_marks", "fake_host_calls"):
        getattr(lib, name).argtypes = [vp]
        getattr(lib, name).restype = ctypes.c_long
    lib.fake_stream_set_device.argtypes = [vp, ctypes.c_int]
    lib.fake_ctx_pushes.restype = ctypes.c_long
    lib.fake_bound_device.restype = ctypes.c_int
    lib.fake_htod_copies.restype = ctypes.c_long
    lib.fake_capture_end.argtypes = [vp]
    lib.fake_capture_end.restype = vp
    lib.fake_graph_host_args.argtypes = [vp, ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
    _kt_core.use_cuda_driver(str(out))
    return lib


class FakeEvent:
    def __init__(self, lib, stream, target):
        self.lib, self.stream, self.target = lib, stream, target

    def query(self) -> bool:
        return self.lib.fake_marks(self.stream) >= self.target


class FakeDevice:
    """The stand-in for torch's CUDA side of the stream path: "device" tensors are CPU
    tensors (the stand-in driver's copies are memcpy in stream order)."""

    pinned = False

    def __init__(self, lib):
        self.lib = lib
        # Inputs the stream reads later: CPU memory is not stream-ordered as CUDA's caching
        # allocator is, so they are kept until the caller clears this.
        self.keep: list = []
        self.marks: dict[int, int] = {}

    def on(self, stream, device):
        return contextlib.nullcontext()

    def device_buffer(self, shape, dtype, device):
        return torch.zeros(shape, dtype=dtype)

    def event(self, stream, device):
        self.lib.fake_mark(stream)
        self.marks[stream] = self.marks.get(stream, 0) + 1
        return FakeEvent(self.lib, stream, self.marks[stream])
