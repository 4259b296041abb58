"""Backends built on the native layer: ``BF16`` (weights kept in bf16), ``AMXINT8`` /
``AMXINT4`` (per-row int8/int4 weights with the original's rule and layout) and ``LLAMAFILE``
(ggml blocks from GGUF files)."""

from __future__ import annotations

import os

import torch

from .. import _kt_core
from ..experts_base import _FLOAT_DTYPES, BaseMoEWrapper, _check_dense


class NativeMoEWrapper(BaseMoEWrapper):
    """BF16 experts: loaded from a Hugging Face safetensors checkpoint (``load_weights``) or
    from tensors (``load_weights_from_tensors``), packed once into the kernels' layout."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.moe = _kt_core.MoeLayer(
            self.cpu_infer.engine,
            self.layer_idx,
            self.num_experts,
            self.num_experts_per_tok,
            self.hidden_size,
            self.moe_intermediate_size,
            self.chunked_prefill_size,
            self.swiglu_limit,
            self.swiglu_alpha,
            os.environ.get("KT_BF16_KERNEL") or None,  # set but empty: as if unset
            self.method,
        )

    def load_weights(self, physical_to_logical_map_cpu=None) -> None:
        """Read this layer's experts from ``weight_path`` (a safetensors file or a folder of
        shards). Physical slot ``p`` receives logical expert ``map[p]``."""
        if not isinstance(self.weight_path, str | os.PathLike) or not self.weight_path:
            raise ValueError("weight_path must name a safetensors file or folder")
        if not os.path.exists(self.weight_path):
            raise FileNotFoundError(f"weight_path {self.weight_path!r} does not exist")
        ptr, n, keep = self._map_arg(physical_to_logical_map_cpu)
        self.moe.load_from_checkpoint(os.fspath(self.weight_path), self.layer_idx, ptr, n)
        del keep

    def load_weights_from_tensors(
        self, gate_proj, up_proj, down_proj, physical_to_logical_map_cpu=None
    ) -> None:
        """Pack experts from CPU tensors gate/up ``[E, I, H]`` and down ``[E, H, I]``
        (bf16, fp16 or fp32)."""
        tensors = {"gate_proj": gate_proj, "up_proj": up_proj, "down_proj": down_proj}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor")
            _check_dense(name, t)
            if t.dtype not in _FLOAT_DTYPES:
                raise TypeError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")
            if t.dim() != 3:
                raise ValueError(f"{name} must be 3-D, got shape {tuple(t.shape)}")
        if len({t.dtype for t in tensors.values()}) != 1:
            raise TypeError("gate_proj, up_proj and down_proj must share one dtype")
        e, i, h = gate_proj.shape[0], self.moe_intermediate_size, self.hidden_size
        want = {"gate_proj": (e, i, h), "up_proj": (e, i, h), "down_proj": (e, h, i)}
        for name, t in tensors.items():
            if tuple(t.shape) != want[name]:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}, expected {list(want[name])} for "
                    f"hidden_size={h}, moe_intermediate_size={i}"
                )
        ptr, n, keep = self._map_arg(physical_to_logical_map_cpu)
        if ptr == 0 and e != self.num_experts:
            raise ValueError(
                f"tensors hold {e} experts but num_experts={self.num_experts}; pass a "
                "physical_to_logical_map_cpu to choose experts"
            )
        gate, up, down = (t.detach().to("cpu").resolve_neg().contiguous() for t in tensors.values())
        self.moe.load_from_tensors(
            gate.data_ptr(),
            up.data_ptr(),
            down.data_ptr(),
            _FLOAT_DTYPES[gate.dtype],
            e,
            ptr,
            n,
        )
        del keep, gate, up, down


class AMXMoEWrapper(NativeMoEWrapper):
    """AMXINT8 / AMXINT4 experts: per-output-row int8/int4 weights (the original's values and
    layout), run with AMX tiles where the CPU has them and integer vector kernels elsewhere.
    Weights come from files the original's converter wrote, from a Hugging Face checkpoint
    (quantized while loading, to the same bytes) or from tensors."""

    def load_weights(self, physical_to_logical_map_cpu=None) -> None:
        """Load this layer from ``weight_path``: converted files (merged ``blk.*`` safetensors
        or ``_layer_*/_numa_*/*.kt``, written for the same ``threadpool_count``) are copied as
        they are; a Hugging Face checkpoint is quantized on the fly."""
        path = os.fspath(self.weight_path) if self.weight_path else ""
        if path and os.path.isdir(path) and _kt_core.has_converted_layer(path, self.layer_idx):
            ptr, n, keep = self._map_arg(physical_to_logical_map_cpu)
            self.moe.load_from_converted(path, self.layer_idx, ptr, n)
            del keep
            return
        super().load_weights(physical_to_logical_map_cpu)


class LlamafileMoEWrapper(BaseMoEWrapper):
    """LLAMAFILE experts: the ggml blocks of a GGUF file (or a folder of GGUF shards), used as
    stored. ``load_weights`` reads ``blk.{layer_idx}.ffn_{gate,up,down}_exps.weight`` (3-D
    ``[k, n, experts]``); the file decides the types (gate and up share one, down may differ,
    e.g. Q4_K + Q6_K in Q4_K_M files). Every type ``kt_kernel`` can multiply works, including
    the ones the original refuses (Q4_1, Q5_1, IQ4_NL); others are refused at load, naming the
    tensor and type."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.moe = _kt_core.MoeLayer(
            self.cpu_infer.engine,
            self.layer_idx,
            self.num_experts,
            self.num_experts_per_tok,
            self.hidden_size,
            self.moe_intermediate_size,
            self.chunked_prefill_size,
            self.swiglu_limit,
            self.swiglu_alpha,
            None,
            self.method,
        )

    def load_weights(self, physical_to_logical_map_cpu=None) -> None:
        """Copy this layer's experts from ``weight_path`` (a ``.gguf`` file or a folder of
        them) into NUMA-local memory. The map may be None (identity, as in the original); if
        given, physical slot ``p`` receives the file's expert ``map[p]``."""
        if not isinstance(self.weight_path, str | os.PathLike) or not self.weight_path:
            raise ValueError("weight_path must name a .gguf file or a folder of .gguf files")
        if not os.path.exists(self.weight_path):
            raise FileNotFoundError(f"weight_path {self.weight_path!r} does not exist")
        ptr, n, keep = self._map_arg(physical_to_logical_map_cpu)
        self.moe.load_from_gguf(os.fspath(self.weight_path), self.layer_idx, ptr, n)
        del keep

    def load_weights_from_tensors(
        self, gate_proj, up_proj, down_proj, physical_to_logical_map_cpu=None
    ) -> None:
        """Not supported, as in the original: LLAMAFILE reads GGUF files."""
        raise NotImplementedError(
            "LLAMAFILE loads GGUF files (load_weights); use method='BF16', 'AMXINT8' or "
            "'AMXINT4' for weights given as tensors"
        )
