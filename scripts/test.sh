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
echo "[test] pytest"
# Run from tests/ so the installed package (not the source tree) is imported.
"$VENV/bin/python" -m pytest -q tests
