#!/usr/bin/env bash
# Same-run A/B of whole layers: the package at BASE_REV (default fe90771, the last commit before
# the format restructure) against the working tree, alternating rounds in one run.
#   bash scripts/ab_bench.sh [BASE_REV] [-- extra kt bench arguments]
# Writes bench-results/ab.md. Run nothing else heavy meanwhile: the machine has 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE="${1:-fe90771}"
shift || true
bash scripts/setup.sh
VENV="${KT_VENV:-$HOME/.cache/kt-kernel/venv}"
WORK="${KT_AB_DIR:-$HOME/.cache/kt-kernel/ab}"
OUT=bench-results
mkdir -p "$OUT" "$WORK"
rm -rf "$WORK/base" "$WORK/new" "$WORK/base-src"
git worktree prune
git worktree add --detach "$WORK/base-src" "$BASE" >/dev/null
echo "[ab] building $BASE"
CARGO_TARGET_DIR="$WORK/target-base" "$VENV/bin/python" -m pip install -q --no-deps \
  --no-build-isolation --target "$WORK/base" "$WORK/base-src"
git worktree remove --force "$WORK/base-src"
echo "[ab] building the working tree"
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation --target "$WORK/new" .
echo "[ab] alternating rounds"
"$VENV/bin/python" benches/ab_compare.py --a "$WORK/base" --b "$WORK/new" \
  --a-name "$BASE" --b-name "$(git rev-parse --short HEAD)+tree" --rounds "${KT_AB_ROUNDS:-5}" \
  --markdown "$OUT/ab.md" --json "$OUT/ab.json" -- \
  --methods BF16 AMXINT8 AMXINT4 LLAMAFILE --gguf-type Q4_K Q8_0 --tokens 1 512 "$@"
