"""A CPU-only decode step in miniature: a torch op on torch's threads, then a 1-token layer call.

Builds 3 S1 layers (128 experts, top-8, H 2048, I 768) of METHOD from random bf16 weights and
alternates `A @ x` (a 4096 × 2048 fp32 matmul on torch's threads) with one `forward` per layer,
printing the median time of each part and the mean step per round. Shows how the workers' spin
(`KT_SPIN_US`) and torch's OpenMP spinning (`OMP_WAIT_POLICY`) share the cores:

    python benches/decode_with_torch.py MXFP4
    OMP_WAIT_POLICY=PASSIVE python benches/decode_with_torch.py MXFP4
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from decode_loop import E as EXPERTS
from decode_loop import H as HIDDEN
from decode_loop import K as TOP_K
from decode_loop import L as LAYERS
from decode_loop import s1_layers, s1_weights
from kt_kernel.bench import _routing, settle_prefetch


def main() -> None:
    method = sys.argv[1] if len(sys.argv) > 1 else "MXFP4"
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    layers = s1_layers(method, s1_weights(gen))
    settle_prefetch(layers, gen)
    x = torch.randn(1, HIDDEN, generator=gen).to(torch.bfloat16)
    a = torch.randn(4096, HIDDEN)
    for rnd in range(3):
        routings = [_routing(gen, 1, EXPERTS, TOP_K) for _ in range(600)]
        torch_times, moe_times = [], []
        start = time.perf_counter()
        for c, (ids, wt) in enumerate(routings):
            t0 = time.perf_counter()
            a @ x.float().T
            t1 = time.perf_counter()
            layers[c % LAYERS].forward(x, ids, wt, None)
            t2 = time.perf_counter()
            torch_times.append(t1 - t0)
            moe_times.append(t2 - t1)
        step = (time.perf_counter() - start) / len(routings)
        print(
            f"{method} round {rnd}: torch op {statistics.median(torch_times) * 1e3:.3f} ms, "
            f"layer {statistics.median(moe_times) * 1e3:.3f} ms, step {step * 1e3:.3f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
