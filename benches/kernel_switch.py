"""Where the decode kernels should hand over to the many-row (GEMM) kernels, measured.

Runs ``python -m kt_kernel bench`` once per candidate value of a switch variable, in
alternating rounds (one process per value and round), and prints the median time per token of
every method and size under each value, the value that minimises the summed time over the
sizes, and how far the current default is from it.

    python benches/kernel_switch.py --var KT_KERNEL_AMX_MIN_ROWS --values 2 4 8 16 \\
        --methods BF16 AMXINT8 AMXINT4 --tokens 16 32 64 128

The switch that can be swept: ``KT_KERNEL_AMX_MIN_ROWS`` (rows per expert from which the AMX
tile kernels take an expert, AMX CPUs; set, it overrides every method's default). The routing
of S1 (128 experts, top-8) gives an expert about tokens/16 rows on average, so 16–128 tokens
cover 1–8 rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path


def run_once(var: str, value: str, args, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "kt_kernel", "bench", "--no-torch", "--json", str(out)]
    cmd += ["--methods", *args.methods, "--tokens", *map(str, args.tokens)]
    cmd += ["--layers", str(args.layers), "--repeats", str(args.repeats)]
    env = {**os.environ, var: value}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{var}={value}: bench failed\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return json.loads(out.read_text())["results"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--var", required=True, help="the switch variable to sweep")
    p.add_argument("--values", nargs="+", required=True)
    p.add_argument("--default", help="the current default (marked in the table)")
    p.add_argument("--methods", nargs="+", required=True)
    p.add_argument("--tokens", nargs="+", type=int, default=[16, 32, 64, 128])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--repeats", type=int, default=0, help="timed calls per size (0 = auto)")
    p.add_argument("--markdown", help="also write the table to this file")
    args = p.parse_args()
    # (value, method, tokens) -> medians of the rounds (ms per call)
    times: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            order = args.values if rnd % 2 == 0 else list(reversed(args.values))
            for value in order:
                rows = run_once(args.var, value, args, Path(tmp) / "bench.json")
                for row in rows:
                    times[(value, row["impl"], row["tokens"])].append(row["median_ms"])
                print(f"round {rnd} {args.var}={value} done", file=sys.stderr, flush=True)
    lines = [
        f"Sweep of `{args.var}` over {', '.join(args.values)} ({args.rounds} alternating "
        f"rounds, median of the rounds' medians; ms per call, lower is better).",
        "",
        "| method | tokens | " + " | ".join(f"{args.var}={v}" for v in args.values) + " |",
        "|---|---|" + "---|" * len(args.values),
    ]
    best_of: dict[str, str] = {}
    for m in args.methods:
        totals = {}
        for t in args.tokens:
            med = {v: statistics.median(times[(v, m, t)]) for v in args.values}
            fastest = min(med.values())
            cells = [
                f"**{med[v]:.2f}**"
                if med[v] == fastest
                else f"{med[v]:.2f} ({med[v] / fastest:.2f}×)"
                for v in args.values
            ]
            lines.append(f"| {m} | {t} | " + " | ".join(cells) + " |")
        for v in args.values:
            totals[v] = sum(statistics.median(times[(v, m, t)]) / t for t in args.tokens)
        best_of[m] = min(totals, key=totals.get)
        if args.default is not None and args.default in totals:
            gap = totals[args.default] / totals[best_of[m]]
            lines.append(
                f"| {m} | best | {args.var}={best_of[m]} (summed ms per token); the default "
                f"{args.default} is {gap:.3f}× that |" + " |" * (len(args.values) - 1)
            )
        else:
            lines.append(
                f"| {m} | best | {args.var}={best_of[m]} |" + " |" * (len(args.values) - 1)
            )
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
