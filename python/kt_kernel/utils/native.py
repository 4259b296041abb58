"""Backends built on the native layer: ``BF16`` (weights kept in bf16) and ``AMXINT8``
(weights quantised per row to int8 with the original's rule and layout)."""

from __future__ import annotations

import os

import torch

from .. import _kt_core
from ..experts_base import _FLOAT_DTYPES, BaseMoEWrapper


class NativeMoEWrapper(BaseMoEWrapper):
    """BF16 experts: loaded from a Hugging Face safetensors checkpoint (``load_weights``) or
    from tensors (``load_weights_from_tensors``), packed once into the kernels' layout."""

    _format = "bf16"

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
            os.environ.get("KT_BF16_KERNEL"),
            self._format,
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
        gate, up, down = (t.detach().to("cpu").contiguous() for t in tensors.values())
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
    """AMXINT8 / AMXINT4 experts: quantised per output row (the original's rules, so values
    and scales equal its converted files) from tensors or from a Hugging Face checkpoint, and
    run with integer dot products (AVX512-VNNI, AVX2 or scalar; AMX tiles are not built yet)."""

    @property
    def _format(self) -> str:
        return "int4" if self.method == "AMXINT4" else "int8"

    def load_weights(self, physical_to_logical_map_cpu=None) -> None:
        """Quantise this layer's experts from the Hugging Face checkpoint at ``weight_path``.
        Files already converted by the original (``blk.*`` safetensors, ``_layer_*`` folders)
        cannot be read yet."""
        path = os.fspath(self.weight_path) if self.weight_path else ""
        if os.path.isdir(path) and (
            any(n.startswith("_layer_") for n in os.listdir(path)) or _has_converted_keys(path)
        ):
            raise NotImplementedError(
                f"{path!r} holds weights converted by the original (AMXINT8 layout); reading them "
                "is not built yet. Point weight_path at the Hugging Face checkpoint instead."
            )
        super().load_weights(physical_to_logical_map_cpu)


def _has_converted_keys(path: str) -> bool:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return '"blk.' in f.read()
    return False


class LlamafileMoEWrapper(BaseMoEWrapper):
    """GGUF (LLAMAFILE) weights: not built yet."""

    def __init__(self, **kwargs) -> None:
        raise NotImplementedError("LLAMAFILE (GGUF) is not built into this kt_kernel yet")
