"""GB/s written by write_weight_scale_to_buffer (one expert into every GPU rank's buffers) for
the methods that have it, on an S1 (Qwen3-30B-A3B) expert shape.

    python benches/write_weight_scale_bench.py [--experts 8] [--threads 2] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from kt_kernel import KTMoEWrapper


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument(
        "--methods",
        nargs="+",
        default=[
            "BF16",
            "FP8",
            "FP8_PERCHANNEL",
            "RAWINT4",
            "GPTQ_INT4",
            "MXFP4",
            "NVFP4",
            "MXFP8",
        ],
    )
    args = p.parse_args()
    e, h, i = args.experts, args.hidden, args.intermediate
    gen = torch.Generator().manual_seed(0)

    def weights(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    gate, up, down = weights(e, i, h), weights(e, i, h), weights(e, h, i)
    print("| method | GPU ranks | MB per expert | median ms | GB/s written |")
    print("|---|---|---|---|---|")
    for layer, method in enumerate(args.methods):
        w = KTMoEWrapper(layer, e, 2, h, i, None, args.threads, 1, "", 16, method=method)
        w.load_weights_from_tensors(gate, up, down, torch.arange(e))
        for gpu_tp in (1, 2):
            sizes = w.moe.gpu_rank_bytes(gpu_tp)
            bufs = [[torch.empty(n, dtype=torch.uint8) for _ in range(gpu_tp)] for n in sizes]
            ptrs = [[b.data_ptr() for b in ranks] for ranks in bufs]
            total = sum(sizes) * gpu_tp
            times = []
            for rep in range(args.repeats + 2):
                t0 = time.perf_counter()
                w.submit_write_weight_scale_to_buffer(gpu_tp, rep % e, *ptrs)
                w.sync_write_weight_scale_to_buffer()
                times.append(time.perf_counter() - t0)
            med = statistics.median(times[2:])
            print(
                f"| {method} | {gpu_tp} | {total / 1e6:.2f} | {med * 1e3:.2f} | "
                f"{total / med / 1e9:.2f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
