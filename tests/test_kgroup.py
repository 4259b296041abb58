"""The group-scaled native methods: RAWINT4 (Kimi-K2), GPTQ_INT4, MXFP4 (DeepSeek-V4-Flash),
NVFP4 and MXFP8 (MiniMax-M3). The original's fixtures reproduced at both threadpool counts,
accuracy against a float64 model of the dequantized weights on every kernel path, tensors
quantized online equal to a file of the same quantization (written here by an independent
torch quantizer), and bad checkpoints refused with the tensor's name."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_wrapper
from native_checkpoints import dequantize, prefix, write_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "native-more"
needs_fixtures = pytest.mark.skipif(not FIXTURES.is_dir(), reason="shared/fixtures not present")
METHODS = ["RAWINT4", "GPTQ_INT4", "MXFP4", "NVFP4", "MXFP8"]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def load_tensors(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def dequantize_checkpoint(method: str, path: Path, layer: int, experts: int):
    t = load_tensors(path)
    return tuple(
        torch.stack([dequantize(method, t, prefix(method, layer, e, proj)) for e in range(experts)])
        for proj in ("gate", "up", "down")
    )


def moe_reference(x, ids, weights, gate, up, down):
    """float64 MoE: Σ_k w_k · down_e(silu(gate_e x) · up_e x)."""
    x = x.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].double().tolist(), strict=True):
            g, u = gate[e] @ x[t], up[e] @ x[t]
            out[t] += w * (down[e] @ (torch.nn.functional.silu(g) * u))
    return out


def random_experts(e, h, i, seed):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)
        for shape in ((e, i, h), (e, i, h), (e, h, i))
    ]


def random_batch(t, h, e, k, gen):
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    return x, ids, torch.rand(t, k, generator=gen)


def batch_budget(method, budget):
    """Error budget of a batch that runs the many-row integer kernels: `budget` with their
    15-bit activations; RAWINT4's are 8-bit (as the original's RAWINT4, whose own error on its
    fixture is 1.2e-2), so 1.5e-2."""
    return max(budget, 1.5e-2) if method == "RAWINT4" else budget


# --- Tests. ---


@needs_fixtures
@pytest.mark.parametrize("tp", [1, 2])
def test_fixtures_reproduce_the_original_within_its_error(tp):
    """`native-more/<method>` of every method at threadpool_count 1 and 2 (a fresh process per
    count: the engine is per process), against the original's outputs for the same count."""
    code = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
import test_kgroup as t
from conftest import make_wrapper
for method in t.METHODS:
    folder = method.lower()
    path = t.FIXTURES / folder / "model.safetensors"
    io = t.load_tensors(t.FIXTURES / f"io-{{folder}}.safetensors")
    g, u, d = t.dequantize_checkpoint(method, path, 1, 4)
    w = make_wrapper(layer_idx=1, e=4, k=2, h=128, i=256, chunk=16, threadpool_count={tp},
                     weight_path=str(path.parent), method=method)
    w.load_weights(torch.arange(4))
    assert w.cpu_infer.engine.parts == {tp}
    assert w.moe.kernel.startswith("kgroup-"), w.moe.kernel
    for n in (1, 7):
        x, ids, wt = io[f"x.T{{n}}"], io[f"ids.T{{n}}"], io[f"weights.T{{n}}"]
        out, orig = w.forward(x, ids, wt, None), io[f"out.tp{tp}.T{{n}}"]
        ref = t.moe_reference(x, ids, wt, g, u, d)
        ours, theirs = t._rel(out, ref), t._rel(orig, ref)
        print(method, n, ours, theirs)
        assert ours <= theirs * 1.05 + 1e-5, (method, n, ours, theirs)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    print(r.stdout)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr + r.stdout


@pytest.mark.parametrize("method", METHODS)
def test_tensors_quantize_like_a_file_of_the_same_quantization(tmp_path, method):
    e, h, i = 4, 256, 384
    gate, up, down = random_experts(e, h, i, seed=hash(method) % 1000)
    gate[1, :32, :128] = 0  # all-zero groups
    write_checkpoint(method, tmp_path / "ckpt", 0, gate, up, down)
    args = dict(layer_idx=0, e=e, k=2, h=h, i=i, chunk=64, method=method)
    online = make_wrapper(**args)
    online.load_weights_from_tensors(gate, up, down, torch.arange(e))
    loaded = make_wrapper(**args, weight_path=str(tmp_path / "ckpt"))
    loaded.load_weights(torch.arange(e))
    g64, u64, d64 = dequantize_checkpoint(method, tmp_path / "ckpt" / "model.safetensors", 0, e)
    gen = torch.Generator().manual_seed(1)
    for t in (1, 3, 40):
        x, ids, wt = random_batch(t, h, e, 2, gen)
        a, b = online.forward(x, ids, wt, None), loaded.forward(x, ids, wt, None)
        assert torch.equal(a, b), (method, t)
        ref = moe_reference(x, ids, wt, g64, u64, d64)
        budget = batch_budget(method, 4e-3) if t == 40 else 4e-3
        assert _rel(a, ref) < budget, (method, t, _rel(a, ref))


@pytest.mark.parametrize("kernel", ["scalar", "fma", "bf16dot", "amx-emulated"])
@pytest.mark.parametrize("method", METHODS)
def test_every_panel_kernel_path_matches_the_dequantized_model(
    tmp_path, monkeypatch, method, kernel
):
    import kt_kernel

    if kernel == "bf16dot" and kt_kernel.cpu_info()["variant"] not in ("avx512_bf16", "amx"):
        pytest.skip("no AVX512-BF16 at this CPU variant")
    monkeypatch.setenv("KT_BF16_KERNEL", kernel)
    e, h, i = 4, 256, 256
    gate, up, down = random_experts(e, h, i, seed=7)
    write_checkpoint(method, tmp_path, 0, gate, up, down)
    g64, u64, d64 = dequantize_checkpoint(method, tmp_path / "model.safetensors", 0, e)
    w = make_wrapper(
        layer_idx=0, e=e, k=2, h=h, i=i, chunk=64, method=method, weight_path=str(tmp_path)
    )
    w.load_weights(torch.arange(e))
    gen = torch.Generator().manual_seed(2)
    # One row per expert (the fused kernels), a few (fp32 on decoded panels; MXFP8 on AVX2: the
    # many-row power-of-two kernel, as for ~10), ~32 (bf16/AMX).
    for t in (1, 5, 20, 64):
        x, ids, wt = random_batch(t, h, e, 2, gen)
        err = _rel(w.forward(x, ids, wt, None), moe_reference(x, ids, wt, g64, u64, d64))
        limit = 4e-3 if t == 1 else batch_budget(method, 1e-2)
        assert err < limit, (method, kernel, t, err, w.moe.kernel)


def test_cpu_info_names_the_decode_and_prefill_kernels():
    import kt_kernel

    info = kt_kernel.cpu_info()
    # Below AVX512-VNNI the AVX2-level kernels multiply with AVX-VNNI where the CPU has it.
    avx2_level = "avx-vnni" if info["flags"]["avx_vnni"] else "avx2"
    below_vnni = {"generic": None, "avx2": avx2_level, "avx512_base": avx2_level}
    isa = below_vnni.get(info["variant"], "avx512-vnni")
    for method in METHODS:
        assert method in info["kernels"], method
        want = "bf16-panels"
        if isa and method != "MXFP8":
            want = f"{'int8' if method == 'RAWINT4' else 'int15'}-gemm-{isa}"
            # Where the bf16 dot product beat fp32 FMA, the 15-bit kinds decode bf16 panels
            # for larger experts.
            if method != "RAWINT4" and "bf16dot" in info["kernels"]["BF16"]:
                want += "; bf16-panels from 16 rows"
        assert info["prefill_kernels"][method] == want, (method, info["variant"])


def test_backend_variables_select_the_avx2_kernels(monkeypatch):
    import kt_kernel

    if kt_kernel.cpu_info()["variant"] in ("generic", "avx2"):
        pytest.skip("the AVX2 kernels are already the best here")
    args = dict(layer_idx=0, e=4, k=2, h=128, i=128)
    for method, var in (("MXFP4", "KT_MXFP4_BACKEND"), ("RAWINT4", "KT_RAWINT4_BACKEND")):
        best = make_wrapper(**args, method=method).moe.kernel
        monkeypatch.setenv(var, "avx2")
        forced = make_wrapper(**args, method=method).moe.kernel
        assert forced.startswith("kgroup-avx2+") and not best.startswith("kgroup-avx2+"), (
            best,
            forced,
        )
        monkeypatch.setenv(var, "amx_blocked")  # the original's name: our best kernels
        assert make_wrapper(**args, method=method).moe.kernel == best
        monkeypatch.delenv(var)
    # Same numbers from the AVX2 kernels (fp32 path, bit-identical twins).
    gate, up, down = random_experts(4, 128, 128, seed=3)
    gen = torch.Generator().manual_seed(4)
    x, ids, wt = random_batch(2, 128, 4, 2, gen)
    outs = []
    for forced in (False, True):
        if forced:
            monkeypatch.setenv("KT_MXFP4_BACKEND", "avx2")
        w = make_wrapper(**args, method="MXFP4")
        w.load_weights_from_tensors(gate, up, down, torch.arange(4))
        outs.append(w.forward(x, ids, wt, None))
    assert torch.equal(outs[0], outs[1])


def _bad(tmp_path, method, change):
    gate, up, down = random_experts(4, 128, 128, seed=9)
    folder = tmp_path / "ckpt"
    write_checkpoint(method, folder, 0, gate, up, down)
    path = folder / "model.safetensors"
    tensors = load_tensors(path)
    change(tensors, prefix(method, 0, 2, "up"))
    save_file(tensors, str(path))
    return make_wrapper(layer_idx=0, e=4, k=2, h=128, i=128, method=method, weight_path=str(folder))


def _nan_code(t, p):
    q = t[f"{p}.weight"].view(torch.uint8).clone()
    q[5, 17] = 0x7F
    t[f"{p}.weight"] = q.view(torch.float8_e4m3fn)


def _nan_e8m0(t, p):
    t[f"{p}.scale"][3, 1] = 0xFF


def _inf_bf16_scale(t, p):
    t[f"{p}.weight_scale"][0, 0] = float("inf")


def _huge_bf16_scale(t, p):
    # finite, but 7 times it is not: the largest of the view's scales, away from [0, 0]
    t[f"{p}.weight_scale"][7, 2] = 1e38


def _negative_inf_bf16_scale(t, p):
    t[f"{p}.weight_scale"][-1, -1] = float("-inf")


def _inf_f16_gptq_scale(t, p):
    t[f"{p}.scales"][0, 5] = float("inf")


def _missing_scale(t, p):
    del t[f"{p}.weight_scale"]


def _group_not_dividing(t, p):
    t[f"{p}.weight_scale"] = t[f"{p}.weight_scale"][:, :3].contiguous()


def _wrong_scale_dtype(t, p):
    t[f"{p}.weight_scale"] = t[f"{p}.weight_scale"].float()


def _truncated_codes(t, p):
    t[f"{p}.weight_packed"] = t[f"{p}.weight_packed"][:, :-1].contiguous()


@pytest.mark.parametrize(
    "method,change,error,message",
    [
        ("MXFP8", _nan_code, ValueError, "NaN code"),
        ("MXFP4", _nan_e8m0, ValueError, "not a finite number"),
        ("RAWINT4", _inf_bf16_scale, ValueError, "not a finite number"),
        ("RAWINT4", _huge_bf16_scale, ValueError, "beyond f32"),
        ("RAWINT4", _negative_inf_bf16_scale, ValueError, "not a finite number"),
        ("GPTQ_INT4", _inf_f16_gptq_scale, ValueError, "not a finite number"),
        ("RAWINT4", _missing_scale, ValueError, "weight_scale is missing"),
        ("RAWINT4", _group_not_dividing, ValueError, r"weight_scale .*group size that divides"),
        ("RAWINT4", _wrong_scale_dtype, ValueError, r"weight_scale is F32 .*Bf16"),
        ("RAWINT4", _truncated_codes, ValueError, "weight_shape says"),
    ],
)
def test_bad_checkpoints_are_refused_naming_the_tensor(tmp_path, method, change, error, message):
    w = _bad(tmp_path, method, change)
    with pytest.raises(error, match=message):
        w.load_weights(torch.arange(4))


@pytest.mark.parametrize("setting", ["desc_act", "sym", "bits"])
def test_gptq_checkpoints_we_would_misread_are_refused(tmp_path, setting):
    gate, up, down = random_experts(4, 128, 128, seed=2)
    write_checkpoint("GPTQ_INT4", tmp_path, 0, gate, up, down)
    value = {"desc_act": '"desc_act": true', "sym": '"sym": false', "bits": '"bits": 8'}[setting]
    (tmp_path / "config.json").write_text('{"quantization_config": {' + value + "}}")
    w = make_wrapper(
        layer_idx=0, e=4, k=2, h=128, i=128, method="GPTQ_INT4", weight_path=str(tmp_path)
    )
    with pytest.raises(NotImplementedError, match=setting.replace("_", ".")):
        w.load_weights(torch.arange(4))


@needs_fixtures
def test_any_method_loads_a_group_scaled_checkpoint():
    """The codes are read through the same views: a BF16 layer from an MXFP4 checkpoint computes
    the dequantized weights."""
    path = FIXTURES / "mxfp4" / "model.safetensors"
    g, u, d = dequantize_checkpoint("MXFP4", path, 1, 4)
    w = make_wrapper(
        layer_idx=1, e=4, k=2, h=128, i=256, method="BF16", weight_path=str(path.parent)
    )
    w.load_weights(torch.arange(4))
    gen = torch.Generator().manual_seed(8)
    x, ids, wt = random_batch(3, 128, 4, 2, gen)
    assert _rel(w.forward(x, ids, wt, None), moe_reference(x, ids, wt, g, u, d)) < 4e-3


@pytest.mark.parametrize("method", ["RAWINT4", "MXFP4", "MXFP8"])
def test_swiglu_limit_and_alpha_on_every_path(tmp_path, method):
    """The clamp and the "swigluoai" variant (DeepSeek-V4 MXFP4, MiniMax-M3 MXFP8) on the
    integer/fp32 few-row kernels (1 token) and the bf16 panels (64 tokens)."""
    from conftest import reference_moe

    e, h, i = 4, 128, 128
    gate, up, down = random_experts(e, h, i, seed=12)
    gate, up = gate * 6, up * 6  # gate/up outputs past the clamp
    write_checkpoint(method, tmp_path, 0, gate, up, down)
    g64, u64, d64 = dequantize_checkpoint(method, tmp_path / "model.safetensors", 0, e)
    gen = torch.Generator().manual_seed(3)
    for limit, alpha in ((0.5, 0.0), (0.7, 1.702)):
        w = make_wrapper(
            layer_idx=0,
            e=e,
            k=2,
            h=h,
            i=i,
            chunk=64,
            method=method,
            weight_path=str(tmp_path),
            swiglu_limit=limit,
            swiglu_alpha=alpha,
        )
        w.load_weights(torch.arange(e))
        for t in (1, 64):
            x, ids, wt = random_batch(t, h, e, 2, gen)
            ref = reference_moe(x, ids, wt, g64, u64, d64, limit=limit, alpha=alpha)
            # RAWINT4's 8-bit batch activations round the clamped SwiGLU rows (many values at
            # the limit) to about 1.8e-2; without the clamp the error is about 0.3.
            budget = 2.5e-2 if method == "RAWINT4" and t > 1 else 1e-2
            assert _rel(w.forward(x, ids, wt, None), ref) < budget, (method, limit, alpha, t)


@pytest.mark.parametrize("method", METHODS)
def test_shapes_that_do_not_split_into_groups_are_refused(method):
    with pytest.raises(ValueError, match="multiple"):
        make_wrapper(layer_idx=0, e=4, k=2, h=48, i=128, method=method)
    with pytest.raises(ValueError, match="multiple"):
        make_wrapper(layer_idx=0, e=4, k=2, h=128, i=80, method=method)


def _checkpoint_load(tmp_path, method: str, edit, config: str | None = None):
    """Load one layer of `method` written by `native_checkpoints`, its tensors changed by
    `edit(tensors)` first; returns the loaded wrapper."""
    import native_checkpoints as nc

    e, h, i = 4, 128, 256
    g = torch.Generator().manual_seed(0)
    gate, up, down = (
        (torch.randn(*s, generator=g) * 0.05).bfloat16() for s in ((e, i, h), (e, i, h), (e, h, i))
    )
    tensors = nc.layer_tensors(method, 0, gate, up, down)
    edit(tensors)
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    if config is not None:
        (tmp_path / "config.json").write_text(config)
    w = make_wrapper(e=e, h=h, i=i, method=method, weight_path=str(tmp_path))
    w.load_weights(torch.arange(e))
    return w


def test_gptq_zero_points_act_order_and_string_flags_are_refused(tmp_path):
    import native_checkpoints as nc

    def add(suffix, t, projs=("gate", "up", "down")):
        def edit(tensors):
            for p in [prefix("GPTQ_INT4", 0, e, q) for e in range(4) for q in projs]:
                tensors[f"{p}.{suffix}"] = t(tensors[f"{p}.scales"])

        return edit

    symmetric = add(
        "qzeros", lambda s: torch.full((s.shape[0], s.shape[1] // 8), 0x77777777, dtype=torch.int32)
    )
    _checkpoint_load(tmp_path / "v1", "GPTQ_INT4", symmetric)  # zero point 8, stored as 7
    asym = add(
        "qzeros", lambda s: torch.full((s.shape[0], s.shape[1] // 8), 0x33333333, dtype=torch.int32)
    )
    with pytest.raises(NotImplementedError, match="asymmetric GPTQ"):
        _checkpoint_load(tmp_path / "asym", "GPTQ_INT4", asym)
    flipped = add("g_idx", lambda s: (torch.arange(256).flip(0) // 128).int(), ("down",))
    with pytest.raises(NotImplementedError, match="activation-order"):
        _checkpoint_load(tmp_path / "order", "GPTQ_INT4", flipped, nc.GPTQ_CONFIG)
    in_order = add("g_idx", lambda s: (torch.arange(256) // 128).int(), ("down",))
    _checkpoint_load(tmp_path / "in-order", "GPTQ_INT4", in_order, nc.GPTQ_CONFIG)
    as_string = nc.GPTQ_CONFIG.replace('"bits": 4', '"bits": "8"')
    with pytest.raises(NotImplementedError, match="8 bits"):
        _checkpoint_load(tmp_path / "bits", "GPTQ_INT4", lambda t: None, as_string)


def test_nvfp4_scales_stored_as_bytes_and_overflowing_e8m0_scales_are_refused(tmp_path):
    def bytes_scales(tensors):
        for name in [n for n in tensors if n.endswith(".weight_scale")]:
            tensors[name] = tensors[name].view(torch.uint8)

    with pytest.raises(ValueError, match="F8_E4M3"):
        _checkpoint_load(tmp_path / "nv", "NVFP4", bytes_scales)

    def huge(tensors):  # E8M0 254 = 2^127: the group's largest code is beyond f32
        tensors[prefix("MXFP8", 0, 0, "gate") + ".weight_scale_inv"].fill_(254)

    with pytest.raises(ValueError, match="beyond f32"):
        _checkpoint_load(tmp_path / "mx", "MXFP8", huge)


def _grouped_checkpoint(folder: Path, method: str, group_gu: int, group_down: int, h: int, i: int):
    """One layer of 3 experts in `method` with its own group sizes for gate/up and down."""
    import native_checkpoints as nc

    gate, up, down = random_experts(3, h, i, seed=4)
    default, tensors = nc.GROUP[method], {}
    try:
        for proj, mats, g in (
            ("gate", gate, group_gu),
            ("up", up, group_gu),
            ("down", down, group_down),
        ):
            nc.GROUP[method] = g
            for e in range(3):
                for suffix, t in nc.matrix_tensors(method, mats[e]).items():
                    tensors[f"{prefix(method, 0, e, proj)}.{suffix}"] = t
    finally:
        nc.GROUP[method] = default
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    return make_wrapper(layer_idx=0, e=3, k=2, h=h, i=i, method=method, weight_path=str(folder))


@pytest.mark.parametrize(
    "method,group_gu,group_down",
    [
        ("RAWINT4", 32, 40),
        ("RAWINT4", 48, 32),
        ("MXFP4", 24, 32),
        ("MXFP8", 32, 6),
        ("NVFP4", 16, 48),
    ],
)
def test_groups_that_straddle_the_kernels_chunks_are_refused(
    tmp_path, method, group_gu, group_down
):
    """The integer kernels cut activations in chunks of 32 and the decoder works in blocks of 32
    or 128: a group of 24, 40 or 48 (or 6) straddles them. Such checkpoints loaded and gave NaN
    or wrong sums (or a panic in the forward); now the load names the group."""
    h, i = math.lcm(32, group_gu) * 2, math.lcm(32, group_down) * 2
    w = _grouped_checkpoint(tmp_path, method, group_gu, group_down, h, i)
    with pytest.raises(ValueError, match=r"group size \d+ \((gate/up|down)\) is not supported"):
        w.load_weights(torch.arange(3))


@pytest.mark.parametrize("method,group", [("RAWINT4", 96), ("RAWINT4", 256), ("MXFP8", 4)])
def test_unusual_groups_that_tile_the_chunks_compute_right(tmp_path, method, group):
    h = i = math.lcm(64, group)
    w = _grouped_checkpoint(tmp_path, method, group, group, h, i)
    w.load_weights(torch.arange(3))
    t = load_tensors(tmp_path / "model.safetensors")
    gate, up, down = (
        torch.stack([dequantize(method, t, prefix(method, 0, e, p)) for e in range(3)])
        for p in ("gate", "up", "down")
    )
    gen = torch.Generator().manual_seed(1)
    for tokens in (1, 40):
        x = torch.randn(tokens, h, generator=gen).bfloat16()
        ids = torch.stack([torch.randperm(3, generator=gen)[:2] for _ in range(tokens)])
        weights = torch.rand(tokens, 2, generator=gen)
        out = w.forward(x, ids, weights, None).double()
        ref = moe_reference(x, ids, weights, gate, up, down)
        assert ((out - ref).norm() / ref.norm()).item() < 2e-2, (method, group, tokens)
