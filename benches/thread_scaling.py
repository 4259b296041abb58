"""1 thread against 2 threads, per method and batch size, with the layer benchmark.

Runs ``python -m kt_kernel bench --threads T`` for T = 1 and 2 in alternating rounds (the same
synthetic S1 layers, the same seed), keeps each row's lowest per-round median, and writes a
table: milliseconds at each thread count, the speed-up, the share of the DRAM read bandwidth
measured by the same run at that thread count (decode) or the multiple of the compute floor
(prefill), and whether any size takes longer than the next larger one.

    python benches/thread_scaling.py [--methods BF16 AMXINT8 ...] [--rounds 2]
        [--json bench-results/threads.json] [--markdown bench-results/threads.md]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_METHODS = ["BF16", "AMXINT8", "AMXINT4", "FP8", "RAWINT4", "MXFP4"]
TOKENS = [1, 4, 32, 128, 512]


def run_bench(threads: int, methods: list[str], tokens: list[int], out: Path) -> dict:
    cmd = [sys.executable, "-m", "kt_kernel", "bench", "--threads", str(threads), "--no-torch"]
    cmd += ["--methods", *methods, "--tokens", *map(str, tokens), "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS)
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--markdown")
    args = p.parse_args()
    best: dict[tuple[str, int, int], dict] = {}
    meta: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for threads in (1, 2) if r % 2 == 0 else (2, 1):
                print(f"round {r + 1}/{args.rounds}: {threads} thread(s)", flush=True)
                data = run_bench(threads, args.methods, args.tokens, Path(tmp) / "b.json")
                meta[threads] = data["meta"]
                for row in data["results"]:
                    key = (row["impl"], row["tokens"], threads)
                    if key not in best or row["median_ms"] < best[key]["median_ms"]:
                        best[key] = row
    impls = list(dict.fromkeys(k[0] for k in best))
    lines = [
        "| method | tokens | 1 thread ms | 2 threads ms | 2 threads / 1 thread speed-up | "
        "1 thread: % of DRAM or × floor | 2 threads: % of DRAM or × floor |",
        "|---|---|---|---|---|---|---|",
    ]
    slower_than_larger = []
    for impl in impls:
        for t in args.tokens:
            one, two = best.get((impl, t, 1)), best.get((impl, t, 2))
            if not one or not two:
                continue

            def share(row):
                if row["floor_bound"] == "memory":
                    return f"{100 * row['frac_dram_now']:.0f}% of {row['dram_now_gbps']:.1f} GB/s"
                return f"{row['x_floor']:.2f}× ({row['compute_family']})"

            lines.append(
                f"| {impl} | {t} | {one['median_ms']:.2f} | {two['median_ms']:.2f} | "
                f"{one['median_ms'] / two['median_ms']:.2f}× | {share(one)} | {share(two)} |"
            )
        for threads in (1, 2):
            sizes = [s for s in args.tokens if (impl, s, threads) in best]
            for small, large in zip(sizes, sizes[1:], strict=False):
                a, b = best[(impl, small, threads)], best[(impl, large, threads)]
                if a["median_ms"] > b["median_ms"]:
                    slower_than_larger.append(
                        f"{impl} at {threads} thread(s): {small} tokens {a['median_ms']:.2f} ms "
                        f"> {large} tokens {b['median_ms']:.2f} ms"
                    )
    one_meta = meta.get(1, {})
    limits1 = one_meta.get("limits", {})
    limits2 = meta.get(2, {}).get("limits", {})
    header = (
        f"{one_meta.get('cpu', '?')}, {args.rounds} alternating rounds, each row the lower of "
        f"its per-round medians. DRAM read measured by the same runs: "
        f"{limits1.get('dram_read_gbps', 0):.1f} GB/s with 1 thread, "
        f"{limits2.get('dram_read_gbps', 0):.1f} GB/s with 2. The share is of the bandwidth "
        f"sampled between the row's blocks; rows bound by compute give the multiple of "
        f"their floor instead."
    )
    verdict = (
        "No size takes longer than the next larger one."
        if not slower_than_larger
        else "Sizes that take longer than the next larger one: "
        + "; ".join(slower_than_larger)
        + "."
    )
    table = header + "\n\n" + "\n".join(lines) + "\n\n" + verdict + "\n"
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.json:
        rows = [dict(row, threads=k[2]) for k, row in best.items()]
        Path(args.json).write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
