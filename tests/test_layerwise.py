"""Layerwise prefill's FP8 expert transport (the original's ``FP8LayerwiseTransport``,
``initialize_fp8_layerwise_control``, ``run_layerwise_fp8_batch``): rank zero writes a layer's
experts into every GPU rank's host slots while each rank's copy thread moves them to its GPU
buffer. Two ranks live in this process here (the protocol does not care); "GPU" buffers are
host memory (``cuda_device=-1``), or go through the stand-in CUDA driver's copy entry points.
The bytes that land must be the original's ``write_weight_scale_to_buffer`` bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import kt_kernel  # noqa: F401  (registers kt_kernel_ext)
import kt_kernel_ext
import pytest
import torch
from conftest import make_wrapper
from safetensors import safe_open

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "native-more"
pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason="shared/fixtures not present")
E, TP = 4, 2
KINDS = ("w13_weight", "w13_scale", "w2_weight", "w2_scale")


def _fp8_layer():
    w = make_wrapper(layer_idx=1, e=E, k=2, h=128, i=256, method="FP8",
                     weight_path=str(FIXTURES / "fp8"))  # fmt: skip
    w.load_weights(torch.arange(E))
    return w


def _control():
    """A 64-byte aligned control block inside a tensor (which the caller keeps)."""
    n = kt_kernel_ext.FP8_LAYERWISE_CONTROL_BYTES
    raw = torch.zeros(n + 64, dtype=torch.uint8)
    off = (-raw.data_ptr()) % 64
    kt_kernel_ext.initialize_fp8_layerwise_control(raw.data_ptr() + off, n, TP)
    return raw, raw.data_ptr() + off


class Rank:
    """One rank's buffers: two host slots and the per-kind "GPU" expert arrays."""

    def __init__(self, nbytes):
        self.slots = [[torch.zeros(n, dtype=torch.uint8) for n in nbytes] for _ in range(2)]
        self.gpu = [torch.full((E * n,), 0xA5, dtype=torch.uint8) for n in nbytes]

    def host_ptrs(self):
        return [t.data_ptr() for slot in self.slots for t in slot]

    def gpu_ptrs(self):
        return [t.data_ptr() for t in self.gpu]

    def expert(self, kind, e, nbytes):
        return self.gpu[kind][e * nbytes[kind] : (e + 1) * nbytes[kind]]


def _transports(control, ranks, nbytes, cuda_device=-1, timeout_ms=10000):
    all_host = [[[t.data_ptr() for t in r.slots[s]] for r in ranks] for s in range(2)]
    return [
        kt_kernel_ext.FP8LayerwiseTransport(
            control,
            kt_kernel_ext.FP8_LAYERWISE_CONTROL_BYTES,
            rank,
            TP,
            cuda_device,
            r.host_ptrs(),
            r.gpu_ptrs(),
            all_host if rank == 0 else [],
            nbytes,
            E,
            timeout_ms=timeout_ms,
        )  # fmt: skip
        for rank, r in enumerate(ranks)
    ]


def _layer(wrapper, transports, epoch, layer_id, count=E):
    """Rank 1 joins and waits on a thread; rank 0 runs the batch."""
    theirs = {}

    def other():
        transports[1].join(epoch, layer_id, count)
        theirs["stats"] = transports[1].wait(epoch)

    t = threading.Thread(target=other)
    t.start()
    mine = wrapper.run_layerwise_fp8_batch(transports[0], epoch, layer_id, count)
    t.join()
    return mine, theirs["stats"]


def _original_bytes():
    with safe_open(str(FIXTURES / "wwsb-fp8.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_every_rank_receives_the_originals_bytes_for_every_expert():
    wrapper = _fp8_layer()
    nbytes = wrapper.moe.gpu_rank_bytes(TP)
    keep, control = _control()
    ranks = [Rank(nbytes), Rank(nbytes)]
    transports = _transports(control, ranks, nbytes)
    original = _original_bytes()
    for epoch, layer_id in ((1, 1), (2, 7)):
        for r in ranks:
            for g in r.gpu:
                g.fill_(0xA5)
        mine, theirs = _layer(wrapper, transports, epoch, layer_id)
        assert (mine["epoch"], mine["layer_id"], mine["expert_count"]) == (epoch, layer_id, E)
        assert mine["writer_ms"] > 0 and not mine["poisoned"] and theirs["writer_ms"] == 0
        for rank, r in enumerate(ranks):
            for e in range(E):
                for kind, name in enumerate(KINDS):
                    got = r.expert(kind, e, nbytes)
                    key = f"gpu{TP}.expert{e}.{name}.rank{rank}"
                    if key in original:  # experts 0 and 3
                        assert torch.equal(got, original[key]), key
                    # Every expert: what write_weight_scale_to_buffer writes for that rank.
                    ref = [[torch.zeros(n, dtype=torch.uint8) for _ in range(TP)] for n in nbytes]
                    ptrs = [[t.data_ptr() for t in per_rank] for per_rank in ref]
                    wrapper.submit_write_weight_scale_to_buffer(TP, e, *ptrs)
                    wrapper.sync_write_weight_scale_to_buffer()
                    assert torch.equal(got, ref[kind][rank]), (epoch, e, name, rank)
    assert transports[0].wait(2)["epoch"] == 2  # repeatable
    with pytest.raises(ValueError, match="reuse or decrease"):
        wrapper.run_layerwise_fp8_batch(transports[0], 2, 8, E)
    for t in transports:
        t.close()
    assert transports[1].closed
    with pytest.raises(RuntimeError, match="closed"):
        transports[1].join(3, 1, E)
    del keep


def test_copies_go_through_the_cuda_driver_when_a_device_is_named(tmp_path):
    """The copy thread binds device 1 and copies with cuMemcpyHtoDAsync_v2 on its own stream
    (the stand-in driver, in a fresh process so this one keeps its driver)."""
    code = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
sys.path.insert(0, {str(Path(__file__).parent / "fake_cuda")!r})
import fake, test_layerwise as tl
lib = fake.build({str(tmp_path)!r})
if lib is None:
    print("skip"); sys.exit(0)
wrapper = tl._fp8_layer()
nbytes = wrapper.moe.gpu_rank_bytes(tl.TP)
keep, control = tl._control()
ranks = [tl.Rank(nbytes), tl.Rank(nbytes)]
transports = tl._transports(control, ranks, nbytes, cuda_device=1)
before = lib.fake_htod_copies()
tl._layer(wrapper, transports, 1, 1)
assert lib.fake_bound_device() == 1, lib.fake_bound_device()
assert lib.fake_htod_copies() - before == tl.TP * tl.E * 4
original = tl._original_bytes()
for rank, r in enumerate(ranks):
    for kind, name in enumerate(tl.KINDS):
        key = f"gpu2.expert3.{{name}}.rank{{rank}}"
        assert torch.equal(r.expert(kind, 3, nbytes), original[key]), key
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    if "skip" in r.stdout:
        pytest.skip("no C compiler for the stand-in driver")
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_a_missing_rank_times_out_and_poisons_every_rank():
    wrapper = _fp8_layer()
    nbytes = wrapper.moe.gpu_rank_bytes(TP)
    keep, control = _control()
    ranks = [Rank(nbytes), Rank(nbytes)]
    transports = _transports(control, ranks, nbytes, timeout_ms=200)
    with pytest.raises(RuntimeError, match="timed out after 200 ms.*joining"):
        wrapper.run_layerwise_fp8_batch(transports[0], 1, 1, E)
    with pytest.raises(RuntimeError, match=r"poisoned \(code=1, rank=0\)"):
        transports[1].join(1, 1, E)
    del keep


def test_bad_arguments_are_refused_clearly():
    wrapper = _fp8_layer()
    nbytes = wrapper.moe.gpu_rank_bytes(TP)
    keep, control = _control()
    r = Rank(nbytes)
    n = kt_kernel_ext.FP8_LAYERWISE_CONTROL_BYTES
    mk = kt_kernel_ext.FP8LayerwiseTransport
    args = (r.host_ptrs(), r.gpu_ptrs(), [], nbytes, E)
    with pytest.raises(ValueError, match="64-byte aligned"):
        mk(control + 8, n, 1, TP, -1, *args)
    with pytest.raises(ValueError, match="at least 8192"):
        mk(control, 1024, 1, TP, -1, *args)
    with pytest.raises(ValueError, match="local_host_ptrs .* must contain 8"):
        mk(control, n, 1, TP, -1, r.host_ptrs()[:4], *args[1:])
    with pytest.raises(ValueError, match="empty on other ranks"):
        mk(control, n, 1, TP, -1, args[0], args[1], [1] * 16, nbytes, E)
    with pytest.raises(ValueError, match="outside TP range"):
        mk(control, n, 2, TP, -1, *args)
    with pytest.raises(ValueError, match="1 through 8"):
        kt_kernel_ext.initialize_fp8_layerwise_control(control, n, 9)
    t1 = mk(control, n, 1, TP, -1, *args)
    with pytest.raises(ValueError, match="rank-zero only"):
        wrapper.run_layerwise_fp8_batch(t1, 1, 1, E)
    somewhere = [[[r.gpu[0].data_ptr()] * 4] * TP] * 2  # [slot][rank][kind]
    t0 = mk(control, n, 0, TP, -1, args[0], args[1], somewhere, [7, 7, 7, 7], E)
    with pytest.raises(ValueError, match="expert_nbytes"):
        wrapper.run_layerwise_fp8_batch(t0, 1, 1, E)
    with pytest.raises(ValueError, match="before this rank joined"):
        t1.wait(5)
    bf16 = make_wrapper(layer_idx=1, e=E, k=2, h=128, i=256, method="BF16",
                        weight_path=str(FIXTURES / "bf16"))  # fmt: skip
    with pytest.raises(RuntimeError, match="block-FP8"):
        bf16.run_layerwise_fp8_batch(t1, 1, 1, E)
    del keep
