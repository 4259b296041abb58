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
