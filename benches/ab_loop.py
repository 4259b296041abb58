"""Tight-loop A/B of one method and size between two builds of kt_kernel.

`benches/ab_compare.py` runs the whole `kt bench` (several methods, a DRAM probe and torch
between timed blocks), so the pool parks between calls and the shared machine's bursts land on
whichever build runs then. This check isolates the forward itself: each round starts one fresh
process per build (A, then B), which builds the S1 layers (Qwen3-30B-A3B shape, 3 layers
cycled, 2 threads) from the same seeded random weights, warms up and times `--calls` forwards
back to back. Prints per-round median/min latency and the B / A ratios of the medians and
minima over rounds.

    python benches/ab_loop.py --a BUILD_A --b BUILD_B --method AMXINT4 --tokens 512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

EXPERTS, TOP_K, HIDDEN, INTER, LAYERS = 128, 8, 2048, 768, 3


def child(method: str, gguf_type: str, tokens: int, calls: int) -> None:
    import time

    import torch
    from kt_kernel import KTMoEWrapper
    from kt_kernel.bench import _routing, _write_gguf_layers

    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    weights = []
    for _ in range(LAYERS):
        g = (torch.randn(EXPERTS, INTER, HIDDEN, generator=gen) * 0.02).to(torch.bfloat16)
        u = (torch.randn(EXPERTS, INTER, HIDDEN, generator=gen) * 0.02).to(torch.bfloat16)
        d = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.02).to(torch.bfloat16)
        weights.append((g, u, d))
    folder = tempfile.TemporaryDirectory(prefix="kt-ab-loop-")
    if method == "LLAMAFILE":
        _write_gguf_layers(folder.name, weights, gguf_type, gguf_type, 2)
    layers = []
    for layer, (g, u, d) in enumerate(weights):
        path = folder.name if method == "LLAMAFILE" else ""
        w = KTMoEWrapper(
            layer, EXPERTS, TOP_K, HIDDEN, INTER, None, 2, 1, path, tokens, method=method
        )
        if method == "LLAMAFILE":
            w.load_weights()
        else:
            w.load_weights_from_tensors(g, u, d, torch.arange(EXPERTS))
        layers.append(w)
    del weights
    inputs = []
    for i in range(8):
        x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
        ids, wt = _routing(gen, tokens, EXPERTS, TOP_K)
        inputs.append((i % LAYERS, x, ids, wt))
    for layer, x, ids, wt in inputs[:3]:
        layers[layer].forward(x, ids, wt, None)
    times = []
    for i in range(calls):
        layer, x, ids, wt = inputs[i % len(inputs)]
        t0 = time.perf_counter()
        layers[layer].forward(x, ids, wt, None)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--a", help="folder with build A (the baseline)")
    p.add_argument("--b", help="folder with build B")
    p.add_argument("--method", default="AMXINT8")
    p.add_argument("--gguf-type", default="Q4_K", help="for LLAMAFILE")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--calls", type=int, default=0, help="timed calls (0 = by size)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    calls = args.calls or max(20, min(3000, int(60000 / args.tokens)))
    if args.child:
        child(args.method, args.gguf_type, args.tokens, calls)
        return 0
    if not (args.a and args.b):
        p.error("--a and --b are required")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--method", args.method]
    cmd += ["--gguf-type", args.gguf_type, "--tokens", str(args.tokens), "--calls", str(calls)]
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for side, site in (("A", args.a), ("B", args.b)):
            env = dict(os.environ, PYTHONPATH=site)
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
            med_ms, min_ms = runs[side][-1]["median_ms"], runs[side][-1]["min_ms"]
            print(f"round {r + 1} {side}: median {med_ms:.3f} ms, min {min_ms:.3f} ms")
    med = {s: statistics.median(x["median_ms"] for x in v) for s, v in runs.items()}
    low = {s: min(x["min_ms"] for x in v) for s, v in runs.items()}
    name = args.method + (f"-{args.gguf_type}" if args.method == "LLAMAFILE" else "")
    print(
        f"{name} tokens={args.tokens}: median of medians A {med['A']:.3f} B {med['B']:.3f} "
        f"(B/A {med['B'] / med['A']:.3f}); min A {low['A']:.3f} B {low['B']:.3f} "
        f"(B/A {low['B'] / low['A']:.3f}); {args.rounds} rounds x {calls} calls"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
