"""GB/s written by write_weight_scale_to_buffer (one expert into every GPU rank's buffers) for
the methods that have it, on an S1 (Qwen3-30B-A3B) expert shape, against a plain copy of as
many bytes (torch, same threads) in the same run, and against the original kt-kernel; and the
time `load_weights` takes to load the layer's native checkpoint from the page cache.

    python benches/write_weight_scale_bench.py [--experts 8] [--threads 2] [--repeats 20]

The layer is loaded from a native checkpoint of each method (written once into
`--weights-dir` by tests/native_checkpoints.py), since the original has no online
quantization for these methods. With `--original` (run with the original's venv) the same
files go through the original; `--json` keeps each run's figures and `--merge OURS ORIGINAL`
prints the table of both. Bytes written are found with a sentinel fill (the original has no
size query).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
METHODS = ["BF16", "FP8", "FP8_PERCHANNEL", "RAWINT4", "GPTQ_INT4", "MXFP4", "NVFP4", "MXFP8"]
SENTINEL = 0xA5


def checkpoint(folder: Path, method: str, e: int, h: int, i: int) -> Path:
    """`folder/<method>/`: one layer (index 0) of seeded weights in `method`'s native format."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    import native_checkpoints as nc
    from safetensors.torch import save_file

    out = folder / method.lower()
    if (out / "model.safetensors").exists():
        return out
    gen = torch.Generator().manual_seed(0)

    def weights(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    gate, up, down = weights(e, i, h), weights(e, i, h), weights(e, h, i)
    if method == "BF16":
        out.mkdir(parents=True, exist_ok=True)
        tensors = {
            f"{nc.prefix(method, 0, x, p)}.weight": m[x].contiguous()
            for p, m in (("gate", gate), ("up", up), ("down", down))
            for x in range(e)
        }
        save_file(tensors, str(out / "model.safetensors"))
    else:
        nc.write_checkpoint(method, out, 0, gate, up, down)
    return out


def copy_ms(nbytes: int, repeats: int, sources: int = 8) -> float:
    """Median ms of a torch copy of `nbytes` from rotating sources (as the experts rotate)."""
    srcs = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8) for _ in range(sources)]
    dst = torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for rep in range(repeats + 2):
        t0 = time.perf_counter()
        dst.copy_(srcs[rep % sources])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e3


def read_ms(file: Path, repeats: int = 5) -> float:
    """Median ms of a 1-thread page-cache read of `file` (`load_loop.read_gbps`)."""
    from load_loop import read_gbps

    size = file.stat().st_size
    return statistics.median(size / read_gbps([str(file)], 1)[0] / 1e6 for _ in range(repeats))


def measure(args) -> dict:
    if args.original:
        sys.path.insert(0, str(HERE))
        import compare_original

        compare_original.patch_for_cpu_only_original(torch)
        # The original runs NVFP4 (group 16) only with its AVX2 FP4 kernels.
        os.environ.setdefault("KT_MXFP4_BACKEND", "avx2")
    from kt_kernel import KTMoEWrapper

    torch.set_num_threads(args.threads)
    e, h, i = args.experts, args.hidden, args.intermediate
    # Touch twice the largest layer's memory once: a VM's first touch of memory new to the
    # process is several times slower than later reuse, and would land on the first method.
    torch.ones(2 * e * 3 * h * i * 2 // 4, dtype=torch.float32).sum()
    import kt_kernel
    from compare_original import _cpu_model

    variant = getattr(kt_kernel, "__cpu_variant__", "?")
    results = {"_machine": {"cpu": _cpu_model(), "variant": variant, "threads": args.threads}}
    for method in args.methods:
        folder = checkpoint(args.weights_dir, method, e, h, i)
        file = folder / "model.safetensors"
        try:
            loads = []
            for _ in range(args.loads + 1):
                w = KTMoEWrapper(
                    0, e, 2, h, i, None, args.threads, 1, str(folder), 16, method=method
                )
                t0 = time.perf_counter()
                w.load_weights(torch.arange(e))
                loads.append(time.perf_counter() - t0)
        except Exception as err:  # the original lacks some methods on some CPUs
            results[method] = {"error": f"{type(err).__name__}: {err}"[:200]}
            continue
        results[method] = {
            "load_ms": statistics.median(loads[1:]) * 1e3,
            "file_bytes": file.stat().st_size,
            "read_ms": read_ms(file),
        }
        for gpu_tp in (1, 2):
            # Every buffer as large as a whole expert; the sentinel shows what was written.
            full = 3 * h * i * 2
            bufs = [
                [torch.full((full,), SENTINEL, dtype=torch.uint8) for _ in range(gpu_tp)]
                for _ in range(4)
            ]
            ptrs = [[b.data_ptr() for b in ranks] for ranks in bufs]
            try:
                w.submit_write_weight_scale_to_buffer(gpu_tp, 0, *ptrs)
                w.sync_write_weight_scale_to_buffer()
            except Exception as err:
                results[f"{method}/{gpu_tp}"] = {"error": f"{type(err).__name__}: {err}"[:200]}
                continue
            written = 0
            for ranks in bufs:
                for b in ranks:
                    nz = (b != SENTINEL).nonzero()
                    written += int(nz.max()) + 1 if len(nz) else 0
            times = []
            for rep in range(args.repeats + 2):
                t0 = time.perf_counter()
                w.submit_write_weight_scale_to_buffer(gpu_tp, rep % e, *ptrs)
                w.sync_write_weight_scale_to_buffer()
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times[2:]) * 1e3
            results[f"{method}/{gpu_tp}"] = {
                "bytes": written,
                "ms": ms,
                "copy_ms": copy_ms(written, args.repeats),
            }
        del w
    return results


def header(columns: list[str], original: dict | None, original_columns: list[str]) -> list[str]:
    """A markdown table's head and rule, with the original's columns when it ran."""
    if original is not None:
        columns = columns + original_columns
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def versus(o: dict, field: str, ours_ms: float, digits: int, note: str = "") -> str:
    """The original's cells of a row: its time `o[field]` and our speed-up, or why it did
    not run."""
    if field not in o:
        why = o.get("error", "not measured").replace("|", "/")
        return f" | not run: {why} | –"
    return f" | {o[field]:.{digits}f}{note} | {o[field] / ours_ms:.1f}×"


def table(ours: dict, original: dict | None) -> str:
    lines = header(
        ["method", "GPU ranks", "MB per expert", "median ms", "GB/s written", "ms × a copy's"],
        original,
        ["original ms", "speed-up over the original"],
    )
    for key, r in ours.items():
        if "/" not in key:
            continue
        method, tp = key.split("/")
        if "error" in r:
            lines.append(f"| {method} | {tp} | | {r['error'].replace('|', '/')} | | |")
            continue
        row = (
            f"| {method} | {tp} | {r['bytes'] / 1e6:.2f} | {r['ms']:.2f} | "
            f"{r['bytes'] / r['ms'] / 1e6:.2f} | {r['ms'] / r['copy_ms']:.2f}"
        )
        if original is not None:
            o = original.get(key) or original.get(method) or {}
            same = (
                "" if o.get("bytes", r["bytes"]) == r["bytes"] else f" ({o['bytes'] / 1e6:.2f} MB)"
            )
            row += versus(o, "ms", r["ms"], 2, same)
        lines.append(row + " |")
    return "\n".join(lines)


def load_table(ours: dict, original: dict | None) -> str:
    lines = header(
        [
            "method",
            "checkpoint MB",
            "load ms (median)",
            "GB/s",
            "× the page-cache read of the file (1 thread)",
        ],
        original,
        ["original load ms", "speed-up over the original"],
    )
    for method, r in ours.items():
        if "/" in method or "load_ms" not in r:
            continue
        mb, ms = r["file_bytes"] / 1e6, r["load_ms"]
        row = f"| {method} | {mb:.1f} | {ms:.1f} | {mb / ms:.2f} | {r['read_ms'] / ms:.2f}"
        if original is not None:
            row += versus(original.get(method, {}), "load_ms", ms, 1)
        lines.append(row + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--loads", type=int, default=5, help="timed loads per method")
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    p.add_argument(
        "--weights-dir",
        type=Path,
        default=Path.home() / ".cache" / "kt-kernel" / "wwsb-ckpt",
        help="native checkpoints, written here once",
    )
    p.add_argument("--original", action="store_true", help="run the original kt-kernel")
    p.add_argument("--json", type=Path, help="write this run's figures here")
    p.add_argument("--merge", nargs=2, type=Path, metavar=("OURS", "ORIGINAL"))
    args = p.parse_args()
    for name in ("experts", "hidden", "intermediate", "threads", "repeats", "loads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.merge:
        ours = json.loads(args.merge[0].read_text())
        original = json.loads(args.merge[1].read_text()) if args.merge[1].exists() else None
        if "_machine" in ours:
            m = ours["_machine"]
            theirs = (original or {}).get("_machine", {}).get("variant")
            print(
                f"CPU: {m['cpu']}, {m['threads']} threads; our variant {m['variant']}"
                + (f", the original's {theirs}" if theirs else "")
                + ".\n"
            )
        print(table(ours, original))
        print("\nLoading each method's checkpoint (8 experts, one layer, from the page cache):\n")
        print(load_table(ours, original))
        return 0
    results = measure(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(table(results, None))
    print()
    print(load_table(results, None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
