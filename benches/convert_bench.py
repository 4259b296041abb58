"""Converter and converted-weight loading, measured on a synthetic checkpoint.

Writes a bf16 Hugging Face checkpoint of a model shape (default: Qwen3-30B-A3B's experts,
128 x 2048 x 768, 3 MoE layers = 3.6 GB) into a temporary folder, then in one run:
- reads its shards once more to measure the page-cache read bandwidth (one thread, read());
- converts it with ``python -m kt_kernel.convert`` for each method: wall time, GB/s of input,
  peak resident memory of the converting process;
- loads every converted layer into a ``KTMoEWrapper`` (median of the layers) and compares the
  GB/s of weights loaded with the page-cache read bandwidth of the converted files, measured in
  the same process right before.

    python benches/convert_bench.py [--layers 3] [--methods int8 int4] [--tp 2] [--markdown F]

The original's converter is not in its PyPI wheel (``kt quant`` looks for a
``scripts/convert_cpu_weights.py`` the wheel does not ship), so it is not run here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# The converter's peak resident memory (VmHWM: ru_maxrss would inherit this parent's peak
# across exec), beyond what importing kt_kernel (and torch) takes.
HWM = "int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])"
PEAK = (
    "import sys; from kt_kernel import convert; s = convert.main(sys.argv[1:]); "
    f"print('PEAK', {HWM}); sys.exit(s)"
)
BASE = f"import kt_kernel; print({HWM})"

LOAD = r"""
import json, mmap, os, statistics, sys, time, torch
from concurrent.futures import ThreadPoolExecutor
from kt_kernel import KTMoEWrapper
path, method, tp, layers, e, h, i = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
files = [os.path.join(root, n) for root, _, names in os.walk(path) for n in names
         if n.endswith((".safetensors", ".kt")) and f"-{layers + 1:05d}-of-" not in n]
def read_part(part, threads, fresh):
    # Thread `part` of `threads` reads that share of every file (one contiguous range each: a
    # layer's merged shard is one file). Into a reused 16 MiB buffer, or (fresh) into newly
    # mapped memory as a load must: the kernel zeroes each fresh page, then the read copies
    # into it; private and advised for huge pages like the layer's own buffers (a bytearray
    # would fault 4 KiB pages one by one).
    n, reused = 0, memoryview(bytearray(16 << 20))
    for name in files:
        size = os.path.getsize(name)
        lo, hi = size * part // threads, size * (part + 1) // threads
        if fresh and hi > lo:
            m = mmap.mmap(-1, hi - lo, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            m.madvise(mmap.MADV_HUGEPAGE)
            view = memoryview(m)
        fd = os.open(name, os.O_RDONLY)
        at = lo
        while at < hi:
            dst = view[at - lo:] if fresh else reused[: min(len(reused), hi - at)]
            r = os.preadv(fd, [dst], at)
            if r == 0:
                break
            at += r
        os.close(fd)
        n += at - lo
        # The mapping goes with its last view (slices of it may still be alive here).
        dst = view = m = None
    return n
def read_gbps(threads, fresh=False):
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        n = sum(ex.map(lambda p: read_part(p, threads, fresh), range(threads)))
    return n / (time.perf_counter() - t) / 1e9
read_gbps(1)
read1 = max(read_gbps(1) for _ in range(3))
read2 = max(read_gbps(2) for _ in range(3))
# Best of three: the first touch of memory this process has never used costs a host fault on
# this VM, which says nothing about the copy; later rounds reuse freed memory, zeroed again.
fresh2 = max(read_gbps(2, fresh=True) for _ in range(3))
per_expert = 3 * h * i // (2 if method == "int4" else 1) + (2 * i + h) * 4 * tp
# Round 0 loads every layer once; round 1 loads them again, each into memory the previous
# (freed) layers used: on this VM the first touch of guest memory costs far more than zeroing.
times, reload_times = [], []
for rnd in range(2):
    for layer in range(1, layers + 1):
        w = KTMoEWrapper(layer_idx=layer, num_experts=e, num_experts_per_tok=8, hidden_size=h,
                         moe_intermediate_size=i, gpu_experts_mask=None, cpuinfer_threads=2,
                         threadpool_count=tp, weight_path=path, chunked_prefill_size=512,
                         method="AMX" + method.upper())
        t = time.perf_counter()
        w.load_weights(torch.arange(e))
        (reload_times if rnd else times).append(time.perf_counter() - t)
        del w
med = statistics.median(times)
print(json.dumps({"read1_gbps": read1, "read2_gbps": read2, "fresh2_gbps": fresh2, "load_s": times,
                  "load_gbps": e * per_expert / med / 1e9,
                  "best_load_gbps": e * per_expert / min(times) / 1e9,
                  "reload_s": reload_times,
                  "reload_gbps": e * per_expert / statistics.median(reload_times) / 1e9}))
"""


def write_checkpoint(path: str, layers: int, e: int, h: int, i: int) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for layer in range(layers + 1):  # layer 0 dense
        t = {f"model.layers.{layer}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
        if layer > 0:
            for x in range(e):
                for name, shape in (
                    ("gate_proj", (i, h)),
                    ("up_proj", (i, h)),
                    ("down_proj", (h, i)),
                ):
                    w = (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
                    t[f"model.layers.{layer}.mlp.experts.{x}.{name}.weight"] = w
        file = f"model-{layer + 1:05d}-of-{layers + 1:05d}.safetensors"
        save_file(t, os.path.join(path, file))
        weight_map.update(dict.fromkeys(t, file))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(
            {
                "hidden_size": h,
                "moe_intermediate_size": i,
                "num_experts": e,
                "num_experts_per_tok": 8,
                "num_hidden_layers": layers + 1,
            },
            f,
        )


def write_gbps(folder: str, size: int = 1 << 30) -> float:
    """Sequential write of `size` bytes to a new file in `folder`, fsync included (as the
    converter finishes every shard): the disk's bound on writing converted weights."""
    block = os.urandom(16 << 20)
    path = os.path.join(folder, "write-probe.bin")
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(size // len(block)):
            f.write(block)
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t
    os.remove(path)
    return size / seconds / 1e9


def read_gbps(folder: str) -> float:
    buf = memoryview(bytearray(16 << 20))
    n, t = 0, time.perf_counter()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with open(os.path.join(folder, name), "rb", buffering=0) as f:
                while r := f.readinto(buf):
                    n += r
    return n / (time.perf_counter() - t) / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--methods", nargs="+", default=["int8", "int4"])
    p.add_argument("--tp", type=int, default=2, help="--threadpool-count of the conversion")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dir", default=None, help="working folder (default: a temporary one)")
    p.add_argument("--json")
    p.add_argument("--markdown")
    a = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="kt-convert-bench-", dir=a.dir)
    try:
        src = os.path.join(work, "hf")
        os.makedirs(src)
        t = time.perf_counter()
        write_checkpoint(src, a.layers, a.experts, a.hidden, a.inter)
        size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
        print(
            f"checkpoint: {a.layers} MoE layers, {size / 1e9:.2f} GB bf16, written in "
            f"{time.perf_counter() - t:.1f} s",
            flush=True,
        )
        read_gbps(src)
        src_read = max(read_gbps(src) for _ in range(2))
        disk_write = write_gbps(work)
        base = subprocess.run([sys.executable, "-c", BASE], capture_output=True, text=True)
        base_rss = int(base.stdout) * 1024
        rows = []
        for method in a.methods:
            out = os.path.join(work, method)
            cmd = [
                sys.executable,
                "-c",
                PEAK,
                "-i",
                src,
                "-o",
                out,
                "--quant-method",
                method,
                "--threadpool-count",
                str(a.tp),
                "--cpuinfer-threads",
                str(a.threads),
                "-q",
            ]
            t = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - t
            if r.returncode != 0:
                print(r.stderr, file=sys.stderr)
                return 1
            peak = int(r.stdout.split("PEAK")[1]) * 1024 - base_rss
            written = sum(
                os.path.getsize(os.path.join(root, n))
                for root, _, names in os.walk(out)
                for n in names
            )
            summary = r.stdout.split("PEAK")[0].strip()
            seconds = float(summary.split(" in ")[1].split(" s:")[0])
            loads = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    LOAD,
                    out,
                    method,
                    str(a.tp),
                    str(a.layers),
                    str(a.experts),
                    str(a.hidden),
                    str(a.inter),
                ],
                capture_output=True,
                text=True,
            )
            if loads.returncode != 0:
                print(loads.stderr, file=sys.stderr)
                return 1
            load = json.loads(loads.stdout.strip().splitlines()[-1])
            row = {
                "method": method,
                "input_gb": size / 1e9,
                "convert_s": seconds,
                "convert_gbps": size / seconds / 1e9,
                "process_wall_s": wall,
                "peak_rss_mb": peak / 2**20,
                "input_read_gbps": src_read,
                "output_gb": written / 1e9,
                "output_write_gbps": written / seconds / 1e9,
                "disk_write_gbps": disk_write,
                "output_read1_gbps": load["read1_gbps"],
                "output_read2_gbps": load["read2_gbps"],
                "output_fresh2_gbps": load["fresh2_gbps"],
                "load_s": load["load_s"],
                "load_gbps": load["load_gbps"],
                "best_load_gbps": load["best_load_gbps"],
                "reload_s": load["reload_s"],
                "reload_gbps": load["reload_gbps"],
            }
            rows.append(row)
            print(f"{method}: {summary}", flush=True)
            print(
                f"  load per layer {', '.join(f'{x * 1e3:.0f}' for x in load['load_s'])} ms: "
                f"{load['load_gbps']:.2f} GB/s median vs page-cache read "
                f"{load['read1_gbps']:.2f} GB/s (1 thread), {load['read2_gbps']:.2f} (2); "
                f"again {', '.join(f'{x * 1e3:.0f}' for x in load['reload_s'])} ms",
                flush=True,
            )
            shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [
        f"Synthetic bf16 checkpoint: {a.layers} MoE layers of {a.experts} experts, "
        f"H={a.hidden}, I={a.inter} ({size / 1e9:.2f} GB), converted with "
        f"--threadpool-count {a.tp} --cpuinfer-threads {a.threads}; page-cache read of its "
        f"shards (1 thread, read()) {src_read:.2f} GB/s; sequential write to the same disk, "
        f"fsync included, {disk_write:.2f} GB/s.",
        "",
        "| method | convert s | GB/s of input | × page-cache read | output GB written, GB/s "
        "(× disk write) | converter peak RSS (beyond "
        "importing kt_kernel) | load per layer ms (median) | load GB/s | page-cache read of the "
        "output GB/s, 1 / 2 threads | load × the 1-thread read | load × the faster read | read "
        "into fresh memory (zeroed by the kernel, then copied: the bound of any copying load), "
        "2 threads, best of 3, GB/s | "
        "load × that | load again into reused memory: ms (median), GB/s, × the "
        "faster read |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rss = f"{r['peak_rss_mb']:.0f} MB"
        lines.append(
            f"| {r['method']} | {r['convert_s']:.2f} | {r['convert_gbps']:.2f} | "
            f"{r['convert_gbps'] / r['input_read_gbps']:.2f} | {r['output_gb']:.2f}, "
            f"{r['output_write_gbps']:.2f} "
            f"({r['output_write_gbps'] / r['disk_write_gbps']:.2f}×) | "
            f"{rss} | "
            f"{statistics.median(r['load_s']) * 1e3:.0f} | {r['load_gbps']:.2f} | "
            f"{r['output_read1_gbps']:.2f} / {r['output_read2_gbps']:.2f} | "
            f"{r['load_gbps'] / r['output_read1_gbps']:.2f} | "
            f"{r['load_gbps'] / max(r['output_read1_gbps'], r['output_read2_gbps']):.2f} | "
            f"{r['output_fresh2_gbps']:.2f} | {r['load_gbps'] / r['output_fresh2_gbps']:.2f} | "
            f"{statistics.median(r['reload_s']) * 1e3:.0f}, {r['reload_gbps']:.2f}, "
            f"{r['reload_gbps'] / max(r['output_read1_gbps'], r['output_read2_gbps']):.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
