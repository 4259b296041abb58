#!/usr/bin/env bash
# The main job: set-up, then the layer benchmark on built-in synthetic weights
# (Qwen3-30B-A3B shape by default). Extra arguments go to `python -m kt_kernel bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${KT_VENV:-$HOME/.cache/kt-kernel/venv}"
exec "$VENV/bin/python" -m kt_kernel bench "$@"
