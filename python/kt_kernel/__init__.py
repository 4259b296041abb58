"""kt_kernel: CPU Mixture-of-Experts kernels for hybrid CPU/GPU LLM serving.

A drop-in for KTransformers' ``kt_kernel``: same import, same ``KTMoEWrapper`` signature, one
native module that picks its kernels at run time (AVX2 → AVX-512 → AVX512-BF16 → AMX).
"""

from __future__ import annotations

import os
import sys

from . import _kt_core

__version__: str = _kt_core.__version__

# Raises here (at import) if KT_KERNEL_CPU_VARIANT is unknown or asks for more than the CPU has.
__cpu_variant__: str = _kt_core.cpu_variant()
__int8_weight_layout__: str = "kt-int8-n32-k64-vnni-v1"
# FP8: E4M3 codes with one f32 scale per 128x128 block, decoded by the named vector kernel.
__fp8_weight_layout__: str = "block-e4m3-128x128"
# `__int8_kernel__` and `__fp8_kernel__` name the kernels in use. They come from cpu_info(),
# whose prefetch calibrations stream DRAM for a while (about 1 s on an Emerald Rapids VM), so
# they are looked up on first access and `import kt_kernel` measures nothing.
_KERNEL_ATTRIBUTES = {"__int8_kernel__": "AMXINT8", "__fp8_kernel__": "FP8"}


from . import kt_kernel_ext  # noqa: E402
from .experts import KTMoEWrapper  # noqa: E402
from .experts_base import generate_gpu_experts_masks  # noqa: E402

# The original exposes its native module as a top-level name too.
sys.modules.setdefault("kt_kernel_ext", kt_kernel_ext)

if os.environ.get("KT_KERNEL_DEBUG") == "1":
    _info = _kt_core.cpu_info()
    print(
        f"[kt_kernel] variant={_info['variant']} (detected {_info['detected_variant']}), "
        f"BF16 kernel={_info['kernels']['BF16']}, topology: {_info['topology']}",
        file=sys.stderr,
    )


def cpu_info() -> dict:
    """CPU, ISA, topology and kernel choices of this process."""
    return _kt_core.cpu_info()


def build_info() -> dict:
    """Version, build profile and compiled kernel paths of the native module."""
    return _kt_core.build_info()


def __getattr__(name: str):
    # SFT is not part of this implementation; the original returns None when SFT is missing.
    if name == "AMXSFTMoEWrapper":
        return None
    if name in _KERNEL_ATTRIBUTES:
        return _kt_core.cpu_info()["kernels"][_KERNEL_ATTRIBUTES[name]]
    raise AttributeError(f"module 'kt_kernel' has no attribute {name!r}")


__all__ = [
    "KTMoEWrapper",
    "AMXSFTMoEWrapper",
    "generate_gpu_experts_masks",
    "kt_kernel_ext",
    "__cpu_variant__",
    "__int8_kernel__",
    "__int8_weight_layout__",
    "__fp8_kernel__",
    "__fp8_weight_layout__",
    "__version__",
    "cpu_info",
    "build_info",
]
