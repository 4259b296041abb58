"""Whole-layer benchmark on synthetic weights (``python -m kt_kernel bench``).

Builds ``--layers`` MoE layers of a model shape with random bf16 experts (enough bytes that they
stream from DRAM; LLAMAFILE quantizes them to ``--gguf-type`` with kt_kernel's own quantizer and
loads them from GGUF files written to a temporary folder), then for each token count runs fresh
random routing through the layers in turn and reports latency, tokens/s, GB/s of expert weights
read, GFLOP/s and the error against a float64 reference, beside a plain torch bf16 implementation
and this machine's own measured limits (DRAM read bandwidth, fp32-FMA, int8, bf16-dot and, where
the CPU has them, AMX tile peaks), all from the same run. Each row's floor is the roofline of
its method here: the larger of its weight bytes over the DRAM bandwidth sampled during the run
and its multiply-adds over the peak of the instruction its many-row kernel computes with
(``_compute_family``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time

import torch

PRESETS = {
    # name: (experts, top_k, hidden, intermediate, default layers)
    "qwen3-30b-a3b": (128, 8, 2048, 768, 3),
    # DeepSeek-V3 has 256 experts of 7168x2048 (22 GB per layer in bf16); 32 experts keep the
    # per-expert shape and the routing density (top-8) at a size this machine can hold.
    "deepseek-v3": (32, 8, 7168, 2048, 1),
    "mixtral": (8, 2, 4096, 14336, 1),
}


# The limit (key of the measured limits) each compute family divides by.
LIMIT_OF = {
    "fma": "fp32_fma_gflops",
    "bf16": "bf16_dot_gflops",
    "int8": "int8_madd_gops",
    "int15": "int8_madd_gops",
    "amx-bf16": "amx_bf16_gflops",
    "amx-int8": "amx_int8_gops",
}
# Products per multiply-add of the limit: the 15-bit kernels (GPTQ_INT4, MXFP4, NVFP4 below
# their bf16-panel rows) multiply each code by two-byte activations in two int8 passes.
PASSES = {"int15": 2}


def _compute_family(name: str, info: dict, rows_per_expert: float) -> str:
    """The instruction family a method's many-row (prefill) kernels compute with on this CPU:
    AMX tiles where they are in use (int8 tiles for AMXINT8/AMXINT4, bf16 tiles for the formats
    that decode to bf16 panels), else the vector kernel's (bf16 dot or fp32 FMA, as the BF16
    calibration chose; int8 multiply-adds for the integer formats and GGUF; for the 15-bit
    kinds below the row count from which they decode bf16 panels (at the mean rows per expert)
    `int15`: two int8 multiply-adds per product)."""
    method = name.split("-")[0]
    if method == "torch":
        return "fma"
    amx = info["kernels"].get("AMX") == "amx" and info["amx_min_rows"] > 0
    if method in ("AMXINT8", "AMXINT4"):
        return "amx-int8" if amx else "int8"
    if method == "LLAMAFILE":
        return "int8"
    if amx:
        return "amx-bf16"
    if method in ("RAWINT4", "GPTQ_INT4", "MXFP4", "NVFP4"):
        kernel = info["prefill_kernels"][method]
        found = re.search(r"bf16-panels from (\d+) rows", kernel)
        if found and rows_per_expert >= int(found.group(1)):
            return "bf16"
        return "int15" if kernel.startswith("int15") else "int8"
    return "bf16" if "bf16dot" in info["kernels"]["BF16"] else "fma"


def _set_floor(row: dict, limits: dict) -> None:
    """The row's roofline floor: its weight bytes at the sampled DRAM bandwidth, or its
    operations at the peak of its compute family, whichever takes longer."""
    family = row["compute_family"]
    compute_ms = row["giga_ops"] * PASSES.get(family, 1) / limits[LIMIT_OF[family]] * 1e3
    row["floor_ms"] = max(row["memory_floor_ms"], compute_ms)
    row["floor_bound"] = "memory" if row["memory_floor_ms"] >= compute_ms else "compute"
    row["x_floor"] = row["median_ms"] / row["floor_ms"]


# A row whose median is this far above its best was probably slowed by something outside
# the process for part of its calls (benches/records/2026-11-26-layer-run-spread.md).
DISTURBED_SPREAD = 1.25
DISTURBED_NOTE = (
    f"† median more than {DISTURBED_SPREAD:.2f}× the row's best: part of its calls ran slowed by "
    "something outside the process (this VM has slow phases); its best is the better guide."
)


# Between blocks the bench also samples the cores' int8 multiply-add rate: on a shared VM it
# drops while another tenant shares the cores (runs with an int8 probe of 721 against the usual
# 904-937 GOP/s were seen), and a row timed then meets less compute than its floor assumes.
# The DRAM sample moves independently of it (AMD EPYC VM, 2026-11-28: 55-60 GB/s in some
# minutes, 29-35 in others, with the cores at 98-100% in both).
SHARED_CORES = 0.85
SHARED_NOTE = (
    f"‡ the cores' int8 rate sampled between this row's blocks was below {SHARED_CORES:.0%} of "
    "the run's probe: the cores were shared with something outside the process, so the row "
    "met less compute than its floor assumes."
)


def _cores_cell(row: dict) -> str:
    """The cores' sampled int8 rate as a share of the run's probe, marked ‡ when shared."""
    share = row.get("cores_now")
    if share is None:
        return ""
    mark = " ‡" if share < SHARED_CORES else ""
    return f"; cores {100 * share:.0f}%{mark}"


def _median_cell(row: dict) -> str:
    """The median, marked † when the row's spread says the machine was disturbed."""
    mark = " †" if row["median_ms"] > DISTURBED_SPREAD * row["best_ms"] else ""
    return f"{row['median_ms']:.2f}{mark}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b")
    p.add_argument("--experts", type=int, help="override the preset's expert count")
    p.add_argument("--layers", type=int, help="layers to cycle through (default: per preset)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 32, 128, 512])
    p.add_argument(
        "--methods", "--method", nargs="+", default=["BF16", "AMXINT8", "AMXINT4", "FP8"]
    )
    p.add_argument(
        "--gguf-type",
        nargs="+",
        default=["Q4_K"],
        help="LLAMAFILE: ggml type(s) of the synthetic GGUF experts (gate/up, and down unless "
        "--gguf-down-type is given), e.g. Q4_K, Q8_0, Q6_K, IQ4_XS; several types are "
        "benchmarked side by side as LLAMAFILE-<type>",
    )
    p.add_argument("--gguf-down-type", help="LLAMAFILE: ggml type of down (e.g. Q6_K as in Q4_K_M)")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="worker threads (default: all physical cores)",
    )
    p.add_argument("--repeats", type=int, default=0, help="timed calls per size (0 = auto)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch baseline")
    p.add_argument(
        "--max-resident-gb",
        type=float,
        help="load the methods in groups of at most this many GB of experts, one group at a "
        "time (default: 45%% of the memory available at start)",
    )
    p.add_argument("--json", help="write results as JSON to this file")
    p.add_argument("--markdown", help="write a markdown table to this file")
    p.add_argument("--seed", type=int, default=0)


class _Progress:
    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        width = 30
        fill = int(width * self.done / self.total)
        el = time.perf_counter() - self.t0
        bar = "#" * fill + "." * (width - fill)
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {el:6.1f}s {label:<40}")
        sys.stderr.flush()
        if self.done == self.total:
            sys.stderr.write("\n")


def _routing(gen: torch.Generator, tokens: int, experts: int, k: int):
    scores = torch.rand(tokens, experts, generator=gen)
    weights, ids = scores.topk(k, dim=1)
    weights = torch.softmax(weights, dim=1).to(torch.float32)
    return ids.to(torch.int64), weights


def _available_memory() -> float:
    """Bytes the kernel says can be allocated without swapping (inf where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def _memory_groups(variants: list, resident, budget: float) -> list[list]:
    """``variants`` in order, split into consecutive groups whose ``resident(name)`` bytes sum
    to at most ``budget`` (a variant larger than the budget gets a group of its own)."""
    groups: list[list] = []
    used = 0.0
    for v in variants:
        need = resident(v[0])
        if not groups or used + need > budget:
            groups.append([])
            used = 0.0
        groups[-1].append(v)
        used += need
    return groups


def settle_prefetch(layers, gen: torch.Generator, max_calls: int = 400) -> None:
    """Run one-token decodes on ``layers`` (wrappers of one method) until the prefetch
    distance of its kernels is final: a serving process tunes it on its first decodes
    (``kernels::prefetch``), so timing before that would measure a mix of settings."""
    from . import _kt_core

    w0 = layers[0]
    x = torch.randn(1, w0.hidden_size, generator=gen).to(torch.bfloat16)
    for i in range(max_calls):
        if _kt_core.prefetch_state(w0.method)[0]:
            return
        ids, w = _routing(gen, 1, w0.num_experts, w0.num_experts_per_tok)
        layers[i % len(layers)].forward(x, ids, w, None)


def settle_amx_prefetch(layers, gen: torch.Generator, tokens: int, max_calls: int = 200) -> None:
    """Run ``tokens``-token prefills on ``layers`` until the weight prefetch of the AMX tile
    programs they stream with is final: a serving process tunes it on its first prefills of
    at least 8 rows per expert (``kernels::amx::amx_tune_begin``). Nothing to do for
    layers off hardware tiles, methods that decode panels first, or smaller sizes."""
    from . import _kt_core

    w0 = layers[0]
    on_tiles = str(w0.moe.kernel).startswith("amx+")
    if not on_tiles or tokens * w0.num_experts_per_tok < 8 * w0.num_experts:
        return
    x = torch.randn(tokens, w0.hidden_size, generator=gen).to(torch.bfloat16)
    for i in range(max_calls):
        state = _kt_core.amx_prefetch_state(w0.method)
        if state is None or state[0]:
            return
        ids, w = _routing(gen, tokens, w0.num_experts, w0.num_experts_per_tok)
        layers[i % len(layers)].forward(x, ids, w, None)


def amx_prefetch_summary(methods) -> str:
    """What the AMX prefill tuner chose for ``methods`` that stream weights into tiles (empty
    when none does)."""
    from . import _kt_core

    chosen = []
    for m in dict.fromkeys(methods):
        state = _kt_core.amx_prefetch_state(m)
        if state is not None:
            tuned, ahead = state
            where = "off" if ahead == 0 else f"{ahead} B ahead into L2"
            chosen.append(f"{m}: {where}{'' if tuned else ', not tuned'}")
    return "; ".join(chosen)


def prefetch_summary(methods) -> str:
    """What the process's prefetch tuners chose for ``methods``' kernels, grouped by setting
    (the choice moves the one-token rows by up to 15%, so a table says which ran)."""
    from . import _kt_core

    by_setting: dict[str, list[str]] = {}
    for m in dict.fromkeys(methods):
        tuned, ahead, into_l2 = _kt_core.prefetch_state(m)
        where = "off" if ahead == 0 else f"{ahead} B ahead into {'L2' if into_l2 else 'L1'}"
        by_setting.setdefault(where + ("" if tuned else ", not tuned"), []).append(m)
    return "; ".join(f"{', '.join(ms)}: {where}" for where, ms in by_setting.items())


def torch_moe(x, ids, weights, gate, up, down):
    """Plain torch: loop over the activated experts, bf16 matmuls, index_add into the output."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[tok]
        h = torch.nn.functional.silu(xe @ gate[e].T) * (xe @ up[e].T)
        y = (h @ down[e].T).float() * weights[tok, slot, None]
        out.index_add_(0, tok, y)
    return out.to(x.dtype)


def reference_moe(x, ids, weights, gate, up, down):
    """float64 reference on the same bf16 weights."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    xd = x.double()
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = xd[tok]
        h = torch.nn.functional.silu(xe @ gate[e].double().T) * (xe @ up[e].double().T)
        out.index_add_(0, tok, (h @ down[e].double().T) * weights[tok, slot, None].double())
    return out


def _rel_l2(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def _time_rounds(fns: dict, calls: list, probe, rounds: int = 3, warmup: int = 1):
    """Time every implementation in alternating blocks: per round, each implementation runs
    ``warmup`` untimed calls and then its share of the calls back to back. Blocks (rather than
    call-by-call alternation) keep torch's spinning OpenMP threads out of our timings;
    several rounds spread this shared machine's noise bursts over all implementations.
    ``probe()`` samples the machine after each block; the samples come back in a list."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    samples: list = []
    per_round = max(1, (len(calls) - 1) // rounds)
    for r in range(rounds):
        block = calls[1 + r * per_round : 1 + (r + 1) * per_round] or calls[1:]
        for name, fn in fns.items():
            for _ in range(warmup):
                fn(*calls[0])
            for args in block:
                t0 = time.perf_counter()
                fn(*args)
                times[name].append(time.perf_counter() - t0)
            # The machine sampled between blocks: the "same moment" reference.
            samples.append(probe())
    return times, samples


def _gguf_bytes_per_expert(gate_up: str, down: str, hidden: int, inter: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    def row(name: str, n: int) -> int:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        return n // block * size

    return 2 * inter * row(gate_up, hidden) + hidden * row(down, inter)


def _write_gguf_layers(folder: str, weights, gate_up: str, down: str, threads: int) -> None:
    """One GGUF file per layer (a folder of shards), quantized with kt_kernel's quantizer."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    from . import _kt_core

    for layer, tensors in enumerate(weights):
        writer = GGUFWriter(os.path.join(folder, f"layer-{layer:03d}.gguf"), "qwen3moe")
        types = (gate_up, gate_up, down)
        for proj, t, ty in zip(("gate", "up", "down"), tensors, types, strict=True):
            data = t.contiguous().view(torch.int16).numpy().tobytes()
            raw = _kt_core.ggml_quantize(ty, data, threads, "bfloat16")
            q = np.frombuffer(raw, dtype=np.uint8).reshape(t.shape[0], t.shape[1], -1)
            writer.add_tensor(
                f"blk.{layer}.ffn_{proj}_exps.weight", q, raw_dtype=GGMLQuantizationType[ty]
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


def _check_args(args: argparse.Namespace, k: int) -> None:
    """Refuse arguments the run could not use, before anything is loaded (a clear message, not
    a traceback minutes into a run, or a run of something else)."""
    from gguf import GGMLQuantizationType

    def bad(msg: str) -> None:
        raise SystemExit(f"kt bench: error: {msg}")

    if any(t < 1 for t in args.tokens):
        bad(f"--tokens must all be >= 1, got {args.tokens}")
    if args.experts is not None and args.experts < k:
        bad(f"--experts must be at least the preset's top-{k}, got {args.experts}")
    if args.layers is not None and args.layers < 1:
        bad(f"--layers must be >= 1, got {args.layers}")
    if args.repeats < 0:
        bad(f"--repeats must be >= 0 (0: automatic), got {args.repeats}")
    # More threads than CPUs only measures oversubscription (and torch crashes at thousands).
    cpus = os.cpu_count() or 1
    if not 0 <= args.threads <= cpus:
        bad(
            f"--threads must be 0 (all physical cores) to {cpus} (this machine's CPUs), got "
            f"{args.threads}"
        )
    from .experts import IMPLEMENTED_METHODS as known

    unknown = [m for m in args.methods if m not in known]
    if unknown:
        bad(f"unknown method(s) {unknown}; known: {sorted(known)}")
    if "LLAMAFILE" in args.methods:
        for ty in [*args.gguf_type, *([args.gguf_down_type] if args.gguf_down_type else [])]:
            if ty.upper() not in GGMLQuantizationType.__members__:
                bad(f"--gguf-type/--gguf-down-type {ty!r} is not a ggml type (e.g. Q4_K, Q8_0)")
    for flag, path in (("--json", args.json), ("--markdown", args.markdown)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            bad(f"{flag} {path!r}: its folder does not exist")


def run(args: argparse.Namespace) -> int:
    import kt_kernel
    from kt_kernel import KTMoEWrapper
    from kt_kernel.experts_base import BaseMoEWrapper

    if args.max_resident_gb is not None and not args.max_resident_gb > 0:
        raise SystemExit(f"--max-resident-gb must be > 0 GB, got {args.max_resident_gb}")
    experts, k, hidden, inter, default_layers = PRESETS[args.preset]
    _check_args(args, k)
    experts = args.experts or experts
    layers = args.layers or default_layers
    args.threads = args.threads or int(kt_kernel.cpu_info()["physical_cores"])
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    bytes_per_expert = 3 * hidden * inter * 2
    # AMXINT8: one byte per weight plus an fp32 scale (and our i32 row sum) per output row.
    int8_bytes_per_expert = 3 * hidden * inter + (2 * inter + hidden) * 8
    int4_bytes_per_expert = 3 * hidden * inter // 2 + (2 * inter + hidden) * 8
    # Implementations: (name, method, GGUF types); LLAMAFILE once per --gguf-type.
    variants = []
    for method in args.methods:
        if method != "LLAMAFILE":
            variants.append((method, method, None))
            continue
        for ty in args.gguf_type:
            types = (ty.upper(), (args.gguf_down_type or ty).upper())
            label = types[0] if types[0] == types[1] else "/".join(types)
            variants.append((f"LLAMAFILE-{label}", method, types))
    # FP8: one byte per weight plus an f32 scale per 128 x 128 block.
    fp8_bytes_per_expert = 3 * hidden * inter + 3 * (hidden // 128) * (inter // 128) * 4
    method_bytes = {
        "AMXINT8": int8_bytes_per_expert,
        "AMXINT4": int4_bytes_per_expert,
        "FP8": fp8_bytes_per_expert,
        # FP8_PERCHANNEL: one byte per weight plus an f32 scale per output row.
        "FP8_PERCHANNEL": 3 * hidden * inter + (2 * inter + hidden) * 4,
    }
    # The group-scaled formats: code bits per weight plus one scale per group of a row.
    weights_per_expert = 3 * hidden * inter
    for method, code_bits, group, scale_bytes in (
        ("RAWINT4", 4, 32, 2),
        ("GPTQ_INT4", 4, 128, 2),
        ("MXFP4", 4, 32, 1),
        ("NVFP4", 4, 16, 1),
        ("MXFP8", 8, 32, 1),
    ):
        method_bytes[method] = (
            weights_per_expert * code_bits // 8 + weights_per_expert // group * scale_bytes
        )
    for name, _, types in variants:
        if types is not None:
            method_bytes[name] = _gguf_bytes_per_expert(*types, hidden, inter)
    info = kt_kernel.cpu_info()
    print(
        f"kt_kernel {kt_kernel.__version__} | variant {info['variant']} | BF16 kernel "
        f"{info['kernels']['BF16']} | {info['brand']} | {info['topology']}"
    )
    print(
        f"preset {args.preset}: E={experts} top-{k} H={hidden} I={inter}, {layers} layers "
        f"({layers * experts * bytes_per_expert / 1e9:.2f} GB of bf16 experts), "
        f"{args.threads} threads, torch {torch.__version__} ({torch.get_num_threads()} threads)"
    )

    weights = []
    for _ in range(layers):
        scale = 0.02
        g = (torch.randn(experts, inter, hidden, generator=gen) * scale).to(torch.bfloat16)
        u = (torch.randn(experts, inter, hidden, generator=gen) * scale).to(torch.bfloat16)
        d = (torch.randn(experts, hidden, inter, generator=gen) * scale).to(torch.bfloat16)
        weights.append((g, u, d))

    max_tokens = max(args.tokens)

    def load(group):
        """The wrappers of ``group`` (variants), loaded and with their prefetch settled."""
        wrappers: dict[str, list] = {}
        for name, method, types in group:
            gguf_dir = None
            if types is not None:
                # Written per type, loaded (copied into the layers) and deleted again.
                gguf_dir = tempfile.TemporaryDirectory(prefix="kt-bench-gguf-")
                t0 = time.perf_counter()
                _write_gguf_layers(gguf_dir.name, weights, *types, args.threads)
                write_s = time.perf_counter() - t0
            ws = []
            for layer, (g, u, d) in enumerate(weights):
                w = KTMoEWrapper(
                    layer,
                    experts,
                    k,
                    hidden,
                    inter,
                    None,
                    args.threads,
                    1,
                    gguf_dir.name if gguf_dir else "",
                    max_tokens,
                    method=method,
                )
                if gguf_dir:
                    w.load_weights()
                else:
                    w.load_weights_from_tensors(g, u, d, torch.arange(experts))
                ws.append(w)
            wrappers[name] = ws
            if gguf_dir:
                gguf_dir.cleanup()
                print(
                    f"{name}: GGUF quantized and written in {write_s:.1f}s, loaded; kernels "
                    f"{ws[0].moe.kernel}"
                )
        for ws in wrappers.values():
            settle_prefetch(ws, gen)
            settle_amx_prefetch(ws, gen, max_tokens)
        return wrappers

    def measure_limits(old=None):
        new = {
            "dram_read_gbps": engine.measure_read_bandwidth(1 << 30, 5),
            "fp32_fma_gflops": engine.measure_peak_gflops("fma", 300),
            "bf16_dot_gflops": engine.measure_peak_gflops("bf16", 300),
            "int8_madd_gops": engine.measure_peak_gflops("int8", 300),
            "amx_int8_gops": engine.measure_peak_gflops("amx_int8", 300),
            "amx_bf16_gflops": engine.measure_peak_gflops("amx_bf16", 300),
        }
        if old:  # best of the measurements before and after the runs
            new = {k: max(v, old[k]) if v is not None else None for k, v in new.items()}
        return new

    probes = info["probes"]

    def print_limits(limits):
        print(
            "machine limits (measured now, {} threads; probes: read {}, fma {}, int8 {}, bf16 {}): "
            "DRAM read {:.1f} GB/s, fp32 FMA {:.0f} GFLOP/s, int8 multiply-add {:.0f} GOP/s, "
            "bf16 dot {} GFLOP/s".format(
                args.threads,
                probes["read"],
                probes["fma"],
                probes["int8"],
                probes["bf16"],
                limits["dram_read_gbps"],
                limits["fp32_fma_gflops"] or 0,
                limits["int8_madd_gops"] or 0,
                f"{limits['bf16_dot_gflops']:.0f}" if limits["bf16_dot_gflops"] else "n/a",
            )
            + (
                ", AMX tiles int8 {:.0f} GOP/s, bf16 {:.0f} GFLOP/s".format(
                    limits["amx_int8_gops"], limits["amx_bf16_gflops"]
                )
                if limits["amx_int8_gops"]
                else ""
            )
        )

    def time_size(tokens, size, impls, wrappers, limits):
        """One row per implementation in ``impls`` at ``tokens`` tokens."""
        calls, distinct, ref = size
        check_layer, cx, cids, cw = calls[-1]
        rows = []
        fns = {}
        for name, kind in impls:
            if kind == "kt":

                def fn(layer, x, ids, w, ws=wrappers[name]):
                    return ws[layer].forward(x, ids, w, None)
            else:

                def fn(layer, x, ids, w):
                    return torch_moe(x, ids, w, *weights[layer])

            fns[name] = fn

        def sample():
            int8 = engine.measure_peak_gflops("int8", 50) if limits["int8_madd_gops"] else None
            return engine.measure_read_bandwidth(512 << 20, 2), int8

        all_times, samples = _time_rounds(
            fns,
            calls,
            sample,
            # Decodes right after the 512 MiB probe (or torch's block) run on cold caches,
            # TLBs and prefetchers: three go untimed (thirty more did not change a ten-call
            # median; a hundred timed calls per round did, see `repeats`).
            warmup=3 if tokens <= 4 else 1,
        )
        dram_median = statistics.median(d for d, _ in samples)
        int8_now = [i for _, i in samples if i]
        cores_now = statistics.median(int8_now) / limits["int8_madd_gops"] if int8_now else None
        for name, fn in fns.items():
            times = all_times[name]
            err = _rel_l2(fn(check_layer, cx, cids, cw), ref)
            med, best = statistics.median(times), min(times)
            expert_bytes = method_bytes.get(name, bytes_per_expert)
            gbps = distinct * expert_bytes / med / 1e9
            gflops = 2 * 3 * hidden * inter * tokens * k / med / 1e9
            family = _compute_family(name, info, tokens * k / experts)
            row = {
                "impl": name,
                "tokens": tokens,
                "median_ms": med * 1e3,
                "best_ms": best * 1e3,
                "tokens_per_s": tokens / med,
                "weight_gbps": gbps,
                "gflops": gflops,
                "rel_l2_err": err,
                "frac_dram": gbps / limits["dram_read_gbps"],
                "dram_now_gbps": dram_median,
                "frac_dram_now": gbps / dram_median,
                "cores_now": cores_now,
                "best_weight_gbps": distinct * expert_bytes / best / 1e9,
                "frac_fma_peak": gflops / limits["fp32_fma_gflops"]
                if limits["fp32_fma_gflops"]
                else None,
                "frac_bf16_peak": gflops / limits["bf16_dot_gflops"]
                if limits["bf16_dot_gflops"]
                else None,
                "compute_family": family,
                "memory_floor_ms": distinct * expert_bytes / dram_median / 1e6,
                "giga_ops": 2 * 3 * hidden * inter * tokens * k / 1e9,
                "repeats": len(times),
            }
            _set_floor(row, limits)
            rows.append(row)
            progress.step(f"{name} tokens={tokens}")
        return rows

    # Methods are loaded in groups that fit in memory with room to spare: with every method of
    # a full run resident at once (about 18 GB here) the kernel reclaims and compacts memory
    # on the benchmark's cores and the decode rows read 20-40% low.
    groups = _memory_groups(
        variants,
        lambda name: method_bytes.get(name, bytes_per_expert) * experts * layers,
        0.45 * _available_memory() if args.max_resident_gb is None else args.max_resident_gb * 1e9,
    )
    impl_order = [v[0] for v in variants] + ([] if args.no_torch else ["torch-bf16"])
    progress = _Progress(len(args.tokens) * len(impl_order))
    # The same inputs for every group.
    sizes = {}
    for tokens in args.tokens:
        # At least 15 calls (5 per round) even for long prefills: with 9 (3 per round), one slow
        # round moved a 512-token median by 10% on this VM (AMXINT8: median 64.7 ms, best 58.0,
        # while a tight loop minutes later gave a median of 58.9). Decodes get 300 (100 per
        # round): after each round's probe sample the next 20-50 decodes run slow (measured in
        # Rust: 1.6-5.7 ms against 1.45 steady), so with 10 per round the medians of one and
        # four tokens read 1.3-2.5x a serving loop's (AMXINT8, FP8, RAWINT4, alternating runs).
        repeats = args.repeats or max(15, min(300, int(2000 / tokens)))
        # Fresh inputs per call, cycling layers so weights come from DRAM, not cache.
        calls = []
        for i in range(repeats + 1):
            layer = i % layers
            x = (torch.randn(tokens, hidden, generator=gen)).to(torch.bfloat16)
            ids, w = _routing(gen, tokens, experts, k)
            calls.append((layer, x, ids, w))
        distinct = statistics.mean(len(torch.unique(c[2])) for c in calls)
        check_layer, cx, cids, cw = calls[-1]
        ref = reference_moe(cx, cids, cw, *weights[check_layer])
        sizes[tokens] = (calls, distinct, ref)
    results = []
    limits = None
    for group_index, group in enumerate(groups):
        wrappers = load(group)
        # Flush the files written meanwhile (the GGUF layers, a build before the run): their
        # writeback otherwise runs during the first timed blocks.
        if hasattr(os, "sync"):
            os.sync()
        if limits is None:
            engine = BaseMoEWrapper._cpu_infer.engine
            limits = measure_limits()
            print_limits(limits)
        else:
            # Let a later group settle as the first does during the limit probes: timed right
            # after the load (the kernel still reclaiming the previous group's memory), its
            # 1-token rows read 52-67% of DRAM where the first group's read 84-90%.
            time.sleep(10)
        impls = [(v[0], "kt") for v in group]
        if group_index == 0 and not args.no_torch:
            impls.append(("torch-bf16", "torch"))
        for tokens in args.tokens:
            results += time_size(tokens, sizes[tokens], impls, wrappers, limits)
        del wrappers
        gc.collect()
    results.sort(key=lambda r: (args.tokens.index(r["tokens"]), impl_order.index(r["impl"])))

    final = measure_limits(limits)
    if final != limits:
        limits = final
        for r in results:
            r["frac_dram"] = r["weight_gbps"] / limits["dram_read_gbps"]
            if limits["fp32_fma_gflops"]:
                r["frac_fma_peak"] = r["gflops"] / limits["fp32_fma_gflops"]
            if limits["bf16_dot_gflops"]:
                r["frac_bf16_peak"] = r["gflops"] / limits["bf16_dot_gflops"]
            _set_floor(r, limits)
        print(
            "limits re-measured after the runs (best of both): DRAM {:.1f} GB/s, fp32 FMA {:.0f}, "
            "bf16 dot {:.0f} GFLOP/s".format(
                limits["dram_read_gbps"],
                limits["fp32_fma_gflops"] or 0,
                limits["bf16_dot_gflops"] or 0,
            )
        )
    by = {(r["impl"], r["tokens"]): r for r in results}
    lines = [
        "| impl | tokens | median ms | best ms | tok/s | weights GB/s median (% of DRAM read "
        "sampled between blocks; cores' int8 rate sampled then, % of the run's probe) | "
        "GFLOP/s (% fp32-FMA / % bf16-dot peak) | floor ms (× floor, bound by) | rel L2 err | "
        "× torch (median) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t = by.get(("torch-bf16", r["tokens"]))
        speedup = f"{t['median_ms'] / r['median_ms']:.2f}" if t else "-"
        fma = f"{100 * r['frac_fma_peak']:.0f}%" if r["frac_fma_peak"] else "-"
        bf = f"{100 * r['frac_bf16_peak']:.0f}%" if r["frac_bf16_peak"] else "-"
        lines.append(
            f"| {r['impl']} | {r['tokens']} | {_median_cell(r)} | {r['best_ms']:.2f} | "
            f"{r['tokens_per_s']:.0f} | {r['weight_gbps']:.1f} ({100 * r['frac_dram_now']:.0f}% "
            f"of {r['dram_now_gbps']:.1f}{_cores_cell(r)}) | "
            f"{r['gflops']:.1f} ({fma} / {bf}) | {r['floor_ms']:.2f} ({r['x_floor']:.2f}×, "
            f"{r['floor_bound'] if r['floor_bound'] == 'memory' else r['compute_family']}) | "
            f"{r['rel_l2_err']:.1e} | {speedup} |"
        )
    if any(" †" in line for line in lines):
        lines += ["", DISTURBED_NOTE]
    if any(" ‡" in line for line in lines):
        lines += ["", SHARED_NOTE]
    table = "\n".join(lines)
    print(table)
    meta = {
        "preset": args.preset,
        "experts": experts,
        "top_k": k,
        "hidden": hidden,
        "intermediate": inter,
        "layers": layers,
        "threads": args.threads,
        "cpu": info["brand"],
        "variant": info["variant"],
        "kernel": info["kernels"]["BF16"],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "limits": limits,
        "probes": info["probes"],
        "groups": [[v[0] for v in g] for g in groups],
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    if args.markdown:
        amx = (
            f", AMX tiles int8 {limits['amx_int8_gops']:.0f} GOP/s and bf16 "
            f"{limits['amx_bf16_gflops']:.0f} GFLOP/s"
            if limits["amx_int8_gops"]
            else ""
        )
        tiles = amx_prefetch_summary(args.methods) if limits["amx_int8_gops"] else ""
        amx_tuned = f" AMX tile weight prefetch chosen by the first prefills: {tiles}."
        amx_tuned = amx_tuned if tiles else ""
        with open(args.markdown, "w") as f:
            f.write(
                f"Preset {args.preset} (E={experts}, top-{k}, H={hidden}, I={inter}), "
                f"{layers} layers cycled, {args.threads} threads, {info['brand']}, variant "
                f"{info['variant']}, kernel {info['kernels']['BF16']}. Methods loaded in "
                f"{len(groups)} group(s) that fit in memory, one group at a time"
                f"{'' if args.no_torch else '; torch timed with the first'}.\n"
                f"Measured limits in this run: DRAM read {limits['dram_read_gbps']:.1f} GB/s, "
                f"fp32 FMA {limits['fp32_fma_gflops'] or 0:.0f} GFLOP/s, int8 multiply-add "
                f"{limits['int8_madd_gops'] or 0:.0f} GOP/s, bf16 dot "
                f"{limits['bf16_dot_gflops'] or 0:.0f} GFLOP/s{amx} (probes: read "
                f"{probes['read']}, fma {probes['fma']}, int8 {probes['int8']}, bf16 "
                f"{probes['bf16']}; DRAM in huge pages, as the weights). The floor column: the "
                f"larger of the weight bytes at the DRAM bandwidth sampled during the row and "
                f"the multiply-adds at the peak of the instruction the method's many-row "
                f"kernels compute with (int15: the 15-bit kernels, two int8 multiply-adds per "
                f"product). Weight prefetch chosen by the process's first decodes: "
                f"{prefetch_summary(args.methods)}.{amx_tuned}\n\n{table}\n"
            )
    return 0
