#!/usr/bin/env bash
# Create (or refresh) a separate virtualenv holding the ORIGINAL kt-kernel
# from PyPI, so benches/compare_original.py can measure it side by side with
# our reimplementation without either install shadowing the other.
#
# Idempotent: re-running only installs what is missing.
#
#   KT_ORIG_VENV      venv path   (default /root/.cache/kt-kernel/orig-venv)
#   KT_ORIG_VERSION   kt-kernel version to install (default 0.7.2)
#   KT_ORIG_TORCH     torch requirement (default torch==2.9.1, the exact pin
#                     in kt-kernel 0.7.2's metadata)
#   PYTHON            interpreter used to create the venv (default python3)
set -euo pipefail

VENV="${KT_ORIG_VENV:-/root/.cache/kt-kernel/orig-venv}"
VERSION="${KT_ORIG_VERSION:-0.7.2}"
TORCH_REQ="${KT_ORIG_TORCH:-torch==2.9.1}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating venv $VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"

have() { "$VPY" -m pip show "$1" >/dev/null 2>&1; }

# Runtime deps the original imports at `import kt_kernel` time (experts ->
# utils.loader pulls numpy, safetensors and gguf). typer/rich/httpx are only
# for its CLI and are deliberately left out.
missing=()
have torch || missing+=("$TORCH_REQ")
for pkg in numpy safetensors gguf; do
    have "$pkg" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "[setup] installing: ${missing[*]}"
    "$VPY" -m pip install "${missing[@]}"
fi

# --no-deps: the wheel pins torch and pulls sglang-related extras we do not
# need; the deps above are what its inference path actually imports.
# `|| true`: pip show exits 1 when absent, which pipefail would make fatal.
installed="$("$VPY" -m pip show kt-kernel 2>/dev/null | sed -n 's/^Version: //p' || true)"
if [ "$installed" != "$VERSION" ]; then
    echo "[setup] installing kt-kernel==$VERSION (no deps)"
    "$VPY" -m pip install --no-deps "kt-kernel==$VERSION"
fi

# Smoke check: import the original with the CPU-only settings the bench uses.
KT_FORCE_SYNC_SUBMIT=1 "$VPY" - <<'EOF'
import kt_kernel
import torch

print(
    f"[setup] ok: kt_kernel {kt_kernel.__version__} "
    f"variant={kt_kernel.__cpu_variant__} torch={torch.__version__}"
)
EOF
