"""A torch dequantize-then-matmul MoE behind `KTMoEWrapper`'s interface.

Issue 19 measures prefill against "a torch dequantize-then-matmul loop in the same run" where
the original kt-kernel cannot run a method on the machine (its FP8_PERCHANNEL needs AVX-512
BF16 and VBMI; its AVX2 build has no NVFP4, AMXINT8 or AMXINT4). `compare_original.py
--torch-dequant` loads this module in place of `kt_kernel`, so the baseline reads the same
native checkpoint files, sees the same inputs and is timed by the same loop.

What a user without kt-kernel would write: the native tensors stay in memory as the checkpoint
stores them (a dequantized copy of a DeepSeek-size model does not fit), and every call
dequantizes each activated expert's three matrices, then runs `kt_kernel.bench.torch_moe` (the
layer benchmark's plain-torch loop). `KT_TORCH_DEQUANT_DTYPE=float32` dequantizes to float32
and multiplies in float32 (faster than bf16 where the CPU has no bf16 dot product); the default
is bf16.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import native_checkpoints  # noqa: E402
from kt_kernel.bench import torch_moe  # noqa: E402

__version__ = f"torch {torch.__version__}"
METHODS = ("BF16", "FP8", "FP8_PERCHANNEL", "RAWINT4", "GPTQ_INT4", "MXFP4", "NVFP4", "MXFP8")


def _pair_table(values: torch.Tensor) -> torch.Tensor:
    """`[256, 2]`: the values of a byte's low and high nibble (low nibble = even input)."""
    b = torch.arange(256)
    return torch.stack([values[b & 15], values[b >> 4]], dim=1)


INT4_PAIRS = _pair_table(torch.arange(16, dtype=torch.float32) - 8)
E2M1_PAIRS = _pair_table(native_checkpoints.E2M1_ALL.float())
# Every E4M3 code's value (a table lookup is 2.5x faster than torch's float8 conversion here).
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _lookup(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`table[code]` for every byte of `codes`, shaped `[codes.shape[0], -1]`."""
    flat = codes.contiguous().view(torch.uint8).reshape(-1).int()
    return table.index_select(0, flat).reshape(codes.shape[0], -1)


def _nibble_values(packed: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """`[N, K/2]` packed bytes → `[N, K]` float32 values."""
    return _lookup(packed, pairs)


def _grouped(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`q [N, K]` times one scale per group of `K / scale.shape[1]` inputs."""
    n, k = q.shape
    return (q.view(n, scale.shape[1], -1) * scale.float()[..., None]).view(n, k)


def dequantize(method: str, t: dict, p: str) -> torch.Tensor:
    """One expert matrix `[N, K]` in float32, from the tensors of `method`'s checkpoint."""
    if method == "BF16":
        return t[f"{p}.weight"].float()
    if method == "FP8":
        q, s = _lookup(t[f"{p}.weight"], E4M3_VALUES), t[f"{p}.weight_scale_inv"].float()
        n, k = q.shape
        blk = native_checkpoints.BLOCK
        return (q.view(n // blk, blk, k // blk, blk) * s[:, None, :, None]).view(n, k)
    if method == "FP8_PERCHANNEL":
        scale = t[f"{p}.weight_scale"].float().view(-1, 1)
        return _lookup(t[f"{p}.weight"], E4M3_VALUES) * scale
    if method == "MXFP8":
        q = _lookup(t[f"{p}.weight"], E4M3_VALUES)
        return _grouped(q, native_checkpoints.e8m0(t[f"{p}.weight_scale_inv"]))
    if method == "RAWINT4":
        return _grouped(_nibble_values(t[f"{p}.weight_packed"], INT4_PAIRS), t[f"{p}.weight_scale"])
    if method == "GPTQ_INT4":
        # [K/8, N] int32 words; input 8i+j sits in bits 4j..4j+3 of word (i, n), so byte b
        # of a word holds inputs 8i+2b (low nibble) and 8i+2b+1.
        qw = t[f"{p}.qweight"]
        words, n = qw.shape
        q = _lookup(qw, INT4_PAIRS).view(words, n, 8).permute(1, 0, 2).reshape(n, words * 8)
        return _grouped(q, t[f"{p}.scales"].T)
    if method == "MXFP4":
        q = _nibble_values(t[f"{p}.weight"], E2M1_PAIRS)
        return _grouped(q, native_checkpoints.e8m0(t[f"{p}.scale"]))
    if method == "NVFP4":
        scale = t[f"{p}.weight_scale"].float() * t[f"{p}.weight_scale_2"].float()
        return _grouped(_nibble_values(t[f"{p}.weight"], E2M1_PAIRS), scale)
    raise NotImplementedError(f"no torch dequantizer for method {method}")


class _Experts:
    """`experts[e]`: one projection of expert `e`, dequantized when indexed."""

    def __init__(self, method: str, tensors: dict, layer: int, proj: str, dtype: torch.dtype):
        self.method, self.tensors, self.dtype = method, tensors, dtype
        self.layer, self.proj = layer, proj

    def __getitem__(self, e: int) -> torch.Tensor:
        # BF16 checkpoints use the default prefix (`...mlp.experts.{e}.{proj}_proj`).
        p = native_checkpoints.prefix(self.method, self.layer, e, self.proj)
        return dequantize(self.method, self.tensors, p).to(self.dtype)


class KTMoEWrapper:
    """The subset of `kt_kernel.KTMoEWrapper` that `compare_original.py` calls."""

    def __init__(self, layer_idx, num_experts, num_experts_per_tok, hidden_size,
                 moe_intermediate_size, gpu_experts_mask, cpuinfer_threads, threadpool_count,
                 weight_path, chunked_prefill_size, method="BF16", **_):  # fmt: skip
        if method not in METHODS:
            raise NotImplementedError(f"the torch baseline has no method {method}")
        self.layer, self.method, self.path = layer_idx, method, Path(weight_path)
        name = os.environ.get("KT_TORCH_DEQUANT_DTYPE", "bf16")
        self.dtype = {"bf16": torch.bfloat16, "float32": torch.float32}[name]
        self.experts = None

    def load_weights(self, physical_to_logical_map=None):
        tensors = load_file(str(self.path / f"layer-{self.layer:05d}.safetensors"))
        self.experts = [
            _Experts(self.method, tensors, self.layer, proj, self.dtype)
            for proj in ("gate", "up", "down")
        ]

    def forward(self, hidden_states, topk_ids, topk_weights, cuda_stream=None):
        x = hidden_states.to(self.dtype)
        out = torch_moe(x, topk_ids.long(), topk_weights.float(), *self.experts)
        return out.to(hidden_states.dtype)
