"""``KTMoEWrapper``: the factory SGLang calls, with the original's signature."""

from __future__ import annotations

from typing import Any

import torch

from . import _kt_core
from .experts_base import _REQUIRED, BaseMoEWrapper

# Every method string of the original, and those this build computes; the rest are recognised
# and refused with NotImplementedError. Both lists come from the native core's registry.
INFERENCE_METHODS = frozenset(_kt_core.METHODS)
SFT_METHODS = frozenset(
    {
        "AMXBF16_SFT",
        "AMXFP8_SFT",
        "MXFP4_SFT",
        "INT8_SFT",
        "AMXINT8_SFT",
        "AMXINT4_SFT",
        "AMXINT4_1_SFT",
        "RAWINT4_SFT",
        "AMXINT4_KGroup_SFT",
        "AMXINT4_1KGroup_SFT",
        "AMXBF16_SFT_SkipLoRA",
        "AMXINT8_SFT_SkipLoRA",
        "AMXINT4_SFT_SkipLoRA",
        "AMXINT4_1_SFT_SkipLoRA",
        "AMXINT4_KGroup_SFT_SkipLoRA",
        "AMXINT4_1KGroup_SFT_SkipLoRA",
    }
)
IMPLEMENTED_METHODS = frozenset(_kt_core.IMPLEMENTED_METHODS)


class KTMoEWrapper:
    """Factory: ``KTMoEWrapper(...)`` returns the backend object for ``method`` (as in the
    original, ``isinstance(w, KTMoEWrapper)`` is False; the backend derives from
    :class:`~kt_kernel.experts_base.BaseMoEWrapper`).

    Beyond the original: ``gpu_experts_mask`` may be omitted (upstream SGLang passes
    ``num_gpu_experts=N`` instead, meaning experts ``[0, N)`` run on the GPU), CPU tensors and
    ``cuda_stream=None`` work, and every argument is validated.
    """

    def __new__(
        cls,
        layer_idx: int,
        num_experts: int,
        num_experts_per_tok: int,
        hidden_size: int,
        moe_intermediate_size: int,
        gpu_experts_mask: torch.Tensor | None = None,
        cpuinfer_threads: int | None = _REQUIRED,  # type: ignore[assignment]
        threadpool_count: int = _REQUIRED,  # type: ignore[assignment]
        weight_path: str = _REQUIRED,  # type: ignore[assignment]
        chunked_prefill_size: int = _REQUIRED,  # type: ignore[assignment]
        cpu_save: bool = False,
        max_deferred_experts_per_token: int | None = None,
        method: str = "AMXINT4",
        numa_nodes: list[int] | None = None,
        mode: str = "inference",
        num_gpu_experts: int = 0,
        lora_rank: int = 16,
        lora_alpha: float = 32.0,
        lora_dropout: float = 0.0,
        max_cache_depth: int = 1,
        group_size: int = 128,
        zero_point: bool = True,
        full_weight_grad: bool = False,
        swiglu_limit: float = 0.0,
        swiglu_alpha: float = 0.0,
        **unknown: Any,
    ):
        for name, value in (
            ("cpuinfer_threads", cpuinfer_threads),
            ("threadpool_count", threadpool_count),
            ("weight_path", weight_path),
            ("chunked_prefill_size", chunked_prefill_size),
        ):
            if value is _REQUIRED:
                raise TypeError(f"KTMoEWrapper() missing required argument: '{name}'")
        # Arguments proposed for later kt-kernel versions (e.g. mmap_experts_dir) are accepted
        # and ignored rather than breaking newer SGLang builds.
        unknown.pop("mmap_experts_dir", None)
        if unknown:
            raise TypeError(f"KTMoEWrapper() got unexpected keyword arguments: {sorted(unknown)}")
        if mode not in ("inference", "sft"):
            raise ValueError(f"mode must be 'inference' or 'sft', got {mode!r}")
        if mode == "sft":
            if method not in SFT_METHODS:
                raise ValueError(
                    f"unknown SFT method {method!r}; valid methods: {sorted(SFT_METHODS)}"
                )
            raise NotImplementedError(
                "mode='sft' (LoRA fine-tuning) is not implemented by this kt_kernel"
            )
        if method not in INFERENCE_METHODS:
            raise ValueError(
                f"unknown method {method!r}; valid methods: {sorted(INFERENCE_METHODS)}"
            )
        if method not in IMPLEMENTED_METHODS:
            raise NotImplementedError(
                f"method {method!r} is recognised but not built into this kt_kernel yet "
                f"(available: {sorted(IMPLEMENTED_METHODS)})"
            )
        from .utils.native import AMXMoEWrapper, LlamafileMoEWrapper, NativeMoEWrapper

        if method in ("AMXINT8", "AMXINT4"):
            backend = AMXMoEWrapper
        elif method == "LLAMAFILE":
            backend = LlamafileMoEWrapper
        else:
            backend = NativeMoEWrapper
        return backend(
            layer_idx=layer_idx,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            hidden_size=hidden_size,
            moe_intermediate_size=moe_intermediate_size,
            gpu_experts_mask=gpu_experts_mask,
            cpuinfer_threads=cpuinfer_threads,
            threadpool_count=threadpool_count,
            weight_path=weight_path,
            chunked_prefill_size=chunked_prefill_size,
            cpu_save=cpu_save,
            max_deferred_experts_per_token=max_deferred_experts_per_token,
            method=method,
            numa_nodes=numa_nodes,
            num_gpu_experts=num_gpu_experts,
            swiglu_limit=swiglu_limit,
            swiglu_alpha=swiglu_alpha,
        )

    @staticmethod
    def set_capture_batch_sizes(batch_sizes: list[int]) -> None:
        """Batch sizes whose output buffers must never move (CUDA-graph capture)."""
        BaseMoEWrapper.set_capture_batch_sizes(batch_sizes)

    @staticmethod
    def get_capture_batch_sizes() -> list[int]:
        return BaseMoEWrapper.get_capture_batch_sizes()

    @staticmethod
    def clear_buffer_cache() -> None:
        """Drop every cached per-batch-size buffer."""
        BaseMoEWrapper.clear_buffer_cache()

    @staticmethod
    def clear_sft_buffer_cache() -> None:
        """No SFT buffers exist in this implementation."""
