"""Methods FP8 (block-quantized E4M3 checkpoints, DeepSeek-V3 style) and FP8_PERCHANNEL (one
scale per output channel): the original's fixtures
reproduced, accuracy against a float64 model of the dequantized weights, quantization from
tensors equal to a file load of the same quantization, and bad checkpoints refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_wrapper
from safetensors import safe_open
from safetensors.torch import save_file

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
needs_fixtures = pytest.mark.skipif(not FIXTURES.is_dir(), reason="shared/fixtures not present")
BLOCK = 128


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def dequantize_checkpoint(path: Path, layer: int, experts: int):
    """gate/up/down as float64 `[E, N, K]` from an FP8 checkpoint (code · block scale, or code ·
    channel scale)."""
    out = {}
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
        for proj in ("gate", "up", "down"):
            mats = []
            for e in range(experts):
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj"
                q = f.get_tensor(f"{name}.weight").double()
                if f"{name}.weight_scale_inv" in keys:
                    s = f.get_tensor(f"{name}.weight_scale_inv").double()
                    s = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
                    mats.append(q * s[: q.shape[0], : q.shape[1]])
                else:
                    mats.append(q * f.get_tensor(f"{name}.weight_scale").double().reshape(-1, 1))
            out[proj] = torch.stack(mats)
    return out["gate"], out["up"], out["down"]


def moe_reference(x, ids, weights, gate, up, down):
    """float64 MoE: Σ_k w_k · down_e(silu(gate_e x) · up_e x)."""
    x = x.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].double().tolist(), strict=True):
            g, u = gate[e] @ x[t], up[e] @ x[t]
            out[t] += w * (down[e] @ (torch.nn.functional.silu(g) * u))
    return out


def quantize_fp8_channels(w: torch.Tensor):
    """`[N, K]` floats → E4M3 codes and `[N]` f32 scales (amax / 448 per row)."""
    amax = w.float().abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (w.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


def quantize_fp8_blocks(w: torch.Tensor):
    """`[N, K]` floats → E4M3 codes and `[N/128, K/128]` f32 scales (amax / 448 per block)."""
    n, k = w.shape
    blocks = w.float().reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).reshape(n, k).to(torch.float8_e4m3fn)
    return q, scale


def write_fp8_checkpoint(folder: Path, layer: int, gate, up, down, per_channel=False) -> None:
    tensors = {}
    for proj, mats in (("gate", gate), ("up", up), ("down", down)):
        for e in range(mats.shape[0]):
            name = f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj"
            if per_channel:
                q, s = quantize_fp8_channels(mats[e])
                tensors[f"{name}.weight_scale"] = s
            else:
                q, s = quantize_fp8_blocks(mats[e])
                tensors[f"{name}.weight_scale_inv"] = s
            tensors[f"{name}.weight"] = q
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))


@needs_fixtures
@pytest.mark.parametrize("fixture", ["native-more", "native"])
def test_fixture_checkpoints_reproduce_the_original_within_its_error(fixture):
    if fixture == "native":
        path, io_path = FIXTURES / "native" / "fp8" / "layer1.safetensors", "io-fp8-tp1"
    else:
        path, io_path = FIXTURES / "native-more" / "fp8" / "model.safetensors", "io-fp8"
    with safe_open(str(FIXTURES / fixture / f"{io_path}.safetensors"), "pt") as f:
        io = {k: f.get_tensor(k) for k in f.keys()}
    gate, up, down = dequantize_checkpoint(path, 1, 4)
    w = make_wrapper(
        layer_idx=1, e=4, k=2, h=128, i=256, chunk=16, weight_path=str(path.parent), method="FP8"
    )
    w.load_weights(torch.arange(4))
    assert w.moe.kernel.startswith("fp8-")
    sizes = (1, 7) if fixture == "native-more" else (1, 5, 16)
    for t in sizes:
        if fixture == "native-more":
            x, ids, wt, orig = (
                io[f"x.T{t}"],
                io[f"ids.T{t}"],
                io[f"weights.T{t}"],
                io[f"out.tp1.T{t}"],
            )
        else:
            x, ids, wt, orig = (
                io[f"T{t}.x"],
                io[f"T{t}.topk_ids"],
                io[f"T{t}.topk_weights"],
                io[f"T{t}.out"],
            )
        ref = moe_reference(x, ids, wt, gate, up, down)
        out = w.forward(x, ids, wt, None)
        ours, theirs = _rel(out, ref), _rel(orig, ref)
        # The original rounds gate, up, SwiGLU and down outputs to bf16; we keep fp32, so our
        # error against the dequantized weights is at most the original's.
        assert ours <= theirs * 1.05 + 1e-5, (t, ours, theirs)
        assert _rel(out, orig) < 1e-2, (t, _rel(out, orig))


def test_tensors_quantize_like_a_file_of_the_same_quantization(tmp_path):
    gen = torch.Generator().manual_seed(11)
    e, h, i = 6, 256, 384
    gate = (torch.randn(e, i, h, generator=gen) * 0.05).to(torch.bfloat16)
    up = (torch.randn(e, i, h, generator=gen) * 0.05).to(torch.bfloat16)
    down = (torch.randn(e, h, i, generator=gen) * 0.05).to(torch.bfloat16)
    gate[1, :128, :128] = 0  # an all-zero block
    write_fp8_checkpoint(tmp_path / "ckpt", 0, gate, up, down)
    online = make_wrapper(layer_idx=0, e=e, k=3, h=h, i=i, chunk=32, method="FP8")
    online.load_weights_from_tensors(gate, up, down, torch.arange(e))
    loaded = make_wrapper(
        layer_idx=0, e=e, k=3, h=h, i=i, chunk=32, method="FP8", weight_path=str(tmp_path / "ckpt")
    )
    loaded.load_weights(torch.arange(e))
    g64, u64, d64 = dequantize_checkpoint(tmp_path / "ckpt" / "model.safetensors", 0, e)
    for t in (1, 3, 20):
        x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(e, generator=gen)[:3] for _ in range(t)])
        wt = torch.rand(t, 3, generator=gen)
        a, b = online.forward(x, ids, wt, None), loaded.forward(x, ids, wt, None)
        assert torch.equal(a, b), t
        ref = moe_reference(x, ids, wt, g64, u64, d64)
        # fp32 arithmetic on the exact dequantized weights: only the bf16 output rounding.
        assert _rel(a, ref) < 4e-3, (t, _rel(a, ref))
        # Against the unquantized bf16 weights: FP8's own error (3 mantissa bits).
        assert _rel(a, moe_reference(x, ids, wt, gate.double(), up.double(), down.double())) < 0.1


def _copy_fixture(tmp_path: Path) -> Path:
    folder = tmp_path / "fp8"
    shutil.copytree(FIXTURES / "native-more" / "fp8", folder)
    return folder


def _rewrite(folder: Path, change) -> None:
    path = folder / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    path.chmod(0o644)
    save_file(tensors, str(path))


@needs_fixtures
def test_nan_codes_and_bad_scales_are_refused(tmp_path):
    name = "model.layers.1.mlp.experts.2.up_proj"

    def nan_code(t):
        q = t[f"{name}.weight"].view(torch.uint8).clone()
        q[5, 17] = 0x7F
        t[f"{name}.weight"] = q.view(torch.float8_e4m3fn)

    def inf_scale(t):
        t[f"{name}.weight_scale_inv"][0, 0] = float("inf")

    def missing_scale(t):
        del t[f"{name}.weight_scale_inv"]

    cases = [
        (nan_code, "NaN code"),
        (inf_scale, "weight_scale_inv"),
        (missing_scale, "weight_scale_inv"),
    ]
    for n, (change, message) in enumerate(cases):
        folder = _copy_fixture(tmp_path / str(n))
        _rewrite(folder, change)
        w = make_wrapper(layer_idx=1, e=4, k=2, h=128, i=256, method="FP8", weight_path=str(folder))
        with pytest.raises(ValueError, match=message):
            w.load_weights(torch.arange(4))


def test_shapes_that_do_not_split_into_128_blocks_are_refused():
    with pytest.raises(ValueError, match="multiples of 128"):
        make_wrapper(layer_idx=0, e=4, k=2, h=192, i=256, method="FP8")


def test_module_reports_the_fp8_kernel_and_layout():
    import kt_kernel

    w = make_wrapper(layer_idx=0, e=4, k=2, h=128, i=128, method="FP8")
    assert kt_kernel.__fp8_kernel__ == w.moe.kernel
    assert kt_kernel.__fp8_weight_layout__ == "block-e4m3-128x128"
    variant = kt_kernel.cpu_info()["variant"]
    want = {
        "generic": "fp8-scalar+",
        "avx2": "fp8-avx2+",
        "avx512_base": "fp8-avx512+",
        "avx512_vnni": "fp8-avx512+",
    }.get(variant, "fp8-avx512-vbmi+")
    assert kt_kernel.__fp8_kernel__.startswith(want), (variant, kt_kernel.__fp8_kernel__)


@pytest.mark.parametrize("kernel", ["scalar", "fma", "bf16dot", "amx-emulated"])
def test_every_panel_kernel_path_matches_the_dequantized_model(tmp_path, monkeypatch, kernel):
    import kt_kernel

    if kernel == "bf16dot" and kt_kernel.cpu_info()["variant"] not in ("avx512_bf16", "amx"):
        pytest.skip("no AVX512-BF16 at this CPU variant")
    monkeypatch.setenv("KT_BF16_KERNEL", kernel)
    gen = torch.Generator().manual_seed(5)
    e, h, i = 4, 256, 384
    gate = (torch.randn(e, i, h, generator=gen) * 0.05).to(torch.bfloat16)
    up = (torch.randn(e, i, h, generator=gen) * 0.05).to(torch.bfloat16)
    down = (torch.randn(e, h, i, generator=gen) * 0.05).to(torch.bfloat16)
    write_fp8_checkpoint(tmp_path, 0, gate, up, down)
    g64, u64, d64 = dequantize_checkpoint(tmp_path / "model.safetensors", 0, e)
    w = make_wrapper(
        layer_idx=0, e=e, k=2, h=h, i=i, chunk=64, method="FP8", weight_path=str(tmp_path)
    )
    w.load_weights(torch.arange(e))
    # Few rows per expert (the fp32 path) and ~32 per expert (the bf16/AMX paths).
    for t in (1, 64):
        x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(e, generator=gen)[:2] for _ in range(t)])
        wt = torch.rand(t, 2, generator=gen)
        err = _rel(w.forward(x, ids, wt, None), moe_reference(x, ids, wt, g64, u64, d64))
        # fp32 arithmetic: the bf16 output rounding; bf16 activations add about as much again.
        limit = 4e-3 if kernel in ("scalar", "fma") or t == 1 else 1e-2
        assert err < limit, (kernel, t, err, w.moe.kernel)


@needs_fixtures
def test_physical_to_logical_map_works_for_fp8():
    folder = str(FIXTURES / "native-more" / "fp8")
    plain = make_wrapper(layer_idx=1, e=4, k=2, h=128, i=256, method="FP8", weight_path=folder)
    plain.load_weights(torch.arange(4))
    mapping = torch.tensor([2, 0, 3, 1])
    mapped = make_wrapper(layer_idx=1, e=4, k=2, h=128, i=256, method="FP8", weight_path=folder)
    mapped.load_weights(mapping)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 128, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(5)])
    wt = torch.rand(5, 2, generator=gen)
    # Physical slot p holds logical expert mapping[p].
    assert torch.equal(mapped.forward(x, ids, wt, None), plain.forward(x, mapping[ids], wt, None))


@needs_fixtures
@pytest.mark.parametrize("method", ["FP8", "FP8_PERCHANNEL"])
@pytest.mark.parametrize("tp", [1, 2])
def test_native_more_fixtures_at_each_threadpool_count(method, tp):
    """`native-more/{fp8,fp8_perchannel}` at threadpool_count 1 and 2 (a fresh process each:
    the engine is per process), against the original's outputs for the same count."""
    folder = method.lower()
    code = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
import test_fp8 as t
from conftest import make_wrapper
from safetensors import safe_open
path = t.FIXTURES / "native-more" / {folder!r} / "model.safetensors"
with safe_open(str(t.FIXTURES / "native-more" / "io-{folder}.safetensors"), "pt") as f:
    io = {{k: f.get_tensor(k) for k in f.keys()}}
w = make_wrapper(layer_idx=1, e=4, k=2, h=128, i=256, chunk=16, threadpool_count={tp},
                 weight_path=str(path.parent), method={method!r})
w.load_weights(torch.arange(4))
assert w.cpu_infer.engine.parts == {tp}
g, u, d = t.dequantize_checkpoint(path, 1, 4)
for n in (1, 7):
    x, ids, wt = io[f"x.T{{n}}"], io[f"ids.T{{n}}"], io[f"weights.T{{n}}"]
    out, orig = w.forward(x, ids, wt, None), io[f"out.tp{tp}.T{{n}}"]
    ref = t.moe_reference(x, ids, wt, g, u, d)
    ours, theirs = t._rel(out, ref), t._rel(orig, ref)
    assert ours <= theirs * 1.05 + 1e-5, (ours, theirs)
    assert t._rel(out, orig) < 1e-2, t._rel(out, orig)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_per_channel_tensors_quantize_like_a_file_and_refuse_bad_scales(tmp_path):
    gen = torch.Generator().manual_seed(12)
    e, h, i = 4, 256, 256
    gate = (torch.randn(e, i, h, generator=gen) * 0.05).to(torch.bfloat16)
    up = (torch.randn(e, i, h, generator=gen) * 0.05).to(torch.bfloat16)
    down = (torch.randn(e, h, i, generator=gen) * 0.05).to(torch.bfloat16)
    write_fp8_checkpoint(tmp_path / "ckpt", 0, gate, up, down, per_channel=True)
    args = dict(layer_idx=0, e=e, k=2, h=h, i=i, chunk=64, method="FP8_PERCHANNEL")
    online = make_wrapper(**args)
    online.load_weights_from_tensors(gate, up, down, torch.arange(e))
    loaded = make_wrapper(**args, weight_path=str(tmp_path / "ckpt"))
    loaded.load_weights(torch.arange(e))
    g64, u64, d64 = dequantize_checkpoint(tmp_path / "ckpt" / "model.safetensors", 0, e)
    for t in (1, 64):
        x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(e, generator=gen)[:2] for _ in range(t)])
        wt = torch.rand(t, 2, generator=gen)
        a, b = online.forward(x, ids, wt, None), loaded.forward(x, ids, wt, None)
        assert torch.equal(a, b), t
        assert _rel(a, moe_reference(x, ids, wt, g64, u64, d64)) < 1e-2
    path = tmp_path / "ckpt" / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.layers.0.mlp.experts.1.down_proj.weight_scale"][3] = float("nan")
    save_file(tensors, str(path))
    bad = make_wrapper(**args, weight_path=str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="weight_scale"):
        bad.load_weights(torch.arange(e))


@pytest.mark.parametrize("mode", ["exact", "zero"])
def test_subnormal_codes_are_exact_or_zero_as_the_environment_says(tmp_path, mode):
    """One token takes the fused decode kernels, which value subnormal E4M3 codes exactly or as
    zero (`KT_KERNEL_FP8_SUBNORMALS`; zero by default on Intel, where each would cost a
    microcode assist). Weights of one large value per 128 × 128 block and the rest below 2⁻⁶
    of its scale make nearly every code subnormal, so the two models differ completely."""
    gen = torch.Generator().manual_seed(12)
    e, h, i = 2, 256, 256
    mats = []
    for n, k in ((i, h), (i, h), (h, i)):
        w = torch.randn(e, n, k, generator=gen) * 1e-5
        for r in range(0, n, BLOCK):
            for c in range(0, k, BLOCK):
                w[:, r + int(torch.randint(BLOCK, (1,), generator=gen)), c] = 1.0
        mats.append(w)
    write_fp8_checkpoint(tmp_path, 0, *mats)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        codes = f.get_tensor("model.layers.0.mlp.experts.0.gate_proj.weight")
    subnormal = (codes.view(torch.uint8) & 0x78 == 0) & (codes.view(torch.uint8) & 0x07 != 0)
    assert subnormal.double().mean() > 0.5
    code = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
import kt_kernel
import test_fp8 as t
from conftest import make_wrapper
w = make_wrapper(layer_idx=0, e={e}, k=2, h={h}, i={i}, chunk=16, method="FP8",
                 weight_path={str(tmp_path)!r})
w.load_weights(torch.arange({e}))
g, u, d = t.dequantize_checkpoint(t.Path({str(tmp_path / "model.safetensors")!r}), 0, {e})
flushed = [m.masked_fill(m.abs() < 2.0**-6 / 448, 0.0) for m in (g, u, d)]
gen = torch.Generator().manual_seed(1)
x = torch.randn(1, {h}, generator=gen).to(torch.bfloat16)
ids, wt = torch.tensor([[0, 1]]), torch.tensor([[0.6, 0.4]])
out = w.forward(x, ids, wt, None)
exact, zero = t.moe_reference(x, ids, wt, g, u, d), t.moe_reference(x, ids, wt, *flushed)
# CPUs without AVX2 have no fused kernels: their bf16 decode is exact either way.
flushes = {mode!r} == "zero" and kt_kernel.cpu_info()["variant"] != "generic"
want, other = (zero, exact) if flushes else (exact, zero)
assert t._rel(want, other) > 0.5, t._rel(want, other)
assert t._rel(out, want) < 4e-3, (t._rel(out, want), t._rel(out, other))
print("ok")
"""
    env = {**os.environ, "KT_KERNEL_FP8_SUBNORMALS": mode}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
