"""The layer benchmark (``python -m kt_kernel bench``, the README's main job) on a tiny layer:
it runs, every method gets a row per size, and methods loaded in separate memory groups are
timed and checked as when loaded together."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kt_kernel
import pytest
from kt_kernel.bench import _compute_family, _memory_groups, _set_floor


def test_memory_groups_keep_order_and_respect_the_budget():
    sizes = {"a": 4, "b": 3, "c": 5, "d": 1, "e": 9}
    variants = [(name, None, None) for name in sizes]
    groups = _memory_groups(variants, sizes.__getitem__, 8)
    assert [[v[0] for v in g] for g in groups] == [["a", "b"], ["c", "d"], ["e"]]
    assert len(_memory_groups(variants, sizes.__getitem__, float("inf"))) == 1


def test_the_15_bit_kernels_floor_counts_two_int8_passes():
    """GPTQ_INT4/MXFP4/NVFP4 below their bf16-panel rows run the 15-bit kernel (two int8
    multiply-adds per product): their floor is half the int8 peak's rate; RAWINT4's 8-bit
    kernel and the bf16 panels keep theirs."""
    info = {
        "kernels": {"AMX": "none", "BF16": "avx512-fma+bf16dot"},
        "amx_min_rows": 0,
        "prefill_kernels": {
            "GPTQ_INT4": "int15-gemm-avx512-vnni; bf16-panels from 16 rows",
            "MXFP4": "int15-gemm-avx2",
            "RAWINT4": "int8-gemm-avx512-vnni",
        },
    }
    assert _compute_family("GPTQ_INT4", info, 8) == "int15"
    assert _compute_family("GPTQ_INT4", info, 32) == "bf16"
    assert _compute_family("MXFP4", info, 64) == "int15"
    assert _compute_family("RAWINT4", info, 8) == "int8"
    rows = [{"giga_ops": 10.0, "memory_floor_ms": 1.0, "median_ms": 30.0} for _ in range(2)]
    for row, family in zip(rows, ("int8", "int15"), strict=True):
        row["compute_family"] = family
        _set_floor(row, {"int8_madd_gops": 1000.0})
    assert [r["floor_ms"] for r in rows] == [10.0, 20.0]
    assert [r["x_floor"] for r in rows] == [3.0, 1.5]


def test_the_bench_runs_methods_in_groups(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--experts", "8", "--layers", "1", "--tokens", "1", "4", "--repeats", "3"]
    args += ["--methods", "BF16", "AMXINT8", "--max-resident-gb", "0.02", "--json", str(out)]
    r = subprocess.run(
        [sys.executable, "-m", "kt_kernel", "bench", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["groups"] == [["BF16"], ["AMXINT8"]]
    # No --threads: every physical core.
    assert data["meta"]["threads"] == kt_kernel.cpu_info()["physical_cores"]
    rows = {(row["impl"], row["tokens"]): row for row in data["results"]}
    assert set(rows) == {(m, t) for m in ("BF16", "AMXINT8", "torch-bf16") for t in (1, 4)}
    # Each row is checked against the float64 reference on the bench's own random weights.
    for (impl, _), row in rows.items():
        assert row["median_ms"] > 0
        assert row["rel_l2_err"] < (0.05 if impl == "AMXINT8" else 0.01), row
    assert [(row["impl"], row["tokens"]) for row in data["results"]][:3] == [
        ("BF16", 1),
        ("AMXINT8", 1),
        ("torch-bf16", 1),
    ]


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--max-resident-gb", "0", "--max-resident-gb must be > 0 GB"),
        ("--threads", "-1", "--threads must be 0"),
        ("--threads", "100000", "--threads must be 0"),  # torch crashed on thousands
        ("--tokens", "0", "--tokens must all be >= 1"),
        ("--experts", "4", "--experts must be at least"),
        ("--layers", "0", "--layers must be >= 1"),
        ("--repeats", "-5", "--repeats must be >= 0"),
        ("--methods", "bogus", "unknown method(s) ['bogus']"),
        ("--gguf-type", "BOGUS", "'BOGUS' is not a ggml type"),
        ("--json", "/nonexistent-folder/x.json", "its folder does not exist"),
    ],
)
def test_bad_bench_arguments_are_refused(flag, value, message):
    # Refused before anything loads: a message, not a traceback minutes into the run.
    r = subprocess.run(
        [sys.executable, "-m", "kt_kernel", "bench", "--methods", "LLAMAFILE", flag, value],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_rows_slowed_from_outside_are_marked():
    from kt_kernel.bench import DISTURBED_SPREAD, _median_cell

    assert _median_cell({"median_ms": 1.2, "best_ms": 1.0}) == "1.20"
    marked = _median_cell({"median_ms": 1.0 + DISTURBED_SPREAD, "best_ms": 1.0})
    assert marked.endswith(" †") and marked.startswith("2.25")


def test_rows_met_with_shared_cores_are_marked():
    from kt_kernel.bench import SHARED_CORES, _cores_cell

    assert _cores_cell({}) == ""
    assert _cores_cell({"cores_now": None}) == ""
    assert _cores_cell({"cores_now": 0.97}) == "; cores 97%"
    marked = _cores_cell({"cores_now": SHARED_CORES - 0.01})
    assert marked.endswith(" ‡") and f"{100 * (SHARED_CORES - 0.01):.0f}%" in marked


@pytest.mark.parametrize("flag", ["--loads", "--repeats", "--experts", "--threads"])
def test_write_weight_scale_bench_refuses_counts_below_one(flag):
    script = Path(__file__).resolve().parents[1] / "benches" / "write_weight_scale_bench.py"
    r = subprocess.run([sys.executable, str(script), flag, "0"], capture_output=True, text=True)
    assert r.returncode == 2 and f"{flag} must be >= 1" in r.stderr, r.stderr


NATIVE_METHODS = ["FP8", "FP8_PERCHANNEL", "RAWINT4", "GPTQ_INT4", "MXFP4", "NVFP4", "MXFP8"]


@pytest.mark.parametrize("method", NATIVE_METHODS)
def test_the_torch_dequant_baseline_reads_the_native_files_exactly(method, tmp_path):
    """The baseline issue 19 compares against where the original cannot run: its dequantizer
    gives the checkpoint's values, and its layer computes the MoE of those values."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))
    import native_checkpoints
    import torch_dequant_moe

    experts, hidden, inter, top_k = 4, 256, 128, 2
    gen = torch.Generator().manual_seed(7)
    stacks = [
        (torch.randn(experts, n, k, generator=gen) * 0.05).bfloat16()
        for n, k in ((inter, hidden), (inter, hidden), (hidden, inter))
    ]
    tensors = native_checkpoints.layer_tensors(method, 0, *stacks)
    save_file(tensors, str(tmp_path / "layer-00000.safetensors"))

    dense = []
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
    for proj, (n, k) in zip(("gate", "up", "down"), shapes, strict=True):
        mats = []
        for e in range(experts):
            p = native_checkpoints.prefix(method, 0, e, proj)
            want = native_checkpoints.dequantize(method, tensors, p)
            got = torch_dequant_moe.dequantize(method, tensors, p)
            assert got.shape == (n, k) and got.dtype == torch.float32
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
            mats.append(want)
        dense.append(torch.stack(mats))

    layer = torch_dequant_moe.KTMoEWrapper(
        0, experts, top_k, hidden, inter, None, 2, 1, str(tmp_path), 64, method=method
    )
    layer.load_weights()
    x = torch.randn(16, hidden, generator=gen).bfloat16()
    ids = torch.rand(16, experts, generator=gen).topk(top_k, dim=-1).indices
    wts = torch.softmax(torch.randn(16, top_k, generator=gen), dim=-1)
    out = layer.forward(x, ids, wts)
    ref = torch.zeros(16, hidden, dtype=torch.float64)
    for t in range(16):
        for slot in range(top_k):
            e = int(ids[t, slot])
            xe = x[t].double()
            h = torch.nn.functional.silu(dense[0][e] @ xe) * (dense[1][e] @ xe)
            ref[t] += wts[t, slot].double() * (dense[2][e] @ h)
    rel = float((out.double() - ref).norm() / ref.norm())
    assert rel < 1e-2, rel
