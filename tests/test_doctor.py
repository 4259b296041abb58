"""`kt doctor`: facts from this machine, problems from synthetic ones (two NUMA nodes, AMX
without permission, little memory, huge pages off), and a fake /sys."""

import copy
import json
import subprocess
import sys

from kt_kernel import doctor

GIB = 1 << 30


def run_cli(*args):
    r = subprocess.run(
        [sys.executable, "-m", "kt_kernel", "doctor", *args], capture_output=True, text=True
    )
    assert r.returncode in (0, 1), r.stderr
    return r


def test_json_reports_this_machine_and_exits_by_its_problems():
    r = run_cli("--json")
    facts = json.loads(r.stdout)
    for key in ("version", "cpu", "kernels", "prefill_kernels", "numa", "cuda", "torch"):
        assert key in facts, key
    assert facts["numa"] and all(n["cores"] >= 1 for n in facts["numa"])
    assert set(facts["cpu"]["flags"]) >= {"AVX2", "AVX-512F", "AVX-512 VNNI", "AMX-TILE"}
    assert "BF16" in facts["kernels"] and "RAWINT4" in facts["prefill_kernels"]
    assert r.returncode == (1 if facts["problems"] else 0)


def test_text_names_each_section_and_the_verdict():
    r = run_cli()
    for head in ("CPU", "ISA", "Kernels", "NUMA", "THP", "CUDA", "torch"):
        assert any(line.startswith(head) for line in r.stdout.splitlines()), head
    assert ("OK: nothing to fix." in r.stdout) == (r.returncode == 0)


def synthetic_two_nodes(free0, free1):
    facts = copy.deepcopy(doctor.collect())
    facts["cpu"]["variant"] = facts["cpu"]["detected_variant"]
    facts["cpu"]["flags"]["AVX2"] = True
    facts["transparent_hugepages"] = "madvise"
    facts["numa"] = [
        {"node": 0, "cores": 4, "memory": {"total": 64 * GIB, "free": free0}},
        {"node": 1, "cores": 4, "memory": {"total": 64 * GIB, "free": free1}},
    ]
    return facts


def test_problems_of_synthetic_machines_point_at_fixes():
    facts = synthetic_two_nodes(40 * GIB, 40 * GIB)
    assert doctor.diagnose(facts, threadpool_count=2, model_bytes=30 * GIB) == []
    (p,) = doctor.diagnose(facts, threadpool_count=1)
    assert "threadpool_count=2" in p
    (p,) = doctor.diagnose(facts, model_bytes=100 * GIB)
    assert "100.0 GiB" in p and "80.0 GiB free" in p and "gpu_experts_mask" in p
    # Enough in all, not on node 1 for its half.
    (p,) = doctor.diagnose(synthetic_two_nodes(40 * GIB, 5 * GIB), model_bytes=30 * GIB)
    assert p.startswith("node 1 has 5.0 GiB free")
    amx = copy.deepcopy(facts)
    amx["cpu"]["amx_hardware"], amx["cpu"]["amx_permission"] = True, False
    (p,) = doctor.diagnose(amx)
    assert "AMX" in p and "5.16" in p
    amx["cpu"]["amx_permission"] = True
    assert doctor.diagnose(amx) == []
    # A CPU that allows AVX-512 run at the AVX2 level (whatever this machine detects).
    capped = copy.deepcopy(facts)
    capped["cpu"]["detected_variant"], capped["cpu"]["variant"] = "avx512", "avx2"
    assert "KT_KERNEL_CPU_VARIANT" in doctor.diagnose(capped)[0]
    off = copy.deepcopy(facts)
    off["transparent_hugepages"] = "never"
    assert "huge pages" in doctor.diagnose(off)[0]


def test_memory_and_huge_pages_come_from_sys(tmp_path):
    node = tmp_path / "devices/system/node/node0"
    node.mkdir(parents=True)
    (node / "meminfo").write_text(
        "Node 0 MemTotal:        2097152 kB\nNode 0 MemFree:          524288 kB\n"
    )
    thp = tmp_path / "kernel/mm/transparent_hugepage"
    thp.mkdir(parents=True)
    (thp / "enabled").write_text("always madvise [never]\n")
    facts = doctor.collect(tmp_path)
    assert facts["transparent_hugepages"] == "never"
    node0 = [n for n in facts["numa"] if n["node"] == 0][0]
    assert node0["memory"] == {"total": 2 * GIB, "free": GIB // 2}
    r = run_cli("--sys-root", str(tmp_path), "--model-bytes", str(GIB))
    assert r.returncode == 1 and "huge pages" in r.stdout and "1.0 GiB of expert" in r.stdout


def test_impossible_plans_are_refused_with_a_message():
    for args, word in (
        (("--threadpool-count", "0"), "threadpool"),
        (("--model-bytes", "-1"), "model"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "kt_kernel", "doctor", *args], capture_output=True, text=True
        )
        assert r.returncode == 1 and f"--{word}" in r.stderr and "Traceback" not in r.stderr
