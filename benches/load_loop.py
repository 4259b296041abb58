"""Load one converted layer again and again in one process, beside the page-cache read of its
shard, to see the steady-state cost of a load (the first loads of a process pay this VM's
first touch of fresh memory).

    python benches/load_loop.py FOLDER --method AMXINT4 [--layer 1] [--loads 8]

FOLDER is a ``python -m kt_kernel.convert`` output (merged layout) of a model with the shape
given by --experts/--hidden/--inter (default: Qwen3-30B-A3B's experts).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from kt_kernel import KTMoEWrapper


def read_gbps(files: list[str], threads: int) -> tuple[float, int]:
    """Page-cache read into a reused 1 MiB buffer per thread; each file is cut into one
    contiguous range per thread (a layer's merged shard is a single file)."""

    def read(part: int) -> int:
        buf, n = bytearray(1 << 20), 0
        for name in files:
            size = os.path.getsize(name)
            lo, hi = size * part // threads, size * (part + 1) // threads
            fd = os.open(name, os.O_RDONLY)
            try:
                while lo < hi:
                    r = os.preadv(fd, [memoryview(buf)[: min(len(buf), hi - lo)]], lo)
                    if r == 0:
                        break
                    lo, n = lo + r, n + r
            finally:
                os.close(fd)
        return n

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        n = sum(ex.map(read, range(threads)))
    return n / (time.perf_counter() - t) / 1e9, n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--method", default="AMXINT4", choices=["AMXINT8", "AMXINT4"])
    p.add_argument("--layer", type=int, default=1)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--tp", type=int, default=2, help="threadpool_count the folder was made for")
    p.add_argument("--loads", type=int, default=8)
    a = p.parse_args()
    prefix = f"blk.{a.layer}."
    # The shards holding the layer: the merged layout writes one per layer.
    from safetensors import safe_open

    files = []
    for name in sorted(os.listdir(a.folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(a.folder, name), "np") as f:
                if any(k.startswith(prefix) for k in f.keys()):
                    files.append(os.path.join(a.folder, name))
    read_gbps(files, 1)
    read1 = max(read_gbps(files, 1)[0] for _ in range(3))
    read2, size = max(read_gbps(files, 2) for _ in range(3))
    times = []
    for _ in range(a.loads):
        w = KTMoEWrapper(
            layer_idx=a.layer, num_experts=a.experts, num_experts_per_tok=8,
            hidden_size=a.hidden, moe_intermediate_size=a.inter, gpu_experts_mask=None,
            cpuinfer_threads=2, threadpool_count=a.tp, weight_path=a.folder,
            chunked_prefill_size=512, method=a.method,
        )  # fmt: skip
        t = time.perf_counter()
        w.load_weights(torch.arange(a.experts))
        times.append(time.perf_counter() - t)
        del w
    steady = statistics.median(times[1:])
    gbps = size / steady / 1e9
    print(
        f"{a.method}: page-cache read {read1:.2f} GB/s (1 thread), {read2:.2f} (2); loads "
        f"{', '.join(f'{x * 1e3:.0f}' for x in times)} ms; median after the first "
        f"{steady * 1e3:.1f} ms = {gbps:.2f} GB/s = {gbps / read1:.2f} x the 1-thread read, "
        f"{gbps / max(read1, read2):.2f} x the faster"
    )


if __name__ == "__main__":
    main()
