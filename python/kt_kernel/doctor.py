"""``kt doctor``: what a user needs to know before serving, and what to fix.

Facts come from the extension (``cpu_info``, ``build_info``) and from Linux (``/sys``: memory per
NUMA node, transparent huge pages); :func:`diagnose` turns facts into problems, each with the
fix. The two steps are separate so tests can feed synthetic machines (two NUMA nodes, AMX
without permission, little memory) to :func:`diagnose`, and a fake ``/sys`` to :func:`collect`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

from . import _kt_core

GIB = 1 << 30

# The ISA features the kernels use, in the order a reader expects them.
ISA_FLAGS = (
    ("AVX2", "avx2"),
    ("FMA", "fma"),
    ("AVX-512F", "avx512f"),
    ("AVX-512BW", "avx512bw"),
    ("AVX-512 VNNI", "avx512_vnni"),
    ("AVX-512 VBMI", "avx512vbmi"),
    ("AVX-512 BF16", "avx512_bf16"),
    ("AVX-VNNI", "avx_vnni"),
    ("AMX-TILE", "amx_tile"),
    ("AMX-INT8", "amx_int8"),
    ("AMX-BF16", "amx_bf16"),
)

# The library the CUDA-stream path opens at first use (no CUDA at build time).
CUDA_LIBRARIES = ("libcuda.so.1",)


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument(
        "--threadpool-count",
        type=int,
        default=None,
        help="the threadpool_count you will serve with (checked against the NUMA nodes)",
    )
    parser.add_argument(
        "--model-bytes",
        type=float,
        default=None,
        help="bytes of CPU expert weights you will load (checked against free memory)",
    )
    # A fake /sys for tests.
    parser.add_argument("--sys-root", default="/sys", help=argparse.SUPPRESS)


def _node_memory(sys_root: Path) -> dict[int, dict[str, int]]:
    """Total and free bytes per NUMA node from ``node*/meminfo`` (empty when absent)."""
    nodes = {}
    for meminfo in sorted((sys_root / "devices/system/node").glob("node*/meminfo")):
        index = int(meminfo.parent.name[4:])
        values = {}
        for line in meminfo.read_text().splitlines():
            m = re.match(r"Node\s+\d+\s+(MemTotal|MemFree):\s+(\d+)\s*kB", line)
            if m:
                values[m.group(1)] = int(m.group(2)) * 1024
        if "MemTotal" in values:
            nodes[index] = {"total": values["MemTotal"], "free": values.get("MemFree", 0)}
    return nodes


def _system_memory() -> dict[str, int]:
    """Total and available bytes of the whole machine (``/proc/meminfo``)."""
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return {"total": out.get("MemTotal", 0), "free": out.get("MemAvailable", 0)}


def _thp(sys_root: Path) -> str | None:
    """The bracketed choice of ``transparent_hugepage/enabled`` (None when unknown)."""
    try:
        text = (sys_root / "kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else None


def _cuda() -> dict[str, str | None]:
    """The CUDA driver the stream path opens (``KT_KERNEL_CUDA_DRIVER`` or libcuda.so.1):
    ``cuLaunchHostFunc`` found, or None."""
    name = os.environ.get("KT_KERNEL_CUDA_DRIVER", CUDA_LIBRARIES[0])
    found, _message = _kt_core.cuda_driver_status()
    return {name: name if found else None}


def _torch() -> dict:
    try:
        import torch
    except ImportError:
        return {"version": None, "cuda_available": False}
    return {"version": torch.__version__, "cuda_available": bool(torch.cuda.is_available())}


def collect(sys_root: str | Path = "/sys") -> dict:
    """Facts about this machine and this build."""
    import kt_kernel

    from .__main__ import version_facts

    sys_root = Path(sys_root)
    info = kt_kernel.cpu_info()
    memory = _node_memory(sys_root)
    nodes = []
    for index, cores in info["numa_nodes"]:
        mem = memory.get(index)
        if mem is None and len(info["numa_nodes"]) == 1:
            mem = _system_memory()
        nodes.append({"node": index, "cores": cores, "memory": mem})
    return {
        "version": version_facts(),
        "cpu": {
            "brand": info["brand"],
            "vendor": info["vendor"],
            "variant": info["variant"],
            "detected_variant": info["detected_variant"],
            "flags": {name: bool(info["flags"].get(key)) for name, key in ISA_FLAGS},
            "amx_hardware": info["amx_hardware"],
            "amx_permission": info["amx_permission"],
        },
        "kernels": info["kernels"],
        "prefill_kernels": info["prefill_kernels"],
        "numa": nodes,
        "physical_cores": info["physical_cores"],
        "transparent_hugepages": _thp(sys_root),
        "cuda": _cuda(),
        "torch": _torch(),
    }


def diagnose(
    facts: dict, threadpool_count: int | None = None, model_bytes: float | None = None
) -> list[str]:
    """Problems in `facts` for serving with `threadpool_count` parts and `model_bytes` of CPU
    expert weights, each saying what to do."""
    problems = []
    cpu = facts["cpu"]
    if cpu["amx_hardware"] and not cpu["amx_permission"]:
        problems.append(
            "AMX tiles are present but Linux did not grant their use (arch_prctl "
            "ARCH_REQ_XCOMP_PERM): run a Linux kernel >= 5.16, or expect the AVX-512 kernels."
        )
    if not cpu["flags"]["AVX2"]:
        problems.append(
            "no AVX2: every method runs its scalar kernels, many times slower; serve on an "
            "x86-64 CPU with AVX2 and FMA."
        )
    if cpu["variant"] != cpu["detected_variant"]:
        problems.append(
            f"KT_KERNEL_CPU_VARIANT caps the kernels at {cpu['variant']} although the CPU allows "
            f"{cpu['detected_variant']}: unset it unless you mean to."
        )
    nodes = facts["numa"]
    if threadpool_count is not None and threadpool_count != len(nodes):
        problems.append(
            f"threadpool_count={threadpool_count} but this machine has {len(nodes)} NUMA "
            f"node(s): use threadpool_count={len(nodes)} so each part's experts live on its "
            "node's memory."
        )
    if model_bytes is not None:
        free = sum((n["memory"] or {}).get("free", 0) for n in nodes)
        if any(n["memory"] is None for n in nodes):
            problems.append("memory per NUMA node is unknown here: cannot check --model-bytes.")
        elif model_bytes > free:
            problems.append(
                f"{model_bytes / GIB:.1f} GiB of expert weights but only {free / GIB:.1f} GiB "
                "free: keep more experts on the GPU (gpu_experts_mask), use a smaller "
                "quantization, or free memory."
            )
        else:
            share = model_bytes / max(len(nodes), 1)
            for n in nodes:
                if share > n["memory"]["free"]:
                    problems.append(
                        f"node {n['node']} has {n['memory']['free'] / GIB:.1f} GiB free but "
                        f"its part of the experts needs {share / GIB:.1f} GiB: free memory on "
                        "that node or keep more experts on the GPU."
                    )
    if facts["transparent_hugepages"] == "never":
        problems.append(
            "transparent huge pages are off ('never'): expert weights ask for huge pages "
            "(madvise); set /sys/kernel/mm/transparent_hugepage/enabled to madvise."
        )
    return problems


def _gib(mem: dict | None) -> str:
    if not mem:
        return "memory unknown"
    return f"{mem['total'] / GIB:.1f} GiB ({mem['free'] / GIB:.1f} GiB free)"


def render(facts: dict, problems: list[str]) -> str:
    v, cpu = facts["version"], facts["cpu"]
    yes = [name for name, on in cpu["flags"].items() if on]
    no = [name for name, on in cpu["flags"].items() if not on]
    amx = "AMX usable" if cpu["amx_hardware"] and cpu["amx_permission"] else "AMX not usable"
    prefill = facts["prefill_kernels"]
    kernels = [
        f"         {m:<10} {k}" + (f" (prefill: {prefill[m]})" if m in prefill else "")
        for m, k in facts["kernels"].items()
        if k
    ]
    nodes = ", ".join(
        f"node{n['node']} {n['cores']} cores, {_gib(n['memory'])}" for n in facts["numa"]
    )
    cuda = [f"{name} (cuLaunchHostFunc) found" for name, path in facts["cuda"].items() if path]
    torch = facts["torch"]
    lines = [
        f"kt_kernel {v['package']} (kt-core {v['core']}, {v['profile']} build, "
        f"git {v['git_revision']})",
        f"CPU      {cpu['brand']} ({cpu['vendor']}); kernels for {cpu['variant']}",
        f"ISA      has {', '.join(yes) or 'none'}; lacks {', '.join(no) or 'nothing'}; {amx}",
        "Kernels  (decode, and prefill where it differs)",
        *kernels,
        f"NUMA     {len(facts['numa'])} node(s): {nodes}",
        f"THP      {facts['transparent_hugepages'] or 'unknown'}",
        "CUDA     "
        + (
            ", ".join(cuda)
            if cuda
            else "no CUDA driver found (CPU-only; the CUDA-stream path stays off)"
        ),
        f"torch    {torch['version'] or 'not installed'}"
        + (" (CUDA available)" if torch["cuda_available"] else ""),
    ]
    if problems:
        lines.append(f"{len(problems)} problem(s):")
        lines += [f"  ! {p}" for p in problems]
    else:
        lines.append("OK: nothing to fix.")
    return "\n".join(lines)


def run(args) -> int:
    if args.threadpool_count is not None and args.threadpool_count < 1:
        raise SystemExit(f"kt doctor: --threadpool-count must be >= 1, got {args.threadpool_count}")
    if args.model_bytes is not None and not args.model_bytes >= 0:
        raise SystemExit(f"kt doctor: --model-bytes must be >= 0, got {args.model_bytes}")
    facts = collect(args.sys_root)
    problems = diagnose(facts, args.threadpool_count, args.model_bytes)
    if args.json:
        print(json.dumps({**facts, "problems": problems}))
    else:
        print(render(facts, problems))
    return 1 if problems else 0
