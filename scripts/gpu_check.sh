#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one script for a lent GPU machine (no network, no Rust
# there; its python3 holds torch with CUDA). Prepare here, in the repository root:
#   bash scripts/wheel.sh                      # dist/kt_kernel-*.whl (abi3)
#   mkdir -p .whl && cp dist/kt_kernel-*.whl .whl/ && python3 -m pip download --no-deps \
#     --only-binary=:all: -d .whl gguf          # pure-Python test dependency missing there
#   mkdir -p .gpu-shared && cp -r ../shared/fixtures ../shared/limits .gpu-shared/
#   mkdir -p .gpu-shared/bin && cc -O2 -pthread -o .gpu-shared/bin/cuda_signal_probe \
#     benches/cuda_signal_probe.c -ldl           # optional: stream signalling costs
# (.whl and .gpu-shared listed in .git/info/exclude), then run it there with both carried.
# Prints the machine, runs the real-CUDA tests, times the stream path against the real driver,
# then runs the whole Python suite and a short layer benchmark on that machine's CPU.
# Logs go to $OUT (the device tool brings them back) or /tmp/gpu-check.
set -u
OUT="${OUT:-/tmp/gpu-check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L
lscpu | grep -E "^Model name|^CPU\(s\)|^Thread|^NUMA node\(s\)"
grep -o -w -E "avx2|avx512f|avx512_vnni|avx512_bf16|amx_tile|amx_int8|amx_bf16" /proc/cpuinfo |
  sort | uniq -c
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
[ -e ../shared ] || ln -s "$PWD/.gpu-shared" ../shared
python3 -m kt_kernel info 2>&1 | tee "$OUT/info.log" | head -30
echo "== real-CUDA tests"
(cd tests && timeout 180 python3 -m pytest -q -rs -p no:cacheprovider test_cuda_real.py \
  test_cuda_stream.py 2>&1) | tee "$OUT/cuda-tests.log" | tail -15
echo "== stream path against the real driver"
timeout 120 python3 benches/stream_overhead.py --real-gpu --steps 200 2>&1 |
  tee "$OUT/stream-real.log"
if [ -x .gpu-shared/bin/cuda_signal_probe ]; then
  echo "== signalling a CPU thread from a stream (benches/cuda_signal_probe.c)"
  timeout 60 .gpu-shared/bin/cuda_signal_probe 200 200 8 2>&1 | tee "$OUT/signal-probe.log"
fi
echo "== stream path, stand-in driver, same machine"
timeout 60 python3 benches/stream_overhead.py --steps 200 2>&1 | tee "$OUT/stream-fake.log"
echo "== whole Python suite on this machine's CPU (${KT_GPU_SUITE_S:-200} s at most)"
(cd tests && KT_SKIP_WHEEL_TEST=1 timeout "${KT_GPU_SUITE_S:-200}" python3 -m pytest -q -rs \
  -p no:cacheprovider -x . 2>&1) | tee "$OUT/suite.log" | tail -25
echo "== layer benchmark, all threads of this machine"
timeout "${KT_GPU_BENCH_S:-90}" python3 -m kt_kernel bench --methods BF16 AMXINT4 FP8 \
  --tokens 1 4 512 --layers 2 --markdown "$OUT/bench.md" 2>&1 | tail -20
