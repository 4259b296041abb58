"""Tight-loop forward timing of several methods in one process, rounds alternating.

Builds the S1 layers (Qwen3-30B-A3B shape: 128 experts, top-8, H 2048, I 768, 3 layers cycled,
`--threads`, default 2) for each method from the same seeded bf16 weights (online
quantization), then per round measures the DRAM read bandwidth with the engine's probe (on as
many threads) and times `--calls` forwards of each method back to back (fresh random routing
per call). Prints per-round medians and the weight bytes streamed per second (distinct
experts × the method's bytes per expert).

    python benches/decode_loop.py --methods FP8 RAWINT4 MXFP4 --tokens 1 --calls 200
"""

from __future__ import annotations

import argparse
import statistics
import time

import kt_kernel
import torch
from kt_kernel import KTMoEWrapper
from kt_kernel.bench import _routing, prefetch_summary, settle_prefetch
from kt_kernel.experts_base import BaseMoEWrapper

E, K, H, INTER, L = 128, 8, 2048, 768, 3
WEIGHTS = 3 * H * INTER
# Bytes per expert as stored (weights + scales).
BYTES = {
    "BF16": 2 * WEIGHTS,
    "AMXINT8": WEIGHTS + (2 * INTER + H) * 8,
    "AMXINT4": WEIGHTS // 2 + (2 * INTER + H) * 8,
    "FP8": WEIGHTS + 3 * (H // 128) * (INTER // 128) * 4,
    "FP8_PERCHANNEL": WEIGHTS + (2 * INTER + H) * 4,
    "RAWINT4": WEIGHTS // 2 + WEIGHTS // 32 * 2,
    "GPTQ_INT4": WEIGHTS // 2 + WEIGHTS // 128 * 2,
    "MXFP4": WEIGHTS // 2 + WEIGHTS // 32,
    "NVFP4": WEIGHTS // 2 + WEIGHTS // 16,
    "MXFP8": WEIGHTS + WEIGHTS // 32,
}


def s1_weights(gen: torch.Generator) -> list:
    """Seeded bf16 (gate, up, down) expert weights of the L layers."""
    shapes = [(E, INTER, H), (E, INTER, H), (E, H, INTER)]
    return [
        tuple((torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for s in shapes)
        for _ in range(L)
    ]


def s1_layers(method: str, weights: list, tokens: int = 1, threads: int = 2) -> list:
    """One wrapper of ``threads`` threads per layer of ``weights``, quantized online to
    ``method``."""
    layers = []
    for li, (g, u, d) in enumerate(weights):
        w = KTMoEWrapper(
            layer_idx=li,
            num_experts=E,
            num_experts_per_tok=K,
            hidden_size=H,
            moe_intermediate_size=INTER,
            gpu_experts_mask=None,
            cpuinfer_threads=threads,
            threadpool_count=1,
            weight_path="",
            chunked_prefill_size=max(512, tokens),
            method=method,
        )
        w.load_weights_from_tensors(g, u, d, torch.arange(E))
        layers.append(w)
    return layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["FP8", "RAWINT4", "MXFP4"])
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="worker threads (and the probe's)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = s1_weights(gen)
    layers = {}
    for m in args.methods:
        layers[m] = s1_layers(m, weights, args.tokens, args.threads)
        settle_prefetch(layers[m], gen)
        # The tuner's choice moves these rows by up to 15% (the 4-bit kernels on an Emerald
        # Rapids VM: 4 KiB ahead into L2 82-88% of DRAM, into L1 74-77%).
        print(f"{m}: kernel {layers[m][0].moe.kernel}; {prefetch_summary([m])}", flush=True)
    del weights
    engine = BaseMoEWrapper._cpu_infer.engine
    info = kt_kernel.cpu_info()
    print(f"{info['brand']} | variant {info['variant']} | tokens {args.tokens}", flush=True)
    x = torch.randn(args.tokens, H, generator=gen).to(torch.bfloat16)
    for rnd in range(args.rounds):
        dram = engine.measure_read_bandwidth(1 << 30, 3)
        # The cores' int8 rate in the same moment: on a shared VM it drops while another
        # tenant shares the cores, which slows a decode whose kernel does real work per byte.
        int8 = engine.measure_peak_gflops("int8", 100) or 0.0
        print(f"round {rnd}: DRAM {dram:.1f} GB/s, int8 {int8:.0f} GOP/s", flush=True)
        for m in args.methods:
            times, distinct = [], []
            # Routings drawn before the timed calls: torch's top-k leaves its OpenMP threads
            # spinning, which took a core from calls made right after it.
            routings = [_routing(gen, args.tokens, E, K) for _ in range(args.calls)]
            for c, (ids, wt) in enumerate(routings):
                w = layers[m][c % L]
                t0 = time.perf_counter()
                w.forward(x, ids, wt, None)
                times.append(time.perf_counter() - t0)
                distinct.append(len(set(ids.flatten().tolist())))
            skip = min(10, len(times) // 2)
            med = statistics.median(times[skip:])
            gbps = statistics.mean(distinct) * BYTES[m] / med / 1e9
            print(
                f"round {rnd} {m:15s} {med * 1e3:8.3f} ms  {gbps:5.1f} GB/s "
                f"({100 * gbps / dram:3.0f}% of DRAM {dram:.1f} GB/s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
