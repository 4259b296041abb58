"""Soak figures (not part of the test run; numbers go to BENCHMARKS.md):

1. ``forwards``: 10^5 forwards of a small layer per method (1 to 4 tokens, cycled): resident
   memory growth after warm-up must stay below 1 MB.
2. ``idle``: three wrappers alive and idle for 10 s: process CPU time below 1% of one core.
3. ``load``: a converted (AMXINT8) Qwen3-30B-A3B-shaped layer set of at least 4 GB loaded in a
   fresh process: peak resident memory beyond the interpreter's, against the packed weights.
4. ``threads``: four Python threads driving four wrappers for 60 s: every output equal to the
   single-threaded one, no deadlock (a watchdog fails the run if a thread stalls).

    python benches/soak.py [--parts forwards idle load threads] [--forwards 100000]
        [--load-layers 7] [--seconds 60] [--dir DIR]

Exit status 1 if a limit is missed.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from convert_bench import write_checkpoint  # noqa: E402
from kt_kernel import KTMoEWrapper  # noqa: E402

METHODS = ["BF16", "AMXINT8", "AMXINT4", "FP8", "FP8_PERCHANNEL", "RAWINT4", "GPTQ_INT4",
           "MXFP4", "NVFP4", "MXFP8"]  # fmt: skip
E, K, H, I = 8, 2, 256, 256  # noqa: E741 (the MoE shape letters)


def rss_kib() -> int:
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def layer(method: str, layer_idx: int, seed: int = 0):
    w = KTMoEWrapper(layer_idx, E, K, H, I, None, 2, 1, "", 64, method=method)
    g = torch.Generator().manual_seed(seed)
    mats = [(torch.randn(*s, generator=g) * 0.05).to(torch.bfloat16)
            for s in ((E, I, H), (E, I, H), (E, H, I))]  # fmt: skip
    w.load_weights_from_tensors(*mats, torch.arange(E))
    return w


def inputs(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, K, generator=g)


def soak_forwards(n: int) -> bool:
    print(f"## {n} forwards per method (1-4 tokens cycled): resident memory growth after warm-up")
    print("| method | forwards | seconds | RSS growth KiB |")
    print("|---|---|---|---|")
    ok = True
    batches = [inputs(t, t) for t in (1, 2, 3, 4)]
    for idx, method in enumerate(METHODS):
        w = layer(method, idx)
        for j in range(2000):
            w.forward(*batches[j % 4])
        before = rss_kib()
        t = time.perf_counter()
        for j in range(n):
            w.forward(*batches[j % 4])
        dt = time.perf_counter() - t
        grown = rss_kib() - before
        ok &= grown < 1024
        print(f"| {method} | {n} | {dt:.1f} | {grown} |")
        del w
    return ok


def soak_idle(seconds: float = 10.0) -> bool:
    wrappers = [layer(m, 20 + n) for n, m in enumerate(("BF16", "AMXINT8", "FP8"))]
    for w in wrappers:
        w.forward(*inputs(2, 0))
    time.sleep(0.5)  # let the workers' spin-before-park run out
    c0, t0 = cpu_seconds(), time.perf_counter()
    time.sleep(seconds)
    used, wall = cpu_seconds() - c0, time.perf_counter() - t0
    share = used / wall
    print(f"## idle: three wrappers alive for {wall:.1f} s: process CPU {used * 1e3:.1f} ms "
          f"= {share:.3%} of one core (limit 1%)")  # fmt: skip
    return share < 0.01


LOAD = """
import sys, time
from kt_kernel import KTMoEWrapper
path, layers = sys.argv[1], int(sys.argv[2])
hwm = lambda: int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) * 1024
base = hwm()
t = time.perf_counter()
ws = []
for layer in range(1, layers + 1):
    w = KTMoEWrapper(layer, 128, 8, 2048, 768, None, 2, 1, path, 64, method="AMXINT8")
    w.load_weights()
    ws.append(w)
print(hwm() - base, time.perf_counter() - t)
"""


def soak_load(layers: int, work: Path) -> bool:
    ckpt, out = work / "bf16", work / "int8"
    if not out.exists():
        print(f"writing a {layers}-layer bf16 checkpoint and converting it to AMXINT8 ...")
        ckpt.mkdir(parents=True, exist_ok=True)
        write_checkpoint(str(ckpt), layers, 128, 2048, 768)
        args = ["-i", str(ckpt), "-o", str(out), "--quant-method", "int8",
                "--threadpool-count", "1", "-q"]  # fmt: skip
        subprocess.run([sys.executable, "-m", "kt_kernel.convert", *args], check=True)
        shutil.rmtree(ckpt)
    r = subprocess.run([sys.executable, "-c", LOAD, str(out), str(layers)],
                       capture_output=True, text=True, check=True)  # fmt: skip
    peak, seconds = r.stdout.split()
    peak = int(peak)
    # The packed weights: the converted files' bytes (int8 codes and row scales), which is
    # what the layers hold in memory.
    packed = sum(f.stat().st_size for f in out.rglob("*.safetensors"))
    ratio = peak / packed
    print(f"## load: {layers} converted S1 layers, {packed / 1e9:.2f} GB of converted files, in "
          f"{float(seconds):.1f} s: peak RSS beyond the interpreter {peak / 1e9:.2f} GB "
          f"= {ratio:.3f}x the packed weights (limit 1.1x)")  # fmt: skip
    return packed >= 4e9 and ratio <= 1.1


def soak_threads(seconds: float) -> bool:
    methods = ("BF16", "AMXINT8", "FP8", "MXFP4")
    wrappers = [layer(m, 40 + n, seed=n) for n, m in enumerate(methods)]
    cases = [inputs(t, 100 + t) for t in (1, 3, 7)]
    want = [[w.forward(*c).clone() for c in cases] for w in wrappers]
    counts, errors = [0] * len(wrappers), []
    last = [time.perf_counter()] * len(wrappers)
    stop = time.perf_counter() + seconds

    def drive(n: int) -> None:
        w = wrappers[n]
        j = 0
        while time.perf_counter() < stop:
            c = j % len(cases)
            out = w.forward(*cases[c])
            if not torch.equal(out, want[n][c]):
                errors.append(f"thread {n}, case {c}: output differs")
                return
            j += 1
            counts[n] = j
            last[n] = time.perf_counter()

    threads = [threading.Thread(target=drive, args=(n,), daemon=True) for n in range(4)]
    for t in threads:
        t.start()
    stalled = False
    while any(t.is_alive() for t in threads):
        time.sleep(1)
        if time.perf_counter() - min(last) > 30:
            stalled = True
            break
    print(f"## threads: four threads x four wrappers for {seconds:.0f} s: forwards {counts}, "
          f"mismatches {len(errors)}, stalled {stalled}")  # fmt: skip
    return not errors and not stalled


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="+", default=["forwards", "idle", "load", "threads"])
    p.add_argument("--forwards", type=int, default=100_000)
    p.add_argument("--load-layers", type=int, default=7)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--dir", default=None, help="working folder for the load part")
    args = p.parse_args()
    model = open("/proc/cpuinfo").read().split("model name")[1].split(":")[1].splitlines()[0]
    print(f"CPU: {model.strip()}")
    ok = True
    if "forwards" in args.parts:
        ok &= soak_forwards(args.forwards)
    if "idle" in args.parts:
        ok &= soak_idle()
    if "load" in args.parts:
        work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kt-soak-"))
        work.mkdir(parents=True, exist_ok=True)
        try:
            ok &= soak_load(args.load_layers, work)
        finally:
            if not args.dir:
                shutil.rmtree(work, ignore_errors=True)
    if "threads" in args.parts:
        ok &= soak_threads(args.seconds)
    print("all limits met" if ok else "A LIMIT WAS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
