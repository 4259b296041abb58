#!/usr/bin/env bash
# One-time (idempotent) set-up on a fresh Debian machine: system libraries, a virtual
# environment with the Python dependencies, and kt-kernel built and installed into it.
# The venv lives outside the work tree so repeated runs (and CI on the same machine) reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
for pkg in libhwloc-dev pkg-config libudev-dev; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if ((${#need[@]})); then
  echo "[setup] installing system packages: ${need[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

VENV="${KT_VENV:-$HOME/.cache/kt-kernel/venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import numpy, torch, safetensors, gguf, pytest, maturin, ruff, transformers" 2>/dev/null; then
  echo "[setup] installing Python dependencies (torch is large)"
  # transformers: the end-to-end tests build tiny Mixtral / Qwen3-MoE models with it.
  "$PY" -m pip install -q numpy torch safetensors gguf pytest maturin ruff transformers
fi
echo "[setup] building and installing kt-kernel (release)"
"$PY" -m pip install -q --no-build-isolation --no-deps --force-reinstall .
echo "[setup] ready: $PY"
