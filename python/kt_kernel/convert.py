"""Convert a Hugging Face MoE checkpoint to AMXINT8 / AMXINT4 weights, in Rust.

The same options and output as the original's ``scripts/convert_cpu_weights.py`` (merged
safetensors shards ``blk.{L}.ffn_*_exps.{E}.numa.{N}.{weight,scale}`` with an index and the
config/tokenizer files, or ``_layer_{L}/_numa_{N}/*.kt`` folders with
``--no-merge-safetensor``); the bytes equal the original's. It streams one layer at a time
with memory bounded by the thread count times one expert matrix, writes every file under a
temporary name and renames it when complete, and ``--resume-layer`` continues an interrupted
run. Input experts may be bf16, fp16, fp32 or block-FP8 (e4m3 + 128x128 ``weight_scale_inv``).

    python -m kt_kernel.convert --input-path MODEL --input-type bf16 --output OUT \\
        --quant-method int8 --cpuinfer-threads 32 --threadpool-count 2
    kt quant MODEL --method int4 --output OUT
"""

from __future__ import annotations

import argparse
import os
import sys
import time

QUANT_METHODS = ["int4", "int8", "awq", "moe_int4", "moe_int8"]
INPUT_TYPES = ["bf16", "fp16", "fp32", "fp8", "awq"]


def add_arguments(p: argparse.ArgumentParser, kt_quant: bool = False) -> None:
    """The original script's options (and, for ``kt quant``, its CLI's spellings)."""
    if kt_quant:
        p.add_argument("model", nargs="?", help="input checkpoint folder (= --input-path)")
    p.add_argument(
        "--input-path", "-i", required=not kt_quant, help="Hugging Face checkpoint folder"
    )
    p.add_argument(
        "--input-type",
        choices=INPUT_TYPES,
        default=None,
        help="precision of the experts (checked against the files; default: what they hold)",
    )
    p.add_argument("--output", "-o", required=not kt_quant, help="output folder")
    names = ["--quant-method", "--method"] if kt_quant else ["--quant-method"]
    p.add_argument(*names, dest="quant_method", choices=QUANT_METHODS, default="int4")
    names = ["--cpuinfer-threads", "--cpu-threads"] if kt_quant else ["--cpuinfer-threads"]
    p.add_argument(
        *names,
        dest="cpuinfer_threads",
        type=int,
        default=0,
        help="threads (default: all physical cores)",
    )
    names = ["--threadpool-count", "--numa-nodes"] if kt_quant else ["--threadpool-count"]
    p.add_argument(
        *names,
        dest="threadpool_count",
        type=int,
        default=2,
        help="NUMA parts the weights are split into; serve with the same "
        "threadpool_count (default 2, as the original)",
    )
    names = ["--no-merge-safetensor", "--no-merge"] if kt_quant else ["--no-merge-safetensor"]
    p.add_argument(
        *names,
        dest="no_merge_safetensor",
        action="store_true",
        help="write _layer_L/_numa_N/*.kt folders instead of safetensors shards",
    )
    p.add_argument(
        "--resume-layer",
        type=int,
        default=0,
        help="skip MoE layers below this index (their output must exist)",
    )
    p.add_argument("--gpu", action="store_true", help="accepted for compatibility; unused")
    p.add_argument("--fp8-expert-batch", type=int, default=16, help=argparse.SUPPRESS)
    if kt_quant:
        p.add_argument("--yes", "-y", action="store_true", help="accepted; nothing is asked")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


class _Bar:
    """Progress on stderr: a self-overwriting line on a terminal (layers, layers/s, GB/s, ETA),
    else one line per finished layer."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.tty = enabled, sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.last, self.layers_shown = "", 0

    def show(self, p: dict) -> None:
        if not self.enabled or not p["bytes_total"]:
            return
        dt = max(time.perf_counter() - self.t0, 1e-9)
        frac = p["bytes_done"] / p["bytes_total"]
        eta = f"{dt * (1 - frac) / frac:.0f}s" if frac > 0 else "?"
        status = (
            f"layer {p['layer']} ({p['layers_done']}/{p['layers_total']} done) "
            f"{p['layers_done'] / dt:.2f} layers/s {p['bytes_done'] / dt / 1e9:.2f} GB/s ETA {eta}"
        )
        if self.tty:
            filled = int(30 * frac)
            line = f"\r[{'#' * filled}{'.' * (30 - filled)}] {status}"
            if line != self.last:
                sys.stderr.write(line)
                sys.stderr.flush()
                self.last = line
        elif p["layers_done"] > self.layers_shown:
            self.layers_shown = p["layers_done"]
            print(status, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty and self.last:
            sys.stderr.write("\n")


def run(args: argparse.Namespace) -> int:
    """Convert as ``args`` says; returns the exit status (0 ok, 1 error, 130 interrupted)."""
    from . import _kt_core

    source = getattr(args, "model", None) or args.input_path
    if not source:
        print("error: give the input checkpoint (MODEL or --input-path)", file=sys.stderr)
        return 2
    output = args.output or f"{source.rstrip(os.sep)}-AMX{args.quant_method.upper()}"
    if args.quant_method in ("awq", "moe_int4", "moe_int8") or args.input_type == "awq":
        print(
            f"error: --quant-method {args.quant_method} / --input-type {args.input_type}: only "
            "int8 and int4 from bf16, fp16, fp32 or fp8 inputs are implemented",
            file=sys.stderr,
        )
        return 1
    most = _kt_core.MAX_THREADS
    for flag, value, low, high in (
        ("--cpuinfer-threads", args.cpuinfer_threads, 0, most),
        ("--threadpool-count", args.threadpool_count, 1, most),
        ("--resume-layer", args.resume_layer, 0, None),
    ):
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"between {low} and {high}"
            print(f"error: {flag} must be {bound}, got {value}", file=sys.stderr)
            return 2
    if args.gpu:
        print("note: --gpu is not needed (FP8 is dequantized on the CPU); ignored", file=sys.stderr)
    try:
        job = _kt_core.Conversion(
            os.fspath(source),
            os.fspath(output),
            args.quant_method,
            args.input_type,
            args.cpuinfer_threads,
            args.threadpool_count,
            not args.no_merge_safetensor,
            args.resume_layer,
        )
    except (ValueError, TypeError, NotImplementedError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    bar = _Bar(not args.quiet)
    try:
        while not job.wait(0.25):
            bar.show(job.progress())
        bar.show(job.progress())
    except KeyboardInterrupt:
        job.cancel()
        try:
            job.wait()
        except Exception:
            pass
        bar.close()
        print(
            "interrupted: finished layers are complete; continue with --resume-layer",
            file=sys.stderr,
        )
        return 130
    except (ValueError, TypeError, NotImplementedError, FileNotFoundError, RuntimeError) as e:
        bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 1
    bar.close()
    r = job.report()
    gb = r["input_bytes"] / 1e9
    skipped = [layer for layer in r["layers"] if layer not in r["converted"]]
    print(
        f"converted {len(r['converted'])} MoE layer(s) to {output} in {r['seconds']:.2f} s: "
        f"{gb:.3f} GB of experts read ({gb / max(r['seconds'], 1e-9):.2f} GB/s), "
        f"{r['output_bytes'] / 1e9:.3f} GB written"
        + (f"; skipped (resumed) layers {skipped}" if skipped else "")
        + f"; buffers at most {r['buffer_bound_bytes'] / 2**20:.0f} MiB"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kt_kernel.convert",
        description="Convert a Hugging Face MoE checkpoint to AMXINT8/AMXINT4 weights",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
