"""Online quantization speed: ``load_weights_from_tensors`` of one S1 layer (Qwen3-30B-A3B:
128 experts, H 2048, I 768) from bf16 tensors, per method, a few loads each.

    python benches/quantize_load.py RAWINT4 GPTQ_INT4 MXFP4 NVFP4 [--loads 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from kt_kernel import KTMoEWrapper

E, H, INTER = 128, 2048, 768


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("methods", nargs="+")
    p.add_argument("--loads", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    gate, up = ((torch.randn(E, INTER, H, generator=g) * 0.02).to(torch.bfloat16) for _ in "gu")
    down = (torch.randn(E, H, INTER, generator=g) * 0.02).to(torch.bfloat16)
    gib = 3 * E * H * INTER * 2 / 2**30
    for method in args.methods:
        times = []
        for n in range(args.loads):
            w = KTMoEWrapper(
                layer_idx=n,
                num_experts=E,
                num_experts_per_tok=8,
                hidden_size=H,
                moe_intermediate_size=INTER,
                gpu_experts_mask=None,
                cpuinfer_threads=args.threads,
                threadpool_count=1,
                weight_path="",
                chunked_prefill_size=512,
                method=method,
            )
            t0 = time.perf_counter()
            w.load_weights_from_tensors(gate, up, down, torch.arange(E))
            times.append(time.perf_counter() - t0)
            del w
        shown = ", ".join(f"{t:.2f}" for t in times)
        print(f"{method}: {shown} s per load ({gib / min(times):.2f} GiB of bf16 per s at best)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
