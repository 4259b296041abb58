"""The yardstick: our in-process probes (DRAM read bandwidth, fp32 FMA, int8 multiply-add and
bf16 dot peaks) use the widest instructions the CPU has and agree with the project's reference
program (`shared/limits/limits.c`, built with gcc -march=native) measured in the same minute:
the peaks within 5%, DRAM within 15% (this VM's DRAM noise; see the test)."""

import os
import shutil
import statistics
import subprocess
from pathlib import Path

import kt_kernel
import pytest
from kt_kernel import _kt_core

LIMITS_C = Path(os.environ.get("KT_LIMITS_DIR", Path(__file__).parents[2] / "shared" / "limits"))
LIMITS_C = LIMITS_C / "limits.c"


@pytest.fixture(scope="module")
def engine():
    return _kt_core.Engine([2], [0], False)


def test_probes_name_the_widest_instructions_of_this_cpu():
    info = kt_kernel.cpu_info()
    flags, probes = info["flags"], info["probes"]
    if flags.get("avx512f"):
        assert probes["read"] == "avx512" and probes["fma"] == "avx512"
    elif flags.get("avx2"):
        assert probes["read"] == "avx2" and probes["fma"] == "avx2"
    if flags.get("avx512_vnni") and flags.get("avx512bw"):
        assert probes["int8"] == "avx512-vnni"
    if flags.get("avx512_bf16"):
        assert probes["bf16"] == "avx512-bf16"
    amx = "amx-int8" if info["amx_permission"] else None
    assert probes["amx_int8"] == amx and probes["amx_bf16"] == (amx and "amx-bf16")
    assert set(probes) == {"read", "fma", "int8", "bf16", "amx_int8", "amx_bf16"}


def test_unknown_peak_kind_and_tiny_buffers_are_refused(engine):
    with pytest.raises(ValueError, match="unknown peak kind"):
        engine.measure_peak_gflops("fp64", 10)
    with pytest.raises(ValueError, match="too small"):
        engine.measure_read_bandwidth(64, 1)


def test_peaks_are_positive_where_the_cpu_has_the_instructions(engine):
    probes = kt_kernel.cpu_info()["probes"]
    for kind in ("fma", "int8", "bf16", "amx_int8", "amx_bf16"):
        value = engine.measure_peak_gflops(kind, 50)
        if probes[kind] is None:
            assert value is None
        else:
            assert value > 1.0, (kind, value)


def _reference(binary: str) -> dict[str, float]:
    """limits.c --quick: 2-thread figures by name (each the median of 5 repetitions)."""
    env = dict(os.environ, OMP_PROC_BIND="spread", OMP_PLACES="cores")
    out = subprocess.run([binary, "--quick"], capture_output=True, text=True, env=env, check=True)
    figures = {}
    for line in out.stdout.splitlines():
        name, threads, value, _unit = line.split("\t")
        if threads == "2":
            figures[name.removesuffix("_avx512").removesuffix("_avx2")] = float(value)
    return figures


def _ours(engine) -> dict[str, float]:
    # Median of five single passes over 512 MiB in the pages a plain allocation gets, as the
    # reference's --quick DRAM figure (the benchmark's own figure uses huge pages, as the
    # weights do; on a VM that reads 10-20% faster).
    passes = (engine.measure_read_bandwidth(512 << 20, 1, huge_pages=False) for _ in range(5))
    dram = statistics.median(passes)
    figures = {"dram_read": dram}
    for kind, name in (("fma", "peak_fp32_fma"), ("int8", "peak_int8_madd")):
        figures[name] = engine.measure_peak_gflops(kind, 300)
    bf16 = engine.measure_peak_gflops("bf16", 300)
    if bf16 is not None:
        figures["peak_bf16_dot"] = bf16
    return figures


@pytest.mark.skipif(
    not LIMITS_C.exists() or shutil.which("gcc") is None,
    reason="the reference limits.c or gcc is not here",
)
def test_probes_agree_with_the_reference(engine, tmp_path):
    binary = str(tmp_path / "limits")
    build = ["gcc", "-O3", "-march=native", "-fopenmp", "-o", binary, str(LIMITS_C)]
    subprocess.run(build, check=True)
    # The compute peaks are steady: within 5%. This shared VM's DRAM rate moves by 0.7-1.25x
    # between back-to-back runs of the same program (measured), so DRAM must agree within 15%
    # in at least one of six back-to-back attempts: a systematic gap like the old narrow read
    # loop's 25% fails every attempt, a neighbour's burst only some.
    tolerance = {"dram_read": 0.15}
    ratios: dict[str, list[float]] = {}

    def agrees(name):
        return any(abs(r - 1) <= tolerance.get(name, 0.05) for r in ratios[name])

    flags = kt_kernel.cpu_info()["flags"]
    # Without VNNI the reference's int8 loop (vpmaddubsw + vpmaddwd + vpaddd, one asm barrier
    # per iteration) compiles to one multiply shared by its 12 chains and spilled adds (gcc 12
    # -O3, read off its assembly on an AMD Zen 3), so it times adds and stores, not the
    # multiplies; ours times the multiplies (6db9f9e). There the int8 figures cannot agree by
    # construction and are not compared.
    int8_comparable = flags["avx512_vnni"] or flags["avx_vnni"]
    for _ in range(6):
        ours, ref = _ours(engine), _reference(binary)
        if not int8_comparable:
            ours.pop("peak_int8_madd")
        for name, value in ours.items():
            if name in ref:
                ratios.setdefault(name, []).append(value / ref[name])
        if all(agrees(name) for name in ratios):
            break
    assert {"dram_read", "peak_fp32_fma"} | (
        {"peak_int8_madd"} if int8_comparable else set()
    ) <= set(ratios)
    for name, rs in ratios.items():
        assert agrees(name), (name, [round(r, 3) for r in rs])


def test_amx_tile_peaks_exceed_the_vector_peaks_where_amx_runs(engine):
    """The tile unit's yardstick: on an AMX CPU one tdpbusd does 16 times the multiply-adds of
    a 512-bit vpdpbusd at a sixteenth of the rate, so its peak must be well above the vector
    one (Sapphire/Emerald Rapids: about 4x for int8, 8x for bf16)."""
    if not kt_kernel.cpu_info()["amx_permission"]:
        pytest.skip("no AMX on this CPU (or no Linux permission)")
    amx_int8 = engine.measure_peak_gflops("amx_int8", 200)
    amx_bf16 = engine.measure_peak_gflops("amx_bf16", 200)
    assert amx_int8 > 2 * engine.measure_peak_gflops("int8", 200)
    assert amx_bf16 > 2 * engine.measure_peak_gflops("bf16", 200)
