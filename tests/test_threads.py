"""Idle workers park: a process holding loaded layers uses no CPU between calls."""

from __future__ import annotations

import resource
import time

import torch
from conftest import random_routing


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def test_idle_process_uses_no_cpu(small_layer):
    w, _ = small_layer
    x = torch.randn(8, 64)
    ids, wt = random_routing(8, 8, 2)
    for _ in range(20):
        w.forward(x, ids, wt, None)
    time.sleep(0.3)  # past the short post-job spin
    before, t0 = _cpu_seconds(), time.perf_counter()
    time.sleep(1.0)
    used, wall = _cpu_seconds() - before, time.perf_counter() - t0
    # A spinning worker would use ~1 s per second; parked threads use next to nothing.
    assert used < 0.1 * wall, f"{used:.3f} s CPU while idle for {wall:.2f} s"


def test_forked_child_builds_its_own_engine(small_layer):
    import multiprocessing as mp

    from conftest import make_wrapper, random_experts, reference_moe, rel_l2

    w, _ = small_layer
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child():
        try:
            # The parent's wrapper cannot run here: its engine's thread was not forked.
            try:
                w.forward(torch.randn(2, 64), *random_routing(2, 8, 2), None)
                q.put("parent wrapper ran in the child?!")
                return
            except RuntimeError as e:
                assert "fork" in str(e)
            g, u, d = random_experts(8, 64, 64, seed=77)
            w2 = make_wrapper(layer_idx=90, e=8, k=2)
            w2.load_weights_from_tensors(g, u, d)
            x = torch.randn(3, 64)
            ids, wt = random_routing(3, 8, 2)
            q.put(rel_l2(w2.forward(x, ids, wt, None), reference_moe(x, ids, wt, g, u, d)))
        except Exception as e:  # reported to the parent
            q.put(repr(e))

    p = ctx.Process(target=child)
    p.start()
    p.join(60)
    assert p.exitcode == 0
    result = q.get(timeout=5)
    assert isinstance(result, float) and result < 5e-3, result
