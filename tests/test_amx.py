"""AMX tile kernels: whole layers run the tile programs on the software emulator
(KT_KERNEL_AMX_EMULATE=1) and must equal the vector kernels (integer formats) or stay within
bf16 accuracy (BF16); where the CPU and Linux allow AMX, the hardware tiles must give the
emulator's integer results bit for bit and its bf16 results within bf16 rounding."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import kt_kernel
import pytest
import torch
from conftest import make_wrapper, random_experts, random_routing, reference_moe, rel_l2

# A fresh process's layer of {e} experts (H=128, I=256, top-2); the scripts below go on from it.
LAYER = """
import sys, torch, kt_kernel
sys.path.insert(0, {tests!r})
from conftest import make_wrapper, random_experts, random_routing
g, u, d = random_experts({e}, 128, 256, seed=5)
w = make_wrapper(e={e}, k=2, h=128, i=256, method={method!r})
w.load_weights_from_tensors(g, u, d)
"""

RUN = """
x = torch.randn(40, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
ids, wt = random_routing(40, 6, 2, seed=3)
print(w.moe.kernel)
torch.save(w.forward(x, ids, wt, None), {out!r})
"""


def run_emulated(method, tmp_path, min_rows="4", emulate="1"):
    """The RUN layer in a fresh process with KT_KERNEL_AMX_MIN_ROWS = `min_rows` (None: the
    method's own default) on the emulator (`emulate="1"`) or whatever the CPU has ("0")."""
    out = tmp_path / f"{method}-{min_rows}-{emulate}.pt"
    env = dict(os.environ, KT_KERNEL_AMX_EMULATE=emulate)
    env.pop("KT_KERNEL_AMX_MIN_ROWS", None)
    if min_rows is not None:
        env["KT_KERNEL_AMX_MIN_ROWS"] = min_rows
    code = (LAYER + RUN).format(tests=os.path.dirname(__file__), e=6, method=method, out=str(out))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip(), torch.load(out)


def run_here(method):
    g, u, d = random_experts(6, 128, 256, seed=5)
    w = make_wrapper(e=6, k=2, h=128, i=256, method=method)
    w.load_weights_from_tensors(g, u, d)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    ids, wt = random_routing(40, 6, 2, seed=3)
    return w.forward(x, ids, wt, None), reference_moe(x, ids, wt, g, u, d)


AMX_USABLE = bool(kt_kernel.cpu_info()["amx_permission"])


@pytest.mark.skipif(not AMX_USABLE, reason="needs AMX (CPUID, XCR0 and Linux permission)")
@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4", "BF16", "FP8", "RAWINT4", "MXFP4"])
def test_hardware_tiles_equal_the_emulator(method, tmp_path):
    """The same tile program on real tiles and on the emulator: integer tiles bit for bit,
    bf16 tiles (BF16, FP8's and the group-scaled methods' decoded panels) within bf16
    rounding, since real tdpbf16ps rounds its sums differently from the SDM pseudo-code."""
    kernel, emulated = run_emulated(method, tmp_path)
    assert "amx-emulated+" in kernel, kernel
    # The same threshold on both sides (the methods' own defaults differ from 4).
    here, hardware = run_emulated(method, tmp_path, emulate="0")
    _, ref = run_here(method)
    assert "amx+" in here and "emulated" not in here, here
    if method in ("AMXINT8", "AMXINT4"):
        assert torch.equal(hardware, emulated)
    else:
        assert rel_l2(hardware, emulated) < 2e-3, rel_l2(hardware, emulated)
        assert abs(rel_l2(hardware, ref) - rel_l2(emulated, ref)) < 2e-3


RUN_TWICE = """
import sys, torch
sys.path.insert(0, {tests!r})
from conftest import make_wrapper, random_experts, random_routing
e, k, t = {shape!r}
g, u, d = random_experts(e, 128, 256, seed=5)
w = make_wrapper(e=e, k=k, h=128, i=256, method={method!r}, chunk=t)
w.load_weights_from_tensors(g, u, d)
outs = []
for seed in {seeds!r}:
    x = torch.randn(t, 128, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    ids, wt = random_routing(t, e, k, seed=3)  # the same rows each time, new values
    outs.append(w.forward(x, ids, wt, None))
print(w.moe.kernel)
torch.save(outs, {out!r})
"""


@pytest.mark.parametrize("shape", [(4, 2, 160), (1, 1, 48)])
@pytest.mark.parametrize("method", ["AMXINT8", "BF16", "FP8", "MXFP4"])
def test_tile_paths_reuse_nothing_stale_across_row_blocks_and_forwards(method, shape, tmp_path):
    """The tile paths keep packed rows and decoded panels per thread while a forward phase
    reuses them: with about 80 rows per expert (three 32-row blocks), or one expert of 48
    rows (two blocks: few enough that a thread still holds the last forward's packings). A
    forward after another with the same routing (so the same row addresses) and new values
    must equal the same forward in a fresh process, bit for bit, and stay accurate."""

    def run(seeds, name):
        out = tmp_path / f"{name}.pt"
        env = dict(os.environ, KT_KERNEL_AMX_EMULATE="1", KT_KERNEL_AMX_MIN_ROWS="4")
        code = RUN_TWICE.format(
            tests=os.path.dirname(__file__), method=method, shape=shape, seeds=seeds, out=str(out)
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "amx-emulated+" in r.stdout, r.stdout
        return torch.load(out)

    first, second = run([11, 12], "both")
    (fresh,) = run([12], "fresh")
    assert torch.equal(second, fresh)
    assert not torch.equal(first, second)
    e, k, t = shape
    g, u, d = random_experts(e, 128, 256, seed=5)
    x = torch.randn(t, 128, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    ids, wt = random_routing(t, e, k, seed=3)
    bound = {"AMXINT8": 0.03, "BF16": 1e-2, "FP8": 0.06, "MXFP4": 0.25}[method]
    assert rel_l2(second, reference_moe(x, ids, wt, g, u, d)) < bound


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4"])
def test_emulated_tile_kernels_equal_the_vector_kernels(method, tmp_path):
    kernel, emulated = run_emulated(method, tmp_path)
    assert kernel.startswith("amx-emulated+"), kernel
    vector, ref = run_here(method)
    # Integer dot products are exact on both paths and the float epilogue is shared.
    assert torch.equal(emulated, vector)
    assert rel_l2(emulated, ref) < {"AMXINT8": 0.027, "AMXINT4": 0.27}[method]


def test_emulated_bf16_tiles_stay_within_bf16_accuracy(tmp_path):
    kernel, emulated = run_emulated("BF16", tmp_path, min_rows="1")
    assert kernel.startswith("amx-emulated+"), kernel
    _, ref = run_here("BF16")
    assert rel_l2(emulated, ref) < 1e-2


def test_amx_reported_used_where_allowed_and_refused_clearly_without_it():
    info = kt_kernel.cpu_info()
    assert "AMX" in info["kernels"] and info["amx_min_rows"] >= 0
    assert info["amx_prefetch_bytes"] >= 0
    core = kt_kernel._kt_core
    eng = core.Engine([2], [0])
    if info["amx_permission"]:
        assert info["kernels"]["AMX"] == "amx"
        layer = core.MoeLayer(eng, 0, 4, 2, 128, 128, 16, kernel="amx", method="AMXINT8")
        assert layer.kernel.startswith("amx+"), layer.kernel
        return
    assert info["kernels"]["AMX"] is None
    with pytest.raises(NotImplementedError, match="amx level"):
        core.MoeLayer(eng, 0, 4, 2, 128, 128, 16, kernel="amx", method="AMXINT8")


def test_each_method_takes_the_tiles_from_its_own_row_count(tmp_path):
    """Without KT_KERNEL_AMX_MIN_ROWS each method uses its measured threshold: RAWINT4's 16
    keeps most experts of this layer (80 rows over 6 experts) on its integer kernels, exactly
    as asking for 16 does, while 4 puts them all on the (emulated) bf16 tiles."""
    code = "import kt_kernel; print(kt_kernel.cpu_info()['amx_min_rows_by_method'])"
    for asked, want in ((None, {"RAWINT4": 16, "MXFP4": 8, "AMXINT8": 4}), ("6", None)):
        env = dict(os.environ, KT_KERNEL_AMX_EMULATE="1")
        env.pop("KT_KERNEL_AMX_MIN_ROWS", None)
        if asked:
            env["KT_KERNEL_AMX_MIN_ROWS"] = asked
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        rows = ast.literal_eval(r.stdout.strip())
        if want is None:
            assert set(rows.values()) == {6}, rows
        else:
            assert {m: rows[m] for m in want} == want, rows
    _, default = run_emulated("RAWINT4", tmp_path, min_rows=None)
    _, at16 = run_emulated("RAWINT4", tmp_path, min_rows="16")
    _, at4 = run_emulated("RAWINT4", tmp_path, min_rows="4")
    assert torch.equal(default, at16)
    assert not torch.equal(default, at4)


@pytest.mark.parametrize("var", ["KT_KERNEL_AMX_MIN_ROWS", "KT_KERNEL_AMX_PREFETCH"])
def test_bad_threshold_or_distance_is_a_clear_error(var):
    env = dict(os.environ, **{var: "many"})
    code = "import kt_kernel; kt_kernel.cpu_info()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and var in r.stderr, r.stderr


TUNE = """
from kt_kernel import _kt_core
x = torch.randn(64, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
states = [_kt_core.amx_prefetch_state({method!r})]
for call in range(48):
    ids, wt = random_routing(64, 8, 2, seed=call)
    w.forward(x, ids, wt, None)
    states.append(_kt_core.amx_prefetch_state({method!r}))
print(repr((w.moe.kernel, states, kt_kernel.cpu_info()["amx_prefetch_bytes"])))
"""


def tune_states(method, prefetch=None):
    """48 prefills of 16 rows per expert in a fresh process: the layer's kernel, the method's
    AMX prefetch state before and after each call, and what cpu_info reports at the end."""
    env = dict(os.environ)
    env.pop("KT_KERNEL_AMX_PREFETCH", None)
    if prefetch is not None:
        env["KT_KERNEL_AMX_PREFETCH"] = prefetch
    code = (LAYER + TUNE).format(tests=os.path.dirname(__file__), e=8, method=method)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return ast.literal_eval(r.stdout.strip().splitlines()[-1])


def test_amx_prefetch_state_names_the_methods_that_stream_into_tiles():
    from kt_kernel import _kt_core

    for method in ("AMXINT8", "AMXINT4", "BF16"):
        tuned, ahead = _kt_core.amx_prefetch_state(method)
        assert ahead in (0, 1024, 4096, 8192) or os.environ.get("KT_KERNEL_AMX_PREFETCH")
    for method in ("FP8", "MXFP4", "LLAMAFILE"):
        assert _kt_core.amx_prefetch_state(method) is None
    with pytest.raises(ValueError):
        _kt_core.amx_prefetch_state("NOPE")


@pytest.mark.skipif(not AMX_USABLE, reason="needs AMX (CPUID, XCR0 and Linux permission)")
@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4", "BF16"])
def test_first_prefills_on_tiles_tune_the_weight_prefetch(method):
    kernel, states, reported = tune_states(method)
    assert kernel.startswith("amx+"), kernel
    near = 4096 if method == "AMXINT4" else 1024
    assert states[0] == (False, near), "the stream's default distance until tuned"
    # 4 warm-up calls, then 12 timed with each of the 3 settings in runs of 2.
    settled = next(i for i, (tuned, _) in enumerate(states) if tuned)
    assert settled == 4 + 3 * 12, states
    assert states[-1] in ((True, 0), (True, near), (True, 8192)), states
    assert all(s == states[-1] for s in states[settled:]), "decided until the next tuning"
    if method != "AMXINT4":
        assert reported == states[-1][1]


@pytest.mark.skipif(not AMX_USABLE, reason="needs AMX (CPUID, XCR0 and Linux permission)")
def test_a_prefetch_distance_from_the_environment_is_never_tuned():
    _, states, reported = tune_states("AMXINT8", prefetch="2048")
    assert set(states) == {(True, 2048)} and reported == 2048
