"""Online quantization speed: ``load_weights_from_tensors`` of one S1 layer (Qwen3-30B-A3B:
128 experts, H 2048, I 768) from bf16 tensors, per method, a few loads each, beside a torch
per-row FP8 quantization of the same tensors in the same run (row amax, divide, cast to
``float8_e4m3fn``, on as many threads).

    python benches/quantize_load.py [METHODS ...] [--loads 3] [--threads 2]
        [--json FILE] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from kt_kernel import KTMoEWrapper

E, H, INTER = 128, 2048, 768
METHODS = [
    "BF16",
    "AMXINT8",
    "AMXINT4",
    "FP8",
    "FP8_PERCHANNEL",
    "RAWINT4",
    "GPTQ_INT4",
    "MXFP4",
    "NVFP4",
    "MXFP8",
]


def torch_fp8_rows(tensors) -> None:
    """The reference: each row scaled by its amax / 448 and cast to E4M3."""
    for t in tensors:
        for e in range(t.shape[0]):
            w = t[e].float()
            scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0
            (w / scale).to(torch.float8_e4m3fn)


def load_once(method: str, tensors, threads: int, layer: int) -> float:
    w = KTMoEWrapper(
        layer_idx=layer,
        num_experts=E,
        num_experts_per_tok=8,
        hidden_size=H,
        moe_intermediate_size=INTER,
        gpu_experts_mask=None,
        cpuinfer_threads=threads,
        threadpool_count=1,
        weight_path="",
        chunked_prefill_size=512,
        method=method,
    )
    t0 = time.perf_counter()
    w.load_weights_from_tensors(*tensors, torch.arange(E))
    took = time.perf_counter() - t0
    del w
    return took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("methods", nargs="*", default=METHODS)
    p.add_argument("--loads", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--markdown")
    args = p.parse_args()
    if args.loads < 1 or args.threads < 1:
        p.error("--loads and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    gate, up = ((torch.randn(E, INTER, H, generator=g) * 0.02).to(torch.bfloat16) for _ in "gu")
    down = (torch.randn(E, H, INTER, generator=g) * 0.02).to(torch.bfloat16)
    tensors = (gate, up, down)
    gib = 3 * E * H * INTER * 2 / 2**30
    # Warm-up: the first touch of torch's scratch memory and of a layer's (slow on a VM).
    torch_fp8_rows(tensors)
    load_once(args.methods[0], tensors, args.threads, 0)
    rows = []
    for method in args.methods:
        times, ref = [], []
        # Alternate each load with the reference so both see the same phase of the machine.
        for n in range(args.loads):
            times.append(load_once(method, tensors, args.threads, n))
            t0 = time.perf_counter()
            torch_fp8_rows(tensors)
            ref.append(time.perf_counter() - t0)
        row = {
            "method": method,
            "loads_s": [round(t, 3) for t in times],
            "median_s": statistics.median(times),
            "best_s": min(times),
            "torch_fp8_median_s": statistics.median(ref),
        }
        rows.append(row)
        shown = ", ".join(f"{t:.2f}" for t in times)
        print(
            f"{method}: {shown} s per load ({gib / row['best_s']:.2f} GiB of bf16 per s at best; "
            f"torch per-row FP8 {row['torch_fp8_median_s']:.2f} s)"
        )
    import kt_kernel
    from compare_original import _cpu_model

    machine = {
        "cpu": _cpu_model(),
        "variant": getattr(kt_kernel, "__cpu_variant__", "?"),
        "threads": args.threads,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "gib_bf16": gib, "results": rows}, f, indent=1)
    if args.markdown:
        lines = [
            f"{machine['cpu']}, {args.threads} threads, variant {machine['variant']}; "
            f"{args.loads} loads per method, each followed by the torch reference.",
            "",
            "| method | load s, median (best) | GiB of bf16 per s, median | torch per-row FP8 s, "
            "median | × torch |",
            "|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['method']} | {r['median_s']:.3f} ({r['best_s']:.3f}) | "
                f"{gib / r['median_s']:.2f} | {r['torch_fp8_median_s']:.3f} | "
                f"{r['torch_fp8_median_s'] / r['median_s']:.2f} |"
            )
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
