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
METHODS = {"BF16": "bf16", "FP8": "fp8", "FP8_PERCHANNEL": "fp8_perchannel"}
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


@pytest.mark.parametrize("method", sorted(METHODS))
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
want = t.expected("FP8")
w = t.loaded("FP8", threadpool_count=2)
assert w.cpu_infer.engine.parts == 2
for gpu_tp in (1, 2):
    for key, got in t.write(w, gpu_tp, 3).items():
        assert torch.equal(got, want[key]), key
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
