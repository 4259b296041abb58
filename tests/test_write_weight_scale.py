"""write_weight_scale_to_buffer: one expert's weights and scales written into each GPU
tensor-parallel rank's buffers, byte-identical to what the original kt-kernel 0.7.2 writes
(`shared/fixtures/native-more/wwsb-*.safetensors`, written with threadpool_count 2), whatever
our own NUMA split; pointer lists checked; methods without a GPU layout refuse."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_wrapper
from safetensors import safe_open

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "native-more"
pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason="shared/fixtures not present")
METHODS = {
    "BF16": "bf16",
    "FP8": "fp8",
    "FP8_PERCHANNEL": "fp8_perchannel",
    "RAWINT4": "rawint4",
    "MXFP4": "mxfp4",
    "NVFP4": "nvfp4",
    "MXFP8": "mxfp8",
    "GPTQ_INT4": "gptq_int4",
}
NAMES = ("w13_weight", "w13_scale", "w2_weight", "w2_scale")


def loaded(method: str, threadpool_count: int = 1):
    w = make_wrapper(
        layer_idx=1,
        e=4,
        k=2,
        h=128,
        i=256,
        method=method,
        threadpool_count=threadpool_count,
        weight_path=str(FIXTURES / METHODS[method]),
    )
    w.load_weights(torch.arange(4))
    return w


def write(w, gpu_tp: int, expert: int) -> dict[str, torch.Tensor]:
    sizes = w.moe.gpu_rank_bytes(gpu_tp)
    bufs = {
        (name, r): torch.full((n,), 0xA5, dtype=torch.uint8)
        for name, n in zip(NAMES, sizes, strict=True)
        for r in range(gpu_tp)
    }
    ptrs = [[bufs[(name, r)].data_ptr() for r in range(gpu_tp)] for name in NAMES]
    w.submit_write_weight_scale_to_buffer(gpu_tp, expert, *ptrs)
    w.sync_write_weight_scale_to_buffer()
    return {f"gpu{gpu_tp}.expert{expert}.{n}.rank{r}": t for (n, r), t in bufs.items()}


def expected(method: str) -> dict[str, torch.Tensor]:
    with safe_open(str(FIXTURES / f"wwsb-{METHODS[method]}.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("method", sorted(set(METHODS) - {"GPTQ_INT4"}))
def test_bytes_equal_the_originals(method):
    w, want = loaded(method), expected(method)
    for gpu_tp in (1, 2):
        for expert in (0, 3):
            got = write(w, gpu_tp, expert)
            for key, t in got.items():
                assert torch.equal(t, want[key]), key


def test_bytes_do_not_depend_on_our_numa_split():
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import torch, test_write_weight_scale as t
for method in ("FP8", "RAWINT4", "MXFP4", "NVFP4", "MXFP8"):
    want = t.expected(method)
    w = t.loaded(method, threadpool_count=2)
    assert w.cpu_infer.engine.parts == 2
    for gpu_tp in (1, 2):
        for key, got in t.write(w, gpu_tp, 3).items():
            assert torch.equal(got, want[key]), (method, key)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_pointer_lists_expert_ids_and_methods_are_checked():
    w = loaded("FP8")
    sizes = w.moe.gpu_rank_bytes(2)
    bufs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    one = [[b.data_ptr()] for b in bufs]
    with pytest.raises(ValueError, match="pointer lists"):
        w.submit_write_weight_scale_to_buffer(2, 0, *one)
    with pytest.raises(ValueError, match="expert_id"):
        w.submit_write_weight_scale_to_buffer(1, 4, *one)
    with pytest.raises(ValueError, match="expert_id"):
        w.submit_write_weight_scale_to_buffer(1, -1, *one)
    null = [list(p) for p in one]
    null[2] = [0]
    with pytest.raises(ValueError, match="null"):
        w.submit_write_weight_scale_to_buffer(1, 0, *null)
    with pytest.raises(ValueError, match="GPU ranks"):
        w.moe.gpu_rank_bytes(3)
    amx = make_wrapper(layer_idx=0, e=4, k=2, h=128, i=128, method="AMXINT8")
    with pytest.raises(NotImplementedError, match="not implemented"):
        amx.moe.gpu_rank_bytes(1)


def test_gptq_writes_its_own_checkpoint_layout_per_rank():
    """The original has no GPTQ_INT4 write; ours writes what GPTQ GPU kernels read: w13 as
    `qweight [H/8, 2·I_r]` (gate columns of the rank, then up) with `scales [H/g, 2·I_r]`, w2 as
    `qweight [I_r/8, H]` with `scales [I_r/g, H]`, i.e. the checkpoint's tensors cut per rank."""
    with safe_open(str(FIXTURES / "gptq_int4" / "model.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    w = loaded("GPTQ_INT4")
    for gpu_tp in (1, 2):
        for expert in (0, 3):
            got = write(w, gpu_tp, expert)
            p = f"model.layers.1.mlp.experts.{expert}"
            for r in range(gpu_tp):
                ir = 256 // gpu_tp
                cols = slice(r * ir, (r + 1) * ir)
                want = {
                    "w13_weight": torch.cat(
                        [t[f"{p}.gate_proj.qweight"][:, cols], t[f"{p}.up_proj.qweight"][:, cols]],
                        1,
                    ),
                    "w13_scale": torch.cat(
                        [t[f"{p}.gate_proj.scales"][:, cols], t[f"{p}.up_proj.scales"][:, cols]], 1
                    ),
                    "w2_weight": t[f"{p}.down_proj.qweight"][r * ir // 8 : (r + 1) * ir // 8],
                    "w2_scale": t[f"{p}.down_proj.scales"][r * ir // 128 : (r + 1) * ir // 128],
                }
                for name, tensor in want.items():
                    key = f"gpu{gpu_tp}.expert{expert}.{name}.rank{r}"
                    raw = tensor.contiguous().view(torch.uint8).flatten()
                    assert torch.equal(got[key], raw), key


@pytest.mark.parametrize("method", ["BF16", "NVFP4", "MXFP8"])
def test_rank_slices_off_the_panel_grid(method, tmp_path):
    """A rank of 80 intermediate rows (I = 160 at 2 GPU ranks: BF16, NVFP4's group of 16) is
    two whole 32-row panels and rows off the grid: whole panels are transposed at once, the
    rest row by row; both must give the checkpoint's rows. MXFP8 (group 32) at 3 ranks of 64
    rows. BF16 from tensors, the others from their checkpoints. Written under the best CPU
    variant, AVX2 and plain Rust (the transposes differ per ISA)."""
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import torch, native_checkpoints as nc, test_write_weight_scale as t
from pathlib import Path
from conftest import make_wrapper
method, e, h, i, tp = {method!r}, 3, 64, 160 if {method!r} != "MXFP8" else 192, 2
if method == "MXFP8":
    tp = 3
g = torch.Generator().manual_seed(7)
gate, up, down = ((torch.randn(s, generator=g) * 0.05).bfloat16()
                  for s in ((e, i, h), (e, i, h), (e, h, i)))
w = make_wrapper(layer_idx=1, e=e, k=2, h=h, i=i, method=method,
                 weight_path="" if method == "BF16" else {str(tmp_path)!r})
if method == "BF16":
    w.load_weights_from_tensors(gate, up, down, torch.arange(e))
else:
    nc.write_checkpoint(method, Path({str(tmp_path)!r}), 1, gate, up, down)
    w.load_weights(torch.arange(e))
    ckpt = nc.layer_tensors(method, 1, gate, up, down)
ir = i // tp
for expert in (0, 2):
    got = t.write(w, tp, expert)
    for r in range(tp):
        rows = slice(r * ir, (r + 1) * ir)
        if method == "BF16":
            want = {{"w13_weight": torch.cat([gate[expert][rows], up[expert][rows]]),
                     "w2_weight": down[expert][:, rows]}}
        else:
            def mat(proj):
                p = nc.prefix(method, 1, expert, proj)
                if method == "NVFP4":
                    s = ckpt[p + ".weight_scale"].float() * ckpt[p + ".weight_scale_2"].float()
                    return ckpt[p + ".weight"].view(torch.uint8), s.bfloat16()
                return ckpt[p + ".weight"].view(torch.uint8), ckpt[p + ".weight_scale_inv"]
            (gw, gs), (uw, us), (dw, ds) = mat("gate"), mat("up"), mat("down")
            grp = nc.GROUP[method]
            cols = slice(r * ir // grp, (r + 1) * ir // grp)
            code_cols = slice(r * ir // 2, (r + 1) * ir // 2) if method == "NVFP4" else rows
            want = {{"w13_weight": torch.cat([gw[rows], uw[rows]]),
                     "w13_scale": torch.cat([gs[rows], us[rows]]),
                     "w2_weight": dw[:, code_cols], "w2_scale": ds[:, cols]}}
        for name, tensor in want.items():
            key = f"gpu{{tp}}.expert{{expert}}.{{name}}.rank{{r}}"
            raw = tensor.contiguous().view(torch.uint8).flatten()
            assert torch.equal(got[key], raw), key
print("ok")
"""
    variants = ["", "avx2", "generic"]
    for variant in variants:
        env = dict(os.environ)
        env.pop("KT_KERNEL_CPU_VARIANT", None)
        if variant:
            env["KT_KERNEL_CPU_VARIANT"] = variant
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert r.returncode == 0 and "ok" in r.stdout, (variant, r.stderr[-3000:])
