#!/usr/bin/env bash
# Every test: set-up, Rust style gates, cargo tests (all kernels vs their scalar twins, pool,
# engine, MoE layer), then the Python suite against the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${KT_VENV:-$HOME/.cache/kt-kernel/venv}"
echo "[test] cargo fmt / clippy"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
echo "[test] module layering"
python3 scripts/check_module_cycles.py
echo "[test] ruff"
"$VENV/bin/ruff" check python tests benches scripts examples
"$VENV/bin/ruff" format --check python tests benches scripts examples
echo "[test] cargo test"
cargo test --workspace
if command -v cargo-fuzz >/dev/null && rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  # A short coverage-guided run of every parser target (fuzz/README.md); a crash fails.
  echo "[test] cargo fuzz (30 s per target)"
  (cd fuzz && for t in $(cargo +nightly fuzz list); do
    mkdir -p "work/$t"
    if ! cargo +nightly fuzz run -O "$t" "work/$t" "corpus/$t" -- -max_total_time=30 \
        -rss_limit_mb=4096 -timeout=10 >"work/$t.log" 2>&1; then
      tail -40 "work/$t.log"
      echo "[test] fuzz target $t failed: the input is in fuzz/artifacts/$t (copy it to fuzz/regressions/$t)"
      exit 1
    fi
    echo "$t: $(grep -E '^#[0-9]+[[:space:]]+DONE' "work/$t.log" | cut -c1-80)"
  done)
else
  echo "[test] no cargo-fuzz or nightly toolchain: the fuzz corpora run in cargo test only"
fi
echo "[test] pytest"
# Run from tests/ so the installed package (not the source tree) is imported.
"$VENV/bin/python" -m pytest -q tests
# The layers' numbers at every ISA level below this CPU's (KT_KERNEL_CPU_VARIANT caps it): the
# kernels' twin tests cover each level's kernels, these the dispatch around them (which kernel
# takes how many rows, decoded panels or integer sums) that users of smaller CPUs run.
detected=$(cd tests && "$VENV/bin/python" -c \
  "import kt_kernel; print(kt_kernel.cpu_info()['detected_variant'])")
for variant in generic avx2 avx512_base avx512_vnni avx512_vbmi avx512_bf16; do
  [ "$variant" = "$detected" ] && break
  echo "[test] layer tests at KT_KERNEL_CPU_VARIANT=$variant"
  (cd tests && KT_KERNEL_CPU_VARIANT=$variant "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    test_forward.py test_amxint8.py test_kgroup.py test_fp8.py test_llamafile.py test_fixtures.py \
    test_ggml_formats.py)
done
