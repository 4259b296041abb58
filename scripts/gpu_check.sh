#!/usr/bin/env bash
# The checks that need a lent GPU machine (no network, no Rust there; its python3 holds torch
# with CUDA; its host CPU has had AVX-512 and AMX), as one script. Prepare here, in the
# repository root:
#   bash scripts/wheel.sh                      # dist/kt_kernel-*.whl (abi3)
#   mkdir -p .whl && cp dist/kt_kernel-*.whl .whl/ && python3 -m pip download --no-deps \
#     --only-binary=:all: -d .whl gguf          # pure-Python test dependency missing there
#   mkdir -p .gpu-shared && cp -r ../shared/fixtures ../shared/limits .gpu-shared/
#   bash scripts/gpu_rust_bins.sh              # optional: kt-core's Rust tests, prebuilt
#   cargo build --release -p kt-benches --examples && mkdir -p .gpu-shared/bin &&
#     cp target/release/examples/byte_cycles .gpu-shared/bin/   # optional: the assists stage
#   mkdir -p .gpu-shared/bin && cc -O2 -pthread -o .gpu-shared/bin/cuda_signal_probe \
#     benches/cuda_signal_probe.c -ldl           # optional: stream signalling costs
# (.whl and .gpu-shared listed in .git/info/exclude), then run it there with both carried.
# KT_GPU_STAGES picks what runs, in this order (default: info rust cuda isa bench):
#   info   the machine and `kt info`
#   rust   kt-core's Rust test binaries (twin tests on this CPU's real AVX-512/AMX)
#   cuda   the real-CUDA tests
#   isa    the Python tests that skip below AVX-512/AMX (hardware tiles against the emulator,
#          every CPU variant, the bf16-dot panels, the probes)
#   stream the stream path against the real driver (and the signalling probe, if built)
#   assists the 8-bit fused decode kernels from cache with and without the E4M3 codes whose
#          fused values are fp32 denormals (Intel cores take a microcode assist per FMA
#          reading one: 150-180 ns per line against 3-4 on AMD Zen 3), the codes exact and
#          read as zero (KT_KERNEL_FP8_SUBNORMALS, zero by default on Intel), if byte_cycles
#          is built
#   panels prefill at 512 tokens with AMX off (KT_KERNEL_CPU_VARIANT=avx512_bf16), fp32-FMA
#          against bf16-dot kernels (KT_BF16_KERNEL): checks on Intel the calibration's choice
#          and the bf16-panel switch of the 15-bit formats, if the prefill example is built
#   probe  the yardstick against shared/limits/limits.c: the CPU topology, the reference under
#          several OpenMP placements and run lengths, our probes at 1 and 2 threads
#   suite  the whole Python suite (KT_GPU_SUITE_S seconds at most)
#   bench  `kt bench` at 2 threads, one method per process, while KT_GPU_BENCH_S lasts
#          (KT_GPU_BENCH_METHODS, KT_GPU_BENCH_TOKENS: default "1 512"); with
#          KT_GPU_BENCH_TOGETHER=1 every method in one process (LLAMAFILE as Q4_K and Q8_0)
# Logs go to $OUT (the device tool brings back at most 8 files) or /tmp/gpu-check.
set -u
OUT="${OUT:-/tmp/gpu-check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STAGES=" ${KT_GPU_STAGES:-info rust cuda isa bench} "
want() { [[ "$STAGES" == *" $1 "* ]]; }
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
[ -e ../shared ] || ln -s "$PWD/.gpu-shared" ../shared
if want info; then
  nvidia-smi -L
  lscpu | grep -E "^Model name|^CPU\(s\)|^Thread|^NUMA node\(s\)"
  grep -o -w -E "avx2|avx512f|avx512_vnni|avx512_bf16|avx_vnni|amx_tile|amx_int8|amx_bf16" \
    /proc/cpuinfo | sort | uniq -c
  python3 -m kt_kernel info 2>&1 | tee "$OUT/info.log" | head -40
fi
if want rust && [ -d .gpu-shared/rust ]; then
  echo "== kt-core Rust tests on this CPU"
  # The binaries look for their data at the path they were built in (the crate's tests/data,
  # ../../../shared/fixtures from the crate): make that path this checkout.
  built_in=$(cat .gpu-shared/rust/built_in)
  [ -e "$built_in" ] || { mkdir -p "$(dirname "$built_in")" && ln -s "$PWD" "$built_in"; }
  for t in .gpu-shared/rust/tests/*; do
    (cd "$built_in/crates/kt-core" && LD_LIBRARY_PATH="$PWD/.gpu-shared/rust/lib" \
      timeout 300 "$OLDPWD/$t" -q 2>&1) | tee -a "$OUT/rust-tests.log" | tail -4
  done
fi
if want cuda; then
  echo "== real-CUDA tests"
  (cd tests && timeout 180 python3 -m pytest -q -rs -p no:cacheprovider test_cuda_real.py \
    test_cuda_stream.py 2>&1) | tee "$OUT/cuda-tests.log" | tail -15
fi
if want isa; then
  # In parallel (8 workers: about 200 s on the H100 host, which a 200-s limit cut before
  # pytest's summary; serially over 200 s for the first 9, one of them 134 s), then the
  # probe test alone: it times the machine's peaks, which parallel workers disturb.
  # pytest-benchmark (installed there) refuses xdist under warnings-as-errors: off.
  # KT_GPU_ISA_K: a pytest -k expression, e.g. to leave out the 134-s row-count test.
  echo "== the tests that need AVX-512 or AMX"
  (cd tests && timeout "${KT_GPU_ISA_S:-300}" python3 -m pytest -q -rs -p no:cacheprovider \
    -p no:benchmark -n 8 --durations=8 -k "${KT_GPU_ISA_K:-}" test_amx.py \
    "test_bad_input.py::test_every_runnable_variant_and_two_subpools_end_to_end" \
    "test_fp8.py::test_every_panel_kernel_path_matches_the_dequantized_model" \
    "test_kgroup.py::test_every_panel_kernel_path_matches_the_dequantized_model" \
    "test_kgroup.py::test_cpu_info_names_the_decode_and_prefill_kernels" \
    "test_kgroup.py::test_backend_variables_select_the_avx2_kernels" 2>&1) |
    tee "$OUT/isa-tests.log" | tail -25
  (cd tests && timeout 120 python3 -m pytest -q -rs -p no:cacheprovider test_probe.py 2>&1) |
    tee "$OUT/probe-tests.log" | tail -8
fi
if want panels && [ -x .gpu-shared/bin/prefill ]; then
  echo "== prefill, 512 tokens, AMX off: fp32-FMA against bf16-dot kernels"
  KT_KERNEL_CPU_VARIANT=avx512_bf16 python3 -m kt_kernel info 2>&1 | grep -iE "bf16|prefill"
  for m in ${KT_GPU_PANEL_METHODS:-MXFP4 NVFP4 FP8}; do
    for kernel in fma bf16dot; do
      line=$(KT_KERNEL_CPU_VARIANT=avx512_bf16 KT_BF16_KERNEL=$kernel ITERS=6 \
        LD_LIBRARY_PATH="$PWD/.gpu-shared/rust/lib" timeout 60 .gpu-shared/bin/prefill "$m" 512 \
        2>/dev/null)
      echo "KT_BF16_KERNEL=$kernel: $line"
    done
  done 2>&1 | tee "$OUT/panels.log"
fi
if want probe && command -v gcc >/dev/null; then
  echo "== probe: topology, then limits.c and our probes (int8 and fp32 FMA, 2 threads)"
  {
    gcc --version | head -1
    lscpu -e=CPU,CORE,SOCKET,NODE,MAXMHZ | head -18
    for c in 0 1 8; do
      echo "cpu$c siblings: $(cat /sys/devices/system/cpu/cpu$c/topology/thread_siblings_list)"
    done
    gcc -O3 -march=native -fopenmp -o /tmp/kt_limits .gpu-shared/limits/limits.c
    echo "vpdpbusd in the reference binary: $(objdump -d /tmp/kt_limits | grep -c vpdpbusd)"
    for placement in "spread cores" "close cores" "unbound"; do
      for mode in --quick --quick ""; do
        read -r bind places <<<"$placement"
        if [ "$bind" = unbound ]; then
          line=$(/tmp/kt_limits $mode | grep -E "peak_(int8|fp32)" | grep -P "\t2\t" | tr '\n' ' ')
        else
          line=$(OMP_PROC_BIND=$bind OMP_PLACES=$places /tmp/kt_limits $mode |
            grep -E "peak_(int8|fp32)" | grep -P "\t2\t" | tr '\n' ' ')
        fi
        echo "reference [$placement ${mode:-full}]: $line"
      done
    done
    python3 - <<'PY'
from kt_kernel import _kt_core
for threads in (1, 2):
    engine = _kt_core.Engine([threads], [0], False)
    for _ in range(3):
        int8 = engine.measure_peak_gflops("int8", 300)
        fma = engine.measure_peak_gflops("fma", 300)
        print(f"ours [{threads} threads]: int8 {int8:.0f} GOP/s, fma {fma:.0f} GFLOP/s")
PY
  } 2>&1 | tee "$OUT/probe-diag.log"
  (cd tests && timeout 120 python3 -m pytest -q -rs -p no:cacheprovider \
    "test_probe.py::test_probes_agree_with_the_reference" 2>&1) | tee -a "$OUT/probe-diag.log" |
    tail -6
fi
if want stream; then
  echo "== stream path against the real driver"
  timeout 120 python3 benches/stream_overhead.py --real-gpu --steps 200 2>&1 |
    tee "$OUT/stream-real.log"
  if [ -x .gpu-shared/bin/cuda_signal_probe ]; then
    echo "== signalling a CPU thread from a stream (benches/cuda_signal_probe.c)"
    timeout 60 .gpu-shared/bin/cuda_signal_probe 200 200 8 2>&1 | tee "$OUT/signal-probe.log"
  fi
  echo "== stream path, stand-in driver, same machine"
  timeout 60 python3 benches/stream_overhead.py --steps 200 2>&1 | tee "$OUT/stream-fake.log"
fi
if want assists && [ -x .gpu-shared/bin/byte_cycles ]; then
  echo "== 8-bit fused decode from cache, without and with subnormal codes"
  export LD_LIBRARY_PATH="$PWD/.gpu-shared/rust/lib"
  for mode in exact zero; do
    for rows in 1 2; do
      for sub in 0 1; do
        line=$(KT_KERNEL_FP8_SUBNORMALS=$mode ROWS=$rows SUBNORMALS=$sub timeout 60 \
          .gpu-shared/bin/byte_cycles | tr '\n' ' ')
        echo "KT_KERNEL_FP8_SUBNORMALS=$mode ROWS=$rows SUBNORMALS=$sub: $line"
      done
    done
  done 2>&1 | tee "$OUT/assists.log"
fi
if want suite; then
  echo "== whole Python suite on this machine's CPU (${KT_GPU_SUITE_S:-200} s at most)"
  (cd tests && KT_SKIP_WHEEL_TEST=1 timeout "${KT_GPU_SUITE_S:-200}" python3 -m pytest -q -rs \
    -p no:cacheprovider -x . 2>&1) | tee "$OUT/suite.log" | tail -25
fi
if want bench; then
  # One method per process: the yardstick's 2 threads, the probes measured in each run.
  budget_end=$((SECONDS + ${KT_GPU_BENCH_S:-150}))
  if [ "${KT_GPU_BENCH_TOGETHER:-0}" = 1 ]; then
    echo "== kt bench, every method in one process, 2 threads"
    timeout $((budget_end - SECONDS)) python3 -m kt_kernel bench --threads 2 \
      --methods ${KT_GPU_BENCH_METHODS:-BF16 FP8 FP8_PERCHANNEL MXFP8 MXFP4 NVFP4 GPTQ_INT4 \
      RAWINT4 AMXINT8 AMXINT4 LLAMAFILE} --gguf-type Q4_K Q8_0 \
      --tokens ${KT_GPU_BENCH_TOKENS:-1 512} --layers 2 --no-torch 2>&1 |
      grep -vE "^\[#" | tee -a "$OUT/bench.log"
  else
    methods=${KT_GPU_BENCH_METHODS:-AMXINT4 MXFP4 BF16 FP8 GPTQ_INT4 NVFP4 MXFP8 AMXINT8}
  fi
  for m in ${methods:-}; do
    [ $((budget_end - SECONDS)) -gt 40 ] || break
    echo "== kt bench $m, 2 threads"
    timeout $((budget_end - SECONDS)) python3 -m kt_kernel bench --threads 2 --methods "$m" \
      --tokens ${KT_GPU_BENCH_TOKENS:-1 512} --layers 2 --no-torch 2>&1 |
      grep -E "^machine|^\| $m" | tee -a "$OUT/bench.log"
  done
fi
echo "== done in $((SECONDS - START)) s"
