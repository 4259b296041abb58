"""The original's per-format checkpoint readers (``kt_kernel.utils.loader.FP8SafeTensorLoader``
...): ``load_experts(base_key)`` returns one tensor per expert and projection, in the layout the
low-level classes take by address (``MOEConfig.gate_projs``/``gate_scales``; see
``kt_core::expert_pointers``)::

    {"gate": [w_0, w_1, ...], "up": [...], "down": [...],
     "gate_scale": [s_0, ...], "up_scale": [...], "down_scale": [...]}   # no scales for BF16

=================  ===========================================  ===============================
loader             weight (per expert, ``[out, in]`` unless      scale
                   noted)
=================  ===========================================  ===============================
BF16               bf16 (fused ``gate_up_proj`` split)           --
FP8                float8_e4m3fn                                 f32 ``[out/128, in/128]``
                                                                 (block) or ``[out]`` (channel)
Compressed         uint8 ``[out, in/2]`` (RAWINT4)                bf16 ``[out, in/group]``
GPTQ               int32 ``qweight`` ``[in/8, out]``               f32 ``[in/group, out]``
MXFP4              uint8 ``[out, in/2]``                          bf16 (E8M0 widened)
NVFP4              uint8 ``[out, in/2]``                          bf16 (E4M3 x per-tensor scale)
MXFP8              uint8 ``[out, in]`` (E4M3 bytes)               uint8 E8M0 ``[out, in/32]``
=================  ===========================================  ===============================

Experts are found under ``{base}.mlp.experts``, ``{base}.block_sparse_moe.experts`` or
``{base}.ffn.experts`` (``base`` with or without its ``model.`` prefix), projections named
``gate_proj``/``up_proj``/``down_proj`` or ``w1``/``w3``/``w2``. The wrappers do not use these
(the native layer reads checkpoints itself).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .loader import SafeTensorLoader

_PROJ_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_KEYS = ("gate", "up", "down")


class _NativeLoader(SafeTensorLoader):
    """Shared lookup: where a layer's experts are and how each expert tensor is read."""

    #: The tensor holding an expert's codes (``weight``, ``weight_packed``, ``qweight``).
    WEIGHT = "weight"

    def __init__(self, file_path: str) -> None:
        super().__init__(file_path)
        self.file_path = file_path

    def _experts(self, base_key: str) -> tuple[str, tuple[str, str, str], int]:
        """(prefix, projection names, expert count) of ``base_key``'s experts."""
        bases = [base_key]
        if base_key.startswith("model."):
            bases.append(base_key[len("model.") :])
        tried = []
        for base in bases:
            for block in ("mlp.experts", "block_sparse_moe.experts", "ffn.experts"):
                prefix = f"{base}.{block}"
                for names in _PROJ_NAMES:
                    tried.append(f"{prefix}.0.{names[0]}.{self.WEIGHT}")
                    count = 0
                    while self.has_tensor(f"{prefix}.{count}.{names[0]}.{self.WEIGHT}"):
                        count += 1
                    if count:
                        return prefix, names, count
        raise ValueError(f"No experts found for {base_key} (looked for {', '.join(tried)})")

    def _expert(self, key: str, device: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One expert projection's (weight, scale) from the tensors under ``key``."""
        raise NotImplementedError

    def load_experts(self, base_key: str, device: str = "cpu") -> dict[str, list]:
        prefix, names, count = self._experts(base_key)
        out: dict[str, list] = {k: [] for k in (*_KEYS, *(f"{k}_scale" for k in _KEYS))}
        for e in range(count):
            for k, name in zip(_KEYS, names, strict=True):
                w, s = self._expert(f"{prefix}.{e}.{name}", device)
                out[k].append(w.contiguous())
                out[f"{k}_scale"].append(None if s is None else s.contiguous())
        if out["gate_scale"][0] is None:
            for k in _KEYS:
                del out[f"{k}_scale"]
        return out


class BF16SafeTensorLoader(_NativeLoader):
    """bf16/fp16/fp32 experts (as bf16); a fused ``experts.gate_up_proj`` ``[E, 2I, H]`` with
    ``experts.down_proj`` ``[E, H, I]`` is split per expert."""

    def _expert(self, key, device):
        return self.load_tensor(f"{key}.weight", device).to(torch.bfloat16), None

    def load_experts(self, base_key: str, device: str = "cpu") -> dict[str, list]:
        fused = f"{base_key}.mlp.experts.gate_up_proj"
        if not self.has_tensor(fused):
            return super().load_experts(base_key, device)
        gate_up = self.load_tensor(fused, device).to(torch.bfloat16)
        down = self.load_tensor(f"{base_key}.mlp.experts.down_proj", device).to(torch.bfloat16)
        mid = gate_up.shape[1] // 2
        return {
            "gate": [gate_up[e, :mid].contiguous() for e in range(gate_up.shape[0])],
            "up": [gate_up[e, mid:].contiguous() for e in range(gate_up.shape[0])],
            "down": [down[e].contiguous() for e in range(down.shape[0])],
        }


class FP8SafeTensorLoader(_NativeLoader):
    """E4M3 experts with ``weight_scale_inv`` (128 x 128 blocks) or ``weight_scale`` (one per
    output channel) f32 scales; ``scale_suffix`` forces one of the two names."""

    def __init__(self, file_path: str, scale_suffix: str | None = None) -> None:
        super().__init__(file_path)
        self.scale_suffix = scale_suffix

    def _expert(self, key, device):
        w = self.load_tensor(f"{key}.weight", device)
        suffixes = ["weight_scale_inv", "weight_scale"]
        if self.scale_suffix:
            suffixes = [self.scale_suffix]
        for suffix in suffixes:
            if self.has_tensor(f"{key}.{suffix}"):
                s = self.load_tensor(f"{key}.{suffix}", device).float()
                if s.dim() == 2 and s.shape[1] == 1:  # per-channel [N, 1]
                    s = s.reshape(-1)
                return w, s
        raise ValueError(f"{key}: no FP8 scale tensor ({' or '.join(suffixes)})")


class CompressedSafeTensorLoader(_NativeLoader):
    """compressed-tensors int4 (RAWINT4, Kimi-K2): ``weight_packed`` as bytes ``[N, K/2]``,
    ``weight_scale`` bf16 ``[N, K/group]``; ``weight_shape`` is checked when present."""

    WEIGHT = "weight_packed"

    def _expert(self, key, device):
        w = self.load_tensor(f"{key}.weight_packed", device).contiguous()
        if w.dtype == torch.int32:
            w = w.view(torch.uint8)
        s = self.load_tensor(f"{key}.weight_scale", device)
        if s.dtype != torch.bfloat16:
            raise ValueError(f"{key}.weight_scale is {s.dtype}; RAWINT4 scales are bf16")
        rows, cols = w.shape[0], w.shape[1] * 2
        if self.has_tensor(f"{key}.weight_shape"):
            shape = [int(v) for v in self.load_tensor(f"{key}.weight_shape").tolist()]
            if shape != [rows, cols]:
                raise ValueError(f"{key}.weight_shape {shape} but the codes hold [{rows}, {cols}]")
        if s.dim() != 2 or s.shape[0] != rows or cols % s.shape[1]:
            raise ValueError(f"{key}.weight_scale {tuple(s.shape)} does not fit [{rows}, {cols}]")
        return w, s


class GPTQSafeTensorLoader(FP8SafeTensorLoader):
    """Symmetric GPTQ int4 (``desc_act`` false): ``qweight`` int32 ``[K/8, N]``, ``scales``
    as f32 ``[K/group, N]``. Refused: a ``config.json`` with ``desc_act`` true, ``sym`` false
    or other than 4 bits (also given as strings), zero points other than the symmetric 8
    (``qzeros`` of 7s or 8s) and a ``g_idx`` other than ``i // group``."""

    WEIGHT = "qweight"

    def __init__(self, file_path: str) -> None:
        super().__init__(file_path, scale_suffix="scales")
        for folder in (Path(file_path), Path(file_path).parent):
            config = folder / "config.json"
            if config.is_file():
                q = json.loads(config.read_text()).get("quantization_config", {})
                if _flag(q.get("desc_act", False)):
                    raise NotImplementedError(
                        "GPTQ desc_act=true is not supported; re-quantize with desc_act=false"
                    )
                if not _flag(q.get("sym", True)):
                    raise NotImplementedError("asymmetric GPTQ (sym=false) is not supported")
                if str(q.get("bits", 4)).strip() != "4":
                    raise NotImplementedError(f"GPTQ with {q['bits']} bits; GPTQ_INT4 reads 4")
                break

    def _expert(self, key, device):
        qweight = self.load_tensor(f"{key}.qweight", device)
        scales = self.load_tensor(f"{key}.scales", device).float()
        if self.has_tensor(f"{key}.qzeros"):
            z = self.load_tensor(f"{key}.qzeros", "cpu").view(torch.uint8)
            if not (bool((z == 0x77).all()) or bool((z == 0x88).all())):
                raise NotImplementedError(
                    f"{key}.qzeros: zero points other than the symmetric 8 (asymmetric GPTQ) "
                    "are not supported"
                )
        if self.has_tensor(f"{key}.g_idx"):
            g_idx = self.load_tensor(f"{key}.g_idx", "cpu").long()
            k, group = qweight.shape[0] * 8, qweight.shape[0] * 8 // scales.shape[0]
            if g_idx.shape != (k,) or not bool((g_idx == torch.arange(k) // group).all()):
                raise NotImplementedError(
                    f"{key}.g_idx is not i // {group}: activation-order groups (desc_act) are "
                    "not supported"
                )
        return qweight, scales


def _flag(v) -> bool:
    """A config flag as JSON or as a string ("false" is False)."""
    return v.strip().lower() == "true" if isinstance(v, str) else bool(v)


def _e8m0_to_bf16(u8: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes as bf16 powers of two (the exponent field is the byte itself)."""
    return (u8.view(torch.uint8).to(torch.int32) << 7).to(torch.int16).view(torch.bfloat16)


class MXFP4SafeTensorLoader(_NativeLoader):
    """MXFP4 (E2M1 nibbles ``[N, K/2]``, E8M0 ``scale`` or ``weight_scale`` ``[N, K/32]``),
    scales widened to bf16 (exact: they are powers of two)."""

    def _expert(self, key, device):
        w = self.load_tensor(f"{key}.weight", device).view(torch.uint8)
        for name in ("scale", "weight_scale"):
            if self.has_tensor(f"{key}.{name}"):
                return w, _e8m0_to_bf16(self.load_tensor(f"{key}.{name}", device))
        raise ValueError(f"{key}: no MXFP4 scale tensor (scale or weight_scale)")


class NVFP4SafeTensorLoader(_NativeLoader):
    """NVFP4 (E2M1 nibbles, E4M3 ``weight_scale`` ``[N, K/16]``, f32 ``weight_scale_2``), the
    two scales folded into one bf16 per group (the original's loader does the same)."""

    def _expert(self, key, device):
        w = self.load_tensor(f"{key}.weight", device).view(torch.uint8)
        block = self.load_tensor(f"{key}.weight_scale", device).float()
        glob = self.load_tensor(f"{key}.weight_scale_2", device).float().reshape(())
        return w, (block * glob).to(torch.bfloat16)


class MXFP8SafeTensorLoader(_NativeLoader):
    """MXFP8 (E4M3 bytes ``[N, K]``, E8M0 ``weight_scale_inv`` or ``scale`` ``[N, K/32]``)."""

    def _expert(self, key, device):
        w = self.load_tensor(f"{key}.weight", device).view(torch.uint8)
        for name in ("weight_scale_inv", "weight_scale", "scale"):
            if self.has_tensor(f"{key}.{name}"):
                return w, self.load_tensor(f"{key}.{name}", device).view(torch.uint8)
        raise ValueError(f"{key}: no MXFP8 scale tensor")
