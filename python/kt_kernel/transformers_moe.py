"""Run the routed experts of a Hugging Face ``transformers`` MoE model with kt-kernel.

``offload_experts(model, weight_path, method=...)`` replaces the expert computation of every
sparse-MoE block (Mixtral, Qwen2/3-MoE, and other models whose ``mlp.experts`` module takes
``(hidden_states, top_k_index, top_k_weights)`` and holds fused ``gate_up_proj`` /
``down_proj`` parameters) with one :class:`~kt_kernel.KTMoEWrapper` per layer, loaded from
``weight_path``: the model's own safetensors checkpoint for BF16 and the native methods, a
converted folder (``kt quant``) for AMXINT8/AMXINT4. The router, attention and everything
else stay torch's.

Experts marked in ``gpu_experts_mask`` keep running in torch (on whatever device the model
is), as in hybrid serving: kt-kernel skips them and their torch output is added. With no mask,
the model's expert weights are released after loading (``keep_torch_experts=False``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from .experts import KTMoEWrapper

__all__ = ["KTExperts", "moe_layers", "offload_experts"]


def moe_layers(model: nn.Module) -> Iterator[tuple[int, nn.Module, str]]:
    """``(layer_idx, block, attribute)`` of each decoder layer's sparse-MoE block, where
    ``getattr(block, attribute)`` is the experts module (fused ``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``). Dense layers are skipped."""
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers at .model.layers")
    for idx, layer in enumerate(layers):
        for name in ("mlp", "block_sparse_moe"):
            block = getattr(layer, name, None)
            experts = getattr(block, "experts", None)
            if isinstance(experts, nn.Module) and _is_fused_experts(experts):
                yield idx, block, "experts"
                break


def _is_fused_experts(experts: nn.Module) -> bool:
    gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return (
        isinstance(gu, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gu.dim() == 3
        and down.dim() == 3
    )


class KTExperts(nn.Module):
    """Drop-in for a fused experts module: ``forward(hidden_states, top_k_index,
    top_k_weights)`` runs the CPU experts with kt-kernel and the masked ("GPU") experts, if
    any, with the original torch module."""

    def __init__(self, wrapper, torch_experts: nn.Module | None, gpu_experts_mask: torch.Tensor):
        super().__init__()
        self.wrapper = wrapper
        self.torch_experts = torch_experts
        self.register_buffer("gpu_experts_mask", gpu_experts_mask.clone(), persistent=False)

    @property
    def num_experts(self) -> int:
        return self.wrapper.num_experts

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        weights = top_k_weights.to(torch.float32)
        out = self.wrapper.forward(hidden_states, top_k_index, weights)
        if self.torch_experts is not None and bool(self.gpu_experts_mask.any()):
            # The CPU experts' slots get weight 0 on the torch side (transformers' expert
            # implementations differ in how they treat an out-of-range id, so none is used).
            mask = self.gpu_experts_mask.to(top_k_index.device)
            on_gpu = mask[top_k_index.clamp(min=0)] & (top_k_index >= 0)
            gpu_weights = torch.where(on_gpu, top_k_weights, torch.zeros_like(top_k_weights))
            part = self.torch_experts(hidden_states, top_k_index, gpu_weights)
            out = out + part.to(out.dtype)
        return out


def offload_experts(
    model: nn.Module,
    weight_path: str,
    method: str = "BF16",
    cpuinfer_threads: int | None = None,
    threadpool_count: int = 1,
    chunked_prefill_size: int = 8192,
    gpu_experts_mask: torch.Tensor | None = None,
    keep_torch_experts: bool | None = None,
    **wrapper_kwargs,
) -> list[KTExperts]:
    """Replace the experts of every sparse-MoE layer of ``model`` by kt-kernel; returns the
    new modules in layer order.

    ``gpu_experts_mask``: bool ``[num_moe_layers, num_experts]`` (or ``[num_experts]`` for
    all layers) of experts that stay in torch. ``keep_torch_experts`` (default: whether any
    expert is masked) keeps the torch module for them; otherwise its weights are dropped.
    Extra keyword arguments go to :class:`~kt_kernel.KTMoEWrapper` (e.g.
    ``max_deferred_experts_per_token``, ``swiglu_limit``).
    """
    config = getattr(model, "config", None)
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"kt-kernel runs SiLU-gated experts; this model uses {act!r}")
    found = list(moe_layers(model))
    if not found:
        raise ValueError(f"{type(model).__name__} has no fused sparse-MoE experts to offload")
    if gpu_experts_mask is not None:
        _check_mask(gpu_experts_mask, len(found), keep_torch_experts)
    # A layer's deferred experts are added by the next MoE layer: the last has none after it,
    # so it computes all of its experts at once (as a serving engine sets it).
    deferred = wrapper_kwargs.pop("max_deferred_experts_per_token", None)
    replaced = []
    for n, (idx, block, attr) in enumerate(found):
        experts = getattr(block, attr)
        e, two_i, h = experts.gate_up_proj.shape
        top_k = _top_k(block, config)
        if gpu_experts_mask is None:
            mask = torch.zeros(e, dtype=torch.bool)
        else:
            mask = gpu_experts_mask if gpu_experts_mask.dim() == 1 else gpu_experts_mask[n]
            mask = mask.to("cpu", torch.bool)
        wrapper = KTMoEWrapper(
            layer_idx=idx,
            num_experts=e,
            num_experts_per_tok=top_k,
            hidden_size=h,
            moe_intermediate_size=two_i // 2,
            gpu_experts_mask=mask,
            cpuinfer_threads=cpuinfer_threads,
            threadpool_count=threadpool_count,
            weight_path=weight_path,
            chunked_prefill_size=chunked_prefill_size,
            method=method,
            max_deferred_experts_per_token=None if n == len(found) - 1 else deferred,
            **wrapper_kwargs,
        )
        wrapper.load_weights(torch.arange(e, dtype=torch.int64))
        keep = bool(mask.any()) if keep_torch_experts is None else keep_torch_experts
        module = KTExperts(wrapper, experts if keep else None, mask)
        setattr(block, attr, module)
        replaced.append(module)
    return replaced


def _check_mask(mask, layers: int, keep_torch_experts: bool | None) -> None:
    """``gpu_experts_mask`` as :func:`offload_experts` takes it: bools, ``[num_experts]`` or
    one row per MoE layer, and torch kept for the masked experts (else no one computes them)."""
    if not isinstance(mask, torch.Tensor) or mask.is_floating_point() or mask.is_complex():
        raise TypeError(
            f"gpu_experts_mask must be a bool tensor, got {getattr(mask, 'dtype', mask)}"
        )
    if mask.dim() not in (1, 2) or (mask.dim() == 2 and mask.shape[0] != layers):
        raise ValueError(
            f"gpu_experts_mask must be [num_experts] or [{layers}, num_experts] (one row per "
            f"MoE layer), got shape {tuple(mask.shape)}"
        )
    if keep_torch_experts is False and bool(mask.any()):
        raise ValueError(
            "gpu_experts_mask marks experts for torch but keep_torch_experts=False drops "
            "their weights: nothing would compute them"
        )


def _top_k(block: nn.Module, config) -> int:
    for owner, name in ((getattr(block, "gate", None), "top_k"), (block, "top_k")):
        k = getattr(owner, name, None)
        if isinstance(k, int):
            return k
    k = getattr(config, "num_experts_per_tok", None)
    if not isinstance(k, int):
        raise ValueError("cannot tell the number of experts per token (top_k) of this model")
    return k
