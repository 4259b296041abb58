#!/usr/bin/env python3
"""llama.cpp's ggml CPU path against kt-kernel's LLAMAFILE method, one MoE layer, same machine.

The peer is ``benches/llamacpp_peer/moe_layer`` (built by ``benches/llamacpp_peer/setup.sh``):
ggml's ``mul_mat_id`` for gate, up and down of a Qwen3-30B-A3B layer (E=128, top-8, H=2048,
I=768), 3 layers cycled, fresh random routing per call, 2 threads. Q4_K runs twice, from
llama.cpp's CPU_REPACK buffer (its default on AVX2) and from plain memory; the faster of the two
is "the strongest peer". Ours is ``python -m kt_kernel bench --methods LLAMAFILE --no-torch`` on
the same shape. Peer and ours alternate for ``--rounds`` rounds so drifts of this shared machine
hit both; each side keeps its lowest per-round median.

    python benches/compare_llamacpp.py --json peer.json --markdown peer.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (gguf type for kt-kernel, ggml type name for the peer, repack settings to try)
TYPES = {"Q4_K": ("q4_K", (True, False)), "Q8_0": ("q8_0", (False,))}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", nargs="+", choices=sorted(TYPES), default=["Q4_K", "Q8_0"])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--min-seconds", type=float, default=1.5, help="peer: timed seconds per size")
    p.add_argument("--peer-bin", help="built moe_layer (default: run llamacpp_peer/setup.sh)")
    p.add_argument("--json")
    p.add_argument("--markdown")
    return p.parse_args(argv)


def build_peer() -> str:
    out = subprocess.run(
        ["bash", str(HERE / "llamacpp_peer" / "setup.sh")],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout
    return out.strip().splitlines()[-1]


def run_peer(binary: str, args, ggml_type: str, repack: bool) -> list[dict]:
    cmd = [binary, ggml_type, "1" if repack else "0", str(args.threads), str(args.min_seconds)]
    out = subprocess.run(
        cmd + [str(t) for t in args.tokens],
        check=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def run_ours(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ours.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "kt_kernel",
                "bench",
                "--no-torch",
                "--methods",
                "LLAMAFILE",
                "--gguf-type",
                *args.types,
                "--threads",
                str(args.threads),
                "--tokens",
                *[str(t) for t in args.tokens],
                "--json",
                str(path),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return json.loads(path.read_text())


def keep_best(table: dict, key, median_ms: float, best_ms: float):
    """The lowest per-round median and the best single call seen so far."""
    old_median, old_best = table.get(key, (float("inf"), float("inf")))
    table[key] = (min(median_ms, old_median), min(best_ms, old_best))


def main(argv=None) -> int:
    args = parse_args(argv)
    binary = args.peer_bin or build_peer()
    peer: dict = {}  # (type, repack, tokens) -> (median ms, best ms)
    ours: dict = {}  # (type, tokens) -> (median ms, best ms)
    meta = {}
    for round_no in range(args.rounds):
        for gguf_type in args.types:
            ggml_type, repacks = TYPES[gguf_type]
            for repack in repacks:
                for r in run_peer(binary, args, ggml_type, repack):
                    keep_best(peer, (gguf_type, repack, r["tokens"]), r["median_ms"], r["best_ms"])
                    print(
                        f"round {round_no}: ggml {gguf_type} repack={repack} tokens={r['tokens']}: "
                        f"{r['median_ms']:.2f} ms",
                        flush=True,
                    )
        result = run_ours(args)
        meta = result["meta"]
        for r in result["results"]:
            gguf_type = r["impl"].removeprefix("LLAMAFILE-")
            keep_best(ours, (gguf_type, r["tokens"]), r["median_ms"], r["best_ms"])
            print(
                f"round {round_no}: kt-kernel {gguf_type} tokens={r['tokens']}: "
                f"{r['median_ms']:.2f} ms",
                flush=True,
            )

    rows = []
    for gguf_type in args.types:
        for tokens in args.tokens:
            candidates = {
                repack: peer[(gguf_type, repack, tokens)] for repack in TYPES[gguf_type][1]
            }
            strongest = min(candidates, key=lambda rp: candidates[rp][0])
            peer_ms, peer_best = candidates[strongest]
            ours_ms, ours_best = ours[(gguf_type, tokens)]
            rows.append(
                {
                    "type": gguf_type,
                    "tokens": tokens,
                    "peer_median_ms": peer_ms,
                    "peer_best_ms": peer_best,
                    "peer_buffer": "CPU_REPACK" if strongest else "CPU",
                    "peer_other_buffers_ms": {
                        ("CPU_REPACK" if rp else "CPU"): v[0]
                        for rp, v in candidates.items()
                        if rp != strongest
                    },
                    "ours_median_ms": ours_ms,
                    "ours_best_ms": ours_best,
                    "speedup": peer_ms / ours_ms,
                }
            )
    report = {
        "meta": {**meta, "rounds": args.rounds, "peer": "ggml from llama-cpp-python 0.3.36 sdist"},
        "results": rows,
    }
    lines = [
        "| type | tokens | llama.cpp (ggml) median ms | its buffer (other buffer ms) "
        "| ours median ms | speed-up of ours (llama.cpp ÷ ours, medians) "
        "| best ms llama.cpp / ours |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        other = ", ".join(f"{k} {v:.2f}" for k, v in r["peer_other_buffers_ms"].items()) or "-"
        lines.append(
            f"| {r['type']} | {r['tokens']} | {r['peer_median_ms']:.2f} "
            f"| {r['peer_buffer']} ({other}) | {r['ours_median_ms']:.2f} | {r['speedup']:.2f}× | "
            f"{r['peer_best_ms']:.2f} / {r['ours_best_ms']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
