"""Native checkpoints for tests and benchmarks, written by an independent torch quantizer:
the recipes of kt-core's `codes::quantize_group` (and the usual FP8 block/channel recipes),
reimplemented here so a file load and an online quantization can be compared, and so the
original kt-kernel can be benchmarked on the same native files. Also the float64 dequantizers
the tests' references use.

Layouts (tensor names and dtypes) are those of the checkpoints each method of the original
reads: see `shared/fixtures/native-more/README.md`."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

BLOCK = 128
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_ALL = torch.cat([E2M1, -E2M1])
# Group size each method quantizes with (and its fixture uses).
GROUP = {"RAWINT4": 32, "GPTQ_INT4": 128, "MXFP4": 32, "NVFP4": 16, "MXFP8": 32}


def prefix(method: str, layer: int, e: int, proj: str) -> str:
    """The tensor prefix of one expert matrix, as each method's checkpoints name it."""
    short = {"gate": "w1", "up": "w3", "down": "w2"}[proj]
    if method == "MXFP4":
        return f"layers.{layer}.ffn.experts.{e}.{short}"
    if method == "MXFP8":
        return f"model.layers.{layer}.block_sparse_moe.experts.{e}.{short}"
    return f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj"


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """`[N, K/2]` bytes → `[N, K]` nibbles, low nibble first (even input)."""
    b = packed.view(torch.uint8).long()
    return torch.stack([b & 15, b >> 4], dim=-1).reshape(b.shape[0], -1)


def e8m0(u: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, u.view(torch.uint8).double() - 127)


def dequantize(method: str, t: dict, p: str) -> torch.Tensor:
    """One expert matrix `[N, K]` in float64."""
    if method == "FP8":
        q, s = t[f"{p}.weight"].double(), t[f"{p}.weight_scale_inv"].double()
        return q * s.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
    if method == "FP8_PERCHANNEL":
        return t[f"{p}.weight"].double() * t[f"{p}.weight_scale"].double().view(-1, 1)
    if method == "RAWINT4":
        q = nibbles(t[f"{p}.weight_packed"]).double() - 8
        s = t[f"{p}.weight_scale"].double()
    elif method == "GPTQ_INT4":
        qw = t[f"{p}.qweight"].long() & 0xFFFFFFFF  # [K/8, N]
        q = torch.stack([(qw >> (4 * j)) & 15 for j in range(8)], dim=1)  # [K/8, 8, N]
        q = q.reshape(-1, qw.shape[1]).T.double() - 8
        s = t[f"{p}.scales"].double().T
    elif method == "MXFP4":
        q = E2M1_ALL.double()[nibbles(t[f"{p}.weight"])]
        s = e8m0(t[f"{p}.scale"])
    elif method == "NVFP4":
        q = E2M1_ALL.double()[nibbles(t[f"{p}.weight"])]
        s = t[f"{p}.weight_scale"].double() * t[f"{p}.weight_scale_2"].double()
    else:
        q = t[f"{p}.weight"].double()
        s = e8m0(t[f"{p}.weight_scale_inv"])
    return q * s.repeat_interleave(q.shape[1] // s.shape[1], dim=1)


# --- An independent quantizer: the recipes of kt-core's `codes::quantize_group`, in torch. ---


def ceil_pow2_exponent(s: torch.Tensor) -> torch.Tensor:
    """⌈log2 s⌉ exactly (s > 0)."""
    m, e = torch.frexp(s)
    return torch.where(m == 0.5, e - 1, e)


def encode_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (ties to the even code), sign bit 3."""
    a = v.abs().clamp(max=6.0)
    d = (a[..., None] - E2M1).abs()
    tie = d == d.min(dim=-1, keepdim=True).values
    codes = torch.arange(8)
    best = torch.where(tie, (codes % 2) * 100 + codes, 999).argmin(dim=-1)
    return torch.where((v < 0) & (best != 0), best | 8, best)


def quantize(method: str, w: torch.Tensor) -> dict:
    """`[N, K]` bf16 weights → the tensors of one expert matrix (suffix → tensor)."""
    g = GROUP[method]
    n, k = w.shape
    v = w.float().reshape(n, k // g, g)
    amax = v.abs().amax(dim=-1)
    if method in ("RAWINT4", "GPTQ_INT4"):
        dt = torch.bfloat16 if method == "RAWINT4" else torch.float16
        s = torch.where(amax > 0, amax / 1.0 / 7.0, torch.ones_like(amax)).to(dt)
        q = (v / s.float()[..., None]).round().clamp(-8, 7).long() + 8
        q = q.reshape(n, k)
        if method == "RAWINT4":
            packed = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
            return {
                "weight_packed": packed,
                "weight_scale": s,
                "weight_shape": torch.tensor([n, k], dtype=torch.int32),
            }
        words = torch.zeros(k // 8, n, dtype=torch.int64)
        for j in range(8):
            words |= q[:, j::8].T << (4 * j)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        return {"qweight": words, "scales": s.T.contiguous()}
    if method == "NVFP4":
        tensor_amax = w.float().abs().max()
        glob = tensor_amax / (6.0 * 448.0)
        wanted = torch.where(amax > 0, amax / glob / 6.0, torch.ones_like(amax))
        s8 = wanted.to(torch.float8_e4m3fn)
        scale = s8.float() * glob
        x = torch.where(scale[..., None] > 0, v / scale[..., None], torch.zeros_like(v))
        q = encode_e2m1(x).reshape(n, k)
        return {
            "weight": (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8),
            "weight_scale": s8,
            "weight_scale_2": glob.reshape(1),
        }
    kmax = 6.0 if method == "MXFP4" else 448.0
    e = torch.where(amax > 0, ceil_pow2_exponent(amax / kmax), torch.zeros_like(amax).long())
    e = e.clamp(-126, 127)
    x = v / torch.pow(2.0, e.float())[..., None]
    u8 = (e + 127).to(torch.uint8)
    if method == "MXFP4":
        q = encode_e2m1(x).reshape(n, k)
        return {"weight": (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.int8), "scale": u8}
    return {"weight": x.reshape(n, k).to(torch.float8_e4m3fn), "weight_scale_inv": u8}


def quantize_fp8(w: torch.Tensor, per_channel: bool) -> dict:
    """`[N, K]` floats → FP8 codes with 128 × 128 block scales (amax / 448) or one per row."""
    n, k = w.shape
    if per_channel:
        amax = w.float().abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        return {
            "weight": (w.float() / scale[:, None]).to(torch.float8_e4m3fn),
            "weight_scale": scale,
        }
    blocks = w.float().reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).reshape(n, k).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}


def matrix_tensors(method: str, w: torch.Tensor) -> dict:
    """The tensors (suffix → tensor) of one expert matrix in `method`'s checkpoint format."""
    if method in ("FP8", "FP8_PERCHANNEL"):
        return quantize_fp8(w, method == "FP8_PERCHANNEL")
    return quantize(method, w)


def layer_tensors(method: str, layer: int, gate, up, down) -> dict:
    """Every tensor of one layer's experts (`[E, N, K]` stacks) in `method`'s format."""
    tensors = {}
    for proj, mats in (("gate", gate), ("up", up), ("down", down)):
        for e in range(mats.shape[0]):
            p = prefix(method, layer, e, proj)
            for suffix, t in matrix_tensors(method, mats[e]).items():
                tensors[f"{p}.{suffix}"] = t
    return tensors


GPTQ_CONFIG = (
    '{"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, '
    '"sym": true, "desc_act": false}}'
)


def write_checkpoint(method: str, folder: Path, layer: int, gate, up, down) -> None:
    """One layer's experts as `folder/model.safetensors` (+ GPTQ's config.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(layer_tensors(method, layer, gate, up, down), str(folder / "model.safetensors"))
    if method == "GPTQ_INT4":
        (folder / "config.json").write_text(GPTQ_CONFIG)
