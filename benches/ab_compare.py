"""Same-run A/B of the layer benchmark between two builds of kt_kernel.

Each build is a folder holding an installed `kt_kernel` (``pip install --target``). Rounds
alternate A, B, A, B, ...; each round runs ``python -m kt_kernel bench --no-torch`` in a fresh
process with that folder first on ``PYTHONPATH``, so both see the same machine minutes. The
table gives, per implementation and token count, the median over rounds of each round's median
latency, and B / A (above 1.0: B is slower).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run_bench(site: str, bench_args: list[str]) -> tuple[str, list[dict]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        env = dict(os.environ, PYTHONPATH=site)
        check = [sys.executable, "-c", "import kt_kernel; print(kt_kernel.__file__)"]
        where = subprocess.run(check, env=env, capture_output=True, text=True, check=True)
        cmd = [sys.executable, "-m", "kt_kernel", "bench", "--no-torch", "--json", out]
        subprocess.run(cmd + bench_args, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return where.stdout.strip(), json.load(f)["results"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--a", required=True, help="folder with build A (the baseline)")
    p.add_argument("--b", required=True, help="folder with build B")
    p.add_argument("--a-name", default="A")
    p.add_argument("--b-name", default="B")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--markdown", help="write the table here")
    p.add_argument("--json", help="write every round's rows here")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: kt bench arguments")
    args = p.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    medians: dict[str, dict[tuple[str, int], list[float]]] = {"A": {}, "B": {}}
    raw = []
    for r in range(args.rounds):
        for side, site in (("A", args.a), ("B", args.b)):
            where, rows = run_bench(site, bench_args)
            if not where.startswith(os.path.abspath(site)):
                raise SystemExit(f"build {side} imported kt_kernel from {where}, not {site}")
            for row in rows:
                key = (row["impl"], row["tokens"])
                medians[side].setdefault(key, []).append(row["median_ms"])
            raw.append({"round": r, "side": side, "rows": rows})
            print(f"round {r + 1}/{args.rounds} {side} done", file=sys.stderr, flush=True)
    lines = [
        f"| impl | tokens | {args.a_name} ms | {args.b_name} ms | {args.b_name} / {args.a_name} |",
        "|---|---|---|---|---|",
    ]
    worst = 0.0
    for key in sorted(medians["A"], key=lambda k: (k[0], k[1])):
        a = statistics.median(medians["A"][key])
        b = statistics.median(medians["B"].get(key, [float("nan")]))
        worst = max(worst, b / a)
        lines.append(f"| {key[0]} | {key[1]} | {a:.3f} | {b:.3f} | {b / a:.3f} |")
    lines.append("")
    lines.append(
        f"Medians over {args.rounds} alternating rounds of each round's median; "
        f"worst {args.b_name} / {args.a_name}: {worst:.3f}."
    )
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
